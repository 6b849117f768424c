"""A pytest plugin for the subprocess case files (``run_cases_on_cpu_devices``): keeps only
shard ``i`` of ``n`` of the collected cases, the ``i``-th of ``n`` runs of consecutive
cases of (nearly) equal length (so that one test's parametrizations, which share compiled
programs, mostly stay together), when the environment sets ``JGM_CASE_SHARD=i/n``. The slow suite runs one long case file as
several shorter tests this way, so that pytest-xdist can spread them over its workers."""

from __future__ import annotations

import os


def shard_of_env() -> tuple[int, int] | None:
    """``(i, n)`` from ``JGM_CASE_SHARD``, or None when it is unset; a ValueError names a bad one."""
    spec = os.environ.get("JGM_CASE_SHARD")
    if not spec:
        return None
    try:
        i, n = (int(s) for s in spec.split("/"))
    except ValueError:
        raise ValueError(f"JGM_CASE_SHARD must be i/n (two integers), got {spec!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"JGM_CASE_SHARD must be i/n with 0 <= i < n, got {spec!r}")
    return i, n


def shard_bounds(count: int, i: int, n: int) -> tuple[int, int]:
    """``[start, stop)`` of shard ``i`` of ``n`` over ``count`` items: every item in one
    shard, the shards' lengths differing by at most one."""
    return count * i // n, count * (i + 1) // n


def pytest_collection_modifyitems(config, items):
    shard = shard_of_env()
    if shard is None:
        return
    start, stop = shard_bounds(len(items), *shard)
    config.hook.pytest_deselected(items=items[:start] + items[stop:])
    items[:] = items[start:stop]
