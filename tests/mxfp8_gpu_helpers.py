"""Helpers shared by the GPU tests of the MXFP8 kernels: byte comparisons, poisoned
output memory, random inputs with many scales, random group sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src.formats import mxfp8
from gpu_helpers import poison_freed


def _bytes(a) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def _poison(shapes, value: int) -> None:
    """Poisons freed device memory of the outputs' sizes (uint8 shapes) with ``value``
    (:func:`gpu_helpers.poison_freed`)."""
    poison_freed(*(int(np.prod(s)) for s in shapes), value=value)


def _assert_same(got: mxfp8.MXFP8Tensor, want: mxfp8.MXFP8Tensor, what: str) -> None:
    """Byte equality of data and scales; the one allowance is NaN's sign (in a NaN
    block every data byte must be a NaN, 0x7F or 0xFF, in both)."""
    gd, wd = _bytes(got.data), _bytes(want.data)
    nan = lambda b: (b & 0x7F) == 0x7F  # noqa: E731  (E4M3 NaN, either sign)
    gd = np.where(nan(gd) & nan(wd), 0x7F, gd)
    wd = np.where(nan(wd) & nan(gd), 0x7F, wd)
    for name, g, w in (("data", gd, wd), ("scale", _bytes(got.scale), _bytes(want.scale))):
        if not np.array_equal(g, w):
            bad = np.argwhere(g != w)
            i = tuple(bad[0])
            raise AssertionError(
                f"{what} {name}: {len(bad)} of {g.size} bytes differ; first at {i}: "
                f"got {g[i]:#04x}, want {w[i]:#04x}"
            )
    assert got.axis == want.axis


def _random(rng, m, k, spread=20):
    """Normal values times 2**e with e varying per row and column: many scales."""
    e = rng.integers(-spread, spread, size=(m, 1)) + rng.integers(-4, 4, size=(1, k))
    return (rng.standard_normal((m, k)) * np.exp2(e)).astype(np.float32)


def _sizes(rng, m, g, total):
    cuts = np.sort(rng.integers(0, total + 1, size=g - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)
