"""HF / z-lab DFlash drafter checkpoints (docs/SPEC.md section 8): config.json plus safetensors.

The folder layout is the one z-lab's and SpecForge's `DFlashDraftModel.save_pretrained` write:
tensors `fc`, `hidden_norm`, `norm` and `layers.i.*` (no `model.` prefix, no embedding or LM
head), usually bf16, and a Qwen3-style `config.json` with a `dflash_config`. Loading returns
the same `(cfg, weights)` pair as the GGUF loader; every deviation fails at load time with an
error naming the file and the tensor or key.
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping

import numpy as np

from dflash_jax.config import (DEFAULT_BLOCK_SIZE, FULL, LAYER_TYPES, SLIDING, DFlashConfig,
                               RopeScaling, drafter_tensor_shapes, rope_from_hf)
from dflash_jax.io import atomic
from dflash_jax.io import safetensors as safetensors_io
from dflash_jax.io.errors import (DrafterFormatError, SafetensorsFormatError,
                                  checked_drafter_weights)
from dflash_jax.io.errors import drafter_error as _fail

CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 4 << 20
SAVE_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}  # -> config "dtype"
STORED_DTYPES = ("F32", "F16", "BF16")
# transformers' Qwen3Config default: without `layer_types`, layer i slides only when
# use_sliding_window, sliding_window and i >= max_window_layers.
QWEN3_MAX_WINDOW_LAYERS = 28
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"fc": "fc", "enc.output_norm": "hidden_norm", "output_norm": "norm"}
_MISSING = object()


def hf_tensor_names(cfg: DFlashConfig) -> dict[str, str]:
  """Weights-dict key (as `load_drafter` returns it) -> HF tensor name, for every tensor."""
  names = {}
  for key in drafter_tensor_shapes(cfg):
    if key.startswith("blk."):
      _, layer, suffix = key.split(".", 2)
      names[key] = f"layers.{layer}.{_LAYER_NAMES[suffix]}.weight"
    else:
      names[key] = _GLOBAL_NAMES[key] + ".weight"
  return names


def checkpoint_folder(path: str | os.PathLike) -> str | None:
  """The HF checkpoint folder `path` names (the folder itself, or its config.json,
  a .safetensors file or the index in it), or None when `path` names something else."""
  path = os.fspath(path)
  if os.path.isdir(path):
    return path
  base = os.path.basename(path)
  if base == CONFIG_FILE or base.endswith((".safetensors", ".safetensors.index.json")):
    return os.path.dirname(path) or "."
  return None


# ---------------------------------------------------------------------------------------------
# config.json


def config_from_hf(config: Mapping[str, Any] | str | os.PathLike) -> DFlashConfig:
  """DFlashConfig from a z-lab / SpecForge / DeepSpec `config.json` (a dict or a path).

  HF `target_layer_ids` name the layer whose *output* is captured; llama.cpp (and this
  library) store the index of the layer whose *input* is captured, i.e. ids + 1.
  `target_layer_ids`, `mask_token_id` and `block_size` are read from `dflash_config` or the top
  level (DeepSpec's files); present in both, they must agree. Attention kinds follow
  transformers' Qwen3Config: `layer_types` (any mix of sliding and full layers) with
  `sliding_window`; without `layer_types`, its `use_sliding_window` / `max_window_layers` rule.
  `max_position_embeddings` becomes `context_length`. The rope: `rope_theta` and its scaling
  (none, linear, llama3, yarn) from `rope_scaling` / `rope_parameters` (`config.rope_from_hf`).
  Raises DrafterFormatError naming the file (or "config.json" for a dict) and the key.
  """
  if isinstance(config, Mapping):
    where = CONFIG_FILE
  else:
    where = os.fspath(config)
    config = _read_json(where)
  dflash = config.get("dflash_config")
  if dflash is None:
    dflash = {}
  elif not isinstance(dflash, Mapping):
    raise _fail(where, f"dflash_config is {type(dflash).__name__}, expected an object")
  ids = _pick(config, dflash, "target_layer_ids", where)
  if ids is None:
    raise _fail(where, "no dflash_config.target_layer_ids (nor top-level target_layer_ids): "
                "not a DFlash drafter config")
  if not isinstance(ids, list) or not ids or not all(_is_int(i) and i >= 0 for i in ids):
    raise _fail(where, f"target_layer_ids must be a non-empty list of ints >= 0, got {ids!r}")
  n_target = _pick(config, dflash, "num_target_layers", where)
  if n_target is not None:
    n_target = _int({"num_target_layers": n_target}, "num_target_layers", where)
    if max(ids) >= n_target:
      raise _fail(where, f"target_layer_ids {ids} name layer {max(ids)}, but num_target_layers "
                  f"is {n_target} (ids are 0-based)")
  mask = _pick(config, dflash, "mask_token_id", where)
  if mask is None:
    raise _fail(where, "missing key dflash_config.mask_token_id (nor top-level mask_token_id)")
  block = _pick(config, dflash, "block_size", where)
  _check_plain_qwen3(config, dflash, where)
  n_layer = _int(config, "num_hidden_layers", where)
  n_embd = _int(config, "hidden_size", where)
  n_head = _int(config, "num_attention_heads", where)
  head_dim = config.get("head_dim")
  if head_dim is None:
    if n_embd % n_head:
      raise _fail(where, f"no head_dim, and hidden_size {n_embd} is not a multiple of "
                  f"num_attention_heads {n_head}")
    head_dim = n_embd // n_head
  layer_types, window = _attention_kinds(config, n_layer, where)
  context = config.get("max_position_embeddings")
  theta, rope_scaling = _rope(config, where)
  fields = dict(
      n_layer=n_layer, n_embd=n_embd, n_ff=_int(config, "intermediate_size", where),
      n_head=n_head, n_head_kv=_int(config, "num_key_value_heads", where, default=n_head),
      head_dim=_int({"head_dim": head_dim}, "head_dim", where),
      rope_theta=theta, rope_scaling=rope_scaling, eps=_float(config, "rms_norm_eps", where),
      target_layers=tuple(i + 1 for i in ids),
      mask_token_id=_int({"mask_token_id": mask}, "mask_token_id", where),
      block_size=DEFAULT_BLOCK_SIZE if block is None else
      _int({"block_size": block}, "block_size", where),
      window=window, layer_types=layer_types,
      context_length=None if context is None else
      _int(config, "max_position_embeddings", where))
  try:
    return DFlashConfig(**fields)
  except ValueError as e:
    raise _fail(where, str(e)) from e


def config_to_hf(cfg: DFlashConfig, dtype: str = "bf16") -> dict[str, Any]:
  """The z-lab-style `config.json` dict for `cfg` (`config_from_hf` of it equals `cfg`).

  `dtype` ("f32", "f16", "bf16") is recorded as the checkpoint's dtype. A config with sliding
  layers needs a window (HF has no "caller's choice" spelling); ids are written as HF
  `target_layer_ids` = target_layers - 1, so target layer 0 cannot be written.
  """
  if dtype not in SAVE_DTYPES:
    raise ValueError(f"dtype must be one of {sorted(SAVE_DTYPES)}, got {dtype!r}")
  if SLIDING in cfg.kinds and cfg.window is None:
    raise ValueError("the config has sliding layers but no window; config.json needs "
                     "sliding_window: give the config one (dataclasses.replace(cfg, window=2048))")
  if min(cfg.target_layers) < 1:
    raise ValueError(f"target_layers {cfg.target_layers} include 0 (the embedding output), "
                     "which HF target_layer_ids (= target_layers - 1) cannot express")
  out: dict[str, Any] = {
      "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
      "hidden_size": cfg.n_embd, "intermediate_size": cfg.n_ff,
      "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
      "num_key_value_heads": cfg.n_head_kv, "head_dim": cfg.head_dim,
      "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": cfg.eps,
      "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling.to_hf(),
      "block_size": cfg.block_size,
      "dflash_config": {"target_layer_ids": [t - 1 for t in cfg.target_layers],
                        "mask_token_id": cfg.mask_token_id},
      "layer_types": list(cfg.kinds), "sliding_window": cfg.window,
      "use_sliding_window": cfg.window is not None, "tie_word_embeddings": False,
      "dtype": SAVE_DTYPES[dtype],
  }
  if cfg.context_length is not None:
    out["max_position_embeddings"] = cfg.context_length
  return out


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such config file")
  try:
    return safetensors_io.read_json_object(path, MAX_CONFIG_BYTES)
  except SafetensorsFormatError as e:
    raise DrafterFormatError(str(e)) from e


def _pick(config: Mapping[str, Any], dflash: Mapping[str, Any], key: str, where: str) -> Any:
  nested, top = dflash.get(key), config.get(key)
  if nested is not None and top is not None and nested != top:
    raise _fail(where, f"dflash_config.{key} = {nested!r} disagrees with top-level {key} = "
                f"{top!r}")
  return nested if nested is not None else top


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _int(config: Mapping[str, Any], key: str, where: str, default: Any = _MISSING) -> int:
  v = config.get(key)
  if v is None:
    if default is _MISSING:
      raise _fail(where, f"missing key {key!r} (expected an integer)")
    return default
  if not _is_int(v):
    raise _fail(where, f"{key} is {v!r}, expected an integer")
  return v


def _float(config: Mapping[str, Any], key: str, where: str) -> float:
  v = config.get(key)
  if v is None:
    raise _fail(where, f"missing key {key!r} (expected a number)")
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
    raise _fail(where, f"{key} is {v!r}, expected a finite number")
  return float(v)


def _check_plain_qwen3(config: Mapping[str, Any], dflash: Mapping[str, Any], where: str) -> None:
  """Refuses the variants whose tensors look like DFlash's but compute something else."""
  act = config.get("hidden_act", "silu")
  if act != "silu":
    raise _fail(where, f"hidden_act is {act!r}; DFlash drafters use silu")
  if config.get("attention_bias"):
    raise _fail(where, "attention_bias is true; DFlash drafters have no attention biases")
  for name, v in (("is_causal", config.get("is_causal")), ("dflash_config.causal",
                                                           dflash.get("causal"))):
    if v:
      raise _fail(where, f"{name} is true; the DFlash block attention is non-causal")


def _rope(config: Mapping[str, Any], where: str) -> tuple[float, RopeScaling]:
  """rope_theta and the rope scaling (`rope_from_hf`: top level, `rope_parameters` and
  `rope_scaling`, flat or keyed by layer type, all agreeing); DFlash ropes the full head_dim."""
  for key in ("rope_parameters", "rope_scaling"):
    params = config.get(key)
    if isinstance(params, Mapping):
      per_kind = [k for k in params if k in LAYER_TYPES]
      for name, sub in ([(f"{key}.{k}", params[k]) for k in per_kind] if per_kind
                        else [(key, params)]):
        if isinstance(sub, Mapping) and sub.get("partial_rotary_factor", 1.0) != 1.0:
          raise _fail(where, f"{name}.partial_rotary_factor is {sub['partial_rotary_factor']}; "
                      "DFlash ropes the full head_dim")
  try:
    theta, scaling = rope_from_hf(config, where)
  except ValueError as e:
    raise DrafterFormatError(str(e)) from None
  if theta is None:
    raise _fail(where, "missing key 'rope_theta' (nor rope_parameters.rope_theta)")
  return theta, scaling


def _attention_kinds(config: Mapping[str, Any], n_layer: int,
                     where: str) -> tuple[tuple[str, ...], int | None]:
  """(layer_types, window) as transformers' Qwen3Config resolves them."""
  use_swa = config.get("use_sliding_window")
  window = config.get("sliding_window")
  if window is not None and (not _is_int(window) or window <= 0):
    raise _fail(where, f"sliding_window is {window!r}, expected a positive integer or null")
  kinds = config.get("layer_types")
  if kinds is None:
    first = _int(config, "max_window_layers", where, default=QWEN3_MAX_WINDOW_LAYERS)
    slides = bool(use_swa) and window is not None
    kinds = [SLIDING if slides and i >= first else FULL for i in range(n_layer)]
  elif not isinstance(kinds, list) or len(kinds) != n_layer or not set(kinds) <= set(LAYER_TYPES):
    raise _fail(where, f"layer_types must list one of {LAYER_TYPES} per layer "
                f"(num_hidden_layers {n_layer}), got {kinds!r}")
  if SLIDING in kinds:
    if use_swa is False:
      raise _fail(where, "layer_types has sliding_attention layers but use_sliding_window is "
                  "false (transformers then drops sliding_window): the config contradicts itself")
    if window is None:
      raise _fail(where, "layer_types has sliding_attention layers but sliding_window is not set")
  elif use_swa is False:
    window = None   # transformers' Qwen3Config ignores sliding_window then
  return tuple(kinds), window


# ---------------------------------------------------------------------------------------------
# Checkpoint folders


def load_hf_drafter(path: str | os.PathLike) -> tuple[DFlashConfig, dict[str, np.ndarray]]:
  """Reads and validates an HF DFlash checkpoint folder (or its config.json / safetensors).

  Returns the config and a dict of writable, C-contiguous float32 arrays in (out, in) layout,
  keyed like `load_drafter`'s (fc, enc.output_norm, output_norm, blk.i.*). Tensors may be F32,
  F16 or BF16, in one file or sharded. Raises DrafterFormatError naming the file and the
  tensor or key: missing or extra tensors, wrong shapes or dtypes, missing config keys, a
  truncated or corrupt safetensors file, a folder that is not a drafter.
  """
  folder = checkpoint_folder(path)
  if folder is None:
    raise _fail(os.fspath(path), "not an HF checkpoint folder (nor its config.json or "
                "safetensors)")
  config_path = os.path.join(folder, CONFIG_FILE)
  if not os.path.isfile(config_path):
    if not os.path.exists(folder):
      raise FileNotFoundError(f"{folder}: no such checkpoint folder")
    raise _fail(folder, f"no {CONFIG_FILE}: not an HF drafter checkpoint folder")
  cfg = config_from_hf(config_path)
  names = hf_tensor_names(cfg)
  try:
    specs = safetensors_io.tensor_specs(folder)
  except FileNotFoundError as e:
    raise _fail(folder, f"{CONFIG_FILE} but no {safetensors_io.SINGLE_FILE} or "
                f"{safetensors_io.INDEX_FILE}") from e
  except SafetensorsFormatError as e:
    raise DrafterFormatError(str(e)) from e
  _check_specs(cfg, names, specs, folder, config_path)
  try:
    arrays = safetensors_io.read_tensors(folder, names=names.values())
  except SafetensorsFormatError as e:
    raise DrafterFormatError(str(e)) from e
  weights = {}
  for key, name in names.items():
    a = np.ascontiguousarray(arrays.pop(name), dtype=np.float32)
    if not np.isfinite(a).all():
      bad = np.argwhere(~np.isfinite(a))
      raise _fail(specs[name].file, f"tensor {name} has {len(bad)} non-finite values (first: "
                  f"{a[tuple(bad[0])]} at index {tuple(int(i) for i in bad[0])})")
    weights[key] = a
  return cfg, weights


def _check_specs(cfg: DFlashConfig, names: Mapping[str, str],
                 specs: Mapping[str, safetensors_io.TensorSpec], folder: str,
                 config_path: str) -> None:
  wanted = set(names.values())
  extra = sorted(set(specs) - wanted)
  if extra:
    hint = ""
    if all(n.startswith("model.") for n in specs):
      hint = " (every name has a 'model.' prefix; DFlash checkpoints have none, SPEC.md section 8)"
    raise _fail(folder, f"unknown tensors {extra[:8]}{' ...' if len(extra) > 8 else ''} in "
                f"{_files(specs, extra)}: a DFlash drafter with n_layer={cfg.n_layer} has only "
                f"{len(names)} tensors{hint}")
  missing = [n for n in names.values() if n not in specs]
  if missing:
    raise _fail(folder, f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                f"(expected by {CONFIG_FILE}: n_layer={cfg.n_layer})")
  shapes = drafter_tensor_shapes(cfg)
  for key, name in names.items():
    spec = specs[name]
    if spec.dtype not in STORED_DTYPES:
      raise _fail(spec.file, f"tensor {name} is {spec.dtype}; drafter tensors must be one of "
                  f"{STORED_DTYPES}")
    if spec.shape != shapes[key]:
      raise _fail(spec.file, f"tensor {name} has shape {spec.shape}, expected {shapes[key]} "
                  f"from {config_path}")


def _files(specs: Mapping[str, safetensors_io.TensorSpec], names: list[str]) -> str:
  return ", ".join(sorted({os.path.basename(specs[n].file) for n in names}))


def save_hf_drafter(folder: str | os.PathLike, cfg: DFlashConfig, w: Mapping[str, np.ndarray],
                    dtype: str = "bf16", max_shard_bytes: int | None = None) -> str:
  """Writes an HF DFlash checkpoint folder (config.json + safetensors) and returns its path.

  Matrices are stored as `dtype` ("f32", "f16" or "bf16", rounded to nearest even); 1-D norm
  weights stay F32, as in the GGUF convention, so GGUF <-> HF conversions are exact where the
  matrix types agree. The target's `tok_embd` / `lm_head` in `w` are not written. `w` and
  `cfg` are fully validated and encoded before anything touches the disk; each file appears
  only complete (temp name + rename), config.json last.
  """
  folder = os.fspath(folder)
  where = f"save_hf_drafter({folder})"
  if dtype not in SAVE_DTYPES:
    raise ValueError(f"dtype must be one of {sorted(SAVE_DTYPES)}, got {dtype!r}")
  if not isinstance(cfg, DFlashConfig):
    raise TypeError(f"cfg must be a DFlashConfig, got {type(cfg).__name__}")
  if os.path.exists(folder) and not os.path.isdir(folder):
    raise _fail(where, "exists and is not a folder")
  try:
    config = config_to_hf(cfg, dtype)
  except ValueError as e:
    raise _fail(where, str(e)) from e
  names = hf_tensor_names(cfg)
  tensors = {}
  for key, a in checked_drafter_weights(cfg, w, where).items():
    try:
      tensors[names[key]] = a if a.ndim == 1 else safetensors_io.cast(names[key], a, dtype)
    except ValueError as e:
      raise _fail(where, str(e)) from e
  safetensors_io.write_tensors(folder, tensors, dtype=None, max_shard_bytes=max_shard_bytes)
  atomic.write_json(os.path.join(folder, CONFIG_FILE), config)
  return folder
