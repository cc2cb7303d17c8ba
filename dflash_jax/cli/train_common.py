"""Argument helpers shared by the training and evaluation subcommands (not a command itself).

Errors follow dflash_jax.cli: a CLIError naming the argument, printed as one line, exit 2.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from dflash_jax.cli import CLIError, int_in

if TYPE_CHECKING:   # the training modules load jax and optax: the subcommands import them late
  from dflash_jax.train.trainer import OptimConfig


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
                 help="use only the first N files of the sorted listing (small runs)")
  p.add_argument("--holdout-every", type=int_in(1), default=20,
                 help="hold out files whose path hash is 0 mod N for evaluation")


def add_optim_args(p: argparse.ArgumentParser, *, steps: int, lr: float, warmup: int) -> None:
  p.add_argument("--steps", type=int_in(1), default=steps)
  p.add_argument("--lr", type=positive_float, default=lr, help="peak learning rate")
  p.add_argument("--warmup", type=int_in(0), default=warmup, help="warmup steps")
  p.add_argument("--final-lr-frac", type=float, default=0.1,
                 help="cosine decay ends at lr times this")
  p.add_argument("--weight-decay", type=float, default=0.1)
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
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--log-every", type=int_in(1), default=50)
  p.add_argument("--eval-every", type=int_in(0), default=0,
                 help="held-out evaluation every N steps (0: at the end only)")
  p.add_argument("--checkpoint-every", type=int_in(0), default=0,
                 help="orbax checkpoint every N steps into OUT/checkpoints (resumed from when "
                      "present); 0: none")
  p.add_argument("--max-minutes", type=positive_float, default=None,
                 help="stop early (checkpointed and exported) once this much wall time passed")
