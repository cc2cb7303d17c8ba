"""Speculative decoding on the GPU: a Qwen3-8B-shaped target with a Qwen3-8B-DFlash-shaped drafter.

  python -m benchmarks.decode --gpu [--only SECTIONS] [--out results/NAME] [--target-impl I]
                              [--family dflash|dflash2|dspark] [--cuts 0.5,0.8] [--ks 3,7]
  python -m benchmarks.decode --smoke        # CPU, tiny dims, seconds (CI): not results

--family picks the drafter: DFlash (Qwen3-8B-DFlash-b16's shape), DFlash2 (the same dims with
Muse-Glimmer-30B-DFlash2's family fields: K 2, G 16, R 256, k 16, the multiplier and softcap)
or DSpark (DSPARK_QWEN3_8B_CONFIG: block 7, shifted rows, a vanilla Markov head, a confidence
head). A round verifies `round_width` rows whatever the family: the drafts of one block + 1,
i.e. block_size for DFlash / DFlash2, block_size + 1 for DSpark (its block of w shifted rows
gives w drafts); the target passes of sections 3-5 ("verify16") are of that width too. The
reduced draft vocab (sections 1 and 6) is DFlash's only (the others index the full
vocabulary; their reduced columns read '-'). The default ks are those the drafter's block can
draft (k <= its drafts).
--cuts adds oracle rows with the drafter's confidence / p-min cut (`Oracle(cut=...)`, i.e.
decode.Drafter(cut)): the oracle's drafts are the target's own, so every cut draft is a draft
that would have been accepted; tau and tokens/s with and without the cut show what computing
it costs (random weights: the values being cut on mean nothing here).

Weights are random bf16, generated on the device (timing does not depend on the values).
Device time is CUPTI's (the median over iterations of the kernel sum; XLA's copies of a
non-donated argument excluded; compilation never counted), wall time is measured after a
warm-up run that compiled the same shapes; the copy bandwidth is measured in the same run.
Sections (--only, a comma list; the bytes always run first; results are saved after each, so
a run cut short keeps what it measured):

1. bytes: target, drafter (layers + fc + inject; LM head full and reduced), K/V cache; the
   copy bandwidth and the byte floors it implies.
2. target_only (run for round, oracle): target-only greedy decoding (the same target code at
   width 1): tokens/s over a long run after a warm-up. Its output is the oracle of `oracle`.
3. target: decode1 (a 1-row pass) and verify16 (16 rows, the drafter's features captured) at
   the round's context (prompt + 16 committed rows in a `capacity`-slot cache), under three
   variants of the target in one process: "xla" (impl "xla": XLA's GEMMs and its masked
   attention over every slot, the target before issue 41), "pallas" (the default policy:
   batch invariant) and "pallas_fast" (`FAST_POLICY`: the same kernels with the query tile
   and GEMM tiles sized for each call, not invariant). Per variant: device ms, the byte floor
   (every weight but the embedding + the live K/V rows, at the copy bandwidth) and the
   fraction of it reached, verify16 / decode1, kernels per pass, wall ms per pass (back-to-back
   calls: idle time between kernels and between passes counts there, which the kernels'
   exclusive times leave out); the cost of invariance
   (pallas over pallas_fast) and the speedup over xla. Then the read ceiling: the GEMMs'
   matrices only read, one kernel each, as a fraction of the copy bandwidth.
4. launches: kernels per decoder layer (a 3-layer minus a 2-layer target at the 8B widths,
   CUPTI) of xla and pallas at 1 and 16 rows.
5. long: decode1 and verify16 of the pallas target over a `long_capacity`-slot cache (32768)
   at live contexts `--live` (512, 4096, 16384, 32768 slots read): device ms, the floor and
   its fraction, the attention kernels' (partial + combine) share of the pass and their
   bandwidth fraction (live K/V bytes over their time, against the copy bandwidth); xla's
   decode1 at the shortest and the longest context (it reads every slot). `--chunks` adds
   the attention chunk A/B (KernelPolicy.target_attention_chunk) at the longest context.
6. round: one round at `round_width` (16; 8 in --smoke), piece by piece, device time:
   draft (`decode.Drafter().propose`: encode + inject of the committed rows + block step +
   drafts), of which inject and block step measured alone; verify of 16 rows; accept +
   commit; a 1-token target decode step (verify and decode with --target-impl). The draft
   with the full 151936-token head and with a 32768-token reduced draft vocab. The target's
   passes run inside a fori_loop of several iterations per call (their cache is the loop
   carry, so it is updated in place and copied once per call, not per iteration).
7. oracle: drafts are the target's own greedy continuation (section 2), k = 3, 7, 15 drafts
   per round (width k + 1): tokens/s, tau, tokens/s over (k + 1) x target-only tokens/s
   (`oracle_run`; with the batch-invariant target every draft is accepted on the first run).
8. batched: S = 1, 4, 8, 16, 32 sequences (--slots; one slot each, `batched_new` tokens per
   slot, cache of `batched_capacity` slots): target-only tokens/s and speculative tokens/s
   with forced acceptance at k = 3, 7, 15 (the oracle proposer with the drafter running its
   round), the same target code in the same run; the speedup at each S.

--target-impl (default: pallas on a GPU, xla on the CPU) is the target of sections 2 and
6-8; the drafter runs its Pallas kernels on a GPU, its jnp twins on the CPU.
"""
from __future__ import annotations

import dataclasses
import json
import re
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
from dflash_jax.config import DFLASH2_CONFIG, DSPARK_QWEN3_8B_CONFIG, FULL, DSparkFields
from dflash_jax.dispatch import KernelPolicy
from dflash_jax.drafter import step as S
from dflash_jax.models import qwen3 as Q

