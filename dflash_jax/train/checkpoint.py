"""Resumable orbax checkpoints of a TrainState plus a JSON record (config, data seed, log).

These are for resuming on the same kind of machine; the portable artifacts are the exported
target (HF folder) and drafter (GGUF).
"""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from dflash_jax.train.trainer import TrainState


def _manager(directory: str, keep: int = 2) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(os.path.abspath(directory), options=ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True))


def save_checkpoint(directory: str, state: TrainState, record: dict, keep: int = 2) -> int:
  """Save state (at its step) and record; returns the step. Blocks until the save is complete
  (orbax commits atomically: a partial save is never the latest)."""
  step = int(jax.device_get(state.step))
  with _manager(directory, keep) as m:
    m.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                         record=ocp.args.JsonSave(record)), force=True)
    m.wait_until_finished()
  return step


def latest_step(directory: str) -> int | None:
  if not os.path.isdir(directory):
    return None
  with _manager(directory) as m:
    return m.latest_step()


def restore_checkpoint(directory: str, like: TrainState, step: int | None = None
                       ) -> tuple[TrainState, dict]:
  """(state, record) from directory at `step` (default: the latest). `like` gives the tree
  structure, shapes and dtypes (e.g. a freshly initialised state)."""
  with _manager(directory) as m:
    step = m.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {directory!r}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    out = m.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                  record=ocp.args.JsonRestore()))
  return out.state, out.record
