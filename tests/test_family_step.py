"""The compiled DFlash2 and DSpark steps (Pallas in interpret mode and the jnp twins) against
the numpy reference: logits, drafts where the reference's margin is clear, the selector's
candidates and scores, the Markov chain, the confidence head, sampled drafts along their own
path; batches against single slots; bf16 / fp8 / q8_0 weights; GPU tests at real dims."""
from __future__ import annotations

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
from dflash_jax.config import DFLASH2_CONFIG, DSPARK_QWEN3_8B_CONFIG
from dflash_jax.drafter import step as S
from reference import DFlashRef
from reference import families as fam
from test_reference_families import dflash2_cfg, dspark_cfg, markov_f64

V = 512
ID_LAST = 3
# fp32 paths vs the fp32 reference: summation order only (logits of O(10)).
FP32_TOL = 1e-4
# bf16 / quantized paths vs the reference rounded the same way (test_step.py's BF16_TOL).
BF16_TOL = 5e-2
N_ROWS = 20


def weights(cfg, seed=2):
  """Synthetic weights with the family's additions strong enough to move drafts."""
  w = dfj.synthetic_drafter(cfg, seed=seed, n_vocab=V)
  for name in ("selector_predecessor", "markov_w2"):
    if name in w:
      w[name] = w[name] * np.float32(2.0)
  return w


# The step without donation (the tests reuse the ring).
_propose = jax.jit(S.propose_round_batched, static_argnames=("width", "impl", "temperature"))


class Setup:
  """A drafter and the reference holding the same N_ROWS injected rows (one slot)."""

  def __init__(self, cfg, impl, dtype="fp32", ring_dtype="fp32", seed=2, ref_weights=None,
               n_rows=N_ROWS):
    self.cfg, self.impl = cfg, impl
    w = weights(cfg, seed)
    self.params = dfj.prepare_weights(cfg, w, dtype)
    ref_dtype = "fp32" if dtype == "fp32" else "bf16"
    self.ref = DFlashRef(cfg, w if ref_weights is None else ref_weights(w), dtype=ref_dtype,
                         ring_dtype=ring_dtype, capacity=64)
    feats = dfj.synthetic_features(cfg, n_rows, seed=seed + 1)
    ring = dfj.init_batched_ring(cfg, 1, ring_dtype=ring_dtype, capacity=64)
    h = S.encode(self.params, jnp.asarray(feats)[None], impl=impl)
    self.ring = S.inject_batched(self.params, ring, h, jnp.arange(n_rows)[None], impl=impl)
    self.ref.inject(self.ref.encode(feats), np.arange(n_rows))
    self.n_past = n_rows

  def draft(self, id_last=ID_LAST, width=None, temperature=0.0, seed=0):
    f = jnp.zeros((1, 2, self.cfg.n_embd_fc), jnp.float32)
    key = jax.random.split(jax.random.key(seed), 1) if temperature else None
    _, d = _propose(self.params, self.ring, f, jnp.zeros(1, jnp.int32),
                    jnp.array([id_last], jnp.int32), jnp.array([self.n_past], jnp.int32),
                    jnp.ones(1, bool), width=width, impl=self.impl, temperature=temperature,
                    key=key)
    return jax.tree.map(lambda a: np.asarray(a[0]), d)


def clear_rows(ref_draft, cfg, tol):
  """Per draft row, whether the reference's choice is clear of `tol` (any logit of the path
  under test may be off by tol), and whether its DFlash2 candidate set is: DFlash2 needs the
  k-th / (k+1)-th logit gap (the candidate set) and the top-2 score gap clear; DSpark the
  top-2 gap of the chain's logits."""
  if cfg.family == "dflash2":
    k = cfg.dflash2.selector_top_k
    rows = np.sort(ref_draft.logits[1:], axis=-1)[:, ::-1]
    cand_ok = rows[:, k - 1] - rows[:, k] > 2 * tol
    sc = np.sort(ref_draft.scores, axis=-1)
    return cand_ok & (sc[:, -1] - sc[:, -2] > 6 * tol), cand_ok
  rows = np.sort(ref_draft.logits[cfg.first_draft_row:], axis=-1)
  return rows[:, -1] - rows[:, -2] > 4 * tol, None


