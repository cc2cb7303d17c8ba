"""The benchmark scripts stay alive: a CPU smoke run at tiny dims (its numbers are not results)."""
import json

import jax
import jax.numpy as jnp
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
  """benchmarks.targets at tiny dims: the MoE model through every section (needs decode.py on
  the Target protocol). One model: the sections run the same code for both (the MoE adds the
  experts-touched row); Muse-Glimmer's target is tested in tests/test_target_muse.py and its
  decoding loop in tests/test_target_loop.py."""
  from benchmarks import targets
  assert targets.main(["--smoke", "--models", "moe", "--out", str(tmp_path)]) == 0
  res = json.loads((tmp_path / "targets.json").read_text())
  assert res["smoke"] and res["copy_bw_TBps"] > 0
  assert abs(sum(res["replay_a"] ** i for i in range(1, 16)) - 2.8) < 1e-6
  assert set(res["models"]) == {"moe"}
  assert set(targets.setups(True)) == {"glimmer", "moe"}
  r = res["models"]["moe"]
  assert r["bytes"]["decode1_floor_ms"] > 0 and r["bytes"]["target_GB"] > 0
  t = r["target"]
  for impl in ("xla", "pallas"):
    assert t[f"decode1_{impl}_ms"] > 0 and t[f"verify16_{impl}_floor_fraction"] > 0
    ks = t[f"decode1_{impl}_kernels"]
    assert ks["launches"] > 0 and ks["kernels"] and ks["kernels"][0][2] > 0
  assert r["draft"]["draft_ms"] > 0 and r["draft"]["round_ms"] > r["draft"]["draft_ms"]
  assert r["target_only"]["tokens_per_s"] > 0
  (o,) = r["oracle"]
  assert o["k"] == 3 and o["tokens"] == 24 and "_tokens" not in o
  (p,) = r["replay"]
  assert p["k"] == 4 and sum(p["hist"]) > 0 and p["speedup"] > 0
  e = t["verify16_experts_touched"]
  assert len(e["per_layer"]) == 2 and 2 <= e["min"] <= e["max"] <= 8
  md = (tmp_path / "targets.md").read_text()
  assert md.startswith("- device:") and "- decode1 pallas: " in md


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


def test_compile_cache_benchmark_smoke_run(tmp_path):
  """benchmarks.compile_cache at tiny dims: two `generate` processes on one cache folder; the
  second reads every program the warm-up needs from it, and the split is reported."""
  from benchmarks import compile_cache
  out = tmp_path / "cc.json"
  assert compile_cache.main(["--smoke", "--folder", str(tmp_path / "w"), "--out", str(out)]) == 0
  first, second = json.loads(out.read_text())["runs"]
  # The first run traces and compiles the loop's programs; the second loads them as kept
  # (io.programs), and whatever else it compiles comes from JAX's cache.
  assert set(first["traced"]) >= compile_cache.LOOP_PROGRAMS
  assert not set(second["traced"]) & compile_cache.LOOP_PROGRAMS, second["traced"]
  assert first["programs"] > second["programs"] and first["cache_hits"] == 0
  assert second["programs"] == second["cache_hits"]
  assert [k.split("-")[0] for k in second["kept"]] == ["rounds", "start"], second["kept"]
  assert first["trace_s"] > 0 and second["warnings"] == []
  for r in (first, second):
    assert r["trace_s"] + r["lower_s"] + r["backend_s"] <= r["compile_s"] + 0.05


def test_gdn_benchmark_smoke_bytes_round(tmp_path):
  """benchmarks.gdn at tiny dims: the byte floors and the round pieces of both rollbacks
  (`--only round` counts the bytes too: its fractions need the floor)."""
  from benchmarks import gdn
  assert gdn.main(["--smoke", "--only", "round", "--out", str(tmp_path)]) == 0
  res = json.loads((tmp_path / "gdn.json").read_text())
  b, r = res["bytes"], res["round"]
  assert res["smoke"] and res["copy_bw_TBps"] > 0 and b["step_floor_ms"] > 0
  assert b["pending_snapshot_MB_per_slot"] > b["pending_replay_MB_per_slot"] > 0
  for rb in ("replay", "snapshot"):
    for key in (f"decode1_{rb}", "verify8_commit_" + rb, f"commit_{rb}",
                f"decode1_floor_fraction_{rb}", f"verify8_over_decode1_{rb}"):
      assert r[key] > 0, key
  assert (tmp_path / "gdn.md").read_text().startswith("- device:")


