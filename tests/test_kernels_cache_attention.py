"""The target's cache kernels: `cache_attention.cache_attention` and
`norm_rope.qk_norm_rope_cache` against float64 numpy transcriptions of their contracts and
their jnp twins (CPU interpret), their batch invariance (a row's bits do not depend on the
call's width, slot count or the cache's capacity), and the same at Qwen3-8B shapes on the GPU.

Slots a row must not see (past its position, or past the pass's rows) carry values far off
the others' scale, so a leak through the mask moves the output by far more than the
tolerance; q is scaled up so the softmax is peaked and the output is not V's mean.

The sliding-window ring (window > 0) is built by replaying its write history (position p into
slot p % S, later laps overwriting earlier ones) and checked against attention over each row's
window read from a position-indexed table, not from the kernel's held-slot arithmetic (which
its twin shares). There, positions outside every row's window and never-written slots carry a
zero key (a score on the others' scale, so the leaked weight is not negligible) and LEAK values.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cache_attention as A
from pallas_kernels import norm_rope as N

LEAK = 1e3
Q_SCALE = 3.0
EPS = 1e-6
# bf16: q, K, V and the probabilities rounded to bf16 for the dots
F64_TOL = {jnp.dtype(jnp.float32): 5e-6, jnp.dtype(jnp.bfloat16): 2e-2}


def _attention_inputs(seed, b, t, hkv, g, d, s, dtype, start=None):
  rng = np.random.default_rng(seed)
  start = rng.integers(0, s - t + 1, b) if start is None else np.asarray(start)
  q = rng.standard_normal((b, hkv, t * g, d)) * Q_SCALE
  k = rng.standard_normal((b, hkv, s, d))
  v = rng.standard_normal((b, hkv, s, d))
  for i in range(b):   # slots past the pass's last row: never visible
    k[i, :, start[i] + t:] = LEAK
    v[i, :, start[i] + t:] = LEAK
  cast = lambda a: jnp.asarray(a, dtype)
  return cast(q), cast(k), cast(v), jnp.asarray(start, jnp.int32)


def numpy_attention(q, k, v, start, t: int) -> np.ndarray:
  """Float64 transcription: row r of kv head h (token r // G, head h G + r % G) of sequence b
  attends slots 0 .. start[b] + r // G; output token-major [B, T, Hq D]."""
  q, k, v = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q, k, v))
  b, hkv, rows, d = q.shape
  g = rows // t
  out = np.zeros((b, t, hkv * g * d))
  for i in range(b):
    for h in range(hkv):
      for r in range(rows):
        n = int(start[i]) + r // g + 1
        sc = k[i, h, :n] @ q[i, h, r] / math.sqrt(d)
        p = np.exp(sc - sc.max())
        col = (h * g + r % g) * d
        out[i, r // g, col:col + d] = (p / p.sum()) @ v[i, h, :n]
  return out


F32, BF16 = jnp.float32, jnp.bfloat16
CASES = [  # (b, t, hkv, g, d, s, chunk, block_k, block_q, cache dtype)
    (1, 1, 2, 2, 16, 40, 16, 16, 16, F32),     # a 1-row decode, ragged last chunk
    (1, 1, 2, 2, 16, 40, 16, 16, 16, BF16),
    (2, 5, 2, 2, 16, 64, 32, 16, 16, BF16),    # two sequences at their own positions
    (3, 16, 1, 4, 48, 50, 16, 16, 32, F32),    # head_dim 48 (masked columns), two row tiles
    (1, 3, 2, 3, 16, 100, 64, 16, 16, BF16),   # group 3: rows cross tokens
    (2, 7, 2, 4, 32, 300, 128, 32, 64, F32),   # many tiles per chunk
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-t{}-g{}-d{}-s{}-{}".format(
    c[0], c[1], c[3], c[4], c[5], jnp.dtype(c[9]).name))
