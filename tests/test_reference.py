"""The numpy reference against SPEC.md section 3-5, with independent float64 checks."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from reference import DFlashRef, attention, first_mismatch, rope_neox, round_bf16
from dflash_jax.config import FULL, SLIDING
from reference.dflash_ref import ring_visibility

CFG = dfj.TINY_CONFIG
N_VOCAB = 512
ID_LAST = 3  # any token but CFG.mask_token_id, so block row 0 differs from the mask rows


@pytest.fixture(scope="module")
def w():
  return dfj.synthetic_drafter(CFG, seed=0, n_vocab=N_VOCAB)


def prefilled(w, n_rows=20, window=None, seed=1, **kw) -> DFlashRef:
  ref = DFlashRef(CFG, w, window=window, **kw)
  ref.inject(ref.encode(dfj.synthetic_features(CFG, n_rows, seed=seed)), np.arange(n_rows))
  return ref


def perturb_slots(ref: DFlashRef, slots, seed=5) -> None:
  rng = np.random.default_rng(seed)
  ref.ring_k[:, :, slots] += rng.standard_normal(ref.ring_k[:, :, slots].shape, np.float32)
  ref.ring_v[:, :, slots] += rng.standard_normal(ref.ring_v[:, :, slots].shape, np.float32)


def attention_f64(q, k_ring, v_ring, ring_pos, k_blk, v_blk, n_past, window, kv_head):
  """Plain per-row, per-head loop in float64; kv_head(h) picks the kv head of query head h;
  window None = full attention."""
  t_rows, hq, d = q.shape
  out = np.zeros((t_rows, hq, d))
  for t in range(t_rows):
    ring = [j for j, p in enumerate(ring_pos)
            if 0 <= p < n_past and (window is None or n_past + t - p < window)]
    for h in range(hq):
      g = kv_head(h)
      keys = np.concatenate([k_ring[g, ring], k_blk[:, g]]).astype(np.float64)
      vals = np.concatenate([v_ring[g, ring], v_blk[:, g]]).astype(np.float64)
      s = keys @ q[t, h].astype(np.float64) / np.sqrt(d)
      p = np.exp(s - s.max())
      out[t, h] = p @ vals / p.sum()
  return out


def random_attention_inputs(seed=0, t=5, hq=6, hkv=2, d=8, w=12):
  rng = np.random.default_rng(seed)
  f = lambda *s: rng.standard_normal(s, np.float32)
  ring_pos = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1, -1], np.int32)[:w]
  return f(t, hq, d), f(hkv, w, d), f(hkv, w, d), ring_pos, f(t, hkv, d), f(t, hkv, d)


def neox_pairs(d):
  return [(i, i + d // 2) for i in range(d // 2)]


def rope_pairs_f64(x, positions, inv_freq, pairs=None, f32_angle=True):
  """Explicit per-pair rotation: pair number i = (a, b) turns by pos * inv_freq[i]."""
  y = np.zeros(x.shape)
  for t, pos in enumerate(positions):
    for i, (a, b) in enumerate(pairs or neox_pairs(x.shape[-1])):
      angle = np.float32(pos) * inv_freq[i] if f32_angle else float(pos) * float(inv_freq[i])
      c, s = np.cos(np.float64(angle)), np.sin(np.float64(angle))
      xa, xb = x[..., t, :, a].astype(np.float64), x[..., t, :, b].astype(np.float64)
      y[..., t, :, a], y[..., t, :, b] = xa * c - xb * s, xb * c + xa * s
  return y


def stored_kv(ref: DFlashRef):
  """l -> layer l's (k [Hkv, S, D], v, pos, window or None) from ref's public stacks: layer l
  is entry i of its kind's stack, i = the number of earlier layers of the same kind."""
  kinds = ref.cfg.kinds

  def get(l):
    i = kinds[:l].count(kinds[l])
    if kinds[l] == SLIDING:
      return ref.ring_k[i], ref.ring_v[i], ref.ring_pos, ref.window
    return ref.cache_k[i], ref.cache_v[i], ref.cache_pos, None
  return get


