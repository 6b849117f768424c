"""Expert parallelism on 4 simulated CPU devices.

Not collected by the main test run (the name does not start with ``test_``):
``test_moe_sharded.py`` runs this file in a fresh interpreter with
``--xla_force_host_platform_device_count=4``, because that flag only acts before jax
starts its CPU backend and must not change the device count of other test files.
Run it directly with ``python -m pytest tests/moe_sharded_cases.py``.

Tolerances against the single-device block (relative, ||got - want|| / ||want||):
the expert-parallel path computes every row with the same operands in the same
order, and the combine sums the top-k outputs in the same float32 order, so the
outputs and the token gradient come out bit-identical, and the router and weight
gradients agree to float32 reassociation (partial sums added across devices;
measured <= 5e-7). Band: 1e-5. The exception allowed for is ``recipe="mxfp8"``
with data axes: an expert's tokens are then split over the data shards, so a
weight-gradient GEMM may quantize different 32-token blocks (MXFP8 wgrad blocks
run along the token axis) before the shards' sums are added. Band for those:
5e-2, about one E4M3 rounding (the CPU reference measured <= 5e-7 here too).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_grouped_mlp as jgm  # noqa: E402
from jax_grouped_mlp import Exchange, ExpertParallel, RoutingConfig, moe_block  # noqa: E402
from jax_grouped_mlp._src.moe.exchange import ragged_all_to_all  # noqa: E402
from jax_grouped_mlp._src.moe.routing import route  # noqa: E402
from jax_grouped_mlp.flax import MoEBlock  # noqa: E402
from moe_helpers import host_copies  # noqa: E402

P = jax.sharding.PartitionSpec

if jax.device_count() < 4:
    pytest.skip(
        "needs 4 devices: run through test_moe_sharded.py (XLA_FLAGS was set too late)",
        allow_module_level=True,
    )

T, H, F, E = 45, 64, 96, 8  # 45 tokens: no even split over 2 or 4 token shards
EXACT, MXFP8_WGRAD_WITH_DATA_AXES = 1e-5, 5e-2


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def mesh_of(ep: int, data: int, axis_type=jax.sharding.AxisType.Explicit):
    return jax.make_mesh(
        (data, ep), ("data", "expert"), axis_types=(axis_type,) * 2, devices=jax.devices()[: data * ep]
    )


def make_inputs(rng):
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    x = bf(rng.standard_normal((T, H)))
    router = jnp.asarray(rng.standard_normal((H, E)) / np.sqrt(H), jnp.float32)
    # float32 weights (as MoEBlock passes its params): their gradients are summed over
    # the data shards in float32, not after a per-shard bf16 rounding.
    w1 = jnp.asarray(rng.standard_normal((E, H, F)) / np.sqrt(H), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((E, F, H)) / np.sqrt(F), jnp.float32)
    dy = bf(rng.standard_normal((T, H)))
    # Skewed: expert 0 is nearly always chosen, experts 3 and 6 never (they own no
    # tokens on any device), the rest share what is left unevenly.
    bias = jnp.asarray([3.0, 0.4, 0.2, -20.0, 0.0, 0.1, -20.0, 0.3], jnp.float32)
    return x, router, w1, w2, dy, bias


def value_and_grads(config, recipe, parallel):
    def loss(x, router, w1, w2, dy, bias):
        y = moe_block(x, router, w1, w2, routing=config, score_bias=bias, recipe=recipe, parallel=parallel)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


LAYOUTS = {"ep1_data4": (1, 4), "ep2_data2": (2, 2), "ep4": (4, 1)}
CASES = {
    "bf16_softmax": ("bf16", RoutingConfig(2)),
    "mxfp8_sigmoid": ("mxfp8", RoutingConfig(3, "sigmoid", True, 2.5)),
}


@pytest.fixture(scope="module")
def single_device_results():
    rng = np.random.default_rng(int(os.environ.get("JGM_SEED", "0")))
    inputs = make_inputs(rng)
    out = {}
    for case, (recipe, config) in CASES.items():
        (_, y), grads = value_and_grads(config, recipe, None)(*inputs)
        out[case] = (y, grads)
    return inputs, out


# The all-gather exchange runs the same rows in the same order; only each token's
# float32 sum of its top-k outputs is added across devices (a reduce-scatter) in
# another association, which can move a bf16 output (and dx) by one ulp when k > 2.
ALL_GATHER_BF16_BAND = 2e-3


@pytest.mark.parametrize("exchange", ["auto", "all_gather"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_matches_single_device(single_device_results, case, layout, exchange):
    inputs, singles = single_device_results
    recipe, config = CASES[case]
    ep, data = LAYOUTS[layout]
    x, router, _, _, _, bias = inputs
    ids, _ = route(x.astype(jnp.float32) @ router, config, bias)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=E)
    assert counts[3] == counts[6] == 0 and counts[0] == T  # the skew the test is about

    parallel = ExpertParallel(mesh_of(ep, data), "expert", ("data",), exchange=exchange)
    (_, y), grads = value_and_grads(config, recipe, parallel)(*inputs)
    want_y, want_grads = singles[case]
    assert y.shape == (T, H) and y.dtype == jnp.bfloat16
    errs = {"y": rel_err(y, want_y)}
    errs.update({n: rel_err(g, w) for n, g, w in zip(("dx", "drouter", "dw1", "dw2"), grads, want_grads)})
    for name, err in errs.items():
        band = MXFP8_WGRAD_WITH_DATA_AXES if (recipe == "mxfp8" and data > 1 and name in ("dw1", "dw2")) else EXACT
        if exchange == "all_gather" and name in ("y", "dx"):
            band = max(band, ALL_GATHER_BF16_BAND)
        assert err <= band, f"{name}: rel err {err:.2e} > {band} ({errs})"
    for g in (np.asarray(grads[2]), np.asarray(grads[3])):  # experts without tokens: exactly zero
        assert not np.any(g[3]) and not np.any(g[6])


@pytest.mark.parametrize("exchange", ["auto", "all_gather"])
@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_capacity_factor_drops_the_documented_pairs(single_device_results, factor, exchange):
    """capacity_factor=c: each device keeps the first ceil(c * local pairs) arrivals.

    Expected result: the single-device computation with the dropped pairs' routing
    weights set to zero (grouped_mlp then gives exact zeros for them).
    """
    inputs, singles = single_device_results
    x, router, w1, w2, dy, bias = inputs
    recipe, config = CASES["bf16_softmax"]
    ep, k = 4, config.top_k
    t_local, e_local = -(-T // ep), E // ep
    rows = min(ep * t_local * k, int(np.ceil(factor * t_local * k)))
    logits = jnp.dot(x.astype(jnp.float32), router, precision=jax.lax.Precision.HIGHEST)
    ids, weights = (np.asarray(a) for a in route(logits, config, bias))
    keep = np.zeros((T, k), bool)
    for dest in range(ep):
        taken = 0
        for src in range(ep):  # arrivals: by source, then (expert, token, choice)
            block = sorted(
                (ids[t, c], t * k + c)
                for t in range(src * t_local, min((src + 1) * t_local, T))
                for c in range(k)
                if ids[t, c] // e_local == dest
            )
            for _, pair in block:
                keep[pair // k, pair % k] = taken < rows
                taken += 1
    assert keep.all() if factor >= ep else not keep.all()

    order = np.argsort(ids.reshape(-1), kind="stable")
    sizes = jnp.asarray(np.bincount(ids.reshape(-1), minlength=E), jnp.int32)
    probs = jnp.asarray((weights * keep).reshape(-1)[order], jnp.float32)
    y_pairs = np.asarray(jgm.grouped_mlp(x[order // k], w1, w2, sizes, probs, recipe=recipe), np.float32)
    want = y_pairs[np.argsort(order)].reshape(T, k, H).sum(axis=1)

    parallel = ExpertParallel(mesh_of(ep, 1), "expert", capacity_factor=factor, exchange=exchange)
    (_, y), grads = value_and_grads(config, recipe, parallel)(*inputs)
    assert rel_err(y, jnp.asarray(want, jnp.bfloat16)) <= EXACT
    _, stats = jax.jit(lambda *a: moe_block(*a, routing=config, score_bias=bias, recipe=recipe, parallel=parallel,
                                            return_stats=True))(x, router, w1, w2)
    assert int(stats.dropped) == int((~keep).sum())  # the numpy count of the same rule
    np.testing.assert_array_equal(np.asarray(stats.expert_load), np.bincount(ids.reshape(-1), minlength=E))
    if factor >= ep:
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(singles["bf16_softmax"][0], np.float32))
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads)


def test_auto_axis_mesh_and_no_data_axes(single_device_results):
    inputs, singles = single_device_results
    recipe, config = CASES["bf16_softmax"]
    parallel = ExpertParallel(mesh_of(4, 1, jax.sharding.AxisType.Auto), "expert")
    (_, y), grads = value_and_grads(config, recipe, parallel)(*inputs)
    assert rel_err(y, singles["bf16_softmax"][0]) <= EXACT
    for g, w in zip(grads, singles["bf16_softmax"][1]):
        assert rel_err(g, w) <= EXACT


def test_dense_exchange_has_ragged_all_to_all_semantics():
    """The CPU stand-in against a numpy transcription of ragged_all_to_all's definition."""
    rng = np.random.default_rng(1)
    n, out_rows, d = 6, 10, 4
    send = rng.integers(0, 3, size=(d, d))  # send[s, r]: rows s sends to r
    operand = rng.standard_normal((d, n, 2)).astype(np.float32)
    in_off = np.stack([np.concatenate([[0], np.cumsum(send[s])[:-1]]) for s in range(d)])
    # Receivers leave one-row gaps between the blocks, to check offsets are honoured.
    out_off = np.zeros((d, d), np.int64)
    for r in range(d):
        at = 0
        for s in range(d):
            out_off[s, r] = at
            at += send[s, r] + 1
    want = np.full((d, out_rows, 2), -1.0, np.float32)
    for s in range(d):
        for r in range(d):
            rows = operand[s, in_off[s, r] : in_off[s, r] + send[s, r]]
            want[r, out_off[s, r] : out_off[s, r] + send[s, r]] = rows

    def body(op, i_off, s_sz, o_off, r_sz):
        return ragged_all_to_all(
            op[0], jnp.full((out_rows, 2), -1.0, jnp.float32), i_off[0], s_sz[0], o_off[0], r_sz[0],
            axis_name="x", exchange=Exchange.DENSE,
        )[None]

    mesh = jax.make_mesh((d,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    as_dev = lambda a: jax.device_put(jnp.asarray(a), jax.sharding.NamedSharding(mesh, P("x")))
    i32 = lambda a: as_dev(np.asarray(a, np.int32))
    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(
        as_dev(operand), i32(in_off), i32(send), i32(out_off), i32(send.T)
    )
    np.testing.assert_array_equal(np.asarray(got), want)


def test_ragged_exchange_on_a_cpu_mesh_is_refused_at_trace_time(single_device_results):
    """XLA:CPU cannot compile ragged-all-to-all: an error naming the argument, before XLA's."""
    inputs, _ = single_device_results
    parallel = ExpertParallel(mesh_of(2, 2), "expert", ("data",), exchange="ragged")
    with pytest.raises(ValueError, match=r"exchange='ragged'.*XLA:CPU.*exchange='auto'"):
        value_and_grads(RoutingConfig(2), "bf16", parallel).trace(*inputs)


def test_ragged_exchange_lowers_with_gradients(single_device_results, monkeypatch):
    """XLA:CPU cannot compile ragged-all-to-all; check the GPU path traces, differentiates and lowers
    (past the trace-time check that refuses it on a CPU mesh)."""
    import jax_grouped_mlp._src.moe.block as block

    monkeypatch.setattr(block, "_check_exchange", lambda exchange, platform: None)
    inputs, _ = single_device_results
    parallel = ExpertParallel(mesh_of(2, 2), "expert", ("data",), exchange="ragged")
    hlo = value_and_grads(RoutingConfig(2), "bf16", parallel).lower(*inputs).as_text()
    # forward: tokens, weights, results back; backward: their transposes
    assert hlo.count("ragged_all_to_all") >= 6
    assert Exchange.AUTO.resolve("gpu") is Exchange.RAGGED and Exchange.AUTO.resolve("cpu") is Exchange.DENSE


@pytest.mark.parametrize(
    "placement",
    [("offload", "offload", "offload"), ("offload", "device", "recompute"), ("recompute", "offload", "device")],
)
def test_offload_policy_inside_sharded_block(single_device_results, placement):
    inputs, singles = single_device_results
    x, router, w1, w2, dy, bias = inputs
    parallel = ExpertParallel(mesh_of(2, 2), "expert", ("data",))
    config = RoutingConfig(2)

    def loss(x, router, w1, w2):
        y = moe_block(x, router, w1, w2, routing=config, score_bias=bias, recipe="bf16", parallel=parallel)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    policy = jgm.offload_policy(*placement)
    grad_fn = jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1, 2, 3))
    copies = host_copies(grad_fn, x, router, w1, w2)
    want = {name for name, where in zip(jgm.RESIDUAL_NAMES, placement) if where == "offload"}
    # Exactly the chosen residuals, each copied inside the shard_map body, nothing else.
    assert set(copies) == {"shard_map"}, copies
    assert set(copies["shard_map"]) == want, copies
    got = jax.jit(grad_fn)(x, router, w1, w2)
    for g, w in zip(got, singles["bf16_softmax"][1]):
        assert rel_err(g, w) <= EXACT


