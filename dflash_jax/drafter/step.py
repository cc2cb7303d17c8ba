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
  layer(blk, l, x) -> x; head(blk, x) -> (logits [rows, V], h [rows, E]); readout(params,
  impl, logits [S, w, V], h [S, w, E], id_last [S], temperature, key) -> Draft (the drafts of
  S blocks: greedy at temperature 0, else sampled with key [S], one PRNG key per block)."""
  embed: Callable
  layer: Callable
  head: Callable
  readout: Callable


@flax.struct.dataclass
class Draft:
  """S blocks' drafts (SPEC_dflash2_dspark section 14), n drafts per block.

  drafts [S, n] int32; top_prob [S, n]: the top probability of each draft row's distribution
  at temperature 1, given the drafts before it (softmax of the row's logits; DFlash2: of the
  walk's scores from the chosen predecessor): the p-min cut's input. A greedy draft is that
  top token, so this is the drafter's own probability of it; a sampled draft is not, and a cut
  must not read the draft it cuts (that would bias which drafts get verified: the loop would
  no longer be lossless). logits [S, w, V]: the family's output logits
  (DFlash2: after the multiplier and softcap; DSpark: Markov-corrected along the chosen path
  on the draft rows). At temperature > 0, q: the proposal distribution along the sampled path,
  [S, n, V] (DFlash, DSpark), or [S, n, k] over `candidates` (DFlash2, a sparse q; None at
  temperature 0). DFlash2: candidates [S, n, k] (each row's top-k ids, largest logit first)
  and scores [S, n, k] (the walk's s_p along the chosen path). DSpark with a confidence head:
  conf [S, n] (sigmoid values).
  """
  drafts: jax.Array
  top_prob: jax.Array
  logits: jax.Array
  q: jax.Array | None = None
  candidates: jax.Array | None = None
  scores: jax.Array | None = None
  conf: jax.Array | None = None


def _route(params: DrafterParams, ring: RingState, kind: str, w: int, impl: str,
           n_slots: int | None, block_mask: bool = False) -> dispatch.Attention:
  """The attention launch of one kind's layers, routed by params.policy (block_mask: the
  block's own keys are masked, `dispatch.attention`)."""
  cfg, cache = params.cfg, ring.cache(kind)
  return dispatch.attention(
      n_seqs=n_slots or 1, n_head_kv=cfg.n_head_kv, t=w, group=cfg.group,
      head_dim=cfg.head_dim, slots=cache.slots, window=cache.window, ring_dtype=cache.k.dtype,
      impl=impl, policy=params.policy, block_mask=block_mask)


def _context(params: DrafterParams, ring: RingState, n_past: jax.Array, w: int, impl: str,
             n_slots: int | None) -> Block:
  """The Block of one block step: each attention kind's launch routed by params.policy."""
  attention = {kind: _route(params, ring, kind, w, impl, n_slots)
               for kind, _ in params.cfg.kind_groups}
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


def attend(blk: Block, l: int, qkv: jax.Array, causal: bool = False,
           band: int | None = None) -> jax.Array:
  """Layer l's qk norm + rope and ring attention of the fused q/k/v projection (its split-K
  partials [P, rows, (Hq + 2 Hkv) D], summed inside qk_norm_rope: no extra launch) -> o
  [rows, Hq D] in blk.act_dtype. causal / band: DFlash2's masks of the block's own keys
  (`ring_attention`); with either, the launch is routed for a masked block."""
  cfg, params, lp = blk.cfg, blk.params, blk.params.layers[l]
  ops = kernels(blk.impl)
  kind = cfg.kinds[l]
  cache = blk.ring.cache(kind)
  route = blk.attention[kind]
  masks = {}
  if causal or band is not None:
    masks = dict(causal=causal, band=band)
    route = _route(params, blk.ring, kind, blk.w, blk.impl, blk.n_slots, block_mask=True)
  knobs = route.knobs.kwargs() if route.kernel == "triton" else {}
  attend_one = functools.partial(ops.ring_attention, layer=cfg.index_in_kind(l),
                                 window=cache.window, out_dtype=blk.act_dtype, **masks, **knobs)

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


def _top_prob(logits: jax.Array) -> jax.Array:
  """max softmax(logits) over the last axis: 1 / sum exp(logits - max)."""
  z = logits.astype(jnp.float32)
  return 1.0 / jnp.sum(jnp.exp(z - jnp.max(z, axis=-1, keepdims=True)), axis=-1)


def _row_keys(key: jax.Array, n: int) -> jax.Array:
  """One PRNG key per block [S] -> one per draft row [S, n]."""
  return jax.vmap(lambda k: jax.random.split(k, n))(key)


def dflash_readout(params, impl: str, logits: jax.Array, h, id_last, temperature: float = 0.0,
                   key: jax.Array | None = None) -> Draft:
  """DFlash v1: block rows 1..w-1 each give a draft, the argmax (`greedy_drafts`), or at
  temperature T > 0 a sample of softmax(logits / T) with key [S] (q that distribution)."""
  del params, impl, h, id_last
  q = None
  if temperature == 0:
    drafts = greedy_drafts(logits)
  else:
    z = logits[:, 1:].astype(jnp.float32) / temperature
    drafts = jax.vmap(lambda k, zz: jax.random.categorical(k, zz, axis=-1))(key, z)
    drafts = drafts.astype(jnp.int32)
    q = jax.nn.softmax(z, axis=-1)
  return Draft(drafts, _top_prob(logits[:, 1:]), logits, q=q)


# -- DFlash2 (SPEC_dflash2_dspark 4-8): per-sublayer grouped dynamic causal convolutions, the
# embedding scale, the logit multiplier and softcap, block causality, the candidate selector.
# The readouts' row-by-row scans are unrolled (at most a block's rows): a rolled XLA loop on
# the GPU reads its trip condition back to the host every iteration, a round trip per row.

def conv_coefficients(blk: Block, a: jax.Array, conv) -> jax.Array:
  """The dynamic coefficients of a sublayer from its normed input a [rows, E] (float32, or
  already in the projection's input dtype): [rows, 2, K, n_groups] float32 (projection
  feature f is side f // (K n_groups), tap (f // n_groups) % K, group f % n_groups)."""
  k = conv.base.shape[1]
  d = project(blk, a, conv.proj)
  return d.reshape(d.shape[0], 2, k, d.shape[1] // (2 * k))


def conv_norm(blk: Block, x: jax.Array, w_norm: jax.Array, proj) -> tuple[jax.Array,
                                                                             jax.Array]:
  """A DFlash2 sublayer's normed input twice: float32 for the convolution, and as the
  coefficient GEMM (by proj) takes it (`dispatch.norm_pair`: one launch on the Pallas path)."""
  return dispatch.norm_pair(x, w_norm, blk.cfg.eps, proj, policy=blk.params.policy,
                            impl=blk.impl)


def causal_conv(blk: Block, y: jax.Array, base: jax.Array, coef: jax.Array) -> jax.Array:
  """One side of the convolution along each block's rows: y [rows, E] (slot-major blocks of
  blk.w rows), base [K, E], coef [rows, K, n_groups] -> out[i, c] = sum_t (base[t, c] +
  coef[i, t, c // G]) y[i - t, c], rows before each block's row 0 zero (blocks never mix).
  Elementwise jnp: XLA fuses it with its neighbours (the residual add on the finish side)."""
  n, w = blk.n_slots or 1, blk.w
  e = y.shape[-1]
  k, n_groups = coef.shape[1], coef.shape[2]
  y3 = y.astype(jnp.float32).reshape(n, w, e)
  full = base[None, None] + jnp.repeat(coef.reshape(n, w, k, n_groups), e // n_groups, axis=-1)
  out = full[:, :, 0] * y3
  for t in range(1, min(k, w)):
    out = out + full[:, :, t] * jnp.pad(y3, ((0, 0), (t, 0), (0, 0)))[:, :w]
  return out.reshape(n * w, e)


def dflash2_embed(blk: Block, tokens: jax.Array) -> jax.Array:
  """The target's embedding of every block row, anchor included, times input_embedding_scale."""
  return dflash_embed(blk, tokens) * jnp.float32(blk.cfg.dflash2.input_embedding_scale)


def _block_masks(blk: Block, l: int) -> tuple[bool, int | None]:
  """(causal, band) of layer l's block keys: the band of a sliding layer bites only for a
  block wider than its window (SPEC_dflash2_dspark 5.4)."""
  window = blk.ring.cache(blk.cfg.kinds[l]).window
  return blk.cfg.block_causal(l), (window if window is not None and blk.w > window else None)


def dflash2_layer(blk: Block, l: int, x: jax.Array) -> jax.Array:
  """One DFlash2 layer (SPEC_dflash2_dspark 5.1): each sublayer's normed input (float32, which
  the convolution reads unrounded) gives the coefficients (one GEMM) and goes through the
  prepare side; the sublayer's output goes through the finish side before the residual add.
  The coefficient GEMM cannot share the q/k/v or gate/up GEMM: those read the prepared rows,
  which need the coefficients first."""
  lp, conv = blk.params.layers[l], blk.params.family
  causal, band = _block_masks(blk, l)
  with jax.named_scope("attn_norm"):
    cp = conv.attn_conv[l]
    a, a_in = conv_norm(blk, x, lp.attn_norm, cp.proj)
  with jax.named_scope("attn_conv"):
    d = conv_coefficients(blk, a_in, cp)
    a = causal_conv(blk, a, cp.base[0], d[:, 0])
  with jax.named_scope("qkv"):
    qkv = project(blk, a, lp.wqkv, partials=True)
  o = attend(blk, l, qkv, causal=causal, band=band)
  with jax.named_scope("o"):
    x = x + causal_conv(blk, project(blk, o, lp.wo), cp.base[1], d[:, 1])
  with jax.named_scope("ffn/norm"):
    cp = conv.ffn_conv[l]
    b, b_in = conv_norm(blk, x, lp.ffn_norm, cp.proj)
  with jax.named_scope("ffn/conv"):
    e = conv_coefficients(blk, b_in, cp)
    b = causal_conv(blk, b, cp.base[0], e[:, 0])
  with jax.named_scope("ffn/gate_up"):
    hidden = project(blk, b, lp.wgu, gate_up=True, out_dtype=blk.act_dtype)
  with jax.named_scope("ffn/down"):
    return x + causal_conv(blk, project(blk, hidden, lp.wd), cp.base[1], e[:, 1])


def logit_transform(raw: jax.Array, multiplier: float, softcap: float | None) -> jax.Array:
  """SPEC_dflash2_dspark 6: raw * multiplier, then c tanh(z / c) when the softcap c is set."""
  z = raw * jnp.float32(multiplier)
  if softcap:
    c = jnp.float32(softcap)
    z = c * jnp.tanh(z / c)
  return z


def dflash2_head(blk: Block, x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """DFlash's head, then the logit multiplier and softcap (XLA fuses them into one pass)."""
  logits, h = dflash_head(blk, x)
  f = blk.cfg.dflash2
  with jax.named_scope("logit_transform"):
    return logit_transform(logits, f.output_multiplier, f.final_logit_softcapping), h


def _dot(a: jax.Array, b: jax.Array, spec: str) -> jax.Array:
  """A float32 einsum at full precision (no TF32 on the GPU)."""
  return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32)


def dflash2_readout(params: DrafterParams, impl: str, logits: jax.Array, h: jax.Array,
                    id_last: jax.Array, temperature: float = 0.0,
                    key: jax.Array | None = None) -> Draft:
  """The candidate selector (SPEC_dflash2_dspark 7) over draft rows p = 1..w-1 of S blocks.

  Candidates C_p: each row's top k logits (largest first, ties to the lower id); g_p =
  hidden_projection h_p. The k x k edge scores of every row (from each candidate of the row
  before; from the anchor for the first row) are one gathered-row product computed up front
  (the lattice form), so the walk itself (`dispatch.selector_walk`: one launch on the Pallas
  path, a scan of P small argmax steps in XLA) only chooses: s_p = unary + edge from the
  chosen predecessor, argmax (greedy) or a draw from softmax(s_p / T) with one key per row,
  the choice feeding the next row. q: softmax(s_p / T) over C_p.
  """
  fp, k = params.family, params.cfg.dflash2.selector_top_k
  s, w, _ = logits.shape
  n = w - 1
  with jax.named_scope("selector"):
    # [S, n, k] each: the draft rows' top k (the Pallas top-k reads them in place)
    unary, cand = dispatch.top_k(logits.astype(jnp.float32), k, first=1, impl=impl)
    g = linear(h[:, 1:].reshape(s * n, -1), fp.hidden, policy=params.policy, impl=impl)
    g = g.reshape(s, n, -1)                                                # [S, n, R]
    succ = fp.successor[cand].astype(jnp.float32)                          # [S, n, k, R]
    r = succ.shape[-1]
    anchor = jnp.broadcast_to(fp.predecessor[id_last][:, None, None].astype(jnp.float32),
                              (s, 1, k, r))
    prev = jnp.concatenate([anchor, fp.predecessor[cand[:, :-1]].astype(jnp.float32)], axis=1)
    # edge[s, p, i, j] = sum_r A[pred_i, r] g_p[r] S[C_p[j], r] (row 0: every i the anchor)
    edge = _dot(prev * g[:, :, None], succ, "spir,spjr->spij")
    chosen, scores = dispatch.selector_walk(
        unary, edge, temperature=temperature,
        keys=None if temperature == 0 else _row_keys(key, n), impl=impl)
    drafts = jnp.take_along_axis(cand, chosen[..., None], axis=-1)[..., 0].astype(jnp.int32)
    q = None if temperature == 0 else jax.nn.softmax(scores / temperature, axis=-1)
    return Draft(drafts, _top_prob(scores), logits, q=q, candidates=cand.astype(jnp.int32),
                 scores=scores)


# -- DSpark (SPEC_dflash2_dspark 9-12): DFlash's backbone, shifted rows, the Markov chain and
# the confidence head.

def _sigmoid(x: jax.Array) -> jax.Array:
  return 0.5 * (1.0 + jnp.tanh(0.5 * x))


def dspark_readout(params: DrafterParams, impl: str, logits: jax.Array, h: jax.Array,
                   id_last: jax.Array, temperature: float = 0.0,
                   key: jax.Array | None = None) -> Draft:
  """The Markov chain over the draft rows (all w rows with shifted rows, else 1..w-1) of S
  blocks, then the confidence head along the chosen path.

  Row i's predecessor is id_last for the first draft row, then the previous row's chosen
  token; its logits are the backbone's plus W2 times the head's R-vector (vanilla: W1[prev];
  gated: sigmoid(Wg [h ; W1[prev]] + bg) * W1[prev]; rnn: tanh(o) of its state update, the
  state zero at each block's first row). The chain is a scan of one rank-R product and one
  vocab-wide argmax (or draw from softmax(logits / T)) per row, on device. Without a Markov
  head the rows are independent. conf_i = sigmoid(w . [h_i (; W1[prev_i])] + b).
  """
  cfg, fp = params.cfg, params.family
  f = cfg.dspark
  first = cfg.first_draft_row
  lin = functools.partial(linear, policy=params.policy, impl=impl)
  base = logits[:, first:].astype(jnp.float32)
  hr = h[:, first:].astype(jnp.float32)
  s, n, _ = base.shape
  keys = None if temperature == 0 else _row_keys(key, n)                  # [S, n]

  def choose(z, kp):
    if temperature == 0:
      return jnp.argmax(z, axis=-1).astype(jnp.int32)
    return jax.vmap(jax.random.categorical)(kp, z / temperature).astype(jnp.int32)

  with jax.named_scope("markov"):
    if not f.markov_rank:
      chain = base
      drafts = jax.vmap(choose, in_axes=(1, None if keys is None else 1), out_axes=1)(
          base, keys)
    else:
      r = f.markov_rank

      def row(carry, xs):
        prev, state = carry
        b, hi, kp = xs
        e = fp.markov_w1[prev].astype(jnp.float32)                        # [S, R]
        if f.markov_head_type == "vanilla":
          v = e
        elif f.markov_head_type == "gated":
          v = _sigmoid(lin(jnp.concatenate([hi, e], -1), fp.gate) + fp.gate_bias) * e
        else:
          z = lin(jnp.concatenate([state, e, hi], -1), fp.joint) + fp.joint_bias
          gate = _sigmoid(z[:, :r])
          state = gate * state + (1.0 - gate) * jnp.tanh(z[:, r:2 * r])
          v = jnp.tanh(z[:, 2 * r:])
        li = b + lin(v, fp.markov_w2)
        d = choose(li, kp)
        return (d, state), (li, d)

      xs = (jnp.swapaxes(base, 0, 1), jnp.swapaxes(hr, 0, 1),
            None if keys is None else jnp.swapaxes(keys, 0, 1))
      init = (id_last.astype(jnp.int32), jnp.zeros((s, r), jnp.float32))
      _, (chain, drafts) = lax.scan(row, init, xs, unroll=True)
      chain, drafts = jnp.swapaxes(chain, 0, 1), jnp.swapaxes(drafts, 0, 1)
  conf = None
  if f.confidence_head:
    with jax.named_scope("confidence"):
      feats = hr
      if f.confidence_with_markov:
        prevs = jnp.concatenate([id_last[:, None].astype(jnp.int32), drafts[:, :-1]], axis=1)
        feats = jnp.concatenate([hr, fp.markov_w1[prevs].astype(jnp.float32)], axis=-1)
      c = lin(feats.reshape(s * n, -1), fp.conf)[:, 0] + fp.conf_bias[0]
      conf = _sigmoid(c).reshape(s, n)
  q = None if temperature == 0 else jax.nn.softmax(chain / temperature, axis=-1)
  out = jnp.concatenate([logits[:, :first].astype(jnp.float32), chain], axis=1)
  return Draft(drafts, _top_prob(chain), out, q=q, conf=conf)


FAMILIES = {
    "dflash": Family(embed=dflash_embed, layer=dflash_layer, head=dflash_head,
                     readout=dflash_readout),
    "dflash2": Family(embed=dflash2_embed, layer=dflash2_layer, head=dflash2_head,
                      readout=dflash2_readout),
    "dspark": Family(embed=dflash_embed, layer=dflash_layer, head=dflash_head,
                     readout=dspark_readout),
}


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

  The block's own keys are its w rows (non-causal; DFlash2's causal layers see rows <= their
  own). Each layer reads its kind's cache (a sliding layer the slots within its window, a
  full-attention layer every position < n_past); the ring is never written. The logits are the
  family's head's: DFlash2's after the multiplier and softcap, DSpark's the backbone's (its
  Markov head runs in the readout, `propose_round_batched`).
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
  Returns (ring, drafts [n] int32, logits [w, n_vocab]): the family's greedy drafts (n =
  cfg.n_drafts(w)) and output logits (`Draft`).
  """
  n_past = jnp.asarray(n_past, jnp.int32)
  n_new = jnp.asarray(n_new, jnp.int32)
  id_last = jnp.asarray(id_last, jnp.int32)
  positions = n_past - n_new + jnp.arange(new_features.shape[0], dtype=jnp.int32)
  ring = inject(params, ring, encode(params, new_features, impl=impl), positions, n_new,
                impl=impl)
  logits, h = _block(params, ring, id_last, n_past, params.cfg.resolve_width(width), impl, None)
  d = family(params.cfg).readout(params, impl, logits[None], h[None], id_last[None])
  return ring, d.drafts[0], d.logits[0]


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
  Returns (ring, drafts [S, n] int32, logits [S, w, n_vocab]): the family's greedy drafts
  (n = cfg.n_drafts(w)) and output logits (`propose_round_batched` gives the whole Draft).
  """
  ring, d = propose_round_batched(params, ring, new_features, n_new, id_last, n_past, active,
                                  width=width, impl=impl)
  return ring, d.drafts, d.logits


def propose_round_batched(params: DrafterParams, ring: RingState, new_features: jax.Array,
                          n_new: jax.Array, id_last: jax.Array, n_past: jax.Array,
                          active: jax.Array, *, width: int | None = None, impl: str = "pallas",
                          temperature: float = 0.0, key: jax.Array | None = None
                          ) -> tuple[RingState, Draft]:
  """`draft_round_batched` returning the whole `Draft` of the family's readout: greedy at
  temperature 0 (static), else sampled at that temperature with key [S] (one PRNG key per
  slot). The speculative loop's drafter call."""
  n = _slots_of(ring, "draft_round_batched", new_features=new_features, n_new=n_new,
                id_last=id_last, n_past=n_past, active=active)
  cfg = params.cfg
  w = cfg.resolve_width(width)
  if temperature < 0 or (temperature > 0 and key is None):
    raise ValueError(f"temperature must be >= 0, and > 0 needs key (one per slot); got "
                     f"{temperature!r}, key {key!r}")
  r = new_features.shape[1]
  n_new = jnp.where(jnp.asarray(active, jnp.bool_), jnp.asarray(n_new, jnp.int32), 0)
  id_last, n_past = _empty_inactive(cfg, active, id_last, n_past)
  positions = (n_past - n_new)[:, None] + jnp.arange(r, dtype=jnp.int32)
  h = encode(params, new_features.reshape(n * r, new_features.shape[2]), impl=impl)
  ring = _inject(params, ring, h, positions, n_new, impl, n)
  logits, h = _block(params, ring, id_last, n_past, w, impl, n)
  logits, h = logits.reshape(n, w, -1), h.reshape(n, w, -1)
  return ring, family(cfg).readout(params, impl, logits, h, id_last, temperature, key)


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
propose_round_batched_jit = jax.jit(propose_round_batched,
                                    static_argnames=("width", "impl", "temperature"),
                                    donate_argnames=("ring",))
