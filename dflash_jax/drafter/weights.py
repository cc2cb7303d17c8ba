"""A drafter's device weights: layout, dtypes, and their preparation from the host tensors (and
the target's device embedding and LM head)."""
from __future__ import annotations

from typing import Any, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import quant
from dflash_jax.config import DFlashConfig, check_drafter_weights, rope_inv_freq
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
class ConvParams:
  """One DFlash2 sublayer's grouped dynamic convolution (SPEC_dflash2_dspark 4)."""
  base: jax.Array          # [2, K, n_embd] f32: side 0 (prepare) then side 1 (finish)
  proj: Any                # [2 K n_groups, n_embd] matrix: the coefficient projection


@flax.struct.dataclass
class DFlash2Params:
  """DFlash2's tensors: per layer the attention and MLP convolutions, once the selector."""
  attn_conv: tuple[ConvParams, ...]
  ffn_conv: tuple[ConvParams, ...]
  predecessor: jax.Array   # [n_vocab, R] table (gathered rows, like tok_embd)
  successor: jax.Array     # [n_vocab, R] table
  hidden: Any              # [R, n_embd] matrix: the hidden projection


@flax.struct.dataclass
class DSparkParams:
  """DSpark's heads (SPEC_dflash2_dspark 11, 12); None where the config has no such head."""
  markov_w1: jax.Array | None      # [n_vocab, R] table (gathered by the previous token)
  markov_w2: Any                   # [n_vocab, R] matrix: R -> vocab, no bias
  gate: Any                        # gated head: [R, n_embd + R] matrix
  gate_bias: jax.Array | None      # [R] f32
  joint: Any                       # rnn head: [3R, 2R + n_embd] matrix
  joint_bias: jax.Array | None     # [3R] f32
  conf: Any                        # confidence head: [1, n_embd (+ R)] matrix
  conf_bias: jax.Array | None      # [1] f32


