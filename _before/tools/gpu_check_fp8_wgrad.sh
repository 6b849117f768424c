#!/usr/bin/env bash
# One device call for the FP8 block-scaled weight gradient (docs/notes/2026-12-04-fp8-wgrad.md):
# its GPU tests (every variant, the layout kernel, the op with the FP8 weight gradient on
# and off), the benchmark against the bf16 kernel, compute-sanitizer memcheck and
# racecheck on the small cases. Builds nothing: carry the extension
#   run(command="bash tools/gpu_check_fp8_wgrad.sh",
#       carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
# Logs and the benchmark JSON (and PNG) land in $OUT.
source "$(dirname "$0")/gpu_common.sh" gpu_check_fp8_wgrad /tmp/fp8_wgrad_out

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python3 -c 'import jax; print(jax.__version__, jax.devices())'; } > "$OUT/env.txt" 2>&1
stamp env

timeout ${TEST_S:-240} python3 -m pytest -q -n 0 -m gpu tests/test_grouped_wgrad_fp8_block_gpu.py tests/test_fp8_block.py \
  --tb=short -p no:cacheprovider --timeout=150 --maxfail=10 -rf 2>&1 | tee "$OUT/pytest.log" | tail -20
stamp tests

timeout ${BENCH_S:-120} python3 benchmarks/bench_wgrad.py --fp8-block --shapes ${SHAPES:-moe8,ep_share,nano} --alphas inf \
  --rounds ${ROUNDS:-3} --iters 10 --plot --out "$OUT/wgrad_fp8_block_h200.json" > "$OUT/bench.log" 2>&1; tail -14 "$OUT/bench.log"
stamp bench

# One buffer per allocation, so memcheck sees the real bounds of every array.
for tool in memcheck racecheck; do
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout ${SAN_S:-150} compute-sanitizer --tool $tool --target-processes all \
    python3 -m pytest -q -n 0 tests/test_grouped_wgrad_fp8_block_gpu.py -k "sanitizer or token_major" \
    -p no:cacheprovider > "$OUT/$tool.log" 2>&1; tail -3 "$OUT/$tool.log"
  stamp $tool
done
