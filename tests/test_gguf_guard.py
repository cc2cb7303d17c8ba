"""The bounds-checked GGUF reader (dflash_jax.io.gguf_guard): the same fields and tensors as
gguf's reader on valid files; every header breach rejected by name, in bounded time and memory;
the two hostile files a fuzz of the loader found (regenerated here) rejected at once.

Time and memory bounds here are correctness bounds against unbounded work (the hostile files
made the old loader run for minutes and allocate 24 GB), set far above what the guard needs;
they are not benchmarks.
"""
from __future__ import annotations

import pathlib
import struct
import time
import tracemalloc

import gguf
import numpy as np
import pytest

from dflash_jax.io import DrafterFormatError, load_drafter, save_drafter
from dflash_jax.io.errors import GGUFFormatError
from dflash_jax.io.gguf_guard import open_gguf
from dflash_jax.config import TINY_CONFIG, DFlashConfig
from dflash_jax.synthetic import synthetic_drafter

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType


# ---------------------------------------------------------------------------------------------
# A GGUF written byte by byte from the format (independent of both readers)


def _str(s: str | bytes) -> bytes:
  b = s.encode() if isinstance(s, str) else s
  return struct.pack("<Q", len(b)) + b


def _kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
  return _str(key) + struct.pack("<I", vtype) + payload


def _array(itype: int, items: list, fmt: str = "") -> bytes:
  body = b"".join(_str(x) for x in items) if itype == VT.STRING else \
      struct.pack(f"<{len(items)}{fmt}", *items)
  return struct.pack("<IQ", itype, len(items)) + body


