#!/usr/bin/env bash
# Session 12 device call 2: full GPU suite on h-int, skewed step ratios, offload scheduler-fencing flags.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JGM_COMMIT=${JGM_COMMIT:-h-int}
T0=$(date +%s); stamp() { echo "[call2] $1 at +$(( $(date +%s) - T0 ))s"; }
timeout 290 python3 -m pytest -q -m gpu -n 3 tests -p no:cacheprovider --tb=line -rf 2>&1 | grep -v Warning | tail -25
stamp gpu-suite
timeout 110 python3 benchmarks/bench_mlp.py --shapes nano --only grouped_mlp_mxfp8,grouped_mlp_bf16 --alphas inf,1,0.3 --out $OUT/mlp_skew_wgrad2_h200.json 2>&1 | tail -14
stamp bench-mlp
F="--xla-option xla_gpu_experimental_scheduler_memory_fencing_threshold_bytes=67108864"
for s in 0; do
timeout 120 python3 benchmarks/bench_offload.py --ep-share --layout loop --layers 4,8 --policies all_offload,d-o-d --no-time $F --xla-option xla_gpu_experimental_scheduler_memory_fencing_slack_windows=$s --out $OUT/offload_fencing_slack${s}_h200.json 2>&1 | tail -8
stamp offload-slack$s
done
