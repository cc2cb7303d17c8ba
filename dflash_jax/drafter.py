"""DFlashDrafter: a thin stateful wrapper over the functional core (holds params and the ring).

It validates host-side inputs before any state changes, keeps the donated ring private (the
caller never holds a stale, deleted buffer), and compiles the block step ahead of time.
Inputs that are already device arrays are not pulled back to the host for validation, except
features (checked for NaN/Inf, one device reduction) and positions (needed on the host to
track what the ring holds).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import step as S
from dflash_jax.config import FULL, DFlashConfig
from dflash_jax.params import prepare_weights
from pallas_kernels import limits

_INT32_MAX = np.iinfo(np.int32).max


def _host_int(x, what: str) -> int | None:
  """A Python/numpy integer scalar as int; None for device arrays (not synced)."""
  if isinstance(x, jax.Array):
    if x.ndim != 0 or not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{what} must be an integer scalar, got {x.dtype}{list(x.shape)}")
    return None
  a = np.asarray(x)
  if a.ndim != 0 or not np.issubdtype(a.dtype, np.integer):
    raise ValueError(f"{what} must be an integer scalar, got {x!r}")
  return int(a)


@jax.jit
def _first_bad_row(x: jax.Array, n_rows: jax.Array) -> jax.Array:
  """Index of the first of x's first n_rows rows holding NaN/Inf, -1 if none (one compiled
  check for any n_rows)."""
  bad = ~jnp.isfinite(x).all(axis=-1) & (jnp.arange(x.shape[0]) < n_rows)
  return jnp.where(bad.any(), jnp.argmax(bad), -1)


class CapturedStep:
  """The AOT-compiled block step bound to a drafter: step(id_last, n_past) -> logits [w, V]."""

  def __init__(self, drafter: "DFlashDrafter", compiled, width: int):
    self._drafter = drafter
    self.compiled = compiled
    self.width = width

  def __call__(self, id_last, n_past) -> jax.Array:
    d = self._drafter
    d._check_step_args(id_last, n_past)
    return self.compiled(d.params, d.ring, jnp.asarray(id_last, jnp.int32),
                         jnp.asarray(n_past, jnp.int32))


class DFlashDrafter:
  """dtype: 'fp32' | 'bf16' | 'fp8' | 'q8_0' weights (q8_0_blocks: `read_q8_0(path)` to keep a
  Q8_0 GGUF's blocks as stored); ring_dtype: 'fp32' | 'bf16'; window: the sliding layers'
  ring size (default the file's, else 2048); capacity: positions the full-attention layers'
  cache holds (default cfg.context_length, else 8192; injecting past it is an error);
  check_finite=False skips the NaN/Inf check of features (a device reduction and host sync
  per call). Usage:

    m = DFlashDrafter(cfg, w, dtype="bf16", ring_dtype="bf16")
    m.inject(m.encode(features), positions)
    step = m.capture_step()                    # or capture_step(width=w), 2 <= w <= block_size
    logits = step(id_last, n_past)
    n_ok = m.accept(logits[1:].argmax(-1), target_tokens)
  """

  def __init__(self, cfg: DFlashConfig, w: dict[str, np.ndarray], dtype: Any = "fp32",
               ring_dtype: Any = "fp32", window: int | None = None, impl: str = "pallas",
               q8_0_blocks: dict | None = None, check_finite: bool = True,
               capacity: int | None = None):
    S.kernels(impl)   # rejects an unknown impl before any work
    self.cfg = cfg
    self.impl = impl
    # The NaN/Inf check of features is one device reduction and a host sync per call.
    self.check_finite = check_finite
    self._ring = S.init_ring(cfg, window, ring_dtype, capacity)
    if impl == "pallas":   # what the kernels cannot run fails here, before the weights' work
      limits.check_drafter(n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim,
                           width=cfg.block_size,
                           ring_slots=[c.slots for c in self._ring.caches()])
    self.params = prepare_weights(cfg, w, dtype, q8_0_blocks)
    self.n_vocab = self.params.n_vocab
    self.max_position = -1   # highest position injected so far (host bookkeeping)
    # The highest position a step may start at: its w <= block_size rows stay int32.
    self.max_n_past = _INT32_MAX - cfg.block_size

  @property
  def ring(self) -> S.RingState:
    """The current ring. Do not keep it across inject calls: inject donates it."""
    return self._ring

  @property
  def window(self) -> int | None:
    """The sliding layers' window (None when no layer slides)."""
    return self._ring.window

  @property
  def capacity(self) -> int | None:
    """Positions the full-attention cache holds (None when no layer has full attention)."""
    return self._ring.capacity

  def _check_capacity(self, highest: int) -> None:
    """A full-attention cache stores position p in slot p: p must be < capacity."""
    c = self.capacity
    if c is not None and highest >= c:
      raise ValueError(f"position {highest} does not fit the full_attention cache (layers "
                       f"{list(self.cfg.layers_of(FULL))} hold positions < capacity {c}; "
                       f"construct the drafter with a larger capacity)")

  def _check_features(self, features, n_rows: int | None = None) -> jax.Array:
    """features [T, n_target_layers n_embd], floating, rows < n_rows (default all) finite."""
    f = jnp.asarray(features)
    if f.ndim != 2 or f.shape[1] != self.cfg.n_embd_fc:
      raise ValueError(f"features must be [T, {self.cfg.n_embd_fc}] (n_target_layers "
                       f"{self.cfg.n_target_layers} x n_embd {self.cfg.n_embd}), got {list(f.shape)}")
    if not jnp.issubdtype(f.dtype, jnp.floating):
      raise ValueError(f"features must be floating point, got {f.dtype}")
    n_rows = f.shape[0] if n_rows is None else n_rows
    if self.check_finite:
      row = int(_first_bad_row(f, n_rows))
      if row >= 0:
        raise ValueError(f"features row {row} holds NaN or Inf: one poisoned row would poison "
                         "the ring")
    return f

  def encode(self, features) -> jax.Array:
    return S.encode_jit(self.params, self._check_features(features), impl=self.impl)

  def inject(self, h, positions) -> None:
    h = jnp.asarray(h)
    if h.ndim != 2 or h.shape[1] != self.cfg.n_embd:
      raise ValueError(f"h must be [T, {self.cfg.n_embd}] (from encode), got {list(h.shape)}")
    if not jnp.issubdtype(h.dtype, jnp.floating):
      raise ValueError(f"h must be floating point, got {h.dtype}")
    pos = np.asarray(positions)
    if pos.shape != (h.shape[0],) or not np.issubdtype(pos.dtype, np.integer):
      raise ValueError(f"positions must be {h.shape[0]} integers (one per row of h), "
                       f"got {pos.dtype}{list(pos.shape)}")
    if pos.size and (pos.min() < 0 or pos.max() > self.max_n_past):
      raise ValueError(f"positions must lie in [0, {self.max_n_past}], "
                       f"got [{pos.min()}, {pos.max()}]")
    if not pos.size:
      return
    self._check_capacity(int(pos.max()))
    self._ring = S.inject_jit(self.params, self._ring, h, jnp.asarray(pos, jnp.int32),
                              impl=self.impl)
    self.max_position = max(self.max_position, int(pos.max()))

  def _check_step_args(self, id_last, n_past) -> None:
    tok = _host_int(id_last, "id_last")
    if tok is not None and not 0 <= tok < self.n_vocab:
      raise ValueError(f"id_last {tok} is outside the vocab [0, {self.n_vocab})")
    n = _host_int(n_past, "n_past")
    if n is not None:
      if n < 0 or n > self.max_n_past:
        raise ValueError(f"n_past {n} out of range [0, {self.max_n_past}]")
      if n <= self.max_position:
        raise ValueError(f"n_past {n} is not past the injected positions (the highest is "
                         f"{self.max_position}); n_past counts the committed tokens before id_last")

  def capture_step(self, width: int | None = None) -> CapturedStep:
    """Compile the block step of `width` rows (default block_size) ahead of time (the XLA
    executable plays the CUDA graph's role)."""
    w = self.cfg.resolve_width(width)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    compiled = S.block_step_jit.lower(self.params, self._ring, scalar, scalar, width=w,
                                      impl=self.impl).compile()
    return CapturedStep(self, compiled, w)

  def step(self, id_last, n_past, width: int | None = None) -> jax.Array:
    """Logits [w, V] of the block [id_last, mask x (w-1)] at n_past.. (w = width, default
    block_size; each width compiles once)."""
    w = self.cfg.resolve_width(width)
    self._check_step_args(id_last, n_past)
    return S.block_step_jit(self.params, self._ring, jnp.asarray(id_last, jnp.int32),
                            jnp.asarray(n_past, jnp.int32), width=w, impl=self.impl)

  def accept(self, drafts, target_tokens) -> jax.Array:
    """Agreeing prefix length; target_tokens may carry extra trailing entries (the bonus token
    after the last draft), which are not compared."""
    d, t = jnp.asarray(drafts), jnp.asarray(target_tokens)
    if (d.ndim not in (1, 2) or t.ndim != d.ndim or t.shape[:-1] != d.shape[:-1]
        or t.shape[-1] < d.shape[-1]):
      raise ValueError(f"drafts [n] or [B, n] and target_tokens with at least n entries per row "
                       f"needed, got {list(d.shape)} and {list(t.shape)}")
    t = t[..., :d.shape[-1]]
    if not (jnp.issubdtype(d.dtype, jnp.integer) and jnp.issubdtype(t.dtype, jnp.integer)):
      raise ValueError(f"drafts and target_tokens must be integer, got {d.dtype} and {t.dtype}")
    return S.accept_jit(d, t, impl=self.impl)

  def draft_round(self, new_features, n_new: int, id_last, n_past, width: int | None = None):
    """Encode + inject the rows committed since the last round, then draft a block of
    w = width rows (default block_size): one dispatch.

    new_features [R, n_target_layers n_embd] (R static, padded); rows 0..n_new-1 go to positions
    n_past - n_new .. n_past - 1. Returns (drafts [w-1], logits [w, V]).
    """
    w = self.cfg.resolve_width(width)
    n_new_i = _host_int(n_new, "n_new")
    n = _host_int(n_past, "n_past")
    if n_new_i is None or n is None:
      raise ValueError("draft_round takes host integers for n_new and n_past")
    if not 0 <= n_new_i <= np.shape(new_features)[0]:
      raise ValueError(f"n_new {n_new_i} must lie in [0, {np.shape(new_features)[0]}]")
    if n - n_new_i < 0:
      raise ValueError(f"n_past {n} - n_new {n_new_i} < 0: the new rows would sit at negative positions")
    f = self._check_features(new_features, n_new_i)
    self._check_step_args(id_last, n)
    if n_new_i:
      self._check_capacity(n - 1)
    self._ring, drafts, logits = S.draft_round_jit(
        self.params, self._ring, f, jnp.int32(n_new_i), jnp.asarray(id_last, jnp.int32),
        jnp.int32(n), width=w, impl=self.impl)
    if n_new_i:
      self.max_position = max(self.max_position, n - 1)
    return drafts, logits
