"""The Hopper grouped weight-gradient kernel against ``reference.ragged_transpose_matmul``.

``out[g] = X_g^T @ dY_g`` over each group's rows, bf16 operands, fp32 sums, one bf16
rounding. Bounds as in test_grouped_gemm_gpu.py. Beyond accuracy: every element is
written (outputs poisoned with NaN, then with a huge value, must agree bitwise, which
also shows the result is reproducible run to run), empty groups give exact zeros, and
rows that are not the group's (the next group's, or past the groups) never contribute,
even when they hold Inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_grouped_mlp._src.cuda import ffi, gemm_ffi
from jax_grouped_mlp._src.cuda.ffi import Unsupported
from jax_grouped_mlp._src.formats import mxfp8
from jax_grouped_mlp._src.op import reference
from gpu_helpers import has_gpu
from test_grouped_gemm_gpu import _sizes

needs_kernels = pytest.mark.skipif(
    not (has_gpu() and ffi.available() and gemm_ffi.grouped_wgrad_variants()),
    reason="needs a GPU and the built extension",
)

_kernel = jax.jit(gemm_ffi.grouped_wgrad_bf16_cuda, static_argnames=("variant", "out_dtype"))
_reference = jax.jit(
    lambda a, b, gs: reference.ragged_transpose_matmul(a.astype(jnp.float32), b.astype(jnp.float32), gs)
)
VARIANTS = gemm_ffi.grouped_wgrad_variants() or ("none",)


def _poison(nbytes: int, value: int) -> None:
    """Leaves a freed device buffer of ``nbytes`` filled with ``value`` (see test_grouped_gemm_gpu)."""
    buf = jnp.full((nbytes,), value, jnp.uint8)
    jax.block_until_ready(buf)
    del buf


def _operands(rng, m, k, n):
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n), np.float32), jnp.bfloat16)
    return x, dy


def _clamped(group_sizes, m):
    ends = np.clip(np.cumsum(np.maximum(np.asarray(group_sizes, np.int64), 0)), 0, m)
    return np.diff(np.concatenate([[0], ends])).astype(np.int32)


def _check(x, dy, group_sizes, variant=None) -> np.ndarray:
    """Checks one run (output dtype: the variant's; bf16 when ``variant`` is None)."""
    out_dtype = gemm_ffi._wgrad_out_dtype(variant) if variant else jnp.dtype(jnp.bfloat16)
    gs = jnp.asarray(np.asarray(group_sizes, np.int32))
    (m, k), n, g = x.shape, dy.shape[1], len(group_sizes)
    clamped = _clamped(group_sizes, m)
    total = int(clamped.sum())
    # The oracle sees only the groups' rows (garbage past them must not matter).
    xs = jnp.zeros_like(x).at[:total].set(x[:total])
    dys = jnp.zeros_like(dy).at[:total].set(dy[:total])
    want = np.asarray(_reference(xs, dys, jnp.asarray(clamped)), np.float64)
    runs = []
    for value in (0xFF, 0x7F):
        _poison(g * k * n * out_dtype.itemsize, value)
        out = jax.block_until_ready(_kernel(x, dy, gs, variant=variant, out_dtype=out_dtype))
        assert out.dtype == out_dtype
        runs.append(np.asarray(out.astype(jnp.float32), np.float64))
    np.testing.assert_array_equal(runs[0], runs[1], err_msg="differs between runs: unwritten elements, a race or nondeterminism")
    got = runs[0]
    assert got.shape == (g, k, n)
    assert np.isfinite(got).all(), f"{(~np.isfinite(got)).sum()} non-finite outputs"
    for i in np.flatnonzero(clamped == 0):
        assert not got[i].any(), f"empty group {i} has a nonzero gradient"
    err = np.abs(got - want)
    # float32 output: only the fp32 summation order differs from the oracle.
    rel_tol, elem_tol = (5e-3, 2.0**-7) if out_dtype == jnp.bfloat16 else (1e-5, 1e-5)
    ref_norm = np.linalg.norm(want)
    if ref_norm:
        rel = np.linalg.norm(err) / ref_norm
        assert rel <= rel_tol, f"relative error {rel:.2e} (variant {variant})"
    scale = np.abs(want).max(axis=(1, 2), keepdims=True) + 1e-30
    bad = err > elem_tol * np.abs(want) + (1e-3 if out_dtype == jnp.bfloat16 else 1e-5) * scale
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{bad.sum()} elements off; first {i}: got {got[i]}, want {want[i]} (variant {variant})")
    return got


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "m,k,n,g,total",
    [
        (1000, 256, 512, 7, 1000),  # ragged starts, sizes sum to M
        (1500, 2688, 1856, 5, 1100),  # Nano FC1 wgrad dims, sum below M
        (777, 1856, 2688, 6, 1200),  # Nano FC2 wgrad dims (K not a multiple of 128), clamped
        (300, 200, 136, 3, 300),  # K, N not multiples of the tile
        (5, 64, 64, 2, 5),  # fewer rows than one slice
    ],
)
def test_random(rng, variant, m, k, n, g, total):
    x, dy = _operands(rng, m, k, n)
    _check(x, dy, _sizes(rng, g, total), variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_group_sizes_with_zeros_giant_and_negative(rng, variant):
    x, dy = _operands(rng, 640, 192, 256)
    _check(x, dy, [0, 5, 0, 300, 0, 129], variant)
    _check(x, dy, [0, 640, 0, 0, 0, 0], variant)  # one giant group
    _check(x, dy, [0, 0, 0, 0, 0, 0], variant)  # all empty: exact zeros
    _check(x, dy, [-5, 70, 0, 900, 4, 4], variant)  # negative -> 0, overshoot clamped
    _check(x, dy, [2**31 - 1, 2**31 - 1, 1, 1, 1, 1], variant)  # huge sizes


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_outside_the_groups_never_leak(rng, variant):
    """Inf in the rows past the groups: a slice that runs past a group end is zeroed, not multiplied."""
    x, dy = _operands(rng, 512, 128, 192)
    x = x.at[300:].set(jnp.inf)
    dy = dy.at[300:].set(-jnp.inf)
    _check(x, dy, [100, 37, 0, 163], variant)  # total 300: group ends mid-slice everywhere


@pytest.mark.gpu
@needs_kernels
def test_no_rows_no_groups_and_bad_buffers(rng):
    x, dy = _operands(rng, 64, 64, 64)
    out = _kernel(jnp.zeros((0, 64), jnp.bfloat16), jnp.zeros((0, 64), jnp.bfloat16), jnp.asarray([0, 0]))
    assert out.shape == (2, 64, 64) and not np.asarray(out.astype(jnp.float32)).any()
    assert _kernel(x, dy, jnp.zeros((0,), jnp.int32)).shape == (0, 64, 64)
    bad_out = jax.ShapeDtypeStruct((2, 64, 32), jnp.bfloat16)
    with pytest.raises(Exception, match="out"):
        call = jax.ffi.ffi_call(gemm_ffi.GROUPED_WGRAD_TARGET, bad_out)
        jax.block_until_ready(jax.jit(lambda a, b, gs: call(a, b, gs, variant=np.int32(0)))(x, dy, jnp.asarray([32, 32])))
    with pytest.raises(Unsupported, match="multiples of 8"):
        gemm_ffi.grouped_wgrad_bf16_cuda(jnp.zeros((4, 12), jnp.bfloat16), jnp.zeros((4, 8), jnp.bfloat16), jnp.asarray([4]))
    with pytest.raises(TypeError, match="out_dtype"):
        gemm_ffi.grouped_wgrad_bf16_cuda(x, dy, jnp.asarray([4]), out_dtype=jnp.float16)
    bf16_out_for_f32_variant = jax.ShapeDtypeStruct((2, 64, 64), jnp.bfloat16)
    f32_variant = gemm_ffi.grouped_wgrad_variants().index(gemm_ffi.default_variant(64, tuple(
        v for v in gemm_ffi.grouped_wgrad_variants() if v.endswith("_f32"))))
    with pytest.raises(Exception, match="out"):
        call = jax.ffi.ffi_call(gemm_ffi.GROUPED_WGRAD_TARGET, bf16_out_for_f32_variant)
        jax.block_until_ready(jax.jit(lambda a, b, gs: call(a, b, gs, variant=np.int32(f32_variant)))(x, dy, jnp.asarray([32, 32])))
    with pytest.raises(ValueError, match="row mismatch"):
        gemm_ffi.grouped_wgrad_bf16_cuda(x, dy[:32], jnp.asarray([4]))


@pytest.mark.gpu
@needs_kernels
def test_mxfp8_grouped_operands_through_the_adapter(rng):
    m, k, n, g = 512, 256, 192, 4
    x, dy = _operands(rng, m, k, n)
    gs = jnp.asarray(_sizes(rng, g, 450))
    xq, dyq = mxfp8.quantize_mxfp8_grouped(x, gs), mxfp8.quantize_mxfp8_grouped(dy, gs)
    want = _reference(mxfp8.dequantize(xq), mxfp8.dequantize(dyq), gs)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 5e-3), (jnp.float16, 2e-3)):
        got = jax.jit(lambda a, b, s: gemm_ffi.grouped_wgrad_cuda(a, b, s, out_dtype=dtype))(xq, dyq, gs)
        assert got.dtype == dtype
        rel = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
        assert rel <= tol, (dtype, rel)


@pytest.mark.gpu
@needs_kernels
def test_small_for_sanitizer(rng):
    """Small and quick: the case compute-sanitizer runs."""
    x, dy = _operands(rng, 300, 200, 136)
    for variant in gemm_ffi.grouped_wgrad_variants():
        _check(x, dy, [100, 0, 150, 200], variant)