def test_gdn_benchmark_smoke_decode(tmp_path):
  """benchmarks.gdn's loop sections (target-only, oracle) at tiny dims; they run the decode
  loop through the Target protocol."""
  from benchmarks import gdn
  assert gdn.main(["--smoke", "--only", "target_only,oracle", "--out", str(tmp_path)]) == 0
  res = json.loads((tmp_path / "gdn.json").read_text())
  assert res["target_only"]["tokens_per_s"] > 0
  (o,) = res["oracle"]
  assert o["k"] == 3 and sum(o["hist"]) == o["rounds"] and o["tokens"] == 24


def test_families_benchmark_smoke_run(tmp_path):
  """benchmarks.families at tiny dims: both pairs through every section."""
  from benchmarks import families
  assert families.main(["--smoke", "--out", str(tmp_path)]) == 0
  res = json.loads((tmp_path / "families.json").read_text())
  assert res["smoke"] and res["copy_bw_TBps"] > 0
  assert [p["pair"] for p in res["pairs"]] == ["tiny-dflash2", "tiny-dspark-b7"]
  for p in res["pairs"]:
    b, e = p["base"], p["ext"]
    assert (b["config"], e["config"]) == ("dflash", p["family"])
    for r in (b, e):
      assert r["step_device_ms"] > 0 and r["round_device_ms"] > 0 and r["readout_device_us"] > 0
    assert p["step_ratio"] > 0 and p["round_ratio"] > 0
  d2, ds = res["pairs"]
  # DFlash2's step reads its convolutions on top of DFlash's; DSpark's block step is DFlash's.
  assert d2["step_floor_ratio"] > 1 and d2["ext"]["step_bytes"] > d2["base"]["step_bytes"]
  assert ds["step_floor_ratio"] == 1 and ds["ext"]["readout_bytes"] > 0
  assert (tmp_path / "families.md").read_text().startswith("- device:")


def test_decode_benchmark_smoke_run_for_a_family(tmp_path):
  """benchmarks.decode --family at tiny dims: the round's pieces and oracle rows with and
  without the cut (every oracle draft is right, so the cut only lowers tau). DSpark, whose
  shifted block widens the round by one (the default DFlash runs in tests/test_decode.py's
  smoke; DFlash2's drafter is DFlash's with its fields, its loop tested in
  tests/test_family_decode.py)."""
  from benchmarks import decode
  family = "dspark"
  assert decode.setup(True, "dflash2").drafter.family == "dflash2"
  assert decode.main(["--smoke", "--family", family, "--cuts", "0.5",
                      "--out", str(tmp_path)]) == 0
  res = json.loads((tmp_path / "decode.json").read_text())
  assert res["setup"]["drafter"]["family"] == family
  r = res["round_ms"]
  assert r["draft_full_vocab"] > 0 and "draft_reduced_vocab" not in r
  assert r["block_width"] == res["setup"]["drafter"]["block_size"] + (family == "dspark")
  plain, cut = res["oracle"]
  assert (plain["cut"], cut["cut"]) == (0.0, 0.5) and plain["k"] == cut["k"] == 3
  assert plain["tau"] == 4.0 and 1.0 <= cut["tau"] <= plain["tau"]
  assert plain["oracle_fixed_point"] and cut["matches_target_only"] == plain["matches_target_only"]


