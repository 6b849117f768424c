"""The CUDA dequantize kernel for kept group-aware MXFP8 residuals, against ``mxfp8.dequantize``.

The input is quantized by the reference (``quantize_mxfp8_grouped``) from fresh random
values with many scales, special values and adversarial group sizes; the kernel's
bf16 output must equal the reference's bit for bit (any NaN matches any NaN; values
below bf16's normal range may differ, as the CPU reference flushes float32
subnormals). The output is poisoned with two patterns first, so an unwritten element
shows up; rows past the groups must be zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_grouped_mlp._src.cuda import ffi, gemm_ffi
from jax_grouped_mlp._src.formats import mxfp8
from gpu_helpers import has_gpu
from test_fake_quantize_gpu import _assert_same_bits, _cpu, _special
from mxfp8_gpu_helpers import _poison, _random, _sizes

needs_kernels = pytest.mark.skipif(
    not (has_gpu() and ffi.available() and ffi.dequantize_variants()),
    reason="needs a GPU and the built extension",
)
_kernel = jax.jit(ffi.dequantize_grouped_mxfp8_cuda)


def _check(x, group_sizes) -> None:
    x = jnp.asarray(x, jnp.bfloat16)
    gs = jnp.asarray(np.asarray(group_sizes, np.int32))
    t = _cpu(mxfp8.quantize_mxfp8_grouped, x, gs)
    want = _cpu(lambda t: mxfp8.dequantize(t, jnp.bfloat16), t)
    t = jax.device_put(t, jax.devices()[0])
    for value in (0x5A, 0xFF):
        _poison([(x.size * 2,)], value)
        got = jax.block_until_ready(_kernel(t))
        _assert_same_bits(got, want, f"dequantize (poison {value:#x}, sizes {list(group_sizes)})")
        total = int(np.clip(np.maximum(np.asarray(group_sizes), 0).sum(), 0, x.shape[0]))
        assert not np.asarray(got[total:], np.float32).any(), "rows past the groups must be zero"


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize(
    "m,k,g,total",
    [(256, 256, 4, 256), (1000, 520, 7, 900), (77, 2056, 3, 77), (300, 40, 5, 400), (33, 8, 1, 33)],
)
def test_random(rng, m, k, g, total):
    _check(_random(rng, m, k), _sizes(rng, m, g, total))


@pytest.mark.gpu
@needs_kernels
def test_group_sizes_and_special_values(rng):
    x = _special(rng)
    for sizes in ([50, 0, 60, 18], [128], [0, 5, 0, 33], [-5, 70, 0, 300], [0, 0]):
        _check(x, sizes)
    _check(np.zeros((0, 64), np.float32), [0, 0])


@pytest.mark.gpu
@needs_kernels
def test_wgrad_adapter_uses_it(rng):
    """A kept residual reaching the weight-gradient GEMM is dequantized by this kernel."""
    x = jnp.asarray(_random(rng, 256, 64), jnp.bfloat16)
    gs = jnp.asarray([100, 0, 156], jnp.int32)
    t = mxfp8.quantize_mxfp8_grouped(x, gs)
    text = jax.jit(lambda t, y: gemm_ffi.grouped_wgrad_cuda(t, y, gs, out_dtype=jnp.bfloat16)).lower(t, x).as_text()
    assert ffi.DEQUANTIZE_TARGET in text


def test_rejects_non_grouped_tensors():
    t = mxfp8.quantize_mxfp8(jnp.ones((64, 64), jnp.bfloat16), axis=1)
    with pytest.raises(TypeError, match="group-aware"):
        ffi.dequantize_grouped_mxfp8_cuda(t)
