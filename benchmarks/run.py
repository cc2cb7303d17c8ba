"""Benchmarks of the drafter step on the GPU, with peers, in one command.

  python -m benchmarks.run --gpu [--only step,kernels] [--out results/NAME]
  python -m benchmarks.run --smoke          # CPU, tiny dims, seconds: keeps the scripts alive

Device times are CUPTI kernel sums (median of many iterations after warm-up); wall times
include dispatch; launches are the kernels in CUPTI's list for one call. Every byte floor uses
the copy bandwidth measured in the same run. Peers of the step: `xla` (`impl="xla"`: our step
with the kernels' jnp twins, the column's history since run 1), `xla_peer`
(benchmarks/xla_peer.py: the plain-XLA step as strong as XLA allows) and PyTorch.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import dflash_jax as dfj
from benchmarks import common as C
from dflash_jax.dispatch import KernelPolicy
from dflash_jax.drafter import step as S

# The fused (non-GEMM) Pallas kernels; the Pallas skinny GEMM counts as a GEMM (common.GEMM_RE).
PALLAS = {"inject": "inject", "qk_norm_rope": "norm_rope", "ring_attn": "attention",
          "accept": "accept"}
GEMM_GROUPS = ("qkv", "o", "gate_up", "down")


@dataclasses.dataclass(frozen=True)
class Case:
  """One benchmarked step: the ring holds positions 0..n_past-1 (the sliding ring the last
  `window` of them, the full-attention cache of `capacity` slots all of them, every slot
  live), n_past = max(window, capacity). peer: also time the PyTorch peer."""
  name: str
  cfg: dfj.DFlashConfig
  n_vocab: int
  dtype: str
  ring_dtype: str
  window: int = 2048
  capacity: int | None = None
  peer: bool = True

  @property
  def n_past(self) -> int:
    return max(self.window, self.capacity or 0)


SLIDE, FULL = dfj.config.SLIDING, dfj.config.FULL


def shape_variants(base: dfj.DFlashConfig, label: str, n_vocab: int, window: int,
                   group3: dict, window_b: int, capacity: int) -> list[Case]:
  """Issue 13's drafter shapes beside `base` (bf16 weights and ring): blocks 10 and 7, a
  GQA group of 3 (`group3` heads), a window that is not a power of 2 (window_b), and 4
  sliding + 1 full layers (a full-attention cache of `capacity` slots)."""
  mixed = dataclasses.replace(base, n_layer=5, layer_types=(SLIDE,) * 4 + (FULL,))
  shapes = [(f"{label}-b10", dataclasses.replace(base, block_size=10), window, None),
            (f"{label}-b7", dataclasses.replace(base, block_size=7), window, None),
            (f"{label}-g3", dataclasses.replace(base, **group3), window, None),
            (f"{label}-w{window_b}", base, window_b, None),
            (f"{label}-4s1f-c{capacity}", mixed, window, capacity)]
  return [Case(f"{name} V{n_vocab} wbf16 rbf16", cfg, n_vocab, "bf16", "bf16", w, c, peer=False)
          for name, cfg, w, c in shapes]


def gpu_cases() -> list[Case]:
  seed, qwen = dfj.SEED_CONFIG, dfj.QWEN3_8B_CONFIG
  cases = [Case(f"seed V8192 w{d} r{r}", seed, 8192, d, r)
           for d, r in (("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "bf16"), ("fp32", "fp32"))]
  # Group 3 as 24 / 8 heads: the seed's kv heads, head_dim and ring (the same attention grid
  # and ring bytes), q/o projections 3/4 of the seed's (97% of its weight bytes); only G
  # (T*G = 48 query rows per kv head, not a power of 2) differs.
  cases[1:1] = shape_variants(seed, "seed", 8192, 2048, dict(n_head=24), 3000, 8192)
  cases += [Case(f"seed V8192 w{f} rbf16", seed, 8192, f, "bf16") for f in ("fp8", "q8_0")]
  cases += [Case(f"seed V202048 w{f} rbf16", seed, 202048, f, "bf16") for f in ("bf16", "fp8")]
  # Qwen3-8B-DFlash's layers are all full attention: a 2048-slot cache, every slot live (the
  # bytes and FLOPs of the seed's 2048-slot ring). Its PyTorch peer (timing only: random
  # weights) runs that cache as a sliding ring of 2048, the same work.
  cases += [Case(f"qwen3-8b V151936 w{f} rbf16", qwen, 151936, f, "bf16", capacity=2048)
            for f in ("bf16", "fp8")]
  return cases


def smoke_cases() -> list[Case]:
  cfg = dataclasses.replace(dfj.TINY_CONFIG, window=64)
  cases = [Case("tiny wbf16 rbf16", cfg, 512, "bf16", "bf16", 64),
           Case("tiny wfp32 rfp32", cfg, 512, "fp32", "fp32", 64),
           Case("tiny wfp8 rbf16", cfg, 512, "fp8", "bf16", 64)]
  # The shape variants with the GPU list's construction, at tiny dims.
  return cases + shape_variants(cfg, "tiny", 512, 64, dict(n_head=6), 48, 128)


def step_bytes(params: dfj.DrafterParams, ring: S.RingState) -> int:
  """Bytes one block step must move: every layer weight, the LM head, every cache slot (all
  live in these cases), the block's embedding rows and its logits (block_size rows)."""
  cfg = params.cfg
  embd_rows = cfg.block_size * cfg.n_embd * params.tok_embd.dtype.itemsize
  logits = cfg.block_size * params.n_vocab * 4
  return (C.tree_bytes(params.layers) + C.tree_bytes((params.lm_head, params.out_norm))
          + C.tree_bytes(ring) + embd_rows + logits)


