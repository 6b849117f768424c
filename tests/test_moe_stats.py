"""Router statistics, the public routing pieces and the shared expert (one device).

References are written here independently of the library: float64 numpy for values,
and plain-JAX formulas (differentiated by ``jax.grad``) for the auxiliary losses'
gradients. The expert-parallel versions are in ``moe_sharded_cases.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_grouped_mlp as jgm
from jax_grouped_mlp import RoutingConfig, moe_block
from jax_grouped_mlp.flax import MoEBlock
from test_moe import BANDS, _chosen, make_moe, moe_f64, rel_err

STAT_CONFIGS = {
    "softmax_top2": (RoutingConfig(2), None),
    "sigmoid_top3_bias": (
        RoutingConfig(3, "sigmoid", True, 2.5),
        np.array([0.0, -9.0, 0.3, 0.0, 0.1, 0.0, -9.0, 0.2]),
    ),
}


def stats_f64(x, router, config, bias=None):
    """(expert_load, load_balancing_loss, z_loss, router_probs), float64, token by token."""
    x, router = np.asarray(x, np.float64), np.asarray(router, np.float64)
    t, e, k = x.shape[0], router.shape[1], config.top_k
    load, probs, z = np.zeros(e, np.int64), np.zeros((t, e)), 0.0
    for i in range(t):
        logits = x[i] @ router
        s, sel, _ = _chosen(logits, bias, config)
        load[sel] += 1
        probs[i] = s if config.score_function.value == "softmax" else s / s.sum()
        m = logits.max()
        z += (m + np.log(np.exp(logits - m).sum())) ** 2
    lb = e * np.sum(load / (t * k) * probs.mean(axis=0))
    return load, lb, z / t, probs


def _args(x, router, w1, w2):
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    return bf(x), jnp.asarray(router, jnp.float32), bf(w1), bf(w2)


# ----------------------------------------------------------------------------------
# Router statistics
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(STAT_CONFIGS))
def test_router_stats_against_float64(rng, case):
    config, bias = STAT_CONFIGS[case]
    x, router, w1, w2, _ = make_moe(rng, config, bias=bias)
    args = _args(x, router, w1, w2)
    b = None if bias is None else jnp.asarray(bias, jnp.float32)
    plain = jax.jit(lambda *a: moe_block(*a, routing=config, score_bias=b, recipe="bf16"))(*args)
    y, stats = jax.jit(
        lambda *a: moe_block(*a, routing=config, score_bias=b, recipe="bf16", return_stats=True,
                             return_router_probs=True)
    )(*args)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(plain, np.float32))  # y unchanged

    load, lb, z, probs = stats_f64(x, router, config, bias)
    assert stats.expert_load.dtype == jnp.int32 and stats.dropped.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(stats.expert_load), load)
    assert int(stats.expert_load.sum()) == x.shape[0] * config.top_k and int(stats.dropped) == 0
    np.testing.assert_allclose(float(stats.load_balancing_loss), lb, rtol=1e-5)
    np.testing.assert_allclose(float(stats.z_loss), z, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(stats.router_probs), probs, rtol=1e-5, atol=1e-7)
    if bias is not None:  # starved by the bias, so f_e = 0 although P_e > 0
        assert load[1] == load[6] == 0 and probs[:, 1].min() > 0


def test_router_stats_leading_axes_and_no_probs_by_default(rng):
    config = RoutingConfig(2)
    x, router, w1, w2, _ = make_moe(rng, config, t=24)
    x3, r, a1, a2 = _args(x, router, w1, w2)
    y, stats = moe_block(x3.reshape(2, 12, -1), r, a1, a2, routing=config, recipe="bf16", return_stats=True)
    assert y.shape == (2, 12, x.shape[1]) and stats.router_probs is None
    _, stats = moe_block(x3.reshape(2, 12, -1), r, a1, a2, routing=config, recipe="bf16", return_stats=True,
                         return_router_probs=True)
    assert stats.router_probs.shape == (2, 12, 8)


@pytest.mark.parametrize("case", list(STAT_CONFIGS))
def test_aux_loss_gradients_against_plain_jax(rng, case):
    """d(lb + z)/d(router, x) against the same formulas in plain JAX, f_e held constant."""
    config, bias = STAT_CONFIGS[case]
    x, router, w1, w2, _ = make_moe(rng, config, bias=bias)
    xs, r, a1, a2 = _args(x, router, w1, w2)
    b = None if bias is None else jnp.asarray(bias, jnp.float32)
    load, *_ = stats_f64(x, router, config, bias)
    f = jnp.asarray(load / (x.shape[0] * config.top_k), jnp.float32)
    e = router.shape[1]

    def reference(x, router):
        logits = jnp.dot(x.astype(jnp.float32), router, precision=jax.lax.Precision.HIGHEST)
        if config.score_function.value == "softmax":
            p = jnp.exp(logits - jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True))
        else:
            s = 1.0 / (1.0 + jnp.exp(-logits))
            p = s / s.sum(-1, keepdims=True)
        lse = jax.scipy.special.logsumexp(logits, axis=-1)
        return e * jnp.sum(f * p.mean(0)) + 0.1 * jnp.mean(lse**2)

    def ours(x, router):
        _, st = moe_block(x, router, a1, a2, routing=config, score_bias=b, recipe="bf16", return_stats=True)
        return st.load_balancing_loss + 0.1 * st.z_loss

    got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))(xs, r)
    want = jax.value_and_grad(reference, argnums=(0, 1))(xs, r)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    assert rel_err(got[1][1], want[1][1]) < 1e-4 and np.any(np.asarray(got[1][1]))
    assert rel_err(got[1][0], want[1][0]) < 1e-2  # dx comes back in bf16


def test_update_score_bias_against_numpy(rng):
    bias = rng.standard_normal(8).astype(np.float32)
    load = np.array([5, 9, 1, 6, 6, 0, 12, 9], np.int32)  # mean 6: expert 3 and 4 stay
    got = jgm.update_score_bias(jnp.asarray(bias), jnp.asarray(load), 0.01)
    # The same float32 arithmetic in NumPy: bitwise (a float64 reference with rtol fails
    # where the step cancels most of the bias, e.g. 0.0101 - 0.01; a CI seed did).
    step = np.sign(load.mean() - load).astype(np.float32) * np.float32(0.01)
    np.testing.assert_array_equal(np.asarray(got), bias + step)
    assert got.dtype == jnp.float32
    g = jax.grad(lambda b: jgm.update_score_bias(b, jnp.asarray(load), 0.01).sum())(jnp.asarray(bias))
    assert not np.any(np.asarray(g))  # stop_gradient
    with pytest.raises(ValueError, match="expert_load.shape"):
        jgm.update_score_bias(jnp.zeros(8), jnp.zeros(7, jnp.int32), 0.01)


def test_stats_without_tokens(rng):
    h, f, e = 32, 16, 4
    router = jnp.asarray(rng.standard_normal((h, e)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((e, h, f)), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((e, f, h)), jnp.bfloat16)
    y, st = moe_block(jnp.zeros((0, h), jnp.bfloat16), router, w1, w2, routing=RoutingConfig(2), return_stats=True)
    assert y.shape == (0, h)
    assert float(st.load_balancing_loss) == 0.0 and float(st.z_loss) == 0.0 and not np.any(st.expert_load)


# ----------------------------------------------------------------------------------
# Public routing pieces: route -> permute -> (your experts) -> combine
# ----------------------------------------------------------------------------------
def dense_moe_f64(x, ids, weights, w1, w2):
    """Plain top-k MoE over unsorted tokens; ids outside [0, E) contribute nothing."""
    x, weights, w1, w2 = (np.asarray(a, np.float64) for a in (x, weights, w1, w2))
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(np.asarray(ids[t])):
            if 0 <= e < w1.shape[0]:
                y[t] += weights[t, j] * (np.maximum(x[t] @ w1[e], 0.0) ** 2) @ w2[e]
    return y


def my_experts(xs, group_sizes, w1, w2):
    """A user's own expert function: every row through its expert with dense einsums."""
    e = w1.shape[0]
    row_expert = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(xs.shape[0]), side="right")
    onehot = jax.nn.one_hot(row_expert, e, dtype=jnp.float32)  # rows past the groups: all zero
    h = jnp.einsum("nh,ehf->nef", xs.astype(jnp.float32), w1)
    a = jnp.maximum(h, 0.0) ** 2
    return jnp.einsum("nef,efh,ne->nh", a, w2, onehot)


