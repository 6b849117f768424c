#!/usr/bin/env bash
# One device call for the `_qw` GEMM's mixed tiles (issue 20's mxfp8 skew; docs/notes/
# 2026-12-02-skew.md, "Session 43"). Builds nothing: carry the extension
#   run(command="JGM_COMMIT=<sha> bash tools/gpu_qw_mixed.sh",
#       carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
# STEPS (default "test sanitize gemm step") picks what runs, in this order:
#   test      the `_qw` GEMM's GPU tests (every variant alone, the mixed tiles, the choice
#             operand's every value) and the op's mxfp8 GPU tests
#   sanitize  compute-sanitizer memcheck on tools/sanitize_small.py (the mixed tiles included)
#   gemm      bench_gemm_qw.py at the Nano GEMMs, equal sizes and Dirichlet(1): every variant,
#             the mixed tiles and the device's choice
#   step      the mxfp8 Nano step at equal sizes, Dirichlet(1) and (0.3), four router draws,
#             with the mixed tiles allowed and with JGM_QW_MIXED_TILES=0, in alternating
#             processes (STEP_PAIRS pairs)
source "$(dirname "$0")/gpu_common.sh" gpu_qw_mixed /tmp/qw_mixed_out
STEPS=${STEPS:-test sanitize gemm step}
# (8 files come back at most: the GPU's description opens test.log.)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$OUT/test.log" 2>&1

if [[ " $STEPS " == *" test "* ]]; then
  timeout ${TEST_S:-200} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_grouped_gemm_qw_gpu.py \
    tests/test_mlp_gpu.py >> "$OUT/test.log" 2>&1
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
      --out "$OUT/gemm_qw_mixed_alpha$alpha.json" > /tmp/gemm_$alpha.log 2>&1
    echo "== alpha $alpha"; grep -E "default|mixed tiles|qw:" /tmp/gemm_$alpha.log
    stamp "gemm alpha $alpha"
  done
fi

if [[ " $STEPS " == *" step "* ]]; then
  for pair in $(seq ${STEP_PAIRS:-2}); do
    for mixed in 1 0; do
      JGM_QW_MIXED_TILES=$mixed timeout ${STEP_S:-120} python3 benchmarks/bench_mlp.py --shapes nano \
        --only grouped_mlp_mxfp8 --alphas inf,1,0.3 --rounds 2 --iters 10 --size-seeds 0,1,2,3 \
        --out "$OUT/mlp_step_mixed${mixed}_$pair.json" > /tmp/step_$mixed.log 2>&1
      echo "== mixed=$mixed pair $pair"; grep -E "over [0-9]+ draws|grouped_mlp_mxfp8" /tmp/step_$mixed.log | tail -6
      stamp "step mixed=$mixed"
    done
  done
fi
