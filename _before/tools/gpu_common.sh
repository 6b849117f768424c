# Sourced first by every tools/gpu_*.sh device script:
#   source "$(dirname "$0")/gpu_common.sh" NAME DEFAULT_OUT [keep-prealloc]
# Sets -o pipefail, OUT (DEFAULT_OUT unless the caller's environment sets it; created),
# PYTHONPATH=. and unbuffered output, XLA_PYTHON_CLIENT_PREALLOCATE=false unless
# keep-prealloc is given (scripts that measure device memory want XLA's default),
# stamp MSG ("[NAME] MSG at +Ns"), and stops (exit 3) before any GPU work when the
# carried extension was compiled against another jaxlib than the one running (e.g. after
# `make test` rebuilt it for this machine's CPU venv: it then registers no handler XLA
# accepts, and every test would fail at its first kernel).
set -o pipefail
OUT=${OUT:-$2}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
[ "${3:-}" = keep-prealloc ] || export XLA_PYTHON_CLIENT_PREALLOCATE=false
JGM_GPU_SCRIPT=$1
T0=$(date +%s); stamp() { echo "[$JGM_GPU_SCRIPT] $1 at +$(( $(date +%s) - T0 ))s"; }
python3 -c 'import jaxlib.version as v; from jax_grouped_mlp import _kernels as k
b = getattr(k, "JAXLIB_VERSION", "?"); assert b == v.__version__, f"extension built against jaxlib {b}, running {v.__version__}: rebuild it with the device jaxlib"' \
  || exit 3
