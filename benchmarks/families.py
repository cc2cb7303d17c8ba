"""DFlash2 and DSpark drafter steps against the DFlash step they extend, in one process.

  python -m benchmarks.families --gpu [--pairs seed-v8192,seed-v202048,qwen3-8b-b7]
                                      [--only bytes,steps,scans] [--out results/NAME]
  python -m benchmarks.families --smoke      # CPU, tiny dims, seconds: not results

Pairs (bf16 weights, bf16 ring with every slot live): the seed drafter (5 sliding layers,
window 2048, block 16) as DFlash and as DFlash2 (DFLASH2_CONFIG: Muse-Glimmer-30B-DFlash2's
dims) at vocab 8192 and 202048; Qwen3-8B's drafter shapes at block 7 as DFlash and as DSpark
(DSPARK_QWEN3_8B_CONFIG, 5 full-attention layers over a 2048-slot cache, vocab 151936).
Sections, each pair in turn (results are saved after each, so a run cut short keeps them):
1. bytes: what the block step must read (layer weights, LM head, every cache slot, the
   block's embedding rows, its logits; DFlash2 adds its convolutions), the family's readout
   (DFlash2: the hidden projection and k + 1 gathered codebook rows per draft row; DSpark:
   all of W2 and one W1 row per draft row, the heads), and the byte-floor ratio of the two
   families' steps at the copy bandwidth measured in this run.
2. steps: CUPTI device ms of the block step (the logits) and of the round the decode loop runs
   (`step.propose_round_batched` for one slot: encode + inject of a block of committed rows,
   block step, the family's readout to its drafts), the ratios, launches, and the block
   step's kernels (name, median us) in launch order.
3. scans: each family's readout alone on fixed logits and hidden states (DFlash: the row
   argmax; DFlash2: top-k, hidden projection, edge lattice and the walk; DSpark: the Markov
   chain and the confidence head), device us per round.
Every measured function takes the weights as arguments (no constants in the program). `base`
is the DFlash drafter of a pair, `ext` the family drafter.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp

import dflash_jax as dfj
from benchmarks import common as C
from dflash_jax.config import (DFLASH2_CONFIG, DSPARK_QWEN3_8B_CONFIG, FULL, TINY_DFLASH2_CONFIG,
                               TINY_DSPARK_CONFIG)
from dflash_jax.drafter import step as S


# The drafter's kernels: Pallas on the GPU; their jnp twins elsewhere (interpret mode is slow,
# and a smoke run's numbers are not results).
IMPL = "pallas" if C.ON_GPU else "xla"


@dataclasses.dataclass(frozen=True)
class Pair:
  """A DFlash drafter and the family drafter that extends it, at one vocabulary; the cache
  holds `slots` live positions (n_past = slots)."""
  name: str
  base: dfj.DFlashConfig
  family: dfj.DFlashConfig
  n_vocab: int
  slots: int
  capacity: int | None      # the full-attention cache (None: sliding layers, a ring of slots)


def gpu_pairs() -> list[Pair]:
  seed2 = DFLASH2_CONFIG
  qwen7 = dataclasses.replace(dfj.QWEN3_8B_CONFIG, block_size=7)
  return [Pair("seed-v8192", dfj.SEED_CONFIG, dataclasses.replace(seed2, mask_token_id=8191),
               8192, 2048, None),
          Pair("seed-v202048", dfj.SEED_CONFIG, seed2, 202048, 2048, None),
          Pair("qwen3-8b-b7", qwen7, DSPARK_QWEN3_8B_CONFIG, 151936, 2048, 2048)]


def smoke_pairs() -> list[Pair]:
  tiny = dataclasses.replace(dfj.TINY_CONFIG, window=64)
  tiny7 = dataclasses.replace(dfj.TINY_CONFIG, block_size=7, window=None,
                              layer_types=(FULL,) * dfj.TINY_CONFIG.n_layer, context_length=64)
  return [Pair("tiny-dflash2", tiny, dataclasses.replace(TINY_DFLASH2_CONFIG, window=64), 512,
               64, None),
          Pair("tiny-dspark-b7", tiny7, TINY_DSPARK_CONFIG, 512, 64, 64)]


def step_bytes(params: dfj.DrafterParams, ring: S.RingState) -> int:
  """Bytes one block step must move: every layer weight (DFlash2: its convolutions too), the
  LM head, every cache slot (all live here), the block's embedding rows and its logits."""
  cfg = params.cfg
  convs = 0
  if cfg.family == "dflash2":
    convs = C.tree_bytes((params.family.attn_conv, params.family.ffn_conv))
  embd_rows = cfg.block_size * cfg.n_embd * params.tok_embd.dtype.itemsize
  logits = cfg.block_size * params.n_vocab * 4
  return (C.tree_bytes(params.layers) + convs + C.tree_bytes((params.lm_head, params.out_norm))
          + C.tree_bytes(ring) + embd_rows + logits)


