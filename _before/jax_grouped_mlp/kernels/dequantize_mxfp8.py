"""Dequantization of a group-aware columnwise MXFP8 ``[M, K]`` tensor to bf16.

    out = dequantize(MXFP8Tensor(data, scale, axis=0, group_sizes=group_sizes))

bit for bit (rows past ``sum(group_sizes)`` are zero). This is how a kept FP8
residual ("fc1_input", "fc2_input") becomes the bf16 operand of a weight-gradient
GEMM: one read of the FP8 bytes and one write, where XLA's version gathers a scale
row per token row and ran at about a third of the memory bandwidth.

Same work split and block walk as :class:`GroupBlockKernel` (CTA ``b`` owns
columnwise block ``b`` of the group layout, ``vec * threads`` columns; each thread
reads the block's ``vec`` scales once and then ``vec`` bytes per row).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Uint8, Uint32

from jax_grouped_mlp.kernels import ptx
from jax_grouped_mlp.kernels.group_blocks import BLOCK, GroupBlockConfig, GroupBlockKernel


class DequantizeConfig(GroupBlockConfig):
    """:class:`GroupBlockConfig` (``vec`` columns per thread: 8-byte loads of E4M3 at 8)."""

    @property
    def name(self) -> str:
        return f"dequantize_mxfp8_col_v{self.vec}_t{self.threads}" + (
            f"_b{self.min_blocks}" if self.min_blocks else ""
        )


class DequantizeColMxfp8(GroupBlockKernel):
    """Group-aware columnwise MXFP8 -> bf16; see the module doc."""

    @cute.jit
    def __call__(
        self,
        data: cute.Tensor,  # [M, K] uint8 (E4M3)
        scale: cute.Tensor,  # [cdiv(M, 32) + G, K] uint8 (E8M0)
        group_sizes: cute.Tensor,  # [G] int32
        out: cute.Tensor,  # [M, K] bf16
        stream: cuda.CUstream,
    ):
        tile = (1, self.vec)
        gd = cute.zipped_divide(data, tile)
        self.dequantize_kernel(
            gd, cute.zipped_divide(scale, tile), group_sizes, cute.zipped_divide(out, tile), data.shape[0]
        ).launch(
            grid=(scale.shape[0], cute.ceil_div(gd.shape[1][1], self.threads), 1),
            block=(self.threads, 1, 1),
            stream=stream,
            max_number_threads=[self.threads, 1, 1],
            min_blocks_per_mp=self.config.min_blocks,
            preferred_smem_carveout=0,
        )

    @cute.kernel
    def dequantize_kernel(
        self,
        g_data: cute.Tensor,  # ((1, vec), (M, K / vec))
        g_scale: cute.Tensor,  # ((1, vec), (NB, K / vec))
        group_sizes: cute.Tensor,
        g_out: cute.Tensor,  # ((1, vec), (M, K / vec)) bf16
        m: Int32,
    ):
        vec = self.vec
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        b = Int32(bidx)
        row0, nrows, in_group = self._locate_block(group_sizes, b, m)
        mask = Uint32(0) - Uint32(in_group)  # rows past the groups: zeros

        chunk = bidy * self.threads + tidx
        valid = chunk < g_data.shape[1][1]
        sc = cute.make_rmem_tensor((1, vec), Uint8)
        sc.fill(0)
        if valid:
            cute.autovec_copy(g_scale[(None, (b, chunk))], sc)
        v = [ptx.e8m0_value(Uint32(sc[j])) for j in range(vec)]

        # Every row's load is issued before the first store: a store may alias a later load
        # as far as the compiler knows, so interleaving them leaves one load in flight.
        rows = []
        for r in cutlass.range_constexpr(BLOCK):
            d = cute.make_rmem_tensor((1, vec), Uint8)
            d.fill(0)
            if valid:
                if r < nrows:
                    cute.autovec_copy(g_data[(None, (row0 + r, chunk))], d)
            rows.append(cute.recast_tensor(d, Uint32))
        for r in cutlass.range_constexpr(BLOCK):
            if valid:
                if r < nrows:
                    dw = rows[r]
                    o = cute.make_rmem_tensor((1, vec), BFloat16)
                    ow = cute.recast_tensor(o, Uint32)
                    for q in cutlass.range_constexpr(vec // 4):
                        lo, hi = ptx.dequant_e4m3x4_bf16(dw[q], *v[4 * q: 4 * q + 4])
                        ow[2 * q] = lo & mask
                        ow[2 * q + 1] = hi & mask
                    cute.autovec_copy(o, g_out[(None, (row0 + r, chunk))])
