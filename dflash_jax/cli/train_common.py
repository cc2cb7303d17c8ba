"""Argument helpers shared by the training and evaluation subcommands (not a command itself).

Errors follow dflash_jax.cli: a CLIError naming the argument, printed as one line, exit 2.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from dflash_jax.cli import CLIError, check_new_output, int_in

if TYPE_CHECKING:   # the training modules load jax and optax: the subcommands import them late
  from dflash_jax.train.trainer import OptimConfig


def check_out(path: str, force: bool) -> None:
  """Refuses a non-empty --out before any work, unless --force or it holds checkpoints/ (a
  resume)."""
  import os
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return
  check_new_output(path, "--out", force, folder=True)


def export_reserve(deadline) -> float:
  """Seconds of a --max-minutes budget kept for what follows training (the last held-out
  evaluation, which may compile, and the export): a tenth of it, at least 10 s."""
  return 0.0 if deadline.seconds is None else max(10.0, 0.1 * deadline.seconds)


def check_memory(stages: dict[str, int], hint: str) -> None:
  """Refuses, before any work, a run whose estimated peak memory does not fit the machine
  (`train.budget.check_fits`), naming the stage, the estimate and what to lower."""
  from dflash_jax.train.budget import check_fits
  problem = check_fits(stages)
  if problem:
    raise CLIError(f"{problem}; {hint}")


def arg_error(argument: str, message) -> CLIError:
  """The one-line error for a bad argument (raise it; `python -m dflash_jax` prints it, exit 2)."""
  return CLIError(f"argument {argument}: {' '.join(str(message).split())}")


def positive_float(text: str) -> float:
  v = float(text)
  if not v > 0:
    raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
  return v


def int_list(text: str) -> tuple[int, ...]:
  try:
    out = tuple(int(t) for t in text.split(",") if t.strip())
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
  if not out:
    raise argparse.ArgumentTypeError("must name at least one integer")
  return out


def add_corpus_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--corpus", default=None,
                 help="folder of .py files (default: this Python's standard library)")
  p.add_argument("--max-files", type=int_in(1), default=None,
                 help="use only the first N files of the sorted listing (small runs; "
                      "default: all)")
  p.add_argument("--holdout-every", type=int_in(1), default=20,
                 help="hold out files whose path hash is 0 mod N for evaluation")


def add_optim_args(p: argparse.ArgumentParser, *, steps: int, lr: float, warmup: int) -> None:
  p.add_argument("--steps", type=int_in(1), default=steps, help="optimizer steps")
  p.add_argument("--lr", type=positive_float, default=lr, help="peak learning rate")
  p.add_argument("--warmup", type=int_in(0), default=warmup, help="warmup steps")
  p.add_argument("--final-lr-frac", type=float, default=0.1,
                 help="cosine decay ends at lr times this")
  p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices)")
  p.add_argument("--clip", type=positive_float, default=1.0, help="global gradient norm clip")


def optim_config(args: argparse.Namespace) -> OptimConfig:
  """The `trainer.OptimConfig` of `add_optim_args`' arguments (a CLIError naming a bad one)."""
  from dflash_jax.train import trainer as TR
  if args.warmup >= args.steps:
    raise arg_error("--warmup", f"must be below --steps ({args.steps}), got {args.warmup}")
  try:
    return TR.OptimConfig(lr=args.lr, total_steps=args.steps, warmup_steps=args.warmup,
                          final_lr_frac=args.final_lr_frac, weight_decay=args.weight_decay,
                          clip_norm=args.clip)
  except ValueError as e:
    raise arg_error("--lr/--final-lr-frac/--weight-decay", e)


def add_run_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--seed", type=int, default=0, help="weights, data order and anchors")
  p.add_argument("--log-every", type=int_in(1), default=50,
                 help="a progress line every N steps (and at least every 30 s)")
  p.add_argument("--eval-every", type=int_in(0), default=0,
                 help="held-out evaluation every N steps (0: at the end only)")
  p.add_argument("--checkpoint-every", type=int_in(0), default=0,
                 help="orbax checkpoint every N steps into OUT/checkpoints (resumed from when "
                      "present); 0: none")
  p.add_argument("--max-minutes", type=positive_float, default=None,
                 help="wall-time limit of the whole command, every stage included: each "
                      "stage stops at its share (data preparation with what it has done, "
                      "training checkpointed), then the model is exported (default: none)")
  p.add_argument("--force", action="store_true",
                 help="write into a non-empty OUT (without it, only a folder holding "
                      "checkpoints/ to resume from is written into)")
