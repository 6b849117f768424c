"""The CUDA MXFP8 quantize kernel (FFI custom call) against the pure-JAX reference.

Everything marked ``gpu`` needs an NVIDIA GPU and the built extension
(``python tools/build_kernels.py``); docs/gpu.md has the device command. Outputs
are compared byte for byte: data (E4M3) and scales (E8M0). The one allowance is
NaN's sign: in a NaN block every data byte must be a NaN (0x7F or 0xFF) in both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_grouped_mlp._src.cuda import ffi
from jax_grouped_mlp._src.formats import mxfp8
from gpu_helpers import has_gpu


def test_reciprocal_multiply_matches_division_exhaustively():
    """The kernel computes amax/448 as amax * f32(1/448); same bf16 for every bf16 amax."""
    bits = np.arange(0, 0x7F81, dtype=np.uint32)  # every non-negative bf16, Inf included
    a = (bits << 16).view(np.float32)
    div = (a / np.float32(448)).astype(ml_dtypes.bfloat16).view(np.uint16)
    mul = (a * (np.float32(1) / np.float32(448))).astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(div, mul)


needs_kernels = pytest.mark.skipif(
    not (has_gpu() and ffi.available()), reason="needs a GPU and the built extension"
)


def _bytes(a) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def _poison(shapes, value: int) -> None:
    """Fills freed device memory of the outputs' sizes with ``value``.

    XLA's allocator hands the same chunks to the next outputs of equal size, so an
    output byte the kernel forgets to write shows up as a difference between two
    runs poisoned with different values.
    """
    bufs = [jnp.full(s, value, jnp.uint8) for s in shapes]
    jax.block_until_ready(bufs)
    del bufs


_both = jax.jit(ffi.quantize_mxfp8_both_cuda, static_argnames="variant")


@jax.jit
def _reference(x, group_sizes):
    return mxfp8.quantize_mxfp8(x, axis=-1), mxfp8.quantize_mxfp8_grouped(x, group_sizes)


def _assert_same(got: mxfp8.MXFP8Tensor, want: mxfp8.MXFP8Tensor, what: str) -> None:
    gd, wd = _bytes(got.data), _bytes(want.data)
    nan = lambda b: (b & 0x7F) == 0x7F  # noqa: E731  (E4M3 NaN, either sign)
    gd = np.where(nan(gd) & nan(wd), 0x7F, gd)
    wd = np.where(nan(wd) & nan(gd), 0x7F, wd)
    for name, g, w in (("data", gd, wd), ("scale", _bytes(got.scale), _bytes(want.scale))):
        if not np.array_equal(g, w):
            bad = np.argwhere(g != w)
            i = tuple(bad[0])
            raise AssertionError(
                f"{what} {name}: {len(bad)} of {g.size} bytes differ; first at {i}: "
                f"got {g[i]:#04x}, want {w[i]:#04x}"
            )
    assert got.axis == want.axis


def _check(x: np.ndarray, group_sizes, variant: str = ffi.QUANTIZE_VARIANT) -> None:
    x = jnp.asarray(x, jnp.bfloat16)
    gs = jnp.asarray(np.asarray(group_sizes, np.int32))
    m, k = x.shape
    shapes = [(m, k), (m, -(-k // 32)), (m, k), (mxfp8.grouped_scale_rows(m, gs.shape[0]), k)]
    want_row, want_col = _reference(x, gs)
    runs = []
    for value in (0x5A, 0xA5):
        _poison(shapes, value)
        runs.append(jax.block_until_ready(_both(x, gs, variant=variant)))
    for row, col in runs:
        _assert_same(row, want_row, "rowwise")
        _assert_same(col, want_col, "columnwise")


def _random(rng, m, k, spread=20):
    """Normal values times 2**e with e varying per row and column: many scales."""
    e = rng.integers(-spread, spread, size=(m, 1)) + rng.integers(-4, 4, size=(1, k))
    return (rng.standard_normal((m, k)) * np.exp2(e)).astype(np.float32)


def _sizes(rng, m, g, total):
    cuts = np.sort(rng.integers(0, total + 1, size=g - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", ffi.quantize_variants() or ["none"])
@pytest.mark.parametrize(
    "m,k,g,total",
    [
        (256, 256, 4, 256),  # aligned, sizes sum to M
        (1000, 520, 7, 900),  # K % 32 == 8, sum below M
        (77, 2056, 3, 77),  # M % 32 != 0, several column tiles
        (300, 40, 5, 400),  # sum above M (clamped), K < 64
        (33, 8, 1, 33),  # tiny K
        (2048, 4096, 16, 2000),
    ],
)
def test_random(rng, variant, m, k, g, total):
    _check(_random(rng, m, k), _sizes(rng, m, g, total), variant)


@pytest.mark.gpu
@needs_kernels
def test_group_sizes_with_zeros_and_negatives(rng):
    x = _random(rng, 200, 96)
    _check(x, [0, 5, 0, 0, 64, 31, 0, 33, 0])
    _check(x, [0, 0, 0])  # every row past the groups
    _check(x, [-5, 70, 0, 300])  # negative counts as zero; overshoot clamped



@pytest.mark.gpu
@needs_kernels
def test_no_groups(rng):
    """G = 0: every row is past the groups (the reference's tile layout needs G >= 1)."""
    x = jnp.asarray(_random(rng, 100, 64), jnp.bfloat16)
    row, col = _both(x, jnp.zeros((0,), jnp.int32))
    _assert_same(row, mxfp8.quantize_mxfp8(x), "rowwise")
    assert not _bytes(col.data).any() and not _bytes(col.scale).any()
    assert col.scale.shape == (4, 64)


@pytest.mark.gpu
@needs_kernels
def test_m_zero():
    _check(np.zeros((0, 64), np.float32), [0, 0])


@pytest.mark.gpu
@needs_kernels
def test_special_values(rng):
    m, k = 128, 128
    x = _random(rng, m, k).astype(ml_dtypes.bfloat16)
    big = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    tiny = float(ml_dtypes.finfo(ml_dtypes.bfloat16).smallest_subnormal)
    x[0:32, 0:32] = 0  # an all-zero block both ways
    x[32, 0:32] = -0.0
    x[40, 64:96] = big  # huge values
    x[41, 64:96] = -big
    x[45, 96] = 448.0 * 2.0**100
    x[64:96, 32:64] = tiny * rng.integers(-3, 4, size=(32, 32))  # subnormals
    x[100, 5] = np.nan
    x[101, 40] = np.inf
    x[102, 70] = -np.inf
    x[110, 100] = -np.nan
    _check(x, [50, 0, 60, 18])
    _check(x, [128])


@pytest.mark.gpu
@needs_kernels
def test_small_for_sanitizer(rng):
    """Small and quick: the case compute-sanitizer runs (docs/gpu.md)."""
    for variant in ffi.quantize_variants():
        _check(_random(rng, 70, 72), [10, 0, 33, 20], variant)


@pytest.mark.gpu
@needs_kernels
def test_jit_and_export_roundtrip(rng):
    x = jnp.asarray(_random(rng, 96, 128), jnp.bfloat16)
    gs = jnp.asarray([40, 0, 50], jnp.int32)

    def f(x, gs):
        row, col = ffi.quantize_mxfp8_both_cuda(x, gs)
        return row.data, row.scale, col.data, col.scale

    exported = jax.export.export(
        jax.jit(f), platforms=["cuda"], disabled_checks=ffi.export_disabled_checks()
    )(x, gs)
    text = exported.mlir_module()
    assert ffi.QUANTIZE_TARGET in text
    restored = jax.export.deserialize(exported.serialize())
    got = restored.call(x, gs)
    want = jax.jit(f)(x, gs)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(_bytes(a), _bytes(b))


@pytest.mark.gpu
@needs_kernels
def test_adapters_and_platform_dependent(rng):
    x = jnp.asarray(_random(rng, 64, 64), jnp.bfloat16)
    gs = jnp.asarray([30, 30], jnp.int32)

    def f(x, gs):
        return jax.lax.platform_dependent(
            x, gs,
            cuda=lambda x, gs: (ffi.quantize_cuda(x, axis=-1), ffi.quantize_both_cuda(x, gs)[1]),
            default=_reference,
        )

    row, col = jax.jit(f)(x, gs)
    want_row, want_col = _reference(x, gs)
    _assert_same(row, want_row, "rowwise")
    _assert_same(col, want_col, "columnwise")
    # Shapes the kernel does not take fall back to the reference.
    x_odd = jnp.asarray(_random(rng, 8, 36), jnp.bfloat16)
    _assert_same(ffi.quantize_cuda(x_odd, axis=-1), mxfp8.quantize_mxfp8(x_odd), "fallback")


@pytest.mark.gpu
@needs_kernels
def test_handler_rejects_bad_buffers():
    x = jnp.zeros((64, 64), jnp.bfloat16)
    gs = jnp.asarray([64], jnp.int32)
    bad = (
        jax.ShapeDtypeStruct((64, 64), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((64, 3), jnp.float8_e8m0fnu),  # should be (64, 2)
        jax.ShapeDtypeStruct((64, 64), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((3, 64), jnp.float8_e8m0fnu),
    )
    with pytest.raises(Exception, match="row_scale"):
        jax.block_until_ready(
            jax.jit(lambda x, gs: jax.ffi.ffi_call(ffi.QUANTIZE_TARGET, bad)(x, gs, variant=np.int32(0)))(x, gs)
        )
    with pytest.raises(ValueError, match="K % 8"):
        ffi.quantize_mxfp8_both_cuda(jnp.zeros((4, 12), jnp.bfloat16), gs)


@pytest.mark.skipif(not ffi.available(), reason="needs the built extension")
def test_every_called_target_is_registered_and_lowers_for_cuda():
    """No GPU needed: the custom call lowers for CUDA wherever the extension loads."""
    assert ffi.QUANTIZE_TARGET in ffi.registered_targets()
    x = jnp.zeros((64, 64), jnp.bfloat16)
    gs = jnp.asarray([64], jnp.int32)
    exported = jax.export.export(
        jax.jit(lambda x, gs: ffi.quantize_mxfp8_both_cuda(x, gs)[1].scale),
        platforms=["cuda"],
        disabled_checks=ffi.export_disabled_checks(),
    )(x, gs)
    assert f"@{ffi.QUANTIZE_TARGET}" in exported.mlir_module()


_GRAPH_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax_grouped_mlp._src.cuda import ffi
from jax_grouped_mlp._src.formats import mxfp8
x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 512)), jnp.bfloat16)
gs = jnp.asarray([100, 0, 90], jnp.int32)
def f(x, gs):
    row, col = ffi.quantize_mxfp8_both_cuda(x * 2, gs + 1)
    return row.data, row.scale, col.data, col.scale
def ref(x, gs):
    row = mxfp8.quantize_mxfp8(x * 2)
    col = mxfp8.quantize_mxfp8_grouped(x * 2, gs + 1)
    return row.data, row.scale, col.data, col.scale
fj, rj = jax.jit(f), jax.jit(ref)
want = [np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)) for a in rj(x, gs)]
for _ in range(3):
    got = [np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)) for a in fj(x, gs)]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
print("graph-ok")
"""


@pytest.mark.gpu
@needs_kernels
def test_inside_cuda_graph():
    """With XLA's command buffers on for custom calls, programs holding the kernel still
    give the reference bytes (the handler is not marked graph-compatible, so XLA runs it
    between graph segments; see csrc/quantize_mxfp8.cc)."""
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
