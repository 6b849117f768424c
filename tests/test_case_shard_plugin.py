"""The subprocess case files' sharding (``case_shard_plugin.py``): the shards of a case
file partition its cases, and a bad ``JGM_CASE_SHARD`` is refused."""

from __future__ import annotations

import types

import pytest

import case_shard_plugin as plugin


@pytest.mark.parametrize("count, n", [(0, 3), (1, 3), (7, 3), (26, 3), (32, 5), (9, 9)])
def test_shards_partition_the_cases_in_order(count, n):
    bounds = [plugin.shard_bounds(count, i, n) for i in range(n)]
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    lengths = [stop - start for start, stop in bounds]
    assert max(lengths) - min(lengths) <= 1


def test_the_hook_keeps_its_shard_and_reports_the_rest(monkeypatch):
    deselected = []
    config = types.SimpleNamespace(hook=types.SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
    items = [f"case{k}" for k in range(8)]
    kept = []
    for i in range(3):
        monkeypatch.setenv("JGM_CASE_SHARD", f"{i}/3")
        shard = list(items)
        plugin.pytest_collection_modifyitems(config, shard)
        kept += shard
    assert kept == items
    assert sorted(deselected) == sorted(items * 2)
    monkeypatch.delenv("JGM_CASE_SHARD")
    whole = list(items)
    plugin.pytest_collection_modifyitems(config, whole)
    assert whole == items


@pytest.mark.parametrize("spec", ["3/3", "-1/2", "1", "a/b", "1/0"])
def test_a_bad_shard_is_refused(monkeypatch, spec):
    monkeypatch.setenv("JGM_CASE_SHARD", spec)
    with pytest.raises(ValueError, match="JGM_CASE_SHARD"):
        plugin.shard_of_env()
