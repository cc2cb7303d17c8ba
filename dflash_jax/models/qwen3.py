"""A Qwen3 / Llama-3 family decoder in functional JAX: the target model of speculative decoding.

GQA (contiguous groups: query head h uses kv head h // (Hq / Hkv)), optional per-head q/k RMS
norm (Qwen3 yes, Llama-3 no), NEOX rope over the full head_dim, SwiGLU MLP, tied or untied LM
head. One layer function serves both paths:

- `forward(params, cfg, tokens [B, T])`: no cache, causal, positions 0..T-1 (training and
  teacher forcing; differentiable).
- `prefill` / `verify` over a `TargetCache` (donated state): per-layer K/V `[B, Hkv, S, D]`
  and a device `length [B]`; a call writes its T rows at slots `length .. length + T - 1`
  (slot = position) and attends causally over the slots up to each row's position. A
  verify commits nothing; `commit(cache, n_keep)` keeps its first rows (the Target protocol
  of models/base.py, which `TargetConfig` implements). The caller keeps
  `length + T <= capacity` (decode.py checks it on the host before a run starts; inside jit
  an out-of-range write would be clamped or dropped, not caught).

Feature capture (SPEC.md section 2): `capture_layers` are llama.cpp-convention indices, the
HF `hidden_states` index: i < n_layers is the residual stream entering layer i (0 = the
embeddings); i = n_layers is HF's last hidden state, after the final norm. A drafter's
`cfg.target_layers` is passed as is; rows are the concatenation in `capture_layers` order.

Layout: matrices stay HF's (out, in) and every product is `dflash_jax.dispatch.linear`
(y = x @ W^T; bf16 weights take bf16-rounded activations with float32 accumulation; fp32 is
full precision). q/k/v are one `[(Hq + 2 Hkv) D, E]` matrix and gate/up one `[2 F, E]`, so a
layer is four GEMMs. All other arithmetic is float32. The layers are a tuple (one pytree per
layer, never a stacked array: slicing a stacked weight inside jit makes XLA copy it).

impl="pallas" (the cached passes; `forward` is always XLA's): per layer one launch of the
pre-norm that also adds the previous sublayer's split-K partials (`dispatch.residual_norm`),
the fused q/k/v GEMM, one launch of q/k norm + rope that writes K/V into the cache in place
(`norm_rope.qk_norm_rope_cache`), the cache attention over the live slots only (partial +
combine, `cache_attention`), the o GEMM, the second pre-norm, gate+up (silu * up in its
epilogue) and down: 9 launches. Batch invariance: under the default policy every row of a
pass is bitwise independent of how many rows share the call (up to
`KernelPolicy.invariant_max_rows` rows, `target_pallas_max_width` per sequence): each GEMM
runs one M tile shape and a K split set by the weight alone, partials are added in a fixed
order, each norm row is its own program, and the attention's query tile, chunks and tiles
do not depend on the call. So a 16-row verify's logits equal sixteen 1-row decodes' bit for
bit, and greedy speculative decoding equals target-only decoding token for token, bf16
included (the prompt's prefill is the same computation in both).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dflash_jax.config import RopeScaling, checked_rope_scaling, rope_from_hf, rope_inv_freq
from dflash_jax.models import base
from dflash_jax.dispatch import (KernelPolicy, Reduced, einsum_f32, input_dtype, linear,
                                 resolve_dtype, residual_norm, rms_norm, sum_in_order,
                                 target_attention)
from pallas_kernels import cache_attention as cache_attn_k
from pallas_kernels import norm_rope as norm_rope_k
from pallas_kernels._common import next_pow2

MODEL_TYPES = ("qwen3", "llama")   # the HF model_type strings this family reads
_QK_NORM = {"qwen3": True, "llama": False}   # HF model_type -> per-head q/k norm
_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


@dataclasses.dataclass(frozen=True)
class TargetConfig(base.HFDecoderFacts):
  """The target's shape (HF config.json names); frozen and hashable (a static jit argument).

  `rope_scaling` is the rope scaling (none, linear, llama3, yarn; None is read as none).
  `eos_token_ids` are the config's end-of-sequence ids (may be empty).
  """
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1e6
  tie_word_embeddings: bool = False
  qk_norm: bool = True
  max_position_embeddings: int = 40960
  rope_scaling: RopeScaling = RopeScaling()
  eos_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    problems = self.dim_problems()
    object.__setattr__(self, "rope_scaling", checked_rope_scaling(self.rope_scaling, problems))
    ids, bad = base.eos_token_ids(self.eos_token_ids, self.vocab_size)
    object.__setattr__(self, "eos_token_ids", ids)
    problems += bad
    if problems:
      raise ValueError("invalid TargetConfig: " + "; ".join(problems))

  # --- the Target protocol (models/base.py) ---
  def init_cache(self, batch: int, capacity: int, dtype: Any = "fp32") -> "TargetCache":
    return init_cache(self, batch, capacity, dtype)

  def cache_nbytes(self, batch: int, capacity: int, dtype: Any = "fp32",
                   verify_width: int = 1) -> int:
    item = resolve_dtype(dtype, "cache dtype").itemsize
    return (2 * self.num_hidden_layers * batch * self.kv_dim * capacity * item) + 4 * batch

  def prefill(self, params, cache, tokens, n_valid, *, capture_layers=(), impl: str = "xla"):
    return prefill(params, self, cache, tokens, n_valid, capture_layers=capture_layers,
                   impl=impl)

  def verify(self, params, cache, tokens, *, capture_layers=(), impl: str = "xla"):
    return verify(params, self, cache, tokens, capture_layers=capture_layers, impl=impl)

  def commit(self, cache: "TargetCache", n_keep: jax.Array) -> "TargetCache":
    return commit(cache, n_keep)

  def reset(self, cache: "TargetCache", empty: jax.Array) -> "TargetCache":
    return reset(cache, empty)

  def forward(self, params, tokens, *, capture_layers=(), with_logits: bool = True):
    return forward(params, self, tokens, capture_layers=capture_layers,
                   with_logits=with_logits)

  @property
  def group(self) -> int:
    return self.num_attention_heads // self.num_key_value_heads

  def to_hf(self) -> dict[str, Any]:
    model_type = "qwen3" if self.qk_norm else "llama"
    eos = list(self.eos_token_ids)
    return {
        "architectures": [_ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
        "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
        "rope_scaling": self.rope_scaling.to_hf(),
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }


def inv_freq(cfg) -> np.ndarray:
  """The NEOX inverse frequencies [head_dim / 2] float32, cfg.rope_scaling applied (the host
  float64 table, `config.rope_inv_freq`)."""
  return rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


# --- parameters ------------------------------------------------------------------------------

@flax.struct.dataclass
class TargetLayer:
  attn_norm: jax.Array          # [E] f32
  wqkv: jax.Array               # [(Hq + 2 Hkv) D, E]: q, k, v projections (one GEMM)
  q_norm: jax.Array | None      # [D] f32 (None without qk_norm)
  k_norm: jax.Array | None      # [D] f32
  wo: jax.Array                 # [E, Hq D]
  ffn_norm: jax.Array           # [E] f32
  wgu: jax.Array                # [2 F, E]: gate rows then up rows (one GEMM)
  wd: jax.Array                 # [E, F]


@flax.struct.dataclass
class TargetParams:
  """Device weights: matrices in the weight dtype, (out, in); norms float32. policy: the
  kernel routing of impl="pallas" (static: part of every jit key)."""
  embed: jax.Array              # [V, E]
  layers: tuple[TargetLayer, ...]
  final_norm: jax.Array         # [E] f32
  lm_head: jax.Array | None     # [V, E]; None when tied to embed
  policy: KernelPolicy = flax.struct.field(pytree_node=False, default=KernelPolicy())

  @property
  def head(self) -> jax.Array:
    return self.embed if self.lm_head is None else self.lm_head


def normals(key: jax.Array, shapes: dict[str, tuple[int, ...]], dtype) -> dict[str, jax.Array]:
  """N(0, 1) arrays of the given shapes from ONE random draw (one threefry in the program:
  each separate draw would add its own, and their compile time dominates on CPU)."""
  sizes = [math.prod(s) for s in shapes.values()]
  flat = jax.random.normal(key, (sum(sizes),), dtype)
  offsets = np.cumsum([0] + sizes)
  return {name: flat[o:o + n].reshape(s) for (name, s), o, n in
          zip(shapes.items(), offsets, sizes)}


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_layer(cfg: TargetConfig, key: jax.Array, dtype) -> TargetLayer:
  e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  branch = 1.0 / math.sqrt(2.0 * cfg.num_hidden_layers)
  mats = normals(key, {"wqkv": (cfg.q_dim + 2 * cfg.kv_dim, e), "wo": (e, cfg.q_dim),
                        "wgu": (2 * f, e), "wd": (e, f), "norms": (2 * e + 2 * d,)}, dtype)
  scale = {"wqkv": 1.0, "wo": branch, "wgu": 1.0, "wd": branch}
  m = {k: (mats[k] * (scale[k] / math.sqrt(mats[k].shape[1]))).astype(dtype) for k in scale}
  norms = 1.0 + 0.1 * mats["norms"].astype(jnp.float32)
  return TargetLayer(
      attn_norm=norms[:e], wqkv=m["wqkv"],
      q_norm=norms[2 * e:2 * e + d] if cfg.qk_norm else None,
      k_norm=norms[2 * e + d:] if cfg.qk_norm else None,
      wo=m["wo"], ffn_norm=norms[e:2 * e], wgu=m["wgu"], wd=m["wd"])


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_outer(cfg: TargetConfig, key: jax.Array, dtype):
  v, e = cfg.vocab_size, cfg.hidden_size
  shapes = {"embed": (v, e), "norm": (e,)}
  if not cfg.tie_word_embeddings:
    shapes["head"] = (v, e)
  r = normals(key, shapes, dtype)
  head = None if cfg.tie_word_embeddings else (r["head"] * (1 / math.sqrt(e))).astype(dtype)
  return r["embed"], 1.0 + 0.1 * r["norm"].astype(jnp.float32), head


def init_params(cfg: TargetConfig, key: jax.Array, dtype: Any = jnp.float32) -> TargetParams:
  """Random weights, generated on the device (one compiled initializer per layer shape).

  Matrices are N(0, 1/fan_in) with the residual branches (o, down) further scaled by
  1/sqrt(2 n_layers); the embedding is N(0, 1) (a tied head then gives logits of scale
  sqrt(E)); an untied head is N(0, 1/E); norm weights are 1 + 0.1 N(0, 1).
  """
  dt = resolve_dtype(dtype)
  keys = jax.random.split(key, cfg.num_hidden_layers + 1)
  embed, final_norm, head = _init_outer(cfg, keys[0], dt)
  layers = tuple(_init_layer(cfg, k, dt) for k in keys[1:])
  return TargetParams(embed=embed, layers=layers, final_norm=final_norm, lm_head=head)


# --- the layer (shared by every path) --------------------------------------------------------

def rope(x: jax.Array, positions: jax.Array, freqs: jax.Array,
         attention_scaling: float = 1.0) -> jax.Array:
  """NEOX rope of x [B, T, H, D] at positions [B, T]: angle = float32(pos) * inv_freq; cos
  and sin times attention_scaling (static: YaRN's attention factor, 1 otherwise)."""
  angle = positions.astype(jnp.float32)[:, :, None, None] * freqs
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  if attention_scaling != 1.0:
    # Where HF puts it: its rotary embedding multiplies cos and sin, so q and k are each
    # scaled after the rotation (the attention logits by the factor squared).
    cos, sin = cos * attention_scaling, sin * attention_scaling
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _attention(q: jax.Array, keys: jax.Array, values: jax.Array, visible: jax.Array) -> jax.Array:
  """q [B, T, Hq, D] f32 over keys/values [B, Hkv, S, D] where visible [B, T, S] -> [B, T, Hq D].

  The dots take their operands in the K/V dtype with float32 accumulation (full precision for
  float32; `dispatch.einsum_f32`, which widens bf16 operands on CPU). Every row must see at
  least one key (each row sees its own position).
  """
  b, t, hq, d = q.shape
  hkv = keys.shape[1]
  dt = keys.dtype
  prec = lax.Precision.HIGHEST if dt == jnp.float32 else lax.Precision.DEFAULT
  qg = q.reshape(b, t, hkv, hq // hkv, d).astype(dt)
  s = einsum_f32("btkgd,bksd->bkgts", qg, keys, prec) * (1.0 / math.sqrt(d))
  s = jnp.where(visible[:, None, None], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  o = einsum_f32("bkgts,bksd->btkgd", p.astype(dt), values, prec)
  return o.reshape(b, t, hq * d)


class Residual(NamedTuple):
  """The residual stream x [M, E] float32 with a sublayer's output still in its split-K
  partials [P, M, E] float32 (P = 1 for an unsplit product): the next pre-norm adds them
  (`pre_norm`; on the Pallas path inside the norm's launch), `settle` does it alone."""
  x: jax.Array
  parts: jax.Array


def settle(x) -> jax.Array:
  """The residual stream as one array: x + parts[0] + parts[1] + ... (in `pre_norm`'s order)."""
  return x.x + sum_in_order(x.parts) if isinstance(x, Residual) else x


def pre_norm(x, w_norm: jax.Array, eps: float, w, impl: str, policy: KernelPolicy,
             out_dtype=None) -> tuple[jax.Array, jax.Array]:
  """(the residual stream as one float32 array, its RMS norm times w_norm as the input of
  linear(., w)) for x an array or a `Residual` (`dispatch.residual_norm`: one Pallas launch
  on the Pallas path, the norm in the dtype the GEMM takes or out_dtype)."""
  x, parts = (x.x, x.parts) if isinstance(x, Residual) else (x, None)
  return residual_norm(x, parts, w_norm, eps, w, policy=policy, impl=impl, out_dtype=out_dtype)


def project(x: jax.Array, w, impl: str, policy: KernelPolicy, partials: bool = False,
            **kw) -> jax.Array:
  """The target's `dispatch.linear` (batch invariant under the policy's row bound). partials:
  the split-K partials [P, M, N] (a `Reduced` weight's psummed product as P = 1)."""
  if partials and isinstance(w, Reduced):
    return linear(x, w, policy=policy, impl=impl, batch_invariant=True, **kw)[None]
  return linear(x, w, policy=policy, impl=impl, partials=partials, batch_invariant=True, **kw)


def qk_rope(cfg, lp, qkv: jax.Array, positions: jax.Array, freqs: jax.Array):
  """q [B, T, Hq, D], k and v [B, T, Hkv, D] float32 from the fused projection's partials
  qkv [P, B T, (Hq + 2 Hkv) D] (added in order): q and k normalised (qk_norm) and roped."""
  b, t = positions.shape
  d, eps = cfg.head_dim, cfg.rms_norm_eps
  y = sum_in_order(qkv)
  q = y[:, :cfg.q_dim].reshape(b, t, cfg.num_attention_heads, d)
  k = y[:, cfg.q_dim:cfg.q_dim + cfg.kv_dim].reshape(b, t, cfg.num_key_value_heads, d)
  v = y[:, cfg.q_dim + cfg.kv_dim:].reshape(b, t, cfg.num_key_value_heads, d)
  if cfg.qk_norm:
    q, k = rms_norm(q, lp.q_norm, eps), rms_norm(k, lp.k_norm, eps)
  scale = cfg.rope_scaling.attention_scaling
  return rope(q, positions, freqs, scale), rope(k, positions, freqs, scale), v


def attention_block(cfg, lp, x, positions: jax.Array, freqs: jax.Array, attend, impl: str,
                    policy: KernelPolicy):
  """The attention half of a decoder layer on rows x (the residual stream [B T, E] f32, or a
  `Residual`) at positions [B, T] -> (Residual(x, the o projection's partials), what attend
  kept). attend(lp, qkv, positions, freqs) takes the fused q/k/v projection's split-K
  partials [P, B T, (Hq + 2 Hkv) D] and returns (o [B T, Hq D], kept). lp needs attn_norm,
  wqkv, q_norm, k_norm and wo (qwen3_moe's layers share it)."""
  x, xn = pre_norm(x, lp.attn_norm, cfg.rms_norm_eps, lp.wqkv, impl, policy)
  o, kept = attend(lp, project(xn, lp.wqkv, impl, policy, partials=True), positions, freqs)
  return Residual(x, project(o, lp.wo, impl, policy, partials=True)), kept


def dense_mlp(cfg, lp, x, impl: str, policy: KernelPolicy) -> Residual:
  """x + down(silu(gate) * up) of the post-attention-normed x (lp: ffn_norm, wgu, wd), the
  down projection's partials not yet added (a `Residual`)."""
  x, xn = pre_norm(x, lp.ffn_norm, cfg.rms_norm_eps, lp.wgu, impl, policy)
  hidden = project(xn, lp.wgu, impl, policy, gate_up=True,
                   out_dtype=jnp.float32 if impl == "xla" else input_dtype(lp.wd))
  return Residual(x, project(hidden, lp.wd, impl, policy, partials=True))


def _layer(cfg: TargetConfig, l: int, lp: TargetLayer, x, positions: jax.Array,
           freqs: jax.Array, attend, impl: str, policy: KernelPolicy):
  """One decoder layer (layer l) on rows x (an array or a `Residual`) -> (x, what attend
  kept)."""
  x, kept = attention_block(cfg, lp, x, positions, freqs, attend, impl, policy)
  return dense_mlp(cfg, lp, x, impl, policy), kept


def _trunk(params: TargetParams, cfg: TargetConfig, tokens: jax.Array, positions: jax.Array,
           attend_layer, capture_layers, impl: str, layer=_layer):
  """Embeddings -> layers -> final norm. Returns (h [B T, E] in the LM head's input dtype
  (float32 when the features capture it), features [B, T, F], kept per layer).
  attend_layer(l) gives layer l's attend function; layer(cfg, l, lp, x, positions, freqs,
  attend, impl, policy) is one decoder layer (qwen3_moe passes its own)."""
  capture = cfg.check_capture_layers(capture_layers)
  b, t = tokens.shape
  freqs = jnp.asarray(inv_freq(cfg))
  x = params.embed[tokens.reshape(-1)].astype(jnp.float32)
  seen, kept = {}, []
  for l, lp in enumerate(params.layers):
    if l in capture:
      x = seen[l] = settle(x)
    x, k = layer(cfg, l, lp, x, positions, freqs, attend_layer(l), impl, params.policy)
    kept.append(k)
  n = cfg.num_hidden_layers
  _, h = pre_norm(x, params.final_norm, cfg.rms_norm_eps, params.head, impl, params.policy,
                  out_dtype=jnp.float32 if n in capture else None)
  seen[n] = h
  feats = (jnp.concatenate([seen[i] for i in capture], axis=-1) if capture
           else jnp.zeros((b * t, 0), jnp.float32))
  return h, feats.reshape(b, t, -1), kept


def _logits(params: TargetParams, h: jax.Array, shape, impl: str) -> jax.Array:
  return project(h, params.head, impl, params.policy).reshape(*shape, -1)


def forward(params: TargetParams, cfg: TargetConfig, tokens: jax.Array, *,
            capture_layers=(), with_logits: bool = True):
  """Uncached causal forward of tokens [B, T] int32 at positions 0..T-1.

  Returns (logits [B, T, V] f32, or None when with_logits=False; features [B, T,
  len(capture_layers) E] f32). Differentiable; every GEMM is XLA's.
  """
  return uncached(params, cfg, tokens, capture_layers, with_logits, _layer)


def uncached(params, cfg, tokens: jax.Array, capture_layers, with_logits: bool, layer):
  """`forward` with the decoder layer as an argument (qwen3_moe passes its own)."""
  tokens = jnp.asarray(tokens, jnp.int32)
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  causal = jnp.tril(jnp.ones((t, t), bool))[None]

  def attend_layer(_):
    def attend(lp, qkv, positions, freqs):
      q, k, v = qk_rope(cfg, lp, qkv, positions, freqs)
      o = _attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), causal)
      return o.reshape(b * t, -1), None
    return attend

  h, feats, _ = _trunk(params, cfg, tokens, positions, attend_layer, capture_layers, "xla",
                       layer)
  return (_logits(params, h, (b, t), "xla") if with_logits else None), feats


# --- the KV cache and the cached path --------------------------------------------------------

@flax.struct.dataclass
class TargetCache:
  """Per-layer K (after q/k norm and rope) and V, [B, Hkv, S, D] each; length [B] int32:
  slots 0..length-1 hold the sequence's committed positions (slot = position)."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  length: jax.Array

  @property
  def capacity(self) -> int:
    return int(self.k[0].shape[2])

  @property
  def batch(self) -> int:
    return int(self.length.shape[0])


def init_cache(cfg: TargetConfig, batch: int, capacity: int, dtype: Any = "fp32") -> TargetCache:
  if batch <= 0 or capacity <= 0:
    raise ValueError(f"batch and capacity must be positive, got {batch} and {capacity}")
  dt = resolve_dtype(dtype, "cache dtype")
  shape = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
  zeros = tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_hidden_layers))
  return TargetCache(k=zeros, v=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_hidden_layers)),
                     length=jnp.zeros((batch,), jnp.int32))


def _write(buf: jax.Array, rows: jax.Array, start: jax.Array,
           n: jax.Array | None = None) -> jax.Array:
  """buf [B, Hkv, S, D] with rows [B, T, Hkv, D] stored at slots start[b] .. start[b] + T - 1.
  With n [B], only rows t < n[b]: the others keep buf's values, so a sequence with n 0 is
  untouched even where start + T passes the capacity (the write's start is then clamped, and
  so is the read of the values it keeps)."""
  rows = rows.transpose(0, 2, 1, 3).astype(buf.dtype)
  t = rows.shape[2]
  if n is not None:
    old = jax.vmap(lambda c, s: lax.dynamic_slice(c, (0, s, 0), (c.shape[0], t, c.shape[2])))(
        buf, start)
    keep = jnp.arange(t, dtype=jnp.int32)[None, :] < n[:, None]
    rows = jnp.where(keep[:, None, :, None], rows, old)
  if buf.shape[0] == 1:   # one sequence: a plain dynamic-update-slice, in place (no scatter)
    return lax.dynamic_update_slice(buf, rows, (0, 0, start[0], 0))
  return jax.vmap(lambda c, r, s: lax.dynamic_update_slice(c, r, (0, s, 0)))(buf, rows, start)


def _cache_attend_layer(cfg, cache: TargetCache, start: jax.Array, t: int, knobs, policy):
  """attend_layer of the Pallas cached pass: layer l's q/k norm + rope with the K/V rows
  written into the cache in place (one launch), then the cache attention over the live
  slots (two launches)."""
  b = start.shape[0]
  hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

  def attend_layer(l):
    def attend(lp, qkv, positions, freqs):
      del positions   # start + row: the kernels' own
      parts = qkv.reshape(qkv.shape[0], b, t, hq + 2 * hkv, d)
      ones = jnp.ones((d,), jnp.float32)   # no q/k norm (Llama): not read
      q, ck, cv = norm_rope_k.qk_norm_rope_cache(
          parts, lp.q_norm if cfg.qk_norm else ones, lp.k_norm if cfg.qk_norm else ones,
          cache.k[l], cache.v[l], start, freqs, n_head=hq, n_head_kv=hkv,
          eps=cfg.rms_norm_eps, qk_norm=cfg.qk_norm,
          attention_scaling=cfg.rope_scaling.attention_scaling,
          block_rows=next_pow2(policy.target_pallas_max_width))
      o = cache_attn_k.cache_attention(q, ck, cv, start, t=t, out_dtype=input_dtype(lp.wo),
                                       **knobs.kwargs())
      return o.reshape(b * t, hq * d), (ck, cv)
    return attend
  return attend_layer


def extend(params: TargetParams, cfg: TargetConfig, cache: TargetCache, tokens: jax.Array,
           n_valid: jax.Array, capture_layers, with_logits: bool, impl: str, layer=_layer):
  """The cached pass of prefill and verify: tokens [B, T] at positions length.., their K/V
  written at those slots, length += n_valid. A prefill (with_logits False) writes only rows
  t < n_valid[b] (`_write`; the Pallas kernel drops rows past the capacity instead of
  clamping, and rows past n_valid land past the length, never visible); a verify writes every
  row past the length for `commit`. layer: the decoder layer (see `_trunk`).

  impl "pallas" (`dispatch.target_attention`): up to policy.target_pallas_max_width rows per
  sequence, the Pallas pieces read only the live slots (below length + T) and write the K/V
  rows in place; wider passes attend with XLA's masked attention over every slot. impl
  "xla": XLA's attention and GEMMs."""
  tokens = jnp.asarray(tokens, jnp.int32)
  b, t = tokens.shape
  start = cache.length
  n_valid = jnp.broadcast_to(jnp.asarray(n_valid, jnp.int32), (b,))
  n_write = None if with_logits else n_valid
  positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)
  knobs = target_attention(t=t, group=cfg.num_attention_heads // cfg.num_key_value_heads,
                           head_dim=cfg.head_dim, cache_dtype=cache.k[0].dtype, impl=impl,
                           policy=params.policy)
  if knobs is not None:
    attend_layer = _cache_attend_layer(cfg, cache, start, t, knobs, params.policy)
  else:
    visible = (jnp.arange(cache.capacity, dtype=jnp.int32)[None, None, :]
               <= positions[:, :, None])

    def attend_layer(l):
      def attend(lp, qkv, positions, freqs):
        q, k, v = qk_rope(cfg, lp, qkv, positions, freqs)
        ck = _write(cache.k[l], k, start, n_write)
        cv = _write(cache.v[l], v, start, n_write)
        return _attention(q, ck, cv, visible).reshape(b * t, -1), (ck, cv)
      return attend

  h, feats, kept = _trunk(params, cfg, tokens, positions, attend_layer, capture_layers, impl,
                          layer)
  new = TargetCache(k=tuple(k for k, _ in kept), v=tuple(v for _, v in kept),
                    length=start + n_valid)
  return new, (_logits(params, h, (b, t), impl) if with_logits else None), feats


