"""Rope scaling (issue 45): none, linear, llama3 and YaRN, read from HF and GGUF and written
back; the host float64 table and YaRN's attention factor in the drafter (reference, jnp twins,
Pallas kernels in interpret mode, the step, the training forward) and in every target family,
at positions past the original context; a YaRN drafter and target through the lossless loop.

Expected tables come from `hf_rope`, a float64 implementation written here from HF's rope
utilities (`_compute_{default,linear_scaling,llama3,yarn}_parameters`, transformers 5), one
frequency at a time; expected rope outputs from per-row float64 loops.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re

import chex
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from dflash_jax import decode as D
from dflash_jax.__main__ import main
from dflash_jax.config import RopeScaling, rope_from_hf, rope_inv_freq
from dflash_jax.io import DrafterFormatError, load_drafter, save_drafter
from dflash_jax.models import load_target, read_target_config, save_target
from dflash_jax.models import muse_glimmer as MG
from dflash_jax.models import qwen3 as Q
from dflash_jax.models import qwen3_moe as QM
from dflash_jax.train import forward as F
from pallas_kernels.inject import inject, inject_reference
from pallas_kernels.norm_rope import qk_norm_rope, qk_norm_rope_reference
from reference import DFlashRef
from reference.dflash_ref import rope_neox
from reference.targets import muse_glimmer as RM
from reference.targets import qwen3 as RQ
from reference.targets import qwen3_moe as RMOE
import target_checkpoints as TC
import tiny_models as TM
from test_gguf import _drafter, _expect_error, _kv, _tensors, _write

EPS = 1e-6
F32_TOL = dict(rtol=2e-5, atol=2e-5)     # float32 kernels vs float64 loops, values ~O(3)
FP32_STEP_TOL = dict(atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# The float64 formulas


def _get_mscale(scale, mscale=1.0):
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def hf_rope(config: dict, dim: int) -> tuple[float, np.ndarray, float]:
  """(theta, inverse frequencies [dim / 2] float64, attention factor) of an HF config dict,
  following HF's rope utilities step by step (transformers 5: the dict under rope_parameters,
  else rope_scaling with rope_theta at the top level)."""
  rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
  theta = rope.get("rope_theta", config.get("rope_theta"))
  max_pos = config.get("max_position_embeddings")
  kind = rope.get("rope_type", rope.get("type", "default"))
  pos_freqs = [theta ** (j / dim) for j in range(0, dim, 2)]
  base = [1.0 / p for p in pos_freqs]
  if kind == "default":
    return theta, np.array(base), 1.0
  factor = rope.get("factor")
  if kind == "linear":
    return theta, np.array([f / factor for f in base]), 1.0
  orig = rope.get("original_max_position_embeddings", max_pos)
  if kind == "llama3":
    lo, hi = rope["low_freq_factor"], rope["high_freq_factor"]
    out = []
    for f in base:
      wavelen = 2 * math.pi / f
      if wavelen < orig / hi:
        out.append(f)
      elif wavelen > orig / lo:
        out.append(f / factor)
      else:
        smooth = (orig / wavelen - lo) / (hi - lo)
        out.append((1 - smooth) * f / factor + smooth * f)
    return theta, np.array(out), 1.0
  assert kind == "yarn", kind
  if factor is None:
    factor = max_pos / orig
  attention = rope.get("attention_factor")
  if attention is None:
    ms, ms_all = rope.get("mscale"), rope.get("mscale_all_dim")
    attention = (_get_mscale(factor, ms) / _get_mscale(factor, ms_all) if ms and ms_all
                 else _get_mscale(factor))
  beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

  def correction_dim(rotations):
    return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if rope.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  out = []
  for j, p in enumerate(pos_freqs):
    extrapolation = 1 - min(max((j - low) / (high - low), 0.0), 1.0)
    out.append(1.0 / (factor * p) * (1 - extrapolation) + 1.0 / p * extrapolation)
  return theta, np.array(out), attention


def rope_rows(x: np.ndarray, positions, inv_freq32: np.ndarray, attention: float) -> np.ndarray:
  """NEOX rope of rows x [T, D] float64, one row at a time: the angle is the float32 product
  float32(pos) * inv_freq (SPEC.md section 3), cos and sin in float64 times the attention
  factor (HF multiplies cos and sin)."""
  h = x.shape[-1] // 2
  out = np.empty_like(x, dtype=np.float64)
  for t, pos in enumerate(positions):
    ang = (np.float32(pos) * inv_freq32).astype(np.float64)
    c, s = np.cos(ang) * attention, np.sin(ang) * attention
    out[t] = np.concatenate([x[t, :h] * c - x[t, h:] * s, x[t, h:] * c + x[t, :h] * s])
  return out


# HF configs, (config, rotary dim): one per type and spelling, published models' values.
HF_CASES = {
    "default": ({"rope_theta": 1e6, "rope_scaling": None}, 128),
    "default-v5": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e7}}, 128),
    "linear-type": ({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}, 64),
    "llama3.1": ({"rope_theta": 5e5, "max_position_embeddings": 131072,
                  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192,
                                   "rope_type": "llama3"}}, 128),
    "yarn-qwen3": ({"rope_theta": 1e6, "max_position_embeddings": 131072,
                    "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 32768}}, 128),
    "yarn-v5-nested": ({"max_position_embeddings": 40960,
                        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                            "original_max_position_embeddings": 32768}}, 128),
    "yarn-no-truncate": ({"rope_theta": 150000, "max_position_embeddings": 131072,
                          "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "truncate": False,
                                           "original_max_position_embeddings": 4096}}, 64),
    "yarn-mscale-equal": ({"rope_theta": 10000, "max_position_embeddings": 163840,
                           "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32,
                                            "beta_slow": 1, "mscale": 0.707,
                                            "mscale_all_dim": 0.707,
                                            "original_max_position_embeddings": 4096}}, 64),
    "yarn-mscale-ratio": ({"rope_theta": 10000, "max_position_embeddings": 65536,
                           "rope_scaling": {"rope_type": "yarn", "factor": 16.0, "mscale": 1.0,
                                            "mscale_all_dim": 0.5,
                                            "original_max_position_embeddings": 4096}}, 64),
    "yarn-mscale-alone": ({"rope_theta": 10000, "max_position_embeddings": 65536,
                           "rope_scaling": {"rope_type": "yarn", "factor": 16.0, "mscale": 0.8,
                                            "original_max_position_embeddings": 4096}}, 64),
    "yarn-attention-factor": ({"rope_theta": 1e6, "max_position_embeddings": 32768,
                               "rope_scaling": {"rope_type": "yarn", "factor": 8.0,
                                                "attention_factor": 1.25, "beta_fast": 0,
                                                "beta_slow": 2.0}}, 128),
    "yarn-factor-null": ({"rope_theta": 5e5, "max_position_embeddings": 16384,
                          "rope_parameters": {"rope_type": "yarn", "factor": None,
                                              "original_max_position_embeddings": 4096}}, 96),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_tables_match_the_float64_formulas(case):
  config, dim = HF_CASES[case]
  theta, scaling = rope_from_hf(config, "config.json")
  want_theta, want, attention = hf_rope(config, dim)
  assert theta == want_theta
  got64 = rope_inv_freq(dim, theta, scaling, np.float64)
  np.testing.assert_allclose(got64, want, rtol=1e-13, atol=0)
  got32 = rope_inv_freq(dim, theta, scaling)
  assert got32.dtype == np.float32
  np.testing.assert_array_equal(got32, got64.astype(np.float32))   # rounded once, from f64
  np.testing.assert_array_max_ulp(got32, want.astype(np.float32), maxulp=1)
  np.testing.assert_allclose(scaling.attention_scaling, attention, rtol=1e-15)
  # The dict written back reads back equal.
  assert rope_from_hf({"rope_theta": theta, "rope_scaling": scaling.to_hf()}, "x") == (
      theta, scaling)
  base = theta ** (-np.arange(0, dim, 2) / dim)
  if scaling.rope_type == "none":
    np.testing.assert_allclose(want, base, rtol=1e-15)
    return
  factor = scaling.factor
  assert not np.allclose(want, base, rtol=1e-6)
  if scaling.rope_type in ("llama3", "yarn"):   # both ends of the band and the blend between
    kept, divided = np.isclose(want, base, rtol=1e-12), np.isclose(want, base / factor,
                                                                    rtol=1e-12)
    assert kept.any() and divided.any() and (~kept & ~divided).any(), case


def test_yarn_spellings_read_equal():
  """transformers 4 (rope_scaling with `type` or `rope_type`, theta at the top level) and 5
  (rope_parameters holding both, flat or keyed by layer type) give one RopeScaling."""
  yarn = {"factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 16.0}
  spellings = [
      {"rope_theta": 1e6, "rope_scaling": {"type": "yarn", **yarn}},
      {"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "type": "yarn", **yarn}},
      {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, **yarn}},
      {"rope_theta": 1e6, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, **yarn},
       "rope_scaling": {"rope_type": "yarn", **yarn}},
      {"rope_parameters": {k: {"rope_type": "yarn", "rope_theta": 1e6, **yarn}
                           for k in ("full_attention", "sliding_attention")}},
  ]
  want = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=32768,
                     beta_fast=16.0)
  for config in spellings:
    assert rope_from_hf(config, "config.json") == (1e6, want), config


@pytest.mark.parametrize("config, message", [
    ({"rope_theta": 1.0, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "config.json: rope_scaling.rope_type 'dynamic' is not supported"),
    ({"rope_parameters": {"type": "longrope", "rope_theta": 1.0}},
     "config.json: rope_parameters.type 'longrope' is not supported"),
    ({"rope_scaling": {"type": "yarn", "rope_type": "linear", "factor": 2.0}},
     "rope_scaling.rope_type 'linear' disagrees with rope_scaling.type 'yarn'"),
    ({"rope_theta": 1e6, "rope_parameters": {"rope_theta": 1e4}}, "rope thetas disagree"),
    ({"rope_parameters": {"rope_type": "default"},
      "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope scalings disagree"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0},
                          "sliding_attention": {"rope_type": "linear", "factor": 4.0}}},
     "rope scalings disagree"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling (yarn) needs original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}}, "low_freq_factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "factor must be a finite number"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "factor must be a finite number"),
    ({"max_position_embeddings": 64, "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                                      "attention_factor": 0.0}},
     "attention_factor must be None or a finite number > 0"),
    ({"rope_theta": "big"}, "rope_theta is 'big'"),
    ({"rope_scaling": [1.0]}, "rope_scaling is [1.0], expected an object"),
])
def test_hf_rope_errors_name_the_key(config, message):
  with pytest.raises(ValueError, match=re.escape(message)) as info:
    rope_from_hf(config, "config.json")
  assert str(info.value).startswith("config.json: ")


def test_rope_scaling_checks_its_fields():
  with pytest.raises(ValueError, match="rope_type must be one of"):
    RopeScaling("ntk")
  with pytest.raises(ValueError, match="beta_fast does not apply to rope_type 'linear'"):
    RopeScaling("linear", factor=2.0, beta_fast=16.0)
  with pytest.raises(ValueError, match="original_max_position_embeddings must be a positive int"):
    RopeScaling("yarn", factor=2.0)
  with pytest.raises(ValueError, match="0 < low < high"):
    RopeScaling("llama3", factor=8.0, original_max_position_embeddings=8192,
                low_freq_factor=4.0, high_freq_factor=1.0)
  hash(RopeScaling("yarn", factor=2.0, original_max_position_embeddings=8))


def _configs_with_rope_scaling():
  from dflash_jax.models import qwen3, qwen3_5, qwen3_moe
  heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
  yield dfj.TINY_CONFIG
  yield qwen3.TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, **heads)
  yield MG.MuseGlimmerConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                             num_hidden_layers=4, sliding_window=8, **heads)
  yield qwen3_moe.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                 moe_intermediate_size=16, num_hidden_layers=2, num_experts=4,
                                 num_experts_per_tok=2, **heads)
  yield qwen3_5.TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                             num_hidden_layers=4, linear_conv_kernel_dim=4,
                             linear_key_head_dim=16, linear_value_head_dim=16,
                             linear_num_key_heads=2, linear_num_value_heads=2, **heads)


@pytest.mark.parametrize("cfg", list(_configs_with_rope_scaling()),
                         ids=lambda c: type(c).__module__)
def test_every_config_takes_none_and_refuses_a_dict_for_rope_scaling(cfg):
  """The drafter's and every target family's config: None is no scaling (the default, equal
  config), an HF dict must be parsed first (rope_from_hf) and is refused by name."""
  with pytest.raises(ValueError, match=r"rope_scaling must be a RopeScaling or None, got \{"):
    dataclasses.replace(cfg, rope_scaling={"rope_type": "yarn"})
  assert dataclasses.replace(cfg, rope_scaling=None) == cfg
  assert cfg.rope_scaling == RopeScaling()


# ---------------------------------------------------------------------------------------------
# The drafter: reference, twins, kernels, step and training forward past the original context

# Original context 16, factor 8: every position below is past it; the ramp of a 16-wide head
# (theta 1e4) runs over dimensions 0..2, so kept, blended and divided frequencies all occur.
YARN = RopeScaling("yarn", factor=8.0, original_max_position_embeddings=16)
YARN_EXPLICIT = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16,
                            attention_factor=1.5, beta_fast=8.0, beta_slow=0.5)


def _yarn_table(d: int, scaling: RopeScaling, theta: float = 1e4):
  config = {"rope_theta": theta, "rope_scaling": scaling.to_hf()}
  _, want, attention = hf_rope(config, d)
  return want.astype(np.float32), attention


@pytest.mark.parametrize("scaling", [YARN, YARN_EXPLICIT], ids=["yarn", "yarn-explicit"])
def test_reference_rope_past_the_original_context(scaling):
  inv32, attention = _yarn_table(16, scaling)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(6, 3, 16)).astype(np.float32)
  pos = np.array([17, 40, 100, 999, 5000, 123_456])
  got = rope_neox(x, pos, rope_inv_freq(16, 1e4, scaling), scaling.attention_scaling)
  for h in range(3):
    np.testing.assert_allclose(got[:, h], rope_rows(x[:, h].astype(np.float64), pos, inv32,
                                                    attention), rtol=1e-5, atol=1e-5)
  plain = rope_neox(x, pos, rope_inv_freq(16, 1e4))
  assert not np.allclose(got, plain, atol=1e-2)   # the scaling changes the rotation


def _norm_rope_oracle(x, w, positions, inv32, attention):
  """rms_head then rope of rows x [T, D] (float64 loops)."""
  x = np.asarray(x, np.float64)
  y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * np.asarray(w, np.float64)
  return rope_rows(y, positions, inv32, attention)


# Interpret mode here; compiled on the H200 (`pytest -m gpu`).
INTERPRET = [pytest.param(True, id="interpret"),
             pytest.param(False, id="gpu", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("scaling", [YARN, YARN_EXPLICIT], ids=["yarn", "yarn-explicit"])
@pytest.mark.parametrize("d, n_past", [(16, 5000), (32, 77)])
def test_qk_norm_rope_kernel_and_twin(scaling, d, n_past, interpret):
  t, hkv, g = 8, 2, 2
  hq = hkv * g
  rng = np.random.default_rng(d + n_past)
  qkv = (rng.normal(size=(t, (hq + 2 * hkv) * d)) * 3.0).astype(np.float32)
  qn, kn = (1.0 + 0.2 * rng.normal(size=(2, d))).astype(np.float32)
  inv32, attention = _yarn_table(d, scaling)
  args = (jnp.asarray(qkv), jnp.asarray(qn), jnp.asarray(kn), jnp.int32(n_past),
          jnp.asarray(rope_inv_freq(d, 1e4, scaling)))
  kw = dict(n_head=hq, n_head_kv=hkv, eps=EPS, attention_scaling=scaling.attention_scaling)
  got = qk_norm_rope(*args, interpret=interpret, **kw)
  twin = qk_norm_rope_reference(*args, **kw)
  heads = qkv.reshape(t, hq + 2 * hkv, d)
  pos = n_past + np.arange(t)
  for kvh in range(hkv):
    for j in range(g):
      want = _norm_rope_oracle(heads[:, kvh * g + j], qn, pos, inv32, attention)
      for out in (got, twin):
        np.testing.assert_allclose(np.asarray(out[0][kvh, j::g]), want, **F32_TOL)
    want = _norm_rope_oracle(heads[:, hq + kvh], kn, pos, inv32, attention)
    for out in (got, twin):
      np.testing.assert_allclose(np.asarray(out[1][kvh]), want, **F32_TOL)
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(twin[0]), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("scaling", [YARN, YARN_EXPLICIT], ids=["yarn", "yarn-explicit"])
def test_inject_kernel_and_twin(scaling, interpret):
  t, n_layer, hkv, d, s = 16, 2, 2, 32, 16
  rng = np.random.default_rng(3)
  kv = rng.normal(size=(t, n_layer, 2, hkv, d)).astype(np.float32) * 2.0
  k_norm = (1.0 + 0.2 * rng.normal(size=(n_layer, d))).astype(np.float32)
  positions = np.arange(200, 200 + t, dtype=np.int32)   # one row per ring slot
  inv32, attention = _yarn_table(d, scaling)
  ring = (jnp.zeros((n_layer, hkv, s, d)), jnp.zeros((n_layer, hkv, s, d)),
          jnp.full((s,), -1, jnp.int32))
  args = (jnp.asarray(kv), jnp.asarray(k_norm), jnp.asarray(positions), jnp.int32(t),
          jnp.asarray(rope_inv_freq(d, 1e4, scaling)))
  kw = dict(eps=EPS, attention_scaling=scaling.attention_scaling)
  outs = [inject(*ring, *args, interpret=interpret, **kw),
          inject_reference(*ring, *args, **kw)]
  slots = positions % s
  for rk, rv, rp in outs:
    np.testing.assert_array_equal(np.asarray(rp)[slots], positions)
    for l in range(n_layer):
      for h in range(hkv):
        want = _norm_rope_oracle(kv[:, l, 0, h], k_norm[l], positions, inv32, attention)
        np.testing.assert_allclose(np.asarray(rk)[l, h, slots], want, **F32_TOL)
        np.testing.assert_array_equal(np.asarray(rv)[l, h, slots], kv[:, l, 1, h])


DRAFTER = dataclasses.replace(dfj.TINY_CONFIG, window=32, rope_scaling=YARN)
VOCAB = 512


@pytest.mark.parametrize("impl", ["xla", "pallas", pytest.param("pallas", id="pallas-gpu",
                                                                 marks=pytest.mark.gpu)])
def test_drafter_step_matches_reference(impl):
  """The jitted step (Pallas kernels: interpret mode on the CPU, compiled on a GPU; or the jnp
  twins) against the float32 reference, at positions up to ~7x the original context; and the
  scaling is in effect."""
  w = dfj.synthetic_drafter(DRAFTER, seed=4, n_vocab=VOCAB)
  m = dfj.DFlashDrafter(DRAFTER, w, impl=impl)
  ref = DFlashRef(DRAFTER, w)
  plain = DFlashRef(dataclasses.replace(DRAFTER, rope_scaling=None), w)
  n = 45
  feats = dfj.synthetic_features(DRAFTER, n, seed=5)
  for r in (m, ref, plain):
    r.inject(r.encode(feats), np.arange(n))
  np.testing.assert_allclose(np.asarray(m.ring.sliding.k, np.float32), ref.ring_k,
                             **FP32_STEP_TOL)
  step = m.capture_step()
  for id_last, n_past in ((3, 45), (100, 100)):
    got = np.asarray(step(id_last, n_past))
    want = ref.step(id_last, n_past)
    chex.assert_trees_all_close(got, want, **FP32_STEP_TOL)
    assert np.abs(want - plain.step(id_last, n_past)).max() > 1e-2


def test_training_forward_equals_reference_step():
  """Train/infer consistency with YaRN: block_logits at each anchor equals the reference step
  after injecting the anchor's context (positions past the original context of 8)."""
  cfg = dataclasses.replace(dfj.TINY_CONFIG, window=None,
                            rope_scaling=dataclasses.replace(YARN,
                                                             original_max_position_embeddings=8))
  vocab, t = 96, 24
  w = dfj.synthetic_drafter(cfg, seed=6, n_vocab=vocab)
  rng = np.random.default_rng(7)
  feats = rng.standard_normal((1, t, cfg.n_embd_fc), dtype=np.float32)
  tokens = rng.integers(0, vocab, (1, t)).astype(np.int32)
  anchors = np.array([[3, 12, 20]], np.int32)
  train_w = {k: jnp.asarray(v) for k, v in w.items() if k not in ("tok_embd", "lm_head")}
  got = np.asarray(jax.jit(F.block_logits, static_argnames=("cfg",))(
      train_w, jnp.asarray(w["tok_embd"]), jnp.asarray(w["lm_head"]), cfg=cfg,
      features=jnp.asarray(feats), tokens=jnp.asarray(tokens), anchors=jnp.asarray(anchors)))
  for j, a in enumerate(anchors[0]):
    ref = DFlashRef(cfg, w)
    ref.inject(ref.encode(feats[0, :a]), np.arange(a))
    np.testing.assert_allclose(got[0, j], ref.step(int(tokens[0, a]), int(a)), atol=1e-4,
                               rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Drafter checkpoints: HF and GGUF


YARN_CFG = dataclasses.replace(dfj.TINY_CONFIG, context_length=64, rope_scaling=YARN)
SAVABLE = {
    "linear": RopeScaling("linear", factor=2.0),
    "yarn": YARN,
    "yarn-betas": dataclasses.replace(YARN, beta_fast=16.0, beta_slow=2.0),
}


@pytest.mark.parametrize("name", SAVABLE)
@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_drafter_round_trip(tmp_path, fmt, name):
  cfg = dataclasses.replace(YARN_CFG, rope_scaling=SAVABLE[name])
  path = tmp_path / ("d.gguf" if fmt == "gguf" else "hf")
  save_drafter(path, cfg, _drafter(1, cfg), format=fmt)
  assert load_drafter(path)[0] == cfg


def test_hf_drafter_only_formats(tmp_path):
  """llama3, YaRN without truncation and mscale pairs: an HF folder holds them exactly."""
  for scaling in (RopeScaling("llama3", factor=8.0, original_max_position_embeddings=16,
                              low_freq_factor=1.0, high_freq_factor=4.0),
                  dataclasses.replace(YARN, truncate=False),
                  dataclasses.replace(YARN, mscale=1.0, mscale_all_dim=0.5)):
    cfg = dataclasses.replace(YARN_CFG, rope_scaling=scaling)
    folder = save_drafter(tmp_path / scaling.rope_type, cfg, _drafter(1, cfg), format="hf")
    assert load_drafter(folder)[0] == cfg
    config = json.loads((tmp_path / scaling.rope_type / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == scaling.rope_type


def test_hf_drafter_reads_transformers5_rope_parameters(tmp_path):
  folder = save_drafter(tmp_path / "a", YARN_CFG, _drafter(1), format="hf")
  path = tmp_path / "a" / "config.json"
  config = json.loads(path.read_text())
  scaling = config.pop("rope_scaling")
  config["rope_parameters"] = {"rope_theta": config.pop("rope_theta"), **scaling}
  path.write_text(json.dumps(config))
  assert load_drafter(folder)[0] == YARN_CFG


def test_gguf_keys_are_llama_cpps(tmp_path):
  cfg = dataclasses.replace(YARN_CFG, rope_scaling=dataclasses.replace(YARN, beta_fast=16.0))
  path = save_drafter(tmp_path / "d.gguf", cfg, _drafter(1))
  fields = gguf.GGUFReader(path).fields
  keys = gguf.Keys.Rope

  def value(key):
    return fields[key.format(arch="dflash")].contents()

  assert value(keys.SCALING_TYPE) == "yarn"
  assert (value(keys.SCALING_FACTOR), value(keys.SCALING_ORIG_CTX_LEN)) == (8.0, 16)
  assert (value(keys.SCALING_YARN_BETA_FAST), value(keys.SCALING_YARN_BETA_SLOW)) == (16.0, 1.0)
  assert keys.SCALING_ATTN_FACTOR.format(arch="dflash") not in fields   # YaRN's default factor


@pytest.mark.parametrize("scaling", [
    dataclasses.replace(YARN, attention_factor=1.3),
    dataclasses.replace(YARN, mscale=1.0, mscale_all_dim=0.5),
    dataclasses.replace(YARN, mscale=0.707, mscale_all_dim=0.707)])
def test_gguf_attention_factor_is_relative_to_yarns_default(tmp_path, scaling):
  """llama.cpp multiplies YaRN's default factor by rope.scaling.attn_factor (float32)."""
  cfg = dataclasses.replace(YARN_CFG, rope_scaling=scaling)
  path = save_drafter(tmp_path / "d.gguf", cfg, _drafter(1))
  stored = gguf.GGUFReader(path).fields["dflash.rope.scaling.attn_factor"].contents()
  np.testing.assert_allclose(stored * _get_mscale(8.0), scaling.attention_scaling, rtol=1e-7)
  got = load_drafter(path)[0].rope_scaling
  np.testing.assert_allclose(got.attention_scaling, scaling.attention_scaling, rtol=1e-7)
  assert dataclasses.replace(got, attention_factor=None) == dataclasses.replace(
      YARN, beta_fast=scaling.beta_fast)
  if scaling.attention_factor == 1.3:
    assert got.attention_factor == 1.3   # its float32, read as the shortest decimal


@pytest.mark.parametrize("scaling, message", [
    (RopeScaling("llama3", factor=8.0, original_max_position_embeddings=16, low_freq_factor=1.0,
                 high_freq_factor=4.0), "llama3 rope scaling has no GGUF metadata form"),
    (dataclasses.replace(YARN, truncate=False), "YaRN with truncate=False has no GGUF key"),
])
def test_gguf_save_refuses_what_llama_cpp_cannot_state(tmp_path, scaling, message):
  cfg = dataclasses.replace(YARN_CFG, rope_scaling=scaling)
  path = tmp_path / "d.gguf"
  with pytest.raises(DrafterFormatError, match=message) as info:
    save_drafter(path, cfg, _drafter(1, cfg))
  assert str(path) in str(info.value) and not path.exists()


def _gguf_with(tmp_path, extra: dict, cfg=dfj.TINY_CONFIG):
  kv = {**_kv(cfg), **extra}
  return _write(tmp_path / "d.gguf", kv, _tensors(_drafter(2, cfg)))


VT = gguf.GGUFValueType
_YARN_KV = {"dflash.rope.scaling.type": ("yarn", VT.STRING),
            "dflash.rope.scaling.factor": (8.0, VT.FLOAT32)}


def test_gguf_reads_llama_cpps_defaults(tmp_path):
  """No original context: the context length (llama.cpp's n_ctx_train); no betas: 32 / 1;
  yarn_log_multiplier M: mscale 1 and mscale_all_dim M; type none: no scaling."""
  path = _gguf_with(tmp_path, {**_YARN_KV, "dflash.context_length": (16, VT.UINT32)})
  assert load_drafter(path)[0].rope_scaling == YARN
  path = _gguf_with(tmp_path, {**_YARN_KV, "dflash.rope.scaling.original_context_length":
                               (16, VT.UINT32),
                               "dflash.rope.scaling.yarn_log_multiplier": (0.5, VT.FLOAT32),
                               "dflash.rope.scaling.yarn_ext_factor": (1.0, VT.FLOAT32)})
  assert load_drafter(path)[0].rope_scaling == dataclasses.replace(YARN, mscale=1.0,
                                                                    mscale_all_dim=0.5)
  path = _gguf_with(tmp_path, {"dflash.rope.scaling.type": ("none", VT.STRING),
                               "dflash.rope.scaling.factor": (4.0, VT.FLOAT32)})
  assert load_drafter(path)[0] == dfj.TINY_CONFIG


@pytest.mark.parametrize("extra, culprits", [
    ({"dflash.rope.scaling.type": ("longrope", VT.STRING)},
     ("'dflash.rope.scaling.type' is 'longrope'",)),
    ({"dflash.rope.scaling.type": ("llama3", VT.STRING)}, ("'llama3'", "rope_freqs")),
    ({"dflash.rope.scaling.type": (3, VT.UINT32)},
     ("'dflash.rope.scaling.type' is UINT32, expected a string",)),
    ({"dflash.rope.scaling.type": ("linear", VT.STRING)},
     ("missing metadata key 'dflash.rope.scaling.factor'",)),
    ({"dflash.rope.scaling.type": ("linear", VT.STRING),
      "dflash.rope.scaling.factor": (2.0, VT.FLOAT32),
      "dflash.rope.scaling.attn_factor": (1.2, VT.FLOAT32)},
     ("'dflash.rope.scaling.attn_factor' = 1.2 with linear scaling",)),
    (_YARN_KV, ("needs 'dflash.rope.scaling.original_context_length'",)),
    ({**_YARN_KV, "dflash.rope.scaling.original_context_length": (16, VT.UINT32),
      "dflash.rope.scaling.yarn_attn_factor": (1.2, VT.FLOAT32)},
     ("'dflash.rope.scaling.yarn_attn_factor' = 1.2", "not settled")),
    ({**_YARN_KV, "dflash.rope.scaling.original_context_length": (16, VT.UINT32),
      "dflash.rope.scaling.yarn_ext_factor": (0.5, VT.FLOAT32)},
     ("'dflash.rope.scaling.yarn_ext_factor' = 0.5",)),
    ({**_YARN_KV, "dflash.rope.scaling.original_context_length": (0, VT.UINT32)},
     ("original_max_position_embeddings must be a positive int",)),
])
def test_gguf_rope_errors_name_the_key_and_file(tmp_path, extra, culprits):
  _expect_error(_gguf_with(tmp_path, extra), *culprits)


def test_convert_cli_keeps_the_scaling(tmp_path):
  cfg = dataclasses.replace(YARN_CFG, rope_scaling=dataclasses.replace(YARN, beta_slow=2.0))
  src = save_drafter(tmp_path / "a.gguf", cfg, _drafter(3))
  assert main(["convert", str(src), str(tmp_path / "hf")]) == 0
  assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "b.gguf")]) == 0
  assert load_drafter(tmp_path / "hf")[0] == cfg == load_drafter(tmp_path / "b.gguf")[0]


