"""Flax NNX shell over :func:`grouped_mlp`: holds the stacked expert weights."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_grouped_mlp._src import checks
from jax_grouped_mlp._src.mlp import grouped_mlp
from jax_grouped_mlp._src.recipes import Recipe

# He-style fan-in init per expert: the expert axis (0) is a batch axis, the
# reduction axis (1) is fan-in.
default_kernel_init = nnx.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
)


class GroupedMLP(nnx.Module):
    """The squared-ReLU expert MLP of an MoE layer, over tokens already sorted by expert.

    Params: ``w1 [num_experts, hidden, ffn]`` and ``w2 [num_experts, ffn, hidden]``,
    stored in ``param_dtype`` and cast to ``dtype`` for the computation (with
    ``recipe="mxfp8"`` the GEMMs quantize them to MXFP8 anyway). ``recipe`` and
    ``fuse_fc1_epilogue`` are :func:`jax_grouped_mlp.grouped_mlp`'s.

    Call as ``module(x, group_sizes, probs=None)`` with ``x [M, hidden]``; see
    :func:`jax_grouped_mlp.grouped_mlp`. Use under ``nnx.jit`` and ``nnx.remat``
    with :func:`jax_grouped_mlp.offload_policy` to place the residuals.
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn: int,
        *,
        recipe: str = "mxfp8",
        fuse_fc1_epilogue: bool = True,
        dtype: Any = jnp.bfloat16,
        param_dtype: Any = jnp.float32,
        kernel_init: nnx.Initializer = default_kernel_init,
        rngs: nnx.Rngs,
    ):
        num_experts = checks.positive_int("num_experts", num_experts)
        hidden = checks.positive_int("hidden", hidden)
        ffn = checks.positive_int("ffn", ffn)
        self.recipe = Recipe.parse(recipe).value
        if not isinstance(fuse_fc1_epilogue, bool):
            raise TypeError(f"fuse_fc1_epilogue must be a bool, got {fuse_fc1_epilogue!r}")
        self.fuse_fc1_epilogue = fuse_fc1_epilogue
        self.num_experts, self.hidden, self.ffn = num_experts, hidden, ffn
        self.dtype = checks.float_dtype("dtype", dtype)  # grouped_mlp takes bf16 or f32
        self.param_dtype = checks.float_dtype("param_dtype", param_dtype)
        self.w1 = nnx.Param(kernel_init(rngs.params(), (num_experts, hidden, ffn), self.param_dtype))
        self.w2 = nnx.Param(kernel_init(rngs.params(), (num_experts, ffn, hidden), self.param_dtype))

    def __call__(
        self, x: jax.Array, group_sizes: jax.Array, probs: jax.Array | None = None
    ) -> jax.Array:
        return grouped_mlp(
            jnp.asarray(x).astype(self.dtype),
            self.w1[...].astype(self.dtype),
            self.w2[...].astype(self.dtype),
            group_sizes,
            probs,
            recipe=self.recipe,
            fuse_fc1_epilogue=self.fuse_fc1_epilogue,
        )
