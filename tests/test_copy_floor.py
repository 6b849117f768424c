"""benchmarks/copy_floor.py: the copy floor read from a synthetic profiled timeline, and
benchmarks/bench_host_store.py without a GPU."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

from benchmarks import bench_host_store, copy_floor  # noqa: E402


def _ev(name, start, dur, stream="Stream #14(Compute)"):
    return {"stream": stream, "name": name, "start": start, "dur": dur}


def _two_steps(step_us: float = 10_000.0) -> dict:
    """Two identical 10 ms steps: layer 0's forward to 1 ms, copies out 1-3 and 3-4 ms
    (with a tiny serial copy that does not count), copies back 5-6.5 ms and 6.5-8 ms,
    layer 0's backward to the step's end."""
    events = []
    for k in range(2):
        t = k * step_us
        events += [
            _ev("fc1_kernel", t, 1000.0),
            _ev("MemcpyD2H", t + 1000, 2000, "Stream #71(MemcpyD2H)"),
            _ev("MemcpyD2H", t + 3000, 1000, "Stream #71(MemcpyD2H)"),
            _ev("MemcpyH2D", t + 4100, 3.0),  # a serial: not a residual copy
            _ev("MemcpyD2H", t + 4000, 50.0, "Stream #71(MemcpyD2H)"),  # a scale array: counts
            _ev("MemcpyH2D", t + 5000, 1500, "Stream #72(MemcpyH2D)"),
            _ev("MemcpyH2D", t + 6500, 1500, "Stream #72(MemcpyH2D)"),
            _ev("dgrad_kernel", t + 8000, 2000),
        ]
    return {"key": "x", "iters": 2, "unit": "us", "events": events[::-1]}  # any order


def test_floor_of_a_synthetic_timeline():
    r = copy_floor.floor_of(_two_steps())
    assert r["period_s"] == pytest.approx(0.010)
    assert r["first_s"] == pytest.approx(0.001) and r["last_s"] == pytest.approx(0.002)
    assert r["d2h_s"] == pytest.approx(0.00305) and r["h2d_s"] == pytest.approx(0.003)
    assert r["floor_s"] == pytest.approx(0.00905)
    assert r["copies_each_way"] == [3, 2]


def test_floor_of_rejects_what_it_cannot_read():
    with pytest.raises(ValueError, match="unit"):
        copy_floor.floor_of({**_two_steps(), "unit": "ns"})
    with pytest.raises(ValueError, match="no events"):
        copy_floor.floor_of({"iters": 1, "unit": "us", "events": []})
    no_back = _two_steps()
    no_back["events"] = [e for e in no_back["events"] if e["name"] != "MemcpyH2D"]
    with pytest.raises(ValueError, match="both ways"):
        copy_floor.floor_of(no_back)
    uneven = _two_steps()
    uneven["events"].append(_ev("MemcpyH2D", 19_000, 500))
    with pytest.raises(ValueError, match="do not divide"):
        copy_floor.floor_of(uneven)


def test_main_compares_with_a_bench_result_and_writes_json(tmp_path, capsys):
    tl = tmp_path / "layer_scan_o-o-o.timeline.json"
    tl.write_text(json.dumps(_two_steps()))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"rows": [
        {"layout": "layer_scan", "label": "o-o-o", "layers": 8, "step_time_s": 0.012, "step_bar_s": 0.0085},
        {"layout": "layer_scan", "label": "o-o-o", "layers": 4, "step_time_s": 0.006, "step_bar_s": 0.02},
    ]}))
    out = tmp_path / "floor.json"
    assert copy_floor.main([str(tl), "--bench", str(bench), "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    row = saved["results"]["layer_scan_o-o-o"]
    assert row["floor_meets_bar"] is False and row["bench_step_s"] == 0.012  # the 8-layer row
    assert "layer_scan_o-o-o" in capsys.readouterr().out
    bad = tmp_path / "stack_d-o-d.timeline.json"
    bad.write_text(json.dumps({"iters": 1, "unit": "us", "events": []}))
    with pytest.raises(SystemExit):
        copy_floor.main([str(bad)])


def test_bench_host_store_without_a_gpu_measures_nothing(tmp_path, capsys):
    out = tmp_path / "r.json"
    if bench_host_store.jax.default_backend() == "gpu" and bench_host_store.host_store.cuda_store_available():
        pytest.skip("a GPU with the store is here: the script measures")
    assert bench_host_store.main(["--sizes-mb", "1", "--out", str(out)]) == 0
    assert "nothing measured" in capsys.readouterr().out and not out.exists()
    with pytest.raises(SystemExit):
        bench_host_store.main(["--sizes-mb", "0"])
