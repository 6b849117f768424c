"""Side work (a weight fake-quantize run beside a GEMM kernel on a second stream).

For each GEMM family (plain, K-major plain, weight gradient, FC1 epilogue) and each
weight axis: the GEMM outputs and the side output of the "_beside" target equal, bit
for bit, the plain kernel followed by the one-pass fake-quantize kernel (which the
fake-quantize tests check against the reference), for several SM reserves including
"every SM but one". Outputs are poisoned with two byte patterns before the runs, so
an unwritten byte shows up. Repeated runs on a size that keeps both kernels busy at
once check that nothing races.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_grouped_mlp._src import ffi, gemm_ffi
from gpu_helpers import has_gpu
from test_quantize_gpu import _poison

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (has_gpu() and ffi.available() and gemm_ffi.grouped_gemm_fc1_variants()),
        reason="needs a GPU and the built extension",
    ),
]

RESERVES = [0, 16, 32, 10_000]  # 10_000: the GEMM keeps a single CTA


def _bits(tree):
    return [np.asarray(x).view(np.uint8) for x in jax.tree.leaves(tree)]


def _family(kind: str):
    """(fn(a, b, gs, probs, side=..., side_axis=...), operand maker) for a GEMM family."""
    if kind == "gemm":
        return lambda a, b, gs, p, **kw: gemm_ffi.grouped_gemm_bf16_cuda(a, b, gs, **kw), False
    if kind == "gemm_bk":
        return lambda a, b, gs, p, **kw: gemm_ffi.grouped_gemm_bf16_cuda(a, b, gs, transpose_rhs=True, **kw), True
    if kind == "wgrad":
        return lambda a, b, gs, p, **kw: gemm_ffi.grouped_wgrad_bf16_cuda(a, b, gs, **kw), None
    return lambda a, b, gs, p, **kw: gemm_ffi.grouped_gemm_fc1_cuda(a, b, gs, p, **kw), False


def _operands(rng, kind: str, m: int, k: int, n: int, sizes):
    g = len(sizes)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    if kind == "wgrad":
        b = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    elif kind == "gemm_bk":
        b = jnp.asarray(rng.standard_normal((g, n, k)) / 16, jnp.bfloat16)
    else:
        b = jnp.asarray(rng.standard_normal((g, k, n)) / 16, jnp.bfloat16)
    probs = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
    return a, b, jnp.asarray(sizes, jnp.int32), probs


@pytest.mark.parametrize("kind", ["gemm", "gemm_bk", "wgrad", "fc1"])
@pytest.mark.parametrize("side_axis", [1, 2])
def test_beside_equals_sequential(rng, kind, side_axis):
    fn, _ = _family(kind)
    a, b, gs, probs = _operands(rng, kind, m=300, k=200, n=136, sizes=[100, 0, 150, 200])
    side = jnp.asarray(rng.standard_normal((3, 96, 160)), jnp.bfloat16)  # another weight
    seq = jax.jit(lambda *x: fn(*x, side=side, side_axis=side_axis))
    with gemm_ffi.beside_config(enabled=False):
        want = _bits(seq.lower(a, b, gs, probs).compile()(a, b, gs, probs))
    assert len(want) >= 2
    for reserve in RESERVES:
        with gemm_ffi.beside_config(enabled=True, reserve_sms=reserve):
            compiled = jax.jit(lambda *x: fn(*x, side=side, side_axis=side_axis)).lower(a, b, gs, probs).compile()
        assert "_beside" in compiled.as_text()
        for value in (0x00, 0xFF):
            _poison([w.shape for w in want], value)
            got = _bits(compiled(a, b, gs, probs))
            for x, y in zip(got, want):
                np.testing.assert_array_equal(x, y)


def test_side_is_the_fake_quantize(rng):
    """The side output is the plain fake-quantize kernel's result, along either axis."""
    a, b, gs, probs = _operands(rng, "gemm", m=256, k=128, n=192, sizes=[64, 64, 64, 64])
    side = jnp.asarray(rng.standard_normal((2, 128, 64)), jnp.bfloat16)
    for axis in (1, 2):
        _, got = jax.jit(lambda a, b, gs: gemm_ffi.grouped_gemm_bf16_cuda(a, b, gs, side=side, side_axis=axis))(a, b, gs)
        want = jax.jit(lambda w: ffi.fake_quantize_cuda(w, axis=axis))(side)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_no_race_at_a_busy_size(rng):
    """Both kernels long enough to overlap; ten runs agree with the sequential result."""
    a, b, gs, probs = _operands(rng, "gemm", m=8192, k=1024, n=1024, sizes=[2048] * 4)
    side = jnp.asarray(rng.standard_normal((16, 1024, 1024)), jnp.bfloat16)
    fn = jax.jit(lambda a, b, gs: gemm_ffi.grouped_gemm_bf16_cuda(a, b, gs, side=side, side_axis=1))
    with gemm_ffi.beside_config(enabled=False):
        want = _bits(fn.lower(a, b, gs).compile()(a, b, gs))
    with gemm_ffi.beside_config(enabled=True):
        compiled = fn.lower(a, b, gs).compile()
    for _ in range(10):
        for x, y in zip(_bits(compiled(a, b, gs)), want):
            np.testing.assert_array_equal(x, y)
