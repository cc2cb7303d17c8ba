"""prepare_weights given a loaded target's embedding and LM head as device arrays equals
prepare_weights given host float32 copies of them, bit for bit, in every weight format and
family; the dense formats share or cast the target's arrays on the device, with no host copy of
either."""
from __future__ import annotations

import dataclasses
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from dflash_jax.dispatch import QuantWeight

CFG = dfj.TINY_CONFIG   # n_embd 64 (a multiple of Q8_0's 32), mask token 7


def drafter_for_target(cfg, w, embed, head, fmt):
  return dfj.prepare_weights(cfg, {**w, "tok_embd": embed, "lm_head": head}, fmt)


def _target(dtype, n_vocab, seed):
  rng = np.random.default_rng(seed)
  embed, head = (rng.standard_normal((n_vocab, CFG.n_embd), dtype=np.float32) for _ in range(2))
  return jnp.asarray(embed, dtype), jnp.asarray(head / 8, dtype)


def _leaves_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark"])
@pytest.mark.parametrize("target_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8", "q8_0"])
def test_equals_prepare_weights_with_host_copies(fmt, target_dtype, family):
  cfg = {"dflash": CFG, "dflash2": dfj.config.TINY_DFLASH2_CONFIG,
         "dspark": dfj.config.TINY_DSPARK_CONFIG}[family]
  # Rank 32: the family's matrices are Q8_0-able (their input widths multiples of 32).
  if family == "dflash2":
    cfg = dataclasses.replace(cfg, family_fields=dataclasses.replace(cfg.dflash2,
                                                                     selector_rank=32))
  elif family == "dspark":
    cfg = dataclasses.replace(cfg, family_fields=dataclasses.replace(cfg.dspark, markov_rank=32))
  w = dfj.synthetic_drafter(cfg, seed=1, n_vocab=96, with_target=False)
  embed, head = _target(target_dtype, 96, seed=2)
  got = drafter_for_target(cfg, w, embed, head, fmt)
  want = dfj.prepare_weights(cfg, {**w, "tok_embd": np.asarray(embed, np.float32),
                                   "lm_head": np.asarray(head, np.float32)}, fmt)
  assert isinstance(got.lm_head, QuantWeight) == (fmt in ("fp8", "q8_0"))
  assert (got.family is None) == (family == "dflash")
  _leaves_equal(got, want)
  if {"fp32": jnp.float32, "bf16": jnp.bfloat16}.get(fmt) == target_dtype:
    assert got.tok_embd is embed and got.lm_head is head   # one copy on the device, not two


@pytest.mark.parametrize("fmt,target_dtype", [("bf16", jnp.bfloat16), ("fp32", jnp.bfloat16),
                                              ("bf16", jnp.float32)])
def test_dense_formats_keep_the_target_on_the_device(fmt, target_dtype):
  """The host allocates nothing of the size of the target's arrays (traced host peak under a
  quarter of one of them, which stays on the device whatever the cast)."""
  w = dfj.synthetic_drafter(CFG, seed=3, with_target=False)
  embed, head = _target(target_dtype, 16384, seed=4)
  drafter_for_target(CFG, w, embed, head, fmt)   # compiles the casts
  tracemalloc.start()
  try:
    drafter_for_target(CFG, w, embed, head, fmt)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < embed.nbytes // 4, (peak, embed.nbytes)


def test_errors_name_the_mismatch():
  w = dfj.synthetic_drafter(CFG, seed=5, with_target=False)
  embed, head = _target(jnp.float32, 5, seed=6)
  with pytest.raises(ValueError, match=r"mask_token_id 7 is outside the target vocab \[0, 5\)"):
    drafter_for_target(CFG, w, embed, head, "fp32")
  embed, head = _target(jnp.float32, 96, seed=6)
  with pytest.raises(ValueError, match=r"'lm_head' has shape \(96, 32\), expected \(96, 64\)"):
    drafter_for_target(CFG, w, embed, head[:, :32], "fp32")
  with pytest.raises(ValueError, match="'tok_embd' holds NaN"):   # checked on the device
    drafter_for_target(CFG, w, embed.at[3, 4].set(jnp.nan), head, "bf16")
