"""DFlash2 and DSpark checkpoints (SPEC_dflash2_dspark 3, 10, 13): HF folders and GGUF files
read and written for both families, round trips between them, and every ambiguity refused."""
from __future__ import annotations

import dataclasses
import json
import os

import gguf
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dflash_jax.__main__ import main
from dflash_jax.config import (DFLASH2_CONFIG, DSPARK_QWEN3_8B_CONFIG, FULL, SLIDING,
                               TINY_DFLASH2_CONFIG, TINY_DSPARK_CONFIG, DFlash2Fields,
                               DSparkFields, drafter_tensor_shapes)
from dflash_jax.io import DrafterFormatError, load_drafter, save_drafter
from dflash_jax.io import safetensors as safetensors_io
from dflash_jax.io.hf import config_from_hf, config_to_hf
from dflash_jax.synthetic import synthetic_drafter

QT = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType
VOCAB = 96
# Rank 32 and k 4: every matrix's input width is a multiple of 32 (Q8_0 blocks).
D2 = dataclasses.replace(TINY_DFLASH2_CONFIG, family_fields=dataclasses.replace(
    TINY_DFLASH2_CONFIG.dflash2, selector_rank=32, input_embedding_scale=1.0))
DS = dataclasses.replace(TINY_DSPARK_CONFIG, family_fields=dataclasses.replace(
    TINY_DSPARK_CONFIG.dspark, markov_rank=32))


def _dspark(head="vanilla", conf=True, with_markov=True, anchor=True, rank=8):
  return dataclasses.replace(TINY_DSPARK_CONFIG, family_fields=DSparkFields(
      sample_from_anchor=anchor, markov_rank=rank if head else 0, markov_head_type=head,
      confidence_head=conf, confidence_with_markov=conf and with_markov))


def _dflash2(causal=False, kinds="sliding", scale=1.5, cap=12.0):
  layer_types = {"sliding": None, "mixed": (SLIDING, FULL)}[kinds]
  return dataclasses.replace(TINY_DFLASH2_CONFIG, layer_types=layer_types, family_fields=(
      dataclasses.replace(TINY_DFLASH2_CONFIG.dflash2, is_causal=causal,
                          input_embedding_scale=scale, final_logit_softcapping=cap)))


def _weights(cfg, seed=0, copies=False):
  """The drafter's tensors; copies: plus tok_embd / lm_head (a DSpark file's copies)."""
  w = synthetic_drafter(cfg, seed=seed, n_vocab=VOCAB, with_target=copies)
  return w


def _expect(fn, *culprits, error=DrafterFormatError) -> str:
  with pytest.raises(error) as info:
    fn()
  msg = str(info.value)
  for c in culprits:
    assert c in msg, (c, msg)
  return msg


def _same(w1, w2):
  assert set(w1) == set(w2)
  for k in w1:
    np.testing.assert_array_equal(w1[k], w2[k], err_msg=k)


# ---------------------------------------------------------------------------------------------
# Published configs (SPEC_dflash2_dspark 3.1, 10.1), as their config.json files state them


def _muse_dflash2_config() -> dict:
  return {
      "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": 6656,
      "intermediate_size": 19968, "num_hidden_layers": 5, "num_attention_heads": 32,
      "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
      "rope_parameters": {"rope_theta": 500000, "rope_type": "default"},
      "layer_types": ["sliding_attention"] * 5, "sliding_window": 2048, "is_causal": False,
      "max_position_embeddings": 131072, "vocab_size": 202048,
      "dflash_config": {"block_size": 16, "mask_token_id": 201818,
                        "target_layer_ids": [1, 13, 25, 37, 49], "conv_kernel_size": 2,
                        "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16,
                        "output_multiplier": 0.19611613513818404,
                        "final_logit_softcapping": 20.0},
  }


def _deepspec_qwen3_8b_config() -> dict:
  return {
      "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": 4096,
      "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32,
      "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
      "vocab_size": 151936, "max_position_embeddings": 40960, "num_target_layers": 36,
      "layer_types": ["full_attention"] * 5, "use_sliding_window": False, "block_size": 7,
      "mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33], "num_anchors": 512,
      "markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
      "confidence_head_with_markov": True,
  }


