"""Batched drafting (issue 14): S sequences in one draft round, in one command.

  python -m benchmarks.batch --gpu [--only rounds,compiles,memory,crossover,batched_ab,...]
      [--out DIR]
  python -m benchmarks.batch --smoke        # tiny dims on any backend (CI): not results

Sections (each printed as it finishes, all written to DIR/batch.json and batch.md):
- rates: copy bandwidth and the dense bf16 GEMM rate (an 8192^3 bf16 dot), measured here.
- rounds: `draft_round_batched` at the seed dims, bf16 and fp8 weights, full bf16 rings
  (every slot of every sequence's 2048-slot ring live), S = 1 .. 32 at widths 16 and 8: CUPTI
  device time of the round (encode + inject of w new rows per slot + the block step; the ring
  copies of the non-donating measurement jit excluded), drafted tokens per second (S (w - 1)
  per round), the roofline max(bytes / copy bandwidth, FLOPs / GEMM rate) and its fraction,
  and the time relative to S = 1.
- compiles: XLA compilations while sequences join (reset_slot + inject_slot), leave and
  change activity between donated rounds, after one warm-up of each call (expected 0).
- memory: ring bytes per slot (from the config), then 64 slots of a 2048 window allocated on
  the device beside the bf16 weights, with one round over all 64 slots.
- crossover: the skinny GEMM vs XLA's GEMM for each bf16 matrix of a seed round at M = 64 ..
  512 rows; prints the row count to set `KernelPolicy.skinny_max_m` to.
- batched_ab, fp8_ab, attn_ab, mgpu_attn_ab: rounds under two or more kernel policies
  (`dflash_jax.dispatch.KernelPolicy`, each its own compiled program), interleaved in one
  process, at 32-128 rows (bf16 weights; `--ab-points` takes fp8 points too; `ab_settings`
  says what each compares): the batched GEMM on vs off (where `batched_bf16_rows` /
  `batched_fp8_rows` come from), fp8's small matrices on the batched or the skinny GEMM at 32
  rows (`fp8_small_weights`), the block's own keys in a program of their own or folded into
  chunk 0's (`fold_own_min_seqs`), the Triton or the Mosaic GPU partials
  (`mgpu_attention_seqs`). By default only batched_ab runs (each A/B takes minutes).

On the H200 the whole run takes about 5 minutes, mostly compiles (one per point); a slower
start can split it: `--only rounds`, then `--only compiles,memory,crossover`.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import dflash_jax as dfj
from benchmarks import common as C
from dflash_jax import dispatch as P
from dflash_jax.dispatch import KernelPolicy, gemm_knobs, linear
from dflash_jax.drafter import step as S
from pallas_kernels import skinny_gemm

POLICY = KernelPolicy()   # the shipped routing
AB_SECTIONS = ("batched_ab", "fp8_ab", "attn_ab", "mgpu_attn_ab")
SECTIONS = ("rounds", "compiles", "memory", "crossover") + AB_SECTIONS   # rates always run
DEFAULT_SECTIONS = ("rounds", "compiles", "memory", "crossover", "batched_ab")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one run measures. points: (weights, width, S) of the rounds section."""
  cfg: dfj.DFlashConfig
  n_vocab: int
  points: tuple[tuple[str, int, int], ...]
  memory_slots: int
  memory_width: int
  crossover_rows: tuple[int, ...]
  crossover_gemms: tuple[str, ...] | None   # None: every GEMM of the round
  compile_slots: int
  compile_width: int
  compile_rounds: int
  iters: int
  gemm_n: int
  ab_points: tuple[tuple[str, int, int], ...] = ()   # (weights, width, S) of the A/Bs

  @property
  def window(self) -> int:
    return self.cfg.resolve_window()


GPU_PLAN = Plan(
    cfg=dfj.SEED_CONFIG, n_vocab=8192,
    points=tuple((d, w, s) for d in ("bf16", "fp8") for w in (16, 8)
                 for s in (1, 2, 4, 8, 16, 32)),
    memory_slots=64, memory_width=16, crossover_rows=(16, 32, 48, 64, 128, 256, 512),
    crossover_gemms=None, compile_slots=8, compile_width=16, compile_rounds=40, iters=20,
    gemm_n=8192,
    ab_points=tuple(("bf16", w, s) for w, s in ((16, 8), (8, 16), (16, 4), (8, 8), (16, 3),
                                                 (16, 2), (8, 4))))
