"""Residual tags that carry out the remat policy's choice themselves.

:func:`tag` marks a residual of :func:`grouped_mlp` like ``checkpoint_name`` does:
a ``jax.checkpoint`` policy is asked about it exactly as about a ``checkpoint_name``
of the same name (``policy(name_p, aval, name=...)``), so ``offload_policy`` and any
other name-based policy place it. What differs is what happens then, in this
primitive's partial-evaluation rule for remat (``partial_eval_jaxpr_custom``):

* **saved** on the device: as with ``checkpoint_name``;
* **offloaded**: the forward writes the host copy with this module's own transfer
  (the same ``annotate_device_placement`` custom calls that ``jax.device_put`` to
  ``pinned_host`` lowers to on GPU/TPU; on CPU, like ``device_put``, no copy). JAX's
  own offload would put a ``device_put`` to a memory *space* in the program, and
  ``jax.jit`` then commits every output of the step to its device, so the second
  call of a training step (whose state is now committed) compiled again;
* **recomputed**: with ``rebuild`` given, the backward pass computes the residual
  with ``rebuild(*extra)`` (e.g. "fc2_input" from "activation_input": one
  elementwise pass) instead of replaying whatever produced it in the forward pass
  (the fused FC1 kernel, with its GEMM); without, like ``checkpoint_name``.

Outside remat the tag is the identity.

This uses JAX internals (``partial_eval_jaxpr_custom_rules``, ``new_jaxpr_eqn``,
``mlir.custom_call``), stable since 2023 but not public API; the tests pin the
behaviour (tests/test_policy.py, tests/test_offload_policies.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
from jax._src import core
from jax.ad_checkpoint import checkpoint_name
from jax._src.ad_checkpoint import name_p
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lib.mlir import ir

# Value modes of ``residual_p``: "value" (the identity), "offload" (the values and
# their host copies), "rebuild" (``rebuild(*extra)``; only in the backward pass).
residual_p = core.Primitive("grouped_mlp_residual")
residual_p.multiple_results = True
# The reload of an offloaded residual (multiple arrays at once).
to_device_p = core.Primitive("grouped_mlp_to_device")
to_device_p.multiple_results = True

_GPU_TPU = ("cuda", "rocm", "tpu")

# False: tag with plain ``checkpoint_name`` and let JAX offload (the behaviour before
# these tags: a jitted step's second call compiles again, and a recomputed
# "fc2_input" reruns whatever wrote it). For comparing, and for programs that return
# offloaded residuals from ``jax.jit`` (``jax.vjp`` under jit): JAX gives those
# outputs the ``pinned_host`` memory kind only when it sees its own transfer.
# Read at trace time.
OWN_TRANSFERS = True

# Prototype (issue 17's lever; off by default, for measuring on the GPU): an offloaded
# residual comes back only in the op's backward rule, after the layer's cotangent
# exists (``after_cotangent``), instead of where remat's backward program starts,
# which XLA's scheduler is free to hoist. Read at trace time.
RELOAD_AFTER_COTANGENT = False


@dataclasses.dataclass(frozen=True)
class Rebuild:
    """How the backward pass recomputes a residual from other values (hashable:
    it is a parameter of the program). ``fn(*extra)`` returns the residual's arrays."""

    fn: Callable
    key: object  # equality and hash (fn is usually a fresh closure)

    def __eq__(self, other):
        return isinstance(other, Rebuild) and self.key == other.key

    def __hash__(self):
        return hash(self.key)


def tag(values: Sequence[jax.Array], name: str, *, rebuild: Rebuild | None = None,
        extra: Sequence[jax.Array] = ()) -> list[jax.Array]:
    """``values`` (the arrays of one residual), tagged ``name`` for the remat policy.

    ``extra`` are the inputs of ``rebuild`` (unused in the forward pass).
    """
    values, extra = list(values), list(extra)
    if rebuild is None and extra:
        raise ValueError("extra inputs need a rebuild function")
    if not OWN_TRANSFERS:
        return [checkpoint_name(v, name) for v in values]
    return residual_p.bind(*values, *extra, name=name, num_values=len(values), mode="value",
                           rebuild=rebuild, jaxpr=None, out_avals=None, memory_kind=None)


