"""Exact top-k along the last axis of float32 rows: `lax.top_k`'s answer (each row's k largest
values, largest first, equal values in ascending index order) in two launches.

Stage 1, one program per (row, block of `block_v` lanes): the block's own top k, by k rounds
of (largest key, the lowest lane holding it, that lane taken out). Stage 2, one program per
row: the same rounds over the row's C * k stage-1 candidates. The row's top k are among its
blocks' top k, and a block's candidates come out in the order lax.top_k ranks them, blocks in
lane order, so ranking the candidates by position among equal keys ranks them by index.

Values are ranked as int32 keys in the total order lax.top_k uses (XLA sorts floats that way):
-NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN, so signed zeros and NaNs come out where
lax.top_k puts them, and the key gives the value back bit for bit. A taken lane and a lane past
the row's end hold the smallest key; the one input that key also stands for (the NaN whose
bits are all ones) may rank after them.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import (KnobsBase, check, is_pow2, load_tile, next_pow2,
                                    resolve_interpret, store_tile)

# Both stages unroll k rounds; the selector's k is 16.
MAX_K = 64
_KEY_MIN = -2 ** 31
# Stage-2 candidates per row `default_knobs` aims at, and its block range.
_MERGE_LANES = 1024
_MIN_BLOCK, _MAX_BLOCK = 256, 4096


@dataclasses.dataclass(frozen=True)
class Knobs(KnobsBase):
  block_v: int       # stage 1's lanes per program (a power of 2 >= k)
  num_warps: int     # stage 1's warps
  merge_warps: int   # stage 2's warps


def default_knobs(v: int, k: int) -> Knobs:
  """Stage 1's block and both stages' warps for rows of v lanes.

  A program's k rounds are a chain of dependent reductions, whose latency rather than the
  block's length sets its time, so stage 1 is fastest with many programs in flight: small
  blocks. Each block hands k candidates to stage 2, where one program per row runs the same
  rounds over all of them, so the blocks must not be so small that stage 2 gets long: the
  smallest power-of-2 block that leaves about _MERGE_LANES candidates per row, within
  [_MIN_BLOCK, _MAX_BLOCK]. For the selector's 15 draft rows and k = 16 that gives 32 blocks
  of 256 at a vocabulary of 8192 (480 programs) and 50 of 4096 at 202048 (750), several per
  SM of a 132-SM GPU, and 512 or 800 candidates in stage 2. Warps: about 8 to 32 lanes per
  thread.
  """
  block = min(max(next_pow2(-(-v * k // _MERGE_LANES)), _MIN_BLOCK), _MAX_BLOCK, next_pow2(v))
  merge = next_pow2(-(-v // block) * k)
  warps = lambda lanes: max(1, min(4, lanes // 256))
  return Knobs(block_v=block, num_warps=warps(block), merge_warps=warps(merge))


def _flip(b: jax.Array) -> jax.Array:
  """A float's int32 bits <-> its key (the map is its own inverse): negative floats' bits
  other than the sign flipped, so the keys' signed order is the floats' total order."""
  return b ^ ((b >> 31) & jnp.int32(0x7FFFFFFF))


def _keys(x: jax.Array) -> jax.Array:
  return _flip(lax.bitcast_convert_type(x, jnp.int32))


def _values(key: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(_flip(key), jnp.float32)


def _rounds(key: jax.Array, idx, k: int, kp: int) -> tuple[jax.Array, jax.Array]:
  """k rounds over a [lanes] tile of keys: ([kp] the keys taken, largest first, [kp] their
  indices; slots past k hold the smallest key and index 0). idx: the lanes' indices, a
  [lanes] tile or an int32 scalar, the index of lane 0 (lane i's is idx + i). argmax gives
  the lowest lane of the largest key (the Triton lowering keeps the smaller index of equal
  values); the rounds' chain runs through the key tile alone."""
  lane = lax.broadcasted_iota(jnp.int32, key.shape, 0)
  slot = lax.broadcasted_iota(jnp.int32, (kp,), 0)
  top = jnp.full((kp,), _KEY_MIN, jnp.int32)
  at = jnp.zeros((kp,), jnp.int32)
  for t in range(k):
    i = jnp.argmax(key).astype(jnp.int32)
    index = idx + i if idx.ndim == 0 else jnp.sum(jnp.where(lane == i, idx, 0))  # one term
    top = jnp.where(slot == t, jnp.max(key), top)
    at = jnp.where(slot == t, index, at)
    if t + 1 < k:
      key = jnp.where(lane == i, _KEY_MIN, key)
  return top, at


def _block_kernel(x_ref, key_ref, idx_ref, *, v: int, k: int):
  block, kp = x_ref.shape[0], key_ref.shape[0]
  start = pl.program_id(2) * block
  lim = None if v % block == 0 else v - start
  key = _keys(load_tile(x_ref, (0,), (block,), (lim,)))
  if lim is not None:
    key = jnp.where(lax.broadcasted_iota(jnp.int32, (block,), 0) < lim, key, _KEY_MIN)
  top, at = _rounds(key, start, k, kp)
  out_lim = (None if kp == k else k,)
  store_tile(key_ref, (0,), top, out_lim)
  store_tile(idx_ref, (0,), at, out_lim)


def _merge_kernel(key_ref, idx_ref, val_ref, out_idx_ref, *, n: int, k: int):
  lanes, kp = key_ref.shape[0], val_ref.shape[0]
  lim = (None if lanes == n else n,)
  key = load_tile(key_ref, (0,), (lanes,), lim, other=_KEY_MIN)
  idx = load_tile(idx_ref, (0,), (lanes,), lim, other=0)
  top, at = _rounds(key, idx, k, kp)
  out_lim = (None if kp == k else k,)
  store_tile(val_ref, (0,), _values(top), out_lim)
  store_tile(out_idx_ref, (0,), at, out_lim)


def _check_args(name: str, x: jax.Array, k: int, first: int) -> None:
  check(x.ndim >= 2, name, "x must be [..., T, V]", x.shape)
  check(x.dtype == jnp.float32, name, "x must be float32", x.dtype)
  check(0 <= first < x.shape[-2], name, "first must be in [0, T)", (first, x.shape))
  check(1 <= k <= x.shape[-1], name, "k must be in [1, V]", (k, x.shape[-1]))


@functools.partial(jax.jit, static_argnames=["k", "first", "block_v", "num_warps",
                                             "merge_warps", "interpret"])
def top_k(x: jax.Array, *, k: int, first: int = 0, block_v: int | None = None,
          num_warps: int | None = None, merge_warps: int | None = None,
          interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """lax.top_k(x[..., first:, :], k) for float32 x [..., T, V]: (values [..., T - first, k]
  float32, indices int32). The rows before `first` of each [T, V] slab are not read (no copy
  of the rest is made). Knobs left None take `default_knobs(V, k)`'s."""
  name = "top_k"
  _check_args(name, x, k, first)
  check(k <= MAX_K, name, f"k must be <= {MAX_K}", k)
  *lead, t, v = x.shape
  d = default_knobs(v, k)
  block_v = d.block_v if block_v is None else block_v
  num_warps = d.num_warps if num_warps is None else num_warps
  merge_warps = d.merge_warps if merge_warps is None else merge_warps
  check(is_pow2(block_v) and block_v >= k, name, "block_v must be a power of 2 >= k", block_v)
  x3 = x.reshape(-1, t, v)
  b, rows, n_blocks, kp = x3.shape[0], t - first, -(-v // block_v), next_pow2(k)
  interpret = resolve_interpret(interpret)
  cand_spec = pl.BlockSpec((None, None, None, kp), lambda i, r, c: (i, r, c, 0))
  keys, idx = pl.pallas_call(
      functools.partial(_block_kernel, v=v, k=k),
      grid=(b, rows, n_blocks),
      # The last block hangs over V's end when block_v does not divide it; the kernel masks it.
      in_specs=[pl.BlockSpec((None, None, block_v), lambda i, r, c: (i, r + first, c))],
      out_specs=[cand_spec, cand_spec],
      out_shape=[jax.ShapeDtypeStruct((b, rows, n_blocks, k), jnp.int32)] * 2,
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="top_k_blocks",
  )(x3)
  n = n_blocks * k
  lanes = next_pow2(n)
  row_in = pl.BlockSpec((None, lanes), lambda r: (r, 0))
  row_out = pl.BlockSpec((None, kp), lambda r: (r, 0))
  vals, out = pl.pallas_call(
      functools.partial(_merge_kernel, n=n, k=k),
      grid=(b * rows,),
      in_specs=[row_in, row_in],
      out_specs=[row_out, row_out],
      out_shape=[jax.ShapeDtypeStruct((b * rows, k), jnp.float32),
                 jax.ShapeDtypeStruct((b * rows, k), jnp.int32)],
      compiler_params=plt.CompilerParams(num_warps=merge_warps, num_stages=1),
      interpret=interpret, name="top_k_merge",
  )(keys.reshape(b * rows, n), idx.reshape(b * rows, n))
  shape = (*lead, rows, k)
  return vals.reshape(shape), out.reshape(shape)


def top_k_reference(x: jax.Array, *, k: int, first: int = 0) -> tuple[jax.Array, jax.Array]:
  """The jnp twin: lax.top_k of the rows from `first` on."""
  _check_args("top_k_reference", x, k, first)
  return lax.top_k(x[..., first:, :], k)
