"""Package build hook: AOT-compiles the CUDA kernels before the Python files are copied.

Everything else is declared in pyproject.toml. ``tools/build_kernels.py`` needs
nvidia-cutlass-dsl, pybind11 and jax (the build requirements) and a CUDA toolkit; where
any is missing, or the build fails, it says so and the package installs with the
pure-JAX path only. The extension lands in ``jax_grouped_mlp/`` and is shipped as
package data.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        result = subprocess.run([sys.executable, str(ROOT / "tools" / "build_kernels.py")], cwd=ROOT)
        if result.returncode:
            print(
                "[jax_grouped_mlp] WARNING: building the CUDA kernels failed (see above); "
                "installing the pure-JAX path only.",
                file=sys.stderr,
            )
        super().run()


setup(cmdclass={"build_py": BuildPyWithKernels})
