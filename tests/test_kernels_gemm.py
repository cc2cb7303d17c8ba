"""pallas_kernels.skinny_gemm and dflash_jax.quant: interpret mode vs the jnp twin, a float64
numpy oracle on the dequantized weights, gguf's Q8_0, and the launch limits.

Interpret mode fills kernel outputs with NaN before the kernel runs, so an output element the
kernel fails to write shows up as NaN and fails every comparison below (poisoned outputs).
"""
from __future__ import annotations

import functools

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dflash_jax.quant import dequantize_fp8, dequantize_q8_0, quantize_fp8, quantize_q8_0
from dflash_jax.dispatch import KernelPolicy
from pallas_kernels import skinny_gemm as G
from pallas_kernels.skinny_gemm import (Knobs, skinny_matmul, skinny_matmul_gate_up,
                                        skinny_matmul_gate_up_reference, skinny_matmul_reference)


def default_knobs(*args, **kw) -> dict:
  """The kernel's default tiles under the default policy's threshold, as keyword arguments."""
  return G.default_knobs(*args, swap_ab_min_m=KernelPolicy().skinny_fp8_swap_min_m,
                         **kw).kwargs()

# float32 accumulation in a different order: the error of a K-term sum is a small multiple of
# eps_f32 * sum_k |x_k w_k|; 1e-5 leaves room for K up to ~20k (the GPU sizes) without
# admitting a wrong scale or a dropped K block (each moves the result by >> 1e-5 of it).
ACC_RTOL = 1e-5
FP8_NORMAL_MIN = 2.0 ** -6   # smallest normal float8_e4m3fn


