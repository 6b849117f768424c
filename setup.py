"""Package build hook: AOT-compiles the CUDA kernels before the Python files are copied.

Everything else is declared in pyproject.toml. ``tools/build_kernels.py`` needs
nvidia-cutlass-dsl, pybind11 and jax (the build requirements) and a CUDA toolkit; where
any is missing, or the build fails, it says so and the package installs with the
pure-JAX path only. The extension lands in ``jax_grouped_mlp/`` and is shipped as
package data.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import sysconfig

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = pathlib.Path(__file__).resolve().parent


class BuildPyWithKernels(build_py):
    """Builds the kernels first. ``JGM_KERNELS_STRICT=1`` (tools/build_wheel.sh) makes a
    missing toolchain or a failed kernel build fail the package build."""

    def run(self) -> None:
        strict = os.environ.get("JGM_KERNELS_STRICT") == "1"
        cmd = [sys.executable, str(ROOT / "tools" / "build_kernels.py"), *(["--strict"] if strict else [])]
        result = subprocess.run(cmd, cwd=ROOT)
        if result.returncode:
            if strict:
                raise SystemExit("[jax_grouped_mlp] building the CUDA kernels failed (JGM_KERNELS_STRICT=1)")
            print(
                "[jax_grouped_mlp] WARNING: building the CUDA kernels failed (see above); "
                "installing the pure-JAX path only.",
                file=sys.stderr,
            )
        super().run()


class BinaryDistribution(Distribution):
    """A wheel with the extension is specific to one Python and one platform
    (``cp312-cp312-linux_x86_64``, made ``manylinux_*`` by ``auditwheel repair``)."""

    def has_ext_modules(self) -> bool:
        return True


# Only this interpreter's extension goes into the wheel (a source tree may hold one
# per Python version).
EXTENSION = f"_kernels{sysconfig.get_config_var('EXT_SUFFIX')}"

setup(
    cmdclass={"build_py": BuildPyWithKernels},
    distclass=BinaryDistribution,
    package_data={"jax_grouped_mlp": [EXTENSION]},
)
