"""An XLA profiler trace of block steps or decoding rounds, readable by phase.

  python -m benchmarks.profile --gpu [--what step|round] [--rounds N] [--out DIR]
  python -m benchmarks.profile --smoke [...]     # tiny dims on any backend (CI): not results

--what step: the seed drafter's block step (vocab 8192, a full 2048-slot ring; --dtype picks
the weights). --what round: decoding rounds of benchmarks.decode's pair (a Qwen3-8B-shaped
target, a Qwen3-8B-DFlash-shaped drafter, random bf16 weights, greedy, width block_size), one
round per call. Both are compiled and run twice first, then N calls are recorded by
`jax.profiler.trace`, each under a `StepTraceAnnotation` ("step" / "round") and synced.

Every phase of the step and of the round runs under a `jax.named_scope` (ARCHITECTURE.md,
"Profiling scopes"), so every HLO instruction's op_name metadata names its phase, e.g.
`layer0/attention` or `draft/layer3/ffn/gate_up`. Written into --out:
  plugins/profile/<stamp>/*.xplane.pb       TensorBoard / xprof (`tensorboard --logdir OUT`)
  plugins/profile/<stamp>/perfetto_trace.json.gz    https://ui.perfetto.dev (Open trace file)
  <what>.hlo.txt    the compiled program the trace ran: instruction names -> op_name scopes
  phases.json       device time per phase: each traced op (its `hlo_op`) mapped to its scope
                    through <what>.hlo.txt, summed over the N calls, divided by N

--command-buffer off (the default) compiles with XLA's command buffers off, so that XLA
launches every kernel itself and each kernel event in the trace names its HLO op (and so its
scope); each kernel transition then costs ~2 us more than inside the product's one CUDA
graph, which inflates small phases. `--command-buffer on`
traces the program exactly as it runs in production: the kernels then appear under the
command buffer's name, not their phases.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import dflash_jax as dfj
from benchmarks import common as C
from dflash_jax import decode as D
from dflash_jax.drafter import step as S
from dflash_jax.io import atomic

# The scope names of dflash_jax.drafter.step and dflash_jax.decode that name a phase; a scope path
# reduces to the ones it holds, in order (layer<i>, jit(...), vmap(...), while/body dropped):
# ".../draft/layer2/ffn/gate_up/jit(silu)" -> "draft/ffn/gate_up".
PHASE_SCOPES = frozenset((
    "draft", "verify", "accept", "commit", "encode", "inject", "sliding_attention",
    "full_attention", "kv", "write", "embed", "attn_norm", "qkv", "norm_rope", "attention",
    "o", "ffn", "norm", "gate_up", "down", "out_norm", "lm_head", "drafts"))
ACROSS = "(across phases)"   # a fused op made of several phases' ops (no common phase)
NO_PHASE = "(no phase)"        # ops outside every phase scope, or whose metadata XLA dropped


def phase_of(op_name: str) -> str:
  """The phase an op_name scope path names ('' when it names none)."""
  out: list[str] = []
  for seg in op_name.split("/"):
    if seg in PHASE_SCOPES and (not out or out[-1] != seg):
      out.append(seg)
  return "/".join(out)


def _common(phases: set[str]) -> str:
  parts = [p.split("/") for p in sorted(phases)]
  prefix = []
  for segs in zip(*parts):
    if any(s != segs[0] for s in segs):
      break
    prefix.append(segs[0])
  return "/".join(prefix)


def hlo_op_phases(hlo_text: str) -> dict[str, str]:
  """Instruction name -> phase for every instruction of a compiled HLO module
  (`Compiled.as_text()`): the phase its op_name metadata names or, for an instruction that
  calls computations (a fusion, a command buffer, a loop), the common phase of everything
  it holds; ACROSS when those phases share none, NO_PHASE when nothing names a phase."""
  own: dict[str, str] = {}
  calls: dict[str, list[str]] = {}
  members: dict[str, list[str]] = collections.defaultdict(list)
  comp = None
  for line in hlo_text.splitlines():
    head = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$", line)
    if head:
      comp = head.group(1)
      continue
    inst = re.match(r"^\s+(?:ROOT )?%([\w.\-]+) = ", line)
    if not inst or comp is None:
      continue
    name = inst.group(1)
    members[comp].append(name)
    m = re.search(r'op_name="([^"]*)"', line)
    own[name] = phase_of(m.group(1)) if m else ""
    called = re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", line)
    for group in re.findall(r"(?:branch_computations|called_computations)=\{([^}]*)\}", line):
      called += re.findall(r"%([\w.\-]+)", group)
    calls[name] = called

  memo: dict[str, set[str]] = {}

  def phases(name: str) -> set[str]:
    if name not in memo:
      memo[name] = set()   # a cycle (none in valid HLO) ends here
      found = {own[name]} - {""}
      for c in calls.get(name, ()):
        for member in members.get(c, ()):
          found |= phases(member)
      memo[name] = found
    return memo[name]

  out = {}
  for name in own:
    found = phases(name)
    out[name] = (NO_PHASE if not found else next(iter(found)) if len(found) == 1
                 else _common(found) or ACROSS)
  return out


def trace_files(out_dir: str) -> tuple[str, str]:
  """(xplane.pb, trace.json.gz) of the newest trace jax.profiler wrote under out_dir."""
  runs = sorted(glob.glob(os.path.join(out_dir, "plugins", "profile", "*")), key=os.path.getmtime)
  if not runs:
    raise RuntimeError(f"jax.profiler wrote no trace under {out_dir}/plugins/profile")
  xplane = glob.glob(os.path.join(runs[-1], "*.xplane.pb"))
  trace = [t for t in glob.glob(os.path.join(runs[-1], "*.trace.json.gz"))
           if not t.endswith("perfetto_trace.json.gz")]
  if not xplane or not trace:
    raise RuntimeError(f"no .xplane.pb / .trace.json.gz in {runs[-1]}")
  return xplane[0], trace[0]


def _hlo_op(args: dict) -> str | None:
  """The HLO instruction an event ran: its `hlo_op` argument, or the `hlo_op=` field of an
  XLA annotation string ("Thunk:#name=...,hlo_op=fusion.3,...#") among its arguments."""
  if "hlo_op" in args:
    return str(args["hlo_op"])
  for v in args.values():
    m = re.search(r"hlo_op=([\w.\-]+)", v) if isinstance(v, str) else None
    if m:
      return m.group(1)
  return None


def phase_times(trace_path: str, op_phases: dict[str, str], module: str, calls: int,
                annotation: str) -> dict:
  """Device time per phase (ms per call) from a trace: the events of `module` that name an
  hlo_op (kernels on a GPU's streams; the CPU client's op thunks on CPU), mapped to phases
  through op_phases (`hlo_op_phases`); an hlo_op the module lacks counts as NO_PHASE."""
  with gzip.open(trace_path, "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"]
  procs = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  gpu = {pid for pid, n in procs.items() if "/device:GPU" in n}
  ms: dict[str, float] = collections.defaultdict(float)
  count: dict[str, int] = collections.defaultdict(int)
  kernels: dict[str, float] = collections.defaultdict(float)
  steps = sum(1 for e in events if e.get("ph") == "X" and e.get("name") == annotation
              and e.get("pid") not in gpu)
  ops = collections.defaultdict(list)   # (pid, tid) -> that thread's op events
  for e in events:
    if e.get("ph") != "X" or "dur" not in e:
      continue
    if gpu and (e["pid"] not in gpu or
                not threads.get((e["pid"], e.get("tid")), "").startswith("Stream")):
      continue
    if gpu:
      kernels[e["name"]] += e["dur"] / 1e3   # trace durations are microseconds
    op = _hlo_op(e.get("args", {}))
    if op is not None and e["args"].get("hlo_module", module) == module:
      ops[(e["pid"], e.get("tid"))].append(dict(e, hlo_op=op))
  for thread_ops in ops.values():
    thread_ops.sort(key=lambda e: (e["ts"], -e["dur"]))
    for i, e in enumerate(thread_ops):
      # An op whose event encloses the next one (a loop or call running its body's ops on
      # this thread, as on the CPU) is counted through those ops, not twice. (Kernels that
      # merely overlap, as programmatic dependent launch allows, both count.)
      nxt = thread_ops[i + 1] if i + 1 < len(thread_ops) else None
      if nxt is not None and nxt["ts"] + nxt["dur"] <= e["ts"] + e["dur"]:
        continue
      phase = op_phases.get(e["hlo_op"], NO_PHASE)
      ms[phase] += e["dur"] / 1e3
      count[phase] += 1
  return dict(source="GPU stream kernels" if gpu else "host op events", calls=calls,
              annotations=steps,
              ms_per_call={k: v / calls for k, v in sorted(ms.items(), key=lambda kv: -kv[1])},
              events=dict(count),
              top_kernels_ms_per_call={k: v / calls for k, v in sorted(
                  kernels.items(), key=lambda kv: -kv[1])[:12]})


@dataclasses.dataclass
class Target:
  """What is traced: a compiled function, its arguments, and how a call's outputs feed the
  next call's arguments (a donated state)."""
  compiled: object
  args: tuple
  advance: object
  annotation: str
  describe: str


