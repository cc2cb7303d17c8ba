"""Train/infer consistency (SPEC.md section 10): the training forward's logits at each anchor
equal the reference step at n_past = a after injecting the context features of positions < a;
for DFlash2 and DSpark also the selector's scores and the Markov-corrected logits and
confidences along the teacher-forced path, against `DFlashRef.draft`."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from dflash_jax.config import (FULL, SLIDING, TINY_DFLASH2_CONFIG, TINY_DSPARK_CONFIG,
                               DSparkFields)
from dflash_jax.train import forward as F
from reference import DFlashRef


CFG = dataclasses.replace(dfj.TINY_CONFIG, window=None)   # block 8, 2 layers, GQA 4/2
VOCAB = 96
T = 24
# Anchors per sequence: a = 0 and 1 (empty / one-row context), the middle, and the last rows
# (blocks running past the sequence end).
ANCHORS = np.array([[1, 5, 13, 22], [0, 9, 17, 23]], np.int32)
TOL = dict(atol=1e-4, rtol=1e-4)
_block_logits = jax.jit(F.block_logits, static_argnames=("cfg", "window", "compute_dtype"))


def _case(seed):
  w = dfj.synthetic_drafter(CFG, seed=seed, n_vocab=VOCAB)
  rng = np.random.default_rng(seed + 1)
  feats = rng.standard_normal((2, T, CFG.n_embd_fc), dtype=np.float32)
  tokens = rng.integers(0, VOCAB, (2, T)).astype(np.int32)
  return w, feats, tokens


def _train_logits(w, feats, tokens, window, cfg=CFG, compute_dtype="fp32"):
  train_w = {k: jnp.asarray(v) for k, v in w.items() if k not in ("tok_embd", "lm_head")}
  return np.asarray(_block_logits(train_w, jnp.asarray(w["tok_embd"]), jnp.asarray(w["lm_head"]),
                                  cfg=cfg, features=jnp.asarray(feats), tokens=jnp.asarray(tokens),
                                  anchors=jnp.asarray(ANCHORS), window=window,
                                  compute_dtype=compute_dtype))


def _ref_logits(w, feats, tokens, s, a, window, cfg=CFG):
  ref = DFlashRef(cfg, w, window=window)
  if a:
    ref.inject(ref.encode(feats[s, :a]), np.arange(a))
  return ref.step(int(tokens[s, a]), a)


# window 8 < T: the sliding window hides the deep past (and differently per block row);
# window 64 > T: all of the context is visible; then a sliding layer mixed with a full one,
# and full layers only.
KINDS = [(None, 8), (None, 64), ((SLIDING, FULL), 8), ((FULL, FULL), None)]


@pytest.mark.parametrize("layer_types,window", KINDS)
def test_training_forward_equals_the_reference_step_at_each_anchor(layer_types, window):
  cfg = dataclasses.replace(CFG, layer_types=layer_types)
  w, feats, tokens = _case(seed=3)
  got = _train_logits(w, feats, tokens, window, cfg=cfg)
  assert got.shape == (2, ANCHORS.shape[1], cfg.block_size, VOCAB)
  for s in range(2):
    for j, a in enumerate(ANCHORS[s]):
      np.testing.assert_allclose(got[s, j],
                                 _ref_logits(w, feats, tokens, s, int(a), window, cfg=cfg),
                                 err_msg=f"sequence {s} anchor {a}", **TOL)


def test_context_is_strictly_before_the_anchor_and_inside_the_window():
  """Features at p >= a (the anchor's own included) never reach anchor a's logits; features
  deeper than the window do not either; the newest context row does."""
  window = 8
  w, feats, tokens = _case(seed=5)
  base = _train_logits(w, feats, tokens, window)
  a = int(ANCHORS[0, 2])   # 13
  for p, moves in ((a, False), (T - 1, False), (a - 1, True), (a - 1 - window + CFG.block_size,
                                                                True), (a - window, False)):
    poked = feats.copy()
    poked[0, p] += 3.0
    delta = np.abs(_train_logits(w, poked, tokens, window)[0, 2] - base[0, 2]).max()
    assert (delta > 1e-3) == moves, (p, delta)


def test_bf16_compute_tracks_fp32():
  w, feats, tokens = _case(seed=7)
  fp32 = _train_logits(w, feats, tokens, 8)
  bf16 = _train_logits(w, feats, tokens, 8, compute_dtype="bf16")
  # bf16 GEMM and attention inputs: logits of O(1) move by a few 1e-2 at these dims.
  assert np.abs(bf16 - fp32).max() < 0.15
  assert np.abs(bf16 - fp32).max() > 0   # it really rounded


def test_bad_shapes_are_named():
  w, feats, tokens = _case(seed=9)
  with pytest.raises(ValueError, match="features must be"):
    _train_logits(w, feats[..., :-1], tokens, 8)
  with pytest.raises(ValueError, match="tokens must be"):
    _train_logits(w, feats, tokens[:, :-1], 8)


# --- DFlash2 and DSpark (SPEC_dflash2_dspark): the families' training forwards ----------------

_dflash2_outputs = jax.jit(F.dflash2_block_outputs,
                           static_argnames=("cfg", "window", "compute_dtype"))
_dspark_outputs = jax.jit(F.dspark_block_outputs,
                          static_argnames=("cfg", "window", "compute_dtype"))
_selector = jax.jit(F.selector_scores, static_argnames=("top_k", "compute_dtype"))
# One anchor per sequence, so that each anchor's drafts can be written after it (the greedy
# path then is the teacher-forced one): empty context, short, middle, and the last anchor
# whose drafts still fit in T.
SOLO = np.array([[0], [5], [11], [16]], np.int32)


def _family_case(cfg, seed, n_seq=2):
  w = dfj.synthetic_drafter(cfg, seed=seed, n_vocab=VOCAB)
  rng = np.random.default_rng(seed + 1)
  feats = rng.standard_normal((n_seq, T, cfg.n_embd_fc), dtype=np.float32)
  tokens = rng.integers(0, VOCAB, (n_seq, T)).astype(np.int32)
  return w, feats, tokens


def _split(w):
  train_w = {k: jnp.asarray(v) for k, v in w.items() if k not in ("tok_embd", "lm_head")}
  return train_w, jnp.asarray(w["tok_embd"]), jnp.asarray(w["lm_head"])


def _ref_at(cfg, w, feats, s, a, window):
  ref = DFlashRef(cfg, w, window=window)
  if a:
    ref.inject(ref.encode(feats[s, :a]), np.arange(a))
  return ref


def _greedy_path_tokens(cfg, w, feats, tokens, window):
  """tokens with each SOLO anchor's reference drafts written after it, and those drafts."""
  tokens = tokens.copy()
  drafts = []
  for s, (a,) in enumerate(SOLO):
    d = _ref_at(cfg, w, feats, s, int(a), window).draft(int(tokens[s, a]), int(a))
    tokens[s, a + 1:a + 1 + len(d.drafts)] = d.drafts   # the first draft predicts a + 1
    drafts.append(d)
  return tokens, drafts


def _dflash2(layer_types, window, causal, softcap):
  f = dataclasses.replace(TINY_DFLASH2_CONFIG.dflash2, is_causal=causal,
                          final_logit_softcapping=softcap)
  return dataclasses.replace(TINY_DFLASH2_CONFIG, layer_types=layer_types, window=None,
                             family_fields=f)


# window 8 = block 8; window 4 < block 8: the sliding layers' symmetric band cuts the block's
# own keys too (and causal rows); a sliding causal layer mixed with a full non-causal one;
# full layers only, softcap off.
DFLASH2_CASES = [(None, 8, False, 12.0), (None, 4, True, 12.0),
                 ((SLIDING, FULL), 8, (True, False), 12.0), ((FULL, FULL), None, False, None)]


@pytest.mark.parametrize("layer_types,window,causal,softcap", DFLASH2_CASES)
def test_dflash2_training_forward_equals_the_reference_step_at_each_anchor(
    layer_types, window, causal, softcap):
  cfg = _dflash2(layer_types, window, causal, softcap)
  w, feats, tokens = _family_case(cfg, seed=11)
  tw, emb, head = _split(w)
  logits, h = _dflash2_outputs(tw, emb, head, cfg=cfg, features=jnp.asarray(feats),
                               tokens=jnp.asarray(tokens), anchors=jnp.asarray(ANCHORS),
                               window=window)
  assert logits.shape == (2, ANCHORS.shape[1], cfg.block_size, VOCAB)
  for s in range(2):
    for j, a in enumerate(ANCHORS[s]):
      ref = _ref_at(cfg, w, feats, s, int(a), window)
      np.testing.assert_allclose(np.asarray(logits[s, j]), ref.step(int(tokens[s, a]), int(a)),
                                 err_msg=f"sequence {s} anchor {a}", **TOL)
      np.testing.assert_allclose(np.asarray(h[s, j]), ref.hidden(int(tokens[s, a]), int(a)),
                                 err_msg=f"hidden, sequence {s} anchor {a}", **TOL)


@pytest.mark.parametrize("layer_types,window,causal,softcap", DFLASH2_CASES[:3])
def test_dflash2_selector_scores_along_the_true_tokens_equal_the_reference_walk(
    layer_types, window, causal, softcap):
  """With each anchor's walk drafts written after it, the teacher-forced predecessors are the
  walk's: the training side's candidates, scores and choices equal `DFlashRef.draft`'s."""
  cfg = _dflash2(layer_types, window, causal, softcap)
  w, feats, tokens = _family_case(cfg, seed=13, n_seq=len(SOLO))
  tokens, drafts = _greedy_path_tokens(cfg, w, feats, tokens, window)
  tw, emb, head = _split(w)
  logits, h = _dflash2_outputs(tw, emb, head, cfg=cfg, features=jnp.asarray(feats),
                               tokens=jnp.asarray(tokens), anchors=jnp.asarray(SOLO),
                               window=window)
  prev = F.teacher_prevs(cfg, jnp.asarray(tokens), jnp.asarray(SOLO))
  labels = F.label_positions(cfg, jnp.asarray(SOLO))
  labels = jnp.take_along_axis(jnp.asarray(tokens), jnp.clip(labels, 0, T - 1).reshape(
      len(SOLO), -1), 1).reshape(labels.shape)
  sel = _selector(tw, logits, h, prev, labels, top_k=cfg.dflash2.selector_top_k)
  k = cfg.dflash2.selector_top_k
  clear = 0
  for s, d in enumerate(drafts):
    rows = np.asarray(logits[s, 0, 1:])
    top = np.sort(rows, -1)[:, ::-1]
    gap = top[:, k - 1] - top[:, k]   # the reference's k-th vs (k+1)-th logit
    for p in range(cfg.block_size - 1):
      if gap[p] < 1e-3:
        continue   # candidate sets may differ within rounding: no claim on this row
      clear += 1
      np.testing.assert_array_equal(np.asarray(sel.candidates[s, 0, p + 1]), d.candidates[p])
      np.testing.assert_allclose(np.asarray(sel.scores[s, 0, p + 1]), d.scores[p],
                                 err_msg=f"sequence {s} row {p + 1}", **TOL)
      s_sorted = np.sort(d.scores[p])[::-1]
      if s_sorted[0] - s_sorted[1] > 1e-3:
        assert int(np.argmax(sel.scores[s, 0, p + 1])) == int(d.chosen[p])
        assert int(sel.label_index[s, 0, p + 1]) == int(d.chosen[p])   # the label is the draft
  assert clear >= 0.8 * len(drafts) * (cfg.block_size - 1), clear


def _dspark(head, conf, with_markov, shifted=True):
  f = DSparkFields(sample_from_anchor=shifted, markov_rank=8 if head else 0,
                   markov_head_type=head, confidence_head=conf,
                   confidence_with_markov=with_markov)
  return dataclasses.replace(TINY_DSPARK_CONFIG, family_fields=f)


DSPARK_CASES = [("vanilla", True, True, True), ("gated", True, True, True),
                ("rnn", True, False, True), (None, True, False, True),
                ("vanilla", False, False, False)]


@pytest.mark.parametrize("head,conf,with_markov,shifted", DSPARK_CASES)
def test_dspark_training_forward_equals_the_reference_draft(head, conf, with_markov, shifted):
  """Backbone logits at every anchor equal `DFlashRef.step`; with each anchor's greedy chain
  written after it (teacher forcing then follows the chain), the Markov-corrected logits and
  the confidence values equal `DFlashRef.draft`'s."""
  cfg = _dspark(head, conf, with_markov, shifted)
  w, feats, tokens = _family_case(cfg, seed=17)
  tw, emb, head_w = _split(w)
  out = _dspark_outputs(tw, emb, head_w, cfg=cfg, features=jnp.asarray(feats),
                        tokens=jnp.asarray(tokens), anchors=jnp.asarray(ANCHORS))
  for s in range(2):
    for j, a in enumerate(ANCHORS[s]):
      ref = _ref_at(cfg, w, feats, s, int(a), None)
      np.testing.assert_allclose(np.asarray(out.base[s, j]), ref.step(int(tokens[s, a]), int(a)),
                                 err_msg=f"sequence {s} anchor {a}", **TOL)
  w, feats, tokens = _family_case(cfg, seed=19, n_seq=len(SOLO))
  tokens, drafts = _greedy_path_tokens(cfg, w, feats, tokens, None)
  tw, emb, head_w = _split(w)
  out = _dspark_outputs(tw, emb, head_w, cfg=cfg, features=jnp.asarray(feats),
                        tokens=jnp.asarray(tokens), anchors=jnp.asarray(SOLO))
  first = cfg.first_draft_row
  assert (out.conf_logits is None) == (not conf)
  for s, d in enumerate(drafts):
    np.testing.assert_allclose(np.asarray(out.logits[s, 0, first:]), d.logits[first:],
                               err_msg=f"sequence {s}", **TOL)
    np.testing.assert_array_equal(np.argmax(np.asarray(out.logits[s, 0, first:]), -1),
                                  d.drafts)
    if conf:
      np.testing.assert_allclose(np.asarray(jax.nn.sigmoid(out.conf_logits[s, 0, first:])),
                                 d.conf, err_msg=f"sequence {s}", atol=1e-5, rtol=1e-5)


def test_teacher_prevs_are_the_true_tokens_before_each_label():
  tokens = jnp.arange(100, 124, dtype=jnp.int32)[None]
  anchors = jnp.array([[3]], jnp.int32)
  shifted = F.teacher_prevs(TINY_DSPARK_CONFIG, tokens, anchors)[0, 0]
  np.testing.assert_array_equal(np.asarray(shifted), 103 + np.arange(7))   # row k: x[a+k]
  plain = F.teacher_prevs(TINY_DFLASH2_CONFIG, tokens, anchors)[0, 0]
  np.testing.assert_array_equal(np.asarray(plain)[1:], 103 + np.arange(7))   # row p: x[a+p-1]
