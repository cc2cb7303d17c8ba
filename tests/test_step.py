"""The jitted drafter (functional core + DFlashDrafter) against the float32 reference."""
import dataclasses
import functools
import glob
import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from dflash_jax.drafter import step as S
from reference import DFlashRef

CFG = dataclasses.replace(dfj.TINY_CONFIG, window=32)
VOCAB = 512
# fp32 path vs the fp32 reference: only summation order differs.
FP32_TOL = dict(atol=1e-4, rtol=1e-4)
# bf16 paths vs the reference rounded the same way agree to ~1e-6 until a float32-level
# difference flips one bf16 rounding of a GEMM input; a flip moves some logits by up to ~3e-2 (seen in the loop test).
BF16_TOL = dict(atol=5e-2, rtol=0.0)
PRECISIONS = [("fp32", "fp32"), ("bf16", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")]


def _weights(cfg=CFG, seed=0):
  return dfj.synthetic_drafter(cfg, seed=seed, n_vocab=VOCAB)


def _tol(dtype, ring_dtype):
  return FP32_TOL if (dtype, ring_dtype) == ("fp32", "fp32") else BF16_TOL


def _assert_drafts_match(logits, ref_logits, tol, min_clear: int | None = None):
  """Greedy drafts equal wherever the reference's top-2 gap is clear of the tolerance.

  logits, ref_logits: one block's [w, V], or lists of blocks whose draft rows are pooled
  (narrow blocks have too few rows to count on a clear gap in each). min_clear: the clear rows
  needed for the check to count (default a third of the rows)."""
  if not isinstance(logits, list):
    logits, ref_logits = [logits], [ref_logits]
  ref = np.concatenate([np.asarray(r)[1:] for r in ref_logits])
  top2 = np.sort(ref, axis=-1)[:, -2:]
  # Both logits move by at most the tolerance, so a gap over twice it cannot flip the order.
  clear = (top2[:, 1] - top2[:, 0]) > 2 * (tol["atol"] + tol["rtol"] * np.abs(top2[:, 1]))
  got = np.concatenate([np.asarray(S.greedy_drafts(jnp.asarray(l))) for l in logits])
  want = np.argmax(ref, axis=-1)
  need = len(clear) // 3 if min_clear is None else min_clear
  assert clear.sum() >= need, f"{clear.sum()} rows with a clear top-2 gap, {need} needed"
  np.testing.assert_array_equal(got[clear], want[clear])


def _assert_ring_matches(m, ref, tol):
  """Each kind's device cache equals the reference's stack: slots exactly, K/V within tol."""
  for cache, (k, v, pos) in ((m.ring.sliding, (ref.ring_k, ref.ring_v, ref.ring_pos)),
                             (m.ring.full, (ref.cache_k, ref.cache_v, ref.cache_pos))):
    assert (cache is None) == (pos is None)
    if cache is not None:
      np.testing.assert_array_equal(np.asarray(cache.pos), pos)
      chex.assert_trees_all_close(np.asarray(cache.k, np.float32), k, **tol)
      chex.assert_trees_all_close(np.asarray(cache.v, np.float32), v, **tol)


def _prefilled(dtype, ring_dtype, impl, n_rows=45, seed=0):
  w = _weights(seed=seed)
  m = dfj.DFlashDrafter(CFG, w, dtype=dtype, ring_dtype=ring_dtype, impl=impl)
  ref = DFlashRef(CFG, w, dtype=dtype, ring_dtype=ring_dtype)
  feats = dfj.synthetic_features(CFG, n_rows, seed=seed + 1)
  pos = np.arange(n_rows)   # 45 rows into 32 slots: the ring wraps
  m.inject(m.encode(feats), pos)
  ref.inject(ref.encode(feats), pos)
  return m, ref


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("dtype,ring_dtype", PRECISIONS)
def test_block_step_matches_reference(dtype, ring_dtype, impl):
  m, ref = _prefilled(dtype, ring_dtype, impl)
  _assert_ring_matches(m, ref, _tol(dtype, ring_dtype))
  step = m.capture_step()
  for id_last, n_past in [(3, 45), (100, 50)]:
    logits = step(id_last, n_past)
    want = ref.step(id_last, n_past)
    chex.assert_shape(logits, (CFG.block_size, VOCAB))
    chex.assert_trees_all_close(np.asarray(logits), want, **_tol(dtype, ring_dtype))
    _assert_drafts_match(logits, want, _tol(dtype, ring_dtype))


def test_pallas_and_xla_paths_agree():
  a, _ = _prefilled("bf16", "bf16", "pallas")
  b, _ = _prefilled("bf16", "bf16", "xla")
  chex.assert_trees_all_close(np.asarray(a.step(5, 45)), np.asarray(b.step(5, 45)), **BF16_TOL)


def check_draft_round_equals_inject_then_step(cfg, w, dtype, n_prefill, exact_ring=True):
  params = dfj.prepare_weights(cfg, w, dtype)
  ring = dfj.init_ring(cfg, ring_dtype=dtype)
  feats = jnp.asarray(dfj.synthetic_features(cfg, n_prefill, seed=3))
  ring = S.inject_jit(params, ring, dfj.encode(params, feats),
                      jnp.arange(n_prefill, dtype=jnp.int32))
  new = jnp.asarray(dfj.synthetic_features(cfg, cfg.block_size, seed=4))
  n_new, n_past, id_last = 3, n_prefill + 3, 11
  ring_copy, ring_rows = jax.tree.map(jnp.copy, ring), jax.tree.map(jnp.copy, ring)
  ring_a, drafts, logits = S.draft_round_jit(params, ring, new, n_new, id_last, n_past)
  # The same padded rows with a valid count: draft_round is exactly this composition.
  positions = n_prefill + jnp.arange(cfg.block_size, dtype=jnp.int32)
  ring_b = S.inject_jit(params, ring_copy, dfj.encode(params, new), positions, n_new)
  logits_b = S.block_step_jit(params, ring_b, id_last, n_past)
  # Two XLA modules (one fused round, two separate calls) may fuse and autotune differently.
  # The GPU runs the inject kernel in both and stores the same K/V bitwise; XLA's CPU code for
  # the jnp twin differs by an ulp between the two modules on some CPUs (AVX-512).
  rings = jax.tree.map(np.asarray, ring_a), jax.tree.map(np.asarray, ring_b)
  if exact_ring:
    chex.assert_trees_all_equal(*rings)
  else:
    chex.assert_trees_all_close(*rings, atol=1e-6, rtol=1e-6)
  tol = 1e-6 if exact_ring else 2e-5   # an ulp of stored K/V moves logits of ~8 by ~1e-6
  chex.assert_trees_all_close(np.asarray(logits), np.asarray(logits_b), atol=tol, rtol=tol)
  np.testing.assert_array_equal(np.asarray(drafts), np.asarray(S.greedy_drafts(logits_b)))
  # Injecting only the n_new rows runs the projections as GEMMs of another row count, whose
  # summation order a GPU may pick differently (H200: one of 10.5M stored bf16 K values one
  # ulp apart), so that path agrees to rounding, not bitwise; downstream, such a stored value
  # can flip a bf16 rounding of a GEMM input, hence BF16_TOL on the logits (H200, seed dims:
  # 0.027 apart).
  ring_c = S.inject_jit(params, ring_rows, dfj.encode(params, new[:n_new]), positions[:n_new])
  rtol = 2.0 ** -7 if dtype == "bf16" else 1e-6
  for cache_c, cache_a in zip(ring_c.caches(), ring_a.caches(), strict=True):
    np.testing.assert_array_equal(np.asarray(cache_c.pos), np.asarray(cache_a.pos))
    for got, want in ((cache_c.k, cache_a.k), (cache_c.v, cache_a.v)):
      np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                 rtol=rtol, atol=1e-6)
  chex.assert_trees_all_close(np.asarray(S.block_step_jit(params, ring_c, id_last, n_past)),
                              np.asarray(logits), **(BF16_TOL if dtype == "bf16" else
                                                     dict(atol=1e-5, rtol=1e-6)))


def test_draft_round_equals_inject_then_step():
  check_draft_round_equals_inject_then_step(CFG, _weights(), "fp32", 20, exact_ring=False)


def check_replay_bitwise(m, id_last, n_past, replays=100):
  """The captured step replayed between unrelated jitted and eager work: bitwise identical
  logits every time, and the ring untouched."""
  step = m.capture_step()
  ring_before = jax.tree.map(np.asarray, m.ring)
  first = np.asarray(step(id_last, n_past))
  unrelated = jax.jit(lambda a: jnp.tanh(a @ a.T).sum(0))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 64), np.float32))
  for i in range(replays):
    x = x + 0.01 * unrelated(x)[None, :]          # unrelated jitted work
    _ = np.linalg.norm(np.asarray(x)) + i          # and eager host work in between
    np.testing.assert_array_equal(np.asarray(step(id_last, n_past)), first)
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, m.ring), ring_before)


