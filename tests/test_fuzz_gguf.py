"""The drafter GGUF loader under a seeded fuzz (benchmarks/fuzz_gguf.py; the 50k-mutant run is
`python -m benchmarks.fuzz_gguf`): every mutant loads or raises DrafterFormatError naming the
file, within a per-load time limit and a memory bound of a few times the file's size."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks import fuzz_gguf as F

MUTANTS = 3000


def test_mutants_load_or_fail_cleanly(tmp_path):
  r = F.run(MUTANTS, seed=0, time_limit_s=5.0, directory=str(tmp_path))
  assert r.n == MUTANTS
  assert not r.failures, "\n".join(r.failures[:20])
  # Neither outcome is degenerate: the mutants reach the loader's later checks.
  assert r.loaded > MUTANTS // 50 and r.rejected > MUTANTS // 2, (r.loaded, r.rejected)


def test_mutants_are_a_function_of_seed_and_index(tmp_path):
  bases = F.make_bases(str(tmp_path))
  assert [F.mutant(bases, 3, i) for i in range(20)] == [F.mutant(bases, 3, i) for i in range(20)]
  assert len({F.mutant(bases, 3, i)[1] for i in range(20)}) == 20


def _slow(path):
  while True:   # CPU-bound: the limit is CPU time
    pass


def _foreign(path):
  raise IndexError("index 0 is out of bounds")


def _greedy(path):
  return np.ones(1 << 22)   # 32 MB, far over the bound for a small file


# The CPU-time limit is short only where it is the thing tested: filling 32 MB can take more
# than 0.2 s of CPU on a loaded machine, which would add a second failure to the greedy case.
@pytest.mark.parametrize("loader,expected,limit", [(_slow, "no answer within", 0.2),
                                                   (_foreign, "IndexError", 10.0),
                                                   (_greedy, "allocated", 10.0)])
def test_the_fuzz_reports_what_it_guards_against(tmp_path, loader, expected, limit):
  r = F.run(3, seed=0, time_limit_s=limit, directory=str(tmp_path), load=loader)
  assert len(r.failures) == 3 and all(expected in f for f in r.failures), r.failures
