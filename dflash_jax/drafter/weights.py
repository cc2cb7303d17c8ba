"""A drafter's device weights: layout, dtypes, and the preparation from host float32 tensors."""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import quant
from dflash_jax.config import DFlashConfig, drafter_tensor_shapes, rope_inv_freq
from dflash_jax.dispatch import (KernelPolicy, QuantWeight, Reduced, matrix_format,
                                 resolve_dtype, resolve_weight_format)
from pallas_kernels import skinny_gemm


@flax.struct.dataclass
class LayerParams:
  attn_norm: jax.Array   # [n_embd] f32
  wqkv: jax.Array        # [(Hq + 2 Hkv) D, n_embd]: q, k, v projections fused (one GEMM)
  q_norm: jax.Array      # [D] f32
  k_norm: jax.Array      # [D] f32
  wo: jax.Array          # [n_embd, Hq D]
  ffn_norm: jax.Array    # [n_embd] f32
  wgu: jax.Array         # [2 n_ff, n_embd]: gate rows then up rows (one GEMM)
  wd: jax.Array          # [n_embd, n_ff]


@flax.struct.dataclass
class InjectParams:
  """The inject GEMM of one attention kind's layers (`cfg.layers_of(kind)`, in layer order),
  which share one K/V cache: one GEMM and one inject launch per kind."""
  w: jax.Array             # [L_kind 2 Hkv D, n_embd]: each layer's wk then wv
  k_norm: jax.Array        # [L_kind, D] f32
  kind: str = flax.struct.field(pytree_node=False)


@flax.struct.dataclass
class DrafterParams:
  """All device weights of a drafter plus its static config and kernel policy.

  Matrices keep the GGUF (out, in) layout: `y = x @ W^T`. Weights are per layer (a tuple,
  not a stacked array): slicing a layer-stacked array inside the step makes XLA copy it.
  `policy` routes the step's kernels (`dflash_jax.dispatch.KernelPolicy`); static, so every
  jitted entry point compiles once per policy.
  """
  fc: jax.Array            # [n_embd, n_target_layers n_embd]
  enc_norm: jax.Array      # [n_embd] f32
  out_norm: jax.Array      # [n_embd] f32
  inject: tuple[InjectParams, ...]   # one per `cfg.kind_groups` entry, same order
  inv_freq: jax.Array      # [D/2] f32, from the host float64 table (cfg.rope_scaling applied)
  tok_embd: jax.Array      # [n_vocab, n_embd]
  lm_head: jax.Array       # [n_vocab, n_embd], or [n_draft_vocab, n_embd] (a reduced draft vocab)
  layers: tuple[LayerParams, ...]
  cfg: DFlashConfig = flax.struct.field(pytree_node=False)
  policy: KernelPolicy = flax.struct.field(pytree_node=False, default=KernelPolicy())

  @property
  def n_vocab(self) -> int:
    return int(self.tok_embd.shape[0])

  @property
  def weight_format(self) -> str:
    return matrix_format(self.fc.w if isinstance(self.fc, Reduced) else self.fc)



def validate_weights(cfg: DFlashConfig, w: dict[str, np.ndarray]) -> int:
  """Check every tensor's presence, shape and finiteness; return n_vocab."""
  for key in ("tok_embd", "lm_head"):
    if key not in w:
      raise ValueError(f"weights lack '{key}': the drafter borrows the target's token embedding "
                       "and LM head; set w['tok_embd'] and w['lm_head'] ([n_vocab, n_embd] each)")
  n_vocab = int(np.shape(w["tok_embd"])[0])
  expected = dict(drafter_tensor_shapes(cfg))
  # The LM head may cover a reduced draft vocab (fewer rows; decode.py maps them via d2t).
  n_head = int(np.shape(w["lm_head"])[0]) if np.ndim(w["lm_head"]) == 2 else n_vocab
  expected["tok_embd"] = (n_vocab, cfg.n_embd)
  expected["lm_head"] = (n_head if 0 < n_head <= n_vocab else n_vocab, cfg.n_embd)
  for name, shape in expected.items():
    if name not in w:
      raise ValueError(f"weights lack tensor '{name}' (expected shape {shape})")
    if tuple(np.shape(w[name])) != shape:
      raise ValueError(f"tensor '{name}' has shape {tuple(np.shape(w[name]))}, expected {shape}")
  extra = sorted(set(w) - set(expected))
  if extra:
    raise ValueError(f"unknown tensors in weights: {extra}")
  for name in expected:
    if not np.isfinite(np.asarray(w[name], np.float32)).all():
      raise ValueError(f"tensor '{name}' holds NaN or Inf")
  if not 0 <= cfg.mask_token_id < n_vocab:
    raise ValueError(f"mask_token_id {cfg.mask_token_id} is outside the target vocab [0, {n_vocab})")
  return n_vocab


