"""The kernels' experimental build switches are off unless the build's environment
turns them on (a switch left on would change every shipped kernel)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("cutlass")

_READ = "from jax_grouped_mlp.kernels import grouped_gemm_sm90 as m; print(m.SKIP_EMPTY_WARP_GROUP)"


def _flag(value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "JGM_SKIP_EMPTY_WARP_GROUP"}
    if value is not None:
        env["JGM_SKIP_EMPTY_WARP_GROUP"] = value
    out = subprocess.run([sys.executable, "-c", _READ], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_skip_empty_warp_group_is_off_by_default():
    assert _flag(None) == "False"
    assert _flag("0") == "False"


def test_skip_empty_warp_group_is_on_only_with_1():
    assert _flag("1") == "True"
