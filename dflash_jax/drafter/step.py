"""The functional drafter: pure, jittable functions over (params, ring).

`impl="pallas"` runs the fused Pallas kernels, routed by the params' kernel policy
(`params.policy`, `dflash_jax.dispatch`); `impl="xla"` runs their pure-jnp twins (the same
step in plain XLA, used as a peer in benchmarks and as a second opinion in tests). Jitted entry
points donate the ring, so under XLA the inject kernels update it in place. The block step is
composed of the pieces of the config's drafter family (`Family`, `FAMILIES`).

Batches (SPEC.md section 6): the `*_batched` functions and `reset_slot` / `inject_slot` run S
independent sequences ("slots") in one call over a batched ring (`init_batched_ring`: every
RingState leaf with a leading slot axis). Rows are slot-major (slot s, row j at s*w + j): every
GEMM takes all S x w rows in one launch, and the per-sequence kernels (inject, qk norm + rope,
ring attention) are vmapped over the slot axis, which the pallas_call batching rule turns into
one more grid axis (one launch for all slots; with S = 1 it lowers to the unbatched kernel).

Every phase runs under a `jax.named_scope` (ARCHITECTURE.md, "Profiling scopes"): the names
land in the ops' metadata (op_name), so an XLA / Perfetto trace reads like the phase table of
`benchmarks.run`. Scopes change metadata only, never the program.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dflash_jax import dispatch
from dflash_jax.config import FULL, SLIDING, DFlashConfig
from dflash_jax.dispatch import gemm_input_norm, linear, resolve_dtype, rms_norm
from dflash_jax.drafter.weights import DrafterParams, LayerParams
from pallas_kernels import accept as accept_k
from pallas_kernels import inject as inject_k
from pallas_kernels import norm_rope as norm_rope_k
from pallas_kernels import ring_attention as attn_k
from pallas_kernels import ring_attention_mgpu as attn_mgpu

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
  layers). A batched ring (`init_batched_ring`) has a leading slot axis on every leaf, in
  front of these shapes: one ring per sequence slot."""
  sliding: KVCache | None = None
  full: KVCache | None = None

  @property
  def batch_slots(self) -> int | None:
    """The sequence slots of a batched ring (its leaves' leading axis), None for one ring."""
    pos = self.caches()[0].pos
    return int(pos.shape[0]) if pos.ndim == 2 else None

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
  return _empty_ring(cfg, (), window, ring_dtype, capacity)


def init_batched_ring(cfg: DFlashConfig, n_slots: int, window: int | None = None,
                      ring_dtype: Any = "fp32", capacity: int | None = None) -> RingState:
  """`n_slots` empty rings in one RingState: `init_ring`'s leaves with a leading slot axis
  (k, v [n_slots, L_kind, Hkv, slots, D], pos [n_slots, slots])."""
  if isinstance(n_slots, bool) or not isinstance(n_slots, (int, np.integer)) or n_slots < 1:
    raise ValueError(f"n_slots must be an int >= 1, got {n_slots!r}")
  return _empty_ring(cfg, (int(n_slots),), window, ring_dtype, capacity)


def ring_nbytes(cfg: DFlashConfig, window: int | None = None, ring_dtype: Any = "fp32",
                capacity: int | None = None) -> int:
  """Device bytes of one sequence's ring (`init_ring` with these arguments; one slot of a
  batched ring): per attention kind, K and V [L_kind, Hkv, slots, D] plus pos [slots]."""
  item = resolve_dtype(ring_dtype, "ring_dtype").itemsize
  total = 0
  for kind, layers in cfg.kind_groups:
    n = cfg.resolve_window(window) if kind == SLIDING else cfg.resolve_capacity(capacity)
    total += 2 * len(layers) * cfg.n_head_kv * n * cfg.head_dim * item + 4 * n
  return total


