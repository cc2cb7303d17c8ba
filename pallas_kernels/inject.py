"""Ring write: K norm + rope and V of every layer scattered into the K/V ring, one launch.

Grid (layer, kv head, row tile). Each program normalises and ropes `block_rows` rows of one
(layer, kv head) and scatters them into their ring slots: `positions % S` for a sliding ring
(wrap=True), `positions` for a full-attention cache (wrap=False: rows at positions >= S write
nothing; the caller checks capacity). The (0, 0, tile) programs also write `ring_pos`. The
ring buffers are aliased input -> output, so under a donating `jax.jit` the update happens in
place.

Duplicate slots (two rows mapping to the same slot, e.g. T > S) resolve to the later row,
deterministically: a row is stored only if no later valid row maps to its slot, so every
slot has at most one writer and concurrent programs never race.

Any T, S and even head_dim: row tiles past T and the halves of a head_dim whose half is not a
power of 2 are masked (pow2 tiles, see _common); shapes the tiles fit run unmasked.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import (check, is_pow2, load_tile, next_pow2, resolve_interpret)
from pallas_kernels.limits import check_head_dim
from pallas_kernels.norm_rope import rms_rope_halves

_FLOAT_STORAGE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _inject_kernel(n_valid_ref, pos_ref, inv_ref, kn_ref, k_ref, v_ref, _rk_in, _rv_in,
                   _rp_in, rk_out, rv_out, rp_out, *, n_rows: int, d: int, eps: float,
                   attention_scaling: float, wrap: bool):
  br = k_ref.shape[0]
  h = d // 2
  hp = next_pow2(h)                       # a half's tile; lanes >= h masked when wider
  col_lim = None if hp == h else h
  s = rk_out.shape[0]
  ragged = n_rows % br != 0               # the last row tile runs past T
  # Grid ids are read at the top level: interpret mode cannot discharge them inside a cond.
  writes_pos = (pl.program_id(0) == 0) & (pl.program_id(1) == 0)
  tile = pl.program_id(2)
  n_eff = jnp.clip(n_valid_ref[0], 0, n_rows)
  rows = tile * br + jnp.arange(br, dtype=jnp.int32)

  def row_lim(c):
    return n_rows - c * br if ragged else None

  def slots(c):
    pos = load_tile(pos_ref, (c * br,), (br,), (row_lim(c),))
    return pos, (lax.rem(pos, s) if wrap else pos)

  pos, slot = slots(tile)

  # A row is overridden when a later valid row maps to the same slot; only tiles from this
  # one up to the last valid row can hold such a row.
  def scan_tile(c, overridden):
    later_rows = c * br + jnp.arange(br, dtype=jnp.int32)
    later_slot = slots(c)[1]
    hit = ((later_slot[None, :] == slot[:, None]) & (later_rows[None, :] > rows[:, None])
           & (later_rows[None, :] < n_eff))
    return jnp.maximum(overridden, jnp.max(hit.astype(jnp.int32), axis=1))

  overridden = lax.fori_loop(tile, (n_eff + br - 1) // br, scan_tile,
                             jnp.zeros((br,), jnp.int32))
  keep = (rows < n_eff) & (overridden == 0)
  if not wrap:
    keep &= (slot >= 0) & (slot < s)      # past the cache's capacity: nothing is written

  @pl.when(jnp.max(keep.astype(jnp.int32)) > 0)
  def _store():
    # Dropped lanes get distinct out-of-range slots: the mask stops them on the GPU, and
    # interpret mode's masked scatter (which writes the old value back for masked lanes)
    # then drops them instead of racing a live lane on a shared slot.
    dst = jnp.where(keep, slot, s + jnp.arange(br, dtype=jnp.int32))
    lims = (row_lim(tile), col_lim)
    halves = [load_tile(k_ref, (0, c0), (br, hp), lims).astype(jnp.float32) for c0 in (0, h)]
    k1, k2 = rms_rope_halves(*halves, load_tile(kn_ref, (0,), (hp,), (col_lim,)),
                             load_tile(kn_ref, (h,), (hp,), (col_lim,)), pos,
                             load_tile(inv_ref, (0,), (hp,), (col_lim,)), eps, d,
                             attention_scaling)
    m = keep[:, None]
    half = jnp.arange(hp, dtype=jnp.int32)[None, :]
    if col_lim is not None:
      m &= half < h
    plt.store(rk_out.at[dst[:, None], half], k1.astype(rk_out.dtype), mask=m)
    plt.store(rk_out.at[dst[:, None], half + h], k2.astype(rk_out.dtype), mask=m)
    if col_lim is None:
      full = jnp.arange(d, dtype=jnp.int32)[None, :]
      plt.store(rv_out.at[dst[:, None], full],
                load_tile(v_ref, (0, 0), (br, d), lims).astype(rv_out.dtype), mask=m)
    else:   # head_dim not a power of 2: V moves as two masked halves too
      for c0 in (0, h):
        v = load_tile(v_ref, (0, c0), (br, hp), lims)
        plt.store(rv_out.at[dst[:, None], half + c0], v.astype(rv_out.dtype), mask=m)

    # ring_pos is shared by all layers and heads: one program column writes it.
    @pl.when(writes_pos)
    def _store_pos():
      plt.store(rp_out.at[dst], pos, mask=keep)


def _check_shapes(name: str, ring_k, ring_v, ring_pos, kv, k_norm, positions, n_valid,
                  inv_freq) -> tuple[int, int, int, int, int]:
  """Shape and dtype checks shared by the kernel and its twin; returns (L, Hkv, S, D, T)."""
  check(ring_k.ndim == 4, name, "ring_k must be rank 4 [L, Hkv, S, D]", ring_k.shape)
  n_layer, hkv, s, d = ring_k.shape
  check(ring_v.shape == ring_k.shape, name, "ring_v shape must equal ring_k's",
        (ring_v.shape, ring_k.shape))
  check(d >= 2 and d % 2 == 0, name, "head_dim must be even and >= 2", d)
  check(s >= 1 and n_layer >= 1 and hkv >= 1, name, "L, Hkv and S (ring slots) must be >= 1",
        (n_layer, hkv, s))
  for arr, nm in ((ring_k, "ring_k"), (ring_v, "ring_v"), (kv, "kv")):
    check(arr.dtype in _FLOAT_STORAGE, name, f"{nm} dtype must be float32 or bfloat16",
          arr.dtype)
  check(ring_pos.shape == (s,), name, f"ring_pos shape must be (S,) = {(s,)}", ring_pos.shape)
  check(ring_pos.dtype == jnp.int32, name, "ring_pos dtype must be int32", ring_pos.dtype)
  check(kv.ndim == 5, name, "kv must be rank 5 [T, L, 2, Hkv, D]", kv.shape)
  t = kv.shape[0]
  check(t >= 1, name, "T (rows of kv) must be >= 1", t)
  check(kv.shape[1:] == (n_layer, 2, hkv, d), name,
        f"kv shape must be [T, L, 2, Hkv, D] = [T, {n_layer}, 2, {hkv}, {d}]", kv.shape)
  check(k_norm.shape == (n_layer, d), name, f"k_norm shape must be (L, D) = {(n_layer, d)}",
        k_norm.shape)
  check(k_norm.dtype == jnp.float32, name, "k_norm dtype must be float32", k_norm.dtype)
  check(positions.shape == (t,), name, f"positions shape must be (T,) = {(t,)}",
        positions.shape)
  check(positions.dtype == jnp.int32, name, "positions dtype must be int32", positions.dtype)
  check(n_valid.shape in ((), (1,)), name, "n_valid must be a scalar or (1,)", n_valid.shape)
  check(n_valid.dtype == jnp.int32, name, "n_valid dtype must be int32", n_valid.dtype)
  check(inv_freq.shape == (d // 2,), name, f"inv_freq shape must be (D/2,) = {(d // 2,)}",
        inv_freq.shape)
  check(inv_freq.dtype == jnp.float32, name, "inv_freq dtype must be float32", inv_freq.dtype)
  return n_layer, hkv, s, d, t


@functools.partial(jax.jit, static_argnames=["eps", "attention_scaling", "wrap", "block_rows",
                                             "num_warps", "num_stages", "interpret"])
def inject(ring_k: jax.Array, ring_v: jax.Array, ring_pos: jax.Array, kv: jax.Array,
           k_norm: jax.Array, positions: jax.Array, n_valid: jax.Array, inv_freq: jax.Array,
           *, eps: float, attention_scaling: float = 1.0, wrap: bool = True,
           block_rows: int = 16, num_warps: int = 4, num_stages: int = 1,
           interpret: bool | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Writes rows t < n_valid of every layer into the ring at their slots.

  ring_k, ring_v: [L, Hkv, S, D] float32 or bfloat16; ring_pos: [S] int32; kv:
  [T, L, 2, Hkv, D] (0 = K before norm, 1 = V) float32 or bfloat16, exactly the L layers of
  this ring; k_norm: [L, D] float32; positions: [T] int32, >= 0; n_valid: int32 scalar or
  (1,); inv_freq: [D/2] float32. Slot of row t: positions[t] % S (wrap=True, a sliding ring)
  or positions[t] (wrap=False, a full-attention cache; rows with positions[t] >= S write
  nothing). K is stored after rms_head(k_norm[l]) and NEOX rope at positions[t] (cos and sin
  times attention_scaling, `norm_rope.rms_rope_halves`); V raw; both
  cast to the ring dtype. Later rows win on equal slots. Returns the updated (ring_k, ring_v,
  ring_pos), aliased to the inputs. Any T >= 1 and S >= 1; head_dim a multiple of 16 up to
  256 (`limits.check_head_dim`).
  """
  name = "inject"
  n_layer, hkv, s, d, t = _check_shapes(name, ring_k, ring_v, ring_pos, kv, k_norm,
                                        positions, n_valid, inv_freq)
  check_head_dim(name, d)
  check(is_pow2(block_rows), name, "block_rows must be a power of 2", block_rows)
  n_tiles = pl.cdiv(t, block_rows)
  kernel = functools.partial(_inject_kernel, n_rows=t, d=d, eps=eps,
                             attention_scaling=attention_scaling, wrap=wrap)
  # Row tiles past T and a head width 2 H' (H' the power of 2 >= D/2) past D hang over the
  # arrays' ends; the kernel masks those lanes (0.11.2 Triton does not mask block reads).
  dp = 2 * next_pow2(d // 2)
  ring_spec = pl.BlockSpec((None, None, s, d), lambda l, h, r: (l, h, 0, 0))
  pos_spec = pl.BlockSpec((s,), lambda l, h, r: (0,))
  return pl.pallas_call(
      kernel,
      grid=(n_layer, hkv, n_tiles),
      in_specs=[
          pl.BlockSpec((1,), lambda l, h, r: (0,)),
          pl.BlockSpec((n_tiles * block_rows,), lambda l, h, r: (0,)),
          pl.BlockSpec((dp // 2,), lambda l, h, r: (0,)),
          pl.BlockSpec((None, dp), lambda l, h, r: (l, 0)),
          pl.BlockSpec((block_rows, None, None, None, dp), lambda l, h, r: (r, l, 0, h, 0)),
          pl.BlockSpec((block_rows, None, None, None, dp), lambda l, h, r: (r, l, 1, h, 0)),
          ring_spec, ring_spec, pos_spec,
      ],
      out_specs=[ring_spec, ring_spec, pos_spec],
      out_shape=[
          jax.ShapeDtypeStruct(ring_k.shape, ring_k.dtype),
          jax.ShapeDtypeStruct(ring_v.shape, ring_v.dtype),
          jax.ShapeDtypeStruct(ring_pos.shape, ring_pos.dtype),
      ],
      input_output_aliases={6: 0, 7: 1, 8: 2},
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=resolve_interpret(interpret),
      name=name,
  )(n_valid.reshape(1), positions, inv_freq, k_norm, kv, kv, ring_k, ring_v, ring_pos)


@functools.partial(jax.jit, static_argnames=["eps", "attention_scaling", "wrap"])
def inject_reference(ring_k: jax.Array, ring_v: jax.Array, ring_pos: jax.Array, kv: jax.Array,
                     k_norm: jax.Array, positions: jax.Array, n_valid: jax.Array,
                     inv_freq: jax.Array, *, eps: float, attention_scaling: float = 1.0,
                     wrap: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Pure-jnp twin of `inject` (same arguments, minus the tuning knobs); any shape."""
  n_layer, hkv, s, d, t = _check_shapes("inject_reference", ring_k, ring_v, ring_pos, kv,
                                        k_norm, positions, n_valid, inv_freq)
  h = d // 2
  rows = jnp.arange(t)
  slot = positions % s if wrap else positions
  valid = rows < n_valid.reshape(())
  if not wrap:
    valid &= (slot >= 0) & (slot < s)
  later = (rows[None, :] > rows[:, None]) & valid[None, :] & (slot[None, :] == slot[:, None])
  # Only the last valid row per slot is scattered, so the scatter has no duplicate index.
  dst = jnp.where(valid & ~later.any(axis=1), slot, s)

  k = kv[:, :, 0].astype(jnp.float32).transpose(1, 2, 0, 3).reshape(n_layer, hkv * t, d)
  pos = jnp.tile(positions, hkv)

  def norm_rope(x, wn):  # one layer: [Hkv*T, D]
    return jnp.concatenate(rms_rope_halves(x[:, :h], x[:, h:], wn[:h], wn[h:], pos, inv_freq,
                                           eps, d, attention_scaling), axis=-1)

  k = jax.vmap(norm_rope)(k, k_norm).reshape(n_layer, hkv, t, d)
  v = kv[:, :, 1].transpose(1, 2, 0, 3)
  return (ring_k.at[:, :, dst].set(k.astype(ring_k.dtype), mode="drop"),
          ring_v.at[:, :, dst].set(v.astype(ring_v.dtype), mode="drop"),
          ring_pos.at[dst].set(positions, mode="drop"))
