"""MXFP8: FP8 E4M3 data with one E8M0 (power-of-two) scale per 32 elements.

The scale rule is RCEIL, bit-identical to the mxfp8 quantizer inside JAX's
``jax.nn.scaled_dot_general`` (and TransformerEngine's) for finite inputs:

1. ``amax`` = max of ``|x|`` over the 32-element block;
2. ``s = amax / 448`` computed in float32 and rounded to the *input* dtype (bf16
   inputs round here, exactly like JAX's quantizer does);
3. the scale byte ``e`` is ``s`` rounded *up* to a power of two (``2**(e - 127)``),
   so that no element saturates (the one exception is the rounding of step 2,
   which is why the data are still clipped to ±448);
4. ``data = e4m3(clip(x * 2**(127 - e), -448, 448))``, round-to-nearest-even.

Special values, documented behaviour:

* all-zero block: scale byte 0 (``2**-127``), data ±0 (the sign is kept). JAX's own
  quantizer divides by the subnormal ``2**-127`` and yields NaN on backends that
  flush subnormals (XLA:CPU); we multiply by the normal ``2**127`` instead.
* subnormal inputs may be flushed to zero by the backend's float32 arithmetic.
* a block that holds a NaN or ±Inf: scale byte ``0xFF`` (E8M0 NaN) and every data
  element NaN, so the whole block dequantizes to NaN.
* an element within about 3 % of float32's (and bfloat16's) largest finite value
  (above ``248 * 2**120``, about 3.297e38): step 4 rounds its data up to 256 under a
  scale of ``2**120``, which dequantizes to ``2**128``, i.e. ±Inf (3.3e38 does, 3.2e38
  does not). The same holds for the fp8_block format's 128-blocks.

An axis whose length is not a multiple of 32 is padded with zeros internally
(zeros never change a block's amax); ``data`` keeps the input's shape and ``scale``
has ``cdiv(n, 32)`` entries along the blocked axis.

The *group-aware* variant blocks along the token axis (axis 0 of ``[M, K]``) in
32-row blocks that never cross a group boundary; see :func:`quantize_mxfp8_grouped`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src import groups
from jax_grouped_mlp._src.formats.derivatives import refuse_derivative
from jax_grouped_mlp._src.formats.tensor_base import BlockScaled
from jax_grouped_mlp._src.op.validation import as_array

BLOCK = 32
E4M3_MAX = 448.0
E8M0_NAN = 0xFF
_SUPPORTED_INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXFP8Tensor(BlockScaled):
    """An MXFP8-quantized array (a pytree; ``axis`` and ``rank`` are static metadata).

    Attributes:
      data: float8_e4m3fn, the shape of the original array.
      scale: float8_e8m0fnu. For a plain tensor, the original shape with the blocked
        axis shrunk to ``cdiv(n, 32)``. For a group-aware tensor (``group_sizes`` set,
        ``axis == 0``), ``[cdiv(M, 32) + G, K]``: group ``g`` owns consecutive scale
        rows starting at the exclusive cumsum of ``cdiv(size_g, 32)``; unused rows
        are byte 0.
      axis: the blocked axis (non-negative) of the array as it was quantized, a rank
        ``rank`` array.
      group_sizes: None, or the int32 ``[G]`` group sizes of a group-aware tensor.
      rank: the rank of ``data`` when the tensor was made (filled in from ``data``
        when not given). ``data`` may have ``batch_ndim = data.ndim - rank`` more
        *leading* axes: a tensor returned by ``jax.vmap`` (default ``out_axes=0``) or
        stacked as the ``ys`` of ``jax.lax.scan`` is the per-example tensor with batch
        axes in front of ``data``, ``scale`` and ``group_sizes``, and its blocked axis
        in ``data`` is ``blocked_axis = axis + batch_ndim``. Fewer axes
        (``batch_ndim < 0``) are leading axes sliced off by ``vmap``/``scan`` over a
        tensor; the blocked axis itself cannot be sliced off.

    ``axis`` and ``rank`` are static (in the pytree structure) and record how the tensor
    was made, so two tensors of the same bytes made differently, e.g. one quantized per
    layer and one sliced from a tensor quantized whole, are different pytrees: JAX
    refuses to mix them as the two branches of ``jax.lax.cond`` or a ``scan`` carry
    (its error quotes these fields' values). Make both the same way.
    """

    data: jax.Array
    scale: jax.Array
    axis: int = dataclasses.field(metadata=dict(static=True))
    group_sizes: jax.Array | None = None
    rank: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def blocked_axis(self) -> int:
        """The blocked axis of ``data`` as it is now: ``axis + batch_ndim``."""
        return self.axis + self.batch_ndim

    def swap_last_axes(self) -> "MXFP8Tensor":
        """Transposes the last two axes of data and scale (e.g. ``[G,F,H]`` -> ``[G,H,F]``)."""
        if self.is_grouped:
            raise ValueError("swap_last_axes is not defined for group-aware tensors")
        nd = self.data.ndim
        if min(nd, self.rank) < 2:
            raise ValueError(f"swap_last_axes needs rank >= 2, got {self.data.shape=} {self.rank=}")
        perm = list(range(nd - 2)) + [nd - 1, nd - 2]
        new_axis = {nd - 1: nd - 2, nd - 2: nd - 1}.get(self.blocked_axis, self.blocked_axis) - self.batch_ndim
        return MXFP8Tensor(
            jnp.transpose(self.data, perm), jnp.transpose(self.scale, perm), new_axis, rank=self.rank
        )


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def check_rank(t, arg: str = "t") -> int:
    """``t.batch_ndim`` after checking that ``t.rank`` is a positive int; a ValueError
    naming ``arg`` otherwise."""
    if not _is_int(t.rank) or t.rank < 1:
        raise ValueError(f"{arg}.rank must be a positive int (the rank of {arg}.data when it was quantized), "
                         f"got {arg}.rank={t.rank!r}")
    return t.data.ndim - int(t.rank)


# The likeliest cause of a stacked tensor whose scale does not fit: vmap moved the
# batch axis (the tensor's fields count batch axes first).
VMAP_OUT_AXES_HINT = (" (a tensor made under jax.vmap needs its batch axes first: out_axes=0, the default, "
                      "then move axes on the dequantized array)")


def check_group_sizes(t, arg: str, b: int) -> None:
    """A group-aware tensor's ``group_sizes``: an integer ``[*batch, G]`` array whose
    batch axes are ``data``'s ``b`` leading ones; a TypeError/ValueError naming ``arg``."""
    gs = t.group_sizes
    if not hasattr(gs, "dtype") or jnp.ndim(gs) != 1 + b or not jnp.issubdtype(gs.dtype, jnp.integer):
        after = f" (after the {b} batch axes of {arg}.data)" if b else ""
        raise TypeError(f"{arg}.group_sizes must be a 1-D integer array or None{after}, got {arg}.group_sizes={gs!r}")
    if tuple(gs.shape[:b]) != tuple(t.data.shape[:b]):
        raise ValueError(f"{arg}.group_sizes must have {arg}.data's batch axes {tuple(t.data.shape[:b])} in front, "
                         f"got {arg}.group_sizes.shape={tuple(gs.shape)}")


def per_example(dequantize_fn, t, dtype) -> jax.Array:
    """``dequantize_fn(t, dtype)`` of a tensor stacked by vmap/scan, one example at a time
    (``jax.vmap`` over its ``t.batch_ndim`` leading axes): for group-aware tensors, whose
    examples each have their own groups."""
    f = functools.partial(dequantize_fn, dtype=dtype)
    for _ in range(t.batch_ndim):
        f = jax.vmap(f)
    return f(t)


def _check_input(x: jax.Array, name: str = "x") -> None:
    if jnp.dtype(x.dtype) not in _SUPPORTED_INPUT_DTYPES:
        raise TypeError(
            f"{name} must be bfloat16 or float32 to quantize to MXFP8, got {name}.dtype={x.dtype}"
        )


def _normalize_axis(axis: int, ndim: int, name: str = "axis") -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got {name}={axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}={axis} is out of range for an array of rank {ndim}")
    return int(axis) % ndim


def scale_bytes(amax: jax.Array, src_dtype: jnp.dtype) -> jax.Array:
    """The RCEIL E8M0 scale byte (uint8) for block maxima ``amax`` of a ``src_dtype`` tensor."""
    s = (amax.astype(jnp.float32) / E4M3_MAX).astype(src_dtype).astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(s, jnp.uint32)
    exp = bits >> 23
    mant = bits & 0x7FFFFF
    # Round the exponent up unless s is already a power of two; for subnormal s the
    # value 2**-127 (mantissa <= 0x400000) is representable as exponent 0.
    round_up = (mant > 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
    e = exp + round_up.astype(jnp.uint32)
    e = jnp.where(jnp.isfinite(s), e, E8M0_NAN)
    return e.astype(jnp.uint8)


def _reciprocal_scale(e: jax.Array) -> jax.Array:
    """``2**(127 - e)`` as float32 (always a normal number for e in [0, 254]); NaN for 0xFF."""
    e32 = e.astype(jnp.int32)
    recip_bits = jnp.clip(254 - e32, 1, 254).astype(jnp.uint32) << 23
    recip = jax.lax.bitcast_convert_type(recip_bits, jnp.float32)
    return jnp.where(e32 == E8M0_NAN, jnp.float32(jnp.nan), recip)


def _scale_value(e: jax.Array) -> jax.Array:
    """``2**(e - 127)`` as float32; NaN for 0xFF. ``e == 0`` gives the subnormal 2**-127."""
    e32 = e.astype(jnp.int32)
    normal = jax.lax.bitcast_convert_type(jnp.maximum(e32, 1).astype(jnp.uint32) << 23, jnp.float32)
    value = jnp.where(e32 == 0, jnp.float32(2.0**-127), normal)
    return jnp.where(e32 == E8M0_NAN, jnp.float32(jnp.nan), value)


def _encode(x: jax.Array, e: jax.Array) -> jax.Array:
    """FP8 data for ``x`` given the scale byte ``e`` broadcast to ``x``'s shape."""
    v = x.astype(jnp.float32) * _reciprocal_scale(e)
    v = jnp.clip(v, -E4M3_MAX, E4M3_MAX)
    return v.astype(jnp.float8_e4m3fn)


def _block_amax(xb: jax.Array, axis: int) -> jax.Array:
    """Max of |x| over a block axis; NaN if the block holds a NaN (Inf already propagates)."""
    a = jnp.abs(xb)
    amax = jnp.max(a, axis=axis)
    has_nan = jnp.any(jnp.isnan(xb), axis=axis)
    return jnp.where(has_nan, jnp.asarray(jnp.nan, amax.dtype), amax)


def quantize_mxfp8(x: jax.Array, axis: int = -1) -> MXFP8Tensor:
    """Quantizes ``x`` to MXFP8 with 32-element blocks along ``axis`` (RCEIL scales).

    Args:
      x: bfloat16 or float32 array of rank >= 1.
      axis: the blocked axis (normally the reduction axis of the GEMM that consumes it).

    Returns:
      An :class:`MXFP8Tensor` whose ``data`` has ``x``'s shape. See the module
      docstring for the rule and for zeros, subnormals, NaN and Inf.

    Not differentiable: differentiating through it (``jax.grad``, ``jax.jvp``) is a
    TypeError at trace time, since JAX's derivative would round the gradient to E4M3 on
    the block scales. Quantize ``jax.lax.stop_gradient(x)``; for straight-through fake
    quantization, with ``xs = stop_gradient(x)``, use ``(x.astype(f32) +
    (dequantize(quantize_mxfp8(xs), f32) - xs.astype(f32))).astype(x.dtype)`` (bitwise
    the quantized values, gradient 1); ``grouped_mlp``'s recipes are straight-through
    inside. (``dequantize`` is linear in
    ``t.data`` and differentiable.)
    """
    x = as_array("x", x)
    _check_input(x)
    if x.ndim == 0:
        raise ValueError("x must have rank >= 1 to be quantized, got a scalar")
    axis = _normalize_axis(axis, x.ndim)
    x = refuse_derivative("quantize_mxfp8", x)
    n = x.shape[axis]
    nb = groups.cdiv(n, BLOCK)
    xm = jnp.moveaxis(x, axis, -1)
    pad = nb * BLOCK - n
    if pad:
        xm = jnp.pad(xm, [(0, 0)] * (xm.ndim - 1) + [(0, pad)])
    xb = xm.reshape(xm.shape[:-1] + (nb, BLOCK))
    e = scale_bytes(_block_amax(xb, -1), x.dtype)
    data = _encode(xb, e[..., None]).reshape(xm.shape)[..., :n]
    return MXFP8Tensor(
        data=jnp.moveaxis(data, -1, axis),
        scale=jnp.moveaxis(jax.lax.bitcast_convert_type(e, jnp.float8_e8m0fnu), -1, axis),
        axis=axis,
    )


def grouped_scale_rows(m: int, num_groups: int) -> int:
    """Static number of scale rows of a group-aware tensor with ``m`` rows and ``num_groups`` groups."""
    return groups.num_tiles(m, num_groups, BLOCK)


def quantize_mxfp8_grouped(x: jax.Array, group_sizes: jax.Array) -> MXFP8Tensor:
    """Quantizes ``x [M, K]`` along the token axis in group-aware 32-row blocks.

    Row ``m`` of group ``g`` is in block ``first_block[g] + (m - start[g]) // 32``
    where ``first_block`` is the exclusive cumsum of ``cdiv(size_g, 32)``: a block
    never mixes two groups (each group's tail block is padded). Rows at or past
    ``sum(group_sizes)`` (clamped to ``M``) belong to no block and get data 0.
    Group sizes are read on the device; nothing is synchronised with the host. The
    tensor keeps them clamped (``groups.clamp_group_sizes``: int32, summing to at most
    ``M``), which describes the same blocks.

    Not differentiable (a TypeError at trace time), like :func:`quantize_mxfp8`.
    """
    x = as_array("x", x)
    _check_input(x)
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K] for group-aware quantization, got {x.shape=}")
    m, k = x.shape
    group_sizes = groups.checked_group_sizes(group_sizes, m)
    x = refuse_derivative("quantize_mxfp8_grouped", x)
    nblocks = grouped_scale_rows(m, group_sizes.shape[0])
    if m == 0:
        return MXFP8Tensor(
            data=jnp.zeros((0, k), jnp.float8_e4m3fn),
            # E8M0 has no zero: build byte 0 (2**-127) as uint8 and reinterpret.
            scale=jax.lax.bitcast_convert_type(jnp.zeros((nblocks, k), jnp.uint8), jnp.float8_e8m0fnu),
            axis=0,
            group_sizes=group_sizes,
        )
    # Gather each block's (at most 32) rows: [nblocks, 32, K], zero-filled. Unused
    # blocks are all zero and so get scale byte 0.
    xb, _, _ = groups.gather_tiles(x, groups.tile_layout(group_sizes, m, BLOCK))
    e = scale_bytes(_block_amax(xb, 1), x.dtype)
    block_of_row = groups.row_tile_ids(group_sizes, m, BLOCK)  # nblocks past the end
    row_e = e[jnp.minimum(block_of_row, nblocks - 1)]
    in_group = (block_of_row < nblocks)[:, None]
    data = jnp.where(in_group, _encode(x, row_e), jnp.zeros((), jnp.float8_e4m3fn))
    return MXFP8Tensor(
        data=data,
        scale=jax.lax.bitcast_convert_type(e, jnp.float8_e8m0fnu),
        axis=0,
        group_sizes=group_sizes,
    )


def _check_tensor(t: MXFP8Tensor) -> None:
    """Raises TypeError/ValueError, naming the field, for an MXFP8Tensor whose fields do not
    fit together (as a hand-built one may): dtypes, ``axis``, ``rank`` and ``scale``'s
    shape, batch axes included."""
    for name in ("data", "scale"):
        arr = getattr(t, name)
        if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise TypeError(f"t.{name} must be an array, got t.{name}={type(arr).__name__}")
    if jnp.dtype(t.data.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise TypeError(f"t.data must be float8_e4m3fn, got t.data.dtype={t.data.dtype}")
    if jnp.dtype(t.scale.dtype) not in (jnp.dtype(jnp.float8_e8m0fnu), jnp.dtype(jnp.uint8)):
        raise TypeError(f"t.scale must be float8_e8m0fnu (or its uint8 bytes), got t.scale.dtype={t.scale.dtype}")
    nd = t.data.ndim
    if nd == 0:
        raise ValueError("t.data must have rank >= 1, got a scalar")
    b = check_rank(t)
    shape = tuple(t.data.shape)
    if not _is_int(t.axis) or not 0 <= t.axis < t.rank:
        raise ValueError(f"t.axis must be an int in [0, {t.rank}) for t.data.shape={shape} (t.rank={t.rank}), "
                         f"got t.axis={t.axis!r}")
    axis = t.axis + b
    if axis < 0:
        raise ValueError(f"t.axis={t.axis} of a rank-{t.rank} tensor is not in t.data.shape={shape}: vmap or scan "
                         "sliced the blocked axis off")
    if t.is_grouped:
        gs = t.group_sizes
        if t.rank != 2 or t.axis != 0:
            raise ValueError(
                f"a group-aware tensor must be [M, K] blocked along axis 0, got t.data.shape={shape} t.axis={t.axis}"
                + (f" t.rank={t.rank}" if b else "")
            )
        check_group_sizes(t, "t", b)
        want = shape[:b] + (grouped_scale_rows(shape[b], gs.shape[-1]), shape[b + 1])
    else:
        want = shape[:axis] + (groups.cdiv(shape[axis], BLOCK),) + shape[axis + 1 :]
    if tuple(t.scale.shape) != want:
        raise ValueError(
            f"t.scale must have shape {want} for t.data.shape={shape} (axis {axis}"
            f"{', group-aware' if t.is_grouped else ''}{f', {b} batch axes' if b > 0 else ''}), "
            f"got t.scale.shape={tuple(t.scale.shape)}{VMAP_OUT_AXES_HINT if b > 0 else ''}"
        )


def dequantize(t: MXFP8Tensor, dtype: jnp.dtype = jnp.bfloat16) -> jax.Array:
    """Back to ``dtype``, a float dtype (exact for bfloat16 and float32 except below float32's
    normal range, and ±Inf for blocks quantized from values near float32's largest: the
    module docstring).

    Differentiable: linear in ``t.data`` (whose tangent is FP8 like the data). The
    quantizers themselves are not (:func:`quantize_mxfp8`).

    A tensor stacked by ``jax.vmap`` or ``jax.lax.scan`` (leading batch axes, see
    :class:`MXFP8Tensor`'s ``rank``), group-aware ones included, dequantizes to the
    stack of its examples' dequantized arrays.

    Raises:
      TypeError, ValueError: for a ``dtype`` that is not a float, or a (hand-built)
        tensor whose fields do not fit together: data not float8_e4m3fn, scale not
        E8M0 (or uint8 bytes), ``axis`` out of range or sliced off ``data``, or
        ``scale`` not the shape that ``data``, ``axis`` and ``rank`` (and
        ``group_sizes``) imply.
    """
    if not isinstance(t, MXFP8Tensor):
        hint = ": dequantize_fp8_block dequantizes that one" if type(t).__name__ == "FP8BlockTensor" else ""
        raise TypeError(f"t must be an MXFP8Tensor, got t={type(t).__name__}{hint}")
    try:
        out_dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a float dtype, got dtype={dtype!r}") from None
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"dtype must be a float dtype, got dtype={dtype!r}")
    dtype = out_dtype
    _check_tensor(t)
    if t.is_grouped and t.batch_ndim:  # stacked by vmap/scan: each example has its own groups
        return per_example(dequantize, t, dtype)
    e = jax.lax.bitcast_convert_type(t.scale, jnp.uint8)
    values = t.data.astype(jnp.float32)
    if t.is_grouped:
        m = t.data.shape[0]
        block_of_row = groups.row_tile_ids(t.group_sizes, m, BLOCK)
        nblocks = t.scale.shape[0]
        row_scale = _scale_value(e[jnp.minimum(block_of_row, nblocks - 1)])
        out = jnp.where((block_of_row < nblocks)[:, None], values * row_scale, 0.0)
        return out.astype(dtype)
    axis = t.blocked_axis
    n = t.data.shape[axis]
    scale = jnp.repeat(_scale_value(e), BLOCK, axis=axis, total_repeat_length=e.shape[axis] * BLOCK)
    scale = jax.lax.slice_in_dim(scale, 0, n, axis=axis)
    return (values * scale).astype(dtype)


def fake_quantize_pair(x: jax.Array, group_sizes: jax.Array, keep_col_fp8: bool):
    """Reference of ``primitives.fake_quantize_pair``: ``(dequantize(quantize_mxfp8(x, 1)),
    col)`` with ``col = quantize_mxfp8_grouped(x, group_sizes)``, dequantized to bf16
    unless ``keep_col_fp8``."""
    row = dequantize(quantize_mxfp8(x, axis=1), jnp.bfloat16)
    col = quantize_mxfp8_grouped(x, group_sizes)
    return row, (col if keep_col_fp8 else dequantize(col, jnp.bfloat16))
