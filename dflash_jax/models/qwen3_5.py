"""The Qwen3.5 / 3.6 / 3.8 hybrid target (and Qwen3-Next's storage of it) in functional JAX.

Three of every four decoder layers (by default; `layer_types` says which) mix tokens with a
Gated DeltaNet, the rest with gated full attention; every layer then runs a SwiGLU MLP. The
decoder norms, the q/k norms and the final norm weigh by (1 + w); the embedding is not
normed. shared/research/target_families.md section 2 holds the semantics; briefly:

- Gated DeltaNet (per token): one projection gives the conv channels (all q heads, all k
  heads, all v heads: C = 2 nk dk + nv dv), z, b and a; a causal depthwise conv over time of
  width K on the channels (its state: the last K-1 pre-conv rows), silu; q and k l2-normed
  (q also scaled by 1/sqrt(dk)); beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias);
  the gated delta rule on S [nv, dk, dv] (pallas_kernels/gdn.py; value head j reads key
  head j // (nv / nk)); o = rms(o) * w * silu(z) (a plain-weight norm before the gate);
  out_proj.
- Gated attention: q_proj's rows are per head [query D | gate D]; q and k are (1+w) normed,
  then NEOX rope turns their first rot = head_dim * partial_rotary_factor dims (text-only
  M-RoPE positions are equal in its three streams, so it is plain rope); causal softmax
  attention (GQA, contiguous groups), times sigmoid(gate), then o_proj.

The cache (`TargetCache`): K/V per attention layer [B, Hkv, S, D] (slot = position, as in
qwen3), and per Gated DeltaNet layer the state S and the conv window, float32 whatever the
weight dtype, stacked over those layers ([B, Lg, nv, dk, dv] and [B, Lg, K-1, C]; every
cache array has the batch axis first) so that a commit updates all of them in one launch.
A verify of w rows reads S once and leaves S and the window as they were; it records in
`Pending` what `commit(cache, n_keep)` needs to move them to after row n_keep - 1. The
config's `rollback` picks how (both kept so that the GPU can decide):
- "snapshot": the verify kernel also writes S after every row ([B, Lg, w, nv, dk, dv]); the
  commit copies row n_keep - 1's. State bytes per round: w + 1 written, 2 read.
- "replay": the verify keeps its rows' recurrence inputs (q, k, v, g, beta: about C floats
  per row and layer); the commit runs the rule again over the first n_keep rows from the
  untouched pre-verify S (gdn.replay: bitwise the verify's own states). State bytes per
  round: 1 written, 2 read.
Both keep the verify's pre-conv rows for the conv window. `cache_nbytes` counts each.

Layout: matrices stay HF's (out, in); every product is `dflash_jax.dispatch.linear`, routed
by the params' KernelPolicy under impl="pallas". A Gated
DeltaNet layer's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a are one matrix (Qwen3-Next's
per-key-head grouped in_proj_qkvz / in_proj_ba are reordered into it at load); an attention
layer's q (with its gate rows), k and v are one matrix; gate and up are one. Norm weights are
kept as stored (float32) and applied as (1 + w) where the model does. Layers are a tuple of
per-layer pytrees of two kinds (`GDNLayer`, `AttnLayer`).

Not covered: the MoE FFN variants (qwen3_5_moe, Qwen3-Next's sparse layers with the shared
expert); a config with MoE layers is refused by name.
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
from jax import lax

from dflash_jax.config import RopeScaling, checked_rope_scaling, rope_from_hf, rope_inv_freq
from dflash_jax.models import base
from dflash_jax.models.qwen3 import _attention, _write
from dflash_jax.dispatch import KernelPolicy, linear, resolve_dtype, rms_norm
from pallas_kernels import gdn

LINEAR, FULL = "linear_attention", "full_attention"
MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next")
ROLLBACKS = ("replay", "snapshot")
IMPLS = ("xla", "pallas")
_ARCHITECTURES = {"qwen3_5": "Qwen3_5ForConditionalGeneration",
                  "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}
# Where the text model's tensors sit in each checkpoint form (the VLM nests it).
_PREFIX = {"qwen3_5": "model.language_model.", "qwen3_5_text": "model.", "qwen3_next": "model."}
L2_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class TargetConfig(base.HFDecoderFacts):
  """The hybrid's shape (HF config names); frozen and hashable (a static jit argument).

  `layer_types`: each layer's mixer, "linear_attention" (Gated DeltaNet) or
  "full_attention"; None gives HF's default (full attention every 4th layer). `model_type`:
  the checkpoint form (`MODEL_TYPES`: the VLM "qwen3_5" nests the text model under
  model.language_model., "qwen3_5_text" and "qwen3_next" under model.; "qwen3_next" stores
  the grouped projections). `rollback`: how a commit restores the recurrent state after a
  partial acceptance ("replay" or "snapshot", see the module docstring); not an HF key.
  """
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int = 256
  layer_types: tuple[str, ...] | None = None
  linear_conv_kernel_dim: int = 4
  linear_key_head_dim: int = 128
  linear_value_head_dim: int = 128
  linear_num_key_heads: int = 16
  linear_num_value_heads: int = 32
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1e7
  partial_rotary_factor: float = 0.25
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 262144
  eos_token_ids: tuple[int, ...] = ()
  model_type: str = "qwen3_5"
  # The rope scaling of the rotary dims (config.RopeScaling: none / linear / llama3 / yarn).
  rope_scaling: RopeScaling = RopeScaling()
  rollback: str = "replay"

  def __post_init__(self):
    problems = []
    object.__setattr__(self, "rope_scaling", checked_rope_scaling(self.rope_scaling, problems))
    problems += self.dim_problems(("linear_conv_kernel_dim", "linear_key_head_dim",
                                   "linear_value_head_dim", "linear_num_key_heads",
                                   "linear_num_value_heads"), neox_head=False)
    if not problems:
      if self.linear_num_value_heads % self.linear_num_key_heads:
        problems.append(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a "
                        f"multiple of linear_num_key_heads ({self.linear_num_key_heads})")
      rot = int(self.head_dim * self.partial_rotary_factor)
      if not 0 < self.partial_rotary_factor <= 1 or rot < 2 or rot % 2:
        problems.append(f"head_dim * partial_rotary_factor must give an even rotary width >= 2, "
                        f"got {self.head_dim} * {self.partial_rotary_factor!r}")
    kinds = self.layer_types
    if kinds is None and not problems:
      kinds = tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(self.num_hidden_layers))
    if kinds is not None:
      kinds = tuple(kinds)
      bad = sorted(set(kinds) - {LINEAR, FULL})
      if bad:
        problems.append(f"layer_types must hold {(LINEAR, FULL)}, got {bad}")
      elif not problems and len(kinds) != self.num_hidden_layers:
        problems.append(f"layer_types has {len(kinds)} entries for num_hidden_layers "
                        f"{self.num_hidden_layers}")
      object.__setattr__(self, "layer_types", kinds)
    if self.model_type not in MODEL_TYPES:
      problems.append(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
    if self.rollback not in ROLLBACKS:
      problems.append(f"rollback must be one of {ROLLBACKS}, got {self.rollback!r}")
    ids, bad = base.eos_token_ids(self.eos_token_ids, self.vocab_size)
    object.__setattr__(self, "eos_token_ids", ids)
    problems += bad
    if problems:
      raise ValueError("invalid qwen3_5 TargetConfig: " + "; ".join(problems))

  # --- the Target protocol (models/base.py) ---
  def init_cache(self, batch: int, capacity: int, dtype: Any = "fp32") -> "TargetCache":
    return init_cache(self, batch, capacity, dtype)

  def cache_nbytes(self, batch: int, capacity: int, dtype: Any = "fp32",
                   verify_width: int = 1) -> int:
    return cache_nbytes(self, batch, capacity, dtype, verify_width)

  def prefill(self, params, cache, tokens, n_valid, *, capture_layers=(), impl: str = "xla"):
    return prefill(params, self, cache, tokens, n_valid, capture_layers=capture_layers,
                   impl=impl)

  def verify(self, params, cache, tokens, *, capture_layers=(), impl: str = "xla"):
    return verify(params, self, cache, tokens, capture_layers=capture_layers, impl=impl)

  def commit(self, cache: "TargetCache", n_keep: jax.Array) -> "TargetCache":
    return commit(self, cache, n_keep)

  def reset(self, cache: "TargetCache", empty: jax.Array) -> "TargetCache":
    return reset(cache, empty)

  def forward(self, params, tokens, *, capture_layers=(), with_logits: bool = True):
    return forward(params, self, tokens, capture_layers=capture_layers,
                   with_logits=with_logits)

  # --- derived sizes ---
  @property
  def gdn_layers(self) -> tuple[int, ...]:
    return tuple(i for i, k in enumerate(self.layer_types) if k == LINEAR)

  @property
  def attn_layers(self) -> tuple[int, ...]:
    return tuple(i for i, k in enumerate(self.layer_types) if k == FULL)

  @property
  def slot(self) -> dict[int, int]:
    """Layer index -> its index among the layers of its kind (the stacked cache's axis 0)."""
    return {**{l: i for i, l in enumerate(self.gdn_layers)},
            **{l: i for i, l in enumerate(self.attn_layers)}}

  @property
  def nk(self) -> int:
    return self.linear_num_key_heads

  @property
  def nv(self) -> int:
    return self.linear_num_value_heads

  @property
  def dk(self) -> int:
    return self.linear_key_head_dim

  @property
  def dv(self) -> int:
    return self.linear_value_head_dim

  @property
  def key_dim(self) -> int:
    return self.nk * self.dk

  @property
  def value_dim(self) -> int:
    return self.nv * self.dv

  @property
  def conv_dim(self) -> int:
    """C: the conv's channels (q, k and v heads)."""
    return 2 * self.key_dim + self.value_dim

  @property
  def in_dim(self) -> int:
    """Rows of a Gated DeltaNet layer's fused input projection: conv channels, z, b, a."""
    return self.conv_dim + self.value_dim + 2 * self.nv

  @property
  def rot(self) -> int:
    """The rotary width: rope turns each q/k head's first `rot` dims."""
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def prefix(self) -> str:
    return _PREFIX[self.model_type]

  def to_hf(self) -> dict[str, Any]:
    """The config.json of this model in its checkpoint form (`model_type`)."""
    eos = list(self.eos_token_ids)
    text = {
        "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
        "layer_types": list(self.layer_types),
        "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
        "linear_key_head_dim": self.dk, "linear_value_head_dim": self.dv,
        "linear_num_key_heads": self.nk, "linear_num_value_heads": self.nv,
        "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu", "attention_bias": False,
        "max_position_embeddings": self.max_position_embeddings,
        "tie_word_embeddings": self.tie_word_embeddings,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    scaling = self.rope_scaling.to_hf()
    if self.model_type == "qwen3_next":   # flat rope keys, dense MLP in every layer
      return {"architectures": [_ARCHITECTURES["qwen3_next"]], "model_type": "qwen3_next",
              **text, "rope_theta": self.rope_theta, "rope_scaling": scaling,
              "partial_rotary_factor": self.partial_rotary_factor, "num_experts": 0,
              "decoder_sparse_step": 1, "mlp_only_layers": []}
    text["rope_parameters"] = {**(scaling or {"rope_type": "default"}),
                               "rope_theta": self.rope_theta,
                               "partial_rotary_factor": self.partial_rotary_factor}
    if self.model_type == "qwen3_5_text":
      return {"architectures": [_ARCHITECTURES["qwen3_5_text"]], "model_type": "qwen3_5_text",
              **text}
    return {"architectures": [_ARCHITECTURES["qwen3_5"]], "model_type": "qwen3_5",
            "text_config": {"model_type": "qwen3_5_text", **text},
            "tie_word_embeddings": self.tie_word_embeddings}


def config_from_hf(config: Mapping[str, Any], where: str) -> TargetConfig:
  """An HF config dict (model_type in MODEL_TYPES) -> TargetConfig; ValueError naming `where`
  and the key. The VLM form ("qwen3_5") reads its text_config (tie_word_embeddings and
  eos_token_id also from the top level)."""
  c = dict(config)
  model_type = c.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ValueError(f"{where}: model_type {model_type!r} is not a Qwen3.5 hybrid "
                     f"(supported: {list(MODEL_TYPES)}; the MoE variants are not)")
  if model_type == "qwen3_5":
    text = c.get("text_config")
    if not isinstance(text, Mapping):
      raise ValueError(f"{where}: model_type 'qwen3_5' needs a text_config object")
    text = dict(text)
    if text.get("model_type", "qwen3_5_text") != "qwen3_5_text":
      raise ValueError(f"{where}: text_config.model_type {text['model_type']!r} is not "
                       "supported (only 'qwen3_5_text'; the MoE variant is not)")
    for key in ("tie_word_embeddings", "eos_token_id"):
      if key not in text and key in c:
        text[key] = c[key]
    c, where = text, f"{where} (text_config)"
  if model_type == "qwen3_next":
    experts = c.get("num_experts", 512)   # HF's default
    sparse = [i for i in range(c.get("num_hidden_layers", 0))
              if experts > 0 and i not in (c.get("mlp_only_layers") or [])
              and (i + 1) % c.get("decoder_sparse_step", 1) == 0]
    if sparse:
      raise ValueError(f"{where}: num_experts {experts} makes layers {sparse[:4]}"
                       f"{' ...' * (len(sparse) > 4)} MoE layers; the MoE FFN is not supported "
                       "(dense MLP layers only)")
  for key, bad in (("attention_bias", True), ("use_sliding_window", True)):
    if c.get(key) == bad:
      raise ValueError(f"{where}: {key}={bad} is not supported")
  if c.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{where}: hidden_act {c['hidden_act']!r} is not supported (only silu)")
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads")
  missing = [k for k in required if k not in c]
  if missing:
    raise ValueError(f"{where}: missing config keys {missing}")
  rope = dict(c.get("rope_parameters") or {})
  if c.get("rope_scaling"):
    rope = {**c["rope_scaling"], **rope}
  theta, scaling = rope_from_hf(c, where)
  if theta is None:
    raise ValueError(f"{where}: missing config keys ['rope_parameters.rope_theta']")
  heads = c["num_attention_heads"]
  layer_types = c.get("layer_types")
  if layer_types is None:
    interval = c.get("full_attention_interval", 4)
    layer_types = [FULL if (i + 1) % interval == 0 else LINEAR
                   for i in range(c["num_hidden_layers"])]
  defaults = {f.name: f.default for f in dataclasses.fields(TargetConfig)}
  get = lambda key: c.get(key, defaults[key])
  try:
    return TargetConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim") or defaults["head_dim"], layer_types=tuple(layer_types),
        linear_conv_kernel_dim=get("linear_conv_kernel_dim"),
        linear_key_head_dim=get("linear_key_head_dim"),
        linear_value_head_dim=get("linear_value_head_dim"),
        linear_num_key_heads=get("linear_num_key_heads"),
        linear_num_value_heads=get("linear_num_value_heads"),
        rms_norm_eps=float(get("rms_norm_eps")), rope_theta=float(theta),
        partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                             get("partial_rotary_factor"))),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_position_embeddings=get("max_position_embeddings"),
        eos_token_ids=c.get("eos_token_id"), model_type=model_type, rope_scaling=scaling)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


