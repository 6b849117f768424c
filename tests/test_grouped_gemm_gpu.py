"""The Hopper grouped GEMM kernel (FFI custom call) against ``reference.ragged_matmul``.

Tests marked ``gpu`` need an NVIDIA Hopper GPU and the built extension
(``python tools/build_kernels.py``; docs/gpu.md has the commands).

Error bound: the kernel multiplies bf16 operands exactly and sums in fp32 (as does the
reference, in another order), then rounds once to bf16. So the relative error of each
output is about one bf16 rounding (2^-9); we ask ``|out - ref| / |ref| <= 5e-3`` in
norm and per element ``|out - ref| <= 2^-7 |ref| + 1e-6 * rowscale`` (accumulation-order
differences on cancelling sums). Rows past the groups must be exact zeros, and no NaN
may survive the poisoning of the output buffer (every element written).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_grouped_mlp._src.cuda import ffi, gemm_ffi
from jax_grouped_mlp._src.cuda.ffi import Unsupported
from jax_grouped_mlp._src.formats import mxfp8
from jax_grouped_mlp._src.op import primitives, reference
from gpu_helpers import SKIPPED_WARP_GROUP_RUNS, has_gpu, poison_freed


needs_kernels = pytest.mark.skipif(
    not (has_gpu() and ffi.available() and gemm_ffi.grouped_gemm_variants()),
    reason="needs a GPU and the built extension",
)

_kernel = jax.jit(gemm_ffi.grouped_gemm_bf16_cuda, static_argnames=("variant", "transpose_rhs"))
_reference = jax.jit(
    lambda a, b, gs: reference.ragged_matmul(a.astype(jnp.float32), b.astype(jnp.float32), gs)
)


def _operands(rng, m, n, k, g):
    a = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((g, k, n), np.float32) / np.sqrt(k), jnp.bfloat16)
    return a, b


def _sizes(rng, g, total):
    cuts = np.sort(rng.integers(0, total + 1, size=g - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


def _check(a, b, group_sizes, variant=None) -> None:
    """``b`` is ``[G, K, N]``; a K-major ("_bk") variant gets it transposed, as stored ``[G, N, K]``."""
    k_major = bool(variant) and variant.endswith("_bk")
    b_in = jnp.swapaxes(b, 1, 2) if k_major else b
    gs = jnp.asarray(np.asarray(group_sizes, np.int32))
    m, n = a.shape[0], b.shape[2]
    # The kernel clamps on the device; the oracle gets the clamped sizes (its int32
    # cumsum would overflow on the huge-size case).
    ends = np.clip(np.cumsum(np.maximum(np.asarray(group_sizes, np.int64), 0)), 0, m)
    clamped = np.diff(np.concatenate([[0], ends])).astype(np.int32)
    total = int(ends[-1]) if len(ends) else 0
    want = np.asarray(_reference(a, b, jnp.asarray(clamped)), np.float64)
    runs = []
    for value in (0xFF, 0x7F):  # NaN, then a huge finite value
        poison_freed(m * n * 2, value=value)  # (the bf16 [m, n] output)
        out = _kernel(a, b_in, gs, variant=variant, transpose_rhs=k_major)
        runs.append(np.asarray(jax.block_until_ready(out).astype(jnp.float32), np.float64))
    np.testing.assert_array_equal(runs[0], runs[1], err_msg="output differs between poisons: unwritten elements or a race")
    got = runs[0]
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} NaN outputs (unwritten elements?)"
    assert not got[total:].any(), f"rows past sum(group_sizes)={total} are not zero"
    err = np.abs(got - want)
    ref_norm = np.linalg.norm(want)
    if ref_norm:
        rel = np.linalg.norm(err) / ref_norm
        assert rel <= 5e-3, f"relative error {rel:.2e} (variant {variant})"
    rowscale = np.abs(want).max(axis=1, keepdims=True) + 1e-30
    bad = err > 2.0**-7 * np.abs(want) + 1e-3 * rowscale
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{bad.sum()} elements off; first {i}: got {got[i]}, want {want[i]} (variant {variant})")


VARIANTS = gemm_ffi.grouped_gemm_variants() or ("none",)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "m,n,k,g,total",
    [
        (1000, 256, 512, 7, 1000),  # sizes sum to M, ragged group starts
        (1000, 1856, 2688, 5, 700),  # Nano FC1 dims (N 64-aligned), sum below M
        (777, 2688, 1856, 6, 1200),  # Nano FC2 dims, sum above M (clamped)
        (300, 136, 200, 3, 300),  # N, K not multiples of the tile (TMA zero fill + masks)
        (5, 64, 64, 2, 5),  # fewer rows than one tile
        (2048, 1536, 4096, 16, 2000),
    ],
)
def test_random(rng, variant, m, n, k, g, total):
    a, b = _operands(rng, m, n, k, g)
    _check(a, b, _sizes(rng, g, total), variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_group_sizes_with_zeros_giant_and_negative(rng, variant):
    a, b = _operands(rng, 640, 192, 256, 6)
    _check(a, b, [0, 5, 0, 300, 0, 129], variant)  # zeros, short groups, sum below M
    _check(a, b, [0, 640, 0, 0, 0, 0], variant)  # one giant group
    _check(a, b, [0, 0, 0, 0, 0, 0], variant)  # every row past the groups
    _check(a, b, [-5, 70, 0, 900, 4, 4], variant)  # negative counts as zero; overshoot clamped
    _check(a, b, [2**31 - 1, 2**31 - 1, 1, 1, 1, 1], variant)  # huge sizes: no int overflow


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_partial_tiles_at_the_warp_group_boundary(rng, variant):
    """Last tiles of 64, 63, 1 valid rows (the second consumer warp group skips its
    wgmmas) next to 65, 127, 128 (it does not), at group starts that are and are not
    multiples of 64."""
    a, b = _operands(rng, 1100, 192, 320, 9)
    _check(a, b, [64, 192, 1, 129, 65, 63, 127, 0, 320], variant)
    _check(a, b, [200, 64, 64, 1, 191, 300, 65, 100, 0], variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_runs_of_skipped_warp_groups_with_deep_k(rng, variant):
    """:data:`gpu_helpers.SKIPPED_WARP_GROUP_RUNS` with 16 K stages of 64 per tile, more than the
    pipeline has slots: with the warp-group skip built in, a stage read a phase early or
    late shows up as wrong rows or a hang."""
    sizes = list(SKIPPED_WARP_GROUP_RUNS)
    a, b = _operands(rng, sum(sizes) + 50, 512, 1024, len(sizes))
    _check(a, b, sizes, variant)


@pytest.mark.gpu
@needs_kernels
def test_no_groups_and_empty_k(rng):
    a, b = _operands(rng, 100, 64, 64, 2)
    out = _kernel(a, jnp.zeros((0, 64, 64), jnp.bfloat16), jnp.zeros((0,), jnp.int32))
    assert out.shape == (100, 64) and not np.asarray(out.astype(jnp.float32)).any()
    out = _kernel(jnp.zeros((100, 0), jnp.bfloat16), jnp.zeros((2, 0, 64), jnp.bfloat16), jnp.asarray([50, 50]))
    assert not np.asarray(out.astype(jnp.float32)).any()
    assert _kernel(jnp.zeros((0, 64), jnp.bfloat16), b, jnp.asarray([0, 0])).shape == (0, 64)


@pytest.mark.gpu
@needs_kernels
def test_mxfp8_operands_through_the_adapter(rng):
    """MXFP8 in, dequantized to bf16 exactly: same as the reference on the dequantized values."""
    m, n, k, g = 512, 320, 384, 4
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
    xq = mxfp8.quantize_mxfp8(x, axis=1)
    wq = mxfp8.quantize_mxfp8(w, axis=1)
    gs = jnp.asarray(_sizes(rng, g, 450))
    got = jax.jit(lambda a, b, s: gemm_ffi.grouped_gemm_cuda(a, b, s, out_dtype=jnp.bfloat16))(xq, wq, gs)
    a, b = mxfp8.dequantize(xq, jnp.bfloat16), mxfp8.dequantize(wq, jnp.bfloat16)
    _check(a, b, np.asarray(gs))
    want = _reference(a, b, gs)
    rel = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
    assert rel <= 5e-3, rel
    # Outputs other than bf16: the adapter says Unsupported, the dispatcher runs the reference.
    with pytest.raises(Unsupported, match="out_dtype"):
        gemm_ffi.grouped_gemm_cuda(xq, wq, gs, out_dtype=jnp.float32)
    f32 = primitives.grouped_gemm(xq, wq, gs, jnp.float32)
    assert f32.dtype == jnp.float32


@pytest.mark.gpu
@needs_kernels
def test_small_for_sanitizer(rng):
    """Small and quick: the case compute-sanitizer runs (docs/gpu.md)."""
    a, b = _operands(rng, 300, 136, 200, 4)
    for variant in gemm_ffi.grouped_gemm_variants():
        _check(a, b, [100, 0, 150, 200], variant)  # last group overshoots M


@pytest.mark.gpu
@needs_kernels
def test_handler_rejects_bad_buffers():
    a = jnp.zeros((64, 64), jnp.bfloat16)
    b = jnp.zeros((2, 64, 64), jnp.bfloat16)
    gs = jnp.asarray([32, 32], jnp.int32)
    out = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)

    def call(results, gs):
        fn = lambda a, b, gs: jax.ffi.ffi_call(gemm_ffi.GROUPED_GEMM_TARGET, results)(a, b, gs, variant=np.int32(0))
        jax.block_until_ready(jax.jit(fn)(a, b, gs))

    with pytest.raises(Exception, match="out"):
        call((jax.ShapeDtypeStruct((64, 32), jnp.bfloat16), gemm_ffi.TILE_COUNTER), gs)
    with pytest.raises(Exception, match="group_sizes"):
        call((out, gemm_ffi.TILE_COUNTER), jnp.asarray([1, 2, 3], jnp.int32))
    with pytest.raises(Exception, match="tile_counter"):
        call((out, jax.ShapeDtypeStruct((2,), jnp.int32)), gs)
    with pytest.raises(Unsupported, match="multiples of 8"):
        gemm_ffi.grouped_gemm_bf16_cuda(jnp.zeros((4, 12), jnp.bfloat16), jnp.zeros((2, 12, 8), jnp.bfloat16), gs)


@pytest.mark.skipif(not gemm_ffi.grouped_gemm_variants(), reason="needs the built extension")
def test_target_is_registered_and_lowers_for_cuda():
    """No GPU needed: the custom call lowers for CUDA wherever the extension loads."""
    assert gemm_ffi.GROUPED_GEMM_TARGET in ffi.registered_targets()
    a = jnp.zeros((64, 64), jnp.bfloat16)
    b = jnp.zeros((2, 64, 64), jnp.bfloat16)
    gs = jnp.asarray([32, 32], jnp.int32)
    exported = jax.export.export(
        jax.jit(gemm_ffi.grouped_gemm_bf16_cuda), platforms=["cuda"], disabled_checks=ffi.export_disabled_checks()
    )(a, b, gs)
    assert gemm_ffi.GROUPED_GEMM_TARGET in exported.mlir_module()


def test_default_variant_prefers_least_padding():
    if not gemm_ffi.grouped_gemm_variants():
        pytest.skip("needs the built extension")
    assert gemm_ffi.tile_n(gemm_ffi.default_variant(4096)) == 256
    assert gemm_ffi.tile_n(gemm_ffi.default_variant(1856)) == 192  # 1920 columns, not 2048


def test_transposed_rhs_lowers_to_a_k_major_variant():
    """No GPU needed: ``transpose_rhs`` picks a "_bk" variant and no transpose is lowered."""
    if not gemm_ffi.grouped_gemm_variants():
        pytest.skip("needs the built extension")
    a = jnp.zeros((64, 128), jnp.bfloat16)
    w = jnp.zeros((2, 96, 128), jnp.bfloat16)  # [G, N, K]
    gs = jnp.asarray([32, 32], jnp.int32)
    fn = jax.jit(lambda a, w, gs: gemm_ffi.grouped_gemm_bf16_cuda(a, w, gs, transpose_rhs=True))
    text = jax.export.export(fn, platforms=["cuda"], disabled_checks=ffi.export_disabled_checks())(a, w, gs).mlir_module()
    assert "stablehlo.transpose" not in text
    names = gemm_ffi.grouped_gemm_variants()
    bk = [i for i, v in enumerate(names) if v.endswith("_bk")]
    assert any(f"variant = {i} : i32" in text for i in bk), text[-2000:]
    with pytest.raises(ValueError, match="contraction mismatch"):
        gemm_ffi.grouped_gemm_bf16_cuda(a, jnp.swapaxes(w, 1, 2), gs, transpose_rhs=True)
