"""Subcommands of `python -m dflash_jax`: one module per job, each with `register(subparsers)`.

Argument errors are one line and exit status 2, never a traceback: `Parser` (the class of every
subparser, since argparse gives subparsers their parent's class) turns argparse's own errors
into `CLIError`, and `main` prints any CLIError a subcommand raises, as
`python -m dflash_jax <command>: error: <message>`. Validate with the argparse types below where
a value alone decides; raise CLIError naming the argument and its allowed range where the limit
depends on other arguments or on the drafter, and do it before any long work starts (loading
weights, training, decoding). Every option's default is shown by `--help` (an option whose
default is None says in its help what None means).

Interrupts: `python -m dflash_jax` (the process entry, not `main()` called in-process) stops
within moments of SIGINT or SIGTERM, even inside a long XLA call: a thread woken by the signal
(`install_interrupt_handler`) removes what `on_interrupt` registered and every temporary file
an atomic write left (`io.atomic.in_flight`), prints one line and exits 128 + signal.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator


class CLIError(Exception):
  """A bad command line: printed as one line, exit status 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Appends each option's default to its help, except None (the help says what None means).
  Lines break at spaces only, so a path or a name with hyphens stays whole."""

  def _get_help_string(self, action):
    if action.default is None:
      return action.help
    return super()._get_help_string(action)

  def _split_lines(self, text, width):
    import textwrap
    return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False,
                         break_long_words=False)


class Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are CLIErrors and whose help shows the defaults."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("formatter_class", HelpFormatter)
    super().__init__(*args, **kwargs)

  def error(self, message: str):
    raise CLIError(f"{message} (see --help)")


# What an interrupt removes: callbacks registered by `on_interrupt` (e.g. a temporary folder).
_CLEANUPS: list[Callable[[], None]] = []


@contextlib.contextmanager
def on_interrupt(cleanup: Callable[[], None]) -> Iterator[None]:
  """Within the block, an interrupt (SIGINT / SIGTERM) runs cleanup() before the exit."""
  _CLEANUPS.append(cleanup)
  try:
    yield
  finally:
    _CLEANUPS.remove(cleanup)


def _clean_up() -> None:
  from dflash_jax.io import atomic
  for fn in list(_CLEANUPS):
    with contextlib.suppress(Exception):
      fn()
  for tmp in atomic.in_flight():
    with contextlib.suppress(OSError):
      os.unlink(tmp)


def install_interrupt_handler(prog: str) -> None:
  """SIGINT / SIGTERM end the process within moments, whatever the main thread is doing.

  Python runs a signal handler in the main thread between bytecodes, so it waits for a long
  XLA compile or computation to return (minutes). The C-level handler Python installs does
  act at once, though: it writes the signal's number to the wakeup fd (`signal.set_wakeup_fd`).
  A daemon thread blocked on that pipe wakes, removes the registered leftovers, prints one line
  (no traceback) and ends the process with os._exit(128 + signal). Call from the main thread."""
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  signal.set_wakeup_fd(write_fd)
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: None)   # the thread below acts; the main thread carries on

  def wait() -> None:
    sig = os.read(read_fd, 1)[0]
    _clean_up()
    with contextlib.suppress(Exception):
      sys.stdout.flush()
    with contextlib.suppress(Exception):
      print(f"\n{prog}: stopped by {signal.Signals(sig).name}", file=sys.stderr, flush=True)
    os._exit(128 + sig)

  threading.Thread(target=wait, name="dflash-jax-signals", daemon=True).start()


def default_compile_cache() -> str:
  """$DFLASH_JAX_COMPILE_CACHE if set (a folder, or "off"), else $XDG_CACHE_HOME/dflash_jax/jax
  ($XDG_CACHE_HOME defaults to ~/.cache)."""
  env = os.environ.get("DFLASH_JAX_COMPILE_CACHE")
  if env:
    return env
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "dflash_jax", "jax")


def add_common_args(p: argparse.ArgumentParser) -> None:
  """Options every subcommand takes."""
  p.add_argument("--compile-cache", metavar="DIR|off", default=default_compile_cache(),
                 help="JAX's persistent compilation cache: compiled programs are kept in DIR "
                      "and reused by later runs of the same shapes, the decoding loop's "
                      "without tracing (DIR/programs) ('off': compile every run; "
                      "the default comes from $DFLASH_JAX_COMPILE_CACHE, else "
                      "$XDG_CACHE_HOME/dflash_jax/jax)")


def enable_compile_cache(where: str) -> str | None:
  """Points JAX's persistent compilation cache at `where` (created if needed), unless it is
  "off"; every compiled program is kept, however fast it compiled (JAX's default keeps only
  those over a second, and a CLI run compiles many smaller ones). Returns the folder or None."""
  if where.lower() == "off":
    return None
  import jax
  try:
    os.makedirs(where, exist_ok=True)
  except OSError as e:
    raise CLIError(f"argument --compile-cache: cannot create {where!r} ({e.strerror}); pass "
                   "another folder or 'off'") from None
  jax.config.update("jax_compilation_cache_dir", where)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return where


def resolve_impl(impl: str) -> str:
  """"auto" -> the fastest correct implementation on this backend: the Pallas kernels on a GPU,
  their pure-jnp twins elsewhere (on CPU the kernels run in interpret mode: exact but slow)."""
  if impl != "auto":
    return impl
  import jax
  return "pallas" if jax.default_backend() == "gpu" else "xla"


IMPL_HELP = ("the drafter's and the target's kernels: pallas (the Pallas kernels; the target's "
             "are batch invariant, so greedy output equals target-only decoding in bf16 too), "
             "xla (XLA's GEMMs and attention, the drafter's pure-jnp twins), or auto (pallas "
             "on a GPU, xla elsewhere)")


def check_new_output(path: str, argument: str, force: bool, *, folder: bool) -> None:
  """Refuses, before any work, an output that would overwrite something: an existing file (or
  a non-empty folder, for folder outputs) unless force; a file where a folder goes, or the
  reverse, always."""
  if folder:
    if os.path.exists(path) and not os.path.isdir(path):
      raise CLIError(f"argument {argument}: {path!r} is a file; this output is a folder")
    if os.path.isdir(path) and os.listdir(path) and not force:
      raise CLIError(f"argument {argument}: {path!r} is not empty (pass --force to write "
                     "into it)")
  else:
    if os.path.isdir(path):
      raise CLIError(f"argument {argument}: {path!r} is a folder; this output is a file")
    if os.path.exists(path) and not force:
      raise CLIError(f"argument {argument}: {path!r} exists (pass --force to replace it)")


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


def existing_path(text: str) -> str:
  """An argparse type: the path of an existing file or folder."""
  if not os.path.exists(text):
    raise argparse.ArgumentTypeError(f"no such file or folder: {text!r}")
  return text


def load_tokenizer(folder: str):
  """folder/tokenizer.json read with the `tokenizers` package, or None when there is none."""
  path = os.path.join(folder, "tokenizer.json")
  if not os.path.isfile(path):
    return None
  from tokenizers import Tokenizer
  try:
    return Tokenizer.from_file(path)
  except Exception as e:   # tokenizers raises its own exception types
    raise CLIError(f"{path}: cannot read it ({' '.join(str(e).split())})") from None


class TextStream:
  """Prints a sequence's tokens as they are committed: text when a tokenizer is given (the
  newly decoded suffix; a character whose bytes span tokens waits for its last one), else
  ids. Records (time, tokens) at each call."""

  def __init__(self, tokenizer, out=None):
    self.tok, self.out = tokenizer, out or sys.stdout
    self.ids: list[int] = []
    self.shown = ""
    self.marks: list[tuple[float, int]] = []

  def __call__(self, slot: int, new: list[int]) -> None:
    import time
    self.ids += new
    if self.tok is None:
      self.out.write(("" if len(self.ids) == len(new) else " ") + " ".join(map(str, new)))
    else:
      text = self.tok.decode(self.ids).rstrip("\ufffd")   # an incomplete character
      if text.startswith(self.shown):
        self.out.write(text[len(self.shown):])
        self.shown = text
    self.out.flush()
    self.marks.append((time.perf_counter(), len(self.ids)))

  def finish(self) -> None:
    """The rest of the text (a trailing incomplete character as U+FFFD), then a newline."""
    if self.tok is not None:
      text = self.tok.decode(self.ids)
      if text.startswith(self.shown):
        self.out.write(text[len(self.shown):])
    self.out.write("\n")
    self.out.flush()


def load_target_arg(path: str, dtype, argument: str = "--target"):
  """load_target(path, dtype) with its errors as a CLIError naming the argument."""
  from dflash_jax.models import load_target
  try:
    return load_target(path, dtype=dtype)
  except (ValueError, OSError) as e:
    raise CLIError(f"argument {argument}: {e}") from None


def drafter_fits(dcfg, tcfg, drafter: str, target: str, argument: str = "--drafter") -> None:
  """Refuses, naming both arguments and the drafter's config fields, a drafter that cannot
  run against this target: its n_embd against the target's hidden_size, its target_layers (HF
  target_layer_ids + 1) against the target's layers, its mask token against the vocab."""
  where = f"argument {argument}: {drafter}"
  if dcfg.n_embd != tcfg.hidden_size:
    raise CLIError(f"{where}: its n_embd {dcfg.n_embd} != the hidden_size {tcfg.hidden_size} "
                   f"of --target {target}")
  try:
    tcfg.check_capture_layers(dcfg.target_layers)
  except ValueError:
    raise CLIError(f"{where}: its target_layers {list(dcfg.target_layers)} (HF "
                   f"target_layer_ids + 1) do not fit --target {target}, whose "
                   f"{tcfg.n_layers} layers give hidden states 0..{tcfg.n_layers}") from None
  if not 0 <= dcfg.mask_token_id < tcfg.vocab_size:
    raise CLIError(f"{where}: its mask_token_id {dcfg.mask_token_id} is outside the vocab "
                   f"[0, {tcfg.vocab_size}) of --target {target}")


def load_drafter_arg(path: str, tcfg, tparams, target: str, dtype, *, draft_window=None,
                     argument: str = "--drafter"):
  """The drafter at path as device params for this target (`prepare_weights` with the
  target's embedding and LM head as the device arrays they are, docs/SPEC.md section 1),
  checked against it first (`drafter_fits`); errors name the argument."""
  from dflash_jax.io import load_drafter
  try:
    dcfg, w = load_drafter(path)
  except (ValueError, OSError) as e:
    raise CLIError(f"argument {argument}: {e}") from None
  if draft_window is not None:
    dcfg = dcfg.with_draft_window(draft_window)
  drafter_fits(dcfg, tcfg, path, target, argument)
  try:
    from dflash_jax.drafter.weights import prepare_weights
    return prepare_weights(dcfg, {**w, "tok_embd": tparams.embed, "lm_head": tparams.head},
                           dtype)
  except ValueError as e:
    raise CLIError(f"argument {argument}: {path}: {e}") from None
