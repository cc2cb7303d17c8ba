"""The training objective (SPEC.md section 10) against plain numpy on tiny cases."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.train import loss as L

_targets = jax.jit(L.block_targets, static_argnames=("block_size", "gamma"))
_loss = jax.jit(L.block_loss)


def test_gamma_defaults_and_decay():
  assert [L.resolve_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
  with pytest.raises(ValueError, match="block_size 12"):
    L.resolve_gamma(12)
  assert L.resolve_gamma(12, 3.0) == 3.0
  d = L.row_decay(8, 4.0)
  assert d[0] == 0 and d[1] == 1
  np.testing.assert_allclose(d[1:], [np.exp(-k / 4.0) for k in range(7)], rtol=1e-6)


def test_anchors_are_uniform_over_eligible_positions():
  """Eligible = next token in the loss mask. 40 eligible of 64; 8 drawn per epoch: each
  eligible position is drawn with probability 1/5. Over 2000 epochs the counts are binomial
  (n 2000, p 0.2, sd ~17.9); every count within 5 sd of 400 (false alarm < 1e-4 for all 40)."""
  rng = np.random.default_rng(0)
  mask = np.zeros(64, bool)
  mask[rng.choice(np.arange(1, 64), 40, replace=False)] = True
  eligible = set(np.nonzero(mask)[0] - 1)
  counts = np.zeros(64, int)
  for epoch in range(2000):
    a, valid = L.epoch_anchors(mask, 8, seed=1, epoch=epoch, index=3)
    assert valid.all() and len(set(a.tolist())) == 8 and (np.diff(a) > 0).all()
    assert set(a.tolist()) <= eligible
    counts[a] += 1
  sd = np.sqrt(2000 * 0.2 * 0.8)
  assert np.abs(counts[sorted(eligible)] - 400).max() < 5 * sd
  # Resampled per epoch, reproducible from (seed, epoch, index).
  a0, _ = L.epoch_anchors(mask, 8, 1, 0, 3)
  np.testing.assert_array_equal(a0, L.epoch_anchors(mask, 8, 1, 0, 3)[0])
  assert not np.array_equal(a0, L.epoch_anchors(mask, 8, 1, 1, 3)[0])


def test_short_sequences_pad_with_invalid_anchors():
  mask = np.array([0, 1, 0, 1, 1], bool)   # eligible anchors 0, 2, 3
  a, valid = L.sample_anchors(mask, 5, np.random.default_rng(0))
  np.testing.assert_array_equal(a[valid], [0, 2, 3])
  assert valid.sum() == 3 and (a[~valid] == 0).all()
  a, valid = L.sample_anchors(np.zeros(5, bool), 2, np.random.default_rng(0))
  assert not valid.any()


def _numpy_loss(logits, tokens, mask, anchors, valid, gamma):
  s_n, a_n, b, v = logits.shape
  t = tokens.shape[1]
  num = den = 0.0
  for s in range(s_n):
    for j in range(a_n):
      if not valid[s, j]:
        continue
      a = anchors[s, j]
      for k in range(1, b):
        if a + k >= t or not mask[s, a + k]:
          continue
        w = np.exp(-(k - 1) / gamma)
        z = logits[s, j, k].astype(np.float64)
        ce = np.log(np.exp(z - z.max()).sum()) + z.max() - z[tokens[s, a + k]]
        num += w * ce
        den += w
  return num / den


def test_loss_equals_a_plain_numpy_computation():
  rng = np.random.default_rng(4)
  s_n, a_n, b, v, t = 2, 3, 8, 11, 12
  logits = rng.standard_normal((s_n, a_n, b, v)).astype(np.float32) * 2
  tokens = rng.integers(0, v, (s_n, t)).astype(np.int32)
  mask = rng.random((s_n, t)) < 0.7
  anchors = np.array([[0, 4, 10], [2, 7, 9]], np.int32)   # 10 and 9: rows run past the end
  valid = np.array([[True, True, True], [True, False, True]])
  labels, weights = _targets(jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(anchors),
                                    jnp.asarray(valid), block_size=b, gamma=4.0)
  loss, m = _loss(jnp.asarray(logits), labels, weights)
  np.testing.assert_allclose(float(loss), _numpy_loss(logits, tokens, mask, anchors, valid, 4.0),
                             rtol=1e-5)
  w = np.asarray(weights)
  assert (w[..., 0] == 0).all() and (w[1, 1] == 0).all() and (w[0, 2, 2:] == 0).all()


def test_accept_metric_counts_the_leading_correct_rows():
  b, v = 6, 5
  labels = jnp.asarray(np.array([[[0, 1, 2, 3, 4, 0]]], np.int32))
  logits = np.full((1, 1, b, v), -5.0, np.float32)
  for k, tok in enumerate([0, 1, 2, 0, 4, 0]):   # row 3 wrong: rows 1, 2 lead
    logits[0, 0, k, tok] = 5.0
  weights = jnp.asarray(L.row_decay(b, 4.0))[None, None]
  _, m = _loss(jnp.asarray(logits), labels, weights)
  assert float(m["accept"]) == 2.0
  np.testing.assert_allclose(np.asarray(m["row_acc"])[1:], [1, 1, 0, 1, 1])


# --- the families' terms (SPEC_dflash2_dspark 9.1, 12.1; DFlash2's selector loss is ours) -----

def test_shifted_rows_predict_the_next_token_with_decay_from_row_0():
  assert L.resolve_gamma(7, shifted=True) == 4.0
  with pytest.raises(ValueError, match="shifted rows"):
    L.resolve_gamma(16, shifted=True)
  d = L.row_decay(7, 4.0, shifted=True)
  np.testing.assert_allclose(d, [np.exp(-k / 4.0) for k in range(7)], rtol=1e-6)
  tokens = np.arange(50, 62, dtype=np.int32)[None]
  mask = np.ones((1, 12), bool)
  mask[0, 8] = False
  labels, weights = jax.jit(L.block_targets, static_argnames=("block_size", "gamma", "shifted"))(
      jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray([[3, 6]], jnp.int32),
      jnp.asarray([[True, True]]), block_size=7, gamma=4.0, shifted=True)
  np.testing.assert_array_equal(np.asarray(labels)[0, 0], 54 + np.arange(7))   # x[a+k+1]
  w = np.asarray(weights)[0]
  np.testing.assert_allclose(w[0], d * np.array([1, 1, 1, 1, 0, 1, 1]), rtol=1e-6)  # x[8] masked
  # anchor 6: rows predict 7..13; 8 is masked, 12 and 13 are past the end
  np.testing.assert_allclose(w[1], d * np.array([1, 0, 1, 1, 1, 0, 0]), rtol=1e-6)


def _numpy_selector_ce(scores, label_score, label_index):
  k = scores.shape[-1]
  out = np.empty(scores.shape[:-1])
  for idx in np.ndindex(*scores.shape[:-1]):
    row = list(scores[idx]) + ([] if label_index[idx] < k else [label_score[idx]])
    row = np.array(row, np.float64)
    m = row.max()
    out[idx] = np.log(np.exp(row - m).sum()) + m - row[min(label_index[idx], k)]
  return out


def test_selector_loss_is_ce_over_the_candidates_plus_an_outside_label():
  rng = np.random.default_rng(5)
  scores = rng.standard_normal((2, 3, 5, 4)).astype(np.float32) * 3
  label_index = rng.integers(0, 5, (2, 3, 5)).astype(np.int32)   # 4 = outside the top 4
  label_score = np.where(label_index < 4,
                         np.take_along_axis(scores, np.minimum(label_index, 3)[..., None],
                                            -1)[..., 0],
                         rng.standard_normal((2, 3, 5))).astype(np.float32)
  weights = rng.random((2, 3, 5)).astype(np.float32) * (rng.random((2, 3, 5)) < 0.8)
  loss, m = jax.jit(L.selector_loss)(jnp.asarray(label_score), jnp.asarray(scores),
                                     jnp.asarray(label_index), jnp.asarray(weights))
  ce = _numpy_selector_ce(scores, label_score, label_index)
  np.testing.assert_allclose(float(loss), (weights * ce).sum() / weights.sum(), rtol=1e-5)
  np.testing.assert_allclose(float(m["sel_in_top_k"]),
                             (weights * (label_index < 4)).sum() / weights.sum(), rtol=1e-5)


def test_confidence_loss_is_bce_against_one_minus_total_variation():
  rng = np.random.default_rng(6)
  draft = rng.standard_normal((2, 2, 3, 9)).astype(np.float32) * 2
  target = rng.standard_normal((2, 2, 3, 9)).astype(np.float32) * 2
  conf = rng.standard_normal((2, 2, 3)).astype(np.float32) * 3
  weights = rng.random((2, 2, 3)).astype(np.float32)
  sm = lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(
      -1, keepdims=True)
  y = 1 - 0.5 * np.abs(sm(draft.astype(np.float64)) - sm(target.astype(np.float64))).sum(-1)
  p = 1 / (1 + np.exp(-conf.astype(np.float64)))
  bce = -(y * np.log(p) + (1 - y) * np.log(1 - p))
  loss, m = jax.jit(L.confidence_loss)(jnp.asarray(conf), jnp.asarray(draft),
                                       jnp.asarray(target), jnp.asarray(weights))
  np.testing.assert_allclose(float(loss), (weights * bce).sum() / weights.sum(), rtol=1e-5)
  np.testing.assert_allclose(float(m["conf_target"]), (weights * y).sum() / weights.sum(),
                             rtol=1e-5)
  # The target is a constant: the gradient reaches the confidence logits only.
  g = jax.grad(lambda c, d: L.confidence_loss(c, d, jnp.asarray(target),
                                              jnp.asarray(weights))[0], argnums=(0, 1))(
      jnp.asarray(conf), jnp.asarray(draft))
  np.testing.assert_allclose(np.asarray(g[0]), weights * (p - y) / weights.sum(), rtol=1e-4,
                             atol=1e-7)
  assert not np.asarray(g[1]).any()


def test_accept_run_from_the_first_draft_row():
  hit = jnp.asarray([[[True, True, False, True], [False, True, True, True]]])
  weights = jnp.ones((1, 2, 4))
  assert float(L.accept_run(hit, weights, 0)) == 1.0   # runs 2 and 0
  assert float(L.accept_run(hit, weights, 1)) == 2.0   # runs 1 and 3
