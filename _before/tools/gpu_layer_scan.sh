#!/usr/bin/env bash
# One device call for layer_scan / layer_stack on the H200: their GPU tests, then the scan
# layouts at the expert-parallel Nano share (4 and 8 layers, five placements) with the
# compiled HLO dumped, a count of the host copies XLA turned into copy-engine memcpys
# (fusion kind "__dynamic_memcpy") against those left as copy kernels, and (STACK27=1)
# layer_stack over all 27 placements. Carry the extension built against jax 0.11.2:
#   run(command="bash tools/gpu_layer_scan.sh",
#       carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
source "$(dirname "$0")/gpu_common.sh" gpu_layer_scan /tmp/gpu_out keep-prealloc
timeout ${TEST_S:-240} python3 -m pytest -q -m gpu tests/test_layer_stack.py -p no:cacheprovider -rf 2>&1 \
  | tee "$OUT/pytest.log" | tail -4
stamp tests
timeout ${SCAN_S:-300} python3 benchmarks/bench_offload.py --ep-share --layers 4,8 --layout ${LAYOUTS:-scan,layer_scan} \
  --policies ${POLICIES:-all_device,all_offload,o-d-d,d-o-d,d-d-o} --inprocess --samples 5 --dump-hlo "$OUT/hlo" \
  --out "$OUT/offload_layer_scan_h200.json" > "$OUT/bench_scan.log" 2>&1; tail -32 "$OUT/bench_scan.log"
stamp scan
for f in "$OUT"/hlo/*_4_*.hlo.txt.gz; do
  [ -f "$f" ] || continue
  echo "$(basename "$f"): memcpy $(zcat "$f" | grep -c '__dynamic_memcpy'), host slices" \
    "$(zcat "$f" | grep -E 'dynamic-(update-)?slice' | grep -c 'S(5)')"
done
if [ "${STACK27:-0}" = 1 ]; then
  timeout ${STACK_S:-240} python3 benchmarks/bench_offload.py --ep-share --layers 4,8 --layout stack --policies all27 \
    --inprocess --samples 3 --out "$OUT/offload_stack_all27_h200.json" > "$OUT/bench_stack.log" 2>&1
  tail -40 "$OUT/bench_stack.log"; stamp stack27
fi
