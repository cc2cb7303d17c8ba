"""Per-head RMS norm + NEOX rope of the block's fused QKV projection, re-laid out per kv head.

One launch, one program per head: it sums the projection's split-K partials, then
normalises and ropes a query or key head or copies a value head, emitting the layouts
`ring_attention` reads (ARCHITECTURE.md, "Kernel signatures"). Any block width T, group G
and head_dim: rows past T and head-half lanes past D/2 of the power-of-2 tiles are masked.

`qk_norm_rope_cache` is the target's form: several sequences, each at its own position, the
optional q/k norm (Llama has none), the queries laid out for `cache_attention` and the keys
and values written into the K/V cache in place. Its row tile is fixed (`block_rows`), so a row
is normalised and roped by the same tile code whatever the call's width (batch invariance).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import (bf16_parts, check, is_pow2, load_tile, next_pow2,
                                    resolve_interpret, store_tile)
from pallas_kernels.limits import check_head_dim, check_width


def rms_rope_halves(x1: jax.Array, x2: jax.Array, w1: jax.Array, w2: jax.Array,
                    pos: jax.Array, inv_freq: jax.Array, eps: float, head_dim: int,
                    attention_scaling: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """rms_head then NEOX rope of rows split into halves (x1 = x[:, :D/2], x2 = x[:, D/2:]).

  Works on halves because Pallas Triton cannot slice or concatenate register values: kernels
  load and store the two halves through sliced Refs. x1, x2: [R, H] float32 with H >= D/2
  (head_dim D); w1, w2: [H] float32; pos: [R] int32; inv_freq: [H] float32. Lanes past D/2
  (a kernel's power-of-2 padding) must hold zeros in x1, x2: they add nothing to the mean
  square, which divides by head_dim. attention_scaling (static; YaRN's attention factor, 1
  otherwise) multiplies cos and sin. Shared by the kernels and their twins so that both round
  identically.
  """
  return rope_halves(*rms_halves(x1, x2, w1, w2, eps, head_dim), pos, inv_freq,
                     attention_scaling)


def rms_halves(x1: jax.Array, x2: jax.Array, w1: jax.Array, w2: jax.Array, eps: float,
               head_dim: int) -> tuple[jax.Array, jax.Array]:
  """`rms_rope_halves` without the rope (a NoPE layer's q/k norm)."""
  ms = (jnp.sum(x1 * x1, axis=-1) + jnp.sum(x2 * x2, axis=-1)) / head_dim
  r = lax.rsqrt(ms + eps)[:, None]
  return x1 * r * w1[None, :], x2 * r * w2[None, :]


def rope_halves(a: jax.Array, b: jax.Array, pos: jax.Array, inv_freq: jax.Array,
                attention_scaling: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """NEOX rope of rows split into halves a, b [R, H] at positions pos [R] (`rms_rope_halves`
  without the norm)."""
  angle = pos.astype(jnp.float32)[:, None] * inv_freq[None, :]
  c, s = jnp.cos(angle), jnp.sin(angle)
  if attention_scaling != 1.0:
    # Where HF puts it: its rotary embedding multiplies cos and sin, so q and k are each
    # scaled after the rotation (the attention logits by the factor squared).
    c, s = c * attention_scaling, s * attention_scaling
  return a * c - b * s, b * c + a * s


def _part_sum(x_ref, c0: int, sizes: tuple[int, int], limits) -> jax.Array:
  """parts[0] + parts[1] + ... of the [T, D/2] half at column c0, in that order (the twin
  folds the same way)."""
  acc = load_tile(x_ref, (0, 0, c0), (None,) + sizes, (None,) + limits)
  for i in range(1, x_ref.shape[0]):
    acc = acc + load_tile(x_ref, (i, 0, c0), (None,) + sizes, (None,) + limits)
  return acc


def _qk_norm_rope_kernel(n_past_ref, inv_ref, qn_ref, kn_ref, x_ref, *outs, group: int, t: int,
                         d: int, eps: float, attention_scaling: float, parts: bool):
  # Program (h, j): query head h*G + j for j < G, kv head h's k for j == G, its v for G + 1.
  # Blocks are [T', 2 H'] for T' and H' the powers of 2 >= T and D/2; the lanes past T and
  # D/2 are masked (no mask when T and D/2 are powers of 2).
  h = d // 2
  tp, hp = next_pow2(t), next_pow2(h)
  lims = (None if tp == t else t, None if hp == h else h)
  j = pl.program_id(1)
  x1, x2 = _part_sum(x_ref, 0, (tp, hp), lims), _part_sum(x_ref, h, (tp, hp), lims)

  # parts: each output is a pair of bf16 refs (hi, lo), q scaled by 1/sqrt(D) first.
  q_out, k_out, v_out = (outs[2 * i:2 * i + 2] for i in range(3)) if parts else outs

  def store(out, y1, y2):
    for y, c0 in ((y1, 0), (y2, h)):
      if parts:
        for ref, part in zip(out, bf16_parts(y)):
          store_tile(ref, (0, c0), part, lims)
      else:
        store_tile(out, (0, c0), y, lims)

  @pl.when(j == group + 1)
  def _():
    store(v_out, x1, x2)

  @pl.when(j <= group)
  def _():
    is_k = j == group
    pos = n_past_ref[0] + jnp.arange(tp, dtype=jnp.int32)

    def norm_half(c0):
      return jnp.where(is_k, load_tile(kn_ref, (c0,), (hp,), lims[1:]),
                       load_tile(qn_ref, (c0,), (hp,), lims[1:]))

    y1, y2 = rms_rope_halves(x1, x2, norm_half(0), norm_half(h), pos,
                             load_tile(inv_ref, (0,), (hp,), lims[1:]), eps, d,
                             attention_scaling)

    @pl.when(is_k)
    def _():
      store(k_out, y1, y2)

    @pl.when(j < group)
    def _():
      scale = 1.0 / math.sqrt(d) if parts else None
      store(q_out, *((y1, y2) if scale is None else (y1 * scale, y2 * scale)))


def _check_shapes(name: str, qkv, q_norm, k_norm, n_past, inv_freq, n_head: int,
                  n_head_kv: int) -> tuple[int, int, int]:
  """Shape and dtype checks shared by the kernel and its twin; returns (T, G, D)."""
  check(qkv.ndim in (2, 3, 4), name,
        "qkv must be [T, (Hq + 2 Hkv) * D], split-K partials [S, T, (Hq + 2 Hkv) * D] or "
        "partials with the heads split, [S, T, Hq + 2 Hkv, D]", qkv.shape)
  check(qkv.dtype == jnp.float32, name, "qkv dtype must be float32", qkv.dtype)
  check(n_head_kv > 0 and n_head % n_head_kv == 0 and n_head > 0, name,
        "n_head must be a positive multiple of n_head_kv", (n_head, n_head_kv))
  check(q_norm.ndim == 1, name, "q_norm must be rank 1 [D]", q_norm.shape)
  d = q_norm.shape[0]
  g = n_head // n_head_kv
  t = qkv.shape[1] if qkv.ndim == 4 else qkv.shape[-2]
  check(qkv.shape[0] >= 1, name, "at least one partial", qkv.shape)
  check(t >= 1, name, "T (rows of qkv) must be >= 1", t)
  check(d >= 2 and d % 2 == 0, name, "head_dim must be even and >= 2", d)
  width = qkv.shape[2] * qkv.shape[3] if qkv.ndim == 4 else qkv.shape[-1]
  check(width == (n_head + 2 * n_head_kv) * d and (qkv.ndim < 4 or qkv.shape[3] == d), name,
        "qkv width must be (n_head + 2 n_head_kv) * head_dim", (qkv.shape, n_head, n_head_kv, d))
  for arr, nm, shape in ((q_norm, "q_norm", (d,)), (k_norm, "k_norm", (d,)),
                         (inv_freq, "inv_freq", (d // 2,))):
    check(arr.shape == shape, name, f"{nm} shape must be {shape}", arr.shape)
    check(arr.dtype == jnp.float32, name, f"{nm} dtype must be float32", arr.dtype)
  check(n_past.shape in ((), (1,)), name, "n_past must be a scalar or (1,)", n_past.shape)
  check(n_past.dtype == jnp.int32, name, "n_past dtype must be int32", n_past.dtype)
  return t, g, d


@functools.partial(jax.jit, static_argnames=["n_head", "n_head_kv", "eps", "attention_scaling",
                                             "parts", "num_warps", "interpret"])
def qk_norm_rope(qkv: jax.Array, q_norm: jax.Array, k_norm: jax.Array, n_past: jax.Array,
                 inv_freq: jax.Array, *, n_head: int, n_head_kv: int, eps: float,
                 attention_scaling: float = 1.0, parts: bool = False, num_warps: int = 4,
                 interpret: bool | None = None) -> tuple[jax.Array, ...]:
  """q, k: rms_head (q_norm / k_norm) then NEOX rope at n_past + t, cos and sin times
  attention_scaling (`rms_rope_halves`); v: re-laid out only.

  qkv: [T, (Hq + 2 Hkv) * D] float32 (q heads, k heads, v heads), or the split-K partials
  [S, T, (Hq + 2 Hkv) * D] of the projection, summed here (parts[0] + parts[1] + ...) so the
  step launches no separate reduction, or those partials with the heads split,
  [S, T, Hq + 2 Hkv, D] (the form to vmap over a slot axis of the rows: the split is a
  reshape, which under vmap would first move the slot axis to the front, a copy). Returns
  float32 q [Hkv, T*G, D] (row r = token r // G, query head kvh*G + r % G), k and v
  [Hkv, T, D]. Any G; T up to `limits.MAX_WIDTH`; D a
  multiple of 16 up to 256. One program per head (grid Hkv x (G + 2)): one per kv head is
  too few programs to hide the loads' latency.
  parts=True returns instead the operands of `ring_attention_mgpu`: (q0, q1, k0, k1, v0,
  v1), the bf16 parts (`bf16_parts`) of q / sqrt(D), k and v in the same layouts, from the
  same launch (bitwise `ring_attention_mgpu.split_operands` of the float32 outputs).
  """
  name = "qk_norm_rope"
  t, g, d = _check_shapes(name, qkv, q_norm, k_norm, n_past, inv_freq, n_head, n_head_kv)
  check_head_dim(name, d)
  check_width(name, t)
  hkv = n_head_kv
  if qkv.ndim == 4:
    heads = qkv
  else:
    partials = qkv if qkv.ndim == 3 else qkv[None]
    heads = partials.reshape(partials.shape[0], t, n_head + 2 * hkv, d)

  def head_of(h, j):
    return jnp.where(j < g, h * g + j, jnp.where(j == g, n_head + h, n_head + hkv + h))

  kernel = functools.partial(_qk_norm_rope_kernel, group=g, t=t, d=d, eps=eps,
                             attention_scaling=attention_scaling, parts=parts)
  n_out, dtype = (2, jnp.bfloat16) if parts else (1, jnp.float32)
  # Power-of-2 blocks (rows T' >= T, head width 2 H' >= D) hang over the arrays' ends when T
  # or D/2 is not a power of 2; the kernel masks those lanes.
  tp, dp = next_pow2(t), 2 * next_pow2(d // 2)
  outs = pl.pallas_call(
      kernel,
      grid=(hkv, g + 2),
      in_specs=[
          pl.BlockSpec((1,), lambda h, j: (0,)),
          pl.BlockSpec((dp // 2,), lambda h, j: (0,)),
          pl.BlockSpec((dp,), lambda h, j: (0,)),
          pl.BlockSpec((dp,), lambda h, j: (0,)),
          pl.BlockSpec((heads.shape[0], tp, None, dp), lambda h, j: (0, 0, head_of(h, j), 0)),
      ],
      # Programs j >= G map to q's last head block but store nothing there.
      out_specs=[spec for spec in (
          pl.BlockSpec((None, tp, None, dp), lambda h, j: (h, 0, jnp.minimum(j, g - 1), 0)),
          pl.BlockSpec((None, tp, dp), lambda h, j: (h, 0, 0)),
          pl.BlockSpec((None, tp, dp), lambda h, j: (h, 0, 0))) for _ in range(n_out)],
      out_shape=[jax.ShapeDtypeStruct(shape, dtype) for shape in (
          (hkv, t, g, d), (hkv, t, d), (hkv, t, d)) for _ in range(n_out)],
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=resolve_interpret(interpret),
      name=name,
  )(n_past.reshape(1), inv_freq, q_norm, k_norm, heads)
  # [Hkv, T, G, D] -> [Hkv, T*G, D] merges adjacent axes: a free bitcast in XLA.
  return tuple(x.reshape(hkv, t * g, d) for x in outs[:n_out]) + tuple(outs[n_out:])


def _sum_parts(qkv: jax.Array) -> jax.Array:
  """[S, T, ...] split-K partials -> their sum in the kernels' order; a [T, W] array as is."""
  if qkv.ndim == 2:
    return qkv
  acc = qkv[0]
  for i in range(1, qkv.shape[0]):
    acc = acc + qkv[i]
  return acc


@functools.partial(jax.jit, static_argnames=["n_head", "n_head_kv", "eps", "attention_scaling"])
def qk_norm_rope_reference(qkv: jax.Array, q_norm: jax.Array, k_norm: jax.Array,
                           n_past: jax.Array, inv_freq: jax.Array, *, n_head: int,
                           n_head_kv: int, eps: float, attention_scaling: float = 1.0
                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Pure-jnp twin of `qk_norm_rope` (same arguments, minus the tuning knobs); any shape."""
  t, g, d = _check_shapes("qk_norm_rope_reference", qkv, q_norm, k_norm, n_past, inv_freq,
                          n_head, n_head_kv)
  h = d // 2
  heads = _sum_parts(qkv).reshape(t, n_head + 2 * n_head_kv, d)
  pos = n_past.reshape(()) + jnp.arange(t, dtype=jnp.int32)

  def norm_rope(x, w):  # x: [T, H, D] -> [H, T, D]
    n = x.shape[1]
    rows = jnp.transpose(x, (1, 0, 2)).reshape(n * t, d)
    y1, y2 = rms_rope_halves(rows[:, :h], rows[:, h:], w[:h], w[h:], jnp.tile(pos, n),
                             inv_freq, eps, d, attention_scaling)
    return jnp.concatenate([y1, y2], axis=-1).reshape(n, t, d)

  q = norm_rope(heads[:, :n_head], q_norm)                       # [Hq, T, D]
  q = q.reshape(n_head_kv, g, t, d).transpose(0, 2, 1, 3).reshape(n_head_kv, t * g, d)
  k = norm_rope(heads[:, n_head:n_head + n_head_kv], k_norm)
  v = jnp.transpose(heads[:, n_head + n_head_kv:], (1, 0, 2))
  return q, k, v


# --- the target's form: several sequences, the K/V cache written in place ---------------------

def _cache_kernel(start_ref, inv_ref, qn_ref, kn_ref, x_ref, _ck_in, _cv_in, q_out, ck_out,
                  cv_out, *, group: int, t: int, d: int, eps: float, qk_norm: bool,
                  attention_scaling: float, n_row_tiles: int, rope: bool, capacity: int):
  # Program (b * n_row_tiles + rt, h, j): query head h*G + j for j < G, kv head h's k for
  # j == G, its v for j == G + 1, on rows rt*TP .. rt*TP + TP - 1 of sequence b.
  h = d // 2
  tp = x_ref.shape[1]
  hp = next_pow2(h)
  rt = pl.program_id(0) % n_row_tiles
  row_lim = None if t % tp == 0 else t - rt * tp
  lims = (row_lim, None if hp == h else h)
  j = pl.program_id(2)
  x1, x2 = _part_sum(x_ref, 0, (tp, hp), lims), _part_sum(x_ref, h, (tp, hp), lims)
  n_slots = ck_out.shape[0]
  rows = rt * tp + jnp.arange(tp, dtype=jnp.int32)
  pos = start_ref[0] + rows
  if capacity:   # a ring: position p at slot p % S, positions past the capacity dropped
    keep = (rows < t) & (pos < capacity)
    slot = pos % n_slots
  else:
    keep = (rows < t) & (pos < n_slots)
    slot = pos
  # Dropped rows get distinct out-of-range slots: the mask stops them on the GPU, and interpret
  # mode's masked scatter drops them instead of racing a live row on a shared slot.
  dst = jnp.where(keep, slot, n_slots + jnp.arange(tp, dtype=jnp.int32))[:, None]
  half = jnp.arange(hp, dtype=jnp.int32)[None, :]
  m = keep[:, None] if hp == h else keep[:, None] & (half < h)

  def write(ref, y1, y2):
    plt.store(ref.at[dst, half], y1.astype(ref.dtype), mask=m)
    plt.store(ref.at[dst, half + h], y2.astype(ref.dtype), mask=m)

  @pl.when(j == group + 1)
  def _():
    write(cv_out, x1, x2)

  @pl.when(j <= group)
  def _():
    inv = load_tile(inv_ref, (0,), (hp,), lims[1:])
    if qk_norm:
      is_k = j == group

      def norm_half(c0):
        return jnp.where(is_k, load_tile(kn_ref, (c0,), (hp,), lims[1:]),
                         load_tile(qn_ref, (c0,), (hp,), lims[1:]))

      if rope:
        y1, y2 = rms_rope_halves(x1, x2, norm_half(0), norm_half(h), pos, inv, eps, d,
                                 attention_scaling)
      else:
        y1, y2 = rms_halves(x1, x2, norm_half(0), norm_half(h), eps, d)
    elif rope:
      y1, y2 = rope_halves(x1, x2, pos, inv, attention_scaling)
    else:
      y1, y2 = x1, x2

    @pl.when(j == group)
    def _():
      write(ck_out, y1, y2)

    @pl.when(j < group)
    def _():
      store_tile(q_out, (0, 0), y1.astype(q_out.dtype), lims)
      store_tile(q_out, (0, h), y2.astype(q_out.dtype), lims)


def _check_cache_shapes(name: str, parts, q_norm, k_norm, cache_k, cache_v, start, inv_freq,
                        n_head: int, n_head_kv: int) -> tuple[int, int, int, int]:
  """Checks shared by `qk_norm_rope_cache` and its twin; returns (B, T, G, D)."""
  check(n_head_kv > 0 and n_head > 0 and n_head % n_head_kv == 0, name,
        "n_head must be a positive multiple of n_head_kv", (n_head, n_head_kv))
  check(parts.ndim == 5, name, "parts must be [P, B, T, n_head + 2 n_head_kv, D]", parts.shape)
  check(parts.dtype == jnp.float32, name, "parts dtype must be float32", parts.dtype)
  n_parts, b, t, nh, d = parts.shape
  check(n_parts >= 1 and b >= 1 and t >= 1, name, "P, B and T must be >= 1", parts.shape)
  check(nh >= n_head + 2 * n_head_kv, name,
        "parts must hold at least n_head + 2 n_head_kv heads", (nh, n_head, n_head_kv))
  check(d >= 2 and d % 2 == 0, name, "head_dim must be even and >= 2", d)
  check(cache_k.ndim == 4 and cache_k.shape[0] == b and cache_k.shape[1] == n_head_kv
        and cache_k.shape[3] == d, name, "cache_k must be [B, n_head_kv, S, D]",
        (cache_k.shape, b, n_head_kv, d))
  check(cache_v.shape == cache_k.shape and cache_v.dtype == cache_k.dtype, name,
        "cache_v must match cache_k", (cache_v.shape, cache_v.dtype, cache_k.dtype))
  check(cache_k.dtype in (jnp.float32, jnp.bfloat16), name,
        "cache dtype must be float32 or bfloat16", cache_k.dtype)
  for arr, nm, shape in ((q_norm, "q_norm", (d,)), (k_norm, "k_norm", (d,)),
                         (inv_freq, "inv_freq", (d // 2,))):
    check(arr.shape == shape, name, f"{nm} shape must be {shape}", arr.shape)
    check(arr.dtype == jnp.float32, name, f"{nm} dtype must be float32", arr.dtype)
  check(start.shape == (b,) and start.dtype == jnp.int32, name, "start must be int32 [B]",
        (start.shape, start.dtype))
  return b, t, n_head // n_head_kv, d


@functools.partial(jax.jit, static_argnames=["n_head", "n_head_kv", "eps", "qk_norm",
                                             "attention_scaling", "rope", "capacity",
                                             "block_rows", "num_warps", "interpret"])
def qk_norm_rope_cache(parts: jax.Array, q_norm: jax.Array, k_norm: jax.Array,
                       cache_k: jax.Array, cache_v: jax.Array, start: jax.Array,
                       inv_freq: jax.Array, *, n_head: int, n_head_kv: int, eps: float,
                       qk_norm: bool = True, attention_scaling: float = 1.0,
                       rope: bool = True, capacity: int = 0,
                       block_rows: int = 16, num_warps: int = 4,
                       interpret: bool | None = None
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A target pass's q/k/v from its fused projection: q and k normalised (q_norm / k_norm,
  when qk_norm) and roped (NEOX; not when rope is False: a NoPE layer) at positions
  start[b] + t, cos and sin times attention_scaling (`rms_rope_halves`), v as is.

  parts: the projection's split-K partials [P, B, T, heads, D] float32 with heads >=
  n_head + 2 n_head_kv (q, k, v first; heads past them, e.g. Muse-Glimmer's output gate, are
  not read), summed parts[0] + parts[1] + ... here; P = 1 for an unsplit product; the
  [P, B T, W] partials reshape to this for free. cache_k, cache_v: [B, n_head_kv, S, D]
  float32 or bfloat16. capacity 0: slot = position, rows t < T go to slots start[b] + t
  (rows at slots >= S write nothing; the caller keeps start + T <= S). capacity > 0: the
  cache is a ring (a sliding-window layer's) over positions below capacity: position p goes
  to slot p % S, rows at positions >= capacity write nothing. Returns (q [B, n_head_kv, T G, D] in the cache dtype, row t G + g = token
  t, query head h G + g; the updated cache_k and cache_v, aliased to the inputs: in place
  under a donating jit). `block_rows` rows per program (a power of 2), the same tile for
  every T. D a multiple of 16 up to 256.
  """
  name = "qk_norm_rope_cache"
  b, t, g, d = _check_cache_shapes(name, parts, q_norm, k_norm, cache_k, cache_v, start,
                                   inv_freq, n_head, n_head_kv)
  check_head_dim(name, d)
  check(is_pow2(block_rows), name, "block_rows must be a power of 2", block_rows)
  hkv, n_parts = n_head_kv, parts.shape[0]
  n_rt = pl.cdiv(t, block_rows)
  dp = 2 * next_pow2(d // 2)
  s = cache_k.shape[2]

  def head_of(h, j):
    return jnp.where(j < g, h * g + j, jnp.where(j == g, n_head + h, n_head + hkv + h))

  cache_spec = pl.BlockSpec((None, None, s, d), lambda p, h, j: (p // n_rt, h, 0, 0))
  q, ck, cv = pl.pallas_call(
      functools.partial(_cache_kernel, group=g, t=t, d=d, eps=eps, qk_norm=qk_norm,
                        attention_scaling=attention_scaling, n_row_tiles=n_rt, rope=rope,
                        capacity=capacity),
      grid=(b * n_rt, hkv, g + 2),
      in_specs=[
          pl.BlockSpec((1,), lambda p, h, j: (p // n_rt,)),
          pl.BlockSpec((dp // 2,), lambda p, h, j: (0,)),
          pl.BlockSpec((dp,), lambda p, h, j: (0,)),
          pl.BlockSpec((dp,), lambda p, h, j: (0,)),
          # Row tiles past T and a head width past D hang over the arrays' ends (masked).
          pl.BlockSpec((n_parts, None, block_rows, None, dp),
                       lambda p, h, j: (0, p // n_rt, p % n_rt, head_of(h, j), 0)),
          cache_spec, cache_spec,
      ],
      # Programs j >= G map to q's last head block but store nothing there.
      out_specs=[pl.BlockSpec((None, None, block_rows, None, dp),
                              lambda p, h, j: (p // n_rt, h, p % n_rt, jnp.minimum(j, g - 1), 0)),
                 cache_spec, cache_spec],
      out_shape=[jax.ShapeDtypeStruct((b, hkv, t, g, d), cache_k.dtype),
                 jax.ShapeDtypeStruct(cache_k.shape, cache_k.dtype),
                 jax.ShapeDtypeStruct(cache_v.shape, cache_v.dtype)],
      input_output_aliases={5: 1, 6: 2},
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=resolve_interpret(interpret),
      name=name,
  )(start, inv_freq, q_norm, k_norm, parts, cache_k, cache_v)
  # [B, Hkv, T, G, D] -> [B, Hkv, T*G, D] merges adjacent axes: a free bitcast in XLA.
  return q.reshape(b, hkv, t * g, d), ck, cv


@functools.partial(jax.jit, static_argnames=["n_head", "n_head_kv", "eps", "qk_norm",
                                             "attention_scaling", "rope", "capacity"])
def qk_norm_rope_cache_reference(parts: jax.Array, q_norm: jax.Array, k_norm: jax.Array,
                                 cache_k: jax.Array, cache_v: jax.Array, start: jax.Array,
                                 inv_freq: jax.Array, *, n_head: int, n_head_kv: int,
                                 eps: float, qk_norm: bool = True, attention_scaling: float = 1.0,
                                 rope: bool = True, capacity: int = 0
                                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Pure-jnp twin of `qk_norm_rope_cache` (same arguments, minus the tuning knobs)."""
  b, t, g, d = _check_cache_shapes("qk_norm_rope_cache_reference", parts, q_norm, k_norm,
                                   cache_k, cache_v, start, inv_freq, n_head, n_head_kv)
  h, hkv, s = d // 2, n_head_kv, cache_k.shape[2]
  x = parts[0]
  for i in range(1, parts.shape[0]):
    x = x + parts[i]                                       # [B, T, heads, D]
  pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)    # [B, T]

  def norm_rope(heads, w):   # [B, T, n, D] -> [B, n, T, D]
    n = heads.shape[2]
    rows = heads.transpose(0, 2, 1, 3).reshape(b * n * t, d)
    p = jnp.broadcast_to(pos[:, None], (b, n, t)).reshape(-1)
    y1, y2 = rows[:, :h], rows[:, h:]
    if qk_norm:
      y1, y2 = rms_halves(y1, y2, w[:h], w[h:], eps, d)
    if rope:
      y1, y2 = rope_halves(y1, y2, p, inv_freq, attention_scaling)
    return jnp.concatenate([y1, y2], axis=-1).reshape(b, n, t, d)

  q = norm_rope(x[:, :, :n_head], q_norm).reshape(b, hkv, g, t, d)
  q = q.transpose(0, 1, 3, 2, 4).reshape(b, hkv, t * g, d).astype(cache_k.dtype)
  k = norm_rope(x[:, :, n_head:n_head + hkv], k_norm)
  v = x[:, :, n_head + hkv:n_head + 2 * hkv].transpose(0, 2, 1, 3)
  if capacity:
    slot = jnp.where(pos < capacity, pos % s, s)           # s: dropped
  else:
    slot = jnp.where(pos < s, pos, s)
  bi = jnp.arange(b)[:, None]

  def write(cache, rows):   # rows [B, Hkv, T, D] -> cache[b, :, slot[b, t]]
    return cache.at[bi, :, slot].set(rows.transpose(0, 2, 1, 3).astype(cache.dtype), mode="drop")

  return q, write(cache_k, k), write(cache_v, v)
