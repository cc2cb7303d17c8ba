"""Kernel choice as data (dflash_jax.dispatch.KernelPolicy) and the block step as a family's
pieces (dflash_jax.drafter.step.Family): a policy is part of every jit key, the default policy
routes the seed drafter's step as the tuned tree did (kernel by kernel on the CPU, the launch
count on the GPU), nothing assigns a library module's data globals from outside, and the v1
pieces compose as a new family would compose them."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import subprocess
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dfj
from benchmarks import common as C
from dflash_jax import dispatch
from dflash_jax.dispatch import KernelPolicy
from dflash_jax.drafter import step as S
from dflash_jax.models import qwen3 as Q

CFG = dataclasses.replace(dfj.TINY_CONFIG, window=32)
VOCAB = 256
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _params(policy=KernelPolicy(), dtype="bf16", cfg=CFG):
  return dfj.prepare_weights(cfg, dfj.synthetic_drafter(cfg, seed=0, n_vocab=VOCAB), dtype,
                             policy=policy)


# ------------------------------------------------------------------------ the policy record
@pytest.mark.parametrize("field, value, msg", [
    ("skinny_max_m", -1, "skinny_max_m must be an int >= 0"),
    ("skinny_max_m", 16.0, "skinny_max_m must be an int >= 0"),
    ("fp8_deep_k", True, "fp8_deep_k must be an int >= 0"),
    ("batched_bf16_rows", [33, 128], r"batched_bf16_rows must be None or a \(min, max\) pair"),
    ("mgpu_attention_seqs", (1,), r"mgpu_attention_seqs must be None or a \(min, max\) pair"),
    ("fold_own_min_seqs", 0, "fold_own_min_seqs must be None or an int >= 1"),
    ("mosaic_gpu", "yes", "mosaic_gpu must be None, True or False"),
    ("target_pallas_max_width", -1, "target_pallas_max_width must be an int >= 0"),
    ("invariant_max_rows", 1.5, "invariant_max_rows must be an int >= 0"),
    ("invariant_max_rows", 65, r"invariant_max_rows must be <= 64 \(16-row chunks x "),
    ("target_invariant_attention", None, "target_invariant_attention must be True or False"),
    ("target_attention_chunk", 100, "target_attention_chunk must be a power of 2 >= 16"),
    ("target_attention_chunk", 8, "target_attention_chunk must be a power of 2 >= 16"),
])
def test_policy_fields_are_checked(field, value, msg):
  with pytest.raises(ValueError, match="KernelPolicy." + msg):
    KernelPolicy(**{field: value})


def test_policy_is_a_frozen_hashable_value_and_a_static_field():
  a, b = KernelPolicy(), KernelPolicy()
  assert a == b and hash(a) == hash(b) and a is not b
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.skinny_max_m = 32
  params = _params(KernelPolicy(skinny_max_m=0))
  assert params.policy == KernelPolicy(skinny_max_m=0)
  assert _params().policy == KernelPolicy()
  # Static: not a leaf (no device array), part of the treedef.
  leaves, treedef = jax.tree.flatten(params)
  assert not any(isinstance(x, KernelPolicy) for x in leaves)
  assert treedef != jax.tree.flatten(params.replace(policy=KernelPolicy()))[1]
  with pytest.raises(ValueError, match="policy must be a dflash_jax.dispatch.KernelPolicy"):
    _params(policy={"skinny_max_m": 0})
  with pytest.raises(ValueError, match="linear: impl='pallas' routes by a KernelPolicy"):
    dispatch.linear(jnp.ones((4, 64)), params.lm_head)


def test_two_policies_compile_two_programs():
  """Params that differ only in their policy lower to different programs (the bf16 GEMMs of
  an 8-row block on the skinny GEMM, or on XLA's), each its own jit cache entry; an equal
  policy (another object) reuses the entry."""
  skinny = _params()
  xla = skinny.replace(policy=KernelPolicy(skinny_max_m=0))
  ring = dfj.init_ring(CFG, ring_dtype="bf16")
  texts = [S.block_step_jit.lower(p, ring, 3, 40).as_text() for p in (skinny, xla)]
  assert texts[0] != texts[1]
  count = lambda t: t.count("func.func private @skinny_matmul")   # one per GEMM shape called
  assert count(texts[0]) > 0 and count(texts[1]) == 0
  before = S.block_step_jit._cache_size()
  outs = [np.asarray(S.block_step_jit(p, ring, 3, 40)) for p in (skinny, xla)]
  assert S.block_step_jit._cache_size() == before + 2
  S.block_step_jit(skinny.replace(policy=KernelPolicy()), ring, 3, 40)
  assert S.block_step_jit._cache_size() == before + 2
  # The same step either way: to the rounding of another GEMM's summation order.
  np.testing.assert_allclose(outs[0], outs[1], atol=5e-2, rtol=0)


def test_target_params_carry_a_policy():
  """qwen3.TargetParams.policy routes the target's GEMMs (impl="pallas"): a second policy is
  a second program. The target's products are batch invariant up to invariant_max_rows rows
  (the skinny GEMM whatever skinny_max_m); with that off they follow skinny_max_m."""
  cfg = Q.TargetConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       rope_theta=1e4, max_position_embeddings=64)
  params = Q.init_params(cfg, jax.random.key(0), jnp.bfloat16)
  assert params.policy == KernelPolicy()
  cache = Q.init_cache(cfg, 1, 32)
  tokens = jnp.ones((1, 8), jnp.int32)
  policies = (KernelPolicy(), KernelPolicy(skinny_max_m=0),
              KernelPolicy(skinny_max_m=0, invariant_max_rows=0),
              KernelPolicy(invariant_max_rows=0))
  texts = [Q.verify_jit.lower(params.replace(policy=p), cfg, cache, tokens,
                              impl="pallas").as_text() for p in policies]
  assert [("skinny_matmul" in t) for t in texts] == [True, True, False, True]
  assert texts[0] == texts[1]   # skinny_max_m does not route a batch-invariant product


# --------------------------------------------------------- the default routing, kernel by kernel
def _kernels(fn, *args) -> list[str]:
  """The kernels fn traces to, in order: Pallas Triton calls by name, Mosaic GPU kernels as
  "mosaic:<name>" (the batched GEMM's is "kernel")."""
  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == "pallas_call":
        yield str(e.params["name"])
      elif e.primitive.name == "mpmd_map":
        yield "mosaic:" + str(e.params["name"])
      else:
        for v in e.params.values():
          inner = getattr(v, "jaxpr", v)
          if hasattr(inner, "eqns"):
            yield from walk(inner)
  return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def _seed_step_kernels(fmt: str, n_slots: int | None) -> list[str]:
  """The seed drafter's block step (V 8192, full bf16 2048-slot rings) under the default
  policy with a Hopper GPU's answer (`mosaic_gpu=True`), traced with abstract weights."""
  cfg = dfj.SEED_CONFIG
  params = jax.eval_shape(lambda: C.random_params(cfg, 8192, fmt)).replace(
      policy=KernelPolicy(mosaic_gpu=True))
  if n_slots is None:
    ring = jax.eval_shape(lambda: dfj.init_ring(cfg, ring_dtype="bf16"))
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return _kernels(lambda p, r, i, n: S.block_step(p, r, i, n), params, ring, scalar, scalar)
  ring = jax.eval_shape(lambda: dfj.init_batched_ring(cfg, n_slots, ring_dtype="bf16"))
  ints = jax.ShapeDtypeStruct((n_slots,), jnp.int32)
  active = jax.ShapeDtypeStruct((n_slots,), jnp.bool_)
  return _kernels(lambda p, r, i, n, a: S.block_step_batched(p, r, i, n, a), params, ring,
                  ints, ints, active)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_default_policy_routes_the_seed_step(fmt):
  """What the tuned routing runs at the seed dims on a Hopper GPU (the CPU side of the GPU
  launch count below), written out kernel by kernel: one sequence's 16 rows on the skinny
  GEMM with the Mosaic GPU attention partials; 8 slots' 128 rows on the batched GEMM behind
  the Pallas row norm; 32 slots' 512 rows (past the bf16 batched rows; fp8's in two 256-row
  calls) with the Triton attention."""
  one = ["skinny_matmul", "qk_norm_rope", "mosaic:ring_attn_mgpu_partial", "ring_attn_combine",
         "skinny_matmul", "skinny_matmul_gate_up", "skinny_matmul"]
  assert _seed_step_kernels(fmt, None) == one * 5 + ["skinny_matmul"]
  batched = ["rms_norm", "mosaic:kernel", "qk_norm_rope", "mosaic:ring_attn_mgpu_partial",
             "ring_attn_combine", "mosaic:kernel", "rms_norm", "mosaic:kernel", "mosaic:kernel"]
  assert _seed_step_kernels(fmt, 8) == batched * 5 + ["rms_norm", "mosaic:kernel"]
  triton = ["qk_norm_rope", "ring_attn_partial", "ring_attn_combine"]
  if fmt == "bf16":   # XLA's GEMMs and norms
    assert _seed_step_kernels(fmt, 32) == triton * 5
  else:   # fp8 up to 512 rows on the batched GEMM, in calls of 256 rows
    two = ["mosaic:kernel"] * 2
    gemm = ["rms_norm", *two, *triton, *two, "rms_norm", *two, *two]
    assert _seed_step_kernels(fmt, 32) == gemm * 5 + ["rms_norm", *two]


def test_attention_routing_follows_the_policy():
  seed = dfj.SEED_CONFIG
  on = KernelPolicy(mosaic_gpu=True)

  def route(policy, n_seqs=1, t=16, group=4, ring_dtype=jnp.bfloat16, impl="pallas"):
    return dispatch.attention(n_seqs=n_seqs, n_head_kv=8, t=t, group=group, head_dim=128,
                              slots=2048, window=seed.window, ring_dtype=ring_dtype, impl=impl,
                              policy=policy)

  assert route(on).kernel == "mgpu" and route(on).knobs.splits == 16
  assert route(on, n_seqs=16).kernel == "mgpu" and route(on, n_seqs=17).kernel == "triton"
  assert route(on, group=3).kernel == "triton"                   # 48 packed rows
  assert route(on, ring_dtype=jnp.float32).kernel == "triton"
  assert route(KernelPolicy(mosaic_gpu=False)).kernel == "triton"
  assert route(dataclasses.replace(on, mgpu_attention_seqs=None)).kernel == "triton"
  assert route(on, impl="xla") == dispatch.Attention("xla")
  assert route(None, impl="xla") == dispatch.Attention("xla")   # the twins route nothing
  assert route(on, n_seqs=17).knobs.fold_own
  assert not route(dataclasses.replace(on, fold_own_min_seqs=None), n_seqs=17).knobs.fold_own


def test_target_routing_follows_the_policy():
  """dispatch.target_attention: the Pallas cache pieces up to target_pallas_max_width rows per
  sequence, their query tile sized for that width (batch invariant) or for this pass, the
  policy's chunk; XLA's composition beyond, and for impl "xla". residual_norm writes the
  GEMM's input dtype on the Pallas path, float32 on XLA's."""
  def route(policy=KernelPolicy(), t=1, group=4, head_dim=128, impl="pallas"):
    return dispatch.target_attention(t=t, group=group, head_dim=head_dim,
                                     cache_dtype=jnp.bfloat16, impl=impl, policy=policy)

  assert route(t=1) == route(t=16) and route(t=1).block_q == 64
  assert route(t=1).chunk == 512 and route(KernelPolicy(target_attention_chunk=256)).chunk == 256
  fast = KernelPolicy(target_invariant_attention=False)
  assert route(fast, t=1).block_q == 16 and route(fast, t=16).block_q == 64
  assert route(group=8).block_q == 128 and route(group=3).block_q == 64
  assert route(t=17) is None and route(impl="xla") is None
  assert route(KernelPolicy(target_pallas_max_width=0)) is None
  with pytest.raises(ValueError, match="head_dim must be a multiple of 16 in \\[16, 256\\] "
                                       "\\(got 8\\)"):
    route(head_dim=8)
  x = jnp.ones((3, 64), jnp.float32)
  for w, want in ((jnp.ones((8, 64), jnp.bfloat16), jnp.bfloat16),
                  (jnp.ones((8, 64), jnp.float32), jnp.float32)):
    new, y = dispatch.residual_norm(x, jnp.ones((2, 3, 64), jnp.float32), jnp.ones(64), 1e-6, w,
                                    policy=KernelPolicy())
    assert y.dtype == want and float(new[0, 0]) == 3.0
    assert dispatch.residual_norm(x, None, jnp.ones(64), 1e-6, w, impl="xla")[1].dtype == (
        jnp.float32)


@pytest.mark.gpu
def test_gpu_default_policy_launch_count_of_the_seed_step():
  """The bf16 seed step (V 8192, a full 2048-slot bf16 ring) under the default policy
  launches what the tuned tree launched: 54 kernels per step (benchmarks/RESULTS.md, the
  bf16 step's launch count in "Where the targets stand")."""
  cfg = dfj.SEED_CONFIG
  params = C.random_params(cfg, 8192, "bf16")
  assert params.policy == KernelPolicy()
  ring = C.filled_state(cfg, "bf16", 2048, 2048)
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  step = S.block_step_jit.lower(params, ring, scalar, scalar).compile()
  per = C.cupti_kernels(step, params, ring, jnp.int32(1), jnp.int32(2048), iterations=3)
  assert C.launches(per) == 54, C.kernel_medians(per)


# ----------------------------------------------------- no data global assigned from outside
LIBRARY = ("dflash_jax", "pallas_kernels")


def _python_files() -> list[str]:
  out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                       check=True).stdout.split()
  return [os.path.join(ROOT, f) for f in out]


def _aliases(tree: ast.AST) -> dict[str, str]:
  """Names the file's imports bind (anywhere in it) -> the dotted path they stand for."""
  names = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for a in node.names:
        names[a.asname or a.name] = f"{node.module}.{a.name}"
  return names


def _lookup(path: str):
  """The object a dotted path names (its longest importable prefix, then attributes); None
  when there is none."""
  parts = path.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for part in parts[i:]:
      if not hasattr(obj, part):
        return None
      obj = getattr(obj, part)
    return obj
  return None


def _resolve(expr: ast.AST, names: dict[str, str]):
  """The object a Name / attribute chain stands for, through the file's imports; None when it
  is not an import's (a local variable)."""
  if isinstance(expr, ast.Name):
    return _lookup(names[expr.id]) if expr.id in names else None
  if isinstance(expr, ast.Attribute):
    base = _resolve(expr.value, names)
    return None if base is None else getattr(base, expr.attr, None)
  return None


def _is_library_module(obj) -> bool:
  return isinstance(obj, types.ModuleType) and obj.__name__.split(".")[0] in LIBRARY


def _assignments(path: str):
  """(line, target object or None, attribute name or None, how) of every setattr call
  (builtin or a monkeypatch's) and attribute assignment in the file."""
  tree = ast.parse(open(path).read(), path)
  names = _aliases(tree)
  for node in ast.walk(tree):
    if isinstance(node, ast.Call):
      f = node.func
      called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
      if called != "setattr" or not node.args:
        continue
      first = node.args[0]
      if isinstance(first, ast.Constant) and isinstance(first.value, str):   # "pkg.mod.attr"
        owner, _, attr = first.value.rpartition(".")
        yield node.lineno, _lookup(owner), attr, "setattr"
        continue
      attr = node.args[1].value if (len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                                    ) else None
      yield node.lineno, _resolve(first, names), attr, "setattr"
    elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      for t in targets:
        if isinstance(t, ast.Attribute):
          base = _resolve(t.value, names)
          if _is_library_module(base):
            yield node.lineno, base, t.attr, "assignment"


def test_no_library_data_global_is_assigned_outside_its_module():
  """Kernel choice is a KernelPolicy, never a module global flipped at run time: no file
  assigns a data global (a threshold, a table, a flag) of a dflash_jax or pallas_kernels
  module, by setattr, a monkeypatch or `module.NAME = ...`. Replacing a function or class with
  a stand-in stays allowed (a test's fake for a kernel body that has no CPU path, or a broken
  class to test cleanup): that changes no routing, and the routing tests pick their routing by
  policy. A setattr whose target or name cannot be read from the source (a variable) is
  refused too: it could hide either."""
  bad = []
  for path in _python_files():
    for line, target, attr, how in _assignments(path):
      where = f"{os.path.relpath(path, ROOT)}:{line}"
      if target is None or attr is None:
        if how == "setattr" and (target is None or _is_library_module(target)):
          bad.append(f"{where}: setattr on a target or name not readable from the source")
        continue
      if not _is_library_module(target):
        continue
      value = getattr(target, attr, None)
      if not callable(value):
        bad.append(f"{where}: {how} of {target.__name__}.{attr} (a data global)")
  assert not bad, "\n".join(bad)


def test_the_assignment_scan_sees_what_it_forbids(tmp_path):
  """The scan above on a file that does each forbidden thing (and two allowed ones)."""
  src = tmp_path / "probe.py"
  src.write_text(
      "from dflash_jax import dispatch as P\n"
      "import pallas_kernels.batched_gemm as BG\n"
      "def t(monkeypatch, mod):\n"
      "  monkeypatch.setattr(P, 'hopper_available', lambda: True)\n"   # a callable: allowed
      "  monkeypatch.setattr(BG, 'MAX_ROWS', 3)\n"
      "  setattr(BG, 'ACC_FLOATS', 1)\n"
      "  monkeypatch.setattr('pallas_kernels.batched_gemm.SMEM_BYTES', 1)\n"
      "  P.WEIGHT_FORMATS = ()\n"
      "  setattr(mod, 'X', 1)\n"
      "  import tempfile\n"
      "  monkeypatch.setattr(tempfile, 'tempdir', '/x')\n")   # not the library: allowed
  found = [(line, getattr(t, "__name__", None), a, how) for line, t, a, how in _assignments(
      str(src))]
  data = [f for f in found if f[1] and f[1].split(".")[0] in LIBRARY
          and not callable(getattr(importlib.import_module(f[1]), f[2], None))]
  assert sorted((line, a) for line, _, a, _ in data) == [
      (5, "MAX_ROWS"), (6, "ACC_FLOATS"), (7, "SMEM_BYTES"), (8, "WEIGHT_FORMATS")]
  assert (9, None, "X", "setattr") in found


# ------------------------------------------------------------------- the family's pieces
def test_unknown_family_is_refused_by_name():
  with pytest.raises(ValueError, match=r"family must be one of .*got 'dflash9'"):
    dataclasses.replace(CFG, family="dflash9")
  assert S.family(CFG) is S.FAMILIES["dflash"]


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_pieces_compose_as_a_new_family_would(impl):
  """The v1 pieces from the shared functions: the attention sublayer's o projection with the
  residual fused (v1) equals the projection followed by the add (how a family that works on
  the sublayer's output before the add composes it: on the CPU the add is XLA's either way,
  so bitwise); the head returns the final-normed rows it projects; the layers, head and
  readout composed by hand give block_step's logits and draft_round's drafts bitwise."""
  params = _params()
  ring = dfj.init_ring(CFG, ring_dtype="bf16")
  feats = jnp.asarray(dfj.synthetic_features(CFG, 30, seed=1))
  ring = S.inject(params, ring, S.encode(params, feats, impl=impl),
                  jnp.arange(30, dtype=jnp.int32), impl=impl)
  w, n_past, id_last = CFG.block_size, jnp.int32(30), jnp.int32(11)
  blk = S._context(params, ring, n_past, w, impl, None)
  fam = S.family(CFG)
  x = fam.embed(blk, S.block_tokens(CFG, id_last, w, None))
  lp = params.layers[0]
  fused = S.attention_sublayer(blk, 0, x)
  qkv = S.project(blk, S.sublayer_norm(blk, x, lp.attn_norm, lp.wqkv), lp.wqkv, partials=True)
  unfused = x + S.project(blk, S.attend(blk, 0, qkv), lp.wo)
  np.testing.assert_array_equal(np.asarray(fused), np.asarray(unfused))
  for l in range(CFG.n_layer):
    x = fam.layer(blk, l, x)
  logits, h = fam.head(blk, x)
  np.testing.assert_allclose(np.asarray(h, np.float32),
                             np.asarray(dispatch.rms_norm(x, params.out_norm, CFG.eps)),
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(logits),
                                np.asarray(S.block_step(params, ring, id_last, n_past, impl=impl)))
  d = fam.readout(params, impl, logits[None], h[None], id_last[None])
  np.testing.assert_array_equal(np.asarray(d.drafts[0]), np.asarray(S.greedy_drafts(logits)))
  np.testing.assert_array_equal(np.asarray(d.logits[0]), np.asarray(logits))


# ---------------------------------------------------------------------------- import layers
# Lower layers never import higher ones (function-level imports included): the kernels, then
# config / quant / io / dispatch, then the drafter, the targets and the random weights, then
# decoding and sharding, then training, the CLI and the package's facade.
LAYERS = (("pallas_kernels", 0),
          ("dflash_jax.config", 1), ("dflash_jax.quant", 1), ("dflash_jax.dispatch", 1),
          ("dflash_jax.io", 1),
          ("dflash_jax.synthetic", 2), ("dflash_jax.drafter", 2), ("dflash_jax.models", 2),
          ("dflash_jax.decode", 3), ("dflash_jax.sharding", 3), ("dflash_jax.sampling", 3),
          ("dflash_jax.train", 4), ("dflash_jax.cli", 4), ("dflash_jax.__main__", 4),
          ("dflash_jax", 4))


def _layer(module: str) -> int | None:
  """The layer of a library module (the longest matching prefix), None outside the library;
  a library module the table does not place is an error (place it when adding it)."""
  best = None
  for prefix, layer in LAYERS:
    if module == prefix or module.startswith(prefix + "."):
      if best is None or len(prefix) > len(best[0]):
        best = (prefix, layer)
  if best is None and module.split(".")[0] in LIBRARY:
    raise AssertionError(f"{module} is in no layer of tests/test_policy.py's LAYERS")
  return None if best is None else best[1]


def _imported_modules(path: str, module: str) -> list[tuple[int, str]]:
  out = []
  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.Import):
      out += [(node.lineno, a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:   # relative: resolved against the importing module's package
        pkg = module.rsplit(".", node.level)[0]
        base = f"{pkg}.{base}" if base else pkg
      for a in node.names:
        sub = f"{base}.{a.name}"
        is_module = (sub.split(".")[0] in LIBRARY and os.path.exists(
            os.path.join(ROOT, *sub.split(".")) + ".py") or os.path.isdir(
            os.path.join(ROOT, *sub.split("."))))
        out.append((node.lineno, sub if is_module else base))
  return out


def test_no_library_module_imports_a_higher_layer():
  bad = []
  for path in _python_files():
    rel = os.path.relpath(path, ROOT)
    if rel.split(os.sep)[0] not in LIBRARY:
      continue
    module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
    own = _layer(module)
    for line, imported in _imported_modules(path, module):
      layer = _layer(imported)
      if layer is not None and layer > own:
        bad.append(f"{rel}:{line}: {module} (layer {own}) imports {imported} (layer {layer})")
  assert not bad, "\n".join(bad)
