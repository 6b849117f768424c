"""The block's row gathers (``routing.gather_pairs``): the values of plain indexing, and a
backward that gathers and sums each token's pairs in float32 instead of scatter-adding
them into a zero-filled buffer in the tokens' dtype (on XLA:GPU, in no fixed order)."""

from __future__ import annotations

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest

import jax_grouped_mlp as jgm
from jax_grouped_mlp._src.moe.routing import gather_pairs

T, H, F, E = 64, 32, 16, 8


def _pairs(rng, t, k):
    order = jnp.asarray(rng.permutation(t * k), jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=jnp.int32))
    return order, inverse


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("k,rows", [(1, None), (6, None), (6, 200), (2, 0)])
def test_values_and_gradient_against_float64(rng, dtype, k, rows):
    x = jnp.asarray(rng.standard_normal((T, H)), dtype)
    order, inverse = _pairs(rng, T, k)
    if rows is not None:  # only the first `rows` pairs (the all-gather exchange under a capacity)
        order = order[:rows]
    ct = jnp.asarray(rng.standard_normal((order.shape[0], H)), dtype)
    got, vjp = jax.vjp(lambda x: gather_pairs(x, order, inverse, k), x)
    np.testing.assert_array_equal(got, x[order // k])
    (dx,) = vjp(ct)
    assert dx.dtype == dtype
    want = np.zeros((T, H), np.float64)
    np.add.at(want, np.asarray(order) // k, np.asarray(ct, np.float64))
    size = np.zeros((T, H), np.float64)
    np.add.at(size, np.asarray(order) // k, np.abs(np.asarray(ct, np.float64)))
    # A float32 sum of at most k terms (error below k * eps32 * sum |terms|), rounded once
    # to the dtype (within one of its ulps; bf16 keeps 8 of float32's 24 significand bits).
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    if dtype == jnp.bfloat16:
        ulp *= 2.0**16
    bound = ulp + k * np.finfo(np.float32).eps * size
    assert (np.abs(np.asarray(dx, np.float64) - want) <= bound).all()
    if k == 1:
        (plain,) = jax.vjp(lambda x: x[order], x)[1](ct)
        np.testing.assert_array_equal(dx, plain)


def test_sums_in_float32(rng):
    """The bf16 cotangent rows are summed in float32 (the values alone cannot show it)."""
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    order, inverse = _pairs(rng, T, 6)
    vjp = jax.vjp(lambda x: gather_pairs(x, order, inverse, 6), x)[1]
    eqns = jax.make_jaxpr(vjp)(x[order // 6]).eqns
    names = [(e.primitive.name, str(e.outvars[0].aval.dtype)) for e in eqns]
    assert ("reduce_sum", "float32") in names and ("reduce_sum", "bfloat16") not in names, names


def test_block_gradient_under_strict_dtype_promotion(rng):
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((H, E)) * 0.1, jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((E, H, F)) * 0.1, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((E, F, H)) * 0.1, jnp.float32)
    routing = jgm.RoutingConfig(top_k=6, score_function="sigmoid", routed_scaling_factor=2.5)
    loss = lambda *a: jnp.sum(jgm.moe_block(*a, routing=routing).astype(jnp.float32) ** 2)  # noqa: E731
    want = jax.grad(loss, argnums=(0, 1, 2, 3))(x, router, w1, w2)
    with jax.numpy_dtype_promotion("strict"):
        got = jax.grad(loss, argnums=(0, 1, 2, 3))(x, router, w1, w2)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_is_reverse_mode_only(rng):
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    order, inverse = _pairs(rng, T, 2)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda x: gather_pairs(x, order, inverse, 2), (x,), (x,))


def _float_scatters(jaxpr) -> list[str]:
    """Float scatter-adds anywhere in ``jaxpr`` (sub-jaxprs included)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scatter-add" and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
            found.append(eqn.outvars[0].aval.str_short())
        for sub in jex_core.jaxprs_in_params(eqn.params):
            found += _float_scatters(sub)
    return found


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_moe_block_backward_scatters_no_rows(rng, recipe):
    """Plain indexing (the block before) transposes to float scatter-adds of ``[T, H]``
    and ``[T*k, H]``; the block's backward now only gathers rows."""
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((H, E)) * 0.1, jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((E, H, F)) * 0.1, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((E, F, H)) * 0.1, jnp.float32)
    routing = jgm.RoutingConfig(top_k=6, score_function="sigmoid", routed_scaling_factor=2.5)

    def loss(x, router, w1, w2):
        return jnp.sum(jgm.moe_block(x, router, w1, w2, routing=routing, recipe=recipe).astype(jnp.float32) ** 2)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    rows = {f"float32[{T},{H}]", f"bfloat16[{T},{H}]", f"float32[{T * 6},{H}]"}  # (not the router's [T, E])
    assert rows & set(_float_scatters(jax.make_jaxpr(grad)(x, router, w1, w2).jaxpr)) == set()
    # The public pieces keep plain indexing (forward mode works), hence the scatters.
    def pieces(x):
        ids, weights = jgm.route(x.astype(jnp.float32) @ router, routing)
        xs, ps, sizes, perm = jgm.permute(x, ids, weights, E)
        return jnp.sum(jgm.combine(xs.astype(jnp.float32) * ps[:, None], perm))

    assert {f"bfloat16[{T},{H}]", f"float32[{T * 6},{H}]"} <= set(_float_scatters(jax.make_jaxpr(jax.grad(pieces))(x).jaxpr))
    gx = jax.jit(grad)(x, router, w1, w2)[0]
    assert np.isfinite(np.asarray(gx, np.float32)).all() and np.abs(np.asarray(gx, np.float32)).max() > 0


def test_moe_block_gradients_repeat_bit_for_bit(rng):
    """Two runs of the same jitted gradient agree bit for bit. Only a GPU can fail it (the
    scatter-add of the tokens' pairs that this replaced added in no fixed order there);
    the GPU machine runs this file on its GPU."""
    x = jnp.asarray(rng.standard_normal((256, H)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((H, E)) * 0.1, jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((E, H, F)) * 0.1, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((E, F, H)) * 0.1, jnp.float32)
    routing = jgm.RoutingConfig(top_k=6, score_function="sigmoid", routed_scaling_factor=2.5)
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(jgm.moe_block(*a, routing=routing).astype(jnp.float32) ** 2),
                            argnums=(0, 1, 2, 3)))
    first = jax.device_get(grad(x, router, w1, w2))
    for _ in range(3):
        for got, want in zip(jax.device_get(grad(x, router, w1, w2)), first):
            np.testing.assert_array_equal(got, want)
