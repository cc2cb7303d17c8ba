"""Skinny GEMM that streams (quantized) weights once: out = x @ dequant(w)^T.

x is [M, K] with M small (the drafter's block rows: 16 per sequence, up to a few hundred);
w is [N, K], K contiguous (the GGUF/torch (out, in) layout), so every weight load is a wide
contiguous read of K-runs. Weight formats:

  "bf16": w bfloat16, scale None.
  "fp32": w float32, scale None; x stays float32 and both operands are split into three bf16
          parts (`_common.split_dot`: six bf16 MMAs per tile, float32 accuracy), so a float32
          target's GEMMs run here with the same fixed reduction order as bf16 (batch
          invariance) instead of a TF32 or cuBLAS product.
  "fp8":  w float8_e4m3fn, scale [N] float32 per output row (applied in the epilogue).
  "q8_0": w int8, scale [N, K // 32] float32 per 32-wide K block (llama.cpp Q8_0 with d
          widened from float16); each 32-block's partial dot is scaled inside the K loop.

1-byte weights are widened in registers to bfloat16, which is exact for int8 and for fp8
e4m3 values; fp8 goes through float32 first because Triton's direct fp8 -> bf16 conversion
is the bottleneck on the H200 (benchmarks/RESULTS.md, the fp8 GEMM sections). The activation x is rounded to
bfloat16 for the dot (the same rounding a bf16-weight GEMM applies), products are exact and
the accumulation is float32, so the kernel matches `skinny_matmul_reference` up to float32
summation order.

q8_0 dequantizes in registers: the int8 tile widened to float32, times its [block_n,
block_k / 32] scales, rounded to bfloat16, one dot per K tile (faster on the H200 than an
exact formulation with one K=32 dot per block and float32-scaled partials, RESULTS.md). So
every format computes a bf16 GEMM on round_bf16(dequantized weights): the quantized drafter
equals the bf16 drafter on the dequantized weights (for fp8 with power-of-two row scales the
rounding is exact).
The int8 -> float32 widening is inline PTX on the GPU (byte permutes and one float subtract,
`_int8_to_f32`): the hardware int -> float convert issues at 16 per clock per SM on Hopper,
below the rate the weight stream delivers bytes.

Grid: (M tiles, N tiles, K splits). M tiles vary fastest so programs that share a weight
tile run together and the repeat reads hit L2. split_k > 1 gives each program a contiguous
range of K blocks and sums the float32 partials in jnp: it fills the GPU when N / block_n
alone is too few programs (the N = 6656 down projection).

Any N and K (q8_0: K a multiple of 32): a last N tile past N and a last K tile past K are
masked (0.11.2 Pallas Triton does not mask block reads); shapes the tiles divide run the
unmasked kernel.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import (KnobsBase, check, is_pow2, resolve_interpret, split_dot,
                                    split_parts)

FORMATS = ("bf16", "fp8", "q8_0", "fp32")
Q8_0_BLOCK = 32
FP32_TERMS = 3   # bf16 parts per float32 operand: float32 accuracy
_WEIGHT_DTYPE = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "q8_0": jnp.int8,
                 "fp32": jnp.float32}
_DOT_NT = (((1,), (1,)), ((), ()))  # x [m, k] . w [n, k] -> [m, n]
MAX_DEFAULT_BLOCK_M = 64
MAX_ROW_CHUNKS = 4   # a program's accumulators: row_chunks x (1 or 2 streams) [block_m, block_n]
N_SMS = 132       # the H200's streaming multiprocessors: the GPU the default tiles are tuned on
BLOCK_ROWS = 16   # the rows of one drafted block (the seed's block size): the tuned case


def _default_block_m(m: int) -> int:
  # One M tile up to 64 rows streams the weights exactly once; beyond that the accumulator
  # would cost too many registers, so tile M and rely on L2 for the repeat weight reads.
  return min(max(16, pl.next_power_of_2(m)), MAX_DEFAULT_BLOCK_M)


@dataclasses.dataclass(frozen=True)
class Knobs(KnobsBase):
  """The launch knobs of `skinny_matmul` / `skinny_matmul_gate_up` (their keyword arguments)."""
  block_n: int
  block_k: int
  split_k: int
  num_stages: int = 3
  block_m: int | None = None
  swap_ab: bool = False
  num_warps: int = 4
  row_chunks: int = 1


def default_knobs(fmt: str, n: int, k: int, gate_up: bool = False, m: int = BLOCK_ROWS, *,
                  swap_ab_min_m: int) -> Knobs:
  """Tiles for an [M, K] x [N, K]^T GEMM (n: the rows of one weight stream, n_ff for the fused
  gate+up), from the H200 sweeps (benchmarks/RESULTS.md): 128-wide K tiles (256 for q8_0 and
  for a long K of 1-byte weights), 32-row N tiles for q8_0 and for the fused gate+up (two
  accumulators), and K split when N / block_n alone cannot fill the 132 SMs: 5 ways for a long
  K (the down projection), else 4. bf16 takes fp8's tiles except two measured in the bf16
  step: a long K keeps 128-wide K tiles and K <= 4096 splits 2 ways where that still fills the
  132 SMs 1.5 times (o: fewer partials for XLA to add up; fp8 got slower with either), and
  8 ways where that split leaves SMs idle and K has >= 48 blocks (a narrow N over a long K). A
  dimension the tile does not divide keeps the tile and masks its last one (no smaller tiles,
  whose extra loop trips cost more than one partly used tile); a dimension smaller than the
  tile gets the power of 2 covering it (>= 16, >= 32 for q8_0's K).

  fp8 from swap_ab_min_m rows on (more than one block of rows: a batched step): the swapped
  MMA (swap_ab) over one M tile of up to 128 rows and 64-row N tiles, 8 warps for a 128-row
  tile (faster than the 64-row-tile default past one block of rows; at one block the plain
  tiles stay ahead). Other formats keep block_m None (`skinny_matmul`'s rule).

  fp32 (three bf16 parts per operand) takes 64-wide K tiles and 32-row N tiles: the parts of
  both tiles live in registers at once.
  """
  if fmt == "fp32":
    block_k = min(64, max(16, pl.next_power_of_2(k)))
    split_k = 4 if n <= 16384 and pl.cdiv(k, block_k) >= 32 else 1
    if gate_up:
      split_k = 1
    return Knobs(block_n=min(32, max(16, pl.next_power_of_2(n))), block_k=block_k,
                 split_k=split_k)
  long_k = not gate_up and k >= 16384
  block_k = 256 if fmt == "q8_0" or (long_k and fmt != "bf16") else 128
  block_k = min(block_k, max(Q8_0_BLOCK if fmt == "q8_0" else 16, pl.next_power_of_2(k)))
  block_n = 32 if (fmt == "q8_0" or gate_up) and not long_k else 64
  block_n = min(block_n, max(16, pl.next_power_of_2(n)))
  split_k = 1
  if not gate_up and n <= 16384 and pl.cdiv(k, block_k) >= 16:
    split_k = 5 if long_k else 4
    # Fewer partials for the consumer to read back, where 2 splits still give >= 1.5
    # programs per SM (the seed's o projection; qkv and the LM head keep 4).
    if fmt == "bf16" and k <= 4096 and 2 * pl.cdiv(n, block_n) >= 1.5 * N_SMS:
      split_k = 2
    # 8 splits where that split leaves SMs idle and K is long enough for 6+ blocks a split
    # (DFlash2's coefficient projection at the seed dims, N 1664).
    if fmt == "bf16" and split_k * pl.cdiv(n, block_n) < N_SMS and pl.cdiv(k, block_k) >= 48:
      split_k = 8
  if fmt == "fp8" and m >= swap_ab_min_m:
    block_m = min(128, pl.next_power_of_2(m))
    return Knobs(block_n=min(64, max(16, pl.next_power_of_2(n))), block_k=block_k,
                 split_k=split_k, block_m=block_m, swap_ab=True,
                 num_warps=8 if block_m > 64 else 4)
  return Knobs(block_n=block_n, block_k=block_k, split_k=split_k)


def _silu_mul(g: jax.Array, u: jax.Array) -> jax.Array:
  return g * jax.nn.sigmoid(g) * u


# 4 int8 in one b32 -> 4 float32 holding the same integers: each byte biased to unsigned, put
# under the exponent of 2^23 by prmt, then 2^23 + 128 subtracted (exact).
_INT8_TO_F32_PTX = """{
.reg .b32 u, t0, t1, t2, t3;
xor.b32 u, $4, 0x80808080;
prmt.b32 t0, u, 0x4B000000, 0x7650;
prmt.b32 t1, u, 0x4B000000, 0x7651;
prmt.b32 t2, u, 0x4B000000, 0x7652;
prmt.b32 t3, u, 0x4B000000, 0x7653;
sub.f32 $0, t0, 0f4B000080;
sub.f32 $1, t1, 0f4B000080;
sub.f32 $2, t2, 0f4B000080;
sub.f32 $3, t3, 0f4B000080;
}"""
# The PTX takes 4 elements per instance: every thread must hold a multiple of 4 weight values.
_PTX_PACK = 4


def _int8_to_f32(w: jax.Array, interpret: bool) -> jax.Array:
  if interpret:   # the interpreter runs no PTX; both widenings are exact
    return w.astype(jnp.float32)
  [f] = plt.elementwise_inline_asm(
      _INT8_TO_F32_PTX, args=[w], constraints="=f,=f,=f,=f,r", pack=_PTX_PACK,
      result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.float32)])
  return f


def _skinny_kernel(x_ref, *refs, fmt: str, gate_up: bool, m: int, n_out: int, k: int,
                   block_m: int, block_n: int, block_k: int, split_k: int, swap_ab: bool,
                   row_chunks: int, interpret: bool):
  """One [row_chunks block_m, block_n] output tile (two weight streams when gate_up): each
  weight tile is loaded once and multiplies the rows block_m at a time, one dot and one
  accumulator per chunk, so a row's arithmetic is that of a one-chunk program.

  swap_ab: the MMA computes the transposed tile w . x^T ([block_n, block_m], weights as the
  left operand, which the tensor core can take from the registers they were widened in), and
  the epilogue transposes it back.

  Shapes the tiles fit run the plain loop. A ragged N (n_out % block_n): the weight and scale
  refs are whole arrays indexed at each stream's first row (the up half of a fused gate+up
  weight does not start on a tile boundary) and rows past n_out are masked. A K tail
  (k % block_k): one masked step after the loop over the full K blocks.
  """
  n_w = 2 if gate_up else 1
  w_refs = refs[:n_w]
  s_refs = refs[n_w:-1]
  o_ref = refs[-1]
  n_ragged = n_out % block_n != 0
  tail = k % block_k
  kb_full = k // block_k
  kb_total = kb_full + (1 if tail else 0)

  rows_pp = block_m * row_chunks
  row_masks = [None] * row_chunks   # per chunk: its rows below M
  if m % rows_pp:
    row_masks = [pl.program_id(0) * rows_pp + c * block_m
                 + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0) < m
                 for c in range(row_chunks)]
  n_mask = None     # [block_n, 1]: weight rows (output columns) of this tile below n_out
  row0s = [None] * n_w
  if n_ragged:
    n_first = pl.program_id(1) * block_n
    n_mask = (n_first + lax.broadcasted_iota(jnp.int32, (block_n, 1), 0)) < n_out
    # First row of each stream's tile in the whole weight array.
    row0s = [n_first + i * n_out for i in range(n_w)]

  def load_x(c: int, start, size: int, k_mask=None) -> jax.Array:
    # No automatic OOB masking in the 0.11 Triton lowering: rows past M must not be read.
    rows = slice(None) if row_chunks == 1 else pl.ds(c * block_m, block_m)
    window = x_ref.at[rows, pl.ds(start, size)]
    row_mask = row_masks[c]
    mask = row_mask if k_mask is None else k_mask if row_mask is None else row_mask & k_mask
    if mask is None:
      return window[...]
    return plt.load(window, mask=mask, other=0.0)

  def load_w(w_ref, row0, k0, k_mask=None) -> jax.Array:
    if not n_ragged and k_mask is None:
      return w_ref[:, pl.ds(k0, block_k)]
    if n_ragged:
      window = w_ref.at[pl.ds(row0, block_n), pl.ds(k0, block_k)]
    else:
      window = w_ref.at[:, pl.ds(k0, block_k)]
    mask = n_mask if k_mask is None else k_mask if n_mask is None else n_mask & k_mask
    # `other` is cast to the weight dtype: a float for bf16 / fp8 (no int -> fp8 convert).
    return plt.load(window, mask=mask, other=0 if fmt == "q8_0" else 0.0)

  def load_q8_scale(s_ref, row0, kb, n_sub: int, kb_mask=None) -> jax.Array:
    if not n_ragged and kb_mask is None:
      return s_ref[:, pl.ds(kb * n_sub, n_sub)]
    rows = pl.ds(row0, block_n) if n_ragged else slice(None)
    window = s_ref.at[rows, pl.ds(kb * n_sub, n_sub)]
    mask = n_mask if kb_mask is None else kb_mask if n_mask is None else n_mask & kb_mask
    return plt.load(window, mask=mask, other=0.0)

  def dot(x, w):
    if swap_ab:
      return lax.dot_general(w, x, _DOT_NT, preferred_element_type=jnp.float32)
    return lax.dot_general(x, w, _DOT_NT, preferred_element_type=jnp.float32)

  def step(kb, accs, owner=None):
    """accs (chunk-major: chunk c's stream i at c n_w + i) + this K block's products. owner:
    this is the masked tail block (columns past K read nothing), read only where owner holds
    (True: unconditionally)."""
    # The tail's block index is a Python int (multiple_of takes traced values only).
    k0 = kb * block_k if isinstance(kb, int) else pl.multiple_of(kb * block_k, block_k)
    k_mask = kb_mask = None
    if owner is not None:
      k_mask = lax.broadcasted_iota(jnp.int32, (1, block_k), 1) < tail
      if owner is not True:
        k_mask &= owner
    ws = [None] * n_w   # each weight tile loaded once, at the first chunk's product

    def chunked(x_of, w_of, product):
      new = []
      for c in range(row_chunks):
        x = x_of(load_x(c, k0, block_k, k_mask))
        for i in range(n_w):
          if ws[i] is None:
            ws[i] = w_of(i)
          new.append(accs[c * n_w + i] + product(x, ws[i]))
      return tuple(new)

    if fmt == "fp32":
      return chunked(lambda x: split_parts(x, FP32_TERMS),
                     lambda i: load_w(w_refs[i], row0s[i], k0, k_mask),
                     lambda x, w: split_dot(x, w, 1))
    if fmt != "q8_0":
      def w_bf16(i):
        w = load_w(w_refs[i], row0s[i], k0, k_mask)
        if fmt == "fp8":
          w = w.astype(jnp.float32)
        return w.astype(jnp.bfloat16)
      return chunked(lambda x: x, w_bf16, dot)
    n_sub = block_k // Q8_0_BLOCK
    if owner is not None:   # the tail's 32-blocks past K / 32
      kb_mask = (kb * n_sub + lax.broadcasted_iota(jnp.int32, (1, n_sub), 1)
                 < k // Q8_0_BLOCK)
      if owner is not True:
        kb_mask &= owner

    def w_q8(i):
      w = _int8_to_f32(load_w(w_refs[i], row0s[i], k0, k_mask), interpret)
      w = w.reshape(block_n, n_sub, Q8_0_BLOCK)
      d = load_q8_scale(s_refs[i], row0s[i], kb, n_sub, kb_mask)
      return (w * d[:, :, None]).reshape(block_n, block_k).astype(jnp.bfloat16)
    return chunked(lambda x: x, w_q8, dot)

  kb_per_split = pl.cdiv(kb_total, split_k)
  kb_first = pl.program_id(2) * kb_per_split
  if kb_per_split * split_k == kb_total and not tail:
    n_iter = kb_per_split
  else:
    # The last split is shorter (or empty); a dynamic trip count keeps every full K block
    # once (the tail block, if any, is the masked step below).
    n_iter = jnp.minimum(jnp.maximum(kb_full - kb_first, 0), kb_per_split)

  acc_shape = (block_n, block_m) if swap_ab else (block_m, block_n)
  zeros = tuple(jnp.zeros(acc_shape, jnp.float32) for _ in range(row_chunks * n_w))
  accs = lax.fori_loop(0, n_iter, lambda kb, accs: step(kb_first + kb, accs), zeros)
  if tail:
    # With split K only the split holding the last block reads it.
    owner = True
    if split_k > 1:
      owner = (kb_first <= kb_full) & (kb_full < kb_first + kb_per_split)
    accs = step(kb_full, accs, owner)
  if swap_ab:
    accs = tuple(acc.T for acc in accs)
  # The epilogue emits its operations in the one-chunk order for every chunk (values loaded
  # once, at their first use), so a one-chunk program lowers as it always has.
  if fmt == "fp8":
    if n_ragged:
      live = (pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)) < n_out
      scales = [plt.load(s_ref.at[pl.ds(row0, block_n)], mask=live, other=0.0)
                for s_ref, row0 in zip(s_refs, row0s)]
    else:
      scales = [None] * n_w
    scaled = []
    for j, acc in enumerate(accs):
      if scales[j % n_w] is None:
        scales[j % n_w] = s_refs[j % n_w][...]
      scaled.append(acc * scales[j % n_w][None, :])
    accs = tuple(scaled)
  col_ok = None
  for c in range(row_chunks):
    chunk = accs[c * n_w:(c + 1) * n_w]
    out = _silu_mul(*chunk) if gate_up else chunk[0]
    out = out.astype(o_ref.dtype)
    out_mask = row_masks[c]
    if n_ragged:
      if col_ok is None:
        col_ok = (pl.program_id(1) * block_n
                  + lax.broadcasted_iota(jnp.int32, (1, block_n), 1) < n_out)
      out_mask = col_ok if out_mask is None else out_mask & col_ok
    dst = o_ref if row_chunks == 1 else o_ref.at[pl.ds(c * block_m, block_m), :]
    if out_mask is None:
      dst[...] = out
    else:
      plt.store(dst, out, mask=out_mask)


def _check_args(kernel: str, x, w, scale, fmt: str, block_m: int, block_n: int,
                block_k: int, split_k: int, num_warps: int, n_out: int, row_chunks: int = 1,
                swap_ab: bool = False) -> None:
  """Limits shared by both entry points; n_out is the row count each weight stream covers."""
  check(fmt in FORMATS, kernel, f"fmt in {FORMATS}", fmt)
  check(x.ndim == 2, kernel, "x must be 2-D [M, K]", x.shape)
  check(w.ndim == 2, kernel, "w must be 2-D [N, K]", w.shape)
  m, k = x.shape
  n = w.shape[0]
  check(w.shape[1] == k, kernel, "w.shape[1] == x.shape[1] (K)", (w.shape, x.shape))
  check(x.dtype in (jnp.bfloat16, jnp.float32), kernel, "x dtype bfloat16 or float32", x.dtype)
  check(w.dtype == _WEIGHT_DTYPE[fmt], kernel, f"w dtype {jnp.dtype(_WEIGHT_DTYPE[fmt])} for "
        f"fmt={fmt!r}", w.dtype)
  if fmt in ("bf16", "fp32"):
    check(scale is None, kernel, f"scale must be None for fmt={fmt!r}", type(scale))
  else:
    want = (n,) if fmt == "fp8" else (n, k // Q8_0_BLOCK)
    check(scale is not None, kernel, f"scale {want} float32 required for fmt={fmt!r}", None)
    check(scale.shape == want, kernel, f"scale shape {want} for fmt={fmt!r}", scale.shape)
    check(scale.dtype == jnp.float32, kernel, "scale dtype float32", scale.dtype)
  check(m >= 1, kernel, "M >= 1", m)
  for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
    check(is_pow2(b) and b >= 16, kernel, f"{name} a power of 2 >= 16", b)
  if fmt == "q8_0":
    check(k % Q8_0_BLOCK == 0, kernel, "K % 32 == 0 for q8_0", k)
    check(block_k >= Q8_0_BLOCK, kernel, "block_k >= 32 for q8_0", block_k)
    check(block_n * block_k >= _PTX_PACK * 32 * num_warps, kernel, "block_n * block_k >= "
          f"{_PTX_PACK * 32} * num_warps for q8_0 ({_PTX_PACK} weights per thread)",
          (block_n, block_k, num_warps))
  check(n_out >= 1 and k >= 1, kernel, "N >= 1 and K >= 1", (n_out, k))
  kb = -(-k // block_k)
  check(1 <= split_k <= kb, kernel, f"1 <= split_k <= ceil(K / block_k) = {kb}", split_k)
  check(isinstance(row_chunks, int) and 1 <= row_chunks <= MAX_ROW_CHUNKS
        and (row_chunks == 1 or not swap_ab), kernel,
        f"row_chunks an int in [1, {MAX_ROW_CHUNKS}], 1 with swap_ab", (row_chunks, swap_ab))


def _launch(x, w, scale, *, fmt: str, gate_up: bool, block_m: int, block_n: int,
            block_k: int, split_k: int, num_warps: int, num_stages: int, swap_ab: bool,
            row_chunks: int, out_dtype, interpret: bool, name: str) -> jax.Array:
  """pallas_call over (M tiles of row_chunks block_m rows, N tiles, K splits); returns
  [M, N] or [split_k, M, N]."""
  m, k = x.shape
  n_out = w.shape[0] // 2 if gate_up else w.shape[0]
  n_tiles = pl.cdiv(n_out, block_n)
  rows_pp = block_m * row_chunks
  grid = (pl.cdiv(m, rows_pp), n_tiles, split_k)
  # K rounded up to whole tiles: a tail tile's block hangs over the arrays' end (masked).
  kp = pl.cdiv(k, block_k) * block_k

  x_spec = pl.BlockSpec((rows_pp, kp), lambda i, j, s: (i, 0))
  s_cols = () if fmt == "fp8" else (kp // Q8_0_BLOCK,)
  if n_out % block_n:
    # Ragged N: whole-array weight (and scale) refs; the kernel indexes each stream's rows
    # (the up half starts at row n_out, not on a block boundary) and masks rows past n_out.
    n_w = 2 if gate_up else 1
    w_specs = [pl.BlockSpec((w.shape[0], kp), lambda i, j, s: (0, 0))] * n_w
    s_specs = [pl.BlockSpec((w.shape[0],) + s_cols,
                            lambda i, j, s: (0,) * (1 + len(s_cols)))] * n_w
  else:
    w_specs = [pl.BlockSpec((block_n, kp), lambda i, j, s: (j, 0))]
    s_block = (block_n,) + s_cols
    s_specs = [pl.BlockSpec(s_block, lambda i, j, s: (j,) + (0,) * (len(s_block) - 1))]
    if gate_up:
      # The up half of the fused weight is the same buffer read n_tiles blocks further down.
      w_specs.append(pl.BlockSpec((block_n, kp), lambda i, j, s: (j + n_tiles, 0)))
      s_specs.append(pl.BlockSpec(s_block,
                                  lambda i, j, s: (j + n_tiles,) + (0,) * (len(s_block) - 1)))
  operands = [x] + [w] * len(w_specs)
  in_specs = [x_spec] + w_specs
  if scale is not None:
    operands += [scale] * len(s_specs)
    in_specs += s_specs

  if split_k == 1:
    out_shape = jax.ShapeDtypeStruct((m, n_out), out_dtype)
    out_spec = pl.BlockSpec((rows_pp, block_n), lambda i, j, s: (i, j))
  else:
    out_shape = jax.ShapeDtypeStruct((split_k, m, n_out), jnp.float32)
    out_spec = pl.BlockSpec((None, rows_pp, block_n), lambda i, j, s: (s, i, j))

  kernel = functools.partial(_skinny_kernel, fmt=fmt, gate_up=gate_up, m=m, n_out=n_out, k=k,
                             block_m=block_m, block_n=block_n, block_k=block_k,
                             split_k=split_k, swap_ab=swap_ab, row_chunks=row_chunks,
                             interpret=interpret)
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_spec,
      out_shape=out_shape,
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=name,
  )(*operands)


_STATIC = ("fmt", "block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages",
           "swap_ab", "row_chunks", "out_dtype", "interpret")
_STATIC_MATMUL = _STATIC + ("keep_splits",)


@functools.partial(jax.jit, static_argnames=_STATIC_MATMUL)
def skinny_matmul(x: jax.Array, w: jax.Array, scale: jax.Array | None = None, *, fmt: str,
                  block_m: int | None = None, block_n: int = 64, block_k: int = 128,
                  split_k: int = 1, num_warps: int = 4, num_stages: int = 3,
                  swap_ab: bool = False, row_chunks: int = 1, out_dtype=jnp.float32,
                  keep_splits: bool = False, interpret: bool | None = None) -> jax.Array:
  """x [M, K] @ dequant(w [N, K])^T -> [M, N] out_dtype, float32 accumulation.

  x (bfloat16 or float32) is rounded to bfloat16 for the dot, as a bf16-weight GEMM does
  (fmt="fp32": kept float32, the dot float32-accurate).
  block_m None: next power of 2 >= M, clamped to [16, 64]. split_k > 1: K blocks are divided
  among split_k programs per output tile and the float32 partials summed afterwards, unless
  keep_splits: then the float32 partials [split_k, M, N] are returned for the consumer to sum
  (out_dtype is ignored; split_k = 1 gives [1, M, N]). swap_ab: the MMA runs on the transposed
  tile (weights as its left operand; the same products and float32 sums), the faster form for
  1-byte weights past one block of rows (`default_knobs`). row_chunks > 1: each program
  covers row_chunks x block_m rows, its weight tiles read once and multiplied block_m rows at
  a time, so each row gets a one-chunk program's arithmetic (the batch-invariant GEMM of up to
  row_chunks x block_m rows streams its weights once).
  """
  block_m = _default_block_m(x.shape[0]) if block_m is None else block_m
  _check_args("skinny_matmul", x, w, scale, fmt, block_m, block_n, block_k, split_k,
              num_warps, w.shape[0] if w.ndim == 2 else 0, row_chunks, swap_ab)
  out = _launch(_dot_input(x, fmt), w, scale, fmt=fmt, gate_up=False, block_m=block_m,
                block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                num_stages=num_stages, swap_ab=swap_ab, row_chunks=row_chunks,
                out_dtype=jnp.float32 if keep_splits else out_dtype,
                interpret=resolve_interpret(interpret), name="skinny_matmul")
  if keep_splits:
    return out if split_k > 1 else out[None]
  if split_k > 1:
    out = out.sum(axis=0).astype(out_dtype)
  return out


@functools.partial(jax.jit, static_argnames=_STATIC)
def skinny_matmul_gate_up(x: jax.Array, w_gu: jax.Array, scale: jax.Array | None = None, *,
                          fmt: str, block_m: int | None = None, block_n: int = 64,
                          block_k: int = 128, split_k: int = 1, num_warps: int = 4,
                          num_stages: int = 3, swap_ab: bool = False, row_chunks: int = 1,
                          out_dtype=jnp.float32, interpret: bool | None = None) -> jax.Array:
  """silu(x W_g^T) * (x W_u^T) -> [M, n_ff] for a fused w_gu [2 n_ff, K] (gate rows first).

  With split_k == 1 each program streams matching gate and up tiles and applies silu * up
  in its epilogue, so the [M, 2 n_ff] intermediate never reaches memory. With split_k > 1
  the summed partials are combined in jnp. Knobs and rounding as in `skinny_matmul`.
  """
  block_m = _default_block_m(x.shape[0]) if block_m is None else block_m
  kernel = "skinny_matmul_gate_up"
  check(w_gu.ndim == 2 and w_gu.shape[0] % 2 == 0, kernel, "w_gu 2-D [2 n_ff, K]", w_gu.shape)
  n_ff = w_gu.shape[0] // 2
  _check_args(kernel, x, w_gu, scale, fmt, block_m, block_n, block_k, split_k, num_warps, n_ff,
              row_chunks, swap_ab)
  xb = _dot_input(x, fmt)
  interpret = resolve_interpret(interpret)
  if split_k == 1:
    return _launch(xb, w_gu, scale, fmt=fmt, gate_up=True, block_m=block_m, block_n=block_n,
                   block_k=block_k, split_k=1, num_warps=num_warps, num_stages=num_stages,
                   swap_ab=swap_ab, row_chunks=row_chunks, out_dtype=out_dtype,
                   interpret=interpret, name=kernel)
  partials = _launch(xb, w_gu, scale, fmt=fmt, gate_up=False, block_m=block_m,
                     block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                     num_stages=num_stages, swap_ab=swap_ab, row_chunks=row_chunks,
                     out_dtype=jnp.float32, interpret=interpret, name=kernel)
  gu = partials.sum(axis=0)
  return _silu_mul(gu[:, :n_ff], gu[:, n_ff:]).astype(out_dtype)


def _dot_input(x: jax.Array, fmt: str) -> jax.Array:
  """The activation as the dot takes it: float32 for fp32 weights, else rounded to bf16."""
  return x.astype(jnp.float32 if fmt == "fp32" else jnp.bfloat16)


def _dequantize(w: jax.Array, scale: jax.Array | None, fmt: str) -> jax.Array:
  if fmt in ("bf16", "fp32"):
    return w.astype(jnp.float32)
  if fmt == "fp8":
    return w.astype(jnp.float32) * scale[:, None]
  deq = w.astype(jnp.float32) * jnp.repeat(scale, Q8_0_BLOCK, axis=1)
  return deq.astype(jnp.bfloat16).astype(jnp.float32)


def skinny_matmul_reference(x: jax.Array, w: jax.Array, scale: jax.Array | None = None, *,
                            fmt: str, out_dtype=jnp.float32) -> jax.Array:
  """Twin of `skinny_matmul`: float32 dequantized weights, x rounded to bf16 (float32 for
  fp32), HIGHEST dot."""
  xr = _dot_input(x, fmt).astype(jnp.float32)
  out = jnp.dot(xr, _dequantize(w, scale, fmt).T, precision=lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


def skinny_matmul_gate_up_reference(x: jax.Array, w_gu: jax.Array,
                                    scale: jax.Array | None = None, *, fmt: str,
                                    out_dtype=jnp.float32) -> jax.Array:
  """Twin of `skinny_matmul_gate_up`."""
  gu = skinny_matmul_reference(x, w_gu, scale, fmt=fmt)
  n_ff = w_gu.shape[0] // 2
  return _silu_mul(gu[:, :n_ff], gu[:, n_ff:]).astype(out_dtype)
