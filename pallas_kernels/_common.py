"""Helpers shared by the kernel modules."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


@dataclasses.dataclass(frozen=True)
class KnobsBase:
  """What each kernel module's `Knobs` (a frozen dataclass of its launch knobs, the value its
  `default_knobs` returns) shares: the fields are the kernel's keyword arguments."""

  def kwargs(self) -> dict:
    """The knobs as the kernel's keyword arguments."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def resolve_interpret(interpret: bool | None) -> bool:
  """None means: compile for the GPU when the default backend is one, else interpret."""
  if interpret is None:
    return jax.default_backend() != "gpu"
  return bool(interpret)


def hopper_available() -> bool:
  """A Hopper-class GPU is the default backend: Mosaic GPU's wgmma and TMA kernels run."""
  if jax.default_backend() != "gpu":
    return False
  return float(getattr(jax.devices()[0], "compute_capability", "0")) >= 9.0


def smem_transforms(minor: int, dtype):
  """Mosaic GPU shared-memory tiling + swizzle for tiles whose minor dimension has `minor`
  elements of `dtype` (the widest swizzle that row fits)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(minor * bits)
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def bf16_parts(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x float32 -> (hi, lo) bf16 with x = hi + lo to ~16 mantissa bits: hi is x rounded to
  the nearest even bf16 by integer ops, lo the rounded remainder. Integer ops because XLA
  may drop a float32 -> bf16 -> float32 round trip (excess precision is allowed), which
  would leave lo = 0 (found on the H200); no compiler folds these. Runs in XLA and in
  Pallas Triton kernel bodies alike."""
  u = lax.bitcast_convert_type(x, jnp.uint32)
  u = (u + (jnp.uint32(0x7FFF) + ((u >> 16) & jnp.uint32(1)))) & jnp.uint32(0xFFFF0000)
  hi = lax.bitcast_convert_type(u, jnp.float32)
  return hi.astype(jnp.bfloat16), (x - hi).astype(jnp.bfloat16)


def split_parts(x: jax.Array, terms: int) -> list[jax.Array]:
  """x float32 -> `terms` bf16 parts whose sum is x to ~8 `terms` mantissa bits: each part is
  the bf16 rounding of what the earlier parts leave (3 parts: float32 accuracy)."""
  parts = []
  for _ in range(terms):
    part = x.astype(jnp.bfloat16)
    parts.append(part)
    x = x - part.astype(jnp.float32)
  return parts


def _bdot(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
  return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())),
                         preferred_element_type=jnp.float32)


def split_dot(a_parts: list[jax.Array], b: jax.Array, contract_b: int) -> jax.Array:
  """(sum of a_parts) times b (contracting a's axis 1 with b's axis contract_b), accurate to
  the parts' precision with bf16 MMAs: b is bf16 (exact as one part) or float32 (split into as
  many parts); the part products of order < terms are summed, smallest first, so they are not
  lost against the large ones. Runs in Pallas Triton kernel bodies (where a float32 dot would
  run as TF32) and in interpret mode alike."""
  terms = len(a_parts)
  b_parts = [b] if b.dtype == jnp.bfloat16 else split_parts(b, terms)
  pairs = sorted(((i, j) for i in range(terms) for j in range(len(b_parts)) if i + j < terms),
                 key=lambda ij: -(ij[0] + ij[1]))
  out = None
  for i, j in pairs:
    prod = _bdot(a_parts[i], b_parts[j], contract_b)
    out = prod if out is None else out + prod
  return out


def is_pow2(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
  """The smallest power of 2 >= n (n >= 1)."""
  return 1 << (n - 1).bit_length()


def check(cond: bool, kernel: str, limit: str, value) -> None:
  """Raise a ValueError naming the kernel, the violated limit and the offending value."""
  if not cond:
    raise ValueError(f"{kernel}: {limit} (got {value})")


# Pallas Triton (jax 0.11.2) needs every loaded or stored tensor to have a power-of-2 size and
# does not mask block reads past an array's end. Kernels therefore work on power-of-2 tiles
# and mask the lanes past the real extent; a tile whose extent is the whole tile (every shape
# the tiles already fit) gets a plain, unmasked access, the same code as before masking.


def _view(ref, starts: Sequence, sizes: Sequence):
  # A size of None indexes that axis with the scalar start (the axis is dropped); as an int32
  # array, which interpret mode's masked load needs (a Python int has no shape).
  return ref.at[tuple(jnp.int32(s) if n is None else pl.ds(s, n)
                      for s, n in zip(starts, sizes))]


def tile_mask(sizes: Sequence[int], limits: Sequence) -> jax.Array | None:
  """Lanes of a `sizes` tile whose index along each axis is below that axis' limit (None: no
  limit on that axis; a limit may be traced); None when no axis has a limit."""
  mask = None
  for axis, limit in enumerate(limits):
    if limit is None:
      continue
    m = lax.broadcasted_iota(jnp.int32, tuple(sizes), axis) < limit
    mask = m if mask is None else mask & m
  return mask


def load_tile(ref, starts: Sequence, sizes: Sequence, limits: Sequence, other=0):
  """ref[starts[i] : starts[i] + sizes[i], ...] as a tile; lanes at or past an axis' limit
  (relative to its start) are not read and hold `other`. A size of None reads the single
  index starts[i] of that axis (dropped from the tile; its limit is ignored)."""
  view = _view(ref, starts, sizes)
  kept = [i for i, n in enumerate(sizes) if n is not None]
  mask = tile_mask([sizes[i] for i in kept], [limits[i] for i in kept])
  if mask is None:
    return view[...]
  return plt.load(view, mask=mask, other=other)


def store_tile(ref, starts: Sequence, value: jax.Array, limits: Sequence) -> None:
  """Stores `value` at ref[starts[i] : starts[i] + value.shape[i], ...], lanes at or past an
  axis' limit (relative to its start) left unwritten."""
  view = _view(ref, starts, value.shape)
  mask = tile_mask(value.shape, limits)
  if mask is None:
    view[...] = value
  else:
    plt.store(view, value, mask=mask)
