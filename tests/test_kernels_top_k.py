"""The selector's kernels (interpret mode on CPU, compiled on the GPU): top_k against a numpy
top-k written from lax.top_k's semantics and against lax.top_k itself; selector_walk against a
numpy walk, greedy and with noise; the Pallas walk's draws against the XLA walk's
jax.random.categorical draws for the same keys; the DFlash2 readout on both paths."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from dflash_jax import dispatch
from dflash_jax.drafter import step as S
from pallas_kernels import selector_walk as W
from pallas_kernels import top_k as T
from test_reference_families import dflash2_cfg


# --------------------------------------------------------------------------------- references
def numpy_top_k(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
  """Each row's k largest in the floats' total order (-NaN < -inf < ... < -0.0 < +0.0 < ...
  < +inf < NaN, the order lax.top_k sorts by), largest first, equal values by lower index."""
  x = np.asarray(x, np.float32)
  rows = x.reshape(-1, x.shape[-1])
  vals, idx = [], []
  for row in rows:
    nan, neg = np.isnan(row), np.signbit(row)
    group = np.where(nan, np.where(neg, 0, 2), 1)
    value = np.where(nan, 0.0, row).astype(np.float64)
    zero_rank = np.where(value == 0, (~neg).astype(np.int64), 0)     # +0.0 above -0.0
    order = np.lexsort((np.arange(row.size), -zero_rank, -value, -group))[:k]
    vals.append(row[order])
    idx.append(order.astype(np.int32))
  shape = x.shape[:-1] + (k,)
  return np.stack(vals).reshape(shape), np.stack(idx).reshape(shape)


def numpy_walk(unary, edge, noisy=None) -> tuple[np.ndarray, np.ndarray]:
  """prev = 0; score_p = unary[p] + edge[p, prev]; chosen_p = first argmax of score_p (or of
  noisy[p, prev]); prev = chosen_p; per slot."""
  s, n, k = unary.shape
  chosen = np.zeros((s, n), np.int32)
  scores = np.zeros((s, n, k), np.float32)
  for b in range(s):
    prev = 0
    for p in range(n):
      scores[b, p] = unary[b, p] + edge[b, p, prev]
      prev = int(np.argmax(scores[b, p] if noisy is None else noisy[b, p, prev]))
      chosen[b, p] = prev
  return chosen, scores


def assert_bitwise(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
  np.testing.assert_array_equal(got.view(np.int32) if got.dtype == np.float32 else got,
                                want.view(np.int32) if want.dtype == np.float32 else want)


def make_rows(rng, shape, data: str) -> np.ndarray:
  if data == "normal":
    return (3 * rng.standard_normal(shape)).astype(np.float32)
  if data == "ties":   # a few values, many equal, some -inf
    x = rng.integers(-3, 3, size=shape).astype(np.float32)
    x[x == -3] = -np.inf
    return x
  # specials: both zeros, infinities and both NaNs among ties
  pool = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, -np.nan, 2.0], np.float32)
  return pool[rng.integers(0, pool.size, size=shape)]


# ------------------------------------------------------------------------------------ top_k
# (leading shape, V, k, block_v): V past the last block, V below one block, V == k, k of 1,
# 4, 16 and 5 (no power of 2), 1, 15 and 32 rows, the default knobs (None).
TOP_K_SHAPES = [((15,), 1000, 16, 256), ((1,), 100, 16, 256), ((3,), 16, 16, None),
                ((32,), 700, 1, 128), ((15,), 8192, 16, None), ((4,), 300, 4, 64),
                ((5,), 300, 5, 64), ((2, 3), 257, 16, 32)]


@pytest.mark.parametrize("data", ["normal", "ties", "specials"])
@pytest.mark.parametrize("lead,v,k,block_v", TOP_K_SHAPES)
def test_top_k_matches_numpy_and_lax(lead, v, k, block_v, data):
  rng = np.random.default_rng(hash((lead, v, k, data)) % 2 ** 32)
  x = make_rows(rng, lead + (v,), data)
  x2 = x if len(lead) > 1 else x.reshape(1, *x.shape)   # a [T, V] slab per leading index
  vals, idx = T.top_k(jnp.asarray(x2), k=k, block_v=block_v, interpret=True)
  want_v, want_i = numpy_top_k(x2, k)
  assert_bitwise(vals, want_v)
  assert_bitwise(idx, want_i)
  lv, li = jax.lax.top_k(jnp.asarray(x2), k)
  assert_bitwise(vals, lv)
  assert_bitwise(idx, li)


@pytest.mark.parametrize("first", [1, 3])
def test_top_k_from_first_row(first):
  """Rows before `first` of every slab are skipped (the selector's anchor row)."""
  rng = np.random.default_rng(first)
  x = make_rows(rng, (2, 7, 600), "ties")
  vals, idx = T.top_k(jnp.asarray(x), k=16, first=first, block_v=128, interpret=True)
  want_v, want_i = numpy_top_k(x[:, first:], 16)
  assert_bitwise(vals, want_v)
  assert_bitwise(idx, want_i)
  rv, ri = T.top_k_reference(jnp.asarray(x), k=16, first=first)
  assert_bitwise(rv, want_v)
  assert_bitwise(ri, want_i)


@pytest.mark.parametrize("v,k", [(8192, 16), (202048, 16), (32000, 4), (20, 20), (100, 64)])
def test_default_knobs_are_valid(v, k):
  kn = T.default_knobs(v, k)
  assert kn.block_v >= k and kn.block_v & (kn.block_v - 1) == 0
  assert 1 <= kn.num_warps <= 4 and 1 <= kn.merge_warps <= 4
  assert -(-v // kn.block_v) * k <= 2 * T._MERGE_LANES or kn.block_v == T._MAX_BLOCK


@pytest.mark.parametrize("shape,dtype,k,kw,match", [
    ((4, 10), jnp.float32, 11, {}, r"k must be in \[1, V\]"),
    ((4, 100), jnp.float32, 65, {}, "k must be <= 64"),
    ((4, 100), jnp.bfloat16, 4, {}, "x must be float32"),
    ((100,), jnp.float32, 4, {}, r"x must be \[..., T, V\]"),
    ((4, 100), jnp.float32, 4, dict(block_v=48), "block_v must be a power of 2 >= k"),
    ((4, 100), jnp.float32, 16, dict(block_v=8), "block_v must be a power of 2 >= k"),
    ((4, 100), jnp.float32, 4, dict(first=4), r"first must be in \[0, T\)"),
])
def test_top_k_limits(shape, dtype, k, kw, match):
  with pytest.raises(ValueError, match=match):
    T.top_k(jnp.zeros(shape, dtype), k=k, interpret=True, **kw)


# ------------------------------------------------------------------------------------- walk
def walk_inputs(rng, s, n, k, data):
  if data == "ties":   # integer scores: many equal sums, some -inf
    u = rng.integers(-2, 3, size=(s, n, k)).astype(np.float32)
    e = rng.integers(-2, 3, size=(s, n, k, k)).astype(np.float32)
    u[rng.random(u.shape) < 0.1] = -np.inf
  else:
    u = rng.standard_normal((s, n, k)).astype(np.float32)
    e = rng.standard_normal((s, n, k, k)).astype(np.float32)
  return u, e


@pytest.mark.parametrize("noise", [False, True])
@pytest.mark.parametrize("data", ["normal", "ties"])
@pytest.mark.parametrize("s,n,k", [(1, 15, 16), (4, 15, 16), (3, 7, 4), (2, 5, 5), (1, 1, 1),
                                   (2, 16, 3)])
def test_walk_matches_numpy(s, n, k, data, noise):
  rng = np.random.default_rng(s * 1000 + n * 10 + k)
  u, e = walk_inputs(rng, s, n, k, data)
  z = (rng.integers(-2, 3, size=e.shape).astype(np.float32) if data == "ties"
       else rng.standard_normal(e.shape).astype(np.float32)) if noise else None
  chosen, scores = W.selector_walk(jnp.asarray(u), jnp.asarray(e),
                                   None if z is None else jnp.asarray(z), interpret=True)
  want_c, want_s = numpy_walk(u, e, z)
  assert_bitwise(chosen, want_c)
  assert_bitwise(scores, want_s)


@pytest.mark.parametrize("shapes,match", [
    (((2, 3, 4), (2, 3, 4, 5), None), r"edge must be \[2, 3, 4, 4\]"),
    (((2, 3, 4), (2, 3, 4, 4), (2, 3, 4)), "noisy must be None or edge's shape"),
    (((2, 3, 65), (2, 3, 65, 65), None), r"k in \[1, 64\]"),
    (((3, 4), (3, 4, 4), None), r"unary must be \[S, n, k\]"),
])
def test_walk_limits(shapes, match):
  args = [None if sh is None else jnp.zeros(sh, jnp.float32) for sh in shapes]
  with pytest.raises(ValueError, match=match):
    W.selector_walk(*args, interpret=True)


def _dispatch_walks(u, e, temperature, keys):
  return [dispatch.selector_walk(jnp.asarray(u), jnp.asarray(e), temperature=temperature,
                                 keys=keys, impl=impl) for impl in ("pallas", "xla")]


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0, 1.7])
@pytest.mark.parametrize("data", ["normal", "ties"])
def test_pallas_walk_draws_as_categorical(temperature, data):
  """The Pallas walk (Gumbel noise drawn up front) and the XLA scan (jax.random.categorical
  per row) choose the same candidates with the same keys, and give the same scores."""
  s, n, k = 3, 15, 16
  u, e = walk_inputs(np.random.default_rng(7), s, n, k, data)
  keys = None
  if temperature:
    keys = jax.vmap(lambda kk: jax.random.split(kk, n))(
        jax.random.split(jax.random.key(11), s))
  (pc, ps), (xc, xs) = jax.jit(_dispatch_walks, static_argnums=2)(u, e, temperature, keys)
  assert_bitwise(pc, xc)
  assert_bitwise(ps, xs)
  if temperature:   # the draws are draws: not every row takes the argmax
    greedy, _ = numpy_walk(u, e)
    assert (np.asarray(pc) != greedy).any()


