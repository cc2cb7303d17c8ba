"""`python -m dflash_jax eval --target DIR --drafter PATH`: acceptance and speed end to end.

Held-out corpus prompts are decoded greedily by the target alone, by each drafter at each
block width (--widths, default 16,8; widths above a drafter's block size are skipped) and by
prompt lookup (n-gram drafting) at the same widths, all through dflash_jax.decode with the
same target code, one prompt at a time. Prints the table (tau, tokens/s, speedup over
target-only, outputs equal to target-only's, acceptance histogram) and with --out writes
eval.md and eval.json there. Errors are one line naming the argument, exit status 2.
"""
from __future__ import annotations

import dataclasses
import os

from dflash_jax.cli import int_in
from dflash_jax.cli import train_common as C
from dflash_jax.io import atomic


def register(sub) -> None:
  p = sub.add_parser("eval", help="tau and tokens/s of drafters vs target-only and prompt lookup",
                     description=__doc__.split("\n\n")[0])
  p.add_argument("--target", required=True, help="target HF folder")
  p.add_argument("--drafter", action="append", default=[],
                 help="drafter GGUF or HF folder (repeatable; none: baselines only)")
  p.add_argument("--out", default=None, help="folder for eval.md and eval.json")
  C.add_corpus_args(p)
  p.add_argument("--prompts", type=int_in(1), default=32, help="held-out prompts")
  p.add_argument("--prompt-len", type=int_in(1), default=128)
  p.add_argument("--gen", type=int_in(1), default=256, help="tokens generated per prompt")
  p.add_argument("--widths", type=C.int_list, default=(16, 8), help="block widths")
  p.add_argument("--no-lookup", action="store_true", help="skip the prompt-lookup rows")
  p.add_argument("--max-ngram", type=int_in(1), default=3)
  p.add_argument("--impl", choices=("pallas", "xla"), default="pallas",
                 help="drafter kernels (xla: their jnp twins; no GPU needed)")
  p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                 help="weights of target and drafters")
  p.add_argument("--seed", type=int, default=0)
  p.set_defaults(run=evaluate)


def evaluate(args) -> int:
  import jax

  import dflash_jax as dfj
  from dflash_jax.io import DrafterFormatError
  from dflash_jax.models import load_target
  from dflash_jax.train import data as D
  from dflash_jax.train import evaluate as E
  from dflash_jax.train import recipes

  if any(w < 2 for w in args.widths):
    raise C.arg_error("--widths", f"block widths must be >= 2, got {args.widths}")
  try:
    tcfg, target = load_target(args.target, dtype=args.dtype)
  except (ValueError, OSError) as e:
    raise C.arg_error("--target", e)
  drafters = []
  for path in args.drafter:
    try:
      cfg, w = dfj.load_drafter(path)
    except (DrafterFormatError, OSError) as e:
      raise C.arg_error("--drafter", e)
    try:
      drafters.append((os.path.basename(os.path.normpath(path)),
                       dfj.prepare_weights(cfg, {**w, "tok_embd": target.embed,
                                                 "lm_head": target.head}, args.dtype)))
    except ValueError as e:
      raise C.arg_error("--drafter", f"{path} does not fit the target: {e}")
  try:
    _, held_s, _, held_f = recipes.corpus_streams(args.corpus, args.max_files, args.holdout_every)
    prompts = recipes.seeded_rows(D.chunk(held_s, args.prompt_len), args.prompts, args.seed)
  except ValueError as e:
    raise C.arg_error("--corpus", e)
  print(f"eval: {prompts.shape[0]} held-out prompts of {args.prompt_len} tokens from "
        f"{len(held_f)} files, {args.gen} new tokens each, widths {args.widths}, "
        f"{args.dtype} weights, {jax.devices()[0].device_kind}")
  try:
    rows = E.evaluate(target, tcfg, drafters, prompts, args.gen, args.widths,
                      lookup=not args.no_lookup, max_ngram=args.max_ngram, impl=args.impl)
  except ValueError as e:
    raise C.arg_error("--drafter/--widths", e)
  table = E.markdown_table(rows)
  print(table)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    atomic.write_text(os.path.join(args.out, "eval.md"), table + "\n")
    atomic.write_json(os.path.join(args.out, "eval.json"), dict(
        args=vars(args) | {"run": None}, device=jax.devices()[0].device_kind,
        rows=[dataclasses.asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in rows]))
  return 0
