"""Muse-Glimmer (dflash_jax.models.muse_glimmer) against the float64 numpy reference written
from the semantics note (reference/targets/muse_glimmer.py), read from random checkpoints with
the published tensor names; its cached path (the sliding layers' rings) against one pass."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import FULL, SLIDING
from dflash_jax.models import base
from dflash_jax.models import muse_glimmer as M
from reference.targets import muse_glimmer as R
import target_checkpoints as TC

# Tiny dims; window 4 so rings wrap within a short sequence. Layer 0 and 4 are full (counted
# back from the last: (4 - i) % 4 == 0), the rest slide.
TINY = M.MuseGlimmerConfig(vocab_size=61, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, rope_theta=1e4, sliding_window=4,
                           max_position_embeddings=256)
# Every combination of kind and rope (HF treats them independently), tied, no softcap.
MIXED = dataclasses.replace(
    TINY, num_hidden_layers=4, layer_types=(SLIDING, FULL, FULL, SLIDING),
    layer_rope_theta=(0.0, 1e4, 0.0, 123.0), tie_word_embeddings=True,
    final_logit_softcapping=None, sliding_window=3, qk_scale_factor=2.0)
TOL = dict(rtol=2e-4, atol=2e-4)
# commit_jit donates the cache, which its result holds unchanged but for the length.
pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


def _centered(name):   # the four sandwich norms are (1 + w); the final norm is plain
  return "layernorm" in name


def _model(cfg, seed):
  t = TC.random_tensors(M.hf_tensor_shapes(cfg), seed, _centered)
  return t, M.params_from_hf(cfg, dict(t), "fp32")


def _tokens(seed, shape, vocab=TINY.vocab_size):
  return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


# --- names, shapes, config -------------------------------------------------------------------

def test_hf_names_and_shapes_are_the_published_ones():
  """Every tensor name and (out, in) shape as the semantics note lists them (written out here,
  not derived from the module), for a 2-layer model of distinct dims."""
  c = M.MuseGlimmerConfig(vocab_size=50, hidden_size=24, intermediate_size=40,
                          num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                          head_dim=4, rope_theta=1e4)
  want = {"model.language_model.embed_tokens.weight": (50, 24),
          "model.language_model.norm.weight": (24,), "lm_head.weight": (50, 24)}
  for i in range(2):
    p = f"model.language_model.layers.{i}."
    for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
              "post_feedforward_layernorm"):
      want[p + n + ".weight"] = (24,)
    want.update({p + "self_attn.q_proj.weight": (24, 24), p + "self_attn.k_proj.weight": (8, 24),
                 p + "self_attn.v_proj.weight": (8, 24), p + "self_attn.gate_proj.weight": (24, 24),
                 p + "self_attn.o_proj.weight": (24, 24), p + "mlp.gate_proj.weight": (40, 24),
                 p + "mlp.up_proj.weight": (40, 24), p + "mlp.down_proj.weight": (24, 40)})
  assert M.hf_tensor_shapes(c) == want
  assert M.hf_optional(c) == set()
  tied = dataclasses.replace(c, tie_word_embeddings=True)
  assert "lm_head.weight" not in M.hf_tensor_shapes(tied)
  assert M.hf_optional(tied) == {"lm_head.weight"}
  for name in ("model.vision_tower.blocks.0.attn.qkv.weight", "model.vision_adapter.fc1.weight",
               "model.vision_projection.weight",
               "model.language_model.layers.0.self_attn.rotary_emb.inv_freq"):
    assert M.hf_ignored(name), name
  assert not any(M.hf_ignored(n) for n in want)


# The released text config as the note gives it (third-party fixtures), in the VLM wrapper.
GLIMMER_30B_HF = {
    "architectures": ["MuseGlimmerForConditionalGeneration"], "model_type": "muse_glimmer",
    "text_config": {
        "model_type": "muse_glimmer_text", "hidden_size": 6656, "intermediate_size": 19968,
        "num_hidden_layers": 52, "num_attention_heads": 32, "num_key_value_heads": 2,
        "head_dim": 128, "vocab_size": 202048, "rms_norm_eps": 1e-5, "post_norm_eps": 1e-8,
        "sliding_window": 2048, "qk_scale_factor": 3.87,
        "output_multiplier": 0.19611613513818404, "final_logit_softcapping": 20.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000},
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],   # x 13 below
        "layer_rope_theta": [5e5, 5e5, 5e5, 0] * 13, "tie_word_embeddings": False,
        "bos_token_id": 200000, "eos_token_id": 200001},
    "vision_config": {"hidden_size": 1536}}
GLIMMER_30B_HF["text_config"]["layer_types"] *= 13


def test_config_from_hf_glimmer_30b():
  c = M.config_from_hf(GLIMMER_30B_HF, "config.json")
  assert (c.num_hidden_layers, c.hidden_size, c.num_key_value_heads, c.head_dim) == (
      52, 6656, 2, 128)
  assert c.eos_token_ids == (200001,) and c.sliding_window == 2048 and c.rope_theta == 5e5
  assert c.full_layers == tuple(range(3, 52, 4)) and len(c.sliding_layers) == 39
  assert [c.has_rope(l) for l in range(8)] == [True, True, True, False] * 2
  assert M.config_from_hf(c.to_hf()) == c
  hash(c)
  # Without layer_types / layer_rope_theta: HF's default, counted back from the last layer,
  # which for 52 layers is the released pattern and for 6 layers puts full attention on 1, 5.
  text = {k: v for k, v in GLIMMER_30B_HF["text_config"].items()
          if k not in ("layer_types", "layer_rope_theta")}
  assert M.config_from_hf(text | {"model_type": "muse_glimmer_text"}) == c
  six = M.config_from_hf({**text, "num_hidden_layers": 6})
  assert six.full_layers == (1, 5) and [six.has_rope(l) for l in range(6)] == [
      True, False, True, True, True, False]


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(model_type="llama"), "config.json: model_type 'llama' is not a Muse"),
    (lambda c: c.pop("text_config"), "config.json: a muse_glimmer config needs a text_config"),
    (lambda c: c["text_config"].pop("hidden_size"),
     r"config.json: text_config: missing config keys \['hidden_size'\]"),
    (lambda c: c["text_config"].pop("rope_parameters"), r"rope_parameters.rope_theta"),
    (lambda c: c["text_config"].update(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    (lambda c: c["text_config"].update(attention_bias=True), "attention_bias=True"),
    (lambda c: c["text_config"].update(rope_parameters={"rope_type": "dynamic", "rope_theta": 1.0}),
     "rope_parameters.rope_type 'dynamic' is not supported"),
    (lambda c: c["text_config"].update(layer_types=["full_attention"]), "layer_types must hold 52"),
    (lambda c: c["text_config"].update(num_key_value_heads=5), "multiple of num_key_value_heads"),
])
def test_config_from_hf_errors(change, message):
  c = json.loads(json.dumps(GLIMMER_30B_HF))
  change(c)
  with pytest.raises(ValueError, match=message):
    M.config_from_hf(c, "config.json")


# --- the forward against the reference ---------------------------------------------------------

@pytest.mark.parametrize("cfg", [TINY, MIXED], ids=["default-layers", "mixed-tied-nocap"])
def test_forward_matches_reference(cfg):
  """Logits and every hidden_states[i] (0: the normed embedding, L: after the final norm)."""
  t, p = _model(cfg, 1)
  toks = _tokens(2, (2, 13))
  capture = tuple(range(cfg.num_hidden_layers + 1))
  logits, feats = M.forward_jit(p, cfg, toks, capture_layers=capture)
  e = cfg.hidden_size
  for b in range(2):
    hs, ref = R.hidden_states(cfg.to_hf(), t, toks[b])
    np.testing.assert_allclose(logits[b], ref, **TOL)
    for i in capture:
      np.testing.assert_allclose(feats[b, :, i * e:(i + 1) * e], hs[i], **TOL, err_msg=str(i))
  if cfg.final_logit_softcapping:   # the softcap is active: logits stay inside it
    assert np.abs(ref).max() < cfg.final_logit_softcapping


def test_embedding_is_raw_for_the_drafter_normed_for_the_layers():
  """params.embed (what the drafter borrows as tok_embd) is the checkpoint's raw table, while
  the target's hidden_states[0] is its weight-less RMS norm."""
  t, p = _model(TINY, 3)
  raw = t["model.language_model.embed_tokens.weight"]
  np.testing.assert_array_equal(p.embed, raw)
  toks = _tokens(4, (1, 6))
  _, feats = M.forward_jit(p, TINY, toks, capture_layers=(0,))
  rows = raw[toks[0]].astype(np.float64)
  np.testing.assert_allclose(feats[0], rows / np.sqrt((rows ** 2).mean(-1, keepdims=True) + 1e-5),
                             rtol=1e-5, atol=1e-6)
  assert np.abs(feats[0] - rows).max() > 0.1


