"""An independent float64 numpy Qwen3-MoE forward (a plain per-layer, per-row loop), written
from the semantics note (shared/research/target_families.md section 3), for testing
dflash_jax.models.qwen3_moe.

It reads the HF config dict and the checkpoint's tensors by their stored names (experts one
by one), so it shares nothing with the device layout (stacked experts, fused matrices).
"""
from __future__ import annotations

import numpy as np

from dflash_jax.config import rope_from_hf, rope_inv_freq


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, positions, inv_freq, attention_scaling):
  """NEOX rope of x [T, H, D] at positions [T] over the whole head: the float64 table of
  `dflash_jax.config.rope_inv_freq` (its scaling certified in tests/test_rope_scaling.py), cos
  and sin times the attention scaling as HF's rotary embedding applies it."""
  d = x.shape[-1]
  ang = positions[:, None, None].astype(np.float64) * inv_freq
  cos, sin = np.cos(ang) * attention_scaling, np.sin(ang) * attention_scaling
  x1, x2 = x[..., :d // 2], x[..., d // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _silu(g):
  return g / (1 + np.exp(-g))


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
    a = _rms(x, w("input_layernorm"), eps)
    q = _rms((a @ w("self_attn.q_proj").T).reshape(t, hq, d), w("self_attn.q_norm"), eps)
    k = _rms((a @ w("self_attn.k_proj").T).reshape(t, hkv, d), w("self_attn.k_norm"), eps)
    v = (a @ w("self_attn.v_proj").T).reshape(t, hkv, d)
    q, k = _rope(q, pos, *rope), _rope(k, pos, *rope)
    o = np.zeros((t, hq, d))
    for head in range(hq):
      kh = head // (hq // hkv)
      s = np.where(causal, q[:, head] @ k[:, kh].T / np.sqrt(d), -np.inf)
      pr = np.exp(s - s.max(-1, keepdims=True))
      o[:, head] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kh]
    x = x + o.reshape(t, hq * d) @ w("self_attn.o_proj").T
    b = _rms(x, w("post_attention_layernorm"), eps)
    if is_sparse(c, i):
      router = w("mlp.gate")
      m = np.zeros_like(b)
      for r in range(t):
        ids, wts = routing(c, router, b[r])
        for e, we in zip(ids, wts):
          ep = f"mlp.experts.{e}."
          hidden = _silu(w(ep + "gate_proj") @ b[r]) * (w(ep + "up_proj") @ b[r])
          m[r] += we * (w(ep + "down_proj") @ hidden)
    else:
      m = (_silu(b @ w("mlp.gate_proj").T) * (b @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
    x = x + m
    hs.append(x)
  hs[-1] = _rms(x, t64("model.norm.weight"), eps)
  head = t64("model.embed_tokens.weight" if c.get("tie_word_embeddings") else "lm_head.weight")
  return hs, hs[-1] @ head.T
