"""Static drafter configuration (SPEC.md section 2) and the host rope table."""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  """Everything about a drafter's shape that a compiled step depends on.

  Frozen and hashable, so it can be a static argument of `jax.jit`.
  `target_layers` follows llama.cpp: HF `target_layer_ids` + 1.
  `window` is the ring size from the GGUF (None when the file has none; callers
  then choose, default 2048).
  """
  n_layer: int
  n_embd: int
  n_ff: int
  n_head: int
  n_head_kv: int
  head_dim: int
  rope_theta: float
  eps: float
  target_layers: tuple[int, ...]
  mask_token_id: int
  block_size: int = 16
  window: int | None = None

  def __post_init__(self):
    problems = []
    for name in ("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim", "block_size"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or v <= 0:
        problems.append(f"{name} must be a positive int, got {v!r}")
    if not problems and self.n_head % self.n_head_kv:
      problems.append(f"n_head ({self.n_head}) must be a multiple of n_head_kv ({self.n_head_kv})")
    if not problems and self.head_dim % 2:
      problems.append(f"head_dim must be even for NEOX rope, got {self.head_dim}")
    if not self.target_layers:
      problems.append("target_layers is empty")
    if not (self.rope_theta > 0):
      problems.append(f"rope_theta must be > 0, got {self.rope_theta!r}")
    if not (self.eps > 0):
      problems.append(f"eps must be > 0, got {self.eps!r}")
    if self.mask_token_id < 0:
      problems.append(f"mask_token_id must be >= 0, got {self.mask_token_id}")
    if self.window is not None and self.window <= 0:
      problems.append(f"window must be positive or None, got {self.window}")
    if problems:
      raise ValueError("invalid DFlashConfig: " + "; ".join(problems))
    object.__setattr__(self, "target_layers", tuple(int(t) for t in self.target_layers))

  @property
  def n_target_layers(self) -> int:
    return len(self.target_layers)

  @property
  def n_embd_fc(self) -> int:
    """Width of one feature row: the captured target layers concatenated."""
    return self.n_target_layers * self.n_embd

  @property
  def group(self) -> int:
    """Query heads per kv head (contiguous GQA groups)."""
    return self.n_head // self.n_head_kv

  def resolve_window(self, window: int | None = None) -> int:
    """The ring size: an explicit `window`, else the file's, else 2048."""
    w = window if window is not None else (self.window if self.window is not None else 2048)
    if w <= 0:
      raise ValueError(f"window must be positive, got {w}")
    return int(w)


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
  """NEOX inverse frequencies theta^(-2i/hd), i < hd/2: computed in float64, returned as float32.

  Computed on the host so no device pow is involved and every device sees the same table.
  """
  i = np.arange(head_dim // 2, dtype=np.float64)
  return (float(theta) ** (-2.0 * i / head_dim)).astype(np.float32)
