"""pallas_kernels.inject: interpret mode vs the jnp twin, a float64 numpy oracle and reference/."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.inject import inject, inject_reference
from reference.dflash_ref import rms_norm, rope_neox

EPS = 1e-6
THETA = 10000.0
# float32 kernel vs float64 oracle: rsqrt, cos/sin and sums each cost a few ulp of values ~O(3).
F32_TOL = dict(rtol=2e-5, atol=2e-5)
BF16_EPS = 2.0 ** -8   # bf16 spacing relative to the value; one rounding is <= half of it


def inv_freq(d: int) -> np.ndarray:
  return (THETA ** (-2.0 * np.arange(d // 2, dtype=np.float64) / d)).astype(np.float32)


def make_case(seed: int, *, L=2, hkv=2, d=16, w=32, positions, kv_dtype=jnp.float32,
              ring_dtype=jnp.float32):
  """Random kv / norms and a ring poisoned with random values (never zeros)."""
  rng = np.random.default_rng(seed)
  t = len(positions)
  return dict(
      ring_k=jnp.asarray(rng.normal(size=(L, hkv, w, d)), ring_dtype),
      ring_v=jnp.asarray(rng.normal(size=(L, hkv, w, d)), ring_dtype),
      ring_pos=jnp.asarray(rng.integers(-1, 10_000, size=w), jnp.int32),
      kv=jnp.asarray(rng.normal(size=(t, L, 2, hkv, d)) * 3.0, kv_dtype),
      k_norm=jnp.asarray(1.0 + 0.2 * rng.normal(size=(L, d)), jnp.float32),
      positions=jnp.asarray(positions, jnp.int32),
      inv_freq=jnp.asarray(inv_freq(d)))


def oracle(c: dict, n_valid: int, wrap: bool = True):
  """float64 numpy: rows applied one after another, so later rows overwrite earlier ones;
  slot pos % S (wrap) or pos, skipped when pos >= S (a full-attention cache).

  Returns the expected float64 K/V, ring_pos, and the set of slots written. The angle is the
  float32 product float32(pos) * inv_freq, as SPEC.md defines it; the rest is float64.
  """
  kv = np.asarray(c["kv"].astype(jnp.float32), np.float64)
  kn = np.asarray(c["k_norm"], np.float64)
  pos = np.asarray(c["positions"])
  inv = np.asarray(c["inv_freq"])
  rk = np.asarray(c["ring_k"].astype(jnp.float32), np.float64).copy()
  rv = np.asarray(c["ring_v"].astype(jnp.float32), np.float64).copy()
  rp = np.asarray(c["ring_pos"]).copy()
  L, hkv, w, d = rk.shape
  h = d // 2
  written = set()
  for t in range(min(max(n_valid, 0), len(pos))):
    if not wrap and pos[t] >= w:
      continue
    s = int(pos[t]) % w
    ang = (np.float32(pos[t]) * inv).astype(np.float64)
    for l in range(L):
      x = kv[t, l, 0]                                          # [Hkv, D]
      y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * kn[l]
      y1, y2 = y[:, :h], y[:, h:]
      rk[l, :, s] = np.concatenate([y1 * np.cos(ang) - y2 * np.sin(ang),
                                    y2 * np.cos(ang) + y1 * np.sin(ang)], axis=-1)
      rv[l, :, s] = kv[t, l, 1]
    rp[s] = pos[t]
    written.add(s)
  return rk, rv, rp, sorted(written)


def run_kernel(c: dict, n_valid, **knobs):
  return inject(c["ring_k"], c["ring_v"], c["ring_pos"], c["kv"], c["k_norm"], c["positions"],
                n_valid, c["inv_freq"], eps=EPS, interpret=True, **knobs)


def run_twin(c: dict, n_valid, wrap: bool = True):
  return inject_reference(c["ring_k"], c["ring_v"], c["ring_pos"], c["kv"], c["k_norm"],
                          c["positions"], n_valid, c["inv_freq"], eps=EPS, wrap=wrap)


def assert_matches_oracle(out, c: dict, n_valid: int, wrap: bool = True):
  rk, rv, rp = (np.asarray(a) for a in out)
  ek, ev, ep, written = oracle(c, n_valid, wrap)
  w = rk.shape[2]
  untouched = [s for s in range(w) if s not in written]
  # Untouched slots: bit-identical to the poisoned input.
  np.testing.assert_array_equal(rk[:, :, untouched], np.asarray(c["ring_k"])[:, :, untouched])
  np.testing.assert_array_equal(rv[:, :, untouched], np.asarray(c["ring_v"])[:, :, untouched])
  np.testing.assert_array_equal(rp, ep)
  ring_dtype = c["ring_k"].dtype
  got_k = rk[:, :, written].astype(np.float64)
  want_k = ek[:, :, written]
  if ring_dtype == jnp.bfloat16:
    np.testing.assert_allclose(got_k, want_k, rtol=BF16_EPS, atol=1e-5)
  else:
    np.testing.assert_allclose(got_k, want_k, **F32_TOL)
  # V is a pure cast: exact, whatever the dtypes.
  np.testing.assert_array_equal(rv[:, :, written], ev[:, :, written].astype(ring_dtype))


def assert_matches_twin(out, ref):
  for a, b in zip(out[:2], ref[:2]):
    assert a.dtype == b.dtype and a.shape == b.shape
    a32, b32 = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
    # Kernel and twin share the float32 formula; a bf16 store may round one ulp apart, and an
    # ulp is up to 2 * BF16_EPS relative to a value just below a power of 2 (seen on the H200).
    rtol = 2 * BF16_EPS if a.dtype == jnp.bfloat16 else 2e-6
    np.testing.assert_allclose(a32, b32, rtol=rtol, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(ref[2]))


CASES = {
    # name: (positions, n_valid, extra make_case kwargs, knobs)
    "wrap_f32": (np.arange(50, 66), 16, {}, {}),
    "wrap_bf16_ring_bf16_kv": (np.arange(50, 66), 16,
                               dict(ring_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16), {}),
    "bf16_ring_f32_kv": (np.arange(7, 23), 16, dict(ring_dtype=jnp.bfloat16), {}),
    "f32_ring_bf16_kv": (np.arange(7, 23), 16, dict(kv_dtype=jnp.bfloat16), {}),
    "n_valid_lt_T": (np.arange(100, 116), 5, {}, {}),
    "n_valid_0": (np.arange(100, 116), 0, {}, {}),
    "n_valid_gt_T": (np.arange(3, 11), 99, {}, {}),
    "T_gt_W_ragged": (np.arange(9, 84), 75, dict(ring_dtype=jnp.bfloat16), {}),
    "T_gt_W_partial_valid": (np.arange(0, 80), 70, {}, dict(block_rows=8)),
    "duplicates_across_tiles": (np.random.default_rng(7).integers(0, 90, size=24), 21, {},
                                dict(block_rows=8)),
    "single_row_large_pos": (np.array([1_000_003]), 1, dict(w=64, d=32), dict(block_rows=4)),
    "hkv4_L3_W64": (np.arange(1000, 1040), 33, dict(L=3, hkv=4, w=64), dict(block_rows=16)),
    # Shapes the tiles do not fit: block 10 in a 16-row tile, head_dim 48 (24-wide halves
    # in 32-wide tiles), a 48-slot ring wrapped by the block.
    "t10_d48_s48": (np.arange(40, 50), 10, dict(w=48, d=48), {}),
    # Block 7, head_dim 80, a 1000-slot bf16 ring, random far positions.
    "t7_d80_s1000": (np.random.default_rng(3).integers(0, 5000, size=7), 7,
                     dict(L=1, w=1000, d=80, ring_dtype=jnp.bfloat16), {}),
    # A full-attention cache of 40 slots (wrap=False): rows at positions >= 40 write
    # nothing, duplicates resolve to the later row, rows >= n_valid write nothing.
    "full_cache_past_capacity": (np.array([30, 5, 39, 40, 5, 41, 12, 39, 100, 7, 2, 3]), 11,
                                 dict(w=40), dict(wrap=False, block_rows=4)),
}


@pytest.mark.parametrize("seed, name", list(enumerate(CASES)))
def test_inject_matches_oracle_and_twin(seed, name):
  positions, n_valid, extra, knobs = CASES[name]
  wrap = knobs.get("wrap", True)
  c = make_case(seed, positions=positions, **extra)
  nv = jnp.asarray(n_valid, jnp.int32)
  out = run_kernel(c, nv, **knobs)
  assert_matches_oracle(out, c, n_valid, wrap)
  assert_matches_twin(out, run_twin(c, nv, wrap))
  assert_matches_oracle(run_twin(c, nv, wrap), c, n_valid, wrap)


@pytest.mark.parametrize("wrap", [True, False])
def test_twin_takes_any_shape(wrap):
  """The jnp twin has no Triton limits: head_dim 6, a 5-slot ring, 9 rows."""
  c = make_case(30, L=2, hkv=3, d=6, w=5, positions=np.array([0, 7, 2, 3, 9, 4, 5, 1, 2]))
  assert_matches_oracle(run_twin(c, jnp.asarray(8, jnp.int32), wrap), c, 8, wrap)


def test_n_valid_0_leaves_ring_bit_identical():
  c = make_case(1, positions=np.arange(16))
  out = run_kernel(c, jnp.zeros((1,), jnp.int32))
  for got, want in zip(out, (c["ring_k"], c["ring_v"], c["ring_pos"])):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_same_slot_later_row_wins():
  # Every row maps to slot 3 (W = 32), in three different tiles: the last valid one wins.
  positions = np.array([3, 35, 67, 99, 131, 163, 195, 227, 259, 291, 323, 355])
  c = make_case(2, positions=positions)
  out = run_kernel(c, jnp.asarray(10, jnp.int32), block_rows=4)
  assert int(out[2][3]) == 291
  ek, ev, _, written = oracle(c, 10)
  assert written == [3]
  np.testing.assert_allclose(np.asarray(out[0][:, :, 3], np.float64), ek[:, :, 3], **F32_TOL)
  np.testing.assert_array_equal(np.asarray(out[1][:, :, 3]),
                                np.asarray(c["kv"][9, :, 1], np.float32))


def test_matches_reference_module():
  """Against reference/dflash_ref (rms_norm, rope_neox): the project's eager float32 oracle."""
  c = make_case(3, L=2, hkv=2, d=32, w=32, positions=np.arange(20, 44))
  n_valid = 21
  out = run_kernel(c, jnp.asarray(n_valid, jnp.int32), block_rows=8)
  kv = np.asarray(c["kv"])
  pos = np.asarray(c["positions"])[:n_valid]
  rk = np.asarray(c["ring_k"]).copy()
  rv = np.asarray(c["ring_v"]).copy()
  for l in range(2):
    k = rope_neox(rms_norm(kv[:n_valid, l, 0], np.asarray(c["k_norm"][l]), EPS), pos,
                  np.asarray(c["inv_freq"]))                      # [T, Hkv, D]
    for t in range(n_valid):                                      # sequential: later wins
      rk[l, :, pos[t] % 32] = k[t]
      rv[l, :, pos[t] % 32] = kv[t, l, 1]
  np.testing.assert_allclose(np.asarray(out[0]), rk, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(out[1]), rv)


