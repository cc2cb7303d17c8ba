"""Attention of a target's cached pass over the live slots of its K/V cache.

The target's cache is [B, Hkv, S, D] per layer (slot = position); a pass of T rows per
sequence at positions start[b] .. start[b] + T - 1 has already written its own K/V there
(`norm_rope.qk_norm_rope_cache`). Row t sees slots 0 .. start[b] + t: the cache up to its
position, the pass's earlier rows and itself (causal within the pass). Only the slots below
start[b] + T are read: the length bound is a traced value, so one compile serves every
length, and the time grows with the live context, not with the capacity S.

Two launches. `cache_attn_partial` runs a grid (sequence x kv head x query row tile, chunk):
the cache is cut into chunks of `chunk` slots at fixed slot offsets (chunk c holds slots
c chunk .. (c + 1) chunk - 1), and program (., c) attends its query rows over chunk c's live
slots with an online softmax (tiles of `block_k` slots), writing an unnormalised partial
(o, m, l); chunks at or past the live bound exit at once. `cache_attn_combine` merges a
row's chunk partials in chunk order into the token-major [B, T, Hq D] output the o
projection reads. The split over the cache length gives the parallelism a long context needs
(one program per kv head would fill 8 of the H200's 132 SMs); the fixed combine order keeps
the result deterministic.

Batch invariance: a row's arithmetic does not depend on how many rows share the launch. The
query row tile (`block_q` rows of one kv head: row t G + g = token t, query head h G + g)
has the same shape for every call (the default knobs size it for the widest pass, so a
1-row decode and a 16-row verify run the same tile code, padding rows masked); chunk and
tile boundaries are fixed slot offsets; and the slots a row cannot see add exact zeros: a
masked score's weight is exp(MASK - m) = 0 in a tile the row already saw a key in, and a
chunk wholly past the row's position keeps m = MASK and gets weight 0 in the combine. So row
t of a verify equals the 1-row decode of the same token at the same position bit for bit.

Dots take their operands in the cache dtype with float32 accumulation, as the target's XLA
attention does: bf16 q and keys, probabilities rounded to bf16 for the product with V. A
float32 cache splits both operands into three bf16 parts (`_common.split_dot`: float32
accuracy; a plain float32 dot would run as TF32 on the GPU).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import (KnobsBase, check, is_pow2, load_tile, next_pow2,
                                    resolve_interpret, split_dot, split_parts, store_tile)
from pallas_kernels.limits import check_head_dim
from pallas_kernels.ring_attention import MASK

F32_TERMS = 3   # bf16 parts per float32 operand: float32 accuracy
COMBINE_ROWS = 8   # query rows per combine program (elementwise per row: any count is exact)


@dataclasses.dataclass(frozen=True)
class Knobs(KnobsBase):
  """The launch knobs of `cache_attention` (its keyword arguments)."""
  chunk: int
  block_k: int
  block_q: int
  num_warps: int = 4
  num_stages: int = 2


def default_knobs(*, rows: int, head_dim: int, cache_dtype, chunk: int) -> Knobs:
  """Knobs for `rows` query rows per kv head and sequence (T G; the widest pass's rows for a
  batch-invariant tile) over a cache of cache_dtype cut into `chunk`-slot chunks.

  block_q: the power of 2 covering `rows` (>= 16), at most 128 rows at head_dim <= 128 (64
  beyond): more rows are more row tiles. block_k: 64-slot tiles for a bf16 cache, 32 for
  float32 (whose three query parts hold three times the registers); halved past head_dim 128.
  8 warps for 128-row tiles and for float32.
  """
  bf16 = jnp.dtype(cache_dtype) == jnp.bfloat16
  block_q = min(128 if head_dim <= 128 else 64, max(16, next_pow2(rows)))
  block_k = (64 if bf16 else 32) // (2 if head_dim > 128 else 1)
  return Knobs(chunk=chunk, block_k=min(block_k, chunk), block_q=block_q,
               num_warps=8 if block_q >= 128 or not bf16 else 4)


def _live(start: jax.Array, t: int, n_slots: int, capacity: int) -> jax.Array:
  """The live slots' bound: slots below it hold a position the pass may see."""
  if capacity:
    return jnp.minimum(jnp.minimum(start + t, capacity), n_slots)
  return jnp.minimum(start + t, n_slots)