def decompose(kernels: list[tuple[str, float]], n_layer: int) -> dict[str, float]:
  """Kernel list of one step -> ms per phase. GEMMs are named by launch order when the count
  is the expected 4 per layer + the LM head; otherwise they stay one 'gemm' phase."""
  labels = [C.classify(n, PALLAS) for n, _ in kernels]
  gemm_idx = [i for i, l in enumerate(labels) if l == "gemm"]
  if len(gemm_idx) == 4 * n_layer + 1:
    for j, i in enumerate(gemm_idx):
      labels[i] = "gemm lm_head" if j == 4 * n_layer else f"gemm {GEMM_GROUPS[j % 4]}"
  out: dict[str, float] = {}
  for label, (_, ms) in zip(labels, kernels):
    out[label] = out.get(label, 0.0) + ms
  return out


def bench_case(case: Case, bw: float, iters: int, torch_peer: bool) -> dict:
  cfg = case.cfg
  params = C.random_params(cfg, case.n_vocab, case.dtype)
  ring = C.filled_state(cfg, case.ring_dtype, case.n_past, case.window, case.capacity)
  id_last, n_past = jnp.int32(1), jnp.int32(case.n_past)
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  res: dict = dict(case=case.name, n_vocab=case.n_vocab, dtype=case.dtype,
                   ring_dtype=case.ring_dtype, window=case.window, capacity=case.capacity,
                   n_past=case.n_past, cfg=dataclasses.asdict(cfg))

  t0 = time.perf_counter()
  step = S.block_step_jit.lower(params, ring, scalar, scalar, impl="pallas").compile()
  res["compile_s"] = time.perf_counter() - t0
  per = C.cupti_kernels(step, params, ring, id_last, n_past, iterations=iters)
  kernels = C.kernel_medians(per)
  res["step_device_ms"] = C.device_ms(per)
  res["launches"] = C.launches(per)
  # Smoke runs (interpret-mode kernels) call the step a few times, not 600.
  wall = functools.partial(C.wall_ms, iterations=200 if C.ON_GPU else 2,
                           trials=3 if C.ON_GPU else 1)
  res["step_wall_ms"] = wall(step, params, ring, id_last, n_past)
  res["kernels"] = kernels
  res["phases_ms"] = decompose(kernels, cfg.n_layer)
  res["bytes"] = step_bytes(params, ring)
  res["floor_ms"] = res["bytes"] / bw * 1e3
  res["floor_fraction"] = res["floor_ms"] / res["step_device_ms"]
  fused = sum(v for k, v in res["phases_ms"].items() if k in PALLAS.values())
  res["fused_fraction"] = fused / res["step_device_ms"]

  # draft_round and prefill are measured through non-donating jits (CUPTI calls them
  # repeatedly); XLA then copies the aliased ring first, and those copies are excluded.
  feats = jax.random.normal(jax.random.key(3), (cfg.block_size, cfg.n_embd_fc), jnp.float32)
  dr = jax.jit(functools.partial(S.draft_round, impl="pallas"))
  per = C.cupti_kernels(dr, params, ring, feats, jnp.int32(cfg.block_size), id_last,
                        n_past, iterations=max(3, iters // 2))
  res["draft_round_device_ms"] = C.device_ms(C.without_copies(per))
  res["draft_round_launches"] = C.launches(C.without_copies(per))
  n_pre = res["prefill_rows"] = min(2048, case.n_past)   # rows a cache holds
  pre_feats = jax.random.normal(jax.random.key(4), (n_pre, cfg.n_embd_fc), jnp.float32)
  prefill = jax.jit(lambda p, r, f: S.inject(p, r, S.encode(p, f), jnp.arange(n_pre, dtype=jnp.int32)))
  per = C.cupti_kernels(prefill, params, ring, pre_feats, iterations=max(3, iters // 5))
  res["prefill_device_ms"] = C.device_ms(C.without_copies(per))

  t0 = time.perf_counter()
  xla = S.block_step_jit.lower(params, ring, scalar, scalar, impl="xla").compile()
  res["xla_compile_s"] = time.perf_counter() - t0
  per = C.cupti_kernels(xla, params, ring, id_last, n_past, iterations=iters)
  res["xla_step_device_ms"] = C.device_ms(per)
  res["xla_launches"] = C.launches(per)
  res["xla_step_wall_ms"] = wall(xla, params, ring, id_last, n_past)
  res["xla_phases_ms"] = decompose(C.kernel_medians(per), cfg.n_layer)
  a = np.asarray(step(params, ring, id_last, n_past))
  b = np.asarray(xla(params, ring, id_last, n_past))
  res["pallas_vs_xla_max_abs_logit_diff"] = float(np.abs(a - b).max())
  del xla
  res.update(bench_xla_peer(params, ring, id_last, n_past, a, iters, wall))
  if torch_peer and case.peer and case.dtype in ("fp32", "bf16"):
    res.update(bench_torch(case, params, ring, a, check_logits=case.n_vocab == 8192
                           and case.dtype == case.ring_dtype == "bf16"))
  return res


def bench_xla_peer(params: dfj.DrafterParams, ring: S.RingState, id_last, n_past, our_logits,
                   iters: int, wall) -> dict:
  """benchmarks.xla_peer's step (plain XLA as strong as it allows) on the same weights and
  ring; its per-layer copy of the ring is made before timing, as a plain-XLA drafter would
  store it."""
  from benchmarks import xla_peer as XP
  pring = XP.peer_ring(params, ring)
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  t0 = time.perf_counter()
  f = XP.block_step_jit.lower(params, pring, scalar, scalar).compile()
  out = {"xla_peer_compile_s": time.perf_counter() - t0}
  per = C.cupti_kernels(f, params, pring, id_last, n_past, iterations=iters)
  kernels = C.kernel_medians(per)
  out.update(xla_peer_step_device_ms=C.device_ms(per), xla_peer_launches=C.launches(per),
             xla_peer_step_wall_ms=wall(f, params, pring, id_last, n_past),
             xla_peer_kernels=kernels, xla_peer_phases_ms=decompose(kernels, params.cfg.n_layer))
  peer = np.asarray(f(params, pring, id_last, n_past))
  out["pallas_vs_xla_peer_max_abs_logit_diff"] = float(np.abs(peer - our_logits).max())
  return out


def bench_torch(case: Case, params, ring, our_logits, check_logits: bool) -> dict:
  """The PyTorch peer on the same shapes. check_logits: it also gets our exact weights and
  ring (a host round trip of every weight) and its logits are compared with ours; otherwise
  it draws its own random weights on the device (timing does not depend on the values)."""
  import torch
  from benchmarks import torch_peer as TP
  cfg = case.cfg
  fields = {f: getattr(cfg, f) for f in ("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv",
                                         "head_dim", "rope_theta", "eps", "block_size",
                                         "mask_token_id")}
  tdt = torch.bfloat16 if case.dtype == "bf16" else torch.float32
  out = {}
  if check_logits:
    r = ring.sliding   # the peer has one sliding ring (peer cases have no full layers)
    peer = TP.TorchDrafterStep(fields, host_weights(params), np.asarray(r.k.astype(jnp.float32)),
                               np.asarray(r.v.astype(jnp.float32)), np.asarray(r.pos),
                               dtype=tdt, device="cuda")
  else:
    peer = TP.TorchDrafterStep.random(fields, case.n_vocab, tdt, "cuda", window=case.window)
  n_past = case.window
  eager = peer.step(1, n_past)
  if check_logits:
    out["torch_logits_max_abs_diff"] = float(np.abs(eager.float().cpu().numpy() - our_logits).max())
  graphed = peer.capture()
  out["torch_eager"] = TP.time_step(lambda p=peer: p.step(1, n_past))
  out["torch_graph"] = TP.time_step(lambda g=graphed: g(1, n_past))
  del peer, graphed, eager   # free the peer's weights before the next case
  torch.cuda.empty_cache()
  return out


def host_weights(params: dfj.DrafterParams) -> dict[str, np.ndarray]:
  """DrafterParams -> host float32 weights in the GGUF naming (for the PyTorch peer)."""
  cfg = params.cfg
  f32 = lambda x: np.asarray(x.astype(jnp.float32))
  hq, hkv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
  w = {"tok_embd": f32(params.tok_embd), "lm_head": f32(params.lm_head),
       "output_norm": f32(params.out_norm)}
  for i, lp in enumerate(params.layers):
    p = f"blk.{i}."
    qkv = f32(lp.wqkv)
    gu = f32(lp.wgu)
    w.update({p + "attn_norm": f32(lp.attn_norm), p + "attn_q": qkv[:hq],
              p + "attn_k": qkv[hq:hq + hkv], p + "attn_v": qkv[hq + hkv:],
              p + "attn_output": f32(lp.wo), p + "attn_q_norm": f32(lp.q_norm),
              p + "attn_k_norm": f32(lp.k_norm), p + "ffn_norm": f32(lp.ffn_norm),
              p + "ffn_gate": gu[:cfg.n_ff], p + "ffn_up": gu[cfg.n_ff:], p + "ffn_down": f32(lp.wd)})
  return w


def bench_kernels(bw: float, iters: int, smoke: bool) -> dict:
  """Each fused kernel alone at the real dims (issue targets: attention <= 8 us/layer incl.
  combine, inject of 16 rows x 5 layers <= 5 us, accept <= 3 us)."""
  from pallas_kernels import accept as A
  from pallas_kernels import inject as I
  from pallas_kernels import norm_rope as N
  from pallas_kernels import ring_attention as R
  cfg = dataclasses.replace(dfj.TINY_CONFIG, window=64) if smoke else dfj.SEED_CONFIG
  w = cfg.resolve_window()
  L, hq, hkv, d, b = cfg.n_layer, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.block_size
  g = hq // hkv
  key = iter(jax.random.split(jax.random.key(0), 32))
  rnd = lambda shape, dt=jnp.float32: jax.random.normal(next(key), shape, jnp.float32).astype(dt)
  inv = jnp.asarray(dfj.rope_inv_freq(d, cfg.rope_theta, cfg.rope_scaling))
  out = {}
  for rdt in ("bf16", "fp32"):
    ring = C.full_ring(cfg, w, rdt)
    q, k, v = rnd((hkv, b * g, d)), rnd((hkv, b, d)), rnd((hkv, b, d))
    # The Triton kernel with its default knobs (the step may route one sequence elsewhere).
    knobs = dict(R.default_knobs(ring.slots, ring.window, ring.k.dtype, head_dim=d,
                                 fold_own_min_seqs=KernelPolicy().fold_own_min_seqs).kwargs(),
                 window=ring.window)
    f = jax.jit(functools.partial(R.ring_attention, layer=L - 1, **knobs))
    per = C.cupti_kernels(f, q, k, v, ring.k, ring.v, ring.pos, jnp.int32(w), iterations=iters)
    ring_bytes = 2 * hkv * w * d * ring.k.dtype.itemsize
    out[f"ring_attention_{rdt}"] = dict(device_us=C.device_ms(per) * 1e3,
                                        kernels_us=[(n, t * 1e3) for n, t in C.kernel_medians(per)],
                                        floor_us=ring_bytes / bw * 1e6, knobs=knobs)
    kv = rnd((b, L, 2, hkv, d))
    f = jax.jit(functools.partial(I.inject, eps=cfg.eps), donate_argnums=())
    per = C.cupti_kernels(f, ring.k, ring.v, ring.pos, kv, rnd((L, d)), jnp.arange(b, dtype=jnp.int32),
                          jnp.int32(b), inv, iterations=iters)
    out[f"inject16_{rdt}"] = dict(
        device_us=C.device_ms(C.without_copies(per)) * 1e3,
        kernels_us=[(n, t * 1e3) for n, t in C.kernel_medians(per)])
  f = jax.jit(functools.partial(N.qk_norm_rope, n_head=hq, n_head_kv=hkv, eps=cfg.eps))
  for s in (1, 4):   # 4: the split-K partials of the quantized qkv projection
    qkv = rnd((s, b, (hq + 2 * hkv) * d))
    per = C.cupti_kernels(f, qkv, rnd((d,)), rnd((d,)), jnp.int32(100), inv, iterations=iters)
    out[f"qk_norm_rope_parts{s}"] = dict(device_us=C.device_ms(per) * 1e3)
  dr = jax.random.randint(next(key), (b - 1,), 0, 100, jnp.int32)
  per = C.cupti_kernels(jax.jit(A.accept), dr, dr.at[7].set(-1), iterations=iters)
  out["accept"] = dict(device_us=C.device_ms(per) * 1e3)
  return out


def bench_quant_accuracy(smoke: bool) -> dict:
  """fp8 / q8_0 drafters against the unquantized fp32 drafter on the same synthetic weights:
  logit error and greedy-draft agreement (overall, and where the fp32 top-2 gap is clear of
  the quantization error)."""
  cfg = (dataclasses.replace(dfj.TINY_CONFIG, window=64) if smoke else
         dataclasses.replace(dfj.SEED_CONFIG, n_embd=1024, n_ff=3072, mask_token_id=8191))
  n_vocab = 512 if smoke else 8192
  w = dfj.synthetic_drafter(cfg, seed=0, n_vocab=n_vocab)
  n_rows = 3 * cfg.resolve_window() // 2
  feats = dfj.synthetic_features(cfg, n_rows, seed=1)
  rng = np.random.default_rng(2)
  steps = [(int(rng.integers(n_vocab)), n_rows + int(rng.integers(0, 4))) for _ in range(4 if smoke else 32)]

  # On CPU the kernels would run in interpret mode: minutes, and no information here (they
  # equal their jnp twins exactly, tests/test_kernels_*.py).
  impl = "pallas" if C.ON_GPU else "xla"

  def logits(fmt):
    m = dfj.DFlashDrafter(cfg, w, dtype=fmt, ring_dtype="fp32", impl=impl)
    m.inject(m.encode(feats), np.arange(n_rows))
    step = m.capture_step()
    return np.stack([np.asarray(step(i, n)) for i, n in steps])[:, 1:]   # draft rows only

  ref = logits("fp32")
  top2 = np.sort(ref, axis=-1)[..., -2:]
  gap = top2[..., 1] - top2[..., 0]
  out = {"config": dict(n_embd=cfg.n_embd, n_ff=cfg.n_ff, n_layer=cfg.n_layer, n_vocab=n_vocab),
         "rows": int(gap.size), "logit_std": float(ref.std())}
  for fmt in ("bf16", "fp8", "q8_0"):
    got = logits(fmt)
    err = np.abs(got - ref)
    clear = gap > 2 * err.max(axis=-1)   # no error of that size can reorder the top two
    agree = np.argmax(got, -1) == np.argmax(ref, -1)
    out[fmt] = dict(max_abs_err=float(err.max()), mean_abs_err=float(err.mean()),
                    agreement=float(agree.mean()), clear_rows=int(clear.sum()),
                    agreement_clear=float(agree[clear].mean()) if clear.any() else None)
  return out


def markdown(results: dict) -> str:
  lines = [f"- device: {results['device']}, jax {results['jax']}, commit {results['commit']}",
           f"- command: `{results['command']}`",
           f"- copy bandwidth (read+write): {results['copy_bw_TBps']:.2f} TB/s", ""]
  if results.get("steps"):
    # Columns past "compile s" came later (issue 19); the earlier ones keep their history.
    lines += ["| case | step device ms | wall ms | floor ms | floor frac | fused frac | xla step ms | "
              "ours/xla | torch eager ms | torch graph ms | graph/ours | draft_round ms | prefill ms (rows) | compile s | "
              "launches | xla launches | xla peer ms | ours/xla peer | xla peer launches |",
              "|" + "---|" * 19]
    for r in results["steps"]:
      tg = r.get("torch_graph", {}).get("median_ms")
      te = r.get("torch_eager", {}).get("median_ms")
      fmt = lambda x: "-" if x is None else f"{x:.3f}"
      lines.append(
          f"| {r['case']} | {r['step_device_ms']:.3f} | {r['step_wall_ms']:.3f} | {r['floor_ms']:.3f} | "
          f"{r['floor_fraction']:.3f} | {r['fused_fraction']:.3f} | {r['xla_step_device_ms']:.3f} | "
          f"{r['xla_step_device_ms'] / r['step_device_ms']:.2f}x | {fmt(te)} | {fmt(tg)} | "
          f"{'-' if tg is None else f'{tg / r['step_device_ms']:.2f}x'} | {r['draft_round_device_ms']:.3f} | "
          f"{r['prefill_device_ms']:.3f} ({r['prefill_rows']}) | {r['compile_s']:.1f} | "
          f"{r['launches']} | {r['xla_launches']} | {r['xla_peer_step_device_ms']:.3f} | "
          f"{r['xla_peer_step_device_ms'] / r['step_device_ms']:.2f}x | {r['xla_peer_launches']} |")
    lines += ["", "Phases (ms per step, all layers; per layer = /n_layer for the layer phases):", ""]
    for r in results["steps"]:
      ph = ", ".join(f"{k} {v:.4f}" for k, v in sorted(r["phases_ms"].items(), key=lambda kv: -kv[1]))
      lines.append(f"- {r['case']}: {ph}")
  if results.get("quant_accuracy"):
    qa = results["quant_accuracy"]
    lines += ["", f"Quantized vs fp32 drafter ({qa['config']}, {qa['rows']} draft rows, logit std "
              f"{qa['logit_std']:.2f}):", "",
              "| weights | max abs logit err | mean abs err | greedy agreement | rows with clear gap | agreement there |",
              "|---|---|---|---|---|---|"]
    for fmt in ("bf16", "fp8", "q8_0"):
      r = qa[fmt]
      ac = "-" if r["agreement_clear"] is None else f"{r['agreement_clear']:.4f}"
      lines.append(f"| {fmt} | {r['max_abs_err']:.4f} | {r['mean_abs_err']:.5f} | "
                   f"{r['agreement']:.4f} | {r['clear_rows']} | {ac} |")
  if results.get("kernels"):
    lines += ["", "| kernel | device us | detail |", "|---|---|---|"]
    for k, v in results["kernels"].items():
      detail = ", ".join(f"{n} {t:.2f}" for n, t in v.get("kernels_us", []))
      if "floor_us" in v:
        detail += f"; ring byte floor {v['floor_us']:.2f} us"
      lines.append(f"| {k} | {v['device_us']:.2f} | {detail} |")
  return "\n".join(lines)


def chart(results: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = results.get("steps") or []
  if not steps:
    return
  labels = sorted({k for r in steps for k in r["phases_ms"]})
  fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(steps)), 5))
  bottom = np.zeros(len(steps))
  for lab in labels:
    vals = np.array([r["phases_ms"].get(lab, 0.0) for r in steps])
    ax.bar(range(len(steps)), vals, bottom=bottom, label=lab)
    bottom += vals
  ax.scatter(range(len(steps)), [r["floor_ms"] for r in steps], marker="_", s=800, c="k",
             label="byte floor", zorder=3)
  ax.set_xticks(range(len(steps)), [r["case"] for r in steps], rotation=20, ha="right", fontsize=8)
  ax.set_ylabel("ms per block step (CUPTI)")
  ax.set_title(f"dflash-jax block step phases, {results['device']}")
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> int:
  p = C.arg_parser(__doc__, "run", "real dimensions on the GPU")
  p.add_argument("--only", default="step,kernels,quant",
                 help="comma list of: step, kernels, quant")
  p.add_argument("--cases", default="", help="comma list of substrings; a case runs if any matches")
  p.add_argument("--iters", type=int, default=None)
  args = p.parse_args(argv)
  iters = args.iters or (50 if args.gpu else 3)
  only = set(args.only.split(","))
  results, out_dir = C.start_results(p, args, argv)
  bw = C.copy_bandwidth(1 << 30 if args.gpu else 1 << 22)
  results["copy_bw_TBps"] = bw / 1e12
  print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)

  def save() -> str:
    return C.save_results(out_dir, "bench", results, markdown(results))

  if "kernels" in only:
    results["kernels"] = bench_kernels(bw, iters, smoke=args.smoke)
    print(json.dumps(results["kernels"], indent=1), flush=True)
    save()
  if "quant" in only:
    results["quant_accuracy"] = bench_quant_accuracy(smoke=args.smoke)
    print(json.dumps(results["quant_accuracy"], indent=1), flush=True)
    save()
  if "step" in only:
    results["steps"] = []
    cases = gpu_cases() if args.gpu else smoke_cases()
    for case in cases:
      if args.cases and not any(c in case.name for c in args.cases.split(",")):
        continue
      t0 = time.perf_counter()
      r = bench_case(case, bw, iters, torch_peer=args.gpu)
      results["steps"].append(r)
      print(f"{case.name}: step {r['step_device_ms']:.3f} ms ({r['launches']} launches), floor "
            f"frac {r['floor_fraction']:.3f}, xla {r['xla_step_device_ms']:.3f} ms "
            f"({r['xla_launches']}), xla peer {r['xla_peer_step_device_ms']:.3f} ms "
            f"({r['xla_peer_launches']}) ({time.perf_counter() - t0:.0f} s)", flush=True)
      save()
  md = save()
  chart(results, os.path.join(out_dir, "phases.png"))
  print(md)
  return 0


if __name__ == "__main__":
  sys.exit(main())
