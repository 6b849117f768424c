#!/usr/bin/env bash
# One device call that checks the whole library on the H200 (about 9 minutes):
# correctness jobs side by side (the GPU suite in 3 workers, the offload-policy and
# higher-order CPU tests on the GPU, compute-sanitizer memcheck of the second-order
# adversarial cases), then the timed jobs one at a time (demo, MLP step, Flax block
# defaults). Carry the extension:
#   run(command="bash tools/gpu_session.sh",
#       carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so"])
source "$(dirname "$0")/gpu_common.sh" gpu_session /tmp/gpu_out
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
  python3 -c 'import jax; print(jax.__version__, jax.devices())'; git log -1 --format=%H 2>/dev/null; } > "$OUT/env.txt" 2>&1
PT="python3 -m pytest -q -p no:cacheprovider --tb=short -rf"
( timeout ${TEST_S:-330} $PT -m gpu -n 3 tests --timeout=300 > "$OUT/pytest_gpu.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_gpu.log" ) &
( timeout ${POLICY_S:-330} $PT -n 0 tests/test_offload_policies.py tests/test_higher_order.py > "$OUT/pytest_policies.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_policies.log" ) &
( timeout ${MEMCHECK_S:-330} compute-sanitizer --tool memcheck --print-limit 20 --target-processes all \
    $PT -n 0 tests/test_adversarial_gpu.py -k 'hessian or grad_of_grad' > "$OUT/memcheck_second_order.txt" 2>&1
  echo "rc=$?" >> "$OUT/memcheck_second_order.txt" ) &
wait; stamp correctness
for f in pytest_gpu pytest_policies; do tail -6 "$OUT/$f.log"; done; tail -4 "$OUT/memcheck_second_order.txt"
timeout ${DEMO_S:-60} python3 examples/demo.py --seed 0 > "$OUT/demo.log" 2>&1; tail -5 "$OUT/demo.log"; stamp demo
timeout ${BENCH_S:-150} python3 benchmarks/bench_mlp.py --shapes nano --out "$OUT/mlp_step_h200.json" --plot > "$OUT/bench_mlp.log" 2>&1
tail -12 "$OUT/bench_mlp.log"; stamp bench_mlp
timeout ${BLOCK_S:-90} python3 benchmarks/bench_moe_block.py --out "$OUT/moe_block_defaults_h200.json" > "$OUT/bench_moe_block.log" 2>&1
tail -10 "$OUT/bench_moe_block.log"; stamp bench_moe_block