# --- parameters ------------------------------------------------------------------------------

@flax.struct.dataclass
class GDNLayer:
  attn_norm: jax.Array          # [E] f32, applied as (1 + w)
  w_in: jax.Array               # [C + nv dv + 2 nv, E]: conv channels (q, k, v heads), z, b, a
  conv: jax.Array               # [K, C] f32: conv[j] weighs the row K-1-j steps back
  dt_bias: jax.Array            # [nv] f32
  a_log: jax.Array              # [nv] f32
  norm: jax.Array               # [dv] f32: the gated norm's plain weight
  w_out: jax.Array              # [E, nv dv]
  ffn_norm: jax.Array           # [E] f32, (1 + w)
  wgu: jax.Array                # [2 F, E]: gate rows then up rows
  wd: jax.Array                 # [E, F]


@flax.struct.dataclass
class AttnLayer:
  attn_norm: jax.Array          # [E] f32, (1 + w)
  wqkv: jax.Array               # [(2 Hq + 2 Hkv) D, E]: q_proj as stored (per head: query D,
                                # gate D), then k, v
  q_norm: jax.Array             # [D] f32, (1 + w)
  k_norm: jax.Array             # [D] f32, (1 + w)
  wo: jax.Array                 # [E, Hq D]
  ffn_norm: jax.Array           # [E] f32, (1 + w)
  wgu: jax.Array                # [2 F, E]
  wd: jax.Array                 # [E, F]


