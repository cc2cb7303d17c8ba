"""Qwen3-MoE (dflash_jax.models.qwen3_moe) against the float64 numpy reference written from the
semantics note (reference/targets/qwen3_moe.py), read from random checkpoints with the
published tensor names (experts one by one); its cached path against one pass; decode and
verify read only the experts their rows route to."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.models import base
from dflash_jax.models import qwen3_moe as Q
from reference.targets import qwen3_moe as R
import target_checkpoints as TC

# Layer 2 dense (mlp_only_layers); renormalised top-3 of 8 experts.
TINY = Q.Qwen3MoeConfig(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                        num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=True,
                        mlp_only_layers=(2,), rope_theta=1e4, max_position_embeddings=256)
# Every other layer sparse (decoder_sparse_step 2: layers 1 and 3), raw top-k weights, tied.
STEP2 = dataclasses.replace(TINY, decoder_sparse_step=2, mlp_only_layers=(),
                            norm_topk_prob=False, tie_word_embeddings=True, num_experts_per_tok=2)
TOL = dict(rtol=2e-4, atol=2e-4)


def _model(cfg, seed, dtype="fp32"):
  t = TC.random_tensors(Q.hf_tensor_shapes(cfg), seed)
  return t, Q.params_from_hf(cfg, dict(t), dtype)


def _tokens(seed, shape, vocab=TINY.vocab_size):
  return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


# --- names, shapes, config -------------------------------------------------------------------

def test_hf_names_and_shapes_are_the_published_ones():
  """The names and (out, in) shapes of the note, written out here: experts one by one, the
  router `mlp.gate`, q/k norms [D]; a dense layer's MLP as Qwen3's."""
  c = Q.Qwen3MoeConfig(vocab_size=50, hidden_size=24, intermediate_size=36, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=4, num_experts=3,
                       num_experts_per_tok=2, moe_intermediate_size=10, mlp_only_layers=(1,))
  want = {"model.embed_tokens.weight": (50, 24), "model.norm.weight": (24,),
          "lm_head.weight": (50, 24)}
  for i in range(2):
    p = f"model.layers.{i}."
    want.update({p + "input_layernorm.weight": (24,), p + "post_attention_layernorm.weight": (24,),
                 p + "self_attn.q_proj.weight": (24, 24), p + "self_attn.k_proj.weight": (8, 24),
                 p + "self_attn.v_proj.weight": (8, 24), p + "self_attn.o_proj.weight": (24, 24),
                 p + "self_attn.q_norm.weight": (4,), p + "self_attn.k_norm.weight": (4,)})
  want["model.layers.0.mlp.gate.weight"] = (3, 24)
  for e in range(3):
    want.update({f"model.layers.0.mlp.experts.{e}.gate_proj.weight": (10, 24),
                 f"model.layers.0.mlp.experts.{e}.up_proj.weight": (10, 24),
                 f"model.layers.0.mlp.experts.{e}.down_proj.weight": (24, 10)})
  want.update({"model.layers.1.mlp.gate_proj.weight": (36, 24),
               "model.layers.1.mlp.up_proj.weight": (36, 24),
               "model.layers.1.mlp.down_proj.weight": (24, 36)})
  assert Q.hf_tensor_shapes(c) == want
  assert Q.hf_optional(dataclasses.replace(c, tie_word_embeddings=True)) == {"lm_head.weight"}
  assert Q.hf_ignored("model.layers.0.self_attn.rotary_emb.inv_freq")
  assert not any(Q.hf_ignored(n) for n in want)


# Qwen3-30B-A3B as its model card and config fixtures give it (not read from the hub here).
QWEN3_30B_A3B_HF = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "use_sliding_window": False, "hidden_act": "silu",
    "attention_bias": False, "eos_token_id": 151645}


def test_config_from_hf_qwen3_30b_a3b():
  c = Q.config_from_hf(QWEN3_30B_A3B_HF, "config.json")
  assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.head_dim) == (
      128, 8, 768, 128)
  assert c.norm_topk_prob and c.sparse_layers == tuple(range(48)) and c.eos_token_ids == (151645,)
  assert Q.config_from_hf(c.to_hf()) == c
  hash(c)
  # HF's defaults where keys are absent: norm_topk_prob false, every layer sparse.
  d = {k: v for k, v in QWEN3_30B_A3B_HF.items()
       if k not in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")}
  assert Q.config_from_hf(d) == dataclasses.replace(c, norm_topk_prob=False)
  assert Q.config_from_hf({**d, "decoder_sparse_step": 3, "mlp_only_layers": [5]}).sparse_layers \
      == tuple(i for i in range(2, 48, 3) if i != 5)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "qwen3"}, "config.json: model_type 'qwen3' is not a Qwen3-MoE config"),
    ({"num_experts": None}, r"config.json: missing config keys \['num_experts'\]"),
    ({"moe_intermediate_size": None}, r"missing config keys \['moe_intermediate_size'\]"),
    ({"rope_theta": None}, "rope_theta"),
    ({"use_sliding_window": True}, "use_sliding_window=True"),
    ({"rope_scaling": {"type": "longrope", "factor": 4.0}},
     "config.json: rope_scaling.type 'longrope' is not supported"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok \\(200\\) exceeds num_experts"),
    ({"mlp_only_layers": [48]}, "mlp_only_layers \\[48\\] must lie in"),
])
def test_config_from_hf_errors(change, message):
  c = {k: v for k, v in {**QWEN3_30B_A3B_HF, **change}.items() if v is not None}
  with pytest.raises(ValueError, match=message):
    Q.config_from_hf(c, "config.json")


# --- the forward against the reference ---------------------------------------------------------

@pytest.mark.parametrize("cfg", [TINY, STEP2], ids=["topk-norm-mlp-only", "step2-raw-tied"])
@pytest.mark.parametrize("t", [7, 40], ids=["by-slot", "sorted"])
def test_forward_matches_reference(cfg, t):
  """Logits and every hidden_states[i]; 2 x 7 rows take the grouped GEMM over touched
  experts, 2 x 40 rows the sort-by-expert grouped GEMM."""
  assert (2 * t <= Q.SLOT_MAX_ROWS) == (t == 7)
  tensors, p = _model(cfg, 1)
  toks = _tokens(2, (2, t))
  capture = tuple(range(cfg.num_hidden_layers + 1))
  logits, feats = Q.forward_jit(p, cfg, toks, capture_layers=capture)
  e = cfg.hidden_size
  for b in range(2):
    hs, ref = R.hidden_states(cfg.to_hf(), tensors, toks[b])
    np.testing.assert_allclose(logits[b], ref, **TOL)
    for i in capture:
      np.testing.assert_allclose(feats[b, :, i * e:(i + 1) * e], hs[i], **TOL, err_msg=str(i))


def test_routing_against_reference():
  """route() picks the reference's experts and weights, norm_topk_prob on and off."""
  rng = np.random.default_rng(3)
  logits = rng.standard_normal((20, 8)).astype(np.float32) * 2
  for cfg in (TINY, STEP2):
    ids, w = Q.route(cfg, jnp.asarray(logits))
    hf = cfg.to_hf()
    for r in range(20):
      want_ids, want_w = R.routing(hf, np.eye(8), logits[r].astype(np.float64))
      np.testing.assert_array_equal(ids[r], want_ids)
      np.testing.assert_allclose(w[r], want_w, rtol=1e-5)