def test_captured_step_replays_bitwise_and_leaves_ring_unchanged():
  m, _ = _prefilled("bf16", "bf16", "pallas")
  check_replay_bitwise(m, 7, 45)


def check_speculative_loop(cfg, w, dtype, ring_dtype, prompt, rounds, seed=5, width=None,
                           impl="pallas", ref=None, **ring_args):
  """Rounds of SPEC.md section 4 with random acceptances and blocks of `width` rows, drafter
  against the reference (ring_args: window, capacity; ref: a DFlashRef of these settings to
  reuse, emptied first)."""
  rng = np.random.default_rng(seed)
  vocab = w["tok_embd"].shape[0]
  m = dfj.DFlashDrafter(cfg, w, dtype=dtype, ring_dtype=ring_dtype, impl=impl, **ring_args)
  if ref is None:
    ref = DFlashRef(cfg, w, dtype=dtype, ring_dtype=ring_dtype, **ring_args)
  ref.reset()
  bsz = cfg.resolve_width(width)
  feats = dfj.synthetic_features(cfg, prompt - 1, seed=9)
  m.inject(m.encode(feats), np.arange(prompt - 1))
  ref.inject(ref.encode(feats), np.arange(prompt - 1))
  id_last, n_past, n_new = 42, prompt - 1, 0
  pending = np.zeros((bsz, cfg.n_embd_fc), np.float32)
  tol = _tol(dtype, ring_dtype)
  for r in range(rounds):
    drafts, logits = m.draft_round(pending, n_new, id_last, n_past, width=width)
    want_logits = ref.step(id_last, n_past, width)
    chex.assert_trees_all_close(np.asarray(logits), want_logits, **tol)
    ref_drafts = ref.drafts(want_logits)
    n_ok = int(rng.integers(0, bsz))
    target = ref_drafts.copy()
    if n_ok < bsz - 1:
      target[n_ok] = (target[n_ok] + 1) % vocab
    assert int(m.accept(ref_drafts, target)) == ref.accept(ref_drafts, target) == n_ok
    pending = dfj.synthetic_features(cfg, bsz, seed=100 + r)
    n_new = n_ok + 1
    ref.inject(ref.encode(pending[:n_new]), n_past + np.arange(n_new))
    n_past += n_new
    id_last = int(target[n_ok]) if n_ok < bsz - 1 else int(rng.integers(vocab))
  drafts, logits = m.draft_round(pending, n_new, id_last, n_past, width=width)   # injects the last round's rows
  _assert_ring_matches(m, ref, tol)
  chex.assert_trees_all_close(np.asarray(logits), ref.step(id_last, n_past, width), **tol)
  return n_past


