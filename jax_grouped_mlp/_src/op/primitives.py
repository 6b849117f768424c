"""The operations the MLP is built from, each dispatched per platform.

Every operation has a pure-JAX reference (used on every platform) and may have a
CUDA implementation (an XLA FFI custom call around an AOT-compiled kernel). A CUDA
implementation is plugged in with :func:`register_cuda_impl`; from then on the
operation lowers through ``jax.lax.platform_dependent``: the custom call when the
computation is lowered for CUDA, the reference everywhere else. Both
implementations take and return exactly the same pytrees.

This module is the dispatcher and owns the fallback: a CUDA implementation that
cannot take a problem raises ``ffi.Unsupported`` while it is traced, and the CUDA
branch then runs the operation's fallback (:data:`_FALLBACK`: the reference, or for
the fused and weight-quantizing GEMMs the composition of the plain primitives, which
dispatch again). The bindings never call back into this module. The CUDA branch is
traced on every platform (``platform_dependent`` traces all branches, also when
lowering for CPU), so the exception never escapes it.

Operands of the GEMMs are either :class:`MXFP8Tensor` or plain float arrays (the
``bf16`` recipe); the reference dequantizes MXFP8 operands to bfloat16, which is
exact (E4M3 times a power of two fits bf16), and multiplies in bf16 with float32
accumulation: the same arithmetic a bf16-MMA kernel does.

Operands of the ``fp8_block`` recipe are :class:`FP8BlockTensor` (FP8 data and
128-block scales, never bf16 values: the Hopper FP8 kernel reads those). Only
``grouped_gemm`` and ``grouped_wgrad`` take them on CUDA (:data:`_FP8_BLOCK_CUDA`: the
FP8 block-scaled GEMM, which promotes its partial sums into float32 every 128 of K, and
the FP8 weight-gradient kernel, or the bf16 one on the exactly dequantized values for
the pairs the op asks so or the FP8 kernel cannot take); :func:`_dispatch` sends any
other primitive with such an operand to the reference on every platform. The reference
dequantizes them (exact) and multiplies with float32 accumulation throughout. The
recipe's quantizers :func:`fp8_block_pair` (an activation's two copies) and
:func:`fp8_block_weight` (a weight's 128 x 128 tiles) are one kernel each on CUDA for
bf16 input (``cuda/fp8_block_ffi.py``), the pure-JAX quantizers elsewhere; :func:`fp8_block_quantize`
(1 x 128 blocks alone) is the kernel's rowwise mode for ``[M, K]`` along K, else pure JAX.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Literal, Union

import jax
import jax.custom_batching
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src import groups, varying, warn
from jax_grouped_mlp._src.cuda import devices
from jax_grouped_mlp._src.cuda.ffi import Unsupported
from jax_grouped_mlp._src.formats import fp8_block, mxfp8
from jax_grouped_mlp._src.op import reference
from jax_grouped_mlp._src.op.activation import srelu_scaled, srelu_scaled_grad
from jax_grouped_mlp._src.formats.fp8_block import FP8BlockTensor, TokenMajorBlocks
from jax_grouped_mlp._src.formats.mxfp8 import MXFP8Tensor

Operand = Union[MXFP8Tensor, FP8BlockTensor, TokenMajorBlocks, jax.Array]
# The quantized operand types (a pytree of data, scale and maybe group sizes).
QUANTIZED = (MXFP8Tensor, FP8BlockTensor, TokenMajorBlocks)
OpName = Literal[
    "quantize", "fake_quantize", "quantize_both", "fake_quantize_pair", "grouped_gemm", "grouped_gemm_qw",
    "grouped_wgrad", "fc1_fused", "dgrad_fused", "fp8_block_pair", "fp8_block_pair_tm", "fp8_block_weight",
    "fp8_block_row", "fp8_block_fc1",
]

_CUDA_IMPLS: dict[str, Callable] = {}


def register_cuda_impl(name: OpName, fn: Callable) -> None:
    """Makes ``fn`` (same signature and outputs as the reference) the CUDA lowering of ``name``."""
    if name not in _REFERENCE:
        raise ValueError(f"unknown primitive {name=}; expected one of {sorted(_REFERENCE)}")
    _CUDA_IMPLS[name] = fn


def cuda_impl(name: OpName) -> Callable | None:
    return _CUDA_IMPLS.get(name)


@functools.cache
def _warn_reference_on_gpu() -> None:
    """Once per process, where CUDA devices are present but no CUDA implementation is
    registered (the extension is not built, or not importable): every primitive then runs
    its pure-JAX reference, correct but many times slower, which is otherwise silent."""
    if devices.cuda_devices():
        warn.warn(
            "jax_grouped_mlp: CUDA devices are present but its CUDA extension is not loaded, so every "
            "operation runs its pure-JAX reference (correct, many times slower). backend_info() says why; "
            "docs/troubleshooting.md says what to do.", RuntimeWarning)


def _dispatch(name: OpName, *args, **static):
    if not _CUDA_IMPLS:
        _warn_reference_on_gpu()
    ref = _REFERENCE[name]
    own = name in _CUDA_IMPLS or (name in COMPOSED and bool(_CUDA_IMPLS))
    if not own or (_has_fp8_block(args) and name not in _FP8_BLOCK_CUDA):
        return ref(*args, **static)
    kw = tuple(sorted(static.items()))
    # Under shard_map(check_vma=True) both branches must return the same types: an FFI
    # call's outputs vary over no mesh axis, the reference's over its operands' axes.
    axes = varying.union(args)
    return jax.lax.platform_dependent(
        *args,
        cuda=lambda *a: varying.to_common(_cuda_branch(name, kw, *varying.to_common(a, axes)), axes),
        default=lambda *a: varying.to_common(ref(*a, **static), axes),
    )


# The primitives that on CUDA, where the build has no kernel of their own, run as the
# composition of other primitives (``_FALLBACK``: each a kernel where the build has one)
# rather than their pure-JAX reference GEMM (the same numbers up to float32 sum order).
COMPOSED = frozenset({"grouped_gemm_qw", "fc1_fused", "dgrad_fused"})

# The primitives whose CUDA implementation takes FP8BlockTensor operands (the FP8
# block-scaled GEMM and weight gradient, or the bf16 kernels on the exactly dequantized
# values); the others
# run their reference on such operands on every platform.
_FP8_BLOCK_CUDA = frozenset({"grouped_gemm", "grouped_wgrad", "fp8_block_fc1"})


def _has_fp8_block(args) -> bool:
    return any(isinstance(a, (FP8BlockTensor, TokenMajorBlocks)) for a in args)


# Which argument is the group sizes that a primitive's group-aware MXFP8 outputs carry.
_GROUP_SIZES_ARG = {"quantize_both": 1, "fake_quantize_pair": 1, "fc1_fused": 2, "fp8_block_pair": 1,
                    "fp8_block_pair_tm": 1, "fp8_block_fc1": 2}


def _cuda_branch(name: OpName, static: tuple, *args):
    """The CUDA implementation, differentiable and batchable (:func:`_kernel`), or the
    operation's fallback (:data:`_FALLBACK`) when the implementation raises
    ``Unsupported`` at trace time or the build has none (a :data:`COMPOSED` primitive).

    The group sizes of a group-aware output are passed through outside the wrapper, as
    the unwrapped implementations do, so that ``platform_dependent`` still sees them
    forwarded from its operands in both branches (and does not make them an output).
    """
    try:
        devices.check_kernels_run_here()
        if name not in _CUDA_IMPLS:  # (COMPOSED, without a kernel of its own in this build)
            raise Unsupported(f"this build of the extension has no kernel for {name}")
        out = _kernel(name, static, *args)
    except Unsupported:
        out = _FALLBACK[name](*args, **dict(static))
    if name not in _GROUP_SIZES_ARG:
        return out
    return _with_group_sizes(out, args[_GROUP_SIZES_ARG[name]])


def _with_group_sizes(out, group_sizes: jax.Array):
    """``out`` with its group-aware MXFP8 tensors carrying ``group_sizes`` (as int32)
    itself: what a custom_jvp / custom_vmap wrapper returned is no longer visibly the
    operand, and a ``cond`` (``platform_dependent``) would then return it as an output,
    which a remat policy cannot save (so it recomputes the whole primitive)."""
    gs = group_sizes.astype(jnp.int32)
    return jax.tree.map(
        lambda t: dataclasses.replace(t, group_sizes=gs) if isinstance(t, QUANTIZED) and t.is_grouped else t,
        out, is_leaf=lambda t: isinstance(t, QUANTIZED),
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _kernel(name: OpName, static: tuple, *args):
    """The CUDA implementation of ``name``, with the reference's derivative and a batching rule.

    The FFI custom calls have neither a derivative nor a batching rule, and
    ``platform_dependent`` differentiates and batches both of its branches, so without
    these anything that differentiates a primitive (grad of the MLP's backward,
    ``jax.hessian``) or vmaps one would fail whenever the extension is built, even on
    CPU. The derivative (:func:`_reference_jvp`) is the reference's; under ``vmap`` the
    kernel runs once per batch element (:func:`_sequential_kernel`). A first-order
    gradient never differentiates a primitive (the MLP's ``custom_vjp`` rules call
    them), and these wrappers lower to nothing, so the program is the same there.
    """
    return _sequential_kernel(name, static)(*args)


@_kernel.defjvp
def _reference_jvp(name: OpName, static: tuple, primals, tangents):
    """Primal from the kernel, tangent from the reference's derivative (the one the
    reference path has, so every path differentiates alike)."""
    out = _kernel(name, static, *primals)
    ref = functools.partial(_REFERENCE[name], **dict(static))
    _, tangent = jax.jvp(ref, primals, tangents)
    return out, tangent


def _sequential_kernel(name: OpName, static: tuple) -> Callable:
    """The CUDA implementation of ``name``; under ``vmap``, once per batch element
    (``lax.map``; a nested ``vmap`` nests the loops)."""
    cuda = functools.partial(_CUDA_IMPLS[name], **dict(static))

    @jax.custom_batching.custom_vmap
    def call(*args):
        return cuda(*args)

    @call.def_vmap
    def _batched(axis_size, in_batched, *args):
        leaves, tree = jax.tree.flatten(args)
        flags = jax.tree.leaves(in_batched)
        assert len(flags) == len(leaves), (name, in_batched)

        def one(batched_leaves):
            it = iter(batched_leaves)
            return call(*jax.tree.unflatten(tree, [next(it) if b else x for x, b in zip(leaves, flags)]))

        out = jax.lax.map(one, [x for x, b in zip(leaves, flags) if b])
        return out, jax.tree.map(lambda _: True, out)

    return call


def _as_bf16(x: Operand, name: str = "x") -> jax.Array:
    if isinstance(x, MXFP8Tensor):
        return mxfp8.dequantize(x, jnp.bfloat16)
    if isinstance(x, FP8BlockTensor):
        return fp8_block.dequantize_fp8_block(x, jnp.bfloat16)
    if isinstance(x, TokenMajorBlocks):
        return fp8_block.dequantize_fp8_block(fp8_block.from_token_major(x, name), jnp.bfloat16)
    return x.astype(jnp.bfloat16)


def _ref_grouped_gemm(
    lhs: Operand, rhs: Operand, group_sizes: jax.Array, *, out_dtype, transpose_rhs: bool = False
) -> jax.Array:
    b = _as_bf16(rhs)
    if transpose_rhs:
        b = jnp.swapaxes(b, 1, 2)
    return reference.ragged_matmul(_as_bf16(lhs), b, group_sizes, out_dtype=out_dtype)


def _ref_grouped_gemm_qw(
    lhs: Operand, w: jax.Array, group_sizes: jax.Array, *, out_dtype, transpose_rhs: bool = False
) -> jax.Array:
    wq = _ref_fake_quantize(w, axis=2 if transpose_rhs else 1)
    return _ref_grouped_gemm(lhs, wq, group_sizes, out_dtype=out_dtype, transpose_rhs=transpose_rhs)


def _ref_grouped_wgrad(lhs: Operand, rhs: Operand, group_sizes: jax.Array, *, out_dtype, with_token: bool = False):
    out = reference.ragged_transpose_matmul(
        _as_bf16(lhs, "lhs"), _as_bf16(rhs, "rhs"), group_sizes, out_dtype=out_dtype
    )
    return reference.with_order_token(out) if with_token else out


# The reference quantizers are differentiated straight-through (quantization is the
# identity in the derivative, as the MLP's own backward treats it), not through their
# arithmetic: that would round every tangent to FP8 (NaN past the block's range)
# and give nonsense second derivatives. A tangent of an FP8 operand is still FP8
# (JAX's tangent of a float8 array has its dtype): ``x_dot`` in units of the
# primal's block scale, rounded to E4M3. The MLP keeps FP8 copies only for the
# weight gradients' operands.


def _ref_quantize(x: jax.Array, *, axis: int) -> MXFP8Tensor:
    return _st_quantize(x, axis)


def _ref_fake_quantize(x: jax.Array, *, axis: int) -> jax.Array:
    return _st_fake_quantize(x, axis)


def _ref_quantize_both(x: jax.Array, group_sizes: jax.Array) -> tuple[MXFP8Tensor, MXFP8Tensor]:
    return _with_group_sizes(_st_quantize_both(x, group_sizes), group_sizes)


def _ref_fake_quantize_pair(x: jax.Array, group_sizes: jax.Array, *, keep_col_fp8: bool):
    return _with_group_sizes(_st_fake_quantize_pair(x, group_sizes, keep_col_fp8), group_sizes)


def _fp8_tangent(q, x_dot: jax.Array):
    """The straight-through tangent of ``q = quantize(x)`` (an :class:`MXFP8Tensor` or
    :class:`FP8BlockTensor`): ``x_dot`` over ``q``'s scales as E4M3 (zero where a
    block's scale underflows or a row is past the groups)."""
    ones = dataclasses.replace(q, data=jnp.ones_like(q.data))
    if isinstance(q, MXFP8Tensor):
        scale = mxfp8.dequantize(ones, jnp.float32)
    else:
        scale = fp8_block.dequantize_fp8_block(ones, jnp.float32)
    ok = scale > 0
    data = jnp.where(ok, x_dot.astype(jnp.float32) / jnp.where(ok, scale, 1.0), 0.0)
    return dataclasses.replace(
        q, data=data.astype(jnp.float8_e4m3fn), scale=jnp.zeros_like(q.scale),
        group_sizes=None if q.group_sizes is None else _float0_like(q.group_sizes),
    )


