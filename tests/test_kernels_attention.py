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

from dflash_jax.dispatch import KernelPolicy
from pallas_kernels import ring_attention as RA
from pallas_kernels.ring_attention import (Knobs, chunking, ring_attention,
                                           ring_attention_reference)


def default_knobs(*args, **kw) -> Knobs:
  """The kernel's default knobs under the default policy's threshold."""
  return RA.default_knobs(*args, fold_own_min_seqs=KernelPolicy().fold_own_min_seqs, **kw)


# Interpret mode is float32 with HIGHEST dots; the kernel differs from the twin only by the
# online-softmax association order, observed <= 1.2e-6 at these sizes (outputs up to ~3).
TOL_TWIN = 5e-6
TOL_F64 = 5e-6
Q_SCALE = 3.0
LEAK = 1e3


def numpy_attention(q, k, v, ring_k, ring_v, ring_pos, n_past: int, layer: int,
                    window: int | None, causal: bool = False, band: int | None = None
                    ) -> np.ndarray:
  """Direct float64 transcription of the visibility rule (SPEC.md sections 3 and 7; the block
  masks of SPEC_dflash2_dspark 5.4: causal, and the band of a sliding layer)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  rk = np.asarray(jnp.asarray(ring_k, jnp.float32), np.float64)[layer]
  rv = np.asarray(jnp.asarray(ring_v, jnp.float32), np.float64)[layer]
  pos = np.asarray(ring_pos)
  hkv, rows, d = q.shape
  t_len = k.shape[1]
  g = rows // t_len
  s = pos.shape[0]
  out = np.zeros((t_len, hkv * g * d))
  for h in range(hkv):
    for r in range(rows):
      t = r // g
      vis = [j for j in range(s) if 0 <= pos[j] < n_past
             and (window is None or n_past + t - pos[j] < window)]
      own = [j for j in range(t_len) if not (causal and j > t) and not (
          band is not None and (t - j >= band or (not causal and j - t >= band)))]
      keys = np.concatenate([rk[h, vis], k[h, own]])
      vals = np.concatenate([rv[h, vis], v[h, own]])
      sc = keys @ q[h, r] / math.sqrt(d)
      p = np.exp(sc - sc.max())
      col = (h * g + r % g) * d
      out[t, col:col + d] = (p / p.sum()) @ vals
  return out


def visible_any(pos: np.ndarray, n_past: int, window: int | None) -> np.ndarray:
  """Slots some row may see: [S] bool."""
  vis = (pos >= 0) & (pos < n_past)
  return vis if window is None else vis & (n_past - pos < window)


def make_inputs(seed: int, *, pos: np.ndarray, n_past: int, hkv=2, t_len=8, g=4, d=32,
                n_layer=3, ring_dtype=jnp.float32, window: int | None = "slots"):
  """window "slots": a sliding ring of S = pos.shape[0] slots (W = S)."""
  rng = np.random.default_rng(seed)
  w = pos.shape[0]
  window = w if window == "slots" else window
  q = Q_SCALE * rng.standard_normal((hkv, t_len * g, d))
  k = rng.standard_normal((hkv, t_len, d))
  v = rng.standard_normal((hkv, t_len, d))
  rk = rng.standard_normal((n_layer, hkv, w, d))
  rv = rng.standard_normal((n_layer, hkv, w, d))
  # Slots nobody may see get large values: a leak would dominate the output.
  hidden = ~visible_any(pos, n_past, window)
  rk[:, :, hidden] *= LEAK
  rv[:, :, hidden] *= LEAK
  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
  return (f32(q), f32(k), f32(v), jnp.asarray(rk, ring_dtype), jnp.asarray(rv, ring_dtype),
          jnp.asarray(pos, jnp.int32), jnp.asarray(n_past, jnp.int32))


def ring_pos_after(n_written: int, s: int, wrap: bool = True) -> np.ndarray:
  """ring_pos after positions 0..n_written-1 were injected: slot p % S, later wins (a sliding
  ring), or slot p for p < S (a full-attention cache, wrap=False)."""
  pos = np.full(s, -1, np.int32)
  for p in range(n_written):
    if wrap or p < s:
      pos[p % s] = p
  return pos


def check_against_both(args, *, layer: int, window: int | None, causal: bool = False,
                       band: int | None = None, **knobs) -> np.ndarray:
  masks = dict(causal=causal, band=band)
  out = np.asarray(ring_attention(*args, layer=layer, window=window, **masks, **knobs))
  twin = np.asarray(ring_attention_reference(*args, layer=layer, window=window, **masks))
  ref = numpy_attention(*args[:6], int(args[6]), layer, window, **masks)
  # Interpret mode fills outputs with NaN before the kernels run: an output element (or a
  # partial feeding the combine) that is never written shows here.
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
  check_against_both(args, layer=i % 3, window=W, splits=(1, 2, 4)[i % 3], block_k=16,
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
  out = check_against_both(args, layer=layer, window=W, splits=splits, block_k=16,
                           interpret=True)
  # Layers hold different data, so another layer's answer must differ.
  other = numpy_attention(*args[:6], n_past, (layer + 1) % 3, W)
  assert np.abs(out - other).max() > 1e-2


def test_wider_window_group_and_tiles():
  # G = 2, D = 16, W = 128 in 2 splits of 2 tiles of 32: several tiles per split.
  pos = ring_pos_after(300, 128)
  args = make_inputs(3, pos=pos, n_past=297, t_len=8, g=2, d=16)
  check_against_both(args, layer=1, window=128, splits=2, block_k=32, interpret=True)


def test_interpreter_poisons_unwritten_outputs():
  """The poisoned-output checks above rely on interpret mode filling unwritten outputs
  with NaN: every partial (o, m, l) feeds the combine, so a missed element shows as NaN."""
  def writes_nothing(x_ref, o_ref):
    del x_ref, o_ref
  out = pl.pallas_call(writes_nothing, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                       interpret=True)(jnp.ones(16, jnp.float32))
  assert np.isnan(np.asarray(out)).all()


# Shapes the seed's tiles do not fit, each combining several axes (interpret mode is slow):
# (hkv, T, G, D, S, window, n_written, wrap, n_past, knobs).
SHAPES = {
    # G 3, block 7, D 48 (a 64-wide tile), a 48-slot ring in 3 chunks of one 16-slot tile.
    "g3_t7_d48_w48": (2, 7, 3, 48, 48, 48, 103, True, 100, dict(splits=3, block_k=16)),
    # Full-attention cache (no window edge) of 37 slots: the last chunk runs past S; block
    # 10 with G 1 (10 query rows in a 16-row tile, 10 own keys in a 16-key tile); 3 stale
    # rows past n_past stay invisible.
    "full_s37_t10_g1": (1, 10, 1, 16, 37, None, 33, False, 30, dict(splits=2, block_k=16)),
    # G 6, block 5: 30 rows in two 16-row query tiles; window 20 narrower than the 50 slots.
    "g6_t5_window_lt_slots": (2, 5, 6, 32, 50, 20, 48, True, 45,
                              dict(splits=4, block_k=16, block_q=16)),
    # 19 chunks (two combine groups of 16, the second masked), G 5, D 80, full cache.
    "full_s300_19_chunks_g5_d80": (1, 8, 5, 80, 300, None, 295, False, 290,
                                   dict(splits=20, block_k=16)),
    # D 256 with G 16: the combine takes 8 of a token's 16 heads per program; T 2.
    "g16_d256_t2": (1, 2, 16, 256, 256, None, 250, False, 240, dict(splits=16, block_k=16)),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_any_shape_matches_twin_and_float64(name):
  hkv, t, g, d, s, window, n_written, wrap, n_past, knobs = SHAPES[name]
  pos = ring_pos_after(n_written, s, wrap)
  i = list(SHAPES).index(name)
  args = make_inputs(40 + i, pos=pos, n_past=n_past, hkv=hkv, t_len=t, g=g, d=d, n_layer=2,
                     ring_dtype=(jnp.float32, jnp.bfloat16)[i % 2], window=window)
  check_against_both(args, layer=1, window=window, interpret=True, **knobs)


@pytest.mark.parametrize("case", ["empty", "window_edge", "random", "g6_t5_window_lt_slots",
                                  "full_s37_t10_g1"])
def test_fold_own(case):
  """fold_own: chunk 0's program attends the block's own keys too (no own partial); the
  empty ring leaves only the own keys, the SHAPES cases add row tiles and a ragged chunk."""
  if case in SHAPES:
    hkv, t, g, d, s, window, n_written, wrap, n_past, knobs = SHAPES[case]
    args = make_inputs(60, pos=ring_pos_after(n_written, s, wrap), n_past=n_past, hkv=hkv,
                       t_len=t, g=g, d=d, n_layer=2, ring_dtype=jnp.bfloat16, window=window)
    check_against_both(args, layer=1, window=window, interpret=True, fold_own=True, **knobs)
  else:
    pos, n_past = scenario(case)
    args = make_inputs(61, pos=pos, n_past=n_past, ring_dtype=jnp.bfloat16)
    check_against_both(args, layer=2, window=W, splits=4, block_k=16, interpret=True,
                       fold_own=True)


@pytest.mark.parametrize("causal,band,fold_own,shape", [
    (True, None, False, "seed-like"), (False, 3, False, "seed-like"), (True, 3, True, "seed-like"),
    (True, None, True, "g6_t5_window_lt_slots"), (False, 2, False, "g3_t7_d48_w48"),
    (True, 4, False, "full_s37_t10_g1")])
def test_block_masks(causal, band, fold_own, shape):
  """DFlash2's causal and band masks over the block's own keys (SPEC_dflash2_dspark 5.4), with
  the own keys in their own program or folded into chunk 0, several row tiles, G not a power
  of 2: kernel, twin and float64 agree, and the masks change the output."""
  if shape == "seed-like":
    pos, n_past = scenario("window_edge")
    args = make_inputs(70, pos=pos, n_past=n_past, ring_dtype=jnp.bfloat16)
    window, knobs = W, dict(splits=4, block_k=16)
  else:
    hkv, t, g, d, s, window, n_written, wrap, n_past, knobs = SHAPES[shape]
    args = make_inputs(71, pos=ring_pos_after(n_written, s, wrap), n_past=n_past, hkv=hkv,
                       t_len=t, g=g, d=d, n_layer=2, window=window)
  layer = 1
  out = check_against_both(args, layer=layer, window=window, causal=causal, band=band,
                           interpret=True, fold_own=fold_own, **knobs)
  plain = np.asarray(ring_attention_reference(*args, layer=layer, window=window))
  assert np.abs(out - plain).max() > 1e-2
  with pytest.raises(ValueError, match="band must be None or an int >= 1"):
    ring_attention_reference(*args, layer=layer, window=window, band=0)


def test_twin_takes_shapes_the_kernel_does_not():
  """The jnp twin has no Triton limits: head_dim 24, a 5-slot ring, block 3, G 3."""
  for window, wrap in ((None, False), (2, True)):
    pos = ring_pos_after(9, 5, wrap)
    args = make_inputs(50, pos=pos, n_past=8, hkv=2, t_len=3, g=3, d=24, n_layer=2,
                       window=window)
    twin = np.asarray(ring_attention_reference(*args, layer=0, window=window))
    np.testing.assert_allclose(twin, numpy_attention(*args[:6], 8, 0, window),
                               rtol=TOL_F64, atol=TOL_F64)


def test_default_knobs():
  """The tuned launch shapes (RESULTS.md's attention sweeps) at the seed's 2048-slot ring, and
  the rules of default_knobs' docstring elsewhere; chunking's chunk counts for each."""
  seed_bf16 = default_knobs(2048, 2048, jnp.bfloat16)
  assert seed_bf16 == Knobs(splits=16, block_k=128, terms=2)
  assert chunking(2048, 16, 128) == (128, 16)
  assert default_knobs(2048, 2048, jnp.float32) == Knobs(splits=16, block_k=64, terms=3)
  assert chunking(2048, 16, 64) == (128, 16)             # two 64-slot tiles per chunk
  # Window 3000: 16 chunks of 188 slots round up to 2 tiles, so 12 chunks of 256.
  assert default_knobs(3000, 3000, jnp.bfloat16) == Knobs(splits=16, block_k=128, terms=2)
  assert chunking(3000, 16, 128) == (256, 12)
  # Small rings: a quarter of the ring per tile (>= 16 slots).
  assert default_knobs(48, 48, jnp.bfloat16) == Knobs(splits=3, block_k=16, terms=2)
  assert chunking(48, 3, 16) == (16, 3)
  assert default_knobs(1000, 1000, jnp.bfloat16).block_k == 128
  assert chunking(1000, 8, 128) == (128, 8)
  assert default_knobs(1, 1, jnp.float32) == Knobs(splits=1, block_k=16, terms=3)
  # Full-attention caches take up to 32 chunks.
  assert default_knobs(40960, None, jnp.bfloat16).splits == 32
  assert chunking(40960, 32, 128) == (2048, 20)
  assert chunking(8192, 32, 128) == (256, 32)
  # head_dim > 128 halves the tiles (two stages of K and V tiles in shared memory).
  assert default_knobs(2048, 2048, jnp.bfloat16, head_dim=256).block_k == 64
  assert default_knobs(2048, 2048, jnp.float32, head_dim=256).block_k == 32
  # Batched launches (n_seqs slots vmapped): about 256 programs, 64-slot tiles from 8 slots;
  # one sequence and S = 2 keep the unbatched knobs.
  assert default_knobs(2048, 2048, jnp.bfloat16, n_seqs=1) == seed_bf16
  assert default_knobs(2048, 2048, jnp.bfloat16, n_seqs=2) == seed_bf16
  # From 4 slots the block's own keys fold into chunk 0's program (fold_own_min_seqs).
  assert default_knobs(2048, 2048, jnp.bfloat16, n_seqs=8) == Knobs(splits=4, block_k=64,
                                                                    terms=2, fold_own=True)
  assert default_knobs(2048, 2048, jnp.bfloat16, n_seqs=32) == Knobs(splits=1, block_k=64,
                                                                     terms=2, fold_own=True)
  assert not default_knobs(2048, 2048, jnp.bfloat16, n_seqs=3).fold_own
  assert default_knobs(2048, 2048, jnp.bfloat16, n_seqs=4).fold_own
  assert default_knobs(2048, 2048, jnp.bfloat16, n_seqs=4, n_head_kv=4).splits == 16
  # The threshold is the caller's (a KernelPolicy's fold_own_min_seqs; None: never).
  assert not RA.default_knobs(2048, 2048, jnp.bfloat16, n_seqs=32,
                              fold_own_min_seqs=None).fold_own
  assert RA.default_knobs(2048, 2048, jnp.bfloat16, n_seqs=2, fold_own_min_seqs=2).fold_own


@pytest.mark.parametrize("change,match", [
    (dict(d=24), "head_dim must be a multiple of 16 in \\[16, 256\\] \\(got 24\\)"),
    (dict(d=272), "head_dim must be a multiple of 16 in \\[16, 256\\] \\(got 272\\)"),
    (dict(t_len=65, g=1), "block width .* must be in \\[1, 64\\] \\(got 65\\)"),
    (dict(splits=0), "splits must be an int >= 1"),
    (dict(block_k=24), "block_k must be a power of 2 >= 16"),
    (dict(block_k=8), "block_k must be a power of 2 >= 16"),
    (dict(block_q=8), "block_q must be a power of 2 >= 16"),
    (dict(terms=1), "terms"),
    (dict(layer=3), "layer must index"),
    (dict(window=0), "window must be None \\(full attention\\) or an int >= 1"),
    (dict(ring_dtype=jnp.float16), "ring dtype must be float32 or bfloat16"),
])
def test_limits(change, match):
  change = dict(change)
  knobs = {kn: change.pop(kn) for kn in ("splits", "block_k", "block_q", "terms")
           if kn in change}
  knobs = dict(dict(splits=2, block_k=16), **knobs)
  layer = change.pop("layer", 0)
  window = change.pop("window", W)
  args = make_inputs(0, pos=ring_pos_after(10, W), n_past=9, **change)
  with pytest.raises(ValueError, match=match):
    ring_attention(*args, layer=layer, window=window, interpret=True, **knobs)


# ---------------------------------------------------------------- GPU (H200), real dims
# The seed drafter: L=5, Hq=32, Hkv=8, D=128, W=2048, T=16.
@pytest.mark.gpu
@pytest.mark.parametrize("ring_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n_written,n_past", [(5003, 5000), (700, 697), (0, 0)],
                         ids=["window_edge", "partly_filled", "empty"])
def test_gpu_real_dims(n_written, n_past, ring_dtype):
  w = 2048
  args = make_inputs(5, pos=ring_pos_after(n_written, w), n_past=n_past, hkv=8, t_len=16,
                     g=4, d=128, n_layer=5, ring_dtype=ring_dtype)
  out = np.asarray(ring_attention(*args, layer=3, window=w, interpret=False))
  twin = np.asarray(ring_attention_reference(*args, layer=3, window=w))
  tol = TOL_TWIN
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out, twin, rtol=tol, atol=tol)
  if n_written == 5003:
    ref = numpy_attention(*args[:6], n_past, 3, w)
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("splits,block_k,fold_own", [(8, 64, False), (16, 32, False),
                                                    (16, 128, False), (32, 64, False),
                                                    (4, 64, True), (16, 128, True)])
def test_gpu_knobs(splits, block_k, fold_own):
  args = make_inputs(6, pos=ring_pos_after(3000, 2048), n_past=2990, hkv=8, t_len=16, g=4,
                     d=128, n_layer=5, ring_dtype=jnp.bfloat16)
  out = np.asarray(ring_attention(*args, layer=4, window=2048, splits=splits,
                                  block_k=block_k, fold_own=fold_own, interpret=False))
  twin = np.asarray(ring_attention_reference(*args, layer=4, window=2048))
  np.testing.assert_allclose(out, twin, rtol=TOL_TWIN, atol=TOL_TWIN)


# Published drafters' shapes at real dims: (hkv, T, G, D, S, window, n_written, wrap, n_past).
GPU_SHAPES = {
    "g3": (8, 16, 3, 128, 2048, 2048, 5003, True, 5000),
    "block10": (8, 10, 4, 128, 2048, 2048, 5003, True, 5000),
    "block7": (8, 7, 4, 128, 2048, 2048, 700, True, 697),
    "window3000": (8, 16, 4, 128, 3000, 3000, 7003, True, 7000),
    "window48": (8, 16, 4, 128, 48, 48, 303, True, 300),
    "head_dim96": (8, 16, 4, 96, 2048, 2048, 2500, True, 2497),
    "head_dim256": (4, 16, 4, 256, 2048, 2048, 2500, True, 2497),
    "full8192": (8, 16, 4, 128, 8192, None, 6003, False, 6000),
    "full40960": (8, 16, 4, 128, 40960, None, 40003, False, 40000),
}


@pytest.fixture(scope="module", params=list(GPU_SHAPES))
def gpu_shape_case(request):
  """Inputs and the twin's answer, once per shape (the kernel runs for both ring dtypes)."""
  hkv, t, g, d, s, window, n_written, wrap, n_past = GPU_SHAPES[request.param]
  cases = {}
  for ring_dtype in (jnp.float32, jnp.bfloat16):
    args = make_inputs(7, pos=ring_pos_after(n_written, s, wrap), n_past=n_past, hkv=hkv,
                       t_len=t, g=g, d=d, n_layer=2, ring_dtype=ring_dtype, window=window)
    cases[ring_dtype] = (args, np.asarray(ring_attention_reference(*args, layer=1,
                                                                   window=window)))
  return request.param, window, cases


@pytest.mark.gpu
@pytest.mark.parametrize("ring_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_published_shapes(gpu_shape_case, ring_dtype):
  """default_knobs' launch at each shape vs the twin (terms 2 on the bf16 ring: ~16 mantissa
  bits per product, far below the bf16 ring's own rounding but above TOL_TWIN)."""
  name, window, cases = gpu_shape_case
  args, twin = cases[ring_dtype]
  s, d = args[3].shape[2], args[0].shape[2]
  knobs = default_knobs(s, window, ring_dtype, head_dim=d)
  out = np.asarray(ring_attention(*args, layer=1, window=window, interpret=False,
                                  **knobs.kwargs()))
  assert np.isfinite(out).all(), name
  tol = TOL_TWIN if knobs.terms == 3 else 2.0 ** -12 * np.abs(twin).max()
  np.testing.assert_allclose(out, twin, rtol=tol, atol=tol, err_msg=name)


@pytest.mark.parametrize("ring_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_two_terms_and_bf16_output(ring_dtype):
  """terms=2 keeps ~16 mantissa bits per product; out_dtype=bf16 is the rounded float32 result."""
  args = make_inputs(11, pos=ring_pos_after(90, W), n_past=90, ring_dtype=ring_dtype)
  ref = numpy_attention(*args[:6], 90, 1, W)
  three = np.asarray(ring_attention(*args, layer=1, window=W, splits=2, block_k=16,
                                    interpret=True))
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


@pytest.mark.gpu
@pytest.mark.parametrize("causal,band,fold_own", [(True, None, False), (False, 12, False),
                                                  (True, 12, True)])
def test_gpu_block_masks(causal, band, fold_own):
  """DFlash2's block masks compiled at the seed drafter's dims (T 16, G 4, D 128, W 2048):
  the kernel against its twin and float64; the masks change the output."""
  args = make_inputs(8, pos=ring_pos_after(3000, 2048), n_past=2990, hkv=8, t_len=16, g=4,
                     d=128, n_layer=5, ring_dtype=jnp.bfloat16)
  masks = dict(causal=causal, band=band)
  out = np.asarray(ring_attention(*args, layer=2, window=2048, fold_own=fold_own,
                                  interpret=False, **masks))
  twin = np.asarray(ring_attention_reference(*args, layer=2, window=2048, **masks))
  np.testing.assert_allclose(out, twin, rtol=TOL_TWIN, atol=TOL_TWIN)
  ref = numpy_attention(*args[:6], 2990, 2, 2048, **masks)
  np.testing.assert_allclose(out, ref, rtol=TOL_F64, atol=TOL_F64)
  plain = np.asarray(ring_attention_reference(*args, layer=2, window=2048))
  assert np.abs(out - plain).max() > 1e-3