def _pallas_eqns(jaxpr):
  """pallas_call equations of a jaxpr, looking through nested (jit) sub-jaxprs."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
      continue
    for p in eqn.params.values():
      if hasattr(p, "jaxpr"):
        yield from _pallas_eqns(p.jaxpr)


@pytest.mark.parametrize("ring_dtype", [jnp.float32, jnp.bfloat16])
def test_rings_aliased_and_donated(ring_dtype):
  c = make_case(4, positions=np.arange(16), ring_dtype=ring_dtype)
  args = (c["ring_k"], c["ring_v"], c["ring_pos"], c["kv"], c["k_norm"], c["positions"],
          jnp.asarray(16, jnp.int32), c["inv_freq"])
  f = functools.partial(inject, eps=EPS, interpret=True)
  # The pallas_call itself aliases the three rings (inputs 6, 7, 8) to its outputs.
  [eqn] = list(_pallas_eqns(jax.make_jaxpr(f)(*args).jaxpr))
  assert tuple(eqn.params["input_output_aliases"]) == ((6, 0), (7, 1), (8, 2))
  compiled = jax.jit(f, donate_argnums=(0, 1, 2)).lower(*args).compile()
  assert "input_output_alias" in compiled.as_text()
  ring_bytes = sum(a.size * a.dtype.itemsize for a in args[:3])
  assert compiled.memory_analysis().alias_size_in_bytes == ring_bytes


@pytest.mark.parametrize("bad, match", [
    (dict(d=24), r"head_dim must be a multiple of 16 in \[16, 256\] \(got 24\)"),
    (dict(d=272), r"head_dim must be a multiple of 16 in \[16, 256\] \(got 272\)"),
    (dict(kv_dtype=jnp.float16), "kv dtype must be float32 or bfloat16"),
    (dict(ring_dtype=jnp.float16), "ring_k dtype must be float32 or bfloat16"),
])
def test_limits_dtype_and_head_dim(bad, match):
  c = make_case(5, positions=np.arange(8), **bad)
  with pytest.raises(ValueError, match=match):
    run_kernel(c, jnp.asarray(8, jnp.int32))


@pytest.mark.parametrize("field, value, match", [
    ("ring_pos", jnp.zeros((16,), jnp.int32), r"ring_pos shape must be \(S,\)"),
    ("k_norm", jnp.ones((3, 16), jnp.float32), r"k_norm shape must be \(L, D\)"),
    ("positions", jnp.arange(8, dtype=jnp.float32), "positions dtype must be int32"),
    ("kv", jnp.ones((8, 2, 2, 3, 16), jnp.float32), r"kv shape must be \[T, L, 2, Hkv, D\]"),
    ("inv_freq", jnp.ones((16,), jnp.float32), r"inv_freq shape must be \(D/2,\)"),
])
def test_limits_shapes(field, value, match):
  c = make_case(6, positions=np.arange(8))
  c[field] = value
  with pytest.raises(ValueError, match=match):
    run_kernel(c, jnp.asarray(8, jnp.int32))


def test_limits_block_rows_and_n_valid():
  c = make_case(7, positions=np.arange(8))
  with pytest.raises(ValueError, match="block_rows must be a power of 2"):
    run_kernel(c, jnp.asarray(8, jnp.int32), block_rows=12)
  with pytest.raises(ValueError, match="n_valid must be a scalar"):
    run_kernel(c, jnp.asarray([8, 8], jnp.int32))


# ---------------------------------------------------------------- GPU (H200), real dims
GPU_DIMS = dict(L=5, hkv=8, d=128, w=2048)


@pytest.mark.gpu
@pytest.mark.parametrize("ring_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("positions, n_valid", [
    (np.arange(2040, 2056), 16),       # one block, wrapping past W
    (np.arange(2040, 2056), 7),        # partially accepted block
    (np.arange(0, 3000), 3000),        # prefill longer than the window: last 2048 survive
    (np.random.default_rng(9).integers(0, 5000, size=64), 60),   # duplicates
])
def test_gpu_compiled_matches_twin(ring_dtype, positions, n_valid):
  c = make_case(8, positions=positions, ring_dtype=ring_dtype, kv_dtype=jnp.bfloat16,
                **GPU_DIMS)
  nv = jnp.asarray(n_valid, jnp.int32)
  f = functools.partial(inject, c["ring_k"], c["ring_v"], c["ring_pos"], c["kv"], c["k_norm"],
                        c["positions"], nv, c["inv_freq"], eps=EPS, interpret=False)
  out = f()
  assert_matches_twin(out, run_twin(c, nv))
  assert_matches_oracle(out, c, n_valid)
  # Duplicate slots are resolved before the scatter, so concurrent programs never race.
  for _ in range(3):
    for a, b in zip(f(), out):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
def test_gpu_in_place_under_donation():
  c = make_case(10, positions=np.arange(100, 116), ring_dtype=jnp.bfloat16, **GPU_DIMS)
  f = jax.jit(functools.partial(inject, eps=EPS, interpret=False), donate_argnums=(0, 1, 2))
  args = (c["ring_k"] + 0, c["ring_v"] + 0, c["ring_pos"] + 0, c["kv"], c["k_norm"],
          c["positions"], jnp.asarray(16, jnp.int32), c["inv_freq"])
  compiled = f.lower(*args).compile()
  ring_bytes = sum(a.size * a.dtype.itemsize for a in args[:3])
  assert compiled.memory_analysis().alias_size_in_bytes == ring_bytes
  assert compiled.memory_analysis().temp_size_in_bytes < ring_bytes   # no ring copy
  ptrs = [a.unsafe_buffer_pointer() for a in args[:3]]
  out = f(*args)
  assert [o.unsafe_buffer_pointer() for o in out] == ptrs
  assert_matches_twin(out, run_twin(c, jnp.asarray(16, jnp.int32)))


# Published drafters' shapes at real dims: (make_case kwargs, positions, n_valid, wrap).
GPU_SHAPES = {
    "window3000_block16": (dict(L=5, hkv=8, d=128, w=3000), np.arange(5990, 6006), 16, True),
    "window3000_prefill": (dict(L=5, hkv=8, d=128, w=3000), np.arange(0, 4100), 4100, True),
    "block10_partial": (dict(L=5, hkv=8, d=128, w=2048), np.arange(2040, 2050), 7, True),
    "head_dim96_block7": (dict(L=5, hkv=8, d=96, w=2048), np.arange(100, 107), 7, True),
    "head_dim256": (dict(L=5, hkv=4, d=256, w=2048), np.arange(2040, 2056), 16, True),
    "full8192_past_capacity": (dict(L=1, hkv=8, d=128, w=8192), np.arange(8180, 8196), 16,
                               False),
    "full40960_prefill": (dict(L=1, hkv=8, d=128, w=40960), np.arange(0, 3000), 3000, False),
}


@pytest.fixture(scope="module", params=list(GPU_SHAPES))
def gpu_inject_case(request):
  """Inputs, the twin's result and the float64 oracle, once per shape."""
  extra, positions, n_valid, wrap = GPU_SHAPES[request.param]
  c = make_case(11, positions=positions, ring_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
                **extra)
  nv = jnp.asarray(n_valid, jnp.int32)
  return request.param, c, nv, n_valid, wrap, run_twin(c, nv, wrap)


@pytest.mark.gpu
def test_gpu_published_shapes(gpu_inject_case):
  name, c, nv, n_valid, wrap, twin = gpu_inject_case
  out = inject(c["ring_k"], c["ring_v"], c["ring_pos"], c["kv"], c["k_norm"], c["positions"],
               nv, c["inv_freq"], eps=EPS, wrap=wrap, interpret=False)
  assert_matches_twin(out, twin)
  assert_matches_oracle(out, c, n_valid, wrap)
