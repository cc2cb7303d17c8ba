import gc
import importlib.util
import os
import warnings

# Without a CUDA plugin (the CPU suite, CI): XLA's LLVM optimization level 0 and no expensive
# LLVM passes. Compiling dominates these tiny programs (level 0 cuts the suite's CPU time by
# about a quarter); both sides of every comparison compile with the same flags, and the
# subprocess tests inherit them. Set before jax starts a backend. A machine with a CUDA plugin
# keeps XLA's defaults: its GPU tests compile as users' programs do.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
  os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS"), FAST_COMPILE) if f)

# Under pytest-xdist (the GPU suite's `-n 6 --dist loadfile`) the workers share one GPU: each
# allocates what it uses instead of XLA's default 75% of the memory up front.
if os.environ.get("PYTEST_XDIST_WORKER"):
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# The CLI's persistent compilation cache stays off in tests that call it in-process (one cache
# setting per process; tests/test_cli.py runs the cache in subprocesses of its own).
os.environ["DFLASH_JAX_COMPILE_CACHE"] = "off"

import jax  # noqa: E402
import pytest  # noqa: E402

import dflash_jax as dfj  # noqa: E402
from reference import DFlashRef  # noqa: E402

# Pallas Triton is deprecated upstream but is the pallas_call GPU backend in jax 0.11.2.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated",
                        category=DeprecationWarning)

ON_GPU = jax.default_backend() == "gpu"


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops each module's compiled programs when it ends: one process runs the whole CPU suite
  (CI: 2 cores, 24 GB), and the programs of a thousand tests held to the end exhausted that
  machine's memory (XLA crashed inside a later compile)."""
  yield
  jax.clear_caches()
  gc.collect()


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 with `pytest -m gpu`)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


# The seed drafter's dims for the GPU step tests (test_step.py, test_step_shapes_gpu.py). Host
# work (random weights, the numpy reference) dominates those tests, so each module makes these
# once.
@pytest.fixture(scope="module")
def seed_w():
  return dfj.synthetic_drafter(dfj.SEED_CONFIG, seed=0, n_vocab=8192)


@pytest.fixture(scope="module")
def seed_feats():
  return dfj.synthetic_features(dfj.SEED_CONFIG, 3100, seed=1)   # more than any ring there


@pytest.fixture(scope="module")
def seed_ref_bf16(seed_w):
  return DFlashRef(dfj.SEED_CONFIG, seed_w, dtype="bf16", ring_dtype="bf16")