def bf16_round(a: np.ndarray) -> np.ndarray:
  return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def random_weights(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
  """Normal weights with per-row and per-32-block magnitudes spread over ~e^+-2, so a scale
  applied to the wrong row or block changes the product."""
  w = rng.standard_normal((n, k))
  w *= np.exp(rng.normal(size=(n, 1)))
  w *= np.repeat(np.exp(rng.normal(size=(n, -(-k // 32)))), 32, axis=1)[:, :k]
  return w.astype(np.float32)


def make_weights(fmt: str, w: np.ndarray):
  """(device weights, device scale or None, float64 dequantized weights) for one format."""
  if fmt == "bf16":
    return jnp.asarray(w, jnp.bfloat16), None, bf16_round(w)
  if fmt == "fp8":
    w8, s = quantize_fp8(w)
    return jnp.asarray(w8), jnp.asarray(s), dequantize_fp8(w8, s).astype(np.float64)
  qs, d = quantize_q8_0(w)
  # q8_0 computes with the dequantized weights rounded to bf16 (see skinny_gemm's docstring).
  return jnp.asarray(qs), jnp.asarray(d), bf16_round(dequantize_q8_0(qs, d))


def oracle(x: np.ndarray, wd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """float64 x_bf16 @ wd^T and the accumulation-order bound ACC_RTOL * |x| @ |wd|^T."""
  xr = bf16_round(x)
  return xr @ wd.T, ACC_RTOL * (np.abs(xr) @ np.abs(wd).T)


def assert_within(out, want: np.ndarray, bound: np.ndarray, what: str) -> None:
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  assert out.shape == want.shape, (what, out.shape, want.shape)
  err = np.abs(out - want)
  bad = ~(err <= bound)  # NaN counts as bad
  assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} outside the bound, max err "
                         f"{np.nanmax(err)}, worst err/bound {np.nanmax(err / bound)}")


def silu(g: np.ndarray) -> np.ndarray:
  return g * 0.5 * (1.0 + np.tanh(0.5 * g))  # g * sigmoid(g) without exp overflow


def silu_mul_bound(g, u, bg, bu, out):
  """First-order propagation of gate/up errors through silu(g) * u (|silu'| <= 1.1)."""
  return 1.1 * np.abs(u) * bg + np.abs(silu(g)) * bu + 1e-6 * np.abs(out)


M_SIZES = (16, 48)
K, N = 256, 128


# ---------------------------------------------------------------------------------------------
# Host quantizers


def test_q8_0_matches_gguf_bit_for_bit():
  rng = np.random.default_rng(0)
  w = random_weights(rng, 16, 256)
  w[3, :32] = 0.0                    # an all-zero block: d = 0, qs = 0
  # amax 127 makes d = 1, so x * (1 / d) lands on exact halves: roundf rounds them away from
  # zero where np.round would round to even (2.5 -> 3, -0.5 -> -1).
  w[5, 32:64] = np.array([127.0, 2.5, -0.5, 0.5, -3.5] + [1.25] * 27, np.float32)
  qs, d = quantize_q8_0(w)
  assert qs.dtype == np.int8 and d.dtype == np.float32 and d.shape == (16, 8)

  packed = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0).reshape(16, 8, 34)
  d_gguf = packed[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
  qs_gguf = packed[..., 2:].copy().view(np.int8).reshape(16, 256)
  np.testing.assert_array_equal(d, d_gguf)
  np.testing.assert_array_equal(qs, qs_gguf)
  deq_gguf = gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                                    gguf.GGMLQuantizationType.Q8_0)
  np.testing.assert_array_equal(dequantize_q8_0(qs, d), deq_gguf)
  assert qs[5, 33] == 3 and qs[5, 34] == -1 and qs[5, 35] == 1 and qs[5, 36] == -4
  assert not dequantize_q8_0(qs, d)[3, :32].any()


def test_q8_0_error_bound():
  rng = np.random.default_rng(1)
  w = random_weights(rng, 32, 512)
  qs, d = quantize_q8_0(w)
  blocks = w.reshape(32, 16, 32).astype(np.float64)
  d32 = np.abs(blocks).max(axis=2, keepdims=True) / 127
  # qs is the nearest integer to x / d computed with the float32 d ...
  assert np.all(np.abs(blocks - qs.reshape(32, 16, 32) * d32) <= d32 / 2 * (1 + 1e-6))
  # ... and storing d as float16 (relative rounding <= 2^-11) adds at most 127 * |d16 - d32|.
  err = np.abs(blocks - dequantize_q8_0(qs, d).reshape(32, 16, 32))
  assert np.all(err <= d32 * (0.5 + 127 * 2.0 ** -11) * (1 + 1e-6))
  assert np.all(np.abs(d[..., None] - d32) <= d32 * 2.0 ** -11)
  assert np.abs(qs).max() == 127


def test_fp8_round_trip_error_bound():
  rng = np.random.default_rng(2)
  w = random_weights(rng, 32, 256)
  w[7] = 0.0                         # all-zero row: guarded scale, zeros back
  w8, scale = quantize_fp8(w)
  assert w8.dtype == ml_dtypes.float8_e4m3fn and scale.dtype == np.float32
  amax = np.delete(np.abs(w).max(axis=1), 7)
  # The smallest power of two with amax / scale <= 448: exact bf16 dequantized weights.
  s = np.delete(scale, 7).astype(np.float64)
  np.testing.assert_array_equal(s, np.exp2(np.round(np.log2(s))))
  assert np.all(amax <= 448 * s) and np.all(amax > 224 * s)
  assert scale[7] == 1.0
  w8f = w8.astype(np.float32)
  assert np.all(np.isfinite(w8f)) and np.abs(w8f).max() <= 448.0
  deq = dequantize_fp8(w8, scale).astype(np.float64)
  np.testing.assert_array_equal(deq, w8f * scale[:, None])
  assert not deq[7].any()
  scaled = np.abs(w) / scale[:, None]
  err = np.abs(deq - w)
  normal = scaled >= FP8_NORMAL_MIN
  # 3 mantissa bits: round to nearest is within 2^-4 relative on normal values, within half
  # the subnormal spacing 2^-9 below that (the f32 rescale adds ~1e-7 relative).
  assert np.all(err[normal] <= 2.0 ** -4 * np.abs(w[normal]) * (1 + 1e-6))
  sub_bound = 2.0 ** -10 * np.broadcast_to(scale[:, None], w.shape) * (1 + 1e-6)
  assert np.all(err[~normal] <= sub_bound[~normal])


@pytest.mark.parametrize("fmt", ["fp8", "q8_0", "bf16"])
def test_quantizers_in_row_blocks_equal_one_block(fmt):
  """Big matrices are converted in blocks of rows on threads: the same bytes as one block (the
  row conversion on the whole matrix; rows long enough that a block holds 14 of the 16, so the
  last block is uneven; bf16 over two parts written as one matrix), q8_0 still gguf's own
  bytes."""
  from dflash_jax import quant
  rng = np.random.default_rng(4)
  k = (quant._BLOCK_VALUES // 15 // 32 + 1) * 32          # 15 rows are over one block
  assert quant._BLOCK_VALUES // k == 14
  w = random_weights(rng, 16, k)
  w[5] = 0.0
  if fmt == "bf16":
    def fn(a):
      return (quant.to_bf16(a[:7], a[7:]),)
    whole = (w.astype(ml_dtypes.bfloat16),)
  else:
    fn = quant.quantize_fp8 if fmt == "fp8" else quant.quantize_q8_0
    whole = (quant._fp8_rows if fmt == "fp8" else quant._q8_0_rows)(w)
  blocked = fn(w)
  for a, b in zip(whole, blocked, strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
  if fmt == "q8_0":
    packed = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0).reshape(16, k // 32, 34)
    np.testing.assert_array_equal(blocked[0], packed[..., 2:].copy().view(np.int8).reshape(16, k))
    w[15, :32] = 70000.0 * 127                             # d overflows float16, in the last block
    with pytest.raises(ValueError, match="must fit float16"):
      fn(w)


def test_quantizer_limits():
  with pytest.raises(ValueError, match=r"K % 32 == 0 required \(got K=48\)"):
    quantize_q8_0(np.ones((4, 48), np.float32))
  with pytest.raises(ValueError, match="must be 2-D"):
    quantize_fp8(np.ones(64, np.float32))
  with pytest.raises(ValueError, match="must be finite"):
    quantize_fp8(np.full((2, 32), np.inf, np.float32))
  with pytest.raises(ValueError, match="fit float16"):
    quantize_q8_0(np.full((2, 32), 1e8, np.float32))


# ---------------------------------------------------------------------------------------------
# Kernel vs twin and float64 oracle


@pytest.mark.parametrize("m", M_SIZES)
@pytest.mark.parametrize("split_k", (1, 2, 3))
@pytest.mark.parametrize("fmt", ("bf16", "fp8", "q8_0"))
def test_skinny_matmul_matches_twin_and_oracle(fmt, split_k, m):
  # block_k 64: 4 K blocks, so split_k 3 gives splits of 2, 2 and 0 blocks (dynamic count);
  # m 48 runs one 64-row tile with masked rows.
  rng = np.random.default_rng(100 + 10 * split_k + m)
  x = rng.standard_normal((m, K)).astype(np.float32)
  w, s, wd = make_weights(fmt, random_weights(rng, N, K))
  out = skinny_matmul(jnp.asarray(x), w, s, fmt=fmt, block_k=64, split_k=split_k,
                      interpret=True)
  assert out.dtype == jnp.float32
  want, bound = oracle(x, wd)
  assert_within(out, want, bound, f"{fmt} vs float64 oracle")
  ref = skinny_matmul_reference(jnp.asarray(x), w, s, fmt=fmt)
  assert_within(ref, want, bound, f"{fmt} twin vs float64 oracle")
  assert_within(out, np.asarray(ref, np.float64), 2 * bound, f"{fmt} vs twin")


@pytest.mark.parametrize("split_k", (1, 3))
def test_keep_splits_returns_the_partials(split_k):
  """keep_splits: [split_k, M, N] float32 partials, each the product over its own K range,
  whose in-order sum is the summed result (up to float32 summation order)."""
  rng = np.random.default_rng(60 + split_k)
  x = rng.standard_normal((16, K)).astype(np.float32)
  w, s, wd = make_weights("q8_0", random_weights(rng, N, K))
  parts = skinny_matmul(jnp.asarray(x), w, s, fmt="q8_0", block_k=64, split_k=split_k,
                        keep_splits=True, out_dtype=jnp.bfloat16, interpret=True)
  assert parts.shape == (split_k, 16, N) and parts.dtype == jnp.float32
  per = -(-(K // 64) // split_k) * 64   # K columns per split (the last may be short or empty)
  for i in range(split_k):
    cols = slice(i * per, min((i + 1) * per, K))
    want, bound = oracle(x[:, cols], wd[:, cols])
    assert_within(parts[i], want, bound, f"partial {i}")
  assert_within(np.asarray(parts, np.float64).sum(0), *oracle(x, wd), "sum of partials")


@pytest.mark.parametrize("fmt", ("bf16", "q8_0"))
def test_m_tiling_with_partial_last_tile(fmt):
  # M = 40 over 16-row tiles: three M programs per weight tile, the last one masked.
  rng = np.random.default_rng(7)
  x = rng.standard_normal((40, K)).astype(np.float32)
  w, s, wd = make_weights(fmt, random_weights(rng, N, K))
  out = skinny_matmul(jnp.asarray(x), w, s, fmt=fmt, block_m=16, block_n=32, block_k=128,
                      split_k=2, interpret=True)
  assert_within(out, *oracle(x, wd), f"{fmt} M-tiled")


@pytest.mark.parametrize("fmt, m, n, k, split_k, gate_up", [
    ("bf16", 64, 128, 256, 1, False), ("bf16", 40, 96, 200, 2, False),
    ("bf16", 48, 128, 256, 1, True), ("fp8", 37, 128, 256, 2, False),
    ("fp8", 64, 96, 256, 1, True), ("q8_0", 33, 128, 256, 2, False),
    ("q8_0", 64, 128, 256, 1, True), ("fp32", 48, 64, 128, 2, False)])
def test_row_chunks_equal_one_chunk_programs(fmt, m, n, k, split_k, gate_up):
  """row_chunks 2-4 (one program over up to 64 rows, the weight tile read once) equals 16-row
  programs (row_chunks 1) bit for bit, ragged N, a K tail and a partial last chunk included,
  and the product is within the float64 oracle's bound."""
  rng = np.random.default_rng(m + n + k)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  rows = 2 * n if gate_up else n
  if fmt == "fp32":
    w, s = jnp.asarray(random_weights(rng, rows, k)), None
    wd = np.asarray(w, np.float64)
  else:
    w, s, wd = make_weights(fmt, random_weights(rng, rows, k))
  kn = dict(fmt=fmt, block_m=16, block_n=32, block_k=64, split_k=split_k, interpret=True)
  f = (functools.partial(skinny_matmul_gate_up, x, w, s) if gate_up
       else functools.partial(skinny_matmul, x, w, s, keep_splits=True))
  one = np.asarray(f(**kn))
  for chunks in range(2, -(-m // 16) + 1):
    got = np.asarray(f(row_chunks=chunks, **kn))
    np.testing.assert_array_equal(got.view(np.uint32), one.view(np.uint32), err_msg=chunks)
  if not gate_up:
    xr = np.asarray(x, np.float64) if fmt == "fp32" else bf16_round(np.asarray(x))
    want = xr @ wd.T
    assert_within(one.sum(0), want, 4 * ACC_RTOL * (np.abs(xr) @ np.abs(wd).T), fmt)


def test_x_is_rounded_to_bf16_and_out_dtype():
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.standard_normal((16, K)), jnp.float32)
  w, s, _ = make_weights("fp8", random_weights(rng, N, K))
  out32 = skinny_matmul(x, w, s, fmt="fp8", interpret=True)
  outb = skinny_matmul(x.astype(jnp.bfloat16), w, s, fmt="fp8", interpret=True)
  np.testing.assert_array_equal(np.asarray(out32), np.asarray(outb))
  for split_k in (1, 2):
    o16 = skinny_matmul(x, w, s, fmt="fp8", split_k=split_k, out_dtype=jnp.bfloat16,
                        interpret=True)
    assert o16.dtype == jnp.bfloat16
    ref = skinny_matmul_reference(x, w, s, fmt="fp8").astype(jnp.bfloat16)
    # One bf16 rounding of values that differ by ~1e-6 relative: at most one bf16 ulp apart.
    np.testing.assert_allclose(np.asarray(o16, np.float32), np.asarray(ref, np.float32),
                               rtol=2.0 ** -7, atol=0)


# The split-K x row-masking grid is the plain kernel's (above); the gate+up epilogue gets one
# unsplit case of full row tiles and one split case with masked rows per format.
@pytest.mark.parametrize("split_k, m", [(1, 16), (2, 48)])
@pytest.mark.parametrize("fmt", ("bf16", "fp8", "q8_0"))
def test_gate_up_fused_vs_separate(fmt, split_k, m):
  n_ff = 64
  rng = np.random.default_rng(200 + 10 * split_k + m)
  x = jnp.asarray(rng.standard_normal((m, K)), jnp.float32)
  w, s, wd = make_weights(fmt, random_weights(rng, 2 * n_ff, K))
  kw = dict(fmt=fmt, block_n=32, block_k=64, split_k=split_k, interpret=True)
  fused = skinny_matmul_gate_up(x, w, s, **kw)
  assert fused.shape == (m, n_ff) and fused.dtype == jnp.float32

  split = lambda a: (a[:n_ff], a[n_ff:])
  (wg, wu), (sg, su) = split(w), split(s) if s is not None else (None, None)
  g = np.asarray(skinny_matmul(x, wg, sg, **kw), np.float64)
  u = np.asarray(skinny_matmul(x, wu, su, **kw), np.float64)
  sep = silu(g) * u
  # Same tiles, same K order: the accumulators are identical, only silu may differ by ulps.
  np.testing.assert_allclose(np.asarray(fused, np.float64), sep, rtol=1e-6, atol=1e-6)

  want_gu, bound_gu = oracle(np.asarray(x), wd)
  gw, uw = want_gu[:, :n_ff], want_gu[:, n_ff:]
  want = silu(gw) * uw
  bound = silu_mul_bound(gw, uw, bound_gu[:, :n_ff], bound_gu[:, n_ff:], want)
  assert_within(fused, want, bound, f"{fmt} gate_up vs float64 oracle")
  ref = skinny_matmul_gate_up_reference(x, w, s, fmt=fmt)
  assert_within(fused, np.asarray(ref, np.float64), 2 * bound, f"{fmt} gate_up vs twin")


@pytest.mark.parametrize("gate_up", (False, True))
@pytest.mark.parametrize("fmt", ("bf16", "fp8", "q8_0"))
def test_swap_ab_matches_oracle(fmt, gate_up):
  """swap_ab (the MMA on the transposed tile): M = 40 in one 64-row tile (rows masked), and
  for the plain GEMM a K split of 2 over a 64-wide K tail (K = 192 + 64 over block_k 128)."""
  rng = np.random.default_rng(300 + 7 * gate_up + len(fmt))
  m, k, n_ff = 40, 256, 64
  x = rng.standard_normal((m, k)).astype(np.float32)
  w, s, wd = make_weights(fmt, random_weights(rng, 2 * n_ff if gate_up else N, k))
  kw = dict(fmt=fmt, block_m=64, block_n=32, block_k=128 if not gate_up else 64,
            swap_ab=True, interpret=True)
  want, bound = oracle(x, wd)
  if not gate_up:
    out = skinny_matmul(jnp.asarray(x), w, s, split_k=2, **kw)
    assert_within(out, want, bound, f"{fmt} swap_ab vs float64 oracle")
    return
  fused = skinny_matmul_gate_up(jnp.asarray(x), w, s, **kw)
  gw, uw = want[:, :n_ff], want[:, n_ff:]
  want = silu(gw) * uw
  assert_within(fused, want, silu_mul_bound(gw, uw, bound[:, :n_ff], bound[:, n_ff:], want),
                f"{fmt} swap_ab gate_up vs float64 oracle")


@pytest.mark.parametrize("split_k", (1, 2))
def test_q8_0_eight_blocks_per_tile(split_k):
  # block_k 256: eight 32-blocks per K tile, each scaled by its own strided scale column; the
  # second K tile (or split) reads columns 8..15, so a column offset missing kb shows.
  k, n_ff = 512, 32
  rng = np.random.default_rng(300 + split_k)
  x = rng.standard_normal((16, k)).astype(np.float32)
  w, s, wd = make_weights("q8_0", random_weights(rng, 2 * n_ff, k))
  kw = dict(fmt="q8_0", block_n=32, block_k=256, split_k=split_k, interpret=True)
  want, bound = oracle(x, wd)
  assert_within(skinny_matmul(jnp.asarray(x), w, s, **kw), want, bound, "q8_0 block_k 256")
  g, u = want[:, :n_ff], want[:, n_ff:]
  assert_within(skinny_matmul_gate_up(jnp.asarray(x), w, s, **kw), silu(g) * u,
                silu_mul_bound(g, u, bound[:, :n_ff], bound[:, n_ff:], silu(g) * u),
                "q8_0 gate_up block_k 256")


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
def test_q8_0_every_weight_exactly(interpret):
  """On the GPU int8 is widened by inline PTX, in the interpreter by a convert: same bits."""
  # x = identity: each output is one product plus exact zeros, so the kernel must return
  # round_bf16(q * d) for every weight bit for bit. All 256 int8 values appear in every row
  # (-128 too: a Q8_0 file may hold it) at shuffled positions, under random float32 scales.
  n = k = 256
  rng = np.random.default_rng(77)
  qs = np.stack([rng.permutation(np.arange(-128, 128)) for _ in range(n)]).astype(np.int8)
  d = rng.uniform(1e-3, 2.0, (n, k // 32)).astype(np.float32)
  x = jnp.eye(k, dtype=jnp.float32)
  out = skinny_matmul(x, jnp.asarray(qs), jnp.asarray(d), fmt="q8_0", block_n=32, block_k=128,
                      interpret=interpret)
  want = bf16_round(qs.astype(np.float32) * np.repeat(d, 32, axis=1)).T
  np.testing.assert_array_equal(np.asarray(out), want)


# Shapes no tile divides: (fmt, M, N, K, knobs). Each combines a ragged last N tile (masked
# weight rows and output columns, the gate+up's up half starting off a tile boundary) with a
# masked K tail (columns past K; with split K only its owner reads it), and M masked rows.
ODD_SHAPES = [
    ("bf16", 5, 100, 40, dict(block_n=64, block_k=128)),           # N and K below one tile
    ("fp8", 16, 72, 200, dict(block_n=32, block_k=64, split_k=3)),  # tail in the 2nd split
    ("q8_0", 20, 50, 96, dict(block_n=32, block_k=64, split_k=2)),  # tail: one 32-block of 2
    ("q8_0", 48, 64, 160, dict(block_n=32, block_k=128)),           # N fits, K tail only
]


@pytest.mark.parametrize("fmt, m, n, k, knobs", ODD_SHAPES)
def test_any_shape_matches_twin_and_oracle(fmt, m, n, k, knobs):
  rng = np.random.default_rng(400 + n + k)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w, s, wd = make_weights(fmt, random_weights(rng, 2 * n, k))
  kw = dict(fmt=fmt, interpret=True, **knobs)
  want, bound = oracle(x, wd)
  out = skinny_matmul(jnp.asarray(x), w, s, **kw)
  assert out.shape == (m, 2 * n)
  assert_within(out, want, bound, f"{fmt} {m}x{2 * n}x{k}")
  assert_within(skinny_matmul_reference(jnp.asarray(x), w, s, fmt=fmt), want, bound,
                f"{fmt} twin")
  g, u = want[:, :n], want[:, n:]
  fused = skinny_matmul_gate_up(jnp.asarray(x), w, s, **kw)
  assert fused.shape == (m, n)
  assert_within(fused, silu(g) * u, silu_mul_bound(g, u, bound[:, :n], bound[:, n:],
                                                  silu(g) * u), f"{fmt} gate_up")


def test_keep_splits_with_a_k_tail():
  """keep_splits on K = 200 in 64-wide tiles split 3 ways: blocks 0-1, 2 + the 8-column tail,
  and an empty split (all zeros)."""
  rng = np.random.default_rng(70)
  x = rng.standard_normal((16, 200)).astype(np.float32)
  w, s, wd = make_weights("fp8", random_weights(rng, 40, 200))
  parts = skinny_matmul(jnp.asarray(x), w, s, fmt="fp8", block_n=32, block_k=64, split_k=3,
                        keep_splits=True, interpret=True)
  assert parts.shape == (3, 16, 40)
  for i, cols in enumerate((slice(0, 128), slice(128, 200))):
    assert_within(parts[i], *oracle(x[:, cols], wd[:, cols]), f"partial {i}")
  np.testing.assert_array_equal(np.asarray(parts[2]), 0.0)


def test_default_knobs():
  """The tuned tiles (RESULTS.md's GEMM sweeps) at the seed's shapes, and the docstring's
  rules for shapes no tuned tile divides; the fp8 swapped MMA from the caller's row
  threshold."""
  seed = {  # (fmt, n, k, gate_up): (block_n, block_k, split_k)
      ("bf16", 6144, 6656, False): (64, 128, 4), ("fp8", 6656, 4096, False): (64, 128, 4),
      ("fp8", 6656, 19968, False): (64, 256, 5), ("q8_0", 6656, 19968, False): (64, 256, 5),
      ("q8_0", 6144, 6656, False): (32, 256, 4), ("fp8", 19968, 6656, True): (32, 128, 1),
      ("q8_0", 19968, 6656, True): (32, 256, 1), ("bf16", 8192, 6656, False): (64, 128, 4),
      ("bf16", 202048, 6656, False): (64, 128, 1), ("fp8", 6656, 33280, False): (64, 256, 5),
      # bf16's own (run 15): 128-wide K tiles for a long K, 2 splits for the o projection.
      ("bf16", 6656, 19968, False): (64, 128, 5), ("bf16", 6656, 4096, False): (64, 128, 2),
      # ... but not where 2 splits would leave fewer than 1.5 programs per SM (a 4096-wide o).
      ("bf16", 4096, 4096, False): (64, 128, 4),
      # 8 splits where 4 would leave SMs idle over a long K (DFlash2's coefficient projection,
      # 26 N tiles) ...
      ("bf16", 1664, 6656, False): (64, 128, 8), ("bf16", 2048, 6144, False): (64, 128, 8),
      # ... not at 33 N tiles (132 programs with 4), nor K below 48 blocks, nor other formats.
      ("bf16", 2112, 6656, False): (64, 128, 4), ("bf16", 1664, 6016, False): (64, 128, 4),
      ("fp8", 1664, 6656, False): (64, 128, 4),
  }
  for (fmt, n, k, gu), (bn, bk, sk) in seed.items():
    assert default_knobs(fmt, n, k, gu) == Knobs(block_n=bn, block_k=bk, split_k=sk,
                                                 num_stages=3).kwargs(), (fmt, n, k, gu)
  # A vocab of 1000 and K = 6656 + 40 keep the tuned tiles (masked last tiles) ...
  assert default_knobs("fp8", 1000, 6696) == Knobs(block_n=64, block_k=128,
                                                   split_k=4).kwargs()
  # ... small dimensions get the power of 2 covering them.
  assert default_knobs("bf16", 10, 40) == Knobs(block_n=16, block_k=64, split_k=1).kwargs()
  assert default_knobs("q8_0", 50, 32)["block_k"] == 32
  # Batched rows: fp8 swaps the MMA over one M tile of up to 128 rows; one block of rows and
  # the other formats keep the tuned tiles.
  assert default_knobs("fp8", 6656, 19968, m=16) == default_knobs("fp8", 6656, 19968)
  assert default_knobs("fp8", 6656, 19968, m=128) == dict(
      block_n=64, block_k=256, split_k=5, num_stages=3, block_m=128, swap_ab=True, num_warps=8,
      row_chunks=1)
  assert default_knobs("fp8", 19968, 6656, True, m=48) == dict(
      block_n=64, block_k=128, split_k=1, num_stages=3, block_m=64, swap_ab=True, num_warps=4,
      row_chunks=1)
  assert default_knobs("fp8", 6144, 6656, m=512)["block_m"] == 128
  for fmt in ("bf16", "q8_0"):
    assert default_knobs(fmt, 6144, 6656, m=128) == default_knobs(fmt, 6144, 6656)
  # The row threshold is the caller's (a KernelPolicy's skinny_fp8_swap_min_m).
  assert G.default_knobs("fp8", 6144, 6656, m=16, swap_ab_min_m=16).swap_ab
  assert not G.default_knobs("fp8", 6144, 6656, m=64, swap_ab_min_m=65).swap_ab


# ---------------------------------------------------------------------------------------------
# Launch limits


def _args(fmt="bf16", m=16, n=N, k=K, w_dtype=None, scale="auto"):
  x = jnp.ones((m, k), jnp.float32)
  w_dtype = w_dtype or {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "q8_0": jnp.int8}[fmt]
  w = jnp.ones((n, k), w_dtype)
  if scale == "auto":
    scale = {"bf16": None, "fp8": jnp.ones((n,), jnp.float32),
             "q8_0": jnp.ones((n, max(k // 32, 1)), jnp.float32)}[fmt]
  return x, w, scale


@pytest.mark.parametrize("args, kw, msg", [
    (_args(), dict(fmt="int4"), r"fmt in \("),
    (_args(w_dtype=jnp.float32), dict(fmt="bf16"), r"w dtype bfloat16 for fmt='bf16'"),
    (_args("fp8", w_dtype=jnp.int8), dict(fmt="fp8"), r"w dtype float8_e4m3fn"),
    (_args(scale=jnp.ones((N,), jnp.float32)), dict(fmt="bf16"), "scale must be None"),
    (_args("fp8", scale=None), dict(fmt="fp8"), r"scale \(128,\) float32 required"),
    (_args("q8_0", scale=jnp.ones((N,), jnp.float32)), dict(fmt="q8_0"),
     r"scale shape \(128, 8\) for fmt='q8_0' \(got \(128,\)\)"),
    (_args("fp8", scale=jnp.ones((N,), jnp.bfloat16)), dict(fmt="fp8"), "scale dtype float32"),
    (_args(), dict(fmt="bf16", block_n=48), r"block_n a power of 2 >= 16 \(got 48\)"),
    (_args(), dict(fmt="bf16", block_k=8), r"block_k a power of 2 >= 16 \(got 8\)"),
    (_args(), dict(fmt="bf16", block_m=8), r"block_m a power of 2 >= 16 \(got 8\)"),
    (_args("q8_0", k=48), dict(fmt="q8_0", block_k=16), r"K % 32 == 0 for q8_0 \(got 48\)"),
    (_args("q8_0"), dict(fmt="q8_0", block_k=16), r"block_k >= 32 for q8_0 \(got 16\)"),
    (_args("q8_0"), dict(fmt="q8_0", block_n=16, block_k=32, num_warps=8),
     r"block_n \* block_k >= 128 \* num_warps for q8_0 \(4 weights per thread\) "
     r"\(got \(16, 32, 8\)\)"),
    (_args(), dict(fmt="bf16", split_k=3), r"1 <= split_k <= ceil\(K / block_k\) = 2 \(got 3\)"),
    (_args(), dict(fmt="bf16", split_k=0), r"1 <= split_k <= ceil\(K / block_k\) = 2 \(got 0\)"),
    (_args(), dict(fmt="bf16", row_chunks=5),
     r"row_chunks an int in \[1, 4\], 1 with swap_ab \(got \(5, False\)\)"),
    (_args("fp8"), dict(fmt="fp8", row_chunks=2, swap_ab=True),
     r"row_chunks an int in \[1, 4\], 1 with swap_ab \(got \(2, True\)\)"),
    # K = 200: one full 128-wide block and a tail block.
    (_args(k=200), dict(fmt="bf16", split_k=3),
     r"1 <= split_k <= ceil\(K / block_k\) = 2 \(got 3\)"),
])
def test_skinny_matmul_limits(args, kw, msg):
  with pytest.raises(ValueError, match=r"skinny_matmul: " + msg):
    skinny_matmul(*args, interpret=True, **kw)


def test_shape_and_dtype_limits():
  x, w, _ = _args()
  with pytest.raises(ValueError, match=r"w.shape\[1\] == x.shape\[1\]"):
    skinny_matmul(x[:, :128], w, fmt="bf16", interpret=True)
  with pytest.raises(ValueError, match="x dtype bfloat16 or float32"):
    skinny_matmul(x.astype(jnp.float16), w, fmt="bf16", interpret=True)
  with pytest.raises(ValueError, match="x must be 2-D"):
    skinny_matmul(x[None], w, fmt="bf16", interpret=True)


def test_gate_up_limits():
  x, w, _ = _args(n=192)
  with pytest.raises(ValueError, match=r"skinny_matmul_gate_up: w_gu 2-D \[2 n_ff, K\]"):
    skinny_matmul_gate_up(x, w[:191], fmt="bf16", interpret=True)


# ---------------------------------------------------------------------------------------------
# GPU: real drafter sizes (Qwen3-8B-class: n_embd 6656 in; qkv 6144, gate+up 2 x 19968, down)


def _device_weights(fmt: str, n: int, k: int, key):
  """Random weights already in the stored format, made on the device (no host quantizing)."""
  kw, ks = jax.random.split(key)
  if fmt == "bf16":
    return (jax.random.normal(kw, (n, k), jnp.float32) * 0.02).astype(jnp.bfloat16), None
  if fmt == "fp8":
    # Clipped to the e4m3fn range: the format has no inf, so an overflowing cast is NaN.
    w8 = jnp.clip(jax.random.normal(kw, (n, k), jnp.float32) * 100.0, -448, 448)
    w8 = w8.astype(jnp.float8_e4m3fn)
    return w8, jax.random.uniform(ks, (n,), jnp.float32, 1e-4, 1e-3)
  qs = jax.random.randint(kw, (n, k), -128, 128, jnp.int32).astype(jnp.int8)
  return qs, jax.random.uniform(ks, (n, k // 32), jnp.float32, 1e-4, 1e-3)


def _device_bound(x, w, s, fmt):
  # Scales are positive, so the twin on |x|, |w| gives sum_k |x_k| |dequant(w)_k|; |w| goes
  # through float32 (exact for all three formats) since abs is not defined on every one.
  w_abs = jnp.abs(w.astype(jnp.float32)).astype(w.dtype)
  return ACC_RTOL * skinny_matmul_reference(jnp.abs(x), w_abs, s, fmt=fmt)


def _assert_device_within(out, want, bound, what):
  err = jnp.abs(out.astype(jnp.float32) - want)
  bad = int(jnp.sum(~(err <= bound)))
  assert bad == 0, f"{what}: {bad} outside the bound, max err/bound {float(jnp.max(err / bound))}"


def _assert_gate_up_within(out, gu, b, what):
  """out vs silu(gate) * up of the twin's [M, 2 n_ff] product gu, with the first-order bound
  propagated from b (the product's bound)."""
  n_ff = gu.shape[1] // 2
  g, u = gu[:, :n_ff], gu[:, n_ff:]
  want = g * jax.nn.sigmoid(g) * u
  bound = 1.1 * jnp.abs(u) * b[:, :n_ff] + jnp.abs(g) * b[:, n_ff:] + 1e-6 * jnp.abs(want)
  _assert_device_within(out, want, bound, what)


GPU_CASES = [  # (n, k, split_k): fused qkv, gate+up as one matrix, down projection
    (6144, 6656, 1), (39936, 6656, 1), (6656, 19968, 1), (6656, 19968, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("n, k, split_k", GPU_CASES)
@pytest.mark.parametrize("fmt", ("bf16", "fp8", "q8_0"))
def test_gpu_skinny_matmul_real_sizes(fmt, n, k, split_k):
  kx, kw = jax.random.split(jax.random.key(n + k + split_k))
  x = jax.random.normal(kx, (16, k), jnp.float32)
  w, s = _device_weights(fmt, n, k, kw)
  out = skinny_matmul(x, w, s, fmt=fmt, split_k=split_k)
  assert out.shape == (16, n) and out.dtype == jnp.float32
  _assert_device_within(out, skinny_matmul_reference(x, w, s, fmt=fmt),
                        _device_bound(x, w, s, fmt), f"{fmt} {n}x{k} split_k={split_k}")


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(6144, 6656), (6656, 4096), (6656, 19968), (8192, 6656),
                                  (1664, 6656)])
@pytest.mark.parametrize("fmt", ("bf16", "fp8", "q8_0"))
def test_gpu_step_tiles_real_sizes(fmt, n, k):
  """The tiles the step launches (default_knobs, uneven K splits included) at the seed's sizes."""
  kx, kw = jax.random.split(jax.random.key(n * 3 + k))
  x = jax.random.normal(kx, (16, k), jnp.float32)
  w, s = _device_weights(fmt, n, k, kw)
  knobs = default_knobs(fmt, n, k)
  out = skinny_matmul(x, w, s, fmt=fmt, **knobs)
  _assert_device_within(out, skinny_matmul_reference(x, w, s, fmt=fmt),
                        _device_bound(x, w, s, fmt), f"{fmt} {n}x{k} {knobs}")


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", (1, 2))
@pytest.mark.parametrize("fmt", ("bf16", "fp8", "q8_0"))
def test_gpu_gate_up_real_sizes(fmt, split_k):
  n_ff, k = 19968, 6656
  kx, kw = jax.random.split(jax.random.key(split_k))
  x = jax.random.normal(kx, (16, k), jnp.float32)
  w, s = _device_weights(fmt, 2 * n_ff, k, kw)
  out = skinny_matmul_gate_up(x, w, s, fmt=fmt, split_k=split_k)
  gu = skinny_matmul_reference(x, w, s, fmt=fmt)
  b = _device_bound(x, w, s, fmt)
  _assert_gate_up_within(out, gu, b, f"{fmt} gate_up split_k={split_k}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", (48, 128))
@pytest.mark.parametrize("n, k, gate_up", [(6144, 6656, False), (6656, 19968, False),
                                           (19968, 6656, True)])
def test_gpu_fp8_batched_rows_real_sizes(n, k, gate_up, m):
  """fp8 at a batched step's row counts with the tiles the step launches (swap_ab)."""
  kx, kw = jax.random.split(jax.random.key(m + n + k))
  x = jax.random.normal(kx, (m, k), jnp.float32)
  w, s = _device_weights("fp8", 2 * n if gate_up else n, k, kw)
  knobs = default_knobs("fp8", n, k, gate_up, m)
  assert knobs["swap_ab"]
  ref = skinny_matmul_reference(x, w, s, fmt="fp8")
  b = _device_bound(x, w, s, "fp8")
  if not gate_up:
    _assert_device_within(skinny_matmul(x, w, s, fmt="fp8", **knobs), ref, b,
                          f"fp8 {n}x{k} m={m} {knobs}")
    return
  out = skinny_matmul_gate_up(x, w, s, fmt="fp8", **knobs)
  _assert_gate_up_within(out, ref, b, f"fp8 gate_up m={m} {knobs}")


# Published drafters' odd shapes at real sizes: a 1000-token vocab through lm_head, K not a
# multiple of 32 (bf16/fp8) or of the tiles (q8_0), a gate+up whose halves are not a whole
# number of tiles. default_knobs' tiles, as the step launches them.
GPU_ODD = [("lm_head1000", 1000, 6656, False), ("k6696", 6144, 6696, False),
           ("k6752", 6656, 6752, False), ("gate_up_ragged", 20008, 6656, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, name, n, k, gate_up", [
    (fmt,) + case for fmt in ("bf16", "fp8", "q8_0") for case in GPU_ODD
    if fmt != "q8_0" or case[2] % 32 == 0])   # q8_0 needs K % 32 == 0 (the format's block)
def test_gpu_odd_shapes(fmt, name, n, k, gate_up):
  kx, kw = jax.random.split(jax.random.key(n + k))
  x = jax.random.normal(kx, (16, k), jnp.float32)
  w, s = _device_weights(fmt, 2 * n if gate_up else n, k, kw)
  knobs = default_knobs(fmt, n, k, gate_up)
  ref = skinny_matmul_reference(x, w, s, fmt=fmt)
  b = _device_bound(x, w, s, fmt)
  if not gate_up:
    out = skinny_matmul(x, w, s, fmt=fmt, **knobs)
    _assert_device_within(out, ref, b, f"{fmt} {name} {knobs}")
    return
  out = skinny_matmul_gate_up(x, w, s, fmt=fmt, **knobs)
  _assert_gate_up_within(out, ref, b, f"{fmt} {name} {knobs}")


# ---------------------------------------------------------------------------------------------
# fp32 weights (three bf16 parts per operand) and the batch-invariant routing of the target


@pytest.mark.parametrize("m, n, k, split_k, gate_up", [
    (1, 48, 64, 1, False), (5, 40, 100, 2, False), (16, N, K, 3, False), (3, 24, 96, 1, True),
    (20, 64, 2100, 4, False)])
def test_fp32_matches_oracle(m, n, k, split_k, gate_up):
  """fmt="fp32": x stays float32 and the product is float32-accurate (the bound of a float32
  accumulation, x unrounded), masked N and K tails, split K, the fused gate+up."""
  rng = np.random.default_rng(m * n + k)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = random_weights(rng, 2 * n if gate_up else n, k)
  wd = w.astype(np.float64)
  prod = x.astype(np.float64) @ wd.T
  bound = ACC_RTOL * (np.abs(x.astype(np.float64)) @ np.abs(wd).T)
  kw = dict(fmt="fp32", block_n=32, block_k=64, interpret=True)
  if not gate_up:
    out = skinny_matmul(jnp.asarray(x), jnp.asarray(w), split_k=split_k, **kw)
    assert_within(out, prod, bound, "fp32 vs float64 oracle")
    ref = skinny_matmul_reference(jnp.asarray(x), jnp.asarray(w), fmt="fp32")
    assert_within(ref, prod, bound, "fp32 twin vs float64 oracle")
    return
  out = skinny_matmul_gate_up(jnp.asarray(x), jnp.asarray(w), **kw)
  g, u, bg, bu = prod[:, :n], prod[:, n:], bound[:, :n], bound[:, n:]
  want = silu(g) * u
  assert_within(out, want, silu_mul_bound(g, u, bg, bu, want), "fp32 gate_up")


def test_fp32_default_knobs_and_limits():
  kn = G.default_knobs("fp32", 4096, 12288, False, 16, swap_ab_min_m=17)
  assert (kn.block_n, kn.block_k, kn.split_k, kn.block_m) == (32, 64, 4, None)
  assert G.default_knobs("fp32", 12288, 4096, True, 16, swap_ab_min_m=17).split_k == 1
  x, w = jnp.ones((4, 64), jnp.float32), jnp.ones((32, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="w dtype float32 for fmt='fp32'"):
    skinny_matmul(x, w, fmt="fp32", interpret=True)
  with pytest.raises(ValueError, match="scale must be None for fmt='fp32'"):
    skinny_matmul(x, w.astype(jnp.float32), jnp.ones((32,), jnp.float32), fmt="fp32",
                  interpret=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_batch_invariant_linear(dtype):
  """dispatch.linear(batch_invariant=True): up to invariant_max_rows rows the skinny GEMM with
  16-row M tiles and the weight's own K split, partials added in order, so every row of a
  1, 5, 16, 48 or 64-row product is bitwise the same; plain, partials and gate+up; past the
  bound (or with the bound at 0) the usual routing, XLA's GEMM for these row counts."""
  from dflash_jax.dispatch import KernelPolicy, linear
  rng = np.random.default_rng(3)
  k, n = 300, 72   # K: 5 blocks of 64 in fp32, 3 of 128 in bf16 with a tail; N ragged
  x = jnp.asarray(rng.standard_normal((64, k)), jnp.float32)
  w = jnp.asarray(random_weights(rng, n, k), dtype)
  w_gu = jnp.asarray(random_weights(rng, 2 * n, k), dtype)
  pol = KernelPolicy()

  def run(rows, **kw):
    return np.asarray(linear(x[:rows], kw.pop("w", w), policy=pol, batch_invariant=True, **kw))

  full = {name: run(64, **kw) for name, kw in (
      ("plain", {}), ("parts", dict(partials=True)), ("gate_up", dict(w=w_gu, gate_up=True)))}
  assert full["parts"].ndim == 3
  for rows in (1, 5, 16, 48):
    np.testing.assert_array_equal(run(rows), full["plain"][:rows])
    np.testing.assert_array_equal(run(rows, partials=True), full["parts"][:, :rows])
    np.testing.assert_array_equal(run(rows, w=w_gu, gate_up=True), full["gate_up"][:rows])
  # The result is the product (the fp32 twin's bound; bf16 rounds x as every bf16 GEMM does).
  xr = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32), np.float64)
  wd = np.asarray(w.astype(jnp.float32), np.float64)
  assert_within(full["plain"], xr @ wd.T, ACC_RTOL * (np.abs(xr) @ np.abs(wd).T), "invariant")
  x65 = jnp.concatenate([x, x[:1]])
  traced = lambda p, rows: str(jax.make_jaxpr(lambda a: linear(
      a, w, policy=p, batch_invariant=True))(x65[:rows]))
  assert "skinny_matmul" in traced(pol, 64) and "skinny_matmul" not in traced(pol, 65)
  off = KernelPolicy(invariant_max_rows=0)
  assert ("skinny_matmul" in traced(off, 16)) == (dtype == jnp.bfloat16)   # skinny_max_m
  assert "skinny_matmul" not in traced(off, 17)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k, gate_up", [(6144, 4096, False), (4096, 4096, False),
                                           (12288, 4096, True), (4096, 12288, False),
                                           (151936, 4096, False)])
def test_gpu_batch_invariant_qwen3_8b(n, k, gate_up):
  """Qwen3-8B's GEMMs (qkv, o, gate+up, down, the LM head) on the GPU through the invariant
  route: rows of 1, 5, 16, 48 and 64-row products bitwise equal (the GPU's MMA and tiles)."""
  from dflash_jax.dispatch import KernelPolicy, linear
  kx, kw = jax.random.split(jax.random.key(n + k))
  x = jax.random.normal(kx, (64, k), jnp.float32)
  w = (jax.random.normal(kw, (2 * n if gate_up else n, k), jnp.float32) * 0.02).astype(
      jnp.bfloat16)
  # w is an argument: closed over, the LM head's 1.2 GB would be a constant of the program.
  f = jax.jit(lambda a, w: linear(a, w, policy=KernelPolicy(), batch_invariant=True,
                                  gate_up=gate_up, partials=not gate_up))
  full = np.asarray(f(x, w))
  for rows in (1, 5, 16, 48):
    got = np.asarray(f(x[:rows], w))
    np.testing.assert_array_equal(got, full[:rows] if gate_up else full[:, :rows])
