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
through 16 KB of shared memory: thread ``t`` loads row ``t`` (eight 16-byte loads; zeros
past the block's rows), stores it with its 16-byte chunks XOR-swizzled by ``t % 8`` (so
eight threads' stores hit distinct banks), then gathers column ``t`` byte by byte (a
warp reads two chunks of one row at a time: no conflicts) and writes it as eight 16-byte
stores into row ``128 kb + t`` of ``out``. Every element of ``out`` is written exactly
once; ``K % 16 == 0`` (whole 16-byte chunks).
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint8

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
        # (byte, chunk, row): row r's chunk q at its swizzled place q ^ (r % 8).
        tile = smem.allocate_tensor(Uint8, cute.make_layout((CHUNK, CHUNKS, BLOCK), stride=(1, CHUNK, BLOCK)), 16)

        # ---- row t of the block into shared memory ----
        for q in cutlass.range_constexpr(CHUNKS):
            v = cute.make_rmem_tensor((1, CHUNK), Uint8)
            v.fill(0)
            chunk = kb * CHUNKS + q
            if t < nrows:
                if in_group != 0:
                    if chunk < n_chunks:
                        cute.autovec_copy(gx[(None, (row0 + t, chunk))], v)
            cute.autovec_copy(v, tile[(None, q ^ (t % 8), t)])
        cute.arch.sync_threads()

        # ---- column t of the tile as row 128 kb + t of out ----
        col = kb * BLOCK + t
        if col // CHUNK < n_chunks:
            byte, q = t % CHUNK, t // CHUNK
            for j in cutlass.range_constexpr(CHUNKS):
                v = cute.make_rmem_tensor((1, CHUNK), Uint8)
                for i in cutlass.range_constexpr(CHUNK):
                    r = j * CHUNK + i
                    v[i] = tile[byte, q ^ (r % 8), r]
                cute.autovec_copy(v, gout[(None, (col, b * CHUNKS + j))])
