"""grouped_mlp end to end on the GPU: the CUDA kernels are used, and results match the CPU path."""

from __future__ import annotations

import itertools
import re

import jax
import numpy as np
import pytest

import jax_grouped_mlp as jgm
from jax_grouped_mlp._src.cuda import ffi, gemm_ffi
from jax_grouped_mlp._src.op import mlp
from jax_grouped_mlp._src.op.heuristics import DEFAULT, KernelChoices
from mlp_reference import mlp_f64, rel_err
from test_mlp import BANDS, SIZES, make_inputs, scanned_stack_grads, scanned_stack_inputs

pytestmark = pytest.mark.gpu


def _loss_and_grads(policy, fuse=True, choices=DEFAULT):
    def run(x, w1, w2, gs, probs, dy):
        def f(x, w1, w2, p):
            return mlp.grouped_mlp_with(choices, x, w1, w2, gs, p, fuse_fc1_epilogue=fuse)

        if policy is not None:
            f = jax.checkpoint(f, policy=policy)
        y, vjp = jax.vjp(f, x, w1, w2, probs)
        return y, vjp(dy)

    return jax.jit(run)


@pytest.mark.parametrize("case", ["zeros_and_skew", "sum_above_m", "unaligned"])
def test_matches_cpu_path_and_float64(gpu, rng, case):
    args = make_inputs(rng, m=512, h=256, f=192, g=4, sizes=[s * 4 for s in SIZES[case]])
    fn = _loss_and_grads(None)
    out_gpu = fn(*jax.device_put(args, gpu))
    out_cpu = fn(*jax.device_put(args, jax.devices("cpu")[0]))
    for got, want in zip(jax.tree.leaves(out_gpu), jax.tree.leaves(out_cpu)):
        # Same quantized operands (bit-identical quantizer); only GEMM summation order differs.
        assert rel_err(np.asarray(got, np.float32), np.asarray(want, np.float32)) < 5e-3
    y, (dx, dw1, dw2, dp) = out_gpu
    ry, (rdx, rdw1, rdw2, rdp) = mlp_f64(*args)
    for name, g_, r in (("y", y, ry), ("dx", dx, rdx), ("dw1", dw1, rdw1), ("dw2", dw2, rdw2), ("dprobs", dp, rdp)):
        assert rel_err(g_, r) < BANDS["mxfp8"][name], name


@pytest.mark.parametrize("in_gemm", [True, False])
@pytest.mark.parametrize("fuse", [True, False])
def test_kernels_are_in_the_compiled_program(gpu, rng, fuse, in_gemm):
    """Every GEMM of forward + backward is ours: no XLA dot, cuBLAS or Triton GEMM is left.

    64 rows per group: with ``KernelChoices.quantize_weights_in_gemm`` the four weight
    GEMMs quantize their weights themselves (no weight pass, FC1 and the FC2 dgrad
    unfused); without it, a fake-quantize pass per weight use and the fused epilogue kernels."""
    choices = KernelChoices(quantize_weights_in_gemm=in_gemm)
    args = jax.device_put(make_inputs(rng, m=256, h=128, f=128, g=4), gpu)
    hlo = _loss_and_grads(None, fuse, choices).lower(*args).compile().as_text()
    def n(target):
        return hlo.count(f'custom_call_target="{target}"')

    fc1 = fuse and not in_gemm
    dgrad = not in_gemm
    # x, a, dy, dh: both MXFP8 copies from one pass each, except a's (FC1's kernel, when
    # fused) and dh's (the FC2 dgrad's kernel, when fused).
    assert n(ffi.FAKE_QUANTIZE_PAIR_TARGET) == 4 - fc1 - dgrad
    assert n(gemm_ffi.GROUPED_GEMM_FC1_TARGET) == fc1
    assert n(gemm_ffi.GROUPED_GEMM_DGRAD_TARGET) == dgrad
    assert n(ffi.FAKE_QUANTIZE_TARGET) == (0 if in_gemm else 4)  # w1, w2 along K and along N
    # The two kept FP8 residuals, dequantized for the weight gradients by our kernel.
    assert n(ffi.DEQUANTIZE_TARGET) == 2
    # FC1, FC2, FC2 dgrad, FC1 dgrad: the ones that quantize their weight have their own target.
    assert n(gemm_ffi.GROUPED_GEMM_QW_TARGET) == (4 if in_gemm else 0)
    assert n(gemm_ffi.GROUPED_GEMM_TARGET) + n(gemm_ffi.GROUPED_GEMM_QW_TARGET) == 4 - fc1 - dgrad
    assert hlo.count(f'custom_call_target="{gemm_ffi.GROUPED_WGRAD_TARGET}"') == 2
    assert not re.search(r"\bdot\(", hlo), "an XLA dot survived"
    assert "cublas" not in hlo and "triton_gemm" not in hlo


