"""Static drafter configuration (SPEC.md section 2) and the host rope table."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import numpy as np


SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)   # HF `layer_types` spellings
DEFAULT_WINDOW = 2048
DEFAULT_BLOCK_SIZE = 16   # a checkpoint that states no block size (docs/SPEC.md section 2)
DEFAULT_CAPACITY = 8192
FAMILIES = ("dflash", "dflash2", "dspark")
MARKOV_HEADS = ("vanilla", "gated", "rnn")
ROPE_TYPES = ("none", "linear", "llama3", "yarn")   # RopeScaling.rope_type


@dataclasses.dataclass(frozen=True)
class DFlash2Fields:
  """What DFlash2 adds to a DFlash drafter (SPEC_dflash2_dspark sections 3-7).

  conv_kernel_size K: taps of each grouped dynamic causal convolution; conv_group_size G:
  channels sharing one dynamic coefficient (n_embd / G groups); selector_rank R and
  selector_top_k k: the candidate selector's codebook rank and candidates per draft row.
  output_multiplier then final_logit_softcapping (None = off; 0 is read as off) shape the
  logits; input_embedding_scale multiplies every block row's embedding. is_causal is the
  resolved block-attention causality: one bool for every layer, or one per layer (an
  all-equal tuple is stored as its bool). A file that omits the flag is resolved by
  `resolve_is_causal` with the file's format named, never guessed here.
  """
  conv_kernel_size: int
  conv_group_size: int
  selector_rank: int
  selector_top_k: int
  output_multiplier: float = 1.0
  final_logit_softcapping: float | None = None
  input_embedding_scale: float = 1.0
  is_causal: bool | tuple[bool, ...] = False

  def __post_init__(self):
    problems = []
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        problems.append(f"{name} must be a positive int, got {v!r}")
    m = self.output_multiplier
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not np.isfinite(m) or m == 0:
      problems.append(f"output_multiplier must be a finite nonzero number, got {m!r}")
    c = self.final_logit_softcapping
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                          or not np.isfinite(c) or c < 0):
      problems.append(f"final_logit_softcapping must be None or a finite number >= 0, got {c!r}")
    e = self.input_embedding_scale
    if isinstance(e, bool) or not isinstance(e, (int, float)) or not np.isfinite(e) or e == 0:
      problems.append(f"input_embedding_scale must be a finite nonzero number, got {e!r}")
    causal = self.is_causal
    if isinstance(causal, (bool, np.bool_)):
      causal = bool(causal)
    elif isinstance(causal, (tuple, list)) and causal and all(
        isinstance(b, (bool, np.bool_)) for b in causal):
      causal = tuple(bool(b) for b in causal)
      causal = causal[0] if len(set(causal)) == 1 else causal
    else:
      problems.append(f"is_causal must be a bool or a non-empty tuple of bools (one per layer), "
                      f"got {causal!r}; a file without the flag is resolved by "
                      f"resolve_is_causal")
    if problems:
      raise ValueError("invalid DFlash2Fields: " + "; ".join(problems))
    object.__setattr__(self, "final_logit_softcapping", None if not c else float(c))
    object.__setattr__(self, "output_multiplier", float(m))
    object.__setattr__(self, "input_embedding_scale", float(e))
    object.__setattr__(self, "is_causal", causal)


@dataclasses.dataclass(frozen=True)
class DSparkFields:
  """What DSpark adds to a DFlash drafter (SPEC_dflash2_dspark sections 9-12).

  sample_from_anchor: shifted rows, block row i predicts position n_past + i + 1 (a block of
  w rows gives w drafts); False keeps DFlash's rows (row i predicts n_past + i, drafts from
  rows 1..w-1). markov_rank R (0 = no Markov head) and markov_head_type ("vanilla", "gated"
  or "rnn"; None exactly when R is 0). confidence_head: the per-row acceptance estimate;
  confidence_with_markov: its input is [h ; W1[prev]] instead of h (needs R > 0).
  """
  sample_from_anchor: bool = True
  markov_rank: int = 0
  markov_head_type: str | None = None
  confidence_head: bool = False
  confidence_with_markov: bool = False

  def __post_init__(self):
    problems = []
    for name in ("sample_from_anchor", "confidence_head", "confidence_with_markov"):
      if not isinstance(getattr(self, name), (bool, np.bool_)):
        problems.append(f"{name} must be a bool, got {getattr(self, name)!r}")
    r = self.markov_rank
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0:
      problems.append(f"markov_rank must be an int >= 0, got {r!r}")
    elif r > 0 and self.markov_head_type not in MARKOV_HEADS:
      problems.append(f"markov_head_type must be one of {MARKOV_HEADS} when markov_rank > 0, "
                      f"got {self.markov_head_type!r}")
    elif r == 0 and self.markov_head_type is not None:
      problems.append(f"markov_head_type must be None when markov_rank is 0 (no Markov head), "
                      f"got {self.markov_head_type!r}")
    if self.confidence_with_markov and not self.confidence_head:
      problems.append("confidence_with_markov needs confidence_head")
    if self.confidence_with_markov and isinstance(r, (int, np.integer)) and r == 0:
      problems.append("confidence_with_markov needs a Markov head (markov_rank > 0)")
    if problems:
      raise ValueError("invalid DSparkFields: " + "; ".join(problems))
    for name in ("sample_from_anchor", "confidence_head", "confidence_with_markov"):
      object.__setattr__(self, name, bool(getattr(self, name)))
    object.__setattr__(self, "markov_rank", int(r))


_FAMILY_FIELDS = {"dflash": type(None), "dflash2": DFlash2Fields, "dspark": DSparkFields}


def resolve_is_causal(flag: bool | None, kinds: tuple[str, ...], source: str
                      ) -> bool | tuple[bool, ...]:
  """DFlash2's block causality from a file's `is_causal` flag (SPEC_dflash2_dspark 5.4, 13.1).

  A present flag holds for every layer. An absent flag (None) follows the documented default
  of the file's format, which the two formats' reference code disagrees on: `source` "hf"
  (z-lab's model code: sliding layers causal, full-attention layers not) or "gguf" (llama.cpp:
  non-causal unless `dflash.attention.causal` is true). `kinds` is each layer's attention kind.
  """
  if flag is not None:
    if not isinstance(flag, (bool, np.bool_)):
      raise ValueError(f"is_causal must be a bool or None (absent), got {flag!r}")
    return bool(flag)
  if source == "hf":
    bad = sorted(set(kinds) - set(LAYER_TYPES))
    if bad or not kinds:
      raise ValueError(f"kinds must be a non-empty tuple of {LAYER_TYPES}, got {kinds!r}")
    return tuple(k == SLIDING for k in kinds)
  if source == "gguf":
    return False
  raise ValueError(f"source must be 'hf' or 'gguf' (whose default applies when is_causal is "
                   f"absent), got {source!r}")


# The fields each rope type reads (the others keep their defaults).
_ROPE_FIELDS = {
    "none": (),
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor",
               "high_freq_factor"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "mscale", "mscale_all_dim", "truncate"),
}


def _finite(v: Any) -> bool:
  return not isinstance(v, bool) and isinstance(v, (int, float, np.integer, np.floating)) and (
      math.isfinite(v))


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """How a model stretches its rope past the context it was trained on (HF `rope_scaling` /
  `rope_parameters`, llama.cpp `<arch>.rope.scaling.*`), as HF's rope utilities define it.

  rope_type "none" (HF's "default"); "linear": every inverse frequency divided by `factor`;
  "llama3" (Llama 3.1): wavelengths longer than original / low_freq_factor divided by
  `factor`, shorter than original / high_freq_factor kept, the band between interpolated;
  "yarn": each inverse frequency blended between itself and itself / `factor` by a ramp over
  the dimensions turning between `beta_fast` and `beta_slow` times within
  `original_max_position_embeddings` positions (ramp ends cut to whole dimensions when
  `truncate`), and cos and sin multiplied by the attention factor (`attention_scaling`).
  `attention_factor` None takes HF's default from factor, mscale and mscale_all_dim. A field
  the type does not read must keep its default; `original_max_position_embeddings` is stated
  (the loaders fill HF's default, the model's max_position_embeddings). Frozen and hashable:
  part of the static configs.
  """
  rope_type: str = "none"
  factor: float = 1.0
  original_max_position_embeddings: int | None = None
  low_freq_factor: float | None = None
  high_freq_factor: float | None = None
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool = True

  def __post_init__(self):
    kind = self.rope_type
    if kind not in ROPE_TYPES:
      raise ValueError(f"invalid RopeScaling: rope_type must be one of {ROPE_TYPES}, got "
                       f"{kind!r}")
    problems = [f"{f.name} does not apply to rope_type {kind!r} (got {getattr(self, f.name)!r})"
                for f in dataclasses.fields(self) if f.name != "rope_type"
                and f.name not in _ROPE_FIELDS[kind] and getattr(self, f.name) != f.default]
    reads = _ROPE_FIELDS[kind]
    if "factor" in reads and not (_finite(self.factor) and self.factor > 0):
      problems.append(f"factor must be a finite number > 0, got {self.factor!r}")
    orig = self.original_max_position_embeddings
    if "original_max_position_embeddings" in reads and (
        isinstance(orig, bool) or not isinstance(orig, (int, np.integer)) or orig <= 0):
      problems.append(f"original_max_position_embeddings must be a positive int, got {orig!r}")
    if kind == "llama3":
      lo, hi = self.low_freq_factor, self.high_freq_factor
      if not (_finite(lo) and _finite(hi) and 0 < lo < hi):
        problems.append(f"low_freq_factor and high_freq_factor must be finite numbers with "
                        f"0 < low < high, got {lo!r} and {hi!r}")
    if kind == "yarn":
      for name in ("beta_fast", "beta_slow"):
        if not _finite(getattr(self, name)):
          problems.append(f"{name} must be a finite number, got {getattr(self, name)!r}")
      a = self.attention_factor
      if a is not None and not (_finite(a) and a > 0):
        problems.append(f"attention_factor must be None or a finite number > 0, got {a!r}")
      for name in ("mscale", "mscale_all_dim"):
        v = getattr(self, name)
        if v is not None and not _finite(v):
          problems.append(f"{name} must be None or a finite number, got {v!r}")
      if not isinstance(self.truncate, (bool, np.bool_)):
        problems.append(f"truncate must be a bool, got {self.truncate!r}")
    if problems:
      raise ValueError("invalid RopeScaling: " + "; ".join(problems))
    for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                 "attention_factor", "mscale", "mscale_all_dim"):
      v = getattr(self, name)
      object.__setattr__(self, name, None if v is None else float(v))
    if orig is not None:
      object.__setattr__(self, "original_max_position_embeddings", int(orig))
    object.__setattr__(self, "truncate", bool(self.truncate))

  @property
  def attention_scaling(self) -> float:
    """What cos and sin are multiplied by (HF's rotary `attention_scaling`, so q and k are
    each scaled and the attention logits by its square): YaRN's attention factor, else 1.
    Computed in float64 from the config, as HF's `_compute_yarn_parameters` does."""
    if self.rope_type != "yarn":
      return 1.0
    if self.attention_factor is not None:
      return self.attention_factor
    if self.mscale and self.mscale_all_dim:
      return (_yarn_mscale(self.factor, self.mscale)
              / _yarn_mscale(self.factor, self.mscale_all_dim))
    return _yarn_mscale(self.factor)

  def to_hf(self) -> dict[str, Any] | None:
    """HF's `rope_scaling` dict (None for "none"); `rope_from_hf` reads it back equal."""
    if self.rope_type == "none":
      return None
    out: dict[str, Any] = {"rope_type": self.rope_type}
    for name in _ROPE_FIELDS[self.rope_type]:
      if getattr(self, name) is not None:
        out[name] = getattr(self, name)
    return out


def checked_rope_scaling(value: Any, problems: list[str]) -> RopeScaling:
  """A config's `rope_scaling` field: None is no scaling; anything but a `RopeScaling` is
  added to `problems` (the config's __post_init__ reports them together)."""
  if value is None:
    return RopeScaling()
  if not isinstance(value, RopeScaling):
    problems.append(f"rope_scaling must be a RopeScaling or None, got {value!r}")
  return value


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction 0.1 mscale ln(scale) + 1 (1 for scale <= 1), HF's
  `get_mscale`."""
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


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

  `family` is "dflash" (SPEC.md), "dflash2" or "dspark" (SPEC_dflash2_dspark);
  `family_fields` holds the family's own fields: None for "dflash", a DFlash2Fields or a
  DSparkFields (the `dflash2` / `dspark` properties return it, checked).
  `rope_scaling` is the drafter's rope scaling (none, linear, llama3 or YaRN; None is read as
  none): `rope_inv_freq` applies it to the table, its `attention_scaling` scales cos and sin.
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
  # The drafter family whose block step runs this config (`dflash_jax.drafter.step.FAMILIES`).
  family: str = "dflash"
  family_fields: DFlash2Fields | DSparkFields | None = None
  rope_scaling: RopeScaling = RopeScaling()

  def __post_init__(self):
    problems = []
    object.__setattr__(self, "rope_scaling", checked_rope_scaling(self.rope_scaling, problems))
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
    problems += self._family_problems(problems)
    if problems:
      raise ValueError("invalid DFlashConfig: " + "; ".join(problems))
    object.__setattr__(self, "target_layers", tuple(int(t) for t in self.target_layers))

  def _family_problems(self, earlier: list[str]) -> list[str]:
    """What is wrong with family / family_fields (the dims are checked first)."""
    if self.family not in FAMILIES:
      return [f"family must be one of {FAMILIES}, got {self.family!r}"]
    want = _FAMILY_FIELDS[self.family]
    if not isinstance(self.family_fields, want):
      need = "None" if want is type(None) else f"a {want.__name__}"
      return [f"family_fields must be {need} for family {self.family!r}, got "
              f"{type(self.family_fields).__name__}"]
    f = self.family_fields
    if self.family != "dflash2" or earlier:
      return []
    problems = []
    if self.n_embd % f.conv_group_size:
      problems.append(f"family_fields.conv_group_size ({f.conv_group_size}) must divide n_embd "
                      f"({self.n_embd})")
    if isinstance(f.is_causal, tuple) and len(f.is_causal) != self.n_layer:
      problems.append(f"family_fields.is_causal has {len(f.is_causal)} entries for n_layer "
                      f"{self.n_layer}")
    return problems

  @property
  def dflash2(self) -> DFlash2Fields:
    """The DFlash2 fields; an error for a drafter of another family."""
    if self.family != "dflash2":
      raise ValueError(f"the drafter's family is {self.family!r}, not 'dflash2'")
    return self.family_fields

  @property
  def dspark(self) -> DSparkFields:
    """The DSpark fields; an error for a drafter of another family."""
    if self.family != "dspark":
      raise ValueError(f"the drafter's family is {self.family!r}, not 'dspark'")
    return self.family_fields

  @property
  def n_conv_groups(self) -> int:
    """DFlash2: dynamic coefficients per convolution tap (n_embd / conv_group_size)."""
    return self.n_embd // self.dflash2.conv_group_size

  def block_causal(self, layer: int) -> bool:
    """Whether layer's block attention is causal (block key j visible to row i iff j <= i).
    Only DFlash2 has causal layers; DFlash and DSpark blocks are bidirectional."""
    if self.family != "dflash2":
      return False
    c = self.dflash2.is_causal
    return c if isinstance(c, bool) else c[layer]

  @property
  def shifted_rows(self) -> bool:
    """DSpark with sample_from_anchor: block row i predicts position n_past + i + 1."""
    return self.family == "dspark" and self.dspark.sample_from_anchor

  @property
  def first_draft_row(self) -> int:
    """The block row of the first draft: 0 with shifted rows, else 1 (row 0 unused)."""
    return 0 if self.shifted_rows else 1

  def n_drafts(self, width: int | None = None) -> int:
    """Drafts of one block of `width` rows (default block_size)."""
    return self.resolve_width(width) - self.first_draft_row

  @property
  def max_verify_width(self) -> int:
    """The most rows a decoding round verifies: id_last and every draft of a full block."""
    return self.n_drafts() + 1

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


def rope_inv_freq(dim: int, theta: float, scaling: RopeScaling | None = None,
                  dtype: Any = np.float32) -> np.ndarray:
  """NEOX inverse frequencies theta^(-2i/dim), i < dim/2, rescaled by `scaling` as HF's rope
  utilities (`_compute_{linear_scaling,llama3,yarn}_parameters`) rescale them.

  dim: the rotated dimensions (head_dim for full rotary). Computed in float64 on the host, so
  no device pow is involved and every device sees the same table; returned as `dtype`
  (float32, what the kernels take; float64 for the references). YaRN's attention factor is
  `scaling.attention_scaling`.
  """
  i = np.arange(dim // 2, dtype=np.float64)
  inv = float(theta) ** (-2.0 * i / dim)
  s = RopeScaling() if scaling is None else scaling
  if s.rope_type == "linear":
    inv = inv / s.factor
  elif s.rope_type == "llama3":
    old = float(s.original_max_position_embeddings)
    lo, hi = s.low_freq_factor, s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    medium = (1 - smooth) * inv / s.factor + smooth * inv
    inv = np.where(wavelen < old / hi, inv, np.where(wavelen > old / lo, inv / s.factor, medium))
  elif s.rope_type == "yarn":
    def turns_dim(turns):   # the dimension that turns `turns` times in the original context
      return (dim * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi))
              / (2 * math.log(theta)))
    low, high = turns_dim(s.beta_fast), turns_dim(s.beta_slow)
    if s.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
      high += 0.001   # HF's guard against a zero-width ramp
    keep = 1 - np.clip((i - low) / (high - low), 0, 1)   # 1: the original frequency
    inv = inv / s.factor * (1 - keep) + inv * keep
  return inv.astype(dtype)


def rope_from_hf(config: Mapping[str, Any], where: str) -> tuple[float | None, RopeScaling]:
  """(rope_theta, RopeScaling) of an HF config dict; theta None when no key states it.

  Reads `rope_theta` and the rope dicts in both spellings: `rope_scaling` (transformers 4:
  {"type" or "rope_type": ..., "factor": ...}) and `rope_parameters` (transformers 5: the
  theta and the scaling in one dict), each flat or keyed by layer type; every key that states
  a value must agree. HF's defaults: rope_type "default" is no scaling, a missing
  `original_max_position_embeddings` is `max_position_embeddings`, YaRN's beta_fast /
  beta_slow 0 or absent are 32 / 1 and a null factor is max_position_embeddings / original.
  Raises ValueError naming `where` and the key: an unsupported rope_type, missing or bad
  values, disagreeing keys. The caller checks `partial_rotary_factor`, which this does not
  read.
  """
  thetas, scalings = [], []
  if config.get("rope_theta") is not None:
    thetas.append(("rope_theta", config["rope_theta"]))
  for key in ("rope_parameters", "rope_scaling"):
    params = config.get(key)
    if params is None:
      continue
    if not isinstance(params, Mapping):
      raise ValueError(f"{where}: {key} is {params!r}, expected an object")
    per_kind = [k for k in params if k in LAYER_TYPES]
    subs = [(f"{key}.{k}", params[k]) for k in per_kind] if per_kind else [(key, params)]
    for name, sub in subs:
      if not isinstance(sub, Mapping):
        raise ValueError(f"{where}: {name} is {sub!r}, expected an object")
      if sub.get("rope_theta") is not None:
        thetas.append((f"{name}.rope_theta", sub["rope_theta"]))
      scalings.append((name, _scaling_from_hf(sub, name, config.get("max_position_embeddings"),
                                              where)))
  for name, v in thetas:
    if not (_finite(v) and v > 0):
      raise ValueError(f"{where}: {name} is {v!r}, expected a finite number > 0")
  if len({float(v) for _, v in thetas}) > 1:
    raise ValueError(f"{where}: rope thetas disagree: "
                     + ", ".join(f"{k} = {v}" for k, v in thetas))
  if len({s for _, s in scalings}) > 1:
    raise ValueError(f"{where}: rope scalings disagree: "
                     + ", ".join(f"{k} = {s.to_hf()}" for k, s in scalings))
  return (float(thetas[0][1]) if thetas else None,
          scalings[0][1] if scalings else RopeScaling())


def _scaling_from_hf(sub: Mapping[str, Any], name: str, max_position: Any,
                     where: str) -> RopeScaling:
  """One HF rope dict (`name` is its key path) -> RopeScaling, with HF's defaults."""
  types = {k: sub[k] for k in ("rope_type", "type") if sub.get(k) is not None}
  if len(set(types.values())) > 1:
    raise ValueError(f"{where}: {name}.rope_type {types['rope_type']!r} disagrees with "
                     f"{name}.type {types['type']!r}")
  hf_type = next(iter(types.values()), "default")
  supported = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}
  if hf_type not in supported:
    raise ValueError(f"{where}: {name}.{next(iter(types))} {hf_type!r} is not supported "
                     f"(supported: {sorted(supported)})")
  kind = supported[hf_type]
  if kind == "none":
    return RopeScaling()
  fields: dict[str, Any] = {"rope_type": kind, "factor": sub.get("factor")}
  if kind in ("llama3", "yarn"):
    orig = sub.get("original_max_position_embeddings", max_position)
    if orig is None:
      raise ValueError(f"{where}: {name} ({hf_type}) needs original_max_position_embeddings "
                       "(nor is max_position_embeddings set)")
    if isinstance(orig, float) and orig.is_integer():
      orig = int(orig)
    fields["original_max_position_embeddings"] = orig
  if kind == "llama3":
    fields.update(low_freq_factor=sub.get("low_freq_factor"),
                  high_freq_factor=sub.get("high_freq_factor"))
  if kind == "yarn":
    if fields["factor"] is None and _finite(max_position) and _finite(orig) and orig > 0:
      fields["factor"] = max_position / orig
    fields.update(beta_fast=sub.get("beta_fast") or 32.0, beta_slow=sub.get("beta_slow") or 1.0,
                  attention_factor=sub.get("attention_factor"), mscale=sub.get("mscale"),
                  mscale_all_dim=sub.get("mscale_all_dim"), truncate=sub.get("truncate", True))
  try:
    return RopeScaling(**fields)
  except ValueError as e:
    raise ValueError(f"{where}: {name}: {e}") from None


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
# z-lab/Muse-Glimmer-30B-DFlash2 as its config.json publishes it: the seed drafter's dims
# (5 sliding layers, window 2048) with K 2, G 16, R 256, k 16, the logit multiplier and
# softcap, is_causal false; HF target_layer_ids [1, 13, 25, 37, 49] (+1 here), mask token
# 201818 of the 202048-token vocabulary, eps 1e-5, max_position_embeddings 131072.
DFLASH2_CONFIG = DFlashConfig(
    n_layer=5, n_embd=6656, n_ff=19968, n_head=32, n_head_kv=8, head_dim=128,
    rope_theta=5e5, eps=1e-5, target_layers=(2, 14, 26, 38, 50), mask_token_id=201818,
    block_size=16, window=2048, context_length=131072, family="dflash2",
    family_fields=DFlash2Fields(
        conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16,
        output_multiplier=0.19611613513818404, final_logit_softcapping=20.0, is_causal=False))