# ---------------------------------------------------------------------------------- readout
def _readouts(params, logits, h, id_last, key, temperature):
  return [S.dflash2_readout(params, impl, logits, h, id_last, temperature,
                            key if temperature else None) for impl in ("pallas", "xla")]


def readout_check(n_vocab: int, s: int, temperature: float):
  cfg = dflash2_cfg()
  w = dfj.synthetic_drafter(cfg, seed=2, n_vocab=n_vocab)
  w["selector_predecessor"] = w["selector_predecessor"] * np.float32(2.0)
  params = dfj.prepare_weights(cfg, w, "fp32")
  ks = jax.random.split(jax.random.key(4), 4)
  logits = 3 * jax.random.normal(ks[0], (s, cfg.block_size, n_vocab), jnp.float32)
  h = jax.random.normal(ks[1], (s, cfg.block_size, cfg.n_embd), jnp.float32)
  id_last = jax.random.randint(ks[2], (s,), 0, n_vocab, jnp.int32)
  f = jax.jit(_readouts, static_argnums=5)
  pal, xla = f(params, logits, h, id_last, jax.random.split(ks[3], s), temperature)
  for name in ("drafts", "candidates", "scores", "top_prob", "q"):
    a, b = getattr(pal, name), getattr(xla, name)
    assert (a is None) == (b is None), name
    if a is not None:
      assert_bitwise(a, b)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_readout_pallas_equals_xla(temperature):
  """The DFlash2 readout on the Pallas path (both kernels) is the XLA path's, bit for bit."""
  readout_check(512, 2, temperature)


