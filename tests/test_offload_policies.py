"""Offload policies in training steps: no recompiles, what the backward recomputes, and
bitwise-equal gradients under every policy, in a Python loop of layers and in a scan.

On the CPU "pinned_host" copies are no-ops in the compiled program (as with
``jax.device_put``), so the gradient tests check the program structure (the jaxpr
each policy leads to) there; marked ``gpu`` they run the same checks on the GPU,
where the copies are real.
"""

from __future__ import annotations

import functools
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

import jax_grouped_mlp as jgm
from compile_counter import COMPILES
from jax_grouped_mlp._src.op import mlp, primitives
from jax_grouped_mlp._src.op.heuristics import DEFAULT, KernelChoices

SETTINGS = ("offload", "device", "recompute")
COMBOS = list(itertools.product(SETTINGS, repeat=3))
ALL_DEVICE = ("device", "device", "device")
# M rows, H hidden, F ffn (H != F, so the FC1 GEMM is told apart by its output), G experts.
M, H, F, G = 96, 64, 96, 3
LAYERS = 3


def _make_inputs(rng, layers=LAYERS):
    x = jnp.asarray(rng.standard_normal((M, H)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((layers, G, H, F)) / 8, jnp.bfloat16)
    # FC2 weights small enough that a stack of squared-ReLU layers stays well inside the
    # float range (with /8 the output grows quadratically per layer and 6 layers reached
    # inf in the gradient for some seeds).
    w2 = jnp.asarray(rng.standard_normal((layers, G, F, H)) / 64, jnp.bfloat16)
    probs = jnp.asarray(rng.uniform(0.1, 1.0, size=M), jnp.float32)
    gs = jnp.asarray([40, 0, 50], jnp.int32)
    return x, w1, w2, probs, gs


def _layer(policy, gs, probs, choices=DEFAULT, prevent_cse=True, **kw):
    """One residual layer of the op (``choices``: its kernel heuristics)."""
    return jax.checkpoint(
        lambda x, w1, w2: x + mlp.grouped_mlp_with(choices, x, w1, w2, gs, probs, **kw), policy=policy,
        prevent_cse=prevent_cse,
    )


def loop_loss(policy, x, w1, w2, probs, gs, **kw):
    layer = _layer(policy, gs, probs, **kw)
    for i in range(w1.shape[0]):
        x = layer(x, w1[i], w2[i])
    return jnp.sum(x.astype(jnp.float32) ** 2)


def scan_loss(policy, x, w1, w2, probs, gs, **kw):
    layer = _layer(policy, gs, probs, **kw)
    x, _ = jax.lax.scan(lambda x, w: (layer(x, *w), None), x, (w1, w2))
    return jnp.sum(x.astype(jnp.float32) ** 2)


LAYOUTS = {"loop": loop_loss, "scan": scan_loss}


# ---------------------------------------------------------------------------------
# 1. No surprise recompiles (issue 17, item 3).




@pytest.mark.parametrize(
    "layout,combo", [("loop", ("offload",) * 3), ("scan", ("device", "offload", "recompute"))], ids=str
)
def test_train_step_compiles_once(rng, layout, combo):
    """A jitted step that donates and returns its state, under an offloading policy,
    compiles on the first call only: the state it returns (committed arrays) hits the
    same executable. JAX's own offload (a ``device_put`` to a memory space in the
    program) made jit commit its outputs, so the second call compiled again."""
    x, w1, w2, probs, gs = _make_inputs(rng)
    loss_fn = LAYOUTS[layout]
    policy = jgm.offload_policy(*combo)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(params, x):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(policy, x, *p, probs, gs))(params)
        return loss, jax.tree.map(lambda p, g: (p - 1e-9 * g).astype(p.dtype), params, grads)

    params = (w1, w2)
    compiles = []
    for _ in range(3):
        before = COMPILES.n
        loss, params = step(params, x)
        jax.block_until_ready(params)
        compiles.append(COMPILES.n - before)
    assert compiles[0] >= 1 and compiles[1:] == [0, 0], compiles
    assert step._cache_size() == 1
    assert np.isfinite(float(loss))


# ---------------------------------------------------------------------------------
# 2. The policy alone decides what the backward recomputes (item 4).

_COUNTED = ("fc1_fused", "grouped_gemm", "grouped_gemm_qw", "fake_quantize_pair")


def _counting_reference(name, ref):
    """``ref`` wrapped in a named jit, so each call leaves one recognisable equation."""

    def stub(*args, **static):
        def counted(*a):
            return ref(*a, **static)

        counted.__name__ = f"counted_{name}"
        return jax.jit(counted)(*args)

    return stub


