"""The per-platform dispatch seam and the FFI registration contract."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_grouped_mlp._src import ffi, primitives


def test_unknown_primitive_is_rejected():
    with pytest.raises(ValueError, match="unknown primitive name='gemm'"):
        primitives.register_cuda_impl("gemm", lambda *a: None)


def test_cuda_impl_is_only_used_when_lowering_for_cuda(monkeypatch, rng):
    """A registered CUDA impl is traced everywhere but must not be what runs on CPU."""
    ref = primitives._REFERENCE["quantize"]
    monkeypatch.setitem(primitives._CUDA_IMPLS, "quantize", lambda x, *, axis: ref(2 * x, axis=axis))
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.bfloat16)
    got = jax.jit(lambda a: primitives.quantize(a, 1))(x)
    want = ref(x, axis=1)
    assert "platform_index" in str(jax.make_jaxpr(lambda a: primitives.quantize(a, 1))(x))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g.view(jnp.uint8)), np.asarray(w.view(jnp.uint8)))


def test_every_called_target_is_registered():
    if not ffi.available():
        pytest.skip("the CUDA extension is not built")
    assert ffi.QUANTIZE_TARGET in ffi.registered_targets()
