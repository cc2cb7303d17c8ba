"""Target features cached to disk: npy shards of [rows, T, F] plus a manifest.

The train step takes features either online (the frozen target runs inside the step) or as
an array; this module is the second source for targets too large to run beside the drafter:
compute the features once (`write_feature_shards`), then read each batch's rows back
(`FeatureShards.rows`). Shards are written whole under a temporary name and renamed, the
manifest last, so a folder with a manifest is complete.
"""
from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.io import atomic
from dflash_jax.models import qwen3
from dflash_jax.train.data import map_batches
from dflash_jax.train.trainer import target_features

MANIFEST = "features.json"
DTYPES = ("float32", "float16")


_features = jax.jit(target_features, static_argnames=("target_cfg", "capture_layers"))


def _save_npy(path: str, a: np.ndarray) -> None:
  with atomic.replacing(path) as tmp, open(tmp, "wb") as f:
    np.save(f, a)


def write_feature_shards(folder: str, target: qwen3.TargetParams, tcfg: qwen3.TargetConfig,
                         capture_layers: tuple[int, ...], tokens: np.ndarray, *,
                         batch_size: int = 64, shard_rows: int = 1024,
                         dtype: str = "float32", stop_at: float | None = None,
                         progress=None) -> dict:
  """Compute the target's features of tokens [N, T] (capture_layers, as the drafter's
  target_layers) batch_size rows at a time and store them as shards of shard_rows rows in
  `dtype` (float32, or float16: half the bytes; a value beyond float16's range is an error
  naming the shard). Returns the manifest. stop_at (a time.perf_counter() value) ends it early
  with the rows done by then (at least one batch; `data.map_batches`): the manifest's n_rows
  says how many (the first n_rows of tokens). progress: as map_batches' (rows of all tokens)."""
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
  capture_layers = tcfg.check_capture_layers(capture_layers)
  tokens = np.asarray(tokens, np.int32)
  n, t = tokens.shape
  os.makedirs(folder, exist_ok=True)
  shards, done = [], 0
  for s0 in range(0, n, shard_rows):
    if shards and stop_at is not None and time.perf_counter() >= stop_at:
      break
    report = None if progress is None else (lambda d, _, sec: progress(s0 + d, n, sec))
    feats = map_batches(lambda b: _features(target, tcfg, capture_layers, jnp.asarray(b)),
                        tokens[s0:s0 + shard_rows], batch_size, stop_at=stop_at,
                        progress=report)
    name = f"features-{len(shards):05d}.npy"
    if dtype == "float16":
      big = np.abs(feats).max()
      if not big < np.finfo(np.float16).max:
        raise ValueError(f"{os.path.join(folder, name)}: |feature| {big:.3g} does not fit "
                         "float16; use dtype float32")
    _save_npy(os.path.join(folder, name), feats.astype(dtype))
    shards.append(dict(file=name, rows=int(feats.shape[0])))
    done += int(feats.shape[0])
    if feats.shape[0] < min(shard_rows, n - s0):   # stopped inside the shard
      break
  manifest = dict(n_rows=done, seq_len=t, width=len(capture_layers) * tcfg.hidden_size,
                  dtype=dtype, shard_rows=shard_rows, capture_layers=list(capture_layers),
                  shards=shards)
  atomic.write_json(os.path.join(folder, MANIFEST), manifest)
  return manifest


class FeatureShards:
  """Read side of `write_feature_shards`: rows(indices) -> float32 [len, T, F], memory-mapped.

  Checks the manifest against the shards' shapes and the expected capture layers on open."""

  def __init__(self, folder: str, capture_layers: tuple[int, ...] | None = None):
    path = os.path.join(folder, MANIFEST)
    try:
      with open(path) as f:
        m = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise ValueError(f"{path}: no readable feature manifest ({e})") from e
    if capture_layers is not None and tuple(m["capture_layers"]) != tuple(capture_layers):
      raise ValueError(f"{path}: features of target layers {tuple(m['capture_layers'])}, the "
                       f"drafter needs {tuple(capture_layers)}")
    self.manifest = m
    self._shards = []
    for s in m["shards"]:
      f = os.path.join(folder, s["file"])
      try:
        a = np.load(f, mmap_mode="r")
      except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"{f}: not a readable npy shard ({e})") from e
      if a.shape != (s["rows"], m["seq_len"], m["width"]) or a.dtype != np.dtype(m["dtype"]):
        raise ValueError(f"{f}: {a.dtype}{list(a.shape)}, the "
                         f"manifest says {m['dtype']}[{s['rows']}, {m['seq_len']}, {m['width']}]")
      self._shards.append(a)
    if sum(s.shape[0] for s in self._shards) != m["n_rows"]:
      raise ValueError(f"{path}: shards hold {sum(s.shape[0] for s in self._shards)} rows, "
                       f"the manifest says {m['n_rows']}")

  @property
  def n_rows(self) -> int:
    return int(self.manifest["n_rows"])

  def rows(self, indices) -> np.ndarray:
    idx = np.asarray(indices, np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= self.n_rows):
      raise ValueError(f"feature rows {idx.min()}..{idx.max()} outside [0, {self.n_rows})")
    per = self.manifest["shard_rows"]
    return np.stack([self._shards[i // per][i % per] for i in idx.tolist()]).astype(np.float32)