def test_cache_attention_matches_numpy_and_twin(case):
  b, t, hkv, g, d, s, chunk, bk, bq, dtype = case
  q, k, v, start = _attention_inputs(sum(case[:9]), b, t, hkv, g, d, s, dtype)
  kw = dict(t=t, chunk=chunk, block_k=bk, block_q=bq)
  got = np.asarray(A.cache_attention(q, k, v, start, **kw))
  assert got.shape == (b, t, hkv * g * d) and np.isfinite(got).all()
  want = numpy_attention(q, k, v, np.asarray(start), t)
  tol = F64_TOL[jnp.dtype(dtype)]
  np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
  twin = np.asarray(A.cache_attention_reference(q, k, v, start, **kw))
  np.testing.assert_allclose(got, twin, atol=tol, rtol=tol)
  bf = np.asarray(A.cache_attention(q, k, v, start, out_dtype=jnp.bfloat16, **kw))
  np.testing.assert_array_equal(bf, np.asarray(jnp.asarray(got).astype(jnp.bfloat16)))


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view(np.uint16 if a.dtype == jnp.bfloat16 else np.uint32)


@pytest.mark.parametrize("dtype, g, d", [(BF16, 4, 16), (F32, 3, 48)], ids=["bf16-g4", "f32-g3"])
def test_cache_attention_rows_are_batch_invariant(dtype, g, d):
  """Each row of a 16-row pass over 3 sequences equals, bit for bit, the 1-row pass of the
  same query at the same position: with the other sequences, alone, and in a cache of
  another capacity. The query tile is the 16-row pass's for every call (as the target's
  default knobs size it), and 4 chunks of 16 slots put the rows' positions in several."""
  b, t, hkv, s = 3, 16, 2, 64
  q, k, v, start = _attention_inputs(g * d, b, t, hkv, g, d, s, dtype, start=[0, 20, 48])
  kw = dict(chunk=16, block_k=16, block_q=A.default_knobs(
      rows=t * g, head_dim=d, cache_dtype=dtype, chunk=16).block_q)
  full = _bits(A.cache_attention(q, k, v, start, t=t, **kw))
  rows = q.reshape(b, hkv, t, g, d)
  wide = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, 37), (0, 0)))
  for i in (0, 1, 5, 15):
    one = rows[:, :, i]
    np.testing.assert_array_equal(_bits(A.cache_attention(one, k, v, start + i, t=1, **kw))[:, 0],
                                  full[:, i])
    np.testing.assert_array_equal(
        _bits(A.cache_attention(one, wide(k), wide(v), start + i, t=1, **kw))[:, 0], full[:, i])
    alone = A.cache_attention(one[1:2], k[1:2], v[1:2], start[1:2] + i, t=1, **kw)
    np.testing.assert_array_equal(_bits(alone)[0, 0], full[1, i])
  # A 5-row pass from row 3 on: its rows equal the 16-row pass's rows 3..7.
  part = A.cache_attention(rows[:, :, 3:8].reshape(b, hkv, 5 * g, d), k, v, start + 3, t=5, **kw)
  np.testing.assert_array_equal(_bits(part), full[:, 3:8])


# --- the sliding-window ring (window > 0) ------------------------------------------------------

def _simulate_ring(kt, vt, last: int, s: int):
  """The ring after writing positions 0 .. last in order: position p's K/V row (kt, vt
  [Hkv, P, D], position-indexed) into slot p % s, a later lap overwriting the earlier one.
  Returns ring_k, ring_v [Hkv, s, D] and the position each slot holds [s] (-1: never written;
  such a slot holds a zero key and LEAK values)."""
  hkv, _, d = kt.shape
  ring_k, ring_v = np.zeros((hkv, s, d)), np.full((hkv, s, d), LEAK)
  held = np.full(s, -1)
  for p in range(last + 1):
    ring_k[:, p % s], ring_v[:, p % s], held[p % s] = kt[:, p], vt[:, p], p
  return ring_k, ring_v, held


def _ring_tables(seed, b, t, hkv, g, d, start, window: int, dtype):
  """Seeded q [B, Hkv, T G, D] and position-indexed K/V tables [B, Hkv, max(start) + T, D],
  rounded to dtype (held as float64). Positions <= start[b] - window are outside every row's
  window: a zero key (a score of 0, the others' scale, so its weight is not negligible) and a
  LEAK value, so a leak of one moves the output by far more than the tolerance."""
  rng = np.random.default_rng(seed)
  n_pos = int(max(start)) + t
  q = rng.standard_normal((b, hkv, t * g, d)) * Q_SCALE
  kt = rng.standard_normal((b, hkv, n_pos, d))
  vt = rng.standard_normal((b, hkv, n_pos, d))
  for i in range(b):
    gone = max(0, int(start[i]) - window + 1)
    kt[i, :, :gone], vt[i, :, :gone] = 0.0, LEAK
  rnd = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64)
  return rnd(q), rnd(kt), rnd(vt)


