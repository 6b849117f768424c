"""Flax NNX shell over :func:`moe_block`: the router and the experts of one MoE layer."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_grouped_mlp._src.flax_mlp import GroupedMLP, default_kernel_init
from jax_grouped_mlp._src.moe import ExpertParallel, moe_block
from jax_grouped_mlp._src.recipes import Recipe
from jax_grouped_mlp._src.routing import RoutingConfig

default_router_init = nnx.initializers.normal(stddev=0.02)


class RouterBias(nnx.Variable):
    """Selection-only router bias (DeepSeek-V3 / Nemotron-3 ``e_score_correction_bias``).

    Not an ``nnx.Param``: it gets no gradient. Load balancing updates it outside the
    optimizer (for example ``block.score_bias.value += rate * (mean_load - load)``).
    """


class MoEBlock(nnx.Module):
    """A drop-free mixture-of-experts layer of squared-ReLU experts.

    Params: ``router [hidden, num_experts]`` (float32 logits) and ``experts``, a
    :class:`GroupedMLP` holding ``w1 [num_experts, hidden, ffn]`` and
    ``w2 [num_experts, ffn, hidden]``. With ``use_score_bias=True`` also a
    :class:`RouterBias` ``score_bias [num_experts]``.

    Call as ``block(x)`` with ``x [..., hidden]``; see :func:`jax_grouped_mlp.moe_block`.
    With ``parallel=ExpertParallel(mesh, expert_axis, data_axes)`` the experts are
    split over ``expert_axis`` (the params carry that ``out_sharding`` metadata) and
    tokens travel by all-to-all. Works under ``nnx.jit`` and ``nnx.remat`` with
    :func:`jax_grouped_mlp.offload_policy` (the policy alone decides what is
    recomputed; ``fuse_fc1_epilogue`` does not change it).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn: int,
        *,
        routing: RoutingConfig,
        use_score_bias: bool = False,
        recipe: str = "mxfp8",
        parallel: ExpertParallel | None = None,
        fuse_fc1_epilogue: bool = True,
        dtype: Any = jnp.bfloat16,
        param_dtype: Any = jnp.float32,
        kernel_init: nnx.Initializer = default_kernel_init,
        router_init: nnx.Initializer = default_router_init,
        rngs: nnx.Rngs,
    ):
        if not isinstance(routing, RoutingConfig):
            raise TypeError(f"routing must be a RoutingConfig, got routing={type(routing).__name__}")
        if isinstance(num_experts, int) and routing.top_k > num_experts:
            raise ValueError(f"routing.top_k={routing.top_k} is larger than num_experts={num_experts}")
        if parallel is not None:
            if not isinstance(parallel, ExpertParallel):
                raise TypeError(f"parallel must be an ExpertParallel or None, got parallel={type(parallel).__name__}")
            if isinstance(num_experts, int) and num_experts % parallel.expert_size:
                raise ValueError(
                    f"num_experts={num_experts} must be divisible by the size of "
                    f"expert_axis={parallel.expert_axis!r} ({parallel.expert_size})"
                )
        self.experts = GroupedMLP(
            num_experts, hidden, ffn, recipe=recipe, fuse_fc1_epilogue=fuse_fc1_epilogue, dtype=dtype,
            param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs,
        )
        self.routing = routing
        self.parallel = parallel
        self.recipe = Recipe.parse(recipe).value
        self.dtype = jnp.dtype(dtype)
        self.router = nnx.Param(router_init(rngs.params(), (hidden, num_experts), jnp.float32))
        self.score_bias = RouterBias(jnp.zeros((num_experts,), jnp.float32)) if use_score_bias else None
        if parallel is not None:
            for param in (self.experts.w1, self.experts.w2):
                param.set_metadata(out_sharding=(parallel.expert_axis, None, None))

    def __call__(self, x: jax.Array) -> jax.Array:
        return moe_block(
            jnp.asarray(x).astype(self.dtype),
            self.router[...],
            # Params go in as stored: grouped_mlp casts/quantizes them itself, and their
            # gradients come back (and are summed over data shards) in param_dtype.
            self.experts.w1[...],
            self.experts.w2[...],
            routing=self.routing,
            score_bias=None if self.score_bias is None else self.score_bias[...],
            recipe=self.recipe,
            parallel=self.parallel,
            fuse_fc1_epilogue=self.experts.fuse_fc1_epilogue,
        )
