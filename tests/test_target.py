"""The target model (dflash_jax.models.qwen3) against an independent float64 numpy forward
(reference/targets/qwen3.py), and its cached path against its uncached one."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.models import TargetFormatError, load_target, read_target_config, save_target
from dflash_jax.models import qwen3 as Q
from dflash_jax.models.base import prefill_bucket
from reference.targets.qwen3 import hidden_states

TINY = Q.TargetConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e4,
                      max_position_embeddings=128)
# Each flag takes both values (Qwen3-8B-like: q/k norm, untied; Llama-3.2-1B-like: neither, tied).
VARIANTS = [dict(qk_norm=True, tie_word_embeddings=False), dict(qk_norm=False, tie_word_embeddings=True)]


def _model(seed=0, **kw):
  cfg = dataclasses.replace(TINY, **kw)
  return cfg, Q.init_params(cfg, jax.random.key(seed))


def _tokens(seed, shape, vocab=TINY.vocab_size):
  return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: f"qk{int(kw['qk_norm'])}-tied{int(kw['tie_word_embeddings'])}")
def test_forward_matches_numpy_reference(kw):
  cfg, p = _model(1, **kw)
  assert (p.lm_head is None) == kw["tie_word_embeddings"]
  assert (p.layers[0].q_norm is None) != kw["qk_norm"]
  toks = _tokens(2, (2, 13))
  capture = (2, 0, 1, 2)   # out of order on purpose, and both ends: embeddings and final norm
  logits, feats = Q.forward_jit(p, cfg, toks, capture_layers=capture)
  assert logits.shape == (2, 13, cfg.vocab_size) and feats.shape == (2, 13, 4 * cfg.hidden_size)
  e = cfg.hidden_size
  for b in range(2):
    hs, ref_logits = hidden_states(p, cfg, toks[b])
    np.testing.assert_allclose(logits[b], ref_logits, rtol=1e-4, atol=1e-4)
    for j, idx in enumerate(capture):
      np.testing.assert_allclose(feats[b, :, j * e:(j + 1) * e], hs[idx], rtol=1e-4, atol=1e-4)
  _, none = Q.forward(p, cfg, toks, with_logits=False)
  assert none.shape == (2, 13, 0)


def test_capture_layers_out_of_range():
  cfg, p = _model()
  with pytest.raises(ValueError, match=r"capture_layers \[3\] outside \[0, 2\]"):
    Q.forward(p, cfg, _tokens(0, (1, 4)), capture_layers=(1, 3))


def test_cached_prefill_verify_equals_forward():
  """Prefill (bucketed, padded) then verify in chunks of varying width, with a rejected chunk
  committed (none of its rows kept), equals the uncached forward row for row; each chunk
  is committed in two parts."""
  cfg, p = _model(3, **VARIANTS[0])
  capture = (1, 2)
  toks = _tokens(4, (1, 29))
  ref_logits, ref_feats = Q.forward_jit(p, cfg, toks, capture_layers=capture)
  cache = Q.init_cache(cfg, 1, 40)
  n = 7
  bucket = prefill_bucket(n)
  padded = np.zeros((1, bucket), np.int32)
  padded[0, :n] = toks[0, :n]
  padded[0, n:] = _tokens(5, bucket - n)   # padding rows write past the length only
  cache, feats = Q.prefill_jit(p, cfg, cache, padded, jnp.int32(n), capture_layers=capture)
  np.testing.assert_allclose(feats[:, :n], ref_feats[:, :n], rtol=1e-5, atol=1e-5)
  assert int(cache.length[0]) == n
  pos = n
  for i, w in enumerate((1, 4, 4, 1, 4)):
    # A rejected continuation first: verify garbage, keep none of it (no copy).
    cache, _, _ = Q.verify_jit(p, cfg, cache, _tokens(10 + i, (1, w)), capture_layers=capture)
    assert int(cache.length[0]) == pos   # a verify commits nothing
    cache = cfg.commit(cache, jnp.zeros((1,), jnp.int32))
    cache, logits, feats = Q.verify_jit(p, cfg, cache, toks[:, pos:pos + w], capture_layers=capture)
    np.testing.assert_allclose(logits, ref_logits[:, pos:pos + w], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(feats, ref_feats[:, pos:pos + w], rtol=1e-5, atol=1e-5)
    keep = w // 2   # commit part of the chunk, then re-verify the rest
    cache = cfg.commit(cache, jnp.asarray([keep], jnp.int32))
    pos += keep
    assert int(cache.length[0]) == pos
    if keep < w:
      cache, logits, _ = Q.verify_jit(p, cfg, cache, toks[:, pos:pos + w - keep],
                                      capture_layers=capture)
      np.testing.assert_allclose(logits, ref_logits[:, pos:pos + w - keep], rtol=1e-5, atol=1e-5)
      cache = cfg.commit(cache, jnp.asarray([w - keep], jnp.int32))
      pos += w - keep


def test_cache_batch_rows_are_independent():
  """Two sequences at different lengths in one cache (the Llama-like variant: no q/k norm,
  tied head): each row equals its own uncached forward."""
  cfg, p = _model(6, **VARIANTS[1])
  toks = _tokens(7, (2, 20))
  ref_logits, ref_feats = Q.forward_jit(p, cfg, toks, capture_layers=(1, 2))
  cache = Q.init_cache(cfg, 2, 32)
  cache, feats = Q.prefill_jit(p, cfg, cache, toks[:, :16], jnp.asarray([5, 9], jnp.int32),
                               capture_layers=(1, 2))
  np.testing.assert_allclose(feats[1, :9], ref_feats[1, :9], rtol=1e-5, atol=1e-5)
  verify_toks = np.stack([toks[0, 5:9], toks[1, 9:13]])
  cache, logits, feats = Q.verify_jit(p, cfg, cache, verify_toks, capture_layers=(1, 2))
  np.testing.assert_allclose(logits[0], ref_logits[0, 5:9], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits[1], ref_logits[1, 9:13], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(feats[1], ref_feats[1, 9:13], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(cache.length, [5, 9])   # a verify commits nothing
  np.testing.assert_array_equal(cfg.commit(cache, jnp.asarray([4, 1], jnp.int32)).length, [9, 10])


def test_init_cache_rejects_bad_sizes():
  with pytest.raises(ValueError, match="capacity must be positive"):
    Q.init_cache(TINY, 1, 0)


def test_prefill_bucket():
  assert [prefill_bucket(n) for n in (0, 1, 16, 17, 64, 65)] == [16, 16, 16, 32, 64, 128]


# --- config ------------------------------------------------------------------------------------

QWEN3_8B_HF = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": False,
    "max_position_embeddings": 40960, "hidden_act": "silu", "attention_bias": False,
    "use_sliding_window": False, "eos_token_id": 151645, "torch_dtype": "bfloat16"}
LLAMA3_HF = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
    "max_position_embeddings": 131072, "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


def test_config_from_hf_qwen3_and_llama(tmp_path):
  c = Q.config_from_hf(QWEN3_8B_HF, "config.json")
  assert (c.num_hidden_layers, c.head_dim, c.qk_norm, c.tie_word_embeddings) == (36, 128, True, False)
  assert c.eos_token_ids == (151645,)
  assert Q.config_from_hf(c.to_hf(), "config.json") == c
  l = Q.config_from_hf(LLAMA3_HF, "config.json")
  assert (l.head_dim, l.qk_norm, l.tie_word_embeddings) == (64, False, True)
  assert l.eos_token_ids == (128001, 128008, 128009)
  assert Q.config_from_hf(l.to_hf(), "config.json") == l
  hash(l)   # static jit argument
  (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B_HF))
  assert read_target_config(tmp_path) == c
  # transformers v5 spelling: rope_parameters
  v5 = {k: v for k, v in QWEN3_8B_HF.items() if k != "rope_theta"}
  v5["rope_parameters"] = {"rope_theta": 1000000, "rope_type": "default"}
  assert Q.config_from_hf(v5, "config.json") == c


@pytest.mark.parametrize("change, message", [
    ({"model_type": "qwen2"}, "model_type 'qwen2' is not supported"),
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"use_sliding_window": True}, "use_sliding_window=True"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_key_value_heads": 5}, "must be a multiple of num_key_value_heads"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
     "config.json: rope_scaling.rope_type 'dynamic' is not supported"),
    ({"rms_norm_eps": None}, "missing config keys \\['rms_norm_eps'\\]"),
    ({"rope_theta": None}, "rope_theta"),
])
def test_config_from_hf_errors(change, message):
  c = {**QWEN3_8B_HF, **change}
  c = {k: v for k, v in c.items() if v is not None}
  with pytest.raises(ValueError, match=message):
    Q.config_from_hf(c, "config.json")


def test_llama3_rope_scaling():
  """High frequencies kept, low ones divided by the factor, the band between interpolated."""
  l = Q.config_from_hf(LLAMA3_HF, "config.json")
  base = 500000.0 ** (-np.arange(0, 64, 2) / 64)
  got = Q.inv_freq(l).astype(np.float64)
  wavelen = 2 * np.pi / base
  hi, lo = wavelen < 8192 / 4, wavelen > 8192 / 1
  assert hi.any() and lo.any() and (~hi & ~lo).any()
  np.testing.assert_allclose(got[hi], base[hi], rtol=1e-6)
  np.testing.assert_allclose(got[lo], base[lo] / 32, rtol=1e-6)
  mid = ~hi & ~lo
  assert np.all((got[mid] < base[mid]) & (got[mid] > base[mid] / 32))
  np.testing.assert_allclose(Q.inv_freq(Q.config_from_hf(QWEN3_8B_HF, "config.json")),
                             1e6 ** (-np.arange(0, 128, 2) / 128), rtol=1e-6)


# --- HF folders --------------------------------------------------------------------------------

def _params_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("kw", VARIANTS, ids=["qwen3", "llama-tied"])
def test_hf_round_trip(tmp_path, kw):
  cfg, p = _model(12, **kw)
  cfg = dataclasses.replace(cfg, eos_token_ids=(5, 6))
  save_target(tmp_path / "f32", cfg, p, dtype="f32")
  cfg2, p2 = load_target(tmp_path / "f32")
  assert cfg2 == cfg
  _params_equal(p2, p)
  # bf16, sharded: every tensor rounded to bf16 (norms too, as HF stores them).
  save_target(tmp_path / "bf16", cfg, p, dtype="bf16", max_shard_bytes=4096)
  assert (tmp_path / "bf16" / "model.safetensors.index.json").exists()
  cfg3, p3 = load_target(tmp_path / "bf16")
  assert p3.embed.dtype == jnp.bfloat16 and p3.final_norm.dtype == jnp.float32
  r = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)
  _params_equal(jax.tree.map(lambda a: a.astype(jnp.float32), p3),
                jax.tree.map(lambda a: jnp.asarray(r(a)), p))
  hf = json.loads((tmp_path / "bf16" / "config.json").read_text())
  assert hf["model_type"] == ("qwen3" if kw["qk_norm"] else "llama") and hf["eos_token_id"] == [5, 6]


def _rewrite(folder, change):
  from dflash_jax.io import safetensors
  t = safetensors.read_tensors(folder)
  change(t)
  safetensors.write_tensors(folder, t, dtype=None)


def test_hf_load_errors(tmp_path):
  cfg, p = _model(13, **VARIANTS[0])
  good = tmp_path / "good"
  save_target(good, cfg, p, dtype="f32")
  with pytest.raises(FileNotFoundError, match="no such model folder"):
    load_target(tmp_path / "nothing")
  (tmp_path / "empty").mkdir()
  with pytest.raises(TargetFormatError, match="no config.json"):
    load_target(tmp_path / "empty")

  def broken(name, change=None, config=None):
    import shutil
    d = tmp_path / name
    shutil.copytree(good, d)
    if change:
      _rewrite(d, change)
    if config:
      c = json.loads((d / "config.json").read_text())
      config(c)
      (d / "config.json").write_text(json.dumps(c))
    return d

  cases = [
      (broken("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
       r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"),
      (broken("extra", lambda t: t.update({"model.layers.2.mlp.up_proj.weight": t["model.norm.weight"]})),
       r"unknown tensors \['model.layers.2.mlp.up_proj.weight'\] for a 2-layer qwen3 model"),
      (broken("shape", lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 32), np.float32)})),
       r"tensor model.layers.0.self_attn.k_proj.weight has shape \(8, 32\), expected \(16, 32\)"),
      (broken("dtype", lambda t: t.update({"model.norm.weight": np.zeros(32, np.int32)})),
       r"tensor model.norm.weight is I32"),
      (broken("nan", lambda t: t["model.layers.0.mlp.down_proj.weight"].__setitem__((0, 0), np.nan)),
       r"tensor model.layers.0.mlp.down_proj.weight holds NaN or Inf"),
      (broken("config", config=lambda c: c.pop("rms_norm_eps")), r"missing config keys \['rms_norm_eps'\]"),
      (broken("tied", config=lambda c: c.update(tie_word_embeddings=True)),
       r"lm_head.weight differs from model.embed_tokens.weight"),
  ]
  for folder, message in cases:
    with pytest.raises(TargetFormatError, match=message):
      load_target(folder)
  with pytest.raises(ValueError, match="params have an lm_head but tie_word_embeddings is True"):
    save_target(tmp_path / "x", dataclasses.replace(cfg, tie_word_embeddings=True), p)


def test_load_target_picks_the_family_and_ignores_buffers(tmp_path):
  cfg, p = _model(14, **VARIANTS[1])   # llama, tied
  save_target(tmp_path / "t", cfg, p, dtype="f32")
  _rewrite(tmp_path / "t", lambda t: t.update(
      {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}))
  cfg2, p2 = load_target(tmp_path / "t")
  assert cfg2 == cfg and read_target_config(tmp_path / "t") == cfg
  _params_equal(p2, p)
  c = json.loads((tmp_path / "t" / "config.json").read_text())
  (tmp_path / "t" / "config.json").write_text(json.dumps({**c, "model_type": "qwen2"}))
  with pytest.raises(TargetFormatError, match=r"config.json: model_type 'qwen2' is not supported "
                     r"\(supported: \['llama', 'muse_glimmer', 'muse_glimmer_text', 'qwen3', "
                     r"'qwen3_5', 'qwen3_5_text', 'qwen3_moe', 'qwen3_next'\]\)"):
    load_target(tmp_path / "t")
  with pytest.raises(ValueError, match="dtype must be 'fp32' or 'bf16', got 'int8'"):
    load_target(tmp_path / "nothing", dtype="int8")   # before looking at the folder


def test_load_target_streams_each_tensor_in_its_stored_dtype(tmp_path, monkeypatch):
  """A bf16 folder of 4 shards: every tensor is read once, as bf16 (the bytes read per shard are
  exactly its data), the params come out bf16 (norms float32), and the host never holds a
  float32 copy: on a GPU the traced host peak stays under two of the largest tensor (the one
  being handed to the device and the one read ahead); on CPU, where device arrays may be host
  buffers, under the folder plus those two."""
  import tracemalloc

  from dflash_jax.io import safetensors as st
  cfg = dataclasses.replace(TINY, vocab_size=2048, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=4, head_dim=16)
  p = Q.init_params(cfg, jax.random.key(15))
  folder = tmp_path / "bf16"
  save_target(folder, cfg, p, dtype="bf16", max_shard_bytes=200_000)
  load_target(folder)   # compiles the device-side checks and casts once, for both dtypes:
  load_target(folder, dtype="fp32")   # what the traced loads below allocate is then theirs
  real, seen = st.iter_tensors, []

  def spy(specs, names, where):
    for name, a in real(specs, names, where):
      seen.append((specs[name].file, name, a.dtype, a.nbytes))
      yield name, a

  monkeypatch.setattr(st, "iter_tensors", spy)
  tracemalloc.start()
  try:
    cfg2, p2 = load_target(folder)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert cfg2 == cfg
  assert {d for _, _, d, _ in seen} == {np.dtype(jnp.bfloat16)}
  assert sorted(n for _, n, _, _ in seen) == sorted(Q.hf_tensor_shapes(cfg))   # each once
  shards = sorted(f for f in folder.iterdir() if f.suffix == ".safetensors")
  assert len(shards) == 4
  for shard in shards:
    header = int.from_bytes(shard.read_bytes()[:8], "little")
    assert sum(n for f, _, _, n in seen if f == str(shard)) == shard.stat().st_size - 8 - header
  assert p2.embed.dtype == jnp.bfloat16 and p2.layers[0].wqkv.dtype == jnp.bfloat16
  assert p2.final_norm.dtype == jnp.float32 and p2.layers[0].attn_norm.dtype == jnp.float32
  r = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)
  _params_equal(jax.tree.map(lambda a: a.astype(jnp.float32), p2),
                jax.tree.map(lambda a: jnp.asarray(r(a)), p))
  largest = max(n for _, _, _, n in seen)
  total = sum(n for _, _, _, n in seen)
  assert total > 3 * largest
  # 64 kB for the interpreter's own allocations. On a GPU the device arrays are not host memory:
  # two tensors in flight at most. The CPU backend may keep a host buffer as its device array
  # (zero-copy), so there every tensor may stay counted: the bound is then the folder plus two
  # in flight, still below the float32 host copy this test exists to catch (2 x the folder).
  slack = 64_000
  bound = 2 * largest + slack + (0 if jax.default_backend() == "gpu" else total)
  assert peak < bound < 2 * total, (peak, largest, total)
  # fp32 from the same bf16 folder: the cast runs on the device, the host peak is unchanged.
  tracemalloc.start()
  try:
    _, p3 = load_target(folder, dtype="fp32")
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert p3.embed.dtype == jnp.float32 and peak < bound, (peak, bound)
  _params_equal(p3, jax.tree.map(lambda a: a.astype(jnp.float32), p2))
