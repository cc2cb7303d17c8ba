"""The Qwen3.5 / 3.6 hybrid target on the GPU: decode, verify and rollback against byte floors.

  python -m benchmarks.gdn --gpu [--out results/NAME] [--only bytes,round,target_only,oracle]
  python -m benchmarks.gdn --smoke          # CPU, tiny dims, seconds (CI): not results

Issue 42 point 5. Random bf16 weights generated on the device at Qwen3.6-27B-like shapes: 64
layers (48 Gated DeltaNet, full attention every 4th), hidden 5120, MLP 17408, vocab 248320,
attention 24 q / 4 kv heads x 256 with a 25% rotary width, Gated DeltaNet 16 key / 48 value
heads x 128 (the note's Qwen3.8-27B fixture; its Qwen3.5-27B figures give no linear head
counts, `--value-heads` changes it), conv width 4; the drafter of Qwen3.6-27B-DFlash's
published shape (5 full-attention layers of hidden 5120, MLP 17408, 32 / 8 heads x 128,
block 16, taps HF [1, 16, 31, 46, 61]). Sections (saved after each, so a cut run keeps what
it measured):
1. bytes: weights (less the embedding, which a step gathers one row of), the K/V cache at
   the capacity (the masked attention reads every slot), the recurrent state; the copy
   bandwidth of this run and the byte floor it gives a step: weights + K/V + the state read
   and written once. Per rollback, the memory one slot's verify of 16 rows adds
   (`pending_nbytes`), checked against the device's free memory before anything else runs.
   Counting takes no device time: `--only round` counts too, for the round's fractions.
2. round: CUPTI device time (median of `iters` calls, XLA's copies excluded; several target
   passes per call in a fori_loop whose carry is the cache, so it is updated in place):
   decode1 (a verify of 1 row + its commit), verify16 + commit (16 rows, 8 kept) and the
   commit alone, per rollback; the bare verify16 (the replay config with its pending data
   dropped: no rollback data kept) gives each rollback's cost per round, verify + commit -
   bare. Fractions of the floor and verify16 / decode1 against the issue's goals (>= 0.8,
   <= 1.3).
3. target_only: target-only greedy decoding (the loop at width 1), tokens/s wall clock after
   a warm-up that compiles it; its output is section 4's oracle.
4. oracle: drafts are the target's own continuation with k = 3, 7, 15 drafts per round,
   refined to a fixed point as benchmarks/decode.py does (a bf16 verify of k + 1 rows can
   break a near tie differently from a 1-row decode): tokens/s, tau, speedup.
Sections 3 and 4 run the decode loop through the Target protocol (Models.target_cfg). Each
compiled program holds all 64 layers: section 2 compiles the target 4 times per rollback and
once more for the bare verify; section 3 once, section 4 once per k. Run the sections in
separate commands (`--only`) to stay within a command's time limit.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import dflash_jax as dfj
from benchmarks import common as C
from benchmarks.oracle import Oracle
from dflash_jax import decode as D
from dflash_jax.config import FULL
from dflash_jax.models import qwen3_5 as M
from dflash_jax.models.base import prefill_bucket

SECTIONS = ("bytes", "round", "target_only", "oracle")


@dataclasses.dataclass(frozen=True)
class Setup:
  target: M.TargetConfig
  drafter: dfj.DFlashConfig
  capacity: int
  prompt_len: int
  max_new: int          # tokens per timed speculative run
  ks: tuple[int, ...]   # drafts per round in section 4
  iters: int
  inner: int            # target passes per measured call (section 2)
  sync_every: int       # rounds per device call in timed runs
  target_impl: str
  drafter_impl: str


def qwen3_6_27b_like(value_heads: int = 48) -> M.TargetConfig:
  return M.TargetConfig(
      vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
      num_attention_heads=24, num_key_value_heads=4, head_dim=256,
      linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
      linear_num_key_heads=16, linear_num_value_heads=value_heads, rms_norm_eps=1e-6,
      rope_theta=1e7, partial_rotary_factor=0.25, max_position_embeddings=262144)


QWEN3_6_27B_DFLASH = dfj.DFlashConfig(
    n_layer=5, n_embd=5120, n_ff=17408, n_head=32, n_head_kv=8, head_dim=128, rope_theta=1e7,
    eps=1e-6, target_layers=(2, 17, 32, 47, 62), mask_token_id=248070, block_size=16,
    window=None, layer_types=(FULL,) * 5, context_length=262144)


def setup(smoke: bool, value_heads: int) -> Setup:
  if smoke:
    lt = (M.LINEAR, M.LINEAR, M.LINEAR, M.FULL)
    t = M.TargetConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, layer_types=lt,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=1,
        linear_num_value_heads=2, rope_theta=1e4, partial_rotary_factor=0.5,
        max_position_embeddings=512)
    d = dataclasses.replace(dfj.TINY_CONFIG, n_layer=1, n_embd=32, n_ff=64, n_head=2,
                            n_head_kv=1, target_layers=(1, 4), mask_token_id=255, block_size=8,
                            window=32)
    return Setup(t, d, capacity=64, prompt_len=12, max_new=24, ks=(3,), iters=1, inner=2,
                 sync_every=4, target_impl="xla", drafter_impl="xla")
  return Setup(qwen3_6_27b_like(value_heads), QWEN3_6_27B_DFLASH, capacity=1024,
               prompt_len=128, max_new=256, ks=(3, 7, 15), iters=10, inner=4, sync_every=64,
               target_impl="pallas", drafter_impl="pallas")


def random_models(su: Setup, on_device: bool) -> D.Models:
  """Random bf16 target + drafter; the drafter borrows the target's embedding and head."""
  tc, dc = su.target, su.drafter
  tp = M.init_params(tc, jax.random.key(0), jnp.bfloat16)
  dp = (C.random_params(dc, 16, "bf16") if on_device else dfj.prepare_weights(
      dc, {**dfj.synthetic_drafter(dc, with_target=False),
           "tok_embd": np.zeros((tc.vocab_size, dc.n_embd)),
           "lm_head": np.zeros((tc.vocab_size, dc.n_embd))}, "bf16"))
  return D.Models(target=tp, drafter=dp.replace(tok_embd=tp.embed, lm_head=tp.head), d2t=None,
                  target_cfg=tc)


