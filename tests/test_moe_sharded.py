"""Runs the expert-parallel MoE tests (``moe_sharded_cases.py``) on 4 simulated CPU devices.

``--xla_force_host_platform_device_count`` only acts before jax starts its CPU backend,
and setting it here would change the device count of every test sharing this process
(pytest-xdist workers run many files). So the cases run in a fresh interpreter; its
pytest output is shown on failure. Set ``JGM_SEED`` to vary their inputs.
"""

from __future__ import annotations

import pathlib

from gpu_helpers import run_cases_on_cpu_devices

HERE = pathlib.Path(__file__).resolve().parent
CASES = HERE / "moe_sharded_cases.py"


def test_expert_parallel_cases_on_four_cpu_devices():
    run_cases_on_cpu_devices(CASES, "sharded MoE cases")
