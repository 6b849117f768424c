"""The grouped GEMM with MXFP8 weights converted in the kernel (``jgm_grouped_gemm_w8``).

Tests marked ``gpu`` need an NVIDIA Hopper GPU and the built extension. The oracle is
twofold: **bitwise** equality with the bf16 kernel of the same tile width on
``dequantize(rhs)`` (same MMA inputs, same accumulation order: any conversion error,
race or missed stage shows up as a differing bit), and the float64 reference within the
bound of tests/test_grouped_gemm_gpu.py. Outputs are poisoned before every run.

The CPU tests at the end check the binding's trace-time validation (no GPU, no extension).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_grouped_mlp._src.cuda import ffi, gemm_ffi
from jax_grouped_mlp._src.formats import mxfp8
from jax_grouped_mlp._src.formats.mxfp8 import MXFP8Tensor
from gpu_helpers import has_gpu

needs_kernels = pytest.mark.skipif(
    not (has_gpu() and ffi.available() and gemm_ffi.grouped_gemm_w8_variants()),
    reason="needs a GPU and the built extension",
)

_w8 = jax.jit(gemm_ffi.grouped_gemm_w8_cuda, static_argnames=("variant", "transpose_rhs"))
_bf16 = jax.jit(gemm_ffi.grouped_gemm_bf16_cuda, static_argnames=("variant", "transpose_rhs"))
_dequant = jax.jit(lambda t: mxfp8.dequantize(t, jnp.bfloat16))

VARIANTS = gemm_ffi.grouped_gemm_w8_variants() or ("none",)


def _poison(m: int, n: int, value: int) -> None:
    """Fills freed device memory of the output's size with ``value`` bytes (see test_grouped_gemm_gpu)."""
    buf = jnp.full((m, n * 2), value, jnp.uint8)
    jax.block_until_ready(buf)
    del buf


def _bf16_twin(variant: str) -> str:
    """The bf16 kernel variant with the same tile width and B layout (same accumulation order)."""
    tn = gemm_ffi.tile_n(variant)
    bk = variant.endswith("_bk")
    pat = re.compile(rf"grouped_gemm_sm90_bf16_m128n{tn}k64_s\d+" + ("_bk" if bk else "") + "$")
    return next(v for v in gemm_ffi.grouped_gemm_variants() if pat.match(v))


