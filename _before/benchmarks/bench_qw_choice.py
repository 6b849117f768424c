"""How well the ``_qw`` GEMM's device-side tile choice picks under router skew, and its cost
table fitted to the measurements.

    PYTHONPATH=. python3 benchmarks/bench_qw_choice.py [--shapes nano_fc1,nano_fc2]
        [--alphas inf,3,1,0.3] [--size-seeds 0,1,2,3] [--rounds 2] [--out FILE]
    python3 benchmarks/bench_qw_choice.py --fit FILE.json     # (no GPU) the fit of a result

The mxfp8 recipe's ``_qw`` GEMMs (``gemm_ffi.grouped_gemm_qw_cuda``) pick their token tile,
or the mixed tiles, on the device from the group sizes, by the least modelled cost
(``gemm_ffi.qw_choice``: ``heuristics.qw_tiles_cost``, ``heuristics.qw_mixed_cost`` with
``heuristics.QW_TILE_COSTS`` and ``QW_MIXED_LAUNCH_COST``). For every shape and weight
layout (``fprop``: ``[G, K, N]``; ``dgrad``: ``[G, N, K]`` used transposed) and every
router draw (``shapes.router_group_sizes``, Dirichlet(alpha), one draw per seed; ``inf``:
equal sizes, one case), this times every option of the call on the same operands:
each variant alone, the mixed tiles, and the default call (the device's choice), in
``--rounds`` interleaved rounds (``common.round_order``), median.

Then, per layout, a least-squares fit of the cost table to the measured times
(:func:`fit_costs`): each option's time is modelled as the sum over its launches of
(full tiles x full cost + half tiles x half cost) per weight tile, plus a cost per extra
working launch, plus a constant, with the work scaled by ``K x weight tiles`` so that
both shapes share one table. The fitted table is printed in ``QW_TILE_COSTS``' units
(scaled to the current table) next to the current one, with each table's **regret**: the
measured time of the option it picks over the best measured option, per case. A
table that should replace the current one must lower the regret out of sample (fit on
some draws, check on others: ``--fit`` with ``--holdout``).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
from typing import Sequence

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import RESULTS, command_line, gemm_shape, round_order  # noqa: E402

from jax_grouped_mlp._src.op import heuristics  # noqa: E402
from jax_grouped_mlp.kernels import registry  # noqa: E402

TILE_W = registry.QwGemmVariant.tile_n  # weight rows per CTA tile


# ---- the model's features (pure NumPy: tests run these on the CPU) ----

def option_names(tiles: Sequence[int]) -> list[str]:
    """The options of one call over ``tiles``: ``t<T>`` each alone, then ``mixed``."""
    return [f"t{t}" for t in tiles] + (["mixed"] if len(tiles) > 1 else [])


def tile_counts(sizes: np.ndarray, tile_t: int) -> tuple[int, int]:
    """``(full, half)``: the token tiles of ``tile_t`` that :func:`heuristics.qw_tiles_cost`
    charges at its full and at its half cost (a tile with at most half its tokens)."""
    sizes = np.maximum(np.asarray(sizes, np.int64), 0)
    rem = sizes % tile_t
    big = rem > tile_t // 2
    small = (rem > 0) & ~big
    return int((sizes // tile_t).sum() + big.sum()), int(small.sum())


def features(sizes: np.ndarray, tiles: Sequence[int], option: str, chunk: int = registry.QW_CHUNK_TOKENS) -> dict:
    """The counts the cost model charges for ``option`` (an :func:`option_names` entry):
    ``full_<T>`` and ``half_<T>`` tiles per weight tile for every tile, and ``launches``
    (working launches beyond the first). ``cost(features, table)`` is the model's cost."""
    out = {f"{kind}_{t}": 0 for t in tiles for kind in ("full", "half")} | {"launches": 0}
    sizes = np.maximum(np.asarray(sizes, np.int64), 0)
    if option == "mixed":
        parts = zip(heuristics.qw_band_rows(sizes, list(tiles), chunk), tiles)
        out["launches"] = len(tiles) - 1
    else:
        t = int(option[1:])
        if t not in tiles:
            raise ValueError(f"option {option!r} names no tile of {tiles}")
        parts = [(sizes, t)]
    for rows, t in parts:
        full, half = tile_counts(rows, t)
        out[f"full_{t}"] += full
        out[f"half_{t}"] += half
    return out


