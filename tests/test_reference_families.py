"""The DFlash2 and DSpark references against SPEC_dflash2_dspark, each piece checked against an
independent re-derivation written here (float64 loops, brute-force lattices, statistics)."""
import dataclasses

import numpy as np
import pytest

from dflash_jax.config import (FULL, SLIDING, TINY_CONFIG, TINY_DFLASH2_CONFIG,
                               TINY_DSPARK_CONFIG, DFlash2Fields, DSparkFields,
                               rope_inv_freq)
from dflash_jax.synthetic import synthetic_drafter, synthetic_features
from reference import DFlashRef, round_bf16
from reference import families as fam
from test_reference import rope_pairs_f64, stored_kv

N_VOCAB = 512
ID_LAST = 3


def dflash2_cfg(block=8, heads=(4, 2), kinds="sliding", k_size=2, group=8, rank=8, top_k=4,
                mult=0.5, cap=12.0, scale=1.5, causal=False, window=32):
  """A tiny DFlash2 config; kinds "sliding" | "full" | "mixed" (sliding then full)."""
  layer_types = {"sliding": None, "full": (FULL, FULL), "mixed": (SLIDING, FULL)}[kinds]
  return dataclasses.replace(
      TINY_CONFIG, n_head=heads[0], n_head_kv=heads[1], block_size=block, window=window,
      layer_types=layer_types, context_length=64, family="dflash2",
      family_fields=DFlash2Fields(conv_kernel_size=k_size, conv_group_size=group,
                                  selector_rank=rank, selector_top_k=top_k,
                                  output_multiplier=mult, final_logit_softcapping=cap,
                                  input_embedding_scale=scale, is_causal=causal))


def dspark_cfg(head="vanilla", rank=8, conf=True, with_markov=True, shifted=True, block=7,
               kinds="full", heads=(4, 2)):
  """A tiny DSpark config (head None: no Markov head)."""
  layer_types = {"sliding": None, "full": (FULL, FULL), "mixed": (SLIDING, FULL)}[kinds]
  return dataclasses.replace(
      TINY_DSPARK_CONFIG, block_size=block, n_head=heads[0], n_head_kv=heads[1],
      window=32 if kinds != "full" else None, layer_types=layer_types,
      family_fields=DSparkFields(sample_from_anchor=shifted, markov_rank=rank if head else 0,
                                 markov_head_type=head, confidence_head=conf,
                                 confidence_with_markov=conf and with_markov))


def prefilled(cfg, w, n_rows=20, seed=1, **kw) -> DFlashRef:
  ref = DFlashRef(cfg, w, **kw)
  ref.inject(ref.encode(synthetic_features(cfg, n_rows, seed=seed)), np.arange(n_rows))
  return ref


def as_v1(cfg):
  return dataclasses.replace(cfg, family="dflash", family_fields=None)


# --- independent float64 forward of SPEC_dflash2_dspark 4-6 -----------------------------------

def block_key_visible_f64(i, j, causal, window):
  if causal and j > i:
    return False
  if window is not None and (i - j >= window or (not causal and j - i >= window)):
    return False
  return True


def dflash2_forward_f64(cfg, w, stored, id_last, n_past, width=None, gemm_in=lambda x: x):
  """SPEC_dflash2_dspark 5.1-6 as float64 loops: the final-normed h [w, H] and the logits."""
  f2 = cfg.dflash2
  w = {k: v.astype(np.float64) for k, v in w.items()}
  rms = lambda x, g: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.eps) * g
  mm = lambda x, name: gemm_in(x.astype(np.float32)).astype(np.float64) @ w[name].T
  inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta)
  b, hd, e = width or cfg.block_size, cfg.head_dim, cfg.n_embd
  n_groups = e // f2.conv_group_size
  kk = f2.conv_kernel_size

  def conv(y, proj_out, base, side):
    # Coefficient of (row i, tap t, channel c) read from projection feature
    # (side * K + t) * n_groups + c // G, added to base[side, t, c]; rows before 0 are zero.
    out = np.zeros_like(y)
    chan_group = np.arange(e) // f2.conv_group_size
    for i in range(b):
      for t in range(kk):
        if i - t >= 0:
          coef = base[side, t] + proj_out[i, (side * kk + t) * n_groups + chan_group]
          out[i] += coef * y[i - t]
    return out

  positions = n_past + np.arange(b)
  x = f2.input_embedding_scale * w["tok_embd"][[id_last] + [cfg.mask_token_id] * (b - 1)]
  for l in range(cfg.n_layer):
    p = f"blk.{l}."
    k_st, v_st, pos_st, window = stored(l)
    causal = f2.is_causal if isinstance(f2.is_causal, bool) else f2.is_causal[l]
    a = rms(x, w[p + "attn_norm"])
    d = mm(a, p + "attn_conv_proj")
    a2 = conv(a, d, w[p + "attn_conv_base"], 0)
    q = rms(mm(a2, p + "attn_q").reshape(b, cfg.n_head, hd), w[p + "attn_q_norm"])
    k = rms(mm(a2, p + "attn_k").reshape(b, cfg.n_head_kv, hd), w[p + "attn_k_norm"])
    v = mm(a2, p + "attn_v").reshape(b, cfg.n_head_kv, hd)
    q, k = rope_pairs_f64(q, positions, inv_freq), rope_pairs_f64(k, positions, inv_freq)
    o = np.zeros((b, cfg.n_head, hd))
    for i in range(b):
      ring = [s for s, ps in enumerate(pos_st)
              if 0 <= ps < n_past and (window is None or n_past + i - ps < window)]
      blk = [j for j in range(b) if block_key_visible_f64(i, j, causal, window)]
      for h in range(cfg.n_head):
        g = h // cfg.group
        keys = np.concatenate([k_st[g, ring], k[blk, g]]).astype(np.float64)
        vals = np.concatenate([v_st[g, ring], v[blk, g]]).astype(np.float64)
        s = keys @ q[i, h] / np.sqrt(hd)
        pr = np.exp(s - s.max())
        o[i, h] = pr @ vals / pr.sum()
    x = x + conv(mm(o.reshape(b, -1), p + "attn_output"), d, w[p + "attn_conv_base"], 1)
    f = rms(x, w[p + "ffn_norm"])
    dm = mm(f, p + "ffn_conv_proj")
    f2_in = conv(f, dm, w[p + "ffn_conv_base"], 0)
    gt = mm(f2_in, p + "ffn_gate")
    m = mm(gt / (1 + np.exp(-gt)) * mm(f2_in, p + "ffn_up"), p + "ffn_down")
    x = x + conv(m, dm, w[p + "ffn_conv_base"], 1)
  h = rms(x, w["output_norm"])
  z = mm(h, "lm_head") * f2.output_multiplier
  if f2.final_logit_softcapping:
    z = f2.final_logit_softcapping * np.tanh(z / f2.final_logit_softcapping)
  return h, z


