"""Quantized tensors stacked by ``jax.vmap`` and ``jax.lax.scan`` (``MXFP8Tensor.rank`` /
``FP8BlockTensor.rank``): dequantized outside the transformation, bitwise the stack of
the examples' own dequantized arrays; scanned over as ``xs``; ``prepare_weights`` under
``vmap`` for a scan over layers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_grouped_mlp as jgm
from jax_grouped_mlp._src.formats import fp8_block
from test_mlp import make_inputs

# (quantize, dequantize) of one example [4, 64, 96] (the axes count in the example).
PLAIN = {
    "mxfp8_axis0": (lambda a: jgm.quantize_mxfp8(a, axis=0), jgm.dequantize),
    "mxfp8_axis-1": (lambda a: jgm.quantize_mxfp8(a, axis=-1), jgm.dequantize),
    "fp8_block_axis1": (lambda a: jgm.quantize_fp8_block(a, axis=1), jgm.dequantize_fp8_block),
    "fp8_block_axes12": (lambda a: jgm.quantize_fp8_block(a, axis=(1, 2)), jgm.dequantize_fp8_block),
}
# Group-aware: (quantize(x [M, K], group_sizes [G]), dequantize).
GROUPED = {
    "mxfp8": (jgm.quantize_mxfp8_grouped, jgm.dequantize),
    "fp8_block": (lambda a, gs: jgm.quantize_fp8_block(a, 0, group_sizes=gs), jgm.dequantize_fp8_block),
}


def _random(rng, shape):
    """Magnitudes over many binades, so that blocks hold elements far below their maximum."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-8, 8, size=shape[:-1] + (1,)))
    return jnp.asarray(x, jnp.float32)


