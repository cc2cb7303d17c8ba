"""Training that fits and tells (issue 43): the memory estimates against XLA's own accounting,
--max-minutes bounding every stage of train-drafter and train-target (distillation and
feature caching included: each stops at its share with the rows done, training stops before a
step that would cross the limit), progress lines with an ETA, and train-target's
tokenizer.json, which generate and eval read text with."""
from __future__ import annotations

import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from dflash_jax.__main__ import main
from dflash_jax.models import qwen3
from dflash_jax.train import budget as B
from dflash_jax.train import distill
from dflash_jax.train import forward as F
from dflash_jax.train import trainer as TR
from dflash_jax.train.data import TOKENIZER, DrafterBatch, map_batches


def _xla_bytes(compiled) -> int:
  m = compiled.memory_analysis()
  return (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
          - m.alias_size_in_bytes)


def _tcfg(layers, hidden, heads, kv, head_dim, ffn):
  return qwen3.TargetConfig(vocab_size=272, hidden_size=hidden, intermediate_size=ffn,
                            num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=kv, head_dim=head_dim)


# The estimates count the peak XLA plans on CPU within this band (they leave out XLA's own
# scratch and layouts, and count some buffers XLA reuses).
BAND = (0.8, 1.6)


@pytest.mark.parametrize("shape", [(2, 64, 4, 2, 16, 128, 8, 64), (3, 128, 4, 2, 32, 384, 8, 256)])
def test_target_step_estimate_tracks_xla(shape):
  l, e, h, kv, d, f, b, t = shape
  tcfg = _tcfg(l, e, h, kv, d, f)
  oc = TR.OptimConfig(total_steps=10, warmup_steps=1)
  state = jax.eval_shape(lambda: TR.init_state(qwen3.init_params(tcfg, jax.random.key(0)), oc))
  c = TR.target_train_step_jit.lower(state, jax.ShapeDtypeStruct((b, t), jnp.int32), cfg=tcfg,
                                     oc=oc, compute_dtype="fp32").compile()
  ratio = B.target_step_bytes(tcfg, b, t) / _xla_bytes(c)
  assert BAND[0] < ratio < BAND[1], ratio


def test_drafter_step_and_distill_estimates_track_xla():
  tcfg = _tcfg(2, 128, 4, 2, 32, 256)
  cfg = dfj.DFlashConfig(n_layer=1, n_embd=128, n_ff=256, n_head=4, n_head_kv=2, head_dim=32,
                         rope_theta=1e4, eps=1e-6, target_layers=(1, 2), mask_token_id=257,
                         block_size=8, window=64)
  s, t, a = 8, 128, 16
  tc = TR.DrafterTrainConfig(optim=TR.OptimConfig(total_steps=10, warmup_steps=1), window=64,
                             compute_dtype="fp32")
  state = jax.eval_shape(lambda: TR.init_state(F.init_drafter(cfg), tc.optim))
  tp = jax.eval_shape(lambda: qwen3.init_params(tcfg, jax.random.key(0)))
  sds = jax.ShapeDtypeStruct
  batch = DrafterBatch(tokens=sds((s, t), jnp.int32), loss_mask=sds((s, t), bool),
                       anchors=sds((s, a), jnp.int32), anchor_valid=sds((s, a), bool))
  c = TR.drafter_train_step_jit.lower(state, tp, batch, cfg=cfg, target_cfg=tcfg, tc=tc).compile()
  ratio = B.drafter_step_bytes(cfg, tcfg, s, t, a) / _xla_bytes(c)
  assert BAND[0] < ratio < BAND[1], ratio
  c = distill._generate.lower(tp, tcfg, sds((32, 64), jnp.int32), 64, "fp32").compile()
  ratio = B.distill_bytes(tcfg, 32, 64, 64) / _xla_bytes(c)
  assert BAND[0] < ratio < BAND[1], ratio


def test_map_batches_stops_at_the_limit_with_the_rows_done():
  calls = []

  def slow(batch):
    calls.append(len(batch))
    time.sleep(0.05)
    return batch * 2

  rows = np.arange(40).reshape(20, 2)
  t0 = time.perf_counter()
  out = map_batches(slow, rows, 4, stop_at=t0 + 0.12)
  assert 1 <= out.shape[0] // 4 <= 3 and out.shape[0] % 4 == 0, out.shape
  assert (out == rows[:out.shape[0]] * 2).all()
  assert time.perf_counter() - t0 < 0.2
  assert map_batches(slow, rows, 4).shape == (20, 2)


def test_deadline_shares():
  d = B.Deadline(100.0, 60.0)
  assert d.at(0.5) == 130.0 and d.at() == 160.0
  assert B.Deadline(0.0, None).at(0.4) == float("inf") and B.Deadline(0.0, None).left() is None
  assert B.clock(59.6) == "1:00" and B.clock(3725) == "1:02:05"


# --- the commands ----------------------------------------------------------------------------

SMALL_TARGET = ["--layers", "2", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
                "--head-dim", "16", "--ffn", "64", "--seq-len", "32", "--batch", "8",
                "--max-files", "40", "--holdout-every", "4", "--log-every", "1000", "--lr",
                "3e-3", "--warmup", "2"]


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
  out = tmp_path_factory.mktemp("budget") / "target"
  assert main(["train-target", "--out", str(out), "--steps", "12"] + SMALL_TARGET) == 0
  return out


