"""``layer_scan``: :func:`layer_stack` for stacked parameters, as a ``jax.lax.scan``.

In a scan of checkpointed layers (``jax.lax.scan`` / ``nnx.scan``), XLA's loop offloading
writes each iteration's offloaded residuals into a stacked host buffer and reads them
back in the backward scan's matching iteration, right where that iteration needs them:
every copy back is exposed (measured on the H200, docs/offload.md "Layer stacks"). This
runs the stack as one ``jax.custom_vjp`` instead:

* forward: a scan over layers ``0 .. L-2`` whose body is ``jax.vjp`` of the checkpointed
  layer; the pullback's arrays leave the body as the scan's outputs (host copies stacked
  in host memory, other residuals on the device), except the layer's own parameters and
  ``args``, which the backward reads again from the inputs. The last layer runs outside
  the scan with its residuals kept on the device (the backward needs them first);
* backward: the last layer's pullback, then a reverse scan over layers ``L-2 .. 1`` that
  carries layer ``i``'s host residuals already on the device and, before running layer
  ``i``'s pullback, reads layer ``i - 1``'s from the host buffer at an index computed
  from layer ``i``'s cotangent (so the read starts only once that exists and overlaps
  layer ``i``'s backward); then layer 0.

The arithmetic is that of the same layers in a loop of ``jax.checkpoint`` (the same
pullbacks on the same values): tests/test_layer_stack.py compares bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_grouped_mlp._src.offload import stack
from jax_grouped_mlp._src.op import residuals

PyTree = Any


@dataclasses.dataclass
class _Layout:
    """Where each array of a layer's pullback comes from in the backward pass, found
    while tracing the forward scan's body: ``("param", j)`` the layer's parameter leaf
    ``j``, ``("arg", j)`` the ``args`` leaf ``j``, ``("res", k)`` the scan's output ``k``."""

    tree: Any = None
    sources: list = dataclasses.field(default_factory=list)
    host: list = dataclasses.field(default_factory=list)  # per output k: a host copy?


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
    policy=policy)``.

    :func:`layer_stack` for scanned stacks: the backward pass brings layer ``i - 1``'s
    offloaded residuals back while layer ``i`` runs backward, and the last layer keeps
    its residuals on the device. Without ``prefetch`` it is ``jax.lax.scan`` of the
    checkpointed layer.

    Raises:
      TypeError: ``layer`` is not callable. ValueError: ``params`` has no arrays, or
      their leading axes differ.
    """
    if not callable(layer):
        raise TypeError(f"layer must be callable, got layer={layer!r}")
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise ValueError("params must hold the layers' parameters stacked along a leading axis; it has no arrays")
    lengths = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in leaves}
    if len(lengths) != 1 or None in lengths:
        raise ValueError(f"every array in params must have the same leading (layer) axis, got lengths {sorted(map(str, lengths))}")
    (length,) = lengths
    ckpt = jax.checkpoint(layer, policy=policy)

    def run(params, x, args):
        return lax.scan(lambda x, p: (ckpt(p, x, *args), None), x, params)[0]

    if not prefetch or length == 0 or policy is None:
        return run(params, x, tuple(args))
    ckpt_body = jax.checkpoint(layer, policy=residuals.FencedByCaller(policy))  # no fence in the loop body
    ckpt_last = jax.checkpoint(layer, policy=stack.KeepOnDevice(policy))
    layout = _Layout()

    @jax.custom_vjp
    def scanned(params, x, args):
        return run(params, x, args)

    def fwd(params, x, args):
        head = jax.tree.map(lambda a: a[:-1], params)
        last = jax.tree.map(lambda a: a[-1], params)
        args_flat = jax.tree.leaves(args)

        def body(x, p):
            y, pullback = jax.vjp(ckpt_body, p, x, *args)
            out, tree = jax.tree_util.tree_flatten(pullback)
            p_flat = jax.tree.leaves(p)
            layout.tree, layout.sources, layout.host, res = tree, [], [], []
            for leaf in out:
                source = _find(leaf, p_flat, "param") or _find(leaf, args_flat, "arg")
                if source is None:
                    source = ("res", len(res))
                    res.append(leaf)
                    layout.host.append(stack._on_host(leaf))
                layout.sources.append(source)
            return y, res

        x, stacked = lax.scan(body, x, head)
        y, last_pullback = jax.vjp(ckpt_last, last, x, *args)
        return y, (stacked, params, args, last_pullback)

    def bwd(saved, dy):
        stacked, params, args, last_pullback = saved
        args_flat = jax.tree.leaves(args)
        n = length - 1  # layers in the forward scan

        def host_of(i, cotangent):
            """Layer ``i``'s host residuals, on the device, read once ``cotangent`` exists."""
            index = i + _zero_from(cotangent)
            return [residuals.to_device_p.bind(lax.dynamic_index_in_dim(s, index, keepdims=False),
                                               memory_kind="device")[0]
                    for s, h in zip(stacked, layout.host) if h]  # fmt: skip

        def pullback_of(i, on_device):
            p_flat = jax.tree.leaves(jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), params))
            moved = iter(on_device)
            res = [next(moved) if h else lax.dynamic_index_in_dim(s, i, keepdims=False)
                   for s, h in zip(stacked, layout.host)]  # fmt: skip
            leaves = [{"param": p_flat, "arg": args_flat, "res": res}[kind][j] for kind, j in layout.sources]
            return jax.tree_util.tree_unflatten(layout.tree, leaves)

        current = host_of(n - 1, dy) if n else []
        d_last, dy, *d_args = last_pullback(dy)

        def step(carry, i):
            dy, d_args, current = carry
            following = host_of(i - 1, dy)
            d_p, dy, *d_a = pullback_of(i, current)(dy)
            return (dy, jax.tree.map(stack._add, d_args, d_a), following), d_p

        parts = [d_last]
        if n:
            (dy, d_args, current), d_rest = lax.scan(step, (dy, d_args, current), jnp.arange(1, n), reverse=True)
            d_0, dy, *d_a = pullback_of(0, current)(dy)
            d_args = jax.tree.map(stack._add, d_args, d_a)
            parts = [d_0, d_rest, d_last]
        return _stack_grads(params, parts), dy, tuple(d_args)

    scanned.defvjp(fwd, bwd)
    return scanned(params, x, tuple(args))


