"""MXFP8 quantizer: bit-identical to JAX's mxfp8 quantizer and to a numpy transcription of the rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_grouped_mlp as jgm
from jax_grouped_mlp._src import groups
from jax_grouped_mlp._src.formats import mxfp8

try:  # JAX's own quantizer (private API; used only as an oracle)
    from jax._src.cudnn.scaled_matmul_stablehlo import BlockScaleConfig, quantize as jax_quantize
except ImportError:  # pragma: no cover
    jax_quantize = None


def _u8(a) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def np_quantize_rows(x: np.ndarray, src_dtype) -> tuple[np.ndarray, np.ndarray]:
    """A plain numpy transcription of the rule for a ``[R, 32*k]`` block-row array."""
    xf = np.asarray(x, np.float32)
    r, n = xf.shape
    xb = xf.reshape(r, n // 32, 32)
    amax = np.max(np.abs(xb), axis=-1)
    s = (amax / np.float32(448)).astype(src_dtype).astype(np.float32)
    scales = np.zeros(s.shape, np.uint8)
    recip = np.zeros(s.shape, np.float32)
    for idx, v in np.ndenumerate(s):
        if not np.isfinite(v) or np.isnan(xb[idx]).any():
            scales[idx] = 0xFF
            recip[idx] = np.nan
            continue
        m, e = np.frexp(np.float64(v))  # v = m * 2**e, m in [0.5, 1)
        k = e - 1 if m == 0.5 else e  # the smallest k with 2**k >= v
        byte = 0 if v == 0 else int(np.clip(k + 127, 0, 254))
        scales[idx] = byte
        recip[idx] = np.float32(2.0 ** (127 - byte))
    data = np.clip(xb * recip[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return data.reshape(r, n).view(np.uint8), scales


def _random(rng, shape, dtype):
    # Spread magnitudes over many binades so blocks get very different scales.
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, size=shape[:-1] + (1,)))
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_matches_jax_quantizer(rng, dtype):
    if jax_quantize is None:
        pytest.skip("jax's mxfp8 quantizer is not importable")
    x = _random(rng, (48, 256), dtype)
    cfg = BlockScaleConfig(
        mode="mxfp8", block_size=32, data_type=jnp.float8_e4m3fn,
        scale_type=jnp.float8_e8m0fnu, global_scale=None, infer_only=False,
    )
    want_q, want_s = jax_quantize(x, cfg)
    got = jgm.quantize_mxfp8(x, axis=-1)
    np.testing.assert_array_equal(_u8(got.scale), _u8(want_s))
    np.testing.assert_array_equal(_u8(got.data), _u8(want_q))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_matches_numpy_rule_with_edge_cases(rng, dtype):
    x = np.array(_random(rng, (16, 128), dtype), np.float32)
    x[0, :32] = 0.0  # all-zero block
    x[1, :32] = -0.0
    x[2, 5] = np.nan  # NaN block
    x[3, 40] = np.inf  # Inf block
    x[4, 70] = -np.inf
    x[5, :32] = 448.0 * 2.0**100  # huge
    x[6, :32] = 2.0**-100  # tiny but normal
    x[7, 64:96] = rng.choice([1.0, -2.0, 448.0, 0.5], size=32)  # exact powers and the max
    x[8, 96] = 3.0e38  # near float32 max
    xj = jnp.asarray(x, dtype)
    got = jgm.quantize_mxfp8(xj, axis=1)
    want_d, want_s = np_quantize_rows(np.asarray(xj, np.float32), np.dtype(jnp.dtype(dtype)))
    np.testing.assert_array_equal(_u8(got.scale), want_s)
    np.testing.assert_array_equal(_u8(got.data), want_d)
    s = _u8(got.scale)
    assert s[0, 0] == 0 and s[2, 0] == 0xFF and s[3, 1] == 0xFF and s[4, 2] == 0xFF
    assert np.all(_u8(got.data)[0, :32] == 0) and np.all(_u8(got.data)[1, :32] == 0x80)
    deq = np.asarray(jgm.dequantize(got, jnp.float32))
    assert np.all(np.isnan(deq[2, :32])) and np.all(np.isnan(deq[3, 32:64]))
    assert np.all(deq[0, :32] == 0)


@pytest.mark.parametrize("shape,axis", [((5, 70), -1), ((33, 3), 0), ((2, 45, 7), 1), ((31,), 0)])
def test_unaligned_axis_is_padded(rng, shape, axis):
    x = _random(rng, shape, jnp.bfloat16)
    q = jgm.quantize_mxfp8(x, axis=axis)
    assert q.data.shape == x.shape
    ax = axis % x.ndim
    assert q.scale.shape[ax] == groups.cdiv(x.shape[ax], 32) and q.axis == ax
    # Same as quantizing the explicitly zero-padded array.
    pad = [(0, 0)] * x.ndim
    pad[ax] = (0, q.scale.shape[ax] * 32 - x.shape[ax])
    qp = jgm.quantize_mxfp8(jnp.pad(x, pad), axis=axis)
    np.testing.assert_array_equal(_u8(q.scale), _u8(qp.scale))
    np.testing.assert_array_equal(
        _u8(q.data), _u8(jax.lax.slice(qp.data, (0,) * x.ndim, x.shape))
    )


def test_dequantize_is_close_and_lossless_to_bf16(rng):
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
    q = jgm.quantize_mxfp8(x)
    back = np.asarray(jgm.dequantize(q, jnp.float32))
    rel = np.abs(back - np.asarray(x)) / np.maximum(np.abs(np.asarray(x)), 1e-3)
    assert np.median(rel) < 0.04
    # bf16 dequantization is lossless.
    np.testing.assert_array_equal(np.asarray(jgm.dequantize(q, jnp.bfloat16), np.float32), back)


@pytest.mark.parametrize("sizes", [[40, 0, 33, 1, 50], [0, 0, 124, 0, 0], [10, 10, 10, 10, 10], [100, 100, 0, 0, 0]])
def test_grouped_matches_per_group_quantization(rng, sizes):
    m, k = 124, 40
    x = _random(rng, (m, k), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    q = jgm.quantize_mxfp8_grouped(x, gs)
    assert q.data.shape == (m, k) and q.scale.shape == (groups.cdiv(m, 32) + len(sizes), k)
    data, scale = _u8(q.data), _u8(q.scale)
    block, start = 0, 0
    for s in sizes:
        end = min(start + s, m)
        if end > start:
            ref = jgm.quantize_mxfp8(x[start:end], axis=0)
            nb = ref.scale.shape[0]
            np.testing.assert_array_equal(scale[block:block + nb], _u8(ref.scale))
            np.testing.assert_array_equal(data[start:end], _u8(ref.data))
            block += nb
        start = end
    assert np.all(scale[block:] == 0), "unused scale rows must be byte 0"
    assert np.all(data[start:] == 0), "rows past the groups must be zero"
    back = np.asarray(jgm.dequantize(q, jnp.float32))
    assert np.all(back[start:] == 0)
    x2 = rng.standard_normal((m, k)).astype(np.float32)
    back2 = np.asarray(jgm.dequantize(jgm.quantize_mxfp8_grouped(jnp.asarray(x2), gs), jnp.float32))
    np.testing.assert_allclose(back2[:start], x2[:start], rtol=0.07, atol=1e-3)


def test_grouped_handles_nan_and_overflowing_sizes(rng):
    x = np.array(_random(rng, (70, 32), jnp.float32))
    x[3, 7] = np.nan
    gs = jnp.asarray([20, 100], jnp.int32)  # sums past M: the extra is ignored
    q = jgm.quantize_mxfp8_grouped(jnp.asarray(x), gs)
    s = _u8(q.scale)
    assert s[0, 7] == 0xFF and np.all(np.delete(s[0], 7) != 0xFF)
    ref = jgm.quantize_mxfp8(jnp.asarray(x[20:]), axis=0)
    np.testing.assert_array_equal(s[1:1 + 2], _u8(ref.scale))


def test_pytree_and_jit(rng):
    x = _random(rng, (64, 64), jnp.bfloat16)
    q = jax.jit(lambda a: jgm.quantize_mxfp8(a, axis=0))(x)
    assert isinstance(q, jgm.MXFP8Tensor) and q.axis == 0
    leaves = jax.tree_util.tree_leaves(q)
    assert [l.dtype for l in leaves] == [jnp.float8_e4m3fn, jnp.float8_e8m0fnu]
    qg = jax.jit(jgm.quantize_mxfp8_grouped)(x, jnp.array([30, 34], jnp.int32))
    assert len(jax.tree_util.tree_leaves(qg)) == 3


def test_bad_inputs():
    with pytest.raises(TypeError, match="x must be bfloat16 or float32"):
        jgm.quantize_mxfp8(jnp.ones((4, 32), jnp.int32))
    with pytest.raises(ValueError, match="axis=2 is out of range"):
        jgm.quantize_mxfp8(jnp.ones((4, 32), jnp.float32), axis=2)
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        jgm.quantize_mxfp8_grouped(jnp.ones((4,), jnp.float32), jnp.array([4]))
    with pytest.raises(TypeError, match="group_sizes must be a 1-D integer array"):
        jgm.quantize_mxfp8_grouped(jnp.ones((4, 32), jnp.float32), jnp.array([4.0]))
    with pytest.raises(TypeError, match="t must be an MXFP8Tensor, got t=ArrayImpl$"):
        jgm.dequantize(jnp.ones(3))
    # The other format's tensor: the error names the dequantizer that takes it.
    x = jnp.ones((4, 128), jnp.float32)
    with pytest.raises(TypeError, match="got t=FP8BlockTensor: dequantize_fp8_block dequantizes that one"):
        jgm.dequantize(jgm.quantize_fp8_block(x))
    with pytest.raises(TypeError, match="got t=MXFP8Tensor: dequantize dequantizes that one"):
        jgm.dequantize_fp8_block(jgm.quantize_mxfp8(x))


def test_grouped_with_no_groups_and_no_rows(rng):
    x = _random(rng, (40, 32), jnp.bfloat16)
    q = jgm.quantize_mxfp8_grouped(x, jnp.zeros((0,), jnp.int32))
    assert q.scale.shape == (2, 32)
    assert np.all(_u8(q.data) == 0) and np.all(_u8(q.scale) == 0)
    q0 = jgm.quantize_mxfp8_grouped(x[:0], jnp.asarray([0, 0], jnp.int32))
    assert q0.data.shape == (0, 32) and q0.scale.shape == (2, 32)
    assert np.all(_u8(q0.scale) == 0), "unused scale rows must be byte 0 (not E8M0 NaN)"




_QUANTIZERS = {
    "quantize_mxfp8": (lambda x: jgm.quantize_mxfp8(x, axis=1), jgm.dequantize),
    "quantize_mxfp8_grouped": (lambda x: jgm.quantize_mxfp8_grouped(x, jnp.array([40, 0, 24], jnp.int32)),
                               jgm.dequantize),
    "quantize_fp8_block": (lambda x: jgm.quantize_fp8_block(x, 1), jgm.dequantize_fp8_block),
    "quantize_fp8_block_grouped": (lambda x: jgm.quantize_fp8_block(x, 0, group_sizes=jnp.array([40, 0, 24])),
                                   jgm.dequantize_fp8_block),
}


@pytest.mark.parametrize("name", list(_QUANTIZERS))
def test_quantizers_refuse_derivatives(rng, name):
    """Differentiating through a public quantizer is a TypeError naming it (JAX's own
    derivative rounded the gradient to E4M3 on the block scales: 0 for small cotangents,
    NaN for large ones); a stop_gradient-ed input quantizes as before."""
    quantize, deq = _QUANTIZERS[name]
    x = jnp.asarray(rng.standard_normal((64, 160)), jnp.float32)
    fq = lambda x: deq(quantize(x), jnp.float32)
    fn = name.removesuffix("_grouped") if name.startswith("quantize_fp8") else name
    with pytest.raises(TypeError, match=f"{fn} is not differentiable.*stop_gradient"):
        jax.grad(lambda x: jnp.sum(fq(x) * 1e-3))(x)
    with pytest.raises(TypeError, match="not differentiable"):
        jax.jvp(fq, (x,), (x,))
    g = jax.jit(jax.grad(lambda x: jnp.sum(fq(jax.lax.stop_gradient(x)) * x)))(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(fq(x)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", list(_QUANTIZERS))
def test_documented_straight_through_fake_quantization(rng, name, dtype):
    """The docstrings' straight-through fake quantization, ``x + (fq(xs) - xs)`` in float32
    with ``xs = stop_gradient(x)``: bitwise the quantized values (Sterbenz: fq(x) is within
    a factor 2 of x, or 0), gradient exactly the cotangent."""
    quantize, deq = _QUANTIZERS[name]
    x = rng.standard_normal((64, 160)) * np.exp2(rng.integers(-30, 30, size=(64, 1)))
    x[3, 5], x[7, :] = 0.0, 1e-3 * x[7, :] ** 3  # zeros and a wide range within a block
    x = jnp.asarray(x, dtype)

    def st(x):
        xs = jax.lax.stop_gradient(x)
        return (x.astype(jnp.float32) + (deq(quantize(xs), jnp.float32) - xs.astype(jnp.float32))).astype(dtype)

    np.testing.assert_array_equal(np.asarray(st(x), np.float32), np.asarray(deq(quantize(x), dtype), np.float32))
    c = jnp.asarray(rng.standard_normal(x.shape), jnp.float32) * 1e-3
    g = jax.grad(lambda x: jnp.sum(st(x).astype(jnp.float32) * c))(x)
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(c.astype(dtype), np.float32))
