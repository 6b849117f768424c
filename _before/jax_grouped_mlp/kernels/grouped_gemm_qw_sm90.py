"""Hopper grouped GEMM with the weight quantized to MXFP8 in registers:
``out[m] = A[m] @ fake_quantize(B[group(m)])`` (blocks of 32 along K).

Same contract as :class:`~jax_grouped_mlp.kernels.grouped_gemm_sm90.GroupedGemmSm90`
(``a [M, K]``, ``b`` seen as ``(N, K, G)``, ``out [M, N]``, ``group_sizes``), except that
the kernel multiplies by the MXFP8 values of the bf16 weight (what
``mxfp8.dequantize(quantize_mxfp8(w, axis=K))`` gives, bit for bit) instead of the
weight itself, so no separate pass over the weights runs (at the Nemotron-3-Nano shape
that pass costs as much as the GEMM: docs/notes/2026-11-30-grouped-gemm-kernels.md).

Roles are swapped against the plain kernel: the wgmma computes ``out^T = W^T A^T``.
  * A operand (wgmma M, from registers): 128 weight rows (output columns n) x 64 K per
    stage, TMA-loaded into shared memory, then each consumer warp group reads its 64
    rows with ``ldmatrix`` (``.trans`` for the fprop weight ``[G, K, N]``), fake-quantizes
    them in registers and issues the wgmma with A from registers. In the m64k16 A
    fragment a lane holds 2 K values of rows ``r`` and ``r + 8`` per 8-K group, so a
    32-K block of a weight row lies in the 4 lanes of a quad: local max, 2 shuffles,
    the RCEIL scale, then ``ptx.fake_quant_bf16x4`` (the kernels' bit-exact quantizer).
    Two A register buffers alternate, so a stage's conversion overlaps the previous
    stage's wgmmas.
  * B operand (wgmma N, from shared memory): ``tile_t`` tokens x 64 K, K-major (TMA).
  * Ragged axis = tokens = the wgmma's N: each group's rows are cut into token tiles
    of ``tile_t`` that never cross the group's end (the plain kernel's scheduler with
    ``seg_tile = tile_t``; "column tiles" are the weight tiles of 128).
  * Epilogue: the accumulator is ``out^T``; the output is viewed as ``(N, M)`` with
    unit stride along N (column-major in the kernel's terms), so the plain kernel's
    stmatrix (transposing) + TMA-store epilogue writes ``out`` row-major. Partial token
    tiles (a group's last tokens, tokens past the groups) are written with 16-byte
    stores along n, predicated per token, so a tile never writes another group's rows.

The ``smem_a`` variants (name ``_ss``, ``tile_t`` 384) quantize each weight tile once for
384 tokens: each consumer warp group reads its 64 rows with ``ldmatrix`` as above,
quantizes them and writes them back in place with ``stmatrix``; after a proxy fence and
the warp group's named barrier, the wgmmas take A from shared memory and feed two
192-token accumulators (the tokens arrive as two TMA boxes per stage). A tile with at
most 192 tokens runs the first accumulator's wgmmas only. The conversion, which limits
the register-A kernel (a warp issues in order, and its conversion takes longer than a
stage's wgmmas), then has twice the MMA work to hide behind (docs/notes/2026-11-30-grouped-gemm-kernels.md).

Zero-filled K past the end (TMA) adds nothing to a block's amax, so a short last block
is quantized like ``quantize_mxfp8``'s zero padding.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, Uint32
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.cute.nvgpu.warpgroup import OperandSource

from jax_grouped_mlp.kernels import ptx
from jax_grouped_mlp.kernels.grouped_gemm_sm90 import (
    EPI_N, SMEM_CAPACITY, GroupedGemmSm90, StoreEpilogue, StoreTarget, TmaLoad, gemm_shared_storage,
)
from jax_grouped_mlp.kernels.registry import QW_CHUNK_TOKENS
from jax_grouped_mlp.kernels.tile_scheduler import RowBand, SegmentTileScheduler, TileWork, TraceTimeObject

TILE_W = 128  # weight rows (output columns) per CTA tile: two consumer warp groups of 64


@dataclasses.dataclass(frozen=True)
class GroupedGemmQwConfig:
    """Compile-time knobs of :class:`GroupedGemmQwSm90`.

    tile_t: tokens per CTA tile (the wgmma N; multiple of 32 in [64, 256]; with
      ``smem_a`` up to 512, split above 256 into two sub-tiles of ``tile_t / 2``).
    smem_a: quantize the weight tile in place in shared memory and take the wgmma's A
      from there (name ``_ss``), so one conversion feeds every token sub-tile.
    w_k_major: the weight arrives as ``[G, N, K]`` (K contiguous: the dgrad use, a
      transposed weight as stored) instead of ``[G, K, N]``.
    stages: shared-memory pipeline depth (0: as many as fit).
    panel_t: token tiles per rasterization panel (CTAs next to each other share a
      weight tile in L2).
    """

    tile_t: int = 192
    w_k_major: bool = False
    stages: int = 0
    panel_t: int = 8
    epi_stages: int = 2
    smem_a: bool = False

    tile_k = 64

    @property
    def halves(self) -> int:
        """Token sub-tiles per CTA tile (each its own accumulator and TMA box): 2 for
        ``smem_a`` tiles of more than 256 tokens, else 1."""
        return 2 if self.smem_a and self.tile_t > 256 else 1

    def __post_init__(self):
        if self.tile_t % (32 * self.halves) or not 64 <= self.tile_t // self.halves <= 256:
            limit = 512 if self.smem_a else 256
            raise ValueError(f"tile_t must be a multiple of 32 in [64, {limit}] (of 64 above 256), got {self.tile_t=}")
        if self.epi_stages < 2:
            raise ValueError(f"epi_stages must be >= 2, got {self.epi_stages=}")
        if self.num_stages < 2:
            raise ValueError(f"{self} leaves room for {self.num_stages} stages; need >= 2")

    @property
    def stage_bytes(self) -> int:
        return (TILE_W + self.tile_t) * self.tile_k * 2

    @property
    def num_stages(self) -> int:
        fit = (SMEM_CAPACITY - 1024 - TILE_W * EPI_N * 2 * self.epi_stages) // self.stage_bytes
        return min(fit, self.stages) if self.stages else fit

    @property
    def name(self) -> str:
        s = f"grouped_gemm_sm90_qw_w{TILE_W}t{self.tile_t}k{self.tile_k}_s{self.num_stages}"
        s += f"_p{self.panel_t}" if self.panel_t != 8 else ""
        s += "_ss" if self.smem_a else ""
        return s + ("_bk" if self.w_k_major else "")


class GroupedGemmQwSm90(GroupedGemmSm90):
    """Grouped GEMM on in-register MXFP8 weights; see the module docstring.

    Reuses the plain kernel's scheduler (``seg_tile`` = ``tile_t``), TMA producer,
    shared-memory pipeline and TMA-store epilogue; owns the register-A mainloop and
    the token-predicated partial-tile store.
    """


    def __init__(self, config: GroupedGemmQwConfig):
        self.qw_config = config
        self.row_boxes = config.halves
        self.tile_t = config.tile_t // config.halves  # tokens per accumulator (and TMA box)
        self.tile_m = TILE_W
        self.tile_n = self.tile_t
        self.tile_k = config.tile_k
        self.stages = config.num_stages
        self.panel_m = config.panel_t
        self.tile_mnk = (TILE_W, self.tile_t, self.tile_k)
        self.seg_tile = config.tile_t
        self.b_tile = TILE_W
        self.atom_layout_mnk = (2, 1, 1)
        self.num_mma_warp_groups = 2
        self.threads = 128 * (1 + self.num_mma_warp_groups)
        self.acc_dtype = cutlass.Float32
        # The smem-A variants keep two accumulators (192 registers): the consumers
        # take the most setmaxnreg allows, the producer warp group the least.
        self.load_regs = 24 if config.halves == 2 else 40
        self.mma_regs = 240 if config.halves == 2 else 232
        self.epi_tile = (TILE_W, EPI_N)
        self.epi_stages = config.epi_stages
        self.epi_store_warp = 4
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=128 * self.num_mma_warp_groups)

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (M, K) bf16 tokens, K contiguous
        b: cute.Tensor,  # (N, K, G) bf16 weights: N contiguous ([G, K, N]) or K contiguous ([G, N, K])
        out: cute.Tensor,  # (M, N) bf16, N contiguous
        group_sizes: cute.Tensor,  # (G,) int32
        choice: cute.Tensor,  # (2,) int32: which of `count` launches work (see kernel)
        slot: Int32,  # this launch's index among them
        count: Int32,
        lo: Int32,  # mixed tiles: the largest token tile below this one's among the launches (0: none)
        top: Int32,  # mixed tiles: 1 where this launch has the largest token tile
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        # out^T: (N, M) with unit stride along N (the accumulator's orientation).
        out_t = cute.make_tensor(
            out.iterator, cute.make_layout((out.shape[1], out.shape[0]), stride=(out.stride[1], out.stride[0]))
        )
        tma, smem_layouts = self._prepare_qw(b, a, out_t)
        self.kernel(*tma, out_t, group_sizes, choice, slot, count, lo, top, self.tiled_mma, *smem_layouts).launch(
            grid=(num_ctas, 1, 1),
            block=(self.threads, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    @cute.jit
    def _prepare_qw(self, w: cute.Tensor, x: cute.Tensor, out_t: cute.Tensor):
        """TMA atoms and shared-memory layouts: ``w`` (N, K, G) is A, ``x`` (M, K) is B."""
        self.ab_dtype = x.element_type
        self.out_dtype = out_t.element_type
        self.w_mn_major = not self.qw_config.w_k_major
        w_layout = utils.LayoutEnum.from_tensor(w)
        x_layout = utils.LayoutEnum.from_tensor(x)
        self.x_major = x_layout.sm90_mma_major_mode()
        self.tiled_mma = self._make_mma(self.qw_config.smem_a)
        w_smem = sm90_utils.make_smem_layout_a(w_layout, self.tile_mnk, self.ab_dtype, self.stages)
        x_smem = sm90_utils.make_smem_layout_b(x_layout, self.tile_mnk, self.ab_dtype, self.stages * self.row_boxes)
        tma_atom_w, tma_w = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), w, cute.slice_(w_smem, (None, None, 0)),
            (TILE_W, self.tile_k),
        )
        tma_atom_x, tma_x = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), x, cute.slice_(x_smem, (None, None, 0)),
            (self.tile_t, self.tile_k),
        )
        self.out_layout = utils.LayoutEnum.from_tensor(out_t)
        epi_smem = sm90_utils.make_smem_layout_epi(self.out_dtype, self.out_layout, self.epi_tile, self.epi_stages)
        tma_atom_out, tma_out = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), out_t, cute.slice_(epi_smem, (None, None, 0)),
            self.epi_tile,
        )

        self.shared_storage = gemm_shared_storage(self, w_smem, x_smem, epi_smem)
        tma = (tma_atom_w, tma_w, tma_atom_x, tma_x, tma_atom_out, tma_out)
        return tma, (w_smem, x_smem, epi_smem)

    def _make_mma(self, smem_a: bool = False) -> cute.TiledMma:
        """The bf16 wgmma with A (weights) from registers (or, ``smem_a``, from the
        quantized weight tile in shared memory), B (tokens) from shared memory."""
        if smem_a:
            a_major = OperandMajorMode.MN if self.w_mn_major else OperandMajorMode.K
            return sm90_utils.make_trivial_tiled_mma(
                self.ab_dtype, self.ab_dtype, a_major, self.x_major, self.acc_dtype, self.atom_layout_mnk,
                tiler_mn=(64, self.tile_t),
            )
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            OperandMajorMode.K,
            self.x_major,
            self.acc_dtype,
            self.atom_layout_mnk,
            tiler_mn=(64, self.tile_t),
            a_source=OperandSource.RMEM,
        )

    # ---- the register-A mainloop ----

    @cute.jit
    def _quantize_stage(self, frag: cute.Tensor, lane) -> None:
        """Fake-quantizes this thread's share of a 64 x 64 weight slice in place.

        ``frag`` is the wgmma A fragment ((2, 2, 2), 1, 4) of bf16, compact: value
        ``v0 + 2 v1 + 4 v2 + 8 kb`` is row ``r + 8 v1``, K ``16 kb + 8 v2 + 2 (lane % 4) + v0``.
        As 32-bit words (pairs along K): word ``v1 + 2 v2 + 4 kb``. A 32-K block of a
        row (``kb in {2 blk, 2 blk + 1}``) lies in the 4 lanes of a quad, so a thread
        holds parts of four blocks ("chains": 2 rows x 2 blocks) and so does each lane
        of its quad. The quad splits the scale work: a transposing reduction (3
        shuffles) leaves lane ``q`` with chain ``q``'s block amax, each lane computes
        one RCEIL scale, and 2 shuffles gather the four scale bytes back to every lane.
        """
        flat = cute.make_tensor(frag.iterator, cute.make_layout(cute.size(frag)))
        words = cute.recast_tensor(flat, Uint32)
        chains = [(half, blk) for blk in range(2) for half in range(2)]
        idx = [[half + 2 * v2 + 4 * kb for kb in (2 * blk, 2 * blk + 1) for v2 in range(2)] for half, blk in chains]
        w = [[words[i] for i in ix] for ix in idx]
        am = [ptx.max_u16x2(ptx.max_u16x2(ptx.abs_bf16x2(c[0]), ptx.abs_bf16x2(c[1])),
                            ptx.max_u16x2(ptx.abs_bf16x2(c[2]), ptx.abs_bf16x2(c[3]))) for c in w]
        am = [cutlass.max(a & Uint32(0xFFFF), a >> 16) for a in am]
        q = lane % 4
        hi = (q >> 1) == 1  # lanes 2, 3 keep chains 2, 3 in the first round
        odd = (q & 1) == 1
        keep0 = cutlass.select_(hi, am[2], am[0])
        keep1 = cutlass.select_(hi, am[3], am[1])
        send0 = cutlass.select_(hi, am[0], am[2])
        send1 = cutlass.select_(hi, am[1], am[3])
        m0 = cutlass.max(keep0, Uint32(cute.arch.shuffle_sync_bfly(send0, offset=2)))
        m1 = cutlass.max(keep1, Uint32(cute.arch.shuffle_sync_bfly(send1, offset=2)))
        keep = cutlass.select_(odd, m1, m0)
        send = cutlass.select_(odd, m0, m1)
        mine = cutlass.max(keep, Uint32(cute.arch.shuffle_sync_bfly(send, offset=1)))  # chain q's amax
        packed = ptx.e8m0_rceil(mine) << (Uint32(8) * q)
        packed = packed | Uint32(cute.arch.shuffle_sync_bfly(packed, offset=1))
        packed = packed | Uint32(cute.arch.shuffle_sync_bfly(packed, offset=2))
        for c in cutlass.range_constexpr(4):
            r2, v2 = ptx.e8m0_bf16x2_scales(packed, c)
            for j in cutlass.range_constexpr(4):
                words[idx[c][j]] = ptx.fake_quant_bf16x2(w[c][j], r2, v2)

    @cute.jit
    def _qw_stage(self, tiled_mma, acc, s2r, tXsW, tXrW, tCrW, tCrX, stage, lane, mma_first=None) -> None:
        """Loads and quantizes one stage's weight slice into the register buffer ``tCrW``
        (both 32-K blocks at once: four independent chains per thread), then issues its
        wgmmas as one commit group. ``mma_first``: the MMA of a tile's first wgmma (it
        overwrites the accumulator)."""
        for kb in cutlass.range_constexpr(cute.size(tCrW, mode=[2])):
            cute.copy(s2r, tXsW[(None, None, kb, stage)], tXrW[(None, None, kb)])
        self._quantize_stage(tCrW, lane)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tCrW, mode=[2])):
            mma = mma_first if cutlass.const_expr(kb == 0 and mma_first is not None) else tiled_mma
            cute.gemm(mma, acc, tCrW[(None, None, kb)], tCrX[(None, None, kb, stage)], acc)
        cute.nvgpu.warpgroup.commit_group()

    def _partial_store_copies_t(self, sC: cute.Tensor, ctid):
        """Partial token tiles: 16-byte stores of 8 output columns (contiguous along n in
        ``out``) of one token; 256 threads = 16 vectors x 16 tokens per pass."""
        s2g_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype, num_bits_per_copy=128)
        tiled_s2g = cute.make_tiled_copy_tv(
            s2g_atom, cute.make_layout((TILE_W // 8, 16)), cute.make_layout((8, 1))
        )
        thr_s2g = tiled_s2g.get_slice(ctid)
        return s2g_atom, thr_s2g, thr_s2g.partition_S(sC), thr_s2g.partition_D(cute.make_identity_tensor(self.epi_tile))

    @cute.jit
    def _store_tile_partial_t(
        self, epi, s2g, mOut: cute.Tensor, w0: Int32, tok0: Int32, toks_valid: Int32, nw: Int32,
        epi_count: Int32, warp_idx,
    ):
        """Stores the accumulator's first ``toks_valid`` tokens (columns of ``out^T``)."""
        if warp_idx == self.epi_store_warp:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        rows_valid = nw - w0
        for e in cutlass.range_constexpr(self.tile_t // EPI_N):
            buf = self._stage_subtile(epi, e, epi_count)
            self.epi_barrier.arrive_and_wait()
            self._store_subtile_rows(
                s2g, s2g[2][(None, None, None, buf)], mOut, w0, tok0 + e * EPI_N, rows_valid, toks_valid - e * EPI_N
            )
        return epi_count + self.tile_t // EPI_N

    @cute.jit
    def _rs_operands(self, tiled_mma: cute.TiledMma, sW: cute.Tensor, ctid):
        """The register-A mainloop's weight buffers: two A fragments (one per stage
        parity) and the ``ldmatrix`` copy into each."""
        thr_mma = tiled_mma.get_slice(ctid)
        tCsW = thr_mma.partition_A(sW)
        tCrW0 = tiled_mma.make_fragment_A(tCsW[(None, None, None, 0)])
        tCrW1 = tiled_mma.make_fragment_A(tCsW[(None, None, None, 0)])
        s2r_atom = cute.make_copy_atom(
            cute.nvgpu.warp.LdMatrix8x8x16bOp(self.w_mn_major, 4), self.ab_dtype
        )
        s2r = cute.make_tiled_copy_A(s2r_atom, tiled_mma)
        thr_s2r = s2r.get_slice(ctid)
        return s2r, thr_s2r.partition_S(sW), (thr_s2r.retile(tCrW0), thr_s2r.retile(tCrW1)), (tCrW0, tCrW1)

    @cute.jit
    def _rs_tile_mainloop(self, mainloop, read, release, k_tiles, mmas, accs, ops, tCrX, thread, halves: int):
        """Every stage of one tile, register-A (one accumulator); returns the advanced
        ``(read, release)`` states.

        The first wgmma overwrites the accumulator (no zero fill: ptxas serializes
        every wgmma when plain instructions define their accumulator registers inside a
        wgmma pipeline stage). Two register buffers, one per stage parity: stage k + 1
        is loaded and quantized while stage k's wgmmas run; a buffer is rewritten only
        after wait_group(1) has retired the wgmmas that read it. The loop body holds
        one stage of each parity and has no branch (ptxas serializes every wgmma of a
        pipeline it cannot follow through control flow); an odd last stage is peeled
        after it. (k_tiles >= 1: the handler never launches K = 0.)"""
        del halves  # always 1 here
        lane, _ = thread
        tiled_mma, mma_first = mmas
        acc = accs[0]
        s2r, tXsW, (tXrW0, tXrW1), (tCrW0, tCrW1) = ops
        mainloop.consumer_wait(read)
        self._qw_stage(tiled_mma, acc, s2r, tXsW, tXrW0, tCrW0, tCrX, read.index, lane, mma_first)
        read.advance()
        for _k in range((k_tiles - 1) // 2):
            mainloop.consumer_wait(read)
            self._qw_stage(tiled_mma, acc, s2r, tXsW, tXrW1, tCrW1, tCrX, read.index, lane)
            cute.nvgpu.warpgroup.wait_group(1)
            mainloop.consumer_release(release)
            release.advance()
            read.advance()
            mainloop.consumer_wait(read)
            self._qw_stage(tiled_mma, acc, s2r, tXsW, tXrW0, tCrW0, tCrX, read.index, lane)
            cute.nvgpu.warpgroup.wait_group(1)
            mainloop.consumer_release(release)
            release.advance()
            read.advance()
        if (k_tiles - 1) % 2 == 1:
            mainloop.consumer_wait(read)
            self._qw_stage(tiled_mma, acc, s2r, tXsW, tXrW1, tCrW1, tCrX, read.index, lane)
            cute.nvgpu.warpgroup.wait_group(1)
            mainloop.consumer_release(release)
            release.advance()
            read.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        mainloop.consumer_release(release)
        release.advance()
        return read, release

    @cute.jit
    def _ss_stage(self, mma, accs, s2r, r2s, tXsW, tXrW, tYsW, tYrW, tCrW, tCrA, tCrX, stage, lane, wg, first: bool, halves: int):
        """One stage of the shared-memory-A mainloop: this warp group's 64 weight rows are
        read (``ldmatrix``), quantized in registers and written back in place
        (``stmatrix``, the inverse partition), made visible to the tensor cores (proxy
        fence + the warp group's named barrier), then the wgmmas of the first ``halves``
        token sub-tiles read the quantized tile from shared memory, one commit group."""
        for kb in cutlass.range_constexpr(cute.size(tCrW, mode=[2])):
            cute.copy(s2r, tXsW[(None, None, kb, stage)], tXrW[(None, None, kb)])
        self._quantize_stage(tCrW, lane)
        for kb in cutlass.range_constexpr(cute.size(tCrW, mode=[2])):
            cute.copy(r2s, tYrW[(None, None, kb)], tYsW[(None, None, kb, stage)])
        cute.arch.fence_proxy("async.shared", space="cta")
        pipeline.NamedBarrier(barrier_id=2 + wg, num_threads=128).arrive_and_wait()
        cute.nvgpu.warpgroup.fence()
        for h in cutlass.range_constexpr(halves):
            for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                m = mma[1] if cutlass.const_expr(first and kb == 0) else mma[0]
                cute.gemm(m, accs[h], tCrA[(None, None, kb, stage)], tCrX[(None, None, kb, stage * self.row_boxes + h)], accs[h])
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _ss_operands(self, tiled_mma: cute.TiledMma, sW: cute.Tensor, ctid):
        """The shared-memory-A mainloop's operands: the wgmma's A fragments over the
        weight buffer, and the conversion's register view of it (the register-A wgmma's
        fragment layout, so a 32-K block of a row lies in one quad) with its
        ``ldmatrix`` read and ``stmatrix`` write-back copies."""
        tCrA = tiled_mma.make_fragment_A(tiled_mma.get_slice(ctid).partition_A(sW))
        rs_mma = self._make_mma()
        tCrW = rs_mma.make_fragment_A(rs_mma.get_slice(ctid).partition_A(sW)[(None, None, None, 0)])
        s2r = cute.make_tiled_copy_A(cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(self.w_mn_major, 4), self.ab_dtype), rs_mma)
        r2s = cute.make_tiled_copy_A(cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(self.w_mn_major, 4), self.ab_dtype), rs_mma)
        thr_s2r = s2r.get_slice(ctid)
        thr_r2s = r2s.get_slice(ctid)
        copies = (s2r, r2s, thr_s2r.partition_S(sW), thr_s2r.retile(tCrW), thr_r2s.partition_D(sW), thr_r2s.retile(tCrW))
        return copies, tCrW, tCrA

    @cute.jit
    def _ss_tile_mainloop(self, mainloop, read, release, k_tiles, mmas, accs, ops, tCrX, thread, halves: int):
        """Every stage of one tile into the first ``halves`` accumulators (the first
        wgmmas overwrite them), shared-memory A; returns the advanced ``(read,
        release)`` states."""
        (s2r, r2s, tXsW, tXrW, tYsW, tYrW), tCrW, tCrA = ops
        lane, wg = thread
        mainloop.consumer_wait(read)
        self._ss_stage(mmas, accs, s2r, r2s, tXsW, tXrW, tYsW, tYrW, tCrW, tCrA, tCrX, read.index, lane, wg, True, halves)
        read.advance()
        for _k in range(k_tiles - 1):
            mainloop.consumer_wait(read)
            self._ss_stage(mmas, accs, s2r, r2s, tXsW, tXrW, tYsW, tYrW, tCrW, tCrA, tCrX, read.index, lane, wg, False, halves)
            cute.nvgpu.warpgroup.wait_group(1)
            mainloop.consumer_release(release)
            release.advance()
            read.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        mainloop.consumer_release(release)
        release.advance()
        return read, release

    @cute.kernel
    def kernel(
        self,
        tma_atom_w: cute.CopyAtom,
        mW: cute.Tensor,  # TMA coordinate tensor (N, K, G)
        tma_atom_x: cute.CopyAtom,
        mX: cute.Tensor,  # TMA coordinate tensor (M, K)
        tma_atom_out: cute.CopyAtom,
        mOutTma: cute.Tensor,  # TMA coordinate tensor (N, M)
        mOut: cute.Tensor,  # (N, M), unit stride along N
        group_sizes: cute.Tensor,
        choice: cute.Tensor,
        slot: Int32,
        count: Int32,
        lo: Int32,
        top: Int32,
        tiled_mma: cute.TiledMma,
        w_smem: cute.ComposedLayout,
        x_smem: cute.ComposedLayout,
        epi_smem: cute.ComposedLayout,
    ):
        # Tiles chosen on the device: the handler launches `count` variants back to back,
        # this one as `slot`; `choice` (computed by XLA from the group sizes) says which
        # work: choice[0] alone (clamped into range), or, with choice[1] == 1 (mixed
        # tiles), all of them, each on its band of every group (tile_scheduler.RowBand:
        # whole chunks on the largest tile, each remainder on the smallest tile that holds
        # it; `lo` and `top` come from the handler). Whatever the buffer holds, the
        # launches that work take every row once; every CTA of the others exits before
        # touching shared memory or the output.
        first = cutlass.min(cutlass.max(Int32(choice[0]), Int32(0)), count - 1)
        mixed = cutlass.select_(Int32(choice[1]) == 1, Int32(1), Int32(0))
        works = cutlass.select_(slot == first, Int32(1), mixed)
        band = RowBand(QW_CHUNK_TOKENS, self.seg_tile, mixed, lo, top)
        if works == 1:
            cta = self._kernel_start((tma_atom_w, tma_atom_x, tma_atom_out))
            # The producer's "A" is the token tile (rows from the tile's start), its "B" the
            # group's weight tile: the plain kernel's loads, into the swapped buffers.
            pipe, sW, sX, sC, warp_group, work = self._setup_and_produce(
                TmaLoad(tma_atom_x, mX), TmaLoad(tma_atom_w, mW), mOut, group_sizes, (w_smem, x_smem, epi_smem),
                cta, swapped=True, band=band,
            )
            if warp_group != 0:
                cute.arch.setmaxregister_increase(self.mma_regs)
                self._consumer(
                    QwMainloop(self, tiled_mma, pipe, sW, sX),
                    TransposedStoreEpilogue(self, StoreTarget(sC, tma_atom_out, mOutTma, mOut), cta.warp_idx),
                    work, cta.tidx - 128, carry_order=("read", "release", "epi_count", "sched"),
                )


