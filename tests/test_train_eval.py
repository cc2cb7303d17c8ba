"""Prompt lookup's proposer against a plain-Python statement of it, and the eval table."""
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.train import evaluate as E


def _python_drafts(seq, n_draft, max_ngram):
  """Longest suffix (<= max_ngram tokens, ending at seq[-1]) that occurred before; its most
  recent earlier occurrence's continuation, read periodically; else seq[-1] repeated."""
  n_past = len(seq) - 1
  for n in range(min(max_ngram, len(seq)), 0, -1):
    suffix = seq[-n:]
    ends = [e for e in range(n - 1, n_past) if seq[e - n + 1:e + 1] == suffix]
    if ends:
      e = max(ends)
      period = n_past - e
      return [seq[e + 1 + i % period] for i in range(n_draft)]
  return [seq[-1]] * n_draft


def test_ngram_drafts_match_the_plain_statement():
  rng = np.random.default_rng(0)
  fn = jax.jit(jax.vmap(E.ngram_drafts, in_axes=(0, 0, None, None)), static_argnums=(2, 3))
  size, n_draft, max_ngram = 40, 6, 3
  bufs, n_pasts, want = [], [], []
  for i in range(64):
    vocab = int(rng.integers(2, 6))   # small vocabularies: matches of every length occur
    n_past = int(rng.integers(0, size - 1))
    seq = rng.integers(0, vocab, n_past + 1).tolist()
    buf = np.full(size, 99, np.int32)   # past n_past: scratch the proposer must not read
    buf[:n_past + 1] = seq
    bufs.append(buf)
    n_pasts.append(n_past)
    want.append(_python_drafts(seq, n_draft, max_ngram))
  got = np.asarray(fn(jnp.asarray(np.stack(bufs)), jnp.asarray(n_pasts, jnp.int32), n_draft,
                      max_ngram))
  np.testing.assert_array_equal(got, np.array(want))
  assert (got != 99).all()


def test_markdown_table_rows():
  rows = [E.EvalRow("target only", 1, 1.0, [10], 100, 2.0, 4, 4),
          E.EvalRow("drafter", 16, 3.5, [1, 2, 3], 100, 0.5, 4, 4)]
  table = E.markdown_table(rows).splitlines()
  assert table[2] == "| target only | 1 | 1.00 | 50.0 | 1.00x | 4/4 | - |"
  assert table[3] == "| drafter | 16 | 3.50 | 200.0 | 4.00x | 4/4 | 1 2 3 |"
