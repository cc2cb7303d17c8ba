"""The eval table (prompt lookup's proposer is tested with the decoding loop, test_decode.py)."""
import numpy as np

from dflash_jax.train import evaluate as E


def test_markdown_table_rows():
  rows = [E.EvalRow("target only", 1, 1.0, [10], 100, 2.0, 4, 4),
          E.EvalRow("drafter", 16, 3.5, [1, 2, 3], 100, 0.5, 4, 4)]
  table = E.markdown_table(rows).splitlines()
  assert table[2] == "| target only | 1 | 1.00 | 50.0 | 1.00x | - | 4/4 | - |"
  assert table[3] == "| drafter | 16 | 3.50 | 200.0 | 4.00x | - | 4/4 | 1 2 3 |"


def test_speedup_interval_brackets_the_speedup_and_widens_with_noise():
  """Per-prompt times: the bootstrap interval holds the overall speedup; a noisier method
  (the same mean, spread per-prompt speeds) gets a wider interval; one prompt gets none."""
  rng = np.random.default_rng(0)
  n = 16
  base = E.EvalRow("target only", 1, 1.0, [n], 100 * n, 1.0 * n, n, n, [100] * n, [1.0] * n)
  steady = [0.5] * n
  noisy = list(np.clip(0.5 + rng.normal(0, 0.15, n), 0.1, None))
  rows = [E.EvalRow("d", 8, 3.0, [1], 100 * n, sum(sec), n, n, [100] * n, sec)
          for sec in (steady, noisy)]
  lo0, hi0 = E.speedup_interval(rows[0], base)
  assert abs(lo0 - 2.0) < 1e-9 and abs(hi0 - 2.0) < 1e-9   # no spread: a point
  lo1, hi1 = E.speedup_interval(rows[1], base)
  speed = rows[1].tokens_per_s / base.tokens_per_s
  assert lo1 < speed < hi1 and hi1 - lo1 > 0.1, (lo1, speed, hi1)
  one = E.EvalRow("d", 8, 3.0, [1], 100, 0.5, 1, 1, [100], [0.5])
  assert E.speedup_interval(one, E.EvalRow("t", 1, 1.0, [1], 100, 1.0, 1, 1, [100], [1.0])) is None
