"""Offline training data: the Python standard library's sources as a byte-level corpus.

Every machine with Python has the corpus (`sysconfig.get_paths()["stdlib"]`); files are
listed in sorted order and split into train / held-out by a hash of their relative path, so
the split does not depend on which other files a Python version ships. Tokens are bytes
(0..255) plus a few specials (`ByteTokenizer`); batches are a pure function of
(seed, step), which is all a checkpoint needs to resume the data order.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
import time
from typing import Callable

import flax.struct
import numpy as np

from dflash_jax.train.loss import epoch_anchors


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """Bytes 0..255, then EOS (end of a document), MASK (the drafter's mask token), PAD.

  vocab_size is padded to a multiple of 16 (GEMM tiles); ids past PAD are never produced.
  """
  eos_id: int = 256
  mask_id: int = 257
  pad_id: int = 258
  vocab_size: int = 272

  def encode(self, data: str | bytes) -> np.ndarray:
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    return np.frombuffer(raw, np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    """Bytes as UTF-8 (invalid sequences replaced); specials as <eos>, <mask>, <pad>."""
    names = {self.eos_id: "<eos>", self.mask_id: "<mask>", self.pad_id: "<pad>"}
    out, run = [], bytearray()
    for i in np.asarray(ids).reshape(-1).tolist():
      if 0 <= i < 256:
        run.append(i)
        continue
      out.append(run.decode("utf-8", "replace"))
      run = bytearray()
      out.append(names.get(i, f"<{i}>"))
    out.append(run.decode("utf-8", "replace"))
    return "".join(out)


  def hf_json(self) -> str:
    """This tokenizer as a `tokenizers` JSON (what `train-target` writes as tokenizer.json, so
    that `generate --prompt` and `eval` read text with the target's own tokenizer): a BPE
    without merges over the 256 byte symbols (ByteLevel's byte-to-character mapping, no
    prefix space, no splitting), so byte b is id b, and EOS / MASK / PAD as special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    symbols = pre_tokenizers.ByteLevel.alphabet()
    table = _byte_symbols()
    assert sorted(table.values()) == sorted(symbols), "ByteLevel's alphabet changed"
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = {self.eos_id: "<eos>", self.mask_id: "<mask>", self.pad_id: "<pad>"}
    assert sorted(specials) == list(range(256, 256 + len(specials)))
    tok.add_special_tokens([AddedToken(specials[i], special=True) for i in sorted(specials)])
    return tok.to_str(pretty=True)


def _byte_symbols() -> dict[int, str]:
  """ByteLevel's (GPT-2's) printable character for each byte: printable Latin-1 bytes stand
  for themselves, the others take the characters from U+0100 on, in byte order."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
          *range(ord("\xae"), ord("\xff") + 1)]
  out, extra = {b: chr(b) for b in keep}, 0
  for b in range(256):
    if b not in out:
      out[b] = chr(256 + extra)
      extra += 1
  return out


TOKENIZER = ByteTokenizer()


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def list_sources(root: str | None = None, max_bytes: int = 1 << 20) -> list[str]:
  """Relative paths of the .py files under root (default: this Python's stdlib), sorted;
  site-packages, __pycache__ and files over max_bytes are skipped."""
  root = root or stdlib_root()
  if not os.path.isdir(root):
    raise ValueError(f"corpus root {root!r} is not a directory")
  out = []
  for d, dirs, files in os.walk(root):
    dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "__pycache__"))
    for f in sorted(files):
      p = os.path.join(d, f)
      if f.endswith(".py") and os.path.getsize(p) <= max_bytes:
        out.append(os.path.relpath(p, root))
  if not out:
    raise ValueError(f"no .py files under {root!r}")
  return sorted(out)


def is_held_out(relpath: str, every: int = 20) -> bool:
  """A file is held out for evaluation when the hash of its relative path is 0 mod `every`."""
  h = int.from_bytes(hashlib.sha1(relpath.replace(os.sep, "/").encode()).digest()[:8], "little")
  return h % every == 0


def split_sources(files: list[str], every: int = 20) -> tuple[list[str], list[str]]:
  """(train, held_out) by `is_held_out`; both keep the sorted order."""
  held = [f for f in files if is_held_out(f, every)]
  return [f for f in files if not is_held_out(f, every)], held


def read_tokens(root: str, files: list[str], tok: ByteTokenizer = TOKENIZER) -> np.ndarray:
  """All files' bytes in order, each followed by EOS: one int32 stream."""
  parts = []
  for f in files:
    with open(os.path.join(root, f), "rb") as fh:
      parts.append(tok.encode(fh.read()))
    parts.append(np.array([tok.eos_id], np.int32))
  return np.concatenate(parts) if parts else np.zeros(0, np.int32)


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
  """A target's own tokenizer (a `tokenizers.Tokenizer`, e.g. read from its tokenizer.json)
  for the corpus: each file's text is encoded, followed by `eos` (when not None)."""
  tokenizer: object
  eos: int | None = None

  def encode(self, text: str) -> np.ndarray:
    ids = self.tokenizer.encode(text).ids
    return np.asarray(ids + ([] if self.eos is None else [self.eos]), np.int32)


def read_text_tokens(root: str, files: list[str], tok: TextTokenizer) -> np.ndarray:
  """All files' text (UTF-8; invalid bytes replaced) encoded by tok, in order: one stream."""
  parts = []
  for f in files:
    with open(os.path.join(root, f), "rb") as fh:
      parts.append(tok.encode(fh.read().decode("utf-8", "replace")))
  return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def chunk(stream: np.ndarray, seq_len: int) -> np.ndarray:
  """[N, seq_len] consecutive windows of the stream (the tail shorter than seq_len dropped)."""
  n = stream.shape[0] // seq_len
  if n == 0:
    raise ValueError(f"the token stream ({stream.shape[0]} tokens) is shorter than one "
                     f"sequence of {seq_len}")
  return stream[:n * seq_len].reshape(n, seq_len)


def epoch_rows(n_rows: int, batch_size: int, seed: int, step: int) -> tuple[int, np.ndarray]:
  """(epoch, row indices) of batch `step`: each epoch is a fresh seeded permutation of the rows
  (the last partial batch of an epoch is dropped), so batch `step` needs no history."""
  per_epoch = n_rows // batch_size
  if per_epoch == 0:
    raise ValueError(f"batch_size {batch_size} exceeds the {n_rows} sequences")
  epoch, i = divmod(int(step), per_epoch)
  perm = np.random.default_rng((seed, epoch)).permutation(n_rows)
  return epoch, perm[i * batch_size:(i + 1) * batch_size]


def map_batches(fn, rows: np.ndarray, batch_size: int, *, stop_at: float | None = None,
                progress: Callable[[int, int, float], None] | None = None) -> np.ndarray:
  """np.concatenate of fn(batch) over rows [N, ...] taken batch_size at a time, every batch
  padded to batch_size rows (repeating its last row) so fn compiles once; padding rows of the
  result are dropped. stop_at (a time.perf_counter() value): no batch starts that the last
  batch's time says would end past it, and the result holds the rows done by then (at least
  one batch). progress(rows done, N, seconds of the last batch) after each batch."""
  out, last = [], None
  for i in range(0, rows.shape[0], batch_size):
    t = time.perf_counter()
    if out and stop_at is not None and t + (last or 0.0) > stop_at:
      break
    chunk = rows[i:i + batch_size]
    pad = batch_size - chunk.shape[0]
    full = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)]) if pad else chunk
    out.append(np.asarray(fn(full))[:chunk.shape[0]])
    last = time.perf_counter() - t
    if progress is not None:
      progress(i + chunk.shape[0], rows.shape[0], last)
  return np.concatenate(out)


