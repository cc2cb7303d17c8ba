"""HF / z-lab checkpoints: safetensors I/O, config.json, drafter folders, GGUF <-> HF, convert."""
from __future__ import annotations

import dataclasses
import json
import os
import struct

import gguf
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dflash_jax.__main__ import main
from dflash_jax.config import FULL, QWEN3_8B_CONFIG, SLIDING, TINY_CONFIG, DFlashConfig
from dflash_jax.io import DrafterFormatError, load_drafter, save_drafter
from dflash_jax.io import safetensors as safetensors_io
from dflash_jax.io.errors import SafetensorsFormatError
from dflash_jax.io.hf import config_from_hf, config_to_hf, load_hf_drafter, save_hf_drafter
from dflash_jax.io.safetensors import read_tensors, write_tensors
from dflash_jax.synthetic import synthetic_drafter

QT = gguf.GGMLQuantizationType
MIXED = dataclasses.replace(TINY_CONFIG, layer_types=(SLIDING, FULL), context_length=4096)
# SPEC.md section 8, spelled out independently of io.hf: GGUF key -> HF tensor name.
LAYER_MAP = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(key: str) -> str:
  if key.startswith("blk."):
    _, i, suffix = key.split(".", 2)
    return f"layers.{i}.{LAYER_MAP[suffix]}.weight"
  return {"fc": "fc", "enc.output_norm": "hidden_norm", "output_norm": "norm"}[key] + ".weight"


def _drafter(seed: int, cfg: DFlashConfig = TINY_CONFIG) -> dict:
  return synthetic_drafter(cfg, seed, with_target=False)


def _tiny_hf_config(**overrides) -> dict:
  """A z-lab-style config.json for TINY_CONFIG's dims, written by hand."""
  config = {
      "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000,
      "block_size": 8, "hidden_act": "silu", "attention_bias": False,
      "dflash_config": {"target_layer_ids": [0, 2, 4], "mask_token_id": 7},
      "layer_types": ["sliding_attention"] * 2, "sliding_window": 32, "use_sliding_window": True,
      "num_target_layers": 6, "dtype": "bfloat16",
  }
  config.update(overrides)
  return config


