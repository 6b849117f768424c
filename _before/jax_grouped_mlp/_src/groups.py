"""Device-side bookkeeping for ragged groups of rows.

Tokens are sorted by expert: group ``g`` owns rows ``[start[g], end[g])`` of an
``[M, ...]`` array. Everything here is computed on the device from ``group_sizes``
(no host sync) and is clamped so that no index ever leaves ``[0, M)``: sizes that
sum past ``M`` are cut at ``M``, negative sizes count as zero, and rows at or past
the (clamped) total belong to no group. The clamping happens before any sum, so sizes
whose running sum passes 2**31 (or int64 sizes past the int32 range) cut at ``M``
like any others instead of wrapping: :func:`clamp_group_sizes`, which the public entry
points and the CUDA bindings apply, so a kernel only ever sees sizes summing to ``<= M``.

A *tile layout* splits every group into tiles of ``tile`` rows that never cross a
group boundary (the last tile of a group may be short). There are at most
``cdiv(M, tile) + G`` such tiles, which is the static number of tiles we allocate;
unused trailing tiles have length 0. With ``tile=32`` the tiles are exactly the
group-aware MXFP8 blocks along the token axis.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

_INT32_MAX = 2**31 - 1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def host_clip(group_sizes):
    """Integer NumPy (or list/tuple) sizes clipped to ``[0, 2**31 - 1]`` on the host, as int32.

    With x64 disabled, ``jnp.asarray`` of an int64 array wraps values past the int32
    range (``2**40`` becomes 0), and of a Python int past it raises: clipping first
    keeps them "huge", so they are cut at ``M`` like any other. Anything else (device
    arrays, tracers, non-integer input, which the caller rejects) is returned unchanged.

    Raises:
      TypeError: naming ``group_sizes``, for bools (a NumPy bool array, or a bool among
        a list's elements, which NumPy would otherwise count as a size of 0 or 1).
    """
    if isinstance(group_sizes, jax.Array) or not isinstance(
        group_sizes, (np.ndarray, np.generic, list, tuple)
    ):
        return group_sizes
    _refuse_bools(group_sizes)
    try:
        arr = np.asarray(group_sizes)
    except (TypeError, ValueError):
        return group_sizes
    if arr.dtype == object:  # Python ints past int64
        flat = arr.reshape(-1).tolist()
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
            return group_sizes
        return np.asarray([min(max(v, 0), _INT32_MAX) for v in flat], np.int32).reshape(arr.shape)
    if arr.dtype.kind not in "iu":
        return group_sizes
    return np.clip(arr, 0, min(_INT32_MAX, np.iinfo(arr.dtype).max)).astype(np.int32)


def _refuse_bools(group_sizes) -> None:
    """A TypeError for host sizes that are bools (``np.asarray([True, 3])`` is int64)."""
    expected = "group_sizes must be integer sizes, not bools (True would count as 1)"
    if not isinstance(group_sizes, (list, tuple)):
        dtype = np.asarray(group_sizes).dtype
        if dtype == np.bool_:
            raise TypeError(f"{expected}, got group_sizes.dtype={dtype}")
        return
    try:
        flat = np.asarray(group_sizes, dtype=object).reshape(-1)
    except (TypeError, ValueError):  # ragged: the caller's conversion refuses it
        return
    for i, v in enumerate(flat):
        if isinstance(v, (bool, np.bool_)) or getattr(v, "dtype", None) == np.bool_:
            raise TypeError(f"{expected}, got {v!r} at (flat) index {i} of group_sizes")


def _clip_sizes(group_sizes: jax.Array, m) -> jax.Array:
    """Each size cut to ``[0, m]`` as int32, clipped in its own dtype first (no wrap)."""
    sizes = group_sizes
    info = jnp.iinfo(sizes.dtype)
    if info.min < 0:
        sizes = jnp.maximum(sizes, 0)
    if info.max > _INT32_MAX:
        sizes = jnp.minimum(sizes, _INT32_MAX)
    return jnp.minimum(sizes.astype(jnp.int32), m)


def group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Returns clamped ``(starts, ends)`` int32 ``[G]`` with ``0 <= start <= end <= m``.

    ``ends`` is the running sum of the sizes cut to ``[0, m]``, saturating at ``m``;
    it never overflows, whatever the sizes (any integer dtype).
    """
    sizes = _clip_sizes(group_sizes, m)
    g = sizes.shape[0]
    if isinstance(m, int) and g * m <= _INT32_MAX:
        ends = jnp.minimum(jnp.cumsum(sizes), m)  # cannot overflow: every size <= m
    elif g == 0:
        ends = sizes
    else:  # min(a + b, m) without forming a + b; associative for values in [0, m]
        ends = jax.lax.associative_scan(lambda a, b: jnp.minimum(a, m - b) + b, sizes)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])[:-1]
    return starts, ends


def clamp_group_sizes(group_sizes, m: int) -> jax.Array:
    """``group_sizes`` as int32 ``[G]`` sizes that sum to at most ``m`` (the documented rule).

    Negative sizes become 0 and the running sum is cut at ``m`` (later groups shrink or
    empty), computed without overflow for any integer dtype; NumPy/list input is
    clipped on the host first (:func:`host_clip`). The result describes exactly the same
    rows per group as the input, so it can replace it anywhere; a kernel given it
    never forms a running sum past ``m``.
    """
    starts, ends = group_bounds(jnp.asarray(host_clip(group_sizes)), m)
    return ends - starts


