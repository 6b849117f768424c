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
block (one pipeline stage: 4 wgmmas of K = 32) is multiplied into a *temporary*
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
CTA-uniform byte of ``sb``. They are loaded right after the block's wgmmas are issued
and arrive while those run. Row indices are clamped to ``M - 1``: a tile's rows past M
(zero-filled by TMA, never stored) read a valid scale.

Per K block a warp group issues its wgmmas, then waits for them (``wait_group(0)``)
before promoting: one warp group's promotion overlaps the other's wgmmas, not its own.
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
from cutlass import Int32, Uint32

from jax_grouped_mlp.kernels import ptx

from jax_grouped_mlp.kernels.grouped_gemm_sm90 import (
    EPI_N, SMEM_CAPACITY, GroupedGemmSm90, StoreEpilogue, StoreTarget, TmaLoad,
)
from jax_grouped_mlp.kernels.tile_scheduler import SegmentTileScheduler, TileWork, TraceTimeObject

SCALE_BLOCK = 128  # K (and N, for B) per scale: one pipeline stage


@dataclasses.dataclass(frozen=True)
class Fp8BlockGemmConfig:
    """Compile-time knobs of :class:`GroupedGemmFp8BlockSm90`.

    tile_n: output columns per CTA tile (128: one B scale per tile and K block; each
      accumulator takes 64 registers per thread).
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
        if self.tile_n != SCALE_BLOCK:
            raise ValueError(f"tile_n must be {SCALE_BLOCK} (one B scale block per tile), got {self.tile_n=}")
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
        self.kernel_fp8(*tma, out, sa, sb, group_sizes, self.tiled_mma, *smem_layouts).launch(
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
        tiled_mma: cute.TiledMma,
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
                Fp8BlockMainloop(self, tiled_mma, pipe, sA, sB, mSA, mSB),
                StoreEpilogue(self, StoreTarget(sC, tma_atom_out, mOutTma, mOut), cta.warp_idx),
                work, cta.tidx - 128,
            )


class Fp8BlockMainloop(TraceTimeObject):
    """FP8 wgmma with per-128-K promotion into the float32 accumulator (module docstring).

    Per K block (one pipeline stage): wgmma fence, the stage's 4 wgmmas into a temporary
    accumulator (the first with ACCUMULATE off), commit; the block's scales from global
    memory; wait for the wgmmas; hand the slot back to the producer;
    ``acc += temp * (sa[row] * sb)``. Tail tiles (rows past the groups)
    skip it and leave a zero accumulator.
    """

    def __init__(self, kernel: GroupedGemmFp8BlockSm90, tiled_mma: cute.TiledMma, pipe, sA: cute.Tensor,
                 sB: cute.Tensor, mSA: cute.Tensor, mSB: cute.Tensor):
        self.kernel = kernel
        self.tiled_mma = tiled_mma
        self.pipe = pipe
        self.sA = sA
        self.sB = sB
        self.mSA = mSA
        self.mSB = mSB

    def setup(self, ctid):
        """Consumer thread ``ctid``'s operand fragments, the temporary accumulator and the
        accumulator rows; returns the float32 main accumulator."""
        k = self.kernel
        self.tCrA, self.tCrB, self.acc = k._mma_fragments(self.tiled_mma, self.sA, self.sB, ctid)
        self.temp = cute.make_rmem_tensor(self.acc.layout, k.acc_dtype)
        # The tile rows of this thread's accumulator elements: its first row (run time)
        # plus a per-element offset that is the same for every thread (trace time, read off
        # thread 0's partition of the identity tensor). For the 64 x N wgmma fragment the
        # offsets are 0 and 8.
        ident = cute.make_identity_tensor((k.tile_m, k.tile_n))
        c_thr = self.tiled_mma.get_slice(ctid).partition_C(ident)
        c_0 = self.tiled_mma.get_slice(0).partition_C(ident)
        r00 = c_0[0][0]
        offsets = []
        self.row_slot = []  # element i -> index into ``offsets``
        for i in range(cute.size(self.acc)):
            off = c_0[i][0] - r00
            if not isinstance(off, int):
                raise TypeError(f"the accumulator's row offsets must be static, got {off!r} for element {i}")
            if off not in offsets:
                offsets.append(off)
            self.row_slot.append(offsets.index(off))
        self.row_offsets = tuple(offsets)
        self.row_base = c_thr[0][0]  # this thread's first accumulator row in the tile
        # The scales of the block in flight (per row slot), in registers.
        self.sc = cute.make_rmem_tensor((len(offsets),), cutlass.Float32)
        return self.acc

    def _issue(self, tiled_mma: cute.TiledMma, temp: cute.Tensor, stage) -> cute.TiledMma:
        """Block ``stage``'s wgmmas into ``temp`` (the first overwrites it), committed.

        Returns ``tiled_mma``, whose ACCUMULATE field this sets: the caller rebinds its
        local to it, so the DSL carries the changed value out of loops and branches."""
        tCrA, tCrB = self.tCrA, self.tCrB
        cute.nvgpu.warpgroup.fence()  # temp was read by its last promotion
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        for kk in range(cute.size(tCrA, mode=[2])):
            c = (None, None, kk, stage)
            cute.gemm(tiled_mma, temp, tCrA[c], tCrB[c], temp)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()
        return tiled_mma

    def _load_scales(self, sc: cute.Tensor, rows: list, g, n_tile, kb) -> None:
        """``sa[row] * sb`` of K block ``kb`` for each of this thread's row slots, into ``sc``."""
        sb = ptx.e8m0_value(Uint32(self.mSB[g, n_tile, kb]))
        for j, r in enumerate(rows):
            sc[j] = ptx.e8m0_value(Uint32(self.mSA[r, kb])) * sb

    def _promote(self, temp: cute.Tensor, sc: cute.Tensor) -> None:
        """``acc += temp * scale`` per element (its row slot's scale)."""
        acc = self.acc
        for i in range(cute.size(acc)):
            acc[i] = acc[i] + temp[i] * sc[self.row_slot[i]]

    @cute.jit
    def tile(self, sched: SegmentTileScheduler, tile, read, release, work: TileWork):
        """The current tile's accumulator; returns the advanced ``(read, release)`` states."""
        tiled_mma, pipe, acc, temp = self.tiled_mma, self.pipe, self.acc, self.temp
        k_tiles = work.k_tiles
        acc.fill(0.0)
        if sched.seg < sched.group_sizes.shape[0]:  # (k_tiles >= 1: the handler never launches K = 0)
            row_off, _, n_tile = tile
            # A-scale rows of this thread (clamped: rows past M are never stored).
            first = sched.row0 + row_off + self.row_base
            last_row = work.m - 1
            rows = [cutlass.min(first + off, last_row) for off in self.row_offsets]
            g = sched.seg
            sc = self.sc
            for kb in range(k_tiles):
                pipe.consumer_wait(read)
                tiled_mma = self._issue(tiled_mma, temp, read.index)
                self._load_scales(sc, rows, g, n_tile, kb)  # while the wgmmas run
                cute.nvgpu.warpgroup.wait_group(0)
                pipe.consumer_release(release)
                release.advance()
                read.advance()
                self._promote(temp, sc)
        return read, release
