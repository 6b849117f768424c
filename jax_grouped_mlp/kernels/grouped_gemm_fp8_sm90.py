"""Hopper (sm_90a) MXFP8 grouped GEMM over ragged M with FP8 wgmma and per-32-K promotion.

DESIGN.md's strategy 1 (a prototype to measure against strategy 2, the bf16 kernel on
dequantized operands): ``out[m] = sum_kb sa[m, kb] * sb[n, kb] * (A[m, kb] . B[g, n, kb])``
where ``kb`` runs over the 32-element MXFP8 blocks of K.

Operands (what the kernel reads; ``_src/gemm_fp8_ffi.py`` builds the scale layouts):
  A            [M, K]          float8_e4m3fn, K contiguous (rowwise MXFP8 data)
  B            [G, N, K]       float8_e4m3fn, K contiguous (a weight quantized along K, stored
                                transposed); seen as (N, K, G)
  SA           [KB, Mp]        float32, M contiguous: SA[kb, m] = 2^(e - 127) of A's scale byte
                                (NaN for 0xFF, 2^-127 for 0); ``KB = cdiv(K, 32)``,
                                ``Mp = round_up(M, 4)`` (16-byte TMA row stride); seen as (Mp, KB)
  SB           [G, KB, Np]     float32, the same values for B's scales; ``Np = round_up(N, tile_n)``
                                and within each chunk of ``tile_n`` columns, column
                                ``c = 8 n8 + 2 q + j`` sits at ``q * tile_n / 4 + 2 n8 + j``
                                (the wgmma accumulator layout: lane ``q = lane % 4`` of a warp
                                reads its ``tile_n / 4`` column scales as contiguous 16-byte
                                vectors); seen as (Np, KB, G)
  group_sizes  [G]             int32, read on the device only
  out          [M, N]          bf16

Scales are decoded to float32 outside the kernel (they are 1/32 of the elements; in fp32
they add 1/8 to the operand bytes) so the promotion costs one FMUL (``sa * sb``) and one
FFMA per accumulator element and 32-K block, with no per-element decode and with NaN /
2^-127 semantics for free.

Tile, pipeline and roles: as :class:`GroupedGemmSm90` (persistent ragged-M scheduler,
TMA producer warp, two consumer warp groups of 64 rows, TMA-store epilogue for full
tiles and predicated 16-byte stores for partial ones; those helpers are inherited), with
``tile_m x tile_n x tile_k = 128 x 128 x 128`` (128 fp8 = one 128-byte swizzle row; four
MXFP8 blocks and four ``m64n128k32`` wgmmas per stage and warp group). A stage holds the
A and B tiles plus the (128 x 4) SA and (128 x 4) SB scale tiles, all in one TMA
transaction. Rows past M, columns past N and K past the end are zero-filled by TMA
(data and scales: ``0 * 0`` contributes nothing).

Promotion (per consumer warp group, per 32-K block): the wgmma writes a fresh
temporary accumulator (scale-d = 0), then each thread adds
``acc[v] = fma(tmp[v], sa[row(v)] * sb[col(v)], acc[v])`` for its 64 values.

``num_tmp = 2`` (default): two temporaries, ping-pong. The wgmma of block kb+1 is issued
into the other temporary before block kb is promoted (``wait_group(1)``), so the tensor
cores work while the CUDA cores promote, inside each warp group; the two warp groups
also interleave. Registers: 64 (acc) + 2 x 64 (tmp) + 32 column scales per thread.
``num_tmp = 1``: one temporary, ``wait_group(0)`` before each promotion (DeepGEMM style):
overlap only comes from the other warp group's wgmma. Fewer registers.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from jax_grouped_mlp.kernels.grouped_gemm_sm90 import EPI_N, SMEM_CAPACITY, GroupedGemmSm90

SCALE_BLOCK = 32  # MXFP8 block along K


@dsl_user_op
def _fma(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """``a * b + c`` with one rounding (fma.rn.f32)."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c)],
            "fma.rn.f32 $0, $1, $2, $3;",
            "=f,f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dataclasses.dataclass(frozen=True)
