"""Where the time of one MLP training step goes: every part of it timed alone.

    PYTHONPATH=. python3 benchmarks/bench_step_parts.py [--shape nano] [--alpha inf,1,0.3] [--out FILE]

For one shape of ``common.MLP_SHAPES`` it times, each as its own jitted program on
the same inputs: the six GEMMs of a step (FC1 and the FC2 dgrad as the fused kernels
the mxfp8 step runs: FC1 with the squared ReLU and both MXFP8 copies of ``a``, the
FC2 dgrad with dSReLU, ``dprobs`` and both copies of ``dh``; FC2, the FC1 dgrad with
the weight as stored, the two wgrads) on bf16 operands, and the MXFP8 conversions
the mxfp8 recipe adds around them: one two-copy pass for x and dy (the rowwise
values in bf16 plus the columnwise copy, kept as FP8 for x), the weights' one-pass
fake quantization, and the dequantization of the two kept FP8 residuals before the
weight gradients. Rows with a count of 0 are what earlier versions ran
instead (quantize both copies to FP8, then dequantize in XLA), kept for
comparison. Each part is multiplied by
how often one step runs it, so the table adds up to an estimate of the step, to set
against ``bench_mlp.py``'s measured step time. Writes JSON
(``results/step_parts_<platform>.json``).

What it answers: how much of the mxfp8 recipe's extra time is dequantization that an
in-kernel conversion would remove, and how much is quantization that stays.

``--alpha inf,1,0.3`` (issue 20) times every part once per group-size skew in the
same process, on the same operands: ``inf`` is equal sizes, other values Dirichlet
router draws (``shapes.router_group_sizes``, with ``--seed``). The table then has one
ms column per alpha and each skewed column's ratio to the equal-sizes one, which says
which kernels slow down with skew; the JSON has them per part (``by_alpha``,
``vs_uniform``). ``--round-to R`` adds, per skewed alpha, the same draw with every size
moved to a multiple of R (``shapes.rounded_group_sizes``; label ``alpha=1/r128``): with R
= 128 no GEMM tile and no weight-gradient row slice is partial, so the difference to the
plain draw is what ragged edges cost, the rest what the uneven distribution costs.
``--alternating 320/448,...`` adds sizes alternating between two values (summing to
twice the rows per group): at Nano every group then ends in a partial tile of the
chosen height (64 rows for 320/448) at the same tile count, which tells what a partial
tile costs by its height (docs/notes/2026-12-02-skew.md, "Session 34").
``--descending`` adds, per skewed alpha, the same sizes in descending order (label
``alpha=1/desc``): the kernels' persistent CTAs take tiles round-robin in group order, so
the difference says what the order of the groups costs (round-robin over non-increasing
tile costs bounds the imbalance between CTAs by one tile). Each part is timed at every
alpha in ``--rounds`` interleaved rounds (default 3; the medians), as ``bench_mlp.py
--rounds`` does: this machine drifts by 10-15 % over a run. ``--parts REGEX`` times only
the parts whose name matches. The weight gradients are also timed with their tile order
forced (``wgrad ... order forced static`` / ``dynamic``, count 0), next to the default rows
whose order XLA chooses from the group sizes: the three in one process. The rows marked ``qw`` are the weight GEMMs with in-kernel weight
quantization that the mxfp8 step runs instead of the fused and pass-quantized GEMMs when
groups are small on average (``heuristics.weights_in_gemm``: Nano's 384 rows per group).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src.cuda import ffi
from jax_grouped_mlp._src.formats import mxfp8
from jax_grouped_mlp._src.op import primitives

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import (  # noqa: E402
    MLP_SHAPES, RESULTS, command_line, device_description, require_kernels, round_order, time_call, write_result,
)
from shapes import rounded_group_sizes, router_group_sizes, skew_label  # noqa: E402


def _operands(m: int, h: int, f: int, g: int, seed: int) -> dict:
    """The bf16 operands every alpha shares (drawn once: at Nano they are 4 GB of
    float32 on the host before the cast)."""
    rng = np.random.default_rng(seed)
    bf = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16)  # noqa: E731
    x, a, w1, w2 = bf(m, h), bf(m, f), bf(g, h, f) / 32, bf(g, f, h) / 32
    probs = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
    return {"x": x, "a": a, "w1": w1, "w2": w2, "probs": probs}


def _functions() -> dict:
    """The jitted parts, made once so that every alpha reuses their compilations (the
    group sizes are an operand, not a static)."""
    gemm = jax.jit(lambda l, r, s: primitives.grouped_gemm(l, r, s, jnp.bfloat16))
    dgrad = jax.jit(lambda l, r, s: primitives.grouped_gemm(l, r, s, jnp.bfloat16, transpose_rhs=True))
    wgrad = jax.jit(lambda l, r, s: primitives.grouped_wgrad(l, r, s, jnp.bfloat16))
    q_both = jax.jit(primitives.quantize_both)
    q_w = {ax: jax.jit(lambda w, ax=ax: primitives.quantize(w, ax)) for ax in (1, 2)}
    fq_w = {ax: jax.jit(lambda w, ax=ax: primitives.fake_quantize(w, ax)) for ax in (1, 2)}
    deq = jax.jit(lambda t: mxfp8.dequantize(t, jnp.bfloat16))  # XLA's
    # What the weight gradients' adapter runs on a kept residual (a kernel on CUDA).
    deq_kept = jax.jit(lambda t: jax.lax.platform_dependent(
        t, cuda=ffi.dequantize_cuda, default=lambda t: mxfp8.dequantize(t, jnp.bfloat16)))
    pair = {keep: jax.jit(lambda x, gs, keep=keep: primitives.fake_quantize_pair(x, gs, keep_col_fp8=keep))
            for keep in (False, True)}
    # The weight gradient with its tile order forced, next to the default (chosen on the
    # device), so one process compares the three orders.
    forced = {order: _wgrad_forced(order) for order in ("static", "dynamic")}
    gemm_qw = jax.jit(lambda l, w, s: primitives.grouped_gemm_qw(l, w, s, jnp.bfloat16))
    dgrad_qw = jax.jit(lambda l, w, s: primitives.grouped_gemm_qw(l, w, s, jnp.bfloat16, transpose_rhs=True))
    return {"gemm": gemm, "dgrad": dgrad, "wgrad": wgrad, "q_both": q_both, "q_w": q_w, "fq_w": fq_w,
            "deq": deq, "deq_kept": deq_kept, "pair": pair, "fc1_fused": jax.jit(primitives.fc1_fused),
            "dgrad_fused": jax.jit(primitives.dgrad_fused), "gemm_qw": gemm_qw, "dgrad_qw": dgrad_qw,
            "wgrad_forced": forced}


def _wgrad_forced(order: str):
    """The weight gradient traced with ``JGM_WGRAD_TILE_ORDER=order`` (the variable is read
    when the program is traced, so it is set around every call: the first one traces)."""
    fn = jax.jit(lambda l, r, s: primitives.grouped_wgrad(l, r, s, jnp.bfloat16))

    def call(*args):
        before = os.environ.get("JGM_WGRAD_TILE_ORDER")
        os.environ["JGM_WGRAD_TILE_ORDER"] = order
        try:
            return fn(*args)
        finally:
            if before is None:
                del os.environ["JGM_WGRAD_TILE_ORDER"]
            else:
                os.environ["JGM_WGRAD_TILE_ORDER"] = before

    return call


def _parts(fns: dict, ops: dict, gs: jax.Array):
    """(name, per-step count, jitted fn, args) for every part of a step with group sizes ``gs``."""
    x, a, w1, w2, probs = ops["x"], ops["a"], ops["w1"], ops["w2"], ops["probs"]
    gemm, dgrad, wgrad, q_both, q_w, fq_w = fns["gemm"], fns["dgrad"], fns["wgrad"], fns["q_both"], fns["q_w"], fns["fq_w"]
    deq, deq_kept, pair, fc1_fused, dgrad_fused = fns["deq"], fns["deq_kept"], fns["pair"], fns["fc1_fused"], fns["dgrad_fused"]
    gemm_qw, dgrad_qw = fns["gemm_qw"], fns["dgrad_qw"]
    x_row, x_col = q_both(x, gs)
    a_row, a_col = q_both(a, gs)
    w1_k = q_w[1](w1)
    w1_t = q_w[2](w1)
    return [
        # What the mxfp8 step runs (per-step counts; the default fused FC1 epilogue):
        ("fused fc1: gemm + srelu + pair(a) [M,H]x[G,H,F]", 1, fc1_fused, (x, w1, gs, probs)),
        ("gemm fc2 [M,F]x[G,F,H]", 1, gemm, (a, w2, gs)),
        ("fused dgrad fc2: dgrad + dsrelu + dprobs + pair(dh)", 1, dgrad_fused, (x, w2, gs, a, probs)),
        ("gemm dgrad fc1 (w1 as stored, K-major)", 1, dgrad, (a, w1, gs)),
        ("wgrad dw1 [M,H]^T[M,F]", 1, wgrad, (x, a, gs)),
        ("wgrad dw2 [M,F]^T[M,H]", 1, wgrad, (a, x, gs)),
        ("fake_quantize_pair + FP8 col [M,H] (x)", 1, pair[True], (x, gs)),
        ("fake_quantize_pair bf16 col [M,H] (dy)", 1, pair[False], (x, gs)),
        # What the fused kernels replace (count 0: the unfused parts, for comparison):
        ("gemm fc1 [M,H]x[G,H,F]", 0, gemm, (x, w1, gs)),
        ("fake_quantize_pair + FP8 col [M,F] (a)", 0, pair[True], (a, gs)),
        ("gemm dgrad fc2 (w2 as stored, K-major)", 0, dgrad, (x, w2, gs)),
        ("fake_quantize_pair bf16 col [M,F] (dh)", 0, pair[False], (a, gs)),
        ("fake_quantize weight along K (fprop)", 2, fq_w[1], (w1,)),
        ("fake_quantize weight along N (dgrad)", 2, fq_w[2], (w1,)),
        ("dequantize grouped col [M,H] (x kept)", 1, deq_kept, (x_col,)),
        ("dequantize grouped col [M,F] (a kept)", 1, deq_kept, (a_col,)),
        # What earlier versions ran instead (count 0: for comparison only):
        ("dequantize grouped col [M,H] in XLA", 0, deq, (x_col,)),
        ("dequantize rowwise [M,H]", 0, deq, (x_row,)),
        ("dequantize rowwise [M,F]", 0, deq, (a_row,)),
        ("dequantize weight (fprop)", 0, deq, (w1_k,)),
        ("dequantize weight along N (dgrad)", 0, deq, (w1_t,)),
        # The mxfp8 step's weight GEMMs with small groups (weights quantized in the GEMM):
        ("qw gemm fc1 [M,H]x[G,H,F]", 0, gemm_qw, (x, w1, gs)),
        ("qw gemm fc2 [M,F]x[G,F,H]", 0, gemm_qw, (a, w2, gs)),
        ("qw gemm dgrad fc2 (w2 as stored)", 0, dgrad_qw, (x, w2, gs)),
        ("qw gemm dgrad fc1 (w1 as stored)", 0, dgrad_qw, (a, w1, gs)),
    ] + [
        # The weight gradients with their tile order forced (count 0: the step runs the chosen one).
        (f"wgrad {which} order forced {order}", 0, fn, args)
        for order, fn in fns["wgrad_forced"].items()
        for which, args in (("dw1 [M,H]^T[M,F]", (x, a, gs)), ("dw2 [M,F]^T[M,H]", (a, x, gs)))
    ]


def _alphas(text: str) -> list[float]:
    """``--alpha``'s comma-separated skews (``inf``: equal sizes), each > 0, none twice."""
    try:
        alphas = [float(a) for a in text.split(",") if a.strip()]
    except ValueError:
        raise SystemExit(f"--alpha must be comma-separated numbers or inf, got --alpha={text!r}") from None
    if not alphas or any(not a > 0 for a in alphas) or len(set(alphas)) != len(alphas):
        raise SystemExit(f"--alpha must name distinct alphas > 0 (inf: equal sizes), got --alpha={text!r}")
    return alphas


