"""Thin stateful wrappers over the functional core (they hold params and the ring):
DFlashDrafter for one sequence, BatchedDrafter for S sequences in the slots of a batched ring.

They validate host-side inputs before any state changes, keep the donated ring private (the
caller never holds a stale, deleted buffer), and DFlashDrafter compiles the block step ahead of
time.
Inputs that are already device arrays are not pulled back to the host for validation, except
features (checked for NaN/Inf, one device reduction) and positions (needed on the host to
track what the ring holds).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import FULL, DFlashConfig
from dflash_jax.dispatch import KernelPolicy
from dflash_jax.drafter import step as S
from dflash_jax.drafter.weights import prepare_weights
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
  check for any n_rows). Batched: x [S, R, F] and n_rows [S] -> the flat index s R + r of the
  first bad row of any slot (rows r < n_rows[s])."""
  bad = ~jnp.isfinite(x).all(axis=-1) & (jnp.arange(x.shape[-2]) < n_rows[..., None])
  bad = bad.reshape(-1)
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


class _Drafter:
  """What both wrappers share: construction (kernel limits before the weights' work), the
  ring, host checks of features, positions and capacity, encode and accept."""

  def __init__(self, cfg: DFlashConfig, w: dict[str, np.ndarray], dtype: Any, ring_dtype: Any,
               window: int | None, impl: str, q8_0_blocks: dict | None, check_finite: bool,
               capacity: int | None, n_slots: int | None, policy: KernelPolicy):
    S.kernels(impl)   # rejects an unknown impl before any work
    self.cfg = cfg
    self.impl = impl
    # The NaN/Inf check of features is one device reduction and a host sync per call.
    self.check_finite = check_finite
    self._ring = (S.init_ring(cfg, window, ring_dtype, capacity) if n_slots is None else
                  S.init_batched_ring(cfg, n_slots, window, ring_dtype, capacity))
    if impl == "pallas":   # what the kernels cannot run fails here, before the weights' work
      limits.check_drafter(n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim,
                           width=cfg.block_size,
                           ring_slots=[c.slots for c in self._ring.caches()])
    self.params = prepare_weights(cfg, w, dtype, q8_0_blocks, policy)
    self.n_vocab = self.params.n_vocab
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

  def _check_capacity(self, highest: int, where: str = "") -> None:
    """A full-attention cache stores position p in slot p: p must be < capacity."""
    c = self.capacity
    if c is not None and highest >= c:
      raise ValueError(f"{where}position {highest} does not fit the full_attention cache "
                       f"(layers {list(self.cfg.layers_of(FULL))} hold positions < capacity "
                       f"{c}; construct the drafter with a larger capacity)")

  def _check_feature_shape(self, f: jax.Array, lead: int) -> None:
    want = ["S"] * (lead - 2) + ["T" if lead == 2 else "R", str(self.cfg.n_embd_fc)]
    if f.ndim != lead or f.shape[-1] != self.cfg.n_embd_fc:
      raise ValueError(f"features must be [{', '.join(want)}] (n_target_layers "
                       f"{self.cfg.n_target_layers} x n_embd {self.cfg.n_embd}), got {list(f.shape)}")
    if not jnp.issubdtype(f.dtype, jnp.floating):
      raise ValueError(f"features must be floating point, got {f.dtype}")

  def _check_features(self, features, n_rows: int | None = None, where: str = "") -> jax.Array:
    """features [T, n_target_layers n_embd], floating, rows < n_rows (default all) finite."""
    f = jnp.asarray(features)
    self._check_feature_shape(f, 2)
    n_rows = f.shape[0] if n_rows is None else n_rows
    if self.check_finite and f.shape[0]:
      row = int(_first_bad_row(f, n_rows))
      if row >= 0:
        raise ValueError(f"{where}features row {row} holds NaN or Inf: one poisoned row would "
                         "poison the ring")
    return f

  def _check_h(self, h) -> jax.Array:
    h = jnp.asarray(h)
    if h.ndim != 2 or h.shape[1] != self.cfg.n_embd:
      raise ValueError(f"h must be [T, {self.cfg.n_embd}] (from encode), got {list(h.shape)}")
    if not jnp.issubdtype(h.dtype, jnp.floating):
      raise ValueError(f"h must be floating point, got {h.dtype}")
    return h

  def _check_positions(self, positions, n_rows: int, where: str = "") -> np.ndarray:
    """n_rows integer positions in [0, max_n_past] that the caches can hold."""
    pos = np.asarray(positions)
    if pos.shape != (n_rows,) or not np.issubdtype(pos.dtype, np.integer):
      raise ValueError(f"{where}positions must be {n_rows} integers (one per row of h), "
                       f"got {pos.dtype}{list(pos.shape)}")
    if pos.size and (pos.min() < 0 or pos.max() > self.max_n_past):
      raise ValueError(f"{where}positions must lie in [0, {self.max_n_past}], "
                       f"got [{pos.min()}, {pos.max()}]")
    if pos.size:
      self._check_capacity(int(pos.max()), where)
    return pos

  def _check_id_last(self, tok: int | None, where: str = "") -> None:
    if tok is not None and not 0 <= tok < self.n_vocab:
      raise ValueError(f"{where}id_last {tok} is outside the vocab [0, {self.n_vocab})")

  def _check_n_past(self, n: int | None, max_position: int, where: str = "") -> None:
    if n is None:
      return
    if n < 0 or n > self.max_n_past:
      raise ValueError(f"{where}n_past {n} out of range [0, {self.max_n_past}]")
    if n <= max_position:
      raise ValueError(f"{where}n_past {n} is not past the injected positions (the highest is "
                       f"{max_position}); n_past counts the committed tokens before id_last")

  def encode(self, features) -> jax.Array:
    return S.encode_jit(self.params, self._check_features(features), impl=self.impl)

  def accept(self, drafts, target_tokens) -> jax.Array:
    """Agreeing prefix length; target_tokens may carry extra trailing entries (the bonus token
    after the last draft), which are not compared. drafts [n] -> scalar, [B, n] -> [B]."""
    d, t = jnp.asarray(drafts), jnp.asarray(target_tokens)
    if (d.ndim not in (1, 2) or t.ndim != d.ndim or t.shape[:-1] != d.shape[:-1]
        or t.shape[-1] < d.shape[-1]):
      raise ValueError(f"drafts [n] or [B, n] and target_tokens with at least n entries per row "
                       f"needed, got {list(d.shape)} and {list(t.shape)}")
    t = t[..., :d.shape[-1]]
    if not (jnp.issubdtype(d.dtype, jnp.integer) and jnp.issubdtype(t.dtype, jnp.integer)):
      raise ValueError(f"drafts and target_tokens must be integer, got {d.dtype} and {t.dtype}")
    return S.accept_jit(d, t, impl=self.impl)


