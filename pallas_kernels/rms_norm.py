"""Row RMS norm of float32 activations, written in the GEMM input dtype (one launch).

y = x * rsqrt(mean(x^2) + eps) * w, rounded to out_dtype (bf16 in front of a bf16 GEMM: the
rounding SPEC.md section 5 names). One program per `rows` rows, each row read once as one
power-of-2 tile (lanes past K masked). At a batched round's 64-128 rows XLA's fusions of the
same norm take several times the bytes' time (benchmarks/RESULTS.md, the batched-round
sections).

`add_rms_norm` is the target's pre-norm: the residual x plus a sublayer's split-K partials
(added in their order, then to x), written back as the new residual, and its norm, in one
launch. One row per program, so a row's sums run in the same order (the same tile and
reduction tree) whatever the row count of the call: the norm is batch invariant.
`sandwich_rms_norm` is the same joint for sandwich-normed layers (Muse-Glimmer): the finished
sublayer's output is normed before it joins the residual, then the residual is normed for
the next sublayer, still one launch and one row per program.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import check, load_tile, next_pow2, resolve_interpret, store_tile


def _normed(x: jax.Array, w: jax.Array, k: int, eps: float) -> jax.Array:
  """Rows x [R, Kp] (lanes past K zero) RMS-normed over K, times w [Kp]: every kernel's norm."""
  r = jax.lax.rsqrt(jnp.sum(x * x, axis=1) / k + eps)
  return x * r[:, None] * w[None, :]


def _part_sum(p_ref, n_parts: int, kp: int, lims) -> jax.Array:
  """parts[0] + parts[1] + ... of one row's [P, 1, Kp] block of split-K partials, in order."""
  y = load_tile(p_ref, (0, 0, 0), (None, 1, kp), (None,) + lims)
  for i in range(1, n_parts):
    y = y + load_tile(p_ref, (i, 0, 0), (None, 1, kp), (None,) + lims)
  return y


def _kernel(x_ref, w_ref, o_ref, *, k: int, eps: float):
  rows, kp = x_ref.shape
  lims = (None, None if kp == k else k)
  x = load_tile(x_ref, (0, 0), (rows, kp), lims)
  w = load_tile(w_ref, (0,), (kp,), lims[1:])
  store_tile(o_ref, (0, 0), _normed(x, w, k, eps).astype(o_ref.dtype), lims)


def _check_args(name, x, w):
  check(x.ndim == 2, name, "x must be [M, K]", x.shape)
  check(x.dtype == jnp.float32 and w.dtype == jnp.float32, name, "x and w must be float32",
        (x.dtype, w.dtype))
  check(w.shape == (x.shape[1],), name, f"w must be [{x.shape[1]}]", w.shape)


def _check_parts(name, parts, x):
  m, k = x.shape
  check(parts.ndim == 3 and parts.shape[1:] == x.shape, name, f"parts must be [P, {m}, {k}]",
        parts.shape)
  check(parts.dtype == jnp.float32, name, "parts must be float32", parts.dtype)


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


def _pair_kernel(x_ref, w_ref, f_ref, o_ref, *, k: int, eps: float):
  rows, kp = x_ref.shape
  lims = (None, None if kp == k else k)
  x = load_tile(x_ref, (0, 0), (rows, kp), lims)
  y = _normed(x, load_tile(w_ref, (0,), (kp,), lims[1:]), k, eps)
  store_tile(f_ref, (0, 0), y, lims)
  store_tile(o_ref, (0, 0), y.astype(o_ref.dtype), lims)


@functools.partial(jax.jit, static_argnames=["eps", "out_dtype", "rows", "num_warps",
                                             "interpret"])
