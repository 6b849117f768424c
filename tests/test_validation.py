"""Bad input to grouped_mlp raises at trace time, naming the argument and what was expected."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jax_grouped_mlp as jgm

M, H, F, G = 64, 32, 48, 4
X = jax.ShapeDtypeStruct((M, H), jnp.bfloat16)
W1 = jax.ShapeDtypeStruct((G, H, F), jnp.bfloat16)
W2 = jax.ShapeDtypeStruct((G, F, H), jnp.bfloat16)
GS = jax.ShapeDtypeStruct((G,), jnp.int32)
P = jax.ShapeDtypeStruct((M,), jnp.float32)


def sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


CASES = {
    "x_rank": ((sds((M, H, 1)), W1, W2, GS, P), {}, ValueError, r"x must be \[M, H\].*x.shape=\(64, 32, 1\)"),
    "w1_rank": ((X, sds((H, F)), W2, GS, P), {}, ValueError, r"w1 must be \[G, H, F\]"),
    "w2_rank": ((X, W1, sds((F, H)), GS, P), {}, ValueError, r"w2 must be \[G, F, H\]"),
    "h_mismatch": ((X, sds((G, H + 1, F)), W2, GS, P), {}, ValueError, r"w1.shape\[1\] must equal H"),
    "f_mismatch": ((X, W1, sds((G, F + 2, H)), GS, P), {}, ValueError, r"w2 must be \[G, F, H\]=\(4, 48, 32\)"),
    "g_mismatch": ((X, W1, sds((G + 1, F, H)), GS, P), {}, ValueError, r"w2 must be"),
    "gs_float": ((X, W1, W2, sds((G,), jnp.float32), P), {}, TypeError, r"group_sizes must be an integer array.*float32"),
    "gs_length": ((X, W1, W2, sds((G + 1,), jnp.int32), P), {}, ValueError, r"group_sizes must have shape \[G\]=\(4,\)"),
    "gs_rank": ((X, W1, W2, sds((G, 1), jnp.int32), P), {}, ValueError, r"group_sizes must have shape"),
    "x_int": ((sds((M, H), jnp.int32), W1, W2, GS, P), {}, TypeError, r"x must be bfloat16 or float32.*int32"),
    "w1_fp16": ((X, sds((G, H, F), jnp.float16), W2, GS, P), {}, TypeError, r"w1 must be bfloat16 or float32"),
    "probs_shape": ((X, W1, W2, GS, sds((M, 2), jnp.float32)), {}, ValueError, r"probs must be \[M\] or \[M, 1\] with M=64"),
    "probs_int": ((X, W1, W2, GS, sds((M,), jnp.int32)), {}, TypeError, r"probs must be a float array"),
    "recipe": ((X, W1, W2, GS, P), {"recipe": "fp4"}, ValueError, r"recipe must be one of \['mxfp8', 'bf16'\], got recipe='fp4'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_at_trace_time(case):
    args, kwargs, exc, match = CASES[case]
    with pytest.raises(exc, match=match):
        jax.eval_shape(lambda *a: jgm.grouped_mlp(*a, **kwargs), *args)


def test_non_array_arguments():
    with pytest.raises(TypeError, match="group_sizes must be an array"):
        jgm.grouped_mlp(jnp.ones((M, H), jnp.bfloat16), jnp.ones((G, H, F)), jnp.ones((G, F, H)), None)
    with pytest.raises(TypeError, match="x must be an array"):
        jgm.grouped_mlp("tokens", jnp.ones((G, H, F)), jnp.ones((G, F, H)), jnp.ones((G,), jnp.int32))


def test_valid_shapes_trace():
    out = jax.eval_shape(jgm.grouped_mlp, X, W1, W2, GS, P)
    assert out.shape == (M, H) and out.dtype == jnp.bfloat16


def test_numpy_integers_are_accepted_and_bools_are_not():
    import numpy as np
    from flax import nnx

    from jax_grouped_mlp.flax import GroupedMLP

    assert jgm.RoutingConfig(top_k=np.int64(2)).top_k == 2
    assert GroupedMLP(np.int32(2), 32, 32, rngs=nnx.Rngs(0)).num_experts == 2
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        GroupedMLP(True, 8, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        jgm.RoutingConfig(top_k=2.0)
