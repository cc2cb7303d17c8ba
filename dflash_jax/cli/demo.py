"""`python -m dflash_jax demo`: load (or make) a drafter GGUF and run speculative rounds.

Without --gguf it writes a small synthetic drafter to a temporary GGUF and loads it back, so
the whole path (file -> weights -> jitted draft rounds) runs on a fresh machine with no data.
The target model is simulated: it accepts a random prefix of each draft block.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time

import numpy as np


def register(sub) -> None:
  d = sub.add_parser("demo", help="run draft rounds on a drafter (default: a small synthetic one)",
                     description=__doc__.splitlines()[0])
  d.add_argument("--gguf", help="drafter GGUF (default: a synthetic drafter written to a temp file)")
  d.add_argument("--size", choices=("tiny", "small", "seed"), default="small",
                 help="synthetic drafter size (seed = the real 5x6656 drafter; GPU only)")
  d.add_argument("--vocab", type=int, default=4096, help="synthetic target vocab size")
  d.add_argument("--prefill", type=int, default=100, help="prompt tokens")
  d.add_argument("--rounds", type=int, default=50)
  d.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp8", "q8_0"),
                 help="weights: fp8 is quantized at load; q8_0 keeps a Q8_0 file's blocks as "
                      "stored (the synthetic drafter is then written as Q8_0)")
  d.add_argument("--ring-dtype", default="fp32", choices=("fp32", "bf16"))
  d.add_argument("--window", type=int, default=None, help="ring size (default: file's, else 2048)")
  d.add_argument("--impl", default="pallas", choices=("pallas", "xla"))
  d.add_argument("--seed", type=int, default=0)
  d.set_defaults(run=demo)


SMALL = dict(n_layer=2, n_embd=256, n_ff=512, n_head=8, n_head_kv=2, head_dim=32,
             rope_theta=1e6, eps=1e-6, target_layers=(2, 10, 18), mask_token_id=7,
             block_size=16, window=256)


def _drafter(args):
  import dflash_jax as dfj
  if args.gguf:
    cfg, w = dfj.load_drafter(args.gguf)
    n_vocab = args.vocab
    rng = np.random.default_rng(args.seed)
    w["tok_embd"] = rng.standard_normal((n_vocab, cfg.n_embd), dtype=np.float32)
    w["lm_head"] = rng.standard_normal((n_vocab, cfg.n_embd), dtype=np.float32) / np.sqrt(cfg.n_embd)
    return cfg, w, args.gguf
  cfg = {"tiny": dfj.TINY_CONFIG, "small": dfj.DFlashConfig(**SMALL), "seed": dfj.SEED_CONFIG}[args.size]
  cfg = dataclasses.replace(cfg, mask_token_id=min(cfg.mask_token_id, args.vocab - 1))
  w = dfj.synthetic_drafter(cfg, seed=args.seed, n_vocab=args.vocab)
  path = os.path.join(tempfile.mkdtemp(prefix="dflash_demo_"), "synthetic-drafter.gguf")
  dfj.save_drafter(path, cfg, w, tensor_type="Q8_0" if args.dtype == "q8_0" else "F32")
  cfg, loaded = dfj.load_drafter(path)
  loaded["tok_embd"], loaded["lm_head"] = w["tok_embd"], w["lm_head"]
  return cfg, loaded, path


def demo(args) -> int:
  import jax
  from tqdm import tqdm

  import dflash_jax as dfj
  cfg, w, source = _drafter(args)
  q8_0_blocks = dfj.read_q8_0(source) if args.dtype == "q8_0" else None
  print(f"drafter: {source}")
  print(f"config:  {cfg}")
  print(f"device:  {jax.devices()[0].device_kind} ({jax.default_backend()}), impl={args.impl}, "
        f"dtype={args.dtype}, ring_dtype={args.ring_dtype}")
  m = dfj.DFlashDrafter(cfg, w, dtype=args.dtype, ring_dtype=args.ring_dtype, window=args.window,
                        impl=args.impl, q8_0_blocks=q8_0_blocks)
  rng = np.random.default_rng(args.seed + 1)
  bsz = cfg.block_size

  t0 = time.perf_counter()
  n = args.prefill
  m.inject(m.encode(dfj.synthetic_features(cfg, n - 1, seed=args.seed + 2)), np.arange(n - 1))
  jax.block_until_ready(m.ring)
  print(f"prefill: {n - 1} rows injected into a {m.window}-slot ring in "
        f"{(time.perf_counter() - t0) * 1e3:.1f} ms (includes compile)")

  id_last, n_past = int(rng.integers(args.vocab)), n - 1
  pending = np.zeros((bsz, cfg.n_embd_fc), np.float32)
  n_new = 0
  times, taus = [], []
  for r in tqdm(range(args.rounds), desc="draft rounds", disable=args.rounds < 20, file=sys.stdout):
    t0 = time.perf_counter()
    drafts, _ = m.draft_round(pending, n_new, id_last, n_past)
    drafts = np.asarray(drafts)
    times.append(time.perf_counter() - t0)
    # Simulated target: agrees on a random prefix, then corrects.
    n_ok = int(min(rng.geometric(0.3) - 1, bsz - 1))
    target = drafts.copy()
    if n_ok < bsz - 1:
      target[n_ok] = (drafts[n_ok] + 1 + rng.integers(args.vocab - 1)) % args.vocab
    n_ok_dev = int(m.accept(drafts, target))
    assert n_ok_dev == n_ok, (n_ok_dev, n_ok)
    correction = int(target[n_ok]) if n_ok < bsz - 1 else int(rng.integers(args.vocab))
    if r == 0:
      print(f"round 0 drafts: {drafts.tolist()}  accepted {n_ok}")
    taus.append(n_ok + 1)
    n_new = n_ok + 1
    pending = dfj.synthetic_features(cfg, bsz, seed=args.seed + 100 + r)
    n_past += n_new
    id_last = correction
  t = np.array(times[1:] or times) * 1e3
  print(f"rounds:  {args.rounds}, committed {n_past - (n - 1)} tokens, tau {np.mean(taus):.2f}")
  print(f"timing:  first round {times[0] * 1e3:.1f} ms (compile), then per round median "
        f"{np.median(t):.3f} ms, p10 {np.percentile(t, 10):.3f}, p90 {np.percentile(t, 90):.3f} "
        "(wall, includes the host round trip of the simulated target)")
  return 0

