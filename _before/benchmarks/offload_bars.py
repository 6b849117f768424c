"""Issue 17's bars for ``bench_offload.py``: per-layer memory growth and step time, per layout and policy.

Memory (items 1 and 2). For each layout and policy, the per-layer growth of the
compiled temp memory and of the device peak between the smallest and the largest
layer count measured, ``(temp(L2) - temp(L1)) / (L2 - L1)``, against

    bar = kept_on_device_bytes_per_layer + 0.10 * offloaded_bytes_per_layer

where the residual bytes per layer are the traced gradient's
(``placement.residual_report``: per residual name, the bytes kept on the device and
the bytes copied to pinned host; a recomputed residual counts in neither). The
checkpoint's own input (the layer input ``x``, ``M * H`` bf16) is kept on the device
by every policy and is not a residual: ``bar_with_layer_input`` adds it, for judging
what a policy can reach at all.

Step time (item 7). ``transfer_s`` = offloaded bytes per step / device->host
bandwidth + the same bytes / host->device bandwidth (the copies out run in the
forward pass and the copies back in the backward pass, so the two directions add up),
``compute_s`` = the step of the same layout and layer count without the copies: the
placement with its offloaded residuals kept on the device (what it recomputes is still
recomputed), or the all-device step where that placement was not measured, and

    step bar = 1.15 * max(compute_s, transfer_s).

The bandwidths are measured in the benchmark's process (:func:`measure_link`) when the
device has a ``pinned_host`` memory kind, else taken from ``--link-gbps``.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time

MB = 1e6
SETTINGS = ("device", "offload", "recompute")
# Every placement over (fc1_input, activation_input, fc2_input), labelled by initials: "d-o-r".
ALL27 = {"-".join(s[0] for s in combo): combo for combo in itertools.product(SETTINGS, repeat=3)}
MEMORY_BAR_OFFLOAD_FRACTION = 0.10
STEP_BAR_FACTOR = 1.15
ALL_DEVICE = ("device", "device", "device")


def measure_link(nbytes: int, reps: int = 5) -> dict | None:
    """Device <-> pinned-host copy bandwidth of ``nbytes`` (median of ``reps`` copies each
    way, after one warm-up), bytes per second; None when the device has no ``pinned_host``
    memory kind, ``{"error": ...}`` when the copies fail. Take ``nbytes`` large: the fixed
    cost of a copy (dispatch, allocating the destination, the wait) made one 256 MB copy
    read 47 GB/s on the H200 where a stack of offloading layers copies at ~53
    (``bench_offload.py --link-mb`` defaults to 2048). The rate from the difference of
    two copy sizes removes that cost but read 53-63 GB/s from run to run there. Run it
    after any device-peak measurement: it allocates ``2 * nbytes`` on the device."""
    import jax
    import jax.numpy as jnp
    from jax_grouped_mlp._src.offload.measure import single_device_sharding

    d = jax.devices()[0]
    if "pinned_host" not in {m.kind for m in d.addressable_memories()}:
        return None
    n = max(int(nbytes) // 4, 1)
    on_host = single_device_sharding(d, "pinned_host")
    on_device = single_device_sharding(d, "device")
    try:
        a = jax.block_until_ready(jnp.arange(n, dtype=jnp.float32))
        times: dict[str, list[float]] = {"d2h": [], "h2d": []}
        h = b = None
        for i in range(reps + 1):
            del h
            t0 = time.perf_counter()
            h = jax.block_until_ready(jax.device_put(a, on_host))
            t1 = time.perf_counter()
            del b
            b = jax.block_until_ready(jax.device_put(h, on_device))
            t2 = time.perf_counter()
            if i:  # the first copies each way are the warm-up
                times["d2h"].append(t1 - t0)
                times["h2d"].append(t2 - t1)
        if str(h.sharding.memory_kind) != "pinned_host":
            return None
    except Exception as e:  # a platform that lists the kind but cannot copy to it
        return {"error": f"{type(e).__name__}: {e}"}
    nb = 4 * n
    return {
        "bytes": nb,
        "reps": reps,
        "d2h_bytes_per_s": nb / statistics.median(times["d2h"]),
        "h2d_bytes_per_s": nb / statistics.median(times["h2d"]),
        "platform": d.platform,
    }


def link_bandwidth(measurements: list[dict | None], link_gbps: float) -> dict:
    """The bandwidths the step bar uses: the median of the workers' measurements, else
    ``link_gbps`` each way."""
    ok = [m for m in measurements if m and "error" not in m]
    if ok:
        return {
            "source": "measured",
            "d2h_bytes_per_s": statistics.median(m["d2h_bytes_per_s"] for m in ok),
            "h2d_bytes_per_s": statistics.median(m["h2d_bytes_per_s"] for m in ok),
            "measurements": len(ok),
            "bytes": ok[0]["bytes"],
        }
    errors = [m["error"] for m in measurements if m and "error" in m]
    return {"source": "--link-gbps", "d2h_bytes_per_s": link_gbps * 1e9, "h2d_bytes_per_s": link_gbps * 1e9,
            "measure_errors": errors[:1]}  # fmt: skip


def _placement(row: dict) -> tuple[str, ...]:
    return tuple(row["placement"].values())


def _without_transfers(placement: tuple[str, ...]) -> tuple[str, ...]:
    """The placement with each offloaded residual kept on the device instead: the same
    compute (a recomputed residual is still recomputed) without the copies."""
    return tuple("device" if s == "offload" else s for s in placement)


def step_bars(rows: list[dict], link: dict) -> None:
    """Adds ``transfer_s``, ``compute_s``, ``compute_ref``, ``step_bar_s`` and
    ``meets_step_bar`` to each measured row of one (layout, layers) group.

    ``compute_s`` is the step of the row's placement without its transfers (offloaded
    residuals kept on the device; what it recomputes is still recomputed) when that
    placement was measured in the group, else the all-device step: a policy that
    recomputes pays for its recompute whether or not it also offloads, and the bar is
    about what the copies add."""
    ok = [r for r in rows if "error" not in r]
    timed = {_placement(r): r for r in ok if r.get("step_time_s") is not None}
    for r in ok:
        base = timed.get(_without_transfers(_placement(r))) or timed.get(ALL_DEVICE)
        compute = base["step_time_s"] if base else None
        host = r["host_residual_bytes"]
        r["transfer_s"] = host / link["d2h_bytes_per_s"] + host / link["h2d_bytes_per_s"]
        r["compute_s"] = compute
        r["compute_ref"] = base["label"] if base else None
        r["step_bar_s"] = None if compute is None else STEP_BAR_FACTOR * max(compute, r["transfer_s"])
        step = r.get("step_time_s")
        r["meets_step_bar"] = None if None in (step, r["step_bar_s"]) else step <= r["step_bar_s"]


def _peak_over_io(row: dict) -> int | None:
    """The device peak less the step's arguments and outputs (the weights and their
    gradients, which grow with the layer count whatever the policy): what the step's own
    buffers add, comparable with the compiled temp. ``None`` without a peak."""
    peak, comp = row.get("peak_bytes_in_use"), row.get("compiled") or {}
    io = (comp.get("argument_size_in_bytes"), comp.get("output_size_in_bytes"))
    return None if peak is None or None in io else peak - io[0] - io[1]


def growth(rows: list[dict], layouts: list[str], labels: list[str], layer_counts: list[int],
           peak_valid: bool) -> list[dict]:  # fmt: skip
    """Per-layer growth of temp memory and device peak per (layout, policy), against the bar.

    ``peak_valid``: whether each row's ``peak_bytes_in_use`` is its own (one process per
    row); in one process the peak only grows, so the peak growth is not reported."""
    lo, hi = min(layer_counts), max(layer_counts)
    by = {(r["layout"], r["layers"], r["label"]): r for r in rows if "error" not in r}
    out = []
    for layout in layouts:
        for label in labels:
            a, b = by.get((layout, lo, label)), by.get((layout, hi, label))
            ref = b or a
            if ref is None:
                continue
            per = ref["residual_bytes_per_layer"]
            bar = per["device"] + MEMORY_BAR_OFFLOAD_FRACTION * per["host"]
            entry = {
                "layout": layout, "label": label, "placement": ref["placement"], "layers": [lo, hi],
                "kept_on_device_bytes_per_layer": per["device"], "offloaded_bytes_per_layer": per["host"],
                "layer_input_bytes": per["layer_input"],
                "bar_bytes_per_layer": bar, "bar_with_layer_input_bytes_per_layer": bar + per["layer_input"],
                "temp_growth_per_layer": None, "peak_growth_per_layer": None,
            }  # fmt: skip
            if a is not None and b is not None and hi > lo:
                ta, tb = a["compiled"]["temp_size_in_bytes"], b["compiled"]["temp_size_in_bytes"]
                if None not in (ta, tb):
                    entry["temp_growth_per_layer"] = (tb - ta) / (hi - lo)
                pa, pb = _peak_over_io(a), _peak_over_io(b)
                if peak_valid and None not in (pa, pb):
                    entry["peak_growth_per_layer"] = (pb - pa) / (hi - lo)
            for what in ("temp", "peak"):
                g = entry[f"{what}_growth_per_layer"]
                entry[f"meets_bar_{what}"] = None if g is None else g <= bar
                entry[f"meets_bar_with_layer_input_{what}"] = None if g is None else g <= bar + per["layer_input"]
            out.append(entry)
    return out


def _f(v, scale=MB, spec=".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v / scale, spec)


def _yn(v) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def print_growth(entries: list[dict]) -> None:
    if not entries:
        return
    lo, hi = entries[0]["layers"]
    print(f"\nper-layer growth between {lo} and {hi} layers, MB per layer (MB = 1e6 bytes). bar = kept on device "
          f"+ {MEMORY_BAR_OFFLOAD_FRACTION:.2f} x offloaded (traced residual bytes per layer);")
    print("+x: the bar plus the layer input x the checkpoint keeps under every policy; d peak: growth of the device "
          "peak less the step's arguments and outputs (weights, gradients); it needs one "
          "process per policy (not --inprocess) and a device that reports memory_stats\n")
    print(f"{'layout':<11}{'policy':<26}{'kept':>8}{'offl':>8}{'x':>8}{'d temp':>9}{'d peak':>9}{'bar':>8}"
          f"{'bar+x':>8}  {'meets bar':<10}{'meets bar+x':<12}")  # fmt: skip
    for e in entries:
        g = e["peak_growth_per_layer"] if e["peak_growth_per_layer"] is not None else e["temp_growth_per_layer"]
        which = "peak" if e["peak_growth_per_layer"] is not None else "temp"
        bar, barx = e["bar_bytes_per_layer"], e["bar_with_layer_input_bytes_per_layer"]
        meets = None if g is None else g <= bar
        meetsx = None if g is None else g <= barx
        print(f"{e['layout']:<11}{e['label']:<26}{_f(e['kept_on_device_bytes_per_layer']):>8}"
              f"{_f(e['offloaded_bytes_per_layer']):>8}{_f(e['layer_input_bytes']):>8}"
              f"{_f(e['temp_growth_per_layer'], spec='+.1f'):>9}{_f(e['peak_growth_per_layer'], spec='+.1f'):>9}"
              f"{_f(bar):>8}{_f(barx):>8}  {_yn(meets) + ' (' + which + ')' if g is not None else '-':<10}"
              f"{_yn(meetsx):<12}")  # fmt: skip


def print_step(rows: list[dict], link: dict) -> None:
    ok = [r for r in rows if "error" not in r and "transfer_s" in r]
    if not ok:
        return
    print(f"\nstep time against {STEP_BAR_FACTOR} x max(compute, transfer); compute = the step of the policy "
          "with its offloads kept on the device (recomputes still recomputed), else all-device; transfer = offloaded bytes "
          f"per step / {link['d2h_bytes_per_s'] / 1e9:.1f} GB/s (device->host) + / "
          f"{link['h2d_bytes_per_s'] / 1e9:.1f} GB/s (host->device), {link['source']}\n")
    print(f"{'layout':<11}{'L':>3} {'policy':<26}{'host MB':>9}{'xfer ms':>9}{'comp ms':>9}{'step ms':>9}"
          f"{'bar ms':>9}  meets bar")  # fmt: skip
    for r in ok:
        print(f"{r['layout']:<11}{r['layers']:>3} {r['label']:<26}{_f(r['host_residual_bytes']):>9}"
              f"{_f(r['transfer_s'], 1e-3, '.2f'):>9}{_f(r['compute_s'], 1e-3, '.2f'):>9}"
              f"{_f(r.get('step_time_s'), 1e-3, '.2f'):>9}{_f(r['step_bar_s'], 1e-3, '.2f'):>9}  "
              f"{_yn(r['meets_step_bar'])}")  # fmt: skip
