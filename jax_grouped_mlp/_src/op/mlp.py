"""The fused expert MLP ``y = FC2_g(probs * srelu(FC1_g(x)))`` as one ``jax.custom_vjp``.

Forward (per recipe, see :mod:`recipes`)::

    h = FC1(row(x), w1)                 bf16, tagged "activation_input"
    a = probs * relu(h)**2              float32 math from the bf16 h, rounded to bf16
    y = FC2(row(a), w2)                 x.dtype

The forward rule additionally keeps ``col(x)`` tagged "fc1_input" and ``col(a)``
tagged "fc2_input" (the token-blocked operands of the two weight gradients). The tags
are :mod:`residuals`' (the remat policy sees them as ``checkpoint_name``s); the
"fc2_input" tag says how to rebuild ``col(a)`` from the tagged ``h``, so a policy
that recomputes "fc2_input" costs one elementwise pass from "activation_input",
whichever kernel produced ``col(a)`` in the forward pass (the fused FC1 kernel
included). Weights, ``probs`` and ``group_sizes`` are never tagged.

Backward::

    da  = dy @ w2^T                     (dy and w2 blocked along H), rounded to bf16
    dprobs = sum_f da * relu(h)**2      float32
    dh  = da * probs * 2 * relu(h)      float32 math, rounded to bf16
    dx  = dh @ w1^T                     (dh and w1 blocked along F)
    dw2 = col(a)^T @ col(dy)            per group
    dw1 = col(x)^T @ col(dh)            per group

With MXFP8 on CUDA, FC1's kernel also writes both MXFP8 copies of ``a``
(``fuse_fc1_epilogue``), and the FC2 dgrad's kernel computes ``dprobs`` and ``dh``
and writes both MXFP8 copies of ``dh`` (``da`` never reaches memory).

Quantization is treated as the identity in the gradient (straight-through), as in
TransformerEngine.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from jax_grouped_mlp._src import checks, eager, groups, varying
from jax_grouped_mlp._src.op import heuristics, primitives, residuals
from jax_grouped_mlp._src.op.activation import srelu_scaled, srelu_scaled_grad
from jax_grouped_mlp._src.op.names import ACTIVATION_INPUT, FC1_INPUT, FC2_INPUT
from jax_grouped_mlp._src.op.primitives import QUANTIZED, Operand
from jax_grouped_mlp._src.op.prepared import PreparedWeights, check_prepared
from jax_grouped_mlp._src.op.recipes import Recipe
from jax_grouped_mlp._src.op.heuristics import KernelChoices
from jax_grouped_mlp._src.op.validation import as_array, check_mlp_args


def _tag(op: Operand, name: str, *, rebuild: residuals.Rebuild | None = None, extra=(), after=None) -> Operand:
    """The residual tag on the arrays of an operand (never on its group sizes);
    ``after``: the op's output, which :func:`residuals.fence` makes wait for the copies."""
    if isinstance(op, QUANTIZED):
        data, scale = residuals.tag([op.data, op.scale], name, rebuild=rebuild, extra=extra, after=after)
        return dataclasses.replace(op, data=data, scale=scale)
    (out,) = residuals.tag([op], name, rebuild=rebuild, extra=extra, after=after)
    return out


def _fc2_input_rebuild(recipe: Recipe) -> residuals.Rebuild:
    """``col(a)`` from the tagged ``h``: what recomputing "fc2_input" runs (elementwise)."""

    def fn(h, probs, group_sizes):
        _, a_col = recipe.row_and_col(srelu_scaled(h, probs), group_sizes, keep_col=True)
        return [a_col.data, a_col.scale] if isinstance(a_col, QUANTIZED) else [a_col]

    return residuals.Rebuild(fn, (FC2_INPUT, recipe))


class _Ready(NamedTuple):
    """A weight operand that came prepared (:mod:`prepared`), and whether it is stored
    transposed against the weight (``PreparedWeights.fprop_k_major``)."""

    op: Operand
    transposed: bool = False


