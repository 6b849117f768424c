"""tests/gpu_helpers.py's pure parts, on the CPU: the sizes the kernels see, and the
poisoning of freed device memory that the GPU tests' "every element written" checks use."""

from __future__ import annotations

import numpy as np

from gpu_helpers import clamped_sizes, poison_freed


def test_clamped_sizes_zero_negatives_and_cut_at_m():
    got = clamped_sizes([3, -2, 5, 4, 7], 10)
    assert got.dtype == np.int32
    assert got.tolist() == [3, 0, 5, 2, 0]  # the running sum stops at 10
    assert clamped_sizes([], 10).tolist() == []


def test_clamped_sizes_do_not_overflow_int32():
    big = np.iinfo(np.int32).max
    assert clamped_sizes(np.array([big, big, 1], np.int32), 1000).tolist() == [1000, 0, 0]


def test_poison_freed_takes_any_byte_counts():
    poison_freed(16, 0, 3, value=0xFF)  # (no output: it only leaves freed memory behind)
    poison_freed(value=0x7F)
