#!/usr/bin/env bash
# One device call for the quantize / dequantize kernels (the fp8_block pair, tile, tile_t and row
# quantizers, the MXFP8 column dequantizer) and the FP8 weight gradient's default variant:
# their GPU tests, compute-sanitizer memcheck and racecheck on the small cases, and
# benchmarks/bench_quantize.py. Builds nothing: carry the extension,
#   run(command="bash tools/gpu_check_quantize.sh",
#       carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
# With BASELINE_SO=path (an extension built from another commit, carried too) the
# benchmark runs twice more, baseline then this build again, so the two can be compared
# from one machine (quantize_baseline.json, quantize_new2.json). Logs and JSON land in $OUT.
source "$(dirname "$0")/gpu_common.sh" gpu_check_quantize /tmp/quantize_out
SO=jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so

# (test_fp8_block.py and test_prepared_weights.py: the op with the FP8 weight gradient on by
# default and the forward's K-major weight copies, bitwise against prepared weights.)
timeout ${TEST_S:-300} python3 -m pytest -q -n 0 -m gpu tests/test_quantize_fp8_block_gpu.py tests/test_dequantize_gpu.py \
  tests/test_grouped_wgrad_fp8_block_gpu.py tests/test_fp8_block.py tests/test_prepared_weights.py \
  --tb=short -p no:cacheprovider --timeout=150 --maxfail=10 -rf 2>&1 \
  | tee "$OUT/pytest.log" | tail -6
stamp tests

bench() {  # $1: output name
  timeout ${BENCH_S:-90} python3 benchmarks/bench_quantize.py --shapes ${SHAPES:-moe32,nano} --rounds ${ROUNDS:-3} \
    --out "$OUT/$1.json" ${PLOT:+--plot} > "$OUT/$1.log" 2>&1; tail -${TAIL:-9} "$OUT/$1.log"
}
PLOT=1 bench quantize_h200
if [ -n "$BASELINE_SO" ]; then
  cp "$SO" /tmp/new_kernels.so && cp "$BASELINE_SO" "$SO" && bench quantize_baseline
  cp /tmp/new_kernels.so "$SO" && bench quantize_new2
fi
stamp bench

# One buffer per allocation, so memcheck sees the real bounds of every array.
for tool in memcheck racecheck; do
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout ${SAN_S:-100} compute-sanitizer --tool $tool --target-processes all \
    python3 -m pytest -q -n 0 tests/test_quantize_fp8_block_gpu.py tests/test_dequantize_gpu.py tests/test_grouped_wgrad_fp8_block_gpu.py \
    -k "special_values or row_alone or sanitizer or k_major or token_major_kernel or pair_token_major" -p no:cacheprovider > "$OUT/$tool.log" 2>&1; tail -3 "$OUT/$tool.log"
  stamp $tool
done
