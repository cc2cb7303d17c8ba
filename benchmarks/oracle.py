"""An oracle proposer for benchmarks and tests: drafts are known tokens, not the drafter's.

`Oracle()` is a `decode.Proposer`: each round it proposes, for every slot, the tokens that
its per-slot sequence holds after the current position (`decode.start(...,
proposer_state=Oracle.state(sequences, length))`). With `run_drafter=True` (the default)
the drafter still runs its round (inject, block step, LM head, readout) and its drafts are
discarded (after a use XLA cannot prove void, so the work is not dead code), so a timed
round costs what a real one does while the acceptance is the oracle's: the target's
own greedy continuation gives every draft accepted, a perturbed one any acceptance length.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dflash_jax import decode as D


@dataclasses.dataclass(frozen=True)
class Oracle:
  """cut > 0: the drafter's cut (`decode.Drafter(cut)`) shortens each round's verify of the
  oracle's drafts (needs run_drafter)."""
  run_drafter: bool = True
  cut: float = 0.0

  @staticmethod
  def state(sequences: Sequence[Sequence[int]], length: int) -> np.ndarray:
    """[S, length] int32: slot s's sequence (prompt then continuation), zero-padded; rows
    longer than length are cut (their tail is never proposed within `length` positions)."""
    out = np.zeros((len(sequences), length), np.int32)
    for i, seq in enumerate(sequences):
      seq = np.asarray(seq, np.int64)[:length]
      out[i, :len(seq)] = seq
    return out

  def check(self, models, dcfg):
    if self.run_drafter and models.drafter is None:
      raise ValueError("Oracle(run_drafter=True) times the drafter's round: Models.drafter "
                       "is None (use Oracle(run_drafter=False))")
    if self.cut > 0 and not self.run_drafter:
      raise ValueError("Oracle(cut > 0) cuts on the drafter's values: it needs run_drafter")
    if self.run_drafter:
      D.Drafter(cut=self.cut).check(models, dcfg)

  def propose(self, models, dcfg, st, key):
    ring, n_verify = st.ring, None
    if self.run_drafter:
      ring, own = D.Drafter(cut=self.cut).propose(models, dcfg, st, key)
      n_verify = own.n_verify
    n = dcfg.width - 1
    drafts = jax.vmap(lambda b, p: lax.dynamic_slice(b, (p,), (n,)))(
        st.proposer_state, st.n_past + 1)
    if self.run_drafter:
      # Token ids are >= 0, so this keeps the oracle's drafts; without a use of the drafter's
      # own drafts XLA drops its block step, LM head and readout as dead code, and the timed
      # round would cost only the drafter's inject.
      drafts = jnp.where(own.drafts >= 0, drafts, own.drafts)
    return ring, D.Proposal(drafts.astype(jnp.int32), n_verify=n_verify)
