"""DFlashConfig's family fields, their validation and the per-family tensor schema."""
import dataclasses

import numpy as np
import pytest

from dflash_jax.config import (DFLASH2_CONFIG, DSPARK_QWEN3_8B_CONFIG, FULL, SEED_CONFIG,
                               SLIDING, TINY_CONFIG, TINY_DFLASH2_CONFIG, TINY_DSPARK_CONFIG,
                               DFlash2Fields, DFlashConfig, DSparkFields, check_drafter_weights,
                               drafter_tensor_shapes, gguf_tensor_name, resolve_is_causal,
                               vocab_sized_tensors)
from dflash_jax.synthetic import synthetic_drafter

D2 = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=4)


def test_dflash_configs_are_what_they_were():
  plain = DFlashConfig(n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, head_dim=16,
                       rope_theta=1e4, eps=1e-6, target_layers=(1, 3, 5), mask_token_id=7,
                       block_size=8, window=32)
  assert plain == TINY_CONFIG and hash(plain) == hash(TINY_CONFIG)
  assert plain.family == "dflash" and plain.family_fields is None
  assert len(drafter_tensor_shapes(SEED_CONFIG)) == 58
  assert vocab_sized_tensors(SEED_CONFIG) == ()
  assert not plain.shifted_rows and plain.first_draft_row == 1 and plain.n_drafts() == 7
  assert not any(plain.block_causal(l) for l in range(plain.n_layer))


def test_presets():
  f = DFLASH2_CONFIG.dflash2
  assert (DFLASH2_CONFIG.n_layer, DFLASH2_CONFIG.n_embd, DFLASH2_CONFIG.n_ff) == (5, 6656, 19968)
  assert DFLASH2_CONFIG.kinds == (SLIDING,) * 5 and DFLASH2_CONFIG.window == 2048
  assert DFLASH2_CONFIG.target_layers == (2, 14, 26, 38, 50)       # HF [1, 13, 25, 37, 49] + 1
  assert (f.conv_kernel_size, f.conv_group_size, f.selector_rank, f.selector_top_k) == (
      2, 16, 256, 16)
  assert f.output_multiplier == 0.19611613513818404 and f.final_logit_softcapping == 20.0
  assert f.is_causal is False and DFLASH2_CONFIG.n_conv_groups == 416
  shapes = drafter_tensor_shapes(DFLASH2_CONFIG, 202048)
  assert len(shapes) == 81     # 58 + 4 per layer + 3
  assert shapes["blk.4.attn_conv_proj"] == (1664, 6656)
  assert shapes["blk.0.ffn_conv_base"] == (2, 2, 6656)
  assert shapes["selector_successor"] == (202048, 256)
  assert shapes["selector_hidden"] == (256, 6656)
  s = DSPARK_QWEN3_8B_CONFIG
  assert s.block_size == 7 and s.kinds == (FULL,) * 5 and s.n_drafts() == 7
  assert s.dspark.markov_head_type == "vanilla" and s.dspark.markov_rank == 256
  assert drafter_tensor_shapes(s, 151936)["conf_proj"] == (1, 4096 + 256)
  for cfg in (DFLASH2_CONFIG, DSPARK_QWEN3_8B_CONFIG, TINY_DFLASH2_CONFIG, TINY_DSPARK_CONFIG):
    hash(cfg)   # a jit static argument


@pytest.mark.parametrize("head,conf,with_markov,expect", [
    ("vanilla", True, True, {"markov_w1": (100, 8), "markov_w2": (100, 8),
                             "conf_proj": (1, 72), "conf_proj.bias": (1,)}),
    ("gated", False, False, {"markov_w1": (100, 8), "markov_w2": (100, 8),
                             "markov_gate": (8, 72), "markov_gate.bias": (8,)}),
    ("rnn", True, False, {"markov_w1": (100, 8), "markov_w2": (100, 8),
                          "markov_joint": (24, 80), "markov_joint.bias": (24,),
                          "conf_proj": (1, 64), "conf_proj.bias": (1,)}),
    (None, True, False, {"conf_proj": (1, 64), "conf_proj.bias": (1,)}),
    (None, False, False, {}),
])
def test_dspark_tensor_shapes(head, conf, with_markov, expect):
  cfg = dataclasses.replace(TINY_DSPARK_CONFIG, family_fields=DSparkFields(
      markov_rank=8 if head else 0, markov_head_type=head, confidence_head=conf,
      confidence_with_markov=with_markov))
  n = 100 if head else None
  shapes = drafter_tensor_shapes(cfg, n)
  v1 = drafter_tensor_shapes(TINY_CONFIG)
  assert {k: v for k, v in shapes.items() if k not in v1} == expect
  assert set(vocab_sized_tensors(cfg)) == ({"markov_w1", "markov_w2"} if head else set())


