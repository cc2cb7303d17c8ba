"""Kernel dispatch: which kernel runs each GEMM, GEMM-input norm and ring-attention launch of
the drafter step and the target, and with which knobs (the target's cached passes: its
pre-norms, `residual_norm`, and its cache attention, `target_attention`).

`KernelPolicy` holds every routing threshold: a frozen record that the prepared params carry
as a static field (`DrafterParams.policy`, `qwen3.TargetParams.policy`), so it is part of
every jit key, and two policies compile two programs. `linear`, `gemm_input_norm` and
`attention` read their arguments and the policy, nothing else; where the policy leaves the
Mosaic GPU kernels to the backend (`mosaic_gpu=None`), they ask `hopper_available()`. Each
kernel module's `default_knobs` keeps its tile tables (from that kernel's sweeps) and takes the
policy's thresholds as arguments. The weight formats these functions take (`QuantWeight`,
`Reduced`, `matrix_format`, `resolve_dtype`, `resolve_weight_format`) live here too.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from pallas_kernels import batched_gemm, skinny_gemm
from pallas_kernels import cache_attention as cache_attn_k
from pallas_kernels import ring_attention as attn_k
from pallas_kernels import ring_attention_mgpu as attn_mgpu
from pallas_kernels import limits
from pallas_kernels import rms_norm as norm_k
from pallas_kernels import selector_walk as walk_k
from pallas_kernels import top_k as top_k_k
from pallas_kernels._common import hopper_available


def _row_range(v, name: str) -> None:
  if v is not None and not (isinstance(v, tuple) and len(v) == 2
                            and all(isinstance(x, int) and x >= 0 for x in v)):
    raise ValueError(f"KernelPolicy.{name} must be None or a (min, max) pair of ints >= 0, "
                     f"got {v!r}")


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
  """Every routing threshold of the drafter step and the target's GEMMs (module docstring).

  The default is the shipped routing. Another policy is a different program: pass it to
  `prepare_weights(..., policy=)` or `params.replace(policy=...)` (benchmarks A/B policies
  that way). Each field's comment names the section of benchmarks/RESULTS.md whose
  measurements set it. Row counts are a GEMM's rows (S x w for a batch of S blocks of w).
  """
  # RESULTS.md sections are quoted by their titles (a long one by its start, ... its end).
  # bf16 GEMMs of up to this many rows: the skinny GEMM ("GPU suite, batches, decoding, eval")
  skinny_max_m: int = 16
  # bf16 rows on the Mosaic GPU batched GEMM, None: never ("New kernel ...batched_gemm.py")
  batched_bf16_rows: tuple[int, int] | None = (33, 128)
  # fp8 rows on the batched GEMM, None: never ("fp8 on the batched GEMM (kept; last call)")
  batched_fp8_rows: tuple[int, int] | None = (32, 512)
  # fp8 matrices of fewer elements... ("The hand-over in the pipeline's memory", its fp8_ab)
  fp8_small_weights: int = 100_000_000
  # ...take the batched GEMM from this many rows, the skinny GEMM below (the same section)
  fp8_small_min_rows: int = 33
  # the batched GEMM's fp8 "k" split takes up to 6 stages from this K (the same section)
  fp8_deep_k: int = 16384
  # fp8 "k" split up to these rows, twice off gate_up ('wg_split "k" for one accumulator ...')
  fp8_k_split_max_m: int = 128
  # skinny fp8 GEMMs: the swapped MMA from this many rows ("... batched-row GEMM probes")
  skinny_fp8_swap_min_m: int = 17
  # slot counts on the Mosaic GPU attention, None: never ("The one-sequence step now runs ...")
  mgpu_attention_seqs: tuple[int, int] | None = (1, 16)
  # the Triton attention folds the own keys from this many slots ("The block's own keys ...")
  fold_own_min_seqs: int | None = 4
  # Mosaic GPU kernels: None where the backend is a Hopper GPU; True / False force it (tests)
  mosaic_gpu: bool | None = None
  # The target (models/qwen3.py and the families reusing its layers), impl="pallas"; the
  # section these come from is "Target side (issue 41)".
  # target passes of up to this many rows per sequence: Pallas q/k norm + rope + cache write and
  # the live-slot cache attention; wider passes (prompt prefill) keep XLA's attention
  target_pallas_max_width: int = 16
  # GEMMs of up to this many rows called batch_invariant (the target's) run the skinny GEMM
  # with 16-row M tiles and K splits set by the weight alone (bf16 and fp32); 0: usual routing
  invariant_max_rows: int = 64
  # the cache attention's query tile sized for the widest pass (batch invariant), else this one
  target_invariant_attention: bool = True
  # cache slots per attention partial (the split over the cache length; a power of 2)
  target_attention_chunk: int = 512

  def __post_init__(self):
    for name in ("skinny_max_m", "fp8_small_weights", "fp8_small_min_rows", "fp8_deep_k",
                 "fp8_k_split_max_m", "skinny_fp8_swap_min_m", "target_pallas_max_width",
                 "invariant_max_rows"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"KernelPolicy.{name} must be an int >= 0, got {v!r}")
    bound = INVARIANT_BLOCK_M * skinny_gemm.MAX_ROW_CHUNKS   # the chunks of one program
    if self.invariant_max_rows > bound:
      raise ValueError(f"KernelPolicy.invariant_max_rows must be <= {bound} "
                       f"({INVARIANT_BLOCK_M}-row chunks x skinny_gemm.MAX_ROW_CHUNKS), got "
                       f"{self.invariant_max_rows}")
    for name in ("batched_bf16_rows", "batched_fp8_rows", "mgpu_attention_seqs"):
      _row_range(getattr(self, name), name)
    v = self.fold_own_min_seqs
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
      raise ValueError(f"KernelPolicy.fold_own_min_seqs must be None or an int >= 1, got {v!r}")
    if self.mosaic_gpu not in (None, True, False):
      raise ValueError(f"KernelPolicy.mosaic_gpu must be None, True or False, got "
                       f"{self.mosaic_gpu!r}")
    if self.target_invariant_attention not in (True, False):
      raise ValueError(f"KernelPolicy.target_invariant_attention must be True or False, got "
                       f"{self.target_invariant_attention!r}")
    v = self.target_attention_chunk
    if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
      raise ValueError(f"KernelPolicy.target_attention_chunk must be a power of 2 >= 16, got "
                       f"{v!r}")

  @property
  def mosaic(self) -> bool:
    """Whether the Mosaic GPU kernels may run (`mosaic_gpu`, else the backend's answer)."""
    return hopper_available() if self.mosaic_gpu is None else self.mosaic_gpu


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


def _bf16_skinny(x: jax.Array, w: jax.Array, policy: KernelPolicy) -> bool:
  """Dense bf16 runs on the skinny GEMM for block-sized row counts (any N and K); prefill
  row counts on XLA's GEMM."""
  return w.dtype == jnp.bfloat16 and x.ndim == 2 and x.shape[0] <= policy.skinny_max_m


def batched_gemm_runs(fmt: str, rows: int, policy: KernelPolicy,
                      n_weights: int | None = None) -> bool:
  """Whether a weight of this format and element count (None: a large one) at this row count
  goes to the batched GEMM (shapes that fit its tiles; `_batched_knobs` checks those)."""
  rows_range = {"bf16": policy.batched_bf16_rows, "fp8": policy.batched_fp8_rows}.get(fmt)
  if rows_range is None:   # q8_0's 32-wide block scales have no path there
    return False
  lo, hi = rows_range
  if fmt == "fp8" and n_weights is not None and n_weights < policy.fp8_small_weights:
    lo = max(lo, policy.fp8_small_min_rows)
  return lo <= rows <= hi and policy.mosaic


def _batched_knobs(x: jax.Array, w, gate_up: bool, out_dtype,
                   policy: KernelPolicy) -> batched_gemm.Knobs | None:
  """The batched GEMM's tiles when it runs this product, else None."""
  fmt = matrix_format(w)
  n, k = w.shape
  if x.ndim != 2 or not batched_gemm_runs(fmt, x.shape[0], policy, n * k):
    return None
  return batched_gemm.default_knobs(x.shape[0], n // 2 if gate_up else n, k,
                                    "gate_up" if gate_up else "none", out_dtype, fmt,
                                    deep_k=policy.fp8_deep_k,
                                    k_split_max_m=policy.fp8_k_split_max_m)


def _batched_operands(w) -> tuple[jax.Array, jax.Array | None]:
  return (w.data, w.scale) if isinstance(w, QuantWeight) else (w, None)


def gemm_knobs(fmt: str, n: int, k: int, gate_up: bool = False, m: int = 16, *,
               policy: KernelPolicy) -> skinny_gemm.Knobs:
  """The skinny GEMM's tiles for this weight at m rows (`skinny_gemm.default_knobs`)."""
  return skinny_gemm.default_knobs(fmt, n, k, gate_up, m,
                                   swap_ab_min_m=policy.skinny_fp8_swap_min_m)


# The M tile of a batch-invariant GEMM: the rows of one drafted block, the tile a 1-row decode
# already runs; a larger tile could move the MMA to another instruction (wgmma from 64 rows).
# More rows run as 16-row chunks of one program (skinny_gemm's row_chunks): each weight tile
# is read once for all of them, not once per 16 rows.
INVARIANT_BLOCK_M = 16


def _invariant_knobs(x: jax.Array, w, gate_up: bool, policy: KernelPolicy
                     ) -> skinny_gemm.Knobs | None:
  """The skinny GEMM's knobs for a batch-invariant product, or None where it does not run one
  (a quantized weight, or more rows than policy.invariant_max_rows)."""
  if isinstance(w, QuantWeight) or x.ndim != 2 or x.shape[0] > policy.invariant_max_rows:
    return None
  fmt = matrix_format(w)
  n, k = w.shape
  knobs = gemm_knobs(fmt, n // 2 if gate_up else n, k, gate_up, INVARIANT_BLOCK_M,
                     policy=policy)
  # A gate+up product with split K would sum its partials in an XLA reduction (whose order
  # XLA may choose by shape); its tiles never split.
  assert not (gate_up and knobs.split_k > 1), knobs
  return dataclasses.replace(knobs, block_m=INVARIANT_BLOCK_M,
                             row_chunks=-(-x.shape[0] // INVARIANT_BLOCK_M))


def sum_in_order(parts: jax.Array) -> jax.Array:
  """parts[0] + parts[1] + ... of split-K partials [S, ...], in that order (elementwise adds:
  the same order for every element and every shape, unlike a reduction XLA may tile)."""
  out = parts[0]
  for i in range(1, parts.shape[0]):
    out = out + parts[i]
  return out


def _routing_policy(policy: KernelPolicy | None, impl: str, what: str) -> KernelPolicy | None:
  if impl != "xla" and not isinstance(policy, KernelPolicy):
    raise ValueError(f"{what}: impl={impl!r} routes by a KernelPolicy; pass policy= (the "
                     f"prepared params' .policy), got {policy!r}")
  return policy


def linear(x: jax.Array, w, *, policy: KernelPolicy | None = None, impl: str = "pallas",
           gate_up: bool = False, partials: bool = False, residual: jax.Array | None = None,
           out_dtype=jnp.float32, batch_invariant: bool = False) -> jax.Array:
  """y = x @ w^T for a weight in (out, in) layout: THE GEMM entry point of the step.

  Dense bf16 weights: the activation is rounded to bf16 (the rounding SPEC.md section 5 names)
  and the product accumulates in float32; up to policy.skinny_max_m rows the Pallas skinny
  GEMM streams the weights (in the bf16 step it beats XLA's GEMMs, mostly by needing no
  split-K reduce or convert launches), whatever N and K; beyond that (prefill and large-batch
  row counts, where a GEMM that reads the weights once per 64-row tile loses), XLA's GEMM,
  except that at the row counts the policy gives a format (`batched_gemm_runs`) the Mosaic GPU
  batched GEMM runs where the shape fits its tiles. Dense fp32: XLA, full-precision float32
  (HIGHEST, so GPUs do not silently use TF32). QuantWeight: the Pallas skinny GEMM streams the
  1-byte weights at every other row count (impl="xla": its jnp twin, which dequantizes in
  XLA). gate_up: w holds gate rows then up rows and the result is silu(gate) * up (fused into
  the GEMM's epilogue). The result is out_dtype, or with partials=True the float32 split-K
  partial sums [S, M, N] (S = 1 unless the skinny GEMM split K), left for the consuming kernel
  to add up (qk_norm_rope). residual (float32 [M, N], plain projections only): the result is
  residual + x @ w^T in float32, the add inside the batched GEMM's epilogue where that runs. A
  `Reduced` weight (inside a sharded call) is the product over this device's columns, psummed
  over its axis. policy: the KernelPolicy that routes the product (impl="xla" reads none).

  batch_invariant (the target's products): up to policy.invariant_max_rows rows, dense bf16
  and fp32 weights run the skinny GEMM with 16-row M tiles, its K split set by the weight's
  shape alone, and split partials added in order (`sum_in_order`), so each row of the result
  is bitwise the same whatever number of rows shares the call; past that row count (or for
  quantized weights) the usual routing.
  """
  policy = _routing_policy(policy, impl, "linear")
  if partials and gate_up:
    raise ValueError("linear: partials=True is for plain projections, not gate_up")
  if residual is not None:
    if partials or gate_up:
      raise ValueError("linear: a residual is for plain projections (no partials, no gate_up)")
    n_out = (w.w if isinstance(w, Reduced) else w).shape[0]
    if tuple(residual.shape) != tuple(x.shape[:-1]) + (n_out,):
      raise ValueError(f"linear: residual must be {tuple(x.shape[:-1]) + (n_out,)} (the "
                       f"product's shape), got {tuple(residual.shape)}")
    if (impl != "xla" and not isinstance(w, Reduced)
        and not (batch_invariant and _invariant_knobs(x, w, False, policy))):
      knobs = _batched_knobs(x, w, False, jnp.float32, policy)
      if knobs is not None:
        data, scale = _batched_operands(w)
        return batched_gemm.batched_matmul(x.astype(jnp.bfloat16), data,
                                           residual.astype(jnp.float32), scale=scale,
                                           epilogue="residual", **knobs.kwargs())
    return residual.astype(jnp.float32) + linear(x, w, policy=policy, impl=impl,
                                                 batch_invariant=batch_invariant)
  if isinstance(w, Reduced):
    if partials or gate_up:
      raise ValueError("linear: a Reduced (column-split) weight takes neither partials nor "
                       "gate_up (its partial sums must be added before any epilogue)")
    return jax.lax.psum(linear(x, w.w, policy=policy, impl=impl,
                               batch_invariant=batch_invariant), w.axis).astype(out_dtype)
  inv = (_invariant_knobs(x, w, gate_up, policy) if batch_invariant and impl != "xla"
         else None)
  if inv is not None:
    fmt = matrix_format(w)
    if gate_up:
      return skinny_gemm.skinny_matmul_gate_up(x, w, None, fmt=fmt, out_dtype=out_dtype,
                                               **inv.kwargs())
    y = skinny_gemm.skinny_matmul(x, w, None, fmt=fmt, keep_splits=True, **inv.kwargs())
    return y if partials else sum_in_order(y).astype(out_dtype)
  knobs = None if impl == "xla" else _batched_knobs(x, w, gate_up, out_dtype, policy)
  if knobs is not None:
    data, scale = _batched_operands(w)
    y = batched_gemm.batched_matmul(x.astype(jnp.bfloat16), data, scale=scale,
                                    epilogue="gate_up" if gate_up else "none",
                                    out_dtype=out_dtype, **knobs.kwargs())
    return y[None] if partials else y.astype(out_dtype)
  if impl != "xla" and (isinstance(w, QuantWeight) or _bf16_skinny(x, w, policy)):
    data, scale, fmt = (w.data, w.scale, w.fmt) if isinstance(w, QuantWeight) else (w, None, "bf16")
    n, k = data.shape
    knobs = gemm_knobs(fmt, n // 2 if gate_up else n, k, gate_up, x.shape[0], policy=policy)
    if gate_up:
      return skinny_gemm.skinny_matmul_gate_up(x, data, scale, fmt=fmt, out_dtype=out_dtype,
                                               **knobs.kwargs())
    return skinny_gemm.skinny_matmul(x, data, scale, fmt=fmt, out_dtype=out_dtype,
                                     keep_splits=partials, **knobs.kwargs())
  if isinstance(w, QuantWeight):
    fn = (skinny_gemm.skinny_matmul_gate_up_reference if gate_up
          else skinny_gemm.skinny_matmul_reference)
    y = fn(x, w.data, w.scale, fmt=w.fmt)
  else:
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if w.dtype == jnp.bfloat16:
      y = bf16_dot_general(x.astype(jnp.bfloat16), w, dims)
    else:
      y = jax.lax.dot_general(x.astype(jnp.float32), w, dims,
                              precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
    if gate_up:
      n_ff = y.shape[-1] // 2
      y = jax.nn.silu(y[..., :n_ff]) * y[..., n_ff:]
  # Unsplit here: one "partial" for a consumer that expects [S, M, N].
  return y[None] if partials else y.astype(out_dtype)


def norm_pair(x: jax.Array, w_norm: jax.Array, eps: float, w, *,
              policy: KernelPolicy | None = None, impl: str = "pallas"
              ) -> tuple[jax.Array, jax.Array]:
  """(rms_norm(x, w_norm, eps) in float32, the same as the input of linear(., w)) for a norm
  that feeds a float32 consumer besides the GEMM. impl "pallas": one launch writing both
  (`rms_norm.rms_norm_pair`), where XLA's norm fusion and the GEMM input's convert are two;
  "xla": XLA's float32 norm, twice the same array."""
  policy = _routing_policy(policy, impl, "norm_pair")
  if impl == "xla" or x.ndim != 2:
    y = rms_norm(x, w_norm, eps)
    return y, y
  return norm_k.rms_norm_pair(x.astype(jnp.float32), w_norm, eps=eps, out_dtype=input_dtype(w))


def gemm_input_norm(x: jax.Array, w_norm: jax.Array, eps: float, w, *,
                    policy: KernelPolicy | None = None, impl: str = "pallas",
                    gate_up: bool = False) -> jax.Array:
  """rms_norm(x, w_norm, eps) as the input of `linear(., w, gate_up=gate_up)`: where the
  batched GEMM runs that product (it takes bf16 rows), the Pallas row norm writes them in bf16
  in one launch, the value linear would round them to (XLA's fusions of the same norm were
  slower: benchmarks/RESULTS.md, "Pallas RMS norm in front of batched-GEMM products (kept)");
  elsewhere XLA's norm in float32."""
  policy = _routing_policy(policy, impl, "gemm_input_norm")
  inner = w.w if isinstance(w, Reduced) else w
  if (impl != "xla" and x.ndim == 2
      and _batched_knobs(x, inner, gate_up, jnp.bfloat16 if gate_up else jnp.float32, policy)):
    return norm_k.rms_norm(x.astype(jnp.float32), w_norm, eps=eps, out_dtype=jnp.bfloat16)
  return rms_norm(x, w_norm, eps)


# --- bf16 x bf16 -> float32 products and their gradients ----------------------------------------
# JAX's transpose of a bf16 dot with a float32 result widens the bf16 operand to float32 for the
# float32 cotangent, so every backward GEMM of bf16 training would run as a float32 GEMM (at
# most half the bf16 rate, twice the bytes). These products round the cotangent to bf16
# instead and run both transposed products bf16 x bf16 (float32 accumulation inside the GEMM),
# as mixed-precision training does; their forward is the plain product, so inference is
# unchanged.

def _product(op, a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
  """op = ("dot_general", dims) or ("einsum", (spec, precision)), accumulated to out_dtype."""
  kind, arg = op
  if kind == "dot_general":
    return jax.lax.dot_general(a, b, arg, preferred_element_type=out_dtype)
  spec, precision = arg
  return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _bf16_product(op, a: jax.Array, b: jax.Array) -> jax.Array:
  return _product(op, a, b, jnp.float32)


def _bf16_product_fwd(op, a, b):
  return _product(op, a, b, jnp.float32), (a, b)


def _bf16_product_bwd(op, res, g):
  """(da, db) for the float32 cotangent g: g rounded to bf16, both transposes bf16 x bf16 with
  bf16 results (the dtype of the primal inputs)."""
  _, vjp = jax.vjp(lambda a, b: _product(op, a, b, jnp.bfloat16), *res)
  return vjp(g.astype(jnp.bfloat16))


_bf16_product.defvjp(_bf16_product_fwd, _bf16_product_bwd)


def bf16_dot_general(a: jax.Array, b: jax.Array, dims) -> jax.Array:
  """lax.dot_general(a, b, dims) of bf16 operands accumulated in float32, with bf16
  backward products (section comment)."""
  return _bf16_product(("dot_general", dims), a, b)


def bf16_einsum(spec: str, a: jax.Array, b: jax.Array, precision=None) -> jax.Array:
  """jnp.einsum(spec, a, b) of bf16 operands accumulated in float32, with bf16 backward
  products (section comment)."""
  return _bf16_product(("einsum", (spec, precision)), a, b)


def einsum_f32(spec: str, a: jax.Array, b: jax.Array, precision=None) -> jax.Array:
  """jnp.einsum(spec, a, b) accumulated in float32 (preferred_element_type float32), the
  operands in their own dtypes (the attention dots of the target families and of training).

  XLA's CPU runtime has no bf16 x bf16 -> float32 dot for every operand layout: a batched dot
  whose contraction is not the operands' minor axis (the attention's probabilities x V at one
  query row, e.g.) fails inside it with "Unsupported element type for DotThunk::Execute: BF16
  x BF16 = F32". On CPU, bf16 operands are therefore widened to float32 first. That is exact
  (every bf16 value is a float32, and the product of two is exact in float32), so the result
  differs from the bf16 dot's only in the order of the float32 sums. `lax.platform_dependent`
  picks the branch at lowering: other platforms compile the bf16 dot as written, and their
  programs do not change; there two bf16 operands take `bf16_einsum` (bf16 backward products).
  """
  def dot(x, y):
    if x.dtype == y.dtype == jnp.bfloat16:
      return bf16_einsum(spec, x, y, precision)
    return jnp.einsum(spec, x, y, precision=precision, preferred_element_type=jnp.float32)

  if jnp.bfloat16 not in (a.dtype, b.dtype):
    return dot(a, b)

  def widened(x, y):
    return jnp.einsum(spec, x.astype(jnp.float32), y.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

  return jax.lax.platform_dependent(a, b, cpu=widened, default=dot)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def input_dtype(w) -> jnp.dtype:
  """The dtype `linear(., w)` takes its input in: float32 for a float32 weight, else bf16 (the
  rounding every other format applies), so a producer may write it so."""
  inner = w.w if isinstance(w, Reduced) else w
  return jnp.dtype(jnp.float32 if matrix_format(inner) == "fp32" else jnp.bfloat16)


def residual_norm(x: jax.Array, parts: jax.Array | None, w_norm: jax.Array, eps: float, w, *,
                  policy: KernelPolicy | None = None, impl: str = "pallas",
                  out_dtype=None) -> tuple[jax.Array, jax.Array]:
  """The target's pre-norm: (x + sum(parts), its RMS norm as the input of linear(., w)) for
  the residual stream x [M, E] float32 and a sublayer's split-K partials [S, M, E] float32
  (or None). impl "pallas": one Pallas launch (`rms_norm.add_rms_norm`: the partials added in
  order, one row per program, so the norm is batch invariant), the norm written in
  `input_dtype(w)` (or out_dtype); "xla": XLA's add and float32 norm."""
  policy = _routing_policy(policy, impl, "residual_norm")
  if impl == "xla":
    x = x if parts is None else x + sum_in_order(parts)
    y = rms_norm(x, w_norm, eps)
    return x, (y if out_dtype is None else y.astype(out_dtype))
  return norm_k.add_rms_norm(x, parts, w_norm, eps=eps,
                             out_dtype=input_dtype(w) if out_dtype is None else out_dtype)


def sandwich_norm(x: jax.Array, parts: jax.Array | None, w_post: jax.Array | None,
                  post_eps: float, w_norm: jax.Array, eps: float, w, *, offset: float,
                  post_offset: float, policy: KernelPolicy | None = None, impl: str = "pallas",
                  out_dtype=None) -> tuple[jax.Array, jax.Array]:
  """A sandwich-normed target's joint between sublayers: (x + the RMS norm of sum(parts)
  (weight post_offset + w_post, post_eps), the RMS norm of that (weight offset + w_norm, eps)
  as the input of linear(., w)); parts None: (x, the norm of x). impl "pallas": one launch
  (`rms_norm.sandwich_rms_norm`, one row per program: batch invariant), the norm written in
  `input_dtype(w)` (or out_dtype); "xla": XLA's float32 norms."""
  policy = _routing_policy(policy, impl, "sandwich_norm")
  if impl == "xla":
    if parts is not None:
      x = x + rms_norm(sum_in_order(parts), post_offset + w_post, post_eps)
    y = rms_norm(x, offset + w_norm, eps)
    return x, (y if out_dtype is None else y.astype(out_dtype))
  return norm_k.sandwich_rms_norm(
      x, parts, w_post, w_norm, eps=eps, post_eps=post_eps, offset=offset,
      post_offset=post_offset, out_dtype=input_dtype(w) if out_dtype is None else out_dtype)


def target_attention(*, t: int, group: int, head_dim: int, cache_dtype, impl: str,
                     policy: KernelPolicy | None) -> cache_attn_k.Knobs | None:
  """How a target pass of t rows per sequence attends its cache: the Pallas pieces
  (`norm_rope.qk_norm_rope_cache`, `cache_attention.cache_attention` with these knobs) for
  up to policy.target_pallas_max_width rows, None for XLA's composition (impl "xla", or
  wider passes). The query tile is sized for the widest pass when
  policy.target_invariant_attention (every width runs the same tile: batch invariance), else
  for this one. A head_dim the kernels do not take is a ValueError naming it."""
  policy = _routing_policy(policy, impl, "target_attention")
  if impl == "xla" or t > policy.target_pallas_max_width:
    return None
  limits.check_head_dim("the target's Pallas attention (impl='pallas')", head_dim)
  width = policy.target_pallas_max_width if policy.target_invariant_attention else t
  return cache_attn_k.default_knobs(rows=width * group, head_dim=head_dim,
                                    cache_dtype=cache_dtype,
                                    chunk=policy.target_attention_chunk)


@dataclasses.dataclass(frozen=True)
class Attention:
  """How one ring-attention launch runs: kernel "mgpu" (the Mosaic GPU partials,
  `ring_attention_mgpu.ring_attention_batched`, a batch of slots, one sequence a batch of
  one), "triton" (`ring_attention.ring_attention`, vmapped over a batch's slots) or "xla" (its
  jnp twin), with that kernel's knobs (None for "xla")."""
  kernel: str
  knobs: Any = None


def attention(*, n_seqs: int, n_head_kv: int, t: int, group: int, head_dim: int, slots: int,
              window: int | None, ring_dtype, impl: str, policy: KernelPolicy | None,
              block_mask: bool = False) -> Attention:
  """The ring attention of t block rows (group query heads per kv head) of n_seqs sequences
  over caches of `slots` slots (window: the sliding window, None for full attention): the
  Mosaic GPU partials for policy.mgpu_attention_seqs slot counts where the shape fits them and
  the policy allows Mosaic GPU kernels, else the Triton kernel with its default knobs (impl
  "xla": the jnp twin). block_mask: the block's own keys are masked (DFlash2's causal or band
  layers), which only the Triton kernel and the twin do."""
  policy = _routing_policy(policy, impl, "attention")
  if impl == "xla":
    return Attention("xla")
  seqs = policy.mgpu_attention_seqs
  if (not block_mask and seqs is not None and seqs[0] <= n_seqs <= seqs[1]
      and policy.mosaic):
    knobs = attn_mgpu.default_knobs(n_seqs, n_head_kv, t * group, t, head_dim, slots,
                                    ring_dtype)
    if knobs is not None:
      return Attention("mgpu", knobs)
  return Attention("triton", attn_k.default_knobs(
      slots, window, ring_dtype, head_dim=head_dim, n_seqs=n_seqs, n_head_kv=n_head_kv,
      fold_own_min_seqs=policy.fold_own_min_seqs))


def top_k(x: jax.Array, k: int, *, first: int = 0, impl: str) -> tuple[jax.Array, jax.Array]:
  """lax.top_k(x[..., first:, :], k) of float32 x [..., T, V]: (values [..., T - first, k],
  indices int32), largest first, equal values by ascending index. impl "pallas": the two-launch
  Pallas top-k (`pallas_kernels.top_k`), which reads the rows from `first` in place; "xla":
  lax.top_k on the slice."""
  if impl == "xla":
    return top_k_k.top_k_reference(x, k=k, first=first)
  return top_k_k.top_k(x, k=k, first=first)


def selector_walk(unary: jax.Array, edge: jax.Array, *, temperature: float,
                  keys: jax.Array | None, impl: str) -> tuple[jax.Array, jax.Array]:
  """The candidate selector's walk over n rows of S blocks (SPEC_dflash2_dspark 7): unary [S,
  n, k], edge [S, n, k, k] float32 (edge[s, p, i, j]: candidate j of row p after candidate i
  of row p - 1; row 0's every i is the anchor); keys [S, n], one PRNG key per row (None when
  temperature is 0). prev = 0; score_p = unary_p + edge_p[prev]; chosen_p = argmax score_p,
  or at temperature T > 0 jax.random.categorical(row p's key, score_p / T); prev = chosen_p.
  Returns (chosen [S, n] int32, scores [S, n, k] float32).

  impl "xla": a scan of the rows (unrolled: a rolled loop on the GPU reads its trip condition
  back to the host every row). "pallas": one launch (`pallas_kernels.selector_walk`); the
  draws are categorical's own, argmax(gumbel(key) + score / T), with the Gumbel noise of the
  same keys drawn up front and added here for every predecessor, so both draw the same tokens.
  """
  if impl != "xla":
    noisy = None
    if temperature != 0:
      k = unary.shape[-1]
      g = jax.vmap(jax.vmap(lambda kp: jax.random.gumbel(kp, (k,), jnp.float32)))(keys)
      noisy = g[:, :, None] + (unary[:, :, None] + edge) / temperature
    return walk_k.selector_walk(unary, edge, noisy)

  def walk(prev_i, xs):
    u, e, kp = xs                                                        # [S, k], [S, k, k]
    score = u + jnp.take_along_axis(e, prev_i[:, None, None], axis=1)[:, 0]
    if temperature == 0:
      j = jnp.argmax(score, axis=-1).astype(jnp.int32)
    else:
      j = jax.vmap(jax.random.categorical)(kp, score / temperature).astype(jnp.int32)
    return j, (score, j)

  _, (scores, chosen) = jax.lax.scan(
      walk, jnp.zeros((unary.shape[0],), jnp.int32),
      (jnp.swapaxes(unary, 0, 1), jnp.swapaxes(edge, 0, 1),
       None if keys is None else jnp.swapaxes(keys, 0, 1)), unroll=True)
  return jnp.swapaxes(chosen, 0, 1), jnp.swapaxes(scores, 0, 1)
