"""Qwen3.5 / 3.6 / 3.8 hybrid (Gated DeltaNet + gated full attention) in numpy float64.

Written from shared/research/target_families.md section 2 as a plain loop: per layer, and
inside a Gated DeltaNet layer per token and per value head. It reads the checkpoint as HF
stores it (tensor names and the HF config dict), so it shares no layout code with
dflash_jax.models.qwen3_5: the `qwen3_5` split projections (`in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a`) and the `qwen3_next` per-key-head groups (`in_proj_qkvz`,
`in_proj_ba`) are both unpacked here from the note's description.
"""
from __future__ import annotations

import numpy as np

from reference.targets.common import rms, silu

L2_EPS = 1e-6   # the l2 norm of q and k: x / sqrt(sum x^2 + 1e-6)


def text_config(config: dict) -> tuple[dict, str, str]:
  """(the text model's keys, tensor name prefix, storage layout) of an HF config dict."""
  model_type = config["model_type"]
  if model_type == "qwen3_5":
    text = {**config.get("text_config", {})}
    for key in ("tie_word_embeddings", "eos_token_id"):
      if key not in text and key in config:
        text[key] = config[key]
    return text, "model.language_model.", "qwen3_5"
  if model_type in ("qwen3_5_text", "qwen3_next"):
    return config, "model.", model_type
  raise ValueError(f"not a Qwen3.5 / Qwen3-Next config: model_type {model_type!r}")


def layer_kinds(text: dict) -> list[str]:
  n = text["num_hidden_layers"]
  if text.get("layer_types"):
    return list(text["layer_types"])
  interval = text.get("full_attention_interval", 4)
  return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def _rope_facts(text: dict) -> tuple[float, float]:
  rope = text.get("rope_parameters") or {}
  theta = rope.get("rope_theta", text.get("rope_theta"))
  factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
  return float(theta), float(factor)





def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))





def _softplus(x):
  return np.logaddexp(0.0, x)


def _partial_rope(x: np.ndarray, positions: np.ndarray, theta: float, rot: int) -> np.ndarray:
  """NEOX rope of the first rot dims of x [T, H, D] (pairs (i, i + rot/2)); the rest passes."""
  inv = theta ** (-np.arange(0, rot, 2, dtype=np.float64) / rot)
  ang = positions.astype(np.float64)[:, None, None] * inv
  half = rot // 2
  x1, x2 = x[..., :half], x[..., half:rot]
  return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                         x2 * np.cos(ang) + x1 * np.sin(ang), x[..., rot:]], axis=-1)


