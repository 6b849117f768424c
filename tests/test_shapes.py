"""The router-like group sizes shared by tests and benchmarks (benchmarks/shapes.py),
and the MLP benchmark reporting skewed cases next to uniform ones (a CPU smoke run)."""

from __future__ import annotations

import json
import math
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import shapes  # noqa: E402

import jax_grouped_mlp as jgm  # noqa: E402


@pytest.mark.parametrize("alpha", shapes.ALPHAS)
def test_router_group_sizes_sum_and_reproduce(alpha):
    for m, g in ((49152, 128), (1000, 7), (5, 8), (0, 3)):
        s = shapes.router_group_sizes(m, g, alpha, seed=3)
        assert s.dtype == np.int32 and s.shape == (g,) and s.min() >= 0 and int(s.sum()) == m
        np.testing.assert_array_equal(s, shapes.router_group_sizes(m, g, alpha, seed=3))
    if math.isinf(alpha):
        assert np.ptp(shapes.router_group_sizes(1000, 7, alpha)) <= 1


def test_smaller_alpha_is_more_skewed():
    def spread(alpha):  # mean max/mean load over seeds
        return np.mean([shapes.router_group_sizes(49152, 128, alpha, seed=s).max() / 384 for s in range(20)])

    uniform, router, heavy = (spread(a) for a in shapes.ALPHAS)
    assert uniform == 1.0 < router < heavy
    assert 3 < router < 8 and heavy > 8  # Dirichlet(1) over 128 experts: the busiest ~5x the mean
    assert (shapes.router_group_sizes(49152, 128, 0.3) == 0).any()  # heavy skew leaves experts idle


def test_bad_arguments():
    with pytest.raises(ValueError, match="alpha"):
        shapes.router_group_sizes(10, 2, 0.0)
    with pytest.raises(ValueError, match="m >= 0"):
        shapes.router_group_sizes(10, 0, 1.0)


@pytest.mark.parametrize("multiple", [64, 128, 384])
def test_rounded_group_sizes_keep_sum_and_move_less_than_a_multiple(rng, multiple):
    for alpha in (1.0, 0.3):
        sizes = shapes.router_group_sizes(49152, 128, alpha, seed=int(rng.integers(1 << 30)))
        r = shapes.rounded_group_sizes(sizes, multiple)
        assert r.dtype == np.int32 and r.shape == sizes.shape and r.min() >= 0
        assert int(r.sum()) == 49152 and not (r % multiple).any()
        assert np.abs(r.astype(np.int64) - sizes).max() < multiple


def test_rounded_group_sizes_bad_multiple():
    with pytest.raises(ValueError, match="multiple"):
        shapes.rounded_group_sizes(np.array([3, 4]), 2)  # sum 7 is no multiple of 2
    with pytest.raises(ValueError, match="multiple"):
        shapes.rounded_group_sizes(np.array([4, 4]), 0)


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_grouped_mlp_on_router_skewed_sizes(rng, recipe):
    """The op on heavily skewed sizes (empty experts, one expert with most rows) against
    the float64 reference of the unquantized MLP."""
    m, g, h, f = 256, 8, 64, 96
    sizes = shapes.router_group_sizes(m, g, 0.3, seed=int(rng.integers(1 << 30)))
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((g, h, f)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((g, f, h)) / np.sqrt(f), jnp.bfloat16)
    p = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
    y = np.asarray(jgm.grouped_mlp(x, w1, w2, jnp.asarray(sizes), p, recipe=recipe), np.float64)
    x64, w164, w264 = (np.asarray(a, np.float64) for a in (x, w1, w2))
    want = np.zeros((m, h))
    start = 0
    for e, n in enumerate(sizes):
        hh = x64[start:start + n] @ w164[e]
        want[start:start + n] = (np.asarray(p, np.float64)[start:start + n, None] * np.maximum(hh, 0) ** 2) @ w264[e]
        start += n
    err = np.linalg.norm(y - want) / np.linalg.norm(want)
    assert err < (1e-2 if recipe == "bf16" else 8e-2), err  # docs/design.md, "Error bands"


def test_bench_mlp_reports_skew_next_to_uniform(tmp_path):
    import bench_mlp

    out = tmp_path / "mlp.json"
    bench_mlp.main(["--shapes", "tiny", "--alphas", "inf,1", "--only", "grouped_mlp_bf16,ragged_dot_bf16",
                    "--iters", "1", "--out", str(out)])
    data = json.loads(out.read_text())["results"]
    assert set(data) == {"tiny", "tiny@alpha=1"}
    assert data["tiny"]["skew"] == "uniform" and data["tiny@alpha=1"]["skew"] == "alpha=1"
    for c in ("grouped_mlp_bf16", "ragged_dot_bf16"):
        assert data["tiny@alpha=1"][c]["vs_uniform"] > 0


