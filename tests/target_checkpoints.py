"""Random HF checkpoints of the target families for the tests, and their loading through
`models.load_target` (which picks the family by the folder's model_type)."""
from __future__ import annotations

import json
import os

import jax
import numpy as np

from dflash_jax import models
from dflash_jax.io import atomic
from dflash_jax.io import safetensors as safetensors_io


def random_tensors(shapes: dict, seed: int, centered=lambda name: False) -> dict:
  """float32 host tensors of the given (out, in) shapes: matrices N(0, 1/in), the embedding
  N(0, 1); vectors (norm weights) 1 + 0.1 N(0, 1), or 0.1 N(0, 1) where centered(name) (the
  w of a (1 + w) norm)."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, s in shapes.items():
    a = rng.standard_normal(s)
    if len(s) == 1:
      a = 0.1 * a + (0.0 if centered(name) else 1.0)
    elif "embed_tokens" not in name:
      a = a / np.sqrt(s[-1])
    out[name] = a.astype(np.float32)
  return out


def write(folder, config: dict, tensors: dict, dtype: str | None = None,
          max_shard_bytes: int | None = None) -> str:
  """config.json plus the tensors (single file, or shards past max_shard_bytes)."""
  folder = os.fspath(folder)
  safetensors_io.write_tensors(folder, tensors, dtype=dtype, max_shard_bytes=max_shard_bytes)
  atomic.write_json(os.path.join(folder, "config.json"), config)
  return folder


def load(family, folder, dtype=None):
  """(cfg, params) of a folder through `models.load_target`, checked to be of `family`."""
  cfg, params = models.load_target(folder, dtype or "fp32")
  assert type(cfg).__module__ == family.__name__, (type(cfg), family)
  return cfg, params


def bf16_cached_vs_reference(family, ref_hidden_states, cfg, centered, *, seed: int,
                             n_tokens: int, n_prefill: int, width: int, impl: str):
  """A random checkpoint stored bf16 and loaded as bf16 device params; one sequence of
  n_tokens prefilled (n_prefill rows) then verified `width` rows at a time (each committed
  whole, with impl's kernels) against the float64 reference on the same bf16 tensors.
  Returns (max |logit error| / std of the reference logits, the reference logits, the
  device logits)."""
  import ml_dtypes
  import jax.numpy as jnp
  t = random_tensors(family.hf_tensor_shapes(cfg), seed, centered)
  t16 = {n: a.astype(ml_dtypes.bfloat16) for n, a in t.items()}
  params = family.params_from_hf(cfg, {n: jax.device_put(a) for n, a in t16.items()}, "bf16")
  del t
  tokens = np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, n_tokens).astype(np.int32)
  _, ref = ref_hidden_states(cfg.to_hf(), {n: a.astype(np.float32) for n, a in t16.items()},
                             tokens)
  cache = cfg.init_cache(1, n_tokens + width, "bf16")
  prefill = jax.jit(lambda p, c, x, n: cfg.prefill(p, c, x, n, impl=impl))
  cache, _ = prefill(params, cache, jnp.asarray(tokens[None, :n_prefill]), jnp.int32(n_prefill))
  out = []
  verify = jax.jit(lambda p, c, x: cfg.verify(p, c, x, impl=impl))
  commit = jax.jit(cfg.commit)
  for at in range(n_prefill, n_tokens - width + 1, width):
    cache, logits, _ = verify(params, cache, jnp.asarray(tokens[None, at:at + width]))
    cache = commit(cache, jnp.full((1,), width, jnp.int32))
    out.append(np.asarray(logits[0]))
  got = np.concatenate(out)
  want = ref[n_prefill:n_prefill + len(got)]
  return float(np.abs(got - want).max() / want.std()), want, got