class GroupedGemmFp8Config:
    """Compile-time knobs of :class:`GroupedGemmFp8Sm90`.

    tile_n: output columns per CTA tile (wgmma N); 128 keeps acc + 2 temporaries in registers.
    tile_k: K per pipeline stage: 128 fp8 (four 32-blocks, one 128-byte swizzle row).
    num_tmp: temporary accumulators per thread (1 or 2; see the module docstring).
    stages: shared-memory pipeline depth (0: as many as fit).
    panel_m, epi_stages: as in :class:`GroupedGemmConfig`.
    """

    tile_n: int = 128
    tile_k: int = 128
    num_tmp: int = 2
    stages: int = 0
    panel_m: int = 8
    epi_stages: int = 2

    tile_m = 128

    def __post_init__(self):
        if self.tile_n % 64 or not 64 <= self.tile_n <= 128 + 64 * (self.num_tmp == 1):
            raise ValueError(f"tile_n must be 64 or 128 (192 with num_tmp=1), got {self.tile_n=}")
        if self.tile_k != 128:
            raise ValueError(f"tile_k must be 128, got {self.tile_k=}")
        if self.num_tmp not in (1, 2):
            raise ValueError(f"num_tmp must be 1 or 2, got {self.num_tmp=}")
        if self.epi_stages < 2:
            raise ValueError(f"epi_stages must be >= 2, got {self.epi_stages=}")
        if self.panel_m < 1:
            raise ValueError(f"panel_m must be >= 1, got {self.panel_m=}")
        if self.num_stages < 2:
            raise ValueError(f"{self} leaves room for {self.num_stages} stages; need >= 2")

    @property
    def k_blocks(self) -> int:
        return self.tile_k // SCALE_BLOCK

    @property
    def stage_bytes(self) -> int:
        return (self.tile_m + self.tile_n) * self.tile_k + (self.tile_m + self.tile_n) * self.k_blocks * 4

    @property
    def epi_bytes(self) -> int:
        return self.tile_m * EPI_N * 2 * self.epi_stages

    @property
    def num_stages(self) -> int:
        fit = (SMEM_CAPACITY - 1024 - self.epi_bytes) // self.stage_bytes
        return min(fit, self.stages) if self.stages else fit

    @property
    def name(self) -> str:
        s = f"grouped_gemm_sm90_mxfp8_m{self.tile_m}n{self.tile_n}k{self.tile_k}_s{self.num_stages}_t{self.num_tmp}"
        s += f"_p{self.panel_m}" if self.panel_m != 8 else ""
        return s + (f"_e{self.epi_stages}" if self.epi_stages != 2 else "")


def is_supported(config: GroupedGemmFp8Config, m: int, n: int, k: int, g: int) -> bool:
    """TMA needs 16-byte row strides (K % 16 for fp8 rows, N % 8 for bf16 output rows)."""
    del config
    return n % 8 == 0 and k % 16 == 0 and n > 0 and g >= 0 and m * k < 2**31 and m * n < 2**31 and g * k * n < 2**31


