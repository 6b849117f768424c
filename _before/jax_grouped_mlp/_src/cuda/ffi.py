"""XLA FFI bindings of the AOT-compiled CUDA kernels (extension ``jax_grouped_mlp._kernels``).

The extension is optional: without it (no CUDA toolkit at build time, or a CPU-only
install) :func:`available` is False and callers use the pure-JAX reference. With
it, the handlers are registered for the CUDA platform once, at first use, and the
functions here emit ``jax.ffi.ffi_call`` custom calls. Those only lower for CUDA:
put them behind ``jax.lax.platform_dependent`` (``primitives.register_cuda_impl``).

Nothing is JIT-compiled at run time; the kernel modules are loaded (and their kernels
loaded on every device in use) once per process, in the handlers' instantiate stage, so
the execute stage only launches and its handlers are marked command-buffer compatible:
XLA may capture them into CUDA graphs. ``JGM_CUDA_GRAPHS=0`` in the environment (read
once, at registration) registers handlers without that mark instead.

A CUDA implementation that cannot take a problem raises :class:`Unsupported` at trace
time; the dispatcher (``primitives``) catches it and runs its fallback. Nothing here
calls back up into the dispatcher.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src import groups, warn
from jax_grouped_mlp._src.formats import mxfp8
from jax_grouped_mlp._src.formats.mxfp8 import MXFP8Tensor
from jax_grouped_mlp.kernels import registry

FAKE_QUANTIZE_TARGET = "jgm_fake_quantize_mxfp8"
FAKE_QUANTIZE_PAIR_TARGET = "jgm_fake_quantize_pair"
DEQUANTIZE_TARGET = "jgm_dequantize_mxfp8"


class Unsupported(NotImplementedError):
    """A CUDA implementation cannot take this problem: an operand dtype, a shape (TMA
    alignment, 32-bit offsets, symbolic sizes) or no compiled variant fits.

    Raised at trace time, before any custom call is emitted; ``primitives`` (the
    dispatcher) catches it and falls back (to the reference, or to the unfused
    composition of other primitives). Malformed operands (wrong rank, mismatched
    shapes) raise ``TypeError``/``ValueError`` instead: no implementation takes those.
    """


def cuda_graphs_enabled() -> bool:
    """Whether the handlers are registered as CUDA-graph (command-buffer) compatible:
    True unless the environment sets ``JGM_CUDA_GRAPHS=0`` (docs/troubleshooting.md)."""
    return os.environ.get("JGM_CUDA_GRAPHS", "1").strip() != "0"


@functools.cache
def _load():
    try:
        from jax_grouped_mlp import _kernels
    except ImportError:
        return None
    _warn_if_built_for_another_jaxlib(getattr(_kernels, "JAXLIB_VERSION", None))
    for name, handlers in _kernels.registrations(cuda_graphs=cuda_graphs_enabled()).items():
        jax.ffi.register_ffi_target(name, handlers, platform="CUDA")
    return _kernels


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.11.2"`` -> ``(0, 11, 2)``: the leading integer fields of a version string."""
    out = []
    for part in version.split("."):
        digits = part[: len(part) - len(part.lstrip("0123456789"))]  # leading digits only
        if not digits:
            break
        out.append(int(digits))
        if len(digits) < len(part):  # "2rc1": the version's numeric part ends here
            break
    return tuple(out)


def _warn_if_built_for_another_jaxlib(built: str | None) -> None:
    """An extension compiled against a *newer* jaxlib's FFI headers than the running one
    can be refused by XLA without an error at registration: every call then fails with
    "No FFI handler registered for jgm_...". Say so at load time, naming both versions.
    An older build is fine (the wheel is built against the oldest supported jax and
    loads in newer ones, docs/gpu.md), and so is an old extension without the record."""
    try:
        import jaxlib.version
    except ImportError:
        return
    running = jaxlib.version.__version__
    if built and version_tuple(built) > version_tuple(running):
        warn.warn(
            f"jax_grouped_mlp._kernels was built against jaxlib {built}, newer than the running "
            f"jaxlib {running}; XLA may reject its kernels ('No FFI handler registered for jgm_...'). "
            "Rebuild it in this environment (`make kernels`), or install a wheel built for this jax.",
            RuntimeWarning)


def available() -> bool:
    """True when the CUDA extension is built and its FFI targets are registered."""
    return _load() is not None


def extension():
    """The loaded extension module ``jax_grouped_mlp._kernels`` (its targets registered),
    or None where it is not built."""
    return _load()


@functools.cache
def registered_targets() -> tuple[str, ...]:
    """Names of the FFI targets the extension provides (empty without it; fixed once the
    extension is loaded, so asked of it once: callers check it per array at trace time)."""
    ext = _load()
    return tuple(ext.registrations()) if ext is not None else ()


