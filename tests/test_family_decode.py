"""The speculative loop with DFlash2 and DSpark drafters (greedy; the sampled loop's statistics
are in test_sampling.py): lossless against target-only decoding with the cut off and on, the
cut shortening the verify without a recompile, DSpark's width semantics, and the wrappers."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from benchmarks.common import count_compiles
from dflash_jax import decode as D
from dflash_jax.config import FULL, DFlash2Fields, DSparkFields
from dflash_jax.drafter import step as S
import tiny_models as TM

PROMPTS = [[5, 17, 3, 44, 9], [1, 2, 3], [60, 61, 7, 7, 7, 7, 8]]
MAX_NEW = 14


def family_drafter(tcfg, tparams, family, block=6):
  """A random drafter of the family for the tiny target (its embedding and head)."""
  cfg, _ = TM.drafter_weights(tcfg, seed=3, block_size=block)
  if family == "dflash2":
    cfg = dataclasses.replace(cfg, family="dflash2", family_fields=DFlash2Fields(
        conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5,
        output_multiplier=0.8, final_logit_softcapping=15.0, input_embedding_scale=1.3,
        is_causal=(True,)))
  else:
    cfg = dataclasses.replace(cfg, window=None, layer_types=(FULL,), family="dspark",
                              family_fields=DSparkFields(markov_rank=8, markov_head_type="rnn",
                                                         confidence_head=True,
                                                         confidence_with_markov=True))
  w = dfj.synthetic_drafter(cfg, seed=4, n_vocab=tcfg.vocab_size, with_target=False)
  w["tok_embd"], w["lm_head"] = tparams.embed, tparams.head   # device arrays, cast there
  return dfj.prepare_weights(cfg, w)


@pytest.fixture(scope="module")
def target():
  return TM.target(seed=1, logit_scale=3.0)


@pytest.fixture(scope="module")
def greedy_text(target):
  tcfg, tp = target
  return D.generate_target_only(tp, tcfg, PROMPTS, MAX_NEW).tokens


@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_greedy_loop_is_lossless_with_and_without_the_cut(target, greedy_text, family):
  tcfg, tp = target
  dp = family_drafter(tcfg, tp, family)
  models = TM.models(tcfg, tp, dp)
  width = 5
  gens = {}
  for cut in (0.0, 0.3, 1.0):
    dcfg = D.DecodeConfig(width=width, impl="xla", proposer=D.Drafter(cut=cut))
    with count_compiles() as names:
      g = D.generate(models, dcfg, PROMPTS, MAX_NEW)
    assert "jit(_rounds)" in names   # a new DecodeConfig compiles the loop once
    assert g.tokens == greedy_text, (family, cut)
    gens[cut] = g
  # cut 1: every value is below it, so no draft is ever verified (one token a round).
  h1 = gens[1.0].hist.sum(0)
  assert h1[0] == h1.sum() and gens[1.0].tau == 1.0
  # The drafter's drafts are accepted sometimes (the loop is not trivially target-only).
  assert gens[0.0].hist.sum(0)[1:].sum() > 0
  # A second run of the same config compiles nothing: the cut is data, per slot.
  dcfg = D.DecodeConfig(width=width, impl="xla", proposer=D.Drafter(cut=0.3))
  with count_compiles() as names:
    g = D.generate(models, dcfg, PROMPTS[::-1], MAX_NEW)
  assert "jit(_rounds)" not in names, names
  assert g.tokens == greedy_text[::-1]


def test_cut_masks_drafts_the_target_would_accept():
  """A cut draft is never accepted even when it equals the target's choice: the oracle proposes
  the target's own continuation (every draft right), and cut_length's per-slot counts bound
  the accepted drafts."""
  vals = jnp.asarray([[0.9, 0.8, 0.2, 0.9], [0.1, 0.9, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5]])
  np.testing.assert_array_equal(np.asarray(D.cut_length(vals, 0.5)), [2, 0, 4])
  np.testing.assert_array_equal(np.asarray(D.cut_length(vals, 0.0)), [4, 4, 4])
  s, n, v = 3, 4, 11
  logits = jax.nn.one_hot(jnp.arange(n + 1) % v, v)[None].repeat(s, 0) * 10.0
  drafts = jnp.broadcast_to(jnp.arange(n) % v, (s, n)).astype(jnp.int32)   # all correct
  st = D.DecodeState(cache=None, ring=None, tokens=jnp.zeros((s, 32), jnp.int32),
                     n_past=jnp.full((s,), 3), id_last=jnp.zeros(s, jnp.int32), pending=None,
                     n_new=jnp.zeros(s, jnp.int32), n_prompt=jnp.full((s,), 3),
                     max_len=jnp.full((s,), 30), done=jnp.zeros(s, bool),
                     rounds=jnp.zeros(s, jnp.int32), hist=jnp.zeros((s, n + 1), jnp.int32),
                     eos=jnp.full((s, 1), -1), key=jax.random.split(jax.random.key(0), s))

  class NoCache:
    def commit(self, cache, n_keep):
      return cache
  models = D.Models(target=None, drafter=None, d2t=None, target_cfg=NoCache())
  dcfg = D.DecodeConfig(width=n + 1, impl="xla")
  out = D.accept_commit(models, dcfg, st, D.Proposal(drafts, n_verify=D.cut_length(vals, 0.5)),
                        logits, None, jax.random.split(jax.random.key(1), s))
  np.testing.assert_array_equal(np.asarray(out.n_past), 3 + np.array([2, 0, 4]) + 1)
  # The committed token after a cut is the target's own at that row.
  np.testing.assert_array_equal(np.asarray(out.id_last), [2, 0, 4])


def test_dspark_width_is_rows_verified(target):
  """DecodeConfig.width counts the verified rows for every family: a DSpark block of w rows
  gives w drafts, so width w + 1 uses a block of w rows, up to block_size + 1."""
  tcfg, tp = target
  dp = family_drafter(tcfg, tp, "dspark", block=4)
  models = TM.models(tcfg, tp, dp)
  assert D.block_width(dp.cfg, 5) == 4
  D.check_models(models, D.DecodeConfig(width=5, impl="xla"))
  for width in (2, 6):
    with pytest.raises(ValueError, match=r"must lie in \[3, 5\] with a dspark drafter"):
      D.check_models(models, D.DecodeConfig(width=width, impl="xla"))
  g = D.generate(models, D.DecodeConfig(width=5, impl="xla"), PROMPTS[:1], 6)
  assert g.hist.shape == (1, 5)
  with pytest.raises(ValueError, match="cuts on its confidence head"):
    no_conf = dataclasses.replace(dp.cfg, family_fields=dataclasses.replace(
        dp.cfg.dspark, confidence_head=False, confidence_with_markov=False))
    D.check_models(models.replace(drafter=dp.replace(cfg=no_conf)),
                   D.DecodeConfig(width=5, impl="xla", proposer=D.Drafter(cut=0.5)))
  with pytest.raises(ValueError, match="cut must be a number in"):
    D.Drafter(cut=1.5)


@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_wrappers_draft_the_familys_drafts(family):
  """DFlashDrafter and BatchedDrafter of a DFlash2 / DSpark config return the family's greedy
  drafts (n = cfg.n_drafts(w)), those of propose_round_batched."""
  tcfg, tp = TM.target()
  dp = family_drafter(tcfg, tp, family)
  cfg = dp.cfg
  w = dfj.synthetic_drafter(cfg, seed=4, n_vocab=tcfg.vocab_size, with_target=False)
  w["tok_embd"], w["lm_head"] = np.asarray(tp.embed), np.asarray(tp.head)
  feats = dfj.synthetic_features(cfg, 12, seed=2)
  one = dfj.DFlashDrafter(cfg, w, impl="xla", capacity=64)
  one.inject(one.encode(feats), np.arange(12))
  drafts, logits = one.draft_round(np.zeros((4, cfg.n_embd_fc), np.float32), 0, 5, 12, width=4)
  assert drafts.shape == (cfg.n_drafts(4),) and logits.shape == (4, tcfg.vocab_size)
  many = dfj.BatchedDrafter(cfg, w, max_batch=2, impl="xla", capacity=64)
  many.join(1, feats)
  bd, _ = many.draft_round(np.zeros((2, 4, cfg.n_embd_fc), np.float32), np.zeros(2, int),
                           np.array([0, 5]), np.array([0, 12]), width=4)
  ring = jax.tree.map(lambda a: a[None], one.ring)
  _, d = S.propose_round_batched(one.params, ring, jnp.zeros((1, 2, cfg.n_embd_fc)),
                                 jnp.zeros(1, jnp.int32), jnp.array([5]), jnp.array([12]),
                                 jnp.ones(1, bool), width=4, impl="xla")
  np.testing.assert_array_equal(np.asarray(drafts), np.asarray(d.drafts[0]))
  np.testing.assert_array_equal(np.asarray(bd[1]), np.asarray(d.drafts[0]))
