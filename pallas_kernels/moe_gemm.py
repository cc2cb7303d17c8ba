"""Grouped skinny GEMM over the experts a few rows route to: MoE decode and verify.

A mixture-of-experts layer stores its experts as one stacked array w [E, N, K] (the (out, in)
layout of each expert, K contiguous). A decode or verify call has few rows (M = sequences x
verify width), which route to a few experts each; together they touch a small set of
experts, listed in `expert_ids` [S] (each touched expert once, then -1 for unused slots).
Program (j, n) reads expert expert_ids[j]'s n-th tile of N rows, and only when the slot is
used, so a call streams the touched experts' bytes and nothing else. Every slot multiplies
all M rows (each row's own experts are picked out afterwards by its routing weights): at
these row counts the weight stream is the cost and the extra rows ride along for free.

Triton Pallas (jax 0.11.2) has no scalar prefetch: the expert list is a plain int32 operand
that each program reads first (one scalar load), then it offsets its weight loads by it.

  moe_matmul(x, w, ids)                 x [M, K] (every slot's rows) or [S, M, K] (per slot)
  moe_matmul(x, w_gu, ids, gate_up=True)  w_gu [E, 2 N, K], gate rows then up rows per expert:
                                        silu(x gate^T) * (x up^T) in the epilogue
-> [S, M, N], zeros in unused slots.

  moe_matmul(x, w_d, ids, routes=(route_ids, route_weights))
                                        the down projection's routed epilogue: route_ids [M, k]
                                        int32 and route_weights [M, k] float32 (each row's
                                        experts in routing order, every one of them in ids)
-> [k, M, N] float32: out[c, m] = route_weights[m, c] (x(j) @ w_d[e]^T)[m] for the slot j of
e = route_ids[m, c]. Each (c, m) is written once, by the program of that slot, with its row's
weight applied, so a row's k expert outputs leave the kernel as k split-K-like partials in
routing order, ready for the next pre-norm to add (no gather-and-sum launch in between).

Weights bf16; x is rounded to bf16 for the dot, the accumulation is float32 (the rounding
`dflash_jax.dispatch.linear` applies to bf16 weights). Feed x in bf16 where it can be (the
MoE target's pre-norm does): a float32 x is read at twice the bytes by every program and
slows the few-row GEMMs (RESULTS.md, `sweep moe`).
`moe_matmul_reference` is the jnp twin (impl="xla"): it gathers the listed experts.

Tiles: N and K must be multiples of block_n and block_k (every published MoE's expert dims
are multiples of 128). Each weight tile, read once, multiplies the rows 16 at a time, one dot
per 16-row chunk (a last chunk past M read and written under a row mask, so a decode's one
row needs no padded copy on either side): a row's result is then the same instruction
sequence whatever M is (a wider dot could move to another MMA instruction, wgmma
from 64 rows), so the product is batch invariant, as `skinny_gemm`'s row chunks make the
dense GEMMs.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import check, is_pow2, resolve_interpret

_DOT_NT = (((1,), (1,)), ((), ()))   # x [m, k] . w [n, k] -> [m, n]
MAX_ROWS = 64   # the accumulators of more rows would cost too many registers
ROW_CHUNK = 16  # the rows of one dot (module docstring)


def default_knobs(n: int, k: int, gate_up: bool = False) -> dict:
  """Tiles for one expert's [N, K] weight (n: the rows of one stream, n_ff for gate+up): the
  skinny GEMM's choices for one block of rows (128-wide K tiles; 32-row N tiles for the two
  accumulators of gate+up, 64 otherwise), shrunk to the largest power of two dividing a
  small dimension."""
  def fit(dim: int, tile: int) -> int:
    while tile > 16 and dim % tile:
      tile //= 2
    return tile
  return dict(block_n=fit(n, 32 if gate_up else 64), block_k=fit(k, 128), num_warps=4,
              num_stages=3)


def _kernel(ids_ref, x_ref, w_ref, *refs, gate_up: bool, m: int, n_out: int, k: int,
            block_n: int, block_k: int, n_routes: int):
  """Slot j = program_id(0), N tile program_id(1): o [M, block_n] of expert ids[j], or with
  n_routes > 0 (refs: route ids and weights [M, k], then o [k, M, block_n]) each row's
  weighted output stored at the choices that route it to ids[j]. The arrays hold exactly M
  rows: a last 16-row chunk past M is read and written under a row mask (no padded copies)."""
  o_ref = refs[-1]
  e = ids_ref[pl.program_id(0)]
  n0 = pl.multiple_of(pl.program_id(1) * block_n, block_n)
  chunks = pl.cdiv(m, ROW_CHUNK)
  n_w = 2 if gate_up else 1
  # [16, 1] per chunk: its rows below M (None: the whole chunk is).
  row_ok = [None if (c + 1) * ROW_CHUNK <= m else
            c * ROW_CHUNK + lax.broadcasted_iota(jnp.int32, (ROW_CHUNK, 1), 0) < m
            for c in range(chunks)]

  def rows_of(c: int):
    return pl.ds(c * ROW_CHUNK, ROW_CHUNK)

  def load_rows(ref, c: int, cols, other):
    if row_ok[c] is None:
      return ref[rows_of(c), cols]
    return plt.load(ref.at[rows_of(c), cols], mask=row_ok[c], other=other)

  def store_rows(c: int, value):
    if row_ok[c] is None:
      o_ref[rows_of(c), :] = value
    else:
      plt.store(o_ref.at[rows_of(c), :], value,
                mask=jnp.broadcast_to(row_ok[c], value.shape))

  @pl.when(e >= 0)
  def _():
    def step(kb, accs):
      k0 = pl.multiple_of(kb * block_k, block_k)
      ws = [w_ref[e, pl.ds(n0 + i * n_out, block_n), pl.ds(k0, block_k)].astype(jnp.bfloat16)
            for i in range(n_w)]
      new = []
      for c in range(chunks):
        x = load_rows(x_ref, c, pl.ds(k0, block_k), 0.0).astype(jnp.bfloat16)
        new += [accs[c * n_w + i] + lax.dot_general(x, w, _DOT_NT,
                                                    preferred_element_type=jnp.float32)
                for i, w in enumerate(ws)]
      return tuple(new)
    zeros = tuple(jnp.zeros((ROW_CHUNK, block_n), jnp.float32) for _ in range(chunks * n_w))
    accs = lax.fori_loop(0, k // block_k, step, zeros)
    if n_routes:
      rid_ref, rw_ref = refs[:2]
      for c in range(chunks):
        for r in range(n_routes):
          # Rows past M read route -1: never this slot's expert, so never stored.
          mine = load_rows(rid_ref, c, pl.ds(r, 1), -1) == e                # [16, 1]
          out = accs[c] * load_rows(rw_ref, c, pl.ds(r, 1), 0.0)
          plt.store(o_ref.at[pl.ds(r, 1), rows_of(c), :], out.astype(o_ref.dtype)[None],
                    mask=jnp.broadcast_to(mine, (ROW_CHUNK, block_n))[None])
      return
    for c in range(chunks):
      if gate_up:
        g, u = accs[2 * c], accs[2 * c + 1]
        out = g * jax.nn.sigmoid(g) * u
      else:
        out = accs[c]
      store_rows(c, out.astype(o_ref.dtype))

  if not n_routes:   # routed: a slot no row routes to has nothing to store
    @pl.when(e < 0)
    def _():
      # Chunk by chunk: the whole block is 48 rows at M = 33..48, not a power of 2.
      for c in range(chunks):
        store_rows(c, jnp.zeros((ROW_CHUNK, block_n), o_ref.dtype))


def _check_routes(kernel: str, routes, m: int, gate_up: bool, out_dtype) -> int:
  """The routed epilogue's operands -> k (0 without routes)."""
  if routes is None:
    return 0
  check(not gate_up, kernel, "routes with gate_up=False (the down projection)", gate_up)
  check(jnp.dtype(out_dtype) == jnp.float32, kernel, "out_dtype float32 with routes",
        out_dtype)
  check(isinstance(routes, tuple) and len(routes) == 2, kernel,
        "routes a tuple (route_ids, route_weights)", type(routes))
  rid, rw = routes
  check(rid.ndim == 2 and rid.shape[0] == m and rid.dtype == jnp.int32, kernel,
        f"route_ids int32 [{m}, k]", (rid.dtype, rid.shape))
  check(rw.shape == rid.shape and rw.dtype == jnp.float32, kernel,
        f"route_weights float32 {tuple(rid.shape)}", (rw.dtype, rw.shape))
  return rid.shape[1]


