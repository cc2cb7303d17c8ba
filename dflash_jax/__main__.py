"""`python -m dflash_jax <command>`: one subcommand per job (modules under dflash_jax/cli/)."""
from __future__ import annotations

import importlib
import os
import sys

from dflash_jax.cli import CLIError, Parser, enable_compile_cache, install_interrupt_handler

# Each module dflash_jax.cli.<name> (dashes in a command's name are underscores in its module's)
# defines register(subparsers), which adds its parser and sets `run` (args -> exit status) as
# the parser's default.
COMMANDS = ("demo", "generate", "eval", "train-target", "train-drafter", "convert", "simulate")
PROG = "python -m dflash_jax"


def _parser() -> Parser:
  p = Parser(prog=PROG, description="DFlash block-diffusion speculative decoding in JAX. "
             "Without a command: demo.")
  sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
  for name in COMMANDS:
    importlib.import_module(f"dflash_jax.cli.{name.replace('-', '_')}").register(sub)
  return p


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
    argv = ["demo"] + argv   # the main job is the default
  if argv[0] not in COMMANDS + ("-h", "--help"):
    print(f"{PROG}: error: unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)}; "
          f"see {PROG} --help)", file=sys.stderr)
    return 2
  try:
    args = _parser().parse_args(argv)
    enable_compile_cache(args.compile_cache)
    return args.run(args)
  except CLIError as e:   # one line, no traceback: the command line is wrong, not the library
    print(f"{PROG} {argv[0]}: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2


def run() -> int:
  """The process entry: interrupts stop it at once (`install_interrupt_handler`), and a reader
  that closes the output early (`... | head`) ends it quietly."""
  install_interrupt_handler(PROG)
  try:
    return main()
  except BrokenPipeError:
    # Python would report the broken pipe again when it flushes stdout at exit.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + 13   # as if SIGPIPE had ended the process


if __name__ == "__main__":
  sys.exit(run())
