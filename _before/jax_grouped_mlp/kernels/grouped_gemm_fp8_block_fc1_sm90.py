"""The FP8 block-scaled grouped GEMM with the FC1 epilogue (``fp8_block`` recipe).

``h[m] = A[m] @ B[group(m)]`` exactly as :class:`GroupedGemmFp8BlockSm90` writes it (same
mainloop, same bf16 rounding, same stores), plus, from the same accumulator, both
``fp8_block`` copies of ``a = bf16(probs[:, None] * relu(f32(h))**2)``
(:func:`ptx.srelu_scaled_bf16x2`):

  a_row        [M, N]  E4M3   ``quantize_fp8_block(a, 1).data``: 1 x 128 blocks along N
  a_row_scale  [M, NB] E8M0   its scales, NB = cdiv(N, 128)
  a_col        [M, N]  E4M3   ``quantize_fp8_block(a, 0, group_sizes).data``: group-aware
                              128-row blocks (zero on rows past the groups)
  a_col_scale  [cdiv(M, 128) + G, N] E8M0  its scales (block ``b`` of the group layout is
                              row ``b``; the handler clears the rows no group uses)

i.e. bit for bit ``fp8_block_pair(srelu_scaled(h, probs), group_sizes, keep_col=True)``
(``primitives``), with no pass over ``h`` and no bf16 ``a`` in global memory.

Why one tile is one block each way: a tile is 128 rows from its group's start plus a
multiple of 128 (never crossing the group's end), so its rows are exactly one group-aware
128-row block; and its ``tile_n`` (128 or 256) columns are one or two whole 1 x 128 row
blocks. So every scale the tile needs is a reduction over the tile alone.

Epilogue, per tile (the 256 consumer threads):
  1. From the accumulator registers: ``h`` rounded to bf16 pairs, ``a``, ``|a|``; the row
     maxima (per row and 128-column block: the 4 lanes of a row, two shuffles) give the
     row scales (into shared memory and ``a_row_scale``); the column maxima over the
     thread's rows that lie in the tile's group (then over the warp's 8 row groups, three
     shuffles) go to shared memory per warp. Columns past N are masked out of the row
     maxima (a non-finite ``probs`` would otherwise make their zeros NaN).
  2. Barrier; threads ``< tile_n / 2`` reduce the 8 warps' maxima of two columns each into
     the column scales (shared memory and ``a_col_scale``; not for tiles past the groups).
  3. Barrier; per 128 x 32 subtile, as :class:`StoreEpilogue`: ``h`` staged in shared
     memory and TMA-stored (full tiles) or stored with row predicates (partial ones); then
     from the staged subtile (thread = 8 columns of rows ``r``, ``r + 64``) ``a`` again,
     encoded with its row's scale and with its columns' scales: two 8-byte stores; a
     barrier before the buffer is reused.
Tail tiles (rows past ``sum(group_sizes)``): ``h`` zero, ``a_row`` the row quantization
of ``bf16(probs * 0)``, ``a_col`` zero, no column scales.

Scratch shared memory beyond the base kernel's: the per-warp column maxima (8 x tile_n / 2
words), the row scales (128 x tile_n / 128 words) and the column scales (tile_n words);
the pipeline keeps its depth (the registry's ``stages``).
"""

# (No "from __future__ import annotations": cute.struct reads its field annotations as objects.)

import dataclasses
import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8, Uint32

from jax_grouped_mlp.kernels import ptx
from jax_grouped_mlp.kernels.grouped_gemm_fc1_sm90 import load_words
from jax_grouped_mlp.kernels.grouped_gemm_fp8_block_sm90 import (
    SCALE_BLOCK, Fp8BlockGemmConfig, Fp8BlockMainloop, GroupedGemmFp8BlockSm90,
)
from jax_grouped_mlp.kernels.grouped_gemm_sm90 import EPI_N, StoreEpilogue, StoreTarget, TmaLoad, gemm_shared_storage
from jax_grouped_mlp.kernels.tile_scheduler import SegmentTileScheduler

VEC = 8  # elements per pass vector (16 bytes of bf16, 8 bytes of E4M3)
CONSUMER_WARPS = 8