@flax.struct.dataclass
class TargetParams:
  """Device weights: matrices in the weight dtype, (out, in); everything else float32.
  policy: the GEMM routing of impl="pallas" (static: part of every jit key)."""
  embed: jax.Array              # [V, E]
  layers: tuple[GDNLayer | AttnLayer, ...]
  final_norm: jax.Array         # [E] f32, (1 + w)
  lm_head: jax.Array | None     # [V, E]; None when tied to embed
  policy: KernelPolicy = flax.struct.field(pytree_node=False, default=KernelPolicy())

  @property
  def head(self) -> jax.Array:
    return self.embed if self.lm_head is None else self.lm_head


def _normals(key: jax.Array, shapes: dict[str, tuple[int, ...]]) -> dict[str, jax.Array]:
  """N(0, 1) float32 arrays of the given shapes from one random draw (one threefry in the
  program; each separate draw would add its own, and their compile time dominates on CPU)."""
  sizes = [math.prod(s) for s in shapes.values()]
  flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
  offsets = np.cumsum([0] + sizes)
  return {name: flat[o:o + n].reshape(s) for (name, s), o, n in
          zip(shapes.items(), offsets, sizes)}


def _mats(r: dict, scale: dict, dtype) -> dict[str, jax.Array]:
  """The matrices of r as N(0, scale^2 / fan_in) in dtype."""
  return {k: (r[k] * (s / math.sqrt(r[k].shape[1]))).astype(dtype) for k, s in scale.items()}


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_gdn(cfg: TargetConfig, key: jax.Array, dtype) -> GDNLayer:
  e, f, kw = cfg.hidden_size, cfg.intermediate_size, cfg.linear_conv_kernel_dim
  branch = 1.0 / math.sqrt(2.0 * cfg.num_hidden_layers)
  r = _normals(key, {"w_in": (cfg.in_dim, e), "w_out": (e, cfg.value_dim), "wgu": (2 * f, e),
                     "wd": (e, f), "conv": (kw, cfg.conv_dim), "heads": (2, cfg.nv),
                     "norms": (2 * e + cfg.dv,)})
  m = _mats(r, {"w_in": 1.0, "w_out": branch, "wgu": 1.0, "wd": branch}, dtype)
  n = 0.1 * r["norms"]
  # A = exp(A_log) in (0.05, 1): decays exp(g) mostly in (0.4, 1), so the state carries
  # over tens of tokens (a test of the rollback needs it to matter).
  a_log = jnp.log(0.05 + 0.95 * jax.nn.sigmoid(r["heads"][0]))
  return GDNLayer(attn_norm=n[:e], w_in=m["w_in"], conv=r["conv"] / math.sqrt(kw),
                  dt_bias=0.5 * r["heads"][1], a_log=a_log, norm=1.0 + n[2 * e:],
                  w_out=m["w_out"], ffn_norm=n[e:2 * e], wgu=m["wgu"], wd=m["wd"])


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_attn(cfg: TargetConfig, key: jax.Array, dtype) -> AttnLayer:
  e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  branch = 1.0 / math.sqrt(2.0 * cfg.num_hidden_layers)
  r = _normals(key, {"wqkv": (2 * cfg.q_dim + 2 * cfg.kv_dim, e), "wo": (e, cfg.q_dim),
                     "wgu": (2 * f, e), "wd": (e, f), "norms": (2 * e + 2 * d,)})
  m = _mats(r, {"wqkv": 1.0, "wo": branch, "wgu": 1.0, "wd": branch}, dtype)
  n = 0.1 * r["norms"]
  return AttnLayer(attn_norm=n[:e], wqkv=m["wqkv"], q_norm=n[2 * e:2 * e + d],
                   k_norm=n[2 * e + d:], wo=m["wo"], ffn_norm=n[e:2 * e], wgu=m["wgu"],
                   wd=m["wd"])


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_outer(cfg: TargetConfig, key: jax.Array, dtype):
  # A draw each: a 248320-token embedding and head together pass 2^31 elements.
  v, e = cfg.vocab_size, cfg.hidden_size
  k_embed, k_norm, k_head = jax.random.split(key, 3)
  embed = jax.random.normal(k_embed, (v, e), jnp.float32).astype(dtype)
  head = None if cfg.tie_word_embeddings else (
      jax.random.normal(k_head, (v, e), jnp.float32) / math.sqrt(e)).astype(dtype)
  return embed, 0.1 * jax.random.normal(k_norm, (e,), jnp.float32), head