FORWARD_CASES = [
    # block, heads, kinds, K, G, cap, causal, window
    dict(block=8, heads=(4, 2), kinds="sliding", k_size=2, group=8, cap=12.0, causal=False),
    dict(block=5, heads=(6, 2), kinds="full", k_size=1, group=64, cap=None, causal=False),
    dict(block=7, heads=(4, 2), kinds="mixed", k_size=3, group=4, cap=12.0, causal=True),
    dict(block=16, heads=(6, 2), kinds="sliding", k_size=2, group=16, cap=None, causal=True),
    dict(block=16, heads=(4, 2), kinds="mixed", k_size=2, group=8, cap=12.0, causal=(True, False)),
    dict(block=8, heads=(6, 2), kinds="full", k_size=3, group=1, cap=3.0, causal=True),
    # a window shorter than the block: the sliding layers' symmetric (or causal) band bites
    dict(block=16, heads=(4, 2), kinds="sliding", k_size=2, group=8, cap=12.0, causal=False,
         window=6),
    dict(block=8, heads=(6, 2), kinds="mixed", k_size=2, group=16, cap=None, causal=True,
         window=3),
]


@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: "-".join(map(str, c.values())))
@pytest.mark.parametrize("width", [None, 4])
def test_dflash2_step_matches_an_independent_float64_forward(case, width):
  cfg = dflash2_cfg(**case)
  w = synthetic_drafter(cfg, seed=2, n_vocab=N_VOCAB)
  ref = prefilled(cfg, w, n_rows=20, capacity=40)
  h, expect = dflash2_forward_f64(cfg, w, stored_kv(ref), ID_LAST, 19, width=width)
  got = ref.step(ID_LAST, 19, width=width)
  assert got.shape == (width or cfg.block_size, N_VOCAB) and got.dtype == np.float32
  np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(ref.hidden(ID_LAST, 19, width=width), h, rtol=1e-4, atol=1e-4)


def test_dflash2_bf16_step_rounds_exactly_the_gemm_inputs():
  cfg = dflash2_cfg(kinds="mixed", k_size=3, group=4)
  w = synthetic_drafter(cfg, seed=3, n_vocab=N_VOCAB)
  ref = prefilled(cfg, w, capacity=40, dtype="bf16", ring_dtype="bf16")
  # Matrices (ndim 2) rounded to bf16; the [2, K, H] base kernels and the norms stay float32.
  w_bf16 = {k: round_bf16(v) if v.ndim == 2 else v for k, v in w.items()}
  _, expect = dflash2_forward_f64(cfg, w_bf16, stored_kv(ref), ID_LAST, 19, gemm_in=round_bf16)
  np.testing.assert_allclose(ref.step(ID_LAST, 19), expect, rtol=1e-4, atol=1e-4)
  fp32 = prefilled(cfg, w, capacity=40).step(ID_LAST, 19)
  rel = np.linalg.norm(ref.step(ID_LAST, 19) - fp32) / np.linalg.norm(fp32)
  assert 1e-5 < rel < 3e-2, rel


# --- the convolution (section 4) -------------------------------------------------------------

def conv_loop(y, a, proj, base, side, k_size, group):
  """Per channel and row: sum over taps of (base + a[i] . proj[feature]) y[i - t]."""
  rows, h = y.shape
  n_groups = h // group
  out = np.zeros((rows, h))
  for i in range(rows):
    for c in range(h):
      for t in range(k_size):
        if i - t < 0:
          continue
        feature = side * k_size * n_groups + t * n_groups + c // group
        coef = float(base[side, t, c]) + float(np.dot(a[i].astype(np.float64), proj[feature]))
        out[i, c] += coef * float(y[i - t, c])
  return out


