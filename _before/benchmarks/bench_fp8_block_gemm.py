"""FP8 block-scaled grouped GEMM (every compiled variant) next to our bf16 grouped GEMM, one process.

    PYTHONPATH=. python benchmarks/bench_fp8_block_gemm.py [--shapes moe8,nano_fc1] [--skew 1.0] [--rounds 3]

Shapes (``benchmarks/common.py`` GEMM_SHAPES, ``[M, K] x [G, K, N] -> [M, N]``, equal
group sizes unless ``--skew``):
  moe8      8 x 8192 rows, 4096 -> 4096        (issue 20's bar: >= 1150 TFLOP/s)
  nano_fc1  128 x 384 = 49152 rows, 2688 -> 1856 (bar: >= 900 TFLOP/s)
K = 2688 is 21 x 128; N = 1856 is 14.5 x 128: the kernel takes it as 15 column tiles of
128, the last one half empty (its B rows past N are zero-filled by TMA, its columns past N
never stored), so 3.4% of the MMA work is padding. Nothing is padded in memory.

What is timed: the GEMM only. ``fp8_block``: ``gemm_ffi.grouped_gemm_fp8_block``, every
compiled variant (``fp8_block`` is the default for the shape,
``gemm_ffi.fp8_block_default_variant``; each other variant is a row
``fp8_block:<name>``; with ``--rounds R`` all candidates are timed in R interleaved
rounds and each entry is the median, since this machine drifts by 10 % within a
process), on operands quantized beforehand (x along K in 1 x 128 blocks; w in 128 x 128 tiles,
transposed to ``[G, N, K]``, exact); ``bf16``: ``gemm_ffi.grouped_gemm_bf16_cuda`` (default
variant) on the bf16 operands. TFLOP/s = 2 M N K / time. ``rel_err``: the FP8 kernel's
norm-wise error against the bf16 kernel on the *dequantized* operands (the same products,
summed in float32; the difference is the FP8 wgmma's internal accumulation plus bf16
rounding). Writes JSON to benchmarks/results/ (``--out``).
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src.cuda import ffi, gemm_ffi
from jax_grouped_mlp._src.formats import fp8_block
from jax_grouped_mlp.kernels import registry

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import RESULTS, gemm_entry, gemm_problem, gemm_report, time_call, write_report  # noqa: E402

BARS = {"moe8": 1150.0, "nano_fc1": 900.0}  # issue 20 item 3, TFLOP/s


def bench(name: str, skew: float, iters: int, rounds: int = 1) -> dict:
    header, a, w, gs = gemm_problem(name, skew)
    lhs = jax.jit(lambda a: fp8_block.quantize_fp8_block(a, axis=1))(a)
    rhs = jax.jit(lambda w: fp8_block.transpose_tiles(fp8_block.quantize_fp8_block(w, axis=(1, 2))))(w)
    fp8 = jax.jit(gemm_ffi.grouped_gemm_fp8_block, static_argnames="variant")
    bf16 = jax.jit(gemm_ffi.grouped_gemm_bf16_cuda)
    flops = header["flops"]
    row = dict(header)
    compiled = gemm_ffi.grouped_gemm_fp8_block_variants()
    default = gemm_ffi.fp8_block_default_variant(int(w.shape[2]), compiled)
    variants = [default] + [v for v in compiled if v != default]
    keys = ["fp8_block"] + [f"fp8_block:{v}" for v in variants[1:]]
    calls = {k: functools.partial(fp8, variant=v) for k, v in zip(keys, variants)}
    calls["bf16"] = bf16
    args = {k: (lhs, rhs, gs) for k in keys} | {"bf16": (a, w, gs)}
    times = {k: [] for k in calls}
    for _ in range(max(rounds, 1)):
        for k, fn in calls.items():
            times[k].append(time_call(fn, *args[k], iters=iters))
    for k, v in zip(keys, variants):
        row[k] = gemm_entry(float(np.median(times[k])), flops)
        row[k]["variant"] = v
        row[k]["ms_rounds"] = times[k]
    row["bf16"] = gemm_entry(float(np.median(times["bf16"])), flops)
    row["bf16"]["variant"] = gemm_ffi.default_variant(
        w.shape[2], tuple(v for v in gemm_ffi.grouped_gemm_variants() if not registry.variant(v).rhs_k_major)
    )
    row["bf16"]["ms_rounds"] = times["bf16"]
    row["speedup_vs_bf16"] = row["bf16"]["ms"] / row["fp8_block"]["ms"]
    if name in BARS:
        row["bar_tflops"] = BARS[name]
    # Accuracy: the same dequantized operands through the bf16 kernel (exact products).
    deq_a = fp8_block.dequantize_fp8_block(lhs, jnp.bfloat16)
    deq_w = fp8_block.dequantize_fp8_block(rhs, jnp.bfloat16)
    got = np.asarray(fp8(lhs, rhs, gs).astype(jnp.float32), np.float64)
    want = np.asarray(
        jax.jit(gemm_ffi.grouped_gemm_bf16_cuda, static_argnames="transpose_rhs")(
            deq_a, deq_w, gs, transpose_rhs=True
        ).astype(jnp.float32),
        np.float64,
    )
    row["rel_err_vs_bf16_on_dequantized"] = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    row["nan_outputs"] = int(np.isnan(got).sum())
    # Every variant gives the same bits (each K block reduced and promoted alike, in order).
    row["variants_bitwise_equal"] = None if len(keys) == 1 else all(
        bool(np.array_equal(np.asarray(calls[k](lhs, rhs, gs)).view(np.uint16), np.asarray(fp8(lhs, rhs, gs)).view(np.uint16)))
        for k in keys[1:]
    )
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="moe8,nano_fc1")
    ap.add_argument("--skew", type=float, default=0.0, help="routed_group_sizes skew (0: equal groups)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved timing rounds (median)")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "fp8_block_gemm.json")
    ns = ap.parse_args(argv)
    if jax.devices()[0].platform != "gpu" or not (ffi.available() and gemm_ffi.grouped_gemm_fp8_block_variants()):
        print("needs the built extension with the fp8_block kernel and a CUDA GPU")
        return 1
    report = gemm_report("FP8 block-scaled grouped GEMM vs our bf16 grouped GEMM", __file__, sys.argv[1:])
    report["skew"] = ns.skew
    report["rounds"] = ns.rounds
    print(f"{'shape':10} {'fp8_block ms':>12} {'TFLOP/s':>8} {'bf16 ms':>9} {'TFLOP/s':>8} {'x bf16':>7} {'bar':>6} {'rel_err':>9}")
    for name in ns.shapes.split(","):
        r = bench(name, ns.skew, ns.iters, ns.rounds)
        report["shapes"][name] = r
        f, b = r["fp8_block"], r["bf16"]
        print(f"{name:10} {f['ms']:12.3f} {f['tflops']:8.0f} {b['ms']:9.3f} {b['tflops']:8.0f} "
              f"{r['speedup_vs_bf16']:7.2f} {r.get('bar_tflops', float('nan')):6.0f} "
              f"{r['rel_err_vs_bf16_on_dequantized']:9.2e}", flush=True)
        for key in (k for k in r if k.startswith("fp8_block:")):
            v = r[key]
            print(f"  {key:60} {v['ms']:8.3f} ms {v['tflops']:6.0f} TFLOP/s  x default {f['ms'] / v['ms']:5.2f}")
        print(f"  variants bitwise equal: {r['variants_bitwise_equal']}", flush=True)
    write_report(report, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