def readout_bytes(params: dfj.DrafterParams) -> int:
  """Bytes the family's readout must read beyond the logits: DFlash2's hidden projection and
  its gathered codebook rows (k per draft row from each table, plus the anchor's); DSpark's
  W2 once per draft row (each row's correction needs the previous row's choice), its W1 rows
  and heads."""
  cfg, f = params.cfg, params.family
  n = cfg.n_drafts()
  if cfg.family == "dflash2":
    k, r = cfg.dflash2.selector_top_k, cfg.dflash2.selector_rank
    rows = (2 * n * k + 1) * r * f.predecessor.dtype.itemsize
    return C.tree_bytes(f.hidden) + rows
  if cfg.family == "dspark":
    r = cfg.dspark.markov_rank
    heads = C.tree_bytes((f.gate, f.joint, f.conf))
    w1 = 2 * n * r * f.markov_w1.dtype.itemsize if r else 0
    return (n * C.tree_bytes(f.markov_w2) if r else 0) + w1 + heads
  return 0


def _ring(cfg: dfj.DFlashConfig, pair: Pair) -> S.RingState:
  return C.filled_state(cfg, "bf16", pair.slots, pair.slots, pair.capacity)


def _round_fn():
  """The decode loop's drafter call for one slot, without donation (measured repeatedly)."""
  return jax.jit(functools.partial(S.propose_round_batched, impl=IMPL))