def _host_ring(cfg: dfj.DFlashConfig, window: int, ring_dtype: str) -> S.RingState:
  """A sliding ring of every layer, all `window` slots live (positions 0..window-1), drawn
  on the host: at tiny dims quicker than compiling device RNGs (common.filled_state)."""
  rng = np.random.default_rng(1)
  shape = (cfg.n_layer, cfg.n_head_kv, window, cfg.head_dim)
  dt = jnp.float32 if ring_dtype == "fp32" else jnp.bfloat16
  return S.RingState(sliding=S.KVCache(
      k=jnp.asarray(rng.standard_normal(shape, np.float32), dt),
      v=jnp.asarray(rng.standard_normal(shape, np.float32), dt),
      pos=jnp.arange(window, dtype=jnp.int32), kind=dfj.config.SLIDING))


def step_target(smoke: bool, dtype: str, impl: str, options: dict) -> Target:
  cfg = dataclasses.replace(dfj.TINY_CONFIG, window=64) if smoke else dfj.SEED_CONFIG
  n_vocab, window = (512, 64) if smoke else (8192, 2048)
  ring_dtype = "fp32" if dtype == "fp32" else "bf16"
  if smoke:
    params = dfj.prepare_weights(cfg, dfj.synthetic_drafter(cfg, seed=0, n_vocab=n_vocab), dtype)
    ring = _host_ring(cfg, window, ring_dtype)
  else:
    params = C.random_params(cfg, n_vocab, dtype)
    ring = C.filled_state(cfg, ring_dtype, window, window)
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  compiled = S.block_step_jit.lower(params, ring, scalar, scalar, impl=impl).compile(
      compiler_options=options)
  return Target(compiled, (params, ring, jnp.int32(1), jnp.int32(window)),
                lambda args, out: args, "step",
                f"block step: {cfg.n_layer} x n_embd {cfg.n_embd}, vocab {n_vocab}, "
                f"{window}-slot {ring_dtype} ring, {dtype} weights, impl {impl}")


