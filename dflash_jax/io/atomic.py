"""Atomic file writes: a reader of `path` sees the old file or the whole new one, never a part.

A file is written under a temporary name beside its destination (the same folder, so the
rename stays on one file system) and renamed over it once complete; on any error the
temporary file is removed and the destination is untouched. Every file gets the mode a plain
`open(path, "w")` would give it (0666 less the umask: 0644 under the usual 022), whatever
mode the writer created its temporary file with (some libraries use 0600).
"""
from __future__ import annotations

import contextlib
import json
import os
import uuid
from typing import Any, Iterator


# Temporary names handed out and not yet published: what an interrupted process removes
# (dflash_jax.cli's interrupt handler) so that no hidden half-written file is left behind.
_IN_FLIGHT: set[str] = set()


def in_flight() -> list[str]:
  """The temporary paths handed out by `temp_beside` and not yet published or discarded."""
  return sorted(_IN_FLIGHT)


def temp_beside(path: str | os.PathLike) -> str:
  """A fresh hidden temporary name in path's folder: `.NAME.<hex>.tmp` (remembered until
  `publish` or `discard`)."""
  directory, base = os.path.split(os.path.abspath(os.fspath(path)))
  tmp = os.path.join(directory, f".{base}.{uuid.uuid4().hex}.tmp")
  _IN_FLIGHT.add(tmp)
  return tmp


def discard(tmp: str) -> None:
  """Removes the temporary file `tmp` if it exists, and forgets the name."""
  try:
    os.unlink(tmp)
  except FileNotFoundError:
    pass
  _IN_FLIGHT.discard(tmp)


def _umask() -> int:
  mask = os.umask(0o022)   # reading the umask means setting it; restored at once
  os.umask(mask)
  return mask


def publish(tmp: str, path: str | os.PathLike) -> None:
  """Renames the finished temporary file `tmp` over `path`, with the default file mode."""
  os.chmod(tmp, 0o666 & ~_umask())
  os.replace(tmp, path)
  _IN_FLIGHT.discard(tmp)


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[str]:
  """Yields a temporary path to write (and close) inside the block; a clean exit renames it
  over `path`, an exception removes it and propagates."""
  tmp = temp_beside(path)
  try:
    yield tmp
    publish(tmp, path)
  finally:
    discard(tmp)


def write_text(path: str | os.PathLike, text: str) -> None:
  """text (UTF-8), atomically."""
  with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
    f.write(text)


def write_json(path: str | os.PathLike, obj: Any) -> None:
  """obj as indented JSON (UTF-8, a final newline), atomically."""
  write_text(path, json.dumps(obj, indent=2) + "\n")