def test_permute_and_combine_with_own_expert_function(rng):
    t, h, f, e, k = 20, 16, 24, 6, 2
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((e, h, f)) / np.sqrt(h), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, f, h)) / np.sqrt(f), jnp.float32)
    ids, weights = jgm.route(logits, RoutingConfig(k, "sigmoid"))
    ids = ids.at[3, 1].set(-1).at[7, 0].set(e)  # two pairs the user skips

    def layer(x, weights, w1, w2):
        xs, ws, sizes, perm = jgm.permute(x, ids, weights, e)
        ys = my_experts(xs, sizes, w1, w2)
        ys = ys.at[-2:].set(1e3)  # garbage in the skipped pairs' rows: combine must ignore it
        return jgm.combine(ys, perm, ws), sizes, perm

    y, sizes, perm = jax.jit(layer)(x, weights, w1, w2)
    want = dense_moe_f64(x, ids, weights, w1, w2)
    assert y.shape == (t, h) and y.dtype == jnp.float32
    assert rel_err(y, want) < 1e-5
    np.testing.assert_array_equal(
        np.asarray(sizes), np.bincount(np.asarray(ids).ravel()[(np.asarray(ids).ravel() >= 0) &
                                                               (np.asarray(ids).ravel() < e)], minlength=e)
    )
    assert perm.top_k == k and perm.num_tokens == t
    # Differentiable through permute and combine: against the same MoE written densely.
    dy = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    valid = ((ids >= 0) & (ids < e)).astype(jnp.float32)

    def dense(x, weights, w1, w2):
        out = jnp.einsum("th,ehf->tef", x, w1)
        out = jnp.einsum("tef,efh->teh", jnp.maximum(out, 0.0) ** 2, w2)
        chosen = jnp.take_along_axis(out, jnp.clip(ids, 0, e - 1)[:, :, None], axis=1)
        return jnp.einsum("tkh,tk->th", chosen, weights * valid)

    got = jax.grad(lambda *a: jnp.sum(layer(*a)[0] * dy), argnums=(0, 1, 2, 3))(x, weights, w1, w2)
    ref = jax.grad(lambda *a: jnp.sum(dense(*a) * dy), argnums=(0, 1, 2, 3))(x, weights, w1, w2)
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-5


