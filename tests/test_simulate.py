"""`python -m dflash_jax simulate`: a drafter's rounds against a simulated target, end to end on a
tiny synthetic drafter (GGUF written and read back, jitted draft rounds, the device accept
checked against the simulated target every round: it raises otherwise), argument errors as one
line with exit status 2, defaults in --help, no temporary files left behind on any exit path."""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import struct
import tempfile

import jax
import numpy as np
import pytest

import dflash_jax as dfj
from dflash_jax.__main__ import _parser, main
from dflash_jax.cli import simulate as D

ON_GPU = jax.default_backend() == "gpu"

TINY = ["simulate", "--size", "tiny", "--vocab", "512", "--impl", "xla"]


@pytest.fixture
def tmpdir_only(tmp_path, monkeypatch):
  """tempfile's folder is tmp_path, so a test sees every temporary file the demo makes."""
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  return tmp_path


def _leftovers(path) -> list[str]:
  return [n for n in os.listdir(path) if n.startswith("dflash_simulate_")]


@pytest.mark.parametrize("dtype", ("fp32", "q8_0"))
def test_demo_runs(dtype, capsys, tmpdir_only):
  assert main(["simulate", "--size", "tiny", "--vocab", "512", "--prefill", "40", "--rounds", "4",
               "--dtype", dtype]) == 0
  out = capsys.readouterr().out
  assert f"dtype={dtype}" in out
  assert re.search(r"rounds:  4, committed \d+ tokens, tau \d\.\d\d \(tau = mean tokens "
                   r"committed per round = accepted drafts \+ 1", out), out
  assert "target:  simulated, not a model" in out and "not the drafter" in out
  assert _leftovers(tmpdir_only) == []


def test_prefill_of_one_token_injects_nothing(capsys, tmpdir_only):
  assert main(TINY + ["--prefill", "1", "--rounds", "2"]) == 0
  out = capsys.readouterr().out
  assert "prefill: 0 rows injected" in out and "rounds:  2," in out


def test_a_gguf_without_a_window_runs_full_attention_unless_asked(tmp_path, capsys,
                                                                  tmpdir_only):
  """A drafter GGUF with no sliding window is full attention on every layer (docs/SPEC.md
  section 2): its cache holds every position; --draft-window puts every layer in a ring."""
  cfg = dataclasses.replace(dfj.TINY_CONFIG, window=None, context_length=256,
                            layer_types=("full_attention",) * dfj.TINY_CONFIG.n_layer)
  path = dfj.save_drafter(tmp_path / "full.gguf", cfg,
                          dfj.synthetic_drafter(cfg, seed=1, with_target=False))
  base = ["simulate", "--drafter", path, "--vocab", "512", "--impl", "xla", "--prefill", "20"]
  assert main(base + ["--rounds", "2"]) == 0
  out = capsys.readouterr().out
  assert "prefill: 19 rows injected into a 256-position full-attention cache" in out, out
  assert main(base + ["--rounds", "2", "--draft-window", "64"]) == 0
  out = capsys.readouterr().out
  assert "prefill: 19 rows injected into a 64-slot ring" in out, out
  line = _fail(base + ["--rounds", "40"], capsys)   # 19 + 40 x 8 positions > 256
  assert "--prefill/--rounds" in line and "256 positions" in line and "--draft-window" in line
  line = _fail(base + ["--window", "64", "--draft-window", "64"], capsys)
  assert "--draft-window" in line and "not allowed with argument --window" in line, line


def test_round_line_does_not_land_inside_the_progress_bar(capsys, monkeypatch, tmpdir_only):
  """On a terminal the bar redraws with carriage returns; the round-0 line must start a line of
  its own (tqdm.write clears the bar first), not be appended to the bar's text."""
  monkeypatch.setattr("sys.stdout.isatty", lambda: True)
  assert main(TINY + ["--prefill", "10", "--rounds", "20"]) == 0
  out = capsys.readouterr().out
  assert "draft rounds:" in out, out   # the bar was drawn
  segments = re.split(r"[\r\n]", out)
  assert any(s.startswith("round 0: drafts [") for s in segments), out
  assert not any("draft rounds" in s and "round 0:" in s for s in segments), out


# ---------------------------------------------------------------------------------------------
# Argument errors: one line naming the argument and its range, exit status 2


def _fail(argv, capsys) -> str:
  assert main(argv) == 2
  captured = capsys.readouterr()
  lines = captured.err.strip().splitlines()
  assert len(lines) == 1, captured.err
  assert lines[0].startswith("python -m dflash_jax simulate: error: "), lines[0]
  assert "Traceback" not in captured.err + captured.out
  return lines[0]


@pytest.mark.parametrize("args,culprits", [
    (["--rounds", "0"], ["--rounds", ">= 1", "got 0"]),
    (["--rounds", "many"], ["--rounds", ">= 1", "'many'"]),
    (["--prefill", "0"], ["--prefill", ">= 1", "got 0"]),
    (["--prefill", "-3"], ["--prefill", ">= 1"]),
    (["--vocab", "1"], ["--vocab", ">= 2"]),
    (["--vocab", "7"], ["--vocab", "must exceed the drafter's mask_token_id 7", "got 7"]),
    (["--window", "0"], ["--window", ">= 1"]),
    (["--seed", "-1"], ["--seed", ">= 0"]),
    (["--dtype", "int4"], ["--dtype", "invalid choice", "'int4'"]),
    (["--size", "huge"], ["--size", "invalid choice"]),
    (["--drafter", "nothere.gguf"], ["--drafter", "no such file", "nothere.gguf"]),
    (["--prefill", str(2**31 - 100)], ["--prefill/--rounds", "int32"]),
    (["--vocab", str(10**9)], ["needs about", "GB of host memory", "this machine has"]),
    (["--bogus"], ["unrecognized arguments: --bogus"]),
])
def test_argument_errors_are_one_line(args, culprits, capsys, tmpdir_only):
  line = _fail(["simulate", "--size", "tiny"] + args, capsys)
  for c in culprits:
    assert c in line, (c, line)
  assert _leftovers(tmpdir_only) == []