def table_params(table: dict[int, tuple[float, float]], launch: float) -> dict:
    """A cost table (``QW_TILE_COSTS``' form) and launch cost as named parameters."""
    return {f"{kind}_{t}": c for t, (full, half) in table.items() for kind, c in (("full", full), ("half", half))} | {
        "launches": launch}


def cost(feat: dict, params: dict) -> float:
    """The modelled cost of an option's :func:`features` under ``params``."""
    return float(sum(n * params[k] for k, n in feat.items()))


def pick(case_feats: dict[str, dict], params: dict) -> str:
    """The option the model picks: least cost, the first of equals (as ``gemm_ffi.qw_choice``)."""
    names = list(case_feats)
    costs = [cost(case_feats[o], params) for o in names]
    return names[int(np.argmin(costs))]


def fit_costs(cases: list[dict], tiles: Sequence[int]) -> dict:
    """Least-squares fit of the cost parameters to measured times.

    ``cases``: dicts with ``features`` (option -> :func:`features`), ``ms`` (option -> the
    measured median) and ``scale`` (``K x weight tiles`` of its shape: the work of one
    tile count). Model: ``ms = scale * sum(count * param) + const`` (one constant per
    scale, i.e. per shape). Returns ``{"params": ..., "const_ms": ..., "rms_rel": ...}``,
    the parameters in ms per unit of scale (rescale with :func:`in_table_units`)."""
    keys = [f"{kind}_{t}" for t in tiles for kind in ("full", "half")] + ["launches"]
    scales = sorted({c["scale"] for c in cases})
    rows, y = [], []
    for c in cases:
        for o, ms in c["ms"].items():
            if o not in c["features"]:
                continue
            f = c["features"][o]
            rows.append([c["scale"] * f.get(k, 0) for k in keys] + [float(c["scale"] == s) for s in scales])
            y.append(ms)
    a, y = np.asarray(rows, np.float64), np.asarray(y, np.float64)
    if len(y) < a.shape[1]:
        raise ValueError(f"{len(y)} timings cannot fit {a.shape[1]} parameters")
    sol, *_ = np.linalg.lstsq(a, y, rcond=None)
    resid = a @ sol - y
    return {"params": dict(zip(keys, map(float, sol[: len(keys)]))),
            "const_ms": {str(s): float(v) for s, v in zip(scales, sol[len(keys):])},
            "rms_rel": float(np.sqrt(np.mean((resid / y) ** 2)))}


def in_table_units(params: dict, reference: dict) -> dict:
    """``params`` scaled by one factor to the units of ``reference`` (least squares over
    the keys both have, launches excluded), so a fitted table reads next to the current one."""
    keys = [k for k in params if k in reference and k != "launches"]
    p = np.asarray([params[k] for k in keys])
    r = np.asarray([reference[k] for k in keys])
    s = float(p @ r / (p @ p)) if p @ p > 0 else 1.0
    return {k: v * s for k, v in params.items()}


def regret(cases: list[dict], params: dict) -> list[float]:
    """Per case: the measured time of the option ``params`` picks over the best measured."""
    out = []
    for c in cases:
        feats = {o: f for o, f in c["features"].items() if o in c["ms"]}
        out.append(c["ms"][pick(feats, params)] / min(c["ms"][o] for o in feats))
    return out


