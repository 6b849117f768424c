#!/usr/bin/env bash
# One device call for issue 20's skew work: the GEMM GPU tests (the partial-tile boundary
# cases included), the per-part skew table with partial tiles of chosen heights, and the
# `_qw` tile cost against the tokens a tile holds. Builds nothing: carry the extension
#   run(command="bash tools/gpu_check_skew.sh",
#       carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
# About 7 minutes on an H200. Logs and JSON land in $OUT (at most 8 files); what they
# answer is in docs/notes/2026-12-02-skew.md, "Session 34".
source "$(dirname "$0")/gpu_common.sh" gpu_check_skew /tmp/skew_out

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python3 -c 'import jax; print(jax.__version__, jax.devices())'; } > "$OUT/env.txt" 2>&1
stamp env

timeout ${TEST_S:-200} python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider --tb=short -rf \
  tests/test_grouped_gemm_gpu.py tests/test_grouped_gemm_fc1_gpu.py tests/test_grouped_gemm_dgrad_gpu.py \
  tests/test_grouped_gemm_fp8_block_gpu.py tests/test_grouped_gemm_fp8_block_fc1_gpu.py \
  > "$OUT/pytest.log" 2>&1; tail -4 "$OUT/pytest.log"
stamp tests

timeout ${PARTS_S:-150} python3 benchmarks/bench_step_parts.py --shape nano --alpha inf,1 --round-to 128 \
  --alternating 320/448,257/511,383/385 --parts "gemm|fused|qw" --rounds 2 --samples 3 \
  --out "$OUT/step_parts_partial_tiles.json" > "$OUT/step_parts.log" 2>&1; tail -12 "$OUT/step_parts.log"
stamp step_parts

timeout ${QW_S:-150} python3 benchmarks/bench_qw_tile_cost.py --out "$OUT/qw_tile_cost.json" \
  > "$OUT/qw_tile_cost.log" 2>&1; tail -20 "$OUT/qw_tile_cost.log"
stamp qw_tile_cost