def forward_f64(cfg, w, stored, id_last, n_past, width=None, gemm_in=lambda x: x):
  """SPEC.md block_step (sections 3, 6, 7) as plain float64 loops over a block of `width`
  rows (default block_size); stored(l) gives layer l's (k, v, pos, window); gemm_in models
  the rounding of GEMM inputs."""
  w = {k: v.astype(np.float64) for k, v in w.items()}
  rms = lambda x, g: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.eps) * g
  mm = lambda x, name: gemm_in(x.astype(np.float32)).astype(np.float64) @ w[name].T
  inv_freq = dfj.rope_inv_freq(cfg.head_dim, cfg.rope_theta)
  b, hd = width or cfg.block_size, cfg.head_dim
  positions = n_past + np.arange(b)
  x = w["tok_embd"][[id_last] + [cfg.mask_token_id] * (b - 1)]
  for l in range(cfg.n_layer):
    p = f"blk.{l}."
    a = rms(x, w[p + "attn_norm"])
    q = rms(mm(a, p + "attn_q").reshape(b, cfg.n_head, hd), w[p + "attn_q_norm"])
    k = rms(mm(a, p + "attn_k").reshape(b, cfg.n_head_kv, hd), w[p + "attn_k_norm"])
    v = mm(a, p + "attn_v").reshape(b, cfg.n_head_kv, hd)
    q, k = rope_pairs_f64(q, positions, inv_freq), rope_pairs_f64(k, positions, inv_freq)
    k_st, v_st, pos_st, window = stored(l)
    o = attention_f64(q, k_st, v_st, pos_st, k, v, n_past, window, lambda h: h // cfg.group)
    x = x + mm(o.reshape(b, -1), p + "attn_output")
    f = rms(x, w[p + "ffn_norm"])
    g = mm(f, p + "ffn_gate")
    x = x + mm(g / (1 + np.exp(-g)) * mm(f, p + "ffn_up"), p + "ffn_down")
  return mm(rms(x, w["output_norm"]), "lm_head")


def inject_f64(w, h, positions, cfg=CFG):
  """SPEC.md inject for one call without shared slots: per-layer K [L, T, Hkv, D] and V."""
  w = {k: v.astype(np.float64) for k, v in w.items()}
  inv_freq = dfj.rope_inv_freq(cfg.head_dim, cfg.rope_theta)
  shape = (len(positions), cfg.n_head_kv, cfg.head_dim)
  ks, vs = [], []
  for l in range(cfg.n_layer):
    k = (h @ w[f"blk.{l}.attn_k"].T).reshape(shape)
    k = k / np.sqrt(np.mean(k * k, -1, keepdims=True) + cfg.eps) * w[f"blk.{l}.attn_k_norm"]
    ks.append(rope_pairs_f64(k, positions, inv_freq))
    vs.append((h @ w[f"blk.{l}.attn_v"].T).reshape(shape))
  return np.stack(ks), np.stack(vs)


# --- ring ------------------------------------------------------------------------------------

def test_positions_past_the_window_wrap_and_later_rows_win(w):
  ref = DFlashRef(CFG, w, window=8)
  h = ref.encode(dfj.synthetic_features(CFG, 3))
  ref.inject(h, np.array([3, 13, 21]))
  assert ref.ring_pos.tolist() == [-1, -1, -1, 3, -1, 21, -1, -1]
  alone, loser = DFlashRef(CFG, w, window=8), DFlashRef(CFG, w, window=8)
  alone.inject(h[2:], np.array([21]))
  loser.inject(h[1:2], np.array([13]))
  np.testing.assert_allclose(ref.ring_k[:, :, 5], alone.ring_k[:, :, 5], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ref.ring_v[:, :, 5], alone.ring_v[:, :, 5], rtol=1e-5, atol=1e-6)
  assert np.abs(ref.ring_k[:, :, 5] - loser.ring_k[:, :, 5]).max() > 1e-2


def test_call_longer_than_window_keeps_the_last_rows(w):
  h = DFlashRef(CFG, w).encode(dfj.synthetic_features(CFG, 20))
  long_call, last_rows = DFlashRef(CFG, w, window=8), DFlashRef(CFG, w, window=8)
  long_call.inject(h, np.arange(20))
  last_rows.inject(h[12:], np.arange(12, 20))
  assert long_call.ring_pos.tolist() == [16, 17, 18, 19, 12, 13, 14, 15]
  # Bitwise: both calls compute the same 8 surviving rows, so BLAS sums them alike.
  np.testing.assert_array_equal(long_call.ring_pos, last_rows.ring_pos)
  np.testing.assert_array_equal(long_call.ring_k, last_rows.ring_k)
  np.testing.assert_array_equal(long_call.ring_v, last_rows.ring_v)


def test_encode_inject_matches_a_per_token_loop(w):
  feats = dfj.synthetic_features(CFG, 20)
  batched = prefilled(w, 20)
  looped = DFlashRef(CFG, w)
  for t in range(20):
    looped.inject(looped.encode(feats[t:t + 1]), np.array([t]))
  np.testing.assert_array_equal(looped.ring_pos, batched.ring_pos)
  # Not bitwise: BLAS sums a 1-row GEMM in a different order than a 20-row one.
  np.testing.assert_allclose(looped.ring_k, batched.ring_k, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(looped.ring_v, batched.ring_v, rtol=1e-5, atol=1e-5)


def test_step_leaves_the_ring_unchanged(w):
  ref = prefilled(w, 20)
  before = (ref.ring_k.copy(), ref.ring_v.copy(), ref.ring_pos.copy())
  ref.step(ID_LAST, 20)
  ref.step(ID_LAST, 7)
  for a, b in zip(before, (ref.ring_k, ref.ring_v, ref.ring_pos)):
    np.testing.assert_array_equal(a, b)


def test_inject_matches_an_independent_float64_computation(w):
  ref = DFlashRef(CFG, w, window=8)
  h = ref.encode(dfj.synthetic_features(CFG, 8))
  positions = np.arange(20, 28)
  ref.inject(h, positions)
  k, v = inject_f64(w, h.astype(np.float64), positions)
  slots = positions % 8
  np.testing.assert_allclose(ref.ring_k[:, :, slots], k.transpose(0, 2, 1, 3), atol=2e-5)
  np.testing.assert_allclose(ref.ring_v[:, :, slots], v.transpose(0, 2, 1, 3), atol=2e-5)


def test_step_matches_an_independent_float64_forward(w):
  ref = prefilled(w, 20, window=8)  # rows see different windowed subsets of the ring
  got = ref.step(ID_LAST, 19)
  expect = forward_f64(CFG, w, stored_kv(ref), ID_LAST, 19)
  np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4)


# --- masks -----------------------------------------------------------------------------------

def test_window_masks_only_the_deep_past(w):
  ref = prefilled(w, 20, window=8)  # ring holds positions 12..19; slot of p is p % 8
  base = ref.step(ID_LAST, 20)
  perturb_slots(ref, [12 % 8])  # q - 12 >= 8 for every block row q >= 20
  np.testing.assert_array_equal(ref.step(ID_LAST, 20), base)
  perturb_slots(ref, [19 % 8])
  assert np.abs(ref.step(ID_LAST, 20) - base).max() > 1e-3


def test_window_mask_differs_per_block_row():
  q, kr, vr, _, kb, vb = random_attention_inputs(t=8, w=8)
  ring_pos = (12 + (np.arange(8) - 12) % 8).astype(np.int32)  # slot p % 8 holds p in 12..19
  base = attention(q, kr, vr, ring_pos, kb, vb, 20, 8)
  kr2 = kr.copy()
  kr2[:, 15 % 8] += 3.0  # row t sees p iff 20 + t - p < 8: p = 15 only for rows 0..2
  diff = np.abs(attention(q, kr2, vr, ring_pos, kb, vb, 20, 8) - base).max(axis=(1, 2))
  assert np.all(diff[:3] > 1e-4)
  np.testing.assert_array_equal(diff[3:], 0.0)


def test_ring_entries_at_or_after_n_past_are_invisible(w):
  ref = prefilled(w, 20)  # window 32: slots 0..19 hold positions 0..19, 20..31 are empty
  base = ref.step(ID_LAST, 12)
  perturb_slots(ref, list(range(12, 32)))
  np.testing.assert_array_equal(ref.step(ID_LAST, 12), base)
  perturb_slots(ref, [11])
  assert np.abs(ref.step(ID_LAST, 12) - base).max() > 1e-3


def test_ring_visibility_truth_table():
  ring_pos = np.array([-1, 0, 3, 4, 5, 9], np.int32)
  got = ring_visibility(ring_pos, n_past=5, window=4, n_rows=2)
  # row 0 at q=5 sees p in [2, 5); row 1 at q=6 sees p in [3, 5)
  assert got.tolist() == [[False, False, True, True, False, False],
                          [False, False, True, True, False, False]]
  got = ring_visibility(ring_pos, n_past=5, window=3, n_rows=2)
  assert got.tolist() == [[False, False, True, True, False, False],
                          [False, False, False, True, False, False]]


def test_block_attention_is_non_causal(w):
  # Only the mask rows (1..) see a different input; row 0 can change only by attending to them.
  w2 = dict(w)
  w2["tok_embd"] = w["tok_embd"].copy()
  w2["tok_embd"][CFG.mask_token_id] = np.random.default_rng(9).standard_normal(CFG.n_embd)
  a, b = prefilled(w, 20), prefilled(w2, 20)
  np.testing.assert_array_equal(a.ring_k, b.ring_k)
  assert np.abs(a.step(ID_LAST, 20)[0] - b.step(ID_LAST, 20)[0]).max() > 1e-3

  q, kr, vr, ring_pos, kb, vb = random_attention_inputs()
  kb2, vb2 = kb.copy(), vb.copy()
  kb2[-1] += 2.0
  vb2[-1] += 2.0
  base = attention(q, kr, vr, ring_pos, kb, vb, 8, 32)
  later = attention(q, kr, vr, ring_pos, kb2, vb2, 8, 32)
  assert np.all(np.abs(later - base).max(axis=(1, 2)) > 1e-3)


def test_gqa_uses_contiguous_groups():
  q, kr, vr, ring_pos, kb, vb = random_attention_inputs(hq=6, hkv=2)
  got = attention(q, kr, vr, ring_pos, kb, vb, 8, 6)
  contiguous = attention_f64(q, kr, vr, ring_pos, kb, vb, 8, 6, lambda h: h // 3)
  interleaved = attention_f64(q, kr, vr, ring_pos, kb, vb, 8, 6, lambda h: h % 2)
  np.testing.assert_allclose(got, contiguous, rtol=1e-5, atol=1e-6)
  assert np.abs(got - interleaved).max() > 1e-2


# --- rope ------------------------------------------------------------------------------------

def test_rope_neox_pairing():
  inv_freq = dfj.rope_inv_freq(16, 1e4)
  x = np.random.default_rng(0).standard_normal((2, 4, 3, 16), np.float32)
  positions = np.array([0, 1, 7, 301])
  got = rope_neox(x, positions, inv_freq)
  np.testing.assert_allclose(got, rope_pairs_f64(x, positions, inv_freq), atol=2e-6)
  np.testing.assert_array_equal(rope_neox(x[0], positions, inv_freq), got[0])
  gptj = rope_pairs_f64(x, positions, inv_freq, pairs=[(2 * i, 2 * i + 1) for i in range(8)])
  assert np.abs(got - gptj).max() > 1e-2


def test_rope_angle_is_a_float32_product():
  inv_freq = dfj.rope_inv_freq(16, 1e4)
  x = np.random.default_rng(1).standard_normal((3, 2, 16), np.float32)
  positions = np.array([999_983, 1_234_567, 4_000_037])
  got = rope_neox(x, positions, inv_freq)
  np.testing.assert_allclose(got, rope_pairs_f64(x, positions, inv_freq), atol=1e-5)
  f64_angle = rope_pairs_f64(x, positions, inv_freq, f32_angle=False)
  assert np.abs(got - f64_angle).max() > 1e-3


@pytest.mark.parametrize("head_dim,theta", [(16, 1e4), (128, 5e5), (128, 1e6)])
def test_inv_freq_is_the_float32_rounding_of_a_float64_table(head_dim, theta):
  i = np.arange(head_dim // 2, dtype=np.float64)
  table = dfj.rope_inv_freq(head_dim, theta)
  assert table.dtype == np.float32
  np.testing.assert_array_equal(table, (theta ** (-2.0 * i / head_dim)).astype(np.float32))


def test_reference_uses_the_host_table(w):
  ref = DFlashRef(CFG, w)
  np.testing.assert_array_equal(ref.inv_freq, dfj.rope_inv_freq(CFG.head_dim, CFG.rope_theta))


# --- drafts, accept, determinism ---------------------------------------------------------------

def test_two_runs_are_bit_identical(w):
  a, b = prefilled(w, 20), prefilled(w, 20)
  la, lb = a.step(ID_LAST, 20), b.step(ID_LAST, 20)
  assert la.shape == (CFG.block_size, N_VOCAB) and la.dtype == np.float32
  np.testing.assert_array_equal(la, lb)
  np.testing.assert_array_equal(a.step(ID_LAST, 20), la)
  np.testing.assert_array_equal(a.ring_k, b.ring_k)


def test_drafts_are_argmax_of_rows_after_the_first_with_ties_low(w):
  ref = DFlashRef(CFG, w)
  logits = np.random.default_rng(3).standard_normal((CFG.block_size, N_VOCAB)).astype(np.float32)
  logits[0, 11] = 100.0  # row 0 is unused
  logits[2, [40, 9, 300]] = 50.0  # a three-way tie resolves to the lowest id
  d = ref.drafts(logits)
  assert d.dtype == np.int32 and d.shape == (CFG.block_size - 1,)
  np.testing.assert_array_equal(d, np.argmax(logits[1:], -1))
  assert d[1] == 9


def test_accept(w):
  ref = DFlashRef(CFG, w)
  drafts = np.array([5, 6, 7, 8], np.int32)
  assert ref.accept(drafts, np.array([9, 6, 7, 8, 1])) == 0
  assert ref.accept(drafts, np.array([5, 6, 2, 8, 1])) == 2
  assert ref.accept(drafts, np.array([5, 6, 7, 8, 1])) == 4
  assert first_mismatch(drafts, np.array([5, 6, 7, 8])) == 4
  with pytest.raises(ValueError, match="fewer"):
    first_mismatch(drafts, np.array([5, 6]))


# --- precision ---------------------------------------------------------------------------------

def test_bf16_ring_stores_the_rounded_fp32_ring(w):
  fp32, bf16 = prefilled(w, 20), prefilled(w, 20, ring_dtype="bf16")
  np.testing.assert_array_equal(bf16.ring_k, round_bf16(fp32.ring_k))
  np.testing.assert_array_equal(bf16.ring_v, round_bf16(fp32.ring_v))
  assert np.any(fp32.ring_k != bf16.ring_k)


def test_bf16_weights_round_matrices_and_gemm_inputs(w):
  ref = DFlashRef(CFG, w, dtype=jnp.bfloat16)
  assert ref.dtype == "bf16"
  np.testing.assert_array_equal(ref.w["blk.1.ffn_up"], round_bf16(w["blk.1.ffn_up"]))
  np.testing.assert_array_equal(ref.w["lm_head"], round_bf16(w["lm_head"]))
  np.testing.assert_array_equal(ref.w["blk.0.attn_k_norm"], w["blk.0.attn_k_norm"])
  feats = dfj.synthetic_features(CFG, 6)
  pre = round_bf16(feats) @ round_bf16(w["fc"]).T
  ms = np.mean(pre * pre, -1, keepdims=True)
  expect = pre / np.sqrt(ms + np.float32(CFG.eps)) * w["enc.output_norm"]
  np.testing.assert_array_equal(ref.encode(feats), expect)


def test_bf16_step_rounds_exactly_the_gemm_inputs(w):
  # Weights and GEMM inputs rounded to bf16; the block's own K/V and everything else stay fp32.
  ref = prefilled(w, 20, window=8, dtype="bf16", ring_dtype="bf16")
  w_bf16 = {k: round_bf16(v) if v.ndim == 2 else v for k, v in w.items()}
  got = ref.step(ID_LAST, 19)
  expect = forward_f64(CFG, w_bf16, stored_kv(ref), ID_LAST, 19, gemm_in=round_bf16)
  np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype,ring_dtype", [("bf16", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")])
