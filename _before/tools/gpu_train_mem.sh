#!/usr/bin/env bash
# One device call for the training step on the user's path (bench_train's Nano decoder
# stack: Flax MoEBlock at its defaults, float32 masters, optax AdamW, router-made group
# sizes) next to tokamax: what is live at the compiled temp peak, and the step itself.
# Builds nothing: run tools/peer_wheels.sh here, then
#   run(command="JGM_COMMIT=<sha> bash tools/gpu_train_mem.sh",
#       carry=["jax_grouped_mlp/_kernels.cpython-312-x86_64-linux-gnu.so", ".whl"])
# STEPS (default "peak step") picks what runs:
#   peak  tools/train_peak.py (compile only) for PEAK_CANDIDATES at PEAK_LAYERS
#   step  benchmarks/bench_train.py at STEP_LAYERS (space-separated), with
#         XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 (MEM_FRACTION): on an 80 GB H100, 4 Nano
#         layers fit only with weight_grad_dtype=bf16 and that fraction (the default
#         float32 gradients run out of memory; JAX's default 0.75 fits neither)
# Logs and JSON land in $OUT.
source "$(dirname "$0")/gpu_common.sh" gpu_train_mem /tmp/train_mem_out
STEPS=${STEPS:-peak step}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  mkdir -p /tmp/site/xprof/cli && touch /tmp/site/xprof/__init__.py /tmp/site/xprof/cli/__init__.py \
    && echo 'get_kernel_stats_tool = None' > /tmp/site/xprof/cli/tools.py
  export PYTHONPATH=.:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/env.txt" 2>&1
CANDS=${CANDIDATES:-jgm_bf16_device,jgm_bf16_device_bf16grad,tokamax_bf16}

if [[ " $STEPS " == *" peak "* ]]; then
  timeout ${PEAK_S:-240} python3 tools/train_peak.py --candidates "${PEAK_CANDIDATES:-$CANDS}" \
    --layers "${PEAK_LAYERS:-1,2}" --top 8 --out "$OUT/train_peak.json" > "$OUT/peak.log" 2>&1
  grep -E "temp|L=" "$OUT/peak.log" | head -20
  stamp peak
fi

if [[ " $STEPS " == *" step "* ]]; then
  for layers in ${STEP_LAYERS:-2 4}; do
    XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.97} timeout ${STEP_S:-240} python3 benchmarks/bench_train.py --layers "$layers" --only "$CANDS" \
      --out "$OUT/train_step_l$layers.json" > "$OUT/step_l$layers.log" 2>&1
    tail -6 "$OUT/step_l$layers.log"
    stamp "step $layers layers"
  done
fi
