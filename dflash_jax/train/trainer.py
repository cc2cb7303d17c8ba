"""Jitted train steps (drafter and target LM): AdamW with warmup + cosine decay and global-norm
clipping, float32 master weights with bf16 compute, the whole state donated.

`TrainState` is one pytree (params, optimizer state, step); the data order is a function of
(seed, step) (`data.epoch_rows`), so a restored state resumes the same batches. bf16 compute
casts the float32 masters inside the loss, so gradients, their global norm and the optimizer
moments are float32.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from dflash_jax.config import DFlashConfig
from dflash_jax.models import qwen3
from dflash_jax.train.data import DrafterBatch
from dflash_jax.dispatch import linear, resolve_dtype
from dflash_jax.train import forward as F
from dflash_jax.train.forward import block_logits, cast_matrices
from dflash_jax.train.loss import (accept_run, block_loss, block_targets, confidence_loss,
                                   resolve_gamma, selector_loss)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW (decoupled weight decay on matrices only), lr warmed up linearly from 0 over
  warmup_steps, then cosine-decayed to lr * final_lr_frac at total_steps; gradients clipped to
  global norm clip_norm (computed in float32)."""
  lr: float = 1e-3
  total_steps: int = 1000
  warmup_steps: int = 50
  final_lr_frac: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  clip_norm: float = 1.0

  def __post_init__(self):
    if not (self.lr > 0 and self.total_steps > 0 and 0 <= self.warmup_steps < self.total_steps
            and 0 <= self.final_lr_frac <= 1 and self.clip_norm > 0 and self.weight_decay >= 0):
      raise ValueError(f"invalid OptimConfig: {self}")

  def schedule(self) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, self.lr, self.warmup_steps, self.total_steps,
                                              self.lr * self.final_lr_frac)

  def optimizer(self) -> optax.GradientTransformation:
    matrices = lambda params: jax.tree.map(lambda x: x.ndim == 2, params)
    return optax.chain(
        optax.clip_by_global_norm(self.clip_norm),
        optax.adamw(self.schedule(), b1=self.b1, b2=self.b2, weight_decay=self.weight_decay,
                    mask=matrices))


@flax.struct.dataclass
class TrainState:
  params: Any          # float32 masters
  opt_state: Any
  step: jax.Array      # int32 scalar: batches applied so far


def init_state(params: Any, oc: OptimConfig) -> TrainState:
  """A fresh state holding float32 copies of params (the donated steps never delete the
  caller's arrays)."""
  params = jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), params)
  return TrainState(params=params, opt_state=oc.optimizer().init(params),
                    step=jnp.zeros((), jnp.int32))


def _apply(state: TrainState, grads: Any, oc: OptimConfig, metrics: dict) -> tuple[TrainState, dict]:
  updates, opt_state = oc.optimizer().update(grads, state.opt_state, state.params)
  # The float32 global norm, written out (the optax name for it moved between versions).
  grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
  metrics = dict(metrics, grad_norm=grad_norm, lr=oc.schedule()(state.step))
  return TrainState(params=optax.apply_updates(state.params, updates), opt_state=opt_state,
                    step=state.step + 1), metrics


