"""`python -m dflash_jax <command>`: one subcommand per job (modules under dflash_jax/cli/)."""
from __future__ import annotations

import argparse
import importlib
import sys

# Each module dflash_jax.cli.<name> (dashes in a command's name are underscores in its module's)
# defines register(subparsers), which adds its parser and sets `run` (args -> exit status) as
# the parser's default.
COMMANDS = ("demo", "convert", "generate", "train-target", "train-drafter", "eval")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m dflash_jax",
                              description="DFlash block-diffusion speculative decoding in JAX")
  sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
  for name in COMMANDS:
    importlib.import_module(f"dflash_jax.cli.{name.replace('-', '_')}").register(sub)
  return p


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] not in COMMANDS + ("-h", "--help"):
    argv = ["demo"] + argv   # the main job is the default
  args = _parser().parse_args(argv)
  return args.run(args)


if __name__ == "__main__":
  sys.exit(main())
