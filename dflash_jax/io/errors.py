"""What every checkpoint format of `dflash_jax.io` shares: its errors and the drafter weight check.

Each error is a ValueError whose message starts with the file (or the call) it is about, then
names the tensor or key. This module imports no format module, so every format imports it.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from dflash_jax.config import DFlashConfig, drafter_tensor_shapes

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


def checked_drafter_weights(cfg: DFlashConfig, w: Mapping[str, np.ndarray],
                            where: str) -> dict[str, np.ndarray]:
  """Exactly the drafter's tensors of `w` (the target's `tok_embd` / `lm_head` dropped) as
  finite, C-contiguous float32 arrays of the schema's shapes; anything else is an error naming
  `where` and the weight."""
  expected = drafter_tensor_shapes(cfg)
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
