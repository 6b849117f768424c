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
_SITE_NAMES = frozenset({"site-packages", "dist-packages"})  # any interpreter's, not only this one's


def _dirs(paths) -> tuple[str, ...]:
    return tuple(os.path.abspath(d).rstrip(os.sep) + os.sep for d in paths if d)


def _internal_dirs() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(this package's, JAX's, jaxlib's and Flax's directories; the standard library's;
    the site-packages directories, which may lie inside the standard library's and hold
    the user's own installed code)."""
    packages = [_PACKAGE_DIR]
    for name in _OTHERS:  # only those already imported: never import one for a warning
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            packages.append(os.path.dirname(module.__file__))
    paths = sysconfig.get_paths()
    return _dirs(packages), _dirs([paths.get("stdlib")]), _dirs([paths.get("purelib"), paths.get("platlib")])


def _is_internal(frame: types.FrameType, dirs) -> bool:
    packages, stdlib, site = dirs
    filename = frame.f_code.co_filename
    if filename.startswith("<"):  # <frozen importlib...>: the interpreter's; <string>, <stdin>: the user's
        return filename.startswith("<frozen")
    path = os.path.abspath(filename)
    if path.startswith(packages):
        return True
    installed = path.startswith(site) or not _SITE_NAMES.isdisjoint(path.split(os.sep))
    return path.startswith(stdlib) and not installed


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
