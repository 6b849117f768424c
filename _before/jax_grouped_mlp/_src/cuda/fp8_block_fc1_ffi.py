"""XLA FFI binding of the FP8 block-scaled grouped GEMM with the FC1 epilogue
(``csrc/grouped_gemm_fp8_block_fc1.cc``, kernel ``kernels/grouped_gemm_fp8_block_fc1_sm90.py``).

``grouped_mlp``'s ``fp8_block`` forward reaches it through ``primitives.fp8_block_fc1``:
one kernel writes ``h`` and both ``fp8_block`` copies of ``a = probs * relu(h)**2``, bit
for bit what the FP8 GEMM followed by the pair quantizer writes, without ``h``'s second
read or a bf16 ``a`` in global memory. What the kernel cannot take raises
:class:`ffi.Unsupported` at trace time (the dispatcher then composes the unfused
primitives).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src import groups
from jax_grouped_mlp._src.cuda import ffi, gemm_ffi
from jax_grouped_mlp._src.cuda.ffi import Unsupported
from jax_grouped_mlp._src.formats import fp8_block
from jax_grouped_mlp._src.formats.fp8_block import FP8BlockTensor
from jax_grouped_mlp.kernels import registry

TARGET = "jgm_grouped_gemm_fp8_block_fc1"
_MAX = 2**31


def variants() -> tuple[str, ...]:
    """Names of the compiled FC1-epilogue FP8 GEMMs (empty without the extension)."""
    return ffi.variants("GROUPED_GEMM_FP8_BLOCK_FC1_VARIANTS")


def grouped_gemm_fp8_block_fc1(
    lhs: FP8BlockTensor,
    rhs: FP8BlockTensor,
    group_sizes: jax.Array,
    probs: jax.Array,
    *,
    variant: str | None = None,
) -> tuple[jax.Array, FP8BlockTensor, FP8BlockTensor]:
    """FC1 of the ``fp8_block`` recipe with its epilogue: ``(h, a_row, a_col)`` from one kernel.

    ``h = gemm_ffi.grouped_gemm_fp8_block(lhs, rhs, group_sizes)`` (bf16 ``[M, N]``, the
    same bits), and with ``a = activation.srelu_scaled(h, probs)``: ``a_row =
    quantize_fp8_block(a, 1)`` and ``a_col = quantize_fp8_block(a, 0,
    group_sizes=group_sizes)`` (rows past the groups zero), i.e. bit for bit
    ``fp8_block_ffi.quantize_pair_cuda(a, group_sizes, keep_col=True)``.

    Operands and shape contract as :func:`gemm_ffi.grouped_gemm_fp8_block` (``lhs [M, K]``
    blocked along K, ``rhs [G, N, K]`` in 128 x 128 tiles, K % 16 == 0, N % 8 == 0, static
    shapes), plus ``probs`` float ``[M]`` (cast to float32) and ``G > 0``, ``K > 0``.

    Raises:
      TypeError, ValueError: naming the argument (as the plain GEMM's binding).
      Unsupported: G or K is 0, or a column-scale array of 2^31 elements or more.
      RuntimeError: the extension is not built.
    """
    m, k, g, n = gemm_ffi.checked_fp8_block_gemm_operands(lhs, rhs)
    rows = fp8_block.grouped_scale_rows(m, g)
    if m * k >= _MAX or m * n >= _MAX or g * n * k >= _MAX or rows * n >= _MAX:
        raise Unsupported(f"grouped_gemm_fp8_block_fc1: every array needs < 2^31 elements, got {m=} {n=} {k=} {g=}")
    if g == 0 or k == 0:
        raise Unsupported(f"grouped_gemm_fp8_block_fc1: needs G > 0 and K > 0, got {g=} {k=}")
    gs = gemm_ffi._checked_group_sizes(group_sizes, g, m)
    probs = gemm_ffi._checked_probs(probs, m)
    if not ffi.available():
        raise RuntimeError("the CUDA extension jax_grouped_mlp._kernels is not built")
    names = variants()
    if variant is None:
        variant = gemm_ffi.fp8_block_default_variant(n, names, registry.Family.GROUPED_GEMM_FP8_BLOCK_FC1)
    if variant not in names:
        raise ValueError(f"variant must be one of the compiled {names}, got {variant=}")
    nb = groups.cdiv(n, fp8_block.BLOCK)
    out = (
        jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((m, n), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((m, nb), jnp.float8_e8m0fnu),
        jax.ShapeDtypeStruct((m, n), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((rows, n), jnp.float8_e8m0fnu),
    )
    h, row, row_scale, col, col_scale = jax.ffi.ffi_call(TARGET, out)(
        lhs.data, gemm_ffi.as_e8m0(lhs.scale), rhs.data, gemm_ffi.as_e8m0(rhs.scale), gs, probs, variant=np.int32(names.index(variant))
    )
    a_row = FP8BlockTensor(data=row, scale=row_scale, axes=(1,))
    return h, a_row, FP8BlockTensor(data=col, scale=col_scale, axes=(0,), group_sizes=gs)


def fp8_block_fc1_cuda(lhs, rhs, group_sizes: jax.Array, probs: jax.Array):
    """``primitives`` "fp8_block_fc1" on CUDA (the reference's signature: ``rhs`` is the
    K-major ``[G, N, K]`` weight). :class:`Unsupported` unless both operands are
    ``fp8_block`` tensors in the GEMM's layouts and the kernel is compiled."""
    if not variants():
        raise Unsupported("grouped_gemm_fp8_block_fc1 is not compiled into the extension")
    ok = (isinstance(lhs, FP8BlockTensor) and isinstance(rhs, FP8BlockTensor) and not lhs.is_grouped
          and not rhs.is_grouped and lhs.data.ndim == 2 and lhs.blocked_axes == (1,) and rhs.data.ndim == 3
          and rhs.blocked_axes == (1, 2))
    if not ok:
        raise Unsupported("grouped_gemm_fp8_block_fc1 takes fp8_block lhs [M, K] (1 x 128) and rhs [G, N, K] (tiles)")
    if lhs.data.shape[1] % 16 or rhs.data.shape[1] % 8:
        raise Unsupported(f"grouped_gemm_fp8_block_fc1 needs K % 16 == 0 and N % 8 == 0, got {lhs.shape=} {rhs.shape=}")
    return grouped_gemm_fp8_block_fc1(lhs, rhs, group_sizes, probs)
