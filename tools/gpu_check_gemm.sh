#!/usr/bin/env bash
# One device call for the grouped GEMM: GPU tests, the benchmark, compute-sanitizer
# memcheck on the small case, and one ncu profile. Builds nothing: carry the extension
#   run(command="bash tools/gpu_check_gemm.sh",
#       carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
# Logs and the benchmark JSON/PNG land in $OUT (at most 8 files).
set -o pipefail
OUT=${OUT:-/tmp/gemm_out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s); stamp() { echo "[gpu_check_gemm] $1 at +$(( $(date +%s) - T0 ))s"; }

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python3 -c 'import jax; print(jax.__version__, jax.devices())'; } > "$OUT/env.txt" 2>&1
stamp env

timeout ${TEST_S:-150} python3 -m pytest -q -m gpu tests/test_grouped_gemm_gpu.py --tb=short \
  -p no:cacheprovider --timeout=90 --maxfail=10 -rf 2>&1 | tee "$OUT/pytest.log" | tail -25
stamp tests

timeout ${BENCH_S:-150} python3 benchmarks/bench_grouped_gemm.py --out "$OUT/grouped_gemm_h200.json" \
  --plot ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1; tail -7 "$OUT/bench.log"
stamp bench

# One buffer per allocation, so memcheck sees the real bounds of every array.
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout ${SAN_S:-100} compute-sanitizer --tool memcheck \
  --target-processes all python3 -m pytest -q -m gpu tests/test_grouped_gemm_gpu.py \
  -k sanitizer -p no:cacheprovider > "$OUT/memcheck.log" 2>&1; tail -4 "$OUT/memcheck.log"
stamp memcheck

timeout ${NCU_S:-90} ncu --clock-control none -k regex:GroupedGemm --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
  python3 benchmarks/bench_grouped_gemm.py --shapes nano_fc1 --skip-ragged --iters 1 \
  --out /tmp/ncu_bench.json > "$OUT/ncu.log" 2>&1
grep -E "Duration|Throughput|Registers|Achieved Occupancy|Max Bandwidth|L2 Hit|DRAM Throughput|SM Busy" "$OUT/ncu.log" | head -20
stamp ncu
