"""The Qwen3.5 / 3.6 / 3.8 hybrid target (dflash_jax.models.qwen3_5) against the float64
numpy reference written from the note (reference/targets/qwen3_5.py), read back from small
checkpoints in both storage layouts; its cached path (chunked prefill, verify, both
rollbacks of the recurrent state) against its uncached one."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import models
from dflash_jax.io import safetensors as safetensors_io
from dflash_jax.models import base
from dflash_jax.models import qwen3_5 as M
from dflash_jax.models.base import prefill_bucket
from reference.targets import qwen3_5 as R

L, F = M.LINEAR, M.FULL
# Every axis > 1: GQA 2 in both mixers, two value heads per key head, a partial rotary
# width (8 of 16), a GDN layer after the attention layer.
TINY = M.TargetConfig(
    vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=(L, L, F, L, F),
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, rope_theta=1e4, partial_rotary_factor=0.5,
    max_position_embeddings=256)
ALL = tuple(range(TINY.num_hidden_layers + 1))   # every hidden state
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def model():
  return TINY, M.init_params(TINY, jax.random.key(0))


def _tokens(seed, shape):
  return np.random.default_rng(seed).integers(0, TINY.vocab_size, shape).astype(np.int32)


def _write(folder, cfg, params):
  """A checkpoint folder written with dflash_jax's safetensors writer (float32)."""
  safetensors_io.write_tensors(folder, M.params_to_hf(cfg, params), dtype="f32")
  (folder / "config.json").write_text(json.dumps(cfg.to_hf()))
  return folder


def _read(folder):
  config = json.loads((folder / "config.json").read_text())
  cfg = M.config_from_hf(config, str(folder / "config.json"))
  tensors = safetensors_io.read_tensors(folder)
  return cfg, config, tensors


def _expected_shapes(cfg, layout):
  """The note's tensor list (section 2), written out here independently of the module."""
  e, f, d, v = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
  nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
  nk, nv, dk, dv, kw = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                        cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                        cfg.linear_conv_kernel_dim)
  c = 2 * nk * dk + nv * dv
  pre = "model.language_model." if layout == "qwen3_5" else "model."
  out = {pre + "embed_tokens.weight": (v, e), pre + "norm.weight": (e,), "lm_head.weight": (v, e)}
  for i, kind in enumerate(cfg.layer_types):
    p = f"{pre}layers.{i}."
    out.update({p + "input_layernorm.weight": (e,), p + "post_attention_layernorm.weight": (e,),
                p + "mlp.gate_proj.weight": (f, e), p + "mlp.up_proj.weight": (f, e),
                p + "mlp.down_proj.weight": (e, f)})
    if kind == F:
      out.update({p + "self_attn.q_proj.weight": (2 * nh * d, e),
                  p + "self_attn.k_proj.weight": (nkv * d, e),
                  p + "self_attn.v_proj.weight": (nkv * d, e),
                  p + "self_attn.o_proj.weight": (e, nh * d),
                  p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
      continue
    g = p + "linear_attn."
    if layout == "qwen3_next":
      out.update({g + "in_proj_qkvz.weight": (2 * nk * dk + 2 * nv * dv, e),
                  g + "in_proj_ba.weight": (2 * nv, e)})
    else:
      out.update({g + "in_proj_qkv.weight": (c, e), g + "in_proj_z.weight": (nv * dv, e),
                  g + "in_proj_b.weight": (nv, e), g + "in_proj_a.weight": (nv, e)})
    out.update({g + "conv1d.weight": (c, 1, kw), g + "dt_bias": (nv,), g + "A_log": (nv,),
                g + "norm.weight": (dv,), g + "out_proj.weight": (e, nv * dv)})
  return out


# --- checkpoints, both layouts -----------------------------------------------------------------

@pytest.mark.parametrize("layout", M.MODEL_TYPES)
def test_checkpoint_names_shapes_and_reference(tmp_path, model, layout):
  """Written and read back in each form: every name and shape as the note gives them; the
  params round-trip bitwise; logits and every captured hidden state equal the float64
  reference run on the stored tensors; the prefilled recurrent state (S and conv window of
  every GDN layer) equals the reference's after the same tokens."""
  cfg, p = model
  cfg = dataclasses.replace(cfg, model_type=layout)
  assert M.hf_tensor_shapes(cfg) == _expected_shapes(cfg, layout)
  folder = _write(tmp_path / layout, cfg, p)
  _, config, tensors = _read(folder)
  assert {n: a.shape for n, a in tensors.items()} == _expected_shapes(cfg, layout)
  cfg2, p2 = models.load_target(folder, "fp32")   # picks the family by model_type
  assert cfg2 == cfg
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p2), strict=True):
    np.testing.assert_array_equal(a, b)
  toks = _tokens(1, (2, 13))
  logits, feats = M.forward_jit(p2, cfg2, toks, capture_layers=ALL)
  e = cfg.hidden_size
  cache = cfg.init_cache(2, 16)
  cache, _ = M.prefill_jit(p2, cfg2, cache, np.pad(toks, ((0, 0), (0, 3))), jnp.int32(13))
  for b in range(2):
    hs, ref_logits, states = R.forward(tensors, config, toks[b])
    np.testing.assert_allclose(logits[b], ref_logits, **TOL)
    for j, i in enumerate(ALL):
      np.testing.assert_allclose(feats[b, :, j * e:(j + 1) * e], hs[i], **TOL)
    for slot, layer in enumerate(cfg.gdn_layers):
      s, window = states[layer]
      np.testing.assert_allclose(cache.state[b, slot], s, **TOL)
      np.testing.assert_allclose(cache.conv[b, slot], window, **TOL)