def test_bf16_modes_differ_by_a_bf16_sized_amount(w, dtype, ring_dtype):
  base = prefilled(w, 20).step(ID_LAST, 20)
  got = prefilled(w, 20, dtype=dtype, ring_dtype=ring_dtype).step(ID_LAST, 20)
  rel = np.linalg.norm(got - base) / np.linalg.norm(base)
  assert 1e-5 < rel < 3e-2, rel


def test_precision_names(w):
  for name in ("fp32", "float32", np.float32, jnp.float32):
    assert DFlashRef(CFG, w, dtype=name).dtype == "fp32"
  for name in ("bf16", "bfloat16", jnp.bfloat16):
    assert DFlashRef(CFG, w, ring_dtype=name).ring_dtype == "bf16"
  with pytest.raises(ValueError, match="precision"):
    DFlashRef(CFG, w, dtype="fp16")


# --- validation --------------------------------------------------------------------------------

def test_input_validation(w):
  ref = DFlashRef(CFG, w)
  feats = dfj.synthetic_features(CFG, 4)
  with pytest.raises(ValueError, match="features must be"):
    ref.encode(feats[:, :-1])
  bad = feats.copy()
  bad[2, 5] = np.nan
  with pytest.raises(ValueError, match="NaN"):
    ref.encode(bad)
  h = ref.encode(feats)
  with pytest.raises(ValueError, match="positions must be in"):
    ref.inject(h, np.array([0, 1, -2, 3]))
  with pytest.raises(ValueError, match="positions must be 4"):
    ref.inject(h, np.arange(3))
  with pytest.raises(ValueError, match="id_last"):
    ref.step(N_VOCAB, 4)
  with pytest.raises(ValueError, match="id_last"):
    ref.step(-1, 4)
  with pytest.raises(ValueError, match="n_past"):
    ref.step(ID_LAST, -1)
  for name in ("tok_embd", "lm_head"):
    missing = {k: v for k, v in w.items() if k != name}
    with pytest.raises(ValueError, match=f"lack '{name}'.*target"):
      DFlashRef(CFG, missing)
  with pytest.raises(ValueError, match="blk.1.attn_q"):
    DFlashRef(CFG, {**w, "blk.1.attn_q": w["blk.1.attn_q"][:, :-1]})


