"""Hopper (sm_90a) FP8 block-scaled grouped GEMM over ragged M (the ``fp8_block`` recipe).

The four data GEMMs of ``grouped_mlp``'s ``fp8_block`` recipe. GPU test:
tests/test_grouped_gemm_fp8_block_gpu.py.

    out[m, :] = sum_kb  sa[m, kb] * sb[g(m), nb, kb] * (A[m, kb-block] @ B[g(m), nb-block, kb-block]^T)

Operands (row-major as JAX stores them):
  A            [M, K]        float8_e4m3fn, K contiguous          (TMA, K-major wgmma operand)
  B            [G, N, K]     float8_e4m3fn, K contiguous          (TMA, K-major wgmma operand;
                                                                    seen as (N, K, G))
  sa           [M, KB]       E8M0 bytes (uint8), one per 1 x 128 block of A along K
  sb           [G, NB, KB]   E8M0 bytes (uint8), one per 128 x 128 block of B
  group_sizes  [G]           int32, read on the device only (clamped as everywhere)
  out          [M, N]        bf16
with KB = cdiv(K, 128), NB = cdiv(N, 128): exactly the ``data``/``scale`` fields of
``formats.fp8_block.FP8BlockTensor`` (A: ``axis=1``; B: the weight quantized over
``axis=(1, 2)`` in its ``[G, N, K]`` layout). Hopper's FP8 wgmma reads both operands
K-major from shared memory only, hence B as ``[G, N, K]``.

Scale value of a byte ``e``: ``2**(e - 127)`` (0 -> 2**-127, a float32 subnormal; 0xFF ->
NaN), applied in float32 as ``(sa * sb) * partial``.

Why promotion (DeepSeek-V3; CUTLASS's "blockwise scaled" Hopper GEMM): the FP8 wgmma
accumulates in an internal format narrower than float32 (about 14 bits kept, per the
DeepSeek-V3 report), and the scales change every 128 of K anyway. So each 128-wide K
block (one pipeline stage: 4 wgmmas of K = 32 per 128-column half of the tile) is
multiplied into a *temporary*
accumulator that the first wgmma of the block overwrites (ACCUMULATE off), and then
added into the float32 main accumulator with one FFMA per element:
``acc += temp * (sa[row] * sb)``. The FP8 products are exact; what the internal
accumulation rounds stays inside one 128-block.

Schedule, scheduler, producer, pipeline and epilogue are the bf16 kernel's
(:mod:`grouped_gemm_sm90`): persistent CTAs over the segment tiles
(:class:`~jax_grouped_mlp.kernels.tile_scheduler.SegmentTileScheduler`), warp 0 the TMA
producer (:class:`~jax_grouped_mlp.kernels.grouped_gemm_sm90.SegmentLoads`: A rows from
the tile's start, the group's B tile, one stage per 128 of K), two consumer warp groups
of 64 rows each, :class:`~jax_grouped_mlp.kernels.grouped_gemm_sm90.StoreEpilogue`
(TMA store of full tiles, row-predicated stores of partial ones: a tile never writes the
next group's rows; tail tiles past ``sum(group_sizes)`` store zeros). Only the mainloop
differs (:class:`Fp8BlockMainloop`).

Scales are not staged through shared memory: each consumer thread holds two output
rows, so per K block it needs two bytes of ``sa`` (rows ``r`` and ``r + 8``; a row's
KB bytes share one 32-byte sector, so after the first block they hit L1) and one
CTA-uniform byte of ``sb`` per 128-column half. They are loaded right after the
block's (half's) wgmmas are issued
and arrive while those run. Row indices are clamped to ``M - 1``: a tile's rows past M
(zero-filled by TMA, never stored) read a valid scale.

Per K block (and half) a warp group issues its wgmmas, then waits for them
(``wait_group(0)``) before promoting: one warp group's promotion overlaps the other's wgmmas, not its own.
A ping-pong pair of temporary accumulators (block ``k + 1`` issued before block ``k`` is
promoted, so the promotion and the scale loads also overlap the warp group's own
wgmmas) was built and measured on the H200 in session 21: bitwise the same output and
no faster (0.98-1.04x, docs/notes/2026-12-04-fp8-gemm-pingpong.md); ncu puts the
tensor pipe at 73 % busy with the stalls spread over barrier, wait, dispatch and scale
loads, so the wait before promoting is not what limits it.

Shape contract (checked by the binding and the handler): K % 16 == 0 and N % 8 == 0
(TMA's 16-byte strides); K and N need *not* be multiples of 128: TMA zero-fills the
last partial K block of A and B (zeros add nothing; the quantizer pads the same way)
and the last column tile past N (not stored).
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, Uint32

from jax_grouped_mlp.kernels import ptx

from jax_grouped_mlp.kernels.grouped_gemm_sm90 import (
    EPI_N, SMEM_CAPACITY, GroupedGemmSm90, StoreEpilogue, StoreTarget, TmaLoad, SKIP_EMPTY_WARP_GROUP, release_stage,
    skip_stages, stage_arrivals, warp_group_row0,
)
from jax_grouped_mlp.kernels.tile_scheduler import SegmentTileScheduler, TileWork, TraceTimeObject

SCALE_BLOCK = 128  # K (and N, for B) per scale: one pipeline stage


@dataclasses.dataclass(frozen=True)
class Fp8BlockGemmConfig:
    """Compile-time knobs of :class:`GroupedGemmFp8BlockSm90`.

    tile_n: output columns per CTA tile: 128 (one B scale block per tile and K block) or
      256 (two column halves sharing the A stage, each multiplied into the one 64-register
      temporary accumulator and promoted in turn; the main accumulator takes 128
      registers a thread). A 256-wide tile writes a quarter less to shared memory per MMA
      (TMA) and reads A from global memory half as often; a half wholly past N is skipped.
    stages: shared-memory pipeline depth (0: as many as fit). Each stage is one
      128-wide K block: 128 x 128 bytes of A and tile_n x 128 of B.
    panel_m, epi_stages: as :class:`~jax_grouped_mlp.kernels.grouped_gemm_sm90.GroupedGemmConfig`.
    The CTA tile has 128 rows: two consumer warp groups of 64.
    """

    tile_n: int = 128
    stages: int = 0
    panel_m: int = 8
    epi_stages: int = 2

    tile_m = 128
    tile_k = SCALE_BLOCK

    def __post_init__(self):
        if self.tile_n not in (SCALE_BLOCK, 2 * SCALE_BLOCK):
            raise ValueError(f"tile_n must be {SCALE_BLOCK} or {2 * SCALE_BLOCK} (one or two B scale blocks), got {self.tile_n=}")
        if self.epi_stages < 2:
            raise ValueError(f"epi_stages must be >= 2, got {self.epi_stages=}")
        if self.panel_m < 1:
            raise ValueError(f"panel_m must be >= 1, got {self.panel_m=}")
        if self.num_stages < 2:
            raise ValueError(f"{self} leaves room for {self.num_stages} stages; need >= 2")

    @property
    def stage_bytes(self) -> int:
        return (self.tile_m + self.tile_n) * self.tile_k  # one byte per FP8 element

    @property
    def epi_bytes(self) -> int:
        return self.tile_m * EPI_N * 2 * self.epi_stages

    @property
    def num_stages(self) -> int:
        fit = (SMEM_CAPACITY - 1024 - self.epi_bytes) // self.stage_bytes
        return min(fit, self.stages) if self.stages else fit

    @property
    def name(self) -> str:
        s = f"grouped_gemm_sm90_fp8block_m{self.tile_m}n{self.tile_n}k{self.tile_k}_s{self.num_stages}"
        s += f"_p{self.panel_m}" if self.panel_m != 8 else ""
        return s + (f"_e{self.epi_stages}" if self.epi_stages != 2 else "")


class GroupedGemmFp8BlockSm90(GroupedGemmSm90):
    """The FP8 block-scaled grouped GEMM: the skeleton of :class:`GroupedGemmSm90` with
    :class:`Fp8BlockMainloop`; see the module docstring."""

    def __init__(self, config: Fp8BlockGemmConfig):
        super().__init__(config)
        self.halves = config.tile_n // SCALE_BLOCK

    def _mma_and_operand_layouts(self, a: cute.Tensor, b: cute.Tensor, out: cute.Tensor):
        """The base class's, plus ``tiled_mma_half``: the wgmma over one 128-column half
        (the whole tile when ``tile_n`` is 128)."""
        layouts = super()._mma_and_operand_layouts(a, b, out)
        self.tiled_mma_half = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype,
            utils.LayoutEnum.from_tensor(a).sm90_mma_major_mode(),
            utils.LayoutEnum.from_tensor(b).sm90_mma_major_mode(),
            self.acc_dtype, self.atom_layout_mnk, tiler_mn=(64, SCALE_BLOCK),
        )
        return layouts

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (M, K) float8_e4m3fn, K contiguous
        b: cute.Tensor,  # (N, K, G) float8_e4m3fn, K contiguous (JAX's [G, N, K])
        sa: cute.Tensor,  # (M, KB) uint8 E8M0
        sb: cute.Tensor,  # (G, NB, KB) uint8 E8M0
        out: cute.Tensor,  # (M, N) bf16, N contiguous
        group_sizes: cute.Tensor,  # (G,) int32
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        tma, smem_layouts = self._prepare(a, b, out)
        self.kernel_fp8(*tma, out, sa, sb, group_sizes, self.tiled_mma, self.tiled_mma_half, *smem_layouts).launch(
            grid=(num_ctas, 1, 1),
            block=(self.threads, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    @cute.kernel
    def kernel_fp8(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,  # TMA coordinate tensor (M, K)
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,  # TMA coordinate tensor (N, K, G)
        tma_atom_out: cute.CopyAtom,
        mOutTma: cute.Tensor,  # TMA coordinate tensor (M, N)
        mOut: cute.Tensor,  # (M, N)
        mSA: cute.Tensor,  # (M, KB) uint8
        mSB: cute.Tensor,  # (G, NB, KB) uint8
        group_sizes: cute.Tensor,
        tiled_mma: cute.TiledMma,  # (64, tile_n) per warp group: the accumulator and the epilogue
        tiled_mma_half: cute.TiledMma,  # (64, 128): one B scale block of columns, what is issued
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        epi_smem: cute.ComposedLayout,
    ):
        cta = self._kernel_start((tma_atom_a, tma_atom_b, tma_atom_out))
        pipe, sA, sB, sC, warp_group, work = self._setup_and_produce(
            TmaLoad(tma_atom_a, mA), TmaLoad(tma_atom_b, mB), mOut, group_sizes, (a_smem, b_smem, epi_smem), cta
        )
        if warp_group != 0:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self._consumer(
                Fp8BlockMainloop(self, tiled_mma, tiled_mma_half, pipe, sA, sB, mSA, mSB),
                StoreEpilogue(self, StoreTarget(sC, tma_atom_out, mOutTma, mOut), cta.warp_idx),
                work, cta.tidx - 128,
            )


def issue_block(tiled_mma: cute.TiledMma, temp: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor, stage) -> cute.TiledMma:
    """One 128-wide K block's wgmmas (stage ``stage`` of ``tCrA`` times ``tCrB``) into the
    temporary accumulator ``temp`` (the first overwrites it), committed.

    Returns ``tiled_mma``, whose ACCUMULATE field this sets: the caller rebinds its local
    to it, so the DSL carries the changed value out of loops and branches. (Also the
    FP8 weight gradient's, :mod:`grouped_wgrad_fp8_block_sm90`.)"""
    cute.nvgpu.warpgroup.fence()  # temp was read by its last promotion
    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
    for kk in range(cute.size(tCrA, mode=[2])):
        c = (None, None, kk, stage)
        cute.gemm(tiled_mma, temp, tCrA[c], tCrB[c], temp)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
    cute.nvgpu.warpgroup.commit_group()
    return tiled_mma


class Fp8BlockMainloop(TraceTimeObject):
    """FP8 wgmma with per-128-K promotion into the float32 accumulator (module docstring).

    Per K block (one pipeline stage) and 128-column half of the tile: wgmma fence, the
    stage's 4 wgmmas into the temporary accumulator (the first with ACCUMULATE off),
    commit; the scales from global memory (A's once per block); wait for the wgmmas;
    ``acc[half] += temp * (sa[row] * sb[half])``; after the last half the slot goes back
    to the producer. Tail tiles (rows past the groups) skip it and leave a zero
    accumulator, and so does, with ``SKIP_EMPTY_WARP_GROUP``, a consumer warp group whose
    64 rows all lie past a partial tile's valid rows (:func:`skip_stages`).
    """

    def __init__(self, kernel: GroupedGemmFp8BlockSm90, tiled_mma: cute.TiledMma, tiled_mma_half: cute.TiledMma,
                 pipe, sA: cute.Tensor, sB: cute.Tensor, mSA: cute.Tensor, mSB: cute.Tensor):
        self.kernel = kernel
        self.tiled_mma = tiled_mma  # the epilogue reads the accumulator through it
        self.tiled_mma_half = tiled_mma_half
        self.pipe = pipe
        self.sA = sA
        self.sB = sB
        self.mSA = mSA
        self.mSB = mSB
        self.halves = kernel.halves

    def setup(self, ctid):
        """Consumer thread ``ctid``'s operand fragments (B per half), the temporary
        accumulator, which main-accumulator element each temporary element of each half
        adds into, and the accumulator rows; returns the float32 main accumulator."""
        k = self.kernel
        half, full = self.tiled_mma_half, self.tiled_mma
        thr = half.get_slice(ctid)
        self.tCrA = half.make_fragment_A(thr.partition_A(self.sA))
        # sB (tile_n, 128, stages) -> halves of 128 rows (whole 8-row swizzle atoms).
        sB_halves = cute.flat_divide(self.sB, (SCALE_BLOCK, SCALE_BLOCK))  # (128, 128, halves, 1, stages)
        self.tCrB = [half.make_fragment_B(thr.partition_B(sB_halves[None, None, h, 0, None]))
                     for h in range(self.halves)]
        self.acc = cute.make_rmem_tensor(full.get_slice(ctid).partition_C(
            cute.make_identity_tensor((k.tile_m, k.tile_n))).shape, k.acc_dtype)
        half_c = half.get_slice(0).partition_C(cute.make_identity_tensor((k.tile_m, SCALE_BLOCK)))
        self.temp = cute.make_rmem_tensor(half_c.shape, k.acc_dtype)
        # Element maps, read off thread 0's partitions of the identity tensors (every
        # thread's elements sit at its own base plus the same offsets): temp element i of
        # half h adds into acc element dst[h][i], the one at the same row, column + 128 h.
        full_c = full.get_slice(0).partition_C(cute.make_identity_tensor((k.tile_m, k.tile_n)))
        where = {}
        for i in range(cute.size(self.acc)):
            where[(full_c[i][0], full_c[i][1])] = i
        self.dst = []
        for h in range(self.halves):
            m = []
            for i in range(cute.size(self.temp)):
                r, c = half_c[i][0], half_c[i][1]
                if not (isinstance(r, int) and isinstance(c, int)) or (r, c + SCALE_BLOCK * h) not in where:
                    raise TypeError(f"no static accumulator element for temp element {i} of half {h}: {(r, c)}")
                m.append(where[(r, c + SCALE_BLOCK * h)])
            self.dst.append(m)
        if sorted(i for m in self.dst for i in m) != list(range(cute.size(self.acc))):
            raise TypeError("the halves' temporary elements do not cover the accumulator exactly once")
        # The tile rows of this thread's accumulator elements: its first row (run time)
        # plus a per-element offset that is the same for every thread. For the 64 x N
        # wgmma fragment the offsets are 0 and 8.
        r00 = half_c[0][0]
        offsets = []
        self.row_slot = []  # temp element i -> index into ``offsets``
        for i in range(cute.size(self.temp)):
            off = half_c[i][0] - r00
            if off not in offsets:
                offsets.append(off)
            self.row_slot.append(offsets.index(off))
        self.row_offsets = tuple(offsets)
        self.row_base = thr.partition_C(cute.make_identity_tensor((k.tile_m, SCALE_BLOCK)))[0][0]
        # A's scales of the block in flight (per row slot), in registers.
        self.sc = cute.make_rmem_tensor((len(offsets),), cutlass.Float32)
        if cutlass.const_expr(SKIP_EMPTY_WARP_GROUP):
            self.wg_row0 = warp_group_row0(ctid)
        return self.acc

    def _issue(self, tiled_mma: cute.TiledMma, temp: cute.Tensor, tCrB: cute.Tensor, stage) -> cute.TiledMma:
        """:func:`issue_block` with this thread's A fragment."""
        return issue_block(tiled_mma, temp, self.tCrA, tCrB, stage)

    def _load_scales(self, sc: cute.Tensor, rows: list, kb) -> None:
        """A's scales of K block ``kb`` for each of this thread's row slots, into ``sc``."""
        for j, r in enumerate(rows):
            sc[j] = ptx.e8m0_value(Uint32(self.mSA[r, kb]))

    def _promote(self, temp: cute.Tensor, sc: cute.Tensor, sb, h: int) -> None:
        """``acc[half h] += temp * (sa[row] * sb)`` per element (its row slot's scale)."""
        acc, dst = self.acc, self.dst[h]
        scales = [sc[j] * sb for j in range(len(self.row_offsets))]
        for i in range(cute.size(temp)):
            acc[dst[i]] = acc[dst[i]] + temp[i] * scales[self.row_slot[i]]

    @cute.jit
    def tile(self, sched: SegmentTileScheduler, tile, read, release, work: TileWork):
        """The current tile's accumulator; returns the advanced ``(read, release)`` states."""
        self.acc.fill(0.0)
        if sched.seg < sched.group_sizes.shape[0]:  # (k_tiles >= 1: the handler never launches K = 0)
            if cutlass.const_expr(SKIP_EMPTY_WARP_GROUP):
                if self.wg_row0 < tile[1]:
                    read, release = self._blocks(sched, tile, read, release, work, stage_arrivals(tile[1]))
                else:
                    read, release = skip_stages(read, release, work.k_tiles)
            else:
                read, release = self._blocks(sched, tile, read, release, work)
        return read, release

    @cute.jit
    def _blocks(self, sched: SegmentTileScheduler, tile, read, release, work: TileWork, arrivals=None):
        """The tile's K blocks into the accumulator; each slot goes back through
        :func:`release_stage` with ``arrivals``."""
        tiled_mma, pipe, temp, sc = self.tiled_mma_half, self.pipe, self.temp, self.sc
        mSB = self.mSB
        row_off, _, n_tile = tile
        # A-scale rows of this thread (clamped: rows past M are never stored).
        first = sched.row0 + row_off + self.row_base
        last_row = work.m - 1
        rows = [cutlass.min(first + off, last_row) for off in self.row_offsets]
        g = sched.seg
        nb0 = n_tile * self.halves
        last_nb = mSB.shape[1] - 1
        for kb in range(work.k_tiles):
            pipe.consumer_wait(read)
            tiled_mma = self._issue(tiled_mma, temp, self.tCrB[0], read.index)
            self._load_scales(sc, rows, kb)  # while the wgmmas run
            sb = ptx.e8m0_value(Uint32(mSB[g, nb0, kb]))
            cute.nvgpu.warpgroup.wait_group(0)
            if cutlass.const_expr(self.halves == 1):
                release_stage(pipe, release, arrivals)  # (before promoting: the slot is read)
                self._promote(temp, sc, sb, 0)
            else:
                self._promote(temp, sc, sb, 0)
                if nb0 + 1 <= last_nb:
                    tiled_mma = self._issue(tiled_mma, temp, self.tCrB[1], read.index)
                    sb = ptx.e8m0_value(Uint32(mSB[g, nb0 + 1, kb]))
                    cute.nvgpu.warpgroup.wait_group(0)
                    release_stage(pipe, release, arrivals)
                    self._promote(temp, sc, sb, 1)
                else:  # the second half lies wholly past N: nothing to multiply
                    release_stage(pipe, release, arrivals)
            release.advance()
            read.advance()
        return read, release
