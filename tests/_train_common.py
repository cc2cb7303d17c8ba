"""Shared by the tests/test_train*.py files: tiny configs and the jitted train step (compiled
with conftest.py's XLA flags, like every test)."""
import dataclasses

import jax
import numpy as np

import dflash_jax as dfj
from dflash_jax.config import DFlash2Fields, DSparkFields
from dflash_jax.models import qwen3

TCFG = qwen3.TargetConfig(vocab_size=80, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, rope_theta=1e4)
CFG = dfj.DFlashConfig(n_layer=1, n_embd=32, n_ff=64, n_head=2, n_head_kv=1, head_dim=16,
                       rope_theta=1e4, eps=1e-6, target_layers=(1, 2), mask_token_id=79,
                       block_size=8, window=16)

from dflash_jax.train import trainer as TR  # noqa: E402

TC = TR.DrafterTrainConfig(optim=TR.OptimConfig(lr=1e-2, total_steps=40, warmup_steps=2),
                           compute_dtype="bf16")
TRAIN_STATIC = ("cfg", "target_cfg", "tc")
drafter_step = jax.jit(TR.drafter_train_step, static_argnames=TRAIN_STATIC,
                       donate_argnames=("state",))

# The families at CFG's dims: DFlash2 (block 8, K 2, G 8, R 8, top 4, softcap) and DSpark
# (block 7, shifted rows, vanilla Markov head, confidence head with the Markov feature).
CFG2 = dataclasses.replace(CFG, family="dflash2", family_fields=DFlash2Fields(
    conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=4,
    output_multiplier=0.5, final_logit_softcapping=12.0))
CFG_SPARK = dataclasses.replace(CFG, block_size=7, family="dspark", family_fields=DSparkFields(
    sample_from_anchor=True, markov_rank=8, markov_head_type="vanilla", confidence_head=True,
    confidence_with_markov=True))


def setup_data(seed=0, n_seq=16, t=32):
  """(TCFG's random target params, random token data for it: n_seq sequences of t tokens,
  the first 4 of each masked out of the loss)."""
  from dflash_jax.train import data as D
  target = qwen3.init_params(TCFG, jax.random.key(seed))
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 79, (n_seq, t)).astype(np.int32)
  mask = np.ones_like(tokens, bool)
  mask[:, :4] = False
  return target, D.DrafterData(tokens, mask, batch_size=8, n_anchors=8, seed=seed)
