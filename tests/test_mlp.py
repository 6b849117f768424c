"""grouped_mlp forward and all four gradients against independent references."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_grouped_mlp as jgm
from mlp_reference import mlp_f64, rel_err

# Relative-error bands (||got - ref|| / ||ref||) against the float64 *unquantized*
# MLP. bf16: operands and outputs rounded to bf16 (8 mantissa bits) -> ~0.5%.
# mxfp8: E4M3 operands (4 significant bits, ~3.6% RMS rounding each) in both GEMMs,
# and srelu squares h's error: measured ~6% for y and all gradients at these shapes.
BANDS = {
    "bf16": {"y": 0.01, "dx": 0.01, "dw1": 0.01, "dw2": 0.01, "dprobs": 0.01},
    # dprobs is one dot product over F per row, so its error has a heavier tail than the
    # others': over 600 seeds mean 0.060, max 0.085 (tests/ seed sweep, 2026-12-05), too
    # close to 0.09 for a fresh seed every CI run.
    "mxfp8": {"y": 0.08, "dx": 0.09, "dw1": 0.09, "dw2": 0.08, "dprobs": 0.11},
    # Measured the same as mxfp8 on these N(0, 1) inputs (tests/test_fp8_block.py says why).
    "fp8_block": {"y": 0.08, "dx": 0.09, "dw1": 0.09, "dw2": 0.08, "dprobs": 0.11},
}

SIZES = {
    "balanced": [32, 32, 32, 32],
    "zeros_and_skew": [0, 97, 0, 3],
    "one_giant": [128, 0, 0, 0],
    "sum_below_m": [10, 33, 0, 40],
    "sum_above_m": [60, 60, 60, 60],
    "unaligned": [1, 31, 33, 63],
}


def make_inputs(rng, m=128, h=64, f=96, g=4, sizes=None):
    x = rng.standard_normal((m, h))
    w1 = rng.standard_normal((g, h, f)) / np.sqrt(h)
    w2 = rng.standard_normal((g, f, h)) / np.sqrt(f)
    probs = rng.uniform(0.1, 1.0, size=(m,))
    dy = rng.standard_normal((m, h))
    gs = np.asarray(sizes if sizes is not None else [m // g] * g, np.int32)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    return bf(x), bf(w1), bf(w2), jnp.asarray(gs), jnp.asarray(probs, jnp.float32), bf(dy)


def run_op(x, w1, w2, gs, probs, dy, recipe, choices=None):
    """Forward and vjp of the op (``choices``: through the private ``mlp.grouped_mlp_with``)."""
    from jax_grouped_mlp._src.op import mlp

    def f(x, w1, w2, probs):
        if choices is None:
            return jgm.grouped_mlp(x, w1, w2, gs, probs, recipe=recipe)
        return mlp.grouped_mlp_with(choices, x, w1, w2, gs, probs, recipe=recipe)

    y, vjp = jax.vjp(f, x, w1, w2, probs)
    return y, vjp(dy)


@pytest.mark.parametrize("recipe", ["mxfp8", "bf16", "fp8_block"])
@pytest.mark.parametrize("case", list(SIZES))
def test_against_float64(rng, recipe, case):
    x, w1, w2, gs, probs, dy = make_inputs(rng, sizes=SIZES[case])
    y, (dx, dw1, dw2, dp) = jax.jit(run_op, static_argnums=6)(x, w1, w2, gs, probs, dy, recipe)
    assert y.dtype == jnp.bfloat16 and dw1.dtype == w1.dtype and dp.dtype == probs.dtype
    ry, (rdx, rdw1, rdw2, rdp) = mlp_f64(x, w1, w2, gs, probs, dy)
    band = BANDS[recipe]
    errs = {
        "y": rel_err(y, ry), "dx": rel_err(dx, rdx), "dw1": rel_err(dw1, rdw1),
        "dw2": rel_err(dw2, rdw2), "dprobs": rel_err(dp, rdp),
    }
    for k, e in errs.items():
        assert np.isfinite(e) and e < band[k], f"{k}: rel err {e:.4f} >= {band[k]} ({errs})"
    # Rows past the groups' total: zero outputs and zero gradients, exactly.
    total = min(int(np.sum(np.asarray(gs))), x.shape[0])
    for name, arr in (("y", y), ("dx", dx), ("dprobs", dp)):
        assert np.all(np.asarray(arr, np.float32)[total:] == 0), f"{name} rows past the total"
    # Empty groups: exactly zero weight gradients.
    for g, s in enumerate(np.asarray(gs)):
        if s == 0 or sum(np.asarray(gs)[:g]) >= x.shape[0]:
            assert np.all(np.asarray(dw1[g], np.float32) == 0) and np.all(np.asarray(dw2[g], np.float32) == 0)


def _ragged_dot_mlp(x, w1, w2, gs, probs):
    h = jax.lax.ragged_dot(x, w1, gs, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    r = jnp.maximum(h.astype(jnp.float32), 0)
    a = (probs[:, None] * r * r).astype(jnp.bfloat16)
    return jax.lax.ragged_dot(a, w2, gs, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


@pytest.mark.parametrize("case", ["zeros_and_skew", "sum_below_m"])
def test_bf16_recipe_matches_ragged_dot_grad(rng, case):
    x, w1, w2, gs, probs, dy = make_inputs(rng, sizes=SIZES[case])
    y, grads = run_op(x, w1, w2, gs, probs, dy, "bf16")
    ry, rvjp = jax.vjp(lambda *a: _ragged_dot_mlp(*a[:3], gs, a[3]), x, w1, w2, probs)
    rgrads = rvjp(dy)
    assert rel_err(y, ry) < 0.01
    for name, g, r in zip(("dx", "dw1", "dw2", "dprobs"), grads, rgrads):
        assert rel_err(g, r) < 0.02, name


def test_mxfp8_gemm_semantics_exact(rng):
    """The forward equals the float64 MLP on the *dequantized* MXFP8 operands (up to bf16 rounding)."""
    x, w1, w2, gs, probs, _ = make_inputs(rng, sizes=SIZES["zeros_and_skew"])
    y = jgm.grouped_mlp(x, w1, w2, gs, probs)
    dq = lambda a, axis: np.asarray(jgm.dequantize(jgm.quantize_mxfp8(a, axis=axis), jnp.float32), np.float64)
    xq, w1q = dq(x, 1), dq(w1, 1)
    ref_y = np.zeros(y.shape)
    start = 0
    for g, s in enumerate(np.asarray(gs)):
        hh = np.asarray(jnp.asarray(xq[start:start + s] @ w1q[g], jnp.bfloat16), np.float64)
        a = np.asarray(probs, np.float64)[start:start + s, None] * np.maximum(hh, 0) ** 2
        aq = dq(jnp.asarray(a, jnp.bfloat16), 1)  # a is rounded to bf16, then quantized
        ref_y[start:start + s] = aq @ dq(w2, 1)[g]
        start += s
    assert rel_err(y, ref_y) < 5e-3


def test_probs_shapes_and_none(rng):
    x, w1, w2, gs, probs, _ = make_inputs(rng)
    y1 = jgm.grouped_mlp(x, w1, w2, gs, probs)
    y2 = jgm.grouped_mlp(x, w1, w2, gs, probs[:, None])
    np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y2, np.float32))
    y3 = jgm.grouped_mlp(x, w1, w2, gs, None, recipe="bf16")
    y4 = jgm.grouped_mlp(x, w1, w2, gs, jnp.ones_like(probs), recipe="bf16")
    np.testing.assert_array_equal(np.asarray(y3, np.float32), np.asarray(y4, np.float32))


def test_float32_inputs_and_empty_tokens(rng):
    x, w1, w2, gs, probs, _ = make_inputs(rng)
    y = jgm.grouped_mlp(x.astype(jnp.float32), w1.astype(jnp.float32), w2, gs, probs)
    assert y.dtype == jnp.float32
    y0 = jgm.grouped_mlp(x[:0], w1, w2, gs, probs[:0])
    assert y0.shape == (0, x.shape[1])
    g0 = jax.grad(lambda w: jgm.grouped_mlp(x[:0], w, w2, gs).astype(jnp.float32).sum())(w1)
    assert np.all(np.asarray(g0, np.float32) == 0)


def test_deterministic(rng):
    x, w1, w2, gs, probs, dy = make_inputs(rng, sizes=SIZES["unaligned"])
    f = jax.jit(run_op, static_argnums=6)
    a = jax.tree_util.tree_leaves(f(x, w1, w2, gs, probs, dy, "mxfp8"))
    b = jax.tree_util.tree_leaves(f(x, w1, w2, gs, probs, dy, "mxfp8"))
    for u, v in zip(a, b):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


# The op's ordering barriers per (recipe, weights quantized inside the GEMMs) on the CPU
# path (the Nano scan's weight copies: docs/notes/2026-12-07-scan-weight-copies.md):
# "h", the unfused FC1's result as the residual (mlp._residual_copy); "w1", the FC1 dgrad's
# weight pass after dh (only where a pass prepares w1); "token", a weight gradient's
# ordering token (reference.with_order_token; on CUDA the kernel call's second result). dx
# waits for both tokens through a select (mlp._after_tokens, one population count), not a
# barrier. mxfp8 without the _qw GEMMs and fp8_block fuse FC1.
BARRIERS = {
    ("mxfp8", True): ["h", "token", "token"],
    ("mxfp8", False): ["w1", "token", "token"],
    ("bf16", True): ["h", "token", "token"],
    ("bf16", False): ["h", "token", "token"],
    ("fp8_block", True): ["w1", "token", "token"],
    ("fp8_block", False): ["w1", "token", "token"],
}


def _barrier_kinds(text: str, m: int, w1_shape) -> list[str]:
    """Each ``optimization_barrier`` of lowered StableHLO ``text``, named by its operands."""
    w1_type = "tensor<" + "x".join(map(str, w1_shape))
    kinds = []
    for line in text.splitlines():
        if "optimization_barrier" not in line:
            continue
        types = [t.strip() for t in line.split(" : ")[-1].split(", ")]
        if len(types) == 1 and types[0].startswith(f"tensor<{m}x{w1_shape[2]}x"):
            kinds.append("h")
        elif len(types) == 2 and types[0].startswith(w1_type) and types[1].startswith(f"tensor<{m}x"):
            kinds.append("w1")
        elif len(types) == 2 and types[1] == "tensor<1xi32>":
            kinds.append("token")
        else:
            kinds.append(f"unexpected: {types}")
    return sorted(kinds)


@pytest.mark.parametrize("recipe,in_gemm", sorted(BARRIERS))
def test_backward_order_barrier(rng, recipe, in_gemm):
    """The op's ordering barriers (``BARRIERS``): present in the lowered gradient with
    ``order_backward``, none without, and the results the same bits either way."""
    from jax_grouped_mlp._src.op.heuristics import KernelChoices

    x, w1, w2, gs, probs, dy = make_inputs(rng, sizes=SIZES["zeros_and_skew"])

    def barriers(order: bool) -> tuple[list, int, int, list]:
        choices = KernelChoices(order_backward=order, quantize_weights_in_gemm=in_gemm)
        f = functools.partial(run_op, recipe=recipe, choices=choices)
        lowered = jax.jit(f).lower(x, w1, w2, gs, probs, dy)
        text = lowered.as_text()
        kinds = _barrier_kinds(text, x.shape[0], w1.shape)
        # (The compiled program still has the population count: dx waits for the tokens.)
        waits = text.count("stablehlo.popcnt"), lowered.compile().as_text().count(" popcnt(")
        return kinds, *waits, jax.tree_util.tree_leaves(jax.jit(f)(x, w1, w2, gs, probs, dy))

    with jax.default_device(jax.devices("cpu")[0]):  # (the CPU path's table, on a GPU machine too)
        kinds_on, lowered_on, compiled_on, on = barriers(True)
        kinds_off, lowered_off, compiled_off, off = barriers(False)
    assert (kinds_on, kinds_off) == (sorted(BARRIERS[recipe, in_gemm]), [])
    assert (lowered_on, compiled_on, lowered_off, compiled_off) == (1, 1, 0, 0)
    for u, v in zip(on, off):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


def scanned_stack_grads(order: bool, inputs, layers: int = 3, recipe: str = "mxfp8") -> list:
    """Gradients of a ``jax.lax.scan`` of ``layers`` checkpointed op layers (stacked
    weights), with the op's ordering on or off."""
    from jax_grouped_mlp._src.op import mlp
    from jax_grouped_mlp._src.op.heuristics import KernelChoices

    x, w1, w2, gs, probs = inputs
    choices = KernelChoices(order_backward=order)
    layer = jax.checkpoint(lambda x, w: x + mlp.grouped_mlp_with(choices, x, w[0], w[1], gs, probs, recipe=recipe),
                           prevent_cse=False)  # fmt: skip

    def loss(x, w1, w2):
        y, _ = jax.lax.scan(lambda x, w: (layer(x, w), None), x, (w1, w2))
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return [np.asarray(g, np.float32) for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w1, w2)]


