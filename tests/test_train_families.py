"""Training DFlash2 and DSpark drafters (SPEC_dflash2_dspark; the objectives in train/loss.py):
every family's step lowers its loss; DFlash2's selector loss reaches the selector's tensors
only; DSpark's confidence target is 1 - TV against the target's own logits at each row, from
the target's final state captured beside the features (online or cached: the same loss);
`train-drafter --family` resumes from its checkpoints and exports what load_drafter reads."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from dflash_jax.__main__ import main
from dflash_jax.config import DFlash2Fields, DSparkFields
from dflash_jax.models import qwen3, save_target
from dflash_jax.train import features as FS
from dflash_jax.train import forward as F
from dflash_jax.train import trainer as TR
from dflash_jax.train.loss import block_targets, resolve_gamma

from _train_common import (CFG, CFG2, CFG_SPARK, TC, TCFG, TRAIN_STATIC, drafter_step,
                           setup_data)

_loss = jax.jit(TR.drafter_loss, static_argnames=TRAIN_STATIC)
_grad = jax.jit(jax.grad(TR.drafter_loss, has_aux=True), static_argnames=TRAIN_STATIC)



@pytest.mark.parametrize("cfg", [CFG, CFG2, CFG_SPARK], ids=["dflash", "dflash2", "dspark"])
def test_each_family_step_lowers_its_loss(cfg):
  target, data = setup_data()
  state = TR.init_state(F.init_drafter(cfg, seed=1, n_vocab=TCFG.vocab_size), TC.optim)
  b = data.batch(0)
  first = None
  for _ in range(12):   # one batch, again and again: the loss must fall
    state, m = drafter_step(state, target, b, cfg=cfg, target_cfg=TCFG, tc=TC)
    first = float(m["loss"]) if first is None else first
    assert np.isfinite(float(m["loss"])) and np.isfinite(float(m["grad_norm"]))
  assert float(m["loss"]) < 0.9 * first, (first, float(m["loss"]))
  keys = {"dflash": {"accept", "row_acc"}, "dflash2": {"block_loss", "sel_loss", "sel_accept"},
          "dspark": {"ce", "conf_bce", "conf_mae", "accept"}}[cfg.family]
  assert keys <= set(m)


def test_dflash2_selector_loss_trains_the_selector_only():
  target, data = setup_data(1)
  w = F.init_drafter(CFG2, seed=2, n_vocab=TCFG.vocab_size)
  w = dict(w, selector_successor=w["selector_predecessor"] * 0.5)   # a live edge term
  b = data.batch(0)
  grads = {}
  for weight in (0.0, 1.0):
    tc = dataclasses.replace(TC, compute_dtype="fp32", selector_weight=weight)
    grads[weight], _ = _grad(w, target, b, cfg=CFG2, target_cfg=TCFG, tc=tc)
  selector = ("selector_hidden", "selector_predecessor", "selector_successor")
  for k in w:
    g0, g1 = np.asarray(grads[0.0][k]), np.asarray(grads[1.0][k])
    if k in selector:
      assert not g0.any() and np.abs(g1).max() > 1e-6, k
    else:   # the backbone and the convolutions see the block loss alone
      np.testing.assert_array_equal(g0, g1, err_msg=k)


@pytest.mark.parametrize("layers", [(1,), (1, 2)], ids=["final-appended", "final-captured"])
def test_dspark_confidence_target_is_one_minus_tv_against_the_target_logits(layers, tmp_path):
  cfg = dataclasses.replace(CFG_SPARK, target_layers=layers)
  capture = TR.training_capture_layers(cfg, TCFG)
  assert capture == (1, 2)   # the target's final state (HF index 2) once, appended or not
  target, data = setup_data(2)
  w = F.init_drafter(cfg, seed=3, n_vocab=TCFG.vocab_size)
  b = data.batch(0)
  tc = dataclasses.replace(TC, compute_dtype="fp32")
  _, m = _loss(w, target, b, cfg=cfg, target_cfg=TCFG, tc=tc)
  # Independently: the target's logits from its own forward, at the position before each label.
  logits, feats = qwen3.forward(target, TCFG, jnp.asarray(b.tokens), capture_layers=layers)
  out = F.dspark_block_outputs(w, target.embed, target.head, cfg, feats, jnp.asarray(b.tokens),
                               jnp.asarray(b.anchors))
  pos = np.clip(np.asarray(F.label_positions(cfg, jnp.asarray(b.anchors))) - 1, 0,
                b.tokens.shape[1] - 1)
  tl = np.take_along_axis(np.asarray(logits, np.float64)[:, None],
                          pos[..., None], 2)                       # [S, A, B, V]
  sm = lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(
      x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
  y = 1 - 0.5 * np.abs(sm(np.asarray(out.logits, np.float64)) - sm(tl)).sum(-1)
  _, weights = block_targets(b.tokens, b.loss_mask, b.anchors, b.anchor_valid, 7,
                             resolve_gamma(7, shifted=True), shifted=True)
  weights = np.asarray(weights)
  np.testing.assert_allclose(float(m["conf_target"]), (weights * y).sum() / weights.sum(),
                             rtol=1e-4)
  # Cached shards of the training capture give the same loss as online features.
  FS.write_feature_shards(str(tmp_path), target, TCFG, capture, data.tokens, batch_size=8)
  cached = FS.FeatureShards(str(tmp_path), capture).rows(data.rows(0))
  loss_cached, _ = _loss(w, target, b, jnp.asarray(cached), cfg=cfg, target_cfg=TCFG, tc=tc)
  np.testing.assert_allclose(float(loss_cached), float(m["loss"]), rtol=1e-5)


@pytest.mark.parametrize("family,extra", [
    ("dflash2", ["--conv-group", "8", "--selector-rank", "8", "--selector-top-k", "4"]),
    ("dspark", ["--markov-rank", "8", "--full-layers", "0"])])
def test_train_drafter_family_resumes_and_exports(family, extra, tmp_path, capsys):
  tcfg = qwen3.TargetConfig(vocab_size=272, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=16)
  folder = save_target(str(tmp_path / "t"), tcfg, qwen3.init_params(tcfg, jax.random.key(0)))
  (tmp_path / "corpus").mkdir()
  for i in range(8):
    (tmp_path / "corpus" / f"m{i}.py").write_text(f"x = {i}\n" * 40)
  out = tmp_path / "d"
  argv = ["train-drafter", "--target", folder, "--out", str(out), "--family", family,
          "--corpus", str(tmp_path / "corpus"), "--holdout-every", "4", "--layers", "1",
          "--window", "16", "--prompts", "16", "--prompt-len", "8", "--gen-len", "16",
          "--gen-batch", "16", "--anchors", "4", "--batch", "4", "--warmup", "1",
          "--log-every", "2", "--checkpoint-every", "2", "--save-type", "F32", *extra]
  rc = main(argv + ["--steps", "2"])
  capsys.readouterr()
  assert (out / "checkpoints").is_dir()
  rc = main(argv + ["--steps", "4"])   # resumes at step 2
  text = capsys.readouterr()
  assert f"resumed from {out / 'checkpoints'} at step 2" in text.out
  assert rc == 0, text.err
  cfg, w = dfj.load_drafter(out / "drafter.gguf")
  assert cfg.family == family and cfg.family_fields == _cfg_of(family).family_fields
  # Each run logs its first step (whose time includes compiling), then every --log-every.
  assert [r["step"] for r in json.loads((out / "train_log.json").read_text())["log"]] == [
      1, 2, 3, 4]


def _cfg_of(family):
  """The family fields the CLI test's arguments give (checked against the exported file)."""
  if family == "dflash2":
    return dataclasses.replace(CFG, family="dflash2", family_fields=DFlash2Fields(
        conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=4))
  return dataclasses.replace(CFG, block_size=7, layer_types=("full_attention",),
                             family="dspark", family_fields=DSparkFields(
      sample_from_anchor=True, markov_rank=8, markov_head_type="vanilla", confidence_head=True,
      confidence_with_markov=True))
