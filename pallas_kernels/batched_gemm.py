"""Batched-row bf16 GEMM on Hopper tensor cores (Mosaic GPU): y = x @ w^T for 65-256+ rows.

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

Each program owns one block_n-wide column tile: a memory warpgroup streams the x and w tiles
over K through shared memory (TMA, max_concurrent_steps deep) while two compute warpgroups
each multiply half of the rows on the tensor cores (wgmma, w's tile read transposed). Rows are
padded to a multiple of 128 by the wrapper. GPU only (Mosaic GPU has no interpreter): the jnp
twin `batched_matmul_reference` is the contract, and the CPU tests check the wrapper's
validation and padding on the twin.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

EPILOGUES = ("none", "residual", "gate_up")
MAX_ROWS = 256      # two warpgroups x 128 accumulator rows; more rows re-tile over M
ROW_QUANTUM = 128   # two warpgroups x one 64-row wgmma


SMEM_BYTES = 232448   # the H200's shared memory per block (Mosaic GPU's limit)
# (block_k, stages) in the order measured best (RESULTS.md run 16): the weights stream at the
# rate of the bytes in flight, so the deepest pipeline that fits wins.
_DEPTHS = ((128, 4), (128, 3), (64, 6), (64, 5), (64, 4), (64, 3), (64, 2))


def smem_bytes(m: int, epilogue: str, out_dtype, block_n: int, block_k: int, steps: int) -> int:
  """Shared memory of one program: the x and weight tiles of every pipeline stage plus the
  two warpgroups' epilogue tiles (a small margin for barriers is left to the caller)."""
  mp = _round_up(min(m, MAX_ROWS), ROW_QUANTUM)
  n_w = 2 if epilogue == "gate_up" else 1
  stage = block_k * (mp + n_w * block_n) * 2
  out_item = jnp.dtype(out_dtype if epilogue == "gate_up" else jnp.float32).itemsize
  return stage * steps + mp * block_n * out_item


def default_knobs(m: int, n: int, k: int, epilogue: str = "none", out_dtype=jnp.float32) -> dict:
  """64-wide column tiles and the deepest K pipeline that fits (H200, RESULTS.md run 16);
  None when N or K fits no tile (the caller then uses another GEMM)."""
  block_n = 64
  if n % block_n:
    return None
  for block_k, steps in _DEPTHS:
    if k % block_k == 0 and smem_bytes(m, epilogue, out_dtype, block_n, block_k,
                                       steps) <= SMEM_BYTES - 2048:
      return dict(block_n=block_n, block_k=block_k, max_concurrent_steps=steps)
  return None


def available() -> bool:
  """The kernel needs Mosaic GPU on a Hopper-class GPU (wgmma, TMA)."""
  if jax.default_backend() != "gpu":
    return False
  cc = getattr(jax.devices()[0], "compute_capability", "0")
  return float(cc) >= 9.0


def _check(x, w, residual, epilogue, block_n, block_k):
  if epilogue not in EPILOGUES:
    raise ValueError(f"batched_matmul: epilogue must be one of {EPILOGUES}, got {epilogue!r}")
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
    raise ValueError(f"batched_matmul: x [M, K] and w [N, K] expected, got x {x.shape}, "
                     f"w {w.shape}")
  if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
    raise ValueError(f"batched_matmul: bf16 x and w expected, got {x.dtype}, {w.dtype}")
  m, k = x.shape
  n = w.shape[0] // 2 if epilogue == "gate_up" else w.shape[0]
  if epilogue == "gate_up" and w.shape[0] % 2:
    raise ValueError(f"batched_matmul: gate_up needs an even number of weight rows, got "
                     f"{w.shape[0]}")
  if n % block_n or k % block_k:
    raise ValueError(f"batched_matmul: N {n} and K {k} must be multiples of block_n "
                     f"{block_n} and block_k {block_k}")
  if epilogue == "residual":
    if residual is None or residual.shape != (m, n) or residual.dtype != jnp.float32:
      raise ValueError(f"batched_matmul: the residual epilogue takes a float32 [{m}, {n}] "
                       f"residual, got {None if residual is None else residual.shape}")
  elif residual is not None:
    raise ValueError("batched_matmul: a residual is only taken by epilogue='residual'")
  return m, n, k


