"""Reads off a traced program where each named residual lives between forward and backward.

``jax.checkpoint`` (remat) with a policy turns into a ``remat`` equation whose inputs
are the residuals it saved. For every such equation we look at where each input
came from: a ``name`` equation (kept on the device), a ``device_put`` to host memory
of a named value (offloaded), or nothing named (the name was recomputed inside the
remat body). This is what the tests, the demo and the planner use to show that a
policy did what it says, without running anything.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import jax
from jax.extend import core as jex_core

UNNAMED_OFFLOAD = "<unnamed>"
# Value-preserving primitives that remat may put between a ``name`` and the saved value.
_ALIASES = frozenset({"reduce_precision", "copy", "copy_p"})


def _is_to_host(eqn) -> bool:
    if eqn.primitive.name != "device_put":
        return False
    return any(getattr(d, "name", None) == "Host" or str(d).endswith("Host") for d in eqn.params.get("devices", ()))


def _names_in(jaxpr) -> set[str]:
    found: set[str] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            found.add(eqn.params["name"])
        for sub in jex_core.jaxprs_in_params(eqn.params):
            found |= _names_in(sub)
    return found


def _walk(jaxpr, out: dict[str, collections.Counter]) -> None:
    named: dict[Any, str] = {}
    host_copy_of: dict[Any, str] = {}
    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        if prim == "name":
            named[eqn.outvars[0]] = eqn.params["name"]
        elif prim in _ALIASES and eqn.invars[0] in named:
            named[eqn.outvars[0]] = named[eqn.invars[0]]
        elif _is_to_host(eqn):
            for src, dst in zip(eqn.invars, eqn.outvars):
                if src in named:
                    host_copy_of[dst] = named[src]
                else:
                    out[UNNAMED_OFFLOAD]["offload"] += 1
        if prim in ("remat", "remat2", "checkpoint") and eqn.params.get("differentiated", False):
            body = eqn.params["jaxpr"]
            body = getattr(body, "jaxpr", body)
            saved: set[str] = set()
            for v in eqn.invars:
                if v in host_copy_of:
                    out[host_copy_of[v]]["offload"] += 1
                    saved.add(host_copy_of[v])
                elif v in named:
                    out[named[v]]["device"] += 1
                    saved.add(named[v])
            for n in _names_in(body) - saved:
                out[n]["recompute"] += 1
        for sub in jex_core.jaxprs_in_params(eqn.params):
            _walk(sub, out)


def residual_placements(fn: Callable, *args, **kwargs) -> dict[str, str]:
    """Traces ``fn(*args, **kwargs)`` (a function that takes gradients) and reports residual placement.

    Returns a dict from each ``checkpoint_name`` found at a remat boundary to
    ``"offload"``, ``"device"`` or ``"recompute"`` (``"mixed"`` if different layers
    placed it differently). A host copy of anything unnamed (a weight, say) shows up
    under the key ``"<unnamed>"``.

    Example::

        grad_fn = jax.grad(jax.checkpoint(loss, policy=offload_policy()))
        residual_placements(grad_fn, params, batch)
        # {'activation_input': 'offload', 'fc1_input': 'offload', 'fc2_input': 'offload'}
    """
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    _walk(closed.jaxpr, counts)
    result: dict[str, str] = {}
    for name, c in sorted(counts.items()):
        kinds = [k for k, v in c.items() if v]
        if kinds:
            result[name] = kinds[0] if len(kinds) == 1 else "mixed"
    return result
