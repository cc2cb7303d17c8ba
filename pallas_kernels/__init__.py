"""Pallas GPU kernels for the DFlash drafter step (Triton backend; interpret mode on CPU)."""
