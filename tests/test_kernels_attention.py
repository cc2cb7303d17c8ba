"""ring_attention vs its jnp twin and vs an independent numpy float64 computation.

Inputs are seeded random; ring slots that a row must not see carry large values, so any
leak through the mask moves the output by far more than the tolerance. q is scaled up so
the softmax is peaked and the output is not just the mean of V.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.ring_attention import ring_attention, ring_attention_reference

# Interpret mode is float32 with HIGHEST dots; the kernel differs from the twin only by the
# online-softmax association order, observed <= 1.2e-6 at these sizes (outputs up to ~3).
TOL_TWIN = 5e-6
TOL_F64 = 5e-6
Q_SCALE = 3.0
LEAK = 1e3


def numpy_attention(q, k, v, ring_k, ring_v, ring_pos, n_past: int, layer: int
                    ) -> np.ndarray:
  """Direct float64 transcription of the visibility rule (SPEC.md section 3)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  rk = np.asarray(jnp.asarray(ring_k, jnp.float32), np.float64)[layer]
  rv = np.asarray(jnp.asarray(ring_v, jnp.float32), np.float64)[layer]
  pos = np.asarray(ring_pos)
  hkv, rows, d = q.shape
  t_len = k.shape[1]
  g = rows // t_len
  w = pos.shape[0]
  out = np.zeros((t_len, hkv * g * d))
  for h in range(hkv):
    for r in range(rows):
      t = r // g
      vis = [j for j in range(w) if 0 <= pos[j] < n_past and n_past + t - pos[j] < w]
      keys = np.concatenate([rk[h, vis], k[h]])
      vals = np.concatenate([rv[h, vis], v[h]])
      s = keys @ q[h, r] / math.sqrt(d)
      p = np.exp(s - s.max())
      col = (h * g + r % g) * d
      out[t, col:col + d] = (p / p.sum()) @ vals
  return out


def visible_any(pos: np.ndarray, n_past: int) -> np.ndarray:
  """Slots some row may see: [W] bool."""
  w = pos.shape[0]
  return (pos >= 0) & (pos < n_past) & (n_past - pos < w)


