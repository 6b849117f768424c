"""Hopper grouped GEMM with the FC1 epilogue: ``h``, and ``a = probs * relu(h)**2`` as MXFP8.

STATUS: GPU-tested on the H200 (tests/test_grouped_gemm_fc1_gpu.py, tools/sanitize_small.py).

``h[m] = A[m] @ B[group(m)]`` exactly as :class:`GroupedGemmSm90` writes it (same
mainloop, same bf16 rounding, same stores), plus, from the same shared-memory subtiles:

  a_row    [M, N] bf16   ``dequantize(quantize_mxfp8(a, axis=1))``: the rowwise MXFP8
                          values of ``a`` in bf16 (FC2's operand; 32-blocks along N)
  a_col    [M, N] E4M3   ``quantize_mxfp8_grouped(a, group_sizes).data``
  a_scale  [cdiv(M, 32) + G, N] E8M0   ``... .scale`` (32-row blocks that never cross a
                          group; block ``b`` of the group layout is scale row ``b``)

with ``a = bf16(probs[:, None] * relu(f32(h))**2)`` (float32 math from the bf16 ``h``,
:func:`ptx.srelu_scaled_bf16x2`), i.e. bit for bit
``mxfp8.fake_quantize_pair(primitives.srelu_scaled(h, probs), group_sizes, keep_col_fp8=True)``.
Rows past ``sum(group_sizes)``: ``h`` zero, ``a_row`` the row quantization of
``bf16(probs * 0)``, ``a_col`` data zero; unused scale rows are zero (the handler clears
``a_scale`` before the launch; the kernel writes only used blocks).

Operands: A ``[M, K]`` bf16, B ``[G, K, N]`` bf16 (N contiguous; fprop only), probs
``[M]`` float32, group_sizes ``[G]`` int32. Everything else (scheduler, producer,
pipeline, register split, TMA store of ``h``) is the bf16 kernel's.

Epilogue, per 128 x 32 subtile (one rowwise block per row; four 32-row column blocks),
after the subtile of ``h`` is staged in shared memory (stmatrix) and the 256 consumer
threads passed the epilogue barrier:
  * ``h``: TMA store (full tiles) or predicated 16-byte stores (partial tiles), as before;
  * row pass: the partial-store mapping (thread = 8 columns of rows ``r``, ``r + 64``;
    4 threads per row): 16-byte shared-memory reads through CuTe's swizzled layout,
    ``a`` in registers, block amax on the integer pipe + 2 shuffles, 16-byte stores
    of the fake-quantized values;
  * column pass: the transposed mapping (a warp = 32 consecutive rows x 8 columns, so a
    warp holds exactly one 32-row block of 8 columns): the same reads, ``a`` again,
    rows past the tile's valid rows masked to zero, amax over the warp (5 butterfly
    shuffles per bf16 pair), 8-byte E4M3 stores per row and one 8-byte scale store per
    warp (lane 0). Tail tiles (rows past the groups) write zero data and no scales.
  * a second barrier (partial tiles too) before the buffer is reused.
The passes only read the staged subtile (the TMA store reads it too), so no extra
shared memory is needed; with the second barrier, the buffer is rewritten two subtiles
later, after every thread has finished both passes over it.

The scale row of a tile's first block is ``seg_blk0 + row_off / 32`` where ``seg_blk0``
(the number of 32-row blocks of all earlier groups, sizes clamped as the scheduler
clamps them) is carried by the consumers' scheduler (``SegmentTileScheduler`` with
``blocks=True``; the producer's does not carry it). Tiles
start at their group's start + a multiple of 128, so each 32-row sub-block of a tile is
one block of the group layout, cut short at the group's end.
"""

from __future__ import annotations

import dataclasses
import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint8, Uint32

from jax_grouped_mlp.kernels import ptx
from jax_grouped_mlp.kernels.grouped_gemm_sm90 import (
    EPI_N, Bf16Mainloop, GroupedGemmConfig, GroupedGemmSm90, StoreEpilogue, StoreTarget, TmaLoad,
)
from jax_grouped_mlp.kernels.tile_scheduler import SegmentTileScheduler

BLOCK = 32  # MXFP8 block
VEC = 8  # elements per thread vector (16 bytes of bf16)


