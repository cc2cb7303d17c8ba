"""Speculative decoding on the GPU: a Qwen3-8B-shaped target with a Qwen3-8B-DFlash-shaped drafter.

  python -m benchmarks.decode --gpu [--out results/NAME] [--skinny]
                              [--family dflash|dflash2|dspark] [--cuts 0.5,0.8]
  python -m benchmarks.decode --smoke        # CPU, tiny dims, seconds (CI): not results

--family picks the drafter: DFlash (Qwen3-8B-DFlash-b16's shape), DFlash2 (the same dims with
Muse-Glimmer-30B-DFlash2's family fields: K 2, G 16, R 256, k 16, the multiplier and softcap)
or DSpark (DSPARK_QWEN3_8B_CONFIG: block 7, shifted rows, a vanilla Markov head, a confidence
head). A round verifies width rows whatever the family (decode.DecodeConfig): width block_size
for DFlash / DFlash2, block_size + 1 for DSpark (its block of w rows gives w drafts). The
reduced draft vocab of section 3 is DFlash's only (the others index the full vocabulary).
--cuts adds oracle rows with the drafter's confidence / p-min cut (decode.Drafter(cut)): the
oracle's drafts are the target's own, so every cut draft is a draft that would have been
accepted; tau and tokens/s with and without the cut show what computing it costs (random
weights: the values being cut on mean nothing here).

Weights are random bf16, generated on the device (timing does not depend on the values).
Sections, in order (results are saved after each, so a run cut short keeps what it measured):
1. bytes: target, drafter (layers + fc + inject; LM head full and reduced), K/V cache; the
   copy bandwidth measured in this run and the byte floors it implies.
2. target-only greedy decoding (the same target code at width 1): tokens/s, wall clock over
   a long run after a warm-up that compiles it. Its output is the oracle of section 4.
3. one round at width block_size (16; 8 in --smoke), piece by piece, CUPTI device time (median over iterations of the
   kernel sum, XLA copies before aliased kernels excluded): draft (`decode.Drafter().propose`: encode +
   inject of the committed rows + block step + drafts), of which inject and block step
   measured alone; verify of 16 rows; accept + commit; and a 1-token target decode step.
   The draft with the full 151936-token head and with a 32768-token reduced draft vocab.
   The target's passes run inside a fori_loop of several iterations per call (their cache is
   the loop carry, so it is updated in place and copied once per call, not per iteration).
4. oracle acceptance: drafts are the target's own greedy continuation (section 2), with
   k = 3, 7, 15 drafts per round (width k + 1): tokens/s, tau, and tokens/s over
   (k + 1) x target-only tokens/s; bf16 rounding can make a verify of k + 1 rows disagree
   with a 1-row decode on a near tie, so the oracle is refined to the loop's own output until
   every draft is accepted (`oracle_run`); tau is printed and the ratio is also given per
   committed token (over tau x target-only).

The target's K/V cache holds `capacity` slots (2048) and its masked attention reads all of
them in every pass (cost independent of the visible length: keep the capacity modest). The
drafter's layers are all full attention (as z-lab's Qwen3-8B-DFlash-b16), so its cache has
the same `capacity` slots (`decode.start`).
The target's GEMMs are XLA's (`target_impl="xla"`); `--skinny` also times verify / decode with
the Pallas skinny GEMM (`target_impl="pallas"`, two more compiles of the target).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
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
from dflash_jax.drafter import step as S
from dflash_jax.config import DFLASH2_CONFIG, DSPARK_QWEN3_8B_CONFIG, FULL, DSparkFields
from dflash_jax.models import qwen3 as Q

QWEN3_8B_TARGET = Q.TargetConfig(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
    rope_theta=1e6, tie_word_embeddings=False, qk_norm=True, max_position_embeddings=40960)


@dataclasses.dataclass(frozen=True)
class Setup:
  target: Q.TargetConfig
  drafter: dfj.DFlashConfig
  window: int
  capacity: int
  prompt_len: int
  max_new: int          # tokens per timed speculative run
  ks: tuple[int, ...]   # drafts per round in section 4
  draft_vocab: int      # the reduced draft vocab of section 3
  iters: int
  inner: int            # target passes per measured call (section 3)
  sync_every: int       # rounds per device call in timed runs


FAMILIES = ("dflash", "dflash2", "dspark")


def family_drafter(d: dfj.DFlashConfig, family: str, smoke: bool) -> dfj.DFlashConfig:
  """The benchmark's drafter d as a drafter of `family` (the module docstring)."""
  if family == "dflash":
    return d
  if family == "dflash2":
    f = dataclasses.replace(DFLASH2_CONFIG.dflash2, conv_group_size=8, selector_rank=8,
                            selector_top_k=4) if smoke else DFLASH2_CONFIG.dflash2
    return dataclasses.replace(d, family="dflash2", family_fields=f)
  if smoke:
    return dataclasses.replace(d, block_size=7, window=None, layer_types=(FULL,) * d.n_layer,
                               family="dspark", family_fields=DSparkFields(
                                   markov_rank=8, markov_head_type="vanilla",
                                   confidence_head=True, confidence_with_markov=True))
  return DSPARK_QWEN3_8B_CONFIG


