#!/usr/bin/env bash
# Device checks of the MXFP8-weight grouped GEMM (in-kernel conversion). Phases (args,
# default "smoke test bench", about 11 minutes at most): smoke (every variant once on the
# small ragged case: a deadlock shows up as a timeout), test (GPU tests), bench, san
# (compute-sanitizer memcheck, racecheck, synccheck on the small case). Builds nothing:
#   run(command="bash tools/gpu_check_w8.sh", carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
#   run(command="bash tools/gpu_check_w8.sh smoke san", carry=[...same...])
# Logs and the benchmark JSON land in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/w8_out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s); stamp() { echo "[gpu_check_w8] $1 at +$(( $(date +%s) - T0 ))s"; }

PHASES=" ${*:-smoke test bench} "
has() { [[ "$PHASES" == *" $1 "* ]]; }

if has smoke; then
timeout ${SMOKE_S:-60} python3 tools/sanitize_small.py > "$OUT/smoke.log" 2>&1; echo "smoke rc=$?"; tail -2 "$OUT/smoke.log"
stamp smoke
fi

if has test; then
timeout ${TEST_S:-420} python3 -m pytest -q -m gpu tests/test_grouped_gemm_w8_gpu.py --tb=short \
  -p no:cacheprovider --maxfail=10 -rf 2>&1 | tee "$OUT/pytest.log" | tail -25
stamp tests
fi

if has bench; then
timeout ${BENCH_S:-180} python3 benchmarks/bench_gemm_w8.py --out "$OUT/gemm_w8_h200.json" ${BENCH_ARGS:-} \
  > "$OUT/bench.log" 2>&1; tail -30 "$OUT/bench.log"
stamp bench
fi

has san && for tool in memcheck racecheck synccheck; do
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout ${SAN_S:-100} compute-sanitizer --tool $tool \
    --target-processes all python3 tools/sanitize_small.py > "$OUT/$tool.log" 2>&1
  echo "$tool rc=$?"; tail -3 "$OUT/$tool.log"
  stamp $tool
done
