"""Row RMS norm of float32 activations, written in the GEMM input dtype (one launch).

y = x * rsqrt(mean(x^2) + eps) * w, rounded to out_dtype (bf16 in front of a bf16 GEMM: the
rounding SPEC.md section 5 names). One program per `rows` rows, each row read once as one
power-of-2 tile (lanes past K masked). At a batched round's 64-128 rows XLA's fusions of the
same norm take several times the bytes' time (benchmarks/RESULTS.md, the batched-round
sections).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import check, load_tile, next_pow2, resolve_interpret, store_tile


def _kernel(x_ref, w_ref, o_ref, *, k: int, eps: float):
  rows, kp = x_ref.shape
  lims = (None, None if kp == k else k)
  x = load_tile(x_ref, (0, 0), (rows, kp), lims)
  w = load_tile(w_ref, (0,), (kp,), lims[1:])
  r = jax.lax.rsqrt(jnp.sum(x * x, axis=1) / k + eps)
  store_tile(o_ref, (0, 0), (x * r[:, None] * w[None, :]).astype(o_ref.dtype), lims)


def _check_args(name, x, w):
  check(x.ndim == 2, name, "x must be [M, K]", x.shape)
  check(x.dtype == jnp.float32 and w.dtype == jnp.float32, name, "x and w must be float32",
        (x.dtype, w.dtype))
  check(w.shape == (x.shape[1],), name, f"w must be [{x.shape[1]}]", w.shape)


@functools.partial(jax.jit, static_argnames=["eps", "out_dtype", "rows", "num_warps",
                                             "interpret"])
def rms_norm(x: jax.Array, w: jax.Array, *, eps: float, out_dtype=jnp.bfloat16,
             rows: int = 1, num_warps: int = 8, interpret: bool | None = None) -> jax.Array:
  """x [M, K] float32, w [K] float32 -> [M, K] out_dtype; `rows` (a power of 2 dividing M)
  rows per program."""
  name = "rms_norm"
  _check_args(name, x, w)
  m, k = x.shape
  check(rows >= 1 and rows & (rows - 1) == 0 and m % rows == 0, name,
        "rows must be a power of 2 dividing M", (rows, m))
  kp = next_pow2(k)
  return pl.pallas_call(
      functools.partial(_kernel, k=k, eps=eps),
      grid=(m // rows,),
      # The kp-wide blocks hang over K's end when K is no power of 2; the kernel masks them.
      in_specs=[pl.BlockSpec((rows, kp), lambda i: (i, 0)), pl.BlockSpec((kp,), lambda i: (0,))],
      out_specs=pl.BlockSpec((rows, kp), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((m, k), out_dtype),
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=resolve_interpret(interpret),
      name=name,
  )(x, w)


def rms_norm_reference(x: jax.Array, w: jax.Array, *, eps: float,
                       out_dtype=jnp.bfloat16) -> jax.Array:
  """The jnp twin (the step's XLA norm, rounded to out_dtype)."""
  _check_args("rms_norm_reference", x, w)
  return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w).astype(out_dtype)
