"""Static drafter configuration (SPEC.md section 2) and the host rope table."""
from __future__ import annotations

import dataclasses

import numpy as np


SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)   # HF `layer_types` spellings
DEFAULT_WINDOW = 2048
DEFAULT_BLOCK_SIZE = 16   # a checkpoint that states no block size (docs/SPEC.md section 2)
DEFAULT_CAPACITY = 8192


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  """Everything about a drafter's shape that a compiled step depends on.

  Frozen and hashable, so it can be a static argument of `jax.jit`.
  `target_layers` follows llama.cpp: HF `target_layer_ids` + 1.
  `window` is the sliding window W (a checkpoint without one has no sliding layer, docs/SPEC.md
  section 2; a config made in code with sliding layers and no window runs them at the
  caller's `window`, default 2048, and cannot be saved). `layer_types` gives each layer's
  attention kind (docs/SPEC.md section 7): "sliding_attention" (a ring of W slots, visibility
  `0 <= q - p < W`) or "full_attention" (every injected position < n_past visible; a cache of
  a caller-chosen capacity, `resolve_capacity`). None means every layer slides (an
  all-sliding tuple is stored as None, so configs read from different formats compare equal).
  `context_length` is the target's context length when the file states it.
  """
  n_layer: int
  n_embd: int
  n_ff: int
  n_head: int
  n_head_kv: int
  head_dim: int
  rope_theta: float
  eps: float
  target_layers: tuple[int, ...]
  mask_token_id: int
  block_size: int = DEFAULT_BLOCK_SIZE
  window: int | None = None
  layer_types: tuple[str, ...] | None = None
  context_length: int | None = None

  def __post_init__(self):
    problems = []
    for name in ("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim", "block_size"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or v <= 0:
        problems.append(f"{name} must be a positive int, got {v!r}")
    if not problems and self.n_head % self.n_head_kv:
      problems.append(f"n_head ({self.n_head}) must be a multiple of n_head_kv ({self.n_head_kv})")
    if not problems and self.head_dim % 2:
      problems.append(f"head_dim must be even for NEOX rope, got {self.head_dim}")
    if not self.target_layers:
      problems.append("target_layers is empty")
    if not (self.rope_theta > 0):
      problems.append(f"rope_theta must be > 0, got {self.rope_theta!r}")
    if not (self.eps > 0):
      problems.append(f"eps must be > 0, got {self.eps!r}")
    if self.mask_token_id < 0:
      problems.append(f"mask_token_id must be >= 0, got {self.mask_token_id}")
    if self.window is not None and self.window <= 0:
      problems.append(f"window must be positive or None, got {self.window}")
    if self.context_length is not None and self.context_length <= 0:
      problems.append(f"context_length must be positive or None, got {self.context_length}")
    if self.layer_types is not None:
      kinds = tuple(self.layer_types)
      bad = sorted(set(kinds) - set(LAYER_TYPES))
      if bad:
        problems.append(f"layer_types must hold {LAYER_TYPES}, got {bad}")
      elif not problems and len(kinds) != self.n_layer:
        problems.append(f"layer_types has {len(kinds)} entries for n_layer {self.n_layer}")
      object.__setattr__(self, "layer_types", None if set(kinds) <= {SLIDING} else kinds)
    if problems:
      raise ValueError("invalid DFlashConfig: " + "; ".join(problems))
    object.__setattr__(self, "target_layers", tuple(int(t) for t in self.target_layers))

  @property
  def n_target_layers(self) -> int:
    return len(self.target_layers)

  @property
  def n_embd_fc(self) -> int:
    """Width of one feature row: the captured target layers concatenated."""
    return self.n_target_layers * self.n_embd

  @property
  def group(self) -> int:
    """Query heads per kv head (contiguous GQA groups)."""
    return self.n_head // self.n_head_kv

  def resolve_window(self, window: int | None = None) -> int:
    """The sliding window: an explicit `window`, else the file's, else 2048."""
    w = window if window is not None else (self.window if self.window is not None else
                                           DEFAULT_WINDOW)
    if w <= 0:
      raise ValueError(f"window must be positive, got {w}")
    return int(w)

  def with_draft_window(self, window: int) -> "DFlashConfig":
    """This drafter with every layer sliding in a ring of `window` slots: the engines'
    draft-window option for long contexts. A full-attention layer then sees only the last
    `window` positions, an approximation of the checkpoint's drafter, so only a caller's
    explicit choice applies it (docs/SPEC.md section 2; CLI `--draft-window`), never a
    default or a loader."""
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window <= 0:
      raise ValueError(f"window must be a positive int, got {window!r}")
    return dataclasses.replace(self, window=int(window), layer_types=None)

  def resolve_capacity(self, capacity: int | None = None) -> int:
    """Positions a full-attention layer's cache holds: explicit, else context_length, else
    DEFAULT_CAPACITY. Injecting a position >= capacity is an error, never a wrap."""
    c = capacity if capacity is not None else (
        self.context_length if self.context_length is not None else DEFAULT_CAPACITY)
    if c <= 0:
      raise ValueError(f"capacity must be positive, got {c}")
    return int(c)

  @property
  def kinds(self) -> tuple[str, ...]:
    """Each layer's attention kind ("sliding_attention" when layer_types is None)."""
    return self.layer_types if self.layer_types is not None else (SLIDING,) * self.n_layer

  def is_sliding(self, layer: int) -> bool:
    return self.kinds[layer] == SLIDING

  def layers_of(self, kind: str) -> tuple[int, ...]:
    """The layers of one attention kind, in layer order (their order in that kind's cache)."""
    return tuple(l for l, k in enumerate(self.kinds) if k == kind)

  @property
  def kind_groups(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(kind, layers) for each kind some layer has, sliding first: one K/V cache each."""
    return tuple((k, self.layers_of(k)) for k in LAYER_TYPES if self.layers_of(k))

  def index_in_kind(self, layer: int) -> int:
    """Where layer sits in its kind's stacked cache."""
    return self.layers_of(self.kinds[layer]).index(layer)

  def resolve_width(self, width: int | None = None) -> int:
    """The block width (SPEC.md section 6): block_size when None, else 2 <= width <=
    block_size."""
    w = self.block_size if width is None else width
    if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or not 2 <= w <= self.block_size:
      raise ValueError(f"width must be an int in [2, block_size {self.block_size}], got {width!r}")
    return int(w)


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
  """NEOX inverse frequencies theta^(-2i/hd), i < hd/2: computed in float64, returned as float32.

  Computed on the host so no device pow is involved and every device sees the same table.
  """
  i = np.arange(head_dim // 2, dtype=np.float64)
  return (float(theta) ** (-2.0 * i / head_dim)).astype(np.float32)


# The seed product's drafter (Muse Glimmer 30B assistant): 5 sliding layers, window 2048.
SEED_CONFIG = DFlashConfig(
    n_layer=5, n_embd=6656, n_ff=19968, n_head=32, n_head_kv=8, head_dim=128,
    rope_theta=5e5, eps=1e-6, target_layers=(2, 14, 26, 38, 50), mask_token_id=8191,
    block_size=16, window=2048)
# z-lab/Qwen3-8B-DFlash-b16 as its config.json publishes it (what `load_drafter` reads from
# that file; tests/test_hf_io.py holds the two equal): 5 full-attention layers (no sliding
# window), HF target_layer_ids [1, 9, 17, 25, 33] (target_layers = those + 1), mask token
# 151669, block 16, rope_theta 1e6, max_position_embeddings 40960 (the context length: the
# default capacity of its full-attention cache; pass `capacity` to hold fewer positions).
QWEN3_8B_CONFIG = DFlashConfig(
    n_layer=5, n_embd=4096, n_ff=12288, n_head=32, n_head_kv=8, head_dim=128,
    rope_theta=1e6, eps=1e-6, target_layers=(2, 10, 18, 26, 34), mask_token_id=151669,
    block_size=16, window=None, layer_types=(FULL,) * 5, context_length=40960)
# Small enough for CPU tests and interpret-mode kernels; every axis still > 1.
TINY_CONFIG = DFlashConfig(
    n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, head_dim=16,
    rope_theta=1e4, eps=1e-6, target_layers=(1, 3, 5), mask_token_id=7,
    block_size=8, window=32)


def drafter_tensor_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
  """The (out, in) numpy shape of every drafter tensor, keyed without `.weight`."""
  e, hd = cfg.n_embd, cfg.head_dim
  shapes = {"fc": (e, cfg.n_embd_fc), "enc.output_norm": (e,), "output_norm": (e,)}
  for i in range(cfg.n_layer):
    p = f"blk.{i}."
    shapes.update({
        p + "attn_norm": (e,),
        p + "attn_q": (cfg.n_head * hd, e),
        p + "attn_k": (cfg.n_head_kv * hd, e),
        p + "attn_v": (cfg.n_head_kv * hd, e),
        p + "attn_output": (e, cfg.n_head * hd),
        p + "attn_q_norm": (hd,),
        p + "attn_k_norm": (hd,),
        p + "ffn_norm": (e,),
        p + "ffn_gate": (cfg.n_ff, e),
        p + "ffn_up": (cfg.n_ff, e),
        p + "ffn_down": (e, cfg.n_ff),
    })
  return shapes