@pytest.fixture
def counting(monkeypatch):
    for name in _COUNTED:
        monkeypatch.setitem(primitives._REFERENCE, name, _counting_reference(name, primitives._REFERENCE[name]))


def _remat_bodies(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("remat") and eqn.params.get("differentiated"):
            body = eqn.params["jaxpr"]
            yield getattr(body, "jaxpr", body)
        else:
            for sub in jex_core.jaxprs_in_params(eqn.params):
                yield from _remat_bodies(sub)


def _calls(jaxpr, out: list) -> list:
    """(name, input avals, output avals) of every counted call, nested programs included."""
    for eqn in jaxpr.eqns:
        name = str(eqn.params.get("name", ""))
        if name.startswith("counted_"):
            if eqn.outvars:  # (dead-code elimination can leave a call with no outputs)
                out.append((name.removeprefix("counted_"), [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars]))
            continue
        for sub in jex_core.jaxprs_in_params(eqn.params):
            _calls(sub, out)
    return out


def _work(calls) -> dict[str, int]:
    """FC1's GEMMs, quantizations of ``[M, H]`` operands (x, dy), and the quantizations
    that write an FP8 copy of x or of srelu(h) (the residuals fc1_input, fc2_input; the
    backward's own quantizations write none: ``keep_col_fp8=False``)."""
    got = {"fc1_gemm": 0, "quantize_x": 0, "fc1_input": 0, "fc2_input": 0}
    for name, ins, outs in calls:
        if name == "fc1_fused" or (name.startswith("grouped_gemm") and outs[0].shape == (M, F)
                                   and ins[1].shape[1:] == (H, F)):  # fmt: skip
            got["fc1_gemm"] += 1
        if name == "fake_quantize_pair":
            fp8 = any(a.dtype == jnp.float8_e4m3fn for a in outs)
            if ins[0].shape == (M, H):
                got["quantize_x"] += 1
                got["fc1_input"] += fp8
            else:
                got["fc2_input"] += fp8
    return got


@pytest.mark.parametrize("path", ["fused", "unfused", "weights_in_gemm"])
def test_backward_recomputes_what_the_policy_says(rng, counting, monkeypatch, path):
    """For every policy and FC1 path, the backward pass (the remat body) does, beyond
    what it does with everything kept on the device: FC1's GEMM only when
    activation_input is recomputed; a quantization of x only when fc1_input or
    activation_input (FC1's operand) is recomputed, writing x's FP8 copy only for the
    former; and one quantization of srelu(h) writing fc2_input only when fc2_input is
    recomputed: never a rerun of FC1 for it, also when the fused FC1 kernel wrote it in
    the forward pass."""
    if jax.default_backend() != "cpu":  # the counting stubs replace the reference kernels,
        pytest.skip("which run only where the platform is not CUDA (the H200 ran 0 of them)")
    choices = KernelChoices(quantize_weights_in_gemm=path == "weights_in_gemm")
    x, w1, w2, probs, gs = _make_inputs(rng, layers=1)

    def work(combo, where):
        loss = functools.partial(
            loop_loss, jgm.offload_policy(*combo), choices=choices, fuse_fc1_epilogue=path != "unfused"
        )
        fn = jax.grad(loss, argnums=(0, 1, 2))
        closed = jax.make_jaxpr(fn)(x, w1, w2, probs, gs)
        if where == "forward":
            return _calls(closed.jaxpr, [])
        (body,) = list(_remat_bodies(closed.jaxpr))
        return _work(_calls(body, []))

    assert any(c[0] == "fc1_fused" for c in work(ALL_DEVICE, "forward")) == (path == "fused")
    base = work(ALL_DEVICE, "backward")
    combos = COMBOS if path == "fused" else [c for c in COMBOS if c.count("device") >= 2]
    for combo in combos:
        fc1, act, fc2 = combo
        got = {k: v - base[k] for k, v in work(combo, "backward").items()}
        want = {
            "fc1_gemm": int(act == "recompute"),
            "quantize_x": int("recompute" in (fc1, act)),
            "fc1_input": int(fc1 == "recompute"),
            "fc2_input": int(fc2 == "recompute"),
        }
        assert got == want, (combo, got)


# ---------------------------------------------------------------------------------
# 3. Gradients under every policy equal the all-device gradients, bit for bit (item 5).

# Each compiled step runs three policies (one per layer of the loop, one per scan of
# two stacked layers), so all 27 take 9 compilations per layout: minutes on a 2-core
# CPU. The default run takes 9 policies in which every pair of settings of every two
# residuals occurs (3 compilations per layout); JGM_ALL_POLICIES=1 takes all 27.
FULL = os.environ.get("JGM_ALL_POLICIES", "") == "1"
PAIRWISE = [c for i, c in enumerate(COMBOS) if sum(SETTINGS.index(s) for s in c) % 3 == 0]


def _mixed_loss(layout, combos, x, w1, w2, probs, gs, recipe="mxfp8"):
    """Layers under ``combos[i]``: a loop of one layer per policy, or one scan of
    two stacked layers per policy."""
    for i, combo in enumerate(combos):
        policy = jgm.offload_policy(*combo)
        layer = _layer(policy, gs, probs, recipe=recipe)
        if layout == "loop":
            x = layer(x, w1[i], w2[i])
        else:
            x, _ = jax.lax.scan(lambda x, w: (layer(x, *w), None), x, (w1[2 * i : 2 * i + 2], w2[2 * i : 2 * i + 2]))
    return jnp.sum(x.astype(jnp.float32) ** 2)


def _grads(layout, combos, inputs, recipe="mxfp8"):
    fn = jax.jit(jax.grad(functools.partial(_mixed_loss, layout, combos, recipe=recipe), argnums=(0, 1, 2)))
    return [np.asarray(g.astype(jnp.float32)) for g in fn(*inputs)]


def _check_all_policies(layout, rng, combos, recipe="mxfp8"):
    inputs = _make_inputs(rng, layers=3 if layout == "loop" else 6)
    want = _grads(layout, (ALL_DEVICE,) * 3, inputs, recipe)
    assert all(np.isfinite(w).all() and np.abs(w).max() > 0 for w in want)  # a test that can fail
    for i in range(0, len(combos), 3):
        group = tuple(combos[i : i + 3])
        got = _grads(layout, group, inputs, recipe)
        for name, a, b in zip(("dx", "dw1", "dw2"), got, want):
            np.testing.assert_array_equal(a, b, err_msg=f"{layout} {group} {name}")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gradients_bitwise_equal_under_every_policy(rng, layout):
    _check_all_policies(layout, rng, COMBOS if FULL else PAIRWISE)


def test_gradients_bitwise_equal_under_every_policy_fp8_block(rng):
    """``recipe="fp8_block"`` (FP8 residuals with 128-block scales) in the loop layout:
    the pairwise set of policies, all 27 with JGM_ALL_POLICIES=1 (as for mxfp8)."""
    _check_all_policies("loop", rng, COMBOS if FULL else PAIRWISE, recipe="fp8_block")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gradients_bitwise_equal_under_every_policy_gpu(rng, layout):
    """The same on the GPU, all 27 policies, where the host copies are real."""
    _check_all_policies(layout, rng, COMBOS)


# ---------------------------------------------------------------------------------
# 4. The experiment: offloaded residuals come back only after the layer's cotangent.


@pytest.mark.parametrize("prevent_cse", [True, False], ids=["prevent_cse", "no_prevent_cse"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reloads_wait_for_the_layers_cotangent(rng, monkeypatch, layout, prevent_cse):
    """With ``residuals.RELOAD_AFTER_COTANGENT`` (an experiment, off by default): in the
    program lowered for CUDA, outside loop bodies every reload of a residual
    array to the device reads the op's own optimization barrier (the layer's 3 residual
    arrays other than E8M0 scales, with its cotangent), with ``jax.checkpoint``'s ``prevent_cse`` on or off: without
    it, under ``prevent_cse=False`` nothing tied a reload to the backward pass and XLA
    folded each host copy and its reload into nothing (measured on the H200). Inside a
    scan body the reloads stay the loop's own (no barrier of ours). Gradients are the
    all-device ones (CPU)."""
    import re

    from jax_grouped_mlp._src.op import residuals

    monkeypatch.setattr(residuals, "RELOAD_AFTER_COTANGENT", True)
    choices = KernelChoices(quantize_weights_in_gemm=False)  # the fused FC1 path
    inputs = _make_inputs(rng, layers=2)
    loss = functools.partial(LAYOUTS[layout], jgm.offload_policy(), choices=choices, prevent_cse=prevent_cse)
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = jax.export.export(fn, platforms=["cuda"], disabled_checks=jgm.export_disabled_checks())(
        *inputs
    ).mlir_module()
    defs = {m.group(1): m.group(2) for m in re.finditer(r"(%[\w]+)(?::\d+)? = (.*)", text)}
    reloads = re.findall(r'annotate_device_placement\((%\w+)(?:#\d+)?\).*_xla_buffer_placement = "device"', text)
    if layout == "loop":  # (the fence's one-element read-backs read slices)
        reloads = [r for r in reloads if not defs[r].startswith(("stablehlo.slice", "stablehlo.dynamic_slice"))]
    ours = [defs[r] for r in reloads if defs[r].startswith("stablehlo.optimization_barrier")
            and len(defs[r].split(":")[0].split(",")) == 4]
    if layout == "loop":  # 5 arrays a layer, 2 of them scales
        assert (len(reloads), len(ours)) == (5 * 2, 3 * 2), [defs[r][:80] for r in reloads]
    else:
        assert reloads and not ours, [defs[r][:80] for r in reloads]
    got = _grads_simple(layout, inputs, ("offload",) * 3, choices)
    want = _grads_simple(layout, inputs, ALL_DEVICE, choices)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def _grads_simple(layout, inputs, combo, choices=DEFAULT):
    loss = functools.partial(LAYOUTS[layout], jgm.offload_policy(*combo), choices=choices)
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return [np.asarray(g.astype(jnp.float32)) for g in fn(*inputs)]


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "fp8_block"])
def test_rebuilt_fc2_input_under_vmap_and_second_order(rng, recipe, monkeypatch):
    """A policy that recomputes fc2_input (the tag's rebuild program in the backward):
    vmap of the gradient and grad of grad work, and give the bits of JAX's own
    ``checkpoint_name`` mechanism (``residuals.OWN_TRANSFERS = False``)."""
    from jax_grouped_mlp._src.op import residuals

    m, h, f, g = 64, 32, 64, 2
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((g, h, f)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((g, f, h)) / np.sqrt(f), jnp.bfloat16)
    gs = jnp.asarray([30, 34], jnp.int32)
    p = jnp.asarray(rng.uniform(0.2, 1.0, m), jnp.float32)
    c = jnp.asarray(rng.standard_normal(w1.shape), jnp.float32)
    policy = jgm.offload_policy("device", "device", "recompute")

    def results(own: bool) -> list:
        monkeypatch.setattr(residuals, "OWN_TRANSFERS", own)
        layer = jax.checkpoint(lambda x, w1: jgm.grouped_mlp(x, w1, w2, gs, p, recipe=recipe), policy=policy)
        loss = lambda x, w1: jnp.sum(layer(x, w1).astype(jnp.float32) ** 2)  # noqa: E731
        inner = lambda x, w1: jnp.vdot(c, jax.grad(loss, argnums=1)(x, w1).astype(jnp.float32))  # noqa: E731
        batched = jax.jit(jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None)))(jnp.stack([x, -0.5 * x]), w1)
        return [batched, jax.jit(jax.grad(inner))(x, w1)]

    for got, want in zip(results(True), results(False)):
        assert np.abs(np.asarray(want, np.float32)).max() > 0
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_eager_calls_compile_only_the_first_time(rng):
    """Without ``jit`` the op's reference GEMMs reuse their compiled scans: each eager call
    made a new tile closure, so every call compiled again (8 programs per call of the
    forward and its gradient at this shape, ~0.3 s)."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=1)
    grad = jax.grad(lambda w1: jnp.sum(jgm.grouped_mlp(x, w1, w2[0], gs, probs).astype(jnp.float32)))
    jax.block_until_ready((jgm.grouped_mlp(x, w1[0], w2[0], gs, probs), grad(w1[0])))
    before = COMPILES.n
    for _ in range(2):
        jax.block_until_ready((jgm.grouped_mlp(x, w1[0], w2[0], gs, probs), grad(w1[0])))
    assert COMPILES.n == before, COMPILES.n - before


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_block", "bf16"])
def test_an_eager_call_at_a_new_shape_compiles_one_program(rng, recipe):
    """Eager calls run as one jitted program (``_src/eager.py``), eager gradients too:
    at a new row count the mxfp8 forward and gradient compiled 254 programs op by op
    (5.6 s on the CPU); now a few. The values are the jitted op's, bit for bit."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=1)
    w1, w2 = w1[0], w2[0]

    def fwd_and_grad(x, w1, probs):
        y = jgm.grouped_mlp(x, w1, w2, gs, probs, recipe=recipe)
        g = jax.grad(lambda w1: jnp.sum(jgm.grouped_mlp(x, w1, w2, gs, probs, recipe=recipe).astype(jnp.float32)))
        return y, g(w1)

    jax.block_until_ready(fwd_and_grad(x, w1, probs))
    before = COMPILES.n
    x1, p1 = x[:-1], probs[:-1]  # one row fewer: new shapes everywhere
    got = jax.block_until_ready(fwd_and_grad(x1, w1, p1))
    assert COMPILES.n - before <= 12, COMPILES.n - before
    want = jax.jit(fwd_and_grad)(x1, w1, p1)
    for g, w in zip(got, want):
        assert np.abs(np.asarray(w, np.float32)).max() > 0
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
