"""offload_policy: every one of the 27 placements does exactly what it says, in the jaxpr."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

import jax_grouped_mlp as jgm

COMBOS = list(itertools.product(["offload", "device", "recompute"], repeat=3))


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng()
    m, h, f, g = 96, 64, 64, 3
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((g, h, f)) / 8, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((g, f, h)) / 8, jnp.bfloat16)
    probs = jnp.asarray(rng.uniform(size=m), jnp.float32)
    gs = jnp.asarray([40, 0, 50], jnp.int32)
    return x, w1, w2, probs, gs


def grad_fn(policy, gs, recipe="mxfp8", fuse=True, choices=None):
    """The gradient of a checkpointed layer (``choices``: the private ``mlp.grouped_mlp_with``)."""
    from jax_grouped_mlp._src.op import mlp

    def op(x, w1, w2, p):
        if choices is None:
            return jgm.grouped_mlp(x, w1, w2, gs, p, recipe=recipe, fuse_fc1_epilogue=fuse)
        return mlp.grouped_mlp_with(choices, x, w1, w2, gs, p, recipe=recipe, fuse_fc1_epilogue=fuse)

    def loss(x, w1, w2, probs):
        layer = jax.checkpoint(op, policy=policy)
        return jnp.sum(layer(x, w1, w2, probs).astype(jnp.float32) ** 2)

    return jax.grad(loss, argnums=(0, 1, 2, 3))


def _remat_bodies(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("remat") and eqn.params.get("differentiated"):
            body = eqn.params["jaxpr"]
            yield getattr(body, "jaxpr", body)
        for sub in jex_core.jaxprs_in_params(eqn.params):
            yield from _remat_bodies(sub)


def _names(jaxpr) -> set[str]:
    """Names of the residuals the backward body recomputes (a tag there in "on_host"
    mode hands an offloaded residual's host copy on to the op's reload, not a recompute)."""
    out = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name" or (
            eqn.primitive.name == "grouped_mlp_residual" and eqn.params["mode"] != "on_host"
        ):
            out.add(eqn.params["name"])
        for sub in jex_core.jaxprs_in_params(eqn.params):
            out |= _names(sub)
    return out


def _host_puts(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put" and any("Host" in str(d) for d in eqn.params["devices"]):
            n += 1
        if eqn.primitive.name == "grouped_mlp_residual" and eqn.params["mode"] == "offload":
            n += eqn.params["num_values"]  # the op's own host copies, one per array
        for sub in jex_core.jaxprs_in_params(eqn.params):
            n += _host_puts(sub)
    return n


@pytest.mark.parametrize("recipe", ["mxfp8", "bf16"])
@pytest.mark.parametrize("combo", COMBOS, ids=["-".join(c) for c in COMBOS])
def test_placement(inputs, combo, recipe):
    x, w1, w2, probs, gs = inputs
    fc1, act, fc2 = combo
    fn = grad_fn(jgm.offload_policy(fc1, act, fc2), gs, recipe)
    got = jgm.residual_placements(fn, x, w1, w2, probs)
    assert got == {"fc1_input": fc1, "activation_input": act, "fc2_input": fc2}
    closed = jax.make_jaxpr(fn)(x, w1, w2, probs)
    # Exactly the offloaded residuals go to host: MXFP8 residuals are 2 arrays (data,
    # scale), bf16 ones 1; nothing else (no weight) is ever copied to host.
    per = 2 if recipe == "mxfp8" else 1
    want_puts = per * (fc1 == "offload") + (act == "offload") + per * (fc2 == "offload")
    assert _host_puts(closed.jaxpr) == want_puts
    (body,) = list(_remat_bodies(closed.jaxpr))
    body_names = _names(body)
    # Recomputing fc2_input must not rerun FC1 when activation_input was kept.
    if fc2 == "recompute" and act != "recompute":
        assert "activation_input" not in body_names
    for name, placement in zip(("fc1_input", "activation_input", "fc2_input"), combo):
        assert (name in body_names) == (placement == "recompute"), name


def _count_prims(jaxpr, name: str) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for sub in jex_core.jaxprs_in_params(eqn.params):
            n += _count_prims(sub, name)
    return n


@pytest.mark.parametrize("in_gemm", [True, False])
@pytest.mark.parametrize("fuse", [True, False])
def test_recomputing_fc2_input_never_reruns_fc1(inputs, fuse, in_gemm):
    """With activation_input kept and fc2_input recomputed, the op rebuilds fc2_input
    from h (no GEMM in the recomputed part), whether FC1 ran fused (one kernel writes
    h and both copies of a) or not, and with the weights quantized inside the GEMMs
    (``KernelChoices.quantize_weights_in_gemm``) or by a pass; same gradients either way."""
    from jax_grouped_mlp._src.op.heuristics import KernelChoices

    choices = KernelChoices(quantize_weights_in_gemm=in_gemm)
    x, w1, w2, probs, gs = inputs

    def gemms_in_backward(fc2_input):
        fn = grad_fn(jgm.offload_policy("device", "device", fc2_input), gs, fuse=fuse, choices=choices)
        (body,) = list(_remat_bodies(jax.make_jaxpr(fn)(x, w1, w2, probs).jaxpr))
        # Every GEMM's reference branch is one dot_general; the body holds the backward
        # pass (4 GEMMs) plus whatever is recomputed.
        return _count_prims(body, "dot_general")

    assert gemms_in_backward("recompute") == gemms_in_backward("device")
    policy = jgm.offload_policy("device", "device", "recompute")
    got = jax.jit(grad_fn(policy, gs, fuse=fuse, choices=choices))(x, w1, w2, probs)
    want = jax.jit(grad_fn(policy, gs, fuse=not fuse, choices=choices))(x, w1, w2, probs)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.fixture(scope="module")
def reference_grads(inputs):
    x, w1, w2, probs, gs = inputs
    return jax.jit(grad_fn(jax.checkpoint_policies.everything_saveable, gs))(x, w1, w2, probs)


@pytest.mark.parametrize("combo", COMBOS[::4] + [COMBOS[-1]], ids=lambda c: "-".join(c))
def test_gradients_identical_across_policies(inputs, reference_grads, combo):
    x, w1, w2, probs, gs = inputs
    got = jax.jit(grad_fn(jgm.offload_policy(*combo), gs))(x, w1, w2, probs)
    for a, b in zip(got, reference_grads):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_default_is_offload_everything(inputs):
    x, w1, w2, probs, gs = inputs
    got = jgm.residual_placements(grad_fn(jgm.offload_policy(), gs), x, w1, w2, probs)
    assert set(got.values()) == {"offload"} and len(got) == 3


def test_extra_names_combine_with_user_tags(inputs):
    from jax.ad_checkpoint import checkpoint_name

    x, w1, w2, probs, gs = inputs
    policy = jgm.offload_policy("device", "device", "device", extra_offloadable=["my_pre"])

    def loss(x, w1, w2, probs):
        def layer(x, w1, w2, p):
            pre = checkpoint_name(jnp.sin(x), "my_pre")
            return jgm.grouped_mlp(pre, w1, w2, gs, p) * jnp.cos(pre)
        return jnp.sum(jax.checkpoint(layer, policy=policy)(x, w1, w2, probs).astype(jnp.float32))

    got = jgm.residual_placements(jax.grad(loss, argnums=(1,)), x, w1, w2, probs)
    assert got["my_pre"] == "offload" and got["fc1_input"] == "device"


def test_otherwise_decides_what_the_policy_does_not_name(inputs):
    """``otherwise=dots_saveable``: the op's residuals are placed as asked, the user's
    own matmul around the op is saved rather than recomputed, and the gradients are
    bitwise those of the plain policy. (``save_from_both_policies`` of the same two
    raises once anything offloads: it accepts only True or False.)"""
    x, w1, w2, probs, gs = inputs
    u = jnp.asarray(np.random.default_rng(5).standard_normal((x.shape[1], x.shape[1])) / 8, jnp.bfloat16)

    def grads(policy):
        def loss(x, w1, w2, probs):
            def layer(x, w1, w2, p):
                return jgm.grouped_mlp(jnp.tanh(x @ u), w1, w2, gs, p)
            return jnp.sum(jax.checkpoint(layer, policy=policy)(x, w1, w2, probs).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2, 3))

    plain = jgm.offload_policy("offload", "device", "recompute")
    mixed = jgm.offload_policy("offload", "device", "recompute", otherwise=jax.checkpoint_policies.dots_saveable)
    placed = jgm.residual_placements(grads(mixed), x, w1, w2, probs)
    assert placed == {"fc1_input": "offload", "activation_input": "device", "fc2_input": "recompute"}, placed

    def saved(policy):
        from jax._src.ad_checkpoint import saved_residuals  # (private; print_saved_residuals prints it)

        def f(x, w1, w2, probs):
            layer = jax.checkpoint(lambda x, w1, w2, p: jgm.grouped_mlp(jnp.tanh(x @ u), w1, w2, gs, p), policy=policy)
            return jnp.sum(layer(x, w1, w2, probs).astype(jnp.float32))
        return [a.shape for a, why in saved_residuals(f, x, w1, w2, probs) if "dot_general" in why]

    assert saved(mixed) and not saved(plain)  # the user's x @ u: saved only with otherwise
    for a, b in zip(grads(mixed)(x, w1, w2, probs), grads(plain)(x, w1, w2, probs)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(TypeError, match="otherwise must be a jax.checkpoint policy"):
        jgm.offload_policy(otherwise="dots")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(fc1_input="host"), "fc1_input must be one of"),
        (dict(activation_input="cpu"), "activation_input must be one of"),
        (dict(fc2_input=None), "fc2_input must be one of"),
        (dict(extra_saveable="abc"), "extra_saveable must be a sequence"),
        (dict(extra_offloadable=b"ab"), "extra_offloadable must be a sequence"),  # bytes iterate as ints
        (dict(extra_offloadable=[1]), "extra_offloadable must contain"),
        (dict(extra_saveable=["a"], extra_offloadable=["a"]), "both saved on device and offloaded"),
    ],
)
def test_bad_policy_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        jgm.offload_policy(**kwargs)


def test_placements_with_constant_inputs_and_shard_map(inputs):
    """Literal inputs to the remat and a shard_map around the layer do not confuse the reader."""
    x, w1, w2, probs, gs = inputs
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("e",))
    P = jax.sharding.PartitionSpec

    def loss(x, w1, w2, probs):
        def layer(x, w1, w2, p, scale):
            return jgm.grouped_mlp(x * scale, w1, w2, gs, p)

        body = lambda x, w1, w2, p: jax.checkpoint(layer, policy=jgm.offload_policy("device"))(
            x, w1, w2, p, 2.0
        )
        y = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())(x, w1, w2, probs)
        return jnp.sum(y.astype(jnp.float32))

    fn = jax.grad(loss, argnums=(1, 2))
    got = jgm.residual_placements(fn, x, w1, w2, probs)
    assert got == {"fc1_input": "device", "activation_input": "offload", "fc2_input": "offload"}
    jax.block_until_ready(jax.jit(fn)(x, w1, w2, probs))


def test_extra_names_cannot_shadow_residual_names():
    with pytest.raises(ValueError, match="for your own names"):
        jgm.offload_policy(fc1_input="recompute", extra_saveable=["fc1_input"])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's single memory")
def test_offload_makes_no_copy_on_the_cpu(inputs):
    """On the CPU (one memory) an offloaded residual stays where it is, as docs/offload.md
    says: the jitted step compiles to the all-device program's temp memory, and the
    residuals it returns are all in device memory, while ``residual_placements`` still
    reports the policy's "offload"."""
    x, w1, w2, probs, gs = inputs

    def residuals(policy):
        layer = jax.checkpoint(lambda x, w1, w2, p: jgm.grouped_mlp(x, w1, w2, gs, p), policy=policy)
        return jax.jit(lambda x, w1, w2, p: jax.vjp(layer, x, w1, w2, p)[1])(x, w1, w2, probs)

    kept = residuals(jgm.offload_policy("offload", "offload", "offload"))
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(kept)} == {"device"}
    on_device = jgm.offload_policy("device", "device", "device")
    temps = [jax.jit(grad_fn(p, gs)).lower(x, w1, w2, probs).compile().memory_analysis().temp_size_in_bytes
             for p in (jgm.offload_policy(), on_device)]
    assert temps[0] == temps[1]
    assert set(jgm.residual_placements(grad_fn(jgm.offload_policy(), gs), x, w1, w2, probs).values()) == {"offload"}
