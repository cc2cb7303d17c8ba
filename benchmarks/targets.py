"""The targets people draft for, on the GPU: Muse-Glimmer-30B with a seed-shaped DFlash drafter,
Qwen3-30B-A3B with a Qwen3-Coder-30B-A3B-DFlash-shaped drafter (issue 40, point 5).

  python -m benchmarks.targets --gpu [--models glimmer,moe] [--only SECTIONS] [--out DIR]
  python -m benchmarks.targets --smoke          # CPU, tiny dims, seconds: not results

Weights are random bf16, generated on the device; the drafter borrows the target's embedding
and LM head. The models run one after the other (each alone fills half an H200). Per model,
sections in order (results saved after each, so a run cut short keeps what it measured):

1. bytes: the target's weights, what one decode step must read (every weight but the
   embedding, which is a gather, plus the K/V cache; for the MoE only the experts routed to:
   k per sparse layer), the drafter's, and the copy bandwidth of this run; the byte floors.
2. target: device time (CUPTI median, copies excluded) of decode1 (a 1-row verify) and
   verify16 (16 rows, the drafter's features captured), each followed by commit(0) as in a
   round that keeps nothing, inside a fori_loop of `inner` passes; with the XLA GEMMs and
   with the Pallas ones (skinny GEMM; the grouped expert GEMM for the MoE); their fractions
   of the byte floor. For the MoE the floor of verify16 counts the experts its 16 rows touch,
   measured on the benchmark's own rows (reported per layer), and commit alone is timed.
3. draft: one draft round (inject of the 16 committed rows + block step + drafts) with the
   drafter's Pallas kernels; round = draft + verify16 + commit, the pieces' sum.
4. target_only: target-only greedy decoding (width 1), tokens/s after a warm-up; its output is
   the oracle of sections 5-6.
5. oracle: drafts are the target's own continuation (refined to the loop's fixed point, see
   benchmarks.decode.oracle_run), k = 3, 7, 15 drafts per round: tokens/s, tau, speedup.
6. replay: the founding document's measured acceptance (llama.cpp, RTX 6000 Ada: a mean
   accepted run of ~2.8 of 15 drafts, 0.25-0.70 per block, 1.44x at a draft length of 4) as
   an oracle distribution: each oracle token is corrupted with probability 1 - a, independently,
   so a round accepts a run of i drafts with probability a^i (1 - a) (truncated at k), and a is
   solved so that a 15-draft round accepts 2.8 on average (a = 0.737; the implied acceptance
   per block is 0.49 at 4 drafts, 0.32 at 8, 0.19 at 15). The end-to-end speedup over
   target-only decoding at draft lengths 4, 8, 15, measured in the loop.

The drafter of Qwen3-Coder-30B-A3B-DFlash is taken as 5 full-attention Qwen3 layers of the
target's width (32/4 heads x 128, ffn 6144, block 16), tapping HF layers [1, 12, 23, 34, 45]
(the z-lab default formula; the published config was not read here).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

# The Muse-Glimmer-30B pair holds ~61 GB of weights, above JAX's default share (75%) of an
# 80 GB card and within 95% (read when the backend starts, not at import; benchmarks/RESULTS.md,
# "2026-12-05 run 30").
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np
from jax import lax

import dflash_jax as dfj
from benchmarks import common as C
from benchmarks.decode import device_ms, oracle_run
from benchmarks.oracle import Oracle
from dflash_jax import decode as D
from dflash_jax.config import FULL
from dflash_jax.models import muse_glimmer as M
from dflash_jax.models import qwen3_moe as Q

GLIMMER_30B = M.MuseGlimmerConfig(
    vocab_size=202048, hidden_size=6656, intermediate_size=19968, num_hidden_layers=52,
    num_attention_heads=32, num_key_value_heads=2, head_dim=128, rope_theta=5e5,
    sliding_window=2048, eos_token_ids=(200001,))
QWEN3_30B_A3B = Q.Qwen3MoeConfig(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, rope_theta=1e6,
    eos_token_ids=(151645,))
CODER_30B_A3B_DFLASH = dataclasses.replace(
    dfj.QWEN3_8B_CONFIG, n_embd=2048, n_ff=6144, target_layers=(2, 13, 24, 35, 46),
    mask_token_id=151669, context_length=None)
MEAN_RUN_15 = 2.8          # the founding document: mean accepted run of a 15-token draft
DOCUMENT_SPEEDUP = 1.44    # its end-to-end speedup at a draft length of 4
REPORT_KERNELS = 12        # kernels named per pass in targets.md (targets.json keeps them all)


@dataclasses.dataclass(frozen=True)
class Setup:
  name: str
  family: object
  target: object
  drafter: dfj.DFlashConfig
  capacity: int
  prompt_len: int
  max_new: int
  ks: tuple[int, ...]
  replay_ks: tuple[int, ...]
  iters: int
  inner: int
  sync_every: int


def setups(smoke: bool) -> dict[str, Setup]:
  if smoke:
    g = M.MuseGlimmerConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=16, rope_theta=1e4, sliding_window=16)
    q = Q.Qwen3MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=16, norm_topk_prob=True, rope_theta=1e4)
    d = dataclasses.replace(dfj.TINY_CONFIG, n_layer=1, n_embd=32, n_ff=64, n_head=2,
                            n_head_kv=1, target_layers=(1, 2), mask_token_id=255, block_size=16,
                            window=32)
    kw = dict(capacity=64, prompt_len=12, max_new=24, ks=(3,), replay_ks=(4,), iters=1,
              inner=2, sync_every=4)
    return {"glimmer": Setup("glimmer", M, g, d, **kw),
            "moe": Setup("moe", Q, q, dataclasses.replace(d, layer_types=(FULL,)), **kw)}
  kw = dict(capacity=2048, prompt_len=128, max_new=512, ks=(3, 7, 15), replay_ks=(4, 8, 15),
            iters=20, inner=8, sync_every=64)
  return {"glimmer": Setup("glimmer", M, GLIMMER_30B, dfj.SEED_CONFIG, **kw),
          "moe": Setup("moe", Q, QWEN3_30B_A3B, CODER_30B_A3B_DFLASH, **kw)}


def replay_acceptance(mean_run: float = MEAN_RUN_15, k: int = 15) -> float:
  """The per-draft acceptance a with sum_{i=1..k} a^i = mean_run (bisection)."""
  lo, hi = 0.0, 1.0
  for _ in range(60):
    a = (lo + hi) / 2
    lo, hi = (a, hi) if sum(a ** i for i in range(1, k + 1)) < mean_run else (lo, a)
  return (lo + hi) / 2


def random_models(su: Setup) -> D.Models:
  """Random bf16 target + drafter on the device; the drafter borrows the target's embedding
  and LM head (the same arrays)."""
  tp = su.family.init_params(su.target, jax.random.key(0), jnp.bfloat16)
  dp = C.random_params(su.drafter, 16, "bf16").replace(tok_embd=tp.embed, lm_head=tp.head)
  return D.Models(target=tp, drafter=dp, d2t=None, target_cfg=su.target)


def target_loop(cfg, inner: int, capture, impl: str):
  """run(params, cache, tokens [1, w]): `inner` verify + commit(0) passes at one position,
  each pass's argmax feeding the next; the cache is the loop carry (copied once per call)."""

  def run(tp, cache, tokens):
    def body(_, c):
      cache, toks = c
      cache, logits, feats = cfg.verify(tp, cache, toks, capture_layers=capture, impl=impl)
      cache = cfg.commit(cache, jnp.zeros(cache.length.shape, jnp.int32))
      toks = jnp.argmax(logits, -1).astype(jnp.int32)
      if capture:   # keep the captured features live, as the round needs them
        toks = toks + (feats[..., 0] > 1e30).astype(jnp.int32)
      return cache, toks
    return lax.fori_loop(0, inner, body, (cache, tokens))[1]
  return jax.jit(run)