@pytest.mark.parametrize("dtype,ring_dtype", [("fp32", "fp32"), ("bf16", "bf16")])
def test_speculative_loop_matches_reference(dtype, ring_dtype):
  n_past = check_speculative_loop(CFG, _weights(seed=2), dtype, ring_dtype, prompt=12, rounds=14)
  assert n_past > 2 * CFG.resolve_window()          # the ring wrapped several times


SLIDE, FULL = dfj.config.SLIDING, dfj.config.FULL
# Issue 13's drafter shapes at tiny dims: odd blocks, GQA groups and head dims, windows that
# are not powers of 2, and 4 sliding + 1 full layers with the full layer inside the stack
# (a wrong layer -> cache entry mapping shows there, not with a trailing full layer).
SHAPES = {
    "b7-g3-w48": dict(block_size=7, n_head=6, n_head_kv=2, window=48),
    "b10-g5-d48-w1000": dict(block_size=10, n_head=5, n_head_kv=1, head_dim=48, window=1000),
    "b16-g1-d64": dict(block_size=16, n_head=2, n_head_kv=2, head_dim=64),
    "b8-g6-mixed": dict(n_layer=5, n_head=12, n_head_kv=2, layer_types=(SLIDE, SLIDE, FULL, SLIDE,
                                                                        SLIDE), window=16,
                        context_length=96),
}
# (shape, impl, widths drafted; None = block_size). The XLA path drafts 2, 5 and 8 rows of a
# block-16 drafter; interpret-mode Pallas is slow, so it drafts one width per shape and runs
# the mixed drafter in the speculative loop below.
CASES = [pytest.param(shape, "xla", (2, 5, 8) if shape == "b16-g1-d64" else (None,),
                      id=f"{shape}-xla") for shape in SHAPES]
CASES += [pytest.param(shape, "pallas", widths, id=f"{shape}-pallas") for shape, widths in
          (("b7-g3-w48", (None,)), ("b10-g5-d48-w1000", (None,)), ("b16-g1-d64", (5,)))]


@pytest.mark.parametrize("shape,impl,widths", CASES)
def test_drafter_shapes_match_reference(shape, impl, widths):
  cfg = dataclasses.replace(CFG, **SHAPES[shape])
  w = _weights(cfg)
  m = dfj.DFlashDrafter(cfg, w, impl=impl)
  ref = DFlashRef(cfg, w)
  # Past the window (the ring wraps), within the full layer's capacity.
  n = min(cfg.resolve_window() + 7, cfg.resolve_capacity() - 10)
  feats = dfj.synthetic_features(cfg, n, seed=2)
  m.inject(m.encode(feats), np.arange(n))
  ref.inject(ref.encode(feats), np.arange(n))
  _assert_ring_matches(m, ref, FP32_TOL)
  got, wants = [], []
  for width in widths:
    step = m.capture_step(width)
    for id_last, n_past in ((3, n), (200, n + 2)):
      got.append(np.asarray(step(id_last, n_past)))
      wants.append(ref.step(id_last, n_past, width))
      chex.assert_shape(got[-1], (cfg.resolve_width(width), VOCAB))
      chex.assert_trees_all_close(got[-1], wants[-1], **FP32_TOL)
  _assert_drafts_match(got, wants, FP32_TOL)


