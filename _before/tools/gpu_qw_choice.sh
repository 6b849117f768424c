#!/usr/bin/env bash
# Device calls for the `_qw` GEMM's tile choice under router skew (issue 20's mxfp8 skew;
# docs/notes/2026-12-02-skew.md, sessions 43-47; it replaces tools/gpu_qw_mixed.sh). Builds nothing: carry the extension
#   run(command="JGM_COMMIT=<sha> STEPS='test sanitize choice' bash tools/gpu_qw_choice.sh",
#       carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
# STEPS picks what runs, in this order (default "test sanitize choice"; "bars" alone fills
# a second call):
#   test      the `_qw` GEMM's and the op's GPU tests (the mixed tiles included)
#   sanitize  compute-sanitizer memcheck on tools/sanitize_small.py (the mixed tiles included)
#   gemm      bench_gemm_qw.py at the Nano GEMMs, equal sizes and Dirichlet(1): every variant,
#             the mixed tiles and the device's choice, next to the plain kernel on the
#             pre-quantized weight (the ceiling) and the fake-quantize pass
#   choice    benchmarks/bench_qw_choice.py at the Nano GEMMs: every option of the call
#             (each tile alone, the mixed tiles, the device's choice) on equal sizes and
#             four router draws each of Dirichlet(3), (1), (0.3); the cost table fitted
#   step      the mxfp8 Nano step at equal sizes, Dirichlet(1) and (0.3), four router draws,
#             in one process (two processes, STEP_RUNS): the default choice, one tile only
#             (JGM_QW_MIXED_TILES=0) and session 43's cost table (--qw-table), interleaved
#             rounds (separate processes drift by ~2 %: docs/notes/2026-12-02-skew.md, "Session 47")
#   bars      the Nano step of every recipe (and ragged_dot) at equal sizes, Dirichlet(1)
#             and (0.3), four router draws each, interleaved rounds: issue 20's skew bars
source "$(dirname "$0")/gpu_common.sh" gpu_qw_choice /tmp/qw_choice_out
STEPS=${STEPS:-test sanitize choice}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [[ " $STEPS " == *" test "* ]]; then
  timeout ${TEST_S:-200} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_grouped_gemm_qw_gpu.py \
    tests/test_mlp_gpu.py > "$OUT/test.log" 2>&1
  tail -3 "$OUT/test.log"; stamp test
fi

if [[ " $STEPS " == *" sanitize "* ]]; then
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout ${SAN_S:-150} compute-sanitizer --tool memcheck \
    --target-processes all python3 tools/sanitize_small.py > "$OUT/sanitize.log" 2>&1
  echo "sanitize rc $?"; grep -E "ERROR SUMMARY" "$OUT/sanitize.log" | tail -2; stamp sanitize
fi

if [[ " $STEPS " == *" gemm "* ]]; then
  for alpha in inf 1; do
    timeout ${GEMM_S:-100} python3 benchmarks/bench_gemm_qw.py --shapes nano_fc1,nano_fc2 --alpha $alpha \
      --out "$OUT/gemm_qw_alpha$alpha.json" > /tmp/gemm_$alpha.log 2>&1
    echo "== alpha $alpha"; grep -E "default|mixed tiles|qw:" /tmp/gemm_$alpha.log
    stamp "gemm alpha $alpha"
  done
fi

if [[ " $STEPS " == *" choice "* ]]; then
  timeout ${CHOICE_S:-200} python3 benchmarks/bench_qw_choice.py --shapes nano_fc1,nano_fc2 \
    --alphas inf,3,1,0.3 --size-seeds 0,1,2,3 --rounds 2 --holdout 3 \
    --out "$OUT/qw_choice.json" > "$OUT/choice.log" 2>&1
  echo "choice rc $?"; grep -E "^==|current |mean regret" "$OUT/choice.log"; stamp choice
fi

if [[ " $STEPS " == *" step "* ]]; then
  for run in $(seq ${STEP_RUNS:-2}); do
    timeout ${STEP_S:-270} python3 benchmarks/bench_mlp.py --shapes nano \
      --only grouped_mlp_mxfp8,grouped_mlp_mxfp8_qw_one_tile,grouped_mlp_mxfp8_qw_table \
      --qw-table 192:0.42/0.42,256:0.49/0.49,384:0.727/0.58,launch:1.0 \
      --alphas inf,1,0.3 --size-seeds 0,1,2,3 --rounds 4 --iters 10 --out "$OUT/qw_step_ab_$run.json" > /tmp/step_$run.log 2>&1
    echo "== run $run rc $?"; grep -E "over [0-9]+ draws|^nano  " /tmp/step_$run.log
    stamp "step $run"
  done
fi

if [[ " $STEPS " == *" bars "* ]]; then
  timeout ${BARS_S:-420} python3 benchmarks/bench_mlp.py --shapes nano \
    --only grouped_mlp_bf16,grouped_mlp_mxfp8,grouped_mlp_fp8_block,ragged_dot_bf16 \
    --alphas inf,1,0.3 --rounds 4 --iters 10 --size-seeds 0,1,2,3 \
    --out "$OUT/mlp_step_skew_bars.json" > "$OUT/bars.log" 2>&1
  echo "bars rc $?"; grep -E 'over [0-9]+ draws' "$OUT/bars.log" | tail -12; stamp bars
fi
