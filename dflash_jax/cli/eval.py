"""`python -m dflash_jax eval --target DIR --drafter PATH`: acceptance and speed end to end.

Held-out corpus prompts (read with TARGET/tokenizer.json) are decoded greedily by the target
alone, by each drafter at each width (--widths; default: each drafter's widest round) and
by prompt lookup (n-gram drafting) at the same widths, all through dflash_jax.decode with the
same target code, one prompt at a time, each configuration compiled by an untimed first run.
Prints the table (tau, tokens/s, speedup over target-only with its 95% bootstrap interval
over the prompts, outputs equal to target-only's, acceptance histogram) and with --out writes
eval.md and eval.json there. Every argument is checked before any decoding; errors are one
line naming the argument, exit status 2.
"""
from __future__ import annotations

import dataclasses
import os

from dflash_jax.cli import (IMPL_HELP, CLIError, add_common_args, check_new_output, int_in,
                            load_drafter_arg, load_target_arg, load_tokenizer, resolve_impl)
from dflash_jax.cli import train_common as C
from dflash_jax.io import atomic

OUT_FILES = ("eval.md", "eval.json")


def register(sub) -> None:
  p = sub.add_parser("eval", help="tau and tokens/s of drafters vs target-only and prompt lookup",
                     description=__doc__.split("\n\n")[0])
  p.add_argument("--target", required=True, help="target HF folder with its tokenizer.json")
  p.add_argument("--drafter", action="append", default=[],
                 help="drafter GGUF or HF folder (repeatable; none: baselines only)")
  p.add_argument("--out", default=None,
                 help="folder for eval.md and eval.json (default: print the table only)")
  p.add_argument("--force", action="store_true", help="replace eval.md / eval.json in --out")
  C.add_corpus_args(p)
  p.add_argument("--prompts", type=int_in(1), default=32, help="held-out prompts")
  p.add_argument("--prompt-len", type=int_in(1), default=128, help="tokens per prompt")
  p.add_argument("--gen", type=int_in(1), default=256, help="tokens generated per prompt")
  p.add_argument("--widths", type=C.int_list, default=None,
                 help="rows verified per round, each in [2, every drafter's widest round: its "
                      "block size, DSpark's + 1] (default: each drafter's widest round, prompt "
                      "lookup at those)")
  p.add_argument("--no-lookup", action="store_true", help="skip the prompt-lookup rows")
  p.add_argument("--max-ngram", type=int_in(1), default=3, help="prompt lookup's longest match")
  p.add_argument("--impl", choices=("auto", "pallas", "xla"), default="auto", help=IMPL_HELP)
  p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                 help="weights of target and drafters")
  p.add_argument("--seed", type=int, default=0, help="which held-out prompts")
  add_common_args(p)
  p.set_defaults(run=evaluate)


def _check_out(args) -> None:
  if args.out is None:
    return
  if os.path.exists(args.out) and not os.path.isdir(args.out):
    raise CLIError(f"argument --out: {args.out!r} is a file; --out is the folder for "
                   f"{' and '.join(OUT_FILES)}")
  for name in OUT_FILES:
    check_new_output(os.path.join(args.out, name), "--out", args.force, folder=False)


def evaluate(args) -> int:
  import jax

  from dflash_jax.train import data as D
  from dflash_jax.train import evaluate as E
  from dflash_jax.train import recipes

  impl = resolve_impl(args.impl)
  if args.widths is not None and any(w < 2 for w in args.widths):
    raise C.arg_error("--widths", f"block widths must be >= 2, got {list(args.widths)}")
  _check_out(args)
  tok = load_tokenizer(args.target)
  if tok is None:
    raise C.arg_error("--target", f"{args.target} has no tokenizer.json: eval reads the "
                      "corpus as text with the target's own tokenizer (train-target writes one)")
  tcfg, target = load_target_arg(args.target, args.dtype)
  drafters = []
  for path in args.drafter:
    dp = load_drafter_arg(path, tcfg, target, args.target, args.dtype)
    drafters.append((os.path.basename(os.path.normpath(path)), path, dp))
  widths = args.widths or tuple(sorted({dp.cfg.max_verify_width for _, _, dp in drafters},
                                       reverse=True)) or (16,)
  for name, path, dp in drafters:
    top = dp.cfg.max_verify_width
    if any(w > top for w in widths):
      raise C.arg_error("--widths", f"{[w for w in widths if w > top]} exceed the "
                        f"{dp.cfg.family} drafter {path}'s widest round {top} (its block_size "
                        f"{dp.cfg.block_size}: widths lie in [2, {top}])")
  need = args.prompt_len + args.gen + max(widths)
  if need > tcfg.max_position_embeddings:
    raise C.arg_error("--prompt-len/--gen", f"{args.prompt_len} + {args.gen} tokens + "
                      f"{max(widths)} verified rows = {need} positions exceed the "
                      f"max_position_embeddings {tcfg.max_position_embeddings} of --target "
                      f"{args.target}")
  eos = tcfg.eos_token_ids[0] if tcfg.eos_token_ids else None
  try:
    _, held_s, _, held_f = recipes.corpus_streams(
        args.corpus, args.max_files, args.holdout_every, D.TextTokenizer(tok, eos))
    prompts = recipes.seeded_rows(D.chunk(held_s, args.prompt_len), args.prompts, args.seed)
  except ValueError as e:
    raise C.arg_error("--corpus/--prompt-len", e)
  print(f"eval: {prompts.shape[0]} held-out prompts of {args.prompt_len} tokens from "
        f"{len(held_f)} files, {args.gen} new tokens each, widths {list(widths)}, "
        f"{args.dtype} weights, impl={impl}, {jax.devices()[0].device_kind}; tokens/s count "
        "the decoding rounds after prefill, every configuration compiled by an untimed run")
  rows = E.evaluate(target, tcfg, [(n, dp) for n, _, dp in drafters], prompts, args.gen,
                    widths, lookup=not args.no_lookup, max_ngram=args.max_ngram, impl=impl,
                    target_impl=impl)
  table = E.markdown_table(rows)
  print(table)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    atomic.write_text(os.path.join(args.out, "eval.md"), table + "\n")
    atomic.write_json(os.path.join(args.out, "eval.json"), dict(
        args=vars(args) | {"run": None}, device=jax.devices()[0].device_kind, impl=impl,
        rows=[dataclasses.asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in rows]))
  return 0
