"""The quantized drafter step at the seed's layer dims on the GPU (a file of its own so that the
GPU suite's workers, one file each, run it beside test_step.py's real-dims tests)."""
import dataclasses

import chex
import numpy as np
import pytest

import dflash_jax as dfj
from test_step import BF16_TOL, SEED, _assert_drafts_match, _first_layers


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ("fp8", "q8_0"))
def test_gpu_real_dims_quantized_matches_twin(dtype, seed_w, seed_feats):
  """The quantized step at the seed's layer dims (2 layers): the compiled Pallas step (inline
  PTX int8 widening for q8_0) against its jnp twin on the same weights and ring, and the
  greedy drafts where the top-2 gap is clear."""
  cfg = dataclasses.replace(SEED, n_layer=2)
  w = _first_layers(seed_w, cfg)
  feats = seed_feats[:300]
  out = {}
  for impl in ("pallas", "xla"):
    m = dfj.DFlashDrafter(cfg, w, dtype=dtype, ring_dtype="bf16", impl=impl)
    m.inject(m.encode(feats), np.arange(300))
    out[impl] = np.asarray(m.capture_step()(17, 300))
  chex.assert_trees_all_close(out["pallas"], out["xla"], **BF16_TOL)
  _assert_drafts_match(out["pallas"], out["xla"], BF16_TOL)
