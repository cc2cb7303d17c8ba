"""The DFlash training objective (SPEC.md section 10): anchors, block labels, decayed CE."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The paper's decay per block size; other sizes must state gamma.
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def resolve_gamma(block_size: int, gamma: float | None = None) -> float:
  """gamma as given, else the default for block_size (16 -> 7, 10 -> 5, 8 -> 4)."""
  if gamma is None:
    if block_size not in DEFAULT_GAMMA:
      raise ValueError(f"no default loss decay gamma for block_size {block_size} (defaults: "
                       f"{DEFAULT_GAMMA}); pass gamma explicitly")
    return DEFAULT_GAMMA[block_size]
  if not gamma > 0:
    raise ValueError(f"gamma must be > 0, got {gamma}")
  return float(gamma)


def row_decay(block_size: int, gamma: float) -> np.ndarray:
  """[B] float32: 0 for row 0 (the anchor, no loss), exp(-(k-1)/gamma) for row k >= 1."""
  k = np.arange(block_size, dtype=np.float64)
  return np.where(k >= 1, np.exp(-(k - 1) / gamma), 0.0).astype(np.float32)


def eligible_anchors(loss_mask: np.ndarray) -> np.ndarray:
  """Positions a (int64) whose next token a + 1 exists and is in the loss mask."""
  m = np.asarray(loss_mask, bool)
  if m.ndim != 1:
    raise ValueError(f"loss_mask must be one sequence [T], got shape {m.shape}")
  return np.nonzero(m[1:])[0]


def sample_anchors(loss_mask: np.ndarray, n_anchors: int, rng: np.random.Generator
                   ) -> tuple[np.ndarray, np.ndarray]:
  """Up to n_anchors distinct anchors, uniform among `eligible_anchors(loss_mask)`.

  Returns (anchors [n_anchors] int32 ascending, valid [n_anchors] bool); when fewer positions
  are eligible, all of them are taken and the rest are padding (anchor 0, valid False).
  """
  if n_anchors < 1:
    raise ValueError(f"n_anchors must be >= 1, got {n_anchors}")
  pool = eligible_anchors(loss_mask)
  take = min(n_anchors, pool.size)
  chosen = np.sort(rng.choice(pool, size=take, replace=False)) if take else pool[:0]
  anchors = np.zeros(n_anchors, np.int32)
  anchors[:take] = chosen
  valid = np.arange(n_anchors) < take
  return anchors, valid


def epoch_anchors(loss_mask: np.ndarray, n_anchors: int, seed: int, epoch: int, index: int
                  ) -> tuple[np.ndarray, np.ndarray]:
  """The anchors of sequence `index` in `epoch`: resampled every epoch, a function of
  (seed, epoch, index) alone, so any batch can be rebuilt in any order (resuming)."""
  return sample_anchors(loss_mask, n_anchors, np.random.default_rng((seed, epoch, index)))


def block_targets(tokens: jax.Array, loss_mask: jax.Array, anchors: jax.Array,
                  anchor_valid: jax.Array, block_size: int, gamma: float
                  ) -> tuple[jax.Array, jax.Array]:
  """Labels [S, A, B] int32 (row k of anchor a predicts x_{a+k}) and weights [S, A, B] f32:
  exp(-(k-1)/gamma) for rows 1..B-1 whose token exists (a + k < T), is in the loss mask and
  belongs to a valid anchor; 0 for row 0 and for every other row."""
  s, t = tokens.shape
  pos = anchors.astype(jnp.int32)[..., None] + jnp.arange(block_size, dtype=jnp.int32)
  inside = pos < t
  idx = jnp.minimum(pos, t - 1).reshape(s, -1)
  labels = jnp.take_along_axis(tokens.astype(jnp.int32), idx, 1).reshape(pos.shape)
  in_mask = jnp.take_along_axis(loss_mask.astype(bool), idx, 1).reshape(pos.shape)
  keep = inside & in_mask & anchor_valid.astype(bool)[..., None]
  decay = jnp.asarray(row_decay(block_size, gamma))
  return labels, jnp.where(keep, decay, 0.0).astype(jnp.float32)


def block_loss(logits: jax.Array, labels: jax.Array, weights: jax.Array
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Weighted mean cross entropy sum(w ce) / sum(w) over the block rows, and metrics.

  logits [S, A, B, V] (float32), labels / weights [S, A, B]. Metrics: `loss`, `weight` (the
  normaliser), `row_acc` [B] (weighted argmax accuracy per row), `accept` (mean over anchors
  with a loss-bearing row 1 of the leading run of rows whose argmax is the label and whose
  weight is > 0: the drafts a greedy verifier would accept if the labels were its choices).
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  ce = -jnp.take_along_axis(logp, labels[..., None], -1)[..., 0]
  total = jnp.sum(weights)
  denom = jnp.maximum(total, 1e-9)
  loss = jnp.sum(weights * ce) / denom
  hit = (jnp.argmax(logits, -1) == labels) & (weights > 0)
  row_w = jnp.sum(weights, axis=(0, 1))
  row_acc = jnp.sum(jnp.where(hit, weights, 0.0), axis=(0, 1)) / jnp.maximum(row_w, 1e-9)
  run = jnp.sum(jnp.cumprod(hit[..., 1:].astype(jnp.int32), axis=-1), axis=-1)
  counted = weights[..., 1] > 0
  accept = jnp.sum(jnp.where(counted, run, 0)) / jnp.maximum(jnp.sum(counted), 1)
  return loss, dict(loss=loss, weight=total, row_acc=row_acc, accept=accept.astype(jnp.float32))
