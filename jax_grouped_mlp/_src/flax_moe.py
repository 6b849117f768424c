"""Flax NNX shell over :func:`moe_block`: the router and the experts of one MoE layer."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as flax_spmd

from jax_grouped_mlp._src import checks
from jax_grouped_mlp._src.flax_mlp import AxisNames, GroupedMLP, default_kernel_init, sharded_param
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
    split over ``expert_axis`` and tokens travel by all-to-all.

    Sharding: the params carry ``out_sharding`` metadata in the logical names of
    ``axis_names`` (:class:`AxisNames`): ``router (hidden, None)``, ``w1 (expert,
    hidden, ffn)``, ``w2 (expert, ffn, hidden)``; ``score_bias`` is replicated. With
    ``parallel``, the logical expert name maps to ``parallel.expert_axis`` and the
    params are placed on ``parallel.mesh`` when built (other names follow
    ``nnx.logical_axis_rules`` if set, else stay replicated), so no
    ``jax.set_mesh`` is needed, for the block nor for ``nnx.Optimizer``. Without
    ``parallel`` they are placed on the mesh ``jax.set_mesh`` set, if any, else left
    on one device with the names only (shard them with ``nnx.get_partition_spec``
    under ``nnx.logical_axis_rules``). Works under ``nnx.jit`` and ``nnx.remat`` with
    :func:`jax_grouped_mlp.offload_policy`; under a policy that recomputes
    "fc2_input", pass ``fuse_fc1_epilogue=False`` (see
    :func:`jax_grouped_mlp.grouped_mlp`; ``OffloadPlan.fuse_fc1_epilogue`` gives it).
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
        axis_names: AxisNames = AxisNames(),
        rngs: nnx.Rngs,
    ):
        if not isinstance(routing, RoutingConfig):
            raise TypeError(f"routing must be a RoutingConfig, got routing={type(routing).__name__}")
        num_experts = checks.positive_int("num_experts", num_experts)
        if routing.top_k > num_experts:
            raise ValueError(f"routing.top_k={routing.top_k} is larger than num_experts={num_experts}")
        if parallel is not None:
            if not isinstance(parallel, ExpertParallel):
                raise TypeError(f"parallel must be an ExpertParallel or None, got parallel={type(parallel).__name__}")
            if num_experts % parallel.expert_size:
                raise ValueError(
                    f"num_experts={num_experts} must be divisible by the size of "
                    f"expert_axis={parallel.expert_axis!r} ({parallel.expert_size})"
                )
        if not isinstance(axis_names, AxisNames):
            raise TypeError(f"axis_names must be an AxisNames, got axis_names={axis_names!r}")
        rules = tuple(flax_spmd.get_logical_axis_rules())
        mesh = None
        if parallel is not None:
            mesh = parallel.mesh
            if axis_names.expert is None:
                raise ValueError(f"with parallel, axis_names.expert must name the expert axis, got {axis_names!r}")
            given = dict(rules).get(axis_names.expert, parallel.expert_axis)
            if given != parallel.expert_axis:
                raise ValueError(
                    f"the logical axis rules map {axis_names.expert!r} to {given!r}, but "
                    f"parallel.expert_axis={parallel.expert_axis!r}"
                )
            rules = (*rules, (axis_names.expert, parallel.expert_axis))
        with flax_spmd.logical_axis_rules(rules):
            self.experts = GroupedMLP(
                num_experts, hidden, ffn, recipe=recipe, fuse_fc1_epilogue=fuse_fc1_epilogue, dtype=dtype,
                param_dtype=param_dtype, kernel_init=kernel_init, axis_names=axis_names, mesh=mesh, rngs=rngs,
            )
            self.router = sharded_param(
                router_init(rngs.params(), (hidden, num_experts), jnp.float32), (axis_names.hidden, None), mesh
            )
        self.routing = routing
        self.parallel = parallel
        self.recipe = Recipe.parse(recipe).value
        self.dtype = jnp.dtype(dtype)
        self.score_bias = RouterBias(jnp.zeros((num_experts,), jnp.float32)) if use_score_bias else None

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
