"""What the decoding loop needs from a target model: the `Target` protocol.

A target family is one module (`qwen3.py`, ...) whose frozen config dataclass implements this
protocol: the config is the family's handle. It is hashable, so it rides in the static part
of a jitted call, and its methods are pure functions of their arguments (params and cache
are pytrees, donated at the jitted edges). `decode.py` talks to a target through these
methods only; `sharding.ShardedTarget` wraps any implementation for a mesh.

The cache contract. A cache is a pytree whose committed state is a length per sequence
(`length [B] int32`: positions 0..length-1 are committed). `prefill` appends committed rows.
`verify` computes w rows at positions length.. and returns their logits and captured
features without committing them: the returned cache holds whatever `commit` needs (K/V
written past the length; for recurrent layers, what restores their state after any row).
`commit(cache, n_keep)` then keeps the first n_keep[b] rows of that verify per sequence
(0 <= n_keep <= w): length += n_keep and every recurrent state is the state after row
n_keep - 1 (unchanged for n_keep = 0). Between a verify and its commit no other call may
touch the cache.

Slots that take new prompts (continuous batching, `decode.serve`): `reset(cache, empty)`
empties the sequences where empty[b] (length 0, recurrent state as `init_cache` makes it)
and leaves the others as they are; a `prefill` leaves every sequence with n_valid[b] = 0
exactly as it was (nothing written, whatever its length, even where its length plus the
prefill's T passes the capacity). Together they put a new prompt into chosen slots alone
while the other slots keep decoding.

Feature capture: `capture_layers` are HF `hidden_states` indices (llama.cpp's DFlash
`target_layers`): i < n_layers is the residual stream entering layer i (0 = what the first
layer receives), i = n_layers the final-normed state. Rows are the concatenation in
`capture_layers` order.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.dispatch import resolve_dtype


@runtime_checkable
class Target(Protocol):
  """A target family bound to its config. Config facts first, then the cached calls."""

  vocab_size: int
  hidden_size: int
  max_position_embeddings: int
  eos_token_ids: tuple[int, ...]

  @property
  def n_layers(self) -> int:
    """Decoder layers: capture indices lie in [0, n_layers]."""

  def check_capture_layers(self, capture_layers: Sequence[int]) -> tuple[int, ...]:
    """capture_layers as ints in [0, n_layers]; a ValueError naming them otherwise."""

  def init_cache(self, batch: int, capacity: int, dtype: Any = "fp32") -> Any:
    """An empty cache for `batch` sequences of up to `capacity` positions each."""

  def cache_nbytes(self, batch: int, capacity: int, dtype: Any = "fp32",
                   verify_width: int = 1) -> int:
    """Device bytes of `init_cache(batch, capacity, dtype)` plus what a verify of
    `verify_width` rows adds to it (checked on the host before a run starts)."""

  def prefill(self, params: Any, cache: Any, tokens: jax.Array, n_valid: jax.Array, *,
              capture_layers: Sequence[int] = (), impl: str = "xla") -> tuple[Any, jax.Array]:
    """Commit rows 0..n_valid[b]-1 of tokens [B, T] at positions length.. -> (cache,
    features [B, T, F] float32; rows past n_valid are garbage). T is padded to a bucket
    (`prefill_bucket`); padding rows never become visible, and a sequence with n_valid 0 is
    left unchanged."""

  def verify(self, params: Any, cache: Any, tokens: jax.Array, *,
             capture_layers: Sequence[int] = (), impl: str = "xla"
             ) -> tuple[Any, jax.Array, jax.Array]:
    """Run tokens [B, w] at positions length.. without committing them -> (cache, logits
    [B, w, V] float32, features [B, w, F] float32)."""

  def commit(self, cache: Any, n_keep: jax.Array) -> Any:
    """Keep the first n_keep [B] rows of the last verify (see the module docstring)."""

  def reset(self, cache: Any, empty: jax.Array) -> Any:
    """The cache with the sequences where empty [B] bool is True emptied (as `init_cache`
    makes them), the others unchanged (see the module docstring)."""

  def forward(self, params: Any, tokens: jax.Array, *, capture_layers: Sequence[int] = (),
              with_logits: bool = True) -> tuple[jax.Array | None, jax.Array]:
    """Uncached causal forward of tokens [B, T] at positions 0..T-1 -> (logits [B, T, V]
    or None, features [B, T, F]); differentiable (training, teacher forcing)."""


class HFDecoderFacts:
  """The config facts every HF decoder family here derives alike from its fields
  (`num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `head_dim`): a mixin of
  the families' frozen config dataclasses, so each states only what differs."""

  @property
  def n_layers(self) -> int:
    return self.num_hidden_layers

  def check_capture_layers(self, capture_layers: Sequence[int]) -> tuple[int, ...]:
    return check_capture_layers(self.num_hidden_layers, capture_layers)

  @property
  def q_dim(self) -> int:
    return self.num_attention_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    return self.num_key_value_heads * self.head_dim

  def dim_problems(self, more_ints: Sequence[str] = (),
                   positive: Sequence[str] = ("rms_norm_eps", "rope_theta"),
                   neox_head: bool = True) -> list[str]:
    """What `__post_init__` reports about the shared fields: the dimensions (and more_ints)
    positive ints, the query heads a multiple of the K/V heads, head_dim even when NEOX rope
    turns the whole head (neox_head), the `positive` floats > 0. Checks past the ints run only
    when they hold."""
    problems = []
    for name in _DECODER_INTS + tuple(more_ints):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        problems.append(f"{name} must be a positive int, got {v!r}")
    if not problems:
      if self.num_attention_heads % self.num_key_value_heads:
        problems.append(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                        f"of num_key_value_heads ({self.num_key_value_heads})")
      if neox_head and self.head_dim % 2:
        problems.append(f"head_dim must be even for NEOX rope, got {self.head_dim}")
    for name in positive:
      if not getattr(self, name) > 0:
        problems.append(f"{name} must be > 0, got {getattr(self, name)!r}")
    return problems


_DECODER_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim",
                 "max_position_embeddings")


def prefill_bucket(n: int, minimum: int = 16) -> int:
  """The padded prefill length for n rows: the next power of two >= max(n, minimum), so a
  prompt compiles prefill once per power of two."""
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def eos_token_ids(ids: Any, vocab_size: int) -> tuple[tuple[int, ...], list[str]]:
  """A config's `eos_token_ids` as HF writes it (None, one id or a list) -> (the ids as a
  tuple of ints, the problems to report: ids outside the vocab)."""
  out = tuple(int(i) for i in (
      () if ids is None else (ids,) if isinstance(ids, (int, np.integer)) else ids))
  bad = any(not 0 <= i < max(vocab_size, 1) for i in out)
  return out, [f"eos_token_ids {out} must lie in [0, {vocab_size})"] if bad else []


def check_capture_layers(n_layers: int, capture_layers: Sequence[int]) -> tuple[int, ...]:
  """The shared check of `Target.check_capture_layers`."""
  out = tuple(int(i) for i in capture_layers)
  bad = [i for i in out if not 0 <= i <= n_layers]
  if bad:
    raise ValueError(f"capture_layers {bad} outside [0, {n_layers}] (HF hidden_states indices "
                     f"of a {n_layers}-layer target)")
  return out


def hf_takers(tensors: dict[str, Any], dtype: Any
              ) -> tuple[Callable[..., jax.Array], Callable[[str], jax.Array],
                         Callable[[str], jax.Array]]:
  """What a family's `params_from_hf` reads checkpoint-named arrays with: (mat, vec, take),
  each taking its entries out of `tensors` as it reads them, so the device holds a stored
  piece only until its fused / cast form exists (a 30B checkpoint would otherwise need twice
  its size on the device). take(name): the array as it is stored; mat(*names): the pieces
  concatenated along axis 0 and cast to dtype on the device; vec(name): float32."""
  dt = resolve_dtype(dtype)

  def take(name: str) -> jax.Array:
    return jnp.asarray(tensors.pop(name))

  def mat(*names: str) -> jax.Array:
    parts = [take(n) for n in names]
    return (jnp.concatenate(parts) if len(parts) > 1 else parts[0]).astype(dt)

  def vec(name: str) -> jax.Array:
    return take(name).astype(jnp.float32)
  return mat, vec, take


def check_hf_tensors(shapes: dict[str, tuple[int, ...]], tensors, where: str = "tensors") -> None:
  """A family's `params_from_hf` input check: every tensor `shapes` names is in tensors with
  that shape (a ValueError naming the first missing or misshapen tensor)."""
  missing = [n for n in shapes if n not in tensors]
  if missing:
    raise ValueError(f"{where}: missing tensors {missing[:8]}{' ...' * (len(missing) > 8)}")
  for name, want in shapes.items():
    got = tuple(tensors[name].shape)
    if got != tuple(want):
      raise ValueError(f"{where}: tensor {name} has shape {got}, expected {tuple(want)}")