QWEN3_8B_TARGET = Q.TargetConfig(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
    rope_theta=1e6, tie_word_embeddings=False, qk_norm=True, max_position_embeddings=40960)

# The fastest non-invariant target: the same kernels, the attention's query tile and the GEMMs'
# M tiles and routing sized for each call (skinny GEMM up to skinny_max_m rows, then XLA's).
FAST_POLICY = KernelPolicy(invariant_max_rows=0, target_invariant_attention=False)
VARIANTS = {"xla": ("xla", KernelPolicy()), "pallas": ("pallas", KernelPolicy()),
            "pallas_fast": ("pallas", FAST_POLICY)}
ATTENTION_KERNELS = ("cache_attn_partial", "cache_attn_combine")


@dataclasses.dataclass(frozen=True)
class Setup:
  target: Q.TargetConfig
  drafter: dfj.DFlashConfig
  window: int
  capacity: int
  prompt_len: int
  max_new: int          # tokens per timed speculative run (section 7)
  ks: tuple[int, ...]   # drafts per round (sections 7, 8)
  draft_vocab: int      # the reduced draft vocab of section 6
  iters: int
  inner: int            # target passes per measured call (sections 3, 5, 6)
  sync_every: int       # rounds per device call in timed runs
  live: tuple[int, ...]      # live contexts of section 5
  long_capacity: int         # cache slots of section 5
  slots: tuple[int, ...]     # sequences of section 8
  batched_new: int           # tokens per sequence in section 8
  batched_capacity: int


FAMILIES = ("dflash", "dflash2", "dspark")


def family_drafter(d: dfj.DFlashConfig, family: str, smoke: bool) -> dfj.DFlashConfig:
  """The benchmark's drafter d as a drafter of `family` (the module docstring)."""
  if family == "dflash":
    return d
  if family == "dflash2":
    f = dataclasses.replace(DFLASH2_CONFIG.dflash2, conv_group_size=8, selector_rank=8,
                            selector_top_k=4) if smoke else DFLASH2_CONFIG.dflash2
    return dataclasses.replace(d, family="dflash2", family_fields=f)
  if family != "dspark":
    raise ValueError(f"family {family!r} not one of {FAMILIES}")
  if smoke:
    return dataclasses.replace(d, block_size=7, window=None, layer_types=(FULL,) * d.n_layer,
                               family="dspark", family_fields=DSparkFields(
                                   markov_rank=8, markov_head_type="vanilla",
                                   confidence_head=True, confidence_with_markov=True))
  return DSPARK_QWEN3_8B_CONFIG


def round_width(dc: dfj.DFlashConfig) -> int:
  """The widest round the drafter's block allows: its drafts + the anchor (block_size for
  DFlash / DFlash2, block_size + 1 for DSpark's shifted rows)."""
  return dc.n_drafts() + 1


def setup(smoke: bool, family: str = "dflash") -> Setup:
  if smoke:
    t = Q.TargetConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=1e4)
    d = dataclasses.replace(dfj.TINY_CONFIG, n_layer=1, n_embd=32, n_ff=64, n_head=2,
                            n_head_kv=1, target_layers=(0, 1), mask_token_id=255, block_size=8,
                            window=32)
    return Setup(t, family_drafter(d, family, True), window=32, capacity=64, prompt_len=12,
                 max_new=24, ks=(3,), draft_vocab=64, iters=1, inner=2, sync_every=4, live=(24, 64),
                 long_capacity=64, slots=(1, 2), batched_new=12, batched_capacity=48)
  d = family_drafter(dfj.QWEN3_8B_CONFIG, family, False)
  ks = tuple(k for k in (3, 7, 15) if k <= d.n_drafts())
  return Setup(QWEN3_8B_TARGET, d, window=2048, capacity=2048,
               prompt_len=128, max_new=512, ks=ks, draft_vocab=32768, iters=20,
               inner=8, sync_every=64, live=(512, 4096, 16384, 32768), long_capacity=32768,
               slots=(1, 4, 8, 16, 32), batched_new=256, batched_capacity=512)


def random_models(su: Setup, on_device: bool) -> D.Models:
  """Random bf16 target + drafter of su's shapes; the drafter borrows the target's embedding
  and LM head (the same device arrays). on_device: weights drawn on the device (the real
  sizes); else host weights, quicker at tiny dims than compiling a device RNG per shape."""
  tc, dc = su.target, su.drafter
  tp = Q.init_params(tc, jax.random.key(0), jnp.bfloat16)
  # The family's vocab-sized tables (DFlash2's selector, DSpark's Markov head) need the
  # target's vocabulary; DFlash's stand-in head is replaced by the target's anyway.
  n_vocab = 16 if dc.family == "dflash" else tc.vocab_size
  dp = (C.random_params(dc, n_vocab, "bf16") if on_device else dfj.prepare_weights(
      dc, {**dfj.synthetic_drafter(dc, with_target=False, n_vocab=tc.vocab_size),
           "tok_embd": np.zeros((tc.vocab_size, dc.n_embd)),
           "lm_head": np.zeros((tc.vocab_size, dc.n_embd))}, "bf16"))
  dp = dp.replace(tok_embd=tp.embed, lm_head=tp.head)
  return D.Models(target=tp, drafter=dp, d2t=None, target_cfg=tc)


def device_ms(f, *args, iters: int, per_call: int = 1) -> float:
  """Median CUPTI kernel time of one call of f (copies excluded), divided by per_call."""
  return C.device_ms(C.without_copies(C.cupti_kernels(f, *args, iterations=iters))) / per_call