def prefill(params: TargetParams, cfg: TargetConfig, cache: TargetCache, tokens: jax.Array,
            n_valid: jax.Array, *, capture_layers=(), impl: str = "xla"):
  """Append rows 0..n_valid-1 of tokens [B, T] (T padded to a bucket, `prefill_bucket`; pad
  with any valid id) at positions length.. -> (cache with length += n_valid, features
  [B, T, F]). Padding rows write no K/V (a sequence with n_valid 0 is left unchanged); their
  features are garbage. No LM head. n_valid: int32 scalar or [B]."""
  cache, _, feats = extend(params, cfg, cache, tokens, n_valid, capture_layers, False, impl)
  return cache, feats


def verify(params: TargetParams, cfg: TargetConfig, cache: TargetCache, tokens: jax.Array, *,
           capture_layers=(), impl: str = "xla"):
  """Run tokens [B, w] at positions length.. -> (cache, logits [B, w, V] f32, features
  [B, w, F] f32). Nothing is committed: the rows' K/V sit past the length until `commit`
  keeps some of them. impl="pallas" runs the target's kernels as params.policy routes them
  (`extend`; every row bitwise independent of how many rows share the call, up to
  `policy.invariant_max_rows` rows and `policy.target_pallas_max_width` rows per sequence);
  "xla" keeps XLA's GEMMs and attention."""
  return extend(params, cfg, cache, tokens, 0, capture_layers, True, impl)


