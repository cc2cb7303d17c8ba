"""io.programs: the decoding loop's programs kept on disk and loaded by a later process without
tracing. Each run is a fresh process (what the CLIs do), pointed at one cache folder."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest

from dflash_jax import decode as D
from dflash_jax.io import programs
import tiny_models as TM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What every script below starts with: JAX's cache in argv[1] with the CLIs' settings, the
# code digest replaced by argv[2] unless it is "-" (an edited tree), and a list of the
# functions this process traces.
PRELUDE = """
import json, sys, warnings
sys.path[:0] = [{root!r}, {tests!r}]
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
from dflash_jax.io import programs
if sys.argv[2] != "-":
  programs.code_digest = lambda: sys.argv[2]
if sys.argv[3] == "no-serialize":   # a machine whose executables cannot be serialized
  import jax.experimental.serialize_executable as se
  def refuse(exe):
    raise NotImplementedError("serialization is not supported here")
  se.serialize = refuse
traced = []
jax.monitoring.register_event_duration_secs_listener(
    lambda e, s, **k: traced.append(k.get("fun_name"))
    if e.endswith("jaxpr_trace_duration") else None)
own = [0]   # XLA compilations that JAX's cache did not answer
jax.monitoring.register_event_listener(
    lambda e, **k: own.__setitem__(0, own[0] + (e.endswith("compile_requests_use_cache"))
                                   - (e.endswith("cache_hits"))))
import tiny_models as TM
from dflash_jax import decode as D
LOOP = lambda: sorted({{"_rounds", "_start"}} & set(traced))
"""

# Greedy speculative decoding of one prompt on tiny random models; prints the tokens, which of
# the loop's programs this process traced, and whether run_rounds' donated state was freed.
SCRIPT = PRELUDE + textwrap.dedent("""
  tcfg, tp = TM.target()
  models = TM.models(tcfg, tp, TM.drafter(tcfg, tp))
  dcfg = D.DecodeConfig(width=6, impl="xla", target_impl="xla")
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    tokens = D.generate(models, dcfg, [list(range(1, 12))], 20).tokens[0]
    state = D.start(models, dcfg, [list(range(1, 12))], 20)
    programs.call(D.run_rounds, "rounds", dict(dcfg=dcfg), models=models, state=state,
                  max_rounds=jnp.int32(1))
  print(json.dumps(dict(tokens=tokens, traced=LOOP(), donated=state.tokens.is_deleted(),
                        warnings=[str(x.message) for x in w if ".unkept" in str(x.message)])))
