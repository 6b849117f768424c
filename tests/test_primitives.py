"""The per-platform dispatch seam and the FFI registration contract."""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_grouped_mlp._src.cuda import ffi
from jax_grouped_mlp._src.op import primitives


def test_unknown_primitive_is_rejected():
    with pytest.raises(ValueError, match="unknown primitive name='gemm'"):
        primitives.register_cuda_impl("gemm", lambda *a: None)


def test_cuda_impl_is_only_used_when_lowering_for_cuda(monkeypatch, rng):
    """A registered CUDA impl is traced everywhere but must not be what runs on CPU."""
    ref = primitives._REFERENCE["quantize"]
    monkeypatch.setitem(primitives._CUDA_IMPLS, "quantize", lambda x, *, axis: ref(2 * x, axis=axis))
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.bfloat16)
    got = jax.jit(lambda a: primitives.quantize(a, 1))(x)
    want = ref(x, axis=1)
    assert "platform_index" in str(jax.make_jaxpr(lambda a: primitives.quantize(a, 1))(x))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g.view(jnp.uint8)), np.asarray(w.view(jnp.uint8)))


def test_every_called_target_is_registered():
    if not ffi.available():
        pytest.skip("the CUDA extension is not built")
    from jax_grouped_mlp._src.cuda import gemm_ffi

    targets = (
        ffi.FAKE_QUANTIZE_TARGET, ffi.FAKE_QUANTIZE_PAIR_TARGET, ffi.DEQUANTIZE_TARGET,
        gemm_ffi.GROUPED_GEMM_TARGET, gemm_ffi.GROUPED_GEMM_QW_TARGET, gemm_ffi.GROUPED_WGRAD_TARGET,
        gemm_ffi.GROUPED_GEMM_FC1_TARGET,
        gemm_ffi.GROUPED_GEMM_DGRAD_TARGET, gemm_ffi.GROUPED_GEMM_FP8_BLOCK_TARGET,
    )
    for target in targets:
        assert target in ffi.registered_targets(), target


@pytest.mark.parametrize("in_gemm,rows_per_group", [(True, 64), (True, 1024), (False, 64)])
@pytest.mark.parametrize("recipe,fuse", [("mxfp8", True), ("mxfp8", False), ("bf16", True)])
def test_cuda_gradient_has_no_fallback_gemms(rng, recipe, fuse, in_gemm, rows_per_group):
    """Lowered for CUDA (no GPU needed), the MLP's forward + backward is our custom calls only.

    No ``dot_general`` (an XLA GEMM, which is also what the reference's tile scan is
    made of) may appear: every GEMM of the training step, fprop, dgrad and wgrad, is
    a kernel. (``while`` loops remain: cumsums and searches over group sizes.)
    """
    if not ffi.available():
        pytest.skip("the CUDA extension is not built")
    import jax_grouped_mlp as jgm
    from jax_grouped_mlp._src.cuda import gemm_ffi
    from jax_grouped_mlp._src.op import mlp
    from jax_grouped_mlp._src.op.heuristics import KernelChoices

    choices = KernelChoices(quantize_weights_in_gemm=in_gemm)
    h, f, g = 128, 192, 4
    m = rows_per_group * g
    args = (
        jax.ShapeDtypeStruct((m, h), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, h, f), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, f, h), jnp.bfloat16),
        jax.ShapeDtypeStruct((g,), jnp.int32),
        jax.ShapeDtypeStruct((m,), jnp.float32),
    )

    def loss(x, w1, w2, gs, p):
        return jnp.sum(
            mlp.grouped_mlp_with(choices, x, w1, w2, gs, p, recipe=recipe, fuse_fc1_epilogue=fuse).astype(jnp.float32) ** 2
        )

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4)))
    text = jax.export.export(step, platforms=["cuda"], disabled_checks=jgm.export_disabled_checks())(
        *args
    ).mlir_module()
    assert "stablehlo.dot_general" not in text
    calls = collections.Counter(re.findall(r"custom_call @(jgm_\w+)\(", text))
    gemm, wgrad = gemm_ffi.GROUPED_GEMM_TARGET, gemm_ffi.GROUPED_WGRAD_TARGET
    if recipe == "bf16":  # FC1, FC2, 2 dgrads; 2 wgrads; nothing else
        assert calls == {gemm: 4, wgrad: 2}
        return
    # The weights quantized inside the GEMM kernels (no weight passes); FC1 and the
    # FC2 dgrad then run unfused.
    small = in_gemm and rows_per_group <= choices.qw_max_rows_per_group
    qw = small and bool(gemm_ffi.grouped_gemm_qw_variants())
    fused_fc1 = fuse and bool(gemm_ffi.grouped_gemm_fc1_variants()) and not small
    fused_dgrad = bool(gemm_ffi.grouped_gemm_dgrad_variants()) and not small
    want = {
        # x, a, dy, dh: both MXFP8 copies from one pass each, except a's (FC1's kernel,
        # when fused) and dh's (the FC2 dgrad's kernel); no quantize + dequantize.
        ffi.FAKE_QUANTIZE_PAIR_TARGET: 4 - fused_fc1 - fused_dgrad,
        ffi.DEQUANTIZE_TARGET: 2,  # the kept FP8 residuals x and a, for the wgrads
        ffi.FAKE_QUANTIZE_TARGET: 0 if qw else 4,  # w1 and w2, along K (fprop) and along N (dgrad)
        # FC1, FC2, FC2 dgrad, FC1 dgrad (quantizing their weights: their own target)
        gemm: 0 if qw else 4 - fused_fc1 - fused_dgrad,
        gemm_ffi.GROUPED_GEMM_QW_TARGET: 4 if qw else 0,
        gemm_ffi.GROUPED_GEMM_FC1_TARGET: int(fused_fc1),
        gemm_ffi.GROUPED_GEMM_DGRAD_TARGET: int(fused_dgrad),
        wgrad: 2,
    }
    assert calls == {k: v for k, v in want.items() if v}


