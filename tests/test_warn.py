"""Which frames the library's warnings skip (``_src/warn.py``): this package's, JAX's,
jaxlib's, Flax's and the standard library's, but not code installed in site-packages
(which may lie inside the standard library's directory) nor ``<stdin>``/``<string>``."""

from __future__ import annotations

import os
import sysconfig
import types
import warnings

import jax

from jax_grouped_mlp._src import warn


def _frame(filename: str):
    return types.SimpleNamespace(f_code=types.SimpleNamespace(co_filename=filename))


def test_internal_frames():
    dirs = warn._internal_dirs()
    paths = sysconfig.get_paths()
    internal = [
        os.path.join(paths["stdlib"], "contextlib.py"),
        os.path.join(os.path.dirname(jax.__file__), "_src", "api.py"),
        os.path.join(warn._PACKAGE_DIR, "_src", "op", "mlp.py"),
        "<frozen importlib._bootstrap>",
    ]
    user = [
        os.path.join(paths["purelib"], "my_model", "train.py"),  # the user's installed package
        os.path.join(paths["stdlib"], "site-packages", "my_model", "train.py"),  # the base Python's
        "/home/someone/train.py",
        "<stdin>",
        "<string>",
    ]
    assert [warn._is_internal(_frame(f), dirs) for f in internal] == [True] * len(internal)
    assert [warn._is_internal(_frame(f), dirs) for f in user] == [False] * len(user)


def test_names_the_first_user_frame_under_jit():
    def library_like():  # (this file's frame is the user's: the warning names it)
        warn.warn("here", RuntimeWarning)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(lambda x: (library_like(), x)[1])(1.0)
    (w,) = caught
    assert (w.filename, w.category) == (__file__, RuntimeWarning)
