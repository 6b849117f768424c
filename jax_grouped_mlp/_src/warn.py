"""Warnings that point at the user's line rather than at this library's or JAX's.

The library warns from deep inside tracing (a primitive's dispatch, a custom rule run
by ``jax.grad``, a device query): a fixed ``stacklevel`` names a frame of this package
or of JAX, which tells a user nothing and, with Python's default filter (once per
location), can hide a second call site. :func:`warn` names the first frame outside
this package, JAX, jaxlib, Flax and the standard library instead (the frame itself
where the whole stack is internal).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import types

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # jax_grouped_mlp/
_OTHERS = ("jax", "jaxlib", "flax")


def _internal_dirs() -> tuple[str, ...]:
    dirs = [_PACKAGE_DIR]
    for name in _OTHERS:  # only those already imported: never import one for a warning
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(module.__file__)))
    stdlib = sysconfig.get_paths().get("stdlib")
    if stdlib:
        dirs.append(os.path.abspath(stdlib))
    return tuple(d.rstrip(os.sep) + os.sep for d in dirs)


def _is_internal(frame: types.FrameType, dirs: tuple[str, ...]) -> bool:
    filename = frame.f_code.co_filename
    if filename.startswith("<"):  # <frozen ...>, <string>: the interpreter's own frames
        return filename.startswith("<frozen")
    return os.path.abspath(filename).startswith(dirs)


def _frames_to_user(frame: types.FrameType) -> int:
    """How many frames up from ``frame`` the first frame outside the library, JAX,
    jaxlib, Flax and the standard library is (the outermost frame where all are)."""
    dirs = _internal_dirs()
    steps = 0
    while frame.f_back is not None and _is_internal(frame, dirs):
        frame = frame.f_back
        steps += 1
    return steps


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` naming the user's frame."""
    import warnings

    caller = sys._getframe(1)
    warnings.warn(message, category, stacklevel=2 + _frames_to_user(caller))
