"""pallas_kernels.batched_gemm: the Mosaic GPU batched-row GEMM against a float64 numpy oracle
(GPU), its twin against the same oracle, its validation and tile rules (CPU), and the routing
in dflash_jax.dispatch.linear.

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
from dflash_jax.quant import quantize_fp8, quantize_q8_0
from pallas_kernels._common import hopper_available
from pallas_kernels import batched_gemm as BG

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
    ((jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((96, 64), jnp.bfloat16)),
     dict(block_n=64), "multiples of block_n"),
    ((jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((130, 64), jnp.bfloat16)),
     dict(epilogue="gate_up", block_n=64, block_k=64), "multiples of block_n"),
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
      kn = BG.default_knobs(m, 6656, 19968, epilogue, out_dtype)
      assert kn is not None and 6656 % kn["block_n"] == 0 and 19968 % kn["block_k"] == 0
      used = BG.smem_bytes(m, epilogue, out_dtype, kn["block_n"], kn["block_k"],
                           kn["max_concurrent_steps"])
      assert used <= BG.SMEM_BYTES - 2048, (m, epilogue, kn)
  assert BG.default_knobs(128, 6656 + 32, 4096) is None      # no 64-wide column tile
  assert BG.default_knobs(128, 6656, 4096 + 32) is None      # K fits no K tile
  # At most 4 stages of 128-deep K tiles (the measured best), fewer where they do not fit.
  for m in (64, 128):
    assert BG.default_knobs(m, 6144, 6656) == dict(block_n=64, block_k=128,
                                                   max_concurrent_steps=4, split_k=1,
                                                   wg_split="rows")
  assert BG.default_knobs(128, 19968, 6656, "gate_up", jnp.bfloat16) == dict(
      block_n=64, block_k=128, max_concurrent_steps=3, split_k=1, wg_split="rows")


@pytest.mark.parametrize("wg_split", BG.WG_SPLITS)
def test_fp8_knobs_fit_shared_memory(monkeypatch, wg_split):
  """fp8's default tiles at every row count the kernel takes in one call fit shared memory
  (counting wg_split "k"'s handed-over sums) and the accumulator registers."""
  monkeypatch.setattr(BG, "FP8_K_SPLIT_MAX_M", 512 if wg_split == "k" else 0)
  for m in (20, 32, 64, 96, 128, 200, 256):
    for n, k, epilogue, out_dtype in ((6144, 6656, "none", jnp.float32),
                                      (6656, 19968, "residual", jnp.float32),
                                      (19968, 6656, "gate_up", jnp.bfloat16)):
      kn = BG.default_knobs(m, n, k, epilogue, out_dtype, "fp8")
      assert kn is not None and kn["wg_split"] == wg_split and kn["block_n"] == 64
      assert BG.smem_bytes(m, epilogue, out_dtype, 64, kn["block_k"], kn["max_concurrent_steps"],
                           "fp8", wg_split) <= BG.SMEM_BYTES - 2048
      mp = BG.padded_rows(min(m, BG.max_rows(epilogue, wg_split)), wg_split)
      n_acc = 2 if epilogue == "gate_up" else 1
      assert BG.acc_rows(mp, wg_split) * 64 * n_acc <= BG.ACC_FLOATS
  # "k" alternates 128-deep K tiles, holds every row (gate_up's two accumulators: 128 of them).
  assert [BG.padded_rows(m, "k") for m in (1, 32, 33, 100, 256)] == [32, 32, 64, 128, 256]
  assert (BG.max_rows("gate_up", "k"), BG.max_rows("none", "k")) == (128, 256)
  assert BG.acc_rows(96, "k") == 96 and BG.acc_rows(128, "rows") == 64
  assert not BG.fits(128, 6144, 6656, "none", jnp.float32, 64, 64, 4, fmt="fp8", wg_split="k")
  assert not BG.fits(128, 6144, 6656, "none", jnp.float32, 64, 128, 4, wg_split="k")   # bf16


def test_fp8_wg_split_by_rows_and_epilogue():
  """gate_up's two accumulators take "k" up to FP8_K_SPLIT_MAX_M rows, one accumulator's
  epilogues twice as many; past one call's rows its chunks decide."""
  assert (BG.FP8_K_SPLIT_MAX_M, BG.MAX_ROWS) == (128, 256)
  for ep in ("none", "residual"):   # every chunk of one accumulator's rows fits "k"
    assert {BG.fp8_wg_split(m, ep) for m in (1, 128, 129, 256, 257, 1024)} == {"k"}
  assert [BG.fp8_wg_split(m, "gate_up") for m in (1, 128, 129, 256, 1024)] == (
      ["k", "k", "rows", "rows", "rows"])
  # Past one call's rows the knobs are those of its 256-row chunks (256 itself: below).
  assert BG.default_knobs(512, 6144, 6656, "none", jnp.float32, "fp8") == dict(
      block_n=64, block_k=128, max_concurrent_steps=3, split_k=1, wg_split="k")
  assert BG.default_knobs(512, 19968, 6656, "gate_up", jnp.bfloat16, "fp8")["wg_split"] == "rows"


def test_fp8_stages_share_memory_with_the_epilogue_tiles():
  """wg_split "k" hands its sums over in the pipeline's memory (a RefUnion), so its stages
  count alone: gate_up at 128 rows takes 4 stages (3 when the sums took 80 KiB of their own),
  and long-K matrices (K >= FP8_DEEP_K: down, fc) as many as fit, up to 6."""
  stage = lambda m, n_w: 128 * (m * 2 + n_w * 64)   # x's and the weight tiles' bytes
  for m, n, k, epilogue, out_dtype, steps in (
      (128, 19968, 6656, "gate_up", jnp.bfloat16, 4), (32, 19968, 6656, "gate_up", jnp.bfloat16, 4),
      (32, 6144, 6656, "none", jnp.float32, 4), (32, 6656, 19968, "residual", jnp.float32, 6),
      (64, 6656, 33280, "none", jnp.float32, 6), (128, 6656, 19968, "residual", jnp.float32, 5)):
    kn = BG.default_knobs(m, n, k, epilogue, out_dtype, "fp8")
    assert (kn["wg_split"], kn["block_k"], kn["max_concurrent_steps"]) == ("k", 128, steps), (m, n)
    n_w = 2 if epilogue == "gate_up" else 1
    used = BG.smem_bytes(m, epilogue, out_dtype, 64, 128, steps, "fp8", "k")
    assert used == stage(m, n_w) * steps + 2 * n_w * 64 * 4   # the tiles and the row scales
    assert used <= BG.SMEM_BYTES - 2048
    if m == 128:   # one more stage would not fit
      assert not BG.fits(m, n, k, epilogue, out_dtype, 64, 128, steps + 1, fmt="fp8",
                         wg_split="k")
  # At 256 rows one accumulator's epilogues run "k" in 3 x 128 stages; gate_up runs "rows",
  # which writes its y^T tiles there too once both pipelines have ended (4 x 64 when the tiles
  # took 64 KiB of their own), its two weight tiles in 5 x 64; "rows" fits 3 x 128 for the
  # others as well.
  for n, k, epilogue, out_dtype, split, depth in (
      (6144, 6656, "none", jnp.float32, "k", (128, 3)),
      (6656, 19968, "residual", jnp.float32, "k", (128, 3)),
      (19968, 6656, "gate_up", jnp.bfloat16, "rows", (64, 5))):
    kn = BG.default_knobs(256, n, k, epilogue, out_dtype, "fp8")
    assert (kn["wg_split"], kn["block_k"], kn["max_concurrent_steps"]) == (split, *depth)
    n_w = 2 if epilogue == "gate_up" else 1
    used = BG.smem_bytes(256, epilogue, out_dtype, 64, *depth, "fp8", split)
    assert used == depth[0] * (256 * 2 + n_w * 64) * depth[1] + 2 * n_w * 64 * 4
    if n_w == 1:
      assert BG.fits(256, n, k, epilogue, out_dtype, 64, 128, 3, fmt="fp8", wg_split="rows")


def test_linear_keeps_xla_off_hopper():
  # On a backend without the kernel (CPU here), every row count past the skinny GEMM's runs
  # XLA's GEMM: no Mosaic GPU call in the lowered program.
  if hopper_available():
    pytest.skip("this backend has the kernel (the GPU tests cover it)")
  x = jnp.ones((128, 256), jnp.bfloat16)
  w = jnp.ones((128, 256), jnp.bfloat16)
  text = jax.jit(lambda x, w: P.linear(x, w)).lower(x, w).as_text()
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
  kn = BG.default_knobs(m, n, k, epilogue, out_dtype)
  got = BG.batched_matmul(jnp.asarray(x), jnp.asarray(w), None if r is None else jnp.asarray(r),
                          epilogue=epilogue, out_dtype=out_dtype, **kn)
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
  lo, hi = P.BATCHED_ROWS["bf16"]
  for rows, want in ((lo - 1, False), (lo, True), (hi, True), (hi + 1, False)):
    xr = jnp.ones((rows, 1024), jnp.bfloat16)
    text = jax.jit(lambda x, w: P.linear(x, w, residual=jnp.zeros((x.shape[0], 512)))).lower(
        xr, w).as_text()
    assert ("mosaic_gpu" in text) == want, rows
  del x


CALLS = []   # (rows, epilogue) of every kernel launch the stand-in below saw


def _fake_call_fp8(x, w, scale, *, gate_up, out_dtype, n, split_k=1, wg_split, **_):
  """The fp8 kernel's stand-in on CPU: the twin's y^T (per K split), as the kernel writes it."""
  y = _fake_call(x, w, None, epilogue="gate_up" if gate_up else "none", out_dtype=out_dtype,
                 n=n, split_k=split_k, scale=scale, wg_split=wg_split)
  return jnp.swapaxes(y, -1, -2)


def _fake_call(x, w, residual, *, epilogue, out_dtype, n, split_k=1, scale=None,
               wg_split="rows", **_):
  """The kernel body's stand-in on CPU: the twin on the padded operands (per K split)."""
  assert x.dtype == jnp.bfloat16 and x.shape[0] == BG.padded_rows(x.shape[0], wg_split)
  assert x.shape[0] <= BG.max_rows(epilogue, wg_split)
  CALLS.append((x.shape[0], epilogue))
  if split_k == 1:
    return BG.batched_matmul_reference(x, w, residual, scale=scale, epilogue=epilogue,
                                       out_dtype=out_dtype)
  kl = x.shape[1] // split_k
  return jnp.stack([BG.batched_matmul_reference(x[:, i * kl:(i + 1) * kl],
                                                w[:, i * kl:(i + 1) * kl], scale=scale)
                    .astype(out_dtype)
                    for i in range(split_k)])


def test_linear_batched_branch_on_cpu(monkeypatch):
  """params.linear's batched branch (rounding to bf16, the residual and gate_up epilogues,
  the padding to 64 or 128 rows; the 256-row chunks of a direct call) with the kernel body
  replaced by the twin on the padded operands: it must give XLA's path to float32 rounding."""
  calls, fake_call = CALLS, _fake_call
  calls.clear()
  rng = np.random.default_rng(7)
  k, n = 256, 128
  w = jnp.asarray(rng.standard_normal((n, k)) / 16, jnp.bfloat16)
  wgu = jnp.asarray(rng.standard_normal((2 * n, k)) / 16, jnp.bfloat16)
  for m in (P.BATCHED_ROWS["bf16"][0], P.BATCHED_ROWS["bf16"][1]):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    want = [P.linear(x, w, impl="xla", residual=r), P.linear(x, w, impl="xla", partials=True),
            P.linear(x, wgu, impl="xla", gate_up=True, out_dtype=jnp.bfloat16)]
    monkeypatch.setattr(P, "hopper_available", lambda: True)
    monkeypatch.setattr(BG, "_call", fake_call)
    monkeypatch.setattr(BG, "_call_fp8", _fake_call_fp8)
    got = [P.linear(x, w, residual=r), P.linear(x, w, partials=True),
           P.linear(x, wgu, gate_up=True, out_dtype=jnp.bfloat16)]
    monkeypatch.undo()
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
    calls.clear()
    for wb in (w, wgu):
      w8, sc = quantize_fp8(np.asarray(wb, np.float32))
      qw = P.QuantWeight(jnp.asarray(w8), jnp.asarray(sc), "fp8")
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
      gu = wb is wgu
      od = jnp.bfloat16 if gu else jnp.float32
      want = P.linear(x, qw, impl="xla", gate_up=gu, out_dtype=od)
      monkeypatch.setattr(P, "hopper_available", lambda: True)
      monkeypatch.setattr(BG, "_call", fake_call)
      monkeypatch.setattr(BG, "_call_fp8", _fake_call_fp8)
      monkeypatch.setattr(BG, "FP8_K_SPLIT_MAX_M", 512 if wg_split == "k" else 0)
      monkeypatch.setattr(P, "BATCHED_ROWS", {"fp8": (17, 512)})
      monkeypatch.setattr(P, "FP8_SMALL_WEIGHTS", 0)
      got = P.linear(x, qw, gate_up=gu, out_dtype=od)
      monkeypatch.undo()
      np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                 rtol=1e-5, atol=1e-5)
    assert calls == want_calls, (wg_split, m)
  # By default fp8 runs there too (measured faster than the skinny fp8 GEMM on the H200); q8_0
  # never does.
  monkeypatch.setattr(P, "hopper_available", lambda: True)
  x = x[:P.BATCHED_ROWS["fp8"][1]]
  assert P._batched_knobs(x, qw, True, jnp.bfloat16) is not None
  # Except that at 32 rows matrices under FP8_SMALL_WEIGHTS elements stay on the skinny GEMM.
  lo = P.BATCHED_ROWS["fp8"][0]
  assert lo < P.FP8_SMALL_MIN_ROWS
  for rows, n_w, k_w, runs in ((lo, 6144, 6656, False), (P.FP8_SMALL_MIN_ROWS, 6144, 6656, True),
                               (lo, 39936, 6656, True), (lo, 6656, 19968, True)):
    big = jax.ShapeDtypeStruct((n_w, k_w), jnp.float8_e4m3fn)
    xs = jax.ShapeDtypeStruct((rows, k_w), jnp.bfloat16)
    knobs = P._batched_knobs(
        xs, P.QuantWeight(big, jax.ShapeDtypeStruct((n_w,), jnp.float32), "fp8"), False,
        jnp.float32)
    assert (knobs is not None) == runs, (rows, n_w, k_w)
  q8 = P.QuantWeight(*map(jnp.asarray, quantize_q8_0(np.asarray(wgu, np.float32))), "q8_0")
  assert P._batched_knobs(x, q8, True, jnp.bfloat16) is None
  monkeypatch.undo()
  # Past MAX_ROWS the kernel runs in 256-row chunks (the last one, 44 rows, padded to 64).
  calls.clear()
  x = jnp.asarray(rng.standard_normal((300, k)), jnp.bfloat16)
  monkeypatch.setattr(BG, "_call", fake_call)
  monkeypatch.setattr(BG, "_call_fp8", _fake_call_fp8)
  got = BG.batched_matmul(x, w, block_n=64, block_k=64)
  monkeypatch.undo()
  assert calls == [(256, "none"), (64, "none")]
  np.testing.assert_allclose(np.asarray(got), np.asarray(P.linear(x, w, impl="xla")),
                             rtol=1e-5, atol=1e-5)


