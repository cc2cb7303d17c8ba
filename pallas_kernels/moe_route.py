"""An MoE router's softmax top-k in one launch: router logits -> each row's k experts and
their weights.

One program per row. The row's logits are the router GEMM's split-K partials [P, E] added in
order; ex = exp(logits - max); the k largest ex by k rounds of (the largest, the lowest
expert id holding it, that lane taken out), so ties go to the lower id as `lax.top_k` sends
them; weights ex / sum(ex) over all experts, or over the k chosen ones (norm_topk: the
softmax's denominator cancels). Ranking ex ranks the softmax probabilities ex / sum(ex): the
same order up to float32 rounding of the division, which can only merge neighbours into a
tie.

One row per program, each sum over a tile whose shape depends on E and k alone: a row's
routing is bitwise the same whatever rows share the call (batch invariance). This replaces
the XLA composition's launches (softmax, top-k, renormalisation) in every sparse layer of a
decode.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import check, load_tile, next_pow2, resolve_interpret, store_tile

MAX_K = 32   # the k rounds are unrolled; published MoE routers take 8


def _kernel(x_ref, w_ref, id_ref, *, e: int, k: int, norm_topk: bool):
  n_parts, ep = x_ref.shape
  kp = w_ref.shape[0]
  lim = (None if ep == e else e,)
  x = load_tile(x_ref, (0, 0), (None, ep), (None,) + lim, other=-jnp.inf)
  for i in range(1, n_parts):
    x = x + load_tile(x_ref, (i, 0), (None, ep), (None,) + lim, other=-jnp.inf)
  ex = jnp.exp(x - jnp.max(x))   # lanes past E: exp(-inf) = 0
  lane = lax.broadcasted_iota(jnp.int32, (ep,), 0)
  slot = lax.broadcasted_iota(jnp.int32, (kp,), 0)
  key = jnp.where(lane < e, ex, -1.0)   # below every ex: never taken
  top = jnp.zeros((kp,), jnp.float32)
  at = jnp.zeros((kp,), jnp.int32)
  for t in range(k):
    i = jnp.argmax(key).astype(jnp.int32)
    top = jnp.where(slot == t, jnp.max(key), top)
    at = jnp.where(slot == t, i, at)
    if t + 1 < k:
      key = jnp.where(lane == i, -1.0, key)
  total = jnp.sum(top) if norm_topk else jnp.sum(ex)
  out_lim = (None if kp == k else k,)
  store_tile(w_ref, (0,), top / total, out_lim)
  store_tile(id_ref, (0,), at, out_lim)


def _check_args(name: str, parts: jax.Array, k: int) -> None:
  check(parts.ndim == 3, name, "parts must be [P, M, E]", parts.shape)
  check(parts.dtype == jnp.float32, name, "parts must be float32", parts.dtype)
  check(1 <= k <= min(parts.shape[2], MAX_K), name,
        f"k must be in [1, min(E, {MAX_K})]", (k, parts.shape[2]))


@functools.partial(jax.jit, static_argnames=["k", "norm_topk", "num_warps", "interpret"])
def moe_route(parts: jax.Array, *, k: int, norm_topk: bool, num_warps: int = 1,
              interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """Router logits as split-K partials [P, M, E] float32 (P = 1 for a plain product) ->
  (expert ids [M, k] int32, largest probability first; weights [M, k] float32)."""
  name = "moe_route"
  _check_args(name, parts, k)
  n_parts, m, e = parts.shape
  ep, kp = next_pow2(e), next_pow2(k)
  out = pl.BlockSpec((None, kp), lambda r: (r, 0))
  w, ids = pl.pallas_call(
      functools.partial(_kernel, e=e, k=k, norm_topk=norm_topk),
      grid=(m,),
      # The ep-wide block hangs over E's end when E is no power of 2; the kernel masks it.
      in_specs=[pl.BlockSpec((n_parts, None, ep), lambda r: (0, r, 0))],
      out_specs=[out, out],
      out_shape=[jax.ShapeDtypeStruct((m, k), jnp.float32),
                 jax.ShapeDtypeStruct((m, k), jnp.int32)],
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=resolve_interpret(interpret), name=name,
  )(parts)
  return ids, w


def moe_route_reference(parts: jax.Array, *, k: int, norm_topk: bool
                        ) -> tuple[jax.Array, jax.Array]:
  """The jnp twin: the same ranking of exp(logits - max) and the same weights."""
  _check_args("moe_route_reference", parts, k)
  x = parts[0]
  for i in range(1, parts.shape[0]):
    x = x + parts[i]
  ex = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  top, ids = lax.top_k(ex, k)
  total = jnp.sum(top if norm_topk else ex, axis=-1, keepdims=True)
  return ids.astype(jnp.int32), top / total
