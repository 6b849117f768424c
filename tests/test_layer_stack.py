"""``layer_stack``: a Python loop of checkpointed layers whose backward pass reloads
layer ``i - 1``'s offloaded residuals when layer ``i``'s backward starts (issue 17's
step time). Its gradients must be bitwise those of the plain loop under every policy
(CPU: the program structure, copies are no-ops; GPU: real host copies), its
prefetch must be in the program, and bad arguments must say what was expected.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_grouped_mlp as jgm
from jax_grouped_mlp._src.offload import scan_stack
from jax_grouped_mlp._src.offload import stack as stack_module
from jax_grouped_mlp._src.op import residuals

from test_offload_policies import ALL_DEVICE, COMBOS, FULL, PAIRWISE, _make_inputs


def _one(p, x, gs, probs, recipe="mxfp8"):
    return x + jgm.grouped_mlp(x, p[0], p[1], gs, probs, recipe=recipe)


def _params(w1, w2, lo, hi):
    return [(w1[i], w2[i]) for i in range(lo, hi)]


def _stack_loss(combos, x, w1, w2, probs, gs, prefetch=True, recipe="mxfp8"):
    """Two layers per policy in ``combos``, each pair one ``layer_stack``."""
    layer = functools.partial(_one, recipe=recipe)
    for i, combo in enumerate(combos):
        x = jgm.layer_stack(layer, _params(w1, w2, 2 * i, 2 * i + 2), x, gs, probs,
                            policy=jgm.offload_policy(*combo), prefetch=prefetch)  # fmt: skip
    return jnp.sum(x.astype(jnp.float32) ** 2)


def _loop_loss(x, w1, w2, probs, gs, recipe="mxfp8"):
    """The plain loop with everything on the device: the reference."""
    layer = jax.checkpoint(functools.partial(_one, recipe=recipe), policy=jgm.offload_policy(*ALL_DEVICE))
    for i in range(w1.shape[0]):
        x = layer((w1[i], w2[i]), x, gs, probs)
    return jnp.sum(x.astype(jnp.float32) ** 2)


def _grads(fn, inputs):
    x, w1, w2, probs, gs = inputs
    out = jax.jit(jax.grad(fn, argnums=(0, 1, 2, 3)))(x, w1, w2, probs, gs)
    return [np.asarray(g.astype(jnp.float32)) for g in out]


def _check(rng, combos, recipe="mxfp8", loss=None):
    """Gradients of ``loss`` (default: ``_stack_loss``) against the all-device loop, three
    policies per program."""
    loss = _stack_loss if loss is None else loss
    inputs = _make_inputs(rng, layers=6)
    want = _grads(functools.partial(_loop_loss, recipe=recipe), inputs)
    assert all(np.isfinite(w).all() and np.abs(w).max() > 0 for w in want)  # a test that can fail
    for i in range(0, len(combos), 3):
        group = tuple(combos[i : i + 3])
        got = _grads(functools.partial(loss, group, recipe=recipe), inputs)
        for name, a, b in zip(("dx", "dw1", "dw2"), got, want):
            np.testing.assert_array_equal(a, b, err_msg=f"{loss.__name__} {group} {name}")
        # probs, read by every layer: each stack sums its layers' gradients and the
        # stacks' sums are then added, where the loop adds layer by layer (the same
        # terms, grouped differently); one stack over all layers is bitwise (below).
        # The bound is relative to the largest element: a row whose layers' terms cancel
        # errs by ulps of the terms, not of its small sum.
        np.testing.assert_allclose(got[3], want[3], rtol=0, atol=1e-5 * float(np.abs(want[3]).max()),
                                   err_msg=f"{loss.__name__} {group} dprobs")


def test_gradients_bitwise_equal_to_the_loop(rng):
    _check(rng, COMBOS if FULL else PAIRWISE)


@pytest.mark.gpu
def test_gradients_bitwise_equal_to_the_loop_gpu(rng):
    """All 27 policies on the GPU, where the host copies and the prefetch are real."""
    _check(rng, COMBOS)


@pytest.mark.gpu
def test_gradients_bitwise_equal_to_the_loop_bf16_gpu(rng):
    _check(rng, [("offload",) * 3, ("device", "offload", "recompute"), ("offload", "device", "offload")],
           recipe="bf16")  # fmt: skip


def test_without_prefetch_and_without_gradient_it_is_the_loop(rng):
    x, w1, w2, probs, gs = inputs = _make_inputs(rng, layers=6)
    combos = [("offload",) * 3, ("device", "offload", "recompute"), ("recompute", "device", "offload")]
    want = _grads(_loop_loss, inputs)
    got = _grads(functools.partial(_stack_loss, combos, prefetch=False), inputs)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(jax.jit(functools.partial(_stack_loss, combos))(*inputs)),
                                  np.asarray(jax.jit(_loop_loss)(*inputs)))  # fmt: skip


def _count(jaxpr, prim) -> int:
    """Arrays ``prim`` outputs in ``jaxpr`` and the programs inside it."""
    n = 0
    for eqn in jaxpr.eqns:
        n += len(eqn.outvars) if eqn.primitive is prim else 0
        for v in eqn.params.values():
            for j in v if isinstance(v, (tuple, list)) else [v]:
                inner = getattr(j, "jaxpr", j)
                if hasattr(inner, "eqns"):
                    n += _count(inner, prim)
    return n


@pytest.mark.parametrize("layers", [1, 3])
def test_the_prefetch_is_in_the_program(rng, layers):
    """With all three residuals offloaded (five arrays a layer in MXFP8: data and scales
    of the two columnwise copies, and h), the backward pass moves layers 0..L-2's host
    arrays to the device once more than the loop does: the prefetch."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=layers)
    policy = jgm.offload_policy()

    def loss(w1, prefetch):
        y = jgm.layer_stack(_one, _params(w1, w2, 0, layers), x, gs, probs, policy=policy, prefetch=prefetch,
                            offload_last=True)  # fmt: skip
        return jnp.sum(y.astype(jnp.float32) ** 2)

    moves = [_count(jax.make_jaxpr(jax.grad(functools.partial(loss, prefetch=p)))(w1).jaxpr, residuals.to_device_p)
             for p in (False, True)]  # fmt: skip
    assert moves[1] - moves[0] == 5 * (layers - 1), moves


