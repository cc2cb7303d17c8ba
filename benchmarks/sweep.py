"""Tuning sweeps on the GPU: ring attention knobs and skinny-GEMM tiles, CUPTI timed.

  python -m benchmarks.sweep [attention] [battn] [mgpu_battn] [mgpu_attn] [gemm] [gate_up]
      [shapes] [rows] [mixed] [mgpu] [bgemm] [norm] [topk] [moe] [gridbar] [--out FILE.json]

Prints one line per configuration (device us, achieved TB/s; GEMM weights streamed from memory,
not L2: `COLD_BYTES`) and writes all of them as JSON;
the defaults in the kernels and step come from these numbers (see RESULTS.md). `shapes`
times the kernels at published drafters' shapes the seed's tiles do not fit (block 10 and 7,
GQA group 3, windows 3000 and 48, full-attention caches, head_dim 96 / 256, odd GEMM N / K)
with their default knobs, next to the seed shape, plus alternative chunkings for the
3000-slot window. `bgemm` times pallas_kernels.batched_gemm's tiles at --rows, `norm` the RMS
norm at --rows, `battn` / `mgpu_battn` the Triton / Mosaic GPU ring attention of --slots
sequences, `topk` the DFlash2 selector's top-k (pallas_kernels.top_k: 15 draft rows of a
16-row block, k 16) over its block and warp knobs at --vocabs, beside XLA's lax.top_k. `moe`
the grouped expert GEMMs (pallas_kernels.moe_gemm) at Qwen3-30B-A3B's decode and verify.
`gridbar` is a premise probe, no tuning: what a grid-wide barrier costs inside one Pallas
Triton kernel (the building block of a persistent decoder layer, RESULTS.md run 45).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
import numpy as np

import dflash_jax as dfj
from benchmarks import common as C
from dflash_jax.dispatch import KernelPolicy
from dflash_jax.quant import quantize_fp8, quantize_q8_0
from pallas_kernels import inject as I
from pallas_kernels import norm_rope as N
from pallas_kernels import ring_attention as R
from pallas_kernels import skinny_gemm as G
from pallas_kernels._common import next_pow2, resolve_interpret

POLICY = KernelPolicy()   # the default knobs' thresholds
# A timed call streams at least this many weight bytes (copies of a smaller matrix in turn), so
# that no matrix is served from L2 (50 MB on the H100, 60 MB on the H200) as none is in a step.
COLD_BYTES = 160 << 20


def _emit(out: list, row: dict) -> None:
  """One configuration's result: printed as a JSON line at once (a sweep cut short keeps what
  it printed) and collected for the output file."""
  print(json.dumps(row), flush=True)
  out.append(row)


def _xla_dot_bf16(x, w):
  """XLA's own GEMM x @ w^T on bf16 inputs with float32 accumulation: the skinny kernel's peer."""
  return jax.lax.dot_general(x.astype(jnp.bfloat16), w, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)


def _tbps(nbytes: int, us: float | None) -> float | None:
  return None if us is None else nbytes / us / 1e6


def _time(f, *args, iters=30):
  try:
    per = C.cupti_kernels(jax.jit(f), *args, iterations=iters)
  except Exception as e:  # a tile config that does not compile (e.g. shared memory) is data
    return None, f"{type(e).__name__}: {str(e)[:160]}"
  return C.device_ms(per) * 1e3, None


def _time_cold(f, x, w, scale, cold_bytes: int = COLD_BYTES):
  """(us of one f(x, w[, scale]) with w read from memory, error): a call runs f on enough
  copies of w (and its scale) to stream cold_bytes, in turn, and the time is divided by their
  count."""
  nbytes = w.nbytes + (0 if scale is None else scale.nbytes)
  copies = [(w, scale)] + [(jnp.array(w, copy=True),
                            None if scale is None else jnp.array(scale, copy=True))
                           for _ in range(-(-cold_bytes // nbytes) - 1)]
  g = ((lambda x, ws: [f(x, wi) for wi, _ in ws]) if scale is None else
       (lambda x, ws: [f(x, wi, si) for wi, si in ws]))
  us, err = _time(g, x, copies)
  return (None if us is None else us / len(copies)), err


def sweep_attention(bw: float) -> list[dict]:
  cfg = dfj.SEED_CONFIG
  w, hkv, d, b, g = 2048, cfg.n_head_kv, cfg.head_dim, cfg.block_size, cfg.group
  key = iter(jax.random.split(jax.random.key(0), 8))
  rnd = lambda s: jax.random.normal(next(key), s, jnp.float32)
  q, k, v = rnd((hkv, b * g, d)), rnd((hkv, b, d)), rnd((hkv, b, d))
  out = []
  for rdt in ("bf16", "fp32"):
    ring = C.full_ring(cfg, w, rdt)
    floor_us = 2 * hkv * w * d * ring.k.dtype.itemsize / bw * 1e6
    grid = [dict(splits=s, block_k=bk, num_warps=4, num_stages=2, terms=t)
            for t in (2, 3)
            for s, bk in ((16, 128), (16, 64), (32, 64), (32, 32), (8, 128), (8, 256))]
    grid += [dict(splits=16, block_k=128, num_warps=nw, num_stages=ns, terms=t)
             for t in (2, 3) for nw, ns in ((4, 1), (4, 3), (8, 2))]
    for kn in grid:
      f = functools.partial(R.ring_attention, layer=cfg.n_layer - 1, window=w, **kn)
      us, err = _time(f, q, k, v, ring.k, ring.v, ring.pos, jnp.int32(w))
      _emit(out, dict(kernel="ring_attention", ring=rdt, us=us, floor_us=floor_us, err=err, **kn))
  return out


def _slot_batch(cfg, n: int, w: int, bw: float):
  """((q, k, v, ring, n_past), ring-read floor us) of n slots' blocks over full bf16 rings of
  w slots at cfg's dims: the inputs of a batched ring attention launch."""
  hkv, d, b, g = cfg.n_head_kv, cfg.head_dim, cfg.block_size, cfg.group
  key = iter(jax.random.split(jax.random.key(n), 4))
  rnd = lambda s: jax.random.normal(next(key), s, jnp.float32)
  q, k, v = rnd((n, hkv, b * g, d)), rnd((n, hkv, b, d)), rnd((n, hkv, b, d))
  ring = C.filled_state(cfg, "bf16", w, w, n_seqs=n).sliding
  floor_us = n * 2 * hkv * w * d * ring.k.dtype.itemsize / bw * 1e6
  return (q, k, v, ring, jnp.full((n,), w, jnp.int32)), floor_us


