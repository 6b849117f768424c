#!/usr/bin/env bash
# Creates (once) and updates the project's virtual environment, then prints its python.
# Prefers Python 3.12 (the GPU machine runs 3.12 and jax 0.11.2), falls back to python3.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  py=""
  for cand in "python3.12" "env PYENV_VERSION=3.12.1 python3.12" "python3"; do
    if $cand -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' >/dev/null 2>&1; then
      py="$cand"; break
    fi
  done
  [ -n "$py" ] || { echo "no Python >= 3.11 found" >&2; exit 1; }
  $py -m venv "$VENV" >&2
fi
stamp="$VENV/.installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test,bench,kernels,docs]" >&2
  touch "$stamp"
fi
echo "$VENV/bin/python"
