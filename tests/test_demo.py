"""The README's main job (`python -m dflash_jax demo`) end to end on a tiny synthetic drafter:
GGUF written and read back, jitted draft rounds, the device accept checked against the
simulated target every round (the demo asserts it)."""
from __future__ import annotations

import re

import pytest

from dflash_jax.__main__ import main


@pytest.mark.parametrize("dtype", ("fp32", "q8_0"))
def test_demo_runs(dtype, capsys):
  assert main(["demo", "--size", "tiny", "--vocab", "512", "--prefill", "40", "--rounds", "4",
               "--dtype", dtype]) == 0
  out = capsys.readouterr().out
  assert f"dtype={dtype}" in out
  assert re.search(r"rounds:  4, committed \d+ tokens", out), out


def test_demo_rejects_an_unknown_dtype():
  with pytest.raises(SystemExit):
    main(["demo", "--dtype", "int4"])
