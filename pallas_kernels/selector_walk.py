"""The candidate selector's walk over a block's draft rows in one launch, one program per slot
(SPEC_dflash2_dspark 7): prev = 0; for p = 0..n-1: score_p = unary[p] + edge[p, prev, :];
chosen_p = the lowest j of the largest score_p[j] (jnp.argmax's choice), or with `noisy` the
lowest j of the largest noisy[p, prev, j]; prev = chosen_p.

A row's choice depends on the walk only through prev, so every row's best candidate after each
possible predecessor (argmax over j of its [k, k] tile) is computed off the walk's chain; the
chain itself is one k-lane selection per row. Scores are exact: the one addition of the
definition, and the chosen predecessor's row taken as a max of it and -infs. NaN scores
are outside the contract (argmax there is the Triton lowering's, not jnp's).

`noisy` carries a sampled walk's draws: noisy[s, p, i, j] = gumbel[s, p, j] + score / T for
score = unary[p, j] + edge[p, i, j], so that its argmax is jax.random.categorical's draw from
softmax(score / T) with the Gumbel noise of row p's key (categorical is that argmax). It is
made outside the kernel (`dflash_jax.dispatch.selector_walk`), by XLA like the draw it matches.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import check, load_tile, next_pow2, resolve_interpret, store_tile

# Each row's k x k tile is held in registers.
MAX_K = 64


def _walk_kernel(u_ref, e_ref, *refs, n: int, k: int, noisy: bool):
  z_ref, chosen_ref, scores_ref = refs if noisy else (None, *refs)
  n_pad, kp = chosen_ref.shape[0], u_ref.shape[1]
  lim = None if kp == k else k
  pred = lax.broadcasted_iota(jnp.int32, (kp, kp), 0)
  cand = lax.broadcasted_iota(jnp.int32, (kp,), 0)
  row = lax.broadcasted_iota(jnp.int32, (n_pad,), 0)
  chosen = jnp.zeros((n_pad,), jnp.int32)
  prev = jnp.int32(0)
  for p in range(n):
    # Lanes past k: -inf, never the largest of a row that has a real lane.
    u = load_tile(u_ref, (p, 0), (None, kp), (None, lim), other=-jnp.inf)
    score = u[None, :] + load_tile(e_ref, (p, 0, 0), (None, kp, kp), (None, lim, lim),
                                   other=-jnp.inf)                        # [pred i, cand j]
    src = score if z_ref is None else load_tile(z_ref, (p, 0, 0), (None, kp, kp),
                                                (None, lim, lim), other=-jnp.inf)
    best = jnp.argmax(src, axis=1).astype(jnp.int32)                      # [pred i]
    taken = jnp.max(jnp.where(pred == prev, score, -jnp.inf), axis=0)      # score[prev, :]
    store_tile(scores_ref, (p, 0), taken[None, :], (None, lim))
    prev = jnp.sum(jnp.where(cand == prev, best, 0))
    chosen = jnp.where(row == p, prev, chosen)
  store_tile(chosen_ref, (0,), chosen, (None if n_pad == n else n,))


def _check_args(name: str, unary: jax.Array, edge: jax.Array, noisy) -> None:
  check(unary.ndim == 3, name, "unary must be [S, n, k]", unary.shape)
  s, n, k = unary.shape
  check(n >= 1 and 1 <= k <= MAX_K, name, f"n must be >= 1 and k in [1, {MAX_K}]", (n, k))
  check(edge.shape == (s, n, k, k), name, f"edge must be [{s}, {n}, {k}, {k}]", edge.shape)
  check(noisy is None or noisy.shape == edge.shape, name, "noisy must be None or edge's shape",
        None if noisy is None else noisy.shape)
  dts = (unary.dtype, edge.dtype) + (() if noisy is None else (noisy.dtype,))
  check(all(d == jnp.float32 for d in dts), name, "inputs must be float32", dts)


@functools.partial(jax.jit, static_argnames=["num_warps", "interpret"])
def selector_walk(unary: jax.Array, edge: jax.Array, noisy: jax.Array | None = None, *,
                  num_warps: int = 1, interpret: bool | None = None
                  ) -> tuple[jax.Array, jax.Array]:
  """unary [S, n, k], edge [S, n, k, k] (edge[s, p, i, j]: candidate j of row p after
  candidate i of row p - 1; row 0's every i is the anchor), noisy None (greedy) or [S, n, k,
  k], all float32 -> (chosen [S, n] int32, scores [S, n, k] float32: row p's score_p)."""
  name = "selector_walk"
  _check_args(name, unary, edge, noisy)
  s, n, k = unary.shape
  n_pad, kp = next_pow2(n), next_pow2(k)
  # Blocks hang over n's and k's ends where they are no powers of 2; the kernel masks them.
  tile_spec = pl.BlockSpec((None, n_pad, kp, kp), lambda i: (i, 0, 0, 0))
  return tuple(pl.pallas_call(
      functools.partial(_walk_kernel, n=n, k=k, noisy=noisy is not None),
      grid=(s,),
      in_specs=[pl.BlockSpec((None, n_pad, kp), lambda i: (i, 0, 0)), tile_spec]
      + ([] if noisy is None else [tile_spec]),
      out_specs=[pl.BlockSpec((None, n_pad), lambda i: (i, 0)),
                 pl.BlockSpec((None, n_pad, kp), lambda i: (i, 0, 0))],
      out_shape=[jax.ShapeDtypeStruct((s, n), jnp.int32),
                 jax.ShapeDtypeStruct((s, n, k), jnp.float32)],
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=resolve_interpret(interpret), name=name,
  )(unary, edge, *([] if noisy is None else [noisy])))
