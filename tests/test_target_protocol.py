"""The decoding loop needs nothing from a target but the Target protocol (models/base.py).

`HashTarget` is a test-only target with no attention and no KV cache: its state is one
recurrent integer per sequence (a rolling hash of the committed tokens), so a rejected draft
can only be undone through `commit` restoring the state after the kept rows — truncating a
length would leave the state wrong. Its logits and features are table rows picked by that
state, so it is deterministic and cheap, and a greedy drafter that ignores it is mostly
rejected. If decode reached past the protocol (a `length` field, qwen3's functions), these
tests would fail.
"""
import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from benchmarks.oracle import Oracle
from dflash_jax import decode as D
from dflash_jax.models import base

N_STATES = 61   # a prime: the hash state's range


@flax.struct.dataclass
class HashCache:
  state: jax.Array    # [B] int32: the hash of the committed tokens
  length: jax.Array   # [B] int32


@flax.struct.dataclass
class Verified:
  """A verify's result: the cache it started from and the state after each of its rows."""
  cache: HashCache
  rows: jax.Array     # [B, w] int32


@dataclasses.dataclass(frozen=True)
class HashTarget:
  vocab_size: int = 53
  hidden_size: int = 32
  max_position_embeddings: int = 512
  eos_token_ids: tuple[int, ...] = ()

  @property
  def n_layers(self) -> int:
    return 2

  def check_capture_layers(self, capture_layers):
    return base.check_capture_layers(self.n_layers, capture_layers)

  def init_cache(self, batch, capacity, dtype="fp32"):
    return HashCache(state=jnp.zeros((batch,), jnp.int32), length=jnp.zeros((batch,), jnp.int32))

  def cache_nbytes(self, batch, capacity, dtype="fp32", verify_width=1):
    return 8 * batch

  def _states(self, state, tokens):
    """States after each row: s_t = (31 s_{t-1} + token_t + 1) mod N_STATES."""
    def step(s, tok):
      s = (31 * s + tok + 1) % N_STATES
      return s, s
    return jax.lax.scan(step, state, tokens.T)[1].T   # [B, T]

  def _outputs(self, params, states, capture_layers):
    logits = params["table"][states]
    feats = [params["feat"][states] * (i + 1) for i in self.check_capture_layers(capture_layers)]
    b, t = states.shape
    return logits, (jnp.concatenate(feats, -1) if feats else jnp.zeros((b, t, 0), jnp.float32))

  def prefill(self, params, cache, tokens, n_valid, *, capture_layers=(), impl="xla"):
    n_valid = jnp.broadcast_to(jnp.asarray(n_valid, jnp.int32), cache.state.shape)
    states = self._states(cache.state, tokens)
    last = jnp.take_along_axis(states, jnp.maximum(n_valid - 1, 0)[:, None], 1)[:, 0]
    new = HashCache(state=jnp.where(n_valid > 0, last, cache.state),
                    length=cache.length + n_valid)
    return new, self._outputs(params, states, capture_layers)[1]

  def verify(self, params, cache, tokens, *, capture_layers=(), impl="xla"):
    states = self._states(cache.state, tokens)
    logits, feats = self._outputs(params, states, capture_layers)
    return Verified(cache=cache, rows=states), logits, feats

  def commit(self, verified, n_keep):
    c = verified.cache
    kept = jnp.take_along_axis(verified.rows, jnp.maximum(n_keep - 1, 0)[:, None], 1)[:, 0]
    return HashCache(state=jnp.where(n_keep > 0, kept, c.state), length=c.length + n_keep)

  def reset(self, cache, empty):
    return HashCache(state=jnp.where(empty, 0, cache.state),
                     length=jnp.where(empty, 0, cache.length))

  def forward(self, params, tokens, *, capture_layers=(), with_logits=True):
    states = self._states(jnp.zeros(tokens.shape[:1], jnp.int32), tokens)
    logits, feats = self._outputs(params, states, capture_layers)
    return (logits if with_logits else None), feats


def _params(t: HashTarget, seed: int):
  rng = np.random.default_rng(seed)
  return {"table": jnp.asarray(rng.normal(size=(N_STATES, t.vocab_size)) * 3, jnp.float32),
          "feat": jnp.asarray(rng.normal(size=(N_STATES, t.hidden_size)), jnp.float32)}


def _drafter(t: HashTarget, seed: int):
  cfg = dataclasses.replace(dfj.TINY_CONFIG, n_layer=1, n_embd=t.hidden_size,
                            target_layers=(1, 2), mask_token_id=t.vocab_size - 1, block_size=6)
  return dfj.prepare_weights(cfg, dfj.synthetic_drafter(cfg, seed=seed, n_vocab=t.vocab_size))


def _python_greedy(params, prompt, n):
  """The target's greedy continuation computed on the host from its definition."""
  table = np.asarray(params["table"])
  s, out = 0, []
  for tok in prompt:
    s = (31 * s + tok + 1) % N_STATES
  for _ in range(n):
    tok = int(np.argmax(table[s]))
    out.append(tok)
    s = (31 * s + tok + 1) % N_STATES
  return out


def test_hash_target_is_a_target():
  assert isinstance(HashTarget(), base.Target)


@pytest.mark.parametrize("width", [2, 6])
def test_loop_is_lossless_through_the_protocol_only(width):
  t = HashTarget()
  params = _params(t, seed=0)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, t.vocab_size, n).tolist() for n in (1, 4, 9)]
  want = [_python_greedy(params, p, 20) for p in prompts]
  alone = D.generate_target_only(params, t, prompts, 20)
  assert alone.tokens == want
  models = D.Models(target=params, drafter=_drafter(t, seed=2), d2t=None, target_cfg=t)
  g = D.generate(models, D.DecodeConfig(width=width, impl="xla"), prompts, 20)
  assert g.tokens == want
  # Oracle drafts with a quarter of them wrong: every acceptance length, rollbacks of the
  # recurrent state after partial accepts.
  seqs = []
  for p, c in zip(prompts, want):
    c = np.array(c + [0] * width)
    bad = rng.random(len(c)) < 0.25
    c[bad] = (c[bad] + 1) % t.vocab_size
    seqs.append(p + c.tolist())
  g = D.generate(models, D.DecodeConfig(width=width, impl="xla", proposer=Oracle()), prompts,
                 20, proposer_state=Oracle.state(seqs, 64))
  assert g.tokens == want
  assert g.hist[:, 0].sum() > 0 and g.hist[:, 1:].sum() > 0, g.hist


def test_the_negative_control_fails():
  """A commit that moves the length but keeps the verify's last state (what truncating a
  KV cache does to a recurrent layer) breaks losslessness: the test above can fail."""

  class Truncating(HashTarget):
    def commit(self, verified, n_keep):
      return HashCache(state=verified.rows[:, -1], length=verified.cache.length + n_keep)

  t = Truncating()
  params = _params(t, seed=0)
  prompts = [[3, 1, 4, 1, 5]]
  want = [_python_greedy(params, prompts[0], 20)]
  models = D.Models(target=params, drafter=_drafter(t, seed=2), d2t=None, target_cfg=t)
  assert D.generate(models, D.DecodeConfig(width=6, impl="xla"), prompts, 20).tokens != want
