"""Batches of sequences (SPEC.md section 6): the batched ring, draft_round_batched and
BatchedDrafter against the unbatched step and against one DFlashRef per slot."""
import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from benchmarks.common import count_compiles, random_params
from dflash_jax.dispatch import KernelPolicy
from dflash_jax.drafter import step as S
from reference import DFlashRef
from test_step import (BF16_TOL, CFG, FP32_TOL, VOCAB, _assert_drafts_match, _pallas_calls,
                       _weights)

SLIDE, FULL = dfj.config.SLIDING, dfj.config.FULL
R = CFG.block_size               # rows of new features per slot (a round commits <= w rows)
WIDTH = 5
# Four slots: slot 0's prefill wraps its 32-slot ring, slot 2 starts empty and gets its first
# rows in the round, slot 3 is inactive (its entries below are garbage it must ignore).
PREFILL = (45, 10, 0, 20)
N_NEW = (3, 8, 4, 2)
ID_LAST = (5, 300, 7, 9)
ACTIVE = (True, True, True, False)


def _tree_np(tree):
  return jax.tree.map(np.asarray, tree)


def _slot(tree, s: int):
  return jax.tree.map(lambda a: a[s], tree)


def _stack(trees):
  return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def _prefilled_rings(params, impl, prefill=PREFILL, seed=0):
  """One unbatched ring per slot holding prefill[s] random rows at 0.. (one compiled inject:
  rows padded to the longest prefill, the rest masked by n_valid)."""
  t = max(prefill)
  rings = []
  for s, n in enumerate(prefill):
    feats = jnp.asarray(dfj.synthetic_features(CFG, t, seed=seed + s))
    ring = dfj.init_ring(CFG, ring_dtype="bf16")
    rings.append(S.inject_jit(params, ring, S.encode_jit(params, feats, impl=impl),
                              jnp.arange(t, dtype=jnp.int32), n, impl=impl))
  return rings


def _round_inputs(seed=10, n_new=N_NEW, id_last=ID_LAST, prefill=PREFILL, active=ACTIVE):
  new = np.stack([dfj.synthetic_features(CFG, R, seed=seed + s) for s in range(len(prefill))])
  n_past = np.asarray(prefill) + np.asarray(n_new)
  return (jnp.asarray(new), jnp.asarray(n_new, jnp.int32), jnp.asarray(id_last, jnp.int32),
          jnp.asarray(n_past, jnp.int32), jnp.asarray(active))


def _batched_round(params, rings, inputs, impl, width=WIDTH):
  """draft_round_batched on a copy of the stacked rings (the inputs stay usable)."""
  ring, drafts, logits = S.draft_round_batched_jit(params, _copy(_stack(rings)), *inputs,
                                                   width=width, impl=impl)
  return _tree_np(ring), np.asarray(drafts), np.asarray(logits)


@pytest.fixture(scope="module", params=["pallas", "xla"])
def case(request):
  """bf16 weights and rings; the batched round of 4 slots and the unbatched round of each
  active slot on its own ring (computed once per impl)."""
  impl = request.param
  params = dfj.prepare_weights(CFG, _weights(seed=1), "bf16")
  rings = _prefilled_rings(params, impl)
  inputs = _round_inputs()
  batched = _batched_round(params, rings, inputs, impl)
  new, n_new, id_last, n_past, _ = inputs
  single = {}
  for s in np.flatnonzero(ACTIVE):
    ring, drafts, logits = S.draft_round_jit(params, _copy(rings[s]), new[s], n_new[s],
                                             id_last[s], n_past[s], width=WIDTH, impl=impl)
    single[s] = (_tree_np(ring), np.asarray(drafts), np.asarray(logits))
  return dict(impl=impl, params=params, rings=rings, inputs=inputs, batched=batched,
              single=single)


def test_batched_round_equals_unbatched_per_slot(case):
  """Every active slot's drafts, logits and ring equal the unbatched round on its own ring:
  to rounding (the GEMMs see 4 x 5 rows here, 5 there, so summation order and bf16 roundings
  may differ), drafts equal where the top-2 gap is clear."""
  ring, drafts, logits = case["batched"]
  assert drafts.shape == (4, WIDTH - 1) and logits.shape == (4, WIDTH, VOCAB)
  got, want = [], []
  for s, (ring_1, drafts_1, logits_1) in case["single"].items():
    chex.assert_trees_all_close(logits[s], logits_1, **BF16_TOL)
    got.append(logits[s])
    want.append(logits_1)
    for c, c1 in zip(_slot(ring, s).caches(), ring_1.caches(), strict=True):
      np.testing.assert_array_equal(c.pos, c1.pos)
      for a, b in ((c.k, c1.k), (c.v, c1.v)):   # bf16 storage: one rounding apart at most
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2.0 ** -7, atol=1e-6)
  _assert_drafts_match(got, want, BF16_TOL)
  # The drafts returned are the argmax of the logits returned.
  np.testing.assert_array_equal(drafts, np.argmax(logits[:, 1:], -1))