def target_loop(tc: Q.TargetConfig, inner: int, capture, impl: str):
  """run(params, cache, tokens [B, w]): `inner` target passes of w rows at one position (the
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


def measure_pass(su: Setup, tp, cache, tokens, capture, impl: str) -> dict:
  """One target pass (inside `target_loop`): device ms, kernels per pass, the attention
  kernels' ms (0 where the pass has none of them), ms and calls per kernel name, and the
  first pass's kernels in launch order (median ms each: where a pass's time goes). wall_ms:
  the wall time per pass of back-to-back calls, which also counts what the kernels'
  exclusive times leave out (idle gaps between kernels and between calls)."""
  f = target_loop(su.target, su.inner, capture, impl)
  p = C.pass_profile(f, tp, cache, tokens, iterations=su.iters, per_call=su.inner)
  attn = sum(ms for name, (_, ms) in p["by_kernel"].items()
             if any(k in name for k in ATTENTION_KERNELS))
  medians = p["medians"]
  wall = C.wall_ms(f, tp, cache, tokens, iterations=su.iters, trials=3) / su.inner
  return dict(ms=p["ms"], wall_ms=wall, attention_ms=attn, launches=p["launches"],
              by_kernel=p["by_kernel"], kernels=medians[:len(medians) // su.inner])


def weight_bytes(tp) -> int:
  """What one pass streams of the weights: all of them but the embedding (a gather of rows)."""
  return C.tree_bytes(tp) - C.tree_bytes(tp.embed)


def kv_bytes(tc: Q.TargetConfig, live: int, itemsize: int = 2) -> int:
  """K and V of `live` slots in every layer."""
  return 2 * tc.num_hidden_layers * tc.num_key_value_heads * tc.head_dim * itemsize * live


def bytes_section(su: Setup, models: D.Models, reduced: D.Models | None, cache, ring,
                  bw: float):
  """Section 1. reduced None (a family without the reduced draft vocab): its entries None."""
  dp = models.drafter
  target = C.tree_bytes(models.target)
  # The family's tensors count in full (DFlash2's selector tables are read by gathered rows,
  # so this overstates them; DSpark's W2 is read once per draft row, so it understates that).
  drafter_body = C.tree_bytes((dp.layers, dp.fc, [ip.w for ip in dp.inject], dp.enc_norm,
                               dp.out_norm, dp.family))
  head = C.tree_bytes(dp.lm_head)
  cache = C.tree_bytes((cache.k, cache.v))
  ring = C.tree_bytes(ring)
  # One decode step reads every target weight but the embedding (a gather of one row) and
  # the live K/V; one draft step reads the drafter's layers, its head and the ring.
  embed = C.tree_bytes(models.target.embed)
  live = kv_bytes(su.target, su.prompt_len + round_width(su.drafter))
  r = dict(target_GB=target / 1e9, target_embedding_GB=embed / 1e9,
           drafter_body_GB=drafter_body / 1e9, drafter_head_full_GB=head / 1e9,
           kv_cache_GB=cache / 1e9, kv_live_GB=live / 1e9, ring_GB=ring / 1e9,
           decode_step_floor_ms=(target - embed + live) / bw * 1e3,
           draft_floor_full_ms=(drafter_body + head + ring) / bw * 1e3)
  r["draft_byte_fraction_full"] = r["draft_floor_full_ms"] / (
      r["draft_floor_full_ms"] + r["decode_step_floor_ms"])
  r.update(drafter_head_reduced_GB=None, draft_floor_reduced_ms=None,
           draft_byte_fraction_reduced=None)
  if reduced is not None:
    head_r = C.tree_bytes(reduced.drafter.lm_head)
    r["drafter_head_reduced_GB"] = head_r / 1e9
    r["draft_floor_reduced_ms"] = (drafter_body + head_r + ring) / bw * 1e3
    r["draft_byte_fraction_reduced"] = r["draft_floor_reduced_ms"] / (
        r["draft_floor_reduced_ms"] + r["decode_step_floor_ms"])
  return r


def round_state(su: Setup, models: D.Models, w16: D.DecodeConfig, prompt, kw) -> D.DecodeState:
  """The round's state: the prompt prefilled, then as after a round that accepted 15 drafts
  (16 committed rows pending for inject; the cache and ring lengths to match)."""
  st = D.start(models, w16, [prompt], su.max_new, **kw)
  w = w16.width
  keys = jax.random.split(jax.random.key(2), 2)
  return st.replace(pending=jax.random.normal(keys[0], st.pending.shape, jnp.float32),
                    n_new=st.n_new + w, n_past=st.n_past + w,
                    cache=su.target.commit(st.cache, jnp.full(st.n_past.shape, w, jnp.int32)))


def _pass_tokens(su: Setup, w: int) -> jax.Array:
  return jax.random.randint(jax.random.key(5), (1, w), 0, su.target.vocab_size, jnp.int32)


def _guarded(what: str, f, *args, **kw):
  """f(*args, **kw), or {"error": ...} when it raises (a configuration that does not compile
  or run is a result: the rest of the benchmark still runs)."""
  try:
    return f(*args, **kw)
  except Exception as e:  # noqa: BLE001 -- recorded and printed, not hidden
    print(f"  {what}: {type(e).__name__}: {str(e)[:400]}", flush=True)
    return {"error": f"{type(e).__name__}: {str(e)[:400]}"}


def target_section(su: Setup, res: dict, tp, cache, bw: float, variants) -> None:
  """Section 3 (module docstring) for the named variants (results merged into res)."""
  tc, dc = su.target, su.drafter
  live0 = int(cache.length[0])
  out = res.setdefault("target", {})
  gemm_bytes = {k: C.tree_bytes(v) for k, v in gemm_matrices(tp).items()}
  for name in variants:
    impl, policy = VARIANTS[name]
    p = tp.replace(policy=policy)
    r = {}
    for label, w, capture in (("decode1", 1, ()),
                              ("verify16", round_width(dc), dc.target_layers)):
      t0 = time.perf_counter()
      m = _guarded(f"{name} {label}", measure_pass, su, p, cache, _pass_tokens(su, w), capture,
                   impl)
      if "error" not in m:
        floor = (weight_bytes(tp) + kv_bytes(tc, live0 + w)) / bw * 1e3
        m.update(floor_ms=floor, floor_fraction=floor / m["ms"])
        # XLA names a kernel's further instances name__1, name__2, ...: summed under name.
        kernel_ms = {}
        for k, (_, ms_k) in m["by_kernel"].items():
          base = re.sub(r"__\d+$", "", k)
          kernel_ms[base] = kernel_ms.get(base, 0.0) + ms_k
        m["gemm_bw_fraction"] = {k: gemm_bytes[k] / (kernel_ms[k] * 1e-3) / bw
                                 for k in gemm_bytes if kernel_ms.get(k, 0.0) > 0}
      r[label] = dict(**m, compile_and_measure_s=time.perf_counter() - t0)
      print(f"  {name} {label}: " + ", ".join(f"{k} {v:.4g}" for k, v in r[label].items()
                                             if isinstance(v, float)), flush=True)
    if "ms" in r["decode1"] and "ms" in r["verify16"]:
      r["verify16_over_decode1"] = r["verify16"]["ms"] / r["decode1"]["ms"]
    out[name] = r
  ms = lambda name, label: out.get(name, {}).get(label, {}).get("ms")
  for label in ("decode1", "verify16"):
    if ms("pallas", label) and ms("pallas_fast", label):
      out[f"invariance_cost_{label}"] = ms("pallas", label) / ms("pallas_fast", label) - 1
    if ms("pallas", label) and ms("xla", label):
      out[f"speedup_over_xla_{label}"] = ms("xla", label) / ms("pallas", label)
  out["live_slots"] = live0
  out["read_ceiling"] = _guarded("read ceiling", read_ceiling, tp, bw, su.iters)


def gemm_matrices(tp) -> dict[str, list]:
  """The matrices each Pallas GEMM kernel streams in one pass, by kernel name."""
  return {"skinny_matmul_gate_up": [l.wgu for l in tp.layers],
          "skinny_matmul": [w for l in tp.layers for w in (l.wqkv, l.wo, l.wd)] + [tp.head]}


def read_ceiling(tp, bw: float, iters: int) -> dict:
  """The premise of the floor fraction: the same matrices the GEMM kernels stream, only read
  (one fp32 row sum each, no arithmetic worth the name), CUPTI. Their bytes over this time, as
  a fraction of the copy bandwidth, is what a pass of separate weight-streaming kernels
  reaches before any GEMM work."""
  mats = [m for ms in gemm_matrices(tp).values() for m in ms]
  f = jax.jit(lambda ms: [jnp.sum(m, axis=-1, dtype=jnp.float32) for m in ms])
  per = C.without_copies(C.cupti_kernels(f, mats, iterations=iters))
  ms = C.device_ms(per)
  nbytes = C.tree_bytes(mats)
  return dict(ms=ms, launches=C.launches(per), bytes=nbytes, bw_fraction=nbytes / (ms * 1e-3) / bw)


def launches_section(su: Setup, res: dict) -> None:
  """Section 4: kernels per decoder layer, a 3-layer minus a 2-layer target (CUPTI)."""
  res["launches"] = {
      f"{impl}_w{w}": C.target_layer_launches(su.target, impl, w, su.capacity, su.prompt_len)[0]
      for impl in ("xla", "pallas") for w in (1, round_width(su.drafter))}


def long_section(su: Setup, res: dict, tp, bw: float, chunks: tuple[int, ...]) -> None:
  """Section 5 (module docstring)."""
  tc, dc = su.target, su.drafter
  cap = su.long_capacity
  keys = jax.random.split(jax.random.key(9), 2 * tc.num_hidden_layers)
  shape = (1, tc.num_key_value_heads, cap, tc.head_dim)
  fill = jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16))
  cache = Q.TargetCache(k=tuple(fill(k) for k in keys[::2]), v=tuple(fill(k) for k in keys[1::2]),
                        length=jnp.zeros((1,), jnp.int32))
  rows = []

  def one(p, impl, live, label, w, capture, **extra):
    m = _guarded(f"long {label} {impl} {live}", measure_pass, su, p,
                 cache.replace(length=jnp.array([live - w], jnp.int32)), _pass_tokens(su, w),
                 capture, impl)
    if "error" in m:
      rows.append(dict(pass_=label, impl=impl, live=live, capacity=cap, **extra, **m))
      return
    kv = kv_bytes(tc, live)
    floor = (weight_bytes(tp) + kv) / bw * 1e3
    r = dict(pass_=label, impl=impl, live=live, capacity=cap, **extra, **m, floor_ms=floor,
             floor_fraction=floor / m["ms"], attention_share=m["attention_ms"] / m["ms"],
             attention_bw_fraction=(kv / (m["attention_ms"] * 1e-3) / bw
                                    if m["attention_ms"] else None))
    rows.append(r)
    print(f"  {label} {impl} live {live}: {m['ms']:.3f} ms", flush=True)

  passes = (("decode1", 1, ()), ("verify16", round_width(dc), dc.target_layers))
  for label, w, capture in passes:
    for live in su.live:
      one(tp, "pallas", live, label, w, capture, chunk=KernelPolicy().target_attention_chunk)
  for live in (min(su.live), max(su.live)):
    one(tp, "xla", live, "decode1", 1, ())
  for chunk in chunks:
    p = tp.replace(policy=KernelPolicy(target_attention_chunk=chunk))
    for label, w, capture in passes:
      one(p, "pallas", max(su.live), label, w, capture, chunk=chunk)
  res["long"] = rows


def main(argv=None) -> int:
  p = C.arg_parser(__doc__, "decode", "Qwen3-8B shapes on the GPU")
  p.add_argument("--only", default="round,oracle",
                 help="sections after bytes (comma list): target, launches, long, round, "
                      "oracle, batched")
  p.add_argument("--target-impl", choices=("pallas", "xla"), default=None,
                 help="the target of target-only, round, oracle and batched (default: pallas "
                      "on a GPU, xla on the CPU)")
  p.add_argument("--variants", default=",".join(VARIANTS),
                 help=f"the target section's variants (default {','.join(VARIANTS)})")
  p.add_argument("--ks", default=None, help="drafts per round, oracle and batched (default "
                 "3,7,15: those the drafter's block can draft)")
  p.add_argument("--family", choices=FAMILIES, default="dflash", help="the drafter's family "
                 "(default dflash)")
  p.add_argument("--cuts", default="", help="oracle: comma list of cut thresholds, an extra "
                 "row per k and cut (Oracle(cut=...), i.e. decode.Drafter(cut))")
  p.add_argument("--slots", default=None, help="sequences of the batched section (default "
                 "1,4,8,16,32)")
  p.add_argument("--live", default=None, help="live contexts of the long section (default "
                 "512,4096,16384,32768)")
  p.add_argument("--chunks", default="", help="long: attention chunk sizes to A/B at the "
                 "longest context (e.g. 256,1024)")
  args = p.parse_args(argv)
  su = setup(args.smoke, args.family)
  ints = lambda v: tuple(int(x) for x in v.split(",") if x)
  for field, v in (("ks", args.ks), ("slots", args.slots), ("live", args.live)):
    if v:
      su = dataclasses.replace(su, **{field: ints(v)})
  only = set(args.only.split(","))
  unknown = only - {"target", "launches", "long", "round", "oracle", "batched"}
  if unknown:
    p.error(f"--only: unknown sections {sorted(unknown)}")
  variants = tuple(v for v in args.variants.split(",") if v)
  if set(variants) - set(VARIANTS):
    p.error(f"--variants: unknown {sorted(set(variants) - set(VARIANTS))}")
  if not su.ks or max(su.ks) > su.drafter.n_drafts() or min(su.ks) < 1:
    p.error(f"--ks: drafts per round must be in [1, {su.drafter.n_drafts()}] (the "
            f"{args.family} drafter's block drafts {su.drafter.n_drafts()})")
  try:
    cuts = [float(c) for c in args.cuts.split(",") if c]
  except ValueError:
    p.error(f"--cuts: not a comma list of numbers: {args.cuts!r}")
  if any(c <= 0 for c in cuts):
    p.error("--cuts: thresholds must be > 0 (the plain row is cut 0)")
  if max(su.live) > su.long_capacity:
    p.error(f"--live: contexts must be <= {su.long_capacity} (the long section's cache)")
  impl = "pallas" if C.ON_GPU else "xla"   # the drafter's kernels (interpret mode is slow)
  target_impl = args.target_impl or impl
  res, out_dir = C.start_results(p, args, argv)
  res.update(setup=dict(dataclasses.asdict(su), target=dataclasses.asdict(su.target),
                        drafter=dataclasses.asdict(su.drafter)), drafter_impl=impl,
             target_impl=target_impl)
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
  reduced = None   # the reduced draft vocab: DFlash's only (the others index the full vocab)
  if dc.family == "dflash":
    d2t = jnp.arange(su.draft_vocab, dtype=jnp.int32)
    reduced = models.replace(drafter=dp.replace(lm_head=tp.head[:su.draft_vocab]), d2t=d2t)
  prompt = np.random.default_rng(0).integers(0, tc.vocab_size, su.prompt_len).tolist()
  kw = dict(capacity=su.capacity, window=su.window, cache_dtype="bf16", ring_dtype="bf16")
  w16 = D.DecodeConfig(width=round_width(dc), impl=impl, target_impl=target_impl)
  # The target passes' cache as at the round (the K/V values do not change the time; no
  # prefill to compile): the prompt and a block of committed rows.
  cache = tc.init_cache(1, su.capacity, "bf16").replace(
      length=jnp.array([su.prompt_len + w16.width], jnp.int32))
  ring = models.run.init_ring(dc, 1, su.window, "bf16", su.capacity)
  res["bytes"] = bytes_section(su, models, reduced, cache, ring, bw)
  del ring
  save("bytes")

  if "target" in only:
    target_section(su, res, tp, cache, bw, variants)
    save("target")
  if "launches" in only:
    launches_section(su, res)
    save("launches")
  if "long" in only:
    long_section(su, res, tp, bw, ints(args.chunks))
    save("long")

  if only & {"round", "oracle"}:
    # Target-only: a warm-up run compiles it (same capacity: same shapes), then the timed
    # run, long enough to give the oracle for every speculative run.
    n_oracle = su.max_new + w16.width
    gkw = dict(rounds_per_call=su.sync_every, target_impl=target_impl, **kw)
    D.generate_target_only(tp, tc, [prompt], 4, **gkw)
    g0 = D.generate_target_only(tp, tc, [prompt], n_oracle, **gkw)
    base_tps = g0.n_tokens / g0.seconds
    oracle = [prompt + g0.tokens[0]]
    res["target_only"] = dict(tokens=g0.n_tokens, seconds=g0.seconds, tokens_per_s=base_tps,
                              ms_per_token=1e3 / base_tps, prefill_s=g0.prefill_seconds)
    save("target_only")
    if "round" in only:
      st = round_state(su, models, w16, prompt, kw)
      round_section(su, res, models, reduced, st, prompt, oracle, impl, target_impl)
      del st
      save("round_ms")
    if "oracle" in only:
      res["oracle"] = []
      for k in su.ks:
        for cut in [0.0] + cuts:
          res["oracle"].append(oracle_run(su, models, prompt, oracle, g0, base_tps, k, impl,
                                          kw, target_impl=target_impl, cut=cut))
          save("oracle")
  if "batched" in only:
    res["batched"] = []
    for n_seqs in su.slots:
      res["batched"].append(_guarded(f"batched S {n_seqs}", batched_run, su, models, n_seqs,
                                     impl, target_impl))
      save("batched")
  print(C.save_results(out_dir, "decode", res, markdown(res)))
  return 0


def round_section(su, res, models, reduced, st, prompt, oracle, impl, target_impl) -> None:
  """Section 6 on the round's state (`round_state`)."""
  tc, dc, tp, dp = su.target, su.drafter, models.target, models.drafter
  w16 = D.DecodeConfig(width=round_width(dc), impl=impl, target_impl=target_impl)
  w = w16.width
  keys = jax.random.split(jax.random.key(3), 3)
  key = jax.random.split(keys[0], 1)
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
  logits = jax.random.normal(keys[1], (1, w, tc.vocab_size), jnp.float32)
  feats = jax.random.normal(keys[2], (1, w, dc.n_embd_fc), jnp.float32)
  commit = jax.jit(lambda m, s, d, lg, f, k: (lambda o: (o.tokens, o.n_past, o.pending, o.hist))(
      D.accept_commit(m, w16, s, D.Proposal(d), lg, f, k)))
  parts["accept_commit"] = device_ms(commit, models, st, drafts, logits, feats, key,
                                     iters=su.iters)
  res["compile_and_measure_draft_parts_s"] = time.perf_counter() - t0
  vt = jnp.concatenate([st.id_last[:, None], drafts], 1)
  t0 = time.perf_counter()
  prior = res.get("target", {}).get("pallas" if target_impl == "pallas" else "xla", {})
  if "ms" in prior.get("verify16", {}) and "ms" in prior.get("decode1", {}):
    # The target section measured them (same state, same passes).
    parts["verify_block"] = prior["verify16"]["ms"]
    parts["decode1"] = prior["decode1"]["ms"]
  else:
    parts["verify_block"] = device_ms(target_loop(tc, su.inner, dc.target_layers, target_impl),
                                      tp, st.cache, vt, iters=su.iters, per_call=su.inner)
    parts["decode1"] = device_ms(target_loop(tc, su.inner, (), target_impl), tp, st.cache,
                                 vt[:, :1], iters=su.iters, per_call=su.inner)
  res["compile_and_measure_target_s"] = time.perf_counter() - t0
  parts["block_width"] = w
  rnd = parts["draft_full_vocab"] + parts["verify_block"] + parts["accept_commit"]
  parts.update(round_full_vocab=rnd,
               verify_block_over_decode1=parts["verify_block"] / parts["decode1"],
               draft_fraction_full_vocab=parts["draft_full_vocab"] / rnd,
               decode1_floor_fraction=res["bytes"]["decode_step_floor_ms"] / parts["decode1"])
  if "draft_reduced_vocab" in parts:   # DFlash only
    rnd_r = parts["draft_reduced_vocab"] + parts["verify_block"] + parts["accept_commit"]
    parts.update(round_reduced_vocab=rnd_r,
                 draft_fraction_reduced_vocab=parts["draft_reduced_vocab"] / rnd_r)
  res["round_ms"] = parts


