"""Gated DeltaNet recurrence kernels (Qwen3.5 / 3.6 / 3.8 hybrid targets), each beside its
jnp twin (the twin is the impl="xla" path and the kernel's test oracle).

Per value head j (key head j // (nv / nk)) and row t, with q already l2-normed and scaled by
1/sqrt(dk) and k l2-normed, the gated delta rule on the state S [dk, dv] (float32):

  S <- exp(g_t) S;   u = beta_t (v_t - S^T k_t);   S <- S + k_t u^T;   o_t = S^T q_t

(o_t from the updated S). States are stacked over a target's Gated DeltaNet layers,
[B, L, nv, dk, dv] (the batch axis first, as in every cache array), and the kernels take
the layer as an int32 operand that indexes the stacked array inside the kernel: one compiled
kernel then serves every layer (a layer in an index map would compile one kernel per
layer), and no layer's state is sliced out of the stack first (XLA would copy it).

- `recurrent`: the rows one at a time (decode, verify). Each program holds a [dk, block_v]
  block of S in registers for all T rows: S is read once per call, never written (a verify
  commits nothing); o per row, and with snapshots S after every row.
- `replay`: the commit of a verify under the replay rollback: every layer's S advanced by the
  first n_keep[b] of that verify's rows, in place, in one launch. Rows past n_keep run with
  g = beta = 0, which leaves S bitwise unchanged, so S after the replay is bitwise the state
  `recurrent` computed after row n_keep - 1 (the kernels: the same row code; the twins are
  two XLA programs that may fuse differently, equal to rounding).
- `chunked`: prefill, C rows at a time in the chunked (WY / UT transform) form: inside a chunk
  the rows' updates of each other are one unit lower triangular solve, applied with matrix
  products; across chunks the state carries. Updates the layer's state in place. Rows with
  g = beta = 0 (padding) leave the state unchanged.

Shapes: q, k [.., T, nk, dk]; v [.., T, nv, dv]; g, beta [.., T, nv]; all float32. dk and dv
are powers of 2 in [16, 256]; T in [1, limits.MAX_WIDTH] for `recurrent` and `replay`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import check, is_pow2, load_tile, next_pow2, resolve_interpret
from pallas_kernels.limits import check_width

PRECISIONS = {"ieee": lax.Precision.HIGHEST, "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3}


@dataclasses.dataclass(frozen=True)
class Knobs:
  """block_v: value columns of S per program (a power of 2 dividing dv; >= 16 for `chunked`,
  whose products need 16-wide tiles). chunk: rows per chunk of `chunked` (a power of 2 >= 16;
  smaller when the prefill is shorter). precision: `chunked`'s matrix products, "ieee" (fp32
  on the CUDA cores) or "tf32x3" (three tf32 tensor-core passes, about fp32 accurate).
  Not tuned on the GPU yet."""
  block_v: int = 32
  chunk: int = 32
  precision: str = "ieee"
  num_warps: int = 4


def default_knobs(dv: int) -> Knobs:
  return Knobs(block_v=min(32, dv))


# --- the math, shared by kernels and twins (so that both round alike) --------------------------

def row_step(s, q, k, v, g, beta):
  """One row of the rule. s [..., dk, V]; q, k [..., dk]; v [..., V]; g broadcasts against s
  and beta against v (scalars in a kernel, [..., 1, 1] and [..., 1] in a twin).
  Returns (S after the row, o [..., V])."""
  s = s * jnp.exp(g)
  u = (v - jnp.sum(s * k[..., :, None], axis=-2)) * beta
  s = s + k[..., :, None] * u[..., None, :]
  return s, jnp.sum(s * q[..., :, None], axis=-2)


def _mm(a, b, contract, precision):
  return lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def unit_lower_inverse(a: jax.Array) -> jax.Array:
  """(I + a)^-1 for a [C, C] strictly lower triangular, by forward substitution: row i of the
  inverse is e_i - sum_{s<i} a[i, s] row_s. Elementwise ops only (Triton cannot index a row of
  a register tile), C^2 per row."""
  c = a.shape[-1]
  rows = lax.broadcasted_iota(jnp.int32, (c, c), 0)
  cols = lax.broadcasted_iota(jnp.int32, (c, c), 1)
  unit = lax.broadcasted_iota(jnp.int32, (c,), 0)
  ident = jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32)

  def body(i, inv):
    a_i = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)            # [C]: row i of a
    new = jnp.where(unit == i, 1.0, 0.0) - jnp.sum(a_i[:, None] * inv, axis=0)
    return jnp.where(rows == i, new[None, :], inv)
  return lax.fori_loop(1, c, body, ident)


def chunk_step(s, q, k, v, g, beta, precision=lax.Precision.HIGHEST):
  """C rows of the rule at once. s [dk, V]; q, k [C, dk]; v [C, V]; g, beta [C].
  Returns (o [C, V], S after the C rows).

  With gam = cumsum(g) and D[t, s] = exp(gam_t - gam_s) for s <= t (0 above): the rows'
  corrections u solve (I + A) U = beta V - (beta exp(gam)) K S0 with A = beta_t D K K^T
  strictly below the diagonal, so U = T beta V - W S0 for T = (I + A)^-1 and
  W = T (beta exp(gam)) K; then O = exp(gam) Q S0 + (D * Q K^T) U and
  S = exp(gam_C) S0 + (exp(gam_C - gam) K)^T U. Every exponent is <= 0."""
  c = g.shape[-1]
  rows = lax.broadcasted_iota(jnp.int32, (c, c), 0)
  cols = lax.broadcasted_iota(jnp.int32, (c, c), 1)
  gam = jnp.cumsum(g)
  last = jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, (c,), 0) == c - 1, gam, 0.0))
  lower = cols <= rows
  decay = jnp.where(lower, jnp.exp(jnp.where(lower, gam[:, None] - gam[None, :], 0.0)), 0.0)
  nt, nn, tn = ((1,), (1,)), ((1,), (0,)), ((0,), (0,))
  a = jnp.where(cols < rows, (beta[:, None] * decay) * _mm(k, k, nt, precision), 0.0)
  t = unit_lower_inverse(a)
  eg = jnp.exp(gam)
  w = _mm(t, (beta * eg)[:, None] * k, nn, precision)                  # [C, dk]
  u = _mm(t, beta[:, None] * v, nn, precision) - _mm(w, s, nn, precision)
  o = eg[:, None] * _mm(q, s, nn, precision) + _mm(decay * _mm(q, k, nt, precision), u, nn,
                                                   precision)
  s = jnp.exp(last) * s + _mm(jnp.exp(last - gam)[:, None] * k, u, tn, precision)
  return o, s


# --- checks -------------------------------------------------------------------------------------

def _check(name: str, q, k, v, g, beta, state, lead: int) -> tuple[int, ...]:
  """Shapes and dtypes shared by kernels and twins; returns (T, nk, dk, nv, dv)."""
  for nm, a in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
    check(a.dtype == jnp.float32, name, f"{nm} dtype must be float32", a.dtype)
  check(q.ndim == lead + 3 and q.shape == k.shape, name,
        f"q and k must be [B, {'L, ' * (lead - 1)}T, nk, dk] alike", (q.shape, k.shape))
  *outer, t, nk, dk = q.shape
  check(v.ndim == q.ndim and tuple(v.shape[:-2]) == tuple(q.shape[:-2]), name,
        "v must be [..., T, nv, dv] over q's leading axes", v.shape)
  nv, dv = v.shape[-2:]
  check(nv % nk == 0, name, "nv must be a multiple of nk", (nv, nk))
  for nm, a in (("g", g), ("beta", beta)):
    check(a.shape == tuple(v.shape[:-1]), name, f"{nm} must be [..., T, nv]", a.shape)
  check(state.ndim == 5 and tuple(state.shape[2:]) == (nv, dk, dv)
        and tuple(state.shape[:len(outer)]) == tuple(outer), name,
        "state must be [B, L, nv, dk, dv]", (state.shape, q.shape, v.shape))
  return t, nk, dk, nv, dv


def _check_dims(name: str, dk: int, dv: int, knobs: Knobs, min_block: int = 1) -> None:
  for nm, d in (("dk", dk), ("dv", dv)):
    check(is_pow2(d) and 16 <= d <= 256, name, f"{nm} must be a power of 2 in [16, 256]", d)
  bv = knobs.block_v
  check(is_pow2(bv) and min_block <= bv <= dv, name,
        f"knobs.block_v must be a power of 2 in [{min_block}, dv]", (bv, dv))


def _layer_index(layer) -> jax.Array:
  return jnp.asarray(layer, jnp.int32).reshape(1)


# --- recurrent (decode / verify) ----------------------------------------------------------------

def _recurrent_kernel(layer_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, *rest, t_rows: int,
                      bv: int, snapshots: bool):
  # rest: (snaps in, when aliased), o, (snaps out, with snapshots).
  o_ref = rest[-2] if snapshots else rest[-1]
  snap_ref = rest[-1] if snapshots else None
  b, j, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  lay = layer_ref[0]
  cols = pl.ds(vb * bv, bv)
  s = s_ref[b, lay, j, :, cols]
  tp = next_pow2(t_rows)
  lim = (None if tp == t_rows else t_rows,)
  gs, betas = load_tile(g_ref, (0,), (tp,), lim), load_tile(b_ref, (0,), (tp,), lim)
  idx = lax.broadcasted_iota(jnp.int32, (tp,), 0)
  for t in range(t_rows):
    g = jnp.sum(jnp.where(idx == t, gs, 0.0))
    beta = jnp.sum(jnp.where(idx == t, betas, 0.0))
    s, o = row_step(s, q_ref[t, :], k_ref[t, :], v_ref[t, :], g, beta)
    o_ref[t, :] = o
    if snapshots:
      snap_ref[b, lay, t, j, :, cols] = s


@functools.partial(jax.jit, static_argnames=("knobs", "interpret", "snapshot_layers"))
def recurrent(q, k, v, g, beta, state, layer, snaps=None, *, snapshot_layers: int = 0,
              knobs: Knobs | None = None, interpret: bool | None = None):
  """The rows of one layer, one at a time, from state[:, layer] (read, not written).

  q, k [B, T, nk, dk]; v [B, T, nv, dv]; g, beta [B, T, nv]; state [B, L, nv, dk, dv];
  layer: int32 scalar. Returns o [B, T, nv, dv], or (o, snaps) with snapshots: snaps
  [B, Ls, T, nv, dk, dv] holds S after every row at [:, layer]. Pass snaps (that buffer, from
  the previous layer's call; updated in place) or snapshot_layers = Ls to start a new one
  (its other layers are left unwritten)."""
  name = "gdn.recurrent"
  t, nk, dk, nv, dv = _check(name, q, k, v, g, beta, state, 1)
  knobs = knobs or default_knobs(dv)
  _check_dims(name, dk, dv, knobs)
  check_width(name, t)
  bsz, r, bv, tp = q.shape[0], nv // nk, knobs.block_v, next_pow2(t)
  with_snaps = snaps is not None or snapshot_layers > 0
  if snaps is not None:
    check(snaps.ndim == 6 and snaps.shape[0] == bsz and snaps.shape[2:] == (t, nv, dk, dv)
          and snaps.dtype == jnp.float32, name, "snaps must be float32 [B, Ls, T, nv, dk, dv]",
          (snaps.shape, snaps.dtype))
  gt, bt = jnp.swapaxes(g, 1, 2), jnp.swapaxes(beta, 1, 2)          # [B, nv, T]
  full = lambda a: pl.BlockSpec(a.shape, lambda b, j, vb: (0,) * len(a.shape))
  in_specs = [
      pl.BlockSpec((1,), lambda b, j, vb: (0,)),
      pl.BlockSpec((None, tp, None, dk), lambda b, j, vb: (b, 0, j // r, 0)),
      pl.BlockSpec((None, tp, None, dk), lambda b, j, vb: (b, 0, j // r, 0)),
      pl.BlockSpec((None, tp, None, bv), lambda b, j, vb: (b, 0, j, vb)),
      pl.BlockSpec((None, None, tp), lambda b, j, vb: (b, j, 0)),
      pl.BlockSpec((None, None, tp), lambda b, j, vb: (b, j, 0)),
      full(state)]
  args = [_layer_index(layer), q, k, v, gt, bt, state]
  out_shape = [jax.ShapeDtypeStruct((bsz, t, nv, dv), jnp.float32)]
  out_specs = [pl.BlockSpec((None, tp, None, bv), lambda b, j, vb: (b, 0, j, vb))]
  aliases = {}
  if with_snaps:
    shape = snaps.shape if snaps is not None else (bsz, snapshot_layers, t, nv, dk, dv)
    out_shape.append(jax.ShapeDtypeStruct(shape, jnp.float32))
    out_specs.append(pl.BlockSpec(shape, lambda b, j, vb: (0,) * 6))
    if snaps is not None:
      in_specs.append(full(snaps))
      args.append(snaps)
      aliases = {len(args) - 1: 1}
  kernel = functools.partial(_recurrent_kernel, t_rows=t, bv=bv, snapshots=with_snaps)
  outs = pl.pallas_call(
      kernel, grid=(bsz, nv, dv // bv), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, input_output_aliases=aliases,
      compiler_params=plt.CompilerParams(num_warps=knobs.num_warps, num_stages=1),
      interpret=resolve_interpret(interpret), name="gdn_recurrent",
  )(*args)
  return tuple(outs) if with_snaps else outs[0]


def _expand(x: jax.Array, r: int) -> jax.Array:
  """Key heads [..., nk, dk] -> one per value head [..., nv, dk] (value head j: key j // r)."""
  return jnp.repeat(x, r, axis=-2)


def _scan_rows(s, q, k, v, g, beta, with_o: bool, snapshots: bool):
  """Twin recurrence over rows: s [B, nv, dk, dv]; q, k [B, T, nv, dk] (expanded); v
  [B, T, nv, dv]; g, beta [B, T, nv]. Returns (S after the rows, o or None, snaps or None)."""
  def body(s, x):
    qt, kt, vt, gt, bt = x
    s, o = row_step(s, qt, kt, vt, gt[..., None, None], bt[..., None])
    return s, (o if with_o else None, s if snapshots else None)
  xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
  s, (o, snaps) = lax.scan(body, s, xs)
  return (s, None if o is None else jnp.moveaxis(o, 0, 1),
          None if snaps is None else jnp.moveaxis(snaps, 0, 1))


@functools.partial(jax.jit, static_argnames=("snapshot_layers",))
def recurrent_reference(q, k, v, g, beta, state, layer, snaps=None, *,
                        snapshot_layers: int = 0):
  """Pure-jnp twin of `recurrent` (same arguments minus the knobs)."""
  t, nk, dk, nv, dv = _check("gdn.recurrent_reference", q, k, v, g, beta, state, 1)
  r = nv // nk
  s0 = lax.dynamic_index_in_dim(state, jnp.asarray(layer, jnp.int32), 1, keepdims=False)
  with_snaps = snaps is not None or snapshot_layers > 0
  _, o, rows = _scan_rows(s0, _expand(q, r), _expand(k, r), v, g, beta, True, with_snaps)
  if not with_snaps:
    return o
  if snaps is None:
    snaps = jnp.zeros((rows.shape[0], snapshot_layers) + rows.shape[1:], jnp.float32)
  return o, snaps.at[:, layer].set(rows)


# --- replay (the commit of the replay rollback) -------------------------------------------------

def _replay_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, s_out_ref, *, t_rows: int,
                   bv: int):
  b, lay, j, vb = (pl.program_id(i) for i in range(4))
  cols = pl.ds(vb * bv, bv)
  s = s_ref[b, lay, j, :, cols]
  tp = next_pow2(t_rows)
  lim = (None if tp == t_rows else t_rows,)
  gs, betas = load_tile(g_ref, (0,), (tp,), lim), load_tile(b_ref, (0,), (tp,), lim)
  idx = lax.broadcasted_iota(jnp.int32, (tp,), 0)
  for t in range(t_rows):
    g = jnp.sum(jnp.where(idx == t, gs, 0.0))
    beta = jnp.sum(jnp.where(idx == t, betas, 0.0))
    s, _ = row_step(s, q_ref[t, :], k_ref[t, :], v_ref[t, :], g, beta)
  s_out_ref[b, lay, j, :, cols] = s


def _keep_mask(g, beta, n_keep):
  """g, beta [B, L, T, nv] with the rows at or past n_keep[b] zeroed (no-op rows)."""
  keep = jnp.arange(g.shape[2], dtype=jnp.int32)[None, :] < n_keep[:, None]   # [B, T]
  keep = keep[:, None, :, None]
  return jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0)


