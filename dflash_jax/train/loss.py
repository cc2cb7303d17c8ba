"""The training objectives: DFlash's (SPEC.md section 10: anchors, block labels, decayed CE) and
the families' (SPEC_dflash2_dspark): DFlash2's block CE plus the selector's ranking loss,
DSpark's shifted-row CE plus the confidence head's BCE."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The paper's decay per block size; other sizes must state gamma.
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
# DSpark with shifted rows: DeepSpec's configs (block 7, weights exp(-k/4) from row 0).
SHIFTED_DEFAULT_GAMMA = {7: 4.0}


def resolve_gamma(block_size: int, gamma: float | None = None, shifted: bool = False) -> float:
  """gamma as given, else the default for block_size (16 -> 7, 10 -> 5, 8 -> 4; with shifted
  rows 7 -> 4)."""
  if gamma is None:
    table = SHIFTED_DEFAULT_GAMMA if shifted else DEFAULT_GAMMA
    if block_size not in table:
      raise ValueError(f"no default loss decay gamma for block_size {block_size} (defaults"
                       f"{' with shifted rows' if shifted else ''}: {table}); pass gamma "
                       "explicitly")
    return table[block_size]
  if not gamma > 0:
    raise ValueError(f"gamma must be > 0, got {gamma}")
  return float(gamma)


def row_decay(block_size: int, gamma: float, shifted: bool = False) -> np.ndarray:
  """[B] float32: 0 for row 0 (the anchor, no loss), exp(-(k-1)/gamma) for row k >= 1; with
  shifted rows (row k predicts x_{a+k+1}) exp(-k/gamma) for every row."""
  k = np.arange(block_size, dtype=np.float64)
  first = 0 if shifted else 1
  return np.where(k >= first, np.exp(-(k - first) / gamma), 0.0).astype(np.float32)


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
                  anchor_valid: jax.Array, block_size: int, gamma: float,
                  shifted: bool = False) -> tuple[jax.Array, jax.Array]:
  """Labels [S, A, B] int32 (row k of anchor a predicts x_{a+k}) and weights [S, A, B] f32:
  exp(-(k-1)/gamma) for rows 1..B-1 whose token exists (a + k < T), is in the loss mask and
  belongs to a valid anchor; 0 for row 0 and for every other row. shifted (DSpark's shifted
  rows): row k predicts x_{a+k+1} with weight exp(-k/gamma), row 0 included."""
  s, t = tokens.shape
  pos = (anchors.astype(jnp.int32)[..., None] + (1 if shifted else 0)
         + jnp.arange(block_size, dtype=jnp.int32))
  inside = pos < t
  idx = jnp.minimum(pos, t - 1).reshape(s, -1)
  labels = jnp.take_along_axis(tokens.astype(jnp.int32), idx, 1).reshape(pos.shape)
  in_mask = jnp.take_along_axis(loss_mask.astype(bool), idx, 1).reshape(pos.shape)
  keep = inside & in_mask & anchor_valid.astype(bool)[..., None]
  decay = jnp.asarray(row_decay(block_size, gamma, shifted))
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


# --- the families' terms ---------------------------------------------------------------------

def _weighted_mean(x: jax.Array, weights: jax.Array) -> jax.Array:
  return jnp.sum(weights * x) / jnp.maximum(jnp.sum(weights), 1e-9)


def accept_run(hit: jax.Array, weights: jax.Array, first_row: int) -> jax.Array:
  """Mean over anchors whose first draft row carries weight of the leading run of draft rows
  (from first_row) that hit their label with weight > 0: under teacher forcing, the drafts a
  greedy verifier would accept if the labels were its choices. hit, weights [S, A, B]."""
  ok = hit[..., first_row:] & (weights[..., first_row:] > 0)
  run = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)
  counted = weights[..., first_row] > 0
  return (jnp.sum(jnp.where(counted, run, 0)) / jnp.maximum(jnp.sum(counted), 1)
          ).astype(jnp.float32)


def selector_loss(label_score: jax.Array, scores: jax.Array, label_index: jax.Array,
                  weights: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
  """DFlash2's selector objective (ours; the sources publish no selector training): cross
  entropy of the label among the row's k candidates plus the label itself when it is not one
  of them, over the walk's scores with the true previous token as predecessor (teacher
  forcing), weighted like the block rows. scores [S, A, B, k], label_score / label_index /
  weights [S, A, B] (`forward.selector_scores`). Metrics: `sel_loss`, `sel_in_top_k` (the
  weighted share of labels among the candidates), `sel_accept` (`accept_run` of the walk's
  choices: what greedy decoding accepts from the walk under teacher forcing), `sel_row_acc`."""
  k = scores.shape[-1]
  inside = label_index < k
  extra = jnp.where(inside, -jnp.inf, label_score)
  ext = jnp.concatenate([scores, extra[..., None]], axis=-1)
  ce = jax.nn.logsumexp(ext, axis=-1) - jnp.take_along_axis(ext, label_index[..., None], -1)[..., 0]
  loss = _weighted_mean(ce, weights)
  hit = jnp.argmax(scores, -1) == label_index
  row_w = jnp.sum(weights, axis=(0, 1))
  row_acc = jnp.sum(jnp.where(hit, weights, 0.0), axis=(0, 1)) / jnp.maximum(row_w, 1e-9)
  return loss, dict(sel_loss=loss, sel_in_top_k=_weighted_mean(inside.astype(jnp.float32),
                                                               weights),
                    sel_accept=accept_run(hit, weights, 1), sel_row_acc=row_acc)


def total_variation(logits_p: jax.Array, logits_q: jax.Array) -> jax.Array:
  """TV(softmax(p), softmax(q)) = 0.5 sum |p - q| over the last axis."""
  p = jax.nn.softmax(logits_p.astype(jnp.float32), axis=-1)
  q = jax.nn.softmax(logits_q.astype(jnp.float32), axis=-1)
  return 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)


def confidence_loss(conf_logits: jax.Array, draft_logits: jax.Array, target_logits: jax.Array,
                    weights: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
  """DSpark's confidence objective (SPEC_dflash2_dspark 12.1): binary cross entropy of
  sigmoid(conf_logits) against 1 - TV(p_draft, p_target), the probability that a draft
  sampled from the draft row is accepted by the target at temperature 1 given the earlier rows
  were (the rows follow the teacher-forced path); the target is not differentiated. Weighted
  like the CE rows, as DeepSpec does. conf_logits / weights [S, A, B]; draft_logits /
  target_logits [S, A, B, V]. Metrics: `conf_bce`, `conf_mae` (weighted |conf - target|),
  `conf_target` (the weighted mean target)."""
  y = jax.lax.stop_gradient(jnp.clip(1.0 - total_variation(draft_logits, target_logits),
                                     0.0, 1.0))
  z = conf_logits.astype(jnp.float32)
  bce = jnp.maximum(z, 0.0) - y * z + jnp.log1p(jnp.exp(-jnp.abs(z)))
  loss = _weighted_mean(bce, weights)
  return loss, dict(conf_bce=loss, conf_mae=_weighted_mean(jnp.abs(jax.nn.sigmoid(z) - y),
                                                           weights),
                    conf_target=_weighted_mean(y, weights))
