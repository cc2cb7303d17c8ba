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
slots). Sliding layers keep a ring of R = min(sliding_window + RING_SLACK, capacity) slots
(slot = position % R), so a long context costs the full layers' cache alone. Every pass
writes its rows in place, a verify's past the length; `commit(cache, n_keep)` only moves the
length. The ring's RING_SLACK slots past the window are what makes that safe: a verify of
w <= RING_SLACK rows overwrites only positions at least R - w + 1 > window behind any row
that can still see them, so a rejected row never costs a committed one a row needs (the
other way, holding a verify's rows aside until the commit, costs a copy per sliding layer and
round). On the Pallas path a call of up to policy.target_pallas_max_width rows runs the
target's cache kernels (q/k norm + rope writing K/V in place, the cache attention over the
live slots, the ring's window masked in the kernel and the output gate applied in its
combine), and each joint between sublayers is one
launch (`dispatch.sandwich_norm`: the post norm of the finished sublayer, the residual add
and the next pre-norm). XLA's cached attention (wider passes) attends a sliding layer over
the ring as it was before the call plus the call's own rows (one softmax over both), so a
prefill longer than the window needs no wider ring.

Layout as in qwen3.py: matrices (out, in), every product is `qwen3.project` (`linear`'s
batch-invariant route); a projection's split-K partials go to their consumer unsummed (the
joint's norm, the q/k kernel) and are added there in order. q/k/v/gate are one
`[(2 Hq + 2 Hkv) D, E]` matrix, gate/up one `[2 F, E]`; norm weights are stored as in the
checkpoint (the w of 1 + w) in float32; caches are [B, Hkv, S, D]. Under the default policy
the Pallas path is batch invariant as qwen3.py's is: a row's bits do not depend on how many
rows share the call.
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
from dflash_jax.dispatch import (KernelPolicy, einsum_f32, input_dtype, resolve_dtype, rms_norm,
                                 sandwich_norm, sum_in_order, target_attention)
from pallas_kernels import cache_attention as cache_attn_k
from pallas_kernels import norm_rope as norm_rope_k
from pallas_kernels._common import next_pow2

MODEL_TYPES = ("muse_glimmer", "muse_glimmer_text")
PREFIX = "model.language_model."   # the text model's tensors in the (VLM) checkpoint
_ARCHITECTURE = "MuseGlimmerForConditionalGeneration"
# Stored but never read: the vision tower and its projection into the text model.
_IGNORED_PREFIXES = ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.")
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# The widest verify (rows per sequence) a sliding layer's ring serves: the ring holds this
# many slots past the window (see the module docstring). Decoding verifies at most a
# drafter's block (16 for the published drafters); 64 costs 64 K/V rows per sliding layer.
RING_SLACK = 64


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
    del verify_width   # a verify writes in place
    item = resolve_dtype(dtype, "cache dtype").itemsize
    slots = (len(self.full_layers) * capacity
             + len(self.sliding_layers) * self.ring_slots(capacity))
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
    return min(self.sliding_window + RING_SLACK, capacity)

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

@flax.struct.dataclass
class Joint:
  """The residual stream x [M, E] f32 between two sublayers, the finished sublayer's output
  still in its split-K partials [P, M, E] f32 with the w of its post norm's (1 + w) weight
  and its eps: the next `sandwich_norm` finishes it (one launch on the Pallas path)."""
  x: jax.Array
  parts: jax.Array
  w_post: jax.Array
  post_eps: float = flax.struct.field(pytree_node=False, default=0.0)


def _embedded(params: MuseParams, cfg: MuseGlimmerConfig, tokens: jax.Array) -> Joint:
  """The embedding's weight-less norm as the first joint's pending sublayer (zero residual,
  post weight 1 + 0, `rms_norm_eps`): the first joint writes HF's hidden_states[0] and layer
  0's input norm in one launch, one row per program (batch invariant, where XLA's own row
  norm would pick its reduction order by the row count)."""
  e = params.embed[tokens.reshape(-1)].astype(jnp.float32)
  return Joint(jnp.zeros_like(e), e[None], jnp.zeros((e.shape[1],), jnp.float32),
               cfg.rms_norm_eps)


def _join(cfg: MuseGlimmerConfig, j: Joint, w_norm: jax.Array, w, impl: str,
          policy: KernelPolicy, offset: float = 1.0, out_dtype=None):
  """(the residual with j's sublayer added, its norm (weight offset + w_norm) as the input
  of linear(., w))."""
  return sandwich_norm(j.x, j.parts, j.w_post, j.post_eps, w_norm, cfg.rms_norm_eps, w,
                       offset=offset, post_offset=1.0, policy=policy, impl=impl,
                       out_dtype=out_dtype)


