"""The pure-JAX grouped GEMMs and group tiling against per-group numpy loops in float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_grouped_mlp._src import groups
from jax_grouped_mlp._src.op import reference
from mlp_reference import group_slices

SIZES = [[0, 0, 0], [5, 0, 70], [200, 0, 0], [1, 2, 3], [64, 64, 64], [-3, 40, 10]]


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("tile", [8, 64])
def test_ragged_matmul(rng, sizes, tile):
    m, k, n = 130, 24, 40
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((3, k, n)).astype(np.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(reference.ragged_matmul(jnp.asarray(a), jnp.asarray(b), gs, tile=tile))
    want = np.zeros((m, n))
    for g, (s, e) in enumerate(group_slices(sizes, m)):
        want[s:e] = a[s:e].astype(np.float64) @ b[g]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("sizes", SIZES)
def test_ragged_transpose_matmul(rng, sizes):
    m, k, n = 130, 24, 40
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((m, n)).astype(np.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(reference.ragged_transpose_matmul(jnp.asarray(a), jnp.asarray(b), gs, tile=16))
    want = np.zeros((3, k, n))
    for g, (s, e) in enumerate(group_slices(sizes, m)):
        want[g] = a[s:e].T.astype(np.float64) @ b[s:e]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    for g, (s, e) in enumerate(group_slices(sizes, m)):
        if e == s:
            assert np.all(got[g] == 0)


@pytest.mark.parametrize("sizes", SIZES)
def test_tile_layout_covers_each_row_once(sizes):
    m, tile = 130, 32
    gs = jnp.asarray(sizes, jnp.int32)
    lay = groups.tile_layout(gs, m, tile)
    assert lay.num_tiles == groups.cdiv(m, tile) + len(sizes)
    covered = np.zeros(m, int)
    gid = np.asarray(groups.row_group_ids(gs, m))
    for grp, st, ln in zip(np.asarray(lay.group), np.asarray(lay.start), np.asarray(lay.length)):
        assert 0 <= ln <= tile and 0 <= st and st + ln <= m
        covered[st:st + ln] += 1
        if ln:
            assert np.all(gid[st:st + ln] == grp), "a tile crosses a group boundary"
    total = min(max(0, sum(max(s, 0) for s in sizes)), m)
    assert np.all(covered[:total] == 1) and np.all(covered[total:] == 0)


def test_row_group_ids_clamps(rng):
    gs = jnp.asarray([3, 100], jnp.int32)
    ids = np.asarray(groups.row_group_ids(gs, 10))
    np.testing.assert_array_equal(ids, [0, 0, 0] + [1] * 7)
    ids = np.asarray(jax.jit(groups.row_group_ids, static_argnums=1)(jnp.asarray([2, 3], jnp.int32), 8))
    np.testing.assert_array_equal(ids, [0, 0, 1, 1, 1, 2, 2, 2])


@pytest.mark.parametrize("n", [0, 1, 2, 5, 128, 300])
def test_search_sorted_is_searchsorted_without_a_loop(rng, n):
    """groups.search_sorted: jnp.searchsorted's results (duplicates, values outside the
    range, both sides), as straight-line code: no while loop in the compiled program."""
    a = jnp.asarray(np.sort(rng.integers(0, 60, n)).astype(np.int32))
    v = jnp.asarray(rng.integers(-3, 64, 500).astype(np.int32))
    for side in ("left", "right"):
        np.testing.assert_array_equal(groups.search_sorted(a, v, side), jnp.searchsorted(a, v, side=side))
    hlo = jax.jit(lambda a, v: groups.search_sorted(a, v, "right")).lower(a, v).compile().as_text()
    assert " while(" not in hlo
