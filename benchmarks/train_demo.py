"""Issue 16's demonstration: a target LM trained on the Python standard library, a DFlash drafter
trained against it, both evaluated on held-out stdlib files, every stage one command.

  python -m benchmarks.train_demo target  --work W            # ~4-6 min on an H200
  python -m benchmarks.train_demo drafter --work W            # ~3-4 min (needs W/target)
  python -m benchmarks.train_demo eval    --work W --out OUT  # ~2 min (needs W/target, W/drafter)
  python -m benchmarks.train_demo drafter+eval --work W --out OUT   # the two in one call
  python -m benchmarks.train_demo all     --work W --out OUT  # the three in one process
  ... --smoke                                                  # tiny dims, 30 files: CPU minutes

Each stage runs the `python -m dflash_jax` subcommand with the presets below (printed as the
equivalent command line) and everything it writes is small: W/target holds config.json, the
bf16 safetensors (~26 MB for the GPU preset, two shards of <= 15 MB plus their index) and
train_log.json; W/drafter holds drafter.gguf (bf16, ~11 MB) and train_log.json. A fresh
machine per stage works: bring the previous stage's folders and name them with --target /
--drafter. `eval` writes OUT/eval.md, OUT/eval.json, OUT/loss_curves.png and OUT/demo.md
(sizes, token and FLOP counts, stage times, the table).

Sizing (GPU preset; FLOPs = 6 x params per trained token + 12 L T E for attention, forward +
backward): target 8 x 384 (FFN 1024, 6 query / 3 kv heads of 64, vocab 272): 13.2 M params,
~98 MFLOP per token; 3000 steps x 64 x 512 tokens = 98 M tokens (~3 epochs of the ~30 M byte
corpus) = 9.6 PFLOP, ~1 min at 150 TFLOP/s, more as the small GEMMs and the unfused T^2
attention run below peak. Drafter 3 x 384: 5.3 M params; a step (16 sequences x 64 anchors x
16 rows = 16 k block rows, plus the frozen target's forward over 16 x 512 tokens for the
features) ~1.5 TFLOP, 3000 steps ~4.5 PFLOP (~3 epochs of the distilled data). Distillation:
16384 prompts x 384 greedy tokens (6.3 M loss tokens) through the KV cache, 2048 at a time
(384 cached steps per batch, memory-bound, tens of seconds).
Eval: 32 prompts x 256 tokens per method at batch 1 (latency-bound).

Why self-distillation: the drafter is judged on the target's greedy continuations, so its
training sequences are exactly those (held-out-free training prompts + 384 target tokens,
loss on the continuation, anchors uniform over it); corpus text would teach it the corpus,
whose next bytes the target itself often does not choose.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from dflash_jax.__main__ import main as cli

GPU = dict(
    target=["--layers", "8", "--hidden", "384", "--heads", "6", "--kv-heads", "3",
            "--head-dim", "64", "--ffn", "1024", "--seq-len", "512", "--batch", "64",
            "--steps", "3000", "--lr", "2e-3", "--warmup", "200", "--log-every", "100",
            "--eval-every", "500", "--max-minutes", "7", "--max-shard-mb", "15"],
    drafter=["--layers", "3", "--block", "16", "--window", "512", "--data", "distill",
             "--prompts", "16384", "--prompt-len", "128", "--gen-len", "384", "--gen-batch",
             "2048", "--anchors", "64", "--batch", "16", "--steps", "3000", "--lr", "1e-3",
             "--warmup", "200", "--log-every", "100", "--eval-every", "500",
             "--max-minutes", "6"],
    eval=["--prompts", "32", "--prompt-len", "128", "--gen", "256", "--widths", "16,8"])
SMOKE = dict(
    target=["--max-files", "30", "--layers", "2", "--hidden", "64", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "16", "--ffn", "128", "--seq-len", "64",
            "--batch", "8", "--steps", "12", "--lr", "3e-3", "--warmup", "2", "--log-every", "4",
            "--max-shard-mb", "0.1"],
    drafter=["--max-files", "30", "--layers", "1", "--block", "8", "--window", "64",
             "--prompts", "32", "--prompt-len", "16", "--gen-len", "32", "--gen-batch", "32",
             "--anchors", "4", "--batch", "4", "--steps", "6", "--lr", "3e-3", "--warmup", "1",
             "--log-every", "2"],
    eval=["--max-files", "30", "--prompts", "2", "--prompt-len", "16", "--gen", "12",
          "--widths", "8", "--impl", "xla", "--dtype", "fp32"])


def _run(name: str, argv: list[str]) -> float:
  print(f"\n== {name}: python -m dflash_jax {shlex.join(argv)}", flush=True)
  t0 = time.perf_counter()
  rc = cli(argv)
  if rc:
    raise SystemExit(f"train_demo: stage {name} failed (exit {rc})")
  dt = time.perf_counter() - t0
  print(f"== {name}: {dt:.1f} s", flush=True)
  return dt


def _load(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def plot_losses(target_log: dict, drafter_log: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  for ax, log, title in ((axes[0], target_log, "target LM (nats/byte)"),
                         (axes[1], drafter_log, "drafter (decayed block CE)")):
    rows = log["log"]
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train")
    ev = [r for r in rows if "eval_loss" in r]
    ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="held-out")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.legend()
  last = [r for r in drafter_log["log"] if "eval_row_acc" in r][-1]
  acc = last["eval_row_acc"]
  axes[2].bar(range(1, len(acc)), acc[1:])
  axes[2].set_title("drafter held-out accuracy per block row")
  axes[2].set_xlabel("block row k (predicts x_{a+k})")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_summary(tdir: str, ddir: str, out: str, times: dict) -> str:
  tl = _load(os.path.join(tdir, "train_log.json"))
  dl = _load(os.path.join(ddir, "train_log.json"))
  ev = _load(os.path.join(out, "eval.json"))
  plot_losses(tl, dl, os.path.join(out, "loss_curves.png"))
  t_end, d_end = tl["log"][-1], dl["log"][-1]
  a = tl["args"]
  tokens = t_end["step"] * a["batch"] * a["seq_len"]
  flops = tokens * (6 * tl["n_params"] + 12 * a["layers"] * a["seq_len"] * a["hidden"])
  with open(os.path.join(out, "eval.md")) as f:
    table = f.read()
  lines = [
      f"- device: {ev['device']}",
      f"- corpus: {tl['corpus']['train_files']} train / {tl['corpus']['held_out_files']} "
      f"held-out stdlib files, {tl['corpus']['train_tokens'] / 1e6:.1f} M / "
      f"{tl['corpus']['held_out_tokens'] / 1e6:.2f} M byte tokens",
      f"- target: {tl['n_params'] / 1e6:.2f} M params, {t_end['step']} steps in "
      f"{tl['seconds']:.0f} s, held-out loss {t_end.get('eval_loss', float('nan')):.3f} "
      f"nats/byte, next-byte accuracy {t_end.get('eval_acc', float('nan')):.3f}; "
      f"{tokens / 1e6:.0f} M tokens x (6 N + 12 L T E) = {flops / 1e15:.1f} PFLOP, "
      f"{flops / tl['seconds'] / 1e12:.0f} TFLOP/s over the whole stage (compile included)",
      f"- drafter: {dl['config']}, {d_end['step']} steps in {dl['seconds']:.0f} s on "
      f"{dl['sequences']} distilled sequences ({dl['loss_tokens'] / 1e6:.2f} M loss tokens), "
      f"held-out loss {d_end.get('eval_loss', float('nan')):.3f}, accepted drafts per block "
      f"{d_end.get('eval_accept', float('nan')):.2f}",
      "- stage wall times (compiles included): " + ", ".join(
          f"{k} {v:.0f} s" for k, v in times.items()),
      "", table.strip(), "", "![loss curves](loss_curves.png)"]
  text = "\n".join(lines) + "\n"
  with open(os.path.join(out, "demo.md"), "w") as f:
    f.write(text)
  return text


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.train_demo", description=__doc__.split(
      "\n\n")[0])
  p.add_argument("stage", choices=("target", "drafter", "eval", "drafter+eval", "all"))
  p.add_argument("--work", required=True,
                 help="folder for the target and drafter (W/target, W/drafter)")
  p.add_argument("--target", default=None, help="the target's folder (default W/target)")
  p.add_argument("--drafter", default=None, help="the drafter's folder (default W/drafter)")
  p.add_argument("--out", default=None, help="folder for eval.md, loss_curves.png, demo.md")
  p.add_argument("--smoke", action="store_true", help="tiny dims (CPU): keeps the script alive")
  p.add_argument("--seed", default="0")
  args = p.parse_args(argv)
  stages = {"all": ("target", "drafter", "eval"), "drafter+eval": ("drafter", "eval")}.get(
      args.stage, (args.stage,))
  if "eval" in stages and not args.out:
    p.error("eval needs --out")
  preset = SMOKE if args.smoke else GPU
  tdir = args.target or os.path.join(args.work, "target")
  ddir = args.drafter or os.path.join(args.work, "drafter")
  seed = ["--seed", args.seed]
  times = {}
  if "target" in stages:
    times["train-target"] = _run("train-target", ["train-target", "--out", tdir] + seed
                                 + preset["target"])
  if "drafter" in stages:
    times["train-drafter"] = _run("train-drafter", ["train-drafter", "--target", tdir, "--out",
                                                    ddir] + seed + preset["drafter"])
  if "eval" in stages:
    drafter = os.path.join(ddir, "drafter.gguf")
    times["eval"] = _run("eval", ["eval", "--target", tdir, "--drafter", drafter, "--out",
                                  args.out] + seed + preset["eval"])
    print("\n" + write_summary(tdir, ddir, args.out, times))
  return 0


if __name__ == "__main__":
  sys.exit(main())
