"""Bad input to grouped_mlp raises at trace time, naming the argument and what was expected."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_grouped_mlp as jgm

M, H, F, G = 64, 32, 48, 4
X = jax.ShapeDtypeStruct((M, H), jnp.bfloat16)
W1 = jax.ShapeDtypeStruct((G, H, F), jnp.bfloat16)
W2 = jax.ShapeDtypeStruct((G, F, H), jnp.bfloat16)
GS = jax.ShapeDtypeStruct((G,), jnp.int32)
P = jax.ShapeDtypeStruct((M,), jnp.float32)


def sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


CASES = {
    "x_rank": ((sds((M, H, 1)), W1, W2, GS, P), {}, ValueError, r"x must be \[M, H\].*x.shape=\(64, 32, 1\)"),
    "w1_rank": ((X, sds((H, F)), W2, GS, P), {}, ValueError, r"w1 must be \[G, H, F\]"),
    "w2_rank": ((X, W1, sds((F, H)), GS, P), {}, ValueError, r"w2 must be \[G, F, H\]"),
    "h_mismatch": ((X, sds((G, H + 1, F)), W2, GS, P), {}, ValueError, r"w1.shape\[1\] must equal H"),
    "f_mismatch": ((X, W1, sds((G, F + 2, H)), GS, P), {}, ValueError, r"w2 must be \[G, F, H\]=\(4, 48, 32\)"),
    "g_mismatch": ((X, W1, sds((G + 1, F, H)), GS, P), {}, ValueError, r"w2 must be"),
    "gs_float": ((X, W1, W2, sds((G,), jnp.float32), P), {}, TypeError, r"group_sizes must be an integer array.*float32"),
    "gs_length": ((X, W1, W2, sds((G + 1,), jnp.int32), P), {}, ValueError, r"group_sizes must have shape \[G\]=\(4,\)"),
    "gs_rank": ((X, W1, W2, sds((G, 1), jnp.int32), P), {}, ValueError, r"group_sizes must have shape"),
    "x_int": ((sds((M, H), jnp.int32), W1, W2, GS, P), {}, TypeError, r"x must be bfloat16 or float32.*int32"),
    "w1_fp16": ((X, sds((G, H, F), jnp.float16), W2, GS, P), {}, TypeError, r"w1 must be bfloat16 or float32"),
    "probs_shape": ((X, W1, W2, GS, sds((M, 2), jnp.float32)), {}, ValueError, r"probs must be \[M\] or \[M, 1\] with M=64"),
    "probs_int": ((X, W1, W2, GS, sds((M,), jnp.int32)), {}, TypeError, r"probs must be a float array"),
    "h_zero": ((sds((M, 0)), sds((G, 0, F)), sds((G, F, 0)), GS, P), {}, ValueError, r"H and the FFN size F must be positive"),
    "f_zero": ((X, sds((G, H, 0)), sds((G, 0, H)), GS, P), {}, ValueError, r"H and the FFN size F must be positive"),
    "recipe": ((X, W1, W2, GS, P), {"recipe": "fp4"}, ValueError, r"recipe must be one of \['mxfp8', 'bf16', 'fp8_block'\], got recipe='fp4'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_at_trace_time(case):
    args, kwargs, exc, match = CASES[case]
    with pytest.raises(exc, match=match):
        jax.eval_shape(lambda *a: jgm.grouped_mlp(*a, **kwargs), *args)


def test_non_array_arguments():
    with pytest.raises(TypeError, match="group_sizes must be an array"):
        jgm.grouped_mlp(jnp.ones((M, H), jnp.bfloat16), jnp.ones((G, H, F)), jnp.ones((G, F, H)), None)
    with pytest.raises(TypeError, match="x must be an array"):
        jgm.grouped_mlp("tokens", jnp.ones((G, H, F)), jnp.ones((G, F, H)), jnp.ones((G,), jnp.int32))


def test_valid_shapes_trace():
    out = jax.eval_shape(jgm.grouped_mlp, X, W1, W2, GS, P)
    assert out.shape == (M, H) and out.dtype == jnp.bfloat16


def test_numpy_integers_are_accepted_and_bools_are_not():
    import numpy as np
    from flax import nnx

    from jax_grouped_mlp.flax import GroupedMLP

    assert jgm.RoutingConfig(top_k=np.int64(2)).top_k == 2
    assert GroupedMLP(np.int32(2), 32, 32, rngs=nnx.Rngs(0)).num_experts == 2
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        GroupedMLP(True, 8, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        jgm.RoutingConfig(top_k=2.0)


# ---- issue #16 items 2 and 6: numbers, None, hand-built tensors, module dtypes ----


@pytest.mark.parametrize("value", [float("inf"), -float("inf"), float("nan"), 1e300, 3.5e38, np.float64(np.inf), True, 0.0, -1.0, "2"])
def test_routed_scaling_factor_rejected(value):
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        jgm.RoutingConfig(2, routed_scaling_factor=value)


@pytest.mark.parametrize("value", [np.float32(2.5), np.float64(2.5), np.int64(3), 2, 3e38])
def test_routed_scaling_factor_numpy_and_python_numbers(value):
    config = jgm.RoutingConfig(np.int64(2), routed_scaling_factor=value)
    assert type(config.routed_scaling_factor) is float and config.routed_scaling_factor == float(value)


def test_expert_parallel_numbers_and_none():
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    for bad in (float("inf"), np.float32(np.inf)):
        with pytest.raises(ValueError, match=r"capacity_factor must be finite \(None is drop-free\)"):
            jgm.ExpertParallel(mesh, "expert", capacity_factor=bad)
    for bad in (float("nan"), True, 0, -2.0, "1.5"):
        with pytest.raises(ValueError, match="capacity_factor"):
            jgm.ExpertParallel(mesh, "expert", capacity_factor=bad)
    assert jgm.ExpertParallel(mesh, "expert", capacity_factor=np.float32(1.5)).capacity_factor == 1.5
    assert jgm.ExpertParallel(mesh, "expert", capacity_factor=np.int64(2)).capacity_factor == 2.0
    for bad in (None, 5):
        with pytest.raises(TypeError, match="data_axes"):
            jgm.ExpertParallel(mesh, "expert", data_axes=bad)


def test_expert_parallel_warns_below_the_average_load():
    """capacity_factor < 1 drops pairs even under balanced routing: a warning at the
    user's line; 1 and above construct silently."""
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    with pytest.warns(UserWarning, match=r"capacity_factor=0\.5 is below 1.*perfectly balanced") as record:
        assert jgm.ExpertParallel(mesh, "expert", capacity_factor=0.5).capacity_factor == 0.5
    assert record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for fine in (None, 1, 1.0, 1.25, 8):
            jgm.ExpertParallel(mesh, "expert", capacity_factor=fine)


