"""plan_offload: the cost model's choices, input checks, and the plan applied for real."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_grouped_mlp._src.offload.measure import (
    measure_host_bandwidth,
    measure_layer_time,
    residual_bytes_kept,
    single_device_sharding,
)
from jax_grouped_mlp._src.op.mlp import grouped_mlp
from jax_grouped_mlp._src.op.names import RESIDUAL_NAMES
from jax_grouped_mlp._src.offload.placement import residual_placements
from jax_grouped_mlp._src.offload.planner import LayerShape, LayerTime, plan_offload
from jax_grouped_mlp._src.offload.policy import offload_policy

NANO = dict(tokens=49152, hidden=2688, ffn=1856, num_experts=128)
GB = 1e9


def _nano_plan(**kw):
    args = dict(
        NANO,
        num_layers=8,
        budget_bytes=100 * GB,
        host_bandwidth=53e9,
        layer_time=LayerTime.roofline(LayerShape(**NANO)),
    )
    args.update(kw)
    return plan_offload(**args)


def _count(placement, kind):
    return sum(placement[n] == kind for n in RESIDUAL_NAMES)


def test_residual_bytes_nano():
    b = LayerShape(**NANO).residual_bytes("mxfp8")
    scale_rows = 49152 // 32 + 128
    assert b == {
        "fc1_input": 49152 * 2688 + scale_rows * 2688,
        "activation_input": 2 * 49152 * 1856,
        "fc2_input": 49152 * 1856 + scale_rows * 1856,
    }
    assert 0.40e9 < sum(b.values()) < 0.42e9  # DESIGN.md: "about 0.4 GB per layer"
    assert LayerShape(**NANO).residual_bytes("bf16")["fc1_input"] == 2 * 49152 * 2688


def test_ample_budget_keeps_everything_on_device():
    plan = _nano_plan()
    assert plan.placement == {n: "device" for n in RESIDUAL_NAMES}
    assert plan.chosen.fits and plan.chosen.exposed_transfer == 0 and plan.chosen.recompute == 0
    assert len(plan.candidates) == 27
    assert _nano_plan(budget_bytes=float("inf")).placement == plan.placement


def test_ample_budget_and_free_transfers_still_prefers_device():
    # With an infinitely fast link offloading costs nothing; the tie goes to less traffic.
    plan = _nano_plan(host_bandwidth=1e18)
    assert plan.placement == {n: "device" for n in RESIDUAL_NAMES}


def test_tight_budget_forces_offload_or_recompute():
    ample = _nano_plan()
    per_layer = sum(ample.residual_bytes.values())
    budgets = [8 * per_layer, 5 * per_layer, 2 * per_layer, per_layer]
    kept = []
    for budget in budgets:
        plan = _nano_plan(budget_bytes=budget)
        assert plan.chosen.fits and plan.chosen.device_bytes <= budget
        kept.append(plan.chosen.device_bytes)
        # Nothing that fits is predicted faster than the choice (beyond the tie tolerance).
        fastest = min(c.step_time for c in plan.candidates if c.fits)
        assert plan.chosen.step_time <= fastest * 1.01
    assert kept == sorted(kept, reverse=True) and kept[0] > kept[-1]
    tight = _nano_plan(budget_bytes=per_layer)
    assert _count(tight.placement, "device") == 0


def test_slow_link_prefers_recompute_or_device():
    ample = _nano_plan()
    # All-device does not fit (8 layers); recomputing does, with the 8 layer inputs the
    # checkpoints then keep (2*M*H each) counted against the budget.
    budget = 8 * 2 * NANO["tokens"] * NANO["hidden"] + 2 * sum(ample.residual_bytes.values())
    assert budget < 8 * sum(ample.residual_bytes.values())
    slow = _nano_plan(budget_bytes=budget, host_bandwidth=1e9)
    assert _count(slow.placement, "offload") == 0
    # A fast link with copies fully hidden makes offload the better use of the budget.
    fast = _nano_plan(budget_bytes=budget, host_bandwidth=1e15)
    assert _count(fast.placement, "offload") > 0
    assert fast.chosen.step_time < slow.chosen.step_time


def test_cost_model_arithmetic():
    lt = LayerTime(1.0, 2.0, {"fc1_input": 0.1, "activation_input": 0.5, "fc2_input": 0.05})
    plan = plan_offload(
        tokens=64, hidden=32, ffn=32, num_experts=2, num_layers=3, budget_bytes=1e12,
        host_bandwidth=1000.0, layer_time=lt, recipe="bf16", overlap=0.5,
        fc1_input_is_layer_input=False,  # count every residual (the layer-input case: below)
    )  # fmt: skip
    b = plan.residual_bytes  # bf16: 4096 bytes each
    assert b == {n: 4096 for n in RESIDUAL_NAMES}
    c = plan.candidate(fc1_input="offload", activation_input="device", fc2_input="recompute")
    transfer = 4096 / 1000.0
    # To the host: hidden behind half the forward. Back, in a Python loop: behind half
    # of the recompute and of the half of the backward before "fc1_input" is read; in
    # a scan: not hidden.
    exposed = max(0, transfer - 0.5 * 1.0) + max(0, transfer - 0.5 * (0.05 + 0.5 * 2.0))
    assert c.device_bytes == 3 * 4096 + 2 * 4096
    assert c.host_bytes == 3 * 4096 and c.transfer_bytes == 2 * 3 * 4096
    assert c.step_time == pytest.approx(3 * (3.0 + 0.05 + exposed))
    assert c.recompute == pytest.approx(3 * 0.05)
    scan = plan_offload(**{**dict(tokens=64, hidden=32, ffn=32, num_experts=2, num_layers=3, budget_bytes=1e12,
                                  host_bandwidth=1000.0, layer_time=lt, recipe="bf16", overlap=0.5,
                                  fc1_input_is_layer_input=False)}, layout="scan")  # fmt: skip
    c = scan.candidate(fc1_input="offload", activation_input="device", fc2_input="recompute")
    assert c.step_time == pytest.approx(3 * (3.0 + 0.05 + max(0, transfer - 0.5 * 1.0) + transfer))


def test_report_prints_a_table():
    plan = _nano_plan(budget_bytes=2 * GB)
    text = str(plan)
    for name in RESIDUAL_NAMES:
        assert name in text
    rows = [line for line in text.splitlines() if line.rstrip().endswith(("yes", "no"))]
    assert len(rows) == 27
    assert sum(line.startswith("*") for line in rows) == 1
    assert f"chosen (*): {plan.chosen.label()}" in text
    # A shortened table still shows the chosen row.
    short = [line for line in plan.table(top=2).splitlines() if line.startswith("*")]
    assert short == [line for line in rows if line.startswith("*")]


def test_layer_time_from_float_matches_total():
    plan = _nano_plan(layer_time=0.006)
    assert plan.layer_time.total == pytest.approx(0.006)
    assert 0 < plan.layer_time.recompute["fc2_input"] < plan.layer_time.recompute["activation_input"]


@pytest.mark.parametrize(
    "kw, arg",
    [
        (dict(tokens=0), "tokens"),
        (dict(hidden=-1), "hidden"),
        (dict(ffn=2.5), "ffn"),
        (dict(num_experts=True), "num_experts"),
        (dict(num_layers=0), "num_layers"),
        (dict(budget_bytes=-1.0), "budget_bytes"),
        (dict(budget_bytes=float("nan")), "budget_bytes"),
        (dict(host_bandwidth=0), "host_bandwidth"),
        (dict(host_bandwidth="fast"), "host_bandwidth"),
        (dict(layer_time=-1.0), "layer_time"),
        (dict(layer_time="1ms"), "layer_time"),
        (dict(recipe="fp4"), "recipe"),
        (dict(overlap=1.5), "overlap"),
        (dict(tie_tolerance=-0.1), "tie_tolerance"),
        (dict(budget_bytes=1.0), "budget_bytes"),  # nothing fits
    ],
)
def test_invalid_inputs_name_the_argument(kw, arg):
    with pytest.raises(ValueError, match=arg):
        _nano_plan(**kw)


def test_invalid_layer_time_fields():
    with pytest.raises(ValueError, match="recompute"):
        LayerTime(1.0, 1.0, {"fc1_input": 0.0})
    with pytest.raises(ValueError, match="forward"):
        LayerTime(0.0, 1.0, {n: 0.0 for n in RESIDUAL_NAMES})


def test_measure_host_bandwidth_runs():
    bw = measure_host_bandwidth(1 << 20, repeats=2)
    assert np.isfinite(bw) and bw > 0
    with pytest.raises(ValueError, match="nbytes"):
        measure_host_bandwidth(0)


def test_measure_layer_time_runs():
    lt = measure_layer_time(tokens=64, hidden=32, ffn=32, num_experts=2, repeats=1)
    assert lt.forward > 0 and lt.backward > 0
    assert set(lt.recompute) == set(RESIDUAL_NAMES) and min(lt.recompute.values()) >= 0
    with pytest.raises(ValueError, match="recipe"):
        measure_layer_time(tokens=64, hidden=32, ffn=32, num_experts=2, recipe="fp4")


# --- The plan applied: a small stack of layers under jax.checkpoint ------------------

M, H, F, G, LAYERS = 128, 64, 64, 4, 2


def _stack_inputs():
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (M, H), jnp.bfloat16)
    w1 = jax.random.normal(keys[1], (LAYERS, G, H, F), jnp.float32) * H**-0.5
    w2 = jax.random.normal(keys[2], (LAYERS, G, F, H), jnp.float32) * F**-0.5
    sizes = jnp.array([40, 24, 32, 32], jnp.int32)
    return x, w1, w2, sizes


def _stack_loss(policy, recipe: str = "mxfp8"):
    layer = jax.checkpoint(functools.partial(grouped_mlp, recipe=recipe), policy=policy)

    def loss(w1, w2, x, sizes):
        for i in range(LAYERS):
            x = x + layer(x, w1[i], w2[i], sizes)
        return jnp.sum(x.astype(jnp.float32) ** 2)

    return loss


def _plan_for(budget_layers: float, host_bandwidth: float):
    shape = LayerShape(M, H, F, G)
    per_layer = sum(shape.residual_bytes("mxfp8").values())
    return plan_offload(
        tokens=M, hidden=H, ffn=F, num_experts=G, num_layers=LAYERS,
        budget_bytes=budget_layers * per_layer, host_bandwidth=host_bandwidth,
        layer_time=LayerTime.roofline(shape),
    )  # fmt: skip


@pytest.mark.parametrize(
    "budget_layers, host_bandwidth",
    [(10.0, 53e9), (1.0, 1e18), (1.0, 1e6)],  # all device / offload / recompute-heavy
)
def test_planned_policy_places_residuals_as_reported(budget_layers, host_bandwidth):
    plan = _plan_for(budget_layers, host_bandwidth)
    x, w1, w2, sizes = _stack_inputs()
    loss = _stack_loss(plan.policy)
    grad = jax.grad(loss, argnums=(0, 1))
    placed = residual_placements(grad, w1, w2, x, sizes)
    assert {n: placed[n] for n in RESIDUAL_NAMES} == plan.placement

    kept = residual_bytes_kept(loss, w1, w2, x, sizes, argnums=(0, 1))
    for name in RESIDUAL_NAMES:
        b = LAYERS * plan.residual_bytes[name]
        want = {"device": (b, 0), "offload": (0, b), "recompute": (0, 0)}[plan.placement[name]]
        assert (kept[name]["device_bytes"], kept[name]["host_bytes"]) == want, name
    # The prediction is what the program keeps plus one layer's transient rebuild.
    transient = sum(b for n, b in plan.residual_bytes.items() if plan.placement[n] != "device")
    on_device = sum(kept[n]["device_bytes"] for n in RESIDUAL_NAMES)
    assert on_device + transient == plan.chosen.device_bytes


@pytest.mark.parametrize("recipe", ["fp8_block", "bf16"])
def test_residual_bytes_are_what_the_op_keeps(recipe):
    """The planner sizes each recipe's residuals as the op keeps them: fp8_block's FP8
    copies with one scale row per group-aware 128-row block, bf16's bf16 copies."""
    shape = LayerShape(M, H, F, G)
    per_layer = shape.residual_bytes(recipe)
    if recipe == "fp8_block":
        rows = -(-M // 128) + G
        assert per_layer == {"fc1_input": M * H + rows * H, "activation_input": 2 * M * F,
                             "fc2_input": M * F + rows * F}
    x, w1, w2, sizes = _stack_inputs()
    placement = {"fc1_input": "device", "activation_input": "offload", "fc2_input": "device"}
    kept = residual_bytes_kept(_stack_loss(offload_policy(**placement), recipe), w1, w2, x, sizes, argnums=(0, 1))
    for name in RESIDUAL_NAMES:
        b = LAYERS * per_layer[name]
        want = (0, b) if placement[name] == "offload" else (b, 0)
        assert (kept[name]["device_bytes"], kept[name]["host_bytes"]) == want, name
    plan = plan_offload(tokens=M, hidden=H, ffn=F, num_experts=G, num_layers=LAYERS, budget_bytes=float("inf"),
                        host_bandwidth=53e9, layer_time=LayerTime.roofline(shape, recipe), recipe=recipe)
    assert plan.residual_bytes == per_layer and f"recipe={recipe}" in str(plan)


def test_planned_policy_gradients_match_no_offload():
    plan = _plan_for(1.0, 1e18)  # offloads (and maybe recomputes) something
    assert set(plan.placement.values()) != {"device"}
    x, w1, w2, sizes = _stack_inputs()
    keep = offload_policy("device", "device", "device")
    want = jax.jit(jax.grad(_stack_loss(keep), argnums=(0, 1)))(w1, w2, x, sizes)
    got = jax.jit(jax.grad(_stack_loss(plan.policy), argnums=(0, 1)))(w1, w2, x, sizes)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_plan_says_when_to_unfuse_fc1():
    """A plan that recomputes fc2_input asks for the unfused FC1 (whose recompute it costs)."""
    import dataclasses

    plan = _nano_plan()
    assert plan.fuse_fc1_epilogue  # everything on the device
    for c in plan.candidates:
        sub = dataclasses.replace(plan, placement=dict(c.placement))
        assert sub.fuse_fc1_epilogue  # the policy alone decides what is recomputed


# ---------------------------------------------------------------------------------
# The planner and the layer's input (bf16) and expert parallelism (issue 22, item 4).


def test_bf16_fc1_input_is_the_layer_input():
    """bf16 saves x itself as "fc1_input": the checkpoint keeps the layer input on the
    device whatever the policy, so it costs no residual memory, offloading it only adds
    copies, and a tight budget is met by the other two residuals."""
    per_layer = LayerShape(**NANO).residual_bytes("bf16")
    plan = _nano_plan(recipe="bf16", budget_bytes=8 * per_layer["fc2_input"])
    assert plan.kept_anyway == frozenset({"fc1_input"})
    assert plan.placement["fc1_input"] == "device"
    for c in plan.candidates:
        others = sum(per_layer[n] for n in ("activation_input", "fc2_input") if c.placement[n] == "device")
        transient = sum(per_layer[n] for n in ("activation_input", "fc2_input") if c.placement[n] != "device")
        assert c.device_bytes == 8 * others + transient, c.label()
    # The same shape with fc1_input not the layer input (a MoE block permutes x first):
    # fc1_input costs its bytes again.
    moe = _nano_plan(recipe="bf16", budget_bytes=8 * per_layer["fc2_input"], fc1_input_is_layer_input=False)
    assert moe.kept_anyway == frozenset()
    assert moe.candidate(fc1_input="device", activation_input="device", fc2_input="device").device_bytes == (
        8 * sum(per_layer.values()))
    with pytest.raises(ValueError, match="fc1_input_is_layer_input"):
        _nano_plan(fc1_input_is_layer_input=True)  # mxfp8 keeps a quantized copy
    with pytest.raises(TypeError, match="fc1_input_is_layer_input"):
        _nano_plan(recipe="bf16", fc1_input_is_layer_input="yes")


def test_exchange_time_is_added_to_every_placement():
    base = _nano_plan(budget_bytes=2e9)
    ep = _nano_plan(budget_bytes=2e9, exchange_time=1e-3)
    assert ep.placement == base.placement
    for a, b in zip(base.candidates, ep.candidates):
        assert b.step_time == pytest.approx(a.step_time + 8 * 1e-3)
    with pytest.raises(ValueError, match="exchange_time"):
        _nano_plan(exchange_time=-1.0)


def test_recomputing_from_x_keeps_the_layer_input():
    """Recomputing fc1_input or activation_input keeps each layer's input x on the device
    (the scan of the H200 run grew by exactly x per layer for those placements, within
    21 MB of 413 MB): counted and budgeted; not where fc1_input is x itself (bf16)."""
    plan = _nano_plan()
    x = 2 * NANO["tokens"] * NANO["hidden"]
    for c in plan.candidates:
        from_x = c.placement["fc1_input"] == "recompute" or c.placement["activation_input"] == "recompute"
        assert c.layer_input_bytes == (8 * x if from_x else 0), c.label()
        assert c.total_device_bytes == c.device_bytes + c.layer_input_bytes
    rrr = plan.candidate(fc1_input="recompute", activation_input="recompute", fc2_input="recompute")
    assert not _nano_plan(budget_bytes=rrr.device_bytes + 8 * x - 1).candidate(
        fc1_input="recompute", activation_input="recompute", fc2_input="recompute").fits
    bf16 = _nano_plan(recipe="bf16")
    assert all(c.layer_input_bytes == 0 for c in bf16.candidates)


def test_moe_block_layers_keep_their_input_anyway():
    """``layer="moe_block"``: the block keeps its input x in every placement (the
    router's gradient reads it; tests/test_block_residuals.py), so recomputing charges no
    layer input, and its fc1_input is never the layer input, even with bf16."""
    grouped, moe = _nano_plan(), _nano_plan(layer="moe_block")
    assert moe.layer == "moe_block" and grouped.layer == "grouped_mlp"
    for c in moe.candidates:
        assert c.layer_input_bytes == 0, c.label()
        g = grouped.candidate(**c.placement)
        assert (c.device_bytes, c.step_time) == (g.device_bytes, g.step_time), c.label()
    assert "layer=moe_block" in moe.table(top=1)
    bf16 = _nano_plan(recipe="bf16", layer="moe_block")
    assert bf16.kept_anyway == frozenset()
    assert all(c.layer_input_bytes == 0 for c in bf16.candidates)
    # A budget that fits all three recomputed only without the layer inputs.
    rrr = dict(fc1_input="recompute", activation_input="recompute", fc2_input="recompute")
    budget = moe.candidate(**rrr).device_bytes
    assert _nano_plan(layer="moe_block", budget_bytes=budget).candidate(**rrr).fits
    assert not _nano_plan(budget_bytes=budget).candidate(**rrr).fits


def test_moe_block_recompute_dispatches_again():
    """With an exchange, recomputing fc1_input or activation_input of a ``moe_block``
    sends the tokens through it once more (one of its four all-to-alls:
    tests/moe_sharded_cases.py counts them): DISPATCH_SHARE of ``exchange_time``."""
    from jax_grouped_mlp._src.offload.planner import DISPATCH_SHARE

    base = _nano_plan(layer="moe_block")
    ep = _nano_plan(layer="moe_block", exchange_time=2e-3)
    for a in base.candidates:
        b = ep.candidate(**a.placement)
        from_x = "recompute" in (a.placement["fc1_input"], a.placement["activation_input"])
        extra = DISPATCH_SHARE * 2e-3 if from_x else 0.0
        assert b.recompute == pytest.approx(a.recompute + 8 * extra), a.label()
        if "offload" not in a.placement.values():  # (else the recompute also hides reloads)
            assert b.step_time == pytest.approx(a.step_time + 8 * (2e-3 + extra)), a.label()
    # grouped_mlp layers have no dispatch to redo.
    plain, plain_ep = _nano_plan(), _nano_plan(exchange_time=2e-3)
    assert all(c.recompute == plain_ep.candidate(**c.placement).recompute for c in plain.candidates)


@pytest.mark.parametrize("bad", ["moe", "", 3, "GROUPED_MLP"])
def test_layer_argument_is_checked(bad):
    with pytest.raises(ValueError, match="layer must be one of"):
        _nano_plan(layer=bad)
    with pytest.raises(ValueError, match="layer='grouped_mlp'"):
        _nano_plan(recipe="bf16", layer="moe_block", fc1_input_is_layer_input=True)


def test_layer_stack_model():
    """``layout="layer_stack"``: the copies hide behind the neighbouring layers (never slower
    than one checkpoint per layer), the last layer offloads nothing, one more layer's
    offloaded residuals are on the device; the hand-computed step for all-offload."""
    loop, stack = _nano_plan(), _nano_plan(layout="layer_stack")
    assert stack.layout == "layer_stack" and loop.layout == "loop"
    for a, b in zip(sorted(loop.candidates, key=lambda c: c.label()), sorted(stack.candidates, key=lambda c: c.label())):
        assert b.step_time <= a.step_time + 1e-12, a.label()
        offloaded = sum(stack.residual_bytes[n] for n in RESIDUAL_NAMES if a.placement[n] == "offload")
        assert b.host_bytes == 7 * offloaded and a.host_bytes == 8 * offloaded
        assert b.device_bytes == a.device_bytes + offloaded
    c = stack.candidate(fc1_input="offload", activation_input="offload", fc2_input="offload")
    lt, t = stack.layer_time, sum(stack.residual_bytes.values()) / 53e9
    want = 8 * lt.total + 7 * (max(0.0, t - lt.forward) + max(0.0, t - lt.backward))
    assert c.step_time == pytest.approx(want, rel=1e-12)
    for bad in ("stack", True, None):
        with pytest.raises(ValueError, match="layout must be one of"):
            _nano_plan(layout=bad)


def test_layer_scan_model():
    """``layout="layer_scan"`` (its CUDA copies) and ``"layer_scan_xla"`` (XLA's): the
    last two layers keep their offloaded residuals on the device; the other layers'
    copies hide as under ``layer_stack`` with the library's copies, and are exposed each
    way with XLA's; hand-computed steps for all-offload; one layer offloads nothing."""
    loop, stack = _nano_plan(), _nano_plan(layout="layer_stack")
    scan, xla = _nano_plan(layout="layer_scan"), _nano_plan(layout="layer_scan_xla")
    assert (scan.layout, xla.layout) == ("layer_scan", "layer_scan_xla")
    key = lambda c: c.label()  # noqa: E731
    for a, b, c in zip(sorted(loop.candidates, key=key), sorted(scan.candidates, key=key),
                       sorted(xla.candidates, key=key)):  # fmt: skip
        offloaded = sum(scan.residual_bytes[n] for n in RESIDUAL_NAMES if a.placement[n] == "offload")
        for d in (b, c):
            assert d.host_bytes == 6 * offloaded and d.device_bytes == a.device_bytes + 2 * offloaded, a.label()
    every = dict(fc1_input="offload", activation_input="offload", fc2_input="offload")
    t = sum(scan.residual_bytes.values()) / 53e9
    lt = scan.layer_time
    assert xla.candidate(**every).step_time == pytest.approx(8 * lt.total + 6 * 2 * t, rel=1e-12)
    exposed = max(0.0, t - lt.forward) + max(0.0, t - lt.backward)
    assert scan.candidate(**every).step_time == pytest.approx(8 * lt.total + 6 * exposed, rel=1e-12)
    # per offloading layer, what layer_stack exposes
    s = stack.candidate(**every)
    assert scan.candidate(**every).exposed_transfer / 6 == pytest.approx(s.exposed_transfer / 7, rel=1e-12)
    for layout in ("layer_scan", "layer_scan_xla"):
        one = _nano_plan(layout=layout, num_layers=1)
        assert all(c.host_bytes == 0 and c.exposed_transfer == 0 for c in one.candidates)


@pytest.mark.parametrize("recipe", ["mxfp8", "bf16"])  # bf16: fc1_input is the layer's input
@pytest.mark.parametrize("layout, layers", [("layer_stack", 1), ("layer_scan", 1), ("layer_scan", 2),
                                            ("layer_scan_xla", 2)])  # fmt: skip
def test_stacks_that_offload_nothing_count_offload_as_device(layout, layers, recipe):
    """Where no layer offloads (the stack keeps its last layers' residuals on the
    device), "offload" costs the device what "device" does, not twice that."""
    plan = _nano_plan(layout=layout, num_layers=layers, recipe=recipe)
    for c in plan.candidates:
        as_device = {n: "device" if p == "offload" else p for n, p in c.placement.items()}
        assert c.host_bytes == 0 and c.device_bytes == plan.candidate(**as_device).device_bytes, c.label()


def test_loop_reloads_hide_behind_the_backward_before_their_first_read():
    """``layout="loop"``: a layer's copies run one after the other in the order the layer
    stored its residuals (fc1_input, activation_input, fc2_input); a copy out hides only
    behind the forward left once its residual exists (all of it for fc1_input, half for
    the other two), a copy back only behind the backward before its first read
    ("activation_input" none, "fc2_input" a quarter, "fc1_input" half); in a scan each
    copy back is exposed whole. Hand-computed for one residual offloaded and for all."""
    loop, scan = _nano_plan(), _nano_plan(layout="scan")
    lt, bw, per = loop.layer_time, 53e9, loop.residual_bytes

    def step(plan, **placement):
        full = {n: "device" for n in RESIDUAL_NAMES} | placement
        return plan.candidate(**full).step_time

    def out(t):  # copies to the host: behind the layer's own forward
        return max(0.0, t - lt.forward)

    t1 = per["fc1_input"] / bw
    assert step(loop, fc1_input="offload") == pytest.approx(8 * (lt.total + out(t1) + max(0.0, t1 - 0.5 * lt.backward)))
    assert step(scan, fc1_input="offload") == pytest.approx(8 * (lt.total + out(t1) + t1))
    ta = per["activation_input"] / bw
    assert step(loop, activation_input="offload") == pytest.approx(
        8 * (lt.total + max(0.0, ta - 0.5 * lt.forward) + ta))
    tc = per["fc2_input"] / bw
    assert step(loop, fc2_input="offload") == pytest.approx(
        8 * (lt.total + max(0.0, tc - 0.5 * lt.forward) + max(0.0, tc - 0.25 * lt.backward)))
    assert step(scan, activation_input="offload") == pytest.approx(8 * (lt.total + out(ta) + ta))
    t = [per[n] / bw for n in ("fc1_input", "activation_input", "fc2_input")]  # stored in this order
    wait = max(t[0] - 0.5 * lt.backward, t[0] + t[1], sum(t) - 0.25 * lt.backward)
    out_all = max(sum(t) - lt.forward, t[1] + t[2] - 0.5 * lt.forward, 0.0)
    every = dict.fromkeys(RESIDUAL_NAMES, "offload")
    assert step(loop, **every) == pytest.approx(8 * (lt.total + out_all + wait))
    assert step(loop, **every) <= step(scan, **every)
    # A recompute runs first in the backward: it hides the copies back too.
    rec = lt.recompute["fc2_input"]
    assert step(loop, fc1_input="offload", fc2_input="recompute") == pytest.approx(
        8 * (lt.total + rec + out(t1) + max(0.0, t1 - rec - 0.5 * lt.backward)))


def test_candidate_and_table_arguments():
    plan = _nano_plan()
    with pytest.raises(ValueError, match="name all of"):
        plan.candidate(fc1_input="offload")
    for top in (-1, 1.5, True):
        with pytest.raises(ValueError, match="top must be"):
            plan.table(top=top)
    assert plan.table(top=0)


def test_single_device_sharding_without_the_deprecated_constructor(monkeypatch):
    """The measurement's shardings come from ``make_single_device_sharding`` where jax
    has it (constructing ``SingleDeviceSharding`` warns from jax 0.12), else from the
    class, in the memory kind asked for."""
    import warnings

    device = jax.devices()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for kind in ("pinned_host", "device"):
            if kind in {m.kind for m in device.addressable_memories()}:
                assert single_device_sharding(device, kind).memory_kind == kind
    monkeypatch.delattr(jax.sharding, "make_single_device_sharding", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert single_device_sharding(device, "device").memory_kind == "device"
