"""The grouped GEMM that quantizes its weight to MXFP8 in registers (``_qw`` variants).

``grouped_gemm_qw_cuda(a, w) == a @ dequantize(quantize_mxfp8(w, axis=K))`` per group.
Checked three ways on fresh random inputs:
  * the quantizer bit for bit: with one-hot rows of ``a`` each output element *is* one
    quantized weight (a product with 1.0, plus exact zeros), so the output must equal
    ``mxfp8``'s reference quantizer exactly, over weights spanning 2^-100 .. 2^40,
    zeros and sign changes, in both weight layouts (products stay float32-normal:
    the tensor cores' handling of subnormal sums is not what is tested here);
  * random operands against the float32 reference on the fake-quantized weight (one
    bf16 rounding; same bound as tests/test_grouped_gemm_gpu.py) and against the plain
    bf16 kernel on that weight (at most one bf16 ulp apart: only the fp32 summation
    order may differ);
  * poisoned outputs (two poisons must give the same result: every element written),
    rows past the groups exactly zero, adversarial group sizes (zeros, one giant group,
    negative, 2^31 - 1, past M).
The mixed tiles (several variants working in one call, each on its band of every group:
``heuristics.qw_band_rows``) go through the same checks, and must give the same bits as
one variant alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_grouped_mlp._src.cuda import ffi, gemm_ffi
from jax_grouped_mlp._src.formats import mxfp8
from jax_grouped_mlp._src.op import heuristics, primitives, reference
from jax_grouped_mlp.kernels import registry
from gpu_helpers import clamped_sizes, has_gpu, poison_freed

needs_kernels = pytest.mark.skipif(
    not (has_gpu() and ffi.available() and gemm_ffi.grouped_gemm_qw_variants()),
    reason="needs a GPU and the built extension",
)

_qw = jax.jit(gemm_ffi.grouped_gemm_qw_cuda, static_argnames=("transpose_rhs", "variant"))
_plain = jax.jit(gemm_ffi.grouped_gemm_bf16_cuda, static_argnames=("variant", "transpose_rhs"))


def _fake_quantize(w: jax.Array, axis: int) -> jax.Array:
    return mxfp8.dequantize(mxfp8.quantize_mxfp8(w, axis=axis), jnp.bfloat16)


def _run(a, w_stored, group_sizes, transpose: bool, variant: str | tuple[str, ...] | None = None) -> np.ndarray:
    """The kernel's output after each of two poisons (must agree), as float64."""
    m, n = a.shape[0], w_stored.shape[1 if transpose else 2]
    gs = jnp.asarray(np.asarray(group_sizes, np.int32))
    runs = []
    for value in (0xFF, 0x7F):
        poison_freed(m * n * 2, value=value)  # (the bf16 [m, n] output)
        out = _qw(a, w_stored, gs, transpose_rhs=transpose, variant=variant)
        runs.append(np.asarray(jax.block_until_ready(out).astype(jnp.float32), np.float64))
    np.testing.assert_array_equal(runs[0], runs[1], err_msg="output differs between poisons: unwritten elements or a race")
    assert not np.isnan(runs[0]).any(), f"{np.isnan(runs[0]).sum()} NaN outputs (unwritten elements?)"
    return runs[0]


def _check(rng, m, n, k, g, group_sizes, variant: str | tuple[str, ...]) -> None:
    transpose = _is_bk(variant)
    a = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n), np.float32) / np.sqrt(k), jnp.bfloat16)
    w_stored = jnp.swapaxes(w, 1, 2) if transpose else w  # [G, N, K] for the dgrad use
    wq = _fake_quantize(w, axis=1)
    got = _run(a, w_stored, group_sizes, transpose, variant)
    clamped = clamped_sizes(group_sizes, m)
    total = int(clamped.sum())
    assert not got[total:].any(), f"rows past sum(group_sizes)={total} are not zero"
    want = np.asarray(
        reference.ragged_matmul(a.astype(jnp.float32), wq.astype(jnp.float32), jnp.asarray(clamped)), np.float64
    )
    err = np.abs(got - want)
    if np.linalg.norm(want):
        rel = np.linalg.norm(err) / np.linalg.norm(want)
        assert rel <= 5e-3, f"relative error {rel:.2e}"
    rowscale = np.abs(want).max(axis=1, keepdims=True) + 1e-30
    bad = err > 2.0**-7 * np.abs(want) + 1e-3 * rowscale
    assert not bad.any(), f"{bad.sum()} elements off; first {tuple(np.argwhere(bad)[0])}"
    # Against the plain kernel on the quantized weight: at most one bf16 ulp apart.
    wq_stored = jnp.swapaxes(wq, 1, 2) if transpose else wq
    plain = np.asarray(
        _plain(a, wq_stored, jnp.asarray(np.asarray(group_sizes, np.int32)), transpose_rhs=transpose).astype(jnp.float32),
        np.float64,
    )
    ulp = np.maximum(np.abs(plain), 2.0**-126) * 2.0**-7
    far = np.abs(got - plain) > ulp
    assert not far.any(), f"{far.sum()} elements more than one bf16 ulp from the plain kernel"


