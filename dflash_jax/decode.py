"""Speculative decoding: a DFlash drafter proposes, a target model verifies (SPEC.md sections 4, 9).

One round, on device, for every slot (sequence) of the state at once:
  draft (`step.draft_round`: inject the rows committed last round, then the block step)
  -> verify `[id_last, drafts]` with the target (one cached forward of `width` rows, which
     also captures the features the drafter needs)
  -> accept (greedy: the agreeing prefix; sampling: rejection sampling, `sampling.py`)
  -> commit drafts[:n_ok] + one target token (correction or bonus), roll the target cache
     back to the committed length (no copy)
  -> the committed rows' features (verify rows 0..n_ok) wait in the state; the next round's
     draft_round injects them at positions n_past .. n_past + n_ok.
Each phase runs under a `jax.named_scope` of that name (draft, verify, accept, commit), so a
`jax.profiler` trace of the loop (`python -m benchmarks.profile --what round`) reads by phase.
`run_rounds` runs up to R rounds inside one `lax.while_loop` in one jitted call with the whole
state donated; the loop ends early once every slot is done (EOS or max length, checked on
device each round). `generate` calls it every R rounds to stream the new tokens.

The loop talks to the target only through the `Target` protocol (models/base.py: prefill,
verify without commit, commit(n_keep) per slot, the config facts), so any family runs here;
and to the drafter only through a `DrafterRun` (`LocalRun` here, `sharding.MeshRun` on a
mesh: `sharding.shard_models` binds both once, and nothing below branches on a mesh).
Target-only decoding (`generate_target_only`) is the same loop at width 1 with no drafter, so
speculative and target-only outputs come from the same target code. Who drafts is a
`Proposer`: the drafter (`Drafter`), prompt lookup (`Lookup`, n-gram drafting from the
committed tokens), or one that tests and benchmarks define (an oracle of known tokens): only
the proposer differs; verify, accept and commit are shared.

Every array of `DecodeState` has a leading slot axis S (batch 1 is S = 1); slots are
independent sequences. A finished slot keeps its tokens, lengths and counts; it still runs
through the (batched) round until every slot is done, and the harmless work it does lands
only where it is never read (target cache slots past its length, its own ring).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Protocol, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dflash_jax import sampling as SP
from dflash_jax.drafter import step
from dflash_jax.drafter.weights import DrafterParams
from dflash_jax.io import programs
from dflash_jax.models.base import Target, prefill_bucket
from dflash_jax.sampling import Sampling


class DrafterRun(Protocol):
  """How the drafter's calls run: on one device (`LocalRun`) or on a mesh
  (`sharding.MeshRun`). Every array has a leading slot axis S."""

  def init_ring(self, cfg, n_slots: int, window, ring_dtype, capacity) -> step.RingState:
    """Empty rings for n_slots sequences."""

  def inject(self, params: DrafterParams, ring: step.RingState, features: jax.Array,
             positions: jax.Array, n_valid: jax.Array, *, impl: str) -> step.RingState:
    """Encode features [S, T, F] and inject rows t < n_valid[s] at positions [S, T]."""

  def draft_round(self, params: DrafterParams, ring: step.RingState, new_features: jax.Array,
                  n_new: jax.Array, id_last: jax.Array, n_past: jax.Array, active: jax.Array,
                  *, width: int, impl: str, temperature: float = 0.0,
                  key: jax.Array | None = None) -> tuple[step.RingState, step.Draft]:
    """`step.propose_round_batched` -> (ring, the Draft of blocks of `width` rows; sampled at
    temperature > 0 with key [S])."""

  def place(self, tree: Any) -> Any:
    """Place the decode state's per-slot arrays (leading axis S) where the calls run."""


@dataclasses.dataclass(frozen=True)
class LocalRun:
  """The drafter's calls on the default device: the step's batched functions as they are."""

  def init_ring(self, cfg, n_slots, window, ring_dtype, capacity):
    return step.init_batched_ring(cfg, n_slots, window, ring_dtype, capacity)

  def inject(self, params, ring, features, positions, n_valid, *, impl):
    return step.inject_batched(params, ring, step.encode(params, features, impl=impl),
                               positions, n_valid, impl=impl)

  def draft_round(self, params, ring, new_features, n_new, id_last, n_past, active, *, width,
                  impl, temperature=0.0, key=None):
    return step.propose_round_batched(params, ring, new_features, n_new, id_last, n_past,
                                      active, width=width, impl=impl, temperature=temperature,
                                      key=key)

  def place(self, tree):
    return tree


@flax.struct.dataclass
class Models:
  """target + drafter weights. target: the target family's params; target_cfg: its config,
  a `Target` (models/base.py; `sharding.ShardedTarget` on a mesh). drafter None: target-only.
  d2t [V_draft] int32: the target id of each draft id when the drafter's LM head covers a
  reduced draft vocab (None: the drafter's head covers the target vocab). run: how the
  drafter's calls run (`LocalRun`, or `sharding.MeshRun` from `sharding.shard_models`)."""
  target: Any
  drafter: DrafterParams | None
  d2t: jax.Array | None
  target_cfg: Target = flax.struct.field(pytree_node=False)
  run: DrafterRun = flax.struct.field(pytree_node=False, default=LocalRun())


