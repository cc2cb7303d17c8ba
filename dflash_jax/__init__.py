"""dflash-jax: DFlash block-diffusion speculative drafting in JAX with Pallas GPU kernels."""
from dflash_jax.config import DFlashConfig, rope_inv_freq
from dflash_jax.synthetic import (QWEN3_8B_CONFIG, SEED_CONFIG, TINY_CONFIG, drafter_tensor_shapes,
                                  synthetic_drafter, synthetic_features)
