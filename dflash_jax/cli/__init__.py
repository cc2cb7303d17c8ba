"""Subcommands of `python -m dflash_jax`: one module per job, each with `register(subparsers)`.

Argument errors are one line and exit status 2, never a traceback: `Parser` (the class of every
subparser, since argparse gives subparsers their parent's class) turns argparse's own errors
into `CLIError`, and `main` prints any CLIError a subcommand raises, as
`python -m dflash_jax <command>: error: <message>`. Validate with the argparse types below where
a value alone decides; raise CLIError naming the argument and its allowed range where the limit
depends on other arguments or on the drafter. Every option's default is shown by `--help`
(an option whose default is None says in its help what None means).
"""
from __future__ import annotations

import argparse
import os


class CLIError(Exception):
  """A bad command line: printed as one line, exit status 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Appends each option's default to its help, except None (the help says what None means)."""

  def _get_help_string(self, action):
    if action.default is None:
      return action.help
    return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are CLIErrors and whose help shows the defaults."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("formatter_class", HelpFormatter)
    super().__init__(*args, **kwargs)

  def error(self, message: str):
    raise CLIError(f"{message} (see --help)")


def int_in(lo: int, hi: int | None = None):
  """An argparse type: an integer in [lo, hi] (no upper limit when hi is None)."""
  allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"

  def parse(text: str) -> int:
    try:
      v = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"must be an integer {allowed}, got {text!r}") from None
    if v < lo or (hi is not None and v > hi):
      raise argparse.ArgumentTypeError(f"must be an integer {allowed}, got {v}")
    return v

  parse.__name__ = f"integer {allowed}"
  return parse


def float_in(lo: float, hi: float, lo_open: bool = False):
  """An argparse type: a number in [lo, hi] ((lo, hi] when lo_open)."""
  allowed = f"{'(' if lo_open else '['}{lo}, {hi}]"

  def parse(text: str) -> float:
    try:
      v = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"must be a number in {allowed}, got {text!r}") from None
    if not ((v > lo if lo_open else v >= lo) and v <= hi):
      raise argparse.ArgumentTypeError(f"must lie in {allowed}, got {v}")
    return v

  parse.__name__ = f"number in {allowed}"
  return parse


def existing_file(text: str) -> str:
  """An argparse type: the path of an existing file."""
  if not os.path.isfile(text):
    raise argparse.ArgumentTypeError(f"no such file: {text!r}")
  return text
