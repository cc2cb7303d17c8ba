"""Host-side (numpy) weight quantization for the streamed skinny GEMMs, and the bf16 cast.

Both formats keep the GGUF/torch (out, in) layout: w is [N, K], K contiguous, which is what
`pallas_kernels.skinny_gemm` streams. Dequantization returns float32; the kernels and their
references compute with exactly these dequantized values.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from pallas_kernels.skinny_gemm import Q8_0_BLOCK  # llama.cpp QK8_0, as the kernel reads it

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Every format here converts each row on its own, so a big matrix is converted in blocks of
# rows on a thread pool (numpy releases the GIL), each block written into the result by its
# thread: the same bytes, faster (two cores: fp8 4.4x; the single-pass bf16 cast 2x).
_BLOCK_VALUES = 1 << 22


def _by_rows(fn, *ws: np.ndarray) -> tuple[np.ndarray, ...]:
  """fn (a row-wise conversion of float32 rows returning a tuple of [rows, ...] arrays) over
  blocks of rows of the row-wise concatenation of ws (same columns, any float dtype), which is
  never made in memory; each block is widened to float32 on its own, so a bf16 input never
  has a whole float32 copy."""
  rows = max(1, _BLOCK_VALUES // max(1, ws[0].shape[1]))
  if len(ws) == 1 and ws[0].shape[0] <= rows:
    return fn(np.asarray(ws[0], np.float32))
  # (part, first row in the part, first row in the result) of every block.
  blocks, offset = [], 0
  for w in ws:
    blocks += [(w, start, offset + start) for start in range(0, w.shape[0], rows)]
    offset += w.shape[0]
  first = fn(np.asarray(ws[0][:0], np.float32))   # dtypes and trailing shapes of the outputs
  outs = tuple(np.empty((offset, *f.shape[1:]), f.dtype) for f in first)

  def fill(block):
    w, start, at = block
    part = np.asarray(w[start:start + rows], np.float32)
    for out, result in zip(outs, fn(part), strict=True):
      out[at:at + part.shape[0]] = result

  with host_pool() as pool:
    list(pool.map(fill, blocks))
  return outs


def host_pool() -> ThreadPoolExecutor:
  """Threads for host array work that releases the GIL (at most 16: the GPU machine's cores)."""
  return ThreadPoolExecutor(min(16, os.cpu_count() or 1))


def to_bf16(*ws: np.ndarray) -> np.ndarray:
  """The row-wise concatenation of ws ([N_i, K] each) rounded to bfloat16 (nearest even,
  ml_dtypes' cast)."""
  return _by_rows(lambda b: (b.astype(ml_dtypes.bfloat16),), *[np.asarray(w) for w in ws])[0]


def _check_matrix(w: np.ndarray, name: str) -> np.ndarray:
  w = np.asarray(w)
  if w.ndim != 2:
    raise ValueError(f"{name}: w must be 2-D [N, K] (got shape {w.shape})")
  if not np.all(np.isfinite(w)):
    raise ValueError(f"{name}: w must be finite (got {np.count_nonzero(~np.isfinite(w))} "
                     "non-finite values)")
  return w


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per-output-row float8_e4m3fn: w ~= w8 * scale[:, None], scale the power of two >= max|row|/448.

  Returns (w8 [N, K] float8_e4m3fn, scale [N] float32). A power-of-two scale costs under one
  bit of range but makes every dequantized weight exactly representable in bf16, so the fp8
  GEMM (bf16 products, scale in the epilogue) equals a bf16 GEMM on the dequantized weights.
  All-zero rows get scale 1. Rounding is to nearest even (ml_dtypes' cast).
  """
  return _by_rows(_fp8_rows, _check_matrix(w, "quantize_fp8"))


def _fp8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  amax = np.max(np.abs(w), axis=1).astype(np.float64)
  with np.errstate(divide="ignore"):
    exponent = np.ceil(np.log2(amax / FP8_MAX))
  scale = np.where(amax > 0, np.exp2(exponent), 1.0).astype(np.float32)
  # w / scale can round a hair above 448; e4m3fn has no inf, so an overflow would become NaN.
  scaled = np.clip(w / scale[:, None], -FP8_MAX, FP8_MAX)
  return scaled.astype(ml_dtypes.float8_e4m3fn), scale


def dequantize_fp8(w8: np.ndarray, scale: np.ndarray) -> np.ndarray:
  return np.asarray(w8).astype(np.float32) * np.asarray(scale, np.float32)[:, None]


def _roundf(x: np.ndarray) -> np.ndarray:
  # C roundf (half away from zero), as ggml-quants.c uses; np.round would round half to even.
  a = np.abs(x)
  floored = np.floor(a)
  return np.sign(x) * (floored + np.floor(2 * (a - floored)))


def quantize_q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """llama.cpp Q8_0: blocks of 32 along K, d = max|block| / 127, qs = roundf(x / d).

  Returns (qs [N, K] int8, d [N, K // 32] float32). As in ggml-quants.c, qs is computed with
  the float32 d and d is then stored as float16; the returned d is that float16 value widened
  to float32, so dequantize_q8_0 reproduces a GGUF Q8_0 tensor bit for bit.
  """
  w = _check_matrix(w, "quantize_q8_0")
  if w.shape[1] % Q8_0_BLOCK:
    raise ValueError(f"quantize_q8_0: K % {Q8_0_BLOCK} == 0 required (got K={w.shape[1]})")
  return _by_rows(_q8_0_rows, w)


def _q8_0_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  n, k = w.shape
  blocks = w.reshape(n, k // Q8_0_BLOCK, Q8_0_BLOCK)
  d = np.max(np.abs(blocks), axis=2, keepdims=True) / np.float32(127)
  with np.errstate(divide="ignore"):
    inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d)
  qs = _roundf(blocks * inv_d).astype(np.int8).reshape(n, k)
  with np.errstate(over="ignore"):  # overflow is reported just below, naming the limit
    d16 = d[..., 0].astype(np.float16)
  if not np.all(np.isfinite(d16)):
    raise ValueError("quantize_q8_0: block scale d must fit float16 (max|block| <= 65504*127, "
                     f"got max|w|={float(np.max(np.abs(w)))})")
  return qs, d16.astype(np.float32)


def dequantize_q8_0(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
  qs = np.asarray(qs)
  n, k = qs.shape
  blocks = qs.reshape(n, k // Q8_0_BLOCK, Q8_0_BLOCK).astype(np.float32)
  return (blocks * np.asarray(d, np.float32)[..., None]).reshape(n, k)