def test_decode_benchmark_target_sections_smoke(tmp_path):
  """benchmarks.decode's target sections at tiny dims: the three target variants with their
  byte floors, the long-context rows (attention share, chunk A/B) and the batched end-to-end
  rows (target-only and the oracle at each S). Not the launches section: CUPTI counts them
  (none on a CPU), and its one call, `common.target_layer_launches`, runs in the GPU tests
  (tests/test_target_invariance.py) at the 8B and 30B shapes."""
  from benchmarks import decode
  assert decode.main(["--smoke", "--only", "target,long,batched", "--slots", "2",
                      "--ks", "3", "--live", "64", "--chunks", "32", "--out",
                      str(tmp_path)]) == 0
  res = json.loads((tmp_path / "decode.json").read_text())
  t = res["target"]
  assert set(decode.VARIANTS) <= set(t) and t["live_slots"] > 0
  for name in decode.VARIANTS:
    for p in ("decode1", "verify16"):
      assert t[name][p]["ms"] > 0 and 0 < t[name][p]["floor_fraction"], (name, p)
      assert t[name][p]["wall_ms"] > 0, (name, p)
  assert {"invariance_cost_decode1", "speedup_over_xla_verify16"} <= set(t)
  rows = {(r["pass_"], r["impl"], r.get("chunk")) for r in res["long"]}
  assert rows == {("decode1", "pallas", 512), ("verify16", "pallas", 512),
                  ("decode1", "xla", None), ("decode1", "pallas", 32), ("verify16", "pallas", 32)}
  assert all(r["live"] == 64 and r["ms"] > 0 for r in res["long"])
  [b] = res["batched"]
  [o] = b["speculative"]
  assert b["slots"] == 2 and b["target_only_tokens_per_s"] > 0
  assert o["k"] == 3 and o["tokens"] == 2 * 12 and o["oracle_fixed_point"]
  assert (tmp_path / "decode.md").read_text().startswith("- device:")


def test_train_families_benchmark_smoke_run(tmp_path):
  """benchmarks.train_families at tiny dims: a target, one family (DSpark: the one with every
  kind of row, its Markov-head ablation and its confidence cut) trained on the distilled data,
  the exact evaluator (greedy: every output equals target-only's) and the compiled loop's rows,
  the loss curves. The stages loop over families with the same code; each family's training,
  export and lossless loop are tested in tests/test_train_families.py and
  tests/test_family_decode.py."""
  from benchmarks import train_families
  work, out = tmp_path / "w", tmp_path / "o"
  assert train_families.main(["all", "--smoke", "--families", "dspark", "--work", str(work),
                              "--out", str(out)]) == 0
  res = json.loads((out / "families.json").read_text())
  ref = {(r["method"], r["temperature"]) for r in res["reference"]}
  assert ref == {("dspark", 0), ("dspark", 1), ("dspark, confidence cut 0.5", 0),
                 ("dspark, confidence cut 0.5", 1),
                 ("dspark without the Markov head (backbone argmax)", 0)}
  for r in res["reference"]:
    assert sum(r["hist"]) == r["rounds"] > 0 and len(r["hist"]) == 8
    if r["temperature"] == 0:
      assert r["same_as_target"] == r["n_prompts"], r
  assert [r["method"].split(" (")[0] for r in res["compiled"]] == [
      "target only", "dspark", "prompt lookup"]
  assert res["compiled"][1]["same_as_target"] == res["compiled"][1]["n_prompts"]   # lossless
  assert [(r["method"].split(" (")[0], r["temperature"]) for r in res["compiled_t1"]] == [
      ("dspark", 1), ("prompt lookup", 1),
      ("dspark, confidence cut 0.5", 0), ("dspark, confidence cut 0.5", 1)]
  cut = res["compiled_t1"][2]
  assert cut["same_as_target"] == 2 and sum(cut["hist"]) > 0
  assert set(res["sizes"]) == {"dspark"}
  assert (work / "dspark" / "weights.npz").exists() and res["sizes"]["dspark"]["steps"] == 6
  assert res["sizes"]["dspark"]["exports"] == {"gguf": "ok", "hf": "ok"}
  assert (out / "loss_curves.png").stat().st_size > 1000
  assert train_families.main(["export", "--smoke", "--work", str(work), "--families",
                              "dspark"]) == 0
  log = json.loads((work / "dspark" / "train_log.json").read_text())
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
  assert res["kernels"]["device_ms"] > 0 and res["kernels"]["top"]
  assert (tmp_path / "train_throughput.md").read_text().startswith("- device:")