@pytest.mark.parametrize("exchange", ["dense", "all_gather"])
def test_batch_and_sequence_axes_on_an_explicit_mesh(single_device_results, exchange):
    """``x [B, S, H]`` with ``B * S`` divisible over the token shards but ``B`` not
    (2 x 20 tokens over 4): the output's reshape back to ``[B, S, H]`` raised JAX's
    ``ShardingTypeError`` on ``Explicit`` meshes. Values and gradients are the
    one-device block's for the same tokens."""
    (x, router, w1, w2, dy, bias), _ = single_device_results
    xb, dyb = x[:40].reshape(2, 20, H), dy[:40].reshape(2, 20, H)
    recipe, config = CASES["bf16_softmax"]
    parallel = ExpertParallel(mesh_of(4, 1), "expert", exchange=exchange)
    (_, want_y), want = value_and_grads(config, recipe, None)(xb, router, w1, w2, dyb, bias)
    (_, got_y), got = value_and_grads(config, recipe, parallel)(xb, router, w1, w2, dyb, bias)
    assert got_y.shape == (2, 20, H)
    band = ALL_GATHER_BF16_BAND if exchange == "all_gather" else 0.0
    assert rel_err(got_y, want_y) <= band
    for g, w in zip(got, want):
        assert rel_err(g, w) <= max(band, EXACT), rel_err(g, w)


