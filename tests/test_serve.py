"""Slots that take the next prompt (issue 43 item 9): the Target protocol's `reset` and the
prefill of one slot alone (n_valid 0 elsewhere) for every family, then `decode.serve` against
decoding each prompt alone, with no recompilation as prompts come and go.

Per family: three sequences are prefilled to different lengths, one of them so close to the
capacity that a prefill of T rows would run past it (a write there would be clamped onto its
committed rows). Slot 1 is then reset and prefilled with a new prompt, the others with
n_valid 0. The next verify's logits must be, for slots 0 and 2, bitwise those of the cache
without the join, and for slot 1 those of a fresh cache holding only the new prompt."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
import tiny_models as TM
from dflash_jax import decode as D
from dflash_jax.models import muse_glimmer, qwen3, qwen3_5, qwen3_moe

CAP, T = 64, 16


def _family(name):
  if name.startswith("qwen3-"):
    cfg, p = TM.target(vocab=61, hidden=32, layers=2, seed=0)
    return cfg, p
  if name == "qwen3_5":
    L, F = qwen3_5.LINEAR, qwen3_5.FULL
    cfg = qwen3_5.TargetConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=(L, F, L),
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, rope_theta=1e4,
        partial_rotary_factor=0.5, max_position_embeddings=256)
    return cfg, qwen3_5.init_params(cfg, jax.random.key(0))
  if name == "muse_glimmer":
    cfg = muse_glimmer.MuseGlimmerConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e4,
        sliding_window=4, max_position_embeddings=256)
    return cfg, muse_glimmer.init_params(cfg, jax.random.key(0))
  cfg = qwen3_moe.Qwen3MoeConfig(
      vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
      num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=256)
  return cfg, qwen3_moe.init_params(cfg, jax.random.key(0))


# The protocol's prefill and verify run jitted, as the decoding loop runs them: one program
# each instead of every operation compiled on its own (eager, compiling took most of these
# tests' time).
@functools.partial(jax.jit, static_argnames=("cfg", "impl"))
def _prefill_jit(cfg, params, cache, rows, n_valid, impl):
  return cfg.prefill(params, cache, rows, n_valid, impl=impl)


@functools.partial(jax.jit, static_argnames=("cfg", "impl"))
def _verify_jit(cfg, params, cache, toks, impl):
  return cfg.verify(params, cache, toks, impl=impl)[1]


def _prefill(cfg, params, cache, rows, n_valid, impl):
  return _prefill_jit(cfg, params, cache, jnp.asarray(rows, jnp.int32),
                      jnp.asarray(n_valid, jnp.int32), impl)


def _verify_logits(cfg, params, cache, toks, impl):
  logits = _verify_jit(cfg, params, cache, jnp.asarray(toks, jnp.int32)[:, None], impl)
  return np.asarray(logits[:, 0])


# qwen3-pallas: the batch-invariant Pallas target (interpret mode here), whose cache kernel
# drops rows past the capacity; qwen3_5: K/V plus the recurrent state and conv window.
@pytest.mark.parametrize("family", ["qwen3-xla", "qwen3-pallas", "muse_glimmer", "qwen3_moe",
                                    "qwen3_5"])
def test_reset_and_prefill_one_slot_leave_the_others_as_they_were(family):
  cfg, params = _family(family)
  impl = "pallas" if family == "qwen3-pallas" else "xla"
  prefill = lambda *a: _prefill(cfg, params, *a, impl)
  logits = lambda *a: _verify_logits(cfg, params, *a, impl)
  rng = np.random.default_rng(1)
  lengths = [CAP - 6, 9, 30]   # slot 0 ends 6 slots short of the capacity: 6 + T > CAP
  rows = np.zeros((3, CAP), np.int32)
  for b, n in enumerate(lengths):
    rows[b, :n] = rng.integers(0, cfg.vocab_size, n)
  cache = prefill(cfg.init_cache(3, CAP), rows, lengths)[0]
  probe = rng.integers(0, cfg.vocab_size, 3)
  before = logits(cache, probe)

  new = rng.integers(0, cfg.vocab_size, 11)
  join = np.zeros((3, T), np.int32)
  join[1, :len(new)] = new
  join[0] = join[2] = rng.integers(0, cfg.vocab_size, T)   # what the other slots' rows hold
  cache = cfg.reset(cache, jnp.array([False, True, False]))
  cache = prefill(cache, join, [0, len(new), 0])[0]
  after = logits(cache, probe)
  np.testing.assert_array_equal(after[[0, 2]], before[[0, 2]])

  fresh = prefill(cfg.init_cache(1, CAP), join[1:2], [len(new)])[0]
  alone = logits(fresh, probe[1:2])
  np.testing.assert_allclose(after[1], alone[0], rtol=1e-5, atol=1e-5)
  assert not np.allclose(after[1], before[1], atol=1e-3)   # slot 1 really holds a new prompt


def _models():
  tcfg, tp = TM.target(vocab=97, hidden=64, layers=2, seed=0)
  return TM.models(tcfg, tp, TM.drafter(tcfg, tp, seed=1)), tcfg, tp


def test_serve_equals_each_prompt_alone_and_compiles_once():
  """9 prompts of different lengths on 3 slots, an EOS that some continuations reach early
  (slots free up at different rounds): every output equals decoding the prompt alone; the
  join and the rounds compile once each for the whole run."""
  models, tcfg, tp = _models()
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, 96, rng.integers(2, 25)).tolist() for _ in range(9)]
  plain = D.generate_target_only(tp, tcfg, prompts, 24)
  counts = np.bincount([t for row in plain.tokens for t in row[:12]], minlength=97)
  eos = int(np.argmax(counts))   # a token several continuations reach before max_new
  dcfg = D.DecodeConfig(width=6, impl="xla")
  alone = [D.generate(models, dcfg, [p], 24, eos_ids=(eos,)).tokens[0] for p in prompts]
  assert len({len(a) for a in alone}) > 1, alone   # the slots do free up at different times
  before = (D._join._cache_size(), D.run_rounds._cache_size())
  done_order = []
  results, stats = D.serve(models, dcfg, prompts, 24, n_slots=3, eos_ids=(eos,),
                           rounds_per_call=2, on_done=lambda r: done_order.append(r.index))
  assert [r.tokens for r in results] == alone
  assert [r.index for r in results] == list(range(9)) and sorted(done_order) == list(range(9))
  assert (D._join._cache_size(), D.run_rounds._cache_size()) == (before[0] + 1, before[1] + 1)
  assert stats.n_tokens == sum(len(a) for a in alone) and stats.n_slots == 3
  for r in results:
    assert r.hist.sum() == r.rounds and 1.0 <= r.tau <= 6


def test_serve_with_more_slots_than_prompts_and_prompt_lookup():
  models, tcfg, tp = _models()
  prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6]]
  lookup = D.Models(target=tp, drafter=None, d2t=None, target_cfg=tcfg)
  dcfg = D.DecodeConfig(width=4, impl="xla", proposer=D.Lookup(2))
  results, stats = D.serve(lookup, dcfg, prompts, 10, n_slots=8)
  assert stats.n_slots == 2
  assert [r.tokens for r in results] == D.generate_target_only(tp, tcfg, prompts, 10).tokens


def test_serve_through_the_protocol_only():
  """The recurrent HashTarget of test_target_protocol (its state must be reset, not just its
  length): serve equals the target's own greedy continuation computed on the host."""
  from test_target_protocol import HashTarget, _drafter, _params, _python_greedy
  t = HashTarget()
  params = _params(t, seed=0)
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, t.vocab_size, n).tolist() for n in (1, 4, 9, 2, 7)]
  models = D.Models(target=params, drafter=_drafter(t, seed=2), d2t=None, target_cfg=t)
  results, _ = D.serve(models, D.DecodeConfig(width=6, impl="xla"), prompts, 15, n_slots=2)
  assert [r.tokens for r in results] == [_python_greedy(params, p, 15) for p in prompts]


def test_serve_input_errors():
  models, _, _ = _models()
  dcfg = D.DecodeConfig(width=4, impl="xla")
  with pytest.raises(ValueError, match="n_slots must be an int >= 1"):
    D.serve(models, dcfg, [[1]], 4, n_slots=0)
  with pytest.raises(ValueError, match="outside the vocab"):
    D.serve(models, dcfg, [[1], [500]], 4, n_slots=2)
