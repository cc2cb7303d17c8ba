"""A bounds-checked GGUF reader: a hostile file fails fast, in about its own size of memory.

`gguf.GGUFReader` trusts the header: a planted array count makes it loop (and allocate a numpy
view per element) for as long as the count says, and even a valid file costs it tens of
microseconds and hundreds of bytes per metadata array element (a target's 150k-token vocab,
which drafter GGUFs carry, takes seconds). `open_gguf` instead walks the header once with the
rules of llama.cpp's GGUF loader (`gguf_init_from_file_impl`): every count and length is checked
against the bytes left in the file before it is used, every string must be UTF-8, tensor dims
(at most 4, non-negative, element count below 2^63), ggml types, block-size rows, offsets
(contiguous, aligned, within the file) and `general.alignment` (a u32 power of two) are checked,
and anything wrong raises `GGUFFormatError` naming the file, the field and the limit.

The walk keeps only offsets (one per key, tensor and string-array element), so its memory is a
small multiple of the header's byte count and its time is linear in it. The result is a
`GGUFReader` with the same public surface (`fields`, `get_field`, `tensors`, `get_tensor`,
`alignment`, `data_offset`, `data`): fields and tensors are gguf's own `ReaderField` /
`ReaderTensor`, built from the checked offsets when accessed, with tensor data as views of the
read-only memmap.
"""
from __future__ import annotations

import array
import bisect
import math
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import gguf
import numpy as np

from dflash_jax.io.errors import GGUFFormatError

_VT = gguf.GGUFValueType
_QT = gguf.GGMLQuantizationType
MAGIC = b"GGUF"
VERSIONS = (2, 3)            # what GGUFReader and llama.cpp read (v1 had 32-bit counts)
MAX_DIMS = 4                 # GGML_MAX_DIMS
MAX_NAME = 64                # GGML_MAX_NAME: a tensor name holds at most 63 bytes
_INT64_MAX = 2**63 - 1
_HEADER = 24                 # magic, version, tensor count, kv count
_MIN_KV = 8 + 4 + 1          # key length, value type, the smallest value (1 byte)
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8   # name length, n_dims, type, offset
_SCALARS = {t: np.dtype(d) for t, d in gguf.GGUFReader.gguf_scalar_to_np.items()}
_SCALAR_SIZES = {int(t): d.itemsize for t, d in _SCALARS.items()}   # plain ints: the walk's hot path
_VALUE_TYPES = frozenset(int(t) for t in _VT)
_QUANT_TYPES = frozenset(int(t) for t in gguf.GGML_QUANT_SIZES)
# ggml types the reader exposes as typed arrays; every other type is raw bytes.
_ITEM_TYPES = {_QT.F16: np.float16, _QT.F32: np.float32, _QT.F64: np.float64, _QT.I8: np.int8,
               _QT.I16: np.int16, _QT.I32: np.int32, _QT.I64: np.int64}
# GGUFReader's fields for the header itself: name -> (offset, numpy type, GGUF type).
_PSEUDO_FIELDS = {"GGUF.version": (4, np.uint32, _VT.UINT32),
                  "GGUF.tensor_count": (8, np.uint64, _VT.UINT64),
                  "GGUF.kv_count": (16, np.uint64, _VT.UINT64)}


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
  """Checks the whole header of the GGUF at `path`, then returns a reader of it.

  Raises FileNotFoundError when there is no such file and GGUFFormatError for any breach of
  the format, before anything of the size the header claims is read or allocated.
  """
  return CheckedGGUFReader(path)


def _pad(n: int, alignment: int) -> int:
  return n + (-n) % alignment


class _LazyParts(Sequence):
  """A ReaderField's parts list: `head` as given, then `n` parts built by `part(i)` on access."""

  def __init__(self, head: list, n: int, part: Callable[[int], np.ndarray]):
    self._head, self._n, self._part = head, n, part

  def __len__(self) -> int:
    return len(self._head) + self._n

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(len(self)))]
    if i < 0:
      i += len(self)
    if not 0 <= i < len(self):
      raise IndexError(i)
    return self._head[i] if i < len(self._head) else self._part(i - len(self._head))


class _NumericArrayField(gguf.ReaderField):
  """A numeric array's ReaderField whose contents() reads its elements as one array (gguf's
  goes part by part: seconds for a few 100k elements)."""

  def __new__(cls, offset, name, parts, data, types, items: np.ndarray):
    field = super().__new__(cls, offset, name, parts, data, types)
    field._items = items
    return field

  def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
    return self._items[index_or_slice].tolist()