def test_route_permute_grouped_mlp_combine_is_moe_block(rng):
    """The pieces compose to exactly the block (they are its path)."""
    config = RoutingConfig(2, "sigmoid", True, 2.5)
    x, router, w1, w2, _ = make_moe(rng, config, t=24)
    xs, r, a1, a2 = _args(x, router, w1, w2)

    def by_hand(x, router, w1, w2):
        logits = jnp.dot(x.astype(jnp.float32), router, precision=jax.lax.Precision.HIGHEST)
        ids, weights = jgm.route(logits, config)
        x_sorted, p_sorted, sizes, perm = jgm.permute(x, ids, weights, w1.shape[0])
        return jgm.combine(jgm.grouped_mlp(x_sorted, w1, w2, sizes, p_sorted, recipe="bf16"), perm)

    got = jax.jit(by_hand)(xs, r, a1, a2)
    want = jax.jit(lambda *a: moe_block(*a, routing=config, recipe="bf16"))(xs, r, a1, a2)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, i, w: jgm.permute(x, i.astype(jnp.float32), w, 4), "expert_ids"),
        (lambda x, i, w: jgm.permute(x[:3], i, w, 4), "x must be"),
        (lambda x, i, w: jgm.permute(x, i, w[:, :1], 4), "weights"),
        (lambda x, i, w: jgm.permute(x, i, w, 0), "num_experts"),
        (lambda x, i, w: jgm.combine(x, jgm.permute(x, i, w, 4)[3]), "y_sorted"),
        # numpy's "data type 'foo' not understood", an AttributeError, and an int cast.
        (lambda x, i, w: jgm.combine(jnp.zeros((10, 8)), jgm.permute(x, i, w, 4)[3], dtype="foo"), "dtype"),
        (lambda x, i, w: jgm.combine(jnp.zeros((10, 8)), jgm.permute(x, i, w, 4)[3], dtype=jnp.int32), "dtype"),
        (lambda x, i, w: jgm.combine(jnp.zeros((10, 8)), (1, 2)), "permutation must be the Permutation"),
        (lambda x, i, w: jgm.route(w, RoutingConfig(3)), "top_k=3"),
        (lambda x, i, w: jgm.route(w, RoutingConfig(1), jnp.zeros(3)), "score_bias"),
        (lambda x, i, w: jgm.route(w, RoutingConfig(1), jnp.zeros((5, 2))), "score_bias"),
        (lambda x, i, w: jgm.route(w[None], RoutingConfig(1)), "logits"),
        (lambda x, i, w: jgm.route(i, RoutingConfig(1)), "logits"),
        (lambda x, i, w: jgm.update_score_bias(jnp.zeros(4, jnp.int32), jnp.ones(4), 0.001), "bias.dtype"),
        (lambda x, i, w: jgm.update_score_bias(jnp.zeros(4), jnp.ones(4), -0.5), "rate"),
        (lambda x, i, w: jgm.update_score_bias(jnp.zeros(4), jnp.ones(4), float("nan")), "rate"),
        (lambda x, i, w: jgm.update_score_bias(jnp.zeros(4), jnp.ones(4), np.float32(-1)), "rate"),
        (lambda x, i, w: jgm.update_score_bias(jnp.zeros(4), jnp.ones(4), jnp.asarray(-1.0)), "rate"),
        # A bool was a step of 1.0, a string parsed as a number, a per-expert array unchecked.
        (lambda x, i, w: jgm.update_score_bias(jnp.zeros(4), jnp.ones(4), True), "rate"),
        (lambda x, i, w: jgm.update_score_bias(jnp.zeros(4), jnp.ones(4), "0.1"), "rate"),
        (lambda x, i, w: jgm.update_score_bias(jnp.zeros(4), jnp.ones(4), None), "rate"),
        (lambda x, i, w: jgm.update_score_bias(jnp.zeros(4), jnp.ones(4), jnp.full(4, 0.1)), "rate"),
        (lambda x, i, w: jax.jit(lambda r: jgm.update_score_bias(jnp.zeros(4), jnp.ones(4), r))(jnp.ones(4)),
         "rate"),
    ],
)
def test_bad_permute_combine_arguments(call, match):
    x, ids, w = jnp.zeros((5, 8)), jnp.zeros((5, 2), jnp.int32), jnp.zeros((5, 2))
    with pytest.raises((ValueError, TypeError), match=match):
        call(x, ids, w)