def setup(smoke: bool, family: str = "dflash") -> Setup:
  if smoke:
    t = Q.TargetConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=1e4)
    d = dataclasses.replace(dfj.TINY_CONFIG, n_layer=1, n_embd=32, n_ff=64, n_head=2,
                            n_head_kv=1, target_layers=(0, 1), mask_token_id=255, block_size=8,
                            window=32)
    return Setup(t, family_drafter(d, family, True), window=32, capacity=64, prompt_len=12,
                 max_new=24, ks=(3,), draft_vocab=64, iters=1, inner=2, sync_every=4)
  d = family_drafter(dfj.QWEN3_8B_CONFIG, family, False)
  ks = tuple(k for k in (3, 7, 15) if k <= d.n_drafts())
  return Setup(QWEN3_8B_TARGET, d, window=2048, capacity=2048, prompt_len=128, max_new=512,
               ks=ks, draft_vocab=32768, iters=20, inner=8, sync_every=64)


def random_models(su: Setup, on_device: bool) -> D.Models:
  """Random bf16 target + drafter of su's shapes; the drafter borrows the target's embedding
  and LM head (the same device arrays). on_device: weights drawn on the device (the real
  sizes); else host weights, quicker at tiny dims than compiling a device RNG per shape."""
  tc, dc = su.target, su.drafter
  tp = Q.init_params(tc, jax.random.key(0), jnp.bfloat16)
  # The family's vocab-sized tables need the target's vocabulary; DFlash's stand-in head is
  # replaced by the target's anyway.
  n_vocab = 16 if dc.family == "dflash" else tc.vocab_size
  dp = (C.random_params(dc, n_vocab, "bf16") if on_device else dfj.prepare_weights(
      dc, {**dfj.synthetic_drafter(dc, with_target=False, n_vocab=tc.vocab_size),
           "tok_embd": tp.embed, "lm_head": tp.head}, "bf16"))
  dp = dp.replace(tok_embd=tp.embed, lm_head=tp.head)
  return D.Models(target=tp, drafter=dp, d2t=None, target_cfg=tc)


def device_ms(f, *args, iters: int, per_call: int = 1) -> float:
  """Median CUPTI kernel time of one call of f (copies excluded), divided by per_call."""
  per = C.cupti_kernels(f, *args, iterations=iters)
  per = [[k for k in it if "copy" not in k[0].lower()] for it in per]
  return C.device_ms(per) / per_call


def target_loop(tc: Q.TargetConfig, inner: int, capture, impl: str):
  """run(params, cache, tokens [1, w]): `inner` target passes of w rows at one position (the
  cache length is restored after each pass), each pass's argmax feeding the next; returns the
  last tokens only. Weights are arguments, never closed over (no constants in the program)."""

  def run(tp, cache, tokens):
    def body(_, c):
      cache, toks = c
      new, logits, feats = tc.verify(tp, cache, toks, capture_layers=capture, impl=impl)
      toks = jnp.argmax(logits, -1).astype(jnp.int32)
      if capture:   # keep the captured features live, as the round needs them
        toks = toks + (feats[..., 0] > 1e30).astype(jnp.int32)
      return new, toks   # nothing committed: the next pass is at the same position
    return lax.fori_loop(0, inner, body, (cache, tokens))[1]
  return jax.jit(run)


