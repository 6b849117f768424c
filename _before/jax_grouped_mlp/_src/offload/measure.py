"""Measurements that feed :func:`plan_offload` and check its predictions.

* :func:`measure_host_bandwidth` - device <-> pinned host copy rate on this device;
* :func:`measure_layer_time` - one grouped-MLP layer's forward, backward and the
  extra backward time of recomputing each residual, on this device;
* :func:`residual_bytes_kept` - how many bytes of each named residual a traced
  program keeps on the device and in host memory (read from the jaxpr of its
  gradient, like :func:`residual_placements`), to compare with a plan.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src.offload import placement
from jax_grouped_mlp._src.op.names import RESIDUAL_NAMES
from jax_grouped_mlp._src.offload.planner import LayerShape, LayerTime, _check_positive_int, _check_recipe


def single_device_sharding(device: jax.Device, memory_kind: str) -> jax.sharding.Sharding:
    """``device``'s sharding in memory ``memory_kind`` (``jax.sharding.make_single_device_sharding``
    where this jax has it: constructing ``SingleDeviceSharding`` directly is deprecated
    since jax 0.12)."""
    make = getattr(jax.sharding, "make_single_device_sharding", None)
    if make is None:  # (older jax)
        return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
    return make(device, memory_kind=memory_kind)


def _best_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time of each function, run round-robin so load from other processes
    spreads over all of them instead of biasing one."""
    for fn in fns.values():
        jax.block_until_ready(fn())  # compile and warm up
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def measure_host_bandwidth(nbytes: int = 1 << 30, *, repeats: int = 5, device=None) -> float:
    """Bytes/s of copies between ``device`` and its pinned host memory, the slower way.

    Copies an ``nbytes`` buffer to ``pinned_host`` and back ``repeats`` times and
    returns ``nbytes`` over the best time of the slower direction. Each copy pays a
    fixed cost besides its bytes, so small buffers read low: on the H200 a 2 GB copy
    reads 53.9 GB/s, a 256 MB one 47 and a 64 MB one about 10 % less than 2 GB. The
    planner's step model was checked against the large-copy rate (docs/offload.md), hence
    the default of 1 GiB (``nbytes`` on the device and as much pinned host memory,
    briefly).
    """
    _check_positive_int("nbytes", nbytes)
    _check_positive_int("repeats", repeats)
    if device is not None and not isinstance(device, jax.Device):
        raise TypeError(f"device must be a jax.Device (one of jax.devices()) or None, got device={device!r} "
                        f"({type(device).__name__})")
    device = device or jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" not in kinds:
        raise ValueError(f"device={device} has no pinned_host memory (it has {sorted(kinds)})")
    on_host = single_device_sharding(device, "pinned_host")
    on_device = single_device_sharding(device, "device")
    x = jax.device_put(np.ones(nbytes, np.uint8), on_device)
    h = jax.device_put(x, on_host)
    t = _best_times(
        {"to_host": lambda: jax.device_put(x, on_host), "to_device": lambda: jax.device_put(h, on_device)},
        repeats,
    )
    return nbytes / max(t.values())


