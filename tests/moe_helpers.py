"""Jaxpr inspection for the MoE tests: which named residuals are copied to host memory."""

from __future__ import annotations

import collections

import jax
from jax.extend import core as jex_core


def _to_host(eqn) -> bool:
    return eqn.primitive.name == "device_put" and any(
        getattr(d, "name", None) == "Host" or str(d).endswith("Host") for d in eqn.params.get("devices", ())
    )


def host_copies(fn, *args) -> dict[str, collections.Counter]:
    """``{enclosing primitive: Counter(name of each value copied to host)}`` for ``fn(*args)``.

    The enclosing primitive is the innermost higher-order equation (``shard_map``,
    ``remat``, ...) whose body holds the copy, ``"<top>"`` outside any; a host copy
    of an unnamed value (a weight, say) counts as ``"<unnamed>"``.
    """
    found: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def walk(jaxpr, where):
        named = {}
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name":
                named[eqn.outvars[0]] = eqn.params["name"]
            elif eqn.primitive.name == "grouped_mlp_residual" and eqn.params["mode"] == "offload":
                # The op's own host copies (jax_grouped_mlp._src.op.residuals), one per array.
                found[where][eqn.params["name"]] += eqn.params["num_values"]
            elif _to_host(eqn):
                for v in eqn.invars:
                    key = named.get(v, "<unnamed>") if isinstance(v, jex_core.Var) else "<unnamed>"
                    found[where][key] += 1
            for sub in jex_core.jaxprs_in_params(eqn.params):
                walk(sub, eqn.primitive.name)

    walk(jax.make_jaxpr(fn)(*args).jaxpr, "<top>")
    return dict(found)