def test_inactive_slot_ring_is_bitwise_unchanged(case):
  ring = case["batched"][0]
  chex.assert_trees_all_equal(_slot(ring, 3), _tree_np(case["rings"][3]))


def test_one_slot_batch_is_bitwise_the_unbatched_round(case):
  """S = 1: the same GEMM row counts and the same kernels (a grid axis of one is squeezed)."""
  new, n_new, id_last, n_past, _ = case["inputs"]
  for s in (0, 2):
    one = tuple(a[s:s + 1] for a in (new, n_new, id_last, n_past)) + (jnp.array([True]),)
    ring, drafts, logits = _batched_round(case["params"], [case["rings"][s]], one, case["impl"])
    ring_1, drafts_1, logits_1 = case["single"][s]
    np.testing.assert_array_equal(logits[0], logits_1)
    np.testing.assert_array_equal(drafts[0], drafts_1)
    chex.assert_trees_all_equal(_slot(ring, 0), ring_1)


def test_slot_isolation(case):
  """A slot's drafts, logits and ring are bitwise the same whatever every other slot holds:
  other rings, features (NaN and Inf included), id_last, n_past, n_new and activity."""
  params, impl = case["params"], case["impl"]
  ring, drafts, logits = case["batched"]
  new, n_new, id_last, n_past, active = case["inputs"]
  other_rings = _prefilled_rings(params, impl, prefill=(7, 45, 33, 1), seed=50)
  rng = np.random.default_rng(0)
  poison = np.asarray(new).copy()
  poison[:, 1, 3], poison[:, 2, 0] = np.nan, np.inf
  for keep in (0, 2):   # the first slot and one in the middle
    others = [s for s in range(4) if s != keep]
    rings = [case["rings"][s] if s == keep else other_rings[s] for s in range(4)]
    mix = lambda a, b: jnp.where(jnp.arange(4).reshape((4,) + (1,) * (a.ndim - 1)) == keep,
                                 a, b)
    inputs = (mix(new, jnp.asarray(poison)),
              mix(n_new, jnp.asarray(rng.integers(0, R + 1, 4), jnp.int32)),
              mix(id_last, jnp.asarray(rng.integers(0, VOCAB, 4), jnp.int32)),
              mix(n_past, jnp.asarray([50, 60, 45, 70], jnp.int32)),
              mix(active, jnp.asarray([s in others[:2] for s in range(4)])))
    ring_p, drafts_p, logits_p = _batched_round(params, rings, inputs, impl)
    np.testing.assert_array_equal(logits_p[keep], logits[keep])
    np.testing.assert_array_equal(drafts_p[keep], drafts[keep])
    chex.assert_trees_all_equal(_slot(ring_p, keep), _slot(ring, keep))
    # The slots made inactive here kept their (other) rings bitwise.
    for s in others[2:]:
      chex.assert_trees_all_equal(_slot(ring_p, s), _tree_np(rings[s]))


def test_inactive_slot_outputs_depend_on_none_of_its_inputs(case):
  """An inactive slot drafts the empty sequence: its drafts and logits are the same for any
  ring and inputs it holds (so nothing about it can be observed through them)."""
  ring, drafts, logits = case["batched"]
  new, n_new, id_last, n_past, active = case["inputs"]
  rings = list(case["rings"])
  rings[3] = _prefilled_rings(case["params"], case["impl"], prefill=(1, 1, 1, 45), seed=70)[3]
  inputs = (new.at[3].set(-new[3]), n_new.at[3].set(7), id_last.at[3].set(411),
            n_past.at[3].set(99), active)
  ring_p, drafts_p, logits_p = _batched_round(case["params"], rings, inputs, case["impl"])
  np.testing.assert_array_equal(logits_p[3], logits[3])
  np.testing.assert_array_equal(drafts_p[3], drafts[3])
  chex.assert_trees_all_equal(_slot(ring_p, 3), _tree_np(rings[3]))