def test_weights_must_be_float_arrays():
    """A list was an AttributeError from the error message itself; combine took integer
    weights (permute now refuses them too: routing weights are floats)."""
    x, ids, w = jnp.zeros((5, 8)), jnp.zeros((5, 2), jnp.int32), jnp.zeros((5, 2))
    xs, ws, _, perm = jgm.permute(x, ids, w, 4)
    calls = {
        "weights must be an array or None, got weights=list": lambda: jgm.permute(x, ids, w.tolist(), 4),
        "weights must be a float array, got weights.dtype=int32": lambda: jgm.permute(x, ids, w.astype(jnp.int32), 4),
        "weights must be a float array, got weights.dtype=bool": lambda: jgm.permute(x, ids, w > 0, 4),
        "weights_sorted must be an array or None, got weights_sorted=list": lambda: jgm.combine(xs, perm, ws.tolist()),
        "weights_sorted must be a float array, got weights_sorted.dtype=int32":
            lambda: jgm.combine(xs, perm, ws.astype(jnp.int32)),
    }
    for match, call in calls.items():
        with pytest.raises(TypeError, match=match):
            call()


def test_route_refuses_complex_and_bool_score_bias():
    """The imaginary part was dropped; the same rule as moe_block's (float or int)."""
    logits = jnp.zeros((5, 4))
    for dtype in (jnp.complex64, jnp.bool_):
        with pytest.raises(TypeError, match=r"score_bias must be a real \(float\) array, got score_bias.dtype="):
            jgm.route(logits, RoutingConfig(2), jnp.zeros(4, dtype))
    ids, _ = jgm.route(logits, RoutingConfig(1), jnp.asarray([0, 0, 1, 0], jnp.int32))
    assert not np.any(np.asarray(ids) != 2)


def test_skipped_pairs_contribute_zero_whatever_they_hold(rng):
    """Masked tokens (logits -inf: NaN softmax weights) skipped by id: their pairs give
    zero output and zero gradients, and an int64 id past 2^32 is skipped, not wrapped
    into [0, E) by a cast."""
    t, h, e = 6, 8, 4
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((t, e)), jnp.float32).at[-2:].set(-jnp.inf)
    ids, w = jgm.route(logits, RoutingConfig(2))
    assert np.isnan(np.asarray(w[-2:])).all()  # the premise: what a masked token's weights are
    ids = ids.at[-2:].set(-1)

    def layer(x, w):
        xs, ws, _, perm = jgm.permute(x, ids, w, e)
        return jgm.combine(xs * 2.0, perm, ws)

    y = layer(x, w)
    np.testing.assert_array_equal(np.asarray(y[-2:]), 0.0)
    np.testing.assert_allclose(np.asarray(y[:-2]), np.asarray(2.0 * x[:-2] * jnp.sum(w[:-2], 1, keepdims=True)),
                               rtol=1e-6)
    dx, dw = jax.grad(lambda x, w: jnp.sum(layer(x, w)), argnums=(0, 1))(x, w)
    assert np.isfinite(np.asarray(dx)).all() and np.isfinite(np.asarray(dw[:-2])).all()
    np.testing.assert_array_equal(np.asarray(dx[-2:]), 0.0)
    wide = np.full((t, 2), 2**32 + 1, np.int64)
    wide[0] = [1, 2]
    sizes = np.asarray(jgm.permute(x, wide, None, e)[2])
    np.testing.assert_array_equal(sizes, [0, 1, 1, 0])
    # Narrow id dtypes with more experts than the dtype holds (uint8 ids, 256 experts).
    narrow = np.asarray([[0, 255], [7, 7]] + [[300 % 256, 1]] * (t - 2), np.uint8)
    sizes = np.asarray(jgm.permute(x, narrow, None, 256)[2])
    np.testing.assert_array_equal(np.nonzero(sizes)[0], [0, 1, 7, 44, 255])
    assert sizes.sum() == 2 * t


