"""The GEMM entry point of the step and the target (`linear`), its input norm, the weight
formats they take, and the kernel policy that routes them."""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from pallas_kernels import batched_gemm, skinny_gemm
from pallas_kernels._common import hopper_available
from pallas_kernels import rms_norm as norm_k

_DTYPE_NAMES = {"fp32": jnp.float32, "float32": jnp.float32, "f32": jnp.float32,
                "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype: Any, what: str = "dtype") -> jnp.dtype:
  """'fp32'/'bf16' or a jnp/numpy dtype -> jnp.float32 / jnp.bfloat16."""
  if isinstance(dtype, str):
    if dtype.lower() not in _DTYPE_NAMES:
      raise ValueError(f"{what} must be 'fp32' or 'bf16', got {dtype!r}")
    return jnp.dtype(_DTYPE_NAMES[dtype.lower()])
  try:
    d = jnp.dtype(dtype)
  except TypeError as e:
    raise ValueError(f"{what} must be 'fp32' or 'bf16', got {dtype!r}") from e
  if d not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"{what} must be float32 or bfloat16, got {d}")
  return d


WEIGHT_FORMATS = ("fp32", "bf16", "fp8", "q8_0")


def resolve_weight_format(dtype: Any) -> str:
  """'fp32' | 'bf16' (or their jnp dtypes) | 'fp8' | 'q8_0' -> the canonical name."""
  if isinstance(dtype, str) and dtype.lower() in ("fp8", "q8_0"):
    return dtype.lower()
  try:
    d = resolve_dtype(dtype)
  except ValueError:
    raise ValueError(f"dtype must be one of {WEIGHT_FORMATS} (or jnp.float32/bfloat16), "
                     f"got {dtype!r}") from None
  return "bf16" if d == jnp.bfloat16 else "fp32"


@flax.struct.dataclass
class QuantWeight:
  """A 1-byte weight matrix in (out, in) layout, K contiguous, with its float32 scales.

  fp8: float8_e4m3fn data and [N] power-of-two row scales; q8_0: int8 data and [N, K/32]
  block scales (llama.cpp's Q8_0). Both compute as bf16 weights round_bf16(dequantized)
  against bf16 activations with float32 accumulation, so a quantized step is the bf16 step
  on the dequantized weights (for fp8 the rounding is exact: 4 significant bits times 2^k).
  """
  data: jax.Array
  scale: jax.Array
  fmt: str = flax.struct.field(pytree_node=False)

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.data.shape)


@flax.struct.dataclass
class Reduced:
  """A weight whose in (K) axis is split over the mesh axis `axis`, as `dflash_jax.sharding`
  hands it to the code inside `jax.shard_map`: each device holds a block of its columns, so
  its product is a partial sum, and `linear` adds the devices' partials (one float32 psum)."""
  w: Any
  axis: str = flax.struct.field(pytree_node=False)


def matrix_format(w) -> str:
  """A weight matrix's format: a QuantWeight's fmt, else 'bf16' or 'fp32' by dtype."""
  if isinstance(w, QuantWeight):
    return w.fmt
  return "bf16" if w.dtype == jnp.bfloat16 else "fp32"


# Rows up to which dense bf16 GEMMs run on the skinny kernel, larger row counts on XLA's
# tensor-core GEMM. For one block of rows the skinny kernel streams the weights exactly once:
# the measured choice for the one-sequence step. A batched step has S x w rows; the H200 crossover probe
# (`python -m benchmarks.batch --gpu --only crossover`, RESULTS.md run 11) has the skinny
# kernel ahead at 16 rows (1.369 vs 1.417 ms for a seed round's GEMMs), behind at 32 (1.591 vs
# 1.479), even at 48 and 64 and far behind from 128, so more than one block of rows runs on
# XLA's GEMM.
SKINNY_MAX_M = 16