def init_params(cfg: TargetConfig, key: jax.Array, dtype: Any = jnp.float32) -> TargetParams:
  """Random weights, generated on the device (one compiled initializer per layer kind).

  Matrices N(0, 1/fan_in), the residual branches (o, out, down) further scaled by
  1/sqrt(2 n_layers); embedding N(0, 1); an untied head N(0, 1/E); stored (1+w) norm weights
  0.1 N(0, 1); the gated norm's weight 1 + 0.1 N(0, 1); conv taps N(0, 1/K); dt_bias
  0.5 N(0, 1); A_log as `_init_gdn` says.
  """
  dt = resolve_dtype(dtype)
  keys = jax.random.split(key, cfg.num_hidden_layers + 1)
  embed, final_norm, head = _init_outer(cfg, keys[0], dt)
  layers = tuple((_init_gdn if kind == LINEAR else _init_attn)(cfg, k, dt)
                 for kind, k in zip(cfg.layer_types, keys[1:]))
  return TargetParams(embed=embed, layers=layers, final_norm=final_norm, lm_head=head)


# --- the layers (shared by every path) -------------------------------------------------------

def _norm1p(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """RMS norm weighed by (1 + w), the decoder / q-k / final norm of this family."""
  return rms_norm(x, 1.0 + w, eps)


def _rope(x: jax.Array, positions: jax.Array, freqs: jax.Array,
          attention_scaling: float = 1.0) -> jax.Array:
  """NEOX rope of the first 2 len(freqs) dims of x [B, T, H, D] at positions [B, T]; cos and
  sin carry the rope scaling's attention factor, as HF applies it (config.RopeScaling)."""
  rot = 2 * freqs.shape[0]
  angle = positions.astype(jnp.float32)[:, :, None, None] * freqs
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  if attention_scaling != 1.0:
    cos, sin = cos * attention_scaling, sin * attention_scaling
  x1, x2, rest = x[..., :rot // 2], x[..., rot // 2:rot], x[..., rot:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def _attention_mix(cfg: TargetConfig, lp: AttnLayer, h: jax.Array, positions: jax.Array,
                   freqs: jax.Array, attend, impl: str, policy: KernelPolicy):
  """Gated attention of normed rows h [B T, E] at positions [B, T]. attend(q, k, v) with
  q [B, T, Hq, D], k/v [B, T, Hkv, D] returns (o [B, T, Hq D], whatever the path keeps)."""
  b, t = positions.shape
  eps, d, hq, hkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
  qkv = linear(h, lp.wqkv, policy=policy, impl=impl)
  both = qkv[:, :2 * cfg.q_dim].reshape(b, t, hq, 2, d)    # per head: query, then gate
  q, gate = both[..., 0, :], both[..., 1, :]
  k = qkv[:, 2 * cfg.q_dim:2 * cfg.q_dim + cfg.kv_dim].reshape(b, t, hkv, d)
  v = qkv[:, 2 * cfg.q_dim + cfg.kv_dim:].reshape(b, t, hkv, d)
  q, k = _norm1p(q, lp.q_norm, eps), _norm1p(k, lp.k_norm, eps)
  scale = cfg.rope_scaling.attention_scaling
  o, kept = attend(_rope(q, positions, freqs, scale), _rope(k, positions, freqs, scale), v)
  o = o.reshape(b * t, cfg.q_dim) * jax.nn.sigmoid(gate.reshape(b * t, cfg.q_dim))
  return linear(o, lp.wo, policy=policy, impl=impl), kept


@flax.struct.dataclass
class GDNRows:
  """A Gated DeltaNet layer's per-row quantities (B, T rows): what the rule runs on."""
  mixed: jax.Array              # [B, T, C] pre-conv rows
  q: jax.Array                  # [B, T, nk, dk] l2-normed, / sqrt(dk)
  k: jax.Array                  # [B, T, nk, dk] l2-normed
  v: jax.Array                  # [B, T, nv, dv]
  g: jax.Array                  # [B, T, nv] log decay
  beta: jax.Array               # [B, T, nv]
  z: jax.Array                  # [B, T, nv, dv] the output gate


def _l2(x: jax.Array) -> jax.Array:
  return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _gdn_rows(cfg: TargetConfig, lp: GDNLayer, h: jax.Array, window: jax.Array, shape,
              impl: str, policy: KernelPolicy) -> GDNRows:
  """Normed rows h [B T, E] after the conv window [B, K-1, C] -> their GDNRows."""
  b, t = shape
  c, vd, nv, kd = cfg.conv_dim, cfg.value_dim, cfg.nv, cfg.key_dim
  proj = linear(h, lp.w_in, policy=policy, impl=impl)
  mixed = proj[:, :c].reshape(b, t, c)
  full = jnp.concatenate([window, mixed], axis=1)           # [B, K-1+T, C], oldest first
  conv = full[:, :t] * lp.conv[0]
  for j in range(1, cfg.linear_conv_kernel_dim):
    conv = conv + full[:, j:j + t] * lp.conv[j]
  conv = jax.nn.silu(conv)
  q = _l2(conv[..., :kd].reshape(b, t, cfg.nk, cfg.dk)) * (1.0 / math.sqrt(cfg.dk))
  k = _l2(conv[..., kd:2 * kd].reshape(b, t, cfg.nk, cfg.dk))
  gb, ga = proj[:, c + vd:c + vd + nv], proj[:, c + vd + nv:]
  g = -jnp.exp(lp.a_log) * jax.nn.softplus(ga + lp.dt_bias)
  return GDNRows(mixed=mixed, q=q, k=k, v=conv[..., 2 * kd:].reshape(b, t, nv, cfg.dv),
                 g=g.reshape(b, t, nv), beta=jax.nn.sigmoid(gb).reshape(b, t, nv),
                 z=proj[:, c:c + vd].reshape(b, t, nv, cfg.dv))


def _gdn_out(cfg: TargetConfig, lp: GDNLayer, o: jax.Array, z: jax.Array, impl: str,
             policy: KernelPolicy):
  """The rule's output o [B, T, nv, dv] -> gated norm -> out_proj [B T, E]."""
  o = rms_norm(o, lp.norm, cfg.rms_norm_eps) * jax.nn.silu(z)
  return linear(o.reshape(-1, cfg.value_dim), lp.w_out, policy=policy, impl=impl)


def _window_after(full: jax.Array, n: jax.Array, kw: int) -> jax.Array:
  """The conv window after n[b] more rows: full [B, K-1+T, C] (window, then the rows) ->
  full[b, n[b] : n[b] + K - 1]."""
  return jax.vmap(lambda f, s: lax.dynamic_slice_in_dim(f, s, kw - 1, axis=0))(full, n)


def _trunk(params: TargetParams, cfg: TargetConfig, tokens: jax.Array, positions: jax.Array,
           attend_layer, gdn_layer, capture_layers, impl: str):
  """Embeddings -> layers -> final norm -> (h [B T, E], features [B, T, F]).
  attend_layer(l) gives attention layer l's attend function; gdn_layer(l, lp, h) runs
  Gated DeltaNet layer l's mixer on normed rows h and returns its output [B T, E]."""
  capture = cfg.check_capture_layers(capture_layers)
  b, t = tokens.shape
  eps = cfg.rms_norm_eps
  freqs = jnp.asarray(rope_inv_freq(cfg.rot, cfg.rope_theta, cfg.rope_scaling))
  policy = params.policy
  x = params.embed[tokens.reshape(-1)].astype(jnp.float32)
  seen = {}
  for l, lp in enumerate(params.layers):
    if l in capture:
      seen[l] = x
    h = _norm1p(x, lp.attn_norm, eps)
    if cfg.layer_types[l] == FULL:
      y, _ = _attention_mix(cfg, lp, h, positions, freqs, attend_layer(l), impl, policy)
    else:
      y = gdn_layer(l, lp, h)
    x = x + y
    hidden = linear(_norm1p(x, lp.ffn_norm, eps), lp.wgu, policy=policy, impl=impl,
                    gate_up=True)
    x = x + linear(hidden, lp.wd, policy=policy, impl=impl)
  h = _norm1p(x, params.final_norm, eps)
  seen[cfg.num_hidden_layers] = h
  feats = (jnp.concatenate([seen[i] for i in capture], axis=-1) if capture
           else jnp.zeros((b * t, 0), jnp.float32))
  return h, feats.reshape(b, t, -1)


def _logits(params: TargetParams, h: jax.Array, shape, impl: str) -> jax.Array:
  return linear(h, params.head, policy=params.policy, impl=impl).reshape(*shape, -1)


def _check_impl(impl: str) -> None:
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def forward(params: TargetParams, cfg: TargetConfig, tokens: jax.Array, *,
            capture_layers=(), with_logits: bool = True):
  """Uncached causal forward of tokens [B, T] int32 at positions 0..T-1.

  Returns (logits [B, T, V] f32, or None when with_logits=False; features [B, T,
  len(capture_layers) E] f32). Differentiable: XLA's GEMMs and the chunked rule's twin.
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  causal = jnp.tril(jnp.ones((t, t), bool))[None]
  zero_state = jnp.zeros((b, 1, cfg.nv, cfg.dk, cfg.dv), jnp.float32)
  window = jnp.zeros((b, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), jnp.float32)

  def attend_layer(_):
    def attend(q, k, v):
      return _attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), causal), None
    return attend

  def gdn_layer(l, lp, h):
    r = _gdn_rows(cfg, lp, h, window, (b, t), "xla", params.policy)
    o, _ = gdn.chunked_reference(r.q, r.k, r.v, r.g, r.beta, zero_state, 0)
    return _gdn_out(cfg, lp, o, r.z, "xla", params.policy)

  h, feats = _trunk(params, cfg, tokens, positions, attend_layer, gdn_layer, capture_layers,
                    "xla")
  return (_logits(params, h, (b, t), "xla") if with_logits else None), feats


# --- the cache and the cached path -----------------------------------------------------------

@flax.struct.dataclass
class Pending:
  """What a verify of w rows leaves for its commit (stacked over the Gated DeltaNet layers).
  rows: the pre-conv rows [B, Lg, w, C]. snapshot rollback: snaps [B, Lg, w, nv, dk, dv], S
  after each row. replay rollback: the rule's inputs q, k [B, Lg, w, nk, dk], v [B, Lg, w,
  nv, dv], g, beta [B, Lg, w, nv]. impl: the verify's kernels, which the commit reuses."""
  rows: jax.Array
  snaps: jax.Array | None = None
  q: jax.Array | None = None
  k: jax.Array | None = None
  v: jax.Array | None = None
  g: jax.Array | None = None
  beta: jax.Array | None = None
  impl: str = flax.struct.field(pytree_node=False, default="xla")


