"""The Flax NNX module: shapes, params, training under nnx.jit + nnx.remat with the policy."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_grouped_mlp as jgm
from gpu_helpers import run_cases_on_cpu_devices
from jax_grouped_mlp.flax import GroupedMLP


def test_params_and_forward(rng):
    m = GroupedMLP(3, 32, 64, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    assert m.w1.shape == (3, 32, 64) and m.w2.shape == (3, 64, 32)
    assert m.w1.dtype == jnp.float32
    x = jnp.asarray(rng.standard_normal((40, 32)), jnp.bfloat16)
    gs = jnp.asarray([10, 0, 25], jnp.int32)
    y = m(x, gs)
    assert y.shape == (40, 32) and y.dtype == jnp.bfloat16
    want = jgm.grouped_mlp(x, m.w1[...].astype(jnp.bfloat16), m.w2[...].astype(jnp.bfloat16), gs)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    assert np.all(np.asarray(y[35:], np.float32) == 0)


def test_float32_params_get_float32_gradients(rng):
    """Default float32 params: the gradient is the op's float32 weight gradient (float32
    sums), not a bf16-rounded one cast back (what a cast before the op would give)."""
    m = GroupedMLP(3, 32, 64, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    x = jnp.asarray(rng.standard_normal((40, 32)), jnp.bfloat16)
    gs = jnp.asarray([10, 7, 23], jnp.int32)
    grads = nnx.grad(lambda mdl: jnp.sum(mdl(x, gs).astype(jnp.float32) ** 2))(m)
    g1 = grads["w1"][...]
    assert g1.dtype == jnp.float32
    want = jax.grad(lambda w: jnp.sum(jgm.grouped_mlp(x, w, m.w2[...], gs).astype(jnp.float32) ** 2))(m.w1[...])
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(want))
    assert np.any(np.asarray(g1) != np.asarray(g1.astype(jnp.bfloat16), np.float32))


@pytest.mark.parametrize("recipe", ["mxfp8", "bf16"])
def test_trains_under_jit_and_remat(rng, recipe):
    g, h, f, m_tokens = 4, 32, 64, 96
    model = GroupedMLP(g, h, f, recipe=recipe, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    x = jnp.asarray(rng.standard_normal((m_tokens, h)), jnp.bfloat16)
    target = jnp.asarray(np.tanh(rng.standard_normal((m_tokens, h))), jnp.float32)
    gs = jnp.asarray([30, 6, 0, 50], jnp.int32)
    probs = jnp.asarray(rng.uniform(0.2, 1.0, m_tokens), jnp.float32)
    policy = jgm.offload_policy(activation_input="device", fc2_input="recompute")

    @nnx.jit
    def step(model, opt):
        def loss_fn(model):
            f_ = nnx.remat(lambda mdl, x: mdl(x, gs, probs), policy=policy)
            return jnp.mean((f_(model, x).astype(jnp.float32) - target) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt)) for _ in range(8)]
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.9 * losses[0], losses


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        GroupedMLP(0, 8, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="recipe must be one of"):
        GroupedMLP(2, 8, 8, recipe="int8", rngs=nnx.Rngs(0))


def test_sharded_cases_on_four_cpu_devices():
    """``flax_sharded_cases.py`` in a fresh interpreter with 4 simulated CPU devices.

    AdamW on an expert-parallel ``MoEBlock`` built without ``jax.set_mesh`` follows the
    single-device trajectory; a model of the modules sharded FSDP/TP-style from their
    logical axis metadata matches one device. (The device-count flag only acts before
    jax starts its CPU backend; see ``test_moe_sharded.py``.)
    """
    run_cases_on_cpu_devices(pathlib.Path(__file__).resolve().parent / "flax_sharded_cases.py",
                             "sharded Flax cases")
