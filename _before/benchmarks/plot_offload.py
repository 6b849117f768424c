"""Figure of ``bench_offload.py``'s JSON.

Results with layouts (``rows`` carrying ``layout``): one column per layout. Top: each
policy at the largest layer count as a dot at (step time, device memory: the device
peak where measured, else compiled temp), and a red tick at the same height at its
step bar, ``1.15 * max(compute step, transfer time)``, joined to the dot by a thin
line: a dot left of its tick meets the bar. Bottom: the per-layer growth of compiled
temp (and of the device peak) per policy as bars, the memory bar as a black tick and
the bar plus the layer input as a grey one. Older results (one stack): step time per
policy, and device / host memory per policy.

    PYTHONPATH=. python benchmarks/plot_offload.py benchmarks/results/offload_gpu.json offload.png
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np


def plot(result: dict, path: pathlib.Path, verbose: bool = True) -> None:
    if any("layout" in r for r in result["rows"]):
        return plot_layouts(result, path, verbose)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "error" not in r]
    labels = [
        r["label"].replace("_offload", "\noffload").replace("all_", "all\n")
        + "\n" + "/".join(p[0].upper() for p in r["placement"].values())
        for r in rows
    ]
    x = np.arange(len(rows))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(14, 4.8))

    step = [r["step_time_s"] * 1e3 for r in rows]
    ax_t.bar(x, step, 0.6, color="tab:blue")
    base = next((r["step_time_s"] * 1e3 for r in rows if r["label"] == "all_device"), None)
    if base is not None:
        ax_t.axhline(base, color="k", lw=0.8, ls="--", label="all_device")
        link = [base + r["link_time_each_way_s"] * 1e3 for r in rows]
        ax_t.scatter(x, link, marker="_", s=300, color="tab:red", zorder=3,
                     label=f"all_device + host bytes / {result['link_bandwidth_each_way'] / 1e9:.0f} GB/s (one way)")
        ax_t.legend(fontsize=7, loc="lower right")
    ax_t.set_xticks(x, labels, fontsize=7)
    ax_t.set_ylabel("step time, ms (median)")
    ax_t.set_title("forward + backward step")

    series = [
        ("compiled temp", [r["compiled"]["temp_size_in_bytes"] for r in rows]),
        ("device peak_bytes_in_use", [r.get("peak_bytes_in_use") for r in rows]),
        ("residuals on device (traced)", [r["device_residual_bytes"] for r in rows]),
        ("residuals in pinned host (traced)", [r["host_residual_bytes"] for r in rows]),
        ("compiled host temp", [r["compiled"].get("host_temp_size_in_bytes") for r in rows]),
    ]
    series = [(n, v) for n, v in series if any(b for b in v if b is not None)]
    width = 0.8 / max(len(series), 1)
    for i, (name, vals) in enumerate(series):
        ys = [np.nan if v is None else v / 1e9 for v in vals]
        ax_m.bar(x - 0.4 + (i + 0.5) * width, ys, width, label=name)
    ax_m.set_xticks(x, labels, fontsize=7)
    ax_m.set_ylabel("GB")
    ax_m.set_title("memory per policy")
    ax_m.legend(fontsize=7)

    s = result["shape"]
    fig.suptitle(
        f"{result['device']}: {s['layers']} x grouped_mlp, M={s['tokens']} H={s['hidden']} F={s['ffn']} "
        f"G={s['experts']} {s['recipe']}{' ragged' if s.get('ragged') else ''} "
        f"(fc1_input/activation_input/fc2_input: D device, O offload, R recompute)",
        fontsize=9,
    )
    _save(fig, path, verbose)


def plot_layouts(result: dict, path: pathlib.Path, verbose: bool = True) -> None:
    """Issue 17's bars per layout (see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = result["layouts"]
    top = max(result["layer_counts"])
    fig, axes = plt.subplots(2, len(layouts), figsize=(7.5 * len(layouts), 9), squeeze=False)
    for col, layout in enumerate(layouts):
        ax = axes[0][col]
        rows = [r for r in result["rows"] if "error" not in r and r["layout"] == layout and r["layers"] == top]
        peak = all(r.get("peak_bytes_in_use") is not None for r in rows) and result["one_process_per_policy"]
        timed = [r for r in rows if r.get("step_time_s") is not None]
        for r in timed:
            y = (r["peak_bytes_in_use"] if peak else r["compiled"]["temp_size_in_bytes"]) / 1e6
            x = r["step_time_s"] * 1e3
            ok = r.get("meets_step_bar")
            ax.scatter([x], [y], color="tab:green" if ok else "tab:red" if ok is False else "tab:gray", zorder=3)
            if r.get("step_bar_s") is not None:
                xb = r["step_bar_s"] * 1e3
                ax.plot([x, xb], [y, y], color="0.7", lw=0.6, zorder=1)
                ax.scatter([xb], [y], marker="|", s=150, color="tab:red", zorder=2)
            ax.annotate(r["label"], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        if not timed:
            ax.text(0.5, 0.5, "no timing (--no-time)", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("step time, ms (median); red |: 1.15 x max(compute step, transfer time)")
        ax.set_ylabel(("device peak" if peak else "compiled temp") + ", MB")
        ax.set_title(f"{layout}, {top} layers: green meets the step bar, red does not", fontsize=9)

        ax = axes[1][col]
        growth = [g for g in result["growth"] if g["layout"] == layout]
        x = np.arange(len(growth))
        series = [("temp growth", "temp_growth_per_layer"), ("peak growth", "peak_growth_per_layer")]
        series = [(n, k) for n, k in series if any(g[k] is not None for g in growth)]
        width = 0.8 / max(len(series), 1)
        for i, (name, key) in enumerate(series):
            ys = [np.nan if g[key] is None else g[key] / 1e6 for g in growth]
            ax.bar(x - 0.4 + (i + 0.5) * width, ys, width, label=name + " per layer")
        ax.scatter(x, [g["bar_bytes_per_layer"] / 1e6 for g in growth], marker="_", s=300, color="k", zorder=3,
                   label="bar: kept + 0.10 x offloaded")
        ax.scatter(x, [g["bar_with_layer_input_bytes_per_layer"] / 1e6 for g in growth], marker="_", s=300,
                   color="0.6", zorder=3, label="bar + layer input x")
        ax.set_xticks(x, [g["label"] for g in growth], rotation=90, fontsize=7)
        lo, hi = growth[0]["layers"] if growth else (None, None)
        ax.set_ylabel(f"MB per layer, ({hi} layers - {lo} layers) / {None if lo is None else hi - lo}")
        ax.set_title(f"{layout}: per-layer growth against the memory bar", fontsize=9)
        ax.legend(fontsize=7)
    s = result["shape"]
    fig.suptitle(
        f"{result['device']}: grouped_mlp stack, M={s['tokens']} H={s['hidden']} F={s['ffn']} G={s['experts']} "
        f"{s['recipe']}{' ragged' if s.get('ragged') else ''}; link {result['link']['source']} "
        f"{result['link']['d2h_bytes_per_s'] / 1e9:.1f} / {result['link']['h2d_bytes_per_s'] / 1e9:.1f} GB/s "
        "(d2h / h2d); labels fc1_input-activation_input-fc2_input: d device, o offload, r recompute",
        fontsize=9,
    )
    _save(fig, path, verbose)


def _save(fig, path, verbose: bool) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    if verbose:
        print(f"wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    plot(json.loads(pathlib.Path(sys.argv[1]).read_text()), pathlib.Path(sys.argv[2]))
