"""The training demo (examples/train_moe.py): its loss falls under the planned policy,
the train step compiles once, and a run resumed from its orbax checkpoint follows the
trajectory of one that never stopped."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import pathlib
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "train_moe.py"
# A tight budget (one layer's worth for two layers) so the plan moves residuals off the
# device; the layer time is given so the demo skips measuring it.
SMALL = ["--tokens", "64", "--hidden", "64", "--ffn", "64", "--experts", "4", "--vocab", "64",
         "--lr", "1e-2", "--layer-time", "0.01", "--budget-mb", "0.05"]  # fmt: skip
STEPS = 6


def _load_example():
    spec = importlib.util.spec_from_file_location("train_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """STEPS steps in one run (aux-loss-free balancing), checkpointing every STEPS/2."""
    ckpt = tmp_path_factory.mktemp("straight")
    plot = ckpt.parent / "straight.png"
    argv = [*SMALL, "--steps", str(STEPS), "--ckpt-dir", str(ckpt), "--save-every", str(STEPS // 2),
            "--plot", str(plot)]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        report = _load_example().main(argv)
    return report, ckpt, plot, out.getvalue(), err.getvalue()


def test_demo_trains_under_the_planned_policy(straight):
    report, ckpt, plot, out, err = straight
    assert set(report["placement"].values()) != {"device"}
    losses = report["losses"]
    assert report["start_step"] == 0 and len(losses) == STEPS and np.all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < losses[0] - 0.5
    # Per-step router metrics: the load of every (layer, expert), tokens * top_k pairs per
    # layer, and the spread and balance loss that follow from it.
    load = np.asarray(report["expert_load"])
    assert load.shape == (STEPS, 2, 4) and np.all(load.sum(-1) == 64 * 2)
    np.testing.assert_allclose(report["load_spread"], (load.max(-1) / load.mean(-1)).max(-1), rtol=1e-12)
    assert np.all(np.isfinite(report["lb_loss"]))
    assert report["aux_loss"] == [0.0] * STEPS  # --balance bias: no auxiliary loss
    # The biases moved against the load: an expert with more than its share of
    # every step's load ends with a negative bias.
    bias = np.stack([np.asarray(b.score_bias[...]) for b in report["model"].blocks])
    expected = sum(1e-3 * np.sign(l.mean(-1, keepdims=True) - l) for l in load)
    np.testing.assert_allclose(bias, expected, atol=1e-7)
    assert report["train_step_compiles"] == 1
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [STEPS // 2, STEPS]
    assert "residuals in the traced step" in out and "train step compiles" in out
    assert f"step {STEPS:>6}  loss {losses[-1]:.4f}" in out  # the metrics line
    assert f"{STEPS}/{STEPS}" in err and f"loss={losses[-1]:.4f}" in err  # the progress bar
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_resumes_from_its_checkpoint(straight, tmp_path):
    """STEPS/2 steps, restore, STEPS/2 more: the losses, router metrics and final
    params of the straight run, and still one compilation of the train step."""
    report, ckpt, *_ = straight
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(ckpt, resumed_dir)
    shutil.rmtree(resumed_dir / str(STEPS))  # as if the run had stopped at STEPS/2
    resumed = _load_example().main([*SMALL, "--steps", str(STEPS), "--ckpt-dir", str(resumed_dir)])
    assert resumed["start_step"] == STEPS // 2
    for key in ("losses", "aux_loss", "lb_loss", "load_spread", "expert_load"):
        np.testing.assert_array_equal(resumed[key], report[key], err_msg=key)
    flat = nnx.to_flat_state(nnx.state(report["model"]))
    flat_resumed = dict(nnx.to_flat_state(nnx.state(resumed["model"])))
    assert len(flat) == len(flat_resumed)
    for path, var in flat:
        np.testing.assert_array_equal(jax.device_get(flat_resumed[path].get_value()),
                                      jax.device_get(var.get_value()), err_msg=str(path))  # fmt: skip
    # The restored state is placed like the step's output: no second compilation.
    assert resumed["train_step_compiles"] == 1
    # The resumed run saved its last step; a third run on the directory has nothing to do.
    assert (resumed_dir / str(STEPS)).is_dir()
    with pytest.raises(SystemExit, match="checkpoint of step 6"):
        _load_example().main([*SMALL, "--steps", str(STEPS), "--ckpt-dir", str(resumed_dir), "--no-resume"])


def test_demo_balances_with_the_aux_loss():
    """--balance loss: the blocks' aux loss (coef * load-balancing loss, summed over
    layers) is in the loss and the report."""
    report = _load_example().main([*SMALL, "--steps", "3", "--balance", "loss", "--aux-coef", "0.5"])
    aux, lb = np.asarray(report["aux_loss"]), np.asarray(report["lb_loss"])
    np.testing.assert_allclose(aux, 0.5 * 2 * lb, rtol=1e-6)  # 2 layers, lb is their mean
    assert np.all(aux > 0.5) and report["train_step_compiles"] == 1


def test_flags_are_checked_before_planning(capsys):
    """A top-k above the experts stops at the flags (before the planner measures
    anything), naming the flag; every recipe the planner takes is offered."""
    example = _load_example()
    with pytest.raises(SystemExit):
        example.parse_args(["--top-k", "5", "--experts", "4"])
    assert "--top-k must be in [1, --experts=4], got 5" in capsys.readouterr().err
    for recipe in ("mxfp8", "bf16", "fp8_block"):
        assert example.parse_args(["--recipe", recipe]).recipe == recipe
