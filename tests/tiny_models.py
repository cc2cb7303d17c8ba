"""Tiny random target + drafter pairs for the decoding tests (CPU-sized, every axis > 1)."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

import dflash_jax as dfj
from dflash_jax import decode as D
from dflash_jax.models import qwen3 as Q


def target(vocab=97, hidden=64, layers=2, seed=0, logit_scale=1.0):
  """A random target; logit_scale multiplies its LM head (spread or sharpen its p)."""
  cfg = Q.TargetConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, rope_theta=1e4, max_position_embeddings=512)
  p = Q.init_params(cfg, jax.random.key(seed))
  if logit_scale != 1.0:
    p = p.replace(lm_head=p.lm_head * logit_scale)
  return cfg, p


def drafter_weights(tcfg, seed=0, block_size=8, window=32):
  """(DFlashConfig, host weights without tok_embd / lm_head) of a random drafter of tcfg."""
  cfg = dataclasses.replace(dfj.TINY_CONFIG, n_layer=1, n_embd=tcfg.hidden_size,
                            target_layers=tuple(range(1, tcfg.num_hidden_layers + 1)),
                            mask_token_id=tcfg.vocab_size - 1, block_size=block_size,
                            window=window)
  return cfg, dfj.synthetic_drafter(cfg, seed=seed, with_target=False)


def drafter(tcfg, tparams, seed=0, block_size=8, window=32, d2t=None):
  """A random drafter of the target (its tok_embd / lm_head are the target's; with d2t, the
  head keeps only those rows: a reduced draft vocab)."""
  cfg, w = drafter_weights(tcfg, seed, block_size, window)
  w["tok_embd"] = np.asarray(tparams.embed)
  head = np.asarray(tparams.head)
  w["lm_head"] = head if d2t is None else head[np.asarray(d2t)]
  return dfj.prepare_weights(cfg, w)


def models(tcfg, tparams, dparams, d2t=None):
  return D.Models(target=tparams, drafter=dparams,
                  d2t=None if d2t is None else jax.numpy.asarray(d2t, jax.numpy.int32),
                  target_cfg=tcfg)


def noisy_oracle_state(prompts, continuations, seed, vocab, length):
  """The oracle proposer's state (`benchmarks.oracle.Oracle`): each prompt followed by the
  target's own continuation with ~1/4 of its tokens changed, so every acceptance length
  occurs, with corrections after partial accepts and bonus tokens after full ones."""
  from benchmarks.oracle import Oracle
  rng = np.random.default_rng(seed)
  out = []
  for p, c in zip(prompts, continuations):
    c = np.array(c)
    bad = rng.random(len(c)) < 0.25
    c[bad] = (c[bad] + 1 + rng.integers(0, vocab - 2, bad.sum())) % vocab
    out.append(list(p) + c.tolist())
  return Oracle.state(out, length)
