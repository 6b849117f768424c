"""Weights prepared once for many micro-batches (``prepare_weights`` and
``grouped_mlp(..., prepared=)``): bitwise the op without them, forward and all four
gradients, in every recipe and both kernel paths, with bf16 and float32 master weights;
no weight preparation left inside a scan over micro-batches; clear errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_grouped_mlp as jgm
from jax_grouped_mlp._src.op import mlp
from jax_grouped_mlp._src.op.heuristics import KernelChoices
from test_mlp import SIZES, make_inputs



def _grads(choices, recipe, use_prepared, x, w1, w2, gs, probs, dy):
    def run(x, w1, w2, probs):
        def f(x, w1, w2, probs):
            pw = jgm.prepare_weights(w1, w2, recipe=recipe) if use_prepared else None
            return mlp.grouped_mlp_with(choices, x, w1, w2, gs, probs, recipe=recipe, prepared=pw)

        y, vjp = jax.vjp(f, x, w1, w2, probs)
        return y, vjp(dy)

    return jax.tree.leaves(jax.jit(run)(x, w1, w2, probs))


def _same_bits(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# in_gemm (the weight-quantizing GEMMs for small groups) matters to mxfp8 only.
CASES = [("mxfp8", True, "bfloat16"), ("mxfp8", True, "float32"), ("mxfp8", False, "float32"),
         ("bf16", True, "float32"), ("fp8_block", True, "bfloat16"), ("fp8_block", True, "float32")]


@pytest.mark.parametrize("recipe,in_gemm,master", CASES)
def test_prepared_weights_change_no_bit(rng, recipe, in_gemm, master):
    x, w1, w2, gs, probs, dy = make_inputs(rng, m=128, h=64, f=96, g=4, sizes=SIZES["zeros_and_skew"])
    w1, w2 = w1.astype(master), w2.astype(master)
    if master == "float32":  # weights that bf16 would round
        w1 = w1 + jnp.asarray(rng.standard_normal(w1.shape) * 1e-3, jnp.float32)
        w2 = w2 + jnp.asarray(rng.standard_normal(w2.shape) * 1e-3, jnp.float32)
    choices = KernelChoices(quantize_weights_in_gemm=in_gemm)
    want = _grads(choices, recipe, False, x, w1, w2, gs, probs, dy)
    got = _grads(choices, recipe, True, x, w1, w2, gs, probs, dy)
    _same_bits(got, want)
    assert got[2].dtype == jnp.dtype(master) and got[3].dtype == jnp.dtype(master)  # dw1, dw2 in the masters' dtype


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_block"])
def test_gradient_accumulation_prepares_once(rng, recipe, monkeypatch):
    """A scan over 3 micro-batches with the weights prepared before it (float32 masters):
    the same gradients as the op preparing them in every micro-batch, and while the
    gradient is traced the weights are prepared only by ``prepare_weights`` (no
    ``Recipe.weight`` call and no weight-quantizing GEMM inside the op)."""
    from jax_grouped_mlp._src.op import primitives
    from jax_grouped_mlp._src.op.recipes import Recipe

    mbs, m, h, f, g = 3, 64, 64, 96, 4
    xs = jnp.asarray(rng.standard_normal((mbs, m, h)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((g, h, f)) / 8, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((g, f, h)) / 8, jnp.float32)
    gs = jnp.asarray([20, 0, 30, 14], jnp.int32)

    def loss(w1, w2, once: bool):
        pw = jgm.prepare_weights(w1, w2, recipe=recipe) if once else None

        def body(acc, x):
            y = jgm.grouped_mlp(x, w1, w2, gs, recipe=recipe, prepared=pw)
            return acc + jnp.sum(y.astype(jnp.float32) ** 2), None

        return jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)[0]

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    want = grad(w1, w2, False)
    calls = []
    weight, qw = Recipe.weight, primitives.grouped_gemm_qw
    monkeypatch.setattr(Recipe, "weight", lambda self, *a: calls.append("weight") or weight(self, *a))
    monkeypatch.setattr(primitives, "grouped_gemm_qw", lambda *a, **k: calls.append("qw") or qw(*a, **k))
    got = grad(w1, w2, True)
    assert calls == ["weight"] * (4 if recipe == "mxfp8" else 2), calls
    _same_bits(jax.tree.leaves(got), jax.tree.leaves(want))


def test_bad_prepared_arguments_are_named(rng):
    x, w1, w2, gs, probs, _ = make_inputs(rng, m=64, h=64, f=96, g=4)
    pw = jgm.prepare_weights(w1, w2, recipe="mxfp8")
    with pytest.raises(TypeError, match="prepared must be a PreparedWeights"):
        jgm.grouped_mlp(x, w1, w2, gs, probs, prepared=(w1, w2))
    with pytest.raises(ValueError, match="recipe='mxfp8'.*recipe='bf16'"):
        jgm.grouped_mlp(x, w1, w2, gs, probs, recipe="bf16", prepared=pw)
    other = jgm.prepare_weights(w1[:2], w2[:2])
    with pytest.raises(ValueError, match=r"prepared.w1_fprop has shape \(2, 64, 96\)"):
        jgm.grouped_mlp(x, w1, w2, gs, probs, prepared=other)
    raw = jgm.PreparedWeights(w1, w1, w2, w2[:1], recipe="mxfp8")  # by hand, one copy cut
    with pytest.raises(ValueError, match="prepared.w2_dgrad has shape"):
        jgm.grouped_mlp(x, w1, w2, gs, probs, prepared=raw)
    q = jgm.prepare_weights(w1, w2, recipe="fp8_block")
    unflagged = jgm.PreparedWeights(q.w1_fprop, q.w1_dgrad, q.w2_fprop, q.w2_dgrad, recipe="fp8_block")
    with pytest.raises(ValueError, match=r"prepared.w1_fprop has shape \(4, 96, 64\).*must be \(4, 64, 96\)"):
        jgm.grouped_mlp(x, w1, w2, gs, probs, recipe="fp8_block", prepared=unflagged)
    wrong_kind = jgm.PreparedWeights(w1, w1, w2, w2, recipe="fp8_block")
    with pytest.raises(TypeError, match="prepared.w1_fprop must be an FP8BlockTensor"):
        jgm.grouped_mlp(x, w1, w2, gs, probs, recipe="fp8_block", prepared=wrong_kind)
    f32 = jgm.PreparedWeights(*(w.astype(jnp.float32) for w in (w1, w1, w2, w2)), recipe="bf16")
    with pytest.raises(TypeError, match="prepared.w1_fprop must be a bfloat16 array"):
        jgm.grouped_mlp(x, w1, w2, gs, probs, recipe="bf16", prepared=f32)
    with pytest.raises(ValueError, match="w2 must be"):
        jgm.prepare_weights(w1, w1)
    with pytest.raises(TypeError, match="w1 must be bfloat16 or float32"):
        jgm.prepare_weights(w1.astype(jnp.int32), w2)
    with pytest.raises(ValueError, match="recipe"):
        jgm.prepare_weights(w1, w2, recipe="fp4")


def test_prepared_weights_are_a_pytree_differentiated_straight_through(rng):
    _, w1, w2, _, _, _ = make_inputs(rng, m=64, h=64, f=96, g=4)
    pw = jgm.prepare_weights(w1, w2, recipe="fp8_block")
    leaves, tree = jax.tree.flatten(pw)
    assert jax.tree.unflatten(tree, leaves).recipe == "fp8_block"
    # The same tiles twice: as stored (dgrad) and transposed (the forward GEMM reads K-major).
    assert pw.fprop_k_major and pw.w1_shape == w1.shape and pw.w1_fprop.data.shape == (4, 96, 64)
    np.testing.assert_array_equal(np.asarray(pw.w1_fprop.data.astype(jnp.float32)),
                                  np.asarray(jnp.swapaxes(pw.w1_dgrad.data, 1, 2).astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(pw.w2_fprop.scale.astype(jnp.float32)),
                                  np.asarray(jnp.swapaxes(pw.w2_dgrad.scale, 1, 2).astype(jnp.float32)))
    # The copies depend on w as the op's own copies do (straight-through quantization),
    # so higher-order derivatives through them see the weights (test_higher_order.py);
    # the op itself sends no cotangent into them, only into its w1 and w2. The
    # straight-through cotangent travels as E4M3 on the tiles' scales (FP8 data has FP8
    # tangents): exactly 1 where a tile's scale is an E4M3 normal (amax > 448 * 2**-7,
    # here every tile: w1 * 16 has amax ~ 8), 0 where it underflows (amax <= 448 * 2**-10,
    # the documented limitation; w1 itself has tiles with amax ~ 0.44, so which experts
    # get 0 would depend on the seed).
    big = w1 * 16
    assert float(jnp.min(jnp.max(jnp.abs(big), axis=(1, 2)))) > 448 * 2.0**-7
    g = jax.grad(lambda w: jnp.sum(jgm.dequantize_fp8_block(jgm.prepare_weights(w, w2, recipe="fp8_block").w1_fprop,
                                                            jnp.float32)))(big)
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.ones(w1.shape, np.float32))
    tiny = w1 * (448 * 2.0**-11 / jnp.max(jnp.abs(w1), axis=(1, 2), keepdims=True))
    g = jax.grad(lambda w: jnp.sum(jgm.dequantize_fp8_block(jgm.prepare_weights(w, w2, recipe="fp8_block").w1_fprop,
                                                            jnp.float32)))(tiny)
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.zeros(w1.shape, np.float32))


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_block"])
def test_moe_block_and_flax_modules_take_prepared_weights(rng, recipe):
    """moe_block(prepared=) on one device, GroupedMLP.prepare() and MoEBlock.prepare():
    bitwise the same outputs and parameter gradients as without. (Expert parallelism:
    tests/moe_sharded_cases.py.)"""
    from flax import nnx

    import jax_grouped_mlp.flax as jgf

    x = jnp.asarray(rng.standard_normal((48, 64)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((64, 4)) / 8, jnp.float32)
    _, w1, w2, gs, _, _ = make_inputs(rng, m=48, h=64, f=96, g=4)
    routing = jgm.RoutingConfig(top_k=2)

    def block(w1, w2, use):
        pw = jgm.prepare_weights(w1, w2, recipe=recipe) if use else None
        y = jgm.moe_block(x, router, w1, w2, routing=routing, recipe=recipe, prepared=pw)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    grads = [jax.jit(jax.value_and_grad(block, argnums=(0, 1)), static_argnums=2)(w1, w2, u) for u in (True, False)]
    _same_bits(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]))

    mlp_mod = jgf.GroupedMLP(4, 64, 96, recipe=recipe, rngs=nnx.Rngs(0))
    moe_mod = jgf.MoEBlock(4, 64, 96, routing=routing, recipe=recipe, rngs=nnx.Rngs(1))
    for module, call in ((mlp_mod, lambda m, p: m(x, gs, None, prepared=p)), (moe_mod, lambda m, p: m(x, prepared=p))):
        def loss(m, use):
            y = call(m, m.prepare() if use else None)
            return jnp.sum(y.astype(jnp.float32) ** 2)

        outs = [nnx.jit(nnx.value_and_grad(loss), static_argnums=1)(module, u) for u in (True, False)]
        _same_bits(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]))


def test_bench_grad_accum_smoke(tmp_path):
    """benchmarks/bench_grad_accum.py on the CPU's tiny shape: both candidates per recipe,
    the ratios, and a results file in the schema."""
    import json
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_grad_accum
    import common

    out = tmp_path / "ga.json"
    bench_grad_accum.main(["--shapes", "tiny", "--micro-batches", "2", "--recipes", "bf16", "--iters", "1",
                           "--out", str(out)])
    data = json.loads(out.read_text())
    assert common.check_result(data) == []
    case = data["results"]["tiny"]
    assert case["micro_batches"] == 2 and case["master_dtype"] == "float32"
    assert case["bf16/per_micro_batch"]["vs_bf16_per_micro_batch"] == 1.0
    assert case["bf16/prepared_once"]["vs_per_micro_batch"] > 0
    assert case["style"] == "through_scan"


@pytest.mark.parametrize("prepared", [False, True])
def test_bench_grad_accum_styles_agree(prepared):
    """The benchmark's two ways of accumulating (grad through the scan; each micro-batch's
    grad added in the scan body) give the same gradients: the second is the same training
    step written as optax's MultiSteps writes it."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_grad_accum

    args, _ = bench_grad_accum._inputs("tiny", 3, "float32", 1.0, 0)
    through = bench_grad_accum._step("bf16", prepared, "through_scan")(*args)
    in_body = bench_grad_accum._step("bf16", prepared, "in_body")(*args)
    for a, b in zip(through, in_body):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)
    assert np.asarray(through[0]).any()
    with pytest.raises(ValueError, match="style must be one of"):
        bench_grad_accum._step("bf16", prepared, "sideways")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,rows_per_group", [("mxfp8", 64), ("mxfp8", 768), ("bf16", 768), ("fp8_block", 768)])
