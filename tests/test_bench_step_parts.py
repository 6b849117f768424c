"""benchmarks/bench_step_parts.py: alternating group sizes (``--alternating``) and the forced weight-gradient orders."""

from __future__ import annotations

import os
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_step_parts  # noqa: E402


def test_alternating_sizes_keep_m_and_end_every_group_in_the_chosen_partial_tile():
    sizes = bench_step_parts.alternating_sizes("320/448", 128, 384)
    assert sizes.dtype == np.int32 and sizes.shape == (128,) and int(sizes.sum()) == 128 * 384
    assert set((sizes % 128).tolist()) == {64}  # every last 128-row tile holds 64 rows
    assert (sizes[::2] == 320).all() and (sizes[1::2] == 448).all()


@pytest.mark.parametrize("pair,g", [("320/447", 128), ("320/448", 127), ("-1/769", 128), ("320", 128), ("a/b", 128)])
def test_alternating_sizes_refuse_what_changes_m(pair, g):
    with pytest.raises(SystemExit, match="--alternating"):
        bench_step_parts.alternating_sizes(pair, g, 384)


def test_forced_wgrad_order_is_set_while_tracing_and_restored(monkeypatch):
    """``_wgrad_forced``: the weight gradient sees ``JGM_WGRAD_TILE_ORDER`` when it is
    traced, and the caller's value (or its absence) is put back after every call."""
    import jax.numpy as jnp

    seen = []

    def fake_wgrad(lhs, rhs, sizes, dtype):
        seen.append(os.environ.get("JGM_WGRAD_TILE_ORDER"))
        return lhs.T @ rhs

    monkeypatch.setattr(bench_step_parts.primitives, "grouped_wgrad", fake_wgrad)
    monkeypatch.delenv("JGM_WGRAD_TILE_ORDER", raising=False)
    call = bench_step_parts._wgrad_forced("dynamic")
    x = jnp.ones((4, 2), jnp.bfloat16)
    call(x, x, jnp.array([4], jnp.int32))
    assert seen == ["dynamic"] and "JGM_WGRAD_TILE_ORDER" not in os.environ
    monkeypatch.setenv("JGM_WGRAD_TILE_ORDER", "auto")
    call(x, x, jnp.array([4], jnp.int32))  # cached: not traced again
    assert seen == ["dynamic"] and os.environ["JGM_WGRAD_TILE_ORDER"] == "auto"
