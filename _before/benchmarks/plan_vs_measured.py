"""The offload planner's predictions against a bench_offload run (no device needed).

    python3 benchmarks/plan_vs_measured.py benchmarks/results/offload_all27_h200.json [--out FILE]

For each layout of the run and its largest layer count, plans the measured shape with
:func:`plan_offload` fed the run's own inputs (the link bandwidth it measured, and one
layer's compute = the all-device step / layers, split like the roofline), then prints
per placement the predicted against the measured step time, and the predicted
growth of device memory per layer (the planner's residual memory, with the layer input
x where a recompute keeps it, between the run's smallest and largest layer count)
against the measured growth of compiled temp per layer. Writes JSON (``device`` = the measured run's).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.common import command_line, write_result  # noqa: E402

ORDER = ("fc1_input", "activation_input", "fc2_input")
SHORT = {"device": "d", "offload": "o", "recompute": "r"}


def compare(run: dict, host_bandwidth: float | None = None) -> list[dict]:
    """One row per (layout, placement) found in ``run`` at its largest layer count;
    ``host_bandwidth`` (bytes/s each way) in place of the link the run measured."""
    import jax_grouped_mlp as jgm

    rows = {(r["layout"], r["layers"], r["label"]): r for r in run["rows"] if "error" not in r}
    growth = {(e["layout"], e["label"]): e for e in run.get("growth", [])}
    link = run["link"]
    bandwidth = host_bandwidth or (link["d2h_bytes_per_s"] + link["h2d_bytes_per_s"]) / 2
    layers = max(run["layer_counts"])
    shape = run["shape"]
    out = []
    for layout in run["layouts"]:
        base = rows.get((layout, layers, "d-d-d")) or rows.get((layout, layers, "all_device"))
        if base is None or not base.get("step_time_s"):
            continue
        def plan(n: int):
            return jgm.plan_offload(
                tokens=shape["tokens"], hidden=shape["hidden"], ffn=shape["ffn"], num_experts=shape["experts"],
                num_layers=n, budget_bytes=math.inf, host_bandwidth=bandwidth,
                layer_time=base["step_time_s"] / layers, recipe=shape.get("recipe", "mxfp8"),
                layout={"stack": "layer_stack"}.get(layout, layout),  # layer_scan_xla: XLA's copies
            )  # fmt: skip

        lo = min(run["layer_counts"])
        small = {c.label(): c for c in plan(lo).candidates}
        for c in plan(layers).candidates:
            label = "-".join(SHORT[c.placement[n]] for n in ORDER)
            r = rows.get((layout, layers, label))
            if r is None or not r.get("step_time_s"):
                continue
            g = growth.get((layout, label), {}).get("temp_growth_per_layer")
            out.append({
                "layout": layout, "label": label, "layers": layers,
                "step_pred_s": c.step_time, "step_meas_s": r["step_time_s"],
                "step_rel_err": (c.step_time - r["step_time_s"]) / r["step_time_s"],
                "device_bytes_per_layer_pred": (c.total_device_bytes - small[c.label()].total_device_bytes)
                / (layers - lo) if layers > lo else c.total_device_bytes / layers,
                "temp_growth_per_layer_meas": g,
            })  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=pathlib.Path, help="a bench_offload JSON with step times and growth")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ap.add_argument("--host-bandwidth", type=float, default=None,
                    help="bytes/s each way to plan with instead of the link the run measured (e.g. 53e9)")
    args = ap.parse_args()
    run = json.loads(args.run.read_text())
    rows = compare(run, args.host_bandwidth)
    if not rows:
        sys.exit(f"{args.run}: no timed all-device row at the largest layer count; nothing to compare")
    print(f"{'layout':<11}{'policy':<8}{'step pred ms':>13}{'meas ms':>9}{'err':>7}{'MB/layer pred':>15}{'meas':>8}")
    for r in rows:
        g = r["temp_growth_per_layer_meas"]
        print(f"{r['layout']:<11}{r['label']:<8}{r['step_pred_s'] * 1e3:>13.1f}{r['step_meas_s'] * 1e3:>9.1f}"
              f"{r['step_rel_err']:>+7.0%}{r['device_bytes_per_layer_pred'] / 1e6:>15.0f}"
              f"{'-' if g is None else f'{g / 1e6:+.0f}':>8}")  # fmt: skip
    for layout in sorted({r["layout"] for r in rows}):
        errs = sorted(abs(r["step_rel_err"]) for r in rows if r["layout"] == layout)
        print(f"{layout}: step within 15 %: {sum(e <= 0.15 for e in errs)}/{len(errs)}, "
              f"median |err| {errs[len(errs) // 2]:.0%}, max {errs[-1]:.0%}")
    if args.out:
        write_result(args.out, command=command_line("benchmarks/plan_vs_measured.py", sys.argv[1:]), rows=rows, device=run["device"],
                     extra={"measured_run": str(args.run), "measured_run_commit": run.get("library_commit"),
                            "host_bandwidth": args.host_bandwidth or "the run's measured link"})


if __name__ == "__main__":
    main()