@pytest.mark.parametrize("offload_last", [False, True])
def test_the_last_layer_keeps_its_residuals_on_the_device(rng, offload_last):
    """The backward pass needs the last layer's residuals first: by default they are not
    offloaded (a copy out and straight back), and only that layer changes."""
    layers = 3
    x, w1, w2, probs, gs = _make_inputs(rng, layers=layers)
    params = _params(w1, w2, 0, layers)
    seen = []

    def spy(pullback):
        seen.append(sum(1 for leaf in jax.tree.leaves(pullback) if stack_module._on_host(leaf)))
        return pullback

    def loss(w1):
        y = jgm.layer_stack(_one, _params(w1, w2, 0, layers), x, gs, probs, policy=jgm.offload_policy(),
                            offload_last=offload_last)  # fmt: skip
        return jnp.sum(y.astype(jnp.float32) ** 2)

    original = stack_module._reload_after
    try:
        stack_module._reload_after = lambda pullback, ct: original(spy(pullback), ct)
        jax.make_jaxpr(jax.grad(loss))(w1)
    finally:
        stack_module._reload_after = original
    # (prefetched: layers L-2 .. 0, each with its five host arrays)
    assert seen == [5] * (layers - 1)
    host_last = [leaf for leaf in jax.tree.leaves(jax.vjp(lambda p: jgm.layer_stack(
        _one, [p], x, gs, probs, policy=jgm.offload_policy(), offload_last=offload_last), params[-1])[1])
        if stack_module._on_host(leaf)]  # fmt: skip
    assert len(host_last) == (5 if offload_last else 0)


def test_an_empty_stack_is_the_identity(rng):
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    assert jgm.layer_stack(_one, [], x) is x


@pytest.mark.parametrize("policy", [None, "offload"])
def test_an_empty_layer_scan_is_the_identity(rng, policy):
    """A leading (layer) axis of 0: ``x`` back, eager, jitted and differentiated, as
    ``jax.lax.scan`` and ``layer_stack([])`` do (it raised a bare IndexError)."""
    policy = jgm.offload_policy() if policy else None
    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.bfloat16)
    params = (jnp.zeros((0, 4, 64, 32), jnp.bfloat16), jnp.zeros((0, 4, 32, 64), jnp.bfloat16))
    gs, probs = jnp.asarray([4, 4, 4, 4], jnp.int32), jnp.ones((16,), jnp.float32)
    assert jgm.layer_scan(_one, params, x, gs, probs, policy=policy) is x
    y = jax.jit(lambda p, x: jgm.layer_scan(_one, p, x, gs, probs, policy=policy))(params, x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    loss = lambda p, x: jnp.sum(jgm.layer_scan(_one, p, x, gs, probs, policy=policy).astype(jnp.float32))  # noqa: E731
    dp, dx = jax.grad(loss, argnums=(0, 1))(params, x)
    assert [d.shape for d in dp] == [a.shape for a in params]
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.ones(x.shape, np.float32))


def test_args_get_summed_gradients(rng):
    """An ``args`` array every layer reads gets the sum of the layers' gradients, and
    integer args (group sizes) pass."""
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    scale = jnp.asarray(rng.standard_normal((8,)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal((8, 8)) / 4, jnp.float32) for _ in range(3)]
    count = jnp.asarray(3, jnp.int32)

    def layer(w, x, scale, count):
        return jnp.tanh(x @ w) * scale + count.astype(x.dtype)

    policy = jax.checkpoint_policies.nothing_saveable

    def via_stack(ws, x, scale):
        return jnp.sum(jgm.layer_stack(layer, ws, x, scale, count, policy=policy) ** 2)

    def via_loop(ws, x, scale):
        for w in ws:
            x = jax.checkpoint(layer, policy=policy)(w, x, scale, count)
        return jnp.sum(x**2)

    got = jax.grad(via_stack, argnums=(0, 1, 2))(ws, x, scale)
    want = jax.grad(via_loop, argnums=(0, 1, 2))(ws, x, scale)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