def sweep_batch_attention(bw: float, slots: tuple[int, ...]) -> list[dict]:
  """Ring attention vmapped over S sequence slots (the batched step's launch), seed dims,
  full bf16 rings, next to the ring-read floor of S rings: splits x block_k x the own keys'
  program (own or folded into chunk 0) per S at 4 warps and 2 stages, then warps x stages x
  query-row tiles around the best two of those."""
  cfg = dfj.SEED_CONFIG
  w = 2048
  out = []
  for n in slots:
    (q, k, v, ring, n_past), floor_us = _slot_batch(cfg, n, w, bw)

    def run(**kn):
      f = jax.vmap(functools.partial(R.ring_attention, layer=cfg.n_layer - 1, window=w,
                                     terms=2, **kn))
      us, err = _time(f, q, k, v, ring.k, ring.v, ring.pos, n_past)
      _emit(out, dict(kernel="ring_attention_vmapped", slots=n, us=us, floor_us=floor_us,
                      err=err, **kn))
      return us

    timed = []
    for splits, bk, fold in itertools.product((1, 2, 4, 8, 16), (64, 128, 256), (False, True)):
      if splits * bk <= w:
        timed.append((run(splits=splits, block_k=bk, fold_own=fold), splits, bk, fold))
    best = sorted((t for t in timed if t[0] is not None))[:2]
    for _, splits, bk, fold in best:
      for nw, ns, bq in itertools.product((4, 8), (1, 2, 3, 4), (None, 32)):
        if (nw, ns, bq) != (4, 2, None):
          run(splits=splits, block_k=bk, fold_own=fold, num_warps=nw, num_stages=ns,
              block_q=bq)
  return out


GEMM_SHAPES = {"qkv": (6144, 6656), "o": (6656, 4096), "gate_up": (39936, 6656),
               "down": (6656, 19968), "lm_head8k": (8192, 6656)}
# The Qwen3-8B target's GEMMs (issue 41; gate_up as one plain [2 F, E] product): not in the
# default --shapes, named with --shapes t_qkv,t_o,...
TARGET_GEMM_SHAPES = {"t_qkv": (6144, 4096), "t_o": (4096, 4096), "t_gate_up": (24576, 4096),
                      "t_down": (4096, 12288), "t_lm_head": (151936, 4096)}
# DFlash2's per-sublayer coefficient projection at the seed dims (DFLASH2_CONFIG: 2 sides x
# kernel 2 x 6656 / 16 groups outputs): also named with --shapes.
FAMILY_GEMM_SHAPES = {"d2_coef": (1664, 6656)}


def sweep_gemm(bw: float, fmts: tuple[str, ...], shapes: tuple[str, ...],
               wide: bool = False, split_ks: tuple[int, ...] = ()) -> list[dict]:
  rng = np.random.default_rng(0)
  out = []
  x = jnp.asarray(rng.standard_normal((16, 19968), np.float32))
  for name, (n, k) in {**GEMM_SHAPES, **TARGET_GEMM_SHAPES, **FAMILY_GEMM_SHAPES}.items():
    if name not in shapes:
      continue
    w32 = (jax.random.normal(jax.random.key(1), (n, k), jnp.float32) / np.sqrt(k))
    xs = x[:, :k]
    weights = {"bf16": (w32.astype(jnp.bfloat16), None)}
    w8, s8 = quantize_fp8(np.asarray(w32))
    weights["fp8"] = (jnp.asarray(w8), jnp.asarray(s8))
    qs, dq = quantize_q8_0(np.asarray(w32))
    weights["q8_0"] = (jnp.asarray(qs), jnp.asarray(dq))
    us, err = _time_cold(_xla_dot_bf16, xs, weights["bf16"][0], None)
    _emit(out, dict(kernel="xla_dot_bf16", shape=name, n=n, k=k, us=us, err=err,
                    TBps=_tbps(n * k * 2, us)))
    for fmt, (wq, sc) in weights.items():
      if fmt not in fmts:
        continue
      nbytes = wq.nbytes + (0 if sc is None else sc.nbytes)
      splits = ((2, 4, 8) if wide else (1, 4)) if n <= 8192 else (1,)
      splits = split_ks or splits
      tiles = (((32, 64), (128, 256, 512), (3, 5), (4, 8)) if wide
               else ((32, 64), (128, 256), (3,), (4,)))
      for bn, bk, ns, nw, sk in itertools.product(*tiles, splits):
        if sk > k // bk:
          continue
        f = functools.partial(G.skinny_matmul, fmt=fmt, block_n=bn, block_k=bk, num_stages=ns,
                              num_warps=nw, split_k=sk)
        us, err = _time_cold(f, xs, wq, sc)
        _emit(out, dict(kernel="skinny", fmt=fmt, shape=name, n=n, k=k, block_n=bn, block_k=bk,
                        num_stages=ns, num_warps=nw, split_k=sk, us=us, err=err,
                        TBps=_tbps(nbytes, us)))
  return out


def sweep_gate_up(fmts: tuple[str, ...]) -> list[dict]:
  """The fused gate+up kernel (two weight streams, silu * up epilogue) at the seed's size."""
  n_ff, k = 19968, 6656
  x = jax.random.normal(jax.random.key(0), (16, k), jnp.float32)
  w32 = np.asarray(jax.random.normal(jax.random.key(1), (2 * n_ff, k), jnp.float32)) / np.sqrt(k)
  out = []
  for fmt in fmts:
    if fmt == "fp8":
      wq, sc = (jnp.asarray(a) for a in quantize_fp8(w32))
    else:
      wq, sc = (jnp.asarray(a) for a in quantize_q8_0(w32))
    nbytes = wq.nbytes + sc.nbytes
    for bn, bk, nw in itertools.product((32, 64), (128, 256), (4, 8)):
      f = functools.partial(G.skinny_matmul_gate_up, fmt=fmt, block_n=bn, block_k=bk,
                            num_warps=nw, num_stages=3)
      us, err = _time(f, x, wq, sc)
      _emit(out, dict(kernel="skinny_gate_up", fmt=fmt, block_n=bn, block_k=bk, num_warps=nw,
                      us=us, err=err, TBps=_tbps(nbytes, us)))
  return out


