"""``layer_scan``: :func:`layer_stack` for stacked parameters, as a ``jax.lax.scan``.

In a scan of checkpointed layers (``jax.lax.scan`` / ``nnx.scan``), XLA's loop offloading
writes each iteration's offloaded residuals into a stacked host buffer inside that
iteration, and reads them back in the backward scan's matching iteration, right where
it needs them: the next layer waits for each copy out, and every copy back is exposed
(measured on the H200: docs/offload.md "Layer stacks"). This runs the stack as one
``jax.custom_vjp`` whose loops are software-pipelined by one layer:

* forward: layer 0, then a scan over layers ``1 .. L-2`` whose body is ``jax.vjp`` of
  the layer with every residual on the device; the arrays the policy offloads (found by
  tracing the layer under the policy) are carried to the next iteration, which writes
  them to the host while it computes its own layer. The last layer runs outside the
  scan; layer ``L-2``'s and ``L-1``'s residuals stay on the device (the backward needs
  them first). The other residuals leave the body as the scan's outputs, and the
  layer's own parameters and ``args`` are read again from the inputs;
* backward: the last layer's pullback, then a reverse scan over layers ``L-2 .. 1``
  that carries layer ``i``'s offloaded residuals already on the device and reads layer
  ``i - 1``'s from the host buffer (the scan's input slice at the loop counter: XLA
  issues an asynchronous copy beside layer ``i``'s pullback); then layer 0.

The copies: on a CUDA GPU (with the extension built) ``layer_scan`` issues them itself,
through a host store (``host_store.py``): custom calls that copy on CUDA streams of their
own and make XLA's stream wait only at the end of the layer they overlap. XLA's own host
copies inside a ``while`` loop are scheduled next to their users, so every one of them
was exposed (docs/notes/2026-12-03-layer-scan.md; measured with the store:
docs/notes/2026-12-04-layer-scan-host-store.md). Elsewhere (the CPU, or
``JGM_LAYER_SCAN_STREAMS=0``) the copies are XLA's, as described above.

The arithmetic is that of the same layers in a loop of ``jax.checkpoint`` (the same
pullbacks on the same values): tests/test_layer_stack.py compares bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core
from jax._src.interpreters import partial_eval as pe

from jax_grouped_mlp._src import checks, eager
from jax_grouped_mlp._src.offload import host_store, stack
from jax_grouped_mlp._src.op import residuals
from jax_grouped_mlp._src.op.names import RESIDUAL_NAMES

PyTree = Any


@dataclasses.dataclass
class _Layout:
    """Where each array of a layer's pullback comes from in the backward pass, found
    while tracing a layer's forward: ``("param", j)`` the layer's parameter leaf ``j``,
    ``("arg", j)`` the ``args`` leaf ``j``, ``("off", k)`` the ``k``-th array the policy
    offloads, ``("keep", k)`` the ``k``-th other array."""

    tree: Any = None
    sources: list = dataclasses.field(default_factory=list)


def layer_scan(
    layer: Callable[..., PyTree],
    params: PyTree,
    x: PyTree,
    *args: PyTree,
    policy: Callable | None = None,
    prefetch: bool = True,
) -> PyTree:
    """``x`` after ``x = layer(params[i], x, *args)`` for ``i`` in ``range(L)``, where
    ``params`` holds every layer's parameters stacked along a leading axis of length
    ``L`` (what ``jax.lax.scan`` takes), each layer under ``jax.checkpoint(layer,
    policy=policy)`` (with ``prevent_cse=False`` where a layer is recomputed inside the
    scan, as JAX advises for a checkpoint in a scan, and for the last layer's parameters:
    the same numbers, and XLA reads the layer's parameter slices in place rather than
    copying them).

    :func:`layer_stack` for scanned stacks: the backward pass brings layer ``i - 1``'s
    offloaded residuals back while layer ``i`` runs backward, and the last layer keeps
    its residuals on the device. Without ``prefetch`` it is ``jax.lax.scan`` of the
    checkpointed layer. An empty stack (``L = 0``) returns ``x``.

    On a CUDA GPU the copies are the library's own (CUDA streams beside XLA's; pinned
    host memory the process keeps and reuses, a layer's offloaded bytes per offloaded
    layer). Each forward pass's copies are read back once, by its own backward pass, in
    reverse order of the forward passes (as one jitted training step does): a backward
    run twice, or out of that order, raises an error (its arrays would be another pass's)
    and reads NaN. ``JGM_LAYER_SCAN_STREAMS=0`` in the environment, read when the step is
    traced, uses XLA's copies instead (slower: docs/offload.md). Elsewhere the host copies
    go to the memory kind the policy names (``Offloadable.dst``: the ``pinned_host`` of
    :func:`offload_policy`, or ``unpinned_host``).

    ``layer(p, x, *args)`` must return ``x``'s structure, shapes and dtypes (it is
    scanned). It may close over arrays, also over values an enclosing ``jax.jit`` or
    ``jax.grad`` traces: they are passed to the scan as ``args`` (read by every layer,
    not copied per layer; their gradients are summed over the layers). ``args`` may
    hold Python numbers. Called outside any trace (eager, or under an eager
    ``jax.grad``), it runs as one jitted program, compiled once per shape, ``layer``
    and ``policy`` (keep those objects to reuse it).

    Raises:
      TypeError: ``layer`` is not callable or returns other types than ``x``,
      ``policy`` is neither None nor callable,
      or ``prefetch`` is not a bool. ValueError: ``params`` has no arrays, or
      their leading axes differ, or ``policy`` offloads the op's residuals to more than
      one host memory kind.
    """
    if not callable(layer):
        raise TypeError(f"layer must be callable, got layer={layer!r}")
    checks.checkpoint_policy("policy", policy)
    prefetch = checks.boolean("prefetch", prefetch)
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise ValueError("params must hold the layers' parameters stacked along a leading axis; it has no arrays")
    lengths = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in leaves}
    if len(lengths) != 1 or None in lengths:
        raise ValueError(f"every array in params must have the same leading (layer) axis, got lengths {sorted(map(str, lengths))}")
    (length,) = lengths
    if length == 0:
        return x  # no layers (what jax.lax.scan over an empty axis and layer_stack([]) give)
    # Python numbers and NumPy arrays as JAX arrays (weakly typed numbers stay weak): a
    # Python scalar stayed a constant of one trace and an input of another.
    args = tuple(jax.tree.map(lambda a: a if isinstance(a, jax.Array) else jnp.asarray(a), args))
    if eager.outside_any_trace((params, x, args), (layer, policy, prefetch)):
        return _layer_scan_jit(layer, params, x, args, policy, prefetch)  # one program per shape (eager.py)
    p0 = jax.tree.map(lambda a: a[0], params)
    layer, args = stack.closure_as_args(layer, p0, x, args, check_types=True)

    # Layers recomputed inside a scan's body take jax.checkpoint(prevent_cse=False), JAX's
    # advice for a checkpoint in a scan (the loop already keeps XLA from merging the
    # recomputation with the forward pass): remat's barrier would otherwise hold each
    # layer's parameter slices, and XLA then copies them out of the stack instead of
    # reading them in place (at the 128-expert Nano shape 2 x 1.28 GB a layer:
    # docs/performance.md, "Scanned layer stacks"). The last layer, recomputed outside
    # the scans, lets XLA merge only what it computes from its parameters alone (its
    # backward comes soon after its forward: only the head and the loss run between),
    # so that its weight slices too are read in place, and keeps the barrier on its
    # inputs; layer 0, recomputed at the end of the step, keeps the default.
    ckpt = jax.checkpoint(layer, policy=policy, prevent_cse=False)
    params_only = _params_only_prevent_cse(len(args))  # per argument of layer(p, x, *args)

    def run(params, x, args):
        return lax.scan(lambda x, p: (ckpt(p, x, *args), None), x, params)[0]

    if not prefetch or policy is None:
        return run(params, x, tuple(args))
    keep = stack.KeepOnDevice(policy)
    ckpt_keep = jax.checkpoint(layer, policy=keep, prevent_cse=params_only)  # the last layer
    ckpt_keep_first = jax.checkpoint(layer, policy=keep)  # layer 0 of two
    deferred = residuals.DeferredOffload(policy)
    ckpt_defer = jax.checkpoint(layer, policy=deferred)  # what runs (no copies): layer 0
    ckpt_defer_scanned = jax.checkpoint(layer, policy=deferred, prevent_cse=False)  # layers 1 .. L-2
    recorder = _DstRecorder(policy)
    ckpt_policy = jax.checkpoint(layer, policy=residuals.FencedByCaller(recorder))  # traced for its placement only
    if not any(_offloaded(ckpt_policy, p0, x, tuple(args), _pullback_avals(ckpt_defer, p0, x, tuple(args)))):
        return run(params, x, tuple(args))  # nothing offloaded (or only by JAX itself): nothing to pipeline
    host_kind = recorder.host_kind()
    store = host_store.for_this_platform()  # None: XLA's own host copies
    first, inner = _Layout(), _Layout()  # layer 0's, and the scanned layers'

    @jax.custom_vjp
    def scanned(params, x, args):
        return run(params, x, args)

    def one_layer(p, x, args, layout, ckpt=ckpt_defer_scanned):
        """Layer ``p`` forward: its output, the pullback arrays the policy offloads (on
        the device still) and the other arrays that are neither parameters nor args
        (recorded in ``layout``). An array that is ``x`` counts as neither, even when
        ``args`` holds it too: layer 0 and the scanned layers then carry the same arrays."""
        y, pullback = jax.vjp(ckpt, p, x, *args)
        leaves, tree = jax.tree_util.tree_flatten(pullback)
        offloads = (_offloaded(ckpt_policy, p, x, args, leaves) if ckpt in (ckpt_defer, ckpt_defer_scanned)
                    else [False] * len(leaves))
        p_flat, args_flat, x_flat = jax.tree.leaves(p), jax.tree.leaves(args), jax.tree.leaves(x)
        layout.tree, layout.sources, off, keep = tree, [], [], []
        for leaf, offloaded in zip(leaves, offloads):
            source = None if _find(leaf, x_flat, "x") else _find(leaf, p_flat, "param") or _find(leaf, args_flat, "arg")
            if source is None:
                kept = off if offloaded else keep
                source = ("off" if offloaded else "keep", len(kept))
                kept.append(leaf)
            layout.sources.append(source)
        return y, off, keep

    def layer_params(params, i):
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), params)

    def fwd(params, x, args):
        saved: dict = {"params": params, "args": args}
        if length > 1:
            # Of two layers, layer 0's residuals stay on the device too (nothing is copied):
            # its tags say so (residual_placements reads them).
            x, off, saved["keep0"] = one_layer(layer_params(params, 0), x, args, first,
                                               ckpt_defer if length > 2 else ckpt_keep_first)  # fmt: skip
            if length > 2:
                # Both scans carry the layer index as a counter instead of reading it from an
                # `xs` array (`jnp.arange`): XLA's dynamic-slice fusion, which lets a kernel
                # read its layer's slice of a stacked weight and write its gradient into the
                # stacked gradients in place, took the backward body's weight reads and
                # gradient writes only with the counter. With the index from `xs` XLA copied
                # each layer's weight slice and wrote its weight gradients into buffers of
                # their own first (H100, Nano, 4 layers, all-offload: temp 7.43 -> 5.52 GB,
                # step 63.3 -> 56.0 ms; docs/notes/2026-12-07-scan-weight-copies.md).
                def body(carry, _):  # layer i (1 .. L-2); indexing the parameters copies none of them
                    x, previous, i = carry
                    if store is None:
                        x, off, keep = one_layer(layer_params(params, i), x, args, inner)
                        # The previous layer's copies out run while this layer computes.
                        return (x, off, i + 1), (residuals.to_host(previous, memory_kind=host_kind), keep)
                    # The store's copies out of the previous layer start before this layer
                    # and are waited for after it (they run on the store's own stream).
                    serial = store.put_start(previous)
                    x, serial = lax.optimization_barrier((x, serial))
                    x, off, keep = one_layer(layer_params(params, i), x, args, inner)
                    store.put_done(previous, serial, jax.tree.leaves(x))
                    return (x, off, i + 1), (serial, keep)

                (x, off, _), (saved["host"], saved["keep"]) = lax.scan(
                    body, (x, off, jnp.int32(1)), None, length=length - 2)
            saved["off"] = off  # layer L-2's: on the device (the backward needs them second)
        y, saved["last"] = jax.vjp(ckpt_keep, layer_params(params, length - 1), x, *args)
        return y, saved

    def bwd(saved, dy):
        params, args = saved["params"], saved["args"]
        args_flat = jax.tree.leaves(args)
        d_last, dy, *d_args = saved["last"](dy)
        # The parameters' gradients, written layer by layer into one stacked buffer (every
        # layer's slot is written, so the store's buffers start unwritten, not zeroed; only
        # where the store's copies run, i.e. in the loops of more than two layers).
        unwritten = store if length > 2 else None
        grads = _put(jax.tree.map(lambda p: _gradient_buffer(p, unwritten), params), d_last, length - 1)
        if length == 1:
            return grads, dy, tuple(d_args)

        def pullback_of(i, off, keep, layout):
            p_flat = jax.tree.leaves(layer_params(params, i))
            leaves = [{"param": p_flat, "arg": args_flat, "off": off, "keep": keep}[kind][j]
                      for kind, j in layout.sources]  # fmt: skip
            return jax.tree_util.tree_unflatten(layout.tree, leaves)

        current = saved["off"]
        if length > 2:

            def step(carry, xs):  # layer i (L-2 .. 1)
                dy, d_args, grads, current, i = carry  # i carried, as in the forward
                before, keep = xs  # layer i - 1's host copies (or serial), layer i's other arrays
                if store is None:
                    # Layer i - 1's copies back, read as the scan's own input slices (at the
                    # loop counter): XLA issues them as asynchronous host dynamic-slices.
                    following = list(residuals.to_device_p.bind(*before, memory_kind="device"))
                else:  # the store's copies back run beside this layer's pullback
                    following = store.get_start(before, current)
                    dy, following = lax.optimization_barrier((dy, following))
                d_p, dy, *d_a = pullback_of(i, current, keep, inner)(dy)
                if store is not None:
                    # Ordered after dy only: an ordering operand of this side-effecting call
                    # is never removed, so passing the gradients too (which moved their writes
                    # before the wait, ~0.15 ms a layer on the H200) kept gradients nobody
                    # asked for (a frozen parameter's) computed.
                    following = store.get_done(following, before, jax.tree.leaves(dy))
                return (dy, jax.tree.map(stack._add, d_args, d_a), _put(grads, d_p, i), following, i - 1), None

            xs = (saved["host"], saved["keep"])  # host: layers 0..L-3, keep: 1..L-2
            carry = (dy, d_args, grads, current, jnp.int32(length - 2))
            (dy, d_args, grads, current, _), _ = lax.scan(step, carry, xs, reverse=True)
        d_0, dy, *d_a = pullback_of(0, current, saved["keep0"], first)(dy)
        return _put(grads, d_0, 0), dy, tuple(jax.tree.map(stack._add, d_args, d_a))

    scanned.defvjp(fwd, bwd)
    return scanned(params, x, tuple(args))


def _layer_scan_positional(layer, params, x, args, policy, prefetch):
    return layer_scan(layer, params, x, *args, policy=policy, prefetch=prefetch)


_layer_scan_jit = jax.jit(_layer_scan_positional, static_argnames=("layer", "policy", "prefetch"))


@functools.cache
def _per_argument_prevent_cse_works() -> bool:
    """Whether this JAX differentiates a ``jax.checkpoint`` whose ``prevent_cse`` is a
    tuple (one flag per argument). In JAX 0.11.2 and 0.12.0 its JVP rule did not extend
    the tuple over the constants the JVP adds (from a ``custom_jvp`` or ``custom_vjp``
    closing over an array, as the op does), and tracing the gradient failed with a bare
    ``AssertionError`` in ``remat_jvp``; JAX 0.12.1 pads it. A tiny such function tells."""
    k = np.arange(2, dtype=np.float32)

    @jax.custom_jvp
    def scaled(p):
        return p * k

    scaled.defjvp(lambda primals, tangents: (primals[0] * k, tangents[0] * k))
    f = jax.checkpoint(lambda p, x: jnp.sum(scaled(p) * x), prevent_cse=(False, True))
    try:
        jax.eval_shape(jax.grad(f), jnp.ones(2, jnp.float32), jnp.float32(1))
    except AssertionError:
        return False
    return True


def _params_only_prevent_cse(n_args: int) -> tuple[bool, ...] | bool:
    """``prevent_cse`` for ``jax.checkpoint(layer)`` called as ``layer(p, x, *args)`` with
    ``n_args`` args: off for the parameters only; ``True`` (the default, for all) where
    this JAX cannot differentiate a per-argument setting
    (:func:`_per_argument_prevent_cse_works`)."""
    if not _per_argument_prevent_cse_works():
        return True
    return (False, True, *([True] * n_args))


class _DstRecorder:
    """``policy``, noting the host memory kind it answers (``Offloadable.dst``) for each of
    the op's residual names while a layer is traced: where ``layer_scan`` writes the
    residuals it offloads itself. (Identity-hashed: a fresh policy object per call, so
    JAX's caches of remat's partial evaluation never return another call's trace.)"""

    def __init__(self, policy: Callable):
        self.policy = policy
        self.dsts: dict[str, set[str]] = {}

    def __call__(self, *args, **kwargs):
        out = self.policy(*args, **kwargs)
        case = pe.ensure_enum(out)
        if isinstance(case, pe.Offloadable) and kwargs.get("name") in RESIDUAL_NAMES:
            self.dsts.setdefault(kwargs["name"], set()).add(case.dst)
        return out

    def host_kind(self) -> str:
        """The one memory kind the policy sends the op's residuals to, or a ValueError."""
        kinds = set().union(*self.dsts.values())
        if len(kinds) > 1:
            named = {name: sorted(k)[0] if len(k) == 1 else sorted(k) for name, k in sorted(self.dsts.items())}
            raise ValueError(
                "policy must offload the op's residuals to one host memory kind for layer_scan (its copies of a "
                f"layer go out together), got {named}"
            )
        return kinds.pop() if kinds else "pinned_host"


def _pullback_avals(ckpt: Callable, p, x, args) -> list:
    return jax.make_jaxpr(lambda p, x, *a: jax.tree.leaves(jax.vjp(ckpt, p, x, *a)[1]))(p, x, *args).out_avals


def _offloaded(ckpt_policy: Callable, p, x, args, leaves: list) -> list[bool]:
    """For each array of the layer's pullback under ``DeferredOffload`` (``leaves``),
    (arrays or their avals) whether ``layer_scan`` writes it to the host: the policy's own checkpoint
    (``ckpt_policy``) keeps it as a host copy, and ``DeferredOffload`` left it on the
    device (arrays JAX's own offloading already put on the host, e.g. names a
    ``save_and_offload_only_these_names`` policy offloads, stay as they are). The two
    trace the same residuals in the same order, only placed differently (checked)."""
    avals = _pullback_avals(ckpt_policy, p, x, args)
    if len(avals) != len(leaves) or any(
        (a.shape, a.dtype) != (jnp.shape(b), jnp.result_type(b)) for a, b in zip(avals, leaves)
    ):
        raise RuntimeError("layer_scan: the layer's residuals differ between its policy and the same policy "
                           "with its host copies deferred; please report this with the layer")
    return [_is_host(a) and not _is_host(b if isinstance(b, core.AbstractValue) else jax.typeof(b))
            for a, b in zip(avals, leaves)]


def _is_host(aval) -> bool:
    return getattr(aval, "memory_space", None) == core.MemorySpace.Host


def _gradient_buffer(p: jax.Array, store: host_store.Store | None):
    """The stacked gradient buffer of parameter ``p``, before any layer's slot is
    written: the store's unwritten buffer (zeros without a store), float0 for integer
    parameters."""
    dtype = jnp.result_type(p)
    if not jnp.issubdtype(dtype, jnp.inexact):
        return np.zeros(jnp.shape(p), jax.dtypes.float0)
    if store is None:
        return jnp.zeros(jnp.shape(p), dtype)
    return store.unwritten(jax.ShapeDtypeStruct(jnp.shape(p), dtype))


def _put(grads, layer_grads, i):
    """``grads`` (stacked) with layer ``i``'s ``layer_grads`` written in place."""

    def one(g, d):
        return g if g.dtype == jax.dtypes.float0 else lax.dynamic_update_index_in_dim(g, d.astype(g.dtype), i, 0)

    return jax.tree.map(one, grads, layer_grads)


def _find(leaf, candidates: list, kind: str):
    for j, c in enumerate(candidates):
        if leaf is c:
            return (kind, j)
    return None
