"""Issue 44's acceptance comparison: DFlash, DFlash2 and DSpark drafters of comparable size
trained for the same steps on the same self-distilled data against the same target, evaluated
with prompt lookup on held-out prompts. CPU-sized (the CPU preset below); --smoke is tiny.

  python -m benchmarks.train_families target   --work W            # the target (train-target)
  python -m benchmarks.train_families drafters --work W            # distill once, train each
  python -m benchmarks.train_families export   --work W            # export the trained weights
  python -m benchmarks.train_families eval     --work W --out OUT  # tau tables, loss curves
  ... --families dflash,dspark                                       # a subset
  ... --smoke                                                        # tiny dims, 30 files

`drafters` distills the training data once (training-split prompts + the target's greedy
continuations, W/distill.npz), then trains each family with `recipes.train_drafter` on those
sequences with the same batches, anchors, steps and schedule, and writes W/<family>/ (weights
as npz, config.json, train_log.json, and the export through `save_drafter` as GGUF and HF, or
the reason it failed). Each family drafts the same number of tokens per round (DFlash and
DFlash2 blocks of 8, DSpark shifted blocks of 7), so all verify 8 rows.

`eval` decodes each held-out prompt alone, two ways:
- the exact evaluator (`reference_generate`): the family's numpy reference (`DFlashRef.draft`:
  the DFlash2 selector walk, DSpark's Markov chain and confidence) proposes, the target's
  compiled cached verify checks, and the drafter's context is injected from the verify's
  features: greedy (T = 0, lossless: the output equals target-only's) and rejection sampling
  (T = 1; DFlash2's sparse q, DSpark's dense q); DSpark also with the confidence cut, and
  both new families without their head (`ABLATION`). tau and histograms only: the drafter is
  numpy, so its seconds mean nothing;
- the compiled loop (`train.evaluate`, `dflash_jax.decode`, impl xla): target-only, every
  family and prompt lookup, greedy with tokens/s (compile excluded); then T = 1 (each family's
  sampled proposals) and DSpark's confidence cut at T = 0 and 1, tau and histograms.
Each family's greedy rows of the two agree (tau within rounding of near-ties), which checks
both. Writes OUT/families.md, OUT/families.json and OUT/loss_curves.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time

import numpy as np

CPU = dict(
    target=["--layers", "4", "--hidden", "128", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "32", "--ffn", "384", "--seq-len", "256", "--batch", "16",
            "--steps", "1500", "--lr", "3e-3", "--warmup", "100", "--log-every", "100",
            "--eval-every", "500", "--compute-dtype", "fp32", "--save-dtype", "f32",
            "--max-minutes", "35"],
    data=dict(prompts=2048, prompt_len=64, gen_len=128, held_prompts=64, gen_batch=256),
    drafter=dict(layers=2, anchors=16, batch=8, steps=1000, lr=2e-3, warmup=50, log_every=50,
                 eval_every=250, dflash2=dict(conv_kernel_size=2, conv_group_size=16,
                                              selector_rank=32, selector_top_k=16),
                 markov_rank=32),
    eval=dict(prompts=32, prompt_len=64, gen=128, cuts=(0.5, 0.8)))
SMOKE = dict(
    target=["--max-files", "30", "--layers", "2", "--hidden", "64", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "16", "--ffn", "128", "--seq-len", "64",
            "--batch", "8", "--steps", "12", "--lr", "3e-3", "--warmup", "2", "--log-every", "4",
            "--compute-dtype", "fp32", "--save-dtype", "f32"],
    data=dict(prompts=32, prompt_len=16, gen_len=24, held_prompts=8, gen_batch=32),
    drafter=dict(layers=1, anchors=4, batch=4, steps=6, lr=3e-3, warmup=1, log_every=2,
                 eval_every=3, dflash2=dict(conv_kernel_size=2, conv_group_size=16,
                                            selector_rank=8, selector_top_k=4),
                 markov_rank=8),
    eval=dict(prompts=2, prompt_len=16, gen=12, cuts=(0.5,)))
SMOKE_FILES = 30
FAMILIES = ("dflash", "dflash2", "dspark")
# Ablations of the exact evaluator: the table through which the head adds to the logits,
# zeroed (DFlash2's walk then takes each row's argmax; DSpark's chain the backbone's argmax).
ABLATION = {"dflash2": ("dflash2 without the selector (row argmax)", "selector_successor"),
            "dspark": ("dspark without the Markov head (backbone argmax)", "markov_w2")}
BLOCK = {"dflash": 8, "dflash2": 8, "dspark": 7}   # 7 drafts per round each


def drafter_config(family: str, tcfg, preset: dict):
  """The family's drafter: `layers` full-attention layers at the target's width and heads,
  the default capture (three target layers ending at the last), the byte tokenizer's mask."""
  from dflash_jax.cli.train_drafter import default_target_layers
  from dflash_jax.config import FULL, DFlash2Fields, DFlashConfig, DSparkFields
  from dflash_jax.train.data import TOKENIZER

  fields = None
  if family == "dflash2":
    fields = DFlash2Fields(**preset["dflash2"])
  elif family == "dspark":
    fields = DSparkFields(sample_from_anchor=True, markov_rank=preset["markov_rank"],
                          markov_head_type="vanilla", confidence_head=True,
                          confidence_with_markov=True)
  n = preset["layers"]
  return DFlashConfig(
      n_layer=n, n_embd=tcfg.hidden_size, n_ff=tcfg.intermediate_size,
      n_head=tcfg.num_attention_heads, n_head_kv=tcfg.num_key_value_heads,
      head_dim=tcfg.head_dim, rope_theta=tcfg.rope_theta, eps=tcfg.rms_norm_eps,
      target_layers=default_target_layers(tcfg.num_hidden_layers),
      mask_token_id=TOKENIZER.mask_id, block_size=BLOCK[family], layer_types=(FULL,) * n,
      family=family, family_fields=fields)