@flax.struct.dataclass
class TargetCache:
  """k, v: per attention layer [B, Hkv, S, D] (after q/k norm and rope; slot = position);
  state [B, Lg, nv, dk, dv] and conv [B, Lg, K-1, C] (float32): per Gated DeltaNet layer, S
  and the last K-1 pre-conv rows after the committed positions; length [B] int32: positions
  0..length-1 are committed. pending: what the last verify left for `commit` (None once
  committed)."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  state: jax.Array
  conv: jax.Array
  length: jax.Array
  pending: Pending | None = None

  @property
  def capacity(self) -> int:
    return int(self.k[0].shape[2])

  @property
  def batch(self) -> int:
    return int(self.length.shape[0])


def init_cache(cfg: TargetConfig, batch: int, capacity: int, dtype: Any = "fp32") -> TargetCache:
  """An empty cache: K/V in dtype ("fp32" / "bf16"), the recurrent state float32."""
  if batch <= 0 or capacity <= 0:
    raise ValueError(f"batch and capacity must be positive, got {batch} and {capacity}")
  dt = resolve_dtype(dtype, "cache dtype")
  shape = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
  n_attn, n_gdn = len(cfg.attn_layers), len(cfg.gdn_layers)
  return TargetCache(
      k=tuple(jnp.zeros(shape, dt) for _ in range(n_attn)),
      v=tuple(jnp.zeros(shape, dt) for _ in range(n_attn)),
      state=jnp.zeros((batch, n_gdn, cfg.nv, cfg.dk, cfg.dv), jnp.float32),
      conv=jnp.zeros((batch, n_gdn, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), jnp.float32),
      length=jnp.zeros((batch,), jnp.int32))


def pending_nbytes(cfg: TargetConfig, batch: int, verify_width: int) -> int:
  """Bytes a verify of verify_width rows leaves for its commit (`Pending`), by rollback."""
  per_row = cfg.conv_dim                                    # the pre-conv rows
  if cfg.rollback == "snapshot":
    per_row += cfg.nv * cfg.dk * cfg.dv
  else:
    per_row += 2 * cfg.key_dim + cfg.value_dim + 2 * cfg.nv
  return 4 * len(cfg.gdn_layers) * batch * verify_width * per_row


def cache_nbytes(cfg: TargetConfig, batch: int, capacity: int, dtype: Any = "fp32",
                 verify_width: int = 1) -> int:
  """Device bytes of init_cache(batch, capacity, dtype) plus a verify's `Pending`."""
  item = resolve_dtype(dtype, "cache dtype").itemsize
  n_gdn = len(cfg.gdn_layers)
  kv = 2 * len(cfg.attn_layers) * batch * cfg.kv_dim * capacity * item
  state = 4 * n_gdn * batch * (cfg.nv * cfg.dk * cfg.dv
                               + (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim)
  return kv + state + 4 * batch + pending_nbytes(cfg, batch, verify_width)


def _kernel_knobs(cfg: TargetConfig) -> gdn.Knobs:
  return gdn.default_knobs(cfg.dv)


def _extend(params: TargetParams, cfg: TargetConfig, cache: TargetCache, tokens: jax.Array,
            n_valid: jax.Array | None, capture_layers, impl: str):
  """T rows at positions length.. through the cache. n_valid [B] (prefill): commit the first
  n_valid rows (rows past it leave S and the window as they were). None (verify): commit
  nothing; the returned cache holds the rows' Pending."""
  _check_impl(impl)
  tokens = jnp.asarray(tokens, jnp.int32)
  b, t = tokens.shape
  kw, slot = cfg.linear_conv_kernel_dim, cfg.slot
  start = cache.length
  positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)
  visible = jnp.arange(cache.capacity, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
  new_k, new_v = list(cache.k), list(cache.v)
  held = {"state": cache.state, "conv": cache.conv, "snaps": None, "rows": []}
  snapshot = n_valid is None and cfg.rollback == "snapshot"

  def attend_layer(l):
    def attend(q, k, v):
      i = slot[l]
      # A prefill writes only rows below n_valid (a slot with n_valid 0 stays as it was).
      new_k[i] = _write(cache.k[i], k, start, n_valid)
      new_v[i] = _write(cache.v[i], v, start, n_valid)
      return _attention(q, new_k[i], new_v[i], visible), None
    return attend

  def gdn_layer(l, lp, h):
    i = slot[l]
    window = cache.conv[:, i]
    r = _gdn_rows(cfg, lp, h, window, (b, t), impl, params.policy)
    args = (r.q, r.k, r.v)
    if n_valid is not None:   # prefill: padding rows become no-ops
      keep = (jnp.arange(t, dtype=jnp.int32)[None, :] < n_valid[:, None])[..., None]
      g, beta = jnp.where(keep, r.g, 0.0), jnp.where(keep, r.beta, 0.0)
      if impl == "pallas":
        o, held["state"] = gdn.chunked(*args, g, beta, held["state"], i,
                                       knobs=_kernel_knobs(cfg))
      else:
        o, held["state"] = gdn.chunked_reference(*args, g, beta, held["state"], i)
      full = jnp.concatenate([window, r.mixed], axis=1)
      held["conv"] = held["conv"].at[:, i].set(_window_after(full, n_valid, kw))
    else:
      snap_kw = {}
      if snapshot:
        snap_kw = ({"snaps": held["snaps"]} if held["snaps"] is not None
                   else {"snapshot_layers": len(cfg.gdn_layers)})
      if impl == "pallas":
        o = gdn.recurrent(*args, r.g, r.beta, cache.state, i, knobs=_kernel_knobs(cfg),
                          **snap_kw)
      else:
        o = gdn.recurrent_reference(*args, r.g, r.beta, cache.state, i, **snap_kw)
      if snapshot:
        o, held["snaps"] = o
      held["rows"].append(r)
    return _gdn_out(cfg, lp, o, r.z, impl, params.policy)

  h, feats = _trunk(params, cfg, tokens, positions, attend_layer, gdn_layer, capture_layers,
                    impl)
  new = cache.replace(k=tuple(new_k), v=tuple(new_v), state=held["state"], conv=held["conv"],
                      pending=None)
  if n_valid is not None:
    return new.replace(length=start + n_valid), h, feats
  rows = held["rows"]
  stack = lambda name: jnp.stack([getattr(r, name) for r in rows], axis=1) if rows else None
  if snapshot:
    pending = Pending(rows=stack("mixed"), snaps=held["snaps"], impl=impl)
  else:
    pending = Pending(rows=stack("mixed"), q=stack("q"), k=stack("k"), v=stack("v"),
                      g=stack("g"), beta=stack("beta"), impl=impl)
  return new.replace(pending=pending), h, feats


def prefill(params: TargetParams, cfg: TargetConfig, cache: TargetCache, tokens: jax.Array,
            n_valid: jax.Array, *, capture_layers=(), impl: str = "xla"):
  """Commit rows 0..n_valid-1 of tokens [B, T] (T padded to a bucket, `prefill_bucket`; pad
  with any valid id) at positions length.. -> (cache, features [B, T, F]). Padding rows
  write K/V only past the new length and leave every S and conv window as the valid rows
  left them; their features are garbage. The rule runs chunked (impl "pallas": the Pallas
  kernel; "xla": its twin). No LM head. n_valid: int32 scalar or [B]."""
  b = jnp.asarray(tokens).shape[0]
  n_valid = jnp.broadcast_to(jnp.asarray(n_valid, jnp.int32), (b,))
  cache, _, feats = _extend(params, cfg, cache, tokens, n_valid, capture_layers, impl)
  return cache, feats


def verify(params: TargetParams, cfg: TargetConfig, cache: TargetCache, tokens: jax.Array, *,
           capture_layers=(), impl: str = "xla"):
  """Run tokens [B, w] at positions length.. -> (cache, logits [B, w, V] f32, features
  [B, w, F] f32). Commits nothing: K/V sit past the length, every S and conv window is
  unchanged, and cache.pending holds what `commit` needs. The rule runs row by row (impl
  "pallas": gdn.recurrent, one read of S per call; "xla": its twin)."""
  cache, h, feats = _extend(params, cfg, cache, tokens, None, capture_layers, impl)
  b, w = jnp.asarray(tokens).shape
  return cache, _logits(params, h, (b, w), impl), feats


def commit(cfg: TargetConfig, cache: TargetCache, n_keep: jax.Array) -> TargetCache:
  """Keep the first n_keep [B] rows (0..w) of the last verify: length += n_keep, every
  layer's S and conv window as after row n_keep - 1 (unchanged for 0), pending cleared."""
  p = cache.pending
  if p is None:
    raise ValueError("commit: the cache holds no verify to commit (call verify first)")
  b = cache.batch
  n_keep = jnp.broadcast_to(jnp.asarray(n_keep, jnp.int32), (b,))
  state, conv = cache.state, cache.conv
  if cfg.gdn_layers:
    kw = cfg.linear_conv_kernel_dim
    full = jnp.concatenate([conv, p.rows], axis=2)          # [B, Lg, K-1+w, C]
    conv = jax.vmap(lambda f: _window_after(f, n_keep, kw), in_axes=1, out_axes=1)(full)
    if cfg.rollback == "snapshot":
      w = p.snaps.shape[2]
      idx = jnp.clip(n_keep - 1, 0, w - 1)
      picked = jnp.take_along_axis(p.snaps, idx[:, None, None, None, None, None], axis=2)
      state = jnp.where((n_keep > 0)[:, None, None, None, None], picked[:, :, 0], state)
    elif p.impl == "pallas":
      state = gdn.replay(p.q, p.k, p.v, p.g, p.beta, state, n_keep, knobs=_kernel_knobs(cfg))
    else:
      state = gdn.replay_reference(p.q, p.k, p.v, p.g, p.beta, state, n_keep)
  return cache.replace(state=state, conv=conv, length=cache.length + n_keep, pending=None)


def reset(cache: TargetCache, empty: jax.Array) -> TargetCache:
  """Empty the sequences where empty [B]: length 0, S and the conv window zero (as
  `init_cache` makes them). Their K/V stay, never visible (the next prefill rewrites slots
  from 0 on); the other sequences are unchanged."""
  e = jnp.asarray(empty, bool)
  zero = lambda a: jnp.where(e.reshape((-1,) + (1,) * (a.ndim - 1)), 0.0, a).astype(a.dtype)
  return cache.replace(length=jnp.where(e, 0, cache.length), state=zero(cache.state),
                       conv=zero(cache.conv))


_STATIC = ("cfg", "capture_layers", "impl")
prefill_jit = jax.jit(prefill, static_argnames=_STATIC, donate_argnames=("cache",))
verify_jit = jax.jit(verify, static_argnames=_STATIC, donate_argnames=("cache",))
forward_jit = jax.jit(forward, static_argnames=("cfg", "capture_layers", "with_logits"))


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _commit_donated(cfg: TargetConfig, cache: TargetCache, pending: Pending, n_keep):
  return commit(cfg, cache.replace(pending=pending), n_keep)


def commit_jit(cfg: TargetConfig, cache: TargetCache, n_keep: jax.Array) -> TargetCache:
  """`commit` jitted with the committed state donated (updated in place); the pending
  buffers are read, not donated (nothing the commit returns could reuse them)."""
  return _commit_donated(cfg, cache.replace(pending=None), cache.pending, n_keep)


# --- the HF checkpoint interface -------------------------------------------------------------

def _layer_names(cfg: TargetConfig, i: int) -> dict[str, tuple[int, ...]]:
  e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  p = f"{cfg.prefix}layers.{i}."
  out = {p + "input_layernorm.weight": (e,), p + "post_attention_layernorm.weight": (e,),
         p + "mlp.gate_proj.weight": (f, e), p + "mlp.up_proj.weight": (f, e),
         p + "mlp.down_proj.weight": (e, f)}
  if cfg.layer_types[i] == FULL:
    a = p + "self_attn."
    out.update({a + "q_proj.weight": (2 * cfg.q_dim, e), a + "k_proj.weight": (cfg.kv_dim, e),
                a + "v_proj.weight": (cfg.kv_dim, e), a + "o_proj.weight": (e, cfg.q_dim),
                a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)})
    return out
  g = p + "linear_attn."
  if cfg.model_type == "qwen3_next":
    out.update({g + "in_proj_qkvz.weight": (cfg.conv_dim + cfg.value_dim, e),
                g + "in_proj_ba.weight": (2 * cfg.nv, e)})
  else:
    out.update({g + "in_proj_qkv.weight": (cfg.conv_dim, e),
                g + "in_proj_z.weight": (cfg.value_dim, e),
                g + "in_proj_b.weight": (cfg.nv, e), g + "in_proj_a.weight": (cfg.nv, e)})
  out.update({g + "conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
              g + "dt_bias": (cfg.nv,), g + "A_log": (cfg.nv,), g + "norm.weight": (cfg.dv,),
              g + "out_proj.weight": (e, cfg.value_dim)})
  return out