def test_bad_arguments_say_what_was_expected(rng):
    x = jnp.zeros((4, 8), jnp.float32)
    with pytest.raises(TypeError, match="layer must be callable"):
        jgm.layer_stack(None, [1], x)
    with pytest.raises(TypeError, match="params must be a sequence"):
        jgm.layer_stack(_one, {"w": 1}, x)
    with pytest.raises(TypeError, match="params must be a sequence"):
        jgm.layer_stack(_one, jnp.zeros((2, 3)), x)
    with pytest.raises(TypeError, match="policy must be a jax.checkpoint policy"):
        jgm.layer_stack(_one, [1], x, policy="offload")
    for flag in ("prefetch", "offload_last"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            jgm.layer_stack(_one, [1], x, **{flag: "no"})  # truthy: would silently mean True


def test_the_policy_function_uncalled_says_to_call_it(rng):
    """``policy=offload_policy`` (no parentheses): JAX calls it with a primitive."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=2)
    for stack in (lambda x, **k: jgm.layer_stack(_one, _params(w1, w2, 0, 2), x, gs, probs, **k),
                  lambda x, **k: jgm.layer_scan(_one, (w1, w2), x, gs, probs, **k)):
        with pytest.raises(TypeError, match=r"pass offload_policy\(\) \(called\)"):
            jax.grad(lambda x: jnp.sum(stack(x, policy=jgm.offload_policy).astype(jnp.float32)))(x)
        with pytest.raises(TypeError, match=r"pass offload_policy\(\) \(called\)"):  # also without a gradient
            stack(x, policy=jgm.offload_policy)


def test_each_layer_waits_for_the_previous_layers_copies(rng):
    """The forward's fence lags one layer (issue 17's step time): in the CUDA program
    layer ``i``'s output waits for read-backs of layer ``i - 1``'s host copies (five
    arrays a layer in MXFP8), taken after that output exists; the op's own fence (each
    layer waiting for its own copies) is off inside the stack."""
    from test_offload_fence import _read_backs, _waits

    layers = 3
    x, w1, w2, probs, gs = _make_inputs(rng, layers=layers)

    def loss(w1):
        y = jgm.layer_stack(_one, _params(w1, w2, 0, layers), x, gs, probs, policy=jgm.offload_policy())
        return jnp.sum(y.astype(jnp.float32) ** 2)

    text = jax.jit(jax.grad(loss)).trace(w1).lower(lowering_platforms=("cuda",)).as_text()
    assert _waits(text) == layers - 1
    assert _read_backs(text) == 5 * (layers - 1)


def nnx_layers(rng, count: int):
    """``count`` Flax NNX ``GroupedMLP`` modules (float32 master weights) as the docs
    stack them: ``(x, gs, probs, states, layer, loop)``, each layer's state from
    ``nnx.split``, ``layer(state, x, gs, probs)`` rebuilding the module with
    ``nnx.merge``, and ``loop(states)`` the loss of the modules in a loop of
    ``jax.checkpoint`` under ``offload_policy()`` (``states[i]``: a list, or stacked)."""
    from flax import nnx

    from jax_grouped_mlp.flax import GroupedMLP

    x, _, _, probs, gs = _make_inputs(rng, layers=1)
    modules = [GroupedMLP(3, x.shape[1], 96, rngs=nnx.Rngs(i)) for i in range(count)]
    graphdef = nnx.split(modules[0])[0]
    states = [nnx.split(m)[1] for m in modules]

    def layer(state, x, gs, probs):
        return x + nnx.merge(graphdef, state)(x, gs, probs)

    def loop(states):
        y = x
        for i in range(count):
            state = states[i] if isinstance(states, list) else jax.tree.map(lambda a: a[i], states)
            y = jax.checkpoint(layer, policy=jgm.offload_policy())(state, y, gs, probs)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return x, gs, probs, states, layer, loop


def test_with_flax_nnx_modules(rng):
    """The recipe docs/offload.md gives for NNX: each layer's state (``nnx.split``) as
    ``params``, the module rebuilt inside ``layer`` (``nnx.merge``); gradients match
    the same modules called in a loop of ``jax.checkpoint``."""
    x, gs, probs, states, layer, loop = nnx_layers(rng, 3)

    def via_stack(states):
        y = jgm.layer_stack(layer, states, x, gs, probs, policy=jgm.offload_policy())
        return jnp.sum(y.astype(jnp.float32) ** 2)

    got = jax.jit(jax.grad(via_stack))(states)
    want = jax.jit(jax.grad(loop))(states)
    leaves = jax.tree.leaves(want)
    assert leaves and all(np.abs(np.asarray(w, np.float32)).max() > 0 for w in leaves)
    for a, b in zip(jax.tree.leaves(got), leaves):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# ---------------------------------------------------------------------------------
# layer_scan: the same for stacked parameters, as a jax.lax.scan.


def _scan_loss(combos, x, w1, w2, probs, gs, prefetch=True, recipe="mxfp8"):
    """Two layers per policy in ``combos``, each pair one ``layer_scan``."""
    layer = functools.partial(_one, recipe=recipe)
    for i, combo in enumerate(combos):
        x = jgm.layer_scan(layer, (w1[2 * i : 2 * i + 2], w2[2 * i : 2 * i + 2]), x, gs, probs,
                           policy=jgm.offload_policy(*combo), prefetch=prefetch)  # fmt: skip
    return jnp.sum(x.astype(jnp.float32) ** 2)


def _check_scan(rng, combos, recipe="mxfp8"):
    _check(rng, combos, recipe, loss=_scan_loss)


def test_layer_scan_gradients_bitwise_equal_to_the_loop(rng):
    _check_scan(rng, COMBOS if FULL else PAIRWISE)


@pytest.mark.gpu
def test_layer_scan_gradients_bitwise_equal_to_the_loop_gpu(rng):
    _check_scan(rng, COMBOS)


@pytest.mark.parametrize("layers", [1, 2, 5])
def test_layer_scan_one_scan_over_all_layers_is_bitwise_the_loop(rng, layers):
    inputs = _make_inputs(rng, layers=layers)
    want = _grads(_loop_loss, inputs)

    def loss(x, w1, w2, probs, gs):
        y = jgm.layer_scan(_one, (w1, w2), x, gs, probs, policy=jgm.offload_policy())
        return jnp.sum(y.astype(jnp.float32) ** 2)

    for name, a, b in zip(("dx", "dw1", "dw2", "dprobs"), _grads(loss, inputs), want):
        np.testing.assert_array_equal(a, b, err_msg=name)
    x, w1, w2, probs, gs = inputs
    np.testing.assert_array_equal(
        np.asarray(jgm.layer_scan(_one, (w1, w2), x, gs, probs, policy=jgm.offload_policy()), np.float32),
        np.asarray(jax.lax.scan(lambda x, w: (_one(w, x, gs, probs), None), x, (w1, w2))[0], np.float32))


def _remats(jaxpr, in_scan=False):
    """``(inside a scan's body, prevent_cse)`` for each ``jax.checkpoint`` in ``jaxpr``;
    a per-argument ``prevent_cse`` that differs between arguments reads "mixed"."""
    for eqn in jaxpr.eqns:
        if "prevent_cse" in eqn.params:
            cse = eqn.params["prevent_cse"]
            if not isinstance(cse, bool):
                cse = cse[0] if len(set(cse)) == 1 else "mixed"
            yield in_scan, cse
        for v in eqn.params.values():
            for j in v if isinstance(v, (tuple, list)) else [v]:
                inner = getattr(j, "jaxpr", j)
                if hasattr(inner, "eqns"):
                    yield from _remats(inner, in_scan or eqn.primitive is jax.lax.scan_p)


# Per layer count: (inside a scan, prevent_cse) of each checkpoint in the gradient of a
# layer_scan whose policy offloads: layer 0 (True, outside), layers 1 .. L-2 (False,
# inside the backward's scan), the last ("mixed": False for its parameters only; True
# where this JAX cannot differentiate a per-argument setting, before JAX 0.12.1).
_LAST = "mixed" if scan_stack._per_argument_prevent_cse_works() else True
_OFFLOAD_REMATS = {
    1: [(False, _LAST)],
    2: [(False, True), (False, _LAST)],
    4: [(False, True), (False, _LAST), (True, False)],
}


def test_per_argument_prevent_cse_probe_matches_the_jax_version():
    """The probe answers what each JAX does: JAX 0.12.1 differentiates a per-argument
    ``prevent_cse`` through a ``custom_jvp`` closing over an array; 0.11.2 and 0.12.0
    raised (the GPU machine runs 0.11.2)."""
    works = scan_stack._per_argument_prevent_cse_works()
    assert works == (jax.__version_info__ >= (0, 12, 1)), jax.__version__
    assert scan_stack._params_only_prevent_cse(2) == ((False, True, True, True) if works else True)


@pytest.mark.parametrize("layers", sorted(_OFFLOAD_REMATS))
@pytest.mark.parametrize("policy", [None, "offload"])
def test_layer_scan_recomputes_scanned_layers_without_remat_barrier(rng, policy, layers):
    """Layers recomputed inside a scan's body (all of them without prefetch, layers 1 ..
    L-2 with it) are checkpointed with ``prevent_cse=False``, the last layer with it for
    its parameters: remat's barrier would hold the layer's parameter slices, which XLA then
    copies out of the stack. Layer 0, recomputed at the end of the step outside any
    loop, keeps ``prevent_cse=True``."""
    inputs = _make_inputs(rng, layers=layers)
    policy = jgm.offload_policy() if policy else None

    def loss(x, w1, w2, probs, gs):
        y = jgm.layer_scan(_one, (w1, w2), x, gs, probs, policy=policy)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    remats = sorted(_remats(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*inputs).jaxpr), key=str)
    want = [(True, False)] if policy is None else _OFFLOAD_REMATS[layers]
    assert remats == sorted(want, key=str)


def _scans_moving(jaxpr, memory_kind):
    """``(scan equation, move equation)`` for each move of arrays to ``memory_kind``
    (``residuals.to_device_p``) directly inside a scan's body."""
    for eqn in _eqns(jaxpr):
        if eqn.primitive is jax.lax.scan_p:
            for inner in eqn.params["jaxpr"].jaxpr.eqns:
                if inner.primitive is residuals.to_device_p and inner.params["memory_kind"] == memory_kind:
                    yield eqn, inner