def _is_bk(variant: str | tuple[str, ...]) -> bool:
    return (variant if isinstance(variant, str) else variant[0]).endswith("_bk")


def _mixed_sets() -> list[tuple[str, ...]]:
    """Per weight layout, every variant together (the default call's mixed tiles) and every
    pair (a largest tile that is not the chunk tile included): the mixed tiles."""
    names = gemm_ffi.grouped_gemm_qw_variants()
    sets = []
    for bk in (False, True):
        fits = tuple(v for v in names if registry.variant(v).rhs_k_major == bk)
        if len(fits) > 1:
            sets.append(fits)
        sets += [(a, b) for i, a in enumerate(fits) for b in fits[i + 1:]] if len(fits) > 2 else []
    return sets


VARIANTS = gemm_ffi.grouped_gemm_qw_variants() or ("none",)
# Every variant alone, then the mixed tiles.
CHOICES = list(VARIANTS) + _mixed_sets()


def _sizes(rng, g, total):
    cuts = np.sort(rng.integers(0, total + 1, size=g - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", CHOICES, ids=str)
@pytest.mark.parametrize(
    "m,n,k,g,total",
    [
        (1000, 256, 512, 7, 1000),  # sizes sum to M, ragged group starts
        (1000, 1856, 2688, 5, 700),  # Nano FC1 dims (N not a multiple of 128), sum below M
        (777, 2688, 1856, 6, 1200),  # Nano FC2 dims (K not a multiple of 64), sum above M
        (300, 136, 200, 3, 300),  # N, K off every tile; K's last MXFP8 block short
        (5, 64, 64, 2, 5),  # fewer tokens than one tile
    ],
)
def test_random(rng, variant, m, n, k, g, total):
    _check(rng, m, n, k, g, _sizes(rng, g, total), variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", CHOICES, ids=str)
def test_adversarial_group_sizes(rng, variant):
    m, n, k, g = 640, 192, 256, 6
    for sizes in ([0, 5, 0, 300, 0, 129], [0, 640, 0, 0, 0, 0], [0] * 6, [-7, 100, 2**31 - 1, 5, 0, 0],
                  [200, 200, 200, 200, 0, 0], [0, 384, 0, 256, 0, 0], [-1, 500, 0, 0, 0, 2**31 - 1]):
        _check(rng, m, n, k, g, sizes, variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", CHOICES, ids=str)
def test_group_sizes_at_tile_boundaries(rng, variant):
    """Groups one short of, at, and one past 192 and 384 tokens: the t384 kernel's tiles
    with two accumulators, with the first only (at most 192 tokens), and partial ones;
    for the mixed tiles, groups with no remainder, no whole chunk, and both (767, 768,
    769), and rows past the groups (M is 100 rows more than the groups)."""
    sizes = [1, 191, 192, 193, 383, 384, 385, 577, 767, 768, 769, 0, 1152]
    _check(rng, sum(sizes) + 100, 192, 256, len(sizes), sizes, variant)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
def test_quantizer_bit_exact(rng, variant):
    """One-hot rows: output row ``r`` of group ``g`` is row ``r % K`` of the quantized weight."""
    transpose = variant.endswith("_bk")
    g, k, n = 3, 192, 136
    mag = 2.0 ** rng.integers(-60, 40, size=(g, k, n))
    w32 = rng.standard_normal((g, k, n)) * mag
    w32[rng.random((g, k, n)) < 0.05] = 0.0  # zeros, some whole blocks
    w32[:, 32:64, :8] = 0.0
    w32[:, 64:96, 8:16] = 2.0**-100 * (1 + rng.random((g, 32, 8)))  # tiny blocks (the scale's low end)
    w = jnp.asarray(w32.astype(np.float32), jnp.bfloat16)
    w_stored = jnp.swapaxes(w, 1, 2) if transpose else w
    a = jnp.asarray(np.tile(np.eye(k, dtype=np.float32), (g, 1)), jnp.bfloat16)  # [g * k, k]
    got = _run(a, w_stored, [k] * g, transpose, variant)
    want = np.asarray(_fake_quantize(w, axis=1).astype(jnp.float32), np.float64).reshape(g * k, n)
    assert np.array_equal(got, want), f"{(got != want).sum()} quantized weights differ from mxfp8.quantize_mxfp8"


@pytest.mark.gpu
@needs_kernels
def test_nan_weight_poisons_its_block_only(rng):
    """A NaN weight makes its 32-block NaN (the MXFP8 rule), so exactly the outputs
    that read that block are NaN: rows of its group, its column."""
    g, k, n, m = 2, 128, 64, 256
    w = np.asarray(rng.standard_normal((g, k, n)), np.float32)
    w[1, 40, 5] = np.nan
    w = jnp.asarray(w, jnp.bfloat16)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    gs = jnp.asarray([100, 120], jnp.int32)
    out = np.asarray(_qw(a, w, gs).astype(jnp.float32))
    nan = np.isnan(out)
    assert nan[100:220, 5].all() and nan.sum() == 120, np.argwhere(nan)[:5]


def test_primitive_reference_on_cpu(rng):
    """``primitives.grouped_gemm_qw``'s reference is the fake-quantized weight's GEMM (CPU)."""
    m, n, k, g = 96, 40, 72, 3
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, n, k)), jnp.bfloat16)
    gs = jnp.asarray([30, 0, 50], jnp.int32)
    with jax.default_device(jax.devices("cpu")[0]):
        got = primitives._REFERENCE["grouped_gemm_qw"](a, w, gs, out_dtype=jnp.dtype(jnp.float32), transpose_rhs=True)
        want = primitives._REFERENCE["grouped_gemm"](
            a, _fake_quantize(w, axis=2), gs, out_dtype=jnp.dtype(jnp.float32), transpose_rhs=True
        )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_binding_rejects_bad_operands():
    """Trace-time errors that name the argument (no GPU needed)."""
    if not ffi.available() or not gemm_ffi.grouped_gemm_qw_variants():
        pytest.skip("the CUDA extension is not built")
    a = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((2,), jnp.int32)
    bad = {
        "w must be bf16": jax.ShapeDtypeStruct((2, 32, 16), jnp.float32),
        "contraction mismatch": jax.ShapeDtypeStruct((2, 48, 16), jnp.bfloat16),
        "w must be": jax.ShapeDtypeStruct((32, 16), jnp.bfloat16),
    }
    for msg, w in bad.items():
        with pytest.raises((ffi.Unsupported, TypeError, ValueError), match=msg):
            jax.eval_shape(lambda a, w, gs: gemm_ffi.grouped_gemm_qw_cuda(a, w, gs), a, w, gs)
    with pytest.raises(TypeError, match="group_sizes"):
        jax.eval_shape(
            lambda a, w, gs: gemm_ffi.grouped_gemm_qw_cuda(a, w, gs), a,
            jax.ShapeDtypeStruct((2, 32, 16), jnp.bfloat16), jax.ShapeDtypeStruct((3,), jnp.int32),
        )
    with pytest.raises(ValueError, match="variant"):
        jax.eval_shape(
            lambda a, w, gs: gemm_ffi.grouped_gemm_qw_cuda(a, w, gs, variant="nope"), a,
            jax.ShapeDtypeStruct((2, 32, 16), jnp.bfloat16), gs,
        )


def test_token_tile_tokens():
    """Each variant's token tile comes from the registry (the device-side choice's model
    reads it: tests/test_heuristics.py)."""
    assert gemm_ffi.qw_tile_tokens("grouped_gemm_sm90_qw_w128t192k64_s5_bk") == 192
    assert gemm_ffi.qw_tile_tokens("grouped_gemm_sm90_qw_w128t256k64_s4") == 256
    assert gemm_ffi.qw_tile_tokens("grouped_gemm_sm90_qw_w128t384k64_s3_ss_bk") == 384
    with pytest.raises(ValueError, match="not a _qw"):
        gemm_ffi.qw_tile_tokens("grouped_gemm_sm90_bf16_m128n256k64_s4")


def test_device_choice_matches_the_model_on_cpu(monkeypatch):
    """``qw_choice`` (XLA, on the device) picks the option ``heuristics`` rates cheapest
    (one variant: ``qw_tiles_cost``; the mixed tiles: ``qw_mixed_cost``), first of equals,
    for equal, skewed, negative and empty groups; with ``JGM_QW_MIXED_TILES=0`` one
    variant only. The fitted table (session 47) keeps the 256 tile alone under router
    skew at Nano, where it measured faster than the mixed tiles; the mixed tiles win
    where the groups are long and their remainders fit the smaller tiles, and never at
    equal 384-token groups."""
    names = ("grouped_gemm_sm90_qw_w128t192k64_s5", "grouped_gemm_sm90_qw_w128t256k64_s4",
             "grouped_gemm_sm90_qw_w128t384k64_s3_ss")
    tiles = [gemm_ffi.qw_tile_tokens(v) for v in names]
    options = gemm_ffi.qw_options(names)
    assert options.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1]]
    assert gemm_ffi.qw_options(names, mixed=False).tolist() == [[0, 0], [1, 0], [2, 0]]
    assert gemm_ffi.qw_options(names[:1]).tolist() == [[0, 0]]  # one variant: nothing to mix
    rng = np.random.default_rng(0)
    dirichlet = rng.multinomial(49152, rng.dirichlet(np.ones(128)))
    long_groups = 1152 + rng.integers(150, 250, 128)  # three whole chunks and a remainder for t256
    cases = [np.full(128, 384), np.full(16, 192), np.full(8, 1024), np.zeros(4, np.int64), dirichlet,
             rng.multinomial(6000, rng.dirichlet(np.full(32, 0.3))), np.asarray([-5, 800, 0, 2**31 - 1]),
             long_groups]

    def modelled(sizes, row):
        sizes = np.maximum(np.asarray(sizes, np.int64), 0)
        i, mixed = row
        if mixed:
            return float(heuristics.qw_mixed_cost(sizes, tiles, registry.QW_CHUNK_TOKENS))
        return float(heuristics.qw_tiles_cost(sizes, tiles[i]))

    choose = jax.jit(gemm_ffi.qw_choice, static_argnums=1)
    with jax.default_device(jax.devices("cpu")[0]):
        for sizes in cases:
            costs = [modelled(sizes, row) for row in options]
            got = choose(jnp.asarray(sizes, jnp.int32), names)
            assert got.shape == (2,) and got.dtype == jnp.int32
            assert got.tolist() == options[int(np.argmin(costs))].tolist(), (sizes[:8], costs)
        assert choose(jnp.asarray(np.full(128, 384), jnp.int32), names).tolist() == [2, 0]
        assert choose(jnp.asarray(dirichlet, jnp.int32), names).tolist() == [1, 0]  # t256 under router skew
        assert choose(jnp.asarray(long_groups, jnp.int32), names).tolist() == [2, 1]  # mixed
        monkeypatch.setenv("JGM_QW_MIXED_TILES", "0")
        assert gemm_ffi.qw_choice(jnp.asarray(long_groups, jnp.int32), names)[1] == 0
        monkeypatch.setenv("JGM_QW_MIXED_TILES", "yes")
        with pytest.raises(ValueError, match="JGM_QW_MIXED_TILES"):
            gemm_ffi.qw_choice(jnp.asarray(dirichlet, jnp.int32), names)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("transpose", [False, True], ids=["w", "w_bk"])
