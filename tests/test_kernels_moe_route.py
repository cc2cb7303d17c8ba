"""pallas_kernels.moe_route (an MoE router's softmax top-k, one launch) against a float64
numpy transcription of the routing (softmax over all experts, the k most probable, weights
renormalised over them or not) and its jnp twin, in interpret mode; its rows bitwise
independent of the call's row count; Qwen3-30B-A3B's router on the GPU.

The outputs are fresh buffers the kernel must write in full; ids are compared exactly (the
logits are drawn without near ties: a gap of at least 1e-3 between neighbours), weights to
float32 rounding.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe_route as MR


def _logits(seed: int, m: int, e: int, n_parts: int) -> np.ndarray:
  """[P, M, E] partials whose sums have no two experts of a row within 1e-3 of each other."""
  rng = np.random.default_rng(seed)
  rows = np.stack([rng.permutation(e) for _ in range(m)]).astype(np.float64)
  total = (rows * 3.0 / e + rng.uniform(-1e-4, 1e-4, (m, e))) * rng.choice([-1, 1], (m, 1))
  parts = rng.standard_normal((n_parts, m, e)) * 2
  parts[-1] = total - parts[:-1].sum(0)
  return parts.astype(np.float32)


def numpy_routing(parts: np.ndarray, k: int, norm_topk: bool):
  x = np.zeros(parts.shape[1:], np.float64)
  for p in parts:   # the float32 partials' sum, as the kernel forms it
    x = (x + p).astype(np.float32).astype(np.float64)
  prob = np.exp(x - x.max(-1, keepdims=True))
  prob /= prob.sum(-1, keepdims=True)
  ids = np.argsort(-prob, axis=-1, kind="stable")[:, :k]
  w = np.take_along_axis(prob, ids, -1)
  if norm_topk:
    w = w / w.sum(-1, keepdims=True)
  return ids, w


@pytest.mark.parametrize("m, e, k, n_parts", [(1, 128, 8, 4), (5, 60, 4, 1), (16, 8, 2, 3),
                                              (3, 128, 8, 1), (2, 100, 16, 2)])
@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_route_matches_numpy_and_twin(m, e, k, n_parts, norm_topk):
  parts = _logits(m * e + k + n_parts, m, e, n_parts)
  ids, w = MR.moe_route(jnp.asarray(parts), k=k, norm_topk=norm_topk)
  assert ids.shape == (m, k) and ids.dtype == jnp.int32 and w.dtype == jnp.float32
  want_ids, want_w = numpy_routing(parts, k, norm_topk)
  np.testing.assert_array_equal(np.asarray(ids), want_ids)
  np.testing.assert_allclose(np.asarray(w), want_w, rtol=2e-6, atol=1e-9)
  t_ids, t_w = MR.moe_route_reference(jnp.asarray(parts), k=k, norm_topk=norm_topk)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(t_ids))
  np.testing.assert_allclose(np.asarray(w), np.asarray(t_w), rtol=2e-6, atol=1e-9)


def test_moe_route_ties_go_to_the_lower_id():
  parts = np.zeros((1, 2, 16), np.float32)
  parts[0, 0, [3, 9, 12]] = 2.0
  parts[0, 1, [15, 0]] = 1.0
  ids, w = MR.moe_route(jnp.asarray(parts), k=3, norm_topk=True)
  np.testing.assert_array_equal(np.asarray(ids), [[3, 9, 12], [0, 15, 1]])
  np.testing.assert_allclose(np.asarray(w)[0], [1 / 3] * 3, rtol=1e-6)


def _rows_invariant(m: int, e: int, k: int):
  parts = jnp.asarray(_logits(7, m, e, 4))
  ids, w = MR.moe_route(parts, k=k, norm_topk=True)
  for i in range(0, m, max(1, m // 5)):
    one_ids, one_w = MR.moe_route(parts[:, i:i + 1], k=k, norm_topk=True)
    np.testing.assert_array_equal(np.asarray(one_ids)[0], np.asarray(ids)[i])
    np.testing.assert_array_equal(np.asarray(one_w).view(np.uint32)[0],
                                  np.asarray(w).view(np.uint32)[i])


def test_moe_route_rows_are_batch_invariant():
  _rows_invariant(16, 128, 8)


def test_moe_route_limits():
  x = jnp.zeros((1, 4, 8), jnp.float32)
  with pytest.raises(ValueError, match="parts must be \\[P, M, E\\]"):
    MR.moe_route(x[0], k=2, norm_topk=True)
  with pytest.raises(ValueError, match="parts must be float32"):
    MR.moe_route(x.astype(jnp.bfloat16), k=2, norm_topk=True)
  with pytest.raises(ValueError, match="k must be in \\[1, min\\(E, 32\\)\\]"):
    MR.moe_route(x, k=9, norm_topk=True)


@pytest.mark.gpu
def test_gpu_moe_route_qwen3_30b_a3b():
  """Qwen3-30B-A3B's router: 128 experts, 8 per token, 4 partials, up to 64 rows."""
  _rows_invariant(64, 128, 8)
  parts = _logits(3, 64, 128, 4)
  ids, w = MR.moe_route(jnp.asarray(parts), k=8, norm_topk=True)
  want_ids, want_w = numpy_routing(parts, 8, True)
  np.testing.assert_array_equal(np.asarray(ids), want_ids)
  np.testing.assert_allclose(np.asarray(w), want_w, rtol=2e-6, atol=1e-9)
