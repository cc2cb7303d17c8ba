"""pallas_kernels.qk_norm_rope: interpret mode vs the jnp twin, a float64 oracle and reference/."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.norm_rope import qk_norm_rope, qk_norm_rope_reference
from reference.dflash_ref import rms_norm, rope_neox

EPS = 1e-6
THETA = 10000.0
F32_TOL = dict(rtol=2e-5, atol=2e-5)   # float32 kernel vs float64 oracle, values ~O(3)


def inv_freq(d: int) -> np.ndarray:
  return (THETA ** (-2.0 * np.arange(d // 2, dtype=np.float64) / d)).astype(np.float32)


def make_case(seed: int, *, t: int, hkv: int, g: int, d: int, n_past: int, scalar_shape=()):
  rng = np.random.default_rng(seed)
  hq = hkv * g
  return dict(
      qkv=jnp.asarray(rng.normal(size=(t, (hq + 2 * hkv) * d)) * 3.0, jnp.float32),
      q_norm=jnp.asarray(1.0 + 0.2 * rng.normal(size=d), jnp.float32),
      k_norm=jnp.asarray(1.0 + 0.2 * rng.normal(size=d), jnp.float32),
      n_past=jnp.full(scalar_shape, n_past, jnp.int32),
      inv_freq=jnp.asarray(inv_freq(d)),
      n_head=hq, n_head_kv=hkv)


def args(c: dict):
  return c["qkv"], c["q_norm"], c["k_norm"], c["n_past"], c["inv_freq"]


def oracle(c: dict):
  """float64 numpy with explicit per-(token, head) loops and the ARCHITECTURE.md layouts.

  The angle is the float32 product float32(pos) * inv_freq (SPEC.md); the rest is float64.
  """
  hq, hkv = c["n_head"], c["n_head_kv"]
  g = hq // hkv
  d = c["q_norm"].shape[0]
  h = d // 2
  t_rows = c["qkv"].shape[0]
  x = np.asarray(c["qkv"], np.float64).reshape(t_rows, hq + 2 * hkv, d)
  n_past = int(np.asarray(c["n_past"]).reshape(()))
  inv = np.asarray(c["inv_freq"])

  def norm_rope(v, w, t):
    y = v / np.sqrt(np.mean(v * v) + EPS) * np.asarray(w, np.float64)
    ang = (np.float32(n_past + t) * inv).astype(np.float64)
    c_, s_ = np.cos(ang), np.sin(ang)
    return np.concatenate([y[:h] * c_ - y[h:] * s_, y[h:] * c_ + y[:h] * s_])

  q = np.empty((hkv, t_rows * g, d))
  k = np.empty((hkv, t_rows, d))
  v = np.empty((hkv, t_rows, d))
  for t in range(t_rows):
    for kvh in range(hkv):
      for gi in range(g):
        q[kvh, t * g + gi] = norm_rope(x[t, kvh * g + gi], c["q_norm"], t)
      k[kvh, t] = norm_rope(x[t, hq + kvh], c["k_norm"], t)
      v[kvh, t] = x[t, hq + hkv + kvh]
  return q, k, v


def run_kernel(c: dict, **knobs):
  return qk_norm_rope(*args(c), n_head=c["n_head"], n_head_kv=c["n_head_kv"], eps=EPS,
                      interpret=True, **knobs)


def run_twin(c: dict):
  return qk_norm_rope_reference(*args(c), n_head=c["n_head"], n_head_kv=c["n_head_kv"],
                                eps=EPS)


def assert_all_close(out, c: dict, twin_rtol: float):
  want = oracle(c)
  ref = run_twin(c)
  for got, w, r in zip(out, want, ref):
    assert got.dtype == jnp.float32 and got.shape == w.shape == r.shape
    np.testing.assert_allclose(np.asarray(got, np.float64), w, **F32_TOL)
    np.testing.assert_allclose(np.asarray(got), np.asarray(r), rtol=twin_rtol, atol=1e-6)
  # v is only re-laid out: bit-exact.
  np.testing.assert_array_equal(np.asarray(out[2]), want[2].astype(np.float32))


@pytest.mark.parametrize("t, hkv, g, d, n_past, scalar_shape", [
    (8, 2, 2, 16, 37, ()),
    (16, 2, 4, 32, 5000, (1,)),
    (4, 1, 8, 16, 0, ()),          # G > 2 Hkv: q blocks run past the k/v heads
    (8, 4, 1, 32, 123_456, ()),    # no GQA, large positions
    # Shapes the tiles do not fit (rows and head halves masked in power-of-2 tiles):
    (7, 2, 3, 48, 37, ()),         # block 7, G 3, head_dim 48
    (10, 1, 5, 80, 0, ()),         # block 10, G 5, head_dim 80
    (2, 2, 6, 16, 999, (1,)),      # block 2, G 6
])
def test_matches_oracle_and_twin(t, hkv, g, d, n_past, scalar_shape):
  c = make_case(t * 100 + g, t=t, hkv=hkv, g=g, d=d, n_past=n_past, scalar_shape=scalar_shape)
  assert_all_close(run_kernel(c), c, twin_rtol=2e-6)


@pytest.mark.parametrize("n_parts, t, g, d", [(1, 8, 4, 32), (3, 10, 3, 48), (4, 8, 4, 32)])
def test_split_k_partials_are_summed(n_parts, t, g, d):
  """qkv given as [S, T, W] partials: the kernel sums them in order (same as the twin, bit for
  bit on v) and the result is the norm/rope of that sum."""
  c = make_case(20 + n_parts, t=t, hkv=2, g=g, d=d, n_past=999)
  rng = np.random.default_rng(n_parts)
  noise = jnp.asarray(rng.normal(size=(n_parts - 1,) + c["qkv"].shape), jnp.float32)
  parts = jnp.concatenate([noise, (c["qkv"] - noise.sum(0))[None]], axis=0)
  summed = c | dict(qkv=qkv_sum_in_order(parts))
  out = run_kernel(c | dict(qkv=parts))
  want = oracle(summed)
  ref = run_twin(c | dict(qkv=parts))
  for got, w, r in zip(out, want, ref):
    np.testing.assert_allclose(np.asarray(got, np.float64), w, **F32_TOL)
    np.testing.assert_allclose(np.asarray(got), np.asarray(r), rtol=2e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(ref[2]))
  # The partials with their heads split, [S, T, heads, D] (what a caller vmapping over a slot
  # axis of the rows passes): the same launch on the same bytes, bit for bit.
  split = c | dict(qkv=parts.reshape(n_parts, t, -1, d))
  for got, same in ((run_kernel(split), out), (run_twin(split), ref)):
    for a, b in zip(got, same):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def qkv_sum_in_order(parts):
  acc = np.asarray(parts[0])
  for p in np.asarray(parts)[1:]:
    acc = acc + p
  return jnp.asarray(acc)


def test_q_rows_are_token_major_within_group():
  """Row r of q[kvh] is token r // G of query head kvh*G + r % G (reshape to [T, G, D])."""
  c = make_case(11, t=8, hkv=2, g=4, d=16, n_past=3)
  q, _, _ = run_kernel(c)
  want_q = oracle(c)[0].reshape(2, 8, 4, 16)
  got_q = np.asarray(q).reshape(2, 8, 4, 16)
  for kvh, t, gi in [(0, 0, 1), (1, 5, 3), (1, 7, 0)]:
    np.testing.assert_allclose(got_q[kvh, t, gi], want_q[kvh, t, gi], **F32_TOL)


