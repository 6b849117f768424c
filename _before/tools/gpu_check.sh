#!/usr/bin/env bash
# One device call for the whole library on the H200: every GPU test, the demo (main job)
# on the GPU, the MLP-step benchmark and the gradient-accumulation one (nano;
# SHAPES=nano,moe32,moe8 for all, several more minutes). The test suite takes about 3 minutes in 4 pytest-xdist workers
# (TEST_WORKERS=0: one process, about 7). Builds nothing: carry the extension
#   run(command="bash tools/gpu_check.sh",
#       carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
# Logs, JSON and PNG land in $OUT.
source "$(dirname "$0")/gpu_common.sh" gpu_check /tmp/gpu_out
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
  python3 -c 'import jax; print(jax.__version__, jax.devices())'; } > "$OUT/env.txt" 2>&1
# -v: every test's outcome is logged as it finishes, so a run cut off by TEST_S still
# names its failures (the summary at the end never comes then).
timeout ${TEST_S:-420} python3 -m pytest -v -m gpu -n ${TEST_WORKERS:-4} tests --tb=short -p no:cacheprovider \
  --timeout=300 -rf > "$OUT/pytest.log" 2>&1; tail -15 "$OUT/pytest.log" | grep -v " PASSED \| SKIPPED "
failures=$(grep -oE '(FAILED|ERROR) tests/[^ ]+' "$OUT/pytest.log" | sort -u)  # (not a file: $OUT holds 8 already)
echo "tests failed or errored: $(printf '%s' "$failures" | grep -c .)"; printf '%s\n' "$failures" | head -20
stamp tests
timeout ${DEMO_S:-90} python3 examples/demo.py --seed 0 2>&1 | tee "$OUT/demo.log" | tail -12
stamp demo
if [ "${BENCH_S:-240}" != 0 ]; then  # BENCH_S=0 skips the MLP-step benchmark
  timeout ${BENCH_S:-240} python3 benchmarks/bench_mlp.py --shapes ${SHAPES:-nano} \
    --out "$OUT/mlp_step_h200.json" --plot > "$OUT/bench_mlp.log" 2>&1; tail -6 "$OUT/bench_mlp.log"
  stamp bench
fi
# Gradient accumulation with the weights prepared once per step, per recipe (float32
# masters, 4 micro-batches; ACCUM_S=0 skips it).
if [ "${ACCUM_S:-150}" != 0 ]; then
  timeout ${ACCUM_S:-150} python3 benchmarks/bench_grad_accum.py --shapes ${SHAPES:-nano} --micro-batches 4 \
    --out "$OUT/grad_accum_h200.json" > "$OUT/bench_grad_accum.log" 2>&1; tail -4 "$OUT/bench_grad_accum.log"
  stamp grad-accum
fi
