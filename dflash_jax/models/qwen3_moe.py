"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B) as a DFlash target.

Qwen3's attention (qwen3.attention_block: plain-weight q/k norms, NEOX rope on every layer)
and its K/V cache and commit (`qwen3.TargetCache`: no recurrent state, a commit only moves the
length). The MLP of a sparse layer (shared/research/target_families.md section 3): router
logits h Wr^T, softmax over all experts in float32, the top k by probability (ties to the
lower id), their probabilities renormalised to sum 1 iff `norm_topk_prob`, output
sum_k p_k down_k(silu(gate_k h) * up_k h); no shared expert. A layer is sparse iff it is not
in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0; the others have Qwen3's dense
MLP of `intermediate_size`.

Experts are stored one by one in the checkpoint; on the device each sparse layer holds them
as two stacked arrays, w_gu [E, 2 Im, H] (each expert's gate rows then up rows) and w_d
[E, H, Im]. How a call reads them depends on its row count:
- up to `SLOT_MAX_ROWS` rows (decode, verify): the experts its rows route to are listed once
  each (`expert_slots`; a one-row decode's own k experts are its list) and a grouped skinny
  GEMM reads only those (pallas_kernels.moe_gemm; its jnp twin, which gathers them, for
  impl="xla" or float32 weights);
- more rows (prefill, training): the (row, expert) pairs sorted by expert and two grouped
  GEMMs over the runs (`lax.ragged_dot_general`).
Every other GEMM goes through `qwen3.project` (the router included); on the Pallas path the
router's softmax top-k is one launch (`pallas_kernels.moe_route`), reading the router GEMM's
split-K partials.

Batch invariance, as qwen3's: on the Pallas path with bf16 experts a decode or verify row is
bitwise the same whatever rows share the call, up to `SLOT_MAX_ROWS` rows (float32 experts
run the jnp twin, whose contraction order XLA picks by shape): the router GEMM is invariant,
the routing's sums run in a fixed order, the grouped GEMM multiplies 16 rows per dot, and a
row's k expert outputs are added in its routing order (the down GEMM stores each row's
weighted outputs at its choices; the next pre-norm adds them, in its launch). So greedy
speculative decoding equals target-only decoding token for token in bf16 (a random router
sits on near ties often: any row-count dependence flips an expert within a few tokens).
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

from dflash_jax.config import RopeScaling, checked_rope_scaling, rope_from_hf
from dflash_jax.models import base, qwen3
from dflash_jax.models.qwen3 import TargetCache, TargetLayer, TargetParams
from dflash_jax.dispatch import KernelPolicy, resolve_dtype, sum_in_order
from pallas_kernels import moe_gemm, moe_route

MODEL_TYPES = ("qwen3_moe",)
_ARCHITECTURE = "Qwen3MoeForCausalLM"
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# Row counts up to which the experts run as a grouped GEMM over the touched experts (the
# kernel's one M tile); more rows go through the sort-by-expert grouped GEMM.
SLOT_MAX_ROWS = moe_gemm.MAX_ROWS


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(base.HFDecoderFacts):
  """The model's shape (HF config.json names); frozen and hashable. `mlp_only_layers` is a
  sorted tuple; `rope_scaling` as in qwen3.TargetConfig."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  num_experts: int
  num_experts_per_tok: int
  moe_intermediate_size: int
  norm_topk_prob: bool = False
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1e6
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 40960
  eos_token_ids: tuple[int, ...] = ()
  rope_scaling: RopeScaling = RopeScaling()

  def __post_init__(self):
    problems = []
    object.__setattr__(self, "rope_scaling", checked_rope_scaling(self.rope_scaling, problems))
    problems += self.dim_problems(("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                   "decoder_sparse_step"))
    if problems:
      raise ValueError("invalid Qwen3MoeConfig: " + "; ".join(problems))
    if self.num_experts_per_tok > self.num_experts:
      problems.append(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                      f"({self.num_experts})")
    only = tuple(sorted(int(i) for i in self.mlp_only_layers))
    if any(not 0 <= i < self.num_hidden_layers for i in only):
      problems.append(f"mlp_only_layers {list(only)} must lie in [0, {self.num_hidden_layers})")
    object.__setattr__(self, "mlp_only_layers", only)
    ids, bad = base.eos_token_ids(self.eos_token_ids, self.vocab_size)
    object.__setattr__(self, "eos_token_ids", ids)
    problems += bad
    if problems:
      raise ValueError("invalid Qwen3MoeConfig: " + "; ".join(problems))

  # --- the Target protocol (models/base.py) ---
  def init_cache(self, batch: int, capacity: int, dtype: Any = "fp32") -> TargetCache:
    return qwen3.init_cache(self, batch, capacity, dtype)

  def cache_nbytes(self, batch: int, capacity: int, dtype: Any = "fp32",
                   verify_width: int = 1) -> int:
    item = resolve_dtype(dtype, "cache dtype").itemsize
    return 2 * self.num_hidden_layers * batch * self.kv_dim * capacity * item + 4 * batch

  def prefill(self, params, cache, tokens, n_valid, *, capture_layers=(), impl: str = "xla"):
    return prefill(params, self, cache, tokens, n_valid, capture_layers=capture_layers,
                   impl=impl)

  def verify(self, params, cache, tokens, *, capture_layers=(), impl: str = "xla"):
    return verify(params, self, cache, tokens, capture_layers=capture_layers, impl=impl)

  def commit(self, cache: TargetCache, n_keep: jax.Array) -> TargetCache:
    return qwen3.commit(cache, n_keep)

  def reset(self, cache: TargetCache, empty: jax.Array) -> TargetCache:
    return qwen3.reset(cache, empty)

  def forward(self, params, tokens, *, capture_layers=(), with_logits: bool = True):
    return forward(params, self, tokens, capture_layers=capture_layers,
                   with_logits=with_logits)

  # --- what qwen3's attention and cache read ---
  qk_norm = True

  def is_sparse(self, layer: int) -> bool:
    """Whether layer's MLP is the expert mixture (HF's rule)."""
    return (layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0)

  @property
  def sparse_layers(self) -> tuple[int, ...]:
    return tuple(l for l in range(self.num_hidden_layers) if self.is_sparse(l))

  def to_hf(self) -> dict[str, Any]:
    eos = list(self.eos_token_ids)
    return {
        "architectures": [_ARCHITECTURE], "model_type": "qwen3_moe",
        "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
        "num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
        "moe_intermediate_size": self.moe_intermediate_size,
        "norm_topk_prob": self.norm_topk_prob, "decoder_sparse_step": self.decoder_sparse_step,
        "mlp_only_layers": list(self.mlp_only_layers), "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling.to_hf(),
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
        "attention_bias": False, "use_sliding_window": False,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}


def config_from_hf(config: Mapping[str, Any], where: str = "config") -> Qwen3MoeConfig:
  """From an HF config dict; absent keys take HF's defaults except the shape (vocab, hidden,
  layers, heads, the experts' count, top-k and size) and the rope theta. A ValueError names
  `where` and the key."""
  c = config
  if c.get("model_type") not in MODEL_TYPES:
    raise ValueError(f"{where}: model_type {c.get('model_type')!r} is not a Qwen3-MoE config "
                     f"({list(MODEL_TYPES)})")
  for key, bad in (("attention_bias", True), ("use_sliding_window", True)):
    if c.get(key) == bad:
      raise ValueError(f"{where}: {key}={bad} is not supported")
  if c.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{where}: hidden_act {c['hidden_act']!r} is not supported (only silu)")
  required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_experts", "num_experts_per_tok", "moe_intermediate_size")
  missing = [k for k in required if k not in c]
  theta, scaling = rope_from_hf(c, where)
  if theta is None:
    missing.append("rope_theta (or rope_parameters.rope_theta)")
  if missing:
    raise ValueError(f"{where}: missing config keys {missing}")
  heads = c["num_attention_heads"]
  try:
    return Qwen3MoeConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c.get("intermediate_size", 6144),
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        num_experts=c["num_experts"], num_experts_per_tok=c["num_experts_per_tok"],
        moe_intermediate_size=c["moe_intermediate_size"],
        norm_topk_prob=bool(c.get("norm_topk_prob", False)),
        decoder_sparse_step=c.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(c.get("mlp_only_layers") or ()),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_position_embeddings=c.get("max_position_embeddings", 40960),
        eos_token_ids=c.get("eos_token_id"), rope_scaling=scaling)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


# --- parameters ------------------------------------------------------------------------------

@flax.struct.dataclass
class MoeLayer:
  """A sparse layer: Qwen3's attention weights (the names `qwen3.attention_block` reads), the
  router and the stacked experts."""
  attn_norm: jax.Array        # [E] f32
  wqkv: jax.Array             # [(Hq + 2 Hkv) D, H]
  q_norm: jax.Array           # [D] f32
  k_norm: jax.Array           # [D] f32
  wo: jax.Array               # [H, Hq D]
  ffn_norm: jax.Array         # [H] f32 (post_attention_layernorm)
  router: jax.Array           # [n_experts, H]
  w_gu: jax.Array             # [n_experts, 2 Im, H]: each expert's gate rows then up rows
  w_d: jax.Array              # [n_experts, H, Im]


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _init_layer(cfg: Qwen3MoeConfig, key: jax.Array, dtype, sparse: bool):
  h, d, n = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
  branch = 1.0 / math.sqrt(2.0 * n)
  shapes = {"wqkv": (cfg.q_dim + 2 * cfg.kv_dim, h), "wo": (h, cfg.q_dim),
            "norms": (2 * h + 2 * d,)}
  if sparse:
    e, im = cfg.num_experts, cfg.moe_intermediate_size
    shapes.update(router=(e, h), w_gu=(e, 2 * im, h), w_d=(e, h, im))
  else:
    shapes.update(wgu=(2 * cfg.intermediate_size, h), wd=(h, cfg.intermediate_size))
  r = qwen3.normals(key, shapes, dtype)
  scale = {"wqkv": 1.0, "wo": branch, "router": 1.0, "w_gu": 1.0, "w_d": branch, "wgu": 1.0,
           "wd": branch}
  m = {k: (a * (scale[k] / math.sqrt(a.shape[-1]))).astype(dtype)
       for k, a in r.items() if k != "norms"}
  norms = 1.0 + 0.1 * r["norms"].astype(jnp.float32)
  common = dict(attn_norm=norms[:h], wqkv=m["wqkv"], q_norm=norms[2 * h:2 * h + d],
                k_norm=norms[2 * h + d:], wo=m["wo"], ffn_norm=norms[h:2 * h])
  if sparse:
    return MoeLayer(**common, router=m["router"], w_gu=m["w_gu"], w_d=m["w_d"])
  return TargetLayer(**common, wgu=m["wgu"], wd=m["wd"])


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_outer(cfg: Qwen3MoeConfig, key: jax.Array, dtype):
  v, h = cfg.vocab_size, cfg.hidden_size
  shapes = {"embed": (v, h), "norm": (h,)}
  if not cfg.tie_word_embeddings:
    shapes["head"] = (v, h)
  r = qwen3.normals(key, shapes, dtype)
  head = None if cfg.tie_word_embeddings else (r["head"] * (1 / math.sqrt(h))).astype(dtype)
  return r["embed"], 1.0 + 0.1 * r["norm"].astype(jnp.float32), head


def init_params(cfg: Qwen3MoeConfig, key: jax.Array, dtype: Any = jnp.float32) -> TargetParams:
  """Random weights generated on the device, one compiled initializer per layer kind (qwen3's
  scales: matrices N(0, 1/fan_in), o and down projections also 1/sqrt(2 n_layers), the
  embedding N(0, 1), an untied head N(0, 1/H), norms 1 + 0.1 N(0, 1))."""
  dt = resolve_dtype(dtype)
  keys = jax.random.split(key, cfg.num_hidden_layers + 1)
  embed, final_norm, head = _init_outer(cfg, keys[0], dt)
  layers = tuple(_init_layer(cfg, k, dt, cfg.is_sparse(l)) for l, k in enumerate(keys[1:]))
  return TargetParams(embed=embed, layers=layers, final_norm=final_norm, lm_head=head)


# --- the expert mixture ----------------------------------------------------------------------

def _row_sum(x: jax.Array) -> jax.Array:
  """Sum over the last axis in one fixed pairwise order (halves added elementwise, zero padded
  to a power of two): the same bits for a row whatever else shares the array, where a
  reduction's order is XLA's choice by shape."""
  n = x.shape[-1]
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (1 << max(0, (n - 1).bit_length())) - n)])
  while x.shape[-1] > 1:
    h = x.shape[-1] // 2
    x = x[..., :h] + x[..., h:]
  return x


def route(cfg: Qwen3MoeConfig, logits: jax.Array, impl: str = "xla"
          ) -> tuple[jax.Array, jax.Array]:
  """Router logits [M, E], or the router GEMM's split-K partials [P, M, E] (added in order)
  -> (expert ids [M, k] int32, weights [M, k] f32): softmax in float32 over all experts, the
  k most probable (ties to the lower id), renormalised iff norm_topk_prob. impl "pallas":
  one launch (`pallas_kernels.moe_route`); "xla": XLA's composition with each row's sums in
  a fixed order (`_row_sum`, `sum_in_order`). Either way the routing of a row is bitwise the
  same whatever rows share the call (batch invariance)."""
  parts = logits.astype(jnp.float32)
  if parts.ndim == 2:
    parts = parts[None]
  if impl != "xla":
    return moe_route.moe_route(parts, k=cfg.num_experts_per_tok, norm_topk=cfg.norm_topk_prob)
  lf = sum_in_order(parts)
  e = jnp.exp(lf - jnp.max(lf, axis=-1, keepdims=True))
  p = e / _row_sum(e)
  w, ids = lax.top_k(p, cfg.num_experts_per_tok)
  if cfg.norm_topk_prob:
    w = w / sum_in_order(jnp.moveaxis(w, -1, 0))[..., None]
  return ids.astype(jnp.int32), w


def expert_slots(ids: jax.Array, n_experts: int) -> jax.Array:
  """The experts rows route to, each listed once: ids [M, k] -> slots [S] int32, the touched
  experts in increasing order, then -1 (S = min(E, M k))."""
  m, k = ids.shape
  s = min(n_experts, m * k)
  e = jnp.arange(n_experts, dtype=jnp.int32)
  # Comparisons and reductions only (E x E and S x E elements: a few thousand): no scatter and
  # no scan, each of which would be a launch of its own in every sparse layer of a decode.
  touched = jnp.any(ids.reshape(-1, 1) == e[None, :], axis=0)                     # [E]
  rank = jnp.sum((e[None, :] < e[:, None]) & touched[None, :], axis=1, dtype=jnp.int32)
  hit = touched[None, :] & (rank[None, :] == jnp.arange(s, dtype=jnp.int32)[:, None])  # [S, E]
  slots = jnp.where(jnp.any(hit, axis=1), jnp.sum(jnp.where(hit, e[None, :], 0), axis=1), -1)
  return slots.astype(jnp.int32)


def _experts_by_slot(lp: MoeLayer, h: jax.Array, ids: jax.Array, w: jax.Array, impl: str):
  """Each row's k weighted expert outputs [k, M, H] (routing order) for a few rows: a grouped
  GEMM over the touched experts only (every row through every touched expert), whose down
  projection stores each row's own k outputs, weighted, at its choices (the routed epilogue:
  a row's outputs do not depend on the other rows' experts). The caller's next pre-norm adds
  them in routing order, as it adds a dense layer's split-K partials."""
  # A slot's product does not depend on where the slot sits in the list, and the routed
  # epilogue finds each choice's slot by its expert: any list of the touched experts gives a
  # row the same bits. One row's k distinct experts are such a list already (a decode skips
  # the listing's launches).
  slots = ids[0] if h.shape[0] == 1 else expert_slots(ids, lp.router.shape[0])
  im = lp.w_d.shape[-1]
  if impl != "xla" and lp.w_gu.dtype == jnp.bfloat16:
    hidden = moe_gemm.moe_matmul(h, lp.w_gu, slots, gate_up=True, out_dtype=jnp.bfloat16,
                                 **moe_gemm.default_knobs(im, h.shape[1], True))
    return moe_gemm.moe_matmul(hidden, lp.w_d, slots, routes=(ids, w),
                               **moe_gemm.default_knobs(lp.w_d.shape[1], im))
  hidden = moe_gemm.moe_matmul_reference(h, lp.w_gu, slots, gate_up=True)
  return moe_gemm.moe_matmul_reference(hidden, lp.w_d, slots, routes=(ids, w))


