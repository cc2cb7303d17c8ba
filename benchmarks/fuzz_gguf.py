"""Fuzz of the drafter GGUF loader: seeded mutants of small drafter files must load or fail cleanly.

  python -m benchmarks.fuzz_gguf --mutants 50000 [--seed 0]     # the long fuzz (minutes)

Every mutant of a valid drafter file (bit flips, integers planted in the header's count/length/
type/offset slots, truncations, byte splices) must either load or raise DrafterFormatError;
any other exception, a load using more than `time_limit_s` of CPU time (CPU, not wall, time:
a loaded machine must not fail the fuzz) or one whose traced peak allocation exceeds
`memory_bound(file size)` is a failure, reported with the seed and mutant index that
rebuild it (`mutant(bases, seed, index)`). tests/test_fuzz_gguf.py runs a few thousand in CI.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import tempfile
import time
import tracemalloc
from typing import Callable

import gguf
import numpy as np

import dflash_jax as dfj
from dflash_jax.io import DrafterFormatError
from dflash_jax.io import gguf as gguf_io

# Small, but with every axis > 1 and Q8_0-compatible widths (multiples of 32).
FUZZ_CONFIG = dfj.DFlashConfig(n_layer=1, n_embd=32, n_ff=64, n_head=2, n_head_kv=1,
                               head_dim=16, rope_theta=1e4, eps=1e-6, target_layers=(1, 3),
                               mask_token_id=5, block_size=8, window=64)
# Two layers of different attention kinds, with a context length: the metadata of newer files
# (a bool array per layer, one more integer).
MIXED_CONFIG = dataclasses.replace(FUZZ_CONFIG, n_layer=2, context_length=256,
                                   layer_types=("sliding_attention", "full_attention"))
TOKENS = 40   # a string array like the target vocab that real drafter files carry


def memory_bound(size: int) -> int:
  """The most a load may allocate: a few times the file (a Q8_0 matrix dequantizes to 3.8x its
  bytes as float32), plus a fixed allowance for Python objects."""
  return 8 * size + (1 << 20)


@dataclasses.dataclass(frozen=True)
class Base:
  """A valid drafter file and the positions of the integers in its header."""
  name: str
  data: bytes
  header_end: int                       # start of the tensor data
  slots: tuple[tuple[int, int], ...]    # (offset, byte width) of every u32/u64 header integer


def _slots(path: str) -> tuple[int, tuple[tuple[int, int], ...]]:
  """The header integers' positions, found by gguf's own reader on the valid file."""
  reader = gguf.GGUFReader(path)
  origin = reader.data.__array_interface__["data"][0]
  fields = list(reader.fields.values()) + [t.field for t in reader.tensors]
  slots = set()
  for field in fields:
    for part in field.parts:
      if part.dtype.itemsize in (4, 8) and part.dtype.kind in "ui":
        start = part.__array_interface__["data"][0] - origin
        slots.update((start + k * part.dtype.itemsize, part.dtype.itemsize)
                     for k in range(part.size))
  return reader.data_offset, tuple(sorted(slots))


def _with_tokens(src: str, dst: str) -> None:
  """A copy of the drafter file `src` plus a tokenizer string array (as llama.cpp's converter
  copies the target's vocab into drafter files)."""
  reader = gguf.GGUFReader(src)
  writer = gguf.GGUFWriter(dst, gguf_io.ARCH)
  for field in reader.fields.values():
    if field.name.startswith("GGUF.") or field.name == gguf_io.KEY_ARCH:
      continue
    vtype = field.types[0]
    sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
  writer.add_array("tokenizer.ggml.tokens", [f"tok{i}\u00e9" for i in range(TOKENS)])
  for t in reader.tensors:
    writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def make_bases(directory: str, seed: int = 0) -> list[Base]:
  """Drafter files written by save_drafter (F32, Q8_0) and one of mixed layer kinds with a
  vocab string array."""
  w = dfj.synthetic_drafter(FUZZ_CONFIG, seed=seed, with_target=False)
  paths = {}
  for tensor_type in ("F32", "Q8_0"):
    paths[tensor_type] = dfj.save_drafter(os.path.join(directory, f"base_{tensor_type}.gguf"),
                                          FUZZ_CONFIG, w, tensor_type=tensor_type)
  mixed = dfj.save_drafter(os.path.join(directory, "base_mixed.gguf"), MIXED_CONFIG,
                           dfj.synthetic_drafter(MIXED_CONFIG, seed=seed, with_target=False),
                           tensor_type="Q8_0")
  paths["mixed Q8_0+tokens"] = os.path.join(directory, "base_mixed_tokens.gguf")
  _with_tokens(mixed, paths["mixed Q8_0+tokens"])
  bases = []
  for name, path in paths.items():
    dfj.load_drafter(path)   # every base is valid
    header_end, slots = _slots(path)
    with open(path, "rb") as f:
      bases.append(Base(name, f.read(), header_end, slots))
  return bases


def _planted(rng: np.random.Generator, base: Base, width: int, pos: int) -> int:
  size = len(base.data)
  old = int.from_bytes(base.data[pos:pos + width], "little")
  top = 2**(8 * width) - 1
  choices = [0, 1, 2, 13, top, top >> 1, (top >> 1) + 1, 2**31, size, size + 1, size - pos,
             (old + int(rng.integers(-3, 4))) % (top + 1), int(rng.integers(0, 2**32)),
             int(rng.integers(0, 2**63)) * 2 % (top + 1), old * 2, old << 16]
  return choices[int(rng.integers(len(choices)))] & top


def _bit_flips(rng, base: Base) -> bytes:
  data = bytearray(base.data)
  in_header = rng.random() < 0.8
  for _ in range(int(rng.integers(1, 9))):
    pos = int(rng.integers(base.header_end if in_header else len(data)))
    data[pos] ^= 1 << int(rng.integers(8))
  return bytes(data)


def _plant(rng, base: Base) -> bytes:
  data = bytearray(base.data)
  for _ in range(int(rng.integers(1, 3))):
    pos, width = base.slots[int(rng.integers(len(base.slots)))]
    data[pos:pos + width] = _planted(rng, base, width, pos).to_bytes(width, "little")
  return bytes(data)


def _truncate(rng, base: Base) -> bytes:
  cut = int(rng.integers(base.header_end + 64)) if rng.random() < 0.6 else \
      int(rng.integers(len(base.data)))
  return base.data[:min(cut, len(base.data) - 1)]


def _splice(rng, base: Base) -> bytes:
  data, size = base.data, len(base.data)
  limit = base.header_end if rng.random() < 0.7 else size
  a, n = int(rng.integers(limit)), int(rng.integers(1, 65))
  b = int(rng.integers(limit))
  chunk = data[a:a + n]
  kind = int(rng.integers(3))
  if kind == 0:   # overwrite in place
    return data[:b] + chunk + data[b + len(chunk):]
  if kind == 1:   # insert: everything after b shifts
    return data[:b] + chunk + data[b:]
  return data[:b] + data[b + n:]   # delete


MUTATORS: dict[str, Callable[[np.random.Generator, Base], bytes]] = {
    "bit_flips": _bit_flips, "plant": _plant, "truncate": _truncate, "splice": _splice}


def mutant(bases: list[Base], seed: int, index: int) -> tuple[str, bytes]:
  """(description, bytes) of mutant `index` of the fuzz seeded `seed`: a pure function."""
  rng = np.random.default_rng([seed, index])
  base = bases[int(rng.integers(len(bases)))]
  name = list(MUTATORS)[int(rng.integers(len(MUTATORS)))]
  return f"{name} of {base.name}", MUTATORS[name](rng, base)


class _Timeout(Exception):
  pass


def _alarm(signum, frame):
  raise _Timeout()


@dataclasses.dataclass
class Report:
  n: int = 0
  loaded: int = 0
  rejected: int = 0
  failures: list[str] = dataclasses.field(default_factory=list)
  slowest_cpu_s: float = 0.0
  max_peak_ratio: float = 0.0   # traced peak allocation / memory_bound(file size)
  wall_s: float = 0.0


def run(n: int, seed: int = 0, time_limit_s: float = 5.0, directory: str | None = None,
        load: Callable[[str], object] = dfj.load_drafter) -> Report:
  """Loads mutants 0..n-1 of the fuzz seeded `seed` with `load` and reports the outcomes."""
  report = Report()
  t_start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="dflash_fuzz_", dir=directory) as tmp:
    bases = make_bases(tmp, seed)
    path = os.path.join(tmp, "mutant.gguf")
    previous = signal.signal(signal.SIGPROF, _alarm)
    tracemalloc.start()
    try:
      for i in range(n):
        what, data = mutant(bases, seed, i)
        with open(path, "wb") as f:
          f.write(data)
        tracemalloc.reset_peak()
        base_mem = tracemalloc.get_traced_memory()[0]
        t0 = time.process_time()
        signal.setitimer(signal.ITIMER_PROF, time_limit_s)
        try:
          load(path)
          report.loaded += 1
        except DrafterFormatError as e:
          report.rejected += 1
          if path not in str(e):
            report.failures.append(f"mutant {i} ({what}): the error does not name the file: {e}")
        except _Timeout:
          report.failures.append(f"mutant {i} ({what}): no answer within {time_limit_s} s of CPU")
        except Exception as e:   # noqa: anything else is what the fuzz looks for
          report.failures.append(f"mutant {i} ({what}): {type(e).__name__}: {e}")
        finally:
          signal.setitimer(signal.ITIMER_PROF, 0)
        dt = time.process_time() - t0
        peak = tracemalloc.get_traced_memory()[1] - base_mem
        ratio = peak / memory_bound(len(data))
        if ratio > 1:
          report.failures.append(f"mutant {i} ({what}): allocated {peak} bytes for a "
                                 f"{len(data)}-byte file (bound {memory_bound(len(data))})")
        report.slowest_cpu_s = max(report.slowest_cpu_s, dt)
        report.max_peak_ratio = max(report.max_peak_ratio, ratio)
        report.n += 1
    finally:
      tracemalloc.stop()
      signal.signal(signal.SIGPROF, previous)
  report.wall_s = time.perf_counter() - t_start
  return report


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--mutants", type=int, default=50000)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--time-limit", type=float, default=5.0, help="CPU seconds per load")
  args = p.parse_args(argv)
  r = run(args.mutants, args.seed, args.time_limit)
  print(f"{r.n} mutants: {r.loaded} loaded, {r.rejected} rejected with DrafterFormatError, "
        f"{len(r.failures)} failures; slowest load {r.slowest_cpu_s:.3f} s of CPU, peak allocation "
        f"{r.max_peak_ratio:.2f} of the bound; {r.wall_s:.0f} s")
  for f in r.failures[:50]:
    print("FAIL", f)
  return 1 if r.failures else 0


if __name__ == "__main__":
  sys.exit(main())
