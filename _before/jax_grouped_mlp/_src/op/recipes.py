"""Recipes: how each GEMM operand is prepared (MXFP8-quantized, or plain bf16).

The MLP's forward and backward are written once against this interface; a recipe
decides what an operand *is*. ``row`` prepares an operand blocked along a feature
axis (the reduction axis of a fprop/dgrad GEMM); ``row_and_col`` also returns the
"col" copy of a token-major ``[M, K]`` operand for a weight-gradient GEMM, blocked
along the token axis in group-aware 32-row blocks; ``weight`` prepares stacked
expert weights for either use.

The GEMM kernels multiply bf16, so an MXFP8 operand that is used at once arrives as
its MXFP8 values in bf16 (exact: E4M3 times a power of two fits bf16), written by
the quantizer in the same pass, with no FP8 copy and no dequantization pass. Only a
copy that is *kept* for the backward pass (``row_and_col(..., keep_col=True)``: the
residuals "fc1_input" and "fc2_input") stays an FP8 :class:`MXFP8Tensor`, half
the bytes.

``fp8_block`` (DeepSeek-V3-style FP8 with 128-blocks, :mod:`formats.fp8_block`)
prepares every operand as an FP8 :class:`FP8BlockTensor` (1 x 128 blocks along K for
activations, 128 x 128 tiles for weights, group-aware 128-row blocks for the
weight-gradient operands): the form the Hopper FP8 wgmma kernel reads. On CUDA the
forward GEMMs and data gradients run on it (promotion into float32 every 128 of K) and
the weight gradients on the FP8 weight-gradient kernel (promotion every 128 tokens), or,
with ``KernelChoices(fp8_block_wgrad=False)``, on the bf16 kernel over the exactly
dequantized operands (``gemm_ffi.grouped_gemm_cuda``, ``grouped_wgrad_cuda``); elsewhere
the GEMM primitives multiply the dequantized values with float32 accumulation.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from jax_grouped_mlp._src import checks
from jax_grouped_mlp._src.op import primitives
from jax_grouped_mlp._src.op.primitives import Operand


class Recipe(str, enum.Enum):
    MXFP8 = "mxfp8"
    BF16 = "bf16"
    FP8_BLOCK = "fp8_block"

    @classmethod
    def parse(cls, value: "str | Recipe") -> "Recipe":
        return checks.parse_enum(cls, value, "recipe")

    def row(self, x: jax.Array, axis: int) -> Operand:
        """``x`` as a GEMM operand blocked along ``axis``: its MXFP8 values in bf16, or
        an :class:`FP8BlockTensor` with 1 x 128 blocks for ``fp8_block``."""
        if self is Recipe.FP8_BLOCK:
            return primitives.fp8_block_quantize(x, axis)
        if self is Recipe.MXFP8:
            return primitives.fake_quantize(x, axis)
        return x.astype(jnp.bfloat16)

    def weight(self, w: jax.Array, reduce_axis: int) -> Operand:
        """A ``[G, A, B]`` weight prepared as a grouped GEMM's rhs reducing over ``reduce_axis``.

        ``reduce_axis=1`` is the fprop use (K = A); ``reduce_axis=2`` the dgrad use
        (K = B): the result stays ``[G, A, B]`` as stored, for
        ``grouped_gemm(..., transpose_rhs=True)``.

        MXFP8 weights are never kept (they are not residuals), and the GEMM kernels
        multiply bf16, so they come as their MXFP8 values in bf16 (``fake_quantize``:
        one pass, no FP8 copy and no separate dequantization; same numbers).

        ``fp8_block`` weights are 128 x 128 tiles over ``(A, B)``, whichever the
        ``reduce_axis``: the tile is square, so fprop and dgrad read the same copy.
        """
        if self is Recipe.FP8_BLOCK:
            return primitives.fp8_block_weight(w)
        if self is Recipe.MXFP8:
            return primitives.fake_quantize(w, reduce_axis)
        return w.astype(jnp.bfloat16)

    def fprop_weight_k_major(self, w: jax.Array) -> Operand | None:
        """``w [G, A, B]`` as a forward GEMM (K = A) reads it, stored transposed ``[G, B, A]``
        for ``grouped_gemm(..., transpose_rhs=True)``, when this recipe's GEMM wants it
        K-major: ``fp8_block`` (Hopper's FP8 wgmma reads both operands K-major; the
        quantizer writes the transposed tiles itself, so no call transposes them).
        None for the others (:meth:`weight` with ``reduce_axis=1`` serves). The same
        numbers either way."""
        if self is Recipe.FP8_BLOCK:
            return primitives.fp8_block_weight(w, k_major=True)
        return None

    @property
    def wgrad_reads_fp8(self) -> bool:
        """Whether the weight gradients can multiply the FP8 copies themselves
        (``fp8_block``: the FP8 weight-gradient kernel, when ``KernelChoices.fp8_block_wgrad``
        asks for it), so the backward's dy and dh columns may stay FP8
        (``row_and_col(..., keep_col=True)``) rather than coming as bf16 values."""
        return self is Recipe.FP8_BLOCK

    def row_and_col(
        self, x: jax.Array, group_sizes: jax.Array, *, keep_col: bool, token_major: bool = False
    ) -> tuple[Operand, Operand]:
        """``(row(x, 1), col)`` for ``[M, K]``, col blocked along tokens; one pass on CUDA.

        ``keep_col``: col is a residual, so it stays FP8 (an :class:`MXFP8Tensor`, or an
        :class:`FP8BlockTensor` in group-aware 128-row blocks for ``fp8_block``);
        otherwise it is used at once and comes as its bf16 values (what the bf16
        weight-gradient kernel reads). ``fp8_block``'s row is an :class:`FP8BlockTensor`.

        ``token_major`` (with ``keep_col``; ``fp8_block`` only): col is read by the FP8
        weight gradient alone, so it comes laid out as that kernel reads it
        (``fp8_block.TokenMajorBlocks``, written by the quantizer itself on CUDA): the
        backward's dy and dh. Not for residuals (the offload planner counts the ``[M,
        K]`` layout's bytes).
        """
        if self is Recipe.FP8_BLOCK:
            if keep_col and token_major:
                return primitives.fp8_block_pair_token_major(x, group_sizes)
            return primitives.fp8_block_pair(x, group_sizes, keep_col=keep_col)
        if self is Recipe.MXFP8:
            return primitives.fake_quantize_pair(x, group_sizes, keep_col_fp8=keep_col)
        x = x.astype(jnp.bfloat16)
        return x, x
