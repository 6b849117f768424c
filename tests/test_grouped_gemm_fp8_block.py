"""The FP8 block-scaled GEMM's binding (``gemm_ffi.grouped_gemm_fp8_block``) checks its
operands at trace time, naming the argument, on any platform (the kernel itself:
tests/test_grouped_gemm_fp8_block_gpu.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_grouped_mlp._src.cuda import gemm_ffi
from jax_grouped_mlp._src.formats import fp8_block
from jax_grouped_mlp.kernels import registry


def _ops(m=64, n=256, k=384, g=2):
    x = jnp.ones((m, k), jnp.float32)
    w = jnp.ones((g, n, k), jnp.float32)
    return fp8_block.quantize_fp8_block(x, axis=1), fp8_block.quantize_fp8_block(w, axis=(1, 2))


def _call(lhs, rhs, g=2):
    return jax.eval_shape(lambda a, b, s: gemm_ffi.grouped_gemm_fp8_block(a, b, s), lhs, rhs, jnp.zeros((g,), jnp.int32))


@pytest.mark.parametrize(
    "make, err, match",
    [
        (lambda: (jnp.ones((64, 384), jnp.bfloat16), _ops()[1]), TypeError, "lhs must be an FP8BlockTensor"),
        (lambda: (_ops()[0], jnp.ones((2, 256, 384), jnp.bfloat16)), TypeError, "rhs must be an FP8BlockTensor"),
        # lhs blocked along M instead of K; rhs blocked along one axis only.
        (lambda: (fp8_block.quantize_fp8_block(jnp.ones((64, 384)), axis=0), _ops()[1]), ValueError, "lhs must be"),
        (lambda: (_ops()[0], fp8_block.quantize_fp8_block(jnp.ones((2, 256, 384)), axis=2)), ValueError, "rhs must be"),
        # group-aware lhs (a weight-gradient operand)
        (lambda: (fp8_block.quantize_fp8_block(jnp.ones((64, 384)), axis=0, group_sizes=jnp.array([64, 0])),
                  _ops()[1]), ValueError, "lhs must be"),
        (lambda: (_ops(k=384)[0], _ops(k=512)[1]), ValueError, "contraction mismatch"),
        (lambda: _ops(k=200), ValueError, r"lhs: K must be a multiple of 16 .*got K=200"),
        (lambda: _ops(n=260), ValueError, r"rhs: N must be a multiple of 8 .*got N=260"),
        (lambda: (_ops()[0], fp8_block.FP8BlockTensor(_ops()[1].data, _ops()[1].scale[:, :1], (1, 2))),
         ValueError, r"rhs.scale must have shape"),
    ],
)
def test_bad_operands_name_the_argument(make, err, match):
    lhs, rhs = make()
    with pytest.raises(err, match=match):
        _call(lhs, rhs)


def test_shapes_off_128_are_in_the_contract():
    """K = 2688 (21 x 128) and N = 1856 (14.5 x 128), the Nano FC1 dims, pass the checks
    (then only a missing extension or the CPU platform stops the call)."""
    lhs, rhs = _ops(m=8, n=1856, k=2688, g=2)
    try:
        _call(lhs, rhs)
    except RuntimeError as e:  # no extension in this checkout
        assert "not built" in str(e)


def test_registry_entry():
    v, wide = registry.variants(registry.Family.GROUPED_GEMM_FP8_BLOCK)
    assert v.name == "grouped_gemm_sm90_fp8block_m128n128k128_s6"
    assert (v.tile_m, v.tile_n, v.tile_k, v.rhs_k_major) == (128, 128, 128, True)
    assert wide.name == "grouped_gemm_sm90_fp8block_m128n256k128_s4" and wide.tile_n == 256
    with pytest.raises(ValueError, match="tile_n"):
        registry.Fp8BlockGemmVariant(tile_n=192, stages=4)


def test_transpose_tiles_is_quantizing_the_transpose():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((3, 200, 328)) * np.exp2(rng.integers(-9, 9, size=(3, 200, 1))), jnp.float32)
    t = fp8_block.transpose_tiles(fp8_block.quantize_fp8_block(w, axis=(1, 2)))
    q = fp8_block.quantize_fp8_block(jnp.swapaxes(w, 1, 2), axis=(1, 2))
    assert t.axes == q.axes == (1, 2)
    np.testing.assert_array_equal(np.asarray(t.data).view(np.uint8), np.asarray(q.data).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(t.scale).view(np.uint8), np.asarray(q.scale).view(np.uint8))
    with pytest.raises(ValueError, match="two axes"):
        fp8_block.transpose_tiles(fp8_block.quantize_fp8_block(w, axis=2))


def test_default_variant_is_the_widest_tile_that_skips_no_half():
    names = tuple(v.name for v in registry.variants(registry.Family.GROUPED_GEMM_FP8_BLOCK))
    narrow, wide = names
    assert gemm_ffi.fp8_block_default_variant(4096, names) == wide
    assert gemm_ffi.fp8_block_default_variant(1536, names) == wide
    assert gemm_ffi.fp8_block_default_variant(1856, names) == narrow  # Nano FC1: 14.5 x 128
    assert gemm_ffi.fp8_block_default_variant(2688, names) == narrow  # 21 x 128, 10.5 x 256
    assert gemm_ffi.fp8_block_default_variant(264, names) == narrow  # 3 blocks of 128: a skipped half
    assert gemm_ffi.fp8_block_default_variant(200, names) == wide  # 2 blocks of 128: one full-width tile
    assert gemm_ffi.fp8_block_default_variant(4096, names + ("not_a_kernel",)) == wide
    assert gemm_ffi.fp8_block_default_variant(64, ()) is None


# ---- the FP8 weight gradient's binding (gemm_ffi.grouped_wgrad_fp8_block) ----


def _wops(m=300, k=256, n=136, sizes=(100, 200)):
    gs = jnp.asarray(sizes, jnp.int32)
    q = lambda c: fp8_block.quantize_fp8_block(jnp.ones((m, c), jnp.float32), 0, group_sizes=gs)  # noqa: E731
    return q(k), q(n), gs


def _wcall(lhs, rhs, gs, **kw):
    return jax.eval_shape(lambda a, b, s: gemm_ffi.grouped_wgrad_fp8_block(a, b, s, **kw), lhs, rhs, gs)


@pytest.mark.parametrize(
    "make, err, match",
    [
        (lambda: (jnp.ones((300, 256), jnp.bfloat16), _wops()[1], _wops()[2]), TypeError,
         "lhs must be a group-aware FP8BlockTensor"),
        (lambda: (_wops()[0], fp8_block.quantize_fp8_block(jnp.ones((300, 136)), axis=0), _wops()[2]), ValueError,
         "rhs must be group-aware"),
        (lambda: (_wops()[0], _wops(m=200, sizes=(100, 100))[1], _wops()[2]), ValueError, "row mismatch"),
        (lambda: _wops(k=260), ValueError, r"K and N must be multiples of 8 .*got K=260"),
        (lambda: (*_wops()[:2], jnp.asarray([100, 100, 100], jnp.int32)), ValueError, "quantized with 2 groups"),
        (lambda: (*_wops()[:2], jnp.zeros((2,), jnp.float32)), TypeError, "group_sizes must be integer"),
    ],
)
def test_wgrad_bad_operands_name_the_argument(make, err, match):
    lhs, rhs, gs = make()
    with pytest.raises(err, match=match):
        _wcall(lhs, rhs, gs)


def test_wgrad_bad_out_dtype_and_registry():
    lhs, rhs, gs = _wops()
    with pytest.raises(TypeError, match="out_dtype must be bfloat16 or float32"):
        _wcall(lhs, rhs, gs, out_dtype=jnp.float16)
    names = [v.name for v in registry.variants(registry.Family.GROUPED_WGRAD_FP8_BLOCK)]
    # The binding's default for a dtype is its first: the ping-pong mainloop for bf16.
    assert names == ["grouped_wgrad_sm90_fp8block_m128n128k128_s5_en64_pp",
                     "grouped_wgrad_sm90_fp8block_m128n128k128_s5_en64",
                     "grouped_wgrad_sm90_fp8block_m128n128k128_s4_en64_f32"]  # fmt: skip
    assert [v.out_dtype for v in registry.variants(registry.Family.GROUPED_WGRAD_FP8_BLOCK)] == [
        "bfloat16", "bfloat16", "float32"]


def test_wgrad_outside_the_fp8_contract_falls_back_or_names_the_limit():
    """``grouped_wgrad_cuda`` sends a pair whose token-major operands would pass 2^31
    elements (P = 128 * (cdiv(M, 128) + G) exceeds M by up to 128 (G + 1) rows) to the
    bf16 kernel instead of raising; the FP8 binding itself names the limit."""
    sds = jax.ShapeDtypeStruct
    m, k, n, g = 700_000, 2688, 1856, 2000  # M K < 2^31 <= K * P
    nb = fp8_block.grouped_scale_rows(m, g)
    gs = sds((g,), jnp.int32)

    def tensor(cols, rows=m, blocks=nb):
        return fp8_block.FP8BlockTensor(sds((rows, cols), jnp.float8_e4m3fn), sds((blocks, cols), jnp.float8_e8m0fnu),
                                        (0,), gs)  # fmt: skip

    assert not gemm_ffi._fp8_block_wgrad_pair(tensor(k), tensor(n), gs)
    with pytest.raises(ValueError, match="fewer than 2\\^31 elements"):
        _wcall(tensor(k), tensor(n), gs)
    fits = gemm_ffi._fp8_block_wgrad_pair(tensor(256, 1000, 8 + g), tensor(128, 1000, 8 + g), gs)
    assert fits == bool(gemm_ffi.grouped_wgrad_fp8_block_variants())  # (needs the built extension)
    # Quantized with another number of groups: the bf16 kernel, not an error.
    assert not gemm_ffi._fp8_block_wgrad_pair(tensor(256, 1000, 8 + g), tensor(128, 1000, 8 + g),
                                              sds((g + 1,), jnp.int32))  # fmt: skip


def test_token_major_blocks_names_a_tensor_that_is_not_group_aware():
    with pytest.raises(ValueError, match="t must be group-aware"):
        gemm_ffi.token_major_blocks_cuda(fp8_block.quantize_fp8_block(jnp.ones((64, 128)), axis=1))
    with pytest.raises(TypeError, match="t must be a group-aware FP8BlockTensor"):
        gemm_ffi.token_major_blocks_cuda(jnp.ones((64, 128)))
