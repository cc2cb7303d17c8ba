"""accept (first-mismatch scan) vs its jnp twin and a plain Python loop."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.accept import accept, accept_reference


def first_mismatch(d: np.ndarray, t: np.ndarray) -> int:
  for i, (a, b) in enumerate(zip(d, t)):
    if a != b:
      return i
  return len(d)


def drafts_with_mismatches(rng, n: int, at: list[int]) -> tuple[np.ndarray, np.ndarray]:
  d = rng.integers(0, 150_000, size=n).astype(np.int32)
  t = d.copy()
  for i in at:
    t[i] = d[i] + 1 + rng.integers(0, 1000)
  return d, t


@pytest.mark.parametrize("n", [15, 16, 7, 1, 33])
@pytest.mark.parametrize("case", ["first", "none", "middle", "last", "several"])
def test_single(n, case):
  rng = np.random.default_rng(n)
  at = {"first": [0], "none": [], "middle": [n // 2], "last": [n - 1],
        "several": sorted({n // 3, n // 2, n - 1})}[case]
  d, t = drafts_with_mismatches(rng, n, at)
  want = first_mismatch(d, t)
  got = accept(jnp.asarray(d), jnp.asarray(t), interpret=True)
  assert got.shape == () and got.dtype == jnp.int32
  assert int(got) == want == (at[0] if at else n)
  assert int(accept_reference(jnp.asarray(d), jnp.asarray(t))) == want


@pytest.mark.parametrize("n", [15, 9])
def test_batched_mixed(n):
  rng = np.random.default_rng(100 + n)
  patterns = [[], [0], [n // 2], [n - 1], [3, 5], [], [1]]
  rows = [drafts_with_mismatches(rng, n, at) for at in patterns]
  d = np.stack([r[0] for r in rows])
  t = np.stack([r[1] for r in rows])
  want = [first_mismatch(a, b) for a, b in rows]
  got = accept(jnp.asarray(d), jnp.asarray(t), interpret=True)
  assert got.shape == (len(patterns),) and got.dtype == jnp.int32
  assert list(np.asarray(got)) == want == [n, 0, n // 2, n - 1, 3, n, 1]
  assert list(np.asarray(accept_reference(jnp.asarray(d), jnp.asarray(t)))) == want


def test_result_stays_on_device_under_jit():
  d = jnp.arange(15, dtype=jnp.int32)
  t = d.at[6].set(-3)
  step = jax.jit(lambda a, b: accept(a, b, interpret=True) + 1)
  assert isinstance(step(d, t), jax.Array) and int(step(d, t)) == 7


@pytest.mark.parametrize("d,t,match", [
    (np.zeros((2, 3, 4), np.int32), np.zeros((2, 3, 4), np.int32), r"\[n\] or \[B, n\]"),
    (np.zeros(4, np.int32), np.zeros(5, np.int32), "target shape must equal"),
    (np.zeros(4, np.int16), np.zeros(4, np.int16), "drafts dtype must be int32"),
    (np.zeros(0, np.int32), np.zeros(0, np.int32), "n must be >= 1"),
])
def test_limits(d, t, match):
  with pytest.raises(ValueError, match=match):
    accept(jnp.asarray(d), jnp.asarray(t), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(15,), (16,), (64, 15), (3, 33)])
def test_gpu_matches_twin(shape):
  rng = np.random.default_rng(1)
  d = rng.integers(0, 4, size=shape).astype(np.int32)
  t = rng.integers(0, 4, size=shape).astype(np.int32)
  t[..., : shape[-1] // 3] = d[..., : shape[-1] // 3]
  got = np.asarray(accept(jnp.asarray(d), jnp.asarray(t), interpret=False))
  want = np.asarray(accept_reference(jnp.asarray(d), jnp.asarray(t)))
  np.testing.assert_array_equal(got, want)
  flat = [first_mismatch(a, b) for a, b in zip(d.reshape(-1, shape[-1]), t.reshape(-1, shape[-1]))]
  np.testing.assert_array_equal(got.reshape(-1), flat)