# ----------------------------------------------------------------------------------
# Shared expert
# ----------------------------------------------------------------------------------
def shared_f64(x, sw1, sw2, dy):
    x, sw1, sw2, dy = (np.asarray(a, np.float64) for a in (x, sw1, sw2, dy))
    r = np.maximum(x @ sw1, 0.0)
    dh = (dy @ sw2.T) * 2.0 * r
    return (r * r) @ sw2, (dh @ sw1.T, x.T @ dh, (r * r).T @ dy)


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_shared_expert_against_float64(rng, recipe):
    check_shared_expert(rng, recipe, t=40, h=64, f=96, fs=64)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_shared_expert_and_stats_on_gpu(rng, recipe):
    """The CUDA kernels: 640 tokens, so the shared expert's one group has more than
    ``KernelChoices.qw_max_rows_per_group`` rows (MXFP8 takes the fused FC1 path there)
    while the routed groups are small (weights quantized in the GEMM)."""
    assert jax.devices()[0].platform == "gpu"
    stats = check_shared_expert(rng, recipe, t=640, h=256, f=128, fs=384)
    assert int(stats.expert_load.sum()) == 640 * 3


def check_shared_expert(rng, recipe, *, t, h, f, fs):
    """moe_block with a shared expert and stats against float64; returns the stats."""
    config, bias = STAT_CONFIGS["sigmoid_top3_bias"]
    x, router, w1, w2, dy = make_moe(rng, config, t=t, h=h, f=f, bias=bias)
    sw1 = np.asarray(jnp.asarray(rng.standard_normal((h, fs)) / np.sqrt(h), jnp.bfloat16), np.float64)
    sw2 = np.asarray(jnp.asarray(rng.standard_normal((fs, h)) / np.sqrt(fs), jnp.bfloat16), np.float64)
    b = jnp.asarray(bias, jnp.float32)

    def block(x, router, w1, w2, sw1, sw2):
        return moe_block(x, router, w1, w2, routing=config, score_bias=b, recipe=recipe, shared_w1=sw1,
                         shared_w2=sw2, return_stats=True)

    args = (*_args(x, router, w1, w2), jnp.asarray(sw1, jnp.bfloat16), jnp.asarray(sw2, jnp.bfloat16))
    y, vjp, stats = jax.vjp(jax.jit(block), *args, has_aux=True)
    dx, _, _, _, dsw1, dsw2 = vjp(jnp.asarray(dy, jnp.bfloat16))
    ry, (rdx, *_) = moe_f64(x, router, w1, w2, config, dy, bias)
    sy, (sdx, rdsw1, rdsw2) = shared_f64(x, sw1, sw2, dy)
    band = BANDS[recipe]
    errs = {"y": rel_err(y, ry + sy), "dx": rel_err(dx, rdx + sdx), "dsw1": rel_err(dsw1, rdsw1),
            "dsw2": rel_err(dsw2, rdsw2)}
    for name, err in errs.items():
        limit = band["dw1"] if name.startswith("dsw") else band[name]
        assert np.isfinite(err) and err < limit, f"{name}: {err:.4f} >= {limit} ({errs})"
    assert rel_err(y, ry) > 0.1  # the shared expert's part is not negligible
    load, lb, z, _ = stats_f64(x, router, config, bias)
    np.testing.assert_array_equal(np.asarray(stats.expert_load), load)
    np.testing.assert_allclose([float(stats.load_balancing_loss), float(stats.z_loss)], [lb, z], rtol=1e-5)
    return stats


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"shared_w1": jnp.zeros((8, 16))}, ValueError, "shared_w1 and shared_w2"),
        ({"shared_w1": jnp.zeros((7, 16)), "shared_w2": jnp.zeros((16, 8))}, ValueError, "shared_w1 must be"),
        ({"shared_w1": jnp.zeros((8, 16)), "shared_w2": jnp.zeros((8, 16))}, ValueError, "shared_w2 must be"),
        ({"shared_w1": jnp.zeros((8, 16), jnp.int32), "shared_w2": jnp.zeros((16, 8))}, TypeError, "shared_w1.dtype"),
        ({"return_router_probs": True}, ValueError, "return_router_probs=True needs return_stats"),
        ({"return_stats": 1}, TypeError, "return_stats"),
    ],
)
def test_bad_shared_and_stats_arguments(kwargs, error, match):
    e, h, f = 4, 8, 16
    x, router = jnp.zeros((5, h), jnp.bfloat16), jnp.zeros((h, e))
    with pytest.raises(error, match=match):
        moe_block(x, router, jnp.zeros((e, h, f)), jnp.zeros((e, f, h)), routing=RoutingConfig(2), **kwargs)


