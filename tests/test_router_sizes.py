"""The op on group sizes as a router makes them: the generator the benchmarks use
(``benchmarks/shapes.py: router_group_sizes``, Dirichlet(alpha) expert loads), so the
skewed cases the benchmarks time are the cases the tests check: typically a few heavy
experts, some nearly or fully empty ones, and a ragged end in nearly every group
(partial tiles, partial weight-gradient slices). Fresh draws every run."""

from __future__ import annotations

import pathlib
import sys

import jax
import numpy as np
import pytest

from mlp_reference import mlp_f64, rel_err
from test_mlp import BANDS, make_inputs, run_op

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import shapes  # noqa: E402

RECIPES = ["mxfp8", "bf16", "fp8_block"]
NAMES = ("y", "dx", "dw1", "dw2", "dprobs")


def _router_inputs(rng, alpha: float, m: int, g: int, h: int = 256, f: int = 192):
    sizes = shapes.router_group_sizes(m, g, alpha, seed=int(rng.integers(1 << 30)))
    assert sizes.sum() == m
    return make_inputs(rng, m=m, h=h, f=f, g=g, sizes=sizes)


def _check_bands(out, args, recipe: str) -> None:
    y, (dx, dw1, dw2, dp) = out
    want = mlp_f64(*args)
    ry, (rdx, rdw1, rdw2, rdp) = want
    for name, got, ref in zip(NAMES, (y, dx, dw1, dw2, dp), (ry, rdx, rdw1, rdw2, rdp)):
        assert rel_err(got, ref) < BANDS[recipe][name], (recipe, name, rel_err(got, ref))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("alpha", [1.0, 0.3])
def test_router_made_sizes_in_the_float64_bands(rng, recipe, alpha):
    args = _router_inputs(rng, alpha, m=512, g=8, h=64, f=96)
    _check_bands(jax.jit(run_op, static_argnums=6)(*args, recipe), args, recipe)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("alpha", [1.0, 0.3])
@pytest.mark.parametrize("m,g", [(1536, 16), (4096, 4)])  # 96 rows a group (mxfp8: _qw GEMMs), 1024 (fused kernels)
def test_router_made_sizes_on_the_gpu(gpu, rng, recipe, alpha, m, g):
    """The kernels on router-made sizes: the float64 bands, and the CPU path's numbers
    (the same quantized operands, so only the summation order differs: 0.5%; fp8_block
    also has the FP8 wgmma's 128-block sums and E4M3 near-tie flips: 3%,
    tests/test_fp8_block.py says why)."""
    args = _router_inputs(rng, alpha, m=m, g=g)
    fn = jax.jit(run_op, static_argnums=6)
    out_gpu = fn(*jax.device_put(args, gpu), recipe)
    out_cpu = fn(*jax.device_put(args, jax.devices("cpu")[0]), recipe)
    tol = 3e-2 if recipe == "fp8_block" else 5e-3
    for name, got, want in zip(NAMES, jax.tree.leaves(out_gpu), jax.tree.leaves(out_cpu)):
        err = rel_err(np.asarray(got, np.float32), np.asarray(want, np.float32))
        assert err < tol, (recipe, name, err)
    _check_bands(out_gpu, args, recipe)
