"""The fp32 numpy reference of SPEC.md: every kernel and jitted path is certified against it."""
from reference.dflash_ref import (DFlashRef, attention, first_mismatch, ring_visibility, rms_norm,
                                  rope_neox, round_bf16, silu)