def bytes_section(su: Setup, models: D.Models, reduced: D.Models | None, st: D.DecodeState,
                  bw: float):
  dp = models.drafter
  target = C.tree_bytes(models.target)
  # The family's tensors count in full (DFlash2's codebooks are read by gathered rows, so this
  # overstates them; DSpark's W2 is read once per draft row, so it understates that).
  drafter_body = C.tree_bytes((dp.layers, dp.fc, [ip.w for ip in dp.inject], dp.enc_norm,
                               dp.out_norm, dp.family))
  head = C.tree_bytes(dp.lm_head)
  head_r = C.tree_bytes((reduced or models).drafter.lm_head)
  cache = C.tree_bytes((st.cache.k, st.cache.v))
  ring = C.tree_bytes(st.ring)
  # One decode step reads every target weight but the embedding (a gather of one row) and
  # the whole cache; one draft step reads the drafter's layers, its head and the ring.
  embed = C.tree_bytes(models.target.embed)
  r = dict(target_GB=target / 1e9, target_embedding_GB=embed / 1e9, drafter_body_GB=drafter_body / 1e9,
           drafter_head_full_GB=head / 1e9, drafter_head_reduced_GB=head_r / 1e9,
           kv_cache_GB=cache / 1e9, ring_GB=ring / 1e9,
           decode_step_floor_ms=(target - embed + cache) / bw * 1e3,
           draft_floor_full_ms=(drafter_body + head + ring) / bw * 1e3,
           draft_floor_reduced_ms=(drafter_body + head_r + ring) / bw * 1e3)
  r["draft_byte_fraction_full"] = r["draft_floor_full_ms"] / (r["draft_floor_full_ms"] + r["decode_step_floor_ms"])
  r["draft_byte_fraction_reduced"] = r["draft_floor_reduced_ms"] / (
      r["draft_floor_reduced_ms"] + r["decode_step_floor_ms"])
  return r


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  mode = p.add_mutually_exclusive_group(required=True)
  mode.add_argument("--gpu", action="store_true", help="Qwen3-8B shapes on the GPU")
  mode.add_argument("--smoke", action="store_true", help="tiny dims on any backend (not results)")
  p.add_argument("--skinny", action="store_true",
                 help="also time verify/decode with the Pallas skinny GEMM for the target")
  p.add_argument("--ks", default=None, help="drafts per round in section 4 (default 3,7,15, "
                 "those the drafter's block can draft)")
  p.add_argument("--family", choices=FAMILIES, default="dflash", help="the drafter's family")
  p.add_argument("--cuts", default="",
                 help="comma list of cut thresholds for extra oracle rows (decode.Drafter(cut))")
  p.add_argument("--only", default="round,oracle",
                 help="sections after bytes and target-only: round, oracle (comma list)")
  p.add_argument("--out", default=None, help="results folder (default results/decode-<stamp>)")
  args = p.parse_args(argv)
  if args.gpu and not C.ON_GPU:
    p.error("--gpu needs a GPU backend")
  su = setup(args.smoke, args.family)
  only = set(args.only.split(","))
  cuts = [float(c) for c in args.cuts.split(",") if c]
  if args.ks:
    su = dataclasses.replace(su, ks=tuple(int(k) for k in args.ks.split(",")))
  impl = "pallas" if C.ON_GPU else "xla"   # the drafter's kernels (interpret mode is slow)
  res: dict = C.run_header("python -m benchmarks.decode " +
                           " ".join(argv if argv is not None else sys.argv[1:]), args.smoke)
  out_dir = args.out or os.path.join("results", f"decode-{res['date']}")
  os.makedirs(out_dir, exist_ok=True)
  res.update(setup=dict(dataclasses.asdict(su), target=dataclasses.asdict(su.target),
                        drafter=dataclasses.asdict(su.drafter)), drafter_impl=impl)
  t_start = time.perf_counter()

  def save(section: str) -> None:
    res.setdefault("elapsed_s", {})[section] = time.perf_counter() - t_start
    C.save_results(out_dir, "decode", res)
    print(f"[{section} done at {time.perf_counter() - t_start:.0f} s] "
          f"{json.dumps(res.get(section), default=str)}", flush=True)

  bw = C.copy_bandwidth(1 << 30 if args.gpu else 1 << 22)
  res["copy_bw_TBps"] = bw / 1e12
  tc, dc = su.target, su.drafter
  models = random_models(su, on_device=args.gpu)
  tp, dp = models.target, models.drafter
  reduced = None
  if dc.family == "dflash":
    d2t = jnp.arange(su.draft_vocab, dtype=jnp.int32)
    reduced = models.replace(drafter=dp.replace(lm_head=tp.head[:su.draft_vocab]), d2t=d2t)
  prompt = np.random.default_rng(0).integers(0, tc.vocab_size, su.prompt_len).tolist()
  kw = dict(capacity=su.capacity, window=su.window, cache_dtype="bf16", ring_dtype="bf16")
  # The widest round the drafter's block allows: block_size drafts rows verified + id_last.
  w16 = D.DecodeConfig(width=dc.n_drafts() + 1, impl=impl)
  probe = D.start(models, w16, [prompt], su.max_new, **kw)
  res["bytes"] = bytes_section(su, models, reduced, probe, bw)
  del probe
  save("bytes")

  # 2. Target-only: a warm-up run compiles it (same capacity: same shapes), then the timed run,
  # long enough to give the oracle for every speculative run.
  n_oracle = su.max_new + w16.width
  D.generate_target_only(tp, tc, [prompt], 4, rounds_per_call=su.sync_every, **kw)
  g0 = D.generate_target_only(tp, tc, [prompt], n_oracle, rounds_per_call=su.sync_every, **kw)
  base_tps = g0.n_tokens / g0.seconds
  oracle = [prompt + g0.tokens[0]]
  res["target_only"] = dict(tokens=g0.n_tokens, seconds=g0.seconds, tokens_per_s=base_tps,
                            ms_per_token=1e3 / base_tps, prefill_s=g0.prefill_seconds)
  save("target_only")

  if "round" in only:
    round_section(su, res, models, reduced, prompt, oracle, w16, kw, impl, args.skinny)
    save("round_ms")
  if "oracle" in only:
    res["oracle"] = []
    for k in su.ks:
      for cut in [0.0] + cuts:
        res["oracle"].append(oracle_run(su, models, prompt, oracle, g0, base_tps, k, impl, kw,
                                        cut=cut))
        save("oracle")
  print(C.save_results(out_dir, "decode", res, markdown(res)))
  return 0