def test_window_comes_from_config_unless_overridden(w):
  assert DFlashRef(CFG, w).ring_k.shape == (CFG.n_layer, CFG.n_head_kv, CFG.window, CFG.head_dim)
  assert DFlashRef(CFG, w, window=2048).ring_pos.shape == (2048,)
  assert DFlashRef(dataclasses.replace(CFG, window=None), w).window == 2048


# --- one speculative round (SPEC.md section 4) -------------------------------------------------

@pytest.mark.parametrize("window,expect_pos", [
    (32, list(range(14)) + [-1] * 18),
    (8, [8, 9, 10, 11, 12, 13, 6, 7]),
])
def test_one_speculative_round(w, window, expect_pos):
  rng = np.random.default_rng(4)
  prompt = rng.integers(0, N_VOCAB, 11)
  feats = dfj.synthetic_features(CFG, 14, seed=6)  # the target's features for positions 0..13
  ref = DFlashRef(CFG, w, window=window)
  ref.inject(ref.encode(feats[:10]), np.arange(10))  # prefill: features of p[0..N-2]
  id_last, n_past = int(prompt[-1]), 10

  drafts = ref.drafts(ref.step(id_last, n_past))
  target = rng.integers(0, N_VOCAB, CFG.block_size)
  target[:3] = drafts[:3]
  target[3] = (drafts[3] + 1) % N_VOCAB  # the target disagrees at the fourth draft
  n_ok = ref.accept(drafts, target)
  assert n_ok == 3

  # rows 0..n_ok (id_last and the accepted drafts) at n_past..n_past+n_ok; rejected rows never
  ref.inject(ref.encode(feats[10:10 + n_ok + 1]), n_past + np.arange(n_ok + 1))
  n_past, id_last = n_past + n_ok + 1, int(target[n_ok])
  assert n_past == 14
  assert ref.ring_pos.tolist() == expect_pos

  everything = DFlashRef(CFG, w, window=window)
  everything.inject(everything.encode(feats), np.arange(14))
  np.testing.assert_array_equal(ref.ring_pos, everything.ring_pos)
  np.testing.assert_allclose(ref.ring_k, everything.ring_k, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ref.step(id_last, n_past), everything.step(id_last, n_past),
                             rtol=1e-4, atol=1e-4)