# The row counts (min, max) at which each weight format runs on the Mosaic GPU batched GEMM
# (pallas_kernels/batched_gemm.py) where the GPU has one (Hopper) and the shape fits its tiles.
# bf16, H200, seed round: at 128 rows (two compute warpgroups) it streams the weights faster
# than XLA's GEMM and finishes the residual add and silu(gate) * up in its epilogue
# (RESULTS.md run 16: S = 8, w 16 1.927 -> 1.864 ms, 83 -> 57 launches); up to 64 rows one
# warpgroup runs them (run 17: every seed matrix at 64 rows 5-10% faster than XLA's GEMM;
# rounds of 48 and 64 rows 29 and 94 us faster, of 32 rows, padded to 64, 23 us slower); at
# 256 rows (a shallower pipeline) XLA's GEMM is faster (2.56 vs 3.00 ms).
# fp8: each weight tile widened to bf16 in registers as wgmma's A operand, the row scales on
# the accumulator (run 18: w 16 rounds of S = 8 2.625 -> 2.034 ms, S = 4 1.960 -> 1.503
# against the skinny fp8 GEMM; run 17's version, which widened the tiles through shared
# memory, was slower than the skinny GEMM). From 32 rows (run 20, us, the skinny fp8 GEMM /
# this one: gate_up 104.0 / 92.4, down 57.7 / 57.8, qkv 16.4 / 19.8) to 512 in 256-row calls
# (256 rows: gate_up 366.1 / 249.2, qkv 70.5 / 59.0; run 21: 366.4 / 248.7, 70.5 / 46.4, down
# 239.4 / 126.5). q8_0's 32-wide block scales have no path there.
BATCHED_ROWS = {"bf16": (33, 128), "fp8": (32, 512)}
# fp8 weights of fewer elements than this (at the seed dims qkv, o and inject: 27-68 M, against
# down's 133 M) start there at FP8_SMALL_MIN_ROWS instead: at 32 rows their 96-160 column
# tiles leave SMs idle where the skinny GEMM splits K (run 21, us, skinny / batched: qkv
# 16.6 / 20.1, inject 28.4 / 41.2, o 14.0 / 14.2; at 64 rows o 21.7 / 16.0).
FP8_SMALL_WEIGHTS = 100_000_000
FP8_SMALL_MIN_ROWS = 33


def _bf16_skinny(x: jax.Array, w: jax.Array) -> bool:
  """Dense bf16 runs on the skinny GEMM for block-sized row counts (any N and K); prefill
  row counts on XLA's GEMM."""
  return w.dtype == jnp.bfloat16 and x.ndim == 2 and x.shape[0] <= SKINNY_MAX_M


def batched_gemm_runs(fmt: str, rows: int, n_weights: int | None = None) -> bool:
  """Whether a weight of this format and element count (None: a large one) at this row count
  goes to the batched GEMM (shapes that fit its tiles; `_batched_knobs` checks those)."""
  lo, hi = BATCHED_ROWS.get(fmt, (1, 0))
  if fmt == "fp8" and n_weights is not None and n_weights < FP8_SMALL_WEIGHTS:
    lo = max(lo, FP8_SMALL_MIN_ROWS)
  return lo <= rows <= hi and hopper_available()


def _batched_knobs(x: jax.Array, w, gate_up: bool, out_dtype) -> dict | None:
  """The batched GEMM's tiles when it runs this product, else None."""
  fmt = matrix_format(w)
  n, k = w.shape
  if x.ndim != 2 or not batched_gemm_runs(fmt, x.shape[0], n * k):
    return None
  return batched_gemm.default_knobs(x.shape[0], n // 2 if gate_up else n, k,
                                    "gate_up" if gate_up else "none", out_dtype, fmt)


def _batched_operands(w) -> tuple[jax.Array, jax.Array | None]:
  return (w.data, w.scale) if isinstance(w, QuantWeight) else (w, None)


def gemm_knobs(fmt: str, n: int, k: int, gate_up: bool = False, m: int = 16) -> dict:
  """The skinny GEMM's tiles for this weight at m rows (`skinny_gemm.default_knobs`)."""
  return skinny_gemm.default_knobs(fmt, n, k, gate_up, m)