def test_shape_polymorphic_export_for_cpu_and_cuda(rng):
    """Symbolic token counts export (the CUDA branch falls back to the reference for them)."""
    import jax_grouped_mlp as jgm

    m = jax.export.symbolic_shape("m")[0]
    args = (
        jax.ShapeDtypeStruct((32 * m, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 64, 96), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 96, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )
    exp = jax.export.export(
        jax.jit(lambda *a: jgm.grouped_mlp(*a)), platforms=("cpu", "cuda"),
        disabled_checks=jgm.export_disabled_checks(),
    )(*args)
    x = jnp.asarray(rng.standard_normal((96, 64)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((4, 64, 96)) / 8, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((4, 96, 64)) / 8, jnp.bfloat16)
    gs = jnp.asarray([30, 0, 40, 10], jnp.int32)
    got = exp.call(x, w1, w2, gs)
    want = jgm.grouped_mlp(x, w1, w2, gs)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("recipe", ["mxfp8", "bf16", "fp8_block"])
def test_shape_polymorphic_export_of_the_gradient(rng, recipe):
    """The training gradient exports with a symbolic token count (any M, not only
    multiples of 32), survives serialization, and gives the non-exported numbers."""
    import jax_grouped_mlp as jgm

    m = jax.export.symbolic_shape("m")[0]
    g, h, f = 4, 64, 96

    def loss(x, w1, w2, gs, p):
        return jnp.sum(jgm.grouped_mlp(x, w1, w2, gs, p, recipe=recipe).astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4)))
    args = (
        jax.ShapeDtypeStruct((m, h), jnp.bfloat16), jax.ShapeDtypeStruct((g, h, f), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, f, h), jnp.bfloat16), jax.ShapeDtypeStruct((g,), jnp.int32),
        jax.ShapeDtypeStruct((m,), jnp.float32),
    )
    exp = jax.export.export(step, platforms=("cpu", "cuda"), disabled_checks=jgm.export_disabled_checks())(*args)
    try:  # the `export` extra
        import flatbuffers  # noqa: F401
    except ImportError:
        pass
    else:
        exp = jax.export.deserialize(exp.serialize())
    for rows, sizes in ((70, [33, 1, 16, 0]),):  # 20 rows past the groups
        x = jnp.asarray(rng.standard_normal((rows, h)), jnp.bfloat16)
        w1 = jnp.asarray(rng.standard_normal((g, h, f)) / 8, jnp.bfloat16)
        w2 = jnp.asarray(rng.standard_normal((g, f, h)) / 8, jnp.bfloat16)
        p = jnp.asarray(rng.uniform(0.1, 1.0, rows), jnp.float32)
        call = (x, w1, w2, jnp.asarray(sizes, jnp.int32), p)
        got, want = exp.call(*call), step(*call)
        for a, b in zip(got, want):
            assert np.abs(np.asarray(b, np.float32)).max() > 0
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("keep", [False, True])
def test_fake_quantize_pair_reference(rng, keep):
    """The two-copy op on the reference path: rowwise MXFP8 values in bf16, and the
    group-aware columnwise copy as FP8 (kept) or as its bf16 values (used at once)."""
    from jax_grouped_mlp._src.formats import mxfp8

    x = jnp.asarray(rng.standard_normal((70, 64)) * 3, jnp.bfloat16)
    gs = jnp.asarray([20, 0, 33], jnp.int32)  # 17 rows past the groups
    row, col = primitives.fake_quantize_pair(x, gs, keep_col_fp8=keep)
    assert row.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(row, np.float32), np.asarray(mxfp8.dequantize(mxfp8.quantize_mxfp8(x, axis=1)), np.float32)
    )
    want = mxfp8.quantize_mxfp8_grouped(x, gs)
    if keep:
        assert isinstance(col, mxfp8.MXFP8Tensor) and col.is_grouped and col.axis == 0
        assert col.data.dtype == jnp.float8_e4m3fn
        np.testing.assert_array_equal(np.asarray(col.data, np.float32), np.asarray(want.data, np.float32))
    else:
        assert col.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(col, np.float32), np.asarray(mxfp8.dequantize(want), np.float32))
        assert not np.asarray(col[53:], np.float32).any()  # rows past the groups are zero
    # Not just the identity: quantization changed some values.
    assert not np.array_equal(np.asarray(row, np.float32), np.asarray(x, np.float32))