def alternating_sizes(pair: str, g: int, rows: int) -> np.ndarray:
    """``"A/B"`` as ``g`` group sizes A, B, A, B, ... (``g`` even, ``A + B == 2 rows``: the
    same M as equal sizes); SystemExit naming ``--alternating`` otherwise."""
    try:
        a, b = (int(v) for v in pair.split("/"))
    except ValueError:
        raise SystemExit(f"--alternating takes pairs like 320/448, got {pair!r}") from None
    if g % 2 or a < 0 or b < 0 or a + b != 2 * rows:
        raise SystemExit(f"--alternating {pair}: needs an even group count (got {g}) and two sizes >= 0 "
                         f"summing to twice the {rows} rows per group")
    return np.tile(np.array([a, b], np.int32), g // 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="nano", choices=sorted(MLP_SHAPES),
                    help="a shape of common.MLP_SHAPES (tiny: a CPU smoke test)")
    ap.add_argument("--dims", default=None, help="groups,rows_per_group,hidden,ffn (overrides --shape)")
    ap.add_argument("--alpha", "--alphas", dest="alpha", default="inf",
                    help="comma-separated group-size skews, each part timed at every one: inf (equal sizes) "
                         "or Dirichlet alphas of shapes.router_group_sizes, e.g. inf,1,0.3 (default: inf)")
    ap.add_argument("--round-to", type=int, default=0,
                    help="also time every skewed alpha with its sizes rounded to multiples of this (e.g. 128)")
    ap.add_argument("--descending", action="store_true",
                    help="also time every skewed alpha with its sizes sorted in descending order")
    ap.add_argument("--alternating", default=None,
                    help="also time group sizes alternating between two values, e.g. 320/448,257/511 (each "
                         "pair summing to twice the rows per group, so M is the same): every group then ends "
                         "in a partial tile of a chosen height, at the same tile count for every pair")
    ap.add_argument("--parts", default=None, help="a regular expression: time only the parts whose name matches")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--samples", type=int, default=5, help="timing samples per part and alpha (median)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds over the alphas per part (median); 1 times them one after another")
    ap.add_argument("--seed", type=int, default=0, help="seed of the operands and of the skewed group sizes")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ns = ap.parse_args(argv)
    require_kernels()  # (no timing of the pure-JAX fallback under our name)
    alphas = _alphas(ns.alpha)
    if ns.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got --rounds={ns.rounds}")
    dims = tuple(int(d) for d in ns.dims.split(",")) if ns.dims else MLP_SHAPES[ns.shape]
    g, rows, h, f = dims
    m = g * rows
    shape = {"name": "custom" if ns.dims else ns.shape, "groups": g, "rows_per_group": rows, "hidden": h, "ffn": f}
    report = {"command": command_line("benchmarks/bench_step_parts.py", sys.argv[1:] if argv is None else argv), "device": device_description(),
              "shape": shape, "parts": {}}
    sizes = {}
    for a in alphas:
        sizes[skew_label(a)] = router_group_sizes(m, g, a, ns.seed)
        if ns.round_to and a != float("inf"):
            if ns.round_to < 0 or m % ns.round_to:
                raise SystemExit(f"--round-to must divide the {m} rows, got --round-to={ns.round_to}")
            sizes[f"{skew_label(a)}/r{ns.round_to}"] = rounded_group_sizes(sizes[skew_label(a)], ns.round_to)
        if ns.descending and a != float("inf"):
            sizes[f"{skew_label(a)}/desc"] = np.sort(sizes[skew_label(a)])[::-1].copy()
    for pair in (ns.alternating.split(",") if ns.alternating else []):
        sizes[f"alt{pair}"] = alternating_sizes(pair, g, rows)
    labels = list(sizes)
    fns, ops = _functions(), _operands(m, h, f, g, ns.seed)
    by_alpha: dict[str, dict[str, float]] = {}
    names: list[tuple[str, int]] = []
    if len(labels) == 1:  # the one-alpha table, printed as it comes
        print(f"{'part':42s} {'ms':>8s} {'x/step':>6s} {'ms/step':>8s}")
    # Every label's group-size-dependent operands first; then each part at every label in
    # --rounds interleaved rounds (this machine drifts by 10-15 % over a run: timing one
    # label after another once put a drift of the run into the skew ratios, e.g. the
    # weight gradients at 1.14-1.27x where interleaved rounds give 0.97-1.04x).
    parts_by = {lab: _parts(fns, ops, jnp.asarray(sizes[lab])) for lab in labels}
    for i, (name, count, _, _) in enumerate(parts_by[labels[0]]):
        if ns.parts and not re.search(ns.parts, name):
            continue
        names.append((name, count))
        rounds: dict[str, list[float]] = {lab: [] for lab in labels}
        for r in range(ns.rounds):
            for lab in round_order(labels, r):
                _, _, fn, args = parts_by[lab][i]
                rounds[lab].append(1e3 * time_call(fn, *args, iters=ns.iters, samples=ns.samples))
        for lab in labels:
            ms = by_alpha.setdefault(name, {})[lab] = float(np.median(rounds[lab]))
            if len(labels) == 1:
                print(f"{name:42s} {ms:8.3f} {count:6d} {ms * count:8.3f}", flush=True)
            else:
                print(f"  {lab}: {name} {ms:.3f} ms (rounds {', '.join(f'{r:.3f}' for r in rounds[lab])})", flush=True)
    totals_by = {lab: {"gemm": 0.0, "fused": 0.0, "quantize": 0.0, "dequantize": 0.0, "fake_quantize": 0.0}
                 for lab in labels}
    skewed = [lab for lab in labels if lab != "uniform"] if "uniform" in labels else []
    if len(labels) > 1:
        print(f"{'part':52s} {'x/step':>6s} " + " ".join(f"{lab:>9s}" for lab in labels)
              + "".join(f" {lab + '/u':>9s}" for lab in skewed))
    for name, count in names:
        kind = {"wgrad": "gemm", "qw": "gemm", "quantize_both": "quantize", "fake_quantize_pair": "quantize"}.get(
            name.split()[0], name.split()[0]
        )
        entry = {"ms": by_alpha[name][labels[0]], "per_step": count}
        if len(labels) > 1:
            entry["by_alpha"] = by_alpha[name]
            entry["vs_uniform"] = {lab: by_alpha[name][lab] / by_alpha[name]["uniform"] for lab in skewed}
            print(f"{name:52s} {count:6d} " + " ".join(f"{by_alpha[name][lab]:9.3f}" for lab in labels)
                  + "".join(f" {entry['vs_uniform'][lab]:9.2f}" for lab in skewed), flush=True)
        for lab in labels:
            totals_by[lab][kind] += by_alpha[name][lab] * count
        report["parts"][name] = entry
    report["ms_per_step"] = totals_by[labels[0]]
    extra = {"shape": report["shape"], "ms_per_step": report["ms_per_step"], "rounds": ns.rounds}
    if ns.parts:  # the totals then cover the matching parts only
        extra["parts_filter"] = ns.parts
    if len(labels) > 1:
        extra["alphas"] = labels
        extra["seed"] = ns.seed
        extra["group_sizes"] = {lab: {"min": int(s.min()), "max": int(s.max()), "zeros": int((s == 0).sum())}
                                for lab, s in sizes.items()}
        extra["ms_per_step_by_alpha"] = totals_by
        for lab in labels:
            print(lab, {k: round(v, 3) for k, v in totals_by[lab].items()})
    else:
        print({k: round(v, 3) for k, v in totals_by[labels[0]].items()})
    out = ns.out or RESULTS / f"step_parts_{jax.devices()[0].platform}.json"
    write_result(out, command=report["command"], results=report["parts"], extra=extra)
    return 0

if __name__ == "__main__":
    sys.exit(main())
