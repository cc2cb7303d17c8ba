"""The training forward of a DFlash drafter (SPEC.md section 10), batched over anchors.

For a sequence with A anchors a_j, block j is `[x_{a_j}, mask x (B-1)]` at positions
`a_j .. a_j+B-1`. Its rows attend to the context K/V of positions `p < a_j` (the features the
inference step would have injected before drafting at `n_past = a_j`), under each layer's
window rule (sliding: `(a_j + i) - p < W`; full: every `p < a_j`), plus all B keys of their own
block (bidirectional). All anchors of all sequences run in one jnp forward with an explicit
mask; nothing loops over anchors.

The layer math is the inference step's: `dispatch.rms_norm`, `dispatch.linear` (its XLA path:
fp32 HIGHEST, or bf16 operands with float32 accumulation), the per-head RMS norm + NEOX rope of
`pallas_kernels.norm_rope.rms_rope_halves` (what the step's qk_norm_rope and inject kernels
use), the silu-gated FFN of `linear(..., gate_up=True)`, and context K/V as SPEC section 3's
inject computes them (`h = encode(features)`; K = rope(rms_head(h wk, k_norm)), V = h wv, with
no attn_norm in front).

Trainable weights are a dict of float32 arrays keyed like the host weights (`fc`,
`enc.output_norm`, `output_norm`, `blk.i.*`; `drafter_tensor_shapes(cfg)`), so the trained
drafter is exported by `save_drafter`. `tok_embd` and `lm_head` are the frozen target's.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import DFlashConfig, drafter_tensor_shapes, rope_inv_freq
from dflash_jax.dispatch import einsum_f32, linear, resolve_dtype, rms_norm
from dflash_jax.synthetic import synthetic_drafter
from pallas_kernels.norm_rope import rms_rope_halves

Weights = Mapping[str, jax.Array]


def init_drafter(cfg: DFlashConfig, seed: int = 0) -> dict[str, jax.Array]:
  """Random float32 trainable weights (synthetic_drafter's scaled init), keyed like the host
  weights, without the target's tok_embd / lm_head."""
  w = synthetic_drafter(cfg, seed=seed, with_target=False)
  return {k: jnp.asarray(v, jnp.float32) for k, v in w.items()}


def check_weights(cfg: DFlashConfig, w: Weights) -> None:
  """Every trainable tensor present with its shape, nothing else (tok_embd / lm_head are
  frozen and passed separately)."""
  expected = drafter_tensor_shapes(cfg)
  missing = sorted(set(expected) - set(w))
  extra = sorted(set(w) - set(expected))
  if missing or extra:
    raise ValueError(f"drafter weights: missing {missing}, unknown {extra}")
  for name, shape in expected.items():
    if tuple(w[name].shape) != shape:
      raise ValueError(f"drafter weight '{name}' has shape {tuple(w[name].shape)}, "
                       f"expected {shape}")


def cast_matrices(tree: Any, dtype: Any) -> Any:
  """Matrices (ndim 2) in dtype, everything else as is: the compute copy of float32 masters
  (bf16 training casts here, inside the loss, so gradients reach the masters in float32).
  Works on any pytree (drafter weight dicts, TargetParams)."""
  dt = resolve_dtype(dtype, "compute_dtype")
  return jax.tree.map(lambda x: x.astype(dt) if x.ndim == 2 else x, tree)


def _norm_rope(x: jax.Array, w: jax.Array, pos: jax.Array, inv_freq: jax.Array,
               eps: float) -> jax.Array:
  """rms_head + NEOX rope of x [..., H, D] at pos (broadcast to x.shape[:-1])."""
  shape = x.shape
  h = shape[-1] // 2
  rows = x.astype(jnp.float32).reshape(-1, shape[-1])
  p = jnp.broadcast_to(pos[..., None], shape[:-1]).reshape(-1).astype(jnp.int32)
  y1, y2 = rms_rope_halves(rows[:, :h], rows[:, h:], w[:h], w[h:], p, inv_freq, eps, shape[-1])
  return jnp.concatenate([y1, y2], axis=-1).reshape(shape)


def context_mask(cfg: DFlashConfig, anchors: jax.Array, n_ctx: int,
                 window: int | None = None) -> jax.Array:
  """[n_layer, S, A, B, T] bool: context position p visible to block row i of anchor a_j.

  p < a_j always (strictly: the anchor's own feature is not context); sliding layers also need
  (a_j + i) - p < W (SPEC section 7). Full layers see every p < a_j.
  """
  w = cfg.resolve_window(window)
  p = jnp.arange(n_ctx, dtype=jnp.int32)
  a = anchors.astype(jnp.int32)[..., None, None]                       # [S, A, 1, 1]
  q = a + jnp.arange(cfg.block_size, dtype=jnp.int32)[:, None]          # [S, A, B, 1]
  past = p < a                                                          # [S, A, 1, T]
  in_window = past & (q - p < w)                                        # [S, A, B, T]
  full = jnp.broadcast_to(past, in_window.shape)
  return jnp.stack([in_window if cfg.is_sliding(l) else full for l in range(cfg.n_layer)])


def block_logits(w: Weights, tok_embd: jax.Array, lm_head: jax.Array, cfg: DFlashConfig,
                 features: jax.Array, tokens: jax.Array, anchors: jax.Array, *,
                 window: int | None = None, compute_dtype: Any = "fp32") -> jax.Array:
  """Logits [S, A, B, n_vocab] float32 of every anchor's block.

  w: trainable weights (float32 masters, see module doc); tok_embd, lm_head: the target's
  [n_vocab, n_embd]; features [S, T, n_target_layers n_embd]: the target's captured features of
  each sequence (row t = token t); tokens [S, T] int32; anchors [S, A] int32 in [0, T) (padding
  anchors compute a harmless block; the loss gives them no weight). window: the sliding
  layers' W (default: the config's, else 2048). compute_dtype: "fp32" (GEMMs at HIGHEST
  precision) or "bf16" (matrices and GEMM/attention inputs rounded to bf16, float32
  accumulation, norms and softmax in float32). Differentiable in w.
  """
  dt = resolve_dtype(compute_dtype, "compute_dtype")
  s, t, f = features.shape
  if f != cfg.n_embd_fc:
    raise ValueError(f"features must be [S, T, {cfg.n_embd_fc}], got {features.shape}")
  if tokens.shape != (s, t):
    raise ValueError(f"tokens must be [S, T] = {(s, t)} like features, got {tokens.shape}")
  if anchors.ndim != 2 or anchors.shape[0] != s:
    raise ValueError(f"anchors must be [S, A] with S = {s}, got {anchors.shape}")
  cw = cast_matrices(w, dt)
  bsz, hq, hkv, d, eps = cfg.block_size, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.eps
  g = hq // hkv
  inv_freq = jnp.asarray(rope_inv_freq(d, cfg.rope_theta))
  prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None

  def lin(x, name, **kw):
    return linear(x, cw[name], impl="xla", **kw)

  def dot(spec, a, b):
    return einsum_f32(spec, a.astype(dt), b.astype(dt), prec)

  a_ = anchors.astype(jnp.int32)
  n_a = a_.shape[1]
  blk_tokens = jnp.full((s, n_a, bsz), cfg.mask_token_id, jnp.int32)
  blk_tokens = blk_tokens.at[:, :, 0].set(jnp.take_along_axis(tokens.astype(jnp.int32), a_, 1))
  blk_pos = a_[..., None] + jnp.arange(bsz, dtype=jnp.int32)            # [S, A, B]
  ctx_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t))
  x = tok_embd.astype(dt)[blk_tokens].astype(jnp.float32)               # [S, A, B, E]
  h = rms_norm(lin(features, "fc"), cw["enc.output_norm"], eps)         # [S, T, E]
  masks = context_mask(cfg, a_, t, window)
  scale = 1.0 / np.sqrt(d)

  for l in range(cfg.n_layer):
    p = f"blk.{l}."
    k_ctx = _norm_rope(lin(h, p + "attn_k").reshape(s, t, hkv, d), cw[p + "attn_k_norm"],
                       ctx_pos, inv_freq, eps)
    v_ctx = lin(h, p + "attn_v").reshape(s, t, hkv, d)
    a = rms_norm(x, cw[p + "attn_norm"], eps)
    q = _norm_rope(lin(a, p + "attn_q").reshape(s, n_a, bsz, hq, d), cw[p + "attn_q_norm"],
                   blk_pos, inv_freq, eps).reshape(s, n_a, bsz, hkv, g, d)
    k = _norm_rope(lin(a, p + "attn_k").reshape(s, n_a, bsz, hkv, d), cw[p + "attn_k_norm"],
                   blk_pos, inv_freq, eps)
    v = lin(a, p + "attn_v").reshape(s, n_a, bsz, hkv, d)
    # Scores over the context [.., T] and over the block's own keys [.., B], one softmax.
    sc = dot("sabkgd,stkd->sabkgt", q, k_ctx) * scale
    sc = jnp.where(masks[l][:, :, :, None, None, :], sc, -jnp.inf)
    sb = dot("sabkgd,sackd->sabkgc", q, k) * scale
    probs = jax.nn.softmax(jnp.concatenate([sc, sb], axis=-1), axis=-1)
    o = (dot("sabkgt,stkd->sabkgd", probs[..., :t], v_ctx)
         + dot("sabkgc,sackd->sabkgd", probs[..., t:], v))
    x = x + lin(o.reshape(s, n_a, bsz, hq * d), p + "attn_output")
    wgu = jnp.concatenate([cw[p + "ffn_gate"], cw[p + "ffn_up"]], axis=0)
    hidden = linear(rms_norm(x, cw[p + "ffn_norm"], eps), wgu, impl="xla", gate_up=True)
    x = x + lin(hidden, p + "ffn_down")
  return linear(rms_norm(x, cw["output_norm"], eps), lm_head.astype(dt), impl="xla")
