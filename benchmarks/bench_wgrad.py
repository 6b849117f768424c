"""The weight-gradient kernel's variants at the MLP shapes: ms, TFLOP/s, and agreement.

    PYTHONPATH=. python3 benchmarks/bench_wgrad.py [--shapes nano] [--skew S] [--out X.json]
    PYTHONPATH=. python3 benchmarks/bench_wgrad.py --fp8-block [--alphas inf,1] [--rounds 3] [--plot]

``--fp8-block``: the FP8 block-scaled weight gradient (``gemm_ffi.grouped_wgrad_fp8_block``)
next to the bf16 kernel's default variant on the same operands' exactly dequantized
values, in interleaved rounds: the kernel alone (operands already token-major) and the
binding as the op calls it (with the XLA pass that lays the group-aware FP8 copies out
token-major), group sizes equal (``inf``) or from the shared router generator
(``shapes.router_group_sizes``, Dirichlet ``alpha``); the relative difference between the
FP8 and bf16 results (the same products; only the summation differs).

For each MLP shape, both weight gradients of the layer on the same random bf16 inputs
(``dW1 = X^T dH``: ``[M, H]^T [M, F]``; ``dW2 = A^T dY``: ``[M, F]^T [M, H]``), timed
for every bf16-output variant of ``gemm_ffi.grouped_wgrad_bf16_cuda``. Every variant
must give the same bits as the first (the kernels sum in the same order whatever the
tile and epilogue); ``default`` names the one the op picks.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from jax_grouped_mlp._src.cuda import ffi, gemm_ffi  # noqa: E402
from common import (  # noqa: E402
    MLP_SHAPES, RESULTS, bar_plot, gemm_cell, gemm_entry, gemm_report, routed_group_sizes, time_call, write_report,
)
from shapes import router_group_sizes  # noqa: E402
from jax_grouped_mlp._src.formats import fp8_block  # noqa: E402


def bench_pair(lhs: jax.Array, rhs: jax.Array, gs: jax.Array, iters: int) -> dict:
    """Every bf16-output variant on ``lhs^T rhs`` per group."""
    m, k = lhs.shape
    n = rhs.shape[1]
    flops = 2.0 * m * k * n
    names = [v for v in gemm_ffi.grouped_wgrad_variants() if not v.endswith("_f32")]
    res: dict = {"M": m, "K": k, "N": n, "flops": flops}
    first = None
    for v in names:
        fn = jax.jit(lambda a, b, s, v=v: gemm_ffi.grouped_wgrad_bf16_cuda(a, b, s, variant=v))
        out = np.asarray(fn(lhs, rhs, gs).astype(jnp.float32))
        first = out if first is None else first
        res[v] = gemm_entry(time_call(fn, lhs, rhs, gs, iters=iters), flops) | {
            "bitwise_equal_to_first": bool(np.array_equal(out, first))
        }
    res["default"] = gemm_ffi.default_variant(n, tuple(names))  # what grouped_wgrad_bf16_cuda picks
    return res


def bench_shape(name: str, iters: int, skew: float) -> dict:
    g, rows, h, f = MLP_SHAPES[name]
    m = g * rows
    kx, ka = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, h), jnp.float32).astype(jnp.bfloat16)
    a = jax.random.normal(ka, (m, f), jnp.float32).astype(jnp.bfloat16)
    gs = jnp.asarray(routed_group_sizes(m, g, skew))
    return {"skew": skew, "dW1": bench_pair(x, a, gs, iters), "dW2": bench_pair(a, x, gs, iters)}


def _fp8_bf16_variants() -> list[str]:
    """The compiled FP8 weight gradients writing bf16, the binding's default first."""
    return [v for v in gemm_ffi.grouped_wgrad_fp8_block_variants() if not v.endswith("_f32")]


def _fp8_kernel_alone(m: int, g: int, k: int, n: int, variant: str):
    """The FP8 weight-gradient custom call (``variant``) on operands already laid out token-major."""
    index = np.int32(gemm_ffi.grouped_wgrad_fp8_block_variants().index(variant))
    call = jax.ffi.ffi_call(gemm_ffi.GROUPED_WGRAD_FP8_BLOCK_TARGET,
                            (jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16), gemm_ffi.ORDER_TOKEN))
    return jax.jit(lambda a, sa, b, sb, s: call(a, sa, b, sb, s, variant=index, rows=np.int64(m))[0])