# deepseek-ai/dspark_qwen3_8b_block7's shape (DeepSpec's Qwen3 DSpark configs): Qwen3-8B's
# attention and rope, 5 full-attention layers, block 7 with shifted rows, a vanilla Markov
# head of rank 256 and a confidence head reading the Markov feature; target_layer_ids
# [1, 9, 17, 25, 33] (+1 here) and mask token 151669 as in DeepSpec's Qwen3 configs.
DSPARK_QWEN3_8B_CONFIG = DFlashConfig(
    n_layer=5, n_embd=4096, n_ff=12288, n_head=32, n_head_kv=8, head_dim=128,
    rope_theta=1e6, eps=1e-6, target_layers=(2, 10, 18, 26, 34), mask_token_id=151669,
    block_size=7, window=None, layer_types=(FULL,) * 5, context_length=40960, family="dspark",
    family_fields=DSparkFields(sample_from_anchor=True, markov_rank=256,
                               markov_head_type="vanilla", confidence_head=True,
                               confidence_with_markov=True))
# TINY_CONFIG's dims for each new family (CPU tests): every family axis > 1 and G < n_embd.
TINY_DFLASH2_CONFIG = dataclasses.replace(
    TINY_CONFIG, family="dflash2",
    family_fields=DFlash2Fields(conv_kernel_size=2, conv_group_size=8, selector_rank=8,
                                selector_top_k=4, output_multiplier=0.5,
                                final_logit_softcapping=12.0, input_embedding_scale=1.5))