# ----------------------------------------------------------------------------------
# Flax NNX: shared expert params, sown stats, aux loss, bias update
# ----------------------------------------------------------------------------------
def test_flax_moe_block_sows_stats_and_shared_expert(rng):
    config = RoutingConfig(2, "sigmoid", True, 2.5)
    block = MoEBlock(8, 32, 64, routing=config, use_score_bias=True, recipe="bf16", shared_ffn=48,
                     load_balancing_coef=0.01, z_loss_coef=1e-3, rngs=nnx.Rngs(0))
    assert block.shared_w1.shape == (32, 48) and block.shared_w2.shape == (48, 32)
    assert isinstance(block.shared_w1, nnx.Param)
    assert block.shared_w1.get_metadata("out_sharding") == ("embed", "mlp")  # the experts' logical names
    assert block.shared_w2.get_metadata("out_sharding") == ("mlp", "embed")
    x = jnp.asarray(rng.standard_normal((2, 10, 32)), jnp.bfloat16)
    block.score_bias[...] = jnp.asarray(rng.standard_normal(8) * 0.1, jnp.float32)
    y, inter = _call_and_collect(block, x)
    stats, aux = inter["router_stats"].get_value(), inter["aux_loss"].get_value()
    want_y, want = moe_block(
        x, block.router[...], block.experts.w1[...], block.experts.w2[...], routing=config,
        score_bias=block.score_bias[...], recipe="bf16", shared_w1=block.shared_w1[...],
        shared_w2=block.shared_w2[...], return_stats=True,
    )
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want_y, np.float32))
    np.testing.assert_array_equal(np.asarray(stats.expert_load), np.asarray(want.expert_load))
    np.testing.assert_allclose(float(aux), 0.01 * float(want.load_balancing_loss) + 1e-3 * float(want.z_loss),
                               rtol=1e-6)
    assert not nnx.state(block, nnx.Intermediate)  # captured or popped: nothing left on the block
    # Bias update from the sown load, as a training loop does it.
    before = np.asarray(block.score_bias[...])
    block.update_score_bias(stats.expert_load, 0.001)
    # The same float32 arithmetic in NumPy, bitwise (as test_update_score_bias_against_numpy):
    # a float64 reference with rtol=1e-6 fails where the step cancels most of a bias
    # (|bias -+ 0.001| below ~6e-5: an estimated 1 seed in 400 for N(0, 0.1) biases).
    load = np.asarray(stats.expert_load, np.float64)
    step = np.sign(load.mean() - load).astype(np.float32) * np.float32(0.001)
    np.testing.assert_array_equal(np.asarray(block.score_bias[...]), before + step)
    # Without a coefficient or sow_stats nothing is sown (no state growing per call).
    plain = MoEBlock(8, 32, 64, routing=config, recipe="bf16", rngs=nnx.Rngs(0))
    plain(x)
    assert not nnx.state(plain, nnx.Intermediate)
    _, nothing = _call_and_collect(plain, x)
    assert not nnx.to_flat_state(nothing)


def _call_and_collect(fn, *args):
    """``(output, sown Intermediates)`` of ``fn(*args)`` (``fn`` a module, or a function
    of the module and more): ``nnx.capture`` where flax has it (>= 0.12, where sowing
    outside it is deprecated), else a plain call and ``nnx.pop`` (flax 0.11)."""
    if hasattr(nnx, "capture"):
        return nnx.capture(fn, nnx.Intermediate)(*args)
    out = fn(*args)
    return out, nnx.pop(fn if isinstance(fn, nnx.Module) else args[0], nnx.Intermediate)


