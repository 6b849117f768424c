"""Hopper grouped GEMM with MXFP8 weights converted to bf16 inside the kernel.

``out[m] = A[m] @ dequantize(B)[group(m)]`` -- DESIGN.md's strategy 2 with the
conversion on the way into shared memory, so the weights cross HBM as FP8 (half the
bytes of bf16) and no separate dequantization pass runs.

Operands:
  A            [M, K]         bf16, K contiguous (MXFP8 values in bf16, as upstream writes them)
  B            [G, K, N]      FP8 E4M3 bytes, N contiguous (the fprop use, e.g. FC1's w1)
               or [G, N, K]   K contiguous (``b_k_major``: a transposed weight as stored,
                              the dgrad use); seen by the kernel as (N, K, G) either way
  B_scale      [G, cdiv(K, 32), N]  E8M0 bytes, N contiguous, one per 32 consecutive K of
                              one column (whatever B's layout: the K-major binding transposes
                              the small scale tensor first); seen as (N, KB, G)
  group_sizes  [G] int32, out [M, N] bf16 -- as in :mod:`grouped_gemm_sm90`.

Exactness: each B element becomes ``bf16(f32(e4m3) * 2**(e - 127))`` (E8M0 byte 0 is
2**-127, 0xFF is NaN), the arithmetic of ``mxfp8.dequantize``; the wgmmas, their order
and the epilogue are the bf16 kernel's. So the output equals the bf16 kernel run on
``dequantize(B)`` bit for bit.

Roles (384 threads, one CTA per SM; the tile scheduler is the bf16 kernel's):
  * warp 0 -- TMA producer: per stage the A tile (bf16), the raw B tile (FP8) and its
    scales (two 32-K blocks x tile_n bytes) into a "raw" stage, one transaction barrier.
  * warps 1-3 -- converters (96 threads; ``_c7`` variants: also warps 12-15, a fourth
    warp group, 224 threads in 512): wait for a raw stage, convert its B tile to bf16
    into the stage's B buffer in the swizzled layout the wgmma reads (16-byte
    shared-memory stores through CuTe's layout), ``fence.proxy.async`` (the stores are
    generic-proxy, wgmma reads through the async proxy), then arrive on the stage's
    "converted" barrier (one arrival per converter thread) and release the raw stage.
    Decode: integer bit placement + one bf16x2 multiply per pair (``ptx.
    dequant_e4m3x4_bf16_fast``) for batches without E4M3 NaN bytes or scale bytes > 134,
    else the exact float32 path (``ptx.dequant_e4m3x4_bf16``); batches of up to 11
    vectors of 8 weights, all loads first.
  * warp groups 1-2 -- consumers, the bf16 kernel's code (``_mma_consumer``): wait for
    the raw stage (A) *and* the converted barrier (B), wgmma, release the raw stage.
Pipelines: ``mainloop`` (PipelineTmaAsync; empty barrier: 8 consumer warps + 3 (or 7)
converter warps arrive, one lane each), ``converted`` (PipelineAsync full barriers only,
same stage index and phase as ``mainloop``). The converted bf16 buffer of a stage needs
no empty barrier of its own: the converters overwrite it only after the producer refilled
the raw stage, which needs the consumers' release of that stage, which they give after
their wgmmas on it completed (``wait_group``).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Int32, Uint8, Uint32
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from jax_grouped_mlp.kernels import ptx
from jax_grouped_mlp.kernels.grouped_gemm_sm90 import GroupedGemmConfig, GroupedGemmSm90

SCALE_BLOCK = 32
CONVERTER_WARPS = (3, 7)  # warps 1-3 of warp group 0 (+ warps 12-15, a fourth warp group: ``_c7``)
UNROLL = 11  # at most this many vectors (8 elements) per converter batch: loads first, for overlap


class GroupedGemmW8Sm90(GroupedGemmSm90):
    """The bf16 grouped GEMM with FP8 + E8M0 B converted in the kernel; see the module docstring."""

    def __init__(self, config: GroupedGemmConfig):
        if not config.b_fp8:
            raise ValueError(f"GroupedGemmW8Sm90 needs b_fp8=True, got {config}")
        super().__init__(config)
        self.b_k_major = config.b_k_major
        self.kb_per_stage = self.tile_k // SCALE_BLOCK  # 2
        # Register split. The CTA's pool is 384 x 168 registers (1 CTA/SM); setmaxnreg
        # moves them between warp groups, and ptxas allocates up to the setmaxnreg count
        # in the code it dominates (the FC1 kernel's consumers reach R174, the _qw
        # kernel's R196, in their SASS), while the bf16 kernel's consumer code needs only
        # R0-R152. Here: warp group 0 (producer + converters) 152, consumers 176:
        # 128 x 152 + 256 x 176 = 64512 = 384 x 168, the pool (an increase beyond the
        # pool would block forever). The converters get the room for 11 vectors in
        # flight per batch.
        # ``_c7`` (converter_warps=7): a fourth warp group of 4 converter warps, 512
        # threads, cap 128 per thread (512 x 128 = 65536): warp groups 0 and 3 at 120,
        # consumers 136 (>= 128): 256 x 120 + 256 x 136 = 65536.
        if config.converter_warps not in CONVERTER_WARPS:
            raise ValueError(f"converter_warps must be one of {CONVERTER_WARPS}, got {config}")
        self.conv_threads = 32 * config.converter_warps
        if config.converter_warps == 3:
            self.load_regs = 152
            self.mma_regs = 176
        else:
            self.threads = 128 * (2 + self.num_mma_warp_groups)
            self.load_regs = 120
            self.mma_regs = 136

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (M, K) bf16, K contiguous
        b: cute.Tensor,  # (N, K, G) uint8 (E4M3): N contiguous ([G, K, N]) or K contiguous ([G, N, K])
        b_scale: cute.Tensor,  # (N, KB, G) uint8 (E8M0), N contiguous ([G, KB, N])
        out: cute.Tensor,  # (M, N) bf16, N contiguous
        group_sizes: cute.Tensor,  # (G,) int32
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        tma, layouts = self._prepare_w8(a, b, b_scale, out)
        self.kernel_w8(*tma, out, group_sizes, self.tiled_mma, *layouts).launch(
            grid=(num_ctas, 1, 1),
            block=(self.threads, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    @cute.jit
    def _prepare_w8(self, a: cute.Tensor, b: cute.Tensor, b_scale: cute.Tensor, out: cute.Tensor):
        a_smem, b_smem = self._mma_and_operand_layouts(a, b, out)  # bf16: A and converted B
        # Raw FP8 B and its scales: plain (unswizzled) row-major boxes, as TMA writes them.
        tn, tk = self.tile_n, self.tile_k
        if cutlass.const_expr(self.b_k_major):
            braw_smem = cute.make_layout((tn, tk, self.stages), stride=(tk, 1, tn * tk))
        else:
            braw_smem = cute.make_layout((tn, tk, self.stages), stride=(1, tn, tn * tk))
        kbs = self.kb_per_stage
        s_smem = cute.make_layout((tn, kbs, self.stages), stride=(1, tn, tn * kbs))

        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, a, cute.slice_(a_smem, (None, None, 0)), (self.tile_m, tk)
        )
        tma_atom_b, tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, b, cute.slice_(braw_smem, (None, None, 0)), (tn, tk)
        )
        tma_atom_s, tma_s = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, b_scale, cute.slice_(s_smem, (None, None, 0)), (tn, kbs)
        )

        self.out_layout = utils.LayoutEnum.from_tensor(out)
        epi_smem = sm90_utils.make_smem_layout_epi(self.out_dtype, self.out_layout, self.epi_tile, self.epi_stages)
        tma_atom_out, tma_out = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
            out,
            cute.slice_(epi_smem, (None, None, 0)),
            self.epi_tile,
        )

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            conv_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.out_dtype, cute.cosize(epi_smem)], 1024]
            sBraw: cute.struct.Align[cute.struct.MemRange[Uint8, cute.cosize(braw_smem)], 128]
            sS: cute.struct.Align[cute.struct.MemRange[Uint8, cute.cosize(s_smem)], 128]

        self.shared_storage = SharedStorage
        tma = (tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_s, tma_s, tma_atom_out, tma_out)
        return tma, (a_smem, b_smem, braw_smem, s_smem, epi_smem)

    # ---- the converters ----

    @cute.jit
    def _store_vec(self, dst_vec: cute.Tensor, owords: cute.Tensor, obf16: cute.Tensor, lo0, hi0, lo1, hi1):
        owords[0] = lo0
        owords[1] = hi0
        owords[2] = lo1
        owords[3] = hi1
        cute.autovec_copy(obf16, dst_vec)

    @cute.jit
    def _convert_vec_k(self, vdst, owords, obf16, rwords, sreg, j, r, kv, fast: cutlass.Constexpr):
        """K-major: vector ``j`` of the batch (row ``r``, k-vector ``kv``, one scale) -> ``vdst``."""
        if cutlass.const_expr(fast):
            f = ptx.e8m0_bf16x2_factor(sreg[j])
            lo0, hi0 = ptx.dequant_e4m3x4_bf16_fast(rwords[(0, j)], f, f)
            lo1, hi1 = ptx.dequant_e4m3x4_bf16_fast(rwords[(1, j)], f, f)
        else:
            v = ptx.e8m0_value(sreg[j])
            lo0, hi0 = ptx.dequant_e4m3x4_bf16(rwords[(0, j)], v, v, v, v)
            lo1, hi1 = ptx.dequant_e4m3x4_bf16(rwords[(1, j)], v, v, v, v)
        self._store_vec(vdst[((0, None), (r, kv))], owords, obf16, lo0, hi0, lo1, hi1)

    @cute.jit
    def _convert_batch_k(
        self, vdst, owords, obf16, rwords, sreg, b: cutlass.Constexpr, unroll: cutlass.Constexpr,
        passes: cutlass.Constexpr, rows: cutlass.Constexpr, row0, kv, fast: cutlass.Constexpr,
    ):
        """K-major: the loaded batch ``b`` (passes ``b * unroll ..``) -> ``vdst``; only the
        last pass can run past the tile's rows."""
        for j in cutlass.range_constexpr(unroll):
            p = b * unroll + j
            if cutlass.const_expr(p < passes - 1):
                self._convert_vec_k(vdst, owords, obf16, rwords, sreg, j, row0 + p * rows, kv, fast)
            elif cutlass.const_expr(p == passes - 1):
                if row0 + p * rows < self.tile_n:
                    self._convert_vec_k(vdst, owords, obf16, rwords, sreg, j, row0 + p * rows, kv, fast)

    @cute.jit
    def _fast_vec_n(self, vdst, owords, obf16, rwords, f, j, nv, kj):
        """N-major fast path: vector ``j`` of the batch (n-vector ``nv``, row ``kj``) -> ``vdst``."""
        lo0, hi0 = ptx.dequant_e4m3x4_bf16_fast(rwords[(0, j)], f[0], f[1])
        lo1, hi1 = ptx.dequant_e4m3x4_bf16_fast(rwords[(1, j)], f[2], f[3])
        self._store_vec(vdst[((None, 0), (nv, kj))], owords, obf16, lo0, hi0, lo1, hi1)

    @cute.jit
    def _convert_stage(self, sBraw: cute.Tensor, sS: cute.Tensor, sB: cute.Tensor, stage, ct):
        """Converter thread ``ct`` (0..conv_threads-1): its share of the stage's raw B tile -> bf16 ``sB``.

        Work unit: 8 consecutive elements along B's contiguous dimension (one 8-byte
        load, one 16-byte store). A batch loads all its vectors (and their scales) first,
        probes them for E4M3 NaN bytes and E8M0 bytes > 134, then converts with the fast
        integer decode (:func:`ptx.dequant_e4m3x4_bf16_fast`: prmt/shift/mask + one bf16x2
        multiply per pair) or, if the probe fired, with the exact float32 decode of the
        first version (:func:`ptx.dequant_e4m3x4_bf16`). Both give
        ``bf16(f32(e4m3) * 2**(e - 127))``. Out-of-bounds parts of the tile (past N or K)
        hold TMA's zero fill, data and scales, and convert to zeros.
        """
        raw = sBraw[(None, None, stage)]
        dst = sB[(None, None, stage)]
        scl = sS[(None, None, stage)]
        owords = cute.make_rmem_tensor((4,), Uint32)
        obf16 = cute.recast_tensor(owords, BFloat16)
        ct_n = self.conv_threads
        if cutlass.const_expr(self.b_k_major):
            # (n, 8 consecutive k): one scale per vector. 8 vectors per 64-byte row,
            # 12 rows per pass of 96 threads (22 passes at n256, 16 at n192, in two
            # batches); a warp covers 4 whole rows.
            vpr = self.tile_k // 8
            rows = ct_n // vpr
            passes = (self.tile_n + rows - 1) // rows
            nbat = (passes + UNROLL - 1) // UNROLL
            unroll = (passes + nbat - 1) // nbat
            vraw = cute.zipped_divide(raw, (1, 8))  # ((1, 8), (tile_n, vpr))
            vdst = cute.zipped_divide(dst, (1, 8))
            kv = ct % vpr
            row0 = ct // vpr
            sb = kv * 8 // SCALE_BLOCK
            rbytes = cute.make_rmem_tensor((8, unroll), Uint8)
            rwords = cute.recast_tensor(rbytes, Uint32)  # (2, unroll)
            sreg = cute.make_rmem_tensor((unroll,), Uint32)
            for b in cutlass.range_constexpr(nbat):
                bad = Uint32(0)  # E4M3 NaN probe (bits 0x80808080)
                smax = Uint32(0)  # the batch's largest scale byte
                for j in cutlass.range_constexpr(unroll):
                    p = b * unroll + j
                    if cutlass.const_expr(p < passes):
                        r = row0 + p * rows
                        if cutlass.const_expr(p < passes - 1):
                            cute.autovec_copy(vraw[((0, None), (r, kv))], rbytes[(None, j)])
                            sreg[j] = Uint32(scl[(r, sb)])
                            bad = ptx.e4m3_nan_probe(bad, rwords[(0, j)], rwords[(1, j)])
                            smax = cutlass.max(smax, sreg[j])
                        else:
                            if r < self.tile_n:
                                cute.autovec_copy(vraw[((0, None), (r, kv))], rbytes[(None, j)])
                                sreg[j] = Uint32(scl[(r, sb)])
                                bad = ptx.e4m3_nan_probe(bad, rwords[(0, j)], rwords[(1, j)])
                                smax = cutlass.max(smax, sreg[j])
                # Fast unless a NaN byte or a scale byte > 134 (then (smax + 121) >> 8 == 1).
                if ((bad & Uint32(0x80808080)) | ((smax + Uint32(121)) >> Uint32(8))) == Uint32(0):
                    self._convert_batch_k(vdst, owords, obf16, rwords, sreg, b, unroll, passes, rows, row0, kv, True)
                else:
                    self._convert_batch_k(vdst, owords, obf16, rwords, sreg, b, unroll, passes, rows, row0, kv, False)
        else:
            # (8 consecutive n, k): eight scales per vector, one set per 32-K block.
            # Thread: a fixed n-vector, k rows kq, kq + KQ, ... (KQ = threads / vectors
            # per row: 3 at n256, 4 at n192); one batch per 32-K block (11 or 8 rows).
            nvec = self.tile_n // 8
            kq_n = ct_n // nvec
            unroll = (SCALE_BLOCK + kq_n - 1) // kq_n
            vraw = cute.zipped_divide(raw, (8, 1))  # ((8, 1), (nvec, tile_k))
            vdst = cute.zipped_divide(dst, (8, 1))
            vscl = cute.zipped_divide(scl, (8, 1))  # ((8, 1), (nvec, 2))
            rbytes = cute.make_rmem_tensor((8, unroll), Uint8)
            rwords = cute.recast_tensor(rbytes, Uint32)  # (2, unroll)
            sbytes = cute.make_rmem_tensor((8,), Uint8)
            swords = cute.recast_tensor(sbytes, Uint32)
            nv = ct % nvec
            kq = ct // nvec
            if kq < kq_n:
                for kb in cutlass.range_constexpr(self.kb_per_stage):
                    # This thread's first row in the block: kq + i * KQ >= kb * 32.
                    k = kq
                    if cutlass.const_expr(kb > 0):
                        k = kq + (kb * SCALE_BLOCK - kq + (kq_n - 1)) // kq_n * kq_n
                    end = (kb + 1) * SCALE_BLOCK
                    cute.autovec_copy(vscl[((None, 0), (nv, kb))], sbytes)
                    s0, s1 = swords[0], swords[1]
                    bad = ptx.e8m0x4_big_probe(ptx.e8m0x4_big_probe(Uint32(0), s0), s1)
                    # Rows j < unroll - 1 always lie in the block ((unroll - 1) * KQ < 32).
                    for j in cutlass.range_constexpr(unroll):
                        kj = k + j * kq_n
                        if cutlass.const_expr(j < unroll - 1):
                            cute.autovec_copy(vraw[((None, 0), (nv, kj))], rbytes[(None, j)])
                            bad = ptx.e4m3_nan_probe(bad, rwords[(0, j)], rwords[(1, j)])
                        else:
                            if kj < end:
                                cute.autovec_copy(vraw[((None, 0), (nv, kj))], rbytes[(None, j)])
                                bad = ptx.e4m3_nan_probe(bad, rwords[(0, j)], rwords[(1, j)])
                    if (bad & Uint32(0x80808080)) == Uint32(0):
                        f = (
                            ptx.e8m0x2_bf16x2_factor(s0, 0),
                            ptx.e8m0x2_bf16x2_factor(s0, 1),
                            ptx.e8m0x2_bf16x2_factor(s1, 0),
                            ptx.e8m0x2_bf16x2_factor(s1, 1),
                        )
                        for j in cutlass.range_constexpr(unroll):
                            kj = k + j * kq_n
                            if cutlass.const_expr(j < unroll - 1):
                                self._fast_vec_n(vdst, owords, obf16, rwords, f, j, nv, kj)
                            else:
                                if kj < end:
                                    self._fast_vec_n(vdst, owords, obf16, rwords, f, j, nv, kj)
                    else:
                        v = (
                            ptx.e8m0_value(s0 & Uint32(0xFF)),
                            ptx.e8m0_value((s0 >> Uint32(8)) & Uint32(0xFF)),
                            ptx.e8m0_value((s0 >> Uint32(16)) & Uint32(0xFF)),
                            ptx.e8m0_value(s0 >> Uint32(24)),
                            ptx.e8m0_value(s1 & Uint32(0xFF)),
                            ptx.e8m0_value((s1 >> Uint32(8)) & Uint32(0xFF)),
                            ptx.e8m0_value((s1 >> Uint32(16)) & Uint32(0xFF)),
                            ptx.e8m0_value(s1 >> Uint32(24)),
                        )
                        for j in cutlass.range_constexpr(unroll):
                            kj = k + j * kq_n
                            if kj < end:
                                lo0, hi0 = ptx.dequant_e4m3x4_bf16(rwords[(0, j)], v[0], v[1], v[2], v[3])
                                lo1, hi1 = ptx.dequant_e4m3x4_bf16(rwords[(1, j)], v[4], v[5], v[6], v[7])
                                self._store_vec(vdst[((None, 0), (nv, kj))], owords, obf16, lo0, hi0, lo1, hi1)

    @cute.kernel
    def kernel_w8(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,  # TMA coordinate tensor (M, K)
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,  # TMA coordinate tensor (N, K, G), uint8
        tma_atom_s: cute.CopyAtom,
        mS: cute.Tensor,  # TMA coordinate tensor (N, KB, G), uint8
        tma_atom_out: cute.CopyAtom,
        mOutTma: cute.Tensor,  # TMA coordinate tensor (M, N)
        mOut: cute.Tensor,  # (M, N)
        group_sizes: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        braw_smem: cute.Layout,
        s_smem: cute.Layout,
        epi_smem: cute.ComposedLayout,
    ):
        tidx, bidx, gdim, warp_idx = self._kernel_start((tma_atom_a, tma_atom_b, tma_atom_s, tma_atom_out))

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        tx_bytes = (
            cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem, (None, None, 0)))
            + cute.size_in_bytes(Uint8, cute.slice_(braw_smem, (None, None, 0)))
            + cute.size_in_bytes(Uint8, cute.slice_(s_smem, (None, None, 0)))
        )
        # Raw stage: filled by TMA; emptied by the 8 consumer warps (A) and the 3
        # converter warps (raw B, scales), one arrival per warp.
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.num_mma_warp_groups * 4 + self.conv_threads // 32
            ),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        # Converted B: every converter thread arrives (after its proxy fence); only the
        # full barriers are used (see the module docstring for why no empty side).
        converted = pipeline.PipelineAsync.create(
            barrier_storage=storage.conv_barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.conv_threads),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_warp_groups * 4),
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sC = storage.sC.get_tensor(epi_smem.outer, swizzle=epi_smem.inner)
        sBraw = storage.sBraw.get_tensor(braw_smem)
        sS = storage.sS.get_tensor(s_smem)

        m = mOut.shape[0]
        n = mOut.shape[1]
        n_tiles = (n + (self.tile_n - 1)) // self.tile_n
        num_groups = group_sizes.shape[0]

        # (tile_n, tile_k, n_tiles, k_tiles, G) and (tile_n, 2, n_tiles, k_tiles, G)
        gB = cute.local_tile(mB, (self.tile_n, self.tile_k), (None, None, None))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sBraw, 0, 2), cute.group_modes(gB, 0, 2)
        )
        gS = cute.local_tile(mS, (self.tile_n, self.kb_per_stage), (None, None, None))
        tSsS, tSgS = cute.nvgpu.cpasync.tma_partition(
            tma_atom_s, 0, cute.make_layout(1), cute.group_modes(sS, 0, 2), cute.group_modes(gS, 0, 2)
        )
        k_tiles = cute.size(gB, mode=[3])

        warp_group = cute.arch.make_warp_uniform(tidx // 128)
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        seg0_rows = self._segment_rows(group_sizes, Int32(0), Int32(0), m)
        seg0_tiles = (seg0_rows + (self.tile_m - 1)) // self.tile_m * n_tiles

        if warp_group == 0 or warp_group == 3:  # (no warp group 3 with 3 converter warps)
            cute.arch.setmaxregister_decrease(self.load_regs)
            t = Int32(bidx)
            seg, seg_tile0, seg_row0, seg_rows, seg_tiles = self._seek(
                group_sizes, t, Int32(0), Int32(0), Int32(0), seg0_rows, seg0_tiles, m, n_tiles
            )
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                self._produce_tiles(
                    mainloop, state, t, (seg, seg_tile0, seg_row0, seg_rows, seg_tiles), tma_atom_a, mA, sA,
                    tma_atom_b, tBgB, tBsB, group_sizes, gdim, m, n_tiles, k_tiles, extra=(tma_atom_s, tSgS, tSsS),
                )
            else:
                # Converters (warps 1-3: ct 0..95; ``_c7``: warps 12-15, ct 96..223): the
                # same stage sequence as the consumers (every stage of every non-tail
                # tile), in order.
                ct = tidx - 32
                if warp_group == 3:
                    ct = tidx - (384 - 96)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                while seg <= num_groups:
                    if seg < num_groups:
                        for k in range(k_tiles):
                            mainloop.consumer_wait(state)
                            self._convert_stage(sBraw, sS, sB, state.index, ct)
                            # Generic-proxy stores -> visible to the consumers' wgmma (async proxy).
                            cute.arch.fence_proxy("async.shared", space="cta")
                            converted.producer_commit(state)
                            # Every lane is done reading the raw stage before lane 0 frees it.
                            cute.arch.sync_warp()
                            mainloop.consumer_release(state)
                            state.advance()
                    t = t + gdim
                    seg, seg_tile0, seg_row0, seg_rows, seg_tiles = self._seek(
                        group_sizes, t, seg, seg_tile0, seg_row0, seg_rows, seg_tiles, m, n_tiles
                    )
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self._mma_consumer(
                tiled_mma, mainloop, converted, sA, sB, sC, tma_atom_out, mOutTma, mOut, group_sizes,
                tidx - 128, bidx, gdim, warp_idx, k_tiles, seg0_rows, seg0_tiles,
            )
