"""Device-side bookkeeping for ragged groups of rows.

Tokens are sorted by expert: group ``g`` owns rows ``[start[g], end[g])`` of an
``[M, ...]`` array. Everything here is computed on the device from ``group_sizes``
(no host sync) and is clamped so that no index ever leaves ``[0, M)``: sizes that
sum past ``M`` are cut at ``M``, negative sizes count as zero, and rows at or past
the (clamped) total belong to no group.

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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Returns clamped ``(starts, ends)`` int32 ``[G]`` with ``0 <= start <= end <= m``."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def row_group_ids(group_sizes: jax.Array, m: int) -> jax.Array:
    """Group index of every row, ``[M]`` int32; rows past the total get ``G``."""
    _, ends = group_bounds(group_sizes, m)
    rows = jnp.arange(m, dtype=jnp.int32)
    return jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)


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
    group = jnp.searchsorted(tile_ends, t, side="right").astype(jnp.int32)
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