def test_bad_parallel_configs():
    x = jnp.zeros((8, H), jnp.bfloat16)
    router = jnp.zeros((H, 6))
    w1, w2 = jnp.zeros((6, H, F)), jnp.zeros((6, F, H))
    with pytest.raises(ValueError, match=r"E=6 must be divisible by the size of expert_axis='expert' \(4\)"):
        moe_block(x, router, w1, w2, routing=RoutingConfig(2), parallel=ExpertParallel(mesh_of(4, 1), "expert"))
    with pytest.raises(ValueError, match="num_experts=6"):
        from flax import nnx

        MoEBlock(6, H, F, routing=RoutingConfig(2), parallel=ExpertParallel(mesh_of(4, 1), "expert"),
                 rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="data_axes"):
        ExpertParallel(mesh_of(2, 2), "expert", ("batch",))
    with pytest.raises(ValueError, match="capacity_factor"):
        ExpertParallel(mesh_of(2, 2), "expert", capacity_factor=0.0)


def test_flax_moe_block_expert_parallel_matches_single_device():
    from flax import nnx

    config = RoutingConfig(2, "sigmoid", True, 2.5)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 21, 32)), jnp.bfloat16)
    single = MoEBlock(8, 32, 48, routing=config, recipe="bf16", rngs=nnx.Rngs(0))
    sharded = MoEBlock(8, 32, 48, routing=config, recipe="bf16", rngs=nnx.Rngs(0),
                       parallel=ExpertParallel(mesh_of(2, 2), "expert", ("data",)))
    assert nnx.get_partition_spec(nnx.state(sharded, nnx.Param))["experts"]["w1"].get_value() == P("expert", None, None)
    y1 = nnx.jit(lambda m, v: m(v))(single, x)
    y2 = nnx.jit(lambda m, v: m(v))(sharded, x)
    assert y2.shape == x.shape
    assert rel_err(y2, y1) <= EXACT


