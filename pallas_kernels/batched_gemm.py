"""Batched-row GEMM of bf16 rows and bf16 or fp8 weights on Hopper tensor cores (Mosaic GPU):
y = x @ w^T for 32-256+ rows.

The skinny GEMM (skinny_gemm.py) streams the weights through CUDA-core-sized MMAs and wins up
to one block of rows; a batched round (issue 14) puts S x w rows through every GEMM, where
XLA's cuBLAS kernels stream the weights at 2.7-3.7 TB/s and leave the residual add, the
silu(gate) * up and the float32 -> bf16 rounding to separate launches (RESULTS.md run 16).
This kernel keeps the weights in their (out, in) layout, reads each weight tile once per
call (every program holds all the rows, up to 256; more run in 256-row chunks), and finishes
inside the epilogue:

  epilogue "none"      y = x @ w^T                     (float32)
  epilogue "residual"  y = r + x @ w^T                 (float32; r [M, N] float32)
  epilogue "gate_up"   y = silu(x @ g^T) * (x @ u^T)   (w = [g; u], computed in float32,
                                                        written as out_dtype)

Each program owns one block_n-wide column tile (and, with split_k > 1, one of split_k K
ranges, writing a float32 partial sum): a memory warpgroup streams the x and w tiles over K
through shared memory (TMA, max_concurrent_steps deep) while the compute warpgroups multiply
the rows on the tensor cores (wgmma, w's tile read transposed): one warpgroup for up to 64
rows, else two, each over half of the rows (padded to 64 or a multiple of 128 by the wrapper).
The epilogue leaves through shared memory in 64-column tiles. fp8 (e4m3) weights with
per-row scales run a second body (`_call_fp8`): the weight tile is widened in registers and
is wgmma's A operand, so the kernel writes y^T and XLA transposes it, adding the residual
there; its two compute warpgroups may instead take alternate K tiles for all the rows
(`wg_split="k"`), so that each weight byte is widened once. At 128 rows the x
tile is twice a 64-wide weight tile, so shared memory, not the weights, bounds the
pipeline's depth: wider column tiles with K splits (the partials summed by their consumer)
trade that for more partial traffic (`benchmarks.sweep bgemm`). GPU only (Mosaic GPU has no
interpreter): the jnp twin `batched_matmul_reference` is the contract, and the CPU tests
check the wrapper's validation, padding and split bookkeeping with the twin in the kernel
body's place.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import smem_transforms

EPILOGUES = ("none", "residual", "gate_up")
MAX_ROWS = 256      # two warpgroups x 128 accumulator rows; more rows run in chunks
ACC_FLOATS = 16384  # accumulator floats per warpgroup: 128 registers per thread
EPI_N = 64          # the epilogue's column tile
SMEM_BYTES = 232448   # the H200's shared memory per block (Mosaic GPU's limit)
# (block_k, stages), deepest first, from 4 x 128: the weights stream at the rate of the bytes
# in flight, up to 4 stages of 128-deep tiles (H200, RESULTS.md run 17: 64 and 128 rows, every
# seed matrix: 4 x 128 the best or within 1 us of it; 5 or 6 stages 1-3 us slower at 64 rows
# for down, at most 1 us faster for qkv and o). 2 x 128 last: fp8's wg_split "k" at 256 rows.
# fp8's y^T tiles share the pipeline's memory, so at 256 rows ("rows") 3 x 128 fits there
# (run 21, us, 3 x 128 / 4 x 64, the earlier default: qkv 46.4 / 51.1, down 126.5 / 143.7;
# gate_up's two weight tiles take 5 x 64: 248.7, against 249.9 at 4 x 64).
_DEPTHS = ((128, 4), (128, 3), (64, 6), (64, 5), (64, 4), (64, 3), (64, 2), (128, 2))
# How the two compute warpgroups of an fp8 program share its work (`wg_split`): up to this
# many rows for gate_up (twice as many for one accumulator's epilogues) each widens every
# other weight tile for all the rows ("k": each weight byte widened once), past it the whole
# tile for half of the rows ("rows": one call holds 256 rows, gate_up's too). H200, RESULTS.md
# run 20 (us, best depth, "rows" / "k"): 128 rows qkv 32.7 / 29.2, gate_up 164.3 / 144.2, down
# 87.9 / 77.2; 64 rows qkv 23.5 / 22.5, gate_up 113.3 / 105.9, down 65.9 / 63.5; 256 rows
# gate_up 249.2 / 288.0 (two 128-row calls); run 24, 256 rows at 3 x 128 since "k" takes
# alternate K tiles: qkv 46.9 / 45.3, o 34.9 / 34.2, down 126.3 / 123.3; gate_up 243.7 ("rows"
# at its default 5 x 64) / 271.8 (two 128-row calls, 4 x 128).
FP8_K_SPLIT_MAX_M = 128
# wg_split "k" runs its sums' hand-over in the pipeline's memory once the pipeline ends, so
# the stages may fill shared memory: from this K on (down, fc) up to 6 stages of 128-deep tiles
# pay, below it 4 stay the best (H200, RESULTS.md run 21, us, 4 / 6 stages (5 at 128 rows):
# down 58.4 / 55.1 at 32 rows, 63.8 / 62.5 at 64, 80.3 / 78.9 at 128; fc 91.9 / 86.7 at 32,
# 100.0 / 97.1 at 64; qkv 20.1 / 20.7 at 32, gate_up 107.1 / 108.4 at 64).
FP8_DEEP_K = 16384
_DEEP = ((128, 6), (128, 5))


def fp8_wg_split(m: int, epilogue: str = "none") -> str:
  """The wg_split of fp8 weights at m rows (called in chunks of at most MAX_ROWS):
  FP8_K_SPLIT_MAX_M for gate_up, twice that for the other epilogues."""
  limit = FP8_K_SPLIT_MAX_M * (1 if epilogue == "gate_up" else 2)
  return "k" if min(m, MAX_ROWS) <= limit else "rows"


WG_SPLITS = ("rows", "k")
K_SPLIT_ROWS = 32   # wg_split "k" pads rows to a multiple of this (the wgmma N of its x tile)


def max_rows(epilogue: str = "none", wg_split: str = "rows") -> int:
  """Rows one call of the kernel body takes (more run in chunks of this many): two
  warpgroups x 128 accumulator rows; with wg_split "k" each warpgroup holds every row, so
  gate_up's two accumulators take 128."""
  return 128 if wg_split == "k" and epilogue == "gate_up" else MAX_ROWS