# --- drafter ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DrafterTrainConfig:
  """Static knobs of the drafter step. gamma None: the default for the block size (and, for
  DSpark, its rows); window None: the drafter config's (else 2048). selector_weight: DFlash2's
  selector loss next to the block loss; confidence_weight: DSpark's confidence BCE next to its
  CE (DeepSpec's configs: 1)."""
  optim: OptimConfig = OptimConfig()
  gamma: float | None = None
  window: int | None = None
  compute_dtype: str = "bf16"
  selector_weight: float = 1.0
  confidence_weight: float = 1.0

  def __post_init__(self):
    for name in ("selector_weight", "confidence_weight"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
        raise ValueError(f"DrafterTrainConfig.{name} must be a number >= 0, got {v!r}")


def target_features(target: qwen3.TargetParams, target_cfg: qwen3.TargetConfig,
                    capture_layers: tuple[int, ...], tokens: jax.Array) -> jax.Array:
  """The frozen target's features [S, T, len(capture_layers) n_embd] of tokens (no gradient);
  capture_layers is a drafter's `target_layers`."""
  _, feats = qwen3.forward(target, target_cfg, tokens, capture_layers=capture_layers,
                           with_logits=False)
  return jax.lax.stop_gradient(feats)


def training_capture_layers(cfg: DFlashConfig, target_cfg: qwen3.TargetConfig
                            ) -> tuple[int, ...]:
  """The target layers a training step of cfg's family captures: the drafter's target_layers,
  then, for a DSpark drafter with a confidence head, the target's final-normed state (HF index
  n_layers, from which the step computes the target's logits at the block rows) unless
  target_layers already holds it. One H-wide row per position is the fewest bytes that give
  those logits (a logits row is V wide)."""
  layers = tuple(cfg.target_layers)
  n = target_cfg.num_hidden_layers
  if cfg.family == "dspark" and cfg.dspark.confidence_head and n not in layers:
    layers += (n,)
  return layers


def drafter_loss(w: Any, target: qwen3.TargetParams, batch: DrafterBatch,
                 features: jax.Array | None = None, *, cfg: DFlashConfig,
                 target_cfg: qwen3.TargetConfig, tc: DrafterTrainConfig):
  """(loss, metrics) of drafter weights w on a batch, by cfg's family (`FAMILY_LOSSES`);
  features None: computed online from the target (else cached features [S, T, F] of
  `training_capture_layers`). tok_embd / lm_head are the target's."""
  return FAMILY_LOSSES[cfg.family](w, target, batch, features, cfg=cfg, target_cfg=target_cfg,
                                   tc=tc)


def _features(target, target_cfg, cfg, batch, features):
  if features is None:
    features = target_features(target, target_cfg, training_capture_layers(cfg, target_cfg),
                               batch.tokens)
  return features


def dflash_loss(w: Any, target: qwen3.TargetParams, batch: DrafterBatch,
                features: jax.Array | None = None, *, cfg: DFlashConfig,
                target_cfg: qwen3.TargetConfig, tc: DrafterTrainConfig):
  """DFlash (SPEC.md section 10): the decayed block CE (`loss.block_loss`)."""
  features = _features(target, target_cfg, cfg, batch, features)
  logits = block_logits(w, target.embed, target.head, cfg, features, batch.tokens,
                        batch.anchors, window=tc.window, compute_dtype=tc.compute_dtype)
  labels, weights = block_targets(batch.tokens, batch.loss_mask, batch.anchors,
                                  batch.anchor_valid, cfg.block_size,
                                  resolve_gamma(cfg.block_size, tc.gamma))
  return block_loss(logits, labels, weights)


def dflash2_loss(w: Any, target: qwen3.TargetParams, batch: DrafterBatch,
                 features: jax.Array | None = None, *, cfg: DFlashConfig,
                 target_cfg: qwen3.TargetConfig, tc: DrafterTrainConfig):
  """DFlash2: the block CE of DFlash on the transformed logits (it trains the backbone and the
  convolutions), plus selector_weight times the selector loss (`loss.selector_loss`, teacher
  forcing), which trains the codebooks and selector_hidden only: its logits and hidden states
  are not differentiated (our choice: the ranking on top of the backbone's logits is the
  selector's job, the logits stay the block CE's). Metrics: block_loss's (`block_loss` = its
  loss; `accept` from per-row argmaxes), the selector's (`sel_*`) and `loss`, the total."""
  features = _features(target, target_cfg, cfg, batch, features)
  logits, h = F.dflash2_block_outputs(w, target.embed, target.head, cfg, features, batch.tokens,
                                      batch.anchors, window=tc.window,
                                      compute_dtype=tc.compute_dtype)
  labels, weights = block_targets(batch.tokens, batch.loss_mask, batch.anchors,
                                  batch.anchor_valid, cfg.block_size,
                                  resolve_gamma(cfg.block_size, tc.gamma))
  ce, metrics = block_loss(logits, labels, weights)
  sel = F.selector_scores(w, jax.lax.stop_gradient(logits), jax.lax.stop_gradient(h),
                          F.teacher_prevs(cfg, batch.tokens, batch.anchors), labels,
                          cfg.dflash2.selector_top_k, compute_dtype=tc.compute_dtype)
  sl, sel_metrics = selector_loss(sel.label_score, sel.scores, sel.label_index, weights)
  total = ce + tc.selector_weight * sl
  return total, dict(metrics, **sel_metrics, block_loss=ce, loss=total)


def dspark_loss(w: Any, target: qwen3.TargetParams, batch: DrafterBatch,
                features: jax.Array | None = None, *, cfg: DFlashConfig,
                target_cfg: qwen3.TargetConfig, tc: DrafterTrainConfig):
  """DSpark: the decayed CE of the Markov-corrected logits along the teacher-forced path (rows
  shifted when sample_from_anchor: row k predicts x_{a+k+1} with weight exp(-k/gamma)), plus,
  with a confidence head, confidence_weight times its BCE against 1 - TV(draft, target) at
  each row (`loss.confidence_loss`), the target's logits there computed from its captured
  final-normed state. Metrics: `ce`, `row_acc`, `accept` (`accept_run` from the first draft
  row), the confidence's (`conf_*`), `loss` (the total), `weight`."""
  features = _features(target, target_cfg, cfg, batch, features)
  capture = training_capture_layers(cfg, target_cfg)
  out = F.dspark_block_outputs(w, target.embed, target.head, cfg,
                               features[..., :cfg.n_embd_fc], batch.tokens, batch.anchors,
                               window=tc.window, compute_dtype=tc.compute_dtype)
  labels, weights = block_targets(batch.tokens, batch.loss_mask, batch.anchors,
                                  batch.anchor_valid, cfg.block_size,
                                  resolve_gamma(cfg.block_size, tc.gamma, cfg.shifted_rows),
                                  shifted=cfg.shifted_rows)
  ce, metrics = block_loss(out.logits, labels, weights)
  hit = jnp.argmax(out.logits, -1) == labels
  metrics = dict(metrics, ce=ce, accept=accept_run(hit, weights, cfg.first_draft_row))
  total = ce
  if out.conf_logits is not None:
    e = cfg.n_embd
    i = capture.index(target_cfg.num_hidden_layers)
    final = features[..., i * e:(i + 1) * e]
    s, t, _ = final.shape
    pos = jnp.clip(F.label_positions(cfg, batch.anchors) - 1, 0, t - 1)
    rows = jnp.take_along_axis(final, pos.reshape(s, -1, 1), 1).reshape(pos.shape + (e,))
    dt = resolve_dtype(tc.compute_dtype, "compute_dtype")
    target_logits = linear(rows, target.head.astype(dt), impl="xla")
    cl, conf_metrics = confidence_loss(out.conf_logits, out.logits, target_logits, weights)
    total = total + tc.confidence_weight * cl
    metrics.update(conf_metrics)
  return total, dict(metrics, loss=total)


# Each family's loss, by DFlashConfig.family.
FAMILY_LOSSES = {"dflash": dflash_loss, "dflash2": dflash2_loss, "dspark": dspark_loss}


def drafter_train_step(state: TrainState, target: qwen3.TargetParams, batch: DrafterBatch,
                       features: jax.Array | None = None, *, cfg: DFlashConfig,
                       target_cfg: qwen3.TargetConfig, tc: DrafterTrainConfig
                       ) -> tuple[TrainState, dict]:
  """One optimizer step of the drafter; returns (state, metrics). The target is frozen."""
  grad_fn = jax.value_and_grad(drafter_loss, has_aux=True)
  (_, metrics), grads = grad_fn(state.params, target, batch, features, cfg=cfg,
                                target_cfg=target_cfg, tc=tc)
  return _apply(state, grads, tc.optim, metrics)


drafter_train_step_jit = jax.jit(drafter_train_step,
                                 static_argnames=("cfg", "target_cfg", "tc"),
                                 donate_argnames=("state",))
drafter_eval_jit = jax.jit(drafter_loss, static_argnames=("cfg", "target_cfg", "tc"))


# --- target LM -------------------------------------------------------------------------------

def lm_loss(params: qwen3.TargetParams, tokens: jax.Array, *, cfg: qwen3.TargetConfig,
            compute_dtype: str = "bf16"):
  """Next-token cross entropy of tokens [S, T] (every position but the last predicts the next
  token), with the masters' matrices cast to compute_dtype. Returns (loss, metrics)."""
  logits, _ = qwen3.forward(cast_matrices(params, compute_dtype), cfg, tokens)
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  ce = -jnp.take_along_axis(logp, tokens[:, 1:, None].astype(jnp.int32), -1)[..., 0]
  loss = jnp.mean(ce)
  acc = jnp.mean(jnp.argmax(logits[:, :-1], -1) == tokens[:, 1:])
  return loss, dict(loss=loss, acc=acc)


def target_train_step(state: TrainState, tokens: jax.Array, *, cfg: qwen3.TargetConfig,
                      oc: OptimConfig, compute_dtype: str = "bf16") -> tuple[TrainState, dict]:
  (_, metrics), grads = jax.value_and_grad(lm_loss, has_aux=True)(
      state.params, tokens, cfg=cfg, compute_dtype=compute_dtype)
  return _apply(state, grads, oc, metrics)


target_train_step_jit = jax.jit(target_train_step, static_argnames=("cfg", "oc", "compute_dtype"),
                                donate_argnames=("state",))
lm_eval_jit = jax.jit(lm_loss, static_argnames=("cfg", "compute_dtype"))