class DFlashDrafter(_Drafter):
  """dtype: 'fp32' | 'bf16' | 'fp8' | 'q8_0' weights (q8_0_blocks: `read_q8_0(path)` to keep a
  Q8_0 GGUF's blocks as stored); ring_dtype: 'fp32' | 'bf16'; window: the sliding layers'
  ring size (default the file's, else 2048); capacity: positions the full-attention layers'
  cache holds (default cfg.context_length, else 8192; injecting past it is an error);
  check_finite=False skips the NaN/Inf check of features (a device reduction and host sync
  per call); policy: the kernel routing (`dflash_jax.dispatch.KernelPolicy`, default the
  shipped one). Usage:

    m = DFlashDrafter(cfg, w, dtype="bf16", ring_dtype="bf16")
    m.inject(m.encode(features), positions)
    step = m.capture_step()                    # or capture_step(width=w), 2 <= w <= block_size
    logits = step(id_last, n_past)
    n_ok = m.accept(logits[1:].argmax(-1), target_tokens)
  """

  def __init__(self, cfg: DFlashConfig, w: dict[str, np.ndarray], dtype: Any = "fp32",
               ring_dtype: Any = "fp32", window: int | None = None, impl: str = "pallas",
               q8_0_blocks: dict | None = None, check_finite: bool = True,
               capacity: int | None = None, policy: KernelPolicy = KernelPolicy()):
    super().__init__(cfg, w, dtype, ring_dtype, window, impl, q8_0_blocks, check_finite,
                     capacity, None, policy)
    self.max_position = -1   # highest position injected so far (host bookkeeping)

  def inject(self, h, positions) -> None:
    h = self._check_h(h)
    pos = self._check_positions(positions, h.shape[0])
    if not pos.size:
      return
    self._ring = S.inject_jit(self.params, self._ring, h, jnp.asarray(pos, jnp.int32),
                              impl=self.impl)
    self.max_position = max(self.max_position, int(pos.max()))

  def _check_step_args(self, id_last, n_past) -> None:
    self._check_id_last(_host_int(id_last, "id_last"))
    self._check_n_past(_host_int(n_past, "n_past"), self.max_position)

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

  def draft_round(self, new_features, n_new: int, id_last, n_past, width: int | None = None):
    """Encode + inject the rows committed since the last round, then draft a block of
    w = width rows (default block_size): one dispatch.

    new_features [R, n_target_layers n_embd] (R static, padded); rows 0..n_new-1 go to positions
    n_past - n_new .. n_past - 1. Returns (drafts [n], logits [w, V]): the family's greedy
    drafts (n = cfg.n_drafts(w): w - 1, or w for DSpark's shifted rows) and output logits.
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


def _host_ints(x, n: int, what: str, required: bool = True) -> np.ndarray | None:
  """[n] integers from the host; a device array gives None (not synced) where the values
  are optional, and is an error where they are required."""
  if isinstance(x, jax.Array):
    if not required and x.shape == (n,) and jnp.issubdtype(x.dtype, jnp.integer):
      return None
    raise ValueError(f"{what} must be [{n}] host integers (one per slot), got a device array "
                     f"{x.dtype}{list(x.shape)}")
  a = np.asarray(x)
  if a.shape != (n,) or not np.issubdtype(a.dtype, np.integer):
    raise ValueError(f"{what} must be [{n}] host integers (one per slot), got "
                     f"{a.dtype}{list(a.shape)}")
  return a.astype(np.int64)


class BatchedDrafter(_Drafter):
  """S = max_batch independent sequences over one set of weights, each in a slot of a batched
  ring (SPEC.md section 6): one jitted call drafts for every slot. The other arguments are
  DFlashDrafter's (window and capacity are per slot). Usage:

    m = BatchedDrafter(cfg, w, max_batch=8, dtype="bf16", ring_dtype="bf16")
    m.join(slot, prompt_features)              # empty the slot, inject rows at 0..T-1, activate
    drafts, logits = m.draft_round(new_feats, n_new, id_last, n_past)   # [S, w-1], [S, w, V]
    n_ok = m.accept(drafts, target_tokens)     # [S] on device
    m.leave(slot)                              # empty it, deactivate

  new_feats [S, R, F] (R static, padded), n_new, id_last, n_past [S]: slot s's rows
  0..n_new[s]-1 go to positions n_past[s] - n_new[s] .. n_past[s] - 1, then it drafts after
  id_last[s] at n_past[s]. Only the active (joined) slots are checked, injected and drafted;
  the others' entries are ignored (their drafts and logits are those of an empty sequence).
  Every check (slot ids, shapes, positions, capacity, vocab, NaN/Inf features naming the slot
  and row, width) runs on the host before any state changes. One compilation per (S, width)
  serves every join, leave and activity pattern (and one per prompt length for join).
  """

  def __init__(self, cfg: DFlashConfig, w: dict[str, np.ndarray], max_batch: int,
               dtype: Any = "fp32", ring_dtype: Any = "fp32", window: int | None = None,
               impl: str = "pallas", q8_0_blocks: dict | None = None, check_finite: bool = True,
               capacity: int | None = None, policy: KernelPolicy = KernelPolicy()):
    super().__init__(cfg, w, dtype, ring_dtype, window, impl, q8_0_blocks, check_finite,
                     capacity, max_batch, policy)
    self.max_batch = self._ring.batch_slots
    self._active = np.zeros(self.max_batch, bool)
    self._max_position = np.full(self.max_batch, -1, np.int64)

  @property
  def active(self) -> np.ndarray:
    """[S] bool: the slots holding a sequence (a copy)."""
    return self._active.copy()

  @property
  def max_position(self) -> np.ndarray:
    """[S] int: each slot's highest injected position, -1 for an empty slot (a copy)."""
    return self._max_position.copy()

  def _slot(self, slot) -> int:
    s = _host_int(slot, "slot")
    if s is None or not 0 <= s < self.max_batch:
      raise ValueError(f"slot must be a host integer in [0, {self.max_batch}) (max_batch "
                       f"{self.max_batch}), got {slot!r}")
    return s

  def _active_slot(self, slot) -> int:
    s = self._slot(slot)
    if not self._active[s]:
      raise ValueError(f"slot {s} holds no sequence (join it first)")
    return s

  def join(self, slot, features=None, positions=None) -> None:
    """Start a sequence in an empty slot: clear it and inject the prompt's features [T, F]
    (none: an empty context) at `positions` (default 0..T-1)."""
    s = self._slot(slot)
    if self._active[s]:
      raise ValueError(f"slot {s} already holds a sequence (leave or reset it first)")
    h = pos = None
    if features is not None:
      f = self._check_features(features, where=f"slot {s}: ")
      pos = self._check_positions(np.arange(f.shape[0]) if positions is None else positions,
                                  f.shape[0], f"slot {s}: ")
      h = S.encode_jit(self.params, f, impl=self.impl)
    self._ring = S.reset_slot_jit(self._ring, jnp.int32(s))
    self._max_position[s] = -1
    self._active[s] = True
    if pos is not None and pos.size:
      self._inject(s, h, pos)

  def leave(self, slot) -> None:
    """End the sequence in `slot`: its caches are cleared and it drafts no more."""
    s = self._active_slot(slot)
    self._ring = S.reset_slot_jit(self._ring, jnp.int32(s))
    self._active[s] = False
    self._max_position[s] = -1

  def reset(self, slot) -> None:
    """Empty an active slot's caches (the sequence restarts with no context)."""
    s = self._active_slot(slot)
    self._ring = S.reset_slot_jit(self._ring, jnp.int32(s))
    self._max_position[s] = -1

  def inject(self, slot, h, positions) -> None:
    """Store h [T, n_embd] (from encode) at `positions` in an active slot's caches."""
    s = self._active_slot(slot)
    h = self._check_h(h)
    pos = self._check_positions(positions, h.shape[0], f"slot {s}: ")
    if pos.size:
      self._inject(s, h, pos)

  def _inject(self, s: int, h: jax.Array, pos: np.ndarray) -> None:
    self._ring = S.inject_slot_jit(self.params, self._ring, jnp.int32(s), h,
                                   jnp.asarray(pos, jnp.int32), impl=self.impl)
    self._max_position[s] = max(self._max_position[s], int(pos.max()))

  def _check_steps(self, id_last, n_past) -> tuple[jax.Array, np.ndarray]:
    """Per active slot: id_last in the vocab (when given on the host), n_past in range and
    past the slot's injected positions."""
    n = self.max_batch
    toks = _host_ints(id_last, n, "id_last", required=False)
    n_past = _host_ints(n_past, n, "n_past")
    for s in np.flatnonzero(self._active):
      self._check_id_last(None if toks is None else int(toks[s]), f"slot {s}: ")
      self._check_n_past(int(n_past[s]), int(self._max_position[s]), f"slot {s}: ")
    # Inactive slots' entries are ignored; zeros keep them in int32 range.
    n_past = np.where(self._active, n_past, 0)
    if toks is not None:
      id_last = np.where(self._active, toks, 0)
    return jnp.asarray(id_last, jnp.int32), n_past

  def step(self, id_last, n_past, width: int | None = None) -> jax.Array:
    """Logits [S, w, V] of every active slot's block [id_last[s], mask x (w-1)] at n_past[s]
    (w = width, default block_size; each width compiles once). The ring is not written."""
    w = self.cfg.resolve_width(width)
    toks, n_past = self._check_steps(id_last, n_past)
    return S.block_step_batched_jit(self.params, self._ring, toks, jnp.asarray(n_past, jnp.int32),
                                    jnp.asarray(self._active), width=w, impl=self.impl)

  def draft_round(self, new_features, n_new, id_last, n_past, width: int | None = None):
    """Every active slot's round in one dispatch: inject its n_new[s] new rows, then draft a
    block of w = width rows (default block_size). Returns (drafts [S, n], logits [S, w, V])
    on device (the family's greedy drafts, n = cfg.n_drafts(w))."""
    w = self.cfg.resolve_width(width)
    f = jnp.asarray(new_features)
    self._check_feature_shape(f, 3)
    n, r = self.max_batch, f.shape[1]
    if f.shape[0] != n or r < 1:
      raise ValueError(f"features must have one block of R >= 1 rows per slot: [{n}, R, "
                       f"{self.cfg.n_embd_fc}], got {list(f.shape)}")
    n_new = _host_ints(n_new, n, "n_new")
    toks, n_past = self._check_steps(id_last, n_past)
    live = np.where(self._active, n_new, 0)
    for s in np.flatnonzero(self._active):
      if not 0 <= n_new[s] <= r:
        raise ValueError(f"slot {s}: n_new {n_new[s]} must lie in [0, {r}] (rows per slot)")
      if n_past[s] - n_new[s] < 0:
        raise ValueError(f"slot {s}: n_past {n_past[s]} - n_new {n_new[s]} < 0: the new rows "
                         "would sit at negative positions")
      if n_new[s]:
        self._check_capacity(int(n_past[s]) - 1, f"slot {s}: ")
    if self.check_finite:
      bad = int(_first_bad_row(f, jnp.asarray(live, jnp.int32)))
      if bad >= 0:
        raise ValueError(f"features slot {bad // r} row {bad % r} holds NaN or Inf: one "
                         "poisoned row would poison the ring")
    self._ring, drafts, logits = S.draft_round_batched_jit(
        self.params, self._ring, f, jnp.asarray(live, jnp.int32), toks,
        jnp.asarray(n_past, jnp.int32), jnp.asarray(self._active), width=w, impl=self.impl)
    grew = self._active & (live > 0)
    self._max_position[grew] = np.maximum(self._max_position[grew], n_past[grew] - 1)
    return drafts, logits
