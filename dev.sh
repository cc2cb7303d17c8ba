#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv (Python 3.12) on first use, installs the
# pinned dependencies, then runs the command.
#   ./dev.sh demo [args]    the main job: python -m dflash_jax demo (the shipped target + drafter)
#   ./dev.sh test [args]    the test suite (GPU tests are skipped without a GPU)
#   ./dev.sh bench [args]   python -m benchmarks.run (CPU smoke by default; --gpu on the H200)
set -euo pipefail
cd "$(dirname "$0")"

find_python312() {
  for cand in python3.12 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$cand"; return
    fi
  done
  if command -v pyenv >/dev/null 2>&1 || [ -x "$HOME/.pyenv/bin/pyenv" ]; then
    for v in $(ls "$HOME/.pyenv/versions" 2>/dev/null | grep '^3\.12' || true); do
      echo "$HOME/.pyenv/versions/$v/bin/python3"; return
    done
  fi
  echo "dev.sh: Python 3.12 is required (jax 0.11.2 needs >= 3.12) and none was found" >&2
  exit 1
}

if [ ! -x .venv/bin/python ]; then
  py=$(find_python312)
  "$py" -m venv .venv
fi
stamp=.venv/.installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"
  touch "$stamp"
fi

cmd=${1:-}
shift || true
case "$cmd" in
  demo)  exec .venv/bin/python -m dflash_jax demo "$@" ;;
  # worksteal: an idle worker takes queued tests from the busy one, so the suite's long tests
  # do not leave one worker running alone at the end.
  test)  exec .venv/bin/python -m pytest -q -n 2 --dist worksteal "$@" ;;
  bench) exec .venv/bin/python -m benchmarks.run "$@" ;;
  *) echo "usage: ./dev.sh demo|test|bench [args]" >&2; exit 2 ;;
esac
