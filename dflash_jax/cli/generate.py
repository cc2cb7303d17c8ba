"""`python -m dflash_jax generate`: speculative decoding with a target model and a DFlash drafter.

--target is an HF folder (config.json + safetensors, any family `load_target` reads); --drafter
a drafter GGUF or HF folder, whose target_layers must fit the target (it borrows the target's
embedding and LM head). Text goes through TARGET/tokenizer.json (the `tokenizers` package).

One prompt (--prompt or --prompt-ids): the tokens stream as they are committed, then tau (the
mean number of tokens committed per round: the accepted drafts plus the target's own token),
the histogram of accepted drafts per round and tokens/s, compilation excluded (compiled
first, untimed, and reported apart). --compare also decodes with the target alone and prints
the speedup with its range over --repeats timed runs of each.

Many prompts (--prompts-file: one per line, or JSONL with "prompt" or "prompt_ids" per line):
decoded on --slots slots, each slot taking the next prompt as soon as its sequence finishes
(continuous batching: one compilation whatever comes and goes); one JSON line per prompt (to
--out, else stdout) with its text, tokens, tau and seconds, then the throughput; --compare
also decodes the same prompts as static batches of --slots and prints both throughputs.
Bad arguments get one line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from dflash_jax.cli import (IMPL_HELP, CLIError, TextStream, add_common_args,
                            check_new_output, float_in, int_in, load_drafter_arg,
                            load_target_arg, load_tokenizer, resolve_impl)


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
  src.add_argument("--prompts-file",
                   help="many prompts: one text per line, or JSONL (a .jsonl name) with "
                        "\"prompt\" (text) or \"prompt_ids\" (ids) in each line")
  g.add_argument("--max-new", type=int_in(1), default=128, help="tokens to generate per prompt")
  g.add_argument("--temperature", type=float_in(0, 100), default=0.0, help="0 = greedy")
  g.add_argument("--top-k", type=int_in(0), default=0, help="0 = off")
  g.add_argument("--top-p", type=float_in(0, 1, lo_open=True), default=1.0, help="1 = off")
  g.add_argument("--proposals", choices=("greedy", "sampled"), default="greedy",
                 help="under sampling: drafts are the drafter's argmax, or samples of its "
                      "softmax(logits / T)")
  g.add_argument("--seed", type=int, default=0, help="sampling seed")
  g.add_argument("--block", type=int_in(2), default=None,
                 help="rows verified per round (default: the drafter's block_size)")
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
  g.add_argument("--impl", choices=("auto", "pallas", "xla"), default="auto", help=IMPL_HELP)
  g.add_argument("--eos", type=_ids, default=None,
                 help="end-of-sequence ids, comma-separated (default: the target config's)")
  g.add_argument("--sync-every", type=int_in(1), default=8,
                 help="rounds per device call between host syncs (streaming granularity; with "
                      "--prompts-file, how long a finished slot may wait for its next prompt)")
  g.add_argument("--compare", action="store_true",
                 help="also decode with the target alone (one prompt), or as static batches "
                      "(--prompts-file), and report the speedup")
  g.add_argument("--repeats", type=int_in(1), default=3,
                 help="one prompt with --compare: timed runs of each decoding")
  g.add_argument("--slots", type=int_in(1), default=8,
                 help="--prompts-file: sequences decoded at once")
  g.add_argument("--out", default=None,
                 help="--prompts-file: the JSONL results file (default: stdout)")
  g.add_argument("--force", action="store_true", help="replace an existing --out")
  add_common_args(g)
  g.set_defaults(run=run)


def _read_prompts(path: str, tokenizer, target: str) -> list[tuple[str | None, list[int]]]:
  """(text or None, ids) per prompt of --prompts-file."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise CLIError(f"argument --prompts-file: cannot read {path!r} ({e})") from None
  out = []
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    where = f"argument --prompts-file: {path}:{n}"
    if path.endswith(".jsonl"):
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise CLIError(f"{where}: not JSON ({e.msg})") from None
      if not isinstance(rec, dict) or ("prompt" in rec) == ("prompt_ids" in rec):
        raise CLIError(f"{where}: each line needs exactly one of \"prompt\" (text) and "
                       "\"prompt_ids\" (a list of ids)")
      if "prompt_ids" in rec:
        ids = rec["prompt_ids"]
        if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
          raise CLIError(f"{where}: \"prompt_ids\" must be a non-empty list of ids >= 0")
        out.append((None, ids))
        continue
      text = rec["prompt"]
      if not isinstance(text, str):
        raise CLIError(f"{where}: \"prompt\" must be a string")
    else:
      text = line
    if tokenizer is None:
      raise CLIError(f"{where}: text needs {os.path.join(target, 'tokenizer.json')}; give "
                     "JSONL lines with \"prompt_ids\" instead")
    ids = tokenizer.encode(text).ids
    if not ids:
      raise CLIError(f"{where}: the text encodes to no tokens")
    out.append((text, ids))
  if not out:
    raise CLIError(f"argument --prompts-file: {path} holds no prompts")
  return out