def bench_fp8_pair(lhs: jax.Array, rhs: jax.Array, gs: jax.Array, iters: int, rounds: int) -> dict:
    """``lhs^T rhs`` per group: the FP8 kernel (alone and through the binding) and the bf16
    kernel on the dequantized values, ``rounds`` interleaved rounds (median kept)."""
    m, k = lhs.shape
    n = rhs.shape[1]
    g = gs.shape[0]
    flops = 2.0 * m * k * n
    @jax.jit
    def prepare(lhs, rhs, gs):
        ql = fp8_block.quantize_fp8_block(lhs, 0, group_sizes=gs)
        qr = fp8_block.quantize_fp8_block(rhs, 0, group_sizes=gs)
        deq = tuple(fp8_block.dequantize_fp8_block(t, jnp.bfloat16) for t in (ql, qr))
        return ql, qr, deq, fp8_block.token_major_blocks(ql), fp8_block.token_major_blocks(qr)

    ql, qr, (dl, dr), (a, sa), (b, sb) = prepare(lhs, rhs, gs)
    default, *others = _fp8_bf16_variants()
    calls = {
        "fp8_block_kernel": (_fp8_kernel_alone(m, g, k, n, default), (a, sa, b, sb, gs)),
        **{f"fp8_block_kernel:{v}": (_fp8_kernel_alone(m, g, k, n, v), (a, sa, b, sb, gs)) for v in others},
        "fp8_block_binding": (jax.jit(lambda x, y, s: gemm_ffi.grouped_wgrad_fp8_block(x, y, s)), (ql, qr, gs)),
        "bf16": (jax.jit(lambda x, y, s: gemm_ffi.grouped_wgrad_bf16_cuda(x, y, s)), (dl, dr, gs)),
    }
    outs = {name: fn(*args).astype(jnp.float32) for name, (fn, args) in calls.items()}
    times: dict = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (fn, args) in calls.items():
            times[name].append(time_call(fn, *args, iters=iters))
    res: dict = {"M": m, "K": k, "N": n, "G": g, "flops": flops}
    for name in calls:
        res[name] = gemm_entry(float(np.median(times[name])), flops) | {"ms_rounds": [t * 1e3 for t in times[name]]}
    ref = outs["bf16"]
    res["fp8_vs_bf16_rel"] = float(jnp.linalg.norm(outs["fp8_block_kernel"] - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))
    res["binding_equals_kernel"] = bool(jnp.array_equal(outs["fp8_block_kernel"], outs["fp8_block_binding"]))
    res["fp8_kernel_default"] = default
    for v in others:  # every variant promotes the same block sums in the same order
        res[f"fp8_block_kernel:{v}"]["bitwise_equal_to_default"] = bool(
            jnp.array_equal(outs[f"fp8_block_kernel:{v}"], outs["fp8_block_kernel"]))
        res[f"speedup_{v}_vs_bf16"] = res["bf16"]["ms"] / res[f"fp8_block_kernel:{v}"]["ms"]
    del outs
    res["speedup_kernel_vs_bf16"] = res["bf16"]["ms"] / res["fp8_block_kernel"]["ms"]
    res["speedup_binding_vs_bf16"] = res["bf16"]["ms"] / res["fp8_block_binding"]["ms"]
    return res


def bench_fp8_shape(name: str, iters: int, alpha: float, rounds: int) -> dict:
    g, rows, h, f = MLP_SHAPES[name]
    m = g * rows
    kx, ka = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, h), jnp.float32).astype(jnp.bfloat16)
    a = jax.random.normal(ka, (m, f), jnp.float32).astype(jnp.bfloat16)
    gs = jnp.asarray(router_group_sizes(m, g, alpha), jnp.int32)
    return {"alpha": alpha, "dW1": bench_fp8_pair(x, a, gs, iters, rounds), "dW2": bench_fp8_pair(a, x, gs, iters, rounds)}


FP8_SERIES = ("bf16", "fp8_block_kernel", "fp8_block_binding")


