"""The device scripts (tools/gpu_*.sh) share one preamble, tools/gpu_common.sh: each
sources it, parses, and stops before any GPU work when the carried extension is stale."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

TOOLS = pathlib.Path(__file__).resolve().parent.parent / "tools"
SCRIPTS = sorted(p for p in TOOLS.glob("gpu_*.sh") if p.name != "gpu_common.sh")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_device_script_sources_the_common_preamble(script):
    text = script.read_text()
    assert 'source "$(dirname "$0")/gpu_common.sh" ' in text
    assert "stamp() {" not in text and "|| exit 3" not in text  # not a copy of it
    subprocess.run(["bash", "-n", str(script)], check=True)


def _preamble(tmp_path, python_rc: int, *args: str) -> subprocess.CompletedProcess:
    """Sources gpu_common.sh with a stub ``python3`` (the preflight) exiting ``python_rc``."""
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (stub / "python3").write_text(f"#!/bin/sh\nexit {python_rc}\n")
    (stub / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "XLA_PYTHON_CLIENT_PREALLOCATE")}
    env["PATH"] = f"{stub}:{env.get('PATH', '')}"
    body = (f'source "{TOOLS}/gpu_common.sh" {" ".join(args)}; stamp ready; '
            'echo "out=$OUT prealloc=${XLA_PYTHON_CLIENT_PREALLOCATE:-default} path=$PYTHONPATH"')
    return subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True)


def test_preamble_sets_up_and_stamps(tmp_path):
    out = tmp_path / "out"
    r = _preamble(tmp_path, 0, "my_check", str(out))
    assert r.returncode == 0, r.stderr
    assert out.is_dir()
    assert "[my_check] ready at +" in r.stdout
    assert f"out={out} prealloc=false path=." in r.stdout
    r = _preamble(tmp_path, 0, "mem_check", str(out), "keep-prealloc")
    assert "prealloc=default" in r.stdout


def test_preamble_stops_on_a_stale_extension(tmp_path):
    r = _preamble(tmp_path, 1, "my_check", str(tmp_path / "out"))
    assert r.returncode == 3
    assert "ready" not in r.stdout
