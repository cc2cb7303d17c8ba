"""Loading a target checkpoint: wall time and peak host memory of `dflash_jax.models.load_target`.

  python -m benchmarks.load_target --gpu [--folder DIR] [--layers 36] [--shard-gb 4]
  python -m benchmarks.load_target --smoke     # CPU, tiny dims, seconds (CI): not results

Writes (when DIR holds no checkpoint yet) a Qwen3-8B-shaped HF folder of random bf16 values
(vocab 151936, hidden 4096, ffn 12288, 32 / 8 heads x 128; 36 layers: 16.4 GB) in shards of at
most --shard-gb, then loads it --repeat times, each in a fresh process, and reports per load:
seconds (until every parameter is on the device), GB/s of checkpoint, the peak RSS of that
process (VmHWM, and before the load), and the largest shard for comparison. The writer's page
cache stays warm, so loads after a fresh write read from memory, not the disk. The values are random
(drawn once from a pool of normals and reused at different offsets: timing and memory do not
depend on them). The folder is kept unless it was a temporary one.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128)
SMOKE = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)


def _config(smoke: bool, layers: int):
  from dflash_jax.models import qwen3
  dims = SMOKE if smoke else QWEN3_8B
  return qwen3.TargetConfig(num_hidden_layers=layers, rms_norm_eps=1e-6, rope_theta=1e6,
                            tie_word_embeddings=False, qk_norm=True,
                            max_position_embeddings=40960, **dims)


def write_folder(folder: str, cfg, shard_bytes: int, seed: int = 0) -> int:
  """A bf16 checkpoint of cfg's shapes in `folder`; returns its tensor bytes. Every tensor is
  a view of one pool of bf16 normals (as large as the largest tensor) at its own offset, so the
  writer holds the pool plus one shard's serialization, not the whole model."""
  import ml_dtypes

  from dflash_jax.io import atomic
  from dflash_jax.io import safetensors as st
  from dflash_jax.models import qwen3
  shapes = qwen3.hf_tensor_shapes(cfg)
  largest = max(int(np.prod(s)) for s in shapes.values())
  rng = np.random.default_rng(seed)
  pool = (0.02 * rng.standard_normal(largest + 4096, dtype=np.float32)).astype(
      ml_dtypes.bfloat16)
  tensors = {}
  for k, (name, shape) in enumerate(shapes.items()):
    n = int(np.prod(shape))
    start = (k * 997) % (pool.size - n + 1)
    tensors[name] = pool[start:start + n].reshape(shape)
  tensors.update({n: np.ones(s, ml_dtypes.bfloat16) for n, s in shapes.items() if len(s) == 1})
  st.write_tensors(folder, tensors, dtype=None, max_shard_bytes=shard_bytes)
  atomic.write_json(os.path.join(folder, "config.json"),
                    {**cfg.to_hf(), "torch_dtype": "bfloat16"})
  return sum(a.nbytes for a in tensors.values())


def load_once(folder: str) -> dict:
  """One load in this process: seconds, peak RSS (bytes) before and after, the params' bytes
  and dtypes."""
  import jax

  from dflash_jax.models import load_target
  device = jax.devices()[0].device_kind   # the backend is up before the clock starts
  before = _vm_kb("VmHWM") * 1024
  t0 = time.perf_counter()
  cfg, params = load_target(folder)
  jax.block_until_ready(params)
  seconds = time.perf_counter() - t0
  leaves = jax.tree.leaves(params)
  return dict(seconds=seconds, rss_before=before,
              peak_rss=_vm_kb("VmHWM") * 1024,
              param_bytes=int(sum(x.nbytes for x in leaves)),
              dtypes=sorted({str(x.dtype) for x in leaves}), device=device)


def _vm_kb(field: str) -> int:
  """A field of /proc/self/status in kB: VmHWM is this process's peak RSS (unlike ru_maxrss,
  which a child inherits from the process that started it)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  mode = ap.add_mutually_exclusive_group(required=True)
  mode.add_argument("--gpu", action="store_true", help="Qwen3-8B shapes (run on the GPU host)")
  mode.add_argument("--smoke", action="store_true", help="tiny dims on any machine (not results)")
  mode.add_argument("--load-once", metavar="DIR", help=argparse.SUPPRESS)   # the child process
  ap.add_argument("--folder", default=None,
                  help="checkpoint folder (written if it holds no config.json; default: a "
                       "temporary folder, removed at exit)")
  ap.add_argument("--layers", type=int, default=None, help="target layers (default: 36; smoke 4)")
  ap.add_argument("--shard-gb", type=float, default=4.0, help="largest shard, GB (1e9 bytes)")
  ap.add_argument("--repeat", type=int, default=2, help="loads, each in a fresh process")
  ap.add_argument("--out", default=None, help="also write the results as JSON here")
  args = ap.parse_args(argv)
  if args.load_once:
    print(json.dumps(load_once(args.load_once)))
    return 0
  layers = args.layers or (4 if args.smoke else 36)
  cfg = _config(args.smoke, layers)
  shard_bytes = int(args.shard_gb * 1e9) if not args.smoke else 1 << 20
  folder = args.folder or tempfile.mkdtemp(prefix="dflash_load_target_")
  try:
    if not os.path.isfile(os.path.join(folder, "config.json")):
      t0 = time.perf_counter()
      nbytes = write_folder(folder, cfg, shard_bytes)
      print(f"wrote {folder}: {nbytes / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")
    shards = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors")]
    total = sum(os.path.getsize(f) for f in shards)
    largest = max(os.path.getsize(f) for f in shards)
    print(f"checkpoint: {len(shards)} shards, {total / 1e9:.2f} GB, largest "
          f"{largest / 1e9:.2f} GB")
    runs = []
    for i in range(args.repeat):
      out = subprocess.run([sys.executable, "-m", "benchmarks.load_target", "--load-once",
                            folder], capture_output=True, text=True, check=True)
      r = json.loads(out.stdout.strip().splitlines()[-1])
      runs.append(r)
      print(f"load {i + 1}: {r['seconds']:.2f} s ({total / 1e9 / r['seconds']:.2f} GB/s), "
            f"peak RSS {r['peak_rss'] / 1e9:.2f} GB ({r['rss_before'] / 1e9:.2f} GB before "
            f"the load; largest shard {largest / 1e9:.2f} GB), params "
            f"{r['param_bytes'] / 1e9:.2f} GB {r['dtypes']} on {r['device']}")
    if args.out:
      from dflash_jax.io import atomic
      atomic.write_json(args.out, dict(folder=folder, shards=len(shards), bytes=total,
                                       largest_shard=largest, layers=layers, smoke=args.smoke,
                                       runs=runs))
  finally:
    if args.folder is None:
      shutil.rmtree(folder, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
