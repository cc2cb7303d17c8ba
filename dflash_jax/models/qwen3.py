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
  of models/base.py, which `TargetConfig` implements). The caller keeps `length + T <= capacity` (decode.py checks it on the host
  before a run starts; inside jit an out-of-range write would be clamped, not caught).

Feature capture (SPEC.md section 2): `capture_layers` are llama.cpp-convention indices, the
HF `hidden_states` index: i < n_layers is the residual stream entering layer i (0 = the
embeddings); i = n_layers is HF's last hidden state, after the final norm. A drafter's
`cfg.target_layers` is passed as is; rows are the concatenation in `capture_layers` order.

Layout: matrices stay HF's (out, in) and every product is `dflash_jax.dispatch.linear`
(y = x @ W^T; bf16 weights take bf16-rounded activations with float32 accumulation; fp32 is
full precision). q/k/v are one `[(Hq + 2 Hkv) D, E]` matrix and gate/up one `[2 F, E]`, so a
layer is four GEMMs. All other arithmetic is float32. The layers are a tuple (one pytree per
layer, never a stacked array: slicing a stacked weight inside jit makes XLA copy it).
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

from dflash_jax.config import rope_inv_freq
from dflash_jax.models import base
from dflash_jax.dispatch import KernelPolicy, einsum_f32, linear, resolve_dtype, rms_norm

MODEL_TYPES = ("qwen3", "llama")   # the HF model_type strings this family reads
_QK_NORM = {"qwen3": True, "llama": False}   # HF model_type -> per-head q/k norm
_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


@dataclasses.dataclass(frozen=True)
class TargetConfig:
  """The target's shape (HF config.json names); frozen and hashable (a static jit argument).

  `rope_scaling` is None or HF's llama3 rope scaling as sorted (key, value) pairs (the only
  scaling supported). `eos_token_ids` are the config's end-of-sequence ids (may be empty).
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
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  eos_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    problems = []
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim",
                 "max_position_embeddings"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        problems.append(f"{name} must be a positive int, got {v!r}")
    if not problems and self.num_attention_heads % self.num_key_value_heads:
      problems.append(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                      f"num_key_value_heads ({self.num_key_value_heads})")
    if not problems and self.head_dim % 2:
      problems.append(f"head_dim must be even for NEOX rope, got {self.head_dim}")
    if not (self.rms_norm_eps > 0):
      problems.append(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
    if not (self.rope_theta > 0):
      problems.append(f"rope_theta must be > 0, got {self.rope_theta!r}")
    if isinstance(self.rope_scaling, Mapping):
      object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
    if self.rope_scaling is not None:
      rs = dict(self.rope_scaling)
      kind = rs.get("rope_type", rs.get("type"))
      need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
      if kind != "llama3":
        problems.append(f"rope_scaling type {kind!r} is not supported (only 'llama3')")
      elif any(k not in rs for k in need):
        problems.append(f"llama3 rope_scaling needs {need}, got {sorted(rs)}")
    ids = self.eos_token_ids
    object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in (
        () if ids is None else (ids,) if isinstance(ids, (int, np.integer)) else ids)))
    if any(not 0 <= i < max(self.vocab_size, 1) for i in self.eos_token_ids):
      problems.append(f"eos_token_ids {self.eos_token_ids} must lie in [0, {self.vocab_size})")
    if problems:
      raise ValueError("invalid TargetConfig: " + "; ".join(problems))

  # --- the Target protocol (models/base.py) ---
  @property
  def n_layers(self) -> int:
    return self.num_hidden_layers

  def check_capture_layers(self, capture_layers) -> tuple[int, ...]:
    return base.check_capture_layers(self.num_hidden_layers, capture_layers)

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

  @property
  def q_dim(self) -> int:
    return self.num_attention_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    return self.num_key_value_heads * self.head_dim

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
        "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }


def inv_freq(cfg: TargetConfig) -> np.ndarray:
  """The NEOX inverse frequencies [head_dim / 2] (float32; llama3 scaling applied in float64)."""
  base = rope_inv_freq(cfg.head_dim, cfg.rope_theta)
  if cfg.rope_scaling is None:
    return base
  rs = dict(cfg.rope_scaling)
  f = base.astype(np.float64)
  factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
  old = float(rs["original_max_position_embeddings"])
  wavelen = 2 * math.pi / f
  smooth = (old / wavelen - lo) / (hi - lo)
  medium = (1 - smooth) * f / factor + smooth * f
  out = np.where(wavelen < old / hi, f, np.where(wavelen > old / lo, f / factor, medium))
  return out.astype(np.float32)


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

def rope(x: jax.Array, positions: jax.Array, freqs: jax.Array) -> jax.Array:
  """NEOX rope of x [B, T, H, D] at positions [B, T]: angle = float32(pos) * inv_freq."""
  angle = positions.astype(jnp.float32)[:, :, None, None] * freqs
  cos, sin = jnp.cos(angle), jnp.sin(angle)
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


def attention_block(cfg, lp, x: jax.Array, positions: jax.Array, freqs: jax.Array, attend,
                    impl: str, policy: KernelPolicy):
  """The attention half of a decoder layer on rows x [B T, E] f32 at positions [B, T]:
  x + o_proj(attention(...)). attend(q, k, v) with q [B, T, Hq, D], k/v [B, T, Hkv, D]
  returns (o [B, T, Hq D], whatever the path keeps). lp needs attn_norm, wqkv, q_norm,
  k_norm and wo (qwen3_moe's layers share it)."""
  b, t = positions.shape
  eps, d = cfg.rms_norm_eps, cfg.head_dim
  qkv = linear(rms_norm(x, lp.attn_norm, eps), lp.wqkv, policy=policy, impl=impl)
  q = qkv[:, :cfg.q_dim].reshape(b, t, cfg.num_attention_heads, d)
  k = qkv[:, cfg.q_dim:cfg.q_dim + cfg.kv_dim].reshape(b, t, cfg.num_key_value_heads, d)
  v = qkv[:, cfg.q_dim + cfg.kv_dim:].reshape(b, t, cfg.num_key_value_heads, d)
  if cfg.qk_norm:
    q, k = rms_norm(q, lp.q_norm, eps), rms_norm(k, lp.k_norm, eps)
  q, k = rope(q, positions, freqs), rope(k, positions, freqs)
  o, kept = attend(q, k, v)
  return x + linear(o.reshape(b * t, cfg.q_dim), lp.wo, policy=policy, impl=impl), kept


def dense_mlp(cfg, lp, x: jax.Array, impl: str, policy: KernelPolicy) -> jax.Array:
  """x + down(silu(gate) * up) of the post-attention-normed x (lp: ffn_norm, wgu, wd)."""
  hidden = linear(rms_norm(x, lp.ffn_norm, cfg.rms_norm_eps), lp.wgu, policy=policy, impl=impl,
                  gate_up=True)
  return x + linear(hidden, lp.wd, policy=policy, impl=impl)


def _layer(cfg: TargetConfig, l: int, lp: TargetLayer, x: jax.Array, positions: jax.Array,
           freqs: jax.Array, attend, impl: str, policy: KernelPolicy):
  """One decoder layer (layer l) on rows x [B T, E] f32 -> (x, what attend kept)."""
  x, kept = attention_block(cfg, lp, x, positions, freqs, attend, impl, policy)
  return dense_mlp(cfg, lp, x, impl, policy), kept


def _trunk(params: TargetParams, cfg: TargetConfig, tokens: jax.Array, positions: jax.Array,
           attend_layer, capture_layers, impl: str, layer=_layer):
  """Embeddings -> layers -> final norm. Returns (h [B T, E], features [B, T, F], kept per
  layer). attend_layer(l) gives layer l's attend function; layer(cfg, l, lp, x, positions,
  freqs, attend, impl) is one decoder layer (qwen3_moe passes its own)."""
  capture = cfg.check_capture_layers(capture_layers)
  b, t = tokens.shape
  freqs = jnp.asarray(inv_freq(cfg))
  x = params.embed[tokens.reshape(-1)].astype(jnp.float32)
  seen, kept = {}, []
  for l, lp in enumerate(params.layers):
    if l in capture:
      seen[l] = x
    x, k = layer(cfg, l, lp, x, positions, freqs, attend_layer(l), impl, params.policy)
    kept.append(k)
  h = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
  seen[cfg.num_hidden_layers] = h
  feats = (jnp.concatenate([seen[i] for i in capture], axis=-1) if capture
           else jnp.zeros((b * t, 0), jnp.float32))
  return h, feats.reshape(b, t, -1), kept


def _logits(params: TargetParams, h: jax.Array, shape, impl: str) -> jax.Array:
  return linear(h, params.head, policy=params.policy, impl=impl).reshape(*shape, -1)


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
    def attend(q, k, v):
      return _attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), causal), None
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


