"""The Flax ``MoEBlock`` as a user builds it: module defaults against bf16 params.

    PYTHONPATH=. python3 benchmarks/bench_moe_block.py [--tokens 8192] [--out FILE] [--small]

One Nemotron-3-Nano MoE layer (H 2688, F 1856, 128 experts, sigmoid top-6 with a
score bias and routed scaling 2.5; group sizes made by the router), forward +
backward of ``sum(block(x)**2)`` with respect to every parameter, under ``jax.jit``.
Candidates: both recipes x ``param_dtype`` float32 (the module default: master
weights) and bfloat16, and float32 params with ``weight_grad_dtype=jnp.bfloat16`` (the
experts' gradients rounded to bf16 inside the op, as a bf16 matmul of the cast weights
gives them). Reports ms per step, the float32/bf16 ratios per recipe (the
bar: at most one cast pass over the weights more, about 1.2x at this shape), the
compiled temp memory and the router's group-size spread. ``--small`` runs a tiny
shape (a CPU smoke test). Writes JSON.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_grouped_mlp as jgm
from jax_grouped_mlp.flax import MoEBlock

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import RESULTS, gemm_report, require_kernels, time_call, write_report  # noqa: E402

NANO = {"hidden": 2688, "ffn": 1856, "experts": 128, "top_k": 6}
SMALL = {"hidden": 128, "ffn": 64, "experts": 8, "top_k": 2}


def block_step(shape: dict, tokens: int, recipe: str, param_dtype, weight_grad_dtype=None):
    """``(compiled step, (params, x), block's router setup)``: the jitted forward + backward of
    ``sum(block(x)**2)`` in every parameter and ``x``, compiled (``profile_step.py --step
    block`` profiles it)."""
    routing = jgm.RoutingConfig(top_k=shape["top_k"], score_function="sigmoid", routed_scaling_factor=2.5)
    block = MoEBlock(shape["experts"], shape["hidden"], shape["ffn"], routing=routing, use_score_bias=True,
                     recipe=recipe, param_dtype=param_dtype, weight_grad_dtype=weight_grad_dtype,
                     rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)
    x = jax.random.normal(jax.random.key(1), (tokens, shape["hidden"]), jnp.float32).astype(jnp.bfloat16)

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params, rest)(x).astype(jnp.float32) ** 2)

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x).compile()
    return compiled, (params, x), (routing, rest)


def _candidate(shape: dict, tokens: int, recipe: str, param_dtype, iters: int, weight_grad_dtype=None) -> dict:
    compiled, (params, x), (routing, rest) = block_step(shape, tokens, recipe, param_dtype, weight_grad_dtype)
    _, (grads, _) = compiled(params, x)
    dtypes = sorted({str(g.dtype) for g in jax.tree_util.tree_leaves(grads)})
    mem = compiled.memory_analysis()
    # The router's group sizes on this input (what the experts actually see).
    logits = x.astype(jnp.float32) @ params["router"][...]
    ids, _ = jax.jit(lambda lg: jgm._src.moe.routing.route(lg, routing, rest["score_bias"][...]))(logits)
    load = np.bincount(np.asarray(ids).ravel(), minlength=shape["experts"])
    ms = time_call(compiled, params, x, iters=iters) * 1e3
    return {
        "ms": ms,
        "temp_bytes": None if mem is None else int(mem.temp_size_in_bytes),
        "grad_dtypes": dtypes,
        "rows_per_expert": {"min": int(load.min()), "max": int(load.max()), "mean": float(load.mean())},
    }


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--small", action="store_true", help="tiny shape (CPU smoke test)")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "moe_block_defaults.json")
    args = ap.parse_args(argv)
    require_kernels()  # (no timing of the pure-JAX fallback under our name)
    shape = SMALL if args.small else NANO
    report = gemm_report("Flax MoEBlock forward + backward: module defaults (float32 params) vs bf16 params",
                         "benchmarks/bench_moe_block.py", argv)
    report.update(shape=shape, tokens=args.tokens, results={})
    for recipe in ("mxfp8", "bf16"):
        for pd in (jnp.float32, jnp.bfloat16):
            name = f"{recipe}_params_{jnp.dtype(pd).name}"
            report["results"][name] = _candidate(shape, args.tokens, recipe, pd, args.iters)
            print(name, report["results"][name], flush=True)
        name = f"{recipe}_params_float32_bf16grad"
        report["results"][name] = _candidate(shape, args.tokens, recipe, jnp.float32, args.iters, jnp.bfloat16)
        print(name, report["results"][name], flush=True)
        r = report["results"]
        report["results"][f"{recipe}_float32_over_bf16"] = (
            r[f"{recipe}_params_float32"]["ms"] / r[f"{recipe}_params_bfloat16"]["ms"])
        report["results"][f"{recipe}_float32_bf16grad_over_bf16"] = (
            r[f"{recipe}_params_float32_bf16grad"]["ms"] / r[f"{recipe}_params_bfloat16"]["ms"])
    print(f"\n{'candidate':34s} {'ms':>8s} {'temp GiB':>9s}")
    for name, e in report["results"].items():
        if isinstance(e, dict):
            temp = e["temp_bytes"] / 2**30 if e["temp_bytes"] is not None else float("nan")
            print(f"{name:34s} {e['ms']:8.2f} {temp:9.2f}")
        else:
            print(f"{name:34s} {e:8.2f}x")
    write_report({k: v for k, v in report.items() if k != "shapes"}, args.out, data_key="results")


if __name__ == "__main__":
    main(sys.argv[1:])