# -------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("data", ["normal", "ties"])
@pytest.mark.parametrize("v", [8192, 202048])
def test_gpu_top_k_equals_lax_top_k(v, data):
  """The selector's shape: a block's 15 draft rows (rows 1..15 of 16), k 16."""
  x = jnp.asarray(make_rows(np.random.default_rng(v), (1, 16, v), data))
  vals, idx = T.top_k(x, k=16, first=1, interpret=False)
  want_v, want_i = numpy_top_k(np.asarray(x)[:, 1:], 16)   # first: the semantics
  assert_bitwise(vals, want_v)
  assert_bitwise(idx, want_i)
  want_v, want_i = jax.lax.top_k(x[:, 1:], 16)             # then XLA's GPU top-k
  assert_bitwise(vals, want_v)
  assert_bitwise(idx, want_i)


@pytest.mark.gpu
@pytest.mark.parametrize("noise", [False, True])
@pytest.mark.parametrize("data", ["normal", "ties"])
def test_gpu_walk_matches_numpy(data, noise):
  rng = np.random.default_rng(3)
  u, e = walk_inputs(rng, 4, 15, 16, data)
  z = rng.standard_normal(e.shape).astype(np.float32) if noise else None
  chosen, scores = W.selector_walk(jnp.asarray(u), jnp.asarray(e),
                                   None if z is None else jnp.asarray(z), interpret=False)
  want_c, want_s = numpy_walk(u, e, z)
  assert_bitwise(chosen, want_c)
  assert_bitwise(scores, want_s)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0])
def test_gpu_pallas_walk_draws_as_categorical(temperature):
  test_pallas_walk_draws_as_categorical(temperature, "normal")


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("v,s", [(8192, 1), (202048, 1), (8192, 4)])
def test_gpu_readout_pallas_equals_xla(v, s, temperature):
  readout_check(v, s, temperature)
