#!/usr/bin/env bash
# The host-copy fence (residuals.fence, issue 17) on the H200 in one call: the whole GPU
# suite, then bench_offload at the EP share for all 27 placements in both layouts at 4 and
# 8 layers (compiled temp, step time, plot). ALL27=0: five policies, fresh-process peaks
# of the loop, and the step with and without the fence instead.
#   run(command="bash tools/gpu_fence_check.sh", carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
source "$(dirname "$0")/gpu_common.sh" fence_check /tmp/gpu_out
PT="python3 -m pytest -q -p no:cacheprovider --tb=short -rf"
B="python3 benchmarks/bench_offload.py --ep-share"
timeout ${TEST_S:-300} $PT -m gpu -n 4 tests --timeout=280 > "$OUT/pytest_gpu.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_gpu.log"
tail -3 "$OUT/pytest_gpu.log"; stamp tests
if [ "${ALL27:-1}" = 1 ]; then
  timeout ${BENCH_S:-280} $B --layers 4,8 --layout both --policies all27 --inprocess \
      --out "$OUT/offload_fence_all27_h200.json" --plot "$OUT/offload_fence_all27_h200.png" > "$OUT/bench.log" 2>&1
  stamp all27
else
  POL=all_device,all_offload,o-d-d,d-o-d,d-d-o
  timeout 260 $B --layout loop --layers 4,8 --policies all_device,all_offload,d-o-d --no-time \
      --out "$OUT/offload_fence_loop_peaks_h200.json" > "$OUT/bench.log" 2>&1; stamp peaks
  timeout 120 $B --layout both --layers 8 --policies $POL --inprocess --samples 3 \
      --out "$OUT/offload_fence_timed_h200.json" >> "$OUT/bench.log" 2>&1; stamp timed
  timeout 60 $B --layout loop --layers 8 --policies $POL --inprocess --samples 3 --no-fence \
      --out "$OUT/offload_nofence_timed_h200.json" >> "$OUT/bench.log" 2>&1; stamp timed_nofence
fi
grep -A40 "issue 17's bars" "$OUT/bench.log" | grep -E "^(loop|scan) " | head -120
