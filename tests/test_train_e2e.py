"""A tiny drafter trained for a few dozen steps against a tiny frozen target (the CI check of
issue 16 item 4): the loss falls, and its tau in the real decoding loop beats the untrained
drafter's; the evaluation (target-only, drafters, prompt lookup) is lossless.

The target is first trained briefly on a corpus of four fixed 16-token phrases in random
order, so its greedy continuations are mostly deterministic (within a phrase) and learnable.
The drafter trains on those continuations (self-distillation: exactly what decoding rewards).
All seeded and CPU-sized; the drafter step shares its compile with tests/test_train_step.py.
"""
import jax
import jax.numpy as jnp
import numpy as np

import dflash_jax as dfj
from dflash_jax.models import qwen3
from dflash_jax.train import data as D
from dflash_jax.train import evaluate as E
from dflash_jax.train import forward as F
from dflash_jax.train import recipes
from dflash_jax.train import trainer as TR

from _train_common import CFG, TC, TCFG, drafter_step, fast_jit

PROMPT, NEW = 8, 24
PHRASES = np.random.default_rng(0).permutation(64).reshape(4, 16)


def _phrases(n, seed):
  order = np.random.default_rng(seed).integers(0, len(PHRASES), n)
  return np.concatenate([PHRASES[i] for i in order]).astype(np.int32)


def _trained_target(steps=30):
  oc = TR.OptimConfig(lr=1e-2, total_steps=steps, warmup_steps=2)
  step = fast_jit(TR.target_train_step, static_argnames=("cfg", "oc", "compute_dtype"),
                  donate_argnames=("state",))
  seqs = D.chunk(_phrases(400, seed=1), 32)
  state = TR.init_state(qwen3.init_params(TCFG, jax.random.key(0)), oc)
  for s in range(steps):
    rows = D.epoch_rows(seqs.shape[0], 16, 0, s)[1]
    state, m = step(state, jnp.asarray(seqs[rows]), cfg=TCFG, oc=oc, compute_dtype="bf16")
  assert float(m["acc"]) > 0.9   # within-phrase successors learnt
  return state.params


def _drafter(target, w):
  host = recipes.host_weights(w)
  host["tok_embd"], host["lm_head"] = np.asarray(target.embed), np.asarray(target.head)
  return dfj.prepare_weights(CFG, host)


def test_training_lowers_the_loss_and_raises_tau():
  target = _trained_target()
  rng = np.random.default_rng(2)
  prompts = np.stack([_phrases(2, 100 + i)[r:r + PROMPT]
                      for i, r in enumerate(rng.integers(0, 16, 72))])
  tokens, mask = recipes.distill_data(target, TCFG, prompts[:64], NEW, batch_size=64)
  train = D.DrafterData(tokens, mask, batch_size=8, n_anchors=8, seed=0)

  w0 = F.init_drafter(CFG, seed=1)
  state = TR.init_state(w0, TC.optim)
  losses = []
  for step in range(TC.optim.total_steps):
    state, m = drafter_step(state, target, train.batch(step), cfg=CFG, target_cfg=TCFG, tc=TC)
    losses.append(float(m["loss"]))
  assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses
  rows = E.evaluate(target, TCFG, [("untrained", _drafter(target, w0)),
                                   ("trained", _drafter(target, state.params))],
                    prompts[64:], NEW, widths=(CFG.block_size,), impl="xla", out=lambda s: None)
  by = {r.method.split(" (")[0]: r for r in rows}
  assert by["trained"].tau > by["untrained"].tau + 0.5, E.markdown_table(rows)
  for r in rows:   # greedy speculative decoding is lossless, whatever proposes
    assert r.same_as_target == r.n_prompts == 8, E.markdown_table(rows)
    assert r.n_tokens == 8 * NEW
  # The phrases recur, so looking up the committed text finds continuations too.
  assert by["prompt lookup"].tau > 1.2, E.markdown_table(rows)
  assert "| trained | 8 |" in E.markdown_table(rows)