def _ring_cache(kt, vt, start, t: int, s: int, capacity: int, dtype, upto=None):
  """The caches [B, Hkv, s, D] (dtype) a pass at `start` sees: every position below
  min(start + T, capacity) written in order (upto[b]: only positions <= upto[b]); also
  returns the positions the slots hold [B, s]."""
  ks, vs, helds = [], [], []
  for i in range(kt.shape[0]):
    last = min(int(start[i]) + t, capacity) - 1 if upto is None else int(upto[i])
    rk, rv, held = _simulate_ring(kt[i], vt[i], last, s)
    ks.append(rk), vs.append(rv), helds.append(held)
  return jnp.asarray(np.stack(ks), dtype), jnp.asarray(np.stack(vs), dtype), np.stack(helds)


def numpy_ring_attention(q, kt, vt, start, t: int, window: int, capacity: int,
                         held=None) -> np.ndarray:
  """Float64 transcription from the position-indexed tables: row r of kv head h (token
  r // G at position pos = start[b] + r // G) attends the positions in (pos - window, pos]
  (those >= 0). Rows at positions >= capacity (padding: nothing was written for them) are
  NaN. held [B, S] (the slots' positions), when given, is checked to hold every position a
  checked row attends (the test's own inputs meet the contract)."""
  b, hkv, rows, d = q.shape
  g = rows // t
  out = np.full((b, t, hkv * g * d), np.nan)
  for i in range(b):
    for r in range(rows):
      pos = int(start[i]) + r // g
      if pos >= capacity:
        continue
      lo = max(0, pos - window + 1)
      if held is not None:
        assert set(range(lo, pos + 1)) <= set(held[i].tolist()), (i, pos)
      for h in range(hkv):
        sc = kt[i, h, lo:pos + 1] @ q[i, h, r] / math.sqrt(d)
        p = np.exp(sc - sc.max())
        col = (h * g + r % g) * d
        out[i, r // g, col:col + d] = (p / p.sum()) @ vt[i, h, lo:pos + 1]
  return out


RING_CASES = [  # (b, t, hkv, g, d, s, window, capacity, start, chunk, block_k, block_q, dtype)
    (1, 1, 2, 2, 16, 40, 32, 4096, [123], 16, 16, 16, F32),      # decode, ring wrapped 3 laps
    (1, 1, 2, 1, 16, 40, 32, 4096, [123], 16, 16, 16, BF16),     # group 1
    (2, 5, 2, 2, 16, 36, 32, 4096, [17, 200], 16, 16, 16, BF16),  # S = W + T - 1; unwrapped
    (3, 16, 1, 4, 48, 48, 33, 1000, [0, 37, 150], 16, 16, 32, F32),  # d 48, two row tiles
    (2, 16, 2, 3, 16, 48, 20, 48, [40, 10], 16, 16, 64, BF16),   # S = capacity: padding rows
    (2, 7, 2, 4, 48, 64, 40, 100, [95, 60], 32, 16, 32, F32),    # ring up to the capacity
    (1, 16, 2, 1, 16, 31, 16, 2000, [500], 16, 16, 16, BF16),    # S = 31: a ragged chunk
]


@pytest.mark.parametrize("case", RING_CASES, ids=lambda c: "b{}-t{}-g{}-d{}-s{}-w{}-c{}-{}".format(
    c[0], c[1], c[3], c[4], c[5], c[6], c[7], jnp.dtype(c[12]).name))
def test_cache_attention_ring_matches_numpy_and_twin(case):
  """window > 0: the ring built by writing every position in order (stale laps overwritten),
  against float64 attention over each row's window read from the position-indexed tables."""
  b, t, hkv, g, d, s, window, capacity, start, chunk, bk, bq, dtype = case
  assert s >= window + t - 1 or s == capacity   # the contract
  q, kt, vt = _ring_tables(sum(case[:8]) + sum(start) + chunk + bq, b, t, hkv, g, d, start, window, dtype)
  ck, cv, held = _ring_cache(kt, vt, start, t, s, capacity, dtype)
  start_j = jnp.asarray(start, jnp.int32)
  kw = dict(t=t, window=window, capacity=capacity, chunk=chunk, block_k=bk, block_q=bq)
  qj = jnp.asarray(q, dtype)
  want = numpy_ring_attention(q, kt, vt, start, t, window, capacity, held)
  ok = ~np.isnan(want)   # rows at positions past the capacity: no contract
  assert ok.any()
  got = np.asarray(A.cache_attention(qj, ck, cv, start_j, **kw))
  assert got.shape == (b, t, hkv * g * d) and np.isfinite(got[ok]).all()
  tol = F64_TOL[jnp.dtype(dtype)]
  np.testing.assert_allclose(got[ok], want[ok], atol=tol, rtol=tol)
  twin = np.asarray(A.cache_attention_reference(qj, ck, cv, start_j, **kw))
  np.testing.assert_allclose(got[ok], twin[ok], atol=tol, rtol=tol)


@pytest.mark.parametrize("b, t, g, d, n_parts, dtype", [
    (1, 1, 2, 16, 4, BF16), (2, 5, 3, 48, 1, F32), (3, 16, 4, 16, 2, BF16)],
    ids=["decode-bf16", "d48-f32", "t16-bf16"])
def test_cache_attention_gate(b, t, g, d, n_parts, dtype):
  """gate: the output times sigmoid of the gate columns' partials summed (Muse-Glimmer's
  output gate, read at gate_col of a [P, B, T, W] projection with other columns around it),
  against float64 numpy; without the gate the kernel's output is unchanged (the ungated call
  times numpy's sigmoid, to the output dtype's rounding)."""
  hkv, s = 2, 64
  q, k, v, start = _attention_inputs(b * t + d, b, t, hkv, g, d, s, dtype)
  hq_d = hkv * g * d
  rng = np.random.default_rng(d + t)
  gate_col = 3 * d + 5   # not aligned to a head
  # Columns outside the gate's range far off scale: reading them would show.
  gate = np.full((n_parts, b, t, gate_col + hq_d + 7), 50.0, np.float32)
  gate[..., gate_col:gate_col + hq_d] = rng.standard_normal((n_parts, b, t, hq_d)) * 2
  kw = dict(t=t, chunk=32, block_k=16, block_q=16)
  plain = np.asarray(A.cache_attention(q, k, v, start, **kw), np.float64)
  got = A.cache_attention(q, k, v, start, jnp.asarray(gate), gate_col=gate_col, **kw)
  assert got.shape == (b, t, hq_d)
  gs = gate[..., gate_col:gate_col + hq_d].astype(np.float64).sum(0)
  want = numpy_attention(q, k, v, np.asarray(start), t) / (1.0 + np.exp(-gs))
  tol = F64_TOL[jnp.dtype(dtype)]
  np.testing.assert_allclose(np.asarray(got), want, atol=tol, rtol=tol)
  np.testing.assert_allclose(np.asarray(got), plain / (1.0 + np.exp(-gs)), atol=1e-6, rtol=1e-5)
  twin = A.cache_attention_reference(q, k, v, start, jnp.asarray(gate), gate_col=gate_col, **kw)
  np.testing.assert_allclose(np.asarray(got), np.asarray(twin), atol=tol, rtol=tol)
  bf = A.cache_attention(q, k, v, start, jnp.asarray(gate), gate_col=gate_col,
                         out_dtype=jnp.bfloat16, **kw)
  np.testing.assert_array_equal(np.asarray(bf), np.asarray(got.astype(jnp.bfloat16)))
  with pytest.raises(ValueError, match="gate_col must leave Hq D"):
    A.cache_attention(q, k, v, start, jnp.asarray(gate), gate_col=gate_col + 8, **kw)
  with pytest.raises(ValueError, match="gate must be float32"):
    A.cache_attention(q, k, v, start, jnp.asarray(gate, jnp.bfloat16), gate_col=0, **kw)


@pytest.mark.parametrize("dtype, g, d", [(BF16, 4, 16), (F32, 3, 48)], ids=["bf16-g4", "f32-g3"])
def test_cache_attention_ring_rows_are_batch_invariant(dtype, g, d):
  """Ring mode: each row of a 16-row pass equals, bit for bit, the 1-row pass of the same query
  at the same position over the ring as it stands after writing only up to that position (the
  later rows' slots still hold the lap before), and a 5-row pass from row 3 its rows 3..7. The
  ring (S = window + 16) has wrapped; the query tile is the 16-row pass's for every call."""
  b, t, hkv, window, capacity = 2, 16, 2, 32, 4096
  s = window + t
  start = [100, 203]
  q, kt, vt = _ring_tables(g * d + 1, b, t, hkv, g, d, start, window, dtype)
  kw = dict(window=window, capacity=capacity, chunk=16, block_k=16, block_q=A.default_knobs(
      rows=t * g, head_dim=d, cache_dtype=dtype, chunk=16).block_q)
  start_j = jnp.asarray(start, jnp.int32)
  ck, cv, _ = _ring_cache(kt, vt, start, t, s, capacity, dtype)
  rows = jnp.asarray(q, dtype).reshape(b, hkv, t, g, d)
  full = _bits(A.cache_attention(rows.reshape(b, hkv, t * g, d), ck, cv, start_j, t=t, **kw))
  for i in (0, 1, 5, 15):
    k1, v1, held = _ring_cache(kt, vt, start, t, s, capacity, dtype,
                               upto=[st + i for st in start])
    assert (held >= 0).all() and held.max() == max(start) + i
    one = A.cache_attention(rows[:, :, i], k1, v1, start_j + i, t=1, **kw)
    np.testing.assert_array_equal(_bits(one)[:, 0], full[:, i])
  k5, v5, _ = _ring_cache(kt, vt, start, t, s, capacity, dtype, upto=[st + 7 for st in start])
  part = A.cache_attention(rows[:, :, 3:8].reshape(b, hkv, 5 * g, d), k5, v5, start_j + 3, t=5,
                           **kw)
  np.testing.assert_array_equal(_bits(part), full[:, 3:8])


def test_cache_attention_limits():
  q, k, v, start = _attention_inputs(0, 1, 2, 2, 2, 16, 32, jnp.float32)
  with pytest.raises(ValueError, match="chunk must be a multiple of block_k"):
    A.cache_attention(q, k, v, start, t=2, chunk=16, block_k=32)
  with pytest.raises(ValueError, match="block_q must be a power of 2 >= 16"):
    A.cache_attention(q, k, v, start, t=2, block_q=24)
  with pytest.raises(ValueError, match="t must be an int >= 1 dividing"):
    A.cache_attention(q, k, v, start, t=3)
  with pytest.raises(ValueError, match="q dtype must be the cache dtype"):
    A.cache_attention(q.astype(jnp.bfloat16), k, v, start, t=2)
  with pytest.raises(ValueError, match="head_dim must be a multiple of 16"):
    A.cache_attention(q[..., :8], k[..., :8], v[..., :8], start, t=2)
  with pytest.raises(ValueError, match="start must be int32"):
    A.cache_attention(q, k, v, start[None], t=2)
  ring = r"a windowed \(ring\) cache needs capacity >= its S slots"
  for fn in (A.cache_attention, A.cache_attention_reference):   # S = 32
    with pytest.raises(ValueError, match=ring):
      fn(q, k, v, start, t=2, window=8, capacity=31)
    with pytest.raises(ValueError, match=ring):
      fn(q, k, v, start, t=2, window=8)   # capacity 0


# --- qk_norm_rope_cache ------------------------------------------------------------------------

def numpy_norm_rope(x, w, pos, inv_freq, norm: bool, rope: bool = True) -> np.ndarray:
  """Float64: x [R, D] -> rms_norm(x) * w (if norm), then NEOX rope at pos [R] (if rope)."""
  x = np.asarray(x, np.float64)
  if norm:
    x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * np.asarray(w, np.float64)
  if not rope:
    return x
  h = x.shape[1] // 2
  ang = np.asarray(pos, np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None, :]
  c, s = np.cos(ang), np.sin(ang)
  return np.concatenate([x[:, :h] * c - x[:, h:] * s, x[:, h:] * c + x[:, :h] * s], axis=1)


def _norm_rope_inputs(seed, n_parts, b, t, hq, hkv, d, s, dtype, extra: int = 0):
  """extra: trailing heads past q, k, v in parts (an output gate's), LEAK-scaled."""
  rng = np.random.default_rng(seed)
  parts = rng.standard_normal((n_parts, b, t, hq + 2 * hkv + extra, d))
  parts[:, :, :, hq + 2 * hkv:] *= LEAK
  parts = jnp.asarray(parts, jnp.float32)
  qn, kn = (jnp.asarray(rng.standard_normal(d) + 1, jnp.float32) for _ in range(2))
  ck, cv = (jnp.asarray(rng.standard_normal((b, hkv, s, d)), dtype) for _ in range(2))
  inv = jnp.asarray(1e4 ** (-np.arange(0, d, 2) / d), jnp.float32)
  return parts, qn, kn, ck, cv, inv


def numpy_qk_norm_rope_cache(parts, qn, kn, old_k, old_v, start, inv, hq: int, hkv: int,
                             qk_norm: bool, rope: bool = True, capacity: int = 0):
  """Float64 transcription: q [B, Hkv, T, G, D] (token t, query head h G + g), and the caches
  old_k, old_v [B, Hkv, S, D] with row t's k and v written at its position p = start[b] + t:
  at slot p if p < S (capacity 0), at slot p % S if p < capacity (a ring); else nowhere.
  Also returns which slots were written [B, S]."""
  x = np.asarray(parts, np.float64).sum(0)   # [B, T, heads, D]; heads past q, k, v unread
  b, t, _, d = x.shape
  s = old_k.shape[2]
  g = hq // hkv
  q = np.zeros((b, hkv, t, g, d))
  want_k, want_v = np.array(old_k, np.float64), np.array(old_v, np.float64)
  written = np.zeros((b, s), bool)
  for i in range(b):
    pos = int(start[i]) + np.arange(t)
    ok, slot = (pos < capacity, pos % s) if capacity else (pos < s, pos)
    written[i, slot[ok]] = True
    for h in range(hkv):
      for j in range(g):
        q[i, h, :, j] = numpy_norm_rope(x[i, :, h * g + j], qn, pos, inv, qk_norm, rope)
      want_k[i, h, slot[ok]] = numpy_norm_rope(x[i, :, hq + h], kn, pos, inv, qk_norm, rope)[ok]
      want_v[i, h, slot[ok]] = x[i, :, hq + hkv + h][ok]
  return q, want_k, want_v, written


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n_parts, b, t, hq, hkv, d, s, qk_norm", [
    (1, 1, 1, 4, 2, 16, 32, True),
    (3, 2, 5, 4, 2, 16, 40, True),
    (2, 3, 16, 6, 2, 48, 24, False),     # head_dim 48, no q/k norm, one row past the cache
    (1, 1, 20, 4, 1, 16, 64, True),      # two row tiles
])
def test_qk_norm_rope_cache(dtype, n_parts, b, t, hq, hkv, d, s, qk_norm):
  """q in the attention's layout; K/V written at start + t and nowhere else (the cache's other
  slots keep their values; a row past the capacity writes nothing); the jnp twin bitwise."""
  parts, qn, kn, ck, cv, inv = _norm_rope_inputs(d + t, n_parts, b, t, hq, hkv, d, s, dtype)
  rng = np.random.default_rng(t)
  start = rng.integers(0, max(1, s - t + 1), b)
  if b == 3:
    start[2] = s - t + 1   # its last row falls past the capacity
  start = jnp.asarray(start, jnp.int32)
  kw = dict(n_head=hq, n_head_kv=hkv, eps=EPS, qk_norm=qk_norm)
  old_k, old_v = np.asarray(ck.astype(jnp.float32)), np.asarray(cv.astype(jnp.float32))
  q, nk, nv = N.qk_norm_rope_cache(parts, qn, kn, ck, cv, start, inv, **kw)
  twin = N.qk_norm_rope_cache_reference(parts, qn, kn, jnp.asarray(old_k, dtype),
                                        jnp.asarray(old_v, dtype), start, inv, **kw)
  for got, want in zip((q, nk, nv), twin):
    np.testing.assert_array_equal(_bits(got), _bits(want))
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  want_q, want_k, want_v, _ = numpy_qk_norm_rope_cache(parts, qn, kn, old_k, old_v,
                                                       np.asarray(start), inv, hq, hkv, qk_norm)
  np.testing.assert_allclose(np.asarray(q.astype(jnp.float32)).reshape(want_q.shape), want_q,
                             rtol=tol, atol=tol)
  np.testing.assert_allclose(np.asarray(nk.astype(jnp.float32)), want_k, rtol=tol, atol=tol)
  np.testing.assert_allclose(np.asarray(nv.astype(jnp.float32)), want_v, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "n_parts, b, t, hq, hkv, d, s, capacity, start, qk_norm, rope, extra, dtype", [
        # a ring: one sequence wraps within the pass, one's rows pass the capacity
        (2, 3, 16, 4, 2, 16, 24, 100, [30, 95, 10], True, True, 2, BF16),
        (1, 1, 8, 2, 1, 16, 24, 24, [20], True, True, 3, BF16),     # S = capacity
        (2, 2, 7, 8, 2, 16, 16, 48, [40, 12], False, True, 0, F32),  # no q/k norm
        (1, 2, 5, 4, 2, 48, 40, 4096, [77, 3], True, False, 1, F32),  # NoPE ring, d 48
        (3, 2, 20, 6, 2, 16, 64, 0, [0, 50], True, False, 4, BF16),   # NoPE, two row tiles
        (1, 1, 1, 4, 1, 16, 32, 0, [7], False, False, 2, F32),        # neither: q, k as is
    ], ids=lambda v: ("-".join(map(str, v)) if isinstance(v, list) else
                      jnp.dtype(v).name if isinstance(v, type) else str(v)))
