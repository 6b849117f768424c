"""Residual tags that carry out the remat policy's choice themselves.

:func:`tag` marks a residual of :func:`grouped_mlp` like ``checkpoint_name`` does:
a ``jax.checkpoint`` policy is asked about it exactly as about a ``checkpoint_name``
of the same name (``policy(name_p, aval, name=...)``), so ``offload_policy`` and any
other name-based policy place it. What differs is what happens then, in this
primitive's partial-evaluation rule for remat (``partial_eval_jaxpr_custom``):

* **saved** on the device: as with ``checkpoint_name``;
* **offloaded**: the forward writes the host copy with this module's own transfer
  (the same ``annotate_device_placement`` custom calls that ``jax.device_put`` to
  ``pinned_host`` lowers to on GPU/TPU). On the CPU it makes no copy: the residual
  stays where it is, since host and device memory are one there (``jax.device_put``
  would make a copy that saves nothing). JAX's
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
import functools
import sys
from typing import Callable, Sequence

import jax
import numpy as np
from jax import lax
from jax._src import core, sharding_impls
from jax.ad_checkpoint import checkpoint_name
from jax._src.ad_checkpoint import name_p, remat_p
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from jax_grouped_mlp._src import warn

# Value modes of ``residual_p``: "value" (the identity), "offload" (the values, their
# host copies, and a token that exists once the copies are written: what :func:`fence`
# waits for), "rebuild" (``rebuild(*extra)``; only in the backward pass).
residual_p = core.Primitive("grouped_mlp_residual")
residual_p.multiple_results = True
# The reload of an offloaded residual (multiple arrays at once); with
# ``memory_kind="pinned_host"`` the copy out (:func:`to_host`).
to_device_p = core.Primitive("grouped_mlp_to_device")
to_device_p.multiple_results = True
# The op's output, usable only once the host copies of its residuals exist (modes
# "value": the identity on the output; "wait": its first element rewritten from the
# read-backs of the host copies, made by remat's rule below).
fence_p = core.Primitive("grouped_mlp_fence")

_GPU_TPU = ("cuda", "rocm", "tpu")
# Where the host-copy fence (:func:`fence`) is built: measured on NVIDIA GPUs only (the
# read-back path through XLA's host offloader is untested on ROCm and TPU).
_FENCED = ("cuda",)

# False: tag with plain ``checkpoint_name`` and let JAX offload (the behaviour before
# these tags: a jitted step's second call compiles again, and a recomputed
# "fc2_input" reruns whatever wrote it). For comparing, and for programs that return
# offloaded residuals from ``jax.jit`` (``jax.vjp`` under jit): JAX gives those
# outputs the ``pinned_host`` memory kind only when it sees its own transfer.
# Read at trace time.
OWN_TRANSFERS = True

# Experiment (off): an offloaded residual comes back to the device in the op's
# backward rule, once the layer's cotangent exists (``after_cotangent``), instead of
# where remat's backward program starts; not inside ``scan``/``while`` bodies. It keeps
# a Python loop's offload under ``jax.checkpoint(prevent_cse=False)``, which XLA
# otherwise folds away (measured on the H200, docs/notes/2026-12-02-reloads-and-prevent-cse.md),
# but is not on by default: a recomputed "fc2_input" then reloads "activation_input"
# twice, and a layer linearized outside a scan and transposed inside one would hand
# host buffers to the kernels. Read at partial evaluation, when the backward rule is
# traced and at lowering, each cached by JAX (call ``jax.clear_caches()`` after
# changing it).
RELOAD_AFTER_COTANGENT = False

# The op's output waits for the host copies of its offloaded residuals (:func:`fence`):
# the device->host copies must finish before the next layer starts, so each
# residual's device buffer dies with its layer. Without it, in an unrolled stack of
# layers XLA's latency-hiding scheduler may finish a copy only just before its reload
# in the backward pass, and the device buffer stays allocated until then (measured on
# the H200: a Python loop of offloaded layers kept nearly all device copies). Read when
# remat partially evaluates a layer, which JAX caches per layer function and policy
# (call ``jax.clear_caches()`` after changing it); False is for A/B measurements.
FENCE_HOST_COPIES = True


@dataclasses.dataclass(frozen=True)
class FencedByCaller:
    """A remat policy (``policy``) whose offloaded residuals get no fence of their own:
    the caller (``layer_stack``) makes a later layer wait for the host copies instead
    (:func:`wait_for_host`). A distinct policy object, so JAX's caches of remat's
    partial evaluation (keyed by the policy) keep the two kinds apart."""

    policy: Callable

    def __call__(self, *args, **kwargs):
        return self.policy(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class DeferredOffload:
    """A remat policy (``policy``) whose offloaded residuals stay on the device, passed
    through exactly where the host copies would be (same residuals, same order as under
    ``policy``): the caller (``layer_scan``) writes them to the host later itself."""

    policy: Callable

    def __call__(self, *args, **kwargs):
        return self.policy(*args, **kwargs)


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
        extra: Sequence[jax.Array] = (), after: jax.Array | None = None) -> list[jax.Array]:
    """``values`` (the arrays of one residual), tagged ``name`` for the remat policy.

    ``extra`` are the inputs of ``rebuild`` (unused in the forward pass). ``after``:
    the array that :func:`fence` will make wait for this residual's host copies (the
    op's output); the copies are read back only once it exists, so the wait falls
    after it (never read in the backward pass).
    """
    values, extra = list(values), list(extra)
    if rebuild is None and extra:
        raise ValueError("extra inputs need a rebuild function")
    if not OWN_TRANSFERS:
        return [checkpoint_name(v, name) for v in values]
    tail = [] if after is None else [after]
    return residual_p.bind(*values, *extra, *tail, name=name, num_values=len(values), mode="value",
                           rebuild=rebuild, jaxpr=None, out_avals=None, memory_kind=None, read_back=False,
                           has_after=after is not None)


# The "copies written" token: an int32 scalar (remat rounds inexact residuals that the
# forward also reads with reduce_precision; a token is neither).
_TOKEN_AVAL = core.ShapedArray((), jax.numpy.int32)


def _host_aval(aval):
    return aval.update(memory_space=core.MemorySpace.Host)


def _abstract_eval(*avals, name, num_values, mode, rebuild, jaxpr, out_avals, memory_kind, read_back, has_after):
    del name, rebuild, jaxpr, read_back, has_after
    if mode == "rebuild":
        return list(out_avals)
    if mode == "on_host":  # a host copy handed on as is (RELOAD_AFTER_COTANGENT)
        return [a.update(memory_space=core.MemorySpace.Device) for a in avals[:num_values]]
    values = list(avals[:num_values])
    if mode == "offload":
        copies = values if memory_kind == "device" else [_host_aval(a) for a in values]  # (DeferredOffload)
        return values + copies + [_TOKEN_AVAL]
    return values


residual_p.def_abstract_eval(_abstract_eval)
# The rebuild program (a parameter in "rebuild" mode) holds only ordinary operations;
# newer JAX would otherwise ask for a "to_lojax" rule because a parameter is a program.
residual_p.is_high = lambda *avals, **params: False
to_device_p.def_abstract_eval(lambda *avals, memory_kind: [  # (any host kind: pinned_host, unpinned_host)
    a.update(memory_space=core.MemorySpace.Device if memory_kind == "device" else core.MemorySpace.Host)
    for a in avals])


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


def _lowering(ctx, *args, name, num_values, mode, rebuild, jaxpr, out_avals, memory_kind, read_back, has_after,
              annotate):
    del name, rebuild, out_avals
    if mode == "rebuild":
        extra = args[num_values:]
        if annotate and RELOAD_AFTER_COTANGENT:  # an input may still be a host copy
            extra = [_annotate(v, "device") for v in extra]
        return mlir.lower_fun(core.jaxpr_as_fun(jaxpr), multiple_results=True)(ctx, *extra)
    values = list(args[:num_values])
    if mode == "offload":
        if not annotate or memory_kind == "device":  # (CPU; DeferredOffload: no copy)
            return values + values + [mlir.ir_constant(np.int32(0))]
        host = [_annotate(v, memory_kind) for v in values]
        token = mlir.ir_constant(np.int32(0))
        if read_back and _per_device_program(ctx):
            # Read once the fence's output exists (the last operand), or else at once.
            index = _zero_from(ctx, args[-1], ctx.avals_in[-1]) if has_after else token
            token = _read_back(ctx, host, ctx.avals_in[:num_values], index)
        return values + host + [token]
    return values


def _per_device_program(ctx) -> bool:
    """Whether this lowering's arrays are each one device's own (one device, or inside
    ``shard_map`` over every mesh axis): only there is reading one element local. Under
    automatic partitioning a slice of a sharded host copy could turn into collectives."""
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, sharding_impls.ShardingContext):
        return axis_context.num_devices == 1
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        return axis_context.manual_axes == frozenset(axis_context.mesh.axis_names)
    return False


def _read_back(ctx, host: list[ir.Value], avals, index: ir.Value) -> ir.Value:
    """An int32 scalar that exists only once every host copy in ``host`` is written:
    one element of each, at ``index`` (an int32 zero) along every axis, read back to
    the device.

    XLA's host offloader turns a host copy into a device->host copy whose completion
    the GPU scheduler puts just before the copy's first reader. The backward reload
    alone lets that be the backward pass, and the device buffer lives until then; a
    read in the forward pass (a one-element slice moved to the device: a path the
    offloader accepts) makes the copy complete there. A barrier on the host values
    themselves, or on a token beside them, orders nothing (the offloader walks through
    barriers; measured on the H200). The read is asynchronous, and XLA's scheduler
    starts it as early as its operands allow, pulling the copy's completion with it:
    ``index`` computed from the output that waits (:func:`_zero_from`) keeps it, and
    so the wait, after that output (measured on the H200: with constant indices the
    next layer waited for its copies before its first GEMM)."""
    token = mlir.ir_constant(np.int32(0))
    scalar = core.ShapedArray((), np.int32)
    for value, aval in zip(host, avals):
        if aval.size == 0:  # no element to read, and no copy to wait for
            continue
        one = aval.update(shape=(1,) * aval.ndim)
        piece = mlir.dynamic_slice(ctx, one, value, start_indices=[index] * aval.ndim)
        piece = mlir.reshape(ctx, _annotate(piece, "device"), aval.update(shape=()))
        token = hlo.add(token, mlir.convert_hlo(ctx, piece, aval.update(shape=()), scalar))
    return token


def _zero_from(ctx, out: ir.Value, aval) -> ir.Value:
    """An int32 zero computed from ``out``'s first element (``(2 t) & 1``), which XLA
    cannot prove to be zero: whatever reads it comes after ``out``. A constant for
    outputs that are empty or not 8-64 bit floats."""
    if aval.size == 0 or not _float_bits(aval):
        return mlir.ir_constant(np.int32(0))
    bits_dtype = np.dtype(f"uint{_float_bits(aval)}")
    one = aval.update(shape=(1,) * aval.ndim)
    first = mlir.slice_op(ctx, out, one, start_indices=(0,) * aval.ndim, limit_indices=(1,) * aval.ndim,
                          strides=(1,) * aval.ndim)
    (bits_type,) = mlir.aval_to_ir_types(ctx.module_context, one.update(dtype=bits_dtype))
    bits = mlir.reshape(ctx, hlo.bitcast_convert(bits_type, first), one.update(shape=(), dtype=bits_dtype))
    scalar = core.ShapedArray((), np.int32)
    t = mlir.convert_hlo(ctx, bits, scalar.update(dtype=bits_dtype), scalar)
    return hlo.and_(hlo.shift_left(t, mlir.ir_constant(np.int32(1))), mlir.ir_constant(np.int32(1)))


def _float_bits(aval) -> int:
    """The bit width of ``aval``'s dtype if it is an 8-64 bit float, else 0."""
    if not jax.numpy.issubdtype(aval.dtype, jax.numpy.floating):
        return 0
    bits = jax.numpy.finfo(aval.dtype).bits
    return bits if bits in (8, 16, 32, 64) else 0