def test_bench_mlp_interleaved_rounds_give_per_round_ratios(tmp_path):
    """``--rounds``: every skew timed once per round; the ratio is the median of the
    per-round ratios, each a skewed round's time over the same round's equal-sizes time."""
    import bench_mlp

    out = tmp_path / "mlp.json"
    bench_mlp.main(["--shapes", "tiny", "--alphas", "inf,1", "--only", "grouped_mlp_bf16", "--iters", "1",
                    "--rounds", "3", "--out", str(out)])
    data = json.loads(out.read_text())["results"]
    equal, skew = data["tiny"]["grouped_mlp_bf16"], data["tiny@alpha=1"]["grouped_mlp_bf16"]
    assert len(equal["rounds_ms"]) == len(skew["rounds_ms"]) == 3 and "vs_uniform" not in equal
    ratios = [s / e for s, e in zip(skew["rounds_ms"], equal["rounds_ms"])]
    np.testing.assert_allclose(skew["vs_uniform_rounds"], ratios, rtol=1e-9)
    assert skew["vs_uniform"] == pytest.approx(float(np.median(ratios)))
    assert equal["ms"] == pytest.approx(float(np.median(equal["rounds_ms"])))


def test_interleaved_rounds_alternate_their_order(tmp_path, monkeypatch):
    """``--rounds``: odd rounds time the jobs in reverse (``common.round_order``), so no
    candidate or skew always runs right after the same other program (on the H200 that
    place moved a step by ~0.3 ms)."""
    import bench_mlp
    import common

    assert common.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert common.round_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    calls = []
    real = bench_mlp.time_call

    def recording(fn, *args, **kw):
        calls.append(fn)
        return real(fn, *args, **kw)

    monkeypatch.setattr(bench_mlp, "time_call", recording)
    bench_mlp.main(["--shapes", "tiny", "--alphas", "inf,1", "--only", "grouped_mlp_bf16,ragged_dot_bf16", "--iters", "1",
                    "--rounds", "2", "--out", str(tmp_path / "mlp.json")])
    # the warm-up round (not kept) in round 0's order, then rounds 0 and 1
    assert len(calls) == 12 and calls[:4] == calls[4:8] and calls[8:] == calls[4:8][::-1], calls


def test_bench_mlp_times_more_draws_of_the_sizes(tmp_path, monkeypatch):
    """``--size-seeds``: each skewed alpha also runs other router draws of its sizes (the
    data unchanged), keyed ``...,sizes=K``, in the same rounds and with one compilation
    per candidate; the first draw's entry summarizes every draw's ``vs_uniform``."""
    import bench_mlp

    compiles = []
    real = bench_mlp.compile_shape
    monkeypatch.setattr(bench_mlp, "compile_shape", lambda *a, **k: compiles.append(a) or real(*a, **k))
    clock = iter(range(1, 100))  # every timing a distinct number: the warm-up round's are 1..4
    monkeypatch.setattr(bench_mlp, "time_call", lambda *a, **k: next(clock) * 1e-3)
    out = tmp_path / "mlp.json"
    bench_mlp.main(["--shapes", "tiny", "--alphas", "inf,1", "--only", "grouped_mlp_bf16", "--iters", "1",
                    "--rounds", "2", "--size-seeds", "0,3,5", "--out", str(out)])
    assert len(compiles) == 1
    assert next(clock) == 13  # 4 cases x (1 warm-up round + 2 kept rounds)
    data = json.loads(out.read_text())["results"]
    assert set(data) == {"tiny", "tiny@alpha=1", "tiny@alpha=1,sizes=3", "tiny@alpha=1,sizes=5"}
    g, rows, _, _ = bench_mlp.MLP_SHAPES["tiny"]
    for draw, key in ((3, "tiny@alpha=1,sizes=3"), (5, "tiny@alpha=1,sizes=5")):
        sizes = shapes.router_group_sizes(g * rows, g, 1.0, draw)
        assert data[key]["sizes_seed"] == draw
        assert data[key]["group_sizes"] == {"min": int(sizes.min()), "max": int(sizes.max())}
        assert len(data[key]["grouped_mlp_bf16"]["rounds_ms"]) == 2
    kept = sorted(t for v in data.values() for t in v["grouped_mlp_bf16"]["rounds_ms"])
    assert kept == pytest.approx(list(range(5, 13)))  # the warm-up round's timings are not kept
    ratios = [data[k]["grouped_mlp_bf16"]["vs_uniform"] for k in sorted(data) if k != "tiny"]
    summary = data["tiny@alpha=1"]["grouped_mlp_bf16"]["vs_uniform_draws"]
    assert summary["draws"] == 3 and summary["mean"] == pytest.approx(float(np.mean(ratios)))
    assert summary["min"] == min(ratios) and summary["max"] == max(ratios)
    assert "sizes_seed" not in data["tiny@alpha=1"]


@pytest.mark.parametrize("argv, message", [
    (["--size-seeds", "1,x", "--rounds", "2"], "comma-separated integers"),
    (["--size-seeds", "1,2"], "needs --rounds 2 or more"),
])
def test_bench_mlp_size_seeds_errors(capsys, argv, message):
    import bench_mlp

    with pytest.raises(SystemExit):
        bench_mlp.main(["--shapes", "tiny", "--only", "grouped_mlp_bf16", *argv])
    assert message in capsys.readouterr().err


def test_bench_mlp_rejects_unknown_candidates(capsys):
    """A misspelt or renamed ``--only`` name is an error naming it, not a silently
    skipped column."""
    import bench_mlp

    with pytest.raises(SystemExit):
        bench_mlp.main(["--shapes", "tiny", "--only", "grouped_mlp_bf16,grouped_mlp_fp8_block_fp8_wgrad"])
    assert "grouped_mlp_fp8_block_fp8_wgrad" in capsys.readouterr().err