def _weight_gemm(
    lhs, w, group_sizes, recipe: Recipe, choices: KernelChoices, out_dtype, *, transpose_rhs: bool = False,
    ready: _Ready | None = None,
):
    """``lhs @ w[g]`` (``transpose_rhs``: ``@ w[g]^T``) with ``w`` prepared by ``recipe``,
    blocked along the GEMM's K (inside the GEMM kernel: ``heuristics.weights_in_gemm``),
    or with ``ready``, that operand already prepared (a transposed one is read as such:
    the same product, without a transposing pass). A recipe whose forward GEMM reads the
    weight K-major (``Recipe.fprop_weight_k_major``) prepares it so here, as
    ``prepare_weights`` does."""
    if ready is None and not transpose_rhs:
        w_k_major = recipe.fprop_weight_k_major(w)
        ready = None if w_k_major is None else _Ready(w_k_major, transposed=True)
    if ready is not None:
        return primitives.grouped_gemm(
            lhs, ready.op, group_sizes, out_dtype, transpose_rhs=transpose_rhs != ready.transposed
        )
    if heuristics.weights_in_gemm(choices, recipe, lhs.shape[0], w.shape[0]):
        return primitives.grouped_gemm_qw(lhs, w, group_sizes, out_dtype, transpose_rhs=transpose_rhs)
    wq = recipe.weight(w, 2 if transpose_rhs else 1)
    return primitives.grouped_gemm(lhs, wq, group_sizes, out_dtype, transpose_rhs=transpose_rhs)


def _weight(recipe: Recipe, w, reduce_axis: int, ready: _Ready | None) -> Operand:
    """``recipe.weight(w, reduce_axis)``, or the prepared operand (the fused kernels that
    take it read the weight as stored: mxfp8, never transposed)."""
    if ready is None:
        return recipe.weight(w, reduce_axis)
    if ready.transposed:
        raise ValueError(f"recipe={recipe.value!r}: a fused kernel cannot take a transposed prepared weight")
    return ready.op


def _fprop_ready(prepared: PreparedWeights | None, weight: str) -> _Ready | None:
    """``prepared``'s copy of ``weight`` ("w1" or "w2") for its forward GEMM."""
    return None if prepared is None else _Ready(getattr(prepared, f"{weight}_fprop"), prepared.fprop_k_major)


def _dgrad_ready(op: Operand | None) -> _Ready | None:
    """A prepared copy for a data gradient (kept as a residual; stored as the weight)."""
    return None if op is None else _Ready(op)


def _fc1(x_row, w1, group_sizes, probs, recipe: Recipe, choices: KernelChoices, ready=None):
    """FC1 and the scaled srelu: the bf16 pre-activation ``h`` and bf16 ``a``."""
    h = _weight_gemm(x_row, w1, group_sizes, recipe, choices, jnp.bfloat16, ready=ready)
    a = srelu_scaled(h, probs)
    return h, a


def _fuses_fc1(recipe: Recipe, fuse: bool, choices: KernelChoices, x_shape, num_groups: int,
               prepared: PreparedWeights | None) -> bool:
    """Whether FC1 runs with its epilogue in one kernel (:func:`_fc1_fused`): the
    heuristics' choice, and for ``fp8_block`` a K-major FC1 weight (what its GEMM reads;
    prepared weights stored otherwise take the unfused path)."""
    if not heuristics.fuse_fc1(choices, recipe.value, fuse, x_shape, num_groups):
        return False
    ready = _fprop_ready(prepared, "w1")
    return recipe is not Recipe.FP8_BLOCK or ready is None or ready.transposed


