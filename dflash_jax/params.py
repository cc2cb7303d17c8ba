"""Device weights: layout, dtypes, and the one GEMM entry point of the step."""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import DFlashConfig, rope_inv_freq
from dflash_jax.synthetic import drafter_tensor_shapes

_DTYPE_NAMES = {"fp32": jnp.float32, "float32": jnp.float32, "f32": jnp.float32,
                "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype: Any, what: str = "dtype") -> jnp.dtype:
  """'fp32'/'bf16' or a jnp/numpy dtype -> jnp.float32 / jnp.bfloat16."""
  if isinstance(dtype, str):
    if dtype.lower() not in _DTYPE_NAMES:
      raise ValueError(f"{what} must be 'fp32' or 'bf16', got {dtype!r}")
    return jnp.dtype(_DTYPE_NAMES[dtype.lower()])
  try:
    d = jnp.dtype(dtype)
  except TypeError as e:
    raise ValueError(f"{what} must be 'fp32' or 'bf16', got {dtype!r}") from e
  if d not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"{what} must be float32 or bfloat16, got {d}")
  return d


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
class DrafterParams:
  """All device weights of a drafter plus its static config.

  Matrices keep the GGUF (out, in) layout: `y = x @ W^T`. Weights are per layer (a tuple,
  not a stacked array): slicing a layer-stacked array inside the step makes XLA copy it.
  """
  fc: jax.Array            # [n_embd, n_target_layers n_embd]
  enc_norm: jax.Array      # [n_embd] f32
  out_norm: jax.Array      # [n_embd] f32
  w_inject: jax.Array      # [L 2 Hkv D, n_embd]: every layer's wk then wv, for one inject GEMM
  k_norm_all: jax.Array    # [L, D] f32
  inv_freq: jax.Array      # [D/2] f32, from the host float64 table
  tok_embd: jax.Array      # [n_vocab, n_embd]
  lm_head: jax.Array       # [n_vocab, n_embd]
  layers: tuple[LayerParams, ...]
  cfg: DFlashConfig = flax.struct.field(pytree_node=False)

  @property
  def n_vocab(self) -> int:
    return int(self.tok_embd.shape[0])

  @property
  def dtype(self) -> jnp.dtype:
    return self.fc.dtype


def validate_weights(cfg: DFlashConfig, w: dict[str, np.ndarray]) -> int:
  """Check every tensor's presence, shape and finiteness; return n_vocab."""
  for key in ("tok_embd", "lm_head"):
    if key not in w:
      raise ValueError(f"weights lack '{key}': the drafter borrows the target's token embedding "
                       "and LM head; set w['tok_embd'] and w['lm_head'] ([n_vocab, n_embd] each)")
  n_vocab = int(np.shape(w["tok_embd"])[0])
  expected = dict(drafter_tensor_shapes(cfg))
  expected["tok_embd"] = expected["lm_head"] = (n_vocab, cfg.n_embd)
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


def prepare_weights(cfg: DFlashConfig, w: dict[str, np.ndarray], dtype: Any = "fp32") -> DrafterParams:
  """Host float32 weights -> device DrafterParams with matrices in `dtype` (fp32 or bf16).

  Norm weights and the rope table stay float32. q/k/v and gate/up are concatenated so each
  pair of GEMMs sharing an input is one GEMM.
  """
  validate_weights(cfg, w)
  mdt = resolve_dtype(dtype)

  def mat(*names):
    a = np.concatenate([np.asarray(w[n], np.float32) for n in names], axis=0)
    return jnp.asarray(a, mdt)

  def vec(name):
    return jnp.asarray(np.asarray(w[name], np.float32))

  layers = []
  for i in range(cfg.n_layer):
    p = f"blk.{i}."
    layers.append(LayerParams(
        attn_norm=vec(p + "attn_norm"), wqkv=mat(p + "attn_q", p + "attn_k", p + "attn_v"),
        q_norm=vec(p + "attn_q_norm"), k_norm=vec(p + "attn_k_norm"), wo=mat(p + "attn_output"),
        ffn_norm=vec(p + "ffn_norm"), wgu=mat(p + "ffn_gate", p + "ffn_up"), wd=mat(p + "ffn_down")))
  inject_names = [f"blk.{i}.attn_{kv}" for i in range(cfg.n_layer) for kv in ("k", "v")]
  return DrafterParams(
      fc=mat("fc"), enc_norm=vec("enc.output_norm"), out_norm=vec("output_norm"),
      w_inject=mat(*inject_names),
      k_norm_all=jnp.asarray(np.stack([w[f"blk.{i}.attn_k_norm"] for i in range(cfg.n_layer)]),
                             jnp.float32),
      inv_freq=jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta)),
      tok_embd=mat("tok_embd"), lm_head=mat("lm_head"), layers=tuple(layers), cfg=cfg)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
  """y = x @ w^T in float32 for a weight in (out, in) layout: THE GEMM entry point of the step.

  bf16 weights: the activation is rounded to bf16 (the rounding SPEC.md section 5 names) and
  the product accumulates in float32. fp32 weights: full-precision float32 (HIGHEST, so GPUs
  do not silently use TF32).
  """
  dims = (((x.ndim - 1,), (1,)), ((), ()))
  if w.dtype == jnp.bfloat16:
    return jax.lax.dot_general(x.astype(jnp.bfloat16), w, dims, preferred_element_type=jnp.float32)
  return jax.lax.dot_general(x.astype(jnp.float32), w, dims, precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w
