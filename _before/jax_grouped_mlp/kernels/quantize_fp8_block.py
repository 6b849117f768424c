"""One-pass FP8 block quantization (``fp8_block`` recipe) of a bf16 ``[M, K]`` tensor.

Modes, bit for bit the pure-JAX quantizers of ``_src/formats/fp8_block.py``
(``row = quantize_fp8_block(x, 1)``, ``col = quantize_fp8_block(x, 0, group_sizes=gs)``):

  "pair"       (row.data, row.scale, col.data, col.scale)     an activation kept as a
                                                              residual (x, a)
  "pair_bf16"  (row.data, row.scale, dequantize(col), col.scale)  a transient one (dy,
                                                              dh): the weight gradient
                                                              reads the bf16 values
  "pair_tm"    "pair", the columnwise data written token-major in whole blocks,
               ``[K, 128 NB]`` (``fp8_block.token_major_blocks``'s bytes: what the FP8
               weight gradient reads), so no separate layout pass
  "row"        (row.data, row.scale) alone (an operand of a forward without gradient)
  "tile_t"     "tile", the data written transposed: ``[G, B, A]`` (the K-major copy the
               forward GEMM reads, ``transpose_tiles(quantize_fp8_block(w, (1, 2)))``;
               scales as "tile", the binding transposes them)
  "tile"       (data, scale) of 128 x 128 tiles of each group's rows: a weight
               ``[G, A, B]`` read as ``[G * A, B]`` with ``group_sizes = [A] * G``
               (scale rows ``g * cdiv(A, 128) + i``; ``quantize_fp8_block(w, (1, 2))``)

Work split: CTA ``(b, kb)`` owns the 128 x 128 tile of group-aware block ``b`` (at most
128 rows of one group, found by :meth:`GroupBlockKernel._locate_block`; the blocks past
the last used one cover the rows after ``sum(group_sizes)``, rowwise only) and 128-column
block ``kb``, and holds the whole tile in registers: thread ``t`` keeps columns
``8 (t % 16) ..`` of rows ``t // 16 + 8 i`` (``i < 16``; 16-byte loads, a warp reads two
256-byte row segments at once). So every element is read once. A row's 1 x 128 block
lives in 16 lanes (butterfly shuffles); a column's 128 rows in 8 row groups (one shuffle,
then the four warps through 1 KB of shared memory); a tile's amax is both.
Every scale row of the group layout is written (unused ones with byte 0), every output
element of a row < M exactly once, nothing else.

"tile_t" sends the encoded tile through shared memory (:mod:`byte_tile`: each thread's 8
bytes of a row one store) and writes it transposed: tile column ``c`` as output row
``g B + 128 kb + c``, its 16-row chunks at ``a0 / 16 + ..`` (``a0``: the block's first
row within its expert). Needs ``A % 16 == 0`` (whole 16-byte chunks; the binding checks).
"pair_tm" does the same with the columnwise copy: tile column ``c`` as row ``128 kb + c``
of ``col``, columns ``[128 b, 128 b + 128)`` (all 128, zeros past the block's rows).
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Uint8, Uint32

from jax_grouped_mlp.kernels import byte_tile, ptx
from jax_grouped_mlp.kernels.group_blocks import GroupBlockConfig, GroupBlockKernel

FP8_BLOCK = 128
MODES = ("pair", "pair_bf16", "pair_tm", "tile", "tile_t", "row")


@dataclasses.dataclass(frozen=True)
class QuantizeFp8BlockConfig(GroupBlockConfig):
    """:class:`GroupBlockConfig` (``vec`` 8: 16 lanes per 128-column block; ``threads``
    128: 8 row groups of 16 rows) plus ``mode``."""

    mode: str = "pair"

    def __post_init__(self):
        super().__post_init__()
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode=}")
        if self.vec != 8 or self.threads != 128:
            raise ValueError(f"vec and threads must be 8 and 128 (a 128 x 128 tile a CTA), got {self.vec=} {self.threads=}")

    @property
    def name(self) -> str:
        return f"quantize_fp8_block_{self.mode}_v{self.vec}_t{self.threads}"


class QuantizeFp8Block(GroupBlockKernel):
    """bf16 -> FP8 E4M3 in 128-blocks; see the module doc."""

    block_rows = FP8_BLOCK
    row_block_cols = FP8_BLOCK

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,  # [M, K] bf16
        group_sizes: cute.Tensor,  # [G] int32
        row: cute.Tensor,  # [M, K] uint8 E4M3, the rowwise data
        row_scale: cute.Tensor,  # [M, cdiv(K, 128)] uint8 E8M0
        col: cute.Tensor,  # [M, K] uint8 E4M3 ("pair") or bf16 values ("pair_bf16"); "pair_tm": [K, 128 NB]
        col_scale: cute.Tensor,  # [cdiv(M, 128) + G, K] uint8 E8M0
        stream: cuda.CUstream,
    ):
        tile = (1, self.vec)
        # "pair_tm": col is [K, 128 NB], written in 16-byte chunks.
        col_tile = (1, 16) if cutlass.const_expr(self.config.mode == "pair_tm") else tile
        self._launch(
            cute.zipped_divide(x, tile), group_sizes, cute.zipped_divide(row, tile), row_scale,
            cute.zipped_divide(col, col_tile), cute.zipped_divide(col_scale, tile), x.shape[0], stream,
        )

    @cute.jit
    def _launch(self, gx, group_sizes, g_row, row_scale, g_col, g_col_scale, m, stream):
        num_blocks = (m + (FP8_BLOCK - 1)) // FP8_BLOCK + group_sizes.shape[0]
        self.kernel(gx, group_sizes, g_row, row_scale, g_col, g_col_scale, m).launch(
            grid=(num_blocks, cute.ceil_div(gx.shape[1][1], self.lanes_per_block), 1),
            block=(self.threads, 1, 1),
            stream=stream,
            max_number_threads=[self.threads, 1, 1],
            min_blocks_per_mp=self.config.min_blocks,
            preferred_smem_carveout=0,
        )

    def _lanes_max(self, w: list) -> Uint32:
        """The largest sign-cleared bf16 of the words ``w`` over the 16 lanes of a block."""
        a = w[0]
        for x in w[1:]:
            a = ptx.max_u16x2(a, x)
        a = cutlass.max(a & Uint32(0xFFFF), a >> 16)
        off = 1
        while off < self.lanes_per_block:
            a = cutlass.max(a, Uint32(cute.arch.shuffle_sync_bfly(a, offset=off)))
            off *= 2
        return a

    def _store_e4m3(self, w: list, rs: list, dst: cute.Tensor, mask: Uint32) -> None:
        """``vec`` bf16 (words ``w``) times reciprocal scales ``rs`` (one per column) as
        E4M3 bytes, ANDed with ``mask``."""
        o = cute.make_rmem_tensor((1, self.vec), Uint8)
        ow = cute.recast_tensor(o, Uint32)
        for q in range(self.vec // 4):
            ow[q] = mask & ptx.encode_e4m3x4(w[2 * q], w[2 * q + 1], *rs[4 * q: 4 * q + 4])
        cute.autovec_copy(o, dst)

    @cute.jit
    def _stage(self, smem, rows: list, rs: list, mask: Uint32) -> cute.Tensor:
        """The tile's E4M3 bytes (``rows``, this thread's, times the per-column reciprocal
        scales ``rs``, ANDed with ``mask``) in a :mod:`byte_tile` tile, synchronized: each
        thread's 8 bytes of a row one store."""
        vec = self.vec
        lanes = self.lanes_per_block
        row_groups = self.threads // lanes
        tidx, _, _ = cute.arch.thread_idx()
        cg = Int32(tidx) % lanes
        rg = Int32(tidx) // lanes
        tile = byte_tile.allocate(smem)
        pieces = cute.zipped_divide(tile, (vec // 4, 1))  # this thread's 8 bytes of a row: one store
        for i in cutlass.range_constexpr(len(rows)):
            r = rg + row_groups * i
            v = cute.make_rmem_tensor((vec // 4, 1), Uint32)
            for q in cutlass.range_constexpr(vec // 4):
                v[q, 0] = mask & ptx.encode_e4m3x4(rows[i][2 * q], rows[i][2 * q + 1], *rs[4 * q: 4 * q + 4])
            piece = ((cg * (vec // 4)) ^ byte_tile.swizzle(r)) // (vec // 4)
            cute.autovec_copy(v, pieces[(None, (piece, r))])
        cute.arch.sync_threads()
        return tile

    @cute.jit
    def _store_transposed(self, smem, rows: list, rs: list, mask: Uint32, g_out: cute.Tensor, row0: Int32,
                          nrows: Int32, kb: Int32, k: Int32) -> None:
        """Mode "tile_t": the tile into ``g_out`` ``((1, 16), (G * B, A / 16))`` transposed."""
        tile = self._stage(smem, rows, rs, mask)
        a = g_out.shape[1][1] * 16  # A: rows of an expert
        g = row0 // a
        a0 = row0 - g * a
        # (chunk_end keeps a block that straddles an expert, possible only with group sizes
        # other than [A] * G, inside its output row.)
        byte_tile.store_transposed(tile, g_out, g * k + kb * FP8_BLOCK, k - kb * FP8_BLOCK, a0 // 16, nrows,
                                   a // 16)

    @cute.kernel
    def kernel(
        self,
        gx: cute.Tensor,  # ((1, vec), (M, K / vec)) bf16
        group_sizes: cute.Tensor,
        g_row: cute.Tensor,  # ((1, vec), (M, K / vec)) uint8
        row_scale: cute.Tensor,  # [M, KB] or [NB, KB] uint8
        g_col: cute.Tensor,  # ((1, vec), (M, K / vec)) uint8 or bf16
        g_col_scale: cute.Tensor,  # ((1, vec), (NB, K / vec)) uint8
        m: Int32,
    ):
        vec = self.vec
        lanes = self.lanes_per_block  # 16: column groups of a 128-column block
        row_groups = self.threads // lanes  # 8
        reps = FP8_BLOCK // row_groups  # 16 rows per thread
        mode = self.config.mode
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        b = Int32(bidx)
        kb = Int32(bidy)
        row0, nrows, in_group = self._locate_block(group_sizes, b, m)
        cg = Int32(tidx) % lanes
        rg = Int32(tidx) // lanes
        n_chunks = gx.shape[1][1]
        chunk = kb * lanes + cg
        valid = chunk < n_chunks
        cc = cutlass.min(chunk, n_chunks - 1)  # loads stay in bounds; lanes past K read zeros
        keep = Uint32(0) - Uint32(valid)
        mask = Uint32(0) - Uint32(in_group)  # the columnwise outputs of rows past the groups are 0

        # ---- the tile into registers, then rowwise blocks and column maxima ----
        # All loads are issued before the first rowwise store: a store may alias a later
        # load as far as the compiler knows, so interleaving them kept one load in flight.
        loaded = []
        for i in cutlass.range_constexpr(reps):
            r = rg + row_groups * i
            t = cute.make_rmem_tensor((1, vec), BFloat16)
            t.fill(0.0)
            if r < nrows:
                cute.autovec_copy(gx[(None, (row0 + r, cc))], t)
            loaded.append(cute.recast_tensor(t, Uint32))
        rows = []
        cm = [Uint32(0)] * (vec // 2)
        for i in cutlass.range_constexpr(reps):
            r = rg + row_groups * i
            w = [loaded[i][q] & keep for q in range(vec // 2)]
            rows.append(w)
            a = [ptx.abs_bf16x2(x) for x in w]
            cm = [ptx.max_u16x2(cm[q], a[q]) for q in range(vec // 2)]
            if cutlass.const_expr(mode not in ("tile", "tile_t")):
                e = ptx.e8m0_rceil(self._lanes_max(a))  # every lane shuffles; stores predicated
                if r < nrows:
                    if valid:
                        self._store_e4m3(w, [ptx.e8m0_reciprocal(e)] * vec, g_row[(None, (row0 + r, chunk))],
                                         Uint32(0xFFFFFFFF))
                    if cg == 0:
                        row_scale[row0 + r, kb] = Uint8(e)

        if cutlass.const_expr(mode != "row"):  # the columnwise copy, or the tile's data
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Uint32, cute.make_layout((self.threads // 32, lanes * (vec // 2))), 16)
            # ---- column maxima over the 8 row groups: lanes l and l + 16, then the warps ----
            cm = [ptx.max_u16x2(x, Uint32(cute.arch.shuffle_sync_bfly(x, offset=16))) for x in cm]
            warp = Int32(tidx) // 32
            if Int32(tidx) % 32 < lanes:
                for q in cutlass.range_constexpr(vec // 2):
                    red[warp, cg * (vec // 2) + q] = cm[q]
            cute.arch.sync_threads()
            for wi in cutlass.range_constexpr(self.threads // 32):  # (its own warp's included: max is idempotent)
                cm = [ptx.max_u16x2(cm[q], red[wi, cg * (vec // 2) + q]) for q in range(vec // 2)]

            if cutlass.const_expr(mode in ("tile", "tile_t")):
                e = ptx.e8m0_rceil(self._lanes_max(cm)) & mask
                rs = [ptx.e8m0_reciprocal(e)] * vec
                if Int32(tidx) == 0:
                    row_scale[b, kb] = Uint8(e)
                if cutlass.const_expr(mode == "tile"):
                    for i in cutlass.range_constexpr(reps):
                        r = rg + row_groups * i
                        if r < nrows:
                            if valid:
                                self._store_e4m3(rows[i], rs, g_row[(None, (row0 + r, chunk))], mask)
                else:
                    self._store_transposed(smem, rows, rs, mask, g_row, row0, nrows, kb, n_chunks * vec)
            else:
                ecol = [ptx.e8m0_rceil((cm[j // 2] >> (16 * (j % 2))) & Uint32(0xFFFF)) & mask for j in range(vec)]
                rcol = [ptx.e8m0_reciprocal(e) for e in ecol]
                if valid:
                    if rg == 0:
                        out_scale = cute.make_rmem_tensor((1, vec), Uint8)
                        for j in cutlass.range_constexpr(vec):
                            out_scale[j] = Uint8(ecol[j])
                        cute.autovec_copy(out_scale, g_col_scale[(None, (b, chunk))])
                vcol = [ptx.e8m0_value(e) for e in ecol] if mode == "pair_bf16" else []
                if cutlass.const_expr(mode == "pair_tm"):
                    # Block b's tile as columns [128 b, 128 b + 128) of rows 128 kb + c of
                    # col, zeros past its rows (loaded as zeros) and for blocks past the groups.
                    tile = self._stage(smem, rows, rcol, mask)
                    byte_tile.store_transposed(tile, g_col, kb * FP8_BLOCK, n_chunks * vec - kb * FP8_BLOCK,
                                               b * (FP8_BLOCK // 16), FP8_BLOCK, g_col.shape[1][1])
                for i in cutlass.range_constexpr(reps if mode != "pair_tm" else 0):
                    r = rg + row_groups * i
                    if r < nrows:
                        if valid:
                            if cutlass.const_expr(mode == "pair"):
                                self._store_e4m3(rows[i], rcol, g_col[(None, (row0 + r, chunk))], mask)
                            else:
                                w = rows[i]
                                o = cute.make_rmem_tensor((1, vec), BFloat16)
                                ow = cute.recast_tensor(o, Uint32)
                                for q in cutlass.range_constexpr(vec // 4):
                                    lo, hi = ptx.fake_quant_bf16x4(
                                        w[2 * q], w[2 * q + 1], *rcol[4 * q: 4 * q + 4], *vcol[4 * q: 4 * q + 4]
                                    )
                                    ow[2 * q] = lo & mask
                                    ow[2 * q + 1] = hi & mask
                                cute.autovec_copy(o, g_col[(None, (row0 + r, chunk))])


class QuantizeFp8BlockTile(QuantizeFp8Block):
    """Modes "tile" (128 x 128 tiles of each group's rows: a weight), "tile_t" (the same,
    ``data`` ``[G * B, A]``: each expert's tiles transposed) and "row" (the rowwise copy
    alone; ``scale`` is then ``[M, cdiv(K, 128)]`` and ``group_sizes`` empty); one data
    output and one scale output. See the module doc."""

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,  # [M, K] bf16 (a weight [G, A, B] as [G * A, B])
        group_sizes: cute.Tensor,  # [G] int32 (A each; "row": [0])
        data: cute.Tensor,  # [M, K] uint8 E4M3 ("tile_t": [G * K, M / G])
        scale: cute.Tensor,  # [cdiv(M, 128) + G, cdiv(K, 128)] uint8 E8M0 ("row": [M, cdiv(K, 128)])
        stream: cuda.CUstream,
    ):
        tile = (1, self.vec)
        # "tile_t": data is [G * B, A], written in 16-byte chunks.
        g_data = cute.zipped_divide(data, (1, 16) if cutlass.const_expr(self.config.mode == "tile_t") else tile)
        # The columnwise outputs are never touched in these modes: the data stands in.
        self._launch(cute.zipped_divide(x, tile), group_sizes, g_data, scale, g_data, g_data, x.shape[0], stream)