def touched_experts(cfg: Q.Qwen3MoeConfig, tp, cache, tokens, impl: str) -> list[int]:
  """Per sparse layer, how many distinct experts the rows of one verify of `tokens` route to
  (read off the routing with a host callback; one extra compile, not timed)."""
  seen, calls = {}, [0]
  route = Q.route

  def spy(c, logits, *a):
    ids, w = route(c, logits, *a)
    n = calls[0]
    calls[0] += 1
    jax.debug.callback(lambda i, n=n: seen.__setitem__(n, len(np.unique(i))), ids)
    return ids, w
  Q.route = spy
  try:
    jax.block_until_ready(jax.jit(lambda p, c, t: cfg.verify(p, c, t, impl=impl))(
        tp, cache, tokens))
  finally:
    Q.route = route
  jax.effects_barrier()
  return [seen[i] for i in range(len(cfg.sparse_layers))]


def bytes_section(su: Setup, models: D.Models, st: D.DecodeState, bw: float) -> dict:
  tp, dp, cfg = models.target, models.drafter, su.target
  target = C.tree_bytes(tp)
  embed = C.tree_bytes(tp.embed)
  cache = C.tree_bytes(st.cache)
  r = dict(target_GB=target / 1e9, target_embedding_GB=embed / 1e9, kv_cache_GB=cache / 1e9,
           drafter_body_GB=C.tree_bytes((dp.layers, dp.fc, [i.w for i in dp.inject])) / 1e9,
           drafter_head_GB=C.tree_bytes(dp.lm_head) / 1e9, ring_GB=C.tree_bytes(st.ring) / 1e9)
  dense = target - embed
  if su.family is Q:
    experts = sum(C.tree_bytes((lp.w_gu, lp.w_d)) for lp in tp.layers if isinstance(lp, Q.MoeLayer))
    one = experts // (len(cfg.sparse_layers) * cfg.num_experts)
    dense -= experts
    r.update(experts_GB=experts / 1e9, expert_MB=one / 1e6,
             decode1_experts_GB=len(cfg.sparse_layers) * cfg.num_experts_per_tok * one / 1e9)
    r["_expert_bytes"] = one
  r["non_expert_read_GB"] = dense / 1e9
  decode1 = dense + cache + (len(cfg.sparse_layers) * cfg.num_experts_per_tok
                             * r["_expert_bytes"] if su.family is Q else 0)
  r["decode1_floor_ms"] = decode1 / bw * 1e3
  r["draft_floor_ms"] = (r["drafter_body_GB"] + r["drafter_head_GB"] + r["ring_GB"]) / bw * 1e12
  r["_dense_plus_cache"] = dense + cache
  return r


