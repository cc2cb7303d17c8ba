"""Batched-row GEMM of bf16 rows and bf16 or fp8 weights on Hopper tensor cores (Mosaic GPU):
y = x @ w^T for 32-256+ rows.

The skinny GEMM (skinny_gemm.py) streams the weights through CUDA-core-sized MMAs and wins up
to one block of rows; a batched round (issue 14) puts S x w rows through every GEMM, where
XLA's cuBLAS kernels stream the weights slower and leave the residual add, the silu(gate) * up
and the float32 -> bf16 rounding to separate launches. This kernel keeps the weights in their
(out, in) layout, reads each weight tile once per call (every program holds all the rows, up
to 256; more run in 256-row chunks), and finishes inside the epilogue:

  epilogue "none"      y = x @ w^T                     (float32)
  epilogue "residual"  y = r + x @ w^T                 (float32; r [M, N] float32)
  epilogue "gate_up"   y = silu(x @ g^T) * (x @ u^T)   (w = [g; u], computed in float32,
                                                        written as out_dtype)

Each program owns one BLOCK_N-wide column tile: a memory warpgroup streams the x and w tiles
over K through shared memory (TMA, max_concurrent_steps deep) while the compute warpgroups
multiply the rows on the tensor cores (wgmma, w's tile read transposed): one warpgroup for up
to 64 rows, else two, each over half of the rows (padded to 64 or a multiple of 128 by the
wrapper). The epilogue leaves through shared memory. fp8 (e4m3) weights with per-row scales
run a second body (`_call_fp8`): the weight tile is widened in registers and is wgmma's A
operand, so the kernel writes y^T and XLA transposes it, adding the residual there; its two
compute warpgroups may instead take alternate K tiles for all the rows (`wg_split="k"`), so
that each weight byte is widened once. Runs on Hopper GPUs; the jnp twin
`batched_matmul_reference` is the contract. On the CPU the bf16 body runs in Mosaic GPU's
interpret mode (tests/test_kernels_mgpu_interpret.py); the fp8 body's register A operand is
beyond jax 0.11.2's interpreter, so the CPU tests check its wrapper with the twin in the
kernel body's place.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import KnobsBase, smem_transforms

EPILOGUES = ("none", "residual", "gate_up")
MAX_ROWS = 256      # two warpgroups x 128 accumulator rows; more rows run in chunks
ACC_FLOATS = 16384  # accumulator floats per warpgroup: 128 registers per thread
BLOCK_N = 64        # the column tile: one wgmma N (bf16) or one register A operand (fp8)
SMEM_BYTES = 232448   # the H200's shared memory per block (Mosaic GPU's limit)
# (block_k, stages), deepest first, from 4 x 128: the weights stream at the rate of the bytes
# in flight, up to 4 stages of 128-deep tiles (every seed matrix at 64 and 128 rows: 4 x 128
# the best or within a microsecond of it; 5 or 6 stages no faster). 2 x 128 last: fp8's
# wg_split "k" at 256 rows. fp8's y^T tiles share the pipeline's memory, so at 256 rows
# ("rows") 3 x 128 fits there (faster than 4 x 64; gate_up's two weight tiles take 5 x 64).
# benchmarks/RESULTS.md, "New kernel pallas_kernels/batched_gemm.py" and the fp8 entries after.
_DEPTHS = ((128, 4), (128, 3), (64, 6), (64, 5), (64, 4), (64, 3), (64, 2), (128, 2))
# wg_split "k" runs its sums' hand-over in the pipeline's memory once the pipeline ends, so
# the stages may fill shared memory: from the caller's deep_k on (down, fc) up to 6 stages of
# 128-deep tiles.
_DEEP = ((128, 6), (128, 5))
WG_SPLITS = ("rows", "k")
K_SPLIT_ROWS = 32   # wg_split "k" pads rows to a multiple of this (the wgmma N of its x tile)


@dataclasses.dataclass(frozen=True)
class Knobs(KnobsBase):
  """The launch knobs of `batched_matmul` (its keyword arguments)."""
  block_k: int = 128
  max_concurrent_steps: int = 4
  wg_split: str = "rows"


def fp8_wg_split(m: int, epilogue: str = "none", *, k_split_max_m: int) -> str:
  """How the two compute warpgroups of an fp8 program share its work at m rows (called in
  chunks of at most MAX_ROWS): up to k_split_max_m rows for gate_up (twice as many for one
  accumulator's epilogues) each widens every other weight tile for all the rows ("k": each
  weight byte widened once), past it the whole tile for half of the rows ("rows": one call
  holds 256 rows, gate_up's too)."""
  limit = k_split_max_m * (1 if epilogue == "gate_up" else 2)
  return "k" if min(m, MAX_ROWS) <= limit else "rows"


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


def fits(m: int, n: int, k: int, epilogue: str, out_dtype, block_k: int, steps: int,
         fmt: str = "bf16", wg_split: str = "rows") -> bool:
  """Whether these tiles run this product: whole tiles (wg_split "k": fp8 only, K tiles of
  two 64-deep halves), the accumulators within the registers and the pipeline within shared
  memory."""
  mp = padded_rows(min(m, max_rows(epilogue, wg_split)), wg_split)
  n_acc = 2 if epilogue == "gate_up" else 1
  return (n % BLOCK_N == 0 and k % block_k == 0
          and (wg_split == "rows" or (fmt == "fp8" and block_k == 128))
          and acc_rows(mp, wg_split) * BLOCK_N * n_acc <= ACC_FLOATS
          and smem_bytes(m, epilogue, out_dtype, block_k, steps, fmt, wg_split)
          <= SMEM_BYTES - 2048)


def smem_bytes(m: int, epilogue: str, out_dtype, block_k: int, steps: int,
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
  stage = block_k * (mp * 2 + n_w * BLOCK_N * w_item)
  out_item = jnp.dtype(out_dtype if epilogue == "gate_up" else jnp.float32).itemsize
  if fmt == "fp8":
    if wg_split == "k":   # 1 KiB covers the alignment between the sums and gate_up's tile
      out = n_w * BLOCK_N * mp * 4 + (BLOCK_N * mp * out_item + 1024 if n_w == 2 else 0)
    else:
      out = mp * BLOCK_N * out_item
    return max(stage * steps, out) + wgs * n_w * BLOCK_N * 4
  return stage * steps + mp * BLOCK_N * out_item


def default_knobs(m: int, n: int, k: int, epilogue: str = "none", out_dtype=jnp.float32,
                  fmt: str = "bf16", *, deep_k: int, k_split_max_m: int) -> Knobs | None:
  """The deepest K pipeline of `_DEPTHS` that fits (narrower column tiles and K splits were
  slower: benchmarks/RESULTS.md, "New kernel pallas_kernels/batched_gemm.py"); None when N or
  K fits no tile (the caller then uses another GEMM). fp8 weights split each program's work
  between the compute warpgroups as `fp8_wg_split(m, epilogue, k_split_max_m=...)` says, and
  wg_split "k" takes up to 6 stages from K = deep_k on."""
  wg_split = fp8_wg_split(m, epilogue, k_split_max_m=k_split_max_m) if fmt == "fp8" else "rows"
  deep = _DEEP if wg_split == "k" and k >= deep_k else ()
  for block_k, steps in deep + _DEPTHS:
    if fits(m, n, k, epilogue, out_dtype, block_k, steps, fmt=fmt, wg_split=wg_split):
      return Knobs(block_k=block_k, max_concurrent_steps=steps, wg_split=wg_split)
  return None


def _check(x, w, scale, residual, epilogue, block_k, wg_split):
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
  if n % BLOCK_N or k % block_k:
    raise ValueError(f"batched_matmul: N {n} and K {k} must be multiples of the column tile "
                     f"{BLOCK_N} and block_k {block_k}")
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
                   scale: jax.Array | None = None, epilogue: str = "none",
                   out_dtype=jnp.float32, block_k: int = 128, max_concurrent_steps: int = 4,
                   wg_split: str = "rows") -> jax.Array:
  """y [M, N] = the epilogue of x [M, K] @ w [N, K]^T (module docstring). GPU only.

  wg_split: how a program's two compute warpgroups share its work: "rows" (each over half of
  the rows) or, for fp8 weights, "k" (alternate K tiles, each over all the rows, so each
  weight tile is widened once; the two sums added in the epilogue)."""
  m, n, k = _check(x, w, scale, residual, epilogue, block_k, wg_split)
  if epilogue != "gate_up":
    out_dtype = jnp.float32
  knobs = dict(block_k=block_k, max_concurrent_steps=max_concurrent_steps, wg_split=wg_split)
  chunk = max_rows(epilogue, wg_split)
  if m > chunk:
    parts = [batched_matmul(x[i:i + chunk], w,
                            None if residual is None else residual[i:i + chunk],
                            scale=scale, epilogue=epilogue, out_dtype=out_dtype, **knobs)
             for i in range(0, m, chunk)]
    return jnp.concatenate(parts, axis=0)
  mp = padded_rows(m, wg_split)
  if mp != m:
    x = jnp.pad(x, ((0, mp - m), (0, 0)))
    if residual is not None:
      residual = jnp.pad(residual, ((0, mp - m), (0, 0)))
  if scale is not None:
    y = _call_fp8(x, w, scale, gate_up=epilogue == "gate_up", out_dtype=jnp.dtype(out_dtype),
                  n=n, block_k=block_k, steps=max_concurrent_steps, wg_split=wg_split)
    # An XLA transpose (with the residual add): the kernel writes y^T.
    y = jnp.swapaxes(y, -1, -2)[..., :m, :]
    return y if residual is None else residual[:m] + y
  y = _call(x, w, residual, epilogue=epilogue, out_dtype=jnp.dtype(out_dtype), n=n,
            block_k=block_k, steps=max_concurrent_steps)
  return y[:m] if mp != m else y


class _Program(NamedTuple):
  """One program's place (`_streamed`): its column tile j, its compute warpgroup wg and that
  warpgroup's rows of the x tile (every row with wg_split "k"), the weight rows of its n_w
  tiles (gate, up), and the output."""
  j: Any
  wg: Any
  wg_rows: Any
  w_rows: list
  out: Any


def _streamed(program, x, w, extra, *, n, n_w, block_k, steps, out_shape, out_dtype, scratch,
              wg_split="rows", after=()):
  """What both kernel bodies share: the grid (one program per column tile), the compute
  warpgroups over the x rows, and the K pipeline in which a memory warpgroup streams
  the x tile [M, block_k] and the n_w weight tiles [BLOCK_N, block_k] of the program's
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
  k_steps = k // block_k
  parts = 2 if wg_split == "k" else 1
  part = block_k // parts
  in_t = smem_transforms(part, jnp.bfloat16)
  w_t = smem_transforms(part, w.dtype)

  def kernel(x_gmem, w_gmem, *refs):
    extra_refs, (out_gmem, *scratch_refs) = refs[:len(extra)], refs[len(extra):]
    j = lax.axis_index("n")
    wg = lax.axis_index("wg")
    wg_rows = pl.ds(0, rows) if wg_split == "k" else pl.ds(wg * rows, rows)
    w_rows = [pl.ds(i * n + j * BLOCK_N, BLOCK_N) for i in range(n_w)]
    p = _Program(j, wg, wg_rows, w_rows, out_gmem)
    spec = lambda r, h, t: plgpu.BlockSpec((r, part), lambda kk: (0, kk * parts + h),
                                           transforms=t)
    pipeline = lambda body, compute_context: plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_steps,), memory_registers=40,
        in_specs=[spec(m, h, in_t) for h in range(parts)]
        + [spec(BLOCK_N, h, w_t) for _ in range(n_w) for h in range(parts)],
        wg_axis="wg", num_compute_wgs=wgs, max_concurrent_steps=steps,
        compute_context=compute_context)
    gmem = (*[x_gmem] * parts, *[w_gmem.at[r] for r in w_rows for _ in range(parts)])
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

  # One program per column tile, although one program fills an SM and gate_up's 312 tiles
  # make 2.36 waves: stream-K ranges that keep all 132 SMs busy made fp8 gate_up's kernel
  # faster, and adding up the cut tiles' partials cost more than that (benchmarks/RESULTS.md,
  # "Stream-K for the fp8 "k" GEMM, measured and not kept").
  f = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
      grid=(n // BLOCK_N,), grid_names=("n",), num_threads=wgs + 1,
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


@functools.partial(jax.jit, static_argnames=("epilogue", "out_dtype", "n", "block_k", "steps"))
def _call(x, w, residual, *, epilogue, out_dtype, n, block_k, steps):
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  m = x.shape[0]
  wgs = warpgroups(m)
  gate_up = epilogue == "gate_up"
  n_w = 2 if gate_up else 1           # weight tiles per stage (gate and up)

  def program(p, rows, refs):
    if epilogue == "residual":
      r_gmem, out_smem, r_barrier = refs
    else:
      (out_smem,), r_gmem = refs, None

    def compute_context(run_pipeline):
      def scope(*accs):
        accs = run_pipeline(accs)
        y = _silu_gate([acc[...] for acc in accs], gate_up, out_dtype)
        cols = pl.ds(p.j * BLOCK_N, BLOCK_N)
        if r_gmem is not None:
          bar = r_barrier.at[p.wg]
          plgpu.copy_gmem_to_smem(r_gmem.at[p.wg_rows, cols], out_smem.at[p.wg], bar)
          plgpu.barrier_wait(bar)
          out_smem[p.wg] += y
        else:
          out_smem[p.wg] = y
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[p.wg], p.out.at[p.wg_rows, cols])
        plgpu.wait_smem_to_gmem(0)

      pl.run_scoped(scope, *[plgpu.ACC((rows, BLOCK_N), jnp.float32)] * n_w)

    def body(_, x_smem, *w_and_carry):
      *w_smems, accs = w_and_carry
      for acc, w_smem in zip(accs, w_smems):
        plgpu.wgmma(acc, x_smem.at[p.wg_rows], w_smem.transpose((1, 0)))
      plgpu.wgmma_wait(0)
      return accs

    return body, compute_context

  scratch = [plgpu.SMEM((wgs, m // wgs, BLOCK_N), out_dtype,
                        transforms=smem_transforms(BLOCK_N, out_dtype))]
  if epilogue == "residual":
    scratch.append(plgpu.Barrier(num_barriers=wgs))
  return _streamed(program, x, w, () if residual is None else (residual,), n=n, n_w=n_w,
                   block_k=block_k, steps=steps, out_shape=(m, n), out_dtype=out_dtype,
                   scratch=scratch)


@functools.partial(jax.jit, static_argnames=("gate_up", "out_dtype", "n", "block_k", "steps",
                                             "wg_split"))
def _call_fp8(x, w, scale, *, gate_up, out_dtype, n, block_k, steps, wg_split="rows"):
  """fp8 weights, the product transposed: y^T [N, M]. Each compute warpgroup loads its e4m3
  weight tile (wg_split "rows": the stage's whole [BLOCK_N, block_k] tile, against its half of
  the rows; "k": every other K tile whole, against all the rows) into registers, widens it to
  bf16 there and runs wgmma with it as the register A operand against the x tile (B from
  shared memory, read transposed): the tile never goes back to shared memory. "k"'s
  warpgroups taking alternate K tiles lets one widen while the other's wgmma runs: splitting
  each stage's tile into two 64-deep halves, one per warpgroup, kept them in lock-step and was
  slower; three compute warpgroups over every third tile were slower than two, and four cannot
  start (the library asks more registers for them than the block's pool holds; RESULTS.md,
  "wg_split "k" with alternate K tiles" and "Three compute warpgroups, every third K tile").
  With "k" the second warpgroup hands its float32 sums to the first through shared memory (an
  mbarrier orders them) and the first finishes alone, writing a float32 y^T over the
  handed-over sums (each thread rewrites the elements it read); the sums and gate_up's y^T
  tile use the pipeline's memory. With "rows" each warpgroup's y^T tile is in the pipeline's
  memory too. Every compute warpgroup arrives on one barrier when its pipeline (the last
  reader of those tiles) has ended, and whoever writes there first waits for it.
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
      [BLOCK_N, rows] float32 value per weight tile."""
      for i in range(n_w):
        plgpu.barrier_wait(s_barrier.at[p.wg * n_w + i])
      vals = [v * lax.broadcast_in_dim(s_smem[p.wg, i], (BLOCK_N, rows), [0])
              for i, v in enumerate(vals)]
      out[...] = _silu_gate(vals, gate_up, out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out, p.out.at[pl.ds(p.j * BLOCK_N, BLOCK_N), p.wg_rows])
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

      pl.run_scoped(scope, *[plgpu.ACC((BLOCK_N, rows), jnp.float32)] * n_w)

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
  scratch = [plgpu.SMEM((wgs, n_w, BLOCK_N), jnp.float32), plgpu.Barrier(num_barriers=wgs * n_w),
             plgpu.Barrier(num_arrivals=wgs, num_barriers=1)]
  if parts == 1:   # one y^T tile per warpgroup
    after = [plgpu.SMEM((wgs, BLOCK_N, rows), out_dtype,
                        transforms=smem_transforms(rows, out_dtype))]
  else:   # the hand-over's barrier; the second warpgroup's sums (float32 y^T), gate_up's y^T
    scratch.append(plgpu.Barrier(num_arrivals=1, num_barriers=1))
    after = [plgpu.SMEM((n_w, BLOCK_N, rows), jnp.float32,
                        transforms=smem_transforms(rows, jnp.float32))]
    if gate_up:
      after.append(plgpu.SMEM((BLOCK_N, rows), out_dtype,
                              transforms=smem_transforms(rows, out_dtype)))
  return _streamed(program, x, w, (scale,), n=n, n_w=n_w, block_k=block_k, steps=steps,
                   out_shape=(n, m), out_dtype=out_dtype,
                   scratch=scratch, wg_split=wg_split, after=after)
