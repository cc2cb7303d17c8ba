"""Sharded drafter, target and decode rounds on 8 host devices against the unsharded code.

Run by tests/test_sharding.py in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8
(the rest of the suite keeps one device); on its own:
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/sharding_cases.py
"""
import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dflash_jax as dfj
import tiny_models as TM
from dflash_jax import decode as D
from dflash_jax import sharding as SH
from dflash_jax.drafter import step as S
from dflash_jax.config import FULL, SLIDING
from dflash_jax.models import qwen3 as Q
from test_step import BF16_TOL, FP32_TOL, _assert_drafts_match

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 devices: tests/test_sharding.py runs this module "
    "with XLA_FLAGS=--xla_force_host_platform_device_count=8")

# Every split axis divides 4: 8 query heads, 4 kv heads, 128 FFN columns, 4 x 64 fc input
# columns (8 Q8_0 blocks a row), a 512-token vocab; one sliding and one full-attention layer
# (both caches).
CFG = dataclasses.replace(dfj.TINY_CONFIG, n_head=8, n_head_kv=4, layer_types=(SLIDING, FULL),
                          window=32, target_layers=(1, 3, 5, 7))
VOCAB, CAPACITY, N_PREFILL = 512, 64, 40
TOL = {"fp32": FP32_TOL, "bf16": BF16_TOL, "fp8": BF16_TOL, "q8_0": BF16_TOL}


@pytest.fixture(scope="module")
def weights():
  return dfj.synthetic_drafter(CFG, seed=0, n_vocab=VOCAB)


def _ring(cfg, ring_dtype, seed):
  """A ring holding random K/V (host numpy: no device compiles) at positions
  0..N_PREFILL-1: the sliding ring keeps the last W of them (wrapped), the full cache all."""
  rng = np.random.default_rng(seed)
  caches = {}
  for kind, layers in cfg.kind_groups:
    slots = cfg.window if kind == SLIDING else CAPACITY
    kept = np.arange(max(0, N_PREFILL - slots) if kind == SLIDING else 0, N_PREFILL)
    pos = np.full((slots,), -1, np.int32)
    pos[kept % slots] = kept
    shape = (len(layers), cfg.n_head_kv, slots, cfg.head_dim)
    k, v = (jnp.asarray(rng.standard_normal(shape, np.float32).astype(
        dfj.resolve_dtype(ring_dtype))) for _ in range(2))
    caches[kind] = S.KVCache(k=k, v=v, pos=jnp.asarray(pos), kind=kind)
  return S.RingState(sliding=caches.get(SLIDING), full=caches.get(FULL))