def _sizes(rng, g, total):
    cuts = np.sort(rng.integers(0, total + 1, size=g - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


def _quantized_weight(
    rng, g, k, n, k_major: bool, *, random_bytes: bool = False, scales: tuple[int, int] = (110, 140)
) -> MXFP8Tensor:
    """MXFP8 weight blocked along K: ``[G, K, N]`` (axis 1) or ``[G, N, K]`` (axis 2).

    ``random_bytes``: every finite E4M3 byte (subnormals included) and scale bytes in
    ``scales`` (default [110, 140]: 2^-17 .. 2^13), instead of quantizing a Gaussian weight.
    """
    shape = (g, n, k) if k_major else (g, k, n)
    axis = 2 if k_major else 1
    if not random_bytes:
        w = jnp.asarray(rng.standard_normal(shape) / np.sqrt(k), jnp.bfloat16)
        return mxfp8.quantize_mxfp8(w, axis=axis)
    data = rng.integers(0, 256, size=shape, dtype=np.uint8)
    data[(data & 0x7F) == 0x7F] = 0x3C  # no E4M3 NaN in the data
    sshape = list(shape)
    sshape[axis] = -(-k // 32)
    scale = rng.integers(scales[0], scales[1] + 1, size=sshape, dtype=np.uint8)
    return MXFP8Tensor(
        jax.lax.bitcast_convert_type(jnp.asarray(data), jnp.float8_e4m3fn),
        jax.lax.bitcast_convert_type(jnp.asarray(scale), jnp.float8_e8m0fnu),
        axis,
    )


def _reference(a, wq: MXFP8Tensor, sizes, k_major: bool) -> np.ndarray:
    """float64 ``a @ dequantize(w)`` per (clamped) group; rows past the groups zero."""
    w = np.asarray(mxfp8.dequantize(wq, jnp.float32), np.float64)
    if k_major:
        w = np.swapaxes(w, 1, 2)
    a = np.asarray(a.astype(jnp.float32), np.float64)
    m = a.shape[0]
    out = np.zeros((m, w.shape[2]))
    start = 0
    for gi, s in enumerate(np.asarray(sizes, np.int64)):
        s = int(min(max(s, 0), m - start))
        out[start:start + s] = a[start:start + s] @ w[gi]
        start += s
    return out


def _run(fn, m, n, *args, **kw) -> np.ndarray:
    """Runs ``fn`` after poisoning with NaN and with a huge finite value; both runs must agree."""
    runs = []
    for value in (0xFF, 0x7F):
        _poison(m, n, value)
        out = fn(*args, **kw)
        runs.append(np.asarray(jax.block_until_ready(out).astype(jnp.float32)))
    np.testing.assert_array_equal(runs[0], runs[1], err_msg="output differs between poisons: unwritten elements or a race")
    return runs[0]


def _check(a, wq: MXFP8Tensor, group_sizes, variant: str, *, expect_finite: bool = True) -> np.ndarray:
    k_major = variant.endswith("_bk")
    gs = jnp.asarray(np.asarray(group_sizes, np.int32))
    m = a.shape[0]
    n = wq.data.shape[1] if k_major else wq.data.shape[2]
    got = _run(_w8, m, n, a, wq, gs, variant=variant, transpose_rhs=k_major)
    twin = _run(_bf16, m, n, a, _dequant(wq), gs, variant=_bf16_twin(variant), transpose_rhs=k_major)
    if not np.array_equal(got, twin, equal_nan=True):
        diff = ~((got == twin) | (np.isnan(got) & np.isnan(twin)))
        i = tuple(np.argwhere(diff)[0])
        raise AssertionError(
            f"{diff.sum()} outputs differ from the bf16 kernel on dequantize(rhs); first {i}: "
            f"{got[i]} vs {twin[i]} ({variant})"
        )
    ends = np.clip(np.cumsum(np.maximum(np.asarray(group_sizes, np.int64), 0)), 0, m)
    total = int(ends[-1]) if len(ends) else 0
    assert not got[total:].any(), f"rows past sum(group_sizes)={total} are not zero"
    if expect_finite:
        assert not np.isnan(got).any(), f"{np.isnan(got).sum()} NaN outputs"
        want = _reference(a, wq, group_sizes, k_major)
        err = np.abs(got - want)
        norm = np.linalg.norm(want)
        if norm:
            assert np.linalg.norm(err) / norm <= 5e-3, f"relative error {np.linalg.norm(err) / norm:.2e} ({variant})"
        rowscale = np.abs(want).max(axis=1, keepdims=True) + 1e-30
        bad = err > 2.0**-7 * np.abs(want) + 1e-3 * rowscale
        assert not bad.any(), f"{bad.sum()} elements off the float64 reference ({variant})"
    return got


def _lhs(rng, m, k):
    return jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "m,n,k,g,total",
    [
        (1000, 256, 512, 7, 1000),  # sizes sum to M, ragged group starts
        (1000, 1856, 2688, 5, 700),  # Nano FC1 dims (N not a tile multiple), sum below M
        (777, 2688, 1856, 6, 1200),  # Nano FC2 dims, sum above M (clamped)
        (300, 144, 208, 3, 300),  # N, K multiples of 16 only; K not a multiple of 32 (partial scale block)
        (5, 64, 64, 2, 5),  # fewer rows than one tile
        (2048, 1536, 4096, 16, 2000),
    ],
)
def test_random(rng, variant, m, n, k, g, total):
    k_major = variant.endswith("_bk")
    a = _lhs(rng, m, k)
    _check(a, _quantized_weight(rng, g, k, n, k_major), _sizes(rng, g, total), variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "scales",
    [
        (110, 140),  # 2^-17..2^13: batches of both decode paths (fast: every scale byte <= 134)
        (100, 134),  # fast path only
        (120, 254),  # mostly the exact path; Inf/NaN outputs (compared bitwise with the twin)
    ],
)
def test_every_e4m3_byte_and_wide_scales(rng, variant, scales):
    """All finite E4M3 codes (subnormals too) and a range of scale bytes: the decode is exact."""
    k_major = variant.endswith("_bk")
    a = _lhs(rng, 600, 320)
    wq = _quantized_weight(rng, 4, 320, 208, k_major, random_bytes=True, scales=scales)
    _check(a, wq, _sizes(rng, 4, 600), variant, expect_finite=scales[1] <= 140)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_nan_byte_poisons_its_column_only(rng, variant, byte):
    """An E4M3 NaN byte (0x7F / 0xFF) with a finite scale: the fast decode's probe must
    send its batch to the exact path, so exactly that column of that group is NaN."""
    k_major = variant.endswith("_bk")
    m, n, k, g = 400, 192, 256, 3
    a = _lhs(rng, m, k)
    wq = _quantized_weight(rng, g, k, n, k_major)
    d = np.array(jax.lax.bitcast_convert_type(wq.data, jnp.uint8))
    col, grp, row = 101, 2, 37
    if k_major:
        d[grp, col, row] = byte
    else:
        d[grp, row, col] = byte
    wq = MXFP8Tensor(jax.lax.bitcast_convert_type(jnp.asarray(d), jnp.float8_e4m3fn), wq.scale, wq.axis)
    sizes = [100, 150, 150]
    got = _check(a, wq, sizes, variant, expect_finite=False)
    want = np.zeros(got.shape, bool)
    want[250:400, col] = True
    np.testing.assert_array_equal(np.isnan(got), want)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_group_sizes_with_zeros_giant_and_negative(rng, variant):
    k_major = variant.endswith("_bk")
    a = _lhs(rng, 640, 256)
    wq = _quantized_weight(rng, 6, 256, 192, k_major)
    _check(a, wq, [0, 5, 0, 300, 0, 129], variant)  # zeros, short groups, sum below M
    _check(a, wq, [0, 640, 0, 0, 0, 0], variant)  # one giant group
    _check(a, wq, [0, 0, 0, 0, 0, 0], variant)  # every row past the groups
    _check(a, wq, [-5, 70, 0, 900, 4, 4], variant)  # negative counts as zero; overshoot clamped
    _check(a, wq, [2**31 - 1, 2**31 - 1, 1, 1, 1, 1], variant)  # huge sizes: no int overflow


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_nan_scale_poisons_its_block_only(rng, variant):
    """E8M0 0xFF: the block's 32 weights are NaN, so exactly that column of that group is NaN."""
    k_major = variant.endswith("_bk")
    m, n, k, g = 400, 192, 256, 3
    a = _lhs(rng, m, k)
    wq = _quantized_weight(rng, g, k, n, k_major)
    e = np.array(jax.lax.bitcast_convert_type(wq.scale, jnp.uint8))
    col, grp, blk = 77, 1, 5
    if k_major:
        e[grp, col, blk] = 0xFF
    else:
        e[grp, blk, col] = 0xFF
    wq = MXFP8Tensor(wq.data, jax.lax.bitcast_convert_type(jnp.asarray(e), jnp.float8_e8m0fnu), wq.axis)
    sizes = [100, 150, 150]
    got = _check(a, wq, sizes, variant, expect_finite=False)
    nan = np.isnan(got)
    want = np.zeros_like(nan)
    want[100:250, col] = True
    np.testing.assert_array_equal(nan, want)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_zero_scale_byte_is_two_to_minus_127(rng, variant):
    """E8M0 byte 0 is 2^-127, not zero: tiny but exact (compared with float64, not bitwise:
    the products are float32 subnormals, which other code paths may flush)."""
    k_major = variant.endswith("_bk")
    m, n, k, g = 256, 128, 128, 2
    a = _lhs(rng, m, k)
    wq = _quantized_weight(rng, g, k, n, k_major)
    zeros = jax.lax.bitcast_convert_type(jnp.zeros(wq.scale.shape, jnp.uint8), jnp.float8_e8m0fnu)
    wq = MXFP8Tensor(wq.data, zeros, wq.axis)
    a = a * jnp.asarray(2.0**100, jnp.bfloat16)  # bring the products back to normal range
    gs = jnp.asarray([128, 128], jnp.int32)
    got = _run(_w8, m, n, a, wq, gs, variant=variant, transpose_rhs=k_major)
    want = _reference(a, wq, [128, 128], k_major)
    assert np.isfinite(got).all() and np.abs(want).max() > 0
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel <= 5e-3, rel


def _exact_dequantize_bf16(wq: MXFP8Tensor) -> jax.Array:
    """``bf16(e4m3 * 2**(e - 127))`` on the host: the float64 product (exact, and exact in
    float32: 4 significant bits, >= 2**-136) rounded once to bf16 with subnormals kept, so
    unlike ``mxfp8.dequantize`` under XLA it never flushes."""
    d = np.asarray(jax.lax.bitcast_convert_type(wq.data, jnp.uint8)).view(ml_dtypes.float8_e4m3fn)
    e = np.asarray(jax.lax.bitcast_convert_type(wq.scale, jnp.uint8)).astype(np.float64)
    e = np.repeat(e, 32, axis=wq.axis)
    e = np.take(e, np.arange(d.shape[wq.axis]), axis=wq.axis)
    v = d.astype(np.float64) * np.exp2(e - 127.0)
    return jnp.asarray(v.astype(np.float32).astype(ml_dtypes.bfloat16))


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_scales_bitwise(rng, variant):
    """Scale bytes 0..8 with every finite E4M3 code: the fast decode's bf16 results are
    subnormal for scale bytes <= 6 (``mul.rn.bf16x2`` must neither flush nor misround
    them). Bitwise against the bf16 twin on the host's exact dequantization (XLA's
    dequantize may flush these float32 subnormals, see test_w8_decode)."""
    k_major = variant.endswith("_bk")
    m, n, k, g = 256, 208, 320, 2
    a = _lhs(rng, m, k) * jnp.asarray(2.0**100, jnp.bfloat16)  # products back in normal range
    wq = _quantized_weight(rng, g, k, n, k_major, random_bytes=True, scales=(0, 8))
    gs = jnp.asarray([100, 156], jnp.int32)
    got = _run(_w8, m, n, a, wq, gs, variant=variant, transpose_rhs=k_major)
    twin = _run(_bf16, m, n, a, _exact_dequantize_bf16(wq), gs, variant=_bf16_twin(variant), transpose_rhs=k_major)
    assert np.isfinite(got).all() and np.abs(got).max() > 0
    diff = got != twin
    assert not diff.any(), f"{diff.sum()} outputs differ from the bf16 kernel on the exact dequantization ({variant})"


@pytest.mark.gpu
@needs_kernels
def test_no_groups_and_zero_rows(rng):
    wq = _quantized_weight(rng, 2, 64, 64, False)
    a = _lhs(rng, 100, 64)
    empty = MXFP8Tensor(wq.data[:0], wq.scale[:0], 1)
    out = _w8(a, empty, jnp.zeros((0,), jnp.int32))
    assert out.shape == (100, 64) and not np.asarray(out.astype(jnp.float32)).any()
    assert _w8(jnp.zeros((0, 64), jnp.bfloat16), wq, jnp.asarray([0, 0])).shape == (0, 64)


@pytest.mark.gpu
@needs_kernels
def test_handler_rejects_bad_buffers():
    a = jnp.zeros((64, 64), jnp.bfloat16)
    data = jnp.zeros((2, 64, 64), jnp.float8_e4m3fn)
    scale = jnp.zeros((2, 2, 64), jnp.uint8)
    gs = jnp.asarray([32, 32], jnp.int32)
    target = gemm_ffi.GROUPED_GEMM_W8_TARGET

    def call(out_shape, *args):
        f = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, jnp.bfloat16))
        return jax.block_until_ready(jax.jit(lambda *x: f(*x, variant=np.int32(0)))(*args))

    with pytest.raises(Exception, match="out"):
        call((64, 32), a, data, scale, gs)
    with pytest.raises(Exception, match="rhs_scale"):
        call((64, 64), a, data, jnp.zeros((2, 3, 64), jnp.uint8), gs)
    with pytest.raises(Exception, match="group_sizes"):
        call((64, 64), a, data, scale, jnp.asarray([1, 2, 3], jnp.int32))
    with pytest.raises(Exception, match="rhs must be"):
        call((64, 64), a, data.astype(jnp.bfloat16), scale, gs)
    with pytest.raises(Exception, match="variant"):
        f = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((64, 64), jnp.bfloat16))
        jax.block_until_ready(jax.jit(lambda *x: f(*x, variant=np.int32(99)))(a, data, scale, gs))


