#!/usr/bin/env bash
# Session 12 device call 3: the GPU suite on h-int (with its failures listed), and the
# scheduler memory-fencing flags on both layouts with timing.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s); stamp() { echo "[call3] $1 at +$(( $(date +%s) - T0 ))s"; }
timeout 320 python3 -m pytest -q -m gpu -n 4 tests -p no:cacheprovider --tb=short -rf > $OUT/gpu_suite.log 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_suite.log | tail -20
stamp gpu-suite
P="all_device,all_offload,o-d-d,d-o-d,d-d-o"
FT=xla_gpu_experimental_scheduler_memory_fencing_threshold_bytes
FS=xla_gpu_experimental_scheduler_memory_fencing_slack_windows
run() { name=$1; shift; timeout 75 python3 benchmarks/bench_offload.py --ep-share --layout both --layers 4,8 --policies $P --inprocess --samples 3 "$@" --out $OUT/offload_$name.json > $OUT/offload_$name.log 2>&1; grep -E "^(loop|scan) " $OUT/offload_$name.log; stamp $name; }
run fencing64_s0 --xla-option $FT=67108864 --xla-option $FS=0
run fencing64_s2 --xla-option $FT=67108864 --xla-option $FS=2
run fencing256_s0 --xla-option $FT=268435456 --xla-option $FS=0
run baseline