def test_prepared_weights_change_no_bit_on_the_gpu(gpu, rng, recipe, rows_per_group):
    """On the kernels: with 64 rows per group mxfp8 quantizes the weights inside its
    GEMMs without ``prepared`` and runs the plain GEMMs on the prepared values with it;
    with 768 the fused FC1 / FC2-dgrad kernels read the prepared copies. Bitwise either
    way, float32 masters (their gradients in float32)."""
    from jax_grouped_mlp._src.op.heuristics import DEFAULT

    g = 4
    x, w1, w2, gs, probs, dy = make_inputs(rng, m=g * rows_per_group, h=128, f=192, g=g,
                                           sizes=[rows_per_group * 2, 0, rows_per_group - 5, rows_per_group + 3])
    w1, w2 = (w.astype(jnp.float32) + jnp.asarray(rng.standard_normal(w.shape) * 1e-3, jnp.float32) for w in (w1, w2))
    args = jax.device_put((x, w1, w2, gs, probs, dy), gpu)
    _same_bits(_grads(DEFAULT, recipe, True, *args), _grads(DEFAULT, recipe, False, *args))


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_numpy_weights_outside_jit(rng, recipe):
    """NumPy weights work as they do under jit (a NumPy array stays one through
    ``stop_gradient`` and ``astype``, and the op then refused it as not bfloat16)."""
    x, w1, w2, gs, probs, _ = make_inputs(rng, m=64, h=64, f=96, g=4)
    n1, n2 = np.asarray(w1, np.float32), np.asarray(w2, np.float32)
    got = jgm.grouped_mlp(x, n1, n2, gs, probs, recipe=recipe, prepared=jgm.prepare_weights(n1, n2, recipe=recipe))
    want = jgm.grouped_mlp(x, n1, n2, gs, probs, recipe=recipe)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
