"""Drafter GGUF I/O: round trips, every type gguf can dequantize, and every loud failure."""
from __future__ import annotations

import dataclasses
import os
import tempfile

import gguf
import numpy as np
import pytest

from dflash_jax.config import FULL, SLIDING, TINY_CONFIG, DFlashConfig, drafter_tensor_shapes
from dflash_jax.io import DrafterFormatError, load_drafter, read_q8_0, save_drafter
from dflash_jax.synthetic import synthetic_drafter

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType
SAVE_TYPES = ("F32", "F16", "BF16", "Q8_0")
# Every matrix input width is a multiple of 256, so K-quants (256-blocks) fit every matrix.
K_CONFIG = DFlashConfig(n_layer=1, n_embd=256, n_ff=256, n_head=4, n_head_kv=2, head_dim=64,
                        rope_theta=1e6, eps=1e-5, target_layers=(2, 5), mask_token_id=3,
                        window=256)
# Byte range of the f16 scales in one block of each K-quant: random bytes there could be NaN/Inf.
K_SCALE_BYTES = {QT.Q2_K: (80, 84), QT.Q3_K: (108, 110), QT.Q4_K: (0, 4), QT.Q5_K: (0, 4),
                 QT.Q6_K: (208, 210)}


class _Writer(gguf.GGUFWriter):
  """GGUFWriter that can also write an empty array (to build an empty target_layers)."""

  def _pack_val(self, val, vtype, add_vtype, sub_type=None):
    if vtype == VT.ARRAY and len(val) == 0:
      return self._pack("I", vtype) + self._pack("I", sub_type) + self._pack("Q", 0)
    return super()._pack_val(val, vtype, add_vtype, sub_type)


def _kv(cfg: DFlashConfig, mask_key: str = "tokenizer.ggml.mask_token_id") -> dict:
  """The metadata of SPEC.md section 2, spelled out independently of io.gguf."""
  kv = {
      "dflash.block_count": (cfg.n_layer, VT.UINT32),
      "dflash.embedding_length": (cfg.n_embd, VT.UINT32),
      "dflash.feed_forward_length": (cfg.n_ff, VT.UINT32),
      "dflash.attention.head_count": (cfg.n_head, VT.UINT32),
      "dflash.attention.head_count_kv": (cfg.n_head_kv, VT.UINT32),
      "dflash.attention.key_length": (cfg.head_dim, VT.UINT32),
      "dflash.attention.value_length": (cfg.head_dim, VT.UINT32),
      "dflash.rope.freq_base": (cfg.rope_theta, VT.FLOAT32),
      "dflash.attention.layer_norm_rms_epsilon": (cfg.eps, VT.FLOAT32),
      "dflash.target_layers": (list(cfg.target_layers), VT.ARRAY, VT.INT32),
      "dflash.block_size": (cfg.block_size, VT.UINT32),
      mask_key: (cfg.mask_token_id, VT.UINT32),
  }
  if cfg.window is not None:
    kv["dflash.attention.sliding_window"] = (cfg.window, VT.UINT32)
  return kv


def _tensors(w: dict, matrix_type=QT.F32) -> dict:
  """GGUF tensor name -> (data, type): matrices in `matrix_type`, norms F32."""
  out = {}
  for name, a in w.items():
    qtype = QT.F32 if a.ndim == 1 else matrix_type
    out[name + ".weight"] = (gguf.quants.quantize(a, qtype), qtype)
  return out