def run(args) -> int:
  import jax.numpy as jnp

  from dflash_jax import decode as D

  impl = resolve_impl(args.impl)
  many = args.prompts_file is not None
  if many and args.out is not None:
    check_new_output(args.out, "--out", args.force, folder=False)
  if not many and args.out is not None:
    raise CLIError("argument --out: goes with --prompts-file")
  tokenizer = load_tokenizer(args.target)
  if many:
    items = _read_prompts(args.prompts_file, tokenizer, args.target)
  elif args.prompt is not None:
    if tokenizer is None:
      raise CLIError(f"argument --prompt: text needs "
                     f"{os.path.join(args.target, 'tokenizer.json')}; pass --prompt-ids instead")
    items = [(args.prompt, tokenizer.encode(args.prompt).ids)]
    if not items[0][1]:
      raise CLIError("argument --prompt: the text encodes to no tokens")
  else:
    items = [(None, args.prompt_ids)]
  prompts = [ids for _, ids in items]

  t_load = time.perf_counter()
  tcfg, target = load_target_arg(args.target, args.dtype)
  wdtype = "bf16" if target.embed.dtype == jnp.bfloat16 else "fp32"
  dparams = load_drafter_arg(args.drafter, tcfg, target, args.target,
                             args.drafter_dtype or wdtype, draft_window=args.draft_window)
  top = max(max(p) for p in prompts)
  if top >= tcfg.vocab_size:
    what = "--prompt-ids" if args.prompt_ids is not None else "--prompts-file"
    raise CLIError(f"argument {what}: id {top} is outside the vocab [0, {tcfg.vocab_size}) "
                   f"of --target {args.target}")
  block = args.block or dparams.cfg.block_size
  if block > dparams.cfg.block_size:
    raise CLIError(f"argument --block: must lie in [2, {dparams.cfg.block_size}] (the "
                   f"drafter's block_size), got {block}")
  eos = tuple(args.eos if args.eos is not None else tcfg.eos_token_ids)
  if any(e >= tcfg.vocab_size for e in eos):
    raise CLIError(f"argument --eos: ids must lie in [0, {tcfg.vocab_size}), got {list(eos)}")
  longest = max(len(p) for p in prompts)
  need = longest + args.max_new + block
  if need > tcfg.max_position_embeddings:
    raise CLIError(f"arguments --max-new/--prompt: the longest prompt {longest} + {args.max_new} "
                   f"new tokens + {block} verified rows exceed the target's "
                   f"max_position_embeddings {tcfg.max_position_embeddings}")
  if args.capacity is not None and args.capacity < need:
    raise CLIError(f"argument --capacity: {args.capacity} < the longest prompt {longest} + "
                   f"--max-new {args.max_new} + block {block} = {need}")
  try:
    sampling = D.Sampling(args.temperature, args.top_k, args.top_p, args.proposals)
    dcfg = D.DecodeConfig(width=block, sampling=sampling, impl=impl, target_impl=impl)
  except ValueError as e:
    raise CLIError(str(e)) from None
  models = D.Models(target=target, drafter=dparams, d2t=None, target_cfg=tcfg)
  cache_dtype = args.cache_dtype or wdtype
  import jax
  jax.block_until_ready((target, dparams))
  print(f"target:  {args.target} ({tcfg.n_layers} layers, hidden {tcfg.hidden_size}, vocab "
        f"{tcfg.vocab_size}, {wdtype}); drafter: {args.drafter} ({dparams.cfg.n_layer} "
        f"layers, block {dparams.cfg.block_size}, target layers "
        f"{list(dparams.cfg.target_layers)}); {jax.devices()[0].device_kind}, impl={impl}; "
        f"loaded in {time.perf_counter() - t_load:.1f} s", file=sys.stderr)
  how = ("greedy" if sampling.greedy else f"T={sampling.temperature} top_k={sampling.top_k} "
         f"top_p={sampling.top_p} proposals={sampling.proposals}")
  kw = dict(eos_ids=eos, cache_dtype=cache_dtype, window=args.window, ring_dtype=cache_dtype)
  try:
    if many:
      return _many(args, models, dcfg, items, tokenizer, kw, how)
    return _one(args, models, dcfg, prompts[0], tokenizer, kw, how, sampling)
  except ValueError as e:
    raise CLIError(str(e)) from None