def test_planner_takes_numpy_scalars():
    kw = dict(tokens=4096, hidden=512, ffn=1024, num_experts=8, num_layers=6)
    want = jgm.plan_offload(**kw, budget_bytes=40e6, host_bandwidth=5e10, layer_time=2e-3)
    got = jgm.plan_offload(
        **kw, budget_bytes=np.int64(40_000_000), host_bandwidth=np.float32(5e10), layer_time=np.float32(2e-3),
        overlap=np.float32(1.0), tie_tolerance=np.float64(0.01),
    )
    assert got.placement == want.placement and got.budget_bytes == want.budget_bytes
    assert type(got.host_bandwidth) is float
    for name, bad in (("host_bandwidth", np.bool_(True)), ("budget_bytes", np.float32(np.nan)), ("layer_time", np.float32(-1))):
        with pytest.raises(ValueError, match=name):
            jgm.plan_offload(**{**kw, "budget_bytes": 1e9, "host_bandwidth": 5e10, "layer_time": 1e-3, name: bad})
    lt = jgm.LayerTime(np.float32(1e-3), np.float64(2e-3), {n: np.float32(0) for n in jgm.RESIDUAL_NAMES})
    assert lt.total == pytest.approx(3e-3)
    with pytest.raises(TypeError, match="recompute must be a mapping.*recompute=None"):
        jgm.LayerTime(1e-3, 2e-3, None)


