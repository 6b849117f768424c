#!/usr/bin/env python3
"""Runs the bf16 weight gradient dW1 of the Nano step once with equal group sizes and once
with Dirichlet(1) router sizes, for ``ncu`` (no timing, no warm-up): where its skew cost
goes (per-SM active cycles min / avg / max for imbalance, DRAM bytes and throughput for a
store-bound phase, the tensor pipes for the MMAs).

    ncu --clock-control none -k regex:GroupedWgradSm90 -c 2 --section SpeedOfLight \
        --section LaunchStats --section Occupancy \
        --metrics sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,dram__bytes_read.sum,dram__bytes_write.sum \
        python3 tools/ncu_wgrad_skew.py

Shape: 128 groups, 49152 rows, X [M, 2688], dY [M, 1856] (DESIGN.md's Nano FC1 weight
gradient); the Dirichlet draw is ``benchmarks/shapes.router_group_sizes(49152, 128, 1.0, 0)``,
as ``bench_mlp.py --alphas 1`` uses. Prints the launches' order.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from shapes import router_group_sizes  # noqa: E402

from jax_grouped_mlp._src.cuda import gemm_ffi  # noqa: E402


def main() -> int:
    g, m, k, n = 128, 49152, 2688, 1856
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n), np.float32), jnp.bfloat16)
    wgrad = jax.jit(gemm_ffi.grouped_wgrad_bf16_cuda)
    for name, alpha in (("equal sizes", float("inf")), ("Dirichlet(1)", 1.0)):
        gs = jnp.asarray(router_group_sizes(m, g, alpha, 0))
        jax.block_until_ready(wgrad(x, dy, gs))
        print(f"launched dW1 with {name}: sizes {int(gs.min())}..{int(gs.max())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
