"""Varying manual axes: what makes the op type-check inside ``jax.shard_map(check_vma=True)``.

Under ``shard_map`` with its default ``check_vma=True`` every value's type records the
mesh axes it varies over. Two things in the op break that bookkeeping:

- An XLA FFI custom call returns values that vary over no axis, whatever its operands
  vary over, and refuses operands that vary over different axes. ``platform_dependent``
  then sees its CUDA branch return another type than its pure-JAX branch.
- A ``custom_vjp`` must return each cotangent with its primal's type. The gradient of
  a weight that is replicated over an axis (while ``x`` varies over it) varies over the
  axis, and has to be summed over it: that ``psum`` is what JAX's own ops insert when
  they transpose the implicit broadcast of a replicated operand.

:func:`to_common` casts a pytree's arrays to vary over the union of their axes
(``jax.lax.pcast(..., to="varying")``: no data moves, and its transpose is the
``psum``), so the op can cast its inputs once, before its ``custom_vjp``, and a CUDA
branch can cast its operands and outputs. Outside ``shard_map``, or with
``check_vma=False``, no array varies and both functions return their input unchanged.
"""

from __future__ import annotations

from typing import TypeVar

import jax

T = TypeVar("T")


def axes_of(value) -> frozenset:
    """The mesh axes ``value`` varies over (empty for non-arrays and outside ``shard_map``)."""
    if not isinstance(value, jax.Array):
        return frozenset()
    aval = jax.typeof(value)
    manual = getattr(aval, "mat", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def union(tree) -> frozenset:
    """The mesh axes any array leaf of ``tree`` varies over."""
    out: frozenset = frozenset()
    for leaf in jax.tree.leaves(tree):
        out |= axes_of(leaf)
    return out


def to_common(tree: T, axes: frozenset | None = None) -> T:
    """``tree`` with every array leaf cast to vary over ``axes`` (by default the union of
    the leaves' axes); leaves that already do are returned as they are (the same
    tracer: ``platform_dependent`` still sees an output forwarded from its operand)."""
    if axes is None:
        axes = union(tree)
    if not axes:
        return tree

    def cast(leaf):
        missing = axes - axes_of(leaf)
        if not missing or not isinstance(leaf, jax.Array):
            return leaf
        return jax.lax.pcast(leaf, tuple(sorted(missing, key=str)), to="varying")

    return jax.tree.map(cast, tree)