def scanned_stack_inputs(rng, layers: int = 3, **shape):
    """Inputs of :func:`scanned_stack_grads`: ``make_inputs(rng, **shape)`` (default:
    zero and skewed groups) with each weight stacked ``layers`` times, scaled per layer."""
    shape.setdefault("sizes", SIZES["zeros_and_skew"])
    x, w1, w2, gs, probs, _ = make_inputs(rng, **shape)
    stack = lambda w: jnp.stack([w * (1 + 0.25 * i) for i in range(layers)])
    return x, stack(w1), stack(w2), gs, probs


def test_scanned_stack_same_bits_with_and_without_the_ordering(rng):
    """A ``jax.lax.scan`` of layers (where the ordering's shape matters most: XLA reads
    the weight slices and writes the stacked gradients in place): the same gradients
    bit for bit with ``order_backward`` on and off."""
    inputs = scanned_stack_inputs(rng)
    for name, a, b in zip(("dx", "dw1", "dw2"), scanned_stack_grads(True, inputs), scanned_stack_grads(False, inputs)):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_weight_gradient_token(rng):
    """``grouped_wgrad(with_token=True)``: the same gradient, and an int32 [1] token."""
    from jax_grouped_mlp._src.op import primitives

    x, _, _, gs, _, _ = make_inputs(rng, sizes=SIZES["zeros_and_skew"])
    h = jnp.asarray(rng.standard_normal((x.shape[0], 24)), jnp.bfloat16)
    want = primitives.grouped_wgrad(x, h, gs, jnp.float32)
    got, token = jax.jit(lambda a, b: primitives.grouped_wgrad(a, b, gs, jnp.float32, with_token=True))(x, h)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert token.shape == (1,) and token.dtype == jnp.int32


