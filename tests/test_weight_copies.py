"""What the op keeps of float32 master weights between its forward and backward passes
(docs/offload.md, "The weights' bf16 copy"): without ``jax.checkpoint`` the bf16 copies
it made, under ``jax.checkpoint`` with a policy the float32 weights themselves (the cast
runs again in the backward pass), and nothing extra for bf16 weights. The gradients are
the same either way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:  # (private: jax.ad_checkpoint.print_saved_residuals prints the same list)
    from jax._src.ad_checkpoint import saved_residuals
except ImportError:  # pragma: no cover - a jax that moved it
    pytest.skip("this jax has no jax._src.ad_checkpoint.saved_residuals", allow_module_level=True)

import jax_grouped_mlp as jgm

G, M, H, F = 4, 256, 64, 32


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, H)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((G, H, F)) * 0.1, dtype)
    w2 = jnp.asarray(rng.standard_normal((G, F, H)) * 0.1, dtype)
    gs = jnp.asarray([100, 0, 120, 36], jnp.int32)
    return x, w1, w2, gs


def _weight_shaped(saved, dtype) -> list:
    """The saved values with a weight's shape and ``dtype``, and where they come from."""
    shapes = {(G, H, F), (G, F, H)}
    return [why for aval, why in saved if tuple(aval.shape) in shapes and aval.dtype == dtype]


def _loss(x, gs, recipe):
    return lambda w1, w2: jgm.grouped_mlp(x, w1, w2, gs, recipe=recipe).astype(jnp.float32).sum()


ALL_DEVICE = dict(fc1_input="device", activation_input="device", fc2_input="device")


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_float32_masters_keep_bf16_copies_only_without_checkpoint(recipe):
    x, w1, w2, gs = _inputs(jnp.float32)
    plain = _loss(x, gs, recipe)
    remat = jax.checkpoint(plain, policy=jgm.offload_policy(**ALL_DEVICE))
    kept = saved_residuals(plain, w1, w2)
    assert len(_weight_shaped(kept, jnp.bfloat16)) == 2, kept  # one bf16 copy of each weight
    kept = saved_residuals(remat, w1, w2)
    assert _weight_shaped(kept, jnp.bfloat16) == [], kept
    assert len(_weight_shaped(kept, jnp.float32)) == 2, kept  # the masters, held anyway
    want = jax.grad(plain, argnums=(0, 1))(w1, w2)
    got = jax.grad(remat, argnums=(0, 1))(w1, w2)
    for g, r in zip(got, want):
        assert g.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))


def test_bf16_weights_are_kept_as_they_are():
    x, w1, w2, gs = _inputs(jnp.bfloat16)
    kept = saved_residuals(_loss(x, gs, "bf16"), w1, w2)
    weights = _weight_shaped(kept, jnp.bfloat16)
    assert len(weights) == 2 and all("from the argument" in why for why in weights), kept
