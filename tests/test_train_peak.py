"""tools/train_peak.py on the CPU: bench_train's step compiled from abstract parameters,
one child per candidate and layer count, a valid results file with the peak's buffers."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from benchmarks.common import check_result

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_small_step_peaks(tmp_path):
    out = tmp_path / "peak.json"
    env = os.environ | {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "train_peak.py"), "--small", "--candidates",
         "jgm_bf16_device,jgm_bf16_device_bf16grad", "--layers", "1", "--top", "4", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert check_result(data) == []
    assert [r["label"] for r in data["rows"]] == ["jgm_bf16_device L=1", "jgm_bf16_device_bf16grad L=1"]
    for row in data["rows"]:
        assert row["temp_bytes"] > 0
        peak = row["temp_peak"]
        assert 0 < peak["estimated_peak_bytes"] <= peak["temp_allocation_bytes"]
        assert peak["live_at_peak_top"] and all(b["bytes"] > 0 for b in peak["live_at_peak_top"])
    assert "jgm_bf16_device_bf16grad" in run.stdout and "temp" in run.stdout


def test_unknown_candidate_is_named():
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "train_peak.py"), "--candidates", "jgm_bf16_device,nope"],
        env=os.environ | {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=300,
    )
    assert run.returncode == 2 and "unknown ['nope']" in run.stderr, run.stderr[-1000:]
