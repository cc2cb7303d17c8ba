"""pallas_kernels.limits.check_drafter: what the Pallas path cannot run, named before any work."""
from __future__ import annotations

import pytest

from pallas_kernels.limits import MAX_HEAD_DIM, MAX_WIDTH, check_drafter

SEED = dict(n_head=32, n_head_kv=8, head_dim=128, width=16)


@pytest.mark.parametrize("shape", [
    SEED,
    dict(SEED, n_head=24),                                 # group 3
    dict(n_head=6, n_head_kv=2, head_dim=64, width=8),     # group 3, block 8
    dict(n_head=8, n_head_kv=8, head_dim=80, width=10),    # no GQA, block 10
    dict(n_head=80, n_head_kv=5, head_dim=256, width=7),   # group 16, block 7
    dict(SEED, width=32, ring_slots=(48, 3000, 40960)),
    dict(SEED, head_dim=16, width=1, ring_slots=(1,)),
])
def test_published_shapes_pass(shape):
  check_drafter(**shape)


@pytest.mark.parametrize("change, match", [
    (dict(head_dim=272), rf"head_dim must be a multiple of 16 in \[16, {MAX_HEAD_DIM}\] "
                         r"\(got 272\)"),
    (dict(head_dim=72), r"head_dim must be a multiple of 16 .*\(got 72\)"),
    (dict(head_dim=8), r"head_dim must be a multiple of 16 .*\(got 8\)"),
    (dict(width=MAX_WIDTH + 1), rf"block width .* must be in \[1, {MAX_WIDTH}\] "
                                rf"\(got {MAX_WIDTH + 1}\)"),
    (dict(width=0), r"block width .*\(got 0\)"),
    (dict(n_head=30), r"n_head must be a positive multiple of n_head_kv \(got \(30, 8\)\)"),
    (dict(ring_slots=(2048, 0)), r"every ring / cache needs >= 1 slot \(got 0\)"),
])
def test_unsupported_shapes_are_named(change, match):
  with pytest.raises(ValueError, match="pallas drafter: " + match):
    check_drafter(**dict(SEED, **change))