def prepare_weights(cfg: DFlashConfig, w: dict[str, np.ndarray], dtype: Any = "fp32",
                    q8_0_blocks: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
                    policy: KernelPolicy = KernelPolicy()) -> DrafterParams:
  """Host float32 weights -> device DrafterParams with matrices in `dtype`.

  dtype: 'fp32' or 'bf16' (dense), 'fp8' (quantized at load, per-row power-of-two scales) or
  'q8_0' (blocks of 32; `q8_0_blocks` from `read_q8_0` supplies tensors stored as Q8_0 in the
  GGUF, taken as stored; other tensors are quantized here). Norm weights and the rope table
  stay float32; the token embedding (a gather, not a GEMM) is bf16 for the 1-byte formats.
  q/k/v and gate/up are concatenated so each pair of GEMMs sharing an input is one GEMM.
  policy: the kernel routing the step runs with (default: the shipped one).
  """
  if not isinstance(policy, KernelPolicy):
    raise ValueError(f"policy must be a dflash_jax.dispatch.KernelPolicy, got {policy!r}")
  validate_weights(cfg, w)
  fmt = resolve_weight_format(dtype)
  if q8_0_blocks and fmt != "q8_0":
    raise ValueError(f"q8_0_blocks given but dtype is {fmt!r}")
  q8_0_blocks = q8_0_blocks or {}

  def host_q8_0(name):
    if name in q8_0_blocks:
      qs, d = q8_0_blocks[name]
      if qs.shape != np.shape(w[name]) or d.shape != (qs.shape[0], qs.shape[1] // 32):
        raise ValueError(f"q8_0 blocks of '{name}' have shapes {qs.shape}, {d.shape}; "
                         f"expected {np.shape(w[name])} and its [N, K/32] scales")
      if qs.dtype != np.int8 or d.dtype != np.float32:
        raise ValueError(f"q8_0 blocks of '{name}' are {qs.dtype}, {d.dtype}; expected int8 "
                         "and float32 (as read_q8_0 returns them)")
      return qs, d
    return quant.quantize_q8_0(w[name])

  def mat(*names):
    if fmt == "q8_0":
      for n in names:
        n_out, k = np.shape(w[n])
        if k % skinny_gemm.Q8_0_BLOCK:
          raise ValueError(f"dtype 'q8_0': tensor '{n}' is [{n_out}, {k}]; Q8_0 blocks need "
                           f"columns (K) a multiple of {skinny_gemm.Q8_0_BLOCK}")
    if fmt in ("q8_0", "fp8"):   # both quantize rows on their own: part by part
      parts = [host_q8_0(n) if fmt == "q8_0" else quant.quantize_fp8(w[n]) for n in names]
      return QuantWeight(data=jnp.asarray(np.concatenate([p[0] for p in parts])),
                         scale=jnp.asarray(np.concatenate([p[1] for p in parts])), fmt=fmt)
    parts = [np.asarray(w[n], np.float32) for n in names]
    return jnp.asarray(quant.to_bf16(*parts) if fmt == "bf16" else np.concatenate(parts))

  def vec(name):
    return jnp.asarray(np.asarray(w[name], np.float32))

  layers = []
  for i in range(cfg.n_layer):
    p = f"blk.{i}."
    layers.append(LayerParams(
        attn_norm=vec(p + "attn_norm"), wqkv=mat(p + "attn_q", p + "attn_k", p + "attn_v"),
        q_norm=vec(p + "attn_q_norm"), k_norm=vec(p + "attn_k_norm"), wo=mat(p + "attn_output"),
        ffn_norm=vec(p + "ffn_norm"), wgu=mat(p + "ffn_gate", p + "ffn_up"), wd=mat(p + "ffn_down")))
  inject = tuple(
      InjectParams(w=mat(*[f"blk.{i}.attn_{kv}" for i in layers for kv in ("k", "v")]),
                   k_norm=jnp.asarray(np.stack([w[f"blk.{i}.attn_k_norm"] for i in layers]),
                                      jnp.float32), kind=kind)
      for kind, layers in cfg.kind_groups)
  embd_dtype = resolve_dtype(fmt) if fmt in ("fp32", "bf16") else jnp.bfloat16
  return DrafterParams(
      fc=mat("fc"), enc_norm=vec("enc.output_norm"), out_norm=vec("output_norm"), inject=inject,
      inv_freq=jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)),
      tok_embd=jnp.asarray(np.asarray(w["tok_embd"], np.float32) if embd_dtype == jnp.float32
                           else quant.to_bf16(w["tok_embd"])),
      lm_head=mat("lm_head"), layers=tuple(layers), cfg=cfg, policy=policy)


