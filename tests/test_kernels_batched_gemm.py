"""pallas_kernels.batched_gemm: the Mosaic GPU batched-row GEMM against a float64 numpy oracle
(GPU), its twin against the same oracle, its validation and tile rules (CPU), and the routing
in dflash_jax.dispatch.linear (a KernelPolicy's row ranges; `mosaic_gpu=True` claims the
Mosaic GPU kernels on the CPU, where a stand-in replaces the kernel body).

The kernel has no interpreter, so its numerics are GPU tests. Outputs are fresh buffers that
the kernel must write in full: every element is compared with the oracle, and an unwritten
tile (stale memory) would miss the tolerance.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dflash_jax import dispatch as P
from dflash_jax.dispatch import KernelPolicy
from dflash_jax.quant import quantize_fp8, quantize_q8_0
from pallas_kernels._common import hopper_available
from pallas_kernels import batched_gemm as BG

POLICY = KernelPolicy()
# The default knobs' thresholds, and fp8's wg_split forced either way ("k" for every call's
# rows, or "rows").
DEFAULT = dict(deep_k=POLICY.fp8_deep_k, k_split_max_m=POLICY.fp8_k_split_max_m)
FORCE = {"k": dict(DEFAULT, k_split_max_m=512), "rows": dict(DEFAULT, k_split_max_m=0)}
MOSAIC = KernelPolicy(mosaic_gpu=True)   # the shipped routing with Mosaic GPU claimed

# float32 accumulation in another order than the float64 oracle's: K-term sums err by a small
# multiple of eps_f32 * sum_k |x_k w_k|; 2e-5 of that sum covers K up to ~20k.
ACC_RTOL = 2e-5
BF16_EPS = 2.0 ** -8


def _inputs(seed: int, m: int, n_w: int, k: int):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
  # Per-row magnitudes over ~e^+-1: a row written to the wrong column tile shows.
  w = (rng.standard_normal((n_w, k)) * np.exp(rng.normal(size=(n_w, 1))) / np.sqrt(k))
  return x, w.astype(ml_dtypes.bfloat16), rng


def _oracle(x, w, residual, epilogue):
  """float64 products of the bf16 operands, the epilogue in float64; and the scale
  sum_k |x_k w_k| each element's rounding error is bounded by."""
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  y, scale = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
  if epilogue == "gate_up":
    n = w.shape[0] // 2
    g, u = y[:, :n], y[:, n:]
    silu = g / (1.0 + np.exp(-g))
    # d(silu(g) u) = u silu'(g) dg + silu(g) du, |silu'| <= 1.1
    return silu * u, 1.1 * np.abs(u) * scale[:, :n] + np.abs(silu) * scale[:, n:]
  if epilogue == "residual":
    y = y + np.asarray(residual, np.float64)
  return y, scale


def test_twin_matches_the_oracle():
  for epilogue in BG.EPILOGUES:
    x, w, rng = _inputs(1, 40, 96 if epilogue == "gate_up" else 48, 256)
    n = w.shape[0] // (2 if epilogue == "gate_up" else 1)
    r = rng.standard_normal((40, n)).astype(np.float32) if epilogue == "residual" else None
    got = np.asarray(BG.batched_matmul_reference(jnp.asarray(x), jnp.asarray(w), r,
                                                 epilogue=epilogue), np.float64)
    want, scale = _oracle(x, w, r, epilogue)
    assert np.all(np.abs(got - want) <= ACC_RTOL * scale + 1e-6), epilogue