def round_section(su, res, models, reduced, prompt, oracle, w16, kw, impl, skinny) -> None:
  """Section 3. The state: the prompt prefilled, then as after a round that accepted 15
  drafts (16 committed rows pending for inject; the cache and ring lengths to match)."""
  tc, dc, tp, dp = su.target, su.drafter, models.target, models.drafter
  st = D.start(models, w16, [prompt], su.max_new, **kw)
  w = w16.width
  keys = jax.random.split(jax.random.key(2), 4)
  st = st.replace(pending=jax.random.normal(keys[0], st.pending.shape, jnp.float32),
                  n_new=st.n_new + w, n_past=st.n_past + w,
                  cache=tc.commit(st.cache, jnp.full(st.n_past.shape, w, jnp.int32)))
  key = jax.random.split(keys[1], 1)
  parts = {}
  t0 = time.perf_counter()
  # The drafter's own drafts; weights are arguments of every measured function.
  propose = jax.jit(lambda m, s, k: D.Drafter().propose(m, w16, s, k)[1].drafts)
  for name, m in (("draft_full_vocab", models), ("draft_reduced_vocab", reduced)):
    if m is not None:
      parts[name] = device_ms(propose, m, st, key, iters=su.iters)
  ring0 = jax.tree.map(lambda a: a[0], st.ring)
  positions = st.n_past[0] - st.n_new[0] + jnp.arange(st.pending.shape[1], dtype=jnp.int32)
  # One element of every ring buffer out: the kernel writes them all, nothing big is returned.
  inject = jax.jit(lambda d, r, f, pos, n: jax.tree.map(
      lambda a: a.ravel()[0], S.inject(d, r, S.encode(d, f, impl=impl), pos, n, impl=impl)))
  parts["inject"] = device_ms(inject, dp, ring0, st.pending[0], positions, st.n_new[0],
                              iters=su.iters)
  block = jax.jit(lambda d, r, i, n: S.greedy_drafts(S.block_step(d, r, i, n, impl=impl)))
  parts["block_step_full_vocab"] = device_ms(block, dp, ring0, st.id_last[0], st.n_past[0],
                                             iters=su.iters)
  p = int(st.n_past[0])
  drafts = jnp.asarray(np.asarray(oracle[0], np.int32)[None, p + 1:p + w])
  # Accept + commit does the same work whatever the values: random verify outputs.
  logits = jax.random.normal(keys[2], (1, w, tc.vocab_size), jnp.float32)
  feats = jax.random.normal(keys[3], (1, w, dc.n_embd_fc), jnp.float32)
  commit = jax.jit(lambda m, s, d, lg, f, k: (lambda o: (o.tokens, o.n_past, o.pending, o.hist))(
      D.accept_commit(m, w16, s, D.Proposal(d), lg, f, k)))
  parts["accept_commit"] = device_ms(commit, models, st, drafts, logits, feats, key,
                                     iters=su.iters)
  res["compile_and_measure_draft_parts_s"] = time.perf_counter() - t0
  vt = jnp.concatenate([st.id_last[:, None], drafts], 1)
  for impl_t in ("xla", "pallas") if skinny else ("xla",):
    sfx = "" if impl_t == "xla" else "_skinny"
    t0 = time.perf_counter()
    f16 = target_loop(tc, su.inner, dc.target_layers, impl_t)
    parts["verify_block" + sfx] = device_ms(f16, tp, st.cache, vt, iters=su.iters, per_call=su.inner)
    f1 = target_loop(tc, su.inner, (), impl_t)
    parts["decode1" + sfx] = device_ms(f1, tp, st.cache, vt[:, :1], iters=su.iters,
                                       per_call=su.inner)
    res[f"compile_and_measure_target{sfx}_s"] = time.perf_counter() - t0
  parts["block_width"] = w
  rnd = parts["draft_full_vocab"] + parts["verify_block"] + parts["accept_commit"]
  parts.update(round_full_vocab=rnd,
               verify_block_over_decode1=parts["verify_block"] / parts["decode1"],
               draft_fraction_full_vocab=parts["draft_full_vocab"] / rnd,
               decode1_floor_fraction=res["bytes"]["decode_step_floor_ms"] / parts["decode1"])
  if "draft_reduced_vocab" in parts:
    rnd_r = parts["draft_reduced_vocab"] + parts["verify_block"] + parts["accept_commit"]
    parts.update(round_reduced_vocab=rnd_r,
                 draft_fraction_reduced_vocab=parts["draft_reduced_vocab"] / rnd_r)
  res["round_ms"] = parts