@flax.struct.dataclass
class Proposal:
  """A round's drafts [S, n] in target ids, and q: the proposal distributions the drafts were
  sampled from, or None for one-hot proposals (the drafter's argmax, prompt lookup, an
  oracle): dense [S, n, V] over target ids, or with `candidates` [S, n, k] (distinct target
  ids per row) a sparse q [S, n, k] over them (DFlash2's selector; zero elsewhere).
  n_verify [S]: how many of the n drafts each slot verifies (a confidence or p-min cut); the
  rest are padding that can never be accepted, so the width stays static. None: all n."""
  drafts: jax.Array
  q: jax.Array | None = None
  candidates: jax.Array | None = None
  n_verify: jax.Array | None = None


class Proposer(Protocol):
  """Who drafts. Static (hashable: part of `DecodeConfig`). `propose` runs inside the jitted
  round; its per-slot data, if any, is `DecodeState.proposer_state` (given to `start`)."""

  def check(self, models: Models, dcfg: "DecodeConfig") -> None:
    """Host checks before a run (ValueError naming what does not fit)."""

  def propose(self, models: Models, dcfg: "DecodeConfig", st: "DecodeState", key: jax.Array
              ) -> tuple[step.RingState | None, Proposal]:
    """-> (the drafter's ring after this round's inject, or st.ring; the proposal)."""


def block_width(cfg, width: int) -> int:
  """The drafter block that proposes a round's width - 1 drafts: width rows for DFlash and
  DFlash2 (block row 0 is the anchor's and drafts nothing), width - 1 for DSpark's shifted
  rows (block row i drafts position n_past + i + 1)."""
  return width - 1 + cfg.first_draft_row


def cut_length(values: jax.Array, threshold: float) -> jax.Array:
  """Drafts to verify per slot [S] from per-draft values [S, n]: those before the first value
  below threshold (n when none is; a cut at 0 verifies no draft)."""
  below = values < threshold
  n = values.shape[-1]
  return jnp.min(jnp.where(below, jnp.arange(n, dtype=jnp.int32), n), axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Drafter:
  """The drafter of `Models` (any family): inject last round's committed rows, draft a block
  of `block_width` rows; under sampling with `Sampling.proposals == "sampled"` the drafts are
  sampled by the family's rule (DFlash: softmax(logits / T) per row; DFlash2: the selector walk
  over its top-k candidates, a sparse q; DSpark: the Markov chain, softmax over the vocab) and
  q is that distribution along the sampled path.

  cut > 0 shortens each slot's verify (SPEC_dflash2_dspark 12.2): the drafts before the first
  one whose value is below `cut`. The value is DSpark's per-row confidence (a drafter with a
  confidence head), and for DFlash / DFlash2 the top probability of the draft row (llama.cpp's
  p-min: greedy drafts are that top token; DFlash2's walk probability, given the chosen
  predecessor; `step.Draft.top_prob`). Either value depends only on the drafts before the row,
  never on the draft it cuts, so the cut decides before the draft is looked at and the loop
  stays lossless under sampling too. The verify width stays static (the cut rows are masked),
  so nothing recompiles; the accept rule is unchanged."""
  cut: float = 0.0

  def __post_init__(self):
    if isinstance(self.cut, bool) or not isinstance(self.cut, (int, float)) or not (
        0.0 <= self.cut <= 1.0):
      raise ValueError(f"cut must be a number in [0, 1] (0 = off), got {self.cut!r}")

  def check(self, models, dcfg):
    if models.drafter is None:
      raise ValueError(f"width {dcfg.width} needs a drafter (width 1 is target-only decoding)")
    c = models.drafter.cfg
    if self.cut > 0 and c.family == "dspark" and not c.dspark.confidence_head:
      raise ValueError(f"Drafter(cut={self.cut}) on a DSpark drafter cuts on its confidence "
                       "head, and this drafter has none")

  def propose(self, models, dcfg, st, key):
    samp, cfg = dcfg.sampling, models.drafter.cfg
    sampled = not samp.greedy and samp.proposals == "sampled"
    active = jnp.ones(st.n_past.shape, jnp.bool_)
    ring, d = models.run.draft_round(
        models.drafter, st.ring, st.pending, st.n_new, st.id_last, st.n_past, active,
        width=block_width(cfg, dcfg.width), impl=dcfg.impl,
        temperature=samp.temperature if sampled else 0.0, key=key if sampled else None)
    drafts, q = d.drafts, d.q
    candidates = d.candidates if q is not None and d.candidates is not None else None
    if models.d2t is not None:   # DFlash with a reduced draft vocab: q over target ids
      if q is not None:
        s, n = q.shape[:2]
        q = jnp.zeros((s, n, models.target_cfg.vocab_size), q.dtype).at[:, :, models.d2t].set(q)
      drafts = models.d2t[drafts]
    n_verify = None
    if self.cut > 0:
      n_verify = cut_length(d.conf if cfg.family == "dspark" else d.top_prob, self.cut)
    return ring, Proposal(drafts.astype(jnp.int32), q, candidates, n_verify)


@dataclasses.dataclass(frozen=True)
class Lookup:
  """Prompt lookup (`ngram_drafts` on matches of up to max_ngram tokens): drafts from the
  committed tokens, no drafter (Models.drafter and d2t None), one-hot proposals."""
  max_ngram: int = 3

  def __post_init__(self):
    if (isinstance(self.max_ngram, bool) or not isinstance(self.max_ngram, int)
        or self.max_ngram < 1):
      raise ValueError(f"max_ngram must be an int >= 1, got {self.max_ngram!r}")

  def check(self, models, dcfg):
    if models.drafter is not None or models.d2t is not None:
      raise ValueError("prompt lookup drafts from the committed tokens: Models.drafter and "
                       "Models.d2t must be None")
    if not dcfg.sampling.greedy and dcfg.sampling.proposals == "sampled":
      raise ValueError("prompt lookup proposes one-hot drafts: sampled proposals "
                       "(Sampling.proposals='sampled') need the drafter")

  def propose(self, models, dcfg, st, key):
    drafts = jax.vmap(ngram_drafts, in_axes=(0, 0, None, None))(st.tokens, st.n_past,
                                                                 dcfg.width - 1, self.max_ngram)
    return st.ring, Proposal(drafts)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Static knobs of the loop. width: rows the target verifies per round, the same for every
  proposer and family: id_last + width - 1 drafts (1 = target-only; >= 2 with lookup). With a
  drafter the block that proposes them has `block_width(cfg, width)` rows, in [2, block_size]:
  width 2 .. block_size for DFlash / DFlash2, 3 .. block_size + 1 for DSpark (its block of w
  rows gives w drafts). proposer: who drafts (`Drafter()`, `Drafter(cut=...)`,
  `Lookup(max_ngram)`, or a `Proposer` of your own). impl: the drafter's kernels and the
  acceptance scan ("pallas" or "xla"); target_impl: the target's GEMMs ("xla", or "pallas"
  for the skinny GEMM)."""
  width: int
  sampling: Sampling = Sampling()
  impl: str = "pallas"
  target_impl: str = "xla"
  proposer: Proposer = Drafter()

  def __post_init__(self):
    if isinstance(self.width, bool) or not isinstance(self.width, int) or self.width < 1:
      raise ValueError(f"width must be an int >= 1, got {self.width!r}")
    step.kernels(self.impl)
    step.kernels(self.target_impl)
    if not callable(getattr(self.proposer, "propose", None)):
      raise ValueError(f"proposer must be a Proposer (Drafter(), Lookup(), ...), got "
                       f"{self.proposer!r}")


@flax.struct.dataclass
class DecodeState:
  """The whole decoding state (donated into every call). Per slot s: tokens[s, :n_past+1]
  are the prompt and committed tokens (id_last = tokens[s, n_past]); the target cache holds
  positions < n_past; pending/n_new: features of the rows committed last round, not yet in
  the ring; hist[s, j]: rounds that accepted j drafts; eos: the ids that end the sequence
  (-1 pads); proposer_state: a custom proposer's per-slot data (None for the built-in ones)."""
  cache: Any
  ring: step.RingState | None       # leading slot axis
  tokens: jax.Array                 # [S, L] int32
  n_past: jax.Array                 # [S] int32
  id_last: jax.Array                # [S] int32
  pending: jax.Array | None         # [S, width, F] float32
  n_new: jax.Array                  # [S] int32
  n_prompt: jax.Array               # [S] int32
  max_len: jax.Array                # [S] int32: n_prompt + max_new
  done: jax.Array                   # [S] bool
  rounds: jax.Array                 # [S] int32
  hist: jax.Array                   # [S, width] int32
  eos: jax.Array                    # [S, n_eos] int32
  key: jax.Array                    # [S] PRNG keys
  proposer_state: Any = None


