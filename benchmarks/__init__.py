"""Benchmarks: python -m benchmarks.run --gpu (see run.py)."""