def test_greedy_continuation_matches_reference():
  """Cached greedy decoding (prefill, then one-row verify + commit per token) picks the
  reference's argmax at every step; the margin over the runner-up is asserted clear."""
  t, p = _model(TINY, 5)
  prompt = list(_tokens(6, 5))
  cache = M.init_cache(TINY, 1, 32)
  cache, _ = M.prefill_jit(p, TINY, cache, np.array([prompt[:-1] + [0] * 12], np.int32),
                           jnp.int32(len(prompt) - 1))
  seq = list(prompt)
  for _ in range(10):
    cache, logits, _ = M.verify_jit(p, TINY, cache, np.array([[seq[-1]]], np.int32))
    cache = M.commit_jit(TINY, cache, jnp.ones((1,), jnp.int32))
    _, ref = R.hidden_states(TINY.to_hf(), t, seq)
    top2 = np.sort(ref[-1])[-2:]
    assert top2[1] - top2[0] > 1e-3, "near tie: pick another seed"
    assert int(jnp.argmax(logits[0, 0])) == int(np.argmax(ref[-1]))
    seq.append(int(np.argmax(ref[-1])))
  assert int(cache.length[0]) == len(seq) - 1


# --- the cached path ---------------------------------------------------------------------------

def _prefill(p, cfg, cache, toks, n):
  """Prefill rows [:, :n[b]] of toks [B, *] padded to the bucket with random ids."""
  b = toks.shape[0]
  bucket = base.prefill_bucket(int(max(n)))
  padded = _tokens(99, (b, bucket), cfg.vocab_size)
  for i in range(b):
    padded[i, :n[i]] = toks[i, :n[i]]
  return M.prefill_jit(p, cfg, cache, padded, jnp.asarray(n, jnp.int32), capture_layers=(1, 3))


