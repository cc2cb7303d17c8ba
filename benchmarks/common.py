"""Measurement helpers: CUPTI device time, wall time, copy bandwidth, random device weights."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import FULL, SLIDING, DFlashConfig, rope_inv_freq
from dflash_jax.dispatch import QuantWeight, resolve_dtype, resolve_weight_format
from dflash_jax.drafter.step import KVCache, RingState
from dflash_jax.drafter.weights import (ConvParams, DFlash2Params, DrafterParams, DSparkParams,
                                        InjectParams, LayerParams)
from dflash_jax.io import atomic
from dflash_jax.models import qwen3 as Q

ON_GPU = jax.default_backend() == "gpu"
# What jax records for each XLA backend compilation (jax._src.dispatch.BACKEND_COMPILE_EVENT).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles():
  """Collects the name of every function XLA compiles inside the block (a jax monitoring
  listener): `with count_compiles() as names: ...`, then len(names) is the count."""
  names: list[str] = []

  def listener(event: str, duration_secs: float, **kwargs) -> None:
    if event == BACKEND_COMPILE_EVENT:
      names.append(str(kwargs.get("fun_name", "?")))

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def cupti_kernels(f, *args, iterations: int = 50):
  """Per-iteration [(kernel, ms)] lists in launch order (f must not donate: it is called
  repeatedly), each kernel's ms its *exclusive* device time (`exclusive_ms`): the part of
  its run that no earlier kernel of the iteration covers. XLA launches Pallas Triton
  kernels with programmatic dependent launch (ARCHITECTURE.md "Kernel launches"), so a
  kernel can start before the one ahead of it has ended and wait inside its own run; raw
  durations would count that overlap twice. Exclusive times sum to the device's busy time,
  and equal the durations where nothing overlaps.

  From XLA's profiler (CUPTI activity records with start and end times, one trace per call
  of this function, after one untraced warm-up call). On CPU there is no CUPTI: one
  wall-clock 'kernel' per call, so smoke runs exercise the same code paths (their numbers
  are not results).
  """
  jax.block_until_ready(f(*args))
  if not ON_GPU:
    out = []
    for _ in range(iterations):
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      out.append([("cpu_wall", (time.perf_counter() - t0) * 1e3)])
    return out
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(iterations):
        r = f(*args)
      jax.block_until_ready(r)   # calls run in stream order: the last one ends last
    paths = glob.glob(os.path.join(d, "plugins", "profile", "*", "*.xplane.pb"))
    if len(paths) != 1:
      raise RuntimeError(f"cupti_kernels: expected one .xplane.pb from jax.profiler, got {paths}")
    planes = device_kernel_events(jax.profiler.ProfileData.from_file(paths[0]))
  per = [[] for _ in range(iterations)]
  for device, events in planes.items():
    if len(events) % iterations:
      raise RuntimeError(f"cupti_kernels: {len(events)} kernels on {device} over {iterations} "
                         "iterations (not a whole number per iteration)")
    n = len(events) // iterations
    for i in range(iterations):
      per[i] += exclusive_ms(events[i * n:(i + 1) * n])
  for i in range(1, iterations):
    if [k for k, _ in per[i]] != [k for k, _ in per[0]]:
      raise RuntimeError("cupti_kernels: the kernels differ between iterations")
  return per


def device_kernel_events(profile) -> dict[str, list[tuple[str, int, int]]]:
  """Per GPU plane of a jax.profiler.ProfileData: its stream lines' activities (name, start
  ns, end ns) sorted by start, the driver's memcpy / memset records (not kernels) left out."""
  out = {}
  for plane in profile.planes:
    if not plane.name.startswith("/device:GPU:"):
      continue
    events = [(e.name, int(e.start_ns), int(e.end_ns)) for line in plane.lines
              if line.name.startswith("Stream") for e in line.events
              if not e.name.startswith(("Memcpy", "Memset"))]
    if events:
      out[plane.name] = sorted(events, key=lambda e: (e[1], e[2]))
  return out


