"""Ring attention partials of a batched bf16 ring on Hopper tensor cores (Mosaic GPU).

The batched step (issue 14) attends S sequences' blocks over their rings in one launch; the
one-sequence step runs it as a batch of one. The Triton partial (`ring_attention`) runs each
(slot, kv head, chunk) program as one warpgroup that waits on every load and every MMA in
turn. Here a memory warpgroup streams the chunk's K, V and position tiles by TMA while the
compute warpgroup runs wgmma on the one before, the same arithmetic: float32 operands split
into two bf16 parts (~16 mantissa bits; emitted by `qk_norm_rope(..., parts=True)` or
`split_operands`), bf16 ring tiles exact as one part, float32 accumulation, smallest products
first. Program (b, h, c) attends kv head h's packed query rows of slot b over ring chunk c
and, in every chunk, the block's own keys (visible only in chunk 0), and writes the
unnormalised partial (o, m, l) that `ring_attention.combine_partials` merges.

The shapes it takes (`fits`): 64 packed query rows (T*G; the seed drafter's 16 x 4), T a
multiple of 16, head_dim 64 or 128, a bf16 ring whose chunks are whole tiles. GPU only
(p.v's register A operand is beyond jax 0.11.2's Mosaic GPU interpreter):
`ring_attention_reference` is the contract; the CPU tests check the wrapper and lower the
kernel for the GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import ring_attention as RA
from pallas_kernels._common import KnobsBase, bf16_parts, smem_transforms

ROWS = 64        # one wgmma M: the packed query rows of one (slot, kv head)
BLOCK_K = 64     # ring slots per compute warpgroup and pipeline step


PROGRAMS = 128   # the launch's programs: one per SM (the compute warpgroup's registers allow one)


@dataclasses.dataclass(frozen=True)
class Knobs(KnobsBase):
  """The launch knobs of `ring_attention_batched` (its keyword arguments)."""
  splits: int
  steps: int = 2


def default_knobs(n_seqs: int, n_head_kv: int, rows: int, t: int, d: int, n_slots: int,
                  ring_dtype) -> Knobs | None:
  """The launch knobs for n_seqs sequence slots: the ring cut into as many chunks as make
  about PROGRAMS programs (the best chunk count at every slot count measured, one to three
  slots included; 2 pipeline steps beat 1 and equal 3: benchmarks/RESULTS.md, "The
  one-sequence step now runs the Mosaic GPU attention partials"); None for a shape `fits`
  refuses. Whether this kernel runs at all is the caller's routing
  (`dflash_jax.dispatch.attention`)."""
  splits = max(1, PROGRAMS // (n_seqs * n_head_kv))
  return Knobs(splits=splits) if fits(rows, t, d, n_slots, ring_dtype, splits) else None


def smem_bytes(t: int, d: int, steps: int) -> int:
  """Shared memory of one program: the query parts (aliased by the partial's buffers), the
  own keys' parts and `steps` pipeline stages of K, V and position tiles."""
  q_or_out = max(2 * ROWS * d * 2, ROWS * (d + 2) * 4)
  return q_or_out + 4 * t * d * 2 + steps * BLOCK_K * (2 * d * 2 + 4)


SMEM_LIMIT = 232448 - 1024   # the H200's per-block shared memory, less barriers' room


def fits(rows: int, t: int, d: int, n_slots: int, ring_dtype, splits: int) -> bool:
  """Whether this kernel takes the shape: see the module docstring."""
  chunk, n_chunks = RA.chunking(n_slots, splits, BLOCK_K)
  return (rows == ROWS and t % 16 == 0 and d in (64, 128)
          and jnp.dtype(ring_dtype) == jnp.bfloat16 and chunk * n_chunks == n_slots)


@functools.partial(jax.jit, static_argnames=("layer", "window", "chunk", "steps"))
def _partials(q0, q1, k0, k1, v0, v1, ring_k, ring_v, ring_pos, n_past, *, layer, window,
              chunk, steps):
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  b_n, hkv, rows, d = q0.shape
  t = k0.shape[2]
  group = rows // t
  n_slots = ring_k.shape[3]
  n_chunks = n_slots // chunk
  mask = RA.MASK
  bf16_t, f32_t = smem_transforms(d, jnp.bfloat16), smem_transforms(d, jnp.float32)
  # The own values are a K = T operand of p.v: wgmma takes K in whole swizzle groups, so
  # they are swizzled in 16-element (32-byte) groups.
  own_v_t = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))

  def kernel(n_past_gmem, pos_gmem, q0_gmem, q1_gmem, k0_gmem, k1_gmem, v0_gmem, v1_gmem,
             rk_gmem, rv_gmem, o_gmem, m_gmem, l_gmem, *scratch):
    # The partial's buffers reuse the query parts' memory once they have been read.
    ((q0, q1), (o_smem, m_smem, l_smem)), ko0, ko1, vo0, vo1, bars, done = scratch
    # Each bf16 part in a buffer of its own (a constant index into a stacked buffer does not
    # lower inside the MMA's state scope).
    q_smem = (q0, q1)
    b, h, c = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("c")
    n_past = n_past_gmem[b]

    def update(carry, s, v_parts):
      # v_parts: the (A register operand, B smem) products of p.v, smallest first
      acc, m, l = carry
      m_new = jnp.maximum(m, s.max(axis=1))
      corr = jnp.exp(m - m_new)
      p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
      l = l * corr + p.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(corr, acc.shape, [0])
      p0 = p.astype(jnp.bfloat16)
      p1 = (p - p0.astype(jnp.float32)).astype(jnp.bfloat16)
      ps = (p0, p1)

      def pv(acc_ref):
        for i, v_smem in v_parts:
          plgpu.wgmma(acc_ref, ps[i], v_smem)

      return pl.run_state(pv)(plgpu.ACC.init(acc)), m_new, l

    def scores(pairs, keys):
      def qk(acc_ref):
        for i, k_smem in pairs:
          plgpu.wgmma(acc_ref, q_smem[i], k_smem.transpose((1, 0)))
        return acc_ref[...]
      return pl.run_scoped(qk, plgpu.ACC((rows, keys), jnp.float32))

    def compute_context(run_pipeline):
      copies = ((q0_gmem, q0), (q1_gmem, q1), (k0_gmem, ko0), (k1_gmem, ko1), (v0_gmem, vo0),
                (v1_gmem, vo1))
      for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src.at[b, h], dst, bars.at[i])
      for i in range(len(copies)):
        plgpu.barrier_wait(bars.at[i])
      acc = plgpu.layout_cast(jnp.zeros((rows, d), jnp.float32), plgpu.Layout.WGMMA)
      m = plgpu.layout_cast(jnp.full((rows,), mask, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
      l = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      # The block's own keys (float32, so both operands in parts: 3 products), visible to
      # chunk 0's program only: the others mask them out and skip no branch.
      s = scores(((0, ko1), (1, ko0), (0, ko0)), t)
      key = plgpu.broadcasted_iota(jnp.int32, (rows, t), 1, layout=plgpu.Layout.WGMMA)
      own_lim = jnp.where(c == 0, t, 0)
      s = jnp.where(key < own_lim, s, mask)
      carry = update((acc, m, l), s,
                     ((0, vo1), (1, vo0), (0, vo0)))
      acc, m, l = run_pipeline(carry)
      plgpu.barrier_arrive(done)   # the query parts are read: their memory is free
      plgpu.barrier_wait(done)
      o_smem[...] = acc
      m_smem[...] = m
      l_smem[...] = l
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, h, c])
      plgpu.copy_smem_to_gmem(m_smem, m_gmem.at[b, h, c])
      plgpu.copy_smem_to_gmem(l_smem, l_gmem.at[b, h, c])
      plgpu.wait_smem_to_gmem(0)

    def body(_, k_smem, v_smem, pos_smem, carry):
      s = scores(((1, k_smem), (0, k_smem)), BLOCK_K)
      pos = lax.broadcast_in_dim(plgpu.load(pos_smem, layout=plgpu.Layout.WGMMA.reduce(0)),
                                 s.shape, [1])
      vis = (pos >= 0) & (pos < n_past)
      if window is not None:
        row = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
        vis &= pos > n_past - window + row // group
      return update(carry, jnp.where(vis, s, mask), ((1, v_smem), (0, v_smem)))

    sl = pl.ds(c * chunk, chunk)
    kv_spec = plgpu.BlockSpec((BLOCK_K, d), lambda i: (i, 0), transforms=bf16_t)
    pipeline = plgpu.emit_pipeline_warp_specialized(
        body, grid=(chunk // BLOCK_K,), memory_registers=40,
        in_specs=[kv_spec, kv_spec, plgpu.BlockSpec((BLOCK_K,), lambda i: (i,))],
        wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=steps,
        compute_context=compute_context)
    pipeline(rk_gmem.at[b, layer, h, sl], rv_gmem.at[b, layer, h, sl], pos_gmem.at[b, sl])

  q_parts = (plgpu.SMEM((rows, d), jnp.bfloat16, transforms=bf16_t),) * 2
  out_bufs = (plgpu.SMEM((rows, d), jnp.float32, transforms=f32_t),
              plgpu.SMEM((rows,), jnp.float32), plgpu.SMEM((rows,), jnp.float32))
  f = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((b_n, hkv, n_chunks, rows, d), jnp.float32),
                jax.ShapeDtypeStruct((b_n, hkv, n_chunks, rows), jnp.float32),
                jax.ShapeDtypeStruct((b_n, hkv, n_chunks, rows), jnp.float32)),
      # One compute warpgroup and the memory warpgroup: two compute warpgroups over halves of
      # each tile were slower (benchmarks/RESULTS.md, "New kernel
      # pallas_kernels/ring_attention_mgpu.py").
      grid=(b_n, hkv, n_chunks), grid_names=("b", "h", "c"), num_threads=2,
      thread_name="wg", kernel_name="ring_attn_mgpu_partial",
      scratch_types=[plgpu.RefUnion(q_parts, out_bufs),
                     *[plgpu.SMEM((t, d), jnp.bfloat16, transforms=bf16_t)] * 2,
                     *[plgpu.SMEM((t, d), jnp.bfloat16, transforms=own_v_t)] * 2,
                     plgpu.Barrier(num_barriers=6), plgpu.Barrier(num_arrivals=1)],
      compiler_params=plgpu.CompilerParams(
          approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return f(n_past, ring_pos, q0, q1, k0, k1, v0, v1, ring_k, ring_v)


def split_operands(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
  """The kernel's operands from float32 q, k, v (any leading axes): (q0, q1, k0, k1, v0, v1),
  the bf16 parts (`bf16_parts`) of q / sqrt(D), k and v. `qk_norm_rope(..., parts=True)`
  emits the same from its launch; this XLA form is for callers holding float32 operands."""
  q = q * (1.0 / math.sqrt(q.shape[-1]))
  return (*bf16_parts(q), *bf16_parts(k), *bf16_parts(v))


@functools.partial(jax.jit, static_argnames=("layer", "window", "splits", "steps", "out_dtype"))
def ring_attention_batched(q0: jax.Array, q1: jax.Array, k0: jax.Array, k1: jax.Array,
                           v0: jax.Array, v1: jax.Array, ring_k: jax.Array, ring_v: jax.Array,
                           ring_pos: jax.Array, n_past: jax.Array, *, layer: int,
                           window: int | None, splits: int = 4, steps: int = 2,
                           out_dtype=jnp.float32) -> jax.Array:
  """`ring_attention` of B sequences at once, from the bf16 parts of its float32 operands
  (`split_operands`: q pre-scaled by 1/sqrt(D)): q0, q1 [B, Hkv, T*G, D], k0, k1, v0, v1
  [B, Hkv, T, D]; ring_k, ring_v [B, L, Hkv, S, D] bf16; ring_pos [B, S] int32; n_past [B]
  int32. Returns [B, T, Hq*D] as out_dtype. The ring is cut into `splits` chunks
  (`RA.chunking` with tiles of 64 slots), `steps` tiles in flight. GPU only; shapes as `fits`
  says."""
  name = "ring_attention_batched"
  b_n, hkv, rows, d = q0.shape
  t = k0.shape[2]
  parts = (q0, q1, k0, k1, v0, v1)
  for x, shape in zip(parts, [q0.shape] * 2 + [(b_n, hkv, t, d)] * 4):
    RA.check(x.shape == shape and x.dtype == jnp.bfloat16, name,
             "the parts must be bf16, q0 / q1 [B, Hkv, T*G, D] and k0 ... v1 [B, Hkv, T, D]",
             [(y.shape, y.dtype) for y in parts])
  RA.check(ring_k.ndim == 5 and ring_k.shape[0] == b_n, name,
           "ring_k must be [B, L, Hkv, S, D]", ring_k.shape)
  RA.check(n_past.shape == (b_n,) and ring_pos.shape == (b_n, ring_k.shape[3]), name,
           "n_past must be [B] and ring_pos [B, S]", (n_past.shape, ring_pos.shape))
  # Every slot has slot 0's shapes: one slot's view is checked (float32 for the parts).
  view = lambda x, dtype=None: jax.ShapeDtypeStruct(x.shape[1:], dtype or x.dtype)
  RA._check_shapes(name, view(q0, jnp.float32), view(k0, jnp.float32), view(v0, jnp.float32),
                   view(ring_k), view(ring_v), view(ring_pos), view(n_past), layer, window)
  n_slots = ring_k.shape[3]
  RA.check(smem_bytes(t, d, steps) <= SMEM_LIMIT, name,
           "steps tiles exceed shared memory", (steps, smem_bytes(t, d, steps)))
  RA.check(fits(rows, t, d, n_slots, ring_k.dtype, splits), name,
           "shape outside this kernel (64 packed rows, T % 16, D 64 / 128, bf16 ring of whole "
           "chunks of 64-slot tiles)", (rows, t, d, n_slots, ring_k.dtype, splits))
  chunk, _ = RA.chunking(n_slots, splits, BLOCK_K)
  o, m, l = _partials(*parts, ring_k, ring_v, ring_pos, n_past, layer=layer, window=window,
                      chunk=chunk, steps=steps)
  combine = functools.partial(RA.combine_partials, t=t, d=d, fold_own=True,
                              out_dtype=out_dtype, interpret=False)
  return jax.vmap(combine)(o, m, l)
