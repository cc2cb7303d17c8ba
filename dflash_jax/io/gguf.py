"""Drafter GGUF files (docs/SPEC.md section 2, SPEC_dflash2_dspark 3.3 and 10.3): a loader that
fails loudly, an atomic saver, raw Q8_0.

llama.cpp's `dflash` architecture holds all three families, told apart by their tensors:
`selector_hidden.weight` makes a DFlash2 file (with its convolution and selector keys),
`markov_w1.weight` or `conf_proj.weight` a DSpark one; a file whose keys name a family its
tensors do not (or the reverse) is refused rather than guessed at.

Parsing, writing and (de)quantization are the `gguf` package's; this module adds the DFlash
conventions (keys, tensor names, shapes) and the checks that make a bad file fail at load time
instead of as a silent acceptance collapse later.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import gguf
import numpy as np

from dflash_jax.config import (DEFAULT_BLOCK_SIZE, FULL, SLIDING, DFlash2Fields, DFlashConfig,
                               DSparkFields, RopeScaling, drafter_tensor_shapes, gguf_tensor_name,
                               resolve_is_causal)
from dflash_jax.io import atomic
from dflash_jax.io.errors import (DrafterFormatError, GGUFFormatError, checked_drafter_weights,
                                  drafter_vocab, stored_target_copies)
from dflash_jax.io.errors import drafter_error as _fail
from dflash_jax.io.gguf_guard import open_gguf

ARCH = "dflash"
KEY_ARCH = "general.architecture"
KEY_VALUE_LENGTH = "dflash.attention.value_length"
KEY_TARGET_LAYERS = "dflash.target_layers"
KEY_BLOCK_SIZE = "dflash.block_size"
KEY_WINDOW = "dflash.attention.sliding_window"
KEY_SWA_PATTERN = "dflash.attention.sliding_window_pattern"  # bool per layer, true = sliding
KEY_CONTEXT = "dflash.context_length"
KEY_MASK = "tokenizer.ggml.mask_token_id"
KEY_MASK_OLD = "dflash.mask_token_id"  # PR-branch files
# Rope scaling: llama.cpp's keys (gguf.Keys.Rope) and its meaning of them, see _read_rope.
_ROPE_KEYS = gguf.Keys.Rope
KEY_ROPE_TYPE = _ROPE_KEYS.SCALING_TYPE.format(arch=ARCH)
KEY_ROPE_FACTOR = _ROPE_KEYS.SCALING_FACTOR.format(arch=ARCH)
KEY_ROPE_ORIG_CTX = _ROPE_KEYS.SCALING_ORIG_CTX_LEN.format(arch=ARCH)
KEY_ROPE_ATTN_FACTOR = _ROPE_KEYS.SCALING_ATTN_FACTOR.format(arch=ARCH)
KEY_YARN_BETA_FAST = _ROPE_KEYS.SCALING_YARN_BETA_FAST.format(arch=ARCH)
KEY_YARN_BETA_SLOW = _ROPE_KEYS.SCALING_YARN_BETA_SLOW.format(arch=ARCH)
KEY_YARN_LOG_MUL = _ROPE_KEYS.SCALING_YARN_LOG_MUL.format(arch=ARCH)
KEY_YARN_EXT_FACTOR = _ROPE_KEYS.SCALING_YARN_EXT_FACTOR.format(arch=ARCH)
KEY_YARN_ATTN_FACTOR = _ROPE_KEYS.SCALING_YARN_ATTN_FACTOR.format(arch=ARCH)
KEY_CAUSAL = "dflash.attention.causal"            # bool; absent = non-causal (llama.cpp)
# DFlash2 (SPEC_dflash2_dspark 3.3).
DFLASH2_INT_KEYS = {
    "conv_kernel_size": "dflash.conv_kernel_size",
    "conv_group_size": "dflash.conv_group_size",
    "selector_rank": "dflash.selector_rank",
    "selector_top_k": "dflash.selector_top_k",
}
KEY_LOGIT_SCALE = "dflash.logit_scale"            # the HF output_multiplier
KEY_SOFTCAP = "dflash.final_logit_softcapping"
# A fork's unverified key for input_embedding_scale; upstream llama.cpp has none (3.3).
KEY_EMBED_SCALE = "dflash.embedding_scale"
# DSpark (10.3).
KEY_ANCHOR = "dflash.sample_from_anchor"           # bool; absent = true
KEY_HAS_CONF = "dflash.has_confidence_head"        # bool; absent = the tensor decides
DFLASH2_MARK = "selector_hidden.weight"
DSPARK_MARKS = ("markov_w1.weight", "conf_proj.weight")
# DSpark's optional copies of the target's tensors, by llama.cpp's names.
COPY_NAMES = {"tok_embd": "token_embd.weight", "lm_head": "output.weight"}
# Required scalar keys, by DFlashConfig field.
INT_KEYS = {
    "n_layer": "dflash.block_count",
    "n_embd": "dflash.embedding_length",
    "n_ff": "dflash.feed_forward_length",
    "n_head": "dflash.attention.head_count",
    "n_head_kv": "dflash.attention.head_count_kv",
    "head_dim": "dflash.attention.key_length",
}
FLOAT_KEYS = {
    "rope_theta": "dflash.rope.freq_base",
    "eps": "dflash.attention.layer_norm_rms_epsilon",
}

_VT = gguf.GGUFValueType
_QT = gguf.GGMLQuantizationType
_INT_TYPES = frozenset({_VT.UINT8, _VT.INT8, _VT.UINT16, _VT.INT16, _VT.UINT32, _VT.INT32,
                        _VT.UINT64, _VT.INT64})
_FLOAT_TYPES = frozenset({_VT.FLOAT32, _VT.FLOAT64})
SAVE_TYPES = {"F32": _QT.F32, "F16": _QT.F16, "BF16": _QT.BF16, "Q8_0": _QT.Q8_0}
_FILE_TYPES = {_QT.F32: gguf.LlamaFileType.ALL_F32, _QT.F16: gguf.LlamaFileType.MOSTLY_F16,
               _QT.BF16: gguf.LlamaFileType.MOSTLY_BF16, _QT.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}
_Q8_0_BLOCK, _Q8_0_BYTES = gguf.GGML_QUANT_SIZES[_QT.Q8_0]
_REQUIRED = object()


# ---------------------------------------------------------------------------------------------
# Loading


def load_gguf_drafter(path: str | os.PathLike) -> tuple[DFlashConfig, dict[str, np.ndarray]]:
  """Reads and validates a drafter GGUF file.

  Returns the config and a dict of writable, C-contiguous float32 arrays in (out, in) layout,
  keyed by GGUF tensor name without `.weight`, dequantized from any type gguf can dequantize.
  Attention kinds as llama.cpp reads them: the sliding-window pattern when present, else every
  layer sliding when the file has a window and full attention when it has none. Raises
  DrafterFormatError (naming the file and the culprit) on any deviation.
  """
  path = os.fspath(path)
  reader = _open(path)
  cfg = _read_config(reader, path)
  tensors = _drafter_tensors(reader, cfg, path)
  return cfg, {name: _dequantize(t, path) for name, t in tensors.items()}


def read_q8_0(path: str | os.PathLike) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """The raw blocks of every matrix stored as Q8_0, without dequantizing.

  Returns name -> (qs int8 [out, in], d float32 [out, in // 32]); the weight is
  `d[:, j, None] * qs[:, 32 j : 32 (j + 1)]`. Checks the file like `load_gguf_drafter` except for
  NaN/Inf (that needs dequantizing); load the file with `load_gguf_drafter` for the full
  check.
  """
  path = os.fspath(path)
  reader = _open(path)
  cfg = _read_config(reader, path)
  out = {}
  for name, t in _drafter_tensors(reader, cfg, path).items():
    if t.tensor_type == _QT.Q8_0 and len(t.shape) == 2:
      blocks = np.asarray(t.data).reshape(t.data.shape[0], -1, _Q8_0_BYTES)
      d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
      qs = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(blocks.shape[0], -1)
      out[name] = (qs, d)
  return out


def _open(path: str) -> gguf.GGUFReader:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such drafter file")
  try:
    reader = open_gguf(path)   # every header count and offset checked before use
  except GGUFFormatError as e:
    raise DrafterFormatError(str(e)) from None
  arch = _get(reader, path, KEY_ARCH, {_VT.STRING}, "a string")
  if arch != ARCH:
    raise _fail(path, f"{KEY_ARCH} is {arch!r}, expected {ARCH!r}: not a DFlash drafter")
  return reader


def _type_name(field: Any) -> str:
  if field.types[0] == _VT.ARRAY:
    return "an array of " + (field.types[-1].name if len(field.types) > 1 else "nothing")
  return field.types[0].name


def _get(reader: gguf.GGUFReader, path: str, key: str, types: frozenset | set, expected: str,
         required: bool = True, array: bool = False) -> Any:
  """The value of `key`, checked against the allowed GGUF (element) types; None when absent."""
  field = reader.get_field(key)
  if field is None:
    if required:
      raise _fail(path, f"missing metadata key {key!r} (expected {expected})")
    return None
  if array:
    ok = field.types[0] == _VT.ARRAY and (len(field.types) == 1 or field.types[-1] in types)
  else:
    ok = field.types[0] in types
  if not ok:
    raise _fail(path, f"metadata key {key!r} is {_type_name(field)}, expected {expected}")
  return field.contents()


def _get_int(reader: gguf.GGUFReader, path: str, key: str, required: bool = True) -> int | None:
  v = _get(reader, path, key, _INT_TYPES, "an integer", required)
  return None if v is None else int(v)


def _get_float(reader: gguf.GGUFReader, path: str, key: str, default: Any = _REQUIRED) -> float:
  """The float at `key`; `default` when absent (required when no default is given)."""
  if default is not _REQUIRED and reader.get_field(key) is None:
    return default
  v = float(_get(reader, path, key, _FLOAT_TYPES, "a float (f32)"))
  # The file holds f32; take the shortest decimal that rounds to it (1e-6, not 9.99999997e-07),
  # so a saved config loads back equal and the f32 the kernels see is unchanged.
  return float(str(np.float32(v))) if reader.get_field(key).types[0] == _VT.FLOAT32 else v


def _read_mask_token(reader: gguf.GGUFReader, path: str) -> int:
  new = _get_int(reader, path, KEY_MASK, required=False)
  old = _get_int(reader, path, KEY_MASK_OLD, required=False)
  if new is None and old is None:
    raise _fail(path, f"missing metadata key {KEY_MASK!r} (or the older {KEY_MASK_OLD!r}), "
                "expected an integer")
  if new is not None and old is not None and new != old:
    raise _fail(path, f"{KEY_MASK!r} = {new} disagrees with {KEY_MASK_OLD!r} = {old}")
  return new if new is not None else old


def _read_config(reader: gguf.GGUFReader, path: str) -> DFlashConfig:
  fields: dict[str, Any] = {f: _get_int(reader, path, k) for f, k in INT_KEYS.items()}
  if fields["n_layer"] > len(reader.tensors):   # before anything of n_layer entries is built
    raise _fail(path, f"{INT_KEYS['n_layer']!r} = {fields['n_layer']}, but the file holds only "
                f"{len(reader.tensors)} tensors (every layer has its own)")
  fields.update({f: _get_float(reader, path, k) for f, k in FLOAT_KEYS.items()})
  layers = _get(reader, path, KEY_TARGET_LAYERS, _INT_TYPES, "a non-empty int32 array",
                array=True)
  if not layers:
    raise _fail(path, f"metadata key {KEY_TARGET_LAYERS!r} is empty; the drafter needs at "
                "least one captured target layer")
  fields["target_layers"] = tuple(int(t) for t in layers)
  fields["mask_token_id"] = _read_mask_token(reader, path)
  block_size = _get_int(reader, path, KEY_BLOCK_SIZE, required=False)
  fields["block_size"] = DEFAULT_BLOCK_SIZE if block_size is None else block_size
  window = fields["window"] = _get_int(reader, path, KEY_WINDOW, required=False)
  fields["context_length"] = _get_int(reader, path, KEY_CONTEXT, required=False)
  pattern = _get(reader, path, KEY_SWA_PATTERN, {_VT.BOOL}, "a bool array (one per layer)",
                 required=False, array=True)
  if pattern is None:
    # docs/SPEC.md sections 2 and 7, as llama.cpp reads a file: a window and no pattern means
    # every layer slides; no window means every layer is full attention.
    pattern = [window is not None] * fields["n_layer"]
  elif len(pattern) != fields["n_layer"]:
    raise _fail(path, f"metadata key {KEY_SWA_PATTERN!r} has {len(pattern)} entries, but "
                f"{INT_KEYS['n_layer']!r} is {fields['n_layer']}")
  elif window is None and any(pattern):
    raise _fail(path, f"metadata key {KEY_SWA_PATTERN!r} marks layers "
                f"{[i for i, p in enumerate(pattern) if p]} sliding, but the file has no "
                f"{KEY_WINDOW!r} (their window)")
  fields["layer_types"] = tuple(SLIDING if p else FULL for p in pattern)
  fields["rope_scaling"] = _read_rope(reader, path, fields["context_length"])
  fields["family"], fields["family_fields"] = _read_family(reader, path, fields)
  try:
    cfg = DFlashConfig(**fields)
  except ValueError as e:
    raise _fail(path, str(e)) from e
  value_length = _get_int(reader, path, KEY_VALUE_LENGTH, required=False)
  if value_length is not None and value_length != cfg.head_dim:
    raise _fail(path, f"{KEY_VALUE_LENGTH!r} = {value_length} differs from "
                f"{INT_KEYS['head_dim']!r} = {cfg.head_dim}; DFlash needs them equal")
  return cfg


def _read_rope(reader: gguf.GGUFReader, path: str, context_length: int | None) -> RopeScaling:
  """The rope scaling as llama.cpp reads `dflash.rope.scaling.*`: type none (or absent),
  linear (factor) or yarn (factor; original_context_length, else the context length;
  yarn_beta_fast / yarn_beta_slow, default 32 / 1; the ramp always truncated). llama.cpp's
  YaRN attention factor is HF's default from the factor (with `yarn_log_multiplier` M:
  mscale 1 and mscale_all_dim M) times `attn_factor`. Keys llama.cpp's readers disagree on
  or that have no HF meaning are errors naming the key and the file."""
  kind = _get(reader, path, KEY_ROPE_TYPE, {_VT.STRING}, "a string", required=False)
  if kind is None or kind == "none":
    return RopeScaling()
  if kind not in ("linear", "yarn"):
    raise _fail(path, f"metadata key {KEY_ROPE_TYPE!r} is {kind!r}; supported: 'none', "
                "'linear', 'yarn' (llama.cpp's types that a drafter file can state; llama.cpp "
                "keeps llama3 scaling in a rope_freqs tensor)")
  factor = _get_float(reader, path, KEY_ROPE_FACTOR)
  attn = _get_float(reader, path, KEY_ROPE_ATTN_FACTOR, 1.0)
  try:
    if kind == "linear":
      if attn != 1.0:
        raise _fail(path, f"metadata key {KEY_ROPE_ATTN_FACTOR!r} = {attn} with linear "
                    "scaling: HF's linear rope has no attention factor")
      return RopeScaling("linear", factor=factor)
    for key, ok, why in (
        (KEY_YARN_EXT_FACTOR, (-1.0, 1.0), "llama.cpp's extrapolation mix other than 1 (HF's "
         "YaRN) is not supported"),
        (KEY_YARN_ATTN_FACTOR, (1.0,), "llama.cpp's converter writes HF's attention_factor "
         "here while its runtime ignores the key for YaRN, so the file's meaning is not "
         f"settled: state the factor relative to YaRN's default in {KEY_ROPE_ATTN_FACTOR!r}")):
      v = _get_float(reader, path, key, ok[0])
      if v not in ok:
        raise _fail(path, f"metadata key {key!r} = {v}: {why}")
    orig = _get_int(reader, path, KEY_ROPE_ORIG_CTX, required=False)
    orig = context_length if orig is None else orig
    if orig is None:
      raise _fail(path, f"YaRN scaling needs {KEY_ROPE_ORIG_CTX!r} (or {KEY_CONTEXT!r})")
    rope = RopeScaling("yarn", factor=factor, original_max_position_embeddings=orig,
                       beta_fast=_get_float(reader, path, KEY_YARN_BETA_FAST, 32.0),
                       beta_slow=_get_float(reader, path, KEY_YARN_BETA_SLOW, 1.0))
    log_mul = _get_float(reader, path, KEY_YARN_LOG_MUL, 0.0)
    if log_mul:
      rope = dataclasses.replace(rope, mscale=1.0, mscale_all_dim=log_mul)
    if attn != 1.0:
      # The product to float32 precision, as its shortest decimal (an HF factor such as 1.3
      # saved by _rope_keys loads back as 1.3).
      total = float(str(np.float32(rope.attention_scaling * attn)))
      rope = dataclasses.replace(rope, attention_factor=total, mscale=None, mscale_all_dim=None)
    return rope
  except ValueError as e:
    if isinstance(e, DrafterFormatError):
      raise
    raise _fail(path, f"rope scaling ({KEY_ROPE_TYPE!r} = {kind!r}): {e}") from None


def _rope_keys(cfg: DFlashConfig, where: str) -> list[tuple[str, Any, Any]]:
  """(key, value, GGUF type) of cfg's rope scaling as llama.cpp reads it (`_read_rope`); an
  error for what llama.cpp's keys cannot state."""
  s = cfg.rope_scaling
  if s.rope_type == "none":
    return []
  if s.rope_type == "llama3":
    raise _fail(where, "llama3 rope scaling has no GGUF metadata form (llama.cpp keeps it in a "
                "rope_freqs tensor, which a drafter file does not hold): save an HF folder")
  keys = [(KEY_ROPE_TYPE, s.rope_type, _VT.STRING), (KEY_ROPE_FACTOR, s.factor, _VT.FLOAT32)]
  if s.rope_type == "yarn":
    if not s.truncate:
      raise _fail(where, "YaRN with truncate=False has no GGUF key (llama.cpp always cuts the "
                  "ramp to whole dimensions): save an HF folder")
    keys += [(KEY_ROPE_ORIG_CTX, s.original_max_position_embeddings, _VT.UINT32),
             (KEY_YARN_BETA_FAST, s.beta_fast, _VT.FLOAT32),
             (KEY_YARN_BETA_SLOW, s.beta_slow, _VT.FLOAT32)]
    default = dataclasses.replace(s, attention_factor=None, mscale=None, mscale_all_dim=None)
    if s.attention_scaling != default.attention_scaling:
      # llama.cpp multiplies YaRN's default factor by this key (float32: the factor loads
      # back to float32 precision, `_read_rope`).
      keys.append((KEY_ROPE_ATTN_FACTOR, s.attention_scaling / default.attention_scaling,
                   _VT.FLOAT32))
  return keys
def _get_bool(reader: gguf.GGUFReader, path: str, key: str) -> bool | None:
  v = _get(reader, path, key, {_VT.BOOL}, "a bool", required=False)
  return None if v is None else bool(v)


def _read_family(reader: gguf.GGUFReader, path: str, fields: dict[str, Any]
                 ) -> tuple[str, DFlash2Fields | DSparkFields | None]:
  """(family, family_fields) from the file's tensors and keys (module docstring)."""
  tensors = {t.name: t for t in reader.tensors}
  dflash2 = DFLASH2_MARK in tensors
  dspark = [m for m in DSPARK_MARKS if m in tensors]
  d2_keys = [k for k in (*DFLASH2_INT_KEYS.values(), KEY_LOGIT_SCALE, KEY_SOFTCAP,
                         KEY_EMBED_SCALE) if reader.get_field(k) is not None]
  ds_keys = [k for k in (KEY_ANCHOR, KEY_HAS_CONF) if reader.get_field(k) is not None]
  if dflash2 and dspark:
    raise _fail(path, f"holds {DFLASH2_MARK!r} (DFlash2) and {dspark} (DSpark): one drafter "
                "file is one family")
  if not dflash2 and d2_keys:
    raise _fail(path, f"has DFlash2 metadata {d2_keys} but no tensor {DFLASH2_MARK!r}: llama.cpp "
                "would run it as a DFlash drafter without them")
  if not dspark and ds_keys:
    raise _fail(path, f"has DSpark metadata {ds_keys} but no tensor of {list(DSPARK_MARKS)}: "
                "llama.cpp would run it as a DFlash drafter")
  causal = _get_bool(reader, path, KEY_CAUSAL)
  if causal and not dflash2:
    raise _fail(path, f"{KEY_CAUSAL!r} is true, but only DFlash2 drafters have causal blocks")
  try:
    if dflash2:
      ints = {f: _get_int(reader, path, k) for f, k in DFLASH2_INT_KEYS.items()}
      if ints["selector_top_k"] == 0:
        raise _fail(path, f"{DFLASH2_INT_KEYS['selector_top_k']!r} is 0 with the selector's "
                    "tensors present: llama.cpp then skips the selector; a DFlash2 drafter "
                    "needs k > 0")
      scale = _get_optional_float(reader, path, KEY_EMBED_SCALE)
      if scale is not None and scale != 1.0:
        raise _fail(path, f"{KEY_EMBED_SCALE!r} = {scale}: upstream llama.cpp has no input "
                    "embedding scale and this fork key's meaning is unverified "
                    "(SPEC_dflash2_dspark 3.3); convert from the HF checkpoint instead")
      mult = _get_optional_float(reader, path, KEY_LOGIT_SCALE)
      kinds = fields["layer_types"]
      return "dflash2", DFlash2Fields(
          **ints, output_multiplier=1.0 if mult is None else mult,
          final_logit_softcapping=_get_optional_float(reader, path, KEY_SOFTCAP),
          is_causal=resolve_is_causal(causal, kinds, "gguf"))
    if dspark:
      w1 = tensors.get("markov_w1.weight")
      rank = _numpy_shape(w1)[-1] if w1 is not None else 0
      conf = "conf_proj.weight" in tensors
      declared = _get_bool(reader, path, KEY_HAS_CONF)
      if declared is not None and declared != conf:
        raise _fail(path, f"{KEY_HAS_CONF!r} is {declared}, but the file "
                    f"{'holds' if conf else 'lacks'} conf_proj.weight")
      if conf and not rank:
        raise _fail(path, "conf_proj.weight without markov_w1.weight: a confidence head without "
                    "the Markov feature has no GGUF form (llama.cpp reads [h ; W1[prev]])")
      anchor = _get_bool(reader, path, KEY_ANCHOR)
      return "dspark", DSparkFields(
          sample_from_anchor=True if anchor is None else anchor, markov_rank=rank,
          markov_head_type="vanilla" if rank else None, confidence_head=conf,
          confidence_with_markov=conf)
  except ValueError as e:
    if isinstance(e, DrafterFormatError):
      raise
    raise _fail(path, str(e)) from e
  return "dflash", None


def _get_optional_float(reader: gguf.GGUFReader, path: str, key: str) -> float | None:
  return None if reader.get_field(key) is None else _get_float(reader, path, key)


def _numpy_shape(t: Any) -> tuple[int, ...]:
  """GGUF stores ggml `ne` (fastest first); numpy/torch order is the reverse."""
  return tuple(int(n) for n in reversed(t.shape.tolist()))


def _drafter_tensors(reader: gguf.GGUFReader, cfg: DFlashConfig, path: str) -> dict[str, Any]:
  """weights key -> ReaderTensor for exactly the drafter's tensors (and a DSpark file's copies
  of the target's), with names and shapes checked."""
  # The names do not depend on the target's vocabulary: any vocab size gives the same keys.
  keys = {gguf_tensor_name(k): k for k in drafter_tensor_shapes(cfg, n_vocab=1)}
  copies = {COPY_NAMES[k]: k for k in stored_target_copies(cfg)}
  by_name, extra, limit = {}, [], 8
  for t in reader.tensors:   # built one at a time: a flood of unknown tensors stops early
    if t.name in keys or t.name in copies:
      by_name[t.name] = t
    else:
      extra.append(t.name)
      if len(extra) > limit:
        break
  if extra:
    more = " and more" if len(extra) > limit else ""
    raise _fail(path, f"unknown tensors {extra[:limit]}{more} (the file holds "
                f"{len(reader.tensors)}; a {cfg.family} drafter has {len(keys)} tensors for "
                f"n_layer={cfg.n_layer})")
  missing = [n for n in keys if n not in by_name]
  if missing:
    raise _fail(path, f"missing tensors {_names(missing)}")
  present = [n for n in copies if n in by_name]
  if present and len(present) != len(copies):
    raise _fail(path, f"holds {present} but not {sorted(set(copies) - set(present))}: a DSpark "
                "file stores both copies of the target's tensors or neither")
  keys.update({n: copies[n] for n in present})
  tensors = {keys[n]: t for n, t in by_name.items()}
  _check_heads(tensors, cfg, path)
  n_vocab = drafter_vocab(cfg, {k: _numpy_shape(t) for k, t in tensors.items()}, path)
  expected = drafter_tensor_shapes(cfg, n_vocab)
  expected.update({copies[n]: (n_vocab, cfg.n_embd) for n in present})
  for name, t in tensors.items():
    if _numpy_shape(t) != expected[name]:
      raise _fail(path, f"tensor {t.name} has shape {_numpy_shape(t)}, expected "
                  f"{expected[name]}")
  return tensors


def _names(names: list[str], limit: int = 8) -> str:
  """The first `limit` names and how many more: an error message stays one readable line."""
  more = f" and {len(names) - limit} more" if len(names) > limit else ""
  return f"{names[:limit]}{more}"


def _check_heads(tensors: Mapping[str, Any], cfg: DFlashConfig, path: str) -> None:
  """Names the head metadata when the attention projections disagree with it."""
  hd_key = INT_KEYS["head_dim"]
  for i in range(cfg.n_layer):
    for suffix, axis, field in (("attn_q", 0, "n_head"), ("attn_k", 0, "n_head_kv"),
                                ("attn_v", 0, "n_head_kv"), ("attn_output", 1, "n_head")):
      shape = _numpy_shape(tensors[f"blk.{i}.{suffix}"])
      heads = getattr(cfg, field)
      if len(shape) == 2 and shape[axis] != heads * cfg.head_dim:
        raise _fail(path, f"tensor blk.{i}.{suffix}.weight has {shape[axis]} "
                    f"{'rows' if axis == 0 else 'columns'}, but {INT_KEYS[field]!r} ({heads}) * "
                    f"{hd_key!r} ({cfg.head_dim}) = {heads * cfg.head_dim}: the head counts or "
                    "head_dim are inconsistent with the tensor shapes")


def _dequantize(t: Any, path: str) -> np.ndarray:
  try:
    with np.errstate(invalid="ignore", over="ignore"):   # non-finite values are named below
      a = gguf.quants.dequantize(t.data, t.tensor_type)
  except NotImplementedError as e:
    raise _fail(path, f"tensor {t.name} is {t.tensor_type.name}, which the gguf package "
                "cannot dequantize") from e
  # F32 dequantizes to a view of the read-only memmap: the caller gets its own copy.
  if np.may_share_memory(a, t.data) or type(a) is not np.ndarray:
    a = np.array(a, dtype=np.float32, order="C")
  a = np.ascontiguousarray(a, dtype=np.float32)
  if not np.isfinite(a).all():
    bad = np.argwhere(~np.isfinite(a))
    raise _fail(path, f"tensor {t.name} has {len(bad)} non-finite values (first: "
                f"{a[tuple(bad[0])]} at index {tuple(int(i) for i in bad[0])})")
  return a


# ---------------------------------------------------------------------------------------------
# Saving


def save_gguf_drafter(path: str | os.PathLike, cfg: DFlashConfig, w: Mapping[str, np.ndarray],
                      tensor_type: str = "F32") -> str:
  """Writes a drafter GGUF (llama.cpp conventions); returns its path.

  Matrices are stored as `tensor_type` (F32, F16, BF16 or Q8_0); 1-D norms and biases and
  DFlash2's base kernels are always F32. The target's `tok_embd`/`lm_head` in `w` are not
  written, except a DSpark drafter's copies (as llama.cpp's `token_embd` / `output`). A config
  GGUF cannot say is refused with the reason (`_check_gguf_form`). `w` is fully validated and
  encoded before anything touches the disk, and the file appears only complete (temp file +
  rename).
  """
  path = os.fspath(path)
  if tensor_type not in SAVE_TYPES:
    raise ValueError(f"tensor_type must be one of {sorted(SAVE_TYPES)}, got {tensor_type!r}")
  if not isinstance(cfg, DFlashConfig):
    raise TypeError(f"cfg must be a DFlashConfig, got {type(cfg).__name__}")
  qtype = SAVE_TYPES[tensor_type]
  where = f"save_drafter({path})"
  if SLIDING in cfg.kinds and cfg.window is None:
    raise _fail(where, f"the config has sliding layers but no window; the file needs "
                f"{KEY_WINDOW!r} (a file without it is full attention on every layer, "
                "docs/SPEC.md section 2): give the config one (dataclasses.replace(cfg, "
                "window=2048))")
  rope = _rope_keys(cfg, where)
  _check_gguf_form(cfg, where)
  arrays = checked_drafter_weights(cfg, w, where)
  encoded = {name: _encode(name, a, qtype, where) for name, a in arrays.items()}
  _write_atomically(path, lambda writer: _fill_writer(writer, cfg, rope, encoded, qtype))
  return path


def _check_gguf_form(cfg: DFlashConfig, where: str) -> None:
  """Refuses what llama.cpp's GGUF cannot say (SPEC_dflash2_dspark 3.3, 10.3), naming why."""
  if cfg.family == "dflash2":
    f = cfg.dflash2
    if not isinstance(f.is_causal, bool):
      raise _fail(where, f"is_causal {f.is_causal} differs between layers; the GGUF holds one "
                  f"{KEY_CAUSAL!r} for every layer")
    if f.input_embedding_scale != 1.0:
      raise _fail(where, f"input_embedding_scale is {f.input_embedding_scale}; upstream "
                  "llama.cpp has no GGUF key for it (it would run the drafter unscaled)")
  elif cfg.family == "dspark":
    f = cfg.dspark
    if f.markov_head_type not in (None, "vanilla"):
      raise _fail(where, f"markov_head_type {f.markov_head_type!r} has no GGUF form; llama.cpp "
                  "runs only the vanilla Markov head")
    if f.confidence_head and not f.confidence_with_markov:
      raise _fail(where, "a confidence head without the Markov feature has no GGUF form; "
                  "llama.cpp's conf_proj reads [h ; W1[prev]]")
    if not f.markov_rank:
      raise _fail(where, "a DSpark drafter without a Markov head has no GGUF form: llama.cpp "
                  "tells DSpark files by their markov_w1 / conf_proj tensors, so it would run "
                  "this one as DFlash")


def _encode(name: str, a: np.ndarray, qtype: Any, where: str) -> tuple[np.ndarray, Any]:
  """(data, ggml type) as the writer takes it; norms, biases and DFlash2's [2, K, H] base
  kernels stay F32 (llama.cpp's converter keeps 1-D tensors F32, and ggml adds the base kernels
  to F32 coefficients)."""
  if a.ndim != 2 or qtype == _QT.F32:
    return a, _QT.F32
  if qtype == _QT.Q8_0 and a.shape[-1] % _Q8_0_BLOCK:
    raise _fail(where, f"weight {name} has {a.shape[-1]} columns, not a multiple of the Q8_0 "
                f"block ({_Q8_0_BLOCK})")
  with np.errstate(over="ignore"):  # an F16 overflow is reported below, by tensor name
    data = gguf.quants.quantize(a, qtype)
  if qtype == _QT.F16 and not np.isfinite(data).all():
    raise _fail(where, f"weight {name} overflows F16 (max |w| = {np.abs(a).max()})")
  return data, qtype


def _fill_writer(writer: gguf.GGUFWriter, cfg: DFlashConfig, rope: list[tuple[str, Any, Any]],
                 encoded: Mapping[str, tuple[np.ndarray, Any]], qtype: Any) -> None:
  for field, key in INT_KEYS.items():
    writer.add_uint32(key, getattr(cfg, field))
  for field, key in FLOAT_KEYS.items():
    writer.add_float32(key, getattr(cfg, field))
  for key, value, vtype in rope:
    writer.add_key_value(key, value, vtype)
  writer.add_uint32(KEY_VALUE_LENGTH, cfg.head_dim)
  writer.add_key_value(KEY_TARGET_LAYERS, list(cfg.target_layers), _VT.ARRAY, sub_type=_VT.INT32)
  writer.add_uint32(KEY_BLOCK_SIZE, cfg.block_size)
  if cfg.window is not None:
    writer.add_uint32(KEY_WINDOW, cfg.window)
  if cfg.layer_types is not None:  # None: every layer slides, as a file with a window says
    writer.add_array(KEY_SWA_PATTERN, [cfg.is_sliding(i) for i in range(cfg.n_layer)])
  if cfg.context_length is not None:
    writer.add_uint32(KEY_CONTEXT, cfg.context_length)
  writer.add_uint32(KEY_MASK, cfg.mask_token_id)
  if cfg.family == "dflash2":
    f = cfg.dflash2
    for field, key in DFLASH2_INT_KEYS.items():
      writer.add_uint32(key, getattr(f, field))
    writer.add_bool(KEY_CAUSAL, f.is_causal)   # explicit: the formats' defaults differ
    writer.add_float32(KEY_LOGIT_SCALE, f.output_multiplier)
    if f.final_logit_softcapping is not None:
      writer.add_float32(KEY_SOFTCAP, f.final_logit_softcapping)
  elif cfg.family == "dspark":
    writer.add_bool(KEY_ANCHOR, cfg.dspark.sample_from_anchor)
    writer.add_bool(KEY_HAS_CONF, cfg.dspark.confidence_head)
  writer.add_file_type(_FILE_TYPES[qtype])
  writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
  for name, (data, dtype) in encoded.items():
    writer.add_tensor(COPY_NAMES[name] if name in COPY_NAMES else gguf_tensor_name(name), data,
                      raw_dtype=dtype)


def _write_atomically(path: str, fill: Any) -> None:
  """Builds the file beside `path` under a temporary name, then renames it into place."""
  with atomic.replacing(path) as tmp:
    writer = gguf.GGUFWriter(tmp, ARCH)
    try:
      fill(writer)
      writer.write_header_to_file()
      writer.write_kv_data_to_file()
      writer.write_tensors_to_file()
    finally:
      writer.close()
