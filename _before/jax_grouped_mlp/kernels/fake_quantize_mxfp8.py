"""One-pass MXFP8 fake quantization of a bf16 ``[M, K]`` tensor: the MXFP8 values, in bf16.

Modes (``rq = dequantize(quantize_mxfp8(x, axis=1))``,
``cq = quantize_mxfp8_grouped(x, group_sizes)``), bit for bit:

  "row"       out = rq                                  (one bf16 output)
  "col"       out = dequantize(cq)                      (one bf16 output)
  "rowcol"    (rq, dequantize(cq), cq.scale)            both GEMM operands of a
                                                        transient tensor (dy, dh)
  "row_colq"  (rq, cq.data, cq.scale)                   the fprop operand, and the FP8
                                                        copy a weight gradient keeps (x, a)

This is what a bf16-MMA GEMM consumes (DESIGN.md's strategy 2): writing the
dequantized values directly saves materializing an FP8 copy and a separate
dequantization pass (for a Nano-sized weight: 1.9 GB + 1.9 GB of traffic -> 2.6 GB;
for an activation that needs both copies, one read instead of three).
Rows past ``sum(group_sizes)`` are quantized rowwise, and are zero in every
columnwise output (as the grouped tensor's dequantization gives).

Same work split, block walk and register layout as :class:`GroupBlockKernel` (CTA
``b`` owns columnwise block ``b`` of the group layout and ``vec * threads`` columns;
each thread holds ``vec`` columns of the block's 32 rows), so each element is read
once and each output written once.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Uint8, Uint32

from jax_grouped_mlp.kernels import ptx
from jax_grouped_mlp.kernels.group_blocks import BLOCK, GroupBlockConfig, GroupBlockKernel

MODES = ("row", "col", "rowcol", "row_colq")
PAIR_MODES = ("rowcol", "row_colq")  # three outputs: FakeQuantizePairMxfp8


@dataclasses.dataclass(frozen=True)
class FakeQuantizeConfig(GroupBlockConfig):
    """:class:`GroupBlockConfig` plus ``mode`` (see the module doc): "row" (32-blocks along
    K), "col" (group-aware 32-row blocks along M), or both at once ("rowcol",
    "row_colq")."""

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


class FakeQuantizeMxfp8(GroupBlockKernel):
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
        g_out = cute.zipped_divide(out, tile)
        # One output: it stands in for the unused ones (never touched in these modes).
        self._launch(cute.zipped_divide(x, tile), group_sizes, g_out, g_out, g_out, m, stream)

    @cute.jit
    def _launch(self, gx, group_sizes, g_row, g_col, g_col_scale, m, stream):
        num_blocks = (m + (BLOCK - 1)) // BLOCK + group_sizes.shape[0]
        self.fake_kernel(gx, group_sizes, g_row, g_col, g_col_scale, m).launch(
            grid=(num_blocks, cute.ceil_div(gx.shape[1][1], self.threads), 1),
            block=(self.threads, 1, 1),
            stream=stream,
            max_number_threads=[self.threads, 1, 1],
            min_blocks_per_mp=self.config.min_blocks,
            preferred_smem_carveout=0,
        )

    @cute.kernel
    def fake_kernel(
        self,
        gx: cute.Tensor,  # ((1, vec), (M, K / vec)) bf16
        group_sizes: cute.Tensor,
        g_row: cute.Tensor,  # rowwise bf16 output (modes with a row output)
        g_col: cute.Tensor,  # columnwise output: bf16 values, or E4M3 bytes ("row_colq")
        g_col_scale: cute.Tensor,  # ((1, vec), (NB, K / vec)) E8M0 bytes (pair modes)
        m: Int32,
    ):
        vec = self.vec
        words = vec // 2
        mode = self.config.mode
        want_row = mode != "col"
        col_kind = {"row": "", "col": "bf16", "rowcol": "bf16", "row_colq": "fp8"}[mode]
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

        # Columnwise outputs of rows past the groups are zeros (all-zero bit mask).
        col_mask = Uint32(0) - Uint32(in_group)
        ecol = []
        rcol = []
        vcol = []
        if cutlass.const_expr(col_kind != ""):
            cmax = [ax[0][w] for w in range(words)]
            for r in cutlass.range_constexpr(1, BLOCK):
                for w in cutlass.range_constexpr(words):
                    cmax[w] = ptx.max_u16x2(cmax[w], ax[r][w])
            for j in cutlass.range_constexpr(vec):
                e = ptx.e8m0_rceil((cmax[j // 2] >> (16 * (j % 2))) & Uint32(0xFFFF))
                ecol.append(e)
                rcol.append(ptx.e8m0_reciprocal(e))
                if cutlass.const_expr(col_kind == "bf16"):
                    vcol.append(ptx.e8m0_value(e))

        for r in cutlass.range_constexpr(BLOCK):
            rs = []
            vs = []
            if cutlass.const_expr(want_row):
                # The shuffles run on every lane; only the stores are predicated.
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
                    row = row0 + r
                    if cutlass.const_expr(want_row):
                        self._store_fake(rx[r], rs, vs, Uint32(0xFFFFFFFF), g_row[(None, (row, chunk))])
                    if cutlass.const_expr(col_kind == "bf16"):
                        self._store_fake(rx[r], rcol, vcol, col_mask, g_col[(None, (row, chunk))])
                    if cutlass.const_expr(col_kind == "fp8"):
                        oc = cute.make_rmem_tensor((1, vec), Uint8)
                        ocw = cute.recast_tensor(oc, Uint32)
                        for q in cutlass.range_constexpr(vec // 4):
                            ocw[q] = col_mask & ptx.encode_e4m3x4(rx[r][2 * q], rx[r][2 * q + 1], *rcol[4 * q: 4 * q + 4])
                        cute.autovec_copy(oc, g_col[(None, (row, chunk))])
        if cutlass.const_expr(mode in PAIR_MODES):
            if valid:
                out_scale = cute.make_rmem_tensor((1, vec), Uint8)
                for j in cutlass.range_constexpr(vec):
                    out_scale[j] = Uint8(ecol[j] & col_mask)
                cute.autovec_copy(out_scale, g_col_scale[(None, (b, chunk))])

    def _store_fake(self, words_in, rs, vs, mask, dst: cute.Tensor) -> None:
        """Stores ``vec`` bf16 (as ``vec // 2`` words) as their MXFP8 values: reciprocal
        scales ``rs``, scales ``vs`` per column, output bits ANDed with ``mask``."""
        o = cute.make_rmem_tensor((1, self.vec), BFloat16)
        ow = cute.recast_tensor(o, Uint32)
        for q in range(self.vec // 4):  # plain Python: unrolled while tracing
            lo, hi = ptx.fake_quant_bf16x4(
                words_in[2 * q], words_in[2 * q + 1], *rs[4 * q: 4 * q + 4], *vs[4 * q: 4 * q + 4]
            )
            ow[2 * q] = lo & mask
            ow[2 * q + 1] = hi & mask
        cute.autovec_copy(o, dst)


class FakeQuantizePairMxfp8(FakeQuantizeMxfp8):
    """Modes "rowcol" and "row_colq": three outputs from one read (see the module doc)."""

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,  # [M, K] bf16
        group_sizes: cute.Tensor,  # [G] int32
        out_row: cute.Tensor,  # [M, K] bf16
        out_col: cute.Tensor,  # [M, K] bf16 ("rowcol") or uint8 E4M3 ("row_colq")
        col_scale: cute.Tensor,  # [cdiv(M, 32) + G, K] uint8 E8M0
        stream: cuda.CUstream,
    ):
        tile = (1, self.vec)
        self._launch(
            cute.zipped_divide(x, tile), group_sizes, cute.zipped_divide(out_row, tile),
            cute.zipped_divide(out_col, tile), cute.zipped_divide(col_scale, tile), x.shape[0], stream,
        )