def _fc1_fused(recipe: Recipe, x_row, w1, group_sizes, probs, ready: _Ready | None):
    """FC1, the scaled srelu and both copies of ``a`` from one kernel: ``(h, a_row, a_col)``,
    the same bits as :func:`_fc1` followed by ``recipe.row_and_col(a, keep_col=True)``."""
    if recipe is Recipe.FP8_BLOCK:
        w1_k_major = ready.op if ready is not None else recipe.fprop_weight_k_major(w1)
        return primitives.fp8_block_fc1(x_row, w1_k_major, group_sizes, probs)
    return primitives.fc1_fused(x_row, _weight(recipe, w1, 1, ready), group_sizes, probs)


def _fc2(a_row, w2, group_sizes, recipe: Recipe, choices: KernelChoices, out_dtype, ready=None):
    return _weight_gemm(a_row, w2, group_sizes, recipe, choices, out_dtype, ready=ready)


def _compute_weight(w: jax.Array) -> jax.Array:
    """The weight as the GEMMs read it: bfloat16 (float32 master weights are rounded once).

    Every GEMM multiplies bf16 (MXFP8 weights are quantized from these bf16 values),
    so a float32 weight costs one cast pass per use of this function and then takes
    the same CUDA path as a bf16 one; its gradient still comes back in float32 (the
    weight-gradient kernels write float32 sums). A no-op for bf16 weights.
    """
    return w.astype(jnp.bfloat16)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _mlp(x, w1, w2, group_sizes, probs, prepared, recipe: Recipe, fuse: bool, choices: KernelChoices):
    # (prepared: PreparedWeights or None. Every weight GEMM then reads its prepared
    # operand; where the heuristics would quantize the weights inside the GEMM (mxfp8,
    # small groups: the _qw kernels) it runs the plain GEMM on the prepared values
    # instead, which tests/test_mlp_gpu.py shows gives the same bits; fused or not,
    # the other choices stay the heuristics'.)
    w1, w2 = _weights_for_gemms(w1, w2, prepared)
    x = _exact(x)  # as the forward rule quantizes it: the same bits with and without grad
    if _fuses_fc1(recipe, fuse, choices, x.shape, w1.shape[0], prepared):
        _, a_row, _ = _fc1_fused(recipe, recipe.row(x, 1), w1, group_sizes, probs, _fprop_ready(prepared, "w1"))
    else:
        _, a = _fc1(recipe.row(x, 1), w1, group_sizes, probs, recipe, choices, _fprop_ready(prepared, "w1"))
        a_row = recipe.row(a, 1)
    return _fc2(a_row, w2, group_sizes, recipe, choices, x.dtype, _fprop_ready(prepared, "w2"))


def _weights_for_gemms(w1, w2, prepared):
    """The weights as the op's own preparation reads them (bf16), or, when they come
    prepared, zero-size stand-ins of the right leading dimension (never read: every
    weight operand then comes from ``prepared``, and no bf16 copy is made or kept)."""
    if prepared is None:
        return _compute_weight(w1), _compute_weight(w2)
    return (jnp.zeros((w1.shape[0], 0, 0), jnp.bfloat16), jnp.zeros((w2.shape[0], 0, 0), jnp.bfloat16))


def _exact(x: jax.Array) -> jax.Array:
    """``x`` rounded to its own dtype. XLA may compute a bf16 producer of ``x`` (the
    previous layer's residual add, say) in float32 and fuse it into the quantization
    here without rounding ("excess precision"), while a backward pass that recomputes
    "fc1_input" quantizes the rounded ``x`` it was given: the two would differ."""
    finfo = jnp.finfo(x.dtype)
    return jax.lax.reduce_precision(x, exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant)