def _empty_ring(cfg: DFlashConfig, lead: tuple[int, ...], window, ring_dtype,
                capacity) -> RingState:
  dt = resolve_dtype(ring_dtype, "ring_dtype")
  caches = {}
  for kind, layers in cfg.kind_groups:
    n = cfg.resolve_window(window) if kind == SLIDING else cfg.resolve_capacity(capacity)
    shape = lead + (len(layers), cfg.n_head_kv, n, cfg.head_dim)
    caches[kind] = KVCache(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt),
                           pos=jnp.full(lead + (n,), -1, jnp.int32), kind=kind)
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


def encode(params: DrafterParams, features: jax.Array, *,
           impl: str = "pallas") -> jax.Array:
  """features [..., n_target_layers n_embd] -> h [..., n_embd] float32 (fc, then RMS norm):
  rows [T] or slots x rows [S, T], every row through one GEMM."""
  x = features.reshape(-1, features.shape[-1])   # no-op for [T, F]
  with jax.named_scope("encode"):
    h = rms_norm(linear(x, params.fc, policy=params.policy, impl=impl), params.enc_norm,
                 params.cfg.eps)
  return h.reshape(*features.shape[:-1], h.shape[-1])


def _inject(params: DrafterParams, ring: RingState, h: jax.Array, positions: jax.Array,
            n_valid: jax.Array, impl: str, n_slots: int | None) -> RingState:
  """Per attention kind, one GEMM of all of h's rows through its layers' wk/wv and one inject
  launch into its cache. n_slots None: one ring, h [T, E], positions [T], n_valid scalar;
  else a batched ring, h [n_slots T, E] slot-major, positions [n_slots, T], n_valid
  [n_slots], the launch vmapped over the slot axis (a grid axis)."""
  cfg = params.cfg
  ops = kernels(impl)
  lead = () if n_slots is None else (n_slots,)
  t = h.shape[0] // (n_slots or 1)
  caches = {}
  for ip in params.inject:
    cache = ring.cache(ip.kind)
    with jax.named_scope(f"inject/{ip.kind}/kv"):
      kv = linear(h, ip.w, policy=params.policy, impl=impl).reshape(
          lead + (t, ip.k_norm.shape[0], 2, cfg.n_head_kv, cfg.head_dim))
    write = functools.partial(ops.inject, eps=cfg.eps, wrap=ip.kind == SLIDING,
                              attention_scaling=cfg.rope_scaling.attention_scaling)
    if n_slots is not None:
      write = jax.vmap(write, in_axes=(0, 0, 0, 0, None, 0, 0, None))
    with jax.named_scope(f"inject/{ip.kind}/write"):
      k, v, pos = write(cache.k, cache.v, cache.pos, kv, ip.k_norm, positions, n_valid,
                        params.inv_freq)
    caches[ip.kind] = KVCache(k=k, v=v, pos=pos, kind=ip.kind)
  return RingState(sliding=caches.get(SLIDING), full=caches.get(FULL))


def inject(params: DrafterParams, ring: RingState, h: jax.Array, positions: jax.Array,
           n_valid: jax.Array | int | None = None, *, impl: str = "pallas") -> RingState:
  """Store K/V of h [T, n_embd] at `positions` in every layer: per attention kind, one GEMM
  through its layers' wk/wv and one inject launch into its cache.

  Rows >= n_valid (default: all rows valid) write nothing. Sliding rings write slot
  pos % W, later rows winning a shared slot; full-attention caches write slot pos and drop
  pos >= capacity (no check inside jit: DFlashDrafter checks on the host).
  """
  t = h.shape[0]
  n_valid = jnp.asarray(t if n_valid is None else n_valid, jnp.int32)
  positions = jnp.asarray(positions, jnp.int32)
  return _inject(params, ring, h, positions, n_valid, impl, None)


# ------------------------------------------------------------------ the block step, in pieces
# A drafter family's block step is a `Family` of pieces: `embed` (the block's tokens -> rows
# x), `layer` (one decoder layer: here an attention sublayer and an MLP sublayer), `head` (the
# final norm and the LM head -> logits and the normed hidden state h) and `readout` (logits, h
# -> drafts). `_block` runs them in that order; `FAMILIES` maps `DFlashConfig.family` to its
# pieces. A new family (DFlash2's per-sublayer convolutions, a head after the LM head) adds its
# own functions, composed from the shared ones below (`sublayer_norm`, `project`, `attend`),
# and an entry in FAMILIES; it does not branch inside another family's pieces.


