"""XLA FFI bindings of the Hopper grouped GEMMs: the forward/dgrad GEMM
(``csrc/grouped_gemm.cc``, kernel ``kernels/grouped_gemm_sm90.py``), the one that
quantizes its weight (``csrc/grouped_gemm_qw.cc``, ``kernels/grouped_gemm_qw_sm90.py``),
the fused-epilogue ones, the FP8 block-scaled one and the weight gradient
(``csrc/grouped_wgrad.cc``, kernel ``kernels/grouped_wgrad_sm90.py``).

``out[m] = lhs[m] @ rhs[group(m)]`` with ``lhs [M, K]`` and ``rhs [G, K, N]`` in bf16,
fp32 accumulation, bf16 output, ``group_sizes [G]`` int32 read on the device (no host
sync; sizes are clamped to ``M``), rows at or past ``sum(group_sizes)`` zero. MXFP8
operands are dequantized to bf16 first, which is exact (``e4m3 * 2^k`` fits bf16), so
the result equals the reference's up to fp32 summation order and the final bf16
rounding. Lowers only for CUDA: dispatch through ``primitives.register_cuda_impl``.

Two layers: the bindings (``grouped_gemm_bf16_cuda``, ``grouped_wgrad_bf16_cuda``,
``grouped_gemm_fc1_cuda``, ...) check their operands once (``_checked_*``), clamp the
group sizes (the one place per kernel launch: the kernels' no-out-of-bounds guarantee
rests on sizes summing to at most M) and emit the custom call; the adapters
(``grouped_gemm_cuda``, ``grouped_wgrad_cuda``, ``fc1_fused_cuda``, ...) have the
signatures of ``primitives``' references, dequantize MXFP8 operands and call a binding.
Whatever a kernel cannot take raises :class:`ffi.Unsupported` at trace time, and the
dispatcher falls back; nothing here imports the dispatcher.

"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src.cuda import devices, ffi
from jax_grouped_mlp._src.cuda.ffi import Unsupported
from jax_grouped_mlp._src import groups
from jax_grouped_mlp._src.formats import fp8_block, mxfp8
from jax_grouped_mlp._src.formats.mxfp8 import MXFP8Tensor
from jax_grouped_mlp._src.op import activation, heuristics
from jax_grouped_mlp.kernels import registry

GROUPED_GEMM_TARGET = "jgm_grouped_gemm"
# The second result of the grouped GEMM and weight-gradient handlers: a scratch int32 (the
# dynamic tile order's counter, kernels/tile_scheduler.TileHandoff), zeroed by the handler
# before each launch: always by the weight gradient's, by the GEMM's in builds with
# JGM_DYNAMIC_TILES (unused otherwise).
TILE_COUNTER = jax.ShapeDtypeStruct((1,), jnp.int32)
# The FP8 weight gradient's second result: a zeroed int32, the order token of
# ``grouped_wgrad_cuda(with_token=True)`` (as TILE_COUNTER is for the bf16 kernel).
ORDER_TOKEN = jax.ShapeDtypeStruct((1,), jnp.int32)
GROUPED_GEMM_QW_TARGET = "jgm_grouped_gemm_qw"
GROUPED_WGRAD_TARGET = "jgm_grouped_wgrad"
_MAX = 2**31


def grouped_gemm_variants() -> tuple[str, ...]:
    """Names of the compiled forward/dgrad tile configurations (empty without the extension)."""
    names = ffi.variants("GROUPED_GEMM_VARIANTS")
    if any(registry.variant(v).family is not registry.Family.GROUPED_GEMM for v in names):
        raise RuntimeError(
            "the CUDA extension jax_grouped_mlp._kernels was built from older sources (its jgm_grouped_gemm "
            "lists the weight-quantizing variants): rebuild it (make kernels)"
        )
    return names


def grouped_gemm_qw_variants() -> tuple[str, ...]:
    """Names of the compiled GEMMs that quantize the weight to MXFP8 themselves
    (:func:`grouped_gemm_qw_cuda`; empty without the extension)."""
    return ffi.variants("GROUPED_GEMM_QW_VARIANTS")


def grouped_wgrad_variants() -> tuple[str, ...]:
    """Names of the compiled weight-gradient tile configurations (empty without the extension)."""
    return ffi.variants("GROUPED_WGRAD_VARIANTS")


def grouped_gemm_supported(m: int, n: int, k: int, g: int) -> bool:
    """Whether the kernel takes these dimensions (16-byte TMA strides, 32-bit offsets)."""
    if not all(isinstance(d, int) for d in (m, n, k, g)):
        return False  # symbolic (shape-polymorphic export): the reference handles it
    return n % 8 == 0 and k % 8 == 0 and m * k < _MAX and m * n < _MAX and g * k * n < _MAX


def tile_n(variant: str) -> int:
    """The CTA tile width (output columns per tile) of a GEMM variant, from the registry."""
    v = registry.variant(variant)
    if not isinstance(v, (registry.GemmVariant, registry.WgradVariant)):
        raise ValueError(f"variant must be a grouped GEMM variant, got {variant=}")
    return v.tile_n


def default_variant(n: int, names: tuple[str, ...] | None = None) -> str:
    """The first of ``names`` (default: the forward GEMM's variants) whose tile width
    :func:`heuristics.gemm_tile_n` picks for ``N`` output columns."""
    names = grouped_gemm_variants() if names is None else names
    if not names:
        raise RuntimeError("the CUDA extension jax_grouped_mlp._kernels is not built")
    width = heuristics.gemm_tile_n(n, (tile_n(v) for v in names))
    return next(v for v in names if tile_n(v) == width)


def _checked_bf16_pair(lhs_name: str, lhs, rhs_name: str, rhs, *, k_major: bool, note: str = "") -> tuple[int, int, int, int]:
    """``(m, n, k, g)`` of bf16 ``lhs [M, K]`` and ``rhs [G, K, N]`` (``k_major``: ``[G, N, K]``),
    or an error naming the argument: :class:`Unsupported` for another dtype, ValueError
    for a wrong rank or a contraction mismatch."""
    want = "[G, N, K]" if k_major else "[G, K, N]"
    if jnp.ndim(lhs) != 2:
        raise ValueError(f"{lhs_name} must be [M, K], got {lhs_name}.shape={jnp.shape(lhs)}")
    if jnp.ndim(rhs) != 3:
        raise ValueError(f"{rhs_name} must be {want}{note}, got {rhs_name}.shape={jnp.shape(rhs)}")
    bf16 = jnp.dtype(jnp.bfloat16)
    for name, arr in ((lhs_name, lhs), (rhs_name, rhs)):
        if jnp.dtype(arr.dtype) != bf16:
            raise Unsupported(f"{name} must be bf16, got {name}.dtype={arr.dtype}")
    m, k = lhs.shape
    g, n, k2 = (rhs.shape[0], rhs.shape[1], rhs.shape[2]) if k_major else (rhs.shape[0], rhs.shape[2], rhs.shape[1])
    if k != k2:
        raise ValueError(
            f"contraction mismatch: {lhs_name}.shape={lhs.shape} vs {rhs_name}.shape={rhs.shape} ({rhs_name} is {want})"
        )
    return m, n, k, g


def _checked_supported(what: str, m, n, k, g) -> None:
    """:class:`Unsupported` unless the GEMM kernels take these dimensions (:func:`grouped_gemm_supported`)."""
    if not grouped_gemm_supported(m, n, k, g):
        raise Unsupported(
            f"{what} needs static N, K multiples of 8 and < 2^31 elements per operand, got {m=} {n=} {k=} {g=}"
        )


def _checked_group_sizes(group_sizes, g: int, m: int) -> jax.Array:
    """``group_sizes`` as int32 ``[G]`` clamped to ``M`` rows (``groups.clamp_group_sizes``:
    the kernel never forms a running sum past M), or a TypeError naming it.

    This is where the kernels' no-out-of-bounds guarantee is kept: every binding calls
    it once, right before its custom call, whoever called the binding."""
    group_sizes = jnp.asarray(groups.host_clip(group_sizes))
    if group_sizes.shape != (g,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(
            f"group_sizes must be integer [{g}], got group_sizes.shape={group_sizes.shape} "
            f"group_sizes.dtype={group_sizes.dtype}"
        )
    return groups.clamp_group_sizes(group_sizes, m)


def _checked_probs(probs, m: int) -> jax.Array:
    """``probs`` as float32 ``[M]``, or an error naming it."""
    probs = jnp.asarray(probs)
    if probs.shape != (m,):
        raise ValueError(f"probs must be [M] = [{m}], got probs.shape={probs.shape}")
    if not jnp.issubdtype(probs.dtype, jnp.floating) or jnp.dtype(probs.dtype).itemsize > 4:
        raise TypeError(f"probs must be float32 (or a narrower float), got probs.dtype={probs.dtype}")
    return probs.astype(jnp.float32)


def _variant_index(names: tuple[str, ...], n: int, variant: str | None, fits, what: str) -> np.int32:
    """The ``variant`` attribute: ``variant`` (checked) or :func:`default_variant` among those that ``fits``."""
    if variant is None:
        variant = default_variant(n, tuple(v for v in names if fits(v)))
    if variant not in names or not fits(variant):
        raise ValueError(f"{variant=} is not one of the compiled {names} for {what}")
    return np.int32(names.index(variant))


def grouped_gemm_bf16_cuda(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    variant: str | None = None,
    transpose_rhs: bool = False,
) -> jax.Array:
    """The kernel on bf16 operands: ``lhs [M, K]``, ``rhs [G, K, N]`` -> bf16 ``[M, N]``.

    ``transpose_rhs``: ``rhs`` is ``[G, N, K]`` and ``out[m] = lhs[m] @ rhs[g]^T`` (a
    variant with ``rhs_k_major`` reads it K-major as stored: no transpose pass).
    """
    if not ffi.available():
        raise RuntimeError("the CUDA extension jax_grouped_mlp._kernels is not built")
    m, n, k, g = _checked_bf16_pair("lhs", lhs, "rhs", rhs, k_major=transpose_rhs)
    _checked_supported("grouped GEMM kernel", m, n, k, g)
    group_sizes = _checked_group_sizes(group_sizes, g, m)
    names = grouped_gemm_variants()
    index = _variant_index(
        names, n, variant, lambda v: registry.variant(v).rhs_k_major == transpose_rhs, f"{transpose_rhs=}"
    )
    out = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    # The second result is the kernel's scratch (the dynamic tile order's counter).
    result, _ = jax.ffi.ffi_call(GROUPED_GEMM_TARGET, (out, TILE_COUNTER))(lhs, rhs, group_sizes, variant=index)
    return result


def qw_tile_tokens(variant: str) -> int:
    """Tokens per CTA tile of a variant that quantizes its weight, from the registry."""
    v = registry.variant(variant)
    if v.family is not registry.Family.GROUPED_GEMM_QW:
        raise ValueError(f"variant must be a _qw grouped GEMM variant (not a _qw one: {variant!r})")
    return v.tile_tokens


# For measurements: JGM_QW_MIXED_TILES=0, read when a program is traced, keeps the ``_qw``
# GEMM's device-side choice to one variant (no mixed tiles), to time both in one process.
def _mixed_tiles_allowed() -> bool:
    value = os.environ.get("JGM_QW_MIXED_TILES", "1") or "1"
    if value not in ("0", "1"):
        raise ValueError(f"JGM_QW_MIXED_TILES must be 0 or 1, got {value!r}")
    return value == "1"


def qw_options(variants: tuple[str, ...], mixed: bool = True) -> np.ndarray:
    """The ``choice`` values of one call over ``variants``, ``[options, 2]`` int32: ``(i, 0)``
    for variant ``i`` alone, then (``mixed``, with more than one variant) ``(i, 1)``, the
    mixed tiles, every variant working on its band of each group
    (:func:`heuristics.qw_band_rows`; ``i``, the largest tile's index, is then unused)."""
    options = [(i, 0) for i in range(len(variants))]
    if mixed and len(variants) > 1:
        tiles = [qw_tile_tokens(v) for v in variants]
        options.append((tiles.index(max(tiles)), 1))
    return np.asarray(options, np.int32).reshape(-1, 2)


def qw_choice(group_sizes: jax.Array, variants: tuple[str, ...]) -> jax.Array:
    """``[2]`` int32 on the device: the :func:`qw_options` row with the least modelled
    time for these (clamped) group sizes (:func:`heuristics.qw_tiles_cost` for one
    variant, :func:`heuristics.qw_mixed_cost` for the mixed tiles; the first of equals, so
    one variant wherever mixing gains nothing). A few integer ops in XLA: no host sync."""
    sizes = jnp.maximum(jnp.asarray(group_sizes, jnp.int32), 0)
    options = qw_options(variants, _mixed_tiles_allowed())
    tiles = [qw_tile_tokens(v) for v in variants]
    costs = [heuristics.qw_tiles_cost(sizes, tiles[i]) if not mixed
             else heuristics.qw_mixed_cost(sizes, tiles, registry.QW_CHUNK_TOKENS) for i, mixed in options]
    return jnp.asarray(options)[jnp.argmin(jnp.stack(costs))]


def grouped_gemm_qw_cuda(
    lhs: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    variant: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """``out[m] = lhs[m] @ fake_quantize(w[g])`` in one kernel (``kernels/grouped_gemm_qw_sm90.py``).

    ``lhs [M, K]`` bf16 (already the MXFP8 values, as :func:`grouped_gemm_bf16_cuda`
    takes them), ``w [G, K, N]`` bf16 as stored (``transpose_rhs``: ``[G, N, K]``, used
    transposed), quantized to MXFP8 along K inside the kernel (in registers; the t384
    variants write it back to shared memory for both token halves): the
    same numbers as ``grouped_gemm_bf16_cuda(lhs, dequantize(quantize_mxfp8(w,
    axis=K)))`` up to fp32 summation order, without the pass that writes the
    quantized weight. bf16 ``[M, N]`` out.

    ``variant``: one compiled variant by name, or a tuple of several with distinct token
    tiles (the mixed tiles, each on its band of every group:
    :func:`heuristics.qw_band_rows`); by default the tiles are chosen on the device from
    the group sizes (:func:`qw_choice`): the call launches every compiled variant of this
    weight layout and, unless the mixed tiles are chosen, all but one exit at once (a few
    microseconds each). Every choice gives the same bits.
    """
    if not ffi.available():
        raise RuntimeError("the CUDA extension jax_grouped_mlp._kernels is not built")
    m, n, k, g = _checked_bf16_pair("lhs", lhs, "w", w, k_major=transpose_rhs)
    _checked_supported("grouped GEMM kernel", m, n, k, g)
    group_sizes = _checked_group_sizes(group_sizes, g, m)
    names = grouped_gemm_qw_variants()
    fits = tuple(v for v in names if registry.variant(v).rhs_k_major == transpose_rhs)
    if not fits:
        raise Unsupported(f"no _qw grouped GEMM variant is compiled for {transpose_rhs=}")
    forced = (variant,) if isinstance(variant, str) else variant
    if forced is not None:
        if not (isinstance(forced, tuple) and forced and all(v in fits for v in forced)):
            raise ValueError(f"{variant=} must be one or a tuple of the compiled {fits} for {transpose_rhs=}")
        if len({qw_tile_tokens(v) for v in forced}) != len(forced):
            raise ValueError(f"{variant=}: the mixed tiles need distinct token tiles")
    chosen = fits if forced is None else forced
    if forced is None and len(chosen) > 1:
        choice = qw_choice(group_sizes, chosen)
    else:
        choice = jnp.asarray([0, int(len(chosen) > 1)], jnp.int32)
    return _grouped_gemm_qw_call(lhs, w, group_sizes, choice, chosen, n)


def _grouped_gemm_qw_call(lhs, w, group_sizes, choice, variants: tuple[str, ...], n: int) -> jax.Array:
    """The custom call (checked operands, ``n`` output columns): launches ``variants``
    (all of one weight layout, distinct token tiles) in order, the ones ``choice`` names
    working (``[2]`` int32 on the device, a :func:`qw_options` row; the kernels clamp the
    first into range and take any second value but 1 as one variant)."""
    names = grouped_gemm_qw_variants()
    attr = np.asarray([names.index(v) for v in variants], np.int32)
    out = jax.ShapeDtypeStruct((lhs.shape[0], n), jnp.bfloat16)
    return jax.ffi.ffi_call(GROUPED_GEMM_QW_TARGET, out)(lhs, w, group_sizes, choice, variants=attr)


def _as_bf16(x, name: str = "x") -> jax.Array:
    if isinstance(x, MXFP8Tensor):
        return ffi.dequantize_cuda(x)  # exact; a kernel for the kept group-aware residuals
    if isinstance(x, fp8_block.FP8BlockTensor):
        return fp8_block.dequantize_fp8_block(x, jnp.bfloat16)  # exact (E4M3 x 2^e fits bf16)
    if isinstance(x, fp8_block.TokenMajorBlocks):
        return fp8_block.dequantize_fp8_block(fp8_block.from_token_major(x, name), jnp.bfloat16)
    return x


def _checked_bf16_out(out_dtype) -> None:
    """:class:`Unsupported` unless ``out_dtype`` is bfloat16 (what the GEMM kernels write)."""
    if jnp.dtype(out_dtype) != jnp.dtype(jnp.bfloat16):
        raise Unsupported(f"the grouped GEMM kernels write bfloat16, got out_dtype={jnp.dtype(out_dtype)}")


def grouped_gemm_cuda(lhs, rhs, group_sizes: jax.Array, *, out_dtype, transpose_rhs: bool = False) -> jax.Array:
    """``primitives`` "grouped_gemm" on CUDA (same signature as the reference).

    Takes MXFP8 (dequantized first, exactly), bf16, or ``fp8_block`` operands. An
    ``fp8_block`` pair in the recipe's layouts (``lhs`` 1 x 128 blocks along K, ``rhs``
    a weight in 128 x 128 tiles) runs the FP8 block-scaled kernel
    (:func:`_fp8_block_pair`); any other ``fp8_block`` operand is dequantized (exact)
    for the bf16 kernel. :class:`Unsupported` (trace time) when the output is not bf16,
    an operand is none of these, or the shape is outside :func:`grouped_gemm_supported`.
    """
    _checked_bf16_out(out_dtype)
    pair = _fp8_block_pair(lhs, rhs, transpose_rhs)
    if pair is not None:
        return grouped_gemm_fp8_block(*pair, group_sizes)
    return grouped_gemm_bf16_cuda(_as_bf16(lhs), _as_bf16(rhs), group_sizes, transpose_rhs=transpose_rhs)


def _fp8_block_pair(lhs, rhs, transpose_rhs: bool):
    """``(lhs, rhs [G, N, K])`` for :func:`grouped_gemm_fp8_block` when ``lhs @ rhs`` (or
    ``rhs^T`` with ``transpose_rhs``) can run on it, else None.

    The kernel reads the weight K-major: a dgrad (``transpose_rhs``) reads the stored
    ``[G, N, K]`` weight as is; a forward GEMM's ``[G, K, N]`` weight gets its exact
    transposed copy (:func:`fp8_block.transpose_tiles`, one FP8 pass over the weight).
    """
    fp8 = fp8_block.FP8BlockTensor
    if not (isinstance(lhs, fp8) and isinstance(rhs, fp8) and grouped_gemm_fp8_block_variants()):
        return None
    if lhs.is_grouped or lhs.blocked_axes != (1,) or rhs.is_grouped or rhs.blocked_axes != (1, 2):
        return None
    rhs_nk = rhs if transpose_rhs else fp8_block.transpose_tiles(rhs)
    m, k = lhs.data.shape
    _, n, k2 = rhs_nk.data.shape
    if not all(isinstance(d, int) for d in (m, n, k, k2)):
        return None  # symbolic (shape-polymorphic export): the bf16 path decides (Unsupported there)
    if k != k2 or k % 16 or n % 8 or m * k >= _MAX or m * n >= _MAX or rhs_nk.data.size >= _MAX:
        return None
    return lhs, rhs_nk


def grouped_gemm_qw_impl(lhs, w: jax.Array, group_sizes: jax.Array, *, out_dtype, transpose_rhs: bool = False):
    """``primitives`` "grouped_gemm_qw" on CUDA (same signature as the reference).

    The in-register weight quantization when the operands are bf16 (or ``lhs`` MXFP8),
    the output bf16, the shape supported and a ``_qw`` variant compiled; otherwise
    :class:`Unsupported` (the dispatcher then runs the weight's fake-quantize pass and
    ``grouped_gemm``: the same numbers).
    """
    _checked_bf16_out(out_dtype)
    if not grouped_gemm_qw_variants():
        raise Unsupported("no _qw grouped GEMM variant is compiled")
    return grouped_gemm_qw_cuda(_as_bf16(lhs), w, group_sizes, transpose_rhs=transpose_rhs)


def _wgrad_out_dtype(variant: str) -> jnp.dtype:
    return jnp.dtype(registry.variant(variant).out_dtype)


def grouped_wgrad_bf16_cuda(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    variant: str | None = None,
    with_token: bool = False,
):
    """The weight-gradient kernel: ``out[g] = lhs_g^T @ rhs_g`` -> ``[G, K, N]`` in ``out_dtype``.

    ``lhs [M, K]`` and ``rhs [M, N]`` bf16; ``out_dtype`` bfloat16 or float32 (one
    rounding of the fp32 sums either way). fp32 accumulation in a fixed order (bitwise
    reproducible), empty groups give zeros, rows past ``sum(group_sizes)`` (clamped
    to ``M``) do not contribute. ``with_token``: ``(out, token)``, the token the
    kernel's int32 ``[1]`` scratch result (``primitives.grouped_wgrad``).
    """
    if not ffi.available():
        raise RuntimeError("the CUDA extension jax_grouped_mlp._kernels is not built")
    if lhs.ndim != 2 or rhs.ndim != 2:
        raise ValueError(f"need lhs [M, K] and rhs [M, N], got {lhs.shape=} {rhs.shape=}")
    m, k = lhs.shape
    m2, n = rhs.shape
    if m != m2:
        raise ValueError(f"row mismatch: {lhs.shape=} vs {rhs.shape=}")
    bf16 = jnp.dtype(jnp.bfloat16)
    if jnp.dtype(lhs.dtype) != bf16 or jnp.dtype(rhs.dtype) != bf16:
        raise Unsupported(f"operands must be bf16, got {lhs.dtype=} {rhs.dtype=}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in (bf16, jnp.dtype(jnp.float32)):
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    g = jnp.shape(group_sizes)[0] if jnp.ndim(group_sizes) == 1 else 0  # else a TypeError below
    _checked_supported("grouped wgrad kernel", m, n, k, g)
    group_sizes = _checked_group_sizes(group_sizes, g, m)
    index = _variant_index(
        grouped_wgrad_variants(), n, variant, lambda v: _wgrad_out_dtype(v) == out_dtype, f"{out_dtype=}"
    )
    out = jax.ShapeDtypeStruct((g, k, n), out_dtype)
    group_tiles = -(-k // 128) * -(-n // tile_n(grouped_wgrad_variants()[index]))
    order = wgrad_tile_order(group_sizes, group_tiles)
    result, scratch = jax.ffi.ffi_call(GROUPED_WGRAD_TARGET, (out, TILE_COUNTER))(
        lhs, rhs, group_sizes, order, variant=index
    )
    return (result, scratch) if with_token else result


# For measurements (the skew notes, "Sessions 37-39"): JGM_WGRAD_TILE_ORDER=static or
# dynamic, read when a program is traced, forces the weight gradient's tile order (to time
# one against the other in one process); "auto" or unset chooses from the group sizes on
# the device.
WGRAD_TILE_ORDERS = ("auto", "static", "dynamic")


def wgrad_tile_order(group_sizes: jax.Array, group_tiles: int) -> jax.Array:
    """``[1]`` int32 on the device: 1 where the weight gradient should take its tiles in
    the dynamic order (the imbalance that these clamped sizes' skew adds to the static
    order, :func:`heuristics.wgrad_skew_imbalance`, above
    :data:`heuristics.WGRAD_DYNAMIC_IMBALANCE`), else 0. A few array ops in XLA
    (microseconds), no host sync."""
    forced = os.environ.get("JGM_WGRAD_TILE_ORDER", "auto") or "auto"
    if forced not in WGRAD_TILE_ORDERS:
        raise ValueError(f"JGM_WGRAD_TILE_ORDER must be one of {WGRAD_TILE_ORDERS}, got {forced!r}")
    if forced != "auto":
        return jnp.full((1,), int(forced == "dynamic"), jnp.int32)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    imbalance = heuristics.wgrad_skew_imbalance(sizes, group_tiles, devices.sm_count())
    # (no groups: a Python float, so jnp.asarray)
    return jnp.asarray(imbalance > heuristics.WGRAD_DYNAMIC_IMBALANCE, jnp.int32).reshape(1)


def grouped_wgrad_cuda(lhs, rhs, group_sizes: jax.Array, *, out_dtype, with_token: bool = False):
    """``primitives`` "grouped_wgrad" on CUDA (same signature as the reference).

    Two group-aware ``fp8_block`` operands run the FP8 weight-gradient kernel
    (:func:`grouped_wgrad_fp8_block`) when it is compiled and the shape fits; other
    quantized operands (MXFP8, or a single ``fp8_block`` one) are dequantized to bf16
    first (exact) for the bf16 kernel. Either writes bfloat16 or float32 (float32
    master weights get full float32 sums); another ``out_dtype`` gets the float32
    result cast. Shapes outside :func:`grouped_gemm_supported` or non-bf16 operands:
    :class:`Unsupported`. ``with_token``: ``(out, token)`` (``primitives.grouped_wgrad``;
    the token is the kernel call's second result: a scratch result or a zeroed one).
    """
    bf16 = jnp.dtype(jnp.bfloat16)
    kernel_dtype = bf16 if jnp.dtype(out_dtype) == bf16 else jnp.dtype(jnp.float32)
    if _fp8_block_wgrad_pair(lhs, rhs, group_sizes):
        out, token = grouped_wgrad_fp8_block(lhs, rhs, group_sizes, out_dtype=kernel_dtype, with_token=True)
    else:
        out, token = grouped_wgrad_bf16_cuda(
            _as_bf16(lhs, "lhs"), _as_bf16(rhs, "rhs"), group_sizes, out_dtype=kernel_dtype, with_token=True
        )
    out = out.astype(out_dtype)
    return (out, token) if with_token else out


def _grouped_dims(t) -> tuple:
    """``(M, K)`` of a group-aware ``fp8_block`` operand, in either layout."""
    if isinstance(t, fp8_block.TokenMajorBlocks):
        return t.rows, t.data.shape[0]
    return tuple(t.data.shape)


def _fp8_block_wgrad_pair(lhs, rhs, group_sizes) -> bool:
    """Whether ``lhs`` and ``rhs`` are group-aware ``fp8_block`` operands (``[M, K]``
    tensors or already token-major) the FP8 weight-gradient kernel takes (compiled;
    static shapes within its contract, :func:`heuristics.fp8_wgrad_fits`; quantized with as many
    groups as ``group_sizes`` has)."""
    kinds = (fp8_block.FP8BlockTensor, fp8_block.TokenMajorBlocks)
    if not all(isinstance(t, kinds) and t.is_grouped for t in (lhs, rhs)):
        return False
    if not grouped_wgrad_fp8_block_variants() or jnp.ndim(group_sizes) != 1:
        return False
    (m, k), (m2, n) = _grouped_dims(lhs), _grouped_dims(rhs)
    g = jnp.shape(group_sizes)[0]
    rows = fp8_block.grouped_scale_rows(m, g) if isinstance(m, int) and isinstance(g, int) else None
    return (m == m2 and heuristics.fp8_wgrad_fits(m, k, n, g)
            and lhs.scale.shape[0] == rows and rhs.scale.shape[0] == rows)  # fmt: skip


# ---- FC1 with the fused epilogue (csrc/grouped_gemm_fc1.cc) ----
# GPU-tested on the H200; mlp.py uses it through primitives.fc1_fused (fuse_fc1_epilogue).

GROUPED_GEMM_FC1_TARGET = "jgm_grouped_gemm_fc1"


def grouped_gemm_fc1_variants() -> tuple[str, ...]:
    """Names of the compiled FC1-epilogue GEMM configurations (empty without the extension)."""
    return ffi.variants("GROUPED_GEMM_FC1_VARIANTS")


def _fc1_operands(x, w1, group_sizes, probs):
    """Validates :func:`grouped_gemm_fc1_cuda`'s operands; returns (m, n, k, g, probs f32, sizes int32)."""
    m, n, k, g = _checked_bf16_pair("x", x, "w1", w1, k_major=False)
    _checked_supported("grouped_gemm_fc1", m, n, k, g)
    if mxfp8.grouped_scale_rows(m, g) * n >= _MAX:
        raise Unsupported(f"grouped_gemm_fc1: a_col's scales need < 2^31 elements, got {m=} {n=} {g=}")
    group_sizes = _checked_group_sizes(group_sizes, g, m)
    probs = _checked_probs(probs, m)
    return m, n, k, g, probs, group_sizes


def grouped_gemm_fc1_cuda(
    x: jax.Array,
    w1: jax.Array,
    group_sizes: jax.Array,
    probs: jax.Array,
    *,
    variant: str | None = None,
) -> tuple[jax.Array, jax.Array, MXFP8Tensor]:
    """FC1 with the fused epilogue: ``(h, a_row, a_col)`` from one kernel.

    ``h = grouped GEMM(x, w1)`` (bf16 ``[M, N]``, bitwise what :func:`grouped_gemm_bf16_cuda`
    writes), and with ``a = activation.srelu_scaled(h, probs)`` (``bf16(probs * relu(h)**2)``,
    float32 math): ``a_row`` the rowwise MXFP8 values of ``a`` in bf16 and ``a_col`` the
    group-aware columnwise :class:`MXFP8Tensor`, i.e. bit for bit
    ``mxfp8.fake_quantize_pair(a, group_sizes, keep_col_fp8=True)``.

    ``x`` bf16 ``[M, K]``, ``w1`` bf16 ``[G, K, N]``, ``group_sizes`` int ``[G]``, ``probs``
    float ``[M]`` (cast to float32). N and K multiples of 8. G == 0 or K == 0 (static)
    is computed here in JAX (the kernel needs non-empty TMA dimensions).
    """
    m, n, k, g, probs, gs = _fc1_operands(x, w1, group_sizes, probs)
    if not ffi.available():
        raise RuntimeError("the CUDA extension jax_grouped_mlp._kernels is not built")
    if g == 0 or k == 0:
        h = jnp.zeros((m, n), jnp.bfloat16)
        a_row, a_col = mxfp8.fake_quantize_pair(activation.srelu_scaled(h, probs), gs, keep_col_fp8=True)
        return h, a_row, a_col
    index = _variant_index(grouped_gemm_fc1_variants(), n, variant, lambda v: True, "the FC1 epilogue")
    nb = mxfp8.grouped_scale_rows(m, g)
    out = (
        jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((m, n), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((nb, n), jnp.float8_e8m0fnu),
    )
    h, a_row, col, col_scale = jax.ffi.ffi_call(GROUPED_GEMM_FC1_TARGET, out)(x, w1, gs, probs, variant=index)
    return h, a_row, MXFP8Tensor(col, col_scale, axis=0, group_sizes=gs)


def fc1_fused_cuda(lhs, rhs, group_sizes: jax.Array, probs: jax.Array):
    """``primitives`` "fc1_fused" on CUDA (same signature as the reference).

    The FC1-epilogue kernel when both operands are (or dequantize to) bf16 and the shape
    fits :func:`grouped_gemm_supported`; otherwise :class:`Unsupported` (the dispatcher
    then composes the unfused primitives).
    """
    return grouped_gemm_fc1_cuda(_as_bf16(lhs), _as_bf16(rhs), group_sizes, probs)


# ---- FC2 dgrad with the fused dSReLU epilogue (csrc/grouped_gemm_dgrad.cc) ----
# mlp.py uses it through primitives.dgrad_fused.

GROUPED_GEMM_DGRAD_TARGET = "jgm_grouped_gemm_dgrad"


def grouped_gemm_dgrad_variants() -> tuple[str, ...]:
    """Names of the compiled dgrad-epilogue GEMM configurations (empty without the extension)."""
    return ffi.variants("GROUPED_GEMM_DGRAD_VARIANTS")


def _dgrad_operands(dy_row, w2, group_sizes, h, probs):
    """Validates :func:`grouped_gemm_dgrad_cuda`'s operands; returns (m, n, k, g, probs f32, sizes int32)."""
    m, n, k, g = _checked_bf16_pair("dy_row", dy_row, "w2", w2, k_major=True, note=" (the FC2 weight [G, F, H] as stored)")
    if jnp.ndim(h) != 2 or tuple(jnp.shape(h)) != (m, n):
        raise ValueError(f"h must be [M, N] = [{m}, {n}], got h.shape={jnp.shape(h)}")
    if jnp.dtype(h.dtype) != jnp.dtype(jnp.bfloat16):
        raise Unsupported(f"h must be bf16, got h.dtype={h.dtype}")
    _checked_supported("grouped_gemm_dgrad", m, n, k, g)
    group_sizes = _checked_group_sizes(group_sizes, g, m)
    probs = _checked_probs(probs, m)
    return m, n, k, g, probs, group_sizes


def grouped_gemm_dgrad_cuda(
    dy_row: jax.Array,
    w2: jax.Array,
    group_sizes: jax.Array,
    h: jax.Array,
    probs: jax.Array,
    *,
    variant: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """FC2 dgrad with the fused dSReLU epilogue: ``(dh_row, dh_col, dprobs)`` from one kernel.

    With ``da = grouped_gemm_bf16_cuda(dy_row, w2, group_sizes, transpose_rhs=True)`` (bf16,
    the same tile width's accumulation order; never written to memory), ``r = relu(f32(h))``:
    ``dh = bf16((f32(da) * (2 * probs)) * r)`` (``mlp._mlp_bwd``'s order), ``(dh_row, dh_col)
    = mxfp8.fake_quantize_pair(dh, group_sizes, keep_col_fp8=False)`` bit for bit (both bf16
    ``[M, N]``), and ``dprobs = sum_n f32(da) * (r * r)`` (float32 ``[M]``, summed in a fixed
    order: reproducible bit for bit, not bitwise ``jnp.sum``'s). Rows past
    ``sum(group_sizes)`` (clamped to M): ``dh_row``, ``dh_col`` and ``dprobs`` are +0.

    ``dy_row`` bf16 ``[M, K]`` (MXFP8 values of ``dy`` in bf16), ``w2`` bf16 ``[G, N, K]`` (the
    FC2 weight ``[G, F, H]`` as stored, K = H), ``group_sizes`` int ``[G]``, ``h`` bf16
    ``[M, N]`` (the ``activation_input`` residual), ``probs`` float ``[M]`` (cast to float32).
    N and K multiples of 8. G == 0 or K == 0 (static) is computed here in JAX.
    """
    m, n, k, g, probs, gs = _dgrad_operands(dy_row, w2, group_sizes, h, probs)
    if not ffi.available():
        raise RuntimeError("the CUDA extension jax_grouped_mlp._kernels is not built")
    if g == 0 or k == 0:
        # da = 0 exactly; the groups' rows get the reference's bf16(0 * 2p * r) (signed
        # zeros, NaN for non-finite h or probs), rows past the groups zeros, as the kernel.
        total = jnp.sum(gs)  # gs is clamped: its sum is at most M
        valid = jnp.arange(m, dtype=jnp.int32) < total
        dh, dprobs = activation.srelu_scaled_grad(jnp.zeros((m, n), jnp.bfloat16), h, probs)
        dprobs = jnp.where(valid, dprobs, 0.0)
        dh = jnp.where(valid[:, None], dh, jnp.zeros((), jnp.bfloat16))
        dh_row, dh_col = mxfp8.fake_quantize_pair(dh, gs, keep_col_fp8=False)
        return dh_row, dh_col, dprobs
    names = grouped_gemm_dgrad_variants()
    index = _variant_index(names, n, variant, lambda v: True, "the dgrad epilogue")
    nt = -(-n // tile_n(names[index]))
    if nt * m >= _MAX:
        raise Unsupported(f"grouped_gemm_dgrad: the dprobs partials [{nt}, {m}] need < 2^31 elements")
    out = (
        jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((nt, m), jnp.float32),
    )
    dh_row, dh_col, dpart = jax.ffi.ffi_call(GROUPED_GEMM_DGRAD_TARGET, out)(
        dy_row, w2, gs, h, probs, variant=index
    )
    # The column tiles' partial sums, added in tile order (elementwise adds: no reduction
    # whose order XLA could choose).
    dprobs = jnp.zeros((m,), jnp.float32) if nt == 0 else dpart[0]
    for t in range(1, nt):
        dprobs = dprobs + dpart[t]
    return dh_row, dh_col, dprobs


def dgrad_fused_cuda(dy_row, w2, group_sizes: jax.Array, h: jax.Array, probs: jax.Array):
    """``primitives`` "dgrad_fused" on CUDA (same signature as the reference).

    The dgrad-epilogue kernel when the operands are (or dequantize to) bf16 and the shape
    fits :func:`grouped_gemm_supported`; otherwise :class:`Unsupported` (the dispatcher
    then composes the unfused primitives).
    """
    return grouped_gemm_dgrad_cuda(_as_bf16(dy_row), _as_bf16(w2), group_sizes, h, probs)


# ---- the FP8 block-scaled GEMM (GPU-tested on the H200; recipe="fp8_block" reaches it
# through grouped_gemm_cuda / _fp8_block_pair) ----

GROUPED_GEMM_FP8_BLOCK_TARGET = "jgm_grouped_gemm_fp8_block"


def grouped_gemm_fp8_block_variants() -> tuple[str, ...]:
    """Names of the compiled FP8 block-scaled GEMMs (empty without the extension)."""
    return ffi.variants("GROUPED_GEMM_FP8_BLOCK_VARIANTS")


def fp8_block_default_variant(
    n: int, names: tuple[str, ...], family: registry.Family = registry.Family.GROUPED_GEMM_FP8_BLOCK
) -> str | None:
    """The FP8 block-scaled GEMM for ``N`` output columns: the widest tile that covers N
    with no more 128-column blocks than N needs (``cdiv(N, 128)`` a multiple of its
    width / 128: no tile with a skipped half), else the first of ``names``.

    A 256-wide tile (two 128-column halves sharing the A stage) was 4 % faster at
    8 x (8192 x 4096 -> 4096) and 4 % slower at Nano FC1 (N = 1856, whose last tile
    has its second half skipped) on the H200 (``benchmarks/results/fp8_block_gemm_n256_h200.json``).
    ``family``: whose variants ``names`` are (the FC1-epilogue kernels are picked alike).
    """
    known = [v for v in names if v in registry.names(family)]
    blocks = -(-n // 128)
    fits = [v for v in known if blocks % (registry.variant(v).tile_n // 128) == 0]
    if fits:
        return max(fits, key=lambda v: registry.variant(v).tile_n)
    return names[0] if names else None


def _checked_fp8_block_operand(name: str, t, rank: int, axes: tuple[int, ...], layout: str) -> None:
    """``t`` is a plain (not group-aware) :class:`FP8BlockTensor` of ``rank`` blocked over
    ``axes`` with consistent fields, or a TypeError/ValueError naming ``name``."""
    if not isinstance(t, fp8_block.FP8BlockTensor):
        raise TypeError(f"{name} must be an FP8BlockTensor ({layout}), got {name}={type(t).__name__}")
    if t.is_grouped or jnp.ndim(t.data) != rank or t.blocked_axes != axes:
        raise ValueError(
            f"{name} must be {layout}: rank {rank}, blocked over axes={axes}, not group-aware; got "
            f"{name}.data.shape={jnp.shape(t.data)} {name}.axes={t.blocked_axes} grouped={t.is_grouped}"
        )
    fp8_block._check_tensor(t, name)


def checked_fp8_block_gemm_operands(lhs, rhs) -> tuple[int, int, int, int]:
    """``(M, K, G, N)`` of an FP8 block-scaled GEMM's operands (``lhs [M, K]`` in 1 x 128
    blocks, ``rhs [G, N, K]`` in 128 x 128 tiles, static shapes, the same K, K % 16 == 0
    and N % 8 == 0), or a TypeError/ValueError naming the argument."""
    _checked_fp8_block_operand("lhs", lhs, 2, (1,), "[M, K] blocked along K (quantize_fp8_block(x, axis=1))")
    _checked_fp8_block_operand(
        "rhs", rhs, 3, (1, 2), "[G, N, K] in 128 x 128 tiles (quantize_fp8_block(w, axis=(1, 2)))"
    )
    m, k = lhs.data.shape
    g, n, k2 = rhs.data.shape
    if not all(isinstance(d, int) for d in (m, k, g, n, k2)):
        raise ValueError(f"lhs and rhs must have static shapes, got {lhs.data.shape=} {rhs.data.shape=}")
    if k != k2:
        raise ValueError(
            f"contraction mismatch: lhs.data.shape={lhs.data.shape} vs rhs.data.shape={rhs.data.shape} "
            "(rhs is [G, N, K])"
        )
    if k % 16:
        raise ValueError(f"lhs: K must be a multiple of 16 (16-byte FP8 rows), got K={k} (lhs.data.shape={lhs.data.shape})")
    if n % 8:
        raise ValueError(f"rhs: N must be a multiple of 8 (16-byte bf16 output rows), got N={n} (rhs.data.shape={rhs.data.shape})")
    return m, k, g, n


def as_e8m0(scale: jax.Array) -> jax.Array:
    """E8M0 scale bytes as the ``float8_e8m0fnu`` the FFI handlers take (a bitcast of uint8)."""
    if jnp.dtype(scale.dtype) == jnp.dtype(jnp.float8_e8m0fnu):
        return scale
    return jax.lax.bitcast_convert_type(scale, jnp.float8_e8m0fnu)


def grouped_gemm_fp8_block(
    lhs: fp8_block.FP8BlockTensor,
    rhs: fp8_block.FP8BlockTensor,
    group_sizes: jax.Array,
    *,
    variant: str | None = None,
) -> jax.Array:
    """``out[m] = lhs[m] @ rhs[g(m)]^T`` on FP8 block-scaled operands, bf16 ``[M, N]``
    (``kernels/grouped_gemm_fp8_block_sm90.py``; CUDA only; ``grouped_mlp``'s ``fp8_block``
    recipe calls it through :func:`grouped_gemm_cuda`).

    Args:
      lhs: ``quantize_fp8_block(x, axis=1)`` of ``x [M, K]``: E4M3 data, one E8M0 scale
        per 1 x 128 block along K (scale ``[M, cdiv(K, 128)]``).
      rhs: a weight stored K-major, ``[G, N, K]``, quantized over ``axis=(1, 2)`` (one scale
        per 128 x 128 tile, scale ``[G, cdiv(N, 128), cdiv(K, 128)]``). Hopper's FP8 wgmma
        reads both operands K-major: a ``[G, K, N]`` weight needs
        :func:`fp8_block.transpose_tiles` first (exact, and the blocks are the same).
      group_sizes: ``[G]`` integers on the device; clamped to ``M``; rows at or past
        their (clamped) sum are zero.
      variant: a name of :func:`grouped_gemm_fp8_block_variants` (default:
        :func:`fp8_block_default_variant`, the 256-wide tile when no tile would skip a half).

    Shape contract: static sizes, ``K % 16 == 0`` and ``N % 8 == 0`` (TMA's 16-byte row
    strides), fewer than 2^31 elements per operand. K and N need not be multiples of 128:
    the last block is partial, zero-padded by the kernel's loads exactly as the quantizer
    pads it.

    Numerics: each 128-wide K block is one FP8 wgmma reduction (exact products; Hopper's
    internal FP8 accumulation), scaled by ``lhs_scale * rhs_scale`` in float32 and added
    into a float32 accumulator; the result is rounded once to bf16.

    Raises:
      TypeError, ValueError: naming the argument (not an FP8BlockTensor, wrong layout or
        blocking, contraction mismatch, K or N off the contract, too large).
      RuntimeError: the extension is not built.
    """
    m, k, g, n = checked_fp8_block_gemm_operands(lhs, rhs)
    if m * k >= _MAX or m * n >= _MAX or g * n * k >= _MAX:
        raise ValueError(f"lhs, rhs: every operand must have fewer than 2^31 elements, got {m=} {n=} {k=} {g=}")
    if not ffi.available():
        raise RuntimeError("the CUDA extension jax_grouped_mlp._kernels is not built")
    group_sizes = _checked_group_sizes(group_sizes, g, m)
    names = grouped_gemm_fp8_block_variants()
    if variant is None:
        variant = fp8_block_default_variant(n, names)
    if variant not in names:
        raise ValueError(f"variant must be one of the compiled {names}, got {variant=}")

    out = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    return jax.ffi.ffi_call(GROUPED_GEMM_FP8_BLOCK_TARGET, out)(
        lhs.data, as_e8m0(lhs.scale), rhs.data, as_e8m0(rhs.scale), group_sizes, variant=np.int32(names.index(variant))
    )


# ---- the FP8 block-scaled weight gradient (csrc/grouped_wgrad_fp8_block.cc; recipe
# "fp8_block" reaches it through grouped_wgrad_cuda) ----

GROUPED_WGRAD_FP8_BLOCK_TARGET = "jgm_grouped_wgrad_fp8_block"


def grouped_wgrad_fp8_block_variants() -> tuple[str, ...]:
    """Names of the compiled FP8 block-scaled weight gradients (empty without the extension)."""
    return ffi.variants("GROUPED_WGRAD_FP8_BLOCK_VARIANTS")


def _checked_grouped_fp8_block(name: str, t) -> None:
    """``t`` is a group-aware ``[M, K]`` :class:`FP8BlockTensor` with consistent fields (or
    one already laid out token-major, ``fp8_block.TokenMajorBlocks``), or a
    TypeError/ValueError naming ``name``."""
    if isinstance(t, fp8_block.TokenMajorBlocks):
        fp8_block.check_token_major(t, name)
        return
    if not isinstance(t, fp8_block.FP8BlockTensor):
        raise TypeError(
            f"{name} must be a group-aware FP8BlockTensor (quantize_fp8_block(x, 0, group_sizes=...)), "
            f"got {name}={type(t).__name__}"
        )
    if not t.is_grouped:
        raise ValueError(
            f"{name} must be group-aware (quantize_fp8_block(x, 0, group_sizes=...)), got {name}.axes={t.axes} "
            "without group_sizes"
        )
    fp8_block._check_tensor(t, name)


def grouped_wgrad_fp8_block(
    lhs: fp8_block.FP8BlockTensor | fp8_block.TokenMajorBlocks,
    rhs: fp8_block.FP8BlockTensor | fp8_block.TokenMajorBlocks,
    group_sizes: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    variant: str | None = None,
    with_token: bool = False,
):
    """``out[g] = lhs_g^T @ rhs_g`` on group-aware ``fp8_block`` operands, ``[G, K, N]``
    (``kernels/grouped_wgrad_fp8_block_sm90.py``; CUDA only; ``grouped_mlp``'s
    ``fp8_block`` weight gradients reach it through :func:`grouped_wgrad_cuda`).

    Args:
      lhs, rhs: ``quantize_fp8_block(x, 0, group_sizes=group_sizes)`` of ``x [M, K]`` and
        ``dy [M, N]``: group-aware 128-row blocks, quantized with these group sizes (the
        blocks are laid out by them). Each is rearranged token-major in whole blocks for
        the kernel (:func:`token_major_blocks_cuda`: one read and one write of its FP8
        bytes), unless it comes so already (``fp8_block.TokenMajorBlocks``, as the
        quantizer's "pair_tm" mode writes dy's and dh's).
      group_sizes: ``[G]`` integers on the device, clamped to ``M``.
      out_dtype: bfloat16 or float32.
      variant: a name of :func:`grouped_wgrad_fp8_block_variants` (default: the one
        writing ``out_dtype``).
      with_token: return ``(out, token)``, the token the kernel call's second result
        (int32 ``[1]``, zero), which exists once ``out`` is written
        (``primitives.grouped_wgrad(with_token=True)``).

    Numerics: each 128-token block is one FP8 wgmma reduction (exact products, Hopper's
    internal FP8 accumulation), scaled by the two blocks' scales in float32 and added
    into a float32 accumulator, blocks in order (bitwise reproducible); one rounding
    to ``out_dtype``. Empty groups give zeros.

    Raises:
      TypeError, ValueError: naming the argument (not a group-aware FP8BlockTensor, row
        mismatch, K or N not a multiple of 8, too large, a bad ``out_dtype`` or
        ``variant``).
      RuntimeError: the extension is not built.
    """
    _checked_grouped_fp8_block("lhs", lhs)
    _checked_grouped_fp8_block("rhs", rhs)
    (m, k), (m2, n) = _grouped_dims(lhs), _grouped_dims(rhs)
    if not all(isinstance(d, int) for d in (m, k, m2, n)):
        raise ValueError(f"lhs and rhs must have static shapes, got [M, K] = {(m, k)} (lhs) and {(m2, n)} (rhs)")
    if m != m2:
        raise ValueError(f"row mismatch: lhs has {m} rows ([M, K] = {(m, k)}), rhs {m2} ([M, N] = {(m2, n)})")
    if k % 8 or n % 8:
        raise ValueError(
            f"lhs, rhs: K and N must be multiples of 8 (16-byte output rows), got K={k} (lhs) and N={n} (rhs)"
        )
    g = jnp.shape(group_sizes)[0] if jnp.ndim(group_sizes) == 1 else 0
    # (Type-checked here; clamped once, by the token-major entry, right before its call.)
    _checked_group_sizes(group_sizes, g, m)
    if not heuristics.fp8_wgrad_fits(m, k, n, g):
        raise ValueError(f"lhs, rhs: every operand must have fewer than 2^31 elements, got {m=} {n=} {k=} {g=}")
    nblocks = fp8_block.grouped_scale_rows(m, g)
    for name, t in (("lhs", lhs), ("rhs", rhs)):
        if t.scale.shape[0] != nblocks:
            raise ValueError(
                f"{name} was quantized with {t.scale.shape[0] - groups.cdiv(m, 128)} groups, group_sizes has {g}"
            )
    _fp8_wgrad_variant(out_dtype, variant)  # (checked before the layout passes)
    return grouped_wgrad_fp8_block_token_major(
        token_major_blocks_cuda(lhs), token_major_blocks_cuda(rhs), group_sizes, rows=m, out_dtype=out_dtype,
        variant=variant, with_token=with_token,
    )


def _fp8_wgrad_variant(out_dtype, variant: str | None) -> np.int32:
    """The ``variant`` attribute of the FP8 weight-gradient kernel writing ``out_dtype``
    (``variant`` by name, or the first compiled one)."""
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    if not ffi.available():
        raise RuntimeError("the CUDA extension jax_grouped_mlp._kernels is not built")
    names = grouped_wgrad_fp8_block_variants()
    fits = [v for v in names if jnp.dtype(registry.variant(v).out_dtype) == out_dtype]
    if variant is None:
        variant = fits[0] if fits else None
    if variant not in fits:
        raise ValueError(f"variant must be one of the compiled {tuple(fits)} for {out_dtype=}, got {variant=}")
    return np.int32(names.index(variant))


def grouped_wgrad_fp8_block_token_major(
    lhs: tuple[jax.Array, jax.Array],
    rhs: tuple[jax.Array, jax.Array],
    group_sizes: jax.Array,
    *,
    rows: int,
    out_dtype=jnp.bfloat16,
    variant: str | None = None,
    with_token: bool = False,
):
    """:func:`grouped_wgrad_fp8_block` on operands already laid out token-major: each of
    ``lhs``, ``rhs`` is ``(data [K, 128 NB] float8_e4m3fn, scale [NB, K] float32)`` as
    :func:`token_major_blocks_cuda` returns them (or the quantizer's "pair_tm" mode writes
    them, scales decoded by ``fp8_block.scale_values``), ``NB = cdiv(rows, 128) + G``, for
    ``rows`` tokens. The same bits as the layout-from-``[M, K]`` entry; ``with_token``
    as there.

    Raises:
      TypeError, ValueError: naming the argument (shapes or dtypes that do not fit
        ``rows`` and the group count, a bad ``out_dtype`` or ``variant``).
    """
    g = jnp.shape(group_sizes)[0] if jnp.ndim(group_sizes) == 1 else 0
    group_sizes = _checked_group_sizes(group_sizes, g, rows)
    nb = fp8_block.grouped_scale_rows(rows, g)
    dims = {}
    for name, (data, scale) in (("lhs", lhs), ("rhs", rhs)):
        if data.dtype != jnp.float8_e4m3fn or data.ndim != 2 or data.shape[1] != 128 * nb:
            raise ValueError(f"{name}[0] must be float8_e4m3fn [K, 128 * {nb}] (rows={rows}, G={g}), "
                             f"got {data.dtype} {data.shape}")
        if scale.dtype != jnp.float32 or scale.shape != (nb, data.shape[0]):
            raise ValueError(f"{name}[1] must be float32 [{nb}, {data.shape[0]}], got {scale.dtype} {scale.shape}")
        if data.shape[0] % 8:
            raise ValueError(f"{name}: K and N must be multiples of 8, got {data.shape[0]}")
        dims[name] = data.shape[0]
    if not heuristics.fp8_wgrad_fits(rows, dims["lhs"], dims["rhs"], g):
        raise ValueError(f"lhs, rhs: every operand must have fewer than 2^31 elements, got {rows=} {dims} {g=}")
    variant_index = _fp8_wgrad_variant(out_dtype, variant)
    out = jax.ShapeDtypeStruct((g, dims["lhs"], dims["rhs"]), out_dtype)
    result, token = jax.ffi.ffi_call(GROUPED_WGRAD_FP8_BLOCK_TARGET, (out, ORDER_TOKEN))(
        *lhs, *rhs, group_sizes, variant=variant_index, rows=np.int64(rows)
    )
    return (result, token) if with_token else result


TOKEN_MAJOR_BLOCKS_TARGET = "jgm_token_major_blocks"


def token_major_blocks_variants() -> tuple[str, ...]:
    """Names of the compiled token-major layout kernels (empty without the extension)."""
    return ffi.variants("TOKEN_MAJOR_BLOCKS_VARIANTS")


def token_major_blocks_cuda(t: fp8_block.FP8BlockTensor | fp8_block.TokenMajorBlocks) -> tuple[jax.Array, jax.Array]:
    """:func:`fp8_block.token_major_blocks` (same bytes), the data by the CUDA kernel
    (``kernels/token_major_blocks.py``: one read and one write of the FP8 bytes) when it is
    compiled, ``K % 16 == 0`` and the result has fewer than 2^31 elements, else by the XLA
    gather and transpose (several times slower on the H200). A tensor already laid out
    (``fp8_block.TokenMajorBlocks``, the pair quantizer's "pair_tm" output) comes back as
    it is, with its scales decoded.

    Raises:
      TypeError, ValueError: ``t`` is neither a group-aware FP8BlockTensor nor a
        consistent TokenMajorBlocks (naming ``t``).
    """
    _checked_grouped_fp8_block("t", t)
    if isinstance(t, fp8_block.TokenMajorBlocks):
        return t.data, fp8_block.scale_values(t)
    m, k = t.data.shape
    g = t.group_sizes.shape[0]
    names = token_major_blocks_variants()
    if not names or k % 16 or not heuristics.fp8_wgrad_fits(m, k, 8, g):
        return fp8_block.token_major_blocks(t)
    gs = _checked_group_sizes(t.group_sizes, g, m)
    out = jax.ShapeDtypeStruct((k, fp8_block.grouped_scale_rows(m, g) * 128), jnp.float8_e4m3fn)
    data = jax.ffi.ffi_call(TOKEN_MAJOR_BLOCKS_TARGET, out)(t.data, gs, variant=np.int32(0))
    return data, fp8_block.scale_values(t)
