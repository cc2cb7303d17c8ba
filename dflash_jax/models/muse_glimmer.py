"""Muse-Glimmer (the text model of Meta's Muse-Glimmer-30B VLM) as a DFlash target.

The layer, in order (shared/research/target_families.md section 1): the embedding goes through
a weight-less RMS norm (that normed row is HF `hidden_states[0]`; the DFlash drafter embeds
its noise tokens with the raw table, `params.embed`, which is what it borrows); per layer an
input norm of weight (1 + w); one GEMM gives q, k, v and the output gate; q and k get
weight-less per-head RMS norms (q then times `qk_scale_factor`); sliding layers rotate q and k
(NEOX, the global theta), full-attention layers use no position encoding at all (NoPE); the
attention output times sigmoid(gate) goes through o_proj, then a (1 + w) norm with
`post_norm_eps` before the residual add; the MLP is sandwiched the same way. The final norm has
a plain weight; logits are `softcap * tanh(output_multiplier * (h @ lm_head^T) / softcap)`.

The cache. Full-attention layers keep K/V for every position (slot = position, `capacity`
slots). Sliding layers keep a ring of R = min(sliding_window, capacity) slots (slot =
position % R) holding only committed rows, so a long context costs the full layers' cache
alone. A call attends over the ring as it was before the call plus the call's own rows (one
softmax over both), so a prefill longer than the window needs no wider ring. `prefill`
writes its first n_valid rows into the ring. `verify` writes nothing into the ring: its rows
ride in the returned cache (`pending_k/v`, one [B, w, Hkv, D] per sliding layer) and
`commit(cache, n_keep)` writes the first n_keep of them, so a rejected row never overwrites a
committed one and the ring needs no slots beyond the window (the alternative, writing the
verify rows into a ring of W + w_max slots, would fix w_max at `init_cache`).

Layout as in qwen3.py: matrices (out, in), every product is `qwen3.project` (`linear`'s
batch-invariant route, whose split-K partials are added elementwise in order: XLA fuses the
adds into the consumer, where a reduction over the splits would be a launch of its own);
q/k/v/gate are one
`[(2 Hq + 2 Hkv) D, E]` matrix, gate/up one `[2 F, E]`; norm weights are stored as in the
checkpoint (the w of 1 + w) in float32; caches are [B, S, Hkv, D].
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import (FULL, LAYER_TYPES, SLIDING, RopeScaling, checked_rope_scaling,
                               rope_from_hf, rope_inv_freq)
from dflash_jax.models import base
from dflash_jax.models.qwen3 import normals, project, rope
from dflash_jax.dispatch import KernelPolicy, einsum_f32, resolve_dtype, rms_norm

MODEL_TYPES = ("muse_glimmer", "muse_glimmer_text")
PREFIX = "model.language_model."   # the text model's tensors in the (VLM) checkpoint
_ARCHITECTURE = "MuseGlimmerForConditionalGeneration"
# Stored but never read: the vision tower and its projection into the text model.
_IGNORED_PREFIXES = ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.")
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class MuseGlimmerConfig(base.HFDecoderFacts):
  """The text model's shape and constants (HF text_config names); frozen and hashable.

  `layer_types` / `layer_rope_theta` None take HF's defaults (every 4th layer counted back
  from the last is full attention without rope); both are stored resolved, one entry per
  layer. A nonzero `layer_rope_theta` only switches rope on: the angle uses `rope_theta`
  (HF does the same), scaled by `rope_scaling` (as in qwen3.TargetConfig).
  `final_logit_softcapping` None: no softcap.
  """
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-5
  post_norm_eps: float = 1e-8
  qk_scale_factor: float = 3.87
  output_multiplier: float = 0.19611613513818404
  final_logit_softcapping: float | None = 20.0
  rope_theta: float = 5e5
  sliding_window: int = 2048
  layer_types: tuple[str, ...] | None = None
  layer_rope_theta: tuple[float, ...] | None = None
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 131072
  eos_token_ids: tuple[int, ...] = ()
  rope_scaling: RopeScaling = RopeScaling()

  def __post_init__(self):
    problems = []
    object.__setattr__(self, "rope_scaling", checked_rope_scaling(self.rope_scaling, problems))
    problems += self.dim_problems(("sliding_window",), positive=(
        "rms_norm_eps", "post_norm_eps", "rope_theta", "output_multiplier"))
    if problems:
      raise ValueError("invalid MuseGlimmerConfig: " + "; ".join(problems))
    n = self.num_hidden_layers
    cap = self.final_logit_softcapping
    if cap is not None and not cap > 0:
      problems.append(f"final_logit_softcapping must be > 0 or None, got {cap!r}")
    # HF's default pattern: full attention (and no rope) on every 4th layer back from the last.
    last = [(n - 1 - i) % 4 == 0 for i in range(n)]
    kinds = tuple(self.layer_types) if self.layer_types is not None else tuple(
        FULL if f else SLIDING for f in last)
    thetas = tuple(float(t) for t in self.layer_rope_theta) if (
        self.layer_rope_theta is not None) else tuple(0.0 if f else float(self.rope_theta)
                                                      for f in last)
    if len(kinds) != n or set(kinds) - set(LAYER_TYPES):
      problems.append(f"layer_types must hold {n} entries of {LAYER_TYPES}, got {list(kinds)}")
    if len(thetas) != n or any(t < 0 for t in thetas):
      problems.append(f"layer_rope_theta must hold {n} entries >= 0, got {list(thetas)}")
    object.__setattr__(self, "layer_types", kinds)
    object.__setattr__(self, "layer_rope_theta", thetas)
    ids, bad = base.eos_token_ids(self.eos_token_ids, self.vocab_size)
    object.__setattr__(self, "eos_token_ids", ids)
    problems += bad
    if problems:
      raise ValueError("invalid MuseGlimmerConfig: " + "; ".join(problems))

  # --- the Target protocol (models/base.py) ---
  def init_cache(self, batch: int, capacity: int, dtype: Any = "fp32") -> "MuseCache":
    return init_cache(self, batch, capacity, dtype)

  def cache_nbytes(self, batch: int, capacity: int, dtype: Any = "fp32",
                   verify_width: int = 1) -> int:
    item = resolve_dtype(dtype, "cache dtype").itemsize
    slots = (len(self.full_layers) * capacity
             + len(self.sliding_layers) * (self.ring_slots(capacity) + verify_width))
    return 2 * batch * self.kv_dim * item * slots + 4 * batch

  def prefill(self, params, cache, tokens, n_valid, *, capture_layers=(), impl: str = "xla"):
    return prefill(params, self, cache, tokens, n_valid, capture_layers=capture_layers,
                   impl=impl)

  def verify(self, params, cache, tokens, *, capture_layers=(), impl: str = "xla"):
    return verify(params, self, cache, tokens, capture_layers=capture_layers, impl=impl)

  def commit(self, cache: "MuseCache", n_keep: jax.Array) -> "MuseCache":
    return commit(self, cache, n_keep)

  def reset(self, cache: "MuseCache", empty: jax.Array) -> "MuseCache":
    return reset(cache, empty)

  def forward(self, params, tokens, *, capture_layers=(), with_logits: bool = True):
    return forward(params, self, tokens, capture_layers=capture_layers,
                   with_logits=with_logits)

  # --- derived shapes ---
  def is_sliding(self, layer: int) -> bool:
    return self.layer_types[layer] == SLIDING

  def has_rope(self, layer: int) -> bool:
    return self.layer_rope_theta[layer] != 0

  @property
  def sliding_layers(self) -> tuple[int, ...]:
    return tuple(l for l in range(self.num_hidden_layers) if self.is_sliding(l))

  @property
  def full_layers(self) -> tuple[int, ...]:
    return tuple(l for l in range(self.num_hidden_layers) if not self.is_sliding(l))

  def ring_slots(self, capacity: int) -> int:
    """Slots of a sliding layer's ring in a cache of `capacity` positions."""
    return min(self.sliding_window, capacity)

  # --- HF config.json ---
  def to_hf(self) -> dict[str, Any]:
    """The VLM wrapper's config.json (the text config under `text_config`, the layout whose
    tensors sit under `model.language_model.`); no vision_config (the text model only)."""
    eos = list(self.eos_token_ids)
    text = {
        "model_type": "muse_glimmer_text", "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
        "hidden_activation": "silu", "attention_bias": False,
        "rms_norm_eps": self.rms_norm_eps, "post_norm_eps": self.post_norm_eps,
        "qk_scale_factor": self.qk_scale_factor, "output_multiplier": self.output_multiplier,
        "final_logit_softcapping": self.final_logit_softcapping,
        "rope_parameters": {"rope_theta": self.rope_theta,
                            **(self.rope_scaling.to_hf() or {"rope_type": "default"})},
        "sliding_window": self.sliding_window, "layer_types": list(self.layer_types),
        "layer_rope_theta": list(self.layer_rope_theta),
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    return {"architectures": [_ARCHITECTURE], "model_type": "muse_glimmer",
            "tie_word_embeddings": self.tie_word_embeddings, "text_config": text}


def config_from_hf(config: Mapping[str, Any], where: str = "config") -> MuseGlimmerConfig:
  """From an HF config dict: the VLM wrapper ("muse_glimmer", the text model under
  `text_config`) or the text config itself ("muse_glimmer_text"). Absent keys take HF's
  defaults except the model's shape (vocab, hidden, intermediate, layers, heads) and the rope
  theta; a ValueError names `where` and the key."""
  model_type = config.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ValueError(f"{where}: model_type {model_type!r} is not a Muse-Glimmer config "
                     f"({list(MODEL_TYPES)})")
  c = config
  if model_type == "muse_glimmer":
    if not isinstance(config.get("text_config"), Mapping):
      raise ValueError(f"{where}: a muse_glimmer config needs a text_config object")
    c, where = config["text_config"], f"{where}: text_config"
  for key, bad in (("attention_bias", True),):
    if c.get(key) == bad:
      raise ValueError(f"{where}: {key}={bad} is not supported")
  act = c.get("hidden_activation", c.get("hidden_act", "silu"))
  if act != "silu":
    raise ValueError(f"{where}: hidden_activation {act!r} is not supported (only silu)")
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads")
  missing = [k for k in required if k not in c]
  theta, scaling = rope_from_hf(c, where)
  if theta is None:
    missing.append("rope_parameters.rope_theta")
  if missing:
    raise ValueError(f"{where}: missing config keys {missing}")
  eos = c.get("eos_token_id", config.get("eos_token_id"))
  try:
    return MuseGlimmerConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c.get("num_key_value_heads", 2), head_dim=c.get("head_dim", 128),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        post_norm_eps=float(c.get("post_norm_eps", 1e-8)),
        qk_scale_factor=float(c.get("qk_scale_factor", 3.87)),
        output_multiplier=float(c.get("output_multiplier", 0.19611613513818404)),
        final_logit_softcapping=c.get("final_logit_softcapping", 20.0),
        rope_theta=float(theta), sliding_window=c.get("sliding_window", 2048),
        layer_types=c.get("layer_types"), layer_rope_theta=c.get("layer_rope_theta"),
        tie_word_embeddings=bool(c.get("tie_word_embeddings",
                                       config.get("tie_word_embeddings", False))),
        max_position_embeddings=c.get("max_position_embeddings", 131072), eos_token_ids=eos,
        rope_scaling=scaling)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