def target_section(su: Setup, models: D.Models, st: D.DecodeState, res: dict, bw: float,
                   impls) -> dict:
  cfg, tp = su.target, models.target
  w = su.drafter.block_size
  rng = np.random.default_rng(3)
  vt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, w)), jnp.int32)
  out = {}
  b = res["bytes"]
  if su.family is Q:
    touched = touched_experts(cfg, tp, st.cache, vt, impls[-1])
    out["verify16_experts_touched"] = dict(per_layer=touched, mean=float(np.mean(touched)),
                                           min=int(min(touched)), max=int(max(touched)))
    verify_bytes = b["_dense_plus_cache"] + sum(touched) * b["_expert_bytes"]
  else:
    verify_bytes = b["_dense_plus_cache"]
  out["verify16_floor_ms"] = verify_bytes / bw * 1e3
  for impl in impls:
    f16 = target_loop(cfg, su.inner, su.drafter.target_layers, impl)
    f1 = target_loop(cfg, su.inner, (), impl)
    t0 = time.perf_counter()
    for name, f, toks in (("verify16", f16, vt), ("decode1", f1, vt[:, :1])):
      out[f"{name}_{impl}_ms"], out[f"{name}_{impl}_kernels"] = kernel_split(
          f, tp, st.cache, toks, iters=su.iters, per_call=su.inner,
          layers=cfg.num_hidden_layers)
    out[f"compile_and_measure_{impl}_s"] = time.perf_counter() - t0
    out[f"decode1_{impl}_floor_fraction"] = b["decode1_floor_ms"] / out[f"decode1_{impl}_ms"]
    out[f"verify16_{impl}_floor_fraction"] = (out["verify16_floor_ms"]
                                              / out[f"verify16_{impl}_ms"])
    out[f"verify16_over_decode1_{impl}"] = out[f"verify16_{impl}_ms"] / out[f"decode1_{impl}_ms"]
  # commit alone (after a verify; what commit(0) adds to each pass above)
  cache, _, _ = jax.jit(lambda p, c, t: cfg.verify(p, c, t, impl="xla"))(tp, st.cache, vt)
  out["commit_ms"] = device_ms(jax.jit(cfg.commit), cache, jnp.full((1,), 3, jnp.int32),
                               iters=su.iters)
  return out