def padded_rows(m: int, wg_split: str = "rows") -> int:
  """Rows the kernel runs for m <= max_rows: one warpgroup's 64 rows, else two warpgroups'
  multiples of 64 (wg_split "rows"); a multiple of K_SPLIT_ROWS (wg_split "k")."""
  if wg_split == "k":
    return _round_up(m, K_SPLIT_ROWS)
  return 64 if m <= 64 else _round_up(m, 128)


def warpgroups(mp: int, wg_split: str = "rows") -> int:
  """Compute warpgroups for mp padded rows: one for 64, else two over half the rows each;
  with wg_split "k" always two, taking alternate K tiles."""
  return 2 if wg_split == "k" or mp != 64 else 1


def acc_rows(mp: int, wg_split: str = "rows") -> int:
  """Rows of each compute warpgroup's accumulator."""
  return mp if wg_split == "k" else mp // warpgroups(mp)


def fits(m: int, n: int, k: int, epilogue: str, out_dtype, block_n: int, block_k: int,
         steps: int, split_k: int = 1, fmt: str = "bf16", wg_split: str = "rows") -> bool:
  """Whether these tiles run this product: whole tiles, a K split only without gate_up, fp8
  only in 64-row weight tiles (wg_split "k": fp8 only, K tiles of two 64-deep halves), the
  accumulators within the registers and the pipeline within shared memory."""
  mp = padded_rows(min(m, max_rows(epilogue, wg_split)), wg_split)
  n_acc = 2 if epilogue == "gate_up" else 1
  return (n % block_n == 0 and k % block_k == 0 and (k // block_k) % split_k == 0
          and (split_k == 1 or epilogue != "gate_up") and (fmt != "fp8" or block_n == 64)
          and (wg_split == "rows" or (fmt == "fp8" and block_k == 128))
          and acc_rows(mp, wg_split) * block_n * n_acc <= ACC_FLOATS
          and smem_bytes(m, epilogue, out_dtype, block_n, block_k, steps, fmt, wg_split)
          <= SMEM_BYTES - 2048)


def smem_bytes(m: int, epilogue: str, out_dtype, block_n: int, block_k: int, steps: int,
               fmt: str = "bf16", wg_split: str = "rows") -> int:
  """Shared memory of one program: the x and weight tiles of every pipeline stage and the
  compute warpgroups' epilogue tiles (a small margin for barriers is left to the caller).
  fp8 weights' epilogue tiles (wg_split "rows": one y^T tile per warpgroup; "k": the second
  warpgroup's float32 sums, which the y^T tile shares where it is float32, and gate_up's tile)
  share the pipeline's memory once it ends; their row scales come on top."""
  mp = padded_rows(min(m, max_rows(epilogue, wg_split)), wg_split)
  wgs = warpgroups(mp, wg_split)
  n_w = 2 if epilogue == "gate_up" else 1
  w_item = 1 if fmt == "fp8" else 2
  stage = block_k * (mp * 2 + n_w * block_n * w_item)
  out_item = jnp.dtype(out_dtype if epilogue == "gate_up" else jnp.float32).itemsize
  if fmt == "fp8":
    if wg_split == "k":   # 1 KiB covers the alignment between the sums and gate_up's tile
      out = n_w * block_n * mp * 4 + (block_n * mp * out_item + 1024 if n_w == 2 else 0)
    else:
      out = mp * block_n * out_item
    return max(stage * steps, out) + wgs * n_w * block_n * 4
  epi_n = min(block_n, EPI_N)
  return stage * steps + mp * epi_n * out_item * min(2, block_n // epi_n)


def default_knobs(m: int, n: int, k: int, epilogue: str = "none", out_dtype=jnp.float32,
                  fmt: str = "bf16") -> dict:
  """64-wide column tiles, no K split and the deepest K pipeline of `_DEPTHS` that fits
  (H200, RESULTS.md runs 16-17, at 64 and 128 rows: 32- and 48-wide tiles, which fill more
  SMs for qkv and o, and wider tiles with K splits were all slower); None when N or K fits no
  tile (the caller then uses another GEMM). fp8 weights split each program's work between
  the compute warpgroups as `fp8_wg_split` says ("k" from FP8_DEEP_K on: up to 6 stages)."""
  wg_split = fp8_wg_split(m, epilogue) if fmt == "fp8" else "rows"
  deep = _DEEP if wg_split == "k" and k >= FP8_DEEP_K else ()
  for block_k, steps in deep + _DEPTHS:
    if fits(m, n, k, epilogue, out_dtype, 64, block_k, steps, fmt=fmt, wg_split=wg_split):
      return dict(block_n=64, block_k=block_k, max_concurrent_steps=steps, split_k=1,
                  wg_split=wg_split)
  return None


def _check(x, w, scale, residual, epilogue, block_n, block_k, split_k, keep_splits, wg_split):
  if epilogue not in EPILOGUES:
    raise ValueError(f"batched_matmul: epilogue must be one of {EPILOGUES}, got {epilogue!r}")
  if wg_split not in WG_SPLITS:
    raise ValueError(f"batched_matmul: wg_split must be one of {WG_SPLITS}, got {wg_split!r}")
  if wg_split == "k" and (w.dtype != jnp.float8_e4m3fn or block_k != 128):
    raise ValueError(f"batched_matmul: wg_split 'k' (two 64-deep halves of each K tile) is for "
                     f"float8_e4m3fn weights with block_k 128, got {w.dtype}, block_k {block_k}")
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
    raise ValueError(f"batched_matmul: x [M, K] and w [N, K] expected, got x {x.shape}, "
                     f"w {w.shape}")
  if x.dtype != jnp.bfloat16 or w.dtype not in (jnp.bfloat16, jnp.float8_e4m3fn):
    raise ValueError(f"batched_matmul: bf16 x and bf16 or float8_e4m3fn w expected, got "
                     f"{x.dtype}, {w.dtype}")
  if w.dtype == jnp.float8_e4m3fn and block_n != 64:
    raise ValueError(f"batched_matmul: float8_e4m3fn weights run 64-row weight tiles (the "
                     f"wgmma register operand), block_n 64; got {block_n}")
  if (w.dtype == jnp.float8_e4m3fn) != (scale is not None):
    raise ValueError("batched_matmul: float8_e4m3fn weights take their per-row scale (and "
                     "bf16 weights none)")
  if scale is not None and (scale.shape != (w.shape[0],) or scale.dtype != jnp.float32):
    raise ValueError(f"batched_matmul: scale must be float32 [{w.shape[0]}], got "
                     f"{scale.dtype} {scale.shape}")
  m, k = x.shape
  n = w.shape[0] // 2 if epilogue == "gate_up" else w.shape[0]
  if epilogue == "gate_up" and w.shape[0] % 2:
    raise ValueError(f"batched_matmul: gate_up needs an even number of weight rows, got "
                     f"{w.shape[0]}")
  if n % block_n or k % block_k:
    raise ValueError(f"batched_matmul: N {n} and K {k} must be multiples of block_n "
                     f"{block_n} and block_k {block_k}")
  if not ((block_n % 8 == 0 and 8 <= block_n <= EPI_N)
          or (block_n % EPI_N == 0 and block_n <= 256)):
    raise ValueError(f"batched_matmul: block_n must be a multiple of 8 up to {EPI_N} or of "
                     f"{EPI_N} up to 256 (one wgmma, whole epilogue tiles), got {block_n}")
  if not isinstance(split_k, int) or split_k < 1 or (k // block_k) % split_k:
    raise ValueError(f"batched_matmul: split_k must be an int >= 1 dividing the {k // block_k} "
                     f"K tiles, got {split_k}")
  if split_k > 1 and epilogue == "gate_up":
    raise ValueError("batched_matmul: gate_up needs whole sums (split_k 1)")
  if keep_splits and epilogue != "none":
    raise ValueError("batched_matmul: keep_splits is for epilogue='none'")
  mp = padded_rows(min(m, max_rows(epilogue, wg_split)), wg_split)
  n_acc, rows = 2 if epilogue == "gate_up" else 1, acc_rows(mp, wg_split)
  if rows * block_n * n_acc > ACC_FLOATS:
    raise ValueError(f"batched_matmul: {n_acc} accumulator(s) of {rows} rows x block_n "
                     f"{block_n} exceed {ACC_FLOATS} floats per warpgroup")
  if epilogue == "residual":
    if residual is None or residual.shape != (m, n) or residual.dtype != jnp.float32:
      raise ValueError(f"batched_matmul: the residual epilogue takes a float32 [{m}, {n}] "
                       f"residual, got {None if residual is None else residual.shape}")
  elif residual is not None:
    raise ValueError("batched_matmul: a residual is only taken by epilogue='residual'")
  return m, n, k


def batched_matmul_reference(x, w, residual=None, *, scale=None, epilogue: str = "none",
                             out_dtype=jnp.float32):
  """The jnp twin: the same products accumulated in float32 (fp8 weights dequantized to bf16
  first, exact for the power-of-two row scales of `dflash_jax.quant.quantize_fp8`)."""
  if scale is not None:
    w = w.astype(jnp.float32) * scale[:, None]
  y = jnp.dot(x.astype(jnp.bfloat16), w.T.astype(jnp.bfloat16),
              preferred_element_type=jnp.float32)
  if epilogue == "gate_up":
    n = w.shape[0] // 2
    return (jax.nn.silu(y[:, :n]) * y[:, n:]).astype(out_dtype)
  if epilogue == "residual":
    y = residual + y
  return y.astype(out_dtype)


def _round_up(v: int, q: int) -> int:
  return -(-v // q) * q


def batched_matmul(x: jax.Array, w: jax.Array, residual: jax.Array | None = None, *,
                   scale: jax.Array | None = None,
                   epilogue: str = "none", out_dtype=jnp.float32, block_n: int = 64,
                   block_k: int = 128, max_concurrent_steps: int = 4, split_k: int = 1,
                   wg_split: str = "rows", keep_splits: bool = False) -> jax.Array:
  """y [M, N] = the epilogue of x [M, K] @ w [N, K]^T (module docstring). GPU only.

  split_k > 1 cuts K into that many programs per column tile, each writing a float32 partial
  sum; keep_splits returns them ([split_k, M, N], for a consumer that adds them up), else they
  are summed here in order (with the residual, for that epilogue: an XLA fusion).
  wg_split: how a program's two compute warpgroups share its work: "rows" (each over half of
  the rows) or, for fp8 weights, "k" (alternate K tiles, each over all the rows, so each
  weight tile is widened once; the two sums added in the epilogue)."""
  m, n, k = _check(x, w, scale, residual, epilogue, block_n, block_k, split_k, keep_splits,
                   wg_split)
  if epilogue != "gate_up":
    out_dtype = jnp.float32
  knobs = dict(block_n=block_n, block_k=block_k, max_concurrent_steps=max_concurrent_steps,
               split_k=split_k, wg_split=wg_split)
  chunk = max_rows(epilogue, wg_split)
  if m > chunk:
    parts = [batched_matmul(x[i:i + chunk], w,
                            None if residual is None else residual[i:i + chunk],
                            scale=scale, epilogue=epilogue, out_dtype=out_dtype,
                            keep_splits=keep_splits, **knobs)
             for i in range(0, m, chunk)]
    return jnp.concatenate(parts, axis=1 if keep_splits else 0)
  mp = padded_rows(m, wg_split)
  if mp != m:
    x = jnp.pad(x, ((0, mp - m), (0, 0)))
    if residual is not None:
      residual = jnp.pad(residual, ((0, mp - m), (0, 0)))
  if scale is not None:
    y = _call_fp8(x, w, scale, gate_up=epilogue == "gate_up", out_dtype=jnp.dtype(out_dtype),
                  n=n, block_n=block_n, block_k=block_k, steps=max_concurrent_steps,
                  split_k=split_k, wg_split=wg_split)
    # An XLA transpose (with the residual add or the split sum): the kernel writes y^T.
    y = jnp.swapaxes(y, -1, -2)[..., :m, :]
    if split_k > 1:
      if keep_splits:
        return y
      y = jnp.sum(y, axis=0)
    return y if residual is None else residual[:m] + y
  fused_residual = residual if split_k == 1 else None
  y = _call(x, w, fused_residual, epilogue=epilogue if split_k == 1 else "none",
            out_dtype=jnp.dtype(out_dtype), n=n, block_n=block_n, block_k=block_k,
            steps=max_concurrent_steps, split_k=split_k)
  if split_k > 1:
    y = y[:, :m]
    if keep_splits:
      return y
    y = jnp.sum(y, axis=0)
    return y if residual is None else residual[:m] + y
  return y[:m] if mp != m else y


class _Program(NamedTuple):
  """One program's place (`_streamed`): its column tile j, its compute warpgroup wg and that
  warpgroup's rows of the x tile (every row with wg_split "k"), the weight rows of its n_w
  tiles (gate, up), and the output (this K split's partials when split)."""
  j: Any
  wg: Any
  wg_rows: Any
  w_rows: list
  out: Any


def _streamed(program, x, w, extra, *, n, n_w, block_n, block_k, steps, split_k, out_shape,
              out_dtype, scratch, wg_split="rows", after=()):
  """What both kernel bodies share: the grid (one program per column tile and K split), the
  compute warpgroups over the x rows, and the K pipeline in which a memory warpgroup streams
  the x tile [M, block_k] and the n_w weight tiles [block_n, block_k] of the program's
  columns (wg_split "k": each tile as two 64-deep halves, x's halves first, then each weight
  tile's, 64 bf16 being one swizzled wgmma operand tile). program(p, rows, refs) ->
  (body, compute_context) of the pipeline, given the `_Program` p, the rows per warpgroup
  and the refs of `extra`'s inputs, `scratch`, then `after`: shared-memory tiles that share
  the pipeline's tiles' memory (a `RefUnion`), for the compute context to use once every
  compute warpgroup's pipeline has ended."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  m, k = x.shape
  wgs = warpgroups(m, wg_split)      # compute warpgroups, each over `rows` of the x tile
  rows = acc_rows(m, wg_split)
  k_steps = k // block_k // split_k  # per program
  k_len = k_steps * block_k
  parts = 2 if wg_split == "k" else 1
  part = block_k // parts
  in_t = smem_transforms(part, jnp.bfloat16)
  w_t = smem_transforms(part, w.dtype)

  def kernel(x_gmem, w_gmem, *refs):
    extra_refs, (out_gmem, *scratch_refs) = refs[:len(extra)], refs[len(extra):]
    j = lax.axis_index("n")
    ks = pl.ds(lax.axis_index("k") * k_len, k_len)
    if split_k > 1:
      out_gmem = out_gmem.at[lax.axis_index("k")]
    wg = lax.axis_index("wg")
    wg_rows = pl.ds(0, rows) if wg_split == "k" else pl.ds(wg * rows, rows)
    w_rows = [pl.ds(i * n + j * block_n, block_n) for i in range(n_w)]
    p = _Program(j, wg, wg_rows, w_rows, out_gmem)
    spec = lambda r, h, t: plgpu.BlockSpec((r, part), lambda kk: (0, kk * parts + h),
                                           transforms=t)
    pipeline = lambda body, compute_context: plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_steps,), memory_registers=40,
        in_specs=[spec(m, h, in_t) for h in range(parts)]
        + [spec(block_n, h, w_t) for _ in range(n_w) for h in range(parts)],
        wg_axis="wg", num_compute_wgs=wgs, max_concurrent_steps=steps,
        compute_context=compute_context)
    gmem = (*[x_gmem.at[:, ks]] * parts, *[w_gmem.at[r, ks] for r in w_rows for _ in range(parts)])
    if not after:
      pipeline(*program(p, rows, (*extra_refs, *scratch_refs)))(*gmem)
      return
    ignore = lambda *_, **__: None
    allocs = pipeline(ignore, ignore).get_allocations(*gmem)
    tiles = allocs.pop("flat_in_smem_refs")

    def scoped(union, rest):
      tile_refs, after_refs = union
      pipeline(*program(p, rows, (*extra_refs, *scratch_refs, *after_refs)))(
          *gmem, allocations=dict(flat_in_smem_refs=tile_refs, **rest))

    pl.run_scoped(scoped, plgpu.RefUnion(tiles, tuple(after)), allocs, collective_axes="wg")

  # One program per column tile (and K split), although one program fills an SM and gate_up's
  # 312 tiles make 2.36 waves: stream-K ranges that keep all 132 SMs busy took fp8 gate_up at
  # 32 rows from 89.4 to 85.3 us, and adding up the cut tiles' partials cost more than that
  # (H200, RESULTS.md run 22).
  f = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
      grid=(n // block_n, split_k), grid_names=("n", "k"), num_threads=wgs + 1,
      thread_name="wg", scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return f(x, w, *extra)


def _silu_gate(vals, gate_up: bool, out_dtype):
  """silu(gate) * up of the gate and up accumulators' values (gate_up), else the one value."""
  if not gate_up:
    return vals[0]
  g, u = vals
  return (g * (1.0 / (1.0 + jnp.exp(-g))) * u).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("epilogue", "out_dtype", "n", "block_n", "block_k",
                                             "steps", "split_k"))
def _call(x, w, residual, *, epilogue, out_dtype, n, block_n, block_k, steps, split_k):
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  m = x.shape[0]
  wgs = warpgroups(m)
  gate_up = epilogue == "gate_up"
  n_w = 2 if gate_up else 1           # weight tiles per stage (gate and up)
  epi_n = min(block_n, EPI_N)
  n_epi = block_n // epi_n
  n_slots = min(2, n_epi)

  def program(p, rows, refs):
    if epilogue == "residual":
      r_gmem, out_smem, r_barrier = refs
    else:
      (out_smem,), r_gmem = refs, None

    def compute_context(run_pipeline):
      def scope(*accs):
        accs = run_pipeline(accs)
        y = _silu_gate([acc[...] for acc in accs], gate_up, out_dtype)
        # Out through shared memory in EPI_N-wide column tiles, two slots in turn, so that
        # a wide block_n's epilogue does not take the pipeline's shared memory.
        for c in range(n_epi):
          slot, sub = c % 2, pl.ds(p.j * block_n + c * epi_n, epi_n)
          yc = y if n_epi == 1 else y[:, c * epi_n:(c + 1) * epi_n]
          if c >= 2:   # the slot's previous copy out must have read it
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
          if r_gmem is not None:
            bar = r_barrier.at[p.wg * n_slots + slot]
            plgpu.copy_gmem_to_smem(r_gmem.at[p.wg_rows, sub], out_smem.at[p.wg, slot], bar)
            plgpu.barrier_wait(bar)
            out_smem[p.wg, slot] += yc
          else:
            out_smem[p.wg, slot] = yc
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(out_smem.at[p.wg, slot], p.out.at[p.wg_rows, sub])
        plgpu.wait_smem_to_gmem(0)

      pl.run_scoped(scope, *[plgpu.ACC((rows, block_n), jnp.float32)] * n_w)

    def body(_, x_smem, *w_and_carry):
      *w_smems, accs = w_and_carry
      for acc, w_smem in zip(accs, w_smems):
        plgpu.wgmma(acc, x_smem.at[p.wg_rows], w_smem.transpose((1, 0)))
      plgpu.wgmma_wait(0)
      return accs

    return body, compute_context

  scratch = [plgpu.SMEM((wgs, n_slots, m // wgs, epi_n), out_dtype,
                        transforms=smem_transforms(epi_n, out_dtype))]
  if epilogue == "residual":
    scratch.append(plgpu.Barrier(num_barriers=wgs * n_slots))
  return _streamed(program, x, w, () if residual is None else (residual,), n=n, n_w=n_w,
                   block_n=block_n, block_k=block_k, steps=steps, split_k=split_k,
                   out_shape=(split_k, m, n) if split_k > 1 else (m, n), out_dtype=out_dtype,
                   scratch=scratch)


@functools.partial(jax.jit, static_argnames=("gate_up", "out_dtype", "n", "block_n", "block_k",
                                             "steps", "split_k", "wg_split"))
def _call_fp8(x, w, scale, *, gate_up, out_dtype, n, block_n, block_k, steps, split_k,
              wg_split="rows"):
  """fp8 weights, the product transposed: y^T [N, M] (or [split_k, N, M] partials). Each
  compute warpgroup loads its e4m3 weight tile (wg_split "rows": the stage's whole
  [block_n, block_k] tile, against its half of the rows; "k": every other K tile whole,
  against all the rows) into registers, widens it to bf16 there and runs wgmma with it as the
  register A operand against the x tile (B from shared memory, read transposed): the tile
  never goes back to shared memory. "k"'s warpgroups taking alternate K tiles lets one widen
  while the other's wgmma runs: splitting each stage's tile into two 64-deep halves, one per
  warpgroup, kept them in lock-step and was 1-6% slower (H200, RESULTS.md run 23, us, halves /
  alternate at the default depths: down 54.5 / 52.4 at 32 rows, 61.4 / 58.1 at 64, 78.2 / 74.2
  at 128 (5 stages); gate_up 139.6 / 137.0 at 128; qkv 29.4 / 28.5 and o 20.8 / 20.0 at 128,
  o 14.1 / 13.1 at 32; within 1% elsewhere). Three compute warpgroups over every third tile
  (152 registers each, the library's share for three) were 2-10% slower than two, and four
  cannot start: the library asks more registers for them than the block's pool holds
  (run 23). With "k" the second warpgroup hands its float32 sums to
  the first through shared memory (an mbarrier orders them) and the first finishes alone,
  writing a float32 y^T over the handed-over sums (each thread rewrites the elements it read);
  the sums and gate_up's y^T tile use the pipeline's memory. With "rows" each warpgroup's y^T
  tile is in the pipeline's memory too. Every compute warpgroup arrives on one barrier when
  its pipeline (the last reader of those tiles) has ended, and whoever writes there first
  waits for it.
  The row scales apply to the accumulator's rows."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  m = x.shape[0]
  wgs = warpgroups(m, wg_split)
  rows = acc_rows(m, wg_split)
  n_w = 2 if gate_up else 1
  parts = 2 if wg_split == "k" else 1

  def widen(w_smem):
    # No direct e4m3 -> bf16 convert on this ptxas; e4m3 -> f16 -> f32 -> bf16 is exact
    # (every e4m3 value is an f16 and a bf16).
    return w_smem[...].astype(jnp.float16).astype(jnp.float32).astype(jnp.bfloat16)

  def program(p, rows, refs):
    s_gmem, s_smem, s_barrier, *tiles = refs

    def finish(vals, out):
      """Scale, epilogue, y^T out through the shared-memory tile `out`; vals: one
      [block_n, rows] float32 value per weight tile."""
      for i in range(n_w):
        plgpu.barrier_wait(s_barrier.at[p.wg * n_w + i])
      vals = [v * lax.broadcast_in_dim(s_smem[p.wg, i], (block_n, rows), [0])
              for i, v in enumerate(vals)]
      out[...] = _silu_gate(vals, gate_up, out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out, p.out.at[pl.ds(p.j * block_n, block_n), p.wg_rows])
      plgpu.wait_smem_to_gmem(0)

    def compute_context(run_pipeline):
      def load_scales():   # they arrive while the pipeline runs
        for i in range(n_w):
          plgpu.copy_gmem_to_smem(s_gmem.at[p.w_rows[i]], s_smem.at[p.wg, i],
                                  s_barrier.at[p.wg * n_w + i])

      def scope(*accs):
        ended, *after = tiles
        if parts == 1:
          load_scales()
        else:
          pl.when(p.wg == 0)(load_scales)   # only the first warpgroup finishes
        accs = run_pipeline(accs)
        plgpu.barrier_arrive(ended)   # the after-tiles may take the pipeline's memory
        if parts == 1:
          plgpu.barrier_wait(ended)
          finish([acc[...] for acc in accs], after[0].at[p.wg])
          return
        sums_barrier, sums, *gate_up_out = after

        @pl.when(p.wg == 1)
        def _():
          plgpu.barrier_wait(ended)   # both pipelines have ended: their memory is free
          for i, acc in enumerate(accs):
            sums[i] = acc[...]
          plgpu.barrier_arrive(sums_barrier)

        @pl.when(p.wg == 0)
        def _():
          plgpu.barrier_wait(sums_barrier)
          finish([acc[...] + sums[i] for i, acc in enumerate(accs)],
                 gate_up_out[0] if gate_up else sums.at[0])

      pl.run_scoped(scope, *[plgpu.ACC((block_n, rows), jnp.float32)] * n_w)

    def body(idx, *refs):
      x_smems, w_smems, accs = refs[:parts], refs[parts:-1], refs[-1]
      if parts == 1:
        for acc, w_smem in zip(accs, w_smems):
          plgpu.wgmma(acc, widen(w_smem), x_smems[0].at[p.wg_rows].transpose((1, 0)))
      else:
        @pl.when(p.wg == idx[0] % wgs)
        def _():
          for h in range(parts):
            for i, acc in enumerate(accs):
              plgpu.wgmma(acc, widen(w_smems[i * parts + h]), x_smems[h].transpose((1, 0)))
      plgpu.wgmma_wait(0)
      return accs

    return body, compute_context

  # Every pipeline's end (wgs arrivals) frees the tiles' memory for the after-tiles.
  scratch = [plgpu.SMEM((wgs, n_w, block_n), jnp.float32), plgpu.Barrier(num_barriers=wgs * n_w),
             plgpu.Barrier(num_arrivals=wgs, num_barriers=1)]
  if parts == 1:   # one y^T tile per warpgroup
    after = [plgpu.SMEM((wgs, block_n, rows), out_dtype,
                        transforms=smem_transforms(rows, out_dtype))]
  else:   # the hand-over's barrier; the second warpgroup's sums (float32 y^T), gate_up's y^T
    scratch.append(plgpu.Barrier(num_arrivals=1, num_barriers=1))
    after = [plgpu.SMEM((n_w, block_n, rows), jnp.float32,
                        transforms=smem_transforms(rows, jnp.float32))]
    if gate_up:
      after.append(plgpu.SMEM((block_n, rows), out_dtype,
                              transforms=smem_transforms(rows, out_dtype)))
  return _streamed(program, x, w, (scale,), n=n, n_w=n_w, block_n=block_n, block_k=block_k,
                   steps=steps, split_k=split_k,
                   out_shape=(split_k, n, m) if split_k > 1 else (n, m), out_dtype=out_dtype,
                   scratch=scratch, wg_split=wg_split, after=after)