def test_none_names_in_offload_policy():
    for name in ("extra_saveable", "extra_offloadable"):
        with pytest.raises(TypeError, match=f"{name} must be a sequence of names.*{name}=None"):
            jgm.offload_policy(**{name: None})


def test_complex_score_bias_rejected():
    e = 4
    args = (sds((8, H), jnp.bfloat16), sds((H, e), jnp.float32), sds((e, H, F)), sds((e, F, H)))
    for dtype in (jnp.complex64, jnp.bool_):
        with pytest.raises(TypeError, match="score_bias must be a real"):
            jax.eval_shape(
                lambda *a, b: jgm.moe_block(*a, routing=jgm.RoutingConfig(2), score_bias=b), *args, b=sds((e,), dtype)
            )


def test_routing_helpers_name_non_array_arguments():
    """Lists or scalars where route/permute/combine/moe_block take arrays: a TypeError
    naming the argument (it was a ValueError reading ``shape=None``)."""
    logits = jnp.ones((8, 4), jnp.float32)
    ids, w = jgm.route(logits, jgm.RoutingConfig(2))
    x = jnp.ones((8, H), jnp.bfloat16)
    _, _, _, perm = jgm.permute(x, ids, w, 4)
    cases = {
        "score_bias": lambda: jgm.route(logits, jgm.RoutingConfig(2), score_bias=[0.0] * 4),
        "x": lambda: jgm.permute(x.tolist(), ids, w, 4),
        "expert_ids": lambda: jgm.permute(x, ids.tolist(), w, 4),
        "y_sorted": lambda: jgm.combine(jnp.ones((16, H)).tolist(), perm),
    }
    for name, call in cases.items():
        with pytest.raises(TypeError, match=f"{name} must be a.*got {name}=list"):
            call()
    with pytest.raises(TypeError, match="score_bias must be a real .E. array or None, got score_bias=list"):
        jgm.moe_block(x, jnp.ones((H, 4), jnp.float32), jnp.ones((4, H, F), jnp.bfloat16),
                      jnp.ones((4, F, H), jnp.bfloat16), routing=jgm.RoutingConfig(2), score_bias=[0.0] * 4)


def test_module_constructors_check_dtypes_and_top_k():
    from flax import nnx

    from jax_grouped_mlp.flax import GroupedMLP, MoEBlock

    for kw, name in (({"dtype": jnp.int32}, "dtype"), ({"dtype": "not-a-dtype"}, "dtype"),
                     ({"param_dtype": jnp.float16}, "param_dtype"), ({"dtype": jnp.complex64}, "dtype")):
        with pytest.raises(TypeError, match=f"{name} must be one of \\['bfloat16', 'float32'\\]"):
            GroupedMLP(2, 8, 8, rngs=nnx.Rngs(0), **kw)
        with pytest.raises(TypeError, match=name):
            MoEBlock(2, 8, 8, routing=jgm.RoutingConfig(1), rngs=nnx.Rngs(0), **kw)
    assert GroupedMLP(2, 8, 8, dtype="float32", param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)).dtype == jnp.float32
    with pytest.raises(ValueError, match="routing.top_k=3 is larger than num_experts=2"):
        MoEBlock(np.int64(2), 8, 8, routing=jgm.RoutingConfig(3), rngs=nnx.Rngs(0))