def summarize(cases: list[dict], tiles: Sequence[int], holdout: Sequence[int] = ()) -> dict:
    """Per layout: the current table's regret, the fitted table (on the cases whose seed is
    not in ``holdout``) in the current table's units, and its regret on all cases and on
    the held-out ones."""
    current = table_params(heuristics.QW_TILE_COSTS, heuristics.QW_MIXED_LAUNCH_COST)
    out = {}
    for layout in sorted({c["layout"] for c in cases}):
        mine = [c for c in cases if c["layout"] == layout]
        train = [c for c in mine if c["seed"] not in holdout or c["alpha"] == "inf"]
        test = [c for c in mine if c not in train]
        fit = fit_costs(train, tiles)
        fitted = in_table_units(fit["params"], current)
        entry = {"current_regret": regret(mine, current), "fit": fit, "fitted_table": fitted,
                 "fitted_regret": regret(mine, fit["params"])}
        if test:
            entry["holdout_current_regret"] = regret(test, current)
            entry["holdout_fitted_regret"] = regret(test, fit["params"])
        out[layout] = entry
    return out


def print_summary(summary: dict, cases: list[dict]) -> None:
    current = table_params(heuristics.QW_TILE_COSTS, heuristics.QW_MIXED_LAUNCH_COST)
    for layout, e in summary.items():
        print(f"== {layout}: fitted cost table (QW_TILE_COSTS units; rms error {e['fit']['rms_rel']:.1%})")
        for k in current:
            print(f"   {k:10} current {current[k]:7.3f}  fitted {e['fitted_table'].get(k, float('nan')):7.3f}")
        mine = [c for c in cases if c["layout"] == layout]
        print(f"   {'case':24} {'best':>10} {'current pick':>14} {'regret':>7} {'fitted pick':>12} {'regret':>7}")
        for c, rc, rf in zip(mine, e["current_regret"], e["fitted_regret"]):
            feats = {o: f for o, f in c["features"].items() if o in c["ms"]}
            best = min(feats, key=lambda o: c["ms"][o])
            print(f"   {c['case']:24} {best:>10} {pick(feats, current):>14} {rc:7.3f} "
                  f"{pick(feats, e['fit']['params']):>12} {rf:7.3f}")
        print(f"   mean regret: current {np.mean(e['current_regret']):.3f}, fitted {np.mean(e['fitted_regret']):.3f}"
              + (f"; held out: current {np.mean(e['holdout_current_regret']):.3f}, "
                 f"fitted {np.mean(e['holdout_fitted_regret']):.3f}" if "holdout_current_regret" in e else ""))