def visible(slot: jax.Array, pos: jax.Array, start: jax.Array, live: jax.Array, *, t: int,
            n_slots: int, window: int, capacity: int) -> jax.Array:
  """Which slots [K] rows at positions pos [R] see ([R, K] bool), the pass's rows written.
  window 0: slot = position, a row sees slots <= its position. window > 0: a ring of n_slots
  slots over positions below capacity (position p at slot p % n_slots); a slot holds the
  latest position <= the pass's last written one (`last`) that it can, and a row sees the
  positions in (pos - window, pos]. live: `_live`'s bound. Shared by the kernel and its
  twin."""
  if not window:
    return (slot[None, :] <= pos[:, None]) & (slot < live)[None, :]
  last = jnp.minimum(start + t, capacity) - 1
  top = last % n_slots   # the slot of `last`; slots above it hold the lap before
  held = last - top + slot - jnp.where(slot <= top, 0, n_slots)
  diff = pos[:, None] - held[None, :]
  return (diff >= 0) & (diff < window) & (held >= 0)[None, :] & (slot < live)[None, :]


def _partial_kernel(start_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, t: int, group: int,
                    rows: int, d: int, n_slots: int, chunk: int, block_k: int,
                    n_row_tiles: int, terms: int, window: int, capacity: int):
  block_q, dp = q_ref.shape
  col_lim = None if dp == d else d
  r0 = 0
  if n_row_tiles > 1:
    r0 = (pl.program_id(0) % n_row_tiles) * block_q
  row_lim = None if rows % block_q == 0 else rows - r0
  start = start_ref[0]
  live = _live(start, t, n_slots, capacity)
  c0 = pl.program_id(1) * chunk
  n_tiles = (jnp.clip(live - c0, 0, chunk) + block_k - 1) // block_k
  q = load_tile(q_ref, (0, 0), (block_q, dp), (row_lim, col_lim))
  q_parts = [q] if terms == 1 else split_parts(q, terms)
  pos = start + (r0 + jnp.arange(block_q, dtype=jnp.int32)) // group
  scale = 1.0 / math.sqrt(d)

  def tile(i, carry):
    acc, m, l = carry
    j0 = i * block_k
    lim = live - c0 - j0   # slots of this tile below the live bound
    slot = c0 + j0 + jnp.arange(block_k, dtype=jnp.int32)
    vis = visible(slot, pos, start, live, t=t, n_slots=n_slots, window=window,
                  capacity=capacity)
    s = split_dot(q_parts, load_tile(k_ref, (j0, 0), (block_k, dp), (lim, col_lim)), 1)
    s = jnp.where(vis, s * scale, MASK)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    p_parts = [p.astype(jnp.bfloat16)] if terms == 1 else split_parts(p, terms)
    pv = split_dot(p_parts, load_tile(v_ref, (j0, 0), (block_k, dp), (lim, col_lim)), 0)
    return acc * corr[:, None] + pv, m_new, l * corr + jnp.sum(p, axis=1)

  init = (jnp.zeros((block_q, dp), jnp.float32), jnp.full((block_q,), MASK, jnp.float32),
          jnp.zeros((block_q,), jnp.float32))
  acc, m, l = lax.fori_loop(0, n_tiles, tile, init)

  @pl.when(c0 < live)   # chunks past the live bound write nothing (the combine stops before)
  def _():
    store_tile(o_ref, (0, 0), acc, (row_lim, col_lim))
    store_tile(m_ref, (0,), m, (row_lim,))
    store_tile(l_ref, (0,), l, (row_lim,))


