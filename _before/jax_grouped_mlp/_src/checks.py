"""Argument checks shared by the public entry points; every error names the argument."""

from __future__ import annotations

import enum
import math
import operator
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

E = TypeVar("E", bound=enum.Enum)

_FLOAT32_MAX = float(np.finfo(np.float32).max)


class ArgumentTypeError(TypeError, ValueError):
    """A numeric argument of the wrong type (a string, a bool, an array where a number
    belongs). Both a TypeError, as Python reports a wrong type, and a ValueError, which
    these checks raised for it before (code that catches ValueError keeps working)."""


def is_real(value) -> bool:
    """Whether ``value`` is a real number: a Python or NumPy int or float, or a concrete
    0-d NumPy or JAX array of an int or float dtype; not a bool (nor a traced value)."""
    if isinstance(value, (np.ndarray, jax.Array)) and not isinstance(value, jax.core.Tracer):
        real = jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(value.dtype, jnp.floating)
        return value.ndim == 0 and bool(real)
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def positive_float(
    name: str, value, *, allow_zero: bool = False, allow_inf: bool = False, float32: bool = False
) -> float:
    """``value`` as a Python float if it is a real number (:func:`is_real`) above 0 (or at
    least 0 with ``allow_zero``), finite unless ``allow_inf``, and with ``float32``
    within float32's range (it multiplies float32 arrays: ``1e300`` would become inf).
    Not a number (a string, an array): :class:`ArgumentTypeError`; out of range: ValueError."""
    if not is_real(value):
        raise ArgumentTypeError(f"{name} must be a number, got {name}={value!r}")
    v = float(value)
    bad_inf = math.isinf(v) and not allow_inf
    if math.isnan(v) or bad_inf or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        finite = "" if allow_inf else "finite and "
        raise ValueError(f"{name} must be {finite}{bound}, got {name}={value!r}")
    if float32 and v > _FLOAT32_MAX:
        raise ValueError(f"{name} must fit in float32 (at most {_FLOAT32_MAX:.8g}), got {name}={value!r}")
    return v


def boolean(name: str, value) -> bool:
    """``value`` as a bool if it is one (Python or NumPy): a string such as ``"no"`` is
    truthy and would silently mean True."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {name}={value!r}")
    return bool(value)


def checkpoint_policy(name: str, value):
    """``value`` if it is None or callable (a ``jax.checkpoint`` policy)."""
    if value is not None and not callable(value):
        raise TypeError(
            f"{name} must be a jax.checkpoint policy (e.g. offload_policy()) or None, got {name}={value!r}"
        )
    if getattr(value, "__name__", None) == "offload_policy" and getattr(value, "__module__", "").startswith(
        "jax_grouped_mlp"
    ):  # the factory itself: JAX would call it with a primitive and its params
        raise TypeError(f"{name} must be a policy: pass offload_policy() (called), not offload_policy itself")
    return value


def positive_int(name: str, value) -> int:
    """``value`` as an int if it is an integer (Python or numpy, not bool) above 0; not an
    integer: :class:`ArgumentTypeError`; 0 or below: ValueError."""
    if isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be a positive int, got {name}={value!r}")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"{name} must be a positive int, got {name}={value!r}") from None
    if as_int <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    return as_int


def parse_enum(cls: type[E], value, name: str) -> E:
    """``cls(value)``, or a ValueError listing the allowed values under the argument's name."""
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {[m.value for m in cls]}, got {name}={value!r}") from None


def float_dtype(name: str, value, allowed: tuple[str, ...] = ("bfloat16", "float32")):
    """``jnp.dtype(value)`` if it is one of ``allowed`` (the dtypes the op takes), else a
    TypeError naming the argument. Only a name, a scalar type (``jnp.bfloat16``) or a
    ``np.dtype`` is a dtype here: ``jnp.dtype`` would also take the dtype of anything that
    has one (an array, a Flax ``Param``, a ``ShapeDtypeStruct``: an argument swapped with
    a tensor)."""
    try:
        dtype = jnp.dtype(value) if isinstance(value, (str, type, np.dtype)) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in allowed:
        raise TypeError(f"{name} must be one of {list(allowed)}, got {name}={value!r}")
    return dtype
