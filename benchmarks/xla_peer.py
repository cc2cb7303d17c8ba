"""The plain-XLA block step made as strong as XLA allows: benchmarks.run's `xla_peer` column.

`impl="xla"` of dflash_jax.drafter.step runs the Pallas kernels' jnp twins, written to be read and to
certify the kernels: every dot float32 at HIGHEST precision, each layer's ring converted to
float32 and concatenated with the block's keys, quantized weights dequantized to float32.
That is a weak peer. This step computes the same function (the same bf16 rounding points,
SPEC.md section 5; the same attention accuracy as the kernel) the way XLA runs it fastest:
- Layers unrolled (a Python loop); every layer's weights are their own arrays, and so is
  every layer's ring (`peer_ring`, made once outside the step): nothing is sliced per layer
  inside the step (a slice of a stacked array is a copy in XLA).
- One GEMM for q/k/v (the fused [(Hq + 2 Hkv) D, n_embd] weight) and one for gate+up, bf16
  operands with float32 accumulation; fp8 weights enter the dot as bf16 (exact) with their
  row scale applied to its output (exact: powers of two); q8_0 weights are dequantized to
  bf16 per block (the rounding SPEC fixes) where XLA may fuse it into the GEMM.
- Attention in plain jnp over the layer's ring in its stored dtype (no float32 copy, no
  concatenation): scores over the ring and over the block's own keys separately, one softmax
  over both. With a bf16 ring the float32 queries and probabilities enter the ring's dots as
  two bf16 terms (hi + lo) stacked on the row axis (one GEMM reading the ring once; the
  kernel's `terms=2`); with a float32 ring the dots are float32 at HIGHEST (`terms=3`).
Only the unbatched step (one sequence, `block_step`'s contract).
"""
from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from dflash_jax.dispatch import QuantWeight, rms_norm
from dflash_jax.drafter.step import RingState
from dflash_jax.drafter.weights import DrafterParams
from pallas_kernels.norm_rope import rms_rope_halves

F32, BF16 = jnp.float32, jnp.bfloat16


@flax.struct.dataclass
class LayerKV:
  """One layer's stored K/V: k, v [Hkv, S, D] in the ring dtype, pos [S] int32 (-1 empty);
  window: the sliding window (None: a full-attention cache)."""
  k: jax.Array
  v: jax.Array
  pos: jax.Array
  window: int | None = flax.struct.field(pytree_node=False)


def peer_ring(params: DrafterParams, ring: RingState) -> tuple[LayerKV, ...]:
  """The ring as one LayerKV per layer (device copies of each layer's K/V, made here, outside
  the step)."""
  cfg = params.cfg
  out = []
  for l in range(cfg.n_layer):
    c = ring.cache(cfg.kinds[l])
    i = cfg.index_in_kind(l)
    out.append(LayerKV(k=c.k[i], v=c.v[i], pos=c.pos, window=c.window))
  return tuple(out)


def _dot(x: jax.Array, w: jax.Array, precision=None) -> jax.Array:
  return lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=precision,
                         preferred_element_type=F32)