def _lowering_on(ctx, *args, fence: bool, read_back: bool, **params):
    """The GPU/TPU lowering: real transfers; read-backs only where the fence is built."""
    return _lowering(ctx, *args, **params, read_back=read_back and fence, annotate=True)


def _to_device_lowering(ctx, *args, memory_kind, annotate):
    return [_annotate(v, memory_kind) for v in args] if annotate else list(args)


mlir.register_lowering(residual_p, lambda ctx, *a, **p: _lowering(ctx, *a, **p, annotate=False))
mlir.register_lowering(to_device_p, lambda ctx, *a, **p: _to_device_lowering(ctx, *a, **p, annotate=False))
for _platform in _GPU_TPU:
    mlir.register_lowering(
        residual_p, functools.partial(_lowering_on, fence=_platform in _FENCED), platform=_platform
    )
    mlir.register_lowering(
        to_device_p, lambda ctx, *a, **p: _to_device_lowering(ctx, *a, **p, annotate=True), platform=_platform
    )


def _jvp(primals, tangents, *, num_values, **params):
    if params["mode"] == "rebuild":  # differentiating the backward pass: the rebuild's own derivative
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        out, out_dot = jax.jvp(core.jaxpr_as_fun(params["jaxpr"]), list(primals), tangents)
        return list(out), list(out_dot)
    out = residual_p.bind(*primals, num_values=num_values, **params)
    values_dot = list(tangents[:num_values])
    if params["mode"] == "offload":
        # Differentiating a program that makes host copies (grad of grad): each copy's
        # tangent is its value's tangent, moved where the copy lives (the reload's rule
        # moves it back with the copy); the token has none.
        copies = out[num_values:2 * num_values]
        return out, values_dot + _moved(values_dot, copies, params["memory_kind"]) + [
            ad.Zero(_TOKEN_AVAL.to_tangent_aval())]
    if params["mode"] != "value":
        raise NotImplementedError(f"differentiating a {params['mode']!r} residual tag")
    return out, values_dot