@pytest.mark.parametrize("args, kw, msg", [
    ((np.zeros((8, 64)), np.zeros((64, 64))), {}, "bf16 x and bf16 or float8_e4m3fn w"),
    ((jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((64, 64), jnp.float8_e4m3fn)), {},
     "take their per-row scale"),
    ((jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((64, 64), jnp.float8_e4m3fn)),
     dict(scale=jnp.ones((32,), jnp.float32)), "scale must be float32 \\[64\\]"),
    ((jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((64, 32), jnp.bfloat16)), {}, "x \\[M, K\\]"),
    ((jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((64, 64), jnp.bfloat16)),
     dict(epilogue="relu"), "epilogue must be"),
    ((jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((96, 64), jnp.bfloat16)), {},
     "multiples of the column tile 64"),
    ((jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((130, 64), jnp.bfloat16)),
     dict(epilogue="gate_up", block_k=64), "multiples of the column tile"),
    ((jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((64, 64), jnp.bfloat16)),
     dict(wg_split="k", block_k=64), "wg_split 'k' .* is for float8_e4m3fn weights"),
    ((jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((64, 64), jnp.bfloat16)),
     dict(epilogue="residual", block_k=64), "float32 \\[8, 64\\] residual"),
    ((jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((64, 64), jnp.bfloat16),
      jnp.zeros((8, 64), jnp.float32)), dict(block_k=64), "only taken by"),
])
def test_limits(args, kw, msg):
  with pytest.raises(ValueError, match=msg):
    BG.batched_matmul(*args, **kw)


def test_default_knobs_fit_shared_memory():
  for m in (17, 64, 128, 129, 200, 256):
    for epilogue, out_dtype in (("none", jnp.float32), ("residual", jnp.float32),
                                ("gate_up", jnp.bfloat16), ("gate_up", jnp.float32)):
      kn = BG.default_knobs(m, 6656, 19968, epilogue, out_dtype, **DEFAULT)
      assert kn is not None and 19968 % kn.block_k == 0
      used = BG.smem_bytes(m, epilogue, out_dtype, kn.block_k, kn.max_concurrent_steps)
      assert used <= BG.SMEM_BYTES - 2048, (m, epilogue, kn)
  assert BG.default_knobs(128, 6656 + 32, 4096, **DEFAULT) is None   # no 64-wide column tile
  assert BG.default_knobs(128, 6656, 4096 + 32, **DEFAULT) is None   # K fits no K tile
  # At most 4 stages of 128-deep K tiles (the measured best), fewer where they do not fit.
  for m in (64, 128):
    assert BG.default_knobs(m, 6144, 6656, **DEFAULT) == BG.Knobs(
        block_k=128, max_concurrent_steps=4, wg_split="rows")
  assert BG.default_knobs(128, 19968, 6656, "gate_up", jnp.bfloat16, **DEFAULT) == BG.Knobs(
      block_k=128, max_concurrent_steps=3, wg_split="rows")


@pytest.mark.parametrize("wg_split", BG.WG_SPLITS)
def test_fp8_knobs_fit_shared_memory(wg_split):
  """fp8's default tiles at every row count the kernel takes in one call fit shared memory
  (counting wg_split "k"'s handed-over sums) and the accumulator registers."""
  for m in (20, 32, 64, 96, 128, 200, 256):
    for n, k, epilogue, out_dtype in ((6144, 6656, "none", jnp.float32),
                                      (6656, 19968, "residual", jnp.float32),
                                      (19968, 6656, "gate_up", jnp.bfloat16)):
      kn = BG.default_knobs(m, n, k, epilogue, out_dtype, "fp8", **FORCE[wg_split])
      assert kn is not None and kn.wg_split == wg_split
      assert BG.smem_bytes(m, epilogue, out_dtype, kn.block_k, kn.max_concurrent_steps,
                           "fp8", wg_split) <= BG.SMEM_BYTES - 2048
      mp = BG.padded_rows(min(m, BG.max_rows(epilogue, wg_split)), wg_split)
      n_acc = 2 if epilogue == "gate_up" else 1
      assert BG.acc_rows(mp, wg_split) * BG.BLOCK_N * n_acc <= BG.ACC_FLOATS
  # "k" alternates 128-deep K tiles, holds every row (gate_up's two accumulators: 128 of them).
  assert [BG.padded_rows(m, "k") for m in (1, 32, 33, 100, 256)] == [32, 32, 64, 128, 256]
  assert (BG.max_rows("gate_up", "k"), BG.max_rows("none", "k")) == (128, 256)
  assert BG.acc_rows(96, "k") == 96 and BG.acc_rows(128, "rows") == 64
  assert not BG.fits(128, 6144, 6656, "none", jnp.float32, 64, 4, fmt="fp8", wg_split="k")
  assert not BG.fits(128, 6144, 6656, "none", jnp.float32, 128, 4, wg_split="k")   # bf16


