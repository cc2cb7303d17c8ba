"""Speculative decoding (dflash_jax.decode) with the Qwen3.5 hybrid target: lossless greedy
decoding under both rollbacks with every acceptance length, and the committed tokens of
speculative sampling distributed as the target's own sampling, with DFlash drafters that
tap Gated DeltaNet and attention layers. The loop reaches the target only through the
Target protocol (Models.target_cfg is the hybrid's config)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from dflash_jax import decode as D
from dflash_jax import sampling as SP
from benchmarks.oracle import Oracle
from dflash_jax.models import qwen3_5 as M
from reference.targets import qwen3_5 as R
from test_decode import _noisy_oracle
from test_sampling import ALPHA, N_TOK, PROMPT, V, _chi2_p, _draws, _np_probs

L, F = M.LINEAR, M.FULL
TCFG = M.TargetConfig(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=(L, L, F, L, F),
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, rope_theta=1e4, partial_rotary_factor=0.5,
    max_position_embeddings=512)
# HF hidden_states indices: 1 = after GDN layer 0, 3 = after the attention layer 2, 4 = after
# GDN layer 3.
TAPS = (1, 3, 4)
PROMPT_LENGTHS = (1, 3, 7, 12, 20)
MAX_NEW = 24


def _drafter(tcfg, tparams, taps, seed=1, block_size=8, window=32, n_head=4, n_head_kv=2,
             d2t=None):
  cfg = dataclasses.replace(dfj.TINY_CONFIG, n_layer=1, n_embd=tcfg.hidden_size, n_head=n_head,
                            n_head_kv=n_head_kv, target_layers=taps,
                            mask_token_id=tcfg.vocab_size - 1, block_size=block_size,
                            window=window)
  w = dfj.synthetic_drafter(cfg, seed=seed, with_target=False)
  w["tok_embd"] = np.asarray(tparams.embed)
  head = np.asarray(tparams.head)
  w["lm_head"] = head if d2t is None else head[np.asarray(d2t)]
  return dfj.prepare_weights(cfg, w)


@pytest.fixture(scope="module")
def pair():
  tp = M.init_params(TCFG, jax.random.key(0))
  return tp, _drafter(TCFG, tp, TAPS)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(2)
  return [rng.integers(0, TCFG.vocab_size, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(pair, prompts):
  """Target-only greedy continuations, each checked against the uncached forward: every
  generated token is the argmax of the forward over the prompt and the tokens before it."""
  tp, _ = pair
  g = D.generate_target_only(tp, TCFG, prompts, MAX_NEW)
  # One causal forward of every sequence padded at the end (the padding changes no earlier
  # row): one compilation for all prompts.
  seqs = [p + out[:-1] for p, out in zip(prompts, g.tokens)]
  n = max(len(s) for s in seqs)
  logits, _ = M.forward_jit(tp, TCFG, np.asarray([s + [0] * (n - len(s)) for s in seqs],
                                                 np.int32))
  for i, (p, out) in enumerate(zip(prompts, g.tokens)):
    assert len(out) == MAX_NEW
    np.testing.assert_array_equal(np.argmax(logits[i, len(p) - 1:len(p) - 1 + MAX_NEW], -1),
                                  out)
  return g.tokens


@pytest.mark.parametrize("rollback", M.ROLLBACKS)
@pytest.mark.parametrize("width, oracle", [(8, False), (5, True)], ids=["random-w8", "oracle-w5"])
def test_greedy_speculative_is_lossless(pair, prompts, reference, rollback, width, oracle):
  """Greedy speculative output == target-only output; with the noisy oracle (a quarter of
  the target's own tokens replaced) rounds accept every number of drafts, so each commit
  restores the recurrent state after a different row."""
  tp, dp = pair
  tcfg = dataclasses.replace(TCFG, rollback=rollback)
  m = D.Models(target=tp, drafter=dp, d2t=None, target_cfg=tcfg)
  kw = _noisy_oracle(prompts, reference, seed=width, vocab=TCFG.vocab_size) if oracle else {}
  dcfg = D.DecodeConfig(width=width, impl="xla", proposer=Oracle() if oracle else D.Drafter())
  g = D.generate(m, dcfg, prompts, MAX_NEW, rounds_per_call=3, **kw)
  assert g.tokens == reference
  assert (g.hist.sum(1) == g.rounds).all()
  if oracle:
    hist = g.hist.sum(0)
    assert hist[0] > 0 and (hist[1:-1] > 0).sum() >= 2 and hist[-1] > 0, hist


def test_greedy_pallas_kernels(pair, prompts, reference):
  """The target's Pallas kernels (interpret mode here) in the loop: still lossless."""
  tp, dp = pair
  m = D.Models(target=tp, drafter=dp, d2t=None, target_cfg=TCFG)
  kw = _noisy_oracle(prompts[2:4], reference[2:4], seed=3, vocab=TCFG.vocab_size)
  dcfg = D.DecodeConfig(width=4, impl="xla", target_impl="pallas", proposer=Oracle())
  g = D.generate(m, dcfg, prompts[2:4], 10, **kw)
  assert g.tokens == [r[:10] for r in reference[2:4]]


# --- sampling -----------------------------------------------------------------------------------

CALLS = 4   # of test_sampling's _draws: 25000 slots each
SMALL = M.TargetConfig(
    vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, layer_types=(L, F),
    linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_num_key_heads=1, linear_num_value_heads=2, rope_theta=1e4, partial_rotary_factor=0.5,
    max_position_embeddings=64)


def _exact(cfg, params, s: SP.Sampling):
  """P(t1, t2 | PROMPT) of target-only sampling, [V, V], from the float64 reference."""
  tensors, config = M.params_to_hf(cfg, params), cfg.to_hf()

  def p_next(seq):
    return _np_probs(R.forward(tensors, config, np.array(seq))[1][-1], s)
  p1 = p_next(PROMPT)
  return np.stack([p1[a] * p_next(PROMPT + [a]) for a in range(V)])


def test_committed_tokens_follow_target_sampling():
  """Sampled proposals over a reduced draft vocab, top-k and top-p, width 3 (the replay
  rollback): 10^5 two-token continuations against the exact distribution (chi-square,
  p >= 1e-3), which a 10% hotter temperature must fail; acceptances, rejections and bonus
  tokens all occur."""
  params = M.init_params(SMALL, jax.random.key(11))
  d2t = np.array([0, 2, 3, 5, 6])
  samp = SP.Sampling(0.8, top_k=5, top_p=0.9, proposals="sampled")
  drafter = _drafter(SMALL, params, (1, 2), seed=5, block_size=4, window=8, n_head=2,
                     n_head_kv=1, d2t=d2t)
  models = D.Models(target=params, drafter=drafter, d2t=jnp.asarray(d2t, jnp.int32),
                    target_cfg=SMALL)
  dcfg = D.DecodeConfig(width=3, sampling=samp, impl="xla")
  prefilled = D.start(models, dcfg, [PROMPT], N_TOK)
  runs = [_draws(models, dcfg, prefilled, seed=100 + i) for i in range(CALLS)]
  toks = np.concatenate([r[0] for r in runs])
  counts = np.zeros((V,) * N_TOK, np.int64)
  np.add.at(counts, tuple(toks.T), 1)
  p = _chi2_p(counts, _exact(SMALL, params, samp))
  assert p >= ALPHA, f"chi-square p = {p:.2e} < {ALPHA}"
  hotter = dataclasses.replace(samp, temperature=samp.temperature * 1.1)
  assert _chi2_p(counts, _exact(SMALL, params, hotter)) < ALPHA, "cannot see a 10% change"
  hist = sum(r[1] for r in runs).sum(0)
  assert hist[0] > 0 and hist[1:].sum() > 0 and hist[-1] > 0, hist


@pytest.mark.gpu
@pytest.mark.parametrize("rollback", M.ROLLBACKS)
def test_greedy_lossless_gpu(rollback):
  """A float32 hybrid at real head shapes (8 layers, hidden 1024, 8 / 2 heads x 256, 16 key /
  48 value heads x 128) with a drafter tapping GDN and attention layers, every kernel
  compiled: speculative greedy output == target-only output at widths 16 and 5 (noisy
  oracle drafts: every acceptance length)."""
  tcfg = M.TargetConfig(
      vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
      num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=16,
      linear_num_value_heads=48, max_position_embeddings=4096, rollback=rollback)
  tp = M.init_params(tcfg, jax.random.key(0))
  dp = _drafter(tcfg, tp, (1, 4, 6, 8), block_size=16, window=64, n_head=8, n_head_kv=2)
  m = D.Models(target=tp, drafter=dp, d2t=None, target_cfg=tcfg)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, tcfg.vocab_size, n).tolist() for n in (5, 40, 100)]
  ref = D.generate_target_only(tp, tcfg, prompts, 48, target_impl="pallas").tokens
  for width in (16, 5):
    dcfg = D.DecodeConfig(width=width, target_impl="pallas", proposer=Oracle())
    g = D.generate(m, dcfg, prompts, 48,
                   **_noisy_oracle(prompts, ref, seed=width, vocab=tcfg.vocab_size, length=256))
    assert g.tokens == ref, width
    assert g.hist[:, 1:].sum() > 0