ad.primitive_jvps[residual_p] = _jvp


def _batch(args, dims, *, num_values, **params):
    if params["mode"] == "rebuild":  # the staged rebuild, batched: run its program under vmap
        in_axes = [d if isinstance(d, int) else None for d in dims]
        return list(jax.vmap(core.jaxpr_as_fun(params["jaxpr"]), in_axes=in_axes)(*args)), [0] * len(
            params["out_avals"])
    if params["rebuild"] is not None:
        # A batched tag drops its rebuild (traced for the unbatched shapes): recomputing
        # it then replays what produced the value, as a plain checkpoint_name would.
        tail = slice(len(args) - 1, None) if params["has_after"] else slice(0, 0)  # ``after`` stays
        args, dims = [*args[:num_values], *args[tail]], [*dims[:num_values], *dims[tail]]
        params = {**params, "rebuild": None}
    out = residual_p.bind(*args, num_values=num_values, **params)
    out_dims = list(dims[:num_values])
    if params["mode"] == "offload":
        return out, out_dims * 2 + [None]  # the token is not batched
    return out, out_dims


batching.primitive_batchers[residual_p] = _batch


def _moved(tangents, outs, memory_kind: str) -> list:
    """``tangents`` moved to ``memory_kind`` like the primal values that became ``outs``
    (symbolic zeros stay zeros, of the outputs' tangent types)."""
    moved = [ad.Zero(o.aval.to_tangent_aval()) if type(t) is ad.Zero else t for t, o in zip(tangents, outs)]
    live = [i for i, t in enumerate(moved)
            if type(t) is not ad.Zero and jax.typeof(t).memory_space != jax.typeof(outs[i]).memory_space]
    if live:
        for i, t in zip(live, to_device_p.bind(*[moved[i] for i in live], memory_kind=memory_kind)):
            moved[i] = t
    return moved


