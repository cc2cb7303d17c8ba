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

from dflash_jax.config import DFlashConfig
from dflash_jax.params import DrafterParams, linear, resolve_dtype, rms_norm
from pallas_kernels import accept as accept_k
from pallas_kernels import inject as inject_k
from pallas_kernels import norm_rope as norm_rope_k
from pallas_kernels import ring_attention as attn_k

IMPLS = ("pallas", "xla")


@flax.struct.dataclass
class RingState:
  """The drafter's K/V ring: k, v [L, Hkv, W, D] in the ring dtype; pos [W] int32 (-1 empty)."""
  k: jax.Array
  v: jax.Array
  pos: jax.Array

  @property
  def window(self) -> int:
    return int(self.pos.shape[-1])


def init_ring(cfg: DFlashConfig, window: int | None = None, ring_dtype: Any = "fp32") -> RingState:
  w = cfg.resolve_window(window)
  dt = resolve_dtype(ring_dtype, "ring_dtype")
  shape = (cfg.n_layer, cfg.n_head_kv, w, cfg.head_dim)
  return RingState(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt),
                   pos=jnp.full((w,), -1, jnp.int32))


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


def attention_knobs(window: int, ring_dtype, impl: str = "pallas") -> dict:
  """Ring attention launch shape and dot precision, from the H200 sweep (benchmarks/RESULTS.md).

  bf16 ring: 16 splits of one 128-slot tile, 2 bf16 terms per float32 operand (~16 mantissa
  bits, far finer than the bf16 ring itself). fp32 ring: 64-slot tiles (128 spills when fp32
  tiles are split three ways) and 3 terms, fp32-accurate like the rest of that path.
  impl="xla": none (the jnp twin takes any window).
  """
  if impl == "xla":
    return {}
  if window < 16 or window & (window - 1):
    raise ValueError(f"the Pallas ring attention needs a power-of-2 window >= 16, got {window}")
  bf16 = jnp.dtype(ring_dtype) == jnp.bfloat16
  block_k = max(16, min(128 if bf16 else 64, window // 4))
  splits = max(1, min(16, window // block_k))
  return dict(block_k=block_k, splits=splits, terms=2 if bf16 else 3)


def encode(params: DrafterParams, features: jax.Array, *,
           impl: str = "pallas") -> jax.Array:
  """features [T, n_target_layers n_embd] -> h [T, n_embd] float32 (fc, then RMS norm)."""
  return rms_norm(linear(features, params.fc, impl=impl), params.enc_norm, params.cfg.eps)


def inject(params: DrafterParams, ring: RingState, h: jax.Array, positions: jax.Array,
           n_valid: jax.Array | int | None = None, *, impl: str = "pallas") -> RingState:
  """Project h through every layer's wk/wv (one GEMM) and store K/V at positions % window.

  Rows >= n_valid (default: all rows valid) write nothing. Later rows win on equal slots.
  """
  cfg = params.cfg
  t = h.shape[0]
  kv = linear(h, params.w_inject, impl=impl).reshape(t, cfg.n_layer, 2, cfg.n_head_kv, cfg.head_dim)
  n_valid = jnp.asarray(t if n_valid is None else n_valid, jnp.int32)
  k, v, pos = kernels(impl).inject(ring.k, ring.v, ring.pos, kv, params.k_norm_all,
                        jnp.asarray(positions, jnp.int32), n_valid, params.inv_freq, eps=cfg.eps)
  return RingState(k=k, v=v, pos=pos)


def block_step(params: DrafterParams, ring: RingState, id_last: jax.Array, n_past: jax.Array,
               *, impl: str = "pallas") -> jax.Array:
  """One denoising pass over [id_last, mask, ...] at positions n_past.. -> logits [B, n_vocab].

  Reads the ring, never writes it.
  """
  cfg = params.cfg
  ops = kernels(impl)
  n_past = jnp.asarray(n_past, jnp.int32)
  tokens = jnp.full((cfg.block_size,), cfg.mask_token_id, jnp.int32)
  tokens = tokens.at[0].set(jnp.asarray(id_last, jnp.int32))
  x = params.tok_embd[tokens].astype(jnp.float32)
  knobs = attention_knobs(ring.window, ring.k.dtype, impl)
  # GEMM inputs are rounded to bf16 unless the weights are fp32; the attention and the gate+up
  # epilogue round when they store (one launch fewer than rounding in the next GEMM's prologue).
  act_dtype = jnp.float32 if params.weight_format == "fp32" else jnp.bfloat16
  for l, lp in enumerate(params.layers):
    # The qkv projection's split-K partials are summed inside qk_norm_rope (no extra launch).
    qkv = linear(rms_norm(x, lp.attn_norm, cfg.eps), lp.wqkv, impl=impl, partials=True)
    q, k, v = ops.qk_norm_rope(qkv, lp.q_norm, lp.k_norm, n_past, params.inv_freq,
                               n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, eps=cfg.eps)
    o = ops.ring_attention(q, k, v, ring.k, ring.v, ring.pos, n_past, layer=l,
                           window=ring.window, out_dtype=act_dtype, **knobs)
    x = x + linear(o, lp.wo, impl=impl)
    hidden = linear(rms_norm(x, lp.ffn_norm, cfg.eps), lp.wgu, impl=impl, gate_up=True,
                    out_dtype=act_dtype)
    x = x + linear(hidden, lp.wd, impl=impl)
  return linear(rms_norm(x, params.out_norm, cfg.eps), params.lm_head, impl=impl)


def greedy_drafts(logits: jax.Array) -> jax.Array:
  """Block positions 1..B-1; argmax breaks ties to the lowest token id."""
  return jnp.argmax(logits[1:], axis=-1).astype(jnp.int32)


def accept(drafts: jax.Array, target_tokens: jax.Array, *, impl: str = "pallas") -> jax.Array:
  """Length of the agreeing prefix (first mismatch), int32 on device; [n] or batched [B, n]."""
  return kernels(impl).accept(jnp.asarray(drafts, jnp.int32), jnp.asarray(target_tokens, jnp.int32))


def draft_round(params: DrafterParams, ring: RingState, new_features: jax.Array, n_new: jax.Array,
                id_last: jax.Array, n_past: jax.Array, *, impl: str = "pallas"):
  """One speculative round in one call: encode + inject the newly committed rows, then draft.

  new_features [R, n_target_layers n_embd] holds the committed rows' features padded to a
  static R (block_size in the usual loop); rows 0..n_new-1 are injected at positions
  n_past - n_new + i (the rows committed since the last round end at n_past - 1).
  Returns (ring, drafts [B-1] int32, logits [B, n_vocab]).
  """
  n_past = jnp.asarray(n_past, jnp.int32)
  n_new = jnp.asarray(n_new, jnp.int32)
  positions = n_past - n_new + jnp.arange(new_features.shape[0], dtype=jnp.int32)
  ring = inject(params, ring, encode(params, new_features, impl=impl), positions, n_new,
                impl=impl)
  logits = block_step(params, ring, id_last, n_past, impl=impl)
  return ring, greedy_drafts(logits), logits


# Jitted entry points. The ring is donated wherever it is returned.
encode_jit = jax.jit(encode, static_argnames=("impl",))
inject_jit = jax.jit(inject, static_argnames=("impl",), donate_argnames=("ring",))
block_step_jit = jax.jit(block_step, static_argnames=("impl",))
draft_round_jit = jax.jit(draft_round, static_argnames=("impl",), donate_argnames=("ring",))
accept_jit = jax.jit(accept, static_argnames=("impl",))
