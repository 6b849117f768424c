"""Flax NNX modules (needs ``flax``; install the ``flax`` extra)."""

from jax_grouped_mlp._src.flax_mlp import GroupedMLP, default_kernel_init
from jax_grouped_mlp._src.flax_moe import MoEBlock, RouterBias, default_router_init

__all__ = ["GroupedMLP", "MoEBlock", "RouterBias", "default_kernel_init", "default_router_init"]