# --- per-layer attention kinds (SPEC.md section 7) ---------------------------------------------

# Layer 1 attends to everything injected; layers 0 and 2 slide. An interior full layer catches
# a wrong layer -> stack entry mapping that a trailing one would not.
MIXED = dataclasses.replace(CFG, n_layer=3, layer_types=(SLIDING, FULL, SLIDING))


@pytest.fixture(scope="module")
def w_mixed():
  return dfj.synthetic_drafter(MIXED, seed=2, n_vocab=N_VOCAB)


def mixed_prefilled(w_mixed, n_rows=20, window=8, capacity=32, **kw) -> DFlashRef:
  ref = DFlashRef(MIXED, w_mixed, window=window, capacity=capacity, **kw)
  ref.inject(ref.encode(dfj.synthetic_features(MIXED, n_rows, seed=3)), np.arange(n_rows))
  return ref


def test_each_kind_stores_its_layers_at_its_slots(w_mixed):
  ref = DFlashRef(MIXED, w_mixed, window=8, capacity=32)
  assert ref.ring_k.shape == (2, MIXED.n_head_kv, 8, MIXED.head_dim)
  assert ref.cache_k.shape == (1, MIXED.n_head_kv, 32, MIXED.head_dim)
  h = ref.encode(dfj.synthetic_features(MIXED, 3))
  positions = np.array([3, 13, 21])
  ref.inject(h, positions)
  assert ref.ring_pos.tolist() == [-1, -1, -1, 3, -1, 21, -1, -1]       # 13 lost to 21
  assert np.flatnonzero(ref.cache_pos >= 0).tolist() == [3, 13, 21]   # slot = position
  np.testing.assert_array_equal(ref.cache_pos[[3, 13, 21]], positions)
  k, v = inject_f64(w_mixed, h.astype(np.float64), positions, cfg=MIXED)   # [L, T, Hkv, D]
  for stack, layer in ((0, 0), (1, 2)):
    np.testing.assert_allclose(ref.ring_k[stack][:, [3, 5]], k[layer][[0, 2]].transpose(1, 0, 2),
                               atol=2e-5)
    np.testing.assert_allclose(ref.ring_v[stack][:, [3, 5]], v[layer][[0, 2]].transpose(1, 0, 2),
                               atol=2e-5)
  np.testing.assert_allclose(ref.cache_k[0][:, positions], k[1].transpose(1, 0, 2), atol=2e-5)
  np.testing.assert_allclose(ref.cache_v[0][:, positions], v[1].transpose(1, 0, 2), atol=2e-5)