def _launches(fn, *args):
  return sorted(_pallas_calls(fn, *args))


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_one_launch_per_kernel_for_all_slots(dtype):
  """The batched round traces to the unbatched round's launches, whatever S: every GEMM takes
  all S x w rows in one launch and each per-sequence kernel runs once with the slot as a grid
  axis (no loop over slots). Past the policy's skinny_max_m rows the bf16 GEMMs move to XLA's
  GEMM; fp8 weights stay on the skinny kernel at any row count where there is no batched GEMM
  (a CPU)."""
  mixed = dataclasses.replace(CFG, layer_types=(SLIDE, FULL))
  params = dfj.prepare_weights(mixed, _weights(mixed), dtype)
  skinny_max_m = params.policy.skinny_max_m
  one = dfj.init_ring(mixed, capacity=64)
  feats = jnp.zeros((R, mixed.n_embd_fc), jnp.float32)
  unbatched = _launches(lambda p, r: S.draft_round(p, r, feats, 3, 1, 20, width=WIDTH), params,
                        one)
  assert unbatched.count("inject") == 2 and unbatched.count("ring_attn_partial") == 2
  # S slots within skinny_max_m rows both for the step (S w) and for encode + inject (S R),
  # and S slots past it for both.
  all_skinny, none_skinny = skinny_max_m // max(WIDTH, R), skinny_max_m // min(WIDTH, R) + 1
  assert all_skinny >= 2
  for n in (1, all_skinny, none_skinny):
    ring = S.init_batched_ring(mixed, n, capacity=64)
    v = jnp.ones((n,), jnp.int32)
    batched = _launches(lambda p, r: S.draft_round_batched(
        p, r, jnp.zeros((n, R, mixed.n_embd_fc)), v, v, 20 * v, v > 0, width=WIDTH), params, ring)
    if dtype == "fp8" or n <= all_skinny:
      assert batched == unbatched, (n, batched)
    else:   # every bf16 GEMM of the step and of encode + inject on XLA's
      assert batched == [c for c in unbatched if not c.startswith("skinny_matmul")], batched


def test_reset_slot_is_pure_and_compiles_once():
  """reset_slot empties one slot (pos -1, K/V 0: a fresh slot) and leaves the others bitwise;
  the slot id is traced: one compilation for every slot."""
  cfg = dataclasses.replace(CFG, layer_types=(SLIDE, FULL))
  params = dfj.prepare_weights(cfg, _weights(cfg), "bf16")
  ring = S.init_batched_ring(cfg, 3, ring_dtype="bf16", capacity=48)
  t = 40
  h = S.encode_jit(params, jnp.asarray(np.stack([dfj.synthetic_features(cfg, t, seed=s)
                                                 for s in range(3)]).reshape(3 * t, -1)))
  ring = S.inject_batched_jit(params, ring, h.reshape(3, t, -1),
                              jnp.tile(jnp.arange(t, dtype=jnp.int32), (3, 1)),
                              jnp.array([40, 25, 7], jnp.int32), impl="xla")
  assert [int((np.asarray(c.pos) >= 0).sum()) for c in ring.caches()] == [32 + 25 + 7, 72]
  empty = _tree_np(S.init_batched_ring(cfg, 3, ring_dtype="bf16", capacity=48))
  with count_compiles() as first:
    ring = S.reset_slot_jit(ring, jnp.int32(1))
  with count_compiles() as later:
    for slot in (2, 0):
      ring = S.reset_slot_jit(ring, jnp.int32(slot))
      after = _tree_np(ring)
      chex.assert_trees_all_equal(_slot(after, slot), _slot(empty, slot))
  assert any("reset_slot" in n for n in first) and later == [], (first, later)
  chex.assert_trees_all_equal(_tree_np(ring), empty)


# ------------------------------------------------------- BatchedDrafter against DFlashRef
SCHED = dataclasses.replace(CFG, layer_types=(SLIDE, FULL), window=16)
CAPACITY = 160


def _assert_slot_matches(m, s, ref, tol):
  """Slot s's caches equal ref's (positions exactly, K/V within tol); an empty ref: the
  slot's caches are empty (pos -1, K/V 0)."""
  for cache, (k, v, pos) in ((m.ring.sliding, (ref.ring_k, ref.ring_v, ref.ring_pos)),
                             (m.ring.full, (ref.cache_k, ref.cache_v, ref.cache_pos))):
    np.testing.assert_array_equal(np.asarray(cache.pos[s]), pos)
    chex.assert_trees_all_close(np.asarray(cache.k[s], np.float32), k, **tol)
    chex.assert_trees_all_close(np.asarray(cache.v[s], np.float32), v, **tol)


