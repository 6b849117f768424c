#!/usr/bin/env bash
# Session 11, device call 1: GPU suite on this tree, the host-copy fence A/B in the loop
# layout (compiled temp and fresh-process peaks, 4 and 8 layers), the fence's step times,
# and the per-part skew timing. Carry the extension.
set -o pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s); stamp() { echo "[fence_ab] $1 at +$(( $(date +%s) - T0 ))s" | tee -a "$OUT/log.txt"; }
PT="python3 -m pytest -q -p no:cacheprovider --tb=short -rf"
POL=all_device,all_offload,o-d-d,d-o-d,d-d-o
( timeout 300 $PT -m gpu -n 3 tests --timeout=280 > "$OUT/pytest_gpu.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_gpu.log" ) &
( timeout 300 python3 benchmarks/bench_offload.py --ep-share --layout loop --layers 4,8 --policies $POL --no-time \
    --out "$OUT/fence_on_notime.json" > "$OUT/b1.log" 2>&1
  timeout 200 python3 benchmarks/bench_offload.py --ep-share --layout loop --layers 4,8 --policies $POL --no-time --no-fence \
    --out "$OUT/fence_off_notime.json" > "$OUT/b2.log" 2>&1 ) &
wait; stamp parallel
tail -4 "$OUT/pytest_gpu.log"
timeout 170 python3 benchmarks/bench_offload.py --ep-share --layout both --layers 8 --policies $POL \
    --out "$OUT/fence_on_timed.json" > "$OUT/b3.log" 2>&1; stamp timed
timeout 80 python3 benchmarks/bench_step_parts.py --shape nano --alpha inf,1,0.3 --round-to 128 \
    --out "$OUT/step_parts_skew_h200.json" > "$OUT/b4.log" 2>&1; stamp parts
cat "$OUT"/b1.log "$OUT"/b2.log "$OUT"/b3.log "$OUT"/b4.log > "$OUT/bench_logs.txt"; rm -f "$OUT"/b?.log
for f in b1 b2 b3; do :; done
grep -E "^(loop|scan) " "$OUT/bench_logs.txt" | head -60
tail -30 "$OUT/bench_logs.txt"