def test_single_kind_drafters_have_one_stack(w):
  sliding = DFlashRef(CFG, w)
  assert sliding.cache_k is None and sliding.capacity is None and sliding.window == CFG.window
  full_cfg = dataclasses.replace(CFG, layer_types=(FULL,) * CFG.n_layer, context_length=40)
  full = DFlashRef(full_cfg, w)
  assert full.ring_k is None and full.window is None
  assert full.capacity == 40 and full.cache_pos.shape == (40,)
  assert DFlashRef(full_cfg, w, capacity=12).cache_k.shape[2] == 12


def test_injecting_past_the_capacity_raises_before_any_write(w_mixed):
  ref = mixed_prefilled(w_mixed, n_rows=20)
  before = [a.copy() for a in (ref.ring_k, ref.ring_v, ref.ring_pos, ref.cache_k, ref.cache_v,
                               ref.cache_pos)]
  h = ref.encode(dfj.synthetic_features(MIXED, 3, seed=4))
  with pytest.raises(ValueError, match=r"full_attention layers \[1\].*capacity 32.*position 33"):
    ref.inject(h, np.array([30, 31, 33]))
  for a, b in zip(before, (ref.ring_k, ref.ring_v, ref.ring_pos, ref.cache_k, ref.cache_v,
                           ref.cache_pos)):
    np.testing.assert_array_equal(a, b)
  ref.inject(h, np.array([29, 30, 31]))                 # the last slot is still usable
  assert ref.cache_pos[31] == 31