# ---------------------------------------------------------------------------------------------
# Targets: every family against its float64 reference past the original context

TARGET_SCALINGS = {
    "yarn": RopeScaling("yarn", factor=4.0, original_max_position_embeddings=8),
    "yarn-explicit": RopeScaling("yarn", factor=8.0, original_max_position_embeddings=8,
                                 attention_factor=1.4, beta_fast=16.0),
    "linear": RopeScaling("linear", factor=3.0),
    "llama3": RopeScaling("llama3", factor=8.0, original_max_position_embeddings=8,
                          low_freq_factor=1.0, high_freq_factor=4.0),
}
T_TOKENS = 24   # three times the original context
TOL = dict(rtol=2e-4, atol=2e-4)


def _target_rope_is_the_formulas(cfg, dim):
  """The table and factor the target and its reference use are hf_rope's of cfg.to_hf()."""
  hf = cfg.to_hf()
  hf = hf.get("text_config", hf)
  _, want, attention = hf_rope(hf, dim)
  np.testing.assert_allclose(rope_inv_freq(dim, cfg.rope_theta, cfg.rope_scaling, np.float64),
                             want, rtol=1e-13)
  np.testing.assert_allclose(cfg.rope_scaling.attention_scaling, attention, rtol=1e-15)


def _assert_forward_matches(logits, feats, capture, hidden_states, e):
  for b, (hs, ref) in enumerate(hidden_states):
    np.testing.assert_allclose(logits[b], ref, **TOL)
    for j, i in enumerate(capture):
      np.testing.assert_allclose(feats[b, :, j * e:(j + 1) * e], hs[i], **TOL, err_msg=str(i))