class Block(NamedTuple):
  """What every piece of one block step reads. n_slots None: one block of w rows, n_past a
  scalar, one ring; else n_slots blocks slot-major (rows s w + j), n_past [n_slots], a batched
  ring. attention: per attention kind, the launch `dispatch.attention` routes; act_dtype: the
  dtype GEMM inputs are rounded to (bf16 unless the weights are fp32: the attention and the
  gate+up epilogue round when they store, one launch fewer than rounding in the next GEMM's
  prologue)."""
  params: DrafterParams
  ring: RingState
  n_past: jax.Array
  w: int
  n_slots: int | None
  impl: str
  attention: dict[str, dispatch.Attention]
  act_dtype: Any

  @property
  def cfg(self) -> DFlashConfig:
    return self.params.cfg


class Family(NamedTuple):
  """A drafter family's block step: embed(blk, tokens [rows]) -> x [rows, E] float32;
  layer(blk, l, x) -> x; head(blk, x) -> (logits [rows, V], h [rows, E]); readout(logits
  [..., w, V], h [..., w, E]) -> drafts [..., w-1]."""
  embed: Callable
  layer: Callable
  head: Callable
  readout: Callable


def _context(params: DrafterParams, ring: RingState, n_past: jax.Array, w: int, impl: str,
             n_slots: int | None) -> Block:
  """The Block of one block step: each attention kind's launch routed by params.policy."""
  cfg = params.cfg
  attention = {}
  for kind, _ in cfg.kind_groups:
    cache = ring.cache(kind)
    attention[kind] = dispatch.attention(
        n_seqs=n_slots or 1, n_head_kv=cfg.n_head_kv, t=w, group=cfg.group,
        head_dim=cfg.head_dim, slots=cache.slots, window=cache.window, ring_dtype=cache.k.dtype,
        impl=impl, policy=params.policy)
  act_dtype = jnp.float32 if params.weight_format == "fp32" else jnp.bfloat16
  return Block(params, ring, n_past, w, n_slots, impl, attention, act_dtype)


def block_tokens(cfg: DFlashConfig, id_last: jax.Array, w: int,
                 n_slots: int | None) -> jax.Array:
  """The block's tokens [id_last, mask x (w-1)] (n_slots of them, slot-major, when batched)."""
  if n_slots is None:
    return jnp.full((w,), cfg.mask_token_id, jnp.int32).at[0].set(id_last)
  tokens = jnp.full((n_slots, w), cfg.mask_token_id, jnp.int32).at[:, 0].set(id_last)
  return tokens.reshape(n_slots * w)


def project(blk: Block, x: jax.Array, w, **kw) -> jax.Array:
  """`dispatch.linear` under the step's policy and impl (kw: gate_up, partials, residual,
  out_dtype): with residual=x the add is the GEMM's epilogue where the batched GEMM runs it."""
  return linear(x, w, policy=blk.params.policy, impl=blk.impl, **kw)


def sublayer_norm(blk: Block, x: jax.Array, w_norm: jax.Array, w, gate_up: bool = False
                  ) -> jax.Array:
  """The RMS norm in front of the GEMM by w (`dispatch.gemm_input_norm`)."""
  return gemm_input_norm(x, w_norm, blk.cfg.eps, w, policy=blk.params.policy, impl=blk.impl,
                         gate_up=gate_up)