@dataclasses.dataclass(frozen=True)
class Fp8BlockFc1Config(Fp8BlockGemmConfig):
    """:class:`Fp8BlockGemmConfig` whose shared-memory budget also holds the epilogue's scratch."""

    @property
    def scratch_bytes(self) -> int:
        words = CONSUMER_WARPS * self.tile_n // 2 + self.tile_m * (self.tile_n // SCALE_BLOCK) + self.tile_n
        return 4 * words + 3 * 128  # (each of the three arrays 128-byte aligned)

    @property
    def epi_bytes(self) -> int:
        return super().epi_bytes + self.scratch_bytes

    @property
    def name(self) -> str:
        return super().name + "_fc1"


class GroupedGemmFp8BlockFc1Sm90(GroupedGemmFp8BlockSm90):
    """The FP8 block-scaled grouped GEMM with the FC1 epilogue; see the module docstring."""

    def __init__(self, config: Fp8BlockFc1Config):
        if not isinstance(config, Fp8BlockFc1Config):
            raise TypeError(f"config must be an Fp8BlockFc1Config, got {config!r}")
        super().__init__(config)

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (M, K) float8_e4m3fn, K contiguous
        b: cute.Tensor,  # (N, K, G) float8_e4m3fn, K contiguous (JAX's [G, N, K])
        sa: cute.Tensor,  # (M, KB) uint8 E8M0
        sb: cute.Tensor,  # (G, NB, KB) uint8 E8M0
        out: cute.Tensor,  # (M, N) bf16: h
        a_row: cute.Tensor,  # (M, N) uint8 E4M3
        a_row_scale: cute.Tensor,  # (M, cdiv(N, 128)) uint8 E8M0
        a_col: cute.Tensor,  # (M, N) uint8 E4M3
        a_col_scale: cute.Tensor,  # (cdiv(M, 128) + G, N) uint8 E8M0
        probs: cute.Tensor,  # (M,) float32
        group_sizes: cute.Tensor,  # (G,) int32
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        tma, smem_layouts = self._prepare(a, b, out)
        self._add_scratch(smem_layouts)
        v = (1, VEC)
        self.kernel_fp8_fc1(
            *tma, out, sa, sb, cute.zipped_divide(a_row, v), a_row_scale, cute.zipped_divide(a_col, v), a_col_scale,
            probs, group_sizes, self.tiled_mma, self.tiled_mma_half, *smem_layouts,
        ).launch(
            grid=(num_ctas, 1, 1),
            block=(self.threads, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    def _add_scratch(self, smem_layouts) -> None:
        """The base class's shared-storage struct plus the epilogue's three scratch arrays."""
        a_smem, b_smem, epi_smem = smem_layouts
        tile_n, halves = self.tile_n, self.halves

        self.shared_storage = gemm_shared_storage(
            self, a_smem, b_smem, epi_smem,
            red=cute.struct.Align[cute.struct.MemRange[Uint32, CONSUMER_WARPS * tile_n // 2], 128],
            row_e=cute.struct.Align[cute.struct.MemRange[Uint32, self.tile_m * halves], 128],
            col_e=cute.struct.Align[cute.struct.MemRange[Uint32, tile_n], 128],
        )

    def _scratch(self) -> "Fc1Scratch":
        """The scratch arrays (inside the kernel, after :meth:`_shared_and_pipeline`)."""
        st = self.smem_storage
        return Fc1Scratch(
            st.red.get_tensor(cute.make_layout((CONSUMER_WARPS, self.tile_n // 2), stride=(self.tile_n // 2, 1))),
            st.row_e.get_tensor(cute.make_layout((self.tile_m, self.halves), stride=(self.halves, 1))),
            st.col_e.get_tensor(cute.make_layout((self.tile_n,))),
        )

    @cute.kernel
    def kernel_fp8_fc1(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,  # TMA coordinate tensor (M, K)
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,  # TMA coordinate tensor (N, K, G)
        tma_atom_out: cute.CopyAtom,
        mOutTma: cute.Tensor,  # TMA coordinate tensor (M, N)
        mOut: cute.Tensor,  # (M, N) bf16: h
        mSA: cute.Tensor,  # (M, KB) uint8
        mSB: cute.Tensor,  # (G, NB, KB) uint8
        g_row: cute.Tensor,  # ((1, 8), (M, N / 8)) uint8
        m_row_scale: cute.Tensor,  # (M, NB) uint8
        g_col: cute.Tensor,  # ((1, 8), (M, N / 8)) uint8
        m_col_scale: cute.Tensor,  # (cdiv(M, 128) + G, N) uint8
        mProbs: cute.Tensor,  # (M,) float32
        group_sizes: cute.Tensor,
        tiled_mma: cute.TiledMma,
        tiled_mma_half: cute.TiledMma,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        epi_smem: cute.ComposedLayout,
    ):
        cta = self._kernel_start((tma_atom_a, tma_atom_b, tma_atom_out))
        pipe, sA, sB, sC, warp_group, work = self._setup_and_produce(
            TmaLoad(tma_atom_a, mA), TmaLoad(tma_atom_b, mB), mOut, group_sizes, (a_smem, b_smem, epi_smem), cta
        )
        scratch = self._scratch()
        if warp_group != 0:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self._consumer(
                Fp8BlockMainloop(self, tiled_mma, tiled_mma_half, pipe, sA, sB, mSA, mSB),
                Fp8BlockFc1Epilogue(
                    self, StoreTarget(sC, tma_atom_out, mOutTma, mOut), cta.warp_idx,
                    Fp8BlockFc1Outputs(g_row, m_row_scale, g_col, m_col_scale, mProbs), scratch,
                ),
                work, cta.tidx - 128,
            )


@dataclasses.dataclass(frozen=True)
class Fp8BlockFc1Outputs:
    """The epilogue's extra operands: ``a``'s row and column E4M3 data (as 8-byte vectors
    ``((1, 8), (M, N / 8))``), their E8M0 scales, and ``probs``."""

    g_row: cute.Tensor
    row_scale: cute.Tensor
    g_col: cute.Tensor
    col_scale: cute.Tensor
    probs: cute.Tensor


@dataclasses.dataclass(frozen=True)
class Fc1Scratch:
    """Shared memory of the epilogue: per-warp column maxima ``(8, tile_n / 2)`` (column
    pairs as bf16x2 words), row scales ``(128, tile_n / 128)`` and column scales ``(tile_n,)``."""

    red: cute.Tensor
    row_e: cute.Tensor
    col_e: cute.Tensor


class Fp8BlockFc1Epilogue(StoreEpilogue):
    """``h`` as :class:`StoreEpilogue` stores it, plus both ``fp8_block`` copies of ``a``
    (module docstring). Its scheduler counts 128-row blocks (a tile's column scale row)."""

    blocks = SCALE_BLOCK

    def __init__(self, kernel: GroupedGemmFp8BlockFc1Sm90, out: StoreTarget, warp_idx, extra: Fp8BlockFc1Outputs,
                 scratch: Fc1Scratch):
        super().__init__(kernel, out, warp_idx)
        self.extra = extra
        self.scratch = scratch

    def setup(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, ctid):
        """The stores' copies, and where this thread's accumulator elements lie: its base
        (row, column) at run time plus offsets that are the same for every thread, read off
        thread 0's partition of the identity tensor (as ``Fp8BlockMainloop.setup`` does)."""
        super().setup(tiled_mma, acc, ctid)
        k = self.kernel
        self.acc = acc
        self.ctid = ctid
        self.lane = ctid % 32
        self.warp = ctid // 32
        ident = cute.make_identity_tensor((k.tile_m, k.tile_n))
        c0 = tiled_mma.get_slice(0).partition_C(ident)
        base = tiled_mma.get_slice(ctid).partition_C(ident)[0]
        self.row_base, self.col_base = base[0], base[1]
        r00, c00 = c0[0][0], c0[0][1]
        where = {}
        for i in range(cute.size(acc)):
            r, c = c0[i][0], c0[i][1]
            if not (isinstance(r, int) and isinstance(c, int)):
                raise TypeError(f"accumulator element {i} has no static offset: {(r, c)}")
            where[(r - r00, c - c00)] = i
        self.row_offs = sorted({r for r, _ in where})
        # Column pairs (c, c + 1) of one row: one bf16x2 word each.
        self.pairs = []  # (row slot, column offset, element of c, element of c + 1)
        for (r, c), i in sorted(where.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            if c % 2 == 0:
                if (r, c + 1) not in where:
                    raise TypeError(f"accumulator element {i} at {(r, c)} has no neighbour at column {c + 1}")
                self.pairs.append((self.row_offs.index(r), c, i, where[(r, c + 1)]))
        if len(self.pairs) * 2 != cute.size(acc):
            raise TypeError("the column pairs do not cover the accumulator")

    @cute.jit
    def _probs(self, rows: list, row0: Int32, rows_valid: Int32) -> list:
        """``probs`` of the tile rows ``rows`` (0 past the valid rows: never stored)."""
        mProbs = self.extra.probs
        ps = []
        for ri in cutlass.range_constexpr(len(rows)):
            r = rows[ri]
            p = Float32(0.0)
            if r < rows_valid:
                p = Float32(mProbs[row0 + r])
            ps.append(p)
        return ps

    @cute.jit
    def _scales(self, row0: Int32, rows_valid: Int32, col0: Int32, cols_valid: Int32, n_tile: Int32):
        """Step 1: the row scales (shared memory and global) and the per-warp column maxima."""
        k, acc, red, row_e = self.kernel, self.acc, self.scratch.red, self.scratch.row_e
        halves = k.halves
        rows = [self.row_base + off for off in self.row_offs]
        ps = self._probs(rows, row0, rows_valid)
        row_ok = [Uint32(0) - Uint32(r < rows_valid) for r in rows]
        n_blocks = self.extra.row_scale.shape[1]
        # One 128-column block at a time (fewer live maxima: no spills at tile_n 256).
        for h in cutlass.range_constexpr(halves):
            pairs = [p for p in self.pairs if p[1] // SCALE_BLOCK == h]
            am = [Uint32(0)] * len(rows)
            cm = {}
            for pi in cutlass.range_constexpr(len(pairs)):
                s, c, i0, i1 = pairs[pi]
                hw = ptx.bf16x2_from_f32(acc[i0], acc[i1])
                aw = ptx.abs_bf16x2(ptx.srelu_scaled_bf16x2(hw, ps[s]))
                aw = aw & (Uint32(0) - Uint32(self.col_base + c < cols_valid))  # columns past N
                am[s] = ptx.max_u16x2(am[s], aw)
                cw = aw & row_ok[s]  # rows past the tile's group are in no column block
                cm[c] = cw if c not in cm else ptx.max_u16x2(cm[c], cw)
            for s in cutlass.range_constexpr(len(rows)):
                a = am[s]
                a = cutlass.max(a & Uint32(0xFFFF), a >> 16)
                # The 4 lanes of a row are 4 consecutive lanes; every lane shuffles.
                a = cutlass.max(a, Uint32(cute.arch.shuffle_sync_bfly(a, offset=1)))
                a = cutlass.max(a, Uint32(cute.arch.shuffle_sync_bfly(a, offset=2)))
                e = ptx.e8m0_rceil(a)
                if self.lane % 4 == 0:
                    row_e[rows[s], h] = e
                    nb = n_tile * halves + h
                    if rows[s] < rows_valid:
                        if nb < n_blocks:
                            self.extra.row_scale[row0 + rows[s], nb] = Uint8(e)
            cols = sorted(cm)
            for ci in cutlass.range_constexpr(len(cols)):
                c = cols[ci]
                w = cm[c]
                # The warp's 8 row groups (lanes l, l ^ 4, l ^ 8, l ^ 16 hold the same columns).
                for off in (4, 8, 16):
                    w = ptx.max_u16x2(w, Uint32(cute.arch.shuffle_sync_bfly(w, offset=off)))
                if self.lane < 4:
                    red[self.warp, (self.col_base + c) // 2] = w

    @cute.jit
    def _column_scales(self, col0: Int32, cols_valid: Int32, in_group, blk: Int32) -> None:
        """Step 2: threads below ``tile_n / 2`` reduce two columns' maxima over the 8 warps."""
        red, col_e = self.scratch.red, self.scratch.col_e
        j = self.ctid
        if j < self.kernel.tile_n // 2:
            w = red[0, j]
            for wi in cutlass.range_constexpr(CONSUMER_WARPS - 1):
                w = ptx.max_u16x2(w, red[wi + 1, j])
            e0 = ptx.e8m0_rceil(w & Uint32(0xFFFF))
            e1 = ptx.e8m0_rceil(w >> 16)
            col_e[2 * j] = e0
            col_e[2 * j + 1] = e1
            if in_group:
                if 2 * j < cols_valid:  # (N % 8 == 0: both columns or neither)
                    self.extra.col_scale[blk, col0 + 2 * j] = Uint8(e0)
                    self.extra.col_scale[blk, col0 + 2 * j + 1] = Uint8(e1)

    @cute.jit
    def _encode_pass(self, tile_args, e: int, buf, tSG_s, gcol0, cols_valid) -> None:
        """Step 3's passes over staged subtile ``e``: this thread's two 8-column vectors
        (rows ``r``, ``r + 64``) of ``a``, encoded with the row's and the columns' scales."""
        ps, row0, rows_valid, data_mask = tile_args
        tSG_cC = self.s2g[3]
        row_e, col_e = self.scratch.row_e, self.scratch.col_e
        h = (e * EPI_N) // SCALE_BLOCK
        for i in cutlass.range_constexpr(cute.size(tSG_cC, mode=[1])):
            r, c = tSG_cC[(0, i, 0)]
            hw = load_words(tSG_s[(None, i, 0)])
            aw = [ptx.srelu_scaled_bf16x2(hw[w], ps[i]) for w in range(VEC // 2)]
            rr = ptx.e8m0_reciprocal(row_e[r, h])
            tc = e * EPI_N + c  # tile column
            rc = [ptx.e8m0_reciprocal(col_e[tc + j]) for j in range(VEC)]
            o_row = cute.make_rmem_tensor((1, VEC), Uint8)
            o_col = cute.make_rmem_tensor((1, VEC), Uint8)
            orw = cute.recast_tensor(o_row, Uint32)
            ocw = cute.recast_tensor(o_col, Uint32)
            for q in cutlass.range_constexpr(VEC // 4):
                orw[q] = ptx.encode_e4m3x4(aw[2 * q], aw[2 * q + 1], rr, rr, rr, rr)
                ocw[q] = data_mask & ptx.encode_e4m3x4(aw[2 * q], aw[2 * q + 1], *rc[4 * q: 4 * q + 4])
            if r < rows_valid:
                if c < cols_valid:
                    cute.autovec_copy(o_row, self.extra.g_row[(None, (row0 + r, (gcol0 + c) // VEC))])
                    cute.autovec_copy(o_col, self.extra.g_col[(None, (row0 + r, (gcol0 + c) // VEC))])

    @cute.jit
    def store_tile(self, sched: SegmentTileScheduler, tile, epi_count):
        """Writes ``h`` and both copies of ``a`` for the current tile; returns the new subtile count."""
        row_off, rows_valid, n_tile = tile
        row0 = sched.row0 + row_off
        col0 = n_tile * self.kernel.tile_n
        n = self.out.mOut.shape[1]
        in_group = sched.seg < sched.group_sizes.shape[0]
        blk = sched.blk0 + row_off // SCALE_BLOCK

        self._scales(row0, rows_valid, col0, n - col0, n_tile)
        self.kernel.epi_barrier.arrive_and_wait()
        self._column_scales(col0, n - col0, in_group, blk)
        self.kernel.epi_barrier.arrive_and_wait()

        tSG_cC = self.s2g[3]
        ps = self._probs([tSG_cC[(0, i, 0)][0] for i in range(cute.size(tSG_cC, mode=[1]))], row0, rows_valid)
        data_mask = Uint32(0) - Uint32(in_group)  # rows past the groups: column data 0
        passes = functools.partial(self._encode_pass, (ps, row0, rows_valid, data_mask))
        return self._store_subtiles(row0, rows_valid, col0, n_tile, epi_count, passes)
