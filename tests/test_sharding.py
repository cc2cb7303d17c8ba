"""The sharded drafter, target and decode rounds (dflash_jax.sharding).

The multi-device cases (tests/sharding_cases.py) need 8 devices, which XLA's CPU backend
only makes before jax initializes: they run in a subprocess with
--xla_force_host_platform_device_count=8, so the rest of the suite keeps seeing one device.
That subprocess (and the benchmark's smoke run) inherits conftest.py's XLA flags (LLVM
optimization level 0 on CPU). On the GPU: the sharded code on a mesh of one (the one H200) is the unsharded code.
"""
import dataclasses
import functools
import json
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from dflash_jax import sharding as SH
from dflash_jax.drafter import step as S
from dflash_jax.config import FULL, SLIDING
from dflash_jax.models import qwen3 as Q

def _cpu_env(**extra):
  return dict(os.environ, JAX_PLATFORMS="cpu", **extra)


def test_sharded_cases_on_8_host_devices():
  env = _cpu_env()
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                      "tests/sharding_cases.py"], env=env, cwd=os.getcwd(), capture_output=True,
                     text=True, timeout=900)
  out = r.stdout + r.stderr
  assert r.returncode == 0, out[-6000:]
  summary = out.strip().splitlines()[-1]
  assert "passed" in summary and "skipped" not in summary and "deselected" not in summary, out


def test_benchmark_smoke_on_2_host_devices(tmp_path):
  r = subprocess.run([sys.executable, "-m", "benchmarks.sharding", "--smoke", "--out",
                      str(tmp_path)], env=_cpu_env(NCCL_NVLS_ENABLE="0"), cwd=os.getcwd(),
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
  assert "NCCL_NVLS_ENABLE=0: XLA's NCCL collectives run without NVLink multicast" in r.stdout
  res = json.loads((tmp_path / "sharding.json").read_text())
  st = res["step"]
  assert res["smoke"] and res["tp"] == 2 and res["env"]["NCCL_NVLS_ENABLE"] == "0"
  assert st["mesh_of_one_bitwise"] and st["drafts_equal_on_clear_rows"] and st["clear_rows"] > 0
  assert 0 <= st["max_abs_logit_diff"] < 2e-2
  for k in ("tp1", "mesh_of_one", "tpn"):
    assert st[k]["device_ms"] > 0 and st[k]["wall_ms"] > 0
  assert res["round"]["tp1_wall_ms"] > 0 and res["round"]["tpn_wall_ms"] > 0


def test_benchmark_refuses_to_run_with_nvlink_multicast_possible(tmp_path):
  env = _cpu_env()
  env.pop("NCCL_NVLS_ENABLE", None)
  r = subprocess.run([sys.executable, "-m", "benchmarks.sharding", "--smoke", "--out",
                      str(tmp_path)], env=env, cwd=os.getcwd(), capture_output=True, text=True,
                     timeout=120)
  assert r.returncode != 0 and "NCCL_NVLS_ENABLE is None; set NCCL_NVLS_ENABLE=0" in r.stderr
  assert not (tmp_path / "sharding.json").exists()


# --- GPU: a mesh of one --------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("layer_types", [None, (SLIDING, FULL)])
def test_gpu_mesh_of_one_equals_unsharded(layer_types):
  """On the one GPU, the sharded draft round and block step (Pallas, bf16 weights and ring,
  seed dims, 2 layers) equal the unsharded ones bitwise (a psum over one device is no
  reduction), and the sharded round aliases the donated ring (no copy)."""
  from benchmarks import common as C
  cfg = dataclasses.replace(dfj.SEED_CONFIG, n_layer=2, layer_types=layer_types)
  params = C.random_params(cfg, 8192, "bf16")
  ring = C.filled_state(cfg, "bf16", 2100, 2048, capacity=4096 if layer_types else None)
  new = jnp.asarray(dfj.synthetic_features(cfg, cfg.block_size))
  args = (new, 5, 17, 2100)
  plan = SH.make_plan(devices=jax.devices()[:1])
  sp = SH.shard_params(params, plan)
  sr = SH.shard_ring(ring, plan)
  compiled = SH.draft_round_jit.lower(plan, sp, sr, *args).compile()
  assert compiled.memory_analysis().alias_size_in_bytes == C.tree_bytes(ring)
  got = jax.tree.map(np.asarray, SH.draft_round_jit(plan, sp, sr, *args))
  want = jax.tree.map(np.asarray, S.draft_round_jit(params, jax.tree.map(jnp.copy, ring), *args))
  chex.assert_trees_all_equal(got, want)
  ring_after = jax.tree.map(jnp.asarray, want[0])
  np.testing.assert_array_equal(
      np.asarray(SH.block_step_jit(plan, sp, SH.shard_ring(ring_after, plan), 3, 2100, width=7)),
      np.asarray(S.block_step_jit(params, ring_after, 3, 2100, width=7)))


@pytest.mark.gpu
def test_gpu_mesh_of_one_target_verify_equals_unsharded():
  """A Qwen3-shaped bf16 target (2 layers at Qwen3-8B widths, vocab 32768): the sharded
  verify on a mesh of one equals the unsharded one bitwise (skinny-GEMM path)."""
  cfg = Q.TargetConfig(vocab_size=32768, hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128)
  params = Q.init_params(cfg, jax.random.key(0), "bf16")
  tokens = jax.random.randint(jax.random.key(1), (1, 16), 0, cfg.vocab_size)
  cache = Q.init_cache(cfg, 1, 256, "bf16").replace(length=jnp.array([100], jnp.int32))
  plan = SH.make_plan(devices=jax.devices()[:1])
  st = SH.ShardedTarget(cfg, plan)
  got = jax.jit(functools.partial(st.verify, capture_layers=(1, 2), impl="pallas"))(
      SH.shard_target(params, cfg, plan), SH.shard_target_cache(cache, plan), tokens)
  want = Q.verify_jit(params, cfg, cache, tokens, capture_layers=(1, 2), impl="pallas")
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want))