def test_split_k_partials_on_cpu(monkeypatch):
  """split_k > 1 (the kernel body replaced by per-split twins): keep_splits returns the
  [split_k, M, N] partials, which sum to the product; the residual epilogue adds them up
  after the residual; gate_up refuses a split; 64 rows run unpadded (one warpgroup)."""
  fake = _fake_call
  rng = np.random.default_rng(11)
  k, n = 512, 128
  w = jnp.asarray(rng.standard_normal((n, k)) / 16, jnp.bfloat16)
  for m in (40, 64, 100):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    want = np.asarray(P.linear(x, w, impl="xla"), np.float64)
    monkeypatch.setattr(BG, "_call", fake)
    parts = BG.batched_matmul(x, w, block_n=64, block_k=64, split_k=4, keep_splits=True)
    res = BG.batched_matmul(x, w, r, epilogue="residual", block_n=64, block_k=64, split_k=2)
    monkeypatch.undo()
    assert parts.shape == (4, m, n)
    np.testing.assert_allclose(np.asarray(parts, np.float64).sum(0), want, rtol=1e-5,
                               atol=1e-4)
    np.testing.assert_allclose(np.asarray(res), want + np.asarray(r), rtol=1e-5, atol=1e-4)
  with pytest.raises(ValueError, match="whole sums"):
    BG.batched_matmul(x, jnp.concatenate([w, w]), epilogue="gate_up", block_k=64, split_k=2)
  with pytest.raises(ValueError, match="dividing the 8 K tiles"):
    BG.batched_matmul(x, w, block_k=64, split_k=3)
  with pytest.raises(ValueError, match="keep_splits is for"):
    BG.batched_matmul(x, w, r, epilogue="residual", block_k=64, split_k=2, keep_splits=True)
  with pytest.raises(ValueError, match="exceed 16384 floats"):
    BG.batched_matmul(jnp.zeros((256, k), jnp.bfloat16), jnp.zeros((512, k), jnp.bfloat16),
                      block_n=256, block_k=64)
  assert [BG.padded_rows(v) for v in (1, 64, 65, 128, 129, 256)] == [64, 64, 128, 128, 256, 256]


