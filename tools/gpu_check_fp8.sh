#!/usr/bin/env bash
# One device call for the MXFP8 FP8-wgmma GEMM prototype (strategy 1): a smoke test,
# the GPU tests, the strategy benchmark, compute-sanitizer memcheck and racecheck on the
# small case, and one ncu profile of the FP8 kernel (NCU_SHAPE, default moe8). Builds
# nothing: carry the extension
#   run(command="bash tools/gpu_check_fp8.sh",
#       carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
# Logs and the benchmark JSON land in $OUT. Step limits (s) sum to 570, under the
# 600 s of one device command; SKIP="memcheck racecheck ncu" skips steps.
set -o pipefail
OUT=${OUT:-/tmp/fp8_out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s); stamp() { echo "[gpu_check_fp8] $1 at +$(( $(date +%s) - T0 ))s"; }
TESTS=tests/test_grouped_gemm_fp8_gpu.py
skip() { [[ " ${SKIP:-} " == *" $1 "* ]]; }

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python3 -c 'import jax; print(jax.__version__, jax.devices())'; } > "$OUT/env.txt" 2>&1
stamp env

# Smoke first: a new kernel that hangs is killed here after 60 s.
if ! skip smoke; then
  timeout ${SMOKE_S:-60} python3 -m pytest -q -m gpu $TESTS -k sanitizer --tb=short -p no:cacheprovider \
    2>&1 | tee "$OUT/smoke.log" | tail -5
  rc=$?
  stamp smoke
  if [ $rc -eq 124 ]; then echo "[gpu_check_fp8] smoke test timed out (a hang?): stopping"; exit 1; fi
fi

if ! skip tests; then
  timeout ${TEST_S:-150} python3 -m pytest -q -m gpu $TESTS --tb=short \
    -p no:cacheprovider --timeout=90 --maxfail=10 -rf 2>&1 | tee "$OUT/pytest.log" | tail -25
  stamp tests
fi

if ! skip bench; then
  timeout ${BENCH_S:-150} python3 benchmarks/bench_mxfp8_strategies.py --out "$OUT/mxfp8_strategies_h200.json" \
    ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1; tail -7 "$OUT/bench.log"
  stamp bench
fi

if ! skip memcheck; then
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout ${SAN_S:-80} compute-sanitizer --tool memcheck \
    --target-processes all python3 -m pytest -q -m gpu $TESTS -k sanitizer -p no:cacheprovider \
    > "$OUT/memcheck.log" 2>&1; tail -4 "$OUT/memcheck.log"
  stamp memcheck
fi

if ! skip racecheck; then
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout ${RACE_S:-60} compute-sanitizer --tool racecheck \
    --target-processes all python3 -m pytest -q -m gpu $TESTS -k sanitizer -p no:cacheprovider \
    > "$OUT/racecheck.log" 2>&1; tail -4 "$OUT/racecheck.log"
  stamp racecheck
fi

if ! skip ncu; then
  timeout ${NCU_S:-70} ncu --clock-control none -k regex:GroupedGemmFp8 --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section InstructionStats --section MemoryWorkloadAnalysis \
    python3 benchmarks/bench_mxfp8_strategies.py --shapes ${NCU_SHAPE:-moe8} --iters 1 \
    --out /tmp/ncu_bench.json > "$OUT/ncu.log" 2>&1
  grep -E "Duration|Throughput|Achieved Occupancy|Issue Slots Busy|Warp Cycles Per Issued|Executed Ipc|Stall|Bank" "$OUT/ncu.log" | head -24
  stamp ncu
fi