def _hand_built_cases():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((70, 40)), jnp.float32)
    t = jgm.quantize_mxfp8(x, axis=0)  # scale (3, 40)
    tg = jgm.quantize_mxfp8_grouped(x, jnp.asarray([30, 40], jnp.int32))  # scale (5, 40)
    T = jgm.MXFP8Tensor
    return {
        "scale_shape": (T(t.data, t.scale[:2], 0), ValueError, r"t.scale must have shape \(3, 40\)"),
        "wrong_axis_for_scale": (T(t.data, t.scale, 1), ValueError, r"t.scale must have shape \(70, 2\)"),
        "axis_range": (T(t.data, t.scale, 2), ValueError, r"t.axis must be an int in \[0, 2\).*t.axis=2"),
        "axis_negative": (T(t.data, t.scale, -1), ValueError, "t.axis"),
        "axis_bool": (T(t.data, t.scale, True), ValueError, "t.axis=True"),
        "data_dtype": (T(t.data.astype(jnp.bfloat16), t.scale, 0), TypeError, "t.data must be float8_e4m3fn"),
        "scale_dtype": (T(t.data, t.scale.astype(jnp.float32), 0), TypeError, "t.scale must be float8_e8m0fnu"),
        "grouped_scale_rows": (T(tg.data, tg.scale[:4], 0, tg.group_sizes), ValueError, r"t.scale must have shape \(5, 40\)"),
        "grouped_axis": (T(tg.data, tg.scale, 1, tg.group_sizes), ValueError, "group-aware tensor must be"),
        "grouped_sizes_dtype": (T(tg.data, tg.scale, 0, tg.group_sizes.astype(jnp.float32)), TypeError, "t.group_sizes"),
    }


@pytest.mark.parametrize("case", list(_hand_built_cases()))
def test_dequantize_checks_hand_built_tensors(case):
    t, exc, match = _hand_built_cases()[case]
    with pytest.raises(exc, match=match):
        jgm.dequantize(t)


def test_dequantize_dtype_and_quantize_axis():
    x = jnp.ones((4, 64), jnp.float32)
    t = jgm.quantize_mxfp8(x)
    for bad in (jnp.int32, jnp.bool_, "nope", jnp.complex64):
        with pytest.raises(TypeError, match="dtype must be a float dtype"):
            jgm.dequantize(t, bad)
    assert jgm.dequantize(t, jnp.float16).dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(jgm.dequantize(t, jnp.float32)), np.asarray(x))
    for bad in (True, np.bool_(False)):
        with pytest.raises(TypeError, match="axis must be an int"):
            jgm.quantize_mxfp8(x, axis=bad)
    assert jgm.quantize_mxfp8(x, axis=np.int64(0)).axis == 0


@pytest.mark.parametrize(
    "group_sizes",
    [
        [True, 3, 0, 4],  # True was a size of 1
        (1, 2, np.True_, 4),
        [np.int32(1), False, 3, 4],
        np.array([True, True, False, True]),
        jnp.array([True, True, False, True]),
    ],
    ids=["list", "tuple_np_bool", "list_false", "numpy_bool", "jax_bool"],
)
def test_bool_group_sizes_rejected(group_sizes):
    with pytest.raises(TypeError, match="group_sizes"):
        jax.eval_shape(lambda x, w1, w2: jgm.grouped_mlp(x, w1, w2, group_sizes), X, W1, W2)
    with pytest.raises(TypeError, match="group_sizes"):  # the group-aware quantizer's check
        jax.eval_shape(lambda x: jgm.quantize_mxfp8_grouped(x, group_sizes), sds((M, 64)))
    from jax_grouped_mlp._src import groups

    if not isinstance(group_sizes, jax.Array):  # host_clip leaves device arrays to their callers
        with pytest.raises(TypeError, match="group_sizes must be integer sizes, not bools"):
            groups.host_clip(group_sizes)


def _prepared_fp8_cast_to_bf16():
    w = jnp.ones((1, 32, 32))
    pw = jax.tree.map(lambda a: a.astype(jnp.bfloat16), jgm.prepare_weights(w, w, recipe="fp8_block"))
    jgm.grouped_mlp(jnp.ones((8, 32), jnp.bfloat16), w, w, jnp.array([8]), recipe="fp8_block", prepared=pw)


