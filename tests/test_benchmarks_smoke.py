"""The benchmark scripts stay alive: a CPU smoke run at tiny dims (its numbers are not results)."""
import json

import numpy as np
import pytest

from benchmarks import run


def test_benchmark_smoke_run(tmp_path):
  # One case per path through the script, to bound CI time (every case runs the same
  # bench_case; the kernels' dtypes and shapes are tested in tests/test_step.py): quantized
  # weights on a sliding ring, and a case built by shape_variants, the mixed-kind drafter
  # with its full-attention cache (bf16).
  cases = "tiny wfp8,tiny-4s1f"
  assert run.main(["--smoke", "--iters", "2", "--cases", cases, "--out", str(tmp_path)]) == 0
  res = json.loads((tmp_path / "bench.json").read_text())
  assert res["smoke"] and res["copy_bw_TBps"] > 0
  assert [(r["case"].split()[0], r["dtype"], r["capacity"]) for r in res["steps"]] == [
      ("tiny", "fp8", None), ("tiny-4s1f-c128", "bf16", 128)]
  assert {c.name.split()[0] for c in run.smoke_cases()} >= {
      "tiny-b10", "tiny-b7", "tiny-g3", "tiny-w48", "tiny-4s1f-c128"}
  for r in res["steps"]:
    assert r["step_device_ms"] > 0 and r["bytes"] > 0 and r["floor_fraction"] > 0
    # The Pallas step and both plain-XLA peers compute the same logits.
    assert r["pallas_vs_xla_max_abs_logit_diff"] < 2e-2, r["case"]
    assert r["pallas_vs_xla_peer_max_abs_logit_diff"] < 2e-2, r["case"]
    assert r["xla_peer_step_device_ms"] > 0 and r["xla_peer_kernels"], r["case"]
    assert min(r["launches"], r["xla_launches"], r["xla_peer_launches"],
               r["draft_round_launches"]) >= 1, r["case"]
  assert {"ring_attention_bf16", "inject16_fp32", "qk_norm_rope_parts4", "accept"} <= set(res["kernels"])
  qa = res["quant_accuracy"]
  for fmt in ("bf16", "fp8", "q8_0"):
    assert 0 < qa[fmt]["max_abs_err"] < 2.0 and qa[fmt]["agreement"] > 0.5, (fmt, qa[fmt])
  md = (tmp_path / "bench.md").read_text()
  assert md.startswith("- device:") and "| xla peer ms | ours/xla peer | xla peer launches |" in md
  assert (tmp_path / "phases.png").stat().st_size > 1000


def test_batch_benchmark_smoke_run(tmp_path):
  """benchmarks.batch at tiny dims: every section runs and records what the GPU run reports."""
  from benchmarks import batch
  assert batch.main(["--smoke", "--out", str(tmp_path)]) == 0
  res = json.loads((tmp_path / "batch.json").read_text())
  [ab] = res["batched_ab"]
  assert (ab["dtype"], ab["width"], ab["slots"]) == ("bf16", 4, 2)
  assert set(ab["ms"]) == {"off", "on"} and ab["drafts_agree"] == {"off": 1.0, "on": 1.0}
  assert res["smoke"] and res["rates"]["copy_Bps"] > 0 and res["rates"]["gemm_flops"] > 0
  [r] = res["rounds"]
  assert (r["slots"], r["width"], r["rows"]) == (2, 4, 8)
  assert r["round_ms"] > 0 and r["bytes"] > 0 and r["flops"] > 0 and r["roofline_fraction"] > 0
  assert r["drafted_tokens_per_s"] == pytest.approx(2 * 3 / (r["round_ms"] * 1e-3))
  c = res["compiles"]
  assert c["join"] >= 1 and c["leave"] >= 1 and c["compiles"] == 0, c
  m = res["memory"]
  assert m["ring_bytes"] == m["slots"] * m["ring_bytes_per_slot"]["bf16"] > 0
  x = res["crossover"]
  assert set(x["totals"]) == {"128"} and set(x["per_rows"]["128"]) == {"qkv", "gate_up"}
  assert (tmp_path / "batch.md").read_text().startswith("- device:")


def test_targets_benchmark_smoke_run(tmp_path):
  """benchmarks.targets at tiny dims: both models through every section (needs decode.py on
  the Target protocol)."""
  from benchmarks import targets
  assert targets.main(["--smoke", "--out", str(tmp_path)]) == 0
  res = json.loads((tmp_path / "targets.json").read_text())
  assert res["smoke"] and res["copy_bw_TBps"] > 0
  assert abs(sum(res["replay_a"] ** i for i in range(1, 16)) - 2.8) < 1e-6
  for name in ("glimmer", "moe"):
    r = res["models"][name]
    assert r["bytes"]["decode1_floor_ms"] > 0 and r["bytes"]["target_GB"] > 0
    t = r["target"]
    for impl in ("xla", "pallas"):
      assert t[f"decode1_{impl}_ms"] > 0 and t[f"verify16_{impl}_floor_fraction"] > 0
    assert r["draft"]["draft_ms"] > 0 and r["draft"]["round_ms"] > r["draft"]["draft_ms"]
    assert r["target_only"]["tokens_per_s"] > 0
    (o,) = r["oracle"]
    assert o["k"] == 3 and o["tokens"] == 24 and "_tokens" not in o
    (p,) = r["replay"]
    assert p["k"] == 4 and sum(p["hist"]) > 0 and p["speedup"] > 0
  e = res["models"]["moe"]["target"]["verify16_experts_touched"]
  assert len(e["per_layer"]) == 2 and 2 <= e["min"] <= e["max"] <= 8
  assert (tmp_path / "targets.md").read_text().startswith("- device:")