def test_device_choice_covers_every_row_once(rng, transpose):
    """One call launches every variant of the layout; the ``choice`` operand makes one
    variant work (the first value, clamped into range on the device) or, with a second
    value of 1, all of them on their bands (mixed tiles): after two different poisons
    every element is written and equal, for in-range, negative, too-large and mixed
    choices, and equal bit for bit to one variant launched alone (all variants give the
    same bits)."""
    fits = tuple(v for v in gemm_ffi.grouped_gemm_qw_variants() if registry.variant(v).rhs_k_major == transpose)
    if len(fits) < 2:
        pytest.skip("one variant of this layout compiled")
    m, n, k, g = 2400, 192, 320, 7
    sizes = jnp.asarray([0, 700, 13, 384, 193, 100, 900], jnp.int32)  # 110 rows past the groups
    a = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, n, k) if transpose else (g, k, n), np.float32) / np.sqrt(k), jnp.bfloat16)
    call = jax.jit(gemm_ffi._grouped_gemm_qw_call, static_argnums=(4, 5))
    alone = _run(a, w, np.asarray(sizes), transpose, fits[0])
    last = len(fits) - 1
    choices = [(-3, 0), (0, 0), (1, 0), (last, 0), (last + 5, 0), (1, -7), (2, 2), (0, 2**31 - 1)]
    choices += [(0, 1), (last, 1), (-4, 1), (last + 9, 1)]  # the mixed tiles (the first is then unused)
    for choice in choices:
        runs = []
        for value in (0xFF, 0x7F):
            poison_freed(m * n * 2, value=value)  # (the bf16 [m, n] output)
            out = call(a, w, sizes, jnp.asarray(choice, jnp.int32), fits, n)
            runs.append(np.asarray(jax.block_until_ready(out).astype(jnp.float32), np.float64))
        # (Two variants on one row would write the same bits: this catches none running or a race.)
        np.testing.assert_array_equal(runs[0], runs[1], err_msg=f"{choice=}: unwritten elements or a race")
        np.testing.assert_array_equal(runs[0], alone, err_msg=f"{choice=}")
    np.testing.assert_array_equal(_run(a, w, np.asarray(sizes), transpose), alone)  # the default: chosen by XLA
