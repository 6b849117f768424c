#!/usr/bin/env bash
# Creates (once) and updates .venv-oldest-jax, then prints its python: the oldest jax and
# jaxlib the package supports (the floor of pyproject.toml's "jax>=" requirement) and the
# test dependencies, under python3. The package itself is not installed (the tests run
# from the source tree with PYTHONPATH=.), so nothing rebuilds the kernels or touches
# .venv; and a Python other than the extension's leaves the CPU tests on the pure-JAX
# path they take anyway. Used by `make test-oldest-jax` (tests/conftest.py OLDEST_JAX).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-oldest-jax}"
PY="${PYTHON:-python3}"
floor=$($PY - <<'PYEOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
floors = [m.group(1) for d in deps if (m := re.match(r"jax\s*>=\s*([0-9.]+)", d))]
if len(floors) != 1:
    raise SystemExit(f"expected one 'jax>=X' requirement in pyproject.toml, got {deps}")
print(floors[0])
PYEOF
)
[ -x "$VENV/bin/python" ] || $PY -m venv "$VENV" >&2
stamp="$VENV/.installed-jax-$floor"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "jax==$floor" "jaxlib==$floor" \
    "numpy" "flax>=0.11" "optax>=0.2" "pytest>=8" "pytest-xdist>=3" "flatbuffers>=24" >&2
  "$VENV/bin/python" -c "import jax, sys; assert jax.__version__ == '$floor', jax.__version__" >&2
  rm -f "$VENV"/.installed-jax-*; touch "$stamp"
fi
echo "$VENV/bin/python"