def _info(name: str | bytes, dims: tuple, ttype: int, offset: int) -> bytes:
  return (_str(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
          + struct.pack("<IQ", ttype, offset))


ARCH_KV = _kv("general.architecture", VT.STRING, _str("dflash"))
DATA = np.arange(8, dtype=np.float32).tobytes()   # tensor "t": F32, ne (4, 2)


def _gguf(kvs=(ARCH_KV,), infos=(_info("t", (4, 2), QT.F32, 0),), data=DATA, version=3,
          n_tensors=None, n_kv=None, alignment=32) -> bytes:
  head = b"GGUF" + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
  out = head + b"".join(kvs) + b"".join(infos)
  return out + b"\0" * (-len(out) % alignment) + data


def _write(tmp_path, data: bytes, name="f.gguf") -> str:
  path = tmp_path / name
  path.write_bytes(data)
  return str(path)


# ---------------------------------------------------------------------------------------------
# Valid files: the same view as gguf.GGUFReader


def _assert_same_as_gguf_reader(path: str) -> None:
  ref, got = gguf.GGUFReader(path), open_gguf(path)
  assert isinstance(got, gguf.GGUFReader)
  assert list(ref.fields) == list(got.fields)
  assert (ref.alignment, ref.data_offset) == (got.alignment, got.data_offset)
  for key, fa in ref.fields.items():
    fb = got.get_field(key)
    assert (fa.offset, fa.name, fa.types, list(fa.data)) == \
        (fb.offset, fb.name, fb.types, list(fb.data)), key
    assert len(fa.parts) == len(fb.parts), key
    for pa, pb in zip(fa.parts, fb.parts):
      assert pa.dtype == pb.dtype and np.array_equal(pa, pb), key
    assert fa.contents() == fb.contents(), key
    if fa.types[0] == VT.ARRAY and fa.data:
      assert fa.contents(len(fa.data) - 1) == fb.contents(len(fb.data) - 1), key
  assert len(ref.tensors) == len(got.tensors)
  for ta, tb in zip(ref.tensors, got.tensors):
    assert (ta.name, ta.tensor_type, ta.n_elements, ta.n_bytes, ta.data_offset) == \
        (tb.name, tb.tensor_type, tb.n_elements, tb.n_bytes, tb.data_offset)
    assert np.array_equal(ta.shape, tb.shape) and ta.shape.dtype == tb.shape.dtype
    assert ta.data.dtype == tb.data.dtype and ta.data.shape == tb.data.shape
    assert np.array_equal(ta.data, tb.data, equal_nan=True), ta.name
    assert [p.tolist() for p in ta.field.parts] == [p.tolist() for p in tb.field.parts]


@pytest.mark.parametrize("tensor_type", ("F32", "F16", "BF16", "Q8_0"))
def test_drafter_files_read_as_gguf_reads_them(tmp_path, tensor_type):
  w = synthetic_drafter(TINY_CONFIG, seed=3, with_target=False)
  _assert_same_as_gguf_reader(save_drafter(tmp_path / "d.gguf", TINY_CONFIG, w, tensor_type))


def test_every_value_type_reads_as_gguf_reads_it(tmp_path):
  rng = np.random.default_rng(4)
  w = gguf.GGUFWriter(str(tmp_path / "all.gguf"), "dflash")
  w.add_custom_alignment(64)
  for vtype, value in ((VT.UINT8, 200), (VT.INT8, -100), (VT.UINT16, 60000), (VT.INT16, -30000),
                       (VT.UINT32, 4_000_000_000), (VT.INT32, -2_000_000_000),
                       (VT.FLOAT32, 0.25), (VT.BOOL, True), (VT.STRING, "h\u00e9llo"),
                       (VT.UINT64, 2**63 + 5), (VT.INT64, -(2**62)), (VT.FLOAT64, -1.5e300)):
    w.add_key_value(f"k.{vtype.name}", value, vtype)
  w.add_array("a.int32", rng.integers(-9, 9, 33).tolist())
  w.add_array("a.f32", rng.standard_normal(5).tolist())
  w.add_array("a.str", ["", "a", "\u00fcber", "x" * 300])
  w.add_array("a.bool", [True, False, True])
  w.add_tensor("m", rng.standard_normal((3, 4), dtype=np.float32))
  w.add_tensor("h", rng.standard_normal(7).astype(np.float16))
  w.add_tensor("i", rng.integers(-5, 5, (2, 3, 4), dtype=np.int16))
  q = gguf.quants.quantize(rng.standard_normal((2, 64), dtype=np.float32), QT.Q8_0)
  w.add_tensor("q", q, raw_dtype=QT.Q8_0)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  _assert_same_as_gguf_reader(str(tmp_path / "all.gguf"))


def test_empty_array_and_scalar_tensor_read_as_gguf_reads_them(tmp_path):
  kvs = (ARCH_KV, _kv("empty", VT.ARRAY, _array(VT.INT32, [], "i")))
  infos = (_info("s", (), QT.F32, 0),)
  _assert_same_as_gguf_reader(_write(tmp_path, _gguf(kvs, infos, data=struct.pack("<f", 2.5))))


# ---------------------------------------------------------------------------------------------
# Every breach rejected, naming the file and the field


ARR = _kv("arr", VT.ARRAY, _array(VT.STRING, ["ab", "c"]))
BREACHES = {
    "magic": (b"GGUX" + _gguf()[4:], ["magic", "b'GGUX'"]),
    "version 1": (_gguf(version=1), ["version", "1 is not one of the supported"]),
    "big-endian": (b"GGUF" + struct.pack(">I", 3) + _gguf()[8:], ["big-endian"]),
    "short file": (b"GGUF" + b"\0" * 10, ["header", "14 bytes", "truncated"]),
    "kv_count": (_gguf(n_kv=2**40), ["kv_count", str(2**40)]),
    "tensor_count": (_gguf(n_tensors=2**40), ["tensor_count", str(2**40)]),
    "key length": (_gguf(kvs=(struct.pack("<Q", 2**62),)), ["metadata key #0", str(2**62),
                                                              "truncated"]),
    "key utf-8": (_gguf(kvs=(ARCH_KV, _kv(b"k\xff", VT.UINT8, b"\1"))),
                  ["metadata key #1", "UTF-8"]),
    "duplicate key": (_gguf(kvs=(ARCH_KV, ARCH_KV)), ["'general.architecture'", "twice"]),
    "value type": (_gguf(kvs=(ARCH_KV, _kv("k", 13, b"\0" * 8))), ["'k'", "value type 13"]),
    "nested array": (_gguf(kvs=(ARCH_KV, _kv("k", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 1)))),
                     ["'k'", "nested"]),
    "array count": (_gguf(kvs=(ARCH_KV, _kv("k", VT.ARRAY, struct.pack("<IQ", VT.INT32, 2**61)))),
                    ["'k'", f"array count {2**61}", "INT32"]),
    "string element": (_gguf(kvs=(ARCH_KV, ARR[:-1] + b"\xff")), ["'arr'[1]", "UTF-8"]),
    "string element length": (_gguf(kvs=(ARCH_KV, ARR[:-9] + struct.pack("<Q", 2**50) + b"c")),
                              ["'arr'[1]", str(2**50)]),
    "alignment type": (_gguf(kvs=(ARCH_KV, _kv("general.alignment", VT.UINT64,
                                               struct.pack("<Q", 32)))),
                       ["'general.alignment'", "UINT64", "expected UINT32"]),
    "alignment value": (_gguf(kvs=(ARCH_KV, _kv("general.alignment", VT.UINT32,
                                                struct.pack("<I", 48)))),
                        ["'general.alignment'", "48 is not a power of 2"]),
    "name length": (_gguf(infos=(_info("n" * 64, (4, 2), QT.F32, 0),)),
                    ["tensor #0", "64 bytes", "limit is 63"]),
    "duplicate tensor": (_gguf(infos=(_info("t", (4,), QT.F32, 0), _info("t", (4,), QT.F32, 32))),
                         ["tensor #1 't'", "twice"]),
    "n_dims": (_gguf(infos=(_info("t", (1, 1, 2, 2, 2), QT.F32, 0),)), ["'t'", "n_dims 5"]),
    "element count": (_gguf(infos=(_info("t", (2**32, 2**32), QT.F32, 0),)), ["'t'", "2^63"]),
    "dim": (_gguf(infos=(_info("t", (2**64 - 1,), QT.F32, 0),)), ["'t'", "2^63"]),
    "ggml type": (_gguf(infos=(_info("t", (4, 2), 1000, 0),)), ["'t'", "type 1000"]),
    "block rows": (_gguf(infos=(_info("t", (33,), QT.Q8_0, 0),)), ["'t'", "33", "Q8_0 block (32)"]),
    "too big": (_gguf(infos=(_info("t", (2**40,), QT.F32, 0),)), ["'t'", "more than the whole"]),
    "offset": (_gguf(infos=(_info("t", (4, 2), QT.F32, 64),)), ["'t'", "data offset 64 is not 0"]),
    "second offset": (_gguf(infos=(_info("a", (4,), QT.F32, 0), _info("b", (4,), QT.F32, 16)),
                            data=DATA + bytes(32)), ["tensor #1 'b'", "offset 16 is not 32"]),
    "truncated data": (_gguf()[:-1], ["tensor 't'", "past the end of the file", "truncated"]),
}


