"""Flax NNX modules over the functional op and MoE block."""
