"""Flax NNX modules (needs ``flax``; install the ``flax`` extra)."""

from jax_grouped_mlp._src.flax.mlp import EMBED_AXIS, EXPERT_AXIS, MLP_AXIS, AxisNames, GroupedMLP, default_kernel_init
from jax_grouped_mlp._src.flax.moe import MoEBlock, RouterBias, default_router_init

__all__ = [
    "EMBED_AXIS",
    "EXPERT_AXIS",
    "MLP_AXIS",
    "AxisNames",
    "GroupedMLP",
    "MoEBlock",
    "RouterBias",
    "default_kernel_init",
    "default_router_init",
]