def bench_pair(pair: Pair, bw: float, iters: int, only: set[str]) -> dict:
  out: dict = dict(pair=pair.name, n_vocab=pair.n_vocab, slots=pair.slots,
                   capacity=pair.capacity, family=pair.family.family, impl=IMPL)
  for role, cfg in (("base", pair.base), ("ext", pair.family)):
    t0 = time.perf_counter()
    params = C.random_params(cfg, pair.n_vocab, "bf16")
    ring = _ring(cfg, pair)
    r: dict = dict(config=cfg.family, block_size=cfg.block_size)
    r["step_bytes"] = step_bytes(params, ring)
    r["readout_bytes"] = readout_bytes(params)
    r["step_floor_ms"] = r["step_bytes"] / bw * 1e3
    r["readout_floor_us"] = r["readout_bytes"] / bw * 1e6
    if "steps" in only:
      scalar = jax.ShapeDtypeStruct((), jnp.int32)
      ring0 = jax.tree.map(lambda a: a[0] if a.ndim and a.shape[0] == 1 else a, ring)
      step = S.block_step_jit.lower(params, ring0, scalar, scalar, impl=IMPL).compile()
      per = C.cupti_kernels(step, params, ring0, jnp.int32(1), jnp.int32(pair.slots),
                            iterations=iters)
      r.update(step_device_ms=C.device_ms(per), step_launches=C.launches(per),
               step_kernels_us=[(n, t * 1e3) for n, t in C.kernel_medians(per)])
      batched = jax.tree.map(lambda a: a[None], ring0)
      feats = jax.random.normal(jax.random.key(3), (1, cfg.block_size, cfg.n_embd_fc))
      rnd = _round_fn()
      args = (params, batched, feats, jnp.array([cfg.block_size], jnp.int32),
              jnp.array([1], jnp.int32), jnp.array([pair.slots], jnp.int32), jnp.ones(1, bool))
      per = C.cupti_kernels(rnd, *args, iterations=max(3, iters // 2))
      per = C.without_copies(per)
      r.update(round_device_ms=C.device_ms(per), round_launches=C.launches(per))
    if "scans" in only:
      r.update(scan_alone(params, iters))
    r["seconds"] = time.perf_counter() - t0
    out[role] = r
    del params, ring
  b, f = out["base"], out["ext"]
  out["step_floor_ratio"] = f["step_floor_ms"] / b["step_floor_ms"]
  out["extra_step_bytes_fraction"] = f["step_bytes"] / b["step_bytes"] - 1
  if "steps" in only:
    out["step_ratio"] = f["step_device_ms"] / b["step_device_ms"]
    out["round_ratio"] = f["round_device_ms"] / b["round_device_ms"]
  return out


def scan_alone(params: dfj.DrafterParams, iters: int) -> dict:
  """The family's readout on fixed logits and hidden states of one block: device us."""
  cfg = params.cfg
  w = cfg.block_size
  key = jax.random.split(jax.random.key(5), 3)
  logits = 3 * jax.random.normal(key[0], (1, w, params.n_vocab), jnp.float32)
  h = jax.random.normal(key[1], (1, w, cfg.n_embd), jnp.float32).astype(jnp.bfloat16)
  id_last = jnp.array([1], jnp.int32)
  readout = S.family(cfg).readout
  f = jax.jit(lambda p, lg, hh, i: readout(p, IMPL, lg, hh, i))
  per = C.cupti_kernels(f, params, logits, h, id_last, iterations=iters)
  return dict(readout_device_us=C.device_ms(per) * 1e3, readout_launches=C.launches(per),
              readout_kernels_us=[(n, t * 1e3) for n, t in C.kernel_medians(per)])


def markdown(res: dict) -> str:
  lines = [f"- device: {res['device']}, jax {res['jax']}, commit {res['commit']}",
           f"- command: `{res['command']}`",
           f"- copy bandwidth (read+write): {res['copy_bw_TBps']:.2f} TB/s", "",
           "| pair | family | step bytes (GB) | extra bytes | floor ratio | step ms (base / "
           "family) | step ratio | round ms (base / family) | round ratio | readout us "
           "(base / family) | readout floor us |",
           "|" + "---|" * 11]
  fmt = lambda x, spec=".3f": "-" if x is None else format(x, spec)
  for p in res.get("pairs", []):
    b, f = p["base"], p["ext"]
    lines.append(
        f"| {p['pair']} | {p['family']} | {b['step_bytes'] / 1e9:.3f} / "
        f"{f['step_bytes'] / 1e9:.3f} | {p['extra_step_bytes_fraction']:+.2%} | "
        f"{p['step_floor_ratio']:.4f} | {fmt(b.get('step_device_ms'))} / "
        f"{fmt(f.get('step_device_ms'))} | {fmt(p.get('step_ratio'), '.3f')} | "
        f"{fmt(b.get('round_device_ms'))} / {fmt(f.get('round_device_ms'))} | "
        f"{fmt(p.get('round_ratio'), '.3f')} | {fmt(b.get('readout_device_us'), '.1f')} / "
        f"{fmt(f.get('readout_device_us'), '.1f')} | {f['readout_floor_us']:.1f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = C.arg_parser(__doc__, "families", "real dimensions on the GPU")
  p.add_argument("--only", default="bytes,steps,scans",
                 help="comma list of: bytes, steps, scans (bytes always run)")
  p.add_argument("--pairs", default="", help="comma list of pair names (default: all)")
  p.add_argument("--iters", type=int, default=None)
  args = p.parse_args(argv)
  iters = args.iters or (50 if args.gpu else 2)
  only = set(args.only.split(","))
  pairs = gpu_pairs() if args.gpu else smoke_pairs()
  if args.pairs:
    wanted = set(args.pairs.split(","))
    unknown = wanted - {q.name for q in pairs}
    if unknown:
      p.error(f"--pairs: unknown {sorted(unknown)}; known: {[q.name for q in pairs]}")
    pairs = [q for q in pairs if q.name in wanted]
  res, out_dir = C.start_results(p, args, argv)
  bw = C.copy_bandwidth(1 << 30 if args.gpu else 1 << 22)
  res["copy_bw_TBps"] = bw / 1e12
  res["pairs"] = []
  for pair in pairs:
    t0 = time.perf_counter()
    r = bench_pair(pair, bw, iters, only)
    res["pairs"].append(r)
    C.save_results(out_dir, "families", res, markdown(res))
    print(f"{pair.name}: floor ratio {r['step_floor_ratio']:.4f}, step ratio "
          f"{r.get('step_ratio', float('nan')):.3f}, round ratio "
          f"{r.get('round_ratio', float('nan')):.3f}, readout "
          f"{r['ext'].get('readout_device_us', float('nan')):.1f} us "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
  print(C.save_results(out_dir, "families", res, markdown(res)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