def _corpus(smoke: bool):
  from dflash_jax.train import recipes
  return recipes.corpus_streams(None, SMOKE_FILES if smoke else None)


def _n_params(w: dict) -> int:
  return int(sum(np.asarray(v).size for v in w.values()))


def stage_target(work: str, preset: dict, seed: int) -> float:
  from dflash_jax.__main__ import main as cli
  argv = ["train-target", "--out", os.path.join(work, "target"), "--seed", str(seed)]
  argv += preset["target"]
  print(f"== python -m dflash_jax {shlex.join(argv)}", flush=True)
  t0 = time.perf_counter()
  if cli(argv):
    raise SystemExit("train_families: train-target failed")
  return time.perf_counter() - t0


def _distilled(work: str, target, tcfg, preset: dict, smoke: bool, seed: int):
  """(train tokens, mask, held tokens, mask): distilled once, then read from W/distill.npz."""
  from dflash_jax.train import data as D
  from dflash_jax.train import recipes

  path = os.path.join(work, "distill.npz")
  if os.path.exists(path):
    z = np.load(path)
    return z["tokens"], z["mask"], z["held_tokens"], z["held_mask"]
  d = preset["data"]
  train_s, held_s, _, _ = _corpus(smoke)
  prompts = recipes.seeded_rows(D.chunk(train_s, d["prompt_len"]), d["prompts"], seed)
  held_p = recipes.seeded_rows(D.chunk(held_s, d["prompt_len"]), d["held_prompts"], seed)
  t0 = time.perf_counter()
  tokens, mask = recipes.distill_data(target, tcfg, prompts, d["gen_len"], d["gen_batch"])
  held_t, held_m = recipes.distill_data(target, tcfg, held_p, d["gen_len"], d["gen_batch"])
  print(f"distill: {tokens.shape[0]} + {held_t.shape[0]} prompts of {d['prompt_len']} + "
        f"{d['gen_len']} greedy target tokens in {time.perf_counter() - t0:.1f} s", flush=True)
  np.savez(path, tokens=tokens, mask=mask, held_tokens=held_t, held_mask=held_m)
  return tokens, mask, held_t, held_m


def config_to_json(cfg) -> dict:
  return dataclasses.asdict(cfg)


