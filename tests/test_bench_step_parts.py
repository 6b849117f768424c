"""benchmarks/bench_step_parts.py's alternating group sizes (``--alternating``)."""

from __future__ import annotations

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
