"""``backend_info()``: what this process would run, and why."""

from __future__ import annotations

import dataclasses
import typing

import jax

from jax_grouped_mlp._src.cuda import devices, ffi
from jax_grouped_mlp._src.offload import host_store
from jax_grouped_mlp._src.op import primitives

KERNEL = "cuda kernel"
COMPOSED = "other cuda kernels"
REFERENCE = "pure JAX"


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    """What :func:`backend_info` reports.

    Attributes:
      extension: whether the compiled extension ``jax_grouped_mlp._kernels`` loaded.
      kernel_arch: the GPU architecture its kernels were compiled for (``"sm_90a"``),
        or None without the extension.
      default_platform: ``jax.default_backend()`` (``"gpu"``, ``"cpu"``, ...).
      cuda_devices: every local CUDA device, with whether the kernels run on it.
      paths: for each primitive of the op, what runs on the default device:
        ``"cuda kernel"``, ``"other cuda kernels"`` (a fused primitive this build has no
        kernel for, run as the composition of the primitives it fuses, each a kernel
        where the build has one) or ``"pure JAX"`` (a kernel can still fall back for a
        shape it cannot take, e.g. a hidden size that is not a multiple of 8).
      reason: why the pure-JAX path runs, when it does for every primitive.
      recipes: for each recipe of :func:`jax_grouped_mlp.grouped_mlp`, what its GEMMs
        run on the default device: ``"cuda kernel"`` or ``"pure JAX"``.
        ``"fp8_block"`` runs its forward GEMMs and data gradients on the FP8
        block-scaled kernel and its weight gradients on the FP8 block-scaled
        weight-gradient kernel; its quantizers are kernels too for bf16 input
        (``fp8_block_pair``, ``fp8_block_weight``; the op quantizes the bf16 copy of
        float32 weights).
      layer_scan_copies: who makes :func:`jax_grouped_mlp.layer_scan`'s host copies in
        programs traced now: ``"library streams"`` (its own custom calls, on a CUDA
        GPU with the extension) or ``"XLA"`` (elsewhere, or ``JGM_LAYER_SCAN_STREAMS=0``).
    """

    extension: bool
    kernel_arch: str | None
    default_platform: str
    cuda_devices: tuple[devices.CudaDevice, ...]
    paths: dict[str, str]
    reason: str | None
    recipes: dict[str, str] = dataclasses.field(default_factory=dict)
    layer_scan_copies: str = "XLA"

    def __str__(self) -> str:
        lines = [
            f"extension: {'built, kernels for ' + str(self.kernel_arch) if self.extension else 'not built'}",
            f"default platform: {self.default_platform}",
        ]
        for d in self.cuda_devices:
            lines.append(f"  cuda:{d.id} {d.kind} (compute capability {d.compute_capability}): "
                         f"{'kernels' if d.kernels else 'pure JAX'}")
        lines += [f"  {name}: {path}" for name, path in self.paths.items()]
        lines += [f"  recipe {name!r}: {path}" for name, path in self.recipes.items()]
        lines.append(f"  layer_scan host copies: {self.layer_scan_copies}")
        if self.reason:
            lines.append(f"why pure JAX: {self.reason}")
        return "\n".join(lines)


def _path(name: str) -> str:
    if primitives.cuda_impl(name) is not None:
        return KERNEL
    return COMPOSED if name in primitives.COMPOSED else REFERENCE


def backend_info() -> BackendInfo:
    """Reports whether the CUDA extension is built, which architecture its kernels are
    for, the local CUDA devices, and which path each primitive of the op takes on the
    default device. Cheap; call it to check an installation (``print(backend_info())``).
    """
    ext = ffi.available()
    platform = jax.default_backend()
    cuda = devices.cuda_devices()
    reason = None
    if not ext:
        reason = "the CUDA extension is not built (see docs/gpu.md)"
    elif platform != "gpu":
        reason = f"the default platform is {platform!r}; the kernels run on CUDA devices only"
    elif not all(d.kernels for d in cuda):
        reason = f"a local CUDA device is not {devices.KERNEL_ARCH} (compute capability 9.0)"
    names = typing.get_args(primitives.OpName)
    paths = {n: _path(n) if reason is None else REFERENCE for n in names}
    if reason is None and not any(p == KERNEL for p in paths.values()):
        reason = "the extension provides no kernel for these primitives"
        paths = dict.fromkeys(names, REFERENCE)
    gemm = paths.get("grouped_gemm", REFERENCE)
    # (Recipe values, not imported: the recipes module imports the primitives too.)
    recipes = {"mxfp8": gemm, "bf16": gemm, "fp8_block": gemm}
    copies = "library streams" if host_store.for_this_platform() is not None else "XLA"
    return BackendInfo(ext, devices.KERNEL_ARCH if ext else None, platform, cuda, paths, reason, recipes, copies)