def kernel_split(f, *args, iters: int, per_call: int, layers: int) -> tuple[float, dict]:
  """(median device ms of one pass, where it goes): launches per pass and per layer, and every
  kernel by time summed by name, most first, [name, launches per pass, us per pass] (the
  report prints the first `REPORT_KERNELS`; the JSON keeps them all, so the small launches a
  layer adds up to can be told apart)."""
  p = C.pass_profile(f, *args, iterations=iters, per_call=per_call)
  by_kernel = p["by_kernel"]
  return p["ms"], dict(
      launches=p["launches"], launches_per_layer=p["launches"] / layers,
      kernels=[[name, n, ms * 1e3]
               for name, (n, ms) in C.slowest_kernels(by_kernel, len(by_kernel))])


def draft_section(su: Setup, models: D.Models, st: D.DecodeState, impl: str) -> dict:
  """One draft round as in benchmarks.decode: the state as after a round that accepted
  every draft (block_size committed rows pending for inject)."""
  w = su.drafter.block_size
  keys = jax.random.split(jax.random.key(2), 2)
  st = st.replace(pending=jax.random.normal(keys[0], st.pending.shape, jnp.float32),
                  n_new=st.n_new + w, n_past=st.n_past + w)
  dcfg = D.DecodeConfig(width=w, impl=impl)
  propose = jax.jit(lambda m, s, k: D.Drafter().propose(m, dcfg, s, k)[1].drafts)
  return dict(draft_ms=device_ms(propose, models, st, jax.random.split(keys[1], 1),
                                 iters=su.iters), width=w)


def replay_run(su: Setup, models: D.Models, prompt, fixed, base_tps: float, k: int, a: float,
               impl: str, target_impl: str, kw: dict) -> dict:
  """Draft length k with each oracle token corrupted with probability 1 - a."""
  rng = np.random.default_rng(1000 + k)
  cont = np.array(fixed[len(prompt):])
  bad = rng.random(len(cont)) >= a
  v = su.target.vocab_size
  cont[bad] = (cont[bad] + 1 + rng.integers(0, v - 2, bad.sum())) % v
  dcfg = D.DecodeConfig(width=k + 1, impl=impl, target_impl=target_impl, proposer=Oracle())
  orc = Oracle.state([list(prompt) + cont.tolist()], len(prompt) + len(cont) + k + 1)
  D.generate(models, dcfg, [prompt], 4, proposer_state=orc, rounds_per_call=su.sync_every, **kw)
  g = D.generate(models, dcfg, [prompt], su.max_new, proposer_state=orc,
                 rounds_per_call=su.sync_every, **kw)
  tps = g.n_tokens / g.seconds
  expected = sum(a ** i for i in range(1, k + 1))
  return dict(k=k, width=k + 1, a=a, expected_accepted=expected,
              expected_acceptance_per_block=expected / k, tau=g.tau,
              accepted_mean=g.tau - 1, hist=g.hist.sum(0).tolist(), tokens=g.n_tokens,
              tokens_per_s=tps, ms_per_round=g.seconds / g.rounds.sum() * 1e3,
              speedup=tps / base_tps, document_speedup_at_4=DOCUMENT_SPEEDUP)