# ----------------------------------------------------------------------------------
# Router statistics and the shared expert under expert parallelism
# ----------------------------------------------------------------------------------
def stats_and_grads(config, parallel, shared):
    """(y, stats) and the gradients of sum(y * dy) + lb + 0.1 z in x, router, w1, w2, shared."""

    def loss(x, router, w1, w2, sw1, sw2, dy, bias):
        y, st = moe_block(x, router, w1, w2, routing=config, score_bias=bias, recipe="bf16", parallel=parallel,
                          shared_w1=sw1 if shared else None, shared_w2=sw2 if shared else None,
                          return_stats=True, return_router_probs=True)
        total = jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)) + st.load_balancing_loss + 0.1 * st.z_loss
        return total, (y, st)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))


@pytest.mark.parametrize("exchange", ["auto", "all_gather"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stats_and_shared_expert_match_single_device(single_device_results, layout, exchange):
    """Stats are summed over every token shard: the same numbers as on one device, and the
    losses' gradients (with the shared expert's) reach the same params."""
    inputs, _ = single_device_results
    x, router, w1, w2, dy, bias = inputs
    rng = np.random.default_rng(7)
    sw1 = jnp.asarray(rng.standard_normal((H, 40)) / np.sqrt(H), jnp.float32)
    sw2 = jnp.asarray(rng.standard_normal((40, H)) / np.sqrt(40), jnp.float32)
    config = RoutingConfig(2, "sigmoid", True, 2.5)
    ep, data = LAYOUTS[layout]
    args = (x, router, w1, w2, sw1, sw2, dy, bias)
    (_, (want_y, want)), want_g = stats_and_grads(config, None, True)(*args)
    parallel = ExpertParallel(mesh_of(ep, data), "expert", ("data",), exchange=exchange)
    (_, (y, got)), got_g = stats_and_grads(config, parallel, True)(*args)

    np.testing.assert_array_equal(np.asarray(got.expert_load), np.asarray(want.expert_load))
    assert int(got.expert_load.sum()) == T * config.top_k and int(got.dropped) == 0
    for name in ("load_balancing_loss", "z_loss"):
        np.testing.assert_allclose(float(getattr(got, name)), float(getattr(want, name)), rtol=1e-6)
    assert got.router_probs.shape == (T, E)
    np.testing.assert_allclose(np.asarray(got.router_probs), np.asarray(want.router_probs), rtol=1e-6, atol=1e-7)
    assert rel_err(y, want_y) <= EXACT
    # dx (bf16) now also carries the losses' gradient, added to the experts' in another
    # order than on one device: measured one element of 45 x 64 one bf16 ulp apart
    # (relative 1.8e-4), with or without the shared expert. Everything else: EXACT.
    for name, g, w in zip(("dx", "drouter", "dw1", "dw2", "dsw1", "dsw2"), got_g, want_g):
        band = 2e-3 if name == "dx" else EXACT
        assert rel_err(g, w) <= band, f"{name}: {rel_err(g, w):.2e}"
    # The stats themselves against numpy: counts of the routed pairs, and the loss formula.
    logits = np.asarray(jnp.dot(x.astype(jnp.float32), router, precision=jax.lax.Precision.HIGHEST), np.float64)
    ids, _ = route(jnp.asarray(logits, jnp.float32), config, bias)
    load = np.bincount(np.asarray(ids).ravel(), minlength=E)
    np.testing.assert_array_equal(np.asarray(got.expert_load), load)
    s = 1.0 / (1.0 + np.exp(-logits))
    lb = E * np.sum(load / (T * config.top_k) * (s / s.sum(1, keepdims=True)).mean(0))
    np.testing.assert_allclose(float(got.load_balancing_loss), lb, rtol=1e-5)


@pytest.mark.parametrize("exchange", ["auto", "all_gather"])
@pytest.mark.parametrize("shape", [(0, H), (2, 0, H)])
def test_no_tokens_match_single_device(shape, exchange):
    """Zero tokens: what the block gives on one device (an empty output, zero stats,
    zero gradients). ``exchange="all_gather"`` failed to lower (a size-0 reduce-scatter)."""
    _, router, w1, w2, _, bias = make_inputs(np.random.default_rng(5))
    sw1, sw2 = jnp.ones((H, 40), jnp.float32), jnp.ones((40, H), jnp.float32)
    x = jnp.zeros(shape, jnp.bfloat16)
    config = RoutingConfig(2, "sigmoid", True, 2.5)
    args = (x, router, w1, w2, sw1, sw2, x, bias)
    want = stats_and_grads(config, None, True)(*args)
    parallel = ExpertParallel(mesh_of(2, 2), "expert", ("data",), exchange=exchange)
    got = stats_and_grads(config, parallel, True)(*args)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (g, w)
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    for g in got[1]:  # zeros, not NaN
        assert not np.any(np.asarray(g, np.float32))


def test_flax_moe_block_shared_expert_and_aux_loss_expert_parallel():
    from flax import nnx

    config = RoutingConfig(2, "sigmoid", True, 2.5)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 21, 32)), jnp.bfloat16)
    kw = dict(routing=config, recipe="bf16", shared_ffn=40, load_balancing_coef=0.5, z_loss_coef=0.1)
    single = MoEBlock(8, 32, 48, **kw, rngs=nnx.Rngs(0))
    sharded = MoEBlock(8, 32, 48, **kw, rngs=nnx.Rngs(0), parallel=ExpertParallel(mesh_of(2, 2), "expert", ("data",)))

    def run(m, v):
        if hasattr(nnx, "capture"):  # flax >= 0.12 (sowing outside it is deprecated)
            y, inter = nnx.capture(m, nnx.Intermediate)(v)
        else:
            y = m(v)
            inter = nnx.pop(m, nnx.Intermediate)
        return y, inter["aux_loss"].get_value(), inter["router_stats"].get_value().expert_load

    y1, aux1, load1 = nnx.jit(run)(single, x)
    y2, aux2, load2 = nnx.jit(run)(sharded, x)
    assert rel_err(y2, y1) <= EXACT
    np.testing.assert_allclose(float(aux2), float(aux1), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(load2), np.asarray(load1))