def test_train_target_writes_its_tokenizer_and_generate_reads_text(small_target, tmp_path,
                                                                  capsys):
  from tokenizers import Tokenizer
  tok = Tokenizer.from_file(str(small_target / "tokenizer.json"))
  text = "def f(x):\n    return x  # é\n"
  assert tok.encode(text).ids == TOKENIZER.encode(text).tolist()
  assert tok.decode(TOKENIZER.encode(text).tolist()) == text
  assert json.loads((small_target / "config.json").read_text())["eos_token_id"] == 256
  capsys.readouterr()
  drafter = dfj.save_drafter(str(tmp_path / "d.gguf"), *_drafter_for(small_target))
  assert main(["generate", "--target", str(small_target), "--drafter", drafter, "--prompt",
               "import os\n", "--max-new", "8", "--eos", "0"]) == 0
  out = capsys.readouterr().out
  cfg, tp = _load(small_target)
  from dflash_jax import decode as D
  want = D.generate_target_only(tp, cfg, [TOKENIZER.encode("import os\n").tolist()], 8,
                                eos_ids=(0,), cache_dtype="bf16").tokens[0]
  assert out.splitlines()[0] == tok.decode(want).splitlines()[0]


def _load(folder):
  from dflash_jax.models import load_target
  return load_target(str(folder))


def _drafter_for(target):
  tcfg, _ = _load(target)
  cfg = dfj.DFlashConfig(n_layer=1, n_embd=tcfg.hidden_size, n_ff=64, n_head=2, n_head_kv=1,
                         head_dim=16, rope_theta=1e4, eps=1e-6, target_layers=(1, 2),
                         mask_token_id=TOKENIZER.mask_id, block_size=8, window=32)
  return cfg, dfj.synthetic_drafter(cfg, seed=0, with_target=False)


def test_train_target_progress_and_time_limit(tmp_path, capsys):
  """With far more steps than the limit allows: the loop stops early, saying so, and the whole
  command (compile, corpus, export included) ends near the limit; lines carry an ETA."""
  out = tmp_path / "t"
  t0 = time.perf_counter()
  assert main(["train-target", "--out", str(out), "--steps", "100000", "--max-minutes", "0.3"]
              + SMALL_TARGET + ["--log-every", "5"]) == 0
  took = time.perf_counter() - t0
  text = capsys.readouterr().out
  assert "first step" in text and "includes compiling" in text, text
  assert "ETA" in text or "stops at the time limit" in text, text
  assert "stopping early after step" in text, text
  assert took < 0.3 * 60 + 15, took   # the limit, plus a step and the interpreter's start
  log = json.loads((out / "train_log.json").read_text())
  assert log["log"][-1]["step"] < 100000 and "eval_loss" in log["log"][-1]
  assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()


def test_train_drafter_bounds_distillation_and_resumes_it(small_target, tmp_path, capsys):
  """Distillation of far more prompts than its share (40%) of --max-minutes allows stops with
  the prompts done, keeps them in OUT/distill.npz and trains on them; a second run reuses them
  and continues distilling."""
  out = tmp_path / "d"
  base = ["train-drafter", "--target", str(small_target), "--out", str(out), "--max-files",
          "40", "--holdout-every", "4", "--layers", "1", "--block", "8", "--window", "32", "--prompts", "100000",
          "--prompt-len", "16", "--gen-len", "16", "--gen-batch", "16", "--anchors", "4",
          "--batch", "4", "--steps", "100000", "--lr", "3e-3", "--warmup", "1",
          "--log-every", "1000", "--compute-dtype", "fp32"]
  t0 = time.perf_counter()
  assert main(base + ["--max-minutes", "0.3"]) == 0
  took = time.perf_counter() - t0
  text = capsys.readouterr().out
  assert "stopped at 40% of the time limit" in text, text
  assert "distill: " in text and "prompts |" in text, text   # progress lines
  assert "stopping early after step" in text, text
  assert took < 0.3 * 60 + 20, took
  with np.load(out / "distill.npz") as z:
    first = z["tokens"].shape[0]
  assert 16 <= first < 100000
  assert main(base + ["--max-minutes", "0.2", "--force"]) == 0
  text = capsys.readouterr().out
  assert re.search(f"distill: {first} of \\d+ prompts' continuations from", text), text
  with np.load(out / "distill.npz") as z:
    assert z["tokens"].shape[0] > first
  assert (out / "drafter.gguf").is_file()


def test_train_drafter_bounds_feature_caching(small_target, tmp_path, capsys):
  out = tmp_path / "f"
  # 400 files: caching all their features takes several times the stage's share of the
  # limit (0.6 x 12 s) even on a quiet machine, so the stop, not the end of the data, ends it.
  assert main(["train-drafter", "--target", str(small_target), "--out", str(out), "--max-files",
               "400", "--holdout-every", "4", "--layers", "1", "--block", "8", "--window", "32",
               "--data", "corpus", "--seq-len", "32", "--features", "cached", "--anchors", "4",
               "--batch", "2", "--steps", "100000", "--warmup", "1", "--max-minutes", "0.2",
               "--log-every", "1000", "--compute-dtype", "fp32"]) == 0
  text = capsys.readouterr().out
  assert "features: stopped at 60% of the time limit" in text, text
  manifest = json.loads((out / "features" / "features.json").read_text())
  assert 0 < manifest["n_rows"] and (out / "drafter.gguf").is_file()
