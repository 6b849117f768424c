"""Hopper (sm_90a) grouped GEMM over ragged M: ``out[m] = A[m] @ B[group(m)]``.

Operands (row-major as JAX stores them; no transposes on the JAX side):
  A            [M, K]      bf16, K contiguous      (TMA, K-major wgmma operand)
  B            [G, K, N]   bf16, N contiguous      (TMA, MN-major wgmma operand;
                                                     seen by the kernel as (N, K, G))
               or [G, N, K], K contiguous (``b_k_major`` variants: a transposed weight
                                           as stored, K-major operand, same (N, K, G) view)
  group_sizes  [G]         int32, read on the device only
  out          [M, N]      bf16

MXFP8 operands enter as bf16 (the JAX side dequantizes; e4m3 * 2^k is exact in bf16),
so this is DESIGN.md's strategy 2 with the conversion outside the kernel.

Work decomposition ("segments"): segment ``g < G`` is group ``g``'s rows
``[start_g, start_g + size_g)`` with sizes clamped so that every segment lies inside
``[0, M)``; segment ``G`` (the tail) is the rows past ``sum(group_sizes)``. Each segment
is cut into row tiles of ``tile_m`` that never cross its end, times ``cdiv(N, tile_n)``
column tiles. Tiles are numbered segment by segment; within a segment they go in panels
of ``panel_m`` row tiles, column tile outer and row tile inner (neighbouring CTAs share
B tiles and a few A tiles in L2).

Persistent grid (one CTA per SM): CTA ``b`` takes tiles ``b, b + grid, ...``. Every warp
role walks the segments with a forward-only cursor (group sizes read from global, one
load per group boundary passed), so no host sync, no prefix-sum workspace and no
communication between roles is needed.

Warp roles (384 threads, 1 CTA per SM):
  * warp group 0, warp 0 -- TMA producer. For each tile and each ``tile_k`` slice it
    waits for a free stage, then loads the A tile (rows from the tile's start; rows past
    the group end are harmless extra rows, rows past M are zero-filled by TMA) and the
    B tile of the tile's group. Registers dropped to 40 (setmaxnreg).
  * warp groups 1 and 2 -- consumers. Each owns 64 of the tile's 128 rows: bf16
    wgmma (64 x tile_n x 16) from shared memory into fp32 registers, one wgmma batch in
    flight while the next stage is awaited. Registers raised to 232. Then the epilogue,
    in 128 x 32 subtiles through ``epi_stages`` shared-memory buffers (stmatrix):
      - full tiles (all 128 rows in the group, the common case): TMA store of each
        subtile, so the store overlaps the next subtile and the next tile's mainloop;
      - partial tiles (a group's last rows, or rows past the groups): 16-byte stores
        from shared memory with a row predicate (``row < end of the tile's group``),
        so a tile never writes rows of the next group.
    Tail tiles (rows past ``sum(group_sizes)``) skip the mainloop and store zeros.
    Storing bf16 straight from the wgmma registers (2-byte scattered stores) cost
    15-25% of the run time on the H200; see docs/notes/2026-11-30-grouped-gemm-kernels.md.

Pipeline: ``stages`` shared-memory slots of (A tile, B tile), ``PipelineTmaAsync``
(full barrier with TMA transaction bytes, empty barrier arrived by each consumer warp).
The producer runs ahead across tile boundaries, so the next tile's loads overlap this
tile's epilogue.

This module is also the skeleton every grouped GEMM kernel of the package is built on
(docs/notes/2026-12-01-architecture.md, "The GEMM skeleton"): the scheduler
(:mod:`tile_scheduler`), the producer (:meth:`GroupedGemmSm90._produce_tiles`), the one
consumer loop (:meth:`GroupedGemmSm90._consumer`) and its pluggable parts, a mainloop
(:class:`Bf16Mainloop` here) and an epilogue (:class:`StoreEpilogue` here) built on the
shared store tail (``_stage_subtile``, ``_tma_store_subtile``, ``_store_subtile_rows``).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from jax_grouped_mlp.kernels.tile_scheduler import (
    HANDOFF_SLOTS, RowBand, SegmentTileScheduler, TileHandoff, TileWork, TraceTimeObject,
)

SMEM_CAPACITY = 227 * 1024  # sm_90 opt-in maximum per block
EPI_N = 32  # columns per epilogue subtile (128 x 32 bf16 = 8 KB of shared memory)
# Experimental, off (issue 20; docs/notes/2026-12-02-skew.md, "Session 35"): on a tile
# with at most 64 valid rows the second consumer warp group skips its wgmmas and passes
# the stages untouched (:func:`skip_stages`), in the bf16 mainloop and the fp8_block one.
# Off, the kernels are byte for byte those without it. Correct, but measured slower under
# skewed sizes (with the static persistent schedule, cheaper tiles cost the L2 sharing of
# weight tiles). JGM_SKIP_EMPTY_WARP_GROUP=1 in the build's environment turns it on.
SKIP_EMPTY_WARP_GROUP = os.environ.get("JGM_SKIP_EMPTY_WARP_GROUP") == "1"
# Experimental, off (issue 20; the skew notes, "Sessions 36-39"): the plain grouped GEMM
# (JGM_DYNAMIC_TILES=1 in the build's environment) can take its tiles in a dynamic order
# (:class:`TileHandoff`: a global atomic counter, zeroed by the handler before each
# launch) instead of CTA b taking b, b + grid, ... Off, the kernels ignore the counter.
# (The bf16 weight gradient, grouped_wgrad_sm90, always can: XLA chooses its order per
# call from the group sizes.)
DYNAMIC_TILES = os.environ.get("JGM_DYNAMIC_TILES") == "1"



def gemm_shared_storage(kernel, a_smem, b_smem, epi_smem, **extra):
    """The shared-storage struct of a grouped GEMM kernel: the pipeline's full and empty
    barriers (``kernel.stages`` each), the A and B stages (``kernel.ab_dtype``) and the
    epilogue's staging buffers (``kernel.out_dtype``), each 1024-byte aligned as their
    swizzled layouts need; then ``extra`` fields in order (name -> ``cute.struct``
    annotation). Every kernel of the package lays out shared memory this way."""
    fields = {
        "barriers": cute.struct.MemRange[cutlass.Int64, kernel.stages * 2],
        "sA": cute.struct.Align[cute.struct.MemRange[kernel.ab_dtype, cute.cosize(a_smem)], 1024],
        "sB": cute.struct.Align[cute.struct.MemRange[kernel.ab_dtype, cute.cosize(b_smem)], 1024],
        "sC": cute.struct.Align[cute.struct.MemRange[kernel.out_dtype, cute.cosize(epi_smem)], 1024],
        **extra,
    }
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig:
    """Compile-time knobs of :class:`GroupedGemmSm90`.

    tile_n: output columns per CTA tile (the wgmma N; 64..256, multiple of 64).
    tile_k: K per pipeline stage (64 bf16 = one 128-byte swizzle atom).
    stages: shared-memory pipeline depth (0: as many as fit).
    panel_m: row tiles per rasterization panel (L2 locality).
    epi_stages: shared-memory buffers of the TMA-store epilogue (128 x 32 bf16 each).
    b_k_major: B arrives as ``[G, N, K]`` (K contiguous: a transposed weight, the
      dgrad use) instead of ``[G, K, N]``; only the TMA/shared-memory layout differs.
    fc1_epilogue: the FC1 epilogue (:mod:`grouped_gemm_fc1_sm90`): besides ``h`` the
      kernel writes ``a = bf16(probs * relu(h)**2)`` as MXFP8, rowwise values in bf16
      and the group-aware columnwise FP8 copy (bf16 ``[G, K, N]`` weights only).
    dgrad_epilogue: the FC2-dgrad epilogue (:mod:`grouped_gemm_dgrad_sm90`): the
      kernel never writes its bf16 output ``da``; it writes ``dh = bf16(da * 2 probs *
      relu(h))`` as MXFP8 values in bf16 (rowwise and group-aware columnwise) and the
      per-tile partial sums of ``dprobs`` (bf16 K-major ``[G, N, K]`` weights only; name
      ``_bk_dsrelu``).
    The CTA tile has 128 rows: two consumer warp groups of 64.
    """

    tile_n: int = 256
    tile_k: int = 64
    stages: int = 0
    panel_m: int = 8
    epi_stages: int = 2
    b_k_major: bool = False
    fc1_epilogue: bool = False
    dgrad_epilogue: bool = False

    tile_m = 128

    def __post_init__(self):
        if self.tile_n % 64 or not 64 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 64 in [64, 256], got {self.tile_n=}")
        if self.tile_k != 64:
            raise ValueError(f"tile_k must be 64, got {self.tile_k=}")
        if self.epi_stages < 2:  # the partial-tile epilogue relies on double buffering
            raise ValueError(f"epi_stages must be >= 2, got {self.epi_stages=}")
        if self.panel_m < 1:
            raise ValueError(f"panel_m must be >= 1, got {self.panel_m=}")
        if self.fc1_epilogue and self.b_k_major:
            raise ValueError(f"fc1_epilogue is fprop with bf16 [G, K, N] weights only, got {self}")
        if self.dgrad_epilogue and (not self.b_k_major or self.fc1_epilogue):
            raise ValueError(f"dgrad_epilogue needs bf16 K-major [G, N, K] weights (b_k_major=True), got {self}")
        if self.num_stages < 2:
            raise ValueError(f"{self} leaves room for {self.num_stages} stages; need >= 2")

    @property
    def stage_bytes(self) -> int:
        return (self.tile_m + self.tile_n) * self.tile_k * 2

    @property
    def epi_bytes(self) -> int:
        return self.tile_m * EPI_N * 2 * self.epi_stages

    @property
    def num_stages(self) -> int:
        fit = (SMEM_CAPACITY - 1024 - self.epi_bytes) // self.stage_bytes
        return min(fit, self.stages) if self.stages else fit

    @property
    def name(self) -> str:
        s = f"grouped_gemm_sm90_bf16_m{self.tile_m}n{self.tile_n}k{self.tile_k}_s{self.num_stages}"
        s += f"_p{self.panel_m}" if self.panel_m != 8 else ""
        s += f"_e{self.epi_stages}" if self.epi_stages != 2 else ""
        s += "_bk" if self.b_k_major else ""
        s += "_dsrelu" if self.dgrad_epilogue else ""
        return s + ("_fc1" if self.fc1_epilogue else "")


class GroupedGemmSm90:
    """Persistent warp-specialized TMA + wgmma grouped GEMM; see the module docstring."""

    dynamic_tiles = False  # a kernel whose tiles come from a TileHandoff sets it (trace time)

    def __init__(self, config: GroupedGemmConfig):
        self.config = config
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.tile_k = config.tile_k
        self.stages = config.num_stages
        self.panel_m = config.panel_m
        self.tile_mnk = (self.tile_m, self.tile_n, self.tile_k)
        self.seg_tile = self.tile_m  # ragged-axis rows per tile (the scheduler's unit)
        self.b_tile = self.tile_n  # weight rows (B's N) per tile: the scheduler's "column tile"
        self.row_boxes = 1  # TMA boxes per stage for the ragged operand's seg_tile rows
        self.atom_layout_mnk = (2, 1, 1)  # two consumer warp groups stacked along M
        self.num_mma_warp_groups = 2
        self.threads = 128 * (1 + self.num_mma_warp_groups)
        self.acc_dtype = Float32
        self.load_regs = 40
        self.mma_regs = 232
        self.epi_tile = (self.tile_m, EPI_N)
        self.epi_stages = config.epi_stages
        self.epi_store_warp = 4  # first consumer warp issues the epilogue's TMA stores
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=128 * self.num_mma_warp_groups)

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (M, K) bf16, K contiguous
        b: cute.Tensor,  # (N, K, G) bf16: N contiguous (JAX's [G, K, N]) or K contiguous ([G, N, K])
        out: cute.Tensor,  # (M, N) bf16, N contiguous
        group_sizes: cute.Tensor,  # (G,) int32
        tile_counter: cute.Tensor,  # (1,) int32, zeroed before the launch (DYNAMIC_TILES)
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        self.dynamic_tiles = DYNAMIC_TILES
        tma, smem_layouts = self._prepare(a, b, out)
        self.kernel(*tma, out, group_sizes, tile_counter, self.tiled_mma, *smem_layouts).launch(
            grid=(num_ctas, 1, 1),
            block=(self.threads, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---- pieces shared with the weight-gradient kernel ----

    def _mma_and_operand_layouts(self, a: cute.Tensor, b: cute.Tensor, out: cute.Tensor):
        """Sets ``ab_dtype``/``out_dtype`` (from ``a``, ``out``) and the bf16 wgmma for the
        operands' major modes; returns the staged shared-memory layouts ``(a_smem, b_smem)``
        (``b``'s layout decides B's major mode; its dtype is ``a``'s, the MMA's)."""
        self.ab_dtype = a.element_type
        self.out_dtype = out.element_type
        a_layout = utils.LayoutEnum.from_tensor(a)
        b_layout = utils.LayoutEnum.from_tensor(b)
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            a_layout.sm90_mma_major_mode(),
            b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            self.atom_layout_mnk,
            tiler_mn=(64, self.tile_n),
        )
        a_smem = sm90_utils.make_smem_layout_a(a_layout, self.tile_mnk, self.ab_dtype, self.stages)
        b_smem = sm90_utils.make_smem_layout_b(b_layout, self.tile_mnk, self.ab_dtype, self.stages)
        return a_smem, b_smem

    @cute.jit
    def _prepare(self, a: cute.Tensor, b: cute.Tensor, out: cute.Tensor, store_out: cutlass.Constexpr = True):
        """Trace-time setup for operands ``a`` (rows x K), ``b`` (N x K) and ``out``.

        Sets the MMA, the output layout and the shared-storage struct; returns the six
        TMA atoms/coordinate tensors (a, b, out) and the three shared-memory layouts.
        ``store_out=False`` (an epilogue that never writes ``out`` with TMA; ``out`` only
        gives the staging dtype and layout): no TMA atom for ``out``, four returned.
        """
        a_smem, b_smem = self._mma_and_operand_layouts(a, b, out)
        tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            a,
            cute.slice_(a_smem, (None, None, 0)),
            (self.tile_m, self.tile_k),
        )
        tma_atom_b, tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            b,
            cute.slice_(b_smem, (None, None, 0)),
            (self.tile_n, self.tile_k),
        )

        self.out_layout = utils.LayoutEnum.from_tensor(out)
        epi_smem = sm90_utils.make_smem_layout_epi(self.out_dtype, self.out_layout, self.epi_tile, self.epi_stages)
        tma_out_pair = ()
        if cutlass.const_expr(store_out):
            tma_atom_out, tma_out = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
                out,
                cute.slice_(epi_smem, (None, None, 0)),
                self.epi_tile,
            )
            tma_out_pair = (tma_atom_out, tma_out)

        handoff = {}
        if cutlass.const_expr(self.dynamic_tiles):
            handoff = {
                "tile_bars": cute.struct.MemRange[cutlass.Int64, HANDOFF_SLOTS * 2],
                "tile_ring": cute.struct.MemRange[Int32, HANDOFF_SLOTS],
            }
        self.shared_storage = gemm_shared_storage(self, a_smem, b_smem, epi_smem, **handoff)
        return (tma_atom_a, tma_a, tma_atom_b, tma_b) + tma_out_pair, (a_smem, b_smem, epi_smem)

    @cute.jit
    def _kernel_start(self, tma_atoms) -> "CtaIds":
        """This thread's :class:`CtaIds`; warp 0 prefetches ``tma_atoms``' descriptors."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in tma_atoms:
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
        return CtaIds(tidx, bidx, gdim, warp_idx)

    def _shared_and_pipeline(self, a_smem, b_smem, epi_smem, b_slices: int = 1, extra_tx_bytes: int = 0):
        """Allocates shared memory and creates the TMA -> wgmma pipeline (inside the kernel).

        ``b_slices``: slices of ``b_smem`` filled per stage (its last mode then counts
        ``stages * b_slices`` of them). ``extra_tx_bytes``: more TMA bytes per stage (a
        kernel that also stages other data with the stage). Returns ``(mainloop, sA, sB,
        sC)``; the allocated struct stays in ``self.smem_storage`` (trace time) for the
        fields a subclass's ``shared_storage`` adds.
        """
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        self.smem_storage = storage
        tx_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem, (None, None, 0))) + b_slices * cute.size_in_bytes(
            self.ab_dtype, cute.slice_(b_smem, (None, None, 0))
        ) + extra_tx_bytes
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_warp_groups * 4),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        if cutlass.const_expr(self.dynamic_tiles):  # the TileHandoff's barriers
            self.handoff_pipe = pipeline.PipelineAsync.create(
                barrier_storage=storage.tile_bars.data_ptr(),
                num_stages=HANDOFF_SLOTS,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * self.num_mma_warp_groups),
                defer_sync=True,
            )
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sC = storage.sC.get_tensor(epi_smem.outer, swizzle=epi_smem.inner)
        return mainloop, sA, sB, sC

    def _tile_handoffs(self, tile_counter: cute.Tensor | None, gdim):
        """``(producer's, consumers')`` :class:`TileHandoff` of the dynamic tile order over
        ``tile_counter`` (inside the kernel, after :meth:`_shared_and_pipeline`), or
        ``(None, None)`` for the static order (``dynamic_tiles`` unset)."""
        if cutlass.const_expr(not self.dynamic_tiles):
            return None, None
        ring = self.smem_storage.tile_ring.get_tensor(cute.make_layout(HANDOFF_SLOTS))
        return (TileHandoff(tile_counter, ring, self.handoff_pipe, gdim, producer=True),
                TileHandoff(tile_counter, ring, self.handoff_pipe, gdim, producer=False))

    def _mma_fragments(self, tiled_mma: cute.TiledMma, sA: cute.Tensor, sB: cute.Tensor, ctid):
        """Consumer thread ``ctid``'s wgmma operand fragments and fp32 accumulator."""
        thr_mma = tiled_mma.get_slice(ctid)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        return tCrA, tCrB, cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)

    @cute.jit
    def _mma_stage(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA, tCrB, stage) -> None:
        """Issues the wgmmas of one pipeline stage (tile_k) into ``acc`` and commits them."""
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            c = (None, None, kb, stage)
            cute.gemm(tiled_mma, acc, tCrA[c], tCrB[c], acc)
        cute.nvgpu.warpgroup.commit_group()

    # ---- epilogue helpers (shared with the weight-gradient kernel) ----

    def _epilogue_copies(self, tiled_mma: cute.TiledMma, sC: cute.Tensor, acc: cute.Tensor, ctid):
        """Register -> shared-memory staging of the accumulator in ``epi_tile`` subtiles
        (128 x 32, or 128 x 64 for the wgrad ``_en64`` variants; stmatrix).

        Returns ``(tiled_copy_r2s, tRS_sD, tRS_rAcc, tRS_rD, tRS_rD_out, store_pipeline)``
        for consumer thread ``ctid`` (0..255); ``store_pipeline`` tracks the TMA stores.
        """
        copy_atom_r2s = sm90_utils.get_smem_store_op(self.out_layout, self.out_dtype, self.acc_dtype)
        copy_atom_c = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(self.out_layout.is_m_major_c(), 4), self.out_dtype
        )
        tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma))
        thr_copy_r2s = tiled_copy_r2s.get_slice(ctid)
        tRS_sD = thr_copy_r2s.partition_D(sC)
        tRS_rAcc = tiled_copy_r2s.retile(acc)
        rD_shape = cute.shape(thr_copy_r2s.partition_S(sC))
        tRS_rD = cute.make_rmem_tensor(rD_shape[:3], self.acc_dtype)
        tRS_rD_out = cute.make_rmem_tensor(rD_shape[:3], self.out_dtype)
        store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * self.num_mma_warp_groups),
        )
        return tiled_copy_r2s, tRS_sD, tRS_rAcc, tRS_rD, tRS_rD_out, store_pipeline

    # ---- the store tail: the steps every epilogue's subtile loop is made of ----

    @cute.jit
    def _stage_subtile(self, epi, e: int, epi_count: Int32):
        """Subtile ``e`` of the accumulator, rounded to ``out_dtype``, into its staging
        buffer (stmatrix; buffers rotate with the running subtile count). Returns the buffer."""
        tiled_copy_r2s, tRS_sD, tRS_rAcc, tRS_rD, tRS_rD_out, _ = epi
        size_tRS_rD = cute.size(tRS_rD)
        for v in cutlass.range_constexpr(size_tRS_rD):
            tRS_rD[v] = tRS_rAcc[e * size_tRS_rD + v]
        tRS_rD_out.store(tRS_rD.load().to(self.out_dtype))
        buf = (epi_count + e) % self.epi_stages
        cute.copy(tiled_copy_r2s, tRS_rD_out, tRS_sD[(None, None, None, buf)])
        return buf

    def _tma_store_partition(self, tma_atom_out, sC: cute.Tensor, gTile: cute.Tensor):
        """The TMA store's view of ``gTile`` in ``epi_tile`` subtiles: ``(bSG_sD, bSG_gD,
        epi_num, epi_order)`` (``epi_order`` maps subtile ``e`` to its coordinate)."""
        gEpi = cute.zipped_divide(gTile, self.epi_tile)  # ((128, EPI), (1, tile_n / EPI))
        bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
            tma_atom_out, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gEpi
        )
        epi_num = cute.size(gEpi, mode=[1])
        epi_shape = gEpi.shape[1]
        epi_order = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
        return bSG_sD, bSG_gD, epi_num, epi_order

    @cute.jit
    def _tma_store_subtile(self, epi, tma_atom_out, tma_part, e: int, buf, warp_idx) -> None:
        """The staged subtile ``e`` (buffer ``buf``) to global memory by TMA, issued by the
        store warp, which then waits until the buffer written next is free again."""
        bSG_sD, bSG_gD, _, epi_order = tma_part
        if warp_idx == self.epi_store_warp:
            cute.copy(tma_atom_out, bSG_sD[(None, buf)], bSG_gD[(None, epi_order.get_hier_coord(e))])
            epi[5].producer_commit()
            epi[5].producer_acquire()  # the buffer written next is free again

    @cute.jit
    def _store_subtile_rows(self, s2g, tSG_s: cute.Tensor, mOut: cute.Tensor, row0, col0, rows_valid, cols_valid):
        """The staged subtile ``tSG_s`` (this thread's view) to ``(row0, col0)`` of ``mOut``
        with 16-byte stores, only rows ``< rows_valid`` and columns ``< cols_valid``."""
        s2g_atom, thr_s2g, _, tSG_cC = s2g
        gSub = cute.local_tile(cute.domain_offset((row0, col0), mOut), self.epi_tile, (0, 0))
        tSG_g = thr_s2g.partition_D(gSub)
        for i in cutlass.range_constexpr(cute.size(tSG_g, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(tSG_g, mode=[2])):
                r, c = tSG_cC[(0, i, j)]
                if r < rows_valid:
                    if c < cols_valid:
                        cute.copy(s2g_atom, tSG_s[(None, i, j)], tSG_g[(None, i, j)])

    @cute.jit
    def _store_tile_tma(self, epi, tma_atom_out, sC: cute.Tensor, gTile: cute.Tensor, epi_count: Int32, warp_idx):
        """Stores the accumulator as the tile ``gTile`` (a TMA coordinate tile, tile_m x tile_n).

        ``epi_tile`` subtiles: registers -> shared memory (stmatrix) -> TMA store, with
        ``epi_stages`` buffers so the store of one subtile overlaps the conversion of
        the next. TMA clips whatever lies outside the output tensor. Returns the new
        subtile count (it picks the buffer).
        """
        tma_part = self._tma_store_partition(tma_atom_out, sC, gTile)
        epi_num = tma_part[2]
        for e in cutlass.range_constexpr(epi_num):
            buf = self._stage_subtile(epi, e, epi_count)
            # stmatrix writes go through the generic proxy; TMA reads async.
            cute.arch.fence_proxy("async.shared", space="cta")
            self.epi_barrier.arrive_and_wait()
            self._tma_store_subtile(epi, tma_atom_out, tma_part, e, buf, warp_idx)
            self.epi_barrier.arrive_and_wait()
        return epi_count + epi_num

    def _partial_store_copies(self, sC: cute.Tensor, ctid):
        """Partial tiles: shared memory -> global with 16-byte stores, a row predicate
        per vector (256 threads = 64 rows x 4 vectors of 8 columns per pass).

        Returns ``(s2g_atom, thr_s2g, tSG_sC, tSG_cC)`` for consumer thread ``ctid``.
        """
        s2g_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype, num_bits_per_copy=128)
        tiled_s2g = cute.make_tiled_copy_tv(
            s2g_atom, cute.make_ordered_layout((64, EPI_N // 8), order=(1, 0)), cute.make_layout((1, 8))
        )
        thr_s2g = tiled_s2g.get_slice(ctid)
        tSG_sC = thr_s2g.partition_S(sC)
        tSG_cC = thr_s2g.partition_D(cute.make_identity_tensor(self.epi_tile))
        return s2g_atom, thr_s2g, tSG_sC, tSG_cC

    @cute.jit
    def _store_tile_partial(
        self, epi, s2g, mOut: cute.Tensor, row0: Int32, col0: Int32, rows_valid: Int32, n: Int32,
        epi_count: Int32, warp_idx,
    ):
        """Stores the accumulator's first ``rows_valid`` rows at ``(row0, col0)`` of ``mOut``.

        Partial tile (a group's last rows, or the rows past the groups): the same
        shared-memory staging as :meth:`_store_tile_tma`, then 16-byte stores of the
        valid rows only, so the tile never writes the next group's rows. Columns past
        N are whole vectors (N % 8 == 0) and are skipped too. Returns the new subtile count.
        """
        if warp_idx == self.epi_store_warp:
            # Earlier TMA stores may still read the buffers we are about to
            # overwrite (the barrier of the first subtile publishes this wait).
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        for e in cutlass.range_constexpr(self.tile_n // EPI_N):
            buf = self._stage_subtile(epi, e, epi_count)
            self.epi_barrier.arrive_and_wait()
            self._store_subtile_rows(
                s2g, s2g[2][(None, None, None, buf)], mOut, row0, col0 + e * EPI_N, rows_valid, n - (col0 + e * EPI_N)
            )
        return epi_count + self.tile_n // EPI_N

    @cute.jit
    def _produce_tiles(self, mainloop, state, sched, loads) -> None:
        """The TMA producer (one thread's worth of warp 0): every stage of this CTA's tiles,
        from the scheduler's tile ``sched`` on, with the pipeline ``state``; ``loads``
        (:class:`SegmentLoads`, or the weight gradient's) issues a tile's stages."""
        while sched.valid():
            # (One assignment, scheduler first: the order in which the loop carries its
            # values, as the kernels' former producer loops did; see ConsumerCarry.)
            sched, state = self._produce_tile(mainloop, state, sched, loads)
        mainloop.producer_tail(state)

    @cute.jit
    def _produce_tile(self, mainloop, state, sched, loads):
        """One tile of :meth:`_produce_tiles`; returns the next ``(sched, state)``. With
        the dynamic order the successor is claimed before the loads, read after them."""
        tile = sched.tile_coords()
        claimed = sched.claim()
        state = loads.load_tile(mainloop, state, sched, tile)
        return sched.advance(tile, claimed), state

    @cute.jit
    def _consumer(
        self, mainloop, epilogue, work: TileWork, ctid,
        carry_order: tuple = ("epi_count", "sched", "read", "release"),
    ):
        """The consumer warp groups (thread ``ctid`` of 256), one loop for every kernel:
        for each tile of the scheduler (``work.scheduler()``: :class:`SegmentTileScheduler`,
        or :class:`GroupTileScheduler` for the weight gradient), ``mainloop`` fills the
        accumulator (or zeroes it for tiles without rows), then ``epilogue`` writes it.

        ``mainloop``: :class:`Bf16Mainloop`, the weight-quantizing ``QwMainloop`` or
        ``WgradMainloop``; ``epilogue``: :class:`StoreEpilogue` or the FC1, dgrad,
        transposed-store and weight-gradient ones. Both are trace-time objects: ``setup``
        before the loop; per tile (``tile``: the scheduler's ``tile_coords()``)
        ``mainloop.tile`` (returns the advanced pipeline states) and
        ``epilogue.store_tile`` (returns the epilogue subtile count, which rotates the
        staging buffers); ``epilogue.finish`` after the last tile.

        ``carry_order``: the order in which the loop carries its run-time state
        (:class:`ConsumerCarry`); each kernel passes the order its former loop had, which
        keeps its machine code byte for byte.
        """
        accs = mainloop.setup(ctid)
        epilogue.setup(mainloop.tiled_mma, accs, ctid)
        epi_count = Int32(0)  # epilogue subtiles stored so far (buffer rotation)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        sched = work.scheduler(blocks=epilogue.blocks)
        carry = ConsumerCarry(carry_order, epi_count, sched, read, release)
        while carry.sched.valid():
            carry = self._consumer_tile(mainloop, epilogue, work, carry)
        epilogue.finish()

    @cute.jit
    def _consumer_tile(self, mainloop, epilogue, work: TileWork, carry: "ConsumerCarry") -> "ConsumerCarry":
        """One tile of :meth:`_consumer`: mainloop, epilogue, the scheduler's next tile."""
        sched, read, release = carry.sched, carry.read, carry.release
        tile = sched.tile_coords()
        read, release = mainloop.tile(sched, tile, read, release, work)
        epi_count = epilogue.store_tile(sched, tile, carry.epi_count)
        return ConsumerCarry(carry.order, epi_count, sched.advance(tile), read, release)

    @cute.jit
    def _setup_and_produce(
        self, rows: "TmaLoad", weight: "TmaLoad", mOut: cute.Tensor, group_sizes: cute.Tensor, smem_layouts,
        cta: "CtaIds", swapped: bool = False, tile_counter: cute.Tensor | None = None,
        band: "RowBand | None" = None,
    ):
        """The kernel body up to the consumers (bf16 B): shared memory and pipeline, the B
        partition, the cursor start, and warp group 0 as the TMA producer (warp 0).

        ``rows`` is the ragged operand's TMA atom and coordinate tensor (rows from a tile's
        start) and ``weight`` the group's weight's (``b_tile`` rows per tile); their
        ``smem`` is unset: allocated here from ``smem_layouts`` ``(a, b, epi)``. ``swapped``
        (the ``_qw`` kernel, whose wgmma takes the weight as A): the weight lives in the
        first shared-memory buffer, the tokens in the second, and ``mOut`` is ``(N, M)``.
        ``tile_counter`` (with ``dynamic_tiles``): the global counter of the dynamic tile
        order (:class:`TileHandoff`); without it CTA ``b`` takes tiles ``b, b + grid, ...``.
        ``band``: the rows of every segment this launch takes (:class:`RowBand`, when several
        launches of one call share the segments; None: all).

        Returns ``(mainloop, sA, sB, sC, warp_group, work)`` for the consumers (warp
        groups 1 and 2): the TMA pipeline, the shared-memory buffers (``sA``/``sB`` in
        buffer order) and the CTA's :class:`TileWork`.
        """
        tidx, bidx, gdim, warp_idx = cta
        mB = weight.gmem
        mainloop, sA, sB, sC = self._shared_and_pipeline(*smem_layouts, b_slices=self.row_boxes if swapped else 1)
        s_rows, s_weight = (sB, sA) if swapped else (sA, sB)

        s0, s1 = mOut.shape[0], mOut.shape[1]
        m, n = (s1, s0) if swapped else (s0, s1)
        n_tiles = (n + (self.b_tile - 1)) // self.b_tile

        # (b_tile, tile_k, n_tiles, k_tiles, G)
        gB = cute.local_tile(mB, (self.b_tile, self.tile_k), (None, None, None))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            weight.atom, 0, cute.make_layout(1), cute.group_modes(s_weight, 0, 2), cute.group_modes(gB, 0, 2)
        )
        k_tiles = cute.size(gB, mode=[3])

        warp_group = cute.arch.make_warp_uniform(tidx // 128)
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        # Cursor start: segment 0 (or the tail directly when G == 0).
        seg0 = SegmentTileScheduler.first_segment(group_sizes, m, n_tiles, self.seg_tile, band)
        producer_source, consumer_source = self._tile_handoffs(tile_counter, gdim)

        if warp_group == 0:
            cute.arch.setmaxregister_decrease(self.load_regs)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                sched = SegmentTileScheduler.create(
                    group_sizes, m, n_tiles, bidx, gdim, self.seg_tile, self.panel_m, seg0, source=producer_source,
                    band=band,
                )
                loads = SegmentLoads(
                    self, TmaLoad(rows.atom, rows.gmem, s_rows), TmaLoad(weight.atom, tBgB, tBsB), k_tiles
                )
                self._produce_tiles(mainloop, state, sched, loads)
        work = TileWork(
            group_sizes, m, n_tiles, k_tiles, bidx, gdim, self.seg_tile, self.panel_m, seg0, source=consumer_source,
            band=band,
        )
        return mainloop, sA, sB, sC, warp_group, work

    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,  # TMA coordinate tensor (M, K)
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,  # TMA coordinate tensor (N, K, G)
        tma_atom_out: cute.CopyAtom,
        mOutTma: cute.Tensor,  # TMA coordinate tensor (M, N)
        mOut: cute.Tensor,  # (M, N)
        group_sizes: cute.Tensor,
        tile_counter: cute.Tensor,  # (1,) int32: the dynamic tile order's counter (DYNAMIC_TILES)
        tiled_mma: cute.TiledMma,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        epi_smem: cute.ComposedLayout,
    ):
        cta = self._kernel_start((tma_atom_a, tma_atom_b, tma_atom_out))
        pipe, sA, sB, sC, warp_group, work = self._setup_and_produce(
            TmaLoad(tma_atom_a, mA), TmaLoad(tma_atom_b, mB), mOut, group_sizes, (a_smem, b_smem, epi_smem), cta,
            tile_counter=tile_counter,
        )
        if warp_group != 0:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self._consumer(
                Bf16Mainloop(self, tiled_mma, pipe, sA, sB),
                StoreEpilogue(self, StoreTarget(sC, tma_atom_out, mOutTma, mOut), cta.warp_idx),
                work, cta.tidx - 128,
            )


# ---- the producer's pluggable part (see GroupedGemmSm90._produce_tiles) ----


class SegmentLoads(TraceTimeObject):
    """A tile's TMA loads for the segment-scheduled kernels: per stage the ragged
    operand's tile (``rows``: rows of the coordinate tensor from the tile's start, into its
    staged buffer, in ``row_boxes`` boxes) and the tile's group's weight tile (``weight``:
    already partitioned ``(.., n_tile, k, group)`` in global and per stage in shared),
    ``k_tiles`` stages. Tail tiles (rows past the groups) load nothing."""

    def __init__(self, kernel: GroupedGemmSm90, rows: "TmaLoad", weight: "TmaLoad", k_tiles):
        self.kernel = kernel
        self.rows = rows
        self.weight = weight
        self.k_tiles = k_tiles

    @cute.jit
    def load_tile(self, mainloop, state, sched: SegmentTileScheduler, tile):
        """Issues the current tile's stages; returns the advanced pipeline ``state``."""
        tma_atom_a, mA, sA = self.rows.atom, self.rows.gmem, self.rows.smem
        tma_atom_b, tBgB, tBsB = self.weight.atom, self.weight.gmem, self.weight.smem
        row_boxes, seg_tile, tile_k = self.kernel.row_boxes, self.kernel.seg_tile, self.kernel.tile_k
        k_tiles = self.k_tiles
        row_off, _, n_tile = tile
        if sched.seg < sched.group_sizes.shape[0]:
            row0 = sched.row0 + row_off
            # ``row_boxes`` TMA boxes of ``box_rows`` rows each (slices
            # ``row_boxes * stage + i`` of ``sA``): a tile taller than one box.
            box_rows = seg_tile // row_boxes
            tAs, tAg = [], []
            for i in cutlass.range_constexpr(row_boxes):
                gA = cute.local_tile(cute.domain_offset((row0 + i * box_rows, 0), mA), (box_rows, tile_k), (0, None))
                tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                    tma_atom_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2),
                )
                tAs.append(tAsA)
                tAg.append(tAgA)
            tBgB_tile = tBgB[(None, n_tile, None, sched.seg)]
            for k in range(k_tiles):
                mainloop.producer_acquire(state)
                bar = mainloop.producer_get_barrier(state)
                if cutlass.const_expr(row_boxes == 1):
                    cute.copy(tma_atom_a, tAg[0][(None, k)], tAs[0][(None, state.index)], tma_bar_ptr=bar)
                else:
                    for i in cutlass.range_constexpr(row_boxes):
                        cute.copy(
                            tma_atom_a, tAg[i][(None, k)], tAs[i][(None, state.index * row_boxes + i)],
                            tma_bar_ptr=bar,
                        )
                cute.copy(tma_atom_b, tBgB_tile[(None, k)], tBsB[(None, state.index)], tma_bar_ptr=bar)
                mainloop.producer_commit(state)
                state.advance()
        return state