# A move between memories: the tangents move with the values (grad of grad reads the
# tangents of offloaded residuals where their reloads put the values).
ad.primitive_jvps[to_device_p] = lambda primals, tangents, **p: (
    (out := to_device_p.bind(*primals, **p)), _moved(tangents, out, p["memory_kind"]))


def _to_device_transpose(cts, *args, memory_kind):
    """A move's cotangents move back to where its inputs were (grad of grad through a
    reload: the cotangent of a host copy lives on the host)."""
    del memory_kind
    out = []
    for ct, x in zip(cts, args):
        if not ad.is_undefined_primal(x):
            out.append(None)
        elif type(ct) is ad.Zero:
            out.append(ad.Zero(x.aval.to_tangent_aval()))
        elif jax.typeof(ct).memory_space == x.aval.memory_space:
            out.append(ct)
        else:
            home = "device" if x.aval.memory_space == core.MemorySpace.Device else "pinned_host"
            out.append(to_device_p.bind(ct, memory_kind=home)[0])
    return out


ad.primitive_transposes[to_device_p] = _to_device_transpose
batching.primitive_batchers[to_device_p] = lambda args, dims, **p: (to_device_p.bind(*args, **p), list(dims))


def _needs(inst_in, invars) -> list:
    """The known inputs that the backward pass must receive (residuals)."""
    return [v for v, inst in zip(invars, inst_in) if not inst and isinstance(v, core.Var)]


