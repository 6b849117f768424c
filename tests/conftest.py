"""Shared fixtures: fresh random inputs every run (the seed is printed on failure)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from gpu_helpers import has_gpu


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def gpu():
    """The first CUDA device; skips without one or without the built extension."""
    import jax

    from jax_grouped_mlp._src.cuda import ffi

    devs = [d for d in jax.devices() if d.platform == "gpu"]
    if not devs or not ffi.available():
        pytest.skip("needs a GPU and the built extension")
    return devs[0]


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator with a fresh seed (set JGM_SEED to reproduce a failure)."""
    seed = int(os.environ.get("JGM_SEED", np.random.SeedSequence().entropy % (2**32)))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)
