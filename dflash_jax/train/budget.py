"""What a training command will cost before it starts: memory estimates and a wall-time budget.

The estimates count what XLA keeps live at a step's peak, in bytes: the float32 masters with
their gradients and AdamW moments (16 bytes per parameter), and per token the residuals the
backward pass reads (per layer: the normed inputs, the q/k/v and attention outputs, the
FFN's gate/up and hidden rows, and the attention's scores and probabilities, Hq x T each), or
for the forward-only stages (distillation, feature caching) the KV cache and the largest
transient (a layer's attention scores). tests/test_train_budget.py holds each estimate within
a band around XLA's own `memory_analysis()` of the compiled step on CPU.

`Deadline` is one command's `--max-minutes`, shared by its stages: each stage ends at its
share of the budget (distillation and feature caching stop early with the rows done so far,
training checkpoints and stops), so the command as a whole ends in time.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time

import jax

from dflash_jax.config import DFlashConfig, drafter_tensor_shapes

# bytes per float32 parameter in training: master, gradient, AdamW's two moments
_STATE_BYTES = 16


def _n_params(tcfg) -> int:
  from dflash_jax.models import qwen3
  shapes = jax.eval_shape(lambda: qwen3.init_params(tcfg, jax.random.key(0)))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def _layer_floats(e: int, f: int, d: int, hq: int, hkv: int, t: int) -> int:
  """Floats a decoder layer keeps per row for the backward pass (see the module docstring)."""
  return 6 * e + 2 * (hq + 2 * hkv) * d + 2 * hq * d + 3 * f + 4 * hq * t


def target_step_bytes(tcfg, batch: int, seq_len: int) -> int:
  """Peak bytes of one `train-target` step: state + residuals of batch x seq_len tokens + the
  logits (the logits, their log-softmax and its gradient)."""
  layer = _layer_floats(tcfg.hidden_size, tcfg.intermediate_size, tcfg.head_dim,
                        tcfg.num_attention_heads, tcfg.num_key_value_heads, seq_len)
  rows = batch * seq_len
  return (_STATE_BYTES * _n_params(tcfg)
          + 4 * rows * (tcfg.num_hidden_layers * layer + 3 * tcfg.vocab_size))


def _target_forward_bytes(tcfg, batch: int, seq_len: int) -> int:
  """Peak bytes of the frozen target's forward over batch x seq_len tokens (no gradient): the
  weights, a few rows of the residual stream, one layer's scores and probabilities."""
  rows = batch * seq_len
  return (4 * _n_params(tcfg)
          + 4 * rows * (8 * tcfg.hidden_size + 3 * tcfg.intermediate_size
                        + 2 * tcfg.num_attention_heads * seq_len))


def drafter_step_bytes(cfg: DFlashConfig, tcfg, batch: int, seq_len: int, anchors: int, *,
                       online: bool = True) -> int:
  """Peak bytes of one `train-drafter` step: the drafter's state, the residuals of its
  batch x anchors x block_size rows (each block row scores seq_len context positions), the
  logits over the target vocab, the captured features, and with online features the frozen
  target's forward."""
  n = sum(math.prod(s) for s in drafter_tensor_shapes(cfg, tcfg.vocab_size).values())
  rows = batch * anchors * cfg.block_size
  layer = _layer_floats(cfg.n_embd, cfg.n_ff, cfg.head_dim, cfg.n_head, cfg.n_head_kv,
                        seq_len + cfg.block_size)
  context = 4 * batch * seq_len * cfg.n_layer * (2 * cfg.n_head_kv * cfg.head_dim + cfg.n_embd)
  feats = 4 * batch * seq_len * (cfg.n_embd_fc + cfg.n_embd)
  total = (_STATE_BYTES * n + 4 * rows * (cfg.n_layer * layer + 3 * tcfg.vocab_size)
           + context + feats)
  if online:
    total += _target_forward_bytes(tcfg, batch, seq_len)
  return total