def test_expert_slots():
  ids = jnp.asarray([[5, 1], [1, 7], [0, 5]], jnp.int32)
  slots = Q.expert_slots(ids, 9)
  np.testing.assert_array_equal(slots, [0, 1, 5, 7, -1, -1])
  slots = Q.expert_slots(ids, 4 + 1 + 3)   # 6 choices, 8 experts: 6 slots
  assert slots.shape == (6,)
  slots = Q.expert_slots(jnp.tile(jnp.arange(3, dtype=jnp.int32), (4, 1)), 3)
  np.testing.assert_array_equal(slots, [0, 1, 2])   # S = min(E, M k)


@pytest.mark.parametrize("m, k, e", [(1, 8, 128), (5, 8, 128), (16, 8, 128), (64, 8, 128),
                                     (7, 3, 60), (40, 2, 5)])
def test_expert_slots_random(m, k, e):
  """Random routings: the slots are the sorted distinct experts then -1 (numpy's unique); the
  program has no scatter and no scan (each would be a launch of its own in every sparse
  layer's decode)."""
  rng = np.random.default_rng(m * 1000 + e)
  ids = np.stack([rng.choice(e, k, replace=False) for _ in range(m)]).astype(np.int32)
  slots = Q.expert_slots(jnp.asarray(ids), e)
  u = np.unique(ids)
  s = min(e, m * k)
  np.testing.assert_array_equal(slots, np.concatenate([u, -np.ones(s - len(u), np.int32)]))
  text = jax.jit(Q.expert_slots, static_argnums=1).trace(
      jax.ShapeDtypeStruct((m, k), jnp.int32), e).lower(lowering_platforms=("cuda",)).as_text()
  assert "scatter" not in text and "scan" not in text and "while" not in text