# The Pallas kernels take head_dim >= 16.
MIXED16 = dataclasses.replace(MIXED, head_dim=16)


@pytest.mark.parametrize("cfg, impl, n_start, upto, widths", [
    (TINY, "xla", (3, 9), 100, tuple(range(1, 8))),
    (MIXED, "xla", (3, 9), 100, tuple(range(1, 8))),
    (MIXED16, "pallas", (66, 60), 80, (1, 6))],
    ids=["default-layers", "mixed-tied-nocap", "pallas-mixed"])
def test_cached_chunks_equal_one_pass(cfg, impl, n_start, upto, widths):
  """Two sequences at different lengths: a prefill, then verifies of random widths (wider
  than the window too), each committed whole or in part (the rest re-verified), with a
  rejected garbage verify between; every row equals the uncached forward's. The rings
  (window + RING_SLACK slots) wrap: the sequences run past them in a 128-position cache.
  impl "pallas": the verifies run the Pallas kernels (interpret mode; two widths, each a
  compile of its own)."""
  assert cfg.ring_slots(128) < upto < 128
  _, p = _model(cfg, 7)
  rng = np.random.default_rng(8)
  toks = _tokens(9, (2, 128), cfg.vocab_size)
  capture = (1, 3)
  ref_logits, ref_feats = M.forward_jit(p, cfg, toks, capture_layers=capture)
  cache = M.init_cache(cfg, 2, 128)
  pos = np.array(n_start)
  cache, feats = _prefill(p, cfg, cache, toks, pos)
  for b in range(2):
    np.testing.assert_allclose(feats[b, :pos[b]], ref_feats[b, :pos[b]], **TOL)
  while pos.max() < upto:
    w = int(rng.choice(widths))
    cache, _, _ = M.verify_jit(p, cfg, cache, _tokens(int(rng.integers(1 << 20)), (2, w),
                                                       cfg.vocab_size), capture_layers=capture,
                               impl=impl)
    cache = M.commit_jit(cfg, cache, jnp.zeros((2,), jnp.int32))
    vt = np.stack([toks[b, pos[b]:pos[b] + w] for b in range(2)])
    cache, logits, feats = M.verify_jit(p, cfg, cache, vt, capture_layers=capture, impl=impl)
    for b in range(2):
      np.testing.assert_allclose(logits[b], ref_logits[b, pos[b]:pos[b] + w], **TOL)
      np.testing.assert_allclose(feats[b], ref_feats[b, pos[b]:pos[b] + w], **TOL)
    keep = rng.integers(0, w + 1, 2)
    cache = M.commit_jit(cfg, cache, jnp.asarray(keep, jnp.int32))
    pos = pos + keep
    np.testing.assert_array_equal(cache.length, pos)