# ---- the consumer's parts (GroupedGemmSm90._consumer runs them) ----


class QwMainloop(TraceTimeObject):
    """The weight-quantizing mainloop: register-A (:meth:`GroupedGemmQwSm90._rs_tile_mainloop`)
    or, for the ``smem_a`` variants, shared-memory A (:meth:`GroupedGemmQwSm90._ss_tile_mainloop`),
    whose quantized weight tile feeds ``row_boxes`` token sub-tiles, each its own
    accumulator. Tail tiles (tokens past the groups) leave zero accumulators."""

    def __init__(self, kernel: GroupedGemmQwSm90, tiled_mma: cute.TiledMma, pipe, sW: cute.Tensor, sX: cute.Tensor):
        self.kernel = kernel
        self.tiled_mma = tiled_mma
        self.pipe = pipe
        self.sW = sW
        self.sX = sX

    def setup(self, ctid):
        """The MMAs, operand fragments and conversion copies of consumer thread ``ctid``;
        returns the accumulators (one per token sub-tile)."""
        kernel, tiled_mma = self.kernel, self.tiled_mma
        smem_a = kernel.qw_config.smem_a
        # Two MMAs with fixed accumulate flags (set once here: a flag changed inside the
        # tile loop would be a value escaping its region).
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        mma_first = kernel._make_mma(smem_a)
        mma_first.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        self.mmas = (tiled_mma, mma_first)
        self.thread = (ctid % 32, ctid // 128)  # lane, consumer warp group
        thr_mma = tiled_mma.get_slice(ctid)
        self.tCrX = tiled_mma.make_fragment_B(thr_mma.partition_B(self.sX))
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((TILE_W, kernel.tile_t)))
        self.accs = [cute.make_rmem_tensor(tCcC.shape, kernel.acc_dtype) for _ in range(kernel.row_boxes)]
        if cutlass.const_expr(smem_a):
            self.ops = kernel._ss_operands(tiled_mma, self.sW, ctid)
            self.tile_mainloop = kernel._ss_tile_mainloop
        else:
            self.ops = kernel._rs_operands(tiled_mma, self.sW, ctid)
            self.tile_mainloop = kernel._rs_tile_mainloop
        return self.accs

    @cute.jit
    def tile(self, sched: SegmentTileScheduler, tile, read, release, work: TileWork):
        """The current tile's accumulators; returns the advanced ``(read, release)`` states."""
        toks_valid, k_tiles = tile[1], work.k_tiles
        halves = self.kernel.row_boxes
        num_groups = sched.group_sizes.shape[0]
        seg = sched.seg
        mainloop, mmas, accs, ops, tCrX, thread = self.pipe, self.mmas, self.accs, self.ops, self.tCrX, self.thread
        if cutlass.const_expr(halves == 1):
            if seg < num_groups:
                read, release = self.tile_mainloop(mainloop, read, release, k_tiles, mmas, accs, ops, tCrX, thread, 1)
            else:
                accs[0].fill(0.0)  # tokens past the groups: zeros
        else:
            # Each branch holds a whole wgmma pipeline (ptxas serializes the wgmmas
            # of one that crosses control flow).
            if seg < num_groups and toks_valid > self.kernel.tile_t:
                read, release = self.tile_mainloop(
                    mainloop, read, release, k_tiles, mmas, accs, ops, tCrX, thread, halves
                )
            elif seg < num_groups:
                # A group's last tile with tokens in the first sub-tile only: its
                # wgmmas alone (the same conversion). The other accumulators are
                # zeroed: past the group, the partial store writes none of them,
                # and without it ptxas spills at the branches' merge.
                for h in cutlass.range_constexpr(1, halves):
                    accs[h].fill(0.0)
                read, release = self.tile_mainloop(mainloop, read, release, k_tiles, mmas, accs, ops, tCrX, thread, 1)
            else:
                for h in cutlass.range_constexpr(halves):
                    accs[h].fill(0.0)  # tokens past the groups: zeros
        return read, release


