"""The op and its stacks inside a user's own ``jax.shard_map``, with ``check_vma`` on and off.

Not collected by the main test run (the name does not start with ``test_``):
``test_shard_map.py`` runs this file in a fresh interpreter with 4 simulated CPU
devices. Run it directly with ``python -m pytest tests/shard_map_cases.py``.

Each case computes a loss of per-device op calls inside ``shard_map`` and its gradient,
and compares with the same per-device calls made one by one outside ``shard_map``
(their losses summed): the gradient of an input that is replicated over a mesh axis
is the sum of the devices' gradients. With 2 devices on that axis the sum is one
addition in either order, so the comparison is bitwise. ``check_vma=True`` (JAX's
default) failed at trace time before 2026-12-05 (``switch branches must have equal
output types``): the CUDA branch's FFI calls return values that vary over no mesh
axis. Both branches are traced on the CPU too, so this runs here; the CUDA lowering
is checked by lowering for ``cuda``.
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

P = jax.sharding.PartitionSpec
RECIPES = ("bf16", "mxfp8", "fp8_block")
E, H, F, M = 4, 128, 128, 256  # M rows per device
LAYERS = 2

if jax.device_count() < 4:
    pytest.skip(
        "needs 4 devices: run through test_shard_map.py (XLA_FLAGS was set too late)",
        allow_module_level=True,
    )


def _seed() -> int:
    return int(os.environ.get("JGM_SEED", "0"))


def _inputs(devices: int, layers: int = 1, *, weights_per_device: bool = False):
    """Fresh random inputs: ``devices`` shards of x, probs and group sizes (one with a
    zero-sized group, one skewed), and weights (per device when ``weights_per_device``)."""
    rng = np.random.default_rng(_seed())
    lead = (devices,) if weights_per_device else ()
    x = jnp.asarray(rng.standard_normal((devices * M, H)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal(lead + (layers, E, H, F)) * 0.08, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal(lead + (layers, E, F, H)) * 0.08, jnp.bfloat16)
    probs = jnp.asarray(rng.uniform(0.1, 1.0, devices * M), jnp.float32)
    sizes = [[60, 0, 150, 46], [200, 20, 20, 10], [64, 64, 64, 64], [0, 0, 0, 250]]
    gs = jnp.asarray(sizes[:devices], jnp.int32)
    return x, w1, w2, probs, gs


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(shape),
                         devices=jax.devices()[:n])


def _put(mesh, tree, specs):
    return jax.tree.map(lambda a, s: jax.device_put(a, jax.NamedSharding(mesh, s)), tree, specs)


def _assert_value_and_grads(got, want, what: str) -> None:
    """The gradients bitwise; the losses to 1e-4 only: XLA may fuse a stack's last
    residual add into the loss's square without rounding it to bf16, differently in the
    two programs (measured 3.4e-5), and the sum order differs (one reduction against
    two and an addition)."""
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-4, err_msg=f"{what}: loss")
    _assert_same(got[1], want[1], what)


def _assert_same(got, want, what: str) -> None:
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, (what, i, g.shape, w.shape)
        assert np.all(np.isfinite(w)) and np.any(w != 0), (what, i, "reference is degenerate")
        np.testing.assert_array_equal(g, w, err_msg=f"{what}: leaf {i}")


def _sq(y) -> jax.Array:
    return jnp.sum(jnp.square(y.astype(jnp.float32)))


def _op(recipe: str, policy=None):
    def layer(x, w1, w2, probs, gs):
        f = lambda x: jgm.grouped_mlp(x, w1[0], w2[0], gs, probs, recipe=recipe)
        return jax.checkpoint(f, policy=policy)(x) if policy is not None else f(x)

    return layer


def _stack(kind: str, recipe: str):
    def one(params, x, probs, gs):
        return x + jgm.grouped_mlp(x, params[0], params[1], gs, probs, recipe=recipe)

    def layers(x, w1, w2, probs, gs):
        policy = jgm.offload_policy()
        if kind == "layer_scan":
            return jgm.layer_scan(one, (w1, w2), x, probs, gs, policy=policy)
        return jgm.layer_stack(one, [(w1[i], w2[i]) for i in range(LAYERS)], x, probs, gs, policy=policy)

    return layers


CASES = {
    "op": lambda r: (_op(r), 1),
    "checkpoint_offload": lambda r: (_op(r, jgm.offload_policy()), 1),
    "layer_stack": lambda r: (_stack("layer_stack", r), LAYERS),
    "layer_scan": lambda r: (_stack("layer_scan", r), LAYERS),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("check_vma", [True, False])
def test_replicated_weights_get_the_sum_of_the_devices_gradients(case, recipe, check_vma):
    """x, probs and group sizes sharded over "d", weights replicated: the loss and every
    gradient are bitwise those of the per-device calls made outside ``shard_map``."""
    fn, layers = CASES[case](recipe)
    x, w1, w2, probs, gs = _inputs(2, layers)
    mesh = _mesh((2,), ("d",))
    specs = (P("d"), P(), P(), P("d"), P("d"))
    args = _put(mesh, (x, w1, w2, probs, gs), specs)

    def body(x, w1, w2, probs, gs):
        return fn(x, w1, w2, probs, gs[0])

    def loss(*a):
        return _sq(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("d"), check_vma=check_vma)(*a))

    def loss_per_device(x, w1, w2, probs, gs):
        rows = lambda a, i: a[i * M:(i + 1) * M]
        return sum(_sq(fn(rows(x, i), w1, w2, rows(probs, i), gs[i])) for i in range(2))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    got = grad(*args)
    want = jax.jit(jax.value_and_grad(loss_per_device, argnums=(0, 1, 2, 3)))(x, w1, w2, probs, gs)
    _assert_value_and_grads(got, want, f"{case} {recipe} check_vma={check_vma}")
    # The CUDA branch (FFI calls) lowers too.
    grad.trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("check_vma", [True, False])
def test_bf16_weight_gradients_are_summed_in_float32(check_vma):
    """float32 weights replicated over "d" with ``weight_grad_dtype=bfloat16``: each
    device's gradient is rounded to bf16 once and the sum over "d" is taken in float32,
    bitwise the per-device calls' gradients added outside ``shard_map`` (a sum in bf16
    would round the sum again)."""
    x, w1, w2, probs, gs = _inputs(2)
    w1, w2 = w1.astype(jnp.float32) * 1.001, w2.astype(jnp.float32) * 1.001  # not bf16 values
    mesh = _mesh((2,), ("d",))
    specs = (P("d"), P(), P(), P("d"), P("d"))
    args = _put(mesh, (x, w1, w2, probs, gs), specs)

    def fn(x, w1, w2, probs, gs):
        return jgm.grouped_mlp(x, w1[0], w2[0], gs, probs, recipe="bf16", weight_grad_dtype=jnp.bfloat16)

    def loss(*a):
        body = lambda x, w1, w2, probs, gs: fn(x, w1, w2, probs, gs[0])  # noqa: E731
        return _sq(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("d"), check_vma=check_vma)(*a))

    def loss_per_device(x, w1, w2, probs, gs):
        rows = lambda a, i: a[i * M:(i + 1) * M]  # noqa: E731
        return sum(_sq(fn(rows(x, i), w1, w2, rows(probs, i), gs[i])) for i in range(2))

    got = jax.jit(jax.value_and_grad(loss, argnums=(1, 2)))(*args)
    want = jax.jit(jax.value_and_grad(loss_per_device, argnums=(1, 2)))(x, w1, w2, probs, gs)
    _assert_value_and_grads(got, want, f"bf16 weight gradients check_vma={check_vma}")
    for g in want[1]:  # (a sum of two bf16 values: not itself a bf16 value everywhere)
        assert g.dtype == jnp.float32 and (np.asarray(g) != np.asarray(g.astype(jnp.bfloat16), np.float32)).any()


@pytest.mark.parametrize("recipe", RECIPES)
def test_per_device_weights_and_replicated_tokens(recipe):
    """The other way round, on a 2 x 2 mesh: x and probs replicated over "w" and
    sharded over "d", the weights sharded over "w" (each device its own): x's and
    probs' gradients are the sums over "w"."""
    x, w1, w2, probs, gs = _inputs(2, weights_per_device=True)
    mesh = _mesh((2, 2), ("d", "w"))
    specs = (P("d"), P("w"), P("w"), P("d"), P("d"))
    args = _put(mesh, (x, w1, w2, probs, gs), specs)
    fn = _op(recipe)

    def body(x, w1, w2, probs, gs):
        return fn(x, w1[0], w2[0], probs, gs[0])[None]

    def loss(*a):
        return _sq(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("w", "d"))(*a))

    def loss_per_device(x, w1, w2, probs, gs):
        rows = lambda a, i: a[i * M:(i + 1) * M]
        return sum(_sq(fn(rows(x, i), w1[j], w2[j], rows(probs, i), gs[i])) for i in range(2) for j in range(2))

    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*args)
    want = jax.jit(jax.value_and_grad(loss_per_device, argnums=(0, 1, 2, 3)))(x, w1, w2, probs, gs)
    _assert_value_and_grads(got, want, f"per-device weights {recipe}")