def make_inputs(seed: int, *, pos: np.ndarray, n_past: int, hkv=2, t_len=8, g=4, d=32,
                n_layer=3, ring_dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  w = pos.shape[0]
  q = Q_SCALE * rng.standard_normal((hkv, t_len * g, d))
  k = rng.standard_normal((hkv, t_len, d))
  v = rng.standard_normal((hkv, t_len, d))
  rk = rng.standard_normal((n_layer, hkv, w, d))
  rv = rng.standard_normal((n_layer, hkv, w, d))
  # Slots nobody may see get large values: a leak would dominate the output.
  hidden = ~visible_any(pos, n_past)
  rk[:, :, hidden] *= LEAK
  rv[:, :, hidden] *= LEAK
  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
  return (f32(q), f32(k), f32(v), jnp.asarray(rk, ring_dtype), jnp.asarray(rv, ring_dtype),
          jnp.asarray(pos, jnp.int32), jnp.asarray(n_past, jnp.int32))


def ring_pos_after(n_written: int, w: int) -> np.ndarray:
  """ring_pos after positions 0..n_written-1 were injected (slot p % W, later wins)."""
  pos = np.full(w, -1, np.int32)
  for p in range(n_written):
    pos[p % w] = p
  return pos


def check_against_both(args, *, layer: int, **knobs) -> np.ndarray:
  out = np.asarray(ring_attention(*args, layer=layer, window=args[3].shape[2], **knobs))
  twin = np.asarray(ring_attention_reference(*args, layer=layer, window=args[3].shape[2]))
  ref = numpy_attention(*args[:6], int(args[6]), layer)
  assert np.isfinite(out).all(), "kernel output has NaN/inf"
  np.testing.assert_allclose(out, twin, rtol=TOL_TWIN, atol=TOL_TWIN)
  np.testing.assert_allclose(out, ref, rtol=TOL_F64, atol=TOL_F64)
  np.testing.assert_allclose(twin, ref, rtol=TOL_F64, atol=TOL_F64)
  return out


W = 64
T = 8


def scenario(name: str) -> tuple[np.ndarray, int]:
  """(ring_pos, n_past) for a named ring state, W = 64 slots, T = 8 rows."""
  if name == "empty":
    return np.full(W, -1, np.int32), 0
  if name == "n_past0_with_future_slots":
    # Rejected-row leftovers at positions >= n_past must stay invisible.
    return ring_pos_after(5, W), 0
  if name == "partly_filled":
    # 21 committed positions plus 3 stale ones >= n_past; tiles 2..3 are empty (skipped).
    return ring_pos_after(24, W), 21
  if name == "window_edge":
    # Wrapped ring with one stale slot >= n_past: row t sees W - 1 - t slots.
    return ring_pos_after(201, W), 200
  if name == "late_rows_see_none":
    # Only 3 live positions at the window edge: rows t >= 3 see no ring slot at all.
    n_past = 200
    pos = np.full(W, -1, np.int32)
    for p in range(n_past - W + 1, n_past - W + 4):
      pos[p % W] = p
    return pos, n_past
  if name == "random":
    rng = np.random.default_rng(7)
    return rng.integers(-1, 110, size=W).astype(np.int32), 100
  raise KeyError(name)


SCENARIOS = ["empty", "n_past0_with_future_slots", "partly_filled", "window_edge",
             "late_rows_see_none", "random"]


@pytest.mark.parametrize("ring_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_scenarios(name, ring_dtype):
  pos, n_past = scenario(name)
  i = SCENARIOS.index(name)
  args = make_inputs(i, pos=pos, n_past=n_past, ring_dtype=ring_dtype)
  check_against_both(args, layer=i % 3, splits=(1, 2, 4)[i % 3], block_k=16,
                     interpret=True)


def test_scenarios_have_the_intended_visibility():
  """Guards the scenarios themselves: each must exercise what its name says."""
  def seen(name):
    pos, n_past = scenario(name)
    t = np.arange(T)[:, None]
    return (pos >= 0) & (pos < n_past) & (n_past + t - pos < W)
  assert not seen("empty").any() and not seen("n_past0_with_future_slots").any()
  pos, n_past = scenario("partly_filled")
  assert (pos >= n_past).sum() == 3 and seen("partly_filled")[:, 32:].sum() == 0
  edge = seen("window_edge").sum(1)
  assert list(edge) == [W - 1 - t for t in range(T)]
  late = seen("late_rows_see_none").sum(1)
  assert list(late) == [3, 2, 1] + [0] * (T - 3)
  rnd = seen("random")
  pos, n_past = scenario("random")
  assert rnd.any() and (pos >= n_past).any() and (pos == -1).any()


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("layer", [0, 2])
def test_splits_and_layers(splits, layer):
  pos, n_past = scenario("window_edge")
  args = make_inputs(11, pos=pos, n_past=n_past, ring_dtype=jnp.bfloat16)
  out = check_against_both(args, layer=layer, splits=splits, block_k=16, interpret=True)
  # Layers hold different data, so another layer's answer must differ.
  other = numpy_attention(*args[:6], n_past, (layer + 1) % 3)
  assert np.abs(out - other).max() > 1e-2


def test_wider_window_group_and_tiles():
  # G = 2, D = 16, W = 128 in 2 splits of 2 tiles of 32: several tiles per split.
  pos = ring_pos_after(300, 128)
  args = make_inputs(3, pos=pos, n_past=297, t_len=8, g=2, d=16)
  check_against_both(args, layer=1, splits=2, block_k=32, interpret=True)


def test_interpreter_poisons_unwritten_outputs():
  """The poisoned-output checks above rely on interpret mode filling unwritten outputs
  with NaN: every partial (o, m, l) feeds the combine, so a missed element shows as NaN."""
  def writes_nothing(x_ref, o_ref):
    del x_ref, o_ref
  out = pl.pallas_call(writes_nothing, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                       interpret=True)(jnp.ones(16, jnp.float32))
  assert np.isnan(np.asarray(out)).all()


@pytest.mark.parametrize("change,match", [
    (dict(d=24), "D must be a power of 2"),
    (dict(g=1, t_len=8), "T\\*G \\(rows of q\\) must be a power of 2 >= 16"),
    (dict(splits=8), "W must be a positive multiple of splits \\* block_k"),
    (dict(splits=3, block_k=16), "splits must be a power of 2"),
    (dict(block_k=8), "block_k must be a power of 2 >= 16"),
    (dict(layer=3), "layer must index"),
    (dict(ring_dtype=jnp.float16), "ring dtype must be float32 or bfloat16"),
])
def test_limits(change, match):
  change = dict(change)
  knobs = dict(splits=change.pop("splits", 2), block_k=change.pop("block_k", 16))
  layer = change.pop("layer", 0)
  args = make_inputs(0, pos=ring_pos_after(10, W), n_past=9, **change)
  with pytest.raises(ValueError, match=match):
    ring_attention(*args, layer=layer, window=W, interpret=True, **knobs)


# Real drafter dims on the H200: L=5, Hq=32, Hkv=8, D=128, W=2048, T=16.
@pytest.mark.gpu
@pytest.mark.parametrize("ring_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n_written,n_past", [(5003, 5000), (700, 697), (0, 0)],
                         ids=["window_edge", "partly_filled", "empty"])
def test_gpu_real_dims(n_written, n_past, ring_dtype):
  w = 2048
  args = make_inputs(5, pos=ring_pos_after(n_written, w), n_past=n_past, hkv=8, t_len=16,
                     g=4, d=128, n_layer=5, ring_dtype=ring_dtype)
  out = np.asarray(ring_attention(*args, layer=3, window=2048, interpret=False))
  twin = np.asarray(ring_attention_reference(*args, layer=3, window=2048))
  tol = TOL_TWIN
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out, twin, rtol=tol, atol=tol)
  if n_written == 5003:
    ref = numpy_attention(*args[:6], n_past, 3)
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("splits,block_k", [(8, 64), (16, 32), (16, 128), (32, 64)])
def test_gpu_knobs(splits, block_k):
  args = make_inputs(6, pos=ring_pos_after(3000, 2048), n_past=2990, hkv=8, t_len=16, g=4,
                     d=128, n_layer=5, ring_dtype=jnp.bfloat16)
  out = np.asarray(ring_attention(*args, layer=4, window=2048, splits=splits, block_k=block_k,
                                  interpret=False))
  twin = np.asarray(ring_attention_reference(*args, layer=4, window=2048))
  np.testing.assert_allclose(out, twin, rtol=TOL_TWIN, atol=TOL_TWIN)


@pytest.mark.parametrize("ring_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_two_terms_and_bf16_output(ring_dtype):
  """terms=2 keeps ~16 mantissa bits per product; out_dtype=bf16 is the rounded float32 result."""
  args = make_inputs(11, pos=ring_pos_after(90, W), n_past=90, ring_dtype=ring_dtype)
  ref = numpy_attention(*args[:6], 90, 1)
  three = np.asarray(ring_attention(*args, layer=1, window=W, splits=2, block_k=16, interpret=True))
  two = np.asarray(ring_attention(*args, layer=1, window=W, splits=2, block_k=16, terms=2,
                                  interpret=True))
  err3, err2 = np.abs(three - ref).max(), np.abs(two - ref).max()
  scale = np.abs(ref).max()
  assert err3 < TOL_F64 and err2 < 2.0 ** -12 * scale, (err3, err2)
  assert err2 > err3   # the third term is doing something
  b = ring_attention(*args, layer=1, window=W, splits=2, block_k=16, out_dtype=jnp.bfloat16,
                     interpret=True)
  assert b.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(b), three.astype(jnp.bfloat16))
