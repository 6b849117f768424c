"""The API reference builds from the docstrings without a warning, and covers the API.

``tools/api_docs.py`` renders ``jax_grouped_mlp`` and ``jax_grouped_mlp.flax`` with
pdoc (the ``docs`` extra; skipped where pdoc is not installed).
"""

from __future__ import annotations

import importlib.util
import inspect
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

pytest.importorskip("pdoc", reason="the API reference needs the docs extra (pip install '.[docs]')")


def _public(module) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items() if not n.startswith("_") and not inspect.ismodule(v)]
    return sorted(names)


def test_api_reference_builds_without_warnings_and_covers_the_public_api(tmp_path):
    import api_docs

    import jax_grouped_mlp
    import jax_grouped_mlp.flax

    pages = api_docs.build(tmp_path)  # a pdoc warning raises here
    assert {p.relative_to(tmp_path).as_posix() for p in pages} >= {"jax_grouped_mlp.html", "jax_grouped_mlp/flax.html"}
    for module, page in ((jax_grouped_mlp, "jax_grouped_mlp.html"), (jax_grouped_mlp.flax, "jax_grouped_mlp/flax.html")):
        text = (tmp_path / page).read_text()
        anchors = set(re.findall(r'id="([A-Za-z_][A-Za-z_0-9]*)"', text))
        for name in _public(module):
            obj = getattr(module, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                assert name in anchors, f"{module.__name__}.{name} is missing from the API reference"
                assert inspect.getdoc(obj), f"{module.__name__}.{name} has no docstring"


def test_api_docs_tool_is_where_the_docs_say():
    assert importlib.util.spec_from_file_location("api_docs", ROOT / "tools" / "api_docs.py") is not None
    assert "tools/api_docs.py" in (ROOT / "docs" / "README.md").read_text()