def attend(blk: Block, l: int, qkv: jax.Array) -> jax.Array:
  """Layer l's qk norm + rope and ring attention of the fused q/k/v projection (its split-K
  partials [P, rows, (Hq + 2 Hkv) D], summed inside qk_norm_rope: no extra launch) -> o
  [rows, Hq D] in blk.act_dtype."""
  cfg, params, lp = blk.cfg, blk.params, blk.params.layers[l]
  ops = kernels(blk.impl)
  kind = cfg.kinds[l]
  cache = blk.ring.cache(kind)
  route = blk.attention[kind]
  knobs = route.knobs.kwargs() if route.kernel == "triton" else {}
  attend_one = functools.partial(ops.ring_attention, layer=cfg.index_in_kind(l),
                                 window=cache.window, out_dtype=blk.act_dtype, **knobs)

  def norm_rope(qkv, n_past, parts=False):
    kw = dict(parts=True) if parts else {}   # the jnp twin (impl "xla") takes no parts
    return ops.qk_norm_rope(qkv, lp.q_norm, lp.k_norm, n_past, params.inv_freq,
                            n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, eps=cfg.eps,
                            attention_scaling=cfg.rope_scaling.attention_scaling, **kw)

  n_slots, w = blk.n_slots, blk.w
  if n_slots is None and route.kernel != "mgpu":
    with jax.named_scope("norm_rope"):
      q, k, v = norm_rope(qkv, blk.n_past)
    with jax.named_scope("attention"):
      return attend_one(q, k, v, cache.k, cache.v, cache.pos, blk.n_past)
  # A batch, or one sequence on the Mosaic GPU partials as a batch of one slot (leading unit
  # axes: no copies). Splitting the partials [P, n w, N] into [P, n, w, heads, D] is free, and
  # vmapping over that axis 1 hands each slot's programs their rows: no transpose (a reshape
  # under vmap would move the slot axis to the front first, copying them). The Mosaic GPU
  # attention takes its operands' bf16 parts, emitted by qk_norm_rope.
  n = n_slots or 1
  ring_k, ring_v, ring_pos, past = (cache.k, cache.v, cache.pos, blk.n_past)
  if n_slots is None:
    ring_k, ring_v, ring_pos, past = (a[None] for a in (ring_k, ring_v, ring_pos, past))
  mgpu = route.kernel == "mgpu"
  with jax.named_scope("norm_rope"):
    heads = qkv.reshape(qkv.shape[0], n, w, cfg.n_head + 2 * cfg.n_head_kv, cfg.head_dim)
    operands = jax.vmap(functools.partial(norm_rope, parts=mgpu), in_axes=(1, 0))(heads, past)
  with jax.named_scope("attention"):
    if mgpu:
      o = attn_mgpu.ring_attention_batched(
          *operands, ring_k, ring_v, ring_pos, past, layer=cfg.index_in_kind(l),
          window=cache.window, out_dtype=blk.act_dtype, **route.knobs.kwargs())
    else:
      o = jax.vmap(attend_one)(*operands, ring_k, ring_v, ring_pos, past)
    return o.reshape(n * w, o.shape[-1])


def attention_sublayer(blk: Block, l: int, x: jax.Array) -> jax.Array:
  """Norm, the fused q/k/v projection, qk norm + rope and attention, the o projection with
  the residual added in its epilogue."""
  lp = blk.params.layers[l]
  with jax.named_scope("attn_norm"):
    xn = sublayer_norm(blk, x, lp.attn_norm, lp.wqkv)
  with jax.named_scope("qkv"):
    qkv = project(blk, xn, lp.wqkv, partials=True)
  o = attend(blk, l, qkv)
  with jax.named_scope("o"):
    return project(blk, o, lp.wo, residual=x)


def mlp_sublayer(blk: Block, l: int, x: jax.Array) -> jax.Array:
  """Norm, gate+up (silu(gate) * up in the GEMM's epilogue), down with the residual added in
  its epilogue."""
  lp: LayerParams = blk.params.layers[l]
  with jax.named_scope("ffn/norm"):
    xn = sublayer_norm(blk, x, lp.ffn_norm, lp.wgu, gate_up=True)
  with jax.named_scope("ffn/gate_up"):
    hidden = project(blk, xn, lp.wgu, gate_up=True, out_dtype=blk.act_dtype)
  with jax.named_scope("ffn/down"):
    return project(blk, hidden, lp.wd, residual=x)


def dflash_embed(blk: Block, tokens: jax.Array) -> jax.Array:
  """The target's token embedding of the block's tokens, float32."""
  return blk.params.tok_embd[tokens].astype(jnp.float32)