def check_models(models: Models, dcfg: DecodeConfig) -> None:
  """Host checks that the drafter fits the target and the loop (raises ValueError)."""
  tc = models.target_cfg
  d = models.drafter
  if dcfg.width == 1:
    if d is not None:
      raise ValueError("width 1 is target-only decoding: Models.drafter must be None")
    return
  dcfg.proposer.check(models, dcfg)
  if d is None:
    return
  c = d.cfg
  lo, hi = 3 - c.first_draft_row, c.max_verify_width
  if not lo <= dcfg.width <= hi:
    raise ValueError(f"width (rows verified per round: id_last + width - 1 drafts) must lie in "
                     f"[{lo}, {hi}] with a {c.family} drafter of block_size {c.block_size} "
                     f"(its block of {block_width(c, dcfg.width)} rows would draft "
                     f"{dcfg.width - 1}), got {dcfg.width}")
  if c.n_embd != tc.hidden_size:
    raise ValueError(f"drafter n_embd {c.n_embd} != target hidden_size {tc.hidden_size}")
  if d.n_vocab != tc.vocab_size:
    raise ValueError(f"drafter tok_embd has {d.n_vocab} rows; the target vocab is "
                     f"{tc.vocab_size} (the drafter embeds target ids)")
  try:
    tc.check_capture_layers(c.target_layers)
  except ValueError as e:
    raise ValueError(f"drafter target_layers {c.target_layers} (HF target_layer_ids + 1) do "
                     f"not fit the target: {e}") from None
  n_head = int(d.lm_head.shape[0])
  if models.d2t is None:
    if n_head != tc.vocab_size:
      raise ValueError(f"drafter lm_head has {n_head} rows != target vocab {tc.vocab_size}; "
                       "a reduced draft vocab needs d2t")
  else:
    d2t = np.asarray(models.d2t)
    if d2t.shape != (n_head,) or not np.issubdtype(d2t.dtype, np.integer):
      raise ValueError(f"d2t must be [{n_head}] integers (one target id per drafter lm_head "
                       f"row), got {d2t.dtype}{list(d2t.shape)}")
    if d2t.min() < 0 or d2t.max() >= tc.vocab_size or len(np.unique(d2t)) != len(d2t):
      raise ValueError(f"d2t must hold distinct target ids in [0, {tc.vocab_size})")