def run_model(su: Setup, res: dict, only: set, bw: float, impl: str, target_impl: str,
              save) -> None:
  t0 = time.perf_counter()
  models = random_models(su)
  jax.block_until_ready(jax.tree.leaves(models.target))
  res["init_s"] = time.perf_counter() - t0
  prompt = np.random.default_rng(0).integers(0, su.target.vocab_size, su.prompt_len).tolist()
  kw = dict(capacity=su.capacity, cache_dtype="bf16", ring_dtype="bf16")
  w16 = D.DecodeConfig(width=su.drafter.block_size, impl=impl, target_impl=target_impl)
  st = D.start(models, w16, [prompt], su.max_new, **kw)
  res["bytes"] = bytes_section(su, models, st, bw)
  save("bytes")
  impls = ("xla", "pallas")
  if "target" in only:
    res["target"] = target_section(su, models, st, res, bw, impls)
    save("target")
  if "draft" in only:
    res["draft"] = draft_section(su, models, st, impl)
    if "target" in res:
      t = res["target"]
      best = min(t["verify16_xla_ms"], t["verify16_pallas_ms"])
      res["draft"].update(round_ms=res["draft"]["draft_ms"] + best + t["commit_ms"],
                          draft_fraction=res["draft"]["draft_ms"] / (
                              res["draft"]["draft_ms"] + best + t["commit_ms"]))
    save("draft")
  del st
  if not only & {"target_only", "oracle", "replay"}:
    return
  n_oracle = su.max_new + su.drafter.block_size
  D.generate_target_only(models.target, su.target, [prompt], 4, target_impl=target_impl,
                         rounds_per_call=su.sync_every, **kw)
  g0 = D.generate_target_only(models.target, su.target, [prompt], n_oracle,
                              target_impl=target_impl, rounds_per_call=su.sync_every, **kw)
  base_tps = g0.n_tokens / g0.seconds
  res["target_only"] = dict(tokens=g0.n_tokens, seconds=g0.seconds, tokens_per_s=base_tps)
  save("target_only")
  oracle = [prompt + g0.tokens[0]]
  if "oracle" in only or "replay" in only:
    res["oracle"] = []
    for k in (su.ks if "oracle" in only else su.ks[-1:]):
      o = oracle_run(su, models, prompt, oracle, g0, base_tps, k, impl, kw,
                     target_impl=target_impl, keep_tokens=True)
      res["oracle"].append(o)
      save("oracle")
      oracle = [prompt + o.pop("_tokens")]
  if "replay" in only:
    a = replay_acceptance()
    res["replay"] = [replay_run(su, models, prompt, oracle[0], base_tps, k, a, impl,
                                target_impl, kw) for k in su.replay_ks]
    save("replay")


def main(argv=None) -> int:
  p = C.arg_parser(__doc__, "targets", "the 30B targets on the GPU")
  p.add_argument("--models", default="glimmer,moe", help="glimmer, moe (comma list)")
  p.add_argument("--only", default="target,draft,target_only,oracle,replay",
                 help="sections after bytes: target, draft, target_only, oracle, replay")
  p.add_argument("--target-impl", default=None, choices=("xla", "pallas"),
                 help="the target's GEMMs in the decoding loop (default: pallas on a GPU)")
  args = p.parse_args(argv)
  impl = "pallas" if C.ON_GPU else "xla"   # the drafter's kernels (interpret mode is slow)
  target_impl = args.target_impl or impl
  res, out_dir = C.start_results(p, args, argv)
  bw = C.copy_bandwidth(1 << 30 if args.gpu else 1 << 22)
  res.update(copy_bw_TBps=bw / 1e12, drafter_impl=impl, target_impl=target_impl,
             replay_a=replay_acceptance(), models={})
  only = set(args.only.split(","))
  t_start = time.perf_counter()
  all_setups = setups(args.smoke)
  for name in args.models.split(","):
    su = all_setups[name]
    r = res["models"][name] = dict(setup=dict(
        target=dataclasses.asdict(su.target), drafter=dataclasses.asdict(su.drafter),
        capacity=su.capacity, prompt_len=su.prompt_len, max_new=su.max_new))

    def save(section: str, r=r, name=name) -> None:
      r.setdefault("elapsed_s", {})[section] = time.perf_counter() - t_start
      C.save_results(out_dir, "targets", res)
      shown = {k: v for k, v in (r.get(section) or {}).items()} if isinstance(
          r.get(section), dict) else r.get(section)
      print(f"[{name} {section} done at {time.perf_counter() - t_start:.0f} s] "
            f"{json.dumps(shown, default=str)}", flush=True)

    run_model(su, r, only, bw, impl, target_impl, save)
    for key in ("_expert_bytes", "_dense_plus_cache"):
      r["bytes"].pop(key, None)
    C.save_results(out_dir, "targets", res)
  print(C.save_results(out_dir, "targets", res, markdown(res)))
  return 0


