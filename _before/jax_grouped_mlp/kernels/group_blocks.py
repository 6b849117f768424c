"""The work split shared by the MXFP8 fake-quantize and dequantize kernels.

A group-aware columnwise MXFP8 ``[M, K]`` tensor has 32-row blocks along M that never
cross a group; its scale rows are numbered block by block (``cdiv(M, 32) + G`` rows, the
unused ones trailing). The kernels built on :class:`GroupBlockKernel` give CTA ``b``
columnwise block ``b`` of that layout (rows ``[row0, row0 + nrows)`` of one group,
``nrows <= 32``) and ``vec * threads`` columns (the grid's second axis). Blocks past the
last used one cover the rows after ``sum(group_sizes)`` (rowwise outputs only). So every
row is read exactly once and every scale row written exactly once, with no host sync:
the CTA finds its rows by walking ``group_sizes`` itself (each warp, lanes in parallel,
about ``G / 32`` steps each; :meth:`GroupBlockKernel._locate_block`).

Each thread holds ``vec`` consecutive columns of the block's 32 rows in registers (one
8- or 16-byte load per row, coalesced across the warp), so a columnwise amax is a
private reduction over its 32 rows and a rowwise amax needs only ``32 / vec``
neighbouring lanes (butterfly shuffles). Amax runs on the integer pipe: sign-cleared
bf16 bits compare like the values, and NaN/Inf bits are larger than every finite one
(``max.u16x2``), which also flags non-finite blocks for free. The grid's second axis
tiles K in steps of ``vec * threads`` columns (a loop over K inside the CTA made the
compiler hoist all 32 row offsets out of it and run out of registers).
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32

BLOCK = 32


@dataclasses.dataclass(frozen=True)
class GroupBlockConfig:
    """Compile-time knobs of a :class:`GroupBlockKernel`.

    vec: bf16 columns per thread (4 -> 8-byte loads, 8 -> 16-byte loads).
    threads: threads per CTA (a multiple of 32).
    min_blocks: CTAs per SM the register allocation must allow (launch bounds;
      0: none). The kernel is latency-bound at low occupancy: its compute phase does
      not overlap its own loads, so other resident CTAs have to.
    """

    vec: int = 8
    threads: int = 128
    min_blocks: int = 0

    def __post_init__(self):
        if self.vec not in (4, 8):
            raise ValueError(f"vec must be 4 or 8, got {self.vec=}")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {self.threads=}")
        if not 0 <= self.min_blocks <= 32:
            raise ValueError(f"min_blocks must be in [0, 32], got {self.min_blocks=}")


class GroupBlockKernel:
    """Base of the kernels with one CTA per group-aware block of ``block_rows`` rows (32:
    MXFP8; a subclass may set 128); see the module doc."""

    block_rows: int = BLOCK
    row_block_cols: int = BLOCK  # columns of a rowwise block

    def __init__(self, config: GroupBlockConfig):
        self.config = config
        self.vec = config.vec
        self.threads = config.threads
        self.lanes_per_block = self.row_block_cols // config.vec  # lanes sharing one rowwise block

    @cute.jit
    def _locate_block(self, group_sizes: cute.Tensor, b: Int32, m: Int32):
        """``(row0, nrows, in_group)`` of columnwise block ``b`` of the group layout.

        Blocks past the last used one cover the rows after ``sum(group_sizes)``
        (``in_group == 0``: rowwise only).
        """
        # ---- which rows does block b own? Each warp walks the clamped group sizes
        # itself, lane l taking groups [l * per, (l + 1) * per): three short passes
        # joined by warp scans, instead of G dependent steps per CTA. ----
        lane = cute.arch.lane_idx()
        num_groups = group_sizes.shape[0]
        per = (num_groups + 31) // 32
        first = Int32(lane) * per
        # Pass 1: rows of my groups (clamping to m is a saturating add: associative).
        rows_mine = Int32(0)
        for i in cutlass.range(per):
            if first + i < num_groups:
                size = cutlass.min(cutlass.max(Int32(group_sizes[first + i]), Int32(0)), m)
                rows_mine = cutlass.min(rows_mine + size, m)
        rows_incl = rows_mine
        for sh in cutlass.range_constexpr(5):
            up = Int32(cute.arch.shuffle_sync_up(rows_incl, offset=1 << sh))
            if Int32(lane) >= (1 << sh):
                rows_incl = cutlass.min(rows_incl + up, m)
        cum = Int32(cute.arch.shuffle_sync_up(rows_incl, offset=1))
        if lane == 0:
            cum = Int32(0)
        total_rows = Int32(cute.arch.shuffle_sync(rows_incl, offset=31))
        # Pass 2: blocks of my groups; scan for my first block.
        blocks_mine = Int32(0)
        c = cum
        for i in cutlass.range(per):
            if first + i < num_groups:
                size = cutlass.min(cutlass.max(Int32(group_sizes[first + i]), Int32(0)), m)
                end = cutlass.min(c + size, m)
                blocks_mine = blocks_mine + (end - c + (self.block_rows - 1)) // self.block_rows
                c = end
        blocks_incl = blocks_mine
        for sh in cutlass.range_constexpr(5):
            up = Int32(cute.arch.shuffle_sync_up(blocks_incl, offset=1 << sh))
            if Int32(lane) >= (1 << sh):
                blocks_incl = blocks_incl + up
        used = blocks_incl - blocks_mine
        total_blocks = Int32(cute.arch.shuffle_sync(blocks_incl, offset=31))
        # Pass 3: the lane whose blocks hold b finds the group, then broadcasts.
        row0 = Int32(0)
        nrows = Int32(0)
        found = Int32(0)
        if b >= used:
            if b < blocks_incl:
                c = cum
                u = used
                for i in cutlass.range(per):
                    if first + i < num_groups:
                        size = cutlass.min(cutlass.max(Int32(group_sizes[first + i]), Int32(0)), m)
                        end = cutlass.min(c + size, m)
                        nblk = (end - c + (self.block_rows - 1)) // self.block_rows
                        if b >= u:
                            if b < u + nblk:
                                row0 = c + (b - u) * self.block_rows
                                nrows = cutlass.min(end - row0, Int32(self.block_rows))
                                found = Int32(1)
                        u = u + nblk
                        c = end
        ballot = Uint32(cute.arch.vote_ballot_sync(found == 1))
        in_group = Int32(0)
        if ballot != Uint32(0):
            src = Int32(cute.arch.popc((ballot & (Uint32(0) - ballot)) - Uint32(1)))
            row0 = Int32(cute.arch.shuffle_sync(row0, offset=src))
            nrows = Int32(cute.arch.shuffle_sync(nrows, offset=src))
            in_group = Int32(1)
        else:
            # Rows past sum(group_sizes): rowwise only.
            row0 = total_rows + (b - total_blocks) * self.block_rows
            nrows = cutlass.max(cutlass.min(m - row0, Int32(self.block_rows)), Int32(0))
        return row0, nrows, in_group
