"""The Hopper grouped weight-gradient kernel against ``reference.ragged_transpose_matmul``.

``out[g] = X_g^T @ dY_g`` over each group's rows, bf16 operands, fp32 sums, one bf16
rounding. Bounds as in test_grouped_gemm_gpu.py. Beyond accuracy: every element is
written (outputs poisoned with NaN, then with a huge value, must agree bitwise, which
also shows the result is reproducible run to run), empty groups give exact zeros, and
rows that are not the group's (the next group's, or past the groups) never contribute,
even when they hold Inf, and a group that ends anywhere inside a 64-row slice (the
kernel multiplies only the slice's 16-row k-blocks that hold the group's rows) gives
the exact result on exactly representable inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_grouped_mlp._src.cuda import ffi, gemm_ffi
from jax_grouped_mlp._src.cuda.ffi import Unsupported
from jax_grouped_mlp._src.formats import mxfp8
from jax_grouped_mlp._src.op import reference
from gpu_helpers import clamped_sizes, has_gpu, poison_freed
from test_grouped_gemm_gpu import _sizes

needs_kernels = pytest.mark.skipif(
    not (has_gpu() and ffi.available() and gemm_ffi.grouped_wgrad_variants()),
    reason="needs a GPU and the built extension",
)

_kernel = jax.jit(gemm_ffi.grouped_wgrad_bf16_cuda, static_argnames=("variant", "out_dtype"))
_reference = jax.jit(
    lambda a, b, gs: reference.ragged_transpose_matmul(a.astype(jnp.float32), b.astype(jnp.float32), gs)
)
VARIANTS = gemm_ffi.grouped_wgrad_variants() or ("none",)


def _operands(rng, m, k, n):
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n), np.float32), jnp.bfloat16)
    return x, dy


def _check(x, dy, group_sizes, variant=None) -> np.ndarray:
    """Checks one run (output dtype: the variant's; bf16 when ``variant`` is None)."""
    out_dtype = gemm_ffi._wgrad_out_dtype(variant) if variant else jnp.dtype(jnp.bfloat16)
    gs = jnp.asarray(np.asarray(group_sizes, np.int32))
    (m, k), n, g = x.shape, dy.shape[1], len(group_sizes)
    clamped = clamped_sizes(group_sizes, m)
    total = int(clamped.sum())
    # The oracle sees only the groups' rows (garbage past them must not matter).
    xs = jnp.zeros_like(x).at[:total].set(x[:total])
    dys = jnp.zeros_like(dy).at[:total].set(dy[:total])
    want = np.asarray(_reference(xs, dys, jnp.asarray(clamped)), np.float64)
    runs = []
    for value in (0xFF, 0x7F):
        poison_freed(g * k * n * out_dtype.itemsize, value=value)
        out = jax.block_until_ready(_kernel(x, dy, gs, variant=variant, out_dtype=out_dtype))
        assert out.dtype == out_dtype
        runs.append(np.asarray(out.astype(jnp.float32), np.float64))
    np.testing.assert_array_equal(runs[0], runs[1], err_msg="differs between runs: unwritten elements, a race or nondeterminism")
    got = runs[0]
    assert got.shape == (g, k, n)
    assert np.isfinite(got).all(), f"{(~np.isfinite(got)).sum()} non-finite outputs"
    for i in np.flatnonzero(clamped == 0):
        assert not got[i].any(), f"empty group {i} has a nonzero gradient"
    err = np.abs(got - want)
    # float32 output: only the fp32 summation order differs from the oracle.
    rel_tol, elem_tol = (5e-3, 2.0**-7) if out_dtype == jnp.bfloat16 else (1e-5, 1e-5)
    ref_norm = np.linalg.norm(want)
    if ref_norm:
        rel = np.linalg.norm(err) / ref_norm
        assert rel <= rel_tol, f"relative error {rel:.2e} (variant {variant})"
    scale = np.abs(want).max(axis=(1, 2), keepdims=True) + 1e-30
    bad = err > elem_tol * np.abs(want) + (1e-3 if out_dtype == jnp.bfloat16 else 1e-5) * scale
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{bad.sum()} elements off; first {i}: got {got[i]}, want {want[i]} (variant {variant})")
    return got


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "m,k,n,g,total",
    [
        (1000, 256, 512, 7, 1000),  # ragged starts, sizes sum to M
        (1500, 2688, 1856, 5, 1100),  # Nano FC1 wgrad dims, sum below M
        (777, 1856, 2688, 6, 1200),  # Nano FC2 wgrad dims (K not a multiple of 128), clamped
        (300, 200, 136, 3, 300),  # K, N not multiples of the tile
        (5, 64, 64, 2, 5),  # fewer rows than one slice
        (3000, 256, 384, 19, 2900),  # many groups: the group cursor walks far
        (9000, 128, 256, 130, 9000),  # 130 groups, as at Nano
    ],
)
def test_random(rng, variant, m, k, n, g, total):
    x, dy = _operands(rng, m, k, n)
    _check(x, dy, _sizes(rng, g, total), variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_group_sizes_with_zeros_giant_and_negative(rng, variant):
    x, dy = _operands(rng, 640, 192, 256)
    _check(x, dy, [0, 5, 0, 300, 0, 129], variant)
    _check(x, dy, [0, 640, 0, 0, 0, 0], variant)  # one giant group
    _check(x, dy, [0, 0, 0, 0, 0, 0], variant)  # all empty: exact zeros
    _check(x, dy, [-5, 70, 0, 900, 4, 4], variant)  # negative -> 0, overshoot clamped
    _check(x, dy, [2**31 - 1, 2**31 - 1, 1, 1, 1, 1], variant)  # huge sizes


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_outside_the_groups_never_leak(rng, variant):
    """Inf in the rows past the groups: a slice that runs past a group end is zeroed, not multiplied."""
    x, dy = _operands(rng, 512, 128, 192)
    x = x.at[300:].set(jnp.inf)
    dy = dy.at[300:].set(-jnp.inf)
    _check(x, dy, [100, 37, 0, 163], variant)  # total 300: group ends mid-slice everywhere


def _exact_operands(rng, group_sizes, m, k, n, past=np.inf):
    """``x [M, K]``, ``dy [M, N]`` whose products and fp32 sums are exact: integers in
    [-4, 4], times 2**12 in the rows of every second non-empty group (clamped sizes),
    so a row of the next group that leaked into a group's sum would show as a large
    error; rows past the groups hold ``past`` (x) and ``-past`` (dy)."""
    clamped = clamped_sizes(group_sizes, m)
    ends = np.cumsum(clamped)
    total = int(ends[-1]) if len(ends) else 0
    rank = np.cumsum(clamped > 0)  # 1 + the group's place among the non-empty groups
    group_of_row = np.searchsorted(ends, np.arange(total), side="right")
    scale = np.ones((m, 1))
    scale[:total, 0] = np.where(rank[group_of_row] % 2 == 0, 2.0**12, 1.0)
    x = rng.integers(-4, 5, (m, k)) * scale
    dy = rng.integers(-4, 5, (m, n)) * scale
    x[total:], dy[total:] = past, -past
    return x, dy


def _check_exact(x: np.ndarray, dy: np.ndarray, group_sizes, variant: str) -> None:
    """The kernel equals the float64 product of the groups' rows exactly (one rounding
    to the output dtype, which is then exact too), whatever the output held before."""
    out_dtype = gemm_ffi._wgrad_out_dtype(variant)
    (m, k), n = x.shape, dy.shape[1]
    clamped = clamped_sizes(group_sizes, m)
    starts = np.concatenate([[0], np.cumsum(clamped)[:-1]]).astype(np.int64)
    want = np.stack([x[s:s + c].T @ dy[s:s + c] for s, c in zip(starts, clamped)])  # float64, exact
    want = np.asarray(jnp.asarray(want, jnp.float32).astype(out_dtype).astype(jnp.float32))
    xj, dyj = jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
    gs = jnp.asarray(np.asarray(group_sizes, np.int32))
    for value in (0xFF, 0x7F):  # NaN, then a huge finite value, in every output element
        poison_freed(len(clamped) * k * n * out_dtype.itemsize, value=value)
        got = np.asarray(jax.block_until_ready(_kernel(xj, dyj, gs, variant=variant, out_dtype=out_dtype))
                         .astype(jnp.float32))
        bad = got != want
        if bad.any():
            i = tuple(int(v) for v in np.argwhere(bad)[0])
            raise AssertionError(f"{bad.sum()} elements differ; first {i} (group {i[0]} of size "
                                 f"{clamped[i[0]]}): got {got[i]}, want {want[i]} (variant {variant})")


# Group ends at every row of a 64-row slice and on both sides of each 16-row wgmma
# k-block boundary; empty groups in between; starts at every alignment.
_EVERY_END = list(range(1, 66))
_KBLOCK_EDGES = [15, 16, 17, 0, 31, 32, 33, 47, 48, 0, 0, 49, 63, 64, 65, 79, 80, 81, 127, 128, 129, 1, 191, 192, 193]


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "group_sizes,m",
    [
        (_EVERY_END, sum(_EVERY_END)),
        (_EVERY_END[::-1], sum(_EVERY_END) + 77),  # Inf rows past the groups
        (_KBLOCK_EDGES, sum(_KBLOCK_EDGES) + 5),
        ([0, 17, 0, 0, 50, 33, 0, 1000, 40, 0], 150),  # sum past M: the 4th group is cut at M
        ([37, 0, 77], 114),  # the last group ends exactly at M (M % 16 != 0: TMA's zeros past M)
        ([37, 0, 77, 0, 0], 114),  # ... followed by empty groups
        ([64, 128, 1, 0, 255], 448),  # ends exactly at M = 7 slices
        ([3], 3),  # one group, fewer rows than one k-block
    ],
)
def test_every_group_end_in_a_slice_is_exact(rng, variant, group_sizes, m):
    """The last slice of every group: only its rows count (the next non-empty group's
    values are 2**12 times larger or smaller, the rows past the groups Inf), equal to
    the exact result (so also to the former kernel, which multiplied zeroed rows)."""
    x, dy = _exact_operands(rng, group_sizes, m, 136, 200)
    _check_exact(x, dy, group_sizes, variant)


