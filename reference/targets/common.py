"""numpy float64 pieces that several target families' references share."""
from __future__ import annotations

import numpy as np


def rms(x: np.ndarray, w, eps: float) -> np.ndarray:
  """x / sqrt(mean(x^2) + eps) * w over the last axis (w = 1.0 for a weight-less norm)."""
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def neox_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
              attention_scaling: float) -> np.ndarray:
  """NEOX rope of x [T, H, D] at positions [T] over the whole head: the float64 table of
  `dflash_jax.config.rope_inv_freq` (its scaling certified in tests/test_rope_scaling.py), cos
  and sin times the attention scaling as HF's rotary embedding applies it."""
  d = x.shape[-1]
  ang = positions[:, None, None].astype(np.float64) * inv_freq
  cos, sin = np.cos(ang) * attention_scaling, np.sin(ang) * attention_scaling
  x1, x2 = x[..., :d // 2], x[..., d // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def silu(x: np.ndarray) -> np.ndarray:
  return x / (1.0 + np.exp(-x))