def test_layer_scan_copies_each_layer_out_and_back_one_iteration_apart(rng):
    """The forward scan writes the host copies of the arrays the previous iteration
    carried in (the layer before), never of this iteration's own; the backward scan
    reads the layer before's copies back into the carry (for the next iteration), never
    for this iteration's pullback. Five arrays each way (activation_input's data, and
    fc1_input's and fc2_input's FP8 data and scales)."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=4)

    def loss(w1):
        y = jgm.layer_scan(_one, (w1, w2), x, gs, probs, policy=jgm.offload_policy())
        return jnp.sum(y.astype(jnp.float32) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(w1).jaxpr
    (scan, out), = _scans_moving(jaxpr, "pinned_host")
    body = scan.params["jaxpr"].jaxpr
    assert len(out.invars) == 5 and set(out.invars) <= set(body.invars)  # values the iteration got, not made
    (scan, back), = _scans_moving(jaxpr, "device")
    body = scan.params["jaxpr"].jaxpr
    readers = [e for e in body.eqns if any(v in set(back.outvars) for v in e.invars if not hasattr(v, "val"))]
    assert len(back.outvars) == 5 and not readers # read by no equation of this iteration
    assert set(back.outvars) <= set(body.outvars)  # only handed to the next one


@pytest.mark.parametrize("layers", [3, 4])
def test_layer_scan_carries_its_layer_index(rng, layers):
    """Both of ``layer_scan``'s own scans (the forward over layers 1 .. L-2 and the
    backward over L-2 .. 1) carry the layer index as an int32 counter and take no
    integer array as ``xs``: with the index read from an ``arange`` in ``xs``, XLA's
    dynamic-slice fusion left the backward body's weight reads and gradient writes
    out, and copied a weight slice and each weight gradient per layer (H100, Nano)."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=layers)

    def loss(w1):
        y = jgm.layer_scan(_one, (w1, w2), x, gs, probs, policy=jgm.offload_policy())
        return jnp.sum(y.astype(jnp.float32) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(w1).jaxpr
    scans = [e for e in _eqns(jaxpr) if e.primitive is jax.lax.scan_p and e.params["length"] == layers - 2
             and any(v.aval.shape == w1.shape for v in e.invars)]  # over the stacked layers
    assert len(scans) == 2, [e.params["length"] for e in _eqns(jaxpr) if e.primitive is jax.lax.scan_p]
    for scan in scans:  # (the group sizes are int32[3]: no layer count here gives them that shape)
        ints = [v.aval for v in scan.invars if jnp.issubdtype(v.aval.dtype, jnp.integer)]
        assert jax.core.ShapedArray((), jnp.int32) in ints, ints  # the counter's start
        assert not [a for a in ints if a.shape == (layers - 2,)], ints  # no arange of the layers


def _one_named(p, x, gs, probs):
    """A layer with a residual of its own (``"mine"``), which JAX offloads itself when
    the policy names it."""
    h = jax.ad_checkpoint.checkpoint_name(x * 2, "mine")
    return x + jgm.grouped_mlp(h, p[0], p[1], gs, probs)


def _plain_loop(layer, policy, x, w1, w2, *args):
    layer = jax.checkpoint(layer, policy=policy)
    for i in range(w1.shape[0]):
        x = layer((w1[i], w2[i]), x, *args)
    return x


def _assert_scan_is_the_loop(rng, layer, policy, args_of, dx_exact=True):
    """``layer_scan`` of ``layer`` over 4 layers (the pipelined scan runs) against the
    plain loop under the same policy: the weights' gradients bit for bit, ``dx`` too
    unless ``dx_exact`` is False (``x`` also among ``args``: its gradient then adds the
    layers' terms in another order, within a bfloat16 rounding of the largest)."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=4)

    def loss(stacked, x, w1, w2):
        if stacked:
            y = jgm.layer_scan(layer, (w1, w2), x, *args_of(x, gs, probs), policy=policy)
        else:
            y = _plain_loop(layer, policy, x, w1, w2, *args_of(x, gs, probs))
        return jnp.sum(y.astype(jnp.float32) ** 2)

    want = jax.jit(jax.grad(functools.partial(loss, False), argnums=(0, 1, 2)))(x, w1, w2)
    got = jax.jit(jax.grad(functools.partial(loss, True), argnums=(0, 1, 2)))(x, w1, w2)
    assert all(np.abs(np.asarray(w, np.float32)).max() > 0 for w in want)
    for name, a, b in zip(("dx", "dw1", "dw2"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if name == "dx" and not dx_exact:
            np.testing.assert_allclose(a, b, rtol=0, atol=2**-7 * np.abs(b).max(), err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("jax_policy", [False, True])
def test_layer_scan_leaves_jax_own_offloads_alone(rng, jax_policy):
    """Arrays JAX's own offloading puts on the host (a name the policy offloads that
    the op does not tag, or a ``save_and_offload_only_these_names`` policy) are not
    written to the host a second time: the scan's carry would change type (this failed
    at three layers or more)."""
    if jax_policy:
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=["mine"],
            offload_src="device", offload_dst="pinned_host")  # fmt: skip
    else:
        policy = jgm.offload_policy("device", "offload", "device", extra_offloadable=["mine"])
    _assert_scan_is_the_loop(rng, _one_named, policy, lambda x, gs, probs: (gs, probs))


@pytest.mark.parametrize("placements", [("offload",) * 3, ("recompute", "offload", "recompute")])
def test_layer_scan_with_x_among_args(rng, placements):
    """``x`` passed again in ``args`` (the first layer's input, read by every layer):
    layer 0 sees one array as both, the scanned layers do not, and each layer's
    pullback must be rebuilt from its own arrays (this raised an IndexError at three
    layers or more)."""

    def layer(p, x, x0, gs, probs):  # x * x0: its pullback keeps both
        return x + jgm.grouped_mlp(x * x0, p[0], p[1], gs, probs)

    _assert_scan_is_the_loop(rng, layer, jgm.offload_policy(*placements), lambda x, gs, probs: (x, gs, probs),
                             dx_exact=False)  # fmt: skip


def test_layer_scan_closed_over_arrays_are_read_not_copied_per_layer(rng):
    """A layer that closes over an array (a table, a mask): the array stays one array,
    where it was a per-layer output of the forward scan (L - 2 stacked copies of it in
    the program), and the gradients are the loop's bit for bit."""
    x, *_ = _make_inputs(rng, layers=4)
    table = jnp.asarray(rng.uniform(0.5, 1.5, (1, x.shape[1])), jnp.bfloat16)  # a shape nothing else has

    def layer(p, x, gs, probs):
        return x + jgm.grouped_mlp(x * table, p[0], p[1], gs, probs)

    _assert_scan_is_the_loop(rng, layer, jgm.offload_policy(), lambda x, gs, probs: (gs, probs))
    _, w1, w2, probs, gs = _make_inputs(rng, layers=4)
    loss = lambda w1, w2, x: jnp.sum(jgm.layer_scan(layer, (w1, w2), x, gs, probs, policy=jgm.offload_policy()))
    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(w1, w2, x))
    assert f"bf16[2,1,{x.shape[1]}]" not in text


