"""Where the library's warnings point (``_src/warn.py``): at the first frame outside this
package, JAX, jaxlib, Flax and the standard library (the import machinery included), not
at code installed in site-packages (which may lie inside the standard library's
directory) nor past ``<stdin>``/``<string>`` (unless run in a library module's namespace, as a
dataclass's generated ``__init__`` is); module filters still match the library."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import types
import warnings

import jax

from jax_grouped_mlp._src import warn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A stand-in for library code: compiled under a file name inside the package, so the walk
# has library frames to skip (under jit: JAX's frames between it and this file too).
_LIB = {"__name__": "jax_grouped_mlp._src.fake"}
exec(compile("from jax_grouped_mlp._src import warn\ndef library_warns():\n    warn.warn('here', RuntimeWarning)\n",
             os.path.join(warn._PACKAGE_DIR, "_src", "fake.py"), "exec"), _LIB)


def _frame(filename: str, module: str = "__main__"):
    return types.SimpleNamespace(f_code=types.SimpleNamespace(co_filename=filename), f_globals={"__name__": module})


def test_internal_frames():
    dirs = warn._internal_dirs()
    paths = sysconfig.get_paths()
    internal = [
        os.path.join(paths["stdlib"], "contextlib.py"),
        os.path.join(os.path.dirname(jax.__file__), "_src", "api.py"),
        os.path.join(warn._PACKAGE_DIR, "_src", "op", "mlp.py"),
        "<frozen importlib._bootstrap>",
    ]
    # code exec'd in a library module's namespace (a dataclass's generated __init__)
    generated = [_frame("<string>", m) for m in ("jax_grouped_mlp._src.moe.block", "flax.nnx.module", "jax")]
    user = [
        os.path.join(paths["purelib"], "my_model", "train.py"),  # the user's installed package
        os.path.join(paths["stdlib"], "site-packages", "my_model", "train.py"),  # the base Python's
        "/home/someone/train.py",
        "<stdin>",
        "<string>",
    ]
    assert [warn._is_internal(_frame(f), dirs) for f in internal] == [True] * len(internal)
    assert [warn._is_internal(_frame(f), dirs) for f in user] == [False] * len(user)
    assert [warn._is_internal(f, dirs) for f in generated] == [True] * len(generated)
    assert not warn._is_internal(_frame("<string>", "jax_grouped_mlp_extras"), dirs)  # a prefix is not the package


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return caught


def test_names_the_users_line_through_library_and_jax_frames():
    (w,) = _caught(lambda: _LIB["library_warns"]())
    assert (w.filename, w.lineno, w.category) == (__file__, test_names_the_users_line_through_library_and_jax_frames.__code__.co_firstlineno + 1, RuntimeWarning)  # noqa: E501
    line = sys._getframe().f_lineno + 1
    (w,) = _caught(lambda: jax.jit(lambda x: (_LIB["library_warns"](), x)[1])(1.0))
    assert (w.filename, w.lineno) == (__file__, line)


def test_module_filters_still_match_the_library():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", module="jax_grouped_mlp")
        _LIB["library_warns"]()
    assert caught == []


def test_a_warning_raised_while_importing_names_the_import(tmp_path):
    """The newer-jaxlib warning fires while ``import jax_grouped_mlp`` loads the
    extension: it names that import line (it named ``sys:1`` when the import
    machinery's frames were counted as ``warnings.warn`` does not)."""
    (tmp_path / "user.py").write_text(textwrap.dedent("""\
        import sys, types, warnings
        fake = types.ModuleType("jax_grouped_mlp._kernels")
        fake.JAXLIB_VERSION = "99.0"
        fake.registrations = lambda **kw: {}
        sys.modules["jax_grouped_mlp._kernels"] = fake
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import jax_grouped_mlp  # line 9
        print([(w.filename, w.lineno) for w in caught if "newer than the running" in str(w.message)])
        """))
    out = subprocess.run([sys.executable, str(tmp_path / "user.py")], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), check=True).stdout
    assert out.strip() == repr([(str(tmp_path / "user.py"), 9)]), out
