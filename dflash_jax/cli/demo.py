"""`python -m dflash_jax demo`: speculative decoding of real text, end to end, in a minute on CPU.

A target model and a DFlash drafter trained by this project's own `train-target` and
`train-drafter` (by default the pair shipped in dflash_jax/demo_pair, made by the commands in
its README.md) decode a prompt: the text streams as the speculative rounds commit it. Then the
same prompt is decoded by the target alone, and the demo prints tau (tokens committed per
round), the histogram of accepted drafts, the tokens/s of both (compilation excluded and
reported apart; the median of --repeats timed runs, with their range) and whether the
speculative output equals the target's own greedy output (it must: greedy speculative
decoding is lossless). `python -m dflash_jax simulate` times a drafter alone instead.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from dflash_jax.cli import (IMPL_HELP, CLIError, TextStream, add_common_args, existing_path,
                            int_in, load_drafter_arg, load_target_arg, load_tokenizer,
                            resolve_impl)

PAIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo_pair")
DEFAULT_TARGET = os.path.join(PAIR, "target")
DEFAULT_DRAFTER = os.path.join(PAIR, "drafter.gguf")
# Not from the corpus: code the pair has not seen, in the style of what it has.
DEFAULT_PROMPT = '''class Stack:
    """A last-in, first-out collection."""

    def __init__(self):
        self._items = []

    def push(self, item):
'''


def register(sub) -> None:
  d = sub.add_parser("demo", help="speculative decoding of real text with a trained target + "
                     "drafter (the main job; the default command)",
                     description=__doc__.split("\n\n")[0])
  d.add_argument("--target", type=existing_path, default=None,
                 help="target HF folder with its tokenizer.json (default: the shipped pair's, "
                      "dflash_jax/demo_pair/target)")
  d.add_argument("--drafter", type=existing_path, default=None,
                 help="drafter GGUF or HF folder, trained for --target (default: the shipped "
                      "pair's, dflash_jax/demo_pair/drafter.gguf)")
  d.add_argument("--prompt", default=None,
                 help="the text to continue (default: the start of a small Python class)")
  d.add_argument("--max-new", type=int_in(1), default=256, help="tokens to generate")
  d.add_argument("--block", type=int_in(2), default=None,
                 help="rows verified per round (default: the drafter's block size)")
  d.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                 help="weights of both models, and the target's cache and the drafter's ring")
  d.add_argument("--impl", choices=("auto", "pallas", "xla"), default="auto", help=IMPL_HELP)
  d.add_argument("--repeats", type=int_in(1), default=3,
                 help="timed runs of each decoding (after one untimed compile)")
  add_common_args(d)
  d.set_defaults(run=demo)


def _spread(xs) -> str:
  xs = np.asarray(xs, np.float64)
  return f"{np.median(xs):.1f}" + (f" ({xs.min():.1f}-{xs.max():.1f})" if len(xs) > 1 else "")


def demo(args) -> int:
  import jax

  from dflash_jax import decode as D

  impl = resolve_impl(args.impl)
  if (args.target is None) != (args.drafter is None):
    raise CLIError("arguments --target/--drafter: give both (a drafter is trained for its "
                   "target), or neither for the shipped pair")
  args.target = args.target or DEFAULT_TARGET
  args.drafter = args.drafter or DEFAULT_DRAFTER
  args.prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
  tok = load_tokenizer(args.target)
  if tok is None:
    raise CLIError(f"argument --target: {args.target} has no tokenizer.json (train-target "
                   "writes one); the demo reads and writes text")
  prompt = tok.encode(args.prompt).ids
  if not prompt:
    raise CLIError("argument --prompt: the text encodes to no tokens")
  t_load = time.perf_counter()
  tcfg, target = load_target_arg(args.target, args.dtype)
  dparams = load_drafter_arg(args.drafter, tcfg, target, args.target, args.dtype)
  block = args.block or dparams.cfg.block_size
  if block > dparams.cfg.block_size:
    raise CLIError(f"argument --block: must lie in [2, {dparams.cfg.block_size}] (the "
                   f"drafter's block_size), got {block}")
  if max(prompt) >= tcfg.vocab_size:
    raise CLIError(f"argument --prompt: token {max(prompt)} is outside the vocab "
                   f"[0, {tcfg.vocab_size}) of --target {args.target}")
  need = len(prompt) + args.max_new + block
  if need > tcfg.max_position_embeddings:
    raise CLIError(f"arguments --prompt/--max-new: {len(prompt)} + {args.max_new} tokens (+ "
                   f"{block} verified rows) exceed the target's max_position_embeddings "
                   f"{tcfg.max_position_embeddings}")
  load_s = time.perf_counter() - t_load
  dcfg_d = dparams.cfg
  models = D.Models(target=target, drafter=dparams, d2t=None, target_cfg=tcfg)
  spec_cfg = D.DecodeConfig(width=block, impl=impl, target_impl=impl)
  eos = tcfg.eos_token_ids
  kw = dict(eos_ids=eos, cache_dtype=args.dtype, capacity=-(-need // 16) * 16)
  dev = jax.devices()[0]
  print(f"target:  {args.target} ({tcfg.n_layers} layers x {tcfg.hidden_size}, vocab "
        f"{tcfg.vocab_size})", file=sys.stderr)
  print(f"drafter: {args.drafter} ({dcfg_d.n_layer} layers, block {dcfg_d.block_size}, target "
        f"layers {list(dcfg_d.target_layers)}); {args.dtype} weights, {dev.device_kind} "
        f"({jax.default_backend()}), impl={impl}; loaded in {load_s:.1f} s", file=sys.stderr)

  c_base = D.warm_up(D.Models(target=target, drafter=None, d2t=None, target_cfg=tcfg),
                     D.DecodeConfig(width=1, target_impl=impl), [prompt], args.max_new, **kw)
  c_spec = D.warm_up(models, spec_cfg, [prompt], args.max_new, ring_dtype=args.dtype, **kw)
  print(f"compile: {c_base:.1f} s target-only, {c_spec:.1f} s speculative (excluded from "
        f"every rate below; a later run of these shapes reads them from the compile cache)",
        file=sys.stderr)
  print(f"--- the prompt ({len(prompt)} tokens), then its continuation as the speculative "
        f"rounds commit it (block {block}) ---", file=sys.stderr, flush=True)
  sys.stdout.write(args.prompt)
  stream = TextStream(tok)
  spec = D.generate(models, spec_cfg, [prompt], args.max_new, on_tokens=stream,
                    ring_dtype=args.dtype, **kw)
  stream.finish()
  spec_rates = [spec.n_tokens / spec.seconds]
  base_rates = []
  base = None
  for _ in range(args.repeats):
    b = D.generate_target_only(target, tcfg, [prompt], args.max_new, target_impl=impl, **kw)
    base = base or b
    base_rates.append(b.n_tokens / b.seconds)
  for _ in range(args.repeats - 1):
    g = D.generate(models, spec_cfg, [prompt], args.max_new, ring_dtype=args.dtype, **kw)
    spec_rates.append(g.n_tokens / g.seconds)
  hist = spec.hist.sum(0)
  same = spec.tokens == base.tokens
  speedups = np.asarray(spec_rates) / np.median(base_rates)
  print("---", file=sys.stderr)
  print(f"tau:      {spec.tau:.2f} tokens per round ({spec.n_tokens} tokens in "
        f"{int(spec.rounds.sum())} rounds: accepted drafts + the target's own token)")
  print("accepted drafts per round: " + " ".join(f"{j}:{int(c)}" for j, c in enumerate(hist)
                                                 if c or j < 4))
  print(f"tokens/s: target only {_spread(base_rates)}, speculative {_spread(spec_rates)} "
        f"(median and range of {args.repeats} runs; compilation and prefill excluded)")
  print(f"speedup:  {np.median(speedups):.2f}x"
        + (f" ({speedups.min():.2f}-{speedups.max():.2f}x over the runs)" if args.repeats > 1
           else ""))
  print(f"output:   {'identical to' if same else 'DIFFERENT from'} target-only greedy decoding"
        + ("" if same else " (greedy speculative decoding must be lossless: a bug)"))
  return 0 if same else 1
