"""Without its CUDA extension on a machine with CUDA devices, the op warns once that it
runs the pure-JAX reference (otherwise a silent slowdown of tens of times), and the
op-level benchmarks refuse to time it under the op's name."""

from __future__ import annotations

import pathlib
import sys
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from jax_grouped_mlp._src.cuda import devices, ffi
from jax_grouped_mlp._src.op import primitives

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402

FAKE_GPU = (devices.CudaDevice(0, "NVIDIA H200", "9.0", True),)


@pytest.fixture
def no_kernels(monkeypatch):
    monkeypatch.setattr(primitives, "_CUDA_IMPLS", {})
    primitives._warn_reference_on_gpu.cache_clear()
    yield
    primitives._warn_reference_on_gpu.cache_clear()


def _x():
    return jnp.asarray(np.random.default_rng(0).standard_normal((64, 64)), jnp.bfloat16)


def test_warns_once_with_cuda_devices_and_no_kernels(no_kernels, monkeypatch):
    monkeypatch.setattr(devices, "cuda_devices", lambda: FAKE_GPU)
    with pytest.warns(RuntimeWarning, match="CUDA extension is not loaded.*pure-JAX reference"):
        primitives.quantize(_x(), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        primitives.quantize(_x(), 1)  # (once per process)


def test_the_warning_names_the_users_line(no_kernels, monkeypatch):
    """Raised from deep inside tracing (jit, the op's custom_vjp, the primitive's
    dispatch), it names this file's line, not the library's or JAX's."""
    import jax

    import jax_grouped_mlp as jgm

    monkeypatch.setattr(devices, "cuda_devices", lambda: FAKE_GPU)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((2, 32, 16)) * 0.1, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((2, 16, 32)) * 0.1, jnp.bfloat16)
    gs = jnp.asarray([40, 24], jnp.int32)
    jax.clear_caches()  # (a cached trace of the same shapes would warn nothing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.grad(lambda w: jax.jit(jgm.grouped_mlp)(x, w, w2, gs).astype(jnp.float32).sum())(w1)
    (w,) = [c for c in caught if issubclass(c.category, RuntimeWarning)]
    assert w.filename == __file__, (w.filename, w.lineno)


def test_silent_without_cuda_devices(no_kernels, monkeypatch):
    monkeypatch.setattr(devices, "cuda_devices", lambda: ())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        primitives.quantize(_x(), 1)


def test_not_asked_where_kernels_are_registered(monkeypatch):
    asked = []
    monkeypatch.setattr(primitives, "_CUDA_IMPLS", {"grouped_gemm": lambda *a, **k: None})
    monkeypatch.setattr(primitives, "_warn_reference_on_gpu", lambda: asked.append(1))
    primitives.quantize(_x(), 1)  # (no kernel of its own: the reference, silently)
    assert not asked


def test_benchmarks_refuse_a_gpu_without_the_extension(monkeypatch):
    monkeypatch.delenv("JGM_BENCH_ALLOW_REFERENCE", raising=False)
    monkeypatch.setattr(common.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(ffi, "available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA extension.*JGM_BENCH_ALLOW_REFERENCE=1"):
        common.require_kernels()
    monkeypatch.setenv("JGM_BENCH_ALLOW_REFERENCE", "1")
    common.require_kernels()  # allowed on purpose


def test_benchmarks_run_on_cpu_or_with_the_extension(monkeypatch):
    monkeypatch.delenv("JGM_BENCH_ALLOW_REFERENCE", raising=False)
    monkeypatch.setattr(common.jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(ffi, "available", lambda: False)
    common.require_kernels()  # the CPU reference path is what runs there
    monkeypatch.setattr(common.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(ffi, "available", lambda: True)
    common.require_kernels()