TINY_DSPARK_CONFIG = dataclasses.replace(
    TINY_CONFIG, block_size=7, window=None, layer_types=(FULL,) * TINY_CONFIG.n_layer,
    context_length=64, family="dspark",
    family_fields=DSparkFields(sample_from_anchor=True, markov_rank=8, markov_head_type="vanilla",
                               confidence_head=True, confidence_with_markov=True))


def vocab_sized_tensors(cfg: DFlashConfig) -> tuple[str, ...]:
  """The family's drafter tensors with one row per target token id (their first axis is the
  target's vocabulary, which the drafter file's metadata does not state)."""
  if cfg.family == "dflash2":
    return ("selector_predecessor", "selector_successor")
  if cfg.family == "dspark" and cfg.dspark.markov_rank:
    return ("markov_w1", "markov_w2")
  return ()


def drafter_tensor_shapes(cfg: DFlashConfig, n_vocab: int | None = None
                          ) -> dict[str, tuple[int, ...]]:
  """The (out, in) numpy shape of every drafter tensor, keyed by its GGUF name without a
  `.weight` suffix (biases keep `.bias`; names without a GGUF form follow the same pattern).

  The target's `tok_embd` / `lm_head` are not drafter tensors. The tensors of
  `vocab_sized_tensors(cfg)` need `n_vocab`, the target's vocabulary (an error without it).
  """
  vocab = vocab_sized_tensors(cfg)
  if vocab and (isinstance(n_vocab, bool) or not isinstance(n_vocab, (int, np.integer))
                or n_vocab <= 0):
    raise ValueError(f"n_vocab must be the target's vocabulary size (a positive int): family "
                     f"{cfg.family!r} has target-vocab-sized tensors {list(vocab)}; got "
                     f"{n_vocab!r}")
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
  if cfg.family == "dflash2":
    shapes.update(_dflash2_shapes(cfg, int(n_vocab)))
  elif cfg.family == "dspark":
    shapes.update(_dspark_shapes(cfg, None if n_vocab is None else int(n_vocab)))
  return shapes


