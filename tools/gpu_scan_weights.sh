#!/usr/bin/env bash
# Device call for what a `jax.lax.scan` over stacked expert weights costs at the 128-expert
# Nano shape (docs/performance.md, "Scanned layer stacks": XLA copies each layer's weight
# slices and weight gradients). Builds nothing: carry the extension
#   run(command="STEPS='test scan' bash tools/gpu_scan_weights.sh",
#       carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
# STEPS (default "scan"):
#   test      the `_qw` GEMM's, the op's and the layer stacks' GPU tests, then memcheck on
#             tools/sanitize_small.py (as tools/gpu_qw_choice.sh's test and sanitize steps)
#   optest    the op's, the offload policies' and the weight gradients' (bf16, FP8) GPU tests alone
#   scan      loop against lax.scan, all residuals on the device, LAYERS layers, prevent_cse
#             on and off, one process; the optimized HLO of each step in $OUT/hlo.tgz
#             (SCAN_FLAGS: more bench_offload.py flags, e.g. "--recipe fp8_block")
#   profile   benchmarks/profile_step.py --step stack over the same candidates (per kernel)
# (At most 8 files come back from a call: "test scan" brings 7.)
source "$(dirname "$0")/gpu_common.sh" gpu_scan_weights /tmp/scan_weights_out keep-prealloc
STEPS=${STEPS:-scan}
LAYERS=${LAYERS:-2,4}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [[ " $STEPS " == *" test "* ]]; then
  OUT="$OUT" STEPS="test sanitize" bash "$(dirname "$0")/gpu_qw_choice.sh"
  timeout ${STACK_TEST_S:-150} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_layer_stack.py > "$OUT/test_stack.log" 2>&1
  tail -3 "$OUT/test_stack.log"; stamp "stack tests"
fi

if [[ " $STEPS " == *" optest "* ]]; then  # the op's and the policies' GPU tests (bitwise checks)
  timeout ${OPTEST_S:-200} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_mlp_gpu.py \
    tests/test_offload_policies.py tests/test_grouped_wgrad_gpu.py tests/test_grouped_wgrad_fp8_block_gpu.py \
    > "$OUT/optest.log" 2>&1
  tail -3 "$OUT/optest.log"; stamp optest
fi

if [[ " $STEPS " == *" scan "* ]]; then
  for cse in on off; do
    flag=""; [ $cse = off ] && flag="--no-prevent-cse"
    timeout ${SCAN_S:-240} python3 benchmarks/bench_offload.py --nano --layers "$LAYERS" --layout loop,scan \
      --policies all_device --inprocess --samples 3 $flag ${SCAN_FLAGS:-} --dump-hlo "$OUT/hlo_cse_$cse" \
      --out "$OUT/scan_nano_cse_$cse.json" > "/tmp/scan_cse_$cse.log" 2>&1
    echo "== prevent_cse $cse rc $?"; grep -E "^(loop|scan) +[0-9]+ all_device" "/tmp/scan_cse_$cse.log"
    stamp "scan cse $cse"
  done
  (cd "$OUT" && tar czf hlo.tgz hlo_cse_* && rm -rf hlo_cse_*)
fi

if [[ " $STEPS " == *" profile "* ]]; then
  timeout ${PROFILE_S:-200} python3 benchmarks/profile_step.py --step stack --shape nano --layers "${LAYERS##*,}" \
    --candidates loop/d-d-d,scan/d-d-d --top 30 --out "$OUT/profile_scan_nano.json" > "$OUT/profile.log" 2>&1
  echo "profile rc $?"; tail -70 "$OUT/profile.log"; stamp profile
fi
