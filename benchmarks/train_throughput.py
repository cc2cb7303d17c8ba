"""Drafter training throughput at real shapes, data parallel over the `dp` mesh axis.

  NCCL_NVLS_ENABLE=0 python -m benchmarks.train_throughput --gpu [--case qwen3-8b|seed]
      [--family dflash|dflash2|dspark] [--dp N] [--batch 4] [--seq-len 2048] [--anchors 128]
      [--out results/NAME]
  NCCL_NVLS_ENABLE=0 python -m benchmarks.train_throughput --smoke --out DIR   # CPU, 2 forced
      # host devices, tiny dims, seconds (CI): not results

NVLink multicast stays off (`benchmarks.sharding.require_no_multicast`: the gradient
all-reduce over dp is NCCL's).

Cases. qwen3-8b: the Qwen3-8B-DFlash-b16 drafter shape (`QWEN3_8B_CONFIG`: 5 full-attention
layers, 4096 hidden, block 16; with --family dflash2 its DFlash2 form, K 2 G 16 R 256 k 16;
dspark: `DSPARK_QWEN3_8B_CONFIG`, block 7) against a random bf16 Qwen3-8B-shaped target (36
layers, 4096 hidden, vocab 151936) whose features are computed online in every step. seed:
the seed drafter (`SEED_CONFIG`, 5 sliding layers of 6656, block 16) with its features given
(random, as cached feature shards would be): no 6656-wide target is built here, so its split
has no target row; the tok_embd / LM head are a random 202048 x 6656 pair (Muse-Glimmer's
vocabulary).

Per device: --batch sequences of --seq-len tokens, --anchors anchors each (block rows =
batch x anchors x block). With N devices the batch axis is split over dp (every array of the
batch placed `P("dp")`, params and optimizer state replicated): jit's SPMD partitioner adds
the gradient all-reduce. bf16 compute, float32 masters and AdamW moments.

Sections (results saved after each): the step split, each phase its own jitted call timed by
wall clock around block_until_ready (median of --iters after one untimed call): target forward
(the features), drafter forward (loss), drafter forward + backward (value_and_grad given the
features), optimizer (clip + AdamW + apply, given gradients), and the whole donated online
step as training runs it; memory (the device's peak bytes in use after the step, and XLA's
compiled memory analysis of it: arguments, outputs, temporaries); FLOPs (XLA's cost analysis
of the target forward and the drafter's forward + backward, and the drafter's model FLOPs
counted here: 6 x trainable GEMM parameters per block row and per context row for the context
projections, the frozen LM head's forward and input gradient 4 E V per row, attention 12 x
(T + B) x n_head x head_dim per row and layer, as the explicit-mask forward computes it); and
throughput: target tokens/s, block rows/s, and the drafter's share of the dense bf16 peak
(--peak-tflops per device, default the H100/H200 SXM figure 989): its model FLOPs over the
forward + backward + optimizer time; kernels: where the drafter's forward + backward spends
its device time (CUPTI, after warm-up, median of 3 calls): GEMM kernels against the rest, the
model FLOPs over the GEMM kernels' time, and the kernels that take the most time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time

SMOKE_DEVICES = 2
DENSE_BF16_PEAK_TFLOPS = 989.0   # H100 / H200 SXM, dense (no sparsity)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.train_throughput",
                              description=__doc__.splitlines()[0])
  mode = p.add_mutually_exclusive_group(required=True)
  mode.add_argument("--gpu", action="store_true", help="real shapes on the GPUs")
  mode.add_argument("--smoke", action="store_true",
                    help=f"tiny dims on {SMOKE_DEVICES} forced CPU devices (not results)")
  p.add_argument("--case", choices=("qwen3-8b", "seed"), default="qwen3-8b")
  p.add_argument("--family", choices=("dflash", "dflash2", "dspark"), default="dflash")
  p.add_argument("--dp", type=int, default=None, help="devices on dp (default: all)")
  p.add_argument("--batch", type=int, default=None,
                 help="sequences per device (default: 4 where a device holds >= 100 GB, as "
                      "an H200; else 2, as an H100's 80 GB; smoke 2)")
  p.add_argument("--seq-len", type=int, default=None, help="default 2048")
  p.add_argument("--anchors", type=int, default=None, help="per sequence (default 128)")
  p.add_argument("--iters", type=int, default=None, help="timed calls (default 5; smoke 1)")
  p.add_argument("--peak-tflops", type=float, default=DENSE_BF16_PEAK_TFLOPS,
                 help="dense bf16 peak per device")
  p.add_argument("--out", default=None, help="results folder (default results/train-<stamp>)")
  args = p.parse_args(argv)
  args.command = "python -m benchmarks.train_throughput " + " ".join(
      sys.argv[1:] if argv is None else argv)
  from benchmarks.sharding import require_no_multicast
  args.nvls = require_no_multicast()
  if args.gpu:
    # JAX's default 75% share of an H100 leaves too little for the qwen3-8b case's
    # optimizer state beside its target.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  if args.smoke:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={SMOKE_DEVICES}")
  return run(args)


BIG_DEVICE_BYTES = 100e9


def default_batch(smoke: bool, device_bytes: int | None) -> int:
  """Sequences per device: 4 fits a 141 GB H200 at both cases, 2 an 80 GB H100 (the
  activations of 4 x 2048 tokens and 128 anchors do not fit beside the Qwen3-8B target and the
  float32 optimizer state there)."""
  if smoke:
    return 2
  return 4 if device_bytes is not None and device_bytes >= BIG_DEVICE_BYTES else 2


def _timed_chain(f, state, *a, iters: int):
  """Median wall ms of state = f(state, *a) with state donated (one untimed call first), so
  no second copy of the optimizer state is held; returns (ms, state)."""
  import jax
  state = f(state, *a)
  jax.block_until_ready(state)
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    state = f(state, *a)
    jax.block_until_ready(state)
    ts.append((time.perf_counter() - t0) * 1e3)
  return float(statistics.median(ts)), state


def _timed(f, *a, iters: int) -> float:
  """Median wall ms of f(*a) (one untimed call first: compiles). Each result is dropped before
  the next call (not chained as in `_timed_chain`): one gradient in memory at a time."""
  import jax
  jax.block_until_ready(f(*a))
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*a))
    ts.append((time.perf_counter() - t0) * 1e3)
  return float(statistics.median(ts))


_GEMM_KERNEL = re.compile(r"gemm|nvjet|xmma|cutlass|matmul|dot", re.IGNORECASE)


def kernel_split(per_iter, model_flops_total: float, top: int = 15) -> dict:
  """CUPTI kernels of one call (medians over iterations): GEMM kernels (by name: XLA's Triton
  and cuBLAS GEMMs) against the rest, the model FLOPs over the GEMM time, the `top` kernel
  names by time (their launches summed)."""
  from benchmarks import common as C
  by_name = C.kernels_by_name(C.kernel_medians(per_iter))
  gemm = [row for n, row in by_name.items() if _GEMM_KERNEL.search(n)]
  gemm_ms, total = sum(ms for _, ms in gemm), C.device_ms(per_iter)
  ranked = C.slowest_kernels(by_name, top)
  return dict(device_ms=total, launches=C.launches(per_iter), gemm_ms=gemm_ms,
              gemm_launches=int(sum(c for c, _ in gemm)), other_ms=total - gemm_ms,
              gemm_tflops_per_s=model_flops_total / (gemm_ms * 1e-3) / 1e12 if gemm_ms else None,
              top=[dict(kernel=n, launches=int(c), ms=t) for n, (c, t) in ranked])


def model_flops(cfg, n_vocab: int, s: int, t: int, a: int) -> dict:
  """The drafter's forward + backward FLOPs per step as counted here (module docstring)."""
  e, hd, hq, hkv = cfg.n_embd, cfg.head_dim, cfg.n_head, cfg.n_head_kv
  rows = s * a * cfg.block_size
  block = cfg.n_layer * (e * hq * hd * 2 + 2 * e * hkv * hd + 3 * e * cfg.n_ff)
  if cfg.family == "dflash2":
    f = cfg.dflash2
    block += cfg.n_layer * 2 * e * 2 * f.conv_kernel_size * cfg.n_conv_groups
    block += e * f.selector_rank
  context = cfg.n_embd_fc * e + cfg.n_layer * 2 * e * hkv * hd
  attention = cfg.n_layer * 12 * (t + cfg.block_size) * hq * hd
  return dict(block_gemm=6 * rows * block, context_gemm=6 * s * t * context,
              lm_head=4 * rows * e * n_vocab, attention=rows * attention,
              total=6 * rows * block + 6 * s * t * context + 4 * rows * e * n_vocab
              + rows * attention)