def config_from_json(d: dict):
  from dflash_jax.config import DFlash2Fields, DFlashConfig, DSparkFields, RopeScaling
  d = dict(d)
  ff = d.pop("family_fields")
  d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
  kind = {"dflash2": DFlash2Fields, "dspark": DSparkFields}.get(d["family"])
  for k in ("target_layers", "layer_types"):
    if d.get(k) is not None:
      d[k] = tuple(d[k])
  return DFlashConfig(**d, family_fields=None if kind is None else kind(**ff))


def export(folder: str, cfg, host: dict) -> dict:
  """save_drafter of the weights as GGUF and HF under folder, each read back by load_drafter:
  {"gguf": "ok" or why not, "hf": ...}."""
  import dflash_jax as dfj
  from dflash_jax.io import DrafterFormatError

  out = {}
  for name, fmt in (("drafter.gguf", "gguf"), ("drafter-hf", "hf")):
    try:
      dfj.save_drafter(os.path.join(folder, name), cfg, host, tensor_type="F32", format=fmt)
      back, w = dfj.load_drafter(os.path.join(folder, name))
      same = back == cfg and all(np.array_equal(w[k], host[k]) for k in host)
      out[fmt] = "ok" if same else f"reads back as another drafter: {back}"
    except (ValueError, OSError, DrafterFormatError) as e:
      out[fmt] = f"{type(e).__name__}: {e}"
  return out


def stage_export(work: str, families) -> dict:
  """Export the trained weights (W/<family>/weights.npz) again, e.g. once the tree's io
  writes the family; records the outcome in W/<family>/train_log.json."""
  from dflash_jax.io import atomic

  done = {}
  for family in families:
    path = os.path.join(work, family, "train_log.json")
    with open(path) as f:
      log = json.load(f)
    z = np.load(os.path.join(work, family, "weights.npz"))
    log["exports"] = done[family] = export(os.path.join(work, family),
                                           config_from_json(log["config"]),
                                           {k: z[k] for k in z.files})
    atomic.write_json(path, log)
    print(f"{family}: {done[family]}", flush=True)
  return done


def stage_drafters(work: str, preset: dict, families, smoke: bool, seed: int) -> dict:
  import jax

  from dflash_jax.io import atomic
  from dflash_jax.models import load_target
  from dflash_jax.train import data as D
  from dflash_jax.train import recipes
  from dflash_jax.train import trainer as TR

  tcfg, target = load_target(os.path.join(work, "target"), dtype="fp32")
  tokens, mask, held_t, held_m = _distilled(work, target, tcfg, preset, smoke, seed)
  p = preset["drafter"]
  data = D.DrafterData(tokens, mask, batch_size=p["batch"], n_anchors=p["anchors"], seed=seed)
  held = D.DrafterData(held_t, held_m, batch_size=min(p["batch"] * 4, held_t.shape[0]),
                       n_anchors=p["anchors"], seed=seed + 1)
  oc = TR.OptimConfig(lr=p["lr"], total_steps=p["steps"], warmup_steps=p["warmup"])
  times = {}
  for family in families:
    cfg = drafter_config(family, tcfg, p)
    tc = TR.DrafterTrainConfig(optim=oc, compute_dtype="fp32")
    out = os.path.join(work, family)
    os.makedirs(out, exist_ok=True)
    print(f"\n== {family}: {cfg}", flush=True)
    t0 = time.perf_counter()
    w, log = recipes.train_drafter(cfg, target, tcfg, data, tc, seed=seed, eval_data=held,
                                   log_every=p["log_every"], eval_every=p["eval_every"])
    seconds = time.perf_counter() - t0
    host = recipes.host_weights(w)
    np.savez(os.path.join(out, "weights.npz"), **host)
    exports = export(out, cfg, host)
    times[family] = seconds
    atomic.write_json(os.path.join(out, "train_log.json"), dict(
        family=family, config=config_to_json(cfg), n_params=_n_params(host), seconds=seconds,
        steps=int(log[-1]["step"]), tokens_per_step=int(data.batch_size * tokens.shape[1]),
        device=jax.devices()[0].device_kind, exports=exports, log=log))
    print(f"== {family}: {_n_params(host) / 1e6:.2f} M params, {seconds:.0f} s; exports "
          f"{exports}", flush=True)
  return times


