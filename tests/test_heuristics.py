"""The kernel heuristics (``_src/op/heuristics.py``): pure rules of a frozen config and static shapes."""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_grouped_mlp as jgm
from jax_grouped_mlp._src.op import heuristics, mlp
from jax_grouped_mlp._src.op.heuristics import DEFAULT, KernelChoices
from jax_grouped_mlp._src.op.recipes import Recipe

MX, BF = Recipe.MXFP8, Recipe.BF16


def test_default_config():
    assert DEFAULT == KernelChoices(
        order_backward=True, quantize_weights_in_gemm=True, qw_max_rows_per_group=512, fp8_block_wgrad=True
    )
    assert hash(DEFAULT) == hash(KernelChoices())  # a static argument of the op's custom_vjp
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.order_backward = False  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs,exc,needle",
    [
        ({"order_backward": 1}, TypeError, "order_backward=1"),
        ({"quantize_weights_in_gemm": "yes"}, TypeError, "quantize_weights_in_gemm='yes'"),
        ({"fp8_block_wgrad": 1}, TypeError, "fp8_block_wgrad=1"),
        ({"qw_max_rows_per_group": -1}, ValueError, "qw_max_rows_per_group=-1"),
        ({"qw_max_rows_per_group": 2.5}, ValueError, "qw_max_rows_per_group=2.5"),
        ({"qw_max_rows_per_group": True}, ValueError, "qw_max_rows_per_group=True"),
    ],
)
def test_bad_config_names_the_field(kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        KernelChoices(**kwargs)


def test_weights_in_gemm_rule():
    """Weights are quantized in the kernel for MXFP8 with at most qw_max_rows_per_group
    rows per group on average (and a symbolic token count), never for bf16 or when off."""
    cap = DEFAULT.qw_max_rows_per_group
    assert heuristics.weights_in_gemm(DEFAULT, MX, 128 * 384, 128)  # Nemotron-3-Nano
    assert heuristics.weights_in_gemm(DEFAULT, MX, cap * 4, 4)
    assert not heuristics.weights_in_gemm(DEFAULT, MX, cap * 4 + 1, 4)
    assert not heuristics.weights_in_gemm(DEFAULT, MX, 32 * 1024, 32)  # moe32: the pass pays
    assert not heuristics.weights_in_gemm(DEFAULT, MX, 16, 0)
    assert not heuristics.weights_in_gemm(DEFAULT, BF, 16, 4)
    assert heuristics.weights_in_gemm(DEFAULT, MX, object(), 4)  # symbolic M
    off = KernelChoices(quantize_weights_in_gemm=False)
    assert not heuristics.weights_in_gemm(off, MX, 16, 4)
    assert heuristics.weights_in_gemm(KernelChoices(qw_max_rows_per_group=2048), MX, 32 * 1024, 32)


def test_fused_epilogue_rules():
    """FC1 and the FC2 dgrad run fused exactly when the weights are quantized by a pass
    (MXFP8); FC1 also needs the caller's flag and static shapes."""
    off = KernelChoices(quantize_weights_in_gemm=False)
    assert heuristics.fuse_fc1(off, MX, True, (64, 32), 4)
    assert not heuristics.fuse_fc1(off, MX, False, (64, 32), 4)
    assert not heuristics.fuse_fc1(off, BF, True, (64, 32), 4)
    assert not heuristics.fuse_fc1(off, MX, True, (object(), 32), 4)  # symbolic M
    assert not heuristics.fuse_fc1(DEFAULT, MX, True, (64, 32), 4)  # small groups: weights in the GEMM
    assert heuristics.fuse_fc1(DEFAULT, MX, True, (4 * 1024, 32), 4)
    # fp8_block: its FC1 kernel has the epilogue too (the weights are never quantized in the GEMM).
    assert heuristics.fuse_fc1(DEFAULT, "fp8_block", True, (64, 32), 4)
    assert not heuristics.fuse_fc1(DEFAULT, "fp8_block", False, (64, 32), 4)
    assert heuristics.fuse_dgrad(off, MX, 64, 4)
    assert not heuristics.fuse_dgrad(DEFAULT, MX, 64, 4)
    assert heuristics.fuse_dgrad(DEFAULT, MX, 4 * 1024, 4)
    assert not heuristics.fuse_dgrad(off, BF, 64, 4)


def _qw_best(sizes) -> int:
    sizes = np.asarray(sizes, np.int64)
    return min(heuristics.QW_TILE_COSTS, key=lambda t: heuristics.qw_tiles_cost(sizes, t))


def test_dy_dh_token_major_rule():
    """dy and dh go token-major only for fp8_block with the FP8 weight gradient, bf16 dy,
    a static M and H, F inside that kernel's contract."""
    on, off = heuristics.DEFAULT, heuristics.KernelChoices(fp8_block_wgrad=False)
    rule = heuristics.dy_dh_token_major
    assert rule(on, "fp8_block", 49152, 2688, 1856, 128, "bfloat16")
    assert not rule(off, "fp8_block", 49152, 2688, 1856, 128, "bfloat16")
    for recipe in ("mxfp8", "bf16"):
        assert not rule(on, recipe, 49152, 2688, 1856, 128, "bfloat16")
    assert not rule(on, "fp8_block", 49152, 2688, 1856, 128, "float32")  # the pair kernel takes bf16
    assert not rule(on, "fp8_block", object(), 2688, 1856, 128, "bfloat16")  # a symbolic M
    assert not rule(on, "fp8_block", 4096, 100, 1856, 8, "bfloat16")  # H % 8
    assert not rule(on, "fp8_block", 4096, 2688, 1852, 8, "bfloat16")  # F % 8
    assert not rule(on, "fp8_block", 2**20, 4096, 4096, 8, "bfloat16")  # a laid-out copy of 2^31 bytes
    assert not rule(on, "fp8_block", 4096, 8192, 8192, 64, "bfloat16")  # an output [G, H, F] of 2^32 elements
    # The same contract the weight gradient's binding checks.
    assert heuristics.fp8_wgrad_fits(49152, 2688, 1856, 128) and not heuristics.fp8_wgrad_fits(49152, 2688, 1852, 128)


def test_qw_tiles_cost_counts_tiles():
    """ceil(g / tile) tiles per group, the 384 tile cheaper when it holds at most 192 tokens."""
    full, half = heuristics.QW_TILE_COSTS[384]
    sizes = np.array([0, 1, 192, 193, 384, 385, 1000])
    # 0: none; 1, 192: one half tile; 193, 384: one full; 385: full + half; 1000: 2 full + full (232 > 192).
    assert heuristics.qw_tiles_cost(sizes, 384) == pytest.approx(6 * full + 3 * half)
    # 256: 1 and 384 end in a tile of at most 128 tokens (half), the rest in fuller ones: 9 full, 2 half.
    full256, half256 = heuristics.QW_TILE_COSTS[256]
    assert heuristics.qw_tiles_cost(sizes, 256) == pytest.approx(9 * full256 + 2 * half256)
    with pytest.raises(ValueError, match="tile_t must be one of"):
        heuristics.qw_tiles_cost(sizes, 128)


def test_every_qw_variant_has_a_cost_and_its_own_tile():
    """The device-side choice prices every compiled ``_qw`` variant (a missing tile would
    fail the default mxfp8 path at trace time) and tells them apart (two of one layout
    with one tile would always tie)."""
    from jax_grouped_mlp.kernels import registry

    qw = [v for v in registry.VARIANTS if isinstance(v, registry.QwGemmVariant)]
    assert qw and all(v.tile_t in heuristics.QW_TILE_COSTS for v in qw)
    for layout in (False, True):
        tiles = [v.tile_t for v in qw if v.rhs_k_major == layout]
        assert len(tiles) == len(set(tiles)), tiles


def test_qw_tiles_cost_under_strict_promotion():
    """Traced under ``jax.numpy_dtype_promotion("strict")`` (a user's setting): no implicit
    int/bool-to-float promotion."""
    sizes = jnp.asarray([0, 5, 300, 1000], jnp.int32)
    with jax.numpy_dtype_promotion("strict"):
        got = jax.jit(lambda s: heuristics.qw_tiles_cost(s, 384))(sizes)
    full, half = heuristics.QW_TILE_COSTS[384]
    assert float(got) == pytest.approx(4 * full + half)  # 5: half; 300: full; 1000: 2 full + full (232)


def test_qw_tile_choice_follows_the_sizes():
    """Equal sizes keep the tiles measured best (192 at 192 rows a group, 384 at Nano's
    384, 256 at 1024); router-made skew at Nano moves 384 to 256 (as measured)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    import shapes

    assert _qw_best(np.full(128, 384)) == 384
    assert _qw_best(np.full(16, 192)) == 192
    assert _qw_best(np.full(8, 1024)) == 256
    assert _qw_best(shapes.router_group_sizes(128 * 384, 128, 1.0)) == 256
    assert _qw_best(np.zeros(4, np.int64)) == 192  # nothing to do: the first of equals


def test_gemm_tile_n():
    """Least column padding, then the widest tile."""
    widths = (128, 192, 256)
    assert heuristics.gemm_tile_n(4096, widths) == 256
    assert heuristics.gemm_tile_n(1536, widths) == 256
    assert heuristics.gemm_tile_n(1856, widths) == 192  # Nemotron-3-Nano's F
    assert heuristics.gemm_tile_n(2688, widths) == 192  # and its H
    assert heuristics.gemm_tile_n(64, widths) == 128  # the least padding first
    with pytest.raises(ValueError, match="widths"):
        heuristics.gemm_tile_n(64, ())


def test_no_mutable_tuning_globals():
    """The tuning knobs are the config's fields, not module globals that callers flip."""
    for name in ("ORDER_BACKWARD", "QUANTIZE_WEIGHTS_IN_GEMM", "QW_MAX_ROWS_PER_GROUP"):
        assert not hasattr(mlp, name), name
    src = pathlib.Path(heuristics.__file__).read_text()
    assert "import jax_grouped_mlp" not in src and "from jax_grouped_mlp" not in src.split("TYPE_CHECKING:")[0]


def test_grouped_mlp_is_the_default_choices(rng):
    """``grouped_mlp`` is ``grouped_mlp_with(DEFAULT)``: the same bits, forward and gradients,
    on fresh random inputs with small groups (weights quantized in the GEMMs) and a
    non-default config giving the same numbers too."""
    m, h, f, g = 96, 64, 96, 3
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((g, h, f)) / 8, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((g, f, h)) / 8, jnp.bfloat16)
    gs = jnp.asarray([40, 0, 50], jnp.int32)
    p = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)

    def run(fn):
        loss = lambda x, w1, w2, p: jnp.sum(fn(x, w1, w2, gs, p).astype(jnp.float32) ** 2)
        return jax.tree.leaves(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, w1, w2, p))

    want = run(jgm.grouped_mlp)
    for choices in (DEFAULT, KernelChoices(order_backward=False, quantize_weights_in_gemm=False)):
        got = run(lambda *a, c=choices: mlp.grouped_mlp_with(c, *a))
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(TypeError, match="choices"):
        mlp.grouped_mlp_with({"order_backward": True}, x, w1, w2, gs, p)