def _ragged(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
  """Rows x [R, K] in runs of sizes[e] rows per expert e, times w[e]^T ([E, N, K])."""
  dn = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                     lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))
  if w.dtype == jnp.bfloat16:
    return lax.ragged_dot_general(x.astype(jnp.bfloat16), w, sizes, dn,
                                  preferred_element_type=jnp.float32)
  return lax.ragged_dot_general(x.astype(jnp.float32), w, sizes, dn,
                                precision=lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32)


def _experts_sorted(lp: MoeLayer, h: jax.Array, ids: jax.Array, w: jax.Array):
  """The same parts [k, M, H] for many rows: (row, choice) pairs sorted by expert, two grouped
  GEMMs over the runs, each row's k weighted outputs gathered back into routing order. (A
  scatter-add of the sorted outputs into their rows would add a row's k terms in whatever
  order the GPU's atomics land, so two runs of one prefill could differ in the last bit.)"""
  m, k = ids.shape
  flat = ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  rows = order // k
  sizes = jnp.zeros((lp.router.shape[0],), jnp.int32).at[flat].add(1)
  gu = _ragged(h[rows], lp.w_gu, sizes)
  im = gu.shape[-1] // 2
  out = _ragged(jax.nn.silu(gu[:, :im]) * gu[:, im:], lp.w_d, sizes)
  where = jnp.zeros_like(order).at[order].set(jnp.arange(m * k, dtype=order.dtype))
  own = out[where].reshape(m, k, -1) * w[..., None]     # [M, k, H]: pair (m, j)'s output
  return jnp.moveaxis(own, 1, 0)


