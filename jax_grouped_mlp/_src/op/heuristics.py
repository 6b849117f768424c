"""Kernel heuristics: which path the op takes and which tile a kernel uses, in one place.

Every decision here is a pure function of static shapes and, for the op's paths, of a
frozen :class:`KernelChoices`, except the ``_qw`` GEMMs' token tile, which XLA computes
on the device from the group sizes with :func:`qw_tiles_cost`. The op takes the choices as an explicit (static)
argument: ``grouped_mlp`` always uses :data:`DEFAULT`; tests and benchmarks that
compare paths pass another config to the private ``mlp.grouped_mlp_with``. Nothing
here is a mutable global, so a traced program depends only on its arguments.

None of these choices changes a result bit (see each field); they change speed and
memory. The thresholds were measured on the H200; the measurements and how they were
taken are in docs/notes/2026-11-30-grouped-gemm-kernels.md and
docs/notes/2026-11-30-performance-history.md (the ``_qw`` tiles:
``benchmarks/results/gemm_qw_h200.json``). In short: quantizing a weight inside the
GEMM pays while groups are small, because the kernel quantizes a weight tile again
for every token tile that uses it: faster at Nemotron-3-Nano's 384 rows per group,
within run-to-run noise at 1024, slower at 8192; hence the cap of 512.

This module imports nothing from the package, so the bindings (``_src/cuda``) can
import it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np



@dataclasses.dataclass(frozen=True)
class KernelChoices:
    """How the op maps onto kernels (frozen and hashable: a static argument of the op).

    Attributes:
      order_backward: pin the op's order (w1's dgrad quantization only once dh exists,
        an optimization barrier; dx leaves the layer only with both weight gradients
        done, through their tokens; the unfused FC1's result kept as the residual
        through a barrier of its own, so that a ``jax.lax.scan`` of layers does not run
        FC1 twice). Changes memory and time, never results.
      quantize_weights_in_gemm: with MXFP8 and small groups, the four weight GEMMs
        quantize their weights themselves (``primitives.grouped_gemm_qw``) instead of a
        fake-quantize pass before every GEMM that uses a weight; FC1 and the FC2 dgrad
        then run unfused (their epilogue kernels take a quantized weight). Same bits.
      qw_max_rows_per_group: "small groups" for ``quantize_weights_in_gemm``: at most
        this many rows per group on average.
      fp8_block_wgrad: ``fp8_block``'s weight gradients multiply the FP8 copies on the
        FP8 weight-gradient kernel (the default: the kept x and srelu(h) copies take a
        token-major layout pass, dy's and dh's come token-major from their quantizer,
        :func:`dy_dh_token_major`); False: the bf16
        weight-gradient kernel on their exactly dequantized values (the same products;
        only the summation differs: the FP8 accumulator sums each 128-token block with
        fewer bits than float32, 6.9e-4 norm-wise apart on the H200). On the H200 the
        FP8 path's step is 0.78-0.97x of the bf16 path's at the four benchmark shapes
        (``mlp_step_byte_tile_h200.json``; docs/notes/2026-12-04-fp8-layout-passes.md).
    """

    order_backward: bool = True
    quantize_weights_in_gemm: bool = True
    qw_max_rows_per_group: int = 512
    fp8_block_wgrad: bool = True

    def __post_init__(self) -> None:
        for name in ("order_backward", "quantize_weights_in_gemm", "fp8_block_wgrad"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {name}={value!r}")
        rows = self.qw_max_rows_per_group
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(f"qw_max_rows_per_group must be an int >= 0, got qw_max_rows_per_group={rows!r}")


# What ``grouped_mlp`` uses.
DEFAULT = KernelChoices()


def weights_in_gemm(choices: KernelChoices, recipe: str, m, num_groups: int) -> bool:
    """Whether the weight GEMMs quantize their weights in the kernel (``grouped_gemm_qw``).

    MXFP8 only, with ``choices.quantize_weights_in_gemm`` and at most
    ``choices.qw_max_rows_per_group`` rows per group on average. Decided from the static
    shapes, so the forward and backward rules agree; a symbolic token count ``m``
    (shape-polymorphic export) counts as small groups.
    """
    # Recipe is a str enum: compared by value, so this module need not import the op.
    if recipe != "mxfp8" or not choices.quantize_weights_in_gemm:
        return False
    if not isinstance(m, int):
        return True
    return num_groups > 0 and m <= choices.qw_max_rows_per_group * num_groups


def fuse_fc1(choices: KernelChoices, recipe: str, fuse: bool, x_shape: Sequence, num_groups: int) -> bool:
    """Whether FC1 runs as one kernel with its epilogue (``primitives.fc1_fused``).

    The caller asked for it (``fuse``, the public ``fuse_fc1_epilogue``), the MXFP8 or
    ``fp8_block`` recipe (``primitives.fp8_block_fc1``), static shapes (the unfused forward
    needs no group-aware quantization, which wants a static row count), and weights
    quantized by a pass (the epilogue kernel takes a quantized weight).
    """
    return (
        fuse and recipe in ("mxfp8", "fp8_block") and all(isinstance(d, int) for d in x_shape)
        and not weights_in_gemm(choices, recipe, x_shape[0], num_groups)
    )


def fp8_wgrad_fits(m, k: int, n: int, g: int) -> bool:
    """The FP8 weight gradient's shape contract: static sizes, K and N multiples of 8,
    fewer than 2^31 elements in each token-major operand ``[K or N, 128 * (cdiv(M, 128)
    + G)]`` and in the output ``[G, K, N]``."""
    if not all(isinstance(d, int) for d in (m, k, n, g)):
        return False
    width = 128 * (-(-m // 128) + g)
    return k % 8 == 0 and n % 8 == 0 and k * width < 2**31 and n * width < 2**31 and g * k * n < 2**31


def dy_dh_token_major(choices: KernelChoices, recipe: str, m, h: int, f: int, num_groups: int,
                      dy_dtype: str) -> bool:
    """Whether the backward quantizes dy and dh straight into the FP8 weight gradient's
    token-major layout (``fp8_block`` with ``choices.fp8_block_wgrad``): only where the
    pair quantizer writes it (bfloat16 dy; dh always is) and the weight-gradient kernel
    takes both (:func:`fp8_wgrad_fits` for dW1 and dW2). Elsewhere the copies stay ``[M, K]``: the
    weight gradient lays them out with its own kernel, or runs the bf16 kernel on their
    dequantized values, where a token-major copy would only be gathered back. Same bits
    either way."""
    if recipe != "fp8_block" or not choices.fp8_block_wgrad or dy_dtype != "bfloat16":
        return False
    return fp8_wgrad_fits(m, h, f, num_groups) and fp8_wgrad_fits(m, f, h, num_groups)


def fuse_dgrad(choices: KernelChoices, recipe: str, m, num_groups: int) -> bool:
    """Whether the FC2 dgrad runs as one kernel with the dSReLU/dprobs epilogue
    (``primitives.dgrad_fused``): MXFP8 with weights quantized by a pass."""
    return recipe == "mxfp8" and not weights_in_gemm(choices, recipe, m, num_groups)


# ---- Tile choices of the CUDA kernels ----

# The token tile of the ``_qw`` GEMM is chosen on the device from the group sizes (one
# FFI call launches every compiled tile; ``gemm_ffi.qw_choice`` computes which one works,
# in XLA, without a host sync): the tile with the least modelled time. A group of g rows
# runs ceil(g / tile) token tiles per weight tile; the model charges each one a cost
# relative to the others: (cost of a tile with more than half its tokens, cost with at
# most half). The register-A kernels (192, 256) are bound by the weight conversion, so a
# tile costs nearly the same however few tokens it holds; the shared-memory-A 384 tile
# runs one accumulator's wgmmas for at most 192 tokens. The numbers are a least-squares
# fit (``benchmarks/bench_qw_choice.py``) of every option of the call, each tile alone and
# the mixed tiles, timed at both Nemotron-3-Nano GEMMs and both weight layouts on equal
# sizes and 24 router draws (Dirichlet 3, 1, 0.3) on an H100
# (``benchmarks/results/qw_choice_s47_h100.json``, ``qw_choice_seeds4567_s47_h100.json``).
# Fitted on one half of the draws, a table picked within 0.3 % of the best option on the
# other half on average (the session-43 table: 1.8-5.3 %, by taking the mixed tiles where
# a single tile is faster); in the Nano step that is 0.15-0.24 ms less `_qw` kernel time
# under skew, which XLA's command buffers mostly hide (docs/performance.md). It keeps the
# order measured at equal sizes (384 best at 384 rows a group, 192 at 192, 256 at 1024)
# and under router skew (256).
QW_TILE_COSTS: dict[int, tuple[float, float]] = {192: (0.44, 0.41), 256: (0.50, 0.44), 384: (0.77, 0.55)}


def qw_tiles_cost(group_sizes, tile_t: int):
    """The modelled time of the ``_qw`` GEMM with token tile ``tile_t`` for these (clamped,
    non-negative) group sizes, per weight tile, in :data:`QW_TILE_COSTS`' units.

    Written with array operators only, so it takes a NumPy array (tests, benchmarks) or a
    traced jax array (the device-side choice) alike; a tile missing from the table raises
    ValueError.
    """
    if tile_t not in QW_TILE_COSTS:
        raise ValueError(f"tile_t must be one of {sorted(QW_TILE_COSTS)}, got {tile_t=}")
    full, half = QW_TILE_COSTS[tile_t]
    rem = group_sizes % tile_t
    big = rem > tile_t // 2
    small = (rem > 0) & ~big
    # Explicit casts: an int or bool array times a float would fail under
    # jax.numpy_dtype_promotion("strict").
    tiles = (group_sizes // tile_t).astype(float) + big.astype(float)
    return (tiles * full + small.astype(float) * half).sum()


def qw_band_rows(group_sizes, tiles: Sequence[int], chunk: int) -> list:
    """The rows each launch of the ``_qw`` GEMM's mixed tiles takes of every group (a list
    over ``tiles``, each like ``group_sizes``), as the kernels' ``tile_scheduler.RowBand``
    assigns them: a group's whole chunks of ``chunk`` tokens go to the largest tile, its
    remainder ``r`` to the smallest tile ``>= r`` (the largest tile if none). ``tiles``
    must be distinct; the lists add up to the (non-negative, clamped) sizes. The rows past
    the groups, which the largest tile's launch zero-fills, are not counted (as in
    :func:`qw_tiles_cost`). Array operators only, for NumPy and traced jax arrays alike."""
    if len(set(tiles)) != len(tiles) or not tiles:
        raise ValueError(f"tiles must be distinct token tiles, got {tiles=}")
    top = max(tiles)
    full = group_sizes // chunk * chunk
    rest = group_sizes - full
    rows = []
    for t in tiles:
        lo = max((u for u in tiles if u < t), default=0)
        in_band = (rest > lo) & ((rest <= t) | (t == top))
        taken = rest * in_band.astype(rest.dtype)
        rows.append(full + taken if t == top else taken)
    return rows


# What each launch beyond the first costs when the mixed tiles make every launch of the
# ``_qw`` call work (its CTAs' setup, its last wave's tail, and its groups' weight tiles
# read and converted once more), in QW_TILE_COSTS' units per weight tile: fitted with the
# table above, about 35 us at the Nano GEMMs (one unit is ~9 us there). It also keeps the
# choice on one variant wherever mixing gains little (equal sizes of a multiple of the
# chunk cost the same either way, up to the float sums' rounding).
QW_MIXED_LAUNCH_COST = 3.8


def qw_mixed_cost(group_sizes, tiles: Sequence[int], chunk: int):
    """The modelled time of the ``_qw`` GEMM's mixed tiles (:func:`qw_tiles_cost`' units):
    every launch in ``tiles`` working on its rows (:func:`qw_band_rows`), plus
    :data:`QW_MIXED_LAUNCH_COST` for each launch beyond the first. Under router skew each
    group's short remainder runs as one tile of the smallest tile that holds it, while the
    bulk of the group still converts its weight once per ``chunk`` tokens."""
    parts = qw_band_rows(group_sizes, tiles, chunk)
    work = sum(qw_tiles_cost(rows, t) for rows, t in zip(parts, tiles))
    return work + QW_MIXED_LAUNCH_COST * (len(tiles) - 1)


# The bf16 weight gradient's tile cost in integer units (H200, equal Nano sizes: 0.586 us
# per 64-row stage of a tile's reduction, 0.82 us per output tile for its store; tools/
# skew_model.py), and the imbalance that skew adds to the static order
# (:func:`wgrad_skew_imbalance`) above which its kernel takes its tiles in the dynamic
# order (skew notes, "Sessions 37-39": on an H100 at the Nano shape the dynamic order cost
# 1-4 % with equal sizes, modelled 1.002, and saved 11-15 % at Dirichlet(0.3), 1.083).
WGRAD_STAGE_ROWS = 64
WGRAD_STAGE_COST, WGRAD_TILE_COST = 5, 7
WGRAD_DYNAMIC_IMBALANCE = 1.03


def wgrad_static_imbalance(group_sizes, group_tiles: int, ctas: int):
    """The largest CTA's modelled work over the mean, for the weight gradient's static
    tile order: group ``g`` owns tiles ``g * group_tiles ...`` (each reducing over the
    group's rows in 64-row stages, then storing), and CTA ``b`` of ``ctas`` takes tiles
    ``b, b + ctas, ...``. 1.0 for no groups.

    Each CTA gets ``group_tiles // ctas`` tiles of every group, plus one of each group
    whose ``group_tiles % ctas`` remaining tiles fall on it (a cyclic range starting at
    ``g * group_tiles % ctas``), so the work per CTA is a [G, ctas] mask product. Written
    with array operators only: a NumPy array (tests) or a traced jax array (the device-side
    choice, :func:`gemm_ffi.wgrad_tile_order`) alike; the sizes are clamped at 0.
    """
    if group_sizes.shape[0] == 0:
        _check_tiles(group_tiles, ctas)
        return 1.0
    work, _ = _wgrad_static_work(group_sizes, group_tiles, ctas)
    return work.max() / work.mean()


def wgrad_skew_imbalance(group_sizes, group_tiles: int, ctas: int):
    """The static order's largest CTA work over an estimate of what a dynamic order
    would leave: the part of its imbalance that the group sizes add, which only a
    dynamic order can remove. 1.0 for no groups and for equal sizes; the same operands
    as :func:`wgrad_static_imbalance`.

    No order beats tile granularity: 8 groups of 512 equal tiles on 132 CTAs leave some
    CTAs 32 tiles against a mean of 31.03 (1.031 at any sizes), and a CTA holding the
    costliest tile takes at least that tile. So the estimate is the larger of the mean
    work times the tile counts' own imbalance (a constant of the shape: every tile the
    same cost, computed on the host) and the costliest tile. It is not a strict lower
    bound (with few tiles of unequal cost the value can fall below 1, e.g. 0.78 for
    sizes 64, 192, 64, one tile each, on 2 CTAs); it only has to stay under the
    threshold where the static order is already as good as any, since there the
    dynamic order's claims (1-4 % on an H100) would buy nothing."""
    if group_sizes.shape[0] == 0:
        _check_tiles(group_tiles, ctas)
        return 1.0
    work, cost = _wgrad_static_work(group_sizes, group_tiles, ctas)
    granularity = wgrad_static_imbalance(np.ones(group_sizes.shape[0], np.int64), group_tiles, ctas)  # equal tiles
    spread = work.mean() * float(granularity)
    largest = cost.max()
    floor = spread + (largest - spread) * (largest > spread).astype(spread.dtype)  # max(), as array operators
    return work.max() / floor


