"""What every checkpoint format of `dflash_jax.io` shares: its errors and the drafter weight check.

Each error is a ValueError whose message starts with the file (or the call) it is about, then
names the tensor or key. This module imports no format module, so every format imports it.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from dflash_jax.config import DFlashConfig, drafter_tensor_shapes, vocab_sized_tensors

# The target's tensors a drafter weights mapping may carry (SPEC.md section 2): savers skip them.
TARGET_TENSORS = ("tok_embd", "lm_head")


class GGUFFormatError(ValueError):
  """A file that is not a well-formed GGUF; the message names the file, the field, the limit."""


class SafetensorsFormatError(ValueError):
  """A safetensors file or index that is truncated, inconsistent or not safetensors at all."""


class DrafterFormatError(ValueError):
  """A drafter checkpoint (GGUF or HF folder), or weights given to `save_drafter`, that break
  docs/SPEC.md sections 2 and 8."""


class TargetFormatError(ValueError):
  """An HF target folder that does not hold the model its config.json describes."""


def drafter_error(where: str, message: str) -> DrafterFormatError:
  return DrafterFormatError(f"{where}: {message}")


def stored_target_copies(cfg: DFlashConfig) -> tuple[str, ...]:
  """The target's tensors a drafter file of cfg's family stores a copy of, when the weights
  hold them: DSpark's `embed_tokens` / `lm_head` (SPEC_dflash2_dspark 10.2-10.3; DeepSpec
  saves the whole state dict). DFlash and DFlash2 files never hold them."""
  return TARGET_TENSORS if cfg.family == "dspark" else ()


def drafter_vocab(cfg: DFlashConfig, shapes: Mapping[str, tuple[int, ...]], where: str,
                  stated: int | None = None) -> int | None:
  """The target vocabulary a drafter's tensors imply: the rows of the family's target-vocab-sized
  tables (`vocab_sized_tensors`) and of any stored target copy, which must all agree (and with
  `stated`, a file's own vocab_size, when given). None when no such tensor is present.
  `shapes` maps weights keys to shapes (absent keys are skipped)."""
  names = [n for n in (*vocab_sized_tensors(cfg), *stored_target_copies(cfg)) if n in shapes]
  rows = {n: int(shapes[n][0]) for n in names if len(shapes[n]) == 2}
  if stated is not None:
    rows["vocab_size"] = int(stated)
  if len(set(rows.values())) > 1:
    raise drafter_error(where, f"the target-vocabulary-sized tensors disagree on the vocabulary "
                        f"(rows {rows}); DFlash2 / DSpark tables have one row per target token")
  return next(iter(rows.values()), None)


def checked_drafter_weights(cfg: DFlashConfig, w: Mapping[str, np.ndarray],
                            where: str) -> dict[str, np.ndarray]:
  """Exactly the tensors a drafter file of cfg stores, from `w`, as finite, C-contiguous float32
  arrays of the schema's shapes: the drafter's own tensors, and for DSpark the target copies
  when `w` holds both (`stored_target_copies`); the target's `tok_embd` / `lm_head` of other
  families are dropped. Anything else is an error naming `where` and the weight."""
  copies = [n for n in stored_target_copies(cfg) if n in w]
  if copies and len(copies) != len(stored_target_copies(cfg)):
    raise drafter_error(where, f"weights hold {copies} but not the other of "
                        f"{list(stored_target_copies(cfg))}: a DSpark file stores both target "
                        "copies or neither")
  n_vocab = drafter_vocab(cfg, {n: np.shape(a) for n, a in w.items()}, where)
  try:
    expected = drafter_tensor_shapes(cfg, n_vocab)
  except ValueError as e:
    raise drafter_error(where, str(e)) from e
  expected.update({n: (n_vocab, cfg.n_embd) for n in copies})
  extra = sorted(set(w) - set(expected) - set(TARGET_TENSORS))
  if extra:
    raise drafter_error(where, f"unknown weights {extra} (not a drafter tensor; refusing to "
                        "drop them)")
  missing = [n for n in expected if n not in w]
  if missing:
    raise drafter_error(where, f"missing weights {missing}")
  arrays = {}
  for name, shape in expected.items():
    a = np.asarray(w[name], dtype=np.float32)
    if a.shape != shape:
      raise drafter_error(where, f"weight {name} has shape {a.shape}, expected {shape}")
    if not np.isfinite(a).all():
      raise drafter_error(where, f"weight {name} has {int((~np.isfinite(a)).sum())} non-finite "
                          "values")
    arrays[name] = np.ascontiguousarray(a)
  return arrays
