"""pallas_kernels.residual_rms_norm: interpret mode vs the jnp twin and a float64 oracle."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.residual_norm import residual_rms_norm, residual_rms_norm_reference
from test_kernels_lowering import lowered_text

EPS = 1e-6
X_TOL = dict(rtol=2e-6, atol=2e-6)     # float32 x_new vs float64 oracle, values ~O(3)
XN_TOL = dict(rtol=1e-5, atol=1e-5)    # float32 xn vs float64 oracle, values ~O(1)
BF16_ULP = 2.0 ** -7                   # bf16 spacing relative to the value, at most


def make_case(seed: int, *, m: int, e: int, p: int, x_scale: float = 3.0):
  rng = np.random.default_rng(seed)
  return dict(
      x=jnp.asarray(rng.normal(size=(m, e)) * x_scale, jnp.float32),
      parts=jnp.asarray(rng.normal(size=(p, m, e)), jnp.float32),
      w=jnp.asarray(1.0 + 0.2 * rng.normal(size=e), jnp.float32))


def oracle(c: dict) -> tuple[np.ndarray, np.ndarray]:
  """float64 numpy: x + sum of the partials, then x / sqrt(mean(x^2) + eps) * w per row."""
  x = np.asarray(c["x"], np.float64) + np.asarray(c["parts"], np.float64).sum(axis=0)
  w = np.asarray(c["w"], np.float64)
  xn = np.empty_like(x)
  for i, row in enumerate(x):
    xn[i] = row / np.sqrt(np.dot(row, row) / row.size + EPS) * w
  return x, xn


def run_kernel(c: dict, out_dtype, **knobs):
  return residual_rms_norm(c["x"], c["parts"], c["w"], eps=EPS, out_dtype=out_dtype,
                           interpret=True, **knobs)


def run_twin(c: dict, out_dtype):
  return residual_rms_norm_reference(c["x"], c["parts"], c["w"], eps=EPS, out_dtype=out_dtype)


def to_bf16(a: np.ndarray) -> np.ndarray:
  return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16), np.float64)


def assert_xn_close(got, want64: np.ndarray, out_dtype):
  """fp32: XN_TOL of the float64 value; bf16: within 1 bf16 ulp of the oracle rounded to bf16
  (the float32 value may sit across a rounding boundary from the float64 one)."""
  got = np.asarray(got.astype(jnp.float32), np.float64)
  if out_dtype == jnp.float32:
    np.testing.assert_allclose(got, want64, **XN_TOL)
  else:
    np.testing.assert_allclose(got, to_bf16(want64), rtol=BF16_ULP, atol=1e-6)


@pytest.mark.parametrize("m, e, p, out_dtype", [
    (1, 64, 1, jnp.float32),       # one row, no split
    (16, 128, 4, jnp.float32),
    (16, 128, 4, jnp.bfloat16),
    (19, 96, 5, jnp.float32),      # ragged rows, E not a power of 2 (masked lanes), P odd
    (19, 96, 5, jnp.bfloat16),
    (16, 96, 1, jnp.bfloat16),
    (1, 128, 5, jnp.bfloat16),
    (3, 1, 2, jnp.float32),        # E = 1: a one-lane tile
])
def test_matches_oracle_and_twin(m, e, p, out_dtype):
  c = make_case(m * 1000 + e * 10 + p, m=m, e=e, p=p)
  x_new, xn = run_kernel(c, out_dtype)
  x_ref, xn_ref = run_twin(c, out_dtype)
  want_x, want_xn = oracle(c)
  assert x_new.shape == xn.shape == x_ref.shape == xn_ref.shape == (m, e)
  assert x_new.dtype == x_ref.dtype == jnp.float32
  assert xn.dtype == xn_ref.dtype == out_dtype
  np.testing.assert_allclose(np.asarray(x_new, np.float64), want_x, **X_TOL)
  assert_xn_close(xn, want_xn, out_dtype)
  assert_xn_close(xn_ref, want_xn, out_dtype)
  # Same add order as the twin: x_new bit for bit. xn differs only by the mean's reduction
  # order (float32 rounding), which in bf16 can flip a rounding boundary: 1 ulp.
  np.testing.assert_array_equal(np.asarray(x_new), np.asarray(x_ref))
  np.testing.assert_allclose(np.asarray(xn.astype(jnp.float32)),
                             np.asarray(xn_ref.astype(jnp.float32)),
                             **(dict(rtol=2e-6, atol=1e-6) if out_dtype == jnp.float32
                                else dict(rtol=BF16_ULP, atol=1e-6)))


def test_partials_summed_in_order():
  """Partials that cancel in float32 only in order ((a + b) + c with a = -b huge): a kernel
  that reordered the sum would lose c or x entirely; x_new must equal the ordered fold."""
  c = make_case(7, m=4, e=96, p=3)
  big = jnp.full((1, 4, 96), 3e7, jnp.float32)
  parts = jnp.concatenate([big, -big, c["parts"][2:]], axis=0)
  c = c | dict(parts=parts)
  x_new, _ = run_kernel(c, jnp.float32)
  want = np.asarray(c["x"]) + ((np.asarray(parts[0]) + np.asarray(parts[1]))
                               + np.asarray(parts[2]))
  np.testing.assert_array_equal(np.asarray(x_new), want)
  np.testing.assert_array_equal(np.asarray(x_new), np.asarray(run_twin(c, jnp.float32)[0]))


def test_masked_lanes_add_nothing():
  """E = 96 in a 128-lane tile with large, row-varying x: interpret mode pads the blocks past
  E with NaN (on the GPU an unmasked read would take the next row's values), so any unmasked
  load or a mean over 128 lanes shows as NaN or a wrong scale."""
  m, e = 5, 96
  c = make_case(8, m=m, e=e, p=2, x_scale=1.0)
  scale = jnp.asarray(10.0 ** (np.arange(m) % 3 * 2), jnp.float32)[:, None]   # 1, 100, 1e4
  c = c | dict(x=c["x"] * 1e3 * scale)
  x_new, xn = run_kernel(c, jnp.float32)
  assert np.isfinite(np.asarray(x_new)).all() and np.isfinite(np.asarray(xn)).all()
  want_x, want_xn = oracle(c)
  np.testing.assert_allclose(np.asarray(x_new, np.float64), want_x, rtol=2e-6, atol=0)
  np.testing.assert_allclose(np.asarray(xn, np.float64), want_xn, **XN_TOL)
  # The norm divides by E: each row's mean square of xn / w is 1 (eps negligible here).
  ms = np.mean((np.asarray(xn, np.float64) / np.asarray(c["w"], np.float64)) ** 2, axis=-1)
  np.testing.assert_allclose(ms, 1.0, rtol=1e-5)


@pytest.mark.parametrize("fn", [residual_rms_norm, residual_rms_norm_reference])
def test_bad_inputs_raise(fn):
  c = make_case(9, m=4, e=32, p=2)
  x, parts, w = c["x"], c["parts"], c["w"]
  name = fn.__name__
  cases = [
      (dict(x=x[None]), "x must be rank 2"),
      (dict(x=x.astype(jnp.bfloat16)), "x dtype must be float32"),
      (dict(parts=parts[0]), "parts must be rank 3"),
      (dict(parts=parts.astype(jnp.bfloat16)), "parts dtype must be float32"),
      (dict(parts=parts[:0]), "parts must hold P >= 1 partials"),
      (dict(parts=parts[:, :3]), r"parts shape must be \[P, 4, 32\]"),
      (dict(parts=parts[:, :, :16]), r"parts shape must be \[P, 4, 32\]"),
      (dict(w=w[:16]), r"w shape must be \(32,\)"),
      (dict(w=w[None]), r"w shape must be \(32,\)"),
      (dict(w=w.astype(jnp.bfloat16)), "w dtype must be float32"),
      (dict(out_dtype=jnp.float16), "out_dtype must be float32 or bfloat16"),
      (dict(x=x[:0], parts=parts[:, :0]),
       r"x must have M >= 1 rows and E >= 1 columns \(got \(0, 32\)\)"),
  ]
  for overrides, match in cases:
    kw = dict(x=x, parts=parts, w=w, out_dtype=jnp.bfloat16) | overrides
    with pytest.raises(ValueError, match=rf"^{name}: {match}"):
      fn(kw["x"], kw["parts"], kw["w"], eps=EPS, out_dtype=kw["out_dtype"])


def test_twin_ignores_kernel_knobs():
  """The twin is a drop-in: it takes num_warps / interpret and returns the same arrays."""
  c = make_case(10, m=3, e=48, p=2)
  a = residual_rms_norm_reference(c["x"], c["parts"], c["w"], eps=EPS, num_warps=8,
                                  interpret=False)
  b = run_twin(c, jnp.bfloat16)
  for u, v in zip(a, b):
    np.testing.assert_array_equal(np.asarray(u.astype(jnp.float32)),
                                  np.asarray(v.astype(jnp.float32)))


@pytest.mark.parametrize("m, e, p, out_dtype", [
    (16, 4096, 4, jnp.bfloat16),   # a power-of-2 row: no masks
    (19, 96, 5, jnp.float32),
    (3, 1000, 1, jnp.bfloat16),
])
def test_lowers_for_sm90(m, e, p, out_dtype):
  """Interpret mode never runs the Triton lowering: lower for an sm90 target (no GPU needed)
  and check for one Triton launch named residual_rms_norm on the arrays as given (no XLA pad
  or copy around it), grid (M,), with lane masks exactly when E is not a power of 2."""
  S = jax.ShapeDtypeStruct
  f = functools.partial(residual_rms_norm, eps=EPS, out_dtype=out_dtype, interpret=False)
  text = lowered_text(f, (S((m, e), jnp.float32), S((p, m, e), jnp.float32),
                          S((e,), jnp.float32)))
  triton, xla = text.split("// XLA")
  assert xla.count("__gpu$xla.gpu.triton") == 1 and 'name = "residual_rms_norm"' in xla
  assert f"grid_x = {m} : i32" in xla
  assert "stablehlo.pad" not in xla and "stablehlo.slice" not in xla
  masked = e & (e - 1) != 0
  assert ("arith.cmpi slt" in triton) == masked


@pytest.mark.gpu
@pytest.mark.parametrize("m, p", [(16, 4), (16, 5), (128, 4), (1, 1)])
def test_gpu_real_dims(m, p):
  """Compiled on the GPU at the seed drafter's residual width (E = 6656, not a power of 2): one
  block (16 rows) and a batched step's 128 rows, with the o (4) and down (5) projections'
  split-K partials, against the oracle; x_new bitwise the twin's."""
  c = make_case(m * 10 + p, m=m, e=6656, p=p)
  want_x, want_xn = oracle(c)
  for out_dtype in (jnp.bfloat16, jnp.float32):
    x_new, xn = residual_rms_norm(c["x"], c["parts"], c["w"], eps=EPS, out_dtype=out_dtype)
    np.testing.assert_allclose(np.asarray(x_new, np.float64), want_x, **X_TOL)
    assert_xn_close(xn, want_xn, out_dtype)
    np.testing.assert_array_equal(np.asarray(x_new), np.asarray(run_twin(c, out_dtype)[0]))