def test_fp8_wg_split_by_rows_and_epilogue():
  """gate_up's two accumulators take "k" up to k_split_max_m rows (the policy's 128), one
  accumulator's epilogues twice as many; past one call's rows its chunks decide."""
  limit = POLICY.fp8_k_split_max_m
  assert (limit, BG.MAX_ROWS) == (128, 256)
  for ep in ("none", "residual"):   # every chunk of one accumulator's rows fits "k"
    assert {BG.fp8_wg_split(m, ep, k_split_max_m=limit)
            for m in (1, 128, 129, 256, 257, 1024)} == {"k"}
  assert [BG.fp8_wg_split(m, "gate_up", k_split_max_m=limit) for m in (1, 128, 129, 256, 1024)
          ] == ["k", "k", "rows", "rows", "rows"]
  assert BG.fp8_wg_split(100, "none", k_split_max_m=40) == "rows"   # 2 x 40 < 100
  # Past one call's rows the knobs are those of its 256-row chunks (256 itself: below).
  assert BG.default_knobs(512, 6144, 6656, "none", jnp.float32, "fp8", **DEFAULT) == BG.Knobs(
      block_k=128, max_concurrent_steps=3, wg_split="k")
  assert BG.default_knobs(512, 19968, 6656, "gate_up", jnp.bfloat16, "fp8",
                          **DEFAULT).wg_split == "rows"


def test_fp8_stages_share_memory_with_the_epilogue_tiles():
  """wg_split "k" hands its sums over in the pipeline's memory (a RefUnion), so its stages
  count alone: gate_up at 128 rows takes 4 stages (3 when the sums took 80 KiB of their own),
  and long-K matrices (K >= the policy's fp8_deep_k: down, fc) as many as fit, up to 6."""
  stage = lambda m, n_w: 128 * (m * 2 + n_w * 64)   # x's and the weight tiles' bytes
  for m, n, k, epilogue, out_dtype, steps in (
      (128, 19968, 6656, "gate_up", jnp.bfloat16, 4), (32, 19968, 6656, "gate_up", jnp.bfloat16, 4),
      (32, 6144, 6656, "none", jnp.float32, 4), (32, 6656, 19968, "residual", jnp.float32, 6),
      (64, 6656, 33280, "none", jnp.float32, 6), (128, 6656, 19968, "residual", jnp.float32, 5)):
    kn = BG.default_knobs(m, n, k, epilogue, out_dtype, "fp8", **DEFAULT)
    assert (kn.wg_split, kn.block_k, kn.max_concurrent_steps) == ("k", 128, steps), (m, n)
    n_w = 2 if epilogue == "gate_up" else 1
    used = BG.smem_bytes(m, epilogue, out_dtype, 128, steps, "fp8", "k")
    assert used == stage(m, n_w) * steps + 2 * n_w * 64 * 4   # the tiles and the row scales
    assert used <= BG.SMEM_BYTES - 2048
    if m == 128:   # one more stage would not fit
      assert not BG.fits(m, n, k, epilogue, out_dtype, 128, steps + 1, fmt="fp8", wg_split="k")
  # At 256 rows one accumulator's epilogues run "k" in 3 x 128 stages; gate_up runs "rows",
  # which writes its y^T tiles there too once both pipelines have ended (4 x 64 when the tiles
  # took 64 KiB of their own), its two weight tiles in 5 x 64; "rows" fits 3 x 128 for the
  # others as well.
  for n, k, epilogue, out_dtype, split, depth in (
      (6144, 6656, "none", jnp.float32, "k", (128, 3)),
      (6656, 19968, "residual", jnp.float32, "k", (128, 3)),
      (19968, 6656, "gate_up", jnp.bfloat16, "rows", (64, 5))):
    kn = BG.default_knobs(256, n, k, epilogue, out_dtype, "fp8", **DEFAULT)
    assert (kn.wg_split, kn.block_k, kn.max_concurrent_steps) == (split, *depth)
    n_w = 2 if epilogue == "gate_up" else 1
    used = BG.smem_bytes(256, epilogue, out_dtype, *depth, "fp8", split)
    assert used == depth[0] * (256 * 2 + n_w * 64) * depth[1] + 2 * n_w * 64 * 4
    if n_w == 1:
      assert BG.fits(256, n, k, epilogue, out_dtype, 128, 3, fmt="fp8", wg_split="rows")