def test_weights_quantized_in_the_gemm_same_bits(rng):
    """The MXFP8 op with the weights quantized inside the GEMMs (small groups) and with a
    quantize pass before each GEMM (and the fused FC1 / FC2-dgrad kernels): the same
    output and gradients, bit for bit, on this platform's path."""
    from jax_grouped_mlp._src.op.heuristics import KernelChoices

    x, w1, w2, gs, probs, dy = make_inputs(rng, sizes=SIZES["zeros_and_skew"])

    def results(in_gemm: bool) -> list:
        f = functools.partial(run_op, recipe="mxfp8", choices=KernelChoices(quantize_weights_in_gemm=in_gemm))
        return jax.tree_util.tree_leaves(jax.jit(f)(x, w1, w2, gs, probs, dy))

    for u, v in zip(results(True), results(False)):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


@pytest.mark.parametrize("recipe", ["mxfp8", "bf16"])
def test_float32_weights_take_the_bf16_path(rng, recipe, monkeypatch):
    """float32 (master) weights: every primitive sees bf16 weights (so the CUDA kernels
    take them), y / dx / dprobs are the bits of the op on the bf16-rounded weights, and
    the weight gradients come back in float32, rounding to the bf16 run's gradients."""
    from jax_grouped_mlp._src.op import primitives

    x, w1, w2, gs, probs, dy = make_inputs(rng, sizes=SIZES["zeros_and_skew"])
    w1_32 = (w1.astype(jnp.float32) + jnp.asarray(rng.standard_normal(w1.shape) * 1e-4, jnp.float32))
    w2_32 = (w2.astype(jnp.float32) + jnp.asarray(rng.standard_normal(w2.shape) * 1e-4, jnp.float32))
    seen: list = []
    for name in ("fake_quantize", "grouped_gemm", "grouped_gemm_qw", "fc1_fused", "dgrad_fused"):
        fn = getattr(primitives, name)

        def spy(*args, _fn=fn, **kw):
            seen.extend(a.dtype for a in args if hasattr(a, "ndim") and a.ndim == 3)
            return _fn(*args, **kw)

        monkeypatch.setattr(primitives, name, spy)
    y32, g32 = run_op(x, w1_32, w2_32, gs, probs, dy, recipe)
    assert seen and all(d == jnp.bfloat16 for d in seen), seen
    yb, gb = run_op(x, w1_32.astype(jnp.bfloat16), w2_32.astype(jnp.bfloat16), gs, probs, dy, recipe)
    assert g32[1].dtype == jnp.float32 and g32[2].dtype == jnp.float32
    for got, want in zip((y32, g32[0], g32[3], g32[1].astype(jnp.bfloat16), g32[2].astype(jnp.bfloat16)),
                         (yb, gb[0], gb[3], gb[1], gb[2])):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # float32 sums, not bf16-rounded ones: the float32 gradient carries more bits.
    assert np.any(np.asarray(g32[1]) != np.asarray(g32[1].astype(jnp.bfloat16), np.float32))


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_block"])
def test_a_jitted_loop_has_the_same_gradients_with_and_without_checkpoint(rng, recipe):
    """Three residual layers under one ``jit``: without ``jax.checkpoint`` XLA fused the
    float32 residual-add cotangent into dy's column quantizer unrounded, so dW2 of the
    first layers differed from the checkpointed loop (and the eager one) by 1.5-3.5 %.
    dy is now rounded to its dtype first: every gradient bitwise equal."""
    m, g, h, f = 32, 4, 32, 48
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((3, g, h, f)) / np.sqrt(h), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((3, g, f, h)) / np.sqrt(f), jnp.float32)
    gs, probs = jnp.asarray([8, 5, 0, 12], jnp.int32), jnp.asarray(rng.uniform(0.1, 1, m), jnp.float32)

    def loss(wrap, w1, w2, x):
        layer = wrap(lambda w1, w2, x: x + jgm.grouped_mlp(x, w1, w2, gs, probs, recipe=recipe))
        for i in range(3):
            x = layer(w1[i], w2[i], x)
        return jnp.sum(x.astype(jnp.float32) ** 2)

    plain = jax.jit(jax.grad(functools.partial(loss, lambda f: f), argnums=(0, 1, 2)))(w1, w2, x)
    ckpt = jax.jit(jax.grad(functools.partial(loss, jax.checkpoint), argnums=(0, 1, 2)))(w1, w2, x)
    for name, a, b in zip(("dw1", "dw2", "dx"), plain, ckpt):
        assert np.abs(np.asarray(b, np.float32)).max() > 0
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "fp8_block"])
def test_vmap_of_grad_over_weights_and_probs(rng, recipe):
    """``vmap(grad)`` batched over the weights or over ``probs`` runs (XLA:CPU has no
    batched bf16 x bf16 = f32 dot: the weight gradient's reference GEMM reads float32)
    and equals the per-example gradients bit for bit."""
    m, g, h, f = 32, 4, 32, 48
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((2, g, h, f)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((g, f, h)) / np.sqrt(f), jnp.bfloat16)
    gs = jnp.asarray([8, 5, 0, 12], jnp.int32)
    probs = jnp.asarray(rng.uniform(0.1, 1, (2, m)), jnp.float32)

    def loss(w1, probs):
        return jnp.sum(jgm.grouped_mlp(x, w1, w2, gs, probs, recipe=recipe).astype(jnp.float32) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    for axes in ((0, None), (None, 0)):
        got = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=axes))(w1 if axes[0] == 0 else w1[0],
                                                                             probs if axes[1] == 0 else probs[0])
        for i in range(2):
            want = grad(w1[i] if axes[0] == 0 else w1[0], probs[i] if axes[1] == 0 else probs[0])
            for a, b in zip(got, want):
                assert np.abs(np.asarray(b, np.float32)).max() > 0
                np.testing.assert_array_equal(np.asarray(a[i], np.float32), np.asarray(b, np.float32),
                                              err_msg=f"{axes} {i}")
