"""tools/ab_extensions.py: builds alternate in separate processes, order reversed every
other round, the original extension restored, and the means and ratios computed right."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import ab_extensions  # noqa: E402
from common import check_result  # noqa: E402

# A stand-in benchmark: reads which build is installed and reports a time for it, plus the
# order in which it ran (appended to a log next to the extension).
FAKE_BENCH = """
import json, pathlib, sys
ext, out = pathlib.Path(sys.argv[1]), sys.argv[2]
build = ext.read_text()
with open(ext.with_suffix(".log"), "a") as f:
    f.write(build + "\\n")
ms = {"base": 2.0, "fast": 1.5}[build]
json.dump({"schema": 1, "device": "Fake GPU", "results": {"gemm fc1": {"by_alpha": {"uniform": ms, "alpha=1": 2 * ms}}}},
          open(out, "w"))
"""


def test_alternates_restores_and_summarizes(tmp_path):
    ext = tmp_path / "_kernels.so"
    ext.write_text("original")
    (tmp_path / "base.so").write_text("base")
    (tmp_path / "fast.so").write_text("fast")
    bench = tmp_path / "bench.py"
    bench.write_text(FAKE_BENCH)
    out = tmp_path / "ab.json"
    rc = ab_extensions.main([
        "--builds", f"base={tmp_path / 'base.so'},fast={tmp_path / 'fast.so'}", "--rounds", "3",
        "--extension", str(ext), "--out", str(out), "--", sys.executable, str(bench), str(ext), "{out}",
    ])
    assert rc == 0
    assert ext.read_text() == "original"  # put back
    order = (tmp_path / "_kernels.log").read_text().split()
    assert order == ["base", "fast", "fast", "base", "base", "fast"]  # reversed every other round
    data = json.loads(out.read_text())
    assert check_result(data) == []
    assert data["device"] == "Fake GPU"
    row = data["results"]["mean"]["gemm fc1"]["alpha=1"]
    assert row["base"] == 4.0 and row["fast"] == 3.0 and row["fast/base"] == pytest.approx(0.75)
    assert len(data["results"]["runs"]) == 6


def test_a_failing_run_stops_and_restores(tmp_path):
    ext = tmp_path / "_kernels.so"
    ext.write_text("original")
    (tmp_path / "a.so").write_text("a")
    (tmp_path / "b.so").write_text("b")
    with pytest.raises(SystemExit, match="failed"):
        ab_extensions.main([
            "--builds", f"a={tmp_path / 'a.so'},b={tmp_path / 'b.so'}", "--extension", str(ext),
            "--out", str(tmp_path / "x.json"), "--", sys.executable, "-c", "raise SystemExit(3)", "{out}",
        ])
    assert ext.read_text() == "original"


def test_bad_builds_are_named(tmp_path):
    one = tmp_path / "x.so"
    one.write_text("x")
    with pytest.raises(SystemExit, match="at least two"):
        ab_extensions.parse_builds(f"a={one}")
    with pytest.raises(SystemExit, match="twice"):
        ab_extensions.parse_builds(f"a={one},a={one}")
    with pytest.raises(SystemExit, match="no file"):
        ab_extensions.parse_builds(f"a={one},b={tmp_path / 'missing.so'}")
    with pytest.raises(SystemExit, match="name=path"):
        ab_extensions.parse_builds("justaname")


def test_command_needs_out_placeholder(tmp_path):
    (tmp_path / "a.so").write_text("a")
    (tmp_path / "b.so").write_text("b")
    with pytest.raises(SystemExit, match="{out}"):
        ab_extensions.main(["--builds", f"a={tmp_path / 'a.so'},b={tmp_path / 'b.so'}", "--out",
                            str(tmp_path / "x.json"), "--", "python3", "bench.py"])


def _builds(tmp_path, names=("base", "fast")) -> tuple[pathlib.Path, str]:
    ext = tmp_path / "_kernels.so"
    ext.write_text("original")
    for n in names:
        (tmp_path / f"{n}.so").write_text(n)
    return ext, ",".join(f"{n}={tmp_path / f'{n}.so'}" for n in names)


def test_a_complete_run_says_so(tmp_path):
    ext, builds = _builds(tmp_path)
    bench = tmp_path / "bench.py"
    bench.write_text(FAKE_BENCH)
    out = tmp_path / "ab.json"
    ab_extensions.main(["--builds", builds, "--rounds", "1", "--extension", str(ext), "--out", str(out), "--",
                        sys.executable, str(bench), str(ext), "{out}"])
    results = json.loads(out.read_text())["results"]
    assert results["complete"] is True and "stopped" not in results


def test_runs_before_a_failure_are_kept(tmp_path):
    """A device call cut short must still bring back the runs it finished."""
    ext, builds = _builds(tmp_path)
    bench = tmp_path / "bench.py"
    bench.write_text("import pathlib, sys\n"
                     "if pathlib.Path(sys.argv[1]).read_text() == 'fast': raise SystemExit(3)\n" + FAKE_BENCH)
    out = tmp_path / "ab.json"
    with pytest.raises(SystemExit, match="fast round 1"):
        ab_extensions.main(["--builds", builds, "--rounds", "2", "--extension", str(ext), "--out", str(out), "--",
                            sys.executable, str(bench), str(ext), "{out}"])
    data = json.loads(out.read_text())
    assert check_result(data) == []
    assert data["results"]["complete"] is False and "fast round 1 failed" in data["results"]["stopped"]
    assert [r["build"] for r in data["results"]["runs"]] == ["base"]
    assert data["results"]["mean"]["gemm fc1"]["uniform"] == {"base": 2.0}
    assert ext.read_text() == "original"


def test_budget_starts_no_run_that_would_overrun(tmp_path):
    ext, builds = _builds(tmp_path)
    bench = tmp_path / "bench.py"
    bench.write_text(FAKE_BENCH)
    out = tmp_path / "ab.json"
    assert ab_extensions.main(["--builds", builds, "--rounds", "2", "--budget", "0.01", "--extension", str(ext),
                               "--out", str(out), "--", sys.executable, str(bench), str(ext), "{out}"]) == 0
    results = json.loads(out.read_text())["results"]
    assert len(results["runs"]) == 1  # the first run always goes; then the budget is spent
    assert results["complete"] is False and "1 of 4 runs" in results["stopped"]
    assert (tmp_path / "_kernels.log").read_text().split() == ["base"]
    assert ext.read_text() == "original"
    with pytest.raises(SystemExit, match="--budget"):
        ab_extensions.main(["--builds", builds, "--budget", "0", "--out", str(out), "--", "python3", "{out}"])


def test_env_applies_to_one_build_only(tmp_path):
    """One file under two names, told apart by an environment variable set for one of them."""
    ext = tmp_path / "_kernels.so"
    ext.write_text("original")
    (tmp_path / "base.so").write_text("base")
    bench = tmp_path / "bench.py"
    bench.write_text(
        "import json, os, sys\n"
        "ms = 1.5 if os.environ.get('AB_FAST') == '1' else 2.0\n"
        "json.dump({'schema': 1, 'device': 'Fake GPU', 'results': {'p': {'by_alpha': {'uniform': ms}}}},"
        " open(sys.argv[1], 'w'))\n"
    )
    out = tmp_path / "ab.json"
    base = tmp_path / "base.so"
    rc = ab_extensions.main([
        "--builds", f"plain={base},switched={base}", "--env", "switched:AB_FAST=1", "--rounds", "2",
        "--extension", str(ext), "--out", str(out), "--", sys.executable, str(bench), "{out}",
    ])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["results"]["env"] == {"switched": {"AB_FAST": "1"}}
    row = data["results"]["mean"]["p"]["uniform"]
    assert row["plain"] == 2.0 and row["switched"] == 1.5


@pytest.mark.parametrize("item, message", [
    ("nobuild:K=V", "no build named"),
    ("plain-K=V", "NAME:KEY=VALUE"),
    ("plain:K", "NAME:KEY=VALUE"),
])
def test_bad_env_is_named(tmp_path, item, message):
    base = tmp_path / "base.so"
    base.write_text("base")
    with pytest.raises(SystemExit, match=message):
        ab_extensions.main([
            "--builds", f"plain={base},other={base}", "--env", item, "--extension", str(tmp_path / "x.so"),
            "--out", str(tmp_path / "x.json"), "--", sys.executable, "-c", "pass", "{out}",
        ])
