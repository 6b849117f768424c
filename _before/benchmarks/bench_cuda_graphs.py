"""The MXFP8 training step with and without XLA's command buffers (CUDA graphs) for our custom calls.

    PYTHONPATH=. python3 benchmarks/bench_cuda_graphs.py [--shapes demo,nano] [--out FILE]

Same shapes, same inputs, one subprocess per configuration (XLA_FLAGS is read once per
process): ``no_command_buffers`` (``--xla_gpu_enable_command_buffer=``), ``xla_default``
(XLA's own default command-buffer set; our handlers registered as compatible),
``graphs`` (``FUSION,CUSTOM_CALL`` with ``--xla_gpu_graph_min_graph_size=1``) and
``graphs_no_trait`` (the same flags, ``JGM_CUDA_GRAPHS=0``: our calls stay outside).
Reports ms per step (value_and_grad of ``grouped_mlp``, equal group sizes) at the demo
shape (``examples/demo.py``: 2048 tokens, H=256, F=512, 8 experts) and Nemotron-3-Nano.
Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
# (G, rows per group, H, F); "tiny" is a CPU smoke test of the script, not a measurement.
SHAPES = {"demo": (8, 256, 256, 512), "nano": (128, 384, 2688, 1856), "tiny": (4, 64, 128, 128)}
GRAPHS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
CONFIGS = {
    "no_command_buffers": ("--xla_gpu_enable_command_buffer=", "1"),
    "xla_default": ("", "1"),
    "graphs": (GRAPHS, "1"),
    "graphs_no_trait": (GRAPHS, "0"),
}


def worker(shape: str) -> dict:
    """Times one shape in this process (its XLA_FLAGS); prints and returns ms per step."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_grouped_mlp as jgm

    sys.path.insert(0, str(HERE))
    from common import require_kernels, time_call

    require_kernels()  # (no timing of the pure-JAX fallback under our name)
    g, rows, h, f = SHAPES[shape]
    m = g * rows
    rng = np.random.default_rng(0)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    args = (bf(rng.standard_normal((m, h))), bf(rng.standard_normal((g, h, f)) / np.sqrt(h)),
            bf(rng.standard_normal((g, f, h)) / np.sqrt(f)), jnp.full((g,), rows, jnp.int32),
            jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32), bf(rng.standard_normal((m, h))))

    def loss(x, w1, w2, gs, probs, dy):
        y = jgm.grouped_mlp(x, w1, w2, gs, probs, recipe="mxfp8")
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 4)))
    from jax_grouped_mlp import _kernels

    before = _kernels.captured_launches()
    seconds = time_call(step, *args, iters=20, warmup=3)
    # Our kernel launches recorded into CUDA graphs (0: none of our calls was captured).
    return {"ms": seconds * 1e3, "device": jax.devices()[0].device_kind,
            "captured_launches": _kernels.captured_launches() - before}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="demo,nano")
    ap.add_argument("--out", default=str(HERE / "results" / "cuda_graphs.json"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.worker:  # (the workers alone start a backend; each needs the kernels anyway)
        print(json.dumps(worker(ns.worker)))
        return 0
    rows = []
    for shape in ns.shapes.split(","):
        for config, (flags, graphs) in CONFIGS.items():
            env = dict(os.environ, JGM_CUDA_GRAPHS=graphs)
            env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH", "")) if p)
            proc = subprocess.run([sys.executable, __file__, "--worker", shape], env=env, capture_output=True,
                                  text=True, timeout=1200)
            if proc.returncode != 0:
                raise SystemExit(f"{shape}/{config} failed:\n{(proc.stdout + proc.stderr)[-5000:]}")
            row = {"shape": shape, "config": config, "xla_flags": flags, "jgm_cuda_graphs": graphs,
                   **json.loads(proc.stdout.strip().splitlines()[-1])}
            print(f"{shape:5s} {config:20s} {row['ms']:8.3f} ms  captured launches {row['captured_launches']}",
                  flush=True)
            rows.append(row)
    sys.path.insert(0, str(HERE))
    from common import command_line, write_result

    # The device from the workers: this process starts no backend (it would hold GPU memory).
    write_result(ns.out, command=command_line("benchmarks/bench_cuda_graphs.py", sys.argv[1:] if argv is None else argv),
                 rows=rows, device=rows[0]["device"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