def oracle_run(su, models, prompt, oracle, g0, base_tps, k, impl, kw,
               max_refine: int = 12, target_impl: str = "xla", keep_tokens: bool = False,
               cut: float = 0.0) -> dict:
  """Section 4 for one k: a warm-up run compiles (same shapes), then timed runs. The first
  oracle is target-only greedy output; a bf16 verify of k + 1 rows can break a near tie
  differently from a 1-row decode, after which that oracle is wrong for the rest of the run.
  So the oracle is refined to a fixed point: each run's committed tokens become the next
  run's oracle (the agreeing prefix grows by at least one round per run) until a run commits
  exactly its oracle, i.e. every draft of every round was accepted. The last run is reported
  (with keep_tokens, its tokens too, as "_tokens"). cut > 0: the drafter's cut shortens each
  round's verify (`Oracle(cut=...)`)."""
  dcfg = D.DecodeConfig(width=k + 1, impl=impl, target_impl=target_impl,
                        proposer=Oracle(cut=cut))
  length = len(oracle[0]) + k + 1
  t0 = time.perf_counter()
  D.generate(models, dcfg, [prompt], 4, proposer_state=Oracle.state(oracle, length),
             rounds_per_call=su.sync_every, **kw)
  warm = time.perf_counter() - t0
  for runs in range(1, max_refine + 1):
    g = D.generate(models, dcfg, [prompt], su.max_new, proposer_state=Oracle.state(oracle, length),
                   rounds_per_call=su.sync_every, **kw)
    fixed = list(g.tokens[0]) == list(oracle[0][len(prompt):len(prompt) + g.n_tokens])
    if fixed:
      break
    # Past the run's output the oracle keeps its old tail (only its first max_new tokens count).
    oracle = [prompt + list(g.tokens[0]) + list(oracle[0][len(prompt) + g.n_tokens:])]
  tps = g.n_tokens / g.seconds
  agree = sum(a == b for a, b in zip(g.tokens[0], g0.tokens[0]))
  extra = {"_tokens": list(g.tokens[0])} if keep_tokens else {}
  return dict(**extra, k=k, cut=cut, width=k + 1, tokens=g.n_tokens, rounds=int(g.rounds.sum()),
              tau=g.tau,
              hist=g.hist.sum(0).tolist(), tokens_per_s=tps,
              ms_per_round=g.seconds / g.rounds.sum() * 1e3,
              ratio_vs_k_plus_1=tps / ((k + 1) * base_tps), ratio_vs_tau=tps / (g.tau * base_tps),
              speedup=tps / base_tps, matches_target_only=f"{agree}/{g.n_tokens}",
              oracle_runs=runs, oracle_fixed_point=fixed, warmup_compile_s=warm)