def _qkv(cfg: MuseGlimmerConfig, l: int, y: jax.Array, positions: jax.Array,
         freqs: jax.Array):
  """q [B, T, Hq, D], k and v [B, T, Hkv, D] f32 from the fused projection's sum y [B T, W]:
  weight-less q/k norms (q times qk_scale_factor), rope on the layers that have it."""
  b, t = positions.shape
  d, eps, qd, kvd = cfg.head_dim, cfg.rms_norm_eps, cfg.q_dim, cfg.kv_dim
  q = rms_norm(y[:, :qd].reshape(b, t, cfg.num_attention_heads, d), cfg.qk_scale_factor, eps)
  k = rms_norm(y[:, qd:qd + kvd].reshape(b, t, cfg.num_key_value_heads, d), 1.0, eps)
  v = y[:, qd + kvd:qd + 2 * kvd].reshape(b, t, cfg.num_key_value_heads, d)
  if cfg.has_rope(l):
    scale = cfg.rope_scaling.attention_scaling
    q, k = rope(q, positions, freqs, scale), rope(k, positions, freqs, scale)
  return q, k, v


def _gated(cfg: MuseGlimmerConfig, o: jax.Array, y: jax.Array) -> jax.Array:
  """o [B T, Hq D] f32 times sigmoid of the output gate: the gate columns of the fused
  projection's partials y, summed in order (XLA fuses it all into the o projection's
  input)."""
  return o * jax.nn.sigmoid(sum_in_order(y[:, :, cfg.q_dim + 2 * cfg.kv_dim:]))


def _attention(q: jax.Array, parts) -> jax.Array:
  """q [B, T, Hq, D] f32 over key/value parts [(keys [B, Hkv, S, D], values, visible [B or
  1, T, S])], one softmax over all of them -> [B T, Hq D]. Each part's dots take their
  operands in its K/V dtype with float32 accumulation (full precision for float32). Every
  row must see at least one key (each row sees its own position)."""
  b, t, hq, d = q.shape
  hkv = parts[0][0].shape[1]
  scores = []
  for keys, _, visible in parts:
    prec = jax.lax.Precision.HIGHEST if keys.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    qg = q.reshape(b, t, hkv, hq // hkv, d).astype(keys.dtype)
    s = einsum_f32("btkgd,bksd->bkgts", qg, keys, prec) * (1.0 / math.sqrt(d))
    scores.append(jnp.where(visible[:, None, None], s, -jnp.inf))
  p = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
  o, start = 0.0, 0
  for (keys, values, _), s in zip(parts, scores):
    prec = jax.lax.Precision.HIGHEST if keys.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    n = s.shape[-1]
    o = o + einsum_f32("bkgts,bksd->btkgd", p[..., start:start + n].astype(values.dtype),
                       values, prec)
    start += n
  return o.reshape(b * t, hq * d)


def _layer(cfg: MuseGlimmerConfig, l: int, lp: MuseLayer, j: Joint, positions: jax.Array,
           attend, impl: str, policy: KernelPolicy):
  """Layer l on the stream j (rows [B T, E]) at positions [B, T] -> (Joint with the MLP's
  down projection pending, what attend kept, the residual stream entering the layer: HF's
  hidden_states[l]). attend(y, out_dtype) takes the fused
  q/k/v/gate projection's partials [P, B T, (2 Hq + 2 Hkv) D] and returns (the attention
  output times sigmoid(gate) [B T, Hq D], what the path keeps)."""
  post = cfg.post_norm_eps
  x_in, h = _join(cfg, j, lp.attn_norm, lp.wqkvg, impl, policy)
  y = project(h, lp.wqkvg, impl, policy, partials=True)
  o, kept = attend(y, input_dtype(lp.wo))
  x, h = _join(cfg, Joint(x_in, project(o, lp.wo, impl, policy, partials=True),
                          lp.post_attn_norm, post), lp.ffn_norm, lp.wgu, impl, policy)
  hidden = project(h, lp.wgu, impl, policy, gate_up=True,
                   out_dtype=jnp.float32 if impl == "xla" else input_dtype(lp.wd))
  return (Joint(x, project(hidden, lp.wd, impl, policy, partials=True), lp.post_ffn_norm, post),
          kept, x_in)


def _trunk(params: MuseParams, cfg: MuseGlimmerConfig, tokens: jax.Array, positions: jax.Array,
           attend_layer, capture_layers, impl: str):
  """Normed embedding -> layers -> final norm: (h [B T, E] in the LM head's input dtype,
  features [B, T, F], kept per layer).
  attend_layer(l) gives layer l's attend function."""
  capture = cfg.check_capture_layers(capture_layers)
  b, t = tokens.shape
  n = cfg.num_hidden_layers
  j = _embedded(params, cfg, tokens)
  seen, kept = {}, []
  for l, lp in enumerate(params.layers):
    j, k, x_in = _layer(cfg, l, lp, j, positions, attend_layer(l), impl, params.policy)
    if l in capture:
      seen[l] = x_in
    kept.append(k)
  _, h = _join(cfg, j, params.final_norm, params.head, impl, params.policy, offset=0.0)
  if n in capture:
    # Its float32 rows for the features from a launch of their own, so the LM head reads the
    # joint's bf16 rows whether or not the features are taken: float32 rows rounded for the
    # LM head outside the kernel can round otherwise on the GPU, and a verify capturing the
    # last layer would then not be batch invariant against a decode.
    seen[n] = _join(cfg, j, params.final_norm, params.head, impl, params.policy, offset=0.0,
                    out_dtype=jnp.float32)[1]
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


def _freqs(cfg: MuseGlimmerConfig) -> jax.Array:
  return jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))