def test_vocab_sized_tensors_need_n_vocab():
  with pytest.raises(ValueError, match=r"n_vocab.*'dflash2'.*selector_predecessor"):
    drafter_tensor_shapes(TINY_DFLASH2_CONFIG)
  with pytest.raises(ValueError, match="n_vocab"):
    drafter_tensor_shapes(TINY_DSPARK_CONFIG, 0)


@pytest.mark.parametrize("fields,match", [
    (dict(conv_kernel_size=0), "conv_kernel_size"),
    (dict(conv_group_size=2.0), "conv_group_size"),
    (dict(selector_rank=-1), "selector_rank"),
    (dict(selector_top_k=True), "selector_top_k"),
    (dict(output_multiplier=0.0), "output_multiplier"),
    (dict(output_multiplier=float("nan")), "output_multiplier"),
    (dict(final_logit_softcapping=-1.0), "final_logit_softcapping"),
    (dict(input_embedding_scale=float("inf")), "input_embedding_scale"),
    (dict(is_causal=None), "is_causal.*resolve_is_causal"),
    (dict(is_causal=()), "is_causal"),
    (dict(is_causal=(True, 1)), "is_causal"),
])
def test_dflash2_fields_validation_names_the_field(fields, match):
  with pytest.raises(ValueError, match=match):
    DFlash2Fields(**{**D2, **fields})


@pytest.mark.parametrize("fields,match", [
    (dict(markov_rank=8), "markov_head_type"),
    (dict(markov_rank=8, markov_head_type="lstm"), "markov_head_type"),
    (dict(markov_rank=0, markov_head_type="vanilla"), "markov_head_type must be None"),
    (dict(markov_rank=-2), "markov_rank"),
    (dict(confidence_with_markov=True, markov_rank=8, markov_head_type="rnn"),
     "confidence_with_markov needs confidence_head"),
    (dict(confidence_head=True, confidence_with_markov=True), "needs a Markov head"),
    (dict(sample_from_anchor=1), "sample_from_anchor"),
])
def test_dspark_fields_validation_names_the_field(fields, match):
  with pytest.raises(ValueError, match=match):
    DSparkFields(**fields)


def test_config_family_validation():
  with pytest.raises(ValueError, match="family must be one of"):
    dataclasses.replace(TINY_CONFIG, family="eagle")
  with pytest.raises(ValueError,
                     match="family_fields must be a DFlash2Fields for family 'dflash2'"):
    dataclasses.replace(TINY_CONFIG, family="dflash2")
  with pytest.raises(ValueError, match="family_fields must be None for family 'dflash'"):
    dataclasses.replace(TINY_CONFIG, family_fields=DSparkFields())
  with pytest.raises(ValueError, match="family_fields must be a DSparkFields"):
    dataclasses.replace(TINY_CONFIG, family="dspark", family_fields=DFlash2Fields(**D2))
  with pytest.raises(ValueError, match=r"conv_group_size \(24\) must divide n_embd \(64\)"):
    dataclasses.replace(TINY_DFLASH2_CONFIG,
                        family_fields=DFlash2Fields(**{**D2, "conv_group_size": 24}))
  with pytest.raises(ValueError, match="is_causal has 3 entries for n_layer 2"):
    dataclasses.replace(TINY_DFLASH2_CONFIG,
                        family_fields=DFlash2Fields(**D2, is_causal=(True, False, True)))
  with pytest.raises(ValueError, match="not 'dflash2'"):
    TINY_CONFIG.dflash2
  with pytest.raises(ValueError, match="not 'dspark'"):
    TINY_DFLASH2_CONFIG.dspark


def test_causality_is_stored_resolved():
  assert DFlash2Fields(**D2, is_causal=(True, True)) == DFlash2Fields(**D2, is_causal=True)
  assert DFlash2Fields(**D2, is_causal=[False, np.bool_(False)]).is_causal is False
  cfg = dataclasses.replace(TINY_DFLASH2_CONFIG,
                            family_fields=DFlash2Fields(**D2, is_causal=(False, True)))
  assert [cfg.block_causal(l) for l in range(2)] == [False, True]