_SDS_W = jax.ShapeDtypeStruct((1, 32, 32), jnp.float32)
UNCLEAR_ERRORS = {
    "quantize_mxfp8_sds": (lambda: jgm.quantize_mxfp8(sds((4, 64))), TypeError, r"x must be an array, got a jax.ShapeDtypeStruct"),
    "quantize_fp8_block_sds": (lambda: jgm.quantize_fp8_block(sds((4, 64))), TypeError, r"x must be an array, got a jax.ShapeDtypeStruct"),
    "quantize_mxfp8_grouped_sds": (lambda: jgm.quantize_mxfp8_grouped(sds((4, 64)), jnp.array([4])), TypeError, r"x must be an array"),
    "quantize_mxfp8_grouped_none": (lambda: jgm.quantize_mxfp8_grouped(jnp.ones((4, 8)), None), TypeError, r"group_sizes must be .*got None"),
    "quantize_fp8_block_group_sizes_sds": (lambda: jgm.quantize_fp8_block(jnp.ones((4, 8)), 0, group_sizes=sds((2,), jnp.int32)),
                                           TypeError, r"group_sizes must be an array, got a jax.ShapeDtypeStruct"),
    "prepare_weights_sds": (lambda: jgm.prepare_weights(_SDS_W, _SDS_W), TypeError, r"w1 must be an array, got a jax.ShapeDtypeStruct"),
    "roofline_tuple": (lambda: jgm.LayerTime.roofline((8192, 1024, 512, 8)), TypeError, r"shape must be a LayerShape"),
    "from_total_none": (lambda: jgm.LayerTime.from_total(1e-3, None), TypeError, r"shape must be a LayerShape.*None"),
    "from_total_seconds": (lambda: jgm.LayerTime.from_total(-1.0, jgm.LayerShape(64, 64, 96, 4)), ValueError,
                           r"seconds must be finite and > 0, got seconds=-1.0"),
    "host_bandwidth_device_str": (lambda: jgm.measure_host_bandwidth(1 << 16, repeats=1, device="cpu"), TypeError,
                                  r"device must be a jax.Device.*'cpu'"),
    "layer_time_seed_none": (lambda: jgm.measure_layer_time(tokens=64, hidden=32, ffn=32, num_experts=2, repeats=1, seed=None),
                             TypeError, r"seed must be an int.*None"),
    "layer_time_seed_float": (lambda: jgm.measure_layer_time(tokens=64, hidden=32, ffn=32, num_experts=2, repeats=1, seed=1.5),
                              TypeError, r"seed must be an int.*1.5"),
    "prepared_fp8_leaves_cast": (_prepared_fp8_cast_to_bf16, TypeError, r"prepared.w1_fprop must be an FP8BlockTensor .*float8_e4m3fn"),
}


@pytest.mark.parametrize("case", list(UNCLEAR_ERRORS))
def test_public_entry_points_name_the_bad_argument(case):
    """Each error names the argument and what was expected (they came from deep inside
    JAX or Python: 'expected number', 'None is not a valid value for jnp.array',
    AttributeError 'tokens' / 'addressable_memories', 'rhs.data must be ...')."""
    fn, exc, match = UNCLEAR_ERRORS[case]
    with pytest.raises(exc, match=match):
        fn()


@pytest.mark.parametrize("recipe", ["mxfp8", "bf16", "fp8_block"])
def test_prepare_weights_accepts_what_grouped_mlp_accepts(rng, recipe):
    """NumPy float64 masters (float32 with x64 off) and nested lists, as grouped_mlp takes
    them: the same y as without prepared (prepare_weights raised 'w1 must be bfloat16 or
    float32, got float64' / 'must be an array')."""
    w1 = rng.standard_normal((2, 32, 64)) * 0.1
    w2 = rng.standard_normal((2, 64, 32)) * 0.1
    x, gs = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16), jnp.array([8, 8])
    want = jgm.grouped_mlp(x, w1, w2, gs, recipe=recipe)
    for a, b in ((w1, w2), (w1.tolist(), w2.tolist())):
        pw = jgm.prepare_weights(a, b, recipe=recipe)
        got = jgm.grouped_mlp(x, a, b, gs, recipe=recipe, prepared=pw)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("shapes", [((0, 32, 48), (0, 48, 32)), ((2, 0, 48), (2, 48, 0)), ((2, 32, 0), (2, 0, 32))],
                         ids=["g_zero", "h_zero", "f_zero"])
def test_prepare_weights_refuses_what_grouped_mlp_refuses(shapes):
    w1, w2 = jnp.ones(shapes[0]), jnp.ones(shapes[1])
    with pytest.raises(ValueError, match=r"(at least one expert|H and the FFN size F must be positive).*w1.shape"):
        jgm.prepare_weights(w1, w2, recipe="bf16")