def _gated_attention(t: dict, p: str, text: dict, h: np.ndarray) -> np.ndarray:
  """Causal gated full attention over h [T, H] at positions 0..T-1."""
  n_tok = h.shape[0]
  nh, nkv = text["num_attention_heads"], text["num_key_value_heads"]
  d = text.get("head_dim") or text["hidden_size"] // nh
  eps = text.get("rms_norm_eps", 1e-6)
  theta, factor = _rope_facts(text)
  rot = int(d * factor)
  both = (h @ t[p + "q_proj.weight"].T).reshape(n_tok, nh, 2 * d)
  q, gate = both[..., :d], both[..., d:]           # per head: query dims, then gate dims
  k = (h @ t[p + "k_proj.weight"].T).reshape(n_tok, nkv, d)
  v = (h @ t[p + "v_proj.weight"].T).reshape(n_tok, nkv, d)
  q = rms(q, 1.0 + t[p + "q_norm.weight"], eps)
  k = rms(k, 1.0 + t[p + "k_norm.weight"], eps)
  pos = np.arange(n_tok)
  q, k = _partial_rope(q, pos, theta, rot), _partial_rope(k, pos, theta, rot)
  out = np.zeros((n_tok, nh, d))
  causal = np.tril(np.ones((n_tok, n_tok), bool))
  for head in range(nh):
    kh = head // (nh // nkv)
    s = np.where(causal, q[:, head] @ k[:, kh].T / np.sqrt(d), -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    out[:, head] = (e / e.sum(-1, keepdims=True)) @ v[:, kh]
  out = out.reshape(n_tok, nh * d) * _sigmoid(gate.reshape(n_tok, nh * d))
  return out @ t[p + "o_proj.weight"].T


def gdn_projections(t: dict, p: str, text: dict, layout: str, h: np.ndarray):
  """(mixed [T, C] pre-conv rows, z [T, nv, dv], b [T, nv], a [T, nv]) of h [T, H].

  C = 2 nk dk + nv dv, channels: all q heads, all k heads, all v heads. qwen3_next stores
  the same rows grouped per key head (q, k, the r = nv / nk value heads' v, their z; and b
  for those r heads, then their a), unpacked here head group by head group."""
  nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
  dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
  n_tok = h.shape[0]
  if layout != "qwen3_next":
    mixed = h @ t[p + "in_proj_qkv.weight"].T
    z = (h @ t[p + "in_proj_z.weight"].T).reshape(n_tok, nv, dv)
    return mixed, z, h @ t[p + "in_proj_b.weight"].T, h @ t[p + "in_proj_a.weight"].T
  r = nv // nk
  qkvz = (h @ t[p + "in_proj_qkvz.weight"].T).reshape(n_tok, nk, 2 * dk + 2 * r * dv)
  ba = (h @ t[p + "in_proj_ba.weight"].T).reshape(n_tok, nk, 2 * r)
  qs, ks, vs, zs, bs, as_ = [], [], [], [], [], []
  for kh in range(nk):
    grp = qkvz[:, kh]
    qs.append(grp[:, :dk])
    ks.append(grp[:, dk:2 * dk])
    vs.append(grp[:, 2 * dk:2 * dk + r * dv])
    zs.append(grp[:, 2 * dk + r * dv:])
    bs.append(ba[:, kh, :r])
    as_.append(ba[:, kh, r:])
  mixed = np.concatenate(qs + ks + vs, axis=-1)
  z = np.concatenate(zs, axis=-1).reshape(n_tok, nv, dv)
  return mixed, z, np.concatenate(bs, axis=-1), np.concatenate(as_, axis=-1)


def _gated_deltanet(t: dict, p: str, text: dict, layout: str, h: np.ndarray):
  """One Gated DeltaNet mixer over h [T, H] from a zero state, token by token.
  Returns (out [T, H], S [nv, dk, dv] after the last token, conv window [K-1, C])."""
  nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
  dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
  kdim = text.get("linear_conv_kernel_dim", 4)
  eps = text.get("rms_norm_eps", 1e-6)
  n_tok = h.shape[0]
  mixed, z, b, a = gdn_projections(t, p, text, layout, h)
  conv_w = t[p + "conv1d.weight"][:, 0, :]          # [C, K]
  a_log, dt_bias = t[p + "A_log"], t[p + "dt_bias"]
  window = np.zeros((kdim - 1, mixed.shape[1]))     # the K-1 latest pre-conv rows
  state = np.zeros((nv, dk, dv))
  o = np.zeros((n_tok, nv, dv))
  for i in range(n_tok):
    hist = np.concatenate([window, mixed[i:i + 1]], axis=0)    # [K, C], oldest first
    c = silu(sum(conv_w[:, j] * hist[j] for j in range(kdim)))
    window = hist[1:]
    q = c[:nk * dk].reshape(nk, dk)
    k = c[nk * dk:2 * nk * dk].reshape(nk, dk)
    v = c[2 * nk * dk:].reshape(nv, dv)
    q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + L2_EPS) / np.sqrt(dk)
    k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + L2_EPS)
    beta = _sigmoid(b[i])
    g = -np.exp(a_log) * _softplus(a[i] + dt_bias)
    for j in range(nv):
      kh = j // (nv // nk)
      state[j] = np.exp(g[j]) * state[j]
      u = (v[j] - state[j].T @ k[kh]) * beta[j]
      state[j] = state[j] + np.outer(k[kh], u)
      o[i, j] = state[j].T @ q[kh]
  o = rms(o, t[p + "norm.weight"], eps) * silu(z)
  return o.reshape(n_tok, nv * dv) @ t[p + "out_proj.weight"].T, state, window


def forward(tensors: dict, config: dict, tokens):
  """One sequence tokens [T] -> (hidden_states: n_layers + 1 arrays [T, H], the last after
  the final norm; logits [T, V]; {layer: (S [nv, dk, dv], conv window [K-1, C])} of every
  Gated DeltaNet layer after the last token)."""
  text, prefix, layout = text_config(config)
  t = {name: np.asarray(a, np.float64) for name, a in tensors.items()}
  eps = text.get("rms_norm_eps", 1e-6)
  x = t[prefix + "embed_tokens.weight"][np.asarray(tokens)]
  hs, states = [x], {}
  for i, kind in enumerate(layer_kinds(text)):
    p = f"{prefix}layers.{i}."
    h = rms(x, 1.0 + t[p + "input_layernorm.weight"], eps)
    if kind == "full_attention":
      x = x + _gated_attention(t, p + "self_attn.", text, h)
    else:
      y, s, w = _gated_deltanet(t, p + "linear_attn.", text, layout, h)
      x = x + y
      states[i] = (s, w)
    h = rms(x, 1.0 + t[p + "post_attention_layernorm.weight"], eps)
    gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
    x = x + (silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    hs.append(x)
  hs[-1] = rms(x, 1.0 + t[prefix + "norm.weight"], eps)
  head = t.get("lm_head.weight")
  if head is None or text.get("tie_word_embeddings", False):
    head = t[prefix + "embed_tokens.weight"]
  return hs, hs[-1] @ head.T, states
