#!/usr/bin/env bash
# Downloads the wheels that make tokamax importable on the H200 device machine (which has
# no network and lacks these; it has jax 0.11.2, flax, jaxtyping, tqdm, absl), into .whl/
# (git-ignored). Run here, then carry ".whl" and start the device command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl || exit 1
#   mkdir -p /tmp/site/xprof/cli && touch /tmp/site/xprof/__init__.py /tmp/site/xprof/cli/__init__.py \
#     && echo 'get_kernel_stats_tool = None' > /tmp/site/xprof/cli/tools.py
#   export PYTHONPATH=.:/tmp/site
# The xprof stub stands in for a 32 MB profiler wheel with heavy dependencies that
# tokamax imports only for its own benchmarking helpers (not for ragged_dot).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for pkg in tokamax==0.0.17 einshape pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
           qwix immutabledict tensorboardx; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$pkg"
done
ls -la .whl
