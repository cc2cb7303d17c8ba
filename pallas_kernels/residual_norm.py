"""Residual add of a GEMM's split-K partials fused with the RMS norm that follows it.

x_new = x + (parts[0] + parts[1] + ... + parts[P-1]) and xn = rms_norm(x_new) * w in one
launch, where XLA would launch an add fusion and then a norm fusion (and write x_new in
between only to read it back). One program per row, the whole row as one power-of-2 tile:
any M, E and P; the lanes past E of the tile are masked (they load 0, so they add nothing to
the mean square, which divides by the real E).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import check, load_tile, next_pow2, resolve_interpret, store_tile

_OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _check_shapes(name: str, x, parts, w, out_dtype) -> tuple[int, int, int, jnp.dtype]:
  """Shape and dtype checks shared by the kernel and its twin; returns (M, E, P, out dtype)."""
  check(x.ndim == 2, name, "x must be rank 2 [M, E]", x.shape)
  check(x.dtype == jnp.float32, name, "x dtype must be float32", x.dtype)
  m, e = x.shape
  check(m >= 1 and e >= 1, name, "x must have M >= 1 rows and E >= 1 columns", x.shape)
  check(parts.ndim == 3, name, "parts must be rank 3 [P, M, E]", parts.shape)
  check(parts.dtype == jnp.float32, name, "parts dtype must be float32", parts.dtype)
  check(parts.shape[0] >= 1, name, "parts must hold P >= 1 partials", parts.shape)
  check(parts.shape[1:] == x.shape, name, f"parts shape must be [P, {m}, {e}] (x's shape)",
        parts.shape)
  check(w.shape == (e,), name, f"w shape must be ({e},)", w.shape)
  check(w.dtype == jnp.float32, name, "w dtype must be float32", w.dtype)
  try:
    od = jnp.dtype(out_dtype)
  except TypeError:
    od = None
  check(od in _OUT_DTYPES, name, "out_dtype must be float32 or bfloat16", out_dtype)
  return m, e, parts.shape[0], od


def _residual_rms_norm_kernel(x_ref, parts_ref, w_ref, x_out, xn_out, *, e: int, eps: float):
  # Refs are one row: x_ref, w_ref, x_out, xn_out [E'], parts_ref [P, E'] for E' = next_pow2(E)
  # (no mask when E is a power of 2).
  ep = x_ref.shape[0]
  lims = (None if ep == e else e,)
  acc = load_tile(parts_ref, (0, 0), (None, ep), (None,) + lims)
  for p in range(1, parts_ref.shape[0]):
    acc = acc + load_tile(parts_ref, (p, 0), (None, ep), (None,) + lims)
  x = load_tile(x_ref, (0,), (ep,), lims) + acc
  r = lax.rsqrt(jnp.sum(x * x) / e + eps)
  y = x * r * load_tile(w_ref, (0,), (ep,), lims)
  store_tile(x_out, (0,), x, lims)
  store_tile(xn_out, (0,), y.astype(xn_out.dtype), lims)


@functools.partial(jax.jit, static_argnames=["eps", "out_dtype", "num_warps", "interpret"])
def residual_rms_norm(x: jax.Array, parts: jax.Array, w: jax.Array, *, eps: float,
                      out_dtype=jnp.bfloat16, num_warps: int = 4,
                      interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """(x_new, xn): x_new = x + sum of the split-K partials, xn = rms_norm(x_new, w, eps).

  x: [M, E] float32, the residual stream (not aliased: the caller keeps it); parts: [P, M, E]
  float32, the partials of the GEMM whose output is added (`skinny_matmul(...,
  keep_splits=True)`), summed parts[0] + parts[1] + ... in that order (P = 1: the output
  itself); w: [E] float32. Returns x_new [M, E] float32 and xn [M, E] out_dtype (float32 or
  bfloat16), xn = x_new * rsqrt(mean(x_new^2) + eps) * w as `dflash_jax.params.rms_norm`.
  Grid (M,): one program per row.
  """
  name = "residual_rms_norm"
  m, e, p, od = _check_shapes(name, x, parts, w, out_dtype)
  ep = next_pow2(e)
  kernel = functools.partial(_residual_rms_norm_kernel, e=e, eps=eps)
  # Blocks of E' >= E lanes hang over the rows' end when E is not a power of 2; the kernel
  # masks those lanes.
  row = pl.BlockSpec((None, ep), lambda i: (i, 0))
  return pl.pallas_call(
      kernel,
      grid=(m,),
      in_specs=[row, pl.BlockSpec((p, None, ep), lambda i: (0, i, 0)),
                pl.BlockSpec((ep,), lambda i: (0,))],
      out_specs=[row, row],
      out_shape=[jax.ShapeDtypeStruct((m, e), jnp.float32), jax.ShapeDtypeStruct((m, e), od)],
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=resolve_interpret(interpret),
      name=name,
  )(x, parts, w)


@functools.partial(jax.jit, static_argnames=["eps", "out_dtype", "num_warps", "interpret"])
def residual_rms_norm_reference(x: jax.Array, parts: jax.Array, w: jax.Array, *, eps: float,
                                out_dtype=jnp.bfloat16, num_warps: int = 4,
                                interpret: bool | None = None
                                ) -> tuple[jax.Array, jax.Array]:
  """Pure-jnp twin of `residual_rms_norm` (same arguments; the kernel knobs are ignored, so
  it is a drop-in replacement). Sums the partials in the kernel's order, so x_new matches it
  bit for bit."""
  del num_warps, interpret
  _, _, p, od = _check_shapes("residual_rms_norm_reference", x, parts, w, out_dtype)
  acc = parts[0]
  for i in range(1, p):
    acc = acc + parts[i]
  x_new = x + acc
  xn = x_new * lax.rsqrt(jnp.mean(x_new * x_new, axis=-1, keepdims=True) + eps) * w
  return x_new, xn.astype(od)