def test_load_target_benchmark_smoke_run(tmp_path):
  """benchmarks.load_target at tiny dims: writes a sharded bf16 folder, loads it in a fresh
  process, reports time and peak RSS (numbers are not results)."""
  from benchmarks import load_target
  out = tmp_path / "load.json"
  assert load_target.main(["--smoke", "--folder", str(tmp_path / "t"), "--repeat", "1",
                           "--out", str(out)]) == 0
  res = json.loads(out.read_text())
  assert res["smoke"] and res["shards"] > 1 and res["largest_shard"] < res["bytes"]
  (run,) = res["runs"]
  assert run["seconds"] > 0 and run["peak_rss"] >= run["rss_before"] > 0
  assert run["dtypes"] == ["bfloat16", "float32"] and run["param_bytes"] > 0


def test_train_families_benchmark_smoke_run(tmp_path):
  """benchmarks.train_families at tiny dims: a target, the three families trained on the same
  distilled data, the exact evaluator (greedy: every output equals target-only's) and the
  compiled loop's rows, the loss curves."""
  from benchmarks import train_families
  work, out = tmp_path / "w", tmp_path / "o"
  assert train_families.main(["all", "--smoke", "--work", str(work), "--out", str(out)]) == 0
  res = json.loads((out / "families.json").read_text())
  ref = {(r["method"], r["temperature"]) for r in res["reference"]}
  assert ref == {("dflash", 0), ("dflash", 1), ("dflash2", 0), ("dflash2", 1), ("dspark", 0),
                 ("dspark", 1), ("dspark, confidence cut 0.5", 0),
                 ("dspark, confidence cut 0.5", 1),
                 ("dflash2 without the selector (row argmax)", 0),
                 ("dspark without the Markov head (backbone argmax)", 0)}
  for r in res["reference"]:
    assert sum(r["hist"]) == r["rounds"] > 0 and len(r["hist"]) == 8
    if r["temperature"] == 0:
      assert r["same_as_target"] == r["n_prompts"], r
  assert [r["method"].split(" (")[0] for r in res["compiled"]] == [
      "target only", "dflash", "prompt lookup"]
  assert [r["method"].split(" (")[0] for r in res["compiled_t1"]] == ["dflash", "prompt lookup"]
  for fam in ("dflash", "dflash2", "dspark"):
    assert (work / fam / "weights.npz").exists() and res["sizes"][fam]["steps"] == 6
  assert res["sizes"]["dflash"]["exports"] == {"gguf": "ok", "hf": "ok"}
  assert (out / "loss_curves.png").stat().st_size > 1000
  assert train_families.main(["export", "--smoke", "--work", str(work), "--families",
                              "dflash"]) == 0
  log = json.loads((work / "dflash" / "train_log.json").read_text())
  assert log["exports"] == {"gguf": "ok", "hf": "ok"}


@pytest.mark.parametrize("case,family", [("qwen3-8b", "dspark"), ("seed", "dflash2")])
def test_train_throughput_benchmark_smoke_on_2_host_devices(case, family, tmp_path):
  """benchmarks.train_throughput at tiny dims, dp = 2 over forced host devices: every section
  runs (online target features for the qwen3-8b case, given ones for the seed case)."""
  import os
  import subprocess
  import sys
  env = dict(os.environ, JAX_PLATFORMS="cpu", NCCL_NVLS_ENABLE="0")
  r = subprocess.run([sys.executable, "-m", "benchmarks.train_throughput", "--smoke", "--case",
                      case, "--family", family, "--out", str(tmp_path)], env=env,
                     cwd=os.getcwd(), capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
  res = json.loads((tmp_path / "train_throughput.json").read_text())
  assert res["smoke"] and res["dp"] == 2 and res["family"] == family
  t = res["step_ms"]
  assert (t["target_forward"] is None) == (case == "seed")
  assert t["whole_step_features"] == ("given" if case == "seed" else "online")
  for k in ("drafter_forward", "drafter_forward_backward", "optimizer", "whole_step"):
    assert t[k] > 0, k
  assert res["flops"]["model"]["total"] > 0 and res["flops"]["xla_drafter_forward_backward"] > 0
  assert res["throughput"]["drafter_fraction_of_dense_bf16_peak"] > 0
  assert res["memory"]["params_bytes"] > 0 and np.isfinite(res["loss"])
  assert (tmp_path / "train_throughput.md").read_text().startswith("- device:")
