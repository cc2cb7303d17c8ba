"""Sampling (SPEC.md section 9): the filters against numpy, and the committed tokens of
speculative sampling distributed as the target's own sampling, by chi-square tests.

The rejection rule alone (`verify_sampled`: no proposals, one-hot, sampled, DFlash2's sparse
q over candidates, and a verify cut short per slot) gets 10^5 draws per case on fixed rows.
End to end (target + drafter + loop), 10^5 sequences of 2 tokens (4 calls of 25000 slots,
every slot starting from the same prefilled state with its own PRNG key) are compared with the
exact target-only distribution of the 8^2 outcomes, computed independently in float64 numpy
(reference/targets/qwen3.py plus numpy filters), for: a DFlash drafter's sampled proposals over
a reduced draft vocab with top-k and top-p; a DFlash2 drafter's sampled selector walk (sparse
q), with and without its p-min cut; a DSpark drafter's sampled Markov chain, with and without
its confidence cut. Cells with an expected count below 5 are pooled.
Each chi-square comparison fails when p < ALPHA = 1e-3, its false alarm rate (13 comparisons
that must pass: at most 1.3% for the file, over random seeds; the seeds here are fixed, so a
run is reproducible). Power checks: the end-to-end counts must REJECT the distribution at a
10% different temperature, and the rule's second tokens must reject the first row's p.
"""
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import dflash_jax as dfj
from dflash_jax import decode as D
from dflash_jax.config import FULL, DFlash2Fields, DSparkFields
from dflash_jax import sampling as SP
from dflash_jax.models import qwen3 as Q
from reference.targets.qwen3 import hidden_states
import tiny_models as TM

ALPHA = 1e-3
V, N_TOK, PROMPT = 8, 2, [3, 1, 4]
SLOTS, CALLS = 25_000, 4