MIXED = dataclasses.replace(CFG, **SHAPES["b8-g6-mixed"])


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_mixed_kinds_speculative_loop_at_width_5(impl):
  """bf16 draft rounds of 5 rows: the 16-slot ring wraps while the full layer's cache fills."""
  n_past = check_speculative_loop(MIXED, _weights(MIXED, seed=3), "bf16", "bf16", prompt=20,
                                  rounds=4, width=5, impl=impl, capacity=64)
  assert n_past > 20 + 4


def test_full_capacity_is_checked_before_any_state_change():
  cfg = dataclasses.replace(CFG, layer_types=(SLIDE, FULL), window=16)
  m = dfj.DFlashDrafter(cfg, _weights(cfg), impl="xla", capacity=32)
  assert (m.window, m.capacity) == (16, 32)
  feats = dfj.synthetic_features(cfg, 30)
  m.inject(m.encode(feats), np.arange(30))
  before = _ring_snapshot(m)
  h = m.encode(feats[:3])
  msg = r"position {} does not fit the full_attention cache \(layers \[1\] hold positions < capacity 32"
  with pytest.raises(ValueError, match=msg.format(32)):
    m.inject(h, np.array([30, 31, 32]))
  with pytest.raises(ValueError, match=msg.format(33)):
    m.draft_round(feats[:4], 4, 1, 34)          # rows at 30..33
  chex.assert_trees_all_equal(_ring_snapshot(m), before)
  assert m.max_position == 29
  m.draft_round(feats[:4], 2, 1, 32)            # rows at 30, 31: the last two slots
  np.testing.assert_array_equal(np.asarray(m.ring.full.pos), np.arange(32))
  m.draft_round(feats[:4], 0, 1, 40)            # drafting past the capacity reads, stores nothing


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_functional_inject_never_wraps_a_full_cache(impl):
  """Inside jit nothing checks the capacity: a full-attention cache drops positions >= its
  slots (slot = position, no wrap) while the sliding ring wraps them."""
  cfg = dataclasses.replace(CFG, layer_types=(SLIDE, FULL))
  params = dfj.prepare_weights(cfg, _weights(cfg))
  ring = dfj.init_ring(cfg, window=32, capacity=32)
  h = jnp.asarray(np.random.default_rng(0).standard_normal((4, cfg.n_embd)), jnp.float32)
  ring = S.inject_jit(params, ring, h, jnp.array([30, 31, 32, 33], jnp.int32), impl=impl)
  full_pos, ring_pos = np.asarray(ring.full.pos), np.asarray(ring.sliding.pos)
  assert full_pos[30:].tolist() == [30, 31] and (full_pos[:30] == -1).all()
  assert not np.asarray(ring.full.k[:, :, :30]).any()     # slots 0, 1 were not written
  assert ring_pos[[30, 31, 0, 1]].tolist() == [30, 31, 32, 33]


def test_xla_path_has_no_kernel_limits():
  """Shapes no Triton tile takes (head_dim 6, window 5, block 3, group 3, 11 cache slots): the
  jnp twins run them as the reference does."""
  cfg = dataclasses.replace(CFG, n_head=3, n_head_kv=1, head_dim=6, block_size=3, window=5,
                            layer_types=(FULL, SLIDE))
  w = _weights(cfg)
  m = dfj.DFlashDrafter(cfg, w, impl="xla", capacity=11)
  ref = DFlashRef(cfg, w, capacity=11)
  feats = dfj.synthetic_features(cfg, 10)
  for rows in (slice(0, 5), slice(5, 10)):   # the second call wraps the 5-slot ring
    m.inject(m.encode(feats[rows]), np.arange(10)[rows])
    ref.inject(ref.encode(feats[rows]), np.arange(10)[rows])
  _assert_ring_matches(m, ref, FP32_TOL)
  for width in (2, None):
    chex.assert_trees_all_close(np.asarray(m.step(4, 10, width)), ref.step(4, 10, width),
                                **FP32_TOL)


