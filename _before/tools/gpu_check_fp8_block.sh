#!/usr/bin/env bash
# One device call for the FP8 block-scaled grouped GEMM (docs/notes/2026-12-02-fp8-block-kernel.md):
# its GPU tests, the benchmark next to the bf16 kernel, compute-sanitizer memcheck and
# racecheck on the small case. Builds nothing: carry the extension
#   run(command="bash tools/gpu_check_fp8_block.sh",
#       carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
# Logs and the benchmark JSON land in $OUT.
source "$(dirname "$0")/gpu_common.sh" gpu_check_fp8_block /tmp/fp8_out

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python3 -c 'import jax; print(jax.__version__, jax.devices())'; } > "$OUT/env.txt" 2>&1
stamp env

timeout ${TEST_S:-240} python3 -m pytest -q -n 0 tests/test_grouped_gemm_fp8_block_gpu.py --tb=short \
  -p no:cacheprovider --timeout=120 --maxfail=20 -rf 2>&1 | tee "$OUT/pytest.log" | tail -30
stamp tests

timeout ${BENCH_S:-150} python3 benchmarks/bench_fp8_block_gemm.py --out "$OUT/fp8_block_gemm_h200.json" \
  --rounds ${ROUNDS:-3} ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1; tail -12 "$OUT/bench.log"
stamp bench

# One buffer per allocation, so memcheck sees the real bounds of every array.
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout ${SAN_S:-120} compute-sanitizer --tool memcheck \
  --target-processes all python3 -m pytest -q -n 0 tests/test_grouped_gemm_fp8_block_gpu.py \
  -k sanitizer -p no:cacheprovider > "$OUT/memcheck.log" 2>&1; tail -4 "$OUT/memcheck.log"
stamp memcheck

XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout ${RACE_S:-80} compute-sanitizer --tool racecheck \
  --target-processes all python3 -m pytest -q -n 0 tests/test_grouped_gemm_fp8_block_gpu.py \
  -k sanitizer -p no:cacheprovider > "$OUT/racecheck.log" 2>&1; tail -4 "$OUT/racecheck.log"
stamp racecheck
