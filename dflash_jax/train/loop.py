"""The host loop shared by both trainers: steps, periodic logging, checkpoints, resume."""
from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np

from dflash_jax.train import checkpoint
from dflash_jax.train.trainer import TrainState


def _host(metrics: dict) -> dict:
  out = {}
  for k, v in jax.device_get(metrics).items():
    a = np.asarray(v)
    out[k] = float(a) if a.ndim == 0 else a.tolist()
  return out


def train_loop(state: TrainState, step_fn: Callable[[TrainState, Any], tuple[TrainState, dict]],
               batch_fn: Callable[[int], Any], total_steps: int, *, log_every: int = 50,
               eval_fn: Callable[[TrainState], dict] | None = None, eval_every: int = 0,
               checkpoint_dir: str | None = None, checkpoint_every: int = 0,
               record: dict | None = None, max_seconds: float | None = None,
               tokens_per_step: int = 0, out: Callable[[str], None] = print
               ) -> tuple[TrainState, list[dict]]:
  """Run step_fn(state, batch_fn(step)) for step = state.step .. total_steps - 1.

  Resumes from checkpoint_dir's latest checkpoint when there is one (state then only gives the
  tree structure); batch_fn(step) must be a pure function of step, so the data order resumes
  too. Logs every log_every steps (the only host syncs), evaluates every eval_every steps and
  at the end, checkpoints every checkpoint_every steps and at the end. max_seconds stops early
  (saying so) after the step that crosses it. Returns (state, log: one dict per logged step).
  """
  log: list[dict] = []
  if checkpoint_dir and checkpoint.latest_step(checkpoint_dir) is not None:
    state, rec = checkpoint.restore_checkpoint(checkpoint_dir, state)
    log = list(rec.get("log", []))
    out(f"resumed from {checkpoint_dir} at step {int(state.step)}")

  def save():
    if checkpoint_dir:
      checkpoint.save_checkpoint(checkpoint_dir, state, dict(record or {}, log=log))

  start = int(jax.device_get(state.step))
  t0 = last_t = time.perf_counter()
  last_step = start
  for step in range(start, total_steps):
    state, m = step_fn(state, batch_fn(step))
    done = step + 1
    final = done == total_steps
    over = max_seconds is not None and time.perf_counter() - t0 > max_seconds
    if done % log_every == 0 or final or over:
      row = dict(step=done, **_host(m))
      now = time.perf_counter()
      row["seconds"] = now - t0
      rate = (done - last_step) / max(now - last_t, 1e-9)
      last_t, last_step = now, done
      if eval_fn is not None and ((eval_every and done % eval_every == 0) or final or over):
        row.update({f"eval_{k}": v for k, v in _host(eval_fn(state)).items()})
      log.append(row)
      scalars = " ".join(f"{k} {v:.4g}" for k, v in row.items()
                         if isinstance(v, float) and k not in ("seconds",))
      tps = rate * tokens_per_step
      speed = ((f", {tps / 1e6:.2f} M tok/s" if tps >= 1e6 else f", {tps / 1e3:.1f} k tok/s")
               if tokens_per_step else "")
      out(f"step {done}/{total_steps} {scalars} | {row['seconds']:.1f} s, "
          f"{rate:.1f} steps/s{speed}")
    if checkpoint_every and done % checkpoint_every == 0 and not final:
      save()
    if over and not final:
      out(f"stopping early at step {done}: max_seconds {max_seconds} reached")
      break
  save()
  return state, log
