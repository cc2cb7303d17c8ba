"""The decoding loop (dflash_jax.decode) on the Muse-Glimmer and Qwen3-MoE targets, through the
Target protocol only: lossless greedy speculative decoding, the committed tokens of
speculative sampling distributed as the target's own sampling (chi-square against the float64
references), and a DFlash drafter tapping Muse-Glimmer's published layers [1, 13, 25, 37, 49]
(HF ids; `target_layers` = those + 1) on a 52-layer Muse-Glimmer of small width, whose drafts
equal the numpy drafter's fed the reference target's features and the RAW embedding."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from dflash_jax import decode as D
from dflash_jax import sampling as SP
from dflash_jax.models import muse_glimmer as M
from dflash_jax.models import qwen3, qwen3_5
from dflash_jax.models import qwen3_moe as Q
from reference import DFlashRef
from reference.targets import muse_glimmer as RM
from reference.targets import qwen3_moe as RQ
import target_checkpoints as TC
from benchmarks.oracle import Oracle
import tiny_models as TM
from test_qwen3_5 import TINY as QWEN3_5
from test_sampling import ALPHA, _chi2_p, _np_probs
from test_target import TINY as QWEN3

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")

MUSE = M.MuseGlimmerConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, rope_theta=1e4, sliding_window=6,
                           max_position_embeddings=512)
MOE = Q.Qwen3MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                       mlp_only_layers=(1,), rope_theta=1e4, max_position_embeddings=512)
FAMILIES = {"muse": (M, MUSE, RM, lambda n: "layernorm" in n),
            "moe": (Q, MOE, RQ, lambda n: False)}
LOADED = {"qwen3": (qwen3, QWEN3), "muse": (M, MUSE), "moe": (Q, MOE),
          "qwen3_5": (qwen3_5, QWEN3_5)}
PROMPT_LENGTHS = (1, 3, 8, 17)
MAX_NEW = 20


def _target(name, cfg=None, seed=0):
  family, default, ref, centered = FAMILIES[name]
  cfg = cfg or default
  t = TC.random_tensors(family.hf_tensor_shapes(cfg), seed, centered)
  return cfg, t, family.params_from_hf(cfg, dict(t), "fp32")


@pytest.mark.parametrize("name", list(LOADED))
def test_params_from_hf_takes_each_tensor_out_as_it_reads_it(name):
  """`load_target` hands a family's params_from_hf every stored tensor on the device; each
  piece leaves the dict once read, so the device holds it only until its fused / cast form
  exists (a 30B checkpoint needs its size once, not twice). The params equal those made
  from a copy of the dict, which the caller keeps whole."""
  family, cfg = LOADED[name]
  host = TC.random_tensors(family.hf_tensor_shapes(cfg), 3)
  t = {n: jnp.asarray(a) for n, a in host.items()}
  params = family.params_from_hf(cfg, t, "bf16")
  assert t == {}
  kept = dict(host)
  again = family.params_from_hf(cfg, kept, "bf16")
  assert kept == {} and set(host) == set(family.hf_tensor_shapes(cfg))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _reference_greedy(ref_mod, cfg, t, prompt, n):
  """The reference target's (module ref_mod's, float64) greedy continuation of n tokens,
  each step's margin over the runner-up checked."""
  seq = list(prompt)
  for _ in range(n):
    logits = ref_mod.hidden_states(cfg.to_hf(), t, seq)[1][-1]
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] > 1e-4, "near tie: pick another seed"
    seq.append(int(np.argmax(logits)))
  return seq[len(prompt):]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_speculative_is_lossless(name):
  """Four slots of different prompt lengths: speculative output (a random drafter at width
  6, and noisy oracle drafts at width 5: partial accepts, rollbacks of every length, bonus
  tokens) equals target-only decoding, which equals the reference's greedy continuation."""
  cfg, t, tp = _target(name)
  ref_mod = FAMILIES[name][2]
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
  base = D.generate_target_only(tp, cfg, prompts, MAX_NEW).tokens
  assert base[2][:8] == _reference_greedy(ref_mod, cfg, t, prompts[2], 8)
  models = TM.models(cfg, tp, TM.drafter(cfg, tp, seed=2))
  g = D.generate(models, D.DecodeConfig(width=6, impl="xla"), prompts, MAX_NEW)
  assert g.tokens == base
  orc = TM.noisy_oracle_state(prompts, base, 3, cfg.vocab_size, 256)
  g = D.generate(models, D.DecodeConfig(width=5, impl="xla", proposer=Oracle()), prompts,
                 MAX_NEW, proposer_state=orc, rounds_per_call=3)
  assert g.tokens == base
  assert g.hist[:, 1:-1].sum() > 0 and g.hist[:, -1].sum() > 0, g.hist


# --- sampling --------------------------------------------------------------------------------