# ----------------------------------------------------------------------------------
# The planner under expert parallelism: residuals sized at the receive buffer
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity_factor", [None, 1.5])
@pytest.mark.parametrize("recipe", ["mxfp8", "bf16"])
def test_planner_residual_bytes_match_the_sharded_program(single_device_results, recipe, capacity_factor):
    """plan_offload(parallel=...) predicts each residual's bytes per device as the
    sharded block's traced program keeps them (its shard_map body holds one device's
    shapes), for drop-free and capacity-bounded buffers and both recipes."""
    from jax_grouped_mlp._src.offload.measure import residual_bytes_kept

    inputs, _ = single_device_results
    x, router, w1, w2, _, bias = inputs
    config = RoutingConfig(2)
    ep = 4
    parallel = ExpertParallel(mesh_of(ep, 1), "expert", capacity_factor=capacity_factor)
    policy = jgm.offload_policy("device", "device", "device")
    block = jax.checkpoint(
        lambda x, w1, w2: moe_block(x, router, w1, w2, routing=config, score_bias=bias, recipe=recipe,
                                    parallel=parallel), policy=policy)
    kept = residual_bytes_kept(lambda w1, w2: jnp.sum(block(x, w1, w2).astype(jnp.float32)), w1, w2,
                               argnums=(0, 1))
    local_pairs = -(-T // ep) * config.top_k
    plan = jgm.plan_offload(tokens=local_pairs, hidden=H, ffn=F, num_experts=E, num_layers=1,
                            budget_bytes=float("inf"), host_bandwidth=50e9, layer_time=1e-3, recipe=recipe,
                            parallel=parallel)
    assert plan.buffer_rows == (ep * local_pairs if capacity_factor is None
                                else int(np.ceil(capacity_factor * local_pairs)))
    assert plan.kept_anyway == frozenset()  # the block's fc1_input is the received buffer
    assert plan.layer == "moe_block"  # it keeps its input x anyway: recomputing charges none
    assert all(c.layer_input_bytes == 0 for c in plan.candidates)
    for name in jgm.RESIDUAL_NAMES:
        assert kept[name]["device_bytes"] == plan.residual_bytes[name], (name, kept, plan.residual_bytes)
    with pytest.raises(ValueError, match="divisible"):
        jgm.plan_offload(tokens=local_pairs, hidden=H, ffn=F, num_experts=6, num_layers=1, budget_bytes=1e9,
                         host_bandwidth=50e9, layer_time=1e-3, parallel=parallel)


@pytest.mark.parametrize("exchange, collective", [("auto", "all_to_all"), ("all_gather", "all_gather")])
def test_recomputing_from_x_dispatches_the_tokens_again(single_device_results, exchange, collective):
    """What ``plan_offload``'s ``DISPATCH_SHARE`` stands for: recomputing "fc1_input" or
    "activation_input" of an expert-parallel block rebuilds the op's x by sending the
    tokens through the exchange once more (one collective more in the gradient's
    program); recomputing "fc2_input" or offloading sends nothing more."""
    inputs, _ = single_device_results
    x, router, w1, w2, _, bias = inputs
    mesh = mesh_of(4, 1)
    parallel = ExpertParallel(mesh, "expert", exchange=exchange)

    def count(*placement) -> int:
        block = jax.checkpoint(
            lambda x, r, w1, w2: moe_block(x, r, w1, w2, routing=RoutingConfig(2), score_bias=bias,
                                           parallel=parallel).astype(jnp.float32).sum(),
            policy=jgm.offload_policy(*placement))
        with jax.set_mesh(mesh):
            text = str(jax.make_jaxpr(jax.grad(block, argnums=(0, 1, 2, 3)))(x, router, w1, w2))
        return text.count(f"{collective}[")

    base = count("device", "device", "device")
    assert base > 0
    assert count("recompute", "device", "device") == base + 1
    assert count("device", "recompute", "device") == base + 1
    assert count("device", "device", "recompute") == base
    assert count("offload", "offload", "offload") == base


@pytest.mark.parametrize("exchange", ["auto", "all_gather"])
@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_block"])
def test_prepared_weights_under_expert_parallelism(single_device_results, recipe, exchange):
    """``moe_block(..., prepared=prepare_weights(w1, w2))`` on a 2 x 2 mesh: the
    prepared copies are split over the expert axis like the weights, and the value and
    every gradient are bitwise those of the same sharded block preparing its own."""
    inputs, _ = single_device_results
    x, router, w1, w2, dy, bias = inputs
    parallel = ExpertParallel(mesh_of(2, 2), "expert", ("data",), exchange=exchange)

    def run(use_prepared: bool):
        def loss(x, router, w1, w2):
            pw = jgm.prepare_weights(w1, w2, recipe=recipe) if use_prepared else None
            y = moe_block(x, router, w1, w2, routing=RoutingConfig(2), score_bias=bias, recipe=recipe,
                          parallel=parallel, prepared=pw)
            return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

        return jax.tree.leaves(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, router, w1, w2))

    got, want = run(True), run(False)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _offloaded_loop_text(x, mesh_fn=None) -> str:
    import jax_grouped_mlp as jgm
    from test_offload_fence import LAYERS, _make_inputs  # noqa: F401
    from test_offload_policies import LAYOUTS

    _, w1, w2, probs, gs = _make_inputs(np.random.default_rng(0), LAYERS)
    policy = jgm.offload_policy()

    def loss(p, x):
        return LAYOUTS["loop"](policy, x, *p, probs, gs)

    fn = jax.grad(loss) if mesh_fn is None else mesh_fn(jax.grad(loss))
    return jax.jit(fn).trace((w1, w2), x).lower(lowering_platforms=("cuda",)).as_text()