def test_kernel_limits_of_the_file_are_named(tmp_path, capsys):
  cfg = dataclasses.replace(dfj.TINY_CONFIG, head_dim=8)
  path = dfj.save_drafter(tmp_path / "d8.gguf", cfg,
                          dfj.synthetic_drafter(cfg, seed=1, with_target=False))
  line = _fail(["simulate", "--drafter", path, "--vocab", "512", "--impl", "pallas"], capsys)
  assert "the drafter's shape" in line and "head_dim must be a multiple of 16" in line, line
  assert "(got 8)" in line and "--impl xla" in line, line


def test_size_with_gguf_is_refused(tmp_path, capsys):
  path = dfj.save_drafter(tmp_path / "d.gguf", dfj.TINY_CONFIG,
                          dfj.synthetic_drafter(dfj.TINY_CONFIG, seed=1, with_target=False))
  line = _fail(["simulate", "--drafter", path, "--size", "tiny"], capsys)
  assert "--size" in line and "not with --drafter" in line, line


def test_a_corrupt_gguf_is_one_line_naming_the_file_and_tensor(tmp_path, capsys):
  path = dfj.save_drafter(tmp_path / "d.gguf", dfj.TINY_CONFIG,
                          dfj.synthetic_drafter(dfj.TINY_CONFIG, seed=1, with_target=False))
  data = open(path, "rb").read()
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[:len(data) - 1000])
  line = _fail(["simulate", "--drafter", str(cut), "--vocab", "512"], capsys)
  assert "--drafter" in line and str(cut) in line and "blk.1.ffn_down.weight" in line, line
  assert "truncated" in line, line


def test_a_hostile_gguf_is_one_line(tmp_path, capsys):
  path = tmp_path / "hostile.gguf"   # a target_layers array claiming 2^60 entries
  path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 20)
                   + b"dflash.target_layers" + struct.pack("<IIQ", 9, 5, 2**60) + bytes(64))
  line = _fail(["simulate", "--drafter", str(path)], capsys)
  assert "'dflash.target_layers'" in line and f"array count {2**60}" in line, line


@pytest.mark.skipif(ON_GPU, reason="the refusal is for machines without a GPU")
def test_seed_size_is_refused_without_a_gpu_with_the_estimate(capsys, tmpdir_only):
  line = _fail(["simulate", "--size", "seed"], capsys)
  assert "--size: seed is GPU only" in line, line
  # The estimate is computed from the seed config: 5 layers x 6656, float32 on the host.
  cfg = dfj.SEED_CONFIG
  n = sum(int(np.prod(s)) for s in dfj.drafter_tensor_shapes(cfg).values())
  host_gb = (4 * (n + 2 * 8192 * cfg.n_embd) + 4 * 100 * cfg.n_embd_fc) / 1e9
  assert f"about {host_gb:.1f} GB of host memory" in line, (host_gb, line)
  assert _leftovers(tmpdir_only) == []


# ---------------------------------------------------------------------------------------------
# Help and temporary files


def test_help_shows_every_default(capsys):
  with pytest.raises(SystemExit) as info:
    main(["simulate", "--help"])
  assert info.value.code == 0
  text = " ".join(capsys.readouterr().out.split())
  parser = _parser()._subparsers._group_actions[0].choices["simulate"]
  options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
  assert len(options) == 12
  for a in options:
    assert a.help, a.dest
    if a.default is None:
      assert "default:" in " ".join(a.help.split()), a.dest   # says what None means
    else:
      assert f"(default: {a.default})" in text, a.dest
  assert "(default: small;" in text   # the synthetic size, whose argparse default is None


def test_no_temporary_folder_left_after_an_error_inside_the_run(monkeypatch, tmpdir_only):
  def broken(*args, **kwargs):
    assert _leftovers(tmpdir_only), "the temporary GGUF should exist at this point"
    raise RuntimeError("boom")

  monkeypatch.setattr(dfj, "DFlashDrafter", broken)
  with pytest.raises(RuntimeError, match="boom"):
    main(TINY + ["--rounds", "1"])
  assert _leftovers(tmpdir_only) == []


# ---------------------------------------------------------------------------------------------
# What the demo says about its simulated target


def test_simulated_tau_has_the_printed_mean():
  """The demo prints E[tau] = sum_k<B P^k for its simulated target. 40000 rounds: the sample
  mean's standard error is under 0.015; 5 of them give a false-alarm rate below 1e-6."""
  rng = np.random.default_rng(7)
  b, p = 16, D.ACCEPT_P
  taus = np.array([D._simulated_accept(rng, b) + 1 for _ in range(40000)])
  assert taus.min() >= 1 and taus.max() <= b
  expected = sum(p**k for k in range(b))
  assert abs(D._expected_tau(b) - expected) < 1e-12
  assert abs(taus.mean() - expected) < 5 * taus.std() / np.sqrt(len(taus)), (taus.mean(), expected)
