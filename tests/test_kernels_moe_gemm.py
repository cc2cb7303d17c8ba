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
])
def test_errors_name_the_limit(kw, message):
  args = dict(x=jnp.zeros((4, 32)), w=jnp.zeros((2, 16, 32), jnp.bfloat16),
              ids=jnp.zeros((2,), jnp.int32), block_k=32, block_n=16)
  args.update(kw)
  with pytest.raises(ValueError, match=message):
    G.moe_matmul(args["x"], args["w"], args["ids"], block_n=args["block_n"],
                 block_k=args["block_k"])


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