def moe_mlp(cfg: Qwen3MoeConfig, lp: MoeLayer, x, impl: str,
            policy: KernelPolicy) -> qwen3.Residual:
  """x + the expert mixture of the post-attention-normed x [M, H] (x an array or qwen3's
  `Residual`: the attention's output partials are added by the norm), each row's k weighted
  expert outputs not yet added (a `Residual` whose parts are the k choices, routing order)."""
  x, h = qwen3.pre_norm(x, lp.ffn_norm, cfg.rms_norm_eps, lp.router, impl, policy)
  ids, w = route(cfg, qwen3.project(h, lp.router, impl, policy, partials=True), impl)
  if h.shape[0] <= SLOT_MAX_ROWS:
    return qwen3.Residual(x, _experts_by_slot(lp, h, ids, w, impl))
  return qwen3.Residual(x, _experts_sorted(lp, h, ids, w))


def _layer(cfg: Qwen3MoeConfig, l: int, lp, x: jax.Array, positions: jax.Array,
           freqs: jax.Array, attend, impl: str, policy: KernelPolicy):
  x, kept = qwen3.attention_block(cfg, lp, x, positions, freqs, attend, impl, policy)
  if cfg.is_sparse(l):
    return moe_mlp(cfg, lp, x, impl, policy), kept
  return qwen3.dense_mlp(cfg, lp, x, impl, policy), kept


