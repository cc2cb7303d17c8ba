"""Train/infer consistency (SPEC.md section 10): the training forward's logits at each anchor
equal the reference step at n_past = a after injecting the context features of positions < a."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from dflash_jax.config import FULL, SLIDING
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