def test_linear_keeps_xla_off_hopper():
  # On a backend without the kernel (CPU here), every row count past the skinny GEMM's runs
  # XLA's GEMM: no Mosaic GPU call in the lowered program.
  if hopper_available():
    pytest.skip("this backend has the kernel (the GPU tests cover it)")
  x = jnp.ones((128, 256), jnp.bfloat16)
  w = jnp.ones((128, 256), jnp.bfloat16)
  text = jax.jit(lambda x, w: P.linear(x, w, policy=POLICY)).lower(x, w).as_text()
  assert "mosaic" not in text.lower()


GPU_CASES = [  # (name, m, n, k): seed shapes at a batched round's rows, padding and chunking
    ("qkv", 128, 6144, 6656), ("o", 128, 6656, 4096), ("down", 128, 6656, 19968),
    ("small", 32, 512, 1024), ("pad", 200, 512, 1024), ("chunks", 300, 512, 1024),
]


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", BG.EPILOGUES)
@pytest.mark.parametrize("name, m, n, k", GPU_CASES)
def test_gpu_matches_oracle(name, m, n, k, epilogue):
  if epilogue == "gate_up" and name == "down":
    n, k = 19968, 6656           # the seed's gate_up
  x, w, rng = _inputs(hash((name, epilogue)) % 2**31, m, 2 * n if epilogue == "gate_up" else n,
                      k)
  r = rng.standard_normal((m, n)).astype(np.float32) if epilogue == "residual" else None
  out_dtype = jnp.bfloat16 if epilogue == "gate_up" else jnp.float32
  kn = BG.default_knobs(m, n, k, epilogue, out_dtype, **DEFAULT)
  got = BG.batched_matmul(jnp.asarray(x), jnp.asarray(w), None if r is None else jnp.asarray(r),
                          epilogue=epilogue, out_dtype=out_dtype, **kn.kwargs())
  assert got.shape == (m, n) and got.dtype == out_dtype
  got = np.asarray(got.astype(jnp.float32), np.float64)
  want, scale = _oracle(x, w, r, epilogue)
  bound = ACC_RTOL * scale + 1e-6
  if epilogue == "gate_up":
    bound = bound + BF16_EPS * np.abs(want)     # the bf16 store
  bad = np.abs(got - want) > bound
  assert not bad.any(), f"{bad.sum()} of {bad.size} elements off, first at {np.argwhere(bad)[0]}"


@pytest.mark.gpu
def test_gpu_linear_routes_batched_rows_to_the_kernel():
  x = jnp.ones((128, 1024), jnp.bfloat16)
  w = jnp.ones((512, 1024), jnp.bfloat16)
  lo, hi = POLICY.batched_bf16_rows
  for rows, want in ((lo - 1, False), (lo, True), (hi, True), (hi + 1, False)):
    xr = jnp.ones((rows, 1024), jnp.bfloat16)
    text = jax.jit(lambda x, w: P.linear(x, w, policy=POLICY,
                                         residual=jnp.zeros((x.shape[0], 512)))).lower(
        xr, w).as_text()
    assert ("mosaic_gpu" in text) == want, rows
  del x


CALLS = []   # (rows, epilogue) of every kernel launch the stand-in below saw


def _fake_call_fp8(x, w, scale, *, gate_up, out_dtype, n, wg_split, **_):
  """The fp8 kernel's stand-in on CPU: the twin's y^T, as the kernel writes it."""
  y = _fake_call(x, w, None, epilogue="gate_up" if gate_up else "none", out_dtype=out_dtype,
                 n=n, scale=scale, wg_split=wg_split)
  return jnp.swapaxes(y, -1, -2)


