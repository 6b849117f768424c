# Both main targets set themselves up: they create .venv (Python 3.12 when present),
# install the package with its test extras, and build the CUDA kernels ahead of time
# (skipped, with a message, where there is no CUDA toolkit: the CPU path still works).
.PHONY: demo test test-gpu kernels api-docs
demo: kernels
	@PY=$$(tools/venv.sh) && $$PY examples/demo.py

test: kernels
	@PY=$$(tools/venv.sh) && $$PY -m pytest -q -n 2 tests

# AOT-compiles the CuTe DSL kernels and links jax_grouped_mlp/_kernels*.so (no GPU needed).
# KERNEL_FLAGS=--strict turns a missing toolkit into an error (CI sets it).
kernels:
	@PY=$$(tools/venv.sh) && $$PY tools/build_kernels.py $(KERNEL_FLAGS)

# On a GPU machine with the extension built: only the tests marked `gpu` (see docs/gpu.md).
test-gpu:
	@PY=$$(tools/venv.sh) && $$PY -m pytest -q -m gpu tests

# The API reference from the public docstrings (pdoc): build/api/index.html.
api-docs:
	@PY=$$(tools/venv.sh) && $$PY tools/api_docs.py --out build/api
