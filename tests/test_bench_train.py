"""benchmarks/bench_train.py's candidates on the CPU (tiny shape)."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_train  # noqa: E402


def test_persistent_bf16_copies_train_like_the_op_casting_itself():
    """``MoEWithCopies`` reads bf16 copies refreshed after every update: the losses of
    every step are those of the block that casts the weights itself, bit for bit (a
    missed refresh would train on stale copies from the second step on)."""
    shape = bench_train.SMALL
    cands = bench_train._candidates(shape)
    runs = {name: bench_train.bench(name, *cands[name], shape, layers=2, tokens=64, iters=1)
            for name in ("jgm_bf16_device_bf16grad", "jgm_bf16_device_bf16grad_copies")}
    plain, copies = runs.values()
    assert copies["loss_first"] == plain["loss_first"] and copies["loss_last"] == plain["loss_last"], runs
    assert plain["loss_last"] != plain["loss_first"]  # (the weights did change between steps)
