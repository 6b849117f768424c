#!/usr/bin/env bash
# One device call for layer_scan's host store on the H200: its GPU tests (and layer_scan's),
# then layer_scan with the store against layer_scan with XLA's own copies at the
# expert-parallel Nano share (4 and 8 layers, five placements; POLICIES=all27 for all; SHAPE=--nano
# for the 128-expert shape; SANITIZE=1 adds compute-sanitizer memcheck of the store).
# Carry the extension built against jax 0.11.2:
#   run(command="bash tools/gpu_host_store.sh",
#       carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
source "$(dirname "$0")/gpu_common.sh" gpu_host_store /tmp/gpu_out keep-prealloc
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_S:-240} python3 -m pytest -q -n 0 -m gpu \
  ${TESTS:-tests/test_host_store.py} -p no:cacheprovider -rf -x 2>&1 | tee "$OUT/pytest.log" | tail -6
stamp tests
if [ "${SANITIZE:-0}" = 1 ]; then  # memcheck over the store's copies, with a release between steps
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${SANITIZE_S:-120} compute-sanitizer --tool memcheck \
    python3 tools/sanitize_small.py --host-store > "$OUT/sanitize.log" 2>&1; tail -4 "$OUT/sanitize.log"
  stamp sanitize
fi
[ "${BENCH:-1}" = 1 ] || exit 0
timeout ${BENCH_S:-330} python3 benchmarks/bench_offload.py ${SHAPE:---ep-share} --layers ${LAYERS:-4,8} \
  --layout ${LAYOUTS:-layer_scan,layer_scan_xla} --policies ${POLICIES:-all_device,all_offload,o-d-d,d-o-d,d-d-o} \
  --inprocess --samples ${SAMPLES:-3} ${BENCH_ARGS:-} --out "$OUT/${NAME:-offload_layer_scan_store_h200}.json" \
  > "$OUT/bench.log" 2>&1; tail -${TAIL:-40} "$OUT/bench.log"
stamp bench
