"""An independent float64 numpy oracle for the expert MLP and its four gradients.

Written from the math, one group at a time, with no code shared with the library.
"""

from __future__ import annotations

import numpy as np


def group_slices(group_sizes, m):
    start = 0
    for s in np.asarray(group_sizes):
        s = max(int(s), 0)
        end = min(start + s, m)
        yield start, end
        start = end


def mlp_f64(x, w1, w2, group_sizes, probs, dy):
    """Returns ``y`` and ``(dx, dw1, dw2, dprobs)`` for cotangent ``dy``, all float64."""
    x, w1, w2, probs, dy = (np.asarray(a, np.float64) for a in (x, w1, w2, probs, dy))
    m = x.shape[0]
    probs = probs.reshape(m)
    y = np.zeros((m, w2.shape[2]))
    dx = np.zeros_like(x)
    dw1, dw2 = np.zeros_like(w1), np.zeros_like(w2)
    dp = np.zeros(m)
    for g, (s, e) in enumerate(group_slices(group_sizes, m)):
        if e <= s:
            continue
        h = x[s:e] @ w1[g]
        r = np.maximum(h, 0.0)
        a = probs[s:e, None] * r * r
        y[s:e] = a @ w2[g]
        da = dy[s:e] @ w2[g].T
        dp[s:e] = np.sum(da * r * r, axis=1)
        dh = da * probs[s:e, None] * 2 * r
        dx[s:e] = dh @ w1[g].T
        dw2[g] = a.T @ dy[s:e]
        dw1[g] = x[s:e].T @ dh
    return y, (dx, dw1, dw2, dp)


def rel_err(got, want) -> float:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    denom = np.linalg.norm(want)
    if denom == 0:
        return float(np.linalg.norm(got))
    return float(np.linalg.norm(got - want) / denom)
