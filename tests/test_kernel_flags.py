"""The kernels' experimental build switches are off unless the build's environment
turns them on (a switch left on would change every shipped kernel)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("cutlass")

# (environment variable, module constant of grouped_gemm_sm90)
SWITCHES = [
    ("JGM_SKIP_EMPTY_WARP_GROUP", "SKIP_EMPTY_WARP_GROUP"),
    ("JGM_DYNAMIC_TILES", "DYNAMIC_TILES"),
]


def _flag(env_name: str, constant: str, value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != env_name}
    if value is not None:
        env[env_name] = value
    read = f"from jax_grouped_mlp.kernels import grouped_gemm_sm90 as m; print(m.{constant})"
    out = subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("env_name,constant", SWITCHES)
def test_switch_is_off_by_default(env_name, constant):
    assert _flag(env_name, constant, None) == "False"
    assert _flag(env_name, constant, "0") == "False"


@pytest.mark.parametrize("env_name,constant", SWITCHES)
def test_switch_is_on_only_with_1(env_name, constant):
    assert _flag(env_name, constant, "1") == "True"


def test_build_tool_records_every_switch():
    """tools/build_kernels.py rebuilds on (and passes to the handlers) exactly these switches."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
    import build_kernels

    assert set(build_kernels.SWITCHES) == {env_name for env_name, _ in SWITCHES}