def checked_group_sizes(group_sizes, m: int) -> jax.Array:
    """:func:`clamp_group_sizes` after checking that ``group_sizes`` is a 1-D integer
    array (a ``TypeError`` naming it otherwise): the argument check of the group-aware
    quantizers."""
    from jax_grouped_mlp._src.op.validation import as_array  # (op imports this module)

    group_sizes = as_array("group_sizes", host_clip(group_sizes))
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer) or group_sizes.dtype == jnp.bool_:
        raise TypeError(
            f"group_sizes must be a 1-D integer array, got group_sizes.shape={group_sizes.shape} "
            f"group_sizes.dtype={group_sizes.dtype}"
        )
    return clamp_group_sizes(group_sizes, m)


def search_sorted(a: jax.Array, v: jax.Array, side: str) -> jax.Array:
    """``jnp.searchsorted(a, v, side=side)`` as straight-line code when ``a``'s length is
    static: the default method is a ``while`` loop, which XLA:GPU runs as a host-driven
    loop of small kernels in the middle of a step (three of them in the fp8_block
    backward at the Nano shape); unrolled, its log2(len(a)) steps fuse with their
    consumers. Same results (the same binary search). A symbolic length keeps the
    default method (jnp.searchsorted takes no symbolic sizes either way)."""
    static = isinstance(a.shape[0], int)
    return jnp.searchsorted(a, v, side=side, method="scan_unrolled" if static else "scan")


def row_group_ids(group_sizes: jax.Array, m: int) -> jax.Array:
    """Group index of every row, ``[M]`` int32; rows past the total get ``G``."""
    _, ends = group_bounds(group_sizes, m)
    rows = jnp.arange(m, dtype=jnp.int32)
    return search_sorted(ends, rows, side="right").astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TileLayout:
    """Group-aligned tiles: ``group``, ``start`` and ``length`` are int32 ``[num_tiles]``.

    ``group`` is ``G`` and ``length`` 0 for unused tiles. ``first_tile[g]`` is the
    index of group ``g``'s first tile (``[G]``).
    """

    tile: int
    group: jax.Array
    start: jax.Array
    length: jax.Array
    first_tile: jax.Array

    @property
    def num_tiles(self) -> int:  # symbolic under shape-polymorphic export
        return self.group.shape[0]


def num_tiles(m: int, num_groups: int, tile: int) -> int:
    """Static upper bound on the number of group-aligned tiles."""
    return cdiv(m, tile) + num_groups


def tile_layout(group_sizes: jax.Array, m: int, tile: int) -> TileLayout:
    """Splits each group into ``tile``-row tiles that never cross a group boundary."""
    g = group_sizes.shape[0]
    t = jnp.arange(num_tiles(m, g, tile), dtype=jnp.int32)
    if g == 0:  # no groups: every tile unused
        zeros = jnp.zeros_like(t)
        return TileLayout(tile, zeros, zeros, zeros, jnp.zeros((0,), jnp.int32))
    starts, ends = group_bounds(group_sizes, m)
    tiles_per_group = (ends - starts + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles_per_group)
    first_tile = tile_ends - tiles_per_group
    group = search_sorted(tile_ends, t, side="right").astype(jnp.int32)
    safe = jnp.minimum(group, g - 1)
    start = starts[safe] + (t - first_tile[safe]) * tile
    length = jnp.where(group < g, jnp.clip(ends[safe] - start, 0, tile), 0)
    start = jnp.where(group < g, start, 0)
    return TileLayout(tile, group, start, length.astype(jnp.int32), first_tile)


def row_tile_ids(group_sizes: jax.Array, m: int, tile: int) -> jax.Array:
    """Index of the group-aligned tile holding each row, ``[M]``; ``num_tiles`` past the total."""
    g = group_sizes.shape[0]
    layout = tile_layout(group_sizes, m, tile)
    if g == 0:
        return jnp.full((m,), layout.num_tiles, jnp.int32)
    starts, _ = group_bounds(group_sizes, m)
    gid = row_group_ids(group_sizes, m)
    safe = jnp.minimum(gid, g - 1)
    rows = jnp.arange(m, dtype=jnp.int32)
    tid = layout.first_tile[safe] + (rows - starts[safe]) // tile
    return jnp.where(gid < g, tid, layout.num_tiles).astype(jnp.int32)


def gather_tiles(x: jax.Array, layout: TileLayout) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rows of every tile of ``x [M, ...]``: ``[num_tiles, tile, ...]`` (zero where invalid).

    Also returns each slot's row index ``[num_tiles, tile]`` and its validity mask.
    ``M`` must be positive.
    """
    m = x.shape[0]
    offs = jnp.arange(layout.tile, dtype=jnp.int32)
    rows = layout.start[:, None] + offs[None, :]
    valid = offs[None, :] < layout.length[:, None]
    mask = valid.reshape(valid.shape + (1,) * (x.ndim - 1))
    tiles = jnp.where(mask, x[jnp.clip(rows, 0, m - 1)], jnp.zeros((), x.dtype))
    return tiles, rows, valid