def test_verify_then_commit_every_n_keep():
  """From one prefilled state past the ring's first lap: verify w rows whose first n_keep are
  the sequence's and the rest garbage, commit(n_keep), then verify the sequence onward: equal
  to one pass over the kept tokens, for every n_keep in 0..w (w = 6 > the window 4). The
  garbage rows overwrote ring slots: what they overwrote was out of every window."""
  _, p = _model(TINY, 10)
  toks = _tokens(11, (1, 100))
  ref_logits, ref_feats = M.forward_jit(p, TINY, toks, capture_layers=(2, 5))
  w, n0 = 6, 75
  assert n0 > TINY.ring_slots(128)
  for n_keep in range(w + 1):
    cache = M.init_cache(TINY, 1, 128)
    cache, _ = _prefill(p, TINY, cache, toks, np.array([n0]))
    vt = _tokens(20 + n_keep, (1, w))
    vt[0, :n_keep] = toks[0, n0:n0 + n_keep]
    cache, logits, _ = M.verify_jit(p, TINY, cache, vt, capture_layers=(2, 5))
    np.testing.assert_allclose(logits[0, :n_keep], ref_logits[0, n0:n0 + n_keep], **TOL)
    cache = M.commit_jit(TINY, cache, jnp.asarray([n_keep], jnp.int32))
    at = n0 + n_keep
    cache, logits, feats = M.verify_jit(p, TINY, cache, toks[:, at:at + 7], capture_layers=(2, 5))
    np.testing.assert_allclose(logits[0], ref_logits[0, at:at + 7], **TOL, err_msg=str(n_keep))
    np.testing.assert_allclose(feats[0], ref_feats[0, at:at + 7], **TOL, err_msg=str(n_keep))


def test_cache_holds_the_window_only():
  """Sliding layers keep min(window + RING_SLACK, capacity) slots, full layers capacity;
  cache_nbytes is what init_cache allocates (a verify writes in place); a verify wider than
  the ring's slack is refused."""
  assert M.RING_SLACK == 64
  cache = M.init_cache(TINY, 2, 100, "bf16")
  assert [k.shape[2] for k in cache.k] == [100, 68, 68, 68, 100]
  assert cache.k[0].shape == (2, 2, 100, 8)
  assert cache.k[0].dtype == jnp.bfloat16 and cache.capacity == 100
  arrays = sum(a.nbytes for a in jax.tree.leaves(cache))
  assert TINY.cache_nbytes(2, 100, "bf16", 16) == arrays
  assert [k.shape[2] for k in M.init_cache(TINY, 1, 3).k] == [3] * 5
  glimmer = M.config_from_hf(GLIMMER_30B_HF)
  per_pos = 2 * 2 * 128 * 2   # K and V, 2 kv heads x 128, bf16
  assert glimmer.cache_nbytes(1, 131072, "bf16", 16) == (
      per_pos * (13 * 131072 + 39 * (2048 + 64)) + 4)
  _, p = _model(TINY, 3)
  with pytest.raises(ValueError, match="65 rows per sequence, but a sliding layer's ring "
                     "serves verifies of at most RING_SLACK = 64 rows"):
    M.verify(p, TINY, M.init_cache(TINY, 1, 100), _tokens(4, (1, 65)))
  with pytest.raises(ValueError, match="capture_layers \\[6\\] outside \\[0, 5\\]"):
    TINY.check_capture_layers((0, 6))


