"""The host loop of both trainers: steps, progress lines, checkpoints, resume, a time limit."""
from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np

from dflash_jax.train import checkpoint
from dflash_jax.train.budget import clock
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
               record: dict | None = None, stop_at: float | None = None,
               tokens_per_step: int = 0, progress_seconds: float = 30.0,
               out: Callable[[str], None] = print) -> tuple[TrainState, list[dict]]:
  """Run step_fn(state, batch_fn(step)) for step = state.step .. total_steps - 1.

  Resumes from checkpoint_dir's latest checkpoint when there is one (state then only gives the
  tree structure); batch_fn(step) must be a pure function of step, so the data order resumes
  too. A line (and a log row) after the first step (its time includes compiling), then every
  log_every steps or progress_seconds, whichever comes first: the metrics, tokens/s and the
  ETA. Evaluates every eval_every steps and at the end, checkpoints every checkpoint_every
  steps and at the end. stop_at (a time.perf_counter() value): no step starts that the recent
  step time says would end past it; the loop then stops early, saying so (checkpointed when
  checkpoint_dir is set). Each step is waited for, so the times are the steps' own. Returns
  (state, log: one dict per logged step).
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
  t0 = last_t = prev = time.perf_counter()
  last_step, recent = start, None   # recent: seconds per step (an average; compile excluded)
  for step in range(start, total_steps):
    now = time.perf_counter()
    if stop_at is not None and recent is not None and now + recent > stop_at:
      out(f"stopping early after step {step} of {total_steps}: the time limit leaves no room "
          f"for another step ({recent:.2f} s each)")
      if eval_fn is not None:
        log.append(dict(step=step, seconds=now - t0,
                        **{f"eval_{k}": v for k, v in _host(eval_fn(state)).items()}))
      break
    state, m = step_fn(state, batch_fn(step))
    jax.block_until_ready(m)
    done = step + 1
    now = time.perf_counter()
    first = step == start
    if not first:
      recent = now - prev if recent is None else 0.8 * recent + 0.2 * (now - prev)
    prev = now
    final = done == total_steps
    due = done % log_every == 0 or final or first or now - last_t >= progress_seconds
    if due:
      row = dict(step=done, **_host(m))
      row["seconds"] = now - t0
      rate = (done - last_step) / max(now - last_t, 1e-9)
      last_t, last_step = now, done
      if eval_fn is not None and ((eval_every and done % eval_every == 0) or final):
        row.update({f"eval_{k}": v for k, v in _host(eval_fn(state)).items()})
      log.append(row)
      scalars = " ".join(f"{k} {v:.4g}" for k, v in row.items()
                         if isinstance(v, float) and k not in ("seconds",))
      if first:
        speed = f"first step {row['seconds']:.1f} s (includes compiling)"
      else:
        tps = rate * tokens_per_step
        speed = f"{rate:.2f} steps/s" + (
            (f", {tps / 1e6:.2f} M tok/s" if tps >= 1e6 else f", {tps / 1e3:.1f} k tok/s")
            if tokens_per_step else "")
      eta = ""
      if not final and recent:
        left = (total_steps - done) * recent
        eta = f", ETA {clock(left)}"
        if stop_at is not None and now + left > stop_at:
          last = done + int((stop_at - now) / recent)
          eta = f", stops at the time limit in {clock(stop_at - now)} (step ~{last})"
      out(f"step {done}/{total_steps} {scalars} | {clock(row['seconds'])}, {speed}{eta}")
    if checkpoint_every and done % checkpoint_every == 0 and not final:
      save()
  save()
  return state, log