def _combine_kernel(start_ref, o_ref, m_ref, l_ref, *refs, t: int, group: int, rows: int,
                    d: int, n_slots: int, chunk: int, n_head_kv: int, capacity: int,
                    gate_col: int | None):
  # Blocks: o [C, R, D], m and l [C, R] (every chunk's partials of one kv head of one
  # sequence), gate [P, T, W] (that sequence's rows of the gating projection's partials),
  # out [T, Hq D] (that sequence's output). RB rows of the kv head per program.
  g_ref, out_ref = refs if gate_col is not None else (None, refs[0])
  rb = COMBINE_ROWS
  dp = next_pow2(d)
  col_lim = None if dp == d else d
  r0 = pl.program_id(1) * rb
  row_lim = None if rows % rb == 0 else rows - r0
  live = _live(start_ref[0], t, n_slots, capacity)
  n_chunks = (live + chunk - 1) // chunk

  def stat(ref, c, other):
    return load_tile(ref, (c, r0), (None, rb), (None, row_lim), other=other)

  top = lax.fori_loop(0, n_chunks, lambda c, top: jnp.maximum(top, stat(m_ref, c, MASK)),
                      jnp.full((rb,), MASK, jnp.float32))

  def add(c, carry):
    num, den = carry
    w = jnp.exp(stat(m_ref, c, MASK) - top)
    o = load_tile(o_ref, (c, r0, 0), (None, rb, dp), (None, row_lim, col_lim))
    return num + w[:, None] * o, den + w * stat(l_ref, c, 0.0)

  num, den = lax.fori_loop(0, n_chunks, add, (jnp.zeros((rb, dp), jnp.float32),
                                              jnp.zeros((rb,), jnp.float32)))
  out = num / den[:, None]
  # Row r of kv head h: token r // G, query head h G + r % G. Lanes past the rows or past D
  # get distinct out-of-range indices: the mask stops them on the GPU, and interpret mode's
  # masked scatter drops them instead of racing a live lane on a shared element.
  r = r0 + jnp.arange(rb, dtype=jnp.int32)
  col = jnp.arange(dp, dtype=jnp.int32)
  live_row = (r < rows)[:, None]
  ok = live_row & (col < d)[None, :]
  hq_d = out_ref.shape[1]
  tok = jnp.where(live_row, (r // group)[:, None], t + r[:, None])
  dst = (pl.program_id(0) % n_head_kv * group + r % group)[:, None] * d + col[None, :]
  if gate_col is not None:
    # The gate's partials added in order, masked lanes reading an in-range element.
    g_tok = jnp.where(live_row, tok, 0)
    g_col = jnp.where(ok, gate_col + dst, gate_col)
    g = plt.load(g_ref.at[0, g_tok, g_col], mask=ok, other=0.0)
    for i in range(1, g_ref.shape[0]):
      g = g + plt.load(g_ref.at[i, g_tok, g_col], mask=ok, other=0.0)
    out = out * (1.0 / (1.0 + jnp.exp(-g)))
  plt.store(out_ref.at[tok, jnp.where(ok, dst, hq_d + col[None, :])],
            out.astype(out_ref.dtype), mask=ok)


def _check_shapes(name: str, q, cache_k, cache_v, start, t: int) -> tuple[int, int, int, int]:
  """Checks shared by the kernel and its twin; returns (B, Hkv, G, D)."""
  check(q.ndim == 4, name, "q must be [B, Hkv, T G, D]", q.shape)
  b, hkv, rows, d = q.shape
  check(isinstance(t, int) and t >= 1 and rows % t == 0, name,
        "t must be an int >= 1 dividing q's rows (T G)", (t, rows))
  check(cache_k.ndim == 4 and cache_k.shape[:2] == (b, hkv) and cache_k.shape[3] == d, name,
        "cache_k must be [B, Hkv, S, D] matching q", (cache_k.shape, q.shape))
  check(cache_v.shape == cache_k.shape and cache_v.dtype == cache_k.dtype, name,
        "cache_v must match cache_k", (cache_v.shape, cache_v.dtype, cache_k.dtype))
  check(cache_k.dtype in (jnp.float32, jnp.bfloat16), name,
        "cache dtype must be float32 or bfloat16", cache_k.dtype)
  check(q.dtype == cache_k.dtype, name, "q dtype must be the cache dtype", (q.dtype,
                                                                            cache_k.dtype))
  check(start.shape == (b,) and start.dtype == jnp.int32, name, "start must be int32 [B]",
        (start.shape, start.dtype))
  return b, hkv, rows // t, d


def _check_gate(name: str, gate, gate_col: int, b: int, t: int, hq_d: int) -> None:
  if gate is None:
    return
  check(gate.ndim == 4 and gate.shape[1:3] == (b, t) and gate.dtype == jnp.float32, name,
        f"gate must be float32 [P, {b}, {t}, W]", (gate.shape, gate.dtype))
  check(isinstance(gate_col, int) and 0 <= gate_col and gate_col + hq_d <= gate.shape[3], name,
        f"gate_col must leave Hq D = {hq_d} gate columns in W", (gate_col, gate.shape[3]))


def _check_window(name: str, window: int, capacity: int, n_slots: int) -> None:
  check(isinstance(window, int) and window >= 0, name, "window must be an int >= 0", window)
  check(isinstance(capacity, int) and capacity >= 0, name, "capacity must be an int >= 0",
        capacity)
  check(not window or capacity >= n_slots, name,
        "a windowed (ring) cache needs capacity >= its S slots", (window, capacity, n_slots))


@functools.partial(jax.jit, static_argnames=["t", "gate_col", "window", "capacity", "chunk",
                                             "block_k", "block_q", "num_warps", "num_stages",
                                             "out_dtype", "interpret"])
def cache_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, start: jax.Array,
                    gate: jax.Array | None = None, *, t: int, gate_col: int = 0,
                    window: int = 0, capacity: int = 0, chunk: int = 512,
                    block_k: int = 64, block_q: int = 64, num_warps: int = 4,
                    num_stages: int = 2, out_dtype=jnp.float32,
                    interpret: bool | None = None) -> jax.Array:
  """Causal attention of T rows per sequence over the cache's slots below start + T.

  q: [B, Hkv, T G, D] in the cache dtype (row t G + g: token t, query head h G + g; the
  layout `qk_norm_rope_cache` writes); cache_k, cache_v: [B, Hkv, S, D] float32 or bfloat16
  holding the pass's own rows at start[b] .. start[b] + T - 1; start: [B] int32.
  window > 0 (with capacity >= S): a sliding-window layer's ring, as `qk_norm_rope_cache`
  writes it with that capacity (position p at slot p % S); row t sees the positions in
  (start + t - window, start + t]. The pass's writes must not have overwritten a position a
  row sees: S >= window + T - 1, or S = capacity (no slot is ever reused). gate: a
  projection's split-K partials [P, B, T, W] float32 whose columns gate_col .. gate_col +
  Hq D - 1 gate the output (Muse-Glimmer's output gate): out * sigmoid(their sum, added in
  order), in the combine. Returns
  [B, T, Hq D] token-major, computed in float32 and stored as out_dtype. Knobs
  (`default_knobs`): `chunk` slots per partial (a multiple of block_k; powers of 2),
  `block_k` slots per tile, `block_q` query rows per program (power of 2 >= 16), the partial
  kernel's num_warps and num_stages. Any S, T, G; D a multiple of 16 up to 256.
  """
  name = "cache_attention"
  b, hkv, g, d = _check_shapes(name, q, cache_k, cache_v, start, t)
  check_head_dim(name, d)
  for nm, v in (("chunk", chunk), ("block_k", block_k), ("block_q", block_q)):
    check(is_pow2(v) and v >= 16, name, f"{nm} must be a power of 2 >= 16", v)
  check(chunk % block_k == 0, name, "chunk must be a multiple of block_k", (chunk, block_k))
  s = cache_k.shape[2]
  _check_window(name, window, capacity, s)
  _check_gate(name, gate, gate_col, b, t, hkv * g * d)
  interpret = resolve_interpret(interpret)
  rows = t * g
  n_chunks = pl.cdiv(s, chunk)
  n_rt = pl.cdiv(rows, block_q)
  dp = next_pow2(d)
  terms = 1 if cache_k.dtype == jnp.bfloat16 else F32_TERMS
  per_seq = hkv * n_rt

  def bh(p):   # grid axis 0 -> (sequence, kv head, row tile)
    return p // per_seq, (p % per_seq) // n_rt, p % n_rt

  # Blocks are power-of-2 tiles; where they hang over an array's end (S past the last chunk,
  # rows past T G, D past the head) the kernel masks those lanes.
  kv_spec = pl.BlockSpec((None, None, chunk, dp), lambda p, c: (*bh(p)[:2], c, 0))
  o, m, l = pl.pallas_call(
      functools.partial(_partial_kernel, t=t, group=g, rows=rows, d=d, n_slots=s, chunk=chunk,
                        block_k=block_k, n_row_tiles=n_rt, terms=terms, window=window,
                        capacity=capacity),
      grid=(b * per_seq, n_chunks),
      in_specs=[pl.BlockSpec((1,), lambda p, c: (bh(p)[0],)),
                pl.BlockSpec((None, None, block_q, dp), lambda p, c: (*bh(p), 0)),
                kv_spec, kv_spec],
      out_specs=[pl.BlockSpec((None, None, None, block_q, dp),
                              lambda p, c: (*bh(p)[:2], c, bh(p)[2], 0)),
                 pl.BlockSpec((None, None, None, block_q), lambda p, c: (*bh(p)[:2], c, bh(p)[2])),
                 pl.BlockSpec((None, None, None, block_q), lambda p, c: (*bh(p)[:2], c, bh(p)[2]))],
      out_shape=[jax.ShapeDtypeStruct((b, hkv, n_chunks, rows, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, hkv, n_chunks, rows), jnp.float32),
                 jax.ShapeDtypeStruct((b, hkv, n_chunks, rows), jnp.float32)],
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="cache_attn_partial",
  )(start, q, cache_k, cache_v)

  hq_d = hkv * g * d
  # Program (b Hkv + h, i): every chunk's partials of kv head h of sequence b (whole blocks:
  # the kernel reads the live chunks' rows of its row group), that sequence's output.
  stat_spec = pl.BlockSpec((None, None, n_chunks, rows), lambda p, i: (p // hkv, p % hkv, 0, 0))
  gated = gate is not None
  gate_specs = [pl.BlockSpec((gate.shape[0], None, t, gate.shape[3]),
                             lambda p, i: (0, p // hkv, 0, 0))] if gated else []
  return pl.pallas_call(
      functools.partial(_combine_kernel, t=t, group=g, rows=rows, d=d, n_slots=s, chunk=chunk,
                        n_head_kv=hkv, capacity=capacity, gate_col=gate_col if gated else None),
      grid=(b * hkv, pl.cdiv(rows, COMBINE_ROWS)),
      in_specs=[pl.BlockSpec((1,), lambda p, i: (p // hkv,)),
                pl.BlockSpec((None, None, n_chunks, rows, d),
                             lambda p, i: (p // hkv, p % hkv, 0, 0, 0)),
                stat_spec, stat_spec] + gate_specs,
      out_specs=pl.BlockSpec((None, t, hq_d), lambda p, i: (p // hkv, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((b, t, hq_d), out_dtype),
      compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret, name="cache_attn_combine",
  )(start, o, m, l, *([gate] if gated else []))


@functools.partial(jax.jit, static_argnames=["t", "gate_col", "window", "capacity", "chunk",
                                             "block_k", "block_q", "num_warps", "num_stages",
                                             "out_dtype", "interpret"])
def cache_attention_reference(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
                              start: jax.Array, gate: jax.Array | None = None, *, t: int,
                              gate_col: int = 0, window: int = 0, capacity: int = 0,
                              chunk: int = 512, block_k: int = 64, block_q: int = 64,
                              num_warps: int = 4, num_stages: int = 2, out_dtype=jnp.float32,
                              interpret: bool | None = None) -> jax.Array:
  """Pure-jnp twin of `cache_attention`: the full score matrix over all S slots with the
  visibility mask, float32, precision HIGHEST. Takes the kernel's knobs (ignored)."""
  del chunk, block_k, block_q, num_warps, num_stages, interpret
  name = "cache_attention_reference"
  b, hkv, g, d = _check_shapes(name, q, cache_k, cache_v, start, t)
  s = cache_k.shape[2]
  _check_window(name, window, capacity, s)
  _check_gate(name, gate, gate_col, b, t, hkv * g * d)
  qf = q.astype(jnp.float32)
  sc = jnp.einsum("bhrd,bhsd->bhrs", qf, cache_k.astype(jnp.float32),
                  precision=lax.Precision.HIGHEST) / math.sqrt(d)
  pos = start[:, None] + jnp.arange(t * g, dtype=jnp.int32)[None, :] // g      # [B, R]
  slot = jnp.arange(s, dtype=jnp.int32)
  vis = jax.vmap(lambda p_, s_: visible(slot, p_, s_, _live(s_, t, s, capacity), t=t,
                                        n_slots=s, window=window, capacity=capacity))(pos, start)
  p = jax.nn.softmax(jnp.where(vis[:, None], sc, -jnp.inf), axis=-1)
  o = jnp.einsum("bhrs,bhsd->bhrd", p, cache_v.astype(jnp.float32),
                 precision=lax.Precision.HIGHEST)
  o = o.reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, -1)
  if gate is not None:
    gs = gate[0]
    for i in range(1, gate.shape[0]):
      gs = gs + gate[i]
    o = o * (1.0 / (1.0 + jnp.exp(-gs[..., gate_col:gate_col + o.shape[-1]])))
  return o.astype(out_dtype)
