"""The DFlash2 and DSpark pieces (SPEC_dflash2_dspark), numpy float32, one function each.

DFlashRef (dflash_ref.py) assembles them around the DFlash backbone. Each function states its
section of the contract as plainly as possible; kernels are certified against them.
`gemm_in` arguments model the rounding of a bf16 GEMM's input (identity in fp32).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

_F32 = np.float32
GemmIn = Callable[[np.ndarray], np.ndarray]


def _same(x: np.ndarray) -> np.ndarray:
  return x


def sigmoid(x: np.ndarray) -> np.ndarray:
  # Written with tanh: equal to 1/(1+exp(-x)) but cannot overflow for very negative x.
  x = np.asarray(x, _F32)
  return _F32(0.5) * (_F32(1.0) + np.tanh(_F32(0.5) * x))


def softmax(x: np.ndarray, temperature: float = 1.0) -> np.ndarray:
  """softmax(x / temperature) over the last axis, float32."""
  z = np.asarray(x, _F32) / _F32(temperature)
  e = np.exp(z - z.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def sample_index(probs: np.ndarray, u: float) -> int:
  """Inverse-CDF draw from probs [n] with the uniform u in [0, 1): the first index whose
  cumulative mass exceeds u times the total (zero-mass entries are never drawn). The running
  sum is float64 so that a 200k-entry vocabulary keeps its tail."""
  cdf = np.cumsum(np.asarray(probs, np.float64))
  return int(min(np.searchsorted(cdf, float(u) * cdf[-1], side="right"), cdf.size - 1))


def check_temperature(temperature: float) -> float:
  t = float(temperature)
  if not np.isfinite(t) or t < 0:
    raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
  return t


def choose(logits: np.ndarray, temperature: float, u: float | None) -> int:
  """One row's choice: argmax (ties to the lowest index) at temperature 0, else a draw from
  softmax(logits / temperature) with the uniform u."""
  if temperature == 0:
    return int(np.argmax(logits))
  return sample_index(softmax(logits, temperature), u)


# --- DFlash2: the grouped dynamic causal convolution (section 4) -----------------------------

def conv_coefficients(d: np.ndarray, kernel_size: int) -> np.ndarray:
  """The projection output d [T, 2*K*n_groups] read as [T, side, tap, group]: feature f is side
  f // (K n_groups), tap (f // n_groups) % K, group f % n_groups (side-major, tap, group)."""
  t, f = d.shape
  return np.asarray(d, _F32).reshape(t, 2, kernel_size, f // (2 * kernel_size))


def grouped_causal_conv(y: np.ndarray, base: np.ndarray, coef: np.ndarray) -> np.ndarray:
  """One side of the convolution along block rows.

  y [T, H]; base [K, H] (that side's base kernel); coef [T, K, n_groups] (that side's dynamic
  coefficients). out[i, c] = sum_t (base[t, c] + coef[i, t, c // G]) * y[i - t, c], with
  y[i - t] = 0 before row 0 and G = H / n_groups contiguous channels per group. The
  coefficient is output row i's, whichever row it multiplies.
  """
  y = np.asarray(y, _F32)
  rows, h = y.shape
  k, n_groups = coef.shape[1], coef.shape[2]
  full = np.asarray(base, _F32)[None] + np.repeat(np.asarray(coef, _F32), h // n_groups, axis=-1)
  out = full[:, 0] * y
  for t in range(1, min(k, rows)):
    shifted = np.zeros_like(y)
    shifted[t:] = y[:rows - t]
    out = out + full[:, t] * shifted
  return out


def block_visibility(n_rows: int, causal: bool, window: int | None) -> np.ndarray:
  """[T, T] bool: block key j visible to block query i (section 5.4).

  Causal: j <= i. A sliding layer (window W) also needs i - j < W and, when non-causal,
  j - i < W (a symmetric band; it bites only for blocks longer than W). window None is a
  full-attention layer.
  """
  i = np.arange(n_rows)[:, None]
  j = np.arange(n_rows)[None, :]
  visible = np.ones((n_rows, n_rows), bool)
  if causal:
    visible &= j <= i
  if window is not None:
    visible &= i - j < window
    if not causal:
      visible &= j - i < window
  return visible


def logit_transform(raw: np.ndarray, multiplier: float, softcap: float | None) -> np.ndarray:
  """Section 6: z = raw * multiplier, then c * tanh(z / c) when the softcap c is set."""
  z = np.asarray(raw, _F32) * _F32(multiplier)
  if softcap:
    c = _F32(softcap)
    z = c * np.tanh(z / c)
  return z


# --- DFlash2: the candidate selector (section 7) ---------------------------------------------

def top_k_candidates(logits: np.ndarray, k: int) -> np.ndarray:
  """C [P, k] int64: each row's k largest logits, in descending order with ties to the lower
  id. (The contract leaves the order open; this one makes a candidate index mean the same
  thing everywhere, and the argmax over candidates then breaks ties to the lower id.)"""
  return np.argsort(-np.asarray(logits, _F32), axis=-1, kind="stable")[:, :k]


def edge_scores(prev: int, g: np.ndarray, candidates: np.ndarray, predecessor: np.ndarray,
                successor: np.ndarray) -> np.ndarray:
  """e(prev, C[j]) = sum_r A[prev, r] g[r] S[C[j], r] for the k candidates: [k] float32."""
  return (predecessor[prev] * np.asarray(g, _F32)) @ successor[candidates].T


@dataclasses.dataclass(frozen=True)
class SelectorWalk:
  """What the walk returns for the P draft rows.

  candidates [P, k] (top_k_candidates' order), scores [P, k] (s_p = unary + edge from the
  chosen predecessor), chosen [P] (the index taken in each row), drafts [P] int32 (the chosen
  candidates' ids), walk_prob [P] (softmax(s_p) at the chosen index, temperature 1: llama.cpp's
  p-min input) and, at temperature > 0, q [P, k] = softmax(s_p / T) (None at 0).
  """
  candidates: np.ndarray
  scores: np.ndarray
  chosen: np.ndarray
  drafts: np.ndarray
  walk_prob: np.ndarray
  q: np.ndarray | None


def selector_walk(logits: np.ndarray, g: np.ndarray, id_last: int, predecessor: np.ndarray,
                  successor: np.ndarray, top_k: int, temperature: float = 0.0,
                  uniforms: np.ndarray | None = None) -> SelectorWalk:
  """The walk over draft rows p = 1..P from the anchor (section 7).

  logits [P, V]: the draft rows' logits after section 6; g [P, R]: hidden_projection of each
  row's final-normed h. prev starts at id_last; each row scores its k candidates by unary
  logit plus edge(prev, candidate), takes the argmax (temperature 0) or draws from
  softmax(s / T) with uniforms[p] (temperature > 0), and the taken candidate becomes the next
  row's prev.
  """
  temperature = check_temperature(temperature)
  logits = np.asarray(logits, _F32)
  n_rows = logits.shape[0]
  if temperature > 0 and (uniforms is None or np.shape(uniforms) != (n_rows,)):
    raise ValueError(f"temperature > 0 needs uniforms [{n_rows}], got "
                     f"{None if uniforms is None else np.shape(uniforms)}")
  candidates = top_k_candidates(logits, top_k)
  unary = np.take_along_axis(logits, candidates, axis=-1)
  scores = np.empty((n_rows, top_k), _F32)
  chosen = np.empty((n_rows,), np.int64)
  prev = int(id_last)
  for p in range(n_rows):
    scores[p] = unary[p] + edge_scores(prev, g[p], candidates[p], predecessor, successor)
    chosen[p] = choose(scores[p], temperature, None if uniforms is None else uniforms[p])
    prev = int(candidates[p, chosen[p]])
  drafts = np.take_along_axis(candidates, chosen[:, None], axis=-1)[:, 0].astype(np.int32)
  walk_prob = np.take_along_axis(softmax(scores), chosen[:, None], axis=-1)[:, 0]
  q = softmax(scores, temperature) if temperature > 0 else None
  return SelectorWalk(candidates, scores, chosen, drafts, walk_prob, q)


def sparse_to_dense(candidates: np.ndarray, q: np.ndarray, n_vocab: int) -> np.ndarray:
  """Section 8's sparse draft distribution q_p(x) = sum_j q_p[j] [C_p[j] = x] as [P, V]."""
  dense = np.zeros((candidates.shape[0], n_vocab), _F32)
  np.put_along_axis(dense, candidates, np.asarray(q, _F32), axis=-1)
  return dense


# --- DSpark: the Markov head and the confidence head (sections 11, 12) -----------------------

def markov_vanilla(base: np.ndarray, e: np.ndarray, w2: np.ndarray,
                   gemm_in: GemmIn = _same) -> np.ndarray:
  """logits = base + W2 E, E = W1[prev] [R]; W2 [V, R]."""
  return base + gemm_in(e) @ w2.T


def markov_gated(base: np.ndarray, h: np.ndarray, e: np.ndarray, w_gate: np.ndarray,
                 b_gate: np.ndarray, w2: np.ndarray, gemm_in: GemmIn = _same) -> np.ndarray:
  """gate = sigmoid(Wg [h ; E] + bg) [R]; logits = base + W2 (gate * E)."""
  gate = sigmoid(gemm_in(np.concatenate([h, e])) @ w_gate.T + b_gate)
  return base + gemm_in(gate * e) @ w2.T


def markov_rnn(state: np.ndarray, base: np.ndarray, h: np.ndarray, e: np.ndarray,
               w_joint: np.ndarray, b_joint: np.ndarray, w2: np.ndarray,
               gemm_in: GemmIn = _same) -> tuple[np.ndarray, np.ndarray]:
  """z = Wj [s ; E ; h] + bj split into a, c, o (R each); g = sigmoid(a);
  s' = g s + (1 - g) tanh(c); logits = base + W2 tanh(o). Returns (logits, s')."""
  z = gemm_in(np.concatenate([state, e, h])) @ w_joint.T + b_joint
  a, c, o = np.split(z, 3)
  g = sigmoid(a)
  new_state = g * state + (_F32(1.0) - g) * np.tanh(c)
  return base + gemm_in(np.tanh(o)) @ w2.T, new_state


@dataclasses.dataclass(frozen=True)
class MarkovChain:
  """logits [n, V] along the chosen path, drafts [n] int32, prevs [n] (each row's
  predecessor: id_last, then the previous row's draft)."""
  logits: np.ndarray
  drafts: np.ndarray
  prevs: np.ndarray


def markov_chain(base: np.ndarray, h: np.ndarray, id_last: int, head: str | None,
                 w: dict[str, np.ndarray], temperature: float = 0.0,
                 uniforms: np.ndarray | None = None, gemm_in: GemmIn = _same) -> MarkovChain:
  """The draft rows' chain (section 11): row i's predecessor is id_last for the first draft row
  and the previous row's chosen token after it; its logits are base[i] corrected by the head
  (None = no Markov head: base itself); the row then takes the argmax (temperature 0) or draws
  from softmax(logits / T) over the full vocabulary with uniforms[i]. The rnn state starts at
  zero in every block and is carried row to row.

  base [n, V], h [n, H] (final-normed); w holds markov_w1 / markov_w2 and the head's own
  `markov_gate(.bias)` or `markov_joint(.bias)`.
  """
  temperature = check_temperature(temperature)
  base, h = np.asarray(base, _F32), np.asarray(h, _F32)
  n = base.shape[0]
  if temperature > 0 and (uniforms is None or np.shape(uniforms) != (n,)):
    raise ValueError(f"temperature > 0 needs uniforms [{n}], got "
                     f"{None if uniforms is None else np.shape(uniforms)}")
  if head not in (None, "vanilla", "gated", "rnn"):
    raise ValueError(f"head must be None, 'vanilla', 'gated' or 'rnn', got {head!r}")
  logits = np.empty_like(base)
  drafts = np.empty((n,), np.int32)
  prevs = np.empty((n,), np.int64)
  state = None if head != "rnn" else np.zeros((w["markov_w1"].shape[1],), _F32)
  prev = int(id_last)
  for i in range(n):
    prevs[i] = prev
    e = None if head is None else w["markov_w1"][prev]
    if head is None:
      logits[i] = base[i]
    elif head == "vanilla":
      logits[i] = markov_vanilla(base[i], e, w["markov_w2"], gemm_in)
    elif head == "gated":
      logits[i] = markov_gated(base[i], h[i], e, w["markov_gate"], w["markov_gate.bias"],
                               w["markov_w2"], gemm_in)
    else:
      logits[i], state = markov_rnn(state, base[i], h[i], e, w["markov_joint"],
                                    w["markov_joint.bias"], w["markov_w2"], gemm_in)
    drafts[i] = choose(logits[i], temperature, None if uniforms is None else uniforms[i])
    prev = int(drafts[i])
  return MarkovChain(logits, drafts, prevs)


def confidence(h: np.ndarray, e: np.ndarray | None, w_conf: np.ndarray, b_conf: np.ndarray,
               gemm_in: GemmIn = _same) -> np.ndarray:
  """conf_i = sigmoid(w . f_i + b), f_i = [h_i ; E_i] with the Markov feature (E_i =
  W1[prev_i]) or h_i without: [n] float32, the probability that draft i is accepted given
  that the drafts before it were (section 12.1)."""
  f = np.asarray(h, _F32) if e is None else np.concatenate([h, e], axis=-1)
  return sigmoid(gemm_in(f) @ w_conf[0] + b_conf[0])


# --- the verify length (section 12.2 and llama.cpp's p-min) ----------------------------------

def verify_length(values: np.ndarray, threshold: float) -> int:
  """How many drafts to verify: all when threshold <= 0, else those before the first row whose
  value is below threshold (0 = no draft this round). DSpark's static cut passes the per-row
  confidence (not the survival product); the p-min cut of DFlash / DFlash2 passes the drafter's
  own probability of each draft (Draft.draft_prob)."""
  values = np.asarray(values)
  if threshold <= 0:
    return int(values.shape[0])
  below = np.flatnonzero(values < threshold)
  return int(below[0]) if below.size else int(values.shape[0])
