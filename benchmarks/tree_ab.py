"""The same measurements on two source trees in one GPU call: did a change move the step?

  python -m benchmarks.tree_ab --gpu --out results/ab/new.json          # this tree
  (cd OTHER && python -c "import runpy, sys; sys.argv = ['x', '--gpu', '--out', 'old.json'];
                          runpy.run_path('PATH/benchmarks/tree_ab.py', run_name='__main__')")

It uses only entry points that the drafter and the decoding loop have had since before the
package split (`block_step_jit`, `draft_round_jit`, `decode.start` / `run_rounds`, the
benchmark helpers of benchmarks/common.py), importing them from either layout, so a tree
from before a refactor runs it unchanged. Measured, in one process per tree:
- the seed drafter's block step (V8192, 2048-slot bf16 ring, every slot live) with bf16 and
  fp8 weights, and its draft round (inject of 16 rows + step): CUPTI device time, median of
  many after a warm-up, and the launch count;
- the decode round at Qwen3-8B shapes (bf16 target, QWEN3_8B_CONFIG drafter, width 16, a
  random drafter): wall time per round of `run_rounds` calls of 16 rounds, median of 9 calls
  after 2 warm-ups (compilation excluded).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import dflash_jax as dfj
from benchmarks import common as C
from dflash_jax import decode as D
from dflash_jax.models import qwen3 as Q

try:   # the drafter package (after the structural step) or the flat module (before)
  from dflash_jax.drafter import step as S
except ImportError:
  from dflash_jax import step as S


def step_cases(iters: int, cfg, n_vocab: int, window: int) -> dict:
  out = {}
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  for fmt in ("bf16", "fp8"):
    params = C.random_params(cfg, n_vocab, fmt)
    ring = C.filled_state(cfg, "bf16", window, window)
    f = S.block_step_jit.lower(params, ring, scalar, scalar, impl="pallas").compile()
    per = C.cupti_kernels(f, params, ring, jnp.int32(1), jnp.int32(window), iterations=iters)
    out[f"step_{fmt}"] = dict(device_ms=C.device_ms(per), launches=C.launches(per))
    if fmt == "bf16":
      feats = jax.random.normal(jax.random.key(3), (cfg.block_size, cfg.n_embd_fc), jnp.float32)
      # Not donated here (CUPTI calls it repeatedly); the round's inject writes a copy.
      rnd = jax.jit(lambda p, r, x, n, i, q: S.draft_round(p, r, x, n, i, q, impl="pallas")[2])
      per = C.cupti_kernels(rnd, params, ring, feats, jnp.int32(cfg.block_size), jnp.int32(1),
                            jnp.int32(window), iterations=iters)
      out["draft_round_bf16"] = dict(device_ms=C.device_ms(per), launches=C.launches(per))
    del params, ring
  return out


QWEN3_8B = Q.TargetConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                          num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, rope_theta=1e6, max_position_embeddings=40960)


def decode_round(tc, dc, impl: str, calls: int = 9, rounds: int = 16) -> dict:
  tp = Q.init_params(tc, jax.random.key(0), "bf16")
  dp = C.random_params(dc, tc.vocab_size, "bf16").replace(tok_embd=tp.embed, lm_head=tp.head)
  models = D.Models(target=tp, drafter=dp, d2t=None, target_cfg=tc)
  dcfg = D.DecodeConfig(width=dc.block_size, impl=impl)
  prompt = np.random.default_rng(0).integers(0, tc.vocab_size, 512).tolist()
  max_new = rounds * dc.block_size * (calls + 3)
  st = D.start(models, dcfg, [prompt], max_new, capacity=512 + max_new + 32,
               cache_dtype="bf16", ring_dtype="bf16")
  times = []
  for i in range(calls + 2):
    t0 = time.perf_counter()
    st = D.run_rounds(models, dcfg, st, jnp.int32(rounds))
    jax.block_until_ready(st.n_past)
    if i >= 2:
      times.append((time.perf_counter() - t0) / rounds * 1e3)
  assert not bool(np.asarray(st.done).any()), "a slot finished: raise max_new"
  return dict(round_wall_ms=statistics.median(times), round_wall_ms_all=times,
              tau=float(np.asarray(st.hist).sum(0) @ np.arange(1, dc.block_size + 1)
                        / np.asarray(st.hist).sum()))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  mode = p.add_mutually_exclusive_group(required=True)
  mode.add_argument("--gpu", action="store_true", help="the real dims on the GPU")
  mode.add_argument("--smoke", action="store_true", help="tiny dims, any backend (no results)")
  p.add_argument("--iters", type=int, default=100)
  p.add_argument("--out", required=True)
  args = p.parse_args(argv)
  if args.gpu and not C.ON_GPU:
    p.error("--gpu needs a GPU backend")
  res = dict(jax=jax.__version__, device=str(jax.devices()[0]))
  if args.gpu:
    res.update(step_cases(args.iters, dfj.SEED_CONFIG, 8192, 2048))
  else:
    res.update(step_cases(2, dfj.TINY_CONFIG, 512, dfj.TINY_CONFIG.window))
  print(json.dumps(res), flush=True)
  if args.gpu:
    res["decode"] = decode_round(QWEN3_8B, dfj.QWEN3_8B_CONFIG, "pallas")
  else:
    tiny = Q.TargetConfig(vocab_size=512, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, max_position_embeddings=4096)
    import dataclasses
    res["decode"] = decode_round(tiny, dataclasses.replace(dfj.TINY_CONFIG, n_embd=64), "xla",
                                 calls=2, rounds=2)
  with open(args.out, "w") as f:
    json.dump(res, f, indent=1)
  print(json.dumps(res), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
