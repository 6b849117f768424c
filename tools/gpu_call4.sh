#!/usr/bin/env bash
# Session 12 device call 4: scheduler memory fencing (slack 2) confirmed with fresh-process peaks,
# at the 128-expert Nano shape, and its neighbours (slack 1, 4; threshold 32 MiB).
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s); stamp() { echo "[call4] $1 at +$(( $(date +%s) - T0 ))s"; }
P="all_device,all_offload,o-d-d,d-o-d,d-d-o"
FT=xla_gpu_experimental_scheduler_memory_fencing_threshold_bytes
FS=xla_gpu_experimental_scheduler_memory_fencing_slack_windows
run() { name=$1; shift; timeout ${TO:-60} python3 benchmarks/bench_offload.py --layers 4,8 --policies $P "$@" --out $OUT/offload_$name.json > $OUT/offload_$name.log 2>&1; grep -E "^(loop|scan) " $OUT/offload_$name.log | head -${HEADN:-40}; stamp $name; }
TO=110 HEADN=10 run fencing64_s2_peaks --ep-share --layout loop --no-time --xla-option $FT=67108864 --xla-option $FS=2
TO=90 run nano_baseline --nano --layout both --inprocess --samples 3
TO=90 run nano_fencing64_s2 --nano --layout both --inprocess --samples 3 --xla-option $FT=67108864 --xla-option $FS=2
HEADN=5 run fencing64_s1 --ep-share --layout loop --inprocess --no-time --xla-option $FT=67108864 --xla-option $FS=1
HEADN=5 run fencing64_s4 --ep-share --layout loop --inprocess --no-time --xla-option $FT=67108864 --xla-option $FS=4
HEADN=5 run fencing32_s2 --ep-share --layout loop --inprocess --no-time --xla-option $FT=33554432 --xla-option $FS=2
