"""One-pass MXFP8 fake quantization of a bf16 ``[M, K]`` tensor: the MXFP8 values, in bf16.

    out = dequantize(quantize_mxfp8(x, axis=1))              (mode "row")
    out = dequantize(quantize_mxfp8_grouped(x, group_sizes))  (mode "col")

bit for bit. This is what a bf16-MMA GEMM consumes (DESIGN.md's strategy 2): writing
the dequantized values directly saves materializing the FP8 copy and a separate
dequantization pass (for a Nano-sized weight: 1.9 GB + 1.9 GB of traffic -> 2.6 GB).
Rows past ``sum(group_sizes)`` are quantized rowwise in mode "row" and are zero in
mode "col" (as the grouped tensor's dequantization gives).

Same work split, block walk and register layout as :class:`QuantizeMxfp8` (CTA
``b`` owns columnwise block ``b`` of the group layout and ``vec * threads`` columns;
each thread holds ``vec`` columns of the block's 32 rows), so each element is read
once and written once.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Uint32

from jax_grouped_mlp.kernels import ptx
from jax_grouped_mlp.kernels.quantize_mxfp8 import BLOCK, QuantizeConfig, QuantizeMxfp8

MODES = ("row", "col")


@dataclasses.dataclass(frozen=True)
class FakeQuantizeConfig(QuantizeConfig):
    """:class:`QuantizeConfig` plus the blocking: ``mode`` "row" (32-blocks along K) or
    "col" (group-aware 32-row blocks along M)."""

    mode: str = "row"

    def __post_init__(self):
        super().__post_init__()
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode=}")

    @property
    def name(self) -> str:
        return f"fake_quantize_mxfp8_{self.mode}_v{self.vec}_t{self.threads}" + (
            f"_b{self.min_blocks}" if self.min_blocks else ""
        )


class FakeQuantizeMxfp8(QuantizeMxfp8):
    """bf16 -> bf16 MXFP8 values, rowwise or group-aware columnwise; see module doc."""

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,  # [M, K] bf16
        group_sizes: cute.Tensor,  # [G] int32
        out: cute.Tensor,  # [M, K] bf16
        stream: cuda.CUstream,
    ):
        tile = (1, self.vec)
        m = x.shape[0]
        num_blocks = (m + (BLOCK - 1)) // BLOCK + group_sizes.shape[0]
        self.fake_kernel(cute.zipped_divide(x, tile), group_sizes, cute.zipped_divide(out, tile), m).launch(
            grid=(num_blocks, cute.ceil_div(x.shape[1], self.vec * self.threads), 1),
            block=(self.threads, 1, 1),
            stream=stream,
            max_number_threads=[self.threads, 1, 1],
            min_blocks_per_mp=self.config.min_blocks,
            preferred_smem_carveout=0,
        )

    @cute.kernel
    def fake_kernel(self, gx: cute.Tensor, group_sizes: cute.Tensor, g_out: cute.Tensor, m: Int32):
        vec = self.vec
        words = vec // 2
        rowwise = self.config.mode == "row"
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        b = Int32(bidx)
        row0, nrows, in_group = self._locate_block(group_sizes, b, m)

        n_chunks = gx.shape[1][1]
        chunk = bidy * self.threads + tidx
        valid = chunk < n_chunks

        rx = []
        for r in cutlass.range_constexpr(BLOCK):
            t = cute.make_rmem_tensor((1, vec), BFloat16)
            t.fill(0.0)
            if valid:
                if r < nrows:
                    cute.autovec_copy(gx[(None, (row0 + r, chunk))], t)
            rx.append(cute.recast_tensor(t, Uint32))
        ax = [[ptx.abs_bf16x2(rx[r][w]) for w in range(words)] for r in range(BLOCK)]

        # Columnwise: rows past the groups are written as zeros (all-zero bit mask).
        out_mask = Uint32(0xFFFFFFFF) if cutlass.const_expr(rowwise) else Uint32(0) - Uint32(in_group)
        rcol = []
        vcol = []
        if cutlass.const_expr(not rowwise):
            cmax = [ax[0][w] for w in range(words)]
            for r in cutlass.range_constexpr(1, BLOCK):
                for w in cutlass.range_constexpr(words):
                    cmax[w] = ptx.max_u16x2(cmax[w], ax[r][w])
            for j in cutlass.range_constexpr(vec):
                e = ptx.e8m0_rceil((cmax[j // 2] >> (16 * (j % 2))) & Uint32(0xFFFF))
                rcol.append(ptx.e8m0_reciprocal(e))
                vcol.append(ptx.e8m0_value(e))

        for r in cutlass.range_constexpr(BLOCK):
            rs = rcol
            vs = vcol
            if cutlass.const_expr(rowwise):
                a = ax[r][0]
                for w in cutlass.range_constexpr(1, words):
                    a = ptx.max_u16x2(a, ax[r][w])
                a = cutlass.max(a & Uint32(0xFFFF), a >> 16)
                off = 1
                while off < self.lanes_per_block:
                    a = cutlass.max(a, Uint32(cute.arch.shuffle_sync_bfly(a, offset=off)))
                    off *= 2
                e = ptx.e8m0_rceil(a)
                rs = [ptx.e8m0_reciprocal(e)] * vec
                vs = [ptx.e8m0_value(e)] * vec
            if valid:
                if r < nrows:
                    o = cute.make_rmem_tensor((1, vec), BFloat16)
                    ow = cute.recast_tensor(o, Uint32)
                    for q in cutlass.range_constexpr(vec // 4):
                        lo, hi = ptx.fake_quant_bf16x4(
                            rx[r][2 * q], rx[r][2 * q + 1], *rs[4 * q: 4 * q + 4], *vs[4 * q: 4 * q + 4]
                        )
                        ow[2 * q] = lo & out_mask
                        ow[2 * q + 1] = hi & out_mask
                    cute.autovec_copy(o, g_out[(None, (row0 + r, chunk))])
