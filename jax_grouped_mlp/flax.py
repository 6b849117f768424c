"""Flax NNX modules (needs ``flax``; install the ``flax`` extra)."""

from jax_grouped_mlp._src.flax_mlp import GroupedMLP, default_kernel_init

__all__ = ["GroupedMLP", "default_kernel_init"]