def _tokens(seed, shape, vocab):
  return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


@pytest.mark.parametrize("name", TARGET_SCALINGS)
def test_qwen3_target(name):
  cfg = Q.TargetConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       rope_theta=1e4, max_position_embeddings=64,
                       rope_scaling=TARGET_SCALINGS[name])
  assert Q.config_from_hf(cfg.to_hf(), "config.json") == cfg
  _target_rope_is_the_formulas(cfg, 16)
  p = Q.init_params(cfg, jax.random.key(1))
  toks = _tokens(2, (2, T_TOKENS), cfg.vocab_size)
  capture = (0, 1, 2)
  logits, feats = Q.forward_jit(p, cfg, toks, capture_layers=capture)
  _assert_forward_matches(logits, feats, capture,
                          [RQ.hidden_states(p, cfg, toks[b]) for b in range(2)], cfg.hidden_size)
  plain, _ = Q.forward_jit(p, dataclasses.replace(cfg, rope_scaling=None), toks)
  assert np.abs(np.asarray(plain) - np.asarray(logits)).max() > 1e-3


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_qwen3_cached_passes(impl):
  """Prefill then verify past the original context, both impls (pallas: the q/k norm + rope
  kernel that writes the cache, interpret mode on CPU): the logits are the reference's."""
  cfg = Q.TargetConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       rope_theta=1e4, max_position_embeddings=64,
                       rope_scaling=TARGET_SCALINGS["yarn-explicit"])
  p = Q.init_params(cfg, jax.random.key(5))
  toks = _tokens(6, (2, T_TOKENS), cfg.vocab_size)
  n_pre = T_TOKENS - 4
  cache = cfg.init_cache(2, 32, "fp32")
  cache, _ = Q.prefill_jit(p, cfg, cache, jnp.asarray(toks[:, :n_pre]),
                           jnp.full((2,), n_pre, jnp.int32), impl=impl)
  _, logits, _ = Q.verify_jit(p, cfg, cache, jnp.asarray(toks[:, n_pre:]), impl=impl)
  for b in range(2):
    ref = RQ.hidden_states(p, cfg, toks[b])[1]
    np.testing.assert_allclose(np.asarray(logits[b]), ref[n_pre:], **TOL)