def plot_fp8(results: dict, path: pathlib.Path) -> None:
    """TFLOP/s of the bf16 kernel, the FP8 kernel alone and the FP8 binding (with its
    layout passes) per shape and weight gradient, from a ``--fp8-block`` report's results."""
    def label(key: str, which: str) -> str:
        return f"{key.replace('@alpha=inf', '').replace('@alpha=', ' a=')} {which}"

    def series(e: dict) -> dict:
        return {s: row for s, row in e.items() if s in FP8_SERIES or s.startswith("fp8_block_kernel:")}

    bars = {label(key, which): series(r[which]) for key, r in results.items() for which in ("dW1", "dW2")}
    bar_plot(bars, "tflops", "TFLOP/s", "grouped weight gradient: bf16 kernel vs FP8 block-scaled", path,
             figsize=(11, 4))


def main_fp8(ns, argv) -> int:
    if not (ffi.available() and gemm_ffi.grouped_wgrad_fp8_block_variants()) or jax.devices()[0].platform != "gpu":
        print("needs a GPU and the built extension with the FP8 weight gradient (tools/build_kernels.py)")
        return 1
    report = gemm_report("FP8 block-scaled weight gradient vs the bf16 kernel", "benchmarks/bench_wgrad.py",
                         sys.argv[1:] if argv is None else argv)
    for name in ns.shapes.split(","):
        for alpha in (float(x) for x in ns.alphas.split(",")):
            report["shapes"][f"{name}@alpha={alpha:g}"] = bench_fp8_shape(name, ns.iters, alpha, ns.rounds)
    write_report(report, ns.out)
    print(f"{'shape':18} {'gemm':4} {'bf16 ms':>8} {'fp8 kernel ms':>14} {'fp8 binding ms':>15} {'kernel x':>9} "
          f"{'binding x':>10} {'TFLOP/s':>8} {'rel diff':>9}")
    for key, r in report["shapes"].items():
        for which in ("dW1", "dW2"):
            e = r[which]
            print(f"{key:18} {which:4} {e['bf16']['ms']:8.3f} {e['fp8_block_kernel']['ms']:14.3f} "
                  f"{e['fp8_block_binding']['ms']:15.3f} {e['speedup_kernel_vs_bf16']:8.2f}x "
                  f"{e['speedup_binding_vs_bf16']:9.2f}x {e['fp8_block_kernel']['tflops']:8.0f} {e['fp8_vs_bf16_rel']:9.2e}")
            for v in (x for x in e if x.startswith("fp8_block_kernel:")):
                row = e[v]
                print(f"{'':18} {which:4} {v[len('fp8_block_kernel:'):]}: {row['ms']:.3f} ms, {row['tflops']:.0f} TFLOP/s, "
                      f"{'same bits' if row['bitwise_equal_to_default'] else 'DIFFERENT BITS'}")
    if ns.plot:
        plot_fp8(report["shapes"], ns.out.with_suffix(".png"))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="nano")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skew", type=float, default=0.0, help="unequal group sizes (common.routed_group_sizes)")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ap.add_argument("--fp8-block", action="store_true", help="the FP8 block-scaled weight gradient vs bf16")
    ap.add_argument("--alphas", default="inf", help="--fp8-block: Dirichlet alphas of the router sizes (inf: equal)")
    ap.add_argument("--rounds", type=int, default=3, help="--fp8-block: interleaved timing rounds")
    ap.add_argument("--plot", action="store_true", help="--fp8-block: a PNG of TFLOP/s next to the JSON")
    ns = ap.parse_args(argv)
    if ns.fp8_block:
        ns.out = ns.out or RESULTS / "wgrad_fp8_block_h200.json"
        return main_fp8(ns, argv)
    ns.out = ns.out or RESULTS / "wgrad_h200.json"
    if not (ffi.available() and gemm_ffi.grouped_wgrad_variants()) or jax.devices()[0].platform != "gpu":
        print("needs a GPU and the built extension (tools/build_kernels.py)")
        return 1
    report = gemm_report("grouped weight-gradient variants", "benchmarks/bench_wgrad.py",
                         sys.argv[1:] if argv is None else argv)
    for name in ns.shapes.split(","):
        report["shapes"][name] = bench_shape(name, ns.iters, ns.skew)
    write_report(report, ns.out)
    for name, r in report["shapes"].items():
        for which in ("dW1", "dW2"):
            e = r[which]
            for v, row in e.items():
                if isinstance(row, dict):
                    mark = "  (default)" if v == e["default"] else ""
                    same = "same bits" if row["bitwise_equal_to_first"] else "DIFFERENT BITS"
                    print(f"{name:6} {which} {v:46} {gemm_cell(row)}  {same}{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
