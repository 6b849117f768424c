#!/usr/bin/env bash
# Session 12 device call 1: the fixed wgrad (h-wgrad2) and the FP8 block GEMM draft (h-fp8gemm).
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JGM_COMMIT=7c61e62
T0=$(date +%s); stamp() { echo "[call1] $1 at +$(( $(date +%s) - T0 ))s"; }
timeout 150 python3 -m pytest -q -n 3 -m gpu tests/test_grouped_wgrad_gpu.py -p no:cacheprovider --tb=line -rf 2>&1 | tail -15
stamp wgrad-tests
timeout 130 python3 benchmarks/bench_step_parts.py --shape nano --alpha inf,1,0.3 --round-to 128 --out $OUT/step_parts_skew_wgrad2_h200.json 2>&1 | tail -40
stamp step-parts
TEST_S=110 BENCH_S=70 SAN_S=60 RACE_S=45 bash tools/gpu_check_fp8_block.sh 2>&1 | tail -40
stamp fp8