# Interpret-mode Pallas compiles take seconds on a CPU: few points, the same code paths.
SMOKE_PLAN = Plan(
    cfg=dataclasses.replace(dfj.TINY_CONFIG, window=64), n_vocab=512,
    points=(("bf16", 4, 2),), memory_slots=2, memory_width=4, crossover_rows=(128,),
    crossover_gemms=("qkv", "gate_up"), compile_slots=2,
    compile_width=4, compile_rounds=4, iters=2, gemm_n=256, ab_points=(("bf16", 4, 2),))


def gemm_rate(n: int, iters: int) -> float:
  """Dense bf16 GEMM FLOP/s: an [n, n] x [n, n] bf16 dot accumulated in float32 (CUPTI)."""
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (n, n), jnp.bfloat16)
  b = jax.random.normal(kb, (n, n), jnp.bfloat16)
  f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  return 2 * n ** 3 / (C.device_ms(C.cupti_kernels(f, a, b, iterations=iters)) * 1e-3)


def gemm_path(dtype: str, rows: int, policy: KernelPolicy = POLICY) -> str:
  """Which GEMM a round's weights run on at this row count (dispatch.linear's rule; fp8's
  small matrices may stay on the skinny GEMM: "batched+skinny")."""
  other = "skinny" if dtype != "bf16" or rows <= policy.skinny_max_m else "xla"
  if not P.batched_gemm_runs(dtype, rows, policy):
    return other
  return "batched" if P.batched_gemm_runs(dtype, rows, policy, 0) else f"batched+{other}"


def round_inputs(cfg: dfj.DFlashConfig, n_slots: int, width: int, n_past: int, seed: int = 3):
  """A round's inputs: every slot active, w new rows each (the most a round commits)."""
  feats = jax.random.normal(jax.random.key(seed), (n_slots, width, cfg.n_embd_fc), jnp.float32)
  ones = jnp.ones((n_slots,), jnp.int32)
  return feats, width * ones, ones, n_past * ones, ones > 0


def round_bytes(params: dfj.DrafterParams, ring: S.RingState, n_slots: int, width: int) -> int:
  """Bytes a round must move: every weight it reads (the step's, the LM head, fc and the
  inject GEMMs'), every ring slot (all live), the new rows written to the rings, the block's
  embedding rows, the features read and the logits written."""
  cfg = params.cfg
  weights = C.tree_bytes((params.layers, params.lm_head, params.out_norm, params.fc,
                          params.enc_norm, params.inject))
  ring_item = ring.caches()[0].k.dtype.itemsize
  rows = n_slots * width
  written = rows * cfg.n_layer * 2 * cfg.n_head_kv * cfg.head_dim * ring_item
  embd = rows * cfg.n_embd * params.tok_embd.dtype.itemsize
  return (weights + C.tree_bytes(ring) + written + embd + rows * cfg.n_embd_fc * 4
          + rows * params.n_vocab * 4)


def round_flops(cfg: dfj.DFlashConfig, n_vocab: int, n_slots: int, width: int,
                visible: int) -> int:
  """Multiply-adds x 2 of a round with `visible` ring keys per layer: the step's GEMMs over
  S w rows, encode and the inject GEMMs over S w new rows, and attention (QK and PV over the
  visible keys plus the block's own)."""
  e, d, hq, hkv = cfg.n_embd, cfg.head_dim, cfg.n_head, cfg.n_head_kv
  per_layer = (hq + 2 * hkv) * d * e + e * hq * d + 3 * cfg.n_ff * e
  step = cfg.n_layer * per_layer + n_vocab * e
  round_only = e * cfg.n_embd_fc + cfg.n_layer * 2 * hkv * d * e
  rows = n_slots * width
  attn = cfg.n_layer * 4 * n_slots * hq * width * (visible + width) * d
  return 2 * rows * (step + round_only) + attn


@functools.cache
def _round_no_donation(width: int):
  # CUPTI calls the round repeatedly on the same ring, so it cannot donate; XLA then copies
  # the ring before the aliased inject kernels, and those copies are excluded from the times.
  # One jitted function per width: every point of a shape compiles once.
  return jax.jit(functools.partial(S.draft_round_batched, width=width, impl="pallas"))