@pytest.mark.skipif(not hasattr(nnx, "capture"), reason="flax < 0.12: sowing outside nnx.capture is the only way")
def test_sowing_outside_capture_still_works(rng):
    """The flax 0.11 way (call, then ``nnx.pop``) gives the same values on newer flax,
    with flax's deprecation warning."""
    block = MoEBlock(8, 32, 64, routing=RoutingConfig(2), recipe="bf16", load_balancing_coef=0.01,
                     rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)
    _, captured = nnx.capture(block, nnx.Intermediate)(x)
    with pytest.warns(DeprecationWarning, match="sow"):
        block(x)
    popped = nnx.pop(block, nnx.Intermediate)
    np.testing.assert_array_equal(np.asarray(popped["aux_loss"].get_value()),
                                  np.asarray(captured["aux_loss"].get_value()))


def test_flax_aux_loss_trains_the_router_towards_balance(rng):
    """Training on the aux loss alone lowers it; the gradient reaches the router."""
    config = RoutingConfig(2)
    block = MoEBlock(8, 32, 64, routing=config, recipe="mxfp8", shared_ffn=32, load_balancing_coef=1.0,
                     z_loss_coef=1e-2, rngs=nnx.Rngs(1))
    block.router[...] = block.router[...] + jnp.asarray(rng.standard_normal((32, 8)) * 0.3, jnp.float32)
    x = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
    opt = nnx.Optimizer(block, optax.adam(3e-2), wrt=nnx.Param)
    policy = jgm.offload_policy()

    @nnx.jit
    def step(block, opt):
        def loss_fn(block):
            y, inter = _call_and_collect(nnx.remat(lambda m, v: m(v), policy=policy), block, x)
            aux = sum(v.get_value() for path, v in nnx.to_flat_state(inter) if path[-1] == "aux_loss")
            return 0.0 * jnp.mean(y.astype(jnp.float32)) + aux

        loss, grads = nnx.value_and_grad(loss_fn)(block)
        opt.update(block, grads)
        return loss

    losses = [float(step(block, opt)) for _ in range(10)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"load_balancing_coef": -1.0}, ValueError, "load_balancing_coef"),
        ({"z_loss_coef": "big"}, ValueError, "z_loss_coef"),
        ({"sow_stats": 1}, TypeError, "sow_stats"),
        ({"use_score_bias": "no"}, TypeError, "use_score_bias"),  # truthy: would build a bias
        ({"shared_ffn": 0}, ValueError, "shared_ffn"),
    ],
)
def test_flax_bad_stats_and_shared_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        MoEBlock(8, 32, 64, routing=RoutingConfig(2), rngs=nnx.Rngs(0), **kwargs)


def test_flax_update_score_bias_needs_a_bias():
    block = MoEBlock(8, 32, 64, routing=RoutingConfig(2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="use_score_bias=True"):
        block.update_score_bias(jnp.zeros(8, jnp.int32), 0.001)


def test_update_score_bias_takes_jax_and_numpy_scalar_rates():
    load = jnp.asarray([1.0, 5.0, 3.0, 3.0])
    want = jgm.update_score_bias(jnp.zeros(4), load, 0.25)
    for rate in (np.float32(0.25), jnp.float32(0.25), jnp.asarray(0.25, jnp.bfloat16)):
        np.testing.assert_array_equal(np.asarray(jgm.update_score_bias(jnp.zeros(4), load, rate)), np.asarray(want))
    traced = jax.jit(lambda r: jgm.update_score_bias(jnp.zeros(4), load, r))(0.25)
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(want))
    # Coefficients take concrete JAX scalars too (they were refused while NumPy's were taken).
    block = MoEBlock(8, 32, 64, routing=RoutingConfig(2), load_balancing_coef=jnp.float32(0.5), rngs=nnx.Rngs(0))
    assert block.load_balancing_coef == 0.5