def oracle_runs(su, models, prompts, oracles, k, impl, kw, max_new: int, max_refine: int = 12,
                target_impl: str = "xla", cut: float = 0.0):
  """Speculative decoding of every prompt (one slot each) with the oracle proposer at k
  drafts per round: a warm-up run compiles (same shapes), then timed runs. The first oracles
  are target-only greedy outputs; where a verify of k + 1 rows breaks a near tie differently
  from a 1-row decode (a target that is not batch invariant), that oracle is wrong for the
  rest of the run. So each slot's oracle is refined to a fixed point: each run's committed
  tokens become the next run's oracle (the agreeing prefix grows by at least one round per
  run) until a run commits exactly its oracles, i.e. every draft of every round was accepted.
  cut > 0: the drafter's cut shortens each round's verify (`Oracle(cut=...)`); a cut draft
  is one the oracle would have had accepted, so the fixed point is still every oracle.
  Returns (the last run's Generation, runs, fixed point reached, warm-up seconds)."""
  dcfg = D.DecodeConfig(width=k + 1, impl=impl, target_impl=target_impl,
                        proposer=Oracle(cut=cut))
  length = max(len(o) for o in oracles) + k + 1
  t0 = time.perf_counter()
  D.generate(models, dcfg, prompts, 4, proposer_state=Oracle.state(oracles, length),
             rounds_per_call=su.sync_every, **kw)
  warm = time.perf_counter() - t0
  for runs in range(1, max_refine + 1):
    g = D.generate(models, dcfg, prompts, max_new, proposer_state=Oracle.state(oracles, length),
                   rounds_per_call=su.sync_every, **kw)
    fixed = all(list(t) == list(o[len(p):len(p) + len(t)])
                for t, o, p in zip(g.tokens, oracles, prompts))
    if fixed:
      break
    # Past the run's output an oracle keeps its old tail (only its first max_new tokens count).
    oracles = [p + list(t) + list(o[len(p) + len(t):])
               for t, o, p in zip(g.tokens, oracles, prompts)]
  return g, runs, fixed, warm