@pytest.mark.parametrize("rows", [5, 7, 8, 16])
@pytest.mark.parametrize("k_size,group", [(1, 4), (2, 16), (3, 1), (2, 32)])
def test_conv_matches_a_per_channel_loop(rows, k_size, group):
  rng = np.random.default_rng(rows * 10 + k_size)
  h = 32
  a, y = rng.standard_normal((rows, h), np.float32), rng.standard_normal((rows, h), np.float32)
  proj = rng.standard_normal((2 * k_size * (h // group), h), np.float32) * np.float32(0.3)
  base = rng.standard_normal((2, k_size, h), np.float32)
  coef = fam.conv_coefficients(a @ proj.T, k_size)
  assert coef.shape == (rows, 2, k_size, h // group)
  for side in (0, 1):
    got = fam.grouped_causal_conv(y, base[side], coef[:, side])
    np.testing.assert_allclose(got, conv_loop(y, a, proj, base, side, k_size, group),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("side,tap,group", [(0, 0, 0), (0, 1, 3), (1, 0, 2), (1, 2, 1)])
def test_coefficient_layout_selects_one_side_tap_group(side, tap, group):
  # A projection with a single nonzero feature, built by hand at the (side, tap, group) slot:
  # with zero base kernels only that side's output, only that group's channels, and only rows
  # i >= tap move, by a[i, src] * y[i - tap].
  rows, h, k_size, g_size, src = 6, 16, 3, 4, 5
  n_groups = h // g_size
  rng = np.random.default_rng(0)
  a, y = rng.standard_normal((rows, h), np.float32), rng.standard_normal((rows, h), np.float32)
  proj = np.zeros((2 * k_size * n_groups, h), np.float32)
  proj[side * k_size * n_groups + tap * n_groups + group, src] = 1.0
  coef = fam.conv_coefficients(a @ proj.T, k_size)
  nonzero = np.argwhere(coef != 0)
  assert set(map(tuple, nonzero[:, 1:])) == {(side, tap, group)}
  base = np.zeros((k_size, h), np.float32)
  out = fam.grouped_causal_conv(y, base, coef[:, side])
  expect = np.zeros((rows, h), np.float32)
  chans = slice(group * g_size, (group + 1) * g_size)
  expect[tap:, chans] = a[tap:, src, None] * y[:rows - tap, chans]
  np.testing.assert_array_equal(out, expect)
  np.testing.assert_array_equal(fam.grouped_causal_conv(y, base, coef[:, 1 - side]), 0)


def test_conv_k1_zero_projection_is_a_per_channel_scale():
  rng = np.random.default_rng(1)
  y = rng.standard_normal((7, 24), np.float32)
  base = rng.standard_normal((1, 24), np.float32)
  out = fam.grouped_causal_conv(y, base, np.zeros((7, 1, 3), np.float32))
  np.testing.assert_array_equal(out, base[0] * y)


def test_conv_uses_output_row_coefficients_and_zeros_before_row_0():
  # Coefficients that differ per row: the output row's coefficient multiplies every tap.
  rows, h = 4, 8
  y = np.arange(1, rows * h + 1, dtype=np.float32).reshape(rows, h)
  coef = np.zeros((rows, 2, 2), np.float32)
  coef[:, 1, :] = np.arange(rows, dtype=np.float32)[:, None] + 1   # tap 1 coefficient = i + 1
  base = np.zeros((2, h), np.float32)
  out = fam.grouped_causal_conv(y, base, coef)
  np.testing.assert_array_equal(out[0], 0)                         # row -1 is zero
  for i in range(1, rows):
    np.testing.assert_array_equal(out[i], (i + 1) * y[i - 1])


def test_block_rows_only_see_earlier_rows_through_the_conv():
  rng = np.random.default_rng(2)
  y = rng.standard_normal((8, 16), np.float32)
  coef = rng.standard_normal((8, 3, 2), np.float32)
  base = rng.standard_normal((3, 16), np.float32)
  y2 = y.copy()
  y2[5:] += 1.0
  a, b = fam.grouped_causal_conv(y, base, coef), fam.grouped_causal_conv(y2, base, coef)
  np.testing.assert_array_equal(a[:5], b[:5])
  assert np.all(np.abs(a[5:] - b[5:]).max(axis=1) > 1e-3)


# --- masks (section 5.4) ---------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 3, 16])
def test_block_visibility_truth_table(causal, window):
  got = fam.block_visibility(8, causal, window)
  for i in range(8):
    for j in range(8):
      assert got[i, j] == block_key_visible_f64(i, j, causal, window), (i, j)
  if window == 3 and not causal:
    assert got[0].tolist() == [True, True, True, False, False, False, False, False]
  if window is None and not causal:
    assert got.all()


def test_causal_blocks_do_not_see_later_rows_and_non_causal_ones_do():
  for causal, kinds in ((True, "mixed"), (False, "mixed"), ((True, True), "full")):
    cfg = dflash2_cfg(block=8, kinds=kinds, causal=causal)
    w = synthetic_drafter(cfg, seed=4, n_vocab=N_VOCAB)
    ref = prefilled(cfg, w, capacity=40)
    full, narrow = ref.step(ID_LAST, 20), ref.step(ID_LAST, 20, width=4)
    if cfg.dflash2.is_causal is True:
      # Rows 0..3 of the 8-row block see exactly what the 4-row block's rows see.
      np.testing.assert_allclose(narrow, full[:4], rtol=1e-5, atol=1e-5)
    else:
      assert np.all(np.abs(narrow - full[:4]).max(axis=1) > 1e-3)


def test_causality_per_layer_changes_only_the_causal_layers():
  base = dflash2_cfg(kinds="mixed", causal=False)
  w = synthetic_drafter(base, seed=5, n_vocab=N_VOCAB)
  outs = {}
  for causal in (False, (True, False), (False, True), True):
    cfg = dataclasses.replace(base, family_fields=dataclasses.replace(base.dflash2,
                                                                      is_causal=causal))
    outs[causal] = prefilled(cfg, w, capacity=40).step(ID_LAST, 20)
  for a in outs:
    for b in outs:
      if a != b:
        assert np.abs(outs[a] - outs[b]).max() > 1e-3, (a, b)


# --- embedding scale, logit transforms (sections 5.2, 6) -------------------------------------

def test_embedding_scale_applies_to_every_row_anchor_included():
  cfg = dflash2_cfg(scale=2.5)
  w = synthetic_drafter(cfg, seed=6, n_vocab=N_VOCAB)
  unit = dataclasses.replace(cfg, family_fields=dataclasses.replace(cfg.dflash2,
                                                                    input_embedding_scale=1.0))
  w_scaled = {**w, "tok_embd": np.float32(2.5) * w["tok_embd"]}
  # Scaling the table by hand scales every row the same way: bitwise the same block.
  np.testing.assert_array_equal(prefilled(cfg, w).step(ID_LAST, 20),
                                prefilled(unit, w_scaled).step(ID_LAST, 20))
  # Scaling the mask rows only would differ.
  mask_only = {**w, "tok_embd": w["tok_embd"].copy()}
  mask_only["tok_embd"][cfg.mask_token_id] *= np.float32(2.5)
  assert np.abs(prefilled(unit, mask_only).step(ID_LAST, 20)
                - prefilled(cfg, w).step(ID_LAST, 20)).max() > 1e-3


@pytest.mark.parametrize("mult,cap", [(0.2, 20.0), (1.7, 3.0), (0.5, None)])
def test_logits_are_multiplied_then_softcapped(mult, cap):
  cfg = dflash2_cfg(mult=mult, cap=cap)
  w = synthetic_drafter(cfg, seed=7, n_vocab=N_VOCAB)
  plain = dataclasses.replace(cfg, family_fields=dataclasses.replace(
      cfg.dflash2, output_multiplier=1.0, final_logit_softcapping=None))
  raw = prefilled(plain, w).step(ID_LAST, 20).astype(np.float64)
  got = prefilled(cfg, w).step(ID_LAST, 20)
  expect = raw * mult if cap is None else cap * np.tanh(raw * mult / cap)
  np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5)
  if cap is not None:
    cap_first = mult * cap * np.tanh(raw / cap)
    assert np.abs(got - cap_first).max() > 1e-2
    assert np.abs(got).max() < cap


def test_softcap_zero_is_off():
  assert DFlash2Fields(2, 8, 8, 4, final_logit_softcapping=0.0).final_logit_softcapping is None


# --- the selector (section 7) ----------------------------------------------------------------

def lattice_f64(logits, g, id_last, pred, succ, k):
  """Brute force: each row's k candidates (sorted by logit, ties to the lower id) and, for every
  candidate of the previous row (the anchor for row 0), the k scores unary + edge."""
  logits, g = logits.astype(np.float64), g.astype(np.float64)
  pred, succ = pred.astype(np.float64), succ.astype(np.float64)
  cands = [sorted(range(logits.shape[1]), key=lambda v: (-logits[p, v], v))[:k]
           for p in range(logits.shape[0])]
  lattice = []
  for p, row in enumerate(cands):
    prevs = [id_last] if p == 0 else cands[p - 1]
    lattice.append(np.array([[logits[p, c] + sum(pred[t, r] * g[p, r] * succ[c, r]
                                                 for r in range(g.shape[1])) for c in row]
                             for t in prevs]))
  return np.array(cands), lattice


def argmax_chain(lattice):
  chain, prev = [], 0
  for scores in lattice:
    prev = int(np.argmax(scores[prev]))
    chain.append(prev)
  return np.array(chain)


def selector_inputs(seed, rows=5, vocab=40, rank=6, edge_scale=1.0):
  rng = np.random.default_rng(seed)
  logits = rng.standard_normal((rows, vocab), np.float32) * np.float32(2.0)
  g = rng.standard_normal((rows, rank), np.float32)
  pred = rng.standard_normal((vocab, rank), np.float32) * np.float32(edge_scale)
  succ = rng.standard_normal((vocab, rank), np.float32) * np.float32(edge_scale)
  return logits, g, pred, succ


@pytest.mark.parametrize("seed,k", [(0, 4), (1, 16), (2, 1), (3, 7)])
def test_greedy_walk_is_the_lattice_argmax_chain(seed, k):
  logits, g, pred, succ = selector_inputs(seed)
  walk = fam.selector_walk(logits, g, ID_LAST, pred, succ, k)
  cands, lattice = lattice_f64(logits, g, ID_LAST, pred, succ, k)
  chain = argmax_chain(lattice)
  np.testing.assert_array_equal(walk.candidates, cands)
  np.testing.assert_array_equal(walk.chosen, chain)
  np.testing.assert_array_equal(walk.drafts, cands[np.arange(len(chain)), chain])
  prev_idx = np.concatenate([[0], chain[:-1]])
  np.testing.assert_allclose(walk.scores, [lat[i] for lat, i in zip(lattice, prev_idx)],
                             rtol=1e-5, atol=1e-5)
  if k > 1:
    assert np.any(chain != 0), "the edges never changed a choice: the test proves nothing"
  assert walk.drafts.dtype == np.int32 and walk.q is None
  np.testing.assert_allclose(walk.walk_prob, fam.softmax(walk.scores)[np.arange(5), chain],
                             rtol=1e-6)


def test_walk_with_zero_codebooks_is_per_row_top_1():
  logits, g, pred, succ = selector_inputs(4)
  walk = fam.selector_walk(logits, g, ID_LAST, 0 * pred, 0 * succ, 6)
  np.testing.assert_array_equal(walk.drafts, np.argmax(logits, -1))
  np.testing.assert_array_equal(walk.chosen, 0)


def test_candidate_ties_break_to_the_lower_id():
  logits = np.zeros((1, 10), np.float32)
  logits[0, [7, 2, 5]] = 1.0
  np.testing.assert_array_equal(fam.top_k_candidates(logits, 4), [[2, 5, 7, 0]])


def test_sampled_walk_feeds_the_sampled_candidate_forward():
  logits, g, pred, succ = selector_inputs(5, rows=4)
  u = np.array([0.93, 0.11, 0.57, 0.999])
  walk = fam.selector_walk(logits, g, ID_LAST, pred, succ, 5, temperature=0.8, uniforms=u)
  cands, lattice = lattice_f64(logits, g, ID_LAST, pred, succ, 5)
  prev = 0
  for p in range(4):
    np.testing.assert_allclose(walk.scores[p], lattice[p][prev], rtol=1e-5, atol=1e-5)
    q = np.exp((lattice[p][prev] - lattice[p][prev].max()) / 0.8)
    q /= q.sum()
    np.testing.assert_allclose(walk.q[p], q, rtol=1e-5, atol=1e-6)
    cdf = np.cumsum(q)
    prev = int(np.searchsorted(cdf, u[p] * cdf[-1], side="right"))
    assert walk.chosen[p] == prev and walk.drafts[p] == cands[p][prev]
  assert np.any(walk.chosen != argmax_chain(lattice))


def test_sampled_walk_draws_the_lattice_joint_distribution():
  # Rows 1 and 2 of k = 3: the pair (j1, j2) must be drawn with q1(j1) q2(j2 | j1), where row 2's
  # scores depend on the candidate that row 1 drew.
  logits, g, pred, succ = selector_inputs(6, rows=2, vocab=10, rank=4, edge_scale=1.5)
  t, k, n = 0.9, 3, 20000
  _, lattice = lattice_f64(logits, g, ID_LAST, pred, succ, k)
  sm = lambda s: np.exp((s - s.max()) / t) / np.exp((s - s.max()) / t).sum()
  q1 = sm(lattice[0][0])
  expect = np.array([[q1[a] * sm(lattice[1][a])[b] for b in range(k)] for a in range(k)])
  rng = np.random.default_rng(7)
  counts = np.zeros((k, k))
  for _ in range(n):
    walk = fam.selector_walk(logits, g, ID_LAST, pred, succ, k, temperature=t,
                             uniforms=rng.random(2))
    counts[walk.chosen[0], walk.chosen[1]] += 1
  np.testing.assert_allclose(counts / n, expect, atol=0.015)
  # A walk that ignored the drawn predecessor would not match: the rows differ.
  assert np.abs(expect / expect.sum(1, keepdims=True) - expect.sum(0)).max() > 0.05


def test_sample_index_is_an_inverse_cdf():
  probs = np.array([0.0, 0.25, 0.0, 0.5, 0.25], np.float32)
  us = (np.arange(1000) + 0.5) / 1000
  draws = np.array([fam.sample_index(probs, u) for u in us])
  np.testing.assert_array_equal(np.bincount(draws, minlength=5) / 1000, probs)
  assert fam.sample_index(probs, 0.0) == 1


def test_dflash2_draft_runs_the_walk_on_its_own_rows():
  cfg = dflash2_cfg(top_k=5)
  w = synthetic_drafter(cfg, seed=8, n_vocab=N_VOCAB)
  w["selector_predecessor"] = w["selector_predecessor"] * np.float32(2.0)
  ref = prefilled(cfg, w)
  d = ref.draft(ID_LAST, 20)
  n = cfg.block_size - 1
  assert d.drafts.shape == (n,) and d.candidates.shape == (n, 5) and d.scores.shape == (n, 5)
  np.testing.assert_array_equal(d.logits, ref.step(ID_LAST, 20))
  # g of draft row p comes from the same row's final-normed h (not the previous row's).
  g = d.hidden[1:].astype(np.float64) @ w["selector_hidden"].T.astype(np.float64)
  cands, lattice = lattice_f64(d.logits[1:], g, ID_LAST, w["selector_predecessor"],
                               w["selector_successor"], 5)
  chain = argmax_chain(lattice)
  np.testing.assert_array_equal(d.chosen, chain)
  np.testing.assert_array_equal(d.drafts, cands[np.arange(n), chain])
  assert np.any(chain != 0)
  sampled = ref.draft(ID_LAST, 20, temperature=1.0, rng=np.random.default_rng(0))
  assert sampled.q.shape == (n, 5)
  np.testing.assert_allclose(sampled.q.sum(-1), 1.0, rtol=1e-5)
  dense = fam.sparse_to_dense(sampled.candidates, sampled.q, N_VOCAB)
  np.testing.assert_allclose(dense[np.arange(n)[:, None], sampled.candidates], sampled.q)
  assert np.count_nonzero(dense) == n * 5


# --- DFlash2 reduces to DFlash ---------------------------------------------------------------

@pytest.mark.parametrize("kinds", ["sliding", "full", "mixed"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_trivial_dflash2_is_dflash_bitwise(kinds, dtype):
  # K = 1, base kernels 1, zero projections and codebooks, multiplier and scale 1, no softcap,
  # non-causal: every DFlash2 addition is an exact identity, so the shared tensors give DFlash.
  cfg = dflash2_cfg(kinds=kinds, k_size=1, mult=1.0, cap=None, scale=1.0, causal=False)
  w = synthetic_drafter(cfg, seed=9, n_vocab=N_VOCAB)
  for name in w:
    if name.endswith("_conv_base"):
      w[name] = np.ones_like(w[name])
    elif name.endswith("_conv_proj") or name.startswith("selector_"):
      w[name] = np.zeros_like(w[name])
  v1 = as_v1(cfg)
  w_v1 = {k: v for k, v in w.items() if not k.endswith(("_conv_base", "_conv_proj"))
          and not k.startswith("selector_")}
  a = prefilled(cfg, w, capacity=40, dtype=dtype, ring_dtype=dtype)
  b = prefilled(v1, w_v1, capacity=40, dtype=dtype, ring_dtype=dtype)
  for width in (None, 3):
    np.testing.assert_array_equal(a.step(ID_LAST, 20, width), b.step(ID_LAST, 20, width))
    np.testing.assert_array_equal(a.draft(ID_LAST, 20, width).drafts,
                                  b.drafts(b.step(ID_LAST, 20, width)))


def test_per_row_argmax_drafts_are_dflash_only():
  cfg = dflash2_cfg()
  ref = DFlashRef(cfg, synthetic_drafter(cfg, n_vocab=N_VOCAB))
  with pytest.raises(ValueError, match="'dflash2' drafter's drafts come from draft"):
    ref.drafts(ref.step(ID_LAST, 0))


def test_dflash_draft_is_the_argmax_of_rows_after_the_first():
  w = synthetic_drafter(TINY_CONFIG, seed=10, n_vocab=N_VOCAB)
  ref = prefilled(TINY_CONFIG, w)
  d = ref.draft(ID_LAST, 20)
  logits = ref.step(ID_LAST, 20)
  np.testing.assert_array_equal(d.logits, logits)
  np.testing.assert_array_equal(d.drafts, ref.drafts(logits))
  p = np.exp(logits[1:] - logits[1:].max(-1, keepdims=True))
  np.testing.assert_allclose(d.draft_prob, (p / p.sum(-1, keepdims=True)).max(-1), rtol=1e-5)
  with pytest.raises(ValueError, match="rng"):
    ref.draft(ID_LAST, 20, temperature=0.5)
  s = ref.draft(ID_LAST, 20, temperature=0.5, rng=np.random.default_rng(1))
  assert s.q.shape == (TINY_CONFIG.block_size - 1, N_VOCAB)


# --- DSpark (sections 9, 11, 12) -------------------------------------------------------------

def markov_f64(base, h, prevs, head, w):
  """Each draft row's logits along the given predecessors, float64, the rnn state carried."""
  w = {k: v.astype(np.float64) for k, v in w.items()}
  sig = lambda x: 1.0 / (1.0 + np.exp(-x))
  out = np.array(base, np.float64)
  state = None
  for i, prev in enumerate(prevs):
    if head is None:
      continue
    e = w["markov_w1"][prev]
    if head == "vanilla":
      out[i] += w["markov_w2"] @ e
    elif head == "gated":
      gate = sig(w["markov_gate"] @ np.concatenate([h[i], e]) + w["markov_gate.bias"])
      out[i] += w["markov_w2"] @ (gate * e)
    else:
      r = e.shape[0]
      state = np.zeros(r) if state is None else state
      z = w["markov_joint"] @ np.concatenate([state, e, h[i]]) + w["markov_joint.bias"]
      gate = sig(z[:r])
      state = gate * state + (1 - gate) * np.tanh(z[r:2 * r])
      out[i] += w["markov_w2"] @ np.tanh(z[2 * r:])
  return out


DSPARK_CASES = [
    dict(head="vanilla", conf=True, with_markov=True, shifted=True, block=7, kinds="full"),
    dict(head="gated", conf=True, with_markov=False, shifted=True, block=5, kinds="sliding"),
    dict(head="rnn", conf=True, with_markov=True, shifted=True, block=8, kinds="mixed"),
    dict(head="rnn", conf=False, shifted=False, block=7, kinds="full"),
    dict(head="vanilla", conf=False, shifted=False, block=16, kinds="mixed"),
    dict(head=None, conf=True, with_markov=False, shifted=True, block=7, kinds="full"),
]


@pytest.mark.parametrize("case", DSPARK_CASES, ids=lambda c: "-".join(map(str, c.values())))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_dspark_draft_matches_an_independent_chain(case, temperature):
  cfg = dspark_cfg(**case)
  w = synthetic_drafter(cfg, seed=11, n_vocab=N_VOCAB)
  if "markov_w2" in w:
    w["markov_w2"] = w["markov_w2"] * np.float32(3.0)   # make the head move some drafts
  ref = prefilled(cfg, w, capacity=40)
  rng = np.random.default_rng(12) if temperature else None
  d = ref.draft(ID_LAST, 20, temperature=temperature, rng=rng)
  first = 0 if case["shifted"] else 1
  n = cfg.block_size - first
  assert d.drafts.shape == (n,) and d.logits.shape == d.base.shape == (cfg.block_size, N_VOCAB)
  # The backbone is DFlash's, bitwise, on the shared tensors.
  w_v1 = {k: v for k, v in w.items() if not k.startswith(("markov_", "conf_"))}
  backbone = prefilled(as_v1(cfg), w_v1, capacity=40).step(ID_LAST, 20)
  np.testing.assert_array_equal(d.base, backbone)
  np.testing.assert_array_equal(ref.step(ID_LAST, 20), backbone)
  # Row i's predecessor is the token just before the position it predicts: the anchor, then
  # the previous draft (greedy or sampled).
  prevs = np.concatenate([[ID_LAST], d.drafts[:-1]])
  expect = markov_f64(backbone[first:], d.hidden[first:].astype(np.float64), prevs,
                      case["head"], w)
  np.testing.assert_allclose(d.logits[first:], expect, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(d.logits[:first], backbone[:first])
  if temperature == 0:
    np.testing.assert_array_equal(d.drafts, np.argmax(expect, -1))
    assert d.q is None
    if case["head"] is None:
      np.testing.assert_array_equal(d.drafts, np.argmax(backbone[first:], -1))
  else:
    z = expect / temperature
    q = np.exp(z - z.max(-1, keepdims=True))
    np.testing.assert_allclose(d.q, q / q.sum(-1, keepdims=True), rtol=1e-4, atol=1e-7)
  if case["conf"]:
    f = d.hidden[first:].astype(np.float64)
    if case["with_markov"]:
      f = np.concatenate([f, w["markov_w1"][prevs].astype(np.float64)], axis=-1)
      assert w["conf_proj"].shape == (1, cfg.n_embd + cfg.dspark.markov_rank)
    else:
      assert w["conf_proj"].shape == (1, cfg.n_embd)
    conf = 1.0 / (1.0 + np.exp(-(f @ w["conf_proj"][0] + w["conf_proj.bias"][0])))
    assert d.conf.shape == (n,)
    np.testing.assert_allclose(d.conf, conf, rtol=1e-5, atol=1e-6)
  else:
    assert d.conf is None


def test_dspark_markov_heads_move_some_drafts():
  moved = 0
  for head in ("vanilla", "gated", "rnn"):
    cfg = dspark_cfg(head=head)
    w = synthetic_drafter(cfg, seed=13, n_vocab=N_VOCAB)
    w["markov_w2"] = w["markov_w2"] * np.float32(3.0)
    d = prefilled(cfg, w, capacity=40).draft(ID_LAST, 20)
    moved += int(np.sum(d.drafts != np.argmax(d.base, -1)))
  assert moved > 0


def test_dspark_shifted_rows_give_one_draft_per_row():
  for width in (None, 2, 5):
    cfg = dspark_cfg(head=None, conf=False)
    w = synthetic_drafter(cfg, seed=14, n_vocab=N_VOCAB)
    ref = prefilled(cfg, w, capacity=40)
    d = ref.draft(ID_LAST, 20, width)
    rows = width or cfg.block_size
    assert cfg.n_drafts(width) == rows and d.drafts.shape == (rows,)
    # Draft 0 (position n_past + 1) comes from the anchor row itself.
    np.testing.assert_array_equal(d.drafts, np.argmax(ref.step(ID_LAST, 20, width), -1))
    unshifted = dataclasses.replace(cfg, family_fields=dataclasses.replace(
        cfg.dspark, sample_from_anchor=False))
    d1 = DFlashRef(unshifted, w, capacity=40)
    d1.inject(d1.encode(synthetic_features(cfg, 20, seed=1)), np.arange(20))
    assert unshifted.n_drafts(width) == rows - 1
    np.testing.assert_array_equal(d1.draft(ID_LAST, 20, width).drafts, d.drafts[1:])


def test_vanilla_markov_with_zero_w2_is_the_argmax_of_base():
  cfg = dspark_cfg(head="vanilla", conf=False)
  w = synthetic_drafter(cfg, seed=15, n_vocab=N_VOCAB)
  w["markov_w2"] = np.zeros_like(w["markov_w2"])
  d = prefilled(cfg, w, capacity=40).draft(ID_LAST, 20)
  np.testing.assert_array_equal(d.drafts, np.argmax(d.base, -1))
  np.testing.assert_array_equal(d.logits, d.base)


def test_sampled_chain_draws_the_joint_distribution():
  # Two rows over 6 tokens: (d0, d1) must be drawn with q0(d0) q1(d1 | d0), row 1's logits
  # corrected by W1 of the token row 0 drew.
  cfg = dspark_cfg(head="vanilla", rank=4, conf=False)
  rng = np.random.default_rng(21)
  v, t, n = 6, 0.7, 20000
  w = {"markov_w1": rng.standard_normal((v, 4), np.float32),
       "markov_w2": rng.standard_normal((v, 4), np.float32)}
  base = rng.standard_normal((2, v), np.float32)
  h = np.zeros((2, cfg.n_embd), np.float32)
  sm = lambda z: np.exp(z / t - (z / t).max()) / np.exp(z / t - (z / t).max()).sum()
  q0 = sm(markov_f64(base[:1], h, [ID_LAST % v], "vanilla", w)[0])
  expect = np.array([q0[a] * sm(markov_f64(base[1:], h, [a], "vanilla", w)[0])
                     for a in range(v)])
  counts = np.zeros((v, v))
  for _ in range(n):
    chain = fam.markov_chain(base, h, ID_LAST % v, "vanilla", w, temperature=t,
                             uniforms=rng.random(2))
    counts[chain.drafts[0], chain.drafts[1]] += 1
  np.testing.assert_allclose(counts / n, expect, atol=0.015)
  assert np.abs(expect / expect.sum(1, keepdims=True) - expect.sum(0)).max() > 0.05


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_only_the_rnn_carries_state_across_rows(head):
  # Force row 1's draft, so row 2's predecessor is the same in both chains; change row 0's
  # draft. Row 2 can then differ only through a state carried from earlier rows.
  cfg = dspark_cfg(head=head)
  w = synthetic_drafter(cfg, seed=16, n_vocab=N_VOCAB)
  rng = np.random.default_rng(17)
  base = rng.standard_normal((3, N_VOCAB), np.float32)
  h = rng.standard_normal((3, cfg.n_embd), np.float32)
  base[1, 77] = 1e4
  outs = []
  for forced in (10, 20):
    b = base.copy()
    b[0, forced] = 1e4
    chain = fam.markov_chain(b, h, ID_LAST, head, w)
    assert chain.drafts[0] == forced and chain.drafts[1] == 77
    outs.append(chain.logits[2])
  if head == "rnn":
    assert np.abs(outs[0] - outs[1]).max() > 1e-3
  else:
    np.testing.assert_array_equal(outs[0], outs[1])


def test_rnn_state_starts_at_zero_and_is_not_reset_per_row():
  cfg = dspark_cfg(head="rnn")
  w = synthetic_drafter(cfg, seed=18, n_vocab=N_VOCAB)
  rng = np.random.default_rng(19)
  base = rng.standard_normal((4, N_VOCAB), np.float32)
  h = rng.standard_normal((4, cfg.n_embd), np.float32)
  chain = fam.markov_chain(base, h, ID_LAST, "rnn", w)
  prevs = np.concatenate([[ID_LAST], chain.drafts[:-1]])
  np.testing.assert_allclose(chain.logits, markov_f64(base, h, prevs, "rnn", w),
                             rtol=1e-5, atol=1e-5)
  restarted = np.stack([markov_f64(base[i:i + 1], h[i:i + 1], prevs[i:i + 1], "rnn", w)[0]
                        for i in range(4)])   # a state restarted at zero on every row
  np.testing.assert_allclose(chain.logits[0], restarted[0], rtol=1e-5, atol=1e-5)
  assert np.abs(chain.logits[1:] - restarted[1:]).max() > 1e-3


# --- verify length (section 12.2, p-min) -----------------------------------------------------

def test_verify_length_cuts_at_the_first_row_below_the_threshold():
  conf = np.array([0.9, 0.8, 0.3, 0.95, 0.1])
  assert fam.verify_length(conf, 0.0) == 5
  assert fam.verify_length(conf, 0.5) == 2
  assert fam.verify_length(conf, 0.85) == 1
  assert fam.verify_length(conf, 0.95) == 0
  assert fam.verify_length(conf, 0.05) == 5
  # Per-row values, not the survival product: 0.9 * 0.8 < 0.75 does not cut at row 1.
  assert fam.verify_length(conf, 0.75) == 2


def test_pmin_cut_reads_the_walk_probability():
  cfg = dflash2_cfg()
  w = synthetic_drafter(cfg, seed=20, n_vocab=N_VOCAB)
  d = prefilled(cfg, w).draft(ID_LAST, 20)
  p = d.draft_prob
  np.testing.assert_allclose(p, fam.softmax(d.scores)[np.arange(len(p)), d.chosen])
  cut = float(np.sort(p)[1])   # the second lowest probability
  n = fam.verify_length(p, cut)
  assert np.all(p[:n] >= cut) and (n == len(p) or p[n] < cut)
