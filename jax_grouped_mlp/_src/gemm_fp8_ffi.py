"""XLA FFI binding of the Hopper MXFP8 grouped GEMM with FP8 wgmma (DESIGN.md strategy 1;
``csrc/grouped_gemm_fp8.cc``, kernel ``kernels/grouped_gemm_fp8_sm90.py``). A prototype:
nothing in ``primitives``/``mlp`` calls it yet.

``out[m] = dequantize(lhs)[m] @ dequantize(rhs_t)[group(m)]^T`` with

* ``lhs``: rowwise MXFP8 ``[M, K]`` (``quantize_mxfp8(x, axis=1)``),
* ``rhs_t``: MXFP8 ``[G, N, K]`` blocked along K (``quantize_mxfp8(w_t, axis=2)``: a weight
  quantized along K, stored transposed),
* ``group_sizes [G]`` int32 on the device (clamped to M there), rows at or past
  ``sum(group_sizes)`` zero; bf16 output.

The kernel multiplies FP8 exactly, sums each 32-K block in the tensor cores' fp32
accumulator (whose internal precision on Hopper is below fp32's), scales the block sum by
``sa * sb`` and adds it to an fp32 accumulator, then rounds once to bf16. The E8M0 scales
are decoded to float32 here (``2^(e - 127)``, NaN for 0xFF, the subnormal 2^-127 for 0)
and laid out for the kernel's TMA loads (:func:`lhs_scales`, :func:`rhs_scales`): these are
small XLA ops on 1/32 of the elements. Products of two scales are formed in float32, so
scale pairs whose product leaves float32's range (below 2^-149 or above 2^127) flush to 0
or overflow: irrelevant for quantized activations and weights, documented for the edges.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src import ffi, mxfp8
from jax_grouped_mlp._src.gemm_ffi import tile_n
from jax_grouped_mlp._src.groups import cdiv
from jax_grouped_mlp._src.mxfp8 import MXFP8Tensor

GROUPED_GEMM_FP8_TARGET = "jgm_grouped_gemm_fp8"
_MAX = 2**31


def grouped_gemm_fp8_variants() -> tuple[str, ...]:
    """Names of the compiled MXFP8 GEMM tile configurations (empty without the extension)."""
    return ffi.variants("GROUPED_GEMM_FP8_VARIANTS")


def default_fp8_variant(names: tuple[str, ...] | None = None) -> str:
    """The first compiled variant (two temporary accumulators, tile_n 128)."""
    names = grouped_gemm_fp8_variants() if names is None else names
    if not names:
        raise RuntimeError("the CUDA extension jax_grouped_mlp._kernels is not built")
    return names[0]


def _scale_values(scale: jax.Array) -> jax.Array:
    """float8_e8m0fnu (or uint8 bytes) -> float32 ``2^(e - 127)`` (NaN for 0xFF, 2^-127 for 0)."""
    e = scale if jnp.dtype(scale.dtype) == jnp.dtype(jnp.uint8) else jax.lax.bitcast_convert_type(scale, jnp.uint8)
    return mxfp8._scale_value(e)


def lhs_scales(scale: jax.Array) -> jax.Array:
    """The kernel's A scales: ``[M, KB]`` E8M0 -> float32 ``[KB, Mp]``, ``Mp = round_up(M, 4)``.

    M contiguous so that a (128 rows x 4 blocks) TMA box has a 512-byte inner extent;
    padding rows are 0.
    """
    m, _ = scale.shape
    v = _scale_values(scale).T
    return jnp.pad(v, ((0, 0), (0, cdiv(m, 4) * 4 - m)))


def rhs_scales(scale: jax.Array, tile: int) -> jax.Array:
    """The kernel's B scales: ``[G, N, KB]`` E8M0 -> float32 ``[G, KB, Np]``, ``Np = round_up(N, tile)``.

    Within each chunk of ``tile`` columns, column ``c = 8 n8 + 2 q + j`` (``q`` in 0..3,
    ``j`` in 0..1: the wgmma accumulator's column of lane ``q = lane % 4``) moves to
    ``q * tile / 4 + 2 n8 + j``, so each lane reads its ``tile / 4`` column scales of a
    32-K block as contiguous 16-byte vectors. Padding columns are 0.
    """
    g, n, kb = scale.shape
    np_ = cdiv(n, tile) * tile
    v = jnp.swapaxes(_scale_values(scale), 1, 2)  # [G, KB, N]
    v = jnp.pad(v, ((0, 0), (0, 0), (0, np_ - n)))
    v = v.reshape(g, kb, np_ // tile, tile // 8, 4, 2)  # (chunk, n8, q, j)
    return jnp.transpose(v, (0, 1, 2, 4, 3, 5)).reshape(g, kb, np_)


def _check_operands(lhs, rhs_t, group_sizes) -> tuple[int, int, int, int]:
    """Trace-time validation; returns (M, N, K, G)."""
    if not isinstance(lhs, MXFP8Tensor) or not isinstance(rhs_t, MXFP8Tensor):
        raise TypeError(
            f"lhs and rhs_t must be MXFP8Tensor, got {type(lhs).__name__} and {type(rhs_t).__name__}"
        )
    if lhs.is_grouped or rhs_t.is_grouped:
        raise ValueError("lhs and rhs_t must be plain MXFP8 tensors blocked along K, not group-aware ones")
    if lhs.data.ndim != 2 or lhs.axis != 1:
        raise ValueError(f"lhs must be MXFP8 [M, K] blocked along K (axis=1), got {lhs.shape=} {lhs.axis=}")
    if rhs_t.data.ndim != 3 or rhs_t.axis != 2:
        raise ValueError(
            f"rhs_t must be MXFP8 [G, N, K] blocked along K (axis=2), got {rhs_t.shape=} {rhs_t.axis=}"
        )
    m, k = lhs.shape
    g, n, k2 = rhs_t.shape
    if k != k2:
        raise ValueError(f"contraction mismatch: lhs {lhs.shape} vs rhs_t {rhs_t.shape} (K last in both)")
    f8, e8 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e8m0fnu)
    for name, t in (("lhs", lhs), ("rhs_t", rhs_t)):
        if jnp.dtype(t.data.dtype) != f8 or jnp.dtype(t.scale.dtype) != e8:
            raise TypeError(
                f"{name} must hold float8_e4m3fn data and float8_e8m0fnu scales, got "
                f"{t.data.dtype} and {t.scale.dtype}"
            )
    kb = cdiv(k, mxfp8.BLOCK)
    if lhs.scale.shape != (m, kb) or rhs_t.scale.shape != (g, n, kb):
        raise ValueError(
            f"scale shapes {lhs.scale.shape} / {rhs_t.scale.shape} do not match the data "
            f"(want {(m, kb)} / {(g, n, kb)})"
        )
    if not all(isinstance(d, int) for d in (m, n, k, g)):
        raise ValueError("grouped_gemm_fp8_cuda needs static shapes")
    if k % 16 or n % 8:
        raise ValueError(f"grouped_gemm_fp8_cuda needs K % 16 == 0 and N % 8 == 0 (TMA strides), got {k=} {n=}")
    if m * k >= _MAX or m * n >= _MAX or g * k * n >= _MAX or g * kb * (n + 256) >= _MAX:
        raise ValueError(f"operands must have < 2^31 elements each, got {m=} {n=} {k=} {g=}")
    gs = jnp.asarray(group_sizes)
    if gs.shape != (g,) or not jnp.issubdtype(gs.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be an integer [{g}] array, got {gs.shape=} {gs.dtype=}")
    return m, n, k, g


def _variant_index(variant: str | None) -> tuple[str, np.int32]:
    names = grouped_gemm_fp8_variants()
    variant = default_fp8_variant(names) if variant is None else variant
    if variant not in names:
        raise ValueError(f"{variant=} is not one of the compiled {names}")
    return variant, np.int32(names.index(variant))


def grouped_gemm_fp8_raw(
    a: jax.Array, b: jax.Array, sa: jax.Array, sb: jax.Array, group_sizes: jax.Array, *, variant: str
) -> jax.Array:
    """The custom call on operands already in the kernel's layout (see the kernel docstring):
    ``a [M, K]``, ``b [G, N, K]`` float8_e4m3fn, ``sa`` = :func:`lhs_scales`, ``sb`` =
    :func:`rhs_scales` for the variant's tile width. Checks shapes only (the handler
    re-checks them); for benchmarks that time the kernel alone."""
    if not ffi.available():
        raise RuntimeError("the CUDA extension jax_grouped_mlp._kernels is not built")
    variant, index = _variant_index(variant)
    m, k = a.shape
    g, n, _ = b.shape
    kb, t = cdiv(k, mxfp8.BLOCK), tile_n(variant)
    if sa.shape != (kb, cdiv(m, 4) * 4) or sb.shape != (g, kb, cdiv(n, t) * t):
        raise ValueError(f"scale layouts {sa.shape=} {sb.shape=} do not match {a.shape=} {b.shape=} for {variant}")
    out = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    return jax.ffi.ffi_call(GROUPED_GEMM_FP8_TARGET, out)(
        a, b, sa.astype(jnp.float32), sb.astype(jnp.float32), group_sizes.astype(jnp.int32), variant=index
    )


def grouped_gemm_fp8_cuda(
    lhs: MXFP8Tensor, rhs_t: MXFP8Tensor, group_sizes: jax.Array, *, variant: str | None = None
) -> jax.Array:
    """MXFP8 grouped GEMM on FP8 tensor cores: ``lhs [M, K]`` x ``rhs_t [G, N, K]`` -> bf16 ``[M, N]``.

    Both operands blocked along K (``lhs.axis == 1``, ``rhs_t.axis == 2``); ``K % 16 == 0``,
    ``N % 8 == 0``. Raises ``TypeError``/``ValueError`` at trace time for anything else,
    and ``RuntimeError`` without the CUDA extension. Lowers only for CUDA.
    """
    _check_operands(lhs, rhs_t, group_sizes)
    if not ffi.available():
        raise RuntimeError("the CUDA extension jax_grouped_mlp._kernels is not built")
    variant, _ = _variant_index(variant)
    return grouped_gemm_fp8_raw(
        lhs.data, rhs_t.data, lhs_scales(lhs.scale), rhs_scales(rhs_t.scale, tile_n(variant)),
        jnp.asarray(group_sizes), variant=variant,
    )