def oracle_run(su, models, prompt, oracle, g0, base_tps, k, impl, kw,
               max_refine: int = 12, target_impl: str = "xla", keep_tokens: bool = False,
               cut: float = 0.0) -> dict:
  """Section 7 for one k and cut, one sequence (`oracle_runs`); reports the last run (with
  keep_tokens, its tokens too, as "_tokens")."""
  g, runs, fixed, warm = oracle_runs(su, models, [prompt], oracle, k, impl, kw, su.max_new,
                                     max_refine, target_impl, cut)
  tps = g.n_tokens / g.seconds
  agree = sum(a == b for a, b in zip(g.tokens[0], g0.tokens[0]))
  extra = {"_tokens": list(g.tokens[0])} if keep_tokens else {}
  return dict(**extra, k=k, cut=cut, width=k + 1, tokens=g.n_tokens, rounds=int(g.rounds.sum()),
              tau=g.tau, hist=g.hist.sum(0).tolist(), tokens_per_s=tps,
              ms_per_round=g.seconds / g.rounds.sum() * 1e3,
              ratio_vs_k_plus_1=tps / ((k + 1) * base_tps), ratio_vs_tau=tps / (g.tau * base_tps),
              speedup=tps / base_tps, matches_target_only=f"{agree}/{g.n_tokens}",
              oracle_runs=runs, oracle_fixed_point=fixed, warmup_compile_s=warm)