# (impl, rounds, prompt lengths): interpret-mode Pallas compiles one inject per prompt length.
@pytest.mark.parametrize("impl,rounds,prompts", [("pallas", 10, (40, 40)), ("xla", 24, (12, 40))])
def test_join_leave_reset_schedule_matches_reference(impl, rounds, prompts):
  """Sequences join, leave and reset slots while the others draft: every active slot's
  logits equal its own DFlashRef (fp32, tight), drafts on clear margins, the 16-slot
  sliding rings wrap and the full-attention caches fill; at the end every slot's caches
  equal its reference's. After a first pass through every operation (both prompt lengths,
  every slot), the rest of the schedule compiles nothing."""
  w = _weights(SCHED, seed=4)
  m = dfj.BatchedDrafter(SCHED, w, max_batch=3, impl=impl, capacity=CAPACITY)
  refs = [DFlashRef(SCHED, w, capacity=CAPACITY) for _ in range(3)]
  rng = np.random.default_rng(7)
  n_past = np.zeros(3, np.int64)
  id_last = np.zeros(3, np.int64)
  n_new = np.zeros(3, np.int64)
  pending = np.zeros((3, R, SCHED.n_embd_fc), np.float32)
  got, want, events = [], [], []
  # A scripted start (every operation on every slot once), then random events.
  short, long = prompts
  script = {0: [("join", 0, long), ("join", 1, short)], 2: [("join", 2, short)],
            3: [("leave", 1)], 4: [("reset", 0), ("join", 1, long)], 6: [("leave", 2)],
            7: [("join", 2, long)]}
  warm = max(script) + 1

  def apply(op, s, t=None):
    events.append(op)
    if op == "join":
      feats = dfj.synthetic_features(SCHED, t, seed=int(rng.integers(1 << 30)))
      m.join(s, feats)
      refs[s].reset()
      refs[s].inject(refs[s].encode(feats), np.arange(t))
      n_past[s], n_new[s], id_last[s] = t, 0, rng.integers(VOCAB)
    elif op == "leave":
      m.leave(s)
      refs[s].reset()
    else:   # reset: the sequence goes on from n_past with an empty context
      m.reset(s)
      refs[s].reset()
      n_new[s] = 0

  def one_round(r):
    for ev in script.get(r, []):
      apply(*ev)
    if r >= warm:
      for s in range(3):
        u = rng.random()
        if not m.active[s] and u < 0.5:
          apply("join", s, int(rng.choice(prompts)))
        elif m.active[s] and u < 0.08:
          apply("leave", s)
        elif m.active[s] and u < 0.14:
          apply("reset", s)
    drafts, logits = m.draft_round(pending, n_new, id_last, n_past, width=WIDTH)
    drafts, logits = np.asarray(drafts), np.asarray(logits)
    for s in np.flatnonzero(m.active):
      ref_logits = refs[s].step(int(id_last[s]), int(n_past[s]), WIDTH)
      chex.assert_trees_all_close(logits[s], ref_logits, **FP32_TOL)
      got.append(logits[s])
      want.append(ref_logits)
      n_ok = int(rng.integers(0, WIDTH))
      pending[s] = dfj.synthetic_features(SCHED, R, seed=int(rng.integers(1 << 30)))
      n_new[s] = n_ok + 1
      refs[s].inject(refs[s].encode(pending[s, :n_ok + 1]), n_past[s] + np.arange(n_ok + 1))
      id_last[s] = rng.integers(VOCAB)                 # the target's correction or bonus
      n_past[s] += n_ok + 1

  for r in range(warm):
    one_round(r)
  with count_compiles() as compiled:
    for r in range(warm, rounds):
      one_round(r)
  assert compiled == [], compiled
  assert {"join", "leave", "reset"} <= set(events)
  m.draft_round(pending, n_new, id_last, n_past, width=WIDTH)   # injects the last rows
  for s in range(3):
    if not m.active[s]:
      refs[s].reset()
    _assert_slot_matches(m, s, refs[s], FP32_TOL)
  assert n_past.max() > long + SCHED.resolve_window()   # the rounds wrapped a ring
  _assert_drafts_match(got, want, FP32_TOL)