def markdown(res: dict) -> str:
  b, r, t = res["bytes"], res.get("round_ms", {}), res["target_only"]
  family = res["setup"]["drafter"]["family"]
  lines = [f"- device: {res['device']}, jax {res['jax']}, drafter {family}"
           f", impl {res['drafter_impl']}; "
           f"copy bandwidth {res['copy_bw_TBps']:.2f} TB/s; command `{res['command']}`",
           f"- bytes: target {b['target_GB']:.2f} GB (embedding {b['target_embedding_GB']:.2f}), "
           f"drafter body {b['drafter_body_GB']:.2f} GB + head {b['drafter_head_full_GB']:.2f} GB "
           f"(reduced {b['drafter_head_reduced_GB']:.3f} GB, DFlash only), K/V cache "
           f"{b['kv_cache_GB']:.3f} GB, "
           f"ring {b['ring_GB']:.3f} GB; floors: decode step {b['decode_step_floor_ms']:.3f} ms, "
           f"draft {b['draft_floor_full_ms']:.3f} / {b['draft_floor_reduced_ms']:.3f} ms "
           f"(byte fraction {b['draft_byte_fraction_full']:.3f} / {b['draft_byte_fraction_reduced']:.3f})",
           f"- target-only: {t['tokens_per_s']:.1f} tokens/s ({t['ms_per_token']:.3f} ms/token wall)"]
  if r:
    lines += ["", f"| piece (width {r['block_width']}) | device ms |", "|---|---|"]
    for k in ("draft_full_vocab", "inject", "block_step_full_vocab", "draft_reduced_vocab",
              "verify_block", "accept_commit", "decode1", "verify_block_skinny", "decode1_skinny",
              "round_full_vocab", "round_reduced_vocab"):
      if k in r:
        lines.append(f"| {k} | {r[k]:.4f} |")
    reduced = r.get("draft_fraction_reduced_vocab")
    lines += ["", f"verify of {r['block_width']} rows / decode1 = "
              f"{r['verify_block_over_decode1']:.3f}; draft fraction "
              f"{r['draft_fraction_full_vocab']:.3f} (full vocab), "
              f"{'-' if reduced is None else f'{reduced:.3f}'} (reduced draft vocab); decode1 "
              f"moves its bytes at {r['decode1_floor_fraction']:.2f} of the copy bandwidth"]
  lines += ["", "| k | cut | tau | tokens/s | ms/round (wall) | speedup | / ((k+1) x "
            "target-only) | / (tau x target-only) | matches target-only | oracle runs (fixed "
            "point) |", "|" + "---|" * 10]
  for o in res.get("oracle", []):
    lines.append(f"| {o['k']} | {o.get('cut', 0.0):g} | {o['tau']:.2f} | "
                 f"{o['tokens_per_s']:.1f} | {o['ms_per_round']:.3f} | "
                 f"{o['speedup']:.2f}x | {o['ratio_vs_k_plus_1']:.3f} | {o['ratio_vs_tau']:.3f} | "
                 f"{o['matches_target_only']} | {o['oracle_runs']} ({o['oracle_fixed_point']}) |")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