def test_published_configs_are_the_presets():
  assert config_from_hf(_muse_dflash2_config()) == DFLASH2_CONFIG
  assert config_from_hf(_deepspec_qwen3_8b_config()) == DSPARK_QWEN3_8B_CONFIG
  for cfg in (DFLASH2_CONFIG, DSPARK_QWEN3_8B_CONFIG):
    assert config_from_hf(config_to_hf(cfg)) == cfg


def test_dflash2_keys_at_the_top_level_and_defaults():
  config = _muse_dflash2_config()
  nested = config.pop("dflash_config")
  for k in ("conv_kernel_size", "selector_top_k", "output_multiplier"):
    config[k] = nested.pop(k)   # z-lab falls back to the top level
  config["dflash_config"] = nested
  assert config_from_hf(config) == DFLASH2_CONFIG
  del nested["final_logit_softcapping"], config["output_multiplier"]
  f = config_from_hf(config).dflash2
  assert f.output_multiplier == 1.0 and f.final_logit_softcapping is None
  assert f.input_embedding_scale == 1.0
  nested["final_logit_softcapping"] = 0   # 0 is off
  assert config_from_hf(config).dflash2.final_logit_softcapping is None


def test_absent_is_causal_follows_each_formats_default(tmp_path):
  """SPEC_dflash2_dspark 13.1: z-lab makes sliding layers causal when is_causal is absent,
  llama.cpp makes every layer non-causal without dflash.attention.causal. Each file is read by
  its own format's rule, and conversion writes the resolved value explicitly, so the converted
  file runs the same drafter."""
  config = _muse_dflash2_config()
  del config["is_causal"]
  assert config_from_hf(config).dflash2.is_causal is True           # every layer slides
  config["layer_types"] = ["sliding_attention"] * 4 + ["full_attention"]
  mixed = config_from_hf(config)
  assert mixed.dflash2.is_causal == (True,) * 4 + (False,)
  assert "is_causal" not in config_to_hf(mixed)   # the absent key says exactly this
  assert config_from_hf(config_to_hf(mixed)) == mixed
  # GGUF: a file written without the key loads non-causal.
  cfg = _dflash2(causal=True, scale=1.0)
  w = _weights(cfg)
  path = save_drafter(tmp_path / "c.gguf", cfg, w)
  assert gguf.GGUFReader(path).get_field("dflash.attention.causal").contents() is True
  no_key = _rewrite_gguf(path, tmp_path / "nokey.gguf", drop=("dflash.attention.causal",))
  assert load_drafter(no_key)[0].dflash2.is_causal is False
  # An HF file without the flag (all sliding: causal) converts to a GGUF that says true.
  folder = save_drafter(tmp_path / "hf", cfg, w, "f32")
  hf = json.load(open(os.path.join(folder, "config.json")))
  del hf["is_causal"]
  json.dump(hf, open(os.path.join(folder, "config.json"), "w"))
  cfg_hf, w_hf = load_drafter(folder)
  assert cfg_hf.dflash2.is_causal is True
  out = save_drafter(tmp_path / "from_hf.gguf", cfg_hf, w_hf)
  assert load_drafter(out)[0] == cfg_hf


@pytest.mark.parametrize("change,culprits", [
    (dict(architectures=["DFlashDraftModel"]), ["conv_kernel_size", "DFlash2DraftModel"]),
    (dict(architectures=["DFlash2DraftModel", "Qwen3DSparkModel"]), ["more than one"]),
    (dict(architectures=["DSparkDraftModel"]), ["DSparkDraftModel", "Qwen3DSparkModel"]),
    (dict(is_causal="no"), ["is_causal is 'no'"]),
    (dict(dflash_config_is_causal=True), ["dflash_config.is_causal", "top level"]),
    (dict(drop="selector_rank"), ["dflash_config.selector_rank"]),
    (dict(selector_top_k=0), ["selector_top_k must be a positive int"]),
    (dict(conv_group_size=100), ["conv_group_size (100) must divide n_embd"]),
    (dict(output_multiplier="x"), ["output_multiplier is 'x'"]),
])
def test_dflash2_config_errors(change, culprits):
  config = _muse_dflash2_config()
  change = dict(change)
  if "drop" in change:
    del config["dflash_config"][change.pop("drop")]
  if change.pop("dflash_config_is_causal", None):
    config["dflash_config"]["is_causal"] = True
  for k in ("selector_top_k", "conv_group_size", "output_multiplier"):
    if k in change:
      config["dflash_config"][k] = change.pop(k)
  config.update(change)
  _expect(lambda: config_from_hf(config), "config.json", *culprits)