def rms_norm_pair(x: jax.Array, w: jax.Array, *, eps: float, out_dtype=jnp.bfloat16,
                  rows: int = 1, num_warps: int = 8,
                  interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """`rms_norm` written twice from one read: float32 and out_dtype ([M, K] each), for a norm
  whose float32 rows feed one consumer and whose rounded rows feed a GEMM (DFlash2's
  sublayer input: the convolution reads it unrounded, the coefficient GEMM in bf16)."""
  name = "rms_norm_pair"
  _check_args(name, x, w)
  m, k = x.shape
  check(rows >= 1 and rows & (rows - 1) == 0 and m % rows == 0, name,
        "rows must be a power of 2 dividing M", (rows, m))
  kp = next_pow2(k)
  block = pl.BlockSpec((rows, kp), lambda i: (i, 0))
  return tuple(pl.pallas_call(
      functools.partial(_pair_kernel, k=k, eps=eps),
      grid=(m // rows,),
      in_specs=[block, pl.BlockSpec((kp,), lambda i: (0,))],
      out_specs=[block, block],
      out_shape=[jax.ShapeDtypeStruct((m, k), jnp.float32),
                 jax.ShapeDtypeStruct((m, k), out_dtype)],
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=resolve_interpret(interpret),
      name=name,
  )(x, w))


def rms_norm_reference(x: jax.Array, w: jax.Array, *, eps: float,
                       out_dtype=jnp.bfloat16) -> jax.Array:
  """The jnp twin (the step's XLA norm, rounded to out_dtype)."""
  _check_args("rms_norm_reference", x, w)
  return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w).astype(out_dtype)


def _add_kernel(x_ref, *refs, k: int, eps: float, n_parts: int):
  if n_parts:
    p_ref, w_ref, x_out, o_ref = refs
  else:
    w_ref, o_ref = refs
  kp = x_ref.shape[1]
  lims = (None, None if kp == k else k)
  x = load_tile(x_ref, (0, 0), (1, kp), lims)
  if n_parts:
    x = x + _part_sum(p_ref, n_parts, kp, lims)
    store_tile(x_out, (0, 0), x, lims)
  w = load_tile(w_ref, (0,), (kp,), lims[1:])
  store_tile(o_ref, (0, 0), _normed(x, w, k, eps).astype(o_ref.dtype), lims)


@functools.partial(jax.jit, static_argnames=["eps", "out_dtype", "num_warps", "interpret"])
def add_rms_norm(x: jax.Array, parts: jax.Array | None, w: jax.Array, *, eps: float,
                 out_dtype=jnp.bfloat16, num_warps: int = 8,
                 interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """(x + sum(parts), rms_norm of it) for x [M, K] float32, parts [P, M, K] float32 (a
  sublayer's split-K partials, summed parts[0] + parts[1] + ... and then added to x) or None
  (x as is: only the norm is written), w [K] float32. Returns (the new residual [M, K]
  float32, the norm [M, K] out_dtype). One row per program."""
  name = "add_rms_norm"
  _check_args(name, x, w)
  m, k = x.shape
  if parts is not None:
    _check_parts(name, parts, x)
  n_parts = 0 if parts is None else parts.shape[0]
  kp = next_pow2(k)
  row = pl.BlockSpec((1, kp), lambda i: (i, 0))
  in_specs = [row] + ([pl.BlockSpec((n_parts, 1, kp), lambda i: (0, i, 0))] if n_parts else [])
  out = pl.pallas_call(
      functools.partial(_add_kernel, k=k, eps=eps, n_parts=n_parts),
      grid=(m,),
      in_specs=in_specs + [pl.BlockSpec((kp,), lambda i: (0,))],
      out_specs=[row] * (2 if n_parts else 1),
      out_shape=([jax.ShapeDtypeStruct((m, k), jnp.float32)] if n_parts else [])
      + [jax.ShapeDtypeStruct((m, k), out_dtype)],
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=resolve_interpret(interpret),
      name=name,
  )(*([x] + ([parts] if n_parts else []) + [w]))
  return (out[0], out[1]) if n_parts else (x, out[0])


def add_rms_norm_reference(x: jax.Array, parts: jax.Array | None, w: jax.Array, *, eps: float,
                           out_dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
  """The jnp twin of `add_rms_norm` (the partials added in the same order)."""
  _check_args("add_rms_norm_reference", x, w)
  if parts is not None:
    s = parts[0]
    for i in range(1, parts.shape[0]):
      s = s + parts[i]
    x = x + s
  return x, rms_norm_reference(x, w, eps=eps, out_dtype=out_dtype)


def _sandwich_kernel(x_ref, *refs, k: int, eps: float, post_eps: float, offset: float,
                     post_offset: float, n_parts: int):
  if n_parts:
    p_ref, wp_ref, w_ref, x_out, o_ref = refs
  else:
    w_ref, o_ref = refs
  kp = x_ref.shape[1]
  lims = (None, None if kp == k else k)
  x = load_tile(x_ref, (0, 0), (1, kp), lims)
  if n_parts:
    y = _part_sum(p_ref, n_parts, kp, lims)
    wp = load_tile(wp_ref, (0,), (kp,), lims[1:]) + post_offset
    x = x + _normed(y, wp, k, post_eps)
    store_tile(x_out, (0, 0), x, lims)
  w = load_tile(w_ref, (0,), (kp,), lims[1:]) + offset
  store_tile(o_ref, (0, 0), _normed(x, w, k, eps).astype(o_ref.dtype), lims)


@functools.partial(jax.jit, static_argnames=["eps", "post_eps", "offset", "post_offset",
                                             "out_dtype", "num_warps", "interpret"])
def sandwich_rms_norm(x: jax.Array, parts: jax.Array | None, w_post: jax.Array | None,
                      w: jax.Array, *, eps: float, post_eps: float = 0.0, offset: float = 0.0,
                      post_offset: float = 0.0, out_dtype=jnp.bfloat16, num_warps: int = 8,
                      interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """A sandwich-normed layer's joint between two sublayers, in one launch: the finished
  sublayer's output y = sum(parts) (its split-K partials [P, M, K] float32, added in order)
  is RMS-normed (post_eps, weight post_offset + w_post) and added to the residual x [M, K]
  float32; the new residual is RMS-normed (eps, weight offset + w) as the next sublayer's
  input. parts None: no finished sublayer (w_post not read), only the norm of x. The offsets
  serve (1 + w)-stored norm weights. Returns (the new residual [M, K] float32, the norm
  [M, K] out_dtype). One row per program: batch invariant, as `add_rms_norm`."""
  name = "sandwich_rms_norm"
  _check_args(name, x, w)
  m, k = x.shape
  if parts is not None:
    _check_parts(name, parts, x)
    check(w_post is not None and w_post.shape == (k,) and w_post.dtype == jnp.float32, name,
          f"w_post must be float32 [{k}]", None if w_post is None else (w_post.shape,
                                                                         w_post.dtype))
  n_parts = 0 if parts is None else parts.shape[0]
  kp = next_pow2(k)
  row = pl.BlockSpec((1, kp), lambda i: (i, 0))
  vec = pl.BlockSpec((kp,), lambda i: (0,))
  in_specs = [row] + ([pl.BlockSpec((n_parts, 1, kp), lambda i: (0, i, 0)), vec]
                      if n_parts else []) + [vec]
  out = pl.pallas_call(
      functools.partial(_sandwich_kernel, k=k, eps=eps, post_eps=post_eps, offset=offset,
                        post_offset=post_offset, n_parts=n_parts),
      grid=(m,),
      in_specs=in_specs,
      out_specs=[row] * (2 if n_parts else 1),
      out_shape=([jax.ShapeDtypeStruct((m, k), jnp.float32)] if n_parts else [])
      + [jax.ShapeDtypeStruct((m, k), out_dtype)],
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=resolve_interpret(interpret),
      name=name,
  )(*([x] + ([parts, w_post] if n_parts else []) + [w]))
  return (out[0], out[1]) if n_parts else (x, out[0])


def sandwich_rms_norm_reference(x: jax.Array, parts: jax.Array | None, w_post: jax.Array | None,
                                w: jax.Array, *, eps: float, post_eps: float = 0.0,
                                offset: float = 0.0, post_offset: float = 0.0,
                                out_dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
  """The jnp twin of `sandwich_rms_norm` (the partials added in the same order)."""
  _check_args("sandwich_rms_norm_reference", x, w)
  if parts is not None:
    y = parts[0]
    for i in range(1, parts.shape[0]):
      y = y + parts[i]
    x = x + rms_norm_reference(y, w_post + post_offset, eps=post_eps, out_dtype=jnp.float32)
  return x, rms_norm_reference(x, w + offset, eps=eps, out_dtype=out_dtype)
