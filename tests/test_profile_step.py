"""benchmarks/profile_step.py: its per-kernel summary (pure functions) and a CPU run, which
has no device events and must say so without writing a file."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

from benchmarks import profile_step  # noqa: E402


def test_summary_sums_per_name_and_step_largest_first():
    events = [("loop_convert_fusion", 2e6), ("kernel_cutlass_grouped_gemm_0", 5e6),
              ("loop_convert_fusion", 4e6), ("kernel_cutlass_grouped_gemm_0", 5e6), ("memcpy_d2h", 1e6)]
    rows = profile_step.summarize(events, steps=2)
    assert [r["kernel"] for r in rows] == ["kernel_cutlass_grouped_gemm_0", "loop_convert_fusion", "memcpy_d2h"]
    assert rows[0]["ms_per_step"] == pytest.approx(5.0) and rows[0]["launches_per_step"] == 1
    assert rows[1]["ms_per_step"] == pytest.approx(3.0)
    assert [r["kind"] for r in rows] == ["ours", "xla fusion", "xla copy"]
    assert profile_step.by_kind(rows) == pytest.approx({"ours": 5.0, "xla fusion": 3.0, "xla copy": 0.5})
    with pytest.raises(ValueError, match="steps must be >= 1"):
        profile_step.summarize(events, steps=0)


def test_kinds():
    assert profile_step.kind_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "cublas"
    assert profile_step.kind_of("input_reduce_fusion_3") == "xla fusion"
    assert profile_step.kind_of("something_else") == "other"


def test_cpu_run_reports_no_device_events(tmp_path, capsys):
    import jax

    if jax.devices()[0].platform != "cpu":
        pytest.skip("a GPU trace has device events")
    out = tmp_path / "p.json"
    # --keep-command-buffers: leave XLA_FLAGS of this test process alone.
    assert profile_step.main(["--shape", "tiny", "--iters", "1", "--keep-command-buffers", "--out", str(out)]) == 0
    assert "no device events" in capsys.readouterr().out
    assert not out.exists()


@pytest.mark.parametrize("argv,key", [
    (["--step", "grad_accum", "--shape", "tiny", "--micro-batches", "2", "--candidates", "bf16/prepared_once"],
     "tiny@uniform/bf16/prepared_once/2mb"),
    (["--step", "stack", "--shape", "cpu", "--layers", "2", "--candidates", "scan/d-o-d", "--no-prevent-cse"],
     "cpu/2L/scan/d-o-d/no_prevent_cse"),
    (["--step", "block", "--shape", "small", "--tokens", "32", "--candidates", "bf16/float32/bf16grad"],
     "moe_block/small/32tok/bf16/float32/bf16grad"),
])
def test_cpu_run_of_each_step(capsys, argv, key):
    import jax

    if jax.devices()[0].platform != "cpu":
        pytest.skip("a GPU trace has device events")
    assert profile_step.main([*argv, "--iters", "1", "--keep-command-buffers"]) == 0
    assert f"{key}: no device events" in capsys.readouterr().out


def test_bad_arguments_name_the_flag(monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", "")  # main() appends to it; restored afterwards
    for argv, flag in ((["--shape", "huge"], "--shape"), (["--candidates", "nope"], "--candidates"),
                       (["--iters", "0"], "--iters"), (["--step", "grad_accum", "--candidates", "bf16"], "--candidates"),
                       (["--step", "grad_accum", "--micro-batches", "0"], "--micro-batches"),
                       (["--step", "stack", "--shape", "tiny"], "--shape"),
                       (["--step", "stack", "--candidates", "loop/x-y-z"], "--candidates"),
                       (["--step", "stack", "--layers", "0"], "--layers"),
                       (["--step", "block", "--candidates", "bf16/float16"], "--candidates"),
                       (["--step", "block", "--candidates", "bf16/float32/x"], "--candidates"),
                       (["--step", "block", "--tokens", "0"], "--tokens"),
                       (["--step", "block", "--shape", "tiny"], "--shape")):
        with pytest.raises(SystemExit):
            profile_step.main(argv)
        assert flag in capsys.readouterr().err


def test_mlp_candidates_are_traced_in_their_context(monkeypatch, capsys):
    """bench_mlp's _qw A/B candidates are profiled as traced under ``bench_mlp.tracing``."""
    import contextlib

    import jax

    if jax.devices()[0].platform != "cpu":
        pytest.skip("a GPU trace has device events")
    import bench_mlp

    seen = []

    @contextlib.contextmanager
    def spy(cname):
        seen.append(cname)
        yield

    monkeypatch.setattr(bench_mlp, "tracing", spy)
    monkeypatch.setattr(bench_mlp, "QW_TABLE", None)
    argv = ["--shape", "tiny", "--iters", "1", "--keep-command-buffers",
            "--candidates", "grouped_mlp_mxfp8,grouped_mlp_mxfp8_qw_one_tile,grouped_mlp_mxfp8_qw_table",
            "--qw-table", "192:0.42/0.42,256:0.49/0.49,384:0.727/0.58,launch:1.0"]
    assert profile_step.main(argv) == 0
    assert seen == ["grouped_mlp_mxfp8", "grouped_mlp_mxfp8_qw_one_tile", "grouped_mlp_mxfp8_qw_table"]
    assert bench_mlp.QW_TABLE[1] == 1.0  # (restored to None by monkeypatch: set below before main ran)
    assert "grouped_mlp_mxfp8_qw_one_tile: no device events" in capsys.readouterr().out
