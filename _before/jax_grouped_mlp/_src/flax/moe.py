"""Flax NNX shell over :func:`moe_block`: the router and the experts of one MoE layer."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from flax import nnx
from flax.core import spmd as flax_spmd

from jax_grouped_mlp._src import checks
from jax_grouped_mlp._src.flax.mlp import (
    AxisNames, GroupedMLP, default_kernel_init, float_tokens, initialized, replicated, sharded_param,
)
from jax_grouped_mlp._src.moe.block import ExpertParallel, moe_block
from jax_grouped_mlp._src.op.prepared import PreparedWeights
from jax_grouped_mlp._src.op.recipes import Recipe
from jax_grouped_mlp._src.moe.router_stats import update_score_bias
from jax_grouped_mlp._src.moe.routing import RoutingConfig

default_router_init = nnx.initializers.normal(stddev=0.02)
default_router_init.__doc__ = """The router kernel's default initializer: ``(key, [H, E], dtype)``, normal with
standard deviation 0.02 (small logits at the start, so routing begins near uniform)."""


class RouterBias(nnx.Variable):
    """Selection-only router bias (DeepSeek-V3 / Nemotron-3 ``e_score_correction_bias``).

    Not an ``nnx.Param``: it gets no gradient. Load balancing updates it outside the
    optimizer: ``block.update_score_bias(expert_load, rate)`` (see
    :func:`jax_grouped_mlp.update_score_bias`).
    """


class MoEBlock(nnx.Module):
    """A drop-free mixture-of-experts layer of squared-ReLU experts.

    Params: ``router [hidden, num_experts]`` (float32 logits) and ``experts``, a
    :class:`GroupedMLP` holding ``w1 [num_experts, hidden, ffn]`` and
    ``w2 [num_experts, ffn, hidden]``. With ``use_score_bias=True`` also a
    :class:`RouterBias` ``score_bias [num_experts]``. With ``shared_ffn=Fs`` also a
    shared expert, ``shared_w1 [hidden, Fs]`` and ``shared_w2 [Fs, hidden]`` (see
    ``moe_block``'s ``shared_w1``), initialised by ``kernel_init`` as one expert.

    Router statistics: with ``sow_stats=True``, or a non-zero ``load_balancing_coef``
    or ``z_loss_coef``, each call also sows into ``nnx.Intermediate``
    ``router_stats`` (:class:`jax_grouped_mlp.RouterStats`) and ``aux_loss``
    (``load_balancing_coef * load_balancing_loss + z_loss_coef * z_loss``, float32,
    differentiable in the router). A block called more than once (tied weights,
    micro-batches inside one loss) sums its calls: ``aux_loss``, the losses in
    ``router_stats``, ``expert_load`` and ``dropped``. The coefficients act only
    through ``aux_loss``: add it to your loss. Collect the values inside the loss
    function with ``nnx.capture(model, nnx.Intermediate)(x)`` (flax >= 0.12;
    docs/moe.md has the loop). On flax 0.11, call the model and take them with
    ``nnx.pop(model, nnx.Intermediate)``; a call under neither stores them on the
    block, where they keep summing until popped, and a jitted step recompiles once
    (its second call sees the new state).

    Call as ``block(x)`` with ``x [..., hidden]`` of a float dtype; it is cast to
    ``dtype`` and the output comes back in ``dtype`` (as Flax's own layers do), not in
    ``x``'s dtype. See :func:`jax_grouped_mlp.moe_block`.
    ``weight_grad_dtype``: None (the default; or ``float32`` with float32 params) keeps
    the experts' gradients in ``param_dtype``; ``jnp.bfloat16`` (with the default float32
    ``param_dtype``) rounds them to bf16 inside the op, as a bf16 ``ragged_dot`` model
    gets them: a training step then keeps half the bytes of them until its optimizer
    update (``moe_block``'s ``weight_grad_dtype``; the router's stay float32).
    With ``parallel=ExpertParallel(mesh, expert_axis, data_axes)`` the experts are
    split over ``expert_axis`` and tokens travel by all-to-all.

    Sharding: the params carry ``out_sharding`` metadata in the logical names of
    ``axis_names`` (:class:`AxisNames`): ``router (hidden, None)``, ``w1 (expert,
    hidden, ffn)``, ``w2 (expert, ffn, hidden)``, ``shared_w1 (hidden, ffn)``,
    ``shared_w2 (ffn, hidden)``; ``score_bias`` is replicated. With
    ``parallel``, the logical expert name maps to ``parallel.expert_axis`` and the
    params are placed on ``parallel.mesh`` when built (other names follow
    ``nnx.logical_axis_rules`` if set, else stay replicated) and the score bias
    replicated on it, so the block needs no ``jax.set_mesh``. (``nnx.Optimizer`` does,
    once: it makes its step counters on the default device, and the second jitted step
    would compile again for their placement on the mesh.) Without
    ``parallel`` they are placed on the mesh ``jax.set_mesh`` set, if any, else left
    on one device with the names only (shard them with ``nnx.get_partition_spec``
    under ``nnx.logical_axis_rules``). Works under ``nnx.jit`` and ``nnx.remat`` with
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
        axis_names: AxisNames = AxisNames(),
        shared_ffn: int | None = None,
        sow_stats: bool = False,
        load_balancing_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        weight_grad_dtype: DTypeLike | None = None,
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
                param_dtype=param_dtype, kernel_init=kernel_init, axis_names=axis_names, mesh=mesh,
                weight_grad_dtype=weight_grad_dtype, rngs=rngs,
            )
            router = initialized("router_init", router_init, rngs, (hidden, num_experts), jnp.float32)
            self.router = sharded_param(router, (axis_names.hidden, None), mesh)
        self.routing = routing
        self.parallel = parallel
        with flax_spmd.logical_axis_rules(rules):
            self._init_shared_and_stats(
                hidden, shared_ffn, sow_stats, load_balancing_coef, z_loss_coef, kernel_init, param_dtype,
                axis_names, mesh, rngs,
            )
        self.recipe = Recipe.parse(recipe).value
        self.dtype = jnp.dtype(dtype)
        use_score_bias = checks.boolean("use_score_bias", use_score_bias)
        self.score_bias = RouterBias(replicated(jnp.zeros((num_experts,), jnp.float32), mesh)) if use_score_bias else None

    def _init_shared_and_stats(
        self, hidden, shared_ffn, sow_stats, load_balancing_coef, z_loss_coef, kernel_init, param_dtype,
        axis_names, mesh, rngs,
    ) -> None:
        sow_stats = checks.boolean("sow_stats", sow_stats)
        self.load_balancing_coef = checks.positive_float(
            "load_balancing_coef", load_balancing_coef, allow_zero=True, float32=True)
        self.z_loss_coef = checks.positive_float("z_loss_coef", z_loss_coef, allow_zero=True, float32=True)
        self.sow_stats = sow_stats or self.load_balancing_coef > 0 or self.z_loss_coef > 0
        w1 = w2 = None
        if shared_ffn is not None:
            shared_ffn = checks.positive_int("shared_ffn", shared_ffn)
            # kernel_init is written for stacked [E, in, out] weights: one expert's worth,
            # with the experts' hidden/ffn logical names (no expert axis: replicated).
            h_, f_ = axis_names.hidden, axis_names.ffn
            dtype = jnp.dtype(param_dtype)
            w1 = sharded_param(initialized("kernel_init", kernel_init, rngs, (1, hidden, shared_ffn), dtype)[0],
                               (h_, f_), mesh)
            w2 = sharded_param(initialized("kernel_init", kernel_init, rngs, (1, shared_ffn, hidden), dtype)[0],
                               (f_, h_), mesh)
        self.shared_w1, self.shared_w2 = nnx.data(w1), nnx.data(w2)

    def prepare(self) -> PreparedWeights:
        """The routed experts' weights cast and quantized once (``GroupedMLP.prepare``):
        pass the result as ``prepared`` to every micro-batch's call within one step, and
        make it again after each optimizer update. The op checks the copies' recipe and
        shapes, not their values: copies made before an update, or from another block,
        are used without a warning."""
        return self.experts.prepare()

    def __call__(self, x: jax.Array, prepared: PreparedWeights | None = None) -> jax.Array:
        out = moe_block(
            float_tokens(x, self.dtype),
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
            shared_w1=None if self.shared_w1 is None else self.shared_w1[...],
            shared_w2=None if self.shared_w2 is None else self.shared_w2[...],
            return_stats=self.sow_stats,
            prepared=prepared,
            weight_grad_dtype=self.experts.weight_grad_dtype,
        )
        if not self.sow_stats:
            return out
        y, stats = out
        aux = self.load_balancing_coef * stats.load_balancing_loss + self.z_loss_coef * stats.z_loss
        self.sow(nnx.Intermediate, "router_stats", stats, reduce_fn=_add, init_fn=_none)
        self.sow(nnx.Intermediate, "aux_loss", aux, reduce_fn=_add, init_fn=_none)
        return y

    def update_score_bias(self, expert_load: jax.Array, rate: float | jax.Array) -> None:
        """One auxiliary-loss-free balancing step on ``score_bias`` (see
        :func:`jax_grouped_mlp.update_score_bias`); call it outside the gradient, for
        example with ``router_stats.expert_load`` after the optimizer step."""
        if self.score_bias is None:
            raise ValueError("update_score_bias needs a score bias: build the block with use_score_bias=True")
        self.score_bias[...] = update_score_bias(self.score_bias[...], expert_load, rate)


def _add(old: Any, new: Any) -> Any:
    """sow's reduce: the calls' values summed leaf by leaf (flax's default would grow a
    tuple, one entry per call)."""
    return new if old is None else jax.tree.map(jnp.add, old, new)


def _none() -> None:
    return None