def _partial_eval_custom(saveable, unks_in, inst_in, eqn):
    """remat's rule: the policy's answer for ``name`` decides, as for ``checkpoint_name``."""
    params = eqn.params
    n = params["num_values"]
    if any(unks_in) or params["mode"] != "value":  # not a forward value: stage it as is
        outs = len(eqn.outvars)  # (an offload's values, host copies and token; a rebuild's)
        return None, eqn, [True] * outs, [True] * outs, _needs(inst_in, eqn.invars)
    case = pe.ensure_enum(saveable(name_p, eqn.outvars[0].aval, name=params["name"]))
    for v in eqn.outvars:  # a fresh answer: forget the token of an earlier pass
        _TOKENS.pop(id(v), None)
    if isinstance(case, pe.SaveableType):
        return eqn, None, [False] * n, [False] * n, []
    if isinstance(case, pe.Offloadable):
        deferred = isinstance(saveable, DeferredOffload)
        host = [core.Var(v.aval if deferred else _host_aval(v.aval)) for v in eqn.outvars]
        token = core.Var(_TOKEN_AVAL)
        # A loop's iteration already bounds its copies: no read-back there, and the
        # reload is the loop offloading's own.
        in_loop = _in_loop_body()
        read_back = (FENCE_HOST_COPIES and not in_loop
                     and not isinstance(saveable, (FencedByCaller, DeferredOffload)))  # fmt: skip
        if not (in_loop or RELOAD_AFTER_COTANGENT or deferred):
            _warn_if_cse_allowed(params["name"])
        known = core.new_jaxpr_eqn(
            eqn.invars, [*eqn.outvars, *host, token], residual_p,
            {**params, "mode": "offload", "memory_kind": "device" if deferred else case.dst,
             "read_back": read_back}, eqn.effects,
            eqn.source_info,
        )  # fmt: skip
        if read_back:
            for v in eqn.outvars:
                _remember_token(v, token)
        if RELOAD_AFTER_COTANGENT and not in_loop and not deferred:  # stays on the host until after_cotangent
            reload = core.new_jaxpr_eqn(host, list(eqn.outvars), residual_p,
                                        {**params, "mode": "on_host", "rebuild": None, "has_after": False},
                                        frozenset(),
                                        eqn.source_info)  # fmt: skip
        else:
            reload = core.new_jaxpr_eqn(host, list(eqn.outvars), to_device_p, {"memory_kind": case.src},
                                        frozenset(), eqn.source_info)  # fmt: skip
        return known, reload, [False] * n, [True] * n, host
    # Recompute (``after`` is not needed for that: the backward's tag never reads back).
    end = len(eqn.invars) - params["has_after"]
    if params["rebuild"] is None:
        staged = eqn.replace(invars=eqn.invars[:end], params={**params, "has_after": False})
        return eqn, staged, [False] * n, [True] * n, _needs(inst_in[:end], eqn.invars[:end])
    extra_vars, extra_inst = eqn.invars[n:end], inst_in[n:end]
    # The rebuild as a program in the backward pass (what it runs is visible there).
    jaxpr = jax.make_jaxpr(params["rebuild"].fn)(*[v.aval for v in extra_vars])
    staged = core.new_jaxpr_eqn(
        extra_vars, list(eqn.outvars), residual_p,
        {**params, "num_values": 0, "mode": "rebuild", "jaxpr": jaxpr,
         "out_avals": tuple(v.aval for v in eqn.outvars), "has_after": False},
        eqn.effects, eqn.source_info,
    )  # fmt: skip
    return eqn, staged, [False] * n, [True] * n, _needs(extra_inst, extra_vars)