def test_train_throughput_batch_fits_the_device():
  """The default batch per device: 4 on a 141 GB H200, 2 on an 80 GB H100 (whose 4-sequence
  step ran out of memory), 2 in smoke runs and where the device reports no limit."""
  from benchmarks.train_throughput import default_batch
  assert default_batch(False, int(0.95 * 143.8e9)) == 4
  assert default_batch(False, int(0.95 * 85.5e9)) == 2
  assert default_batch(False, None) == 2
  assert default_batch(True, int(143.8e9)) == 2


def test_train_throughput_kernel_split():
  """GEMM kernels (XLA's Triton GEMM fusions, cuBLAS) against the rest, iteration medians,
  the top kernels with their launches summed."""
  from benchmarks.train_throughput import kernel_split
  it = lambda s: [("gemm_fusion_dot_1", 4.0 * s), ("loop_add_fusion", 1.0),
                  ("nvjet_tst_128x64", 2.0 * s), ("loop_add_fusion", 0.5), ("input_reduce", 0.5)]
  r = kernel_split([it(1.0), it(2.0), it(1.5)], model_flops_total=9e12, top=2)
  assert r["launches"] == 5 and r["gemm_launches"] == 2
  assert r["gemm_ms"] == 9.0 and r["device_ms"] == 11.0 and r["other_ms"] == 2.0
  assert r["gemm_tflops_per_s"] == pytest.approx(1000.0)   # 9 TFLOP in 9 ms
  assert r["top"] == [dict(kernel="gemm_fusion_dot_1", launches=1, ms=6.0),
                      dict(kernel="nvjet_tst_128x64", launches=1, ms=3.0)]
  r = kernel_split([[("loop_add_fusion", 1.0), ("loop_add_fusion", 2.0)]], 1e12, top=5)
  assert r["gemm_ms"] == 0 and r["gemm_tflops_per_s"] is None
  assert r["top"] == [dict(kernel="loop_add_fusion", launches=2, ms=3.0)]


def test_exclusive_kernel_times_count_an_overlap_once():
  """benchmarks.common's kernel times: each kernel's part of the timeline that no earlier
  kernel covers (a kernel launched early by programmatic dependent launch waits inside its
  own interval), so the times sum to the busy time; idle gaps count for nobody."""
  from benchmarks.common import exclusive_ms
  ev = [("a", 0, 10_000), ("b", 2_000, 12_000), ("c", 3_000, 9_000), ("d", 15_000, 16_500)]
  got = exclusive_ms(ev)
  assert [k for k, _ in got] == ["a", "b", "c", "d"]
  assert [round(ms, 6) for _, ms in got] == [0.01, 0.002, 0.0, 0.0015]
  assert exclusive_ms([]) == []


def test_device_kernel_events_keep_gpu_stream_kernels():
  """benchmarks.common.device_kernel_events on a profile's planes: only GPU planes' stream
  lines, sorted by start, the driver's Memcpy / Memset records dropped (a memcpy kernel
  stays a kernel)."""
  from types import SimpleNamespace as NS
  from benchmarks.common import device_kernel_events
  ev = lambda n, s, e: NS(name=n, start_ns=s, end_ns=e)
  profile = NS(planes=[
      NS(name="/host:CPU", lines=[NS(name="python", events=[ev("x", 0, 1)])]),
      NS(name="/device:GPU:0", lines=[
          NS(name="Stream #13(Compute)", events=[ev("k2", 50, 60), ev("MemcpyD2D", 5, 9),
                                                 ev("k1", 10, 40), ev("memcpy128", 70, 71)]),
          NS(name="XLA Ops", events=[ev("fusion.1", 10, 40)]),
          NS(name="Stream #14(MemcpyD2H)", events=[ev("Memset", 1, 2)])]),
      NS(name="/device:GPU:1", lines=[NS(name="Stream #7", events=[])])])
  assert device_kernel_events(profile) == {
      "/device:GPU:0": [("k1", 10, 40), ("k2", 50, 60), ("memcpy128", 70, 71)]}