def _pallas_calls(fn, *args) -> list[str]:
  """Names of the pallas_calls fn traces to (nested jits included), in order."""
  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == "pallas_call":
        yield str(e.params["name"])
      else:
        for v in e.params.values():
          inner = getattr(v, "jaxpr", v)
          if hasattr(inner, "eqns"):
            yield from walk(inner)
  return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def test_inject_is_one_gemm_and_one_launch_per_kind():
  """A single-kind drafter keeps one ring (today's arrays) and one inject launch; a mixed one
  adds one cache and one launch for its full layers."""
  ring = dfj.init_ring(CFG, ring_dtype="bf16")
  assert ring.full is None
  chex.assert_shape(jax.tree.leaves(ring), [(2, 2, 32, 16), (2, 2, 32, 16), (32,)])
  for cfg, kinds in ((CFG, 1), (MIXED, 2)):
    params = dfj.prepare_weights(cfg, _weights(cfg), "bf16")
    ring = dfj.init_ring(cfg, ring_dtype="bf16", capacity=64)
    h = jnp.ones((cfg.block_size, cfg.n_embd), jnp.float32)
    calls = _pallas_calls(lambda p, r, x: S.inject(p, r, x, jnp.arange(8, dtype=jnp.int32)),
                          params, ring, h)
    assert calls.count("inject") == kinds and len(calls) == 2 * kinds, calls
    if kinds == 2:
      assert [c.k.shape[0] for c in (ring.sliding, ring.full)] == [4, 1]


def test_inject_donates_ring_in_place():
  params = dfj.prepare_weights(CFG, _weights(), "bf16")
  ring = dfj.init_ring(CFG, ring_dtype="bf16")
  h = jnp.ones((CFG.block_size, CFG.n_embd), jnp.float32)
  pos = jnp.arange(CFG.block_size, dtype=jnp.int32)
  compiled = S.inject_jit.lower(params, ring, h, pos).compile()
  ring_bytes = sum(x.nbytes for x in jax.tree.leaves(ring))
  assert compiled.memory_analysis().alias_size_in_bytes == ring_bytes
  new_ring = S.inject_jit(params, ring, h, pos)
  assert all(x.is_deleted() for x in jax.tree.leaves(ring))
  with pytest.raises(RuntimeError, match="deleted"):
    S.block_step_jit(params, ring, 1, 16)        # the donated ring is gone
  S.block_step_jit(params, new_ring, 1, 16).block_until_ready()


def _ring_snapshot(m):
  return jax.tree.map(np.asarray, m.ring)


def test_bad_inputs_raise_before_state_changes():
  w = _weights()
  m = dfj.DFlashDrafter(CFG, w)
  feats = dfj.synthetic_features(CFG, 5)
  m.inject(m.encode(feats), np.arange(5))
  before = _ring_snapshot(m)
  h = m.encode(feats)
  cases = [
      (lambda: m.encode(feats[:, :-1]), "features must be"),
      (lambda: m.encode(feats.astype(np.int32)), "floating point"),
      (lambda: m.encode(np.where(np.arange(5)[:, None] == 3, np.nan, feats)),
       "features row 3 holds NaN"),
      (lambda: m.inject(h, np.arange(4)), "positions must be 5"),
      (lambda: m.inject(h, np.arange(5) - 1), "positions must lie"),
      (lambda: m.inject(h, np.arange(5) + 2**31 - 3), "positions must lie"),
      (lambda: m.inject(h, np.arange(5.0)), "integers"),
      (lambda: m.inject(h[:, :-1], np.arange(5)), "h must be"),
      (lambda: m.step(VOCAB, 5), "outside the vocab"),
      (lambda: m.step(-1, 5), "outside the vocab"),
      (lambda: m.step(1, 4), "not past the injected positions"),
      (lambda: m.step(1, -2), r"n_past -2 out of range \[0, 2147483639\]"),
      (lambda: m.step(1, 2**31 - 8), r"n_past 2147483640 out of range \[0, 2147483639\]"),
      (lambda: m.step(1, 5, width=1), r"width must be an int in \[2, block_size 8\]"),
      (lambda: m.capture_step(width=9), "width must be"),
      (lambda: m.capture_step()(1, 3), "not past the injected positions"),
      (lambda: m.accept(np.arange(3), np.arange(4.0)), "integer"),
      (lambda: m.accept(np.arange(3), np.arange(2)), "at least n entries"),
      (lambda: m.draft_round(feats, 9, 1, 20), "n_new"),
      (lambda: m.draft_round(np.where(np.arange(5)[:, None] == 2, np.inf, feats), 3, 1, 20),
       "features row 2 holds NaN or Inf"),
      (lambda: m.draft_round(feats, 3, 1, 20, width=9), "width must be"),
  ]
  for fn, msg in cases:
    with pytest.raises(ValueError, match=msg):
      fn()
  chex.assert_trees_all_equal(_ring_snapshot(m), before)
  assert m.max_position == 4
  # Rows past n_new are padding: a NaN there is never injected and is not an error.
  m.draft_round(np.where(np.arange(5)[:, None] == 4, np.nan, feats), 3, 1, 20)
  assert m.max_position == 19


@pytest.mark.parametrize("missing", ["tok_embd", "lm_head"])
def test_missing_target_tensors(missing):
  w = _weights()
  del w[missing]
  with pytest.raises(ValueError, match=missing):
    dfj.DFlashDrafter(CFG, w)


