"""The FP8 block-scaled GEMM with the FC1 epilogue (``fp8_block_fc1_ffi.grouped_gemm_fp8_block_fc1``,
kernel ``kernels/grouped_gemm_fp8_block_fc1_sm90.py``) against the unfused kernels, bit for bit.

For every case (fresh random inputs; every output poisoned with two byte patterns first,
and both runs must agree byte for byte, so no byte is left unwritten):
  * ``h`` equals the plain FP8 block-scaled GEMM's output (``gemm_ffi.grouped_gemm_fp8_block``,
    same tile width, so the same accumulation order), bit for bit;
  * ``a_row`` and ``a_col`` (data and scales) equal the pair quantizer's
    (``fp8_block_ffi.quantize_pair_cuda``) of ``a = srelu_scaled(h, probs)``, byte for
    byte; that kernel is itself bitwise the pure-JAX quantizers
    (tests/test_quantize_fp8_block_gpu.py);
  * ``a_col``'s scale rows that no group uses are zero, and its data is zero on rows past
    the groups.
Group sizes: ragged, with empty groups, summing below M (rows past the groups) and past M
(clamped), giant and negative. ``probs`` with zeros, negatives and large values.
Tests marked ``gpu`` need a Hopper GPU and the built extension; the binding's validation
runs anywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_grouped_mlp._src.cuda import ffi, fp8_block_fc1_ffi, fp8_block_ffi, gemm_ffi
from jax_grouped_mlp._src.cuda.ffi import Unsupported
from jax_grouped_mlp._src.formats import fp8_block
from jax_grouped_mlp._src.op.activation import srelu_scaled
from gpu_helpers import clamped_sizes, has_gpu
from mxfp8_gpu_helpers import _poison

VARIANTS = fp8_block_fc1_ffi.variants() or ("none",)
needs_kernels = pytest.mark.skipif(
    not (has_gpu() and ffi.available() and fp8_block_fc1_ffi.variants()),
    reason="needs a GPU and the built extension",
)

_fc1 = jax.jit(fp8_block_fc1_ffi.grouped_gemm_fp8_block_fc1, static_argnames="variant")
_plain = jax.jit(gemm_ffi.grouped_gemm_fp8_block, static_argnames="variant")
_pair = jax.jit(lambda a, gs: fp8_block_ffi.quantize_pair_cuda(a, gs, keep_col=True))
_srelu = jax.jit(srelu_scaled)


def _operands(rng, m, n, k, g):
    """``x [M, K]`` in 1 x 128 blocks (rows spread over 2^+-4) and ``w1`` as the forward GEMM
    reads it, ``[G, N, K]`` in 128 x 128 tiles."""
    x = rng.standard_normal((m, k)) * np.exp2(rng.integers(-4, 4, size=(m, 1)))
    w = rng.standard_normal((g, k, n)) / np.sqrt(k)
    lhs = fp8_block.quantize_fp8_block(jnp.asarray(x, jnp.bfloat16), axis=1)
    rhs = fp8_block.transpose_tiles(fp8_block.quantize_fp8_block(jnp.asarray(w, jnp.bfloat16), axis=(1, 2)))
    return lhs, rhs


def _probs(rng, m) -> jax.Array:
    """Router weights with zeros, negatives and large values (the kernel assumes nothing)."""
    p = rng.uniform(-1.0, 1.0, m).astype(np.float32)
    p[rng.random(m) < 0.1] = 0.0
    p[rng.random(m) < 0.05] *= 1e4
    return jnp.asarray(p)


def _sizes(rng, g, total):
    cuts = np.sort(rng.integers(0, total + 1, size=g - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


def _bytes(t) -> np.ndarray:
    a = np.asarray(t)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8)


def _plain_variant(variant: str | None) -> str | None:
    return None if variant is None else variant.removesuffix("_fc1")


def _check(lhs, rhs, sizes, probs, variant=None) -> None:
    gs = jnp.asarray(np.asarray(sizes, np.int64).astype(np.int32))
    m, n, g = lhs.data.shape[0], rhs.data.shape[1], rhs.data.shape[0]
    nb, rows = -(-n // 128), fp8_block.grouped_scale_rows(m, g)
    if variant is None:
        plain = gemm_ffi.fp8_block_default_variant(n, gemm_ffi.grouped_gemm_fp8_block_variants())
    else:
        plain = _plain_variant(variant)
    h_want = jax.block_until_ready(_plain(lhs, rhs, gs, variant=plain))
    a_row_want, a_col_want = _pair(_srelu(h_want, probs), gs)
    clamped = clamped_sizes(sizes, m)
    runs = []
    for value in (0x5A, 0xFF):
        _poison([(m, 2 * n), (m, n), (m, nb), (m, n), (rows, n)], value)
        h, a_row, a_col = jax.block_until_ready(_fc1(lhs, rhs, gs, probs, variant=variant))
        what = f"variant {variant}, sizes {np.asarray(sizes).tolist()}, poison {value:#x}"
        assert a_row.axes == (1,) and not a_row.is_grouped
        assert a_col.axes == (0,) and a_col.is_grouped and a_col.scale.shape == (rows, n)
        np.testing.assert_array_equal(np.asarray(a_col.group_sizes), clamped)  # the binding clamps them
        got = [h, a_row.data, a_row.scale, a_col.data, a_col.scale]
        want = [h_want, a_row_want.data, a_row_want.scale, a_col_want.data, a_col_want.scale]
        for name, x, y in zip(("h", "a_row.data", "a_row.scale", "a_col.data", "a_col.scale"), got, want):
            assert x.shape == y.shape and x.dtype == y.dtype, (name, x.shape, y.shape, x.dtype, y.dtype)
            np.testing.assert_array_equal(_bytes(x), _bytes(y), err_msg=f"{name}: {what}")
        runs.append([_bytes(t) for t in got])
    for r0, r1 in zip(*runs):
        np.testing.assert_array_equal(r0, r1, err_msg="outputs differ between poisons: unwritten bytes or a race")
    end = int(clamped.sum())
    assert not _bytes(a_col.data)[end:].any(), "a_col has data on rows past the groups"
    used = int(sum(-(-int(s) // 128) for s in clamped))
    assert not _bytes(a_col.scale)[used:].any(), "a_col has scales in rows no group uses"


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "m,n,k,g,total",
    [
        (1000, 256, 512, 7, 1000),  # sizes sum to M, ragged group starts; N two blocks
        (1000, 1856, 2688, 5, 700),  # Nano FC1 dims (N = 14.5 blocks), rows past the groups
        (777, 384, 512, 6, 1200),  # sum above M (clamped); N three blocks
        (300, 136, 208, 3, 300),  # N and K off 128 (partial last blocks)
        (5, 64, 64, 2, 5),  # fewer rows than one tile
        (33, 8, 16, 1, 33),  # N = 8: most of the tile past N
        (2048, 1536, 1024, 16, 2000),
    ],
)
def test_random(rng, variant, m, n, k, g, total):
    lhs, rhs = _operands(rng, m, n, k, g)
    _check(lhs, rhs, _sizes(rng, g, total), _probs(rng, m), variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_group_sizes_with_zeros_giant_and_negative(rng, variant):
    m, n, k = 700, 256, 256
    lhs, rhs = _operands(rng, m, n, k, 6)
    probs = _probs(rng, m)
    for sizes in ([0, 300, 0, 0, 400, 0], [129, 127, 128, 1, 0, 315], [700, 0, 0, 0, 0, 0],
                  [0, 0, 0, 0, 0, 0], [-5, 2**30, 100, 0, 0, 2**31 - 1], [64, 64, 64, 64, 64, 64],
                  [192, 64, 65, 63, 191, 65]):  # last tiles of 64 / 63 rows: the second warp group skips
        _check(lhs, rhs, sizes, probs, variant)


@pytest.mark.gpu
@needs_kernels
def test_default_variant_is_the_plain_gemms_choice(rng):
    """No ``variant``: the tile the plain GEMM would take for this N (the same bits)."""
    for n in (256, 1856):
        lhs, rhs = _operands(rng, 300, n, 128, 3)
        _check(lhs, rhs, [100, 50, 150], _probs(rng, 300))


def test_binding_validation_names_the_argument(rng):
    lhs, rhs = _operands(rng, 64, 32, 64, 2)
    gs = jnp.asarray([30, 34], jnp.int32)
    probs = jnp.ones((64,), jnp.float32)
    with pytest.raises(TypeError, match="lhs"):
        fp8_block_fc1_ffi.grouped_gemm_fp8_block_fc1(lhs.data, rhs, gs, probs)
    with pytest.raises(ValueError, match="rhs"):
        fp8_block_fc1_ffi.grouped_gemm_fp8_block_fc1(lhs, lhs, gs, probs)
    with pytest.raises(ValueError, match="probs"):
        fp8_block_fc1_ffi.grouped_gemm_fp8_block_fc1(lhs, rhs, gs, probs[:10])
    with pytest.raises(Unsupported):  # not fp8_block operands: the dispatcher composes instead
        fp8_block_fc1_ffi.fp8_block_fc1_cuda(jnp.zeros((64, 64), jnp.bfloat16), rhs, gs, probs)
