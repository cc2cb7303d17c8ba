"""Compiled programs kept on disk beside JAX's persistent compilation cache, found before tracing.

JAX's persistent cache skips XLA's compilation, but its key is the lowered module: every run
still traces and lowers each program before it can look the executable up. For the decoding
loop at Qwen3-8B shapes with the Pallas kernels that Python work is seconds (RESULTS.md,
"2026-12-05 session 25: where a cached start spends its time"). `call` keys a jitted call by
what fixes its program before tracing (the code, the versions, the device, the configuration,
the arguments' structure with every static field, their shapes, dtypes and placement, the
static arguments) and keeps the serialized executable in a folder `programs/` of the one JAX's
cache uses (`jax_compilation_cache_dir`; nothing is kept while that is unset, and `call` is the
jitted call itself). A later process with the same key loads the executable and runs it
without tracing or lowering anything. A program that cannot be kept or loaded on this machine
is noted as such and runs as jit does from then on (a warning says so), so the cost of trying
is paid once.

An executable is machine code for this machine's devices and runs with the process's rights:
the folder must be as trusted as JAX's own cache (it holds the same kind of data).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import io
import os
import pickle
import re
import secrets
import warnings
from typing import Any

import jax

from dflash_jax.io import atomic

SUBDIR = "programs"
_loaded: dict[Any, Any] = {}   # in-process: (function, structure, avals, statics) -> executable
_last: dict[Any, Any] = {}     # (function, statics) -> (structure, executable) of its last call


def folder() -> str | None:
  """Where programs are kept: `programs/` in JAX's compilation cache folder, or None (unset)."""
  where = jax.config.values.get("jax_compilation_cache_dir")
  if not where or not jax.config.values.get("jax_enable_compilation_cache", True):
    return None
  return os.path.join(where, SUBDIR)


@functools.cache
def code_digest() -> str:
  """sha256 over the path and bytes of every .py file of the packages programs are traced
  from (this one and pallas_kernels): a change to any of them is a new key."""
  import pallas_kernels
  h = hashlib.sha256()
  for pkg in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
              os.path.dirname(os.path.abspath(pallas_kernels.__file__))):
    for d, dirs, files in os.walk(pkg):
      dirs.sort()
      for f in sorted(files):
        if f.endswith(".py"):
          path = os.path.join(d, f)
          h.update(os.path.relpath(path, os.path.dirname(pkg)).encode())
          with open(path, "rb") as fh:
            h.update(fh.read())
  return h.hexdigest()


def _environment() -> str:
  """What else decides the program: versions, devices, XLA's flags, JAX's configuration."""
  import jaxlib
  devs = jax.devices()
  config = {k: v for k, v in jax.config.values.items() if "cache" not in k}
  return repr((jax.__version__, jaxlib.__version__, devs[0].client.platform,
               devs[0].client.platform_version, [d.device_kind for d in devs],
               jax.process_count(), os.environ.get("XLA_FLAGS", ""), sorted(config.items())))


def _aval(x) -> tuple:
  a = jax.typeof(x)
  sharding = x.sharding if isinstance(x, jax.Array) else None
  return (a.shape, str(a.dtype), getattr(a, "weak_type", False), sharding)


def signature(fun, static: dict[str, Any], args: dict[str, Any]) -> tuple:
  """What picks a call's program in this process: the function, the arguments' structure
  (with every static field of their pytrees), each leaf's shape, dtype, weak type and
  sharding, and the static arguments."""
  leaves, tree = jax.tree.flatten(args)
  return (fun, tree, tuple(_aval(x) for x in leaves), tuple(sorted(static.items())))


def key(name: str, sig: tuple) -> str | None:
  """The file key of a call's program: its signature (the function by its role `name`) with
  the code digest and the environment; None when a static value prints its address (an
  object without a repr of its fields, e.g. a custom proposer), which no later process
  could match: such a program is compiled in each process, as jit does."""
  _, tree, avals, statics = sig
  text = repr((name, code_digest(), _environment(), str(tree), avals, statics))
  if re.search(r" at 0x[0-9a-fA-F]+>", text):
    return None
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def call(fun, name: str, static: dict[str, Any], **args):
  """fun(**static, **args) for `fun` a `jax.jit` function whose static arguments are those
  named in `static`, through the kept executable when JAX's cache folder is set (see the
  module's docstring; donation is the executable's own, as in `fun`). name: the program's
  role, the prefix of its file name."""
  where = folder()
  if where is None:
    return fun(**static, **args)
  statics = tuple(sorted(static.items()))
  tree = jax.tree.structure(args)
  last = _last.get((fun, statics))
  if last is not None and last[0] == tree:
    # The host loops call one program again and again: the executable checks the arguments'
    # types and shardings itself (before it donates anything), which costs what a jit call
    # does, where the full signature costs milliseconds at 8B's hundreds of leaves.
    try:
      return last[1](**args)
    except (TypeError, ValueError):   # other shapes, dtypes or shardings: look it up
      pass
  sig = signature(fun, static, args)
  exe = _loaded.get(sig)
  if exe is None:
    k = key(name, sig)
    exe = _loaded[sig] = (functools.partial(fun, **static) if k is None
                          else _load_or_compile(fun, static, args, where, name, k))
  _last[(fun, statics)] = (tree, exe)
  return exe(**args)


