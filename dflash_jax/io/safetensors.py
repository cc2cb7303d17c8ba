"""Safetensors checkpoints (one `model.safetensors`, or shards with an index) as numpy arrays.

Every header is checked first, with bounds: a truncated or hostile file fails before any tensor
data is touched, with an error naming the file and the tensor. The check pins each tensor's
bytes (offsets that tile the data section exactly), so reading is positional file reads
straight into a fresh array per tensor: no memory map, and a caller that hands each tensor on
(to a device) holds about one tensor on the host at a time (`iter_tensors`). bf16 tensors arrive as
`ml_dtypes.bfloat16` arrays (`a.astype(np.float32)` is exact); every other dtype as the numpy
dtype of the same name. Writing goes through the `safetensors` package's numpy API (no torch)
and is atomic per file: each file is written under a temporary name and renamed into place, a
sharded index last.
"""
from __future__ import annotations

import json
import os
import re
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Iterator, Mapping, NamedTuple

import ml_dtypes
import numpy as np
from safetensors import numpy as st_numpy

from dflash_jax.io import atomic
from dflash_jax.io.errors import SafetensorsFormatError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Real headers are KBs (a few MB for the largest single shards); the format's own cap is 100 MB.
# A bound this size keeps a hostile header from costing more than a fraction of a second.
MAX_HEADER_BYTES = 16 << 20
MAX_INDEX_BYTES = 64 << 20
_SHARD_NAME = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
# safetensors dtype name -> numpy dtype, for the dtypes this module reads and writes.
DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
# Tensor data is read in pieces of this many bytes, up to READ_THREADS at a time.
READ_CHUNK = 64 << 20
READ_THREADS = 8
# Names accepted by `write_tensors(dtype=...)` for casting floating tensors.
CAST_DTYPES = {"f32": DTYPES["F32"], "f16": DTYPES["F16"], "bf16": DTYPES["BF16"]}


class TensorSpec(NamedTuple):
  """One tensor as its header states it: safetensors dtype name, shape, the file holding it,
  and where its bytes start in that file."""
  dtype: str
  shape: tuple[int, ...]
  file: str
  offset: int

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * DTYPES[self.dtype].itemsize


def _fail(where: str, message: str) -> SafetensorsFormatError:
  return SafetensorsFormatError(f"{where}: {message}")


# ---------------------------------------------------------------------------------------------
# Reading


def tensor_specs(path: str | os.PathLike) -> dict[str, TensorSpec]:
  """Every tensor's header entry, checked, without reading tensor data.

  `path` is a checkpoint folder (holding `model.safetensors` or `model.safetensors.index.json`,
  not both), a `.safetensors` file, or an index file. Raises SafetensorsFormatError naming the
  file (and the tensor) on any inconsistency, FileNotFoundError when nothing is there.
  """
  files = _resolve(os.fspath(path))
  specs: dict[str, TensorSpec] = {}
  if files.index is None:
    for name, (dtype, shape, offset) in _checked_header(files.shards[0]).items():
      specs[name] = TensorSpec(dtype, shape, files.shards[0], offset)
    return specs
  by_shard: dict[str, list[str]] = {}
  for name, shard in files.weight_map.items():
    by_shard.setdefault(shard, []).append(name)
  for shard in sorted(by_shard):
    header = _checked_header(shard)
    for name, (dtype, shape, offset) in header.items():
      if name in specs:
        raise _fail(files.index, f"tensor {name!r} is in two shards: "
                    f"{os.path.basename(specs[name].file)} and {os.path.basename(shard)}")
      specs[name] = TensorSpec(dtype, shape, shard, offset)
  for name, shard in files.weight_map.items():
    if name not in specs:
      raise _fail(files.index, f"tensor {name!r} is mapped to {os.path.basename(shard)}, "
                  "which does not hold it")
    if specs[name].file != shard:
      raise _fail(files.index, f"tensor {name!r} is mapped to {os.path.basename(shard)} but "
                  f"stored in {os.path.basename(specs[name].file)}")
  unlisted = sorted(set(specs) - set(files.weight_map))
  if unlisted:
    raise _fail(files.index, f"tensors {unlisted[:8]} are in shards but not in the weight_map "
                f"({len(unlisted)} in all)")
  return specs


