"""The FP8 block-scaled grouped GEMM (``gemm_ffi.grouped_gemm_fp8_block``, kernel
``kernels/grouped_gemm_fp8_block_sm90.py``) against a float64 numpy reference of the
dequantized operands.

Tests marked ``gpu`` need an NVIDIA Hopper GPU and the built extension; the others check
the oracle itself and run anywhere. One command on the H200 (docs/notes/2026-12-02-fp8-block-kernel.md):

    python -m pytest -q -n 0 tests/test_grouped_gemm_fp8_block_gpu.py

Shape contract of the binding: static sizes, K % 16 == 0, N % 8 == 0 (K and N need not be
multiples of 128: the last block is partial and zero-padded, as the quantizer pads it).

Error bound. The products of E4M3 values are exact, the scales are powers of two, so the
only roundings are (1) the sum of each 128-wide K block inside the FP8 wgmma, whose
accumulator is narrower than float32 (DeepSeek-V3 reports about 14 bits kept), (2) the
float32 promotion ``acc += partial * sa * sb`` over the K blocks and (3) one bf16
rounding of the result (at most 2^-9 relative). So per element we ask
``|out - ref| <= 2^-8 |ref| + 2^-12 sum_k |a_k b_k|`` (the second term covers (1) and
(2) with room; a wrong scale, row or group is off by O(|ref|)), and the norm-wise relative
error <= 5e-3. Where every partial sum is small integers times powers of two
(:func:`test_exact_when_sums_are_exact`), nothing rounds before the output and the kernel
must equal ``bf16(ref)`` bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_grouped_mlp._src.cuda import ffi, gemm_ffi
from jax_grouped_mlp._src.formats import fp8_block
from jax_grouped_mlp._src.formats.fp8_block import FP8BlockTensor
from gpu_helpers import SKIPPED_WARP_GROUP_RUNS, has_gpu, poison_freed

B = fp8_block.BLOCK

needs_kernels = pytest.mark.skipif(
    not (has_gpu() and ffi.available() and gemm_ffi.grouped_gemm_fp8_block_variants()),
    reason="needs a GPU and the built extension",
)

_kernel = jax.jit(gemm_ffi.grouped_gemm_fp8_block, static_argnames=("variant",))


# ---- operands and the float64 oracle (no library code but the format's field layout) ----


def _scale_values(scale) -> np.ndarray:
    e = np.asarray(jax.lax.bitcast_convert_type(scale, jnp.uint8)).astype(np.int64)
    return np.where(e == 255, np.nan, np.exp2(np.maximum(e, 0) - 127.0))


def dequantize_f64(t: FP8BlockTensor) -> np.ndarray:
    """``data * 2**(scale - 127)`` per block in float64 (lhs ``[M, K]`` blocked along axis 1,
    rhs ``[G, N, K]`` in 128 x 128 tiles over axes 1 and 2)."""
    data = np.asarray(t.data).astype(np.float64)
    s = _scale_values(t.scale)
    for a in t.axes:
        s = np.repeat(s, B, axis=a)
        s = np.take(s, np.arange(data.shape[a]), axis=a)
    return data * s


def clamped_ends(group_sizes, m: int) -> np.ndarray:
    """Each group's end row after the kernels' clamp (negative sizes 0, cut at M)."""
    return np.clip(np.cumsum(np.maximum(np.asarray(group_sizes, np.int64), 0)), 0, m)


def reference_f64(lhs: FP8BlockTensor, rhs: FP8BlockTensor, group_sizes) -> tuple[np.ndarray, np.ndarray]:
    """``(out, sum_k |a_k b_k|)`` in float64; rows past the (clamped) groups are 0."""
    a, b = dequantize_f64(lhs), dequantize_f64(rhs)
    m, n = a.shape[0], b.shape[1]
    out, mag = np.zeros((m, n)), np.zeros((m, n))
    start = 0
    for g, end in enumerate(clamped_ends(group_sizes, m)):
        out[start:end] = a[start:end] @ b[g].T
        mag[start:end] = np.abs(a[start:end]) @ np.abs(b[g]).T
        start = end
    return out, mag


def _sizes(rng, g, total):
    cuts = np.sort(rng.integers(0, total + 1, size=g - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


def operands(rng, m, n, k, g) -> tuple[FP8BlockTensor, FP8BlockTensor]:
    """Quantized ``x [M, K]`` (rows spread over 2^+-8) and ``w [G, K, N]`` as the kernel takes
    it: tiles transposed to ``[G, N, K]`` (exact)."""
    x = rng.standard_normal((m, k)) * np.exp2(rng.integers(-8, 8, size=(m, 1)))
    w = rng.standard_normal((g, k, n)) / np.sqrt(k)
    lhs = fp8_block.quantize_fp8_block(jnp.asarray(x, jnp.float32), axis=1)
    rhs = fp8_block.transpose_tiles(fp8_block.quantize_fp8_block(jnp.asarray(w, jnp.float32), axis=(1, 2)))
    return lhs, rhs


def exact_operands(rng, m, n, k, g) -> tuple[FP8BlockTensor, FP8BlockTensor]:
    """Integer data in [-3, 3] and scale exponents in [-2, 1]: a 128-block's partial sum is an
    integer of magnitude <= 128 * 9 < 2^11 (exact in any accumulator of >= 11 bits), every
    sum over blocks a multiple of 2^-4 below 2^17 for K <= 2688 (exact in float32): nothing
    rounds before the bf16 output (:func:`test_exact_operands_are_exact_in_float32`)."""
    kb, nb = -(-k // B), -(-n // B)
    a = rng.integers(-3, 4, size=(m, k)).astype(np.float32)
    b = rng.integers(-3, 4, size=(g, n, k)).astype(np.float32)
    sa = rng.integers(127 - 2, 127 + 2, size=(m, kb)).astype(np.uint8)
    sb = rng.integers(127 - 2, 127 + 2, size=(g, nb, kb)).astype(np.uint8)
    e8 = lambda s: jax.lax.bitcast_convert_type(jnp.asarray(s), jnp.float8_e8m0fnu)  # noqa: E731
    lhs = FP8BlockTensor(jnp.asarray(a, jnp.float8_e4m3fn), e8(sa), (1,))
    rhs = FP8BlockTensor(jnp.asarray(b, jnp.float8_e4m3fn), e8(sb), (1, 2))
    return lhs, rhs


def _run(lhs, rhs, group_sizes, variant=None) -> np.ndarray:
    """The kernel's output in float64, run after two poisons (0xFF: bf16 NaN; 0x7F: huge);
    both runs must agree bit for bit (every element written, deterministic)."""
    m, n = lhs.data.shape[0], rhs.data.shape[1]
    gs = jnp.asarray(np.asarray(group_sizes, np.int32))
    runs = []
    for value in (0xFF, 0x7F):
        poison_freed(m * n * 2, value=value)  # (the bf16 [m, n] output)
        out = jax.block_until_ready(_kernel(lhs, rhs, gs, variant=variant))
        assert out.shape == (m, n) and out.dtype == jnp.bfloat16
        runs.append(np.asarray(out.astype(jnp.float32), np.float64))
    np.testing.assert_array_equal(runs[0], runs[1], err_msg="output differs between poisons: unwritten elements or a race")
    got = runs[0]
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} NaN outputs (unwritten elements?)"
    return got


def _check(lhs, rhs, group_sizes, variant=None) -> None:
    m = lhs.data.shape[0]
    want, mag = reference_f64(lhs, rhs, group_sizes)
    got = _run(lhs, rhs, group_sizes, variant)
    total = int(clamped_ends(group_sizes, m)[-1]) if len(group_sizes) else 0
    assert not got[total:].any(), f"rows past sum(group_sizes)={total} are not zero"
    err = np.abs(got - want)
    if np.linalg.norm(want):
        rel = np.linalg.norm(err) / np.linalg.norm(want)
        assert rel <= 5e-3, f"relative error {rel:.2e}"
    bad = err > 2.0**-8 * np.abs(want) + 2.0**-12 * mag
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"{bad.sum()} elements off; first {i}: got {got[i]}, want {want[i]}, sum|ab| {mag[i]}"
        )


VARIANTS = gemm_ffi.grouped_gemm_fp8_block_variants() or ("none",)


# ---- the oracle, anywhere ----


def test_oracle_matches_the_library_dequantizer(rng):
    """The numpy dequantizer and grouped product are the library's on the same operands."""
    lhs, rhs = operands(rng, 300, 200, 272, 3)
    np.testing.assert_array_equal(dequantize_f64(lhs), np.asarray(fp8_block.dequantize_fp8_block(lhs, jnp.float32)))
    np.testing.assert_array_equal(dequantize_f64(rhs), np.asarray(fp8_block.dequantize_fp8_block(rhs, jnp.float32)))
    sizes = np.array([100, 0, 150], np.int32)
    want, _ = reference_f64(lhs, rhs, sizes)
    a, b = dequantize_f64(lhs), dequantize_f64(rhs)
    np.testing.assert_allclose(want[100:250], a[100:250] @ b[2].T, rtol=1e-12)
    assert not want[250:].any()


