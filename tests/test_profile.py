"""Profiling: every phase of the step and of the decoding round carries its named scope in
the compiled program's op_name metadata, and `python -m benchmarks.profile` writes a trace
whose ops map back to those phases."""
import collections
import dataclasses
import json
import os
import re

import jax
import numpy as np
import pytest

import dflash_jax as dfj
from benchmarks import profile as P
from dflash_jax.drafter import step as S

MIXED = dataclasses.replace(dfj.TINY_CONFIG, n_layer=2, window=16,
                            layer_types=("sliding_attention", "full_attention"))
LAYER_PHASES = ("attn_norm", "qkv", "norm_rope", "attention", "o", "ffn/norm", "ffn/gate_up",
                "ffn/down")


def _mixed_drafter(dtype="bf16"):
  params = dfj.prepare_weights(MIXED, dfj.synthetic_drafter(MIXED, seed=0, n_vocab=256), dtype)
  return params, dfj.init_ring(MIXED, window=16, ring_dtype="bf16", capacity=32)


def test_compiled_step_names_every_phase_and_each_gemm():
  """XLA's optimized HLO keeps the scopes: each dot sits in the phase that owns it (one per
  projection and layer, attention's two einsums per layer, the LM head), and every named
  phase holds ops."""
  params, ring = _mixed_drafter()
  hlo = S.block_step_jit.lower(params, ring, 1, 5, impl="xla").compile().as_text()
  op_names = re.findall(r'op_name="jit\(block_step\)/([^"]*)"', hlo)
  dots = collections.Counter(
      re.search(r'op_name="jit\(block_step\)/(.*?)/(?:jit\(ring_attention_reference\)/.*?/)?'
                r'dot_general"', line).group(1)
      for line in hlo.splitlines() if re.search(r"= \S+ dot\(", line))
  want = collections.Counter({"lm_head": 1})
  for l in range(MIXED.n_layer):
    want.update({f"layer{l}/qkv": 1, f"layer{l}/o": 1, f"layer{l}/ffn/gate_up": 1,
                 f"layer{l}/ffn/down": 1, f"layer{l}/attention": 2})
  assert dots == want
  for scope in [f"layer{l}/{p}" for l in range(MIXED.n_layer) for p in LAYER_PHASES] + [
      "embed", "out_norm", "lm_head"]:
    assert any(n.startswith(scope + "/") for n in op_names), scope


def test_pallas_round_launches_every_kernel_in_its_phase():
  """The Pallas draft round (encode, inject per attention kind, the step, drafts): the set of
  (scope, kernel) calls in the lowered program is exactly the expected one."""
  params, ring = _mixed_drafter()
  feats = np.zeros((MIXED.block_size, MIXED.n_embd_fc), np.float32)
  text = S.draft_round_jit.lower(params, ring, feats, 3, 1, 5, impl="pallas").as_text(
      debug_info=True)
  kernels = ("skinny_matmul", "skinny_matmul_gate_up", "inject", "qk_norm_rope",
             "ring_attention")
  calls = {m.groups() for m in re.finditer(
      r'loc\("jit\(draft_round\)/([^"]*?)/jit\((' + "|".join(kernels) + r')\)"', text)}
  want = {("encode", "skinny_matmul"), ("lm_head", "skinny_matmul")}
  for kind in ("sliding_attention", "full_attention"):
    want |= {(f"inject/{kind}/kv", "skinny_matmul"), (f"inject/{kind}/write", "inject")}
  for l in range(MIXED.n_layer):
    want |= {(f"layer{l}/qkv", "skinny_matmul"), (f"layer{l}/norm_rope", "qk_norm_rope"),
             (f"layer{l}/attention", "ring_attention"), (f"layer{l}/o", "skinny_matmul"),
             (f"layer{l}/ffn/gate_up", "skinny_matmul_gate_up"),
             (f"layer{l}/ffn/down", "skinny_matmul")}
  assert calls == want
  assert 'loc("jit(draft_round)/drafts' in text