def _host_aval(aval):
    return aval.update(memory_space=core.MemorySpace.Host)


def _abstract_eval(*avals, name, num_values, mode, rebuild, jaxpr, out_avals, memory_kind):
    del name, rebuild, jaxpr, memory_kind
    if mode == "rebuild":
        return list(out_avals)
    if mode == "on_host":  # a host copy handed on as is (RELOAD_AFTER_COTANGENT)
        return [a.update(memory_space=core.MemorySpace.Device) for a in avals[:num_values]]
    values = list(avals[:num_values])
    if mode == "offload":
        return values + [_host_aval(a) for a in values]
    return values


residual_p.def_abstract_eval(_abstract_eval)
# The rebuild program (a parameter in "rebuild" mode) holds only ordinary operations;
# newer JAX would otherwise ask for a "to_lojax" rule because a parameter is a program.
residual_p.is_high = lambda *avals, **params: False
to_device_p.def_abstract_eval(lambda *avals, memory_kind: [a.update(memory_space=core.MemorySpace.Device) for a in avals])


def _impl(*args, **params):
    from jax._src import dispatch

    return dispatch.apply_primitive(residual_p, *args, **params)


def _to_device_impl(*args, **params):
    from jax._src import dispatch

    return dispatch.apply_primitive(to_device_p, *args, **params)


residual_p.def_impl(_impl)
to_device_p.def_impl(_to_device_impl)


def _annotate(x: ir.Value, memory_kind: str) -> ir.Value:
    """The custom call XLA's host offloader reads (what ``device_put`` emits on GPU/TPU)."""
    op = mlir.custom_call("annotate_device_placement", result_types=[x.type], operands=[x],
                          has_side_effect=True, api_version=1)
    op.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get(
        {"_xla_buffer_placement": ir.StringAttr.get(memory_kind)}
    )
    return op.result


def _lowering(ctx, *args, name, num_values, mode, rebuild, jaxpr, out_avals, memory_kind, annotate):
    del name, rebuild, out_avals
    if mode == "rebuild":
        extra = args[num_values:]
        if annotate and RELOAD_AFTER_COTANGENT:  # an input may still be a host copy
            extra = [_annotate(v, "device") for v in extra]
        return mlir.lower_fun(core.jaxpr_as_fun(jaxpr), multiple_results=True)(ctx, *extra)
    values = list(args[:num_values])
    if mode == "offload":
        host = [_annotate(v, memory_kind) for v in values] if annotate else values
        return values + host
    return values


def _to_device_lowering(ctx, *args, memory_kind, annotate):
    return [_annotate(v, memory_kind) for v in args] if annotate else list(args)


mlir.register_lowering(residual_p, lambda ctx, *a, **p: _lowering(ctx, *a, **p, annotate=False))
mlir.register_lowering(to_device_p, lambda ctx, *a, **p: _to_device_lowering(ctx, *a, **p, annotate=False))
for _platform in _GPU_TPU:
    mlir.register_lowering(residual_p, lambda ctx, *a, **p: _lowering(ctx, *a, **p, annotate=True), platform=_platform)
    mlir.register_lowering(
        to_device_p, lambda ctx, *a, **p: _to_device_lowering(ctx, *a, **p, annotate=True), platform=_platform
    )


def _jvp(primals, tangents, *, num_values, **params):
    if params["mode"] == "rebuild":  # differentiating the backward pass: the rebuild's own derivative
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        out, out_dot = jax.jvp(core.jaxpr_as_fun(params["jaxpr"]), list(primals), tangents)
        return list(out), list(out_dot)
    out = residual_p.bind(*primals, num_values=num_values, **params)
    if params["mode"] != "value":
        raise NotImplementedError(f"differentiating a {params['mode']!r} residual tag")
    return out, list(tangents[:num_values])


ad.primitive_jvps[residual_p] = _jvp


