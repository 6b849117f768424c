"""What the tests need to know about the machine they run on (a GPU; simulated CPU devices)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np


def has_gpu() -> bool:
    """True when JAX sees a CUDA GPU (False, not an error, on CPU-only installs)."""
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def clamped_sizes(sizes, m: int) -> np.ndarray:
    """The group sizes a kernel sees: negative ones as 0, the running sum cut at ``m``
    (summed in int64, so a huge size cannot overflow), int32."""
    ends = np.clip(np.cumsum(np.maximum(np.asarray(sizes, np.int64), 0)), 0, m)
    return np.diff(np.concatenate([[0], ends])).astype(np.int32)


def poison_freed(*nbytes: int, value: int) -> None:
    """Leaves freed device buffers of these byte counts filled with ``value`` (all
    allocated at once, then dropped). XLA's allocator hands the same chunks to the next
    outputs of equal size, so an output byte a kernel forgets to write keeps the poison
    (0xFF in a bf16 output: a NaN), and two runs poisoned with different values differ."""
    bufs = [jnp.full((int(n),), value, jnp.uint8) for n in nbytes]
    jax.block_until_ready(bufs)
    del bufs


def run_cases_on_cpu_devices(cases: pathlib.Path, what: str, devices: int = 4, *, xla_flags: str = "",
                             keyword: str | None = None, shard: tuple[int, int] | None = None) -> None:
    """Runs the pytest file ``cases`` (its tests matching ``keyword``, a ``pytest -k``
    expression, when given; with ``shard=(i, n)`` only the ``i``-th of ``n`` runs of
    consecutive ones, ``case_shard_plugin.py``) in a fresh interpreter that sees ``devices`` CPU
    devices and runs XLA with ``xla_flags`` too (both fixed at JAX's start), and fails
    with its output unless every case passed (a run whose last line reports skips fails
    too)."""
    import pytest

    env = dict(os.environ)
    flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices} {xla_flags}"
    env["XLA_FLAGS"] = " ".join(flags.split())
    env["JAX_PLATFORMS"] = "cpu"
    root = cases.resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(cases)]
    if keyword is not None:
        cmd += ["-k", keyword]
    if shard is not None:
        env["JGM_CASE_SHARD"] = f"{shard[0]}/{shard[1]}"
        cmd += ["-p", "case_shard_plugin"]
        env["PYTHONPATH"] = os.pathsep.join((str(cases.resolve().parent), env["PYTHONPATH"]))
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{what} timed out after {err.timeout}s:\n{err.stdout or ''}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{what} failed (rc={proc.returncode}):\n{out[-20000:]}"
    assert "skipped" not in out.splitlines()[-1], f"{what} were skipped:\n{out[-5000:]}"


# Group sizes for the GEMM kernels' deep-K cases: long runs of tiles with at most 64 valid
# rows (with SKIP_EMPTY_WARP_GROUP, grouped_gemm_sm90, the second warp group skips them
# and the first hands each pipeline slot back for both), with full and empty groups
# between them.
SKIPPED_WARP_GROUP_RUNS = (64, 1, 63, 30, 64, 2, 0, 64, 40, 129, 64, 1, 64, 63, 7, 64, 192, 64, 3, 64)
