"""benchmarks/bench_offload.py: its HLO reading on a GPU-style module, and a tiny end-to-end run (CPU)."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks import bench_offload, buffer_assignment, common  # noqa: E402

# What XLA:GPU's host offloader leaves in a compiled module: async copies to and from
# memory space S(5), a synchronous copy, and a fusion whose body mentions S(5) (not
# counted again: only the fusion instruction itself is), and a one-element read-back.
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
  %rb = f32[1,1]{1,0} dynamic-slice(%dus, %i, %i), dynamic_slice_sizes={1,1}
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
    assert r["read_backs"] == 1  # the one-element read (the host-copy fence's), not a reload
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
            "--layout", "loop", "--policies", "all_offload,all_device", "--warmup", "1", "--samples", "1",
            "--link-mb", "1", "--out", str(out), "--plot", str(png)]  # fmt: skip
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
    assert saved["bars"]["loop/1"]["traced"]["passes"] is True
    assert saved["bars"]["loop/1"]["compiled_temp"]["drop"] is None  # needs all_recompute
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
                        "--layout", "loop", "--policies", "all_device", "--warmup", "1", "--samples", "1",
                        "--inprocess", "--link-mb", "0", "--out", str(out)])  # fmt: skip
    saved = json.loads(out.read_text())
    (row,) = saved["rows"]
    tp = row["temp_peak"]
    if saved["platform"] == "cpu" or tp is not None:  # XLA:GPU has no serialized assignment: None there
        assert "source" not in tp
        assert 0 < tp["estimated_peak_bytes"] <= tp["temp_allocation_bytes"]
        assert tp["live_at_peak_top"] and "live_at_peak_by_shape" in tp


TINY = dict(tokens=128, hidden=32, ffn=64, experts=4)


def test_layouts_layer_counts_and_bars_inprocess(tmp_path):
    """Both layouts at two layer counts, two policies (one a d-o-r label), in one process:
    every row is there, the per-layer residual bytes agree with the planner's formula in
    both layouts and at both counts, and the growth and step bars are finite and follow
    their definitions."""
    from jax_grouped_mlp._src.offload.planner import LayerShape

    out = tmp_path / "offload.json"
    argv = ["--tokens", "128", "--hidden", "32", "--ffn", "64", "--experts", "4", "--layers", "1,2",
            "--layout", "both", "--policies", "d-o-r,all_device", "--warmup", "0", "--samples", "1",
            "--link-mb", "1", "--inprocess", "--out", str(out)]  # fmt: skip
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--plot", str(tmp_path / "offload.png")]
    bench_offload.main(argv)
    saved = json.loads(out.read_text())
    assert common.check_result(saved) == []
    assert saved["layouts"] == ["loop", "scan"] and saved["layer_counts"] == [1, 2]
    assert saved["policies"] == ["all_device", "d-o-r"]
    keys = [(r["layout"], r["layers"], r["label"]) for r in saved["rows"]]
    assert keys == [(lo, n, p) for lo in ("loop", "scan") for n in (1, 2) for p in ("all_device", "d-o-r")]
    assert set(saved["bars"]) == {"loop/1", "loop/2", "scan/1", "scan/2"}

    per_residual = LayerShape(128, 32, 64, 4).residual_bytes("mxfp8")  # independent of the traced report
    want_device = {"all_device": sum(per_residual.values()), "d-o-r": per_residual["fc1_input"]}
    want_host = {"all_device": 0, "d-o-r": per_residual["activation_input"]}
    for r in saved["rows"]:
        assert r["placement"] == dict(zip(bench_offload.PLACEMENT_NAMES, bench_offload.POLICIES[r["label"]]))
        per = r["residual_bytes_per_layer"]
        where = (r["layout"], r["layers"], r["label"])
        assert (per["device"], per["host"]) == (want_device[r["label"]], want_host[r["label"]]), where
        assert per["layer_input"] == 128 * 32 * 2
        assert r["host_residual_bytes"] == per["host"] * r["layers"]
        assert r["compiled"]["temp_size_in_bytes"] > 0 and r["step_time_s"] > 0
        assert math.isfinite(r["transfer_s"]) and r["compute_s"] > 0
        assert r["step_bar_s"] == pytest.approx(1.15 * max(r["compute_s"], r["transfer_s"]))
        assert r["meets_step_bar"] == (r["step_time_s"] <= r["step_bar_s"])
        assert (r["transfer_s"] > 0) == (r["label"] != "all_device")

    link = saved["link"]
    if "pinned_host" in saved["memory_kinds"]:  # the CPU has one: the copies are measured
        assert link["source"] == "measured" and link["bytes"] == 10**6
    assert link["d2h_bytes_per_s"] > 0 and link["h2d_bytes_per_s"] > 0

    growth = {(g["layout"], g["label"]): g for g in saved["growth"]}
    assert set(growth) == {(lo, p) for lo in ("loop", "scan") for p in want_device}
    rows = {k: r for k, r in zip(keys, saved["rows"])}
    for (layout, label), g in growth.items():
        t1, t2 = (rows[layout, n, label]["compiled"]["temp_size_in_bytes"] for n in (1, 2))
        assert g["temp_growth_per_layer"] == t2 - t1 and math.isfinite(g["temp_growth_per_layer"])
        assert g["peak_growth_per_layer"] is None  # in one process the peak is cumulative
        assert g["bar_bytes_per_layer"] == pytest.approx(want_device[label] + 0.10 * want_host[label])
        assert g["meets_bar_temp"] == (g["temp_growth_per_layer"] <= g["bar_bytes_per_layer"])


def test_scan_and_loop_layouts_give_the_same_gradients():
    """The layouts are the same model: bitwise-equal gradients under an offload policy
    (XLA:CPU; the weights of the loop and the stack are the scan's slices)."""
    import jax
    import numpy as np

    grads = {}
    for layout in bench_offload.LAYOUTS:
        loss_for, (params, x, sizes, probs) = bench_offload.make_stack(TINY, 2, "mxfp8", False, layout=layout)
        g_params, g_x = jax.jit(jax.grad(loss_for("d-o-d"), argnums=(0, 1)))(params, x, sizes, probs)
        if layout in ("loop", "stack"):
            g_params = tuple(np.stack([np.asarray(p[i]) for p in g_params]) for i in range(2))
        grads[layout] = [np.asarray(a, np.float32) for a in (*g_params, g_x)]
    assert all(np.abs(g).max() > 0 for g in grads["loop"])
    for other in ("scan", "stack", "layer_scan"):
        for name, a, b in zip(("dw1", "dw2", "dx"), grads["loop"], grads[other]):
            np.testing.assert_array_equal(a, b, err_msg=f"{other} {name}")


def test_policy_labels():
    assert len(bench_offload.offload_bars.ALL27) == 27
    assert bench_offload.POLICIES["d-o-r"] == ("device", "offload", "recompute")
    labels = bench_offload._labels("all_device,all27,d-d-d", pytest.fail)
    assert labels[0] == "all_device" and len(labels) == 28 and labels.count("d-d-d") == 1
    with pytest.raises(SystemExit):
        bench_offload.main(["--policies", "x-y-z"])
    with pytest.raises(SystemExit):
        bench_offload.main(["--layers", "4,0"])


def test_step_bar_compares_with_the_policy_without_its_copies():
    """A policy that recomputes pays for the recompute with or without copies: its step
    bar's compute is the same placement with the offloads kept on the device, and the
    all-device step only where that placement was not measured."""
    from benchmarks import offload_bars

    def row(label, step, host):
        placement = dict(zip(("fc1_input", "activation_input", "fc2_input"), offload_bars.ALL27[label]))
        return {"label": label, "placement": placement, "step_time_s": step, "host_residual_bytes": host}

    rows = [row("d-d-d", 0.050, 0), row("d-r-d", 0.060, 0), row("d-r-o", 0.066, 1e9),
            row("o-d-r", 0.070, 1e9), row("o-o-o", 0.200, 4e9)]  # fmt: skip
    link = {"d2h_bytes_per_s": 100e9, "h2d_bytes_per_s": 100e9}
    offload_bars.step_bars(rows, link)
    by = {r["label"]: r for r in rows}
    assert by["d-r-o"]["compute_ref"] == "d-r-d" and by["d-r-o"]["compute_s"] == 0.060
    assert by["d-r-o"]["meets_step_bar"] is True  # 66 <= 1.15 x 60 ms, not <= 1.15 x 50
    assert by["o-d-r"]["compute_ref"] == "d-d-d"  # d-d-r not measured: the all-device step
    assert by["o-d-r"]["meets_step_bar"] is False
    assert by["o-o-o"]["transfer_s"] == pytest.approx(0.08)
    assert by["o-o-o"]["step_bar_s"] == pytest.approx(1.15 * 0.08)


def test_peak_growth_excludes_the_weights_and_gradients():
    """The device peak holds the step's arguments and outputs (weights and their
    gradients, which grow with the layers under every policy): the peak growth compared
    with the bar is that of the peak less them (H200, 4 -> 8 layers, all offloaded in a
    scan: raw peak +647 MB a layer, weights and gradients +639, residuals +8)."""
    from benchmarks import offload_bars

    per = {"device": 0, "host": 400, "layer_input": 100}

    def row(layers, peak, io):
        return {"layout": "scan", "layers": layers, "label": "o-o-o", "placement": {},
                "residual_bytes_per_layer": per, "peak_bytes_in_use": peak,
                "compiled": {"temp_size_in_bytes": 1000, "argument_size_in_bytes": io,
                             "output_size_in_bytes": io}}  # fmt: skip

    rows = [row(4, 10_000 + 2 * 4 * 300, 4 * 300), row(8, 10_000 + 2 * 8 * 300 + 4 * 20, 8 * 300)]
    (entry,) = offload_bars.growth(rows, ["scan"], ["o-o-o"], [4, 8], peak_valid=True)
    assert entry["peak_growth_per_layer"] == 20
    assert entry["meets_bar_peak"] is True  # 20 <= 0.10 x 400
    assert entry["temp_growth_per_layer"] == 0
    (entry,) = offload_bars.growth(rows, ["scan"], ["o-o-o"], [4, 8], peak_valid=False)
    assert entry["peak_growth_per_layer"] is None


def test_plan_vs_measured_reads_the_committed_h200_run():
    """benchmarks/plan_vs_measured.py: every placement of both layouts of the committed
    27-placement run gets a prediction next to its measurement."""
    from benchmarks import plan_vs_measured

    run = json.loads((pathlib.Path(__file__).resolve().parent.parent / "benchmarks/results/offload_all27_h200.json")
                     .read_text())
    rows = plan_vs_measured.compare(run)
    assert len(rows) == 54 and {r["layout"] for r in rows} == {"loop", "scan"}
    for r in rows:
        assert r["step_pred_s"] > 0 and r["step_meas_s"] > 0 and math.isfinite(r["step_rel_err"])
        assert r["temp_growth_per_layer_meas"] is not None
    # The all-device step is the planner's input, so it is predicted exactly.
    assert all(abs(r["step_rel_err"]) < 1e-9 for r in rows if r["label"] == "d-d-d")


def test_planner_predicts_the_scans_memory_growth_on_the_h200():
    """The planner against the committed H200 run: in the scan, every placement's growth
    of compiled temp per layer within 25 MB of the prediction (kept residuals plus the
    layer input x where a recompute keeps it; 413 MB of residuals a layer)."""
    from benchmarks import plan_vs_measured

    run = json.loads((pathlib.Path(__file__).resolve().parent.parent / "benchmarks/results/offload_all27_h200.json")
                     .read_text())
    scan = [r for r in plan_vs_measured.compare(run) if r["layout"] == "scan"]
    assert len(scan) == 27
    for r in scan:
        assert abs(r["device_bytes_per_layer_pred"] - r["temp_growth_per_layer_meas"]) < 25e6, r