def _configs(case: str, family: str, smoke: bool):
  """(drafter cfg, target cfg or None (features given), n_vocab)."""
  import dflash_jax as dfj
  from dflash_jax.config import DFlash2Fields, DSPARK_QWEN3_8B_CONFIG, TINY_DSPARK_CONFIG
  from dflash_jax.models import qwen3

  if smoke:
    tcfg = qwen3.TargetConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, rope_theta=1e4)
    base = dataclasses.replace(dfj.TINY_CONFIG, target_layers=(1, 2, 3), window=None,
                               layer_types=("full_attention",) * 2)
    spark = dataclasses.replace(TINY_DSPARK_CONFIG, target_layers=(1, 2, 3))
    d2 = DFlash2Fields(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
  else:
    tcfg = qwen3.TargetConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                              num_hidden_layers=36, num_attention_heads=32,
                              num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                              rope_theta=1e6, max_position_embeddings=40960)
    base, spark = dfj.QWEN3_8B_CONFIG, DSPARK_QWEN3_8B_CONFIG
    d2 = DFlash2Fields(conv_kernel_size=2, conv_group_size=16, selector_rank=256,
                       selector_top_k=16)
  if case == "seed":
    seed = (dataclasses.replace(dfj.TINY_CONFIG, target_layers=(1, 2, 3), window=32)
            if smoke else dfj.SEED_CONFIG)
    n_vocab = 96 if smoke else 202048
    cfg = {"dflash": seed, "dflash2": dataclasses.replace(seed, family="dflash2",
                                                          family_fields=d2),
           "dspark": dataclasses.replace(seed, block_size=7, family="dspark",
                                         family_fields=spark.family_fields)}[family]
    return cfg, None, n_vocab
  cfg = {"dflash": base, "dflash2": dataclasses.replace(base, family="dflash2", family_fields=d2),
         "dspark": spark}[family]
  return cfg, tcfg, tcfg.vocab_size