def test_batched_drafter_checks_inputs_before_any_state_change():
  cfg = dataclasses.replace(CFG, layer_types=(SLIDE, FULL))
  m = dfj.BatchedDrafter(cfg, _weights(cfg), max_batch=4, impl="xla", capacity=32)
  assert (m.max_batch, m.window, m.capacity) == (4, 32, 32)
  feats = dfj.synthetic_features(cfg, 20)
  m.join(0, feats)
  m.join(1)                                            # an empty context
  m.join(2, feats[:5], positions=np.arange(5) + 3)
  np.testing.assert_array_equal(m.active, [True, True, True, False])
  np.testing.assert_array_equal(m.max_position, [19, -1, 7, -1])
  snapshot = lambda: (_tree_np(m.ring), m.active, m.max_position)
  before = snapshot()
  new = np.zeros((4, R, cfg.n_embd_fc), np.float32)
  ok = dict(new_features=new, n_new=np.array([2, 0, 1, 0]), id_last=np.array([1, 2, 3, 4]),
            n_past=np.array([22, 0, 9, 0]))

  def round_with(**kw):
    return lambda: m.draft_round(**(ok | kw))

  nan_row = new.copy()
  nan_row[2, 0, 5] = np.nan
  f_dim = cfg.n_embd_fc
  cases = [
      (lambda: m.join(4, feats), r"slot must be a host integer in \[0, 4\)"),
      (lambda: m.join(-1, feats), r"slot must be a host integer in \[0, 4\)"),
      (lambda: m.join(jnp.int32(3), feats), "slot must be a host integer"),
      (lambda: m.join(0, feats), "slot 0 already holds a sequence"),
      (lambda: m.leave(3), "slot 3 holds no sequence"),
      (lambda: m.reset(3), "slot 3 holds no sequence"),
      (lambda: m.inject(3, m.encode(feats), np.arange(20)), "slot 3 holds no sequence"),
      (lambda: m.join(3, feats, positions=np.arange(20) + 13),
       r"slot 3: position 32 does not fit the full_attention cache .*capacity 32"),
      (lambda: m.join(3, np.where(np.arange(20)[:, None] == 4, np.inf, feats)),
       "slot 3: features row 4 holds NaN or Inf"),
      (lambda: m.inject(2, m.encode(feats[:3]), np.array([1, 2])), "slot 2: positions must be 3"),
      (round_with(n_past=np.array([22, 0, 7, 0])), "slot 2: n_past 7 is not past the injected "
       r"positions \(the highest is 7\)"),
      (round_with(n_past=np.array([33, 0, 9, 0])), r"slot 0: position 32 does not fit"),
      (round_with(n_new=np.array([2, 0, R + 1, 0])),
       rf"slot 2: n_new {R + 1} must lie in \[0, {R}\]"),
      (round_with(n_new=np.array([2, 3, 1, 0]), n_past=np.array([22, 2, 9, 0])),
       r"slot 1: n_past 2 - n_new 3 < 0"),
      (round_with(id_last=np.array([1, 2, VOCAB, 4])),
       rf"slot 2: id_last {VOCAB} is outside the vocab"),
      (round_with(n_past=np.array([22, 0, 9])), r"n_past must be \[4\] host integers"),
      (round_with(n_past=jnp.array([22, 0, 9, 0])), r"n_past must be \[4\] host integers .*device"),
      (round_with(new_features=new[:2]), r"features must have one block of R >= 1 rows per slot"),
      (round_with(new_features=new[..., 1:]), rf"features must be \[S, R, {f_dim}\]"),
      (round_with(new_features=nan_row), "features slot 2 row 0 holds NaN or Inf"),
      (lambda: m.draft_round(**ok, width=R + 1), r"width must be an int in \[2, block_size 8\]"),
      (lambda: m.step(ok["id_last"], ok["n_past"], width=1), "width must be"),
      (lambda: m.step(ok["id_last"], np.array([19, 0, 9, 0])), "slot 0: n_past 19 is not past"),
  ]
  for fn, msg in cases:
    with pytest.raises(ValueError, match=msg):
      fn()
    chex.assert_trees_all_equal(snapshot(), before)
  # The empty slot 3's entries are ignored, NaN features there and in padding rows included.
  poisoned = new.copy()
  poisoned[3] = np.nan
  poisoned[0, 2:] = np.inf                              # rows past n_new[0] = 2
  drafts, logits = m.draft_round(poisoned, np.array([2, 0, 1, 5]), np.array([1, 2, 3, -4]),
                                 np.array([22, 0, 9, -9]))
  assert drafts.shape == (4, R - 1) and np.isfinite(np.asarray(logits)).all()
  np.testing.assert_array_equal(m.max_position, [21, -1, 8, -1])
  np.testing.assert_array_equal(np.asarray(m.accept(drafts, drafts)), [R - 1] * 4)
  m.leave(1)
  m.join(1, feats[:3])
  np.testing.assert_array_equal(m.max_position, [21, 2, 8, -1])


# ----------------------------------------------------------------------------- GPU, real dims
SEED2 = dataclasses.replace(dfj.SEED_CONFIG, n_layer=2)