pe.partial_eval_jaxpr_custom_rules[residual_p] = _partial_eval_custom


@functools.cache
def _loop_rule_codes() -> frozenset:
    """The code of JAX's partial-evaluation, linearization, transposition and JVP rules
    for ``scan`` and ``while`` (the JVP rule traces a ``custom_vjp`` forward inside the
    body, e.g. ``layer_stack``'s) (looked up in JAX's rule tables, so no private function is
    named)."""
    codes = set()
    for prim in (lax.scan_p, lax.while_p):
        for table in (pe.custom_partial_eval_rules, pe.partial_eval_jaxpr_custom_rules,
                      getattr(ad, "primitive_linearizations", {}), getattr(ad, "fancy_transposes", {}),
                      ad.primitive_transposes, ad.primitive_jvps):
            rule = table.get(prim)
            while isinstance(rule, functools.partial):
                rule = rule.func
            code = getattr(rule, "__code__", None)
            if code is not None:
                codes.add(code)
    return frozenset(codes)


def _in_loop_body() -> bool:
    """Whether remat is partially evaluating, or the op's backward rule is being traced
    for, the body of a ``scan``/``while`` (a layer of ``jax.lax.scan``, ``nnx.scan``,
    ``fori_loop``) right now. A scanned layer is partially evaluated and transposed
    inside these rules; a layer linearized outside a loop and transposed inside one
    gets two different answers (why ``RELOAD_AFTER_COTANGENT`` is off).

    There the host copies need no fence: XLA writes a loop's offloaded residuals into
    a stacked host buffer with an asynchronous dynamic-update-slice that finishes
    inside its iteration, and a read-back would add a second device->host copy of
    every residual (measured on the H200: 20 instead of 15 transfers, the scan step
    171 -> 225 ms). tests/test_offload_fence.py pins the answer for both layouts."""
    codes = _loop_rule_codes()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


@functools.cache
def _remat_rule_code():
    rule = pe.custom_partial_eval_rules.get(remat_p)
    return getattr(rule, "__code__", None)


def _warn_if_cse_allowed(name: str) -> None:
    """Warn when the ``jax.checkpoint`` being partially evaluated (outside a loop body)
    has ``prevent_cse=False``: nothing then keeps XLA from folding the host copy and its
    reload into nothing (measured on the H200 in a Python loop of layers: no transfer,
    the device memory of keeping everything). Found by reading remat's rule's frame; no
    warning when JAX's internals differ."""
    code = _remat_rule_code()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            if frame.f_locals.get("prevent_cse") is False:
                warn.warn(
                    f"jax.checkpoint(..., prevent_cse=False) around a layer whose policy offloads {name!r}: "
                    "outside a scan, XLA removes the host copy and keeps the residual on the device. Keep "
                    "prevent_cse=True (the default) for layers in a Python loop (docs/offload.md, "
                    "\"Layer stacks\").")
            return
        frame = frame.f_back


# Offloaded residual -> the token of its host copies' read-backs, from this rule to
# :func:`fence`'s rule in the same partial evaluation (the tag always comes first in
# program order). An int32 token, not the host copies themselves: remat rounds inexact
# residuals that the forward also reads (``reduce_precision``), which would change FP8
# data and E8M0 scales. Keyed by ``id`` (``core.Var`` takes no weak reference) with the
# variable kept for an identity check; the fence takes its entries out, and the size is
# bounded for tags whose fence never came (a tag used on its own).
_TOKENS: dict[int, tuple[core.Var, core.Var]] = {}
_MAX_REMEMBERED = 4096


def _remember_token(value: core.Var, token: core.Var) -> None:
    if len(_TOKENS) >= _MAX_REMEMBERED:
        _TOKENS.clear()
    _TOKENS[id(value)] = (value, token)


def _token_of(value) -> core.Var | None:
    entry = _TOKENS.pop(id(value), None)
    return entry[1] if entry is not None and entry[0] is value else None


