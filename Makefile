# Both targets set themselves up: they create .venv (Python 3.12 when present) and install
# the package with its test extras before running.
.PHONY: demo test test-gpu
demo:
	@PY=$$(tools/venv.sh) && $$PY examples/demo.py

test:
	@PY=$$(tools/venv.sh) && $$PY -m pytest -q -n 2 tests

# On a GPU machine: runs only the tests marked `gpu`.
test-gpu:
	@PY=$$(tools/venv.sh) && $$PY -m pytest -q -m gpu tests