@pytest.mark.parametrize("case", ["zeros_and_skew", "sum_above_m", "unaligned"])
def test_weights_quantized_in_the_gemm_change_no_bit(gpu, rng, case):
    """The op with the weights quantized inside the GEMM kernels (the ``_qw`` kernels,
    FC1 and the FC2 dgrad unfused) and with a quantize pass per weight use (and the fused
    FC1 / FC2-dgrad kernels): the output and the x, w1, w2 gradients bitwise equal; the
    probs gradient up to summation order (the fused dgrad kernel sums ``dprobs`` in its
    own fixed order, the unfused path with ``jnp.sum``)."""
    args = jax.device_put(make_inputs(rng, m=512, h=256, f=192, g=4, sizes=[s * 4 for s in SIZES[case]]), gpu)
    got = {}
    for in_gemm in (True, False):
        choices = KernelChoices(quantize_weights_in_gemm=in_gemm)
        got[in_gemm] = jax.tree.leaves(_loss_and_grads(None, True, choices)(*args))
    *same, dprobs = got[True]
    *want, dprobs_want = got[False]
    for a, b in zip(same, want):  # y, dx, dw1, dw2
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    d, dw = np.asarray(dprobs, np.float64), np.asarray(dprobs_want, np.float64)
    np.testing.assert_allclose(d, dw, rtol=1e-5, atol=1e-5 * np.abs(dw).max())


@pytest.mark.parametrize("case", ["zeros_and_skew", "sum_above_m", "unaligned"])
def test_fused_fc1_epilogue_changes_no_bit(gpu, rng, case):
    """The FC1 epilogue kernel writes what the unfused FC1 + srelu + quantize passes write,
    so the output and all four gradients are bitwise those of the unfused op. (Weights
    quantized by passes: with small groups the op otherwise never fuses FC1.)"""
    passes = KernelChoices(quantize_weights_in_gemm=False)
    args = jax.device_put(make_inputs(rng, m=512, h=256, f=192, g=4, sizes=[s * 4 for s in SIZES[case]]), gpu)
    fused = jax.tree.leaves(_loss_and_grads(None, True, passes)(*args))
    unfused = jax.tree.leaves(_loss_and_grads(None, False, passes)(*args))
    # y, dx, dw1, dw2 and dprobs (summed in the dgrad kernel's fixed order either way)
    for a, b in zip(fused, unfused):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_gradients_are_bitwise_reproducible(gpu, rng):
    args = jax.device_put(make_inputs(rng, m=512, h=256, f=192, g=4, sizes=[200, 0, 57, 190]), gpu)
    fn = _loss_and_grads(None)
    first = jax.tree.leaves(fn(*args))
    for _ in range(2):
        for a, b in zip(first, jax.tree.leaves(fn(*args))):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_offload_policies_run_and_agree(gpu, rng):
    args = jax.device_put(make_inputs(rng, m=256, h=128, f=128, g=4, sizes=[100, 0, 56, 60]), gpu)
    base = _loss_and_grads(jax.checkpoint_policies.everything_saveable)(*args)
    for combo in itertools.product(("device", "offload", "recompute"), repeat=3):  # all 27
        y, (dx, dw1, dw2, dp) = _loss_and_grads(jgm.offload_policy(*combo))(*args)
        by, (bdx, bdw1, bdw2, bdp) = base
        # All five bit for bit: dprobs too, now that the dgrad kernel sums it in a fixed
        # order (an XLA reduction could be ordered differently per program).
        for a, b in ((y, by), (dx, bdx), (dw1, bdw1), (dw2, bdw2), (dp, bdp)):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    hlo = _loss_and_grads(jgm.offload_policy()).lower(*args).compile().as_text()
    assert "S(5)" in hlo, "no pinned-host buffers in the compiled program"