# ---- the consumer's loop state and pluggable parts (see GroupedGemmSm90._consumer) ----


class ConsumerCarry:
    """The consumer loop's run-time state: the epilogue subtile count, the scheduler and
    the two consumer pipeline states, carried through the loop as one value.

    ``order`` lists the order of its values in the loop (names of ``epi_count``,
    ``sched``, ``read``, ``release``, or ``sched.<field>`` for a single scheduler field).
    It changes no computation, only which register the allocator picks for what; each
    kernel passes the order of the loop it had before the skeleton, so its machine code
    stayed byte for byte what was tested on the GPU.
    """

    def __init__(self, order: tuple, epi_count, sched, read, release):
        self.order = order
        self.epi_count, self.sched, self.read, self.release = epi_count, sched, read, release

    def _leaf(self, name: str):
        if name.startswith("sched."):
            return getattr(self.sched, name[len("sched."):])
        return getattr(self, name)

    def _leaves(self) -> list:
        names = []
        for name in self.order:
            if name == "sched":
                names += [f"sched.{f}" for f in self.sched._fields()]
            else:
                names.append(name)
        return names

    def __extract_mlir_values__(self):
        values = []
        for name in self._leaves():
            values += extract_mlir_values(self._leaf(name))
        return values

    def __new_from_mlir_values__(self, values):
        new = copy.copy(self)
        new.sched = copy.copy(self.sched)
        i = 0
        for name in self._leaves():
            leaf = self._leaf(name)
            n = len(extract_mlir_values(leaf))
            rebuilt = new_from_mlir_values(leaf, values[i:i + n])
            i += n
            if name.startswith("sched."):
                setattr(new.sched, name[len("sched."):], rebuilt)
            else:
                setattr(new, name, rebuilt)
        assert i == len(values), (i, len(values))
        return new


