"""ring_attention_mgpu (Mosaic GPU partials of a batched bf16 ring) vs the jnp twin.

Every slot of a batch gets its own seeded random ring, positions and n_past (full and
wrapped, partly filled, empty, with slots past n_past), so a slot that read another slot's
ring or position would miss its own twin by far more than the tolerance. Tolerance: the two
bf16 terms per float32 operand keep ~16 mantissa bits per product (2^-12 of the output's
scale, as the Triton kernel's two-term tests state).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.dispatch import KernelPolicy
from pallas_kernels import ring_attention as RA
from pallas_kernels import ring_attention_mgpu as M
from tests.test_kernels_attention import make_inputs, ring_pos_after

D, HKV, T, G, L = 128, 8, 16, 4, 3


def batch_inputs(seed: int, cases, *, s: int, window, ring_dtype=jnp.bfloat16):
  """cases: per slot (n_written, n_past); a ring of s slots each, window `window`."""
  per = [make_inputs(seed + i, pos=ring_pos_after(n_written, s, window is not None),
                     n_past=n_past, hkv=HKV, t_len=T, g=G, d=D, n_layer=L,
                     ring_dtype=ring_dtype, window=window)
         for i, (n_written, n_past) in enumerate(cases)]
  return tuple(jnp.stack([p[i] for p in per]) for i in range(7))


def batched(args, **kw):
  """The kernel on float32 operands: their bf16 parts by `split_operands`."""
  return M.ring_attention_batched(*M.split_operands(*args[:3]), *args[3:], **kw)


def twin(args, *, layer, window):
  f = lambda *a: RA.ring_attention_reference(*a, layer=layer, window=window)
  return np.asarray(jax.vmap(f)(*args))


def test_fits():
  assert M.fits(64, 16, 128, 2048, jnp.bfloat16, 4)
  assert not M.fits(48, 16, 128, 2048, jnp.bfloat16, 4)     # G = 3
  assert not M.fits(64, 8, 128, 2048, jnp.bfloat16, 4)      # T = 8
  assert not M.fits(64, 16, 96, 2048, jnp.bfloat16, 4)      # head_dim 96
  assert not M.fits(64, 16, 128, 2048, jnp.float32, 4)      # fp32 ring
  assert not M.fits(64, 16, 128, 3000, jnp.bfloat16, 4)     # ragged chunks
  assert M.fits(64, 16, 128, 2048, jnp.bfloat16, 32)        # 32 chunks of one 64-slot tile
  # Shared memory: up to 5 pipeline stages of 64-slot K, V and position tiles.
  assert M.smem_bytes(16, 128, 5) <= M.SMEM_LIMIT < M.smem_bytes(16, 128, 6)


def test_default_knobs_aim_at_128_programs():
  """The chunk count makes about PROGRAMS programs of slots x kv heads x chunks; None where
  the shape is not the kernel's (48 packed rows, an fp32 ring). Whether the kernel runs at
  all is dispatch's (test_batch's routing tests)."""
  assert M.default_knobs(1, 8, 64, 16, 128, 2048, jnp.bfloat16) == M.Knobs(splits=16, steps=2)
  assert M.default_knobs(2, 8, 64, 16, 128, 2048, jnp.bfloat16) == M.Knobs(splits=8)
  assert M.default_knobs(8, 8, 64, 16, 128, 2048, jnp.bfloat16) == M.Knobs(splits=2)
  assert M.default_knobs(32, 8, 64, 16, 128, 2048, jnp.bfloat16) == M.Knobs(splits=1)
  # 32 splits of a 128-slot ring: two chunks of one 64-slot tile.
  assert M.default_knobs(4, 1, 64, 16, 64, 128, jnp.bfloat16) == M.Knobs(splits=32)
  assert M.default_knobs(4, 1, 64, 16, 64, 3000, jnp.bfloat16) is None   # ragged chunks
  assert M.default_knobs(8, 8, 48, 16, 128, 2048, jnp.bfloat16) is None
  assert M.default_knobs(8, 8, 64, 16, 128, 2048, jnp.float32) is None


def test_rejects_shapes_outside_the_kernel():
  args = batch_inputs(1, [(40, 40)] * 2, s=64, window=64)
  with pytest.raises(ValueError, match="shape outside this kernel"):   # 48 packed rows
    batched((args[0][:, :, :48],) + args[1:], layer=0, window=64)
  with pytest.raises(ValueError, match="n_past must be"):
    batched(args[:6] + (args[6][:1],), layer=0, window=64)
  parts = M.split_operands(*args[:3])
  with pytest.raises(ValueError, match="exceed shared memory"):
    batched(args, layer=0, window=64, splits=1, steps=6)
  with pytest.raises(ValueError, match="the parts must be bf16"):
    M.ring_attention_batched(*parts[:5], parts[5].astype(jnp.float32), *args[3:], layer=0,
                             window=64)


def test_parts_keep_16_bits_under_jit():
  """hi + lo recovers x to ~16 mantissa bits inside a jit (where XLA could otherwise fold the
  float32 -> bf16 -> float32 round trip away and leave lo = 0); hi is x rounded to nearest
  even, as XLA's own convert rounds it."""
  from pallas_kernels._common import bf16_parts
  x = jax.random.normal(jax.random.key(3), (64, 128), jnp.float32) * 3.0
  hi, lo = jax.jit(bf16_parts)(x)
  assert hi.dtype == lo.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(hi, np.float32),
                                np.asarray(np.asarray(x).astype(jnp.bfloat16), np.float32))
  err = np.abs(np.asarray(hi, np.float32) + np.asarray(lo, np.float32) - np.asarray(x))
  assert err.max() <= 2.0 ** -15 * np.abs(np.asarray(x)).max()
  assert np.abs(np.asarray(lo, np.float32)).max() > 0


