"""Token choice and verification rules (SPEC.md sections 3, 4 and 9), on device, batched over slots.

`Sampling` fixes the rule (static): temperature 0 is greedy; otherwise the target's
distribution at a row is `p = softmax(filter(logits) / T)`, with top-k (keep the k largest
logits, ties at the k-th value kept) and top-p (keep the most likely tokens while the mass
ranked strictly before them is < top_p; a token tied in probability with a kept one is kept)
applied to logits / T. Verification of drafts is lossless either way:

- greedy: accept the longest prefix on which drafts equal the target's argmax; commit the
  target's argmax after it (correction, or bonus when every draft was accepted).
- sampling with greedy proposals (q one-hot at the drafter's argmax): accept draft j with
  probability p_j(d_j); at the first rejection commit a sample of p_j with d_j removed.
- sampling with sampled proposals (d_j ~ q_j: the drafter family's proposal, dense or sparse
  over candidates): accept with probability min(1, p_j(d_j) / q_j(d_j)); else commit a sample
  of norm(max(0, p_j - q_j)). When every draft is accepted the bonus token is a sample of the
  last row's p; when a cut stops the verify early, a sample of p at the row after it.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

PROPOSALS = ("greedy", "sampled")


@dataclasses.dataclass(frozen=True)
class Sampling:
  """temperature 0 = greedy (top_k / top_p / proposals then unused); top_k 0 = off;
  top_p 1 = off; proposals: how the drafter proposes under sampling ("greedy": its argmax,
  "sampled": a sample of softmax(drafter_logits / temperature))."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  proposals: str = "greedy"

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
    if self.proposals not in PROPOSALS:
      raise ValueError(f"proposals must be one of {PROPOSALS}, got {self.proposals!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def filtered_logits(logits: jax.Array, s: Sampling) -> jax.Array:
  """logits [..., V] -> logits / T with filtered-out tokens at -inf (float32)."""
  z = logits.astype(jnp.float32) / s.temperature
  v = z.shape[-1]
  if 0 < s.top_k < v:
    kth = jax.lax.top_k(z, s.top_k)[0][..., -1:]
    z = jnp.where(z >= kth, z, -jnp.inf)
  if s.top_p < 1:
    p = jax.nn.softmax(z, axis=-1)
    ps = jnp.sort(p, axis=-1)[..., ::-1]
    before = jnp.cumsum(ps, axis=-1) - ps
    # The smallest kept probability: the top token always stays (its mass before is 0).
    floor = jnp.min(jnp.where(before < s.top_p, ps, jnp.inf), axis=-1, keepdims=True)
    z = jnp.where(p >= floor, z, -jnp.inf)
  return z


def probs(logits: jax.Array, s: Sampling) -> jax.Array:
  """The target distribution p [..., V] of section 9 (float32)."""
  return jax.nn.softmax(filtered_logits(logits, s), axis=-1)


def choose(key: jax.Array, logits: jax.Array, s: Sampling) -> jax.Array:
  """One token per row of logits [..., V]: argmax (ties to the lowest id) or a sample of p."""
  if s.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, filtered_logits(logits, s), axis=-1).astype(jnp.int32)


def _first_false(ok: jax.Array) -> jax.Array:
  """ok [S, n] bool -> index of the first False per row (n when all True), int32."""
  n = ok.shape[-1]
  if n == 0:
    return jnp.zeros(ok.shape[:-1], jnp.int32)
  return jnp.min(jnp.where(ok, n, jnp.arange(n, dtype=jnp.int32)), axis=-1).astype(jnp.int32)


def _take(a: jax.Array, idx: jax.Array) -> jax.Array:
  """a [S, n, ...] at idx [S] -> [S, ...]."""
  return jnp.take_along_axis(a, idx.reshape(-1, *([1] * (a.ndim - 1))), axis=1)[:, 0]


def verify_sampled(key: jax.Array, drafts: jax.Array, p: jax.Array, q: jax.Array | None,
                   candidates: jax.Array | None = None, n_valid: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array]:
  """Rejection sampling of drafts [S, n] against the target's p [S, n + 1, V].

  q: the proposal distributions the drafts were sampled from, or None for greedy (one-hot)
  proposals: dense [S, n, V], or sparse [S, n, k] over `candidates` [S, n, k] (distinct ids
  per row, q zero elsewhere: DFlash2's selector, SPEC_dflash2_dspark section 8; only the
  rejected row is densified). n_valid [S]: the drafts each slot verifies (a cut); draft i >=
  n_valid[s] is never accepted, and stopping there is no rejection: the committed token is a
  sample of p at that row, as after a full acceptance. key: one key per slot [S]. Returns
  (n_ok [S], the committed target token t [S]): a sample of the first rejected row's residual,
  or of p[n_ok] (bonus, or the row after a cut).
  """
  s, n = drafts.shape
  d = drafts[..., None]
  keys = jax.vmap(lambda k: jax.random.split(k, 2))(key)
  u = jax.vmap(lambda k: jax.random.uniform(k, (n,)))(keys[:, 0])
  p_d = jnp.take_along_axis(p[:, :n], d, axis=-1)[..., 0]
  if q is None:
    accept = u < p_d
  else:
    if candidates is None:
      q_d = jnp.take_along_axis(q, d, axis=-1)[..., 0]
    else:
      q_d = jnp.sum(jnp.where(candidates == d, q, 0.0), axis=-1)
    accept = u * q_d < p_d
  limit = jnp.full((s,), n, jnp.int32) if n_valid is None else jnp.asarray(n_valid, jnp.int32)
  accept &= jnp.arange(n, dtype=jnp.int32)[None] < limit[:, None]
  n_ok = _first_false(accept)
  row = _take(p, n_ok)                                    # [S, V]
  if n:
    rejected = n_ok < limit
    if q is None:
      draft = _take(drafts, jnp.minimum(n_ok, n - 1))
      residual = row.at[jnp.arange(s), draft].set(0.0)
    else:
      at = jnp.minimum(n_ok, n - 1)
      if candidates is None:
        q_row = _take(q, at)
      else:
        q_row = jax.vmap(lambda ids, qs: jnp.zeros(row.shape[-1], qs.dtype).at[ids].add(qs))(
            _take(candidates, at), _take(q, at))
      residual = jnp.maximum(row - q_row, 0.0)
    # A residual of zero mass only arises when the draft could not be rejected (p <= q
    # nowhere); then the row itself is the right distribution.
    ok = residual.sum(-1, keepdims=True) > 0
    row = jnp.where(rejected[:, None] & ok, residual, row)
  t = jax.vmap(lambda k, r: jax.random.categorical(k, jnp.log(r)))(keys[:, 1], row)
  return n_ok, t.astype(jnp.int32)