@functools.partial(jax.jit, static_argnames=("gate_up", "block_n", "block_k", "num_warps",
                                             "num_stages", "out_dtype", "interpret"))
def moe_matmul(x: jax.Array, w: jax.Array, expert_ids: jax.Array, *, gate_up: bool = False,
               routes: tuple[jax.Array, jax.Array] | None = None, block_n: int = 64,
               block_k: int = 128, num_warps: int = 4, num_stages: int = 3,
               out_dtype=jnp.float32, interpret: bool | None = None) -> jax.Array:
  """[S, M, N]: slot j holds x(j) @ w[expert_ids[j]]^T (silu(gate) * up with gate_up), zeros
  where expert_ids[j] < 0. x [M, K] (the same rows for every slot) or [S, M, K].

  routes (route_ids [M, k] int32, route_weights [M, k] float32; each route id must be listed
  in expert_ids): [k, M, N] float32 instead, out[c, m] = route_weights[m, c] times row m of
  the slot holding expert route_ids[m, c] (the module docstring's routed epilogue)."""
  kernel = "moe_matmul"
  check(w.ndim == 3 and w.dtype == jnp.bfloat16, kernel, "w bfloat16 [E, N, K]",
        (w.dtype, w.shape))
  check(expert_ids.ndim == 1 and expert_ids.dtype == jnp.int32, kernel,
        "expert_ids int32 [S]", (expert_ids.dtype, expert_ids.shape))
  s = expert_ids.shape[0]
  per_slot = x.ndim == 3
  check(x.ndim in (2, 3) and (not per_slot or x.shape[0] == s), kernel,
        "x [M, K] or [S, M, K] with S = len(expert_ids)", (x.shape, s))
  m, k = x.shape[-2:]
  n_routes = _check_routes(kernel, routes, m, gate_up, out_dtype)
  e, n_rows, kw = w.shape
  check(kw == k, kernel, "w.shape[2] == x.shape[-1] (K)", (w.shape, x.shape))
  check(not gate_up or n_rows % 2 == 0, kernel, "gate_up w [E, 2 N, K]", w.shape)
  n_out = n_rows // 2 if gate_up else n_rows
  check(1 <= m <= MAX_ROWS, kernel, f"1 <= M <= {MAX_ROWS}", m)
  for name, b, dim in (("block_n", block_n, n_out), ("block_k", block_k, k)):
    check(is_pow2(b) and b >= 16 and dim % b == 0, kernel,
          f"{name} a power of 2 >= 16 dividing {dim}", b)
  # Blocks of whole 16-row chunks over arrays of exactly M rows (the kernel masks the rest).
  mp = -(-m // ROW_CHUNK) * ROW_CHUNK
  if per_slot:
    x_spec = pl.BlockSpec((None, mp, k), lambda j, n: (j, 0, 0))
  else:
    x_spec = pl.BlockSpec((mp, k), lambda j, n: (0, 0))
  operands = [expert_ids, x, w]
  in_specs = [pl.BlockSpec((s,), lambda j, n: (0,)), x_spec,
              pl.BlockSpec((e, n_rows, k), lambda j, n: (0, 0, 0))]
  out_spec = pl.BlockSpec((None, mp, block_n), lambda j, n: (j, 0, n))
  out_shape = jax.ShapeDtypeStruct((s, m, n_out), out_dtype)
  if n_routes:
    operands += list(routes)
    in_specs += [pl.BlockSpec((mp, n_routes), lambda j, n: (0, 0))] * 2
    # Every slot's programs store into the one [k, M, N] array, each (choice, row) once.
    out_spec = pl.BlockSpec((n_routes, mp, block_n), lambda j, n: (0, 0, n))
    out_shape = jax.ShapeDtypeStruct((n_routes, m, n_out), jnp.float32)
  return pl.pallas_call(
      functools.partial(_kernel, gate_up=gate_up, m=m, n_out=n_out, k=k, block_n=block_n,
                        block_k=block_k, n_routes=n_routes),
      grid=(s, n_out // block_n),
      in_specs=in_specs,
      out_specs=out_spec,
      out_shape=out_shape,
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=resolve_interpret(interpret), name="moe_matmul_gate_up" if gate_up else
      "moe_matmul")(*operands)


def moe_matmul_reference(x: jax.Array, w: jax.Array, expert_ids: jax.Array, *,
                         gate_up: bool = False, routes: tuple[jax.Array, jax.Array] | None = None,
                         out_dtype=jnp.float32) -> jax.Array:
  """Twin of `moe_matmul` in jnp (any float weights: bf16 rounds x to bf16 and accumulates
  in float32, float32 is full precision). Gathers the listed experts (unused slots repeat
  slot 0's expert, so no other expert is read) and zeroes the unused slots; with routes, picks
  each row's choices out of their slots and weights them."""
  if routes is not None:
    _check_routes("moe_matmul_reference", routes, x.shape[-2], gate_up, out_dtype)
    y = moe_matmul_reference(x, w, expert_ids)
    rid, rw = routes
    slot_of = jnp.argmax(rid[..., None] == expert_ids, axis=-1)           # [M, k]
    own = y[slot_of, jnp.arange(rid.shape[0])[:, None]]                   # [M, k, N]
    return jnp.moveaxis(own * rw[..., None], 1, 0)
  used = expert_ids >= 0
  wg = w[jnp.where(used, expert_ids, expert_ids[0])]
  if w.dtype == jnp.bfloat16:
    xs, prec = x.astype(jnp.bfloat16), lax.Precision.DEFAULT
  else:
    xs, prec = x.astype(jnp.float32), lax.Precision.HIGHEST
  spec = "smk,snk->smn" if x.ndim == 3 else "mk,snk->smn"
  y = jnp.einsum(spec, xs, wg, precision=prec, preferred_element_type=jnp.float32)
  if gate_up:
    n = y.shape[-1] // 2
    y = y[..., :n] * jax.nn.sigmoid(y[..., :n]) * y[..., n:]
  return jnp.where(used[:, None, None], y, 0.0).astype(out_dtype)