def check_draft(cfg, d, want, tol, width=None) -> int:
  """The jitted greedy Draft against the reference's along their shared path; returns its
  length (the drafts both made alike). The paths may part only at a row where the
  reference's choice is a near tie."""
  w = cfg.resolve_width(width)
  n = cfg.n_drafts(width)
  # The vocabulary is the drafter's (V in the small cases, the real one at real dims).
  vocab = want.logits.shape[1]
  assert d.drafts.shape == (n,) and d.logits.shape == want.logits.shape == (w, vocab)
  ok, cand_ok = clear_rows(want, cfg, tol)
  differ = np.flatnonzero(d.drafts != want.drafts)
  same = int(differ[0]) if differ.size else n
  assert same == n or not ok[same], (
      f"drafts part at row {same} where the reference's choice is clear: "
      f"{d.drafts} vs {want.drafts}")
  # Along the shared path the logits, probabilities and family outputs agree.
  first = cfg.first_draft_row
  np.testing.assert_allclose(d.logits[:first + same], want.logits[:first + same],
                             atol=tol, rtol=0)
  # A greedy draft is its row's top token: the reference's probability of it is top_prob.
  np.testing.assert_allclose(d.top_prob[:same], want.draft_prob[:same], atol=tol * 10)
  if cfg.family == "dflash2":
    np.testing.assert_allclose(d.logits, want.logits, atol=tol, rtol=0)   # no path dependence
    for p in np.flatnonzero(cand_ok[:same]):
      assert set(d.candidates[p]) == set(want.candidates[p]), p
      np.testing.assert_allclose(np.sort(d.scores[p]), np.sort(want.scores[p]), atol=3 * tol)
  if cfg.family == "dspark":
    if want.conf is None:
      assert d.conf is None
    else:
      np.testing.assert_allclose(d.conf[:same + 1], want.conf[:same + 1], atol=tol)
  return same


# --------------------------------------------------------------------------------- DFlash2

DFLASH2_CASES = {
    # block, GQA group, attention kinds, K, G, softcap, causality, window
    "b8-g2-sliding-k2-g8": dict(block=8, heads=(4, 2), kinds="sliding", k_size=2, group=8),
    "b5-g3-full-k1-g64-nocap": dict(block=5, heads=(6, 2), kinds="full", k_size=1, group=64,
                                    cap=None, top_k=3),
    "b7-g2-mixed-k3-g4-causal": dict(block=7, heads=(4, 2), kinds="mixed", k_size=3, group=4,
                                     causal=True, top_k=6),
    "b16-g3-sliding-causal-band": dict(block=16, heads=(6, 2), kinds="sliding", k_size=2,
                                       group=16, causal=True, window=6, cap=None),
    "b16-g2-mixed-percausal-band": dict(block=16, heads=(4, 2), kinds="mixed", k_size=2,
                                        group=8, causal=(True, False), window=6),
    "b8-g3-full-k3-g1": dict(block=8, heads=(6, 2), kinds="full", k_size=3, group=1, cap=3.0,
                             top_k=8),
}
# Interpret-mode Pallas is slow: it runs the cases that reach a kernel path the twins do not
# (masks, G 3, several taps); the twins run every case.
PALLAS_D2 = ("b7-g2-mixed-k3-g4-causal", "b16-g3-sliding-causal-band", "b8-g2-sliding-k2-g8")
D2_PARAMS = ([pytest.param(c, "xla", id=f"{c}-xla") for c in DFLASH2_CASES]
             + [pytest.param(c, "pallas", id=f"{c}-pallas") for c in PALLAS_D2])


