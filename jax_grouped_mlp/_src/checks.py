"""Argument checks shared by the public entry points; every error names the argument."""

from __future__ import annotations

import enum
import operator
from typing import TypeVar

E = TypeVar("E", bound=enum.Enum)


def positive_int(name: str, value) -> int:
    """``value`` as an int if it is an integer (Python or numpy, not bool) above 0."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}") from None
    if as_int <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    return as_int


def parse_enum(cls: type[E], value, name: str) -> E:
    """``cls(value)``, or a ValueError listing the allowed values under the argument's name."""
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {[m.value for m in cls]}, got {name}={value!r}") from None
