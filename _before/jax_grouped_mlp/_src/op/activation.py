"""The MLP's activation, ``probs * relu(h)**2``, and its backward, as the kernels' epilogues compute them.

Pure JAX with no other dependency in the package: the op, the reference primitives
and the bindings (for the cases they compute in JAX) all use these, so the
arithmetic order is written once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def srelu_scaled(h: jax.Array, probs: jax.Array) -> jax.Array:
    """``probs * relu(h)**2`` in float32 from the bf16 ``h``, rounded to bf16 (what the FC1 epilogue writes)."""
    r = jnp.maximum(h.astype(jnp.float32), 0.0)
    return (probs[:, None] * (r * r)).astype(jnp.bfloat16)


def srelu_scaled_grad(da: jax.Array, h: jax.Array, probs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The backward of :func:`srelu_scaled` from bf16 ``da``: ``(dh, dprobs)``.

    ``da`` arrives rounded to bf16, as the dgrad kernel rounds it (far below the MXFP8
    operands' own error; the same on every platform). float32 math from the bf16
    ``da`` and ``h``: ``dh = bf16((da * 2 * probs) * relu(h))``, ``dprobs = sum_f da *
    relu(h)**2`` (float32), in the order the dgrad kernel's epilogue computes them.
    """
    da = da.astype(jnp.float32)
    r = jnp.maximum(h.astype(jnp.float32), 0.0)
    dprobs = jnp.sum(da * (r * r), axis=1)
    dh = (da * (2.0 * probs[:, None]) * r).astype(jnp.bfloat16)
    return dh, dprobs