def d2t_from_offsets(offsets) -> np.ndarray:
  """EAGLE-3 / speculators files store d2t as offsets (target id = draft id + d2t[draft id]);
  this returns the absolute target ids that `Models.d2t` takes."""
  off = np.asarray(offsets)
  if off.ndim != 1 or not np.issubdtype(off.dtype, np.integer):
    raise ValueError(f"d2t offsets must be a 1-D integer array, got {off.dtype}{list(off.shape)}")
  return (np.arange(len(off)) + off).astype(np.int32)


def _capture(models: Models) -> tuple[int, ...]:
  return models.drafter.cfg.target_layers if models.drafter is not None else ()


# --- one round --------------------------------------------------------------------------------

def ngram_drafts(tokens: jax.Array, n_past: jax.Array, n_draft: int, max_ngram: int
                 ) -> jax.Array:
  """Prompt-lookup drafts [n_draft] int32 for one sequence whose committed tokens are
  tokens[:n_past + 1] (tokens[n_past] = id_last; later entries do not matter): the tokens
  that followed the most recent earlier occurrence of the longest suffix (up to max_ngram
  tokens, ending at id_last) of the committed text, read periodically when that occurrence
  is closer than n_draft; with no match, id_last repeated."""
  size = tokens.shape[0]
  e = jnp.arange(size, dtype=jnp.int32)
  cand = e < n_past          # a match must end before the suffix itself
  chosen = jnp.int32(-1)
  for k in range(max_ngram):  # n-gram length k + 1; a longer match overrides a shorter one
    src = tokens[jnp.clip(e - k, 0, size - 1)]
    cand = cand & (e - k >= 0) & (n_past - k >= 0) & (src == tokens[jnp.maximum(n_past - k, 0)])
    last = jnp.max(jnp.where(cand, e, -1))
    chosen = jnp.where(last >= 0, last, chosen)
  period = jnp.maximum(n_past - chosen, 1)
  idx = chosen + 1 + jnp.arange(n_draft, dtype=jnp.int32) % period
  return jnp.where(chosen >= 0, tokens[jnp.clip(idx, 0, size - 1)], tokens[n_past])


def verify(models: Models, dcfg: DecodeConfig, st: DecodeState, drafts: jax.Array):
  """The target on [id_last, drafts] (nothing committed) -> (cache, logits [S, w, V],
  features [S, w, F])."""
  vtok = jnp.concatenate([st.id_last[:, None], drafts], axis=1)
  return models.target_cfg.verify(models.target, st.cache, vtok, capture_layers=_capture(models),
                                   impl=dcfg.target_impl)


def accept_commit(models: Models, dcfg: DecodeConfig, st: DecodeState, proposal: Proposal,
                  logits, feats, key: jax.Array) -> DecodeState:
  """Accept (greedy prefix or rejection sampling), commit the kept verify rows in the target
  cache (`Target.commit`), keep the verify features for the next round's inject. st.cache
  is the cache the verify returned; the returned state's ring is st's (the caller sets it)."""
  w, n, samp = dcfg.width, dcfg.width - 1, dcfg.sampling
  drafts = proposal.drafts
  s = st.n_past.shape[0]
  active = ~st.done
  with jax.named_scope("accept"):
    if samp.greedy:
      target_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      n_ok = (step.accept(drafts, target_tokens[:, :n], impl=dcfg.impl) if n
              else jnp.zeros((s,), jnp.int32))
      if proposal.n_verify is not None:   # drafts past the cut are never accepted
        n_ok = jnp.minimum(n_ok, proposal.n_verify)
      t = jnp.take_along_axis(target_tokens, n_ok[:, None], axis=1)[:, 0]
    else:
      n_ok, t = SP.verify_sampled(key, drafts, SP.probs(logits, samp), proposal.q,
                                  candidates=proposal.candidates, n_valid=proposal.n_verify)
  with jax.named_scope("commit"):
    rows = jnp.arange(w, dtype=jnp.int32)[None]
    # Row i of the commit: drafts[i] for i < n_ok, then t; rows past n_ok are scratch.
    committed = jnp.where(rows < n_ok[:, None], jnp.concatenate([drafts, t[:, None]], axis=1),
                          t[:, None])
    tokens = jax.vmap(lambda b, c, p: lax.dynamic_update_slice(b, c, (p,)))(
        st.tokens, committed, st.n_past + 1)
    n_past = st.n_past + n_ok + 1
    is_eos = (committed[:, :, None] == st.eos[:, None, :]).any(-1) & (rows <= n_ok[:, None])
    stop = (n_past + 1 >= st.max_len) | is_eos.any(-1)

    def keep(new, old):   # finished slots keep their state
      return jnp.where(active.reshape(-1, *([1] * (new.ndim - 1))), new, old)

    # The verify rows 0..n_ok (id_last and the accepted drafts) are now committed.
    cache = models.target_cfg.commit(st.cache, jnp.where(active, n_ok + 1, 0))
    return st.replace(
        cache=cache, tokens=keep(tokens, st.tokens), n_past=keep(n_past, st.n_past),
        id_last=keep(t, st.id_last),
        pending=None if st.pending is None else keep(feats, st.pending),
        n_new=keep(n_ok + 1, st.n_new), done=st.done | (active & stop),
        rounds=st.rounds + active,
        hist=st.hist.at[jnp.arange(s), n_ok].add(active.astype(jnp.int32)))