def test_qwen3_next_groups_are_per_key_head(model):
  """in_proj_qkvz / in_proj_ba built here from the split projections by the note's rule
  (per key head: its q, its k, its r value heads' v, their z; b of those r heads, then a)
  load into the same params as the split form."""
  cfg, p = model
  split = M.params_to_hf(cfg, p)
  nk, nv, dk, dv = cfg.nk, cfg.nv, cfg.dk, cfg.dv
  r = nv // nk
  nxt = dataclasses.replace(cfg, model_type="qwen3_next")
  tensors = {}
  for name, a in split.items():
    name = name.replace("model.language_model.", "model.")
    if "in_proj_" not in name:
      tensors[name] = a
  for layer in cfg.gdn_layers:
    g = f"model.language_model.layers.{layer}.linear_attn."
    qkv, z = split[g + "in_proj_qkv.weight"], split[g + "in_proj_z.weight"]
    b, a = split[g + "in_proj_b.weight"], split[g + "in_proj_a.weight"]
    rows, ba = [], []
    for kh in range(nk):
      rows.append(qkv[kh * dk:(kh + 1) * dk])                                  # q of kh
      rows.append(qkv[nk * dk + kh * dk:nk * dk + (kh + 1) * dk])              # k of kh
      for j in range(kh * r, (kh + 1) * r):
        rows.append(qkv[2 * nk * dk + j * dv:2 * nk * dk + (j + 1) * dv])      # v of head j
      for j in range(kh * r, (kh + 1) * r):
        rows.append(z[j * dv:(j + 1) * dv])
      ba += [b[kh * r:(kh + 1) * r], a[kh * r:(kh + 1) * r]]
    out = g.replace("model.language_model.", "model.")
    tensors[out + "in_proj_qkvz.weight"] = np.concatenate(rows)
    tensors[out + "in_proj_ba.weight"] = np.concatenate(ba)
  got = M.params_from_hf(nxt, dict(tensors), "fp32")
  for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(x, y)
  back = M.params_to_hf(nxt, got)
  assert set(back) == set(tensors)
  for name, a in tensors.items():
    np.testing.assert_array_equal(back[name], a, err_msg=name)