@pytest.mark.parametrize("change,culprits", [
    (dict(architectures=["DFlashDraftModel"]), ["markov_rank", "Qwen3DSparkModel"]),
    (dict(markov_head_type=None), ["markov_head_type"]),
    (dict(markov_head_type="lstm"), ["markov_head_type must be one of"]),
    (dict(confidence_head_with_markov=None), ["confidence_head_with_markov is missing"]),
    (dict(enable_confidence_head="yes"), ["enable_confidence_head is 'yes'"]),
    (dict(target_layer_ids=[-2, 9]), ["target_layer_ids", ">= -1"]),
    (dict(target_layer_ids=[9, 1]), ["strictly increasing"]),
    (dict(is_causal=True), ["non-causal"]),
])
def test_dspark_config_errors(change, culprits):
  config = {k: v for k, v in {**_deepspec_qwen3_8b_config(), **change}.items() if v is not None}
  _expect(lambda: config_from_hf(config), "config.json", *culprits)


def test_dspark_config_reads_the_embedding_layer_and_defaults():
  config = _deepspec_qwen3_8b_config()
  config["target_layer_ids"] = [-1, 9, 17]
  cfg = config_from_hf(config)
  assert cfg.target_layers == (0, 10, 18)   # -1 reads the target's embedding output
  assert cfg.dspark.sample_from_anchor is True   # DeepSpec always shifts the rows
  assert config_to_hf(cfg)["target_layer_ids"] == [-1, 9, 17]
  assert config_from_hf({**config, "sample_from_anchor": False}).dspark.sample_from_anchor is False
  bare = {k: v for k, v in config.items() if not k.startswith(("markov", "enable_", "confid"))}
  f = config_from_hf(bare).dspark
  assert (f.markov_rank, f.markov_head_type, f.confidence_head) == (0, None, False)
  # markov_rank 0 means no head, whatever type a file names next to it.
  assert config_from_hf({**bare, "markov_rank": 0, "markov_head_type": "vanilla"}) \
      == config_from_hf(bare)


# ---------------------------------------------------------------------------------------------
# HF folders


HF_CASES = {
    "dflash2": _dflash2(),
    "dflash2-causal-mixed": _dflash2(causal=(True, False), kinds="mixed"),
    "dspark-vanilla": _dspark(),
    "dspark-gated": _dspark("gated", with_markov=False),
    "dspark-rnn-unshifted": _dspark("rnn", anchor=False),
    "dspark-no-markov": _dspark(None, conf=True, with_markov=False),
}