def test_sorted_experts_add_no_float_scatter():
  """The sort-by-expert path (prefill) gathers each row's k outputs back and adds them in
  order: its program, lowered for CUDA, scatters integers only (a float scatter-add would add
  a row's terms in whatever order the GPU's atomics land, so one prefill run twice could
  differ)."""
  cfg = TINY
  _, p = _model(cfg, 2)
  lp = next(l for l in p.layers if isinstance(l, Q.MoeLayer))
  m, k, hsz = 40, cfg.num_experts_per_tok, cfg.hidden_size
  text = jax.jit(Q._experts_sorted).trace(
      lp, jax.ShapeDtypeStruct((m, hsz), jnp.float32), jax.ShapeDtypeStruct((m, k), jnp.int32),
      jax.ShapeDtypeStruct((m, k), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
  # Each scatter op's result type follows its region: "-> tensor<...>" after the op.
  results = [text[i:].split("->", 1)[1].split("\n", 1)[0]
             for i in (mm.start() for mm in re.finditer(r'"stablehlo\.scatter"', text))]
  assert results and all("i32" in r and "f32" not in r and "bf16" not in r for r in results), (
      results)


def test_greedy_continuation_matches_reference():
  t, p = _model(TINY, 5)
  seq = list(_tokens(6, 4))
  cache = Q.qwen3.init_cache(TINY, 1, 32)
  cache, _ = Q.prefill_jit(p, TINY, cache, np.array([seq[:-1] + [0] * 13], np.int32),
                           jnp.int32(len(seq) - 1))
  for _ in range(10):
    cache, logits, _ = Q.verify_jit(p, TINY, cache, np.array([[seq[-1]]], np.int32))
    cache = TINY.commit(cache, jnp.ones((1,), jnp.int32))
    _, ref = R.hidden_states(TINY.to_hf(), t, seq)
    top2 = np.sort(ref[-1])[-2:]
    assert top2[1] - top2[0] > 1e-3, "near tie: pick another seed"
    assert int(jnp.argmax(logits[0, 0])) == int(np.argmax(ref[-1]))
    seq.append(int(np.argmax(ref[-1])))


# --- the cached path ---------------------------------------------------------------------------

def test_cached_chunks_equal_one_pass():
  """Two sequences at different lengths: a prefill (2 x 64 bucket rows: the sorted-experts
  path), then verifies of random widths 1-9 (the touched-experts path) committed in part, a
  garbage verify rejected between: every row equals the uncached forward's."""
  _, p = _model(TINY, 7)
  rng = np.random.default_rng(8)
  toks = _tokens(9, (2, 70))
  ref_logits, ref_feats = Q.forward_jit(p, TINY, toks, capture_layers=(1, 4))
  cache = TINY.init_cache(2, 80)
  pos = np.array([20, 33])
  padded = _tokens(10, (2, base.prefill_bucket(33)))
  for b in range(2):
    padded[b, :pos[b]] = toks[b, :pos[b]]
  cache, feats = Q.prefill_jit(p, TINY, cache, padded, jnp.asarray(pos, jnp.int32),
                               capture_layers=(1, 4))
  for b in range(2):
    np.testing.assert_allclose(feats[b, :pos[b]], ref_feats[b, :pos[b]], **TOL)
  while pos.max() < 58:
    w = int(rng.integers(1, 10))
    cache, _, _ = Q.verify_jit(p, TINY, cache, _tokens(int(rng.integers(1 << 20)), (2, w)),
                               capture_layers=(1, 4))
    cache = TINY.commit(cache, jnp.zeros((2,), jnp.int32))
    vt = np.stack([toks[b, pos[b]:pos[b] + w] for b in range(2)])
    cache, logits, feats = Q.verify_jit(p, TINY, cache, vt, capture_layers=(1, 4))
    for b in range(2):
      np.testing.assert_allclose(logits[b], ref_logits[b, pos[b]:pos[b] + w], **TOL)
      np.testing.assert_allclose(feats[b], ref_feats[b, pos[b]:pos[b] + w], **TOL)
    keep = rng.integers(0, w + 1, 2)
    cache = TINY.commit(cache, jnp.asarray(keep, jnp.int32))
    pos = pos + keep


def test_verify_then_commit_every_n_keep():
  _, p = _model(STEP2, 11)
  toks = _tokens(12, (1, 30))
  ref_logits, _ = Q.forward_jit(p, STEP2, toks)
  w, n0 = 5, 8
  for n_keep in range(w + 1):
    cache = STEP2.init_cache(1, 32)
    cache, _ = Q.prefill_jit(p, STEP2, cache, toks[:, :16], jnp.int32(n0))
    vt = _tokens(20 + n_keep, (1, w))
    vt[0, :n_keep] = toks[0, n0:n0 + n_keep]
    cache, _, _ = Q.verify_jit(p, STEP2, cache, vt)
    cache = STEP2.commit(cache, jnp.asarray([n_keep], jnp.int32))
    at = n0 + n_keep
    cache, logits, _ = Q.verify_jit(p, STEP2, cache, toks[:, at:at + 6])
    np.testing.assert_allclose(logits[0], ref_logits[0, at:at + 6], **TOL, err_msg=str(n_keep))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_verify_reads_only_the_routed_experts(impl):
  """bf16 weights, every expert the verify rows do not route to replaced by NaN: the result is
  unchanged and finite. For the Pallas kernel this shows it reads no unlisted expert (a read
  reaches the result as NaN through the slot's zero routing weight); for the jnp twin, that
  its gather touches only listed experts' values (its unused slots are masked, so a read
  there would not show). The reference is the same impl on the unpoisoned weights (head_dim
  16: the Pallas path's attention kernels take multiples of 16)."""
  cfg = dataclasses.replace(TINY, num_experts=32, num_experts_per_tok=2, head_dim=16)
  _, p = _model(cfg, 13, "bf16")
  toks = _tokens(14, (2, 12))
  cache = cfg.init_cache(2, 16)
  cache, _ = Q.prefill_jit(p, cfg, cache, toks, jnp.int32(8))
  keep = jax.tree.map(jnp.copy, cache)
  vt = toks[:, 8:12]
  _, want, _ = Q.verify_jit(p, cfg, jax.tree.map(jnp.copy, keep), vt, impl=impl)
  # Which experts each sparse layer's rows route to, from the same forward's routing.
  touched = _touched_experts(p, cfg, keep, vt, impl)
  # 8 rows x 2 choices: 16 slots; some unused (padding) and expert 0 untouched somewhere.
  assert all(0 < len(t) < 16 for t in touched.values()), touched
  assert any(0 not in t for t in touched.values()), touched
  layers = list(p.layers)
  for l, t in touched.items():
    bad = np.setdiff1d(np.arange(cfg.num_experts), t)
    lp = layers[l]
    layers[l] = lp.replace(w_gu=lp.w_gu.at[bad].set(jnp.nan), w_d=lp.w_d.at[bad].set(jnp.nan))
  poisoned = p.replace(layers=tuple(layers))
  _, got, _ = Q.verify_jit(poisoned, cfg, jax.tree.map(jnp.copy, keep), vt, impl=impl)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _touched_experts(p, cfg, cache, vt, impl="xla"):
  """layer -> the experts the verify rows route to (recomputed with the same pieces)."""
  seen, calls = {}, [0]
  orig = Q.route

  def spy(c, logits, *a):
    ids, w = orig(c, logits, *a)
    n = calls[0]
    calls[0] += 1
    jax.debug.callback(lambda i, n=n: seen.__setitem__(n, np.unique(i)), ids)
    return ids, w
  Q.route = spy
  try:
    jax.block_until_ready(Q.verify(p, cfg, jax.tree.map(jnp.copy, cache), vt, impl=impl))
  finally:
    Q.route = orig
  jax.effects_barrier()
  return {l: seen[i] for i, l in enumerate(cfg.sparse_layers)}


def test_target_protocol():
  assert isinstance(TINY, base.Target)
  assert TINY.cache_nbytes(2, 40, "bf16") == sum(
      a.nbytes for a in jax.tree.leaves(TINY.init_cache(2, 40, "bf16")))


# --- checkpoints -------------------------------------------------------------------------------

@pytest.mark.parametrize("stored, shard", [("f32", None), ("bf16", 1 << 12)],
                         ids=["f32-single", "bf16-sharded"])
def test_checkpoint_folder(tmp_path, stored, shard):
  t = TC.random_tensors(Q.hf_tensor_shapes(TINY), 14)
  folder = TC.write(tmp_path / "m", TINY.to_hf(), t, stored, shard)
  cfg, p = TC.load(Q, folder, "bf16" if stored == "bf16" else "fp32")
  assert cfg == TINY
  assert p.layers[0].w_gu.shape == (8, 32, 32) and p.layers[0].w_d.shape == (8, 32, 16)
  stored_t = {n: np.asarray(jnp.asarray(a, jnp.bfloat16 if stored == "bf16" else jnp.float32),
                            np.float32) for n, a in t.items()}
  back = Q.params_to_hf(cfg, p)
  assert set(back) == set(t)
  for n in t:
    np.testing.assert_array_equal(np.asarray(back[n], np.float32), stored_t[n], err_msg=n)
  toks = _tokens(15, (1, 10))
  logits, _ = Q.forward_jit(p, cfg, toks)
  _, ref = R.hidden_states(cfg.to_hf(), stored_t, toks[0])
  if stored == "f32":
    np.testing.assert_allclose(logits[0], ref, **TOL)
  else:   # bf16 GEMM inputs: loose, but the same picture
    assert np.corrcoef(np.asarray(logits[0]).ravel(), ref.ravel())[0, 1] > 0.99


def test_checkpoint_errors_name_file_and_tensor(tmp_path):
  t = TC.random_tensors(Q.hf_tensor_shapes(TINY), 16)
  gone = {n: a for n, a in t.items() if n != "model.layers.3.mlp.experts.7.down_proj.weight"}
  with pytest.raises(ValueError, match=r"missing: missing tensors \['model.layers.3.mlp.experts.7"
                     r".down_proj.weight'\]"):
    TC.load(Q, TC.write(tmp_path / "missing", TINY.to_hf(), gone))
  extra = {**t, "model.layers.0.mlp.experts.8.up_proj.weight": np.zeros((16, 32), np.float32)}
  with pytest.raises(ValueError, match=r"extra: unknown tensors "
                     r"\['model.layers.0.mlp.experts.8.up_proj.weight'\]"):
    TC.load(Q, TC.write(tmp_path / "extra", TINY.to_hf(), extra))
  bad = {**t, "model.layers.1.mlp.gate.weight": np.zeros((7, 32), np.float32)}
  with pytest.raises(ValueError, match=r"model.safetensors: tensor model.layers.1.mlp.gate.weight "
                     r"has shape \(7, 32\), expected \(8, 32\)"):
    TC.load(Q, TC.write(tmp_path / "shape", TINY.to_hf(), bad))
  with pytest.raises(ValueError, match=r"tensor model.layers.2.mlp.up_proj.weight has shape"):
    Q.params_from_hf(TINY, {**t, "model.layers.2.mlp.up_proj.weight": np.zeros((3, 3))}, "fp32")


def test_init_params_round_trip():
  p = Q.init_params(TINY, jax.random.key(0), "bf16")
  t = Q.params_to_hf(TINY, p)
  assert {n: a.shape for n, a in t.items()} == Q.hf_tensor_shapes(TINY)
  p2 = Q.params_from_hf(TINY, t, "bf16")
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p2)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert isinstance(p.layers[2], Q.TargetLayer) and isinstance(p.layers[1], Q.MoeLayer)


# --- bf16 against the reference ----------------------------------------------------------------
# Tolerances as in test_target_muse.py (per row, 90% of rows: a router near tie can give a
# row another expert, and that row alone a large error): at 2 layers of width 1024 with 32
# experts the XLA bf16 path measured a largest error of 0.25 (any row), a mean of 0.003 and
# 97% on CPU; at width 64 with 16 experts one row of 48 reached 0.73, the 90% quantile 0.03.
BF16_ROW, BF16_MEAN, BF16_AGREE = 0.25, 0.05, 0.9


def _bf16_check(cfg, impl, n_tokens, n_prefill):
  err, want, got = TC.bf16_cached_vs_reference(Q, R.hidden_states, cfg, lambda n: False,
                                               seed=31, n_tokens=n_tokens,
                                               n_prefill=n_prefill, width=16, impl=impl)
  rows = np.abs(got - want).max(-1) / want.std()
  assert np.quantile(rows, 0.9) <= BF16_ROW, (err, np.sort(rows)[-8:])
  assert np.abs(got - want).mean() / want.std() <= BF16_MEAN
  assert (got.argmax(-1) == want.argmax(-1)).mean() >= BF16_AGREE


def test_bf16_cached_pallas_vs_reference_small():
  """The GPU test's body at small dims (the grouped GEMM in interpret mode)."""
  cfg = dataclasses.replace(TINY, hidden_size=64, head_dim=16, moe_intermediate_size=32,
                            num_experts=16, num_experts_per_tok=4, vocab_size=128)
  _bf16_check(cfg, "pallas", 64, 16)


@pytest.mark.gpu
def test_bf16_cached_pallas_vs_reference_30b_a3b_dims():
  """Qwen3-30B-A3B's layer dims (hidden 2048, 32/4 heads x 128, 128 experts x 768, top 8
  renormalised), two sparse layers, vocab 32768; 32 prefill rows (the grouped GEMM over the
  touched experts), then 16-row verifies with the Pallas GEMMs."""
  cfg = Q.Qwen3MoeConfig(vocab_size=32768, hidden_size=2048, intermediate_size=6144,
                         num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
                         head_dim=128, num_experts=128, num_experts_per_tok=8,
                         moe_intermediate_size=768, norm_topk_prob=True, rope_theta=1e6)
  _bf16_check(cfg, "pallas", 160, 32)


# --- batch invariance (the loop's bitwise-lossless bf16) --------------------------------------

INV = dataclasses.replace(TINY, hidden_size=64, head_dim=16, moe_intermediate_size=32,
                          num_experts=16, num_experts_per_tok=4, vocab_size=97)


def _pairwise_f32(row: np.ndarray) -> np.float32:
  """float32 sum of one row in the pairwise order the contract of `_row_sum` names (halves
  added elementwise, zero padded to a power of two), written here in numpy."""
  n = 1 << max(0, (len(row) - 1).bit_length())
  x = np.zeros(n, np.float32)
  x[:len(row)] = row
  while len(x) > 1:
    x = (x[:len(x) // 2] + x[len(x) // 2:]).astype(np.float32)
  return x[0]


@pytest.mark.parametrize("e", [128, 60])
def test_route_rows_do_not_depend_on_the_call(e):
  """Each row's routing (ids and weights) is bitwise the same routed alone or among 37 rows,
  its softmax denominator is the fixed pairwise sum, and the weights match a float64
  softmax top-k."""
  cfg = dataclasses.replace(INV, num_experts=e, num_experts_per_tok=8)
  logits = np.random.default_rng(e).standard_normal((37, e)).astype(np.float32) * 3
  ids, w = Q.route(cfg, jnp.asarray(logits))
  for i in (0, 17, 36):
    one_ids, one_w = Q.route(cfg, jnp.asarray(logits[i:i + 1]))
    np.testing.assert_array_equal(one_ids[0], ids[i])
    np.testing.assert_array_equal(np.asarray(one_w[0]).view(np.uint32),
                                  np.asarray(w[i]).view(np.uint32))
  ex = np.exp(logits - logits.max(-1, keepdims=True)).astype(np.float32)
  for i in (0, 36):
    assert np.float32(np.asarray(Q._row_sum(jnp.asarray(ex)))[i, 0]) == _pairwise_f32(ex[i])
  p = np.exp(logits.astype(np.float64))
  p /= p.sum(-1, keepdims=True)
  want_ids = np.argsort(-p, axis=-1, kind="stable")[:, :8]
  np.testing.assert_array_equal(ids, want_ids)
  want_w = np.take_along_axis(p, want_ids, -1)
  np.testing.assert_allclose(w, want_w / want_w.sum(-1, keepdims=True), rtol=1e-6)


def test_verify_rows_equal_one_row_decodes():
  """bf16: 3 sequences x 16 rows (48 rows: three 16-row chunks of the grouped GEMM) against
  5-row verifies, one sequence's sixteen 1-row decodes and a wider cache, bit for bit (Pallas
  path, interpret mode here; the GPU test below runs the compiled kernels). float32 experts
  run XLA's gathered product, whose order XLA picks by shape (the module docstring)."""
  from test_target_invariance import check_rows_invariant
  params = Q.init_params(INV, jax.random.key(3), "bf16")
  check_rows_invariant(INV, params, "bf16", (5, 9, 13), 48, widths=(5,), decode_slots=(1,),
                       model=Q)


A3B_WIDTHS = Q.Qwen3MoeConfig(vocab_size=32768, hidden_size=2048, intermediate_size=6144,
                              num_hidden_layers=2, num_attention_heads=32,
                              num_key_value_heads=4, head_dim=128, num_experts=128,
                              num_experts_per_tok=8, moe_intermediate_size=768,
                              norm_topk_prob=True, rope_theta=1e6)


@pytest.mark.gpu
def test_gpu_30b_a3b_widths_rows_are_invariant():
  """Qwen3-30B-A3B's layer widths (2 sparse layers): 3 sequences x 16 rows (48 rows) against
  5-row verifies and sixteen 1-row decodes of one sequence, bit for bit on the GPU's
  kernels."""
  from test_target_invariance import check_rows_invariant
  params = Q.init_params(A3B_WIDTHS, jax.random.key(0), "bf16")
  # Prompts within a 512-row prefill bucket: the prefill's sorted grouped GEMM (XLA's
  # ragged dot) took 24 GB of scratch at 3 x 2048 rows.
  check_rows_invariant(A3B_WIDTHS, params, "bf16", (100, 300, 500), 1024, widths=(5,),
                       decode_slots=(2,), model=Q)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [3, 7, 15])
def test_gpu_30b_a3b_widths_greedy_lossless(k):
  """4 sparse layers at Qwen3-30B-A3B's widths, bf16, 256 tokens with k drafts per round
  forced accepted (the oracle is target-only decoding's own output): every draft of every
  round accepted on the first run, the tokens equal target-only decoding's."""
  from benchmarks.oracle import Oracle
  from dflash_jax import decode as D
  cfg = dataclasses.replace(A3B_WIDTHS, num_hidden_layers=4)
  params = Q.init_params(cfg, jax.random.key(1), "bf16")
  prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 64).tolist()
  kw = dict(capacity=512, cache_dtype="bf16", rounds_per_call=32)
  base = D.generate_target_only(params, cfg, [prompt], 272, target_impl="pallas", **kw).tokens[0]
  models = D.Models(target=params, drafter=None, d2t=None, target_cfg=cfg)
  dcfg = D.DecodeConfig(width=k + 1, target_impl="pallas", proposer=Oracle(run_drafter=False))
  g = D.generate(models, dcfg, [prompt], 256, proposer_state=Oracle.state([prompt + base], 512),
                 **kw)
  assert g.tokens[0] == base[:256]
  rounds = -(-256 // (k + 1))
  assert int(g.rounds.sum()) == rounds and g.hist[0, k] == rounds, g.hist