def _round_robin_imbalance(sizes: np.ndarray, group_tiles: int, ctas: int) -> float:
    """The weight gradient's static order replayed tile by tile (an independent oracle)."""
    stages = -(-np.maximum(sizes, 0) // heuristics.WGRAD_STAGE_ROWS)
    cost = np.repeat(stages * heuristics.WGRAD_STAGE_COST + heuristics.WGRAD_TILE_COST, group_tiles).astype(float)
    work = np.zeros(ctas)
    for t, c in enumerate(cost):
        work[t % ctas] += c
    return work.max() / work.mean()


@pytest.mark.parametrize("group_tiles, ctas", [(210, 132), (168, 132), (7, 132), (132, 132), (300, 114), (5, 3)])
def test_wgrad_static_imbalance_replays_the_static_order(rng, group_tiles, ctas):
    for alpha in (0.3, 1.0, 100.0):
        sizes = rng.multinomial(20000, rng.dirichlet(np.full(37, alpha))).astype(np.int64)
        sizes[::7] = -5  # negative sizes count as empty groups
        want = _round_robin_imbalance(sizes, group_tiles, ctas)
        assert heuristics.wgrad_static_imbalance(sizes, group_tiles, ctas) == pytest.approx(want, rel=1e-12)
    equal = np.full(128, 384)
    assert heuristics.wgrad_static_imbalance(equal, 210, 132) == pytest.approx(_round_robin_imbalance(equal, 210, 132))
    assert heuristics.wgrad_static_imbalance(np.zeros(0, np.int64), 210, 132) == 1.0
    with pytest.raises(ValueError, match="group_tiles and ctas"):
        heuristics.wgrad_static_imbalance(equal, 0, 132)


def test_wgrad_order_choice_at_the_nano_shape():
    """Equal sizes and Dirichlet(1) keep the static order at the Nano weight gradients'
    210 tiles per group; Dirichlet(0.3), where the H100 measured the dynamic order 12-15 %
    faster, takes the dynamic one (skew notes, "Session 37")."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    from shapes import router_group_sizes

    def imbalance(alpha):
        sizes = np.full(128, 384) if alpha is None else np.asarray(router_group_sizes(49152, 128, alpha=alpha, seed=0))
        return heuristics.wgrad_skew_imbalance(sizes, 210, 132)

    assert imbalance(None) < imbalance(1.0) < heuristics.WGRAD_DYNAMIC_IMBALANCE < imbalance(0.3)


@pytest.mark.parametrize("groups, group_tiles", [(8, 512), (128, 210), (16, 210), (32, 192), (5, 7)])
def test_wgrad_skew_imbalance_leaves_out_tile_granularity(rng, groups, group_tiles):
    """Equal sizes add no skew, whatever the granularity of the static order's tiles (8
    groups of 512 tiles on 132 CTAs: 1.031 from granularity alone, which the dynamic
    order cannot remove), at any rows per group and nearly so with a remainder; skewed
    sizes are measured against equal ones, negative sizes counting as empty; traced
    sizes give the same value."""
    for rows in (1, 64, 384, 5000):
        equal = np.full(groups, rows)
        assert heuristics.wgrad_skew_imbalance(equal, group_tiles, 132) == pytest.approx(1.0, abs=1e-12)
    with_remainder = np.full(groups, 384)
    with_remainder[: groups // 2] += 1  # 385 rows: one more 64-row stage for those groups
    got = heuristics.wgrad_skew_imbalance(with_remainder, group_tiles, 132)
    assert got == pytest.approx(_skew_oracle(with_remainder, group_tiles, 132), rel=1e-12)
    assert 1 - 1e-9 <= got < 1.005
    skewed = rng.multinomial(384 * groups, rng.dirichlet(np.full(groups, 0.3))).astype(np.int64)
    want = _skew_oracle(skewed, group_tiles, 132)
    assert heuristics.wgrad_skew_imbalance(skewed, group_tiles, 132) == pytest.approx(want, rel=1e-12)
    with_negative = np.concatenate([skewed, [-7]])
    assert heuristics.wgrad_skew_imbalance(with_negative, group_tiles, 132) == pytest.approx(
        _skew_oracle(np.maximum(with_negative, 0), group_tiles, 132), rel=1e-12)
    traced = jax.jit(lambda s: heuristics.wgrad_skew_imbalance(s, group_tiles, 132))(jnp.asarray(skewed, jnp.int32))
    assert float(traced) == pytest.approx(want, rel=1e-5)
    assert heuristics.wgrad_skew_imbalance(np.zeros(0, np.int64), group_tiles, 132) == 1.0


def _skew_oracle(sizes: np.ndarray, group_tiles: int, ctas: int) -> float:
    """The static order replayed tile by tile, its largest CTA over the larger of (the
    mean times the imbalance of equal-cost tiles) and the costliest tile."""
    stages = -(-np.maximum(sizes, 0) // heuristics.WGRAD_STAGE_ROWS)
    cost = np.repeat(stages * heuristics.WGRAD_STAGE_COST + heuristics.WGRAD_TILE_COST, group_tiles).astype(float)
    work, counts = np.zeros(ctas), np.zeros(ctas)
    for t, c in enumerate(cost):
        work[t % ctas] += c
        counts[t % ctas] += 1
    return work.max() / max(work.mean() * counts.max() / counts.mean(), cost.max())


def test_wgrad_skew_imbalance_is_one_where_few_tiles(rng):
    """Fewer tiles than CTAs: every CTA holds at most one, so no order does better than
    the costliest tile, however skewed the sizes."""
    sizes = rng.multinomial(4000, rng.dirichlet(np.full(5, 0.3)))
    assert heuristics.wgrad_skew_imbalance(sizes, 7, 132) == pytest.approx(1.0)
    assert heuristics.wgrad_static_imbalance(sizes, 7, 132) > 3  # (the mean counts the idle CTAs)


def test_wgrad_tile_order_on_the_device(monkeypatch):
    """``gemm_ffi.wgrad_tile_order``: XLA computes the choice from traced group sizes (no
    host sync); ``JGM_WGRAD_TILE_ORDER`` forces it, and a bad value is named."""
    from jax_grouped_mlp._src.cuda import devices, gemm_ffi

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    from shapes import router_group_sizes

    equal = jnp.full((128,), 384, jnp.int32)
    skewed = jnp.asarray(router_group_sizes(49152, 128, alpha=0.3, seed=0), jnp.int32)
    # A new function each time: jax caches a trace per function, and the variable is read
    # when tracing.
    choose = lambda sizes: np.asarray(jax.jit(lambda s: gemm_ffi.wgrad_tile_order(s, 210))(sizes))
    monkeypatch.delenv("JGM_WGRAD_TILE_ORDER", raising=False)
    if devices.sm_count() == devices.DEFAULT_SM_COUNT:  # the threshold's calibration
        assert choose(equal).tolist() == [0] and choose(skewed).tolist() == [1]
        # 8 equal groups of 512 tiles: the static order's 1.031 is granularity, kept static
        eight = jnp.full((8,), 8192, jnp.int32)
        assert np.asarray(jax.jit(lambda s: gemm_ffi.wgrad_tile_order(s, 512))(eight)).tolist() == [0]
    assert choose(jnp.zeros((0,), jnp.int32)).tolist() == [0]  # no groups: static, an array all the same
    for forced, want in (("static", 0), ("dynamic", 1)):
        monkeypatch.setenv("JGM_WGRAD_TILE_ORDER", forced)
        assert choose(skewed).tolist() == choose(equal).tolist() == [want]
        assert choose(skewed).dtype == np.int32
    monkeypatch.setenv("JGM_WGRAD_TILE_ORDER", "fast")
    with pytest.raises(ValueError, match="JGM_WGRAD_TILE_ORDER must be one of"):
        choose(equal)


def test_qw_band_rows_take_every_row_once():
    """The mixed tiles' bands (what the kernels' ``RowBand`` takes): for random, equal,
    empty and boundary sizes, and for every set of distinct tiles (the compiled 192, 256,
    384 and others), the bands add up to the sizes; the largest tile takes every whole
    chunk and a remainder above the next tile; any other tile takes at most one tile's
    worth, only a remainder it holds and the next smaller tile does not."""
    rng = np.random.default_rng(3)
    cases = [np.full(128, 384), np.zeros(5, np.int64), np.asarray([0, 1, 191, 192, 193, 255, 256, 257, 383, 384,
                                                                  385, 575, 576, 577, 767, 768, 769, 5000]),
             rng.multinomial(49152, rng.dirichlet(np.ones(128))), rng.multinomial(9999, rng.dirichlet(np.full(64, 0.3)))]
    for tiles in ((192, 256, 384), (384, 192), (256, 192), (384,), (128, 320)):
        top = max(tiles)
        for sizes in cases:
            parts = heuristics.qw_band_rows(sizes, tiles, 384)
            np.testing.assert_array_equal(sum(parts), sizes)
            rest = sizes % 384
            for rows, t in zip(parts, tiles):
                assert (rows >= 0).all()
                lo = max((u for u in tiles if u < t), default=0)
                if t == top:
                    np.testing.assert_array_equal(rows, sizes - rest + np.where(rest > lo, rest, 0))
                else:
                    np.testing.assert_array_equal(rows, np.where((rest > lo) & (rest <= t), rest, 0))
    with pytest.raises(ValueError, match="distinct"):
        heuristics.qw_band_rows(cases[0], (192, 192), 384)


def test_qw_mixed_cost_is_the_bands_cost():
    """The bands' tile costs plus one launch cost per extra working launch: equal multiples
    of the chunk cost more than the largest tile alone (nothing to gain, so the choice
    keeps one variant, whatever the float sums' rounding); less than every single tile
    where the groups are long and their remainders fit a smaller tile."""
    tiles = (192, 256, 384)
    extra = 2 * heuristics.QW_MIXED_LAUNCH_COST
    for rows in (384, 768, 1152):
        equal = np.full(7, rows)
        assert heuristics.qw_mixed_cost(equal, tiles, 384) == pytest.approx(heuristics.qw_tiles_cost(equal, 384) + extra)
    skewed = 1152 + np.random.default_rng(0).integers(130, 256, 128)
    mixed = heuristics.qw_mixed_cost(skewed, tiles, 384)
    assert mixed < min(heuristics.qw_tiles_cost(skewed, t) for t in tiles)
    parts = heuristics.qw_band_rows(skewed, tiles, 384)
    assert mixed == pytest.approx(sum(heuristics.qw_tiles_cost(r, t) for r, t in zip(parts, tiles)) + extra)