@pytest.mark.parametrize("case,impl", D2_PARAMS)
def test_dflash2_step_matches_reference(case, impl):
  cfg = dflash2_cfg(**DFLASH2_CASES[case])
  st = Setup(cfg, impl)
  widths = (None, 4) if impl == "xla" else (None,)
  shared = 0
  for width in widths:
    for id_last in (ID_LAST, 101):
      d = st.draft(id_last, width)
      want = st.ref.draft(id_last, st.n_past, width)
      shared += check_draft(st.cfg, d, want, FP32_TOL, width)
  # The one-sequence entry point (no slot axis) computes the same block.
  logits = S.block_step_jit(st.params, jax.tree.map(lambda a: a[0], st.ring), ID_LAST,
                            st.n_past, impl=impl)
  np.testing.assert_allclose(np.asarray(logits), st.ref.step(ID_LAST, st.n_past),
                             atol=FP32_TOL, rtol=0)
  assert shared >= len(widths) * 2 * (cfg.block_size // 2 - 1), shared


def test_dflash2_selector_moves_drafts_off_the_argmax():
  """The test weights make the walk matter: some greedy drafts are not the row's argmax."""
  moved = 0
  for case in ("b8-g2-sliding-k2-g8", "b8-g3-full-k3-g1"):
    st = Setup(dflash2_cfg(**DFLASH2_CASES[case]), "xla")
    for id_last in (3, 50, 101):
      d = st.draft(id_last)
      moved += int(np.sum(d.drafts != np.argmax(d.logits[1:], -1)))
  assert moved > 0


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_dflash2_sampled_walk_follows_its_own_path(temperature):
  """At T > 0 the walk's scores, taken along the path it sampled, are the reference's unary
  logits plus the edge from the sampled predecessor, and q = softmax(scores / T) over the
  candidates; every draft is one of its row's candidates."""
  cfg = dflash2_cfg(**DFLASH2_CASES["b8-g2-sliding-k2-g8"])
  st = Setup(cfg, "xla")
  ref_d = st.ref.draft(ID_LAST, st.n_past)
  g = st.ref._linear(ref_d.hidden[1:], "selector_hidden")
  seen = set()
  for seed in range(4):
    d = st.draft(ID_LAST, temperature=temperature, seed=seed)
    assert d.q.shape == (cfg.block_size - 1, cfg.dflash2.selector_top_k)
    np.testing.assert_allclose(d.q.sum(-1), 1.0, rtol=1e-5)
    prev = ID_LAST
    for p in range(cfg.block_size - 1):
      cand = d.candidates[p]
      assert d.drafts[p] in cand
      want = ref_d.logits[1 + p][cand] + fam.edge_scores(
          prev, g[p], cand, st.ref.w["selector_predecessor"], st.ref.w["selector_successor"])
      np.testing.assert_allclose(d.scores[p], want, atol=3 * FP32_TOL)
      np.testing.assert_allclose(d.q[p], fam.softmax(want, temperature), atol=1e-4)
      prev = int(d.drafts[p])
    seen.add(tuple(d.drafts))
  assert len(seen) > 1   # the keys matter


def test_trivial_dflash2_is_dflash():
  """K = 1, base kernels 1, zero projections and codebooks, multiplier and scale 1, no softcap:
  the jitted DFlash2 step gives DFlash's logits and drafts."""
  cfg = dflash2_cfg(k_size=1, mult=1.0, cap=None, scale=1.0, kinds="mixed")
  w = weights(cfg)
  for name in w:
    if name.endswith("_conv_base"):
      w[name] = np.ones_like(w[name])
    elif name.endswith("_conv_proj") or name.startswith("selector_"):
      w[name] = np.zeros_like(w[name])
  v1 = dataclasses.replace(cfg, family="dflash", family_fields=None)
  w1 = {k: v for k, v in w.items() if not k.endswith(("_conv_base", "_conv_proj"))
        and not k.startswith("selector_")}
  out = []
  for c, ww in ((cfg, w), (v1, w1)):
    params = dfj.prepare_weights(c, ww, "bf16")
    ring = dfj.init_ring(c, ring_dtype="bf16", capacity=64)
    feats = jnp.asarray(dfj.synthetic_features(c, 20, seed=4))
    ring, drafts, logits = S.draft_round_jit(params, ring, feats, 20, ID_LAST, 20,
                                             impl="xla")
    out.append((np.asarray(drafts), np.asarray(logits)))
  np.testing.assert_allclose(out[0][1], out[1][1], atol=1e-5, rtol=0)
  np.testing.assert_array_equal(out[0][0], out[1][0])


# ----------------------------------------------------------------------------------- DSpark

DSPARK_CASES = {
    "vanilla-conf-markov-shifted-b7-full": dict(head="vanilla", block=7, kinds="full"),
    "gated-conf-shifted-b5-sliding-g3": dict(head="gated", with_markov=False, block=5,
                                             kinds="sliding", heads=(6, 2)),
    "rnn-conf-markov-shifted-b8-mixed": dict(head="rnn", block=8, kinds="mixed"),
    "rnn-unshifted-b7-full": dict(head="rnn", conf=False, shifted=False, block=7),
    "vanilla-unshifted-b16-mixed": dict(head="vanilla", conf=False, shifted=False, block=16,
                                        kinds="mixed"),
    "nohead-conf-shifted-b7": dict(head=None, with_markov=False, block=7),
}
PALLAS_DS = ("vanilla-conf-markov-shifted-b7-full", "rnn-conf-markov-shifted-b8-mixed")
DS_PARAMS = ([pytest.param(c, "xla", id=f"{c}-xla") for c in DSPARK_CASES]
             + [pytest.param(c, "pallas", id=f"{c}-pallas") for c in PALLAS_DS])


@pytest.mark.parametrize("case,impl", DS_PARAMS)
def test_dspark_step_matches_reference(case, impl):
  cfg = dspark_cfg(**DSPARK_CASES[case])
  st = Setup(cfg, impl)
  shared = 0
  widths = (None, 3) if impl == "xla" else (None,)
  for width in widths:
    for id_last in (ID_LAST, 77):
      d = st.draft(id_last, width)
      want = st.ref.draft(id_last, st.n_past, width)
      shared += check_draft(st.cfg, d, want, FP32_TOL, width)
  assert shared >= len(widths) * 2 * (cfg.n_drafts() // 2), shared


def test_dspark_markov_heads_move_drafts():
  moved = 0
  for head in ("vanilla", "gated", "rnn"):
    st = Setup(dspark_cfg(head=head, with_markov=head != "gated"), "xla")
    d = st.draft()
    base = np.asarray(S.block_step(st.params, jax.tree.map(lambda a: a[0], st.ring), ID_LAST,
                                   st.n_past, impl="xla"))
    moved += int(np.sum(d.drafts != np.argmax(base, -1)))
  assert moved > 0


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_dspark_sampled_chain_follows_its_own_path(head):
  """At T > 0 each row's logits are the backbone's corrected by the head along the sampled
  path (the rnn state carried), q = softmax(logits / T) over the vocabulary, and the confidence
  reads the sampled predecessor."""
  cfg = dspark_cfg(head=head)
  st = Setup(cfg, "xla")
  ref_d = st.ref.draft(ID_LAST, st.n_past)
  t = 0.8
  seen = set()
  for seed in range(3):
    d = st.draft(ID_LAST, temperature=t, seed=seed)
    prevs = np.concatenate([[ID_LAST], d.drafts[:-1]])
    want = markov_f64(ref_d.base, ref_d.hidden.astype(np.float64), prevs, head, st.ref.w)
    np.testing.assert_allclose(d.logits, want, atol=FP32_TOL * 10)
    np.testing.assert_allclose(d.q, fam.softmax(want.astype(np.float32), t), atol=1e-5)
    conf = fam.confidence(ref_d.hidden, st.ref.w["markov_w1"][prevs], st.ref.w["conf_proj"],
                          st.ref.w["conf_proj.bias"])
    np.testing.assert_allclose(d.conf, conf, atol=1e-5)
    seen.add(tuple(d.drafts))
  assert len(seen) > 1


# ------------------------------------------------------------------------ batches, widths

@pytest.mark.parametrize("cfg", [dflash2_cfg(**DFLASH2_CASES["b7-g2-mixed-k3-g4-causal"]),
                                 dspark_cfg(head="rnn")], ids=["dflash2", "dspark"])
def test_batched_slots_equal_single_slots(cfg):
  """Three slots in one call: each slot's Draft equals the one-slot call on its own ring (the
  GEMM row counts differ: to rounding), and a slot's outputs are bitwise unaffected by another
  slot's inputs (the convolutions and scans never mix slots)."""
  w = weights(cfg)
  params = dfj.prepare_weights(cfg, w, "fp32")
  rings, singles = [], []
  for s, n in enumerate((20, 9, 14)):
    ring = dfj.init_batched_ring(cfg, 1, capacity=64)
    feats = jnp.asarray(dfj.synthetic_features(cfg, 20, seed=10 + s))[None]
    rings.append(S.inject_batched(params, ring, S.encode(params, feats, impl="xla"),
                                  jnp.arange(20)[None], jnp.array([n]), impl="xla"))
  ring3 = jax.tree.map(lambda *a: jnp.concatenate(a), *rings)
  f = jnp.zeros((3, 2, cfg.n_embd_fc))
  args = lambda ids: (f, jnp.zeros(3, jnp.int32), jnp.asarray(ids, jnp.int32),
                      jnp.array([20, 9, 14], jnp.int32), jnp.ones(3, bool))
  for width in (None, 4):
    _, d3 = _propose(params, ring3, *args([3, 50, 77]), width=width, impl="xla")
    for s, n in enumerate((20, 9, 14)):
      _, d1 = _propose(params, rings[s], f[:1], jnp.zeros(1, jnp.int32),
                       jnp.array([(3, 50, 77)[s]]), jnp.array([n]), jnp.ones(1, bool),
                       width=width, impl="xla")
      np.testing.assert_array_equal(np.asarray(d3.drafts[s]), np.asarray(d1.drafts[0]))
      chex.assert_trees_all_close(jax.tree.map(lambda a: np.asarray(a[s]), d3),
                                  jax.tree.map(lambda a: np.asarray(a[0]), d1), atol=1e-5)
    _, other = _propose(params, ring3, *args([3, 51, 78]), width=width, impl="xla")
    chex.assert_trees_all_equal(jax.tree.map(lambda a: np.asarray(a[0]), d3),
                                jax.tree.map(lambda a: np.asarray(a[0]), other))


def test_narrow_block_convolves_from_its_own_row_0():
  """A block of width w < block_size is its own sequence for the convolution: with a causal
  DFlash2, rows 0..w-1 of the full block equal the narrow block's (the zero padding sits at
  row 0 of each block, not of the full one)."""
  cfg = dflash2_cfg(block=8, kinds="full", causal=True, k_size=3, group=4)
  st = Setup(cfg, "xla")
  ring = jax.tree.map(lambda a: a[0], st.ring)
  full = np.asarray(S.block_step(st.params, ring, ID_LAST, st.n_past, impl="xla"))
  narrow = np.asarray(S.block_step(st.params, ring, ID_LAST, st.n_past, width=5, impl="xla"))
  np.testing.assert_allclose(narrow, full[:5], atol=1e-5, rtol=0)


# -------------------------------------------------------------------- weight formats

def _dequantized(w, fmt):
  """The values a quantized GEMM computes with, for every matrix (tables are bf16-rounded by
  the bf16 reference itself)."""
  from dflash_jax import quant
  tables = {"tok_embd", "selector_predecessor", "selector_successor", "markov_w1"}
  out = dict(w)
  for name, a in w.items():
    if a.ndim == 2 and name not in tables:
      out[name] = (quant.dequantize_fp8(*quant.quantize_fp8(a)) if fmt == "fp8"
                   else quant.dequantize_q8_0(*quant.quantize_q8_0(a)))
  return out


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "q8_0"])
@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_weight_formats_match_the_rounded_reference(family, fmt, impl):
  """bf16 weights against the bf16-rounded reference; fp8 / q8_0 against the bf16 reference
  on the dequantized weights (every new matrix quantized like the old ones)."""
  if family == "dflash2":
    cfg = dflash2_cfg(rank=32)
  else:
    cfg = dspark_cfg(head="gated", rank=32)
  rw = None if fmt == "bf16" else functools.partial(_dequantized, fmt=fmt)
  st = Setup(cfg, impl, dtype=fmt, ring_dtype="bf16", ref_weights=rw)
  fp = st.params.family
  quantized = [fp.hidden] if family == "dflash2" else [fp.markov_w2, fp.gate, fp.conf]
  if family == "dflash2":
    quantized += [c.proj for c in fp.attn_conv]
  assert all(dfj.dispatch.matrix_format(m) == fmt for m in quantized)
  shared = 0
  for id_last in (ID_LAST, 101, 7):
    d = st.draft(id_last)
    want = st.ref.draft(id_last, st.n_past)
    shared += check_draft(st.cfg, d, want, BF16_TOL)
  assert shared >= 3, shared