# --- parameters ------------------------------------------------------------------------------

@flax.struct.dataclass
class MuseLayer:
  attn_norm: jax.Array        # [E] f32: w of the (1 + w) input norm
  wqkvg: jax.Array            # [(2 Hq + 2 Hkv) D, E]: q, k, v, output gate (one GEMM)
  wo: jax.Array               # [E, Hq D]
  post_attn_norm: jax.Array   # [E] f32 (1 + w), post_norm_eps
  ffn_norm: jax.Array         # [E] f32 (1 + w): pre_feedforward_layernorm
  post_ffn_norm: jax.Array    # [E] f32 (1 + w), post_norm_eps
  wgu: jax.Array              # [2 F, E]: gate rows then up rows
  wd: jax.Array               # [E, F]


@flax.struct.dataclass
class MuseParams:
  """Device weights: matrices in the weight dtype, (out, in); norms float32. `embed` is the
  raw table (the drafter's `tok_embd`); the target norms the rows it looks up."""
  embed: jax.Array            # [V, E]
  layers: tuple[MuseLayer, ...]
  final_norm: jax.Array       # [E] f32, plain weight
  lm_head: jax.Array | None   # [V, E]; None when tied
  # The GEMMs' routing (dispatch.linear); static: part of every jit key.
  policy: KernelPolicy = flax.struct.field(pytree_node=False, default=KernelPolicy())

  @property
  def head(self) -> jax.Array:
    return self.embed if self.lm_head is None else self.lm_head


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_layer(cfg: MuseGlimmerConfig, key: jax.Array, dtype) -> MuseLayer:
  e, f = cfg.hidden_size, cfg.intermediate_size
  r = normals(key, {"wqkvg": (2 * cfg.q_dim + 2 * cfg.kv_dim, e), "wo": (e, cfg.q_dim),
                    "wgu": (2 * f, e), "wd": (e, f), "norms": (4, e)}, dtype)
  m = {k: (r[k] * (1 / math.sqrt(r[k].shape[1]))).astype(dtype)
       for k in ("wqkvg", "wo", "wgu", "wd")}
  n = 0.1 * r["norms"].astype(jnp.float32)   # the w of (1 + w): near 0
  return MuseLayer(attn_norm=n[0], wqkvg=m["wqkvg"], wo=m["wo"], post_attn_norm=n[1],
                   ffn_norm=n[2], post_ffn_norm=n[3], wgu=m["wgu"], wd=m["wd"])


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_outer(cfg: MuseGlimmerConfig, key: jax.Array, dtype):
  v, e = cfg.vocab_size, cfg.hidden_size
  shapes = {"embed": (v, e), "norm": (e,)}
  if not cfg.tie_word_embeddings:
    shapes["head"] = (v, e)
  r = normals(key, shapes, dtype)
  head = None if cfg.tie_word_embeddings else (r["head"] * (1 / math.sqrt(e))).astype(dtype)
  return r["embed"], 1.0 + 0.1 * r["norm"].astype(jnp.float32), head