class _Fields(Mapping):
  """key -> ReaderField in file order, each built from its checked offset when looked up."""

  def __init__(self, reader: "CheckedGGUFReader"):
    self._reader = reader

  def __getitem__(self, key: str) -> gguf.ReaderField:
    return self._reader._field(key)

  def __iter__(self):
    yield from _PSEUDO_FIELDS
    yield from self._reader._kv_offsets

  def __len__(self) -> int:
    return len(_PSEUDO_FIELDS) + len(self._reader._kv_offsets)

  def __contains__(self, key) -> bool:
    return key in _PSEUDO_FIELDS or key in self._reader._kv_offsets


class _Tensors(Sequence):
  """The ReaderTensors in file order, each built from its checked tensor info when accessed."""

  def __init__(self, reader: "CheckedGGUFReader"):
    self._reader = reader

  def __len__(self) -> int:
    return len(self._reader._tensor_offsets)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(len(self)))]
    return self._reader._tensor(self._reader._tensor_offsets[i])


class CheckedGGUFReader(gguf.GGUFReader):
  """A GGUFReader whose header was walked with bounds checks (see the module docstring).

  Only little-endian files are read (like llama.cpp on a little-endian host).
  """

  def __init__(self, path: str | os.PathLike):   # replaces the parent's unchecked parse
    self.path = os.fspath(path)
    if not os.path.isfile(self.path):
      raise FileNotFoundError(f"{self.path}: no such file")
    self.size = os.path.getsize(self.path)
    if self.size < _HEADER:
      raise self._error("header", f"the file has {self.size} bytes, fewer than the "
                        f"{_HEADER}-byte GGUF header (truncated?)")
    self.data = np.memmap(self.path, mode="r")
    self.size = len(self.data)
    self._buf = memoryview(self.data)
    self._kv_offsets: dict[str, int] = {}
    self._string_items: dict[str, array.array] = {}   # string-array key -> element offsets
    self._tensor_offsets = array.array("Q")
    self._tensor_names: set[str] = set()   # for the duplicate check of the walk only
    self._walk()
    del self._tensor_names
    self.endianess = gguf.GGUFEndian.LITTLE
    self.fields = _Fields(self)
    self.tensors = _Tensors(self)

  # -- errors and primitive reads --------------------------------------------------------------

  def _error(self, where: str, problem: str) -> GGUFFormatError:
    return GGUFFormatError(f"{self.path}: not a readable GGUF file: {where}: {problem}")

  def _need(self, pos: int, n: int, where: str, what: str) -> None:
    if n > self.size - pos:
      raise self._error(where, f"{what} needs {n} bytes at offset {pos}, but the file ends at "
                        f"byte {self.size} (truncated?)")

  def _u32(self, pos: int, where: str) -> int:
    self._need(pos, 4, where, "a u32")
    return struct.unpack_from("<I", self._buf, pos)[0]

  def _u64(self, pos: int, where: str) -> int:
    self._need(pos, 8, where, "a u64")
    return struct.unpack_from("<Q", self._buf, pos)[0]

  def _string(self, pos: int, where: str) -> tuple[str, int]:
    """(the UTF-8 string at pos, the offset after it)."""
    n = self._u64(pos, where)
    end = pos + 8 + n
    if end > self.size:
      self._need(pos + 8, n, where, f"a string of {n} bytes")
    try:
      s = str(self._buf[pos + 8:end], "utf-8")
    except UnicodeDecodeError as e:
      raise self._error(where, f"the string at offset {pos} is not valid UTF-8 ({e.reason} at "
                        f"byte {e.start})") from None
    return s, end

  # -- the walk --------------------------------------------------------------------------------

  def _walk(self) -> None:
    magic = bytes(self._buf[:4])
    if magic != MAGIC:
      raise self._error("magic", f"the file starts with {magic!r}, not {MAGIC!r}")
    version = self._u32(4, "version")
    if version & 0xFFFF == 0 and version:
      raise self._error("version", f"{version:#x} reads as a byte-swapped version: big-endian "
                        "GGUF files are not supported")
    if version not in VERSIONS:
      raise self._error("version", f"{version} is not one of the supported versions {VERSIONS}")
    n_tensors, n_kv = self._u64(8, "tensor_count"), self._u64(16, "kv_count")
    room = self.size - _HEADER
    if n_kv * _MIN_KV > room:
      raise self._error("kv_count", f"{n_kv} key-value pairs need at least {_MIN_KV} bytes "
                        f"each, and only {room} bytes follow the header")
    if n_tensors * _MIN_TENSOR_INFO + n_kv * _MIN_KV > room:
      raise self._error("tensor_count", f"{n_tensors} tensor infos need at least "
                        f"{_MIN_TENSOR_INFO} bytes each, and only {room - n_kv * _MIN_KV} bytes "
                        f"are left after {n_kv} key-value pairs")
    pos = _HEADER
    for i in range(n_kv):
      pos = self._walk_kv(pos, i)
    self.alignment = self._read_alignment()
    expected = 0   # tensor data is contiguous: each offset is the padded end of the previous one
    ends = array.array("Q")
    for i in range(n_tensors):
      pos, nbytes, offset, where = self._walk_tensor_info(pos, i)
      if offset != expected:
        raise self._error(where, f"data offset {offset} is not {expected}, the padded end of the "
                          "previous tensor (tensor data must be contiguous and aligned to "
                          f"{self.alignment} bytes)")
      ends.append(offset + nbytes)
      expected = offset + _pad(nbytes, self.alignment)
    self.data_offset = _pad(pos, self.alignment)
    i = bisect.bisect_right(ends, self.size - self.data_offset)   # ends grow: data is contiguous
    if i < len(ends):   # the first tensor whose data runs past the end names the truncation
      name = self._string(self._tensor_offsets[i], "tensor name")[0]
      raise self._error(f"tensor {name!r}", f"its data ends at byte {self.data_offset + ends[i]}, "
                        f"past the end of the file at byte {self.size} (truncated?)")

  def _walk_kv(self, pos: int, i: int) -> int:
    start = pos
    key, pos = self._string(pos, f"metadata key #{i}")
    where = f"metadata key {key!r}"
    if key in self._kv_offsets or key in _PSEUDO_FIELDS:
      raise self._error(where, "appears twice")
    vtype = self._u32(pos, f"{where} (value type)")
    pos = self._walk_value(pos + 4, vtype, where, key)
    self._kv_offsets[key] = start
    return pos

  def _walk_value(self, pos: int, vtype: int, where: str, key: str) -> int:
    size = _SCALAR_SIZES.get(vtype)
    if size is not None:
      self._need(pos, size, where, f"a {_VT(vtype).name} value")
      return pos + size
    if vtype == _VT.STRING:
      return self._string(pos, where)[1]
    if vtype != _VT.ARRAY:
      raise self._error(where, f"value type {vtype} is not a GGUF value type")
    itype = self._u32(pos, f"{where} (array element type)")
    if itype == _VT.ARRAY or itype not in _VALUE_TYPES:
      raise self._error(where, f"array element type {itype} is not a GGUF scalar or string type "
                        "(nested arrays are not supported)")
    n = self._u64(pos + 4, f"{where} (array count)")
    pos += 12
    left = self.size - pos
    item = _SCALAR_SIZES.get(itype, 8)   # a string element takes at least its 8-byte length
    if n * item > left:
      raise self._error(where, f"array count {n} x {item}-byte {_VT(itype).name} elements needs "
                        f"at least {n * item} bytes, only {left} are left in the file")
    if itype != _VT.STRING:
      return pos + n * item
    offsets = array.array("Q")
    for j in range(n):
      offsets.append(pos)
      pos = self._string(pos, f"{where}[{j}]")[1]
    self._string_items[key] = offsets
    return pos

  def _read_alignment(self) -> int:
    if "general.alignment" not in self._kv_offsets:
      return gguf.GGUF_DEFAULT_ALIGNMENT
    field = self._field("general.alignment")
    if field.types != [_VT.UINT32]:
      raise self._error("metadata key 'general.alignment'", f"is {field.types[0].name}, "
                        "expected UINT32")
    alignment = int(field.parts[-1][0])
    if alignment == 0 or alignment & (alignment - 1):
      raise self._error("metadata key 'general.alignment'", f"{alignment} is not a power of 2")
    return alignment

  def _walk_tensor_info(self, pos: int, i: int) -> tuple[int, int, int, str]:
    """Checks tensor info #i at pos; returns (the offset after it, nbytes, data offset, where)."""
    self._tensor_offsets.append(pos)
    name, pos = self._string(pos, f"tensor #{i} (name)")
    where = f"tensor #{i} {name!r}"
    if len(name.encode()) >= MAX_NAME:
      raise self._error(where, f"the name has {len(name.encode())} bytes, the limit is "
                        f"{MAX_NAME - 1}")
    if name in self._tensor_names:
      raise self._error(where, "the name appears twice")
    self._tensor_names.add(name)
    n_dims = self._u32(pos, f"{where} (n_dims)")
    if n_dims > MAX_DIMS:
      raise self._error(where, f"n_dims {n_dims} is more than {MAX_DIMS}")
    self._need(pos + 4, 8 * n_dims, where, f"{n_dims} dims")
    dims = struct.unpack_from(f"<{n_dims}Q", self._buf, pos + 4)
    pos += 4 + 8 * n_dims
    n_elements = math.prod(dims)
    if max(dims, default=0) > _INT64_MAX or n_elements > _INT64_MAX:
      raise self._error(where, f"dims {list(dims)} hold {n_elements} elements, more than "
                        "2^63 - 1 (or a dim does not fit an int64)")
    ttype = self._u32(pos, f"{where} (type)")
    if ttype not in _QUANT_TYPES:
      raise self._error(where, f"type {ttype} is not a ggml type this gguf package knows")
    qtype = _QT(ttype)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    row = dims[0] if dims else 1   # ggml pads missing dims with 1
    if row % block:
      raise self._error(where, f"rows of {row} elements are not a multiple of the "
                        f"{qtype.name} block ({block})")
    offset = self._u64(pos + 4, f"{where} (data offset)")
    nbytes = n_elements // block * type_size
    if nbytes > self.size:
      raise self._error(where, f"{qtype.name} dims {list(dims)} need {nbytes} bytes, more than "
                        f"the whole file ({self.size} bytes)")
    return pos + 12, nbytes, offset, where

  # -- building gguf's field and tensor objects from checked offsets ---------------------------

  def _field(self, key: str) -> gguf.ReaderField:
    if key in _PSEUDO_FIELDS:
      offset, dtype, vtype = _PSEUDO_FIELDS[key]
      return gguf.ReaderField(offset, key, [self._get(offset, dtype)], [0], [vtype])
    start = self._kv_offsets[key]   # KeyError for an absent key, as a dict's
    klen = self._get(start, np.uint64)
    kdata = self._get(start + 8, np.uint8, int(klen[0]))
    pos = start + 8 + int(klen[0])
    raw_type = self._get(pos, np.uint32)
    vtype = _VT(int(raw_type[0]))
    pos += 4
    head = [klen, kdata, raw_type]
    if vtype == _VT.STRING:
      slen = self._get(pos, np.uint64)
      return gguf.ReaderField(start, key, head + [slen, self._get(pos + 8, np.uint8,
                                                                  int(slen[0]))], [4], [vtype])
    if vtype != _VT.ARRAY:
      return gguf.ReaderField(start, key, head + [self._get(pos, _SCALARS[vtype])], [3], [vtype])
    raw_itype, alen = self._get(pos, np.uint32), self._get(pos + 4, np.uint64)
    itype, n = _VT(int(raw_itype[0])), int(alen[0])
    head += [raw_itype, alen]
    types = [vtype, itype] if n else [vtype]   # as GGUFReader: no element, no element type
    if itype == _VT.STRING:
      offsets = self._string_items[key]

      def part(j: int) -> np.ndarray:   # slices, not _get: contents() of a vocab calls this a lot
        p = offsets[j // 2]
        if j % 2 == 0:
          return self.data[p:p + 8].view(np.uint64)
        return self.data[p + 8:p + 8 + struct.unpack_from("<Q", self._buf, p)[0]]

      return gguf.ReaderField(start, key, _LazyParts(head, 2 * n, part),
                              range(len(head) + 1, len(head) + 2 * n, 2), types)
    items = self._get(pos + 12, _SCALARS[itype], n)   # one view; each part is a slice of it
    parts = _LazyParts(head, n, lambda j: items[j:j + 1])
    return _NumericArrayField(start, key, parts, range(len(head), len(head) + n), types, items)

  def _tensor(self, start: int) -> gguf.ReaderTensor:
    name_len = self._get(start, np.uint64)
    name_data = self._get(start + 8, np.uint8, int(name_len[0]))
    pos = start + 8 + int(name_len[0])
    n_dims = self._get(pos, np.uint32)
    dims = self._get(pos + 4, np.uint64, int(n_dims[0]))
    pos += 4 + 8 * int(n_dims[0])
    raw_dtype, offset = self._get(pos, np.uint32), self._get(pos + 4, np.uint64)
    field = gguf.ReaderField(start, str(bytes(name_data), "utf-8"),
                             [name_len, name_data, n_dims, dims, raw_dtype, offset], [1, 3, 4, 5])
    qtype = _QT(int(raw_dtype[0]))
    n_elements = math.prod(int(d) for d in dims)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_bytes = n_elements // block * type_size
    np_dims = tuple(reversed([int(d) for d in dims]))
    data_offset = self.data_offset + int(offset[0])
    if qtype in _ITEM_TYPES:
      data = self._get(data_offset, _ITEM_TYPES[qtype], n_elements)
    else:
      data = self._get(data_offset, np.uint8, n_bytes)
      np_dims = gguf.quants.quant_shape_to_byte_shape(np_dims, qtype)
    return gguf.ReaderTensor(name=field.name, tensor_type=qtype, shape=dims,
                             n_elements=n_elements, n_bytes=n_bytes, data_offset=data_offset,
                             data=data.reshape(np_dims), field=field)