@pytest.mark.parametrize("stack", ["layer_scan", "layer_stack"])
def test_closure_over_a_differentiated_value(rng, stack):
    """A layer closing over a value ``jax.grad`` differentiates: its gradient sums the
    layers' (it raised ``UnexpectedTracerError``), bit for bit the loop's."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=4)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, x.shape[1]), jnp.bfloat16)

    def loss(stacked, w1, w2, x, scale):
        def layer(p, x, gs, probs):
            return x + jgm.grouped_mlp(x * scale, p[0], p[1], gs, probs)

        policy = jgm.offload_policy()
        if stacked and stack == "layer_scan":
            y = jgm.layer_scan(layer, (w1, w2), x, gs, probs, policy=policy)
        elif stacked:
            y = jgm.layer_stack(layer, _params(w1, w2, 0, w1.shape[0]), x, gs, probs, policy=policy)
        else:
            y = _plain_loop(layer, policy, x, w1, w2, gs, probs)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    want = jax.jit(jax.grad(functools.partial(loss, False), argnums=(0, 1, 2, 3)))(w1, w2, x, scale)
    got = jax.jit(jax.grad(functools.partial(loss, True), argnums=(0, 1, 2, 3)))(w1, w2, x, scale)
    assert np.abs(np.asarray(want[3])).max() > 0
    for name, a, b in zip(("dw1", "dw2", "dx", "dscale"), got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


def test_layer_stack_closure_over_a_differentiated_value_with_layers_of_other_shapes(rng):
    """Layers whose parameters differ in shape (one trace cannot fit them all) closing
    over a value ``jax.grad`` differentiates: each shape's trace gets its own trailing
    args (this raised ``UnexpectedTracerError``), gradients bit for bit the loop's."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=3)
    f = w1.shape[-1]
    wide1 = jnp.asarray(rng.standard_normal((w1.shape[1], w1.shape[2], 2 * f)) * 0.05, w1.dtype)
    wide2 = jnp.asarray(rng.standard_normal((w2.shape[1], 2 * f, w2.shape[3])) * 0.05, w2.dtype)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, x.shape[1]), jnp.bfloat16)
    bias = jnp.asarray(rng.uniform(-0.5, 0.5, x.shape[1]), jnp.bfloat16)
    policy = jgm.offload_policy()

    def loss(stacked, params, x, scale, bias):
        def layer(p, x, gs, probs):  # the wide layer reads bias too: the traces' consts differ
            h = x * scale + (bias if p[0].shape[-1] == 2 * f else 0)
            return x + jgm.grouped_mlp(h, p[0], p[1], gs, probs)

        if stacked:
            y = jgm.layer_stack(layer, params, x, gs, probs, policy=policy)
        else:
            for p in params:
                y = x = jax.checkpoint(layer, policy=policy)(p, x, gs, probs)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    params = [(w1[0], w2[0]), (wide1, wide2), (w1[1], w2[1]), (wide1 * 0.5, wide2)]
    want = jax.jit(jax.grad(functools.partial(loss, False), argnums=(0, 1, 2, 3)))(params, x, scale, bias)
    got = jax.jit(jax.grad(functools.partial(loss, True), argnums=(0, 1, 2, 3)))(params, x, scale, bias)
    assert np.abs(np.asarray(want[2])).max() > 0 and np.abs(np.asarray(want[3])).max() > 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=jax.tree_util.keystr(path))


