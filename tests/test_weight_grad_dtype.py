"""``weight_grad_dtype=jnp.bfloat16``: float32 weights' gradients rounded to bf16 inside
the op and cast back outside it (docs/performance.md, "A training step of a decoder
stack"). Each gradient is exactly the default float32 gradient rounded to bf16 (one
rounding of the same float32 sums); nothing else changes; bad values are named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_grouped_mlp as jgm
from jax_grouped_mlp.flax import GroupedMLP, MoEBlock

G, M, H, F = 4, 192, 64, 32
SIZES = [90, 0, 77, 13]  # an empty group and skew; 12 rows past the groups


def _inputs(rng):
    x = jnp.asarray(rng.standard_normal((M, H)), jnp.bfloat16)
    # float32 masters that are not bf16 values (so a bf16 weight path would differ)
    w1 = jnp.asarray(rng.standard_normal((G, H, F)) * 0.12, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((G, F, H)) * 0.17, jnp.float32)
    probs = jnp.asarray(rng.uniform(0.1, 1.0, M), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((M, H)), jnp.float32)
    return x, w1, w2, jnp.asarray(SIZES, jnp.int32), probs, dy


def _grads(args, recipe, wgd, prepared=False, policy=None):
    x, w1, w2, gs, probs, dy = args

    def loss(x, w1, w2, probs):
        pw = jgm.prepare_weights(w1, w2, recipe=recipe) if prepared else None
        y = jgm.grouped_mlp(x, w1, w2, gs, probs, recipe=recipe, prepared=pw, weight_grad_dtype=wgd)
        return jnp.sum(y.astype(jnp.float32) * dy)

    if policy is not None:
        loss = jax.checkpoint(loss, policy=policy)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w1, w2, probs)


def _as_bf16(a):
    return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "fp8_block"])
@pytest.mark.parametrize("variant", ["plain", "prepared", "offloaded"])
def test_gradients_are_the_float32_ones_rounded_to_bf16(rng, recipe, variant):
    args = _inputs(rng)
    kw = {"prepared": variant == "prepared",
          "policy": jgm.offload_policy() if variant == "offloaded" else None}
    dx, dw1, dw2, dp = _grads(args, recipe, None, **kw)
    ex, ew1, ew2, ep = _grads(args, recipe, jnp.bfloat16, **kw)
    assert ew1.dtype == ew2.dtype == jnp.float32  # the weights' dtype, as JAX requires
    for got, want in ((ew1, dw1), (ew2, dw2)):
        np.testing.assert_array_equal(np.asarray(got), _as_bf16(want))
        assert np.abs(np.asarray(want)).max() > 0  # (not a vacuous comparison)
        assert (np.asarray(want) != _as_bf16(want)).any()  # the default really is float32
    for got, want in ((ex, dx), (ep, dp)):  # the data and probs gradients do not move
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_op_writes_bf16_and_the_cast_back_is_outside_it(rng):
    """The weight gradients leave the op's custom_vjp in bf16; a convert to float32 of a
    weight's shape follows (what XLA fuses into the gradient's consumer)."""
    x, w1, w2, gs, probs, dy = _inputs(rng)

    def casts(wgd):
        fn = jax.grad(lambda w1, w2: jnp.sum(
            jgm.grouped_mlp(x, w1, w2, gs, probs, recipe="bf16", weight_grad_dtype=wgd).astype(jnp.float32)),
            argnums=(0, 1))
        jaxpr = jax.make_jaxpr(fn)(w1, w2).jaxpr
        found = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name != "convert_element_type":
                continue
            src, dst = eqn.invars[0].aval, eqn.outvars[0].aval
            if src.shape in (w1.shape, w2.shape) and src.dtype == jnp.bfloat16 and dst.dtype == jnp.float32:
                found.append(src.shape)
        return sorted(found)

    assert casts(jnp.bfloat16) == sorted([w1.shape, w2.shape])
    assert casts(None) == []


def test_bf16_weights_and_float32_request(rng):
    x, w1, w2, gs, probs, _ = _inputs(rng)
    b1, b2 = w1.astype(jnp.bfloat16), w2.astype(jnp.bfloat16)
    base = jgm.grouped_mlp(x, b1, b2, gs, probs, recipe="bf16")
    # bfloat16 weights: a no-op; "float32" with float32 weights: the default.
    np.testing.assert_array_equal(jgm.grouped_mlp(x, b1, b2, gs, probs, recipe="bf16", weight_grad_dtype="bfloat16"),
                                  base)
    g = jax.grad(lambda w: jgm.grouped_mlp(x, w, w2, gs, probs, recipe="bf16", weight_grad_dtype="float32")
                 .astype(jnp.float32).sum())(w1)
    g0 = jax.grad(lambda w: jgm.grouped_mlp(x, w, w2, gs, probs, recipe="bf16").astype(jnp.float32).sum())(w1)
    np.testing.assert_array_equal(g, g0)


@pytest.mark.parametrize("bad", ["float16", jnp.int8, "fp32x", 3, jnp.zeros((2,), jnp.bfloat16), np.float32(1.0),
                                 jax.ShapeDtypeStruct((2,), jnp.bfloat16), nnx.Param(jnp.zeros((2,), jnp.float32))])
def test_bad_dtype_is_named(rng, bad):
    x, w1, w2, gs, probs, _ = _inputs(rng)
    with pytest.raises(TypeError, match="weight_grad_dtype"):
        jgm.grouped_mlp(x, w1, w2, gs, probs, recipe="bf16", weight_grad_dtype=bad)
    with pytest.raises(TypeError, match="weight_grad_dtype"):
        GroupedMLP(G, H, F, weight_grad_dtype=bad, rngs=nnx.Rngs(0))


def test_float32_gradients_of_bf16_weights_are_refused(rng):
    x, w1, w2, gs, probs, _ = _inputs(rng)
    with pytest.raises(ValueError, match=r"w2\.dtype=bfloat16"):
        jgm.grouped_mlp(x, w1, w2.astype(jnp.bfloat16), gs, probs, weight_grad_dtype=jnp.float32)
    with pytest.raises(ValueError, match="param_dtype=bfloat16"):
        MoEBlock(G, H, F, routing=jgm.RoutingConfig(top_k=2), param_dtype=jnp.bfloat16,
                 weight_grad_dtype=jnp.float32, rngs=nnx.Rngs(0))
    router = jnp.zeros((H, G), jnp.float32)
    with pytest.raises(ValueError, match=r"shared_w1\.dtype=bfloat16"):
        jgm.moe_block(x, router, w1, w2, routing=jgm.RoutingConfig(top_k=2), weight_grad_dtype="float32",
                      shared_w1=jnp.zeros((H, 8), jnp.bfloat16), shared_w2=jnp.zeros((8, H), jnp.float32))


def test_moe_block_module_routed_and_shared_experts(rng):
    """MoEBlock: every expert weight's gradient (routed and shared) is the default one
    rounded to bf16; the router's is unchanged, bit for bit."""
    x = jnp.asarray(rng.standard_normal((48, H)), jnp.bfloat16)
    seed = int(rng.integers(1 << 30))

    def grads(wgd):
        block = MoEBlock(G, H, F, routing=jgm.RoutingConfig(top_k=2), recipe="bf16", shared_ffn=16,
                         weight_grad_dtype=wgd, rngs=nnx.Rngs(seed))
        g = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))(block)
        return {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(g, nnx.Param))}

    base, rounded = grads(None), grads(jnp.bfloat16)
    assert set(base) == set(rounded) and any("router" in k for k in base)
    for name, want in base.items():
        got = np.asarray(rounded[name][...])
        want = np.asarray(want[...])
        if "router" in name:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_array_equal(got, _as_bf16(want), err_msg=name)
