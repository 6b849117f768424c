"""XLA FFI bindings of the ``fp8_block`` quantize kernels (``csrc/quantize_fp8_block.cc``,
kernel ``kernels/quantize_fp8_block.py``).

Two targets, bit for bit the pure-JAX quantizers of :mod:`formats.fp8_block` on bf16
input (the E4M3 conversion and the RCEIL scale rule are MXFP8's, which the MXFP8 kernels
already match exactly):

* ``jgm_quantize_fp8_block_pair``: from one read of an activation ``[M, K]``, the
  GEMM operand (1 x 128 blocks along K) and the weight-gradient operand (group-aware
  128-row blocks), the latter as E4M3 (a residual) or as its bf16 values (used at once);
* ``jgm_quantize_fp8_block``: one copy: a weight ``[G, A, B]`` in 128 x 128 tiles (as
  stored, what a data gradient reads, or transposed to ``[G, B, A]``, the K-major copy a
  forward GEMM reads), or an activation's 1 x 128 rowwise copy alone (a forward that is
  not differentiated).

Whatever the kernels cannot take (another dtype, symbolic shapes, ``K % 8 != 0``,
offsets past 32 bits, no compiled variant) raises :class:`ffi.Unsupported` at trace time
and ``primitives`` runs the reference. Lowers only for CUDA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src import groups
from jax_grouped_mlp._src.cuda import ffi
from jax_grouped_mlp._src.cuda.ffi import Unsupported
from jax_grouped_mlp._src.formats import fp8_block
from jax_grouped_mlp._src.formats.fp8_block import FP8BlockTensor, TokenMajorBlocks
from jax_grouped_mlp.kernels import registry

PAIR_TARGET = "jgm_quantize_fp8_block_pair"
TARGET = "jgm_quantize_fp8_block"


def pair_variants() -> tuple[str, ...]:
    """Names of the compiled activation-quantizer configurations (empty without the extension)."""
    return ffi.variants("QUANTIZE_FP8_BLOCK_PAIR_VARIANTS")


def single_variants() -> tuple[str, ...]:
    """Names of the compiled one-copy (weight tiles, rowwise) configurations (empty without the extension)."""
    return ffi.variants("QUANTIZE_FP8_BLOCK_VARIANTS")


def _mode_variant(names: tuple[str, ...], mode: str) -> np.int32:
    """The ``variant`` attribute of the first compiled variant of ``mode``, or Unsupported."""
    for i, v in enumerate(names):
        if registry.variant(v).mode == mode:
            return np.int32(i)
    raise Unsupported(f"no quantize_fp8_block variant of mode {mode!r} is compiled")


def _fits(x: jax.Array, num_groups) -> bool:
    """bf16 ``[M, K]``, static sizes, ``K % 8 == 0`` (16-byte loads of 8 columns per
    thread), and 32-bit offsets for the data and the group-aware scale rows."""
    if x.ndim != 2 or jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16):
        return False
    m, k = x.shape
    if not all(isinstance(d, int) for d in (m, k, num_groups)):
        return False
    return k % 8 == 0 and m * k < 2**31 and fp8_block.grouped_scale_rows(m, num_groups) * k < 2**31


def _pair_call(x: jax.Array, group_sizes: jax.Array, mode: str) -> tuple[FP8BlockTensor, jax.Array, jax.Array, jax.Array]:
    """The pair kernel in ``mode`` ("pair", "pair_bf16", "pair_tm"): ``(row tensor, col
    data, col scale, clamped group sizes)``, or :class:`Unsupported`."""
    g = jnp.shape(group_sizes)[0] if jnp.ndim(group_sizes) == 1 else None
    if not ffi.available() or not pair_variants() or g is None or not _fits(x, g):
        raise Unsupported(f"quantize_fp8_block_pair kernel: needs bf16 [M, K], K % 8 == 0, got {x.shape=} {x.dtype=}")
    variant = _mode_variant(pair_variants(), mode)
    m, k = x.shape
    kb, nb = groups.cdiv(k, fp8_block.BLOCK), fp8_block.grouped_scale_rows(m, g)
    col = {"pair": ((m, k), jnp.float8_e4m3fn), "pair_bf16": ((m, k), jnp.bfloat16),
           "pair_tm": ((k, 128 * nb), jnp.float8_e4m3fn)}[mode]  # fmt: skip
    if col[0][0] * col[0][1] >= 2**31:
        raise Unsupported(f"quantize_fp8_block_pair kernel ({mode}): the column copy needs 32-bit offsets, got {x.shape=}")
    out = (
        jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((m, kb), jnp.float8_e8m0fnu),
        jax.ShapeDtypeStruct(*col),
        jax.ShapeDtypeStruct((nb, k), jnp.float8_e8m0fnu),
    )
    gs = groups.clamp_group_sizes(group_sizes, m)
    row, row_scale, col_data, col_scale = jax.ffi.ffi_call(PAIR_TARGET, out)(x, gs, variant=variant)
    return FP8BlockTensor(data=row, scale=row_scale, axes=(1,)), col_data, col_scale, gs


def quantize_pair_cuda(
    x: jax.Array, group_sizes: jax.Array, *, keep_col: bool
) -> tuple[FP8BlockTensor, FP8BlockTensor | jax.Array]:
    """``primitives`` "fp8_block_pair" on CUDA: one kernel, one read of bf16 ``x [M, K]``.

    Returns ``(quantize_fp8_block(x, 1), col)``: ``col`` is
    ``quantize_fp8_block(x, 0, group_sizes=group_sizes)`` (``keep_col``), or its
    dequantized bf16 values (rows past the groups 0). :class:`Unsupported` when the kernel
    does not take ``x``.
    """
    row, col, col_scale, gs = _pair_call(x, group_sizes, "pair" if keep_col else "pair_bf16")
    if keep_col:
        return row, FP8BlockTensor(data=col, scale=col_scale, axes=(0,), group_sizes=gs)
    return row, col


def quantize_pair_token_major_cuda(x: jax.Array, group_sizes: jax.Array) -> tuple[FP8BlockTensor, TokenMajorBlocks]:
    """``primitives`` "fp8_block_pair_tm" on CUDA (mode "pair_tm"): ``x``'s rowwise copy
    and its group-aware copy already laid out as the FP8 weight gradient reads it, from
    one read: ``(quantize_fp8_block(x, 1), to_token_major(quantize_fp8_block(x, 0,
    group_sizes=group_sizes)))``, the same bytes (data ``[K, 128 NB]``, scale ``[NB,
    K]``). :class:`Unsupported` when the kernel does not take ``x``."""
    row, col, col_scale, gs = _pair_call(x, group_sizes, "pair_tm")
    return row, TokenMajorBlocks(data=col, scale=col_scale, group_sizes=gs, rows=x.shape[0])


def quantize_weight_cuda(w: jax.Array, *, k_major: bool = False) -> FP8BlockTensor:
    """``primitives`` "fp8_block_weight" on CUDA: ``quantize_fp8_block(w, (1, 2))`` of a
    bf16 weight ``[G, A, B]`` in one kernel (the weight read as ``[G * A, B]``, each
    expert's rows one group). ``k_major``: its transpose ``[G, B, A]``
    (``transpose_tiles`` of it, the same bytes) written by the same kernel, no transposing
    pass; needs ``A % 16 == 0``. :class:`Unsupported` when the kernel does not take it."""
    if w.ndim != 3 or not ffi.available() or not single_variants():
        raise Unsupported(f"quantize_fp8_block kernel (tile): needs a bf16 [G, A, B] weight, got {w.shape=}")
    g, a, b = w.shape
    flat = w.reshape(g * a, b) if all(isinstance(d, int) for d in w.shape) else w
    if flat.ndim != 2 or not _fits(flat, g):
        raise Unsupported(f"quantize_fp8_block kernel (tile): needs bf16, B % 8 == 0, 32-bit offsets, got {w.shape=} {w.dtype=}")
    mode = "tile_t" if k_major else "tile"
    if k_major and (a % 16 or a == 0):
        raise Unsupported(f"quantize_fp8_block kernel (tile_t): needs A % 16 == 0 and A > 0, got {w.shape=}")
    m = g * a
    ab, kb = groups.cdiv(a, fp8_block.BLOCK), groups.cdiv(b, fp8_block.BLOCK)
    nb = fp8_block.grouped_scale_rows(m, g)
    out = (
        jax.ShapeDtypeStruct((g * b, a) if k_major else (m, b), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((nb, kb), jnp.float8_e8m0fnu),
    )
    sizes = jnp.full((g,), a, jnp.int32)
    data, scale = jax.ffi.ffi_call(TARGET, out)(flat, sizes, variant=_mode_variant(single_variants(), mode))
    # Group g's blocks are scale rows [g * ab, (g + 1) * ab); the G trailing rows are unused.
    scale = scale[: g * ab].reshape(g, ab, kb)
    if k_major:
        return FP8BlockTensor(data=data.reshape(g, b, a), scale=jnp.swapaxes(scale, 1, 2), axes=(1, 2))
    return FP8BlockTensor(data=data.reshape(g, a, b), scale=scale, axes=(1, 2))


def quantize_row_cuda(x: jax.Array) -> FP8BlockTensor:
    """``primitives`` "fp8_block_row" on CUDA: ``quantize_fp8_block(x, 1)`` of bf16
    ``[M, K]`` in one kernel. :class:`Unsupported` when the kernel does not take ``x``."""
    if not ffi.available() or not single_variants() or not _fits(x, 0):
        raise Unsupported(f"quantize_fp8_block kernel (row): needs bf16 [M, K], K % 8 == 0, got {x.shape=} {x.dtype=}")
    m, k = x.shape
    out = (
        jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((m, groups.cdiv(k, fp8_block.BLOCK)), jnp.float8_e8m0fnu),
    )
    data, scale = jax.ffi.ffi_call(TARGET, out)(
        x, jnp.zeros((0,), jnp.int32), variant=_mode_variant(single_variants(), "row")
    )
    return FP8BlockTensor(data=data, scale=scale, axes=(1,))