def gemm(x: jax.Array, w) -> jax.Array:
  """x @ w^T in float32 for a weight in (out, in) layout, as `params.linear` computes it."""
  if isinstance(w, QuantWeight):
    if w.fmt == "fp8":
      return _dot(x.astype(BF16), w.data.astype(BF16)) * w.scale
    n, k = w.data.shape
    deq = w.data.reshape(n, k // 32, 32).astype(F32) * w.scale[:, :, None]
    return _dot(x.astype(BF16), deq.astype(BF16).reshape(n, k))
  if w.dtype == BF16:
    return _dot(x.astype(BF16), w)
  return _dot(x.astype(F32), w, lax.Precision.HIGHEST)


def _terms(x: jax.Array) -> jax.Array:
  """float32 [H, R, C] -> bf16 [H, 2R, C]: hi rows, then lo rows (hi + lo = x to ~16 bits)."""
  hi = x.astype(BF16)
  return jnp.concatenate([hi, (x - hi.astype(F32)).astype(BF16)], axis=1)


def _ring_dot(spec: str, a: jax.Array, ring: jax.Array) -> jax.Array:
  """einsum(spec, a, ring) with a float32 [H, R, .]: two bf16 terms against a bf16 ring,
  HIGHEST float32 against a float32 one."""
  if ring.dtype == BF16:
    r = a.shape[1]
    both = jnp.einsum(spec, _terms(a), ring, preferred_element_type=F32)
    return both[:, :r] + both[:, r:]
  return jnp.einsum(spec, a, ring, precision=lax.Precision.HIGHEST, preferred_element_type=F32)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, kv: LayerKV,
              n_past: jax.Array) -> jax.Array:
  """q [Hkv, T G, D] (row r: token r // G), k, v [Hkv, T, D] float32 -> [T, Hq D] float32.
  Ring slot j is visible to token t iff 0 <= pos[j] < n_past and, with a window W,
  n_past + t - pos[j] < W; the block's own keys are all visible (non-causal)."""
  hkv, rows, d = q.shape
  t = k.shape[1]
  scale = 1.0 / math.sqrt(d)
  s_ring = _ring_dot("hrd,hsd->hrs", q, kv.k) * scale
  s_blk = jnp.einsum("hrd,htd->hrt", q, k, precision=lax.Precision.HIGHEST) * scale
  tok = jnp.arange(rows, dtype=jnp.int32) // (rows // t)
  vis = ((kv.pos >= 0) & (kv.pos < n_past))[None, :]
  if kv.window is not None:
    vis = vis & ((n_past + tok)[:, None] - kv.pos[None, :] < kv.window)
  s_ring = jnp.where(vis[None], s_ring, -jnp.inf)
  m = jnp.maximum(s_ring.max(-1, keepdims=True), s_blk.max(-1, keepdims=True))
  p_ring, p_blk = jnp.exp(s_ring - m), jnp.exp(s_blk - m)
  denom = p_ring.sum(-1, keepdims=True) + p_blk.sum(-1, keepdims=True)
  o = (_ring_dot("hrs,hsd->hrd", p_ring, kv.v)
       + jnp.einsum("hrt,htd->hrd", p_blk, v, precision=lax.Precision.HIGHEST)) / denom
  return o.reshape(hkv, t, rows // t, d).transpose(1, 0, 2, 3).reshape(t, -1)


def block_step(params: DrafterParams, ring: tuple[LayerKV, ...], id_last: jax.Array,
               n_past: jax.Array, *, width: int | None = None) -> jax.Array:
  """`dflash_jax.drafter.step.block_step` (logits [w, n_vocab] float32 of [id_last, mask x (w-1)] at
  n_past..) on the ring of `peer_ring`."""
  cfg = params.cfg
  w = cfg.resolve_width(width)
  hq, hkv, d = cfg.n_head, cfg.n_head_kv, cfg.head_dim
  g = hq // hkv
  act = F32 if params.weight_format == "fp32" else BF16
  n_past = jnp.asarray(n_past, jnp.int32)
  tokens = jnp.full((w,), cfg.mask_token_id, jnp.int32).at[0].set(id_last)
  x = params.tok_embd[tokens].astype(F32)
  pos = n_past + jnp.arange(w, dtype=jnp.int32)

  def norm_rope(heads, weight):   # [w, H, D] -> [w, H, D]
    n = heads.shape[1]
    rows = heads.reshape(w * n, d)
    y1, y2 = rms_rope_halves(rows[:, :d // 2], rows[:, d // 2:], weight[:d // 2],
                             weight[d // 2:], jnp.repeat(pos, n), params.inv_freq, cfg.eps, d,
                             cfg.rope_scaling.attention_scaling)
    return jnp.concatenate([y1, y2], axis=-1).reshape(w, n, d)

  for lp, kv in zip(params.layers, ring):
    heads = gemm(rms_norm(x, lp.attn_norm, cfg.eps), lp.wqkv).reshape(w, hq + 2 * hkv, d)
    q = norm_rope(heads[:, :hq], lp.q_norm)
    k = norm_rope(heads[:, hq:hq + hkv], lp.k_norm)
    q = q.reshape(w, hkv, g, d).transpose(1, 0, 2, 3).reshape(hkv, w * g, d)
    o = attention(q, k.transpose(1, 0, 2), heads[:, hq + hkv:].transpose(1, 0, 2), kv, n_past)
    x = x + gemm(o.astype(act), lp.wo)
    gu = gemm(rms_norm(x, lp.ffn_norm, cfg.eps), lp.wgu)
    n_ff = gu.shape[-1] // 2
    x = x + gemm((jax.nn.silu(gu[:, :n_ff]) * gu[:, n_ff:]).astype(act), lp.wd)
  return gemm(rms_norm(x, params.out_norm, cfg.eps), params.lm_head)


block_step_jit = jax.jit(block_step, static_argnames=("width",))