def test_layer_scan_python_numbers_in_args(rng):
    """A Python number among ``args`` stayed a constant of one trace and an input of
    another ("please report this"); it is the loop's now."""

    def layer(p, x, gs, probs, scale):
        return x + jgm.grouped_mlp(x * scale, p[0], p[1], gs, probs)

    _assert_scan_is_the_loop(rng, layer, jgm.offload_policy(), lambda x, gs, probs: (gs, probs, 0.5))


def test_layer_scan_layer_must_keep_x_types(rng):
    x, w1, w2, probs, gs = _make_inputs(rng, layers=3)

    def layer(p, x, gs, probs):  # returns float32 for bfloat16 x: scan's carry would change
        return x.astype(jnp.float32) + jgm.grouped_mlp(x, p[0], p[1], gs, probs)

    with pytest.raises(TypeError, match="layer must return x's structure, shapes and dtypes"):
        jgm.layer_scan(layer, (w1, w2), x, gs, probs, policy=jgm.offload_policy())


def test_layer_scan_eager_gradient_compiles_once(rng):
    """Without jit, the second gradient call reuses the first's program (each call
    compiled the scans again: ~2.8 s a call at a tiny shape on the CPU)."""
    from compile_counter import COMPILES

    x, w1, w2, probs, gs = _make_inputs(rng, layers=3)
    policy = jgm.offload_policy()
    grad = jax.grad(lambda w1: jnp.sum(jgm.layer_scan(_one, (w1, w2), x, gs, probs, policy=policy)
                                       .astype(jnp.float32)))  # fmt: skip
    first = jax.block_until_ready(grad(w1))
    before = COMPILES.n
    again = jax.block_until_ready(grad(w1))
    assert COMPILES.n == before, COMPILES.n - before
    np.testing.assert_array_equal(np.asarray(first, np.float32), np.asarray(again, np.float32))