def test_tied_head_and_bf16_weights(model):
  """A tied head reads the embedding; bf16 weights keep the state (and norms) float32 and
  stay near the float32 model."""
  cfg, _ = model
  tied = dataclasses.replace(cfg, tie_word_embeddings=True)
  p = M.init_params(tied, jax.random.key(3))
  assert p.lm_head is None and "lm_head.weight" not in M.hf_tensor_shapes(tied)
  assert M.hf_optional(tied) == {"lm_head.weight"}
  toks = _tokens(4, (1, 9))
  logits, _ = M.forward_jit(p, tied, toks)
  _, ref, _ = R.forward(M.params_to_hf(tied, p), tied.to_hf(), toks[0])
  np.testing.assert_allclose(logits[0], ref, **TOL)
  p16 = M.params_from_hf(tied, M.params_to_hf(tied, p), "bf16")
  assert p16.embed.dtype == jnp.bfloat16 and p16.layers[0].conv.dtype == jnp.float32
  cache = tied.init_cache(1, 16, "bf16")
  cache, _ = M.prefill_jit(p16, tied, cache, np.pad(toks, ((0, 0), (0, 7))), jnp.int32(9))
  assert cache.state.dtype == jnp.float32 and cache.k[0].dtype == jnp.bfloat16
  l16, _ = M.forward_jit(p16, tied, toks)
  assert float(jnp.abs(l16 - logits).max()) < 0.1 * float(jnp.abs(logits).max())


def test_hf_ignored():
  assert M.hf_ignored("model.visual.blocks.0.attn.qkv.weight")
  assert M.hf_ignored("mtp.layers.0.mlp.gate_proj.weight")
  assert M.hf_ignored("model.language_model.layers.0.self_attn.rotary_emb.inv_freq")
  assert not M.hf_ignored("model.language_model.layers.0.linear_attn.A_log")


# --- config -------------------------------------------------------------------------------------

QWEN3_5_27B_TEXT = {   # the note's Qwen3.5-27B figures, nested as the VLM stores them
    "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120,
        "intermediate_size": 17408, "num_hidden_layers": 64, "num_attention_heads": 24,
        "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144, "eos_token_id": 248044, "attn_output_gate": True,
        "mamba_ssm_dtype": "float32",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                            "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                            "mrope_interleaved": True}}}


def test_config_from_hf_and_back():
  c = M.config_from_hf(QWEN3_5_27B_TEXT, "cfg.json")
  assert (c.num_hidden_layers, c.rot, c.conv_dim, c.model_type) == (64, 64, 10240, "qwen3_5")
  assert len(c.gdn_layers) == 48 and c.attn_layers == tuple(range(3, 64, 4))
  assert c.eos_token_ids == (248044,) and c.rollback == "replay"
  hash(c)
  for layout in M.MODEL_TYPES:
    d = dataclasses.replace(c, model_type=layout)
    assert M.config_from_hf(d.to_hf(), "x") == d
  # Defaults where keys are absent: partial rotary 0.25, full attention every 4th layer.
  text = {k: v for k, v in QWEN3_5_27B_TEXT["text_config"].items()
          if k not in ("rope_parameters", "full_attention_interval")}
  d = M.config_from_hf({**text, "model_type": "qwen3_5_text", "rope_theta": 1e7}, "x")
  assert d.partial_rotary_factor == 0.25 and d.layer_types == c.layer_types
  assert isinstance(c, base.Target)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "qwen3_5_moe"}, "model_type 'qwen3_5_moe' is not a Qwen3.5 hybrid"),
    ({"text_config": None}, "needs a text_config object"),
    ({"text_config": {"model_type": "qwen3_5_moe_text"}}, "text_config.model_type"),
    ({"text_config": {"hidden_act": "gelu"}}, "hidden_act 'gelu'"),
    ({"text_config": {"linear_num_value_heads": 40}}, "multiple of linear_num_key_heads"),
    ({"text_config": {"layer_types": ["linear_attention"] * 3}}, "layer_types has 3 entries"),
    ({"text_config": {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e7}}},
     "rope_parameters.rope_type 'dynamic' is not supported"),
    ({"text_config": {"vocab_size": None}}, r"missing config keys \['vocab_size'\]"),
])
def test_config_from_hf_errors(change, message):
  c = json.loads(json.dumps(QWEN3_5_27B_TEXT))
  for k, v in change.items():
    if isinstance(v, dict) and k == "text_config":
      c[k].update(v)
      c[k] = {kk: vv for kk, vv in c[k].items() if vv is not None}
    elif v is None:
      del c[k]
    else:
      c[k] = v
  with pytest.raises(ValueError, match=message) as e:
    M.config_from_hf(c, "some/config.json")
  assert "some/config.json" in str(e.value)


