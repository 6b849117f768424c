"""Weight fake-quantize run beside a GEMM kernel (second stream) vs after it.

    PYTHONPATH=. python3 benchmarks/bench_beside.py [--shape nano] [--reserves 0,16,32,48] [--out X.json]

The MXFP8 training step quantizes each weight twice (along K for the forward GEMM,
along N for the dgrad): four memory-bound passes over a weight as large as the
GEMM's whole work at the Nemotron-3-Nano shape. ``grouped_mlp`` hands three of them
to a GEMM kernel as side work. For each pairing the op uses, on the same inputs in
one process:
  gemm_alone / fake_quantize_alone   each kernel by itself
  sequential                         the GEMM, then the fake-quantize (one stream)
  beside:<r>                         the "_beside" target, the GEMM leaving r SMs free
and ``saved_ms = sequential - best beside``. Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

from jax_grouped_mlp._src import ffi, gemm_ffi

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import MLP_SHAPES, RESULTS, gemm_report, time_call, write_json  # noqa: E402


def _pairings(g: int, rows: int, h: int, f: int, key) -> dict:
    """name -> (gemm fn taking side kwargs, its operands, the side weight, side axis)."""
    m = g * rows
    ks = jax.random.split(key, 6)
    bf = lambda k, s, scale=1.0: (jax.random.normal(k, s, jnp.float32) * scale).astype(jnp.bfloat16)  # noqa: E731
    x, dy, a = bf(ks[0], (m, h)), bf(ks[1], (m, h)), bf(ks[2], (m, f))
    w1, w2 = bf(ks[3], (g, h, f), h**-0.5), bf(ks[4], (g, f, h), f**-0.5)
    gs = jnp.full((g,), rows, jnp.int32)
    probs = jax.random.uniform(ks[5], (m,), jnp.float32)
    gemm = gemm_ffi.grouped_gemm_bf16_cuda
    return {
        "fc1 + w2 along K": (lambda x, w, gs, **kw: gemm(x, w, gs, **kw), (x, w1, gs), w2, 1),
        "fc1_epilogue + w2 along K": (
            lambda x, w, gs, **kw: gemm_ffi.grouped_gemm_fc1_cuda(x, w, gs, probs, **kw), (x, w1, gs), w2, 1),
        "dW2 + w2 along N": (lambda a, dy, gs, **kw: gemm_ffi.grouped_wgrad_bf16_cuda(a, dy, gs, **kw), (a, dy, gs), w2, 2),
        "fc2 dgrad + w1 along N": (
            lambda dy, w, gs, **kw: gemm(dy, w, gs, transpose_rhs=True, **kw), (dy, w2, gs), w1, 2),
    }


def bench(shape: str, reserves: list[int], iters: int) -> dict:
    g, rows, h, f = MLP_SHAPES[shape]
    out: dict = {"shape": {"G": g, "rows_per_group": rows, "H": h, "F": f}}
    for name, (fn, ops, side, axis) in _pairings(g, rows, h, f, jax.random.key(0)).items():
        r: dict = {}
        r["gemm_alone_ms"] = 1e3 * time_call(jax.jit(fn), *ops, iters=iters)
        fq = jax.jit(lambda w, axis=axis: ffi.fake_quantize_cuda(w, axis=axis))
        r["fake_quantize_alone_ms"] = 1e3 * time_call(fq, side, iters=iters)
        both = jax.jit(lambda *o, side: fn(*o, side=side, side_axis=axis))
        with gemm_ffi.beside_config(enabled=False):
            seq = both.lower(*ops, side=side).compile()
        r["sequential_ms"] = 1e3 * time_call(lambda *o: seq(*o, side=side), *ops, iters=iters)
        want = jax.tree.leaves(seq(*ops, side=side))
        for reserve in reserves:
            with gemm_ffi.beside_config(enabled=True, reserve_sms=reserve):
                bes = both.lower(*ops, side=side).compile()
            ms = 1e3 * time_call(lambda *o: bes(*o, side=side), *ops, iters=iters)
            same = all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(bes(*ops, side=side)), want))
            r[f"beside:{reserve}"] = {"ms": ms, "bitwise_equal_to_sequential": same}
        best = min((k for k in r if k.startswith("beside:")), key=lambda k: r[k]["ms"])
        r["best_reserve"] = int(best.split(":")[1])
        r["saved_ms"] = r["sequential_ms"] - r[best]["ms"]
        out[name] = r
        print(name, json.dumps(r), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="nano", choices=sorted(MLP_SHAPES))
    ap.add_argument("--reserves", default="0,8,16,24,32,48,64")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "beside_h200.json")
    ns = ap.parse_args(argv)
    if not (ffi.available() and gemm_ffi.grouped_gemm_variants()) or jax.devices()[0].platform != "gpu":
        print("needs a GPU and the built extension (tools/build_kernels.py)")
        return 1
    report = gemm_report("weight fake-quantize beside a GEMM kernel vs after it", "benchmarks/bench_beside.py", sys.argv[1:])
    report["shapes"][ns.shape] = bench(ns.shape, [int(r) for r in ns.reserves.split(",")], ns.iters)
    write_json(report, ns.out)
    reserves = [int(r) for r in ns.reserves.split(",")]
    print(f"{'pairing':28} {'gemm':>7} {'fq':>7} {'seq':>7} " + " ".join(f"{'r=' + str(r):>7}" for r in reserves) + "  saved")
    for name, r in report["shapes"][ns.shape].items():
        if name == "shape":
            continue
        cells = " ".join(f"{r[f'beside:{x}']['ms']:7.3f}" for x in reserves)
        print(f"{name:28} {r['gemm_alone_ms']:7.3f} {r['fake_quantize_alone_ms']:7.3f} {r['sequential_ms']:7.3f} {cells}  "
              f"{r['saved_ms']:.3f} (r={r['best_reserve']})")
    print("ms per call; all beside results bitwise equal to sequential:",
          all(v["bitwise_equal_to_sequential"] for r in report["shapes"][ns.shape].values() if isinstance(r, dict)
              for k, v in r.items() if k.startswith("beside:")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
