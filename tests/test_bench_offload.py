"""benchmarks/bench_offload.py: its HLO reading on a GPU-style module, and a tiny end-to-end run (CPU)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks import bench_offload, buffer_assignment, common  # noqa: E402

# What XLA:GPU's host offloader leaves in a compiled module: async copies to and from
# memory space S(5), a synchronous copy, and a fusion whose body mentions S(5) (not
# counted again: only the fusion instruction itself is).
GPU_STYLE_HLO = """HloModule m, is_scheduled=true, entry_computation_layout={(f32[1024]{0})->f32[1024]{0}}

%fused_computation (param_0: f32[256]) -> f32[256] {
  %param_0 = f32[256]{0:S(5)} parameter(0)
  ROOT %neg = f32[256]{0:S(5)} negate(%param_0)
}

ENTRY %main (p0: f32[1024], h: bf16[1024], buf: f32[4,256], i: s32[]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  %copy-start = (f32[1024]{0:S(5)}, f32[1024]{0}, u32[]) copy-start(%p0)
  %tanh = f32[1024]{0} tanh(%p0), metadata={op_name="jit(loss)/jvp()/tanh"}
  %copy-done = f32[1024]{0:S(5)} copy-done((f32[1024]{0:S(5)}, f32[1024]{0}, u32[]) %copy-start)
  %h = bf16[1024]{0:S(5)} parameter(1)
  %copy-start.1 = (bf16[1024]{0}, bf16[1024]{0:S(5)}, u32[]) copy-start(%h)
  %copy-done.1 = bf16[1024]{0} copy-done(%copy-start.1)
  %slice = f32[256]{0} slice(%tanh), slice={[0:256]}
  %copy.1 = f32[256]{0:S(5)} copy(%slice)
  %fusion = f32[256]{0:S(5)} fusion(%copy.1), kind=kLoop, calls=%fused_computation
  %buf = f32[4,256]{1,0:S(5)} parameter(2)
  %i = s32[] parameter(3)
  %upd = f32[1,256]{1,0} bitcast(%slice)
  %dus = f32[4,256]{1,0:S(5)} dynamic-update-slice(%buf, %upd, %i, %i)
  %ds = f32[1,256]{1,0} dynamic-slice(%dus, %i, %i), dynamic_slice_sizes={1,256}
  %mv = f32[1024]{0} custom-call(%tanh), custom_call_target="MoveToDevice"
  ROOT %add = f32[1024]{0} add(%tanh, %mv)
}
"""


def test_host_placement_report_counts_s5_and_transfers():
    r = bench_offload.host_placement_report(GPU_STYLE_HLO)
    assert r["s5_instructions_by_opcode"] == {
        "parameter": 2, "copy-start": 2, "copy-done": 1, "copy": 1, "fusion": 1, "dynamic-update-slice": 1
    }  # fmt: skip
    assert r["to_host_ops"] == {"copy-start": 1, "copy": 1, "dynamic-update-slice": 1}
    assert r["to_device_ops"] == {"copy-start": 1, "dynamic-slice": 1}
    assert r["to_host_bytes"] == 4096 + 1024 + 1024  # the slice written, not the host buffer
    assert r["to_device_bytes"] == 2048 + 1024  # the bf16 source of copy-start.1, the slice read
    assert r["host_placement_custom_calls"] == {"MoveToDevice": 1}
    assert r["s5_in_entry_layout"] == 0


def test_protobuf_reader():
    # field 1 varint 150, field 2 bytes "ab", field 3 packed [1, 300]
    blob = bytes([0x08, 0x96, 0x01, 0x12, 0x02, 0x61, 0x62, 0x1A, 0x03, 0x01, 0xAC, 0x02])
    fields = list(buffer_assignment._fields(blob))
    assert fields[:2] == [(1, 150), (2, b"ab")]
    assert buffer_assignment._ints([fields[2][1]]) == [1, 300]


def test_tiny_run_end_to_end(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs the bench extra (pip install .[bench])")
    out = tmp_path / "offload.json"
    png = tmp_path / "offload.png"
    argv = ["--tokens", "128", "--hidden", "32", "--ffn", "64", "--experts", "4", "--layers", "1",
            "--policies", "all_offload,all_device", "--warmup", "1", "--samples", "1",
            "--out", str(out), "--plot", str(png)]  # fmt: skip
    result = bench_offload.main(argv)
    saved = json.loads(out.read_text())
    assert common.check_result(saved) == []  # written through common.write_result
    assert png.stat().st_size > 0
    assert saved["argv"] == argv and saved["complete"] and saved["one_process_per_policy"]
    assert saved["device"] and saved["platform"] == result["platform"]
    assert saved["default_offload_policy"] == dict.fromkeys(bench_offload.PLACEMENT_NAMES, "offload")
    rows = {r["label"]: r for r in saved["rows"]}
    assert list(rows) == ["all_device", "all_offload"]  # table order, whatever the run order
    dev, off = rows["all_device"], rows["all_offload"]
    # What the traced gradients keep: everything on device, or everything on host.
    assert dev["device_residual_bytes"] > 0 and dev["host_residual_bytes"] == 0
    assert off["device_residual_bytes"] == 0 and off["host_residual_bytes"] == dev["device_residual_bytes"]
    assert {t["placement"] for t in off["traced"].values()} == {"offload"}
    lowered = off["lowered_placement"]  # what JAX asks XLA to move (lowered for CUDA off the GPU)
    assert "error" not in lowered
    assert sum(v["bytes"] for v in lowered["pinned_host"].values()) == off["host_residual_bytes"]
    assert set(lowered["pinned_host"]) == {"bf16", "f8E4M3FN", "f8E8M0FNU"}  # h; MXFP8 data and scales
    assert "pinned_host" not in dev["lowered_placement"]
    assert saved["bar"]["traced"]["passes"] is True
    assert saved["bar"]["compiled_temp"]["drop"] is None  # needs all_recompute
    for r in rows.values():
        assert r["step_time_s"] > 0
        assert r["compiled"]["temp_size_in_bytes"] is not None
        assert {"s5_instructions", "to_host_ops", "to_device_bytes"} <= set(r["hlo"])
        tp = r["temp_peak"]
        assert tp["source"] == "xla_dump"  # each policy's process dumps its step
        assert sum(tp["live_at_peak_residual_bytes"].values()) == tp["estimated_peak_bytes"]
        assert tp["temp_allocation_bytes"] == r["compiled"]["temp_size_in_bytes"]
        assert 0 < tp["estimated_peak_bytes"] <= tp["temp_allocation_bytes"]
        assert tp["live_at_peak_top"]
    if saved["platform"] == "cpu":  # no memory_stats, and device_put inside jit is a no-op
        assert dev["peak_bytes_in_use"] is None
        assert off["hlo"]["s5_instructions"] == 0


def test_inprocess_run_estimates_the_peak_from_the_serialized_assignment(tmp_path):
    """--inprocess: no XLA dump (XLA_FLAGS is read once per process), so the temp peak
    comes from the serialized buffer assignment (XLA:CPU has it)."""
    out = tmp_path / "offload.json"
    bench_offload.main(["--tokens", "128", "--hidden", "32", "--ffn", "64", "--experts", "4", "--layers", "1",
                        "--policies", "all_device", "--warmup", "1", "--samples", "1", "--inprocess",
                        "--out", str(out)])  # fmt: skip
    saved = json.loads(out.read_text())
    (row,) = saved["rows"]
    tp = row["temp_peak"]
    if saved["platform"] == "cpu" or tp is not None:  # XLA:GPU has no serialized assignment: None there
        assert "source" not in tp
        assert 0 < tp["estimated_peak_bytes"] <= tp["temp_allocation_bytes"]
        assert tp["live_at_peak_top"] and "live_at_peak_by_shape" in tp