def test_exact_operands_are_exact_in_float32(rng):
    """What makes the bit-exact GPU test valid: every 128-block partial sum and the running
    float32 sum over the blocks are exactly representable (|value| / ulp < 2^24)."""
    k = 2688  # the largest K of the GPU cases
    lhs, rhs = exact_operands(rng, 64, 256, k, 2)
    a, b = dequantize_f64(lhs), dequantize_f64(rhs)
    # The worst case, not just this draw: the bound of every partial and running sum.
    assert 128 * 9 < 2**11 and (k // B + 1) * 128 * 9 * 2**2 / 2**-4 < 2**24
    for kb in range(-(-k // B)):
        part = a[:, kb * B:(kb + 1) * B] @ b[0, :, kb * B:(kb + 1) * B].T
        assert np.array_equal(part.astype(np.float32).astype(np.float64), part)
        run = a[:, :(kb + 1) * B] @ b[0, :, :(kb + 1) * B].T
        assert np.array_equal(run.astype(np.float32).astype(np.float64), run)


# ---- the kernel ----


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "m,n,k,g,total",
    [
        (1000, 256, 512, 7, 1000),  # sizes sum to M, ragged group starts
        (1000, 384, 1024, 5, 700),  # sum below M: the tail rows are zero
        (777, 256, 768, 6, 1200),  # sum past M: clamped on the device
        (1000, 1856, 2688, 5, 1000),  # Nano FC1 dims: N = 14.5 x 128 (last column tile half empty)
        (777, 2688, 1856, 6, 777),  # Nano FC2 dims: K = 14.5 x 128 (last K block zero-padded)
        (300, 136, 208, 3, 300),  # N, K not multiples of 128 (nor of the 32-column epilogue subtile)
        (5, 128, 128, 2, 5),  # fewer rows than one tile
        (130, 128, 128, 1, 130),  # M not a multiple of 128: one full and one 2-row tile
        (2048, 1536, 4096, 16, 2000),
    ],
)
def test_random(rng, variant, m, n, k, g, total):
    lhs, rhs = operands(rng, m, n, k, g)
    _check(lhs, rhs, _sizes(rng, g, total), variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "sizes",
    [
        [0, 0, 640, 0, 0, 0],  # empty groups around one
        [1, 127, 128, 129, 0, 255],  # every tile-boundary offset
        [192, 64, 65, 63, 191, 65],  # last tiles of 64 / 63 rows (the second warp group skips) and 65 / 127
        [600, 30, 5, 3, 1, 1],  # skewed
        [5000, -3, 0, 7, 2**30, 1],  # giant and negative sizes: clamped, never out of bounds
        [-1, -1, -1, -1, -1, -1],  # nothing: all rows are the tail
    ],
)
def test_group_sizes_zero_skewed_giant_negative(rng, variant, sizes):
    lhs, rhs = operands(rng, 640, 256, 384, 6)
    _check(lhs, rhs, np.array(sizes, np.int64).clip(-(2**31), 2**31 - 1).astype(np.int32), variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_runs_of_skipped_warp_groups_with_deep_k(rng, variant):
    """:data:`gpu_helpers.SKIPPED_WARP_GROUP_RUNS` with 16 K blocks of 128 per tile, more than the
    pipeline has slots: with the warp-group skip built in, a stage read a phase early or
    late shows up as wrong rows or a hang."""
    sizes = list(SKIPPED_WARP_GROUP_RUNS)
    lhs, rhs = operands(rng, sum(sizes) + 50, 512, 2048, len(sizes))
    _check(lhs, rhs, np.array(sizes, np.int32), variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m,n,k,g,sizes", [(700, 384, 1024, 4, [200, 0, 377, 123]), (300, 1856, 2688, 3, [129, 1, 100])])
def test_exact_when_sums_are_exact(rng, variant, m, n, k, g, sizes):
    """Integer data, small power-of-two scales: every scale, row and group mapping and the
    promotion are checked bit for bit (the output is ``bf16(ref)``, round to nearest even)."""
    lhs, rhs = exact_operands(rng, m, n, k, g)
    want, _ = reference_f64(lhs, rhs, sizes)
    got = _run(lhs, rhs, sizes, variant)
    want_bf16 = want.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    bad = got != want_bf16
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{bad.sum()} elements differ; first {i}: got {got[i]}, want {want_bf16[i]}")


@pytest.mark.gpu
@needs_kernels
def test_no_groups_and_no_rows(rng):
    """G = 0: every row is the tail (zeros, no launch); M = 0: an empty result."""
    lhs, rhs = operands(rng, 200, 128, 256, 1)
    empty = FP8BlockTensor(rhs.data[:0], rhs.scale[:0], rhs.axes)
    got = _run(lhs, empty, np.zeros((0,), np.int32))
    assert not got.any()
    lhs0, rhs0 = operands(rng, 0, 128, 256, 2)
    out = _kernel(lhs0, rhs0, jnp.zeros((2,), jnp.int32))
    assert out.shape == (0, 128)


@pytest.mark.gpu
@needs_kernels
def test_nan_block_poisons_only_its_rows(rng):
    """A NaN in one 1 x 128 block of ``x`` (scale byte 0xFF, NaN data) makes that row NaN
    and nothing else (the group's other rows and other groups stay finite)."""
    m, n, k = 256, 128, 512
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[5, 300] = np.nan
    lhs = fp8_block.quantize_fp8_block(jnp.asarray(x), axis=1)
    _, rhs = operands(rng, m, n, k, 2)
    out = np.asarray(_kernel(lhs, rhs, jnp.asarray([100, 156], jnp.int32)).astype(jnp.float32))
    assert np.isnan(out[5]).all()
    assert np.isfinite(np.delete(out, 5, axis=0)).all()


@pytest.mark.gpu
@needs_kernels
def test_small_for_sanitizer(rng):
    """Small and quick: the case compute-sanitizer runs (tools/gpu_check_fp8_block.sh):
    N, K off 128, a group ending mid-tile, the last group overshooting M, an empty group."""
    lhs, rhs = operands(rng, 300, 136, 208, 4)
    for variant in gemm_ffi.grouped_gemm_fp8_block_variants():
        _check(lhs, rhs, [100, 0, 150, 200], variant)
    # N = 264: three 128-column scale blocks, so a 256-wide tile skips the half past N
    # (an off-by-one there would read rhs's scales out of bounds: memcheck sees it).
    lhs, rhs = operands(rng, 160, 264, 256, 2)
    for variant in gemm_ffi.grouped_gemm_fp8_block_variants():
        _check(lhs, rhs, [60, 100], variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("k", [128, 256, 384, 2688])  # 1, 2, 3 and 21 K blocks: odd and even tails
def test_variants_give_the_same_bits(rng, k):
    """1, 2, 3 and 21 K blocks (a mainloop that treats blocks in pairs has odd and even
    tails), ragged and empty groups: each variant within the float64 bands, and all
    variants bitwise equal (each reduces and promotes every K block alike, in order)."""
    lhs, rhs = operands(rng, 700, 264, k, 5)
    sizes = [300, 0, 129, 1, 270]
    names = gemm_ffi.grouped_gemm_fp8_block_variants()
    for v in names:
        _check(lhs, rhs, sizes, v)
    outs = [_run(lhs, rhs, sizes, v) for v in names]
    for v, o in zip(names[1:], outs[1:]):
        np.testing.assert_array_equal(o, outs[0], err_msg=v)


@pytest.mark.gpu
@needs_kernels
def test_handler_rejects_bad_buffers():
    """The C++ handler's own checks (what the binding never lets through): a scale of the
    wrong shape reaches the custom call only by hand, and fails with the argument named."""
    lhs, rhs = operands(np.random.default_rng(0), 64, 128, 256, 2)
    call = jax.ffi.ffi_call(gemm_ffi.GROUPED_GEMM_FP8_BLOCK_TARGET, jax.ShapeDtypeStruct((64, 128), jnp.bfloat16))
    with pytest.raises(Exception, match="lhs_scale must be"):
        jax.block_until_ready(
            call(lhs.data, lhs.scale[:, :1], rhs.data, rhs.scale, jnp.asarray([32, 32], jnp.int32), variant=np.int32(0))
        )