@pytest.mark.parametrize("name", ["yarn", "yarn-explicit"])
def test_muse_glimmer_target(name):
  cfg = MG.MuseGlimmerConfig(vocab_size=61, hidden_size=32, intermediate_size=48,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, rope_theta=1e4, sliding_window=6,
                             max_position_embeddings=64, rope_scaling=TARGET_SCALINGS[name])
  assert MG.config_from_hf(cfg.to_hf(), "config.json") == cfg
  assert cfg.to_hf()["text_config"]["rope_parameters"]["rope_type"] == "yarn"
  _target_rope_is_the_formulas(cfg, 16)
  t = TC.random_tensors(MG.hf_tensor_shapes(cfg), 1, lambda n: "layernorm" in n)
  p = MG.params_from_hf(cfg, dict(t), "fp32")
  toks = _tokens(3, (2, T_TOKENS), cfg.vocab_size)
  capture = tuple(range(cfg.num_hidden_layers + 1))
  logits, feats = MG.forward_jit(p, cfg, toks, capture_layers=capture)
  _assert_forward_matches(logits, feats, capture,
                          [RM.hidden_states(cfg.to_hf(), t, toks[b]) for b in range(2)],
                          cfg.hidden_size)


@pytest.mark.parametrize("name", ["yarn", "llama3"])
def test_qwen3_moe_target(name):
  cfg = QM.Qwen3MoeConfig(vocab_size=61, hidden_size=32, intermediate_size=40,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=16, rope_theta=1e4, max_position_embeddings=64,
                          rope_scaling=TARGET_SCALINGS[name])
  assert QM.config_from_hf(cfg.to_hf(), "config.json") == cfg
  _target_rope_is_the_formulas(cfg, 16)
  t = TC.random_tensors(QM.hf_tensor_shapes(cfg), 1)
  p = QM.params_from_hf(cfg, dict(t), "fp32")
  toks = _tokens(4, (2, T_TOKENS), cfg.vocab_size)
  capture = (0, 2)
  logits, feats = QM.forward_jit(p, cfg, toks, capture_layers=capture)
  _assert_forward_matches(logits, feats, capture,
                          [RMOE.hidden_states(cfg.to_hf(), t, toks[b]) for b in range(2)],
                          cfg.hidden_size)


