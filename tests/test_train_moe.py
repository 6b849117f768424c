"""The training demo (examples/train_moe.py) runs a few steps and its loss falls."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "train_moe.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("train_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_trains_under_the_planned_policy(capsys):
    demo = _load_example()
    # A tight budget (one layer's worth for two layers) so the plan moves residuals
    # off the device; the layer time is given so the test skips measuring it.
    report = demo.main(
        ["--steps", "8", "--tokens", "64", "--hidden", "64", "--ffn", "64", "--experts", "4",
         "--vocab", "64", "--lr", "1e-2", "--layer-time", "0.01", "--budget-mb", "0.05"]
    )  # fmt: skip
    assert set(report["placement"].values()) != {"device"}
    losses = report["losses"]
    assert len(losses) == 8 and np.all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < losses[0] - 0.5
    out = capsys.readouterr()
    assert "residuals in the traced step" in out.out and "step time" in out.out
    assert "8/8" in out.err  # the progress bar
