"""One-pass MXFP8 quantize of a bf16 ``[M, K]`` tensor, rowwise and group-aware columnwise.

Outputs (byte tensors; the FFI handler hands XLA's buffers straight through):
  row_data  [M, K]          E4M3, 32-blocks along K
  row_scale [M, cdiv(K,32)] E8M0
  col_data  [M, K]          E4M3, 32-row blocks along M that never cross a group
  col_scale [cdiv(M,32)+G, K] E8M0; block b of the group layout is scale row b

Work split: CTA ``b`` owns columnwise block ``b`` of the group layout (rows
``[row0, row0 + nrows)`` of one group, ``nrows <= 32``). Blocks past the last used
one cover the rows after ``sum(group_sizes)`` (rowwise only; their columnwise data and
scale rows are zero). So every row is read exactly once and every scale row is
written exactly once, with no host sync: the CTA finds its rows by walking
``group_sizes`` itself (each warp, lanes in parallel, about ``G / 32`` steps each).

Each thread holds ``vec`` consecutive columns of all 32 rows in registers (one
8- or 16-byte load per row, coalesced across the warp), so:
  * columnwise amax is a private reduction over its 32 rows, and
  * rowwise amax needs only ``32 / vec`` neighbouring lanes (butterfly shuffles).
Amax runs on the integer pipe: sign-cleared bf16 bits compare like the values,
and NaN/Inf bits are larger than every finite one (``max.u16x2``), which also
flags non-finite blocks for free. The grid's second axis tiles K in steps of
``vec * threads`` columns (a loop over K inside the CTA made the compiler hoist all
32 row offsets out of it and run out of registers).
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Uint8, Uint32

from jax_grouped_mlp.kernels import ptx

BLOCK = 32


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """Compile-time knobs of :class:`QuantizeMxfp8`.

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

    @property
    def name(self) -> str:
        return f"quantize_mxfp8_v{self.vec}_t{self.threads}" + (
            f"_b{self.min_blocks}" if self.min_blocks else ""
        )


