"""benchmarks.xla_peer (the strong plain-XLA step) computes what the step computes: its
logits equal `block_step(impl="xla")`'s (fp32: to summation order; bf16: to the flip of one
bf16 rounding of a GEMM input, as in test_step), its greedy drafts wherever the top-2 gap is
clear of that tolerance, and its GEMMs equal `params.linear`'s for every weight format."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from benchmarks import xla_peer as X
from dflash_jax.drafter import step as S
from dflash_jax.dispatch import linear

FP32_TOL = 1e-4
BF16_TOL = 5e-2   # test_step's BF16_TOL: one flipped bf16 rounding moves logits by up to ~3e-2
SLIDE, FULL = dfj.config.SLIDING, dfj.config.FULL
# Group 3 (6 / 2 heads), one sliding and one full-attention layer: both visibility rules.
MIXED_G3 = dataclasses.replace(dfj.TINY_CONFIG, n_head=6, window=16, layer_types=(SLIDE, FULL))


# fp32 weights with a bf16 ring check the two-term attention at float32 accuracy (dropping
# the lo term would move logits by ~1e-2); bf16 weights the activations' rounding points.
@pytest.mark.parametrize("dtype,ring_dtype,tol", [
    ("fp32", "bf16", FP32_TOL), ("fp32", "fp32", FP32_TOL), ("bf16", "bf16", BF16_TOL)])
def test_peer_step_equals_the_xla_step(dtype, ring_dtype, tol):
  cfg = MIXED_G3
  w = dfj.synthetic_drafter(cfg, seed=3, n_vocab=256)
  m = dfj.DFlashDrafter(cfg, w, dtype=dtype, ring_dtype=ring_dtype, window=16, capacity=64,
                        impl="xla")
  n_rows = 40   # 40 positions into 16 sliding slots: the ring wrapped
  m.inject(m.encode(dfj.synthetic_features(cfg, n_rows, seed=4)), np.arange(n_rows))
  ring = X.peer_ring(m.params, m.ring)
  rng = np.random.default_rng(5)
  ours, peer = [], []
  for n_past in (n_rows, n_rows, n_rows + 3, 9):   # n_past 9: most ring slots not yet visible
    id_last = jnp.int32(rng.integers(256))
    ours.append(np.asarray(S.block_step_jit(m.params, m.ring, id_last, jnp.int32(n_past),
                                            impl="xla")))
    peer.append(np.asarray(X.block_step_jit(m.params, ring, id_last, jnp.int32(n_past))))
  ours, peer = np.stack(ours), np.stack(peer)
  assert np.isfinite(peer).all() and ours.std() > 0.1
  np.testing.assert_allclose(peer, ours, atol=tol, rtol=0)
  top2 = np.sort(ours[:, 1:], axis=-1)[..., -2:]
  clear = top2[..., 1] - top2[..., 0] > 2 * tol
  assert clear.sum() >= clear.size // 3
  np.testing.assert_array_equal(peer[:, 1:].argmax(-1)[clear], ours[:, 1:].argmax(-1)[clear])


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8", "q8_0"])
def test_peer_gemm_equals_linear(dtype):
  cfg = dfj.TINY_CONFIG
  p = dfj.prepare_weights(cfg, dfj.synthetic_drafter(cfg, seed=1, n_vocab=256), dtype)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((16, cfg.n_embd)), jnp.float32)
  for wgt in (p.layers[0].wqkv, p.layers[0].wgu, p.lm_head):
    want = np.asarray(linear(x, wgt, impl="xla"))
    tol = 1e-5 * np.abs(want).max()   # the same products, summed in another order
    np.testing.assert_allclose(np.asarray(X.gemm(x, wgt)), want, atol=tol, rtol=0)
