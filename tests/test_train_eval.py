"""The eval table (prompt lookup's proposer is tested with the decoding loop, test_decode.py)."""
from dflash_jax.train import evaluate as E


def test_markdown_table_rows():
  rows = [E.EvalRow("target only", 1, 1.0, [10], 100, 2.0, 4, 4),
          E.EvalRow("drafter", 16, 3.5, [1, 2, 3], 100, 0.5, 4, 4)]
  table = E.markdown_table(rows).splitlines()
  assert table[2] == "| target only | 1 | 1.00 | 50.0 | 1.00x | 4/4 | - |"
  assert table[3] == "| drafter | 16 | 3.50 | 200.0 | 4.00x | 4/4 | 1 2 3 |"