""")


# The same, also printing how many programs XLA compiled (not answered by JAX's cache).
SCRIPT_COUNTING = SCRIPT.replace("print(json.dumps(dict(",
                                 "print(json.dumps(dict(compiles=own[0], ")


def _run(cache, script=SCRIPT, devices=1, code="-", how="-", gpu=False):
  """The script in a fresh process on `devices` host devices (gpu: on the GPU) -> its JSON
  line."""
  env = dict(os.environ)
  if not gpu:
    # conftest.py's XLA flags (fast CPU compiles) kept, as every other subprocess test does.
    flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())
  script = script.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
  r = subprocess.run([sys.executable, "-c", script, str(cache), code, how], capture_output=True,
                     text=True, env=env, cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def _kept(cache):
  return sorted(os.listdir(cache / programs.SUBDIR))


def test_a_later_process_loads_the_loop_without_tracing_it(tmp_path):
  """First process: traces the prefill and the rounds and keeps both; second: traces
  neither, decodes the same tokens, and the kept rounds still donate the state. Other code
  keeps its own files and removes those of the code before. (A host of several devices:
  test_programs_on_a_mesh_are_kept_and_loaded.)"""
  first = _run(tmp_path)
  assert first["traced"] == ["_rounds", "_start"] and first["donated"]
  assert first["warnings"] == []
  kept = _kept(tmp_path)
  assert [k.split("-")[0] for k in kept] == ["rounds", "start"]
  assert {k.split("-")[1] for k in kept} == {programs.code_digest()[:12]}
  second = _run(tmp_path)
  assert second == dict(first, traced=[]), (first, second)
  assert _kept(tmp_path) == kept
  # Other code: its programs are kept, and every file of the code before is removed (also
  # of a role this code does not have).
  (tmp_path / programs.SUBDIR / ("prefill-" + kept[0].split("-", 1)[1])).write_bytes(b"old")
  edited = _run(tmp_path, code="e" * 64)
  assert edited == first and [k.split("-")[1] for k in _kept(tmp_path)] == ["e" * 12] * 2


def test_a_program_that_cannot_be_loaded_runs_as_jit_from_then_on(tmp_path):
  """A kept file this machine cannot load (here: damaged) is replaced by a note that names
  the cause; that process and every later one run the program as jit does (through JAX's
  cache: no compilation of its own, which a JAX-cached program would need to be kept), with a
  warning naming the note, and decode the same tokens. Removing the note keeps it again."""
  first = _run(tmp_path)
  rounds = tmp_path / programs.SUBDIR / _kept(tmp_path)[0]
  rounds.write_bytes(b"not a program")
  for _ in range(2):
    again = _run(tmp_path)
    assert again["traced"] == ["_rounds"] and again["tokens"] == first["tokens"]
    assert again["donated"]
    note = rounds.with_suffix(".unkept")
    assert len(again["warnings"]) == 1 and str(note) in again["warnings"][0]
    assert not rounds.exists() and "cannot load the kept program" in note.read_text()
  note.unlink()
  assert _run(tmp_path) == dict(first, traced=["_rounds"])
  assert _run(tmp_path) == dict(first, traced=[])


def test_a_program_that_cannot_be_serialized_is_compiled_once_for_it(tmp_path):
  """Where serialization fails, the first process notes why (warning) and later processes
  run the program as jit does, without the extra compilation keeping would need: each
  program is compiled by XLA once over all runs (JAX's cache serves the rest)."""
  compiles = []
  for _ in range(3):
    r = _run(tmp_path, SCRIPT_COUNTING, how="no-serialize")
    compiles.append(r["compiles"])
    assert r["traced"] == ["_rounds", "_start"] and len(r["warnings"]) == 2, r
  notes = _kept(tmp_path)
  assert [n.split("-")[0] for n in notes] == ["rounds", "start"]
  assert all(n.endswith(".unkept") for n in notes), notes
  assert compiles[0] > 0 and compiles[1] == compiles[2] == 0, compiles


# The loop with the Pallas drafter at a shape the Mosaic GPU ring attention takes (16 block
# rows x 4 query heads per kv head = its 64 rows, head_dim 64, a bf16 ring of 64 slots).
MOSAIC_SCRIPT = PRELUDE + textwrap.dedent("""
  import dataclasses
  import dflash_jax as dfj
  tcfg, tp = TM.target()
  cfg = dataclasses.replace(dfj.TINY_CONFIG, n_layer=1, n_head=8, n_head_kv=2, head_dim=64,
                            target_layers=(1, 2), mask_token_id=tcfg.vocab_size - 1,
                            block_size=16, window=64)
  wts = dfj.synthetic_drafter(cfg, seed=0, with_target=False)
  wts["tok_embd"], wts["lm_head"] = jax.device_get(tp.embed), jax.device_get(tp.head)
  models = TM.models(tcfg, tp, dfj.prepare_weights(cfg, wts))
  dcfg = D.DecodeConfig(width=16, impl="pallas", target_impl="xla")
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    tokens = D.generate(models, dcfg, [list(range(1, 12))], 40, ring_dtype="bf16",
                        cache_dtype="bf16").tokens[0]
  print(json.dumps(dict(tokens=tokens, traced=LOOP(),
                        warnings=[str(x.message) for x in w if ".unkept" in str(x.message)])))
""")


@pytest.mark.gpu
def test_gpu_a_later_process_loads_mosaic_gpu_kernels_without_tracing(tmp_path):
  """A kept program with a Mosaic GPU kernel loads in a process that has traced nothing (its
  host side is compiled at load time against Mosaic GPU's runtime library, which only an
  import of jax's Mosaic GPU module names): no note, no tracing, the same tokens."""
  first = _run(tmp_path, MOSAIC_SCRIPT, gpu=True)
  assert first["traced"] == ["_rounds", "_start"] and first["warnings"] == [], first
  kept = _kept(tmp_path)
  assert [k.split("-")[0] for k in kept] == ["rounds", "start"], kept
  assert any(b"mosaic_gpu" in (tmp_path / programs.SUBDIR / k).read_bytes() for k in kept), \
      "no kept program holds a Mosaic GPU kernel: the test does not test what it says"
  second = _run(tmp_path, MOSAIC_SCRIPT, gpu=True)
  assert second == dict(first, traced=[]), (first, second)
  assert _kept(tmp_path) == kept


MESH_SCRIPT = PRELUDE + textwrap.dedent("""
  from dflash_jax import sharding as SH
  tcfg, tp = TM.target(vocab=128, layers=1, seed=1)
  models = TM.models(tcfg, tp, TM.drafter(tcfg, tp, seed=2))
  dcfg = D.DecodeConfig(width=8, impl="xla")
  prompts = [[1, 5, 9, 3, 7], [2, 4, 6, 8, 10, 12, 14]]
  sharded = D.generate(SH.shard_models(models, SH.make_plan(tp=2, dp=2)), dcfg, prompts, 12)
  print(json.dumps(dict(tokens=sharded.tokens, plain=D.generate(models, dcfg, prompts, 12).tokens,
                        traced=LOOP())))
""")


def test_programs_on_a_mesh_are_kept_and_loaded(tmp_path):
  """Models on a dp = 2 x tp = 2 mesh of host devices (static fields that hold devices), and
  the same models unsharded (one-device programs on a host of four): the second process
  traces none of the loop's programs and commits the same tokens, the sharded ones equal to
  the unsharded."""
  runs = [_run(tmp_path, MESH_SCRIPT, devices=4) for _ in range(2)]
  assert runs[0]["traced"] == ["_rounds", "_start"] and runs[1]["traced"] == []
  assert runs[0]["tokens"] == runs[1]["tokens"] == runs[0]["plain"]


def _sig(models, dcfg, state):
  return programs.signature(D.run_rounds, dict(dcfg=dcfg),
                            dict(models=models, state=state, max_rounds=jnp.int32(1)))


def test_the_key_changes_with_what_changes_the_program(monkeypatch):
  """Static fields (the decode config, the target's config), a shape, a dtype, the code and
  XLA's flags each give another key; equal calls give one key."""
  tcfg, tp = TM.target()
  models = TM.models(tcfg, tp, TM.drafter(tcfg, tp))
  dcfg = D.DecodeConfig(width=6, impl="xla", target_impl="xla")
  state = D.start(models, dcfg, [[1, 2, 3]], 8)
  base = programs.key("rounds", _sig(models, dcfg, state))
  assert base == programs.key("rounds", _sig(models, dcfg, D.start(models, dcfg, [[4, 5, 6]], 8)))
  others = [
      programs.key("rounds", _sig(models, dataclasses.replace(dcfg, width=5), state)),
      programs.key("rounds", _sig(models.replace(target_cfg=dataclasses.replace(
          tcfg, rms_norm_eps=1e-5)), dcfg, state)),
      programs.key("rounds", _sig(models, dcfg, D.start(models, dcfg, [[1, 2, 3]], 30))),
      programs.key("rounds", _sig(models, dcfg, state.replace(
          pending=state.pending.astype(jnp.bfloat16)))),
      programs.key("start", _sig(models, dcfg, state)),
  ]
  monkeypatch.setattr(programs, "code_digest", lambda: "another tree")
  others.append(programs.key("rounds", _sig(models, dcfg, state)))
  monkeypatch.undo()
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
  others.append(programs.key("rounds", _sig(models, dcfg, state)))
  assert len({base, *others}) == len(others) + 1, others


def test_a_static_value_without_a_stable_repr_is_not_kept():
  """A proposer printed with its address could never be found again: no key (the call is
  then jit's own)."""
  class Mine(D.Drafter):
    __repr__ = object.__repr__
  tcfg, tp = TM.target()
  models = TM.models(tcfg, tp, TM.drafter(tcfg, tp))
  dcfg = D.DecodeConfig(width=6, impl="xla", target_impl="xla", proposer=Mine())
  assert programs.key("rounds", _sig(models, dcfg, D.start(models, dcfg, [[1, 2]], 8))) is None
  assert programs.folder() is None   # the tests run without JAX's cache: calls are jit's own
