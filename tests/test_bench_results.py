"""benchmarks/results: one schema for every result file (benchmarks/common.py's
``write_result``), and every file cited from the docs."""

from __future__ import annotations

import json
import pathlib
import re
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
# What a user or maintainer reads: README.md and docs/ (decision records in docs/notes included).
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# A citation of a results file; one after "<commit>:" is a `git show` of a removed file.
CITATION = re.compile(r"(?<![:\w/])(?:benchmarks/)?results/([\w.-]+\.\w+)")


def _docs_text() -> str:
    return "\n".join(p.read_text() for p in DOC_FILES)


def test_every_result_json_follows_the_schema():
    files = sorted(RESULTS.glob("*.json"))
    assert files
    bad = {}
    for path in files:
        errors = common.check_result(json.loads(path.read_text()))
        if errors:
            bad[path.name] = errors
    assert not bad


def test_every_results_file_is_cited_from_the_docs():
    text = _docs_text()
    orphans = [p.name for p in sorted(RESULTS.iterdir()) if p.is_file() and p.name not in text]
    assert not orphans, f"cite these from docs/ or README.md, or delete them: {orphans}"


def test_every_cited_results_file_exists():
    cited = {m.group(1) for p in DOC_FILES for m in CITATION.finditer(p.read_text())}
    assert cited
    missing = sorted(name for name in cited if not (RESULTS / name).is_file())
    assert not missing, f"docs cite results files that are not there: {missing}"


def test_write_result_writes_the_schema(tmp_path, monkeypatch):
    monkeypatch.setenv("JGM_COMMIT", "abc1234")
    rows = [{"policy": "all_device", "ms": 1.5}, {"policy": "all_offload", "ms": 2.25}]
    path = tmp_path / "sub" / "r.json"
    returned = common.write_result(path, command="PYTHONPATH=. python3 benchmarks/x.py --n 3", rows=rows,
                                   extra={"shape": {"M": 64}})
    saved = json.loads(path.read_text())
    assert saved == returned
    assert common.check_result(saved) == []
    assert list(saved)[:7] == [*common.RESULT_KEYS, "rows"]
    assert saved["schema"] == common.RESULT_SCHEMA == 1
    assert saved["command"] == "PYTHONPATH=. python3 benchmarks/x.py --n 3"
    assert saved["library_commit"] == "abc1234"
    assert saved["device"] == jax.devices()[0].device_kind
    assert saved["jax_version"] == jax.__version__
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", saved["date"])
    assert saved["rows"] == rows and saved["shape"] == {"M": 64}

    results = {"nano": {"ms": 6.7}}
    saved = common.write_result(tmp_path / "d.json", command="c", results=results, device="NVIDIA H200")
    assert saved["device"] == "NVIDIA H200" and saved["results"] == results and "rows" not in saved


def test_write_report_moves_shapes_to_results(tmp_path):
    report = common.gemm_report("what it measures", "benchmarks/bench_x.py", ["--shapes", "a b"])
    report["shapes"]["nano"] = {"ms": 1.0}
    common.write_report(report, tmp_path / "g.json")
    saved = json.loads((tmp_path / "g.json").read_text())
    assert common.check_result(saved) == []
    assert saved["command"] == "PYTHONPATH=. python3 benchmarks/bench_x.py --shapes 'a b'"
    assert saved["results"] == {"nano": {"ms": 1.0}} and saved["what"] == "what it measures"
    assert "shapes" not in saved


def test_write_result_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="exactly one of rows and results"):
        common.write_result(tmp_path / "x.json", command="c", rows=[], results={})
    with pytest.raises(ValueError, match="exactly one of rows and results"):
        common.write_result(tmp_path / "x.json", command="c")
    with pytest.raises(ValueError, match="extra must not set the schema's keys"):
        common.write_result(tmp_path / "x.json", command="c", rows=[], extra={"device": "mine"})
    with pytest.raises(ValueError, match="command must be a non-empty string"):
        common.write_result(tmp_path / "x.json", command="", rows=[])
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("library_commit"), "missing key 'library_commit'"),
        (lambda d: d.update(schema=2), "schema must be 1"),
        (lambda d: d.update(date="30.11.2026"), "date must be YYYY-MM-DD"),
        (lambda d: d.update(device=""), "device must be a non-empty string or null"),
        (lambda d: d.update(results={}), "exactly one of"),
        (lambda d: (d.pop("rows"), d.update(results=[])), "results must be a dict"),
    ],
)
def test_check_result_finds_what_is_wrong(change, message):
    data = {"schema": 1, "command": "c", "library_commit": None, "device": "cpu", "date": "2026-12-01",
            "jax_version": "0.11.2", "rows": []}
    assert common.check_result(data) == []
    change(data)
    assert any(message in e for e in common.check_result(data))


@pytest.mark.parametrize("script, plot, result", [
    ("bench_wgrad", "plot_fp8", "wgrad_fp8_block_h200.json"),  # bench_wgrad.py --fp8-block --plot
    ("bench_quantize", "plot", "quantize_byte_tile_h200.json"),  # bench_quantize.py --plot
])
def test_plot_draws_the_committed_run(tmp_path, script, plot, result):
    """A benchmark's ``--plot`` draws the report it writes: here a committed H200 run (the
    PNG beside it was drawn this way)."""
    import importlib

    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    results = json.loads((RESULTS / result).read_text())["results"]
    out = tmp_path / "plot.png"
    getattr(importlib.import_module(script), plot)(results, out)
    assert out.stat().st_size > 10_000


def test_library_commit_names_the_tree_that_ran(tmp_path, monkeypatch):
    """Where .git lags the files (the device machine's copy), the tree id still names the
    code: it is the tree of the commit whose files ran."""
    import subprocess

    monkeypatch.delenv("JGM_COMMIT", raising=False)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "one")
    first = git("rev-parse", "HEAD")
    assert common.library_commit(tmp_path) == first
    (tmp_path / "untracked.txt").write_text("not code")  # untracked files do not count
    assert common.library_commit(tmp_path) == first
    (tmp_path / "a.py").write_text("x = 2\n")
    git("commit", "-q", "-am", "two")
    second_tree = git("rev-parse", "HEAD^{tree}")
    git("update-ref", "HEAD", first)  # HEAD now lags the files, as on the device
    assert common.library_commit(tmp_path) == f"{first}-dirty tree {second_tree}"
    assert git("rev-parse", "HEAD") == first  # nothing moved
    assert common.library_commit(tmp_path / "nowhere") is None  # no such folder: no commit