def test_float32_master_weights_get_float32_gradients(gpu, rng):
    """float32 weights: the wgrad kernel writes float32 (not bf16 widened), matching the CPU path."""
    x, w1, w2, gs, probs, dy = make_inputs(rng, m=512, h=256, f=192, g=4, sizes=[200, 0, 57, 190])
    w1, w2 = w1.astype(np.float32) * 1.001, w2.astype(np.float32) * 1.001  # not bf16-representable
    args = (x, w1, w2, gs, probs, dy)
    fn = _loss_and_grads(None)
    hlo = fn.lower(*jax.device_put(args, gpu)).compile().as_text()
    assert hlo.count(f'custom_call_target="{gemm_ffi.GROUPED_WGRAD_TARGET}"') == 2
    _, (_, dw1, dw2, _) = fn(*jax.device_put(args, gpu))
    _, (_, cw1, cw2, _) = fn(*jax.device_put(args, jax.devices("cpu")[0]))
    for got, want in ((dw1, cw1), (dw2, cw2)):
        assert got.dtype == np.float32
        assert rel_err(np.asarray(got), np.asarray(want)) < 5e-3
        # float32 output: the gradients are not all bf16 values.
        assert (np.asarray(got) != np.asarray(got.astype(jax.numpy.bfloat16), np.float32)).any()


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "fp8_block"])
def test_bf16_weight_gradients_are_the_float32_ones_rounded(gpu, rng, recipe):
    """weight_grad_dtype=bfloat16 on the kernels: the weight-gradient kernels' bf16 output
    is their float32 output rounded once (the same sums), for each recipe."""
    x, w1, w2, gs, probs, dy = make_inputs(rng, m=512, h=256, f=192, g=4, sizes=[200, 0, 57, 190])
    w1, w2 = w1.astype(np.float32) * 1.001, w2.astype(np.float32) * 1.001  # not bf16-representable
    args = jax.device_put((x, w1, w2, gs, probs, dy), gpu)

    def grads(wgd):
        def loss(w1, w2):
            y = jgm.grouped_mlp(args[0], w1, w2, args[3], args[4], recipe=recipe, weight_grad_dtype=wgd)
            return (y.astype(np.float32) * args[5]).sum()
        fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
        hlo = fn.lower(args[1], args[2]).compile().as_text()
        assert re.search(r"custom_call_target=\"jgm_grouped_wgrad", hlo), "no weight-gradient kernel"
        return fn(args[1], args[2])

    for got, want in zip(grads(jax.numpy.bfloat16), grads(None)):
        assert got.dtype == np.float32
        want = np.asarray(want)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.numpy.asarray(want).astype(jax.numpy.bfloat16),
                                                                  np.float32))
        assert (want != np.asarray(jax.numpy.asarray(want).astype(jax.numpy.bfloat16), np.float32)).any()


@pytest.mark.parametrize("recipe", ["mxfp8", "bf16", "fp8_block"])
def test_scanned_stack_same_bits_with_and_without_the_ordering(gpu, rng, recipe):
    """A ``jax.lax.scan`` of three layers on the GPU, where XLA reads the weight slices and
    writes the stacked gradients in place: the same gradients bit for bit with the op's
    ordering (``KernelChoices.order_backward``: tokens, barriers) on and off, for each
    recipe's weight-gradient kernel (bf16, FP8) and its token."""
    inputs = jax.device_put(scanned_stack_inputs(rng, m=512, h=256, f=192, g=4,
                                                 sizes=[s * 4 for s in SIZES["zeros_and_skew"]]), gpu)  # fmt: skip
    on, off = scanned_stack_grads(True, inputs, recipe=recipe), scanned_stack_grads(False, inputs, recipe=recipe)
    for name, a, b in zip(("dx", "dw1", "dw2"), on, off):
        np.testing.assert_array_equal(a, b, err_msg=name)