def read_tensors(path: str | os.PathLike,
                 names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
  """The tensors of a safetensors checkpoint (see `tensor_specs` for `path`), as stored.

  Returns name -> writable numpy array in the stored dtype (bf16 as `ml_dtypes.bfloat16`),
  owning its memory (no view of the file), in the order of `names` (default: every tensor).
  Every header is checked before any data is read.
  """
  specs = tensor_specs(path)
  wanted = list(specs) if names is None else list(names)
  out = dict(iter_tensors(specs, wanted, os.fspath(path)))
  return {name: out[name] for name in wanted}


def iter_tensors(specs: Mapping[str, TensorSpec], names: Iterable[str],
                 where: str = "checkpoint") -> Iterator[tuple[str, np.ndarray]]:
  """(name, array) for each of `names`, read one at a time from the files `specs` (from
  `tensor_specs`) point at: file by file, each in the order of its bytes. Each array is fresh
  and writable, in the stored dtype, filled by positional reads of `READ_CHUNK` bytes on a few
  threads (a single reader does not reach the page cache's or an NVMe's bandwidth); the host
  holds only the one being yielded (and what the caller keeps). A name not in `specs` is an
  error naming `where`, raised before anything is read."""
  names = list(names)
  missing = [n for n in names if n not in specs]
  if missing:
    raise _fail(where, f"no tensors named {missing[:8]}")
  if sys.byteorder != "little":
    raise _fail(where, "safetensors data is little-endian; this host is big-endian")
  by_file: dict[str, list[str]] = {}
  for name in names:
    by_file.setdefault(specs[name].file, []).append(name)
  with ThreadPoolExecutor(min(READ_THREADS, os.cpu_count() or 1)) as pool:
    for file in sorted(by_file):
      try:
        fd = os.open(file, os.O_RDONLY)
      except OSError as e:
        raise _fail(file, f"could not read it: {e}") from e
      try:
        for name in sorted(by_file[file], key=lambda n: specs[n].offset):
          yield name, _read(fd, specs[name], name, pool)
      finally:
        os.close(fd)


def _read(fd: int, spec: TensorSpec, name: str, pool: ThreadPoolExecutor) -> np.ndarray:
  a = np.empty(spec.shape, DTYPES[spec.dtype])
  buf = memoryview(a.reshape(-1).view(np.uint8))

  def fill(lo: int) -> None:
    hi = min(lo + READ_CHUNK, spec.nbytes)
    while lo < hi:
      try:
        n = os.preadv(fd, [buf[lo:hi]], spec.offset + lo)
      except OSError as e:
        raise _fail(spec.file, f"could not read tensor {name!r}: {e}") from e
      if not n:
        raise _fail(spec.file, f"tensor {name!r}: the file ended inside its bytes (it "
                    "changed since its header was checked)")
      lo += n

  list(pool.map(fill, range(0, spec.nbytes, READ_CHUNK)))
  return a


class _Files(NamedTuple):
  shards: list[str]
  index: str | None
  weight_map: dict[str, str]   # tensor name -> shard path (empty without an index)


def _resolve(path: str) -> _Files:
  if os.path.isdir(path):
    single, index = os.path.join(path, SINGLE_FILE), os.path.join(path, INDEX_FILE)
    has_single, has_index = os.path.isfile(single), os.path.isfile(index)
    if has_single and has_index:
      raise _fail(path, f"holds both {SINGLE_FILE} and {INDEX_FILE}; which one is the "
                  "checkpoint is ambiguous (remove the stale one)")
    if not (has_single or has_index):
      raise FileNotFoundError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} in this folder")
    path = single if has_single else index
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such safetensors file or folder")
  if path.endswith(".json"):
    weight_map = _read_index(path)
    return _Files(sorted(set(weight_map.values())), path, weight_map)
  return _Files([path], None, {})


def read_json_object(path: str, max_bytes: int) -> dict[str, Any]:
  """The JSON object in `path` (a file of at most `max_bytes`), or SafetensorsFormatError."""
  size = os.path.getsize(path)
  if size > max_bytes:
    raise _fail(path, f"{size} bytes, over the {max_bytes}-byte bound for this JSON file")
  try:
    with open(path, "rb") as f:
      value = json.loads(f.read().decode("utf-8"))
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise _fail(path, f"not valid JSON: {e}") from e
  if not isinstance(value, dict):
    raise _fail(path, f"holds a JSON {type(value).__name__}, expected an object")
  return value


