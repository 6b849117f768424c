"""Pure-JAX grouped GEMMs: the CPU path and the oracle for the GPU kernels.

Both GEMMs work on group-aligned row tiles (see :mod:`groups`) and scan over them,
so the cost is ``O(M * K * N)`` plus ``G`` tiles of padding: no per-group Python
loop and no dense ``G x M`` expansion (which is what ``jax.lax.ragged_dot`` does on
CPU). Inputs are float arrays (MXFP8 operands are dequantized first, which is exact
in bfloat16, which the GEMM primitives use); products are accumulated in float32
(HIGHEST precision, so float32 inputs are not truncated either).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_grouped_mlp._src import groups

# Rows per scan step. Larger tiles mean fewer, bigger matmuls but more padding
# (up to ``tile - 1`` rows per group).
DEFAULT_TILE = 64
_HIGHEST = jax.lax.Precision.HIGHEST


# jit: an eager call reuses the compiled scan (each call made a new tile closure)
@functools.partial(jax.jit, static_argnames=("out_dtype", "tile"))
def ragged_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype: jnp.dtype = jnp.float32,
    tile: int = DEFAULT_TILE,
) -> jax.Array:
    """``out[m] = lhs[m] @ rhs[group(m)]`` for ``lhs [M, K]``, ``rhs [G, K, N]``.

    Rows at or past ``sum(group_sizes)`` (clamped to ``M``) are zero.
    """
    m, k = lhs.shape
    g, k2, n = rhs.shape
    if k != k2:
        raise ValueError(f"contraction mismatch: lhs {lhs.shape} vs rhs {rhs.shape}")
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    layout = groups.tile_layout(group_sizes, m, tile)
    tiles, rows, valid = groups.gather_tiles(lhs, layout)

    def one_tile(args):
        a, grp = args
        b = rhs[jnp.minimum(grp, g - 1)]
        return jnp.dot(a, b, precision=_HIGHEST, preferred_element_type=jnp.float32)

    products = jax.lax.map(one_tile, (tiles, layout.group))  # [T, tile, N]
    dest = jnp.where(valid, rows, m)  # invalid rows go to a dropped slot
    out = jnp.zeros((m, n), jnp.float32).at[dest.reshape(-1)].set(
        products.reshape(-1, n), mode="drop"
    )
    return out.astype(out_dtype)


# jit: an eager call reuses the compiled scan (each call made a new tile closure)
@functools.partial(jax.jit, static_argnames=("out_dtype", "tile"))
def ragged_transpose_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype: jnp.dtype = jnp.float32,
    tile: int = DEFAULT_TILE,
) -> jax.Array:
    """Per-group ``lhs_g^T @ rhs_g`` for ``lhs [M, K]``, ``rhs [M, N]``: the weight gradient ``[G, K, N]``.

    Empty groups give exact zeros. Rows past the groups' total do not contribute.
    The summation order is fixed (tiles in order), so results are deterministic.
    """
    m, k = lhs.shape
    m2, n = rhs.shape
    if m != m2:
        raise ValueError(f"row mismatch: lhs {lhs.shape} vs rhs {rhs.shape}")
    g = group_sizes.shape[0]
    # zeros_like keeps lhs's varying-manual-axes type, so the scan carry type-checks
    # inside shard_map.
    acc = jnp.zeros_like(lhs, shape=(g + 1, k, n), dtype=jnp.float32)
    if m == 0:
        return acc[:g].astype(out_dtype)
    layout = groups.tile_layout(group_sizes, m, tile)
    a_tiles, _, _ = groups.gather_tiles(lhs, layout)
    b_tiles, _, _ = groups.gather_tiles(rhs, layout)

    def step(carry, args):
        a, b, grp = args
        # float32 operands: exact for bf16 ones (their products fit), and XLA:CPU has no
        # batched BF16 x BF16 = F32 dot, which vmap over the weights makes of this one.
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        p = jnp.dot(a.T, b, precision=_HIGHEST, preferred_element_type=jnp.float32)
        return carry.at[grp].add(p), None

    acc, _ = jax.lax.scan(step, acc, (a_tiles, b_tiles, layout.group))
    return acc[:g].astype(out_dtype)


def with_order_token(value: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(value, token)``: ``value`` through an optimization barrier with an int32 ``[1]``
    zero, the token, which then exists only once ``value`` does
    (``primitives.grouped_wgrad(with_token=True)`` on the pure-JAX path; on CUDA the
    kernel call's second result is the token). Callers read the barrier's ``value``, so ``value``'s producer
    keeps one reader (a second one can make XLA clone it, to write a scan's stack)."""
    return jax.lax.optimization_barrier((value, jnp.zeros((1,), jnp.int32)))
