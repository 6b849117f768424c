#!/usr/bin/env bash
# One device call that decides the weight gradient's tile order (docs/notes/2026-12-02-skew.md,
# "Session 38"). Builds nothing: build both extensions here and carry them as untracked files
#   make kernels && cp jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so exp/base.sobin
#   JGM_WGRAD_DYNAMIC_TILES=1 make kernels && cp jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so exp/dyn.sobin
#   run(command="JGM_COMMIT=<the commit sent> bash tools/gpu_wgrad_order.sh")
# STEPS (default "orders tests step") picks what runs, in this order:
#   orders  one process on the dynamic build: the weight gradients with the order XLA chooses
#           next to the order forced static and dynamic (bench_step_parts.py, interleaved rounds)
#   tests   the weight-gradient, GEMM and MLP GPU tests on the dynamic build
#   step    the bf16 and mxfp8 steps, base against dynamic, alternated in separate processes
#           (tools/ab_extensions.py; it starts no run that would end past the call's limit)
# About 9 minutes on an H100 with all three (the step comparison gets what is left of
# CALL_S, default 560 s). Logs and JSON land in $OUT, at most 8 files.
BASE=${BASE:-exp/base.sobin}
DYN=${DYN:-exp/dyn.sobin}
EXT=jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so
for f in "$BASE" "$DYN"; do
  [ -f "$f" ] || { echo "[gpu_wgrad_order] no $f: build it here first (the top of this script says how)"; exit 2; }
done
cp "$DYN" "$EXT"  # (before gpu_common.sh, which checks the extension against the running jaxlib)
source "$(dirname "$0")/gpu_common.sh" gpu_wgrad_order /tmp/wgrad_order_out
python3 -c 'from jax_grouped_mlp._src.cuda import ffi; assert ffi.wgrad_dynamic_tiles(), "not a JGM_WGRAD_DYNAMIC_TILES build"' \
  || { echo "[gpu_wgrad_order] $DYN was built without JGM_WGRAD_DYNAMIC_TILES=1"; exit 2; }
STEPS=${STEPS:-orders tests step}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$OUT/env.txt" 2>&1

if [[ " $STEPS " == *" orders "* ]]; then
  timeout ${ORDERS_S:-200} python3 benchmarks/bench_step_parts.py --shape nano --alpha inf,1,0.3 --parts '^wgrad' \
    --rounds ${ROUNDS:-3} --samples 3 --out "$OUT/wgrad_orders.json" > "$OUT/wgrad_orders.log" 2>&1
  grep -E '^(part|wgrad)' "$OUT/wgrad_orders.log" | tail -8
  stamp orders
fi

if [[ " $STEPS " == *" tests "* ]]; then
  timeout ${TEST_S:-150} python3 -m pytest -v -m gpu -n 4 -p no:cacheprovider --tb=short -rf \
    tests/test_grouped_wgrad_gpu.py tests/test_grouped_gemm_gpu.py tests/test_mlp_gpu.py > "$OUT/pytest.log" 2>&1
  tail -1 "$OUT/pytest.log"
  grep -oE '(FAILED|ERROR) tests/[^ ]+' "$OUT/pytest.log" | sort -u | head -20
  stamp tests
fi

if [[ " $STEPS " == *" step "* ]]; then
  left=$(( ${CALL_S:-560} - ($(date +%s) - T0) ))
  if [ "$left" -gt 60 ]; then
    python3 tools/ab_extensions.py --builds "base=$BASE,dyn=$DYN" --rounds ${STEP_ROUNDS:-2} --budget "$left" \
      --out "$OUT/wgrad_order_step_ab.json" -- python3 benchmarks/bench_mlp.py --shapes nano \
      --only grouped_mlp_bf16,grouped_mlp_mxfp8 --alphas inf,1,0.3 --rounds 2 --iters 10 --out '{out}' \
      > "$OUT/step_ab.log" 2>&1
    grep -E '^\[ab\]|grouped_mlp' "$OUT/step_ab.log" | tail -16
  else
    echo "[gpu_wgrad_order] step: only ${left} s left of CALL_S, skipped (run again with STEPS=step)"
  fi
  stamp step
fi