def _mlp_fwd(x, w1, w2, group_sizes, probs, prepared, recipe: Recipe, fuse: bool, choices: KernelChoices):
    # The residuals keep the bf16 weights the GEMMs read (the very arrays for bf16
    # weights; one bf16 copy for float32 ones; with prepared weights, the prepared
    # copies the data gradients read instead) and the weights' own dtypes, as zero-size
    # arrays (custom_vjp residuals must be arrays), for the gradients' dtype.
    w_dtypes = (jnp.zeros((0,), w1.dtype), jnp.zeros((0,), w2.dtype))
    # The kept weights are cast apart from the forward GEMMs' (XLA computes the equal
    # casts once): differentiating the backward (grad of grad) then sums each use's
    # cotangent of a float32 weight in float32, as with prepared weights, rather than
    # in bf16 on the shared copy (0.2 % off, test_higher_order.py).
    w1_kept, w2_kept = _weights_for_gemms(w1, w2, prepared)
    w1, w2 = _weights_for_gemms(w1, w2, prepared)
    x_row, x_col = recipe.row_and_col(_exact(x), group_sizes, keep_col=True)
    if _fuses_fc1(recipe, fuse, choices, x.shape, w1.shape[0], prepared):
        # One kernel: h and both copies of a. a_col's tag rebuilds it from the tagged h
        # when it is recomputed, so this kernel is never rerun for it.
        h, a_row, a_col = _fc1_fused(recipe, x_row, w1, group_sizes, probs, _fprop_ready(prepared, "w1"))
    else:
        h, a = _fc1(x_row, w1, group_sizes, probs, recipe, choices, _fprop_ready(prepared, "w1"))
        a_row, a_col = recipe.row_and_col(a, group_sizes, keep_col=True)
        h = _residual_copy(choices, h)
    y = _fc2(a_row, w2, group_sizes, recipe, choices, x.dtype, _fprop_ready(prepared, "w2"))
    # The residuals are tagged once y exists (the tags are the identity; their host
    # copies still start as soon as each value does, and are read back for the fence
    # only after y: docs/notes/2026-12-03-layer-stack.md).
    h = _tag(h, ACTIVATION_INPUT, after=y)
    a_col = _tag(a_col, FC2_INPUT, rebuild=_fc2_input_rebuild(recipe), extra=(h, probs, group_sizes), after=y)
    dgrad_weights = None if prepared is None else (prepared.w1_dgrad, prepared.w2_dgrad)
    x_col = _tag(x_col, FC1_INPUT, after=y)
    # The next layer starts only once the offloaded residuals are on the host.
    y = residuals.fence(y, [*_leaves(x_col), *_leaves(h), *_leaves(a_col)])
    return y, (x_col, h, a_col, w1_kept, w2_kept, dgrad_weights, group_sizes, probs, w_dtypes)


def _residual_copy(choices: KernelChoices, h: jax.Array) -> jax.Array:
    """``h`` as the residual, through a barrier of its own (with ``choices.order_backward``).

    Unfused, FC1's result has two readers: the activation and the residual. In a
    ``jax.lax.scan`` of layers the residual is written into the scan's stack, and XLA's
    dynamic-slice fusion then clones FC1's kernel to write that stack in place: FC1 ran
    twice, and its clone read a copy of the layer's ``w1`` slice (1.28 GB at the Nano
    shape). Through the barrier, the stack gets a plain copy of ``h`` instead
    (docs/notes/2026-12-07-scan-weight-copies.md)."""
    return jax.lax.optimization_barrier(h) if choices.order_backward else h


def _dgrad_weight_pass(recipe: Recipe, choices: KernelChoices, m: int, w1, ready: _Ready | None) -> bool:
    """Whether the FC1 dgrad's weight operand comes from a pass over ``w1`` (a quantizer:
    not for a prepared copy, a ``_qw`` GEMM that quantizes in its kernel, or bf16)."""
    if ready is not None or recipe is Recipe.BF16:
        return False
    return not heuristics.weights_in_gemm(choices, recipe, m, w1.shape[0])


def _leaves(op: Operand) -> list:
    return [op.data, op.scale] if isinstance(op, QUANTIZED) else [op]


def _with_leaves(op: Operand, leaves) -> Operand:
    if isinstance(op, QUANTIZED):
        return dataclasses.replace(op, data=leaves[0], scale=leaves[1])
    return leaves[0]