# ------------------------------------------------------------------- GPU, real dims

@pytest.mark.gpu
@pytest.mark.parametrize("family", ["dflash2", "dflash2-causal-2-layers", "dspark"])
def test_gpu_real_dims_match_reference(family):
  """DFLASH2_CONFIG at vocab 8192 (its 2048-slot ring wrapped; as published, and with causal
  blocks, which route the attention to the masked Triton kernel) and DSpark Qwen3-8B block 7
  (a 2048-slot full cache): the compiled bf16 Pallas step against the bf16 reference."""
  if family.startswith("dflash2"):
    cfg, n_vocab, n_rows, capacity = DFLASH2_CONFIG, 8192, 2100, None
    cfg = dataclasses.replace(cfg, mask_token_id=8191)
    if family != "dflash2":
      cfg = dataclasses.replace(cfg, n_layer=2, family_fields=dataclasses.replace(
          cfg.dflash2, is_causal=True))
  else:
    cfg, n_vocab, n_rows, capacity = DSPARK_QWEN3_8B_CONFIG, 151936, 1500, 2048
  w = dfj.synthetic_drafter(cfg, seed=0, n_vocab=n_vocab)
  params = dfj.prepare_weights(cfg, w, "bf16")
  ref = DFlashRef(cfg, w, dtype="bf16", ring_dtype="bf16", capacity=capacity)
  feats = dfj.synthetic_features(cfg, n_rows, seed=1)
  ring = dfj.init_batched_ring(cfg, 1, ring_dtype="bf16", capacity=capacity)
  ring = S.inject_batched(params, ring, S.encode(params, jnp.asarray(feats)[None]),
                          jnp.arange(n_rows)[None])
  ref.inject(ref.encode(feats), np.arange(n_rows))
  f = jnp.zeros((1, 2, cfg.n_embd_fc))
  _, d = _propose(params, ring, f, jnp.zeros(1, jnp.int32), jnp.array([17]),
                  jnp.array([n_rows]), jnp.ones(1, bool))
  d = jax.tree.map(lambda a: np.asarray(a[0]), d)
  want = ref.draft(17, n_rows)
  # Random weights at a real vocabulary leave near ties anywhere (no count of shared rows is
  # promised); the logits are compared on every row the two paths share, all rows for DFlash2.
  check_draft(cfg, d, want, BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["dflash2", "dspark"])