@flax.struct.dataclass
class DrafterParams:
  """All device weights of a drafter plus its static config and kernel policy.

  Matrices keep the GGUF (out, in) layout: `y = x @ W^T`. Weights are per layer (a tuple,
  not a stacked array): slicing a layer-stacked array inside the step makes XLA copy it.
  `policy` routes the step's kernels (`dflash_jax.dispatch.KernelPolicy`); static, so every
  jitted entry point compiles once per policy. `family`: the family's own tensors
  (DFlash2Params, DSparkParams; None for DFlash).
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
  family: DFlash2Params | DSparkParams | None = None

  @property
  def n_vocab(self) -> int:
    return int(self.tok_embd.shape[0])

  @property
  def weight_format(self) -> str:
    return matrix_format(self.fc.w if isinstance(self.fc, Reduced) else self.fc)


def _finite(a: Any) -> bool:
  """NaN/Inf check without a host copy of a device array (one device reduction)."""
  if isinstance(a, jax.Array):
    return bool(jnp.isfinite(a).all())
  return bool(np.isfinite(np.asarray(a, np.float32)).all())


def prepare_weights(cfg: DFlashConfig, w: Mapping[str, Any], dtype: Any = "fp32",
                    q8_0_blocks: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
                    policy: KernelPolicy = KernelPolicy()) -> DrafterParams:
  """Weights -> device DrafterParams with matrices in `dtype`.

  w: the drafter's tensors (`config.drafter_tensor_shapes`, host arrays) and the target's
  `tok_embd` / `lm_head`, host arrays or device `jax.Array`s as a loaded target holds them:
  those are cast on the device (kept as they are when the dtype already fits, so the target
  and the drafter share one copy; no float32 host copy is made), except that a 1-byte format
  brings the LM head to the host in its stored dtype for the host quantizer. Checked first
  (`config.check_drafter_weights`: names, shapes, finiteness, device arrays on the device).
  dtype: 'fp32' or 'bf16' (dense), 'fp8' (quantized at load, per-row power-of-two scales) or
  'q8_0' (blocks of 32; `q8_0_blocks` from `read_q8_0` supplies tensors stored as Q8_0 in the
  GGUF, taken as stored; other tensors are quantized here). Norm weights, biases, DFlash2's
  base kernels and the rope table stay float32; the gathered tables (token embedding, DFlash2
  codebooks, DSpark's W1) are bf16 for the 1-byte formats. q/k/v and gate/up are concatenated
  so each pair of GEMMs sharing an input is one GEMM.
  policy: the kernel routing the step runs with (default: the shipped one).
  """
  if not isinstance(policy, KernelPolicy):
    raise ValueError(f"policy must be a dflash_jax.dispatch.KernelPolicy, got {policy!r}")
  check_drafter_weights(cfg, w, finite=_finite)
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
    return quant.quantize_q8_0(np.asarray(w[name]))

  dense = resolve_dtype(fmt) if fmt in ("fp32", "bf16") else None

  def mat(*names):
    if fmt == "q8_0":
      for n in names:
        n_out, k = np.shape(w[n])
        if k % skinny_gemm.Q8_0_BLOCK:
          raise ValueError(f"dtype 'q8_0': tensor '{n}' is [{n_out}, {k}]; Q8_0 blocks need "
                           f"columns (K) a multiple of {skinny_gemm.Q8_0_BLOCK}")
    if fmt in ("q8_0", "fp8"):   # both quantize rows on their own: part by part
      parts = [host_q8_0(n) if fmt == "q8_0" else quant.quantize_fp8(np.asarray(w[n]))
               for n in names]
      return QuantWeight(data=jnp.asarray(np.concatenate([p[0] for p in parts])),
                         scale=jnp.asarray(np.concatenate([p[1] for p in parts])), fmt=fmt)
    if len(names) == 1 and isinstance(w[names[0]], jax.Array):
      return _on_device(w[names[0]], dense)
    parts = [np.asarray(w[n], np.float32) for n in names]
    return jnp.asarray(quant.to_bf16(*parts) if fmt == "bf16" else np.concatenate(parts))

  table_dtype = dense if dense is not None else jnp.bfloat16

  def table(name):   # read by gathered rows, never a GEMM operand
    a = w[name]
    if isinstance(a, jax.Array):
      return _on_device(a, table_dtype)
    return jnp.asarray(np.asarray(a, np.float32) if table_dtype == jnp.float32
                       else quant.to_bf16(a))

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
  family = None
  if cfg.family == "dflash2":
    conv = lambda i, side: ConvParams(base=vec(f"blk.{i}.{side}_conv_base"),
                                      proj=mat(f"blk.{i}.{side}_conv_proj"))
    family = DFlash2Params(
        attn_conv=tuple(conv(i, "attn") for i in range(cfg.n_layer)),
        ffn_conv=tuple(conv(i, "ffn") for i in range(cfg.n_layer)),
        predecessor=table("selector_predecessor"), successor=table("selector_successor"),
        hidden=mat("selector_hidden"))
  elif cfg.family == "dspark":
    f = cfg.dspark
    has = lambda name: name in w
    family = DSparkParams(
        markov_w1=table("markov_w1") if f.markov_rank else None,
        markov_w2=mat("markov_w2") if f.markov_rank else None,
        gate=mat("markov_gate") if has("markov_gate") else None,
        gate_bias=vec("markov_gate.bias") if has("markov_gate") else None,
        joint=mat("markov_joint") if has("markov_joint") else None,
        joint_bias=vec("markov_joint.bias") if has("markov_joint") else None,
        conf=mat("conf_proj") if f.confidence_head else None,
        conf_bias=vec("conf_proj.bias") if f.confidence_head else None)
  return DrafterParams(
      fc=mat("fc"), enc_norm=vec("enc.output_norm"), out_norm=vec("output_norm"), inject=inject,
      inv_freq=jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)),
      tok_embd=table("tok_embd"), lm_head=mat("lm_head"), layers=tuple(layers), cfg=cfg,
      policy=policy, family=family)


def _on_device(a: jax.Array, dtype) -> jax.Array:
  """A device array in dtype: itself when it already is (shared, not copied), else cast there."""
  return a if a.dtype == dtype else a.astype(dtype)