def load_words(src: cute.Tensor) -> list:
    """8 bf16 of a staged subtile (one 16-byte shared-memory read) -> 4 packed words."""
    rv = cute.make_rmem_tensor((VEC,), BFloat16)
    cute.autovec_copy(src, rv)
    rw = cute.recast_tensor(rv, Uint32)
    return [rw[w] for w in range(VEC // 2)]


class Mxfp8EpiloguePasses:
    """The row and column MXFP8 passes over a staged 128 x 32 epilogue subtile, shared by
    the FC1 (:class:`GroupedGemmFc1Sm90`) and FC2-dgrad (``GroupedGemmDgradSm90``)
    epilogues. Mixed into a :class:`GroupedGemmSm90` subclass (uses its ``out_dtype`` and
    ``epi_tile``)."""

    def _col_read_copies(self, sC: cute.Tensor, ctid):
        """The column pass's view of the staged subtile: 16-byte reads, thread ``ctid`` =
        row ``ctid % 64`` (and + 64) x 8 columns ``8 * (ctid // 64)``; a warp is 32
        consecutive rows of one 8-column vector. Returns ``(tCR_sC, tCR_cC)``."""
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype, num_bits_per_copy=128)
        tiled = cute.make_tiled_copy_tv(
            atom, cute.make_ordered_layout((64, EPI_N // VEC), order=(0, 1)), cute.make_layout((1, VEC))
        )
        thr = tiled.get_slice(ctid)
        return thr.partition_S(sC), thr.partition_D(cute.make_identity_tensor(self.epi_tile))

    def _load_words(self, src: cute.Tensor):
        """:func:`load_words`."""
        return load_words(src)

    @cute.jit
    def _row_pass(self, tSG_s, tSG_cC, g_row, p_row, row0, gcol0, rows_valid, cols_valid):
        """Rowwise MXFP8 values for this thread's two 8-column vectors (rows ``r``, ``r + 64``).

        The values are ``a = srelu_scaled(staged, p_row[i])`` (FC1) or, with ``p_row=None``,
        the staged bf16 values themselves (the dgrad kernel stages ``dh``)."""
        for i in cutlass.range_constexpr(cute.size(tSG_cC, mode=[1])):
            r, c = tSG_cC[(0, i, 0)]
            hw = self._load_words(tSG_s[(None, i, 0)])
            aw = hw
            if cutlass.const_expr(p_row is not None):
                aw = [ptx.srelu_scaled_bf16x2(hw[w], p_row[i]) for w in range(VEC // 2)]
            am = ptx.max_u16x2(ptx.max_u16x2(ptx.abs_bf16x2(aw[0]), ptx.abs_bf16x2(aw[1])),
                               ptx.max_u16x2(ptx.abs_bf16x2(aw[2]), ptx.abs_bf16x2(aw[3])))
            am = cutlass.max(am & Uint32(0xFFFF), am >> 16)
            am = am & (Uint32(0) - Uint32(c < cols_valid))  # columns past N: not in any block
            # The 4 threads of a row are 4 consecutive lanes; every lane shuffles.
            am = cutlass.max(am, Uint32(cute.arch.shuffle_sync_bfly(am, offset=1)))
            am = cutlass.max(am, Uint32(cute.arch.shuffle_sync_bfly(am, offset=2)))
            e = ptx.e8m0_rceil(am)
            rs = ptx.e8m0_reciprocal(e)
            vs = ptx.e8m0_value(e)
            o = cute.make_rmem_tensor((1, VEC), BFloat16)
            ow = cute.recast_tensor(o, Uint32)
            for q in cutlass.range_constexpr(VEC // 4):
                lo, hi = ptx.fake_quant_bf16x4(aw[2 * q], aw[2 * q + 1], rs, rs, rs, rs, vs, vs, vs, vs)
                ow[2 * q] = lo
                ow[2 * q + 1] = hi
            if r < rows_valid:
                if c < cols_valid:
                    cute.autovec_copy(o, g_row[(None, (row0 + r, (gcol0 + c) // VEC))])

    @cute.jit
    def _col_pass(self, tCR_s, tCR_cC, g_col, g_scale, p_col, row0, gcol0, rows_valid, cols_valid, in_group,
                  blk0, lane, col_bf16: cutlass.Constexpr = False):
        """Group-aware columnwise MXFP8 of this warp's 32-row block(s) of 8 columns.

        Values as in :meth:`_row_pass` (``p_col=None``: the staged values). ``col_bf16=False``
        (FC1): E4M3 data into ``g_col`` and the E8M0 scales into ``g_scale`` at block row
        ``blk0 + r // 32``; ``col_bf16=True`` (dgrad): the dequantized MXFP8 values in bf16
        into ``g_col`` (``fake_quantize_pair(..., keep_col_fp8=False)``'s column copy), no
        scales (``g_scale``, ``blk0`` unused). Rows past the groups: zeros either way."""
        data_mask = Uint32(0) - Uint32(in_group)  # rows past the groups: data 0, no scales
        for i in cutlass.range_constexpr(cute.size(tCR_cC, mode=[1])):
            r, c = tCR_cC[(0, i, 0)]
            hw = self._load_words(tCR_s[(None, i, 0)])
            row_mask = Uint32(0) - Uint32(r < rows_valid)  # rows past the tile's group: zero
            if cutlass.const_expr(p_col is None):
                aw = [hw[w] & row_mask for w in range(VEC // 2)]
            else:
                aw = [ptx.srelu_scaled_bf16x2(hw[w], p_col[i]) & row_mask for w in range(VEC // 2)]
            cm = [ptx.abs_bf16x2(aw[w]) for w in range(VEC // 2)]
            for w in cutlass.range_constexpr(VEC // 2):
                for s in cutlass.range_constexpr(5):  # the warp's 32 rows: one block
                    cm[w] = ptx.max_u16x2(cm[w], Uint32(cute.arch.shuffle_sync_bfly(cm[w], offset=1 << s)))
            if cutlass.const_expr(col_bf16):
                # Four columns at a time (fewer live scale values than the FP8 path's order).
                ob = cute.make_rmem_tensor((1, VEC), BFloat16)
                obw = cute.recast_tensor(ob, Uint32)
                for q in cutlass.range_constexpr(VEC // 4):
                    eq = [ptx.e8m0_rceil((cm[j // 2] >> (16 * (j % 2))) & Uint32(0xFFFF))
                          for j in range(4 * q, 4 * q + 4)]
                    lo, hi = ptx.fake_quant_bf16x4(aw[2 * q], aw[2 * q + 1], *[ptx.e8m0_reciprocal(e) for e in eq],
                                                   *[ptx.e8m0_value(e) for e in eq])
                    obw[2 * q] = data_mask & lo
                    obw[2 * q + 1] = data_mask & hi
                if r < rows_valid:
                    if c < cols_valid:
                        cute.autovec_copy(ob, g_col[(None, (row0 + r, (gcol0 + c) // VEC))])
            else:
                ecol = []
                rcol = []
                for j in cutlass.range_constexpr(VEC):
                    ej = ptx.e8m0_rceil((cm[j // 2] >> (16 * (j % 2))) & Uint32(0xFFFF))
                    ecol.append(ej)
                    rcol.append(ptx.e8m0_reciprocal(ej))
                oc = cute.make_rmem_tensor((1, VEC), Uint8)
                ocw = cute.recast_tensor(oc, Uint32)
                for q in cutlass.range_constexpr(VEC // 4):
                    ocw[q] = data_mask & ptx.encode_e4m3x4(aw[2 * q], aw[2 * q + 1], *rcol[4 * q: 4 * q + 4])
                if r < rows_valid:
                    if c < cols_valid:
                        cute.autovec_copy(oc, g_col[(None, (row0 + r, (gcol0 + c) // VEC))])
                blk = r // BLOCK  # the tile's block (0..3); the warp's rows are one block
                if in_group:
                    if lane == 0:
                        if blk * BLOCK < rows_valid:
                            if c < cols_valid:
                                os_ = cute.make_rmem_tensor((1, VEC), Uint8)
                                for j in cutlass.range_constexpr(VEC):
                                    os_[j] = Uint8(ecol[j])
                                cute.autovec_copy(os_, g_scale[(None, (blk0 + blk, (gcol0 + c) // VEC))])


class GroupedGemmFc1Sm90(Mxfp8EpiloguePasses, GroupedGemmSm90):
    """The bf16 grouped GEMM with the FC1 epilogue; see the module docstring."""

    def __init__(self, config: GroupedGemmConfig):
        if not config.fc1_epilogue or config.b_k_major:
            raise ValueError(f"GroupedGemmFc1Sm90 needs fc1_epilogue=True with bf16 [G, K, N] B, got {config}")
        super().__init__(config)

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (M, K) bf16, K contiguous
        b: cute.Tensor,  # (N, K, G) bf16, N contiguous (JAX's [G, K, N])
        out: cute.Tensor,  # (M, N) bf16: h
        a_row: cute.Tensor,  # (M, N) bf16: rowwise MXFP8 values of a
        a_col: cute.Tensor,  # (M, N) uint8: E4M3 data of the group-aware columnwise copy
        a_scale: cute.Tensor,  # (NB, N) uint8: its E8M0 scales, NB = cdiv(M, 32) + G
        probs: cute.Tensor,  # (M,) float32
        group_sizes: cute.Tensor,  # (G,) int32
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        tma, smem_layouts = self._prepare(a, b, out)
        v = (1, VEC)
        self.kernel_fc1(
            *tma, out, cute.zipped_divide(a_row, v), cute.zipped_divide(a_col, v), cute.zipped_divide(a_scale, v),
            probs, group_sizes, self.tiled_mma, *smem_layouts,
        ).launch(
            grid=(num_ctas, 1, 1),
            block=(self.threads, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---- the epilogue ----

    @cute.jit
    def _load_probs(self, mProbs: cute.Tensor, coords, row0: Int32, rows_valid: Int32):
        """``probs`` of this thread's two rows in ``coords`` (tile-relative); 0 past the valid rows."""
        ps = []
        for i in cutlass.range_constexpr(cute.size(coords, mode=[1])):
            r, _ = coords[(0, i, 0)]
            p = Float32(0.0)
            if r < rows_valid:
                p = Float32(mProbs[row0 + r])
            ps.append(p)
        return ps

    @cute.kernel
    def kernel_fc1(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,  # TMA coordinate tensor (M, K)
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,  # TMA coordinate tensor (N, K, G)
        tma_atom_out: cute.CopyAtom,
        mOutTma: cute.Tensor,  # TMA coordinate tensor (M, N)
        mOut: cute.Tensor,  # (M, N) bf16
        g_row: cute.Tensor,  # ((1, 8), (M, N / 8)) bf16
        g_col: cute.Tensor,  # ((1, 8), (M, N / 8)) uint8
        g_scale: cute.Tensor,  # ((1, 8), (NB, N / 8)) uint8
        mProbs: cute.Tensor,  # (M,) float32
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
                Bf16Mainloop(self, tiled_mma, pipe, sA, sB),
                Fc1Epilogue(self, StoreTarget(sC, tma_atom_out, mOutTma, mOut), cta.warp_idx,
                            Fc1Outputs(g_row, g_col, g_scale, mProbs)),
                work, cta.tidx - 128,
            )


@dataclasses.dataclass(frozen=True)
class Fc1Outputs:
    """The FC1 epilogue's extra operands: ``a``'s rowwise values (``g_row``), columnwise
    E4M3 data (``g_col``) and E8M0 scales (``g_scale``), all viewed as 8-element vectors
    ``((1, 8), (rows, N / 8))``, and ``probs`` ``(M,)``."""

    g_row: cute.Tensor
    g_col: cute.Tensor
    g_scale: cute.Tensor
    probs: cute.Tensor


class Fc1Epilogue(StoreEpilogue):
    """``h`` as :class:`StoreEpilogue` stores it, plus the MXFP8 row and column passes of
    ``a = probs * relu(h)**2`` over each staged subtile (:class:`Mxfp8EpiloguePasses`).
    Its scheduler counts MXFP8 blocks (the scale row of a tile's first block)."""

    blocks = True

    def __init__(self, kernel: GroupedGemmFc1Sm90, out: StoreTarget, warp_idx, extra: Fc1Outputs):
        super().__init__(kernel, out, warp_idx)
        self.extra = extra

    def setup(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, ctid):
        super().setup(tiled_mma, acc, ctid)
        self.lane = ctid % 32
        self.col_read = self.kernel._col_read_copies(self.out.sC, ctid)

    @cute.jit
    def store_tile(self, sched: SegmentTileScheduler, tile, epi_count):
        """``h`` as :class:`StoreEpilogue` stores it (TMA for full tiles, predicated 16-byte
        stores for partial ones), then per subtile the row and column passes of ``a`` from
        the same staged shared-memory subtile. Returns the new subtile count."""
        row_off, rows_valid, n_tile = tile
        extra = self.extra
        row0 = sched.row0 + row_off
        col0 = n_tile * self.kernel.tile_n
        p_row = self.kernel._load_probs(extra.probs, self.s2g[3], row0, rows_valid)
        p_col = self.kernel._load_probs(extra.probs, self.col_read[1], row0, rows_valid)
        in_group = sched.seg < sched.group_sizes.shape[0]
        blk0 = sched.blk0 + row_off // BLOCK
        passes = functools.partial(self._passes, (p_row, p_col, row0, rows_valid, in_group, blk0))
        return self._store_subtiles(row0, rows_valid, col0, n_tile, epi_count, passes)

    @cute.jit
    def _passes(self, tile_args, e: int, buf, tSG_s, gcol0, cols_valid):
        """The row and column passes over staged subtile ``e`` (buffer ``buf``)."""
        p_row, p_col, row0, rows_valid, in_group, blk0 = tile_args
        extra = self.extra
        tCR_sC, tCR_cC = self.col_read
        self.kernel._row_pass(tSG_s, self.s2g[3], extra.g_row, p_row, row0, gcol0, rows_valid, cols_valid)
        self.kernel._col_pass(
            tCR_sC[(None, None, None, buf)], tCR_cC, extra.g_col, extra.g_scale, p_col, row0, gcol0, rows_valid,
            cols_valid, in_group, blk0, self.lane,
        )