def batched_run(su: Setup, models: D.Models, n_seqs: int, impl: str, target_impl: str) -> dict:
  """Section 8 for S = n_seqs sequences: target-only, then the oracle at every k."""
  tc = su.target
  rng = np.random.default_rng(100 + n_seqs)
  prompts = [rng.integers(0, tc.vocab_size, su.prompt_len).tolist() for _ in range(n_seqs)]
  kw = dict(capacity=su.batched_capacity, window=su.window, cache_dtype="bf16",
            ring_dtype="bf16")
  gkw = dict(rounds_per_call=su.sync_every, target_impl=target_impl, **kw)
  t0 = time.perf_counter()
  D.generate_target_only(models.target, tc, prompts, 4, **gkw)
  warm = time.perf_counter() - t0
  g0 = D.generate_target_only(models.target, tc, prompts, su.batched_new + max(su.ks) + 1,
                              **gkw)
  base_tps = g0.n_tokens / g0.seconds
  oracles = [p + t for p, t in zip(prompts, g0.tokens)]
  r = dict(slots=n_seqs, target_only_tokens_per_s=base_tps, target_only_warmup_s=warm,
           speculative=[])
  for k in su.ks:
    g, runs, fixed, warm = oracle_runs(su, models, prompts, oracles, k, impl, kw,
                                       su.batched_new, target_impl=target_impl)
    tps = g.n_tokens / g.seconds
    agree = sum(a == b for t, b0 in zip(g.tokens, g0.tokens) for a, b in zip(t, b0))
    r["speculative"].append(dict(
        k=k, tokens=g.n_tokens, tau=g.tau, tokens_per_s=tps, speedup=tps / base_tps,
        ms_per_round=g.seconds / (g.rounds.max()) * 1e3,
        matches_target_only=f"{agree}/{g.n_tokens}", oracle_runs=runs,
        oracle_fixed_point=fixed, warmup_compile_s=warm))
    print(f"  S {n_seqs} k {k}: {tps:.1f} tokens/s ({tps / base_tps:.2f}x target-only "
          f"{base_tps:.1f})", flush=True)
  return r


