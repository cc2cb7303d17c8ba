"""`python -m dflash_jax simulate`: a drafter's rounds against a simulated target (no target model).

The drafter is a file (--drafter: a GGUF or an HF folder) or a synthetic one written to a
temporary GGUF and loaded back, so the path file -> weights -> jitted draft rounds runs with
no data, at any size (the real seed drafter's on a GPU). There is no target model: a coin
accepts a random prefix of each draft block, so tau describes that coin, not the drafter;
the timings are the drafter's alone. `python -m dflash_jax demo` decodes real text instead.
"""
from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from dflash_jax.cli import (IMPL_HELP, CLIError, add_common_args, existing_path, int_in,
                            on_interrupt, resolve_impl)

SIZES = ("tiny", "small", "seed")
VOCAB = 4096
SMALL = dict(n_layer=2, n_embd=256, n_ff=512, n_head=8, n_head_kv=2, head_dim=32,
             rope_theta=1e6, eps=1e-6, target_layers=(2, 10, 18), mask_token_id=7,
             block_size=16, window=256)
# The simulated target accepts each draft with this probability until its first rejection, so
# tau has mean (1 - P^B) / (1 - P) for block size B, whatever the drafter proposes.
ACCEPT_P = 0.7
# Bytes per weight on the device and in the GGUF (Q8_0: 34 bytes per 32 weights).
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1, "q8_0": 34 / 32}
_INT32_MAX = 2**31 - 1


def register(sub) -> None:
  d = sub.add_parser("simulate", help="a drafter's rounds against a simulated target (drafter "
                     "timings only; tau is a coin's)", description=__doc__.split("\n\n")[0])
  d.add_argument("--drafter", type=existing_path,
                 help="drafter GGUF or HF folder (default: a synthetic drafter written to a "
                      "temporary GGUF)")
  d.add_argument("--size", choices=SIZES, default=None,
                 help="synthetic drafter size (default: small; seed = the real 5x6656 drafter, "
                      "GPU only); not with --drafter")
  d.add_argument("--vocab", type=int_in(2), default=None,
                 help="target vocab size, the rows of the synthetic tok_embd/lm_head (default: "
                      f"{VOCAB}, or the first multiple of 256 above the drafter's "
                      "mask_token_id when that is larger); must exceed mask_token_id")
  d.add_argument("--prefill", type=int_in(1), default=100,
                 help="prompt tokens: the features of all but the last are injected, the last "
                      "is the first round's id_last")
  d.add_argument("--rounds", type=int_in(1), default=50, help="speculative rounds")
  d.add_argument("--dtype", default="fp32", choices=tuple(WEIGHT_BYTES),
                 help="weights: fp8 is quantized at load; q8_0 keeps a Q8_0 file's blocks as "
                      "stored (the synthetic drafter is then written as Q8_0)")
  d.add_argument("--ring-dtype", default="fp32", choices=("fp32", "bf16"),
                 help="K/V ring storage")
  ring = d.add_mutually_exclusive_group()
  ring.add_argument("--window", type=int_in(1), default=None,
                    help="ring size of the sliding layers (default: the file's window, else "
                         "2048); full-attention layers keep every position")
  ring.add_argument("--draft-window", type=int_in(1), default=None,
                    help="run every layer, full-attention ones included, in a ring of this many "
                         "slots (the engines' draft-window option: an approximation of full "
                         "layers past N positions; default: off)")
  d.add_argument("--impl", default="auto", choices=("auto", "pallas", "xla"),
                 help=IMPL_HELP + "; the twins have no kernel limits")
  d.add_argument("--seed", type=int_in(0), default=0,
                 help="seed of the synthetic weights, features and simulated target")
  add_common_args(d)
  d.set_defaults(run=simulate)


def _config(args):
  import dflash_jax as dfj
  if args.drafter:
    if args.size is not None:
      raise CLIError("argument --size: applies to the synthetic drafter, not with --drafter")
    try:
      cfg, w = dfj.load_drafter(args.drafter)
    except (dfj.DrafterFormatError, OSError) as e:
      raise CLIError(f"argument --drafter: {e}") from None
  else:
    cfg, w = {"tiny": dfj.TINY_CONFIG, "small": dfj.DFlashConfig(**SMALL),
              "seed": dfj.SEED_CONFIG}[args.size or "small"], None
  if args.draft_window is not None:
    cfg = cfg.with_draft_window(args.draft_window)
  return cfg, w


def _gb(n: float) -> str:
  return f"{n / 1e9:.1f} GB"