@pytest.mark.parametrize("layers, want", [(1, "device"), (2, "device"), (4, "mixed")])
def test_layer_scan_residual_placements(rng, layers, want):
    """What ``residual_placements`` reads off ``layer_scan`` under an all-offload policy:
    up to two layers nothing leaves the device (the stack keeps the last two layers'
    residuals; two layers were reported as one offloaded), from three on the layers
    before those go to the host ("mixed")."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=layers)
    loss = lambda w1, w2, x: jnp.sum(jgm.layer_scan(_one, (w1, w2), x, gs, probs, policy=jgm.offload_policy())
                                     .astype(jnp.float32))  # fmt: skip
    got = jgm.residual_placements(jax.grad(loss, argnums=(0, 1, 2)), w1, w2, x)
    assert got == {name: want for name in jgm.RESIDUAL_NAMES}, got


def test_layer_scan_bad_arguments(rng):
    x = jnp.zeros((4, 8), jnp.float32)
    with pytest.raises(TypeError, match="layer must be callable"):
        jgm.layer_scan(None, (jnp.zeros((2, 3)),), x)
    with pytest.raises(ValueError, match="no arrays"):
        jgm.layer_scan(_one, (), x)
    with pytest.raises(ValueError, match="same leading"):
        jgm.layer_scan(_one, (jnp.zeros((2, 3)), jnp.zeros((3, 3))), x)
    with pytest.raises(TypeError, match="policy must be a jax.checkpoint policy"):
        jgm.layer_scan(_one, (jnp.zeros((2, 3)),), x, policy="offload")
    with pytest.raises(TypeError, match="prefetch must be a bool"):
        jgm.layer_scan(_one, (jnp.zeros((2, 3)),), x, prefetch="no")



def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the programs inside it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for j in v if isinstance(v, (tuple, list)) else [v]:
                inner = getattr(j, "jaxpr", j)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


@pytest.mark.xfail(raises=ValueError, strict=True,
                   reason="known limitation (docs/offload.md): an enclosing jax.checkpoint sees the stack's "
                          "tags already placed and JAX's linearization fails; layer_stack checkpoints each "
                          "layer itself")  # fmt: skip
def test_inside_an_outer_checkpoint(rng):
    """An enclosing ``jax.checkpoint`` (or a layer_stack inside another's layer): pinned
    as failing loudly (JAX's "Linearization failed"), never with wrong numbers. Treating
    the placed tags as known there made remat round the FP8 host copies that the lagged
    fence reads (``reduce_precision``), which gave NaN gradients."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=3)
    policy = jgm.offload_policy()

    def outer(inner):
        def loss(w1):
            y = jax.checkpoint(lambda w1: inner(_params(w1, w2, 0, 3)))(w1)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        return np.asarray(jax.jit(jax.grad(loss))(w1), np.float32)

    loop = jax.checkpoint(_one, policy=policy)

    def plain(params):
        y = x
        for p in params:
            y = loop(p, y, gs, probs)
        return y

    got = outer(lambda params: jgm.layer_stack(_one, params, x, gs, probs, policy=policy))
    np.testing.assert_array_equal(got, outer(plain))


def test_every_float_leaf_of_the_carry_waits(rng):
    """A carry with an unused float leaf first: the copies are still waited for (every
    float leaf waits; a fence on a dead leaf alone would be removed with it)."""
    from test_offload_fence import _read_backs

    x, w1, w2, probs, gs = _make_inputs(rng, layers=3)

    def layer(p, carry, gs, probs):
        return {"aux": carry["aux"] * 2, "x": _one(p, carry["x"], gs, probs)}

    def loss(w1):
        out = jgm.layer_stack(layer, _params(w1, w2, 0, 3), {"aux": jnp.float32(1), "x": x}, gs, probs,
                              policy=jgm.offload_policy())  # fmt: skip
        return jnp.sum(out["x"].astype(jnp.float32) ** 2)

    text = jax.jit(jax.grad(loss)).trace(w1).lower(lowering_platforms=("cuda",)).as_text()
    # layers 1 and 2 wait for 5 arrays through "x" ("aux" is unused: its wait goes with it)
    assert _read_backs(text) == 2 * 5


def test_no_wait_inside_a_scan_body(rng):
    """layer_stack as the body of a scan: the iteration bounds the copies; no read-back."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=4)

    def loss(w1):
        def body(y, w):
            return jgm.layer_stack(_one, [(w[0][0], w[1][0]), (w[0][1], w[1][1])], y, gs, probs,
                                   policy=jgm.offload_policy()), None  # fmt: skip

        y, _ = jax.lax.scan(body, x, (w1.reshape(2, 2, *w1.shape[1:]), w2.reshape(2, 2, *w2.shape[1:])))
        return jnp.sum(y.astype(jnp.float32) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(w1).jaxpr
    assert not [e for e in _eqns(jaxpr) if e.primitive is residuals.host_wait_p]


def test_vmap_keeps_the_read_back_after_the_output(rng):
    """Batched tags keep their ``after`` operand (a batched rebuild tag drops only its
    rebuild inputs), so every read-back still waits for the output."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=2)
    layer = jax.checkpoint(_one, policy=jgm.offload_policy())

    def loss(w1, x):
        y = x
        for i in range(2):
            y = layer((w1[i], w2[i]), y, gs, probs)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    xs = jnp.stack([x, x * 2])
    jaxpr = jax.make_jaxpr(jax.grad(lambda w1: jax.vmap(lambda x: loss(w1, x))(xs).sum()))(w1).jaxpr
    offloads = [e for e in _eqns(jaxpr) if e.primitive is residuals.residual_p and e.params["mode"] == "offload"]
    assert offloads and all(e.params["has_after"] for e in offloads)


def test_layer_scan_with_nothing_offloaded_is_the_plain_scan(rng):
    """A policy that offloads nothing has nothing to pipeline: ``layer_scan`` is then
    ``jax.lax.scan`` of the checkpointed layer (no custom_vjp around it)."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=3)
    policy = jgm.offload_policy(*ALL_DEVICE)
    jaxpr = jax.make_jaxpr(lambda w1: jgm.layer_scan(_one, (w1, w2), x, gs, probs, policy=policy))(w1).jaxpr
    names = [e.primitive.name for e in jaxpr.eqns]  # the op inside is a custom_vjp; the stack is not
    assert "scan" in names and not any("custom_vjp" in n for n in names)


def _check_vmap_of_grad(rng, stack: str, layers: int) -> None:
    """``vmap(grad)`` over a batch of inputs equals the per-example gradients bit for bit."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=layers)

    def loss(w1, x):
        if stack == "layer_scan":
            y = jgm.layer_scan(_one, (w1, w2), x, gs, probs, policy=jgm.offload_policy())
        else:
            y = jgm.layer_stack(_one, _params(w1, w2, 0, layers), x, gs, probs, policy=jgm.offload_policy())
        return jnp.sum(y.astype(jnp.float32) ** 2)

    xs = jnp.stack([x, x * 0.5])
    got = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(w1, xs)
    one = jax.jit(jax.grad(loss))
    for i in range(xs.shape[0]):
        want = one(w1, xs[i])
        assert np.abs(np.asarray(want, np.float32)).max() > 0
        np.testing.assert_array_equal(np.asarray(got[i], np.float32), np.asarray(want, np.float32), err_msg=f"{stack} {i}")


@pytest.mark.parametrize("stack", ["layer_scan", "layer_stack"])
@pytest.mark.parametrize("layers", [2, 3])
def test_vmap_of_grad(rng, stack, layers):
    _check_vmap_of_grad(rng, stack, layers)


@pytest.mark.gpu
@pytest.mark.parametrize("stack", ["layer_scan", "layer_stack"])
@pytest.mark.parametrize("layers", [3, 4])
def test_vmap_of_grad_gpu(rng, stack, layers):
    """On the GPU, where the fences and read-backs are built (a session saw
    ``vmap(grad)`` of ``layer_scan`` fail at >= 3 layers)."""
    _check_vmap_of_grad(rng, stack, layers)


def _tags_offload_to(dst: dict):
    """A policy offloading each of the op's residual names in ``dst`` to its memory kind."""
    from jax._src.interpreters import partial_eval as pe

    def policy(prim, *avals, **params):
        name = params.get("name")
        return pe.Offloadable(src="device", dst=dst[name]) if name in dst else False

    return policy


def test_layer_scan_writes_to_the_host_kind_the_policy_names(rng):
    """``Offloadable.dst`` decides where ``layer_scan``'s own copies go (here
    ``unpinned_host``, not the default ``pinned_host``), as it does for the op's tags in
    a loop; the gradients stay the loop's bit for bit."""
    names = ("fc1_input", "activation_input", "fc2_input")
    policy = _tags_offload_to({n: "unpinned_host" for n in names})
    x, w1, w2, probs, gs = _make_inputs(rng, layers=4)

    def loss(w1):
        y = jgm.layer_scan(_one, (w1, w2), x, gs, probs, policy=policy)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(w1).jaxpr
    assert len(list(_scans_moving(jaxpr, "unpinned_host"))) == 1
    assert not list(_scans_moving(jaxpr, "pinned_host"))
    _assert_scan_is_the_loop(rng, _one, policy, lambda x, gs, probs: (gs, probs))


def test_layer_scan_rejects_two_host_kinds(rng):
    """One layer's copies go out together: a policy splitting the residuals over two host
    memory kinds gets a ValueError naming the residuals and their kinds."""
    policy = _tags_offload_to({"fc1_input": "unpinned_host", "fc2_input": "pinned_host"})
    x, w1, w2, probs, gs = _make_inputs(rng, layers=4)
    with pytest.raises(ValueError, match=r"one host memory kind.*fc1_input.*unpinned_host.*fc2_input.*pinned_host"):
        jax.make_jaxpr(lambda w1: jgm.layer_scan(_one, (w1, w2), x, gs, probs, policy=policy))(w1)
