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
_LIBRARIES = frozenset({"jax_grouped_mlp", *_OTHERS})
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
    if filename.startswith("<"):  # <frozen importlib...>: the interpreter's; <string>, <stdin>: the user's,
        # unless exec'd in a library module's namespace (a dataclass's generated __init__)
        module = str(frame.f_globals.get("__name__", ""))
        return filename.startswith("<frozen") or module.split(".")[0] in _LIBRARIES
    path = os.path.abspath(filename)
    if path.startswith(packages):
        return True
    installed = path.startswith(site) or not _SITE_NAMES.isdisjoint(path.split(os.sep))
    return path.startswith(stdlib) and not installed


def _user_frame(frame: types.FrameType) -> types.FrameType:
    """The first frame up from ``frame`` outside the library, JAX, jaxlib, Flax and the
    standard library (the import machinery's frames included); the outermost frame where
    every one is."""
    dirs = _internal_dirs()
    while frame.f_back is not None and _is_internal(frame, dirs):
        frame = frame.f_back
    return frame


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Warns ``message`` at the user's line (:func:`_user_frame`), keeping the calling
    library module as the warning's module: filters by module (``-W
    ignore::RuntimeWarning:jax_grouped_mlp``) still match, and "once per location" is
    per user line. Falls back to the caller's line if the walk fails."""
    import warnings

    caller = sys._getframe(1)
    try:
        user = _user_frame(caller)
    except Exception:  # noqa: BLE001 - a warning must never fail the call that raises it
        warnings.warn(message, category, stacklevel=2)
        return
    warnings.warn_explicit(
        message, category, user.f_code.co_filename, user.f_lineno,
        module=caller.f_globals.get("__name__", "jax_grouped_mlp"),
        registry=user.f_globals.setdefault("__warningregistry__", {}), module_globals=user.f_globals,
    )
