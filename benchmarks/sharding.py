"""The drafter's block step tensor-parallel over N GPUs against the one-GPU step.

  NCCL_NVLS_ENABLE=0 python -m benchmarks.sharding --gpu [--tp 2] [--out results/NAME]
  NCCL_NVLS_ENABLE=0 python -m benchmarks.sharding --smoke   # CPU, 2 forced host devices, tiny
                                                             # dims, seconds (CI): not results

NVLink multicast stays off: the script exits before jax initializes unless the environment
has NCCL_NVLS_ENABLE=0 (NCCL's NVLS algorithms are the ones that use multicast), and says so
when it is set. Seed drafter dims (dflash_jax.SEED_CONFIG, vocab 8192), random bf16 device
weights (benchmarks.common.random_params, then sharding.shard_params), a full bf16 ring
(2048 slots, n_past 2100). Sections, in order (results are saved after each):
1. step: the unsharded step.block_step on one GPU (TP = 1), the sharded step on a mesh of
   one (the same arithmetic: its logits must equal TP = 1's bitwise), and the TP = N step:
   CUPTI device time per device (every device's kernels summed, over N), wall time per call
   (back to back, dispatch included), the all-reduce kernels (names holding nccl /
   all-reduce; two a layer: after the o and down projections) per device per layer, and
   TP = N / TP = 1 for both times ("tpn": the TP = N step, N = "tp"); the TP = N logits against TP = 1's (rounding: the psums
   add per-device partial sums) and their greedy drafts.
2. round: the draft round (encode + inject 16 rows + block step), ring donated and threaded
   through back-to-back calls: wall time per round at TP = 1 and TP = N.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time

SMOKE_DEVICES = 2
ALL_REDUCE_RE = re.compile(r"nccl|all[-_]?reduce", re.I)


def require_no_multicast() -> str:
  """NCCL_NVLS_ENABLE must be 0 before jax (and so XLA's NCCL) initializes."""
  value = os.environ.get("NCCL_NVLS_ENABLE")
  if value != "0":
    raise SystemExit(f"benchmarks.sharding: NCCL_NVLS_ENABLE is {value!r}; set "
                     "NCCL_NVLS_ENABLE=0 (NVLink multicast off) before running: multicast can "
                     "take a shared host's GPUs out of service")
  if "jax" in sys.modules:
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
      raise SystemExit("benchmarks.sharding: jax is already initialized; run this script as "
                       "its own process (python -m benchmarks.sharding)")
  msg = "NCCL_NVLS_ENABLE=0: XLA's NCCL collectives run without NVLink multicast"
  print(msg, flush=True)
  return msg


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  mode = p.add_mutually_exclusive_group(required=True)
  mode.add_argument("--gpu", action="store_true", help="seed dims on the GPUs")
  mode.add_argument("--smoke", action="store_true",
                    help=f"tiny dims on {SMOKE_DEVICES} forced CPU devices (not results)")
  p.add_argument("--tp", type=int, default=2, help="GPUs of the tensor-parallel step")
  p.add_argument("--iters", type=int, default=None, help="timed calls (default 50; smoke 2)")
  p.add_argument("--impl", default=None, help="drafter kernels (default pallas; smoke xla)")
  p.add_argument("--out", default=None, help="results folder (default results/sharding-<stamp>)")
  args = p.parse_args(argv)
  nvls = require_no_multicast()
  if args.smoke:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={SMOKE_DEVICES}")
    args.tp = min(args.tp, SMOKE_DEVICES)
  return run(args, nvls)


def run(args, nvls: str) -> int:
  import dataclasses

  import jax
  import jax.numpy as jnp
  import numpy as np

  import dflash_jax as dfj
  from benchmarks import common as C
  from dflash_jax import sharding as SH
  from dflash_jax.drafter import step as S

  if args.gpu and not C.ON_GPU:
    raise SystemExit("--gpu needs a CUDA backend")
  if len(jax.devices()) < args.tp:
    raise SystemExit(f"--tp {args.tp} needs {args.tp} devices; jax sees {len(jax.devices())}")
  iters = args.iters or (2 if args.smoke else 50)
  impl = args.impl or ("xla" if args.smoke else "pallas")
  if args.smoke:
    cfg, n_vocab, window, n_past = dataclasses.replace(dfj.TINY_CONFIG, window=64), 512, 64, 70
  else:
    cfg, n_vocab, window, n_past = dfj.SEED_CONFIG, 8192, 2048, 2100
  out_dir = args.out or os.path.join(
      "results", "sharding-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
  os.makedirs(out_dir, exist_ok=True)
  res: dict = dict(
      smoke=bool(args.smoke), command="python -m benchmarks.sharding " + " ".join(sys.argv[1:]),
      device=str(jax.devices()[0].device_kind), n_devices=len(jax.devices()), tp=args.tp,
      impl=impl, nvls=nvls, env={k: os.environ.get(k) for k in (
          "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS", "XLA_FLAGS")},
      cfg=dataclasses.asdict(cfg), n_vocab=n_vocab, weights="bf16", ring="bf16",
      window=window, n_past=n_past)

  def save(section):
    C.save_results(out_dir, "sharding", res)
    print(f"{section}: {json.dumps(res.get(section), default=str)}", flush=True)

  # At tiny dims host weights are quicker than compiling a device RNG per tensor shape.
  params = (dfj.prepare_weights(cfg, dfj.synthetic_drafter(cfg, n_vocab=n_vocab), "bf16")
            if args.smoke else C.random_params(cfg, n_vocab, "bf16"))
  ring = C.filled_state(cfg, "bf16", n_past, window)
  one = SH.make_plan(devices=jax.devices()[:1])
  tpn = SH.make_plan(tp=args.tp)
  p_one, p_tp = SH.shard_params(params, one), SH.shard_params(params, tpn)
  r_one, r_tp = SH.shard_ring(ring, one), SH.shard_ring(ring, tpn)
  id_last, n_past_a = jnp.int32(1), jnp.int32(n_past)

  def timed(f, *a, n_dev: int):
    per = _kernel_times(C, f, *a, iterations=iters)
    n_dev = n_dev if C.ON_GPU else 1   # CPU: one wall-clock entry per call, all devices
    total = sum(ms for _, ms in per) / iters / n_dev
    ar = [(k, ms) for k, ms in per if ALL_REDUCE_RE.search(k)]
    return dict(device_ms=total, wall_ms=C.wall_ms(f, *a, iterations=iters, trials=3),
                all_reduce_ms=sum(ms for _, ms in ar) / iters / n_dev,
                all_reduce_launches=len(ar) / iters / n_dev,
                kernels=len(per) / iters / n_dev)

  def step1(p, r):
    return S.block_step_jit(p, r, id_last, n_past_a, impl=impl)

  def step_mesh(plan):
    def f(p, r):
      return SH.block_step_jit(plan, p, r, id_last, n_past_a, impl=impl)
    return f

  t0 = time.perf_counter()
  logits1 = np.asarray(step1(params, ring))
  logits_one = np.asarray(step_mesh(one)(p_one, r_one))
  logits_tp = np.asarray(step_mesh(tpn)(p_tp, r_tp))
  compile_s = time.perf_counter() - t0
  tp1 = timed(step1, params, ring, n_dev=1)
  mesh1 = timed(step_mesh(one), p_one, r_one, n_dev=1)
  tp = timed(step_mesh(tpn), p_tp, r_tp, n_dev=args.tp)
  tp["all_reduce_ms_per_layer"] = tp["all_reduce_ms"] / cfg.n_layer
  gap = np.sort(logits1[1:], axis=-1)
  clear = (gap[:, -1] - gap[:, -2]) > 0.1
  d1, dtp = logits1[1:].argmax(-1), logits_tp[1:].argmax(-1)
  res["step"] = dict(
      compile_s=compile_s, tp1=tp1, mesh_of_one=mesh1, tpn=tp,
      device_ratio=tp["device_ms"] / tp1["device_ms"], wall_ratio=tp["wall_ms"] / tp1["wall_ms"],
      mesh_of_one_bitwise=bool(np.array_equal(logits_one, logits1)),
      max_abs_logit_diff=float(np.abs(logits_tp - logits1).max()),
      drafts_equal_on_clear_rows=bool((d1 == dtp)[clear].all()), clear_rows=int(clear.sum()))
  save("step")

  new = jnp.asarray(dfj.synthetic_features(cfg, cfg.block_size, seed=3))

  def round_wall(f, p, r):
    r = jax.tree.map(jnp.copy, r)
    r, _, logits = f(p, r)   # compile
    jax.block_until_ready(logits)
    t = time.perf_counter()
    for _ in range(iters):
      r, _, logits = f(p, r)
    jax.block_until_ready(logits)
    return (time.perf_counter() - t) / iters * 1e3

  args_round = (new, cfg.block_size, id_last, n_past_a)
  w1 = round_wall(lambda p, r: S.draft_round_jit(p, r, *args_round, impl=impl), params, ring)
  wn = round_wall(lambda p, r: SH.draft_round_jit(tpn, p, r, *args_round, impl=impl), p_tp,
                  r_tp)
  res["round"] = dict(tp1_wall_ms=w1, tpn_wall_ms=wn, wall_ratio=wn / w1)
  save("round")
  print(f"TP={args.tp} step {tp['device_ms']:.3f} ms device / {tp['wall_ms']:.3f} ms wall vs "
        f"TP=1 {tp1['device_ms']:.3f} / {tp1['wall_ms']:.3f} "
        f"(x{res['step']['device_ratio']:.2f} device, x{res['step']['wall_ratio']:.2f} wall); "
        f"all-reduce {tp['all_reduce_ms_per_layer'] * 1e3:.1f} us/layer "
        f"({tp['all_reduce_launches']:.0f} launches/step); results in {out_dir}", flush=True)
  return 0


def _kernel_times(C, f, *args, iterations: int) -> list[tuple[str, float]]:
  """(kernel, ms) of every kernel that `iterations` calls ran, on every device (CUPTI records
  the whole process; kernels of different devices interleave, so nothing assumes an order).
  On CPU: one 'cpu_wall' entry per call (smoke runs exercise the code, their numbers are not
  results)."""
  import jax
  if not C.ON_GPU:
    return [k for it in C.cupti_kernels(f, *args, iterations=iterations) for k in it]
  from jax._src.lib import mosaic_gpu
  ext = mosaic_gpu._mosaic_gpu_ext
  jax.block_until_ready(f(*args))
  ext._cupti_init()
  try:
    outs = [f(*args) for _ in range(iterations)]
    jax.block_until_ready(outs)
  finally:
    timings = ext._cupti_get_timings(True)
  return list(timings)


if __name__ == "__main__":
  sys.exit(main())