def test_matches_reference_module():
  """Against reference/dflash_ref (rms_norm per head, rope_neox at n_past + t)."""
  c = make_case(12, t=16, hkv=2, g=2, d=32, n_past=777)
  q, k, _ = run_kernel(c)
  x = np.asarray(c["qkv"]).reshape(16, 8, 32)
  pos = 777 + np.arange(16)
  qr = rope_neox(rms_norm(x[:, :4], np.asarray(c["q_norm"]), EPS), pos,
                 np.asarray(c["inv_freq"]))                         # [T, Hq, D]
  kr = rope_neox(rms_norm(x[:, 4:6], np.asarray(c["k_norm"]), EPS), pos,
                 np.asarray(c["inv_freq"]))                         # [T, Hkv, D]
  qr = qr.reshape(16, 2, 2, 32).transpose(1, 0, 2, 3).reshape(2, 32, 32)
  np.testing.assert_allclose(np.asarray(q), qr, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(k), kr.transpose(1, 0, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides, match", [
    (dict(d=24), r"head_dim must be a multiple of 16 in \[16, 256\] \(got 24\)"),
    (dict(d=272), r"head_dim must be a multiple of 16 in \[16, 256\] \(got 272\)"),
    (dict(t=65), r"block width .* must be in \[1, 64\] \(got 65\)"),
])
def test_kernel_limits(overrides, match):
  kw = dict(t=8, hkv=2, g=2, d=16, n_past=1) | overrides
  c = make_case(13, **kw)
  with pytest.raises(ValueError, match=match):
    run_kernel(c)


def test_limits_shapes_and_dtypes():
  c = make_case(14, t=8, hkv=2, g=2, d=16, n_past=1)
  with pytest.raises(ValueError, match="qkv width must be"):
    run_kernel(c | dict(qkv=c["qkv"][:, :-16]))
  with pytest.raises(ValueError, match="n_past dtype must be int32"):
    run_kernel(c | dict(n_past=jnp.asarray(1.0, jnp.float32)))
  with pytest.raises(ValueError, match="qkv must be"):
    run_kernel(c | dict(qkv=c["qkv"][None, None, None]))
  with pytest.raises(ValueError, match="qkv width must be"):   # heads split at the wrong D
    run_kernel(c | dict(qkv=c["qkv"].reshape(1, 8, -1, 8)))
  with pytest.raises(ValueError, match="qkv dtype must be float32"):
    run_kernel(c | dict(qkv=c["qkv"].astype(jnp.bfloat16)))
  with pytest.raises(ValueError, match=r"k_norm shape must be \(16,\)"):
    run_kernel(c | dict(k_norm=jnp.ones((8,), jnp.float32)))
  with pytest.raises(ValueError, match="n_head must be a positive multiple of n_head_kv"):
    run_kernel(c | dict(n_head=5))


