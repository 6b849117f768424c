#!/usr/bin/env bash
# One device call (best on an H200) for issue 20's skew bars with the weight gradient's
# chosen tile order (session 39; docs/notes/2026-12-02-skew.md, "Session 39"). Builds
# nothing: carry the extension
#   run(command="JGM_COMMIT=<sha> bash tools/gpu_skew_bars.sh",
#       carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
# STEPS (default "sanitize wgrad step") picks what runs, in this order:
#   sanitize  compute-sanitizer memcheck and racecheck on the weight gradient's small
#          cases, each tile order forced (its dynamic order was never sanitized)
#   wgrad  the weight gradients, chosen order next to both forced ones, in one process per
#          shape: ep_share and moe32 (where the choice takes the dynamic order from
#          Dirichlet(1) on; measured on an H100 in session 39) and moe8 (stays static)
#   step   the Nano step of every recipe at equal sizes, Dirichlet(1) and Dirichlet(0.3),
#          four router draws of each skew (--size-seeds), interleaved rounds: the bars
# About 9 minutes. Logs and JSON land in $OUT (8 files at most: this writes 8).
source "$(dirname "$0")/gpu_common.sh" gpu_skew_bars /tmp/skew_bars_out
STEPS=${STEPS:-sanitize wgrad step}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$OUT/env.txt" 2>&1

if [[ " $STEPS " == *" sanitize "* ]]; then
  for tool in memcheck racecheck; do  # (one buffer per allocation: memcheck sees each array's bounds)
    echo "== $tool" >> "$OUT/sanitize.log"
    XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout ${SAN_S:-90} compute-sanitizer --tool $tool \
      --target-processes all python3 -m pytest -q -m gpu tests/test_grouped_wgrad_gpu.py -k sanitizer \
      -p no:cacheprovider >> "$OUT/sanitize.log" 2>&1
    echo "== $tool"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitize.log" | tail -2
    stamp "$tool"
  done
fi

if [[ " $STEPS " == *" wgrad "* ]]; then
  for shape in ${WGRAD_SHAPES:-ep_share moe32 moe8}; do
    timeout ${WGRAD_S:-70} python3 benchmarks/bench_step_parts.py --shape "$shape" --alpha inf,1,0.3 \
      --parts '^wgrad' --rounds 4 --samples 3 --out "$OUT/wgrad_orders_$shape.json" > /tmp/wgrad_$shape.log 2>&1
    { echo "== $shape"; cat /tmp/wgrad_$shape.log; } >> "$OUT/wgrad.log"  # (one log: $OUT holds 8 files at most)
    echo "== $shape"; grep -E '^(part|wgrad)' /tmp/wgrad_$shape.log | tail -7
    stamp "wgrad $shape"
  done
fi

if [[ " $STEPS " == *" step "* ]]; then
  timeout ${STEP_S:-300} python3 benchmarks/bench_mlp.py --shapes nano \
    --only grouped_mlp_bf16,grouped_mlp_mxfp8,grouped_mlp_fp8_block,ragged_dot_bf16 \
    --alphas inf,1,0.3 --rounds 4 --iters 10 --size-seeds ${SIZE_SEEDS:-0,1,2,3} \
    --out "$OUT/mlp_step_skew_draws.json" > "$OUT/step.log" 2>&1
  grep -E 'over [0-9]+ draws' "$OUT/step.log" | tail -12
  stamp step
fi
