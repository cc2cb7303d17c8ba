"""What the Pallas kernels cannot run, checked before any work (their jnp twins take any shape).

Every kernel masks its power-of-2 tiles, so block width, GQA group, ring and cache slot
counts and GEMM shapes are free; what remains is the head_dim range the kernels' tiles are
built and tested for, and the block width a block-step program holds whole.
"""
from __future__ import annotations

from typing import Sequence

from pallas_kernels._common import check

MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 16
# qk_norm_rope holds a head's whole block in one program (and ring attention a kv head's
# T*G query rows in tiles of them); tested up to 32.
MAX_WIDTH = 64


def check_head_dim(kernel: str, head_dim: int) -> None:
  check(head_dim % HEAD_DIM_MULTIPLE == 0 and HEAD_DIM_MULTIPLE <= head_dim <= MAX_HEAD_DIM,
        kernel, f"head_dim must be a multiple of {HEAD_DIM_MULTIPLE} in "
        f"[{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}]", head_dim)


def check_width(kernel: str, width: int) -> None:
  check(1 <= width <= MAX_WIDTH, kernel, f"block width (rows of the block) must be in "
        f"[1, {MAX_WIDTH}]", width)


def check_drafter(*, n_head: int, n_head_kv: int, head_dim: int, width: int,
                  ring_slots: Sequence[int] = ()) -> None:
  """Raises a ValueError naming the limit and the value for any drafter shape the Pallas
  path cannot run: n_head / n_head_kv heads, head_dim, the widest block `width` the drafter
  will step, and the slot count of each ring / cache it will attend (`ring_slots`)."""
  name = "pallas drafter"
  check(n_head >= 1 and n_head_kv >= 1 and n_head % n_head_kv == 0, name,
        "n_head must be a positive multiple of n_head_kv", (n_head, n_head_kv))
  check_head_dim(name, head_dim)
  check_width(name, width)
  for s in ring_slots:
    check(s >= 1, name, "every ring / cache needs >= 1 slot", s)
