"""Gradient accumulation: the expert MLP's training step over micro-batches, with the
weights prepared by every micro-batch (the op's default) or once per step
(``prepare_weights`` + ``grouped_mlp(..., prepared=)``).

    PYTHONPATH=. python3 benchmarks/bench_grad_accum.py [--shapes nano] [--micro-batches 4]
        [--recipes mxfp8,bf16,fp8_block] [--master float32] [--alphas inf,1] [--style in_body] [--out FILE] [--plot]

Same process, same inputs. One step = ``jax.lax.scan`` over ``--micro-batches`` micro-
batches of the shape's rows (each with its own tokens, group sizes and probs), the
gradient of the summed loss (``--style through_scan``, the default: ``grad`` through the
scan; ``in_body``: each micro-batch's ``grad`` added to accumulators inside the scan, as
optax's MultiSteps does) in ``w1`` and ``w2`` (``--master`` dtype, float32 by default
as with an optimizer's master weights) and in each micro-batch's ``x``. Reports ms per
micro-batch, TFLOP/s (six GEMMs of 2·M·H·F per micro-batch), the compiled temp memory,
the ratio prepared / per-micro-batch, and each candidate against the bf16 recipe
preparing per micro-batch (issue 20's bar for fp8_block with reused weights: 0.75x at
the 128-expert Nano shape). Writes JSON (and a PNG with --plot).
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
from common import (  # noqa: E402
    MLP_SHAPES, RESULTS, bar_plot, command_line, device_description, require_kernels, time_call, write_result,
)
from shapes import router_group_sizes, skew_label  # noqa: E402

BASELINE = "bf16/per_micro_batch"
STYLES = ("through_scan", "in_body")


def _step(recipe: str, prepared: bool, style: str = "through_scan"):
    """The gradient in (w1, w2, xs) of the micro-batches' summed loss, one jitted program.

    ``style="through_scan"``: ``grad`` of a function that scans over the micro-batches
    (XLA transposes the scan and sums the weights' cotangents in its carry).
    ``"in_body"``: the scan body takes each micro-batch's ``grad`` and adds it to
    accumulators in the weights' dtype (how optax's MultiSteps and most training loops
    accumulate). The same gradients up to the order of the additions."""

    def mb_loss(w1, w2, x, gs, p, dy, pw):
        y = jgm.grouped_mlp(x, w1, w2, gs, p, recipe=recipe, prepared=pw)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    def through_scan(w1, w2, xs, gss, probs, dys):
        def loss(w1, w2, xs):
            pw = jgm.prepare_weights(w1, w2, recipe=recipe) if prepared else None

            def body(total, mb):
                return total + mb_loss(w1, w2, *mb, pw), None

            return jax.lax.scan(body, jnp.zeros((), jnp.float32), (xs, gss, probs, dys))[0]

        return jax.grad(loss, argnums=(0, 1, 2))(w1, w2, xs)

    def in_body(w1, w2, xs, gss, probs, dys):
        pw = jgm.prepare_weights(w1, w2, recipe=recipe) if prepared else None
        grad = jax.grad(mb_loss, argnums=(0, 1, 2))

        def body(acc, mb):
            dw1, dw2, dx = grad(w1, w2, *mb, pw)
            return (acc[0] + dw1, acc[1] + dw2), dx

        (dw1, dw2), dxs = jax.lax.scan(body, (jnp.zeros_like(w1), jnp.zeros_like(w2)), (xs, gss, probs, dys))
        return dw1, dw2, dxs

    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style=}")
    return jax.jit(through_scan if style == "through_scan" else in_body)


def _inputs(name: str, micro_batches: int, master: str, alpha: float, seed: int):
    g, rows, h, f = MLP_SHAPES[name]
    m = g * rows
    rng = np.random.default_rng(seed)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    w1 = jnp.asarray(rng.standard_normal((g, h, f)) / np.sqrt(h), master)
    w2 = jnp.asarray(rng.standard_normal((g, f, h)) / np.sqrt(f), master)
    xs = bf(rng.standard_normal((micro_batches, m, h)))
    dys = bf(rng.standard_normal((micro_batches, m, h)))
    probs = jnp.asarray(rng.uniform(0.1, 1, (micro_batches, m)), jnp.float32)
    gss = jnp.asarray(np.stack([router_group_sizes(m, g, alpha, seed + i) for i in range(micro_batches)]))
    return (w1, w2, xs, gss, probs, dys), 6 * 2 * m * h * f


def bench_case(name: str, micro_batches: int, recipes: list[str], master: str, alpha: float,
               iters: int, seed: int, style: str = "through_scan") -> dict:
    args, flops = _inputs(name, micro_batches, master, alpha, seed)
    g, rows, h, f = MLP_SHAPES[name]
    res: dict = {"groups": g, "rows_per_micro_batch": g * rows, "hidden": h, "ffn": f, "micro_batches": micro_batches,
                 "master_dtype": master, "skew": skew_label(alpha), "flops_per_micro_batch": flops,
                 "style": style}
    for recipe in recipes:
        for prepared in (False, True):
            cname = f"{recipe}/{'prepared_once' if prepared else 'per_micro_batch'}"
            try:
                compiled = _step(recipe, prepared, style).lower(*args).compile()
                mem = compiled.memory_analysis()
                sec = time_call(compiled, *args, iters=iters, warmup=1, samples=3) / micro_batches
                res[cname] = {"ms": sec * 1e3, "tflops": flops / sec / 1e12,
                              "temp_bytes": getattr(mem, "temp_size_in_bytes", None) if mem is not None else None}
            except Exception as err:  # noqa: BLE001 - OOM and unsupported shapes are results too
                res[cname] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
            print(name, skew_label(alpha), cname, res[cname], flush=True)
        per, once = res.get(f"{recipe}/per_micro_batch", {}), res.get(f"{recipe}/prepared_once", {})
        if "ms" in per and "ms" in once:
            once["vs_per_micro_batch"] = once["ms"] / per["ms"]
    base = res.get(BASELINE, {}).get("ms")
    for e in res.values():
        if isinstance(e, dict) and base and "ms" in e:
            e["vs_bf16_per_micro_batch"] = e["ms"] / base
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="nano")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--recipes", default="mxfp8,bf16,fp8_block")
    ap.add_argument("--master", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--alphas", default="inf", help="group-size skews: inf (equal sizes) and Dirichlet alphas")
    ap.add_argument("--style", default="through_scan", choices=STYLES,
                    help="through_scan: grad of the scanned loss; in_body: each micro-batch's grad added to "
                         "accumulators in the scan body")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "grad_accum.json")
    ap.add_argument("--plot", action="store_true")
    ns = ap.parse_args(argv)
    require_kernels()  # (no timing of the pure-JAX fallback under our name)
    if ns.micro_batches < 1:
        ap.error(f"--micro-batches must be >= 1, got {ns.micro_batches}")
    recipes = [r for r in ns.recipes.split(",") if r]
    command = command_line("benchmarks/bench_grad_accum.py", argv if argv is not None else sys.argv[1:])
    results = {}
    for name in ns.shapes.split(","):
        for alpha in (float(a) for a in ns.alphas.split(",") if a):
            key = name if alpha == float("inf") else f"{name}@{skew_label(alpha)}"
            results[key] = bench_case(name, ns.micro_batches, recipes, ns.master, alpha, ns.iters, ns.seed, ns.style)
    write_result(ns.out, command=command, results=results)
    if ns.plot:
        title = f"grad accumulation, ms per micro-batch, {device_description()['device_kind']}"
        bar_plot(results, "ms", "ms per micro-batch", title, ns.out.with_suffix(".png"))
    cands = [f"{r}/{p}" for r in recipes for p in ("per_micro_batch", "prepared_once")]
    print(f"{'case':12s} " + " ".join(f"{c:>28s}" for c in cands))
    for key, r in results.items():
        cells = []
        for c in cands:
            e = r.get(c, {})
            cells.append(f"{e['ms']:8.2f} ms ({e.get('vs_bf16_per_micro_batch', float('nan')):.2f}x bf16)"
                         if "ms" in e else "error")
        print(f"{key:12s} " + " ".join(f"{c:>28s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
