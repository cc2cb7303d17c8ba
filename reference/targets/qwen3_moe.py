"""An independent float64 numpy Qwen3-MoE forward (a plain per-layer, per-row loop), written
from the semantics note (shared/research/target_families.md section 3), for testing
dflash_jax.models.qwen3_moe.

It reads the HF config dict and the checkpoint's tensors by their stored names (experts one
by one), so it shares nothing with the device layout (stacked experts, fused matrices).
"""
from __future__ import annotations

import numpy as np

from dflash_jax.config import rope_from_hf, rope_inv_freq
from reference.targets.common import neox_rope, rms, silu











def is_sparse(config: dict, layer: int) -> bool:
  """Whether a layer's MLP is the expert mixture (else the dense MLP)."""
  step = config.get("decoder_sparse_step", 1)
  return (layer not in config.get("mlp_only_layers", []) and config["num_experts"] > 0
          and step > 0 and (layer + 1) % step == 0)


def routing(config: dict, router: np.ndarray, x: np.ndarray):
  """One row x [H] -> (expert ids [k], weights [k]): softmax over every expert, the k most
  probable (ties to the lower id), renormalised iff norm_topk_prob."""
  z = router @ x
  p = np.exp(z - z.max())
  p /= p.sum()
  k = config["num_experts_per_tok"]
  ids = np.argsort(-p, kind="stable")[:k]
  w = p[ids]
  if config.get("norm_topk_prob", False):
    w = w / w.sum()
  return ids, w


def hidden_states(config: dict, tensors: dict, tokens):
  """One sequence tokens [T] -> (HF hidden_states: n_layers + 1 arrays [T, H], the last after
  the final norm; logits [T, V])."""
  c = config
  t64 = lambda name: np.asarray(tensors[name], np.float64)
  hq = c["num_attention_heads"]
  hkv = c.get("num_key_value_heads", hq)
  d = c.get("head_dim") or c["hidden_size"] // hq
  eps = c["rms_norm_eps"]
  theta, scaling = rope_from_hf(c, "config")
  rope = rope_inv_freq(d, theta, scaling, np.float64), scaling.attention_scaling
  tokens = np.asarray(tokens)
  t = len(tokens)
  pos = np.arange(t)
  x = t64("model.embed_tokens.weight")[tokens]
  hs = [x]
  causal = np.tril(np.ones((t, t), bool))
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    w = lambda name: t64(p + name + ".weight")
    a = rms(x, w("input_layernorm"), eps)
    q = rms((a @ w("self_attn.q_proj").T).reshape(t, hq, d), w("self_attn.q_norm"), eps)
    k = rms((a @ w("self_attn.k_proj").T).reshape(t, hkv, d), w("self_attn.k_norm"), eps)
    v = (a @ w("self_attn.v_proj").T).reshape(t, hkv, d)
    q, k = neox_rope(q, pos, *rope), neox_rope(k, pos, *rope)
    o = np.zeros((t, hq, d))
    for head in range(hq):
      kh = head // (hq // hkv)
      s = np.where(causal, q[:, head] @ k[:, kh].T / np.sqrt(d), -np.inf)
      pr = np.exp(s - s.max(-1, keepdims=True))
      o[:, head] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kh]
    x = x + o.reshape(t, hq * d) @ w("self_attn.o_proj").T
    b = rms(x, w("post_attention_layernorm"), eps)
    if is_sparse(c, i):
      router = w("mlp.gate")
      m = np.zeros_like(b)
      for r in range(t):
        ids, wts = routing(c, router, b[r])
        for e, we in zip(ids, wts):
          ep = f"mlp.experts.{e}."
          hidden = silu(w(ep + "gate_proj") @ b[r]) * (w(ep + "up_proj") @ b[r])
          m[r] += we * (w(ep + "down_proj") @ hidden)
    else:
      m = (silu(b @ w("mlp.gate_proj").T) * (b @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
    x = x + m
    hs.append(x)
  hs[-1] = rms(x, t64("model.norm.weight"), eps)
  head = t64("model.embed_tokens.weight" if c.get("tie_word_embeddings") else "lm_head.weight")
  return hs, hs[-1] @ head.T