def _mlp_bwd(recipe: Recipe, fuse: bool, choices: KernelChoices, res, dy):
    x_col, h, a_col, w1, w2, dgrad_weights, group_sizes, probs, (w1_dtype, w2_dtype) = res
    w1_ready, w2_ready = (None, None) if dgrad_weights is None else map(_dgrad_ready, dgrad_weights)
    # Offloaded residuals come back once dy exists (residuals.RELOAD_AFTER_COTANGENT).
    a_leaves, x_leaves = _leaves(a_col), _leaves(x_col)
    (h, *leaves), dy = residuals.after_cotangent([h, *a_leaves, *x_leaves], dy)
    a_col = _with_leaves(a_col, leaves[: len(a_leaves)])
    x_col = _with_leaves(x_col, leaves[len(a_leaves):])
    wgrad_fp8 = recipe.wgrad_reads_fp8 and choices.fp8_block_wgrad
    # (Where the FP8 weight gradient takes them, dy's and dh's columns come laid out for it.)
    token_major = heuristics.dy_dh_token_major(choices, recipe.value, dy.shape[0], dy.shape[1], h.shape[1],
                                               group_sizes.shape[0], str(jnp.dtype(dy.dtype)))
    # dy rounded to its dtype like x in the forward (_exact): a float32 producer (the
    # next layer's residual-add cotangent) fused into dy's quantizers without rounding
    # gave another dW2 under jit than without (1.5-3.5 % on the CPU path, mxfp8).
    dy = _exact(dy)
    dy_row, dy_col = recipe.row_and_col(dy, group_sizes, keep_col=wgrad_fp8, token_major=token_major)
    if heuristics.fuse_dgrad(choices, recipe, dy.shape[0], w2.shape[0]):
        # One kernel: the FC2 dgrad, dSReLU, dprobs and both MXFP8 copies of dh.
        w2q = _weight(recipe, w2, 2, w2_ready)
        dh_row, dh_col, dprobs = primitives.dgrad_fused(dy_row, w2q, group_sizes, h, probs)
    else:
        da = _weight_gemm(dy_row, w2, group_sizes, recipe, choices, jnp.bfloat16, transpose_rhs=True, ready=w2_ready)
        dh, dprobs = srelu_scaled_grad(da, h, probs)
        dh_row, dh_col = recipe.row_and_col(dh, group_sizes, keep_col=wgrad_fp8, token_major=token_major)
    # w1's dgrad quantization only once dh exists (XLA hoists it to the top otherwise).
    # Only where a pass prepares w1: a barrier on w1 alone costs, in a jax.lax.scan of
    # layers, a copy of the layer's w1 slice (XLA then cannot read the slice in place).
    if _dgrad_weight_pass(recipe, choices, dh_row.shape[0], w1, w1_ready):
        if isinstance(dh_row, QUANTIZED):
            # (The FP8 data alone order it the same. With the E8M0 scales in the barrier,
            # its transpose under remat fails in grad of grad: jax 0.12, AttributeError
            # "no attribute accum" in _opt_barrier_fancy_transpose.)
            w1, dh_data = _after(choices, w1, dh_row.data)
            dh_row = dataclasses.replace(dh_row, data=dh_data)
        else:
            w1, dh_row = _after(choices, w1, dh_row)
    dx = _weight_gemm(dh_row, w1, group_sizes, recipe, choices, dy.dtype, transpose_rhs=True, ready=w1_ready)
    token = choices.order_backward
    dw2 = primitives.grouped_wgrad(a_col, dy_col, group_sizes, w2_dtype.dtype, with_token=token)
    dw1 = primitives.grouped_wgrad(x_col, dh_col, group_sizes, w1_dtype.dtype, with_token=token)
    if token:
        # dx leaves this layer only with both weight gradients done (the same
        # arithmetic). Otherwise XLA's scheduler defers every layer's
        # weight gradients to the end of the step, and their operands (fc1_input,
        # fc2_input, dy's and dh's columns) stay live across the other layers' backward
        # passes (measured on the H200: docs/notes/2026-11-30-performance-history.md, "The
        # backward's order"). dx waits for the gradients' tokens rather than for the
        # gradients themselves, so each gradient's only reader stays its consumer (in a
        # jax.lax.scan, the stacked gradients, which XLA then writes in place).
        (dw2, token2), (dw1, token1) = dw2, dw1
        dx = _after_tokens(dx, token1, token2)
    return dx, dw1, dw2, None, dprobs.astype(probs.dtype), None