def test_config_refuses_moe_layers():
  nxt = {**{k: v for k, v in QWEN3_5_27B_TEXT["text_config"].items() if k != "model_type"},
         "model_type": "qwen3_next", "num_experts": 512, "decoder_sparse_step": 1}
  with pytest.raises(ValueError, match="MoE FFN is not supported"):
    M.config_from_hf(nxt, "x")
  assert M.config_from_hf({**nxt, "mlp_only_layers": list(range(64))}, "x").model_type == \
      "qwen3_next"


# --- the cached path ----------------------------------------------------------------------------

IMPLS = ("xla", "pallas")


def _copy(cache):
  return jax.tree.map(jnp.array, cache)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_prefill_equals_token_by_token(model, impl):
  """A 37-row prefill (bucketed to 64: two chunked sequences of different lengths) leaves the
  state and window the rows fed one at a time (verify of 1 + commit) leave, and the next
  verify's logits equal the uncached forward."""
  cfg, p = model
  toks = _tokens(5, (2, 40))
  ref_logits, _ = M.forward_jit(p, cfg, toks)
  n = np.array([37, 30])
  padded = np.zeros((2, prefill_bucket(37)), np.int32)
  padded[:, :37] = toks[:, :37]
  a, _ = M.prefill_jit(p, cfg, cfg.init_cache(2, 64), padded, jnp.asarray(n), impl=impl)
  b = cfg.init_cache(2, 64)
  for i in range(37):
    b, logits, _ = M.verify_jit(p, cfg, b, toks[:, i:i + 1], impl=impl)
    b = M.commit_jit(cfg, b, jnp.asarray((i < n).astype(np.int32)))
  np.testing.assert_array_equal(a.length, n)
  np.testing.assert_array_equal(b.length, n)
  np.testing.assert_allclose(a.state, b.state, **TOL)
  np.testing.assert_allclose(a.conv, b.conv, **TOL)
  for cache in (a, b):
    nxt = np.stack([toks[0, 37:40], toks[1, 30:33]])
    _, logits, _ = M.verify_jit(p, cfg, _copy(cache), nxt, impl=impl)
    np.testing.assert_allclose(logits[0], ref_logits[0, 37:40], **TOL)
    np.testing.assert_allclose(logits[1], ref_logits[1, 30:33], **TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_cached_random_chunks_equal_one_pass(model, impl):
  """Two sequences fed in random chunks, alternating prefills and fully kept verifies, give
  the uncached forward's logits and features row for row."""
  cfg, p = model
  rng = np.random.default_rng(6)
  toks = _tokens(7, (2, 44))
  capture = (4, 0, 3)
  ref_logits, ref_feats = M.forward_jit(p, cfg, toks, capture_layers=capture)
  cache = cfg.init_cache(2, 64)
  pos = 0
  while pos < 40:
    w = int(rng.integers(1, 6))
    if rng.random() < 0.5:
      chunk = np.pad(toks[:, pos:pos + w], ((0, 0), (0, 16 - w)))
      cache, feats = M.prefill_jit(p, cfg, cache, chunk, jnp.int32(w), capture_layers=capture,
                                   impl=impl)
      np.testing.assert_allclose(feats[:, :w], ref_feats[:, pos:pos + w], **TOL)
    else:
      cache, logits, feats = M.verify_jit(p, cfg, cache, toks[:, pos:pos + w],
                                          capture_layers=capture, impl=impl)
      np.testing.assert_allclose(logits, ref_logits[:, pos:pos + w], **TOL)
      np.testing.assert_allclose(feats, ref_feats[:, pos:pos + w], **TOL)
      cache = M.commit_jit(cfg, cache, jnp.full((2,), w, jnp.int32))
    pos += w
    np.testing.assert_array_equal(cache.length, [pos, pos])


@pytest.mark.parametrize("rollback", M.ROLLBACKS)
@pytest.mark.parametrize("impl", IMPLS)
def test_verify_commit_every_n_keep(model, rollback, impl):
  """Verify 6 rows (two sequences, different prompt lengths), commit n_keep = 0..6: the
  state and window equal a prefill of just the kept rows (tolerance: the projections of 6
  and of n rows are different XLA programs, so their rounding may differ), and the next
  verify's logits equal the uncached forward over prompt + kept rows + continuation. With
  the kernels both rollbacks give bitwise the same state (the same row code); their twins
  are two XLA programs, equal to rounding."""
  cfg, p = model
  cfg = dataclasses.replace(cfg, rollback=rollback)
  other = dataclasses.replace(cfg, rollback=[r for r in M.ROLLBACKS if r != rollback][0])
  w, n_prompt = 6, np.array([9, 5])
  toks = _tokens(8 + len(rollback), (2, 32))
  pre = np.pad(toks[:, :9], ((0, 0), (0, 7)))
  start, _ = M.prefill_jit(p, cfg, cfg.init_cache(2, 40), pre, jnp.asarray(n_prompt), impl=impl)
  drafts = np.stack([toks[b, n_prompt[b]:n_prompt[b] + w] for b in range(2)])
  for n in range(w + 1):
    n_keep = jnp.asarray([n, w - n], jnp.int32)
    cache, _, _ = M.verify_jit(p, cfg, _copy(start), drafts, impl=impl)
    np.testing.assert_array_equal(cache.length, n_prompt)        # nothing committed yet
    np.testing.assert_array_equal(cache.state, start.state)
    cache = M.commit_jit(cfg, cache, n_keep)
    np.testing.assert_array_equal(cache.length, n_prompt + np.asarray(n_keep))
    assert cache.pending is None
    twin, _, _ = M.verify_jit(p, other, _copy(start), drafts, impl=impl)
    twin = M.commit_jit(other, twin, n_keep)
    if impl == "pallas":
      np.testing.assert_array_equal(cache.state, twin.state)
    else:
      np.testing.assert_allclose(cache.state, twin.state, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(cache.conv, twin.conv)
    # One pass over the kept rows: a prefill of them from the same start.
    kept = np.zeros((2, 16), np.int32)
    for b in range(2):
      kept[b, :int(n_keep[b])] = drafts[b, :int(n_keep[b])]
    once, _ = M.prefill_jit(p, cfg, _copy(start), kept, n_keep, impl=impl)
    np.testing.assert_allclose(cache.state, once.state, **TOL)
    np.testing.assert_allclose(cache.conv, once.conv, **TOL)
    # The next verify: continuation rows after the kept ones, against the uncached forward.
    seqs = [np.concatenate([toks[b, :n_prompt[b]], drafts[b, :int(n_keep[b])],
                            toks[b, 20:24]]) for b in range(2)]
    _, logits, _ = M.verify_jit(p, cfg, cache, np.stack([s[-4:] for s in seqs]), impl=impl)
    # One forward of both sequences padded at the end to one length (it is causal: the
    # padding changes no earlier row), so every n_keep reuses one compilation.
    padded = np.stack([np.pad(s, (0, 20 - len(s))) for s in seqs])
    ref, _ = M.forward_jit(p, cfg, padded)
    for b in range(2):
      np.testing.assert_allclose(logits[b], ref[b, len(seqs[b]) - 4:len(seqs[b])], **TOL)


def test_truncating_without_restoring_the_state_is_wrong(model):
  """The negative control: after a verify of 6 rows, moving only the length (what suffices
  for a KV cache) leaves every S and window after row 5, and the next logits are far off the
  forward's; the commit's restore is what makes them right."""
  cfg, p = model
  toks = _tokens(9, (1, 24))
  start, _ = M.prefill_jit(p, cfg, cfg.init_cache(1, 32), np.pad(toks[:, :8], ((0, 0), (0, 8))),
                           jnp.int32(8))
  ref, _ = M.forward_jit(p, cfg, np.concatenate([toks[:, :10], toks[:, 16:20]], 1))
  cache, _, _ = M.verify_jit(p, cfg, _copy(start), toks[:, 8:14])
  good = M.commit_jit(cfg, _copy(cache), jnp.asarray([2], jnp.int32))
  # Truncation alone: the state after all 6 rows (the commit of 6), length as if 2 were kept.
  bad = M.commit_jit(cfg, cache, jnp.asarray([6], jnp.int32))
  bad = bad.replace(length=bad.length - 4)
  _, lg_good, _ = M.verify_jit(p, cfg, good, toks[:, 16:20])
  _, lg_bad, _ = M.verify_jit(p, cfg, bad, toks[:, 16:20])
  np.testing.assert_allclose(lg_good[0], ref[0, -4:], **TOL)
  rel = float(jnp.linalg.norm(lg_bad[0] - ref[0, -4:]) / jnp.linalg.norm(ref[0, -4:]))
  assert rel > 0.05, rel


@pytest.mark.parametrize("rollback", M.ROLLBACKS)
def test_cache_nbytes_counts_the_verify(model, rollback):
  """cache_nbytes(verify_width=w) is the bytes of the cache a verify of w rows returns (K/V,
  state, windows, length and the pending rollback data)."""
  cfg, p = model
  cfg = dataclasses.replace(cfg, rollback=rollback)
  cache = cfg.init_cache(2, 24, "bf16")
  nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))
  assert nbytes(cache) == cfg.cache_nbytes(2, 24, "bf16", verify_width=0)
  cache, _, _ = M.verify_jit(p, cfg, cache, _tokens(10, (2, 5)))
  assert nbytes(cache) == cfg.cache_nbytes(2, 24, "bf16", verify_width=5)
  per_row = {"snapshot": cfg.conv_dim + cfg.nv * cfg.dk * cfg.dv,
             "replay": 2 * cfg.conv_dim + 2 * cfg.nv}[rollback]
  assert M.pending_nbytes(cfg, 2, 5) == 4 * 3 * 2 * 5 * per_row