def _seed_case(dtype: str, prefill: tuple[int, ...], widths: tuple[int, ...]) -> dict:
  """A seed-dims (2-layer) drafter with random device weights; one ring per prefill length
  (some past the 2048-slot window); the unbatched round of every slot at each width."""
  params = random_params(SEED2, 8192, dtype)
  n_slots, t = len(prefill), max(prefill)
  feats = dfj.synthetic_features(SEED2, t + 16 * n_slots, seed=1)
  rings = []
  for s, n in enumerate(prefill):
    ring = dfj.init_ring(SEED2, ring_dtype="bf16")
    rows = jnp.asarray(feats[s * 16: s * 16 + t])
    rings.append(S.inject_jit(params, ring, S.encode_jit(params, rows),
                              jnp.arange(t, dtype=jnp.int32), n))
  rng = np.random.default_rng(2)
  new = jnp.asarray(np.stack([feats[s * 16:(s + 1) * 16] for s in range(n_slots)]) * 0.5)
  n_new = jnp.asarray(rng.integers(1, 17, n_slots), jnp.int32)
  id_last = jnp.asarray(rng.integers(0, 8192, n_slots), jnp.int32)
  n_past = jnp.asarray(prefill, jnp.int32) + n_new
  single = {}
  for width in widths:
    for s in range(n_slots):
      ring, drafts, logits = S.draft_round_jit(params, _copy(rings[s]), new[s], n_new[s],
                                               id_last[s], n_past[s], width=width)
      single[width, s] = (_tree_np(ring), np.asarray(drafts), np.asarray(logits))
  return dict(params=params, rings=rings, inputs=(new, n_new, id_last, n_past), single=single)


@pytest.fixture(scope="module")
def seed_case():
  """bf16 weights, 8 slots, widths 16 and 8, computed once."""
  return _seed_case("bf16", (2100, 300, 2048, 17, 1500, 2200, 64, 900), (16, 8))


@pytest.fixture(scope="module")
def seed_case_fp8():
  """fp8 weights, 16 slots at width 16 (up to 256 rows), computed once."""
  return _seed_case("fp8", (2100, 300, 2048, 17, 1500, 2200, 64, 900,
                            40, 2049, 700, 1999, 5, 1234, 2300, 333), (16,))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,n_slots,width", [
    ("bf16", 1, 16), ("bf16", 4, 16), ("bf16", 8, 16), ("bf16", 8, 8),
    ("fp8", 2, 16), ("fp8", 8, 16), ("fp8", 16, 16)])
def test_gpu_batched_round_equals_unbatched(request, dtype, n_slots, width):
  """Real dims: S = 1's 16 rows run on the skinny GEMM, bf16 past skinny_max_m on XLA's or the
  batched GEMM, fp8 at 32 and 128 rows on the batched GEMM's K-split warpgroups and at 256 on
  its row-split ones; every slot equals its unbatched round (S = 1: the same launches, so to
  float32 rounding at most), drafts on clear margins."""
  seed_case = request.getfixturevalue("seed_case" if dtype == "bf16" else "seed_case_fp8")
  new, n_new, id_last, n_past = seed_case["inputs"]
  inputs = tuple(a[:n_slots] for a in (new, n_new, id_last, n_past)) + (
      jnp.ones((n_slots,), bool),)
  ring, drafts, logits = _batched_round(seed_case["params"], seed_case["rings"][:n_slots],
                                        inputs, "pallas", width)
  tol = dict(atol=1e-5, rtol=1e-5) if n_slots == 1 else BF16_TOL
  got, want = [], []
  for s in range(n_slots):
    ring_1, drafts_1, logits_1 = seed_case["single"][width, s]
    chex.assert_trees_all_close(logits[s], logits_1, **tol)
    got.append(logits[s])
    want.append(logits_1)
    for c, c1 in zip(_slot(ring, s).caches(), ring_1.caches(), strict=True):
      np.testing.assert_array_equal(c.pos, c1.pos)
      # Another GEMM row count sums in another order (skinny tiles or XLA's), and K of a
      # near-zero entry can land a few bf16 steps of its own magnitude away: an absolute bound
      # on K's O(1) scale (measured on the H200: at most 2^-10 off).
      k_tol = dict(rtol=2.0 ** -7, atol=1e-6 if n_slots == 1 else 2.0 ** -8)
      np.testing.assert_allclose(np.asarray(c.k, np.float32), np.asarray(c1.k, np.float32),
                                 **k_tol)
  # Random seed-dim weights leave few rows with a top-2 gap over 2 x BF16_TOL (10-22 of 56-120
  # on the H200): at least one clear row per slot.
  _assert_drafts_match(got, want, tol, min_clear=n_slots)