def _group_sizes(rng, batch, m, g):
    """Different sizes per example, some summing past ``m`` or below it."""
    return jnp.asarray(rng.integers(0, m // 2, size=(batch, g)), jnp.int32)


def _same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _f32(dq):
    return functools.partial(dq, dtype=jnp.float32)


@pytest.mark.parametrize("case", list(PLAIN))
def test_vmap_output_dequantizes_outside(rng, case):
    q, dq = PLAIN[case]
    w = _random(rng, (3, 4, 64, 96))
    want = jax.vmap(lambda a: _f32(dq)(q(a)))(w)
    t = jax.vmap(q)(w)
    assert t.batch_ndim == 1 and t.rank == 3
    _same_bits(_f32(dq)(t), want)
    _same_bits(jax.jit(_f32(dq))(t), want)
    # Two batch axes (nested vmap), and dequantize under vmap of the stacked tensor.
    w2 = _random(rng, (2, 3, 4, 64, 96))
    t2 = jax.vmap(jax.vmap(q))(w2)
    assert t2.batch_ndim == 2
    _same_bits(_f32(dq)(t2), jax.vmap(jax.vmap(lambda a: _f32(dq)(q(a))))(w2))
    _same_bits(jax.vmap(_f32(dq))(t2), _f32(dq)(t2))


def test_stacked_swap_last_axes_and_transpose_tiles(rng):
    w = _random(rng, (3, 4, 64, 96))
    for axis in (0, 1, 2):
        t = jax.vmap(lambda a: jgm.quantize_mxfp8(a, axis=axis))(w)
        assert t.blocked_axis == axis + 1
        want = jax.vmap(lambda a: jgm.dequantize(jgm.quantize_mxfp8(a, axis=axis).swap_last_axes(), jnp.float32))(w)
        _same_bits(jgm.dequantize(t.swap_last_axes(), jnp.float32), want)
    t = jax.vmap(lambda a: jgm.quantize_fp8_block(a, axis=(1, 2)))(w)
    assert t.blocked_axes == (2, 3)
    want = jax.vmap(lambda a: jgm.dequantize_fp8_block(
        fp8_block.transpose_tiles(jgm.quantize_fp8_block(a, axis=(1, 2))), jnp.float32))(w)
    _same_bits(jgm.dequantize_fp8_block(fp8_block.transpose_tiles(t), jnp.float32), want)


@pytest.mark.parametrize("case", list(GROUPED))
def test_vmap_output_group_aware_dequantizes_outside(rng, case):
    q, dq = GROUPED[case]
    x = _random(rng, (3, 200, 64))
    gs = _group_sizes(rng, 3, 200, 4)
    want = jax.vmap(lambda a, g: _f32(dq)(q(a, g)))(x, gs)
    t = jax.vmap(q)(x, gs)
    assert t.batch_ndim == 1 and t.group_sizes.shape == (3, 4)
    _same_bits(_f32(dq)(t), want)
    _same_bits(jax.jit(_f32(dq))(t), want)


@pytest.mark.parametrize("case", list(PLAIN) + [f"grouped_{k}" for k in GROUPED])
def test_scan_ys_dequantize_after(rng, case):
    x = _random(rng, (3, 4, 64, 96))
    if case.startswith("grouped_"):
        q, dq = GROUPED[case.removeprefix("grouped_")]
        xs = (x.reshape(3, 256, 96), _group_sizes(rng, 3, 256, 4))
    else:
        q, dq = PLAIN[case]
        xs = (x,)

    def body(c, a):
        return c, q(*a)

    _, ys = jax.jit(lambda xs: jax.lax.scan(body, 0, xs))(xs)
    want = jnp.stack([_f32(dq)(q(*(a[i] for a in xs))) for i in range(3)])
    _same_bits(_f32(dq)(ys), want)


def test_scan_and_vmap_over_a_stacked_tensor(rng):
    """A tensor quantized whole (weights [L, G, A, B] over axes (2, 3)) and sliced per
    layer by scan or vmap: each slice is that layer's tensor."""
    w = _random(rng, (3, 4, 200, 96))
    for q, dq in ((lambda a: jgm.quantize_fp8_block(a, axis=(2, 3)), jgm.dequantize_fp8_block),
                  (lambda a: jgm.quantize_mxfp8(a, axis=-1), jgm.dequantize),
                  (lambda a: jgm.quantize_mxfp8(a, axis=2), jgm.dequantize)):
        t = q(w)
        want = _f32(dq)(t)
        _, ys = jax.lax.scan(lambda c, layer: (c, _f32(dq)(layer)), 0, t)
        _same_bits(ys, want)
        _same_bits(jax.vmap(_f32(dq))(t), want)
    # The blocked axis itself sliced off (one block long, so vmap takes it) is an error
    # naming it.
    one = w[0, :1]  # [1, 200, 96]
    with pytest.raises(ValueError, match=r"t.axis=0 of a rank-3 tensor .*sliced the blocked axis off"):
        jax.vmap(jgm.dequantize)(jgm.quantize_mxfp8(one, axis=0))
    with pytest.raises(ValueError, match=r"t.axes=\(0, 1\) of a rank-3 tensor .*sliced a blocked axis off"):
        jax.vmap(jgm.dequantize_fp8_block)(jgm.quantize_fp8_block(one, axis=(0, 1)))


def test_rank_is_static_and_filled_in(rng):
    x = _random(rng, (70, 40))
    t = jgm.quantize_mxfp8(x, axis=0)
    assert t.rank == 2 and t.batch_ndim == 0 and t.blocked_axis == 0
    assert jgm.MXFP8Tensor(t.data, t.scale, 0, None).rank == 2  # positional, as before
    b = jgm.quantize_fp8_block(x, axis=1)
    assert jgm.FP8BlockTensor(b.data, b.scale, (1,)).rank == 2
    for u in (t, b):
        leaves, treedef = jax.tree.flatten(u)
        assert len(leaves) == 2  # data and scale; axis/axes and rank are static
        # unflattening with placeholders keeps the static rank and never reads them
        assert jax.tree.unflatten(treedef, [object()] * len(leaves)).rank == 2
    # A hand-built tensor with a bad rank, or group sizes without the batch axes, is named.
    with pytest.raises(ValueError, match="t.rank must be a positive int"):
        jgm.dequantize(jgm.MXFP8Tensor(t.data, t.scale, 0, rank=0))
    g = jax.vmap(jgm.quantize_mxfp8_grouped)(jnp.stack([x, x]), jnp.asarray([[30, 40], [0, 70]], jnp.int32))
    with pytest.raises(TypeError, match="t.group_sizes must be a 1-D integer array or None"):
        jgm.dequantize(jgm.MXFP8Tensor(g.data, g.scale, 0, g.group_sizes[0], rank=2))
    with pytest.raises(ValueError, match=r"t.group_sizes must have t.data's batch axes \(2,\)"):
        jgm.dequantize(jgm.MXFP8Tensor(g.data, g.scale, 0, g.group_sizes[:1], rank=2))


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_block", "bf16"])
def test_vmap_prepared_weights_for_a_scan_over_layers(rng, recipe):
    """``jax.vmap(prepare_weights)`` of stacked layer weights, then a scan over the
    layers with ``grouped_mlp(prepared=...)``: forward and gradients bitwise the scan
    without them."""
    layers = 2
    x, _, _, gs, probs, _ = make_inputs(rng, m=64, h=64, f=96, g=4, sizes=[20, 0, 30, 14])
    w1 = jnp.asarray(rng.standard_normal((layers, 4, 64, 96)) / 8, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((layers, 4, 96, 64)) / 8, jnp.float32)

    def loss(x, w1, w2, use: bool):
        pw = jax.vmap(functools.partial(jgm.prepare_weights, recipe=recipe))(w1, w2) if use else None

        def body(h, layer):
            a, b, p = layer
            y = jgm.grouped_mlp(h, a, b, gs, probs, recipe=recipe, prepared=p)
            return (h + y).astype(h.dtype), None

        h, _ = jax.lax.scan(body, x, (w1, w2, pw))
        return jnp.sum(h.astype(jnp.float32) ** 2), h

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    got, want = run(x, w1, w2, True), run(x, w1, w2, False)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_errors_point_at_vmap_mistakes(rng):
    """What a stacked tensor or stacked prepared weights do wrong is named with its fix:
    a batch axis vmap put elsewhere than first, stacked weights given to prepare_weights,
    and per-layer copies given to one layer's op."""
    xs = jnp.asarray(rng.standard_normal((3, 64, 96)), jnp.bfloat16)
    moved = jax.vmap(functools.partial(jgm.quantize_mxfp8, axis=0), out_axes=1)(xs)
    with pytest.raises(ValueError, match="batch axes first: out_axes=0"):
        jgm.dequantize(moved)
    moved = jax.vmap(functools.partial(jgm.quantize_fp8_block, axis=0), out_axes=1)(
        jnp.asarray(rng.standard_normal((3, 128, 96)), jnp.bfloat16))
    with pytest.raises(ValueError, match="batch axes first: out_axes=0"):
        jgm.dequantize_fp8_block(moved)
    x, _, _, gs, probs, _ = make_inputs(rng, m=64, h=64, f=96, g=4, sizes=[20, 0, 30, 14])
    w1 = jnp.asarray(rng.standard_normal((2, 4, 64, 96)) / 8, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((2, 4, 96, 64)) / 8, jnp.float32)
    with pytest.raises(ValueError, match=r"w1 must be rank 3 .*jax.vmap\(prepare_weights\) makes one copy per layer"):
        jgm.prepare_weights(w1, w2)
    stacked = jax.vmap(jgm.prepare_weights)(w1, w2)
    with pytest.raises(ValueError, match="one copy per layer .*pass one layer's slice"):
        jgm.grouped_mlp(x, w1[0], w2[0], gs, probs, prepared=stacked)
    # One layer's slice is what the op takes.
    one = jax.tree.map(lambda a: a[0], stacked)
    np.testing.assert_array_equal(np.asarray(jgm.grouped_mlp(x, w1[0], w2[0], gs, probs, prepared=one), np.float32),
                                  np.asarray(jgm.grouped_mlp(x, w1[0], w2[0], gs, probs), np.float32))
