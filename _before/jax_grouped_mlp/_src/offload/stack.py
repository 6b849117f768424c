"""``layer_stack``: a Python loop of checkpointed layers whose backward pass
prefetches each layer's offloaded residuals while the layer after it runs backward.

Why a helper: with one ``jax.checkpoint`` per layer, a layer's offloaded residuals
come back to the device only once that layer's own cotangent exists (remat's
``prevent_cse`` barrier ties them to it, and without that barrier XLA either folds the
copy away or brings every layer back at once). Each reload is then exposed: measured
on the H200 at the expert-parallel share of Nano, 8 layers all-offload took 168 ms
against 50 ms of compute and 62 ms of link time each way
(docs/notes/2026-12-02-reloads-and-prevent-cse.md). The layers cannot see each other;
this helper can. It runs the stack as one ``jax.custom_vjp``:

* forward: layer by layer, ``jax.vjp`` of ``jax.checkpoint(layer, policy=policy)``;
  each layer's residuals (its pullback's arrays, the op's host copies among them) are
  kept, exactly as the per-layer checkpoints would keep them. Layer ``i``'s output
  waits for layer ``i - 1``'s host copies (``residuals.wait_for_host``), not for its
  own (the op's fence, off here): each layer's copies overlap the next layer's
  compute. The last layer's residuals stay on the device (``offload_last``);
* backward: before layer ``i``'s pullback runs, layer ``i - 1``'s host residuals are
  tied to layer ``i``'s cotangent by an optimization barrier and moved to the device.
  The copies back then run during layer ``i``'s backward pass.

Either way one more layer's offloaded residuals are on the device at a time, once,
not per layer (the growth per layer is the loop's; measured on the H200:
docs/notes/2026-12-03-layer-stack.md).

The arithmetic is the per-layer loop's: the same pullbacks run on the same values, so
gradients are bitwise those of ``for p in params: x = jax.checkpoint(layer, policy)(p, x, *args)``
(tests/test_layer_stack.py), except where one array reaches the layers by two ways
(tied weights, ``x`` also in ``args``): its gradient's terms are then added in
another order (within a bf16 rounding).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.interpreters import partial_eval as pe

from jax_grouped_mlp._src import checks
from jax_grouped_mlp._src.op import residuals

PyTree = Any

# Each layer's device->host copies are waited for by the next layer's output, not by
# its own (the op's fence): the copies overlap one layer of compute, at the cost of one
# more layer's offloaded residuals on the device at a time. False: the op's own fence.
# Read when layer_stack is traced.
LAG_FENCE = True


def layer_stack(
    layer: Callable[..., PyTree],
    params: Sequence[PyTree],
    x: PyTree,
    *args: PyTree,
    policy: Callable | None = None,
    prefetch: bool = True,
    offload_last: bool = False,
) -> PyTree:
    """``x`` after ``x = layer(params[i], x, *args)`` for each ``i``, each layer under
    ``jax.checkpoint(layer, policy=policy)``, differentiable in ``params``, ``x`` and
    ``args``.

    With ``prefetch`` (the default), the backward pass moves layer ``i - 1``'s
    offloaded residuals back to the device as soon as layer ``i``'s backward pass
    starts, so the copies overlap compute instead of each layer waiting for its own
    (one more layer's offloaded residuals on the device, once, not per layer). Without
    it the helper is the plain loop.

    Args:
      layer: ``layer(p, x, *args) -> x``: one layer (e.g. attention and a
        :func:`grouped_mlp` expert block); its output has ``x``'s structure, shapes
        and dtypes. It may close over concrete values and values of the enclosing
        ``jax.jit``, and over values an enclosing ``jax.grad`` traces (with ``prefetch``
        they are then passed as ``args``, their gradients summed over the layers).
      params: one parameter pytree per layer (a list; layers may differ in values,
        not in structure). An empty list returns ``x``.
      x: the carry (any pytree of arrays).
      *args: arrays every layer reads (group sizes, routing probabilities, a mask);
        their gradients are summed over the layers.
      policy: the ``jax.checkpoint`` policy, e.g. :func:`offload_policy`'s; None
        saves nothing (``jax.checkpoint``'s default).
      prefetch: overlap each layer's reload with the next layer's backward pass.
      offload_last: offload the last layer's residuals too. By default (with
        ``prefetch``) they stay on the device: the backward pass needs them first, so
        a copy out and straight back would only add both copies to the step (about
        5 ms at the expert-parallel share of Nano), and they would be back on the
        device at the peak anyway.

    Returns:
      The carry after the last layer.

    Raises:
      TypeError: ``layer`` is not callable, ``params`` is not a sequence, ``policy`` is
        neither None nor callable, or ``prefetch`` / ``offload_last`` is not a bool.

    Use it instead of a Python loop of ``jax.checkpoint`` layers for reverse-mode
    differentiation (``jax.grad``, ``jax.vjp``); forward mode (``jax.jvp``,
    ``jax.jacfwd``) is not supported with a policy (it is a ``jax.custom_vjp``, like
    :func:`grouped_mlp` itself). For stacked parameters see :func:`layer_scan`
    (docs/offload.md, "Layer stacks").
    """
    if not callable(layer):
        raise TypeError(f"layer must be callable, got layer={layer!r}")
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        raise TypeError(f"params must be a sequence (one parameter pytree per layer), got {type(params).__name__}")
    checks.checkpoint_policy("policy", policy)
    prefetch, offload_last = checks.boolean("prefetch", prefetch), checks.boolean("offload_last", offload_last)
    params = list(params)
    if not params:
        return x
    ckpt = jax.checkpoint(layer, policy=policy)

    def run(params, x, args):
        for p in params:
            x = ckpt(p, x, *args)
        return x

    if not prefetch or policy is None:  # (nothing to prefetch without a policy that offloads)
        return run(params, x, args)
    layers, args = _closures_as_args(layer, params, x, tuple(args))
    ckpts: dict = {}

    def checkpointed(f: Callable, layer_policy) -> Callable:  # one per function and policy: JAX caches its trace
        if (f, layer_policy) not in ckpts:
            ckpts[f, layer_policy] = jax.checkpoint(f, policy=layer_policy)
        return ckpts[f, layer_policy]

    @jax.custom_vjp
    def stack(params, x, args):
        for f, p in zip(layers, params):
            x = checkpointed(f, policy)(p, x, *args)
        return x

    # The forward: each layer's host copies are waited for by the next layer's output
    # (LAG_FENCE), so they overlap that layer's compute; the op's own fence (the layer's
    # output waits for its own copies) is off for these layers. Not inside a scan/while
    # body (decided when the forward is traced, inside the loop's rules): the iteration
    # already bounds the copies, and a read-back there copies every residual twice.
    keep_last = not offload_last and policy is not None

    def fwd(params, x, args):
        lagged = LAG_FENCE and policy is not None and not residuals._in_loop_body()
        fwd_policy = residuals.FencedByCaller(policy) if lagged else policy
        last = len(params) - 1
        pullbacks = []
        for i, p in enumerate(params):
            layer_policy = KeepOnDevice(policy) if i == last and keep_last else fwd_policy
            x, pullback = jax.vjp(checkpointed(layers[i], layer_policy), p, x, *args)
            if lagged and pullbacks:
                x = _wait(x, _host_leaves(pullbacks[-1]))
            pullbacks.append(pullback)
        return x, pullbacks

    def bwd(pullbacks, dy):
        d_params = [None] * len(pullbacks)
        d_args = None
        for i in reversed(range(len(pullbacks))):
            if i > 0:  # layer i - 1's copies back start with layer i's backward pass
                pullbacks[i - 1], dy = _reload_after(pullbacks[i - 1], dy)
            d_p, dy, *d_a = pullbacks[i](dy)
            d_params[i] = d_p
            d_args = d_a if d_args is None else jax.tree.map(_add, d_args, d_a)
        return d_params, dy, tuple(d_args)

    stack.defvjp(fwd, bwd)
    return stack(params, x, tuple(args))


def _closures_as_args(layer: Callable, params: list, x, args: tuple) -> tuple[list[Callable], tuple]:
    """Per layer, the function to run, and the args they all take: ``args`` followed by
    the traced arrays ``layer`` closes over (:func:`closure_as_args`, once per distinct
    set of parameter shapes and dtypes; each function reads its own of those, each array
    passed once however many traces read it, so its gradient sums the layers in the
    loop's order). A closed-over value an enclosing ``jax.grad`` traces would otherwise
    leak out of the stack's ``custom_vjp`` (``UnexpectedTracerError``)."""
    n, extra, by_avals, layers = len(args), [], {}, []
    for p in params:
        key = tuple((jnp.shape(a), jnp.result_type(a)) for a in jax.tree.leaves(p))
        if key not in by_avals:
            converted, with_consts = closure_as_args(layer, p, x, args, only_traced=True)
            where = []
            for c in with_consts[n:]:
                at = next((i for i, e in enumerate(extra) if e is c), None)
                if at is None:
                    at = len(extra)
                    extra.append(c)
                where.append(n + at)
            by_avals[key] = _reading(converted, n, tuple(where)) if where else layer
        layers.append(by_avals[key])
    return layers, (*args, *extra)


def _reading(converted: Callable, n: int, where: tuple[int, ...]) -> Callable:
    """``converted(p, x, *args[:n], *(args[i] for i in where))``: one trace's consts."""
    return lambda p, x, *args: converted(p, x, *args[:n], *(args[i] for i in where))


def closure_as_args(layer: Callable, p0, x, args: tuple, *, only_traced: bool = False,
                    check_types: bool = False) -> tuple[Callable, tuple]:
    """``(layer, args)``, or where ``layer`` closes over arrays (a table, a mask, a value
    of an enclosing ``jit`` or ``grad``), the layer as its traced program (at parameters
    ``p0``) with those arrays as trailing ``args``. In ``layer_scan`` a closed-over array
    in a layer's pullback was neither a parameter nor an arg, so it became a per-layer
    output of the forward scan (one copy per layer); in both stacks one that
    ``jax.grad`` traces raised ``UnexpectedTracerError`` inside their ``custom_vjp``.
    As an arg it is read from the inputs, and its gradient is the sum over the layers.
    ``only_traced``: convert only when a closed-over array is traced. ``check_types``:
    a TypeError naming ``layer`` unless it returns ``x``'s types (a scanned layer must)."""
    closed, out = jax.make_jaxpr(layer, return_shape=True)(p0, x, *args)
    if check_types:
        same = jax.tree.structure(out) == jax.tree.structure(x) and all(
            (o.shape, o.dtype) == (jnp.shape(a), jnp.result_type(a))
            for o, a in zip(jax.tree.leaves(out), jax.tree.leaves(x))
        )
        if not same:
            got = jax.tree.map(lambda o: f"{o.dtype}{list(o.shape)}", out)
            want = jax.tree.map(lambda a: f"{jnp.result_type(a)}{list(jnp.shape(a))}", x)
            raise TypeError(f"layer must return x's structure, shapes and dtypes (its output is the next layer's x), "
                            f"got {got} for x {want}")
    consts = list(closed.consts)
    if not consts or (only_traced and not any(isinstance(c, jax.core.Tracer) for c in consts)):
        return layer, args
    out_tree, n = jax.tree.structure(out), len(args)

    def converted(p, x, *rest):
        flat = jax.tree.leaves((p, x, *rest[:n]))
        return jax.tree.unflatten(out_tree, jax.core.eval_jaxpr(closed.jaxpr, list(rest[n:]), *flat))

    return converted, (*args, *consts)


@dataclasses.dataclass(frozen=True)
class KeepOnDevice:
    """``policy`` with every residual it offloads kept on the device instead (the last
    layer of a stack). A distinct policy object, so JAX's caches keep it apart."""

    policy: Callable

    def __call__(self, *args, **kwargs):
        out = self.policy(*args, **kwargs)
        return True if isinstance(out, pe.Offloadable) else out


def _wait(x: PyTree, host: list) -> PyTree:
    """``x`` with every floating leaf made to wait for the host copies ``host`` (any of
    them may be the one the next layer reads first; one element each is read back)."""
    leaves, tree = jax.tree_util.tree_flatten(x)
    leaves = [residuals.wait_for_host(leaf, host) if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.size
              else leaf for leaf in leaves]  # fmt: skip
    return jax.tree_util.tree_unflatten(tree, leaves)


def _host_leaves(pullback) -> list:
    return [leaf for leaf in jax.tree_util.tree_leaves(pullback) if _on_host(leaf)]


def _add(a: jax.Array, b: jax.Array) -> jax.Array:
    """Sum of two cotangents; integer inputs' cotangents (float0) stay as they are."""
    return a if a.dtype == jax.dtypes.float0 else a + b


def _on_host(leaf) -> bool:
    aval = jax.typeof(leaf)
    return getattr(aval, "memory_space", None) == core.MemorySpace.Host


def _reload_after(pullback, cotangent):
    """``pullback`` with its host arrays moved to the device once ``cotangent`` exists
    (``residuals.after_cotangent``'s barrier and move), and ``cotangent``.

    The pullback's own reload of those arrays then moves arrays already on the
    device, which XLA drops."""
    leaves, tree = jax.tree_util.tree_flatten(pullback)
    host = [i for i, leaf in enumerate(leaves) if _on_host(leaf)]
    if not host:
        return pullback, cotangent
    moved, cotangent = residuals.reload_after([leaves[i] for i in host], cotangent)
    for i, leaf in zip(host, moved):
        leaves[i] = leaf
    return jax.tree_util.tree_unflatten(tree, leaves), cotangent

