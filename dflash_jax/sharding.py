"""Multi-device drafter and target: sharding rules as data, placement, sharded entry points.

A `Plan` is a mesh with axes "dp" (data parallel: sequence slots) and "tp" (tensor parallel:
query heads, kv heads, FFN columns, the fc input columns and the LM head's vocab rows), plus
`Rules`: which mesh axis each logical axis is split over. The tables below give every leaf
of the drafter params, the ring, the target params and the target cache its logical axes
(every other array of a decode state has a leading slot axis); `shard_params` /
`shard_ring` / `shard_target` / `shard_target_cache` / `shard_models` place every leaf with a
`NamedSharding` and raise a ValueError before placing anything when a split does not divide (naming the leaf, the axis and the sizes). Embeddings stay whole on
every device (a gather reads a few rows); so does a tied target head (lm_head None).

Layout on the mesh. A plain axis is split in place (device i holds block i; the array keeps
its shape). A fused matrix whose rows are segments split per head group (wqkv: q | k | v
heads; wgu: gate | up columns; each inject GEMM: wk | wv of every layer of the kind) is
stored as [n, rows / n, K] with n the size of its mesh axis (1 when unsplit): block i holds
segment part i of every segment, in segment order, so device i's block is exactly the fused
matrix of a model with n_head / n query heads, n_head_kv / n kv heads and n_ff / n FFN
columns. Those arrays are meant for this module's entry points only (the unsharded
functions would misread them; the entry points reject unsharded trees).

Inside each entry point `shard_call` (`jax.shard_map`, the one wrapper) runs the unsharded
function on every device's block with that local
config, the o, down and fc projections wrapped in `params.Reduced` (their inputs are split,
so `linear` psums their products), and the LM head producing this device's vocab columns:
the logits leave the map sharded over vocab, and the greedy drafts are their argmax across
devices. A TP result equals the unsharded one to rounding (the psums add per-device partial
sums in another order than one GEMM does); a DP-only result (tp = 1) runs each slot's
unsharded arithmetic.

For decoding, `shard_models` binds the mesh into `decode.Models` once: the target becomes a
`ShardedTarget` (a `Target` whose calls run on the mesh) and the drafter's calls a `MeshRun`,
so the loop itself never looks at the plan.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dflash_jax.config import DFlashConfig
from dflash_jax.dispatch import QuantWeight, Reduced
from dflash_jax.drafter import step
from dflash_jax.drafter.weights import DrafterParams, InjectParams, LayerParams
from dflash_jax.models import qwen3

DP, TP = "dp", "tp"


@dataclasses.dataclass(frozen=True)
class Rules:
  """Logical axis -> mesh axis name (None: replicated). q_heads and kv_heads must share an
  axis (a GQA group stays on one device)."""
  q_heads: str | None = TP
  kv_heads: str | None = TP
  ffn: str | None = TP
  fc_in: str | None = TP      # the fc GEMM's input columns (the concatenated target features)
  vocab: str | None = TP      # LM head rows (the logits' vocab axis); embeddings stay whole
  slots: str | None = DP      # sequence slots (the leading axis of batched state)

  def axis(self, logical: str) -> str | None:
    return getattr(self, logical)


LOGICAL_AXES = tuple(f.name for f in dataclasses.fields(Rules))


@dataclasses.dataclass(frozen=True)
class Plan:
  """A mesh and the rules placing logical axes on it; hashable (a static jit argument)."""
  mesh: Mesh
  rules: Rules = Rules()

  def __post_init__(self):
    names = tuple(self.mesh.axis_names)
    for logical in LOGICAL_AXES:
      a = self.rules.axis(logical)
      if a is not None and a not in names:
        raise ValueError(f"rules map {logical} to mesh axis {a!r}, but the mesh has axes {names}")
    if self.rules.q_heads != self.rules.kv_heads:
      raise ValueError(f"rules must split q_heads and kv_heads over one axis (a GQA group on "
                       f"one device), got {self.rules.q_heads!r} and {self.rules.kv_heads!r}")

  def size(self, logical: str) -> int:
    """Devices the logical axis is split over (1 when replicated)."""
    a = self.rules.axis(logical)
    return 1 if a is None else int(self.mesh.shape[a])


def make_plan(tp: int = 1, dp: int = 1, devices=None, rules: Rules = Rules()) -> Plan:
  """A (dp, tp) mesh over the first dp * tp devices (default: jax.devices())."""
  for name, v in (("tp", tp), ("dp", dp)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError(f"{name} must be an int >= 1, got {v!r}")
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) < dp * tp:
    raise ValueError(f"a dp={dp} x tp={tp} mesh needs {dp * tp} devices, {len(devices)} given")
  grid = np.array(devices[:dp * tp], dtype=object).reshape(dp, tp)
  return Plan(Mesh(grid, (DP, TP)), rules)


def as_plan(plan: Plan | Mesh) -> Plan:
  """A Plan, or a Mesh with axes dp / tp taken with the default rules."""
  return plan if isinstance(plan, Plan) else Plan(plan)


# --- the tables ------------------------------------------------------------------------------
# Per leaf, one entry per array axis: None (never split), a logical axis, or a tuple of
# logical axes (a fused axis: concatenated segments, each split on its own). A segment of a
# head or FFN axis holds count x unit rows (unit: head_dim for heads, 1 for FFN columns);
# other logical axes count the axis length.

_SUB = "subtree"
_LAYER = {"attn_norm": (None,), "wqkv": (("q_heads", "kv_heads", "kv_heads"), None),
          "q_norm": (None,), "k_norm": (None,), "wo": (None, "q_heads"), "ffn_norm": (None,),
          "wgu": (("ffn", "ffn"), None), "wd": (None, "ffn")}


def _drafter_table(p: DrafterParams) -> dict:
  return {"fc": (None, "fc_in"), "enc_norm": (None,), "out_norm": (None,), "inv_freq": (None,),
          "tok_embd": (None, None), "lm_head": ("vocab", None), "inject": _SUB, "layers": _SUB}


def _inject_table(ip: InjectParams) -> dict:
  # Rows: for each layer of the kind, its wk heads then its wv heads.
  return {"w": (("kv_heads",) * (2 * int(ip.k_norm.shape[0])), None), "k_norm": (None, None)}


def _kv_cache_table(c: step.KVCache) -> dict:
  lead = ("slots",) if c.pos.ndim == 2 else ()
  return {"k": lead + (None, "kv_heads", None, None), "v": lead + (None, "kv_heads", None, None),
          "pos": lead + (None,)}


def _target_table(p: qwen3.TargetParams) -> dict:
  return {"embed": (None, None), "layers": _SUB, "final_norm": (None,),
          "lm_head": ("vocab", None)}


def _target_cache_table(c: qwen3.TargetCache) -> dict:
  kv = ("slots", "kv_heads", None, None)
  return {"k": kv, "v": kv, "length": ("slots",)}


_TABLES: dict[type, Callable[[Any], dict]] = {
    DrafterParams: _drafter_table, LayerParams: lambda _: _LAYER, InjectParams: _inject_table,
    step.RingState: lambda _: {"sliding": _SUB, "full": _SUB}, step.KVCache: _kv_cache_table,
    qwen3.TargetParams: _target_table, qwen3.TargetLayer: lambda _: _LAYER,
    qwen3.TargetCache: _target_cache_table,
}

# Counts of the flattened logical axes of weights (query heads x head_dim rows, ...).
def _drafter_counts(cfg: DFlashConfig) -> dict[str, int]:
  return {"q_heads": cfg.n_head, "kv_heads": cfg.n_head_kv, "ffn": cfg.n_ff}


def _target_counts(cfg: qwen3.TargetConfig) -> dict[str, int]:
  return {"q_heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
          "ffn": cfg.intermediate_size}


def _map_leaves(node, fn, path: str = ""):
  """node with fn(value, axes, path) in place of every leaf field (value: an array or a
  QuantWeight, whose scale takes the leading axes of its data)."""
  if node is None:
    return None
  if isinstance(node, (tuple, list)):
    return type(node)(_map_leaves(x, fn, f"{path}[{i}]") for i, x in enumerate(node))
  table = _TABLES.get(type(node))
  if table is None:
    raise TypeError(f"{path or 'tree'}: no sharding table for {type(node).__name__}")
  def leaf(v, axes, where):   # a tuple field (the target cache's per-layer k, v) maps per entry
    if isinstance(v, (tuple, list)):
      return type(v)(leaf(x, axes, f"{where}[{i}]") for i, x in enumerate(v))
    return None if v is None else fn(v, axes, where)
  out = {}
  for field, axes in table(node).items():
    v, where = getattr(node, field), f"{path}.{field}" if path else field
    out[field] = _map_leaves(v, fn, where) if axes == _SUB else leaf(v, axes, where)
  return node.replace(**out)


def _arrays(value, axes, path, fn):
  """fn(array, axes, path, blocks) on an array, or on a QuantWeight's data and scale (blocks:
  the scale's axes past the first count Q8_0 blocks, not heads or columns)."""
  if isinstance(value, QuantWeight):
    stored = value.data.ndim - len(axes)   # 1 when a fused axis is stored as [parts, ...]
    return value.replace(data=fn(value.data, axes, path + ".data", False),
                         scale=fn(value.scale, axes[:value.scale.ndim - stored], path + ".scale",
                                  True))
  return fn(value, axes, path, False)