def run(args) -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from benchmarks import common as C
  from dflash_jax import sharding as SH
  from dflash_jax.models import qwen3
  from dflash_jax.train import forward as F
  from dflash_jax.train import trainer as TR
  from dflash_jax.train.data import DrafterBatch
  from dflash_jax.train.loss import sample_anchors

  if args.gpu and not C.ON_GPU:
    raise SystemExit("--gpu needs a CUDA backend")
  n_dev = len(jax.devices())
  dp = args.dp or n_dev
  if dp > n_dev:
    raise SystemExit(f"--dp {dp} needs {dp} devices; jax sees {n_dev}")
  device_bytes = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  batch = args.batch or default_batch(args.smoke, device_bytes)
  seq = args.seq_len or (32 if args.smoke else 2048)
  n_anchors = args.anchors or (4 if args.smoke else 128)
  iters = args.iters or (1 if args.smoke else 5)
  cfg, tcfg, n_vocab = _configs(args.case, args.family, args.smoke)
  out_dir = args.out or os.path.join("results", "train-" + time.strftime("%Y%m%d-%H%M%S"))
  os.makedirs(out_dir, exist_ok=True)
  s = batch * dp
  res: dict = C.run_header(args.command, args.smoke)
  res.update(case=args.case, family=args.family, cfg=dataclasses.asdict(cfg), dp=dp,
             n_devices=n_dev, device_bytes_limit=device_bytes, batch_per_device=batch, seq_len=seq, anchors=n_anchors,
             block_rows=s * n_anchors * cfg.block_size, n_vocab=n_vocab,
             target=None if tcfg is None else dataclasses.asdict(tcfg),
             compute_dtype="bf16", peak_tflops_per_device=args.peak_tflops, nvls=args.nvls)

  def save(section):
    C.save_results(out_dir, "train_throughput", res)
    print(f"{section}: {json.dumps(res.get(section), default=str)}", flush=True)

  mesh = SH.make_plan(dp=dp).mesh
  rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(SH.DP))
  key = jax.random.key(0)
  if tcfg is not None:
    target = qwen3.init_params(tcfg, key, jnp.bfloat16)
  else:   # embedding and LM head only: the step never runs the target's layers
    k1, k2 = jax.random.split(key)
    tcfg_embed = qwen3.TargetConfig(vocab_size=n_vocab, hidden_size=cfg.n_embd,
                                    intermediate_size=cfg.n_ff, num_hidden_layers=1,
                                    num_attention_heads=cfg.n_head,
                                    num_key_value_heads=cfg.n_head_kv, head_dim=cfg.head_dim)
    target = qwen3.TargetParams(
        embed=jax.random.normal(k1, (n_vocab, cfg.n_embd), jnp.bfloat16),
        layers=(), final_norm=jnp.ones((cfg.n_embd,), jnp.float32),
        lm_head=(jax.random.normal(k2, (n_vocab, cfg.n_embd), jnp.bfloat16)
                 / np.sqrt(cfg.n_embd)).astype(jnp.bfloat16))
  target = jax.device_put(target, rep)
  tc = TR.DrafterTrainConfig(optim=TR.OptimConfig(total_steps=1000, warmup_steps=10),
                             window=cfg.window, compute_dtype="bf16")
  state = jax.device_put(TR.init_state(F.init_drafter(cfg, 0, n_vocab=n_vocab), tc.optim), rep)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, n_vocab, (s, seq)).astype(np.int32)
  mask = np.ones((s, seq), bool)
  mask[:, :seq // 8] = False   # a prompt without loss, as in distilled data
  picks = [sample_anchors(mask[i], n_anchors, rng) for i in range(s)]
  b = DrafterBatch(tokens=tokens, loss_mask=mask, anchors=np.stack([a for a, _ in picks]),
                   anchor_valid=np.stack([v for _, v in picks]))
  b = jax.device_put(b, split)
  tcfg_feat = tcfg if tcfg is not None else tcfg_embed
  capture = TR.training_capture_layers(cfg, tcfg_feat)
  static = ("cfg", "target_cfg", "tc")
  kw = dict(cfg=cfg, target_cfg=tcfg_feat, tc=tc)
  feat_fn = jax.jit(TR.target_features, static_argnames=("target_cfg", "capture_layers"))
  if tcfg is not None:
    features = feat_fn(target, tcfg, capture, b.tokens)
  else:
    features = jax.device_put(jax.random.normal(
        jax.random.key(1), (s, seq, len(capture) * cfg.n_embd), jnp.float32), split)
  t_start = time.perf_counter()

  # 1. The split.
  loss_fn = jax.jit(TR.drafter_loss, static_argnames=static)
  grad_fn = jax.jit(jax.value_and_grad(TR.drafter_loss, has_aux=True), static_argnames=static)
  opt_fn = jax.jit(lambda st, g: TR._apply(st, g, tc.optim, {})[0], donate_argnums=0)
  split_ms = dict(
      target_forward=None if tcfg is None else _timed(
          lambda: feat_fn(target, tcfg, capture, b.tokens), iters=iters),
      drafter_forward=_timed(lambda: loss_fn(state.params, target, b, features, **kw)[0],
                             iters=iters),
      drafter_forward_backward=_timed(
          lambda: grad_fn(state.params, target, b, features, **kw)[1], iters=iters))
  grads = grad_fn(state.params, target, b, features, **kw)[1]
  split_ms["optimizer"], state = _timed_chain(opt_fn, state, grads, iters=iters)
  del grads
  step = jax.jit(TR.drafter_train_step, static_argnames=static, donate_argnames=("state",))
  online = tcfg is not None
  args_step = (target, b) if online else (target, b, features)
  lowered = step.lower(state, *args_step, **kw)
  compiled = lowered.compile()
  state, m = compiled(state, *args_step)
  jax.block_until_ready(m["loss"])
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    state, m = compiled(state, *args_step)
    jax.block_until_ready(m["loss"])
    ts.append((time.perf_counter() - t0) * 1e3)
  split_ms["whole_step"] = float(statistics.median(ts))
  split_ms["whole_step_features"] = "online" if online else "given"
  res["step_ms"] = split_ms
  res["loss"] = float(m["loss"])
  save("step_ms")

  # 2. Memory.
  ma = compiled.memory_analysis()
  stats = jax.devices()[0].memory_stats() or {}
  res["memory"] = dict(
      peak_bytes_in_use=stats.get("peak_bytes_in_use"), bytes_limit=stats.get("bytes_limit"),
      argument_bytes=getattr(ma, "argument_size_in_bytes", None),
      output_bytes=getattr(ma, "output_size_in_bytes", None),
      temp_bytes=getattr(ma, "temp_size_in_bytes", None),
      params_bytes=C.tree_bytes(state.params), opt_state_bytes=C.tree_bytes(state.opt_state))
  save("memory")

  # 3. FLOPs and throughput.
  def xla_flops(jitted, *a, **k):
    ca = jitted.lower(*a, **k).compile().cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return None if not ca else ca.get("flops")

  mf = model_flops(cfg, n_vocab, s, seq, n_anchors)
  drafter_s = (split_ms["drafter_forward_backward"] + split_ms["optimizer"]) * 1e-3
  peak = args.peak_tflops * 1e12 * dp
  res["flops"] = dict(
      model=mf, xla_drafter_forward_backward=xla_flops(grad_fn, state.params, target, b,
                                                       features, **kw),
      xla_target_forward=None if tcfg is None else xla_flops(feat_fn, target, tcfg, capture,
                                                             b.tokens))
  res["throughput"] = dict(
      target_tokens_per_s=s * seq / (split_ms["whole_step"] * 1e-3),
      block_rows_per_s=res["block_rows"] / (split_ms["whole_step"] * 1e-3),
      drafter_tflops_per_s=mf["total"] / drafter_s / 1e12,
      drafter_fraction_of_dense_bf16_peak=mf["total"] / drafter_s / peak,
      step_fraction_of_dense_bf16_peak=mf["total"] / (split_ms["whole_step"] * 1e-3) / peak)
  save("throughput")

  # 4. Kernels of the drafter's forward + backward.
  # The batch, features and target are arguments: closed over, they would be compiled in as
  # constants, a second copy of them on the device (the seed case then ran out of memory).
  # The optimizer state is dropped first: beside it, the forward + backward's outputs and
  # temporaries do not fit one 80 GB card at the seed case.
  params = state.params
  del state, compiled
  fb = jax.jit(lambda p, t, bb, f: grad_fn(p, t, bb, f, **kw)[1])
  res["kernels"] = kernel_split(C.cupti_kernels(fb, params, target, b, features,
                                                iterations=3), mf["total"])
  res["seconds"] = time.perf_counter() - t_start
  save("kernels")
  md = markdown(res)
  C.save_results(out_dir, "train_throughput", res, md)
  print(md)
  return 0


def markdown(res: dict) -> str:
  t = res["step_ms"]
  th = res["throughput"]
  mem = res["memory"]
  gb = lambda v: "-" if v is None else f"{v / 1e9:.1f}"
  ms = lambda v: "-" if v is None else f"{v:.1f}"
  tf = lambda v: "-" if v is None else f"{v:.0f}"
  kn = res["kernels"]
  return "\n".join([
      f"- device: {res['device']} x {res['dp']} (dp); case {res['case']}, family "
      f"{res['family']}; {res['batch_per_device']} x {res['seq_len']} tokens and "
      f"{res['anchors']} anchors per sequence per device ({res['block_rows']} block rows)",
      "", "| target fwd ms | drafter fwd ms | drafter fwd+bwd ms | optimizer ms | whole step ms "
      "| target tok/s | drafter TFLOP/s | drafter / dense bf16 peak | peak GB | temp GB |",
      "|---|---|---|---|---|---|---|---|---|---|",
      f"| {ms(t['target_forward'])} | {ms(t['drafter_forward'])} | "
      f"{ms(t['drafter_forward_backward'])} | {ms(t['optimizer'])} | {ms(t['whole_step'])} "
      f"({t['whole_step_features']}) | {th['target_tokens_per_s']:.0f} | "
      f"{th['drafter_tflops_per_s']:.1f} | {th['drafter_fraction_of_dense_bf16_peak']:.1%} | "
      f"{gb(mem['peak_bytes_in_use'])} | {gb(mem['temp_bytes'])} |",
      "", f"- drafter forward + backward kernels: {ms(kn['device_ms'])} ms in {kn['launches']} "
      f"launches; GEMMs {ms(kn['gemm_ms'])} ms ({kn['gemm_launches']} launches, "
      f"{tf(kn['gemm_tflops_per_s'])} model TFLOP/s over their time), the rest "
      f"{ms(kn['other_ms'])} ms",
      "", "| kernel | launches | ms |", "|---|---|---|",
      *[f"| {r['kernel'][:90]} | {r['launches']} | {r['ms']:.2f} |" for r in kn["top"]]])


if __name__ == "__main__":
  sys.exit(main())
