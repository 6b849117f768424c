"""The fastest step a stack's host copies allow, read from a profiled timeline.

    PYTHONPATH=. python3 benchmarks/copy_floor.py TIMELINE.json [...] [--bench RESULT.json] [--out FILE]

Reads the timelines ``profile_step.py --step stack --timeline DIR`` writes (every device
event of ``iters`` back-to-back steps) and measures:

* ``first_s``: from the first step's start (the trace's first event) to its first
  device->host copy (layer 0's forward, as this schedule ran it);
* ``last_s``: from the last step's last host->device copy to its end (the trace's last
  event): layer 0's backward;
* ``d2h_s`` / ``h2d_s``: the summed durations of the copies each way over all steps,
  divided by ``iters``, i.e. at the rate the copy engines reached on these arrays (on
  the H200, 48-50 GB/s for the 100-200 MB residuals of the expert-parallel Nano share
  against ~53.8 GB/s for the 2 GB copy that sets ``bench_offload``'s bar). Copies shorter
  than ``MIN_COPY_US`` (a serial, one element read back) are not residuals.

``floor_s = first_s + d2h_s + h2d_s + last_s`` bounds schedules like the one measured
that keep about one layer's copies in flight: the copies out follow layer 0's forward,
the copies back come after the copies out (the backward needs the forward's last copies
first), and layer 0's backward follows the last copy back. When ``floor_s`` exceeds the
step bar of ``bench_offload.py`` (``1.15 x max(compute, transfer at the 2 GB rate)``),
such a schedule cannot meet the bar at these copy rates; faster copies, more layers in
flight (memory), or copies inside a layer (shorter first and last terms) could.
``--bench`` takes a ``bench_offload`` result with the same layout, layer count and
policies and puts each row's measured step and bar beside the floor.

Candidates are named ``LAYOUT_POLICY.timeline.json`` (``profile_step``'s names). Writes
JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import command_line, write_result  # noqa: E402

COPY_NAMES = ("MemcpyD2H", "MemcpyH2D")
MIN_COPY_US = 20.0  # shorter copies (a serial, one element read back) are not residuals


def floor_of(timeline: dict) -> dict:
    """``first_s`` (the first step), ``last_s`` (the last step), ``d2h_s``, ``h2d_s``
    (per step), ``floor_s`` and ``period_s`` (the steps' span over ``iters``) from a
    ``profile_step`` timeline (``{"iters", "unit": "us", "events": [{"stream", "name",
    "start", "dur"}]}``). Only the trace's two ends are used as step boundaries (steps
    run back to back, and a copy may cross from one into the next).

    Raises:
      ValueError: the timeline has no events, another unit, no copies both ways, or
        copies that do not divide evenly into its steps.
    """
    if timeline.get("unit") != "us":
        raise ValueError(f"timeline unit must be 'us', got {timeline.get('unit')!r}")
    events = sorted(timeline.get("events") or [], key=lambda e: e["start"])
    iters = int(timeline.get("iters") or 1)
    if not events or iters < 1:
        raise ValueError("timeline has no events")
    t0, end = events[0]["start"], max(e["start"] + e["dur"] for e in events)
    copies = {n: [e for e in events if e["name"] == n and e["dur"] >= MIN_COPY_US] for n in COPY_NAMES}
    if not all(copies.values()):
        raise ValueError(f"timeline has no residual copies both ways ({iters} steps)")
    d2h, h2d = copies["MemcpyD2H"], copies["MemcpyH2D"]
    if len(d2h) % iters or len(h2d) % iters:
        raise ValueError(f"{len(d2h)} copies out and {len(h2d)} back do not divide into {iters} steps")
    out = {
        "period_s": (end - t0) / iters,
        "first_s": d2h[0]["start"] - t0,
        "last_s": max(end - max(e["start"] + e["dur"] for e in h2d), 0.0),
        "d2h_s": sum(e["dur"] for e in d2h) / iters,
        "h2d_s": sum(e["dur"] for e in h2d) / iters,
        "copies_each_way": [len(d2h) // iters, len(h2d) // iters],
    }
    out["floor_s"] = out["first_s"] + out["d2h_s"] + out["h2d_s"] + out["last_s"]
    return {k: v / 1e6 if k.endswith("_s") else v for k, v in out.items()}


def _bench_rows(path: pathlib.Path | None) -> dict:
    if path is None:
        return {}
    data = json.loads(path.read_text())
    rows = [r for r in data.get("rows", []) if r.get("step_time_s") is not None]
    return {(r["layout"], r["label"], r["layers"]): r for r in rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("timelines", nargs="+", type=pathlib.Path)
    ap.add_argument("--bench", type=pathlib.Path, default=None, help="a bench_offload result to compare with")
    ap.add_argument("--layers", type=int, default=8, help="the layer count of the timelines (to match --bench rows)")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ns = ap.parse_args(argv)
    bench = _bench_rows(ns.bench)
    results = {}
    print(f"{'candidate':24} {'period':>7} {'first':>6} {'d2h':>6} {'h2d':>6} {'last':>6} {'floor':>7}"
          f" {'bench':>7} {'bar':>7}  floor <= bar")
    for path in ns.timelines:
        try:
            r = floor_of(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"{path}: {e}")
        name = path.name.removesuffix(".timeline.json")
        layout, _, label = name.rpartition("_")
        row = bench.get((layout, label, ns.layers))
        if row is not None:
            r |= {"bench_step_s": row["step_time_s"], "step_bar_s": row.get("step_bar_s")}
            if r["step_bar_s"] is not None:
                r["floor_meets_bar"] = r["floor_s"] <= r["step_bar_s"]
        results[name] = r
        ms = lambda k: f"{r[k] * 1e3:7.2f}" if r.get(k) is not None else f"{'-':>7}"  # noqa: E731
        print(f"{name:24} {ms('period_s')} {r['first_s'] * 1e3:6.2f} {r['d2h_s'] * 1e3:6.2f} {r['h2d_s'] * 1e3:6.2f}"
              f" {r['last_s'] * 1e3:6.2f} {ms('floor_s')} {ms('bench_step_s')} {ms('step_bar_s')}"
              f"  {r.get('floor_meets_bar', '-')}")
    if ns.out is not None:
        write_result(ns.out, command=command_line("benchmarks/copy_floor.py", argv or sys.argv[1:]),
                     results=results, extra={"bench": str(ns.bench) if ns.bench else None, "layers": ns.layers},
                     device="from the timelines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