# --- the exact evaluator -----------------------------------------------------------------------

@dataclasses.dataclass
class RefRow:
  """One method on all prompts (the exact evaluator): hist[j] = rounds accepting j drafts;
  verified = drafts verified over all rounds (the confidence cut verifies fewer);
  same_as_target: greedy outputs equal to target-only's (None at T = 1)."""
  method: str
  temperature: float
  tau: float
  hist: list[int]
  rounds: int
  verified: int
  n_tokens: int
  same_as_target: int | None
  n_prompts: int


class _TargetCalls:
  """The target's jitted prefill / verify / commit for one sequence (the Target protocol)."""

  def __init__(self, target, tcfg, capture):
    import jax
    self.target, self.tcfg, self.capture = target, tcfg, tuple(capture)
    self.prefill = jax.jit(lambda t, c, x, n: tcfg.prefill(t, c, x, n, capture_layers=capture))
    self.verify = jax.jit(lambda t, c, x: tcfg.verify(t, c, x, capture_layers=capture))
    self.commit = jax.jit(tcfg.commit)


def _verify_sampled(rng, drafts, q, p):
  """SPEC.md section 9 on the host: accept draft j with probability min(1, p_j/q_j) at the
  draft; the first rejection samples norm(max(0, p_j - q_j)) (p_j when that is empty); all
  accepted: the bonus from p_n. -> (n_ok, committed token)."""
  from reference import families as fam
  for j, d in enumerate(drafts):
    if rng.random() * q[j, d] < p[j, d]:
      continue
    resid = np.maximum(p[j] - q[j], 0)
    resid = resid if resid.sum() > 0 else p[j]
    return j, fam.sample_index(resid, rng.random())
  return len(drafts), fam.sample_index(p[len(drafts)], rng.random())


