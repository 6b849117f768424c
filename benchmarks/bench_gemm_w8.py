"""MXFP8-weight grouped GEMM: weights converted in the kernel vs converted before it.

    PYTHONPATH=. python3 benchmarks/bench_gemm_w8.py [--shapes moe8,nano_fc1] [--out X.json]

For each shape (G groups of equal size, ``[M, K] x [G, K, N] -> [M, N]``), on the same
inputs in one process:
  bf16_predequantized   the bf16 kernel on weights already dequantized to bf16 (the
                        GEMM alone, the weights read as bf16: the ceiling to match)
  fake_quantize+bf16    fake-quantize kernel on the bf16 weight (its MXFP8 values as
                        bf16), then the bf16 kernel: what the library does today
  xla_dequantize+bf16   XLA's dequantize of the MXFP8 weight, then the bf16 kernel
  w8:<variant>          the in-kernel conversion, weights given as FP8 + E8M0 scales
                        (every compiled variant of the weight's layout)
  w8_kmajor:<variant>   the same with the weight stored transposed ``[G, N, K]`` (dgrad use)
Each w8 output is compared bit for bit with the bf16 kernel of the same tile width on
the dequantized weight (``bitwise_equal_to_bf16``). TFLOP/s = 2 M N K / time.
Writes JSON to benchmarks/results/gemm_w8_h200.json (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import jax
import jax.numpy as jnp

from jax_grouped_mlp._src.cuda import ffi, gemm_ffi
from jax_grouped_mlp._src.formats import mxfp8

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import GEMM_SHAPES, bench_gemm_shapes, gemm_cell, gemm_entry, gemm_problem, gemm_report, time_call  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SHAPES = GEMM_SHAPES


def _bf16_twin(variant: str) -> str:
    tn = gemm_ffi.tile_n(variant)
    bk = "_bk" if variant.endswith("_bk") else ""
    pat = re.compile(rf"grouped_gemm_sm90_bf16_m128n{tn}k64_s\d+{bk}$")
    return next(v for v in gemm_ffi.grouped_gemm_variants() if pat.match(v))


def bench_shape(name: str, iters: int, kmajor: bool) -> dict:
    res, a, w, gs = gemm_problem(name)
    flops = res["flops"]
    g, _, k, n = SHAPES[name]
    res["weight_bytes"] = {"bf16": g * k * n * 2, "mxfp8": g * k * n + g * -(-k // 32) * n}

    wq = jax.jit(lambda w: mxfp8.quantize_mxfp8(w, axis=1))(w)
    w_deq = jax.jit(lambda t: mxfp8.dequantize(t, jnp.bfloat16))(wq)
    default_bf16 = gemm_ffi.default_variant(n, tuple(v for v in gemm_ffi.grouped_gemm_variants() if not v.endswith("_bk")))

    bf16 = jax.jit(lambda a, b, gs: gemm_ffi.grouped_gemm_bf16_cuda(a, b, gs, variant=default_bf16))
    res["bf16_predequantized"] = gemm_entry(time_call(bf16, a, w_deq, gs, iters=iters), flops)
    res["bf16_predequantized"]["variant"] = default_bf16

    fq = jax.jit(lambda a, w, gs: gemm_ffi.grouped_gemm_bf16_cuda(a, ffi.fake_quantize_cuda(w, axis=1), gs, variant=default_bf16))
    res["fake_quantize+bf16"] = gemm_entry(time_call(fq, a, w, gs, iters=iters), flops)
    fq_w = jax.jit(lambda w: ffi.fake_quantize_cuda(w, axis=1))
    res["fake_quantize_alone"] = gemm_entry(time_call(fq_w, w, iters=iters), flops)

    xq = jax.jit(lambda a, t, gs: gemm_ffi.grouped_gemm_bf16_cuda(a, mxfp8.dequantize(t, jnp.bfloat16), gs, variant=default_bf16))
    res["xla_dequantize+bf16"] = gemm_entry(time_call(xq, a, wq, gs, iters=iters), flops)

    layouts = [(False, wq, w_deq)]
    if kmajor:
        wq_t = jax.jit(lambda w: mxfp8.quantize_mxfp8(jnp.swapaxes(w, 1, 2), axis=2))(w)
        layouts.append((True, wq_t, jax.jit(lambda t: mxfp8.dequantize(t, jnp.bfloat16))(wq_t)))
    for bk, wl, wl_deq in layouts:
        for variant in gemm_ffi.grouped_gemm_w8_variants():
            if variant.endswith("_bk") != bk:
                continue
            fn = jax.jit(lambda a, t, gs, v=variant, bk=bk: gemm_ffi.grouped_gemm_w8_cuda(a, t, gs, variant=v, transpose_rhs=bk))
            e = gemm_entry(time_call(fn, a, wl, gs, iters=iters), flops)
            twin = _bf16_twin(variant)
            got = fn(a, wl, gs)
            want = gemm_ffi.grouped_gemm_bf16_cuda(a, wl_deq, gs, variant=twin, transpose_rhs=bk)
            e["bitwise_equal_to_bf16"] = bool(jnp.array_equal(got, want))
            e["bf16_twin"] = twin
            if bk:
                tw = jax.jit(lambda a, b, gs, v=twin: gemm_ffi.grouped_gemm_bf16_cuda(a, b, gs, variant=v, transpose_rhs=True))
                e["bf16_twin_predequantized"] = gemm_entry(time_call(tw, a, wl_deq, gs, iters=iters), flops)
            res[("w8_kmajor:" if bk else "w8:") + variant] = e
        del wl, wl_deq

    w8 = {kk: v for kk, v in res.items() if kk.startswith("w8:")}
    best = min(w8, key=lambda kk: w8[kk]["ms"])
    res["w8_best"] = best.split(":", 1)[1]
    res["w8_default"] = gemm_ffi.default_variant(n, tuple(v for v in gemm_ffi.grouped_gemm_w8_variants() if not v.endswith("_bk")))
    res["ratios"] = {
        "fake_quantize+bf16 / w8_best (speed-up)": res["fake_quantize+bf16"]["ms"] / w8[best]["ms"],
        "xla_dequantize+bf16 / w8_best (speed-up)": res["xla_dequantize+bf16"]["ms"] / w8[best]["ms"],
        "w8_best / bf16_predequantized (time)": w8[best]["ms"] / res["bf16_predequantized"]["ms"],
    }
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-kmajor", action="store_true", help="skip the K-major ([G, N, K]) weight variants")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "gemm_w8_h200.json")
    ns = ap.parse_args(argv)
    if not (ffi.available() and gemm_ffi.grouped_gemm_w8_variants()) or jax.devices()[0].platform != "gpu":
        print("needs a GPU and the built extension (tools/build_kernels.py)")
        return 1
    report = gemm_report(
        "grouped GEMM with MXFP8 weights: in-kernel conversion vs conversion before the bf16 kernel",
        "benchmarks/bench_gemm_w8.py", sys.argv[1:],
    )
    bench_gemm_shapes(report, ns.shapes, lambda name: bench_shape(name, ns.iters, not ns.no_kmajor), ns.out)
    cell = gemm_cell

    print(f"{'shape':9} | {'bf16 pre-deq':>14} | {'fakeq+bf16':>14} | {'xla deq+bf16':>14} | "
          f"{'w8 best':>14} {'variant':36} {'bitwise':>7} | {'x fakeq':>7} {'w8/pre':>6}")
    for name, r in report["shapes"].items():
        best = r["w8:" + r["w8_best"]]
        ratios = list(r["ratios"].values())
        print(f"{name:9} | {cell(r['bf16_predequantized'])} | {cell(r['fake_quantize+bf16'])} | "
              f"{cell(r['xla_dequantize+bf16'])} | {cell(best)} {r['w8_best']:36} {str(best['bitwise_equal_to_bf16']):>7} | "
              f"{ratios[0]:7.2f} {ratios[2]:6.2f}")
        for kk, e in r.items():
            if kk.startswith(("w8:", "w8_kmajor:")):
                extra = f"  (bf16 twin pre-deq {cell(e['bf16_twin_predequantized'])})" if "bf16_twin_predequantized" in e else ""
                print(f"    {kk:50} {cell(e)}  bitwise={e['bitwise_equal_to_bf16']}{extra}")
    print("columns: ms TFLOP/s; 'x fakeq' = fake_quantize+bf16 time / w8 best time; 'w8/pre' = w8 best / bf16 on pre-dequantized weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