def _after_tokens(x: jax.Array, *tokens: jax.Array) -> jax.Array:
    """``x``, unchanged, but computed only once the int32 ``tokens`` exist.

    Not an optimization barrier: XLA drops a barrier's operands whose results nothing
    reads, and then nothing waits for the tokens (measured: the loop's weight gradients
    all moved to the end of the step). Here ``x`` reads the tokens through a zero that
    XLA cannot fold (a population count of 32 bits is below 64), as a select that XLA
    fuses into ``x``'s consumer: the same bits, and no pass of its own there."""
    bits = functools.reduce(jnp.bitwise_or, tokens)
    zero = jax.lax.shift_right_logical(jax.lax.population_count(bits), jnp.int32(6))
    return jnp.where(zero[0] == 0, x, jnp.zeros_like(x))


def _after(choices: KernelChoices, *values):
    """``values``, each usable only once all of them exist (``lax.optimization_barrier``):
    pins the backward's order when ``choices.order_backward`` is set."""
    return jax.lax.optimization_barrier(values) if choices.order_backward else values


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def grouped_mlp(
    x: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    group_sizes: jax.Array,
    probs: jax.Array | None = None,
    *,
    recipe: str = "mxfp8",
    fuse_fc1_epilogue: bool = True,
    prepared: PreparedWeights | None = None,
    weight_grad_dtype: DTypeLike | None = None,
) -> jax.Array:
    """The squared-ReLU expert MLP over tokens sorted by expert, as one differentiable op.

    ``y[m] = (probs[m] * relu(x[m] @ w1[g])**2) @ w2[g]`` for the expert ``g`` that
    owns row ``m`` (group ``g`` owns the ``group_sizes[g]`` rows after those of
    groups ``0..g-1``).

    Args:
      x: ``[M, H]`` bfloat16 (or float32) tokens, sorted by expert.
      w1: ``[G, H, F]`` stacked FC1 weights (bfloat16 or float32).
      w2: ``[G, F, H]`` stacked FC2 weights.
      group_sizes: ``[G]`` integer rows per expert, read on the device (no host
        sync). Sizes that sum past ``M`` are cut at ``M``; negative sizes count as 0.
        The cut happens before any sum, so huge sizes (a running sum past 2**31, or
        int64 values past the int32 range, in a NumPy array or with x64 enabled) cut
        at ``M`` too instead of wrapping.
      probs: ``[M]`` or ``[M, 1]`` routing weights, or None for all ones.
      recipe: ``"mxfp8"`` (both GEMMs in MXFP8, forward and backward), ``"bf16"``, or
        ``"fp8_block"`` (FP8 E4M3 with power-of-two scales per 128-block: 1 x 128 for
        activations, 128 x 128 for weights; docs/design.md). On CUDA,
        ``"fp8_block"``'s four data GEMMs run on the FP8 block-scaled kernel (FP8 wgmma,
        promoted into float32 every 128 of K) when K % 16 == 0 and N % 8 == 0, its
        weight gradients on the FP8 block-scaled weight-gradient kernel (promoted every
        128 tokens); its quantizers are kernels, FC1's kernel writes ``a``'s two copies
        itself (``fuse_fc1_epilogue``) and the FC2 dgrad's activation backward is a
        separate pass. Elsewhere the GEMMs multiply the dequantized values with
        float32 accumulation.
      fuse_fc1_epilogue: with ``"mxfp8"`` or ``"fp8_block"`` on CUDA, FC1's kernel also
        writes ``a``'s two quantized copies (FC2's operand and the "fc2_input"
        residual), so no separate pass reads ``h`` again. Same numbers either way, and no effect on what the
        remat policy costs: recomputing "fc2_input" always rebuilds it from
        "activation_input" by one elementwise pass, never by rerunning FC1. No
        effect when the groups are small (at most 512 rows on average,
        ``heuristics.KernelChoices.qw_max_rows_per_group``): then the GEMM kernels
        quantize the weights themselves and FC1 always runs unfused.

      prepared: ``prepare_weights(w1, w2, recipe=recipe)`` made once for many calls with
        these same weights (gradient accumulation over micro-batches): the op then
        reads those copies instead of casting and quantizing the weights itself, with
        the same results bit for bit. Gradients still flow to ``w1`` and ``w2``.
      weight_grad_dtype: None (the default) or ``float32``: each weight's gradient in
        its own dtype, so float32 master weights get float32 sums written as float32
        (``float32`` with a bfloat16 weight is a ValueError: JAX gives a weight's
        gradient its dtype). ``jnp.bfloat16``: float32 weights get their float32 sums
        rounded once to bfloat16 by the weight-gradient kernel and cast back to float32
        outside the op, as ``jax.lax.ragged_dot(x, w.astype(jnp.bfloat16))`` gives them;
        no effect on bfloat16 weights. XLA fuses that cast into whatever reads the
        gradient (an optimizer update), so no float32 gradient buffer exists: half the
        bytes of the weight gradients a training step keeps until its optimizer update
        (at the Nano shape 2.55 of 5.1 GB a layer; the compiled temp of a two-layer
        decoder step fell from 10.34 to 8.14 GiB, docs/performance.md). Where nothing
        fuses the cast (a jitted function that returns the gradients), it is a pass of
        its own and the step is slower (docs/performance.md, "The Flax MoE block"). Under
        ``shard_map`` the sum of a replicated weight's gradient over data shards stays
        in float32. Second derivatives with respect to the weights then pass through
        the bf16 copy too (rounded like the gradients).

    Returns:
      ``[M, H]`` in ``x.dtype``. Rows at or past ``sum(group_sizes)`` are zero, and
      so are their gradients. Differentiable in ``x``, ``w1``, ``w2`` and ``probs``;
      the backward pass needs the residuals "fc1_input", "activation_input" and
      "fc2_input", which :func:`offload_policy` places.

    Raises:
      TypeError, ValueError: at trace time, for bad ranks, shapes, dtypes or recipe.

    Weights: bfloat16 or float32 (master weights), the same path either way. The
    GEMMs read bf16, so float32 weights are rounded to bfloat16 once per step (one
    cast pass; the MXFP8 recipe quantizes those bf16 values), and their gradients
    come back in float32 from float32 sums (rounded to bfloat16 on the way with
    ``weight_grad_dtype=jnp.bfloat16``).

    Performance: on CUDA every GEMM runs on the Hopper kernels when ``x`` is
    bfloat16 and H, F are multiples of 8; a float32 ``x`` makes FC2 and the FC1
    dgrad use the pure-JAX GEMM (float32 output). Cast ``x`` to bfloat16 for speed.
    """
    return grouped_mlp_with(
        heuristics.DEFAULT, x, w1, w2, group_sizes, probs, recipe=recipe, fuse_fc1_epilogue=fuse_fc1_epilogue,
        prepared=prepared, weight_grad_dtype=weight_grad_dtype,
    )


