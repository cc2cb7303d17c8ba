import warnings

import jax
import pytest

# Pallas Triton is deprecated upstream but is the pallas_call GPU backend in jax 0.11.2.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated",
                        category=DeprecationWarning)

ON_GPU = jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 with `pytest -m gpu`)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