def markdown(res: dict) -> str:
  lines = [f"- device: {res['device']}, jax {res['jax']}, drafter impl {res['drafter_impl']}, "
           f"loop target impl {res['target_impl']}; copy bandwidth {res['copy_bw_TBps']:.2f} "
           f"TB/s; command `{res['command']}`",
           f"- replayed acceptance: a = {res['replay_a']:.3f} per draft (mean run "
           f"{MEAN_RUN_15} of 15; the document's {DOCUMENT_SPEEDUP}x at 4 drafts)"]
  for name, r in res["models"].items():
    b = r.get("bytes", {})
    lines += ["", f"### {name}", "",
              f"- bytes: target {b.get('target_GB', 0):.2f} GB (embedding "
              f"{b.get('target_embedding_GB', 0):.2f}), decode1 reads "
              f"{b.get('decode1_floor_ms', 0) * res['copy_bw_TBps']:.2f} GB -> floor "
              f"{b.get('decode1_floor_ms', 0):.3f} ms; K/V cache {b.get('kv_cache_GB', 0):.3f} GB;"
              f" drafter body {b.get('drafter_body_GB', 0):.2f} GB"]
    t = r.get("target")
    if t:
      lines += ["", "| pass | impl | device ms | floor ms | fraction of floor |",
                "|---|---|---|---|---|"]
      for impl in ("xla", "pallas"):
        lines.append(f"| decode1 | {impl} | {t[f'decode1_{impl}_ms']:.3f} | "
                     f"{b['decode1_floor_ms']:.3f} | {t[f'decode1_{impl}_floor_fraction']:.3f} |")
        lines.append(f"| verify16 | {impl} | {t[f'verify16_{impl}_ms']:.3f} | "
                     f"{t['verify16_floor_ms']:.3f} | {t[f'verify16_{impl}_floor_fraction']:.3f} |")
      for name in ("decode1", "verify16"):
        ks = t.get(f"{name}_pallas_kernels")
        if ks:
          lines.append(f"- {name} pallas: {ks['launches']:.0f} launches "
                       f"({ks['launches_per_layer']:.1f} per layer); by kernel (launches, us): "
                       + ", ".join(f"{n} {c:g} {us:.0f}"
                                   for n, c, us in ks["kernels"][:REPORT_KERNELS]))
      note = f"\n- commit alone {t['commit_ms']:.4f} ms (in every pass above)"
      if "verify16_experts_touched" in t:
        e = t["verify16_experts_touched"]
        note += (f"; a 16-row verify touches {e['mean']:.1f} experts per layer (min {e['min']}, "
                 f"max {e['max']}) of {r['setup']['target']['num_experts']}")
      lines.append(note)
    d = r.get("draft")
    if d:
      lines.append(f"- draft {d['draft_ms']:.3f} ms" + (
          f"; round (draft + verify16 + commit) {d['round_ms']:.3f} ms, draft fraction "
          f"{d['draft_fraction']:.3f}" if "round_ms" in d else ""))
    if "target_only" in r:
      lines.append(f"- target-only: {r['target_only']['tokens_per_s']:.1f} tokens/s")
    if r.get("oracle"):
      lines += ["", "| oracle k | tau | tokens/s | ms/round | speedup |", "|---|---|---|---|---|"]
      for o in r["oracle"]:
        lines.append(f"| {o['k']} | {o['tau']:.2f} | {o['tokens_per_s']:.1f} | "
                     f"{o['ms_per_round']:.3f} | {o['speedup']:.2f}x |")
    if r.get("replay"):
      lines += ["", "| replay k | expected accepted | measured accepted | tokens/s | ms/round | "
                "speedup |", "|---|---|---|---|---|---|"]
      for o in r["replay"]:
        lines.append(f"| {o['k']} | {o['expected_accepted']:.2f} | {o['accepted_mean']:.2f} | "
                     f"{o['tokens_per_s']:.1f} | {o['ms_per_round']:.3f} | {o['speedup']:.2f}x |")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
