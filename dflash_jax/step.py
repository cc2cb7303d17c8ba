"""The functional drafter: pure, jittable functions over (params, ring).

`impl="pallas"` runs the fused Pallas kernels; `impl="xla"` runs their pure-jnp twins (the same
step in plain XLA, used as a peer in benchmarks and as a second opinion in tests). Jitted entry
points donate the ring, so under XLA the inject kernels update it in place.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from dflash_jax.config import FULL, SLIDING, DFlashConfig
from dflash_jax.params import DrafterParams, linear, resolve_dtype, rms_norm
from pallas_kernels import accept as accept_k
from pallas_kernels import inject as inject_k
from pallas_kernels import norm_rope as norm_rope_k
from pallas_kernels import ring_attention as attn_k

IMPLS = ("pallas", "xla")


@flax.struct.dataclass
class KVCache:
  """The stored K/V of one attention kind's layers (`cfg.layers_of(kind)`, stacked in layer
  order): k, v [L_kind, Hkv, S, D] in the ring dtype, pos [S] int32 (-1 = empty), shared by
  those layers. "sliding_attention": a ring of S = W slots, position p in slot p % W, later
  rows win. "full_attention": S = capacity slots, position p in slot p; p >= S is never
  stored (DFlashDrafter raises before such an inject)."""
  k: jax.Array
  v: jax.Array
  pos: jax.Array
  kind: str = flax.struct.field(pytree_node=False)

  @property
  def slots(self) -> int:
    return int(self.pos.shape[-1])

  @property
  def window(self) -> int | None:
    """The attention window: the slot count of a sliding ring, None for full attention."""
    return self.slots if self.kind == SLIDING else None


@flax.struct.dataclass
class RingState:
  """Every layer's stored K/V: one KVCache per attention kind that some layer has (None for
  the other). A drafter whose layers all slide has exactly `sliding` (the one ring of all
  layers). Every leaf may take a leading batch axis (vmap) in front of these shapes."""
  sliding: KVCache | None = None
  full: KVCache | None = None

  def caches(self) -> tuple[KVCache, ...]:
    """The caches present, sliding first."""
    return tuple(c for c in (self.sliding, self.full) if c is not None)

  def cache(self, kind: str) -> KVCache:
    c = self.sliding if kind == SLIDING else self.full
    if c is None:
      raise ValueError(f"this ring holds no {kind} layers")
    return c

  @property
  def window(self) -> int | None:
    """The sliding window W (None when no layer slides)."""
    return None if self.sliding is None else self.sliding.slots

  @property
  def capacity(self) -> int | None:
    """Positions the full-attention cache holds (None when no layer has full attention)."""
    return None if self.full is None else self.full.slots


def init_ring(cfg: DFlashConfig, window: int | None = None, ring_dtype: Any = "fp32",
              capacity: int | None = None) -> RingState:
  """Empty caches for cfg's layer kinds: a ring of `cfg.resolve_window(window)` slots for the
  sliding layers, `cfg.resolve_capacity(capacity)` slots for the full-attention layers (each
  argument is unused when no layer has its kind)."""
  dt = resolve_dtype(ring_dtype, "ring_dtype")
  caches = {}
  for kind, layers in cfg.kind_groups:
    n = cfg.resolve_window(window) if kind == SLIDING else cfg.resolve_capacity(capacity)
    shape = (len(layers), cfg.n_head_kv, n, cfg.head_dim)
    caches[kind] = KVCache(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt),
                           pos=jnp.full((n,), -1, jnp.int32), kind=kind)
  return RingState(sliding=caches.get(SLIDING), full=caches.get(FULL))


class Kernels(NamedTuple):
  inject: Callable
  qk_norm_rope: Callable
  ring_attention: Callable
  accept: Callable


def kernels(impl: str) -> Kernels:
  """The fused ops of one implementation: the Pallas kernels or their pure-jnp twins."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if impl == "pallas":
    return Kernels(inject_k.inject, norm_rope_k.qk_norm_rope, attn_k.ring_attention,
                   accept_k.accept)
  return Kernels(inject_k.inject_reference, norm_rope_k.qk_norm_rope_reference,
                 attn_k.ring_attention_reference, accept_k.accept_reference)


def attention_knobs(cache: KVCache, impl: str = "pallas") -> dict:
  """The ring attention's static arguments for one cache: its `window` and, for the Pallas
  kernel, the launch knobs `ring_attention.default_knobs` picks for its slots and dtype."""
  if impl == "xla":
    return dict(window=cache.window)
  return dict(attn_k.default_knobs(cache.slots, cache.window, cache.k.dtype,
                                   head_dim=int(cache.k.shape[-1])), window=cache.window)


def encode(params: DrafterParams, features: jax.Array, *,
           impl: str = "pallas") -> jax.Array:
  """features [T, n_target_layers n_embd] -> h [T, n_embd] float32 (fc, then RMS norm)."""
  return rms_norm(linear(features, params.fc, impl=impl), params.enc_norm, params.cfg.eps)