@pytest.mark.gpu
def test_gpu_slot_isolation_and_inactive_slots(seed_case):
  """Compiled on the GPU: slot 5's outputs and ring are bitwise the same when every other
  slot's ring, inputs and activity change; the inactive slots' rings are bitwise unchanged."""
  params, rings = seed_case["params"], seed_case["rings"]
  new, n_new, id_last, n_past = seed_case["inputs"]
  base = _batched_round(params, rings, (new, n_new, id_last, n_past, jnp.ones(8, bool)), "pallas")
  perm = [1, 2, 3, 4, 0, 5, 7, 6]                     # slot 5 keeps its own everything
  active = jnp.asarray([s % 3 != 0 or s == 5 for s in range(8)])
  poison = new.at[jnp.arange(8) != 5, 3, 7].set(jnp.nan)
  ring_p, drafts_p, logits_p = _batched_round(
      params, [rings[p] for p in perm],
      (poison[jnp.asarray(perm)], n_new[::-1].at[5].set(n_new[5]),
       (id_last + 11).at[5].set(id_last[5]), n_past[jnp.asarray(perm)], active), "pallas")
  np.testing.assert_array_equal(logits_p[5], base[2][5])
  np.testing.assert_array_equal(drafts_p[5], base[1][5])
  chex.assert_trees_all_equal(_slot(ring_p, 5), _slot(base[0], 5))
  for s in np.flatnonzero(~np.asarray(active)):
    chex.assert_trees_all_equal(_slot(ring_p, s), _tree_np(rings[perm[s]]))


@pytest.mark.gpu
def test_gpu_batched_round_aliases_ring_without_copy(seed_case):
  params = seed_case["params"]
  ring = S.init_batched_ring(SEED2, 4, ring_dtype="bf16")
  v = jnp.ones((4,), jnp.int32)
  args = (params, ring, jnp.zeros((4, 16, SEED2.n_embd_fc), jnp.float32), v, v, 20 * v, v > 0)
  compiled = S.draft_round_batched_jit.lower(*args).compile()
  hlo = compiled.as_text()
  assert " copy(" not in hlo and "copy-start" not in hlo
  assert compiled.memory_analysis().alias_size_in_bytes == sum(
      x.nbytes for x in jax.tree.leaves(ring))
  ptrs = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(ring)]
  new_ring, _, _ = S.draft_round_batched_jit(*args)
  assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(new_ring)] == ptrs


# A drafter whose attention fits ring_attention_mgpu (64 packed rows: block 16 x G 4, head_dim
# 64, a 128-slot window of two 64-slot chunks at 4 slots x 1 kv head).
MGPU_CFG = dataclasses.replace(dfj.TINY_CONFIG, n_layer=2, n_head=4, n_head_kv=1, head_dim=64,
                               block_size=16, window=128)
# The shipped routing with the Mosaic GPU kernels claimed for the attention only (the batched
# GEMM, which has no CPU path either, stays off).
MGPU_ATTENTION = KernelPolicy(mosaic_gpu=True, batched_bf16_rows=None, batched_fp8_rows=None)


def _fake_mosaic_attention(calls: list):
  """A stand-in for `ring_attention_mgpu.ring_attention_batched` on the CPU: records each
  call's static arguments and slot count, and returns the jnp twin on the parts' sums (q /
  sqrt(D) scaled back), so a wrong operand order, scale, layer or window shows."""
  from pallas_kernels import ring_attention as RA

  def fake(q0, q1, k0, k1, v0, v1, ring_k, ring_v, ring_pos, n_past, *, layer, window, splits,
           steps, out_dtype):
    calls.append(dict(layer=layer, window=window, splits=splits, steps=steps,
                      out_dtype=out_dtype, slots=(q0.shape[0], ring_k.shape[0], n_past.shape[0])))
    f32 = lambda a, b: a.astype(jnp.float32) + b.astype(jnp.float32)
    q = f32(q0, q1) * np.sqrt(q0.shape[-1])
    twin = functools.partial(RA.ring_attention_reference, layer=layer, window=window,
                             out_dtype=out_dtype)
    return jax.vmap(twin)(q, f32(k0, k1), f32(v0, v1), ring_k, ring_v, ring_pos, n_past)

  return fake


