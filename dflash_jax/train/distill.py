"""Self-distillation data: the frozen target's own greedy continuations of corpus prompts.

A drafter is judged against the target's greedy choices, so the sequences it trains on can be
exactly those: `prompt + greedy continuation`, with the loss on the continuation only. The
first eligible anchor is then the last prompt token, as in the first round of decoding.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models import qwen3
from dflash_jax.train.data import map_batches


@functools.partial(jax.jit, static_argnames=("cfg", "n_new", "cache_dtype"))
def _generate(params: qwen3.TargetParams, cfg: qwen3.TargetConfig, prompts: jax.Array,
              n_new: int, cache_dtype: str) -> jax.Array:
  b, p = prompts.shape
  cache = qwen3.init_cache(cfg, b, p + n_new, cache_dtype)
  cache, _ = qwen3.prefill(params, cfg, cache, prompts[:, :-1], p - 1)

  def one(carry, _):
    cache, tok = carry
    cache, logits, _ = qwen3.verify(params, cfg, cache, tok[:, None])
    cache = qwen3.commit(cache, jnp.ones((b,), jnp.int32))
    nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    return (cache, nxt), nxt

  _, out = jax.lax.scan(one, (cache, prompts[:, -1].astype(jnp.int32)), None, length=n_new)
  return out.T


def greedy_continuations(params: qwen3.TargetParams, cfg: qwen3.TargetConfig,
                         prompts: np.ndarray, n_new: int, batch_size: int = 256,
                         cache_dtype: str = "fp32", *, stop_at: float | None = None,
                         progress=None) -> np.ndarray:
  """[N', n_new] int32: the target's greedy continuation of each prompt [N, P] (P >= 2; the
  argmax breaks ties to the lowest id), computed batch_size prompts at a time with the KV cache
  (prefill, then one verify per token inside one jitted scan). No early stop at EOS.
  N' = N unless stop_at (a time.perf_counter() value) ends it early: then the first N' prompts'
  continuations (`data.map_batches`, which also calls progress)."""
  prompts = np.asarray(prompts, np.int32)
  if prompts.ndim != 2 or prompts.shape[1] < 2:
    raise ValueError(f"prompts must be [N, P] with P >= 2, got {prompts.shape}")
  if n_new < 1:
    raise ValueError(f"n_new must be >= 1, got {n_new}")
  if prompts.shape[1] + n_new > cfg.max_position_embeddings:
    raise ValueError(f"prompt {prompts.shape[1]} + {n_new} new tokens exceed the target's "
                     f"max_position_embeddings {cfg.max_position_embeddings}")
  return map_batches(lambda b: _generate(params, cfg, jnp.asarray(b), n_new, cache_dtype),
                     prompts, batch_size, stop_at=stop_at, progress=progress)


def distill_sequences(prompts: np.ndarray, continuations: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [N, P + n], loss_mask [N, P + n]): prompt then continuation; the loss covers the
  continuation only."""
  tokens = np.concatenate([prompts, continuations], axis=1).astype(np.int32)
  mask = np.zeros(tokens.shape, bool)
  mask[:, prompts.shape[1]:] = True
  return tokens, mask