@pytest.mark.parametrize("name", list(HF_CASES))
@pytest.mark.parametrize("copies", [False, True])
def test_hf_round_trip(tmp_path, name, copies):
  cfg = HF_CASES[name]
  w = _weights(cfg, seed=1, copies=copies)
  folder = save_drafter(tmp_path / "hf", cfg, w, "f32")
  cfg2, w2 = load_drafter(folder)
  assert cfg2 == cfg
  stored = cfg.family == "dspark" and copies   # only DSpark files hold the target's tensors
  want = {k: v for k, v in w.items() if stored or k not in ("tok_embd", "lm_head")}
  _same(want, w2)
  specs = safetensors_io.tensor_specs(folder)
  config = json.load(open(os.path.join(folder, "config.json")))
  if cfg.family == "dflash2":
    assert config["architectures"] == ["DFlash2DraftModel"]
    for n in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
              "candidate_selector.hidden_projection.weight", "layers.1.mlp_conv.base_kernel",
              "layers.0.attention_conv.kernel_projection.weight"):
      assert n in specs, n
    assert specs["layers.0.attention_conv.base_kernel"].shape == (2, 2, 64)
    assert config["vocab_size"] == VOCAB and "dflash_config" in config
  else:
    assert config["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in config
    assert ("embed_tokens.weight" in specs) == ("lm_head.weight" in specs) == stored
    assert config["target_layer_ids"] == [t - 1 for t in cfg.target_layers]
    if cfg.dspark.markov_rank:
      assert specs["markov_head.markov_w2.weight"].shape == (VOCAB, 8)
  # bf16: the matrices and base kernels round, norms and biases stay F32.
  folder16 = save_drafter(tmp_path / "hf16", cfg, w, "bf16")
  specs16 = safetensors_io.tensor_specs(folder16)
  cfg3, w3 = load_drafter(folder16)
  assert cfg3 == cfg
  for k, v in want.items():
    np.testing.assert_array_equal(
        w3[k], v if v.ndim == 1 else v.astype(ml_dtypes.bfloat16).astype(np.float32), err_msg=k)
  assert all(s.dtype == ("F32" if len(s.shape) == 1 else "BF16") for s in specs16.values())


def _tamper(folder, edit) -> str:
  tensors = safetensors_io.read_tensors(folder)
  edit(tensors)
  save_file(tensors, os.path.join(folder, "model.safetensors"))
  return folder


def test_hf_tensor_errors(tmp_path):
  cfg = _dflash2()
  w = _weights(cfg, seed=2)
  base = lambda name: save_drafter(tmp_path / name, cfg, w, "f32")
  _expect(lambda: load_drafter(_tamper(base("a"), lambda t: t.pop(
      "candidate_selector.hidden_projection.weight"))), "missing tensors",
      "candidate_selector.hidden_projection.weight")
  # The codebooks carry no `.weight` suffix in z-lab's files: a suffixed name is not theirs.
  def suffixed(t):
    t["candidate_selector.successor_codebook.weight"] = t.pop(
        "candidate_selector.successor_codebook")
  _expect(lambda: load_drafter(_tamper(base("b"), suffixed)), "unknown tensors",
          "candidate_selector.successor_codebook.weight")
  def short_vocab(t):
    t["candidate_selector.successor_codebook"] = t["candidate_selector.successor_codebook"][:90]
  _expect(lambda: load_drafter(_tamper(base("c"), short_vocab)), "disagree", "90", str(VOCAB))
  folder = base("d")
  config = json.load(open(os.path.join(folder, "config.json")))
  config["vocab_size"] = 100
  json.dump(config, open(os.path.join(folder, "config.json"), "w"))
  _expect(lambda: load_drafter(folder), "vocab_size", "100")
  ds = _dspark()
  folder = save_drafter(tmp_path / "e", ds, _weights(ds, copies=True), "f32")
  _expect(lambda: load_drafter(_tamper(folder, lambda t: t.pop("lm_head.weight"))),
          "embed_tokens.weight", "both copies")
  folder = save_drafter(tmp_path / "f", ds, _weights(ds), "f32")
  _expect(lambda: load_drafter(_tamper(folder, lambda t: t.pop("confidence_head.proj.bias"))),
          "missing tensors", "confidence_head.proj.bias")
  _expect(lambda: save_drafter(tmp_path / "g", ds, {
      k: v for k, v in _weights(ds, copies=True).items() if k != "lm_head"}),
      "both target copies")


# ---------------------------------------------------------------------------------------------
# GGUF


def _rewrite_gguf(src, dst, drop=(), add=None, drop_tensors=()) -> str:
  """A copy of the GGUF at src without the keys `drop` / tensors `drop_tensors`, plus `add`
  {key: (value, type)}."""
  reader = gguf.GGUFReader(str(src))
  writer = gguf.GGUFWriter(str(dst), "dflash")
  for field in reader.fields.values():
    name = field.name
    if name.startswith("GGUF.") or name == "general.architecture" or name in drop:
      continue
    vtype = field.types[0]
    sub = field.types[-1] if vtype == VT.ARRAY else None
    writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
  for key, (value, vtype) in (add or {}).items():
    writer.add_key_value(key, value, vtype)
  for t in reader.tensors:
    if t.name not in drop_tensors:
      writer.add_tensor(t.name, np.asarray(t.data), raw_shape=tuple(reversed(t.shape.tolist())),
                        raw_dtype=t.tensor_type)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(dst)


GGUF_CASES = {"dflash2": _dflash2(scale=1.0), "dflash2-causal": _dflash2(True, scale=1.0),
              "dflash2-nocap": _dflash2(scale=1.0, cap=None), "dspark": _dspark(),
              "dspark-noconf-unshifted": _dspark(conf=False, anchor=False)}


@pytest.mark.parametrize("name", list(GGUF_CASES))
@pytest.mark.parametrize("copies", [False, True])
def test_gguf_round_trip_and_names(tmp_path, name, copies):
  cfg = GGUF_CASES[name]
  w = _weights(cfg, seed=3, copies=copies)
  path = save_drafter(tmp_path / "d.gguf", cfg, w)
  cfg2, w2 = load_drafter(path)
  assert cfg2 == cfg
  stored = cfg.family == "dspark" and copies
  _same({k: v for k, v in w.items() if stored or k not in ("tok_embd", "lm_head")}, w2)
  reader = gguf.GGUFReader(path)
  names = {t.name: t for t in reader.tensors}
  field = lambda k: None if reader.get_field(k) is None else reader.get_field(k).contents()
  if cfg.family == "dflash2":
    f = cfg.dflash2
    assert len(names) == 58 - 33 + 4 * 2 + 3 + 0   # 2 layers: 3 + 11 * 2 + 4 * 2 + 3
    assert names["blk.0.attn_conv_base"].tensor_type == QT.F32   # no .weight suffix
    assert {"blk.1.ffn_conv_proj.weight", "selector_predecessor.weight",
            "selector_successor.weight", "selector_hidden.weight"} <= set(names)
    assert (field("dflash.conv_kernel_size"), field("dflash.conv_group_size"),
            field("dflash.selector_rank"), field("dflash.selector_top_k")) == (2, 8, 8, 4)
    assert field("dflash.attention.causal") is f.is_causal
    assert field("dflash.logit_scale") == pytest.approx(0.5)
    assert field("dflash.final_logit_softcapping") == f.final_logit_softcapping
  else:
    assert {"markov_w1.weight", "markov_w2.weight"} <= set(names)
    assert ("conf_proj.weight" in names) == ("conf_proj.bias" in names) == \
        cfg.dspark.confidence_head
    assert field("dflash.sample_from_anchor") is cfg.dspark.sample_from_anchor
    assert field("dflash.has_confidence_head") is cfg.dspark.confidence_head
    assert ("token_embd.weight" in names) == ("output.weight" in names) == stored


@pytest.mark.parametrize("cfg,hf_type,gguf_type", [
    (D2, "f32", "F32"), (D2, "bf16", "BF16"), (DS, "f32", "F32"), (DS, "bf16", "Q8_0"),
    (DS, "f16", "F16")], ids=["d2-f32", "d2-bf16", "ds-f32", "ds-bf16-q8_0", "ds-f16"])
def test_hf_gguf_hf_round_trip(tmp_path, cfg, hf_type, gguf_type):
  """HF -> GGUF -> HF: the same config and, where the two formats keep the matrices' dtype,
  bitwise the same tensors and files; through Q8_0, GGUF's own quantization."""
  w = _weights(cfg, seed=4, copies=cfg.family == "dspark")
  first = save_drafter(tmp_path / "a", cfg, w, hf_type)
  cfg1, w1 = load_drafter(first)
  path = save_drafter(tmp_path / "a.gguf", cfg1, w1, gguf_type)
  cfg2, w2 = load_drafter(path)
  assert cfg2 == cfg1 == cfg
  if gguf_type == "Q8_0":
    qt = QT.Q8_0
    for k, v in w1.items():
      want = v if v.ndim != 2 else gguf.quants.dequantize(gguf.quants.quantize(v, qt), qt)
      np.testing.assert_array_equal(w2[k], want, err_msg=k)
    return
  _same(w1, w2)
  again = save_drafter(tmp_path / "b", cfg2, w2, hf_type)
  for f in ("config.json", "model.safetensors"):
    assert open(os.path.join(first, f), "rb").read() == open(os.path.join(again, f), "rb").read()
  second = save_drafter(tmp_path / "b.gguf", *load_drafter(again), tensor_type=gguf_type)
  assert open(path, "rb").read() == open(second, "rb").read()


@pytest.mark.parametrize("cfg,culprits", [
    (_dspark("gated", with_markov=False), ["'gated' has no GGUF form"]),
    (_dspark("rnn"), ["'rnn' has no GGUF form"]),
    (_dspark("vanilla", with_markov=False), ["without the Markov feature"]),
    (_dspark(None, conf=True, with_markov=False), ["without the Markov feature"]),
    (_dspark(None, conf=False), ["without a Markov head"]),
    (_dflash2(causal=(True, False), kinds="mixed", scale=1.0), ["differs between layers"]),
    (_dflash2(scale=1.5), ["input_embedding_scale is 1.5"]),
], ids=["gated", "rnn", "conf-without-markov", "conf-without-head", "no-heads", "mixed-causal",
        "embedding-scale"])
def test_gguf_refuses_what_it_cannot_say(tmp_path, cfg, culprits):
  path = tmp_path / "x.gguf"
  _expect(lambda: save_drafter(path, cfg, _weights(cfg)), "save_drafter", *culprits)
  assert not path.exists()
  assert os.path.isdir(save_drafter(tmp_path / "hf", cfg, _weights(cfg)))   # HF can


def test_gguf_load_errors(tmp_path):
  d2 = GGUF_CASES["dflash2"]
  good = save_drafter(tmp_path / "d2.gguf", d2, _weights(d2))
  bad = lambda name, **kw: _rewrite_gguf(good, tmp_path / name, **kw)
  _expect(lambda: load_drafter(bad("a.gguf", drop=("dflash.selector_rank",))),
          "dflash.selector_rank")
  _expect(lambda: load_drafter(bad("b.gguf", drop_tensors=("selector_hidden.weight",))),
          "no tensor 'selector_hidden.weight'")
  _expect(lambda: load_drafter(bad("c.gguf", drop=("dflash.selector_top_k",),
                                   add={"dflash.selector_top_k": (0, VT.UINT32)})),
          "skips the selector")
  _expect(lambda: load_drafter(bad("d.gguf", add={"dflash.embedding_scale": (2.0, VT.FLOAT32)})),
          "dflash.embedding_scale", "unverified")
  assert load_drafter(bad("e.gguf", add={"dflash.embedding_scale": (1.0, VT.FLOAT32)}))[0] == d2
  _expect(lambda: load_drafter(bad("f.gguf", drop_tensors=("selector_successor.weight",))),
          "missing tensors", "selector_successor.weight")
  ds = GGUF_CASES["dspark"]
  good = save_drafter(tmp_path / "ds.gguf", ds, _weights(ds))
  _expect(lambda: load_drafter(bad("g.gguf", drop_tensors=("conf_proj.weight", "conf_proj.bias"),
                                   drop=("dflash.has_confidence_head",),
                                   add={"dflash.has_confidence_head": (True, VT.BOOL)})),
          "dflash.has_confidence_head", "lacks conf_proj.weight")
  # Without the key, the tensor decides (llama.cpp's "assume present").
  cfg, _ = load_drafter(bad("h.gguf", drop=("dflash.has_confidence_head",
                                            "dflash.sample_from_anchor")))
  assert cfg == ds
  _expect(lambda: load_drafter(bad("i.gguf", add={"dflash.attention.causal": (True, VT.BOOL)})),
          "only DFlash2 drafters have causal blocks")
  _expect(lambda: load_drafter(bad("j.gguf", drop_tensors=("markov_w1.weight",
                                                           "markov_w2.weight"))),
          "without the Markov feature")
  plain = _rewrite_gguf(good, tmp_path / "k.gguf", drop_tensors=(
      "markov_w1.weight", "markov_w2.weight", "conf_proj.weight", "conf_proj.bias"))
  _expect(lambda: load_drafter(plain), "DSpark metadata", "dflash.sample_from_anchor")


def test_convert_cli_both_families(tmp_path, capsys):
  for cfg in (D2, DS):
    w = _weights(cfg, seed=5, copies=True)
    src = save_drafter(tmp_path / f"{cfg.family}", cfg, w, "bf16")
    dst = tmp_path / f"{cfg.family}.gguf"
    assert main(["convert", src, str(dst), "--type", "BF16"]) == 0
    assert main(["convert", str(dst), str(tmp_path / f"{cfg.family}-back"), "--type", "bf16"]) == 0
    cfg2, w2 = load_drafter(tmp_path / f"{cfg.family}-back")
    assert cfg2 == cfg
    _same(load_drafter(src)[1], w2)
  capsys.readouterr()
  gated = _dspark("gated", with_markov=False)
  src = save_drafter(tmp_path / "gated", gated, _weights(gated))
  assert main(["convert", src, str(tmp_path / "gated.gguf")]) == 2
  err = capsys.readouterr().err
  assert "argument DST:" in err and "no GGUF form" in err


def test_tensor_counts():
  assert len(drafter_tensor_shapes(D2, VOCAB)) == 3 + 11 * 2 + 4 * 2 + 3
  assert len(drafter_tensor_shapes(DFLASH2_CONFIG, 202048)) == 81