def _fake_call(x, w, residual, *, epilogue, out_dtype, n, scale=None, wg_split="rows", **_):
  """The kernel body's stand-in on CPU: the twin on the padded operands."""
  assert x.dtype == jnp.bfloat16 and x.shape[0] == BG.padded_rows(x.shape[0], wg_split)
  assert x.shape[0] <= BG.max_rows(epilogue, wg_split)
  CALLS.append((x.shape[0], epilogue))
  return BG.batched_matmul_reference(x, w, residual, scale=scale, epilogue=epilogue,
                                     out_dtype=out_dtype)


def _stand_in_kernels(monkeypatch):
  """The kernel bodies replaced by their twins (Mosaic GPU has no CPU path); the routing is
  the policy's (a fake kernel, not a patched threshold)."""
  monkeypatch.setattr(BG, "_call", _fake_call)
  monkeypatch.setattr(BG, "_call_fp8", _fake_call_fp8)


def test_linear_batched_branch_on_cpu(monkeypatch):
  """dispatch.linear's batched branch (rounding to bf16, the residual and gate_up epilogues,
  the padding to 64 or 128 rows; the 256-row chunks of a direct call) with the kernel body
  replaced by the twin on the padded operands: it must give XLA's path to float32 rounding."""
  calls = CALLS
  calls.clear()
  _stand_in_kernels(monkeypatch)
  rng = np.random.default_rng(7)
  k, n = 256, 128
  w = jnp.asarray(rng.standard_normal((n, k)) / 16, jnp.bfloat16)
  wgu = jnp.asarray(rng.standard_normal((2 * n, k)) / 16, jnp.bfloat16)
  for m in MOSAIC.batched_bf16_rows:
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    want = [P.linear(x, w, impl="xla", residual=r), P.linear(x, w, impl="xla", partials=True),
            P.linear(x, wgu, impl="xla", gate_up=True, out_dtype=jnp.bfloat16)]
    got = [P.linear(x, w, policy=MOSAIC, residual=r), P.linear(x, w, policy=MOSAIC, partials=True),
           P.linear(x, wgu, policy=MOSAIC, gate_up=True, out_dtype=jnp.bfloat16)]
    for g, e in zip(got, want):
      assert g.shape == e.shape and g.dtype == e.dtype
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32),
                                 rtol=1e-5, atol=1e-5)
  assert {c[1] for c in calls} == {"residual", "none", "gate_up"}
  # 33 rows pad to one warpgroup's 64, 128 run as two warpgroups' halves.
  assert calls.count((64, "none")) == 1 and calls.count((128, "none")) == 1
  # fp8 weights take the same branch (their twin dequantizes; exact for power-of-two scales),
  # with either wg_split: "k" pads to 32 rows and runs gate_up in 128-row chunks, the other
  # epilogues in 256-row ones.
  for wg_split, m, want_calls in (
      ("k", 20, [(32, "none"), (32, "gate_up")]),
      ("k", 512, [(256, "none")] * 2 + [(128, "gate_up")] * 4),
      ("rows", 100, [(128, "none"), (128, "gate_up")])):
    policy = KernelPolicy(mosaic_gpu=True, batched_fp8_rows=(17, 512), fp8_small_weights=0,
                          fp8_k_split_max_m=FORCE[wg_split]["k_split_max_m"])
    calls.clear()
    for wb in (w, wgu):
      w8, sc = quantize_fp8(np.asarray(wb, np.float32))
      qw = P.QuantWeight(jnp.asarray(w8), jnp.asarray(sc), "fp8")
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
      gu = wb is wgu
      od = jnp.bfloat16 if gu else jnp.float32
      want = P.linear(x, qw, impl="xla", gate_up=gu, out_dtype=od)
      got = P.linear(x, qw, policy=policy, gate_up=gu, out_dtype=od)
      np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                 rtol=1e-5, atol=1e-5)
    assert calls == want_calls, (wg_split, m)
  # By default fp8 runs there too (measured faster than the skinny fp8 GEMM on the H200); q8_0
  # never does.
  x = x[:MOSAIC.batched_fp8_rows[1]]
  assert P._batched_knobs(x, qw, True, jnp.bfloat16, MOSAIC) is not None
  # Except that at 32 rows matrices under fp8_small_weights elements stay on the skinny GEMM.
  lo = MOSAIC.batched_fp8_rows[0]
  assert lo < MOSAIC.fp8_small_min_rows
  small_lo = MOSAIC.fp8_small_min_rows
  for rows, n_w, k_w, runs in ((lo, 6144, 6656, False), (small_lo, 6144, 6656, True),
                               (lo, 39936, 6656, True), (lo, 6656, 19968, True)):
    big = jax.ShapeDtypeStruct((n_w, k_w), jnp.float8_e4m3fn)
    xs = jax.ShapeDtypeStruct((rows, k_w), jnp.bfloat16)
    knobs = P._batched_knobs(
        xs, P.QuantWeight(big, jax.ShapeDtypeStruct((n_w,), jnp.float32), "fp8"), False,
        jnp.float32, MOSAIC)
    assert (knobs is not None) == runs, (rows, n_w, k_w)
  q8 = P.QuantWeight(*map(jnp.asarray, quantize_q8_0(np.asarray(wgu, np.float32))), "q8_0")
  assert P._batched_knobs(x, q8, True, jnp.bfloat16, MOSAIC) is None
  # The policy's switches: the default asks the backend, False refuses.
  assert (P._batched_knobs(x, qw, True, jnp.bfloat16, POLICY) is not None) == hopper_available()
  assert P._batched_knobs(x, qw, True, jnp.bfloat16,
                          KernelPolicy(mosaic_gpu=False)) is None
  assert P._batched_knobs(x, qw, True, jnp.bfloat16,
                          KernelPolicy(mosaic_gpu=True, batched_fp8_rows=None)) is None
  # Past MAX_ROWS the kernel runs in 256-row chunks (the last one, 44 rows, padded to 64).
  calls.clear()
  x = jnp.asarray(rng.standard_normal((300, k)), jnp.bfloat16)
  got = BG.batched_matmul(x, w, block_k=64)
  assert calls == [(256, "none"), (64, "none")]
  np.testing.assert_allclose(np.asarray(got), np.asarray(P.linear(x, w, impl="xla")),
                             rtol=1e-5, atol=1e-5)
  assert [BG.padded_rows(v) for v in (1, 64, 65, 128, 129, 256)] == [64, 64, 128, 128, 256, 256]


