"""What the GPU tests need to know about the machine they run on."""

from __future__ import annotations

import jax


def has_gpu() -> bool:
    """True when JAX sees a CUDA GPU (False, not an error, on CPU-only installs)."""
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False