def _dflash2_shapes(cfg: DFlashConfig, n_vocab: int) -> dict[str, tuple[int, ...]]:
  """Per layer the attention and MLP convolutions' base kernels [2, K, H] (side 0 = prepare,
  1 = finish) and coefficient projections [2 K n_groups, H]; once the selector's codebooks
  [V, R] and hidden projection [R, H]."""
  f, e = cfg.dflash2, cfg.n_embd
  k, proj = f.conv_kernel_size, 2 * f.conv_kernel_size * cfg.n_conv_groups
  shapes = {}
  for i in range(cfg.n_layer):
    for side in ("attn", "ffn"):
      shapes[f"blk.{i}.{side}_conv_base"] = (2, k, e)
      shapes[f"blk.{i}.{side}_conv_proj"] = (proj, e)
  shapes.update(selector_predecessor=(n_vocab, f.selector_rank),
                selector_successor=(n_vocab, f.selector_rank),
                selector_hidden=(f.selector_rank, e))
  return shapes


def _dspark_shapes(cfg: DFlashConfig, n_vocab: int | None) -> dict[str, tuple[int, ...]]:
  """The Markov head's tables W1 [V, R] (rows gathered by the previous token) and W2 [V, R]
  (R -> V, no bias), the gated head's gate [R, H+R] or the rnn head's joint projection
  [3R, 2R+H] with their biases, and the confidence head's [1, H(+R)] projection and bias."""
  f, e = cfg.dspark, cfg.n_embd
  r = f.markov_rank
  shapes = {}
  if r:
    shapes.update(markov_w1=(n_vocab, r), markov_w2=(n_vocab, r))
  if f.markov_head_type == "gated":
    shapes.update({"markov_gate": (r, e + r), "markov_gate.bias": (r,)})
  elif f.markov_head_type == "rnn":
    shapes.update({"markov_joint": (3 * r, 2 * r + e), "markov_joint.bias": (3 * r,)})
  if f.confidence_head:
    shapes.update({"conf_proj": (1, e + (r if f.confidence_with_markov else 0)),
                   "conf_proj.bias": (1,)})
  return shapes


