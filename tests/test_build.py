"""The kernel build degrades to the CPU path, loudly, when its toolchain is missing."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import build_kernels  # noqa: E402


def test_missing_toolchain_is_reported_and_skipped(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cutlass" else real(name, *a))
    monkeypatch.setattr(build_kernels, "_existing_extension", lambda: None)
    assert build_kernels.main([]) == 0
    out = capsys.readouterr().out
    assert "NOT building the CUDA kernels" in out and "nvidia-cutlass-dsl" in out
    assert build_kernels.main(["--strict"]) == 1


def test_up_to_date_check_sees_every_input(tmp_path):
    inputs = build_kernels._inputs()
    names = {p.name for p in inputs}
    assert {"build_kernels.py", "module.cc", "kernels.h", "aot.py"} <= names
