"""The CUDA MXFP8 fake-quantize kernels: bf16 MXFP8 values, bit for bit the reference's.

``fake_quantize_mxfp8_cuda(x, gs, mode)`` must equal ``dequantize(quantize_mxfp8(x, 1))``
(mode "row") or ``dequantize(quantize_mxfp8_grouped(x, gs))`` (mode "col"), compared
as bf16 bit patterns (any NaN matches any NaN). The reference runs on the CPU, whose
XLA flushes subnormal float32 results to zero; the kernel keeps them (no .ftz). So
where both sides are below bf16's normal range (zero or subnormal: tiny blocks, scale
2**-127) they may differ; everywhere else the bits must agree. Outputs are poisoned
with two patterns first: an unwritten element shows up as a difference.

The two-copy kernel (``fake_quantize_pair_mxfp8_cuda``) must give the rowwise values
as above, and the columnwise copy as values (mode "rowcol") or as the grouped
MXFP8 tensor itself (mode "row_colq": data and scales byte for byte).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_grouped_mlp._src.cuda import ffi
from jax_grouped_mlp._src.formats import mxfp8
from jax_grouped_mlp._src.op import primitives
from gpu_helpers import has_gpu
from mxfp8_gpu_helpers import _assert_same, _poison, _random, _sizes

needs_kernels = pytest.mark.skipif(
    not (has_gpu() and ffi.available() and ffi.fake_quantize_variants()),
    reason="needs a GPU and the built extension",
)
_fake = jax.jit(ffi.fake_quantize_mxfp8_cuda, static_argnames="mode")
_pair = jax.jit(ffi.fake_quantize_pair_mxfp8_cuda, static_argnames="keep_col_fp8")
needs_pair = pytest.mark.skipif(
    not (has_gpu() and ffi.available() and ffi.fake_quantize_pair_variants()),
    reason="needs a GPU and the built extension",
)


def _cpu(fn, *args):
    cpu = jax.devices("cpu")[0]
    return jax.jit(fn)(*jax.device_put(args, cpu))


def _reference(x, gs, mode):
    if mode == "row":
        return _cpu(lambda x: mxfp8.dequantize(mxfp8.quantize_mxfp8(x, axis=1)), x)
    return _cpu(lambda x, gs: mxfp8.dequantize(mxfp8.quantize_mxfp8_grouped(x, gs)), x, gs)


def _assert_same_bits(got, want, what: str) -> None:
    g = np.asarray(got).view(np.uint16)
    w = np.asarray(want).view(np.uint16)
    nan = lambda b: (b & 0x7FFF) > 0x7F80  # noqa: E731
    below_normal = lambda b: (b & 0x7F80) == 0  # noqa: E731  (zero or subnormal)
    same = (g == w) | (nan(g) & nan(w)) | (below_normal(g) & below_normal(w))
    if not same.all():
        i = tuple(np.argwhere(~same)[0])
        raise AssertionError(f"{what}: {(~same).sum()} of {g.size} differ; first {i}: got {g[i]:#06x}, want {w[i]:#06x}")


def _check(x, group_sizes, mode: str) -> None:
    x = jnp.asarray(x, jnp.bfloat16)
    gs = jnp.asarray(np.asarray(group_sizes, np.int32))
    want = _reference(x, gs, mode)
    for value in (0x5A, 0xFF):
        _poison([(x.size * 2,)], value)
        _assert_same_bits(jax.block_until_ready(_fake(x, gs, mode=mode)), want, f"{mode} (poison {value:#x})")


def _check_pair(x, group_sizes, keep_col_fp8: bool) -> None:
    x = jnp.asarray(x, jnp.bfloat16)
    gs = jnp.asarray(np.asarray(group_sizes, np.int32))
    m, k = x.shape
    want_row = _reference(x, gs, "row")
    # The FP8 copy is checked against the reference run on the GPU, as the quantize tests did.
    want_col = jax.jit(mxfp8.quantize_mxfp8_grouped)(x, gs) if keep_col_fp8 else _reference(x, gs, "col")
    shapes = [(m, 2 * k), (m, k if keep_col_fp8 else 2 * k), (mxfp8.grouped_scale_rows(m, gs.shape[0]), k)]
    for value in (0x5A, 0xFF):
        _poison(shapes, value)
        row, col = jax.block_until_ready(_pair(x, gs, keep_col_fp8=keep_col_fp8))
        what = f"pair keep_col_fp8={keep_col_fp8} (poison {value:#x})"
        _assert_same_bits(row, want_row, what + " row")
        if keep_col_fp8:
            assert col.group_sizes is not None and col.axis == 0
            _assert_same(col, want_col, what + " col")
        else:
            _assert_same_bits(col, want_col, what + " col")


_SHAPES = [(256, 256, 4, 256), (1000, 520, 7, 900), (77, 2056, 3, 77), (300, 40, 5, 400), (33, 8, 1, 33)]


@pytest.mark.gpu
@needs_pair
@pytest.mark.parametrize("keep_col_fp8", [False, True])
@pytest.mark.parametrize("m,k,g,total", _SHAPES)
def test_pair_random(rng, keep_col_fp8, m, k, g, total):
    _check_pair(_random(rng, m, k), _sizes(rng, m, g, total), keep_col_fp8)


@pytest.mark.gpu
@needs_pair
@pytest.mark.parametrize("keep_col_fp8", [False, True])
def test_pair_group_sizes_and_special_values(rng, keep_col_fp8):
    x = _special(rng)
    for sizes in ([50, 0, 60, 18], [128], [0, 5, 0, 33], [-5, 70, 0, 300], [0, 0]):
        _check_pair(x, sizes, keep_col_fp8)
    _check_pair(np.zeros((0, 64), np.float32), [0, 0], keep_col_fp8)


@pytest.mark.gpu
@needs_pair
def test_pair_primitive_in_jit(rng):
    """``primitives.fake_quantize_pair`` lowers to the kernel under jit, both ways."""
    x = jnp.asarray(_random(rng, 200, 96), jnp.bfloat16)
    gs = jnp.asarray([64, 0, 100], jnp.int32)
    for keep in (False, True):
        text = jax.jit(lambda x, gs: primitives.fake_quantize_pair(x, gs, keep_col_fp8=keep)).lower(x, gs).as_text()
        assert ffi.FAKE_QUANTIZE_PAIR_TARGET in text


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("mode", ["row", "col"])
@pytest.mark.parametrize(
    "m,k,g,total",
    [(256, 256, 4, 256), (1000, 520, 7, 900), (77, 2056, 3, 77), (300, 40, 5, 400), (33, 8, 1, 33)],
)
def test_random(rng, mode, m, k, g, total):
    _check(_random(rng, m, k), _sizes(rng, m, g, total), mode)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("mode", ["row", "col"])
def test_group_sizes_and_special_values(rng, mode):
    x = _special(rng)
    for sizes in ([50, 0, 60, 18], [128], [0, 5, 0, 33], [-5, 70, 0, 300], [0, 0]):
        _check(x, sizes, mode)
    _check(np.zeros((0, 64), np.float32), [0, 0], mode)


def _special(rng) -> np.ndarray:
    """128 x 128 with a zero block, bf16 max/-max, subnormal blocks, a NaN and an Inf."""
    x = _random(rng, 128, 128).astype(ml_dtypes.bfloat16)
    big = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    tiny = float(ml_dtypes.finfo(ml_dtypes.bfloat16).smallest_subnormal)
    x[0:32, 0:32] = 0
    x[40, 64:96] = big
    x[41, 64:96] = -big
    x[64:96, 32:64] = tiny * rng.integers(-3, 4, size=(32, 32))
    x[100, 5] = np.nan
    x[101, 40] = np.inf
    return x


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("axis", [1, 2])
def test_stacked_weights_both_axes(rng, axis):
    """The primitive on [G, A, B] weights (A = 84 blocks of 32 + a ragged case)."""
    for shape in ((4, 2688 // 8, 1856 // 8), (3, 100, 72)):
        w = jnp.asarray(_random(rng, shape[0] * shape[1], shape[2]).reshape(shape) / 64, jnp.bfloat16)
        got = jax.jit(lambda w: ffi.fake_quantize_cuda(w, axis=axis))(w)
        want = _cpu(lambda w: primitives._REFERENCE["fake_quantize"](w, axis=axis), w)
        _assert_same_bits(got, want, f"weights {shape} axis {axis}")


def test_reciprocal_multiply_matches_division_exhaustively():
    """The kernels compute amax/448 as amax * f32(1/448) (``ptx.e8m0_rceil``); same bf16
    for every bf16 amax."""
    bits = np.arange(0, 0x7F81, dtype=np.uint32)  # every non-negative bf16, Inf included
    a = (bits << 16).view(np.float32)
    div = (a / np.float32(448)).astype(ml_dtypes.bfloat16).view(np.uint16)
    mul = (a * (np.float32(1) / np.float32(448))).astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(div, mul)


@pytest.mark.skipif(not (ffi.available() and ffi.fake_quantize_pair_variants()), reason="needs the built extension")
def test_pair_target_is_registered_and_lowers_for_cuda():
    """No GPU needed: the custom call lowers for CUDA wherever the extension loads."""
    assert ffi.FAKE_QUANTIZE_PAIR_TARGET in ffi.registered_targets()
    x = jnp.zeros((64, 64), jnp.bfloat16)
    gs = jnp.asarray([64], jnp.int32)
    exported = jax.export.export(
        jax.jit(lambda x, gs: ffi.fake_quantize_pair_mxfp8_cuda(x, gs, keep_col_fp8=True)[1].scale),
        platforms=["cuda"],
        disabled_checks=ffi.export_disabled_checks(),
    )(x, gs)
    assert f"@{ffi.FAKE_QUANTIZE_PAIR_TARGET}" in exported.mlir_module()


_GRAPH_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax_grouped_mlp._src.cuda import ffi
from jax_grouped_mlp._src.formats import mxfp8
x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 512)), jnp.bfloat16)
gs = jnp.asarray([100, 0, 90], jnp.int32)
def f(x, gs):
    row, col = ffi.fake_quantize_pair_mxfp8_cuda(x * 2, gs + 1, keep_col_fp8=True)
    return row, col.data, col.scale
def ref(x, gs):
    row, col = mxfp8.fake_quantize_pair(x * 2, gs + 1, True)
    return row, col.data, col.scale
fj, rj = jax.jit(f), jax.jit(ref)
want = [np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)) for a in rj(x, gs)]
for _ in range(3):
    got = [np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)) for a in fj(x, gs)]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
print("graph-ok")
"""


@pytest.mark.gpu
@needs_pair
def test_inside_cuda_graph():
    """With XLA's command buffers on for custom calls, programs holding the kernel still
    give the reference bytes (the handlers are not marked graph-compatible, so XLA runs
    them between graph segments; see csrc/grouped_gemm.cc)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "")
        + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
    )
    out = subprocess.run(
        [sys.executable, "-c", _GRAPH_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "graph-ok" in out.stdout, out.stdout + out.stderr