def fence(out: jax.Array, residual_arrays: Sequence[jax.Array]) -> jax.Array:
    """``out`` (the op's output), which under remat becomes usable only once the host
    copies of those of ``residual_arrays`` (tagged arrays) that the policy offloads are
    written. The identity otherwise, and without ``FENCE_HOST_COPIES``/``OWN_TRANSFERS``.

    The copies still overlap the rest of the layer (they start as soon as each
    residual exists); what the fence removes is the scheduler's freedom to finish a
    copy, and so free its device buffer, only where the backward pass reloads it.
    """
    if not (FENCE_HOST_COPIES and OWN_TRANSFERS):
        return out
    return fence_p.bind(out, *residual_arrays, mode="value")


fence_p.def_abstract_eval(lambda out, *rest, mode: out)
fence_p.def_impl(lambda out, *rest, mode: out)
mlir.register_lowering(fence_p, lambda ctx, out, *rest, mode: [out])


def _fence_wait_lowering(ctx, out, *tokens, mode):
    """``out`` usable only once the read-backs in ``tokens`` exist (:func:`_after_token`)."""
    if mode == "value" or not tokens or not _per_device_program(ctx):
        return [out]  # (no read-backs either without a per-device program)
    token = tokens[0]
    for t in tokens[1:]:
        token = hlo.add(token, t)
    return [_after_token(ctx, out, token, ctx.avals_in[0])]


def _after_token(ctx, out: ir.Value, token: ir.Value, aval) -> ir.Value:
    """``out`` with its first element rewritten to itself OR-ed with bits that are
    always zero but computed from the int32 ``token`` (the read-backs of host copies):
    the identity, bit for bit, that XLA cannot prove to be one, so every consumer of
    ``out`` comes after the copies. An optimization barrier would not do: XLA drops a
    barrier's unused outputs, and with them the read-backs (measured on the H200).
    Outputs that are empty or not 8-64 bit floats pass unchanged."""
    if aval.size == 0 or not _float_bits(aval):
        return out
    bits_dtype = np.dtype(f"uint{_float_bits(aval)}")
    one = aval.update(shape=(1,) * aval.ndim)
    one_bits = one.update(dtype=bits_dtype)
    scalar = core.ShapedArray((), np.int32)
    # (2 t) & 1 == 0 for every t.
    zero = mlir.convert_hlo(ctx, token, scalar, scalar.update(dtype=bits_dtype))
    zero = hlo.and_(hlo.shift_left(zero, mlir.ir_constant(bits_dtype.type(1))), mlir.ir_constant(bits_dtype.type(1)))
    first = mlir.slice_op(ctx, out, one, start_indices=(0,) * aval.ndim, limit_indices=(1,) * aval.ndim,
                          strides=(1,) * aval.ndim)
    (bits_type,) = mlir.aval_to_ir_types(ctx.module_context, one_bits)
    bits = hlo.or_(hlo.bitcast_convert(bits_type, first), mlir.reshape(ctx, zero, one_bits))
    (first_type,) = mlir.aval_to_ir_types(ctx.module_context, one)
    index = mlir.ir_constant(np.int32(0))
    return hlo.dynamic_update_slice(out, hlo.bitcast_convert(first_type, bits), [index] * aval.ndim)


for _platform in _FENCED:
    mlir.register_lowering(fence_p, _fence_wait_lowering, platform=_platform)


def _fence_jvp(primals, tangents, *, mode):
    return fence_p.bind(*primals, mode=mode), tangents[0]


ad.primitive_jvps[fence_p] = _fence_jvp
batching.primitive_batchers[fence_p] = lambda args, dims, *, mode: (fence_p.bind(*args, mode=mode), dims[0])


def _fence_partial_eval_custom(saveable, unks_in, inst_in, eqn):
    """remat's rule: the forward's output made to wait ("wait" mode) for the tokens of
    the host copies of its residual inputs, when their tags read them back; the
    backward's copy (if anything there needs the output) the plain identity."""
    del saveable
    out = eqn.invars[0]
    if any(unks_in) or eqn.params["mode"] != "value":
        return None, eqn, [True], [True], _needs(inst_in, eqn.invars)
    tokens = list(dict.fromkeys(t for t in map(_token_of, eqn.invars[1:]) if t is not None))
    known = core.new_jaxpr_eqn([out, *tokens], list(eqn.outvars), fence_p,
                               {"mode": "wait" if tokens else "value"}, frozenset(), eqn.source_info)
    staged = core.new_jaxpr_eqn([out], list(eqn.outvars), fence_p, {"mode": "value"}, frozenset(),
                                eqn.source_info)  # fmt: skip
    return known, staged, [False], [True], _needs(inst_in[:1], [out])


