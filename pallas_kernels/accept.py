"""Accepted-prefix length of a speculative round: the index of the first draft that the
target disagrees with, or n when all agree (SPEC.md section 3, `accept`). One launch, one
program per sequence; the result stays on device.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import check, resolve_interpret


def _accept_kernel(d_ref, t_ref, o_ref, *, n: int):
  # The block is n rounded up to a power of 2 (Triton tensors must be); lanes >= n lie past
  # the row, so they are not loaded and compare equal.
  width = d_ref.shape[0]
  idx = jnp.arange(width, dtype=jnp.int32)
  live = idx < n
  d = plt.load(d_ref, mask=live, other=0)
  t = plt.load(t_ref, mask=live, other=0)
  o_ref[...] = jnp.full((1,), jnp.min(jnp.where(d != t, idx, n)), jnp.int32)


def _check_args(name: str, drafts: jax.Array, target: jax.Array) -> None:
  check(drafts.ndim in (1, 2), name, "drafts must be [n] or [B, n]", drafts.shape)
  check(target.shape == drafts.shape, name, "target shape must equal drafts shape",
        (target.shape, drafts.shape))
  check(drafts.dtype == jnp.int32, name, "drafts dtype must be int32", drafts.dtype)
  check(target.dtype == jnp.int32, name, "target dtype must be int32", target.dtype)
  check(drafts.shape[-1] >= 1, name, "n must be >= 1", drafts.shape[-1])
  check(drafts.ndim == 1 or drafts.shape[0] >= 1, name, "B must be >= 1", drafts.shape)


@functools.partial(jax.jit, static_argnames=["interpret"])
def accept(drafts: jax.Array, target: jax.Array, *, interpret: bool | None = None
           ) -> jax.Array:
  """First-mismatch index of int32 drafts vs target: [n] -> int32 scalar, [B, n] -> [B]."""
  _check_args("accept", drafts, target)
  batched = drafts.ndim == 2
  d2 = drafts if batched else drafts[None]
  t2 = target if batched else target[None]
  b, n = d2.shape
  width = pl.next_power_of_2(n)
  row_spec = pl.BlockSpec((None, width), lambda i: (i, 0))
  out = pl.pallas_call(
      functools.partial(_accept_kernel, n=n), grid=(b,),
      in_specs=[row_spec, row_spec],
      out_specs=pl.BlockSpec((1,), lambda i: (i,)),
      out_shape=jax.ShapeDtypeStruct((b,), jnp.int32),
      compiler_params=plt.CompilerParams(num_warps=1, num_stages=1),
      interpret=resolve_interpret(interpret), name="accept",
  )(d2, t2)
  return out if batched else out.reshape(())


@functools.partial(jax.jit, static_argnames=["interpret"])
def accept_reference(drafts: jax.Array, target: jax.Array, *,
                     interpret: bool | None = None) -> jax.Array:
  """Pure-jnp twin of `accept` (`interpret` is accepted for a drop-in signature; unused)."""
  del interpret
  n = drafts.shape[-1]
  idx = jnp.arange(n, dtype=jnp.int32)
  return jnp.min(jnp.where(drafts != target, idx, n), axis=-1).astype(jnp.int32)