class TransposedStoreEpilogue(StoreEpilogue):
    """:class:`StoreEpilogue` for the swapped GEMM: the accumulators are ``out^T`` (weight
    rows x tokens, one per token sub-tile) and ``out`` is viewed as ``(N, M)``; full token
    tiles are TMA-stored, partial ones stored with token-predicated 16-byte stores along
    n (:meth:`GroupedGemmQwSm90._store_tile_partial_t`)."""

    def setup(self, tiled_mma: cute.TiledMma, accs, ctid):
        self.epis = [self.kernel._epilogue_copies(tiled_mma, self.out.sC, accs[h], ctid) for h in range(len(accs))]
        self.s2g = self.kernel._partial_store_copies_t(self.out.sC, ctid)

    @cute.jit
    def store_tile(self, sched: SegmentTileScheduler, tile, epi_count):
        tok_off, toks_valid, w_tile = tile
        out, tile_t = self.out, self.kernel.tile_t
        tok0 = sched.row0 + tok_off
        w0 = w_tile * TILE_W
        if toks_valid == self.kernel.seg_tile:
            for h in cutlass.range_constexpr(len(self.epis)):
                gTile = cute.local_tile(
                    cute.domain_offset((0, tok0 + h * tile_t), out.mOutTma), (TILE_W, tile_t), (w_tile, 0)
                )
                epi_count = self.kernel._store_tile_tma(
                    self.epis[h], out.tma_atom, out.sC, gTile, epi_count, self.warp_idx
                )
        else:
            for h in cutlass.range_constexpr(len(self.epis)):
                epi_count = self.kernel._store_tile_partial_t(
                    self.epis[h], self.s2g, out.mOut, w0, tok0 + h * tile_t, toks_valid - h * tile_t,
                    out.mOut.shape[0], epi_count, self.warp_idx,
                )
        return epi_count

    def finish(self):
        self.epis[0][5].producer_tail()
