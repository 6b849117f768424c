"""Which GPUs the compiled kernels can run on, checked once per process.

The kernels are compiled ahead of time for one architecture (``sm_90a``: Hopper's
arch-specific wgmma and TMA instructions, which no other GPU generation runs). A
program traced where a CUDA device of another compute capability is present (an
A100, a Blackwell GPU) must not call them: :func:`check_kernels_run_here` raises
:class:`ffi.Unsupported` there, so the dispatcher runs the pure-JAX path instead,
after one warning. On a machine without CUDA devices nothing is checked (a program
lowered there for CUDA, e.g. by ``jax.export``, keeps its kernels; the custom call
checks its device when it runs).
"""

from __future__ import annotations

import dataclasses
import functools
import jax

from jax_grouped_mlp._src import warn

from jax_grouped_mlp._src.cuda.ffi import Unsupported

KERNEL_ARCH = "sm_90a"
# Compute capabilities that run sm_90a code: exactly 9.0 (arch-specific features are
# not forward compatible).
SUPPORTED_CAPABILITIES = frozenset({"9.0"})


@dataclasses.dataclass(frozen=True)
class CudaDevice:
    """One local CUDA device: its id, kind and compute capability, and whether our
    kernels run on it."""

    id: int
    kind: str
    compute_capability: str | None
    kernels: bool


def _local_cuda_devices() -> list:
    try:
        return list(jax.local_devices(backend="cuda"))
    except RuntimeError:  # no CUDA backend in this jaxlib, or no CUDA device
        return []


@functools.cache
def cuda_devices() -> tuple[CudaDevice, ...]:
    """The local CUDA devices (empty on a machine without one); queried once."""
    out = []
    for d in _local_cuda_devices():
        cc = getattr(d, "compute_capability", None)
        out.append(CudaDevice(int(d.id), str(d.device_kind), cc, cc in SUPPORTED_CAPABILITIES))
    return tuple(out)


# The SM count of the H100 and H200 (SXM), for a program traced where no CUDA device is.
DEFAULT_SM_COUNT = 132


@functools.cache
def sm_count() -> int:
    """Streaming multiprocessors of the first local CUDA device (the persistent kernels'
    grid), or :data:`DEFAULT_SM_COUNT` where there is none; queried once."""
    for d in _local_cuda_devices():
        count = getattr(d, "core_count", None)
        if isinstance(count, int) and count > 0:
            return count
    return DEFAULT_SM_COUNT


@functools.cache
def _warn_once(message: str) -> None:
    warn.warn(message, RuntimeWarning)


def check_kernels_run_here() -> None:
    """:class:`Unsupported` (after one warning per process) when a local CUDA device
    cannot run ``sm_90a`` kernels; nothing when every one can, or there is none."""
    bad = [d for d in cuda_devices() if not d.kernels]
    if not bad:
        return
    desc = ", ".join(f"{d.kind} (compute capability {d.compute_capability})" for d in bad)
    message = (
        f"jax_grouped_mlp: the CUDA kernels are built for {KERNEL_ARCH} (compute capability "
        f"{', '.join(sorted(SUPPORTED_CAPABILITIES))}) and cannot run on {desc}; "
        "the pure-JAX path runs instead (same results, slower)."
    )
    _warn_once(message)
    raise Unsupported(message)