def time_round(params, ring, inputs, width: int, iters: int) -> tuple[float, list]:
  """CUPTI device ms of one draft_round_batched (ring copies excluded) and the per-kernel
  medians."""
  per = C.without_copies(C.cupti_kernels(_round_no_donation(width), params, ring, *inputs,
                                         iterations=iters))
  return C.device_ms(per), C.kernel_medians(per)


def bench_rounds(plan: Plan, rates: dict, out: list, save) -> None:
  cfg, window = plan.cfg, plan.window
  params = None
  for dtype, width, n_slots in plan.points:
    if params is None or params.weight_format != dtype:
      params = None   # free the previous weights first
      params = C.random_params(cfg, plan.n_vocab, dtype)
    ring = C.filled_state(cfg, "bf16", window, window, n_seqs=n_slots)
    inputs = round_inputs(cfg, n_slots, width, window)
    t0 = time.perf_counter()
    ms, kernels = time_round(params, ring, inputs, width, plan.iters)
    nbytes = round_bytes(params, ring, n_slots, width)
    flops = round_flops(cfg, plan.n_vocab, n_slots, width, window)
    floor_ms = nbytes / rates["copy_Bps"] * 1e3
    compute_ms = flops / rates["gemm_flops"] * 1e3
    roofline = max(floor_ms, compute_ms)
    base = next((r["round_ms"] for r in out if (r["dtype"], r["width"], r["slots"]) ==
                 (dtype, width, 1)), None)
    r = dict(dtype=dtype, width=width, slots=n_slots, rows=n_slots * width, round_ms=ms,
             drafted_tokens_per_s=n_slots * (width - 1) / (ms * 1e-3), bytes=nbytes,
             flops=flops, byte_floor_ms=floor_ms, compute_floor_ms=compute_ms,
             roofline_ms=roofline, roofline_fraction=roofline / ms,
             vs_one_slot=None if base is None else ms / base,
             gemm_path=gemm_path(dtype, n_slots * width),
             kernels=kernels, seconds=time.perf_counter() - t0)
    out.append(r)
    print(f"round {dtype} w{width} S{n_slots}: {ms:.3f} ms, {r['drafted_tokens_per_s']:.0f} "
          f"drafted tok/s, roofline {roofline:.3f} ms "
          f"({'bytes' if floor_ms >= compute_ms else 'FLOPs'})"
          f" frac {r['roofline_fraction']:.3f}"
          + ("" if base is None else f", x{r['vs_one_slot']:.2f} of S=1")
          + f" ({r['seconds']:.0f} s)", flush=True)
    del ring, inputs
    save()


def ab_settings(section: str) -> list[tuple[str, KernelPolicy]]:
  """The kernel policies one A/B section compares, the shipped routing's opposite first:
  (tag, policy). batched_ab: the Mosaic GPU batched GEMM off (XLA's GEMM for bf16, the
  skinny GEMM for fp8) vs on for bf16 and fp8 from skinny_max_m + 1 rows (so the A/B also says
  where each format's lower bound belongs). fp8_ab: every fp8 matrix on the batched GEMM from
  32 rows vs the small ones on the skinny GEMM there (fp8_small_weights, shipped). attn_ab:
  the Triton attention's own-key program vs folded into chunk 0 from 2 slots
  (fold_own_min_seqs). mgpu_attn_ab: the Triton attention vs the Mosaic GPU partials up to 64
  slots (mgpu_attention_seqs)."""
  if section == "batched_ab":
    on = lambda rows: (POLICY.skinny_max_m + 1, (rows or (0, 128))[1])
    return [("off", dataclasses.replace(POLICY, batched_bf16_rows=None, batched_fp8_rows=None)),
            ("on", dataclasses.replace(POLICY, batched_bf16_rows=on(POLICY.batched_bf16_rows),
                                       batched_fp8_rows=on(POLICY.batched_fp8_rows)))]
  if section == "fp8_ab":
    return [("all_batched", dataclasses.replace(POLICY, fp8_small_weights=0)),
            ("small_skinny", POLICY)]
  if section == "attn_ab":
    return [("own_program", dataclasses.replace(POLICY, fold_own_min_seqs=None)),
            ("own_folded", dataclasses.replace(POLICY, fold_own_min_seqs=2))]
  if section == "mgpu_attn_ab":
    return [("triton", dataclasses.replace(POLICY, mgpu_attention_seqs=None)),
            ("mgpu", dataclasses.replace(POLICY, mgpu_attention_seqs=(1, 64)))]
  raise ValueError(section)