def test_qk_norm_rope_cache_ring_nope_and_trailing_heads(n_parts, b, t, hq, hkv, d, s, capacity,
                                                         start, qk_norm, rope, extra, dtype):
  """capacity > 0: row t's K/V at slot (start + t) % S, rows at positions >= capacity dropped;
  rope=False: q and k normed (when qk_norm), not rotated; the cache's other slots keep their
  bits. Against the float64 transcription, the twin bitwise, and trailing heads in parts
  (LEAK-scaled) changing no bit: the same call with them cut off."""
  parts, qn, kn, ck, cv, inv = _norm_rope_inputs(d + t + extra, n_parts, b, t, hq, hkv, d, s,
                                                 dtype, extra=extra)
  start = jnp.asarray(start, jnp.int32)
  kw = dict(n_head=hq, n_head_kv=hkv, eps=EPS, qk_norm=qk_norm, rope=rope, capacity=capacity)
  old_k, old_v = np.asarray(ck.astype(jnp.float32)), np.asarray(cv.astype(jnp.float32))
  fresh = lambda: (jnp.asarray(old_k, dtype), jnp.asarray(old_v, dtype))
  got = N.qk_norm_rope_cache(parts, qn, kn, *fresh(), start, inv, **kw)
  cut = N.qk_norm_rope_cache(parts[:, :, :, :hq + 2 * hkv], qn, kn, *fresh(), start, inv, **kw)
  twin = N.qk_norm_rope_cache_reference(parts, qn, kn, *fresh(), start, inv, **kw)
  for a, c, w in zip(got, cut, twin):
    np.testing.assert_array_equal(_bits(a), _bits(c))
    np.testing.assert_array_equal(_bits(a), _bits(w))
  q, nk, nv = got
  want_q, want_k, want_v, written = numpy_qk_norm_rope_cache(
      parts, qn, kn, old_k, old_v, np.asarray(start), inv, hq, hkv, qk_norm, rope, capacity)
  assert written.any() and not written.all()
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(q.astype(jnp.float32)).reshape(want_q.shape), want_q,
                             rtol=tol, atol=tol)
  for new, old, want in ((nk, old_k, want_k), (nv, old_v, want_v)):
    new = np.asarray(new.astype(jnp.float32))
    np.testing.assert_allclose(new, want, rtol=tol, atol=tol)
    np.testing.assert_array_equal(new.transpose(0, 2, 1, 3)[~written],
                                  old.transpose(0, 2, 1, 3)[~written])


