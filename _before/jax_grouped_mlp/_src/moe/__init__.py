"""The MoE block: routing, token permutation, the expert-parallel exchange and router statistics."""