V, N_TOK, PROMPT = 8, 2, [3, 1, 4]
SLOTS, CALLS = 25_000, 4
# Logits that the softcap bends hard (multiplier 1, cap 1.5): a sampled path that skipped
# either would be seen.
SAMPLING_CFGS = {
    "muse": M.MuseGlimmerConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                                num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=16, rope_theta=1e4,
                                sliding_window=2, output_multiplier=3.0,
                                final_logit_softcapping=1.5, max_position_embeddings=64),
    "moe": Q.Qwen3MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=16, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, rope_theta=1e4, max_position_embeddings=64),
}


def _exact(name, cfg, t, s: SP.Sampling):
  """P(t1, t2 | PROMPT) of target-only sampling, [V, V], float64, from the reference."""
  ref_mod = FAMILIES[name][2]

  def p_next(seq):
    return _np_probs(ref_mod.hidden_states(cfg.to_hf(), t, np.array(seq))[1][-1], s)
  p1 = p_next(PROMPT)
  return np.stack([p1[a] * p_next(PROMPT + [a]) for a in range(V)])


@pytest.mark.parametrize("name", list(SAMPLING_CFGS))
def test_committed_tokens_follow_target_sampling(name):
  """10^5 two-token continuations (sampled proposals from a random drafter, top-k and top-p)
  against the exact target-only distribution; fails at p < ALPHA = 1e-3 (the false-alarm
  rate of each of the two comparisons here); the power check must reject a 10% hotter
  temperature."""
  cfg = SAMPLING_CFGS[name]
  _, t, tp = _target(name, cfg, seed=11)
  dc = dataclasses.replace(dfj.TINY_CONFIG, n_layer=1, n_embd=cfg.hidden_size, n_head=2,
                           n_head_kv=1, target_layers=(0, 1), mask_token_id=V - 1,
                           block_size=4, window=8)
  w = dfj.synthetic_drafter(dc, seed=5, with_target=False)
  w["tok_embd"], w["lm_head"] = np.asarray(tp.embed), np.asarray(tp.head)
  models = D.Models(target=tp, drafter=dfj.prepare_weights(dc, w), d2t=None, target_cfg=cfg)
  samp = SP.Sampling(0.9, top_k=6, top_p=0.95, proposals="sampled")
  dcfg = D.DecodeConfig(width=3, sampling=samp, impl="xla")
  prefilled = D.start(models, dcfg, [PROMPT], N_TOK)
  counts = np.zeros((V, V), np.int64)
  hist = 0
  for i in range(CALLS):
    st = jax.tree.map(lambda a: jnp.broadcast_to(a, (SLOTS, *a.shape[1:])),
                      prefilled.replace(key=None))
    st = st.replace(key=jax.random.split(jax.random.key(100 + i), SLOTS))
    st = D.run_rounds(models, dcfg, st, jnp.int32(N_TOK))
    assert bool(st.done.all())
    toks = np.asarray(st.tokens[:, len(PROMPT):len(PROMPT) + N_TOK])
    np.add.at(counts, tuple(toks.T), 1)
    hist = hist + np.asarray(st.hist).sum(0)
  p = _chi2_p(counts, _exact(name, cfg, t, samp))
  assert p >= ALPHA, f"{name}: chi-square p = {p:.2e} < {ALPHA}"
  hotter = dataclasses.replace(samp, temperature=samp.temperature * 1.1)
  assert _chi2_p(counts, _exact(name, cfg, t, hotter)) < ALPHA, "the test cannot see a 10% change"
  assert hist[0] > 0 and hist[1:].sum() > 0 and hist[-1] > 0, hist


# --- a DFlash drafter on Muse-Glimmer's layers -------------------------------------------------

HF_TARGET_LAYER_IDS = (1, 13, 25, 37, 49)   # Muse-Glimmer-30B-assistant / -DFlash2
MUSE52 = dataclasses.replace(MUSE, num_hidden_layers=52, hidden_size=32, intermediate_size=48,
                             head_dim=8, sliding_window=8, layer_types=None, layer_rope_theta=None)


@pytest.fixture(scope="module")
def muse52():
  cfg, t, tp = _target("muse", MUSE52, seed=21)
  dc = dataclasses.replace(dfj.TINY_CONFIG, n_layer=2, n_embd=cfg.hidden_size, n_ff=64,
                           n_head=4, n_head_kv=2, head_dim=8,
                           target_layers=tuple(i + 1 for i in HF_TARGET_LAYER_IDS),
                           mask_token_id=cfg.vocab_size - 1, block_size=8, window=16)
  w = dfj.synthetic_drafter(dc, seed=22, with_target=False)
  w["tok_embd"], w["lm_head"] = np.asarray(tp.embed), np.asarray(tp.head)
  return cfg, t, tp, dc, w