def _check_tiles(group_tiles: int, ctas: int) -> None:
    if group_tiles < 1 or ctas < 1:
        raise ValueError(f"group_tiles and ctas must be >= 1, got {group_tiles=}, {ctas=}")


def _wgrad_static_work(group_sizes, group_tiles: int, ctas: int):
    """(work per CTA ``[ctas]``, cost of one tile per group ``[G]``) of the weight
    gradient's static order, in the integer units above (as floats)."""
    _check_tiles(group_tiles, ctas)
    num_groups = group_sizes.shape[0]
    # (Explicit casts throughout: the CUDA branch is traced under
    # jax_numpy_dtype_promotion="strict" too, which refuses int * bool.)
    sizes = group_sizes * (group_sizes > 0).astype(group_sizes.dtype)
    stages = (sizes + (WGRAD_STAGE_ROWS - 1)) // WGRAD_STAGE_ROWS
    cost = (stages * WGRAD_STAGE_COST + WGRAD_TILE_COST).astype(float)
    full, extra = divmod(group_tiles, ctas)
    first = (np.arange(num_groups) * group_tiles % ctas)[:, None]
    covers = ((np.arange(ctas)[None, :] - first) % ctas) < extra  # static [G, ctas]
    work = full * cost.sum() + (cost[:, None] * covers.astype(cost.dtype)).sum(0)
    return work, cost


def gemm_tile_n(n: int, widths: Iterable[int]) -> int:
    """The CTA tile width for ``n`` output columns among the compiled ``widths``: least
    column padding, then the widest tile. On the H200 this picked the fastest measured
    variant (up to timing noise) at every benchmark shape: 256 for N = 4096 and 1536,
    192 for N = 1856 and 2688 (docs/notes/2026-11-30-grouped-gemm-kernels.md)."""
    widths = tuple(widths)
    if not widths:
        raise ValueError("widths must name at least one compiled tile width, got widths=()")
    return min(widths, key=lambda t: (-(-n // t) * t, -t))