def init_params(cfg: MuseGlimmerConfig, key: jax.Array, dtype: Any = jnp.float32) -> MuseParams:
  """Random weights generated on the device (one compiled initializer per layer shape):
  matrices N(0, 1/fan_in), the embedding N(0, 1), an untied head N(0, 1/E), the (1 + w)
  norms' w 0.1 N(0, 1), the final norm 1 + 0.1 N(0, 1)."""
  dt = resolve_dtype(dtype)
  keys = jax.random.split(key, cfg.num_hidden_layers + 1)
  embed, final_norm, head = _init_outer(cfg, keys[0], dt)
  layers = tuple(_init_layer(cfg, k, dt) for k in keys[1:])
  return MuseParams(embed=embed, layers=layers, final_norm=final_norm, lm_head=head)


# --- the layer and the uncached forward ----------------------------------------------------

def _attention(q: jax.Array, parts) -> jax.Array:
  """q [B, T, Hq, D] f32 over key/value parts [(keys [B, S, Hkv, D], values, visible [B or
  1, T, S])], one softmax over all of them -> [B, T, Hq D]. Each part's dots take their
  operands in its K/V dtype with float32 accumulation (full precision for float32). Every
  row must see at least one key (each row sees its own position)."""
  b, t, hq, d = q.shape
  hkv = parts[0][0].shape[2]
  scores = []
  for keys, _, visible in parts:
    prec = jax.lax.Precision.HIGHEST if keys.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    qg = q.reshape(b, t, hkv, hq // hkv, d).astype(keys.dtype)
    s = einsum_f32("btkgd,bskd->bkgts", qg, keys, prec) * (1.0 / math.sqrt(d))
    scores.append(jnp.where(visible[:, None, None], s, -jnp.inf))
  p = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
  o, start = 0.0, 0
  for (keys, values, _), s in zip(parts, scores):
    prec = jax.lax.Precision.HIGHEST if keys.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    n = s.shape[-1]
    o = o + einsum_f32("bkgts,bskd->btkgd", p[..., start:start + n].astype(values.dtype),
                       values, prec)
    start += n
  return o.reshape(b, t, hq * d)


def _layer(cfg: MuseGlimmerConfig, l: int, lp: MuseLayer, x: jax.Array, positions: jax.Array,
           freqs: jax.Array, attend, impl: str, policy: KernelPolicy):
  """Layer l on rows x [B T, E] f32 at positions [B, T]. attend(q, k, v) with q [B, T, Hq,
  D], k/v [B, T, Hkv, D] returns (o [B, T, Hq D], what the path keeps)."""
  b, t = positions.shape
  eps, post, d = cfg.rms_norm_eps, cfg.post_norm_eps, cfg.head_dim
  qd, kvd = cfg.q_dim, cfg.kv_dim
  h = rms_norm(x, 1.0 + lp.attn_norm, eps)
  y = project(h, lp.wqkvg, impl, policy)
  q = rms_norm(y[:, :qd].reshape(b, t, cfg.num_attention_heads, d), cfg.qk_scale_factor, eps)
  k = rms_norm(y[:, qd:qd + kvd].reshape(b, t, cfg.num_key_value_heads, d), 1.0, eps)
  v = y[:, qd + kvd:qd + 2 * kvd].reshape(b, t, cfg.num_key_value_heads, d)
  if cfg.has_rope(l):
    scale = cfg.rope_scaling.attention_scaling
    q, k = rope(q, positions, freqs, scale), rope(k, positions, freqs, scale)
  o, kept = attend(q, k, v)
  o = o.reshape(b * t, qd) * jax.nn.sigmoid(y[:, qd + 2 * kvd:])   # the gate of the normed h
  x = x + rms_norm(project(o, lp.wo, impl, policy), 1.0 + lp.post_attn_norm, post)
  hidden = project(rms_norm(x, 1.0 + lp.ffn_norm, eps), lp.wgu, impl, policy, gate_up=True)
  return x + rms_norm(project(hidden, lp.wd, impl, policy), 1.0 + lp.post_ffn_norm,
                      post), kept


def _trunk(params: MuseParams, cfg: MuseGlimmerConfig, tokens: jax.Array, positions: jax.Array,
           attend_layer, capture_layers, impl: str):
  """Normed embedding -> layers -> final norm: (h [B T, E], features [B, T, F], kept per
  layer). attend_layer(l) gives layer l's attend function."""
  capture = cfg.check_capture_layers(capture_layers)
  b, t = tokens.shape
  freqs = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
  x = rms_norm(params.embed[tokens.reshape(-1)], 1.0, cfg.rms_norm_eps)   # weight-less
  seen, kept = {}, []
  for l, lp in enumerate(params.layers):
    if l in capture:
      seen[l] = x
    x, k = _layer(cfg, l, lp, x, positions, freqs, attend_layer(l), impl, params.policy)
    kept.append(k)
  h = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
  seen[cfg.num_hidden_layers] = h
  feats = (jnp.concatenate([seen[i] for i in capture], axis=-1) if capture
           else jnp.zeros((b * t, 0), jnp.float32))
  return h, feats.reshape(b, t, -1), kept


def _logits(params: MuseParams, cfg: MuseGlimmerConfig, h: jax.Array, shape, impl: str):
  z = project(h, params.head, impl, params.policy) * cfg.output_multiplier
  cap = cfg.final_logit_softcapping
  if cap is not None:
    z = cap * jnp.tanh(z / cap)
  return z.reshape(*shape, -1)


def _window(cfg: MuseGlimmerConfig, l: int, diff: jax.Array) -> jax.Array:
  """Key visibility from diff = query position - key position."""
  vis = diff >= 0
  return vis & (diff < cfg.sliding_window) if cfg.is_sliding(l) else vis


def forward(params: MuseParams, cfg: MuseGlimmerConfig, tokens: jax.Array, *,
            capture_layers=(), with_logits: bool = True):
  """Uncached causal forward of tokens [B, T] at positions 0..T-1 -> (logits [B, T, V] f32 or
  None, features [B, T, F] f32). Differentiable; every GEMM is XLA's."""
  tokens = jnp.asarray(tokens, jnp.int32)
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  diff = (jnp.arange(t)[:, None] - jnp.arange(t)[None, :])[None]

  def attend_layer(l):
    vis = _window(cfg, l, diff)
    return lambda q, k, v: (_attention(q, [(k, v, vis)]), None)

  h, feats, _ = _trunk(params, cfg, tokens, positions, attend_layer, capture_layers, "xla")
  return (_logits(params, cfg, h, (b, t), "xla") if with_logits else None), feats


# --- the cache and the cached path -----------------------------------------------------------

@flax.struct.dataclass
class MuseCache:
  """k / v: one [B, S, Hkv, D] per layer (S = capacity for full-attention layers, slot =
  position; S = R = min(sliding_window, capacity) for sliding ones, slot = position % R,
  committed rows only). length [B] int32: positions < length are committed. pending_k /
  pending_v: after a verify, its rows' K/V [B, w, Hkv, D] per sliding layer (in layer order)
  for `commit`; None otherwise."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  length: jax.Array
  pending_k: tuple[jax.Array, ...] | None = None
  pending_v: tuple[jax.Array, ...] | None = None
  capacity: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def batch(self) -> int:
    return int(self.length.shape[0])


def init_cache(cfg: MuseGlimmerConfig, batch: int, capacity: int, dtype: Any = "fp32"
               ) -> MuseCache:
  if batch <= 0 or capacity <= 0:
    raise ValueError(f"batch and capacity must be positive, got {batch} and {capacity}")
  dt = resolve_dtype(dtype, "cache dtype")
  shapes = [(batch, cfg.ring_slots(capacity) if cfg.is_sliding(l) else capacity,
             cfg.num_key_value_heads, cfg.head_dim) for l in range(cfg.num_hidden_layers)]
  return MuseCache(k=tuple(jnp.zeros(s, dt) for s in shapes),
                   v=tuple(jnp.zeros(s, dt) for s in shapes),
                   length=jnp.zeros((batch,), jnp.int32), capacity=int(capacity))


def _write(buf: jax.Array, rows: jax.Array, start: jax.Array,
           n: jax.Array | None = None) -> jax.Array:
  """buf [B, S, Hkv, D] with rows [B, T, Hkv, D] at slots start[b] .. start[b] + T - 1. With
  n [B], only rows t < n[b]: the others keep buf's values, so a sequence with n 0 is untouched
  even where start + T passes the capacity (the write's start is then clamped, and so is the
  read of the values it keeps)."""
  rows = rows.astype(buf.dtype)
  t = rows.shape[1]
  if n is not None:
    old = jax.vmap(lambda c, s: jax.lax.dynamic_slice(c, (s, 0, 0), (t, *c.shape[1:])))(
        buf, start)
    keep = jnp.arange(t, dtype=jnp.int32)[None, :] < n[:, None]
    rows = jnp.where(keep[:, :, None, None], rows, old)
  if buf.shape[0] == 1:   # one sequence: a plain dynamic-update-slice, in place
    return jax.lax.dynamic_update_slice(buf, rows, (0, start[0], 0, 0))
  return jax.vmap(lambda c, r, s: jax.lax.dynamic_update_slice(c, r, (s, 0, 0)))(
      buf, rows, start)


def _ring_write(ring: jax.Array, rows: jax.Array, start: jax.Array, n: jax.Array) -> jax.Array:
  """ring [B, R, Hkv, D] with rows t < n[b] of rows [B, T, Hkv, D] (positions start[b] + t)
  at slots (start + t) % R; of those only the last R (the earlier ones would be overwritten),
  so every written slot is distinct."""
  r, t = ring.shape[1], rows.shape[1]
  i = jnp.arange(t, dtype=jnp.int32)[None]
  keep = (i < n[:, None]) & (i >= n[:, None] - r)
  slot = jnp.where(keep, (start[:, None] + i) % r, r)   # r: out of range, dropped
  b = jnp.broadcast_to(jnp.arange(ring.shape[0], dtype=jnp.int32)[:, None], slot.shape)
  return ring.at[b, slot].set(rows.astype(ring.dtype), mode="drop")


def _extend(params: MuseParams, cfg: MuseGlimmerConfig, cache: MuseCache, tokens: jax.Array,
            n_commit, capture_layers, with_logits: bool, impl: str):
  """tokens [B, T] at positions length..; n_commit None (verify: the sliding layers' rows go
  to pending) or [B] (prefill: rows < n_commit enter the rings, length += n_commit)."""
  tokens = jnp.asarray(tokens, jnp.int32)
  b, t = tokens.shape
  start = cache.length
  positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)
  own = (jnp.arange(t)[:, None] - jnp.arange(t)[None, :])[None]   # diff within the call

  def attend_layer(l):
    ck, cv = cache.k[l], cache.v[l]
    if not cfg.is_sliding(l):
      slots = jnp.arange(ck.shape[1], dtype=jnp.int32)
      vis = slots[None, None, :] <= positions[:, :, None]

      def attend_full(q, k, v):
        nk, nv = _write(ck, k, start, n_commit), _write(cv, v, start, n_commit)
        return _attention(q, [(nk, nv, vis)]), (nk, nv)
      return attend_full
    # The ring as before the call: slot s holds the latest committed position = s (mod R).
    r = ck.shape[1]
    last = start[:, None] - 1
    held = last - (last - jnp.arange(r, dtype=jnp.int32)[None]) % r     # [B, R]
    vis_ring = (held[:, None, :] >= 0) & (
        positions[:, :, None] - held[:, None, :] < cfg.sliding_window)
    vis_own = _window(cfg, l, own)

    def attend_sliding(q, k, v):
      k, v = k.astype(ck.dtype), v.astype(cv.dtype)   # as a later call will read them
      return _attention(q, [(ck, cv, vis_ring), (k, v, vis_own)]), (k, v)
    return attend_sliding

  h, feats, kept = _trunk(params, cfg, tokens, positions, attend_layer, capture_layers, impl)
  ks, vs = list(cache.k), list(cache.v)
  pend_k, pend_v = [], []
  for l, (k, v) in enumerate(kept):
    if not cfg.is_sliding(l):
      ks[l], vs[l] = k, v
    elif n_commit is None:
      pend_k.append(k)
      pend_v.append(v)
    else:
      ks[l], vs[l] = _ring_write(ks[l], k, start, n_commit), _ring_write(vs[l], v, start, n_commit)
  new = cache.replace(k=tuple(ks), v=tuple(vs), pending_k=None, pending_v=None)
  if n_commit is None:
    new = new.replace(pending_k=tuple(pend_k), pending_v=tuple(pend_v))
  else:
    new = new.replace(length=start + n_commit)
  return new, (_logits(params, cfg, h, (b, t), impl) if with_logits else None), feats


def prefill(params: MuseParams, cfg: MuseGlimmerConfig, cache: MuseCache, tokens: jax.Array,
            n_valid: jax.Array, *, capture_layers=(), impl: str = "xla"):
  """Commit rows 0..n_valid-1 of tokens [B, T] (T padded to a bucket, any valid ids past
  n_valid) at positions length.. -> (cache, features [B, T, F]; rows past n_valid garbage).
  Padding rows write nothing (a sequence with n_valid 0 is left unchanged)."""
  n = jnp.broadcast_to(jnp.asarray(n_valid, jnp.int32), (tokens.shape[0],))
  cache, _, feats = _extend(params, cfg, cache, tokens, n, capture_layers, False, impl)
  return cache, feats


def verify(params: MuseParams, cfg: MuseGlimmerConfig, cache: MuseCache, tokens: jax.Array, *,
           capture_layers=(), impl: str = "xla"):
  """Run tokens [B, w] at positions length.. -> (cache, logits [B, w, V] f32, features [B, w,
  F] f32). Nothing is committed: the full layers' K/V sit past the length, the sliding
  layers' rows in pending_k/v, until `commit`."""
  return _extend(params, cfg, cache, tokens, None, capture_layers, True, impl)


def commit(cfg: MuseGlimmerConfig, cache: MuseCache, n_keep: jax.Array) -> MuseCache:
  """Keep the first n_keep [B] rows of the last verify: they enter the rings, length +=
  n_keep; the rest are dropped (nothing committed is overwritten)."""
  n = jnp.broadcast_to(jnp.asarray(n_keep, jnp.int32), cache.length.shape)
  ks, vs = list(cache.k), list(cache.v)
  if cfg.sliding_layers:
    if cache.pending_k is None:
      raise ValueError("commit: the cache holds no verify rows (commit follows a verify)")
    for i, l in enumerate(cfg.sliding_layers):
      ks[l] = _ring_write(ks[l], cache.pending_k[i], cache.length, n)
      vs[l] = _ring_write(vs[l], cache.pending_v[i], cache.length, n)
  return cache.replace(k=tuple(ks), v=tuple(vs), length=cache.length + n, pending_k=None,
                       pending_v=None)


def reset(cache: MuseCache, empty: jax.Array) -> MuseCache:
  """Empty the sequences where empty [B]: length 0. Their K/V stay, never visible (full
  layers: a row at position p sees slots <= p, rewritten from 0 on; rings: a slot is read only
  for a committed position, and there are none)."""
  return cache.replace(length=jnp.where(jnp.asarray(empty, bool), 0, cache.length))


_STATIC = ("cfg", "capture_layers", "impl")
prefill_jit = jax.jit(prefill, static_argnames=_STATIC, donate_argnames=("cache",))
verify_jit = jax.jit(verify, static_argnames=_STATIC, donate_argnames=("cache",))
commit_jit = jax.jit(commit, static_argnames=("cfg",), donate_argnames=("cache",))
forward_jit = jax.jit(forward, static_argnames=("cfg", "capture_layers", "with_logits"))


# --- HF checkpoints ----------------------------------------------------------------------------

def hf_tensor_shapes(cfg: MuseGlimmerConfig) -> dict[str, tuple[int, ...]]:
  """Checkpoint name -> (out, in) shape of every tensor the text model needs (lm_head only
  untied)."""
  e, f, p = cfg.hidden_size, cfg.intermediate_size, PREFIX
  shapes = {p + "embed_tokens.weight": (cfg.vocab_size, e), p + "norm.weight": (e,)}
  for i in range(cfg.num_hidden_layers):
    q = f"{p}layers.{i}."
    shapes.update({q + n + ".weight": (e,) for n in (
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
        "post_feedforward_layernorm")})
    shapes.update({
        q + "self_attn.q_proj.weight": (cfg.q_dim, e),
        q + "self_attn.k_proj.weight": (cfg.kv_dim, e),
        q + "self_attn.v_proj.weight": (cfg.kv_dim, e),
        q + "self_attn.gate_proj.weight": (cfg.q_dim, e),
        q + "self_attn.o_proj.weight": (e, cfg.q_dim), q + "mlp.gate_proj.weight": (f, e),
        q + "mlp.up_proj.weight": (f, e), q + "mlp.down_proj.weight": (e, f)})
  if not cfg.tie_word_embeddings:
    shapes["lm_head.weight"] = (cfg.vocab_size, e)
  return shapes


def hf_optional(cfg: MuseGlimmerConfig) -> set[str]:
  """Stored by some checkpoints, not needed: a tied model's lm_head."""
  return {"lm_head.weight"} if cfg.tie_word_embeddings else set()


def hf_ignored(name: str) -> bool:
  """Stored, never read: the vision tower, adapter and projection, rotary buffers."""
  return name.startswith(_IGNORED_PREFIXES) or name.endswith(_IGNORED_SUFFIXES)


def params_from_hf(cfg: MuseGlimmerConfig, tensors: dict[str, Any], dtype: Any) -> MuseParams:
  """Checkpoint-named arrays (host numpy or device jax.Array, in their stored dtype) ->
  MuseParams: matrices fused and cast to dtype on the device, norms float32. The entries are
  taken out of `tensors` as they are used (`base.hf_takers`)."""
  base.check_hf_tensors(hf_tensor_shapes(cfg), tensors)
  mat, vec, _ = base.hf_takers(tensors, dtype)

  layers = []
  for i in range(cfg.num_hidden_layers):
    q = f"{PREFIX}layers.{i}."
    a = q + "self_attn."
    layers.append(MuseLayer(
        attn_norm=vec(q + "input_layernorm.weight"),
        wqkvg=mat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight",
                  a + "gate_proj.weight"),
        wo=mat(a + "o_proj.weight"), post_attn_norm=vec(q + "post_attention_layernorm.weight"),
        ffn_norm=vec(q + "pre_feedforward_layernorm.weight"),
        post_ffn_norm=vec(q + "post_feedforward_layernorm.weight"),
        wgu=mat(q + "mlp.gate_proj.weight", q + "mlp.up_proj.weight"),
        wd=mat(q + "mlp.down_proj.weight")))
  return MuseParams(embed=mat(PREFIX + "embed_tokens.weight"), layers=tuple(layers),
                    final_norm=vec(PREFIX + "norm.weight"),
                    lm_head=None if cfg.tie_word_embeddings else mat("lm_head.weight"))