@pytest.mark.gpu
@needs_kernels
def test_small_for_sanitizer(rng):
    """Small and quick: every variant once on a ragged case whose last group overshoots M."""
    a = _lhs(rng, 300, 208)
    for variant in gemm_ffi.grouped_gemm_w8_variants():
        _check(a, _quantized_weight(rng, 4, 208, 144, variant.endswith("_bk")), [100, 0, 150, 200], variant)


# ---- CPU: lowering and the binding's validation ----


@pytest.mark.skipif(not gemm_ffi.grouped_gemm_w8_variants(), reason="needs the built extension")
def test_target_is_registered_and_lowers_for_cuda():
    """No GPU needed: the custom call lowers for CUDA; ``transpose_rhs`` picks a "_bk" variant."""
    assert gemm_ffi.GROUPED_GEMM_W8_TARGET in ffi.registered_targets()
    a = jnp.zeros((64, 128), jnp.bfloat16)
    gs = jnp.asarray([32, 32], jnp.int32)
    names = gemm_ffi.grouped_gemm_w8_variants()
    for transpose in (False, True):
        w = jnp.zeros((2, 96, 128) if transpose else (2, 128, 96), jnp.bfloat16)
        wq = mxfp8.quantize_mxfp8(w, axis=2 if transpose else 1)
        fn = jax.jit(lambda a, w, gs, t=transpose: gemm_ffi.grouped_gemm_w8_cuda(a, w, gs, transpose_rhs=t))
        text = jax.export.export(fn, platforms=["cuda"], disabled_checks=ffi.export_disabled_checks())(a, wq, gs).mlir_module()
        assert gemm_ffi.GROUPED_GEMM_W8_TARGET in text
        ok = [i for i, v in enumerate(names) if v.endswith("_bk") == transpose]
        assert any(f"variant = {i} : i32" in text for i in ok), text[-2000:]


