"""benchmarks/bench_mlp.py: the `_qw` choice's in-process A/B candidates (one tile; --qw-table)."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_mlp  # noqa: E402

from jax_grouped_mlp._src.cuda import gemm_ffi  # noqa: E402
from jax_grouped_mlp._src.op import heuristics  # noqa: E402

NAMES = ("grouped_gemm_sm90_qw_w128t192k64_s5", "grouped_gemm_sm90_qw_w128t256k64_s4",
         "grouped_gemm_sm90_qw_w128t384k64_s3_ss")
TABLE = "192:0.1/0.1,256:0.5/0.44,384:0.77/0.55,launch:3.8"  # t192 far cheapest: always chosen


def test_parse_qw_table():
    table, launch = bench_mlp.parse_qw_table("192:0.44/0.41,256:0.5/0.44,384:0.77/0.55,launch:3.8")
    assert table == {192: (0.44, 0.41), 256: (0.5, 0.44), 384: (0.77, 0.55)} and launch == 3.8
    for bad in ("192:0.4,256:0.5/0.4,384:0.7/0.5,launch:1", "256:0.5/0.4,384:0.7/0.5,launch:1",
                "192:0.4/0.4,256:0.5/0.4,384:0.7/0.5", "x"):
        with pytest.raises(SystemExit, match="--qw-table"):
            bench_mlp.parse_qw_table(bad)


def test_tracing_changes_the_choice_and_restores(monkeypatch):
    """Inside ``tracing`` the traced choice is another one (so the candidates do differ);
    after it, the environment and the table are as before."""
    monkeypatch.delenv("JGM_QW_MIXED_TILES", raising=False)
    long_groups = jnp.asarray(1152 + np.random.default_rng(0).integers(150, 250, 128), jnp.int32)
    choose = lambda: gemm_ffi.qw_choice(long_groups, NAMES).tolist()  # noqa: E731
    with jax.default_device(jax.devices("cpu")[0]):
        default = choose()
        assert default == [2, 1]  # the mixed tiles
        with bench_mlp.tracing("grouped_mlp_mxfp8_qw_one_tile"):
            assert os.environ["JGM_QW_MIXED_TILES"] == "0"
            assert choose()[1] == 0
        assert "JGM_QW_MIXED_TILES" not in os.environ
        table = dict(heuristics.QW_TILE_COSTS)
        monkeypatch.setattr(bench_mlp, "QW_TABLE", bench_mlp.parse_qw_table(TABLE))
        with bench_mlp.tracing("grouped_mlp_mxfp8_qw_table"):
            assert choose() == [0, 0]
        assert heuristics.QW_TILE_COSTS == table and choose() == default
        with pytest.raises(RuntimeError), bench_mlp.tracing("grouped_mlp_mxfp8_qw_table"):
            raise RuntimeError  # restored on the way out of an error too
        assert heuristics.QW_TILE_COSTS == table


def test_candidates_run_only_where_named(tmp_path):
    out = tmp_path / "r.json"
    bench_mlp.main(["--shapes", "tiny", "--alphas", "inf", "--iters", "1", "--out", str(out),
                    "--only", "grouped_mlp_mxfp8,grouped_mlp_mxfp8_qw_one_tile,grouped_mlp_mxfp8_qw_table",
                    "--qw-table", TABLE])
    got = json.loads(out.read_text())["results"]["tiny"]
    for c in ("grouped_mlp_mxfp8", "grouped_mlp_mxfp8_qw_one_tile", "grouped_mlp_mxfp8_qw_table"):
        assert "ms" in got[c], got[c]
    bench_mlp.main(["--shapes", "tiny", "--alphas", "inf", "--iters", "1", "--out", str(out)])
    got = json.loads(out.read_text())["results"]["tiny"]
    assert "grouped_mlp_mxfp8" in got and not set(bench_mlp.QW_VARIANTS) & set(got)