class GroupedGemmFp8Sm90(GroupedGemmSm90):
    """Persistent warp-specialized TMA + FP8 wgmma MXFP8 grouped GEMM; see the module docstring."""

    def __init__(self, config: GroupedGemmFp8Config):
        self.config = config
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.tile_k = config.tile_k
        self.k_blocks = config.k_blocks
        self.num_tmp = config.num_tmp
        # Scale loads before the wgmma wait hide their latency but keep 2 + tile_n / 4
        # more registers live across it: that spills with two temporaries or tile_n 192.
        self.early_scales = config.num_tmp == 1 and config.tile_n <= 128
        self.stages = config.num_stages
        self.panel_m = config.panel_m
        self.tile_mnk = (self.tile_m, self.tile_n, self.tile_k)
        self.atom_layout_mnk = (2, 1, 1)
        self.num_mma_warp_groups = 2
        self.threads = 128 * (1 + self.num_mma_warp_groups)
        self.acc_dtype = Float32
        self.load_regs = 40
        self.mma_regs = 232
        self.epi_tile = (self.tile_m, EPI_N)
        self.epi_stages = config.epi_stages
        self.epi_store_warp = 4
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=128 * self.num_mma_warp_groups)

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (M, K) fp8, K contiguous
        b: cute.Tensor,  # (N, K, G) fp8, K contiguous
        sa: cute.Tensor,  # (Mp, KB) f32, M contiguous
        sb: cute.Tensor,  # (Np, KB, G) f32, N contiguous (permuted within tile_n chunks)
        out: cute.Tensor,  # (M, N) bf16
        group_sizes: cute.Tensor,  # (G,) int32
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        tma, smem_layouts = self._prepare(a, b, out)
        sa_smem = cute.make_layout((self.tile_m, self.k_blocks, self.stages),
                                   stride=(1, self.tile_m, self.tile_m * self.k_blocks))
        sb_smem = cute.make_layout((self.tile_n, self.k_blocks, self.stages),
                                   stride=(1, self.tile_n, self.tile_n * self.k_blocks))
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_sa, tma_sa = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, sa, cute.slice_(sa_smem, (None, None, 0)), (self.tile_m, self.k_blocks)
        )
        tma_atom_sb, tma_sb = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, sb, cute.slice_(sb_smem, (None, None, 0)), (self.tile_n, self.k_blocks)
        )
        a_smem, b_smem, epi_smem = smem_layouts

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.out_dtype, cute.cosize(epi_smem)], 1024]
            sSA: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sa_smem)], 128]
            sSB: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sb_smem)], 128]

        self.shared_storage = SharedStorage
        self.kernel(*tma, tma_atom_sa, tma_sa, tma_atom_sb, tma_sb, out, group_sizes, self.tiled_mma,
                    *smem_layouts, sa_smem, sb_smem).launch(
            grid=(num_ctas, 1, 1),
            block=(self.threads, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    def _shared_and_pipeline_fp8(self, a_smem, b_smem, epi_smem, sa_smem, sb_smem):
        """Shared memory and the TMA -> wgmma pipeline; a stage's transaction includes the scales."""
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        tx_bytes = (
            cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem, (None, None, 0)))
            + cute.size_in_bytes(self.ab_dtype, cute.slice_(b_smem, (None, None, 0)))
            + cute.size_in_bytes(Float32, cute.slice_(sa_smem, (None, None, 0)))
            + cute.size_in_bytes(Float32, cute.slice_(sb_smem, (None, None, 0)))
        )
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_warp_groups * 4),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sC = storage.sC.get_tensor(epi_smem.outer, swizzle=epi_smem.inner)
        sSA = storage.sSA.get_tensor(sa_smem)
        sSB = storage.sSB.get_tensor(sb_smem)
        return mainloop, sA, sB, sC, sSA, sSB

    @cute.jit
    def _issue(self, tiled_mma: cute.TiledMma, tmp: cute.Tensor, tCrA, tCrB, kb: int, stage) -> None:
        """One 32-K block: wgmma into the temporary ``tmp`` (overwritten: scale-d = 0), committed."""
        cute.nvgpu.warpgroup.fence()
        cute.gemm(tiled_mma, tmp, tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)], tmp)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _load_scales(self, sSA: cute.Tensor, sSBq: cute.Tensor, sb_frag: cute.Tensor, row: Int32, kb: int, stage):
        """This thread's scales of block ``kb`` of ``stage``: its ``tile_n / 4`` column scales
        into ``sb_frag`` (16-byte loads), and the row scales of rows ``row`` and ``row + 8``
        (returned). Issued before the wgmma wait where registers allow (``early_scales``)."""
        cute.autovec_copy(sSBq[(None, kb, stage)], sb_frag)
        return sSA[(row, kb, stage)], sSA[(row + 8, kb, stage)]

    @cute.jit
    def _promote(self, acc: cute.Tensor, tmp: cute.Tensor, sb_frag: cute.Tensor, sa) -> None:
        """``acc += tmp * sa[row] * sb[col]``, one FMUL and one FFMA per value.

        Accumulator value ``v`` of an m64nNk32 wgmma fragment is column pair element
        ``j = v % 2``, row half ``i = (v // 2) % 2`` (rows ``row`` and ``row + 8``),
        column octet ``n8 = v // 4``: column ``8 n8 + 2 q + j`` (``q = lane % 4``), whose
        scale is ``sb_frag[2 n8 + j]`` in the permuted SB layout.
        """
        for v in cutlass.range_constexpr(cute.size(acc)):
            j = v % 2
            i = (v // 2) % 2
            n8 = v // 4
            s = sa[i] * sb_frag[2 * n8 + j]
            acc[v] = _fma(tmp[v], s, acc[v])

    @cute.jit
    def _pingpong_stage(self, blocks, stage, carry) -> None:
        """Issues the k_blocks wgmmas of ``stage``, block kb into temporary ``kb % 2``, and
        promotes each block once the next one is issued; the last block stays in flight.

        ``carry``: None, or the stage whose last block is still in flight (promoted right
        after this stage's first block is issued; the caller then releases ``carry``).
        """
        tiled_mma, acc, tmp0, tmp1, tCrA, tCrB, sSA, sSBq, sb_frag, row = blocks
        tmps = (tmp0, tmp1)
        last = self.k_blocks - 1
        self._issue(tiled_mma, tmp0, tCrA, tCrB, 0, stage)
        if cutlass.const_expr(carry is not None):
            cute.nvgpu.warpgroup.wait_group(1)
            sa = self._load_scales(sSA, sSBq, sb_frag, row, last, carry)
            self._promote(acc, tmps[last % 2], sb_frag, sa)
        for kb in cutlass.range_constexpr(1, self.k_blocks):
            self._issue(tiled_mma, tmps[kb % 2], tCrA, tCrB, kb, stage)
            cute.nvgpu.warpgroup.wait_group(1)
            sa = self._load_scales(sSA, sSBq, sb_frag, row, kb - 1, stage)
            self._promote(acc, tmps[(kb - 1) % 2], sb_frag, sa)

    @cute.jit
    def _drain(self, blocks, stage) -> None:
        """Waits for the last block of ``stage`` (in flight) and promotes it."""
        tiled_mma, acc, tmp0, tmp1, tCrA, tCrB, sSA, sSBq, sb_frag, row = blocks
        last = self.k_blocks - 1
        cute.nvgpu.warpgroup.wait_group(0)
        sa = self._load_scales(sSA, sSBq, sb_frag, row, last, stage)
        self._promote(acc, (tmp0, tmp1)[last % 2], sb_frag, sa)

    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_out: cute.CopyAtom,
        mOutTma: cute.Tensor,
        tma_atom_sa: cute.CopyAtom,
        mSA: cute.Tensor,  # TMA coordinate tensor (Mp, KB)
        tma_atom_sb: cute.CopyAtom,
        mSB: cute.Tensor,  # TMA coordinate tensor (Np, KB, G)
        mOut: cute.Tensor,
        group_sizes: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        epi_smem: cute.ComposedLayout,
        sa_smem: cute.Layout,
        sb_smem: cute.Layout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_sa)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_sb)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_out)

        mainloop, sA, sB, sC, sSA, sSB = self._shared_and_pipeline_fp8(a_smem, b_smem, epi_smem, sa_smem, sb_smem)

        m = mOut.shape[0]
        n = mOut.shape[1]
        n_tiles = (n + (self.tile_n - 1)) // self.tile_n
        num_groups = group_sizes.shape[0]

        gB = cute.local_tile(mB, (self.tile_n, self.tile_k), (None, None, None))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        k_tiles = cute.size(gB, mode=[3])
        # (tile_n, k_blocks, n_tiles, kb_tiles, G): same tiling of the (Np, KB, G) scales.
        gSB = cute.local_tile(mSB, (self.tile_n, self.k_blocks), (None, None, None))
        tSBsSB, tSBgSB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_sb, 0, cute.make_layout(1), cute.group_modes(sSB, 0, 2), cute.group_modes(gSB, 0, 2)
        )

        warp_group = cute.arch.make_warp_uniform(tidx // 128)
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        seg0_rows = self._segment_rows(group_sizes, Int32(0), Int32(0), m)
        seg0_tiles = (seg0_rows + (self.tile_m - 1)) // self.tile_m * n_tiles

        if warp_group == 0:
            cute.arch.setmaxregister_decrease(self.load_regs)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                t = Int32(bidx)
                seg, seg_tile0, seg_row0, seg_rows, seg_tiles = self._seek(
                    group_sizes, t, Int32(0), Int32(0), Int32(0), seg0_rows, seg0_tiles, m, n_tiles
                )
                while seg <= num_groups:
                    row_off, _, n_tile = self._tile_coords(t, seg_tile0, seg_rows, n_tiles)
                    if seg < num_groups:
                        row0 = seg_row0 + row_off
                        gA = cute.local_tile(
                            cute.domain_offset((row0, 0), mA), (self.tile_m, self.tile_k), (0, None)
                        )
                        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                            tma_atom_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
                            cute.group_modes(gA, 0, 2),
                        )
                        gSA = cute.local_tile(
                            cute.domain_offset((row0, 0), mSA), (self.tile_m, self.k_blocks), (0, None)
                        )
                        tSAsSA, tSAgSA = cute.nvgpu.cpasync.tma_partition(
                            tma_atom_sa, 0, cute.make_layout(1), cute.group_modes(sSA, 0, 2),
                            cute.group_modes(gSA, 0, 2),
                        )
                        tBgB_tile = tBgB[(None, n_tile, None, seg)]
                        tSBgSB_tile = tSBgSB[(None, n_tile, None, seg)]
                        for k in range(k_tiles):
                            mainloop.producer_acquire(state)
                            bar = mainloop.producer_get_barrier(state)
                            cute.copy(tma_atom_a, tAgA[(None, k)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                            cute.copy(tma_atom_b, tBgB_tile[(None, k)], tBsB[(None, state.index)], tma_bar_ptr=bar)
                            cute.copy(tma_atom_sa, tSAgSA[(None, k)], tSAsSA[(None, state.index)], tma_bar_ptr=bar)
                            cute.copy(tma_atom_sb, tSBgSB_tile[(None, k)], tSBsSB[(None, state.index)],
                                      tma_bar_ptr=bar)
                            mainloop.producer_commit(state)
                            state.advance()
                    t = t + gdim
                    seg, seg_tile0, seg_row0, seg_rows, seg_tiles = self._seek(
                        group_sizes, t, seg, seg_tile0, seg_row0, seg_rows, seg_tiles, m, n_tiles
                    )
                mainloop.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            ctid = tidx - 128
            tCrA, tCrB, acc = self._mma_fragments(tiled_mma, sA, sB, ctid)
            tmp0 = cute.make_rmem_tensor(acc.shape, self.acc_dtype)
            tmp1 = cute.make_rmem_tensor(acc.shape, self.acc_dtype)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)  # every wgmma starts a temporary
            # This thread's rows (row, row + 8) of the tile and its column quad q.
            lane = ctid % 32
            row = (ctid // 32) * 16 + lane // 4
            q = lane % 4
            cols = self.tile_n // 4
            # (cols, q, kb, stage) view of the SB tiles: thread q's column scales are contiguous.
            sSBq = cute.make_tensor(
                sSB.iterator,
                cute.make_layout((cols, 4, self.k_blocks, self.stages),
                                 stride=(1, cols, self.tile_n, self.tile_n * self.k_blocks)),
            )[(None, q, None, None)]
            sb_frag = cute.make_rmem_tensor((cols,), Float32)

            epi = self._epilogue_copies(tiled_mma, sC, acc, ctid)
            store_pipeline = epi[5]
            epi_count = Int32(0)
            s2g = self._partial_store_copies(sC, ctid)

            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            t = Int32(bidx)
            seg, seg_tile0, seg_row0, seg_rows, seg_tiles = self._seek(
                group_sizes, t, Int32(0), Int32(0), Int32(0), seg0_rows, seg0_tiles, m, n_tiles
            )
            nkb = self.k_blocks
            while seg <= num_groups:
                row_off, rows_valid, n_tile = self._tile_coords(t, seg_tile0, seg_rows, n_tiles)
                acc.fill(0.0)
                if seg < num_groups:  # (k_tiles >= 1: the handler never launches K = 0)
                    if cutlass.const_expr(self.num_tmp == 2):
                        # Ping-pong through two temporaries, two stages per loop iteration:
                        # ptxas serializes the wgmmas (C7514) when a temporary is promoted
                        # across the loop's back edge, so only every second stage boundary
                        # drains (wait_group(0)); elsewhere block kb - 1 is promoted while
                        # block kb runs.
                        blocks = (tiled_mma, acc, tmp0, tmp1, tCrA, tCrB, sSA, sSBq, sb_frag, row)
                        for k2 in range(k_tiles // 2):
                            mainloop.consumer_wait(read)
                            self._pingpong_stage(blocks, read.index, None)
                            prev = read.index
                            read.advance()
                            mainloop.consumer_wait(read)
                            self._pingpong_stage(blocks, read.index, prev)
                            mainloop.consumer_release(release)  # `prev` is fully read
                            release.advance()
                            self._drain(blocks, read.index)
                            mainloop.consumer_release(release)
                            release.advance()
                            read.advance()
                        if k_tiles % 2 == 1:
                            mainloop.consumer_wait(read)
                            self._pingpong_stage(blocks, read.index, None)
                            self._drain(blocks, read.index)
                            mainloop.consumer_release(release)
                            release.advance()
                            read.advance()
                    else:
                        # One temporary: wgmma, wait, promote; the other warp group's
                        # wgmma keeps the tensor cores busy meanwhile.
                        for k in range(k_tiles):
                            mainloop.consumer_wait(read)
                            for kb in cutlass.range_constexpr(nkb):
                                self._issue(tiled_mma, tmp0, tCrA, tCrB, kb, read.index)
                                if cutlass.const_expr(self.early_scales):
                                    sa = self._load_scales(sSA, sSBq, sb_frag, row, kb, read.index)
                                    cute.nvgpu.warpgroup.wait_group(0)
                                else:
                                    cute.nvgpu.warpgroup.wait_group(0)
                                    sa = self._load_scales(sSA, sSBq, sb_frag, row, kb, read.index)
                                self._promote(acc, tmp0, sb_frag, sa)
                            mainloop.consumer_release(release)
                            release.advance()
                            read.advance()

                row0 = seg_row0 + row_off
                col0 = n_tile * self.tile_n
                if rows_valid == self.tile_m:
                    gTile = cute.local_tile(
                        cute.domain_offset((row0, 0), mOutTma), (self.tile_m, self.tile_n), (0, n_tile)
                    )
                    epi_count = self._store_tile_tma(epi, tma_atom_out, sC, gTile, epi_count, warp_idx)
                else:
                    epi_count = self._store_tile_partial(
                        epi, s2g, mOut, row0, col0, rows_valid, n, epi_count, warp_idx
                    )

                t = t + gdim
                seg, seg_tile0, seg_row0, seg_rows, seg_tiles = self._seek(
                    group_sizes, t, seg, seg_tile0, seg_row0, seg_rows, seg_tiles, m, n_tiles
                )
            store_pipeline.producer_tail()
