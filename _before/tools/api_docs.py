#!/usr/bin/env python3
"""Builds the API reference (HTML) from the public modules' docstrings with pdoc.

    python tools/api_docs.py [--out build/api]

Documents what a user imports: ``jax_grouped_mlp`` and ``jax_grouped_mlp.flax``
(``_src`` is private; ``jax_grouped_mlp.kernels`` is the build-time kernel source).
Any warning pdoc raises (a docstring it cannot parse, a name it cannot resolve, a
module that fails to import) is an error: CI runs this through
``tests/test_api_docs.py``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import warnings

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODULES = ("jax_grouped_mlp", "jax_grouped_mlp.flax")


def build(out: pathlib.Path) -> list[pathlib.Path]:
    """Writes the HTML pages under ``out``; returns them. Raises on any pdoc warning."""
    import pdoc
    import pdoc.render

    pdoc.render.configure(docformat="google", show_source=False, search=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pdoc.pdoc(*MODULES, output_directory=out)
    return sorted(out.rglob("*.html"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "build" / "api")
    ns = ap.parse_args(argv)
    pages = build(ns.out)
    print(f"{len(pages)} pages under {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