def test_breach_cases_start_from_a_valid_file(tmp_path):
  """The base every breach case edits reads fine (so each failure below is the breach's)."""
  r = open_gguf(_write(tmp_path, _gguf(kvs=(ARCH_KV, ARR))))
  assert r.get_field("arr").contents() == ["ab", "c"]
  assert r.tensors[0].data.tolist() == np.arange(8, dtype=np.float32).reshape(2, 4).tolist()


@pytest.mark.parametrize("case", sorted(BREACHES))
def test_breach_rejected_naming_the_field(tmp_path, case):
  data, culprits = BREACHES[case]
  path = _write(tmp_path, data)
  with pytest.raises(GGUFFormatError) as info:
    open_gguf(path)
  msg = str(info.value)
  for c in [path, "not a readable GGUF"] + culprits:
    assert c in msg, (c, msg)
  with pytest.raises(DrafterFormatError, match="not a readable GGUF"):   # and through the loader
    load_drafter(path)


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="nothere"):
    open_gguf(tmp_path / "nothere.gguf")


def test_n_layer_beyond_the_tensor_count_is_rejected_before_any_table(tmp_path):
  """A planted block count of 2^32 - 1 used to build a table of 11 * 2^32 tensor shapes."""
  w = synthetic_drafter(TINY_CONFIG, seed=5, with_target=False)
  path = save_drafter(tmp_path / "d.gguf", TINY_CONFIG, w)
  reader = gguf.GGUFReader(path)
  part = reader.get_field("dflash.block_count").parts[-1]
  pos = part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]
  data = bytearray(open(path, "rb").read())
  data[pos:pos + 4] = struct.pack("<I", 2**32 - 1)
  t0 = time.perf_counter()
  with pytest.raises(DrafterFormatError, match=r"'dflash.block_count' = 4294967295, but the file "
                     r"holds only 25 tensors"):
    load_drafter(_write(tmp_path, bytes(data), "layers.gguf"))
  assert time.perf_counter() - t0 < 2.0


# ---------------------------------------------------------------------------------------------
# Bounded cost: the hostile fixtures and floods of small items


def _cost(path: str, error=DrafterFormatError) -> tuple[float, int, str]:
  """(seconds, traced peak bytes, message) of load_drafter(path), which must raise `error`.
  Time and memory come from separate runs (tracing slows allocation-heavy code)."""
  t0 = time.perf_counter()
  with pytest.raises(error) as info:
    load_drafter(path)
  seconds = time.perf_counter() - t0
  tracemalloc.start()
  try:
    with pytest.raises(error):
      load_drafter(path)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  return seconds, peak, str(info.value)


