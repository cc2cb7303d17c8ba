"""Random drafters for demos, tests and benchmarks (the embedded default)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dflash_jax.config import FULL, DFlashConfig
from dflash_jax.quant import host_pool

# The seed product's drafter (Muse Glimmer 30B assistant): 5 sliding layers, window 2048.
SEED_CONFIG = DFlashConfig(
    n_layer=5, n_embd=6656, n_ff=19968, n_head=32, n_head_kv=8, head_dim=128,
    rope_theta=5e5, eps=1e-6, target_layers=(2, 14, 26, 38, 50), mask_token_id=8191,
    block_size=16, window=2048)
# z-lab/Qwen3-8B-DFlash-b16 as its config.json publishes it (what `load_drafter` reads from
# that file; tests/test_hf_io.py holds the two equal): 5 full-attention layers (no sliding
# window), HF target_layer_ids [1, 9, 17, 25, 33] (target_layers = those + 1), mask token
# 151669, block 16, rope_theta 1e6, max_position_embeddings 40960 (the context length: the
# default capacity of its full-attention cache; pass `capacity` to hold fewer positions).
QWEN3_8B_CONFIG = DFlashConfig(
    n_layer=5, n_embd=4096, n_ff=12288, n_head=32, n_head_kv=8, head_dim=128,
    rope_theta=1e6, eps=1e-6, target_layers=(2, 10, 18, 26, 34), mask_token_id=151669,
    block_size=16, window=None, layer_types=(FULL,) * 5, context_length=40960)
# Small enough for CPU tests and interpret-mode kernels; every axis still > 1.
TINY_CONFIG = DFlashConfig(
    n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, head_dim=16,
    rope_theta=1e4, eps=1e-6, target_layers=(1, 3, 5), mask_token_id=7,
    block_size=8, window=32)


def drafter_tensor_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
  """The (out, in) numpy shape of every drafter tensor, keyed without `.weight`."""
  e, hd = cfg.n_embd, cfg.head_dim
  shapes = {"fc": (e, cfg.n_embd_fc), "enc.output_norm": (e,), "output_norm": (e,)}
  for i in range(cfg.n_layer):
    p = f"blk.{i}."
    shapes.update({
        p + "attn_norm": (e,),
        p + "attn_q": (cfg.n_head * hd, e),
        p + "attn_k": (cfg.n_head_kv * hd, e),
        p + "attn_v": (cfg.n_head_kv * hd, e),
        p + "attn_output": (e, cfg.n_head * hd),
        p + "attn_q_norm": (hd,),
        p + "attn_k_norm": (hd,),
        p + "ffn_norm": (e,),
        p + "ffn_gate": (cfg.n_ff, e),
        p + "ffn_up": (cfg.n_ff, e),
        p + "ffn_down": (e, cfg.n_ff),
    })
  return shapes


# Values per random stream. Every tensor is filled in chunks of this size, each from its own
# stream spawned from the seed, so that threads can fill them (numpy's generators release the
# GIL) and the values do not depend on how many threads there are. The seed drafter (2.4B
# values) takes 4.6 s on the H200 machine's 16 cores, 51.5 s from one stream (RESULTS.md run 26).
_CHUNK = 1 << 22


def _normal(pool: ThreadPoolExecutor, seq: np.random.SeedSequence, shape: tuple[int, ...],
            scale: float = 1.0) -> np.ndarray:
  """float32 N(0, scale^2) of `shape`, chunked as described at _CHUNK."""
  out = np.empty(shape, np.float32)
  flat = out.reshape(-1)
  starts = range(0, flat.size, _CHUNK)

  def fill(start_seq):
    start, chunk_seq = start_seq
    part = flat[start:start + _CHUNK]
    np.random.default_rng(chunk_seq).standard_normal(out=part, dtype=np.float32)
    part *= np.float32(scale)

  chunks = list(zip(starts, seq.spawn(len(starts))))
  if len(chunks) == 1:      # no thread for a small tensor
    fill(chunks[0])
  else:
    list(pool.map(fill, chunks))
  return out


def synthetic_drafter(cfg: DFlashConfig, seed: int = 0, n_vocab: int = 512,
                      with_target: bool = True) -> dict[str, np.ndarray]:
  """Random float32 drafter weights (plus the target's `tok_embd`/`lm_head` of `n_vocab` rows).

  Matrices are N(0, 1/fan_in); the residual branches (attn_output, ffn_down) are further
  scaled by 1/sqrt(2 n_layer), so activations stay O(1) through every layer at any size.
  Norm weights are 1 + 0.1 N(0, 1), stored raw as in the GGUF.
  """
  if with_target and cfg.mask_token_id >= n_vocab:
    raise ValueError(f"mask_token_id {cfg.mask_token_id} does not fit n_vocab {n_vocab}")
  shapes = dict(drafter_tensor_shapes(cfg))
  if with_target:
    shapes.update(tok_embd=(n_vocab, cfg.n_embd), lm_head=(n_vocab, cfg.n_embd))
  branch = 1.0 / np.sqrt(2.0 * cfg.n_layer)
  w = {}
  with host_pool() as pool:
    for name, shape in shapes.items():
      seq = np.random.SeedSequence([seed, *name.encode()])
      if len(shape) == 1:
        w[name] = 1.0 + _normal(pool, seq, shape, 0.1)
      elif name == "tok_embd":
        w[name] = _normal(pool, seq, shape)
      elif name == "lm_head":
        w[name] = _normal(pool, seq, shape, 4.0 / np.sqrt(cfg.n_embd))
      else:
        scale = 1.0 / np.sqrt(shape[1])
        if name.endswith(("attn_output", "ffn_down")):
          scale *= branch
        w[name] = _normal(pool, seq, shape, scale)
  return w


def synthetic_features(cfg: DFlashConfig, n_rows: int, seed: int = 1) -> np.ndarray:
  """Random target features [n_rows, n_target_layers * n_embd] with unit-variance entries."""
  with host_pool() as pool:
    return _normal(pool, np.random.SeedSequence(seed), (n_rows, cfg.n_embd_fc))
