"""pallas_kernels.rms_norm against a float64 numpy oracle and its jnp twin: CPU interpret at small
and odd widths, the GPU at the seed's n_embd and batched row counts.

The output is a fresh buffer the kernel must write in full; every element is compared, so an
unwritten row or a lane past a power-of-2 tile's masked end would miss the tolerance.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import rms_norm as RN

BF16_EPS = 2.0 ** -8
EPS = 1e-6


def _inputs(seed: int, m: int, k: int):
  rng = np.random.default_rng(seed)
  # Rows over ~e^+-2 in scale: a row normalised with another row's scale shows.
  x = rng.standard_normal((m, k)) * np.exp(2 * rng.normal(size=(m, 1)))
  w = rng.standard_normal(k) + 1.0
  return x.astype(np.float32), w.astype(np.float32)


def _oracle(x, w):
  x64 = np.asarray(x, np.float64)
  return x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + EPS) * np.asarray(w, np.float64)


def _check(m, k, rows, num_warps=4, out_dtype=jnp.bfloat16, seed=0):
  x, w = _inputs(seed, m, k)
  got = RN.rms_norm(jnp.asarray(x), jnp.asarray(w), eps=EPS, rows=rows, num_warps=num_warps,
                    out_dtype=out_dtype)
  assert got.shape == (m, k) and got.dtype == out_dtype
  got = np.asarray(got.astype(jnp.float32), np.float64)
  want = _oracle(x, w)
  # float32 arithmetic (a few eps_f32 relative) then one rounding to out_dtype.
  ulp = BF16_EPS if out_dtype == jnp.bfloat16 else 2.0 ** -23
  assert np.all(np.abs(got - want) <= (ulp + 1e-5) * np.abs(want) + 1e-30)
  twin = np.asarray(RN.rms_norm_reference(jnp.asarray(x), jnp.asarray(w), eps=EPS,
                                          out_dtype=out_dtype).astype(jnp.float32), np.float64)
  # Kernel and twin sum the squares in other orders (float32: ~1e-6 relative apart), so
  # after the rounding to out_dtype they may land a rounding step apart.
  assert np.all(np.abs(got - twin) <= (2 * ulp + 1e-5) * np.abs(want) + 1e-30)


@pytest.mark.parametrize("m, k, rows", [(8, 64, 1), (12, 100, 4), (3, 6656 // 8, 1),
                                        (16, 48, 16)])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_matches_oracle_interpret(m, k, rows, out_dtype):
  _check(m, k, rows, out_dtype=out_dtype, seed=m * k + rows)


@pytest.mark.parametrize("bad, msg", [
    (dict(x=np.zeros((4, 8), np.float16)), "must be float32"),
    (dict(w=np.zeros((7,), np.float32)), "w must be \\[8\\]"),
    (dict(x=np.zeros((8,), np.float32)), "x must be \\[M, K\\]"),
    (dict(rows=3), "power of 2 dividing M"),
    (dict(rows=8), "power of 2 dividing M"),
])
def test_limits(bad, msg):
  args = dict(x=np.ones((4, 8), np.float32), w=np.ones((8,), np.float32), rows=1) | bad
  with pytest.raises(ValueError, match=msg):
    RN.rms_norm(jnp.asarray(args["x"]), jnp.asarray(args["w"]), eps=EPS, rows=args["rows"])


@pytest.mark.gpu
@pytest.mark.parametrize("m, rows, num_warps", [(128, 1, 8), (64, 2, 8), (100, 4, 16),
                                                (48, 1, 4)])
def test_gpu_seed_width(m, rows, num_warps):
  _check(m, 6656, rows, num_warps, seed=m + rows)


def test_gemm_input_norm_routes_with_the_batched_gemm():
  """dispatch.gemm_input_norm: the Pallas norm (bf16 out, interpret mode here) exactly where the
  batched GEMM would run the consuming product (a policy that claims the Mosaic GPU kernels,
  at its bf16 row range), XLA's float32 norm elsewhere; both round to the same bf16 GEMM input
  up to one rounding step."""
  from dflash_jax import dispatch as P
  k, n = 256, 128
  rng = np.random.default_rng(3)
  w = jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16)
  wn = jnp.asarray(rng.standard_normal(k) + 1, jnp.float32)
  policy = P.KernelPolicy(mosaic_gpu=True)
  lo, hi = policy.batched_bf16_rows
  for rows, kernel in ((lo - 1, False), (lo, True), (hi, True), (hi + 1, False)):
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    got = P.gemm_input_norm(x, wn, EPS, w, policy=policy)
    assert got.dtype == (jnp.bfloat16 if kernel else jnp.float32), rows
    xla = P.rms_norm(x, wn, EPS)
    assert P.gemm_input_norm(x, wn, EPS, w, impl="xla").dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(xla.astype(jnp.bfloat16), np.float32),
                               rtol=2 * BF16_EPS, atol=1e-30)
  # No Mosaic GPU kernels (mosaic_gpu=False, or no batched rows for bf16): XLA's norm.
  for off in (P.KernelPolicy(mosaic_gpu=False),
              P.KernelPolicy(mosaic_gpu=True, batched_bf16_rows=None)):
    assert P.gemm_input_norm(x[:hi], wn, EPS, w, policy=off).dtype == jnp.float32
  with pytest.raises(ValueError, match="gemm_input_norm: impl='pallas' routes by a "
                                       "KernelPolicy; pass policy="):
    P.gemm_input_norm(x, wn, EPS, w)


# --- add_rms_norm: the target's pre-norm ----------------------------------------------------------

@pytest.mark.parametrize("m, k, n_parts", [(1, 64, None), (5, 100, 3), (16, 48, 1),
                                           (3, 6656 // 8, 4)])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_add_rms_norm_matches_oracle_and_twin(m, k, n_parts, out_dtype):
  """The new residual (x plus the partials, added in order: the twin's bits) and its norm."""
  x, w = _inputs(m + k, m, k)
  rng = np.random.default_rng(k)
  parts = None if n_parts is None else rng.standard_normal((n_parts, m, k)).astype(np.float32)
  jp = None if parts is None else jnp.asarray(parts)
  new, got = RN.add_rms_norm(jnp.asarray(x), jp, jnp.asarray(w), eps=EPS, out_dtype=out_dtype)
  t_new, twin = RN.add_rms_norm_reference(jnp.asarray(x), jp, jnp.asarray(w), eps=EPS,
                                          out_dtype=out_dtype)
  assert new.dtype == jnp.float32 and got.dtype == out_dtype and got.shape == (m, k)
  np.testing.assert_array_equal(np.asarray(new), np.asarray(t_new))
  x64 = x.astype(np.float64) + (0 if parts is None else parts.astype(np.float64).sum(0))
  np.testing.assert_allclose(np.asarray(new), x64, rtol=1e-6, atol=1e-6)
  ulp = BF16_EPS if out_dtype == jnp.bfloat16 else 2.0 ** -23
  want = _oracle(np.asarray(new), w)
  got = np.asarray(got.astype(jnp.float32), np.float64)
  assert np.all(np.abs(got - want) <= (ulp + 1e-5) * np.abs(want) + 1e-30)
  twin = np.asarray(twin.astype(jnp.float32), np.float64)
  assert np.all(np.abs(got - twin) <= (2 * ulp + 1e-5) * np.abs(want) + 1e-30)


def _rows_invariant(m, k, norm=None):
  """norm(x, parts, w) -> (new residual, norm) for a call of any rows (default add_rms_norm):
  each row's bits equal the same row's alone."""
  if norm is None:
    norm = lambda x, parts, w: RN.add_rms_norm(x, parts, w, eps=EPS)
  x, w = _inputs(m, m, k)
  parts = jnp.asarray(np.random.default_rng(1).standard_normal((4, m, k)), jnp.float32)
  x, w = jnp.asarray(x), jnp.asarray(w)
  new, y = norm(x, parts, w)
  for i in range(0, m, max(1, m // 5)):
    n1, y1 = norm(x[i:i + 1], parts[:, i:i + 1], w)
    np.testing.assert_array_equal(np.asarray(n1)[0], np.asarray(new)[i])
    np.testing.assert_array_equal(np.asarray(y1).view(np.uint16)[0],
                                  np.asarray(y).view(np.uint16)[i])


def test_add_rms_norm_rows_are_batch_invariant():
  """One row per program: a row's bits do not depend on the call's row count."""
  _rows_invariant(16, 96)


def test_add_rms_norm_limits():
  x, w = jnp.ones((4, 8), jnp.float32), jnp.ones((8,), jnp.float32)
  with pytest.raises(ValueError, match="parts must be \\[P, 4, 8\\]"):
    RN.add_rms_norm(x, jnp.ones((2, 3, 8), jnp.float32), w, eps=EPS)
  with pytest.raises(ValueError, match="parts must be float32"):
    RN.add_rms_norm(x, jnp.ones((2, 4, 8), jnp.bfloat16), w, eps=EPS)


@pytest.mark.gpu
def test_gpu_add_rms_norm_qwen3_8b_width():
  _rows_invariant(64, 4096)
  _check(16, 4096, 1, 8, seed=3)


# --- sandwich_rms_norm: a sandwich-normed target's joint (Muse-Glimmer) ------------------------

POST_EPS = 1e-8


@pytest.mark.parametrize("m, k, n_parts, offsets", [
    (1, 64, None, (1.0, 0.0)), (5, 100, 3, (1.0, 1.0)), (16, 48, 1, (0.0, 1.0)),
    (3, 6656 // 8, 4, (1.0, 1.0))])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_sandwich_rms_norm_matches_oracle_and_twin(m, k, n_parts, offsets, out_dtype):
  """x + norm(sum of the partials) (weight post_offset + w_post, POST_EPS), then its norm
  (weight offset + w, EPS): against float64 numpy, and the new residual against the twin's
  bits up to the norm's float32 rounding."""
  offset, post_offset = offsets
  x, w = _inputs(m + k, m, k)
  rng = np.random.default_rng(k + 1)
  # Partials far from unit scale: a post norm skipped or applied to x instead shows.
  parts = (None if n_parts is None else
           (rng.standard_normal((n_parts, m, k)) * 7.0).astype(np.float32))
  w_post = (0.3 * rng.standard_normal(k)).astype(np.float32)
  jp = None if parts is None else jnp.asarray(parts)
  kw = dict(eps=EPS, post_eps=POST_EPS, offset=offset, post_offset=post_offset,
            out_dtype=out_dtype)
  new, got = RN.sandwich_rms_norm(jnp.asarray(x), jp, jnp.asarray(w_post), jnp.asarray(w), **kw)
  t_new, twin = RN.sandwich_rms_norm_reference(jnp.asarray(x), jp, jnp.asarray(w_post),
                                               jnp.asarray(w), **kw)
  assert new.dtype == jnp.float32 and got.dtype == out_dtype and got.shape == (m, k)
  x64 = x.astype(np.float64)
  if parts is not None:
    y = parts.astype(np.float64).sum(0)
    x64 = x64 + y / np.sqrt(np.mean(y * y, axis=1, keepdims=True) + POST_EPS) * (
        post_offset + w_post.astype(np.float64))
  else:
    np.testing.assert_array_equal(np.asarray(new), x)
  np.testing.assert_allclose(np.asarray(new), x64, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(new), np.asarray(t_new), rtol=1e-6, atol=1e-6)
  ulp = BF16_EPS if out_dtype == jnp.bfloat16 else 2.0 ** -23
  n64 = np.asarray(new, np.float64)
  want = n64 / np.sqrt(np.mean(n64 * n64, axis=1, keepdims=True) + EPS) * (
      offset + w.astype(np.float64))
  got = np.asarray(got.astype(jnp.float32), np.float64)
  assert np.all(np.abs(got - want) <= (ulp + 1e-5) * np.abs(want) + 1e-30)
  twin = np.asarray(twin.astype(jnp.float32), np.float64)
  assert np.all(np.abs(got - twin) <= (2 * ulp + 1e-5) * np.abs(want) + 1e-30)


def _sandwich_rows_invariant(m, k):
  wp = jnp.asarray(0.1 * np.random.default_rng(2).standard_normal(k), jnp.float32)
  _rows_invariant(m, k, lambda x, parts, w: RN.sandwich_rms_norm(
      x, parts, wp, w, eps=EPS, post_eps=POST_EPS, offset=1.0, post_offset=1.0))


def test_sandwich_rms_norm_rows_are_batch_invariant():
  """One row per program: a row's bits do not depend on the call's row count."""
  _sandwich_rows_invariant(16, 96)


def test_sandwich_rms_norm_limits():
  x, w = jnp.ones((4, 8), jnp.float32), jnp.ones((8,), jnp.float32)
  with pytest.raises(ValueError, match="parts must be \\[P, 4, 8\\]"):
    RN.sandwich_rms_norm(x, jnp.ones((2, 3, 8), jnp.float32), w, w, eps=EPS)
  with pytest.raises(ValueError, match="w_post must be float32 \\[8\\]"):
    RN.sandwich_rms_norm(x, jnp.ones((2, 4, 8), jnp.float32), None, w, eps=EPS)


@pytest.mark.gpu
def test_gpu_sandwich_rms_norm_glimmer_width():
  _sandwich_rows_invariant(64, 6656)


# --- rms_norm_pair: one read, float32 and GEMM-input rows (DFlash2's sublayer input) ----------

@pytest.mark.parametrize("m, k, rows", [(16, 6656 // 8, 1), (5, 100, 1), (32, 64, 4)])
def test_rms_norm_pair_matches_oracle_and_the_single_norm(m, k, rows):
  """The float32 rows against float64 numpy; the bf16 rows are exactly the float32 rows
  rounded, and exactly what `rms_norm` writes."""
  x, w = _inputs(m * k + rows, m, k)
  f32, b16 = RN.rms_norm_pair(jnp.asarray(x), jnp.asarray(w), eps=EPS, rows=rows)
  assert f32.dtype == jnp.float32 and b16.dtype == jnp.bfloat16 and f32.shape == (m, k)
  want = _oracle(x, w)
  got = np.asarray(f32, np.float64)
  assert np.all(np.abs(got - want) <= 1e-5 * np.abs(want) + 1e-30)
  np.testing.assert_array_equal(np.asarray(b16).view(np.uint16),
                                np.asarray(f32.astype(jnp.bfloat16)).view(np.uint16))
  single = RN.rms_norm(jnp.asarray(x), jnp.asarray(w), eps=EPS, rows=rows)
  np.testing.assert_array_equal(np.asarray(b16).view(np.uint16),
                                np.asarray(single).view(np.uint16))