def _estimate(cfg, args) -> dict[str, float]:
  """Bytes the run needs, roughly: 'host' (float32 weights as loaded, the target's tok_embd and
  lm_head, the prompt's features), 'device' (weights in --dtype, the ring, the features) and
  'disk' (the synthetic drafter's temporary GGUF; 0 with --drafter)."""
  import dflash_jax as dfj
  n_drafter = sum(math.prod(s) for s in dfj.drafter_tensor_shapes(cfg).values())
  n_target = 2 * args.vocab * cfg.n_embd
  features = 4 * args.prefill * cfg.n_embd_fc
  ring = dfj.ring_nbytes(cfg, args.window, args.ring_dtype)
  file_bytes = WEIGHT_BYTES["q8_0" if args.dtype == "q8_0" else "fp32"]
  return {"host": 4 * (n_drafter + n_target) + features,
          "device": WEIGHT_BYTES[args.dtype] * n_drafter + 4 * n_target + ring + 2 * features,
          "disk": 0 if args.drafter else file_bytes * n_drafter}


def _check_fits(cfg, args, tmp: str) -> None:
  """Refuses, before any work, a run this machine cannot hold (or, for seed, cannot run)."""
  import jax
  need = _estimate(cfg, args)
  backend = jax.default_backend()
  what = (f"about {_gb(need['host'])} of host memory, {_gb(need['device'])} on the device and "
          f"{_gb(need['disk'])} of temporary disk")
  if args.size == "seed" and backend != "gpu":
    raise CLIError(f"argument --size: seed is GPU only (it needs {what}, and on {backend} the "
                   "Pallas kernels run in interpret mode); use --size tiny or small here")
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  on_host = need["host"] + (need["device"] if backend == "cpu" else 0)
  if on_host > ram:
    raise CLIError(f"this run needs {what}; this machine has {_gb(ram)} of memory "
                   "(lower --vocab, --prefill or --size)")
  if backend != "cpu":
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if limit and need["device"] > limit:
      raise CLIError(f"this run needs {what}; the {jax.devices()[0].device_kind} holds "
                     f"{_gb(limit)} (lower --vocab, --prefill or use --dtype fp8)")
  free = shutil.disk_usage(tmp).free
  if need["disk"] > free:
    raise CLIError(f"this run needs {what}; {tmp} has {_gb(free)} free")