def _write(path, kv: dict, tensors: dict, arch: str = "dflash") -> str:
  writer = _Writer(str(path), arch)
  for key, (value, vtype, *sub) in kv.items():
    writer.add_key_value(key, value, vtype, sub_type=sub[0] if sub else None)
  for name, (data, qtype) in tensors.items():
    writer.add_tensor(name, data, raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


def _drafter(seed: int = 0, cfg: DFlashConfig = TINY_CONFIG) -> dict:
  return synthetic_drafter(cfg, seed, with_target=False)


def _expect_error(path, *culprits: str) -> str:
  with pytest.raises(DrafterFormatError) as info:
    load_drafter(path)
  msg = str(info.value)
  assert str(path) in msg, msg
  for c in culprits:
    assert c in msg, (c, msg)
  return msg


# ---------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("tensor_type", SAVE_TYPES)
def test_round_trip(tmp_path, tensor_type):
  w = _drafter(seed=1)
  path = save_drafter(tmp_path / f"d_{tensor_type}.gguf", TINY_CONFIG, w, tensor_type)
  cfg, w2 = load_drafter(path)
  assert cfg == TINY_CONFIG
  assert set(w2) == set(drafter_tensor_shapes(TINY_CONFIG))
  qtype = QT[tensor_type]
  for name, a in w.items():
    b = w2[name]
    assert type(b) is np.ndarray and b.dtype == np.float32 and b.shape == a.shape
    assert b.flags.c_contiguous and b.flags.writeable
    if a.ndim == 1 or qtype == QT.F32:
      np.testing.assert_array_equal(b, a, err_msg=name)
    else:
      expect = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
      np.testing.assert_array_equal(b, expect, err_msg=name)
      assert not np.array_equal(b, a), f"{name}: {tensor_type} should round"
  reader = gguf.GGUFReader(path)
  types = {t.name: t.tensor_type for t in reader.tensors}
  assert types["fc.weight"] == qtype and types["blk.1.ffn_down.weight"] == qtype
  assert types["blk.0.attn_q_norm.weight"] == QT.F32 and types["output_norm.weight"] == QT.F32
  layers = reader.get_field("dflash.target_layers")
  assert layers.types == [VT.ARRAY, VT.INT32] and layers.contents() == [1, 3, 5]
  assert reader.get_field("tokenizer.ggml.mask_token_id").contents() == 7
  assert reader.get_field("dflash.attention.sliding_window").contents() == 32


def test_loaded_arrays_are_private_copies(tmp_path):
  w = _drafter(seed=2)
  path = save_drafter(tmp_path / "d.gguf", TINY_CONFIG, w)
  _, w2 = load_drafter(path)
  w2["fc"][0, 0] += 1.0  # would raise on a read-only memmap view
  assert not any(np.may_share_memory(a, b) for a in w2.values() for b in w2.values() if a is not b)
  _, w3 = load_drafter(path)
  assert w3["fc"][0, 0] == w["fc"][0, 0]


def test_target_tensors_are_not_written(tmp_path):
  w = synthetic_drafter(TINY_CONFIG, 3, with_target=True)
  assert "tok_embd" in w and "lm_head" in w
  with_target = save_drafter(tmp_path / "a.gguf", TINY_CONFIG, w)
  drafter_only = {k: v for k, v in w.items() if k not in ("tok_embd", "lm_head")}
  without = save_drafter(tmp_path / "b.gguf", TINY_CONFIG, drafter_only)
  with open(with_target, "rb") as f, open(without, "rb") as g:
    assert f.read() == g.read()
  _, w2 = load_drafter(with_target)
  assert "tok_embd" not in w2 and "lm_head" not in w2


def test_window_absent_and_block_size_default(tmp_path):
  """No sliding_window key: every layer is full attention (docs/SPEC.md section 2)."""
  cfg = dataclasses.replace(TINY_CONFIG, window=None, layer_types=(FULL, FULL), block_size=16)
  w = _drafter(seed=4)
  path = save_drafter(tmp_path / "nowin.gguf", cfg, w)
  assert gguf.GGUFReader(path).get_field("dflash.attention.sliding_window") is None
  assert load_drafter(path)[0] == cfg
  kv = _kv(dataclasses.replace(TINY_CONFIG, window=None))   # no window, no pattern
  del kv["dflash.block_size"]
  loaded, _ = load_drafter(_write(tmp_path / "nobs.gguf", kv, _tensors(w)))
  assert loaded.block_size == 16 and loaded.window is None and loaded.kinds == (FULL, FULL)


def test_old_mask_key_spelling(tmp_path):
  w = _drafter(seed=5)
  cfg = dataclasses.replace(TINY_CONFIG, mask_token_id=11)
  path = _write(tmp_path / "old.gguf", _kv(cfg, mask_key="dflash.mask_token_id"), _tensors(w))
  assert load_drafter(path)[0] == cfg
  kv = _kv(cfg)
  kv["dflash.mask_token_id"] = (12, VT.UINT32)
  _expect_error(_write(tmp_path / "both.gguf", kv, _tensors(w)), "tokenizer.ggml.mask_token_id",
                "dflash.mask_token_id", "disagrees")


def _random_k_blocks(rng, shape: tuple[int, int], qtype) -> np.ndarray:
  """Random blocks of a K-quant gguf can only dequantize, with finite f16 scales."""
  block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
  blocks = rng.integers(0, 256, (shape[0], shape[1] // block, nbytes), dtype=np.uint8)
  lo, hi = K_SCALE_BYTES[qtype]
  scales = rng.uniform(-0.01, 0.01, (shape[0], shape[1] // block, (hi - lo) // 2))
  blocks[..., lo:hi] = scales.astype(np.float16).view(np.uint8)
  return blocks.reshape(shape[0], -1)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.Q4_K,
                                   QT.Q5_K, QT.Q6_K], ids=lambda q: q.name)
def test_other_types_load_as_gguf_dequantizes(tmp_path, qtype):
  rng = np.random.default_rng(int(qtype))
  w = _drafter(seed=6, cfg=K_CONFIG)
  tensors = _tensors({k: v for k, v in w.items() if v.ndim == 1})
  for name, a in w.items():
    if a.ndim == 2:
      try:
        data = gguf.quants.quantize(a, qtype)
      except NotImplementedError:  # gguf only dequantizes K-quants: store random valid blocks
        data = _random_k_blocks(rng, a.shape, qtype)
      tensors[name + ".weight"] = (data, qtype)
  cfg, w2 = load_drafter(_write(tmp_path / f"{qtype.name}.gguf", _kv(K_CONFIG), tensors))
  assert cfg == K_CONFIG
  for name, (data, t) in tensors.items():
    expect = gguf.quants.dequantize(data, t)
    np.testing.assert_array_equal(w2[name.removesuffix(".weight")], expect, err_msg=name)
  assert np.abs(w2["fc"]).max() > 0


def test_read_q8_0_matches_dequantized(tmp_path):
  w = _drafter(seed=7)
  path = save_drafter(tmp_path / "q8.gguf", TINY_CONFIG, w, "Q8_0")
  _, w2 = load_drafter(path)
  raw = read_q8_0(path)
  assert set(raw) == {n for n, a in w.items() if a.ndim == 2}
  for name, (qs, d) in raw.items():
    out, cols = w[name].shape
    assert qs.dtype == np.int8 and qs.shape == (out, cols)
    assert d.dtype == np.float32 and d.shape == (out, cols // 32)
    assert qs.flags.c_contiguous and d.flags.c_contiguous
    rebuilt = (d[:, :, None] * qs.reshape(out, cols // 32, 32).astype(np.float32))
    np.testing.assert_array_equal(rebuilt.reshape(out, cols), w2[name], err_msg=name)
  assert read_q8_0(save_drafter(tmp_path / "f32.gguf", TINY_CONFIG, w)) == {}


# ---------------------------------------------------------------------------------------------
# Loader failures


@pytest.fixture
def parts():
  """(kv, tensors) of a valid TINY_CONFIG drafter, to break one thing at a time."""
  return _kv(TINY_CONFIG), _tensors(_drafter(seed=8))


def test_random_bytes(tmp_path):
  path = tmp_path / "noise.gguf"
  path.write_bytes(np.random.default_rng(9).bytes(4096))
  _expect_error(path, "not a readable GGUF")


def test_truncated(tmp_path):
  data = open(save_drafter(tmp_path / "full.gguf", TINY_CONFIG, _drafter(seed=10)), "rb").read()
  for cut in (len(data) // 2, 40):
    path = tmp_path / f"cut{cut}.gguf"
    path.write_bytes(data[:cut])
    _expect_error(path, "not a readable GGUF", "truncated")


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="nothere.gguf"):
    load_drafter(tmp_path / "nothere.gguf")


def test_wrong_architecture(tmp_path, parts):
  _expect_error(_write(tmp_path / "llama.gguf", *parts, arch="llama"), "general.architecture",
                "'llama'")


@pytest.mark.parametrize("key", ["dflash.block_count", "dflash.embedding_length",
                                 "dflash.feed_forward_length", "dflash.attention.head_count",
                                 "dflash.attention.head_count_kv", "dflash.attention.key_length",
                                 "dflash.rope.freq_base", "dflash.attention.layer_norm_rms_epsilon",
                                 "dflash.target_layers", "tokenizer.ggml.mask_token_id"])
def test_missing_key(tmp_path, parts, key):
  kv, tensors = parts
  del kv[key]
  _expect_error(_write(tmp_path / "nokey.gguf", kv, tensors), "missing metadata key", key)


@pytest.mark.parametrize("key,value,found", [
    ("dflash.attention.head_count", ("4", VT.STRING), "STRING"),
    ("dflash.rope.freq_base", (10000, VT.UINT32), "UINT32"),
    ("dflash.target_layers", ([1.0, 3.0], VT.ARRAY, VT.FLOAT32), "array of FLOAT32"),
    ("dflash.target_layers", (3, VT.INT32), "INT32"),
    ("tokenizer.ggml.mask_token_id", (True, VT.BOOL), "BOOL"),
    ("dflash.attention.sliding_window", (32.0, VT.FLOAT32), "FLOAT32"),
])
def test_ill_typed_key(tmp_path, parts, key, value, found):
  kv, tensors = parts
  kv[key] = value
  _expect_error(_write(tmp_path / "badtype.gguf", kv, tensors), key, found, "expected")


def test_missing_tensor(tmp_path, parts):
  kv, tensors = parts
  del tensors["blk.1.ffn_up.weight"]
  _expect_error(_write(tmp_path / "notensor.gguf", kv, tensors), "missing tensors",
                "blk.1.ffn_up.weight")


@pytest.mark.parametrize("name,shape,expected", [
    ("blk.1.ffn_up.weight", (64, 128), "(128, 64)"),
    ("blk.0.attn_k_norm.weight", (32,), "(16,)"),
    ("fc.weight", (64, 128), "(64, 192)"),
])
def test_misshaped_tensor(tmp_path, parts, name, shape, expected):
  kv, tensors = parts
  a = np.random.default_rng(11).standard_normal(shape, dtype=np.float32)
  tensors[name] = (a, QT.F32)
  _expect_error(_write(tmp_path / "shape.gguf", kv, tensors), name, str(shape), expected)


def test_extra_tensors(tmp_path, parts):
  kv, tensors = parts
  rng = np.random.default_rng(12)
  tensors["token_embd.weight"] = (rng.standard_normal((16, 64), dtype=np.float32), QT.F32)
  tensors["blk.2.attn_q.weight"] = (rng.standard_normal((64, 64), dtype=np.float32), QT.F32)
  _expect_error(_write(tmp_path / "extra.gguf", kv, tensors), "unknown tensors",
                "token_embd.weight", "blk.2.attn_q.weight")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("tensor_type", [QT.F32, QT.F16])
def test_non_finite_tensor(tmp_path, parts, bad, tensor_type):
  kv, _ = parts
  w = _drafter(seed=13)
  w["blk.0.ffn_gate"][5, 7] = bad
  tensors = _tensors(w, tensor_type)
  msg = _expect_error(_write(tmp_path / "nan.gguf", kv, tensors), "blk.0.ffn_gate.weight",
                      "non-finite", "(5, 7)")
  assert str(bad) in msg


def test_empty_target_layers(tmp_path, parts):
  kv, tensors = parts
  kv["dflash.target_layers"] = ([], VT.ARRAY, VT.INT32)
  _expect_error(_write(tmp_path / "empty.gguf", kv, tensors), "dflash.target_layers", "empty")


@pytest.mark.parametrize("key,value,culprit", [
    ("dflash.attention.head_count", 8, "blk.0.attn_q.weight has 64 rows"),
    ("dflash.attention.head_count_kv", 4, "blk.0.attn_k.weight has 32 rows"),
])
def test_head_inconsistency(tmp_path, parts, key, value, culprit):
  kv, tensors = parts
  kv[key] = (value, VT.UINT32)
  _expect_error(_write(tmp_path / "heads.gguf", kv, tensors), culprit, key, "inconsistent")


@pytest.mark.parametrize("key,value,culprit", [
    ("dflash.attention.head_count_kv", 3, "multiple of n_head_kv"),
    ("dflash.attention.key_length", 15, "head_dim must be even"),
    ("dflash.block_count", 0, "n_layer must be a positive int"),
    ("dflash.attention.value_length", 8, "dflash.attention.value_length"),
])
def test_config_rejected(tmp_path, parts, key, value, culprit):
  kv, tensors = parts
  kv[key] = (value, VT.UINT32)
  _expect_error(_write(tmp_path / "cfg.gguf", kv, tensors), culprit)


def test_type_gguf_cannot_dequantize(tmp_path, parts):
  kv, tensors = parts
  norm = np.random.default_rng(14).integers(1, 9, 64, dtype=np.int32)
  tensors["output_norm.weight"] = (norm, QT.I32)
  _expect_error(_write(tmp_path / "i32.gguf", kv, tensors), "output_norm.weight", "I32",
                "cannot dequantize")


# ---------------------------------------------------------------------------------------------
# Saver failures: an error, and nothing on disk


def _assert_save_fails(tmp_path, w, culprit: str, cfg=TINY_CONFIG, tensor_type="F32"):
  out = tempfile.mkdtemp(dir=tmp_path)
  path = os.path.join(out, "d.gguf")
  with pytest.raises((DrafterFormatError, ValueError)) as info:
    save_drafter(path, cfg, w, tensor_type)
  assert culprit in str(info.value), str(info.value)
  assert os.listdir(out) == []


def test_save_rejects_missing_weight(tmp_path):
  w = _drafter(seed=15)
  del w["blk.0.attn_v"]
  _assert_save_fails(tmp_path, w, "blk.0.attn_v")


def test_save_rejects_misshaped_weight(tmp_path):
  w = _drafter(seed=16)
  w["blk.1.attn_output"] = w["blk.1.attn_output"][:, :32]
  _assert_save_fails(tmp_path, w, "blk.1.attn_output has shape (64, 32), expected (64, 64)")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_save_rejects_non_finite(tmp_path, bad):
  w = _drafter(seed=17)
  w["enc.output_norm"][3] = bad
  _assert_save_fails(tmp_path, w, "enc.output_norm")


def test_save_rejects_unknown_weight(tmp_path):
  w = _drafter(seed=18)
  w["blk.0.attn_sinks"] = np.ones(4, np.float32)
  _assert_save_fails(tmp_path, w, "blk.0.attn_sinks")


def test_save_rejects_f16_overflow_and_bad_q8_0_width(tmp_path):
  w = _drafter(seed=19)
  w["fc"][0, 0] = 1e6
  _assert_save_fails(tmp_path, w, "fc overflows F16", tensor_type="F16")
  cfg = dataclasses.replace(TINY_CONFIG, n_embd=48, head_dim=12)
  _assert_save_fails(tmp_path, _drafter(seed=20, cfg=cfg), "not a multiple of the Q8_0",
                     cfg=cfg, tensor_type="Q8_0")
  _assert_save_fails(tmp_path, _drafter(seed=21), "tensor_type", tensor_type="Q4_K")


def test_failed_write_keeps_old_file(tmp_path, monkeypatch):
  path = save_drafter(tmp_path / "d.gguf", TINY_CONFIG, _drafter(seed=22))
  before = open(path, "rb").read()

  def boom(self, *args, **kwargs):
    raise OSError("disk full")

  monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
  with pytest.raises(OSError, match="disk full"):
    save_drafter(path, TINY_CONFIG, _drafter(seed=23), "BF16")
  assert open(path, "rb").read() == before
  assert os.listdir(tmp_path) == ["d.gguf"]


# ---------------------------------------------------------------------------------------------
# Per-layer attention kinds and context length (SPEC.md section 7)


def test_layer_kinds_and_context_length_round_trip(tmp_path):
  cfg = dataclasses.replace(TINY_CONFIG, layer_types=(FULL, SLIDING), context_length=3000)
  path = save_drafter(tmp_path / "mixed.gguf", cfg, _drafter(seed=24))
  reader = gguf.GGUFReader(path)
  pattern = reader.get_field("dflash.attention.sliding_window_pattern")
  assert pattern.types == [VT.ARRAY, VT.BOOL] and pattern.contents() == [False, True]
  assert reader.get_field("dflash.context_length").contents() == 3000
  assert load_drafter(path)[0] == cfg
  # All sliding is the default: no pattern is written, and none is needed to read it back.
  path = save_drafter(tmp_path / "swa.gguf", TINY_CONFIG, _drafter(seed=24))
  assert gguf.GGUFReader(path).get_field("dflash.attention.sliding_window_pattern") is None
  assert gguf.GGUFReader(path).get_field("dflash.context_length") is None


@pytest.mark.parametrize("pattern,window,kinds", [
    ([True, True], 32, None),
    ([False, False], None, (FULL, FULL)),
    ([True, False], 32, (SLIDING, FULL)),
    ([False, False], 32, (FULL, FULL)),
])
def test_pattern_key_read(tmp_path, parts, pattern, window, kinds):
  kv, tensors = parts
  del kv["dflash.attention.sliding_window"]
  if window is not None:
    kv["dflash.attention.sliding_window"] = (window, VT.UINT32)
  kv["dflash.attention.sliding_window_pattern"] = (pattern, VT.ARRAY, VT.BOOL)
  kv["dflash.context_length"] = (512, VT.UINT32)
  cfg, _ = load_drafter(_write(tmp_path / "p.gguf", kv, tensors))
  assert cfg.layer_types == kinds and cfg.window == window and cfg.context_length == 512


def test_window_and_no_pattern_is_all_sliding(tmp_path, parts):
  kv, tensors = parts
  assert "dflash.attention.sliding_window_pattern" not in kv
  cfg, _ = load_drafter(_write(tmp_path / "swa.gguf", kv, tensors))
  assert cfg.window == 32 and cfg.kinds == (SLIDING, SLIDING)


def test_hf_and_gguf_forms_without_a_window_load_alike(tmp_path):
  """One full-attention drafter (as z-lab's Qwen3-8B-DFlash: no window) saved as an HF folder
  and as a GGUF loads with the same config from both, so the same attention kinds."""
  cfg = dataclasses.replace(TINY_CONFIG, window=None, layer_types=(FULL, FULL),
                            context_length=4096)
  w = _drafter(seed=25)
  hf = save_drafter(tmp_path / "hf", cfg, w, "f32")
  gg = save_drafter(tmp_path / "d.gguf", cfg, w)
  assert gguf.GGUFReader(gg).get_field("dflash.attention.sliding_window") is None
  from_hf, from_gguf = load_drafter(hf)[0], load_drafter(gg)[0]
  assert from_hf == from_gguf == cfg and from_gguf.kinds == (FULL, FULL)
  # The GGUF written from the HF folder says the same.
  again = save_drafter(tmp_path / "again.gguf", from_hf, load_drafter(hf)[1])
  assert load_drafter(again)[0] == cfg


def test_sliding_layers_need_a_window(tmp_path, parts):
  kv, tensors = parts
  del kv["dflash.attention.sliding_window"]
  kv["dflash.attention.sliding_window_pattern"] = ([True, False], VT.ARRAY, VT.BOOL)
  _expect_error(_write(tmp_path / "nowin.gguf", kv, tensors),
                "dflash.attention.sliding_window_pattern", "layers [0] sliding",
                "no 'dflash.attention.sliding_window'")
  with pytest.raises(DrafterFormatError, match=r"save_drafter\(.*nowin2.gguf\): the config has "
                     r"sliding layers but no window"):
    save_drafter(tmp_path / "nowin2.gguf", dataclasses.replace(TINY_CONFIG, window=None),
                 _drafter(seed=26))
  assert not (tmp_path / "nowin2.gguf").exists()


def test_draft_window_is_an_explicit_choice():
  """with_draft_window runs every layer, full ones included, in a ring of W slots."""
  cfg = dataclasses.replace(TINY_CONFIG, layer_types=(FULL, SLIDING))
  ring = cfg.with_draft_window(64)
  assert ring.kinds == (SLIDING, SLIDING) and ring.window == 64 and ring.resolve_window() == 64
  assert cfg.kinds == (FULL, SLIDING) and cfg.window == 32   # the original is unchanged
  for bad in (0, -1, 2.5, True):
    with pytest.raises(ValueError, match="window must be a positive int"):
      cfg.with_draft_window(bad)


@pytest.mark.parametrize("value,culprit", [
    (([True, False, True], VT.ARRAY, VT.BOOL), "has 3 entries"),
    (([1, 0], VT.ARRAY, VT.INT32), "array of INT32"),
    ((2, VT.UINT32), "UINT32"),
])
def test_bad_pattern_key(tmp_path, parts, value, culprit):
  kv, tensors = parts
  kv["dflash.attention.sliding_window_pattern"] = value
  _expect_error(_write(tmp_path / "badpat.gguf", kv, tensors),
                "dflash.attention.sliding_window_pattern", culprit)
