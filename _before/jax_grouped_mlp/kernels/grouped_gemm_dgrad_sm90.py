"""Hopper grouped GEMM with the FC2-dgrad (dSReLU) epilogue: ``dh`` as MXFP8 and ``dprobs`` partials.

STATUS: GPU-tested on the H200 (tests/test_grouped_gemm_dgrad_gpu.py, tools/sanitize_small.py); used by the MXFP8 backward.

``da[m] = dy[m] @ w2[group(m)]^T`` exactly as the plain K-major (``_bk``) kernel computes
it (same mainloop, same tile width, same fp32 -> bf16 rounding), but ``da`` never goes to
global memory. From each staged 128 x 32 subtile of bf16 ``da`` the epilogue writes

  dh_row   [M, N] bf16   ``dequantize(quantize_mxfp8(dh, axis=1))`` (32-blocks along N)
  dh_col   [M, N] bf16   ``dequantize(quantize_mxfp8_grouped(dh, group_sizes))`` (32-row
                          blocks restarting at each group's start), i.e. together
                          ``mxfp8.fake_quantize_pair(dh, group_sizes, keep_col_fp8=False)``
  dpart    [cdiv(N, tile_n), M] float32   per column tile, per row: ``sum da * relu(h)**2``
                          over the tile's columns (the binding sums the tiles in order)

with, in float32 from the bf16 ``da`` and the bf16 residual ``h`` (``[M, N]``, read from
global memory): ``r = max(h, 0)``, ``dh = bf16((da * (2 * probs)) * r)`` (``mlp._mlp_bwd``'s
operation order, so ``dh`` is bitwise the reference's), ``dprobs`` terms ``da * (r * r)``
(:func:`ptx.dsrelu_scaled_bf16x2`). Rows past ``sum(group_sizes)``: ``dh_row``, ``dh_col``
and the partials are +0 (nothing of ``h`` or ``probs`` is read there). Every output
element is written, so the handler clears nothing.

Operands: dy ``[M, K]`` bf16, w2 ``[G, N, K]`` bf16 (K contiguous, the ``_bk`` layout: the
FC2 weight ``[G, F, H]`` as stored, K = H, N = F), h ``[M, N]`` bf16, probs ``[M]``
float32, group_sizes ``[G]`` int32. Scheduler, producer, pipeline and register split are
the bf16 kernel's; no TMA store (``out`` is only the staging layout).

Epilogue, per 128 x 32 subtile, after the stmatrix staging of ``da`` and the epilogue
barrier (256 consumer threads):
  * dSReLU pass (the partial-store mapping: thread = 8 columns of rows ``r``, ``r + 64``):
    16-byte shared-memory reads of ``da``, 16-byte global loads of ``h`` (predicated: the
    tile's valid rows, columns < N, in-group tiles only), ``dh`` written back in place
    (each thread rewrites exactly the 16 bytes it read); the subtile's ``dprobs`` terms
    summed per row (order below) into the row's running sum in registers;
  * the row pass of :class:`Mxfp8EpiloguePasses` on the staged ``dh`` (same mapping, the
    thread's own bytes: no barrier needed in between);
  * a barrier (every thread's ``dh`` is in shared memory);
  * the column pass on the staged ``dh`` (transposed mapping; a warp = one 32-row block of
    8 columns), bf16 output mode.
The next subtile stages into the other buffer; a buffer is rewritten two subtiles later,
after both barriers of the subtile in between, so all its readers are done.
``dprobs`` order (fixed, so reproducible bit for bit; no atomics): per subtile, each thread
sums its 8 columns in order, the row's 4 lanes combine theirs with 2 butterfly shuffles
(``(s0 + s1) + (s2 + s3)`` on every lane), and that is added to the row's running sum;
after the tile's subtiles the lane with column 0 stores it.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32

from jax_grouped_mlp.kernels import ptx
from jax_grouped_mlp.kernels.grouped_gemm_fc1_sm90 import VEC, Mxfp8EpiloguePasses
from jax_grouped_mlp.kernels.grouped_gemm_sm90 import (
    EPI_N, Bf16Mainloop, GroupedGemmConfig, GroupedGemmSm90, StoreEpilogue, StoreTarget, TmaLoad,
)
from jax_grouped_mlp.kernels.tile_scheduler import SegmentTileScheduler


class GroupedGemmDgradSm90(Mxfp8EpiloguePasses, GroupedGemmSm90):
    """The bf16 K-major grouped GEMM with the FC2-dgrad epilogue; see the module docstring."""

    def __init__(self, config: GroupedGemmConfig):
        if not config.dgrad_epilogue:
            raise ValueError(f"GroupedGemmDgradSm90 needs dgrad_epilogue=True (K-major bf16 B), got {config}")
        super().__init__(config)

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (M, K) bf16, K contiguous: dy
        b: cute.Tensor,  # (N, K, G) bf16, K contiguous (JAX's [G, N, K]): w2
        h: cute.Tensor,  # (M, N) bf16: the activation_input residual
        dh_row: cute.Tensor,  # (M, N) bf16: rowwise MXFP8 values of dh
        dh_col: cute.Tensor,  # (M, N) bf16: group-aware columnwise MXFP8 values of dh
        dpart: cute.Tensor,  # (cdiv(N, tile_n), M) float32: dprobs partials
        probs: cute.Tensor,  # (M,) float32
        group_sizes: cute.Tensor,  # (G,) int32
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        # h stands in for the (never written) da: same dtype, shape and layout.
        tma, smem_layouts = self._prepare(a, b, h, store_out=False)
        v = (1, VEC)
        self.kernel_dgrad(
            *tma, h, cute.zipped_divide(h, v), cute.zipped_divide(dh_row, v), cute.zipped_divide(dh_col, v),
            dpart, probs, group_sizes, self.tiled_mma, *smem_layouts,
        ).launch(
            grid=(num_ctas, 1, 1),
            block=(self.threads, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---- the epilogue ----

    @cute.jit
    def _load_probs2(self, mProbs: cute.Tensor, coords, row0: Int32, rows_valid: Int32, in_group):
        """``2 * probs`` of this thread's two rows (exact); 0 past the valid rows and in tail tiles."""
        ps = []
        for i in cutlass.range_constexpr(cute.size(coords, mode=[1])):
            r, _ = coords[(0, i, 0)]
            p = Float32(0.0)
            if in_group:
                if r < rows_valid:
                    p = Float32(mProbs[row0 + r]) * Float32(2.0)
            ps.append(p)
        return ps

    @cute.jit
    def _dsrelu_pass(self, tSG_s, tSG_cC, g_h, p2, dp, row0, gcol0, rows_valid, cols_valid, in_group):
        """``dh`` from the staged ``da`` and ``h`` (global), written back over ``da``; returns
        the rows' ``dprobs`` sums ``dp`` with this subtile's 8 columns added."""
        dp_out = []
        for i in cutlass.range_constexpr(cute.size(tSG_cC, mode=[1])):
            r, c = tSG_cC[(0, i, 0)]
            hv = cute.make_rmem_tensor((1, VEC), BFloat16)
            hvw = cute.recast_tensor(hv, Uint32)
            for w in cutlass.range_constexpr(VEC // 2):
                hvw[w] = Uint32(0)
            if in_group:
                if r < rows_valid:
                    if c < cols_valid:
                        cute.autovec_copy(g_h[(None, (row0 + r, (gcol0 + c) // VEC))], hv)
            dw = self._load_words(tSG_s[(None, i, 0)])
            o = cute.make_rmem_tensor((1, VEC), BFloat16)
            ow = cute.recast_tensor(o, Uint32)
            # dprobs: this thread's 8 columns in order, then the row's 4 lanes (butterfly:
            # every lane gets the same (s0 + s1) + (s2 + s3)), added to the row's sum.
            # Reducing per subtile (not once per tile) keeps ptxas from deferring the
            # products to the end of the tile, which spilled their inputs (n256).
            s = Float32(0.0)
            for w in cutlass.range_constexpr(VEC // 2):
                d, s = ptx.dsrelu_scaled_bf16x2(dw[w], hvw[w], p2[i], s)
                ow[w] = d
            s = s + Float32(cute.arch.shuffle_sync_bfly(s, offset=1))
            s = s + Float32(cute.arch.shuffle_sync_bfly(s, offset=2))
            acc = dp[i] + s
            cute.autovec_copy(o, tSG_s[(None, i, 0)])
            dp_out.append(acc)
        return dp_out

    @cute.kernel
    def kernel_dgrad(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,  # TMA coordinate tensor (M, K)
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,  # TMA coordinate tensor (N, K, G)
        mH: cute.Tensor,  # (M, N) bf16
        g_h: cute.Tensor,  # ((1, 8), (M, N / 8)) bf16
        g_row: cute.Tensor,  # ((1, 8), (M, N / 8)) bf16
        g_col: cute.Tensor,  # ((1, 8), (M, N / 8)) bf16
        mPart: cute.Tensor,  # (cdiv(N, tile_n), M) float32
        mProbs: cute.Tensor,  # (M,) float32
        group_sizes: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        epi_smem: cute.ComposedLayout,
    ):
        cta = self._kernel_start((tma_atom_a, tma_atom_b))
        pipe, sA, sB, sC, warp_group, work = self._setup_and_produce(
            TmaLoad(tma_atom_a, mA), TmaLoad(tma_atom_b, mB), mH, group_sizes, (a_smem, b_smem, epi_smem), cta
        )
        if warp_group != 0:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self._consumer(
                Bf16Mainloop(self, tiled_mma, pipe, sA, sB),
                DgradEpilogue(
                    self, StoreTarget(sC, None, None, mH), cta.warp_idx, DgradOutputs(g_h, g_row, g_col, mPart, mProbs)
                ),
                work, cta.tidx - 128,
            )


@dataclasses.dataclass(frozen=True)
class DgradOutputs:
    """The dgrad epilogue's extra operands, the bf16 ones viewed as 8-element vectors
    ``((1, 8), (M, N / 8))``: the residual ``h`` (``g_h``), ``dh``'s rowwise and columnwise
    MXFP8 values (``g_row``, ``g_col``), the ``dprobs`` partials ``(cdiv(N, tile_n), M)``
    and ``probs`` ``(M,)``."""

    g_h: cute.Tensor
    g_row: cute.Tensor
    g_col: cute.Tensor
    part: cute.Tensor
    probs: cute.Tensor


class DgradEpilogue(StoreEpilogue):
    """``da`` staged as :class:`StoreEpilogue` stages it but never stored: the dSReLU pass
    turns it into ``dh`` in shared memory, then its MXFP8 row and column passes and the
    ``dprobs`` partials (:meth:`GroupedGemmDgradSm90._dsrelu_pass`, :class:`Mxfp8EpiloguePasses`). No TMA store,
    so nothing to wait for at the end."""

    def __init__(self, kernel: GroupedGemmDgradSm90, out: StoreTarget, warp_idx, extra: DgradOutputs):
        super().__init__(kernel, out, warp_idx)
        self.extra = extra

    def setup(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, ctid):
        super().setup(tiled_mma, acc, ctid)  # (the staging's TMA-store pipeline stays unused)
        self.lane = ctid % 32
        self.col_read = self.kernel._col_read_copies(self.out.sC, ctid)

    @cute.jit
    def store_tile(self, sched: SegmentTileScheduler, tile, epi_count):
        """The tile's epilogue (see the module docstring). Returns the new subtile count."""
        row_off, rows_valid, n_tile = tile
        extra, lane = self.extra, self.lane
        row0 = sched.row0 + row_off
        col0 = n_tile * self.kernel.tile_n
        in_group = sched.seg < sched.group_sizes.shape[0]
        p2 = self.kernel._load_probs2(extra.probs, self.s2g[3], row0, rows_valid, in_group)
        n = self.out.mOut.shape[1]
        mPart = extra.part
        _, _, tSG_sC, tSG_cC = self.s2g
        tCR_sC, tCR_cC = self.col_read
        epi_num = self.kernel.tile_n // EPI_N
        dp = [Float32(0.0) for _ in range(cute.size(tSG_cC, mode=[1]))]
        for e in cutlass.range_constexpr(epi_num):
            buf = self.kernel._stage_subtile(self.epi, e, epi_count)  # da, rounded as the plain kernel does
            self.kernel.epi_barrier.arrive_and_wait()
            gcol0 = col0 + e * EPI_N
            cols_valid = n - gcol0
            tSG_s = tSG_sC[(None, None, None, buf)]
            dp = self.kernel._dsrelu_pass(
                tSG_s, tSG_cC, extra.g_h, p2, dp, row0, gcol0, rows_valid, cols_valid, in_group
            )
            self.kernel._row_pass(tSG_s, tSG_cC, extra.g_row, None, row0, gcol0, rows_valid, cols_valid)
            # Every thread's dh is in shared memory before the column pass reads across threads.
            self.kernel.epi_barrier.arrive_and_wait()
            self.kernel._col_pass(
                tCR_sC[(None, None, None, buf)], tCR_cC, extra.g_col, None, None, row0, gcol0, rows_valid,
                cols_valid, in_group, None, lane, col_bf16=True,
            )
        # dprobs partials (every lane of a row holds the row's sum): the lane with column 0 stores.
        for i in cutlass.range_constexpr(cute.size(tSG_cC, mode=[1])):
            r, c = tSG_cC[(0, i, 0)]
            if c == 0:
                if r < rows_valid:
                    mPart[(n_tile, row0 + r)] = dp[i]
        return epi_count + epi_num

    def finish(self):
        pass
