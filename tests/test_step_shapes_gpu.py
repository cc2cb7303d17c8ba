"""Issue 13's published drafter shapes at the seed's layer dims on the GPU: the Pallas and XLA
steps against the bf16 reference."""
import dataclasses

import chex
import numpy as np
import pytest

import dflash_jax as dfj
from reference import DFlashRef
from test_step import BF16_TOL, FULL, SEED, SLIDE, _assert_drafts_match, _first_layers


# Issue 13's shapes at the seed's layer dims: (config changes, layers, widths drafted), two
# shapes per drafter to bound the host work: blocks 10 and 7, GQA group 3 (24 / 8 heads), a
# 3000-slot ring, 4 sliding + 1 full layers, widths 4 of 7 and 5 of 16. Two layers where the
# shape lives in every layer; the mixed drafter has its 5.
GPU_SHAPES = {
    "b10-g3": (dict(block_size=10, n_head=24), 2, (None,)),
    "b7-w3000": (dict(block_size=7, window=3000), 2, (None, 4)),
    "4s1f": (dict(layer_types=(SLIDE,) * 4 + (FULL,)), 5, (None, 5)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_shapes_match_reference(shape, seed_w, seed_feats):
  """Pallas and XLA steps against the bf16 reference (computed once per shape)."""
  changes, n_layer, widths = GPU_SHAPES[shape]
  cfg = dataclasses.replace(SEED, n_layer=n_layer, **changes)
  w = (dfj.synthetic_drafter(cfg, seed=0, n_vocab=8192) if "n_head" in changes
       else _first_layers(seed_w, cfg))
  n = cfg.resolve_window() + 52               # the ring wraps; the full cache holds them all
  feats = seed_feats[:n]
  ref = DFlashRef(cfg, w, dtype="bf16", ring_dtype="bf16", capacity=4096)
  ref.inject(ref.encode(feats), np.arange(n))
  calls = [(width, id_last, n_past) for width in widths for id_last, n_past in
           ((17, n), (4000, n + 2))]
  want = [ref.step(id_last, n_past, width) for width, id_last, n_past in calls]
  del ref
  for impl in ("pallas", "xla"):
    m = dfj.DFlashDrafter(cfg, w, dtype="bf16", ring_dtype="bf16", impl=impl, capacity=4096)
    m.inject(m.encode(feats), np.arange(n))
    steps = {width: m.capture_step(width) for width in widths}
    got = [np.asarray(steps[width](id_last, n_past)) for width, id_last, n_past in calls]
    for g, wnt in zip(got, want):
      chex.assert_trees_all_close(g, wnt, **BF16_TOL)
    _assert_drafts_match(got, want, BF16_TOL)
    del m, steps
