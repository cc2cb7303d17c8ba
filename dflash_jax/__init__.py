"""dflash-jax: DFlash block-diffusion speculative drafting in JAX with Pallas GPU kernels."""
from dflash_jax.config import (QWEN3_8B_CONFIG, SEED_CONFIG, TINY_CONFIG, DFlashConfig,
                               RopeScaling, drafter_tensor_shapes, rope_inv_freq)
from dflash_jax.dispatch import linear, resolve_dtype
from dflash_jax.drafter import (BatchedDrafter, CapturedStep, DFlashDrafter, DrafterParams,
                                InjectParams, KVCache, LayerParams, RingState, accept,
                                block_step, block_step_batched, draft_round, draft_round_batched,
                                encode, greedy_drafts, init_batched_ring, init_ring, inject,
                                inject_batched, inject_slot, prepare_weights, reset_slot,
                                ring_nbytes)
from dflash_jax.io import DrafterFormatError, load_drafter, read_q8_0, save_drafter
from dflash_jax.synthetic import synthetic_drafter, synthetic_features
