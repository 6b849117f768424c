"""Grouped GEMM by a bf16 weight's MXFP8 values: quantized in registers vs by a pass first.

    PYTHONPATH=. python3 benchmarks/bench_gemm_qw.py [--shapes nano_fc1,nano_fc2] [--out X.json]

For each shape (G groups, of equal size unless `--skew`; ``[M, K] x [G, K, N] -> [M, N]``) and each weight
layout (``fprop``: ``[G, K, N]`` as stored; ``dgrad``: ``[G, N, K]`` used transposed), on
the same inputs in one process:
  bf16_prequantized   the plain bf16 kernel on the weight's MXFP8 values, already in
                      memory (the GEMM alone: the ceiling)
  fake_quantize+bf16  the weight's fake-quantize pass, then the plain kernel (what the
                      op runs with ``KernelChoices(quantize_weights_in_gemm=False)``)
  qw                  ``grouped_gemm_qw_cuda``: the weight quantized inside the GEMM
                      (``qw:<variant>`` each variant alone, ``qw`` the best of them,
                      ``qw_mixed`` every variant on its band of each group, the mixed
                      tiles, ``qw_device_choice`` the default call)
``qw`` is checked against the plain kernel on the pre-quantized weight: the share of
bitwise-equal outputs and the largest difference in bf16 ulps (only the fp32 summation
order may differ). TFLOP/s = 2 M N K / time. Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src.cuda import ffi, gemm_ffi
from jax_grouped_mlp.kernels import registry

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import RESULTS, bench_gemm_shapes, gemm_cell, gemm_entry, gemm_problem, gemm_report, time_call  # noqa: E402


def _agreement(got: jax.Array, want: jax.Array) -> dict:
    g = np.asarray(got.astype(jnp.float32), np.float64)
    w = np.asarray(want.astype(jnp.float32), np.float64)
    ulp = np.maximum(np.abs(w), 2.0**-126) * 2.0**-7
    return {"bitwise_equal_fraction": float(np.mean(g == w)), "max_diff_bf16_ulps": float(np.max(np.abs(g - w) / ulp))}


def bench_layout(a, w, gs, flops: float, transpose: bool, iters: int) -> dict:
    axis = 2 if transpose else 1
    plain_names = tuple(v for v in gemm_ffi.grouped_gemm_variants() if v.endswith("_bk") == transpose)
    n = w.shape[1 if transpose else 2]
    variant = gemm_ffi.default_variant(n, plain_names)
    wq = jax.jit(lambda w: ffi.fake_quantize_cuda(w, axis=axis))(w)
    plain = jax.jit(lambda a, b, gs: gemm_ffi.grouped_gemm_bf16_cuda(a, b, gs, variant=variant, transpose_rhs=transpose))
    passes = jax.jit(lambda a, w, gs: plain(a, ffi.fake_quantize_cuda(w, axis=axis), gs))
    res = {
        "bf16_prequantized": gemm_entry(time_call(plain, a, wq, gs, iters=iters), flops) | {"variant": variant},
        "fake_quantize+bf16": gemm_entry(time_call(passes, a, w, gs, iters=iters), flops),
    }
    want = plain(a, wq, gs)
    for v in gemm_ffi.grouped_gemm_qw_variants():
        if v.endswith("_bk") != transpose:
            continue
        qw = jax.jit(lambda a, w, gs, v=v: gemm_ffi.grouped_gemm_qw_cuda(a, w, gs, transpose_rhs=transpose, variant=v))
        res["qw:" + v] = gemm_entry(time_call(qw, a, w, gs, iters=iters), flops) | _agreement(qw(a, w, gs), want)
    best = min((k for k in res if k.startswith("qw:")), key=lambda k: res[k]["ms"])
    res["qw"] = res[best] | {"variant": best[3:]}
    # The mixed tiles: every variant working on its band of each group.
    fits = tuple(v for v in gemm_ffi.grouped_gemm_qw_variants() if registry.variant(v).rhs_k_major == transpose)
    if len(fits) > 1:
        mixed = jax.jit(lambda a, w, gs: gemm_ffi.grouped_gemm_qw_cuda(a, w, gs, transpose_rhs=transpose, variant=fits))
        res["qw_mixed"] = gemm_entry(time_call(mixed, a, w, gs, iters=iters), flops) | _agreement(mixed(a, w, gs), want)
    # The default call: every variant launched, the one (or the mixed tiles) chosen on the device from the sizes.
    first, is_mixed = (int(x) for x in jax.jit(gemm_ffi.qw_choice, static_argnums=1)(gs, fits))
    chosen = "mixed" if is_mixed == 1 else fits[first]
    auto = jax.jit(lambda a, w, gs: gemm_ffi.grouped_gemm_qw_cuda(a, w, gs, transpose_rhs=transpose))
    res["qw_device_choice"] = (gemm_entry(time_call(auto, a, w, gs, iters=iters), flops)
                               | _agreement(auto(a, w, gs), want) | {"variant": chosen})
    res["device_choice_over_best"] = res["qw_device_choice"]["ms"] / res["qw"]["ms"]
    res["speedup_vs_fake_quantize+bf16"] = res["fake_quantize+bf16"]["ms"] / res["qw"]["ms"]
    res["qw_over_prequantized"] = res["qw"]["ms"] / res["bf16_prequantized"]["ms"]
    return res


def bench_shape(name: str, iters: int, skew: float = 0.0, alpha: float | None = None) -> dict:
    res, a, w, gs = gemm_problem(name, skew, alpha)
    flops = res["flops"]
    res["fprop"] = bench_layout(a, w, gs, flops, False, iters)
    res["dgrad"] = bench_layout(a, jnp.swapaxes(w, 1, 2), gs, flops, True, iters)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="nano_fc1,nano_fc2,moe32,moe8")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skew", type=float, default=0.0,
                    help="unequal group sizes like a router's (common.routed_group_sizes); 0: equal")
    ap.add_argument("--alpha", type=float, default=None,
                    help="group sizes as a router makes them (shapes.router_group_sizes, Dirichlet(alpha)); "
                         "overrides --skew")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "gemm_qw_h200.json")
    ns = ap.parse_args(argv)
    if not (ffi.available() and gemm_ffi.grouped_gemm_qw_variants()) or jax.devices()[0].platform != "gpu":
        print("needs a GPU and the built extension (tools/build_kernels.py)")
        return 1
    report = gemm_report(
        "grouped GEMM by a bf16 weight's MXFP8 values: quantized in registers vs a fake-quantize pass first",
        "benchmarks/bench_gemm_qw.py", sys.argv[1:] if argv is None else argv,
    )
    bench_gemm_shapes(report, ns.shapes, lambda name: bench_shape(name, ns.iters, ns.skew, ns.alpha), ns.out)

    def cell(e):
        return gemm_cell(e, 5)

    print(f"{'shape':9} {'layout':6} | {'bf16 pre-q':>13} | {'fakeq+bf16':>13} | {'qw':>13} | {'speed-up':>8} "
          f"{'qw/pre':>6} | {'bitwise':>7} {'max ulp':>7}")
    for name, r in report["shapes"].items():
        for layout in ("fprop", "dgrad"):
            e = r[layout]
            print(f"{name:9} {layout:6} | {cell(e['bf16_prequantized'])} | {cell(e['fake_quantize+bf16'])} | "
                  f"{cell(e['qw'])} | {e['speedup_vs_fake_quantize+bf16']:8.2f} {e['qw_over_prequantized']:6.2f} | "
                  f"{e['qw']['bitwise_equal_fraction']:7.4f} {e['qw']['max_diff_bf16_ulps']:7.2f}")
            for k, q in e.items():
                if k.startswith("qw:"):
                    print(f"    {k:48} {cell(q)}  bitwise {q['bitwise_equal_fraction']:.4f}")
            if "qw_mixed" in e:
                q = e["qw_mixed"]
                print(f"    {'mixed tiles (every variant on its band)':48} {cell(q)}  bitwise {q['bitwise_equal_fraction']:.4f}")
            d = e["qw_device_choice"]
            print(f"    {'default (device choice: ' + d['variant'] + ')':48} {cell(d)}  bitwise "
                  f"{d['bitwise_equal_fraction']:.4f}  / best {e['device_choice_over_best']:.3f}")
    print("columns: ms TFLOP/s; qw = the best qw variant alone; speed-up = fake_quantize+bf16 / qw; "
          "qw/pre = qw / bf16 on pre-quantized weights; default = the op's call, tile chosen on the device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