def test_full_layers_see_the_deep_past_and_sliding_layers_do_not(w_mixed):
  ref = mixed_prefilled(w_mixed, n_rows=20)   # ring: 12..19; cache: 0..19
  base = ref.step(ID_LAST, 20)
  ref.ring_k[:, :, 12 % 8] += 3.0              # q - 12 >= 8 for every block row
  np.testing.assert_array_equal(ref.step(ID_LAST, 20), base)
  ref.cache_k[:, :, 2] += 3.0                  # position 2: outside any window, full layer sees it
  assert np.abs(ref.step(ID_LAST, 20) - base).max() > 1e-3


def test_full_cache_entries_at_or_after_n_past_are_invisible(w_mixed):
  ref = mixed_prefilled(w_mixed, n_rows=20)
  base = ref.step(ID_LAST, 12)
  ref.cache_k[:, :, 12:] += 3.0
  ref.cache_v[:, :, 12:] += 3.0
  np.testing.assert_array_equal(ref.step(ID_LAST, 12), base)
  ref.cache_v[:, :, 11] += 3.0
  assert np.abs(ref.step(ID_LAST, 12) - base).max() > 1e-3


def test_visibility_without_a_window():
  ring_pos = np.array([-1, 0, 3, 4, 5, 9], np.int32)
  got = ring_visibility(ring_pos, n_past=5, window=None, n_rows=3)
  assert got.tolist() == [[False, True, True, True, False, False]] * 3


