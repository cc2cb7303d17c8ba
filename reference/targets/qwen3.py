"""An independent float64 numpy Qwen3 / Llama-3 forward, written from HF's modeling code
semantics (a plain per-layer loop), for testing dflash_jax.models.qwen3 (it reads the device
params' fused matrices by their row blocks)."""
from __future__ import annotations

import numpy as np

from dflash_jax.config import rope_inv_freq
from reference.targets.common import neox_rope, rms








def hidden_states(params, cfg, tokens):
  """One sequence tokens [T] -> (HF hidden_states: list of n_layers + 1 arrays [T, E], the
  last after the final norm; logits [T, V])."""
  f64 = lambda a: None if a is None else np.asarray(a, np.float64)
  hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  t = len(tokens)
  pos = np.arange(t)
  rope = (rope_inv_freq(d, cfg.rope_theta, cfg.rope_scaling, np.float64),
          cfg.rope_scaling.attention_scaling)
  x = f64(params.embed)[np.asarray(tokens)]
  hs = [x]
  for lp in params.layers:
    wqkv = f64(lp.wqkv)
    wq, wk, wv = wqkv[:hq * d], wqkv[hq * d:(hq + hkv) * d], wqkv[(hq + hkv) * d:]
    a = rms(x, f64(lp.attn_norm), cfg.rms_norm_eps)
    q = (a @ wq.T).reshape(t, hq, d)
    k = (a @ wk.T).reshape(t, hkv, d)
    v = (a @ wv.T).reshape(t, hkv, d)
    if cfg.qk_norm:
      q = rms(q, f64(lp.q_norm), cfg.rms_norm_eps)
      k = rms(k, f64(lp.k_norm), cfg.rms_norm_eps)
    q, k = neox_rope(q, pos, *rope), neox_rope(k, pos, *rope)
    o = np.zeros((t, hq, d))
    for h in range(hq):
      kh = h // (hq // hkv)
      s = q[:, h] @ k[:, kh].T / np.sqrt(d)
      s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
      p = np.exp(s - s.max(-1, keepdims=True))
      o[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, kh]
    x = x + o.reshape(t, hq * d) @ f64(lp.wo).T
    b = rms(x, f64(lp.ffn_norm), cfg.rms_norm_eps)
    wgu = f64(lp.wgu)
    f = cfg.intermediate_size
    g, u = b @ wgu[:f].T, b @ wgu[f:].T
    x = x + (g / (1 + np.exp(-g)) * u) @ f64(lp.wd).T
    hs.append(x)
  hs[-1] = rms(x, f64(params.final_norm), cfg.rms_norm_eps)
  head = f64(params.embed if params.lm_head is None else params.lm_head)
  return hs, hs[-1] @ head.T
