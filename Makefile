# Both main targets set themselves up: they create .venv (Python 3.12 when present),
# install the package with its test extras, and build the CUDA kernels ahead of time
# (skipped, with a message, where there is no CUDA toolkit: the CPU path still works).
.PHONY: wgmma-check demo test test-slow test-all test-oldest-jax test-gpu test-no-excess-precision kernels api-docs
demo: kernels
	@PY=$$(tools/venv.sh) && $$PY examples/demo.py

# The fast suite (about 18 minutes on 2 cores, 2026-12-07); test-slow: the long CPU
# cases (tests/conftest.py SLOW); CI runs both (test-all). Each prints its 25 slowest
# tests, so that a CI log shows where the time goes.
test: kernels
	@PY=$$(tools/venv.sh) && $$PY -m pytest -q -n 2 -m "not slow" --durations=25 tests

test-slow: kernels
	@PY=$$(tools/venv.sh) && $$PY -m pytest -q -n 2 -m slow --durations=25 tests

test-all: test test-slow

# The tests marked oldest_jax (tests/conftest.py OLDEST_JAX: one case of each offload
# mechanism, which reads JAX internals) under the oldest jax the package supports, in
# .venv-oldest-jax (tools/venv_oldest_jax.sh; the package is not installed there, the
# tests import it from the source tree). CI runs it after test-slow. About 3 minutes.
test-oldest-jax:
	@PY=$$(tools/venv_oldest_jax.sh) && PYTHONPATH=. $$PY -m pytest -q -n 2 -m "oldest_jax and not gpu" -p no:cacheprovider --durations=10 tests

# The fast suite with XLA's excess precision off: the CPU then rounds every bf16
# intermediate to bf16, as a GPU does wherever XLA writes one to memory. A bitwise claim
# that holds only through the CPU's float32 intermediates fails here, without a GPU
# (docs/gpu.md, "Before a GPU run"). About 9 minutes on 2 cores.
test-no-excess-precision: kernels
	@PY=$$(tools/venv.sh) && XLA_FLAGS="$$XLA_FLAGS --xla_allow_excess_precision=false" $$PY -m pytest -q -n 2 -m "not slow" tests

# AOT-compiles the CuTe DSL kernels and links jax_grouped_mlp/_kernels*.so (no GPU needed).
# KERNEL_FLAGS=--strict turns a missing toolkit into an error (CI sets it).
kernels:
	@PY=$$(tools/venv.sh) && $$PY tools/build_kernels.py $(KERNEL_FLAGS)

# Fails when ptxas serializes any kernel's wgmmas (C7520; docs/gpu.md). Needs the kernel
# toolchain (nvidia-cutlass-dsl) and the CUDA toolkit's ptxas, no GPU. About a minute.
wgmma-check:
	@PY=$$(tools/venv.sh) && $$PY tools/wgmma_check.py

# On a GPU machine with the extension built: only the tests marked `gpu` (see docs/gpu.md).
test-gpu:
	@PY=$$(tools/venv.sh) && $$PY -m pytest -q -m gpu tests

# The API reference from the public docstrings (pdoc): build/api/index.html.
api-docs:
	@PY=$$(tools/venv.sh) && $$PY tools/api_docs.py --out build/api
