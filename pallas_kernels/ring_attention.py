"""GQA attention of the drafter block over its own keys plus a K/V ring or cache.

Two launches. `ring_attn_partial` runs a grid (Hkv x query row tiles, chunks + 1): program
(h, c < chunks) attends kv head h's packed query rows (T*G rows: token r // G, query head
h*G + r % G) over ring chunk c with an online softmax and writes an unnormalised partial
(o, m, l); program (h, chunks) does the same over the block's own T keys, so no ring program
carries that extra work (faster than folding them into the first chunk). `ring_attn_combine`
runs a grid (Hkv, row tiles of the combine) and merges the chunks + 1 partials of its rows
straight into the token-major [T, Hq*D] output. One program per kv head would fill only Hkv
of the H200's 132 SMs, and combining in XLA takes 3 launches (benchmarks/RESULTS.md, the
attention sweeps of "kernel GPU tests, kernel timings, attention sweep" and after).

Visibility (SPEC.md sections 3 and 7): token t sees all T block keys, and slot j iff
0 <= ring_pos[j] < n_past and, for a sliding window W, n_past + t - ring_pos[j] < W
(window=None: a full-attention cache, no window edge). DFlash2's block masks
(SPEC_dflash2_dspark 5.4) restrict the block keys: `causal` (block key j visible to token t
iff j <= t) and `band` B (t - j < B, and j - t < B when not causal); both off, the program is
the one without them.

Any shape: the ring's S slots are cut into chunks of a power-of-2 number of block_k tiles (a
last chunk past S masks its slots to invisible), T*G query rows into power-of-2 row tiles
(rows past T*G masked), T own keys into a power-of-2 key tile (keys past T masked) and
head_dim into a power-of-2 width (columns past D zero). Shapes the tiles fit (the seed
drafter's T = 16, G = 4, D = 128, S = 2048) run without any mask.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import (KnobsBase, check, is_pow2, load_tile, next_pow2,
                                    resolve_interpret, split_dot, split_parts, store_tile)
from pallas_kernels.limits import check_head_dim, check_width

# Finite so that fully masked rows, tiles and splits never produce inf - inf = NaN: a row
# whose scores are all MASK gets exp(0) = 1 weights (garbage), but its running max stays MASK
# and every real score later rescales that garbage by exp(MASK - real) = 0; a split that
# never sees a real score keeps m = MASK and gets weight 0 in the combine. Each row always
# has a real score somewhere because the block's own keys are always visible.
MASK = -0.7 * float(np.finfo(np.float32).max)

# Dots must be fp32-accurate, and plain f32 dots run as TF32 on the GPU (errors of order
# 1e-2 on the H200). Each float32 operand is split into `terms` bf16 parts (x = x0 + x1
# + ..., each part the bf16 rounding of the remainder) and the part products of order < terms
# are summed with fp32 accumulation: terms=3 keeps ~24 mantissa bits (fp32), terms=2 ~16. A
# bf16 ring tile is exact as one part, so q.k costs `terms` bf16 MMAs. The query is split once
# per program, not once per tile as lax.DotAlgorithmPreset.BF16_BF16_F32_X3 would (slower on
# the H200, and tf32x3 slower still: RESULTS.md, "attention GPU tests, attention + GEMM
# sweeps, first step benchmark"). The interpreter runs the same arithmetic, so CPU tests see
# GPU numerics.


def _partial_kernel(n_past_ref, pos_ref, q_ref, k_ref, v_ref, rk_ref, rv_ref,
                    o_ref, m_ref, l_ref, *, rows: int, t: int, d: int, n_slots: int, group: int,
                    window: int | None, block_k: int, terms: int, n_chunks: int,
                    n_row_tiles: int, fold_own: bool, causal: bool, band: int | None):
  block_q, dp = q_ref.shape
  tp = k_ref.shape[0]
  chunk = pos_ref.shape[0]
  n_past = n_past_ref[0]
  col_lim = None if dp == d else d
  r0 = 0
  if n_row_tiles > 1:
    r0 = (pl.program_id(0) % n_row_tiles) * block_q
  row_lim = None if rows % block_q == 0 else rows - r0
  q = load_tile(q_ref, (0, 0), (block_q, dp), (row_lim, col_lim))
  q_parts = split_parts(q * (1.0 / math.sqrt(d)), terms)

  def row_ids():
    r = jnp.arange(block_q, dtype=jnp.int32)
    return r if n_row_tiles == 1 else r0 + r

  # Slot j is visible to row r iff lo[r] < pos[j] (the window edge) and 0 <= pos[j] < n_past.
  lo = None if window is None else (n_past - window + row_ids() // group)[:, None]

  def update(carry, s, v):
    acc, m, l = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    acc = acc * corr[:, None] + split_dot(split_parts(p, terms), v, 0)
    return acc, m_new, l * corr + jnp.sum(p, axis=1)

  init = (jnp.zeros((block_q, dp), jnp.float32), jnp.full((block_q,), MASK, jnp.float32),
          jnp.zeros((block_q,), jnp.float32))

  def own_block(carry):
    key_lim = None if tp == t else t
    sc = split_dot(q_parts, load_tile(k_ref, (0, 0), (tp, dp), (key_lim, col_lim)), 1)
    if key_lim is not None:   # key tile columns past T are no keys
      sc = jnp.where(jnp.arange(tp, dtype=jnp.int32)[None, :] < t, sc, MASK)
    if causal or band is not None:   # DFlash2's block masks; the key t == token always stays
      key = jnp.arange(tp, dtype=jnp.int32)[None, :]
      tok = (row_ids() // group)[:, None]
      vis = key <= tok if causal else None
      if band is not None:
        near = tok - key < band
        if not causal:
          near &= key - tok < band
        vis = near if vis is None else vis & near
      sc = jnp.where(vis, sc, MASK)
    return update(carry, sc, load_tile(v_ref, (0, 0), (tp, dp), (key_lim, col_lim)))

  # The last chunk may run past S: its slots there read as empty (-1) and their K/V as 0.
  ragged = n_slots % chunk != 0
  c0 = pl.program_id(1) * chunk

  def ring_tile(i, carry):
    start = i * block_k
    slot_lim = n_slots - c0 - start if ragged else None
    pos = load_tile(pos_ref, (start,), (block_k,), (slot_lim,), other=-1)
    vis = (pos[None, :] >= 0) & (pos[None, :] < n_past)
    if lo is not None:
      vis &= pos[None, :] > lo
    sc = split_dot(q_parts, load_tile(rk_ref, (start, 0), (block_k, dp), (slot_lim, col_lim)),
                    1)
    return update(carry, jnp.where(vis, sc, MASK),
                  load_tile(rv_ref, (start, 0), (block_k, dp), (slot_lim, col_lim)))

  def ring_chunk(carry):
    # One test per chunk (row 0 has the widest window, so a chunk with no slot visible to row
    # 0 is invisible to all rows); no branch inside the loop, so its loads can be pipelined.
    chunk_pos = load_tile(pos_ref, (0,), (chunk,), (n_slots - c0 if ragged else None,), other=-1)
    vis0 = (chunk_pos >= 0) & (chunk_pos < n_past)
    if window is not None:
      vis0 &= chunk_pos > n_past - window
    any_vis = jnp.max(vis0.astype(jnp.int32)) > 0
    return lax.cond(any_vis, lambda c: lax.fori_loop(0, chunk // block_k, ring_tile, c),
                    lambda c: c, carry)

  if fold_own:   # chunk 0's program starts from the block's own keys
    acc, m, l = ring_chunk(lax.cond(pl.program_id(1) == 0, own_block, lambda c: c, init))
  else:
    acc, m, l = lax.cond(pl.program_id(1) == n_chunks, own_block, ring_chunk, init)
  store_tile(o_ref, (0, 0), acc, (row_lim, col_lim))
  store_tile(m_ref, (0,), m, (row_lim,))
  store_tile(l_ref, (0,), l, (row_lim,))


def _combine_kernel(*refs, rows: int, d: int, group: int, n_chunks: int, split_group: int,
                    hq: int, token_aligned: bool, fold_own: bool):
  # Blocks: o [C, RB, D'], m and l [C, RB] (the ring chunks, C >= chunks) and, unless folded
  # into chunk 0, own_o [RB, D'], own_m and own_l [RB] (the block's own keys) for RB packed
  # query rows of one kv head. The chunks are merged in groups of `split_group` (one group,
  # hence one load, up to 16).
  if fold_own:
    o_ref, m_ref, l_ref, out_ref = refs
  else:
    o_ref, m_ref, l_ref, own_o_ref, own_m_ref, own_l_ref, out_ref = refs
  rb, dp = o_ref.shape[-2:]
  col_lim = None if dp == d else d
  i = pl.program_id(1)
  row_lim = None if rows % rb == 0 else rows - i * rb
  n_groups = pl.cdiv(n_chunks, split_group)
  chunk_lim = None if n_chunks % split_group == 0 else n_chunks % split_group

  ms = [load_tile(m_ref, (gi * split_group, 0), (split_group, rb),
                  (chunk_lim if gi == n_groups - 1 else None, row_lim), other=MASK)
        for gi in range(n_groups)]
  own_m = None if fold_own else load_tile(own_m_ref, (0,), (rb,), (row_lim,), other=MASK)
  top = jnp.max(ms[0], axis=0)
  for m in ms[1:]:
    top = jnp.maximum(top, jnp.max(m, axis=0))
  if not fold_own:
    top = jnp.maximum(top, own_m)
  ws = [jnp.exp(m - top[None, :]) for m in ms]
  own_w = None if fold_own else jnp.exp(own_m - top)

  def lims(gi, *tail):
    return (chunk_lim if gi == n_groups - 1 else None, row_lim) + tail

  def group_sum(f):  # f(gi, w) -> [RB, ...]: summed over the groups in order
    acc = f(0, ws[0])
    for gi in range(1, n_groups):
      acc = acc + f(gi, ws[gi])
    return acc

  denom = group_sum(lambda gi, w: jnp.sum(
      w * load_tile(l_ref, (gi * split_group, 0), (split_group, rb), lims(gi)), axis=0))
  if not fold_own:
    denom = denom + own_w * load_tile(own_l_ref, (0,), (rb,), (row_lim,))
  num = group_sum(lambda gi, w: jnp.sum(
      w[:, :, None] * load_tile(o_ref, (gi * split_group, 0, 0), (split_group, rb, dp),
                                lims(gi, col_lim)), axis=0))
  if not fold_own:
    num = num + own_w[:, None] * load_tile(own_o_ref, (0, 0), (rb, dp), (row_lim, col_lim))
  out = (num / denom[:, None]).astype(out_ref.dtype)
  if token_aligned:
    # The RB rows are RB query heads of one token: one contiguous [RB, D] block of the output.
    store_tile(out_ref, (0, 0), out, (None, col_lim))
  else:
    # Rows cross token boundaries (G not a power of 2): row r goes to output row
    # (r // G) * Hq + h*G + r % G of the [T*Hq, D] view.
    r = i * rb + jnp.arange(rb, dtype=jnp.int32)
    orow = (r // group) * hq + pl.program_id(0) * group + r % group
    col = jnp.arange(dp, dtype=jnp.int32)[None, :]
    plt.store(out_ref.at[orow[:, None], col], out, mask=(r < rows)[:, None] & (col < d))


def _check_shapes(name: str, q, k, v, ring_k, ring_v, ring_pos, n_past, layer: int,
                  window: int | None, causal: bool = False, band: int | None = None) -> None:
  """Shape and dtype checks shared by the kernel and its twin."""
  check(q.ndim == 3, name, "q must be rank 3 [Hkv, T*G, D]", q.shape)
  hkv, rows, d = q.shape
  check(hkv >= 1 and d >= 1, name, "Hkv and D must be >= 1", (hkv, d))
  check(k.ndim == 3 and k.shape[0] == hkv and k.shape[2] == d, name,
        "k must be [Hkv, T, D] matching q", (k.shape, q.shape))
  t = k.shape[1]
  check(v.shape == k.shape, name, "v shape must equal k shape", (v.shape, k.shape))
  for arr, nm in ((q, "q"), (k, "k"), (v, "v")):
    check(arr.dtype == jnp.float32, name, f"{nm} dtype must be float32", arr.dtype)
  check(t >= 1 and rows >= t and rows % t == 0, name,
        "T*G (rows of q) must be a positive multiple of T (rows of k)", (rows, t))
  check(ring_k.ndim == 4 and ring_k.shape[1:] == (hkv, ring_k.shape[2], d), name,
        "ring_k must be [L, Hkv, S, D] matching q", (ring_k.shape, q.shape))
  check(ring_v.shape == ring_k.shape, name, "ring_v shape must equal ring_k shape",
        (ring_v.shape, ring_k.shape))
  check(ring_k.dtype in (jnp.float32, jnp.bfloat16), name,
        "ring dtype must be float32 or bfloat16", ring_k.dtype)
  check(ring_v.dtype == ring_k.dtype, name, "ring_v dtype must equal ring_k dtype",
        (ring_v.dtype, ring_k.dtype))
  n_layer, s = ring_k.shape[0], ring_k.shape[2]
  check(s >= 1, name, "S (ring slots) must be >= 1", s)
  check(0 <= layer < n_layer, name, "layer must index the ring's L layers", (layer, n_layer))
  check(ring_pos.shape == (s,), name, "ring_pos must be [S]", (ring_pos.shape, s))
  check(ring_pos.dtype == jnp.int32, name, "ring_pos dtype must be int32", ring_pos.dtype)
  check(n_past.shape in ((), (1,)), name, "n_past must be a scalar or (1,)", n_past.shape)
  check(n_past.dtype == jnp.int32, name, "n_past dtype must be int32", n_past.dtype)
  check(window is None or (isinstance(window, int) and window >= 1), name,
        "window must be None (full attention) or an int >= 1", window)
  check(isinstance(causal, bool), name, "causal must be a bool", causal)
  check(band is None or (isinstance(band, int) and not isinstance(band, bool) and band >= 1),
        name, "band must be None or an int >= 1", band)


def _check_launch(name: str, k, splits: int, block_k: int, block_q: int, terms: int) -> None:
  """Limits of the Pallas kernel only (the twin has none)."""
  check_head_dim(name, k.shape[2])
  check_width(name, k.shape[1])
  check(isinstance(splits, int) and splits >= 1, name, "splits must be an int >= 1", splits)
  check(is_pow2(block_k) and block_k >= 16, name, "block_k must be a power of 2 >= 16",
        block_k)
  check(is_pow2(block_q) and block_q >= 16, name, "block_q must be a power of 2 >= 16",
        block_q)
  check(terms in (2, 3), name, "terms (bf16 parts per float32 operand) must be 2 or 3", terms)


def chunking(n_slots: int, splits: int, block_k: int) -> tuple[int, int]:
  """(chunk, chunks): the ring's slots are cut into `chunks` = ceil(S / chunk) <= splits
  chunks of `chunk` slots, a power-of-2 number of block_k tiles (a chunk's positions load as
  one Triton tensor), the fewest tiles per chunk that `splits` chunks cover S with."""
  chunk = block_k * next_pow2(pl.cdiv(n_slots, splits * block_k))
  return chunk, pl.cdiv(n_slots, chunk)


@dataclasses.dataclass(frozen=True)
class Knobs(KnobsBase):
  """The launch knobs `default_knobs` sets (keyword arguments of `ring_attention` and its twin;
  block_q, num_warps and num_stages keep the kernel's defaults)."""
  splits: int
  block_k: int
  terms: int
  fold_own: bool = False


def default_knobs(capacity: int, window: int | None, ring_dtype, head_dim: int = 128,
                  n_seqs: int = 1, n_head_kv: int = 8, *,
                  fold_own_min_seqs: int | None) -> Knobs:
  """Launch shape and dot precision for a ring / cache of `capacity` slots (H200 sweeps,
  benchmarks/RESULTS.md: the attention sweeps and the batched attention knobs).

  bf16 ring: 128-slot tiles, 2 bf16 terms per float32 operand (~16 mantissa bits, far finer
  than the bf16 ring itself). fp32 ring: 64-slot tiles (128 spills when fp32 tiles are split
  three ways) and 3 terms, fp32-accurate like the rest of that path. Tiles shrink to a
  quarter of a small ring (>= 16 slots), and halve for head_dim > 128 (two pipeline stages of
  K and V tiles must fit shared memory). Up to 16 chunks of the ring per kv head (16 x 128 at
  the seed's 2048-slot bf16 ring was the sweep's best), 32 for a full-attention cache
  (window None), whose large capacity needs more programs to stream at bandwidth.

  A launch vmapped over n_seqs > 1 sequence slots already has n_seqs x n_head_kv x splits
  programs: splits shrink so that about 256 of them run (more only re-read and re-combine
  partials), and from 8 slots on the tiles are 64 slots. From fold_own_min_seqs slots on
  (None: never) chunk 0's program also attends the block's own keys (`fold_own`).
  """
  bf16 = jnp.dtype(ring_dtype) == jnp.bfloat16
  cap = (128 if bf16 else 64) // (2 if head_dim > 128 else 1)
  quarter = max(1, capacity // 4)
  block_k = max(16, min(cap, 1 << (quarter.bit_length() - 1)))
  if n_seqs >= 8:
    block_k = min(block_k, 64)
  splits = max(1, min(16 if window is not None else 32, pl.cdiv(capacity, block_k)))
  if n_seqs > 1:
    splits = max(1, min(splits, 256 // (n_seqs * n_head_kv)))
  fold_own = fold_own_min_seqs is not None and n_seqs >= fold_own_min_seqs
  return Knobs(splits=splits, block_k=block_k, terms=2 if bf16 else 3, fold_own=fold_own)


def _default_block_q(rows: int, dp: int) -> int:
  # One row tile up to 64 rows at head_dim 128 (the seed's 16 x 4): larger [rows, D] tiles of
  # the accumulator and the split query spill registers; wider heads get fewer rows.
  return max(16, min(next_pow2(rows), 8192 // dp))


@functools.partial(jax.jit, static_argnames=["layer", "window", "splits", "block_k",
                                             "block_q", "num_warps", "num_stages", "terms",
                                             "fold_own", "causal", "band", "out_dtype",
                                             "interpret"])
def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, ring_k: jax.Array,
                   ring_v: jax.Array, ring_pos: jax.Array, n_past: jax.Array, *,
                   layer: int, window: int | None, splits: int = 16, block_k: int = 128,
                   block_q: int | None = None, num_warps: int = 4, num_stages: int = 2,
                   terms: int = 3, fold_own: bool = False, causal: bool = False,
                   band: int | None = None, out_dtype=jnp.float32,
                   interpret: bool | None = None) -> jax.Array:
  """Attention of the block's queries over its own keys and ring layer `layer`.

  q: [Hkv, T*G, D] float32 (row r = token r // G, query head h*G + r % G); k, v: [Hkv, T, D]
  float32; ring_k, ring_v: [L, Hkv, S, D] float32 or bfloat16, any S >= 1; ring_pos: [S]
  int32 (-1 = empty); n_past: int32 scalar; window: the sliding window W, or None for a
  full-attention cache. Returns [T, Hq*D] token-major, computed in float32 and stored as
  out_dtype (bfloat16 when the output projection rounds its input to bf16 anyway). Any G;
  T up to `limits.MAX_WIDTH`; D a multiple of 16 up to 256.
  Knobs (`default_knobs`): the ring is cut into at most `splits` chunks of a power-of-2
  number of `block_k`-slot tiles (`chunking`); `block_q` query rows per program (None: all
  T*G rows up to 64 at D = 128); `num_warps` and `num_stages` of the partial kernel; `terms`
  bf16 parts per float32 dot operand (3: fp32 accuracy; 2: ~16 mantissa bits, fewer MMAs);
  `fold_own`: chunk 0's program also attends the block's own keys (one program fewer per kv
  head and no own partial to combine) instead of a program of their own. `causal` / `band`:
  DFlash2's block masks (module docstring).
  """
  name = "ring_attention"
  _check_shapes(name, q, k, v, ring_k, ring_v, ring_pos, n_past, layer, window, causal, band)
  hkv, rows, d = q.shape
  t = k.shape[1]
  group = rows // t
  n_slots = ring_k.shape[2]
  dp = next_pow2(d)
  block_q = _default_block_q(rows, dp) if block_q is None else block_q
  _check_launch(name, k, splits, block_k, block_q, terms)
  interpret = resolve_interpret(interpret)
  chunk, n_chunks = chunking(n_slots, splits, block_k)
  n_rt = pl.cdiv(rows, block_q)
  tp = max(16, next_pow2(t))
  kernel = functools.partial(_partial_kernel, rows=rows, t=t, d=d, n_slots=n_slots,
                             group=group, window=window, block_k=block_k, terms=terms,
                             n_chunks=n_chunks, n_row_tiles=n_rt, fold_own=fold_own,
                             causal=causal, band=band)
  # Grid axis 0 runs over (kv head, query row tile) pairs; one row tile: the kv head.
  if n_rt == 1:
    head, rt = (lambda p: p), (lambda p: 0)
  else:
    head, rt = (lambda p: p // n_rt), (lambda p: p % n_rt)
  # Program (., chunks) reads no ring chunk; clamping keeps its (unused) block in bounds.
  chunk_of = lambda c: jnp.minimum(c, n_chunks - 1)
  # Blocks are power-of-2 tiles; where they hang over an array's end (S, T*G, T or D not
  # fitting them) the kernel masks the lanes past it (0.11.2 Triton does not mask blocks).
  ring_spec = pl.BlockSpec((None, None, chunk, dp),
                           lambda p, c: (layer, head(p), chunk_of(c), 0))
  own_spec = pl.BlockSpec((None, tp, dp), lambda p, c: (head(p), 0, 0))
  n_part = n_chunks + (0 if fold_own else 1)
  o, m, l = pl.pallas_call(
      kernel, grid=(hkv * n_rt, n_part),
      in_specs=[pl.BlockSpec((1,), lambda p, c: (0,)),
                pl.BlockSpec((chunk,), lambda p, c: (chunk_of(c),)),
                pl.BlockSpec((None, block_q, dp), lambda p, c: (head(p), rt(p), 0)),
                own_spec, own_spec, ring_spec, ring_spec],
      out_specs=[pl.BlockSpec((None, None, block_q, dp), lambda p, c: (head(p), c, rt(p), 0)),
                 pl.BlockSpec((None, None, block_q), lambda p, c: (head(p), c, rt(p))),
                 pl.BlockSpec((None, None, block_q), lambda p, c: (head(p), c, rt(p)))],
      out_shape=[jax.ShapeDtypeStruct((hkv, n_part, rows, d), jnp.float32),
                 jax.ShapeDtypeStruct((hkv, n_part, rows), jnp.float32),
                 jax.ShapeDtypeStruct((hkv, n_part, rows), jnp.float32)],
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="ring_attn_partial",
  )(n_past.reshape(1), ring_pos, q, k, v, ring_k, ring_v)

  return combine_partials(o, m, l, t=t, d=d, fold_own=fold_own, out_dtype=out_dtype,
                          interpret=interpret)


def combine_partials(o: jax.Array, m: jax.Array, l: jax.Array, *, t: int, d: int,
                     fold_own: bool, out_dtype, interpret: bool | None = None) -> jax.Array:
  """The combine launch: merges the (o [Hkv, P, T*G, D], m and l [Hkv, P, T*G]) partials of
  the ring chunks (and, unless folded into chunk 0, the own keys' partial last) into the
  token-major [T, Hq*D] output."""
  interpret = resolve_interpret(interpret)
  hkv, n_part, rows = m.shape
  n_chunks = n_part if fold_own else n_part - 1
  group = rows // t
  dp = next_pow2(d)
  # The combine merges RB packed rows per program: one token's G heads when G is a power of
  # 2 (as many as fit: the [chunks, RB, D'] block stays <= 32K floats), else RB = the power
  # of 2 >= G rows that cross token boundaries and are scattered to their output rows.
  split_group = min(16, next_pow2(n_chunks))
  cap = max(1, 32768 // (split_group * dp))
  rb = min(next_pow2(group), 1 << (cap.bit_length() - 1))
  token_aligned = group % rb == 0
  n_ct = pl.cdiv(rows, rb)
  chunks_p = split_group * pl.cdiv(n_chunks, split_group)
  hq = hkv * group
  if token_aligned:
    # Row-major reshapes are free: the partials' rows split into (token x G/RB, RB), and the
    # [T, Hkv, G/RB, RB, D] output (G/RB = 1: [T, Hkv, G, D]) is the [T, Hq*D] buffer.
    n_sub = group // rb
    o = o.reshape(hkv, n_part, t * n_sub, rb, d)
    m = m.reshape(hkv, n_part, t * n_sub, rb)
    l = l.reshape(hkv, n_part, t * n_sub, rb)
    o_spec = pl.BlockSpec((None, chunks_p, None, rb, dp), lambda h, i: (h, 0, i, 0, 0))
    own_o_spec = pl.BlockSpec((None, None, None, rb, dp), lambda h, i: (h, n_chunks, i, 0, 0))
    stat_spec = pl.BlockSpec((None, chunks_p, None, rb), lambda h, i: (h, 0, i, 0))
    own_stat_spec = pl.BlockSpec((None, None, None, rb), lambda h, i: (h, n_chunks, i, 0))
    if n_sub == 1:
      out_shape = (t, hkv, group, d)
      out_spec = pl.BlockSpec((None, None, rb, dp), lambda h, i: (i, h, 0, 0))
    else:
      out_shape = (t, hkv, n_sub, rb, d)
      out_spec = pl.BlockSpec((None, None, None, rb, dp),
                              lambda h, i: (i // n_sub, h, i % n_sub, 0, 0))
  else:
    o_spec = pl.BlockSpec((None, chunks_p, rb, dp), lambda h, i: (h, 0, i, 0))
    own_o_spec = pl.BlockSpec((None, None, rb, dp), lambda h, i: (h, n_chunks, i, 0))
    stat_spec = pl.BlockSpec((None, chunks_p, rb), lambda h, i: (h, 0, i))
    own_stat_spec = pl.BlockSpec((None, None, rb), lambda h, i: (h, n_chunks, i))
    out_shape = (t * hq, d)
    out_spec = pl.BlockSpec(out_shape, lambda h, i: (0, 0))
  combine = functools.partial(_combine_kernel, rows=rows, d=d, group=group, n_chunks=n_chunks,
                              split_group=split_group, hq=hq, token_aligned=token_aligned,
                              fold_own=fold_own)
  own_specs, own_args = [own_o_spec, own_stat_spec, own_stat_spec], [o, m, l]
  if fold_own:
    own_specs, own_args = [], []
  out = pl.pallas_call(
      combine, grid=(hkv, n_ct),
      in_specs=[o_spec, stat_spec, stat_spec, *own_specs],
      out_specs=out_spec,
      out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
      # No loop to pipeline: one load of the whole [chunks, RB, D] block per program; 8 warps
      # beat 4 on the H200.
      compiler_params=plt.CompilerParams(num_warps=8, num_stages=1),
      interpret=interpret, name="ring_attn_combine",
  )(o, m, l, *own_args)
  return out.reshape(t, hq * d)


@functools.partial(jax.jit, static_argnames=["layer", "window", "splits", "block_k",
                                             "num_warps", "num_stages", "terms", "fold_own",
                                             "causal", "band", "out_dtype", "interpret"])
def ring_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, ring_k: jax.Array,
                             ring_v: jax.Array, ring_pos: jax.Array, n_past: jax.Array, *,
                             layer: int, window: int | None, splits: int = 16,
                             block_k: int = 128, num_warps: int = 4, num_stages: int = 2,
                             terms: int = 3, fold_own: bool = False, causal: bool = False,
                             band: int | None = None, out_dtype=jnp.float32,
                             interpret: bool | None = None) -> jax.Array:
  """Pure-jnp twin of `ring_attention`: the full score matrix, float32, precision HIGHEST.

  Any shape. Takes the kernel's knobs so that it is a drop-in replacement; they do not
  affect it.
  """
  del splits, block_k, num_warps, num_stages, terms, fold_own, interpret
  _check_shapes("ring_attention_reference", q, k, v, ring_k, ring_v, ring_pos, n_past, layer,
                window, causal, band)
  hkv, rows, d = q.shape
  t = k.shape[1]
  keys = jnp.concatenate([ring_k[layer].astype(jnp.float32), k], axis=1)
  vals = jnp.concatenate([ring_v[layer].astype(jnp.float32), v], axis=1)
  s = jnp.einsum("hrd,hkd->hrk", q, keys, precision=lax.Precision.HIGHEST) / math.sqrt(d)
  n_past = n_past.reshape(())
  tok = jnp.arange(rows, dtype=jnp.int32) // (rows // t)
  ring_vis = jnp.broadcast_to(((ring_pos >= 0) & (ring_pos < n_past))[None, :],
                              (rows, ring_pos.shape[0]))
  if window is not None:
    ring_vis &= (n_past + tok)[:, None] - ring_pos[None, :] < window
  key = jnp.arange(t, dtype=jnp.int32)[None, :]
  own_vis = jnp.ones((rows, t), bool)
  if causal:
    own_vis &= key <= tok[:, None]
  if band is not None:
    own_vis &= tok[:, None] - key < band
    if not causal:
      own_vis &= key - tok[:, None] < band
  vis = jnp.concatenate([ring_vis, own_vis], axis=1)
  p = jax.nn.softmax(jnp.where(vis[None], s, -jnp.inf), axis=-1)
  o = jnp.einsum("hrk,hkd->hrd", p, vals, precision=lax.Precision.HIGHEST)
  return o.reshape(hkv, t, rows // t, d).transpose(1, 0, 2, 3).reshape(t, -1).astype(out_dtype)