@pytest.mark.parametrize("recipe", RECIPES)
def test_moe_block_and_quantizers_under_check_vma(recipe):
    """``moe_block`` (router replicated, tokens sharded; its auxiliary losses in the
    loss) and the public quantizers give the same values and gradients with
    ``check_vma`` on as off."""
    x, w1, w2, _, gs = _inputs(2)
    router = jnp.asarray(np.random.default_rng(_seed() + 1).standard_normal((H, E)) * 0.1, jnp.float32)
    mesh = _mesh((2,), ("d",))
    specs = (P("d"), P(), P(), P(), P("d"))
    args = _put(mesh, (x, router, w1[0], w2[0], gs), specs)
    routing = jgm.RoutingConfig(top_k=2)

    def body(x, router, w1, w2, gs):
        y, stats = jgm.moe_block(x, router, w1, w2, routing=routing, recipe=recipe, return_stats=True)
        # The quantizers refuse derivatives (formats/derivatives.py): quantize a constant.
        xc = jax.lax.stop_gradient(x)
        q = jgm.dequantize(jgm.quantize_mxfp8(xc)) + jgm.dequantize(jgm.quantize_mxfp8_grouped(xc, gs[0]))
        b = jgm.dequantize_fp8_block(jgm.quantize_fp8_block(xc, axis=0, group_sizes=gs[0]))
        aux = stats.load_balancing_loss + 1e-3 * stats.z_loss
        return y + q + b.astype(y.dtype), stats.expert_load[None], aux[None]

    def run(check_vma: bool):
        out_specs = (P("d"), P("d"), P("d"))
        f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=check_vma)

        def loss(*a):
            y, _, aux = f(*a)
            return _sq(y) + jnp.sum(aux)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*args), jax.jit(f)(*args)[1]

    _assert_same(run(True), run(False), f"moe_block {recipe}")