def commit(cache: TargetCache, n_keep: jax.Array) -> TargetCache:
  """Keep the first n_keep [B] rows of the last verify: length += n_keep. The other rows'
  K/V stay past the length, never visible (a row at position p sees slots <= p, and the
  next call rewrites slots from the length on), so nothing is copied."""
  return cache.replace(length=cache.length + jnp.asarray(n_keep, jnp.int32))


def reset(cache: TargetCache, empty: jax.Array) -> TargetCache:
  """Empty the sequences where empty [B]: length 0. Their K/V stay, never visible (a row at
  position p sees slots <= p, and the next prefill rewrites slots from 0 on)."""
  return cache.replace(length=jnp.where(jnp.asarray(empty, bool), 0, cache.length))


_STATIC = ("cfg", "capture_layers", "impl")
prefill_jit = jax.jit(prefill, static_argnames=_STATIC, donate_argnames=("cache",))
verify_jit = jax.jit(verify, static_argnames=_STATIC, donate_argnames=("cache",))
forward_jit = jax.jit(forward, static_argnames=("cfg", "capture_layers", "with_logits"))


# --- HF checkpoints (read and written by dflash_jax.models.load_target / save_target) ----------

def config_from_hf(config: Mapping[str, Any], where: str) -> TargetConfig:
  """TargetConfig from an HF config.json dict; errors (ValueError) name `where` and the key."""
  c = dict(config)
  model_type = c.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ValueError(f"{where}: model_type {model_type!r} is not supported "
                     f"(supported: {sorted(MODEL_TYPES)})")
  for key, bad in (("attention_bias", True), ("mlp_bias", True), ("use_sliding_window", True)):
    if c.get(key) == bad:
      raise ValueError(f"{where}: {key}={bad} is not supported")
  if c.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{where}: hidden_act {c['hidden_act']!r} is not supported (only silu)")
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "rms_norm_eps")
  missing = [k for k in required if k not in c]
  theta, scaling = rope_from_hf(c, where)
  if theta is None:
    missing.append("rope_theta (or rope_parameters.rope_theta)")
  if missing:
    raise ValueError(f"{where}: missing config keys {missing}")
  heads = c["num_attention_heads"]
  try:
    return TargetConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rms_norm_eps=float(c["rms_norm_eps"]), rope_theta=float(theta),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        qk_norm=_QK_NORM[model_type],
        max_position_embeddings=c.get("max_position_embeddings", 40960),
        rope_scaling=scaling, eos_token_ids=c.get("eos_token_id"))
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


