"""benchmarks/bench_qw_tile_cost.py: the per-tile cost arithmetic and the CPU exit."""

from __future__ import annotations

import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_qw_tile_cost as bench  # noqa: E402


def test_tile_cost_counts_token_and_weight_tiles():
    # 128 groups of 300 tokens with 256-token tiles: 2 token tiles per group; N = 1856: 15 weight tiles.
    got = bench.tile_cost_us(1.0, 132, 128, 300, 256, 1856, 128)
    assert got == pytest.approx(1e3 * 132 / (128 * 2 * 15))
    assert math.isnan(bench.tile_cost_us(1.0, 132, 128, 0, 256, 1856, 128))


@pytest.mark.parametrize("argv", [["--tokens", "0,64"], ["--tokens", "a"], ["--dims", "2688"], ["--layouts", "fwd"]])
def test_bad_flags_name_themselves(argv):
    with pytest.raises(SystemExit, match=argv[0]):
        bench.main(argv)


def test_without_a_gpu_it_says_so(capsys):
    assert bench.main(["--tokens", "64"]) == 1
    assert "needs a GPU" in capsys.readouterr().out
