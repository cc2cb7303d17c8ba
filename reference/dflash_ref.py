"""Eager numpy float32 DFlash drafter: SPEC.md section 3, written to be read.

Every kernel and jitted path is certified against this module, so it favours the plainest
possible statement of each operation over speed. All arithmetic is float32; bf16 modes only
round stored values and GEMM inputs (SPEC.md section 5).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from dflash_jax.config import DFlashConfig, drafter_tensor_shapes, rope_inv_freq

_F32 = np.float32
_PRECISIONS = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
  """x / sqrt(mean(x^2) + eps) * w over the last axis (per head when x is [..., H, D])."""
  x = np.asarray(x, _F32)
  ms = np.mean(x * x, axis=-1, keepdims=True)
  return x / np.sqrt(ms + _F32(eps)) * np.asarray(w, _F32)


def rope_neox(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
  """NEOX (rotate-half) rope of x [..., T, H, D] at positions [T].

  The angle is float32(pos) * inv_freq in float32, exactly as kernels compute it, so that
  kernels and reference agree tightly even at large positions.
  """
  x = np.asarray(x, _F32)
  half = x.shape[-1] // 2
  angle = np.asarray(positions).astype(_F32)[:, None] * np.asarray(inv_freq, _F32)[None, :]
  cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]  # [T, 1, D/2] over heads
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
              window: int | None) -> np.ndarray:
  """Block attention over the visible stored slots plus ALL block keys (non-causal).

  q [T, Hq, D]; k_ring, v_ring [Hkv, S, D]; ring_pos [S]; k_blk, v_blk [T, Hkv, D]; window
  None for a full-attention layer. Query head h reads kv head h // G (contiguous GQA groups).
  Returns [T, Hq, D] float32.
  """
  t, hq, d = q.shape
  hkv = k_ring.shape[0]
  g = hq // hkv
  keys = np.concatenate([k_ring, np.transpose(k_blk, (1, 0, 2))], axis=1).astype(_F32)
  vals = np.concatenate([v_ring, np.transpose(v_blk, (1, 0, 2))], axis=1).astype(_F32)
  visible = np.concatenate(
      [ring_visibility(ring_pos, n_past, window, t), np.ones((t, t), bool)], axis=1)
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


class DFlashRef:
  """One sequence's drafter state: weights plus every layer's stored K/V.

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
    self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta)
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
    shapes = drafter_tensor_shapes(cfg)
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
    return out

  def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
    """x @ W^T with W in (out, in) layout; a bf16 GEMM sees its input rounded to bf16."""
    if self.dtype == "bf16":
      x = round_bf16(x)
    return np.asarray(x, _F32) @ self.w[name].T

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
      k = rope_neox(rms_norm(k, self.w[f"blk.{l}.attn_k_norm"], cfg.eps), pos, self.inv_freq)
      store_k[i][:, slots] = self._store(k).transpose(1, 0, 2)
      store_v[i][:, slots] = self._store(v).transpose(1, 0, 2)
    store_pos[slots] = pos

  def _layer(self, l: int, x: np.ndarray, positions: np.ndarray, n_past: int) -> np.ndarray:
    """One decoder layer over the block x [w, n_embd]; reads layer l's K/V, writes nothing."""
    cfg, p = self.cfg, f"blk.{l}."
    b = x.shape[0]
    a = rms_norm(x, self.w[p + "attn_norm"], cfg.eps)
    q = self._linear(a, p + "attn_q").reshape(b, cfg.n_head, cfg.head_dim)
    k = self._linear(a, p + "attn_k").reshape(b, cfg.n_head_kv, cfg.head_dim)
    v = self._linear(a, p + "attn_v").reshape(b, cfg.n_head_kv, cfg.head_dim)
    q = rope_neox(rms_norm(q, self.w[p + "attn_q_norm"], cfg.eps), positions, self.inv_freq)
    k = rope_neox(rms_norm(k, self.w[p + "attn_k_norm"], cfg.eps), positions, self.inv_freq)
    stored_k, stored_v, stored_pos, window = self.layer_kv(l)
    o = attention(q, stored_k, stored_v, stored_pos, k, v, n_past, window)
    x = x + self._linear(o.reshape(b, -1), p + "attn_output")
    f = rms_norm(x, self.w[p + "ffn_norm"], cfg.eps)
    gated = silu(self._linear(f, p + "ffn_gate")) * self._linear(f, p + "ffn_up")
    return x + self._linear(gated, p + "ffn_down")

  def step(self, id_last: int, n_past: int, width: int | None = None) -> np.ndarray:
    """Logits [w, n_vocab] float32 of the block [id_last, mask x (w-1)] at n_past + i.

    w = width (default block_size); the block's own keys are its w rows only.
    """
    cfg = self.cfg
    w = cfg.resolve_width(width)
    if not 0 <= int(id_last) < self.n_vocab:
      raise ValueError(f"id_last {id_last} is outside the vocab [0, {self.n_vocab})")
    if int(n_past) < 0:
      raise ValueError(f"n_past must be >= 0, got {n_past}")
    n_past = int(n_past)
    tokens = np.full((w,), cfg.mask_token_id, np.int64)
    tokens[0] = int(id_last)
    positions = n_past + np.arange(w, dtype=np.int64)
    x = self.w["tok_embd"][tokens]
    for l in range(cfg.n_layer):
      x = self._layer(l, x, positions, n_past)
    return self._linear(rms_norm(x, self.w["output_norm"], cfg.eps), "lm_head")

  def drafts(self, logits: np.ndarray) -> np.ndarray:
    """Greedy drafts int32 [w-1] from rows 1.. (row 0 unused); ties to the lowest id."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[1] != self.n_vocab:
      raise ValueError(f"logits must be [w, {self.n_vocab}], got shape {logits.shape}")
    self.cfg.resolve_width(logits.shape[0])
    return np.argmax(logits[1:], axis=-1).astype(np.int32)

  def accept(self, drafts: np.ndarray, target_tokens: np.ndarray) -> int:
    """Number of leading drafts that equal the target's own choices."""
    return first_mismatch(drafts, target_tokens)