def grouped_mlp_with(
    choices: KernelChoices,
    x: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    group_sizes: jax.Array,
    probs: jax.Array | None = None,
    *,
    recipe: str = "mxfp8",
    fuse_fc1_epilogue: bool = True,
    prepared: PreparedWeights | None = None,
    weight_grad_dtype: DTypeLike | None = None,
) -> jax.Array:
    """:func:`grouped_mlp` with explicit kernel choices (private: for tests and benchmarks
    that compare the op's paths). The same numbers whatever ``choices`` says."""
    if not isinstance(choices, KernelChoices):
        raise TypeError(f"choices must be a heuristics.KernelChoices, got choices={choices!r}")
    recipe_ = Recipe.parse(recipe)
    x = as_array("x", x)
    w1 = as_array("w1", w1)
    w2 = as_array("w2", w2)
    group_sizes = as_array("group_sizes", groups.host_clip(group_sizes))
    if probs is not None:
        probs = as_array("probs", probs)
    check_mlp_args(x, w1, w2, group_sizes, probs)
    fuse_fc1_epilogue = checks.boolean("fuse_fc1_epilogue", fuse_fc1_epilogue)
    grad_bf16 = weight_grads_in_bf16(weight_grad_dtype, w1=w1, w2=w2)
    if prepared is not None:
        check_prepared(prepared, recipe_, w1, w2)
    m = x.shape[0]
    if probs is None:
        p = jnp.ones((m,), jnp.float32)
    else:
        p = probs.reshape(m).astype(jnp.float32)
    # Clamped once here (sums cut at M, no int32 overflow): every kernel and reference
    # below sees sizes that sum to at most M.
    args = (x, w1, w2, groups.clamp_group_sizes(group_sizes, m), p, prepared)
    statics = (recipe_, fuse_fc1_epilogue, choices, grad_bf16)
    if eager.outside_any_trace(args, statics):
        return _mlp_jit(*args, *statics)  # one compiled program per shape (eager.py)
    # Inside shard_map(check_vma=True): all operands vary over the same mesh axes, so the
    # custom_vjp's cotangents have their primals' types, and the transpose of this cast
    # sums a replicated weight's gradient over the axes x varies over (varying.py).
    return _mlp_grads_as(*varying.to_common(args), *statics)


