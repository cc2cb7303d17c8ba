"""Issue 16's CI check, through the CLI: `train-target` trains a tiny target, `train-drafter`
trains a tiny drafter against it for a few dozen steps (the loss falls), and `eval` shows the
trained drafter's tau beating the untrained one's in the real decoding loop, every method
lossless.

The corpus is four fixed 16-byte phrases in random order, written as .py files: the target
learns them in a few dozen steps, so its greedy continuations are mostly determined (within a
phrase) and the drafter, trained on them (self-distillation), can learn them too. Seeded and
CPU-sized.
"""
import json

import numpy as np

import dflash_jax as dfj
from dflash_jax.__main__ import main
from dflash_jax.train import forward as F
from dflash_jax.train import recipes

ALPHABET = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-"
PHRASES = [bytes(p) for p in np.random.default_rng(0).permutation(list(ALPHABET)).reshape(4, 16)]


def _corpus(folder):
  rng = np.random.default_rng(1)
  for i in range(40):
    text = b"".join(PHRASES[j] for j in rng.integers(0, 4, 100))
    (folder / f"m{i:02d}.py").write_bytes(text)
  return ["--corpus", str(folder), "--holdout-every", "4"]


def _log(path):
  return json.loads(path.read_text())


def test_cli_trains_a_drafter_that_beats_the_untrained_one(tmp_path):
  (tmp_path / "corpus").mkdir()
  corpus = _corpus(tmp_path / "corpus")
  target, drafter, out = tmp_path / "target", tmp_path / "drafter", tmp_path / "eval"
  assert main(["train-target", "--out", str(target), *corpus, "--layers", "2", "--hidden", "32",
               "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--ffn", "64",
               "--seq-len", "32", "--batch", "16", "--steps", "30", "--lr", "1e-2",
               "--warmup", "2", "--log-every", "10"]) == 0
  assert _log(target / "train_log.json")["log"][-1]["eval_acc"] > 0.8   # phrases learnt

  assert main(["train-drafter", "--target", str(target), "--out", str(drafter), *corpus,
               "--layers", "1", "--block", "8", "--window", "16", "--prompts", "64",
               "--prompt-len", "8", "--gen-len", "24", "--gen-batch", "64", "--anchors", "8",
               "--batch", "8", "--steps", "40", "--lr", "1e-2", "--warmup", "2",
               "--log-every", "5"]) == 0
  losses = [r["loss"] for r in _log(drafter / "train_log.json")["log"]]
  assert losses[-1] < 0.6 * losses[0], losses

  trained = drafter / "drafter.gguf"
  cfg, _ = dfj.load_drafter(trained)
  untrained = str(tmp_path / "untrained.gguf")   # the trained drafter's initial weights
  dfj.save_drafter(untrained, cfg, recipes.host_weights(F.init_drafter(cfg, seed=0)))
  assert main(["eval", "--target", str(target), "--drafter", untrained, "--drafter",
               str(trained), *corpus, "--prompts", "8", "--prompt-len", "8", "--gen", "24",
               "--widths", "8", "--impl", "xla", "--dtype", "fp32", "--out", str(out)]) == 0
  rows = {r["method"].split(" (")[0]: r for r in _log(out / "eval.json")["rows"]}
  table = (out / "eval.md").read_text()
  assert set(rows) == {"target only", "untrained.gguf", "drafter.gguf", "prompt lookup"}, table
  assert rows["drafter.gguf"]["tau"] > rows["untrained.gguf"]["tau"] + 0.5, table
  for r in rows.values():   # greedy speculative decoding is lossless, whatever proposes
    assert r["same_as_target"] == r["n_prompts"] == 8 and r["n_tokens"] == 8 * 24, table