def dflash_layer(blk: Block, l: int, x: jax.Array) -> jax.Array:
  return mlp_sublayer(blk, l, attention_sublayer(blk, l, x))


def dflash_head(blk: Block, x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The final RMS norm and the LM head: (logits float32, h the normed rows as the head reads
  them: bf16 where the batched GEMM runs the head, else float32)."""
  params = blk.params
  with jax.named_scope("out_norm"):
    h = sublayer_norm(blk, x, params.out_norm, params.lm_head)
  with jax.named_scope("lm_head"):
    return project(blk, h, params.lm_head), h


def dflash_readout(logits: jax.Array, h: jax.Array) -> jax.Array:
  """DFlash v1 drafts greedily: the argmax of block rows 1..w-1 (`greedy_drafts`)."""
  del h
  return greedy_drafts(logits)


FAMILIES = {"dflash": Family(embed=dflash_embed, layer=dflash_layer, head=dflash_head,
                             readout=dflash_readout)}


def family(cfg: DFlashConfig) -> Family:
  """The pieces of cfg.family's block step."""
  if cfg.family not in FAMILIES:
    raise ValueError(f"DFlashConfig.family {cfg.family!r} has no block step; known families: "
                     f"{sorted(FAMILIES)}")
  return FAMILIES[cfg.family]


def _block(params: DrafterParams, ring: RingState, id_last: jax.Array, n_past: jax.Array,
           w: int, impl: str, n_slots: int | None) -> tuple[jax.Array, jax.Array]:
  """(logits [rows, n_vocab], h [rows, n_embd]) of the block step: one block of w rows
  (n_slots None: id_last and n_past scalars, one ring), or n_slots blocks slot-major
  (id_last, n_past [n_slots], a batched ring) with every GEMM over all n_slots w rows and the
  per-sequence kernels vmapped over the slot axis. The pieces are cfg.family's."""
  fam = family(params.cfg)
  blk = _context(params, ring, n_past, w, impl, n_slots)
  with jax.named_scope("embed"):
    x = fam.embed(blk, block_tokens(params.cfg, id_last, w, n_slots))
  for l in range(params.cfg.n_layer):
    with jax.named_scope(f"layer{l}"):
      x = fam.layer(blk, l, x)
  return fam.head(blk, x)


def block_step(params: DrafterParams, ring: RingState, id_last: jax.Array, n_past: jax.Array,
               *, width: int | None = None, impl: str = "pallas") -> jax.Array:
  """One denoising pass over [id_last, mask x (w-1)] at positions n_past.. -> logits
  [w, n_vocab], w = width (static; default block_size; 2 <= w <= block_size).

  The block's own keys are its w rows (non-causal). Each layer reads its kind's cache (a
  sliding layer the slots within its window, a full-attention layer every position
  < n_past); the ring is never written.
  """
  w = params.cfg.resolve_width(width)
  logits, _ = _block(params, ring, jnp.asarray(id_last, jnp.int32),
                     jnp.asarray(n_past, jnp.int32), w, impl, None)
  return logits


def greedy_drafts(logits: jax.Array) -> jax.Array:
  """Block positions 1..w-1 of logits [..., w, V] -> [..., w-1]; argmax breaks ties to the
  lowest token id."""
  with jax.named_scope("drafts"):
    return jnp.argmax(logits[..., 1:, :], axis=-1).astype(jnp.int32)


def accept(drafts: jax.Array, target_tokens: jax.Array, *, impl: str = "pallas") -> jax.Array:
  """Length of the agreeing prefix (first mismatch), int32 on device; [n] or batched [B, n]."""
  with jax.named_scope("accept"):
    return kernels(impl).accept(jnp.asarray(drafts, jnp.int32),
                                jnp.asarray(target_tokens, jnp.int32))


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
  logits, h = _block(params, ring, jnp.asarray(id_last, jnp.int32), n_past,
                     params.cfg.resolve_width(width), impl, None)
  return ring, family(params.cfg).readout(logits, h), logits


# ------------------------------------------------------------------ batches of sequences
# A batched ring's slot s is one sequence: its own caches, n_past[s], id_last[s], n_new[s] and
# active[s]. Nothing here loops over slots in Python: one trace (one compilation) serves every
# slot id, activity pattern and position. The functional core does not validate inside jit
# (BatchedDrafter does, on the host): a slot id outside [0, S) is clamped by XLA's dynamic
# slicing, so callers must pass valid ones.


def _slots_of(ring: RingState, what: str, **arrays) -> int:
  """The ring's slot count S, after checking that every array has a leading axis of S."""
  n = ring.batch_slots
  if n is None:
    raise ValueError(f"{what} needs a batched ring (init_batched_ring), got one ring")
  for name, a in arrays.items():
    shape = np.shape(a)
    if not shape or shape[0] != n:
      raise ValueError(f"{what}: {name} must have a leading slot axis of {n} (the ring's "
                       f"slots), got shape {list(shape)}")
  return n


def _empty_inactive(cfg: DFlashConfig, active, id_last, n_past) -> tuple[jax.Array, jax.Array]:
  """An inactive slot drafts the empty sequence (id_last = the mask token at n_past 0, which
  sees no ring slot): its outputs depend on none of its inputs or its ring, and it reads no
  ring chunk."""
  active = jnp.asarray(active, jnp.bool_)
  return (jnp.where(active, jnp.asarray(id_last, jnp.int32), cfg.mask_token_id),
          jnp.where(active, jnp.asarray(n_past, jnp.int32), 0))


def reset_slot(ring: RingState, slot: jax.Array | int) -> RingState:
  """Empty sequence slot `slot` of a batched ring (pos -1, K/V zero: the state of a fresh
  slot); the other slots are untouched. `slot` is a traced int32, so one compilation serves
  every slot; jitted with the ring donated, the slot is cleared in place."""
  _slots_of(ring, "reset_slot")
  slot = jnp.asarray(slot, jnp.int32)

  def clear(a: jax.Array, fill) -> jax.Array:
    return lax.dynamic_update_index_in_dim(a, jnp.full(a.shape[1:], fill, a.dtype), slot, 0)

  return jax.tree.map(lambda c: c.replace(k=clear(c.k, 0), v=clear(c.v, 0), pos=clear(c.pos, -1)),
                      ring, is_leaf=lambda c: isinstance(c, KVCache))


def inject_slot(params: DrafterParams, ring: RingState, slot: jax.Array | int, h: jax.Array,
                positions: jax.Array, n_valid: jax.Array | int | None = None, *,
                impl: str = "pallas") -> RingState:
  """`inject` into one slot of a batched ring (e.g. a joining sequence's prompt): h
  [T, n_embd] at positions [T], rows >= n_valid writing nothing. `slot` is a traced int32
  (one compilation per T for every slot); that slot's caches are sliced out, injected and
  written back, the other slots untouched."""
  _slots_of(ring, "inject_slot")
  slot = jnp.asarray(slot, jnp.int32)
  one = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, slot, 0, keepdims=False), ring)
  one = inject(params, one, h, positions, n_valid, impl=impl)
  return jax.tree.map(lambda a, b: lax.dynamic_update_index_in_dim(a, b, slot, 0), ring, one)


