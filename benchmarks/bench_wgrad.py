"""The weight-gradient kernel's variants at the MLP shapes: ms, TFLOP/s, and agreement.

    PYTHONPATH=. python3 benchmarks/bench_wgrad.py [--shapes nano] [--skew S] [--out X.json]

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
from common import MLP_SHAPES, RESULTS, gemm_cell, gemm_entry, gemm_report, routed_group_sizes, time_call, write_report  # noqa: E402


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="nano")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skew", type=float, default=0.0, help="unequal group sizes (common.routed_group_sizes)")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "wgrad_h200.json")
    ns = ap.parse_args(argv)
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