def round_keys(st: DecodeState) -> jax.Array:
  """Each slot's key split for one round: [S, 3] (next state, propose, accept)."""
  return jax.vmap(lambda k: jax.random.split(k, 3))(st.key)


def one_round(models: Models, dcfg: DecodeConfig, st: DecodeState) -> DecodeState:
  """propose -> verify -> accept + commit (the next round's propose injects the features)."""
  s = st.n_past.shape[0]
  keys = round_keys(st)
  ring, proposal = st.ring, Proposal(jnp.zeros((s, 0), jnp.int32))
  if dcfg.width > 1:
    with jax.named_scope("draft"):
      ring, proposal = dcfg.proposer.propose(models, dcfg, st, keys[:, 1])
  with jax.named_scope("verify"):
    cache, logits, feats = verify(models, dcfg, st, proposal.drafts)
  st = accept_commit(models, dcfg, st.replace(cache=cache), proposal, logits, feats, keys[:, 2])
  return st.replace(ring=ring, key=keys[:, 0])


def _rounds(models: Models, dcfg: DecodeConfig, state: DecodeState, max_rounds) -> DecodeState:
  def cond(c):
    return (c[1] < max_rounds) & ~jnp.all(c[0].done)

  def body(c):
    return one_round(models, dcfg, c[0]), c[1] + 1
  return lax.while_loop(cond, body, (state, jnp.int32(0)))[0]


# Up to max_rounds rounds (a traced int32: one compile for any value) in one call.
run_rounds = jax.jit(_rounds, static_argnames=("dcfg",), donate_argnames=("state",))


def _run_rounds(models: Models, dcfg: DecodeConfig, state: DecodeState, n: int) -> DecodeState:
  """run_rounds for up to n rounds as the host loops call it: through the programs kept on
  disk (`io.programs`: a later process loads it without tracing when JAX's cache is on)."""
  return programs.call(run_rounds, "rounds", dict(dcfg=dcfg), models=models, state=state,
                       max_rounds=np.int32(n))


def _prefill(models: Models, cache, ring, tokens, n_valid, *, impl: str, target_impl: str):
  """The target's prefill of tokens (n_valid rows per slot) and, with a drafter, the captured
  features injected into its ring; traced inside `_start` and `_join`."""
  cache, feats = models.target_cfg.prefill(models.target, cache, tokens, n_valid,
                                           capture_layers=_capture(models), impl=target_impl)
  if models.drafter is not None:
    pos = jnp.broadcast_to(jnp.arange(feats.shape[1], dtype=jnp.int32), feats.shape[:2])
    ring = models.run.inject(models.drafter, ring, feats, pos, n_valid, impl=impl)
  return cache, ring


# --- host side -------------------------------------------------------------------------------

def _check_prompts(prompts, vocab: int) -> list[np.ndarray]:
  if not prompts:
    raise ValueError("no prompts")
  out = []
  for i, p in enumerate(prompts):
    a = np.asarray(p)
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
      raise ValueError(f"prompt {i} must be a non-empty list of token ids, got {a.dtype}{list(a.shape)}")
    if a.min() < 0 or a.max() >= vocab:
      raise ValueError(f"prompt {i} holds token ids outside the vocab [0, {vocab}): "
                       f"[{a.min()}, {a.max()}]")
    out.append(a.astype(np.int32))
  return out


