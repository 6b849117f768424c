"""The MoE block on one device: routing, permutation, a float64 reference, errors, Flax.

Expert parallelism is tested in ``moe_sharded_cases.py`` (4 simulated CPU devices,
run in a subprocess by ``test_moe_sharded.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_grouped_mlp as jgm
from jax_grouped_mlp import ExpertParallel, RoutingConfig, moe_block
from jax_grouped_mlp._src.moe.routing import route, sort_by_expert
from jax_grouped_mlp.flax import MoEBlock
from moe_helpers import host_copies

# Relative-error bands (||got - ref|| / ||ref||) of the block against the float64
# unquantized MoE below. The routing itself is exact (inputs are drawn with a clear
# top-k margin), so the error is the expert MLP's. Measured over seeds 0-2 (t=40,
# h=64, f=96, 8 experts): bf16 <= 0.005 everywhere (bf16 operands and outputs,
# 8 mantissa bits); mxfp8 0.044-0.079 (E4M3 keeps 4 significant bits: each quantized
# GEMM operand carries ~3.6% rms error; the router gradient goes through the
# quantized expert outputs). Bands leave >= 1.5x headroom because seeds are fresh.
BANDS = {
    "bf16": {"y": 0.02, "dx": 0.02, "drouter": 0.02, "dw1": 0.02, "dw2": 0.02},
    "mxfp8": {"y": 0.10, "dx": 0.12, "drouter": 0.15, "dw1": 0.12, "dw2": 0.10},
}


# ----------------------------------------------------------------------------------
# Plain float64 MoE, one token at a time, with a hand-written backward pass.
# ----------------------------------------------------------------------------------
def _scores(z, score_function):
    if score_function == "softmax":
        e = np.exp(z - z.max())
        return e / e.sum()
    return 1.0 / (1.0 + np.exp(-z))


def _chosen(z, bias, config):
    s = _scores(z, config.score_function.value)
    pick = s + (0.0 if bias is None else bias)
    return s, np.argsort(-pick, kind="stable")[: config.top_k], pick


def moe_f64(x, router, w1, w2, config, dy, bias=None):
    """Returns ``y`` and ``(dx, drouter, dw1, dw2)`` for cotangent ``dy``, float64."""
    x, router, w1, w2, dy = (np.asarray(a, np.float64) for a in (x, router, w1, w2, dy))
    c = config.routed_scaling_factor
    y, dx = np.zeros_like(x), np.zeros_like(x)
    drouter, dw1, dw2 = np.zeros_like(router), np.zeros_like(w1), np.zeros_like(w2)
    for t in range(x.shape[0]):
        z = x[t] @ router
        s, sel, _ = _chosen(z, bias, config)
        total = s[sel].sum() if config.normalize_weights else 1.0
        weight = c * s[sel] / total
        dweight = np.zeros(len(sel))
        for j, e in enumerate(sel):
            h = x[t] @ w1[e]
            r = np.maximum(h, 0.0)
            out = (r * r) @ w2[e]
            y[t] += weight[j] * out
            dweight[j] = dy[t] @ out
            dw2[e] += np.outer(weight[j] * r * r, dy[t])
            dh = weight[j] * (w2[e] @ dy[t]) * 2.0 * r
            dw1[e] += np.outer(x[t], dh)
            dx[t] += w1[e] @ dh
        ds = np.zeros_like(s)
        if config.normalize_weights:
            ds[sel] = c * (dweight / total - (dweight @ s[sel]) / total**2)
        else:
            ds[sel] = c * dweight
        if config.score_function.value == "softmax":
            dz = s * (ds - ds @ s)
        else:
            dz = ds * s * (1.0 - s)
        drouter += np.outer(x[t], dz)
        dx[t] += router @ dz
    return y, (dx, drouter, dw1, dw2)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _bf16(a):
    return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)


def make_moe(rng, config, t=40, h=64, f=96, e=8, bias=None, margin=1e-3):
    """bf16-exact inputs whose top-k choice has a clear margin for every token."""
    router = _bf16(rng.standard_normal((h, e)) / np.sqrt(h) * 2.0)
    x = _bf16(rng.standard_normal((t, h)))
    for _ in range(100):
        bad = []
        for i in range(t):
            _, sel, pick = _chosen(x[i] @ router, bias, config)
            ordered = np.sort(pick)[::-1]
            if config.top_k < e and ordered[config.top_k - 1] - ordered[config.top_k] < margin:
                bad.append(i)
        if not bad:
            break
        x[bad] = _bf16(rng.standard_normal((len(bad), h)))
    w1 = _bf16(rng.standard_normal((e, h, f)) / np.sqrt(h))
    w2 = _bf16(rng.standard_normal((e, f, h)) / np.sqrt(f))
    dy = _bf16(rng.standard_normal((t, h)))
    return x, router, w1, w2, dy


def run_block(x, router, w1, w2, dy, config, recipe, bias=None):
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    b = None if bias is None else jnp.asarray(bias, jnp.float32)

    def f(x, router, w1, w2):
        return moe_block(x, router, w1, w2, routing=config, score_bias=b, recipe=recipe)

    y, vjp = jax.vjp(f, bf(x), jnp.asarray(router, jnp.float32), bf(w1), bf(w2))
    return y, vjp(bf(dy))


# ----------------------------------------------------------------------------------
# Routing pieces
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [True, False])
def test_route_matches_numpy(rng, score_function, normalize):
    config = RoutingConfig(3, score_function, normalize, routed_scaling_factor=2.5)
    logits = rng.standard_normal((16, 8)).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    ids, weights = route(jnp.asarray(logits), config, jnp.asarray(bias))
    for t in range(16):
        s, sel, _ = _chosen(logits[t].astype(np.float64), bias, config)
        want = s[sel] / (s[sel].sum() if normalize else 1.0) * 2.5
        np.testing.assert_array_equal(np.asarray(ids[t]), sel)
        np.testing.assert_allclose(np.asarray(weights[t]), want, rtol=1e-5)


def test_score_bias_selects_but_does_not_weight():
    config = RoutingConfig(1, "sigmoid", normalize_weights=False)
    logits = jnp.array([[0.0, 1.0]])
    ids, weights = route(logits, config, jnp.array([5.0, 0.0]))
    assert int(ids[0, 0]) == 0
    np.testing.assert_allclose(float(weights[0, 0]), 0.5)  # sigmoid(0), bias not added


def test_sort_by_expert_is_stable_and_counts_on_device():
    ids = jnp.array([2, 0, 2, 4, 1, 0, 2], jnp.int32)  # 4 = padding (num_experts)
    perm = sort_by_expert(ids, 4)
    np.testing.assert_array_equal(perm.order, [1, 5, 4, 0, 2, 6, 3])
    np.testing.assert_array_equal(perm.group_sizes, [2, 1, 3, 0])
    np.testing.assert_array_equal(np.asarray(perm.order)[perm.inverse], np.arange(7))
    jaxpr = str(jax.make_jaxpr(lambda i: sort_by_expert(i, 4).group_sizes)(ids))
    assert "callback" not in jaxpr  # nothing goes to the host


# ----------------------------------------------------------------------------------
# The block against the float64 MoE
# ----------------------------------------------------------------------------------
CONFIGS = {
    "softmax_top2": (RoutingConfig(2), None),
    "softmax_top1_unnormalized": (RoutingConfig(1, normalize_weights=False), None),
    # Nemotron-3 style: sigmoid, normalised, scaled; the bias starves experts 1 and 6.
    "sigmoid_top3_bias": (
        RoutingConfig(3, "sigmoid", True, 2.5),
        np.array([0.0, -9.0, 0.3, 0.0, 0.1, 0.0, -9.0, 0.2]),
    ),
}


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_block_against_float64(rng, recipe, case):
    config, bias = CONFIGS[case]
    x, router, w1, w2, dy = make_moe(rng, config, bias=bias)
    y, (dx, drouter, dw1, dw2) = jax.jit(run_block, static_argnums=(5, 6))(
        x, router, w1, w2, dy, config, recipe, bias
    )
    assert y.shape == x.shape and y.dtype == jnp.bfloat16
    ry, (rdx, rdrouter, rdw1, rdw2) = moe_f64(x, router, w1, w2, config, dy, bias)
    errs = {
        "y": rel_err(y, ry), "dx": rel_err(dx, rdx), "drouter": rel_err(drouter, rdrouter),
        "dw1": rel_err(dw1, rdw1), "dw2": rel_err(dw2, rdw2),
    }
    for k, e in errs.items():
        assert np.isfinite(e) and e < BANDS[recipe][k], f"{k}: rel err {e:.4f} >= {BANDS[recipe][k]} ({errs})"
    if bias is not None:  # starved experts get exactly zero weight gradients
        assert not np.any(np.asarray(dw1[1], np.float32)) and not np.any(np.asarray(dw2[6], np.float32))


def test_leading_axes_and_jit_grad_under_offload_policy(rng):
    config = RoutingConfig(2)
    x, router, w1, w2, dy = make_moe(rng, config, t=24)
    args = (jnp.asarray(x, jnp.bfloat16).reshape(2, 12, -1), jnp.asarray(router, jnp.float32),
            jnp.asarray(w1, jnp.bfloat16), jnp.asarray(w2, jnp.bfloat16))

    def loss(x, router, w1, w2):
        y = moe_block(x, router, w1, w2, routing=config, recipe="bf16")
        return jnp.sum(y.astype(jnp.float32) * jnp.asarray(dy, jnp.float32).reshape(2, 12, -1))

    plain = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    policy = jgm.offload_policy(activation_input="device", fc2_input="recompute")
    remat = jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1, 2, 3))
    copies = host_copies(remat, *args)
    assert {n for c in copies.values() for n in c} == {"fc1_input"}, copies
    for a, b in zip(jax.jit(remat)(*args), plain):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# ----------------------------------------------------------------------------------
# Bad configurations name the argument
# ----------------------------------------------------------------------------------
def _good(e=4, h=8, f=16):
    return (jnp.zeros((5, h), jnp.bfloat16), jnp.zeros((h, e)), jnp.zeros((e, h, f)), jnp.zeros((e, f, h)))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: {"routing": RoutingConfig(5)}, ValueError, "top_k=5"),
        (lambda a: {"router_kernel": jnp.zeros((9, 4))}, ValueError, "router_kernel"),
        (lambda a: {"w1": jnp.zeros((3, 8, 16))}, ValueError, "w1"),
        # A router for another expert count names the router, not only w1.
        (lambda a: {"router_kernel": jnp.zeros((8, 7))}, ValueError,
         r"router_kernel.shape=\(8, 7\) \(\[H, E\]\) scores E=7 experts, but w1.shape=\(4, 8, 16\)"),
        (lambda a: {"w2": jnp.zeros((4, 8, 16))}, ValueError, "w2"),
        (lambda a: {"x": jnp.zeros((8,))}, ValueError, "x.shape"),
        (lambda a: {"x": jnp.zeros((5, 9), jnp.bfloat16)}, ValueError, r"x.shape\[-1\]=9"),
        (lambda a: {"x": jnp.zeros((5, 8), jnp.int32)}, TypeError, "x.dtype"),
        (lambda a: {"score_bias": jnp.zeros((3,))}, ValueError, "score_bias"),
        (lambda a: {"routing": 2}, TypeError, "routing"),
        (lambda a: {"parallel": "expert"}, TypeError, "parallel"),
        (lambda a: {"recipe": "fp4"}, ValueError, "recipe"),
        # What grouped_mlp would refuse, named here as moe_block's arguments (the routed
        # F = 0 named w1 with a permuted x's shape; H = 0 was a ZeroDivisionError; the
        # shared expert's errors named w1 / x of its one-group call).
        (lambda a: {"w1": jnp.zeros((4, 8, 0)), "w2": jnp.zeros((4, 0, 8))}, ValueError,
         r"w1 must be \[E, H, F\] with F >= 1, got w1.shape=\(4, 8, 0\)"),
        (lambda a: {"x": jnp.zeros((5, 0), jnp.bfloat16), "router_kernel": jnp.zeros((0, 4)),
                    "w1": jnp.zeros((4, 0, 16)), "w2": jnp.zeros((4, 16, 0))}, ValueError,
         r"x must be \[..., H\] with H >= 1, got x.shape=\(5, 0\)"),
        (lambda a: {"x": jnp.zeros((5, 8), jnp.float16)}, TypeError, "x must be bfloat16 or float32"),
        (lambda a: {"shared_w1": jnp.zeros((8, 16), jnp.float16), "shared_w2": jnp.zeros((16, 8))},
         TypeError, "shared_w1 must be bfloat16 or float32, got shared_w1.dtype=float16"),
        (lambda a: {"shared_w1": jnp.zeros((8, 16)), "shared_w2": jnp.zeros((16, 8), jnp.float16)},
         TypeError, "shared_w2 must be bfloat16 or float32, got shared_w2.dtype=float16"),
        (lambda a: {"shared_w1": jnp.zeros((8, 0)), "shared_w2": jnp.zeros((0, 8))},
         ValueError, r"shared_w1 must be \[H, Fs\] with Fs >= 1.*shared_w1.shape=\(8, 0\)"),
    ],
)
def test_bad_block_arguments(change, error, match):
    x, router, w1, w2 = _good()
    kw = dict(x=x, router_kernel=router, w1=w1, w2=w2, routing=RoutingConfig(2))
    kw.update(change(kw))
    with pytest.raises(error, match=match):
        moe_block(**kw)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"top_k": 0}, "top_k"),
        ({"top_k": 2, "score_function": "relu"}, "score_function"),
        ({"top_k": 2, "routed_scaling_factor": 0.0}, "routed_scaling_factor"),
    ],
)
def test_bad_routing_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RoutingConfig(**kwargs)


def test_bad_expert_parallel():
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="expert_axis='model'"):
        ExpertParallel(mesh, "model")
    with pytest.raises(ValueError, match="data_axes"):
        ExpertParallel(mesh, "expert", ("expert",))
    with pytest.raises(ValueError, match="exchange"):
        ExpertParallel(mesh, "expert", exchange="nccl")


# ----------------------------------------------------------------------------------
# Flax NNX
# ----------------------------------------------------------------------------------
def test_flax_moe_block_trains(rng):
    block = MoEBlock(
        8, 32, 64, routing=RoutingConfig(2, "sigmoid", True, 2.5), use_score_bias=True,
        recipe="mxfp8", rngs=nnx.Rngs(0),
    )
    x = jnp.asarray(rng.standard_normal((4, 16, 32)), jnp.bfloat16)
    target = jnp.asarray(rng.standard_normal((4, 16, 32)) * 0.1, jnp.float32)
    opt = nnx.Optimizer(block, optax.adam(1e-2), wrt=nnx.Param)
    policy = jgm.offload_policy()

    @nnx.jit
    def step(block, opt, x):
        def loss_fn(block):
            y = nnx.remat(lambda m, v: m(v), policy=policy)(block, x)
            return jnp.mean((y.astype(jnp.float32) - target) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(block)
        opt.update(block, grads)
        return loss

    bias_before = np.asarray(block.score_bias[...])
    losses = [float(step(block, opt, x)) for _ in range(8)]
    assert losses[-1] < losses[0], losses
    np.testing.assert_array_equal(block.score_bias[...], bias_before)  # not a Param: untouched


def test_flax_moe_block_bad_config():
    with pytest.raises(ValueError, match="top_k=9"):
        MoEBlock(8, 32, 64, routing=RoutingConfig(9), rngs=nnx.Rngs(0))


def test_no_tokens(rng):
    h, f, e = 32, 16, 4
    router = jnp.asarray(rng.standard_normal((h, e)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((e, h, f)), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((e, f, h)), jnp.bfloat16)
    y = moe_block(jnp.zeros((0, h), jnp.bfloat16), router, w1, w2, routing=RoutingConfig(top_k=2))
    assert y.shape == (0, h)


@pytest.mark.parametrize("exchange, capacity_factor", [("all_gather", None), ("all_gather", 1.5), ("dense", None)])
def test_no_tokens_under_expert_parallelism(rng, exchange, capacity_factor):
    """Zero tokens (``[0, H]`` or ``[B, 0, H]``) under ExpertParallel give what the block
    gives on one device: an empty output, the same (zero) stats, zero gradients.
    ``exchange="all_gather"`` failed to lower (a size-0 reduce-scatter). One device's
    mesh shows it; moe_sharded_cases.py has four devices with data axes."""
    h, f, e, fs = 8, 16, 4, 12
    router = jnp.asarray(rng.standard_normal((h, e)), jnp.float32)
    w1, w2 = jnp.asarray(rng.standard_normal((e, h, f)), jnp.float32), jnp.asarray(rng.standard_normal((e, f, h)))
    sw1, sw2 = jnp.asarray(rng.standard_normal((h, fs))), jnp.asarray(rng.standard_normal((fs, h)))
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    parallel = ExpertParallel(mesh, "expert", exchange=exchange, capacity_factor=capacity_factor)

    def loss(x, router, w1, w2, sw1, sw2, parallel):
        y, st = moe_block(x, router, w1, w2, routing=RoutingConfig(2, "sigmoid"), recipe="bf16", parallel=parallel,
                          shared_w1=sw1, shared_w2=sw2, return_stats=True, return_router_probs=True)
        return jnp.sum(y.astype(jnp.float32)) + st.load_balancing_loss + st.z_loss, (y, st)

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True), static_argnums=6)
    for shape in ((0, h), (2, 0, h)):
        x = jnp.zeros(shape, jnp.bfloat16)
        want = run(x, router, w1, w2, sw1, sw2, None)
        got = run(x, router, w1, w2, sw1, sw2, parallel)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.shape == w.shape and g.dtype == w.dtype, (g, w)
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        (_, (y, st)), grads = got
        assert y.shape == shape and st.router_probs.shape == (*shape[:-1], e)
        assert not np.any(np.asarray(st.expert_load)) and float(st.load_balancing_loss) == 0 == float(st.z_loss)
        for g in grads:  # zeros, not NaN
            assert not np.any(np.asarray(g, np.float32)), g


@pytest.mark.parametrize("fuse", [True, False])
def test_fuse_fc1_epilogue_reaches_the_mlp(rng, monkeypatch, fuse):
    """moe_block and the Flax MoEBlock pass fuse_fc1_epilogue on to grouped_mlp (the flag
    that makes recomputing fc2_input cheap), with the same result either way. (The block
    gets the op with weights quantized by passes: with groups this small the default
    kernel choices never fuse FC1.)"""
    import functools

    from jax_grouped_mlp._src.moe import block
    from jax_grouped_mlp._src.op import mlp, primitives
    from jax_grouped_mlp._src.op.heuristics import KernelChoices

    monkeypatch.setattr(
        block, "grouped_mlp", functools.partial(mlp.grouped_mlp_with, KernelChoices(quantize_weights_in_gemm=False))
    )

    calls = []
    real = primitives.fc1_fused
    monkeypatch.setattr(primitives, "fc1_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    config = RoutingConfig(2)
    x, router, w1, w2, _ = make_moe(rng, config, t=24)
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(router, jnp.float32),
            jnp.asarray(w1, jnp.bfloat16), jnp.asarray(w2, jnp.bfloat16))
    y = jax.grad(lambda *a: jnp.sum(moe_block(*a, routing=config, fuse_fc1_epilogue=fuse).astype(jnp.float32)))(*args)
    assert bool(calls) == fuse
    calls.clear()
    block = MoEBlock(4, w1.shape[1], w1.shape[2], routing=config, fuse_fc1_epilogue=fuse, rngs=nnx.Rngs(0))
    block(args[0])
    assert bool(calls) == fuse
    assert np.isfinite(np.asarray(y, np.float32)).all()
