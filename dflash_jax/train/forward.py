"""The training forwards of the drafter families (SPEC.md section 10, SPEC_dflash2_dspark),
batched over anchors.

For a sequence with A anchors a_j, block j is `[x_{a_j}, mask x (B-1)]` at positions
`a_j .. a_j+B-1`. Its rows attend to the context K/V of positions `p < a_j` (the features the
inference step would have injected before drafting at `n_past = a_j`), under each layer's
window rule (sliding: `(a_j + i) - p < W`; full: every `p < a_j`), plus the keys of their own
block (all B for DFlash and DSpark; DFlash2 layers may be causal). All anchors of all
sequences run in one jnp forward with an explicit mask; nothing loops over anchors.

The layer math is the inference step's: `dispatch.rms_norm`, `dispatch.linear` (its XLA path:
fp32 HIGHEST, or bf16 operands with float32 accumulation), the per-head RMS norm + NEOX rope of
`pallas_kernels.norm_rope.rms_rope_halves` (what the step's qk_norm_rope and inject kernels
use), the silu-gated FFN of `linear(..., gate_up=True)`, and context K/V as SPEC section 3's
inject computes them (`h = encode(features)`; K = rope(rms_head(h wk, k_norm)), V = h wv, with
no attn_norm in front).

Each family is a set of functions around the shared pieces (`_blocks`, `_attention`, `_mlp`):
DFlash `block_logits`; DFlash2 `dflash2_block_outputs` (the convolutions, embedding scale,
logit multiplier and softcap, block causality) and `selector_scores` (the walk's scores given
each row's predecessor); DSpark `dspark_block_outputs` (shifted rows, the Markov head and the
confidence head along the teacher-forced path, `teacher_prevs`).

Trainable weights are a dict of float32 arrays keyed like the host weights (`fc`,
`enc.output_norm`, `output_norm`, `blk.i.*` and the family's tensors;
`drafter_tensor_shapes(cfg, n_vocab)`), so the trained drafter is exported by `save_drafter`.
`tok_embd` and `lm_head` are the frozen target's.
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import DFlashConfig, drafter_tensor_shapes, rope_inv_freq
from dflash_jax.dispatch import einsum_f32, linear, resolve_dtype, rms_norm
from dflash_jax.synthetic import synthetic_drafter
from pallas_kernels.norm_rope import rms_rope_halves

Weights = Mapping[str, jax.Array]


def init_drafter(cfg: DFlashConfig, seed: int = 0, n_vocab: int | None = None
                 ) -> dict[str, jax.Array]:
  """Random float32 trainable weights (synthetic_drafter's scaled init), keyed like the host
  weights, without the target's tok_embd / lm_head. n_vocab: the target's vocabulary (needed
  by DFlash2's codebooks and DSpark's Markov tables).

  The tables through which DFlash2's selector and DSpark's Markov head add to the logits
  (`selector_successor`, `markov_w2`) start at zero, so a fresh drafter drafts like its
  backbone and each head learns its correction from there (their other tables still get
  gradients: the zero table's gradient is not zero).
  """
  w = synthetic_drafter(cfg, seed=seed, with_target=False,
                        **({} if n_vocab is None else dict(n_vocab=n_vocab)))
  for name in ZERO_INIT:
    if name in w:
      w[name] = np.zeros_like(w[name])
  return {k: jnp.asarray(v, jnp.float32) for k, v in w.items()}


# The family tables `init_drafter` zeroes (see there).
ZERO_INIT = ("selector_successor", "markov_w2")


def check_weights(cfg: DFlashConfig, w: Weights, n_vocab: int | None = None) -> None:
  """Every trainable tensor present with its shape, nothing else (tok_embd / lm_head are
  frozen and passed separately). n_vocab: the target's vocabulary, for the family tables."""
  expected = drafter_tensor_shapes(cfg, n_vocab)
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
               eps: float, attention_scaling: float) -> jax.Array:
  """rms_head + NEOX rope of x [..., H, D] at pos (broadcast to x.shape[:-1]), cos and sin
  times attention_scaling."""
  shape = x.shape
  h = shape[-1] // 2
  rows = x.astype(jnp.float32).reshape(-1, shape[-1])
  p = jnp.broadcast_to(pos[..., None], shape[:-1]).reshape(-1).astype(jnp.int32)
  y1, y2 = rms_rope_halves(rows[:, :h], rows[:, h:], w[:h], w[h:], p, inv_freq, eps, shape[-1],
                           attention_scaling)
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


class _Blocks(NamedTuple):
  """What every layer of a batched training forward reads: the compute copy of the weights,
  the encoded context, the per-layer context masks and the positions (see `_blocks`)."""
  cfg: DFlashConfig
  cw: Weights
  dt: Any
  prec: Any
  s: int
  t: int
  n_a: int
  blk_pos: jax.Array      # [S, A, B] int32
  ctx_pos: jax.Array      # [S, T] int32
  h: jax.Array            # [S, T, E]: the encoded context
  masks: jax.Array        # [n_layer, S, A, B, T]
  inv_freq: jax.Array      # the rope table, the config's scaling applied
  rope_scale: float       # its attention factor (cos and sin times it)


def _blocks(w: Weights, cfg: DFlashConfig, features: jax.Array, tokens: jax.Array,
            anchors: jax.Array, window: int | None, compute_dtype: Any) -> _Blocks:
  """Checks the shapes and sets up a forward (`block_logits` documents the arguments)."""
  dt = resolve_dtype(compute_dtype, "compute_dtype")
  s, t, f = features.shape
  if f != cfg.n_embd_fc:
    raise ValueError(f"features must be [S, T, {cfg.n_embd_fc}], got {features.shape}")
  if tokens.shape != (s, t):
    raise ValueError(f"tokens must be [S, T] = {(s, t)} like features, got {tokens.shape}")
  if anchors.ndim != 2 or anchors.shape[0] != s:
    raise ValueError(f"anchors must be [S, A] with S = {s}, got {anchors.shape}")
  cw = cast_matrices(w, dt)
  a_ = anchors.astype(jnp.int32)
  blk_pos = a_[..., None] + jnp.arange(cfg.block_size, dtype=jnp.int32)   # [S, A, B]
  ctx_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t))
  b = _Blocks(cfg=cfg, cw=cw, dt=dt, prec=jax.lax.Precision.HIGHEST if dt == jnp.float32 else None,
              s=s, t=t, n_a=a_.shape[1], blk_pos=blk_pos, ctx_pos=ctx_pos, h=None,
              masks=context_mask(cfg, a_, t, window),
              inv_freq=jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)),
              rope_scale=cfg.rope_scaling.attention_scaling)
  return b._replace(h=rms_norm(_lin(b, features, "fc"), cw["enc.output_norm"], cfg.eps))