def test_commit_needs_a_verify(model):
  cfg, p = model
  with pytest.raises(ValueError, match="no verify to commit"):
    cfg.commit(cfg.init_cache(1, 8), jnp.zeros((1,), jnp.int32))
  with pytest.raises(ValueError, match="impl must be one of"):
    cfg.verify(p, cfg.init_cache(1, 8), _tokens(0, (1, 2)), impl="triton")
  with pytest.raises(ValueError, match=r"capture_layers \[6\] outside \[0, 5\]"):
    cfg.forward(p, _tokens(0, (1, 2)), capture_layers=(6,))


@pytest.mark.parametrize("rollback", M.ROLLBACKS)
def test_pallas_path_lowers_for_sm90(monkeypatch, rollback):
  """prefill, verify and commit with impl="pallas" (bf16 weights, real head shapes: dk = dv =
  128, head_dim 256) lower for an sm90 target with the kernels compiled, not interpreted:
  one recurrent kernel serves every GDN layer (the layer is an operand), one replay or
  snapshot commit."""
  import pallas_kernels.gdn as gdn_kernels
  import pallas_kernels.skinny_gemm as skinny
  from test_kernels_lowering import lowered_text
  monkeypatch.setattr(gdn_kernels, "resolve_interpret", lambda _: False)
  monkeypatch.setattr(skinny, "resolve_interpret", lambda _: False)
  cfg = dataclasses.replace(M.TargetConfig(
      vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
      num_attention_heads=4, num_key_value_heads=2, layer_types=(L, L, F, L),
      linear_num_key_heads=2, linear_num_value_heads=6), rollback=rollback)
  p = jax.eval_shape(lambda: M.init_params(cfg, jax.random.key(0), jnp.bfloat16))
  cache = jax.eval_shape(lambda: cfg.init_cache(1, 256, "bf16"))

  def round_(p, c, t):
    c, logits, feats = cfg.verify(p, c, t, capture_layers=(1, 3), impl="pallas")
    return cfg.commit(c, jnp.asarray([5], jnp.int32)), logits, feats

  import re
  text = lowered_text(round_, (p, cache, jax.ShapeDtypeStruct((1, 16), jnp.int32)))
  kernels = re.findall(r"tt.func public @(\w+)", text)
  # Skinny GEMMs for the 16-row bf16 products, then the rule's kernels: one recurrent kernel
  # for all three GDN layers (two with snapshots: the first call starts the buffer).
  assert "skinny_matmul" in kernels
  assert kernels.count("gdn_recurrent") == (2 if rollback == "snapshot" else 1), kernels
  assert kernels.count("gdn_replay") == (rollback == "replay"), kernels
  text = lowered_text(lambda p, c, t: cfg.prefill(p, c, t, jnp.asarray([100], jnp.int32),
                                                  impl="pallas"),
                      (p, cache, jax.ShapeDtypeStruct((1, 128), jnp.int32)))
  assert "gdn_chunked" in text