def test_offload_fence_only_in_per_device_programs():
    """The host-copy fence reads one element of each host copy back: only where every
    array is one device's own (not under automatic partitioning, where a slice of a
    sharded copy could become collectives; inside a shard_map over every axis, yes)."""
    from test_offload_fence import _read_backs, _waits
    from test_offload_policies import M, H

    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((M, H)), jnp.bfloat16)
    auto = _offloaded_loop_text(jax.device_put(x, jax.NamedSharding(mesh, jax.P("d"))))
    assert "pinned_host" in auto and _read_backs(auto) == 0 and _waits(auto) == 0

    def per_device(f):
        return jax.shard_map(f, mesh=mesh, in_specs=(jax.P(), jax.P()), out_specs=jax.P(), check_vma=False)

    manual = _offloaded_loop_text(x, per_device)
    assert _read_backs(manual) > 0 and _waits(manual) > 0


def test_gathered_pairs_backward_sums_every_device_in_float32():
    """The all-gather exchange's token gather (``block._gathered_pairs``), on a prefix of
    each device's pairs (as under a capacity): its backward is each token's sum over
    every device's pairs, within one bf16 ulp of the float64 sum, and the devices' sums
    are reduce-scattered in float32 (rounded once, after the collective)."""
    from jax_grouped_mlp._src.moe.block import _gathered_pairs

    rng = np.random.default_rng(3)
    ep, t_local, k, h, rows = 4, 16, 6, 32, 300
    n = ep * t_local * k
    orders = np.stack([rng.permutation(n) for _ in range(ep)]).astype(np.int32)
    inverses = np.argsort(orders, axis=1).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((ep * t_local, h)), jnp.bfloat16)
    ct = jnp.asarray(rng.standard_normal((ep, rows, h)), jnp.bfloat16)
    mesh = mesh_of(ep, 1)

    def local(x, order, inverse, ct):
        vjp = jax.vjp(lambda x: _gathered_pairs(x, order[0, :rows], inverse[0], k, "expert"), x)[1]
        return vjp(ct[0])[0]

    dx_of = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("expert"),) * 4, out_specs=P("expert")))
    args = jax.device_put((x, jnp.asarray(orders), jnp.asarray(inverses), ct),
                          jax.sharding.NamedSharding(mesh, P("expert")))
    dx = np.asarray(dx_of(*args), np.float64)
    want = np.zeros((ep * t_local, h))
    for d in range(ep):
        np.add.at(want, orders[d, :rows] // k, np.asarray(ct[d], np.float64))
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64) * 2.0**16
    assert (np.abs(dx - want) <= ulp + 1e-6 * np.abs(want).max()).all()
    from jax.extend import core as jex_core

    def collectives(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name in ("reduce_scatter", "psum_scatter"):
                yield str(e.invars[0].aval.dtype)
            for sub in jex_core.jaxprs_in_params(e.params):
                yield from collectives(sub)

    dtypes = list(collectives(jax.make_jaxpr(dx_of)(*args).jaxpr))
    assert dtypes and set(dtypes) == {"float32"}, dtypes
