"""The numpy references of SPEC.md and SPEC_dflash2_dspark: every kernel and jitted path is
certified against them (family pieces in reference/families.py)."""
from reference.dflash_ref import (DFlashRef, Draft, attention, first_mismatch, ring_visibility,
                                  rms_norm, rope_neox, round_bf16, silu)