def _lin(b: _Blocks, x: jax.Array, name: str, **kw) -> jax.Array:
  return linear(x, b.cw[name], impl="xla", **kw)


def _dot(b: _Blocks, spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
  return einsum_f32(spec, x.astype(b.dt), y.astype(b.dt), b.prec)


def _embed(b: _Blocks, tok_embd: jax.Array, tokens: jax.Array, anchors: jax.Array) -> jax.Array:
  """[S, A, B, E] float32: each block's `[x_a, mask x (B-1)]` embedded (the target's rows)."""
  a_ = anchors.astype(jnp.int32)
  blk_tokens = jnp.full((b.s, b.n_a, b.cfg.block_size), b.cfg.mask_token_id, jnp.int32)
  blk_tokens = blk_tokens.at[:, :, 0].set(jnp.take_along_axis(tokens.astype(jnp.int32), a_, 1))
  return tok_embd.astype(b.dt)[blk_tokens].astype(jnp.float32)


def _attention(b: _Blocks, l: int, a: jax.Array, block_visible: np.ndarray | None = None
               ) -> jax.Array:
  """Layer l's attention heads [S, A, B, n_head head_dim] (before attn_output) of the blocks'
  normed rows a: one softmax over the visible context and the block's own keys (all of them,
  or those block_visible [B, B] allows)."""
  cfg, cw, eps = b.cfg, b.cw, b.cfg.eps
  s, t, n_a, bsz = b.s, b.t, b.n_a, cfg.block_size
  hq, hkv, d = cfg.n_head, cfg.n_head_kv, cfg.head_dim
  p = f"blk.{l}."
  k_ctx = _norm_rope(_lin(b, b.h, p + "attn_k").reshape(s, t, hkv, d), cw[p + "attn_k_norm"],
                     b.ctx_pos, b.inv_freq, eps, b.rope_scale)
  v_ctx = _lin(b, b.h, p + "attn_v").reshape(s, t, hkv, d)
  q = _norm_rope(_lin(b, a, p + "attn_q").reshape(s, n_a, bsz, hq, d), cw[p + "attn_q_norm"],
                 b.blk_pos, b.inv_freq, eps, b.rope_scale).reshape(s, n_a, bsz, hkv, hq // hkv, d)
  k = _norm_rope(_lin(b, a, p + "attn_k").reshape(s, n_a, bsz, hkv, d), cw[p + "attn_k_norm"],
                 b.blk_pos, b.inv_freq, eps, b.rope_scale)
  v = _lin(b, a, p + "attn_v").reshape(s, n_a, bsz, hkv, d)
  scale = 1.0 / np.sqrt(d)
  # Scores over the context [.., T] and over the block's own keys [.., B], one softmax.
  sc = _dot(b, "sabkgd,stkd->sabkgt", q, k_ctx) * scale
  sc = jnp.where(b.masks[l][:, :, :, None, None, :], sc, -jnp.inf)
  sb = _dot(b, "sabkgd,sackd->sabkgc", q, k) * scale
  if block_visible is not None:
    sb = jnp.where(jnp.asarray(block_visible)[:, None, None, :], sb, -jnp.inf)
  probs = jax.nn.softmax(jnp.concatenate([sc, sb], axis=-1), axis=-1)
  o = (_dot(b, "sabkgt,stkd->sabkgd", probs[..., :t], v_ctx)
       + _dot(b, "sabkgc,sackd->sabkgd", probs[..., t:], v))
  return o.reshape(s, n_a, bsz, hq * d)


def _mlp(b: _Blocks, l: int, f: jax.Array) -> jax.Array:
  """Layer l's gated MLP of its normed input f, through ffn_down."""
  p = f"blk.{l}."
  wgu = jnp.concatenate([b.cw[p + "ffn_gate"], b.cw[p + "ffn_up"]], axis=0)
  return _lin(b, linear(f, wgu, impl="xla", gate_up=True), p + "ffn_down")


def _dflash_layer(b: _Blocks, l: int, x: jax.Array) -> jax.Array:
  """One DFlash (and DSpark) layer over the blocks x [S, A, B, E]."""
  p, eps = f"blk.{l}.", b.cfg.eps
  x = x + _lin(b, _attention(b, l, rms_norm(x, b.cw[p + "attn_norm"], eps)), p + "attn_output")
  return x + _mlp(b, l, rms_norm(x, b.cw[p + "ffn_norm"], eps))


def block_hidden(w: Weights, tok_embd: jax.Array, cfg: DFlashConfig, features: jax.Array,
                 tokens: jax.Array, anchors: jax.Array, *, window: int | None = None,
                 compute_dtype: Any = "fp32") -> jax.Array:
  """The final-normed hidden states [S, A, B, n_embd] float32 of every anchor's block, by the
  DFlash layer (DFlash and DSpark); arguments as `block_logits`."""
  b = _blocks(w, cfg, features, tokens, anchors, window, compute_dtype)
  x = _embed(b, tok_embd, tokens, anchors)
  for l in range(cfg.n_layer):
    x = _dflash_layer(b, l, x)
  return rms_norm(x, b.cw["output_norm"], cfg.eps)


def block_logits(w: Weights, tok_embd: jax.Array, lm_head: jax.Array, cfg: DFlashConfig,
                 features: jax.Array, tokens: jax.Array, anchors: jax.Array, *,
                 window: int | None = None, compute_dtype: Any = "fp32") -> jax.Array:
  """Logits [S, A, B, n_vocab] float32 of every anchor's block (DFlash).

  w: trainable weights (float32 masters, see module doc); tok_embd, lm_head: the target's
  [n_vocab, n_embd]; features [S, T, n_target_layers n_embd]: the target's captured features of
  each sequence (row t = token t); tokens [S, T] int32; anchors [S, A] int32 in [0, T) (padding
  anchors compute a harmless block; the loss gives them no weight). window: the sliding
  layers' W (default: the config's, else 2048). compute_dtype: "fp32" (GEMMs at HIGHEST
  precision) or "bf16" (matrices and GEMM/attention inputs rounded to bf16, float32
  accumulation, norms and softmax in float32). Differentiable in w.
  """
  h = block_hidden(w, tok_embd, cfg, features, tokens, anchors, window=window,
                   compute_dtype=compute_dtype)
  return linear(h, lm_head.astype(resolve_dtype(compute_dtype, "compute_dtype")), impl="xla")


def label_positions(cfg: DFlashConfig, anchors: jax.Array) -> jax.Array:
  """[S, A, B] int32: the sequence position each block row predicts: a + i (DFlash, DFlash2,
  DSpark without shifted rows; row 0 then predicts nothing) or a + i + 1 (shifted rows)."""
  shift = 1 if cfg.shifted_rows else 0
  return (anchors.astype(jnp.int32)[..., None] + shift
          + jnp.arange(cfg.block_size, dtype=jnp.int32))


def teacher_prevs(cfg: DFlashConfig, tokens: jax.Array, anchors: jax.Array) -> jax.Array:
  """[S, A, B] int32: each row's predecessor under teacher forcing, the true token just before
  the one the row predicts (the first draft row's is the anchor x_a, as at inference, where
  later rows take the previous draft). Positions outside the sequence are clamped: such rows
  carry no loss."""
  s, t = tokens.shape
  pos = jnp.clip(label_positions(cfg, anchors) - 1, 0, t - 1)
  return jnp.take_along_axis(tokens.astype(jnp.int32), pos.reshape(s, -1), 1).reshape(pos.shape)


# --- DFlash2 (SPEC_dflash2_dspark sections 4-7) ----------------------------------------------

def grouped_causal_conv(y: jax.Array, base: jax.Array, coef: jax.Array) -> jax.Array:
  """One side of a grouped dynamic causal convolution along the block rows (axis -2).

  y [..., B, H]; base [K, H]; coef [..., B, K, n_groups] (output row i's coefficients):
  out[i, c] = sum_t (base[t, c] + coef[i, t, c // G]) y[i - t, c], zero before row 0."""
  rows, h = y.shape[-2], y.shape[-1]
  k, n_groups = coef.shape[-2], coef.shape[-1]
  full = base.astype(jnp.float32) + jnp.repeat(coef, h // n_groups, axis=-1)   # [..., B, K, H]
  out = full[..., 0, :] * y
  for tap in range(1, min(k, rows)):
    pad = jnp.zeros(y.shape[:-2] + (tap, h), y.dtype)
    shifted = jnp.concatenate([pad, y[..., :rows - tap, :]], axis=-2)
    out = out + full[..., tap, :] * shifted
  return out


def _conv_sides(b: _Blocks, name: str, a: jax.Array):
  """The convolution `name` (blk.i.attn_conv / blk.i.ffn_conv) of the sublayer whose normed
  input is a: (prepare, finish), its two sides with the coefficients projected from a."""
  k = b.cfg.dflash2.conv_kernel_size
  d = _lin(b, a, name + "_proj")
  coef = d.reshape(d.shape[:-1] + (2, k, d.shape[-1] // (2 * k)))   # side, tap, group
  base = b.cw[name + "_base"]
  return (lambda y: grouped_causal_conv(y, base[0], coef[..., 0, :, :]),
          lambda y: grouped_causal_conv(y, base[1], coef[..., 1, :, :]))


def _dflash2_layer(b: _Blocks, l: int, x: jax.Array, visible: np.ndarray) -> jax.Array:
  """One DFlash2 layer: each sublayer's normed input through the prepare side of its
  convolution, its output through the finish side before the residual add; the block's own
  keys as `visible` [B, B] allows (causality, and the symmetric band of a sliding layer)."""
  p, eps = f"blk.{l}.", b.cfg.eps
  a = rms_norm(x, b.cw[p + "attn_norm"], eps)
  prepare, finish = _conv_sides(b, p + "attn_conv", a)
  x = x + finish(_lin(b, _attention(b, l, prepare(a), visible), p + "attn_output"))
  f = rms_norm(x, b.cw[p + "ffn_norm"], eps)
  prepare, finish = _conv_sides(b, p + "ffn_conv", f)
  return x + finish(_mlp(b, l, prepare(f)))


def dflash2_block_visibility(cfg: DFlashConfig, l: int, window: int | None = None) -> np.ndarray:
  """[B, B] bool: block key j visible to block row i in layer l (SPEC_dflash2_dspark 5.4):
  j <= i when the layer is causal; a sliding layer also needs i - j < W and, non-causal,
  j - i < W."""
  i = np.arange(cfg.block_size)[:, None]
  j = np.arange(cfg.block_size)[None, :]
  visible = np.ones((cfg.block_size, cfg.block_size), bool)
  causal = cfg.block_causal(l)
  if causal:
    visible &= j <= i
  if cfg.is_sliding(l):
    w = cfg.resolve_window(window)
    visible &= i - j < w
    if not causal:
      visible &= j - i < w
  return visible


def logit_transform(raw: jax.Array, multiplier: float, softcap: float | None) -> jax.Array:
  """raw * multiplier, then softcap * tanh(z / softcap) when the softcap is set."""
  z = raw * jnp.float32(multiplier)
  if softcap:
    z = jnp.float32(softcap) * jnp.tanh(z / jnp.float32(softcap))
  return z


def dflash2_block_outputs(w: Weights, tok_embd: jax.Array, lm_head: jax.Array,
                          cfg: DFlashConfig, features: jax.Array, tokens: jax.Array,
                          anchors: jax.Array, *, window: int | None = None,
                          compute_dtype: Any = "fp32") -> tuple[jax.Array, jax.Array]:
  """(logits [S, A, B, V], hidden [S, A, B, E]) of every anchor's DFlash2 block: every row's
  embedding times input_embedding_scale, the DFlash2 layers, the final norm, then lm_head with
  the logit multiplier and softcap. Arguments as `block_logits`."""
  f = cfg.dflash2
  b = _blocks(w, cfg, features, tokens, anchors, window, compute_dtype)
  x = jnp.float32(f.input_embedding_scale) * _embed(b, tok_embd, tokens, anchors)
  for l in range(cfg.n_layer):
    x = _dflash2_layer(b, l, x, dflash2_block_visibility(cfg, l, window))
  h = rms_norm(x, b.cw["output_norm"], cfg.eps)
  raw = linear(h, lm_head.astype(b.dt), impl="xla")
  return logit_transform(raw, f.output_multiplier, f.final_logit_softcapping), h


class SelectorScores(NamedTuple):
  """The walk's scores of draft rows given their predecessors (SPEC_dflash2_dspark 7):
  candidates [..., k] int32 (each row's top-k logits, descending, ties to the lower id),
  scores [..., k] (unary logit + edge from the predecessor), and for each row's label:
  label_score [...] (its unary + edge), label_index [...] int32 (its place among the
  candidates, k when it is not one)."""
  candidates: jax.Array
  scores: jax.Array
  label_score: jax.Array
  label_index: jax.Array


def selector_scores(w: Weights, logits: jax.Array, hidden: jax.Array, prev: jax.Array,
                    labels: jax.Array, top_k: int, *, compute_dtype: Any = "fp32"
                    ) -> SelectorScores:
  """The selector's scores of rows [...] given logits [..., V] (after the logit transform),
  final-normed hidden [..., E], predecessor ids prev [...] and label ids [...]:
  g = selector_hidden h, edge(t, c) = sum_r A[t, r] g[r] S[c, r] (A, S: the predecessor and
  successor codebooks). Gradients reach the codebooks and selector_hidden, and through
  `logits` / `hidden` whatever the caller does not stop."""
  dt = resolve_dtype(compute_dtype, "compute_dtype")
  prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
  cw = cast_matrices({k: w[k] for k in ("selector_hidden", "selector_predecessor",
                                        "selector_successor")}, dt)
  g = linear(hidden, cw["selector_hidden"], impl="xla")                      # [..., R]
  left = cw["selector_predecessor"][prev].astype(jnp.float32) * g            # A[prev] * g
  _, cand = jax.lax.top_k(jax.lax.stop_gradient(logits), top_k)
  cand = cand.astype(jnp.int32)
  unary = jnp.take_along_axis(logits, cand, -1)
  succ = cw["selector_successor"][cand]                                      # [..., k, R]
  edge = einsum_f32("...r,...kr->...k", left.astype(dt), succ, prec)
  lab = labels.astype(jnp.int32)
  lab_edge = einsum_f32("...r,...r->...", left.astype(dt), cw["selector_successor"][lab], prec)
  lab_unary = jnp.take_along_axis(logits, lab[..., None], -1)[..., 0]
  hit = cand == lab[..., None]
  index = jnp.where(hit.any(-1), jnp.argmax(hit, -1), top_k).astype(jnp.int32)
  return SelectorScores(cand, unary + edge, lab_unary + lab_edge, index)


# --- DSpark (SPEC_dflash2_dspark sections 9-12) ----------------------------------------------

class DSparkOutputs(NamedTuple):
  """A DSpark training forward along the teacher-forced path: base [S, A, B, V] (the
  backbone's logits), logits [S, A, B, V] (Markov-corrected, each row's predecessor the true
  token: `teacher_prevs`), hidden [S, A, B, E], prev [S, A, B] int32, and conf_logits
  [S, A, B] (the confidence head before its sigmoid; None without a head)."""
  base: jax.Array
  logits: jax.Array
  hidden: jax.Array
  prev: jax.Array
  conf_logits: jax.Array | None


def markov_logits(cfg: DFlashConfig, w: Weights, base: jax.Array, hidden: jax.Array,
                  prev: jax.Array) -> jax.Array:
  """base [..., B, V] corrected by the Markov head given each row's predecessor prev [..., B]
  (section 11): vanilla base + W2 E; gated base + W2 (sigmoid(Wg [h ; E] + bg) E); rnn a
  state carried over the B rows from zero. E = W1[prev]. w: the compute copy of the weights
  (matrices already in the compute dtype). No head: base."""
  f = cfg.dspark
  if not f.markov_rank:
    return base
  e = w["markov_w1"][prev].astype(jnp.float32)
  lin = lambda x, name: linear(x, w[name], impl="xla")
  if f.markov_head_type == "vanilla":
    return base + lin(e, "markov_w2")
  if f.markov_head_type == "gated":
    gate = jax.nn.sigmoid(lin(jnp.concatenate([hidden, e], -1), "markov_gate")
                          + w["markov_gate.bias"])
    return base + lin(gate * e, "markov_w2")
  state = jnp.zeros(e.shape[:-2] + (f.markov_rank,), jnp.float32)
  outs = []
  for i in range(base.shape[-2]):
    z = lin(jnp.concatenate([state, e[..., i, :], hidden[..., i, :]], -1), "markov_joint")
    a, c, o = jnp.split(z + w["markov_joint.bias"], 3, axis=-1)
    g = jax.nn.sigmoid(a)
    state = g * state + (1.0 - g) * jnp.tanh(c)
    outs.append(lin(jnp.tanh(o), "markov_w2"))
  return base + jnp.stack(outs, axis=-2)


def dspark_block_outputs(w: Weights, tok_embd: jax.Array, lm_head: jax.Array,
                         cfg: DFlashConfig, features: jax.Array, tokens: jax.Array,
                         anchors: jax.Array, *, window: int | None = None,
                         compute_dtype: Any = "fp32") -> DSparkOutputs:
  """Every anchor's DSpark block along the teacher-forced path (`DSparkOutputs`): the DFlash
  backbone (`block_hidden`), lm_head, the Markov head with the true previous tokens, the
  confidence head on [h ; W1[prev]] (or h). Arguments as `block_logits`."""
  f = cfg.dspark
  dt = resolve_dtype(compute_dtype, "compute_dtype")
  h = block_hidden(w, tok_embd, cfg, features, tokens, anchors, window=window,
                   compute_dtype=compute_dtype)
  base = linear(h, lm_head.astype(dt), impl="xla")
  prev = teacher_prevs(cfg, tokens, anchors)
  cw = cast_matrices(w, dt)
  logits = markov_logits(cfg, cw, base, h, prev)
  conf = None
  if f.confidence_head:
    feat = h
    if f.confidence_with_markov:
      feat = jnp.concatenate([h, cw["markov_w1"][prev].astype(jnp.float32)], -1)
    conf = linear(feat, cw["conf_proj"], impl="xla")[..., 0] + w["conf_proj.bias"][0]
  return DSparkOutputs(base, logits, h, prev, conf)