def inject(params: DrafterParams, ring: RingState, h: jax.Array, positions: jax.Array,
           n_valid: jax.Array | int | None = None, *, impl: str = "pallas") -> RingState:
  """Store K/V of h [T, n_embd] at `positions` in every layer: per attention kind, one GEMM
  through its layers' wk/wv and one inject launch into its cache.

  Rows >= n_valid (default: all rows valid) write nothing. Sliding rings write slot
  pos % W, later rows winning a shared slot; full-attention caches write slot pos and drop
  pos >= capacity (no check inside jit: DFlashDrafter checks on the host).
  """
  cfg = params.cfg
  t = h.shape[0]
  n_valid = jnp.asarray(t if n_valid is None else n_valid, jnp.int32)
  positions = jnp.asarray(positions, jnp.int32)
  caches = {}
  for ip in params.inject:
    cache = ring.cache(ip.kind)
    kv = linear(h, ip.w, impl=impl).reshape(t, ip.k_norm.shape[0], 2, cfg.n_head_kv,
                                             cfg.head_dim)
    k, v, pos = kernels(impl).inject(cache.k, cache.v, cache.pos, kv, ip.k_norm, positions,
                                     n_valid, params.inv_freq, eps=cfg.eps,
                                     wrap=ip.kind == SLIDING)
    caches[ip.kind] = KVCache(k=k, v=v, pos=pos, kind=ip.kind)
  return RingState(sliding=caches.get(SLIDING), full=caches.get(FULL))


def block_step(params: DrafterParams, ring: RingState, id_last: jax.Array, n_past: jax.Array,
               *, width: int | None = None, impl: str = "pallas") -> jax.Array:
  """One denoising pass over [id_last, mask x (w-1)] at positions n_past.. -> logits
  [w, n_vocab], w = width (static; default block_size; 2 <= w <= block_size).

  The block's own keys are its w rows (non-causal). Each layer reads its kind's cache (a
  sliding layer the slots within its window, a full-attention layer every position
  < n_past); the ring is never written.
  """
  cfg = params.cfg
  w = cfg.resolve_width(width)
  ops = kernels(impl)
  n_past = jnp.asarray(n_past, jnp.int32)
  tokens = jnp.full((w,), cfg.mask_token_id, jnp.int32)
  tokens = tokens.at[0].set(jnp.asarray(id_last, jnp.int32))
  x = params.tok_embd[tokens].astype(jnp.float32)
  knobs = {kind: attention_knobs(ring.cache(kind), impl) for kind, _ in cfg.kind_groups}
  # GEMM inputs are rounded to bf16 unless the weights are fp32; the attention and the gate+up
  # epilogue round when they store (one launch fewer than rounding in the next GEMM's prologue).
  act_dtype = jnp.float32 if params.weight_format == "fp32" else jnp.bfloat16
  for l, lp in enumerate(params.layers):
    # The qkv projection's split-K partials are summed inside qk_norm_rope (no extra launch).
    qkv = linear(rms_norm(x, lp.attn_norm, cfg.eps), lp.wqkv, impl=impl, partials=True)
    q, k, v = ops.qk_norm_rope(qkv, lp.q_norm, lp.k_norm, n_past, params.inv_freq,
                               n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, eps=cfg.eps)
    kind = cfg.kinds[l]
    cache = ring.cache(kind)
    o = ops.ring_attention(q, k, v, cache.k, cache.v, cache.pos, n_past,
                           layer=cfg.index_in_kind(l), out_dtype=act_dtype, **knobs[kind])
    x = x + linear(o, lp.wo, impl=impl)
    hidden = linear(rms_norm(x, lp.ffn_norm, cfg.eps), lp.wgu, impl=impl, gate_up=True,
                    out_dtype=act_dtype)
    x = x + linear(hidden, lp.wd, impl=impl)
  return linear(rms_norm(x, params.out_norm, cfg.eps), params.lm_head, impl=impl)


def greedy_drafts(logits: jax.Array) -> jax.Array:
  """Block positions 1..w-1 of logits [w, V]; argmax breaks ties to the lowest token id."""
  return jnp.argmax(logits[1:], axis=-1).astype(jnp.int32)


def accept(drafts: jax.Array, target_tokens: jax.Array, *, impl: str = "pallas") -> jax.Array:
  """Length of the agreeing prefix (first mismatch), int32 on device; [n] or batched [B, n]."""
  return kernels(impl).accept(jnp.asarray(drafts, jnp.int32), jnp.asarray(target_tokens, jnp.int32))


def draft_round(params: DrafterParams, ring: RingState, new_features: jax.Array, n_new: jax.Array,
                id_last: jax.Array, n_past: jax.Array, *, width: int | None = None,
                impl: str = "pallas"):
  """One speculative round in one call: encode + inject the newly committed rows, then draft
  a block of w = width rows (static, default block_size).

  new_features [R, n_target_layers n_embd] holds the committed rows' features padded to a
  static R (block_size in the usual loop); rows 0..n_new-1 are injected at positions
  n_past - n_new + i (the rows committed since the last round end at n_past - 1).
  Returns (ring, drafts [w-1] int32, logits [w, n_vocab]).
  """
  n_past = jnp.asarray(n_past, jnp.int32)
  n_new = jnp.asarray(n_new, jnp.int32)
  positions = n_past - n_new + jnp.arange(new_features.shape[0], dtype=jnp.int32)
  ring = inject(params, ring, encode(params, new_features, impl=impl), positions, n_new,
                impl=impl)
  logits = block_step(params, ring, id_last, n_past, width=width, impl=impl)
  return ring, greedy_drafts(logits), logits


# Jitted entry points. The ring is donated wherever it is returned.
encode_jit = jax.jit(encode, static_argnames=("impl",))
inject_jit = jax.jit(inject, static_argnames=("impl",), donate_argnames=("ring",))
block_step_jit = jax.jit(block_step, static_argnames=("width", "impl"))
draft_round_jit = jax.jit(draft_round, static_argnames=("width", "impl"),
                          donate_argnames=("ring",))
accept_jit = jax.jit(accept, static_argnames=("impl",))
