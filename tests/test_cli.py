"""The command line as a user meets it (issue 43): every check runs before any work, errors
name the argument and the file's field, unknown commands list the valid ones, every default is
in --help, files are written 0644, interrupts and closed pipes end the process quietly and at
once, and the persistent compilation cache is used by default.

The process-level behaviour (signals, broken pipes, the compile cache) runs `python -m
dflash_jax` in subprocesses; the rest calls `main` in-process."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import dflash_jax as dfj
import tiny_models as TM
from dflash_jax.__main__ import COMMANDS, _parser, main
from dflash_jax.models import save_target
from dflash_jax.train import data as TD

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _err(capsys) -> str:
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1, lines
  assert "Traceback" not in lines[0]
  return lines[0]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """A tiny target folder with the byte tokenizer.json, and a block-8 drafter GGUF for it."""
  root = tmp_path_factory.mktemp("cli")
  tcfg, tp = TM.target(vocab=272, hidden=64, layers=2, seed=0)
  target = save_target(root / "target", tcfg, tp, dtype="f32")
  (root / "target" / "tokenizer.json").write_text(TD.TOKENIZER.hf_json())
  dcfg, w = TM.drafter_weights(tcfg, seed=1)
  drafter = dfj.save_drafter(str(root / "drafter.gguf"), dcfg, w)
  return str(root / "target"), drafter, root


# --- commands and help ---------------------------------------------------------------------------

def test_unknown_command_lists_the_valid_ones(capsys):
  assert main(["frobnicate"]) == 2
  line = _err(capsys)
  assert "unknown command 'frobnicate'" in line
  for c in COMMANDS:
    assert c in line


def test_every_default_is_in_help(capsys):
  """Each option of each command shows its default, or (default None) says what None means."""
  sub = _parser()._subparsers._group_actions[0].choices
  assert set(sub) == set(COMMANDS)
  for name, parser in sub.items():
    with pytest.raises(SystemExit):
      main([name, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    chosen = {id(a) for g in parser._mutually_exclusive_groups if g.required
              for a in g._group_actions}   # one of them must be given: no default to show
    for a in parser._actions:
      if not a.option_strings or a.dest == "help" or a.required or id(a) in chosen:
        continue
      assert a.help, (name, a.dest)
      if a.default is None:
        assert "default" in " ".join(a.help.split()).lower(), (name, a.dest, a.help)
      else:
        assert f"(default: {a.default})" in text, (name, a.dest)


def test_window_help_states_the_real_rule(capsys):
  with pytest.raises(SystemExit):
    main(["simulate", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert "power of 2" not in text
  assert "ring size of the sliding layers" in text


# --- files ---------------------------------------------------------------------------------------

def test_files_are_written_0644(tmp_path, pair):
  old = os.umask(0o022)
  try:
    tcfg, tp = TM.target(seed=3)
    folder = save_target(tmp_path / "t", tcfg, tp, dtype="bf16", max_shard_bytes=20_000)
    cfg, w = TM.drafter_weights(tcfg)
    dfj.save_drafter(str(tmp_path / "d.gguf"), cfg, w)
    dfj.save_drafter(str(tmp_path / "d-hf"), cfg, w, format="hf")
  finally:
    os.umask(old)
  files = [p for p in tmp_path.rglob("*") if p.is_file()]
  assert any(p.suffix == ".safetensors" for p in files) and any(p.suffix == ".gguf" for p in files)
  assert any(p.name.endswith(".index.json") for p in files)
  assert {oct(p.stat().st_mode & 0o777) for p in files} == {"0o644"}, [
      (p.name, oct(p.stat().st_mode & 0o777)) for p in files]
  del folder


# --- refused before any work ---------------------------------------------------------------------

def test_eval_refuses_an_existing_out_file_before_loading_anything(tmp_path, capsys):
  out = tmp_path / "results"
  out.write_text("keep me")
  assert main(["eval", "--target", str(tmp_path / "missing"), "--out", str(out)]) == 2
  line = _err(capsys)
  assert "argument --out" in line and "is a file" in line
  assert out.read_text() == "keep me"
  out.unlink()
  out.mkdir()
  (out / "eval.md").write_text("earlier results")
  assert main(["eval", "--target", str(tmp_path / "missing"), "--out", str(out)]) == 2
  line = _err(capsys)
  assert "eval.md" in line and "--force" in line


def test_eval_refuses_widths_above_a_drafters_block(pair, capsys):
  target, drafter, _ = pair
  assert main(["eval", "--target", target, "--drafter", drafter, "--widths", "100"]) == 2
  line = _err(capsys)
  assert "argument --widths" in line and "[100]" in line and "block_size 8" in line
  assert drafter in line
  assert main(["eval", "--target", target, "--drafter", drafter, "--widths", "16,8"]) == 2
  assert "[16] exceed the dflash drafter" in _err(capsys)


def test_eval_names_prompt_len_when_the_positions_do_not_fit(pair, capsys):
  target, drafter, _ = pair
  assert main(["eval", "--target", target, "--drafter", drafter, "--prompt-len", "5000"]) == 2
  line = _err(capsys)
  assert "argument --prompt-len/--gen" in line and "max_position_embeddings 512" in line


def test_mismatch_errors_name_the_argument_and_the_field(pair, tmp_path, capsys):
  target, _, _ = pair
  from dflash_jax.models import load_target
  tcfg, _ = load_target(target)
  dcfg, w = TM.drafter_weights(tcfg)
  bad = dfj.save_drafter(str(tmp_path / "far.gguf"),
                         dataclasses.replace(dcfg, target_layers=(3, 5)), w)
  for cmd in (["eval", "--target", target, "--drafter", bad],
              ["generate", "--target", target, "--drafter", bad, "--prompt-ids", "1"],
              ["demo", "--target", target, "--drafter", bad]):
    assert main(cmd) == 2
    line = _err(capsys)
    assert "argument --drafter" in line and "target_layers [3, 5]" in line, line
    assert "--target" in line and "hidden states 0..2" in line, line
  wide = dfj.save_drafter(str(tmp_path / "wide.gguf"), dataclasses.replace(dcfg, n_embd=32),
                          TM.drafter_weights(dataclasses.replace(tcfg, hidden_size=32))[1])
  assert main(["generate", "--target", target, "--drafter", wide, "--prompt-ids", "1"]) == 2
  line = _err(capsys)
  assert "argument --drafter" in line and "n_embd 32" in line and "hidden_size 64" in line


def test_convert_refuses_src_as_dst_and_existing_outputs(tmp_path, capsys):
  cfg = dfj.TINY_CONFIG
  src = dfj.save_drafter(str(tmp_path / "d.gguf"), cfg,
                         dfj.synthetic_drafter(cfg, seed=0, with_target=False), tensor_type="BF16")
  before = open(src, "rb").read()
  assert main(["convert", src, src]) == 2
  assert "is SRC itself" in _err(capsys)
  assert open(src, "rb").read() == before
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "notes.txt").write_text("x")
  assert main(["convert", src, str(tmp_path / "full")]) == 2
  assert "argument DST" in (line := _err(capsys)) and "not empty" in line and "--force" in line
  assert main(["convert", src, str(tmp_path / "full"), "--force"]) == 0
  capsys.readouterr()
  (tmp_path / "other.gguf").write_bytes(b"x")
  assert main(["convert", src, str(tmp_path / "other.gguf")]) == 2
  assert "exists" in _err(capsys)


def test_convert_keeps_the_sources_precision(tmp_path, capsys):
  """BF16 stays BF16 both ways (not doubled to F32); Q8_0 stays Q8_0 (its blocks round-trip
  exactly) and becomes F32 in an HF folder, which has no Q8_0."""
  import gguf

  from dflash_jax.io import safetensors as st
  cfg = dfj.TINY_CONFIG
  w = dfj.synthetic_drafter(cfg, seed=0, with_target=False)
  src = dfj.save_drafter(str(tmp_path / "d.gguf"), cfg, w, tensor_type="BF16")
  assert main(["convert", src, str(tmp_path / "hf")]) == 0
  assert {s.dtype for s in st.tensor_specs(tmp_path / "hf").values() if len(s.shape) == 2} == {"BF16"}
  assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "back.gguf")]) == 0
  types = {t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "back.gguf").tensors
           if len(t.shape) == 2}
  assert types == {"BF16"}
  assert os.path.getsize(tmp_path / "back.gguf") == os.path.getsize(src)
  q = dfj.save_drafter(str(tmp_path / "q.gguf"), cfg, w, tensor_type="Q8_0")
  assert main(["convert", q, str(tmp_path / "q2.gguf")]) == 0
  assert open(q, "rb").read() == open(tmp_path / "q2.gguf", "rb").read()
  assert main(["convert", q, str(tmp_path / "qhf")]) == 0
  assert "f32 (the source's Q8_0 has no HF form" in capsys.readouterr().out
  a, b = dfj.load_drafter(q)[1], dfj.load_drafter(str(tmp_path / "qhf"))[1]
  assert all((a[k] == b[k]).all() for k in a)


def test_training_refuses_a_run_that_cannot_fit(monkeypatch, tmp_path, capsys):
  """The defaults (the GPU preset) on a machine of 8 GB: refused at once with the estimate,
  before the corpus is read or anything is written."""
  from dflash_jax.train import budget
  monkeypatch.setattr(budget, "device_memory", lambda: (8e9, "a test machine's 8.0 GB"))
  out = tmp_path / "t"
  t0 = time.perf_counter()
  assert main(["train-target", "--out", str(out)]) == 2
  line = _err(capsys)
  assert "a training step needs about" in line and "GB (estimated)" in line, line
  assert "a test machine's 8.0 GB" in line and "--batch" in line, line
  assert time.perf_counter() - t0 < 5 and not out.exists()
  from dflash_jax.models import qwen3
  need = budget.target_step_bytes(
      qwen3.TargetConfig(vocab_size=272, hidden_size=384, intermediate_size=1024,
                                    num_hidden_layers=8, num_attention_heads=6,
                                    num_key_value_heads=3, head_dim=64), 64, 512)
  assert f"about {need / 1e9:.1f} GB" in line


# --- generate over many prompts ------------------------------------------------------------------

def test_generate_prompts_file_on_slots(pair, tmp_path, capsys):
  """7 prompts on 3 slots: one JSON line each, in prompt order in --out, the same tokens as
  decoding each prompt alone; --compare decodes them as static batches too."""
  from dflash_jax import decode as D
  from dflash_jax.models import load_target
  target, drafter, _ = pair
  rng = np.random.default_rng(0)
  texts = ["".join(chr(c) for c in rng.integers(97, 123, rng.integers(3, 20))) for _ in range(5)]
  f = tmp_path / "prompts.jsonl"
  f.write_text("\n".join([json.dumps({"prompt": t}) for t in texts]
                         + [json.dumps({"prompt_ids": [1, 2, 3]}), json.dumps({"prompt": "x"})]))
  out = tmp_path / "out.jsonl"
  assert main(["generate", "--target", target, "--drafter", drafter, "--prompts-file", str(f),
               "--slots", "3", "--max-new", "20", "--out", str(out), "--compare",
               "--sync-every", "2"]) == 0
  err = capsys.readouterr().err
  assert re.search(r"served:  7 prompts, 140 tokens in [\d.]+ s: [\d.]+ tokens/s on 3 slots", err)
  assert re.search(r"static batches of 3: [\d.]+ tokens/s .* outputs identical", err), err
  recs = [json.loads(l) for l in out.read_text().splitlines()]
  assert [r["index"] for r in recs] == list(range(7))
  tcfg, tp = load_target(target)
  from dflash_jax.cli import load_drafter_arg
  dp = load_drafter_arg(drafter, tcfg, tp, target, "fp32")
  models = D.Models(target=tp, drafter=dp, d2t=None, target_cfg=tcfg)
  from tokenizers import Tokenizer
  tok = Tokenizer.from_str(TD.TOKENIZER.hf_json())
  ids = [list(t.encode()) for t in texts] + [[1, 2, 3], [ord("x")]]
  for r, p in zip(recs, ids):
    alone = D.generate(models, D.DecodeConfig(width=8, impl="xla"), [p], 20).tokens[0]
    assert r["tokens"] == alone and r["n_tokens"] == 20 and r["prompt_tokens"] == len(p)
    assert r["text"] == tok.decode(alone) and 1 <= r["tau"] <= 8
  assert main(["generate", "--target", target, "--drafter", drafter, "--prompts-file", str(f),
               "--out", str(out)]) == 2
  assert "--out" in _err(capsys)


def test_generate_prompts_file_errors_name_the_line(pair, tmp_path, capsys):
  target, drafter, _ = pair
  f = tmp_path / "p.jsonl"
  f.write_text('{"prompt": "ok"}\n{"prompt_ids": [1, -2]}\n')
  assert main(["generate", "--target", target, "--drafter", drafter, "--prompts-file",
               str(f)]) == 2
  line = _err(capsys)
  assert f"{f}:2" in line and "prompt_ids" in line


# --- the process: interrupts, closed pipes, the compile cache ------------------------------------

def _env(tmp_path, **extra) -> dict:
  env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=ROOT, **extra)
  return env


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_a_long_run_at_once_without_a_traceback(tmp_path, sig):
  """`simulate --prefill 100000` spends its time in long XLA calls (compiling, injecting 10^5
  rows), where a Python signal handler would wait for the call to return: the process must
  still end within a couple of seconds, with its temporary folder removed and one line."""
  proc = subprocess.Popen(
      [sys.executable, "-m", "dflash_jax", "simulate", "--size", "small", "--prefill", "100000",
       "--rounds", "100", "--impl", "xla", "--vocab", "512"],
      cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 120
  while time.time() < deadline and not any(n.startswith("dflash_simulate_")
                                           for n in os.listdir(tmp_path)):
    time.sleep(0.05)
  assert any(n.startswith("dflash_simulate_") for n in os.listdir(tmp_path)), "never started"
  time.sleep(2.0)   # inside the run now (writing the GGUF, loading, compiling, injecting)
  assert proc.poll() is None, proc.communicate()
  t0 = time.time()
  proc.send_signal(sig)
  out, err = proc.communicate(timeout=60)
  took = time.time() - t0
  assert took < 3.0, took
  assert proc.returncode == 128 + sig, (proc.returncode, err)
  assert "Traceback" not in err and f"stopped by {signal.Signals(sig).name}" in err, err
  assert not [n for n in os.listdir(tmp_path) if n.startswith("dflash_simulate_")]


def test_a_closed_pipe_ends_quietly(pair, tmp_path):
  """`generate ... | head -c 20`: the reader leaves early; no BrokenPipeError traceback."""
  target, drafter, _ = pair
  proc = subprocess.Popen(
      [sys.executable, "-m", "dflash_jax", "generate", "--target", target, "--drafter", drafter,
       "--prompt-ids", "1,2,3", "--max-new", "300", "--sync-every", "1", "--impl", "xla"],
      cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  first = proc.stdout.read(20)
  proc.stdout.close()
  err = proc.stderr.read().decode()
  proc.wait(timeout=120)
  assert first and "Traceback" not in err and "BrokenPipe" not in err, err
  assert proc.returncode == 141, (proc.returncode, err)


def test_the_compile_cache_is_used_by_default(pair, tmp_path):
  """Two `generate` runs of the same shapes: the first fills the cache folder
  ($XDG_CACHE_HOME/dflash_jax/jax), the second compiles from it faster; with the cache off
  nothing is written."""
  target, drafter, _ = pair
  env = _env(tmp_path, XDG_CACHE_HOME=str(tmp_path / "cache"))
  env.pop("DFLASH_JAX_COMPILE_CACHE", None)
  cmd = [sys.executable, "-m", "dflash_jax", "generate", "--target", target, "--drafter",
         drafter, "--prompt-ids", "1,2,3", "--max-new", "16", "--impl", "xla"]

  def compile_seconds(extra=()):
    r = subprocess.run(cmd + list(extra), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return float(re.search(r"compile: ([\d.]+) s", r.stderr).group(1))

  first = compile_seconds()
  folder = tmp_path / "cache" / "dflash_jax" / "jax"
  entries = len(os.listdir(folder))
  assert entries > 0
  second = compile_seconds()
  assert second < 0.7 * first, (first, second)
  assert len(os.listdir(folder)) == entries   # nothing new to compile
  off = tmp_path / "off"
  env["XDG_CACHE_HOME"] = str(off)
  compile_seconds(["--compile-cache", "off"])
  assert not off.exists()


# --- the shipped demo pair (dflash_jax/demo_pair, made by train-target + train-drafter) ---------

PAIR = os.path.join(ROOT, "dflash_jax", "demo_pair")


def test_the_shipped_demo_pair_loads_with_the_readmes_shapes():
  """The pair `demo` decodes with by default: a 4-layer x 256 byte-level Qwen3 target with its
  tokenizer.json, a 1-layer block-8 drafter for it, all small files of mode 0644, all of them
  in the installed package's data (pyproject.toml)."""
  import fnmatch
  import tomllib

  from dflash_jax.cli import load_drafter_arg
  from dflash_jax.cli.demo import DEFAULT_DRAFTER, DEFAULT_TARGET
  from dflash_jax.io import load_drafter
  from dflash_jax.models import load_target
  assert DEFAULT_TARGET == os.path.join(PAIR, "target")
  assert DEFAULT_DRAFTER == os.path.join(PAIR, "drafter.gguf")
  tcfg, tp = load_target(DEFAULT_TARGET)
  assert (tcfg.num_hidden_layers, tcfg.hidden_size, tcfg.vocab_size) == (4, 256, 272)
  assert (tcfg.num_attention_heads, tcfg.num_key_value_heads, tcfg.head_dim) == (4, 2, 64)
  assert tp.embed.shape == (272, 256)
  dcfg, w = load_drafter(DEFAULT_DRAFTER)
  assert (dcfg.n_layer, dcfg.n_embd, dcfg.block_size) == (1, 256, 8)
  assert dcfg.mask_token_id == TD.TOKENIZER.mask_id and max(dcfg.target_layers) == 4
  assert "tok_embd" not in w and "lm_head" not in w      # borrowed from the target
  load_drafter_arg(DEFAULT_DRAFTER, tcfg, tp, DEFAULT_TARGET, "fp32")   # fits its target
  from tokenizers import Tokenizer
  tok = Tokenizer.from_file(os.path.join(DEFAULT_TARGET, "tokenizer.json"))
  assert tok.encode("def f():").ids == list(b"def f():")
  files = [os.path.join(d, f) for d, _, fs in os.walk(PAIR) for f in fs
           if "__pycache__" not in d]
  rel = sorted(os.path.relpath(f, os.path.join(ROOT, "dflash_jax")) for f in files)
  assert {"demo_pair/README.md", "demo_pair/drafter.gguf", "demo_pair/target/config.json",
          "demo_pair/target/tokenizer.json"} <= set(rel), rel
  assert any(r.endswith(".safetensors") for r in rel), rel
  assert sum(os.path.getsize(f) for f in files) < 12 * 2**20
  assert {oct(os.stat(f).st_mode & 0o777) for f in files} == {"0o644"}
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["dflash_jax"]
  for r in rel:
    assert any(fnmatch.fnmatch(r, g) for g in globs), (r, globs)


def test_demo_with_the_shipped_pair_decodes_losslessly(capsys):
  """`demo` with its defaults (one timed run of each decoding): text streams, tau is well
  above 1 (the drafter was trained for this target), and the output equals target-only
  decoding."""
  assert main(["demo", "--repeats", "1"]) == 0
  cap = capsys.readouterr()
  from dflash_jax.cli.demo import DEFAULT_PROMPT
  assert cap.out.startswith(DEFAULT_PROMPT) and len(cap.out) > len(DEFAULT_PROMPT)
  assert "output:   identical to target-only greedy decoding" in cap.out, cap.out
  tau = float(re.search(r"tau: +([\d.]+) tokens per round \(256 tokens", cap.out).group(1))
  assert tau >= 2.5, cap.out
  assert re.search(r"accepted drafts per round: 0:\d+ 1:\d+ 2:\d+ 3:\d+", cap.out), cap.out
  assert re.search(r"tokens/s: target only [\d.]+, speculative [\d.]+ ", cap.out), cap.out
  assert "compile:" in cap.err, cap.err
  assert "demo_pair/drafter.gguf (1 layers, block 8" in cap.err, cap.err