# Attention shapes: (name, Hkv, T, G, D, S, window, n_past). The seed first: the other rows'
# floor fractions compare with it. Full caches read only their chunks below n_past.
ATTN_SHAPES = [
    ("seed", 8, 16, 4, 128, 2048, 2048, 2048),
    ("block10", 8, 10, 4, 128, 2048, 2048, 2048),
    ("block7", 8, 7, 4, 128, 2048, 2048, 2048),
    ("group3", 8, 16, 3, 128, 2048, 2048, 2048),
    ("window3000", 8, 16, 4, 128, 3000, 3000, 3000),
    ("window48", 8, 16, 4, 128, 48, 48, 48),
    ("head_dim96", 8, 16, 4, 96, 2048, 2048, 2048),
    ("head_dim256", 8, 16, 4, 256, 2048, 2048, 2048),
    ("full8192_npast8192", 8, 16, 4, 128, 8192, None, 8192),
    ("full40960_npast4096", 8, 16, 4, 128, 40960, None, 4096),
    ("full40960_npast40960", 8, 16, 4, 128, 40960, None, 40960),
]
# Alternatives to default_knobs (12 chunks of 256 slots) for the 3000-slot bf16 window:
# 24 chunks of one 128-slot tile, 24 of two 64-slot tiles, 47 of one 64-slot tile.
ATTN_ALT = {"window3000": [dict(splits=24, block_k=128), dict(splits=24, block_k=64),
                           dict(splits=48, block_k=64)]}


# qk_norm_rope / inject at the block widths: (name, Hkv, T, G, D).
BLOCK_SHAPES = [("seed", 8, 16, 4, 128), ("block10", 8, 10, 4, 128), ("block7", 8, 7, 4, 128),
                ("group3", 8, 16, 3, 128), ("head_dim96", 8, 16, 4, 96)]
# GEMMs (M = 16): (name, N of one weight stream, K, gate_up).
GEMM_ODD = [("seed_qkv", 6144, 6656, False), ("group3_qkv", 5120, 6656, False),
            ("group3_o", 6656, 3072, False), ("lm_head1000", 1000, 6656, False),
            ("k6696", 6144, 6696, False), ("k6752", 6144, 6752, False),
            ("gate_up_seed", 19968, 6656, True), ("gate_up_20008", 20008, 6656, True)]


def _ring(key, hkv: int, s: int, d: int, n_fill: int, ring_dtype):
  """A 2-layer ring / cache with slots 0..n_fill-1 holding positions 0.., the rest empty."""
  kk, kv = jax.random.split(key)
  shape = (2, hkv, s, d)
  pos = jnp.where(jnp.arange(s) < n_fill, jnp.arange(s), -1).astype(jnp.int32)
  return (jax.random.normal(kk, shape, jnp.float32).astype(ring_dtype),
          jax.random.normal(kv, shape, jnp.float32).astype(ring_dtype), pos)


