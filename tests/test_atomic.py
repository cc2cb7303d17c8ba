"""dflash_jax.io.atomic: a destination is replaced whole or not at all."""
import json
import os

import pytest

from dflash_jax.io import atomic


def test_replacing_commits_on_success_and_leaves_nothing_on_error(tmp_path):
  path = tmp_path / "config.json"
  atomic.write_json(path, {"a": [1, 2]})
  assert json.loads(path.read_text()) == {"a": [1, 2]} and path.read_text().endswith("\n")
  with pytest.raises(RuntimeError, match="half way"):
    with atomic.replacing(path) as tmp:
      assert os.path.dirname(tmp) == str(tmp_path) and os.path.basename(tmp).startswith(".")
      with open(tmp, "w") as f:
        f.write('{"a": ')
      raise RuntimeError("half way")
  assert json.loads(path.read_text()) == {"a": [1, 2]}   # the old file, whole
  assert os.listdir(tmp_path) == ["config.json"]         # no temporary file left
  with pytest.raises(TypeError):
    atomic.write_json(path, {"a": object()})
  assert json.loads(path.read_text()) == {"a": [1, 2]}
  atomic.write_text(path, "new\n")
  assert path.read_text() == "new\n" and os.listdir(tmp_path) == ["config.json"]