def test_target_protocol():
  assert isinstance(TINY, base.Target)
  _, p = _model(TINY, 12)
  toks = _tokens(13, (1, 9))
  c = TINY.init_cache(1, 16)
  # Jitted, as the decoding loop calls them (eager, each operation compiled on its own: most
  # of the test's time).
  prefill, verify, forward = (jax.jit(f, static_argnames="capture_layers")
                              for f in (TINY.prefill, TINY.verify, TINY.forward))
  c, f = prefill(p, c, toks[:, :8], jnp.int32(5), capture_layers=(0,))
  c, logits, _ = verify(p, c, toks[:, 5:9], capture_layers=(0,))
  c = TINY.commit(c, jnp.asarray([2], jnp.int32))
  ref, _ = forward(p, toks)
  np.testing.assert_allclose(logits[0], ref[0, 5:9], **TOL)
  assert int(c.length[0]) == 7


# --- checkpoints -------------------------------------------------------------------------------

@pytest.mark.parametrize("stored, shard", [("f32", None), ("bf16", 1 << 13)],
                         ids=["f32-single", "bf16-sharded"])
def test_checkpoint_folder(tmp_path, stored, shard):
  """A random checkpoint with the published names plus vision tensors (ignored), single file
  or shards: read through the HF interface (device arrays in the stored dtype), its logits
  equal the reference's on the same (stored-rounded) tensors; params_to_hf gives the stored
  tensors back."""
  t = TC.random_tensors(M.hf_tensor_shapes(TINY), 14, _centered)
  extra = {"model.vision_tower.patch_embed.weight": np.ones((4, 3), np.float32),
           "model.vision_projection.weight": np.ones((32, 8), np.float32)}
  folder = TC.write(tmp_path / "m", TINY.to_hf(), {**t, **extra}, stored, shard)
  if shard:
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
  cfg, p = TC.load(M, folder, "bf16" if stored == "bf16" else "fp32")
  assert cfg == TINY
  stored_t = {n: np.asarray(jnp.asarray(a, jnp.bfloat16 if stored == "bf16" else jnp.float32),
                            np.float32) for n, a in t.items()}
  back = M.params_to_hf(cfg, p)
  assert set(back) == set(t)
  for n in t:
    np.testing.assert_array_equal(np.asarray(back[n], np.float32), stored_t[n], err_msg=n)
  toks = _tokens(15, (1, 10))
  logits, _ = M.forward_jit(p, cfg, toks)
  _, ref = R.hidden_states(cfg.to_hf(), stored_t, toks[0])
  np.testing.assert_allclose(logits[0], ref, **(TOL if stored == "f32" else dict(atol=5e-2)))