def test_sweep_top_k_rows_check_the_answer():
  """benchmarks.sweep topk: one row for lax.top_k, one for the kernel's defaults and one per
  knob point (blocks wider than the vocabulary's power of 2 left out), each checked against
  lax.top_k (err 0)."""
  from benchmarks import sweep
  rows = sweep.sweep_top_k((300,), blocks=(128, 512, 1024), warps=(1,), merge_warps=(1,),
                           k=4, rows=3)
  assert [r["kernel"] for r in rows] == ["xla_top_k"] + ["pallas_top_k"] * 3
  assert [r.get("block_v") for r in rows[2:]] == [128, 512]
  assert rows[1]["default"] and not rows[2]["default"]
  assert all(r["err"] in (0, None) for r in rows[:1]) and all(r["err"] == 0 for r in rows[1:])


def test_sweep_times_a_gemm_over_cold_copies():
  """benchmarks.sweep's GEMM timing: a matrix smaller than the bytes a call must stream runs
  on as many copies as reach them (one product each), and a time per product comes back."""
  from benchmarks import sweep
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)), jnp.float32)
  w = jnp.asarray(np.random.default_rng(1).standard_normal((32, 64)), jnp.bfloat16)
  seen = []

  def f(x, w):
    seen.append(w)   # traced once: one entry per copy
    return sweep._xla_dot_bf16(x, w)

  us, err = sweep._time_cold(f, x, w, None, cold_bytes=3 * w.nbytes - 1)
  assert err is None and us > 0 and len(seen) == 3


def test_sweep_moe_rows_check_the_answer():
  """benchmarks.sweep moe at tiny expert dims: the default knobs and each grid point, for the
  gate+up and the routed down projection at a decode's and a verify's rows, each row checked
  against the kernel's twin (err within bf16 rounding) and timed (CPU wall time here)."""
  from benchmarks import sweep
  dims = dict(hidden=64, ffn=32, experts=8, top_k=2)
  rows = sweep.sweep_moe((1, 16), dims=dims, block_ns=(16,), block_ks=(32,), stages=(2,),
                         iters=1)
  for m in (1, 16):
    for gate_up in (True, False):
      mine = [r for r in rows if r["m"] == m and r["gate_up"] == gate_up]
      assert sum(r["default"] for r in mine) == 1 and len(mine) == 2, mine
      for r in mine:
        assert r["us"] > 0 and isinstance(r["err"], float) and r["err"] < 0.05, r
      # a decode touches its row's 2 experts; 16 rows most of the 8
      assert (mine[0]["experts_touched"] == 2 if m == 1 else 4 < mine[0]["experts_touched"] <= 8)


@pytest.mark.skipif(jax.default_backend() == "gpu",
                    reason="on a GPU the two programs run at once and both pass")
def test_sweep_gridbar_counts_and_gives_up_instead_of_hanging():
  """benchmarks.sweep gridbar on the CPU (interpret mode runs programs one after another): one
  program passes every barrier (the counter ends at barriers x programs); with two, the first
  program polls for a second that has not run yet and gives up after max_polls (the row says
  not ok) instead of hanging."""
  from benchmarks import sweep
  rows = sweep.sweep_gridbar(programs=(1,), barriers=(0, 3), iters=1)
  bars = [r for r in rows if r["kernel"] == "gridbar"]
  assert [(r["barriers"], r["ok"], r["counter"]) for r in bars] == [(0, True, 0.0),
                                                                     (3, True, 3.0)]
  assert [r["kernel"] for r in rows].count("gridbar_slope") == 1
  (two,) = sweep.sweep_gridbar(programs=(2,), barriers=(1,), max_polls=4, iters=1)
  assert two["ok"] is False and two["counter"] == 2.0