def test_gpu_round_replays_bitwise_as_one_command_buffer(family, tmp_path):
  """The compiled round (inject + block step + selector walk / Markov chain + confidence)
  replayed between unrelated work: bitwise the same Draft; and XLA records the whole round,
  Pallas kernels and unrolled scans included, into one command buffer."""
  script = textwrap.dedent(f"""
      import dataclasses, jax, jax.numpy as jnp, numpy as np, dflash_jax as dfj
      from dflash_jax.config import DFLASH2_CONFIG, DSPARK_QWEN3_8B_CONFIG
      from dflash_jax.drafter import step as S
      fam = {family!r}
      if fam == "dflash2":
        cfg = dataclasses.replace(DFLASH2_CONFIG, n_layer=2, mask_token_id=8191)
        n_vocab, cap = 8192, None
      else:
        cfg = dataclasses.replace(DSPARK_QWEN3_8B_CONFIG, n_layer=2,
                                  layer_types=("full_attention",) * 2)
        n_vocab, cap = 151936, 2048
      params = dfj.prepare_weights(cfg, dfj.synthetic_drafter(cfg, n_vocab=n_vocab), "bf16")
      ring = dfj.init_batched_ring(cfg, 1, ring_dtype="bf16", capacity=cap)
      feats = jnp.asarray(dfj.synthetic_features(cfg, 16))[None]
      run = jax.jit(S.propose_round_batched, static_argnames=("width", "impl", "temperature"))
      args = (params, ring, feats, jnp.array([16]), jnp.array([1]), jnp.array([16]),
              jnp.ones(1, bool))
      keys = jax.random.split(jax.random.key(3), 1)
      first = jax.tree.map(np.asarray, run(*args)[1])
      sampled = jax.tree.map(np.asarray, run(*args, temperature=0.8, key=keys)[1])
      x = jnp.ones((256, 256))
      for i in range(20):
        x = jnp.tanh(x @ x.T / 256)
        again = jax.tree.map(np.asarray, run(*args)[1])
        jax.tree.map(np.testing.assert_array_equal, again, first)
        again = jax.tree.map(np.asarray, run(*args, temperature=0.8, key=keys)[1])
        jax.tree.map(np.testing.assert_array_equal, again, sampled)
      print("replay ok")
  """)
  env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path}")
  out = subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=os.getcwd(),
                       capture_output=True, text=True)
  assert "replay ok" in out.stdout
  files = glob.glob(str(tmp_path / "*propose_round_batched*thunk_sequence_after_thunk_passes.txt"))
  assert len(files) == 2, os.listdir(tmp_path)[:20]   # the greedy and the sampled round
  for f in files:
    text = open(f).read()
    top = [l for l in text.splitlines() if l and not l.startswith(" ")]
    assert len(top) == 1 and "kCommandBuffer" in top[0], (f, top[:10])