def _parse_list(text: str, flag: str, kind) -> list:
    try:
        values = [kind(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values if kind is float) or any(v < 0 for v in values if kind is int):
        raise SystemExit(f"{flag} takes positive numbers (seeds: non-negative), got {text!r}")
    return values


# ---- the GPU run ----

def measure(ns) -> tuple[list[dict], list[int]]:
    import jax
    import jax.numpy as jnp

    from common import time_call
    from shapes import router_group_sizes

    from jax_grouped_mlp._src.cuda import gemm_ffi

    names = gemm_ffi.grouped_gemm_qw_variants()
    jobs, calls, cases = [], {}, []
    rng = np.random.default_rng(0)
    tiles_all: list[int] = []
    for shape in ns.shapes.split(","):
        g, rows, k, n = gemm_shape(shape)
        m = g * rows
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
        for layout in ("fprop", "dgrad"):
            transpose = layout == "dgrad"
            kk, nn = (n, k) if transpose else (k, n)
            a = x if not transpose else jnp.asarray(rng.standard_normal((m, kk)), jnp.bfloat16)
            b = w if not transpose else jnp.asarray(rng.standard_normal((g, nn, kk)) / np.sqrt(kk), jnp.bfloat16)
            fits = tuple(v for v in names if registry.variant(v).rhs_k_major == transpose)
            tiles = [gemm_ffi.qw_tile_tokens(v) for v in fits]
            tiles_all = sorted(set(tiles_all) | set(tiles))
            fns = {f"t{t}": jax.jit(lambda a, b, s, v=v, tr=transpose: gemm_ffi.grouped_gemm_qw_cuda(
                a, b, s, transpose_rhs=tr, variant=v)) for t, v in zip(tiles, fits)}
            fns["mixed"] = jax.jit(lambda a, b, s, tr=transpose, f=fits: gemm_ffi.grouped_gemm_qw_cuda(
                a, b, s, transpose_rhs=tr, variant=f))
            fns["device"] = jax.jit(lambda a, b, s, tr=transpose: gemm_ffi.grouped_gemm_qw_cuda(
                a, b, s, transpose_rhs=tr))
            choose = jax.jit(gemm_ffi.qw_choice, static_argnums=1)
            for alpha in ns.alphas:
                for seed in ([0] if math.isinf(alpha) else ns.size_seeds):
                    sizes = router_group_sizes(m, g, alpha, seed)
                    gs = jnp.asarray(sizes)
                    first, mixed = (int(v) for v in choose(gs, fits))
                    case = {"shape": shape, "layout": layout, "alpha": "inf" if math.isinf(alpha) else alpha,
                            "seed": seed, "case": f"{shape} a={alpha:g} s={seed}",
                            "scale": kk * math.ceil(nn / TILE_W), "sizes": sizes.tolist(),
                            "features": {o: features(sizes, tiles, o) for o in option_names(tiles)},
                            "device_choice": "mixed" if mixed == 1 else f"t{tiles[first]}", "ms": {}}
                    cases.append(case)
                    for o in fns:
                        calls[len(cases) - 1, o] = (fns[o], (a, b, gs))
                        jobs.append((len(cases) - 1, o))
    times: dict = {j: [] for j in jobs}
    for r in range(ns.rounds):
        for job in round_order(jobs, r):
            fn, args = calls[job]
            times[job].append(1e3 * time_call(fn, *args, iters=ns.iters, samples=3))
    for (i, o), ts in times.items():
        cases[i]["ms"][o] = float(np.median(ts))
        cases[i].setdefault("ms_rounds", {})[o] = ts
    return cases, tiles_all


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="nano_fc1,nano_fc2")
    ap.add_argument("--alphas", default="inf,3,1,0.3")
    ap.add_argument("--size-seeds", default="0,1,2,3")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--holdout", default="", help="seeds left out of the fit (their regret printed apart)")
    ap.add_argument("--fit", type=pathlib.Path, default=None, help="fit a result file instead of measuring")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ns = ap.parse_args(argv)
    ns.alphas = _parse_list(ns.alphas, "--alphas", float)
    ns.size_seeds = _parse_list(ns.size_seeds, "--size-seeds", int)
    holdout = _parse_list(ns.holdout, "--holdout", int) if ns.holdout else []
    if ns.rounds < 1 or ns.iters < 1:
        raise SystemExit(f"--rounds and --iters must be >= 1, got {ns.rounds}, {ns.iters}")
    for s in ns.shapes.split(","):
        try:
            gemm_shape(s)
        except ValueError as e:
            raise SystemExit(f"--shapes: {e}") from None
    if ns.fit is not None:
        import json

        data = json.loads(ns.fit.read_text())
        cases, tiles = data["rows"], data["tiles"]
        print_summary(summarize(cases, tiles, holdout), cases)
        return 0
    import jax

    from common import write_result

    from jax_grouped_mlp._src.cuda import ffi, gemm_ffi

    if not (ffi.available() and gemm_ffi.grouped_gemm_qw_variants()) or jax.devices()[0].platform != "gpu":
        print("needs a GPU and the built extension (tools/build_kernels.py); --fit FILE needs neither")
        return 1
    cases, tiles = measure(ns)
    summary = summarize(cases, tiles, holdout)
    print_summary(summary, cases)
    dev = jax.devices()[0]
    out = ns.out or RESULTS / f"qw_choice_{dev.device_kind.split()[-1].lower()}.json"
    write_result(out, command=command_line("benchmarks/bench_qw_choice.py", sys.argv[1:] if argv is None else argv),
                 rows=cases, extra={"tiles": tiles, "summary": summary})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