def linear(x: jax.Array, w, *, impl: str = "pallas", gate_up: bool = False,
           partials: bool = False, residual: jax.Array | None = None,
           out_dtype=jnp.float32) -> jax.Array:
  """y = x @ w^T for a weight in (out, in) layout: THE GEMM entry point of the step.

  Dense bf16 weights: the activation is rounded to bf16 (the rounding SPEC.md section 5 names)
  and the product accumulates in float32; up to SKINNY_MAX_M rows the Pallas skinny GEMM
  streams the weights (in the bf16 step it beats XLA's GEMMs, mostly by needing no split-K
  reduce or convert launches: RESULTS.md run 10), whatever N and K; beyond that (prefill and
  large-batch row counts, where a GEMM that reads the weights once per 64-row tile loses),
  XLA's GEMM, except that at the row counts BATCHED_ROWS gives a format, a Hopper GPU runs the
  Mosaic GPU batched GEMM where the shape fits its tiles.
  Dense fp32:
  XLA, full-precision float32 (HIGHEST, so GPUs do not silently use TF32). QuantWeight: the
  Pallas skinny GEMM streams the 1-byte weights at every other row count (impl="xla": its
  jnp twin, which dequantizes in XLA). gate_up: w holds gate rows then up rows and the
  result is silu(gate) * up (fused into the skinny GEMM's epilogue). The result is out_dtype,
  or with partials=True the float32 split-K partial sums [S, M, N] (S = 1 unless the skinny
  GEMM split K), left for the consuming kernel to add up (qk_norm_rope). residual (float32
  [M, N], plain projections only): the result is residual + x @ w^T in float32, the add inside
  the batched GEMM's epilogue where that runs. A `Reduced` weight
  (inside a sharded call) is the product over this device's columns, psummed over its axis.
  """
  if partials and gate_up:
    raise ValueError("linear: partials=True is for plain projections, not gate_up")
  if residual is not None:
    if partials or gate_up:
      raise ValueError("linear: a residual is for plain projections (no partials, no gate_up)")
    n_out = (w.w if isinstance(w, Reduced) else w).shape[0]
    if tuple(residual.shape) != tuple(x.shape[:-1]) + (n_out,):
      raise ValueError(f"linear: residual must be {tuple(x.shape[:-1]) + (n_out,)} (the "
                       f"product's shape), got {tuple(residual.shape)}")
    if impl != "xla" and not isinstance(w, Reduced):
      knobs = _batched_knobs(x, w, False, jnp.float32)
      if knobs is not None:
        data, scale = _batched_operands(w)
        return batched_gemm.batched_matmul(x.astype(jnp.bfloat16), data,
                                           residual.astype(jnp.float32), scale=scale,
                                           epilogue="residual", **knobs)
    return residual.astype(jnp.float32) + linear(x, w, impl=impl)
  if isinstance(w, Reduced):
    if partials or gate_up:
      raise ValueError("linear: a Reduced (column-split) weight takes neither partials nor "
                       "gate_up (its partial sums must be added before any epilogue)")
    return jax.lax.psum(linear(x, w.w, impl=impl), w.axis).astype(out_dtype)
  knobs = None if impl == "xla" else _batched_knobs(x, w, gate_up, out_dtype)
  if knobs is not None:
    split = knobs["split_k"] > 1
    data, scale = _batched_operands(w)
    y = batched_gemm.batched_matmul(x.astype(jnp.bfloat16), data, scale=scale,
                                    epilogue="gate_up" if gate_up else "none",
                                    out_dtype=out_dtype, keep_splits=partials and split, **knobs)
    if partials:
      return y if split else y[None]
    return y.astype(out_dtype)
  if impl != "xla" and (isinstance(w, QuantWeight) or _bf16_skinny(x, w)):
    data, scale, fmt = (w.data, w.scale, w.fmt) if isinstance(w, QuantWeight) else (w, None, "bf16")
    n, k = data.shape
    knobs = gemm_knobs(fmt, n // 2 if gate_up else n, k, gate_up, x.shape[0])
    if gate_up:
      return skinny_gemm.skinny_matmul_gate_up(x, data, scale, fmt=fmt, out_dtype=out_dtype,
                                               **knobs)
    return skinny_gemm.skinny_matmul(x, data, scale, fmt=fmt, out_dtype=out_dtype,
                                     keep_splits=partials, **knobs)
  if isinstance(w, QuantWeight):
    fn = (skinny_gemm.skinny_matmul_gate_up_reference if gate_up
          else skinny_gemm.skinny_matmul_reference)
    y = fn(x, w.data, w.scale, fmt=w.fmt)
  else:
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if w.dtype == jnp.bfloat16:
      y = jax.lax.dot_general(x.astype(jnp.bfloat16), w, dims,
                              preferred_element_type=jnp.float32)
    else:
      y = jax.lax.dot_general(x.astype(jnp.float32), w, dims,
                              precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
    if gate_up:
      n_ff = y.shape[-1] // 2
      y = jax.nn.silu(y[..., :n_ff]) * y[..., n_ff:]
  # Unsplit here: one "partial" for a consumer that expects [S, M, N].
  return y[None] if partials else y.astype(out_dtype)


# Whether the RMS norm in front of a batched-GEMM product runs as the Pallas row norm
# (`gemm_input_norm`); False puts XLA's fusion back (`benchmarks.batch --only norm_ab`).
NORM_KERNEL = True


def gemm_input_norm(x: jax.Array, w_norm: jax.Array, eps: float, w, *, impl: str = "pallas",
                    gate_up: bool = False) -> jax.Array:
  """rms_norm(x, w_norm, eps) as the input of `linear(., w, gate_up=gate_up)`: where the
  batched GEMM runs that product (it takes bf16 rows), the Pallas row norm writes them in bf16
  in one launch, the value linear would round them to; elsewhere XLA's norm in float32."""
  inner = w.w if isinstance(w, Reduced) else w
  if (NORM_KERNEL and impl != "xla" and x.ndim == 2
      and _batched_knobs(x, inner, gate_up, jnp.bfloat16 if gate_up else jnp.float32)):
    return norm_k.rms_norm(x.astype(jnp.float32), w_norm, eps=eps, out_dtype=jnp.bfloat16)
  return rms_norm(x, w_norm, eps)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w
