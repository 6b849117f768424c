"""The CUDA ``fp8_block`` quantize kernels: bit for bit the pure-JAX quantizers.

``quantize_pair_cuda(x, gs, keep_col)`` must give ``quantize_fp8_block(x, 1)`` (data and
scales byte for byte) and ``quantize_fp8_block(x, 0, group_sizes=gs)`` (``keep_col``) or
its bf16 dequantization; ``quantize_weight_cuda(w)`` must give
``quantize_fp8_block(w, (1, 2))`` and ``quantize_row_cuda(x)`` ``quantize_fp8_block(x, 1)``. The references run on the GPU through XLA (the FP8
tests of the MXFP8 kernels do the same: the CPU flushes float32 subnormals). Outputs are
poisoned with two patterns first, so an element the kernel forgets to write shows up as
a difference. Shapes cover K off the 128 grid, M off 128, empty and skewed groups,
sizes that are negative or sum past M, and non-finite values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_grouped_mlp._src.cuda import ffi, fp8_block_ffi, gemm_ffi
from jax_grouped_mlp._src.formats import fp8_block
from jax_grouped_mlp._src.op import primitives
from gpu_helpers import has_gpu
from mxfp8_gpu_helpers import _bytes, _poison, _random, _sizes
from test_fake_quantize_gpu import _assert_same_bits, _special

needs_kernels = pytest.mark.skipif(
    not (has_gpu() and ffi.available() and fp8_block_ffi.pair_variants() and fp8_block_ffi.single_variants()),
    reason="needs a GPU and the built extension",
)
_pair = jax.jit(fp8_block_ffi.quantize_pair_cuda, static_argnames="keep_col")
_weight = jax.jit(fp8_block_ffi.quantize_weight_cuda)
_row = jax.jit(fp8_block_ffi.quantize_row_cuda)
_ref_pair = jax.jit(
    lambda x, gs: (fp8_block.quantize_fp8_block(x, 1), fp8_block.quantize_fp8_block(x, 0, group_sizes=gs))
)
_ref_weight = jax.jit(lambda w: fp8_block.quantize_fp8_block(w, (1, 2)))
_weight_t = jax.jit(functools.partial(fp8_block_ffi.quantize_weight_cuda, k_major=True))
_ref_weight_t = jax.jit(lambda w: fp8_block.transpose_tiles(fp8_block.quantize_fp8_block(w, (1, 2))))


def _assert_same_fp8(got: fp8_block.FP8BlockTensor, want: fp8_block.FP8BlockTensor, what: str) -> None:
    """Byte equality of data and scales (a NaN byte matches a NaN byte of either sign)."""
    assert got.axes == want.axes and got.data.shape == want.data.shape and got.scale.shape == want.scale.shape, what
    gd, wd = _bytes(got.data), _bytes(want.data)
    nan = lambda b: (b & 0x7F) == 0x7F  # noqa: E731
    both_nan = nan(gd) & nan(wd)
    for name, g, w in (("data", np.where(both_nan, 0, gd), np.where(both_nan, 0, wd)),
                       ("scale", _bytes(got.scale), _bytes(want.scale))):
        if not np.array_equal(g, w):
            bad = np.argwhere(g != w)
            i = tuple(bad[0])
            raise AssertionError(f"{what} {name}: {len(bad)} of {g.size} bytes differ; first {i}: "
                                 f"got {g[i]:#04x}, want {w[i]:#04x}")


def _check_pair(x, sizes, keep_col: bool) -> None:
    x = jnp.asarray(x, jnp.bfloat16)
    gs = jnp.asarray(np.asarray(sizes, np.int32))
    m, k = x.shape
    want_row, want_col = _ref_pair(x, gs)
    nb = fp8_block.grouped_scale_rows(m, gs.shape[0])
    shapes = [(m, k), (m, -(-k // 128)), (m, k * (1 if keep_col else 2)), (nb, k)]
    for value in (0x5A, 0xFF):
        _poison([s for s in shapes if all(s)], value)
        row, col = jax.block_until_ready(_pair(x, gs, keep_col=keep_col))
        what = f"pair keep_col={keep_col} {x.shape} sizes={list(sizes)[:6]} (poison {value:#x})"
        _assert_same_fp8(row, want_row, what + " row")
        if keep_col:
            assert col.is_grouped
            _assert_same_fp8(col, want_col, what + " col")
        else:
            _assert_same_bits(col, fp8_block.dequantize_fp8_block(want_col, jnp.bfloat16), what + " col")


_SHAPES = [(256, 256, 4, 256), (1000, 520, 7, 900), (77, 2056, 3, 77), (300, 40, 5, 400), (33, 8, 1, 33),
           (1500, 1856, 16, 1500)]


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("keep_col", [False, True])
@pytest.mark.parametrize("m,k,g,total", _SHAPES)
def test_pair_random(rng, keep_col, m, k, g, total):
    _check_pair(_random(rng, m, k), _sizes(rng, m, g, total), keep_col)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("keep_col", [False, True])
def test_pair_group_sizes_and_special_values(rng, keep_col):
    x = _special(rng)
    for sizes in ([50, 0, 60, 18], [128], [0, 5, 0, 33], [-5, 70, 0, 300], [0, 0], [100, 2**30]):
        _check_pair(x, sizes, keep_col)
    skewed = np.asarray([1000, 0, 3, 0, 0, 200, 1, 296], np.int32)  # 1500 rows, one big group
    _check_pair(_random(rng, 1500, 264), skewed, keep_col)
    _check_pair(np.zeros((0, 64), np.float32), [0, 0], keep_col)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("shape", [(4, 2688 // 8, 1856 // 8), (3, 100, 72), (2, 256, 384), (1, 0, 64)])
def test_weight_tiles(rng, shape):
    _check_weight(rng, shape, _weight, _ref_weight, (shape[0] * shape[1], shape[2]), "weight")


def _check_weight(rng, shape, fn, ref, data_shape, what: str) -> None:
    """``fn`` (a weight quantizer binding) against ``ref`` byte for byte on a random
    ``shape`` weight, its ``data_shape`` data and the scales poisoned twice first."""
    g, a, b = shape
    w = jnp.asarray(_random(rng, g * a, b).reshape(shape) / 64, jnp.bfloat16)
    want = ref(w)
    for value in (0x5A, 0xFF):
        _poison([data_shape, (fp8_block.grouped_scale_rows(g * a, g), -(-b // 128))], value)
        _assert_same_fp8(jax.block_until_ready(fn(w)), want, f"{what} {shape} (poison {value:#x})")


@pytest.mark.gpu
@needs_kernels
def test_weight_special_values(rng):
    w = jnp.asarray(np.stack([_special(rng), _random(rng, 128, 128)]), jnp.bfloat16)
    _assert_same_fp8(_weight(w), _ref_weight(w), "weight with NaN, Inf, zero and subnormal tiles")


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("shape", [(4, 2688 // 8, 1856 // 8), (3, 144, 72), (2, 256, 384), (5, 240, 2688 // 8),
                                   (1, 16, 8)])
def test_weight_tiles_k_major(rng, shape):
    """Mode "tile_t": the transposed tiles ``[G, B, A]`` byte for byte, A and B off 128
    (partial tiles: nothing written past A or B), two poisons."""
    _check_weight(rng, shape, _weight_t, _ref_weight_t, (shape[0] * shape[2], shape[1]), "weight k_major")


@pytest.mark.gpu
@needs_kernels
def test_weight_k_major_special_values_and_fallback(rng):
    """NaN / Inf / zero / subnormal tiles transposed; A % 16 != 0 or A == 0 is not the
    kernel's (Unsupported), and the primitive then transposes the kernel's tiles by XLA:
    the same bytes."""
    w = jnp.asarray(np.stack([_special(rng), _random(rng, 128, 128)]), jnp.bfloat16)
    _assert_same_fp8(_weight_t(w), _ref_weight_t(w), "weight k_major with NaN, Inf, zero and subnormal tiles")
    for shape in ((3, 100, 72), (1, 0, 64)):
        w = jnp.asarray(_random(rng, shape[0] * shape[1], shape[2]).reshape(shape), jnp.bfloat16)
        with pytest.raises(ffi.Unsupported, match="A % 16 == 0"):
            fp8_block_ffi.quantize_weight_cuda(w, k_major=True)
        got = jax.jit(functools.partial(primitives.fp8_block_weight, k_major=True))(w)
        _assert_same_fp8(got, _ref_weight_t(w), f"primitive k_major fallback {shape}")
    # The handler's own check, reached only by hand: data as stored is not the transposed shape.
    x = jnp.asarray(_random(rng, 256, 128), jnp.bfloat16)
    variant = np.int32(fp8_block_ffi.single_variants().index("quantize_fp8_block_tile_t_v8_t128"))
    call = jax.ffi.ffi_call(fp8_block_ffi.TARGET, (jax.ShapeDtypeStruct((256, 128), jnp.float8_e4m3fn),
                                                   jax.ShapeDtypeStruct((4, 1), jnp.float8_e8m0fnu)))
    with pytest.raises(Exception, match=r"data must be \[G \* K, M / G\]"):
        jax.block_until_ready(call(x, jnp.asarray([64] * 4, jnp.int32), variant=variant))


_pair_tm = jax.jit(fp8_block_ffi.quantize_pair_token_major_cuda)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("m,k,sizes", [
    (600, 144, [100, 0, 300, 29]),  # K off 128 (one partial column block), a group ending mid-block
    (640, 256, [5000, -3, 0, 7, 2**30, 1]),  # giant and negative sizes: clamped; blocks past the groups
    (300, 2688, [128, 1, 171]),  # Nano's K; block-boundary sizes
    (77, 8, [77]),  # one column chunk
    (300, 72, [100, 0, 200]),  # K % 16 == 8: a half chunk at the end (the op's dy at H = 72)
    (0, 128, [0, 0]),  # no rows: all zero
])
def test_pair_token_major(rng, m, k, sizes):
    """Mode "pair_tm": the rowwise copy as "pair" writes it, and the group-aware copy's
    bytes as ``fp8_block.token_major_blocks`` lays them out (every byte: two poisons),
    scales as the group-aware tensor's; and the FP8 weight gradient on that layout gives
    the bits of the layout-from-``[M, K]`` entry."""
    x = jnp.asarray(_random(rng, m, k), jnp.bfloat16)
    gs = jnp.asarray(np.asarray(sizes, np.int64).clip(-(2**31), 2**31 - 1).astype(np.int32))
    want_row, want_col = _ref_pair(x, gs)
    want_data, _ = fp8_block.token_major_blocks(want_col)
    nb = fp8_block.grouped_scale_rows(m, gs.shape[0])
    for value in (0x5A, 0xFF):
        _poison([s for s in ((m, k), (m, -(-k // 128)), (k, 128 * nb), (nb, k)) if all(s)], value)
        row, tm = jax.block_until_ready(_pair_tm(x, gs))
        data, scale = tm.data, tm.scale
        what = f"pair_tm {x.shape} sizes={sizes} (poison {value:#x})"
        assert tm.rows == m and np.array_equal(np.asarray(tm.group_sizes), np.asarray(want_col.group_sizes)), what
        _assert_same_fp8(row, want_row, what + " row")
        np.testing.assert_array_equal(_bytes(data), _bytes(want_data), err_msg=what + " token-major data")
        np.testing.assert_array_equal(_bytes(scale), _bytes(want_col.scale), err_msg=what + " scale")
    if m:
        # The weight gradient on the token-major copies (both, or one of each) gives the
        # bits of the [M, K] entry's (which lays both out itself).
        dy = jnp.asarray(_random(rng, m, 64), jnp.bfloat16)
        _, dy_tm = _pair_tm(dy, gs)
        dy_col = _ref_pair(dy, gs)[1]
        wgrad = jax.jit(gemm_ffi.grouped_wgrad_fp8_block)
        want = np.asarray(wgrad(want_col, dy_col, gs)).view(np.uint16)
        for lhs, rhs in ((tm, dy_tm), (want_col, dy_tm), (tm, dy_col)):
            got = np.asarray(wgrad(lhs, rhs, gs)).view(np.uint16)
            np.testing.assert_array_equal(got, want, err_msg=f"{what}: wgrad {type(lhs).__name__} x {type(rhs).__name__}")


@pytest.mark.gpu
@needs_kernels
def test_primitives_lower_to_the_kernels(rng):
    """The recipe's quantizers lower to the kernels for bf16 and to the reference for float32."""
    x = jnp.asarray(_random(rng, 200, 256), jnp.bfloat16)
    gs = jnp.asarray([64, 0, 100], jnp.int32)
    w = jnp.asarray(_random(rng, 256, 128).reshape(2, 128, 128), jnp.bfloat16)
    for keep in (False, True):
        text = jax.jit(lambda x, gs: primitives.fp8_block_pair(x, gs, keep_col=keep)).lower(x, gs).as_text()
        assert fp8_block_ffi.PAIR_TARGET in text
    assert fp8_block_ffi.TARGET in jax.jit(lambda x: primitives.fp8_block_quantize(x, 1)).lower(x).as_text()
    assert fp8_block_ffi.TARGET in jax.jit(primitives.fp8_block_weight).lower(w).as_text()
    k_major = jax.jit(functools.partial(primitives.fp8_block_weight, k_major=True))
    assert fp8_block_ffi.TARGET in k_major.lower(w).as_text()
    assert fp8_block_ffi.TARGET not in jax.jit(primitives.fp8_block_weight).lower(w.astype(jnp.float32)).as_text()


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("m,k", [(256, 256), (1000, 520), (77, 2056), (33, 8), (0, 64)])
def test_row_alone(rng, m, k):
    """The rowwise copy alone (a forward without gradient), with poisoned outputs."""
    x = jnp.asarray(_random(rng, m, k), jnp.bfloat16)
    want = jax.jit(lambda x: fp8_block.quantize_fp8_block(x, 1))(x)
    for value in (0x5A, 0xFF):
        _poison([s for s in ((m, k), (m, -(-k // 128))) if all(s)], value)
        _assert_same_fp8(jax.block_until_ready(_row(x)), want, f"row {x.shape} (poison {value:#x})")
    x = jnp.asarray(_special(rng), jnp.bfloat16)
    _assert_same_fp8(_row(x), jax.jit(lambda x: fp8_block.quantize_fp8_block(x, 1))(x), "row, special values")
