"""The DFlash drafter: device weights (`weights`), the functional step (`step`: ring, encode,
inject, the block step from a family's pieces, rounds, batches) and the stateful wrappers
(`wrappers`)."""
from dflash_jax.drafter import step, weights, wrappers
from dflash_jax.drafter.step import (KVCache, RingState, accept, block_step, block_step_batched,
                                     draft_round, draft_round_batched, encode, greedy_drafts,
                                     init_batched_ring, init_ring, inject, inject_batched,
                                     inject_slot, reset_slot, ring_nbytes)
from dflash_jax.drafter.weights import (ConvParams, DFlash2Params, DrafterParams, DSparkParams,
                                        InjectParams, LayerParams, prepare_weights)
from dflash_jax.drafter.wrappers import BatchedDrafter, CapturedStep, DFlashDrafter