def inject_batched(params: DrafterParams, ring: RingState, h: jax.Array, positions: jax.Array,
                   n_valid: jax.Array | None = None, *, impl: str = "pallas") -> RingState:
  """`inject` for every slot at once: h [S, T, n_embd] at positions [S, T] into slot s's
  caches, rows t >= n_valid[s] (default: none) writing nothing. One GEMM of all S T rows and
  one inject launch per attention kind (the slot a grid axis)."""
  n = _slots_of(ring, "inject_batched", h=h, positions=positions)
  t = h.shape[1]
  n_valid = jnp.full((n,), t, jnp.int32) if n_valid is None else jnp.asarray(n_valid, jnp.int32)
  _slots_of(ring, "inject_batched", n_valid=n_valid)
  return _inject(params, ring, h.reshape(n * t, h.shape[2]), jnp.asarray(positions, jnp.int32),
                 n_valid, impl, n)


def block_step_batched(params: DrafterParams, ring: RingState, id_last: jax.Array,
                       n_past: jax.Array, active: jax.Array, *, width: int | None = None,
                       impl: str = "pallas") -> jax.Array:
  """`block_step` of every slot of a batched ring in one call: id_last, n_past, active [S]
  -> logits [S, w, n_vocab]. Slot s's logits equal block_step on its own ring (bitwise when
  the GEMM row counts agree, S = 1; else to rounding) whatever the other slots hold. An
  inactive slot's logits are those of the empty sequence (see draft_round_batched)."""
  n = _slots_of(ring, "block_step_batched", id_last=id_last, n_past=n_past, active=active)
  w = params.cfg.resolve_width(width)
  id_last, n_past = _empty_inactive(params.cfg, active, id_last, n_past)
  logits, _ = _block(params, ring, id_last, n_past, w, impl, n)
  return logits.reshape(n, w, -1)


