"""Every weight / cache dtype combination decodes on CPU, target-only and speculative.

At the size where XLA's CPU runtime used to fail ("Unsupported element type for
DotThunk::Execute: BF16 x BF16 = F32"): a bf16 Qwen3-shaped target of 4 layers, hidden 256,
8 / 2 heads, a bf16 cache and 4 sequences (the attention's probabilities x V at one query
row per sequence). Target weights fp32 / bf16, its cache and the drafter's ring fp32 / bf16,
drafter weights fp32 / bf16 / fp8 / q8_0; greedy speculative output must equal target-only
decoding with the same target weights and cache dtype (the losslessness the loop promises).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from dflash_jax import decode as D
from dflash_jax.models import muse_glimmer, qwen3, qwen3_moe

TCFG = qwen3.TargetConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=32, rope_theta=1e4, max_position_embeddings=512)
DCFG = dataclasses.replace(dfj.TINY_CONFIG, n_layer=1, n_embd=256, n_ff=512, n_head=8,
                           n_head_kv=2, head_dim=32, target_layers=(1, 4), mask_token_id=511,
                           block_size=8, window=64)
MAX_NEW = 24


def _prompts(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 511, n).tolist() for n in (5, 9, 3, 12)]


@pytest.fixture(scope="module")
def targets():
  p = qwen3.init_params(TCFG, jax.random.key(0))
  return {"fp32": p, "bf16": jax.tree.map(
      lambda x: x.astype(jnp.bfloat16) if x.ndim == 2 else x, p)}


@pytest.fixture(scope="module")
def target_only(targets):
  """(weights, cache) -> the target-only Generation, decoded on first use (so a failing
  combination fails its own tests only)."""
  done = {}

  def get(w, c):
    if (w, c) not in done:
      done[(w, c)] = D.generate_target_only(targets[w], TCFG, _prompts(), MAX_NEW, cache_dtype=c)
    return done[(w, c)]
  return get


@pytest.mark.parametrize("weights", ("fp32", "bf16"))
@pytest.mark.parametrize("cache", ("fp32", "bf16"))
def test_target_only_runs(targets, target_only, weights, cache):
  g = target_only(weights, cache)
  assert [len(t) for t in g.tokens] == [MAX_NEW] * 4
  assert all(0 <= t < TCFG.vocab_size for row in g.tokens for t in row)


# Every pair of the three choices occurs (a pairwise covering of the 4 x 2 x 2 grid, 8 of its
# 16 points): each drafter format with each ring / cache dtype (the drafter's ring is the
# cache's dtype) and with each target weight dtype, and every target weight x cache pair.
SPECULATIVE = [(w, c, d) for c, ws in (("fp32", ("fp32", "bf16")), ("bf16", ("bf16", "fp32")))
               for d, w in zip(("fp32", "bf16", "fp8", "q8_0"), ws * 2)]


def test_speculative_cases_cover_every_pair():
  grid = [("fp32", "bf16"), ("fp32", "bf16"), ("fp32", "bf16", "fp8", "q8_0")]
  for i, j in ((0, 1), (0, 2), (1, 2)):
    assert {(t[i], t[j]) for t in SPECULATIVE} == {(a, b) for a in grid[i] for b in grid[j]}
  assert len(SPECULATIVE) == len(set(SPECULATIVE)) == 8


@pytest.mark.parametrize("weights,cache,drafter", SPECULATIVE)
def test_speculative_runs_and_is_lossless(targets, target_only, weights, cache, drafter):
  t = targets[weights]
  w = dfj.synthetic_drafter(DCFG, seed=1, with_target=False)
  dp = dfj.prepare_weights(DCFG, {**w, "tok_embd": t.embed, "lm_head": t.head}, drafter)
  models = D.Models(target=t, drafter=dp, d2t=None, target_cfg=TCFG)
  g = D.generate(models, D.DecodeConfig(width=8, impl="xla"), _prompts(), MAX_NEW,
                 cache_dtype=cache, ring_dtype=cache)
  assert g.tokens == target_only(weights, cache).tokens


def _bf16(p):
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.ndim >= 2 else x, p)


@pytest.mark.parametrize("family", ("muse_glimmer", "qwen3_moe"))
def test_other_families_run_bf16_on_cpu(family):
  """The other target families share the widened attention dots: bf16 weights and cache."""
  if family == "muse_glimmer":
    cfg = muse_glimmer.MuseGlimmerConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, sliding_window=8,
        max_position_embeddings=512)
    p = muse_glimmer.init_params(cfg, jax.random.key(0), jnp.bfloat16)
  else:
    cfg = qwen3_moe.Qwen3MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=512)
    p = qwen3_moe.init_params(cfg, jax.random.key(0), jnp.bfloat16)
  g = D.generate_target_only(p, cfg, _prompts(), 8, cache_dtype="bf16")
  assert [len(t) for t in g.tokens] == [8] * 4


def test_the_widening_is_for_cpu_only():
  """einsum_f32 widens bf16 operands in the CPU program only: lowered for CUDA (no GPU needed
  to lower), the dot takes the bf16 operands as written and nothing is converted."""
  from dflash_jax.dispatch import einsum_f32
  a = jnp.ones((4, 2, 4, 1, 64), jnp.bfloat16)
  b = jnp.ones((4, 2, 64, 32), jnp.bfloat16)
  fn = jax.jit(lambda a, b: einsum_f32("bkgts,bksd->btkgd", a, b))
  text = {p: fn.trace(a, b).lower(lowering_platforms=(p,)).as_text() for p in ("cpu", "cuda")}
  dots = {p: [l for l in t.splitlines() if "stablehlo.dot_general" in l] for p, t in text.items()}
  assert len(dots["cuda"]) == 1 and "xbf16>, tensor<" in dots["cuda"][0], dots["cuda"]
  assert "stablehlo.convert" not in text["cuda"]
  assert len(dots["cpu"]) == 1 and "xbf16>" not in dots["cpu"][0], dots["cpu"]