def _read_index(path: str) -> dict[str, str]:
  weight_map = read_json_object(path, MAX_INDEX_BYTES).get("weight_map")
  if not isinstance(weight_map, dict) or not weight_map:
    raise _fail(path, "no 'weight_map' object (tensor name -> shard file)")
  folder = os.path.dirname(path)
  out = {}
  for name, shard in weight_map.items():
    if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard \
        or shard.startswith("."):
      raise _fail(path, f"weight_map[{name!r}] = {shard!r} is not a shard file name in this "
                  "folder")
    full = os.path.join(folder, shard)
    if not os.path.isfile(full):
      raise _fail(path, f"weight_map[{name!r}] names shard {shard!r}, which does not exist")
    out[name] = full
  # HF shard names count the shards: an index that maps no tensor to one of them lost entries.
  counts = {m.group(2) for m in map(_SHARD_NAME.fullmatch, map(os.path.basename, out.values()))
            if m}
  for count in counts:
    unused = sorted(set(f"model-{i:05d}-of-{count}.safetensors" for i in range(1, int(count) + 1))
                    - set(map(os.path.basename, out.values())))
    if unused:
      raise _fail(path, f"no tensor in the weight_map is in shard(s) {unused[:4]} of {int(count)}")
  return out


def _checked_header(path: str) -> dict[str, tuple[str, tuple[int, ...], int]]:
  """name -> (dtype, shape, file offset of its bytes) from the header of `path`, after checking
  the header against the file: bounded length, valid JSON, known dtypes, and data offsets that
  tile the data section exactly (no gap, no overlap, each span = prod(shape) * itemsize,
  nothing past the end)."""
  size = os.path.getsize(path)
  if size < 8:
    raise _fail(path, f"{size} bytes: too short for a safetensors header (truncated?)")
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    if n > size - 8:
      raise _fail(path, f"header length {n} runs past the end of the file ({size} bytes): "
                  "truncated, or not a safetensors file")
    if n > MAX_HEADER_BYTES:
      raise _fail(path, f"header length {n} is over the {MAX_HEADER_BYTES}-byte bound")
    raw = f.read(n)
  try:
    header = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise _fail(path, f"header is not valid JSON (not a safetensors file?): {e}") from e
  if not isinstance(header, dict):
    raise _fail(path, "header is not a JSON object")
  metadata = header.pop("__metadata__", {})
  if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
    raise _fail(path, "__metadata__ must map strings to strings")
  data_size = size - 8 - n
  entries = []
  out = {}
  for name, info in header.items():
    dtype, shape, begin, end = _checked_entry(path, name, info)
    nbytes = int(np.prod(shape, dtype=object)) * DTYPES[dtype].itemsize
    if end - begin != nbytes:
      raise _fail(path, f"tensor {name!r}: data_offsets [{begin}, {end}] span {end - begin} "
                  f"bytes, but {dtype} {list(shape)} needs {nbytes}")
    if end > data_size:
      raise _fail(path, f"tensor {name!r} ends at data byte {end}, but the file holds only "
                  f"{data_size} data bytes: truncated")
    entries.append((begin, end, name))
    out[name] = (dtype, shape, 8 + n + begin)
  entries.sort()
  at, prev = 0, None
  for begin, end, name in entries:
    if begin < at:
      raise _fail(path, f"tensor {name!r} (bytes {begin}..{end}) overlaps tensor {prev!r}")
    if begin > at:
      raise _fail(path, f"tensor {name!r} starts at data byte {begin}, leaving a gap after "
                  f"{'the header' if prev is None else repr(prev)} (byte {at})")
    at, prev = end, name
  if at != data_size:
    raise _fail(path, f"the tensors cover {at} data bytes but the file holds {data_size} "
                "(trailing bytes)")
  return out


def _checked_entry(path: str, name: str, info: Any) -> tuple[str, tuple[int, ...], int, int]:
  if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
    raise _fail(path, f"tensor {name!r}: header entry must have exactly dtype, shape and "
                f"data_offsets, got {info!r:.200}")
  dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
  if dtype not in DTYPES:
    raise _fail(path, f"tensor {name!r} has dtype {dtype!r}; supported: {sorted(DTYPES)}")
  if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
    raise _fail(path, f"tensor {name!r}: shape {shape!r:.200} is not a list of non-negative ints")
  if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_uint, offsets))
          and offsets[0] <= offsets[1]):
    raise _fail(path, f"tensor {name!r}: data_offsets {offsets!r:.200} is not [begin, end] "
                "with 0 <= begin <= end")
  return dtype, tuple(shape), offsets[0], offsets[1]


