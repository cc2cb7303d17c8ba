"""Helpers shared by the kernel modules."""
from __future__ import annotations

import jax


def resolve_interpret(interpret: bool | None) -> bool:
  """None means: compile for the GPU when the default backend is one, else interpret."""
  if interpret is None:
    return jax.default_backend() != "gpu"
  return bool(interpret)


def is_pow2(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


def check(cond: bool, kernel: str, limit: str, value) -> None:
  """Raise a ValueError naming the kernel, the violated limit and the offending value."""
  if not cond:
    raise ValueError(f"{kernel}: {limit} (got {value})")
