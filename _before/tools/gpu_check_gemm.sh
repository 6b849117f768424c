#!/usr/bin/env bash
# One device call for the grouped GEMM: GPU tests, the benchmark, compute-sanitizer
# memcheck and racecheck on the small case, and one ncu profile (NCU_SHAPE, default moe8). Builds nothing: carry the extension
#   run(command="bash tools/gpu_check_gemm.sh",
#       carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
# Logs and the benchmark JSON/PNG land in $OUT (at most 8 files).
source "$(dirname "$0")/gpu_common.sh" gpu_check_gemm /tmp/gemm_out

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

XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout ${RACE_S:-60} compute-sanitizer --tool racecheck \
  --target-processes all python3 -m pytest -q -m gpu tests/test_grouped_gemm_gpu.py \
  -k sanitizer -p no:cacheprovider > "$OUT/racecheck.log" 2>&1; tail -4 "$OUT/racecheck.log"
stamp racecheck

timeout ${NCU_S:-90} ncu --clock-control none -k regex:GroupedGemm --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats --section ComputeWorkloadAnalysis \
  python3 benchmarks/bench_grouped_gemm.py --shapes ${NCU_SHAPE:-moe8} --skip-ragged --iters 1 \
  --out /tmp/ncu_bench.json > "$OUT/ncu.log" 2>&1
grep -E "Duration|Throughput|Achieved Occupancy|L2 Hit|DRAM Throughput|Issue Slots Busy|Warp Cycles Per Issued|Executed Ipc" "$OUT/ncu.log" | head -20
stamp ncu