def _assert_rings_close(got, want, tol):
  for g, w in zip(got.caches(), want.caches(), strict=True):
    np.testing.assert_array_equal(np.asarray(g.pos), np.asarray(w.pos))
    for a, b in ((g.k, w.k), (g.v, w.v)):
      chex.assert_trees_all_close(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


ROUND = dict(n_new=5, id_last=3, n_past=N_PREFILL + 5)


def _round_inputs(cfg, seed):
  return (jnp.asarray(dfj.synthetic_features(cfg, cfg.block_size, seed=seed)), ROUND["n_new"],
          ROUND["id_last"], ROUND["n_past"])


def _check_round(ring_s, drafts_s, logits_s, want, tol):
  ring_u, _, logits_u = want
  _assert_rings_close(ring_s, ring_u, tol)
  chex.assert_trees_all_close(np.asarray(logits_s), np.asarray(logits_u), **tol)
  np.testing.assert_array_equal(np.asarray(drafts_s), np.asarray(S.greedy_drafts(logits_s)))
  _assert_drafts_match(np.asarray(logits_s), np.asarray(logits_u), tol)


@pytest.mark.parametrize("dtype,ring_dtype,tp", [("fp32", "fp32", 2), ("q8_0", "bf16", 4)])
def test_tp_draft_round_equals_unsharded(weights, dtype, ring_dtype, tp):
  """A TP round (XLA: inject the new rows, then the block step) equals the unsharded round to
  rounding: positions exactly, K/V and logits within the dtype's tolerance, drafts on every
  row whose top-2 gap is clear of it; the sharded ring is donated. Q8_0 at tp = 4 splits the
  o, down and fc block scales with their columns."""
  params = dfj.prepare_weights(CFG, weights, dtype)
  ring = _ring(CFG, ring_dtype, seed=1)
  args = _round_inputs(CFG, seed=9)
  want = _host(S.draft_round_jit(params, _copy(ring), *args, impl="xla"))
  plan = SH.make_plan(tp=tp)
  sp, sr = SH.shard_params(params, plan), SH.shard_ring(ring, plan)
  ring_s, drafts_s, logits_s = SH.draft_round_jit(plan, sp, sr, *args, impl="xla")
  assert all(c.k.is_deleted() and c.pos.is_deleted() for c in sr.caches())
  assert logits_s.sharding.shard_shape(logits_s.shape) == (CFG.block_size, VOCAB // tp)
  assert all(c.k.sharding.spec == P(None, SH.TP) for c in ring_s.caches())
  tol = TOL[ring_dtype if dtype == "fp32" else dtype]
  _check_round(ring_s, drafts_s, logits_s, want, tol)
  # The block step alone on the ring the round left: the round's logits again.
  step_s = SH.block_step_jit(plan, sp, ring_s, ROUND["id_last"], ROUND["n_past"], impl="xla")
  chex.assert_trees_all_close(np.asarray(step_s), want[2], **tol)


def test_dp_slot_rounds_equal_unsharded(weights):
  """Per-slot rings split over dp = 2 (XLA): each device runs its slot's unsharded round,
  bitwise (the same as one unsharded call per slot)."""
  params = dfj.prepare_weights(CFG, weights, "fp32")
  rings = [_ring(CFG, "fp32", seed=1), _ring(CFG, "fp32", seed=3)]
  inputs = [_round_inputs(CFG, seed=9), (jnp.asarray(dfj.synthetic_features(
      CFG, CFG.block_size, seed=21)), 2, 17, N_PREFILL + 2)]
  stacked = [jnp.stack([jnp.asarray(a), jnp.asarray(b)]) for a, b in zip(*inputs)]
  plan = SH.make_plan(dp=2)
  ring_s, drafts_s, logits_s = SH.draft_round_slots_jit(
      plan, SH.shard_params(params, plan),
      SH.shard_ring(jax.tree.map(lambda *a: jnp.stack(a), *rings), plan), *stacked, impl="xla")
  assert ring_s.sliding.k.sharding.spec == P(SH.DP)
  for s in range(2):
    want = _host(S.draft_round_jit(params, rings[s], *inputs[s], impl="xla"))
    got = _host((jax.tree.map(lambda a: a[s], ring_s), drafts_s[s], logits_s[s]))
    chex.assert_trees_all_equal(got, want)


# The Pallas case runs a one-layer drafter (interpret mode compiles slowly); the XLA cases
# carry both attention kinds.
PALLAS_CFG = dataclasses.replace(CFG, n_layer=1, layer_types=None)


def test_dp_tp_pallas_slot_rounds_equal_unsharded():
  """Per-slot rings on a dp = 2 x tp = 4 mesh (Pallas kernels in interpret mode, bf16 weights
  on the skinny GEMM): each slot's round equals the unsharded one-ring round to rounding."""
  w = dfj.synthetic_drafter(PALLAS_CFG, seed=1, n_vocab=VOCAB)
  params = dfj.prepare_weights(PALLAS_CFG, w, "bf16")
  rings = [_ring(PALLAS_CFG, "fp32", seed=2), _ring(PALLAS_CFG, "fp32", seed=7)]
  inputs = [_round_inputs(PALLAS_CFG, seed=3), (jnp.asarray(dfj.synthetic_features(
      PALLAS_CFG, CFG.block_size, seed=8)), 2, 11, N_PREFILL + 2)]
  stacked = [jnp.stack([jnp.asarray(a), jnp.asarray(b)]) for a, b in zip(*inputs)]
  plan = SH.make_plan(tp=4, dp=2)
  ring_s, drafts_s, logits_s = SH.draft_round_slots_jit(
      plan, SH.shard_params(params, plan),
      SH.shard_ring(jax.tree.map(lambda *a: jnp.stack(a), *rings), plan), *stacked,
      impl="pallas")
  assert ring_s.sliding.k.sharding.shard_shape(ring_s.sliding.k.shape)[:3] == (1, 1, 1)
  for s in range(2):
    want = _host(S.draft_round_jit(params, rings[s], *inputs[s], impl="pallas"))
    _check_round(jax.tree.map(lambda a: a[s], ring_s), drafts_s[s], logits_s[s], want,
                 BF16_TOL)


def _target(vocab=128, seed=0):
  """A one-layer target (every split axis divides 2); its initializer compiles once."""
  return TM.target(vocab=vocab, layers=1, seed=seed)


def test_target_forward_and_verify_equal_unsharded():
  """The target's forward (TP = 2) and a cached verify (dp = 2 x tp = 2) equal the unsharded
  calls to rounding: logits (vocab-sharded), captured features and the written cache."""
  tcfg, tparams = _target()
  capture = (0, 1)
  tokens = jax.random.randint(jax.random.key(5), (2, 6), 0, tcfg.vocab_size)
  plan2 = SH.make_plan(tp=2)
  lg_s, ft_s = jax.jit(functools.partial(SH.ShardedTarget(tcfg, plan2).forward,
                                          capture_layers=capture))(
      SH.shard_target(tparams, tcfg, plan2), tokens)
  lg_u, ft_u = Q.forward_jit(tparams, tcfg, tokens, capture_layers=capture)
  assert lg_s.sharding.shard_shape(lg_s.shape) == (2, 6, tcfg.vocab_size // 2)
  chex.assert_trees_all_close(_host((lg_s, ft_s)), _host((lg_u, ft_u)), **FP32_TOL)
  plan = SH.make_plan(tp=2, dp=2)
  cache = Q.init_cache(tcfg, 2, 16, "fp32").replace(length=jnp.array([0, 3], jnp.int32))
  st = SH.ShardedTarget(tcfg, plan)
  c_s, lg_s, fv_s = jax.jit(functools.partial(st.verify, capture_layers=capture))(
      SH.shard_target(tparams, tcfg, plan), SH.shard_target_cache(cache, plan), tokens)
  c_u, lg_u, fv_u = Q.verify_jit(tparams, tcfg, cache, tokens, capture_layers=capture)
  assert c_s.k[0].sharding.shard_shape(c_s.k[0].shape)[:2] == (1, tcfg.num_key_value_heads // 2)
  np.testing.assert_array_equal(np.asarray(c_s.length), np.asarray(c_u.length))
  chex.assert_trees_all_close(_host((c_s.k, c_s.v, lg_s, fv_s)), _host((c_u.k, c_u.v, lg_u, fv_u)),
                              **FP32_TOL)


def test_decode_rounds_on_the_mesh_equal_unsharded():
  """Greedy speculative decoding with models and state on a dp = 2 x tp = 2 mesh commits the
  unsharded tokens, acceptance counts and lengths; its rings agree to rounding."""
  tcfg, tparams = _target(seed=1)
  models = TM.models(tcfg, tparams, TM.drafter(tcfg, tparams, seed=2))
  dcfg = D.DecodeConfig(width=8, impl="xla")
  prompts = [[1, 5, 9, 3, 7], [2, 4, 6, 8, 10, 12, 14]]
  plan = SH.make_plan(tp=2, dp=2)
  sm = SH.shard_models(models, plan)
  st_s = D.run_rounds(sm, dcfg, D.start(sm, dcfg, prompts, 12), jnp.int32(4))
  st_u = D.run_rounds(models, dcfg, D.start(models, dcfg, prompts, 12), jnp.int32(4))
  assert st_s.tokens.sharding.spec[0] == SH.DP
  for f in ("tokens", "n_past", "id_last", "hist", "rounds", "done"):
    np.testing.assert_array_equal(np.asarray(getattr(st_s, f)), np.asarray(getattr(st_u, f)), f)
  np.testing.assert_array_equal(np.asarray(st_s.cache.length), np.asarray(st_u.cache.length))
  _assert_rings_close(st_s.ring, st_u.ring, FP32_TOL)


def test_mesh_of_one_is_the_unsharded_code(weights):
  """On a 1 x 1 mesh the sharded round is the unsharded one, bitwise."""
  params = dfj.prepare_weights(CFG, weights, "fp32")
  ring = _ring(CFG, "fp32", seed=4)
  args = _round_inputs(CFG, seed=10)
  plan = SH.make_plan(devices=jax.devices()[:1])
  out_s = SH.draft_round_jit(plan, SH.shard_params(params, plan), SH.shard_ring(ring, plan),
                             *args, impl="xla")
  out_u = S.draft_round_jit(params, ring, *args, impl="xla")   # compiled by the TP test
  chex.assert_trees_all_equal(_host(out_s), _host(out_u))


# --- shapes the mesh cannot split ----------------------------------------------------------

def _no_device_put(monkeypatch):
  calls = []
  monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or pytest.fail(
      "device_put ran before the shape check"))
  return calls


@pytest.mark.parametrize("change,message", [
    (dict(n_head=4, n_head_kv=2), r"inject\[0\].w axis 0: 2 kv_heads \(32 rows\)"),
    (dict(n_ff=90), r"layers\[0\].wgu axis 0: 90 ffn do not"),
    (dict(n_head=6, n_head_kv=2), r"layers\[0\].wqkv axis 0: 6 q_heads \(96 rows\)"),
])
def test_drafter_shapes_that_do_not_divide_raise_before_placing(monkeypatch, change, message):
  cfg = dataclasses.replace(CFG, **change)
  params = dfj.prepare_weights(cfg, dfj.synthetic_drafter(cfg, seed=0, n_vocab=VOCAB))
  plan = SH.make_plan(tp=4)
  _no_device_put(monkeypatch)
  with pytest.raises(ValueError, match=message + r".* split over mesh axis 'tp' of 4 devices"):
    SH.shard_params(params, plan)


def test_vocab_slots_and_quant_blocks_that_do_not_divide(monkeypatch):
  plan2, plan4 = SH.make_plan(tp=2), SH.make_plan(tp=4)
  odd = dfj.prepare_weights(CFG, dfj.synthetic_drafter(CFG, seed=0, n_vocab=97))
  # fc is [64, 192] in Q8_0: 6 blocks of 32 per row do not split 4 ways.
  cfg3 = dataclasses.replace(CFG, target_layers=(1, 3, 5))
  q8 = dfj.prepare_weights(cfg3, dfj.synthetic_drafter(cfg3, seed=0, n_vocab=VOCAB), "q8_0")
  ring3 = jax.tree.map(lambda a: jnp.stack([a] * 3), S.init_ring(CFG, capacity=CAPACITY))
  tcfg, tparams = _target(vocab=97)
  _no_device_put(monkeypatch)
  with pytest.raises(ValueError, match=r"lm_head axis 0: 97 vocab do not split over mesh axis 'tp' of 2"):
    SH.shard_params(odd, plan2)
  with pytest.raises(ValueError, match=r"fc.scale axis 1: 6 fc_in"):
    SH.shard_params(q8, plan4)
  with pytest.raises(ValueError, match=r"sliding.k axis 0: 3 slots do not split over mesh axis 'dp' of 2"):
    SH.shard_ring(ring3, SH.make_plan(dp=2))
  with pytest.raises(ValueError, match=r"lm_head axis 0: 97 vocab"):
    SH.shard_target(tparams, tcfg, plan2)
  with pytest.raises(ValueError, match=r"k\[0\] axis 0: 3 slots"):
    SH.shard_target_cache(Q.init_cache(tcfg, 3, 16), SH.make_plan(dp=2))


def test_entry_points_reject_unsharded_or_mismatched_trees(weights):
  params = dfj.prepare_weights(CFG, weights)
  ring = S.init_ring(CFG, capacity=CAPACITY)
  new = jnp.zeros((CFG.block_size, CFG.n_embd_fc), jnp.float32)
  plan2, plan4 = SH.make_plan(tp=2), SH.make_plan(tp=4)
  with pytest.raises(ValueError, match=r"w has shape \(128, 64\): not sharded for this plan"):
    SH.draft_round(plan2, params, SH.shard_ring(ring, plan2), new, 1, 1, 2, impl="xla")
  with pytest.raises(ValueError, match=r"stored as \[4, rows / 4"):
    SH.block_step(plan4, SH.shard_params(params, plan2), ring, 1, 2, impl="xla")
  with pytest.raises(ValueError, match="leading slot axis"):
    SH.draft_round_slots(plan2, SH.shard_params(params, plan2), ring, new[None], jnp.ones(1, int),
                         jnp.ones(1, int), jnp.ones(1, int), impl="xla")
  with pytest.raises(ValueError, match="cannot be split over dp=2"):
    SH.block_step(SH.make_plan(dp=2), params, ring, 1, 2, impl="xla")
  with pytest.raises(ValueError, match="needs 16 devices"):
    SH.make_plan(tp=4, dp=4)
  with pytest.raises(ValueError, match="q_heads and kv_heads over one axis"):
    SH.Plan(plan2.mesh, SH.Rules(kv_heads=None))
  with pytest.raises(ValueError, match="mesh axis 'x'"):
    SH.Plan(plan2.mesh, SH.Rules(ffn="x"))