def _names(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _mesh_axis(plan: Plan, entry, path: str, dim: int) -> str | None:
  axes = {plan.rules.axis(n) for n in _names(entry)}
  if len(axes) > 1:
    raise ValueError(f"{path}: the segments of fused axis {dim} ({_names(entry)}) map to "
                     f"different mesh axes {sorted(map(str, axes))}")
  return axes.pop() if axes else None


def _segments(shape, entry, dim: int, counts: dict[str, int], path: str) -> list[tuple[str, int, int]]:
  """(logical axis, count, rows) per segment of axis `dim`."""
  names = _names(entry)
  n_rows = int(shape[dim])
  known = [counts.get(n) for n in names]
  if all(c is None for c in known):
    per = n_rows // len(names)
    return [(n, per, per) for n in names]
  total = sum(known)
  if n_rows % total:
    raise ValueError(f"{path}: axis {dim} has {n_rows} rows, not a multiple of its "
                     f"{'+'.join(names)} = {total} heads/columns")
  unit = n_rows // total
  return [(n, c, c * unit) for n, c in zip(names, known)]


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """How one array lies on the mesh: its PartitionSpec, and for a fused axis (always axis 0)
  the segment row counts and the number of parts it is stored in ([parts, rows / parts, ...])."""
  spec: P
  segments: tuple[int, ...] | None = None
  parts: int = 1


def _leaf(plan: Plan, a, axes, path: str, counts: dict[str, int], problems: dict,
          stored: bool, blocks: bool = False) -> _Leaf:
  """The layout of array a and any divisibility problems. stored=False: a has the unsharded
  shape (to be placed); stored=True: a is as shard_* placed it (fused axes [parts, ...]).
  blocks: axes past the first count their length (a Q8_0 scale's blocks of 32 columns)."""
  fused_axis = bool(axes) and isinstance(axes[0], tuple)
  shape = tuple(a.shape)
  if stored and fused_axis:
    want = plan.size(_names(axes[0])[0])
    if a.ndim != len(axes) + 1 or shape[0] != want:
      raise ValueError(f"{path} has shape {shape}: not sharded for this plan (its fused rows "
                       f"must be stored as [{want}, rows / {want}, ...]: place the tree with "
                       f"this module's shard_* functions)")
    shape = (shape[0] * shape[1],) + shape[2:]
  if len(axes) != len(shape):
    hint = (" (already sharded? place the unsharded tree)"
            if not stored and fused_axis and a.ndim == len(axes) + 1 else "")
    raise ValueError(f"{path}: expected {len(axes)} axes, got shape {tuple(a.shape)}{hint}")
  entries = []
  fused = None
  for dim, entry in enumerate(axes):
    mesh_axis = _mesh_axis(plan, entry, path, dim)
    n = 1 if mesh_axis is None else int(plan.mesh.shape[mesh_axis])
    segs = (_segments(shape, entry, dim, {} if blocks and dim else counts, path)
            if entry is not None else [])
    for name, count, rows in segs:
      if n > 1 and (count % n or rows % n):
        what = f"{count} {name}" + (f" ({rows} rows)" if rows != count else "")
        problems.setdefault((name, mesh_axis, count), (path, dim, what, n))
    if isinstance(entry, tuple):
      if dim != 0:
        raise ValueError(f"{path}: a fused axis must be axis 0, got axis {dim}")
      fused = (tuple(r for _, _, r in segs), n)
    entries.append(mesh_axis)
  used = [e for e in entries if e is not None]
  if len(used) != len(set(used)):
    raise ValueError(f"{path}: two axes map to one mesh axis ({entries}); fix the rules")
  if fused is not None:   # stored [parts, rows / parts, ...]: the parts axis is the split one
    return _Leaf(P(entries[0], None, *entries[1:]), segments=fused[0], parts=fused[1])
  return _Leaf(P(*entries))


def _raise_problems(problems: dict) -> None:
  """One ValueError naming every split that does not divide (the first leaf of each)."""
  if problems:
    lines = [f"{path} axis {dim}: {what} do not split over mesh axis {key[1]!r} of {n} devices"
             for key, (path, dim, what, n) in problems.items()]
    raise ValueError("shapes do not divide the mesh: " + "; ".join(lines))


def _layout(plan: Plan, tree, counts: dict[str, int] | None = None, stored: bool = True):
  """tree with a _Leaf in place of every array (raises before returning any)."""
  problems: dict = {}
  out = _map_leaves(tree, lambda v, axes, path: _arrays(
      v, axes, path, lambda a, ax, pth, blocks: _leaf(plan, a, ax, pth, counts or {}, problems,
                                                      stored, blocks)))
  _raise_problems(problems)
  return out


def _is_leaf(x) -> bool:
  return isinstance(x, _Leaf)


def _specs(layout):
  """The shard_map specs of a layout (fused arrays: their stored [parts, ...] form)."""
  return jax.tree.map(lambda l: l.spec, layout, is_leaf=_is_leaf)


def _fuse_split(a: jax.Array, segments: tuple[int, ...], parts: int) -> jax.Array:
  """[sum(segments), ...] -> [parts, sum / parts, ...]: block i is part i of every segment."""
  off, pieces = 0, []
  for rows in segments:
    pieces.append(a[off:off + rows].reshape(parts, rows // parts, *a.shape[1:]))
    off += rows
  return jnp.concatenate(pieces, axis=1)


def _place(plan: Plan, tree, layout, copy: bool):
  def put(l: _Leaf, a):
    if l.segments is not None:
      a = _fuse_split(jnp.asarray(a), l.segments, l.parts)
    sharding = NamedSharding(plan.mesh, l.spec)
    if isinstance(a, jax.core.Tracer):   # inside a jitted program (decode's start): a layout
      return jax.lax.with_sharding_constraint(a, sharding)
    if (isinstance(a, jax.Array) and isinstance(a.sharding, NamedSharding)
        and a.sharding.mesh == plan.mesh and a.sharding.is_equivalent_to(sharding, a.ndim)):
      return a   # already on this mesh (e.g. a decode state's cache after its sharded prefill)
    if copy:   # device_put reuses the input's buffer for a shard on the same device
      a = jnp.array(a, copy=True)
    return jax.device_put(a, sharding)
  return jax.tree.map(put, layout, tree, is_leaf=_is_leaf)


def _shard(tree, plan, counts=None, copy=False):
  """copy=True for state that entry points donate: a placed array may otherwise share its
  buffer with the input (device_put does, even with may_alias=False), and donating it would
  delete the input too."""
  plan = as_plan(plan)
  return _place(plan, tree, _layout(plan, tree, counts, stored=False), copy)


def shard_params(params: DrafterParams, plan: Plan | Mesh) -> DrafterParams:
  """Drafter weights on the mesh (fused matrices in the [parts, rows / parts, K] form). DFlash
  drafters only: the DFlash2 / DSpark tensors have no layout on a mesh yet."""
  if params.cfg.family != "dflash":
    raise ValueError(f"a {params.cfg.family!r} drafter cannot be sharded yet (its "
                     "convolution, selector and Markov tensors have no mesh layout); run it on "
                     "one device")
  return _shard(params, plan, _drafter_counts(params.cfg))


def shard_ring(ring: step.RingState, plan: Plan | Mesh) -> step.RingState:
  """A ring (or one with a leading slot axis) on the mesh: kv heads over `kv_heads`'s axis,
  slots over `slots`'s axis."""
  return _shard(ring, plan, copy=True)


def shard_target(params: qwen3.TargetParams, cfg: qwen3.TargetConfig,
                 plan: Plan | Mesh) -> qwen3.TargetParams:
  """Target weights on the mesh (same rules as the drafter's layers)."""
  return _shard(params, plan, _target_counts(cfg))


def shard_target_cache(cache: qwen3.TargetCache, plan: Plan | Mesh) -> qwen3.TargetCache:
  """The target cache on the mesh: batch over `slots`'s axis, kv heads over `kv_heads`'s."""
  return _shard(cache, plan, copy=True)


def _slot_arrays(plan: Plan, values: dict[str, Any]) -> dict[str, Any]:
  """Arrays whose leading axis is the slot axis (values may be pytrees of them, or None),
  placed over `slots`'s mesh axis."""
  problems: dict = {}

  def layout(path, v):
    name = jax.tree_util.keystr(path)
    return _leaf(plan, v, ("slots",) + (None,) * (v.ndim - 1), name, {}, problems, stored=False)
  layouts = jax.tree_util.tree_map_with_path(layout, values)
  _raise_problems(problems)
  return _place(plan, values, layouts, copy=True)


@dataclasses.dataclass(frozen=True)
class MeshRun:
  """`decode.DrafterRun` on a mesh: the drafter's rounds and prompt injection sharded (DP
  over slots x TP), rings and per-slot state placed by the plan's rules."""
  plan: Plan

  def init_ring(self, cfg, n_slots, window, ring_dtype, capacity):
    return shard_ring(step.init_batched_ring(cfg, n_slots, window, ring_dtype, capacity),
                      self.plan)

  def inject(self, params, ring, features, positions, n_valid, *, impl):
    return inject_slots(self.plan, params, ring, features, positions, n_valid, impl=impl)

  def draft_round(self, params, ring, new_features, n_new, id_last, n_past, active, *, width,
                  impl, temperature=0.0, key=None):
    ring, _, logits = draft_round_slots(self.plan, params, ring, new_features, n_new, id_last,
                                        n_past, active, width=width, impl=impl)
    # DFlash's readout needs only the gathered logits (shard_params admits no other family).
    return ring, step.dflash_readout(params, impl, logits, None, id_last, temperature, key)

  def place(self, tree):
    return _slot_arrays(self.plan, tree)


@dataclasses.dataclass(frozen=True)
class ShardedTarget:
  """A Qwen3-family target (`qwen3.TargetConfig`) on a mesh, as a `Target` (models/base.py):
  the config facts and commit are the inner config's; init_cache places the cache (batch
  over `slots`'s axis, kv heads over `kv_heads`'s); prefill, verify and forward run every
  device's block of the weights inside `jax.shard_map` (the logits leave it vocab-sharded)."""
  inner: qwen3.TargetConfig
  plan: Plan

  def __post_init__(self):
    if not isinstance(self.inner, qwen3.TargetConfig):
      raise ValueError(f"sharding supports qwen3-family targets (qwen3.TargetConfig), got "
                       f"{type(self.inner).__name__}")

  def __getattr__(self, name):   # the config facts (vocab_size, hidden_size, ...)
    if name in ("inner", "plan"):
      raise AttributeError(name)
    return getattr(self.inner, name)

  @property
  def n_layers(self) -> int:
    return self.inner.n_layers

  def check_capture_layers(self, capture_layers):
    return self.inner.check_capture_layers(capture_layers)

  def init_cache(self, batch, capacity, dtype="fp32"):
    return shard_target_cache(self.inner.init_cache(batch, capacity, dtype), self.plan)

  def cache_nbytes(self, batch, capacity, dtype="fp32", verify_width=1):
    return self.inner.cache_nbytes(batch, capacity, dtype, verify_width)

  def commit(self, cache, n_keep):
    return self.inner.commit(cache, n_keep)

  def reset(self, cache, empty):
    return self.inner.reset(cache, empty)

  def _call(self, params, fn, args, arg_specs, out_specs):
    """Run fn(local params, local cfg, *args) on every device's block."""
    p_layout = _layout(self.plan, params, _target_counts(self.inner))
    cfg_local = local_target_config(self.inner, self.plan)

    def body(p, *a):
      return fn(_local_params(self.plan, p, p_layout), cfg_local, *a)
    return shard_call(self.plan, body, (_specs(p_layout), *arg_specs), out_specs)(params, *args)

  def forward(self, params, tokens, *, capture_layers=(), with_logits: bool = True):
    s = self.plan.rules.slots
    problems: dict = {}
    _leaf(self.plan, tokens, ("slots", None), "tokens", {}, problems, stored=False)
    _raise_problems(problems)

    def fn(p, lc, t):
      return qwen3.forward(p, lc, t, capture_layers=capture_layers, with_logits=with_logits)
    logits = P(s, None, _head_axis(self.plan, params.lm_head)) if with_logits else None
    return self._call(params, fn, (tokens,), (P(s),), (logits, P(s, None, None)))

  def prefill(self, params, cache, tokens, n_valid, *, capture_layers=(), impl: str = "xla"):
    s, c = self.plan.rules.slots, _specs(_layout(self.plan, cache))

    def fn(p, lc, cache, t, n):
      return qwen3.prefill(p, lc, cache, t, n, capture_layers=capture_layers, impl=impl)
    n_valid = jnp.broadcast_to(jnp.asarray(n_valid, jnp.int32), (tokens.shape[0],))
    return self._call(params, fn, (cache, tokens, n_valid), (c, P(s), P(s)),
                      (c, P(s, None, None)))

  def verify(self, params, cache, tokens, *, capture_layers=(), impl: str = "xla"):
    s, c = self.plan.rules.slots, _specs(_layout(self.plan, cache))

    def fn(p, lc, cache, t):
      return qwen3.verify(p, lc, cache, t, capture_layers=capture_layers, impl=impl)
    return self._call(params, fn, (cache, tokens), (c, P(s)),
                      (c, P(s, None, _head_axis(self.plan, params.lm_head)), P(s, None, None)))


def shard_models(models, plan: Plan | Mesh):
  """`decode.Models` on the mesh: weights placed, the target a `ShardedTarget` and the
  drafter's calls a `MeshRun`, so decode's rounds run sharded with no change to the loop."""
  plan = as_plan(plan)
  drafter = None if models.drafter is None else shard_params(models.drafter, plan)
  d2t = None if models.d2t is None else jax.device_put(models.d2t, NamedSharding(plan.mesh, P()))
  return models.replace(target=shard_target(models.target, models.target_cfg, plan),
                        drafter=drafter, d2t=d2t, target_cfg=ShardedTarget(models.target_cfg, plan),
                        run=MeshRun(plan))


# --- inside the map ----------------------------------------------------------------------------

def _local_params(plan: Plan, tree, layout):
  """A device's block of sharded params as the unsharded functions take them: fused blocks
  [1, rows, K] -> [rows, K]; weights whose in axis is split wrapped in Reduced."""
  def local(l: _Leaf, a):
    return a[0] if l.segments is not None else a
  out = jax.tree.map(local, layout, tree, is_leaf=_is_leaf)

  def wrap(v, axes, path):
    mesh_axis = _mesh_axis(plan, axes[-1], path, len(axes) - 1)
    return v if mesh_axis is None or len(axes) != 2 else Reduced(w=v, axis=mesh_axis)
  return _map_leaves(out, wrap)


def local_drafter_config(cfg: DFlashConfig, plan: Plan) -> DFlashConfig:
  """The config of one device's block: heads and FFN columns divided by their split."""
  return dataclasses.replace(cfg, n_head=cfg.n_head // plan.size("q_heads"),
                             n_head_kv=cfg.n_head_kv // plan.size("kv_heads"),
                             n_ff=cfg.n_ff // plan.size("ffn"))


def local_target_config(cfg: qwen3.TargetConfig, plan: Plan) -> qwen3.TargetConfig:
  return dataclasses.replace(
      cfg, num_attention_heads=cfg.num_attention_heads // plan.size("q_heads"),
      num_key_value_heads=cfg.num_key_value_heads // plan.size("kv_heads"),
      intermediate_size=cfg.intermediate_size // plan.size("ffn"))


def shard_call(plan: Plan, fn, in_specs, out_specs):
  """fn run on every device's block (`jax.shard_map` over the plan's mesh; check_vma=False:
  the Pallas kernels carry no varying-axes rules). The one wrapper every entry point uses."""
  return jax.shard_map(fn, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)


def _head_axis(plan: Plan, head) -> str | None:
  """The mesh axis of an LM head's logits (None: the head is whole on every device)."""
  return None if head is None else plan.rules.vocab


def _check_slots(plan: Plan, ring: step.RingState, batched: bool) -> None:
  if (ring.batch_slots is not None) != batched:
    raise ValueError("this entry point takes a ring with a leading slot axis (init_ring's "
                     "leaves stacked per slot)" if batched else
                     "this entry point takes one ring (no slot axis); use draft_round_slots "
                     "for per-slot rings")
  if not batched and plan.size("slots") > 1:
    raise ValueError(f"one ring (no slot axis) cannot be split over {plan.rules.slots}="
                     f"{plan.size('slots')}: use a mesh with dp = 1 or draft_round_slots")


def _drafter_call(plan: Plan, params: DrafterParams, ring: step.RingState, fn, args, arg_specs,
                  out_extra_specs):
  """Run fn(local params, local ring, *args) -> (ring, *extra) on every device's block."""
  p_layout = _layout(plan, params, _drafter_counts(params.cfg))
  r_layout = _layout(plan, ring)
  cfg_local = local_drafter_config(params.cfg, plan)

  def body(p, r, *a):
    lp = _local_params(plan, p, p_layout).replace(cfg=cfg_local)
    return fn(lp, r, *a)
  r_specs = _specs(r_layout)
  return shard_call(plan, body, (_specs(p_layout), r_specs, *arg_specs),
                    (r_specs, *out_extra_specs))(params, ring, *args)


def _features_spec(plan: Plan, lead: tuple) -> P:
  return P(*lead, None, plan.rules.fc_in)


def block_step(plan: Plan, params: DrafterParams, ring: step.RingState, id_last, n_past, *,
               width: int | None = None, impl: str = "pallas") -> jax.Array:
  """`step.block_step` on the mesh (TP; one ring, dp = 1) -> logits [w, V] (vocab-sharded)."""
  _check_slots(plan, ring, batched=False)
  vocab = P(None, plan.rules.vocab)

  def fn(p, r, i, n):
    return r, step.block_step(p, r, i, n, width=width, impl=impl)
  _, logits = _drafter_call(plan, params, ring, fn, (id_last, n_past), (P(), P()), (vocab,))
  return logits


def draft_round(plan: Plan, params: DrafterParams, ring: step.RingState, new_features, n_new,
                id_last, n_past, *, width: int | None = None, impl: str = "pallas"):
  """`step.draft_round` on the mesh (TP; one ring, dp = 1) -> (ring, drafts [w-1], logits
  [w, V]); the drafts are the argmax of the vocab-sharded logits across devices."""
  _check_slots(plan, ring, batched=False)

  def fn(p, r, f, nn, i, n):
    r, _, logits = step.draft_round(p, r, f, nn, i, n, width=width, impl=impl)
    return r, logits
  ring, logits = _drafter_call(plan, params, ring, fn, (new_features, n_new, id_last, n_past),
                               (_features_spec(plan, ()), P(), P(), P()),
                               (P(None, plan.rules.vocab),))
  return ring, step.greedy_drafts(logits), logits


def draft_round_slots(plan: Plan, params: DrafterParams, ring: step.RingState, new_features,
                      n_new, id_last, n_past, active=None, *, width: int | None = None,
                      impl: str = "pallas"):
  """`step.draft_round_batched` on the mesh (DP over slots x TP): ring leaves with a leading
  slot axis S, new_features [S, R, F], n_new / id_last / n_past / active [S] (default: every
  slot active) -> (ring, drafts [S, w-1], logits [S, w, V])."""
  _check_slots(plan, ring, batched=True)
  s = plan.rules.slots
  if active is None:
    active = jnp.ones(jnp.shape(n_past), jnp.bool_)

  def fn(p, r, f, nn, i, n, a):
    r, _, logits = step.draft_round_batched(p, r, f, nn, i, n, a, width=width, impl=impl)
    return r, logits
  ring, logits = _drafter_call(plan, params, ring, fn,
                               (new_features, n_new, id_last, n_past, active),
                               (_features_spec(plan, (s,)), P(s), P(s), P(s), P(s)),
                               (P(s, None, plan.rules.vocab),))
  return ring, jax.vmap(step.greedy_drafts)(logits), logits


def inject_slots(plan: Plan, params: DrafterParams, ring: step.RingState, features, positions,
                 n_valid, *, impl: str = "pallas") -> step.RingState:
  """encode + `step.inject_batched` on the mesh: features [S, T, F] at positions [S, T], rows
  >= n_valid [S] writing nothing (decode's prompt prefill)."""
  _check_slots(plan, ring, batched=True)
  s = plan.rules.slots

  def fn(p, r, f, pos, n):
    return (step.inject_batched(p, r, step.encode(p, f, impl=impl), pos, n, impl=impl),)
  (ring,) = _drafter_call(plan, params, ring, fn, (features, positions, n_valid),
                          (_features_spec(plan, (s,)), P(s), P(s)), ())
  return ring


# Jitted entry points; the ring / cache is donated wherever it is returned.
block_step_jit = jax.jit(block_step, static_argnames=("plan", "width", "impl"))
draft_round_jit = jax.jit(draft_round, static_argnames=("plan", "width", "impl"),
                          donate_argnames=("ring",))
draft_round_slots_jit = jax.jit(draft_round_slots, static_argnames=("plan", "width", "impl"),
                                donate_argnames=("ring",))

