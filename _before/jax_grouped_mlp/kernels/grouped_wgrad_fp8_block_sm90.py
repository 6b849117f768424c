"""Hopper (sm_90a) FP8 block-scaled grouped weight gradient (the ``fp8_block`` recipe).

    out[g][i, j] = sum over group g's 128-token blocks b of
                   sa[b, i] * sb[b, j] * (A[i, block b] . B[j, block b])

GPU test: tests/test_grouped_wgrad_fp8_block_gpu.py.

Operands (the group-aware ``fp8_block`` copies of ``x [M, K]`` and ``dy [M, N]``, laid out
for Hopper's FP8 wgmma, which reads both operands K-major: here K is the token axis):
  A            [K, P]     float8_e4m3fn, tokens contiguous   (TMA, K-major wgmma operand)
  B            [N, P]     float8_e4m3fn, tokens contiguous   (TMA, K-major wgmma operand)
  sa           [NB, K]    float32, the decoded E8M0 scale of each (block, column) of A
  sb           [NB, N]    float32, the same for B
  group_sizes  [G]        int32, read on the device only (clamped as everywhere)
  out          [G, K, N]  bf16 or float32 (a variant per dtype), N contiguous
with ``NB = cdiv(M, 128) + G`` group-aware blocks and ``P = 128 * NB``: block ``b``'s
tokens are columns ``[128 b, 128 b + 128)`` of A and B, zero past its group's rows
(``formats.fp8_block.token_major_blocks`` builds this from an ``FP8BlockTensor``).
Group ``g`` owns blocks ``first_g .. first_g + cdiv(size_g, 128) - 1``, ``first_g`` the
exclusive cumsum of ``cdiv(size_g, 128)`` over the sizes clamped to ``M`` (``rows``):
the quantizer's block numbering, so a block never mixes two groups and no masking is
needed. The clamped sizes keep every block index below ``NB``. Each stage's scales are
TMA boxes of the block's row of ``sa`` and of ``sb`` (zero-filled past K and N, where A's
and B's rows are zero-filled too; those output rows and columns are never stored).

Numerics as the data GEMM's (:mod:`grouped_gemm_fp8_block_sm90`): each 128-token block
is one FP8 wgmma reduction (exact products, Hopper's internal FP8 accumulation) into a
temporary accumulator, then promoted: ``acc += temp * (sa[b, i] * sb[b, j])`` in float32
(the scale varies along both output axes here, so per element one FMUL and one FFMA).
Blocks are summed in order in one CTA: bitwise reproducible; an empty group's tiles
store zeros.

Schedule: :class:`~jax_grouped_mlp.kernels.grouped_wgrad_sm90.GroupedWgradSm90`'s
(every group has the same ``cdiv(K, 128) * cdiv(N, 128)`` output tiles, numbered group
by group; persistent CTAs; a forward-only group cursor that also counts the blocks:
:class:`~jax_grouped_mlp.kernels.tile_scheduler.GroupBlockTileScheduler`), its producer
warp, two consumer warp groups of 64 output rows and its TMA-store epilogue. One pipeline
stage is one block: 128 x 128 bytes of A and of B.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass.pipeline import pipeline_init_wait

from jax_grouped_mlp.kernels.grouped_gemm_fp8_block_sm90 import SCALE_BLOCK, issue_block
from jax_grouped_mlp.kernels.grouped_gemm_sm90 import SMEM_CAPACITY, StoreTarget, TmaLoad, gemm_shared_storage
from jax_grouped_mlp.kernels.grouped_wgrad_sm90 import GroupedWgradSm90, WgradStoreEpilogue
from jax_grouped_mlp.kernels.tile_scheduler import GroupBlockTileScheduler, TraceTimeObject


@dataclasses.dataclass(frozen=True)
class Fp8BlockWgradConfig:
    """Compile-time knobs of :class:`GroupedWgradFp8BlockSm90`.

    tile_n: output columns per tile (128: one register accumulator of 64 floats a thread
      plus the 64-float temporary of a block).
    stages: shared-memory pipeline depth (0: as many as fit); a stage is one 128-token block.
    epi_n: columns per epilogue subtile (``_en64``). out_f32: float32 output (float32
      master weights).
    pingpong: two temporary accumulators (name ``_pp``; :class:`Fp8WgradPingPongMainloop`):
      block k + 1's wgmmas are issued before block k is promoted, so a warp group's
      promotion overlaps its own wgmmas too; the same sums in the same order.
    The output tile has 128 rows (of K): two consumer warp groups of 64.
    """

    tile_n: int = 128
    stages: int = 0
    epi_n: int = 64
    out_f32: bool = False
    pingpong: bool = False
    epi_stages: int = 2
    panel_m: int = 8  # (unused: the group-major walk has no panels; the skeleton reads it)

    tile_m = 128
    tile_k = SCALE_BLOCK

    def __post_init__(self):
        if self.tile_n != SCALE_BLOCK:
            raise ValueError(f"tile_n must be {SCALE_BLOCK}, got {self.tile_n=}")
        if self.epi_n not in (32, 64):
            raise ValueError(f"epi_n must be 32 or 64, got {self.epi_n=}")
        if self.num_stages < 2:
            raise ValueError(f"{self} leaves room for {self.num_stages} stages; need >= 2")

    @property
    def stage_bytes(self) -> int:
        # One byte per FP8 element, and the block's float32 scales of the tile's rows and columns.
        return (self.tile_m + self.tile_n) * self.tile_k + (self.tile_m + self.tile_n) * 4

    @property
    def epi_bytes(self) -> int:
        return self.tile_m * self.epi_n * (4 if self.out_f32 else 2) * self.epi_stages

    @property
    def num_stages(self) -> int:
        fit = (SMEM_CAPACITY - 1024 - self.epi_bytes) // self.stage_bytes
        return min(fit, self.stages) if self.stages else fit

    @property
    def name(self) -> str:
        s = f"grouped_wgrad_sm90_fp8block_m{self.tile_m}n{self.tile_n}k{self.tile_k}_s{self.num_stages}"
        s += f"_en{self.epi_n}" if self.epi_n != 32 else ""
        s += "_pp" if self.pingpong else ""
        return s + ("_f32" if self.out_f32 else "")


class GroupedWgradFp8BlockSm90(GroupedWgradSm90):
    """The FP8 block-scaled weight gradient: the weight-gradient skeleton with
    :class:`Fp8WgradMainloop` and :class:`GroupBlockLoads`; see the module docstring."""

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (K, P) float8_e4m3fn, P contiguous
        b: cute.Tensor,  # (N, P) float8_e4m3fn, P contiguous
        sa: cute.Tensor,  # (NB, K) float32
        sb: cute.Tensor,  # (NB, N) float32
        out: cute.Tensor,  # (K, N, G) bf16 or float32, N contiguous (JAX's [G, K, N])
        group_sizes: cute.Tensor,  # (G,) int32
        rows: Int32,  # M: the token rows the group sizes are clamped to
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        tma, smem_layouts = self._prepare(a, b, out)
        scale_tma = self._prepare_scales(sa, sb, smem_layouts)
        self.fp8_wgrad_kernel(*tma, *scale_tma, group_sizes, rows, self.tiled_mma, *smem_layouts).launch(
            grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), min_blocks_per_mp=1, stream=stream
        )

    @cute.jit
    def _prepare_scales(self, sa: cute.Tensor, sb: cute.Tensor, smem_layouts):
        """The scales' staging: per pipeline stage the block's 128 scales of the tile's rows
        (``sa``) and of its columns (``sb``), loaded by TMA with the stage's operands
        (zero-filled past K and N, :meth:`_scale_smem`). Sets the shared-storage struct
        (the base class's fields plus ``sSA``, ``sSB``); returns the two TMA atoms and
        coordinate tensors."""
        one = cute.slice_(self._scale_smem(), (None, None, 0))
        op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        atom_sa, tma_sa = cute.nvgpu.cpasync.make_tiled_tma_atom(op, sa, one, (1, SCALE_BLOCK))
        atom_sb, tma_sb = cute.nvgpu.cpasync.make_tiled_tma_atom(op, sb, one, (1, SCALE_BLOCK))
        a_smem, b_smem, epi_smem = smem_layouts

        # (The base class's struct plus the two scale rings.)
        self.shared_storage = gemm_shared_storage(
            self, a_smem, b_smem, epi_smem,
            sSA=cute.struct.Align[cute.struct.MemRange[cutlass.Float32, SCALE_BLOCK * self.stages], 128],
            sSB=cute.struct.Align[cute.struct.MemRange[cutlass.Float32, SCALE_BLOCK * self.stages], 128],
        )
        return atom_sa, tma_sa, atom_sb, tma_sb

    def _scale_smem(self) -> cute.Layout:
        """One ring of staged scales, ``(1, 128, stages)`` floats (built where it is used:
        a layout made on the host is not a value inside the kernel)."""
        return cute.make_layout((1, SCALE_BLOCK, self.stages), stride=(SCALE_BLOCK, 1, SCALE_BLOCK))

    @cute.kernel
    def fp8_wgrad_kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,  # TMA coordinate tensor (K, P)
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,  # TMA coordinate tensor (N, P)
        tma_atom_out: cute.CopyAtom,
        mOutTma: cute.Tensor,  # TMA coordinate tensor (K, N, G)
        tma_atom_sa: cute.CopyAtom,
        mSA: cute.Tensor,  # TMA coordinate tensor (NB, K)
        tma_atom_sb: cute.CopyAtom,
        mSB: cute.Tensor,  # TMA coordinate tensor (NB, N)
        group_sizes: cute.Tensor,
        rows: Int32,
        tiled_mma: cute.TiledMma,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        epi_smem: cute.ComposedLayout,
    ):
        tidx, bidx, gdim, warp_idx = self._kernel_start((tma_atom_a, tma_atom_b, tma_atom_out, tma_atom_sa, tma_atom_sb))

        scale_bytes = 2 * SCALE_BLOCK * 4  # one block's row and column scales, float32
        mainloop, sA, sB, sC = self._shared_and_pipeline(a_smem, b_smem, epi_smem, extra_tx_bytes=scale_bytes)
        sSA = self.smem_storage.sSA.get_tensor(self._scale_smem())
        sSB = self.smem_storage.sSB.get_tensor(self._scale_smem())

        m_tiles, group_tiles, total_tiles = self._group_tiles(mA.shape[0], mB.shape[0], group_sizes)

        warp_group = cute.arch.make_warp_uniform(tidx // 128)
        pipeline_init_wait(cluster_shape_mn=(1, 1))
        size0 = cutlass.min(cutlass.max(Int32(group_sizes[0]), Int32(0)), rows)

        work = GroupBlockWork(group_sizes, rows, m_tiles, group_tiles, total_tiles, bidx, gdim, size0)

        if warp_group == 0:
            cute.arch.setmaxregister_decrease(self.load_regs)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                loads = GroupBlockLoads(
                    self, TmaLoad(tma_atom_a, mA, sA), TmaLoad(tma_atom_b, mB, sB),
                    TmaLoad(tma_atom_sa, mSA, sSA), TmaLoad(tma_atom_sb, mSB, sSB),
                )
                self._produce_tiles(mainloop, state, work.scheduler(), loads)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            mainloop_class = Fp8WgradPingPongMainloop if self.config.pingpong else Fp8WgradMainloop
            self._consumer(
                mainloop_class(self, tiled_mma, mainloop, sA, sB, sSA, sSB),
                WgradStoreEpilogue(self, StoreTarget(sC, tma_atom_out, mOutTma, None), warp_idx),
                work, tidx - 128,
                carry_order=("sched", "epi_count", "read", "release"),
            )


class GroupBlockWork(TraceTimeObject):
    """One CTA's share of the FP8 weight gradient: :class:`GroupBlockTileScheduler`'s walk
    (a tile's K is its group's 128-token blocks)."""

    def __init__(self, group_sizes: cute.Tensor, rows, m_tiles, group_tiles, total_tiles, bidx, gdim, size0):
        self.args = (group_sizes, rows, m_tiles, group_tiles, total_tiles, bidx, gdim, size0)

    def scheduler(self, blocks: bool = False) -> GroupBlockTileScheduler:
        return GroupBlockTileScheduler.create(*self.args)


class GroupBlockLoads(TraceTimeObject):
    """A tile's TMA loads: for each of its group's blocks, A's ``128 x 128`` box at
    (row tile, block), B's at (column tile, block), and the block's 128 scales of the
    tile's rows and of its columns; none for an empty group."""

    def __init__(self, kernel: GroupedWgradFp8BlockSm90, rows: TmaLoad, cols: TmaLoad,
                 row_scales: TmaLoad, col_scales: TmaLoad):
        self.kernel = kernel
        self.loads = (rows, cols, row_scales, col_scales)

    @cute.jit
    def load_tile(self, mainloop, state, sched: GroupBlockTileScheduler, tile):
        """Issues the current tile's stages; returns the advanced pipeline ``state``."""
        tile_m, tile_n, tile_k = self.kernel.tile_m, self.kernel.tile_n, self.kernel.tile_k
        at, m_tile, n_tile = tile
        rows, cols, row_scales, col_scales = self.loads
        # (box, which tile along the box's non-block mode): the block is the last coordinate.
        views = (
            (rows, cute.local_tile(rows.gmem, (tile_m, tile_k), (m_tile, None))),
            (cols, cute.local_tile(cols.gmem, (tile_n, tile_k), (n_tile, None))),
            (row_scales, cute.local_tile(row_scales.gmem, (1, SCALE_BLOCK), (None, m_tile))),
            (col_scales, cute.local_tile(col_scales.gmem, (1, SCALE_BLOCK), (None, n_tile))),
        )
        parts = []
        for load, g in views:
            ts, tg = cute.nvgpu.cpasync.tma_partition(
                load.atom, 0, cute.make_layout(1), cute.group_modes(load.smem, 0, 2), cute.group_modes(g, 0, 2)
            )
            parts.append((load.atom, ts, tg))
        for k in range(at.blocks()):
            mainloop.producer_acquire(state)
            bar = mainloop.producer_get_barrier(state)
            for atom, ts, tg in parts:
                cute.copy(atom, tg[(None, at.blk + k)], ts[(None, state.index)], tma_bar_ptr=bar)
            mainloop.producer_commit(state)
            state.advance()
        return state


class Fp8WgradMainloop(TraceTimeObject):
    """Per block of the tile's group: the stage's 4 FP8 wgmmas (K = 32 each) into the
    temporary accumulator (the first overwrites it), this thread's two row scales and
    32 column scales from the stage's shared-memory copy (read while the wgmmas run),
    wait, hand the slot back, ``acc += temp * (sa[row] * sb[col])``. An empty group
    leaves zeros."""

    def __init__(self, kernel: GroupedWgradFp8BlockSm90, tiled_mma: cute.TiledMma, pipe,
                 sA: cute.Tensor, sB: cute.Tensor, sSA: cute.Tensor, sSB: cute.Tensor):
        self.kernel = kernel
        self.tiled_mma = tiled_mma
        self.pipe = pipe
        self.sA = sA
        self.sB = sB
        self.sSA = sSA
        self.sSB = sSB

    def setup(self, ctid):
        """Consumer thread ``ctid``'s fragments, its temporary accumulator, and the static
        maps from an accumulator element to its row and column slot; returns the float32
        main accumulator."""
        k = self.kernel
        self.tCrA, self.tCrB, self.acc = k._mma_fragments(self.tiled_mma, self.sA, self.sB, ctid)
        self.temp = cute.make_rmem_tensor(self.acc.shape, k.acc_dtype)
        ident = cute.make_identity_tensor((k.tile_m, k.tile_n))
        # Every thread's elements sit at its first element's (row, column) plus offsets
        # that are the same for all threads: read them off thread 0's partition.
        c0 = self.tiled_mma.get_slice(0).partition_C(ident)
        r00, c00 = c0[0][0], c0[0][1]
        row_offsets, col_offsets = [], []
        self.row_slot, self.col_slot = [], []
        for i in range(cute.size(self.acc)):
            r, c = c0[i][0], c0[i][1]
            if not (isinstance(r, int) and isinstance(c, int)):
                raise TypeError(f"accumulator element {i} has no static coordinate: {(r, c)}")
            dr, dc = r - r00, c - c00
            if dr not in row_offsets:
                row_offsets.append(dr)
            if dc not in col_offsets:
                col_offsets.append(dc)
            self.row_slot.append(row_offsets.index(dr))
            self.col_slot.append(col_offsets.index(dc))
        self.row_offsets, self.col_offsets = tuple(row_offsets), tuple(col_offsets)
        first = self.tiled_mma.get_slice(ctid).partition_C(ident)[0]
        self.row_base, self.col_base = first[0], first[1]
        self.sr = cute.make_rmem_tensor((len(row_offsets),), cutlass.Float32)
        self.sc = cute.make_rmem_tensor((len(col_offsets),), cutlass.Float32)
        return self.acc

    @cute.jit
    def tile(self, sched: GroupBlockTileScheduler, tile, read, release, work: GroupBlockWork):
        """The current tile's accumulator; returns the advanced ``(read, release)`` states."""
        tiled_mma, pipe, acc, temp = self.tiled_mma, self.pipe, self.acc, self.temp
        sSA, sSB, sr, sc = self.sSA, self.sSB, self.sr, self.sc
        at = tile[0]
        acc.fill(0.0)
        for kb in range(at.blocks()):
            pipe.consumer_wait(read)
            tiled_mma = issue_block(tiled_mma, temp, self.tCrA, self.tCrB, read.index)
            for j in cutlass.range_constexpr(len(self.row_offsets)):  # while the wgmmas run
                sr[j] = sSA[0, self.row_base + self.row_offsets[j], read.index]
            for j in cutlass.range_constexpr(len(self.col_offsets)):
                sc[j] = sSB[0, self.col_base + self.col_offsets[j], read.index]
            cute.nvgpu.warpgroup.wait_group(0)
            pipe.consumer_release(release)  # (the stage's operands and scales are read)
            for i in cutlass.range_constexpr(cute.size(temp)):
                acc[i] = acc[i] + temp[i] * (sr[self.row_slot[i]] * sc[self.col_slot[i]])
            release.advance()
            read.advance()
        return read, release


class Fp8WgradPingPongMainloop(Fp8WgradMainloop):
    """:class:`Fp8WgradMainloop` with two temporary accumulators: block ``k + 1``'s
    wgmmas are issued (into the other temporary) before block ``k`` is promoted, so the
    promotion and the scale loads overlap this warp group's own wgmmas as well as the
    other warp group's. Blocks are promoted in order, each from the same wgmma sums:
    bitwise the single-temporary result. The stage of the block being promoted is the
    oldest unreleased one (``release.index``); its scales are read before it is handed
    back, and ``wait_group(1)`` (one newer block still in flight) or ``wait_group(0)`` (the
    tile's last block) makes sure its wgmmas are done."""

    def setup(self, ctid):
        acc = super().setup(ctid)
        self.temp2 = cute.make_rmem_tensor(acc.shape, self.kernel.acc_dtype)
        return acc

    @cute.jit
    def _promote(self, temp: cute.Tensor, stage, pending: cutlass.Constexpr) -> None:
        """``acc += temp * (sa * sb)`` of the block in ``stage``, once only ``pending``
        newer wgmma groups are still in flight."""
        sSA, sSB, sr, sc, acc = self.sSA, self.sSB, self.sr, self.sc, self.acc
        for j in cutlass.range_constexpr(len(self.row_offsets)):
            sr[j] = sSA[0, self.row_base + self.row_offsets[j], stage]
        cute.nvgpu.warpgroup.wait_group(pending)
        # Column by column, each column's scale read just before its elements: with two
        # temporaries live, few scale registers may be.
        for j in cutlass.range_constexpr(len(self.col_offsets)):
            sc[j] = sSB[0, self.col_base + self.col_offsets[j], stage]
            for i in cutlass.range_constexpr(cute.size(temp)):
                if self.col_slot[i] == j:
                    acc[i] = acc[i] + temp[i] * (sr[self.row_slot[i]] * sc[j])

    def _issue_next(self, tiled_mma: cute.TiledMma, temp: cute.Tensor, read):
        """Waits for the next stage and issues its block into ``temp``; returns
        ``(tiled_mma, read)``, advanced (the caller rebinds both: the DSL threads only
        plain locals rebound in a loop or branch body through it)."""
        self.pipe.consumer_wait(read)
        tiled_mma = issue_block(tiled_mma, temp, self.tCrA, self.tCrB, read.index)
        read.advance()
        return tiled_mma, read

    def _retire(self, temp: cute.Tensor, release, pending: int):
        """Promotes the oldest block in flight (in ``temp``; ``pending`` newer groups may
        still run) and hands its stage back; returns ``release``, advanced."""
        self._promote(temp, release.index, pending)
        self.pipe.consumer_release(release)
        release.advance()
        return release

    @cute.jit
    def tile(self, sched: GroupBlockTileScheduler, tile, read, release, work: GroupBlockWork):
        """The current tile's accumulator; returns the advanced ``(read, release)`` states.

        Block 0 into temporary 0; then pairs (blocks 2p + 1 into temporary 1 and 2p + 2
        into temporary 0, each issued before the one before it is promoted); then the
        last one or two blocks."""
        tiled_mma, acc, t0, t1 = self.tiled_mma, self.acc, self.temp, self.temp2
        blocks = tile[0].blocks()
        acc.fill(0.0)
        if blocks > 0:
            tiled_mma, read = self._issue_next(tiled_mma, t0, read)
            for _ in range((blocks - 1) // 2):
                tiled_mma, read = self._issue_next(tiled_mma, t1, read)
                release = self._retire(t0, release, 1)
                tiled_mma, read = self._issue_next(tiled_mma, t0, read)
                release = self._retire(t1, release, 1)
            if (blocks - 1) % 2 == 1:  # two blocks left: the one in t0 and one more
                tiled_mma, read = self._issue_next(tiled_mma, t1, read)
                release = self._retire(t0, release, 1)
                release = self._retire(t1, release, 0)
            else:
                release = self._retire(t0, release, 0)
        return read, release