def _zlab_folder(path, w: dict, config: dict | None = None, dtype=ml_dtypes.bfloat16) -> str:
  """An HF folder as z-lab ships it (every tensor bf16, norms too), without io.hf."""
  os.makedirs(path, exist_ok=True)
  save_file({_hf_name(k): np.ascontiguousarray(a.astype(dtype)) for k, a in w.items()},
            os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(_tiny_hf_config() if config is None else config, f)
  return str(path)


def _expect(fn, *culprits: str, error=DrafterFormatError) -> str:
  with pytest.raises(error) as info:
    fn()
  msg = str(info.value)
  for c in culprits:
    assert c in msg, (c, msg)
  return msg


# ---------------------------------------------------------------------------------------------
# io.safetensors


def _random_tensors(seed: int) -> dict:
  rng = np.random.default_rng(seed)
  return {
      "a.f32": rng.standard_normal((5, 7), dtype=np.float32),
      "b.f16": rng.standard_normal((3, 4)).astype(np.float16),
      "c.bf16": rng.standard_normal((6,)).astype(ml_dtypes.bfloat16),
      "d.i32": rng.integers(-9, 9, (2, 3), dtype=np.int32),
      "e.empty": np.zeros((0, 4), np.float32),
  }


def test_write_read_single_and_sharded(tmp_path):
  t = _random_tensors(0)
  path = write_tensors(tmp_path / "one", t, dtype=None)
  assert os.path.basename(path) == "model.safetensors"
  for where in (tmp_path / "one", path):
    back = read_tensors(where)
    assert set(back) == set(t)
    for name, a in t.items():
      assert back[name].dtype == a.dtype and back[name].shape == a.shape, name
      assert back[name].flags.writeable and back[name].flags.c_contiguous
      np.testing.assert_array_equal(back[name].astype(np.float64), a.astype(np.float64))
  index = write_tensors(tmp_path / "sh", t, dtype=None, max_shard_bytes=40)
  folder = os.path.dirname(index)
  shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
  assert len(shards) == 3 and shards[0] == "model-00001-of-00003.safetensors"
  weight_map = json.load(open(index))["weight_map"]
  assert set(weight_map) == set(t) and set(weight_map.values()) == set(shards)
  for shard in shards:   # no shard over the bound unless one tensor alone is larger
    names = [n for n, s in weight_map.items() if s == shard]
    assert len(names) == 1 or sum(t[n].nbytes for n in names) <= 40, (shard, names)
  back = read_tensors(folder)
  for name, a in t.items():
    np.testing.assert_array_equal(back[name].astype(np.float64), a.astype(np.float64))
  assert set(read_tensors(index, names=["d.i32"])) == {"d.i32"}
  _expect(lambda: read_tensors(folder, names=["nope"]), "nope", error=SafetensorsFormatError)


def test_writing_one_layout_removes_the_other(tmp_path):
  t = _random_tensors(1)
  write_tensors(tmp_path, t, dtype=None, max_shard_bytes=40)
  write_tensors(tmp_path, t, dtype=None)
  assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
  write_tensors(tmp_path, t, dtype=None, max_shard_bytes=40)
  assert "model.safetensors" not in os.listdir(tmp_path)
  assert sorted(os.listdir(tmp_path))[-1] == "model.safetensors.index.json"


def test_cast_rounds_like_gguf_and_names_overflow(tmp_path):
  a = np.random.default_rng(2).standard_normal((8, 32), dtype=np.float32)
  for dtype, qtype in (("bf16", QT.BF16), ("f16", QT.F16)):
    write_tensors(tmp_path / dtype, {"w": a}, dtype=dtype)
    back = read_tensors(tmp_path / dtype)["w"].astype(np.float32)
    expect = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
    np.testing.assert_array_equal(back, expect)
  big = a.copy()
  big[1, 2] = 1e5
  _expect(lambda: write_tensors(tmp_path / "x", {"big": big}, dtype="f16"), "'big'", "f16",
          error=ValueError)
  _expect(lambda: write_tensors(tmp_path / "x", {"i": np.arange(3)}, dtype="bf16"), "'i'",
          error=ValueError)
  assert not os.path.exists(tmp_path / "x")


def test_failed_write_keeps_old_checkpoint(tmp_path, monkeypatch):
  write_tensors(tmp_path, _random_tensors(3), dtype=None, max_shard_bytes=40)
  before = {f: open(tmp_path / f, "rb").read() for f in os.listdir(tmp_path)}
  real, calls = safetensors_io.st_numpy.save_file, []

  def second_fails(tensors, filename, metadata=None):
    calls.append(filename)
    if len(calls) == 2:
      open(filename, "wb").write(b"partial")
      raise OSError("disk full")
    real(tensors, filename, metadata=metadata)

  monkeypatch.setattr(safetensors_io.st_numpy, "save_file", second_fails)
  with pytest.raises(OSError, match="disk full"):
    write_tensors(tmp_path, _random_tensors(4), dtype=None, max_shard_bytes=40)
  assert {f: open(tmp_path / f, "rb").read() for f in os.listdir(tmp_path)} == before


def _header(path) -> tuple[dict, bytes]:
  raw = open(path, "rb").read()
  (n,) = struct.unpack("<Q", raw[:8])
  return json.loads(raw[8:8 + n]), raw[8 + n:]


def _pack(header: dict, data: bytes) -> bytes:
  h = json.dumps(header).encode()
  return struct.pack("<Q", len(h)) + h + data


def _edit(key, field, value):
  def edit(header, data):
    header[key][field] = value
    return _pack(header, data)
  return edit


HOSTILE = {
    "empty": (lambda h, d: b"", ["too short"]),
    "cut_in_data": (lambda h, d: _pack(h, d[:-3]), ["'b'", "truncated"]),
    "cut_in_header": (lambda h, d: _pack(h, d)[:40], ["header length", "past the end"]),
    "length_2_64": (lambda h, d: b"\xff" * 8 + _pack(h, d)[8:], ["18446744073709551615"]),
    "not_json": (lambda h, d: struct.pack("<Q", 4) + b"\x00{[x" + d, ["not valid JSON"]),
    "json_list": (lambda h, d: _pack([1, 2], b""), ["not a JSON object"]),
    "deep_json": (lambda h, d: struct.pack("<Q", 200000) + b"[" * 200000, ["not valid JSON"]),
    "dtype": (_edit("a", "dtype", "F8_E4M3"), ["'a'", "F8_E4M3"]),
    "neg_shape": (_edit("a", "shape", [-2, 3]), ["'a'", "shape"]),
    "bad_offsets": (_edit("a", "data_offsets", [24, 0]), ["'a'", "data_offsets"]),
    "span": (_edit("a", "shape", [2, 2]), ["'a'", "span 24", "needs 16"]),
    "past_end": (_edit("b", "data_offsets", [10 ** 15, 10 ** 15 + 8]), ["'b'"]),
    "overlap": (_edit("b", "data_offsets", [20, 28]), ["'b'", "overlaps", "'a'"]),
    "gap": (lambda h, d: _edit("b", "data_offsets", [28, 36])(h, d + b"\0" * 4),
            ["'b'", "gap"]),
    "trailing": (lambda h, d: _pack(h, d + b"\0" * 8), ["trailing"]),
    "extra_field": (_edit("a", "note", 1), ["'a'", "exactly dtype"]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_or_truncated_file(tmp_path, case):
  good = write_tensors(tmp_path / "good", {"a": np.ones((2, 3), np.float32),
                                           "b": np.ones((4,), np.float16)}, dtype=None)
  make, culprits = HOSTILE[case]
  path = tmp_path / f"{case}.safetensors"
  path.write_bytes(make(*_header(good)))
  msg = _expect(lambda: read_tensors(path), *culprits, error=SafetensorsFormatError)
  assert str(path) in msg


def test_header_bound(tmp_path):
  """A header length over MAX_HEADER_BYTES is refused before it is read (a sparse file long
  enough that the length does not run past its end)."""
  n = safetensors_io.MAX_HEADER_BYTES + 1
  path = tmp_path / "big_header.safetensors"
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", n))
    f.truncate(8 + n)
  _expect(lambda: read_tensors(path), f"header length {n} is over the "
          f"{safetensors_io.MAX_HEADER_BYTES}-byte bound", error=SafetensorsFormatError)


def _sharded(tmp_path) -> tuple[str, dict]:
  index = write_tensors(tmp_path, _random_tensors(5), dtype=None, max_shard_bytes=40)
  return index, json.load(open(index))


def _rewrite_index(path, index: dict) -> None:
  with open(path, "w") as f:
    json.dump(index, f)


def test_bad_index(tmp_path):
  index, good = _sharded(tmp_path)
  shard1 = "model-00001-of-00003.safetensors"
  bad = json.loads(json.dumps(good))
  bad["weight_map"]["a.f32"] = "model-00009-of-00009.safetensors"
  _rewrite_index(index, bad)
  _expect(lambda: read_tensors(tmp_path), "'a.f32'", "does not exist",
          error=SafetensorsFormatError)
  bad["weight_map"]["a.f32"] = "../" + shard1
  _rewrite_index(index, bad)
  _expect(lambda: read_tensors(tmp_path), "not a shard file name", error=SafetensorsFormatError)
  # Shards (max 40 bytes): [a.f32 140 bytes], [b.f16, c.bf16], [d.i32, e.empty].
  assert [good["weight_map"][n][:11] for n in sorted(good["weight_map"])] == \
      ["model-00001", "model-00002", "model-00002", "model-00003", "model-00003"]
  ghost = json.loads(json.dumps(good))
  ghost["weight_map"]["z.ghost"] = "model-00002-of-00003.safetensors"
  _rewrite_index(index, ghost)
  _expect(lambda: read_tensors(tmp_path), "'z.ghost'", "model-00002-of-00003.safetensors",
          "does not hold it", error=SafetensorsFormatError)
  moved = json.loads(json.dumps(good))
  moved["weight_map"]["b.f16"] = "model-00003-of-00003.safetensors"   # shard 2 still used
  _rewrite_index(index, moved)
  _expect(lambda: read_tensors(tmp_path), "'b.f16'", "stored in model-00002-of-00003",
          error=SafetensorsFormatError)
  unlisted = json.loads(json.dumps(good))
  del unlisted["weight_map"]["b.f16"]
  _rewrite_index(index, unlisted)
  _expect(lambda: read_tensors(tmp_path), "b.f16", "not in the weight_map",
          error=SafetensorsFormatError)
  del unlisted["weight_map"]["a.f32"]
  _rewrite_index(index, unlisted)
  _expect(lambda: read_tensors(tmp_path), "model-00001-of-00003.safetensors", "of 3",
          error=SafetensorsFormatError)
  _rewrite_index(index, {"metadata": {}})
  _expect(lambda: read_tensors(tmp_path), "weight_map", error=SafetensorsFormatError)
  index_path = tmp_path / "model.safetensors.index.json"
  index_path.write_text("{not json")
  _expect(lambda: read_tensors(tmp_path), "not valid JSON", error=SafetensorsFormatError)


def test_tensor_in_two_shards_and_ambiguous_folder(tmp_path):
  index, good = _sharded(tmp_path)
  first = good["weight_map"]["a.f32"]
  last = max(set(good["weight_map"].values()))
  dup = read_tensors(tmp_path / last)
  dup["a.f32"] = np.ones((5, 7), np.float32)
  save_file(dup, str(tmp_path / last))
  msg = _expect(lambda: read_tensors(tmp_path), "'a.f32'", "two shards",
                error=SafetensorsFormatError)
  assert first in msg and last in msg
  _rewrite_index(index, good)
  write_tensors(tmp_path / "x", {"a": np.ones(2, np.float32)}, dtype=None)
  os.replace(tmp_path / "x" / "model.safetensors", tmp_path / "model.safetensors")
  _expect(lambda: read_tensors(tmp_path), "both", "ambiguous", error=SafetensorsFormatError)


# ---------------------------------------------------------------------------------------------
# config.json


def _zlab_qwen3_8b() -> dict:
  """z-lab/Qwen3-8B-DFlash-b16's config.json (the fields that matter, as published)."""
  return {
      "architectures": ["DFlashDraftModel"], "attention_bias": False, "block_size": 16,
      "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
      "dtype": "bfloat16", "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
      "intermediate_size": 12288, "layer_types": ["full_attention"] * 5,
      "max_position_embeddings": 40960, "max_window_layers": 5, "model_type": "qwen3",
      "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8,
      "num_target_layers": 36, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
      "sliding_window": None, "use_sliding_window": False, "vocab_size": 151936,
  }


def test_zlab_qwen3_8b_config(tmp_path):
  expect = DFlashConfig(n_layer=5, n_embd=4096, n_ff=12288, n_head=32, n_head_kv=8,
                        head_dim=128, rope_theta=1e6, eps=1e-6, target_layers=(2, 10, 18, 26, 34),
                        mask_token_id=151669, block_size=16, window=None,
                        layer_types=(FULL,) * 5, context_length=40960)
  assert config_from_hf(_zlab_qwen3_8b()) == expect == QWEN3_8B_CONFIG   # the library's preset
  path = tmp_path / "config.json"
  path.write_text(json.dumps(_zlab_qwen3_8b()))
  assert config_from_hf(str(path)) == expect
  assert config_from_hf(config_to_hf(expect)) == expect


def test_mixed_kinds_config():
  """A Qwen3.6-27B-style drafter: 4 sliding layers and a full one, window 2048, rope in
  transformers 5's rope_parameters, block_size inside dflash_config."""
  config = {
      "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 5120,
      "intermediate_size": 17408, "num_hidden_layers": 5, "num_attention_heads": 24,
      "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
      "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
      "dflash_config": {"block_size": 16, "mask_token_id": 248070,
                        "target_layer_ids": [1, 16, 31, 46, 61]},
      "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "sliding_window": 2048,
      "use_sliding_window": True, "max_position_embeddings": 262144, "num_target_layers": 64,
  }
  cfg = config_from_hf(config)
  assert cfg.layer_types == (SLIDING,) * 4 + (FULL,) and cfg.window == 2048
  assert cfg.target_layers == (2, 17, 32, 47, 62) and cfg.rope_theta == 1e7
  assert cfg.context_length == 262144 and cfg.block_size == 16 and cfg.head_dim == 256
  assert config_from_hf(config_to_hf(cfg)) == cfg


@pytest.mark.parametrize("block", [10, 7])
def test_block_10_and_block_7_configs(block):
  """z-lab's LLaMA-3.1-8B drafter (block 10) and DeepSpec's Qwen3 drafters (block 7, ids and
  mask token at the top level, rope_parameters)."""
  if block == 10:
    config = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 5,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "block_size": 10,
              "dflash_config": {"target_layer_ids": [1, 8, 15, 22, 29], "mask_token_id": 128002},
              "layer_types": ["full_attention"] * 5, "num_target_layers": 32}
    ids = (2, 9, 16, 23, 30)
  else:
    config = {"architectures": ["Qwen3DSparkModel"], "block_size": 7, "hidden_size": 2560,
              "intermediate_size": 9728, "num_hidden_layers": 5, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
              "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
              "target_layer_ids": [1, 9, 17, 25, 33], "mask_token_id": 151669,
              "layer_types": ["full_attention"] * 5, "max_position_embeddings": 40960,
              "num_target_layers": 36, "use_sliding_window": False}
    ids = (2, 10, 18, 26, 34)
  cfg = config_from_hf(config)
  assert cfg.block_size == block and cfg.target_layers == ids
  assert cfg.layer_types == (FULL,) * 5 and cfg.window is None
  assert config_from_hf(config_to_hf(cfg)) == cfg


def test_layer_types_absent_follow_qwen3_rule():
  base = _tiny_hf_config()
  del base["layer_types"]
  assert config_from_hf(base).layer_types == (FULL, FULL)   # max_window_layers defaults to 28
  cfg = config_from_hf(dict(base, max_window_layers=1))
  assert cfg.layer_types == (FULL, SLIDING) and cfg.window == 32
  cfg = config_from_hf(dict(base, use_sliding_window=False, max_window_layers=0))
  assert cfg.layer_types == (FULL, FULL) and cfg.window is None


@pytest.mark.parametrize("key", ["hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "rms_norm_eps", "rope_theta"])
def test_missing_config_key(tmp_path, key):
  config = _tiny_hf_config()
  del config[key]
  folder = _zlab_folder(tmp_path, _drafter(seed=6), config)
  msg = _expect(lambda: load_drafter(folder), key)
  assert os.path.join(folder, "config.json") in msg


@pytest.mark.parametrize("key", ["mask_token_id", "target_layer_ids"])
def test_missing_dflash_key(tmp_path, key):
  config = _tiny_hf_config()
  del config["dflash_config"][key]
  folder = _zlab_folder(tmp_path, _drafter(seed=7), config)
  _expect(lambda: load_drafter(folder), f"dflash_config.{key}", "config.json")


@pytest.mark.parametrize("change,culprit", [
    (dict(block_size=16, dflash_config={"block_size": 8, "target_layer_ids": [0, 2, 4],
                                        "mask_token_id": 7}), "disagrees"),
    (dict(num_target_layers=4), "num_target_layers is 4"),
    (dict(sliding_window=None), "sliding_window is not set"),
    (dict(use_sliding_window=False), "use_sliding_window is false"),
    (dict(layer_types=["sliding_attention"]), "layer_types"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
     "rope_scaling.rope_type 'dynamic' is not supported"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "needs original_max_position_embeddings"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (dict(rope_parameters={"rope_theta": 500000}), "disagree"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(is_causal=True), "non-causal"),
    (dict(hidden_size="64"), "hidden_size is '64'"),
    (dict(num_attention_heads=3), "multiple of n_head_kv"),
])
def test_bad_config(change, culprit):
  _expect(lambda: config_from_hf(_tiny_hf_config(**change)), culprit, "config.json")


def test_config_to_hf_refuses_what_hf_cannot_say():
  with pytest.raises(ValueError, match="no window"):
    config_to_hf(dataclasses.replace(TINY_CONFIG, window=None))
  with pytest.raises(ValueError, match="target_layers"):
    config_to_hf(dataclasses.replace(TINY_CONFIG, target_layers=(0, 3)))
  full = dataclasses.replace(TINY_CONFIG, window=None, layer_types=(FULL, FULL))
  assert config_from_hf(config_to_hf(full)) == full


# ---------------------------------------------------------------------------------------------
# Drafter folders


@pytest.mark.parametrize("sharded", [False, True])
def test_zlab_folder_loads(tmp_path, sharded):
  w = _drafter(seed=8)
  folder = _zlab_folder(tmp_path / "d", w)
  if sharded:   # re-shard the same tensors the way HF does, with an index
    tensors = read_tensors(folder)
    os.unlink(os.path.join(folder, "model.safetensors"))
    write_tensors(folder, tensors, dtype=None, max_shard_bytes=20000)
    assert len([f for f in os.listdir(folder) if f.startswith("model-")]) > 2
  for where in (folder, os.path.join(folder, "config.json"),
                os.path.join(folder, "model.safetensors.index.json" if sharded else
                             "model.safetensors")):
    cfg, w2 = load_drafter(where)
    assert cfg == TINY_CONFIG
    assert set(w2) == set(w)
    for key, a in w.items():
      expect = a.astype(ml_dtypes.bfloat16).astype(np.float32)
      assert w2[key].dtype == np.float32 and w2[key].flags.writeable, key
      np.testing.assert_array_equal(w2[key], expect, err_msg=key)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_save_hf_drafter(tmp_path, dtype):
  w = synthetic_drafter(MIXED, 9, with_target=True)
  folder = save_hf_drafter(tmp_path / "d", MIXED, w, dtype=dtype)
  assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
  specs = safetensors_io.tensor_specs(folder)
  drafter = {k: a for k, a in w.items() if k not in ("tok_embd", "lm_head")}
  assert set(specs) == {_hf_name(k) for k in drafter}
  stored = {"f32": "F32", "f16": "F16", "bf16": "BF16"}[dtype]
  for key, a in drafter.items():
    spec = specs[_hf_name(key)]
    assert spec.shape == a.shape and spec.dtype == ("F32" if a.ndim == 1 else stored), key
  cfg, w2 = load_hf_drafter(folder)
  assert cfg == MIXED
  qtype = QT[stored]
  for key, a in drafter.items():
    expect = a if a.ndim == 1 else gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
    np.testing.assert_array_equal(w2[key], expect, err_msg=key)
  config = json.load(open(os.path.join(folder, "config.json")))
  assert config["dflash_config"] == {"target_layer_ids": [0, 2, 4], "mask_token_id": 7}
  assert config["layer_types"] == ["sliding_attention", "full_attention"]
  assert config["sliding_window"] == 32 and config["max_position_embeddings"] == 4096


def test_save_hf_drafter_sharded_and_failures(tmp_path):
  w = _drafter(seed=10)
  folder = save_hf_drafter(tmp_path / "sh", TINY_CONFIG, w, dtype="f32", max_shard_bytes=30000)
  assert "model.safetensors.index.json" in os.listdir(folder)
  cfg, w2 = load_drafter(folder)
  assert cfg == TINY_CONFIG and all(np.array_equal(w2[k], w[k]) for k in w)
  out = tmp_path / "none"
  bad = dict(w, **{"blk.0.attn_q": w["blk.0.attn_q"][:, :8]})
  _expect(lambda: save_hf_drafter(out, TINY_CONFIG, bad), "blk.0.attn_q", "shape")
  big = dict(w, fc=w["fc"] * 1e6)
  _expect(lambda: save_hf_drafter(out, TINY_CONFIG, big, dtype="f16"), "fc.weight", "overflows")
  _expect(lambda: save_drafter(out, TINY_CONFIG, w, "Q8_0"), "dtype", error=ValueError)
  _expect(lambda: save_hf_drafter(out, dataclasses.replace(TINY_CONFIG, window=None), w),
          "no window")
  assert not out.exists()


def test_missing_and_extra_tensors(tmp_path):
  w = _drafter(seed=11)
  folder = _zlab_folder(tmp_path / "a", w)
  tensors = read_tensors(folder)
  del tensors["layers.1.mlp.up_proj.weight"]
  save_file(tensors, os.path.join(folder, "model.safetensors"))
  _expect(lambda: load_drafter(folder), "missing tensors", "layers.1.mlp.up_proj.weight")
  tensors = read_tensors(_zlab_folder(tmp_path / "b", w))
  tensors["layers.0.self_attn.q_proj.bias"] = np.ones(64, np.float32)
  save_file(tensors, str(tmp_path / "b" / "model.safetensors"))
  _expect(lambda: load_drafter(tmp_path / "b"), "unknown tensors",
          "layers.0.self_attn.q_proj.bias", "model.safetensors")
  prefixed = {"model." + k: v for k, v in read_tensors(_zlab_folder(tmp_path / "c", w)).items()}
  save_file(prefixed, str(tmp_path / "c" / "model.safetensors"))
  _expect(lambda: load_drafter(tmp_path / "c"), "unknown tensors", "'model.' prefix")


def test_wrong_shape_dtype_non_finite(tmp_path):
  w = _drafter(seed=12)
  tensors = read_tensors(_zlab_folder(tmp_path / "a", w))
  tensors["layers.0.self_attn.k_proj.weight"] = np.ones((64, 64), ml_dtypes.bfloat16)
  save_file(tensors, str(tmp_path / "a" / "model.safetensors"))
  msg = _expect(lambda: load_drafter(tmp_path / "a"), "layers.0.self_attn.k_proj.weight",
                "(64, 64)", "expected (32, 64)")
  assert str(tmp_path / "a" / "model.safetensors") in msg
  tensors = read_tensors(_zlab_folder(tmp_path / "b", w))
  tensors["norm.weight"] = np.ones(64, np.int32)
  save_file(tensors, str(tmp_path / "b" / "model.safetensors"))
  _expect(lambda: load_drafter(tmp_path / "b"), "norm.weight", "I32")
  tensors = read_tensors(_zlab_folder(tmp_path / "c", w))
  tensors["layers.1.mlp.gate_proj.weight"][3, 5] = np.inf
  save_file(tensors, str(tmp_path / "c" / "model.safetensors"))
  _expect(lambda: load_drafter(tmp_path / "c"), "layers.1.mlp.gate_proj.weight", "non-finite",
          "(3, 5)")


def test_truncated_and_hostile_drafter_files(tmp_path):
  folder = _zlab_folder(tmp_path / "a", _drafter(seed=13))
  path = os.path.join(folder, "model.safetensors")
  data = open(path, "rb").read()
  header, _ = _header(path)
  header.pop("__metadata__", None)
  last = max(header, key=lambda n: header[n]["data_offsets"][1])
  open(path, "wb").write(data[:-100])
  _expect(lambda: load_drafter(folder), "truncated", path, repr(last))
  open(path, "wb").write(b"\x00" * 7 + data[7:])
  _expect(lambda: load_drafter(folder), path)


def test_not_a_drafter_folder(tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  _expect(lambda: load_drafter(empty), "no config.json", str(empty))
  qwen = _tiny_hf_config()
  del qwen["dflash_config"]
  folder = _zlab_folder(tmp_path / "qwen", _drafter(seed=14), qwen)
  _expect(lambda: load_drafter(folder), "not a DFlash drafter", "config.json")
  only_config = tmp_path / "cfg"
  only_config.mkdir()
  (only_config / "config.json").write_text(json.dumps(_tiny_hf_config()))
  _expect(lambda: load_drafter(only_config), "no model.safetensors")
  (only_config / "config.json").write_text("[1, 2")
  _expect(lambda: load_drafter(only_config), "not valid JSON")
  with pytest.raises(FileNotFoundError, match="nothere"):
    load_drafter(tmp_path / "nothere" / "config.json")


# ---------------------------------------------------------------------------------------------
# GGUF <-> HF


@pytest.mark.parametrize("gguf_type,hf_type", [("F32", "f32"), ("BF16", "bf16"), ("F16", "f16")])
def test_gguf_hf_gguf_bit_exact(tmp_path, gguf_type, hf_type):
  w = _drafter(seed=15, cfg=MIXED)
  first = save_drafter(tmp_path / "a.gguf", MIXED, w, gguf_type)
  cfg, w1 = load_drafter(first)
  folder = save_drafter(tmp_path / "hf", cfg, w1, hf_type)
  cfg2, w2 = load_drafter(folder)
  assert cfg2 == cfg == MIXED
  assert all(np.array_equal(w1[k], w2[k]) for k in w1)
  second = save_drafter(tmp_path / "b.gguf", cfg2, w2, gguf_type)
  assert open(first, "rb").read() == open(second, "rb").read()
  again = save_drafter(tmp_path / "hf2", *load_drafter(second), tensor_type=hf_type.upper())
  for f in ("config.json", "model.safetensors"):
    assert open(os.path.join(folder, f), "rb").read() == open(os.path.join(again, f), "rb").read()


def test_save_drafter_format_choice(tmp_path):
  w = _drafter(seed=16)
  assert os.path.isfile(save_drafter(tmp_path / "x.gguf", TINY_CONFIG, w))
  assert os.path.isdir(save_drafter(tmp_path / "x", TINY_CONFIG, w))
  path = save_drafter(tmp_path / "y.gguf", TINY_CONFIG, w, "bf16", format="hf")
  assert os.path.isfile(os.path.join(path, "config.json"))
  with pytest.raises(ValueError, match="format"):
    save_drafter(tmp_path / "z", TINY_CONFIG, w, format="onnx")


# ---------------------------------------------------------------------------------------------
# python -m dflash_jax convert


def _one_line_error(capsys, argument: str) -> str:
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "Traceback" not in err, err
  assert f"argument {argument}:" in err, err
  return err


def test_convert_cli(tmp_path, capsys):
  w = _drafter(seed=17, cfg=MIXED)
  src = save_drafter(tmp_path / "a.gguf", MIXED, w, "BF16")
  assert main(["convert", src, str(tmp_path / "hf"), "--type", "bf16"]) == 0
  assert "hf, bf16" in capsys.readouterr().out
  assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "b.gguf"), "--type", "BF16"]) == 0
  assert open(src, "rb").read() == open(tmp_path / "b.gguf", "rb").read()
  assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "c.gguf")]) == 0   # default F32
  cfg, w3 = load_drafter(tmp_path / "c.gguf")
  assert cfg == MIXED and all(np.array_equal(w3[k], load_drafter(src)[1][k]) for k in w3)

  assert main(["convert", src, str(tmp_path / "q"), "--type", "Q8_0"]) == 2
  assert "f32, f16, bf16" in _one_line_error(capsys, "--type")
  assert main(["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "d.gguf")]) == 2
  assert "missing.gguf" in _one_line_error(capsys, "SRC")
  # A GGUF without a sliding window is full attention on every layer (docs/SPEC.md section
  # 2), and its HF form says the same: nothing to choose at conversion.
  full = dataclasses.replace(TINY_CONFIG, window=None, layer_types=(FULL, FULL))
  nowin = save_drafter(tmp_path / "nowin.gguf", full, _drafter(seed=18))
  assert main(["convert", nowin, str(tmp_path / "hf2")]) == 0
  assert load_drafter(tmp_path / "hf2")[0] == load_drafter(nowin)[0] == full