def hf_tensor_shapes(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
  """Every tensor the model needs, by its checkpoint name, (out, in) shapes (lm_head only
  when untied)."""
  e, p = cfg.hidden_size, cfg.prefix
  shapes = {p + "embed_tokens.weight": (cfg.vocab_size, e), p + "norm.weight": (e,)}
  for i in range(cfg.num_hidden_layers):
    shapes.update(_layer_names(cfg, i))
  if not cfg.tie_word_embeddings:
    shapes["lm_head.weight"] = (cfg.vocab_size, e)
  return shapes


def hf_optional(cfg: TargetConfig) -> set[str]:
  """Stored by some checkpoints, not needed: a tied lm_head."""
  return {"lm_head.weight"} if cfg.tie_word_embeddings else set()


def hf_ignored(name: str) -> bool:
  """Stored but never read: the vision tower, the multi-token-prediction head, rotary
  buffers."""
  return (name.startswith(("model.visual.", "visual.", "mtp.", "model.mtp."))
          or name.endswith(".rotary_emb.inv_freq"))


def params_from_hf(cfg: TargetConfig, tensors: dict[str, Any], dtype: Any) -> TargetParams:
  """Checkpoint-named arrays (hf_tensor_shapes' names; host or device, any stored float
  dtype) -> TargetParams: matrices cast to dtype on the device and fused; qwen3_next's
  grouped projections reordered into the split layout; norms, conv, dt_bias, A_log float32.
  The entries are taken out of `tensors` as they are used (`base.hf_takers`)."""
  dt = resolve_dtype(dtype)
  _, vec, dev = base.hf_takers(tensors, dtype)
  mat = lambda *parts: jnp.concatenate([x.astype(dt) for x in parts]) if len(parts) > 1 \
      else parts[0].astype(dt)
  r, e = cfg.nv // cfg.nk, cfg.hidden_size
  layers = []
  for i, kind in enumerate(cfg.layer_types):
    p = f"{cfg.prefix}layers.{i}."
    common = dict(attn_norm=vec(p + "input_layernorm.weight"),
                  ffn_norm=vec(p + "post_attention_layernorm.weight"),
                  wgu=mat(dev(p + "mlp.gate_proj.weight"), dev(p + "mlp.up_proj.weight")),
                  wd=mat(dev(p + "mlp.down_proj.weight")))
    if kind == FULL:
      a = p + "self_attn."
      layers.append(AttnLayer(
          wqkv=mat(dev(a + "q_proj.weight"), dev(a + "k_proj.weight"), dev(a + "v_proj.weight")),
          q_norm=vec(a + "q_norm.weight"), k_norm=vec(a + "k_norm.weight"),
          wo=mat(dev(a + "o_proj.weight")), **common))
      continue
    g = p + "linear_attn."
    if cfg.model_type == "qwen3_next":
      # Per key head: its q, its k, then the r value heads' v, then their z (and in
      # in_proj_ba the r heads' b, then their a); value head kh * r + i reads key head kh.
      dk, vr = cfg.dk, r * cfg.dv
      grp = dev(g + "in_proj_qkvz.weight").reshape(cfg.nk, 2 * dk + 2 * vr, e)
      q, k = grp[:, :dk], grp[:, dk:2 * dk]
      v, z = grp[:, 2 * dk:2 * dk + vr], grp[:, 2 * dk + vr:]
      ba = dev(g + "in_proj_ba.weight").reshape(cfg.nk, 2 * r, e)
      parts = [x.reshape(-1, e) for x in (q, k, v, z, ba[:, :r], ba[:, r:])]
    else:
      parts = [dev(g + n + ".weight") for n in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                "in_proj_a")]
    layers.append(GDNLayer(
        w_in=mat(*parts), conv=vec(g + "conv1d.weight")[:, 0, :].T, dt_bias=vec(g + "dt_bias"),
        a_log=vec(g + "A_log"), norm=vec(g + "norm.weight"),
        w_out=mat(dev(g + "out_proj.weight")), **common))
  return TargetParams(embed=mat(dev(cfg.prefix + "embed_tokens.weight")), layers=tuple(layers),
                      final_norm=vec(cfg.prefix + "norm.weight"),
                      lm_head=None if cfg.tie_word_embeddings else mat(dev("lm_head.weight")))


