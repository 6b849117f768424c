"""Figure of ``bench_offload.py``'s JSON: step time per policy, and device / host memory per policy.

    PYTHONPATH=. python benchmarks/plot_offload.py benchmarks/results/offload_gpu.json offload.png
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np


def plot(result: dict, path: pathlib.Path, verbose: bool = True) -> None:
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