@functools.partial(jax.jit, static_argnames=("knobs", "interpret"))
def replay(q, k, v, g, beta, state, n_keep, *, knobs: Knobs | None = None,
           interpret: bool | None = None):
  """Every layer's S advanced by its first n_keep[b] rows (the output aliases state: in
  place inside a jit that donates it).

  q, k [B, L, T, nk, dk]; v [B, L, T, nv, dv]; g, beta [B, L, T, nv] (what `recurrent` ran
  in a verify, stacked over the layers); state [B, L, nv, dk, dv]; n_keep [B] int32 in
  [0, T]. Returns the new state."""
  name = "gdn.replay"
  t, nk, dk, nv, dv = _check(name, q, k, v, g, beta, state, 2)
  knobs = knobs or default_knobs(dv)
  _check_dims(name, dk, dv, knobs)
  check_width(name, t)
  bsz, nl, r, bv, tp = q.shape[0], q.shape[1], nv // nk, knobs.block_v, next_pow2(t)
  g, beta = _keep_mask(g, beta, jnp.asarray(n_keep, jnp.int32).reshape(bsz))
  gt, bt = jnp.swapaxes(g, 2, 3), jnp.swapaxes(beta, 2, 3)          # [B, L, nv, T]
  full = pl.BlockSpec(state.shape, lambda b, l, j, vb: (0,) * 5)
  return pl.pallas_call(
      functools.partial(_replay_kernel, t_rows=t, bv=bv),
      grid=(bsz, nl, nv, dv // bv),
      in_specs=[
          pl.BlockSpec((None, None, tp, None, dk), lambda b, l, j, vb: (b, l, 0, j // r, 0)),
          pl.BlockSpec((None, None, tp, None, dk), lambda b, l, j, vb: (b, l, 0, j // r, 0)),
          pl.BlockSpec((None, None, tp, None, bv), lambda b, l, j, vb: (b, l, 0, j, vb)),
          pl.BlockSpec((None, None, None, tp), lambda b, l, j, vb: (b, l, j, 0)),
          pl.BlockSpec((None, None, None, tp), lambda b, l, j, vb: (b, l, j, 0)),
          full],
      out_specs=full, out_shape=jax.ShapeDtypeStruct(state.shape, jnp.float32),
      input_output_aliases={5: 0},
      compiler_params=plt.CompilerParams(num_warps=knobs.num_warps, num_stages=1),
      interpret=resolve_interpret(interpret), name="gdn_replay",
  )(q, k, v, gt, bt, state)


@jax.jit
def replay_reference(q, k, v, g, beta, state, n_keep):
  """Pure-jnp twin of `replay`."""
  t, nk, dk, nv, dv = _check("gdn.replay_reference", q, k, v, g, beta, state, 2)
  r = nv // nk
  g, beta = _keep_mask(g, beta, jnp.asarray(n_keep, jnp.int32).reshape(q.shape[0]))
  run = lambda s, *x: _scan_rows(s, *x, False, False)[0]
  return jax.vmap(run, in_axes=1, out_axes=1)(state, _expand(q, r), _expand(k, r), v, g, beta)


# --- chunked (prefill) --------------------------------------------------------------------------

def _chunked_kernel(layer_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, s_out_ref, *,
                    n_chunks: int, c: int, bv: int, precision):
  b, j, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  lay = layer_ref[0]
  cols = pl.ds(vb * bv, bv)

  def body(i, s):
    rows = pl.ds(i * c, c)
    o, s = chunk_step(s, q_ref[rows, :], k_ref[rows, :], v_ref[rows, :], g_ref[rows],
                      b_ref[rows], precision)
    o_ref[rows, :] = o
    return s
  s_out_ref[b, lay, j, :, cols] = lax.fori_loop(0, n_chunks, body, s_ref[b, lay, j, :, cols])


def _chunk_rows(t: int, chunk: int) -> tuple[int, int]:
  """(rows per chunk, padded row count): the knob, or the prefill's own power of 2 (>= 16)
  when it is shorter; rows padded up to a whole number of chunks."""
  c = min(chunk, max(16, next_pow2(t)))
  return c, -(-t // c) * c


def _pad_rows(t_pad: int, *arrays):
  """Zero rows appended on axis 1 up to t_pad: with g = beta = 0 they leave S unchanged."""
  t = arrays[0].shape[1]
  return tuple(jnp.pad(a, [(0, 0), (0, t_pad - t)] + [(0, 0)] * (a.ndim - 2)) for a in arrays)


@functools.partial(jax.jit, static_argnames=("knobs", "interpret"))
def chunked(q, k, v, g, beta, state, layer, *, knobs: Knobs | None = None,
            interpret: bool | None = None):
  """The rows of one layer in chunks from state[:, layer] -> (o [B, T, nv, dv], state with
  [:, layer] advanced by every row; the output aliases state: in place inside a jit that
  donates it).

  q, k [B, T, nk, dk]; v [B, T, nv, dv]; g, beta [B, T, nv]; state [B, L, nv, dk, dv];
  layer: int32 scalar. Any T (padded inside to whole chunks)."""
  name = "gdn.chunked"
  t, nk, dk, nv, dv = _check(name, q, k, v, g, beta, state, 1)
  knobs = knobs or default_knobs(dv)
  _check_dims(name, dk, dv, knobs, min_block=16)
  check(is_pow2(knobs.chunk) and knobs.chunk >= 16, name,
        "knobs.chunk must be a power of 2 >= 16", knobs.chunk)
  check(knobs.precision in PRECISIONS, name, f"knobs.precision must be one of "
        f"{sorted(PRECISIONS)}", knobs.precision)
  bsz, r, bv = q.shape[0], nv // nk, knobs.block_v
  c, t_pad = _chunk_rows(t, knobs.chunk)
  q, k, v, g, beta = _pad_rows(t_pad, q, k, v, g, beta)
  gt, bt = jnp.swapaxes(g, 1, 2), jnp.swapaxes(beta, 1, 2)          # [B, nv, T']
  full = pl.BlockSpec(state.shape, lambda b, j, vb: (0,) * 5)
  o, state = pl.pallas_call(
      functools.partial(_chunked_kernel, n_chunks=t_pad // c, c=c, bv=bv,
                        precision=PRECISIONS[knobs.precision]),
      grid=(bsz, nv, dv // bv),
      in_specs=[
          pl.BlockSpec((1,), lambda b, j, vb: (0,)),
          pl.BlockSpec((None, t_pad, None, dk), lambda b, j, vb: (b, 0, j // r, 0)),
          pl.BlockSpec((None, t_pad, None, dk), lambda b, j, vb: (b, 0, j // r, 0)),
          pl.BlockSpec((None, t_pad, None, bv), lambda b, j, vb: (b, 0, j, vb)),
          pl.BlockSpec((None, None, t_pad), lambda b, j, vb: (b, j, 0)),
          pl.BlockSpec((None, None, t_pad), lambda b, j, vb: (b, j, 0)),
          full],
      out_specs=[pl.BlockSpec((None, t_pad, None, bv), lambda b, j, vb: (b, 0, j, vb)), full],
      out_shape=[jax.ShapeDtypeStruct((bsz, t_pad, nv, dv), jnp.float32),
                 jax.ShapeDtypeStruct(state.shape, jnp.float32)],
      input_output_aliases={6: 1},
      compiler_params=plt.CompilerParams(num_warps=knobs.num_warps, num_stages=1),
      interpret=resolve_interpret(interpret), name="gdn_chunked",
  )(_layer_index(layer), q, k, v, gt, bt, state)
  return o[:, :t], state


@functools.partial(jax.jit, static_argnames=("chunk",))
def chunked_reference(q, k, v, g, beta, state, layer, *, chunk: int = Knobs.chunk):
  """Pure-jnp twin of `chunked` (chunk: the knob of the same name)."""
  t, nk, dk, nv, dv = _check("gdn.chunked_reference", q, k, v, g, beta, state, 1)
  bsz, r = q.shape[0], nv // nk
  c, t_pad = _chunk_rows(t, chunk)
  q, k, v, g, beta = _pad_rows(t_pad, _expand(q, r), _expand(k, r), v, g, beta)

  def per_head(s, qh, kh, vh, gh, bh):   # s [dk, dv]; qh [n, C, dk]; gh [n, C]
    def body(s, x):
      o, s = chunk_step(s, *x)
      return s, o
    s, o = lax.scan(body, s, (qh, kh, vh, gh, bh))
    return o.reshape(t_pad, dv), s

  def heads(a):   # [B, T', nv, ...] -> [B, nv, n, C, ...]
    a = jnp.moveaxis(a, 2, 1)
    return a.reshape(bsz, nv, t_pad // c, c, *a.shape[3:])
  lay = jnp.asarray(layer, jnp.int32)
  s0 = lax.dynamic_index_in_dim(state, lay, 1, keepdims=False)
  o, s = jax.vmap(jax.vmap(per_head))(s0, *(heads(a) for a in (q, k, v, g, beta)))
  return jnp.moveaxis(o, 1, 2)[:, :t], state.at[:, lay].set(s)
