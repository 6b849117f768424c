"""Reads off a traced program where each named residual lives between forward and backward.

Under ``jax.grad``, ``jax.checkpoint`` (remat) with a policy leaves one ``name``
equation per tagged value in the forward pass, follows it with a ``device_put`` to
host memory when the policy offloads it, and repeats the ``name`` equation inside the
differentiated remat body when the policy recomputes it. The op's own residual tags
(:mod:`residuals`) leave one tag equation per residual in the forward pass, in its
"offload" mode when the policy offloads it (the tag writes the host copy itself), and
a tag equation inside the remat body when it is recomputed. Counting those things per
name (through jit, scan, shard_map and other nested programs) tells where each
residual lives, without running anything and without having to link values across
program boundaries. This is what the tests, the demo and the planner use to
show that a policy did what it says.

A tagged value that the backward pass does not need at all is reported as
``"device"`` (the forward computed it and nothing moved or recomputed it).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Callable

import jax
from jax.extend import core as jex_core

UNNAMED_OFFLOAD = "<unnamed>"
_RESIDUAL_TAG = "grouped_mlp_residual"  # residuals.residual_p
# Value-preserving primitives that may sit between a ``name`` and its host copy.
_ALIASES = frozenset({"reduce_precision", "copy", "copy_p"})


def _is_to_host(eqn) -> bool:
    if eqn.primitive.name != "device_put":
        return False
    return any(getattr(d, "name", None) == "Host" or str(d).endswith("Host") for d in eqn.params.get("devices", ()))


def _is_remat_body_owner(eqn) -> bool:
    return eqn.primitive.name in ("remat", "remat2", "checkpoint") and eqn.params.get("differentiated", False)


def _nbytes(var) -> int:
    aval = var.aval
    return int(math.prod(aval.shape)) * aval.dtype.itemsize


def _walk(jaxpr, counts: dict[str, collections.Counter], in_body: bool) -> None:
    """Counts, per name, forward occurrences, host copies and recomputations (and their bytes)."""
    named: dict[Any, str] = {}
    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        if prim == _RESIDUAL_TAG:
            name, mode = eqn.params["name"], eqn.params["mode"]
            if mode == "on_host":  # the backward's handle on a host copy (not a recompute)
                continue
            values = eqn.outvars[: eqn.params["num_values"]] if mode == "offload" else eqn.outvars
            nbytes = sum(_nbytes(v) for v in values)
            if in_body:
                counts[name]["recompute"] += 1
            else:
                counts[name]["forward"] += 1
                counts[name]["forward_bytes"] += nbytes
                if mode == "offload":
                    counts[name]["offload"] += 1
                    counts[name]["host_bytes"] += nbytes
        elif prim == "name":
            name = eqn.params["name"]
            named[eqn.outvars[0]] = name
            if in_body:
                counts[name]["recompute"] += 1
            else:
                counts[name]["forward"] += 1
                counts[name]["forward_bytes"] += _nbytes(eqn.outvars[0])
        elif prim in _ALIASES and isinstance(eqn.invars[0], jex_core.Var) and eqn.invars[0] in named:
            named[eqn.outvars[0]] = named[eqn.invars[0]]
        elif _is_to_host(eqn):
            for src in eqn.invars:
                key = named.get(src, UNNAMED_OFFLOAD) if isinstance(src, jex_core.Var) else UNNAMED_OFFLOAD
                counts[key]["offload"] += 1
                if isinstance(src, jex_core.Var):
                    counts[key]["host_bytes"] += _nbytes(src)
        for sub in jex_core.jaxprs_in_params(eqn.params):
            _walk(sub, counts, in_body or _is_remat_body_owner(eqn))


@dataclasses.dataclass(frozen=True)
class ResidualReport:
    """Where one named residual lives, and how many bytes each layer keeps where.

    Bytes are summed over the traced program's ``name`` equations: a layer inside a
    ``scan`` body counts once, not once per iteration.
    """

    placement: str  # "offload", "device", "recompute" or "mixed"
    device_bytes: int
    host_bytes: int


def residual_report(fn: Callable, *args, **kwargs) -> dict[str, ResidualReport]:
    """Like :func:`residual_placements`, with the bytes kept on device and on host."""
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    _walk(closed.jaxpr, counts, in_body=False)
    result: dict[str, ResidualReport] = {}
    for name, c in sorted(counts.items()):
        if name == UNNAMED_OFFLOAD:
            result[name] = ResidualReport("offload", 0, c["host_bytes"])
            continue
        # Every placement computes the value once in the forward pass.
        device = max(c["forward"] - c["offload"] - c["recompute"], 0)
        kinds = {"offload": c["offload"], "recompute": c["recompute"], "device": device}
        present = [k for k, v in kinds.items() if v]
        if not present:
            continue
        per_occurrence = c["forward_bytes"] // max(c["forward"], 1)
        result[name] = ResidualReport(
            present[0] if len(present) == 1 else "mixed",
            device_bytes=per_occurrence * device,
            host_bytes=c["host_bytes"],
        )
    return result


def residual_placements(fn: Callable, *args, **kwargs) -> dict[str, str]:
    """Traces ``fn(*args, **kwargs)`` (a function that takes gradients) and reports residual placement.

    Returns a dict from each ``checkpoint_name`` found at a remat boundary to
    ``"offload"``, ``"device"`` or ``"recompute"`` (``"mixed"`` if different layers
    placed it differently). A host copy of anything unnamed (a weight, say) shows up
    under the key ``"<unnamed>"``. :func:`residual_report` adds the bytes. It reports
    what the traced program places: on the CPU, where host and device memory are one,
    an ``"offload"`` residual is not copied and saves nothing.

    A ``scan`` body counts once, whatever its length. Under :func:`layer_stack` and
    :func:`layer_scan`, whose last layers keep their residuals on the device by design,
    an offloading policy reads ``"device"`` for a single layer (``layer_stack``) or up to
    two (``layer_scan``) and ``"mixed"`` from there on (the first layers offload, the
    last does not).

    Example::

        grad_fn = jax.grad(jax.checkpoint(loss, policy=offload_policy()))
        residual_placements(grad_fn, params, batch)
        # {'activation_input': 'offload', 'fc1_input': 'offload', 'fc2_input': 'offload'}
    """
    return {name: r.placement for name, r in residual_report(fn, *args, **kwargs).items()}