pe.partial_eval_jaxpr_custom_rules[fence_p] = _fence_partial_eval_custom


# ``out`` usable only once the host arrays after it are written (``wait_for_host``).
host_wait_p = core.Primitive("grouped_mlp_host_wait")
host_wait_p.def_abstract_eval(lambda out, *host: out)
host_wait_p.def_impl(lambda out, *host: out)
mlir.register_lowering(host_wait_p, lambda ctx, out, *host: [out])
ad.primitive_jvps[host_wait_p] = lambda primals, tangents: (host_wait_p.bind(*primals), tangents[0])
batching.primitive_batchers[host_wait_p] = lambda args, dims: (host_wait_p.bind(*args), dims[0])


def _host_wait_lowering(ctx, out, *host):
    """``out`` (first operand) rewritten through read-backs of ``host`` (the rest) taken
    after ``out`` exists; the identity outside per-device programs."""
    aval = ctx.avals_in[0]
    if not host or not _per_device_program(ctx) or aval.size == 0 or not _float_bits(aval):
        return [out]
    token = _read_back(ctx, list(host), ctx.avals_in[1:], _zero_from(ctx, out, aval))
    return [_after_token(ctx, out, token, aval)]


for _platform in _FENCED:
    mlir.register_lowering(host_wait_p, _host_wait_lowering, platform=_platform)


def wait_for_host(out: jax.Array, host_arrays: Sequence[jax.Array]) -> jax.Array:
    """``out``, usable only once every array in ``host_arrays`` (host copies made by
    this module's tags) is written: one element of each read back to the device, and
    ``out``'s first element rewritten through them (bit for bit the same). The
    fence of :func:`fence`, for a caller that ties one layer's copies to a later
    layer's output. The identity on the CPU and without ``FENCE_HOST_COPIES``."""
    if not (FENCE_HOST_COPIES and OWN_TRANSFERS) or not host_arrays:
        return out
    return host_wait_p.bind(out, *host_arrays)


def after_cotangent(residual_arrays: Sequence[jax.Array], cotangent) -> tuple[list[jax.Array], object]:
    """With ``RELOAD_AFTER_COTANGENT`` (outside loop bodies): the residual arrays, each
    on the device, usable only once ``cotangent`` (any pytree) exists. An optimization
    barrier ties the (possibly host) arrays to the cotangent, then each is moved to the
    device; XLA drops the move for an array that was on the device already. Otherwise
    the identity (there remat's own reload brought them back)."""
    arrays = list(residual_arrays)
    if not RELOAD_AFTER_COTANGENT or _in_loop_body():
        return arrays, cotangent
    return reload_after(arrays, cotangent)


def to_host(arrays: Sequence[jax.Array], memory_kind: str = "pinned_host") -> list[jax.Array]:
    """Host copies of ``arrays`` in ``memory_kind`` (device->host copies on GPU/TPU, the
    values as they are on the CPU, like the tags' own offload): what ``layer_scan``
    writes one iteration after the layer that made them."""
    arrays = list(arrays)
    return to_device_p.bind(*arrays, memory_kind=memory_kind) if arrays else []


def reload_after(arrays: Sequence[jax.Array], cotangent) -> tuple[list[jax.Array], object]:
    """``arrays`` (host or device), each moved to the device once ``cotangent`` (any
    pytree) exists, and ``cotangent``: an optimization barrier ties them, then each is
    moved; XLA drops the move of an array that was on the device already."""
    arrays = list(arrays)
    # E8M0 scales (1/32 of their data's bytes) stay out of the barrier: with them in it,
    # its transpose fails in grad of grad (jax 0.12: AttributeError "no attribute
    # accum" in _opt_barrier_fancy_transpose).
    tied = [i for i, a in enumerate(arrays) if a.dtype != _E8M0]
    out, cotangent = jax.lax.optimization_barrier(([arrays[i] for i in tied], cotangent))
    for i, a in zip(tied, out):
        arrays[i] = a
    return to_device_p.bind(*arrays, memory_kind="device"), cotangent


_E8M0 = np.dtype(jax.numpy.float8_e8m0fnu)
