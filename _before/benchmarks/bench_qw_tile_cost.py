"""What one ``_qw`` tile costs by its valid tokens: every compiled variant at equal group sizes.

    PYTHONPATH=. python3 benchmarks/bench_qw_tile_cost.py [--tokens 32,64,128,192,256,320,384]
        [--groups 128] [--dims 2688,1856] [--layouts fprop,dgrad] [--rounds 2] [--out FILE]

The ``_qw`` GEMMs (the weight quantized to MXFP8 in registers, ``gemm_ffi.grouped_gemm_qw_cuda``)
convert a weight tile once per token tile. Under router skew a group of ``s`` rows takes
``ceil(s / tile)`` token tiles, most of them partly filled, so what a partly filled tile
costs decides the mxfp8 recipe's skew cost (docs/notes/2026-12-02-skew.md, "Session 34").
Here every group holds ``T`` tokens (``--tokens``), ``G`` groups (``--groups``), ``[G * T,
K] x [G, K, N]`` (``--dims K,N``, default Nano FC1) for the ``fprop`` layout and its
transpose for ``dgrad``. For every variant and ``T``: ms per call and the **tile cost**,
SM-microseconds per CTA tile: ``ms * SMs / (G * ceil(T / tile) * ceil(N / tile_n))`` (the registry's tile sizes). A
tile bound by its weight conversion costs the same whatever ``T``; one bound by its
wgmmas grows with ``T``. ``heuristics.QW_TILE_COSTS`` models these costs (relative units).
Every (T, variant) is timed in ``--rounds`` interleaved rounds (``common.round_order``),
median. Writes JSON rows (``results/qw_tile_cost_<gpu>.json`` by default) and prints a
table: one row per ``T``, one column per variant.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src.cuda import devices, ffi, gemm_ffi
from jax_grouped_mlp.kernels import registry

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import RESULTS, command_line, round_order, time_call, write_result  # noqa: E402

def tile_cost_us(ms: float, sms: int, groups: int, tokens: int, tile_tokens: int, n: int, tile_w: int) -> float:
    """SM-microseconds per CTA tile of a ``_qw`` call that took ``ms`` on ``sms`` SMs for
    ``groups`` groups of ``tokens`` tokens each, tiles of ``tile_tokens`` tokens by
    ``tile_w`` of the ``n`` output columns (``tokens = 0``: no tile, NaN)."""
    tiles = groups * math.ceil(tokens / tile_tokens) * math.ceil(n / tile_w)
    return ms * 1e3 * sms / tiles if tiles else float("nan")


def _parse_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise SystemExit(f"{flag} takes positive integers, got {text!r}")
    return values


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="32,64,128,192,256,320,384", help="tokens per group, comma-separated")
    ap.add_argument("--groups", type=int, default=128)
    ap.add_argument("--dims", default="2688,1856", help="K,N of the fprop layout (dgrad: N,K)")
    ap.add_argument("--layouts", default="fprop,dgrad")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ns = ap.parse_args(argv)
    tokens = _parse_ints(ns.tokens, "--tokens")
    (g,) = _parse_ints(str(ns.groups), "--groups")
    dims = _parse_ints(ns.dims, "--dims")
    if len(dims) != 2:
        raise SystemExit(f"--dims takes K,N, got {ns.dims!r}")
    k, n = dims
    layouts = ns.layouts.split(",")
    if set(layouts) - {"fprop", "dgrad"}:
        raise SystemExit(f"--layouts takes fprop and/or dgrad, got {ns.layouts!r}")
    if not (ffi.available() and gemm_ffi.grouped_gemm_qw_variants()) or jax.devices()[0].platform != "gpu":
        print("needs a GPU and the built extension (tools/build_kernels.py)")
        return 1
    dev = jax.devices()[0]
    sms = devices.sm_count()
    rng = np.random.default_rng(0)
    jobs, calls = [], {}
    for layout in layouts:
        transpose = layout == "dgrad"
        kk, nn = (n, k) if transpose else (k, n)
        w = jnp.asarray(rng.standard_normal((g, kk, nn)) / np.sqrt(kk), jnp.bfloat16)
        w_in = jnp.swapaxes(w, 1, 2) if transpose else w
        for t in tokens:
            x = jnp.asarray(rng.standard_normal((g * t, kk)), jnp.bfloat16)
            gs = jnp.full((g,), t, jnp.int32)
            for v in gemm_ffi.grouped_gemm_qw_variants():
                if registry.variant(v).rhs_k_major != transpose:
                    continue
                fn = jax.jit(lambda a, b, s, v=v, tr=transpose: gemm_ffi.grouped_gemm_qw_cuda(
                    a, b, s, transpose_rhs=tr, variant=v))
                calls[layout, t, v] = (fn, (x, w_in, gs), nn)
                jobs.append((layout, t, v))
    times: dict = {j: [] for j in jobs}
    for r in range(ns.rounds):
        for job in round_order(jobs, r):
            fn, args, _ = calls[job]
            times[job].append(1e3 * time_call(fn, *args, iters=ns.iters, samples=3))
    rows = []
    for layout, t, v in jobs:
        ms = float(np.median(times[layout, t, v]))
        tt = gemm_ffi.qw_tile_tokens(v)
        rows.append({"layout": layout, "tokens_per_group": t, "variant": v, "tile_tokens": tt, "ms": ms,
                     "ms_rounds": times[layout, t, v],
                     "tile_cost_sm_us": tile_cost_us(ms, sms, g, t, tt, calls[layout, t, v][2],
                                                     registry.variant(v).tile_n)})
    for layout in layouts:
        names = [v for lay, t, v in jobs if lay == layout and t == tokens[0]]
        print(f"{layout}: ms / SM-us per tile, {g} groups, K,N = {ns.dims}")
        print(f"{'T':>5} " + " ".join(f"{v.split('_qw_')[-1]:>24}" for v in names))
        for t in tokens:
            cells = [next(r for r in rows if (r["layout"], r["tokens_per_group"], r["variant"]) == (layout, t, v))
                     for v in names]
            print(f"{t:5d} " + " ".join(f"{c['ms']:9.3f} / {c['tile_cost_sm_us']:9.1f}  " for c in cells))
    out = ns.out or RESULTS / f"qw_tile_cost_{dev.device_kind.split()[-1].lower()}.json"
    write_result(out, command=command_line("benchmarks/bench_qw_tile_cost.py", sys.argv[1:] if argv is None else argv),
                 rows=rows, extra={"sms": sms, "groups": g, "dims": [k, n]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