def _host_finite(a: Any) -> bool:
  return bool(np.isfinite(np.asarray(a, np.float32)).all())


def check_drafter_weights(cfg: DFlashConfig, w: Mapping[str, Any],
                          finite: Callable[[Any], bool] = _host_finite) -> int:
  """Validate a drafter weights mapping (plus the target's `tok_embd` / `lm_head`) against the
  family's tensor set; returns n_vocab (tok_embd's rows).

  Every tensor present with its shape, no unknown names, everything finite (`finite(array)`;
  the default copies to host float32: pass a device reduction for device arrays), mask_token_id
  in the vocabulary. `lm_head` may cover a reduced draft vocabulary (fewer rows, mapped by d2t)
  only for family "dflash": DFlash2's selector and DSpark's Markov head index the target's
  full vocabulary by token id. DFlash2 also needs selector_top_k <= n_vocab.
  """
  for key in ("tok_embd", "lm_head"):
    if key not in w:
      raise ValueError(f"weights lack '{key}': the drafter borrows the target's token embedding "
                       "and LM head; set w['tok_embd'] and w['lm_head'] ([n_vocab, n_embd] each)")
  if np.ndim(w["tok_embd"]) != 2:
    raise ValueError(f"tensor 'tok_embd' must be [n_vocab, {cfg.n_embd}], got shape "
                     f"{tuple(np.shape(w['tok_embd']))}")
  n_vocab = int(np.shape(w["tok_embd"])[0])
  expected = dict(drafter_tensor_shapes(cfg, n_vocab))
  expected["tok_embd"] = (n_vocab, cfg.n_embd)
  n_head = int(np.shape(w["lm_head"])[0]) if np.ndim(w["lm_head"]) == 2 else n_vocab
  reduced_ok = cfg.family == "dflash" and 0 < n_head <= n_vocab
  expected["lm_head"] = (n_head if reduced_ok else n_vocab, cfg.n_embd)
  for name, shape in expected.items():
    if name not in w:
      raise ValueError(f"weights lack tensor '{name}' (expected shape {shape})")
    if tuple(np.shape(w[name])) != shape:
      why = (" (DFlash2 / DSpark read the target's full vocabulary: no reduced LM head)"
             if name == "lm_head" and cfg.family != "dflash" else "")
      raise ValueError(f"tensor '{name}' has shape {tuple(np.shape(w[name]))}, expected "
                       f"{shape}{why}")
  extra = sorted(set(w) - set(expected))
  if extra:
    raise ValueError(f"unknown tensors in weights: {extra} (family {cfg.family!r})")
  for name in expected:
    if not finite(w[name]):
      raise ValueError(f"tensor '{name}' holds NaN or Inf")
  if not 0 <= cfg.mask_token_id < n_vocab:
    raise ValueError(f"mask_token_id {cfg.mask_token_id} is outside the target vocab "
                     f"[0, {n_vocab})")
  if cfg.family == "dflash2" and cfg.dflash2.selector_top_k > n_vocab:
    raise ValueError(f"family_fields.selector_top_k {cfg.dflash2.selector_top_k} exceeds the "
                     f"target vocab ({n_vocab})")
  return n_vocab


def gguf_tensor_name(key: str) -> str:
  """The GGUF tensor name of a weights key: `.weight` appended, except for biases and the
  DFlash2 base kernels, which llama.cpp names without it (SPEC_dflash2_dspark 3.3)."""
  return key if key.endswith((".bias", "_conv_base")) else key + ".weight"
