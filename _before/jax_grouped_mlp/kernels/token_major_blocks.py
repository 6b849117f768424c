"""A group-aware FP8 ``[M, K]`` copy laid out token-major in whole 128-token blocks.

The FP8 weight gradient (:mod:`grouped_wgrad_fp8_block_sm90`) reads its operands K-major,
where K is the token axis: ``out [K, P]`` with ``P = 128 * NB``, ``NB = cdiv(M, 128) + G``
group-aware blocks (numbered as the quantizer numbers its scale rows,
:meth:`~jax_grouped_mlp.kernels.group_blocks.GroupBlockKernel._locate_block`): block ``b``'s
rows, in order, are columns ``[128 b, 128 b + 128)`` of ``out``, zero past the block's
rows; unused blocks (the rows past ``sum(group_sizes)``) are all zero. The same bytes as
``formats.fp8_block.token_major_blocks`` (an XLA gather and transpose, several times
slower on the H200). GPU test: tests/test_grouped_wgrad_fp8_block_gpu.py.

CTA ``(b, kb)`` transposes the 128 x 128 byte tile of block ``b`` and column block ``kb``
through shared memory (:mod:`byte_tile`): eight lanes load a row's 16-byte chunks (a
warp: four whole 128-byte row segments; zeros past the block's rows), then
:func:`byte_tile.store_transposed` writes tile column ``c`` as row ``128 kb + c`` of
``out``, columns ``[128 b, 128 b + 128)``. Every element of ``out`` is written exactly
once; ``K % 16 == 0`` (whole 16-byte chunks).
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32

from jax_grouped_mlp.kernels import byte_tile
from jax_grouped_mlp.kernels.group_blocks import GroupBlockConfig, GroupBlockKernel

BLOCK = 128
CHUNK = 16  # bytes per vector load/store
CHUNKS = BLOCK // CHUNK


@dataclasses.dataclass(frozen=True)
class TokenMajorBlocksConfig(GroupBlockConfig):
    """128 threads, one per row (then per column) of a 128 x 128 byte tile."""

    vec: int = 8
    threads: int = 128

    def __post_init__(self):
        super().__post_init__()
        if self.threads != BLOCK:
            raise ValueError(f"threads must be {BLOCK} (one per row of a tile), got {self.threads=}")

    @property
    def name(self) -> str:
        return f"token_major_blocks_t{self.threads}"


class TokenMajorBlocks(GroupBlockKernel):
    """See the module doc."""

    block_rows = BLOCK
    row_block_cols = BLOCK

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,  # [M, K] uint8 (E4M3 bytes), K % 16 == 0
        group_sizes: cute.Tensor,  # [G] int32
        out: cute.Tensor,  # [K, 128 * (cdiv(M, 128) + G)] uint8
        stream: cuda.CUstream,
    ):
        tile = (1, CHUNK)
        gx = cute.zipped_divide(x, tile)
        gout = cute.zipped_divide(out, tile)
        m = x.shape[0]
        num_blocks = (m + (BLOCK - 1)) // BLOCK + group_sizes.shape[0]
        self.kernel(gx, group_sizes, gout, m).launch(
            grid=(num_blocks, cute.ceil_div(gx.shape[1][1], CHUNKS), 1),
            block=(self.threads, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        gx: cute.Tensor,  # ((1, 16), (M, K / 16)) uint8
        group_sizes: cute.Tensor,
        gout: cute.Tensor,  # ((1, 16), (K, P / 16)) uint8
        m: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        b = Int32(bidx)
        kb = Int32(bidy)
        t = Int32(tidx)
        row0, nrows, in_group = self._locate_block(group_sizes, b, m)
        n_chunks = gx.shape[1][1]  # K / 16
        smem = cutlass.utils.SmemAllocator()
        tile = byte_tile.allocate(smem)
        pieces = cute.zipped_divide(tile, (CHUNK // 4, 1))  # 16-byte chunks of rows

        # ---- the block's rows into shared memory: 8 lanes a row (16-byte chunks), all
        # loads issued before the first store ----
        q = t % CHUNKS
        chunk = kb * CHUNKS + q
        vals = []
        for i in cutlass.range_constexpr(BLOCK * CHUNKS // self.threads):
            r = (self.threads // CHUNKS) * i + t // CHUNKS
            v = cute.make_rmem_tensor((CHUNK // 4, 1), Uint32)
            v.fill(0)
            if r < nrows:
                if in_group != 0:
                    if chunk < n_chunks:
                        cute.autovec_copy(cute.recast_tensor(gx[(None, (row0 + r, chunk))], Uint32), v)
            vals.append(v)
        for i in cutlass.range_constexpr(BLOCK * CHUNKS // self.threads):
            r = (self.threads // CHUNKS) * i + t // CHUNKS
            cute.autovec_copy(vals[i], pieces[(None, ((4 * q ^ byte_tile.swizzle(r)) // 4, r))])
        cute.arch.sync_threads()

        # ---- column c of the tile as row 128 kb + c of out, block b's chunks ----
        byte_tile.store_transposed(tile, gout, kb * BLOCK, n_chunks * CHUNK - kb * BLOCK, b * CHUNKS, BLOCK,
                                   gout.shape[1][1])
