"""Target models: the LLMs that DFlash drafts for (functional JAX, params as pytrees).

One module per target family (`qwen3`: Qwen3 and Llama-3; `muse_glimmer`; `qwen3_moe`;
`qwen3_5`: the Gated DeltaNet hybrids); each implements the `Target`
protocol of `base` and the HF interface that `load_target` / `save_target` use:
`MODEL_TYPES`, `config_from_hf(config, where)`, `Config.to_hf()`, `hf_tensor_shapes(cfg)`,
`hf_optional(cfg)`, `hf_ignored(name)`, `params_from_hf(cfg, tensors, dtype)`,
`params_to_hf(cfg, params)`. `FAMILIES` lists the modules; the HF `model_type` in a folder's
config.json picks one. `params_from_hf` takes the entries out of the dict it is given as it
uses them, so the device holds each stored piece only until its fused / cast form exists.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, Iterator, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.io import atomic
from dflash_jax.io import safetensors as st
from dflash_jax.io.errors import SafetensorsFormatError, TargetFormatError
from dflash_jax.models import muse_glimmer, qwen3, qwen3_5, qwen3_moe
from dflash_jax.dispatch import resolve_dtype

__all__ = ["FAMILIES", "TargetFormatError", "family", "load_target", "read_target_config",
           "save_target"]

FAMILIES: tuple[ModuleType, ...] = (qwen3, muse_glimmer, qwen3_moe, qwen3_5)
CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 4 << 20
STORED_DTYPES = ("F32", "F16", "BF16")
SAVE_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}   # -> torch_dtype
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.MODEL_TYPES}
T = TypeVar("T")


def family(model_type: Any, where: str) -> ModuleType:
  """The family module that reads HF `model_type`; ValueError naming `where` otherwise."""
  if model_type not in _BY_MODEL_TYPE:
    raise ValueError(f"{where}: model_type {model_type!r} is not supported "
                     f"(supported: {sorted(_BY_MODEL_TYPE)})")
  return _BY_MODEL_TYPE[model_type]


def read_target_config(folder: str | os.PathLike) -> Any:
  """The config of an HF target folder (its config.json, read by the family its model_type
  names). FileNotFoundError without the folder; TargetFormatError naming the file and key."""
  return _read_config(os.fspath(folder))[1]


def _read_config(folder: str) -> tuple[ModuleType, Any, str]:
  """(family module, config, HF model_type) of a target folder."""
  if not os.path.isdir(folder):
    raise FileNotFoundError(f"{folder}: no such model folder")
  where = os.path.join(folder, CONFIG_FILE)
  if not os.path.isfile(where):
    raise TargetFormatError(f"{folder}: no {CONFIG_FILE}: not an HF model folder")
  try:
    config = st.read_json_object(where, MAX_CONFIG_BYTES)
    fam = family(config.get("model_type"), where)
    return fam, fam.config_from_hf(config, where), config["model_type"]
  except (SafetensorsFormatError, ValueError) as e:
    raise TargetFormatError(str(e)) from None


def load_target(folder: str | os.PathLike, dtype: Any = None) -> tuple[Any, Any]:
  """An HF target folder (config.json + safetensors, single or sharded) -> (config, device
  params) of the family its model_type names.

  dtype: the device weight dtype ("fp32" / "bf16"); None = bf16 when the checkpoint's matrices
  are all stored BF16, else fp32. Every check on the headers runs before any tensor data is
  read: missing or unknown tensors, shapes, stored dtypes (F32, F16, BF16). Then the tensors go
  to the device one at a time, shard by shard, in their stored dtype (the host holds about one
  tensor; casts and fusions run on the device in the family's `params_from_hf`), and their
  values are checked there (NaN / Inf). Errors (TargetFormatError) name the file and the
  tensor or config key.
  """
  folder = os.fspath(folder)
  if dtype is not None:
    resolve_dtype(dtype)   # a bad argument fails before any file is read
  fam, cfg, model_type = _read_config(folder)
  config_path = os.path.join(folder, CONFIG_FILE)
  try:
    specs = st.tensor_specs(folder)
  except FileNotFoundError as e:
    raise TargetFormatError(f"{folder}: no {st.SINGLE_FILE} or {st.INDEX_FILE}") from e
  except SafetensorsFormatError as e:
    raise TargetFormatError(str(e)) from e
  shapes, optional = fam.hf_tensor_shapes(cfg), fam.hf_optional(cfg)
  extra = sorted(n for n in set(specs) - set(shapes) - optional if not fam.hf_ignored(n))
  if extra:
    raise TargetFormatError(f"{folder}: unknown tensors {extra[:8]}{' ...' * (len(extra) > 8)} "
                            f"for a {cfg.n_layers}-layer {model_type} model ({config_path})")
  missing = [n for n in shapes if n not in specs]
  if missing:
    raise TargetFormatError(f"{folder}: missing tensors {missing[:8]}"
                            f"{' ...' * (len(missing) > 8)} (expected by {config_path})")
  wanted = list(shapes) + sorted(optional & set(specs))
  for name in wanted:
    spec = specs[name]
    if spec.dtype not in STORED_DTYPES:
      raise TargetFormatError(f"{spec.file}: tensor {name} is {spec.dtype}, not one of "
                              f"{STORED_DTYPES}")
    if name in shapes and spec.shape != shapes[name]:
      raise TargetFormatError(f"{spec.file}: tensor {name} has shape {spec.shape}, expected "
                              f"{shapes[name]} from {config_path}")
  if dtype is None:
    matrices = [specs[n].dtype for n in shapes if len(shapes[n]) > 1]
    dtype = "bf16" if matrices and all(d == "BF16" for d in matrices) else "fp32"
  tensors, finite = {}, {}
  try:
    for name, a in _read_ahead(st.iter_tensors(specs, wanted, folder)):
      tensors[name] = jax.device_put(a)
      finite[name] = _all_finite(tensors[name])   # on the device; read once, below
      del a
  except SafetensorsFormatError as e:
    raise TargetFormatError(str(e)) from e
  for name, ok in zip(finite, jax.device_get(list(finite.values()))):
    if not ok:
      raise TargetFormatError(f"{specs[name].file}: tensor {name} holds NaN or Inf")
  try:
    return cfg, fam.params_from_hf(cfg, tensors, dtype)   # takes the tensors out as it goes
  except ValueError as e:
    raise TargetFormatError(f"{folder}: {e}") from e


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
  return jnp.isfinite(x).all()


def _read_ahead(items: Iterator[T]) -> Iterator[T]:
  """items, with the next one read on a thread while the caller handles the current one (file
  reads overlap the transfers to the device; the host holds at most two tensors)."""
  with ThreadPoolExecutor(1) as pool:
    ahead = pool.submit(next, items, None)
    while (item := ahead.result()) is not None:
      ahead = pool.submit(next, items, None)
      yield item


def save_target(folder: str | os.PathLike, cfg: Any, params: Any, dtype: str = "bf16",
                max_shard_bytes: int | None = None) -> str:
  """Write an HF folder (config.json + safetensors) that `load_target` and transformers read.

  Every tensor is stored as dtype ("f32", "f16", "bf16"; rounded to nearest even), as HF
  checkpoints store them; shards hold at most max_shard_bytes (None: one file). Each file
  appears only complete; config.json is written last.
  """
  folder = os.fspath(folder)
  if dtype not in SAVE_DTYPES:
    raise ValueError(f"dtype must be one of {sorted(SAVE_DTYPES)}, got {dtype!r}")
  if os.path.exists(folder) and not os.path.isdir(folder):
    raise ValueError(f"{folder}: exists and is not a folder")
  config = cfg.to_hf()
  fam = family(config.get("model_type"), f"{type(cfg).__name__}.to_hf()")
  tensors: dict[str, np.ndarray] = fam.params_to_hf(cfg, params)
  st.write_tensors(folder, tensors, dtype=dtype, max_shard_bytes=max_shard_bytes)
  config["torch_dtype"] = SAVE_DTYPES[dtype]
  atomic.write_json(os.path.join(folder, CONFIG_FILE), config)
  return folder