def params_to_hf(cfg: MuseGlimmerConfig, params: MuseParams) -> dict[str, np.ndarray]:
  """MuseParams -> checkpoint-named host arrays in the params' dtypes (params_from_hf's
  inverse)."""
  if len(params.layers) != cfg.num_hidden_layers:
    raise ValueError(f"params have {len(params.layers)} layers, the config "
                     f"{cfg.num_hidden_layers}")
  if (params.lm_head is None) != cfg.tie_word_embeddings:
    raise ValueError(f"params have {'no' if params.lm_head is None else 'an'} lm_head but "
                     f"tie_word_embeddings is {cfg.tie_word_embeddings}")
  qd, kvd, f = cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
  out = {PREFIX + "embed_tokens.weight": np.asarray(params.embed),
         PREFIX + "norm.weight": np.asarray(params.final_norm)}
  for i, lp in enumerate(params.layers):
    q = f"{PREFIX}layers.{i}."
    a = q + "self_attn."
    w, gu = np.asarray(lp.wqkvg), np.asarray(lp.wgu)
    out.update({
        q + "input_layernorm.weight": np.asarray(lp.attn_norm),
        q + "post_attention_layernorm.weight": np.asarray(lp.post_attn_norm),
        q + "pre_feedforward_layernorm.weight": np.asarray(lp.ffn_norm),
        q + "post_feedforward_layernorm.weight": np.asarray(lp.post_ffn_norm),
        a + "q_proj.weight": w[:qd], a + "k_proj.weight": w[qd:qd + kvd],
        a + "v_proj.weight": w[qd + kvd:qd + 2 * kvd], a + "gate_proj.weight": w[qd + 2 * kvd:],
        a + "o_proj.weight": np.asarray(lp.wo), q + "mlp.gate_proj.weight": gu[:f],
        q + "mlp.up_proj.weight": gu[f:], q + "mlp.down_proj.weight": np.asarray(lp.wd)})
  if not cfg.tie_word_embeddings:
    out["lm_head.weight"] = np.asarray(params.lm_head)
  return out