def variants(attr: str) -> tuple[str, ...]:
    """The extension's tuple ``attr`` of compiled variant names (empty without the extension)."""
    ext = _load()
    return tuple(getattr(ext, attr, ())) if ext is not None else ()


def quantize_supported(x: jax.Array, num_groups: int = 0) -> bool:
    """Whether the CUDA (fake-)quantize kernels take ``x`` (else use the reference).

    bf16 ``[M, K]`` with ``K % 8 == 0`` (16-byte rows of 8 columns per thread) and
    offsets that fit in 32 bits (the kernel indexes with int32).
    """
    if x.ndim != 2 or jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16):
        return False
    return _fits_row_kernels(*x.shape, num_groups)


def _fits_row_kernels(m, k, num_groups) -> bool:
    """The shape rule of the fake-quantize and dequantize kernels for ``[M, K]`` with
    ``num_groups`` groups: static sizes (symbolic ones, from shape-polymorphic export,
    take the reference), ``K % 8 == 0`` (16-byte rows of 8 columns per thread) and 32-bit
    offsets for the data and the group-aware scale rows."""
    if not all(isinstance(d, int) for d in (m, k, num_groups)):
        return False
    return k % 8 == 0 and m * k < 2**31 and mxfp8.grouped_scale_rows(m, num_groups) * k < 2**31


def fake_quantize_variants() -> tuple[str, ...]:
    """Names of the compiled fake-quantize configurations (empty without the extension)."""
    return variants("FAKE_QUANTIZE_VARIANTS")


