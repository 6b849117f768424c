"""Runs the expert-parallel MoE tests (``moe_sharded_cases.py``) on 4 simulated CPU devices.

``--xla_force_host_platform_device_count`` only acts before jax starts its CPU backend,
and setting it here would change the device count of every test sharing this process
(pytest-xdist workers run many files). So the cases run in a fresh interpreter; its
pytest output is shown on failure. Set ``JGM_SEED`` to vary their inputs.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
CASES = HERE / "moe_sharded_cases.py"


def test_expert_parallel_cases_on_four_cpu_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(CASES)]
    try:
        proc = subprocess.run(cmd, cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"sharded MoE cases timed out after {err.timeout}s:\n{err.stdout or ''}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"sharded MoE cases failed (rc={proc.returncode}):\n{out[-20000:]}"
    assert "skipped" not in out.splitlines()[-1], f"sharded MoE cases were skipped:\n{out[-5000:]}"
