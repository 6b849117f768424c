"""A 128 x 128 byte tile transposed through shared memory (the FP8 kernels' layout passes).

Used by the quantizer's "tile_t" mode (a weight's tiles written K-major) and by
``token_major_blocks`` (a group-aware copy laid out token-major). The tile is 16 KB of
shared memory, 128 rows of 32 words, row ``r``'s 16-byte chunk ``q`` stored at chunk
``q ^ (r // 16 % 8)`` (:func:`swizzle`). Writers store whole 8- or 16-byte pieces of one
row per quarter- or half-warp (any chunk permutation keeps those conflict-free);
:func:`store_transposed` reads word ``j`` of rows ``16 c + i`` for eight ``c`` and four
``j`` per warp load, which the swizzle spreads over all 32 banks.

:func:`store_transposed`: each thread takes, twice, four tile columns x sixteen tile rows
(16 word loads), turns each 4 x 4 byte block around with ``prmt``
(:func:`ptx.transpose_bytes_4x4`) and writes each column's 16 bytes as one 16-byte store.
Eight lanes share an output row, so one warp store covers four whole 128-byte row
segments.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint8, Uint32

from jax_grouped_mlp.kernels import ptx

BLOCK = 128  # rows and columns (bytes) of the tile
WORDS = BLOCK // 4  # 32-bit words in a row


def allocate(smem) -> cute.Tensor:
    """The tile in ``smem`` (a ``SmemAllocator``): words, indexed ``[word, row]``."""
    return smem.allocate_tensor(Uint32, cute.make_layout((WORDS, BLOCK), stride=(1, WORDS)), 16)


def swizzle(r):
    """The word XOR of row ``r``: its 16-byte chunks permuted by ``r // 16 % 8``."""
    return 4 * ((r // 16) % 8)


@cute.jit
def store_transposed(tile: cute.Tensor, g_out: cute.Tensor, row_base: Int32, ncols: Int32, chunk_base: Int32,
                     nrows: Int32, chunk_end: Int32) -> None:
    """Column ``c`` of ``tile`` (swizzled, filled, and synchronized by the caller) as row
    ``row_base + c`` of ``g_out`` (``((1, 16), (rows, cols / 16))`` bytes), its rows
    ``[16 q, 16 q + 16)`` as chunk ``chunk_base + q``. Written only for ``c < ncols``,
    ``16 q < nrows`` and ``chunk_base + q < chunk_end``; 128 threads."""
    tidx, _, _ = cute.arch.thread_idx()
    lane = Int32(tidx) % 32
    warp = Int32(tidx) // 32
    q = lane % 8  # tile rows [16 q, 16 q + 16)
    for p in cutlass.range_constexpr(2):
        j = 4 * warp + lane // 8 + 16 * p  # tile columns [4 j, 4 j + 4)
        cols = [[], [], [], []]  # cols[e]: column 4 j + e, 4 words of 4 rows
        for h in cutlass.range_constexpr(4):
            w = [tile[j ^ swizzle(16 * q + 4 * h + i), 16 * q + 4 * h + i] for i in range(4)]
            for e, c in enumerate(ptx.transpose_bytes_4x4(*w)):
                cols[e].append(c)
        if 16 * q < nrows:
            if chunk_base + q < chunk_end:
                for e in cutlass.range_constexpr(4):
                    c = 4 * j + e
                    if c < ncols:
                        v = cute.make_rmem_tensor((1, 16), Uint8)
                        vw = cute.recast_tensor(v, Uint32)
                        for i in cutlass.range_constexpr(4):
                            vw[i] = cols[e][i]
                        cute.autovec_copy(v, g_out[(None, (row_base + c, chunk_base + q))])