KNOB_VARIANTS = {   # beyond the defaults: wide column tiles (epilogue in 64-wide tiles), K splits
    "wide128": dict(block_n=128, block_k=64, max_concurrent_steps=3, split_k=1),
    "wide256": dict(block_n=256, block_k=64, max_concurrent_steps=2, split_k=1),
    "split2": dict(block_n=128, block_k=64, max_concurrent_steps=3, split_k=2),
    "split4": dict(block_n=64, block_k=64, max_concurrent_steps=4, split_k=4),
}


@pytest.mark.gpu
@pytest.mark.parametrize("m, variant, epilogue", [
    (m, v, e) for m in (40, 64, 128) for v in sorted(KNOB_VARIANTS) for e in BG.EPILOGUES
    # gate_up takes no K split (test_split_k_partials_on_cpu checks the refusal)
    if not (e == "gate_up" and KNOB_VARIANTS[v]["split_k"] > 1)])
def test_gpu_knob_variants_match_oracle(m, variant, epilogue):
  kn = dict(KNOB_VARIANTS[variant])
  n, k = 512, 1024
  if epilogue == "gate_up":   # two accumulators: at most 128 columns per warpgroup
    kn["block_n"] = min(kn["block_n"], 128)
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
  if kn["split_k"] > 1 and epilogue == "none":
    parts = BG.batched_matmul(jnp.asarray(x), jnp.asarray(w), keep_splits=True, **kn)
    assert parts.shape == (kn["split_k"], m, n)
    assert not (np.abs(np.asarray(parts, np.float64).sum(0) - want) > bound).any()


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", BG.EPILOGUES)
@pytest.mark.parametrize("m, n, k, wg_split", [
    (128, 6144, 6656, "rows"), (64, 512, 1024, "rows"), (100, 512, 1024, "rows"),
    (128, 6144, 6656, "k"), (32, 512, 1024, "k"), (20, 512, 1024, "k"), (100, 512, 1024, "k"),
    (256, 512, 1024, "k"), (300, 512, 1024, "k")])