# --- the passes (qwen3's, with this layer) ---------------------------------------------------

def forward(params: TargetParams, cfg: Qwen3MoeConfig, tokens: jax.Array, *,
            capture_layers=(), with_logits: bool = True):
  """Uncached causal forward of tokens [B, T] -> (logits [B, T, V] f32 or None, features
  [B, T, F] f32). Differentiable; every GEMM is XLA's."""
  return qwen3.uncached(params, cfg, tokens, capture_layers, with_logits, _layer)


def prefill(params: TargetParams, cfg: Qwen3MoeConfig, cache: TargetCache, tokens: jax.Array,
            n_valid: jax.Array, *, capture_layers=(), impl: str = "xla"):
  """As qwen3.prefill: commit rows 0..n_valid-1 of tokens [B, T] -> (cache, features)."""
  cache, _, feats = qwen3.extend(params, cfg, cache, tokens, n_valid, capture_layers, False,
                                 impl, _layer)
  return cache, feats


def verify(params: TargetParams, cfg: Qwen3MoeConfig, cache: TargetCache, tokens: jax.Array, *,
           capture_layers=(), impl: str = "xla"):
  """As qwen3.verify: tokens [B, w] -> (cache, logits, features), nothing committed.
  impl="pallas" runs bf16 experts on the grouped Pallas GEMM (and the other bf16 GEMMs as
  `linear` routes them)."""
  return qwen3.extend(params, cfg, cache, tokens, 0, capture_layers, True, impl, _layer)