@flax.struct.dataclass
class DrafterBatch:
  """One drafter batch (a pytree; numpy from `DrafterData.batch`): tokens [S, T] int32,
  loss_mask [S, T] bool, anchors [S, A] int32, anchor_valid [S, A] bool."""
  tokens: np.ndarray
  loss_mask: np.ndarray
  anchors: np.ndarray
  anchor_valid: np.ndarray


@dataclasses.dataclass(frozen=True)
class DrafterData:
  """Sequences [N, T] with their loss masks; `batch(step)` draws `batch_size` of them (a seeded
  permutation per epoch) with up to `n_anchors` anchors each, resampled every epoch."""
  tokens: np.ndarray
  loss_mask: np.ndarray
  batch_size: int
  n_anchors: int
  seed: int = 0

  def __post_init__(self):
    if self.tokens.ndim != 2 or self.loss_mask.shape != self.tokens.shape:
      raise ValueError(f"tokens [N, T] and loss_mask of the same shape expected, got "
                       f"{self.tokens.shape} and {self.loss_mask.shape}")

  @property
  def steps_per_epoch(self) -> int:
    return self.tokens.shape[0] // self.batch_size

  def rows(self, step: int) -> np.ndarray:
    """The sequence indices of batch `step` (e.g. to look up cached features)."""
    return epoch_rows(self.tokens.shape[0], self.batch_size, self.seed, step)[1]

  def batch(self, step: int) -> DrafterBatch:
    epoch, rows = epoch_rows(self.tokens.shape[0], self.batch_size, self.seed, step)
    picks = [epoch_anchors(self.loss_mask[r], self.n_anchors, self.seed, epoch, int(r))
             for r in rows]
    return DrafterBatch(tokens=self.tokens[rows].astype(np.int32),
                        loss_mask=self.loss_mask[rows].astype(bool),
                        anchors=np.stack([a for a, _ in picks]),
                        anchor_valid=np.stack([v for _, v in picks]))