def test_target_folder_keeps_the_scaling(tmp_path):
  cfg = Q.TargetConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e4,
                       max_position_embeddings=64, rope_scaling=TARGET_SCALINGS["yarn"])
  p = Q.init_params(cfg, jax.random.key(0))
  save_target(tmp_path / "t", cfg, p)
  assert read_target_config(tmp_path / "t") == cfg
  assert load_target(tmp_path / "t")[0] == cfg


# ---------------------------------------------------------------------------------------------
# The lossless loop


def test_yarn_drafter_and_target_through_the_lossless_loop():
  """Greedy speculative decoding with a YaRN target (original context 8) and a YaRN drafter
  equals the target's own greedy decoding, over contexts up to ~6x the original."""
  scaling = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=8)
  tcfg, _ = TM.target(seed=0)
  tcfg = dataclasses.replace(tcfg, rope_scaling=scaling)
  tp = Q.init_params(tcfg, jax.random.key(0))
  dcfg, w = TM.drafter_weights(tcfg, seed=1)
  dcfg = dataclasses.replace(dcfg, rope_scaling=scaling)
  w["tok_embd"], w["lm_head"] = np.asarray(tp.embed), np.asarray(tp.head)
  dp = dfj.prepare_weights(dcfg, w)
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, tcfg.vocab_size, n).tolist() for n in (3, 12, 20)]
  ref = D.generate_target_only(tp, tcfg, prompts, 24)
  got = D.generate(TM.models(tcfg, tp, dp), D.DecodeConfig(width=8, impl="xla"), prompts, 24,
                   rounds_per_call=2)
  assert got.tokens == ref.tokens
