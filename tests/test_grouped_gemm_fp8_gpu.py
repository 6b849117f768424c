"""The MXFP8 grouped GEMM on FP8 tensor cores (strategy 1 prototype) against float64 math.

Tests marked ``gpu`` need an NVIDIA Hopper GPU and the built extension
(``python tools/build_kernels.py``); the others run anywhere (binding validation,
scale layouts, lowering when the extension is built).

Oracle: ``dequantize(lhs)[m] @ dequantize(rhs_t)[g]^T`` in float64 over the groups'
(clamped) rows, zeros past them. Error bound: FP8 products are exact; each 32-K block
is summed by the tensor cores (Hopper's FP8 wgmma keeps fewer than fp32's bits while
accumulating: we allow 2^-10 of the block's sum of |products|, about 8x what the
reported ~13-bit alignment loses), promoted in fp32 (negligible), rounded once to bf16
(2^-9 relative). Per element: ``|out - ref| <= 2^-8 |ref| + 2^-10 (|A| @ |B|^T)``, and
``||out - ref|| / ||ref|| <= 5e-3``. Rows past the groups must be exact zeros, NaN
appears exactly where the oracle has it, and two runs over differently poisoned
output buffers must agree (every element written).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_grouped_mlp._src import ffi, gemm_fp8_ffi, mxfp8
from jax_grouped_mlp._src.mxfp8 import MXFP8Tensor
from gpu_helpers import has_gpu

VARIANTS = gemm_fp8_ffi.grouped_gemm_fp8_variants() or ("none",)
needs_kernels = pytest.mark.skipif(
    not (has_gpu() and ffi.available() and gemm_fp8_ffi.grouped_gemm_fp8_variants()),
    reason="needs a GPU and the built extension",
)
_kernel = jax.jit(gemm_fp8_ffi.grouped_gemm_fp8_cuda, static_argnames=("variant",))


def _poison(m: int, n: int, value: int) -> None:
    """Fills freed device memory of the output's size with ``value`` bytes (0xFF: bf16 NaN)."""
    buf = jnp.full((m, n * 2), value, jnp.uint8)
    jax.block_until_ready(buf)
    del buf


