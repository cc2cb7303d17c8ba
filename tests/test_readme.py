"""Every ```python block of README.md runs as written: in file order, in one namespace, in a
fresh working folder, so the documentation cannot drift from the code. A block whose first line
is `# skip-ci: <reason>` is skipped, visibly (it is counted and reported); nothing else is."""
from __future__ import annotations

import pathlib
import re
import tempfile

import pytest

import reference  # noqa: F401  (imported from the checkout before the test leaves it)

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
SKIP = re.compile(r"# skip-ci: \S")
FENCE = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.S | re.M)
# Usage has 4 runnable blocks and Checkpoints 1; sections may add more, never fewer.
MIN_BLOCKS = 5


def _blocks() -> list[tuple[int, str]]:
  """(first code line number, code) of every ```python block."""
  text = README.read_text(encoding="utf-8")
  blocks = [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]
  opened = len(re.findall(r"^```python[ \t]*$", text, re.M))
  assert opened == len(blocks), f"{opened} ```python fences but {len(blocks)} closed blocks"
  return blocks


def test_every_python_block_of_the_readme_runs(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)   # blocks write files (drafter.gguf) into a fresh folder
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # and their temporary files too
  namespace: dict = {"__name__": "__readme__"}
  ran, skipped = 0, []
  for line, code in _blocks():
    if SKIP.match(code):
      skipped.append(f"README.md:{line}: {code.splitlines()[0]}")
      continue
    # Pad so a traceback's line numbers are the README's.
    exec(compile("\n" * (line - 1) + code, str(README), "exec"), namespace)
    ran += 1
  with capsys.disabled():
    for s in skipped:
      print(f"\nskipped {s}")
  assert ran == len(_blocks()) - len(skipped)
  assert ran >= MIN_BLOCKS, f"only {ran} README blocks ran"


def test_skip_marker_needs_a_reason():
  for line, code in _blocks():
    first = code.splitlines()[0] if code.strip() else ""
    if first.startswith("# skip-ci"):
      assert SKIP.match(first), f"README.md:{line}: '# skip-ci: <reason>' needs a reason"


@pytest.mark.parametrize("text,n", [("```python\nx = 1\n```\n", 1),
                                    ("```python\nx = 1\n```\n```bash\nls\n```\n", 1),
                                    ("```python\n# skip-ci: needs a GPU\nx\n```\n", 1)])
def test_block_extraction(text, n):
  assert len(FENCE.findall(text)) == n
