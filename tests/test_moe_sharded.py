"""Runs the expert-parallel MoE tests (``moe_sharded_cases.py``) on 4 simulated CPU devices.

``--xla_force_host_platform_device_count`` only acts before jax starts its CPU backend,
and setting it here would change the device count of every test sharing this process
(pytest-xdist workers run many files). So the cases run in a fresh interpreter; its
pytest output is shown on failure. The cases run in ``SHARDS`` parts, so that pytest-xdist
can run them side by side. Set ``JGM_SEED`` to vary their inputs.
"""

from __future__ import annotations

import pathlib

import pytest

from gpu_helpers import run_cases_on_cpu_devices

HERE = pathlib.Path(__file__).resolve().parent
CASES = HERE / "moe_sharded_cases.py"
SHARDS = 3


@pytest.mark.parametrize("shard", range(SHARDS))
def test_expert_parallel_cases_on_four_cpu_devices(shard):
    run_cases_on_cpu_devices(CASES, f"sharded MoE cases, part {shard + 1} of {SHARDS}", shard=(shard, SHARDS))
