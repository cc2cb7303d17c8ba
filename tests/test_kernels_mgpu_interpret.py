"""The Mosaic GPU batched GEMM's bf16 kernel body on the CPU, in Mosaic GPU's interpret mode.

jax 0.11.2 interprets Mosaic GPU kernels (`plgpu.force_gpu_interpret_mode`): TMA copies,
barriers, the warp-specialized pipeline and wgmma from shared memory run as host callbacks,
so the kernel's tiling, pipeline refills, warpgroup row split and epilogues are checked in CI,
not only on the GPU (tests/test_kernels_batched_gemm.py's GPU tests). The fp8 body's
register A operand is outside what this interpreter runs (it fails inside its wgmma).

Oracle: float64 numpy on the bf16-rounded operands. Tolerance: float32 accumulation over K <=
512 products of magnitude <= ~16 (1e-4 absolute on outputs of ~30); the gate_up output is
bf16 (2^-8 relative). Every case has more K tiles than pipeline stages, so slots are refilled.
"""
from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp

from pallas_kernels import batched_gemm as BG


def _oracle(x, w, r, epilogue):
  x64 = np.asarray(x, np.float64)
  w64 = np.asarray(w, np.float64)
  y = x64 @ w64.T
  if epilogue == "gate_up":
    n = w.shape[0] // 2
    g, u = y[:, :n], y[:, n:]
    return g / (1.0 + np.exp(-g)) * u
  return y if r is None else np.asarray(r, np.float64) + y


@pytest.mark.parametrize("m, n, k, epilogue, steps", [
    (64, 128, 512, "none", 2),        # one compute warpgroup, 4 K tiles through 2 slots
    (16, 64, 384, "none", 2),         # 16 rows padded to 64
    (128, 64, 256, "residual", 1),    # two warpgroups over halves of the rows
    (40, 64, 384, "gate_up", 2),      # two weight streams, silu(gate) * up in the epilogue
    (300, 64, 256, "residual", 2),    # past 256 rows: two calls of the body
])
def test_bf16_body_interpreted_matches_float64(m, n, k, epilogue, steps):
  import jax.experimental.pallas.mosaic_gpu as plgpu
  rng = np.random.default_rng(m * 1000 + n + k)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((2 * n if epilogue == "gate_up" else n, k)) * 0.25,
                  jnp.bfloat16)
  r = (jnp.asarray(rng.standard_normal((m, n)), jnp.float32) if epilogue == "residual"
       else None)
  out_dtype = jnp.bfloat16 if epilogue == "gate_up" else jnp.float32
  with plgpu.force_gpu_interpret_mode():
    y = BG.batched_matmul(x, w, r, epilogue=epilogue, out_dtype=out_dtype, block_k=128,
                          max_concurrent_steps=steps)
  assert y.shape == (m, n) and y.dtype == out_dtype
  want = _oracle(x, w, r, epilogue)
  got = np.asarray(y, np.float64)
  if epilogue == "gate_up":
    np.testing.assert_allclose(got, want, rtol=2.0 ** -7, atol=1e-3)
  else:
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
  assert np.abs(want).max() > 1.0   # the products are not trivially small
