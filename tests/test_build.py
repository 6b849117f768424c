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


def test_an_extension_built_for_another_jaxlib_is_stale(tmp_path, monkeypatch):
    """Both venvs of one Python version write the same file name: the jaxlib the file was
    compiled against (a marker in its bytes) decides, not only the modification times."""
    monkeypatch.setattr(build_kernels, "_running_jaxlib", lambda: "0.11.2")
    monkeypatch.setattr(build_kernels, "SWITCH_STAMP", tmp_path / "no_stamp.json")
    for name in build_kernels.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    fake = tmp_path / "_kernels.so"
    fake.write_bytes(b"\x7fELF..." + build_kernels.BUILT_AGAINST_MARKER + b"0.12.0\0rest")
    assert build_kernels.built_against(fake) == "0.12.0"
    assert not build_kernels._up_to_date(fake)
    fake.write_bytes(b"\x7fELF..." + build_kernels.BUILT_AGAINST_MARKER + b"0.11.2\0rest")
    fake.touch()
    assert build_kernels._up_to_date(fake)
    fake.write_bytes(b"an extension from before the marker")
    assert build_kernels.built_against(fake) is None and not build_kernels._up_to_date(fake)


def test_an_extension_built_with_other_switches_is_stale(tmp_path, monkeypatch):
    """Turning an experimental kernel switch on or off (docs/gpu.md) rebuilds."""
    monkeypatch.setattr(build_kernels, "_running_jaxlib", lambda: "0.11.2")
    stamp = tmp_path / "kernel_switches.json"
    monkeypatch.setattr(build_kernels, "SWITCH_STAMP", stamp)
    fake = tmp_path / "_kernels.so"
    fake.write_bytes(b"\x7fELF..." + build_kernels.BUILT_AGAINST_MARKER + b"0.11.2\0rest")
    for name in build_kernels.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert build_kernels._up_to_date(fake)  # no stamp: built with every switch off
    monkeypatch.setenv("JGM_SKIP_EMPTY_WARP_GROUP", "1")
    assert build_kernels.switches() == {"JGM_SKIP_EMPTY_WARP_GROUP": "1"}
    assert not build_kernels._up_to_date(fake)
    stamp.write_text('{"JGM_SKIP_EMPTY_WARP_GROUP": "1"}')
    assert build_kernels._up_to_date(fake)
    monkeypatch.setenv("JGM_SKIP_EMPTY_WARP_GROUP", "0")
    assert not build_kernels._up_to_date(fake)
    stamp.write_text("not json")
    monkeypatch.delenv("JGM_SKIP_EMPTY_WARP_GROUP")
    assert not build_kernels._up_to_date(fake)  # an unreadable record rebuilds
    stamp.write_text("{}")
    monkeypatch.setenv("JGM_DYNAMIC_TILES", "1")  # the GEMM's dynamic tile order is a switch too
    assert not build_kernels._up_to_date(fake)


def test_loading_an_extension_built_for_a_newer_jaxlib_warns():
    import warnings

    import jaxlib.version
    import pytest

    from jax_grouped_mlp._src.cuda import ffi

    running = jaxlib.version.__version__
    with pytest.warns(RuntimeWarning, match=r"built against jaxlib 99\.0\.0, newer than the running jaxlib"):
        ffi._warn_if_built_for_another_jaxlib("99.0.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for built in (running, "0.0.1", None, ""):  # the same, older (the wheel's case), unrecorded
            ffi._warn_if_built_for_another_jaxlib(built)
    assert ffi.version_tuple("0.12.0.1") == (0, 12, 0, 1) and ffi.version_tuple("0.11.2rc1") == (0, 11, 2)
    assert ffi.version_tuple("0.12.0.dev20261201") == (0, 12, 0)


def test_marker_without_terminator_is_no_record(tmp_path):
    fake = tmp_path / "_kernels.so"
    fake.write_bytes(b"..." + build_kernels.BUILT_AGAINST_MARKER + b"0.1\xff")
    assert build_kernels.built_against(fake) is None


def test_the_built_extension_is_not_newer_than_the_running_jaxlib():
    """What the loader requires (an older build loads; `make test` rebuilds for this jaxlib)."""
    import pytest

    from jax_grouped_mlp._src.cuda import ffi

    ext = build_kernels._existing_extension()
    built = build_kernels.built_against(ext) if ext is not None else None
    if built is None:
        pytest.skip("no extension with a jaxlib record is built here")
    assert ffi.version_tuple(built) <= ffi.version_tuple(build_kernels._running_jaxlib())