def test_checkpoint_errors_name_file_and_tensor(tmp_path):
  t = TC.random_tensors(M.hf_tensor_shapes(TINY), 16, _centered)
  bad = dict(t)
  bad["model.language_model.layers.1.self_attn.gate_proj.weight"] = np.zeros((8, 32), np.float32)
  folder = TC.write(tmp_path / "shape", TINY.to_hf(), bad)
  with pytest.raises(ValueError, match=r"model.safetensors: tensor model.language_model.layers.1"
                     r".self_attn.gate_proj.weight has shape \(8, 32\), expected \(32, 32\)"):
    TC.load(M, folder)
  gone = {n: a for n, a in t.items() if "layers.4.mlp.up_proj" not in n}
  with pytest.raises(ValueError, match=r"missing: missing tensors \['model.language_model.layers.4.mlp"
                     r".up_proj.weight'\] \(expected by .*config.json\)"):
    TC.load(M, TC.write(tmp_path / "missing", TINY.to_hf(), gone))
  with pytest.raises(ValueError, match=r"unknown: unknown tensors \['model.language_model"
                     r".layers.5.mlp.up_proj.weight'\]"):
    TC.load(M, TC.write(tmp_path / "unknown", TINY.to_hf(), {
        **t, "model.language_model.layers.5.mlp.up_proj.weight": np.zeros((48, 32), np.float32)}))
  with pytest.raises(ValueError, match=r"config.json: text_config: missing config keys "
                     r"\['vocab_size'\]"):
    cfg = TINY.to_hf()
    cfg["text_config"].pop("vocab_size")
    TC.load(M, TC.write(tmp_path / "config", cfg, t))
  # params_from_hf on its own names the tensor too.
  with pytest.raises(ValueError, match=r"missing tensors \['model.language_model.norm.weight'\]"):
    M.params_from_hf(TINY, {n: a for n, a in t.items()
                            if not n.endswith("language_model.norm.weight")}, "fp32")


def test_init_params_shapes_and_round_trip():
  p = M.init_params(TINY, jax.random.key(0), "bf16")
  t = M.params_to_hf(TINY, p)
  assert {n: a.shape for n, a in t.items()} == M.hf_tensor_shapes(TINY)
  p2 = M.params_from_hf(TINY, t, "bf16")
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p2)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert p.layers[0].attn_norm.dtype == jnp.float32 and p.embed.dtype == jnp.bfloat16
  assert abs(float(p.layers[0].attn_norm.mean())) < 0.1   # the w of (1 + w): near 0


# --- bf16 against the reference ----------------------------------------------------------------
# Tolerances, from the bf16 rounding of every GEMM input (the reference computes in float64 on
# the same bf16 tensors), in units of the reference logits' standard deviation: a row's largest
# logit error at most 0.25 for 90% of the rows, the mean error at most 0.05, and greedy argmax
# equal at >= 90% of positions. At 4 layers of width 1024 the XLA bf16 path measured a largest
# error of 0.12 (any row), a mean of 0.017 and 97% on CPU.
BF16_ROW, BF16_MEAN, BF16_AGREE = 0.25, 0.05, 0.9


def _bf16_check(cfg, impl, n_tokens, n_prefill):
  err, want, got = TC.bf16_cached_vs_reference(M, R.hidden_states, cfg, _centered, seed=30,
                                               n_tokens=n_tokens, n_prefill=n_prefill,
                                               width=16, impl=impl)
  rows = np.abs(got - want).max(-1) / want.std()
  assert np.quantile(rows, 0.9) <= BF16_ROW, (err, np.sort(rows)[-8:])
  assert np.abs(got - want).mean() / want.std() <= BF16_MEAN
  assert (got.argmax(-1) == want.argmax(-1)).mean() >= BF16_AGREE


def test_bf16_cached_pallas_vs_reference_small():
  """The GPU test's body at small dims (Pallas kernels in interpret mode)."""
  cfg = dataclasses.replace(TINY, hidden_size=64, intermediate_size=128, head_dim=16,
                            vocab_size=128, sliding_window=8, num_hidden_layers=2,
                            layer_types=(SLIDING, FULL), layer_rope_theta=(1e4, 0.0))
  _bf16_check(cfg, "pallas", 64, 16)


@pytest.mark.gpu
def test_bf16_cached_pallas_vs_reference_glimmer_dims():
  """Muse-Glimmer-30B's layer dims (hidden 6656, 32/2 heads x 128, ffn 19968), one sliding
  layer (window 64) and one full NoPE layer, vocab 32768; 32 prefill rows, then 16-row
  verifies with the Pallas GEMMs up to position 160 (the ring wraps twice)."""
  cfg = M.MuseGlimmerConfig(vocab_size=32768, hidden_size=6656, intermediate_size=19968,
                            num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=2,
                            head_dim=128, rope_theta=5e5, sliding_window=64,
                            layer_types=(SLIDING, FULL), layer_rope_theta=(5e5, 0.0))
  _bf16_check(cfg, "pallas", 160, 32)