@pytest.mark.gpu
@needs_kernels
def test_no_rows_no_groups_and_bad_buffers(rng):
    x, dy = _operands(rng, 64, 64, 64)
    out = _kernel(jnp.zeros((0, 64), jnp.bfloat16), jnp.zeros((0, 64), jnp.bfloat16), jnp.asarray([0, 0]))
    assert out.shape == (2, 64, 64) and not np.asarray(out.astype(jnp.float32)).any()
    assert _kernel(x, dy, jnp.zeros((0,), jnp.int32)).shape == (0, 64, 64)
    def raw(results, variant=0, order=jnp.zeros((1,), jnp.int32)):
        call = jax.ffi.ffi_call(gemm_ffi.GROUPED_WGRAD_TARGET, results)
        jax.block_until_ready(jax.jit(lambda a, b, gs, o: call(a, b, gs, o, variant=np.int32(variant)))(
            x, dy, jnp.asarray([32, 32]), order))

    with pytest.raises(Exception, match="out"):
        raw((jax.ShapeDtypeStruct((2, 64, 32), jnp.bfloat16), gemm_ffi.TILE_COUNTER))
    with pytest.raises(Exception, match="tile_counter"):
        raw((jax.ShapeDtypeStruct((2, 64, 64), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.int32)))
    with pytest.raises(Exception, match="tile_order"):
        raw((jax.ShapeDtypeStruct((2, 64, 64), jnp.bfloat16), gemm_ffi.TILE_COUNTER), order=jnp.zeros((2,), jnp.int32))
    with pytest.raises(Unsupported, match="multiples of 8"):
        gemm_ffi.grouped_wgrad_bf16_cuda(jnp.zeros((4, 12), jnp.bfloat16), jnp.zeros((4, 8), jnp.bfloat16), jnp.asarray([4]))
    with pytest.raises(TypeError, match="out_dtype"):
        gemm_ffi.grouped_wgrad_bf16_cuda(x, dy, jnp.asarray([4]), out_dtype=jnp.float16)
    bf16_out_for_f32_variant = jax.ShapeDtypeStruct((2, 64, 64), jnp.bfloat16)
    f32_variant = gemm_ffi.grouped_wgrad_variants().index(gemm_ffi.default_variant(64, tuple(
        v for v in gemm_ffi.grouped_wgrad_variants() if v.endswith("_f32"))))
    with pytest.raises(Exception, match="out"):
        raw((bf16_out_for_f32_variant, gemm_ffi.TILE_COUNTER), f32_variant)
    with pytest.raises(ValueError, match="row mismatch"):
        gemm_ffi.grouped_wgrad_bf16_cuda(x, dy[:32], jnp.asarray([4]))


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("alpha", [0.3, 3.0])
def test_both_tile_orders_give_the_same_bits(rng, monkeypatch, alpha):
    """The static order, the dynamic one and the device's choice between them
    (``JGM_WGRAD_TILE_ORDER``, read when a program is traced) give the same bits at
    router-made sizes with empty groups: every tile is computed whole by one CTA,
    whichever takes it. The choice itself is checked against the reference by ``_check``."""
    m, k, n, g = 6144, 256, 192, 64
    sizes = rng.multinomial(m - 100, rng.dirichlet(np.full(g, alpha)))  # rows past the groups too
    x, dy = _operands(rng, m, k, n)
    _check(x, dy, sizes)
    outs = {}
    for order in gemm_ffi.WGRAD_TILE_ORDERS:
        monkeypatch.setenv("JGM_WGRAD_TILE_ORDER", order)
        # A new function, so a new trace that reads the variable (jax caches per function).
        fresh = jax.jit(lambda a, b, gs: gemm_ffi.grouped_wgrad_bf16_cuda(a, b, gs))
        outs[order] = np.asarray(fresh(x, dy, jnp.asarray(sizes, jnp.int32)).astype(jnp.float32))
    np.testing.assert_array_equal(outs["dynamic"], outs["static"])
    np.testing.assert_array_equal(outs["auto"], outs["static"])