@dataclasses.dataclass(frozen=True)
class _Layer:
    """Random inputs of one layer and its jitted steps under a given placement."""

    shape: LayerShape
    recipe: str
    args: tuple

    @classmethod
    def make(cls, shape: LayerShape, recipe: str, seed: int = 0) -> "_Layer":
        m, h, f, g = shape.tokens, shape.hidden, shape.ffn, shape.num_experts
        kx, k1, k2, kp = jax.random.split(jax.random.key(seed), 4)
        x = jax.random.normal(kx, (m, h), jnp.bfloat16)
        w1 = (jax.random.normal(k1, (g, h, f), jnp.float32) * h**-0.5).astype(jnp.bfloat16)
        w2 = (jax.random.normal(k2, (g, f, h), jnp.float32) * f**-0.5).astype(jnp.bfloat16)
        sizes = np.full(g, m // g, np.int32)
        sizes[: m % g] += 1
        probs = jax.random.uniform(kp, (m,), jnp.float32)
        return cls(shape, recipe, (x, w1, w2, jnp.asarray(sizes), probs))

    def forward(self):
        from jax_grouped_mlp._src.op.mlp import grouped_mlp

        fwd = jax.jit(functools.partial(grouped_mlp, recipe=self.recipe))
        return lambda: fwd(*self.args)

    def step(self, **placement: str):
        """Forward + backward (loss and grads of x, w1, w2, probs) under ``offload_policy(**placement)``.

        The loss value is returned so that the forward pass is live: with ``jax.grad``
        alone XLA drops a lone layer's forward when everything is recomputed.
        """
        from jax_grouped_mlp._src.op.mlp import grouped_mlp
        from jax_grouped_mlp._src.offload.policy import offload_policy

        layer = jax.checkpoint(
            functools.partial(grouped_mlp, recipe=self.recipe), policy=offload_policy(**placement)
        )
        dy = jnp.ones(self.args[0].shape, jnp.float32)

        def loss(x, w1, w2, gs, probs):
            return jnp.vdot(layer(x, w1, w2, gs, probs).astype(jnp.float32), dy)

        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 4)))
        return lambda: grad(*self.args)


def measure_layer_time(
    *,
    tokens: int,
    hidden: int,
    ffn: int,
    num_experts: int,
    recipe: str = "mxfp8",
    repeats: int = 5,
    seed: int = 0,
) -> LayerTime:
    """Time one :func:`grouped_mlp` layer on the default device (best of ``repeats``).

    ``forward`` is the jitted forward alone; ``backward`` is forward+backward with every
    residual on the device, minus ``forward``; ``recompute[r]`` is the step time with
    ``r`` recomputed (the others on device) minus the all-device step, floored at 0
    (small shapes are noisy). Balanced random inputs; costs a few compilations.
    """
    shape = LayerShape(tokens, hidden, ffn, num_experts)
    _check_positive_int("repeats", repeats)
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int (a jax.random.key seed), got seed={seed!r} ({type(seed).__name__})")
    layer = _Layer.make(shape, _check_recipe(recipe), seed)
    keep = {n: "device" for n in RESIDUAL_NAMES}
    fns = {"forward": layer.forward(), "all_device": layer.step(**keep)}
    fns |= {n: layer.step(**{**keep, n: "recompute"}) for n in RESIDUAL_NAMES}
    t = _best_times(fns, repeats)
    forward, total = t["forward"], t["all_device"]
    recompute = {n: max(0.0, t[n] - total) for n in RESIDUAL_NAMES}
    backward = max(total - forward, 1e-3 * total)
    return LayerTime(forward, backward, recompute)


def residual_bytes_kept(fun: Callable, *args, argnums=0) -> dict[str, dict[str, int]]:
    """Bytes of each named residual the gradient of ``fun`` keeps, read from its jaxpr.

    Traces ``jax.grad(fun, argnums)(*args)`` (``fun`` returns a scalar and wraps its
    layers in ``jax.checkpoint``). Returns, for each of "fc1_input",
    "activation_input", "fc2_input", ``{"device_bytes": ..., "host_bytes": ...}``
    summed over all checkpoints (0 and 0 when recomputed; a checkpoint inside a
    ``scan`` body counts once, not once per iteration). Built on
    :func:`jax_grouped_mlp._src.offload.placement.residual_report`.
    """
    report = placement.residual_report(jax.grad(fun, argnums=argnums), *args)
    out = {n: {"device_bytes": 0, "host_bytes": 0} for n in RESIDUAL_NAMES}
    for name in RESIDUAL_NAMES:
        if name in report:
            out[name] = {"device_bytes": report[name].device_bytes, "host_bytes": report[name].host_bytes}
    return out
