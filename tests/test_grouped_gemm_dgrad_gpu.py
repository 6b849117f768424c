"""The FC2-dgrad grouped GEMM with the fused dSReLU epilogue (``gemm_ffi.grouped_gemm_dgrad_cuda``)
against the reference composition of ``mlp._mlp_bwd``.

Written before the kernel first ran; it passed on the H200 on 2026-11-30 (docs/notes/2026-11-30-grouped-gemm-kernels.md, "FC2 dgrad epilogue").

For every case (fresh random inputs, outputs poisoned with two byte patterns first):
  * ``da`` = the plain K-major kernel with the same tile width
    (``grouped_gemm_bf16_cuda(dy, w2, gs, transpose_rhs=True)``), then on the GPU the
    reference ops ``r = relu(f32(h))``, ``dh = bf16((f32(da) * (2 * probs)) * r)``,
    ``dprobs = sum(f32(da) * (r * r), axis=1)``;
  * ``dh_row`` equals ``dequantize(quantize_mxfp8(dh, axis=1))`` and ``dh_col`` equals
    ``dequantize(quantize_mxfp8_grouped(dh, group_sizes))`` as bf16 bit patterns in the
    groups' rows (quantizer references on the CPU as in test_fake_quantize_gpu.py: any NaN
    matches any NaN, zero/subnormal pairs may differ); rows past the groups are +0 exactly
    (the reference's ``dh_row`` there is ``bf16(0 * 2p * r)``, a signed zero or NaN: the
    kernel does not read ``h`` or ``probs`` there);
  * ``dprobs`` within ``1e-5 * sum(|da * r * r|)`` of the reference per row (a different
    summation order), 0 exactly past the groups, and bit for bit the same in both runs;
  * the raw partials ``[cdiv(N, tile_n), M]`` are fully written (same bits under both
    poisons) and their in-order sum is the binding's ``dprobs``.
Tests marked ``gpu`` need a Hopper GPU and the built extension; the binding's
validation, its JAX fallback and the lowering are checked without a GPU.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_grouped_mlp._src.cuda import ffi, gemm_ffi
from jax_grouped_mlp._src.cuda.ffi import Unsupported
from jax_grouped_mlp._src.formats import mxfp8
from gpu_helpers import clamped_sizes, has_gpu
from test_fake_quantize_gpu import _assert_same_bits, _reference
from mxfp8_gpu_helpers import _poison

VARIANTS = gemm_ffi.grouped_gemm_dgrad_variants() or ("none",)
needs_kernels = pytest.mark.skipif(
    not (has_gpu() and ffi.available() and gemm_ffi.grouped_gemm_dgrad_variants()),
    reason="needs a GPU and the built extension",
)

_dgrad = jax.jit(gemm_ffi.grouped_gemm_dgrad_cuda, static_argnames="variant")
_plain = jax.jit(gemm_ffi.grouped_gemm_bf16_cuda, static_argnames=("variant", "transpose_rhs"))


@jax.jit
def _reference_ops(da, h, probs):
    """``mlp._mlp_bwd``'s ops after the dgrad GEMM (float32 math), and the rows' |terms| sums."""
    da = da.astype(jnp.float32)
    r = jnp.maximum(h.astype(jnp.float32), 0.0)
    terms = da * (r * r)
    dh = (da * (2.0 * probs[:, None]) * r).astype(jnp.bfloat16)
    return dh, jnp.sum(terms, axis=1), jnp.sum(jnp.abs(terms), axis=1)


def _raw(dy, w2, gs, h, probs, variant: str):
    """The FFI call itself: ``(dh_row, dh_col, dpart)`` with the partials not yet summed."""
    names = gemm_ffi.grouped_gemm_dgrad_variants()
    m, n = h.shape
    nt = -(-n // gemm_ffi.tile_n(variant))
    out = (
        jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((nt, m), jnp.float32),
    )
    fn = jax.jit(
        lambda *a: jax.ffi.ffi_call(gemm_ffi.GROUPED_GEMM_DGRAD_TARGET, out)(*a, variant=np.int32(names.index(variant)))
    )
    return jax.block_until_ready(fn(dy, w2, gs, h, probs))


def _plain_variant(variant: str | None) -> str | None:
    """The bf16 kernel with the same tile (same accumulation order): ``..._bk_dsrelu`` -> ``..._bk``."""
    if variant is None:
        return None
    plain = variant.removesuffix("_dsrelu")
    assert plain.endswith("_bk") and plain in gemm_ffi.grouped_gemm_variants(), plain
    return plain


def _operands(rng, m, n, k, g):
    dy = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((g, n, k), np.float32) / np.sqrt(k), jnp.bfloat16)
    return dy, w2


def _h(rng, m, n) -> np.ndarray:
    """The residual: about half negative (relu kills them), exact +0 and -0, tiny values."""
    h = rng.standard_normal((m, n), np.float32)
    h[rng.random((m, n)) < 0.05] = 0.0
    h[rng.random((m, n)) < 0.05] = -0.0
    h[rng.random((m, n)) < 0.01] *= 1e-30
    return h


def _probs(rng, m) -> np.ndarray:
    """Router weights with zeros and negatives (the kernel must not assume 0 <= p <= 1)."""
    p = rng.uniform(-1.0, 1.0, m).astype(np.float32)
    p[rng.random(m) < 0.1] = 0.0
    p[rng.random(m) < 0.05] *= 1e4
    return p


def _sizes(rng, g, total):
    cuts = np.sort(rng.integers(0, total + 1, size=g - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


def _check_dprobs(got, want, abs_sum, what: str) -> None:
    got, want, abs_sum = (np.asarray(a, np.float32) for a in (got, want, abs_sum))
    finite = np.isfinite(want)
    # Non-finite rows (overflowing terms): the same NaN/Inf.
    np.testing.assert_array_equal(got[~finite], want[~finite], err_msg=f"dprobs (non-finite rows): {what}")
    err = np.abs(got[finite].astype(np.float64) - want[finite])
    tol = 1e-5 * abs_sum[finite].astype(np.float64)
    bad = ~(err <= tol)
    if bad.any():
        i = np.flatnonzero(finite)[np.argmax(bad)]
        raise AssertionError(
            f"dprobs: {bad.sum()} of {finite.sum()} rows off by more than 1e-5 of sum|terms|; first row {i}: "
            f"got {got[i]!r}, want {want[i]!r}, sum|terms| {abs_sum[i]!r} ({what})"
        )


def _check(dy, w2, sizes, h, probs, variant=None) -> None:
    sizes = np.asarray(sizes, np.int64)
    gs = jnp.asarray(sizes.astype(np.int32))
    h = jnp.asarray(h, jnp.bfloat16)
    probs = jnp.asarray(probs, jnp.float32)
    m, n = h.shape
    clamped = clamped_sizes(sizes, m)
    total = int(clamped.sum())
    da = jax.block_until_ready(_plain(dy, w2, gs, variant=_plain_variant(variant), transpose_rhs=True))
    dh, want_dprobs, abs_sum = _reference_ops(da, h, probs)
    want_row = np.asarray(_reference(dh, jnp.asarray(clamped), "row"))
    want_col = np.asarray(_reference(dh, jnp.asarray(clamped), "col"))
    want_dprobs, abs_sum = np.asarray(want_dprobs), np.asarray(abs_sum)
    name = variant or gemm_ffi.default_variant(n, gemm_ffi.grouped_gemm_dgrad_variants())
    nt = -(-n // gemm_ffi.tile_n(name))
    runs = []
    for value in (0x5A, 0xFF):
        what = f"variant {name}, sizes {sizes.tolist()}, poison {value:#x}"
        _poison([(m, 2 * n), (m, 2 * n), (nt, 4 * m)], value)
        dh_row, dh_col, dprobs = jax.block_until_ready(_dgrad(dy, w2, gs, h, probs, variant=variant))
        assert dh_row.dtype == dh_col.dtype == jnp.bfloat16 and dprobs.dtype == jnp.float32
        assert dh_row.shape == dh_col.shape == (m, n) and dprobs.shape == (m,)
        dh_row, dh_col, dprobs = np.asarray(dh_row), np.asarray(dh_col), np.asarray(dprobs)
        _assert_same_bits(dh_row[:total], want_row[:total], f"dh_row: {what}")
        _assert_same_bits(dh_col, want_col, f"dh_col: {what}")
        for label, t in (("dh_row", dh_row), ("dh_col", dh_col)):
            tail = t[total:].view(np.uint16)
            assert not tail.any(), f"{label}: rows past the groups ({total}..{m}) not +0: {what}"
        _check_dprobs(dprobs[:total], want_dprobs[:total], abs_sum[:total], what)
        assert not dprobs[total:].view(np.uint32).any(), f"dprobs: rows past the groups not +0: {what}"
        # The raw partials: every element written, zero past the groups, summed in order.
        _poison([(m, 2 * n), (m, 2 * n), (nt, 4 * m)], value)
        raw_row, raw_col, dpart = (np.asarray(t) for t in _raw(dy, w2, gs, h, probs, name))
        assert dpart.shape == (nt, m)
        assert not dpart[:, total:].view(np.uint32).any(), f"dpart: rows past the groups not +0: {what}"
        acc = dpart[0].copy()
        for t in range(1, nt):
            acc = acc + dpart[t]
        np.testing.assert_array_equal(acc.view(np.uint32), dprobs.view(np.uint32), err_msg=f"sum of dpart: {what}")
        runs.append([dh_row.view(np.uint16), dh_col.view(np.uint16), dprobs.view(np.uint32),
                     raw_row.view(np.uint16), raw_col.view(np.uint16), dpart.view(np.uint32)])
    for r0, r1 in zip(*runs):
        np.testing.assert_array_equal(r0, r1, err_msg="outputs differ between runs/poisons: unwritten bytes, a race "
                                                      "or a non-deterministic sum")


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "m,n,k,g,total",
    [
        (1000, 256, 512, 7, 1000),  # sizes sum to M, ragged group starts
        (1000, 1856, 2688, 5, 700),  # Nano FC2 dgrad dims (N = F = 1856, K = H = 2688), sum below M
        (777, 1856, 512, 6, 1200),  # sum above M (clamped)
        (300, 136, 200, 3, 300),  # N, K not multiples of the tile (nor N of 32)
        (5, 64, 64, 2, 5),  # fewer rows than one tile
        (33, 8, 8, 1, 33),  # N = 8: one vector per row, most of the tile past N
        (2048, 1536, 1024, 16, 2000),
    ],
)
def test_random(rng, variant, m, n, k, g, total):
    dy, w2 = _operands(rng, m, n, k, g)
    _check(dy, w2, _sizes(rng, g, total), _h(rng, m, n), _probs(rng, m), variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_group_sizes_with_zeros_giant_and_negative(rng, variant):
    m, n = 640, 192
    dy, w2 = _operands(rng, m, n, 256, 6)
    h, p = _h(rng, m, n), _probs(rng, m)
    for sizes in (
        [0, 5, 0, 300, 0, 129],  # zeros, short groups, sum below M
        [0, 640, 0, 0, 0, 0],  # one giant group
        [0, 0, 0, 0, 0, 0],  # every row past the groups
        [-5, 70, 0, 900, 4, 4],  # negative counts as zero; overshoot clamped
        [2**31 - 1, 2**31 - 1, 1, 1, 1, 1],  # huge sizes: no int overflow
        [31, 33, 1, 127, 129, 64],  # block tails of every length
        [32, 96, 128, 160, 1, 223],  # block- and tile-aligned starts
        [192, 64, 65, 63, 191, 65],  # last tiles of 64 / 63 rows (the second warp group skips) and 65 / 127
    ):
        _check(dy, w2, sizes, h, p, variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_special_values(rng, variant):
    """h all negative / zero / -0 in whole rows and blocks, huge h (r * r overflows in dprobs),
    NaN and Inf probs in a group and past the groups, non-finite h past the groups."""
    m, n, k, g = 300, 200, 128, 3
    dy, w2 = _operands(rng, m, n, k, g)
    h = _h(rng, m, n)
    h[10] = -np.abs(h[10])  # relu kills the row: dh 0 (signed), dprobs +-0
    h[11] = 0.0
    h[12] = -0.0
    h[32:64, :40] = -1.0  # a whole 32 x 32 column block of zeros in dh
    h[20, 5] = 1e20  # r * r overflows float32: that row's dprobs is +-Inf
    h[200:] = np.where(rng.random((100, n)) < 0.5, np.nan, np.inf)  # past the groups: never read
    p = _probs(rng, m)
    p[13] = np.nan  # a NaN row (and NaN column blocks) in dh
    p[14] = np.inf
    p[250:] = np.nan  # past the groups: never read
    dyn = np.asarray(dy, np.float32)
    dyn[15] = 0.0  # da row of zeros
    _check(jnp.asarray(dyn, jnp.bfloat16), w2, [120, 0, 80], h, p, variant)


@pytest.mark.gpu
@needs_kernels
def test_default_variant_and_zero_rows(rng):
    """Default variant (n192 for N = 1856), M = 0, and the JAX fallback for G = 0 and K = 0."""
    m, n = 200, 1856
    dy, w2 = _operands(rng, m, n, 64, 3)
    h, p = _h(rng, m, n), _probs(rng, m)
    _check(dy, w2, [50, 100, 25], h, p)
    dh_row, dh_col, dprobs = _dgrad(jnp.zeros((0, 64), jnp.bfloat16), w2, jnp.asarray([0, 0, 0], jnp.int32),
                                    jnp.zeros((0, n), jnp.bfloat16), jnp.zeros((0,)))
    assert dh_row.shape == dh_col.shape == (0, n) and dprobs.shape == (0,)
    _check_fallback(jnp.asarray(h, jnp.bfloat16), jnp.asarray(p))


@pytest.mark.gpu
@needs_kernels
def test_small_for_sanitizer(rng):
    """Small and quick: the case compute-sanitizer runs (tools/sanitize_small.py does the same)."""
    dy, w2 = _operands(rng, 300, 136, 200, 4)
    for variant in gemm_ffi.grouped_gemm_dgrad_variants():
        _check(dy, w2, [100, 0, 150, 200], _h(rng, 300, 136), _probs(rng, 300), variant)  # last group overshoots M


@pytest.mark.gpu
@needs_kernels
def test_handler_rejects_bad_buffers():
    m, n, k, g = 64, 64, 64, 2
    dy = jnp.zeros((m, k), jnp.bfloat16)
    w2 = jnp.zeros((g, n, k), jnp.bfloat16)
    gs = jnp.asarray([32, 32], jnp.int32)
    h = jnp.zeros((m, n), jnp.bfloat16)
    p = jnp.zeros((m,), jnp.float32)
    nt = -(-n // gemm_ffi.tile_n(gemm_ffi.grouped_gemm_dgrad_variants()[0]))

    def call(outs, *args):
        fn = jax.jit(lambda *a: jax.ffi.ffi_call(gemm_ffi.GROUPED_GEMM_DGRAD_TARGET, outs)(*a, variant=np.int32(0)))
        return jax.block_until_ready(fn(*args))

    ok = [
        jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((nt, m), jnp.float32),
    ]
    call(tuple(ok), dy, w2, gs, h, p)
    with pytest.raises(Exception, match="dpart"):
        call(tuple(ok[:2] + [jax.ShapeDtypeStruct((nt + 1, m), jnp.float32)]), dy, w2, gs, h, p)
    # A wrong dtype on a typed buffer: XLA's FFI decoder rejects it (by operand position).
    with pytest.raises(Exception, match="Wrong buffer dtype: expected BF16 but got F32"):
        call(tuple([ok[0], jax.ShapeDtypeStruct((m, n), jnp.float32), ok[2]]), dy, w2, gs, h, p)
    with pytest.raises(Exception, match="probs"):
        call(tuple(ok), dy, w2, gs, h, jnp.zeros((m - 1,), jnp.float32))
    with pytest.raises(Exception, match="grouped_gemm_dgrad: h"):
        call(tuple(ok), dy, w2, gs, jnp.zeros((m, n - 8), jnp.bfloat16), p)
    with pytest.raises(Exception, match="group_sizes"):
        call(tuple(ok), dy, w2, jnp.asarray([1, 2, 3], jnp.int32), h, p)
    with pytest.raises(Exception, match="variant"):
        fn = jax.jit(lambda *a: jax.ffi.ffi_call(gemm_ffi.GROUPED_GEMM_DGRAD_TARGET, tuple(ok))(*a, variant=np.int32(7)))
        jax.block_until_ready(fn(dy, w2, gs, h, p))


# ---- no GPU needed ----

needs_extension = pytest.mark.skipif(not gemm_ffi.grouped_gemm_dgrad_variants(), reason="needs the built extension")


@needs_extension
def test_target_is_registered_and_lowers_for_cuda():
    assert gemm_ffi.GROUPED_GEMM_DGRAD_TARGET in ffi.registered_targets()
    names = gemm_ffi.grouped_gemm_dgrad_variants()
    assert all(v.endswith("_bk_dsrelu") for v in names)
    assert sorted(gemm_ffi.tile_n(v) for v in names) == [192, 256]
    for v in names:  # the plain kernel with the same tile exists (the GPU tests' reference)
        assert v.removesuffix("_dsrelu") in gemm_ffi.grouped_gemm_variants()
    m, k, g = 64, 64, 2
    for n, want_tile in ((1856, 192), (4096, 256), (136, 192)):
        dy = jnp.zeros((m, k), jnp.bfloat16)
        w2 = jnp.zeros((g, n, k), jnp.bfloat16)
        gs = jnp.asarray([32, 32], jnp.int32)
        h = jnp.zeros((m, n), jnp.bfloat16)
        p = jnp.zeros((m,), jnp.float32)
        exported = jax.export.export(
            jax.jit(gemm_ffi.grouped_gemm_dgrad_cuda), platforms=["cuda"], disabled_checks=ffi.export_disabled_checks()
        )(dy, w2, gs, h, p)
        text = exported.mlir_module()
        assert gemm_ffi.GROUPED_GEMM_DGRAD_TARGET in text
        want = [i for i, v in enumerate(names) if gemm_ffi.tile_n(v) == want_tile]
        assert any(f"variant = {i} : i32" in text for i in want), text[-2000:]
        nt = -(-n // want_tile)
        assert f"tensor<{nt}x{m}xf32>" in text, text[-2000:]  # the partials
        assert [tuple(a.shape) for a in exported.out_avals] == [(m, n), (m, n), (m,)]
        assert [a.dtype for a in exported.out_avals] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]
    with pytest.raises(ValueError, match="is not one of the compiled"):
        gemm_ffi.grouped_gemm_dgrad_cuda(dy, w2, gs, h, p, variant=gemm_ffi.grouped_gemm_variants()[0])


def _fallback_reference(h, p, gs):
    """What the kernel computes when ``da`` is 0: the reference ops, rows past the groups +0."""
    m, n = h.shape
    r = jnp.maximum(h.astype(jnp.float32), 0.0)
    da = jnp.zeros((m, n), jnp.float32)
    dh = (da * (2.0 * p[:, None]) * r).astype(jnp.bfloat16)
    sizes = clamped_sizes(np.asarray(gs), m)
    valid = np.arange(m) < int(sizes.sum())
    dh = jnp.where(valid[:, None], dh, jnp.zeros((), jnp.bfloat16))
    dprobs = jnp.where(valid, jnp.sum(da * (r * r), axis=1), 0.0)
    row, col = mxfp8.fake_quantize_pair(dh, jnp.asarray(sizes), keep_col_fp8=False)
    return row, col, dprobs


def _check_fallback(h, p):
    m, n = h.shape
    for dy, w2, gs in (
        (jnp.ones((m, 8), jnp.bfloat16), jnp.zeros((0, n, 8), jnp.bfloat16), jnp.zeros((0,), jnp.int32)),
        (jnp.zeros((m, 0), jnp.bfloat16), jnp.zeros((3, n, 0), jnp.bfloat16), jnp.asarray([m // 4, -3, m // 4], jnp.int32)),
        (jnp.zeros((m, 0), jnp.bfloat16), jnp.zeros((2, n, 0), jnp.bfloat16), jnp.asarray([2**31 - 1, 2**31 - 1], jnp.int32)),
    ):
        got = gemm_ffi.grouped_gemm_dgrad_cuda(dy, w2, gs, h, p)
        want = _fallback_reference(h, p, gs)
        for a, b, label in zip(got, want, ("dh_row", "dh_col", "dprobs")):
            assert a.shape == b.shape and a.dtype == b.dtype, (label, a.shape, b.shape)
            bits = np.uint32 if label == "dprobs" else np.uint16
            np.testing.assert_array_equal(np.asarray(a).view(bits), np.asarray(b).view(bits), err_msg=label)
        total = int(clamped_sizes(np.asarray(gs), m).sum())
        for t in got:
            assert not np.asarray(t)[total:].view(np.uint16 if t.dtype == jnp.bfloat16 else np.uint32).any()


@needs_extension
def test_static_empty_cases_are_exact_in_jax():
    """G = 0 and K = 0 never reach the kernel: computed in JAX (runs on the CPU too)."""
    p = jnp.asarray([1.0, -1.0, 0.0, 2.0, np.nan, -3.0, 0.5, 1.0], jnp.float32)
    h = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.bfloat16)
    _check_fallback(h, p)
    # K = 0 with the groups covering row 1 (probs -1): bf16((0 * -2) * r) = -0 (r >= +0), as the
    # reference; row 4 (probs NaN) is NaN; rows past the groups (5..7) +0.
    dh_row, dh_col, dprobs = gemm_ffi.grouped_gemm_dgrad_cuda(
        jnp.zeros((8, 0), jnp.bfloat16), jnp.zeros((1, 16, 0), jnp.bfloat16), jnp.asarray([5], jnp.int32), h, p
    )
    rows = np.asarray(dh_row.astype(jnp.float32))
    assert np.signbit(rows[1]).all() and not rows[1].any()
    assert np.isnan(rows[4]).all() and np.isnan(np.asarray(dh_col.astype(jnp.float32))[4]).all()
    assert not np.asarray(dh_row)[5:].view(np.uint16).any() and not np.asarray(dprobs)[5:].view(np.uint32).any()


def _ok_operands(m=16, k=64, n=32, g=2):
    return (jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((g, n, k), jnp.bfloat16), jnp.zeros((g,), jnp.int32),
            jnp.zeros((m, n), jnp.bfloat16), jnp.zeros((m,), jnp.float32))


@pytest.mark.parametrize(
    "mutate,exc,needle",
    [
        (lambda dy, w, gs, h, p: (dy.astype(jnp.float32), w, gs, h, p), Unsupported, "dy_row.dtype"),
        (lambda dy, w, gs, h, p: (dy[0], w, gs, h, p), ValueError, "dy_row must be [M, K]"),
        (lambda dy, w, gs, h, p: (dy, w[0], gs, h, p), ValueError, "w2 must be [G, N, K]"),
        (lambda dy, w, gs, h, p: (dy, w.astype(jnp.float32), gs, h, p), Unsupported, "w2.dtype"),
        (lambda dy, w, gs, h, p: (dy[:, :32], w, gs, h, p), ValueError, "contraction mismatch"),
        (lambda dy, w, gs, h, p: (dy, jnp.swapaxes(w, 1, 2), gs, h, p), ValueError, "contraction mismatch"),
        (lambda dy, w, gs, h, p: (dy, w, gs[:1], h, p), TypeError, "group_sizes"),
        (lambda dy, w, gs, h, p: (dy, w, gs.astype(jnp.float32), h, p), TypeError, "group_sizes"),
        (lambda dy, w, gs, h, p: (dy, w, gs, h[:, :8], p), ValueError, "h must be [M, N]"),
        (lambda dy, w, gs, h, p: (dy, w, gs, h[:8], p), ValueError, "h must be [M, N]"),
        (lambda dy, w, gs, h, p: (dy, w, gs, h.astype(jnp.float32), p), Unsupported, "h.dtype"),
        (lambda dy, w, gs, h, p: (dy, w, gs, h, p[:, None]), ValueError, "probs must be [M]"),
        (lambda dy, w, gs, h, p: (dy, w, gs, h, p[:8]), ValueError, "probs must be [M]"),
        (lambda dy, w, gs, h, p: (dy, w, gs, h, p.astype(jnp.int32)), TypeError, "probs.dtype"),
    ],
)
def test_binding_validation_names_the_argument(mutate, exc, needle):
    args = mutate(*_ok_operands())
    with pytest.raises(exc, match=re.escape(needle)):
        gemm_ffi.grouped_gemm_dgrad_cuda(*args)


def test_binding_validation_shapes():
    with pytest.raises(Unsupported, match="multiples of 8"):
        gemm_ffi.grouped_gemm_dgrad_cuda(*_ok_operands(n=12))
    with pytest.raises(Unsupported, match="multiples of 8"):
        gemm_ffi.grouped_gemm_dgrad_cuda(*_ok_operands(k=12))