@pytest.mark.skipif(not hasattr(nnx, "capture"), reason="flax < 0.12")
def test_a_block_called_twice_sums_its_stats(rng):
    """Tied weights (or micro-batches inside one loss): the sown aux loss and stats are
    the sums of the calls, not the last call's (which silently dropped the others)."""
    block = MoEBlock(8, 32, 64, routing=RoutingConfig(2), recipe="bf16", load_balancing_coef=1.0,
                     z_loss_coef=0.1, rngs=nnx.Rngs(0))
    x1 = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)
    x2 = jnp.asarray(rng.standard_normal((24, 32)), jnp.bfloat16)
    _, one = nnx.capture(block, nnx.Intermediate)(x1)
    _, two = nnx.capture(block, nnx.Intermediate)(x2)
    _, both = nnx.capture(lambda b, u, v: (b(u), b(v)), nnx.Intermediate)(block, x1, x2)
    aux = float(one["aux_loss"].get_value()) + float(two["aux_loss"].get_value())
    np.testing.assert_allclose(float(both["aux_loss"].get_value()), aux, rtol=1e-6)
    s1, s2, s = (c["router_stats"].get_value() for c in (one, two, both))
    np.testing.assert_array_equal(np.asarray(s.expert_load), np.asarray(s1.expert_load + s2.expert_load))
    assert int(s.expert_load.sum()) == (16 + 24) * 2
    np.testing.assert_allclose(float(s.z_loss), float(s1.z_loss + s2.z_loss), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64])
def test_flax_modules_refuse_non_float_tokens(dtype):
    block = MoEBlock(8, 32, 64, routing=RoutingConfig(2), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="x must be a float array"):
        block(jnp.ones((4, 32), dtype))
    with pytest.raises(TypeError, match="x must be a float array"):
        block.experts(jnp.ones((4, 32), dtype), jnp.asarray([4, 0, 0, 0, 0, 0, 0, 0], jnp.int32))


def test_flax_grouped_mlp_names_x_for_a_wrong_hidden_size():
    mlp = jgm.flax.GroupedMLP(4, 32, 64, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"x must be \[M, hidden=32\]"):
        mlp(jnp.ones((4, 33), jnp.bfloat16), jnp.asarray([4, 0, 0, 0], jnp.int32))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"router_init": lambda key, shape, dtype: jnp.zeros(shape[::-1], dtype)}, r"router_init .*\(32, 8\)"),
        ({"router_init": lambda key, shape, dtype: jnp.zeros(shape, jnp.bfloat16)}, "router_init .*float32"),
        ({"kernel_init": lambda key, shape, dtype: jnp.zeros(shape[-1:], dtype)}, "kernel_init"),
        ({"kernel_init": lambda key, shape, dtype: jnp.zeros(shape, jnp.bfloat16)}, "kernel_init .*float32"),
    ],
)
def test_flax_initializers_are_checked_when_built(kwargs, match):
    """An initializer that ignores its shape or dtype fails where it is given, naming it
    (it failed at the first call, blaming ``x``, or stored a bf16 router)."""
    with pytest.raises(ValueError, match=match):
        MoEBlock(8, 32, 64, routing=RoutingConfig(2), rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize("rngs", [None, 0, jax.random.key(0)])
def test_flax_modules_name_rngs_when_it_is_not_an_nnx_rngs(rngs):
    """``rngs=None`` (or a seed, or a bare key) failed inside Flax with an AttributeError."""
    with pytest.raises(TypeError, match=r"rngs must be an nnx.Rngs \(for example rngs=nnx.Rngs\(0\)\)"):
        MoEBlock(8, 32, 64, routing=RoutingConfig(2), rngs=rngs)
    with pytest.raises(TypeError, match="rngs must be an nnx.Rngs"):
        jgm.flax.GroupedMLP(4, 32, 64, rngs=rngs)


def test_sigmoid_balance_probs_stay_finite_when_every_score_underflows():
    """Logits all below about -88: sigmoid scores are 0 in float32 and their normalisation
    was 0 / 0, a NaN load-balancing loss and router gradient (found by a review)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 32)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((4, 32, 64)) * 0.1, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((4, 64, 32)) * 0.1, jnp.bfloat16)
    routing = RoutingConfig(2, "sigmoid")

    def lb(router):
        _, stats = moe_block(x, router, w1, w2, routing=routing, return_stats=True, recipe="bf16")
        return stats.load_balancing_loss

    far = jnp.asarray(rng.uniform(-30.0, -20.0, (32, 4)), jnp.float32)  # logits ~ -1000
    assert np.isfinite(float(lb(far))) and np.isfinite(np.asarray(jax.grad(lb)(far))).all()
    near = jnp.asarray(rng.standard_normal((32, 4)) * 0.1, jnp.float32)
    logits = (x.astype(jnp.float32) @ near)
    scores = jax.nn.sigmoid(logits)
    from jax_grouped_mlp._src.moe import router_stats

    np.testing.assert_allclose(np.asarray(router_stats.balance_probs(logits, routing)),
                               np.asarray(scores / scores.sum(-1, keepdims=True)), rtol=2e-6)
