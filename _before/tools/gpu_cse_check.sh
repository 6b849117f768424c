#!/usr/bin/env bash
# Reloads tied to the layer's cotangent by the op itself (residuals.RELOAD_AFTER_COTANGENT,
# an experiment, issue 17) on the H200 in one call: the whole GPU suite (as it is), then
# the 8-layer step at the EP share for five policies in both layouts with the experiment
# on, and in the loop again with jax.checkpoint(prevent_cse=False) (the offload must
# survive it). (The committed runs had the flag's default on instead.)
#   run(command="bash tools/gpu_cse_check.sh", carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
source "$(dirname "$0")/gpu_common.sh" cse_check /tmp/gpu_out
B="python3 benchmarks/bench_offload.py --ep-share --layers 8 --policies all_device,all_offload,o-d-d,d-o-d,d-d-o --inprocess --samples 3 --reload-after-cotangent"
timeout ${TEST_S:-290} python3 -m pytest -q -p no:cacheprovider --tb=short -rf -m gpu -n 4 tests --timeout=280 \
    > "$OUT/pytest_gpu.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_gpu.log"; tail -3 "$OUT/pytest_gpu.log"; stamp tests
timeout 100 $B --layout both --out "$OUT/offload_reload_after_dy_timed_h200.json" > "$OUT/bench.log" 2>&1; stamp timed
timeout 60 $B --layout loop --no-prevent-cse --out "$OUT/offload_reload_after_dy_nocse_timed_h200.json" >> "$OUT/bench.log" 2>&1
stamp nocse
grep -E "^(loop|scan) +8 " "$OUT/bench.log"
