#!/usr/bin/env bash
# Installs a built wheel into a fresh virtual environment and runs the tests against
# the installed package, not the source tree (issue 21: the wheel needs no compiler,
# CUDA toolkit or nvidia-cutlass-dsl).
#
#   tools/check_wheel.sh [WHEEL] [PYTEST ARGS...]
#       WHEEL        default: the newest dist/*-cp<this python>-*manylinux*.whl
#       PYTEST ARGS  default: -q -m gpu  (the GPU suite; on a CPU machine: e.g. -q -m "not gpu" -k backend)
#   PYTHON=python3.12 tools/check_wheel.sh ...   the base interpreter (default python3;
#       a venv works too: its packages are made visible)
#
# The venv sees the base interpreter's site-packages (--system-site-packages: its jax,
# pytest, flax), so it works offline (the H200 has no network); the wheel goes in with
# --no-deps. Imports of cutlass / nvidia_cutlass_dsl are blocked in the venv, and the
# tests run from a copy of tests/ in a temporary directory, so nothing can come from
# the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
tag=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
wheel=""
if [ $# -gt 0 ] && [[ "$1" == *.whl ]]; then wheel=$1; shift; fi
[ -n "$wheel" ] || wheel=$(ls -t dist/*-"$tag"-*manylinux*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || { echo "no dist/*-$tag-*manylinux*.whl: run tools/build_wheel.sh first" >&2; exit 1; }
wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")
[ $# -gt 0 ] || set -- -q -m gpu

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
$PY -m venv --system-site-packages "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-deps --no-index --disable-pip-version-check "$wheel"
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# A base interpreter that is itself a venv: --system-site-packages does not reach its
# packages, so a .pth file does (they come after the venv's own, the wheel first).
$PY -c 'import sys, sysconfig; sys.prefix != sys.base_prefix and print(sysconfig.get_paths()["purelib"])' \
  > "$site/zz_base_site.pth"
cat > "$site/sitecustomize.py" <<'PY'
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cutlass", "nvidia_cutlass_dsl", "cutlass_dsl"):
            raise ImportError(f"{name} is blocked: the installed wheel must not need it")
        return None
sys.meta_path.insert(0, _Block())
PY
cp -r "$ROOT/tests" "$work/tests"
# Tests of the source tree itself (the build, tools/, benchmarks/, docs) have nothing
# to check in an installed wheel.
for t in test_build.py test_registry.py test_api_docs.py test_sass_diff.py test_xla_dump.py test_shapes.py test_bench_*.py; do
  rm -f "$work"/tests/$t
done
printf '[pytest]\nmarkers =\n    gpu: needs an NVIDIA GPU with the compiled kernels\naddopts = -ra\n' > "$work/pytest.ini"
cd "$work"
env -u PYTHONPATH "$work/venv/bin/python" - <<'PY'
import pathlib, jax_grouped_mlp as jgm
where = pathlib.Path(jgm.__file__).resolve()
assert "site-packages" in str(where), f"imported from {where}, not the installed wheel"
info = jgm.backend_info()
assert info.extension, "the installed wheel's extension did not load"
print(f"installed: {where.parent}\n{info}")
PY
paths=()
for a in "$@"; do [[ "$a" == tests* ]] && paths+=("$a"); done
[ ${#paths[@]} -gt 0 ] || set -- "$@" tests
env -u PYTHONPATH "$work/venv/bin/python" -m pytest -p no:cacheprovider "$@"