def _sizes(rng, g, total):
    cuts = np.sort(rng.integers(0, total + 1, size=g - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


def _blocky(rng, shape, scale=1.0):
    """Normal values whose magnitude changes per 32-block of the last axis (2^-6..2^6),
    with about 5% all-zero blocks (scale byte 0): every block gets its own scale."""
    k = shape[-1]
    kb = -(-k // 32)
    mag = 2.0 ** rng.integers(-6, 7, size=shape[:-1] + (kb,))
    mag = np.where(rng.random(mag.shape) < 0.05, 0.0, mag)
    x = rng.standard_normal(shape) * np.repeat(mag, 32, axis=-1)[..., :k] * scale
    return jnp.asarray(x, jnp.float32)


def _operands(rng, m, n, k, g):
    lhs = mxfp8.quantize_mxfp8(_blocky(rng, (m, k)), axis=1)
    rhs_t = mxfp8.quantize_mxfp8(_blocky(rng, (g, n, k), 1.0 / np.sqrt(k)), axis=2)
    return lhs, rhs_t


def _with_nan_scale(t: MXFP8Tensor, index) -> MXFP8Tensor:
    e = jax.lax.bitcast_convert_type(t.scale, jnp.uint8).at[index].set(mxfp8.E8M0_NAN)
    return MXFP8Tensor(t.data, jax.lax.bitcast_convert_type(e, jnp.float8_e8m0fnu), t.axis)


def _oracle(lhs, rhs_t, group_sizes):
    """(float64 reference, float64 |A| @ |B|^T, rows covered) with clamped group sizes."""
    a = np.asarray(mxfp8.dequantize(lhs, jnp.float32), np.float64)
    b = np.asarray(mxfp8.dequantize(rhs_t, jnp.float32), np.float64)
    m, n = a.shape[0], b.shape[1]
    want = np.zeros((m, n))
    absref = np.zeros((m, n))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes, np.int64)):
        end = min(start + max(int(size), 0), m)
        with np.errstate(invalid="ignore"):
            want[start:end] = a[start:end] @ b[g].T
            absref[start:end] = np.abs(a[start:end]) @ np.abs(b[g]).T
        start = end
    return want, absref, start


def _check(lhs, rhs_t, group_sizes, variant) -> np.ndarray:
    gs = jnp.asarray(np.asarray(group_sizes, np.int32))
    m, n = lhs.shape[0], rhs_t.shape[1]
    want, absref, total = _oracle(lhs, rhs_t, group_sizes)
    runs = []
    for value in (0xFF, 0x7F):  # NaN, then a huge finite value
        _poison(m, n, value)
        out = _kernel(lhs, rhs_t, gs, variant=variant)
        runs.append(np.asarray(jax.block_until_ready(out).astype(jnp.float32), np.float64))
    np.testing.assert_array_equal(runs[0], runs[1], err_msg="output differs between poisons: unwritten elements or a race")
    got = runs[0]
    assert not got[total:].any(), f"rows past sum(group_sizes)={total} are not zero"
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    if (nan_got != nan_want).any():
        i = tuple(np.argwhere(nan_got != nan_want)[0])
        raise AssertionError(f"{(nan_got != nan_want).sum()} NaN mismatches; first {i}: got {got[i]}, want {want[i]}")
    fin = ~nan_want
    err = np.abs(got - want)[fin]
    ref_norm = np.linalg.norm(want[fin])
    if ref_norm:
        rel = np.linalg.norm(err) / ref_norm
        assert rel <= 5e-3, f"relative error {rel:.2e} (variant {variant})"
    bad = err > 2.0**-8 * np.abs(want[fin]) + 2.0**-10 * absref[fin] + 1e-30
    if bad.any():
        i = tuple(np.argwhere(fin)[np.argmax(bad)])
        raise AssertionError(f"{bad.sum()} elements off; first {i}: got {got[i]}, want {want[i]} (variant {variant})")
    return got


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "m,n,k,g,total",
    [
        (1000, 256, 512, 7, 1000),  # sizes sum to M, ragged group starts
        (1000, 1856, 2688, 5, 700),  # Nano FC1 dims (N 64-aligned), sum below M
        (777, 2688, 1856, 6, 1200),  # Nano FC2 dims, sum above M (clamped)
        (300, 136, 208, 3, 300),  # N not a tile multiple, K not a 128 (nor 32) multiple
        (5, 64, 64, 2, 5),  # fewer rows than one tile
        (2048, 1536, 4096, 16, 2000),
    ],
)
def test_random(rng, variant, m, n, k, g, total):
    lhs, rhs_t = _operands(rng, m, n, k, g)
    _check(lhs, rhs_t, _sizes(rng, g, total), variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_group_sizes_with_zeros_giant_and_negative(rng, variant):
    lhs, rhs_t = _operands(rng, 640, 192, 384, 6)
    _check(lhs, rhs_t, [0, 5, 0, 300, 0, 129], variant)  # zeros, short groups, sum below M
    _check(lhs, rhs_t, [0, 640, 0, 0, 0, 0], variant)  # one giant group
    _check(lhs, rhs_t, [0, 0, 0, 0, 0, 0], variant)  # every row past the groups
    _check(lhs, rhs_t, [-5, 70, 0, 900, 4, 4], variant)  # negative counts as zero; overshoot clamped
    _check(lhs, rhs_t, [2**31 - 1, 2**31 - 1, 1, 1, 1, 1], variant)  # huge sizes: no int overflow


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_nan_scale_blocks(rng, variant):
    """An E8M0 NaN scale (0xFF) poisons exactly the rows (A) / columns of its group (B) it touches."""
    m, n, k, g = 400, 320, 512, 3
    lhs, rhs_t = _operands(rng, m, n, k, g)
    sizes = [150, 0, 200]  # rows 350.. are past the groups
    lhs = _with_nan_scale(lhs, (17, 3))  # row 17 (group 0), block 3
    lhs = _with_nan_scale(lhs, (371, 0))  # a row past the groups: must stay zero
    rhs_t = _with_nan_scale(rhs_t, (2, 201, 15))  # group 2, column 201, last block
    rhs_t = _with_nan_scale(rhs_t, (1, 5, 0))  # the empty group: touches nothing
    got = _check(lhs, rhs_t, sizes, variant)
    assert np.isnan(got[17]).all() and np.isnan(got[150:350, 201]).all()
    assert np.isnan(got).sum() == n + 200  # row 17, and column 201 of group 2 (other rows)


@pytest.mark.gpu
@needs_kernels
def test_no_groups(rng):
    lhs, _ = _operands(rng, 100, 64, 64, 1)
    rhs_t = MXFP8Tensor(jnp.zeros((0, 64, 64), jnp.float8_e4m3fn),
                        jax.lax.bitcast_convert_type(jnp.zeros((0, 64, 2), jnp.uint8), jnp.float8_e8m0fnu), 2)
    out = _kernel(lhs, rhs_t, jnp.zeros((0,), jnp.int32))
    assert out.shape == (100, 64) and not np.asarray(out.astype(jnp.float32)).any()


@pytest.mark.gpu
@needs_kernels
def test_small_for_sanitizer(rng):
    """Small and quick: the case to run under compute-sanitizer."""
    lhs, rhs_t = _operands(rng, 300, 136, 208, 4)
    for variant in gemm_fp8_ffi.grouped_gemm_fp8_variants():
        _check(lhs, rhs_t, [100, 0, 150, 200], variant)  # last group overshoots M


@pytest.mark.gpu
@needs_kernels
def test_handler_rejects_bad_buffers():
    a = jnp.zeros((64, 64), jnp.float8_e4m3fn)
    b = jnp.zeros((2, 128, 64), jnp.float8_e4m3fn)
    sa = jnp.zeros((2, 64), jnp.float32)
    sb = jnp.zeros((2, 2, 128), jnp.float32)
    gs = jnp.asarray([32, 32], jnp.int32)
    call = lambda out, sa_: jax.ffi.ffi_call(gemm_fp8_ffi.GROUPED_GEMM_FP8_TARGET, out)(  # noqa: E731
        a, b, sa_, sb, gs, variant=np.int32(0))
    with pytest.raises(Exception, match="out"):
        jax.block_until_ready(jax.jit(lambda: call(jax.ShapeDtypeStruct((64, 64), jnp.bfloat16), sa))())
    with pytest.raises(Exception, match="sa"):
        jax.block_until_ready(jax.jit(lambda: call(jax.ShapeDtypeStruct((64, 128), jnp.bfloat16), sa[:, :60]))())


# ---- no GPU needed ----


def _small():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 128)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((2, 96, 128)), jnp.float32)
    return mxfp8.quantize_mxfp8(x, axis=1), mxfp8.quantize_mxfp8(w, axis=2), jnp.asarray([32, 32], jnp.int32)