def device_ms(f, *args, iters: int, per_call: int = 1) -> float:
  """Median CUPTI kernel time of one call of f (copies excluded), divided by per_call."""
  per = C.cupti_kernels(f, *args, iterations=iters)
  return C.device_ms(C.without_copies(per)) / per_call


def bytes_section(su: Setup, tp, cache, bw: float, width: int) -> dict:
  tc = su.target
  weights = C.tree_bytes(tp) - (C.tree_bytes(tp.embed) if tp.lm_head is not None else 0)
  kv = C.tree_bytes((cache.k, cache.v))
  state = C.tree_bytes(cache.state)
  conv = C.tree_bytes(cache.conv)
  floor = weights + kv + 2 * (state + conv)
  r = dict(weights_read_GB=weights / 1e9, kv_cache_GB=kv / 1e9, state_MB=state / 1e6,
           conv_MB=conv / 1e6, floor_GB=floor / 1e9, step_floor_ms=floor / bw * 1e3,
           verify_width=width)
  for rb in M.ROLLBACKS:
    c = dataclasses.replace(tc, rollback=rb)
    r[f"pending_{rb}_MB_per_slot"] = M.pending_nbytes(c, 1, width) / 1e6
    r[f"cache_{rb}_GB_per_slot"] = c.cache_nbytes(1, su.capacity, "bf16", width) / 1e9
  return r


def check_memory(su: Setup, width: int) -> None:
  """Refuse to start when one slot's cache plus a verify's pending data exceeds the free
  device memory (the weights already placed)."""
  stats = jax.devices()[0].memory_stats() or {}
  free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
  need = max(dataclasses.replace(su.target, rollback=rb).cache_nbytes(1, su.capacity, "bf16",
                                                                      width)
             for rb in M.ROLLBACKS)
  if stats and need > free:
    raise SystemExit(f"the cache of one slot with a verify of {width} rows needs "
                     f"{need / 1e9:.2f} GB; {free / 1e9:.2f} GB free")