def hf_tensor_shapes(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
  """HF tensor name -> (out, in) shape for every tensor of the model (lm_head only untied)."""
  e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  shapes = {"model.embed_tokens.weight": (cfg.vocab_size, e), "model.norm.weight": (e,)}
  for i in range(cfg.num_hidden_layers):
    p = f"model.layers.{i}."
    shapes.update({
        p + "input_layernorm.weight": (e,), p + "post_attention_layernorm.weight": (e,),
        p + "self_attn.q_proj.weight": (cfg.q_dim, e), p + "self_attn.k_proj.weight": (cfg.kv_dim, e),
        p + "self_attn.v_proj.weight": (cfg.kv_dim, e), p + "self_attn.o_proj.weight": (e, cfg.q_dim),
        p + "mlp.gate_proj.weight": (f, e), p + "mlp.up_proj.weight": (f, e),
        p + "mlp.down_proj.weight": (e, f)})
    if cfg.qk_norm:
      shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
  if not cfg.tie_word_embeddings:
    shapes["lm_head.weight"] = (cfg.vocab_size, e)
  return shapes


def hf_optional(cfg: TargetConfig) -> set[str]:
  """Stored by some checkpoints, not needed: a tied model's lm_head (which must then equal the
  embedding; params_from_hf checks it)."""
  return {"lm_head.weight"} if cfg.tie_word_embeddings else set()


def hf_ignored(name: str) -> bool:
  """Buffers some older checkpoints store; derived from the config, so never read."""
  return name.endswith(".rotary_emb.inv_freq")


def params_from_hf(cfg: TargetConfig, t: dict[str, Any], dtype: Any) -> TargetParams:
  """HF-named arrays (hf_tensor_shapes' names, plus any of hf_optional's) -> TargetParams:
  matrices in dtype, norms float32; q/k/v and gate/up concatenated.

  The arrays may be device arrays in their stored dtype: the concatenation and the cast run
  on the device, so no float32 copy of a matrix is made on the host. Entries are taken out of
  `t` as they are used (a stored piece is freed once its fused form exists). A tied model's
  stored lm_head must equal the embedding (ValueError naming both).
  """
  mat, vec, take = base.hf_takers(t, dtype)
  if "lm_head.weight" in hf_optional(cfg) and "lm_head.weight" in t:
    head = take("lm_head.weight")
    embed = jnp.asarray(t["model.embed_tokens.weight"])
    if head.shape != embed.shape or not bool(jnp.array_equal(head, embed)):
      raise ValueError("tie_word_embeddings is true but lm_head.weight differs from "
                       "model.embed_tokens.weight")
  layers = []
  for i in range(cfg.num_hidden_layers):
    p = f"model.layers.{i}."
    a = p + "self_attn."
    layers.append(TargetLayer(
        attn_norm=vec(p + "input_layernorm.weight"),
        wqkv=mat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
        q_norm=vec(a + "q_norm.weight") if cfg.qk_norm else None,
        k_norm=vec(a + "k_norm.weight") if cfg.qk_norm else None,
        wo=mat(a + "o_proj.weight"), ffn_norm=vec(p + "post_attention_layernorm.weight"),
        wgu=mat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
        wd=mat(p + "mlp.down_proj.weight")))
  return TargetParams(embed=mat("model.embed_tokens.weight"), layers=tuple(layers),
                      final_norm=vec("model.norm.weight"),
                      lm_head=None if cfg.tie_word_embeddings else mat("lm_head.weight"))


def params_to_hf(cfg: TargetConfig, params: TargetParams) -> dict[str, np.ndarray]:
  """TargetParams -> HF-named host arrays in the params' dtypes (inverse of params_from_hf)."""
  _check_params(cfg, params)
  q, kv, f = cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
  out = {"model.embed_tokens.weight": np.asarray(params.embed),
         "model.norm.weight": np.asarray(params.final_norm)}
  for i, lp in enumerate(params.layers):
    p = f"model.layers.{i}."
    wqkv, wgu = np.asarray(lp.wqkv), np.asarray(lp.wgu)
    out.update({
        p + "input_layernorm.weight": np.asarray(lp.attn_norm),
        p + "post_attention_layernorm.weight": np.asarray(lp.ffn_norm),
        p + "self_attn.q_proj.weight": wqkv[:q], p + "self_attn.k_proj.weight": wqkv[q:q + kv],
        p + "self_attn.v_proj.weight": wqkv[q + kv:], p + "self_attn.o_proj.weight": np.asarray(lp.wo),
        p + "mlp.gate_proj.weight": wgu[:f], p + "mlp.up_proj.weight": wgu[f:],
        p + "mlp.down_proj.weight": np.asarray(lp.wd)})
    if cfg.qk_norm:
      out[p + "self_attn.q_norm.weight"] = np.asarray(lp.q_norm)
      out[p + "self_attn.k_norm.weight"] = np.asarray(lp.k_norm)
  if not cfg.tie_word_embeddings:
    out["lm_head.weight"] = np.asarray(params.lm_head)
  return out


def _check_params(cfg: TargetConfig, params: TargetParams) -> None:
  if len(params.layers) != cfg.num_hidden_layers:
    raise ValueError(f"params have {len(params.layers)} layers, the config "
                     f"{cfg.num_hidden_layers}")
  if (params.lm_head is None) != cfg.tie_word_embeddings:
    raise ValueError(f"params have {'no' if params.lm_head is None else 'an'} lm_head but "
                     f"tie_word_embeddings is {cfg.tie_word_embeddings}")
  if (params.layers[0].q_norm is None) == cfg.qk_norm:
    raise ValueError(f"params {'lack' if cfg.qk_norm else 'have'} q/k norms but qk_norm is "
                     f"{cfg.qk_norm}")
  lp, e = params.layers[0], cfg.hidden_size
  for what, got, want in (("embed", params.embed.shape, (cfg.vocab_size, e)),
                          ("wqkv", lp.wqkv.shape, (cfg.q_dim + 2 * cfg.kv_dim, e)),
                          ("wgu", lp.wgu.shape, (2 * cfg.intermediate_size, e))):
    if tuple(got) != want:
      raise ValueError(f"params {what} has shape {tuple(got)}, the config implies {want}")