def bench_ab(plan: Plan, section: str, repeats: int = 2) -> list[dict]:
  """Rounds under each of `ab_settings(section)` in the same process, interleaved, for every
  point of plan.ab_points (each policy compiles its own program); with the largest logits
  difference and draft agreement of each setting against the first."""
  cfg, window = plan.cfg, plan.window
  settings = ab_settings(section)
  out, params = [], None
  for dtype, width, n_slots in plan.ab_points:
    if params is None or params.weight_format != dtype:
      params = None
      params = C.random_params(cfg, plan.n_vocab, dtype)
    ring = C.filled_state(cfg, "bf16", window, window, n_seqs=n_slots)
    inputs = round_inputs(cfg, n_slots, width, window)
    f = _round_no_donation(width)
    times, outs = {tag: [] for tag, _ in settings}, {}
    for _ in range(repeats):
      for tag, policy in settings:
        p = params.replace(policy=policy)
        per = C.without_copies(C.cupti_kernels(f, p, ring, *inputs, iterations=plan.iters))
        times[tag].append((C.device_ms(per), C.launches(per)))
        outs[tag] = f(p, ring, *inputs)
    first = settings[0][0]
    r = dict(dtype=dtype, width=width, slots=n_slots, rows=n_slots * width,
             ms={tag: [t for t, _ in ts] for tag, ts in times.items()},
             launches={tag: ts[0][1] for tag, ts in times.items()},
             max_logits_diff={tag: float(jnp.max(jnp.abs(o[2] - outs[first][2])))
                              for tag, o in outs.items()},
             drafts_agree={tag: float(jnp.mean(o[1] == outs[first][1]))
                           for tag, o in outs.items()})
    out.append(r)
    print(f"{section} {dtype} w{width} S{n_slots}: " + "; ".join(
        f"{tag} {r['ms'][tag]} ms ({r['launches'][tag]} launches, max|dlogits| "
        f"{r['max_logits_diff'][tag]:.3g}, drafts agree {r['drafts_agree'][tag]:.3f})"
        for tag, _ in settings), flush=True)
    del ring, inputs
  return out


def bench_compiles(plan: Plan, seed: int = 5) -> dict:
  """Sequences join (reset_slot + inject_slot of a prompt at a random slot), leave
  (reset_slot, inactive) and change activity between donated rounds: XLA compilations
  counted after one warm-up call of each function (zero expected: slot ids, activity and
  positions are traced values)."""
  cfg, width, n_slots = plan.cfg, plan.compile_width, plan.compile_slots
  params = C.random_params(cfg, plan.n_vocab, "bf16")
  ring = S.init_batched_ring(cfg, n_slots, ring_dtype="bf16")
  rng = np.random.default_rng(seed)
  n_prompt = 2 * width
  prompt = S.encode_jit(params, jax.random.normal(jax.random.key(seed), (n_prompt, cfg.n_embd_fc)))
  feats = jax.random.normal(jax.random.key(seed + 1), (n_slots, width, cfg.n_embd_fc))
  active = np.zeros(n_slots, bool)
  n_past = np.zeros(n_slots, np.int64)

  def join(ring, s):
    ring = S.reset_slot_jit(ring, jnp.int32(s))
    ring = S.inject_slot_jit(params, ring, jnp.int32(s), prompt,
                             jnp.arange(n_prompt, dtype=jnp.int32), impl="pallas")
    active[s], n_past[s] = True, n_prompt
    return ring

  def one_round(ring):
    n_new = np.where(active, rng.integers(1, width + 1, n_slots), 0)
    ring, drafts, _ = S.draft_round_batched_jit(
        params, ring, feats, jnp.asarray(n_new, jnp.int32),
        jnp.asarray(rng.integers(0, plan.n_vocab, n_slots), jnp.int32),
        jnp.asarray(n_past + n_new, jnp.int32), jnp.asarray(active), width=width,
        impl="pallas")
    n_ok = S.accept_jit(drafts, jnp.roll(drafts, 1, axis=-1))
    n_past[:] += n_new
    return ring, n_ok

  ring = join(ring, 0)                                    # warm-up: each call once
  ring, n_ok = one_round(ring)
  jax.block_until_ready(n_ok)
  events = {"join": 0, "leave": 0}
  with C.count_compiles() as names:
    for _ in range(plan.compile_rounds):
      for s in range(n_slots):
        u = rng.random()
        if not active[s] and u < 0.4:
          ring = join(ring, s)
          events["join"] += 1
        elif active[s] and u < 0.15:
          ring = S.reset_slot_jit(ring, jnp.int32(s))
          active[s] = False
          events["leave"] += 1
      ring, n_ok = one_round(ring)
    jax.block_until_ready(n_ok)
  res = dict(slots=n_slots, width=width, rounds=plan.compile_rounds, **events,
             compiles=len(names), compiled=names,
             cache_sizes={f.__name__: f._cache_size() for f in (
                 S.reset_slot_jit, S.inject_slot_jit, S.draft_round_batched_jit, S.accept_jit)})
  print(f"compiles while {events['join']} joins and {events['leave']} leaves over "
        f"{plan.compile_rounds} rounds of {n_slots} slots: {len(names)} {names}; jit cache "
        f"sizes {res['cache_sizes']}", flush=True)
  return res