_STATIC = ("cfg", "capture_layers", "impl")
prefill_jit = jax.jit(prefill, static_argnames=_STATIC, donate_argnames=("cache",))
verify_jit = jax.jit(verify, static_argnames=_STATIC, donate_argnames=("cache",))
forward_jit = jax.jit(forward, static_argnames=("cfg", "capture_layers", "with_logits"))


# --- HF checkpoints ----------------------------------------------------------------------------

def hf_tensor_shapes(cfg: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
  """Checkpoint name -> (out, in) shape of every tensor (experts one by one; lm_head only
  untied)."""
  h, d, im, f = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size, cfg.intermediate_size
  shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
  for i in range(cfg.num_hidden_layers):
    p = f"model.layers.{i}."
    shapes.update({
        p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (cfg.q_dim, h),
        p + "self_attn.k_proj.weight": (cfg.kv_dim, h),
        p + "self_attn.v_proj.weight": (cfg.kv_dim, h),
        p + "self_attn.o_proj.weight": (h, cfg.q_dim),
        p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    if cfg.is_sparse(i):
      shapes[p + "mlp.gate.weight"] = (cfg.num_experts, h)
      for e in range(cfg.num_experts):
        q = f"{p}mlp.experts.{e}."
        shapes.update({q + "gate_proj.weight": (im, h), q + "up_proj.weight": (im, h),
                       q + "down_proj.weight": (h, im)})
    else:
      shapes.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                     p + "mlp.down_proj.weight": (h, f)})
  if not cfg.tie_word_embeddings:
    shapes["lm_head.weight"] = (cfg.vocab_size, h)
  return shapes


def hf_optional(cfg: Qwen3MoeConfig) -> set[str]:
  """Stored by some checkpoints, not needed: a tied model's lm_head."""
  return {"lm_head.weight"} if cfg.tie_word_embeddings else set()


def hf_ignored(name: str) -> bool:
  """Stored, never read: rotary buffers."""
  return name.endswith(_IGNORED_SUFFIXES)


def params_from_hf(cfg: Qwen3MoeConfig, tensors: dict[str, Any], dtype: Any) -> TargetParams:
  """Checkpoint-named arrays (host numpy or device jax.Array, in their stored dtype) ->
  device params: q/k/v and gate/up fused, each sparse layer's experts stacked, matrices cast
  to dtype on the device, norms float32. The entries are taken out of `tensors` as they are
  used (`base.hf_takers`)."""
  base.check_hf_tensors(hf_tensor_shapes(cfg), tensors)
  dt = resolve_dtype(dtype)
  mat, vec, take = base.hf_takers(tensors, dtype)

  layers = []
  for i in range(cfg.num_hidden_layers):
    p = f"model.layers.{i}."
    a = p + "self_attn."
    common = dict(attn_norm=vec(p + "input_layernorm.weight"),
                  wqkv=mat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                  q_norm=vec(a + "q_norm.weight"), k_norm=vec(a + "k_norm.weight"),
                  wo=mat(a + "o_proj.weight"), ffn_norm=vec(p + "post_attention_layernorm.weight"))
    if cfg.is_sparse(i):
      ex = [f"{p}mlp.experts.{e}." for e in range(cfg.num_experts)]
      layers.append(MoeLayer(
          **common, router=mat(p + "mlp.gate.weight"),
          w_gu=jnp.stack([jnp.concatenate([take(q + "gate_proj.weight"),
                                           take(q + "up_proj.weight")]) for q in ex]).astype(dt),
          w_d=jnp.stack([take(q + "down_proj.weight") for q in ex]).astype(dt)))
    else:
      layers.append(TargetLayer(
          **common, wgu=mat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
          wd=mat(p + "mlp.down_proj.weight")))
  return TargetParams(embed=mat("model.embed_tokens.weight"), layers=tuple(layers),
                      final_norm=vec("model.norm.weight"),
                      lm_head=None if cfg.tie_word_embeddings else mat("lm_head.weight"))


def params_to_hf(cfg: Qwen3MoeConfig, params: TargetParams) -> dict[str, np.ndarray]:
  """Device params -> checkpoint-named host arrays in the params' dtypes (params_from_hf's
  inverse: experts one by one again)."""
  if len(params.layers) != cfg.num_hidden_layers:
    raise ValueError(f"params have {len(params.layers)} layers, the config "
                     f"{cfg.num_hidden_layers}")
  if (params.lm_head is None) != cfg.tie_word_embeddings:
    raise ValueError(f"params have {'no' if params.lm_head is None else 'an'} lm_head but "
                     f"tie_word_embeddings is {cfg.tie_word_embeddings}")
  qd, kvd = cfg.q_dim, cfg.kv_dim
  out = {"model.embed_tokens.weight": np.asarray(params.embed),
         "model.norm.weight": np.asarray(params.final_norm)}
  for i, lp in enumerate(params.layers):
    if isinstance(lp, MoeLayer) != cfg.is_sparse(i):
      raise ValueError(f"params layer {i} is {'sparse' if isinstance(lp, MoeLayer) else 'dense'}"
                       f" but the config makes it {'sparse' if cfg.is_sparse(i) else 'dense'}")
    p = f"model.layers.{i}."
    a = p + "self_attn."
    wqkv = np.asarray(lp.wqkv)
    out.update({
        p + "input_layernorm.weight": np.asarray(lp.attn_norm),
        p + "post_attention_layernorm.weight": np.asarray(lp.ffn_norm),
        a + "q_proj.weight": wqkv[:qd], a + "k_proj.weight": wqkv[qd:qd + kvd],
        a + "v_proj.weight": wqkv[qd + kvd:], a + "o_proj.weight": np.asarray(lp.wo),
        a + "q_norm.weight": np.asarray(lp.q_norm), a + "k_norm.weight": np.asarray(lp.k_norm)})
    if cfg.is_sparse(i):
      out[p + "mlp.gate.weight"] = np.asarray(lp.router)
      w_gu, w_d = np.asarray(lp.w_gu), np.asarray(lp.w_d)
      im = cfg.moe_intermediate_size
      for e in range(cfg.num_experts):
        q = f"{p}mlp.experts.{e}."
        out.update({q + "gate_proj.weight": w_gu[e, :im], q + "up_proj.weight": w_gu[e, im:],
                    q + "down_proj.weight": w_d[e]})
    else:
      wgu, f = np.asarray(lp.wgu), cfg.intermediate_size
      out.update({p + "mlp.gate_proj.weight": wgu[:f], p + "mlp.up_proj.weight": wgu[f:],
                  p + "mlp.down_proj.weight": np.asarray(lp.wd)})
  if not cfg.tie_word_embeddings:
    out["lm_head.weight"] = np.asarray(params.lm_head)
  return out
