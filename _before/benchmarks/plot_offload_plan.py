"""Plot the planner's predictions for the Nemotron-3-Nano expert shape (docs/offload.md).

Left: predicted residual memory against step time for all 27 placements of a stack
of ``--layers`` layers, with the budget line and the planner's choice. Right: the
fastest placement that fits, as the budget shrinks. Inputs: 53 GB/s each way (the
H200 here) and the roofline layer time (700 TFLOP/s MXFP8 grouped GEMMs, 4 TB/s),
or ``--layer-time-ms`` once the kernels are measured. No device needed.

    PYTHONPATH=. python benchmarks/plot_offload_plan.py [--out docs/offload_plan_nano.png]
"""

from __future__ import annotations

import argparse
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from jax_grouped_mlp._src.op.names import RESIDUAL_NAMES  # noqa: E402
from jax_grouped_mlp._src.offload.planner import (  # noqa: E402
    H200_HOST_BANDWIDTH,
    LayerShape,
    LayerTime,
    plan_offload,
)

NANO = LayerShape(tokens=49152, hidden=2688, ffn=1856, num_experts=128)
SHORT = {"device": "D", "offload": "O", "recompute": "R"}
COLOR = {0: "tab:green", 1: "tab:olive", 2: "tab:orange", 3: "tab:red"}  # by number offloaded


def _code(placement) -> str:
    return "".join(SHORT[placement[n]] for n in RESIDUAL_NAMES)


def _label_clusters(candidates):
    """One label per group of points that would print on top of each other."""
    pts = sorted((c.device_bytes / 1e9, c.step_time * 1e3, _code(c.placement)) for c in candidates)
    span = max(p[1] for p in pts) - min(p[1] for p in pts)
    groups: list[list] = []
    for y, x, code in pts:
        g = groups[-1] if groups else None
        if g and abs(g[0][0] - y) < 0.05 and abs(g[-1][1] - x) < 0.08 * span:
            g.append((y, x, code))
        else:
            groups.append([(y, x, code)])
    return [((g[0][1], g[0][0]), [code for _, _, code in g]) for g in groups]


def budget_table(common: dict, layer_times_ms=(None, 8.0, 14.0, 28.0), budgets_gb=(1.0, 3.0, 5.0)) -> str:
    """docs/offload.md's "The Nano shape" table (markdown): per layer time (None: the
    roofline's) and budget, the chosen placement and its step time over compute alone."""
    lines = ["| layer fwd+bwd | " + " | ".join(f"{b:g} GB budget" for b in budgets_gb) + " |",
             "|---" * (len(budgets_gb) + 1) + "|"]  # fmt: skip
    for ms in layer_times_ms:
        lt = LayerTime.roofline(NANO, "mxfp8") if ms is None else LayerTime.from_total(ms / 1e3, NANO, "mxfp8")
        cells = []
        for b in budgets_gb:
            chosen = plan_offload(budget_bytes=b * 1e9, **(common | {"layer_time": lt})).chosen
            over = chosen.step_time / (common["num_layers"] * lt.total) - 1
            cells.append(f"{'/'.join(_code(chosen.placement))}, +{over * 100:.0f} %")
        name = f"{lt.total * 1e3:.2f} ms (roofline)" if ms is None else f"{ms:g} ms"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--budget-gb", type=float, default=3.0)
    p.add_argument("--host-gbps", type=float, default=H200_HOST_BANDWIDTH / 1e9)
    p.add_argument("--layer-time-ms", type=float, default=None)
    p.add_argument("--out", type=pathlib.Path,
                   default=pathlib.Path(__file__).parents[1] / "docs" / "offload_plan_nano.png")
    args = p.parse_args(argv)  # fmt: skip

    lt = LayerTime.roofline(NANO, "mxfp8")
    if args.layer_time_ms is not None:
        lt = LayerTime.from_total(args.layer_time_ms / 1e3, NANO, "mxfp8")
    common = dict(
        tokens=NANO.tokens, hidden=NANO.hidden, ffn=NANO.ffn, num_experts=NANO.num_experts,
        num_layers=args.layers, host_bandwidth=args.host_gbps * 1e9, layer_time=lt,
    )  # fmt: skip
    plan = plan_offload(budget_bytes=args.budget_gb * 1e9, **common)
    print(plan)
    print()
    print(budget_table(common))

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5.5))
    for c in plan.candidates:
        n_off = sum(v == "offload" for v in c.placement.values())
        ax.scatter(c.step_time * 1e3, c.device_bytes / 1e9, color=COLOR[n_off], s=30, zorder=3)
    for (x, y), codes in _label_clusters(plan.candidates):
        ax.annotate(",".join(codes), (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ch = plan.chosen
    ax.scatter(ch.step_time * 1e3, ch.device_bytes / 1e9, s=160, facecolors="none",
               edgecolors="black", linewidths=1.5, zorder=4, label=f"chosen: {_code(ch.placement)}")  # fmt: skip
    ax.axhline(args.budget_gb, color="gray", ls="--", lw=1, label=f"budget {args.budget_gb:g} GB")
    for k, color in COLOR.items():
        ax.scatter([], [], color=color, label=f"{k} offloaded")
    ax.set_xlabel(f"predicted step time, {args.layers} layers fwd+bwd (ms)")
    ax.set_ylabel("predicted residual memory on device (GB)")
    ax.set_title("27 placements (fc1_input, activation_input, fc2_input)\n"
                 "D = device, O = offload, R = recompute", fontsize=10)  # fmt: skip
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)

    # Right: the best placement as the budget shrinks.
    least = min(c.device_bytes for c in plan.candidates)
    most = max(c.device_bytes for c in plan.candidates)
    budgets = np.linspace(least, most * 1.05, 200)
    best = [plan_offload(budget_bytes=b, **common).chosen for b in budgets]
    ax2.plot(budgets / 1e9, [c.step_time * 1e3 for c in best], color="tab:blue")
    last = None
    for b, c in zip(budgets, best):
        if _code(c.placement) != last:
            last = _code(c.placement)
            ax2.annotate(last, (b / 1e9, c.step_time * 1e3), textcoords="offset points",
                         xytext=(2, 6), fontsize=8)  # fmt: skip
            ax2.plot(b / 1e9, c.step_time * 1e3, "o", color="tab:blue", ms=4)
    ax2.axhline(args.layers * lt.total * 1e3, color="gray", ls=":", lw=1, label="compute only")
    ax2.set_xlabel("residual budget (GB)")
    ax2.set_ylabel("predicted step time of the best fitting placement (ms)")
    ax2.set_title("fastest placement that fits, per budget", fontsize=10)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)

    fig.suptitle(
        f"Nemotron-3-Nano expert MLP (M={NANO.tokens}, H={NANO.hidden}, F={NANO.ffn}, "
        f"G={NANO.num_experts}), MXFP8; link {args.host_gbps:g} GB/s each way; layer "
        f"fwd {lt.forward * 1e3:.2f} + bwd {lt.backward * 1e3:.2f} ms",
        fontsize=10,
    )
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
