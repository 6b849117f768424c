"""FP8 block scaling (DeepSeek-V3 style): FP8 E4M3 data, one E8M0 scale per 128-block.

The data and the scale rule are MXFP8's (:mod:`mxfp8`: RCEIL, i.e. the scale is
``amax / 448`` rounded *up* to a power of two, so no element saturates; the same
function computes the scale byte); only the blocks differ:

* ``1 x 128`` along one axis (``axis=k``): activations, blocked along the reduction
  axis K of the GEMM that reads them (x, the squared-ReLU output, dy, dh);
* ``128 x 128`` tiles over two axes (``axis=(i, j)``): weights ``[G, A, B]`` with
  ``axis=(1, 2)``. The tile is square, so one quantized copy serves a GEMM that
  reduces over A (fprop) and one that reduces over B (dgrad): its transpose is the
  same blocks;
* group-aware ``128 x 1`` blocks along the token axis of ``[M, K]``
  (``group_sizes`` given): the weight-gradient operands. A block never crosses a group
  boundary (each group's tail block is short), exactly as MXFP8's group-aware 32-row
  blocks (:func:`mxfp8.quantize_mxfp8_grouped`) with 128 rows.

Special values, as MXFP8 documents them: an all-zero block gets scale byte 0
(``2**-127``) and data ±0; subnormal inputs may be flushed by the backend's float32
arithmetic; a block that holds a NaN or ±Inf gets scale byte ``0xFF`` (E8M0 NaN) and
NaN data, so the *whole block* (128 elements, or a 128 x 128 weight tile)
dequantizes to NaN.

An axis whose length is not a multiple of 128 is padded with zeros internally (zeros
never change a block's amax): ``data`` keeps the input's shape, ``scale`` has
``cdiv(n, 128)`` entries along each blocked axis.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src import groups
from jax_grouped_mlp._src.formats import mxfp8
from jax_grouped_mlp._src.formats.derivatives import refuse_derivative
from jax_grouped_mlp._src.formats.tensor_base import BlockScaled
from jax_grouped_mlp._src.op.validation import as_array

BLOCK = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8BlockTensor(BlockScaled):
    """An FP8-block-quantized array (a pytree; ``axes`` and ``rank`` are static metadata).

    Attributes:
      data: float8_e4m3fn, the shape of the original array.
      scale: float8_e8m0fnu. For a plain tensor, the original shape with every axis in
        ``axes`` shrunk to ``cdiv(n, 128)`` (a weight ``[G, A, B]`` blocked over
        ``axes=(1, 2)`` has scale ``[G, cdiv(A, 128), cdiv(B, 128)]``). For a
        group-aware tensor (``group_sizes`` set, ``axes == (0,)``),
        ``[cdiv(M, 128) + G, K]``: group ``g`` owns consecutive scale rows starting at
        the exclusive cumsum of ``cdiv(size_g, 128)``; unused rows are byte 0.
      axes: the blocked axes (non-negative, increasing) of the array as it was
        quantized, a rank ``rank`` array: one axis for ``1 x 128`` blocks, two for
        ``128 x 128`` tiles.
      group_sizes: None, or the int32 ``[G]`` group sizes of a group-aware tensor.
      rank: the rank of ``data`` when the tensor was made (filled in from ``data``
        when not given). ``data`` may have ``batch_ndim = data.ndim - rank`` more
        *leading* axes: a tensor returned by ``jax.vmap`` (default ``out_axes=0``) or
        stacked as the ``ys`` of ``jax.lax.scan`` is the per-example tensor with batch
        axes in front of ``data``, ``scale`` and ``group_sizes``, and its blocked axes
        in ``data`` are ``blocked_axes``, each of ``axes`` plus ``batch_ndim``. Fewer
        axes (``batch_ndim < 0``) are leading axes sliced off by ``vmap``/``scan`` over
        a tensor (weights ``[L, G, A, B]`` quantized with ``axis=(2, 3)`` and scanned
        over ``L``); a blocked axis itself cannot be sliced off.

    ``axes`` and ``rank`` are static (in the pytree structure) and record how the tensor
    was made, so two tensors of the same bytes made differently, e.g. one quantized per
    layer and one sliced from a tensor quantized whole, are different pytrees: JAX
    refuses to mix them as the two branches of ``jax.lax.cond`` or a ``scan`` carry
    (its error quotes these fields' values). Make both the same way.
    """

    data: jax.Array
    scale: jax.Array
    axes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    group_sizes: jax.Array | None = None
    rank: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def blocked_axes(self) -> tuple[int, ...]:
        """The blocked axes of ``data`` as it is now: ``axes`` shifted by ``batch_ndim``."""
        b = self.batch_ndim
        return tuple(a + b for a in self.axes)


def _normalize_axes(axis, ndim: int) -> tuple[int, ...]:
    """``axis`` (an int or a pair of distinct ints) as sorted non-negative axes."""
    if isinstance(axis, (tuple, list)):
        if len(axis) != 2:
            raise ValueError(f"axis must be an int or a pair of axes (a 128 x 128 tile), got axis={axis!r}")
        axes = tuple(mxfp8._normalize_axis(a, ndim, "axis") for a in axis)
        if axes[0] == axes[1]:
            raise ValueError(f"axis must name two different axes for 128 x 128 tiles, got axis={axis!r}")
        return tuple(sorted(axes))
    return (mxfp8._normalize_axis(axis, ndim, "axis"),)


def _quantize_plain(x: jax.Array, axes: tuple[int, ...]) -> FP8BlockTensor:
    nd = x.ndim
    rest = [a for a in range(nd) if a not in axes]
    perm = rest + list(axes)
    inv = list(np.argsort(perm))
    xm = jnp.transpose(x, perm)  # blocked axes last
    lead = xm.shape[: len(rest)]
    sizes = [x.shape[a] for a in axes]
    nbs = [groups.cdiv(n, BLOCK) for n in sizes]
    pad = [(0, 0)] * len(rest) + [(0, nb * BLOCK - n) for n, nb in zip(sizes, nbs)]
    if any(p for _, p in pad):
        xm = jnp.pad(xm, pad)
    if len(axes) == 1:
        xb = xm.reshape(lead + (nbs[0], BLOCK))
        e = mxfp8.scale_bytes(mxfp8._block_amax(xb, -1), x.dtype)  # lead + (nb,)
        data = mxfp8._encode(xb, e[..., None])
    else:
        xb = xm.reshape(lead + (nbs[0], BLOCK, nbs[1], BLOCK))
        e = mxfp8.scale_bytes(mxfp8._block_amax(xb, (-3, -1)), x.dtype)  # lead + (nb0, nb1)
        data = mxfp8._encode(xb, e[..., :, None, :, None])
    data = data.reshape(xm.shape)[tuple([slice(None)] * len(rest) + [slice(0, n) for n in sizes])]
    return FP8BlockTensor(
        data=jnp.transpose(data, inv),
        scale=jnp.transpose(jax.lax.bitcast_convert_type(e, jnp.float8_e8m0fnu), inv),
        axes=axes,
    )


def grouped_scale_rows(m: int, num_groups: int) -> int:
    """Static number of scale rows of a group-aware tensor with ``m`` rows and ``num_groups`` groups."""
    return groups.num_tiles(m, num_groups, BLOCK)


def _quantize_grouped(x: jax.Array, group_sizes) -> FP8BlockTensor:
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K] for group-aware quantization, got x.shape={x.shape}")
    m, k = x.shape
    group_sizes = groups.checked_group_sizes(group_sizes, m)
    nblocks = grouped_scale_rows(m, group_sizes.shape[0])
    if m == 0:
        return FP8BlockTensor(
            data=jnp.zeros((0, k), jnp.float8_e4m3fn),
            scale=jax.lax.bitcast_convert_type(jnp.zeros((nblocks, k), jnp.uint8), jnp.float8_e8m0fnu),
            axes=(0,),
            group_sizes=group_sizes,
        )
    # Each block's (at most 128) rows, zero-filled: [nblocks, 128, K]. Unused blocks are
    # all zero and so get scale byte 0.
    xb, _, _ = groups.gather_tiles(x, groups.tile_layout(group_sizes, m, BLOCK))
    e = mxfp8.scale_bytes(mxfp8._block_amax(xb, 1), x.dtype)
    block_of_row = groups.row_tile_ids(group_sizes, m, BLOCK)  # nblocks past the end
    row_e = e[jnp.minimum(block_of_row, nblocks - 1)]
    in_group = (block_of_row < nblocks)[:, None]
    data = jnp.where(in_group, mxfp8._encode(x, row_e), jnp.zeros((), jnp.float8_e4m3fn))
    return FP8BlockTensor(
        data=data, scale=jax.lax.bitcast_convert_type(e, jnp.float8_e8m0fnu), axes=(0,), group_sizes=group_sizes
    )


def quantize_fp8_block(
    x: jax.Array, axis: int | tuple[int, int] = -1, *, group_sizes: jax.Array | None = None
) -> FP8BlockTensor:
    """Quantizes ``x`` to FP8 E4M3 with one power-of-two (E8M0) scale per 128-block.

    Args:
      x: bfloat16 or float32 array of rank >= 1.
      axis: an int: ``1 x 128`` blocks along that axis (an activation, blocked along
        the reduction axis of the GEMM that reads it). A pair of axes: ``128 x 128``
        tiles over them (a weight ``[G, A, B]``: ``axis=(1, 2)``; one copy serves
        the GEMM reducing over either axis).
      group_sizes: optional ``[G]`` integer sizes, read on the device: then ``x`` must
        be ``[M, K]`` and ``axis`` 0, and the blocks are 128 rows of one group
        (a weight-gradient operand): row ``m`` of group ``g`` is in block
        ``first_block[g] + (m - start[g]) // 128``, ``first_block`` the exclusive cumsum
        of ``cdiv(size_g, 128)``. Sizes summing past ``M`` are cut at ``M``; rows past
        the (cut) total get data 0. The tensor keeps the cut sizes (int32).

    Returns:
      An :class:`FP8BlockTensor` whose ``data`` has ``x``'s shape. The scale rule is
      MXFP8's (RCEIL); zeros, NaN and Inf behave as documented for
      :func:`quantize_mxfp8`, per 128-block (a NaN or Inf makes its whole block NaN).

    Not differentiable: differentiating through it is a TypeError at trace time (JAX's
    derivative would round the gradient to E4M3 on the block scales). Quantize
    ``jax.lax.stop_gradient(x)``; for straight-through fake quantization, with ``xs =
    stop_gradient(x)``, use ``(x.astype(f32) + (dequantize_fp8_block(quantize_fp8_block(xs,
    ...), f32) - xs.astype(f32))).astype(x.dtype)`` (bitwise the quantized values,
    gradient 1).
    ``dequantize_fp8_block`` is linear in ``t.data`` and differentiable.

    Raises:
      TypeError, ValueError: at trace time, naming the argument: ``x`` not
        bfloat16/float32 or a scalar, ``axis`` not an int or a pair of distinct axes
        in range, ``group_sizes`` not a 1-D integer array, or ``group_sizes`` with an
        ``x`` that is not ``[M, K]`` or an ``axis`` other than 0.
    """
    x = as_array("x", x)
    if jnp.dtype(x.dtype) not in mxfp8._SUPPORTED_INPUT_DTYPES:
        raise TypeError(f"x must be bfloat16 or float32 to quantize to FP8 blocks, got x.dtype={x.dtype}")
    if x.ndim == 0:
        raise ValueError("x must have rank >= 1 to be quantized, got a scalar")
    axes = _normalize_axes(axis, x.ndim)
    if group_sizes is None:
        return _quantize_plain(refuse_derivative("quantize_fp8_block", x), axes)
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K] for group-aware quantization, got x.shape={x.shape}")
    if axes != (0,):
        raise ValueError(f"group-aware blocks run along the token axis: axis must be 0, got axis={axis!r}")
    return _quantize_grouped(refuse_derivative("quantize_fp8_block", x), group_sizes)


def _scale_shape(t: FP8BlockTensor) -> tuple[int, ...]:
    shape = tuple(t.data.shape)
    if t.is_grouped:  # [*batch, M, K]
        b = t.batch_ndim
        return shape[:b] + (grouped_scale_rows(shape[b], t.group_sizes.shape[-1]), shape[b + 1])
    axes = t.blocked_axes
    return tuple(groups.cdiv(n, BLOCK) if a in axes else n for a, n in enumerate(shape))


def _check_tensor(t: FP8BlockTensor, arg: str = "t") -> None:
    """Raises TypeError/ValueError, naming the argument ``arg`` and the field, for a
    (hand-built) tensor whose fields do not fit together."""
    for field in ("data", "scale"):
        arr = getattr(t, field)
        if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise TypeError(f"{arg}.{field} must be an array, got {arg}.{field}={type(arr).__name__}")
    if jnp.dtype(t.data.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise TypeError(f"{arg}.data must be float8_e4m3fn, got {arg}.data.dtype={t.data.dtype}")
    if jnp.dtype(t.scale.dtype) not in (jnp.dtype(jnp.float8_e8m0fnu), jnp.dtype(jnp.uint8)):
        raise TypeError(f"{arg}.scale must be float8_e8m0fnu (or its uint8 bytes), got {arg}.scale.dtype={t.scale.dtype}")
    if t.data.ndim == 0:
        raise ValueError(f"{arg}.data must have rank >= 1, got a scalar")
    b = mxfp8.check_rank(t, arg)
    shape, rank, axes = tuple(t.data.shape), t.rank, t.axes
    ok = (
        isinstance(axes, tuple) and len(axes) in (1, 2)
        and all(mxfp8._is_int(a) and 0 <= a < rank for a in axes)
        and list(axes) == sorted(set(axes))
    )
    if not ok:
        raise ValueError(
            f"{arg}.axes must be one or two increasing axes in [0, {rank}) for {arg}.data.shape={shape} "
            f"({arg}.rank={rank}), got {arg}.axes={axes!r}"
        )
    if axes[0] + b < 0:
        raise ValueError(f"{arg}.axes={axes} of a rank-{rank} tensor are not all in {arg}.data.shape={shape}: "
                         "vmap or scan sliced a blocked axis off")
    if t.is_grouped:
        if rank != 2 or axes != (0,):
            raise ValueError(
                f"a group-aware tensor must be [M, K] blocked along axis 0, got {arg}.data.shape={shape} "
                f"{arg}.axes={axes}" + (f" {arg}.rank={rank}" if b else "")
            )
        mxfp8.check_group_sizes(t, arg, b)
    want = _scale_shape(t)
    if tuple(t.scale.shape) != want:
        raise ValueError(
            f"{arg}.scale must have shape {want} for {arg}.data.shape={shape} (axes {t.blocked_axes}"
            f"{', group-aware' if t.is_grouped else ''}{f', {b} batch axes' if b > 0 else ''}), "
            f"got {arg}.scale.shape={tuple(t.scale.shape)}{mxfp8.VMAP_OUT_AXES_HINT if b > 0 else ''}"
        )


def transpose_tiles(t: FP8BlockTensor) -> FP8BlockTensor:
    """The tensor of the transpose over ``t``'s two blocked axes (a weight ``[G, A, B]`` in
    128 x 128 tiles -> ``[G, B, A]``): data and scale transposed, nothing re-rounded.

    Exact, and equal to quantizing the transposed input (the tiles are square, so their
    elements, amax and scale are the same). This is how a GEMM that needs the other
    operand major mode (Hopper's FP8 wgmma reads both operands K-major) gets its copy.

    Raises:
      ValueError: ``t`` is not blocked over exactly two axes.
    """
    if not isinstance(t, FP8BlockTensor):
        raise TypeError(f"t must be an FP8BlockTensor, got t={type(t).__name__}")
    if len(t.axes) != 2 or t.is_grouped:
        raise ValueError(f"t must be blocked in 128 x 128 tiles over two axes, got t.axes={t.axes}")
    i, j = t.blocked_axes  # (the same axes of a stacked tensor's examples)
    if i < 0:
        raise ValueError(f"t.axes={t.axes} of a rank-{t.rank} tensor are not all in t.data.shape={t.shape}")
    return FP8BlockTensor(data=jnp.swapaxes(t.data, i, j), scale=jnp.swapaxes(t.scale, i, j), axes=t.axes,
                          rank=t.rank)


def token_major_blocks(t: FP8BlockTensor) -> tuple[jax.Array, jax.Array]:
    """A group-aware ``[M, K]`` tensor as the FP8 weight-gradient kernel reads it:
    ``(data [K, 128 * NB], scale [NB, K] float32)`` with ``NB = cdiv(M, 128) + G``.

    Block ``b`` (the scale row numbering of the tensor, :func:`quantize_fp8_block` with
    ``group_sizes``) occupies columns ``[128 b, 128 b + 128)`` of ``data``: its group's
    rows in order, then zeros up to the block's end; unused blocks are zero. Tokens are
    contiguous (Hopper's FP8 wgmma reads both operands K-major, and the weight
    gradient's K is the token axis). ``scale`` holds each byte's value ``2**(e - 127)``
    (NaN for 0xFF). Pure data movement: no value is re-rounded.

    Raises:
      ValueError: ``t`` is not group-aware.
    """
    tm = to_token_major(t)
    return tm.data, scale_values(tm)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenMajorBlocks:
    """A group-aware tensor in :func:`token_major_blocks`'s layout, with its scale bytes:
    how the backward's dy and dh columns travel from the quantizer that writes this
    layout directly to the FP8 weight gradient (internal; a pytree, ``rows`` static).

    Attributes:
      data: float8_e4m3fn ``[K, 128 * NB]``, ``NB = cdiv(rows, 128) + G``.
      scale: float8_e8m0fnu ``[NB, K]``: the group-aware tensor's scale, unchanged.
      group_sizes: the int32 ``[G]`` group sizes as passed (every consumer clamps them to
        ``rows``, as the layout does).
      rows: M, the token rows of the tensor this was laid out from.
    """

    data: jax.Array
    scale: jax.Array
    group_sizes: jax.Array
    rows: int = dataclasses.field(metadata=dict(static=True))

    @property
    def is_grouped(self) -> bool:
        return True


def check_token_major(t: TokenMajorBlocks, arg: str = "t") -> None:
    """Raises TypeError/ValueError, naming ``arg`` and the field, when ``t``'s fields do
    not fit together (dtypes; ``data [K, 128 * NB]`` and ``scale [NB, K]`` with ``NB =
    cdiv(rows, 128) + G``)."""
    if not isinstance(t, TokenMajorBlocks):
        raise TypeError(f"{arg} must be a TokenMajorBlocks, got {arg}={type(t).__name__}")
    gs = t.group_sizes
    if not hasattr(gs, "dtype") or jnp.ndim(gs) != 1 or not jnp.issubdtype(gs.dtype, jnp.integer):
        raise TypeError(f"{arg}.group_sizes must be a 1-D integer array, got {arg}.group_sizes={gs!r}")
    if jnp.dtype(t.data.dtype) != jnp.dtype(jnp.float8_e4m3fn) or jnp.ndim(t.data) != 2:
        raise TypeError(f"{arg}.data must be float8_e4m3fn [K, 128 * NB], got {t.data.dtype} {tuple(t.data.shape)}")
    if jnp.dtype(t.scale.dtype) not in (jnp.dtype(jnp.float8_e8m0fnu), jnp.dtype(jnp.uint8)):
        raise TypeError(f"{arg}.scale must be float8_e8m0fnu (or its uint8 bytes), got {arg}.scale.dtype={t.scale.dtype}")
    nb, k = grouped_scale_rows(t.rows, gs.shape[0]), t.data.shape[0]
    if tuple(t.data.shape) != (k, nb * BLOCK) or tuple(t.scale.shape) != (nb, k):
        raise ValueError(
            f"{arg}: rows={t.rows} and {gs.shape[0]} groups need data [K, {nb * BLOCK}] and scale [{nb}, K], "
            f"got {arg}.data.shape={tuple(t.data.shape)} {arg}.scale.shape={tuple(t.scale.shape)}"
        )


def to_token_major(t: FP8BlockTensor) -> TokenMajorBlocks:
    """``t`` (group-aware) in :func:`token_major_blocks`'s layout, scales kept as bytes.

    Raises:
      ValueError: ``t`` is not group-aware.
    """
    if not isinstance(t, FP8BlockTensor):
        raise TypeError(f"t must be an FP8BlockTensor, got t={type(t).__name__}")
    if not t.is_grouped:
        raise ValueError(f"t must be group-aware (quantize_fp8_block(x, 0, group_sizes=...)), got t.axes={t.axes}")
    _check_tensor(t)
    if t.batch_ndim:
        raise ValueError(f"t must be one [M, K] tensor, got t.data.shape={t.shape}: stacked by vmap or scan")
    m, k = t.data.shape
    nblocks = t.scale.shape[0]
    if m == 0:
        data = jnp.zeros((k, nblocks * BLOCK), jnp.float8_e4m3fn)
    else:
        tiles, _, _ = groups.gather_tiles(t.data, groups.tile_layout(t.group_sizes, m, BLOCK))
        data = tiles.reshape(nblocks * BLOCK, k).T
    return TokenMajorBlocks(data=data, scale=t.scale, group_sizes=t.group_sizes, rows=m)


def from_token_major(t: TokenMajorBlocks, arg: str = "t") -> FP8BlockTensor:
    """The group-aware ``[M, K]`` tensor back from its token-major layout (exact: each
    row read from its block's column; rows past the groups 0). ``arg`` names ``t`` in
    errors."""
    check_token_major(t, arg)
    m, (k, width) = t.rows, t.data.shape
    nblocks = width // BLOCK
    data = jnp.zeros((m, k), jnp.float8_e4m3fn)
    if m:
        layout = groups.tile_layout(t.group_sizes, m, BLOCK)
        block = groups.row_tile_ids(t.group_sizes, m, BLOCK)  # nblocks past the groups
        inside = block < nblocks
        b = jnp.minimum(block, nblocks - 1)
        col = b * BLOCK + jnp.clip(jnp.arange(m, dtype=jnp.int32) - layout.start[b], 0, BLOCK - 1)
        data = jnp.where(inside[:, None], t.data.T[col], jnp.zeros((), jnp.float8_e4m3fn))
    return FP8BlockTensor(data=data, scale=t.scale, axes=(0,), group_sizes=t.group_sizes)


def scale_values(t: FP8BlockTensor | TokenMajorBlocks) -> jax.Array:
    """``t``'s scales as float32 values ``2**(e - 127)`` (NaN for 0xFF), ``scale``'s shape."""
    return mxfp8._scale_value(jax.lax.bitcast_convert_type(t.scale, jnp.uint8))


def dequantize_fp8_block(t: FP8BlockTensor, dtype: jnp.dtype = jnp.bfloat16) -> jax.Array:
    """Back to ``dtype``, a float dtype: ``data * 2**(scale - 127)`` per block (exact in
    bfloat16 and float32 except below float32's normal range; rows of a group-aware
    tensor past its groups are 0).

    A tensor stacked by ``jax.vmap`` or ``jax.lax.scan`` (leading batch axes, see
    :class:`FP8BlockTensor`'s ``rank``), group-aware ones included, dequantizes to the
    stack of its examples' dequantized arrays.

    Raises:
      TypeError, ValueError: for a ``dtype`` that is not a float, or a (hand-built)
        tensor whose fields do not fit together (dtypes, ``axes``, ``rank``,
        ``scale``'s shape).
    """
    if not isinstance(t, FP8BlockTensor):
        hint = ": dequantize dequantizes that one" if type(t).__name__ == "MXFP8Tensor" else ""
        raise TypeError(f"t must be an FP8BlockTensor, got t={type(t).__name__}{hint}")
    try:
        out_dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a float dtype, got dtype={dtype!r}") from None
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"dtype must be a float dtype, got dtype={dtype!r}")
    _check_tensor(t)
    if t.is_grouped and t.batch_ndim:  # stacked by vmap/scan: each example has its own groups
        return mxfp8.per_example(dequantize_fp8_block, t, out_dtype)
    e = jax.lax.bitcast_convert_type(t.scale, jnp.uint8)
    values = t.data.astype(jnp.float32)
    if t.is_grouped:
        m = t.data.shape[0]
        nblocks = t.scale.shape[0]
        block_of_row = groups.row_tile_ids(t.group_sizes, m, BLOCK)
        row_scale = mxfp8._scale_value(e[jnp.minimum(block_of_row, nblocks - 1)])
        return jnp.where((block_of_row < nblocks)[:, None], values * row_scale, 0.0).astype(out_dtype)
    scale = mxfp8._scale_value(e)
    for a in t.blocked_axes:
        n = t.data.shape[a]
        scale = jnp.repeat(scale, BLOCK, axis=a, total_repeat_length=scale.shape[a] * BLOCK)
        scale = jax.lax.slice_in_dim(scale, 0, n, axis=a)
    return (values * scale).astype(out_dtype)
