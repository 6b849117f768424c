"""Does the offload planner predict what happens? Predicted vs measured, per policy.

Runs a stack of ``--layers`` grouped-MLP layers (each under its own ``jax.checkpoint``)
on the default device under several placements of the three residuals and prints,
side by side, what :func:`plan_offload` predicts and what was measured:

* residual bytes kept on the device / in pinned host memory: read from the traced
  gradient (which values each checkpoint carries into the backward pass), and the
  host bytes again from the arrays the jitted forward actually returns;
* device memory of the whole step: XLA's buffer assignment of the compiled step
  (temp bytes), relative to the all-recompute policy, against the predicted
  residual memory relative to the same baseline. On the CPU the reference path's
  own workspace (float32 tiles) dwarfs the residuals, so this column says little
  there; on the GPU it is the check that matters;
* step time: best wall time of the jitted loss+gradient (as the planner's inputs).

The planner's inputs (host bandwidth, layer time) are measured here first, with the
helpers the package provides. Small shapes on the CPU (the default); on the H200 run
it with the Nano shape (``--nano``) once the kernels exist. Writes JSON to
``benchmarks/results/offload_plan_<platform>.json``.

    PYTHONPATH=. python benchmarks/bench_offload_plan.py [--layers 4] [--nano]
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src.offload.measure import (
    _best_times,
    measure_host_bandwidth,
    measure_layer_time,
    residual_bytes_kept,
)
from jax_grouped_mlp._src.op.mlp import grouped_mlp
from jax_grouped_mlp._src.op.names import RESIDUAL_NAMES
from jax_grouped_mlp._src.offload.planner import LayerShape, plan_offload
from jax_grouped_mlp._src.offload.policy import offload_policy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import command_line, write_result  # noqa: E402

CPU_SHAPE = LayerShape(tokens=2048, hidden=256, ffn=384, num_experts=8)
NANO_SHAPE = LayerShape(tokens=49152, hidden=2688, ffn=1856, num_experts=128)
RESULTS = pathlib.Path(__file__).parent / "results"

# Placements measured besides the planned one: the corners and the mixes that matter.
POLICIES = [
    ("device", "device", "device"),
    ("offload", "offload", "offload"),
    ("recompute", "recompute", "recompute"),
    ("device", "device", "recompute"),
    ("device", "device", "offload"),
    ("offload", "device", "recompute"),
    ("recompute", "device", "recompute"),
]


def make_stack(shape: LayerShape, layers: int, recipe: str, seed: int = 0):
    """``loss(w1, w2, x, sizes, probs)`` of ``layers`` residual grouped-MLP layers, and its args."""
    m, h, f, g = shape.tokens, shape.hidden, shape.ffn, shape.num_experts
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (m, h), jnp.bfloat16)
    w1 = (jax.random.normal(k[1], (layers, g, h, f)) * h**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k[2], (layers, g, f, h)) * f**-0.5).astype(jnp.bfloat16)
    sizes = np.full(g, m // g, np.int32)
    sizes[: m % g] += 1
    probs = jax.random.uniform(k[3], (m,), jnp.float32)

    def loss_for(placement):
        layer = jax.checkpoint(
            functools.partial(grouped_mlp, recipe=recipe), policy=offload_policy(*placement)
        )

        def loss(w1, w2, x, sizes, probs):
            for i in range(layers):
                x = x + layer(x, w1[i], w2[i], sizes, probs)
            return jnp.mean(x.astype(jnp.float32) ** 2)

        return loss

    return loss_for, (w1, w2, x, jnp.asarray(sizes), probs)


def measure_policy(loss, args) -> tuple[dict, object]:
    """Static measurements of one placement, and its compiled step for timing."""
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    mem = step.memory_analysis()
    kept = residual_bytes_kept(loss, *args, argnums=(0, 1))
    # Residuals returned by jit get their memory kind only from JAX's own transfers.
    from jax_grouped_mlp._src.op import residuals

    residuals.OWN_TRANSFERS = False
    try:
        vjp_fn = jax.jit(lambda *a: jax.vjp(loss, *a)[1])(*args)
    finally:
        residuals.OWN_TRANSFERS = True
    host_runtime = sum(
        a.nbytes for a in jax.tree.leaves(vjp_fn) if a.sharding.memory_kind == "pinned_host"
    )
    return {
        "device_residual_bytes": sum(kept[n]["device_bytes"] for n in RESIDUAL_NAMES),
        "host_residual_bytes": sum(kept[n]["host_bytes"] for n in RESIDUAL_NAMES),
        "host_bytes_runtime": int(host_runtime),
        "temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0) or 0),
        "host_temp_bytes": int(getattr(mem, "host_temp_size_in_bytes", 0) or 0),
    }, functools.partial(step, *args)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--recipe", default="mxfp8", choices=["mxfp8", "bf16"])
    p.add_argument("--nano", action="store_true", help="Nemotron-3-Nano shape (GPU)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget-layers", type=float, default=None,
                   help="residual budget in layers' worth of residuals (default: layers / 2)")
    p.add_argument("--overlap", type=float, default=None,
                   help="copy/compute overlap for the model (default: 1 on GPU, 0 on CPU)")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)

    platform = jax.devices()[0].platform
    shape = NANO_SHAPE if args.nano else CPU_SHAPE
    overlap = args.overlap if args.overlap is not None else (1.0 if platform == "gpu" else 0.0)
    per_layer = sum(shape.residual_bytes(args.recipe).values())
    budget_layers = args.budget_layers if args.budget_layers is not None else args.layers / 2
    print(f"device {jax.devices()[0].device_kind} ({platform}); measuring the planner's inputs...")
    # The GPU: one large copy, the rate the planner's model was checked against (small
    # copies read low); elsewhere a layer's residuals at most (quick).
    nbytes = 1 << 30 if platform == "gpu" else min(256 << 20, max(1 << 20, per_layer))
    host_bw = measure_host_bandwidth(nbytes, repeats=args.repeats)
    layer_time = measure_layer_time(
        tokens=shape.tokens, hidden=shape.hidden, ffn=shape.ffn, num_experts=shape.num_experts,
        recipe=args.recipe, repeats=args.repeats,
    )  # fmt: skip
    plan = plan_offload(
        tokens=shape.tokens, hidden=shape.hidden, ffn=shape.ffn, num_experts=shape.num_experts,
        num_layers=args.layers, budget_bytes=budget_layers * per_layer, host_bandwidth=host_bw,
        layer_time=layer_time, recipe=args.recipe, overlap=overlap,
    )  # fmt: skip
    print(plan.table(top=10))

    planned = tuple(plan.placement[n] for n in RESIDUAL_NAMES)
    policies = POLICIES + ([planned] if planned not in POLICIES else [])
    loss_for, stack_args = make_stack(shape, args.layers, args.recipe)
    measured, steps = {}, {}
    for placement in policies:
        measured[placement], steps[placement] = measure_policy(loss_for(placement), stack_args)
    # Round-robin timing, best of --repeats (as the planner's inputs were measured).
    for placement, t in _best_times(steps, args.repeats).items():
        measured[placement]["step_time_s"] = t
    stats = jax.devices()[0].memory_stats() or {}
    rows = []
    for placement in policies:
        pred = plan.candidate(**dict(zip(RESIDUAL_NAMES, placement)))
        meas = measured[placement]
        transient = pred.device_bytes - meas["device_residual_bytes"]
        rows.append({
            "placement": dict(zip(RESIDUAL_NAMES, placement)),
            "planned": placement == planned,
            "predicted": {
                "device_bytes": pred.device_bytes,
                "device_bytes_kept": pred.device_bytes - transient,
                "host_bytes": pred.host_bytes,
                "step_time_s": pred.step_time,
                "fits": pred.fits,
            },
            "measured": meas,
        })  # fmt: skip

    base = next(r for r in rows if set(r["placement"].values()) == {"recompute"})
    hdr = (
        f"{'placement (fc1/act/fc2)':<32}{'kept dev pred/meas':>22}{'host pred/meas/run':>26}"
        f"{'d_temp pred/meas':>22}{'step ms pred/meas':>20}"
    )
    print("\n" + hdr)
    for r in rows:
        pr, me = r["predicted"], r["measured"]
        d_pred = pr["device_bytes"] - base["predicted"]["device_bytes"]
        d_meas = me["temp_bytes"] - base["measured"]["temp_bytes"]
        r["delta_vs_all_recompute"] = {"predicted_bytes": d_pred, "measured_temp_bytes": d_meas}
        label = ("* " if r["planned"] else "  ") + "/".join(r["placement"].values())
        print(
            f"{label:<32}{pr['device_bytes_kept'] / 1e6:>10.2f}/{me['device_residual_bytes'] / 1e6:<8.2f}MB"
            f"{pr['host_bytes'] / 1e6:>9.2f}/{me['host_residual_bytes'] / 1e6:.2f}/"
            f"{me['host_bytes_runtime'] / 1e6:<6.2f}MB"
            f"{d_pred / 1e6:>10.2f}/{d_meas / 1e6:<8.2f}MB"
            f"{pr['step_time_s'] * 1e3:>10.1f}/{me['step_time_s'] * 1e3:<8.1f}"
        )

    result = {
        "device": jax.devices()[0].device_kind,
        "platform": platform,
        "jax": jax.__version__,
        "shape": vars(shape) | {"layers": args.layers, "recipe": args.recipe},
        "inputs": {
            "host_bandwidth": host_bw,
            "layer_time": {"forward": layer_time.forward, "backward": layer_time.backward,
                           "recompute": dict(layer_time.recompute)},
            "overlap": overlap,
            "budget_bytes": budget_layers * per_layer,
            "residual_bytes": dict(plan.residual_bytes),
        },
        "planned": dict(plan.placement),
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),  # whole run, GPU only
        "rows": rows,
    }  # fmt: skip
    out = args.out or RESULTS / f"offload_plan_{platform}.json"
    extra = {k: v for k, v in result.items() if k not in ("rows", "device", "jax")}
    write_result(out, command=command_line("benchmarks/bench_offload_plan.py", sys.argv[1:] if argv is None else argv),
                 rows=result["rows"], extra=extra)
    return result


if __name__ == "__main__":
    main()