def test_accept_ignores_the_bonus_entry():
  m = dfj.DFlashDrafter(CFG, _weights())
  d = np.array([4, 5, 6, 7], np.int32)
  assert int(m.accept(d, np.array([4, 5, 6, 7, 99], np.int32))) == 4
  assert int(m.accept(d, np.array([4, 9, 6, 7, 99], np.int32))) == 1
  batched = m.accept(np.stack([d, d]), np.array([[4, 5, 0, 7, 1], [0, 5, 6, 7, 1]], np.int32))
  np.testing.assert_array_equal(np.asarray(batched), [2, 0])


def test_kernel_limits_are_checked_at_construction():
  """What the Pallas kernels cannot run (head_dim 8) fails when the drafter is built, before
  the weights are looked at (this dict even lacks the LM head); impl="xla" builds it."""
  cfg = dataclasses.replace(CFG, head_dim=8)
  w = _weights(cfg)
  lm_head = w.pop("lm_head")
  with pytest.raises(ValueError, match=r"pallas drafter: head_dim must be a multiple of 16 .*"
                                       r"\(got 8\)"):
    dfj.DFlashDrafter(cfg, w)
  dfj.DFlashDrafter(cfg, dict(w, lm_head=lm_head), impl="xla")


def test_fp8_lm_head_of_any_vocab():
  """The skinny GEMM takes any N: a 500-token vocab's fp8 lm_head runs on it (no limit)."""
  from dflash_jax.dispatch import linear
  p = dfj.prepare_weights(CFG, dfj.synthetic_drafter(CFG, n_vocab=500), "fp8")
  x = jnp.asarray(np.random.default_rng(5).standard_normal((16, CFG.n_embd)), jnp.float32)
  np.testing.assert_allclose(np.asarray(linear(x, p.lm_head, policy=p.policy)),
                             np.asarray(linear(x, p.lm_head, impl="xla")), rtol=1e-5, atol=1e-5)


def test_bad_dtype_names():
  with pytest.raises(ValueError, match="dtype must be one of"):
    dfj.DFlashDrafter(CFG, _weights(), dtype="fp16")
  with pytest.raises(ValueError, match="ring_dtype"):
    dfj.DFlashDrafter(CFG, _weights(), ring_dtype=jnp.int8)


def test_bf16_weights_are_the_host_round_to_nearest_even():
  """prepare_weights casts blocks of rows on threads, written straight into the concatenated
  matrix; every matrix equals ml_dtypes' cast of the whole bit for bit, ties (to even, both
  ways) included."""
  import ml_dtypes
  w = _weights()
  q = w["blk.0.attn_q"].copy()
  ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80C000, 0x3F807FFF], np.uint32)
  q[0, :5] = ties.view(np.float32)              # 1 + 2^-8: down to 1; 1 + 3 * 2^-8: up; ...
  w["blk.0.attn_q"] = q
  params = dfj.prepare_weights(CFG, w, "bf16")
  got = np.asarray(params.layers[0].wqkv).view(np.uint16)
  want = np.concatenate([w[f"blk.0.attn_{n}"] for n in "qkv"]).astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(got, want.view(np.uint16))
  np.testing.assert_array_equal(got[0, :5], [0x3F80, 0x3F82, 0xBF80, 0x3F81, 0x3F80])
  got_gu = np.asarray(params.layers[1].wgu).view(np.uint16)
  want_gu = np.concatenate([w["blk.1.ffn_gate"], w["blk.1.ffn_up"]]).astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(got_gu, want_gu.view(np.uint16))


def _dequantized(w, fmt):
  """Host weights with every matrix replaced by the values the quantized GEMM computes with."""
  from dflash_jax import quant
  out = dict(w)
  for name, a in w.items():
    if a.ndim == 2 and name != "tok_embd":
      out[name] = (quant.dequantize_fp8(*quant.quantize_fp8(a)) if fmt == "fp8"
                   else quant.dequantize_q8_0(*quant.quantize_q8_0(a)))
  return out


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("fmt", ["fp8", "q8_0"])
def test_quantized_step_is_bf16_step_on_dequantized_weights(fmt, impl):
  w = _weights()
  m = dfj.DFlashDrafter(CFG, w, dtype=fmt, ring_dtype="bf16", impl=impl)
  ref = DFlashRef(CFG, _dequantized(w, fmt), dtype="bf16", ring_dtype="bf16")
  feats = dfj.synthetic_features(CFG, 40, seed=1)
  m.inject(m.encode(feats), np.arange(40))
  ref.inject(ref.encode(feats), np.arange(40))
  _assert_ring_matches(m, ref, BF16_TOL)
  logits = m.capture_step()(9, 40)
  want = ref.step(9, 40)
  chex.assert_trees_all_close(np.asarray(logits), want, **BF16_TOL)
  _assert_drafts_match(logits, want, BF16_TOL)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8", "q8_0"])
