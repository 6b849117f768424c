"""Runs the user-``shard_map`` cases (``shard_map_cases.py``) on 4 simulated CPU devices,
in a fresh interpreter (see ``test_moe_sharded.py`` for why), in ``SHARDS`` parts that
pytest-xdist can run side by side. Set ``JGM_SEED`` to vary their inputs."""

from __future__ import annotations

import pathlib

import pytest

from gpu_helpers import run_cases_on_cpu_devices

CASES = pathlib.Path(__file__).resolve().parent / "shard_map_cases.py"
SHARDS = 3


@pytest.mark.parametrize("shard", range(SHARDS))
def test_user_shard_map_cases_on_four_cpu_devices(shard):
    run_cases_on_cpu_devices(CASES, f"user shard_map cases, part {shard + 1} of {SHARDS}", shard=(shard, SHARDS))


def test_outside_shard_map_the_op_casts_nothing():
    """The casts to common varying axes (``_src/varying.py``) are no-ops outside
    ``shard_map``: the traced forward and gradient hold no ``pcast``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_grouped_mlp as jgm

    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((2, 32, 32)) * 0.1, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((2, 32, 32)) * 0.1, jnp.bfloat16)
    gs = jnp.asarray([40, 24], jnp.int32)

    def loss(x, w1, w2):
        return jnp.sum(jgm.grouped_mlp(x, w1, w2, gs).astype(jnp.float32))

    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, w1, w2))
    assert "pcast" not in text and "pvary" not in text