class QuantizeMxfp8:
    """bf16 -> (rowwise MXFP8, group-aware columnwise MXFP8) in one pass; see module doc."""

    def __init__(self, config: QuantizeConfig):
        self.config = config
        self.vec = config.vec
        self.threads = config.threads
        self.lanes_per_block = BLOCK // config.vec  # lanes sharing one rowwise block

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,  # [M, K] bf16
        group_sizes: cute.Tensor,  # [G] int32
        row_data: cute.Tensor,  # [M, K] uint8
        row_scale: cute.Tensor,  # [M, cdiv(K, 32)] uint8
        col_data: cute.Tensor,  # [M, K] uint8
        col_scale: cute.Tensor,  # [cdiv(M, 32) + G, K] uint8
        stream: cuda.CUstream,
    ):
        tile = (1, self.vec)
        self.kernel(
            cute.zipped_divide(x, tile),
            group_sizes,
            cute.zipped_divide(row_data, tile),
            row_scale,
            cute.zipped_divide(col_data, tile),
            cute.zipped_divide(col_scale, tile),
            x.shape[0],
        ).launch(
            grid=(col_scale.shape[0], cute.ceil_div(x.shape[1], self.vec * self.threads), 1),
            block=(self.threads, 1, 1),
            stream=stream,
            max_number_threads=[self.threads, 1, 1],
            min_blocks_per_mp=self.config.min_blocks,
            preferred_smem_carveout=0,  # no shared memory; also spares a device query
        )

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
                blocks_mine = blocks_mine + (end - c + (BLOCK - 1)) // BLOCK
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
                        nblk = (end - c + (BLOCK - 1)) // BLOCK
                        if b >= u:
                            if b < u + nblk:
                                row0 = c + (b - u) * BLOCK
                                nrows = cutlass.min(end - row0, Int32(BLOCK))
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
            row0 = total_rows + (b - total_blocks) * BLOCK
            nrows = cutlass.max(cutlass.min(m - row0, Int32(BLOCK)), Int32(0))
        return row0, nrows, in_group

    @cute.kernel
    def kernel(
        self,
        gx: cute.Tensor,  # ((1, vec), (M, K / vec))
        group_sizes: cute.Tensor,
        g_row_data: cute.Tensor,
        row_scale: cute.Tensor,
        g_col_data: cute.Tensor,
        g_col_scale: cute.Tensor,  # ((1, vec), (NB, K / vec))
        m: Int32,
    ):
        vec = self.vec
        words = vec // 2  # bf16x2 words per row per thread
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        b = Int32(bidx)
        row0, nrows, in_group = self._locate_block(group_sizes, b, m)
        # All ones when the rows are in a group, else zero: masks columnwise output.
        col_mask = Uint32(0) - Uint32(in_group)

        n_chunks = gx.shape[1][1]
        lane_in_block = tidx % self.lanes_per_block
        chunk = bidy * self.threads + tidx
        valid = chunk < n_chunks

        # ---- load 32 rows x vec columns (zeros where out of range) ----
        rx = []
        for r in cutlass.range_constexpr(BLOCK):
            t = cute.make_rmem_tensor((1, vec), BFloat16)
            t.fill(0.0)
            if valid:
                if r < nrows:
                    cute.autovec_copy(gx[(None, (row0 + r, chunk))], t)
            rx.append(cute.recast_tensor(t, Uint32))

        # ---- columnwise: amax over the 32 rows, one scale per column ----
        ax = [[ptx.abs_bf16x2(rx[r][w]) for w in range(words)] for r in range(BLOCK)]
        cmax = [ax[0][w] for w in range(words)]
        for r in cutlass.range_constexpr(1, BLOCK):
            for w in cutlass.range_constexpr(words):
                cmax[w] = ptx.max_u16x2(cmax[w], ax[r][w])
        ecol = []
        for j in cutlass.range_constexpr(vec):
            bits = (cmax[j // 2] >> (16 * (j % 2))) & Uint32(0xFFFF)
            ecol.append(ptx.e8m0_rceil(bits) & col_mask)
        scol = [ptx.e8m0_reciprocal(e) for e in ecol]

        # ---- rowwise (amax over vec columns here, then across the block's lanes),
        # encode both copies and store, one row at a time to keep registers low.
        # The shuffles run on every lane; only the stores are predicated. ----
        for r in cutlass.range_constexpr(BLOCK):
            a = ax[r][0]
            for w in cutlass.range_constexpr(1, words):
                a = ptx.max_u16x2(a, ax[r][w])
            a = cutlass.max(a & Uint32(0xFFFF), a >> 16)
            off = 1
            while off < self.lanes_per_block:
                a = cutlass.max(a, Uint32(cute.arch.shuffle_sync_bfly(a, offset=off)))
                off *= 2
            erow = ptx.e8m0_rceil(a)
            if valid:
                if r < nrows:
                    srow = ptx.e8m0_reciprocal(erow)
                    out_row = cute.make_rmem_tensor((1, vec), Uint8)
                    out_col = cute.make_rmem_tensor((1, vec), Uint8)
                    orw = cute.recast_tensor(out_row, Uint32)
                    ocw = cute.recast_tensor(out_col, Uint32)
                    for q in cutlass.range_constexpr(vec // 4):
                        w0 = rx[r][2 * q]
                        w1 = rx[r][2 * q + 1]
                        rw, cw = ptx.encode_both_e4m3x4(
                            w0, w1, srow, scol[4 * q], scol[4 * q + 1], scol[4 * q + 2], scol[4 * q + 3]
                        )
                        orw[q] = rw
                        ocw[q] = col_mask & cw
                    row = row0 + r
                    cute.autovec_copy(out_row, g_row_data[(None, (row, chunk))])
                    cute.autovec_copy(out_col, g_col_data[(None, (row, chunk))])
                    if lane_in_block == 0:
                        row_scale[row, chunk // self.lanes_per_block] = Uint8(erow)
        if valid:
            out_scale = cute.make_rmem_tensor((1, vec), Uint8)
            for j in cutlass.range_constexpr(vec):
                out_scale[j] = Uint8(ecol[j])
            cute.autovec_copy(out_scale, g_col_scale[(None, (b, chunk))])