@pytest.mark.parametrize("width", [None, 2, 5])
def test_mixed_step_matches_an_independent_float64_forward(w_mixed, width):
  ref = mixed_prefilled(w_mixed, n_rows=20)
  got = ref.step(ID_LAST, 19, width=width)
  assert got.shape == (width or MIXED.block_size, N_VOCAB)
  expect = forward_f64(MIXED, w_mixed, stored_kv(ref), ID_LAST, 19, width=width)
  np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4)


# --- block width (SPEC.md section 6) -----------------------------------------------------------

def test_width_block_is_not_the_full_block_sliced(w):
  ref = prefilled(w, 20, window=8)
  full = ref.step(ID_LAST, 20)
  np.testing.assert_array_equal(ref.step(ID_LAST, 20, width=CFG.block_size), full)
  narrow = ref.step(ID_LAST, 20, width=3)
  # Rows 3.. are keys of the full block only (non-causal), so every row differs.
  assert np.all(np.abs(narrow - full[:3]).max(axis=1) > 1e-3)
  np.testing.assert_allclose(narrow, forward_f64(CFG, w, stored_kv(ref), ID_LAST, 20, width=3),
                             rtol=1e-4, atol=1e-4)
  d = ref.drafts(narrow)
  assert d.shape == (2,) and d.dtype == np.int32
  np.testing.assert_array_equal(d, np.argmax(narrow[1:], -1))


@pytest.mark.parametrize("width", [0, 1, CFG.block_size + 1, 2.0])
def test_width_out_of_range(w, width):
  ref = prefilled(w, 4)
  with pytest.raises(ValueError, match=r"width must be an int in \[2, block_size 8\]"):
    ref.step(ID_LAST, 4, width=width)