def _rate(g) -> float:
  return g.n_tokens / max(g.seconds, 1e-12)


def _one(args, models, dcfg, prompt, tokenizer, kw, how, sampling) -> int:
  from dflash_jax import decode as D
  # --compare decodes target-only with the same cache capacity: the prompt's prefill is then
  # the same computation in both runs (its XLA attention reads every slot).
  kw = dict(kw, capacity=args.capacity or -(-(len(prompt) + args.max_new + dcfg.width) // 16) * 16)
  print(f"prompt:  {len(prompt)} tokens; verifying {dcfg.width} rows per round; {how}",
        file=sys.stderr)
  compile_s = D.warm_up(models, dcfg, [prompt], args.max_new, seed=args.seed, **kw)
  print(f"compile: {compile_s:.1f} s (excluded from the rates below)", file=sys.stderr)
  stream = TextStream(tokenizer)
  g = D.generate(models, dcfg, [prompt], args.max_new, rounds_per_call=args.sync_every,
                 on_tokens=stream, seed=args.seed, **kw)
  stream.finish()
  hist = g.hist.sum(0)
  print(f"tokens:  {g.n_tokens} in {int(g.rounds.sum())} rounds; tau {g.tau:.2f} (mean tokens "
        f"committed per round: accepted drafts + the target's own token)")
  print("accepted drafts per round (count): " +
        " ".join(f"{j}:{int(c)}" for j, c in enumerate(hist)))
  print(f"speed:   {_rate(g):.1f} tokens/s decoding (prefill {g.prefill_seconds * 1e3:.0f} ms "
        f"and compilation excluded)")
  if not args.compare:
    return 0
  base_kw = {k: v for k, v in kw.items() if k not in ("window", "ring_dtype")}
  plain = D.Models(target=models.target, drafter=None, d2t=None, target_cfg=models.target_cfg)
  compile_b = D.warm_up(plain, D.DecodeConfig(width=1, sampling=sampling,
                                               target_impl=dcfg.target_impl), [prompt],
                        args.max_new, seed=args.seed, **base_kw)
  spec = [_rate(g)] + [_rate(D.generate(models, dcfg, [prompt], args.max_new,
                                        rounds_per_call=args.sync_every, seed=args.seed, **kw))
                       for _ in range(args.repeats - 1)]
  base_runs = [D.generate_target_only(models.target, models.target_cfg, [prompt], args.max_new,
                                      rounds_per_call=args.sync_every, sampling=sampling,
                                      seed=args.seed, target_impl=dcfg.target_impl, **base_kw)
               for _ in range(args.repeats)]
  base = [_rate(b) for b in base_runs]
  ratio = np.asarray(spec) / np.median(base)
  same = base_runs[0].tokens == g.tokens
  print(f"target only: {np.median(base):.1f} tokens/s (compile {compile_b:.1f} s, excluded); "
        f"speculative {np.median(spec):.1f}; speedup {np.median(ratio):.2f}x "
        f"(range {ratio.min():.2f}-{ratio.max():.2f}x over {args.repeats} runs of each); "
        f"output {'identical' if same else 'different'}"
        + (" (expected: greedy decoding is lossless)" if sampling.greedy else
           " (sampling: the same distribution, not the same draw)"))
  return 0


def _many(args, models, dcfg, items, tokenizer, kw, how) -> int:
  from dflash_jax import decode as D
  prompts = [ids for _, ids in items]
  print(f"prompts: {len(prompts)} from {args.prompts_file} on {min(args.slots, len(prompts))} "
        f"slots, up to {args.max_new} new tokens each; verifying {dcfg.width} rows per round; "
        f"{how}", file=sys.stderr)
  out = sys.stdout if args.out is None else None
  lines: list[str] = []

  def emit(r: D.Served) -> None:
    text, ids = items[r.index]
    rec = dict(index=r.index, prompt=text, prompt_tokens=len(ids),
               text=None if tokenizer is None else tokenizer.decode(r.tokens),
               tokens=r.tokens, n_tokens=len(r.tokens), rounds=r.rounds, tau=round(r.tau, 4),
               accepted_hist=r.hist.astype(int).tolist(), seconds=round(r.seconds, 4))
    line = json.dumps(rec, ensure_ascii=False)
    if out is not None:
      print(line, file=out, flush=True)
    else:
      lines.append(line)

  results, st = D.serve(models, dcfg, prompts, args.max_new, n_slots=args.slots,
                        rounds_per_call=args.sync_every, on_done=emit, seed=args.seed, **kw)
  if args.out is not None:
    from dflash_jax.io import atomic
    by_index = sorted(lines, key=lambda l: json.loads(l)["index"])
    atomic.write_text(args.out, "\n".join(by_index) + "\n")
  hist = np.sum([r.hist for r in results], axis=0)
  tau = float((hist * np.arange(1, len(hist) + 1)).sum() / max(hist.sum(), 1))
  print(f"served:  {len(results)} prompts, {st.n_tokens} tokens in {st.seconds:.2f} s: "
        f"{st.tokens_per_s:.1f} tokens/s on {st.n_slots} slots, tau {tau:.2f} (compile "
        f"{st.compile_seconds:.1f} s, excluded)" + ("" if args.out is None else
                                                   f"; results in {args.out}"),
        file=sys.stderr)
  if args.compare:
    rate, compile_s, same = _static(models, dcfg, prompts, args, kw, results)
    print(f"static batches of {st.n_slots}: {rate:.1f} tokens/s (compile {compile_s:.1f} s, "
          f"excluded); continuous batching {st.tokens_per_s / rate:.2f}x that; outputs "
          f"{'identical' if same else 'different'}", file=sys.stderr)
  return 0


def _static(models, dcfg, prompts, args, kw, served):
  """Tokens/s decoding the prompts as static batches of --slots (the last one padded with
  copies of the first prompt, whose outputs are dropped), all at one capacity and prefill
  length so that one compilation serves every batch; and whether each output equals serve's
  (greedy: it must)."""
  from dflash_jax import decode as D
  from dflash_jax.models.base import prefill_bucket
  s = min(args.slots, len(prompts))
  longest = max(len(p) for p in prompts)
  cap = -(-(longest + args.max_new + dcfg.width) // 16) * 16
  kw = dict(kw, capacity=cap, prefill_len=min(prefill_bucket(longest - 1), cap), seed=args.seed)
  groups = [prompts[i:i + s] for i in range(0, len(prompts), s)]
  groups = [g + [prompts[0]] * (s - len(g)) for g in groups]
  compile_s = D.warm_up(models, dcfg, groups[0], args.max_new, **kw)
  outs, n_tok = [], 0
  t0 = time.perf_counter()
  for g in groups:
    r = D.generate(models, dcfg, g, args.max_new, rounds_per_call=args.sync_every, **kw)
    outs += r.tokens
  seconds = time.perf_counter() - t0
  outs = outs[:len(prompts)]
  n_tok = sum(len(t) for t in outs)
  same = all(o == r.tokens for o, r in zip(outs, served))
  return n_tok / seconds, compile_s, same
