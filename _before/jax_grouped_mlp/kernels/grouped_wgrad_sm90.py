"""Hopper (sm_90a) grouped weight gradient over ragged M: ``out[g] = X_g^T @ dY_g``.

Operands (row-major as JAX stores them; no transposes on the JAX side):
  X            [M, K]      bf16, K contiguous  -> seen as (K, M): MN-major wgmma A
  dY           [M, N]      bf16, N contiguous  -> seen as (N, M): MN-major wgmma B
  group_sizes  [G]         int32, read on the device only
  out          [G, K, N]   bf16 or float32 (a variant per dtype), N contiguous
                                                -> seen as (K, N, G)

``X_g`` / ``dY_g`` are group ``g``'s rows ``[start_g, start_g + size_g)``, sizes clamped
on the device exactly as in the forward kernel (negative -> 0, running sum cut at M),
so no memory outside the operands is touched whatever ``group_sizes`` holds.

Work decomposition: every group has the same ``cdiv(K, 128) * cdiv(N, tile_n)`` output
tiles; tiles are numbered group by group, and the persistent CTAs take tiles
``b, b + grid, ...``. Each tile reduces over its group's rows in ``tile_k`` = 64-row
slices **in order**, in one CTA, in fp32 registers: no atomics, no split-K, so the
result is bitwise reproducible. An empty group's tiles skip the mainloop and store
zeros. The group cursor (start row of the tile's group) moves forward only: one
``group_sizes`` load per group passed (``tile_scheduler.GroupTileScheduler``).

Ragged edges: a slice is loaded by TMA from the group's current row whatever the
group's end (rows past M are zero-filled by TMA). Of a group's last slice only the
16-row wgmma k-blocks that hold some of the group's rows are multiplied, and in the
one partly filled k-block the rows that belong to the next group (or lie past M) are
zeroed in shared memory by the consumers before their wgmma (both operands, so garbage
such as Inf in a neighbour's rows cannot leak through ``0 * Inf``; at most 15 rows,
16-byte stores). Output tiles at the K and N edges are clipped by the TMA store.

Warp roles, pipeline and epilogue are those of :class:`GroupedGemmSm90` (producer warp,
two consumer warp groups of 64 output rows each, TMA-store epilogue); the consumers run
its one consumer loop with :class:`WgradMainloop` and :class:`WgradStoreEpilogue`, and
its producer loop with :class:`GroupLoads` (both operands start at the group's row).
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass.pipeline import pipeline_init_wait

from jax_grouped_mlp.kernels.grouped_gemm_sm90 import (
    EPI_N, Bf16Mainloop, GroupedGemmConfig, GroupedGemmSm90, StoreEpilogue, StoreTarget, TmaLoad,
)
from jax_grouped_mlp.kernels.tile_scheduler import GroupTileScheduler, TileHandoff, TraceTimeObject

MMA_K = 16  # token rows per bf16 wgmma (a k-block): the granularity of the last slice


@dataclasses.dataclass(frozen=True)
class GroupedWgradConfig(GroupedGemmConfig):
    """The forward kernel's knobs; ``tile_k`` here counts token rows per stage.

    out_f32: write float32 gradients (for float32 master weights) instead of bf16;
    the epilogue's staging buffers double.
    epi_n: columns per epilogue subtile (32 or 64; name ``_en64``): a wider subtile
    halves the epilogue's barriers and TMA stores per tile, which matters here since a
    tile's K is one group's tokens (384 at Nemotron-3-Nano: 6 stages of MMA per tile).
    """

    out_f32: bool = False
    epi_n: int = EPI_N

    @property
    def epi_bytes(self) -> int:
        return self.tile_m * self.epi_n * (4 if self.out_f32 else 2) * self.epi_stages

    @property
    def name(self) -> str:
        s = f"grouped_wgrad_sm90_bf16_m{self.tile_m}n{self.tile_n}k{self.tile_k}_s{self.num_stages}"
        s += f"_e{self.epi_stages}" if self.epi_stages != 2 else ""
        s += f"_en{self.epi_n}" if self.epi_n != EPI_N else ""
        return s + ("_f32" if self.out_f32 else "")


class GroupedWgradSm90(GroupedGemmSm90):
    """Persistent warp-specialized TMA + wgmma weight gradient; see the module docstring."""

    def __init__(self, config: GroupedWgradConfig):
        super().__init__(config)
        self.epi_tile = (self.tile_m, config.epi_n)

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (K, M) bf16, K contiguous (JAX's X [M, K])
        b: cute.Tensor,  # (N, M) bf16, N contiguous (JAX's dY [M, N])
        out: cute.Tensor,  # (K, N, G) bf16, N contiguous (JAX's [G, K, N])
        group_sizes: cute.Tensor,  # (G,) int32
        tile_counter: cute.Tensor,  # (1,) int32, zeroed before the launch (the dynamic order's)
        tile_order: cute.Tensor,  # (1,) int32: non-zero for the dynamic order (XLA's choice)
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        # Tiles in the static or the dynamic order, as tile_order says (a TileHandoff).
        self.dynamic_tiles = True
        tma, smem_layouts = self._prepare(a, b, out)
        self.wgrad_kernel(*tma, group_sizes, tile_counter, tile_order, self.tiled_mma, *smem_layouts).launch(
            grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), min_blocks_per_mp=1, stream=stream
        )

    @cute.jit
    def _zero_rows(self, s: cute.Tensor, valid: Int32, ctid: Int32):
        """Zeroes token rows ``valid..`` up to the next multiple of ``MMA_K`` (at most 15
        rows, all inside the wgmma k-block that holds row ``valid``) of ``s``, one stage
        ``(rows, tile_k)`` of an MN-major operand, with 16-byte stores (consumer thread
        ``ctid`` of 256).

        A 16-byte vector is 8 consecutive values of one token row: the 128-byte swizzle
        permutes whole 16-byte chunks within a token's 128-byte line, so the vector stays
        contiguous and aligned wherever the swizzle puts it. The k-block's 16 token rows
        hold ``16 * rows / 8`` vectors; thread ``ctid`` takes every 256th (token row
        outer, so a warp writes whole lines).
        """
        chunks = cute.size(s, mode=[0]) // 8  # 16-byte vectors per token row
        row0 = valid - valid % MMA_K  # the k-block's first token row
        zero = cute.make_rmem_tensor((8, 1), self.ab_dtype)
        zero.fill(0.0)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.ab_dtype, num_bits_per_copy=128)
        vectors = MMA_K * chunks
        for p in cutlass.range_constexpr((vectors + 255) // 256):
            i = ctid + 256 * p
            j = row0 + i // chunks
            dst = cute.local_tile(s, (8, 1), (i % chunks, j))
            if cutlass.const_expr(256 * (p + 1) <= vectors):
                if j >= valid:
                    cute.copy(atom, zero, dst)
            else:  # a partial last pass (tile_n = 192)
                if i < vectors:
                    if j >= valid:
                        cute.copy(atom, zero, dst)

    @cute.jit
    def _zero_kblock_past(self, sA: cute.Tensor, sB: cute.Tensor, stage: Int32, valid: Int32, ctid: Int32):
        """Zeroes the token rows past ``valid`` of the wgmma k-block that holds row
        ``valid`` (``valid % MMA_K != 0``) in ``stage`` of both operands (consumer threads).

        Both operands, so garbage in those rows (the next group's, which may hold Inf)
        cannot leak through ``0 * Inf``; later k-blocks are never multiplied
        (:meth:`WgradMainloop.tile`). Generic-proxy stores, then a proxy fence and a
        barrier of both consumer warp groups (each reads all of B and its half of A), so
        the following wgmma (async proxy) sees the zeros.
        """
        self._zero_rows(sA[(None, None, stage)], valid, ctid)
        self._zero_rows(sB[(None, None, stage)], valid, ctid)
        cute.arch.fence_proxy("async.shared", space="cta")
        self.epi_barrier.arrive_and_wait()

    @cute.jit
    def _mma_first(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA, tCrB, stage, count: cutlass.Constexpr) -> None:
        """Issues the first ``count`` (a Python int) wgmma k-blocks of one pipeline stage
        into ``acc``, straight-line, and commits them (``count`` = all: :meth:`_mma_stage`)."""
        for kb in cutlass.range_constexpr(count):
            c = (None, None, kb, stage)
            cute.gemm(tiled_mma, acc, tCrA[c], tCrB[c], acc)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _mma_kblocks(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA, tCrB, stage, kblocks: Int32) -> None:
        """Issues the first ``kblocks`` (1 .. tile_k / MMA_K = 4, uniform over the
        consumers) wgmma k-blocks of one pipeline stage into ``acc`` and commits them.

        One branch per count, each an unconditional run of wgmmas as in
        :meth:`_mma_stage` (a branch between two wgmmas of a group makes ptxas fence and
        commit every wgmma on its own, and ``kblocks = 4``, every slice at equal sizes,
        must cost what a full stage costs). ``tiled_mma`` must be the caller's, the one
        whose ``ACCUMULATE`` was set (see :meth:`WgradMainloop.tile`).
        """
        assert cute.size(tCrA, mode=[2]) == 4, "tile_k must be 4 wgmma k-blocks (64 rows)"
        if kblocks == 4:
            self._mma_first(tiled_mma, acc, tCrA, tCrB, stage, 4)
        else:
            if kblocks == 3:
                self._mma_first(tiled_mma, acc, tCrA, tCrB, stage, 3)
            else:
                if kblocks == 2:
                    self._mma_first(tiled_mma, acc, tCrA, tCrB, stage, 2)
                else:
                    self._mma_first(tiled_mma, acc, tCrA, tCrB, stage, 1)

    def _group_tiles(self, k_dim, n_dim, group_sizes: cute.Tensor) -> tuple:
        """``(m_tiles, group_tiles, total_tiles)`` of the group-major walk: every group
        has ``cdiv(K, tile_m) * cdiv(N, tile_n)`` output tiles (also the FP8 kernel's)."""
        num_groups = group_sizes.shape[0]
        m_tiles = (k_dim + (self.tile_m - 1)) // self.tile_m
        n_tiles = (n_dim + (self.tile_n - 1)) // self.tile_n
        group_tiles = m_tiles * n_tiles
        return m_tiles, group_tiles, group_tiles * num_groups

    @cute.kernel
    def wgrad_kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,  # TMA coordinate tensor (K, M)
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,  # TMA coordinate tensor (N, M)
        tma_atom_out: cute.CopyAtom,
        mOutTma: cute.Tensor,  # TMA coordinate tensor (K, N, G)
        group_sizes: cute.Tensor,
        tile_counter: cute.Tensor,  # (1,) int32: the dynamic tile order's counter
        tile_order: cute.Tensor,  # (1,) int32: XLA's choice of order
        tiled_mma: cute.TiledMma,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        epi_smem: cute.ComposedLayout,
    ):
        tidx, bidx, gdim, warp_idx = self._kernel_start((tma_atom_a, tma_atom_b, tma_atom_out))

        mainloop, sA, sB, sC = self._shared_and_pipeline(a_smem, b_smem, epi_smem)

        k_dim = mA.shape[0]
        m = mA.shape[1]
        m_tiles, group_tiles, total_tiles = self._group_tiles(k_dim, mB.shape[0], group_sizes)

        warp_group = cute.arch.make_warp_uniform(tidx // 128)
        pipeline_init_wait(cluster_shape_mn=(1, 1))
        size0 = cutlass.min(cutlass.max(Int32(group_sizes[0]), Int32(0)), m)

        producer_source, consumer_source = self._tile_handoffs(tile_counter, gdim)
        # Every role follows XLA's choice of order: the handoff only where it is dynamic.
        dynamic = Int32(tile_order[0]) != 0
        producer_source, consumer_source = producer_source.choosing(dynamic), consumer_source.choosing(dynamic)
        work = GroupWork(group_sizes, m, m_tiles, group_tiles, total_tiles, bidx, gdim, size0, consumer_source)
        carry_order = ("sched.g", "sched.start", "sched.size", "epi_count", "sched.t", "read", "release",
                       "sched.handoff")

        if warp_group == 0:
            cute.arch.setmaxregister_decrease(self.load_regs)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                sched = work.scheduler(source=producer_source)
                loads = GroupLoads(self, TmaLoad(tma_atom_a, mA, sA), TmaLoad(tma_atom_b, mB, sB))
                self._produce_tiles(mainloop, state, sched, loads)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self._consumer(
                WgradMainloop(self, tiled_mma, mainloop, sA, sB),
                WgradStoreEpilogue(self, StoreTarget(sC, tma_atom_out, mOutTma, None), warp_idx),
                work, tidx - 128, carry_order=carry_order,
            )


class GroupWork(TraceTimeObject):
    """One CTA's share of the weight gradient (the :class:`TileWork` of
    :class:`GroupTileScheduler`): no fixed stage count, a tile's K is its group's rows."""

    def __init__(self, group_sizes: cute.Tensor, m, m_tiles, group_tiles, total_tiles, bidx, gdim, size0,
                 source: TileHandoff | None = None):
        self.args = (group_sizes, m, m_tiles, group_tiles, total_tiles, bidx, gdim, size0)
        self.source = source  # the consumers' TileHandoff (dynamic order), or None

    def scheduler(self, blocks: bool = False, source: TileHandoff | None = None) -> GroupTileScheduler:
        """A role's cursor at this CTA's first tile: the consumers' (``source`` None: the
        one given at construction) or the producer's (its own ``source``)."""
        return GroupTileScheduler.create(*self.args, source=source if source is not None else self.source)


class GroupLoads(TraceTimeObject):
    """A weight-gradient tile's TMA loads: both operands (``(K, M)`` and ``(N, M)``
    coordinate tensors, ``rows`` and ``weight``) from the tile's group's first row, in
    ``tile_k``-row slices, as many as the group has (none for an empty group)."""

    def __init__(self, kernel: GroupedWgradSm90, rows: TmaLoad, weight: TmaLoad):
        self.kernel = kernel
        self.rows = rows
        self.weight = weight

    @cute.jit
    def load_tile(self, mainloop, state, sched: GroupTileScheduler, tile):
        """Issues the current tile's stages; returns the advanced pipeline ``state``."""
        tma_atom_a, mA, sA = self.rows.atom, self.rows.gmem, self.rows.smem
        tma_atom_b, mB, sB = self.weight.atom, self.weight.gmem, self.weight.smem
        tile_m, tile_n, tile_k = self.kernel.tile_m, self.kernel.tile_n, self.kernel.tile_k
        at, m_tile, n_tile = tile
        start, size = at.start, at.size
        gA = cute.local_tile(cute.domain_offset((0, start), mA), (tile_m, tile_k), (m_tile, None))
        gB = cute.local_tile(cute.domain_offset((0, start), mB), (tile_n, tile_k), (n_tile, None))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_atom_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        k_tiles = (size + (tile_k - 1)) // tile_k
        for k in range(k_tiles):
            mainloop.producer_acquire(state)
            bar = mainloop.producer_get_barrier(state)
            cute.copy(tma_atom_a, tAgA[(None, k)], tAsA[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(tma_atom_b, tBgB[(None, k)], tBsB[(None, state.index)], tma_bar_ptr=bar)
            mainloop.producer_commit(state)
            state.advance()
        return state


class WgradMainloop(Bf16Mainloop):
    """The bf16 mainloop over the tile's group rows in ``tile_k`` slices, in order; an
    empty group leaves a zero accumulator.

    The last slice may hold fewer of the group's rows (``last_valid``) than ``tile_k``;
    TMA has filled the rest with the next group's rows (anything, Inf included) or, past
    M, with zeros. Only its first ``cdiv(last_valid, MMA_K)`` wgmma k-blocks are issued,
    and in the one partly valid k-block the rows past the group are zeroed in shared
    memory first (:meth:`GroupedWgradSm90._zero_kblock_past`: at most 15 token rows,
    16-byte stores). The result is that of multiplying zeroed rows (the former kernel):
    the skipped products are exact zeros, and adding zeros to the fp32 accumulator
    changes none of its bits (at most the sign of an exact zero sum, as ``-0 + 0``).
    """

    @cute.jit
    def tile(self, sched: GroupTileScheduler, tile, read, release, work: GroupWork):
        tiled_mma, mainloop, acc, tCrA, tCrB = self.tiled_mma, self.pipe, self.acc, self.tCrA, self.tCrB
        tile_k = self.kernel.tile_k
        size = tile[0].size
        k_tiles = (size + (tile_k - 1)) // tile_k
        last_valid = size - (k_tiles - 1) * tile_k  # rows of the group in the last slice (1..tile_k)
        last_kblocks = (last_valid + (MMA_K - 1)) // MMA_K  # its wgmma k-blocks that hold any
        acc.fill(0.0)
        if k_tiles > 0:
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.fence()
            mainloop.consumer_wait(read)
            if k_tiles == 1:
                self._last_stage(tiled_mma, acc, tCrA, tCrB, read.index, last_valid, last_kblocks)
            else:
                self.kernel._mma_stage(tiled_mma, acc, tCrA, tCrB, read.index)
            read.advance()
            for k in range(1, k_tiles):
                mainloop.consumer_wait(read)
                if k == k_tiles - 1:
                    self._last_stage(tiled_mma, acc, tCrA, tCrB, read.index, last_valid, last_kblocks)
                else:
                    self.kernel._mma_stage(tiled_mma, acc, tCrA, tCrB, read.index)
                cute.nvgpu.warpgroup.wait_group(1)
                mainloop.consumer_release(release)
                release.advance()
                read.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            mainloop.consumer_release(release)
            release.advance()
        return read, release

    @cute.jit
    def _last_stage(self, tiled_mma, acc, tCrA, tCrB, stage: Int32, last_valid: Int32, last_kblocks: Int32):
        """The wgmmas of the tile's last slice (``last_valid`` group rows) in ``stage``.

        ``tiled_mma`` (and the fragments) must be :meth:`tile`'s locals, never
        ``self.tiled_mma``: ``tiled_mma.set(ACCUMULATE, True)`` runs inside the dynamic
        ``if k_tiles > 0`` region, on the object the DSL rebuilt there from the MLIR
        values; ``self.tiled_mma`` still holds the kernel argument's state, whose
        ``ACCUMULATE`` is a 1-byte kernel parameter, false from the host. With it
        (commit 9edbd08) every wgmma of a last slice overwrote the accumulator: each
        tile's result was the product of its last k-block alone.
        """
        if last_valid % MMA_K != 0:
            self.kernel._zero_kblock_past(self.sA, self.sB, stage, last_valid, self.ctid)
        self.kernel._mma_kblocks(tiled_mma, acc, tCrA, tCrB, stage, last_kblocks)

    def setup(self, ctid):
        self.ctid = ctid
        return super().setup(ctid)


class WgradStoreEpilogue(StoreEpilogue):
    """The weight gradient's store: every tile is whole (TMA clips the K and N edges), into
    group ``g``'s ``[K, N]`` slice of ``out``."""

    def setup(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, ctid):
        self.epi = self.kernel._epilogue_copies(tiled_mma, self.out.sC, acc, ctid)

    @cute.jit
    def store_tile(self, sched: GroupTileScheduler, tile, epi_count):
        at, m_tile, n_tile = tile
        out, kernel = self.out, self.kernel
        gTile = cute.local_tile(out.mOutTma[(None, None, at.g)], (kernel.tile_m, kernel.tile_n), (m_tile, n_tile))
        return self.kernel._store_tile_tma(self.epi, out.tma_atom, out.sC, gTile, epi_count, self.warp_idx)