def batched_matmul_reference(x, w, residual=None, *, epilogue: str = "none",
                             out_dtype=jnp.float32):
  """The jnp twin: the same products accumulated in float32."""
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
                   epilogue: str = "none", out_dtype=jnp.float32, block_n: int = 64,
                   block_k: int = 64, max_concurrent_steps: int = 6,
                   cluster: int = 1) -> jax.Array:
  """y [M, N] = the epilogue of x [M, K] @ w [N, K]^T (module docstring). GPU only."""
  m, n, k = _check(x, w, residual, epilogue, block_n, block_k)
  if epilogue != "gate_up":
    out_dtype = jnp.float32
  if m > MAX_ROWS:
    parts = [batched_matmul(x[i:i + MAX_ROWS], w,
                            None if residual is None else residual[i:i + MAX_ROWS],
                            epilogue=epilogue, out_dtype=out_dtype, block_n=block_n,
                            block_k=block_k, max_concurrent_steps=max_concurrent_steps,
                            cluster=cluster)
             for i in range(0, m, MAX_ROWS)]
    return jnp.concatenate(parts, axis=0)
  mp = _round_up(m, ROW_QUANTUM)
  if mp != m:
    x = jnp.pad(x, ((0, mp - m), (0, 0)))
    if residual is not None:
      residual = jnp.pad(residual, ((0, mp - m), (0, 0)))
  y = _call(x, w, residual, epilogue=epilogue, out_dtype=jnp.dtype(out_dtype), n=n,
            block_n=block_n, block_k=block_k, steps=max_concurrent_steps, cluster=cluster)
  return y[:m] if mp != m else y


def _transforms(minor: int, dtype):
  import jax.experimental.pallas.mosaic_gpu as plgpu
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(minor * bits)
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


@functools.partial(jax.jit, static_argnames=("epilogue", "out_dtype", "n", "block_n", "block_k",
                                             "steps", "cluster"))
def _call(x, w, residual, *, epilogue, out_dtype, n, block_n, block_k, steps, cluster):
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  m, k = x.shape
  rows = m // 2                      # per compute warpgroup
  k_steps = k // block_k
  gate_up = epilogue == "gate_up"
  in_t = _transforms(block_k, jnp.bfloat16)
  out_t = _transforms(block_n, out_dtype)

  def kernel(*refs):
    if epilogue == "residual":
      x_gmem, w_gmem, r_gmem, out_gmem, out_smem, r_barrier = refs
    else:
      (x_gmem, w_gmem, out_gmem, out_smem), r_gmem, r_barrier = refs, None, None
    j = lax.axis_index("n") * cluster + lax.axis_index("cluster")
    wg = lax.axis_index("wg")
    wg_rows = pl.ds(wg * rows, rows)
    cols = pl.ds(j * block_n, block_n)

    def compute_context(run_pipeline):
      n_acc = 2 if gate_up else 1

      def scope(*accs):
        accs = run_pipeline(accs)
        if gate_up:
          g, u = accs[0][...], accs[1][...]
          y = (g * (1.0 / (1.0 + jnp.exp(-g))) * u).astype(out_dtype)
        else:
          y = accs[0][...]
        if r_gmem is not None:
          plgpu.copy_gmem_to_smem(r_gmem.at[wg_rows, cols], out_smem.at[wg],
                                  r_barrier.at[wg])
          plgpu.barrier_wait(r_barrier.at[wg])
          out_smem[wg] += y
        else:
          out_smem[wg] = y
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[wg_rows, cols])
        plgpu.wait_smem_to_gmem(0)

      pl.run_scoped(scope, *[plgpu.ACC((rows, block_n), jnp.float32)] * n_acc)

    def body(_, x_smem, *w_and_carry):
      *w_smems, accs = w_and_carry
      for acc, w_smem in zip(accs, w_smems):
        plgpu.wgmma(acc, x_smem.at[wg_rows], w_smem.transpose((1, 0)))
      plgpu.wgmma_wait(0)
      return accs

    w_spec = plgpu.BlockSpec((block_n, block_k), lambda kk: (0, kk), transforms=in_t)
    pipeline = plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_steps,), memory_registers=40,
        in_specs=[plgpu.BlockSpec((m, block_k), lambda kk: (0, kk), transforms=in_t,
                                  collective_axes=("cluster",) if cluster > 1 else ())]
        + [w_spec] * (2 if gate_up else 1),
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=steps,
        compute_context=compute_context)
    w_tiles = [w_gmem.at[cols]]
    if gate_up:
      w_tiles.append(w_gmem.at[pl.ds(n + j * block_n, block_n)])
    pipeline(x_gmem, *w_tiles)

  scratch = [plgpu.SMEM((2, rows, block_n), out_dtype, transforms=out_t)]
  if epilogue == "residual":
    scratch.append(plgpu.Barrier(num_barriers=2))
  f = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(n // block_n // cluster,),
      grid_names=("n",), cluster=(cluster,), cluster_names=("cluster",), num_threads=3,
      thread_name="wg", scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  args = (x, w) if residual is None else (x, w, residual)
  return f(*args)