def start(models: Models, dcfg: DecodeConfig, prompts: Sequence[Sequence[int]], max_new: int, *,
          eos_ids: Sequence[int] = (), seed: int = 0, capacity: int | None = None,
          window: int | None = None, cache_dtype: Any = "fp32", ring_dtype: Any = "fp32",
          proposer_state: Any = None, prefill_len: int | None = None) -> DecodeState:
  """Prefill every prompt (one slot each; SPEC.md section 4 step 1) and return the state.

  capacity: target cache slots (default: the longest prompt + max_new + width, the least
  that the loop can need, rounded up to a multiple of 16), and the slots of the drafter's
  full-attention cache (which holds the same positions). The prompt is prefilled in one
  call padded to a power of two (at most the capacity). proposer_state: the per-slot data
  of a custom proposer (a pytree of arrays with a leading slot axis), kept in the state.
  prefill_len: the padded prefill length instead of the longest prompt's power of two (at
  least the longest prompt - 1, at most the capacity): one compilation for many prompt sets.
  """
  check_models(models, dcfg)
  tc = models.target_cfg
  ps = _check_prompts(prompts, tc.vocab_size)
  if isinstance(max_new, bool) or not isinstance(max_new, (int, np.integer)) or max_new < 1:
    raise ValueError(f"max_new must be an int >= 1, got {max_new!r}")
  eos_ids = tuple(int(e) for e in eos_ids)
  bad = [e for e in eos_ids if not 0 <= e < tc.vocab_size]
  if bad:
    raise ValueError(f"eos ids {bad} outside the vocab [0, {tc.vocab_size})")
  s, w = len(ps), dcfg.width
  for leaf in jax.tree.leaves(proposer_state):
    if not np.shape(leaf) or np.shape(leaf)[0] != s:
      raise ValueError(f"proposer_state arrays need a leading slot axis of {s} (one per "
                       f"prompt), got shape {list(np.shape(leaf))}")
  longest = max(len(p) for p in ps)
  need = longest + max_new + w
  if capacity is None:
    capacity = -(-need // 16) * 16
  if capacity < need:
    raise ValueError(f"capacity {capacity} < longest prompt {longest} + max_new {max_new} + "
                     f"width {w} = {need}")
  if need > tc.max_position_embeddings:
    raise ValueError(f"longest prompt {longest} + max_new {max_new} + width {w} = {need} "
                     f"positions exceed the target's max_position_embeddings "
                     f"{tc.max_position_embeddings}")
  buf_len = capacity + w
  tokens = np.zeros((s, buf_len), np.int32)
  for i, p in enumerate(ps):
    tokens[i, :len(p)] = p
  n_prompt = np.array([len(p) for p in ps], np.int32)
  bucket = min(prefill_bucket(longest - 1), capacity) if prefill_len is None else prefill_len
  if not longest - 1 <= bucket <= capacity:
    raise ValueError(f"prefill_len {bucket} must lie in [longest prompt - 1 = {longest - 1}, "
                     f"capacity {capacity}]")
  statics = dict(capacity=capacity, window=window, cache_dtype=cache_dtype,
                 ring_dtype=ring_dtype, bucket=bucket, impl=dcfg.impl,
                 target_impl=dcfg.target_impl)
  # jax.random.key of a Python int keeps its low 32 bits (64-bit ints are off): the same key.
  return programs.call(_start, "start", statics, models=models, tokens=tokens,
                       n_prompt=n_prompt, max_len=(n_prompt + max_new).astype(np.int32),
                       eos=np.tile(np.array(eos_ids or (-1,), np.int32), (s, 1)),
                       seed=np.uint32(seed % 2**32), proposer_state=proposer_state)


@functools.partial(jax.jit, static_argnames=("capacity", "window", "cache_dtype", "ring_dtype",
                                             "bucket", "impl", "target_impl"))
def _start(models: Models, tokens, n_prompt, max_len, eos, seed, proposer_state, *,
           capacity: int, window, cache_dtype, ring_dtype, bucket: int, impl: str,
           target_impl: str) -> DecodeState:
  """start's device work as one program (a later process loads it whole, where separate
  array creations would each be traced, lowered and looked up): the empty target cache and
  ring, the prefill of tokens[:, :bucket], each slot's entries. tokens [S, capacity + width]."""
  s, w = tokens.shape[0], tokens.shape[1] - capacity
  cache = models.target_cfg.init_cache(s, capacity, cache_dtype)
  ring = pending = None
  if models.drafter is not None:
    ring = models.run.init_ring(models.drafter.cfg, s, window, ring_dtype, capacity)
    pending = jnp.zeros((s, w, models.drafter.cfg.n_embd_fc), jnp.float32)
  n_past = n_prompt - 1
  cache, ring = _prefill(models, cache, ring, tokens[:, :bucket], n_past, impl=impl,
                         target_impl=target_impl)
  slots = models.run.place(dict(
      tokens=tokens, n_past=n_past, id_last=tokens[jnp.arange(s), n_past], pending=pending,
      n_new=jnp.zeros((s,), jnp.int32), n_prompt=n_prompt, max_len=max_len,
      done=jnp.zeros((s,), bool), rounds=jnp.zeros((s,), jnp.int32),
      hist=jnp.zeros((s, w), jnp.int32), eos=eos,
      key=jax.random.split(jax.random.key(seed), s), proposer_state=proposer_state))
  return DecodeState(cache=cache, ring=ring, **slots)


@dataclasses.dataclass
class Generation:
  """tokens[s]: slot s's generated tokens (through the first EOS, at most max_new);
  rounds[s]; hist[s, j]: rounds with j drafts accepted; seconds: wall time of the rounds
  (after prefill; compile included on a first call); prefill_seconds likewise."""
  tokens: list[list[int]]
  rounds: np.ndarray
  hist: np.ndarray
  seconds: float
  prefill_seconds: float

  @property
  def tau(self) -> float:
    """Mean tokens committed per round: the accepted drafts plus the target's own token."""
    h = self.hist.sum(0)
    return float((h * np.arange(1, len(h) + 1)).sum() / max(h.sum(), 1))

  @property
  def n_tokens(self) -> int:
    return sum(len(t) for t in self.tokens)


def _visible(row: np.ndarray, eos_ids: tuple[int, ...], max_new: int) -> list[int]:
  out = row[:max_new].tolist()
  for i, t in enumerate(out):
    if t in eos_ids:
      return out[:i + 1]
  return out


def generate(models: Models, dcfg: DecodeConfig, prompts: Sequence[Sequence[int]], max_new: int,
             *, eos_ids: Sequence[int] = (), rounds_per_call: int = 8,
             on_tokens: Callable[[int, list[int]], None] | None = None, **start_kw) -> Generation:
  """Decode every prompt (one slot each) to max_new tokens or EOS.

  Syncs with the host once per `rounds_per_call` rounds: on_tokens(slot, new_tokens) then
  receives the tokens committed since the last sync (never past EOS or max_new). start_kw
  goes to `start` (seed, capacity, window, cache_dtype, ring_dtype, proposer_state).
  """
  if rounds_per_call < 1:
    raise ValueError(f"rounds_per_call must be >= 1, got {rounds_per_call}")
  t0 = time.perf_counter()
  eos_ids = tuple(int(e) for e in eos_ids)
  state = start(models, dcfg, prompts, max_new, eos_ids=eos_ids, **start_kw)
  jax.block_until_ready(state.n_past)
  t1 = time.perf_counter()
  n_prompt = np.asarray(state.n_prompt)
  sent = [0] * len(n_prompt)
  while True:
    state = _run_rounds(models, dcfg, state, rounds_per_call)
    n_past, done, tokens = jax.device_get((state.n_past, state.done, state.tokens))
    for i in range(len(n_prompt)):
      vis = _visible(tokens[i, n_prompt[i]:n_past[i] + 1], eos_ids, max_new)
      if on_tokens is not None and len(vis) > sent[i]:
        on_tokens(i, vis[sent[i]:])
      sent[i] = len(vis)
    if done.all():
      break
  t2 = time.perf_counter()
  rounds, hist = jax.device_get((state.rounds, state.hist))
  out = [_visible(tokens[i, n_prompt[i]:n_past[i] + 1], eos_ids, max_new)
         for i in range(len(n_prompt))]
  return Generation(tokens=out, rounds=rounds, hist=hist, seconds=t2 - t1, prefill_seconds=t1 - t0)


def generate_target_only(target: Any, cfg: Target, prompts: Sequence[Sequence[int]],
                         max_new: int, *, sampling: Sampling = Sampling(),
                         target_impl: str = "xla", **kw) -> Generation:
  """The target's own decoding (one token per round) with the same target code."""
  return generate(Models(target=target, drafter=None, d2t=None, target_cfg=cfg),
                  DecodeConfig(width=1, sampling=sampling, target_impl=target_impl), prompts,
                  max_new, **kw)


def warm_up(models: Models, dcfg: DecodeConfig, prompts: Sequence[Sequence[int]], max_new: int,
            **start_kw) -> float:
  """Compiles what `generate(models, dcfg, prompts, max_new, **start_kw)` runs (its prefill
  and its rounds, at these shapes) without decoding: `start`, then `run_rounds` for 0 rounds.
  Returns the seconds it took, so that a caller can report compilation apart from decoding
  (a later `generate` of the same shapes compiles nothing)."""
  t0 = time.perf_counter()
  state = start(models, dcfg, prompts, max_new, **start_kw)
  jax.block_until_ready(_run_rounds(models, dcfg, state, 0).n_past)
  return time.perf_counter() - t0


# --- slots that take the next prompt (continuous batching) ------------------------------------

def _reset_ring(ring: step.RingState, empty: jax.Array) -> step.RingState:
  """The batched ring with the slots where empty [S] as a fresh slot (pos -1, K/V zero)."""
  def clear(a: jax.Array, fill) -> jax.Array:
    return jnp.where(empty.reshape(-1, *([1] * (a.ndim - 1))), jnp.asarray(fill, a.dtype), a)
  return jax.tree.map(lambda c: c.replace(k=clear(c.k, 0), v=clear(c.v, 0), pos=clear(c.pos, -1)),
                      ring, is_leaf=lambda c: isinstance(c, step.KVCache))


@functools.partial(jax.jit, static_argnames=("bucket", "impl", "target_impl"),
                   donate_argnames=("state",))
def _join(models: Models, state: DecodeState, rows: jax.Array, n_prompt: jax.Array,
          max_new: jax.Array, join: jax.Array, keys: jax.Array, *, bucket: int, impl: str,
          target_impl: str) -> DecodeState:
  """New prompts into the slots where join [S]: their target cache (`Target.reset`) and ring
  emptied, their prompt rows[s] [L] (padded) prefilled into them alone (n_valid 0 elsewhere,
  which leaves the other slots as they are), their per-slot entries those of a fresh start
  (keys [S, 2]: each slot's new key as key data)."""
  s = join.shape[0]
  cache = models.target_cfg.reset(state.cache, join)
  ring = None if state.ring is None else _reset_ring(state.ring, join)
  n_valid = jnp.where(join, n_prompt - 1, 0)
  cache, ring = _prefill(models, cache, ring, rows[:, :bucket], n_valid, impl=impl,
                         target_impl=target_impl)

  def pick(new, old):
    return jnp.where(join.reshape(-1, *([1] * (old.ndim - 1))), new, old)

  return state.replace(
      cache=cache, ring=ring, tokens=pick(rows, state.tokens),
      n_past=pick(n_prompt - 1, state.n_past),
      id_last=pick(rows[jnp.arange(s), n_prompt - 1], state.id_last),
      pending=None if state.pending is None else pick(jnp.zeros_like(state.pending),
                                                      state.pending),
      n_new=pick(jnp.zeros_like(state.n_new), state.n_new), n_prompt=pick(n_prompt, state.n_prompt),
      max_len=pick(n_prompt + max_new, state.max_len), done=pick(jnp.zeros_like(state.done),
                                                                 state.done),
      rounds=pick(jnp.zeros_like(state.rounds), state.rounds),
      hist=pick(jnp.zeros_like(state.hist), state.hist),
      key=jax.random.wrap_key_data(pick(keys, jax.random.key_data(state.key))))


@dataclasses.dataclass
class Served:
  """One prompt of `serve`: its index in the prompts, generated tokens (through the first EOS,
  at most max_new), rounds, hist[j] = rounds that accepted j drafts, and seconds from the
  call that put it into a slot to the host sync that saw it finished."""
  index: int
  tokens: list[int]
  rounds: int
  hist: np.ndarray
  seconds: float

  @property
  def tau(self) -> float:
    return float((self.hist * np.arange(1, len(self.hist) + 1)).sum() / max(self.hist.sum(), 1))


@dataclasses.dataclass
class ServeStats:
  """compile_seconds: the warm-up (prefill, join and rounds compiled, before the clock);
  seconds: wall time from the first join to the last prompt finished; n_tokens: generated."""
  compile_seconds: float
  seconds: float
  n_tokens: int
  n_slots: int

  @property
  def tokens_per_s(self) -> float:
    return self.n_tokens / max(self.seconds, 1e-12)


def serve(models: Models, dcfg: DecodeConfig, prompts: Sequence[Sequence[int]], max_new: int, *,
          n_slots: int, eos_ids: Sequence[int] = (), rounds_per_call: int = 4,
          on_done: Callable[[Served], None] | None = None, seed: int = 0,
          window: int | None = None, cache_dtype: Any = "fp32", ring_dtype: Any = "fp32"
          ) -> tuple[list[Served], ServeStats]:
  """Decode many prompts on n_slots slots: each slot takes the next prompt as soon as its
  sequence finishes (EOS or max_new), while the other slots keep decoding.

  Every prompt shares one capacity (the longest prompt + max_new + width) and one prefill
  length, so nothing recompiles as prompts come and go: a join is one call (`_join`: the
  slot's target cache and ring emptied, its prompt prefilled into it alone) and the rounds are
  `run_rounds`, synced every rounds_per_call rounds (a finished slot waits at most that long
  for its next prompt). Compilation runs first, untimed (ServeStats.compile_seconds).
  on_done(Served) is called as each prompt finishes. Returns (results in prompt order,
  stats). Greedy outputs equal `generate`'s, prompt by prompt; sampled ones use each join's
  own key (seed, prompt index).
  """
  if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1:
    raise ValueError(f"n_slots must be an int >= 1, got {n_slots!r}")
  if rounds_per_call < 1:
    raise ValueError(f"rounds_per_call must be >= 1, got {rounds_per_call}")
  tc = models.target_cfg
  ps = _check_prompts(prompts, tc.vocab_size)
  eos_ids = tuple(int(e) for e in eos_ids)
  s, w = min(n_slots, len(ps)), dcfg.width
  longest = max(len(p) for p in ps)
  capacity = -(-(longest + max_new + w) // 16) * 16
  bucket = min(prefill_bucket(longest - 1), capacity)
  kw = dict(eos_ids=eos_ids, seed=seed, capacity=capacity, window=window,
            cache_dtype=cache_dtype, ring_dtype=ring_dtype)
  # Slots start empty (a one-token prompt each, done): every prompt comes in by a join.
  state = start(models, dcfg, [[0]] * s, max_new, prefill_len=bucket, **kw)
  state = state.replace(done=jnp.ones((s,), bool))
  buf = state.tokens.shape[1]
  impls = dict(bucket=bucket, impl=dcfg.impl, target_impl=dcfg.target_impl)
  # Prompt i samples with key i (the last one for slots that join nothing), as key data on
  # the host: a join then dispatches its one program and nothing else.
  prompt_keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed),
                                                                len(ps) + 1)))

  def join_call(state, assign: dict[int, int]):
    rows = np.zeros((s, buf), np.int32)
    n_prompt = np.ones(s, np.int32)
    mask = np.zeros(s, bool)
    for slot, i in assign.items():
      rows[slot, :len(ps[i])] = ps[i]
      n_prompt[slot], mask[slot] = len(ps[i]), True
    return programs.call(_join, "join", impls, models=models, state=state, rows=rows,
                         n_prompt=n_prompt, max_new=np.int32(max_new), join=mask,
                         keys=prompt_keys[[assign.get(j, len(ps)) for j in range(s)]])

  t0 = time.perf_counter()
  state = join_call(state, {})   # compiles the join (joins nothing) ...
  state = _run_rounds(models, dcfg, state, 0)   # ... and the rounds
  jax.block_until_ready(state.n_past)
  compile_seconds = time.perf_counter() - t0

  results: list[Served | None] = [None] * len(ps)
  slot_of: dict[int, int] = {}        # slot -> prompt index
  joined_at: dict[int, float] = {}
  queue = list(range(len(ps)))
  t0 = time.perf_counter()
  free = list(range(s))
  while queue or slot_of:
    if queue and free:
      assign = {slot: queue.pop(0) for slot in free[:len(queue)]}
      state = join_call(state, assign)
      now = time.perf_counter()
      for slot, i in assign.items():
        slot_of[slot], joined_at[i] = i, now
      free = [f for f in free if f not in assign]
    state = _run_rounds(models, dcfg, state, rounds_per_call)
    done, n_past, tokens, rounds, hist = jax.device_get(
        (state.done, state.n_past, state.tokens, state.rounds, state.hist))
    now = time.perf_counter()
    for slot in [sl for sl in slot_of if done[sl]]:
      i = slot_of.pop(slot)
      n0 = len(ps[i])
      r = Served(index=i, tokens=_visible(tokens[slot, n0:n_past[slot] + 1], eos_ids, max_new),
                 rounds=int(rounds[slot]), hist=hist[slot].copy(), seconds=now - joined_at[i])
      results[i] = r
      free.append(slot)
      if on_done is not None:
        on_done(r)
  seconds = time.perf_counter() - t0
  return results, ServeStats(compile_seconds=compile_seconds, seconds=seconds,
                             n_tokens=sum(len(r.tokens) for r in results), n_slots=s)