def round_target(smoke: bool, rounds: int, impl: str, options: dict) -> Target:
  from benchmarks import decode as BD
  su = BD.setup(smoke)
  models = BD.random_models(su, on_device=not smoke)
  w = su.drafter.block_size
  dcfg = D.DecodeConfig(width=w, impl=impl)
  prompt = np.random.default_rng(0).integers(0, su.target.vocab_size, su.prompt_len).tolist()
  # A round commits at most w tokens: the warm-up and the traced rounds never reach max_new.
  max_new = (rounds + 3) * w
  need = -(-(su.prompt_len + max_new + w) // 16) * 16
  state = D.start(models, dcfg, [prompt], max_new, capacity=max(su.capacity, need),
                  window=su.window, cache_dtype="bf16", ring_dtype="bf16")
  one = jnp.int32(1)
  compiled = D.run_rounds.lower(models, dcfg, state, one).compile(compiler_options=options)
  return Target(compiled, (models, state, one), lambda args, out: (args[0], out, args[2]),
                "round", f"decoding round: {su.target.num_hidden_layers}-layer target "
                f"(hidden {su.target.hidden_size}, vocab {su.target.vocab_size}), "
                f"{su.drafter.n_layer}-layer drafter, width {w}, impl {impl}")


def main(argv=None) -> int:
  p = C.arg_parser(__doc__, "profile", "real dimensions on the GPU")
  p.add_argument("--what", choices=("step", "round"), default="step")
  p.add_argument("--rounds", type=int, default=10, help="calls recorded (steps or rounds)")
  p.add_argument("--dtype", choices=("bf16", "fp32", "fp8", "q8_0"), default="bf16",
                 help="drafter weights of --what step")
  p.add_argument("--impl", choices=S.IMPLS, default=None,
                 help="drafter kernels (default pallas on a GPU, xla elsewhere)")
  p.add_argument("--command-buffer", choices=("on", "off"), default="off",
                 help="off: each kernel event names its phase; on: the production program")
  args = p.parse_args(argv)
  if args.rounds < 1:
    p.error(f"--rounds must be >= 1, got {args.rounds}")
  header, out_dir = C.start_results(p, args, argv)
  impl = args.impl or ("pallas" if C.ON_GPU else "xla")
  # Command buffers exist only on the GPU; the option is not passed elsewhere.
  options = ({"xla_gpu_enable_command_buffer": ""}
             if C.ON_GPU and args.command_buffer == "off" else None)
  t0 = time.perf_counter()
  target = (step_target(args.smoke, args.dtype, impl, options) if args.what == "step"
            else round_target(args.smoke, args.rounds, impl, options))
  hlo = target.compiled.as_text()
  module = re.match(r"HloModule (\S+?),", hlo).group(1)
  hlo_path = os.path.join(out_dir, f"{args.what}.hlo.txt")
  atomic.write_text(hlo_path, hlo)
  call_args = target.args
  for _ in range(2):   # warm-up: the first calls pay one-time costs
    call_args = target.advance(call_args, jax.block_until_ready(target.compiled(*call_args)))
  compile_s = time.perf_counter() - t0
  with jax.profiler.trace(out_dir, create_perfetto_trace=True):
    for i in range(args.rounds):
      with jax.profiler.StepTraceAnnotation(target.annotation, step_num=i):
        out = jax.block_until_ready(target.compiled(*call_args))
      call_args = target.advance(call_args, out)
  xplane, trace = trace_files(out_dir)
  phases = phase_times(trace, hlo_op_phases(hlo), module, args.rounds, target.annotation)
  res = dict(header, what=args.what, describe=target.describe, calls=args.rounds,
             command_buffer=args.command_buffer if C.ON_GPU else "n/a (not a GPU)",
             compile_and_warmup_s=compile_s, hlo_module=module, xplane=xplane, trace=trace,
             perfetto=os.path.join(os.path.dirname(trace), "perfetto_trace.json.gz"),
             hlo=hlo_path, phases=phases)
  C.save_results(out_dir, "phases", res)
  print(f"{target.describe}; {args.rounds} {target.annotation}s traced "
        f"(command buffers {res['command_buffer']})")
  print(f"\n{phases['source']}, ms per {target.annotation} by phase (all layers):")
  for k, v in phases["ms_per_call"].items():
    print(f"  {k:28s} {v:9.4f}  ({phases['events'][k] // args.rounds} events)")
  if phases["top_kernels_ms_per_call"] and not phases["ms_per_call"]:
    print("  no kernel event names an HLO op (command buffers on?); heaviest kernels:")
    for k, v in phases["top_kernels_ms_per_call"].items():
      print(f"  {k[:60]:60s} {v:9.4f}")
  print(f"\ntrace:    {xplane}\nperfetto: {res['perfetto']}\nHLO:      {hlo_path}\n"
        f"phases:   {os.path.join(out_dir, 'phases.json')}\n"
        f"open:     tensorboard --logdir {out_dir}   (Profile tab: tensorboard-plugin-profile)\n"
        f"          or load the perfetto file at https://ui.perfetto.dev")
  return 0


if __name__ == "__main__":
  sys.exit(main())
