"""The FC1-epilogue grouped GEMM (``gemm_ffi.grouped_gemm_fc1_cuda``) against the plain
kernel and the reference quantizers, bit for bit.

Written before the kernel first ran; it passed on the H200 on 2026-11-30 (docs/notes/2026-11-30-grouped-gemm-kernels.md, "FC1 epilogue").

For every case (fresh random inputs, outputs poisoned with two byte patterns first):
  * ``h`` equals the plain kernel's output with the same tile width, bit for bit;
  * ``a_row`` equals ``dequantize(quantize_mxfp8(a, axis=1))`` with
    ``a = primitives.srelu_scaled(h, probs)``, as bf16 bit patterns (reference on the CPU; any
    NaN matches any NaN, and where both are zero or subnormal they may differ: the CPU
    flushes subnormal float32 results, see test_fake_quantize_gpu.py);
  * ``a_col`` (data and scales) equals ``quantize_mxfp8_grouped(a, group_sizes)`` byte for
    byte (reference run on the GPU, as in test_fake_quantize_gpu.py; E4M3 NaN of either
    sign matches), with the group sizes clamped as the kernel clamps them.
Tests marked ``gpu`` need a Hopper GPU and the built extension; the binding's
validation and the lowering are checked without a GPU.
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
from jax_grouped_mlp._src.op.activation import srelu_scaled as _srelu_scaled
from gpu_helpers import clamped_sizes, has_gpu
from test_fake_quantize_gpu import _assert_same_bits
from mxfp8_gpu_helpers import _assert_same, _poison

VARIANTS = gemm_ffi.grouped_gemm_fc1_variants() or ("none",)
needs_kernels = pytest.mark.skipif(
    not (has_gpu() and ffi.available() and gemm_ffi.grouped_gemm_fc1_variants()),
    reason="needs a GPU and the built extension",
)

_fc1 = jax.jit(gemm_ffi.grouped_gemm_fc1_cuda, static_argnames="variant")
_plain = jax.jit(gemm_ffi.grouped_gemm_bf16_cuda, static_argnames=("variant", "transpose_rhs"))
_srelu = jax.jit(_srelu_scaled)
_col_reference = jax.jit(mxfp8.quantize_mxfp8_grouped)


def _cpu(fn, *args):
    cpu = jax.devices("cpu")[0]
    return jax.jit(fn)(*jax.device_put(args, cpu))


def _row_reference(a):
    return _cpu(lambda a: mxfp8.dequantize(mxfp8.quantize_mxfp8(a, axis=1), jnp.bfloat16), a)


def _plain_variant(variant: str | None) -> str | None:
    """The bf16 kernel with the same tile (same accumulation order): ``..._fc1`` -> ``...``."""
    if variant is None:
        return None
    plain = variant.removesuffix("_fc1")
    assert plain in gemm_ffi.grouped_gemm_variants(), plain
    return plain


def _operands(rng, m, n, k, g):
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n), np.float32) / np.sqrt(k), jnp.bfloat16)
    return x, w


def _probs(rng, m) -> np.ndarray:
    """Router weights with zeros and negatives (the kernel must not assume 0 <= p <= 1)."""
    p = rng.uniform(-1.0, 1.0, m).astype(np.float32)
    p[rng.random(m) < 0.1] = 0.0
    p[rng.random(m) < 0.05] *= 1e4
    return p


def _sizes(rng, g, total):
    cuts = np.sort(rng.integers(0, total + 1, size=g - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


def _check(x, w, sizes, probs, variant=None) -> None:
    sizes = np.asarray(sizes, np.int64)
    gs = jnp.asarray(sizes.astype(np.int32))
    probs = jnp.asarray(probs, jnp.float32)
    m, n, g = x.shape[0], w.shape[2], w.shape[0]
    nb = mxfp8.grouped_scale_rows(m, g)
    h_want = jax.block_until_ready(_plain(x, w, gs, variant=_plain_variant(variant)))
    a = _srelu(h_want, probs)
    want_row = _row_reference(a)
    want_col = _col_reference(a, jnp.asarray(clamped_sizes(sizes, m)))
    runs = []
    for value in (0x5A, 0xFF):
        _poison([(m, 2 * n), (m, 2 * n), (m, n), (nb, n)], value)
        h, a_row, a_col = jax.block_until_ready(_fc1(x, w, gs, probs, variant=variant))
        what = f"variant {variant}, sizes {sizes.tolist()}, poison {value:#x}"
        np.testing.assert_array_equal(
            np.asarray(h).view(np.uint16), np.asarray(h_want).view(np.uint16), err_msg=f"h: {what}"
        )
        _assert_same_bits(a_row, want_row, f"a_row: {what}")
        assert isinstance(a_col, mxfp8.MXFP8Tensor) and a_col.axis == 0 and a_col.group_sizes is not None
        assert a_col.data.dtype == jnp.float8_e4m3fn and a_col.scale.dtype == jnp.float8_e8m0fnu
        assert a_col.scale.shape == (nb, n), a_col.scale.shape
        np.testing.assert_array_equal(np.asarray(a_col.group_sizes), clamped_sizes(sizes, m))  # the binding clamps them
        _assert_same(a_col, want_col, f"a_col: {what}")
        runs.append([np.asarray(t).view(np.uint8) for t in (a_row, a_col.data, a_col.scale)])
    for r0, r1 in zip(*runs):
        np.testing.assert_array_equal(r0, r1, err_msg="outputs differ between poisons: unwritten bytes or a race")


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "m,n,k,g,total",
    [
        (1000, 256, 512, 7, 1000),  # sizes sum to M, ragged group starts
        (1000, 1856, 2688, 5, 700),  # Nano FC1 dims (N 64-aligned, not 128), sum below M
        (777, 1856, 512, 6, 1200),  # sum above M (clamped)
        (300, 136, 200, 3, 300),  # N, K not multiples of the tile (nor N of 32)
        (5, 64, 64, 2, 5),  # fewer rows than one tile
        (33, 8, 8, 1, 33),  # N = 8: one vector per row, most of the tile past N
        (2048, 1536, 1024, 16, 2000),
    ],
)
def test_random(rng, variant, m, n, k, g, total):
    x, w = _operands(rng, m, n, k, g)
    _check(x, w, _sizes(rng, g, total), _probs(rng, m), variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_group_sizes_with_zeros_giant_and_negative(rng, variant):
    m = 640
    x, w = _operands(rng, m, 192, 256, 6)
    p = _probs(rng, m)
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
        _check(x, w, sizes, p, variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_special_values(rng, variant):
    """Rows whose srelu overflows (h**2 -> Inf; 0 * Inf -> NaN), NaN and Inf probs, zero rows."""
    m, n, k, g = 300, 200, 128, 3
    x, w = _operands(rng, m, n, k, g)
    xs = np.asarray(x, np.float32)
    xs[7] *= 1e20  # h ~ 1e20: h**2 overflows float32
    # Group 2's row 125 lies in group 0's last 128-row tile (rows 120..127 past its end,
    # probs 0 there): 0 * Inf = NaN must not reach group 0's block 3 (the column pass's row mask).
    xs[125] *= 1e20
    xs[32:72] = 0.0  # a whole column block of zeros (block 1 = rows 32..63 of group 0) and more
    xs[100:103] *= 1e-30  # tiny h: a underflows
    x = jnp.asarray(xs, jnp.bfloat16)
    p = _probs(rng, m)
    p[7] = 0.0 if rng.random() < 0.5 else -2.0
    p[150] = np.nan
    p[151] = np.inf
    p[299] = np.inf  # a row past the groups: its a_row is p * 0 = NaN
    _check(x, w, [120, 0, 170], p, variant)


@pytest.mark.gpu
@needs_kernels
def test_default_variant_and_zero_rows(rng):
    """Default variant (n192 for N = 1856), M = 0 (scale rows still cleared), G = 0 and K = 0."""
    x, w = _operands(rng, 200, 1856, 64, 3)
    _check(x, w, [50, 100, 25], _probs(rng, 200))
    h, a_row, a_col = _fc1(jnp.zeros((0, 64), jnp.bfloat16), w, jnp.asarray([0, 0, 0], jnp.int32), jnp.zeros((0,)))
    assert h.shape == (0, 1856) and a_col.scale.shape == (3, 1856)
    assert not np.asarray(a_col.scale).view(np.uint8).any()
    p = jnp.asarray(_probs(rng, 200))
    for xx, ww, gs in (
        (x, jnp.zeros((0, 64, 1856), jnp.bfloat16), jnp.zeros((0,), jnp.int32)),
        (jnp.zeros((200, 0), jnp.bfloat16), jnp.zeros((3, 0, 1856), jnp.bfloat16), jnp.asarray([50, 50, 50], jnp.int32)),
    ):
        h, a_row, a_col = _fc1(xx, ww, gs, p)
        assert not np.asarray(h.astype(jnp.float32)).any()
        want_row, want_col = mxfp8.fake_quantize_pair(_srelu_scaled(h, p), gs, keep_col_fp8=True)
        _assert_same_bits(a_row, want_row, "a_row, G = 0 or K = 0")
        _assert_same(a_col, want_col, "a_col, G = 0 or K = 0")


@pytest.mark.gpu
@needs_kernels
def test_small_for_sanitizer(rng):
    """Small and quick: the case compute-sanitizer runs (tools/sanitize_small.py does the same)."""
    x, w = _operands(rng, 300, 136, 200, 4)
    for variant in gemm_ffi.grouped_gemm_fc1_variants():
        _check(x, w, [100, 0, 150, 200], _probs(rng, 300), variant)  # last group overshoots M


@pytest.mark.gpu
@needs_kernels
def test_handler_rejects_bad_buffers():
    x = jnp.zeros((64, 64), jnp.bfloat16)
    w = jnp.zeros((2, 64, 64), jnp.bfloat16)
    gs = jnp.asarray([32, 32], jnp.int32)
    p = jnp.zeros((64,), jnp.float32)
    nb = mxfp8.grouped_scale_rows(64, 2)

    def call(outs, *args):
        fn = jax.jit(lambda *a: jax.ffi.ffi_call(gemm_ffi.GROUPED_GEMM_FC1_TARGET, outs)(*a, variant=np.int32(0)))
        return jax.block_until_ready(fn(*args))

    ok = [
        jax.ShapeDtypeStruct((64, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((64, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((64, 64), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((nb, 64), jnp.float8_e8m0fnu),
    ]
    call(tuple(ok), x, w, gs, p)
    bad_scale = ok[:3] + [jax.ShapeDtypeStruct((nb - 1, 64), jnp.float8_e8m0fnu)]
    with pytest.raises(Exception, match="a_col_scale"):
        call(tuple(bad_scale), x, w, gs, p)
    with pytest.raises(Exception, match="probs"):
        call(tuple(ok), x, w, gs, jnp.zeros((63,), jnp.float32))
    with pytest.raises(Exception, match="group_sizes"):
        call(tuple(ok), x, w, jnp.asarray([1, 2, 3], jnp.int32), p)


# ---- no GPU needed ----


@pytest.mark.skipif(not gemm_ffi.grouped_gemm_fc1_variants(), reason="needs the built extension")
def test_target_is_registered_and_lowers_for_cuda():
    assert gemm_ffi.GROUPED_GEMM_FC1_TARGET in ffi.registered_targets()
    x = jnp.zeros((64, 64), jnp.bfloat16)
    w = jnp.zeros((2, 64, 1856), jnp.bfloat16)
    gs = jnp.asarray([32, 32], jnp.int32)
    p = jnp.zeros((64,), jnp.float32)
    exported = jax.export.export(
        jax.jit(gemm_ffi.grouped_gemm_fc1_cuda), platforms=["cuda"], disabled_checks=ffi.export_disabled_checks()
    )(x, w, gs, p)
    text = exported.mlir_module()
    assert gemm_ffi.GROUPED_GEMM_FC1_TARGET in text
    names = gemm_ffi.grouped_gemm_fc1_variants()
    n192 = [i for i, v in enumerate(names) if gemm_ffi.tile_n(v) == 192]
    assert any(f"variant = {i} : i32" in text for i in n192), text[-2000:]
    with pytest.raises(ValueError, match="is not one of the compiled"):
        gemm_ffi.grouped_gemm_fc1_cuda(x, w, gs, p, variant=gemm_ffi.grouped_gemm_variants()[0])


@pytest.mark.skipif(not gemm_ffi.grouped_gemm_fc1_variants(), reason="needs the built extension")
def test_static_empty_cases_are_exact_in_jax():
    """G = 0 and K = 0 never reach the kernel: computed in JAX (runs on the CPU too)."""
    p = jnp.asarray([1.0, -1.0, 0.0, 2.0], jnp.float32)
    for x, w, gs in (
        (jnp.ones((4, 8), jnp.bfloat16), jnp.zeros((0, 8, 16), jnp.bfloat16), jnp.zeros((0,), jnp.int32)),
        (jnp.zeros((4, 0), jnp.bfloat16), jnp.zeros((2, 0, 16), jnp.bfloat16), jnp.asarray([3, 1], jnp.int32)),
    ):
        h, a_row, a_col = gemm_ffi.grouped_gemm_fc1_cuda(x, w, gs, p)
        assert h.shape == a_row.shape == a_col.data.shape == (4, 16)
        assert a_col.scale.shape == (mxfp8.grouped_scale_rows(4, gs.shape[0]), 16)
        assert not np.asarray(h.astype(jnp.float32)).any()
        assert np.signbit(np.asarray(a_row.astype(jnp.float32))[1]).all()  # bf16(-1 * 0) = -0


def _ok_operands(m=16, k=64, n=32, g=2):
    return (jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((g, k, n), jnp.bfloat16), jnp.zeros((g,), jnp.int32),
            jnp.zeros((m,), jnp.float32))


@pytest.mark.parametrize(
    "mutate,exc,needle",
    [
        (lambda x, w, gs, p: (x.astype(jnp.float32), w, gs, p), Unsupported, "x.dtype"),
        (lambda x, w, gs, p: (x[0], w, gs, p), ValueError, "x must be [M, K]"),
        (lambda x, w, gs, p: (x, w[0], gs, p), ValueError, "w1 must be [G, K, N]"),
        (lambda x, w, gs, p: (x, w.astype(jnp.float32), gs, p), Unsupported, "w1.dtype"),
        (lambda x, w, gs, p: (x[:, :32], w, gs, p), ValueError, "contraction mismatch"),
        (lambda x, w, gs, p: (x, w, gs[:1], p), TypeError, "group_sizes"),
        (lambda x, w, gs, p: (x, w, gs.astype(jnp.float32), p), TypeError, "group_sizes"),
        (lambda x, w, gs, p: (x, w, gs, p[:, None]), ValueError, "probs must be [M]"),
        (lambda x, w, gs, p: (x, w, gs, p[:8]), ValueError, "probs must be [M]"),
        (lambda x, w, gs, p: (x, w, gs, p.astype(jnp.int32)), TypeError, "probs.dtype"),
    ],
)
def test_binding_validation_names_the_argument(mutate, exc, needle):
    x, w, gs, p = mutate(*_ok_operands())
    with pytest.raises(exc, match=re.escape(needle)):
        gemm_ffi.grouped_gemm_fc1_cuda(x, w, gs, p)


def test_binding_validation_shapes():
    with pytest.raises(Unsupported, match="multiples of 8"):
        gemm_ffi.grouped_gemm_fc1_cuda(*_ok_operands(n=12))
    with pytest.raises(Unsupported, match="multiples of 8"):
        gemm_ffi.grouped_gemm_fc1_cuda(*_ok_operands(k=12))
