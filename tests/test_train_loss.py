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