def test_qk_norm_rope_cache_rows_are_batch_invariant():
  """A row's q and K/V do not depend on the pass's width: a 16-row pass equals 1-row passes."""
  b, t, hq, hkv, d, s = 2, 16, 4, 2, 16, 48
  parts, qn, kn, ck, cv, inv = _norm_rope_inputs(7, 4, b, t, hq, hkv, d, s, jnp.bfloat16)
  start = jnp.asarray([3, 30], jnp.int32)
  kw = dict(n_head=hq, n_head_kv=hkv, eps=EPS)
  q, nk, nv = N.qk_norm_rope_cache(parts, qn, kn, ck, cv, start, inv, **kw)
  q = _bits(q).reshape(b, hkv, t, hq // hkv, d)
  for i in (0, 9, 15):
    q1, k1, v1 = N.qk_norm_rope_cache(parts[:, :, i:i + 1], qn, kn, ck, cv, start + i, inv,
                                      **kw)
    np.testing.assert_array_equal(_bits(q1), q[:, :, i])
    for c1, c in ((k1, nk), (v1, nv)):
      for j in range(b):
        np.testing.assert_array_equal(_bits(c1)[j, :, int(start[j]) + i],
                                      _bits(c)[j, :, int(start[j]) + i])


def test_qk_norm_rope_cache_limits():
  parts, qn, kn, ck, cv, inv = _norm_rope_inputs(0, 1, 1, 2, 4, 2, 16, 8, jnp.float32)
  start = jnp.zeros((1,), jnp.int32)
  with pytest.raises(ValueError, match="parts must hold at least n_head \\+ 2 n_head_kv heads"):
    N.qk_norm_rope_cache(parts, qn, kn, ck, cv, start, inv, n_head=6, n_head_kv=2, eps=EPS)
  with pytest.raises(ValueError, match="cache_v must match cache_k"):
    N.qk_norm_rope_cache(parts, qn, kn, ck, cv.astype(jnp.bfloat16), start, inv, n_head=4,
                         n_head_kv=2, eps=EPS)
  with pytest.raises(ValueError, match="block_rows must be a power of 2"):
    N.qk_norm_rope_cache(parts, qn, kn, ck, cv, start, inv, n_head=4, n_head_kv=2, eps=EPS,
                         block_rows=12)


# --- GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_gpu_qwen3_8b_shapes(dtype):
  """Qwen3-8B's attention shapes (8 kv heads, group 4, head_dim 128) with the target's default
  knobs over a 4096-slot cache at live lengths across several chunks: the compiled kernels
  against the twin, and rows of a 16-row pass bitwise equal to 1-row passes (the GPU's MMA,
  reductions and exp)."""
  from dflash_jax.dispatch import KernelPolicy, target_attention
  b, t, hkv, g, d, s = 2, 16, 8, 4, 128, 4096
  q, k, v, start = _attention_inputs(1, b, t, hkv, g, d, s, dtype, start=[100, 3000])
  kn = target_attention(t=t, group=g, head_dim=d, cache_dtype=dtype, impl="pallas",
                        policy=KernelPolicy()).kwargs()
  full = A.cache_attention(q, k, v, start, t=t, **kn)
  twin = A.cache_attention_reference(q, k, v, start, t=t, **kn)
  tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
  np.testing.assert_allclose(np.asarray(full), np.asarray(twin), atol=tol, rtol=tol)
  rows = q.reshape(b, hkv, t, g, d)
  for i in range(t):
    one = A.cache_attention(rows[:, :, i], k, v, start + i, t=1, **kn)
    np.testing.assert_array_equal(_bits(one)[:, 0], _bits(full)[:, i])
  parts, qn, kn_, ck, cv, inv = _norm_rope_inputs(2, 4, b, t, 32, 8, d, s, dtype)
  kw = dict(n_head=32, n_head_kv=8, eps=EPS)
  got = N.qk_norm_rope_cache(parts, qn, kn_, ck, cv, start, inv, **kw)
  want = N.qk_norm_rope_cache_reference(parts, qn, kn_, ck, cv, start, inv, **kw)
  for a, w in zip(got, want):   # GPU sin/cos and rsqrt may differ from XLA's by an ulp
    np.testing.assert_allclose(np.asarray(a.astype(jnp.float32)),
                               np.asarray(w.astype(jnp.float32)), atol=tol, rtol=tol)
  q1 = N.qk_norm_rope_cache(parts[:, :, 5:6], qn, kn_, ck, cv, start + 5, inv, **kw)[0]
  np.testing.assert_array_equal(_bits(q1), _bits(got[0]).reshape(b, 8, t, g, d)[:, :, 5])