def _ok_operands(transpose=False, k=64, n=32, g=2):
    a = jnp.zeros((16, k), jnp.bfloat16)
    w = jnp.zeros((g, n, k) if transpose else (g, k, n), jnp.bfloat16)
    return a, mxfp8.quantize_mxfp8(w, axis=2 if transpose else 1), jnp.zeros((g,), jnp.int32)


@pytest.mark.parametrize(
    "mutate,exc,needle",
    [
        (lambda a, w, gs: (a, mxfp8.dequantize(w), gs), TypeError, "rhs must be an MXFP8Tensor"),
        (lambda a, w, gs: (a.astype(jnp.float32), w, gs), TypeError, "lhs.dtype"),
        (lambda a, w, gs: (a[0], w, gs), ValueError, "lhs must be"),
        (lambda a, w, gs: (a[:, :32], w, gs), ValueError, "contraction mismatch"),
        (lambda a, w, gs: (a, mxfp8.quantize_mxfp8(mxfp8.dequantize(w), axis=2), gs), ValueError, "rhs.axis"),
        (lambda a, w, gs: (a, MXFP8Tensor(w.data, w.scale[:, :1], 1), gs), ValueError, "rhs.scale must have shape"),
        (lambda a, w, gs: (a, MXFP8Tensor(w.data.astype(jnp.bfloat16), w.scale, 1), gs), TypeError, "rhs.data.dtype"),
        (lambda a, w, gs: (a, MXFP8Tensor(w.data, w.scale.astype(jnp.float32), 1), gs), TypeError, "rhs.scale.dtype"),
        (lambda a, w, gs: (a, w, gs[:1]), TypeError, "group_sizes"),
        (lambda a, w, gs: (a, w, gs.astype(jnp.float32)), TypeError, "group_sizes"),
    ],
)
def test_binding_validation_names_the_argument(mutate, exc, needle):
    a, w, gs = mutate(*_ok_operands())
    with pytest.raises(exc, match=re.escape(needle)):
        gemm_ffi.grouped_gemm_w8_cuda(a, w, gs)


def test_binding_validation_shapes_and_layouts():
    a, w, gs = _ok_operands(n=24)  # N not a multiple of 16
    with pytest.raises(ValueError, match="multiples of 16"):
        gemm_ffi.grouped_gemm_w8_cuda(a, w, gs)
    a, w, gs = _ok_operands(transpose=True, n=64)
    with pytest.raises(ValueError, match="rhs.axis"):  # a [G, N, K] weight given without transpose_rhs
        gemm_ffi.grouped_gemm_w8_cuda(a, w, gs)
    a, w, gs = _ok_operands(transpose=False)
    with pytest.raises(ValueError, match="contraction mismatch"):
        gemm_ffi.grouped_gemm_w8_cuda(a, w, gs, transpose_rhs=True)
    grouped = mxfp8.quantize_mxfp8_grouped(jnp.zeros((64, 32), jnp.bfloat16), jnp.asarray([64], jnp.int32))
    with pytest.raises(ValueError, match="group-aware"):
        gemm_ffi.grouped_gemm_w8_cuda(a, grouped, gs)
