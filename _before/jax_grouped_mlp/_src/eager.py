"""Eager calls of the public entry points run as one compiled program.

Outside ``jax.jit`` JAX runs a function operation by operation, compiling a small
program for each operation and each new shape: the op's MXFP8 path is a few hundred of
them (measured on the CPU at a tiny shape: 270 compiles and 4.7 s for the first
forward, 116 and 2.5 s again for one more row). The entry points check their
arguments, then, when :func:`outside_any_trace` says every argument has a concrete
value, call a ``jax.jit`` of themselves: one compile per shape. That includes eager
``jax.grad`` / ``jax.vjp``, whose tracers carry concrete values (JAX differentiates
the jitted function as it would the plain one). Under ``jit``, ``vmap`` or
``checkpoint`` nothing changes: their tracers have no concrete value.
"""

from __future__ import annotations

import jax

try:  # jax >= 0.4.36: also true for the tracers of eager differentiation
    from jax._src.core import is_concrete as _is_concrete
except ImportError:  # pragma: no cover - older jax: only plain arrays count
    def _is_concrete(value) -> bool:
        return not isinstance(value, jax.core.Tracer)


def outside_any_trace(arrays, statics: tuple = ()) -> bool:
    """Whether every leaf of ``arrays`` has a concrete value (no ``jit``, ``vmap`` or
    ``checkpoint`` trace is staging it) and ``statics`` can key ``jax.jit``'s cache."""
    if not all(_is_concrete(leaf) for leaf in jax.tree.leaves(arrays)):
        return False
    try:
        hash(statics)
    except TypeError:
        return False
    return True