def _fake_quantize_inputs(name: str, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Checks a fake-quantize kernel's inputs; returns ``group_sizes`` as int32, clamped
    (``groups.clamp_group_sizes``)."""
    if not available():
        raise RuntimeError("the CUDA extension jax_grouped_mlp._kernels is not built")
    g = jnp.shape(group_sizes)[0] if jnp.ndim(group_sizes) == 1 else 0
    if not quantize_supported(x, g):
        raise ValueError(
            f"{name} needs bf16 x [M, K] with K % 8 == 0 and 32-bit offsets, got {x.shape=} {x.dtype=}"
        )
    group_sizes = jnp.asarray(groups.host_clip(group_sizes))
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be a 1-D integer array, got {group_sizes.shape=} {group_sizes.dtype=}")
    return groups.clamp_group_sizes(group_sizes, x.shape[0])


def _mode_variant(names: tuple[str, ...], mode: str) -> np.int32:
    """The ``variant`` attribute of the first compiled variant of ``mode`` (registry)."""
    return np.int32(next(i for i, v in enumerate(names) if registry.variant(v).mode == mode))


def fake_quantize_mxfp8_cuda(x: jax.Array, group_sizes: jax.Array, *, mode: str) -> jax.Array:
    """One kernel: the MXFP8 values of bf16 ``x [M, K]`` as bf16, without the FP8 copy.

    ``mode="row"``: ``dequantize(quantize_mxfp8(x, axis=1))``; ``mode="col"``:
    ``dequantize(quantize_mxfp8_grouped(x, group_sizes))`` (rows past the groups
    zero). Bit-identical to those. Lowers only for CUDA and needs :func:`available`.
    """
    if mode not in ("row", "col"):
        raise ValueError(f"mode must be 'row' or 'col', got {mode!r}")
    group_sizes = _fake_quantize_inputs("fake_quantize_mxfp8_cuda", x, group_sizes)
    return jax.ffi.ffi_call(FAKE_QUANTIZE_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.bfloat16))(
        x, group_sizes, variant=_mode_variant(fake_quantize_variants(), mode)
    )


def fake_quantize_pair_variants() -> tuple[str, ...]:
    """Names of the compiled two-copy fake-quantize configurations (empty without the extension)."""
    return variants("FAKE_QUANTIZE_PAIR_VARIANTS")


def fake_quantize_pair_mxfp8_cuda(
    x: jax.Array, group_sizes: jax.Array, *, keep_col_fp8: bool
) -> tuple[jax.Array, jax.Array | MXFP8Tensor]:
    """One kernel, one read of bf16 ``x [M, K]``: both MXFP8 copies a GEMM pair needs.

    Returns ``(dequantize(quantize_mxfp8(x, 1)), col)`` with the rowwise values in
    bf16 (for a fprop/dgrad GEMM) and ``col`` the group-aware columnwise copy (for a
    weight gradient): its values in bf16, or with ``keep_col_fp8`` the
    :class:`MXFP8Tensor` itself (a residual worth keeping small). Bit-identical to
    the reference quantizers. Lowers only for CUDA and needs :func:`available`.
    """
    group_sizes = _fake_quantize_inputs("fake_quantize_pair_mxfp8_cuda", x, group_sizes)
    m, k = x.shape
    nb = mxfp8.grouped_scale_rows(m, group_sizes.shape[0])
    out = (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn if keep_col_fp8 else jnp.bfloat16),
        jax.ShapeDtypeStruct((nb, k), jnp.float8_e8m0fnu),
    )
    mode = "row_colq" if keep_col_fp8 else "rowcol"
    row, col, col_scale = jax.ffi.ffi_call(FAKE_QUANTIZE_PAIR_TARGET, out)(
        x, group_sizes, variant=_mode_variant(fake_quantize_pair_variants(), mode)
    )
    if keep_col_fp8:
        return row, MXFP8Tensor(col, col_scale, axis=0, group_sizes=group_sizes)
    return row, col


def fake_quantize_pair_cuda(x: jax.Array, group_sizes: jax.Array, *, keep_col_fp8: bool):
    """``primitives`` "fake_quantize_pair" on CUDA: the kernel, or :class:`Unsupported`
    when it does not take ``x``."""
    if not fake_quantize_pair_variants() or not quantize_supported(x, jnp.shape(group_sizes)[0]):
        raise Unsupported(f"fake_quantize_pair kernel: needs bf16 [M, K], K % 8 == 0, got {x.shape=} {x.dtype=}")
    return fake_quantize_pair_mxfp8_cuda(x, group_sizes, keep_col_fp8=keep_col_fp8)


def dequantize_variants() -> tuple[str, ...]:
    """Names of the compiled dequantize configurations (empty without the extension)."""
    return variants("DEQUANTIZE_VARIANTS")


def dequantize_grouped_mxfp8_cuda(t: MXFP8Tensor) -> jax.Array:
    """One kernel: ``mxfp8.dequantize(t, bfloat16)`` for a group-aware columnwise ``[M, K]`` tensor.

    Bit-identical to the reference (rows past the groups zero). ``K % 8 == 0``.
    Lowers only for CUDA and needs :func:`available`.
    """
    if not isinstance(t, MXFP8Tensor) or not t.is_grouped or t.data.ndim != 2:
        raise TypeError(f"need a group-aware columnwise [M, K] MXFP8Tensor, got {t!r}")
    if not available() or not dequantize_variants():
        raise RuntimeError("the CUDA extension jax_grouped_mlp._kernels (with the dequantize kernel) is not built")
    m, k = t.data.shape
    g = t.group_sizes.shape[0]
    if not _fits_row_kernels(m, k, g):
        raise ValueError(f"dequantize_grouped_mxfp8_cuda needs K % 8 == 0 and 32-bit offsets, got {t.data.shape=} G={g}")
    return jax.ffi.ffi_call(DEQUANTIZE_TARGET, jax.ShapeDtypeStruct((m, k), jnp.bfloat16))(
        t.data, t.scale, groups.clamp_group_sizes(t.group_sizes, m), variant=np.int32(0)
    )


def dequantize_cuda(t: MXFP8Tensor) -> jax.Array:
    """``mxfp8.dequantize(t, bfloat16)`` on CUDA: the kernel for a group-aware ``[M, K]``
    tensor it takes, else the reference."""
    if t.is_grouped and t.data.ndim == 2 and dequantize_variants():
        if _fits_row_kernels(*t.data.shape, t.group_sizes.shape[0]):
            return dequantize_grouped_mxfp8_cuda(t)
    return mxfp8.dequantize(t, jnp.bfloat16)


def fake_quantize_cuda(x: jax.Array, *, axis: int) -> jax.Array:
    """``primitives`` "fake_quantize" on CUDA for either of the last two axes, or
    :class:`Unsupported` (another axis, symbolic or unaligned shapes, another dtype).

    ``x [*lead, A, B]`` is viewed as ``[prod(lead) * A, B]``: blocks along B are its
    rows' blocks, blocks along A its group-aware columns with one group of A rows per
    leading index.
    """
    unsupported = Unsupported(
        f"fake_quantize kernel: needs bf16 [..., A, B] blocked along A or B, B % 8 == 0, got {x.shape=} {x.dtype=} {axis=}"
    )
    static = all(isinstance(d, int) for d in x.shape)
    nd = x.ndim
    if nd < 2 or axis % nd < nd - 2 or not static or not fake_quantize_variants():
        raise unsupported
    a, b = x.shape[-2:]
    flat = x.reshape(-1, b)
    n = flat.shape[0] // a if a else 0
    if not quantize_supported(flat, n) or a == 0:
        raise unsupported
    if axis % nd == nd - 1:
        out = fake_quantize_mxfp8_cuda(flat, jnp.zeros((0,), jnp.int32), mode="row")
    else:
        out = fake_quantize_mxfp8_cuda(flat, jnp.full((n,), a, jnp.int32), mode="col")
    return out.reshape(x.shape)


def export_disabled_checks() -> list:
    """``disabled_checks`` for ``jax.export.export`` of functions calling our kernels.

    Our targets carry no cross-version compatibility guarantee from JAX; an exported
    artifact needs the same build of this package wherever it is deserialized.
    """
    return [jax.export.DisabledSafetyCheck.custom_call(t) for t in registered_targets()]
