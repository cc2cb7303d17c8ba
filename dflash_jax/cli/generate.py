"""`python -m dflash_jax generate`: speculative decoding with a target model and a DFlash drafter.

--target is an HF folder (config.json + safetensors; Qwen3 or Llama); --drafter a drafter GGUF
or HF folder, whose target_layers must fit the target (it borrows the target's embedding and
LM head). Tokens stream as they are committed: detokenized when the target folder has a
tokenizer.json (read with the `tokenizers` package), else as ids. At the end: tau (the mean
number of tokens committed per round: the accepted drafts plus the target's own token), the
histogram of accepted drafts per round, and tokens/s. Bad arguments get one line, exit 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from dflash_jax.cli import CLIError, float_in, int_in

def _ids(text: str) -> list[int]:
  try:
    ids = [int(t) for t in text.replace(" ", "").split(",") if t]
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
  if not ids or min(ids) < 0:
    raise argparse.ArgumentTypeError(f"must be one or more ids >= 0, got {text!r}")
  return ids


def register(sub) -> None:
  g = sub.add_parser("generate", help="speculative decoding: a target folder + a DFlash drafter",
                     description=__doc__.split("\n\n")[0])
  g.add_argument("--target", required=True, help="HF target folder (config.json + safetensors)")
  g.add_argument("--drafter", required=True, help="drafter GGUF file or HF folder")
  src = g.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="prompt text (needs TARGET/tokenizer.json)")
  src.add_argument("--prompt-ids", type=_ids, help="prompt token ids, comma-separated")
  g.add_argument("--max-new", type=int_in(1), default=128, help="tokens to generate")
  g.add_argument("--temperature", type=float_in(0, 100), default=0.0, help="0 = greedy")
  g.add_argument("--top-k", type=int_in(0), default=0, help="0 = off")
  g.add_argument("--top-p", type=float_in(0, 1, lo_open=True), default=1.0, help="1 = off")
  g.add_argument("--proposals", choices=("greedy", "sampled"), default="greedy",
                 help="under sampling: drafts are the drafter's argmax, or samples of its "
                      "softmax(logits / T)")
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--block", type=int_in(2), default=None,
                 help="rows verified per round (the drafter's block_size by default)")
  g.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                 help="target weights (default: bf16 when stored bf16, else fp32)")
  g.add_argument("--drafter-dtype", choices=("fp32", "bf16", "fp8", "q8_0"), default=None,
                 help="drafter weights (default: the target's dtype)")
  g.add_argument("--cache-dtype", choices=("fp32", "bf16"), default=None,
                 help="target K/V cache and drafter ring (default: the target's dtype)")
  ring = g.add_mutually_exclusive_group()
  ring.add_argument("--window", type=int_in(1), default=None,
                    help="ring size of the drafter's sliding layers (default: the checkpoint's "
                         "window); full-attention layers keep every position")
  ring.add_argument("--draft-window", type=int_in(1), default=None,
                    help="run every drafter layer, full-attention ones included, in a ring of "
                         "this many slots (the engines' draft-window option for long contexts: "
                         "full layers then see only the last N positions; default: off)")
  g.add_argument("--capacity", type=int_in(1), default=None,
                 help="target cache slots (default: prompt + max-new + block)")
  g.add_argument("--impl", choices=("pallas", "xla"), default="pallas",
                 help="the drafter's and the target's kernels (pallas: the batch-invariant "
                      "target, whose greedy output equals target-only decoding in bf16 too)")
  g.add_argument("--eos", type=_ids, default=None,
                 help="end-of-sequence ids, comma-separated (default: the target config's)")
  g.add_argument("--sync-every", type=int_in(1), default=8,
                 help="rounds per device call between host syncs (streaming granularity)")
  g.add_argument("--compare", action="store_true",
                 help="also decode with the target alone and report the speedup")
  g.set_defaults(run=run)


def run(args) -> int:
  return _generate(args)


def _load(args):
  import jax.numpy as jnp

  import dflash_jax as dfj
  from dflash_jax.models import load_target

  try:
    tcfg, tparams = load_target(args.target, dtype=args.dtype)
  except (ValueError, OSError) as e:
    raise CLIError(f"argument --target: {e}") from None
  try:
    dcfg, w = dfj.load_drafter(args.drafter)
  except (ValueError, OSError) as e:
    raise CLIError(f"argument --drafter: {e}") from None
  if args.draft_window is not None:
    dcfg = dcfg.with_draft_window(args.draft_window)
  if dcfg.n_embd != tcfg.hidden_size:
    raise CLIError(f"argument --drafter: its n_embd {dcfg.n_embd} != the target's "
                        f"hidden_size {tcfg.hidden_size}")
  wdtype = "bf16" if tparams.embed.dtype == jnp.bfloat16 else "fp32"
  try:   # the target's embedding and LM head stay on the device (shared when dtypes agree)
    dparams = dfj.prepare_weights(dcfg, {**w, "tok_embd": tparams.embed, "lm_head": tparams.head},
                                  args.drafter_dtype or wdtype)
  except ValueError as e:
    raise CLIError(f"argument --drafter: {e}") from None
  return tcfg, tparams, dparams, wdtype


class _Stream:
  """Prints committed tokens as they arrive (text: each new decoded suffix; else ids), and a
  progress line on stderr every 5 s. Records (time, tokens) at each sync."""

  def __init__(self, tokenizer, max_new: int):
    self.tok, self.max_new = tokenizer, max_new
    self.ids, self.shown, self.marks = [], "", []
    self.last_progress = time.perf_counter()

  def __call__(self, slot: int, new: list[int]) -> None:
    self.ids += new
    if self.tok is None:
      sys.stdout.write(("" if len(self.ids) == len(new) else " ") + " ".join(map(str, new)))
    else:
      text = self.tok.decode(self.ids)
      # A multi-byte character may decode only once its last token arrives.
      if text.startswith(self.shown):
        sys.stdout.write(text[len(self.shown):])
        self.shown = text
    sys.stdout.flush()
    now = time.perf_counter()
    self.marks.append((now, len(self.ids)))
    rate = self.rate()
    if rate is not None and now - self.last_progress > 5:
      self.last_progress = now
      print(f"\n[{len(self.ids)}/{self.max_new} tokens, {rate:.1f} tokens/s]", file=sys.stderr)

  def rate(self) -> float | None:
    """Tokens per second from the first sync (compilation done by then) to the last."""
    m = self.marks
    if len(m) < 2 or m[-1][0] <= m[0][0]:
      return None
    return (m[-1][1] - m[0][1]) / (m[-1][0] - m[0][0])


def _generate(args) -> int:
  import jax

  from dflash_jax import decode as D

  tokenizer = None
  tok_path = os.path.join(args.target, "tokenizer.json")
  if os.path.isfile(tok_path):
    from tokenizers import Tokenizer
    try:
      tokenizer = Tokenizer.from_file(tok_path)
    except Exception as e:   # tokenizers raises its own exception type
      raise CLIError(f"{tok_path}: cannot read it ({e})") from None
  if args.prompt is not None:
    if tokenizer is None:
      raise CLIError(f"argument --prompt: text needs {tok_path}; pass --prompt-ids instead")
    prompt = tokenizer.encode(args.prompt).ids
    if not prompt:
      raise CLIError("argument --prompt: the text encodes to no tokens")
  else:
    prompt = args.prompt_ids

  tcfg, tparams, dparams, wdtype = _load(args)
  if max(prompt) >= tcfg.vocab_size:
    raise CLIError(f"argument --prompt-ids: id {max(prompt)} is outside the target vocab "
                        f"[0, {tcfg.vocab_size})")
  block = args.block or dparams.cfg.block_size
  if block > dparams.cfg.block_size:
    raise CLIError(f"argument --block: must lie in [2, {dparams.cfg.block_size}] (the "
                        f"drafter's block_size), got {block}")
  eos = tuple(args.eos if args.eos is not None else tcfg.eos_token_ids)
  if any(e >= tcfg.vocab_size for e in eos):
    raise CLIError(f"argument --eos: ids must lie in [0, {tcfg.vocab_size}), got {list(eos)}")
  try:
    sampling = D.Sampling(args.temperature, args.top_k, args.top_p, args.proposals)
    dcfg = D.DecodeConfig(width=block, sampling=sampling, impl=args.impl, target_impl=args.impl)
    models = D.Models(target=tparams, drafter=dparams, d2t=None, target_cfg=tcfg)
  except ValueError as e:
    raise CLIError(str(e)) from None
  try:   # the drafter's shape, vocab and target_layers against the target
    D.check_models(models, dcfg)
  except ValueError as e:
    raise CLIError(f"argument --drafter: {e}") from None
  cache_dtype = args.cache_dtype or wdtype
  print(f"target:  {args.target} ({tcfg.num_hidden_layers} layers, hidden {tcfg.hidden_size}, "
        f"vocab {tcfg.vocab_size}, {wdtype}); drafter: {args.drafter} "
        f"({dparams.cfg.n_layer} layers, block {dparams.cfg.block_size}, target layers "
        f"{list(dparams.cfg.target_layers)}); device {jax.devices()[0].device_kind}",
        file=sys.stderr)
  print(f"prompt:  {len(prompt)} tokens; verifying {block} rows per round; "
        f"{'greedy' if sampling.greedy else f'T={sampling.temperature} top_k={sampling.top_k} top_p={sampling.top_p} proposals={sampling.proposals}'}",
        file=sys.stderr)

  stream = _Stream(tokenizer, args.max_new)
  # --compare decodes target-only with the same cache capacity: the prompt's prefill is then
  # the same computation in both runs (its XLA attention reads every slot).
  capacity = args.capacity or -(-(len(prompt) + args.max_new + block) // 16) * 16
  kw = dict(eos_ids=eos, seed=args.seed, capacity=capacity, cache_dtype=cache_dtype)
  try:
    g = D.generate(models, dcfg, [prompt], args.max_new, rounds_per_call=args.sync_every,
                   on_tokens=stream, window=args.window, ring_dtype=cache_dtype, **kw)
  except ValueError as e:
    raise CLIError(str(e)) from None
  print()
  hist = g.hist.sum(0)
  print(f"tokens:  {g.n_tokens} in {int(g.rounds.sum())} rounds; tau {g.tau:.2f} (mean tokens "
        f"committed per round: accepted drafts + the target's own token)")
  print("accepted drafts per round (count): " +
        " ".join(f"{j}:{int(c)}" for j, c in enumerate(hist)))
  rate = stream.rate()
  print(f"speed:   {g.n_tokens / g.seconds:.1f} tokens/s over the whole run (compilation "
        f"included, prefill {g.prefill_seconds:.2f} s excluded); "
        + (f"{rate:.1f} tokens/s after the first sync" if rate else
           "the run ended within the first sync (no compile-free rate)"))
  if args.compare:
    base = D.generate_target_only(tparams, tcfg, [prompt], args.max_new,
                                  rounds_per_call=args.sync_every, sampling=sampling,
                                  target_impl=args.impl, **kw)
    same = "identical" if base.tokens == g.tokens else "different"
    print(f"target only: {base.n_tokens / base.seconds:.1f} tokens/s (compilation included); "
          f"speedup {g.n_tokens / g.seconds / (base.n_tokens / base.seconds):.2f}x; output {same}"
          + (" (expected: greedy decoding is lossless)" if sampling.greedy else
             " (sampling: the same distribution, not the same draw)"))
  return 0
