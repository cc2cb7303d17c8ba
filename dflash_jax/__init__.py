"""dflash-jax: DFlash block-diffusion speculative drafting in JAX with Pallas GPU kernels."""
from dflash_jax.config import (QWEN3_8B_CONFIG, SEED_CONFIG, TINY_CONFIG, DFlashConfig,
                               drafter_tensor_shapes, rope_inv_freq)
from dflash_jax.dispatch import linear, resolve_dtype
from dflash_jax.drafter import (BatchedDrafter, CapturedStep, DFlashDrafter, DrafterParams,
                                InjectParams, KVCache, LayerParams, RingState, accept,
                                block_step, block_step_batched, draft_round, draft_round_batched,
                                encode, greedy_drafts, init_batched_ring, init_ring, inject,
                                inject_batched, inject_slot, prepare_weights, reset_slot,
                                ring_nbytes)
from dflash_jax.gguf_io import DrafterFormatError, load_drafter, read_q8_0, save_drafter
from dflash_jax.hf_io import config_from_hf, config_to_hf, load_hf_drafter, save_hf_drafter
from dflash_jax.safetensors_io import SafetensorsFormatError, read_tensors, write_tensors
from dflash_jax.synthetic import synthetic_drafter, synthetic_features
