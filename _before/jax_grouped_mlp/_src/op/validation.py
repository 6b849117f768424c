"""Trace-time checks of the public op's arguments; every error names the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def is_mlp_float(x) -> bool:
    """Whether ``x``'s dtype is one :func:`grouped_mlp` takes for ``x``, ``w1`` and ``w2``."""
    return jnp.dtype(x.dtype) in _FLOATS


def check_mlp_args(x, w1, w2, group_sizes, probs) -> None:
    """Raises ``TypeError``/``ValueError`` for bad shapes or dtypes of :func:`grouped_mlp`'s inputs."""
    for name, arr in (("x", x), ("w1", w1), ("w2", w2), ("group_sizes", group_sizes)):
        if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(arr).__name__}")
    if x.ndim != 2:
        raise ValueError(f"x must be [M, H] (rank 2), got x.shape={x.shape}")
    if w1.ndim != 3:
        raise ValueError(f"w1 must be [G, H, F] (rank 3), got w1.shape={w1.shape}")
    if w2.ndim != 3:
        raise ValueError(f"w2 must be [G, F, H] (rank 3), got w2.shape={w2.shape}")
    m, h = x.shape
    g, h1, f = w1.shape
    if h1 != h:
        raise ValueError(f"w1.shape[1] must equal H=x.shape[1]={h}, got w1.shape={w1.shape}")
    if w2.shape != (g, f, h):
        raise ValueError(
            f"w2 must be [G, F, H]={(g, f, h)} to match x.shape={x.shape} and w1.shape={w1.shape}, "
            f"got w2.shape={w2.shape}"
        )
    if g == 0:
        raise ValueError(f"need at least one expert, got w1.shape={w1.shape}")
    if h == 0 or f == 0:
        raise ValueError(f"the hidden size H and the FFN size F must be positive, got x.shape={x.shape}, "
                         f"w1.shape={w1.shape}")
    for name, arr in (("x", x), ("w1", w1), ("w2", w2)):
        if not is_mlp_float(arr):
            raise TypeError(f"{name} must be bfloat16 or float32, got {name}.dtype={arr.dtype}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer) or group_sizes.dtype == jnp.bool_:
        raise TypeError(
            f"group_sizes must be an integer array (int32), got group_sizes.dtype={group_sizes.dtype}"
        )
    if group_sizes.shape != (g,):
        raise ValueError(
            f"group_sizes must have shape [G]=({g},) to match w1.shape={w1.shape}, "
            f"got group_sizes.shape={group_sizes.shape}"
        )
    if probs is not None:
        if not hasattr(probs, "shape") or not hasattr(probs, "dtype"):
            raise TypeError(f"probs must be an array or None, got {type(probs).__name__}")
        if not jnp.issubdtype(probs.dtype, jnp.floating):
            raise TypeError(f"probs must be a float array, got probs.dtype={probs.dtype}")
        if probs.shape not in ((m,), (m, 1)):
            raise ValueError(f"probs must be [M] or [M, 1] with M={m}, got probs.shape={probs.shape}")


def as_array(name: str, value) -> jax.Array:
    """``jnp.asarray`` that turns conversion failures into an error naming the argument."""
    if value is None:
        raise TypeError(f"{name} must be an array, got None")
    if isinstance(value, jax.ShapeDtypeStruct):
        raise TypeError(f"{name} must be an array, got a jax.ShapeDtypeStruct ({name}.shape={value.shape}, "
                        f"{name}.dtype={value.dtype}): a shape and dtype, not values (trace with jax.eval_shape "
                        f"or jax.jit(...).lower to use it)")
    try:
        return jnp.asarray(value)
    except TypeError as err:
        raise TypeError(f"{name} must be an array, got {type(value).__name__}: {err}") from None
