"""Router statistics of the MoE block: expert load, auxiliary losses, dropped pairs.

The block computes per-shard *partial sums* (:class:`StatSums`) from the tokens a
device routes; under expert parallelism every token shard returns its own and they
are summed outside ``shard_map`` (an ordinary reduction, so the gradient of the
losses needs no collective transpose). :func:`finish` turns the sums into
:class:`RouterStats`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jax_grouped_mlp._src import checks
from jax_grouped_mlp._src.moe.routing import RoutingConfig, ScoreFunction


@dataclasses.dataclass(frozen=True)
class RouterStats:
    """What the router did in one call of :func:`jax_grouped_mlp.moe_block` (a pytree).

    Attributes:
      expert_load: ``[E]`` int32, the (token, choice) pairs the router sent to each
        expert, over all tokens (summed over the devices under expert parallelism),
        including pairs a capacity later dropped. Sums to ``tokens * top_k``.
      load_balancing_loss: float32 scalar, ``E * sum_e f_e * P_e`` (Switch / GShard;
        DeepSeek-V3's sequence-wise form over the whole batch): ``f_e =
        expert_load[e] / (tokens * top_k)`` (no gradient) and ``P_e`` the mean over
        tokens of ``router_probs[:, e]``. 1 for a perfectly uniform router. Its
        gradient reaches the router kernel (and ``x``) through ``P_e``.
      z_loss: float32 scalar, ST-MoE's router z-loss, the mean over tokens of
        ``logsumexp(logits)**2``; differentiable like the above.
      dropped: int32 scalar, the pairs dropped by ``ExpertParallel.capacity_factor``
        (always 0 when drop-free).
      router_probs: ``[..., E]`` float32 (``x``'s leading axes), or None unless
        asked for: the probabilities ``P_e`` averages. With
        ``score_function="softmax"`` they are ``softmax(logits)`` (Switch / GShard);
        with ``"sigmoid"`` the sigmoid scores normalised to sum to 1 per token
        (DeepSeek-V3's balance loss), so that both forms give 1 for a uniform router.
        The selection bias (``score_bias``) is not in them.
    """

    expert_load: jax.Array
    load_balancing_loss: jax.Array
    z_loss: jax.Array
    dropped: jax.Array
    router_probs: jax.Array | None = None


jax.tree_util.register_dataclass(
    RouterStats,
    data_fields=["expert_load", "load_balancing_loss", "z_loss", "dropped", "router_probs"],
    meta_fields=[],
)


@dataclasses.dataclass(frozen=True)
class StatSums:
    """Per-shard sums over its valid tokens; add shards' sums to get the whole batch's."""

    load: jax.Array  # [E] int32 pair counts
    prob_sum: jax.Array  # [E] float32, sum over tokens of router_probs
    z_sum: jax.Array  # float32, sum over tokens of logsumexp(logits)**2
    dropped: jax.Array  # int32


jax.tree_util.register_dataclass(
    StatSums, data_fields=["load", "prob_sum", "z_sum", "dropped"], meta_fields=[]
)


def balance_probs(logits: jax.Array, routing: RoutingConfig) -> jax.Array:
    """``[T, E]`` float32 probabilities of the load-balancing loss (see RouterStats)."""
    logits = logits.astype(jnp.float32)
    if routing.score_function is ScoreFunction.SOFTMAX:
        return jax.nn.softmax(logits, axis=-1)
    # sigmoid(l) / sum(sigmoid(l)), as a softmax of log-sigmoids: finite where every
    # score underflows (all logits below about -88 made 0 / 0, a NaN loss and gradient).
    return jax.nn.softmax(jax.nn.log_sigmoid(logits), axis=-1)


def sums(
    logits: jax.Array,
    probs: jax.Array,
    group_sizes: jax.Array,
    valid: jax.Array | None,
    dropped: jax.Array | int = 0,
) -> StatSums:
    """Sums over the rows of ``logits``/``probs`` ``[T, E]`` where ``valid`` (None: all).

    ``group_sizes`` (``[E]``) already counts only valid pairs (padding pairs route to
    no expert).
    """
    z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2
    if valid is not None:
        probs = jnp.where(valid[:, None], probs, 0.0)
        z = jnp.where(valid, z, 0.0)
    return StatSums(
        load=group_sizes.astype(jnp.int32),
        prob_sum=jnp.sum(probs, axis=0),
        z_sum=jnp.sum(z),
        dropped=jnp.asarray(dropped, jnp.int32),
    )


def finish(s: StatSums, num_tokens: int, top_k: int, router_probs: jax.Array | None) -> RouterStats:
    """Whole-batch sums -> :class:`RouterStats` (``num_tokens`` static; 0 gives zero losses)."""
    e = s.load.shape[0]
    f = jax.lax.stop_gradient(s.load.astype(jnp.float32) / max(num_tokens * top_k, 1))
    p = s.prob_sum / max(num_tokens, 1)
    return RouterStats(
        expert_load=s.load,
        load_balancing_loss=e * jnp.sum(f * p),
        z_loss=s.z_sum / max(num_tokens, 1),
        dropped=s.dropped,
        router_probs=router_probs,
    )


def update_score_bias(bias: jax.Array, expert_load: jax.Array, rate: float | jax.Array) -> jax.Array:
    """Auxiliary-loss-free load balancing (DeepSeek-V3, Nemotron-3): one bias step.

    Returns ``bias + rate * sign(mean(expert_load) - expert_load)`` in ``bias``'s
    dtype, under ``stop_gradient``: experts that got more than the average load get
    a lower selection bias, the others a higher one (an expert at exactly the mean
    keeps its bias). Call it outside the gradient, once per step, with the
    ``expert_load`` of :class:`RouterStats` (summed over micro-batches or layers as
    your recipe wants); DeepSeek-V3 uses ``rate = 0.001``. Keep the bias in float32:
    in bfloat16 a step of 0.001 is rounded away once the bias passes about 0.25.
    Pure: nothing is updated
    in place (``MoEBlock.update_score_bias`` writes the result into its
    ``RouterBias``).
    """
    bias = jnp.asarray(bias)
    load = jnp.asarray(expert_load)
    if bias.ndim != 1 or load.shape != bias.shape:
        raise ValueError(
            f"bias and expert_load must both be [E], got bias.shape={bias.shape}, expert_load.shape={load.shape}"
            + (" (a stack of blocks: update each block's bias, e.g. under nnx.vmap or jax.vmap)"
               if bias.ndim == 2 and load.shape == bias.shape else "")
        )
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"bias must be a float array (an integer bias never moves), got bias.dtype={bias.dtype}")
    _check_rate(rate)
    load = load.astype(jnp.float32)
    step = jnp.sign(jnp.mean(load) - load) * jnp.asarray(rate, jnp.float32)
    return jax.lax.stop_gradient((bias.astype(jnp.float32) + step).astype(bias.dtype))


def _check_rate(rate) -> None:
    """A finite rate >= 0: a number or a 0-d int/float array. A traced rate is only
    checked for its type (its value is not known at trace time)."""
    if isinstance(rate, jax.core.Tracer):
        if rate.ndim != 0 or not (jnp.issubdtype(rate.dtype, jnp.floating) or jnp.issubdtype(rate.dtype, jnp.integer)):
            raise TypeError(f"rate must be a scalar number, got a traced {rate.dtype}{list(rate.shape)}")
        return
    if not checks.is_real(rate):
        raise TypeError(f"rate must be a number (a float, or a 0-d float array), got rate={rate!r}")
    value = float(rate)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"rate must be finite and >= 0 (a negative rate undoes the balancing), got rate={rate}")