def exclusive_ms(events: list[tuple[str, int, int]]) -> list[tuple[str, float]]:
  """(name, start ns, end ns) in start order -> (name, ms) where ms is the part of the
  event's interval after the latest end of the events before it (0 if they cover it)."""
  out, covered = [], float("-inf")
  for name, start, end in events:
    out.append((name, max(0, end - max(start, covered)) * 1e-6))
    covered = max(covered, end)
  return out


def device_ms(per_iter) -> float:
  """Median over iterations of the summed kernel time (ms)."""
  return float(statistics.median(sum(t for _, t in it) for it in per_iter))


def launches(per_iter) -> int:
  """Kernels one call launches: the length of CUPTI's kernel list per iteration (the same in
  every iteration; `cupti_kernels` checks the names). On CPU the stand-in's one entry."""
  return len(per_iter[0])


def kernel_medians(per_iter) -> list[tuple[str, float]]:
  """(kernel, median ms) in launch order."""
  return [(per_iter[0][i][0], float(statistics.median(it[i][1] for it in per_iter)))
          for i in range(len(per_iter[0]))]


def kernels_by_name(medians: list[tuple[str, float]], per: int = 1) -> dict[str, list]:
  """kernel_medians summed by kernel name: name -> [launches, ms], each divided by `per` (the
  passes one measured call makes)."""
  out: dict[str, list] = {}
  for name, ms in medians:
    row = out.setdefault(name, [0, 0.0])
    row[0] += 1 / per
    row[1] += ms / per
  return out


def slowest_kernels(by_name: dict[str, list], top: int) -> list[tuple[str, list]]:
  """The `top` entries of kernels_by_name, most time first."""
  return sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]


def pass_profile(f, *args, iterations: int, per_call: int = 1) -> dict:
  """CUPTI kernels of a call of f that runs `per_call` passes (copies excluded), per pass:
  ms (median summed kernel time), launches, by_kernel (kernels_by_name) and medians (the
  whole call's kernel_medians, launch order)."""
  per = without_copies(cupti_kernels(f, *args, iterations=iterations))
  medians = kernel_medians(per)
  return dict(ms=device_ms(per) / per_call, launches=launches(per) / per_call,
              by_kernel=kernels_by_name(medians, per=per_call), medians=medians)


def wall_ms(f, *args, iterations: int = 200, trials: int = 3) -> float:
  """Wall time per call, dispatch included: calls back to back, one sync at the end."""
  jax.block_until_ready(f(*args))
  best = []
  for _ in range(trials):
    t0 = time.perf_counter()
    for _ in range(iterations):
      r = f(*args)
    jax.block_until_ready(r)
    best.append((time.perf_counter() - t0) / iterations * 1e3)
  return float(statistics.median(best))


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
  """Device copy bandwidth in bytes/s (bytes read + written per second), CUPTI timed."""
  n = nbytes // 4
  x = jnp.arange(n, dtype=jnp.float32)
  f = jax.jit(lambda a: a * 1.0001)   # one read, one write; XLA cannot elide it
  per = cupti_kernels(f, x, iterations=20)
  return 2 * n * 4 / (device_ms(per) * 1e-3)


