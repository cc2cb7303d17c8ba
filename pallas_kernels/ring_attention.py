"""Sliding-window GQA attention of the drafter block over its own keys plus the K/V ring.

Two launches. `ring_attn_partial` runs a grid (Hkv, splits + 1): program (h, s < splits)
attends the packed query tile of kv head h (T*G rows: token r // G, query head h*G + r % G)
over ring chunk s with an online softmax and writes an unnormalised partial (o, m, l); program
(h, splits) does the same over the block's own T keys, so no ring program carries that extra
work (measured on the H200: 8.3 vs 9.0 us). `ring_attn_combine` runs a grid (Hkv, T) and merges
the splits + 1 partials of one token's G query heads straight into the token-major [T, Hq*D]
output. One program per kv head would fill only Hkv of the H200's 132 SMs (measured 33 us vs
~6 us with 16 splits); combining in XLA cost ~4 us in 3 launches.

Visibility (SPEC.md section 3): token t sees all T block keys, and ring slot j iff
0 <= ring_pos[j] < n_past and n_past + t - ring_pos[j] < W.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import check, is_pow2, resolve_interpret

# Finite so that fully masked rows, tiles and splits never produce inf - inf = NaN: a row
# whose scores are all MASK gets exp(0) = 1 weights (garbage), but its running max stays MASK
# and every real score later rescales that garbage by exp(MASK - real) = 0; a split that
# never sees a real score keeps m = MASK and gets weight 0 in the combine. Each row always
# has a real score somewhere because the block's own keys are always visible.
MASK = -0.7 * float(np.finfo(np.float32).max)

# Dots must be fp32-accurate, and plain f32 dots run as TF32 on the GPU (1.8e-2 error
# measured on the H200). Each float32 operand is split into `terms` bf16 parts (x = x0 + x1
# + ..., each part the bf16 rounding of the remainder) and the part products of order < terms
# are summed with fp32 accumulation: terms=3 keeps ~24 mantissa bits (fp32), terms=2 ~16. A
# bf16 ring tile is exact as one part, so q.k costs `terms` bf16 MMAs. The query is split once
# per program, not once per tile as lax.DotAlgorithmPreset.BF16_BF16_F32_X3 would (measured on
# the H200: 14.6 us per layer with that preset, 41 us with tf32x3). The interpreter runs the
# same arithmetic, so CPU tests see GPU numerics.


def _split(x: jax.Array, terms: int) -> list[jax.Array]:
  parts = []
  for _ in range(terms):
    part = x.astype(jnp.bfloat16)
    parts.append(part)
    x = x - part.astype(jnp.float32)
  return parts


def _bdot(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
  return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _split_dot(a_parts: list[jax.Array], b: jax.Array, contract_b: int) -> jax.Array:
  """(sum of a_parts) times b, fp32-accurate; b is bf16 (exact) or float32 (split too)."""
  terms = len(a_parts)
  b_parts = [b] if b.dtype == jnp.bfloat16 else _split(b, terms)
  # Smallest products first, so they are not lost against the large ones.
  pairs = sorted(((i, j) for i in range(terms) for j in range(len(b_parts)) if i + j < terms),
                 key=lambda ij: -(ij[0] + ij[1]))
  out = None
  for i, j in pairs:
    prod = _bdot(a_parts[i], b_parts[j], contract_b)
    out = prod if out is None else out + prod
  return out


def _partial_kernel(n_past_ref, pos_ref, q_ref, k_ref, v_ref, rk_ref, rv_ref,
                    o_ref, m_ref, l_ref, *, group: int, window: int, block_k: int,
                    terms: int, splits: int):
  rows, d = q_ref.shape
  chunk = pos_ref.shape[0]
  n_past = n_past_ref[0]
  q_parts = _split(q_ref[...] * (1.0 / math.sqrt(d)), terms)
  # Slot j is visible to row r iff lo[r] < pos[j] (the window edge) and 0 <= pos[j] < n_past.
  lo = (n_past - window + jnp.arange(rows, dtype=jnp.int32) // group)[:, None]

  def update(carry, s, v):
    acc, m, l = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    acc = acc * corr[:, None] + _split_dot(_split(p, terms), v, 0)
    return acc, m_new, l * corr + jnp.sum(p, axis=1)

  init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), MASK, jnp.float32),
          jnp.zeros((rows,), jnp.float32))

  def own_block(carry):
    return update(carry, _split_dot(q_parts, k_ref[...], 1), v_ref[...])

  def ring_tile(i, carry):
    sl = pl.ds(i * block_k, block_k)
    pos = pos_ref[sl]
    vis = (pos[None, :] >= 0) & (pos[None, :] < n_past) & (pos[None, :] > lo)
    s = _split_dot(q_parts, rk_ref[sl, :], 1)
    return update(carry, jnp.where(vis, s, MASK), rv_ref[sl, :])

  def ring_chunk(carry):
    # One test per chunk (row 0 has the widest window, so a chunk with no slot visible to row
    # 0 is invisible to all rows); no branch inside the loop, so its loads can be pipelined.
    chunk_pos = pos_ref[...]
    any_vis = jnp.max(((chunk_pos >= 0) & (chunk_pos < n_past)
                       & (chunk_pos > n_past - window)).astype(jnp.int32)) > 0
    return lax.cond(any_vis, lambda c: lax.fori_loop(0, chunk // block_k, ring_tile, c),
                    lambda c: c, carry)

  acc, m, l = lax.cond(pl.program_id(1) == splits, own_block, ring_chunk, init)
  o_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def _combine_kernel(o_ref, m_ref, l_ref, own_o_ref, own_m_ref, own_l_ref, out_ref):
  # Blocks: o [splits, G, D], m and l [splits, G] (the ring chunks) and own_o [G, D], own_m
  # and own_l [G] (the block's own keys): one token's G query heads.
  m, own_m = m_ref[...], own_m_ref[...]
  top = jnp.maximum(jnp.max(m, axis=0), own_m)
  w = jnp.exp(m - top[None, :])
  own_w = jnp.exp(own_m - top)
  denom = jnp.sum(w * l_ref[...], axis=0) + own_w * own_l_ref[...]
  num = jnp.sum(w[:, :, None] * o_ref[...], axis=0) + own_w[:, None] * own_o_ref[...]
  out_ref[...] = (num / denom[:, None]).astype(out_ref.dtype)


def _check_shapes(name: str, q, k, v, ring_k, ring_v, ring_pos, n_past, layer: int,
                  window: int | None) -> None:
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


def _check_launch(name: str, q, ring_k, splits: int, block_k: int, terms: int) -> None:
  """Limits of the Pallas kernel only (the twin has none)."""
  d = q.shape[2]
  rows = q.shape[1]
  w = ring_k.shape[2]
  check(is_pow2(d) and d % 16 == 0, name, "D must be a power of 2 and a multiple of 16", d)
  check(is_pow2(rows) and rows >= 16, name, "T*G (rows of q) must be a power of 2 >= 16",
        rows)
  check(is_pow2(splits), name, "splits must be a power of 2", splits)
  check(is_pow2(block_k) and block_k >= 16, name, "block_k must be a power of 2 >= 16",
        block_k)
  check(terms in (2, 3), name, "terms (bf16 parts per float32 operand) must be 2 or 3", terms)
  check(w > 0 and w % (splits * block_k) == 0, name,
        "W must be a positive multiple of splits * block_k",
        (w, splits, block_k))
  check(is_pow2(w // splits), name,
        "W / splits must be a power of 2 (a split's positions load as one Triton tile)",
        (w, splits))


@functools.partial(jax.jit, static_argnames=["layer", "window", "splits", "block_k",
                                             "num_warps", "num_stages", "terms", "out_dtype",
                                             "interpret"])
def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, ring_k: jax.Array,
                   ring_v: jax.Array, ring_pos: jax.Array, n_past: jax.Array, *,
                   layer: int, window: int | None, splits: int = 16, block_k: int = 128,
                   num_warps: int = 4, num_stages: int = 2, terms: int = 3, out_dtype=jnp.float32,
                   interpret: bool | None = None) -> jax.Array:
  """Attention of the block's queries over its own keys and ring layer `layer`.

  q: [Hkv, T*G, D] float32 (row r = token r // G, query head h*G + r % G); k, v: [Hkv, T, D]
  float32; ring_k, ring_v: [L, Hkv, W, D] float32 or bfloat16; ring_pos: [W] int32 (-1 =
  empty); n_past: int32 scalar. Returns [T, Hq*D] token-major, computed in float32 and
  stored as out_dtype (bfloat16 when the output projection rounds its input to bf16 anyway).
  Knobs: `splits` ring chunks per kv head, `block_k` ring slots per tile, `num_warps` and
  `num_stages` of the partial kernel, `terms` bf16 parts per float32 dot operand (3: fp32
  accuracy; 2: ~16 mantissa bits, fewer MMAs).
  """
  name = "ring_attention"
  _check_shapes(name, q, k, v, ring_k, ring_v, ring_pos, n_past, layer, window)
  _check_launch(name, q, ring_k, splits, block_k, terms)
  check(window == ring_k.shape[2], name, "window must equal the ring's slot count",
        (window, ring_k.shape[2]))
  interpret = resolve_interpret(interpret)
  hkv, rows, d = q.shape
  t = k.shape[1]
  group = rows // t
  window = ring_k.shape[2]
  chunk = window // splits
  kernel = functools.partial(_partial_kernel, group=group, window=window, block_k=block_k,
                             terms=terms, splits=splits)
  # Program (h, splits) reads no ring chunk; clamping keeps its (unused) block in bounds.
  chunk_of = lambda s: jnp.minimum(s, splits - 1)
  ring_spec = pl.BlockSpec((None, None, chunk, d), lambda h, s: (layer, h, chunk_of(s), 0))
  own_spec = pl.BlockSpec((None, t, d), lambda h, s: (h, 0, 0))
  n_part = splits + 1
  o, m, l = pl.pallas_call(
      kernel, grid=(hkv, n_part),
      in_specs=[pl.BlockSpec((1,), lambda h, s: (0,)),
                pl.BlockSpec((chunk,), lambda h, s: (chunk_of(s),)),
                pl.BlockSpec((None, rows, d), lambda h, s: (h, 0, 0)),
                own_spec, own_spec, ring_spec, ring_spec],
      out_specs=[pl.BlockSpec((None, None, rows, d), lambda h, s: (h, s, 0, 0)),
                 pl.BlockSpec((None, None, rows), lambda h, s: (h, s, 0)),
                 pl.BlockSpec((None, None, rows), lambda h, s: (h, s, 0))],
      out_shape=[jax.ShapeDtypeStruct((hkv, n_part, rows, d), jnp.float32),
                 jax.ShapeDtypeStruct((hkv, n_part, rows), jnp.float32),
                 jax.ShapeDtypeStruct((hkv, n_part, rows), jnp.float32)],
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="ring_attn_partial",
  )(n_past.reshape(1), ring_pos, q, k, v, ring_k, ring_v)

  # Row-major reshapes are free: the partials split rows into (token, head), and the
  # combine writes [T, Hkv, G, D], which is the [T, Hq*D] buffer.
  o = o.reshape(hkv, n_part, t, group, d)
  m = m.reshape(hkv, n_part, t, group)
  l = l.reshape(hkv, n_part, t, group)
  # The ring partials load as one [splits, ...] block (a power of 2, as Triton tiles must
  # be) and the own-keys partial, index `splits`, as a second operand over the same buffers.
  stat_spec = pl.BlockSpec((None, splits, None, group), lambda h, i: (h, 0, i, 0))
  own_stat_spec = pl.BlockSpec((None, None, None, group), lambda h, i: (h, splits, i, 0))
  out = pl.pallas_call(
      _combine_kernel, grid=(hkv, t),
      in_specs=[pl.BlockSpec((None, splits, None, group, d), lambda h, i: (h, 0, i, 0, 0)),
                stat_spec, stat_spec,
                pl.BlockSpec((None, None, None, group, d), lambda h, i: (h, splits, i, 0, 0)),
                own_stat_spec, own_stat_spec],
      out_specs=pl.BlockSpec((None, None, group, d), lambda h, i: (i, h, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((t, hkv, group, d), out_dtype),
      # No loop to pipeline: one load of the whole [splits, G, D] block per program; 8 warps
      # measured 3.0 vs 4.0 us with 4 (H200).
      compiler_params=plt.CompilerParams(num_warps=8, num_stages=1),
      interpret=interpret, name="ring_attn_combine",
  )(o, m, l, o, m, l)
  return out.reshape(t, hkv * group * d)


@functools.partial(jax.jit, static_argnames=["layer", "window", "splits", "block_k",
                                             "num_warps", "num_stages", "terms", "out_dtype",
                                             "interpret"])
def ring_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, ring_k: jax.Array,
                             ring_v: jax.Array, ring_pos: jax.Array, n_past: jax.Array, *,
                             layer: int, window: int | None, splits: int = 16,
                             block_k: int = 128, num_warps: int = 4, num_stages: int = 2,
                             terms: int = 3, out_dtype=jnp.float32,
                             interpret: bool | None = None) -> jax.Array:
  """Pure-jnp twin of `ring_attention`: the full score matrix, float32, precision HIGHEST.

  Any shape. Takes the kernel's knobs so that it is a drop-in replacement; they do not
  affect it.
  """
  del splits, block_k, num_warps, num_stages, terms, interpret
  _check_shapes("ring_attention_reference", q, k, v, ring_k, ring_v, ring_pos, n_past, layer,
                window)
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
  vis = jnp.concatenate([ring_vis, jnp.ones((rows, t), bool)], axis=1)
  p = jax.nn.softmax(jnp.where(vis[None], s, -jnp.inf), axis=-1)
  o = jnp.einsum("hrk,hkd->hrd", p, vals, precision=lax.Precision.HIGHEST)
  return o.reshape(hkv, t, rows // t, d).transpose(1, 0, 2, 3).reshape(t, -1).astype(out_dtype)