def _assert_parts_of_f32(c: dict, interpret: bool):
  """parts=True is the bf16 split of the float32 launch's outputs (q / sqrt(D)): bitwise in
  interpret mode; compiled, the two launches' float32 values may differ by a few ulps of the
  rope's terms (FMA contraction in another kernel: the H200 runs found 1 of 65536 q elements
  one bf16 step apart, then 3e-9 apart at -8.3e-5 where x cos - y sin cancels between terms
  near 0.17), so there hi + lo agree to the split's 2^-15 plus 2^-20 of the largest value."""
  from pallas_kernels.ring_attention_mgpu import split_operands
  kw = dict(n_head=c["n_head"], n_head_kv=c["n_head_kv"], eps=EPS, interpret=interpret)
  f32 = qk_norm_rope(*args(c), **kw)
  parts = qk_norm_rope(*args(c), parts=True, **kw)
  want = jax.jit(split_operands)(*f32)
  assert len(parts) == 6
  as32 = lambda x: np.asarray(x, np.float32)
  for i, (got, w) in enumerate(zip(parts, want, strict=True)):
    assert got.dtype == jnp.bfloat16 and got.shape == w.shape, i
    if interpret:
      np.testing.assert_array_equal(as32(got), as32(w), err_msg=str(i))
  for i in (0, 2, 4):
    x = as32(want[i]) + as32(want[i + 1])
    np.testing.assert_allclose(as32(parts[i]) + as32(parts[i + 1]), x,
                               rtol=2.0 ** -15, atol=2.0 ** -15 * np.abs(x).max(), err_msg=str(i))
  # the low parts carry the next 8 bits: they are not all zero
  assert all(np.abs(as32(parts[i])).max() > 0 for i in (1, 3, 5))
  scale = 1.0 / np.sqrt(c["q_norm"].shape[0])
  q = np.asarray(f32[0]) * scale
  np.testing.assert_allclose(as32(parts[0]) + as32(parts[1]), q, rtol=2.0 ** -15,
                             atol=1e-30 if interpret else 2.0 ** -20 * np.abs(q).max())


@pytest.mark.parametrize("t, hkv, g, d", [(16, 2, 4, 64), (10, 2, 3, 48)])
def test_parts_are_the_split_of_the_float32_outputs(t, hkv, g, d):
  _assert_parts_of_f32(make_case(18, t=t, hkv=hkv, g=g, d=d, n_past=300), interpret=True)


# ---------------------------------------------------------------- GPU (H200), real dims
@pytest.mark.gpu
@pytest.mark.parametrize("n_past", [0, 2040, 131_000])
def test_gpu_compiled_matches_twin(n_past):
  c = make_case(15, t=16, hkv=8, g=4, d=128, n_past=n_past)
  out = qk_norm_rope(*args(c), n_head=32, n_head_kv=8, eps=EPS, interpret=False)
  # libdevice vs XLA cos/sin and reduction order: a few float32 ulp.
  assert_all_close(out, c, twin_rtol=1e-5)


@pytest.mark.gpu
def test_gpu_parts_are_the_split_of_the_float32_outputs():
  _assert_parts_of_f32(make_case(19, t=16, hkv=8, g=4, d=128, n_past=2040), interpret=False)


def test_twin_takes_any_shape():
  """The jnp twin has no Triton limits: head_dim 6, block 3, G 3."""
  c = make_case(16, t=3, hkv=2, g=3, d=6, n_past=11)
  for got, want in zip(run_twin(c), oracle(c)):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, **F32_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("t, hkv, g, d, n_parts", [
    (16, 8, 3, 128, 4),    # group 3 (24 query heads), the qkv GEMM's 4 split-K partials
    (10, 8, 4, 128, 1),    # block 10
    (7, 8, 4, 96, 4),      # block 7, head_dim 96
    (16, 4, 4, 256, 1),    # head_dim 256
])
def test_gpu_published_shapes(t, hkv, g, d, n_parts):
  c = make_case(17, t=t, hkv=hkv, g=g, d=d, n_past=4097)
  rng = np.random.default_rng(t)
  noise = jnp.asarray(rng.normal(size=(n_parts - 1,) + c["qkv"].shape), jnp.float32)
  parts = jnp.concatenate([noise, (c["qkv"] - noise.sum(0))[None]], axis=0)
  c = c | dict(qkv=parts)
  out = qk_norm_rope(*args(c), n_head=hkv * g, n_head_kv=hkv, eps=EPS, interpret=False)
  want = oracle(c | dict(qkv=qkv_sum_in_order(parts)))
  ref = run_twin(c)
  for got, w, r in zip(out, want, ref):
    np.testing.assert_allclose(np.asarray(got, np.float64), w, **F32_TOL)
    np.testing.assert_allclose(np.asarray(got), np.asarray(r), rtol=1e-5, atol=1e-6)