def random_params(cfg: DFlashConfig, n_vocab: int, dtype, seed: int = 0) -> DrafterParams:
  """Random DrafterParams made on the device, in prepare_weights' layout.

  At the real sizes host generation of 2.5B float32s dominates a benchmark run; timing does
  not depend on the values, only that they stay finite and O(1). 1-byte formats get random
  data and scales of the right dtypes (the GEMM streams the same bytes whatever they hold).
  The family's own tensors too (DFlash2's convolutions and selector, DSpark's heads; their
  vocab-sized tables have n_vocab rows).
  """
  fmt = resolve_weight_format(dtype)
  keys = iter(jax.random.split(jax.random.key(seed), 16 + 8 * cfg.n_layer))
  e, d, hq, hkv = cfg.n_embd, cfg.head_dim, cfg.n_head, cfg.n_head_kv

  def mat(n_out, n_in):
    w = jax.random.normal(next(keys), (n_out, n_in), jnp.float32)
    if fmt == "fp8":
      return QuantWeight(data=(w * 64).astype(jnp.float8_e4m3fn),
                         scale=jnp.full((n_out,), 1 / (64 * np.sqrt(n_in)), jnp.float32), fmt=fmt)
    if fmt == "q8_0":
      return QuantWeight(data=jnp.clip(w * 40, -127, 127).astype(jnp.int8),
                         scale=jnp.full((n_out, n_in // 32), 1 / (40 * np.sqrt(n_in)), jnp.float32),
                         fmt=fmt)
    return (w / np.sqrt(n_in)).astype(resolve_dtype(fmt))

  def norm(n):
    return 1.0 + 0.1 * jax.random.normal(next(keys), (n,), jnp.float32)

  layers = tuple(LayerParams(
      attn_norm=norm(e), wqkv=mat((hq + 2 * hkv) * d, e), q_norm=norm(d), k_norm=norm(d),
      wo=mat(e, hq * d), ffn_norm=norm(e), wgu=mat(2 * cfg.n_ff, e), wd=mat(e, cfg.n_ff))
      for _ in range(cfg.n_layer))
  inject = tuple(InjectParams(w=mat(len(layers) * 2 * hkv * d, e),
                              k_norm=jnp.stack([norm(d) for _ in layers]), kind=kind)
                 for kind, layers in cfg.kind_groups)
  table_dtype = jnp.float32 if fmt == "fp32" else jnp.bfloat16

  def table(n, r, scale=1.0):
    return (scale * jax.random.normal(next(keys), (n, r), jnp.float32)).astype(table_dtype)

  backbone = dict(fc=mat(e, cfg.n_embd_fc), enc_norm=norm(e), out_norm=norm(e),
                  tok_embd=table(n_vocab, e), lm_head=mat(n_vocab, e))
  # The family's tensors from a stream of their own: the backbone's values stay those of a
  # DFlash drafter of the same seed.
  keys = iter(jax.random.split(jax.random.fold_in(jax.random.key(seed), 1), 8 + 4 * cfg.n_layer))
  family = None
  if cfg.family == "dflash2":
    f = cfg.dflash2
    k, proj = f.conv_kernel_size, 2 * f.conv_kernel_size * cfg.n_conv_groups

    def conv():
      base = 0.1 * jax.random.normal(next(keys), (2, k, e), jnp.float32)
      return ConvParams(base=base.at[:, 0].add(1.0), proj=mat(proj, e))
    family = DFlash2Params(
        attn_conv=tuple(conv() for _ in range(cfg.n_layer)),
        ffn_conv=tuple(conv() for _ in range(cfg.n_layer)),
        predecessor=table(n_vocab, f.selector_rank, f.selector_rank ** -0.25),
        successor=table(n_vocab, f.selector_rank, f.selector_rank ** -0.25),
        hidden=mat(f.selector_rank, e))
  elif cfg.family == "dspark":
    f = cfg.dspark
    r = f.markov_rank
    bias = lambda n: 0.1 * jax.random.normal(next(keys), (n,), jnp.float32)
    gated, rnn = f.markov_head_type == "gated", f.markov_head_type == "rnn"
    family = DSparkParams(
        markov_w1=table(n_vocab, r) if r else None, markov_w2=mat(n_vocab, r) if r else None,
        gate=mat(r, e + r) if gated else None, gate_bias=bias(r) if gated else None,
        joint=mat(3 * r, 2 * r + e) if rnn else None, joint_bias=bias(3 * r) if rnn else None,
        conf=mat(1, e + (r if f.confidence_with_markov else 0)) if f.confidence_head else None,
        conf_bias=bias(1) if f.confidence_head else None)
  return DrafterParams(**backbone, inject=inject,
                       inv_freq=jnp.asarray(rope_inv_freq(d, cfg.rope_theta, cfg.rope_scaling)), layers=layers,
                       cfg=cfg, family=family)


def filled_cache(n_layer: int, cfg: DFlashConfig, slots: int, ring_dtype, positions,
                 kind: str = SLIDING, seed: int = 1, n_seqs: int | None = None) -> KVCache:
  """A cache of `slots` slots for n_layer layers holding random K/V at `positions` (slot
  p % slots for a sliding ring, p for a full-attention cache; the rest empty); n_seqs: that
  many such caches (different K/V, the same positions) stacked on a leading slot axis, as in
  a batched ring."""
  dt = resolve_dtype(ring_dtype)
  kk, kv = jax.random.split(jax.random.key(seed))
  lead = () if n_seqs is None else (n_seqs,)
  shape = lead + (n_layer, cfg.n_head_kv, slots, cfg.head_dim)
  positions = np.asarray(positions, np.int64)
  pos = np.full((slots,), -1, np.int32)
  pos[positions % slots if kind == SLIDING else positions] = positions
  return KVCache(k=jax.random.normal(kk, shape, jnp.float32).astype(dt),
                 v=jax.random.normal(kv, shape, jnp.float32).astype(dt),
                 pos=jnp.asarray(np.broadcast_to(pos, lead + pos.shape)), kind=kind)


def full_ring(cfg: DFlashConfig, window: int, ring_dtype, seed: int = 1) -> KVCache:
  """One ring of every layer with every slot filled (positions 0..W-1), as after a long
  prefill: the operands of a kernel benchmark."""
  return filled_cache(cfg.n_layer, cfg, window, ring_dtype, np.arange(window), seed=seed)


def filled_state(cfg: DFlashConfig, ring_dtype, n_past: int, window: int,
                 capacity: int | None = None, seed: int = 1,
                 n_seqs: int | None = None) -> RingState:
  """The drafter's ring after committing positions 0..n_past-1: the sliding ring holds the
  last W of them, the full-attention cache (capacity >= n_past) all of them. n_seqs: a
  batched ring of that many such sequences."""
  caches = {}
  for kind, layers in cfg.kind_groups:
    if kind == SLIDING:
      caches[kind] = filled_cache(len(layers), cfg, window, ring_dtype,
                                  np.arange(max(0, n_past - window), n_past), kind, seed, n_seqs)
    else:
      if capacity is None or capacity < n_past:
        raise ValueError(f"a full-attention cache for n_past {n_past} needs capacity >= n_past, "
                         f"got {capacity}")
      caches[kind] = filled_cache(len(layers), cfg, capacity, ring_dtype, np.arange(n_past),
                                  kind, seed + 1, n_seqs)
  return RingState(sliding=caches.get(SLIDING), full=caches.get(FULL))


GEMM_RE = re.compile(r"gemm|gemv|xmma|nvjet|cutlass|cublas|matmul|sm90|sm80|triton_dot|dot_|skinny",
                     re.I)


def classify(name: str, pallas_names: dict[str, str]) -> str:
  for key, label in pallas_names.items():
    if key in name:
      return label
  return "gemm" if GEMM_RE.search(name) else "other"


def without_copies(per_iter):
  """Drop the ring copies that a non-donating measurement jit adds before aliased kernels
  (CUPTI calls the function repeatedly on the same arguments, so it cannot donate): XLA's
  copy fusions and the driver's memcpy kernels (e.g. `memcpy128`)."""
  return [[k for k in it if not any(c in k[0].lower() for c in ("copy", "memcpy"))]
          for it in per_iter]


def target_layer_launches(cfg, impl: str, w: int, capacity: int, live: int,
                          policy=None, module=Q) -> tuple[int, list[str]]:
  """Kernels one decoder layer adds to a w-row verify of a target (CUPTI, copies dropped): a
  3-layer minus a 2-layer `cfg` (per-layer tuples such as Muse-Glimmer's layer_types cut to
  their last layers) at `live` cached rows; with the 3-layer pass's kernel names in launch
  order. module: the family's module (its init_params)."""
  counts, names = {}, []
  for n in (2, 3):
    per_layer = {f: getattr(cfg, f)[-n:] for f in ("layer_types", "layer_rope_theta")
                 if getattr(cfg, f, None) is not None}
    c = dataclasses.replace(cfg, num_hidden_layers=n, **per_layer)
    tp = module.init_params(c, jax.random.key(0), jnp.bfloat16)
    if policy is not None:
      tp = tp.replace(policy=policy)
    cache = c.init_cache(1, capacity, "bf16").replace(length=jnp.array([live], jnp.int32))
    tokens = jax.random.randint(jax.random.key(5), (1, w), 0, c.vocab_size, jnp.int32)
    f = jax.jit(functools.partial(lambda p, k, t, c: c.verify(p, k, t, impl=impl)[1], c=c))
    per = without_copies(cupti_kernels(f, tp, cache, tokens, iterations=3))
    counts[n], names = launches(per), [name for name, _ in per[0]]
  return counts[3] - counts[2], names


def tree_bytes(tree) -> int:
  return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def run_header(command: str, smoke: bool) -> dict:
  """What every results file starts with: UTC stamp, device, jax, the commit (+modified when the
  tree differs from HEAD, e.g. a copy whose git metadata lags) and the command line."""
  try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                      capture_output=True, text=True).stdout.strip():
      commit += "+modified"
  except OSError:
    commit = "unknown"
  return dict(date=datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ"),
              device=jax.devices()[0].device_kind, jax=jax.__version__, commit=commit,
              command=command, smoke=bool(smoke))


def arg_parser(doc: str, script: str, gpu_help: str) -> argparse.ArgumentParser:
  """The command line the benchmarks share: --gpu (gpu_help) or --smoke, exactly one, and
  --out; `start_results` then checks --gpu and opens the results."""
  p = argparse.ArgumentParser(prog=f"python -m benchmarks.{script}",
                              description=doc.splitlines()[0])
  mode = p.add_mutually_exclusive_group(required=True)
  mode.add_argument("--gpu", action="store_true", help=gpu_help)
  mode.add_argument("--smoke", action="store_true", help="tiny dims on any backend (not results)")
  p.add_argument("--out", default=None,
                 help=f"results folder (default results/{script}-<UTC stamp>)")
  return p


def start_results(p: argparse.ArgumentParser, args, argv) -> tuple[dict, str]:
  """For a command line of `arg_parser` (argv: main's, None for sys.argv): --gpu without a GPU
  backend is the parser's error; -> (the results header, `run_header`, and the results
  folder: --out or results/<script>-<UTC stamp>, absolute, created)."""
  if args.gpu and not ON_GPU:
    p.error("--gpu needs a GPU backend")
  words = sys.argv[1:] if argv is None else list(argv)
  res = run_header(" ".join([p.prog, *words]), args.smoke)
  script = p.prog.rsplit(".", 1)[1]
  out_dir = os.path.abspath(args.out or os.path.join("results", f"{script}-{res['date']}"))
  os.makedirs(out_dir, exist_ok=True)
  return res, out_dir


def save_results(out_dir: str, stem: str, results: dict, md: str | None = None) -> str | None:
  """out_dir/stem.json and, given md, out_dir/stem.md, each written atomically (called after
  every section, so a run cut short keeps what it measured and no file is half-written);
  returns md."""
  atomic.write_text(os.path.join(out_dir, f"{stem}.json"),
                    json.dumps(results, indent=1, default=str) + "\n")
  if md is not None:
    atomic.write_text(os.path.join(out_dir, f"{stem}.md"), md + "\n")
  return md