def test_gpu_fp8_matches_oracle(monkeypatch, m, n, k, wg_split, epilogue):
  """fp8 weights (tiles widened to bf16 in registers, row scales in the epilogue) against
  the float64 oracle on the dequantized weights, both ways of sharing a program between the
  compute warpgroups (rows padded, chunked past one call's rows)."""
  monkeypatch.setattr(BG, "FP8_K_SPLIT_MAX_M", 512 if wg_split == "k" else 0)
  x, w, rng = _inputs(hash((m, n, epilogue, "fp8", wg_split)) % 2**31, m,
                      2 * n if epilogue == "gate_up" else n, k)
  w8, sc = quantize_fp8(np.asarray(w, np.float32))
  wd = (np.asarray(w8, np.float32) * sc[:, None]).astype(ml_dtypes.bfloat16)   # exact
  r = rng.standard_normal((m, n)).astype(np.float32) if epilogue == "residual" else None
  out_dtype = jnp.bfloat16 if epilogue == "gate_up" else jnp.float32
  kn = BG.default_knobs(m, n, k, epilogue, out_dtype, "fp8")
  assert kn["wg_split"] == wg_split
  got = BG.batched_matmul(jnp.asarray(x), jnp.asarray(w8), None if r is None else jnp.asarray(r),
                          scale=jnp.asarray(sc), epilogue=epilogue, out_dtype=out_dtype, **kn)
  got = np.asarray(got.astype(jnp.float32), np.float64)
  want, scale = _oracle(x, wd, r, epilogue)
  bound = ACC_RTOL * scale + 1e-6 + (BF16_EPS * np.abs(want) if epilogue == "gate_up" else 0)
  assert got.shape == want.shape and not (np.abs(got - want) > bound).any()


