"""An independent float64 numpy Muse-Glimmer text forward (a plain per-layer loop), written
from the semantics note (shared/research/target_families.md section 1), for testing
dflash_jax.models.muse_glimmer.

It reads the HF config (the VLM wrapper's dict with `text_config`, or the text config itself)
and the checkpoint's tensors by their stored names, so it shares nothing with the device
layout: not the fused matrices, not the config dataclass, not the defaults.
"""
from __future__ import annotations

import numpy as np

from dflash_jax.config import rope_from_hf, rope_inv_freq
from reference.targets.common import neox_rope, rms

PREFIX = "model.language_model."


def text_config(config: dict) -> dict:
  """The text config with HF's defaults filled in where the keys are absent."""
  c = dict(config.get("text_config", config))
  n = c["num_hidden_layers"]
  rope = c.get("rope_parameters") or {}
  theta = float(c.get("rope_theta", rope.get("rope_theta", 500000.0)))
  c.setdefault("head_dim", 128)
  c.setdefault("rms_norm_eps", 1e-5)
  c.setdefault("post_norm_eps", 1e-8)
  c.setdefault("qk_scale_factor", 3.87)
  c.setdefault("output_multiplier", 0.19611613513818404)
  c.setdefault("final_logit_softcapping", 20.0)
  c.setdefault("sliding_window", 2048)
  c.setdefault("tie_word_embeddings", False)
  # Absent layer kinds: every 4th layer counted back from the last is full attention.
  if c.get("layer_types") is None:
    c["layer_types"] = ["full_attention" if (n - 1 - i) % 4 == 0 else "sliding_attention"
                        for i in range(n)]
  if c.get("layer_rope_theta") is None:
    c["layer_rope_theta"] = [0.0 if (n - 1 - i) % 4 == 0 else theta for i in range(n)]
  c["rope_theta"] = theta
  c["rope"] = rope_from_hf(c, "text_config")[1]   # RopeScaling
  return c








def hidden_states(config: dict, tensors: dict, tokens, prefix: str = PREFIX):
  """One sequence tokens [T] -> (HF hidden_states: n_layers + 1 arrays [T, H], [0] the normed
  embedding, [n_layers] after the final norm; logits [T, V] after the multiplier and the
  softcap)."""
  c = text_config(config)
  t64 = lambda name: np.asarray(tensors[name], np.float64)
  hq, hkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
  eps, post_eps = c["rms_norm_eps"], c["post_norm_eps"]
  tokens = np.asarray(tokens)
  t = len(tokens)
  pos = np.arange(t)
  rope = (rope_inv_freq(d, c["rope_theta"], c["rope"], np.float64),
          c["rope"].attention_scaling)
  x = rms(t64(prefix + "embed_tokens.weight")[tokens], 1.0, eps)   # weight-less embedding norm
  hs = [x]
  for i in range(c["num_hidden_layers"]):
    p = f"{prefix}layers.{i}."
    w = lambda name: t64(p + name + ".weight")
    h = rms(x, 1.0, eps) * (1 + w("input_layernorm"))
    q = (h @ w("self_attn.q_proj").T).reshape(t, hq, d)
    k = (h @ w("self_attn.k_proj").T).reshape(t, hkv, d)
    v = (h @ w("self_attn.v_proj").T).reshape(t, hkv, d)
    q = rms(q, 1.0, eps) * c["qk_scale_factor"]
    k = rms(k, 1.0, eps)
    if c["layer_rope_theta"][i] != 0:   # an on/off switch: the global theta is used
      q, k = neox_rope(q, pos, *rope), neox_rope(k, pos, *rope)
    diff = pos[:, None] - pos[None, :]
    mask = diff >= 0
    if c["layer_types"][i] == "sliding_attention":
      mask &= diff < c["sliding_window"]
    o = np.zeros((t, hq, d))
    for head in range(hq):
      kh = head // (hq // hkv)
      s = q[:, head] @ k[:, kh].T / np.sqrt(d)
      s = np.where(mask, s, -np.inf)
      pr = np.exp(s - s.max(-1, keepdims=True))
      o[:, head] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kh]
    gate = h @ w("self_attn.gate_proj").T
    o = o.reshape(t, hq * d) / (1 + np.exp(-gate))
    o = o @ w("self_attn.o_proj").T
    x = x + rms(o, 1.0, post_eps) * (1 + w("post_attention_layernorm"))
    h2 = rms(x, 1.0, eps) * (1 + w("pre_feedforward_layernorm"))
    g, u = h2 @ w("mlp.gate_proj").T, h2 @ w("mlp.up_proj").T
    m = (g / (1 + np.exp(-g)) * u) @ w("mlp.down_proj").T
    x = x + rms(m, 1.0, post_eps) * (1 + w("post_feedforward_layernorm"))
    hs.append(x)
  hs[-1] = rms(x, 1.0, eps) * t64(prefix + "norm.weight")   # plain weight
  head = (t64(prefix + "embed_tokens.weight") if c["tie_word_embeddings"]
          else t64("lm_head.weight"))
  z = hs[-1] @ head.T * c["output_multiplier"]
  cap = c["final_logit_softcapping"]
  return hs, (z if cap is None else cap * np.tanh(z / cap))