# The drafter the fuzz mutated: about 1.1 MB as F32 (its two hostile files were that size).
HOSTILE_BASE = DFlashConfig(n_layer=2, n_embd=128, n_ff=128, n_head=6, n_head_kv=2, head_dim=32,
                            rope_theta=1e4, eps=1e-6, target_layers=(17, 24, 26),
                            mask_token_id=997, block_size=16, window=64)


def _hostile(tmp_path, field: str) -> pathlib.Path:
  """The valid drafter file with one header field mutated as the fuzz found it, so that an
  array claims a planted element count of 4-byte elements:
  - "dflash.target_layers": the INT32 array's u64 count overwritten with 0x70655f736d000003
    (the fuzz spliced text bytes over it);
  - "general.architecture": the string's value type turned into ARRAY (9), so its length's low
    half reads as the element type (6, FLOAT32) and the next 8 bytes ("\0\0\0\0dfla") as
    the count.
  Zero bytes are appended so the elements tile the rest of the file: gguf's reader then walks
  the count, one numpy view per element, past the end, where every further element is empty
  and the walk never advances (the fuzz's files: 102 s under a 10 GB limit, or a MemoryError;
  unbounded, 24 GB)."""
  w = synthetic_drafter(HOSTILE_BASE, seed=11, with_target=False)
  path = save_drafter(tmp_path / "base.gguf", HOSTILE_BASE, w)
  reader = gguf.GGUFReader(path)   # the valid file: its parts give the byte positions
  parts = reader.get_field(field).parts
  part, value, after = {   # the mutated part, its new bytes, where the elements start after it
      "dflash.target_layers": (parts[4], struct.pack("<Q", 0x70655f736d000003), 8),
      "general.architecture": (parts[2], struct.pack("<I", VT.ARRAY), 4 + 4 + 8)}[field]
  pos = part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]
  data = bytearray(open(path, "rb").read())
  assert len(value) == part.nbytes
  data[pos:pos + len(value)] = value
  data += bytes((pos + after - len(data)) % 4)
  out = tmp_path / f"hostile_{field}.gguf"
  out.write_bytes(bytes(data))
  return out


@pytest.mark.parametrize("field", ["dflash.target_layers", "general.architecture"])
def test_hostile_files_rejected_at_once(tmp_path, field):
  path = _hostile(tmp_path, field)
  seconds, peak, msg = _cost(str(path))
  assert str(path) in msg and f"'{field}'" in msg and "array count" in msg, msg
  assert seconds < 2.0, seconds
  assert peak < path.stat().st_size, peak   # far less than the file: nothing of its claims


def _flood(kind: str, n: int) -> bytes:
  if kind == "keys":   # n one-byte metadata values under distinct keys
    return _gguf(kvs=(ARCH_KV, *(_kv(f"k{i}", VT.UINT8, b"\1") for i in range(n))), infos=(),
                 data=b"")
  if kind == "strings":   # one array of n empty strings
    return _gguf(kvs=(ARCH_KV, _kv("s", VT.ARRAY, _array(VT.STRING, [""] * n))), infos=(),
                 data=b"")
  if kind == "tensors":   # n empty tensors, each just its info
    return _gguf(infos=tuple(_info(f"t{i}", (0,), QT.F32, 0) for i in range(n)), data=b"")
  if kind == "numbers":   # one array of n u8
    return _gguf(kvs=(ARCH_KV, _kv("a", VT.ARRAY, _array(VT.UINT8, [1] * n, "B"))), infos=(),
                 data=b"")
  raise ValueError(kind)


@pytest.mark.parametrize("kind,n", [("keys", 16000), ("strings", 32000), ("tensors", 8000),
                                    ("numbers", 256000)])
def test_floods_of_small_items_cost_time_and_memory_linear_in_the_file(tmp_path, kind, n):
  """About 256 KB of the smallest items the format allows: each is walked once and kept as an
  offset (gguf's reader built numpy views per element: tens of us and ~700 bytes each)."""
  path = _write(tmp_path, _flood(kind, n))
  size = pathlib.Path(path).stat().st_size
  seconds, peak, msg = _cost(path)
  assert "missing metadata key" in msg or "unknown tensors" in msg, msg
  assert seconds < 2.0, seconds
  assert peak < 8 * size, (peak, size)
