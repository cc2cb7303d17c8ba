"""Checkpoint formats: drafter GGUF files and HF folders, safetensors, atomic writes.

One entry per artifact and direction: `load_drafter` / `save_drafter` here detect the format
(a GGUF file or an HF checkpoint folder); target folders load through
`dflash_jax.models.load_target`, which reads them with `safetensors`. The modules, lowest
first: `errors` (every format's error and the drafter weight check), `atomic`, `gguf_guard` (a
bounds-checked GGUF header walk), `safetensors`, then `gguf` and `hf` (the drafter formats).
Nothing here imports the drafter or the models.
"""
from __future__ import annotations

import os
from typing import Mapping

import numpy as np

from dflash_jax.config import DFlashConfig
from dflash_jax.io import gguf, hf
from dflash_jax.io.errors import DrafterFormatError
from dflash_jax.io.gguf import read_q8_0

__all__ = ["DrafterFormatError", "load_drafter", "read_q8_0", "save_drafter"]


def load_drafter(path: str | os.PathLike) -> tuple[DFlashConfig, dict[str, np.ndarray]]:
  """Reads and validates a drafter of any family (DFlash, DFlash2, DSpark): a GGUF file, or an
  HF checkpoint folder (or its config.json / safetensors file; see `hf.load_hf_drafter`).

  Returns the config and a dict of writable, C-contiguous float32 arrays in (out, in) layout,
  keyed like `config.drafter_tensor_shapes` (GGUF tensor names without `.weight`); a DSpark
  file's copies of the target's embedding and LM head come as `tok_embd` / `lm_head`. Raises
  DrafterFormatError (naming the file and the culprit) on any deviation, FileNotFoundError
  when nothing is there.
  """
  path = os.fspath(path)
  if hf.checkpoint_folder(path) is not None:
    return hf.load_hf_drafter(path)
  return gguf.load_gguf_drafter(path)


def save_drafter(path: str | os.PathLike, cfg: DFlashConfig, w: Mapping[str, np.ndarray],
                 tensor_type: str = "F32", format: str | None = None) -> str:
  """Writes a drafter GGUF (llama.cpp conventions) or HF checkpoint folder; returns its path.

  `format` is "gguf" or "hf"; None picks by the path: a `.gguf` file name means GGUF, anything
  else (a folder) HF. Matrices are stored as `tensor_type`: F32, F16, BF16 or Q8_0 for GGUF;
  f32, f16 or bf16 (any case) for HF. 1-D norms are always F32. The target's
  `tok_embd`/`lm_head` in `w` are not written (except a DSpark drafter's copies). What a format
  cannot say is refused with the reason (e.g. a gated DSpark Markov head as GGUF). `w` is fully
  validated and encoded before anything touches the disk, and each file appears only complete
  (temp file + rename).
  """
  path = os.fspath(path)
  if format is None:
    format = "gguf" if path.lower().endswith(".gguf") and not os.path.isdir(path) else "hf"
  if format == "hf":
    return hf.save_hf_drafter(path, cfg, w, dtype=str(tensor_type).lower())
  if format != "gguf":
    raise ValueError(f"format must be 'gguf', 'hf' or None, got {format!r}")
  return gguf.save_gguf_drafter(path, cfg, w, tensor_type)