def bench_memory(plan: Plan) -> dict:
  """Ring bytes per slot from the config; `memory_slots` full rings (every slot live)
  allocated beside the bf16 weights, and one round over all of them."""
  cfg, window, n, width = plan.cfg, plan.window, plan.memory_slots, plan.memory_width
  per_slot = {rd: S.ring_nbytes(cfg, window, rd) for rd in ("bf16", "fp32")}
  params = C.random_params(cfg, plan.n_vocab, "bf16")
  ring = C.filled_state(cfg, "bf16", window, window, n_seqs=n)
  jax.block_until_ready(ring)
  assert C.tree_bytes(ring) == n * per_slot["bf16"], (C.tree_bytes(ring), n, per_slot)
  stats = jax.devices()[0].memory_stats() or {}
  ms, _ = time_round(params, ring, round_inputs(cfg, n, width, window), width,
                     max(2, plan.iters // 4))
  res = dict(window=window, ring_bytes_per_slot=per_slot, slots=n,
             ring_bytes=C.tree_bytes(ring), weight_bytes=C.tree_bytes(params),
             device_bytes_in_use=stats.get("bytes_in_use"),
             device_bytes_limit=stats.get("bytes_limit"),
             device_peak_bytes=(jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
             round_ms_all_slots=ms, round_width=width)
  gib = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"
  print(f"memory: ring bytes per slot (window {window}) bf16 {per_slot['bf16']:,} fp32 "
        f"{per_slot['fp32']:,}; {n} full bf16 slots {gib(res['ring_bytes'])} beside weights "
        f"{gib(res['weight_bytes'])}: device in use {gib(res['device_bytes_in_use'])} of "
        f"{gib(res['device_bytes_limit'])}, peak {gib(res['device_peak_bytes'])}; a round of "
        f"all {n} slots (w {width}): {ms:.3f} ms", flush=True)
  return res


def step_matrices(cfg: dfj.DFlashConfig, n_vocab: int) -> list[tuple[str, int, int, bool, int]]:
  """(name, N, K, gate_up, launches per round) of every GEMM in a draft round."""
  e, d, hq, hkv = cfg.n_embd, cfg.head_dim, cfg.n_head, cfg.n_head_kv
  inject = [(f"inject_{kind[:4]}", len(layers) * 2 * hkv * d, e, False, 1)
            for kind, layers in cfg.kind_groups]
  return ([("fc", e, cfg.n_embd_fc, False, 1)] + inject +
          [("qkv", (hq + 2 * hkv) * d, e, False, cfg.n_layer), ("o", e, hq * d, False, cfg.n_layer),
           ("gate_up", 2 * cfg.n_ff, e, True, cfg.n_layer),
           ("down", e, cfg.n_ff, False, cfg.n_layer),
           ("lm_head", n_vocab, e, False, 1)])


def bench_crossover(plan: Plan) -> dict:
  """Each bf16 GEMM of a round on the skinny kernel (ceil(M / 64) M tiles) and on XLA's GEMM
  at M rows; per M the round's total (each matrix times its launches). The suggested
  skinny_max_m is the largest probed M up to which the skinny total never loses."""
  key = iter(jax.random.split(jax.random.key(9), 64))
  rows = {}
  for name, n, k, gate_up, count in step_matrices(plan.cfg, plan.n_vocab):
    if plan.crossover_gemms is not None and name not in plan.crossover_gemms:
      continue
    w = (jax.random.normal(next(key), (n, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    knobs = gemm_knobs("bf16", n // 2 if gate_up else n, k, gate_up, policy=POLICY).kwargs()
    partials = name == "qkv"   # the step keeps qkv's split-K partials for qk_norm_rope
    if gate_up:
      skinny = jax.jit(functools.partial(skinny_gemm.skinny_matmul_gate_up, fmt="bf16",
                                         out_dtype=jnp.bfloat16, **knobs))
      xla = jax.jit(functools.partial(linear, impl="xla", gate_up=True, out_dtype=jnp.bfloat16))
    else:
      skinny = jax.jit(functools.partial(skinny_gemm.skinny_matmul, fmt="bf16",
                                         keep_splits=partials, **knobs))
      xla = jax.jit(functools.partial(linear, impl="xla", partials=partials))
    for m in plan.crossover_rows:
      x = jax.random.normal(next(key), (m, k), jnp.float32)
      t_s = C.device_ms(C.cupti_kernels(skinny, x, w, iterations=plan.iters))
      t_x = C.device_ms(C.cupti_kernels(xla, x, w, iterations=plan.iters))
      rows.setdefault(m, {})[name] = dict(skinny_ms=t_s, xla_ms=t_x, launches=count)
    del w
  totals = {m: dict(skinny_ms=sum(v["skinny_ms"] * v["launches"] for v in per.values()),
                    xla_ms=sum(v["xla_ms"] * v["launches"] for v in per.values()))
            for m, per in rows.items()}
  suggested = None
  for m in sorted(totals):
    if totals[m]["skinny_ms"] > totals[m]["xla_ms"]:
      break
    suggested = m
  for m in sorted(totals):
    per = ", ".join(f"{nm} {v['skinny_ms'] * 1e3:.1f}/{v['xla_ms'] * 1e3:.1f}"
                    for nm, v in rows[m].items())
    print(f"crossover M={m}: round GEMMs skinny {totals[m]['skinny_ms']:.3f} ms, xla "
          f"{totals[m]['xla_ms']:.3f} ms (us skinny/xla: {per})", flush=True)
  print(f"crossover: suggested skinny_max_m = {suggested} (now {POLICY.skinny_max_m}; the largest "
        "probed M up to which the skinny kernel's round total never loses; None: it loses "
        f"already at M = {min(totals)})", flush=True)
  return dict(per_rows={str(m): v for m, v in rows.items()},
              totals={str(m): v for m, v in totals.items()},
              suggested_skinny_max_m=suggested, current_skinny_max_m=POLICY.skinny_max_m)


def markdown(res: dict) -> str:
  lines = [f"- device: {res['device']}, jax {res['jax']}, commit {res['commit']}",
           f"- command: `{res['command']}`"]
  if "rates" in res:
    r = res["rates"]
    lines.append(f"- copy bandwidth {r['copy_Bps'] / 1e12:.2f} TB/s (read+write), dense bf16 "
                 f"GEMM {r['gemm_flops'] / 1e12:.0f} TFLOP/s ({r['gemm_n']}^3)")
  if res.get("rounds"):
    lines += ["", "| weights | w | S | rows | GEMMs | round ms | x S=1 | drafted tok/s | "
              "byte floor ms | FLOP floor ms | roofline frac |", "|" + "---|" * 11]
    for r in res["rounds"]:
      vs = "-" if r["vs_one_slot"] is None else f"{r['vs_one_slot']:.2f}"
      lines.append(f"| {r['dtype']} | {r['width']} | {r['slots']} | {r['rows']} | "
                   f"{r['gemm_path']} | {r['round_ms']:.3f} | {vs} | "
                   f"{r['drafted_tokens_per_s']:.0f} | {r['byte_floor_ms']:.3f} | "
                   f"{r['compute_floor_ms']:.3f} | {r['roofline_fraction']:.3f} |")
  if "compiles" in res:
    c = res["compiles"]
    lines += ["", f"- compilations while {c['join']} joins and {c['leave']} leaves over "
              f"{c['rounds']} rounds of {c['slots']} slots: **{c['compiles']}** "
              f"(jit cache sizes {c['cache_sizes']})"]
  if "memory" in res:
    m = res["memory"]
    lines += ["", f"- ring bytes per slot (window {m['window']}): bf16 "
              f"{m['ring_bytes_per_slot']['bf16']:,}, fp32 {m['ring_bytes_per_slot']['fp32']:,}; "
              f"{m['slots']} bf16 slots = {m['ring_bytes']:,} bytes beside {m['weight_bytes']:,} "
              f"bytes of bf16 weights; device in use {m['device_bytes_in_use']}, limit "
              f"{m['device_bytes_limit']}; a round of all slots {m['round_ms_all_slots']:.3f} ms"]
  if "crossover" in res:
    x = res["crossover"]
    lines += ["", "| M | round GEMMs skinny ms | xla ms |", "|---|---|---|"]
    for m, t in x["totals"].items():
      lines.append(f"| {m} | {t['skinny_ms']:.3f} | {t['xla_ms']:.3f} |")
    lines.append(f"\nsuggested skinny_max_m = {x['suggested_skinny_max_m']} "
                 f"(current {x['current_skinny_max_m']})")
  for section in AB_SECTIONS:
    if section not in res:
      continue
    lines += ["", f"{section}:", "", "| weights | w | S | rows | setting | round ms | launches | "
              "max logits diff | drafts agree |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res[section]:
      for tag, ms in r["ms"].items():
        lines.append(f"| {r['dtype']} | {r['width']} | {r['slots']} | {r['rows']} | {tag} | "
                     + " / ".join(f"{t:.4f}" for t in ms)
                     + f" | {r['launches'][tag]} | {r['max_logits_diff'][tag]:.3g} | "
                     f"{r['drafts_agree'][tag]:.3f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = C.arg_parser(__doc__, "batch", "seed dims on the GPU")
  p.add_argument("--only", default=",".join(DEFAULT_SECTIONS),
                 help=f"comma list of: {', '.join(SECTIONS)}")
  p.add_argument("--ab-points", default=None,
                 help="A/B points as WEIGHTSxWIDTHxS, comma list (default: the plan's)")
  args = p.parse_args(argv)
  only = args.only.split(",")
  unknown = sorted(set(only) - set(SECTIONS))
  if unknown:
    p.error(f"unknown sections {unknown}; choose from {SECTIONS}")
  plan = GPU_PLAN if args.gpu else SMOKE_PLAN
  if args.ab_points:
    pts = [v.split("x") for v in args.ab_points.split(",")]
    plan = dataclasses.replace(plan, ab_points=tuple((d, int(w), int(n)) for d, w, n in pts))
  res, out_dir = C.start_results(p, args, argv)

  def save() -> str:
    return C.save_results(out_dir, "batch", res, markdown(res))

  t0 = time.perf_counter()
  rates = dict(copy_Bps=C.copy_bandwidth(1 << 30 if args.gpu else 1 << 22),
               gemm_flops=gemm_rate(plan.gemm_n, max(2, plan.iters // 4)), gemm_n=plan.gemm_n)
  res["rates"] = rates
  print(f"copy bandwidth {rates['copy_Bps'] / 1e12:.3f} TB/s, dense bf16 GEMM "
        f"{rates['gemm_flops'] / 1e12:.1f} TFLOP/s", flush=True)
  save()
  res["seconds"] = {}
  for section, run in (("rounds", lambda: bench_rounds(plan, rates, res.setdefault("rounds", []),
                                                       save)),
                       ("compiles", lambda: bench_compiles(plan)),
                       ("memory", lambda: bench_memory(plan)),
                       ("crossover", lambda: bench_crossover(plan)),
                       *((ab, functools.partial(bench_ab, plan, ab)) for ab in AB_SECTIONS)):
    if section in only:
      t1 = time.perf_counter()
      out = run()
      if out is not None:
        res[section] = out
      res["seconds"][section] = time.perf_counter() - t1
      print(f"{section}: {res['seconds'][section]:.0f} s", flush=True)
      save()
  print(save())
  print(f"total {time.perf_counter() - t0:.0f} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
