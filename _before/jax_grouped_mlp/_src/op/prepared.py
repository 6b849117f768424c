"""Expert weights prepared once for many micro-batches (gradient accumulation).

Every call of the op prepares ``w1`` and ``w2`` for its GEMMs: rounded to bf16 (float32
master weights), and for ``mxfp8`` fake-quantized twice each (blocked along K for the
forward GEMM, along N for the data gradient), for ``fp8_block`` quantized into 128 x 128
tiles. With gradient accumulation the weights do not change between micro-batches, so
that work (at the Nemotron-3-Nano shape, reading 2.5 GB of weights per step) can be done
once per optimizer step: :func:`prepare_weights` returns the prepared copies, and
``grouped_mlp(..., prepared=...)`` reads them instead of preparing its own. The op
sends no first-order gradient into the copies: the weight gradients flow to ``w1`` and
``w2`` themselves, in their dtypes, so pass the same weights to both. The copies still
depend on the weights as the op's own copies do (straight-through quantization), so
higher-order derivatives through the weights (grad of grad, Hessian-vector products) are
those without ``prepared``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_grouped_mlp._src.formats.fp8_block import FP8BlockTensor
from jax_grouped_mlp._src.op.primitives import QUANTIZED, Operand
from jax_grouped_mlp._src.op.recipes import Recipe
from jax_grouped_mlp._src.op.validation import as_array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreparedWeights:
    """``w1`` and ``w2`` as one recipe's GEMMs read them (a pytree; build it with
    :func:`prepare_weights`).

    Attributes:
      w1_fprop, w1_dgrad: ``w1 [G, H, F]`` for FC1 (blocked along H) and for the FC1
        data gradient (blocked along F). Equal copies when the recipe blocks both uses
        alike (``bf16``; the same array for bf16 weights).
      w2_fprop, w2_dgrad: the same for ``w2 [G, F, H]``.
      recipe: the recipe they were prepared for (static).
      fprop_k_major: the forward copies are stored transposed, ``w1_fprop [G, F, H]``
        and ``w2_fprop [G, H, F]``: the K-major layout Hopper's FP8 GEMM reads, so no
        call makes that copy (static; ``fp8_block``: the same 128 x 128 tiles as the
        dgrad copies, transposed, as ``fp8_block.transpose_tiles`` gives them). Build the object with
        :func:`prepare_weights`: a hand-built one that leaves the flag off while storing
        transposed copies of square weights (H == F) passes the shape checks and
        multiplies by the transpose.

    Every leaf has the experts on axis 0, so a ``PreparedWeights`` shards like the
    weights (``moe_block`` under expert parallelism passes each device its experts').

    Memory: ``mxfp8`` keeps four bf16 copies (twice the bf16 weights), ``bf16`` one bf16
    copy of each float32 weight under jit (XLA computes the equal casts once; two outside
    jit) and none extra for bf16 weights, ``fp8_block`` two FP8 copies of
    each (as stored and transposed) plus their tile scales (the bf16 bytes).
    """

    w1_fprop: Operand
    w1_dgrad: Operand
    w2_fprop: Operand
    w2_dgrad: Operand
    recipe: str = dataclasses.field(metadata=dict(static=True))
    fprop_k_major: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def w1_shape(self) -> tuple[int, ...]:
        """``w1``'s shape, ``[G, H, F]``."""
        return _shape(self.w1_dgrad)

    @property
    def w2_shape(self) -> tuple[int, ...]:
        """``w2``'s shape, ``[G, F, H]``."""
        return _shape(self.w2_dgrad)


def _shape(op: Operand) -> tuple[int, ...]:
    return tuple((op.data if isinstance(op, QUANTIZED) else op).shape)


def prepare_weights(w1: jax.Array, w2: jax.Array, *, recipe: str = "mxfp8") -> PreparedWeights:
    """``w1 [G, H, F]`` and ``w2 [G, F, H]`` prepared for ``recipe``'s GEMMs, once.

    Pass the result to every micro-batch's ``grouped_mlp(x, w1, w2, ..., recipe=recipe,
    prepared=p)`` with the same ``w1`` and ``w2``: the op then neither casts nor quantizes
    the weights, and its results are bitwise those without ``prepared``. Call it inside
    the differentiated function but outside the loop over micro-batches (see
    docs/design.md, "Weights prepared once per step"). The op sends the first-order
    weight gradients to ``w1`` and ``w2``, none into the copies; the copies depend on the
    weights as the op's own do, so second-order derivatives through the weights (grad of
    grad, ``jax.hessian``) are bitwise those without ``prepared`` too.

    ``w1`` and ``w2`` are converted as ``grouped_mlp`` converts them (NumPy float64 or
    lists become float32 with x64 off).

    Raises:
      TypeError, ValueError: naming the argument, for a bad recipe, rank, shape or dtype,
        and for weights ``grouped_mlp`` refuses (``G = 0``, ``H = 0`` or ``F = 0``).
    """
    recipe_ = Recipe.parse(recipe)
    # Converted as grouped_mlp converts them (NumPy float64 masters become float32 with
    # x64 off), so the same w1 and w2 are accepted by both.
    w1, w2 = as_array("w1", w1), as_array("w2", w2)
    for name, w in (("w1", w1), ("w2", w2)):
        if w.ndim != 3:
            hint = (": for weights stacked along a layer axis, jax.vmap(prepare_weights) makes one copy per layer"
                    if w.ndim > 3 else "")
            raise ValueError(f"{name} must be rank 3 ([G, H, F] / [G, F, H]), got {name}.shape={w.shape}{hint}")
        if w.dtype not in (jnp.bfloat16, jnp.float32):
            raise TypeError(f"{name} must be bfloat16 or float32, got {name}.dtype={w.dtype}")
    g, h, f = w1.shape
    if w2.shape != (g, f, h):
        raise ValueError(f"w2 must be [G, F, H]={(g, f, h)} to match w1.shape={w1.shape}, got w2.shape={w2.shape}")
    # What grouped_mlp refuses (check_mlp_args), refused one call earlier.
    if g == 0:
        raise ValueError(f"w1 must hold at least one expert (G > 0), got w1.shape={w1.shape}")
    if h == 0 or f == 0:
        raise ValueError(f"the hidden size H and the FFN size F must be positive, got w1.shape={w1.shape} "
                         f"([G, H, F])")
    # The copies depend on w1 and w2 as the op's own copies do (the same casts and
    # straight-through quantizers), so differentiating the op's backward pass (grad of
    # grad, Hessian-vector products) sees the weights through them, as without
    # ``prepared``. First-order gradients are unchanged: the op returns no cotangent for
    # ``prepared`` and sends the weight gradients to w1 and w2 themselves.
    def bf16(w):
        return w.astype(jnp.bfloat16)

    # One cast per use, not one shared bf16 array: a second-order cotangent then comes
    # back to a float32 weight through each use's own cast and is summed in float32, as
    # in the op (a shared bf16 copy summed the uses' cotangents in bf16: 0.2 % off).
    # Under jit XLA computes the equal casts once; for bf16 weights they are no-ops.
    # fp8_block's forward GEMM reads its tiles K-major (the same tiles, transposed).
    k_major = recipe_ is Recipe.FP8_BLOCK

    def fprop(w):
        return recipe_.fprop_weight_k_major(bf16(w)) if k_major else recipe_.weight(bf16(w), 1)

    ops = (fprop(w1), recipe_.weight(bf16(w1), 2), fprop(w2), recipe_.weight(bf16(w2), 2))
    return PreparedWeights(*ops, recipe=recipe_.value, fprop_k_major=k_major)


def check_prepared(prepared: object, recipe: Recipe, w1: jax.Array, w2: jax.Array) -> None:
    """``prepared`` fits the op's call, or a TypeError/ValueError naming it (trace time).

    Checked: the recipe, every copy's shape, and its kind (bf16 arrays for ``mxfp8`` and
    ``bf16``; plain 128 x 128-tile :class:`FP8BlockTensor` for ``fp8_block``). That the
    copies come from these very weights is the caller's promise (``prepare_weights`` on
    the step's weights)."""
    if not isinstance(prepared, PreparedWeights):
        raise TypeError(f"prepared must be a PreparedWeights from jax_grouped_mlp.prepare_weights or None, "
                        f"got prepared={type(prepared).__name__}")
    if prepared.recipe != recipe.value:
        raise ValueError(f"prepared was made for recipe={prepared.recipe!r}, but the op runs recipe={recipe.value!r}")
    for field, w in (("w1_fprop", w1), ("w1_dgrad", w1), ("w2_fprop", w2), ("w2_dgrad", w2)):
        op = getattr(prepared, field)
        g, a, b = w.shape
        want = (g, b, a) if prepared.fprop_k_major and field.endswith("fprop") else (g, a, b)
        if recipe is Recipe.FP8_BLOCK:
            # tiles over the last two axes of data (axes (1, 2) of [G, A, B]; _shape's check
            # below then names a copy of another rank, e.g. one stacked by vmap)
            ok = (isinstance(op, FP8BlockTensor) and not op.is_grouped
                  and op.blocked_axes == (op.data.ndim - 2, op.data.ndim - 1)
                  and op.data.dtype == jnp.float8_e4m3fn and op.scale.dtype in (jnp.float8_e8m0fnu, jnp.uint8))
            kind = ("an FP8BlockTensor (float8_e4m3fn data, float8_e8m0fnu or uint8 scales) in 128 x 128 tiles "
                    "over axes (1, 2)")
        else:
            ok = isinstance(op, jax.Array) and op.dtype == jnp.bfloat16  # (tracers are jax.Arrays)
            kind = "a bfloat16 array"
        if not ok:
            got = (f"data {op.data.dtype}, scale {op.scale.dtype}" if isinstance(op, QUANTIZED)
                   else getattr(op, "dtype", None))
            raise TypeError(f"prepared.{field} must be {kind} for recipe={recipe.value!r}, got {type(op).__name__}"
                            f"{'' if got is None else ' of ' + str(got)}: build it with prepare_weights")
        if _shape(op) != want:
            stacked = len(_shape(op)) > len(want) and _shape(op)[-len(want):] == want
            hint = (": this looks like one copy per layer (jax.vmap(prepare_weights)); pass one layer's slice, "
                    "e.g. scan over it with the weights" if stacked else "")
            raise ValueError(f"prepared.{field} has shape {_shape(op)}, but the op's weight is {tuple(w.shape)} "
                             f"(so {field} must be {want}): prepare_weights of these w1 ({tuple(w1.shape)}) "
                             f"and w2 ({tuple(w2.shape)}){hint}")
