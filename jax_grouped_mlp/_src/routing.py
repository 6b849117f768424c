"""Top-k routing and the device-side permutation of (token, choice) pairs into expert order.

Everything here is plain JAX on device arrays: no host sync, static shapes, so it is
safe under ``jax.jit`` and CUDA graphs. The sort is ``jnp.argsort(stable=True)``, so
pairs routed to the same expert keep token order, which makes the permutation (and
with it the rounding of every later sum) deterministic.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from jax_grouped_mlp._src import checks


class ScoreFunction(str, enum.Enum):
    """How router logits become per-expert scores."""

    SOFTMAX = "softmax"  # Mixtral, Qwen-MoE: softmax over all experts
    SIGMOID = "sigmoid"  # DeepSeek-V3, Nemotron-3: independent sigmoid per expert

    @classmethod
    def parse(cls, value: "str | ScoreFunction") -> "ScoreFunction":
        return checks.parse_enum(cls, value, "score_function")


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    """How each token picks its experts and how their outputs are weighted.

    weights = top_k(scores), then, if ``normalize_weights``, divided by their sum
    (plus 1e-20), then multiplied by ``routed_scaling_factor`` (a positive number,
    Python or NumPy, finite and within float32's range). With
    ``score_function="softmax"`` and ``normalize_weights=True`` this is Mixtral's
    router; Nemotron-3 uses ``"sigmoid"``, ``normalize_weights=True`` and the
    model's ``routed_scaling_factor``. An optional selection bias (DeepSeek-V3's
    ``e_score_correction_bias``) is passed to the block, not stored here: it changes
    which experts are chosen, never the weights.
    """

    top_k: int
    score_function: ScoreFunction = ScoreFunction.SOFTMAX
    normalize_weights: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "top_k", checks.positive_int("top_k", self.top_k))
        object.__setattr__(self, "score_function", ScoreFunction.parse(self.score_function))
        if not isinstance(self.normalize_weights, bool):
            raise TypeError(f"normalize_weights must be a bool, got normalize_weights={self.normalize_weights!r}")
        # Finite and within float32: it multiplies the float32 weights.
        factor = checks.positive_float("routed_scaling_factor", self.routed_scaling_factor, float32=True)
        object.__setattr__(self, "routed_scaling_factor", factor)


def route(
    logits: jax.Array, config: RoutingConfig, score_bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """``[T, E]`` router logits -> (expert ids ``[T, k]`` int32, weights ``[T, k]`` float32).

    Ties between equal scores go to the lower expert index (``lax.top_k``).
    """
    logits = logits.astype(jnp.float32)
    if config.score_function is ScoreFunction.SOFTMAX:
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = scores if score_bias is None else scores + score_bias.astype(jnp.float32)
    _, expert_ids = jax.lax.top_k(choice, config.top_k)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if config.normalize_weights:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return expert_ids.astype(jnp.int32), weights


@dataclasses.dataclass(frozen=True)
class Permutation:
    """(token, choice) pairs sorted by expert.

    ``order[i]`` is the flat pair index (``token * k + choice``) at sorted position
    ``i``; ``inverse`` undoes it. ``group_sizes[e]`` counts the pairs of expert ``e``;
    pairs with an expert id outside ``[0, num_experts)`` (padding tokens) sort last
    and are counted nowhere.
    """

    order: jax.Array
    inverse: jax.Array
    group_sizes: jax.Array


def sort_by_expert(expert_ids: jax.Array, num_experts: int) -> Permutation:
    """Stable device-side sort of flat expert ids ``[N]`` (ids may be ``num_experts`` = dropped)."""
    n = expert_ids.shape[0]
    order = jnp.argsort(expert_ids, stable=True).astype(jnp.int32)
    inverse = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[expert_ids].add(1, mode="drop")
    return Permutation(order=order, inverse=inverse, group_sizes=group_sizes)