def _np_probs(logits, s: SP.Sampling):
  """The target distribution of section 9 in numpy (float64), written independently."""
  z = np.asarray(logits, np.float64) / s.temperature
  if 0 < s.top_k < z.shape[-1]:
    z = np.where(z >= np.sort(z)[-s.top_k], z, -np.inf)
  p = np.exp(z - z.max())
  p /= p.sum()
  if s.top_p < 1:
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    floor = p[order][before < s.top_p].min()
    z = np.where(p >= floor, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
  return p


def test_filters_match_numpy():
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((64, 11)).astype(np.float32)
  logits[:8, 3] = logits[:8, 5]   # ties
  for s in (SP.Sampling(1.0), SP.Sampling(0.6, top_k=3), SP.Sampling(1.3, top_p=0.5),
            SP.Sampling(0.8, top_k=6, top_p=0.8), SP.Sampling(2.0, top_k=1)):
    got = np.asarray(SP.probs(jnp.asarray(logits), s))
    want = np.stack([_np_probs(l, s) for l in logits])
    np.testing.assert_allclose(got, want, atol=1e-6, err_msg=str(s))
  # By hand: probs .644 .237 .087 .032; top_p 0.7 keeps the first two (mass before: 0, .644).
  p = np.asarray(SP.probs(jnp.asarray([3.0, 2.0, 1.0, 0.0]), SP.Sampling(1.0, top_p=0.7)))
  np.testing.assert_allclose(p, [np.e / (np.e + 1), 1 / (np.e + 1), 0, 0], rtol=1e-6)


def test_sampling_config_errors():
  for kw, msg in ((dict(temperature=-1), "temperature"), (dict(top_k=-2), "top_k"),
                  (dict(top_p=0), "top_p"), (dict(proposals="beam"), "proposals")):
    with pytest.raises(ValueError, match=msg):
      SP.Sampling(**kw)


@pytest.mark.parametrize("proposals", ["none", "greedy", "sampled", "sparse", "sampled-cut"])
def test_rejection_rule_chi_square(proposals):
  """`verify_sampled` alone, 10^5 vmapped draws on fixed rows p[0..2]: the first committed
  token is distributed as p[0], and the next one, once the first draft is accepted, as p[1]
  (proposals none = target-only decoding; greedy = one-hot q at fixed drafts; sampled =
  drafts drawn from q; sparse = drafts drawn from a q over 4 candidate ids per row, given as
  (candidates, probabilities); sampled-cut = sampled, each draw verifying a random 0..2 of
  its drafts)."""
  rng = np.random.default_rng(4)
  n_draw, v = 100_000, 12
  s = SP.Sampling(0.9, top_k=10, top_p=0.95)
  logits = rng.standard_normal((3, v)).astype(np.float32) * 2
  p = np.asarray(SP.probs(jnp.asarray(logits), s))
  n = 0 if proposals == "none" else 2
  keys = jax.random.split(jax.random.key(5), n_draw)
  q = candidates = n_valid = None
  draw_keys = jax.random.split(jax.random.key(6), n_draw)
  if proposals in ("sampled", "sampled-cut"):
    q1 = jax.nn.softmax(jnp.asarray(rng.standard_normal((n, v)), jnp.float32))
    drafts = jax.vmap(lambda k: jax.random.categorical(k, jnp.log(q1)))(
        draw_keys).astype(jnp.int32)
    q = jnp.broadcast_to(q1, (n_draw, n, v))
    if proposals == "sampled-cut":
      n_valid = jnp.asarray(rng.integers(0, n + 1, n_draw), jnp.int32)
  elif proposals == "sparse":
    # Candidates include p's filtered-out ids and miss some of its mass: both residual cases.
    cand = jnp.asarray([[int(np.argmax(p[0])), 0, 5, 11], [2, 7, 3, 9]], jnp.int32)
    q1 = jax.nn.softmax(jnp.asarray(rng.standard_normal((n, 4)), jnp.float32))
    pick = jax.vmap(lambda k: jax.random.categorical(k, jnp.log(q1)))(draw_keys)
    drafts = jnp.take_along_axis(cand[None], pick[..., None], axis=-1)[..., 0]
    q = jnp.broadcast_to(q1, (n_draw, n, 4))
    candidates = jnp.broadcast_to(cand, (n_draw, n, 4))
  else:
    drafts = jnp.broadcast_to(jnp.asarray([int(np.argmax(p[0])), 3][:n], jnp.int32), (n_draw, n))
  p_rows = jnp.broadcast_to(p[:n + 1], (n_draw, n + 1, v))
  n_ok, t = jax.jit(SP.verify_sampled)(keys, drafts, p_rows, q, candidates, n_valid)
  if n_valid is not None:
    assert (np.asarray(n_ok) <= np.asarray(n_valid)).all()
  n_ok, t, drafts = np.asarray(n_ok), np.asarray(t), np.asarray(drafts)
  first = np.where(n_ok >= 1, drafts[:, 0], t) if n else t
  want = np.stack([_np_probs(l, s) for l in logits])
  assert np.bincount(first, minlength=v)[want[0] == 0].sum() == 0   # filtered: never drawn
  assert _chi2_p(np.bincount(first, minlength=v), want[0]) >= ALPHA
  if n:
    acc = n_ok >= 1
    assert 0 < acc.mean() < 1
    second = np.where(n_ok >= 2, drafts[:, 1], t)[acc]
    assert _chi2_p(np.bincount(second, minlength=v), want[1]) >= ALPHA
    assert _chi2_p(np.bincount(second, minlength=v), want[0]) < ALPHA   # power: p[1] != p[0]


@pytest.fixture(scope="module")
def target():
  cfg = Q.TargetConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       rope_theta=1e4, max_position_embeddings=64)
  return cfg, Q.init_params(cfg, jax.random.key(11))


def _exact(cfg, params, s: SP.Sampling):
  """P(t1, t2 | PROMPT) of target-only sampling, [V, V], float64."""
  def p_next(seq):
    return _np_probs(hidden_states(params, cfg, np.array(seq))[1][-1], s)
  p1 = p_next(PROMPT)
  return np.stack([p1[a] * p_next(PROMPT + [a]) for a in range(V)])


def _drafter(cfg, params, d2t=None, family="dflash"):
  dc = dataclasses.replace(dfj.TINY_CONFIG, n_layer=1, n_embd=cfg.hidden_size, n_head=2,
                           n_head_kv=1, target_layers=(0, 1), mask_token_id=V - 1,
                           block_size=4, window=8)
  if family == "dflash2":
    dc = dataclasses.replace(dc, family="dflash2", family_fields=DFlash2Fields(
        conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=3,
        output_multiplier=0.7, final_logit_softcapping=5.0, input_embedding_scale=1.2))
  elif family == "dspark":
    dc = dataclasses.replace(dc, window=None, layer_types=(FULL,), family="dspark",
                             family_fields=DSparkFields(markov_rank=4, markov_head_type="vanilla",
                                                        confidence_head=True,
                                                        confidence_with_markov=True))
  w = dfj.synthetic_drafter(dc, seed=5, n_vocab=V, with_target=False)
  w["tok_embd"] = np.asarray(params.embed)
  head = np.asarray(params.head)
  w["lm_head"] = head if d2t is None else head[d2t]
  return dfj.prepare_weights(dc, w)