# An executable that JAX's cache loaded cannot always be serialized again (on CPU the copy lost
# its fused functions: "Function ... not found" when it ran), so a program is kept only from a
# compilation of its own. When JAX's cache holds the program already (kept by an older tree,
# or our file went missing), the compilation is repeated with a debug option set to a value of
# its own: it changes JAX's cache key (which keeps that option; it drops the dump options) and
# nothing in the code XLA generates (it bounds a debug listing of buffers). That one entry of
# JAX's cache is never read again.
_NONCE_OPTION = "xla_debug_buffer_assignment_show_max"
_CACHE_HITS = "/jax/compilation_cache/cache_hits"
_hits = [0]


def _count_hits(event: str, **kw) -> None:
  if event == _CACHE_HITS:
    _hits[0] += 1


jax.monitoring.register_event_listener(_count_hits)


def _fresh(lowered):
  """lowered compiled by XLA in this process, not returned by JAX's cache."""
  before = _hits[0]
  exe = lowered.compile()
  if _hits[0] == before:
    return exe
  return lowered.compile(compiler_options={_NONCE_OPTION: 1000 + secrets.randbelow(1 << 30)})


def _load_or_compile(fun, static: dict, args: dict, where: str, name: str, k: str):
  """The executable from `where`'s file for (name, key k), else compiled and kept there; or
  `fun` itself (jit, through JAX's cache) for a program that cannot be kept or loaded here.
  Such a program leaves a note in place of its file (`.unkept`, with the reason) so that no
  later process pays for a compilation of its own again; a warning names it each time. File
  names carry the code digest's first characters: keeping a program (or its note) removes
  the files of other code, so the folder holds only what this code can use."""
  from jax.experimental import serialize_executable as se
  code = code_digest()[:12]
  path = os.path.join(where, f"{name}-{code}-{k}.bin")
  note = path[:-len(".bin")] + ".unkept"
  jitted = functools.partial(fun, **static)
  if os.path.isfile(note):
    with open(note) as f:
      why = f.read().strip()
    warnings.warn(f"{name}: not kept on disk here ({why}); it is compiled through JAX's cache "
                  f"in each process (remove {note} to try again)", RuntimeWarning, stacklevel=3)
    return jitted
  if os.path.isfile(path):
    try:
      with open(path, "rb") as f:
        device_ids, blob, trees = pickle.load(f)
      by_id = {d.id: d for d in jax.devices()}
      devices = [by_id[i] for i in device_ids]
      in_tree, out_tree = se._JaxPjrtUnpickler(io.BytesIO(trees), devices[0].client,
                                               devices).load()
      _mosaic_gpu_runtime()
      return se.deserialize_and_load(blob, in_tree, out_tree, execution_devices=devices)
    except Exception as e:   # a damaged or foreign file, or one this machine cannot load
      _leave_note(where, code, path, note, f"cannot load the kept program: "
                  f"{type(e).__name__}: {e}")
      return jitted
  exe = _fresh(fun.lower(**static, **args))
  # The devices the executable runs on, in its device assignment's order (a one-device
  # program on a host of several must be loaded onto its one device).
  device_ids = [d.id for d in exe._executable.xla_executable.local_devices()]
  try:
    blob, in_tree, out_tree = se.serialize(exe)
    with io.BytesIO() as f:   # the trees' static fields may hold devices (a mesh): as ids
      se._JaxPjrtPickler(f).dump((in_tree, out_tree))
      trees = f.getvalue()
    data = pickle.dumps((device_ids, blob, trees))
  except (ValueError, NotImplementedError, TypeError, pickle.PicklingError) as e:
    _leave_note(where, code, path, note, f"cannot serialize it: {type(e).__name__}: {e}")
    return exe
  _write(where, code, path, data)
  return exe


def _mosaic_gpu_runtime() -> None:
  """Name Mosaic GPU's runtime library to its custom call before an executable is loaded.
  A Mosaic GPU kernel's host side is JIT-compiled when its executable is loaded, linked
  against the library that MOSAIC_GPU_RUNTIME_LIB_PATH names; jax sets that variable when
  its Mosaic GPU module is imported, which tracing a kernel does and loading does not, so a
  process that loads before it traces fails ("Failed to materialize symbols: {
  kernel_mosaic_gpu ...}")."""
  if jax.default_backend() != "gpu":
    return
  try:
    importlib.import_module("jax.experimental.mosaic.gpu")   # sets the variable
  except ImportError:   # no Mosaic GPU bindings: no executable here holds such a kernel
    pass


def _leave_note(where: str, code: str, path: str, note: str, why: str) -> None:
  warnings.warn(f"{path}: {why}; from now on it is compiled through JAX's cache in each "
                f"process (remove {note} to try again)", RuntimeWarning, stacklevel=4)
  with contextlib.suppress(FileNotFoundError):
    os.unlink(path)
  _write(where, code, note, why.encode())


def _write(where: str, code: str, path: str, data: bytes) -> None:
  """path's bytes written whole, then the files of other code removed (whatever their role:
  no process of this code can load them)."""
  os.makedirs(where, exist_ok=True)
  with atomic.replacing(path) as tmp:
    with open(tmp, "wb") as f:
      f.write(data)
  for old in os.listdir(where):
    parts = old.split("-")
    if len(parts) == 3 and parts[1] != code and old.endswith((".bin", ".unkept")):
      with contextlib.suppress(FileNotFoundError):   # another process may remove it first
        os.unlink(os.path.join(where, old))
