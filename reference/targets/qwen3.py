"""An independent float64 numpy Qwen3 / Llama-3 forward, written from HF's modeling code
semantics (a plain per-layer loop), for testing dflash_jax.models.qwen3 (it reads the device
params' fused matrices by their row blocks)."""
from __future__ import annotations

import numpy as np


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, positions, theta):
  """NEOX rope of x [T, H, D] at positions [T] (inverse frequencies in float64)."""
  d = x.shape[-1]
  inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
  ang = positions[:, None, None].astype(np.float64) * inv
  x1, x2 = x[..., :d // 2], x[..., d // 2:]
  return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def hidden_states(params, cfg, tokens):
  """One sequence tokens [T] -> (HF hidden_states: list of n_layers + 1 arrays [T, E], the
  last after the final norm; logits [T, V])."""
  f64 = lambda a: None if a is None else np.asarray(a, np.float64)
  hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  t = len(tokens)
  pos = np.arange(t)
  x = f64(params.embed)[np.asarray(tokens)]
  hs = [x]
  for lp in params.layers:
    wqkv = f64(lp.wqkv)
    wq, wk, wv = wqkv[:hq * d], wqkv[hq * d:(hq + hkv) * d], wqkv[(hq + hkv) * d:]
    a = _rms(x, f64(lp.attn_norm), cfg.rms_norm_eps)
    q = (a @ wq.T).reshape(t, hq, d)
    k = (a @ wk.T).reshape(t, hkv, d)
    v = (a @ wv.T).reshape(t, hkv, d)
    if cfg.qk_norm:
      q = _rms(q, f64(lp.q_norm), cfg.rms_norm_eps)
      k = _rms(k, f64(lp.k_norm), cfg.rms_norm_eps)
    q, k = _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta)
    o = np.zeros((t, hq, d))
    for h in range(hq):
      kh = h // (hq // hkv)
      s = q[:, h] @ k[:, kh].T / np.sqrt(d)
      s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
      p = np.exp(s - s.max(-1, keepdims=True))
      o[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, kh]
    x = x + o.reshape(t, hq * d) @ f64(lp.wo).T
    b = _rms(x, f64(lp.ffn_norm), cfg.rms_norm_eps)
    wgu = f64(lp.wgu)
    f = cfg.intermediate_size
    g, u = b @ wgu[:f].T, b @ wgu[f:].T
    x = x + (g / (1 + np.exp(-g)) * u) @ f64(lp.wd).T
    hs.append(x)
  hs[-1] = _rms(x, f64(params.final_norm), cfg.rms_norm_eps)
  head = f64(params.embed if params.lm_head is None else params.lm_head)
  return hs, hs[-1] @ head.T
