"""Group sizes as a router makes them, shared by benchmarks and tests.

Real routing is never uniform: the expert loads of a batch look like a multinomial
draw of the batch's (token, expert) pairs over expert probabilities that themselves
vary from expert to expert. :func:`router_group_sizes` draws those probabilities from
a symmetric Dirichlet(alpha): ``alpha = inf`` gives equal sizes, ``alpha = 1`` the
moderate skew of a trained router (issue 20 measures at it), ``alpha = 0.3`` a heavy
one (a few experts take most tokens, some none).
"""

from __future__ import annotations

import math

import numpy as np

# The skews benchmarks report next to each other: uniform, router-like, heavy.
ALPHAS = (math.inf, 1.0, 0.3)


def router_group_sizes(m: int, g: int, alpha: float, seed: int = 0) -> np.ndarray:
    """``g`` int32 group sizes summing to ``m``: equal (the remainder on the first groups)
    for ``alpha = inf``, else a multinomial draw of ``m`` over Dirichlet(``alpha``)
    probabilities with this ``seed`` (reproducible)."""
    if m < 0 or g <= 0:
        raise ValueError(f"need m >= 0 and g > 0, got m={m}, g={g}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0 (inf: equal sizes), got alpha={alpha!r}")
    if math.isinf(alpha):
        sizes = np.full(g, m // g, np.int64)
        sizes[: m % g] += 1
        return sizes.astype(np.int32)
    rng = np.random.default_rng(seed)
    return rng.multinomial(m, rng.dirichlet(np.full(g, float(alpha)))).astype(np.int32)


def rounded_group_sizes(sizes: np.ndarray, multiple: int) -> np.ndarray:
    """``sizes`` moved to multiples of ``multiple`` with the same sum (which must be a
    multiple of it), each by less than ``multiple`` (largest remainders: every size
    rounded down, then the groups with the largest remainders rounded up until the sum
    matches). The same skew without ragged edges: a benchmark that times both tells the
    cost of partial tiles (and of the weight gradient's partial row slices) from that of
    the uneven distribution."""
    sizes = np.asarray(sizes, np.int64)
    if multiple <= 0 or sizes.sum() % multiple:
        raise ValueError(f"multiple must be > 0 and divide sum(sizes) = {int(sizes.sum())}, got multiple={multiple}")
    down = sizes // multiple * multiple
    short = int(sizes.sum() - down.sum()) // multiple
    up = np.argsort(-(sizes - down), kind="stable")[:short]
    down[up] += multiple
    return down.astype(np.int32)


def skew_label(alpha: float) -> str:
    """``"uniform"`` or ``"alpha=1"``-style names for reports."""
    return "uniform" if math.isinf(alpha) else f"alpha={alpha:g}"