def forward(params: MuseParams, cfg: MuseGlimmerConfig, tokens: jax.Array, *,
            capture_layers=(), with_logits: bool = True):
  """Uncached causal forward of tokens [B, T] at positions 0..T-1 -> (logits [B, T, V] f32 or
  None, features [B, T, F] f32). Differentiable; every GEMM is XLA's."""
  tokens = jnp.asarray(tokens, jnp.int32)
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  diff = (jnp.arange(t)[:, None] - jnp.arange(t)[None, :])[None]
  freqs = _freqs(cfg)

  def attend_layer(l):
    vis = _window(cfg, l, diff)

    def attend(y, _):
      q, k, v = _qkv(cfg, l, sum_in_order(y), positions, freqs)
      o = _attention(q, [(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), vis)])
      return _gated(cfg, o, y), None
    return attend

  h, feats, _ = _trunk(params, cfg, tokens, positions, attend_layer, capture_layers, "xla")
  return (_logits(params, cfg, h, (b, t), "xla") if with_logits else None), feats


# --- the cache and the cached path -----------------------------------------------------------

@flax.struct.dataclass
class MuseCache:
  """k / v: one [B, Hkv, S, D] per layer (full-attention layers: S = capacity, slot =
  position; sliding layers: a ring of S = `ring_slots(capacity)` slots, slot = position % S).
  length [B] int32: positions < length are committed. A verify's rows are written in place
  (past the length) and `commit` only moves the length."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  length: jax.Array
  capacity: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def batch(self) -> int:
    return int(self.length.shape[0])


def init_cache(cfg: MuseGlimmerConfig, batch: int, capacity: int, dtype: Any = "fp32"
               ) -> MuseCache:
  if batch <= 0 or capacity <= 0:
    raise ValueError(f"batch and capacity must be positive, got {batch} and {capacity}")
  dt = resolve_dtype(dtype, "cache dtype")
  shapes = [(batch, cfg.num_key_value_heads,
             cfg.ring_slots(capacity) if cfg.is_sliding(l) else capacity, cfg.head_dim)
            for l in range(cfg.num_hidden_layers)]
  return MuseCache(k=tuple(jnp.zeros(s, dt) for s in shapes),
                   v=tuple(jnp.zeros(s, dt) for s in shapes),
                   length=jnp.zeros((batch,), jnp.int32), capacity=int(capacity))


def _write(buf: jax.Array, rows: jax.Array, start: jax.Array,
           n: jax.Array | None = None) -> jax.Array:
  """buf [B, Hkv, S, D] with rows [B, T, Hkv, D] at slots start[b] .. start[b] + T - 1. With
  n [B], only rows t < n[b]: the others keep buf's values, so a sequence with n 0 is untouched
  even where start + T passes the capacity (the write's start is then clamped, and so is the
  read of the values it keeps)."""
  rows = rows.transpose(0, 2, 1, 3).astype(buf.dtype)
  t = rows.shape[2]
  if n is not None:
    old = jax.vmap(lambda c, s: jax.lax.dynamic_slice(c, (0, s, 0), (c.shape[0], t,
                                                                     c.shape[2])))(buf, start)
    keep = jnp.arange(t, dtype=jnp.int32)[None, :] < n[:, None]
    rows = jnp.where(keep[:, None, :, None], rows, old)
  if buf.shape[0] == 1:   # one sequence: a plain dynamic-update-slice, in place
    return jax.lax.dynamic_update_slice(buf, rows, (0, 0, start[0], 0))
  return jax.vmap(lambda c, r, s: jax.lax.dynamic_update_slice(c, r, (0, s, 0)))(
      buf, rows, start)


def _ring_write(ring: jax.Array, rows: jax.Array, start: jax.Array, n: jax.Array) -> jax.Array:
  """ring [B, Hkv, R, D] with rows t < n[b] of rows [B, T, Hkv, D] (positions start[b] + t)
  at slots (start + t) % R; of those only the last R (the earlier ones would be overwritten),
  so every written slot is distinct."""
  r, t = ring.shape[2], rows.shape[1]
  i = jnp.arange(t, dtype=jnp.int32)[None]
  keep = (i < n[:, None]) & (i >= n[:, None] - r)
  slot = jnp.where(keep, (start[:, None] + i) % r, r)   # r: out of range, dropped
  b = jnp.broadcast_to(jnp.arange(ring.shape[0], dtype=jnp.int32)[:, None], slot.shape)
  return ring.at[b, :, slot].set(rows.astype(ring.dtype), mode="drop")


def _ring_visible(cfg: MuseGlimmerConfig, l: int, r: int, start: jax.Array,
                  positions: jax.Array) -> jax.Array:
  """[B, T, R]: which slots of a ring as it was before the call (slot s holds the latest
  committed position = s mod R) rows at positions [B, T] see."""
  last = start[:, None] - 1
  held = last - (last - jnp.arange(r, dtype=jnp.int32)[None]) % r     # [B, R]
  return (held[:, None, :] >= 0) & (
      positions[:, :, None] - held[:, None, :] < cfg.sliding_window)


def _xla_attend_layer(cfg, cache: MuseCache, start, positions, n_write, freqs):
  """attend_layer of XLA's cached pass: K/V written (full layers at slot = position; rings at
  position % R, of a prefill only the committed rows), then a masked attention; a sliding
  layer attends over the ring as it was before the call plus the call's own rows (one
  softmax), so a prefill longer than the window needs no wider ring."""
  b, t = positions.shape
  own = (jnp.arange(t)[:, None] - jnp.arange(t)[None, :])[None]   # diff within the call
  all_rows = jnp.full((b,), t, jnp.int32)

  def attend_layer(l):
    ck, cv = cache.k[l], cache.v[l]

    def attend(y, _):
      q, k, v = _qkv(cfg, l, sum_in_order(y), positions, freqs)
      if not cfg.is_sliding(l):
        nk, nv = _write(ck, k, start, n_write), _write(cv, v, start, n_write)
        vis = jnp.arange(ck.shape[2], dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
        return _gated(cfg, _attention(q, [(nk, nv, vis)]), y), (nk, nv)
      k, v = k.astype(ck.dtype), v.astype(cv.dtype)   # as a later call will read them
      vis_ring = _ring_visible(cfg, l, ck.shape[2], start, positions)
      o = _attention(q, [(ck, cv, vis_ring), (k.transpose(0, 2, 1, 3),
                                              v.transpose(0, 2, 1, 3), _window(cfg, l, own))])
      n = all_rows if n_write is None else n_write
      return _gated(cfg, o, y), (_ring_write(ck, k, start, n), _ring_write(cv, v, start, n))
    return attend
  return attend_layer


def _pallas_attend_layer(cfg, cache: MuseCache, start, t: int, knobs, policy, freqs):
  """attend_layer of the Pallas cached pass: the q/k norms (+ rope) with the K/V rows
  written into the cache or ring in place (one launch), then the cache attention over the
  live slots (two launches; a ring's window masked in the kernel)."""
  b = start.shape[0]
  hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  q_norm = jnp.full((d,), cfg.qk_scale_factor, jnp.float32)
  k_norm = jnp.ones((d,), jnp.float32)

  def attend_layer(l):
    sliding = cfg.is_sliding(l)
    ring = dict(capacity=cache.capacity) if sliding else {}

    def attend(y, out_dtype):
      parts = y.reshape(y.shape[0], b, t, y.shape[-1] // d, d)
      q, ck, cv = norm_rope_k.qk_norm_rope_cache(
          parts, q_norm, k_norm, cache.k[l], cache.v[l], start, freqs, n_head=hq,
          n_head_kv=hkv, eps=cfg.rms_norm_eps, rope=cfg.has_rope(l),
          attention_scaling=cfg.rope_scaling.attention_scaling,
          block_rows=next_pow2(policy.target_pallas_max_width), **ring)
      # The output gate in the attention's combine: the o projection reads its output.
      o = cache_attn_k.cache_attention(
          q, ck, cv, start, y.reshape(y.shape[0], b, t, y.shape[-1]), t=t,
          gate_col=cfg.q_dim + 2 * cfg.kv_dim, window=cfg.sliding_window if sliding else 0,
          out_dtype=out_dtype, **ring, **knobs.kwargs())
      return o.reshape(b * t, hq * d), (ck, cv)
    return attend
  return attend_layer


def _extend(params: MuseParams, cfg: MuseGlimmerConfig, cache: MuseCache, tokens: jax.Array,
            n_commit, capture_layers, with_logits: bool, impl: str):
  """tokens [B, T] at positions length.., their K/V written in place; n_commit None (verify:
  every row written, nothing committed) or [B] (prefill: length += n_commit). impl "pallas"
  (`dispatch.target_attention`): up to policy.target_pallas_max_width rows per sequence run
  the Pallas pieces (which write every row: rows past n_commit land past the length, never
  seen); wider passes XLA's attention, which writes only the committed rows of a prefill."""
  tokens = jnp.asarray(tokens, jnp.int32)
  b, t = tokens.shape
  if n_commit is None and cfg.sliding_layers and t > RING_SLACK:
    raise ValueError(f"verify: {t} rows per sequence, but a sliding layer's ring serves "
                     f"verifies of at most RING_SLACK = {RING_SLACK} rows")
  start = cache.length
  positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)
  freqs = _freqs(cfg)
  knobs = target_attention(t=t, group=cfg.num_attention_heads // cfg.num_key_value_heads,
                           head_dim=cfg.head_dim, cache_dtype=cache.k[0].dtype, impl=impl,
                           policy=params.policy)
  if knobs is not None:
    attend_layer = _pallas_attend_layer(cfg, cache, start, t, knobs, params.policy, freqs)
  else:
    attend_layer = _xla_attend_layer(cfg, cache, start, positions, n_commit, freqs)
  h, feats, kept = _trunk(params, cfg, tokens, positions, attend_layer, capture_layers, impl)
  new = cache.replace(k=tuple(k for k, _ in kept), v=tuple(v for _, v in kept))
  if n_commit is not None:
    new = new.replace(length=start + n_commit)
  return new, (_logits(params, cfg, h, (b, t), impl) if with_logits else None), feats


def prefill(params: MuseParams, cfg: MuseGlimmerConfig, cache: MuseCache, tokens: jax.Array,
            n_valid: jax.Array, *, capture_layers=(), impl: str = "xla"):
  """Commit rows 0..n_valid-1 of tokens [B, T] (T padded to a bucket, any valid ids past
  n_valid) at positions length.. -> (cache, features [B, T, F]; rows past n_valid garbage).
  Padding rows change nothing a later call sees (XLA's path writes none; the Pallas path's
  land past the length, over ring positions out of every window), so a sequence with
  n_valid 0 is left as it was."""
  n = jnp.broadcast_to(jnp.asarray(n_valid, jnp.int32), (tokens.shape[0],))
  cache, _, feats = _extend(params, cfg, cache, tokens, n, capture_layers, False, impl)
  return cache, feats


def verify(params: MuseParams, cfg: MuseGlimmerConfig, cache: MuseCache, tokens: jax.Array, *,
           capture_layers=(), impl: str = "xla"):
  """Run tokens [B, w] (w <= RING_SLACK where the model has sliding layers) at positions
  length.. -> (cache, logits [B, w, V] f32, features [B, w, F] f32). Every row's K/V is
  written in place past the length; nothing is committed until `commit`."""
  return _extend(params, cfg, cache, tokens, None, capture_layers, True, impl)


def commit(cfg: MuseGlimmerConfig, cache: MuseCache, n_keep: jax.Array) -> MuseCache:
  """Keep the first n_keep [B] rows of the last verify: length += n_keep. The rows past them
  stay where the verify wrote them, past the length, and are overwritten by later calls
  before anything reads them."""
  del cfg
  n = jnp.broadcast_to(jnp.asarray(n_keep, jnp.int32), cache.length.shape)
  return cache.replace(length=cache.length + n)


def reset(cache: MuseCache, empty: jax.Array) -> MuseCache:
  """Empty the sequences where empty [B]: length 0. Their K/V stay, never visible (a row at
  position p sees full-layer slots <= p and ring slots holding positions <= p, all rewritten
  from 0 on)."""
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