def _batch(args, dims, *, num_values, **params):
    if params["mode"] == "rebuild":  # the staged rebuild, batched: run its program under vmap
        in_axes = [d if isinstance(d, int) else None for d in dims]
        return list(jax.vmap(core.jaxpr_as_fun(params["jaxpr"]), in_axes=in_axes)(*args)), [0] * len(
            params["out_avals"])
    if params["rebuild"] is not None:
        # A batched tag drops its rebuild (traced for the unbatched shapes): recomputing
        # it then replays what produced the value, as a plain checkpoint_name would.
        args, dims = args[:num_values], dims[:num_values]
        params = {**params, "rebuild": None}
    out = residual_p.bind(*args, num_values=num_values, **params)
    out_dims = list(dims[:num_values])
    return out, out_dims * (2 if params["mode"] == "offload" else 1)


batching.primitive_batchers[residual_p] = _batch
batching.primitive_batchers[to_device_p] = lambda args, dims, **p: (to_device_p.bind(*args, **p), list(dims))


def _needs(inst_in, invars) -> list:
    """The known inputs that the backward pass must receive (residuals)."""
    return [v for v, inst in zip(invars, inst_in) if not inst and isinstance(v, core.Var)]


def _partial_eval_custom(saveable, unks_in, inst_in, eqn):
    """remat's rule: the policy's answer for ``name`` decides, as for ``checkpoint_name``."""
    params = eqn.params
    n = params["num_values"]
    if any(unks_in) or params["mode"] != "value":  # not a forward value: stage it as is
        return None, eqn, [True] * n, [True] * n, _needs(inst_in, eqn.invars)
    case = pe.ensure_enum(saveable(name_p, eqn.outvars[0].aval, name=params["name"]))
    if isinstance(case, pe.SaveableType):
        return eqn, None, [False] * n, [False] * n, []
    if isinstance(case, pe.Offloadable):
        host = [core.Var(_host_aval(v.aval)) for v in eqn.outvars]
        known = core.new_jaxpr_eqn(
            eqn.invars, [*eqn.outvars, *host], residual_p,
            {**params, "mode": "offload", "memory_kind": case.dst}, eqn.effects, eqn.source_info,
        )  # fmt: skip
        if RELOAD_AFTER_COTANGENT:  # stays on the host until after_cotangent
            reload = core.new_jaxpr_eqn(host, list(eqn.outvars), residual_p,
                                        {**params, "mode": "on_host", "rebuild": None}, frozenset(),
                                        eqn.source_info)  # fmt: skip
        else:
            reload = core.new_jaxpr_eqn(host, list(eqn.outvars), to_device_p, {"memory_kind": case.src},
                                        frozenset(), eqn.source_info)  # fmt: skip
        return known, reload, [False] * n, [True] * n, host
    # Recompute.
    if params["rebuild"] is None:
        return eqn, eqn, [False] * n, [True] * n, _needs(inst_in, eqn.invars)
    extra_vars, extra_inst = eqn.invars[n:], inst_in[n:]
    # The rebuild as a program in the backward pass (what it runs is visible there).
    jaxpr = jax.make_jaxpr(params["rebuild"].fn)(*[v.aval for v in extra_vars])
    staged = core.new_jaxpr_eqn(
        extra_vars, list(eqn.outvars), residual_p,
        {**params, "num_values": 0, "mode": "rebuild", "jaxpr": jaxpr,
         "out_avals": tuple(v.aval for v in eqn.outvars)},
        eqn.effects, eqn.source_info,
    )  # fmt: skip
    return eqn, staged, [False] * n, [True] * n, _needs(extra_inst, extra_vars)


pe.partial_eval_jaxpr_custom_rules[residual_p] = _partial_eval_custom


def after_cotangent(residual_arrays: Sequence[jax.Array], cotangent) -> tuple[list[jax.Array], object]:
    """With ``RELOAD_AFTER_COTANGENT``: the residual arrays, each on the device, usable
    only once ``cotangent`` (any pytree) exists. An optimization barrier ties the
    (possibly host) arrays to the cotangent, then each is moved to the device; XLA
    drops the move for an array that was on the device already. Otherwise the identity.
    """
    if not RELOAD_AFTER_COTANGENT:
        return list(residual_arrays), cotangent
    arrays, cotangent = jax.lax.optimization_barrier((list(residual_arrays), cotangent))
    return to_device_p.bind(*arrays, memory_kind="device"), cotangent