@pytest.mark.gpu
@needs_kernels
def test_mxfp8_grouped_operands_through_the_adapter(rng):
    m, k, n, g = 512, 256, 192, 4
    x, dy = _operands(rng, m, k, n)
    gs = jnp.asarray(_sizes(rng, g, 450))
    xq, dyq = mxfp8.quantize_mxfp8_grouped(x, gs), mxfp8.quantize_mxfp8_grouped(dy, gs)
    want = _reference(mxfp8.dequantize(xq), mxfp8.dequantize(dyq), gs)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 5e-3), (jnp.float16, 2e-3)):
        got = jax.jit(lambda a, b, s: gemm_ffi.grouped_wgrad_cuda(a, b, s, out_dtype=dtype))(xq, dyq, gs)
        assert got.dtype == dtype
        rel = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
        assert rel <= tol, (dtype, rel)


@pytest.mark.gpu
@needs_kernels
def test_small_for_sanitizer(rng):
    """Small and quick: the case compute-sanitizer runs."""
    x, dy = _operands(rng, 300, 200, 136)
    for variant in gemm_ffi.grouped_wgrad_variants():
        _check(x, dy, [100, 0, 150, 200], variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("order", ["static", "dynamic"])
def test_small_for_sanitizer_each_tile_order(rng, monkeypatch, order):
    """The sanitizer's case in each forced tile order, with more tiles than a full grid
    (4 groups of 8 x 6 tiles: the dynamic order's claims wrap its shared-memory ring and
    run past the last tile), poisoned twice; equal to the reference."""
    monkeypatch.setenv("JGM_WGRAD_TILE_ORDER", order)
    x, dy = _operands(rng, 300, 1024, 1536)
    sizes = [100, 0, 150, 200]  # the last group overshoots M
    clamped = clamped_sizes(sizes, 300)
    # A new function, so a new trace that reads the variable (jax caches per function).
    fresh = jax.jit(lambda a, b, gs: gemm_ffi.grouped_wgrad_bf16_cuda(a, b, gs))
    runs = []
    for value in (0xFF, 0x7F):
        poison_freed(4 * 1024 * 1536 * 2, value=value)
        runs.append(np.asarray(jax.block_until_ready(fresh(x, dy, jnp.asarray(sizes, jnp.int32))).astype(jnp.float32)))
    np.testing.assert_array_equal(runs[0], runs[1], err_msg="differs between poisons: unwritten elements or a race")
    total = int(clamped.sum())
    xs, dys = jnp.zeros_like(x).at[:total].set(x[:total]), jnp.zeros_like(dy).at[:total].set(dy[:total])
    want = np.asarray(_reference(xs, dys, jnp.asarray(clamped)), np.float64)
    assert not runs[0][1].any(), "the empty group has a nonzero gradient"
    rel = np.linalg.norm(runs[0] - want) / np.linalg.norm(want)
    assert rel < 5e-3, rel


@pytest.mark.gpu
@needs_kernels
def test_with_token_same_gradient_and_kernel_scratch_token(rng):
    """``grouped_wgrad(..., with_token=True)`` on CUDA: the same bits as without, an int32
    [1] token, and the token is the kernel's own second result (no extra barrier or pass
    in the optimized program: the op's dx waits for it, docs/notes/2026-12-07-scan-weight-copies.md)."""
    from jax_grouped_mlp._src.op import primitives

    x, dy = _operands(rng, 1000, 256, 512)
    gs = jnp.asarray(_sizes(rng, 7, 900))
    plain = jax.jit(lambda a, b: primitives.grouped_wgrad(a, b, gs, jnp.float32))
    tokened = jax.jit(lambda a, b: primitives.grouped_wgrad(a, b, gs, jnp.float32, with_token=True))
    out, token = tokened(x, dy)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain(x, dy)))
    assert token.shape == (1,) and token.dtype == jnp.int32
    hlo = tokened.lower(x, dy).compile().as_text()
    assert "opt-barrier" not in hlo and hlo.count('custom_call_target="jgm_grouped_wgrad"') == 1


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("recipe", ["mxfp8", "bf16", "fp8_block"])
def test_op_gradient_waits_for_the_weight_gradient_tokens(rng, recipe):
    """The op's compiled gradient on CUDA: dx still reads the weight gradients' tokens
    (the population count of ``mlp._after_tokens`` survives XLA's passes), and both
    tokens are the weight-gradient kernel calls' own second results, read (no barrier or
    extra pass makes them): the bf16 kernel's scratch (mxfp8, bf16), the FP8 kernel's
    zeroed token (fp8_block)."""
    import jax_grouped_mlp as jgm

    m, h, f, g = 2048, 256, 192, 16
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((g, h, f)) * 0.05, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((g, f, h)) * 0.05, jnp.bfloat16)
    gs = jnp.asarray(_sizes(rng, g, m - 100))
    loss = lambda x, w1, w2: jgm.grouped_mlp(x, w1, w2, gs, recipe=recipe).astype(jnp.float32).sum()
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, w1, w2).compile().as_text()
    assert " popcnt(" in hlo
    target = "jgm_grouped_wgrad_fp8_block" if recipe == "fp8_block" else "jgm_grouped_wgrad"
    calls = [line.split(" = ")[0].strip() for line in hlo.splitlines()
             if f'custom_call_target="{target}"' in line]  # fmt: skip
    assert len(calls) == 2
    assert not [line for line in hlo.splitlines() if " opt-barrier(" in line and "s32[1]" in line]
    for call in calls:  # each kernel's second result (the token) has a reader
        assert f"get-tuple-element({call}), index=1" in hlo, call