def sweep_shapes(bw: float) -> list[dict]:
  """Kernels at the published shapes with their default knobs (us, byte floor, fraction)."""
  out = []
  emit = functools.partial(_emit, out)

  key = iter(jax.random.split(jax.random.key(3), 64))
  rnd = lambda shape: jax.random.normal(next(key), shape, jnp.float32)
  for rdt in (jnp.bfloat16, jnp.float32):
    for name, hkv, t, g, d, s, window, n_past in ATTN_SHAPES:
      q, k, v = rnd((hkv, t * g, d)), rnd((hkv, t, d)), rnd((hkv, t, d))
      rk, rv, pos = _ring(next(key), hkv, s, d, min(n_past, s), rdt)
      # The ring bytes that must be read: the slots below n_past (all of a sliding ring).
      floor_us = 2 * hkv * min(n_past, s) * d * jnp.dtype(rdt).itemsize / bw * 1e6
      for kn in [R.default_knobs(s, window, rdt, head_dim=d,
                                 fold_own_min_seqs=POLICY.fold_own_min_seqs).kwargs()] + (
          ATTN_ALT.get(name, []) if rdt == jnp.bfloat16 else []):
        kn = dict(dict(terms=2 if rdt == jnp.bfloat16 else 3), **kn)
        f = functools.partial(R.ring_attention, layer=1, window=window, **kn)
        us, err = _time(f, q, k, v, rk, rv, pos, jnp.int32(n_past))
        emit(dict(kernel="ring_attention", shape=name, ring=jnp.dtype(rdt).name, us=us,
                  floor_us=floor_us, floor_fraction=None if us is None else floor_us / us,
                  chunks=R.chunking(s, kn["splits"], kn["block_k"])[1], err=err, **kn))
  # qk_norm_rope (4 split-K partials, as in the step) and inject at the block widths.
  for name, hkv, t, g, d in BLOCK_SHAPES:
    qkv = rnd((4, t, (hkv * g + 2 * hkv) * d))
    f = functools.partial(N.qk_norm_rope, n_head=hkv * g, n_head_kv=hkv, eps=1e-6)
    us, err = _time(f, qkv, rnd((d,)), rnd((d,)), jnp.int32(100), rnd((d // 2,)))
    emit(dict(kernel="qk_norm_rope", shape=name, us=us, err=err))
    rk, rv, pos = _ring(next(key), hkv, 2048, d, 2048, jnp.bfloat16)
    rk, rv = jnp.concatenate([rk] * 3)[:5], jnp.concatenate([rv] * 3)[:5]   # 5 layers
    kv = rnd((t, 5, 2, hkv, d))
    f = functools.partial(I.inject, eps=1e-6)
    us, err = _time(f, rk, rv, pos, kv, rnd((5, d)), jnp.arange(2040, 2040 + t, dtype=jnp.int32),
                    jnp.int32(t), rnd((d // 2,)))
    emit(dict(kernel="inject", shape=name, us=us, err=err))
  # Skinny GEMMs at odd N / K (M = 16) with default_knobs, next to XLA's bf16 GEMM.
  x = rnd((16, max(k for _, _, k, _ in GEMM_ODD)))
  for name, n, k, gate_up in GEMM_ODD:
    rows = 2 * n if gate_up else n
    w32 = jax.random.normal(next(key), (rows, k), jnp.float32) / np.sqrt(k)
    xs = x[:, :k]
    us, err = _time(_xla_dot_bf16, xs, w32.astype(jnp.bfloat16))
    emit(dict(kernel="xla_dot_bf16", shape=name, n=rows, k=k, us=us, err=err,
              TBps=_tbps(rows * k * 2, us)))
    for fmt in ("bf16", "fp8", "q8_0"):
      if fmt == "q8_0" and k % 32:
        continue
      if fmt == "bf16":
        wq, sc = w32.astype(jnp.bfloat16), None
      else:
        quant = quantize_fp8 if fmt == "fp8" else quantize_q8_0
        wq, sc = (jnp.asarray(a) for a in quant(np.asarray(w32)))
      kn = G.default_knobs(fmt, n, k, gate_up,
                           swap_ab_min_m=POLICY.skinny_fp8_swap_min_m).kwargs()
      fn = G.skinny_matmul_gate_up if gate_up else G.skinny_matmul
      f = functools.partial(fn, fmt=fmt, **kn)
      us, err = _time(f, xs, wq, sc)
      nbytes = wq.nbytes + (0 if sc is None else sc.nbytes)
      emit(dict(kernel="skinny_gate_up" if gate_up else "skinny", fmt=fmt, shape=name, n=rows,
                k=k, us=us, err=err, TBps=_tbps(nbytes, us), **kn))
  return out


# The seed's GEMMs of the batched-row probes: (name, N of one weight stream, K, gate_up).
BATCH_GEMMS = (("qkv", 6144, 6656, False), ("down", 6656, 19968, False),
               ("gate_up", 19968, 6656, True))


def sweep_rows(fmts: tuple[str, ...], rows: tuple[int, ...]) -> list[dict]:
  """Skinny-GEMM tiles at batched row counts (S x w rows): one M tile of all rows (the weights
  streamed once) against 64-row tiles (4 warps; 8 for larger tiles), plain and swapped
  (swap_ab), for the seed's qkv, down and fused gate+up, next to XLA's bf16 GEMM at the same M
  (issue 14's crossover)."""
  out = []
  key = iter(jax.random.split(jax.random.key(4), 32))
  for name, n, k, gate_up in BATCH_GEMMS:
    n_w = 2 * n if gate_up else n
    w32 = np.asarray(jax.random.normal(next(key), (n_w, k), jnp.float32)) / np.sqrt(k)
    weights = {"bf16": (jnp.asarray(w32, jnp.bfloat16), None)}
    if "fp8" in fmts:
      weights["fp8"] = tuple(jnp.asarray(a) for a in quantize_fp8(w32))
    del w32
    fn = G.skinny_matmul_gate_up if gate_up else G.skinny_matmul
    for m in rows:
      x = jax.random.normal(next(key), (m, k), jnp.float32)
      us, err = _time(_xla_dot_bf16, x, weights["bf16"][0])
      _emit(out, dict(kernel="xla_dot_bf16", shape=name, m=m, us=us, err=err,
                      TBps=_tbps(n_w * k * 2, us)))
      for fmt in fmts:
        wq, sc = weights[fmt]
        nbytes = wq.nbytes + (0 if sc is None else sc.nbytes)
        base = G.default_knobs(fmt, n, k, gate_up,
                               swap_ab_min_m=POLICY.skinny_fp8_swap_min_m).kwargs()
        grid = [(bm, bn, False) for bm in sorted({min(64, m), m}) for bn in (32, 64, 128)]
        grid += [(bm, bn, True) for bm in sorted({min(64, m), min(128, m)}) for bn in (64, 128)]
        for bm, bn, swap in grid:
          kn = dict(base, block_m=bm, num_warps=4 if bm <= 64 else 8, block_n=bn,
                    swap_ab=swap)
          us, err = _time(functools.partial(fn, fmt=fmt, **kn), x, wq, sc)
          _emit(out, dict(kernel="skinny", fmt=fmt, shape=name, m=m, us=us, err=err,
                          TBps=_tbps(nbytes, us), **kn))
    del weights
  return out


def sweep_mixed(rows: tuple[int, ...]) -> list[dict]:
  """XLA's own GEMM on 1-byte weights widened inside the dot's operand (fp8: convert to bf16,
  the row scale after the dot; q8_0: int8 times its 32-block scales rounded to bf16), next to
  its bf16 GEMM, at batched row counts: can XLA's GEMM fusion stream 1-byte weights? (gate_up
  as one plain GEMM, no silu epilogue.)"""
  out = []
  fp8 = lambda x, w, s: _xla_dot_bf16(x, w.astype(jnp.bfloat16)) * s[None, :]
  q8 = lambda x, w, d: _xla_dot_bf16(
      x, (w.astype(jnp.float32) * jnp.repeat(d, 32, axis=1)).astype(jnp.bfloat16))
  key = iter(jax.random.split(jax.random.key(5), 32))
  for name, n, k, gate_up in BATCH_GEMMS:
    n_w = 2 * n if gate_up else n
    w32 = np.asarray(jax.random.normal(next(key), (n_w, k), jnp.float32)) / np.sqrt(k)
    wb = jnp.asarray(w32, jnp.bfloat16)
    w8, s8 = (jnp.asarray(a) for a in quantize_fp8(w32))
    qs, dq = (jnp.asarray(a) for a in quantize_q8_0(w32))
    del w32
    for m in rows:
      x = jax.random.normal(next(key), (m, k), jnp.float32)
      for kernel, f, args, nbytes in (("xla_bf16", _xla_dot_bf16, (wb,), wb.nbytes),
                                      ("xla_fp8w", fp8, (w8, s8), w8.nbytes + s8.nbytes),
                                      ("xla_q8w", q8, (qs, dq), qs.nbytes + dq.nbytes)):
        us, err = _time(f, x, *args)
        _emit(out, dict(kernel=kernel, shape=name, m=m, us=us, err=err, TBps=_tbps(nbytes, us)))
    del wb, w8, s8, qs, dq
  return out


def sweep_mgpu(rows: tuple[int, ...]) -> list[dict]:
  """Probe: jax's Mosaic GPU Hopper matmul (TMA + wgmma, warp-specialized, persistent grid) on
  the seed's bf16 weights at batched row counts, as out^T = W [N, K] @ x^T [K, M] so that the
  weights keep their (out, in) layout; next to XLA's GEMM. Speed only (bf16 output; gate_up as
  one plain GEMM)."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as H
  out = []
  key = iter(jax.random.split(jax.random.key(6), 32))
  for name, n, k, gate_up in BATCH_GEMMS:
    n_w = 2 * n if gate_up else n
    w = (jax.random.normal(next(key), (n_w, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    for m in rows:
      x = jax.random.normal(next(key), (m, k), jnp.float32).astype(jnp.bfloat16)
      us, err = _time(_xla_dot_bf16, x, w)
      _emit(out, dict(kernel="xla_dot_bf16", shape=name, m=m, us=us, err=err,
                      TBps=_tbps(w.nbytes, us)))
      xt = jnp.asarray(x.T)   # [K, M]: the kernel's right operand, M contiguous
      for tm, tn, tk, wg in itertools.product((64, 128), (64, 128), (64, 128),
                                              (H.MatmulDimension.M, H.MatmulDimension.N)):
        cta_n = tn * (2 if wg == H.MatmulDimension.N else 1)
        if m % cta_n or k % tk:
          continue
        cfg = H.TuningConfig(tile_m=tm, tile_n=tn, tile_k=tk, max_concurrent_steps=4,
                             wg_dimension=wg, epi_tile_n=min(64, tn), epi_tile_m=min(64, tm))
        us, err = _time(lambda a, b, cfg=cfg: H.matmul(a, b, None, cfg), w, xt)
        _emit(out, dict(kernel="mgpu_matmul", shape=name, m=m, tile_m=tm, tile_n=tn, tile_k=tk,
                        steps=4, wg=str(wg), us=us, err=err, TBps=_tbps(w.nbytes, us)))
    del w
  return out


def sweep_batched_gemm(rows: tuple[int, ...], fmts: tuple[str, ...],
                       shapes_wanted: tuple[str, ...] = ("qkv", "o", "gate_up", "down"),
                       block_ks: tuple[int, ...] = (64, 128),
                       stages: tuple[int, ...] = (2, 3, 4, 5, 6),
                       wg_splits: tuple[str, ...] = ("rows",)) -> list[dict]:
  """pallas_kernels.batched_gemm on the seed's matrices with their round epilogues (qkv
  plain, o and down + residual, gate_up silu * up; encode's fc and the inject GEMM plain), bf16
  or fp8 weights, block_k x stages x wg_split, next to the path outside the kernel in one jit:
  XLA's dot + the same epilogue for bf16, the skinny GEMM for fp8 (err: max |kernel - twin|).
  (Wider column tiles and K splits were slower and left the kernel; RESULTS.md, "New kernel
  pallas_kernels/batched_gemm.py".)"""
  from dflash_jax.dispatch import gemm_knobs
  from pallas_kernels import batched_gemm as BG
  shapes = {"qkv": (6144, 6656, "none"), "o": (6656, 4096, "residual"),
            "gate_up": (19968, 6656, "gate_up"), "down": (6656, 19968, "residual"),
            "fc": (6656, 33280, "none"), "inject": (10240, 6656, "none")}
  out = []
  key = iter(jax.random.split(jax.random.key(8), 64))
  for name, (n, k, ep) in shapes.items():
    if name not in shapes_wanted:
      continue
    n_w = 2 * n if ep == "gate_up" else n
    w32 = jax.random.normal(next(key), (n_w, k), jnp.float32) / np.sqrt(k)
    od = jnp.bfloat16 if ep == "gate_up" else jnp.float32
    for fmt in fmts:
      if fmt == "fp8":
        w8, sc = quantize_fp8(np.asarray(w32))
        w, scale = jnp.asarray(w8), jnp.asarray(sc)
      else:
        w, scale = w32.astype(jnp.bfloat16), None
      nbytes = w.nbytes + (0 if scale is None else scale.nbytes)
      for m in rows:
        x = jax.random.normal(next(key), (m, k), jnp.float32).astype(jnp.bfloat16)
        r = jax.random.normal(next(key), (m, n), jnp.float32) if ep == "residual" else None
        twin = jax.jit(lambda x, w, s, r: BG.batched_matmul_reference(
            x, w, r, scale=s, epilogue=ep, out_dtype=od))
        want = twin(x, w, scale, r)
        if fmt == "fp8":
          kn = gemm_knobs("fp8", n, k, ep == "gate_up", m, policy=POLICY).kwargs()
          if ep == "gate_up":
            base = lambda x, w, s, r, kn=kn: G.skinny_matmul_gate_up(x, w, s, fmt="fp8",
                                                                     out_dtype=od, **kn)
          else:
            base = lambda x, w, s, r, kn=kn: (0.0 if r is None else r) + G.skinny_matmul(
                x, w, s, fmt="fp8", **kn)
          label = "skinny_fp8"
        else:
          base, label = twin, "xla_dot_epilogue"
        us, err = _time(base, x, w, scale, r, iters=20)
        _emit(out, dict(kernel=label, fmt=fmt, shape=name, m=m, us=us, err=err,
                        TBps=_tbps(nbytes, us)))
        for bk, st, ws in itertools.product(block_ks, stages, wg_splits):
          if not BG.fits(m, n, k, ep, od, bk, st, fmt, ws):
            continue
          f = jax.jit(lambda x, w, s, r, kn=dict(block_k=bk, max_concurrent_steps=st,
                                                 wg_split=ws):
                      BG.batched_matmul(x, w, r, scale=s, epilogue=ep, out_dtype=od, **kn))
          us, err = _time(f, x, w, scale, r, iters=20)
          if err is None:
            got = f(x, w, scale, r).astype(jnp.float32)
            err = float(jnp.max(jnp.abs(got - want.astype(jnp.float32))))
          _emit(out, dict(kernel="batched_gemm", fmt=fmt, shape=name, m=m, block_k=bk,
                          steps=st, wg_split=ws, us=us, err=err, TBps=_tbps(nbytes, us)))
      del w, scale
  return out


def sweep_norm(rows: tuple[int, ...]) -> list[dict]:
  """The RMS norm in front of a bf16 GEMM at the seed's n_embd: XLA's fusion (the step's
  `dispatch.rms_norm` + the bf16 rounding) next to pallas_kernels.rms_norm's rows x num_warps
  (err: max |kernel - XLA|)."""
  from dflash_jax.dispatch import rms_norm as xla_norm
  from pallas_kernels import rms_norm as RN
  k, eps, out = dfj.SEED_CONFIG.n_embd, dfj.SEED_CONFIG.eps, []
  key = iter(jax.random.split(jax.random.key(9), 16))
  w = jax.random.normal(next(key), (k,), jnp.float32)
  for m in rows:
    x = 3 * jax.random.normal(next(key), (m, k), jnp.float32)
    nbytes = m * k * 6 + k * 4
    f_xla = lambda x, w: xla_norm(x, w, eps).astype(jnp.bfloat16)
    want = jax.jit(f_xla)(x, w)
    us, err = _time(f_xla, x, w)
    _emit(out, dict(kernel="xla_norm", m=m, us=us, err=err, TBps=_tbps(nbytes, us)))
    for r, nw in itertools.product((1, 2, 4), (4, 8, 16)):
      f = lambda x, w, r=r, nw=nw: RN.rms_norm(x, w, eps=eps, rows=r, num_warps=nw)
      us, err = _time(f, x, w)
      if err is None:
        err = float(jnp.max(jnp.abs(jax.jit(f)(x, w).astype(jnp.float32)
                                    - want.astype(jnp.float32))))
      _emit(out, dict(kernel="pallas_norm", m=m, rows=r, num_warps=nw, us=us, err=err,
                      TBps=_tbps(nbytes, us)))
  return out


# Qwen3-30B-A3B's experts (hidden 2048, expert ffn 768, 128 experts, 8 per token).
MOE_DIMS = dict(hidden=2048, ffn=768, experts=128, top_k=8)


def sweep_moe(rows: tuple[int, ...] = (1, 16), dims: dict = MOE_DIMS,
              block_ns=(16, 32, 64), block_ks=(128, 256), stages=(3, 4, 5),
              warps=(4,), iters: int = 30) -> list[dict]:
  """pallas_kernels.moe_gemm at a MoE target's decode (1 row: its 8 experts) and verify (16
  rows: the experts they touch): the gate+up and the routed down projections over block_n x
  block_k x num_stages x num_warps, the default knobs marked. Each timed call runs the GEMM
  over successive expert lists that cycle through every expert (at 1 row) or touch most of
  them (at 16), so the weights come from memory; TBps counts the touched experts' bytes.
  err: max |kernel - twin| of the first list."""
  from pallas_kernels import moe_gemm as MG
  h, f, e, k = dims["hidden"], dims["ffn"], dims["experts"], dims["top_k"]
  key = iter(jax.random.split(jax.random.key(11), 64))
  w_gu = (jax.random.normal(next(key), (e, 2 * f, h), jnp.float32) / np.sqrt(h)).astype(
      jnp.bfloat16)
  w_d = (jax.random.normal(next(key), (e, h, f), jnp.float32) / np.sqrt(f)).astype(jnp.bfloat16)
  rng = np.random.default_rng(0)
  out = []
  for m in rows:
    disjoint = m * k < e   # lists that cover the experts: every call reads new ones
    lists, routes = [], []
    perm = rng.permutation(e)
    for i in range(e // (m * k) if disjoint else 4):
      if disjoint:
        ids = perm[i * m * k:(i + 1) * m * k].reshape(m, k)
      else:
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(m)])
      touched = np.unique(ids)
      slots = np.full(min(e, m * k), -1, np.int32)
      slots[:touched.size] = touched
      lists.append(jnp.asarray(slots))
      routes.append((jnp.asarray(ids, jnp.int32),
                     jnp.asarray(rng.random((m, k)), jnp.float32)))
    n_touched = float(np.mean([int((np.asarray(sl) >= 0).sum()) for sl in lists]))
    # bf16 rows, as the pre-norm feeds the experts: a float32 input makes the 32-wide gate+up
    # tiles 1.65x slower (RESULTS.md run 45), a cost the decode never pays.
    x = jax.random.normal(next(key), (m, h), jnp.float32).astype(jnp.bfloat16)
    hid = jax.random.normal(next(key), (m, f), jnp.float32).astype(jnp.bfloat16)
    for gate_up in (True, False):
      w = w_gu if gate_up else w_d
      n, kk = (f, h) if gate_up else (h, f)
      inp = x if gate_up else hid
      default = MG.default_knobs(n, kk, gate_up)
      nbytes = n_touched * w[0].nbytes

      def run(kn, gate_up=gate_up):
        extra = dict(gate_up=True, out_dtype=jnp.bfloat16) if gate_up else {}
        return lambda a, ws, ls, rs: [
            MG.moe_matmul(a, ws, sl, routes=None if gate_up else r, **extra, **kn)
            for sl, r in zip(ls, rs)]

      twin = (MG.moe_matmul_reference(inp, w, lists[0], gate_up=True) if gate_up else
              MG.moe_matmul_reference(inp, w, lists[0], routes=routes[0]))
      points = [dict(block_n=bn, block_k=bk, num_stages=st, num_warps=nw)
                for bn, bk, st, nw in itertools.product(block_ns, block_ks, stages, warps)
                if n % bn == 0 and kk % bk == 0]
      if default not in points:
        points.insert(0, default)
      for kn in points:
        f_ = run(kn)
        us, err = _time(f_, inp, w, lists, routes, iters=iters)
        if err is None:   # the timed program's first list against the twin
          us /= len(lists)
          got = jax.jit(f_)(inp, w, lists, routes)[0]
          err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - twin.astype(jnp.float32))))
        _emit(out, dict(kernel="moe_matmul", gate_up=gate_up, m=m, experts_touched=n_touched,
                        default=kn == default, us=us, err=err, TBps=_tbps(nbytes, us), **kn))
  return out


def _gridbar_kernel(cnt_in, cnt_ref, o_ref, *, programs: int, barriers: int, max_polls: int):
  """Each program: `barriers` times, bump the counter by 1 and poll it (an atomic add of 0)
  until it holds programs x (barriers so far), giving up after max_polls polls; stores its
  poll count, or -1 where it gave up. The counter is float32 (exact to 2^24): Pallas Triton
  lowers an integer tensor's atomic add to a float add (RESULTS.md run 45)."""
  del cnt_in   # aliased to cnt_ref
  at0 = (pl.ds(0, 1),)

  def poll():
    return jnp.sum(plt.atomic_add(cnt_ref, at0, jnp.zeros((1,), jnp.float32)))

  def barrier(b, polls):
    plt.atomic_add(cnt_ref, at0, jnp.ones((1,), jnp.float32))
    target = ((b + 1) * programs).astype(jnp.float32)
    v, n = lax.while_loop(lambda c: (c[0] < target) & (c[1] < max_polls),
                          lambda c: (poll(), c[1] + 1), (poll(), jnp.int32(1)))
    return jnp.where((polls < 0) | (v < target), -1, polls + n)

  polls = lax.fori_loop(0, barriers, barrier, jnp.int32(0))
  o_ref[...] = jnp.full((16,), polls, jnp.int32)


def sweep_gridbar(programs=(32, 132, 264), barriers=(0, 1, 8, 32), max_polls: int = 1 << 20,
                  iters: int = 20) -> list[dict]:
  """Premise probe for a persistent decoder layer: the cost of a grid-wide barrier (an atomic
  counter every program bumps, then polls) in a Pallas Triton kernel of `programs` programs
  (4 warps each, all resident on an H100 / H200 up to a few per SM), CUPTI us of the kernel
  at each barrier count and, per program count, us per barrier (the slope). ok: every program
  passed every barrier (a program that gives up after max_polls polls marks the row not ok
  instead of hanging; on the CPU, which interprets programs one after another, only one
  program can pass a barrier)."""
  out = []
  for p in programs:
    us_at = {}
    for b in barriers:
      call = pl.pallas_call(
          functools.partial(_gridbar_kernel, programs=p, barriers=b, max_polls=max_polls),
          grid=(p,), in_specs=[pl.BlockSpec((16,), lambda i: (0,))],
          out_specs=[pl.BlockSpec((16,), lambda i: (0,)), pl.BlockSpec((16,), lambda i: (i,))],
          out_shape=[jax.ShapeDtypeStruct((16,), jnp.float32),
                     jax.ShapeDtypeStruct((16 * p,), jnp.int32)],
          input_output_aliases={0: 0},
          compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
          interpret=resolve_interpret(None), name=f"gridbar_{b}")
      f = jax.jit(lambda: call(jnp.zeros((16,), jnp.float32)))
      cnt, polls = f()
      ok = float(cnt[0]) == b * p and bool(jnp.all(polls >= 0))
      per = C.cupti_kernels(f, iterations=iters)
      # the kernel's own time (not the counter's zeroing); the CPU stand-in's one entry
      us = float(np.median([sum(t for k, t in it if not C.ON_GPU or k.startswith("gridbar"))
                            for it in per])) * 1e3
      us_at[b] = us
      _emit(out, dict(kernel="gridbar", programs=p, barriers=b, ok=ok, us=us,
                      max_polls=int(jnp.max(polls)), counter=float(cnt[0])))
    top = max(barriers)
    if top > 0 and 0 in us_at:
      _emit(out, dict(kernel="gridbar_slope", programs=p,
                      us_per_barrier=(us_at[top] - us_at[0]) / top))
  return out


def sweep_top_k(vocabs: tuple[int, ...], blocks=(512, 1024, 2048, 4096), warps=(4, 8, 16),
                merge_warps=(4, 16), k: int = 16, rows: int = 16) -> list[dict]:
  """The selector's top-k of rows 1..rows-1 of one block's float32 logits: lax.top_k, the
  Pallas kernel's default knobs, then every (block_v, num_warps, merge_warps); err: whether
  the values and indices differ from lax.top_k's (0 or 1; a knob that changes the answer is a
  bug, not a result)."""
  from pallas_kernels import top_k as TK
  out, key = [], jax.random.key(11)
  for v in vocabs:
    x = 3 * jax.random.normal(jax.random.fold_in(key, v), (1, rows, v), jnp.float32)
    ref = lambda x: jax.lax.top_k(x[:, 1:], k)
    want = ref(x)
    us, err = _time(ref, x)
    nbytes = (rows - 1) * v * 4
    _emit(out, dict(kernel="xla_top_k", v=v, k=k, us=us, err=err, TBps=_tbps(nbytes, us)))
    d = TK.default_knobs(v, k)
    grid = [(None, None, None)] + [c for c in itertools.product(blocks, warps, merge_warps)
                                   if c[0] >= k and c[0] <= next_pow2(v)]
    for block_v, nw, mw in grid:
      f = lambda x, b=block_v, nw=nw, mw=mw: TK.top_k(x, k=k, first=1, block_v=b, num_warps=nw,
                                                      merge_warps=mw)
      us, err = _time(f, x)
      if err is None:
        got = jax.jit(f)(x)
        err = int(not (bool(jnp.all(got[0] == want[0])) and bool(jnp.all(got[1] == want[1]))))
      _emit(out, dict(kernel="pallas_top_k", v=v, k=k, default=block_v is None,
                      block_v=block_v or d.block_v, num_warps=nw or d.num_warps,
                      merge_warps=mw or d.merge_warps, us=us, err=err,
                      TBps=_tbps(nbytes, us)))
  return out


def sweep_mgpu_attention(bw: float) -> list[dict]:
  """Premise probe for the batched ring attention: jax's Mosaic GPU attention (TMA + wgmma,
  warp-specialized) on the work of S = 8 slots at the seed's dims: per (slot, kv head) 64
  packed query rows (16 tokens x 4 heads, padded to 2 x block_q = 128) over 2048 bf16 keys cut
  into `chunks` (batch = 8 slots x 8 kv heads x chunks, one head). No ring mask, no combine,
  bf16 queries: speed only, next to the ring-read floor of S = 8 (RESULTS run 15: the Pallas
  kernel 44.4 us, 35.6 with one bf16 term)."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu as A
  cfg = dfj.SEED_CONFIG
  out = []
  d, hkv, n_slots, window = cfg.head_dim, cfg.n_head_kv, 8, 2048
  floor_us = n_slots * 2 * hkv * window * d * 2 / bw * 1e6   # bf16 rings read once
  for chunks in (1, 4, 8):
    tkv, b = window // chunks, n_slots * hkv * chunks
    key = iter(jax.random.split(jax.random.key(chunks), 3))
    # attention_mgpu takes float16 (the same MMA rate and bytes as bf16)
    q, k, v = (jax.random.normal(next(key), (b, t, 1, d), jnp.float32).astype(jnp.float16)
               for t in (128, tkv, tkv))
    for bkv, steps in ((64, 2), (128, 2), (64, 4)):
      cfg = A.TuningConfig(block_q=64, block_kv=bkv, max_concurrent_steps=steps)
      us, err = _time(lambda q, k, v, cfg=cfg: A.attention(q, k, v, cfg), q, k, v)
      _emit(out, dict(kernel="mgpu_attention", chunks=chunks, keys=tkv, block_kv=bkv,
                      steps=steps, us=us, floor_us=floor_us, err=err))
  return out


def sweep_mgpu_batch_attention(bw: float, slots: tuple[int, ...]) -> list[dict]:
  """The Mosaic GPU batched ring attention (ring_attention_mgpu) next to the vmapped Triton
  kernel with its default knobs, S slots at the seed's dims, full bf16 rings, bf16 out:
  chunks x pipeline stages, each timed from the bf16 parts (as qk_norm_rope emits them) and
  split per launch (partials, combine)."""
  from pallas_kernels import ring_attention_mgpu as M
  cfg = dfj.SEED_CONFIG
  w, d, b = 2048, cfg.head_dim, cfg.block_size
  layer = cfg.n_layer - 1
  out = []
  for n in slots:
    (q, k, v, ring, n_past), floor_us = _slot_batch(cfg, n, w, bw)
    kn = R.default_knobs(w, w, jnp.bfloat16, n_seqs=n,
                         fold_own_min_seqs=POLICY.fold_own_min_seqs).kwargs()
    tri = jax.vmap(functools.partial(R.ring_attention, layer=layer, window=w,
                                     out_dtype=jnp.bfloat16, **kn))
    args = (q, k, v, ring.k, ring.v, ring.pos, n_past)
    us, err = _time(tri, *args)
    _emit(out, dict(kernel="ring_attention_vmapped", slots=n, us=us, floor_us=floor_us,
                    err=err, **kn))
    ref = tri(*args).astype(jnp.float32)
    parts = jax.jit(M.split_operands)(q, k, v)
    for splits, steps in itertools.product((1, 2, 4, 8, 16), (2, 3)):
      if M.smem_bytes(b, d, steps) > M.SMEM_LIMIT:
        continue
      f = functools.partial(M.ring_attention_batched, layer=layer, window=w, splits=splits,
                            steps=steps, out_dtype=jnp.bfloat16)
      margs = (*parts, ring.k, ring.v, ring.pos, n_past)
      us, err = _time(f, *margs)
      row = dict(kernel="ring_attention_mgpu", slots=n, splits=splits, steps=steps,
                 us=us, floor_us=floor_us, err=err)
      if err is None:
        row["max_diff_vs_triton"] = float(jnp.max(jnp.abs(jax.jit(f)(*margs) - ref)))
        row["launches_us"] = [round(ms * 1e3, 2) for _, ms in C.kernel_medians(
            C.cupti_kernels(jax.jit(f), *margs, iterations=20))]
      _emit(out, row)
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("what", nargs="*", default=["attention", "gemm"])
  p.add_argument("--out", default="sweep.json")
  p.add_argument("--fmts", default="bf16,fp8,q8_0", help="GEMM formats")
  p.add_argument("--shapes", default=",".join(GEMM_SHAPES))
  p.add_argument("--wide", action="store_true", help="GEMM: the wide tile grid")
  p.add_argument("--rows", default="32,64,128", help="rows: the M values (comma list)")
  p.add_argument("--slots", default="2,8,32", help="battn: the S values (comma list)")
  p.add_argument("--split-ks", default="", help="GEMM: these split_k values (comma list)")
  p.add_argument("--block-ks", default="64,128", help="bgemm: these block_k values")
  p.add_argument("--stages", default="2,3,4,5,6", help="bgemm: these pipeline depths")
  p.add_argument("--wg-splits", default="rows", help="bgemm: these wg_split values (fp8: rows,k)")
  p.add_argument("--vocabs", default="8192,202048", help="topk: these vocabulary sizes")
  p.add_argument("--moe-rows", default="1,16", help="moe: these row counts (decode, verify)")
  args = p.parse_args(argv)
  bw = C.copy_bandwidth(1 << 30)
  print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
  res = dict(copy_bw_TBps=bw / 1e12, device=jax.devices()[0].device_kind, rows=[])
  if "attention" in args.what:
    res["rows"] += sweep_attention(bw)
  if "mgpu_attn" in args.what:
    res["rows"] += sweep_mgpu_attention(bw)
  if "battn" in args.what:
    res["rows"] += sweep_batch_attention(bw, tuple(int(v) for v in args.slots.split(",")))
  if "gate_up" in args.what:
    res["rows"] += sweep_gate_up(tuple(f for f in args.fmts.split(",") if f != "bf16"))
  if "shapes" in args.what:
    res["rows"] += sweep_shapes(bw)
  rows = tuple(int(v) for v in args.rows.split(","))
  if "bgemm" in args.what:
    ints = lambda v: tuple(int(x) for x in v.split(","))
    res["rows"] += sweep_batched_gemm(
        rows, tuple(f for f in args.fmts.split(",") if f != "q8_0"),
        tuple(args.shapes.split(",")), block_ks=ints(args.block_ks), stages=ints(args.stages),
        wg_splits=tuple(args.wg_splits.split(",")))
  if "mgpu_battn" in args.what:
    res["rows"] += sweep_mgpu_batch_attention(bw, tuple(int(v) for v in args.slots.split(",")))
  if "norm" in args.what:
    res["rows"] += sweep_norm(rows)
  if "topk" in args.what:
    res["rows"] += sweep_top_k(tuple(int(v) for v in args.vocabs.split(",")))
  if "moe" in args.what:
    res["rows"] += sweep_moe(tuple(int(v) for v in args.moe_rows.split(",")))
  if "gridbar" in args.what:
    res["rows"] += sweep_gridbar()
  if "mgpu" in args.what:
    res["rows"] += sweep_mgpu(rows)
  if "mixed" in args.what:
    res["rows"] += sweep_mixed(rows)
  if "rows" in args.what:
    res["rows"] += sweep_rows(tuple(f for f in args.fmts.split(",") if f != "q8_0"), rows)
  if "gemm" in args.what:
    res["rows"] += sweep_gemm(bw, tuple(args.fmts.split(",")), tuple(args.shapes.split(",")),
                              args.wide,
                              tuple(int(v) for v in args.split_ks.split(",") if v))
  with open(args.out, "w") as f:
    json.dump(res, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