@pytest.mark.parametrize("window,splits,steps", [(2048, 4, 2), (2048, 2, 3), (None, 8, 2),
                                                (2048, 16, 2)])
def test_lowers_for_hopper_on_cpu(window, splits, steps):
  """Mosaic GPU lowers the partial kernel for sm90 at the seed's dims without a GPU (layouts,
  the register A operand of p.v, the own values' 32-byte swizzle, the aliased buffers)."""
  sd = jax.ShapeDtypeStruct
  b, s = 8, 2048
  args = (*[sd((b, HKV, T * G, D), jnp.bfloat16)] * 2, *[sd((b, HKV, T, D), jnp.bfloat16)] * 4,
          sd((b, 5, HKV, s, D), jnp.bfloat16),
          sd((b, 5, HKV, s, D), jnp.bfloat16), sd((b, s), jnp.int32), sd((b,), jnp.int32))
  chunk, _ = RA.chunking(s, splits, M.BLOCK_K)
  f = lambda *a: M._partials(*a, layer=3, window=window, chunk=chunk, steps=steps)
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


# ---------------------------------------------------------------- GPU (H200), real dims
CASES = [(5003, 5000), (700, 697), (0, 0), (2048, 2040), (3000, 2990), (100, 40), (5003, 4900),
         (1, 1)]


@pytest.fixture(scope="module")
def seed_batch():
  """Eight slots of a 2048-slot window, each ring state different; the twin once."""
  args = batch_inputs(20, CASES, s=2048, window=2048)
  return args, twin(args, layer=2, window=2048)


@pytest.mark.gpu
@pytest.mark.parametrize("splits,steps", [(4, 2), (2, 2), (8, 3), (1, 2), (16, 2), (32, 5)])
def test_gpu_matches_twin(seed_batch, splits, steps):
  args, ref = seed_batch
  out = np.asarray(batched(args, layer=2, window=2048, splits=splits, steps=steps))
  assert np.isfinite(out).all()
  tol = 2.0 ** -12 * np.abs(ref).max()
  np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_gpu_full_cache_and_bf16_out():
  """A full-attention cache (no window edge, 4096 slots), three slots; bf16 output is the
  rounded float32 one."""
  args = batch_inputs(30, [(4000, 3990), (4096, 4096), (10, 3)], s=4096, window=None)
  ref = twin(args, layer=1, window=None)
  out = np.asarray(batched(args, layer=1, window=None, splits=8))
  tol = 2.0 ** -12 * np.abs(ref).max()
  np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
  b = batched(args, layer=1, window=None, splits=8, out_dtype=jnp.bfloat16)
  assert b.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(b), out.astype(jnp.bfloat16))


@pytest.mark.gpu
def test_gpu_agrees_with_triton_kernel(seed_batch):
  """Same arithmetic as the Triton partial at two terms: the two agree to rounding."""
  args, ref = seed_batch
  kn = RA.default_knobs(2048, 2048, jnp.bfloat16, n_seqs=len(CASES),
                        fold_own_min_seqs=KernelPolicy().fold_own_min_seqs)
  tri = jax.vmap(lambda *a: RA.ring_attention(*a, layer=2, window=2048, **kn.kwargs()))(*args)
  out = batched(args, layer=2, window=2048, splits=kn.splits)
  tol = 2.0 ** -12 * np.abs(ref).max()
  np.testing.assert_allclose(np.asarray(out), np.asarray(tri), rtol=tol, atol=tol)