def test_binding_rejects_bad_operands():
    f = gemm_fp8_ffi.grouped_gemm_fp8_cuda
    lhs, rhs_t, gs = _small()
    with pytest.raises(TypeError, match="MXFP8Tensor"):
        f(mxfp8.dequantize(lhs), rhs_t, gs)
    with pytest.raises(ValueError, match="axis=1"):
        f(mxfp8.quantize_mxfp8(jnp.ones((64, 128)), axis=0), rhs_t, gs)
    with pytest.raises(ValueError, match="axis=2"):
        f(lhs, mxfp8.quantize_mxfp8(jnp.ones((2, 96, 128)), axis=1), gs)
    with pytest.raises(ValueError, match="contraction mismatch"):
        f(lhs, mxfp8.quantize_mxfp8(jnp.ones((2, 96, 160)), axis=2), gs)
    with pytest.raises(ValueError, match="K % 16"):
        f(mxfp8.quantize_mxfp8(jnp.ones((64, 40)), axis=1), mxfp8.quantize_mxfp8(jnp.ones((2, 96, 40)), axis=2), gs)
    with pytest.raises(ValueError, match="N % 8"):
        f(lhs, mxfp8.quantize_mxfp8(jnp.ones((2, 12, 128)), axis=2), gs)
    with pytest.raises(TypeError, match="group_sizes"):
        f(lhs, rhs_t, jnp.asarray([32, 32, 0], jnp.int32))
    with pytest.raises(TypeError, match="group_sizes"):
        f(lhs, rhs_t, jnp.asarray([32.0, 32.0]))
    with pytest.raises(ValueError, match="group-aware"):
        f(mxfp8.quantize_mxfp8_grouped(jnp.ones((64, 128)), gs), rhs_t, gs)
    bad = MXFP8Tensor(lhs.data.astype(jnp.bfloat16), lhs.scale, 1)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        f(bad, rhs_t, gs)
    if ffi.available():
        with pytest.raises(ValueError, match="compiled"):
            f(lhs, rhs_t, gs, variant="no_such_variant")
    else:
        with pytest.raises(RuntimeError, match="not built"):
            f(lhs, rhs_t, gs)


def test_scale_layouts():
    """lhs_scales: [KB, round_up(M, 4)] transposed; rhs_scales: lane q's columns contiguous."""
    rng = np.random.default_rng(0)
    m, n, kb, g, tile = 7, 200, 3, 2, 128
    ea = rng.integers(0, 256, size=(m, kb)).astype(np.uint8)
    eb = rng.integers(0, 256, size=(g, n, kb)).astype(np.uint8)
    val = lambda e: np.asarray(mxfp8._scale_value(jnp.asarray(e)))  # noqa: E731
    sa = np.asarray(gemm_fp8_ffi.lhs_scales(jnp.asarray(ea)))
    assert sa.shape == (kb, 8)
    np.testing.assert_array_equal(sa[:, :m], val(ea).T)
    assert not sa[:, m:].any()
    sb = np.asarray(gemm_fp8_ffi.rhs_scales(jnp.asarray(eb), tile))
    assert sb.shape == (g, kb, 256)
    want = val(eb)
    for c in range(256):
        chunk, r = divmod(c, tile)
        n8, q, j = r // 8, (r % 8) // 2, r % 2
        pos = chunk * tile + q * (tile // 4) + 2 * n8 + j
        if c < n:
            np.testing.assert_array_equal(sb[:, :, pos], want[:, c, :])
        else:
            assert not sb[:, :, pos].any()


@pytest.mark.skipif(not gemm_fp8_ffi.grouped_gemm_fp8_variants(), reason="needs the built extension")
def test_target_is_registered_and_lowers_for_cuda():
    assert gemm_fp8_ffi.GROUPED_GEMM_FP8_TARGET in ffi.registered_targets()
    lhs, rhs_t, gs = _small()
    for variant in gemm_fp8_ffi.grouped_gemm_fp8_variants():
        fn = jax.jit(lambda a, b, s, v=variant: gemm_fp8_ffi.grouped_gemm_fp8_cuda(a, b, s, variant=v))
        text = jax.export.export(fn, platforms=["cuda"], disabled_checks=ffi.export_disabled_checks())(
            lhs, rhs_t, gs).mlir_module()
        assert gemm_fp8_ffi.GROUPED_GEMM_FP8_TARGET in text