def test_linear_partials_and_out_dtype(fmt):
  """linear(partials=True) gives [S, M, N] float32 parts summing to the plain result (K split
  4 ways here for the skinny GEMM: K // block_k >= 16); out_dtype rounds the result once."""
  from dflash_jax import quant
  from dflash_jax.dispatch import KernelPolicy, QuantWeight, gemm_knobs
  policy = KernelPolicy()
  linear = functools.partial(dfj.linear, policy=policy)
  rng = np.random.default_rng(3)
  a = rng.standard_normal((64, 4096)).astype(np.float32) / 64
  if fmt == "fp8":
    wq = QuantWeight(*(jnp.asarray(v) for v in quant.quantize_fp8(a)), fmt="fp8")
  elif fmt == "q8_0":
    wq = QuantWeight(*(jnp.asarray(v) for v in quant.quantize_q8_0(a)), fmt="q8_0")
  else:
    wq = jnp.asarray(a, jnp.float32 if fmt == "fp32" else jnp.bfloat16)
  x = jnp.asarray(rng.standard_normal((16, 4096)), jnp.float32)
  y = linear(x, wq)
  parts = linear(x, wq, partials=True)
  n_split = gemm_knobs(fmt, 64, 4096, policy=policy).split_k if fmt != "fp32" else 1
  assert parts.shape == (n_split, 16, 64) and parts.dtype == jnp.float32
  assert fmt == "fp32" or n_split == 4
  np.testing.assert_allclose(np.asarray(parts).sum(0), np.asarray(y), rtol=1e-5, atol=1e-5)
  y16 = linear(x, wq, out_dtype=jnp.bfloat16)
  assert y16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y16, np.float32), np.asarray(y), rtol=2.0 ** -7, atol=0)
  with pytest.raises(ValueError, match="partials=True is for plain projections"):
    linear(x, wq, gate_up=True, partials=True)
  # residual=: the float32 residual plus the product (the skinny path adds it in XLA)
  r = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
  np.testing.assert_allclose(np.asarray(linear(x, wq, residual=r)), np.asarray(r + y),
                             rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match=r"residual must be \(16, 64\)"):
    linear(x, wq, residual=r[:, :1])      # would broadcast silently
  with pytest.raises(ValueError, match="a residual is for plain projections"):
    linear(x, wq, residual=r, partials=True)


def test_linear_bf16_runs_skinny_up_to_skinny_max_m_rows():
  """Dense bf16 weights: the Pallas skinny GEMM for block-sized row counts whatever the shape
  (a vocab of 100 rows, K = 200), XLA's GEMM for prefill-sized row counts (past the policy's
  skinny_max_m); every case agrees with the jnp path to float32 summation order."""
  from dflash_jax.dispatch import KernelPolicy
  policy = KernelPolicy()
  skinny_max_m = policy.skinny_max_m
  linear = functools.partial(dfj.linear, policy=policy)
  rng = np.random.default_rng(4)
  for (n, k), m, kernel in (((96, 256), 7, True), ((96, 256), skinny_max_m, True),
                            ((96, 256), skinny_max_m + 1, False), ((100, 256), 16, True),
                            ((96, 200), 16, True), ((96, 256), 2048, False)):
    w = jnp.asarray(rng.standard_normal((n, k)) / 16, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda x, w: linear(x, w))(x, w))
    assert ("pallas_call" in jaxpr) == kernel, (n, k, m, kernel)
    np.testing.assert_allclose(np.asarray(linear(x, w)), np.asarray(linear(x, w, impl="xla")),
                               rtol=1e-5, atol=1e-5)


def test_q8_0_blocks_taken_as_stored(tmp_path):
  """Tensors stored as Q8_0 in the GGUF reach the device as the same int8 blocks."""
  w = _weights()
  path = str(tmp_path / "d.gguf")
  dfj.save_drafter(path, CFG, w, tensor_type="Q8_0")
  cfg, loaded = dfj.load_drafter(path)
  loaded["tok_embd"], loaded["lm_head"] = w["tok_embd"], w["lm_head"]
  blocks = dfj.read_q8_0(path)
  params = dfj.prepare_weights(cfg, loaded, "q8_0", q8_0_blocks=blocks)
  qs, d = blocks["blk.1.ffn_down"]
  np.testing.assert_array_equal(np.asarray(params.layers[1].wd.data), qs)
  np.testing.assert_array_equal(np.asarray(params.layers[1].wd.scale), d)
  with pytest.raises(ValueError, match="q8_0_blocks given"):
    dfj.prepare_weights(cfg, loaded, "fp8", q8_0_blocks=blocks)
  narrowed = dict(blocks, **{"blk.1.ffn_down": (qs, d.astype(np.float16))})
  with pytest.raises(ValueError, match=r"'blk.1.ffn_down' are int8, float16; expected int8 and "
                                       "float32"):
    dfj.prepare_weights(cfg, loaded, "q8_0", q8_0_blocks=narrowed)