def _is_uint(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# ---------------------------------------------------------------------------------------------
# Writing


def cast(name: str, a: np.ndarray, dtype: str) -> np.ndarray:
  """`a` as "f32", "f16" or "bf16" (round to nearest even), C-contiguous; a finite value that
  overflows the target dtype is an error naming the tensor."""
  if dtype not in CAST_DTYPES:
    raise ValueError(f"dtype must be one of {sorted(CAST_DTYPES)} or None, got {dtype!r}")
  a = np.asarray(a)
  if not np.issubdtype(a.dtype, np.floating) and a.dtype != DTYPES["BF16"]:
    raise ValueError(f"tensor {name!r} is {a.dtype}, not floating: cannot store it as {dtype}")
  with np.errstate(over="ignore"):
    out = np.ascontiguousarray(a.astype(CAST_DTYPES[dtype]))
  overflow = np.isfinite(a) & ~np.isfinite(out)
  if overflow.any():
    raise ValueError(f"tensor {name!r} overflows {dtype} (max |value| = "
                     f"{np.abs(a.astype(np.float64)).max()})")
  return out


def write_tensors(folder: str | os.PathLike, tensors: Mapping[str, np.ndarray], *,
                  dtype: str | None, max_shard_bytes: int | None = None) -> str:
  """Writes `tensors` as `folder/model.safetensors`, or as shards plus an index when they
  exceed `max_shard_bytes`; returns the path of the file or index written.

  `dtype` ("f32", "f16", "bf16") casts every tensor (see `cast`); None keeps each array's
  dtype (one of DTYPES). Shards hold whole tensors, in the order given, each at most
  `max_shard_bytes` (a larger tensor gets a shard of its own). Each file appears only
  complete (temp name + rename; the index last), and a checkpoint of the other layout left in
  the folder is removed after the new one is in place, so the folder never holds both.
  """
  folder = os.fspath(folder)
  if max_shard_bytes is not None and max_shard_bytes <= 0:
    raise ValueError(f"max_shard_bytes must be positive or None, got {max_shard_bytes}")
  arrays = {}
  for name, a in tensors.items():
    if not isinstance(name, str) or not name:
      raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
    a = cast(name, a, dtype) if dtype is not None else np.ascontiguousarray(a)
    if a.dtype not in DTYPES.values():
      raise ValueError(f"tensor {name!r} is {a.dtype}; safetensors here stores {sorted(DTYPES)}")
    arrays[name] = a
  if not arrays:
    raise ValueError("no tensors to write")
  shards = _plan_shards(arrays, max_shard_bytes)
  os.makedirs(folder, exist_ok=True)
  if len(shards) == 1:
    files = {SINGLE_FILE: shards[0]}
  else:
    files = {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": s
             for i, s in enumerate(shards)}
  temps: dict[str, str] = {}
  try:
    for file, names in files.items():
      temps[file] = atomic.temp_beside(os.path.join(folder, file))
      st_numpy.save_file({n: arrays[n] for n in names}, temps[file], metadata={"format": "pt"})
    if len(files) > 1:
      index = {"metadata": {"total_size": sum(a.nbytes for a in arrays.values())},
               "weight_map": {n: file for file, names in files.items() for n in names}}
      temps[INDEX_FILE] = atomic.temp_beside(os.path.join(folder, INDEX_FILE))
      with open(temps[INDEX_FILE], "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    if len(files) == 1:  # an index beside the new single file would make the folder ambiguous
      _remove_if_present(os.path.join(folder, INDEX_FILE))
    for file in temps:    # shards first, the index (the sharded layout's commit point) last
      atomic.publish(temps[file], os.path.join(folder, file))
    temps.clear()
  finally:
    for tmp in temps.values():
      atomic.discard(tmp)
  for stale in os.listdir(folder):
    if (_SHARD_NAME.fullmatch(stale) or stale == SINGLE_FILE) and stale not in files:
      _remove_if_present(os.path.join(folder, stale))
  return os.path.join(folder, SINGLE_FILE if len(files) == 1 else INDEX_FILE)


def _plan_shards(arrays: Mapping[str, np.ndarray], limit: int | None) -> list[list[str]]:
  shards: list[list[str]] = [[]]
  used = 0
  for name, a in arrays.items():
    if limit is not None and shards[-1] and used + a.nbytes > limit:
      shards.append([])
      used = 0
    shards[-1].append(name)
    used += a.nbytes
  return shards


def _remove_if_present(path: str) -> None:
  try:
    os.unlink(path)
  except FileNotFoundError:
    pass