def test_dflash_drafter_on_muse_glimmer_layers(muse52):
  """After the prompt's prefill, the loop's first drafts (and their logits) equal the numpy
  drafter's, fed the reference target's hidden_states [2, 14, 26, 38, 50] and the raw
  embedding table; the normed table (what hidden_states[0] holds) gives other logits."""
  cfg, t, tp, dc, w = muse52
  assert dc.target_layers == (2, 14, 26, 38, 50) and cfg.full_layers[-1] == 51
  prompt = np.random.default_rng(23).integers(0, cfg.vocab_size, 12).tolist()
  models = D.Models(target=tp, drafter=dfj.prepare_weights(dc, w), d2t=None, target_cfg=cfg)
  dcfg = D.DecodeConfig(width=8, impl="xla")
  st = D.start(models, dcfg, [prompt], 8)
  _, proposal = jax.jit(dcfg.proposer.propose, static_argnums=1)(
      models, dcfg, st, jax.random.split(jax.random.key(0), 1))
  drafts = proposal.drafts
  hs, _ = RM.hidden_states(cfg.to_hf(), t, prompt[:-1])
  feats = np.concatenate([hs[i] for i in dc.target_layers], axis=-1)

  def ref_logits(tok_embd):
    r = DFlashRef(dc, {**w, "tok_embd": tok_embd})
    r.inject(r.encode(feats), np.arange(len(prompt) - 1))
    return r.step(prompt[-1], len(prompt) - 1, 8)
  raw = ref_logits(w["tok_embd"])
  rows = w["tok_embd"].astype(np.float64)
  normed = ref_logits((rows / np.sqrt((rows ** 2).mean(-1, keepdims=True) + cfg.rms_norm_eps))
                      .astype(np.float32))
  got = jax.jit(lambda s: jax.vmap(lambda r, i, n: dfj.drafter.step.block_step(
      models.drafter, r, i, n, width=8, impl="xla"))(s.ring, s.id_last, s.n_past))(st)[0]
  np.testing.assert_allclose(got, raw, rtol=1e-4, atol=1e-4)
  assert np.abs(normed - raw).max() > 100 * np.abs(np.asarray(got) - raw).max()
  np.testing.assert_array_equal(drafts[0], np.argmax(raw[1:], -1))


def test_dflash_drafter_on_muse_glimmer_layers_is_lossless(muse52):
  """The 52-layer loop's output equals the reference target's greedy continuation (the
  expected tokens come from the numpy reference, not from a second compiled 52-layer loop)."""
  cfg, t, tp, dc, w = muse52
  models = D.Models(target=tp, drafter=dfj.prepare_weights(dc, w), d2t=None, target_cfg=cfg)
  rng = np.random.default_rng(24)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (4, 19)]
  base = [_reference_greedy(RM, cfg, t, p, 16) for p in prompts]
  g = D.generate(models, D.DecodeConfig(width=8, impl="xla", proposer=Oracle()), prompts, 16,
                 proposer_state=TM.noisy_oracle_state(prompts, base, 25, cfg.vocab_size, 256))
  assert g.tokens == base and g.hist[:, 1:].sum() > 0


def test_check_models_names_the_drafters_target_layers(muse52):
  """A drafter tapping past the target's layers: the error names the drafter's target_layers
  (the CLI prefixes it with --drafter)."""
  cfg, _, tp, dc, w = muse52
  small = dataclasses.replace(cfg, num_hidden_layers=40, layer_types=None, layer_rope_theta=None)
  models = D.Models(target=tp, drafter=dfj.prepare_weights(dc, w), d2t=None, target_cfg=small)
  with pytest.raises(ValueError, match=r"drafter target_layers \(2, 14, 26, 38, 50\) .*"
                     r"capture_layers \[50\] outside \[0, 40\]"):
    D.check_models(models, D.DecodeConfig(width=4, impl="xla"))


def test_generate_cli_names_drafter_and_target_layers(tmp_path, capsys):
  """`python -m dflash_jax generate` with a drafter whose target_layers reach past the
  target: one line naming --drafter and the drafter's target_layers."""
  from dflash_jax.__main__ import main
  from dflash_jax.models import save_target
  tcfg, tp = TM.target(seed=0)
  save_target(tmp_path / "target", tcfg, tp, dtype="f32")
  dcfg, w = TM.drafter_weights(tcfg)
  dfj.save_drafter(str(tmp_path / "d.gguf"), dataclasses.replace(dcfg, target_layers=(1, 5)), w)
  assert main(["generate", "--target", str(tmp_path / "target"), "--drafter",
               str(tmp_path / "d.gguf"), "--prompt-ids", "1,2", "--max-new", "2"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "argument --drafter: " in err[0], err
  assert "its target_layers [1, 5] (HF target_layer_ids + 1) do not fit --target" in err[0], err
  assert "2 layers give hidden states 0..2" in err[0], err