# ----------------------------------------------------------------------------- GPU, real dims
# The seed fixtures (seed_w, seed_feats, seed_ref_bf16) are in conftest.py; the published
# shapes at these dims (test_step_shapes_gpu.py) and the quantized steps
# (test_step_quantized_gpu.py) are files of their own so that the GPU suite's workers
# (pytest-xdist, one file each) run them side by side.
SEED = dfj.SEED_CONFIG


def _first_layers(w, cfg):
  """w's tensors that a drafter of cfg (fewer layers, same dims) has."""
  names = set(dfj.drafter_tensor_shapes(cfg)) | {"tok_embd", "lm_head"}
  return {k: v for k, v in w.items() if k in names}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,ring_dtype", [("fp32", "fp32"), ("bf16", "bf16")])
def test_gpu_real_dims_match_reference(dtype, ring_dtype, seed_w, seed_feats, seed_ref_bf16):
  m = dfj.DFlashDrafter(SEED, seed_w, dtype=dtype, ring_dtype=ring_dtype)
  ref = (seed_ref_bf16 if dtype == "bf16" else
         DFlashRef(SEED, seed_w, dtype=dtype, ring_dtype=ring_dtype))
  ref.reset()
  feats = seed_feats[:2100]                               # more than the 2048-slot ring
  m.inject(m.encode(feats), np.arange(2100))
  ref.inject(ref.encode(feats), np.arange(2100))
  logits = np.asarray(m.capture_step()(17, 2100))
  want = ref.step(17, 2100)
  tol = _tol(dtype, ring_dtype)
  chex.assert_trees_all_close(logits, want, **tol)
  _assert_drafts_match(logits, want, tol)


@pytest.mark.gpu
def test_gpu_real_dims_replay_draft_round_and_loop(seed_w, seed_feats, seed_ref_bf16):
  m = dfj.DFlashDrafter(SEED, seed_w, dtype="bf16", ring_dtype="bf16")
  m.inject(m.encode(seed_feats[:2100]), np.arange(2100))
  check_replay_bitwise(m, 17, 2100)
  del m
  check_draft_round_equals_inject_then_step(SEED, seed_w, "bf16", 2040)   # wraps during the round
  # Prompt 2040 plus ~8 tokens a round wraps the 2048-slot ring within the loop.
  check_speculative_loop(SEED, seed_w, "bf16", "bf16", prompt=2040, rounds=6, ref=seed_ref_bf16)


@pytest.mark.gpu
@pytest.mark.parametrize("layer_types", [None, (SLIDE, FULL)])
def test_gpu_draft_round_aliases_ring_without_copy(seed_w, layer_types):
  cfg = dataclasses.replace(SEED, n_layer=2, layer_types=layer_types)
  params = dfj.prepare_weights(cfg, _first_layers(seed_w, cfg), "bf16")
  ring = dfj.init_ring(cfg, ring_dtype="bf16", capacity=4096)
  feats = jnp.asarray(dfj.synthetic_features(cfg, cfg.block_size))
  args = (params, ring, feats, 4, 1, 20)
  compiled = S.draft_round_jit.lower(*args).compile()
  hlo = compiled.as_text()
  assert "input_output_alias" in hlo
  assert " copy(" not in hlo and "copy-start" not in hlo
  ring_bytes = sum(x.nbytes for x in jax.tree.leaves(ring))
  assert compiled.memory_analysis().alias_size_in_bytes == ring_bytes
  ptrs = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(ring)]
  new_ring, _, _ = S.draft_round_jit(*args)
  assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(new_ring)] == ptrs


@pytest.mark.gpu
def test_gpu_step_runs_as_one_command_buffer(tmp_path):
  """XLA records the whole draft round, Pallas kernels included, into one command buffer."""
  script = textwrap.dedent("""
      import dataclasses, jax, jax.numpy as jnp, dflash_jax as dfj
      from dflash_jax.drafter import step as S
      cfg = dataclasses.replace(dfj.SEED_CONFIG, n_layer=2)
      params = dfj.prepare_weights(cfg, dfj.synthetic_drafter(cfg, n_vocab=8192), "bf16")
      ring = dfj.init_ring(cfg, ring_dtype="bf16")
      feats = jnp.asarray(dfj.synthetic_features(cfg, cfg.block_size))
      ring, d, l = S.draft_round_jit(params, ring, feats, 4, 1, 20)
      jax.block_until_ready(l)
  """)
  env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path}")
  subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=os.getcwd())
  files = glob.glob(str(tmp_path / "*draft_round*thunk_sequence_after_thunk_passes.txt"))
  assert files, os.listdir(tmp_path)[:20]
  text = open(files[0]).read()
  print(text[:4000])
  top = [l for l in text.splitlines() if l and not l.startswith(" ")]
  assert len(top) == 1 and "kCommandBuffer" in top[0], top
  for kernel in ("inject", "qk_norm_rope", "ring_attn"):
    assert kernel in text, kernel
