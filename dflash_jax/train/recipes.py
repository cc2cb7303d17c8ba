"""End-to-end training recipes (what the CLI runs): corpus -> target LM -> drafter.

Each recipe is deterministic given its seed: the corpus split, the batches and anchors, and
the initial weights are functions of the arguments alone.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import DFlashConfig
from dflash_jax.models import qwen3
from dflash_jax.train import data as D
from dflash_jax.train import distill
from dflash_jax.train import forward as F
from dflash_jax.train import trainer as TR
from dflash_jax.train.features import FeatureShards
from dflash_jax.train.loop import train_loop


def corpus_streams(root: str | None = None, max_files: int | None = None,
                   holdout_every: int = 20, tokenizer=None
                   ) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
  """(train token stream, held-out token stream, train files, held-out files) of the stdlib
  (or `root`). max_files keeps the first files of the sorted listing (small CPU runs).
  tokenizer: None for byte tokens (`data.read_tokens`), else a `data.TextTokenizer` (a
  target's tokenizer.json) that reads each file as UTF-8 text."""
  root = root or D.stdlib_root()
  files = D.list_sources(root)[:max_files]
  train, held = D.split_sources(files, holdout_every)
  if not train or not held:
    raise ValueError(f"{len(files)} files under {root!r} give {len(train)} train and "
                     f"{len(held)} held-out files; need both (more files or a smaller "
                     "holdout_every)")
  if tokenizer is None:
    return D.read_tokens(root, train), D.read_tokens(root, held), train, held
  return (D.read_text_tokens(root, train, tokenizer), D.read_text_tokens(root, held, tokenizer),
          train, held)


def seeded_rows(seqs: np.ndarray, n: int, seed: int) -> np.ndarray:
  """n rows of seqs, a seeded choice without replacement (all rows if n >= len)."""
  if n >= seqs.shape[0]:
    return seqs
  return seqs[np.sort(np.random.default_rng(seed).choice(seqs.shape[0], n, replace=False))]


def pretrain_target(tcfg: qwen3.TargetConfig, train_seqs: np.ndarray, eval_seqs: np.ndarray,
                    oc: TR.OptimConfig, batch_size: int, *, seed: int = 0,
                    compute_dtype: str = "bf16", log_every: int = 50, eval_every: int = 0,
                    checkpoint_dir: str | None = None, checkpoint_every: int = 0,
                    stop_at: float | None = None, out: Callable[[str], None] = print
                    ) -> tuple[qwen3.TargetParams, list[dict]]:
  """Train a target LM from random init on token sequences [N, T]; returns (float32 params,
  log). Held-out loss (64 seeded rows of eval_seqs) is logged every eval_every steps and at
  the end. stop_at: `loop.train_loop`'s time limit."""
  state = TR.init_state(qwen3.init_params(tcfg, jax.random.key(seed)), oc)
  step = lambda st, toks: TR.target_train_step_jit(st, toks, cfg=tcfg, oc=oc,
                                                   compute_dtype=compute_dtype)
  batch = lambda i: train_seqs[D.epoch_rows(train_seqs.shape[0], batch_size, seed, i)[1]]
  held = jnp.asarray(seeded_rows(eval_seqs, 64, seed))
  ev = lambda st: TR.lm_eval_jit(st.params, held, cfg=tcfg, compute_dtype=compute_dtype)[1]
  state, log = train_loop(state, step, batch, oc.total_steps, log_every=log_every, eval_fn=ev,
                          eval_every=eval_every, checkpoint_dir=checkpoint_dir,
                          checkpoint_every=checkpoint_every, stop_at=stop_at,
                          record=dict(kind="target", seed=seed),
                          tokens_per_step=batch_size * train_seqs.shape[1], out=out)
  return state.params, log


def distill_data(target: qwen3.TargetParams, tcfg: qwen3.TargetConfig, prompts: np.ndarray,
                 n_new: int, batch_size: int = 256, *, stop_at: float | None = None,
                 progress=None) -> tuple[np.ndarray, np.ndarray]:
  """Sequences prompt + the target's greedy continuation, loss on the continuation (of the
  first prompts only when stop_at ends it early: `distill.greedy_continuations`)."""
  cont = distill.greedy_continuations(target, tcfg, prompts, n_new, batch_size,
                                      stop_at=stop_at, progress=progress)
  return distill.distill_sequences(prompts[:cont.shape[0]], cont)


def train_drafter(cfg: DFlashConfig, target: qwen3.TargetParams, tcfg: qwen3.TargetConfig,
                  data: D.DrafterData, tc: TR.DrafterTrainConfig, *, seed: int = 0,
                  eval_data: D.DrafterData | None = None, log_every: int = 50,
                  eval_every: int = 0, checkpoint_dir: str | None = None,
                  checkpoint_every: int = 0, stop_at: float | None = None,
                  init: dict | None = None, features: FeatureShards | None = None,
                  out: Callable[[str], None] = print) -> tuple[dict, list[dict]]:
  """Train drafter weights (from `init`, else random with `seed`) against the frozen target.
  Features online (computed in each step), or from `features` (cached shards of data's
  sequences, row for row). Returns (float32 weights keyed like the host weights, log);
  eval_data's first batch gives the logged held-out loss and accept length (online)."""
  w = init if init is not None else F.init_drafter(cfg, seed, n_vocab=tcfg.vocab_size)
  state = TR.init_state(w, tc.optim)
  kw = dict(cfg=cfg, target_cfg=tcfg, tc=tc)
  if features is None:
    step = lambda st, b: TR.drafter_train_step_jit(st, target, b, **kw)
    batch_fn = data.batch
  else:
    if features.n_rows != data.tokens.shape[0]:
      raise ValueError(f"cached features hold {features.n_rows} sequences, the data "
                       f"{data.tokens.shape[0]}")
    step = lambda st, bf: TR.drafter_train_step_jit(st, target, bf[0], bf[1], **kw)
    batch_fn = lambda s: (data.batch(s), features.rows(data.rows(s)))
  ev = None
  if eval_data is not None:
    held = eval_data.batch(0)
    ev = lambda st: TR.drafter_eval_jit(st.params, target, held, cfg=cfg, target_cfg=tcfg,
                                        tc=tc)[1]
  state, log = train_loop(state, step, batch_fn, tc.optim.total_steps, log_every=log_every,
                          eval_fn=ev, eval_every=eval_every, checkpoint_dir=checkpoint_dir,
                          checkpoint_every=checkpoint_every, stop_at=stop_at,
                          record=dict(kind="drafter", seed=seed),
                          tokens_per_step=data.batch_size * data.tokens.shape[1], out=out)
  return state.params, log


def host_weights(w: dict) -> dict[str, np.ndarray]:
  """Device weights -> float32 numpy, ready for `save_drafter`."""
  return {k: np.asarray(jax.device_get(v), np.float32) for k, v in w.items()}