@pytest.mark.parametrize("name", ["ring_attention_bfloat16", "gemm_bf16_qkv"])
def test_scopes_leave_a_kernel_lowering_unchanged(name):
  """test_kernels_lowering's text of a seed-shape launch (Triton IR, then the XLA module
  without locations) is the same inside the step's scopes as outside: scopes are metadata."""
  import test_kernels_lowering as TKL
  f, args = TKL._cases()[name]

  def launch(scoped):
    def run(*a):
      if not scoped:
        return f(*a)
      with jax.named_scope("layer3"), jax.named_scope("attention"):
        return f(*a)
    return run

  assert TKL.lowered_text(launch(True), args) == TKL.lowered_text(launch(False), args)


def test_hlo_op_phases():
  """Instruction -> phase: its own op_name, else the common phase of what it calls."""
  hlo = """HloModule jit_f, entry_computation_layout={()->f32[]}

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %m = f32[4]{0} multiply(%p, %p), metadata={op_name="jit(f)/draft/layer0/ffn/norm/mul"}
  %n = f32[4]{0} add(%p, %p), metadata={op_name="jit(f)/draft/layer0/o/add"}
}

%fused_b (p: f32[4]) -> f32[4] {
  ROOT %x = f32[4]{0} exp(%p), metadata={op_name="jit(f)/verify/exp"}
  %y = f32[4]{0} log(%p), metadata={op_name="jit(f)/draft/layer1/qkv/log"}
}

ENTRY %main () -> f32[] {
  %fa = f32[4]{0} fusion(%c), kind=kLoop, calls=%fused_a
  %fb = f32[4]{0} fusion(%c), kind=kLoop, calls=%fused_b
  %d = f32[4]{0} dot(%fa, %fb), metadata={op_name="jit(f)/draft/layer2/attention/jit(g)/dot"}
  ROOT %z = f32[] reduce(%d), metadata={op_name="reduce_sum"}
}
"""
  got = P.hlo_op_phases(hlo)
  assert got["fa"] == "draft" and got["fb"] == P.ACROSS and got["z"] == P.NO_PHASE
  assert got["d"] == "draft/attention" and got["m"] == "draft/ffn/norm"
  assert P.phase_of("jit(_rounds)/while/body/draft/inject/full_attention/write/x") == (
      "draft/inject/full_attention/write")


def _profile(tmp_path, what, rounds):
  out = tmp_path / what
  assert P.main(["--smoke", "--what", what, "--rounds", str(rounds), "--out", str(out)]) == 0
  res = json.loads((out / "phases.json").read_text())
  for key in ("xplane", "trace", "perfetto"):
    assert os.path.getsize(res[key]) > 0, key
  assert res["xplane"].endswith(".xplane.pb") and str(out) in res["xplane"]
  ph = res["phases"]
  # One StepTraceAnnotation per recorded call: the trace holds exactly the calls asked for.
  assert ph["annotations"] == rounds and ph["calls"] == rounds
  return res, ph["ms_per_call"], (out / f"{what}.hlo.txt").read_text()


def test_profile_step_writes_a_trace_read_by_phase(tmp_path):
  res, ms, hlo = _profile(tmp_path, "step", 2)
  assert "layer0/attention" in hlo and "layer1/ffn/gate_up" in hlo
  # The traced ops map back to the step's phases (on CPU: the client's op events).
  for phase in ("qkv", "attention", "o", "ffn/gate_up", "ffn/down", "lm_head"):
    assert ms.get(phase, 0) > 0, (phase, ms)
  assert not any(k.startswith(("draft", "verify")) for k in ms)


def test_profile_round_writes_a_trace_read_by_phase(tmp_path):
  res, ms, hlo = _profile(tmp_path, "round", 3)
  for scope in ("draft/layer0/attention", "draft/inject/sliding_attention/write", "draft/encode",
                "/verify/", "/accept/", "/commit/"):
    assert scope in hlo, scope
  for phase in ("draft/attention", "draft/qkv", "draft/lm_head", "verify", "commit"):
    assert ms.get(phase, 0) > 0, (phase, ms)