def weight_grads_in_bf16(weight_grad_dtype, **weights) -> bool:
    """Whether ``weight_grad_dtype`` asks for bfloat16 gradients of float32 weights
    (:func:`grouped_mlp`'s argument, checked against ``weights``, name -> array or
    dtype: None, bfloat16, or float32 for float32 weights only; JAX gives a bfloat16
    weight a bfloat16 gradient)."""
    if weight_grad_dtype is None:
        return False
    dtype = checks.float_dtype("weight_grad_dtype", weight_grad_dtype)
    if dtype == jnp.float32:
        for name, w in weights.items():
            w_dtype = jnp.dtype(getattr(w, "dtype", w))
            if w_dtype != jnp.float32:
                label = f"{name}.dtype" if hasattr(w, "dtype") else name
                raise ValueError(
                    f"weight_grad_dtype=float32 needs float32 weights (a weight's gradient has its dtype), "
                    f"got {label}={w_dtype}"
                )
        return False
    return True


def _mlp_grads_as(x, w1, w2, group_sizes, probs, prepared, recipe, fuse, choices, grad_bf16: bool):
    """:func:`_mlp`, with float32 weights cast to bfloat16 first when ``grad_bf16``: the
    op then writes their gradients in bfloat16 and JAX's transpose of the cast makes them
    float32 outside the op, where XLA fuses it into their consumer. (After
    ``varying.to_common``: the sum over data shards of a replicated weight's gradient,
    the transpose of that cast, then comes after the cast back to float32.)"""
    if grad_bf16:
        w1, w2 = (w.astype(jnp.bfloat16) for w in (w1, w2))
    return _mlp(x, w1, w2, group_sizes, probs, prepared, recipe, fuse, choices)


_mlp_jit = jax.jit(_mlp_grads_as, static_argnums=(6, 7, 8, 9))
