"""pallas_kernels.moe_gemm: the grouped skinny GEMM over listed experts (interpret mode here)
against its jnp twin and a float64 numpy statement, and its Triton lowering for sm90 at the
Qwen3-30B-A3B expert shapes."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe_gemm as G
from test_kernels_lowering import assert_lowers_for_sm90


def _numpy(x, w, ids, gate_up):
  """float64 statement on bf16-rounded inputs: slot j = x(j) @ w[ids[j]]^T, 0 if ids[j] < 0."""
  x = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
  w = np.asarray(w, np.float64)
  out = []
  for j, e in enumerate(np.asarray(ids)):
    xj = x[j] if x.ndim == 3 else x
    if e < 0:
      y = np.zeros((xj.shape[0], w.shape[1] // (2 if gate_up else 1)))
    else:
      y = xj @ w[e].T
      if gate_up:
        n = y.shape[1] // 2
        y = y[:, :n] / (1 + np.exp(-y[:, :n])) * y[:, n:]
    out.append(y)
  return np.stack(out)


@pytest.mark.parametrize("m, gate_up, per_slot", [(1, True, False), (5, True, False),
                                                  (16, False, True), (37, False, False),
                                                  (64, True, False)])
def test_kernel_matches_twin_and_numpy(m, gate_up, per_slot):
  rng = np.random.default_rng(m)
  e, n, k = 9, 32, 96
  s = 6
  w = jnp.asarray(rng.standard_normal((e, 2 * n if gate_up else n, k)), jnp.bfloat16)
  # Unsorted experts, unused slots (-1) in the middle and at the end.
  ids = jnp.asarray([7, 2, -1, 0, 8, -1], jnp.int32)
  x = jnp.asarray(rng.standard_normal((s, m, k) if per_slot else (m, k)), jnp.float32)
  kn = G.default_knobs(n, k, gate_up)
  got = G.moe_matmul(x, w, ids, gate_up=gate_up, **kn)
  twin = G.moe_matmul_reference(x, w, ids, gate_up=gate_up)
  assert got.shape == twin.shape == (s, m, n)
  np.testing.assert_allclose(got, twin, rtol=1e-5, atol=1e-4)
  want = _numpy(x, w, ids, gate_up)
  np.testing.assert_allclose(twin, want, rtol=1e-4, atol=1e-3 * np.abs(want).max())
  assert not np.asarray(got[2]).any() and not np.asarray(got[5]).any()
  # bf16 output (what the MoE block feeds the down projection)
  got16 = G.moe_matmul(x, w, ids, gate_up=gate_up, out_dtype=jnp.bfloat16, **kn)
  assert got16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got16, np.float32), got, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("m", [5, 16, 37, 64])
def test_rows_do_not_depend_on_the_row_count(m):
  """Each row of an M-row call is bitwise the row computed alone (16 rows per dot, whatever
  M): the grouped GEMM's part of the MoE target's batch invariance."""
  rng = np.random.default_rng(m)
  w = jnp.asarray(rng.standard_normal((5, 64, 96)), jnp.bfloat16)
  ids = jnp.asarray([3, -1, 0], jnp.int32)
  x = jnp.asarray(rng.standard_normal((m, 96)), jnp.float32)
  kn = G.default_knobs(32, 96, True)
  got = np.asarray(G.moe_matmul(x, w, ids, gate_up=True, **kn)).view(np.uint32)
  for i in (0, m // 2, m - 1):
    one = G.moe_matmul(x[i:i + 1], w, ids, gate_up=True, **kn)
    np.testing.assert_array_equal(np.asarray(one)[:, 0].view(np.uint32), got[:, i])


def _routes(rng, m, n_experts, k):
  """Random routing of m rows: k distinct experts per row, weights in (0.1, 1)."""
  rid = np.stack([rng.permutation(n_experts)[:k] for _ in range(m)]).astype(np.int32)
  return jnp.asarray(rid), jnp.asarray(rng.uniform(0.1, 1.0, (m, k)), jnp.float32)


def _slots_of(rid, n_slots):
  """The touched experts of rid in a shuffled order, padded with -1 to n_slots."""
  touched = np.unique(np.asarray(rid))[::-1]
  return jnp.asarray(np.concatenate([touched, -np.ones(n_slots - len(touched))]), jnp.int32)


@pytest.mark.parametrize("m, k", [(1, 8), (5, 3), (37, 2)])
def test_routed_epilogue_matches_numpy(m, k):
  """routes: out[c, m] = weight[m, c] x(slot of expert rid[m, c])[m] @ w[rid[m, c]]^T, every
  (choice, row) written (float64 statement on bf16-rounded inputs, non-zero everywhere)."""
  rng = np.random.default_rng(100 + m)
  e, n, kk = 9, 32, 96
  rid, rw = _routes(rng, m, e, k)
  ids = _slots_of(rid, min(e, m * k) + 1)
  s = ids.shape[0]
  w = jnp.asarray(rng.standard_normal((e, n, kk)), jnp.bfloat16)
  x = jnp.asarray(rng.standard_normal((s, m, kk)), jnp.float32)
  got = G.moe_matmul(x, w, ids, routes=(rid, rw), **G.default_knobs(n, kk))
  twin = G.moe_matmul_reference(x, w, ids, routes=(rid, rw))
  assert got.shape == twin.shape == (k, m, n) and got.dtype == jnp.float32
  xs = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
  slot = {int(ex): j for j, ex in enumerate(np.asarray(ids))}
  want = np.zeros((k, m, n))
  for r in range(m):
    for c in range(k):
      ex = int(rid[r, c])
      want[c, r] = float(rw[r, c]) * (xs[slot[ex], r] @ np.asarray(w[ex], np.float64).T)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * np.abs(want).max())
  np.testing.assert_allclose(twin, want, rtol=1e-4, atol=1e-3 * np.abs(want).max())
  assert np.all(np.asarray(got) != 0)


@pytest.mark.parametrize("m", [5, 37])
def test_routed_rows_do_not_depend_on_the_other_rows(m):
  """A row's routed outputs are bitwise those of the row alone, whose slot list is only its
  own experts (other slots, other order)."""
  rng = np.random.default_rng(7 + m)
  e, n, kk, k = 12, 64, 96, 4
  rid, rw = _routes(rng, m, e, k)
  w = jnp.asarray(rng.standard_normal((e, n, kk)), jnp.bfloat16)
  h = jnp.asarray(rng.standard_normal((m, kk)), jnp.float32)
  kn = G.default_knobs(n, kk)
  ids = _slots_of(rid, min(e, m * k))
  # Each slot's rows: the same hidden rows seen through its expert (a per-slot x).
  x = jnp.stack([h * (1 + 0.1 * j) for j in range(ids.shape[0])])
  got = np.asarray(G.moe_matmul(x, w, ids, routes=(rid, rw), **kn)).view(np.uint32)
  pos = {int(ex): j for j, ex in enumerate(np.asarray(ids))}
  for i in (0, m // 2, m - 1):
    own = _slots_of(rid[i:i + 1], k)
    xi = jnp.stack([x[pos[int(ex)], i:i + 1] for ex in np.asarray(own)])
    one = G.moe_matmul(xi, w, own, routes=(rid[i:i + 1], rw[i:i + 1]), **kn)
    np.testing.assert_array_equal(np.asarray(one)[:, 0].view(np.uint32), got[:, i])


def test_twin_float32_is_full_precision():
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.standard_normal((4, 8, 24)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((3, 24)), jnp.float32)
  ids = jnp.asarray([3, -1, 1], jnp.int32)
  got = G.moe_matmul_reference(x, w, ids)
  want = np.stack([np.asarray(x, np.float64) @ np.asarray(w[3], np.float64).T, np.zeros((3, 8)),
                   np.asarray(x, np.float64) @ np.asarray(w[1], np.float64).T])
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_default_knobs_fit_the_dims():
  assert G.default_knobs(768, 2048, True) == dict(block_n=32, block_k=128, num_warps=4,
                                                  num_stages=3)
  assert G.default_knobs(2048, 768)["block_n"] == 64
  assert G.default_knobs(48, 80) == dict(block_n=16, block_k=16, num_warps=4, num_stages=3)


@pytest.mark.parametrize("kw, message", [
    (dict(w=jnp.zeros((2, 16, 32), jnp.float32)), "w bfloat16"),
    (dict(ids=jnp.zeros((2,), jnp.uint32)),
     "expert_ids int32"),
    (dict(x=jnp.zeros((65, 32))), "M <= 64"),
    (dict(x=jnp.zeros((3, 4, 32))), r"x \[M, K\] or \[S, M, K\]"),
    (dict(block_k=64), "block_k a power of 2 >= 16 dividing 32"),
    (dict(gate_up=True, routes=(jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2)))),
     "routes with gate_up=False"),
    (dict(routes=(jnp.zeros((3, 2), jnp.int32), jnp.zeros((3, 2)))), r"route_ids int32 \[4, k\]"),
    (dict(routes=(jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2), jnp.bfloat16))),
     r"route_weights float32 \(4, 2\)"),
    (dict(routes=(jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2))), out_dtype=jnp.bfloat16),
     "out_dtype float32 with routes"),
])
def test_errors_name_the_limit(kw, message):
  args = dict(x=jnp.zeros((4, 32)), w=jnp.zeros((2, 16, 32), jnp.bfloat16),
              ids=jnp.zeros((2,), jnp.int32), block_k=32, block_n=16, gate_up=False,
              routes=None, out_dtype=jnp.float32)
  args.update(kw)
  with pytest.raises(ValueError, match=message):
    G.moe_matmul(args["x"], args["w"], args["ids"], block_n=args["block_n"],
                 block_k=args["block_k"], gate_up=args["gate_up"], routes=args["routes"],
                 out_dtype=args["out_dtype"])


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("rows, slots", [(1, 8), (16, 128), (64, 128)],
                         ids=["decode1", "verify16", "4x16rows"])
def test_lowers_for_sm90_at_qwen3_30b_a3b_shapes(rows, slots):
  """The two launches of a Qwen3-30B-A3B MoE layer (128 experts of 768 x 2048) lower to
  Triton IR: gate+up over the shared rows, down over each slot's rows."""
  gu = functools.partial(G.moe_matmul, gate_up=True, out_dtype=jnp.bfloat16, interpret=False,
                         **G.default_knobs(768, 2048, True))
  assert_lowers_for_sm90(gu, (S((rows, 2048), jnp.float32),
                              S((128, 1536, 2048), jnp.bfloat16), S((slots,), jnp.int32)))
  down = functools.partial(G.moe_matmul, interpret=False, **G.default_knobs(2048, 768))
  assert_lowers_for_sm90(down, (S((slots, rows, 768), jnp.bfloat16),
                                S((128, 2048, 768), jnp.bfloat16), S((slots,), jnp.int32)))
  # The target's down projection: the routed epilogue (8 choices a row).
  routed = lambda x, w, ids, rid, rw: down(x, w, ids, routes=(rid, rw))
  assert_lowers_for_sm90(routed, (S((slots, rows, 768), jnp.bfloat16),
                                  S((128, 2048, 768), jnp.bfloat16), S((slots,), jnp.int32),
                                  S((rows, 8), jnp.int32), S((rows, 8), jnp.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("gate_up", [True, False])
def test_gpu_rows_do_not_depend_on_the_row_count_at_30b_a3b_shapes(gate_up):
  """The compiled kernel at Qwen3-30B-A3B's expert shapes: rows of 5, 16, 37 and 64-row calls
  bitwise equal to the same rows alone."""
  rng = np.random.default_rng(4)
  n, k = (768, 2048) if gate_up else (2048, 768)
  w = jnp.asarray(rng.standard_normal((128, 2 * n if gate_up else n, k)) * 0.02, jnp.bfloat16)
  ids = jnp.asarray([3, 17, 64, 127, -1], jnp.int32)
  kn = G.default_knobs(n, k, gate_up)
  x = jnp.asarray(rng.standard_normal((64, k)), jnp.float32)
  alone = np.stack([np.asarray(G.moe_matmul(x[i:i + 1], w, ids, gate_up=gate_up, **kn))[:, 0]
                    for i in range(64)], 1).view(np.uint32)
  for m in (5, 16, 37, 64):
    got = np.asarray(G.moe_matmul(x[:m], w, ids, gate_up=gate_up, **kn)).view(np.uint32)
    np.testing.assert_array_equal(got, alone[:, :m], err_msg=f"{m} rows")


@pytest.mark.gpu
def test_gpu_routed_rows_do_not_depend_on_the_row_count_at_30b_a3b_shapes():
  """The compiled routed epilogue at Qwen3-30B-A3B's down shapes (8 of 128 experts a row):
  rows of 5, 16, 37 and 64-row calls bitwise equal to the same rows alone."""
  rng = np.random.default_rng(5)
  n, kk, k = 2048, 768, 8
  w = jnp.asarray(rng.standard_normal((128, n, kk)) * 0.02, jnp.bfloat16)
  rid, rw = _routes(rng, 64, 128, k)
  h = jnp.asarray(rng.standard_normal((64, kk)), jnp.bfloat16)
  kn = G.default_knobs(n, kk)
  alone = []
  for i in range(64):
    own = _slots_of(rid[i:i + 1], k)
    alone.append(np.asarray(G.moe_matmul(jnp.broadcast_to(h[i:i + 1], (k, 1, kk)), w, own,
                                         routes=(rid[i:i + 1], rw[i:i + 1]), **kn))[:, 0])
  alone = np.stack(alone, 1).view(np.uint32)
  for m in (5, 16, 37, 64):
    ids = _slots_of(rid[:m], min(128, m * k))
    x = jnp.broadcast_to(h[:m], (ids.shape[0], m, kk))
    got = np.asarray(G.moe_matmul(x, w, ids, routes=(rid[:m], rw[:m]), **kn)).view(np.uint32)
    np.testing.assert_array_equal(got, alone[:, :m], err_msg=f"{m} rows")