def _stack_grads(params, parts: list):
    """The parameters' gradients stacked along the layer axis from ``parts``: [layer 0's,
    layers 1..L-2's (stacked), the last layer's], or [the last layer's] alone. Integer
    parameters' (float0) come back as float0 zeros of the stacked shape."""

    def one(p, *ds):
        if ds[-1].dtype == jax.dtypes.float0:
            return np.zeros(jnp.shape(p), jax.dtypes.float0)
        if len(ds) == 1:
            return ds[0][None]
        first, rest, last = ds
        return jnp.concatenate([first[None], rest, last[None]])

    return jax.tree.map(one, params, *parts)


def _find(leaf, candidates: list, kind: str):
    for j, c in enumerate(candidates):
        if leaf is c:
            return (kind, j)
    return None


def _zero_from(tree: PyTree) -> jax.Array:
    """An int32 zero computed from the first element of ``tree``'s first float leaf
    (``(2 t) & 1``, which XLA cannot prove to be zero): an index that exists only once
    ``tree`` does. A constant for trees without one."""
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.size:
            first = leaf.reshape(-1)[0]
            bits = lax.bitcast_convert_type(first, jnp.dtype(f"uint{jnp.finfo(leaf.dtype).bits}"))
            t = bits.astype(jnp.int32)
            return jnp.bitwise_and(jnp.left_shift(t, 1), 1)
    return jnp.int32(0)