def _num(v, fmt: str) -> str:
  """v formatted, or '-' where there is none (a family without the reduced draft vocab)."""
  return "-" if v is None else format(v, fmt)


def markdown(res: dict) -> str:
  b = res["bytes"]
  family = res["setup"]["drafter"]["family"]
  lines = [f"- device: {res['device']}, jax {res['jax']}, drafter {family}, drafter impl "
           f"{res['drafter_impl']}, target impl {res['target_impl']}; copy bandwidth "
           f"{res['copy_bw_TBps']:.2f} TB/s; command `{res['command']}`",
           f"- bytes: target {b['target_GB']:.2f} GB (embedding {b['target_embedding_GB']:.2f}), "
           f"drafter body {b['drafter_body_GB']:.2f} GB + head {b['drafter_head_full_GB']:.2f} GB "
           f"(reduced {_num(b['drafter_head_reduced_GB'], '.3f')} GB, DFlash only), K/V cache "
           f"{b['kv_cache_GB']:.3f} GB ({b['kv_live_GB']:.4f} GB live at the round), ring "
           f"{b['ring_GB']:.3f} GB; floors: decode step {b['decode_step_floor_ms']:.3f} ms, draft "
           f"{b['draft_floor_full_ms']:.3f} / {_num(b['draft_floor_reduced_ms'], '.3f')} ms "
           f"(byte fraction {b['draft_byte_fraction_full']:.3f} / "
           f"{_num(b['draft_byte_fraction_reduced'], '.3f')})"]
  t = res.get("target_only")
  if t:
    lines.append(f"- target-only: {t['tokens_per_s']:.1f} tokens/s ({t['ms_per_token']:.3f} "
                 f"ms/token wall)")
  tg = res.get("target")
  if tg:
    lines += ["", f"Target passes at {tg['live_slots']} live slots:", "",
              "| variant | decode1 ms | floor frac | verify16 ms | floor frac | verify16 / decode1 "
              "| kernels per pass (1 / 16 rows) | attention ms (1 / 16) | wall ms (1 / 16) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name in VARIANTS:
      v = tg.get(name)
      if v is None:
        continue
      d, w = v["decode1"], v["verify16"]
      if "ms" not in d or "ms" not in w:
        lines.append(f"| {name} | {d.get('error', '')} {w.get('error', '')} |")
        continue
      lines.append(f"| {name} | {d['ms']:.3f} | {d['floor_fraction']:.3f} | {w['ms']:.3f} | "
                   f"{w['floor_fraction']:.3f} | {v['verify16_over_decode1']:.3f} | "
                   f"{d['launches']:.1f} / {w['launches']:.1f} | {d['attention_ms']:.4f} / "
                   f"{w['attention_ms']:.4f} | {d['wall_ms']:.3f} / {w['wall_ms']:.3f} |")
    for name, label in (("pallas", "decode1"), ("pallas", "verify16")):
      bk = tg.get(name, {}).get(label, {}).get("by_kernel")
      if bk:
        top = sorted(bk.items(), key=lambda kv: -kv[1][1])
        lines.append(f"- {name} {label}, ms per pass by kernel (calls): " + ", ".join(
            f"{k} {ms:.3f} ({n:.0f})" for k, (n, ms) in top))
        fr = tg[name][label].get("gemm_bw_fraction", {})
        if fr:
          lines.append(f"- {name} {label}, GEMM weight bytes / (kernel time x copy bandwidth): "
                       + ", ".join(f"{k} {v:.3f}" for k, v in fr.items()))
    rc = tg.get("read_ceiling")
    if rc and "ms" in rc:
      lines.append(f"- the GEMMs' matrices only read (a row sum each, {rc['launches']} kernels): "
                   f"{rc['ms']:.3f} ms for {rc['bytes'] / 1e9:.2f} GB = {rc['bw_fraction']:.3f} "
                   "of the copy bandwidth")
    for label in ("decode1", "verify16"):
      if f"invariance_cost_{label}" in tg:
        lines.append(f"- {label}: cost of invariance (pallas / pallas_fast - 1) "
                     f"{100 * tg[f'invariance_cost_{label}']:+.2f}%")
      if f"speedup_over_xla_{label}" in tg:
        lines.append(f"- {label}: pallas over xla {tg[f'speedup_over_xla_{label}']:.3f}x")
  if res.get("launches"):
    lines += ["", "Kernels per decoder layer: " + ", ".join(
        f"{k} {v}" for k, v in res["launches"].items())]
  if res.get("long"):
    lines += ["", "| pass | impl | chunk | live slots | ms | floor ms | floor frac | attention ms "
              "| attention share | attention bw frac |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["long"]:
      if "error" in r:
        lines.append(f"| {r['pass_']} | {r['impl']} | {r.get('chunk', '-')} | {r['live']} | "
                     f"{r['error']} |")
        continue
      bwf = "-" if r["attention_bw_fraction"] is None else f"{r['attention_bw_fraction']:.3f}"
      lines.append(f"| {r['pass_']} | {r['impl']} | {r.get('chunk', '-')} | {r['live']} | "
                   f"{r['ms']:.3f} | {r['floor_ms']:.3f} | {r['floor_fraction']:.3f} | "
                   f"{r['attention_ms']:.4f} | {r['attention_share']:.3f} | {bwf} |")
  r = res.get("round_ms", {})
  if r:
    lines += ["", f"| piece (width {r['block_width']}) | device ms |", "|---|---|"]
    for k in ("draft_full_vocab", "inject", "block_step_full_vocab", "draft_reduced_vocab",
              "verify_block", "accept_commit", "decode1", "round_full_vocab",
              "round_reduced_vocab"):
      if k in r:
        lines.append(f"| {k} | {r[k]:.4f} |")
    lines += ["", f"verify of {r['block_width']} rows / decode1 = "
              f"{r['verify_block_over_decode1']:.3f}; draft fraction "
              f"{r['draft_fraction_full_vocab']:.3f} (full vocab), "
              f"{_num(r.get('draft_fraction_reduced_vocab'), '.3f')} (reduced draft vocab); "
              f"decode1 at "
              f"{r['decode1_floor_fraction']:.2f} of its byte floor"]
  if res.get("oracle"):
    lines += ["", "| k | cut | tau | tokens/s | ms/round (wall) | speedup | / ((k+1) x "
              "target-only) | / (tau x target-only) | matches target-only | oracle runs (fixed "
              "point) |", "|" + "---|" * 10]
    for o in res["oracle"]:
      lines.append(f"| {o['k']} | {o.get('cut', 0.0):g} | {o['tau']:.2f} | "
                   f"{o['tokens_per_s']:.1f} | {o['ms_per_round']:.3f} | "
                   f"{o['speedup']:.2f}x | {o['ratio_vs_k_plus_1']:.3f} | {o['ratio_vs_tau']:.3f} | "
                   f"{o['matches_target_only']} | {o['oracle_runs']} ({o['oracle_fixed_point']}) |")
  if res.get("batched"):
    lines += ["", "| S | target-only tokens/s | k | tokens/s | speedup | tau | matches target-only "
              "| oracle runs (fixed point) |", "|---|---|---|---|---|---|---|---|"]
    for r in res["batched"]:
      if "error" in r:
        lines.append(f"| {r['error']} |")
        continue
      for o in r["speculative"]:
        lines.append(f"| {r['slots']} | {r['target_only_tokens_per_s']:.1f} | {o['k']} | "
                     f"{o['tokens_per_s']:.1f} | {o['speedup']:.2f}x | {o['tau']:.2f} | "
                     f"{o['matches_target_only']} | {o['oracle_runs']} "
                     f"({o['oracle_fixed_point']}) |")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