def _float0_like(x: jax.Array):
    return np.zeros(x.shape, jax.dtypes.float0)


def _in_groups(x_dot: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``x_dot`` with the rows past the groups zeroed (what a group-aware copy holds), bf16."""
    g = group_sizes.shape[0]
    keep = (groups.row_group_ids(group_sizes, x_dot.shape[0]) < g)[:, None]
    return jnp.where(keep, x_dot, jnp.zeros((), x_dot.dtype)).astype(jnp.bfloat16)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _st_quantize(x: jax.Array, axis: int) -> MXFP8Tensor:
    return mxfp8.quantize_mxfp8(x, axis=axis)


@_st_quantize.defjvp
def _st_quantize_jvp(axis, primals, tangents):
    q = _st_quantize(primals[0], axis)
    return q, _fp8_tangent(q, tangents[0])


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _st_fake_quantize(x: jax.Array, axis: int) -> jax.Array:
    return mxfp8.dequantize(mxfp8.quantize_mxfp8(x, axis=axis), jnp.bfloat16)


@_st_fake_quantize.defjvp
def _st_fake_quantize_jvp(axis, primals, tangents):
    return _st_fake_quantize(primals[0], axis), tangents[0].astype(jnp.bfloat16)


@jax.custom_jvp
def _st_quantize_both(x: jax.Array, group_sizes: jax.Array) -> tuple[MXFP8Tensor, MXFP8Tensor]:
    return mxfp8.quantize_mxfp8(x, axis=1), mxfp8.quantize_mxfp8_grouped(x, group_sizes)


@_st_quantize_both.defjvp
def _st_quantize_both_jvp(primals, tangents):
    row, col = _st_quantize_both(*primals)
    return (row, col), (_fp8_tangent(row, tangents[0]), _fp8_tangent(col, tangents[0]))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _st_fake_quantize_pair(x: jax.Array, group_sizes: jax.Array, keep_col_fp8: bool):
    return mxfp8.fake_quantize_pair(x, group_sizes, keep_col_fp8)


@_st_fake_quantize_pair.defjvp
def _st_fake_quantize_pair_jvp(keep_col_fp8, primals, tangents):
    x, group_sizes = primals
    x_dot = tangents[0]
    row, col = _st_fake_quantize_pair(x, group_sizes, keep_col_fp8)
    col_dot = _fp8_tangent(col, x_dot) if keep_col_fp8 else _in_groups(x_dot, group_sizes)
    return (row, col), (x_dot.astype(jnp.bfloat16), col_dot)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _st_fp8_block(x: jax.Array, axis) -> FP8BlockTensor:
    return fp8_block.quantize_fp8_block(x, axis)


@_st_fp8_block.defjvp
def _st_fp8_block_jvp(axis, primals, tangents):
    q = _st_fp8_block(primals[0], axis)
    return q, _fp8_tangent(q, tangents[0])


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _st_fp8_block_pair(x: jax.Array, group_sizes: jax.Array, keep_col: bool):
    row = fp8_block.quantize_fp8_block(x, 1)
    col = fp8_block.quantize_fp8_block(x, 0, group_sizes=group_sizes)
    return row, (col if keep_col else fp8_block.dequantize_fp8_block(col, jnp.bfloat16))


@_st_fp8_block_pair.defjvp
def _st_fp8_block_pair_jvp(keep_col, primals, tangents):
    x, group_sizes = primals
    x_dot = tangents[0]
    row, col = _st_fp8_block_pair(x, group_sizes, keep_col)
    col_dot = _fp8_tangent(col, x_dot) if keep_col else _in_groups(x_dot, group_sizes)
    return (row, col), (_fp8_tangent(row, x_dot), col_dot)


def _ref_fp8_block_pair(x: jax.Array, group_sizes: jax.Array, *, keep_col: bool):
    return _with_group_sizes(_st_fp8_block_pair(x, group_sizes, keep_col), group_sizes)


@jax.custom_jvp
def _st_fp8_block_pair_tm(x: jax.Array, group_sizes: jax.Array):
    row, col = _st_fp8_block_pair(x, group_sizes, True)
    return row, fp8_block.to_token_major(col)


@_st_fp8_block_pair_tm.defjvp
def _st_fp8_block_pair_tm_jvp(primals, tangents):
    (row, col), (row_dot, col_dot) = _st_fp8_block_pair_jvp(True, primals, tangents)
    # The column tangent laid out as the column (float0 group sizes carry no layout).
    tm_dot = fp8_block.to_token_major(dataclasses.replace(col_dot, group_sizes=col.group_sizes))
    tm_dot = dataclasses.replace(tm_dot, group_sizes=col_dot.group_sizes)
    return (row, fp8_block.to_token_major(col)), (row_dot, tm_dot)


def _ref_fp8_block_pair_tm(x: jax.Array, group_sizes: jax.Array):
    return _with_group_sizes(_st_fp8_block_pair_tm(x, group_sizes), group_sizes)


def _ref_fp8_block_weight(w: jax.Array, *, k_major: bool = False) -> FP8BlockTensor:
    q = _st_fp8_block(w, (1, 2))
    return fp8_block.transpose_tiles(q) if k_major else q


def _ref_fp8_block_row(x: jax.Array) -> FP8BlockTensor:
    return _st_fp8_block(x, 1)


def _fc1_composed(gemm: Callable, quantize_pair: Callable, lhs: Operand, rhs: Operand, group_sizes: jax.Array,
                  probs: jax.Array):
    """FC1, the activation and its two MXFP8 copies, unfused, from ``gemm`` and
    ``quantize_pair`` (the references for the reference; the dispatched primitives for
    the CUDA fallback, so each step still takes a kernel where one fits)."""
    h = gemm(lhs, rhs, group_sizes, out_dtype=jnp.dtype(jnp.bfloat16))
    a_row, a_col = quantize_pair(srelu_scaled(h, probs), group_sizes, keep_col_fp8=True)
    return h, a_row, a_col


def _dgrad_composed(gemm: Callable, quantize_pair: Callable, dy_row: Operand, w2: Operand, group_sizes: jax.Array,
                    h: jax.Array, probs: jax.Array):
    """The FC2 dgrad, the activation's backward and dh's two MXFP8 copies, unfused (as
    :func:`_fc1_composed`)."""
    da = gemm(dy_row, w2, group_sizes, out_dtype=jnp.dtype(jnp.bfloat16), transpose_rhs=True)
    dh, dprobs = srelu_scaled_grad(da, h, probs)
    dh_row, dh_col = quantize_pair(dh, group_sizes, keep_col_fp8=False)
    return dh_row, dh_col, dprobs


def _fp8_block_fc1_composed(gemm: Callable, pair: Callable, lhs: Operand, rhs: Operand, group_sizes: jax.Array,
                            probs: jax.Array):
    """FC1 of the ``fp8_block`` recipe (``rhs`` the K-major ``[G, N, K]`` weight), the
    activation and its two ``fp8_block`` copies, unfused (as :func:`_fc1_composed`)."""
    h = gemm(lhs, rhs, group_sizes, out_dtype=jnp.dtype(jnp.bfloat16), transpose_rhs=True)
    a_row, a_col = pair(srelu_scaled(h, probs), group_sizes, keep_col=True)
    return h, a_row, a_col


def _ref_fp8_block_fc1(lhs: Operand, rhs: Operand, group_sizes: jax.Array, probs: jax.Array):
    return _fp8_block_fc1_composed(_ref_grouped_gemm, _ref_fp8_block_pair, lhs, rhs, group_sizes, probs)


def _ref_fc1_fused(lhs: Operand, rhs: Operand, group_sizes: jax.Array, probs: jax.Array):
    return _fc1_composed(_ref_grouped_gemm, _ref_fake_quantize_pair, lhs, rhs, group_sizes, probs)


def _ref_dgrad_fused(dy_row: Operand, w2: Operand, group_sizes: jax.Array, h: jax.Array, probs: jax.Array):
    return _dgrad_composed(_ref_grouped_gemm, _ref_fake_quantize_pair, dy_row, w2, group_sizes, h, probs)


_REFERENCE: dict[str, Callable] = {
    "quantize": _ref_quantize,
    "fake_quantize": _ref_fake_quantize,
    "quantize_both": _ref_quantize_both,
    "fake_quantize_pair": _ref_fake_quantize_pair,
    "grouped_gemm": _ref_grouped_gemm,
    "grouped_gemm_qw": _ref_grouped_gemm_qw,
    "grouped_wgrad": _ref_grouped_wgrad,
    "fc1_fused": _ref_fc1_fused,
    "dgrad_fused": _ref_dgrad_fused,
    "fp8_block_pair": _ref_fp8_block_pair,
    "fp8_block_pair_tm": _ref_fp8_block_pair_tm,
    "fp8_block_weight": _ref_fp8_block_weight,
    "fp8_block_row": _ref_fp8_block_row,
    "fp8_block_fc1": _ref_fp8_block_fc1,
}


# What the CUDA branch runs when the CUDA implementation raises ``Unsupported``. The
# composed fallbacks call the plain primitives, so each of their steps still takes a
# kernel where one fits (same numbers as the fused kernel: see each primitive).


def _fallback_grouped_gemm_qw(lhs: Operand, w: jax.Array, group_sizes: jax.Array, *, out_dtype, transpose_rhs: bool):
    """The weight's fake-quantize pass, then :func:`grouped_gemm`."""
    wq = fake_quantize(w, 2 if transpose_rhs else 1)
    return grouped_gemm(lhs, wq, group_sizes, out_dtype, transpose_rhs=transpose_rhs)


def _fallback_fc1_fused(lhs: Operand, rhs: Operand, group_sizes: jax.Array, probs: jax.Array):
    return _fc1_composed(grouped_gemm, fake_quantize_pair, lhs, rhs, group_sizes, probs)


def _fallback_dgrad_fused(dy_row: Operand, w2: Operand, group_sizes: jax.Array, h: jax.Array, probs: jax.Array):
    return _dgrad_composed(grouped_gemm, fake_quantize_pair, dy_row, w2, group_sizes, h, probs)


def _fallback_fp8_block_fc1(lhs: Operand, rhs: Operand, group_sizes: jax.Array, probs: jax.Array):
    return _fp8_block_fc1_composed(grouped_gemm, fp8_block_pair, lhs, rhs, group_sizes, probs)


def _fallback_fp8_block_weight(w: jax.Array, *, k_major: bool = False) -> FP8BlockTensor:
    """A K-major copy the kernel cannot write itself (``A % 16 != 0``): the kernel's tiles
    as stored, transposed by XLA; else the reference."""
    if k_major:
        try:
            return fp8_block.transpose_tiles(_kernel("fp8_block_weight", (("k_major", False),), w))
        except Unsupported:
            pass
    return _ref_fp8_block_weight(w, k_major=k_major)


_FALLBACK: dict[str, Callable] = {
    **_REFERENCE,
    "fp8_block_weight": _fallback_fp8_block_weight,
    "grouped_gemm_qw": _fallback_grouped_gemm_qw,
    "fc1_fused": _fallback_fc1_fused,
    "dgrad_fused": _fallback_dgrad_fused,
    "fp8_block_fc1": _fallback_fp8_block_fc1,
}


def quantize(x: jax.Array, axis: int) -> MXFP8Tensor:
    """MXFP8 with 32-blocks along ``axis``."""
    return _dispatch("quantize", x, axis=axis)


def fake_quantize(x: jax.Array, axis: int) -> jax.Array:
    """``dequantize(quantize_mxfp8(x, axis))`` in bf16: the MXFP8 values, for a bf16 GEMM
    operand that need not be kept as FP8 (one pass on CUDA, no FP8 copy)."""
    return _dispatch("fake_quantize", x, axis=axis)


def quantize_both(x: jax.Array, group_sizes: jax.Array) -> tuple[MXFP8Tensor, MXFP8Tensor]:
    """``(quantize_mxfp8(x, 1), quantize_mxfp8_grouped(x, group_sizes))`` for ``[M, K]``: one pass on CUDA."""
    return _dispatch("quantize_both", x, group_sizes)


def fake_quantize_pair(
    x: jax.Array, group_sizes: jax.Array, *, keep_col_fp8: bool
) -> tuple[jax.Array, Operand]:
    """Both MXFP8 copies of ``[M, K]`` a GEMM pair needs, from one read on CUDA.

    ``(rowwise values in bf16, group-aware columnwise copy)``: the first is a
    fprop/dgrad GEMM operand (blocks along K), the second a weight-gradient operand
    (32-row blocks along M that never cross a group), as its bf16 values or, with
    ``keep_col_fp8``, as the :class:`MXFP8Tensor` (when it is kept as a residual).
    """
    return _dispatch("fake_quantize_pair", x, group_sizes, keep_col_fp8=keep_col_fp8)


def grouped_gemm(
    lhs: Operand, rhs: Operand, group_sizes: jax.Array, out_dtype, *, transpose_rhs: bool = False
) -> jax.Array:
    """``out[m] = lhs[m] @ rhs[group(m)]``: ``lhs [M, K]`` (blocks along K), ``rhs [G, K, N]`` (blocks along K).

    ``transpose_rhs``: ``rhs`` is ``[G, N, K]`` (still blocked along K) and is used
    transposed: the dgrad GEMM with a weight as stored, without a transpose pass.
    """
    return _dispatch(
        "grouped_gemm", lhs, rhs, group_sizes, out_dtype=jnp.dtype(out_dtype), transpose_rhs=transpose_rhs
    )


def grouped_gemm_qw(
    lhs: Operand, w: jax.Array, group_sizes: jax.Array, out_dtype, *, transpose_rhs: bool = False
) -> jax.Array:
    """:func:`grouped_gemm` by the weight's MXFP8 values, ``fake_quantize(w)`` blocked
    along K, without materializing them on CUDA (the GEMM kernel quantizes the weight).

    ``w`` is the plain weight ``[G, K, N]`` (``transpose_rhs``: ``[G, N, K]``, used
    transposed). Same numbers as ``grouped_gemm(lhs, fake_quantize(w, K axis), ...)``
    up to fp32 summation order.
    """
    return _dispatch(
        "grouped_gemm_qw", lhs, w, group_sizes, out_dtype=jnp.dtype(out_dtype), transpose_rhs=transpose_rhs
    )


def grouped_wgrad(lhs: Operand, rhs: Operand, group_sizes: jax.Array, out_dtype, *, with_token: bool = False):
    """``out[g] = lhs_g^T @ rhs_g``: both ``[M, *]`` in group-aware blocks along M; ``[G, K, N]``.

    ``with_token``: ``(out, token)``, ``token`` an int32 ``[1]`` that exists only once
    ``out`` does (on CUDA the kernel call's own second result). Something that must wait for
    the weight gradient can wait for the token instead of reading ``out``, so that
    ``out``'s only reader stays its consumer: in a ``jax.lax.scan`` of layers XLA then
    writes the kernel's result into the stacked gradients in place rather than copying
    it there (docs/notes/2026-12-07-scan-weight-copies.md)."""
    return _dispatch("grouped_wgrad", lhs, rhs, group_sizes, out_dtype=jnp.dtype(out_dtype), with_token=with_token)


def fc1_fused(
    lhs: Operand, rhs: Operand, group_sizes: jax.Array, probs: jax.Array
) -> tuple[jax.Array, jax.Array, MXFP8Tensor]:
    """FC1 and everything the MLP derives from its output, from one kernel on CUDA.

    ``h = grouped_gemm(lhs, rhs)`` in bf16, ``a = srelu_scaled(h, probs)``, and ``a``'s
    two MXFP8 copies: ``(h, a_row, a_col)`` with ``a_row`` the rowwise values in bf16
    (FC2's operand) and ``a_col`` the group-aware columnwise :class:`MXFP8Tensor`
    (FC2's weight-gradient operand), bit for bit the unfused composition.
    """
    return _dispatch("fc1_fused", lhs, rhs, group_sizes, probs)


def dgrad_fused(
    dy_row: Operand, w2: Operand, group_sizes: jax.Array, h: jax.Array, probs: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The FC2 dgrad and everything the backward derives from it, from one kernel on CUDA.

    ``da = grouped_gemm(dy_row, w2, transpose_rhs=True)`` (``w2 [G, F, H]`` as stored;
    bf16), ``r = relu(h)``, ``dprobs = sum_f da * r**2`` (float32 ``[M]``) and
    ``dh = bf16(da * 2 * probs * r)`` as its two MXFP8 copies in bf16: ``(dh_row, dh_col,
    dprobs)``, ``dh_row`` blocked along F (the FC1 dgrad's operand) and ``dh_col`` in
    group-aware 32-row blocks (dW1's operand). The kernel sums ``dprobs`` in its own
    fixed order (reproducible, not bitwise ``jnp.sum``'s); rows past the groups are
    zero.
    """
    return _dispatch("dgrad_fused", dy_row, w2, group_sizes, h, probs)


def fp8_block_fc1(
    lhs: FP8BlockTensor, rhs_k_major: FP8BlockTensor, group_sizes: jax.Array, probs: jax.Array
) -> tuple[jax.Array, FP8BlockTensor, FP8BlockTensor]:
    """:func:`fc1_fused` for the ``fp8_block`` recipe, from one kernel on CUDA.

    ``h = grouped_gemm(lhs, rhs_k_major, transpose_rhs=True)`` in bf16 (``lhs [M, K]`` in
    1 x 128 blocks, ``rhs_k_major`` the FC1 weight stored K-major ``[G, N, K]`` in 128 x
    128 tiles, as ``fp8_block_weight(w1, k_major=True)`` makes it), ``a =
    srelu_scaled(h, probs)`` and ``fp8_block_pair(a, group_sizes, keep_col=True)``:
    ``(h, a_row, a_col)``, bit for bit the unfused composition on CUDA (elsewhere the
    reference GEMM, which sums in another order). Without the kernel in the extension, the
    composition of the dispatched primitives (each still a kernel where one fits).
    """
    if cuda_impl("fp8_block_fc1") is None:
        return _fallback_fp8_block_fc1(lhs, rhs_k_major, group_sizes, probs)
    return _dispatch("fp8_block_fc1", lhs, rhs_k_major, group_sizes, probs)


def fp8_block_quantize(x: jax.Array, axis: int | tuple[int, int]) -> FP8BlockTensor:
    """``quantize_fp8_block(x, axis)`` (1 x 128 blocks along ``axis``, or 128 x 128 tiles
    over a pair of axes), differentiated straight-through. The 1 x 128 blocks of a
    ``[M, K]`` operand along K (a GEMM operand of a forward without gradient) are one
    kernel on CUDA for bf16 input (``fp8_block_row``); anything else is pure JAX."""
    if isinstance(axis, int) and jnp.ndim(x) == 2 and axis in (1, -1):
        return _dispatch("fp8_block_row", x)
    return _st_fp8_block(x, axis if isinstance(axis, int) else tuple(axis))


def fp8_block_pair(
    x: jax.Array, group_sizes: jax.Array, *, keep_col: bool
) -> tuple[FP8BlockTensor, FP8BlockTensor | jax.Array]:
    """Both ``fp8_block`` copies of ``[M, K]`` a GEMM pair needs, from one read on CUDA.

    ``(quantize_fp8_block(x, 1), col)``: the fprop/dgrad operand (1 x 128 blocks along
    K) and the weight-gradient operand in group-aware 128-row blocks, as the
    :class:`FP8BlockTensor` when ``keep_col`` (a residual) or else as its exactly
    dequantized bf16 values (what the bf16 weight-gradient kernel reads; rows past the
    groups 0). Differentiated straight-through; one kernel on CUDA for bf16 input.
    """
    return _dispatch("fp8_block_pair", x, group_sizes, keep_col=keep_col)


def fp8_block_pair_token_major(x: jax.Array, group_sizes: jax.Array) -> tuple[FP8BlockTensor, TokenMajorBlocks]:
    """:func:`fp8_block_pair` with ``keep_col``, the column laid out as the FP8 weight
    gradient reads it (``fp8_block.to_token_major``): what the backward's dy and dh
    feed the weight gradient, whose column copy nothing else reads. One kernel on CUDA
    for bf16 input (the quantizer's "pair_tm" mode writes the layout itself: no ``[M,
    K]`` column copy, no layout pass); differentiated straight-through."""
    return _dispatch("fp8_block_pair_tm", x, group_sizes)


def fp8_block_weight(w: jax.Array, *, k_major: bool = False) -> FP8BlockTensor:
    """``quantize_fp8_block(w, (1, 2))`` of a ``[G, A, B]`` weight (128 x 128 tiles),
    differentiated straight-through; one kernel on CUDA for bf16 weights.

    ``k_major``: the tiles of the transpose, ``[G, B, A]`` (``fp8_block.transpose_tiles``
    of the above, the same bytes): what a forward GEMM reads, written by the quantizer
    itself on CUDA (no transposing pass; ``A % 16 == 0``, else the kernel's tiles are
    transposed by XLA)."""
    return _dispatch("fp8_block_weight", w, k_major=k_major)


def _register_available_kernels() -> None:
    """Plugs in whatever the CUDA extension provides (nothing when it is not built)."""
    from jax_grouped_mlp._src.cuda import ffi, fp8_block_fc1_ffi, fp8_block_ffi, gemm_ffi

    if not ffi.available():
        return
    if fp8_block_ffi.pair_variants():
        register_cuda_impl("fp8_block_pair", fp8_block_ffi.quantize_pair_cuda)
        register_cuda_impl("fp8_block_pair_tm", fp8_block_ffi.quantize_pair_token_major_cuda)
    if fp8_block_ffi.single_variants():
        register_cuda_impl("fp8_block_weight", fp8_block_ffi.quantize_weight_cuda)
        register_cuda_impl("fp8_block_row", fp8_block_ffi.quantize_row_cuda)
    if ffi.fake_quantize_pair_variants():
        register_cuda_impl("fake_quantize_pair", ffi.fake_quantize_pair_cuda)
    if ffi.fake_quantize_variants():
        register_cuda_impl("fake_quantize", ffi.fake_quantize_cuda)
    if gemm_ffi.grouped_gemm_variants():
        register_cuda_impl("grouped_gemm", gemm_ffi.grouped_gemm_cuda)
    if gemm_ffi.grouped_gemm_variants() and ffi.fake_quantize_variants():
        register_cuda_impl("grouped_gemm_qw", gemm_ffi.grouped_gemm_qw_impl)
    if gemm_ffi.grouped_wgrad_variants():
        register_cuda_impl("grouped_wgrad", gemm_ffi.grouped_wgrad_cuda)
    if gemm_ffi.grouped_gemm_fc1_variants():
        register_cuda_impl("fc1_fused", gemm_ffi.fc1_fused_cuda)
    if gemm_ffi.grouped_gemm_dgrad_variants():
        register_cuda_impl("dgrad_fused", gemm_ffi.dgrad_fused_cuda)
    if fp8_block_fc1_ffi.variants():
        register_cuda_impl("fp8_block_fc1", fp8_block_fc1_ffi.fp8_block_fc1_cuda)


_register_available_kernels()