@pytest.mark.parametrize("fmt, name, m, wg_split", [
    ("bf16", "qkv", 128, "rows"), ("bf16", "gate_up", 128, "rows"), ("bf16", "down", 64, "rows"),
    ("fp8", "qkv", 128, "rows"), ("fp8", "gate_up", 128, "rows"), ("fp8", "o", 64, "rows"),
    ("fp8", "qkv", 32, "k"), ("fp8", "gate_up", 128, "k"), ("fp8", "down", 256, "k"),
    ("fp8", "o", 96, "k")])
def test_seed_shapes_lower_for_hopper_on_cpu(monkeypatch, fmt, name, m, wg_split):
  """Mosaic GPU lowers the kernel at the seed's matrices with the default tiles for an sm90
  target without a GPU (layouts, the register A operand of the fp8 body, wg_split "k"'s
  conditional wgmma and hand-over, shared memory within the H200's): what would otherwise
  first fail on the GPU."""
  monkeypatch.setattr(BG, "FP8_K_SPLIT_MAX_M", 512 if wg_split == "k" else 0)
  n, k, epilogue = {"qkv": (6144, 6656, "none"), "o": (6656, 4096, "residual"),
                    "gate_up": (19968, 6656, "gate_up"), "down": (6656, 19968, "residual")}[name]
  out_dtype = jnp.bfloat16 if epilogue == "gate_up" else jnp.float32
  kn = BG.default_knobs(m, n, k, epilogue, out_dtype, fmt)
  assert kn["wg_split"] == wg_split
  n_w = 2 * n if epilogue == "gate_up" else n
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  if fmt == "fp8":
    w = jax.ShapeDtypeStruct((n_w, k), jnp.float8_e4m3fn)
    f = lambda x, w, s: BG._call_fp8(
        x, w, s, gate_up=epilogue == "gate_up", out_dtype=jnp.dtype(out_dtype), n=n,
        block_n=kn["block_n"], block_k=kn["block_k"], steps=kn["max_concurrent_steps"],
        split_k=kn["split_k"], wg_split=wg_split)
    args = (x, w, jax.ShapeDtypeStruct((n_w,), jnp.float32))
  else:
    w = jax.ShapeDtypeStruct((n_w, k), jnp.bfloat16)
    r = jax.ShapeDtypeStruct((m, n), jnp.float32) if epilogue == "residual" else None
    f = lambda x, w, r: BG._call(
        x, w, r, epilogue=epilogue, out_dtype=jnp.dtype(out_dtype), n=n,
        block_n=kn["block_n"], block_k=kn["block_k"], steps=kn["max_concurrent_steps"],
        split_k=kn["split_k"])
    args = (x, w, r)
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