def _draws(models, dcfg, prefilled, seed):
  """N_TOK-token continuations of PROMPT, one per slot, SLOTS slots: [SLOTS, N_TOK]."""
  st = jax.tree.map(lambda a: jnp.broadcast_to(a, (SLOTS, *a.shape[1:])),
                    prefilled.replace(key=None))
  st = st.replace(key=jax.random.split(jax.random.key(seed), SLOTS))
  st = D.run_rounds(models, dcfg, st, jnp.int32(N_TOK))
  assert bool(st.done.all())
  return np.asarray(st.tokens[:, len(PROMPT):len(PROMPT) + N_TOK]), np.asarray(st.hist)


def _chi2_p(counts, expected_p):
  e = expected_p.ravel() * counts.sum()
  o = counts.ravel().astype(np.float64)
  small = e < 5
  e = np.append(e[~small], e[small].sum())
  o = np.append(o[~small], o[small].sum())
  keep = e > 0
  return stats.chi2.sf(((o[keep] - e[keep]) ** 2 / e[keep]).sum(), keep.sum() - 1)


# (sampling, width, d2t, drafter family, cut). Width 3 verifies 2 drafts: DFlash and DFlash2
# draft them from a block of 3 rows, DSpark from a block of 2 (its shifted rows).
CASES = {
    "sampled-proposals-topk-topp-d2t": (
        SP.Sampling(0.8, top_k=5, top_p=0.9, proposals="sampled"), 3, np.array([0, 2, 3, 5, 6]),
        "dflash", 0.0),
    "dflash2-sampled-walk-topk": (SP.Sampling(0.8, top_k=5, proposals="sampled"), 3, None,
                                  "dflash2", 0.0),
    # The cuts fall between the second row's values, which depend on the sampled first draft.
    "dflash2-sampled-walk-pmin-cut": (SP.Sampling(1.0, proposals="sampled"), 3, None,
                                      "dflash2", 0.8),
    "dspark-sampled-chain-topp": (SP.Sampling(0.8, top_p=0.9, proposals="sampled"), 3, None,
                                  "dspark", 0.0),
    "dspark-sampled-chain-confidence-cut": (SP.Sampling(1.0, proposals="sampled"), 3, None,
                                            "dspark", 0.3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_committed_tokens_follow_target_sampling(target, case):
  cfg, params = target
  samp, width, d2t, family, cut = CASES[case]
  drafter = None if width == 1 else _drafter(cfg, params, d2t, family)
  models = D.Models(target=params, drafter=drafter,
                    d2t=None if d2t is None else jnp.asarray(d2t, jnp.int32), target_cfg=cfg)
  dcfg = D.DecodeConfig(width=width, sampling=samp, impl="xla", proposer=D.Drafter(cut=cut))
  prefilled = D.start(models, dcfg, [PROMPT], N_TOK)
  runs = [_draws(models, dcfg, prefilled, seed=100 + i) for i in range(CALLS)]
  toks = np.concatenate([r[0] for r in runs])
  counts = np.zeros((V,) * N_TOK, np.int64)
  np.add.at(counts, tuple(toks.T), 1)
  p = _chi2_p(counts, _exact(cfg, params, samp))
  assert p >= ALPHA, f"{case}: chi-square p = {p:.2e} < {ALPHA}"
  hotter = dataclasses.replace(samp, temperature=samp.temperature * 1.1)
  assert _chi2_p(counts, _exact(cfg, params, hotter)) < ALPHA, "the test cannot see a 10% change"
  if width > 1:   # acceptance and rejection both happen, and so do bonus tokens
    hist = sum(r[1] for r in runs).sum(0)
    assert hist[0] > 0 and hist[1:].sum() > 0 and hist[-1] > 0, hist
  # Seeded: the same seed reproduces every token, another seed does not.
  assert (runs[1][0] != runs[0][0]).any()
  if case == "sampled-proposals-topk-topp-d2t":
    np.testing.assert_array_equal(_draws(models, dcfg, prefilled, seed=100)[0], runs[0][0])