def test_resolve_is_causal_follows_the_format_default():
  kinds = (SLIDING, FULL, SLIDING)
  assert resolve_is_causal(None, kinds, "hf") == (True, False, True)      # z-lab's rule
  assert resolve_is_causal(None, kinds, "gguf") is False                  # llama.cpp's
  assert resolve_is_causal(True, kinds, "gguf") is True
  assert resolve_is_causal(False, kinds, "hf") is False
  with pytest.raises(ValueError, match="source"):
    resolve_is_causal(None, kinds, "mlx")
  with pytest.raises(ValueError, match="is_causal must be a bool"):
    resolve_is_causal("false", kinds, "hf")


def test_dspark_rows():
  unshifted = dataclasses.replace(TINY_DSPARK_CONFIG, family_fields=dataclasses.replace(
      TINY_DSPARK_CONFIG.dspark, sample_from_anchor=False))
  assert TINY_DSPARK_CONFIG.shifted_rows and TINY_DSPARK_CONFIG.first_draft_row == 0
  assert TINY_DSPARK_CONFIG.n_drafts(4) == 4 and unshifted.n_drafts(4) == 3
  assert not unshifted.shifted_rows


@pytest.mark.parametrize("cfg", [TINY_CONFIG, TINY_DFLASH2_CONFIG, TINY_DSPARK_CONFIG])
def test_check_drafter_weights(cfg):
  w = synthetic_drafter(cfg, seed=0, n_vocab=100)
  assert check_drafter_weights(cfg, w) == 100
  assert set(w) == set(drafter_tensor_shapes(cfg, 100)) | {"tok_embd", "lm_head"}
  with pytest.raises(ValueError, match="unknown tensors.*'extra'"):
    check_drafter_weights(cfg, {**w, "extra": np.zeros(3)})
  name = sorted(set(drafter_tensor_shapes(cfg, 100)) - set(drafter_tensor_shapes(TINY_CONFIG)))
  for n in name or ["blk.0.attn_q"]:
    with pytest.raises(ValueError, match=f"lack tensor '{n}'"):
      check_drafter_weights(cfg, {k: v for k, v in w.items() if k != n})
    bad = {**w, n: np.full(w[n].shape, np.nan, np.float32)}
    with pytest.raises(ValueError, match=f"'{n}' holds NaN"):
      check_drafter_weights(cfg, bad)
  reduced = {**w, "lm_head": w["lm_head"][:60]}
  if cfg.family == "dflash":
    assert check_drafter_weights(cfg, reduced) == 100
  else:
    with pytest.raises(ValueError, match="lm_head.*full vocabulary"):
      check_drafter_weights(cfg, reduced)


def test_check_drafter_weights_top_k_fits_the_vocab():
  cfg = dataclasses.replace(TINY_DFLASH2_CONFIG, mask_token_id=2,
                            family_fields=DFlash2Fields(**{**D2, "selector_top_k": 6}))
  w = synthetic_drafter(cfg, seed=0, n_vocab=6)
  assert check_drafter_weights(cfg, w) == 6
  w5 = synthetic_drafter(dataclasses.replace(cfg, family_fields=DFlash2Fields(**D2)), n_vocab=5)
  with pytest.raises(ValueError, match="selector_top_k 6 exceeds"):
    check_drafter_weights(cfg, w5)


def test_synthetic_shares_the_backbone_across_families():
  w1 = synthetic_drafter(TINY_CONFIG, seed=4, n_vocab=100)
  w2 = synthetic_drafter(TINY_DFLASH2_CONFIG, seed=4, n_vocab=100)
  for k, v in w1.items():
    np.testing.assert_array_equal(w2[k], v)
  base = w2["blk.0.attn_conv_base"]
  assert np.abs(base[:, 0] - 1).mean() < 0.2 and np.abs(base[:, 1]).mean() < 0.2


def test_gguf_tensor_names():
  assert gguf_tensor_name("blk.3.attn_conv_base") == "blk.3.attn_conv_base"
  assert gguf_tensor_name("blk.3.ffn_conv_proj") == "blk.3.ffn_conv_proj.weight"
  assert gguf_tensor_name("selector_hidden") == "selector_hidden.weight"
  assert gguf_tensor_name("conf_proj") == "conf_proj.weight"
  assert gguf_tensor_name("conf_proj.bias") == "conf_proj.bias"
  assert gguf_tensor_name("fc") == "fc.weight"