def _check_args(cfg, args) -> int:
  """The limits that depend on the drafter (filling in --vocab's default); returns the window."""
  from dflash_jax.config import FULL, SLIDING
  from pallas_kernels import limits
  if args.vocab is None:
    args.vocab = max(VOCAB, (cfg.mask_token_id // 256 + 1) * 256)
  if args.vocab <= cfg.mask_token_id:
    raise CLIError(f"argument --vocab: must exceed the drafter's mask_token_id "
                   f"{cfg.mask_token_id} (its embedding is a row of the target's tok_embd), "
                   f"got {args.vocab}")
  window = cfg.resolve_window(args.window)
  slots = [window if kind == SLIDING else cfg.resolve_capacity() for kind, _ in cfg.kind_groups]
  if args.impl == "pallas":
    try:
      limits.check_drafter(n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim,
                           width=cfg.block_size, ring_slots=slots)
    except ValueError as e:
      raise CLIError(f"the drafter's shape: {e} (or use --impl xla)") from None
  last = args.prefill - 1 + args.rounds * cfg.block_size   # every draft accepted
  if last > _INT32_MAX - cfg.block_size:
    raise CLIError(f"arguments --prefill/--rounds: positions would reach {last}, past the int32 "
                   f"limit {_INT32_MAX - cfg.block_size}")
  if FULL in cfg.kinds and last + cfg.block_size > cfg.resolve_capacity():
    raise CLIError(f"arguments --prefill/--rounds: positions would reach {last}, past the "
                   f"{cfg.resolve_capacity()} positions of the drafter's full-attention cache "
                   "(its context length; --draft-window N runs those layers in a ring instead)")
  return window


def _weights(cfg, w, args, tmp: str):
  """(weights with the target's tok_embd/lm_head, GGUF path) for the run."""
  import dflash_jax as dfj
  rng = np.random.default_rng(args.seed)
  if args.drafter:
    w["tok_embd"] = rng.standard_normal((args.vocab, cfg.n_embd), dtype=np.float32)
    w["lm_head"] = rng.standard_normal((args.vocab, cfg.n_embd), dtype=np.float32)
    w["lm_head"] /= np.sqrt(cfg.n_embd)
    return w, args.drafter
  synthetic = dfj.synthetic_drafter(cfg, seed=args.seed, n_vocab=args.vocab)
  path = os.path.join(tmp, "synthetic-drafter.gguf")
  dfj.save_drafter(path, cfg, synthetic, tensor_type="Q8_0" if args.dtype == "q8_0" else "F32")
  target = {k: synthetic[k] for k in dfj.io.errors.TARGET_TENSORS}
  del synthetic   # one float32 copy of the drafter at a time
  cfg_file, loaded = dfj.load_drafter(path)
  assert cfg_file == cfg, (cfg_file, cfg)
  loaded.update(target)
  return loaded, path


def simulate(args) -> int:
  args.impl = resolve_impl(args.impl)
  cfg, w = _config(args)
  window = _check_args(cfg, args)
  # Every temporary file lives in this folder, removed on every exit path (an interrupt too).
  with tempfile.TemporaryDirectory(prefix="dflash_simulate_") as tmp, \
       on_interrupt(lambda: shutil.rmtree(tmp, ignore_errors=True)):
    _check_fits(cfg, args, tmp)
    return _run(cfg, w, args, window, tmp)


def _run(cfg, w, args, window: int, tmp: str) -> int:
  import jax
  from tqdm import tqdm

  import dflash_jax as dfj
  w, source = _weights(cfg, w, args, tmp)
  from_gguf = args.dtype == "q8_0" and os.path.isfile(source)
  q8_0_blocks = dfj.read_q8_0(source) if from_gguf else None
  print(f"drafter: {source}" + ("" if args.drafter else
                                " (synthetic, random weights; removed at exit)"))
  print(f"config:  {cfg}")
  print(f"device:  {jax.devices()[0].device_kind} ({jax.default_backend()}), impl={args.impl}, "
        f"dtype={args.dtype}, ring_dtype={args.ring_dtype}")
  try:
    m = dfj.DFlashDrafter(cfg, w, dtype=args.dtype, ring_dtype=args.ring_dtype, window=window,
                          impl=args.impl, q8_0_blocks=q8_0_blocks)
  except ValueError as e:   # the weight formats' shape limits (e.g. fp8 rows of the vocab)
    raise CLIError(f"argument --dtype {args.dtype}: {e}") from None
  rng = np.random.default_rng(args.seed + 1)
  bsz = cfg.block_size
  print(f"target:  simulated, not a model: it accepts each draft with probability {ACCEPT_P} "
        "until the first rejection, whatever the drafter proposes (a real target comes with "
        "the decoding loop)")

  t0 = time.perf_counter()
  n = args.prefill
  if n > 1:
    m.inject(m.encode(dfj.synthetic_features(cfg, n - 1, seed=args.seed + 2)), np.arange(n - 1))
    jax.block_until_ready(m.ring)
  caches = ([f"a {m.window}-slot ring"] if m.window else []) + (
      [f"a {m.capacity}-position full-attention cache"] if m.capacity else [])
  print(f"prefill: {n - 1} rows injected into {' and '.join(caches)} in "
        f"{(time.perf_counter() - t0) * 1e3:.1f} ms (includes compile)")

  id_last, n_past = int(rng.integers(args.vocab)), n - 1
  pending = np.zeros((bsz, cfg.n_embd_fc), np.float32)   # static row count: one compile
  n_new = 0
  times, taus = [], []
  with tqdm(range(args.rounds), desc="draft rounds", file=sys.stdout,
            disable=args.rounds < 20 or not sys.stdout.isatty()) as bar:
    for r in bar:
      t0 = time.perf_counter()
      drafts, _ = m.draft_round(pending, n_new, id_last, n_past)
      drafts = np.asarray(drafts)
      times.append(time.perf_counter() - t0)
      n_ok = _simulated_accept(rng, bsz)
      target = drafts.copy()
      if n_ok < bsz - 1:
        target[n_ok] = (drafts[n_ok] + 1 + rng.integers(args.vocab - 1)) % args.vocab
      n_ok_dev = int(m.accept(drafts, target))
      if n_ok_dev != n_ok:
        raise AssertionError(f"device accept {n_ok_dev} != the simulated target's {n_ok}")
      correction = int(target[n_ok]) if n_ok < bsz - 1 else int(rng.integers(args.vocab))
      if r == 0:
        bar.write(f"round 0: drafts {drafts.tolist()}, accepted {n_ok} (random weights: the "
                  "block's mask positions share one embedding and differ only through rope, "
                  "so a random drafter tends to repeat one token)", file=sys.stdout)
      taus.append(n_ok + 1)
      n_new = n_ok + 1
      pending = dfj.synthetic_features(cfg, bsz, seed=args.seed + 100 + r)
      n_past += n_new
      id_last = correction
  t = np.array(times[1:] or times) * 1e3
  print(f"rounds:  {args.rounds}, committed {n_past - (n - 1)} tokens, tau {np.mean(taus):.2f} "
        "(tau = mean tokens committed per round = accepted drafts + 1; it measures the "
        f"simulated target, whose mean is {_expected_tau(bsz):.2f}, not the drafter)")
  print(f"timing:  first round {times[0] * 1e3:.1f} ms (compile), then per round median "
        f"{np.median(t):.3f} ms, p10 {np.percentile(t, 10):.3f}, p90 {np.percentile(t, 90):.3f} "
        "(wall, includes the host round trip of the simulated target)")
  return 0


def _simulated_accept(rng: np.random.Generator, block_size: int) -> int:
  """Accepted drafts: each of the block_size - 1 accepted with ACCEPT_P until the first miss."""
  return int(min(rng.geometric(1 - ACCEPT_P) - 1, block_size - 1))


def _expected_tau(block_size: int) -> float:
  """E[accepted + 1] for _simulated_accept: sum over k < block_size of ACCEPT_P^k."""
  return (1 - ACCEPT_P**block_size) / (1 - ACCEPT_P)