def extend(params: TargetParams, cfg: TargetConfig, cache: TargetCache, tokens: jax.Array,
           n_valid: jax.Array, capture_layers, with_logits: bool, impl: str, layer=_layer):
  """The cached pass of prefill and verify: tokens [B, T] at positions length.., their K/V
  written at those slots, length += n_valid. A prefill (with_logits False) writes only rows
  t < n_valid[b] (`_write`); a verify writes every row past the length for `commit`. layer:
  the decoder layer (see `_trunk`)."""
  tokens = jnp.asarray(tokens, jnp.int32)
  b, t = tokens.shape
  start = cache.length
  n_valid = jnp.broadcast_to(jnp.asarray(n_valid, jnp.int32), (b,))
  n_write = None if with_logits else n_valid
  positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)
  visible = jnp.arange(cache.capacity, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]

  def attend_layer(l):
    def attend(q, k, v):
      ck, cv = _write(cache.k[l], k, start, n_write), _write(cache.v[l], v, start, n_write)
      return _attention(q, ck, cv, visible), (ck, cv)
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
  keeps some of them. impl="pallas" routes the GEMMs by params.policy (dispatch.linear: bf16
  GEMMs of up to `policy.skinny_max_m` rows on the Pallas skinny GEMM); "xla" keeps XLA's
  GEMMs."""
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
  rope = c.get("rope_parameters") or {}
  theta = c.get("rope_theta", rope.get("rope_theta"))
  if theta is None:
    missing.append("rope_theta (or rope_parameters.rope_theta)")
  if missing:
    raise ValueError(f"{where}: missing config keys {missing}")
  scaling = c.get("rope_scaling")
  if scaling is None and rope.get("rope_type", "default") != "default":
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
  if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
    scaling = None
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
  dt = resolve_dtype(dtype)

  def mat(*names):
    parts = [jnp.asarray(t.pop(n)) for n in names]
    return (jnp.concatenate(parts) if len(parts) > 1 else parts[0]).astype(dt)

  def vec(name):
    return jnp.asarray(t.pop(name)).astype(jnp.float32)

  if "lm_head.weight" in hf_optional(cfg) and "lm_head.weight" in t:
    head = jnp.asarray(t.pop("lm_head.weight"))
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