def draft_round_batched(params: DrafterParams, ring: RingState, new_features: jax.Array,
                        n_new: jax.Array, id_last: jax.Array, n_past: jax.Array,
                        active: jax.Array, *, width: int | None = None,
                        impl: str = "pallas"):
  """`draft_round` of every slot of a batched ring in one call (SPEC.md section 6).

  new_features [S, R, n_target_layers n_embd]: slot s's rows 0..n_new[s]-1 go to positions
  n_past[s] - n_new[s] + i of its ring; then each slot drafts a block of w = width rows
  (static) at n_past[s] after id_last[s]. All S R rows go through encode and the inject GEMMs
  in one GEMM each and one inject launch per kind; all S w block rows through each step GEMM
  in one launch. An inactive slot (active[s] False) injects nothing (its ring stays bitwise
  unchanged) and drafts the empty sequence (the mask token at n_past 0): its drafts and
  logits depend on none of its inputs; ignore them.
  Returns (ring, drafts [S, w-1] int32, logits [S, w, n_vocab]).
  """
  n = _slots_of(ring, "draft_round_batched", new_features=new_features, n_new=n_new,
                id_last=id_last, n_past=n_past, active=active)
  cfg = params.cfg
  w = cfg.resolve_width(width)
  r = new_features.shape[1]
  n_new = jnp.where(jnp.asarray(active, jnp.bool_), jnp.asarray(n_new, jnp.int32), 0)
  id_last, n_past = _empty_inactive(cfg, active, id_last, n_past)
  positions = (n_past - n_new)[:, None] + jnp.arange(r, dtype=jnp.int32)
  h = encode(params, new_features.reshape(n * r, new_features.shape[2]), impl=impl)
  ring = _inject(params, ring, h, positions, n_new, impl, n)
  logits, h = _block(params, ring, id_last, n_past, w, impl, n)
  logits, h = logits.reshape(n, w, -1), h.reshape(n, w, -1)
  return ring, family(cfg).readout(logits, h), logits


# Jitted entry points. The ring is donated wherever it is returned.
encode_jit = jax.jit(encode, static_argnames=("impl",))
inject_jit = jax.jit(inject, static_argnames=("impl",), donate_argnames=("ring",))
block_step_jit = jax.jit(block_step, static_argnames=("width", "impl"))
draft_round_jit = jax.jit(draft_round, static_argnames=("width", "impl"),
                          donate_argnames=("ring",))
accept_jit = jax.jit(accept, static_argnames=("impl",))
reset_slot_jit = jax.jit(reset_slot, donate_argnames=("ring",))
inject_slot_jit = jax.jit(inject_slot, static_argnames=("impl",), donate_argnames=("ring",))
inject_batched_jit = jax.jit(inject_batched, static_argnames=("impl",),
                             donate_argnames=("ring",))
block_step_batched_jit = jax.jit(block_step_batched, static_argnames=("width", "impl"))
draft_round_batched_jit = jax.jit(draft_round_batched, static_argnames=("width", "impl"),
                                  donate_argnames=("ring",))