@pytest.mark.gpu
def test_pallas_path_gpu():
  """Real head shapes (dk = dv = 128, head_dim 256; 4 key / 12 value heads), float32, the
  compiled kernels: a 40-row chunked prefill, then a verify of 16 rows committed at n_keep
  0, 1, 7 and 16 under both rollbacks: the states of the two rollbacks are bitwise equal,
  and the next verify's logits equal the uncached forward (XLA's GEMMs, the twins)."""
  base_cfg = M.TargetConfig(
      vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
      num_attention_heads=4, num_key_value_heads=2, layer_types=(L, L, F, L),
      linear_num_key_heads=4, linear_num_value_heads=12, max_position_embeddings=4096)
  p = M.init_params(base_cfg, jax.random.key(0))
  toks = np.random.default_rng(0).integers(0, 1024, (2, 80)).astype(np.int32)
  pre = np.zeros((2, 64), np.int32)
  pre[:, :40] = toks[:, :40]
  for n in (0, 1, 7, 16):
    states = {}
    for rollback in M.ROLLBACKS:
      cfg = dataclasses.replace(base_cfg, rollback=rollback)
      cache, _ = M.prefill_jit(p, cfg, cfg.init_cache(2, 128), pre, jnp.int32(40),
                               impl="pallas")
      cache, _, _ = M.verify_jit(p, cfg, cache, toks[:, 40:56], impl="pallas")
      cache = M.commit_jit(cfg, cache, jnp.full((2,), n, jnp.int32))
      states[rollback] = np.asarray(cache.state)
      _, logits, _ = M.verify_jit(p, cfg, cache, toks[:, 60:64], impl="pallas")
      # Padded at the end to one length (causal: no earlier row changes), one compilation.
      seq = np.concatenate([toks[:, :40 + n], toks[:, 60:64], toks[:, :16 - n]], 1)
      ref, _ = M.forward_jit(p, cfg, seq)
      np.testing.assert_allclose(logits, ref[:, 40 + n:44 + n], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(states["replay"], states["snapshot"])


def test_yarn_rope_scaling_round_trips_and_turns_the_rotary_dims():
  """A YaRN config reads from rope_parameters (with partial_rotary_factor beside it), writes
  back to the same config, and the attention layer's rope turns the first rot dims by the
  scaled table with cos and sin times the attention factor (float64 check); the other dims
  pass through."""
  import math
  from dflash_jax.config import RopeScaling, rope_inv_freq
  c = json.loads(json.dumps(QWEN3_5_27B_TEXT))
  c["text_config"]["rope_parameters"] = {
      "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
      "rope_theta": 1e7, "partial_rotary_factor": 0.25}
  cfg = M.config_from_hf(c, "config.json")
  assert cfg.rope_scaling == RopeScaling(rope_type="yarn", factor=4.0,
                                         original_max_position_embeddings=32768)
  assert M.config_from_hf(cfg.to_hf(), "again") == cfg
  scale = cfg.rope_scaling.attention_scaling
  assert abs(scale - (0.1 * math.log(4.0) + 1.0)) < 1e-12   # HF's default YaRN mscale
  freqs = rope_inv_freq(cfg.rot, cfg.rope_theta, cfg.rope_scaling)
  x = np.random.default_rng(0).standard_normal((1, 1, 2, cfg.head_dim)).astype(np.float32)
  pos = 100_000   # past the original context
  got = np.asarray(M._rope(jnp.asarray(x), jnp.full((1, 1), pos, jnp.int32), jnp.asarray(freqs),
                           scale))
  half = cfg.rot // 2
  ang = (np.float32(pos) * freqs).astype(np.float64)   # the angle in float32, as SPEC fixes it
  x64 = x.astype(np.float64)
  want = x64.copy()
  want[..., :half] = (x64[..., :half] * np.cos(ang) - x64[..., half:cfg.rot] * np.sin(ang)) * scale
  want[..., half:cfg.rot] = (x64[..., half:cfg.rot] * np.cos(ang)
                             + x64[..., :half] * np.sin(ang)) * scale
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
  np.testing.assert_array_equal(got[..., cfg.rot:], x[..., cfg.rot:])