def warp_group_row0(ctid) -> Int32:
    """The first tile row of consumer thread ``ctid``'s warp group (0 or 64), through
    ``make_warp_uniform``: a branch on a value ptxas cannot prove warp-uniform makes it
    serialize every wgmma of the kernel (C7520; ``make wgmma-check``)."""
    return cute.arch.make_warp_uniform(ctid // 128) * 64


def stage_arrivals(rows_valid) -> Int32:
    """Arrivals per consumer warp with which a computing warp group hands back each stage
    of a tile with ``rows_valid`` rows: 2 when the other warp group (rows 64-127) has no
    valid row and skips the tile (:func:`skip_stages`), else 1."""
    return Int32(1) + Int32(rows_valid <= 64)


@cute.jit
def release_stage(pipe, state, arrivals=None) -> None:
    """``pipe.consumer_release(state)`` (``arrivals`` None), or that with ``arrivals``
    arrivals of this warp's signalling thread on the slot's empty barrier
    (:func:`stage_arrivals`)."""
    if cutlass.const_expr(arrivals is None):
        pipe.consumer_release(state)
    else:
        if pipe.is_signaling_thread:
            cute.arch.mbarrier_arrive(pipe.consumer_get_barrier(state), arrive_count=arrivals)


def skip_stages(read, release, k_tiles):
    """A warp group with no valid row in the tile: its pipeline states pass the tile's
    ``k_tiles`` stages without waiting on them or handing them back (the other warp
    group hands each back for both: :func:`stage_arrivals`). It cannot run ahead into
    a slot's next use: the epilogue's barrier holds it until the other warp group has
    consumed every stage of the tile. Returns the advanced ``(read, release)``."""
    read.advance(k_tiles)
    release.advance(k_tiles)
    return read, release


class Bf16Mainloop(TraceTimeObject):
    """The bf16 mainloop: wgmma with both operands from shared memory, one stage's wgmmas
    in flight while the next stage is awaited, each slot handed back to the producer as
    soon as the wgmmas that read it are done. Tail tiles (rows past the groups) skip it
    and leave a zero accumulator, and so does, with :data:`SKIP_EMPTY_WARP_GROUP`, a
    consumer warp group whose 64 rows all lie past a partial tile's valid rows
    (:func:`skip_stages`)."""

    def __init__(self, kernel: GroupedGemmSm90, tiled_mma: cute.TiledMma, pipe, sA: cute.Tensor, sB: cute.Tensor):
        self.kernel = kernel
        self.tiled_mma = tiled_mma
        self.pipe = pipe
        self.sA = sA
        self.sB = sB

    def setup(self, ctid):
        """Consumer thread ``ctid``'s operand fragments; returns the fp32 accumulator."""
        self.tCrA, self.tCrB, self.acc = self.kernel._mma_fragments(self.tiled_mma, self.sA, self.sB, ctid)
        if cutlass.const_expr(SKIP_EMPTY_WARP_GROUP):
            self.wg_row0 = warp_group_row0(ctid)
        return self.acc

    @cute.jit
    def tile(self, sched: SegmentTileScheduler, tile, read, release, work: TileWork):
        """The current tile's accumulator; returns the advanced ``(read, release)`` states."""
        self.acc.fill(0.0)
        if sched.seg < sched.group_sizes.shape[0]:  # (k_tiles >= 1: the handler never launches K = 0)
            if cutlass.const_expr(SKIP_EMPTY_WARP_GROUP):
                if self.wg_row0 < tile[1]:
                    read, release = self._stages(read, release, work.k_tiles, stage_arrivals(tile[1]))
                else:
                    read, release = skip_stages(read, release, work.k_tiles)
            else:
                read, release = self._stages(read, release, work.k_tiles)
        return read, release

    @cute.jit
    def _stages(self, read, release, k_tiles, arrivals=None):
        """The tile's ``k_tiles`` stages into the accumulator; each slot goes back with
        ``consumer_release`` (``arrivals`` None) or :func:`release_stage`."""
        tiled_mma, mainloop, acc, tCrA, tCrB = self.tiled_mma, self.pipe, self.acc, self.tCrA, self.tCrB
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.fence()
        # First stage: issue and keep in flight.
        mainloop.consumer_wait(read)
        self.kernel._mma_stage(tiled_mma, acc, tCrA, tCrB, read.index)
        read.advance()
        for k in range(1, k_tiles):
            mainloop.consumer_wait(read)
            self.kernel._mma_stage(tiled_mma, acc, tCrA, tCrB, read.index)
            # The previous stage's wgmmas are done: hand its slot back. (Every mainloop
            # spells these lines out: the DSL carries ``read`` / ``release`` through the
            # loop only when their advances are in the loop body; moved into a helper
            # function they fail IR verification, "operand does not dominate this use".)
            cute.nvgpu.warpgroup.wait_group(1)
            release_stage(mainloop, release, arrivals)
            release.advance()
            read.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        release_stage(mainloop, release, arrivals)
        release.advance()
        return read, release


@dataclasses.dataclass(frozen=True)
class StoreTarget:
    """Where an epilogue stages and stores ``out``: the shared-memory staging buffers
    ``sC``, the TMA store atom and coordinate tensor (``tma_atom`` None: no TMA store),
    and ``out`` itself for the predicated stores."""

    sC: cute.Tensor
    tma_atom: cute.CopyAtom | None
    mOutTma: cute.Tensor | None
    mOut: cute.Tensor


class StoreEpilogue(TraceTimeObject):
    """The plain epilogue: the accumulator rounded to ``out``'s dtype, staged in shared
    memory (stmatrix), TMA-stored for full tiles, stored with row-predicated 16-byte
    stores for partial ones (:meth:`GroupedGemmSm90._store_tile_tma`,
    :meth:`GroupedGemmSm90._store_tile_partial`)."""

    blocks = False  # the scheduler need not count MXFP8 blocks

    def __init__(self, kernel: GroupedGemmSm90, out: StoreTarget, warp_idx):
        self.kernel = kernel
        self.out = out
        self.warp_idx = warp_idx

    def setup(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, ctid):
        """The register -> shared -> global copies of consumer thread ``ctid``."""
        self.epi = self.kernel._epilogue_copies(tiled_mma, self.out.sC, acc, ctid)
        self.s2g = self.kernel._partial_store_copies(self.out.sC, ctid)

    @cute.jit
    def store_tile(self, sched: SegmentTileScheduler, tile, epi_count):
        """Writes the current tile; returns the new subtile count."""
        row_off, rows_valid, n_tile = tile
        tile_m, tile_n, out = self.kernel.tile_m, self.kernel.tile_n, self.out
        row0 = sched.row0 + row_off
        col0 = n_tile * tile_n
        if rows_valid == tile_m:
            gTile = cute.local_tile(cute.domain_offset((row0, 0), out.mOutTma), (tile_m, tile_n), (0, n_tile))
            epi_count = self.kernel._store_tile_tma(self.epi, out.tma_atom, out.sC, gTile, epi_count, self.warp_idx)
        else:
            epi_count = self.kernel._store_tile_partial(
                self.epi, self.s2g, out.mOut, row0, col0, rows_valid, out.mOut.shape[1], epi_count, self.warp_idx
            )
        return epi_count

    @cute.jit
    def _store_subtiles(self, row0: Int32, rows_valid: Int32, col0: Int32, n_tile, epi_count, passes):
        """The tile as :meth:`store_tile` writes it, subtile by subtile, with
        ``passes(e, tSG_s, gcol0, cols_valid)`` run on each staged subtile ``e`` after its
        store (the fused epilogues' extra outputs, read from the same staged values), and a
        barrier before the buffer is reused. Returns the new subtile count."""
        out, warp_idx = self.out, self.warp_idx
        tile_m = self.kernel.tile_m
        n = out.mOut.shape[1]
        tSG_sC = self.s2g[2]
        full = rows_valid == tile_m
        gTile = cute.local_tile(cute.domain_offset((row0, 0), out.mOutTma), (tile_m, self.kernel.tile_n), (0, n_tile))
        tma_part = self.kernel._tma_store_partition(out.tma_atom, out.sC, gTile)
        epi_num = tma_part[2]
        if rows_valid < tile_m:  # partial tile
            if warp_idx == self.kernel.epi_store_warp:
                # Earlier TMA stores may still read the buffers about to be overwritten
                # (the first subtile's barrier publishes this wait).
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        for e in cutlass.range_constexpr(epi_num):
            buf = self.kernel._stage_subtile(self.epi, e, epi_count)
            # stmatrix writes go through the generic proxy; TMA reads async.
            cute.arch.fence_proxy("async.shared", space="cta")
            self.kernel.epi_barrier.arrive_and_wait()
            gcol0 = col0 + e * EPI_N
            cols_valid = n - gcol0
            tSG_s = tSG_sC[(None, None, None, buf)]
            if full:
                self.kernel._tma_store_subtile(self.epi, out.tma_atom, tma_part, e, buf, warp_idx)
            else:
                self.kernel._store_subtile_rows(self.s2g, tSG_s, out.mOut, row0, gcol0, rows_valid, cols_valid)
            passes(e, buf, tSG_s, gcol0, cols_valid)
            # Every thread is done reading this buffer before it is written again.
            self.kernel.epi_barrier.arrive_and_wait()
        return epi_count + epi_num

    def finish(self):
        """Waits for the last TMA stores."""
        self.epi[5].producer_tail()


@dataclasses.dataclass(frozen=True)
class TmaLoad:
    """A TMA-loaded operand: the copy atom, its global side (the coordinate tensor, or a
    partition of it) and its shared side (the staged buffer or its partition; None
    before shared memory is allocated)."""

    atom: cute.CopyAtom
    gmem: cute.Tensor
    smem: cute.Tensor | None = None


class CtaIds(NamedTuple):
    """This thread's place: thread index in the CTA, CTA index and count of the persistent
    grid, warp index (warp-uniform)."""

    tidx: Int32
    bidx: Int32
    gdim: Int32
    warp_idx: Int32