def target_loop(tc: M.TargetConfig, inner: int, capture, impl: str, keep: int | None):
  """run(params, cache, tokens [1, w]): `inner` passes of a verify of w rows at one position,
  each followed by commit(keep) (None: the pending data dropped, no commit), the length put
  back after each; each pass's argmax feeds the next. Returns the last tokens."""
  def run(tp, cache, tokens):
    def body(_, c):
      cache, toks = c
      new, logits, feats = tc.verify(tp, cache, toks, capture_layers=capture, impl=impl)
      if keep is None:
        new = new.replace(pending=None)
      else:
        new = tc.commit(new, jnp.full(cache.length.shape, keep, jnp.int32))
      toks = jnp.argmax(logits, -1).astype(jnp.int32)
      if capture:   # keep the captured features live, as the round needs them
        toks = toks + (feats[..., 0] > 1e30).astype(jnp.int32)
      return new.replace(length=cache.length), toks
    return lax.fori_loop(0, inner, body, (cache, tokens))[1]
  return jax.jit(run)


def round_section(su: Setup, tp, cache, tokens, impl: str, rollbacks) -> dict:
  """Section 2 on a prefilled cache of one slot (4 compiles of the target per rollback, one
  for the bare verify)."""
  tc, dc = su.target, su.drafter
  w = dc.block_size
  r = {"rollbacks": list(rollbacks)}
  for rb in rollbacks:
    c = dataclasses.replace(tc, rollback=rb)
    cache_rb = cache.replace(pending=None)
    t0 = time.perf_counter()
    r[f"decode1_{rb}"] = device_ms(target_loop(c, su.inner, (), impl, 1), tp, cache_rb,
                                   tokens[:, :1], iters=su.iters, per_call=su.inner)
    r[f"verify{w}_commit_{rb}"] = device_ms(
        target_loop(c, su.inner, dc.target_layers, impl, w // 2), tp, cache_rb, tokens,
        iters=su.iters, per_call=su.inner)
    verified, _, _ = jax.jit(lambda p, k, t: c.verify(p, k, t, capture_layers=dc.target_layers,
                                                      impl=impl))(tp, cache_rb, tokens)
    commit = jax.jit(lambda k: (lambda o: (o.state, o.conv))(c.commit(k, jnp.asarray([w // 2]))))
    r[f"commit_{rb}"] = device_ms(commit, verified, iters=su.iters)
    r[f"compile_and_measure_{rb}_s"] = time.perf_counter() - t0
  bare = dataclasses.replace(tc, rollback="replay")
  r[f"verify{w}_bare"] = device_ms(target_loop(bare, su.inner, dc.target_layers, impl, None),
                                   tp, cache, tokens, iters=su.iters, per_call=su.inner)
  for rb in rollbacks:
    r[f"rollback_cost_{rb}"] = r[f"verify{w}_commit_{rb}"] - r[f"verify{w}_bare"]
  r["verify_width"] = w
  return r


def floors(res: dict) -> None:
  """The goals: decode1 at >= 0.8 of its floor, verify16 + commit <= 1.3 x decode1."""
  b, r = res.get("bytes"), res.get("round")
  if not (b and r):
    return
  w = r["verify_width"]
  for rb in r["rollbacks"]:
    r[f"decode1_floor_fraction_{rb}"] = b["step_floor_ms"] / r[f"decode1_{rb}"]
    r[f"verify{w}_over_decode1_{rb}"] = r[f"verify{w}_commit_{rb}"] / r[f"decode1_{rb}"]


def oracle_run(su: Setup, models, prompt, oracle, base_tps, k, kw, max_refine: int = 12) -> dict:
  """Section 4 for one k: a warm-up run compiles, then runs refine the oracle to the loop's
  own output until every draft is accepted (see benchmarks/decode.py); the last is kept."""
  dcfg = D.DecodeConfig(width=k + 1, impl=su.drafter_impl, target_impl=su.target_impl,
                        proposer=Oracle())
  length = len(oracle[0]) + k + 1
  t0 = time.perf_counter()
  D.generate(models, dcfg, [prompt], 4, proposer_state=Oracle.state(oracle, length),
             rounds_per_call=su.sync_every, **kw)
  warm = time.perf_counter() - t0
  for runs in range(1, max_refine + 1):
    g = D.generate(models, dcfg, [prompt], su.max_new,
                   proposer_state=Oracle.state(oracle, length), rounds_per_call=su.sync_every,
                   **kw)
    fixed = list(g.tokens[0]) == list(oracle[0][len(prompt):len(prompt) + g.n_tokens])
    if fixed:
      break
    oracle = [prompt + list(g.tokens[0]) + list(oracle[0][len(prompt) + g.n_tokens:])]
  tps = g.n_tokens / g.seconds
  return dict(k=k, width=k + 1, rollback=models.target_cfg.rollback, tokens=g.n_tokens,
              rounds=int(g.rounds.sum()), tau=g.tau, hist=g.hist.sum(0).tolist(),
              tokens_per_s=tps, ms_per_round=g.seconds / g.rounds.sum() * 1e3,
              speedup=tps / base_tps, oracle_runs=runs, oracle_fixed_point=fixed,
              warmup_compile_s=warm)


def markdown(res: dict) -> str:
  lines = [f"- device: {res['device']}, jax {res['jax']}; copy bandwidth "
           f"{res['copy_bw_TBps']:.2f} TB/s; command `{res['command']}`"]
  b = res.get("bytes")
  if b:
    lines.append(
        f"- bytes: weights read {b['weights_read_GB']:.2f} GB, K/V {b['kv_cache_GB']:.3f} GB, "
        f"state {b['state_MB']:.1f} MB (+ conv {b['conv_MB']:.2f} MB); step floor "
        f"{b['step_floor_ms']:.3f} ms; a verify of {b['verify_width']} rows keeps "
        f"{b['pending_snapshot_MB_per_slot']:.1f} MB (snapshot) / "
        f"{b['pending_replay_MB_per_slot']:.1f} MB (replay) per slot")
  r = res.get("round")
  if r:
    w = r["verify_width"]
    lines += ["", "| rollback | decode1 ms | floor fraction | verify%d + commit ms | / decode1 | "
              "commit ms | rollback cost ms |" % w, "|---|---|---|---|---|---|---|"]
    for rb in r["rollbacks"]:
      lines.append(f"| {rb} | {r[f'decode1_{rb}']:.4f} | "
                   f"{r.get(f'decode1_floor_fraction_{rb}', float('nan')):.3f} | "
                   f"{r[f'verify{w}_commit_{rb}']:.4f} | "
                   f"{r.get(f'verify{w}_over_decode1_{rb}', float('nan')):.3f} | "
                   f"{r[f'commit_{rb}']:.4f} | {r[f'rollback_cost_{rb}']:.4f} |")
    lines.append(f"\nbare verify{w} (no rollback data kept): {r[f'verify{w}_bare']:.4f} ms")
  t = res.get("target_only")
  if t:
    lines.append(f"- target-only: {t['tokens_per_s']:.1f} tokens/s "
                 f"({t['ms_per_token']:.3f} ms/token wall)")
  if res.get("oracle"):
    lines += ["", "| k | rollback | tau | tokens/s | ms/round | speedup | oracle runs (fixed) |",
              "|---|---|---|---|---|---|---|"]
    for o in res["oracle"]:
      lines.append(f"| {o['k']} | {o['rollback']} | {o['tau']:.2f} | {o['tokens_per_s']:.1f} | "
                   f"{o['ms_per_round']:.3f} | {o['speedup']:.2f}x | {o['oracle_runs']} "
                   f"({o['oracle_fixed_point']}) |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = C.arg_parser(__doc__, "gdn", "Qwen3.6-27B-like shapes on the GPU")
  p.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
  p.add_argument("--ks", default=None, help="drafts per round in section 4 (default 3,7,15)")
  p.add_argument("--rollback", default="replay", choices=M.ROLLBACKS,
                 help="the rollback of sections 3 and 4")
  p.add_argument("--round-rollbacks", default=",".join(M.ROLLBACKS),
                 help="the rollbacks section 2 measures (comma list)")
  p.add_argument("--value-heads", type=int, default=48, help="Gated DeltaNet value heads")
  args = p.parse_args(argv)
  only = args.only.split(",")
  unknown = sorted(set(only) - set(SECTIONS))
  if unknown:
    p.error(f"unknown sections {unknown}; choose from {SECTIONS}")
  bad = sorted(set(args.round_rollbacks.split(",")) - set(M.ROLLBACKS))
  if bad:
    p.error(f"--round-rollbacks: unknown {bad}; choose from {M.ROLLBACKS}")
  su = setup(args.smoke, args.value_heads)
  su = dataclasses.replace(su, target=dataclasses.replace(su.target, rollback=args.rollback))
  if args.ks:
    su = dataclasses.replace(su, ks=tuple(int(k) for k in args.ks.split(",")))
  res, out_dir = C.start_results(p, args, argv)
  res.update(setup=dict(dataclasses.asdict(su), target=dataclasses.asdict(su.target),
                        drafter=dataclasses.asdict(su.drafter)))
  t_start = time.perf_counter()

  def save(section: str) -> None:
    res.setdefault("elapsed_s", {})[section] = time.perf_counter() - t_start
    floors(res)
    C.save_results(out_dir, "gdn", res, markdown(res))
    print(f"[{section} done at {time.perf_counter() - t_start:.0f} s] "
          f"{json.dumps(res.get(section), default=str)}", flush=True)

  res["copy_bw_TBps"] = C.copy_bandwidth(1 << 30 if args.gpu else 1 << 22) / 1e12
  tc, dc = su.target, su.drafter
  models = random_models(su, on_device=args.gpu)
  tp = models.target
  check_memory(su, dc.block_size)
  prompt = np.random.default_rng(0).integers(0, tc.vocab_size, su.prompt_len).tolist()
  cache = tc.init_cache(1, su.capacity, "bf16")
  bucket = prefill_bucket(su.prompt_len)
  pre = np.zeros((1, bucket), np.int32)
  pre[0, :su.prompt_len] = prompt
  cache, _ = M.prefill_jit(tp, tc, cache, pre, jnp.int32(su.prompt_len), impl=su.target_impl)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, tc.vocab_size, (1, dc.block_size)),
                       jnp.int32)
  if "bytes" in only or "round" in only:
    res["bytes"] = bytes_section(su, tp, cache, res["copy_bw_TBps"] * 1e12, dc.block_size)
    save("bytes")
  if "round" in only:
    res["round"] = round_section(su, tp, cache, tokens, su.target_impl,
                                 args.round_rollbacks.split(","))
    save("round")
  del cache
  kw = dict(capacity=su.capacity, cache_dtype="bf16", ring_dtype="bf16")
  if "target_only" in only or "oracle" in only:
    n_oracle = su.max_new + dc.block_size
    D.generate_target_only(tp, tc, [prompt], 4, rounds_per_call=su.sync_every,
                           target_impl=su.target_impl, **kw)
    g0 = D.generate_target_only(tp, tc, [prompt], n_oracle, rounds_per_call=su.sync_every,
                                target_impl=su.target_impl, **kw)
    base_tps = g0.n_tokens / g0.seconds
    res["target_only"] = dict(tokens=g0.n_tokens, seconds=g0.seconds, tokens_per_s=base_tps,
                              ms_per_token=1e3 / base_tps, prefill_s=g0.prefill_seconds,
                              rollback=tc.rollback)
    save("target_only")
    if "oracle" in only:
      res["oracle"] = []
      for k in su.ks:
        res["oracle"].append(oracle_run(su, models, prompt, [prompt + g0.tokens[0]], base_tps,
                                        k, kw))
        save("oracle")
  print(C.save_results(out_dir, "gdn", res, markdown(res)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