DEPTH_VARIANTS = {   # (block_k, stages) of _DEPTHS that the seed shapes' defaults do not pick
    "64x6": dict(block_k=64, max_concurrent_steps=6),
    "64x2": dict(block_k=64, max_concurrent_steps=2),
    "128x2": dict(block_k=128, max_concurrent_steps=2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("m, variant, epilogue", [
    (m, v, e) for m in (40, 64, 128) for v in sorted(DEPTH_VARIANTS) for e in BG.EPILOGUES])
def test_gpu_depth_variants_match_oracle(m, variant, epilogue):
  kn = dict(DEPTH_VARIANTS[variant])
  n, k = 512, 1024
  x, w, rng = _inputs(hash((m, variant, epilogue)) % 2**31, m,
                      2 * n if epilogue == "gate_up" else n, k)
  r = rng.standard_normal((m, n)).astype(np.float32) if epilogue == "residual" else None
  out_dtype = jnp.bfloat16 if epilogue == "gate_up" else jnp.float32
  got = BG.batched_matmul(jnp.asarray(x), jnp.asarray(w), None if r is None else jnp.asarray(r),
                          epilogue=epilogue, out_dtype=out_dtype, **kn)
  got = np.asarray(got.astype(jnp.float32), np.float64)
  want, scale = _oracle(x, w, r, epilogue)
  bound = ACC_RTOL * scale + 1e-6 + (BF16_EPS * np.abs(want) if epilogue == "gate_up" else 0)
  assert got.shape == want.shape and not (np.abs(got - want) > bound).any()


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", BG.EPILOGUES)
@pytest.mark.parametrize("m, n, k, wg_split", [
    (128, 6144, 6656, "rows"), (64, 512, 1024, "rows"), (100, 512, 1024, "rows"),
    (128, 6144, 6656, "k"), (32, 512, 1024, "k"), (20, 512, 1024, "k"), (100, 512, 1024, "k"),
    (256, 512, 1024, "k"), (300, 512, 1024, "k")])
def test_gpu_fp8_matches_oracle(m, n, k, wg_split, epilogue):
  """fp8 weights (tiles widened to bf16 in registers, row scales in the epilogue) against
  the float64 oracle on the dequantized weights, both ways of sharing a program between the
  compute warpgroups (rows padded, chunked past one call's rows)."""
  x, w, rng = _inputs(hash((m, n, epilogue, "fp8", wg_split)) % 2**31, m,
                      2 * n if epilogue == "gate_up" else n, k)
  w8, sc = quantize_fp8(np.asarray(w, np.float32))
  wd = (np.asarray(w8, np.float32) * sc[:, None]).astype(ml_dtypes.bfloat16)   # exact
  r = rng.standard_normal((m, n)).astype(np.float32) if epilogue == "residual" else None
  out_dtype = jnp.bfloat16 if epilogue == "gate_up" else jnp.float32
  kn = BG.default_knobs(m, n, k, epilogue, out_dtype, "fp8", **FORCE[wg_split])
  assert kn.wg_split == wg_split
  got = BG.batched_matmul(jnp.asarray(x), jnp.asarray(w8), None if r is None else jnp.asarray(r),
                          scale=jnp.asarray(sc), epilogue=epilogue, out_dtype=out_dtype,
                          **kn.kwargs())
  got = np.asarray(got.astype(jnp.float32), np.float64)
  want, scale = _oracle(x, wd, r, epilogue)
  bound = ACC_RTOL * scale + 1e-6 + (BF16_EPS * np.abs(want) if epilogue == "gate_up" else 0)
  assert got.shape == want.shape and not (np.abs(got - want) > bound).any()


@pytest.mark.parametrize("fmt, name, m, wg_split", [
    ("bf16", "qkv", 128, "rows"), ("bf16", "gate_up", 128, "rows"), ("bf16", "down", 64, "rows"),
    ("fp8", "qkv", 128, "rows"), ("fp8", "gate_up", 128, "rows"), ("fp8", "o", 64, "rows"),
    ("fp8", "qkv", 32, "k"), ("fp8", "gate_up", 128, "k"), ("fp8", "down", 256, "k"),
    ("fp8", "o", 96, "k")])
def test_seed_shapes_lower_for_hopper_on_cpu(fmt, name, m, wg_split):
  """Mosaic GPU lowers the kernel at the seed's matrices with the default tiles for an sm90
  target without a GPU (layouts, the register A operand of the fp8 body, wg_split "k"'s
  conditional wgmma and hand-over, shared memory within the H200's): what would otherwise
  first fail on the GPU."""
  n, k, epilogue = {"qkv": (6144, 6656, "none"), "o": (6656, 4096, "residual"),
                    "gate_up": (19968, 6656, "gate_up"), "down": (6656, 19968, "residual")}[name]
  out_dtype = jnp.bfloat16 if epilogue == "gate_up" else jnp.float32
  kn = BG.default_knobs(m, n, k, epilogue, out_dtype, fmt, **FORCE[wg_split])
  assert kn.wg_split == wg_split
  n_w = 2 * n if epilogue == "gate_up" else n
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  if fmt == "fp8":
    w = jax.ShapeDtypeStruct((n_w, k), jnp.float8_e4m3fn)
    f = lambda x, w, s: BG._call_fp8(
        x, w, s, gate_up=epilogue == "gate_up", out_dtype=jnp.dtype(out_dtype), n=n,
        block_k=kn.block_k, steps=kn.max_concurrent_steps, wg_split=wg_split)
    args = (x, w, jax.ShapeDtypeStruct((n_w,), jnp.float32))
  else:
    w = jax.ShapeDtypeStruct((n_w, k), jnp.bfloat16)
    r = jax.ShapeDtypeStruct((m, n), jnp.float32) if epilogue == "residual" else None
    f = lambda x, w, r: BG._call(
        x, w, r, epilogue=epilogue, out_dtype=jnp.dtype(out_dtype), n=n,
        block_k=kn.block_k, steps=kn.max_concurrent_steps)
    args = (x, w, r)
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
