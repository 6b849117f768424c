"""MXFP8 grouped GEMM on Hopper: strategy 1 (FP8 wgmma + per-32-K promotion) vs strategy 2
(the bf16 kernel on dequantized operands), DESIGN.md "the central performance problem".

    PYTHONPATH=. python3 benchmarks/bench_mxfp8_strategies.py [--shapes moe8,...] [--out FILE]

One process, the same operands for every candidate: ``x [M, K]`` quantized rowwise and a
weight ``w_t [G, N, K]`` quantized along K (as FP8 wgmma wants it, K-major), equal group
sizes. Shapes (G groups x rows, K -> N): moe8 8 x 8192, 4096 -> 4096; moe32 32 x 1024,
4096 -> 1536; nano_fc1 128 x 384, 2688 -> 1856; nano_fc2 128 x 384, 1856 -> 2688.

Candidates (TFLOP/s = 2 M N K / time):
  s1:<variant>        the FP8 kernel on operands already in its layout (data as is, scales
                      decoded to float32 and laid out beforehand): the kernel alone
  s1_with_scale_prep  ``gemm_fp8_ffi.grouped_gemm_fp8_cuda`` on the MXFP8 tensors: the
                      default variant plus the XLA ops that decode and lay out the scales
  s2:<variant>        ``gemm_ffi.grouped_gemm_bf16_cuda`` on the dequantized bf16 operands,
                      every compiled variant ([G, K, N] materialized for the plain ones,
                      [G, N, K] as stored for the "_bk" ones): the kernel alone
  s2_with_dequant     dequantize both MXFP8 operands in XLA, then the default "_bk" bf16
                      kernel, in one jit (strategy 2 with the conversion outside the kernel)
Ratios: ``s2_best_ms / s1_best_ms`` (> 1: strategy 1 is faster) for the kernels alone and
for the end-to-end forms. ``s1_rel_err_vs_s2``: relative Frobenius distance between the
two outputs (both bf16; s2's products are exact, so this is strategy 1's error).
Writes JSON (``--out``, default benchmarks/results/mxfp8_strategies_h200.json).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src import ffi, gemm_ffi, gemm_fp8_ffi, mxfp8

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import RESULTS, device_description, time_call, write_json  # noqa: E402

SHAPES = {  # name: (groups, rows per group, K, N)
    "moe8": (8, 8192, 4096, 4096),
    "moe32": (32, 1024, 4096, 1536),
    "nano_fc1": (128, 384, 2688, 1856),
    "nano_fc2": (128, 384, 1856, 2688),
}


def _entry(seconds: float, flops: float) -> dict:
    return {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12}


def _best(res: dict, prefix: str) -> tuple[str, dict]:
    cands = {k: v for k, v in res.items() if k.startswith(prefix)}
    name = min(cands, key=lambda k: cands[k]["ms"])
    return name.split(":", 1)[1], cands[name]


def bench_shape(name: str, iters: int) -> dict:
    g, rows, k, n = SHAPES[name]
    m = g * rows
    flops = 2.0 * m * n * k
    kx, kw = jax.random.split(jax.random.key(abs(hash(name)) % 2**31))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w_t = (jax.random.normal(kw, (g, n, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    gs = jnp.full((g,), rows, jnp.int32)
    lhs = jax.jit(lambda x: mxfp8.quantize_mxfp8(x, axis=1))(x)
    rhs_t = jax.jit(lambda w: mxfp8.quantize_mxfp8(w, axis=2))(w_t)
    del x, w_t
    res: dict = {"shape": {"G": g, "rows_per_group": rows, "M": m, "K": k, "N": n}, "flops": flops}

    # Strategy 1: the kernel alone, then with the scale preparation.
    out_s1 = None
    for variant in gemm_fp8_ffi.grouped_gemm_fp8_variants():
        t = gemm_ffi.tile_n(variant)
        sa = gemm_fp8_ffi.lhs_scales(lhs.scale)
        sb = gemm_fp8_ffi.rhs_scales(rhs_t.scale, t)
        fn = jax.jit(lambda a, b, sa, sb, gs, v=variant: gemm_fp8_ffi.grouped_gemm_fp8_raw(a, b, sa, sb, gs, variant=v))
        res[f"s1:{variant}"] = _entry(time_call(fn, lhs.data, rhs_t.data, sa, sb, gs, iters=iters), flops)
        if out_s1 is None:
            out_s1 = fn(lhs.data, rhs_t.data, sa, sb, gs).astype(jnp.float32)
        del sa, sb
    s1_full = jax.jit(lambda l, r, gs: gemm_fp8_ffi.grouped_gemm_fp8_cuda(l, r, gs))
    res["s1_with_scale_prep"] = _entry(time_call(s1_full, lhs, rhs_t, gs, iters=iters), flops)
    res["s1_with_scale_prep"]["variant"] = gemm_fp8_ffi.default_fp8_variant()

    # Strategy 2: the bf16 kernel on the dequantized operands.
    a = mxfp8.dequantize(lhs, jnp.bfloat16)
    b_nk = mxfp8.dequantize(rhs_t, jnp.bfloat16)  # [G, N, K]
    b_kn = jnp.swapaxes(b_nk, 1, 2)  # [G, K, N], materialized
    out_s2 = None
    for variant in gemm_ffi.grouped_gemm_variants():
        bk = variant.endswith("_bk")
        fn = jax.jit(lambda a, b, gs, v=variant, bk=bk: gemm_ffi.grouped_gemm_bf16_cuda(a, b, gs, variant=v, transpose_rhs=bk))
        b = b_nk if bk else b_kn
        res[f"s2:{variant}"] = _entry(time_call(fn, a, b, gs, iters=iters), flops)
        if out_s2 is None:
            out_s2 = fn(a, b, gs).astype(jnp.float32)
    del a, b_nk, b_kn
    s2_full = jax.jit(lambda l, r, gs: gemm_ffi.grouped_gemm_bf16_cuda(
        mxfp8.dequantize(l, jnp.bfloat16), mxfp8.dequantize(r, jnp.bfloat16), gs, transpose_rhs=True))
    res["s2_with_dequant"] = _entry(time_call(s2_full, lhs, rhs_t, gs, iters=iters), flops)

    res["s1_rel_err_vs_s2"] = float(jnp.linalg.norm(out_s1 - out_s2) / jnp.linalg.norm(out_s2))
    s1v, s1 = _best(res, "s1:")
    s2v, s2 = _best(res, "s2:")
    res["s1_best"] = {"variant": s1v, **s1}
    res["s2_best"] = {"variant": s2v, **s2}
    res["speedup_s1_over_s2_kernels"] = s2["ms"] / s1["ms"]
    res["speedup_s1_over_s2_end_to_end"] = res["s2_with_dequant"]["ms"] / res["s1_with_scale_prep"]["ms"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "mxfp8_strategies_h200.json")
    ns = ap.parse_args(argv)
    if (
        not (ffi.available() and gemm_fp8_ffi.grouped_gemm_fp8_variants() and gemm_ffi.grouped_gemm_variants())
        or jax.devices()[0].platform != "gpu"
    ):
        print("needs a GPU and the built extension (tools/build_kernels.py)")
        return 1
    report = {
        "what": "MXFP8 grouped GEMM: strategy 1 (FP8 wgmma + promotion) vs strategy 2 (bf16 kernel on dequantized operands)",
        "command": "PYTHONPATH=. python3 " + " ".join(["benchmarks/bench_mxfp8_strategies.py", *sys.argv[1:]]),
        **device_description(),
        "timing": "median of 5 x (iters back-to-back dispatches / iters), after warm-up",
        "shapes": {},
    }
    for name in ns.shapes.split(","):
        report["shapes"][name] = r = bench_shape(name, ns.iters)
        for key, v in r.items():
            if isinstance(v, dict) and "ms" in v:
                print(f"  {name:9} {key:58} {v['ms']:8.3f} ms {v['tflops']:7.1f} TFLOP/s", flush=True)
    write_json(report, ns.out)
    print(f"\n{'shape':9} {'s1 best':44} {'ms':>7} {'TF/s':>6} | {'s2 best':42} {'ms':>7} {'TF/s':>6} | "
          f"{'s2/s1':>5} {'e2e s2/s1':>9} {'s1 err':>8}")
    for name, r in report["shapes"].items():
        s1, s2 = r["s1_best"], r["s2_best"]
        print(f"{name:9} {s1['variant']:44} {s1['ms']:7.3f} {s1['tflops']:6.0f} | {s2['variant']:42} {s2['ms']:7.3f} "
              f"{s2['tflops']:6.0f} | {r['speedup_s1_over_s2_kernels']:5.2f} {r['speedup_s1_over_s2_end_to_end']:9.2f} "
              f"{r['s1_rel_err_vs_s2']:8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
