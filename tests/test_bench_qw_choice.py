"""benchmarks/bench_qw_choice.py: the cost model's features, the fit, the regret, the CPU exits."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_qw_choice as bench  # noqa: E402
import shapes  # noqa: E402

from jax_grouped_mlp._src.op import heuristics  # noqa: E402

TILES = (192, 256, 384)
CURRENT = bench.table_params(heuristics.QW_TILE_COSTS, heuristics.QW_MIXED_LAUNCH_COST)


def _draws(n: int = 6) -> list[np.ndarray]:
    out = [shapes.router_group_sizes(128 * 384, 128, a, s) for a in (1.0, 0.3) for s in range(n // 2)]
    return out + [np.full(128, 384), np.full(16, 1000), np.array([0, 5, 191, 193, 383, 385, 1200, 7])]


def test_features_price_as_the_heuristics_do():
    """The features under the current table are the device-side choice's costs, for every
    option: a fit of them is a fit of that model."""
    for sizes in _draws():
        for t in TILES:
            got = bench.cost(bench.features(sizes, TILES, f"t{t}"), CURRENT)
            assert got == pytest.approx(float(heuristics.qw_tiles_cost(sizes, t)))
        got = bench.cost(bench.features(sizes, TILES, "mixed"), CURRENT)
        assert got == pytest.approx(float(heuristics.qw_mixed_cost(sizes, TILES, 384)))
    with pytest.raises(ValueError, match="t128"):
        bench.features(np.full(4, 10), TILES, "t128")


def _synthetic_cases(params: dict, noise: float, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    cases = []
    for layout in ("fprop", "dgrad"):
        for scale, const in ((40320, 0.02), (38976, 0.03)):
            for i, sizes in enumerate(_draws()):
                feats = {o: bench.features(sizes, TILES, o) for o in bench.option_names(TILES)}
                ms = {o: (scale * bench.cost(f, params) * 2e-5 + const) * (1 + noise * rng.standard_normal())
                      for o, f in feats.items()}
                cases.append({"layout": layout, "alpha": 1.0, "seed": i, "case": f"c{i}", "scale": scale,
                              "features": feats, "ms": ms | {"device": 1.0}})
    return cases


def test_the_fit_recovers_a_table_and_its_choices():
    """Times made by a known table (the 256 tile dearer than now, launches cheaper) fit
    back to it, and the fitted table's picks are the best measured (regret 1)."""
    truth = dict(CURRENT, full_256=0.6, half_256=0.55, launches=0.5)
    cases = _synthetic_cases(truth, 0.0)
    fit = bench.fit_costs([c for c in cases if c["layout"] == "dgrad"], TILES)
    got = bench.in_table_units(fit["params"], truth)
    for k in ("full_192", "full_256", "full_384", "half_384", "launches"):
        assert got[k] == pytest.approx(truth[k], rel=1e-6), k
    assert fit["rms_rel"] < 1e-9
    assert bench.regret(cases, fit["params"]) == pytest.approx([1.0] * len(cases))
    # The current table is not that table: somewhere it picks a slower option.
    assert max(bench.regret(cases, CURRENT)) > 1.0


def test_summary_holds_seeds_out_and_prints(capsys):
    truth = dict(CURRENT, launches=3.0)
    cases = _synthetic_cases(truth, 0.01)
    summary = bench.summarize(cases, TILES, holdout=[0, 1])
    assert set(summary) == {"fprop", "dgrad"}
    e = summary["dgrad"]
    assert len(e["holdout_fitted_regret"]) == 2 * 2  # two seeds held out, two shapes
    assert len(e["current_regret"]) == len([c for c in cases if c["layout"] == "dgrad"])
    bench.print_summary(summary, cases)
    out = capsys.readouterr().out
    assert "fitted cost table" in out and "held out" in out


def test_fit_needs_enough_timings():
    cases = _synthetic_cases(CURRENT, 0.0)[:1]
    cases[0]["ms"] = {"t192": 1.0}
    with pytest.raises(ValueError, match="cannot fit"):
        bench.fit_costs(cases, TILES)


def test_fit_a_result_file_without_a_gpu(tmp_path, capsys):
    cases = _synthetic_cases(dict(CURRENT, launches=2.0), 0.0)
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": cases, "tiles": list(TILES)}))
    assert bench.main(["--fit", str(path), "--holdout", "2"]) == 0
    assert "mean regret" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--alphas", "0"], ["--alphas", "x"], ["--size-seeds", "-1"],
                                  ["--rounds", "0"], ["--shapes", "nano"]])
def test_bad_flags_name_themselves(argv):
    with pytest.raises(SystemExit, match=argv[0]):
        bench.main(argv)


def test_without_a_gpu_it_says_so(capsys):
    assert bench.main([]) == 1
    assert "needs a GPU" in capsys.readouterr().out
