"""Eager numpy float32 drafters: SPEC.md section 3 (DFlash) and SPEC_dflash2_dspark (DFlash2,
DSpark), written to be read.

Every kernel and jitted path is certified against this module, so it favours the plainest
possible statement of each operation over speed. All arithmetic is float32; bf16 modes only
round stored values and GEMM inputs (SPEC.md section 5). The DFlash2 and DSpark pieces are the
functions of reference/families.py; DFlashRef puts each family's pieces around the shared
backbone.
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from dflash_jax.config import DFlashConfig, drafter_tensor_shapes, rope_inv_freq
from reference import families as fam

_F32 = np.float32
_PRECISIONS = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
  """x / sqrt(mean(x^2) + eps) * w over the last axis (per head when x is [..., H, D])."""
  x = np.asarray(x, _F32)
  ms = np.mean(x * x, axis=-1, keepdims=True)
  return x / np.sqrt(ms + _F32(eps)) * np.asarray(w, _F32)


def rope_neox(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
              attention_scaling: float = 1.0) -> np.ndarray:
  """NEOX (rotate-half) rope of x [..., T, H, D] at positions [T].

  The angle is float32(pos) * inv_freq in float32, exactly as kernels compute it, so that
  kernels and reference agree tightly even at large positions. cos and sin are multiplied by
  attention_scaling (YaRN's attention factor), where HF's rotary embedding multiplies them.
  """
  x = np.asarray(x, _F32)
  half = x.shape[-1] // 2
  angle = np.asarray(positions).astype(_F32)[:, None] * np.asarray(inv_freq, _F32)[None, :]
  cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]  # [T, 1, D/2] over heads
  if attention_scaling != 1.0:
    cos, sin = cos * _F32(attention_scaling), sin * _F32(attention_scaling)
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def ring_visibility(ring_pos: np.ndarray, n_past: int, window: int | None,
                    n_rows: int) -> np.ndarray:
  """[T, S] bool: stored slot j is visible to block row t (at position n_past + t).

  Visible iff the slot holds a committed position p (0 <= p < n_past) and, for a sliding
  layer, q - p < window; window None is full attention (no window edge).
  """
  p = np.asarray(ring_pos, np.int64)[None, :]
  q = n_past + np.arange(n_rows, dtype=np.int64)[:, None]
  in_window = np.ones_like(q - p, bool) if window is None else q - p < window
  return (p >= 0) & (p < n_past) & in_window


def attention(q: np.ndarray, k_ring: np.ndarray, v_ring: np.ndarray, ring_pos: np.ndarray,
              k_blk: np.ndarray, v_blk: np.ndarray, n_past: int,
              window: int | None, block_visible: np.ndarray | None = None) -> np.ndarray:
  """Block attention over the visible stored slots plus the block keys.

  q [T, Hq, D]; k_ring, v_ring [Hkv, S, D]; ring_pos [S]; k_blk, v_blk [T, Hkv, D]; window
  None for a full-attention layer. block_visible [T, T] says which block keys each row sees
  (None: all of them, non-causal, as DFlash and DSpark do). Query head h reads kv head h // G
  (contiguous GQA groups). Returns [T, Hq, D] float32.
  """
  t, hq, d = q.shape
  hkv = k_ring.shape[0]
  g = hq // hkv
  keys = np.concatenate([k_ring, np.transpose(k_blk, (1, 0, 2))], axis=1).astype(_F32)
  vals = np.concatenate([v_ring, np.transpose(v_blk, (1, 0, 2))], axis=1).astype(_F32)
  if block_visible is None:
    block_visible = np.ones((t, t), bool)
  visible = np.concatenate([ring_visibility(ring_pos, n_past, window, t), block_visible], axis=1)
  scale = _F32(1.0 / np.sqrt(d))
  out = np.empty((t, hq, d), _F32)
  for h in range(hq):
    scores = (np.asarray(q[:, h], _F32) @ keys[h // g].T) * scale
    scores = np.where(visible, scores, _F32(-np.inf))
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    out[:, h] = (p / p.sum(axis=-1, keepdims=True)) @ vals[h // g]
  return out


def first_mismatch(drafts: np.ndarray, target_tokens: np.ndarray) -> int:
  """Length of the longest common prefix of drafts [n] and target_tokens [>= n].

  target_tokens may carry one more entry (the bonus token after the last draft); only the
  first n are compared.
  """
  drafts, target_tokens = np.asarray(drafts).reshape(-1), np.asarray(target_tokens).reshape(-1)
  n = drafts.shape[0]
  if target_tokens.shape[0] < n:
    raise ValueError(f"target_tokens has {target_tokens.shape[0]} entries, fewer than the "
                     f"{n} drafts")
  differ = np.nonzero(drafts != target_tokens[:n])[0]
  return int(differ[0]) if differ.size else n


def silu(x: np.ndarray) -> np.ndarray:
  # sigmoid written with tanh: equal to 1/(1+exp(-x)) but cannot overflow for very negative x.
  return x * (_F32(0.5) * (_F32(1.0) + np.tanh(_F32(0.5) * x)))


def _precision(p) -> str:
  """Normalise "fp32"/"bf16", their long names, or a numpy/jnp dtype to "fp32" or "bf16"."""
  if isinstance(p, str) and p.lower() in _PRECISIONS:
    return _PRECISIONS[p.lower()]
  try:
    dt = np.dtype(p)
  except TypeError:
    dt = None
  if dt == np.dtype(np.float32):
    return "fp32"
  if dt == np.dtype(ml_dtypes.bfloat16):
    return "bf16"
  raise ValueError(f"precision must be 'fp32' or 'bf16' (or float32/bfloat16), got {p!r}")


def round_bf16(x: np.ndarray) -> np.ndarray:
  """Round to bfloat16 (round-to-nearest-even, like jnp astype) and back to float32."""
  return np.asarray(x, _F32).astype(ml_dtypes.bfloat16).astype(_F32)


@dataclasses.dataclass(frozen=True)
class Draft:
  """One block's draft (SPEC_dflash2_dspark section 14), n = the block's drafts.

  Every family: `logits` [w, V], the drafter's output logits (DFlash: lm_head's; DFlash2:
  after the multiplier and softcap; DSpark: the Markov-corrected logits along the chosen path
  on the draft rows, the backbone's on an unused row 0), `hidden` [w, H] the final-normed
  state, `drafts` [n] int32, and `draft_prob` [n], the drafter's own probability of each draft
  at temperature 1 (DFlash, DSpark: softmax(logits) at the draft; DFlash2: softmax(s_p) at the
  chosen candidate), the input of the p-min cut (families.verify_length).
  At temperature > 0, `q` is the proposal distribution along the sampled path: DFlash2 [n, k]
  over `candidates`, DFlash / DSpark [n, V] = softmax(logits / T) of the draft rows.
  DFlash2 only: `candidates` [n, k], `scores` [n, k] (the walk's s_p), `chosen` [n].
  DSpark only: `base` [w, V] (the backbone's logits) and, with a confidence head, `conf` [n].
  """
  logits: np.ndarray
  hidden: np.ndarray
  drafts: np.ndarray
  draft_prob: np.ndarray
  q: np.ndarray | None = None
  candidates: np.ndarray | None = None
  scores: np.ndarray | None = None
  chosen: np.ndarray | None = None
  base: np.ndarray | None = None
  conf: np.ndarray | None = None


class DFlashRef:
  """One sequence's drafter state: weights plus every layer's stored K/V.

  The drafter's family is `cfg.family`: "dflash" (SPEC.md), "dflash2" or "dspark"
  (SPEC_dflash2_dspark). `step` gives the output logits of a block; `draft` the whole draft
  (the DFlash2 selector walk, DSpark's Markov chain and confidence) as a `Draft`.

  Each layer is "sliding_attention" or "full_attention" (`cfg.kinds`, SPEC.md section 7).
  Observable state, float32 holding ring_dtype-rounded values, one stack per kind in layer
  order (None when no layer has that kind):
  - sliding layers: `ring_k`, `ring_v` [n_sliding, n_head_kv, window, head_dim] and
    `ring_pos` [window] int32 (-1 = empty); position p lives in slot p % window.
  - full-attention layers: `cache_k`, `cache_v` [n_full, n_head_kv, capacity, head_dim] and
    `cache_pos` [capacity]; position p lives in slot p, and p >= capacity cannot be stored.
  """

  def __init__(self, cfg: DFlashConfig, w: dict[str, np.ndarray], window: int | None = None,
               dtype="fp32", ring_dtype="fp32", capacity: int | None = None):
    self.cfg = cfg
    self.dtype = _precision(dtype)
    self.ring_dtype = _precision(ring_dtype)
    self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    self.rope_scale = cfg.rope_scaling.attention_scaling
    self.w = self._check_weights(w)
    self.n_vocab = self.w["tok_embd"].shape[0]
    self.sliding_layers = [l for l in range(cfg.n_layer) if cfg.is_sliding(l)]
    self.full_layers = [l for l in range(cfg.n_layer) if not cfg.is_sliding(l)]
    # window and capacity mean something only for layers of their kind.
    self.window = cfg.resolve_window(window) if self.sliding_layers else None
    self.capacity = cfg.resolve_capacity(capacity) if self.full_layers else None
    self.reset()

  def reset(self) -> None:
    """Empty every cache (all slots -1, K/V zero): the state of a fresh DFlashRef."""
    self.ring_k, self.ring_v, self.ring_pos = self._empty(len(self.sliding_layers), self.window)
    self.cache_k, self.cache_v, self.cache_pos = self._empty(len(self.full_layers), self.capacity)

  def _empty(self, n_layers: int, slots: int | None):
    if not n_layers:
      return None, None, None
    shape = (n_layers, self.cfg.n_head_kv, slots, self.cfg.head_dim)
    return np.zeros(shape, _F32), np.zeros(shape, _F32), np.full((slots,), -1, np.int32)

  def layer_kv(self, l: int):
    """Layer l's stored (k [Hkv, S, D], v, pos [S], window or None for full attention)."""
    if self.cfg.is_sliding(l):
      i = self.sliding_layers.index(l)
      return self.ring_k[i], self.ring_v[i], self.ring_pos, self.window
    i = self.full_layers.index(l)
    return self.cache_k[i], self.cache_v[i], self.cache_pos, None

  def _check_weights(self, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Validated float32 copies; with dtype bf16 the matrices (not the norms) are rounded."""
    cfg = self.cfg
    for name in ("tok_embd", "lm_head"):
      if name not in w:
        raise ValueError(f"weights lack {name!r}: the drafter borrows the target's token "
                         f"embedding and LM head; set w[{name!r}] to the target's "
                         f"[n_vocab, n_embd] matrix")
    n_vocab = np.shape(w["tok_embd"])[0]
    shapes = drafter_tensor_shapes(cfg, n_vocab)
    shapes.update(tok_embd=(n_vocab, cfg.n_embd), lm_head=(n_vocab, cfg.n_embd))
    out = {}
    for name, shape in shapes.items():
      if name not in w:
        raise ValueError(f"weights lack {name!r} (shape {shape})")
      a = np.array(w[name], dtype=_F32)
      if a.shape != shape:
        raise ValueError(f"weight {name!r} has shape {a.shape}, expected {shape}")
      out[name] = round_bf16(a) if self.dtype == "bf16" and a.ndim == 2 else a
    if cfg.mask_token_id >= n_vocab:
      raise ValueError(f"mask_token_id {cfg.mask_token_id} is outside the vocab ({n_vocab})")
    if cfg.family == "dflash2" and cfg.dflash2.selector_top_k > n_vocab:
      raise ValueError(f"selector_top_k {cfg.dflash2.selector_top_k} exceeds the vocab "
                       f"({n_vocab})")
    return out

  def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
    """x @ W^T with W in (out, in) layout; a bf16 GEMM sees its input rounded to bf16."""
    return self._gemm_in(x) @ self.w[name].T

  def _gemm_in(self, x: np.ndarray) -> np.ndarray:
    """What a GEMM of this precision reads of its input x."""
    return round_bf16(x) if self.dtype == "bf16" else np.asarray(x, _F32)

  def _store(self, x: np.ndarray) -> np.ndarray:
    return round_bf16(x) if self.ring_dtype == "bf16" else x

  def encode(self, features: np.ndarray) -> np.ndarray:
    """features [T, n_target_layers*n_embd] -> h = rms(features @ fc^T, enc.output_norm)."""
    features = np.asarray(features)
    if features.ndim != 2 or features.shape[1] != self.cfg.n_embd_fc:
      raise ValueError(f"features must be [T, {self.cfg.n_embd_fc}] (n_target_layers "
                       f"{self.cfg.n_target_layers} x n_embd {self.cfg.n_embd}), "
                       f"got shape {features.shape}")
    if not np.all(np.isfinite(features)):
      raise ValueError("features contain NaN or inf")
    return rms_norm(self._linear(features, "fc"), self.w["enc.output_norm"], self.cfg.eps)

  def inject(self, h: np.ndarray, positions: np.ndarray) -> None:
    """Store every layer's K (k_norm + rope) and raw V of h [T, n_embd] at `positions`.

    Sliding layers write slot pos % window, full-attention layers slot pos; when two rows
    share a slot the later row wins. A position a full-attention cache cannot hold
    (>= capacity) is an error, raised before anything is stored.
    """
    cfg = self.cfg
    h, positions = np.asarray(h), np.asarray(positions)
    if h.ndim != 2 or h.shape[1] != cfg.n_embd:
      raise ValueError(f"h must be [T, {cfg.n_embd}], got shape {h.shape}")
    if not np.all(np.isfinite(h)):
      raise ValueError("h contains NaN or inf")
    if positions.shape != (h.shape[0],) or not np.issubdtype(positions.dtype, np.integer):
      raise ValueError(f"positions must be {h.shape[0]} integers, got {positions.dtype} "
                       f"array of shape {positions.shape}")
    if np.any(positions < 0) or np.any(positions > np.iinfo(np.int32).max):
      raise ValueError(f"positions must be in [0, 2^31), got min {positions.min()} "
                       f"max {positions.max()}")
    if self.full_layers and positions.size and positions.max() >= self.capacity:
      raise ValueError(f"full_attention layers {self.full_layers} hold positions < capacity "
                       f"{self.capacity}; got position {positions.max()}")
    if self.sliding_layers:
      self._write(h, positions, positions % self.window, self.sliding_layers,
                  self.ring_k, self.ring_v, self.ring_pos)
    if self.full_layers:
      self._write(h, positions, positions, self.full_layers,
                  self.cache_k, self.cache_v, self.cache_pos)

  def _write(self, h, positions, slots, layers, store_k, store_v, store_pos) -> None:
    """K/V of `layers` for h's rows into their stacked store at `slots`."""
    cfg = self.cfg
    # Later rows win a shared slot, so only each slot's last row is computed at all.
    last_row = {int(s): t for t, s in enumerate(slots)}
    rows = np.array(sorted(last_row.values()), dtype=np.int64)
    slots, pos = slots[rows], positions[rows]
    for i, l in enumerate(layers):
      k = self._linear(h[rows], f"blk.{l}.attn_k").reshape(-1, cfg.n_head_kv, cfg.head_dim)
      v = self._linear(h[rows], f"blk.{l}.attn_v").reshape(-1, cfg.n_head_kv, cfg.head_dim)
      k = rope_neox(rms_norm(k, self.w[f"blk.{l}.attn_k_norm"], cfg.eps), pos, self.inv_freq,
                    self.rope_scale)
      store_k[i][:, slots] = self._store(k).transpose(1, 0, 2)
      store_v[i][:, slots] = self._store(v).transpose(1, 0, 2)
    store_pos[slots] = pos

  def _attend(self, l: int, a: np.ndarray, positions: np.ndarray, n_past: int,
              block_visible: np.ndarray | None = None) -> np.ndarray:
    """Layer l's attention of the block's normed rows a [w, n_embd] over its stored K/V and
    the block's own keys; returns the heads [w, n_head*head_dim] before attn_output."""
    cfg, p = self.cfg, f"blk.{l}."
    b = a.shape[0]
    q = self._linear(a, p + "attn_q").reshape(b, cfg.n_head, cfg.head_dim)
    k = self._linear(a, p + "attn_k").reshape(b, cfg.n_head_kv, cfg.head_dim)
    v = self._linear(a, p + "attn_v").reshape(b, cfg.n_head_kv, cfg.head_dim)
    q = rope_neox(rms_norm(q, self.w[p + "attn_q_norm"], cfg.eps), positions, self.inv_freq,
                  self.rope_scale)
    k = rope_neox(rms_norm(k, self.w[p + "attn_k_norm"], cfg.eps), positions, self.inv_freq,
                  self.rope_scale)
    stored_k, stored_v, stored_pos, window = self.layer_kv(l)
    o = attention(q, stored_k, stored_v, stored_pos, k, v, n_past, window, block_visible)
    return o.reshape(b, -1)

  def _mlp(self, l: int, f: np.ndarray) -> np.ndarray:
    """Layer l's gated MLP of its normed input f, through ffn_down."""
    p = f"blk.{l}."
    gated = silu(self._linear(f, p + "ffn_gate")) * self._linear(f, p + "ffn_up")
    return self._linear(gated, p + "ffn_down")

  def _layer(self, l: int, x: np.ndarray, positions: np.ndarray, n_past: int) -> np.ndarray:
    """One DFlash (and DSpark) decoder layer over the block x [w, n_embd]; reads layer l's
    K/V, writes nothing."""
    cfg, p = self.cfg, f"blk.{l}."
    a = rms_norm(x, self.w[p + "attn_norm"], cfg.eps)
    x = x + self._linear(self._attend(l, a, positions, n_past), p + "attn_output")
    f = rms_norm(x, self.w[p + "ffn_norm"], cfg.eps)
    return x + self._mlp(l, f)

  def _conv_sides(self, name: str, a: np.ndarray):
    """A DFlash2 convolution `name` (`blk.i.attn_conv` / `blk.i.ffn_conv`) for the sublayer
    whose normed input is a: (prepare, finish), the functions applying side 0 and side 1
    with the coefficients projected from a."""
    coef = fam.conv_coefficients(self._linear(a, name + "_proj"),
                                 self.cfg.dflash2.conv_kernel_size)
    base = self.w[name + "_base"]
    return (lambda y: fam.grouped_causal_conv(y, base[0], coef[:, 0]),
            lambda y: fam.grouped_causal_conv(y, base[1], coef[:, 1]))

  def _layer_dflash2(self, l: int, x: np.ndarray, positions: np.ndarray,
                     n_past: int) -> np.ndarray:
    """One DFlash2 layer (SPEC_dflash2_dspark 5.1): each sublayer's normed input goes through
    the prepare side of its convolution, its output through the finish side before the
    residual add; block attention follows the layer's causality and band."""
    cfg, p = self.cfg, f"blk.{l}."
    a = rms_norm(x, self.w[p + "attn_norm"], cfg.eps)
    prepare, finish = self._conv_sides(p + "attn_conv", a)
    window = self.window if cfg.is_sliding(l) else None
    visible = fam.block_visibility(x.shape[0], cfg.block_causal(l), window)
    o = self._attend(l, prepare(a), positions, n_past, visible)
    x = x + finish(self._linear(o, p + "attn_output"))
    b = rms_norm(x, self.w[p + "ffn_norm"], cfg.eps)
    prepare, finish = self._conv_sides(p + "ffn_conv", b)
    return x + finish(self._mlp(l, prepare(b)))

  def _check_block(self, id_last: int, n_past: int, width: int | None) -> tuple[int, int]:
    w = self.cfg.resolve_width(width)
    if not 0 <= int(id_last) < self.n_vocab:
      raise ValueError(f"id_last {id_last} is outside the vocab [0, {self.n_vocab})")
    if int(n_past) < 0:
      raise ValueError(f"n_past must be >= 0, got {n_past}")
    return w, int(n_past)

  def hidden(self, id_last: int, n_past: int, width: int | None = None) -> np.ndarray:
    """The final-normed hidden states [w, n_embd] of the block [id_last, mask x (w-1)] at
    positions n_past + i (w = width, default block_size; the block's own keys are its w rows
    only). DFlash2 scales every row's embedding by input_embedding_scale."""
    cfg = self.cfg
    w, n_past = self._check_block(id_last, n_past, width)
    tokens = np.full((w,), cfg.mask_token_id, np.int64)
    tokens[0] = int(id_last)
    positions = n_past + np.arange(w, dtype=np.int64)
    x = self.w["tok_embd"][tokens]
    layer = self._layer
    if cfg.family == "dflash2":
      x = _F32(cfg.dflash2.input_embedding_scale) * x
      layer = self._layer_dflash2
    for l in range(cfg.n_layer):
      x = layer(l, x, positions, n_past)
    return rms_norm(x, self.w["output_norm"], cfg.eps)

  def _output_logits(self, h: np.ndarray) -> np.ndarray:
    """h lm_head^T; DFlash2 then applies its multiplier and softcap."""
    raw = self._linear(h, "lm_head")
    if self.cfg.family != "dflash2":
      return raw
    f = self.cfg.dflash2
    return fam.logit_transform(raw, f.output_multiplier, f.final_logit_softcapping)

  def step(self, id_last: int, n_past: int, width: int | None = None) -> np.ndarray:
    """Logits [w, n_vocab] float32 of the block [id_last, mask x (w-1)] at n_past + i.

    w = width (default block_size); the block's own keys are its w rows only. DFlash2: after
    the multiplier and softcap; DSpark: the backbone's logits (`draft` adds the Markov head).
    """
    return self._output_logits(self.hidden(id_last, n_past, width))

  def draft(self, id_last: int, n_past: int, width: int | None = None,
            temperature: float = 0.0, rng: np.random.Generator | None = None) -> Draft:
    """The block's drafts by the family's rule (see `Draft`): greedy at temperature 0; at
    temperature > 0 sampled with uniforms drawn from rng, one per draft row, in row order."""
    temperature = fam.check_temperature(temperature)
    n = self.cfg.n_drafts(width)
    if temperature > 0 and not isinstance(rng, np.random.Generator):
      raise ValueError(f"temperature > 0 needs rng, a numpy Generator; got {rng!r}")
    uniforms = rng.random(n) if temperature > 0 else None
    h = self.hidden(id_last, n_past, width)
    if self.cfg.family == "dflash2":
      return self._draft_dflash2(h, id_last, temperature, uniforms)
    if self.cfg.family == "dspark":
      return self._draft_dspark(h, id_last, temperature, uniforms)
    return self._draft_dflash(h, temperature, uniforms)

  def _draft_dflash(self, h, temperature, uniforms) -> Draft:
    """SPEC.md: rows 1.. each take their argmax (or a draw from softmax(logits / T))."""
    logits = self._output_logits(h)
    rows = logits[1:]
    drafts = np.array([fam.choose(r, temperature, None if uniforms is None else uniforms[i])
                       for i, r in enumerate(rows)], np.int32)
    return Draft(logits, h, drafts, _prob_of(fam.softmax(rows), drafts),
                 q=fam.softmax(rows, temperature) if temperature > 0 else None)

  def _draft_dflash2(self, h, id_last, temperature, uniforms) -> Draft:
    """SPEC_dflash2_dspark 7: the selector walk over rows 1.. from the anchor."""
    logits = self._output_logits(h)
    g = self._linear(h[1:], "selector_hidden")
    walk = fam.selector_walk(logits[1:], g, id_last, self.w["selector_predecessor"],
                             self.w["selector_successor"], self.cfg.dflash2.selector_top_k,
                             temperature, uniforms)
    return Draft(logits, h, walk.drafts, walk.walk_prob, q=walk.q, candidates=walk.candidates,
                 scores=walk.scores, chosen=walk.chosen)

  def _draft_dspark(self, h, id_last, temperature, uniforms) -> Draft:
    """SPEC_dflash2_dspark 9, 11, 12: the Markov chain over the draft rows (all w rows with
    shifted rows), then the confidence head along the chosen path."""
    f = self.cfg.dspark
    base = self._output_logits(h)
    first = self.cfg.first_draft_row
    chain = fam.markov_chain(base[first:], h[first:], id_last, f.markov_head_type, self.w,
                             temperature, uniforms, self._gemm_in)
    logits = base.copy()
    logits[first:] = chain.logits
    conf = None
    if f.confidence_head:
      e = self.w["markov_w1"][chain.prevs] if f.confidence_with_markov else None
      conf = fam.confidence(h[first:], e, self.w["conf_proj"], self.w["conf_proj.bias"],
                            self._gemm_in)
    return Draft(logits, h, chain.drafts, _prob_of(fam.softmax(chain.logits), chain.drafts),
                 q=fam.softmax(chain.logits, temperature) if temperature > 0 else None,
                 base=base, conf=conf)

  def drafts(self, logits: np.ndarray) -> np.ndarray:
    """DFlash's greedy drafts int32 [w-1] from rows 1.. (row 0 unused); ties to the lowest id.
    DFlash2 and DSpark drafts are not per-row argmaxes: `draft` gives them."""
    if self.cfg.family != "dflash":
      raise ValueError(f"drafts(logits) is DFlash's rule; a {self.cfg.family!r} drafter's drafts "
                       f"come from draft(id_last, n_past, ...)")
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[1] != self.n_vocab:
      raise ValueError(f"logits must be [w, {self.n_vocab}], got shape {logits.shape}")
    self.cfg.resolve_width(logits.shape[0])
    return np.argmax(logits[1:], axis=-1).astype(np.int32)

  def accept(self, drafts: np.ndarray, target_tokens: np.ndarray) -> int:
    """Number of leading drafts that equal the target's own choices."""
    return first_mismatch(drafts, target_tokens)


def _prob_of(probs: np.ndarray, tokens: np.ndarray) -> np.ndarray:
  """probs[i, tokens[i]] for each row i."""
  return np.take_along_axis(probs, np.asarray(tokens, np.int64)[:, None], axis=-1)[:, 0]
