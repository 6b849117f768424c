"""``offload_policy``: where each named residual lives between forward and backward."""

from __future__ import annotations

from typing import Callable, Iterable, Literal, get_args

import jax

from jax_grouped_mlp._src.op.names import ACTIVATION_INPUT, FC1_INPUT, FC2_INPUT

Placement = Literal["offload", "device", "recompute"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)


def _check_placement(name: str, value: str) -> str:
    if hasattr(value, "bind"):  # policy=offload_policy: JAX called it with a primitive
        raise TypeError(
            f"{name} must be one of {list(PLACEMENTS)}, got {name}={value!r} (a JAX primitive); "
            "as a jax.checkpoint policy pass offload_policy() (called), not offload_policy itself"
        )
    if value not in PLACEMENTS:
        raise ValueError(f"{name} must be one of {list(PLACEMENTS)}, got {name}={value!r}")
    return value


def _check_names(arg: str, names: Iterable[str]) -> tuple[str, ...]:
    if isinstance(names, (str, bytes)):
        raise TypeError(f"{arg} must be a sequence of names, got the string {names!r}")
    try:
        out = tuple(names)
    except TypeError:
        raise TypeError(f"{arg} must be a sequence of names (use () for none), got {arg}={names!r}") from None
    for n in out:
        if not isinstance(n, str):
            raise TypeError(f"{arg} must contain checkpoint names (str), got {n!r}")
    return out


def offload_policy(
    fc1_input: Placement = "offload",
    activation_input: Placement = "offload",
    fc2_input: Placement = "offload",
    *,
    extra_saveable: Iterable[str] = (),
    extra_offloadable: Iterable[str] = (),
    otherwise: Callable | None = None,
):
    """A ``jax.checkpoint`` policy that places each residual of :func:`grouped_mlp`.

    Each residual is ``"offload"`` (copied to pinned host memory after the forward
    pass and back before the backward pass), ``"device"`` (kept in device memory) or
    ``"recompute"`` (rebuilt in the backward pass: "fc2_input" from
    "activation_input" by one elementwise pass, whatever kernel wrote it; the
    other residuals by rerunning what produced them).
    Everything offloads by default. Weights are never offloaded.

    Values the policy does not name are recomputed, as with any
    ``save_and_offload_only_these_names`` policy; ``extra_saveable`` and
    ``extra_offloadable`` add your own ``checkpoint_name`` tags. ``otherwise``, another
    ``jax.checkpoint`` policy (e.g. ``jax.checkpoint_policies.dots_saveable``), decides
    every value this one does not name instead. (JAX's ``save_from_both_policies``
    cannot combine this policy with another once it offloads: it accepts only True or
    False answers.)

    The op copies its own offloaded residuals to the host (the copies JAX's
    ``device_put`` to ``pinned_host`` makes, without a memory-space transfer in the
    traced program), so a jitted train step does not compile again on its second call.
    Your own names in ``extra_offloadable`` are offloaded by JAX and do bring that
    back (``jax.jit`` then commits the step's outputs; commit the step's inputs before
    the first call to avoid it: ``jax.device_put(x, jax.devices()[0])``, with the device
    named; without one ``device_put`` leaves them uncommitted).

    Example::

        policy = jax_grouped_mlp.offload_policy(activation_input="device")
        layer = jax.checkpoint(lambda x, w1, w2, gs, p: grouped_mlp(x, w1, w2, gs, p),
                               policy=policy)
        grads = jax.jit(jax.grad(lambda *a: layer(*a).sum(), argnums=(1, 2)))(x, w1, w2, gs, p)
    """
    placements = {
        FC1_INPUT: _check_placement("fc1_input", fc1_input),
        ACTIVATION_INPUT: _check_placement("activation_input", activation_input),
        FC2_INPUT: _check_placement("fc2_input", fc2_input),
    }
    save = [n for n, p in placements.items() if p == "device"]
    offload = [n for n, p in placements.items() if p == "offload"]
    extra_save = _check_names("extra_saveable", extra_saveable)
    extra_offload = _check_names("extra_offloadable", extra_offloadable)
    clash = sorted(set(extra_save + extra_offload) & set(placements))
    if clash:
        raise ValueError(
            f"extra_saveable/extra_offloadable are for your own names; place {clash} with "
            f"the fc1_input/activation_input/fc2_input arguments instead"
        )
    save += extra_save
    offload += extra_offload
    both = set(save) & set(offload)
    if both:
        raise ValueError(f"names cannot be both saved on device and offloaded: {sorted(both)}")
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=save,
        names_which_can_be_offloaded=offload,
        offload_src="device",
        offload_dst="pinned_host",
    )
    if otherwise is None:
        return policy
    if not callable(otherwise) or hasattr(otherwise, "bind"):
        raise TypeError(f"otherwise must be a jax.checkpoint policy (a callable) or None, got {otherwise=!r}")
    named = frozenset(placements) | frozenset(extra_save) | frozenset(extra_offload)

    def combined(prim, *avals, **params):
        """This policy for the names it places, ``otherwise`` for everything else."""
        if params.get("name") in named:
            return policy(prim, *avals, **params)
        return otherwise(prim, *avals, **params)

    return combined