def reference_generate(calls: _TargetCalls, cfg, w: dict, prompt, max_new: int, *,
                       temperature: float = 0.0, cut: float = 0.0,
                       rng: np.random.Generator | None = None):
  """Speculative decoding of one prompt with the family's numpy reference as the drafter and
  the target's compiled cached verify: -> (tokens, hist, rounds, drafts verified). cut > 0
  (DSpark): verify only the drafts before the first confidence below it."""
  import jax.numpy as jnp

  from dflash_jax.models.base import prefill_bucket
  from reference import DFlashRef
  from reference import families as fam
  from reference.dflash_ref import first_mismatch

  n_drafts = cfg.n_drafts()
  width = n_drafts + 1
  prompt = np.asarray(prompt, np.int32)
  n = len(prompt)
  capacity = -(-(n + max_new + width) // 16) * 16
  cache = calls.tcfg.init_cache(1, capacity, "fp32")
  bucket = min(prefill_bucket(n - 1), capacity)
  buf = np.zeros((1, bucket), np.int32)
  buf[0, :n - 1] = prompt[:-1]
  cache, feats = calls.prefill(calls.target, cache, jnp.asarray(buf), jnp.int32(n - 1))
  ref = DFlashRef(cfg, w, capacity=capacity)
  if n > 1:
    ref.inject(ref.encode(np.asarray(feats[0, :n - 1])), np.arange(n - 1))
  id_last, n_past, out = int(prompt[-1]), n - 1, []
  hist = np.zeros(width, np.int64)
  rounds = verified = 0
  while len(out) < max_new:
    d = ref.draft(id_last, n_past, temperature=temperature, rng=rng)
    l = n_drafts if not cut else fam.verify_length(d.conf, cut)
    vtok = np.zeros((1, width), np.int32)   # one compile: rows past l are never read
    vtok[0, 0] = id_last
    vtok[0, 1:l + 1] = d.drafts[:l]
    cache, logits, vfeats = calls.verify(calls.target, cache, jnp.asarray(vtok))
    logits = np.asarray(logits[0], np.float32)
    if temperature == 0:
      tt = np.argmax(logits, -1)
      n_ok = first_mismatch(d.drafts[:l], tt)
      t = int(tt[n_ok])
    else:
      q = d.q if cfg.family != "dflash2" else fam.sparse_to_dense(d.candidates, d.q,
                                                                    logits.shape[-1])
      n_ok, t = _verify_sampled(rng, d.drafts[:l], q[:l], fam.softmax(logits, temperature))
    cache = calls.commit(cache, jnp.asarray([n_ok + 1], jnp.int32))
    ref.inject(ref.encode(np.asarray(vfeats[0, :n_ok + 1])), n_past + np.arange(n_ok + 1))
    out += [int(x) for x in d.drafts[:n_ok]] + [t]
    n_past += n_ok + 1
    id_last = t
    hist[n_ok] += 1
    rounds += 1
    verified += l
  return out[:max_new], hist, rounds, verified


def _tau(hist) -> float:
  """Mean tokens committed per round: accepted drafts plus the target's token."""
  hist = np.asarray(hist)
  return float((hist * np.arange(1, len(hist) + 1)).sum() / max(hist.sum(), 1))


def _ref_row(method, temperature, results, ref_tokens) -> RefRow:
  hist = np.sum([r[1] for r in results], axis=0)
  rounds = int(sum(r[2] for r in results))
  toks = [r[0] for r in results]
  same = None if ref_tokens is None else sum(a == b for a, b in zip(toks, ref_tokens))
  return RefRow(method=method, temperature=temperature, tau=_tau(hist),
                hist=hist.astype(int).tolist(), rounds=rounds,
                verified=int(sum(r[3] for r in results)), n_tokens=sum(len(t) for t in toks),
                same_as_target=same, n_prompts=len(results))


def ref_table(rows) -> str:
  """tau; drafts verified per round; tau / (1 + verified): committed tokens per verified row
  (what the confidence cut trades for); outputs equal to target-only's; the histogram."""
  lines = ["| drafter | T | tau | drafts verified per round | tokens per verified row | "
           "= target | rounds accepting 0, 1, 2, ... drafts |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    same = "-" if r.same_as_target is None else f"{r.same_as_target}/{r.n_prompts}"
    per = r.verified / max(r.rounds, 1)
    lines.append(f"| {r.method} | {r.temperature:g} | {r.tau:.2f} | {per:.2f} | "
                 f"{r.tau / (1 + per):.2f} | {same} | {' '.join(str(h) for h in r.hist)} |")
  return "\n".join(lines)


def plot_curves(logs: dict, path: str) -> None:
  """Left: each family's block CE (DFlash2: without the selector term; DSpark: without the
  confidence BCE), train and held-out; right: the held-out teacher-forced accepted drafts
  per block (DFlash2: the selector walk's)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
  ce_key = {"dflash": "loss", "dflash2": "block_loss", "dspark": "ce"}
  acc_key = {"dflash": "accept", "dflash2": "sel_accept", "dspark": "accept"}
  for fam, log in logs.items():
    rows = log["log"]
    line, = axes[0].plot([r["step"] for r in rows], [r[ce_key[fam]] for r in rows],
                         label=f"{fam} train")
    ev = [r for r in rows if f"eval_{ce_key[fam]}" in r]
    axes[0].plot([r["step"] for r in ev], [r[f"eval_{ce_key[fam]}"] for r in ev], "o--",
                 color=line.get_color(), label=f"{fam} held-out")
    axes[1].plot([r["step"] for r in ev], [r[f"eval_{acc_key[fam]}"] for r in ev], "o-",
                 color=line.get_color(), label=fam)
    if fam == "dflash2":
      axes[2].plot([r["step"] for r in rows], [r["sel_loss"] for r in rows],
                   color=line.get_color(), label="dflash2 selector CE")
    if fam == "dspark":
      axes[2].plot([r["step"] for r in rows], [r["conf_bce"] for r in rows],
                   color=line.get_color(), label="dspark confidence BCE")
  axes[0].set_title("decayed block CE (nats)")
  axes[1].set_title("held-out accepted drafts per block (teacher forcing)")
  axes[2].set_title("the heads' own losses")
  for ax in axes:
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def stage_eval(work: str, out: str, preset: dict, families, smoke: bool, seed: int) -> str:
  import jax

  import dflash_jax as dfj
  from dflash_jax import decode
  from dflash_jax.io import atomic
  from dflash_jax.models import load_target
  from dflash_jax.sampling import Sampling
  from dflash_jax.train import data as D
  from dflash_jax.train import evaluate as E
  from dflash_jax.train import recipes

  e = preset["eval"]
  tcfg, target = load_target(os.path.join(work, "target"), dtype="fp32")
  _, held_s, _, held_f = _corpus(smoke)
  prompts = recipes.seeded_rows(D.chunk(held_s, e["prompt_len"]), e["prompts"], seed + 7)
  print(f"eval: {len(prompts)} held-out prompts of {e['prompt_len']} tokens from "
        f"{len(held_f)} files, {e['gen']} new tokens each", flush=True)
  drafters, logs = {}, {}
  for fam in families:
    with open(os.path.join(work, fam, "train_log.json")) as f:
      logs[fam] = json.load(f)
    cfg = config_from_json(logs[fam]["config"])
    z = np.load(os.path.join(work, fam, "weights.npz"))
    w = {k: z[k] for k in z.files}
    w["tok_embd"], w["lm_head"] = np.asarray(target.embed), np.asarray(target.head)
    drafters[fam] = (cfg, w)
  # Compiled loop (decode, the Pallas-free xla path on CPU): target-only, every family and
  # prompt lookup, greedy, with tokens/s; each verifies 8 rows per round.
  dps = {}
  for fam, (cfg, w) in drafters.items():
    own = {k: v for k, v in w.items() if k not in ("tok_embd", "lm_head")}
    dps[fam] = dfj.prepare_weights(cfg, {**own, "tok_embd": target.embed,
                                         "lm_head": target.head}, "fp32")
  compiled = E.evaluate(target, tcfg, list(dps.items()), prompts, e["gen"], widths=(8,),
                        impl="xla")
  ref_tokens = [decode.generate_target_only(target, tcfg, [list(map(int, p))], e["gen"]).tokens[0]
                for p in prompts]
  # Compiled loop at T = 1 (each family's sampled proposals, prompt lookup), and DSpark's
  # confidence cut at T = 0 and 1: tau and histograms (greedy rows: outputs vs target-only).
  t1 = []
  runs = [(fam, dp, decode.Drafter(), 1.0) for fam, dp in dps.items()]
  runs += [("prompt lookup (n <= 3)", None, decode.Lookup(3), 1.0)]
  if "dspark" in dps:
    runs += [(f"dspark, confidence cut {c:g}", dps["dspark"], decode.Drafter(cut=c), t)
             for c in e["cuts"] for t in (0.0, 1.0)]
  for name, dpp, prop, temp in runs:
    models = decode.Models(target=target, drafter=dpp, d2t=None, target_cfg=tcfg)
    samp = (Sampling() if temp == 0 else
            Sampling(temperature=temp, proposals="sampled" if dpp is not None else "greedy"))
    dcfg = decode.DecodeConfig(width=8, sampling=samp, impl="xla", proposer=prop)
    gens = [decode.generate(models, dcfg, [list(map(int, p))], e["gen"], seed=seed + i)
            for i, p in enumerate(prompts)]
    hist = np.sum([g.hist.sum(0) for g in gens], axis=0)
    same = (sum(g.tokens[0] == r for g, r in zip(gens, ref_tokens)) if temp == 0 else None)
    t1.append(dict(method=name, temperature=temp, tau=_tau(hist), same_as_target=same,
                   hist=hist.astype(int).tolist()))
    print(f"compiled {name} T={temp:g}: tau {t1[-1]['tau']:.2f}", flush=True)
  # The exact evaluator: each family's reference drafts, the target's compiled verify.
  rows = []
  for fam, (cfg, w) in drafters.items():
    calls = _TargetCalls(target, tcfg, cfg.target_layers)
    settings = [(fam, w, 0.0, 0.0), (fam, w, 1.0, 0.0)]
    if fam in ABLATION:   # the head's table zeroed: the family without its head
      name, table = ABLATION[fam]
      settings.append((name, dict(w, **{table: np.zeros_like(w[table])}), 0.0, 0.0))
    if fam == "dspark":
      settings += [(f"{fam}, confidence cut {c:g}", w, t, c) for c in e["cuts"]
                   for t in (0.0, 1.0)]
    for name, ww, temp, cut in settings:
      t0 = time.perf_counter()
      res = [reference_generate(calls, cfg, ww, p, e["gen"], temperature=temp, cut=cut,
                                rng=np.random.default_rng((seed, i)) if temp else None)
             for i, p in enumerate(prompts)]
      rows.append(_ref_row(name, temp, res, ref_tokens if temp == 0 else None))
      print(f"{name} T={temp:g}: tau {rows[-1].tau:.2f} "
            f"({time.perf_counter() - t0:.0f} s, numpy drafter)", flush=True)
  os.makedirs(out, exist_ok=True)
  plot_curves(logs, os.path.join(out, "loss_curves.png"))
  sizes = "; ".join(
      f"{fam}: {logs[fam]['n_params'] / 1e6:.3f} M params, {logs[fam]['steps']} steps in "
      f"{logs[fam]['seconds']:.0f} s, exports {logs[fam]['exports']}" for fam in families)
  def t1_line(r):
    same = "-" if r["same_as_target"] is None else f"{r['same_as_target']}/{len(prompts)}"
    return (f"| {r['method']} | {r['temperature']:g} | {r['tau']:.2f} | {same} | "
            f"{' '.join(map(str, r['hist']))} |")
  t1_lines = ["| method (compiled loop) | T | tau | = target | rounds accepting 0, 1, 2, ... "
              "drafts |", "|---|---|---|---|---|"] + [t1_line(r) for r in t1]
  text = "\n".join([
      f"- device: {jax.devices()[0].device_kind}; target {tcfg.num_hidden_layers} x "
      f"{tcfg.hidden_size}; {len(prompts)} held-out prompts x {e['gen']} tokens",
      f"- drafters: {sizes}", "",
      "Exact evaluator (numpy reference drafts, compiled target verify; tau and histograms "
      "only):", "", ref_table(rows), "",
      "Compiled loop (greedy; tokens/s with compile excluded):", "",
      E.markdown_table(compiled), "", *t1_lines, "", "![loss curves](loss_curves.png)"]) + "\n"
  atomic.write_text(os.path.join(out, "families.md"), text)
  atomic.write_json(os.path.join(out, "families.json"), dict(
      reference=[dataclasses.asdict(r) for r in rows],
      compiled=[dataclasses.asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in compiled],
      compiled_t1=t1, sizes={f: dict(n_params=logs[f]["n_params"], steps=logs[f]["steps"],
                                     seconds=logs[f]["seconds"], exports=logs[f]["exports"])
                             for f in families}))
  return text


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.train_families",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("stage", choices=("target", "drafters", "export", "eval", "all"))
  p.add_argument("--work", required=True, help="folder for the target, data and drafters")
  p.add_argument("--out", default=None, help="folder for families.md/json, loss_curves.png")
  p.add_argument("--families", default=",".join(FAMILIES),
                 help=f"comma-separated subset of {FAMILIES}")
  p.add_argument("--smoke", action="store_true", help="tiny dims: keeps the script alive")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  families = tuple(f for f in args.families.split(",") if f)
  bad = sorted(set(families) - set(FAMILIES))
  if bad or not families:
    p.error(f"--families: unknown {bad} (choose from {FAMILIES})")
  stages = ("target", "drafters", "eval") if args.stage == "all" else (args.stage,)
  if "eval" in stages and not args.out:
    p.error("eval needs --out")
  preset = SMOKE if args.smoke else CPU
  os.makedirs(args.work, exist_ok=True)
  if "target" in stages:
    print(f"target: {stage_target(args.work, preset, args.seed):.0f} s")
  if "drafters" in stages:
    stage_drafters(args.work, preset, families, args.smoke, args.seed)
  if "export" in stages:
    stage_export(args.work, families)
  if "eval" in stages:
    print("\n" + stage_eval(args.work, args.out, preset, families, args.smoke, args.seed))
  return 0


if __name__ == "__main__":
  sys.exit(main())
