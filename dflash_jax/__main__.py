"""`python -m dflash_jax <command>`: one subcommand per job (modules under dflash_jax/cli/)."""
from __future__ import annotations

import importlib
import sys

from dflash_jax.cli import CLIError, Parser

# Each module dflash_jax.cli.<name> (dashes in a command's name are underscores in its module's)
# defines register(subparsers), which adds its parser and sets `run` (args -> exit status) as
# the parser's default.
COMMANDS = ("demo", "convert", "generate", "train-target", "train-drafter", "eval")
PROG = "python -m dflash_jax"


def _parser() -> Parser:
  p = Parser(prog=PROG, description="DFlash block-diffusion speculative decoding in JAX")
  sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
  for name in COMMANDS:
    importlib.import_module(f"dflash_jax.cli.{name.replace('-', '_')}").register(sub)
  return p


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] not in COMMANDS + ("-h", "--help"):
    argv = ["demo"] + argv   # the main job is the default
  try:
    args = _parser().parse_args(argv)
    return args.run(args)
  except CLIError as e:   # one line, no traceback: the command line is wrong, not the library
    print(f"{PROG} {argv[0]}: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