def test_batched_step_routes_attention_to_mosaic_gpu_kernel(monkeypatch):
  """The routing and the wiring of the Mosaic GPU attention, on the CPU: under a policy that
  claims the Mosaic GPU kernels, 4 slots take ring_attention_mgpu with qk_norm_rope's bf16
  parts. The kernel is replaced by the jnp twin on the parts' sum (q / sqrt(D) scaled back; the
  kernel has no CPU path), so a wrong operand order, scale, layer or window shows against the
  Triton kernels' round (interpret mode)."""
  from pallas_kernels import ring_attention_mgpu as AM
  cfg = MGPU_CFG
  params = dfj.prepare_weights(cfg, dfj.synthetic_drafter(cfg, seed=4, n_vocab=VOCAB), "bf16")
  n = 4
  rng = np.random.default_rng(6)
  feats = jnp.asarray(rng.standard_normal((n, cfg.block_size, cfg.n_embd_fc)), jnp.float32)
  n_new = jnp.asarray([16, 9, 3, 16], jnp.int32)
  id_last = jnp.asarray(rng.integers(0, VOCAB, n), jnp.int32)
  active = jnp.ones((n,), bool)
  calls = []
  fake = _fake_mosaic_attention(calls)

  def rounds(params):
    ring = S.init_batched_ring(cfg, n, ring_dtype="bf16")
    outs = []
    for r in range(3):   # 150+ positions per slot: the 128-slot ring wraps
      n_past = jnp.asarray([16, 9, 3, 16], jnp.int32) * (r + 1) + 40 * r
      ring, drafts, logits = S.draft_round_batched(params, ring, feats * (1 + r), n_new,
                                                   id_last, n_past, active, impl="pallas")
      outs.append(np.asarray(logits))
    return outs

  monkeypatch.setattr(AM, "ring_attention_batched", fake)
  # No Mosaic GPU kernels: the Triton kernels (interpret mode).
  want = rounds(params.replace(policy=KernelPolicy(mosaic_gpu=False)))
  assert not calls
  got = rounds(params.replace(policy=MGPU_ATTENTION))
  assert len(calls) == 3 * cfg.n_layer
  assert [c["layer"] for c in calls[:cfg.n_layer]] == list(range(cfg.n_layer))
  assert all(c["window"] == cfg.window and c["splits"] == 128 // (n * cfg.n_head_kv)
             and c["steps"] == 2 and c["out_dtype"] == jnp.bfloat16
             and c["slots"] == (n, n, n) for c in calls)
  for g, w in zip(got, want, strict=True):
    chex.assert_trees_all_close(g, w, **BF16_TOL)
  # The policy's slot range: past it (or with none) the Triton kernels run again.
  calls.clear()
  rounds(params.replace(policy=dataclasses.replace(MGPU_ATTENTION, mgpu_attention_seqs=(1, 3))))
  rounds(params.replace(policy=dataclasses.replace(MGPU_ATTENTION, mgpu_attention_seqs=None)))
  assert not calls


def test_one_sequence_step_routes_attention_to_mosaic_gpu_kernel(monkeypatch):
  """The unbatched step's wiring of the Mosaic GPU attention (a batch of one slot), on the
  CPU: under a policy that claims the Mosaic GPU kernels and the kernel replaced by the jnp
  twin on the parts' sum, three draft rounds (the ring wraps) match the Triton kernels' rounds
  (interpret mode)."""
  from pallas_kernels import ring_attention_mgpu as AM
  cfg = MGPU_CFG
  params = dfj.prepare_weights(cfg, dfj.synthetic_drafter(cfg, seed=5, n_vocab=VOCAB), "bf16")
  rng = np.random.default_rng(8)
  feats = jnp.asarray(rng.standard_normal((cfg.block_size, cfg.n_embd_fc)), jnp.float32)
  calls = []
  fake = _fake_mosaic_attention(calls)

  def rounds(params):
    ring = S.init_ring(cfg, ring_dtype="bf16")
    outs = []
    for r in range(3):
      ring, drafts, logits = S.draft_round(params, ring, feats * (1 + r), 16,
                                           int(rng.integers(0, VOCAB)), 60 * r + 16,
                                           impl="pallas")
      outs.append(np.asarray(logits))
    return outs

  monkeypatch.setattr(AM, "ring_attention_batched", fake)
  rng = np.random.default_rng(8)
  want = rounds(params.replace(policy=KernelPolicy(mosaic_gpu=False)))
  assert not calls
  rng = np.random.default_rng(8)
  got = rounds(params.replace(policy=MGPU_ATTENTION))
  assert [c["layer"] for c in calls] == list(range(cfg.n_layer)) * 3
  assert all(c["window"] == cfg.window and c["splits"] == 128 // cfg.n_head_kv
             and c["out_dtype"] == jnp.bfloat16 and c["slots"] == (1, 1, 1) for c in calls)
  for g, w in zip(got, want, strict=True):
    chex.assert_trees_all_close(g, w, **BF16_TOL)