def params_to_hf(cfg: TargetConfig, params: TargetParams) -> dict[str, np.ndarray]:
  """TargetParams -> checkpoint-named host arrays in the params' dtypes, in cfg's form
  (inverse of params_from_hf)."""
  _check_params(cfg, params)
  h = lambda x: np.asarray(x)
  e, f, r = cfg.hidden_size, cfg.intermediate_size, cfg.nv // cfg.nk
  out = {cfg.prefix + "embed_tokens.weight": h(params.embed),
         cfg.prefix + "norm.weight": h(params.final_norm)}
  for i, lp in enumerate(params.layers):
    p = f"{cfg.prefix}layers.{i}."
    wgu = h(lp.wgu)
    out.update({p + "input_layernorm.weight": h(lp.attn_norm),
                p + "post_attention_layernorm.weight": h(lp.ffn_norm),
                p + "mlp.gate_proj.weight": wgu[:f], p + "mlp.up_proj.weight": wgu[f:],
                p + "mlp.down_proj.weight": h(lp.wd)})
    if isinstance(lp, AttnLayer):
      a, wqkv, q2 = p + "self_attn.", h(lp.wqkv), 2 * cfg.q_dim
      out.update({a + "q_proj.weight": wqkv[:q2], a + "k_proj.weight": wqkv[q2:q2 + cfg.kv_dim],
                  a + "v_proj.weight": wqkv[q2 + cfg.kv_dim:], a + "o_proj.weight": h(lp.wo),
                  a + "q_norm.weight": h(lp.q_norm), a + "k_norm.weight": h(lp.k_norm)})
      continue
    g, w = p + "linear_attn.", h(lp.w_in)
    c, vd, nv = cfg.conv_dim, cfg.value_dim, cfg.nv
    qkv, z, b, a = w[:c], w[c:c + vd], w[c + vd:c + vd + nv], w[c + vd + nv:]
    if cfg.model_type == "qwen3_next":
      kd = cfg.key_dim
      groups = [qkv[:kd].reshape(cfg.nk, cfg.dk, e), qkv[kd:2 * kd].reshape(cfg.nk, cfg.dk, e),
                qkv[2 * kd:].reshape(cfg.nk, r * cfg.dv, e), z.reshape(cfg.nk, r * cfg.dv, e)]
      out[g + "in_proj_qkvz.weight"] = np.concatenate(groups, axis=1).reshape(-1, e)
      out[g + "in_proj_ba.weight"] = np.concatenate(
          [b.reshape(cfg.nk, r, e), a.reshape(cfg.nk, r, e)], axis=1).reshape(-1, e)
    else:
      out.update({g + "in_proj_qkv.weight": qkv, g + "in_proj_z.weight": z,
                  g + "in_proj_b.weight": b, g + "in_proj_a.weight": a})
    out.update({g + "conv1d.weight": np.ascontiguousarray(h(lp.conv).T[:, None, :]),
                g + "dt_bias": h(lp.dt_bias), g + "A_log": h(lp.a_log),
                g + "norm.weight": h(lp.norm), g + "out_proj.weight": h(lp.w_out)})
  if not cfg.tie_word_embeddings:
    out["lm_head.weight"] = h(params.lm_head)
  return out


def _check_params(cfg: TargetConfig, params: TargetParams) -> None:
  if len(params.layers) != cfg.num_hidden_layers:
    raise ValueError(f"params have {len(params.layers)} layers, the config "
                     f"{cfg.num_hidden_layers}")
  for i, (lp, kind) in enumerate(zip(params.layers, cfg.layer_types)):
    want = AttnLayer if kind == FULL else GDNLayer
    if not isinstance(lp, want):
      raise ValueError(f"params layer {i} is a {type(lp).__name__}, layer_types says {kind}")
  if (params.lm_head is None) != cfg.tie_word_embeddings:
    raise ValueError(f"params have {'no' if params.lm_head is None else 'an'} lm_head but "
                     f"tie_word_embeddings is {cfg.tie_word_embeddings}")
  if tuple(params.embed.shape) != (cfg.vocab_size, cfg.hidden_size):
    raise ValueError(f"params embed has shape {tuple(params.embed.shape)}, the config implies "
                     f"{(cfg.vocab_size, cfg.hidden_size)}")
