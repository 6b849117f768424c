"""Expert-parallel MoE block on 1..N GPUs: weak scaling and a cross-check.

    PYTHONPATH=. python3 benchmarks/bench_moe_ep.py [--tokens-per-gpu 8192] [--exchange ragged all_gather] [--out FILE]

Nemotron-3-Nano expert shape (H=2688, F=1856, 128 experts, top-6, sigmoid routing).
For every device count n in 1, 2, 4, ... up to the devices present: a mesh of n
devices on one "expert" axis, n * tokens_per_gpu tokens (weak scaling: the work per
GPU stays constant), ``moe_block`` forward + backward (jit(value_and_grad)) timed,
once per exchange (``--exchange``: the ragged all-to-all and the all-gather /
reduce-scatter exchange by default, so the two are compared in one process).
Before timing, a small case checks that the n-device block gives the one-device
outputs (this is the first run of the real ragged all-to-all on GPUs). Writes JSON.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_grouped_mlp as jgm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import RESULTS, command_line, device_description, require_kernels, time_call, write_result  # noqa: E402

H, F, E, TOP_K = 2688, 1856, 128, 6
ROUTING = jgm.RoutingConfig(top_k=TOP_K, score_function="sigmoid", normalize_weights=True,
                            routed_scaling_factor=2.5)


def _params(rng, h, f, e):
    router = jnp.asarray(rng.standard_normal((h, e)) / np.sqrt(h), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((e, h, f)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((e, f, h)) / np.sqrt(f), jnp.bfloat16)
    return router, w1, w2


def _step(parallel, recipe):
    def loss(x, router, w1, w2):
        y = jgm.moe_block(x, router, w1, w2, routing=ROUTING, recipe=recipe, parallel=parallel)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))


def _parallel(n, exchange="auto"):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("expert",))
    return jgm.ExpertParallel(mesh, "expert", exchange=exchange)


def cross_check(n: int, rng, exchange: str) -> float:
    """Max relative error of the n-device block against one device on a small case."""
    h, f, e = 256, 128, 16
    x = jnp.asarray(rng.standard_normal((n * 96, h)), jnp.bfloat16)
    router, w1, w2 = _params(rng, h, f, e)
    routing = jgm.RoutingConfig(top_k=4)
    one = jgm.moe_block(x, router, w1, w2, routing=routing, recipe="bf16")
    many = jax.jit(lambda *a: jgm.moe_block(*a, routing=routing, recipe="bf16", parallel=_parallel(n, exchange)))(
        x, router, w1, w2)
    a, b = np.asarray(one, np.float32), np.asarray(many, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens-per-gpu", type=int, default=8192)
    ap.add_argument("--recipe", default="mxfp8")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--exchange", nargs="+", default=["ragged", "all_gather"],
                    choices=[e.value for e in jgm.Exchange], help="exchanges to time at every device count > 1")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "moe_ep.json")
    ns = ap.parse_args(argv)
    require_kernels()  # (no timing of the pure-JAX fallback under our name)
    rng = np.random.default_rng(0)
    counts = [n for n in (1, 2, 4, 8) if n <= len(jax.devices())]
    report = {"command": command_line("benchmarks/bench_moe_ep.py", argv or sys.argv[1:]),
              "device": device_description(), "num_devices": len(jax.devices()),
              "shape": {"hidden": H, "ffn": F, "experts": E, "top_k": TOP_K,
                        "tokens_per_gpu": ns.tokens_per_gpu, "recipe": ns.recipe}, "runs": {}}
    router, w1, w2 = _params(rng, H, F, E)
    for n in counts:
        x = jnp.asarray(rng.standard_normal((n * ns.tokens_per_gpu, H)), jnp.bfloat16)
        for exchange in ns.exchange if n > 1 else ["none"]:
            entry: dict = {"devices": n, "exchange": exchange}
            try:
                if n > 1:
                    entry["cross_check_rel_err"] = cross_check(n, rng, exchange)
                step = _step(_parallel(n, exchange) if n > 1 else None, ns.recipe)
                sec = time_call(step, x, router, w1, w2, iters=ns.iters, warmup=1, samples=3)
                flops = 6 * 2 * n * ns.tokens_per_gpu * TOP_K * H * F
                entry.update(ms=sec * 1e3, tflops_per_gpu=flops / sec / 1e12 / n)
            except Exception as err:  # noqa: BLE001 - an OOM is a result too
                entry["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            report["runs"][f"{n}/{exchange}"] = entry
            print(n, entry, flush=True)
    base = report["runs"].get("1/none", {}).get("ms")
    for e in report["runs"].values():
        if base and "ms" in e:
            e["weak_scaling_efficiency"] = base / e["ms"]
    write_result(ns.out, command=report["command"], results=report["runs"],
                 extra={k: report[k] for k in ("num_devices", "shape")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
