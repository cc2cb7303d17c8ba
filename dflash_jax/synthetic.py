"""Random drafters for demos, tests and benchmarks (the embedded default)."""
from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dflash_jax.config import DFlashConfig, drafter_tensor_shapes
from dflash_jax.quant import host_pool

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
  Norm weights are 1 + 0.1 N(0, 1), stored raw as in the GGUF. The family tensors (their
  target-vocab-sized tables have `n_vocab` rows too) are scaled so that each addition moves
  the drafts without swamping the backbone; see `_family_tensor`.
  """
  if with_target and cfg.mask_token_id >= n_vocab:
    raise ValueError(f"mask_token_id {cfg.mask_token_id} does not fit n_vocab {n_vocab}")
  if cfg.family == "dflash2" and cfg.dflash2.selector_top_k > n_vocab:
    raise ValueError(f"selector_top_k {cfg.dflash2.selector_top_k} exceeds n_vocab {n_vocab}")
  shapes = dict(drafter_tensor_shapes(cfg, n_vocab))
  family = set(shapes) - set(drafter_tensor_shapes(dataclasses.replace(
      cfg, family="dflash", family_fields=None)))
  if with_target:
    shapes.update(tok_embd=(n_vocab, cfg.n_embd), lm_head=(n_vocab, cfg.n_embd))
  branch = 1.0 / np.sqrt(2.0 * cfg.n_layer)
  w = {}
  with host_pool() as pool:
    for name, shape in shapes.items():
      seq = np.random.SeedSequence([seed, *name.encode()])
      if name in family:
        w[name] = _family_tensor(pool, seq, name, shape)
      elif len(shape) == 1:
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


def _family_tensor(pool: ThreadPoolExecutor, seq: np.random.SeedSequence, name: str,
                   shape: tuple[int, ...]) -> np.ndarray:
  """One DFlash2 / DSpark tensor.

  Convolution base kernels are near the identity (tap 0 about 1, later taps about 0.1) and
  the coefficient projections add about 0.1 per coefficient, so each convolution mixes the
  previous rows in without blowing up the residual stream. The selector codebooks are
  N(0, R^-1/2), so an edge score (a sum of R products with an O(1) hidden projection) is about
  N(0, 1): comparable to the gaps between the top logits. W1 rows are O(1) like an embedding and
  W2 is N(0, 1/R), so the Markov correction is about N(0, 1) per token. Biases are N(0, 0.01).
  """
  if name.endswith(".bias"):
    return _normal(pool, seq, shape, 0.1)
  if name.endswith("_conv_base"):
    base = _normal(pool, seq, shape, 0.1)
    base[:, 0] += 1.0
    return base
  if name.endswith("_conv_proj"):
    return _normal(pool, seq, shape, 0.1 / np.sqrt(shape[1]))
  if name in ("selector_predecessor", "selector_successor"):
    return _normal(pool, seq, shape, shape[1] ** -0.25)
  if name == "markov_w1":
    return _normal(pool, seq, shape)
  return _normal(pool, seq, shape, 1.0 / np.sqrt(shape[1]))   # the remaining projections


def synthetic_features(cfg: DFlashConfig, n_rows: int, seed: int = 1) -> np.ndarray:
  """Random target features [n_rows, n_target_layers * n_embd] with unit-variance entries."""
  with host_pool() as pool:
    return _normal(pool, np.random.SeedSequence(seed), (n_rows, cfg.n_embd_fc))