def distill_bytes(tcfg, batch: int, prompt_len: int, gen_len: int) -> int:
  """Peak bytes of distilling gen_len greedy tokens for `batch` prompts: the KV cache of
  prompt_len + gen_len positions and the prompt's prefill (its forward over the cache)."""
  cap = prompt_len + gen_len
  cache = 2 * 4 * tcfg.num_hidden_layers * batch * tcfg.num_key_value_heads * cap * tcfg.head_dim
  prefill = 4 * batch * prompt_len * (4 * tcfg.hidden_size + 2 * tcfg.intermediate_size
                                      + tcfg.num_attention_heads * cap)
  return 4 * _n_params(tcfg) + cache + prefill


def device_memory() -> tuple[int, str]:
  """(bytes a run may use, what they are): on CPU the machine's physical memory, on an
  accelerator the device's allocator limit."""
  dev = jax.devices()[0]
  if jax.default_backend() != "cpu":
    limit = (dev.memory_stats() or {}).get("bytes_limit")
    if limit:
      return int(limit), f"the {dev.device_kind}'s {limit / 1e9:.1f} GB"
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return ram, f"this machine's {ram / 1e9:.1f} GB of memory"


# The share of the memory a stage may plan for: the rest is the runtime's (XLA's buffers and
# compiler, Python, the corpus arrays), which the estimates do not count.
USABLE = 0.8


def check_fits(stages: dict[str, int]) -> str | None:
  """None when every stage's estimate fits USABLE of `device_memory()`, else the message
  naming the stage, its estimate and the memory."""
  have, what = device_memory()
  for name, need in stages.items():
    if need > USABLE * have:
      return (f"{name} needs about {need / 1e9:.1f} GB (estimated), more than "
              f"{USABLE:.0%} of {what}")
  return None


@dataclasses.dataclass(frozen=True)
class Deadline:
  """A command's wall-time budget from `start` (time.perf_counter()); seconds None: none."""
  start: float
  seconds: float | None

  @staticmethod
  def minutes(m: float | None) -> "Deadline":
    return Deadline(time.perf_counter(), None if m is None else 60.0 * m)

  def at(self, share: float = 1.0) -> float:
    """The perf_counter time by which a stage ending at `share` of the budget must stop
    (inf without a budget)."""
    return math.inf if self.seconds is None else self.start + share * self.seconds

  def left(self, share: float = 1.0) -> float | None:
    """Seconds until `at(share)` (None without a budget; may be negative)."""
    return None if self.seconds is None else self.at(share) - time.perf_counter()


def clock(seconds: float) -> str:
  """A duration as m:ss (h:mm:ss past an hour)."""
  s = max(0, int(round(seconds)))
  h, rest = divmod(s, 3600)
  return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Progress:
  """A `map_batches` progress callback printing one line per batch at most every `every`
  seconds, and after the first batch (whose time includes compiling) and the last: units
  done, tokens/s and the ETA (at the last batch's pace)."""

  def __init__(self, stage: str, unit: str, tokens_per_unit: int, *, every: float = 15.0,
               stop_at: float | None = None, out=print):
    self.stage, self.unit, self.tpu, self.every = stage, unit, tokens_per_unit, every
    self.stop_at, self.out = stop_at, out
    self.t0 = self.last_line = time.perf_counter()
    self.prev = 0

  def __call__(self, done: int, total: int, seconds: float) -> None:
    now = time.perf_counter()
    rows, first = done - self.prev, self.prev == 0
    self.prev = done
    if not (first or done == total or now - self.last_line >= self.every):
      return
    self.last_line = now
    rate = rows * self.tpu / max(seconds, 1e-9)
    speed = f"{rate / 1e3:.1f} k tok/s" + (" (includes compiling)" if first else "")
    eta = ""
    if done < total:
      left = (total - done) / max(rows, 1) * seconds
      eta = f", ETA {clock(left)}"
      if self.stop_at is not None and now + left > self.stop_at:
        eta = f", stops at its share of the time limit in {clock(self.stop_at - now)}"
    self.out(f"{self.stage}: {done}/{total} {self.unit} | {clock(now - self.t0)}, {speed}{eta}")
