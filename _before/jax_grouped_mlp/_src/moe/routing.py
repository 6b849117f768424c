"""Top-k routing and the device-side permutation of (token, choice) pairs into expert order.

Everything here is plain JAX on device arrays: no host sync, static shapes, so it is
safe under ``jax.jit`` and CUDA graphs. The sort is ``jnp.argsort(stable=True)``, so
pairs routed to the same expert keep token order, which makes the permutation (and
with it the rounding of every later sum) deterministic.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

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
        object.__setattr__(self, "normalize_weights", checks.boolean("normalize_weights", self.normalize_weights))
        # Finite and within float32: it multiplies the float32 weights.
        factor = checks.positive_float("routed_scaling_factor", self.routed_scaling_factor, float32=True)
        object.__setattr__(self, "routed_scaling_factor", factor)


def route(
    logits: jax.Array, config: RoutingConfig, score_bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """``[T, E]`` router logits -> (expert ids ``[T, k]`` int32, weights ``[T, k]`` float32).

    The scores are ``config.score_function`` of the float32 logits; the ``k`` experts
    with the highest ``scores + score_bias`` are chosen (``score_bias`` ``[E]``, the
    selection-only bias, may be None), and their weights are the *unbiased* scores,
    normalised and scaled as ``config`` says. Ties go to the lower expert index
    (``lax.top_k``). Differentiable in ``logits`` through the weights. Feed the
    result to :func:`permute`. Raises TypeError for a ``config`` that is not a
    :class:`RoutingConfig` or a ``score_bias`` that is not a real array (float or
    integer; a complex bias would lose its imaginary part), ValueError for logits that are not a
    float ``[T, E]`` array, ``config.top_k > E`` or a ``score_bias`` that is not ``[E]``.
    """
    _check_route_args(logits, config, score_bias)
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


def _check_route_args(logits, config, score_bias) -> None:
    if not isinstance(config, RoutingConfig):
        raise TypeError(f"config must be a RoutingConfig, got config={type(config).__name__}")
    if getattr(logits, "ndim", None) != 2 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(
            f"logits must be a float [T, E] array, got logits.shape={getattr(logits, 'shape', None)}, "
            f"dtype={getattr(logits, 'dtype', None)}"
        )
    e = logits.shape[1]
    if config.top_k > e:
        raise ValueError(f"config.top_k={config.top_k} is larger than the number of experts E={e} (logits' last axis)")
    check_score_bias(score_bias, e)


def check_score_bias(score_bias, num_experts: int) -> None:
    """``score_bias`` is None or a real ``[E]`` array, float or integer (a complex one would
    lose its imaginary part, a bool one is no bias): :func:`route`'s and ``moe_block``'s rule."""
    if score_bias is None:
        return
    _require_array("score_bias", score_bias, "a real [E] array or None")
    if score_bias.shape != (num_experts,):
        raise ValueError(
            f"score_bias must be [E]=({num_experts},), got score_bias.shape={getattr(score_bias, 'shape', None)}"
        )
    if not any(jnp.issubdtype(score_bias.dtype, t) for t in (jnp.floating, jnp.integer)):
        raise TypeError(f"score_bias must be a real (float) array, got score_bias.dtype={score_bias.dtype}")


def _require_array(name: str, value, expected: str) -> None:
    """A TypeError naming ``name`` unless ``value`` has a shape and a dtype (a list or a
    scalar would otherwise fail later with a shape error that reads ``shape=None``)."""
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"{name} must be {expected}, got {name}={type(value).__name__}")


def _check_weights(name: str, weights, shape: tuple[int, ...], expected: str) -> None:
    """``weights`` is None or a float array of ``shape`` (``expected`` describes it)."""
    if weights is None:
        return
    _require_array(name, weights, "an array or None")
    if weights.shape != shape:
        raise ValueError(f"{name} must be {expected}, got {name}.shape={weights.shape}")
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise TypeError(f"{name} must be a float array, got {name}.dtype={weights.dtype}")


@dataclasses.dataclass(frozen=True)
class Permutation:
    """(token, choice) pairs sorted by expert; a pytree (``top_k`` is static).

    ``order[i]`` is the flat pair index (``token * top_k + choice``) at sorted
    position ``i``; ``inverse`` undoes it. ``group_sizes[e]`` counts the pairs of
    expert ``e``; pairs with an expert id outside ``[0, num_experts)`` (padding or
    skipped pairs) sort last and are counted nowhere.
    """

    order: jax.Array
    inverse: jax.Array
    group_sizes: jax.Array
    top_k: int = 1

    @property
    def num_tokens(self) -> int:
        return self.order.shape[0] // self.top_k


jax.tree_util.register_dataclass(
    Permutation, data_fields=["order", "inverse", "group_sizes"], meta_fields=["top_k"]
)


def sort_by_expert(expert_ids: jax.Array, num_experts: int, top_k: int = 1) -> Permutation:
    """Stable device-side sort of flat expert ids ``[N]`` (ids may be ``num_experts`` = dropped)."""
    n = expert_ids.shape[0]
    order = jnp.argsort(expert_ids, stable=True).astype(jnp.int32)
    inverse = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[expert_ids].add(1, mode="drop")
    return Permutation(order=order, inverse=inverse, group_sizes=group_sizes, top_k=top_k)


def permute(
    x: jax.Array, expert_ids: jax.Array, weights: jax.Array | None, num_experts: int
) -> tuple[jax.Array, jax.Array | None, jax.Array, Permutation]:
    """Sorts the (token, choice) pairs by expert: what a grouped expert op takes.

    Args:
      x: ``[T, H]`` tokens.
      expert_ids: ``[T, k]`` integer expert of each pair (:func:`route`'s first
        output). Ids outside ``[0, num_experts)`` mark pairs to skip: they sort last,
        count in no group, and :func:`combine` gives them zero.
      weights: ``[T, k]`` float routing weights (:func:`route`'s second output), or None.
      num_experts: ``E``, a static int.

    Returns:
      ``(x_sorted [T*k, H], weights_sorted [T*k] or None, group_sizes [E] int32,
      permutation)``. Row ``i`` of ``x_sorted`` is token ``permutation.order[i] // k``;
      expert ``e`` owns the ``group_sizes[e]`` rows after those of experts ``0..e-1``,
      in token order (stable sort), and the skipped pairs come last. Everything stays
      on the device with static shapes.

    Raises:
      TypeError, ValueError: naming the argument, for non-array ``x`` or
        ``expert_ids``, non-array or non-float ``weights``, bad shapes, non-integer ``expert_ids`` or ``num_experts < 1``.
    """
    return permute_pairs(x, expert_ids, weights, num_experts, forward_mode=True)


def permute_pairs(
    x: jax.Array, expert_ids: jax.Array, weights: jax.Array | None, num_experts: int, *,
    forward_mode: bool = False,
) -> tuple[jax.Array, jax.Array | None, jax.Array, Permutation]:
    """:func:`permute`, same checks and values (note the default: ``forward_mode=False``,
    what the block wants; the public :func:`permute` passes True). Without ``forward_mode`` its two gathers
    are :func:`gather_pairs` (reverse mode only): their backward gathers and sums each
    token's ``k`` rows in float32, where plain indexing's backward scatter-adds them into
    a zero-filled ``[T, H]`` in ``x``'s dtype (XLA:GPU's scatter of repeated indices adds
    in no fixed order). With ``forward_mode``, plain indexing (any mode)."""
    num_experts = checks.positive_int("num_experts", num_experts)
    _require_array("x", x, "a [T, H] array")
    _require_array("expert_ids", expert_ids, "an integer [T, k] array")
    if getattr(expert_ids, "ndim", None) != 2 or not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(
            f"expert_ids must be an integer [T, k] array, got expert_ids.shape="
            f"{getattr(expert_ids, 'shape', None)}, dtype={getattr(expert_ids, 'dtype', None)}"
        )
    t, k = expert_ids.shape
    if getattr(x, "ndim", None) != 2 or x.shape[0] != t:
        raise ValueError(f"x must be [T, H] with T={t} (expert_ids' rows), got x.shape={getattr(x, 'shape', None)}")
    _check_weights("weights", weights, (t, k), f"[T, k]={(t, k)} like expert_ids")
    ids = expert_ids.astype(jnp.int32)
    valid = (ids >= 0) & (ids < num_experts)
    if jnp.iinfo(expert_ids.dtype).bits > 32:  # a 64-bit id the cast wraps into [0, E) is skipped too
        valid = valid & (expert_ids >= 0) & (expert_ids < num_experts)
    ids = jnp.where(valid, ids, num_experts).reshape(-1)
    perm = sort_by_expert(ids, num_experts, top_k=k)
    if forward_mode:
        x_sorted = x[perm.order // k]
        w_sorted = None if weights is None else weights.reshape(-1)[perm.order]
    else:
        x_sorted = gather_pairs(x, perm.order, perm.inverse, k)
        w_sorted = None if weights is None else gather_pairs(weights.reshape(-1), perm.order, perm.inverse)
    return x_sorted, w_sorted, perm.group_sizes, perm


def combine(
    y_sorted: jax.Array, permutation: Permutation, weights_sorted: jax.Array | None = None, *, dtype=None
) -> jax.Array:
    """Undoes :func:`permute`: per-pair outputs ``[T*k, H]`` -> per-token sums ``[T, H]``.

    ``y[t] = sum over t's k pairs of w * y_sorted[pair]``, summed in float32 and
    cast to ``dtype`` (default ``y_sorted.dtype``). ``w`` is ``weights_sorted`` (as
    :func:`permute` returned them) or 1 when None: pass None when the expert op has
    already multiplied its rows by the weights (``grouped_mlp``'s ``probs`` does),
    the weights when it has not. Rows at or past ``sum(group_sizes)`` (the skipped
    pairs) contribute zero whatever they hold. Differentiable in ``y_sorted`` and
    ``weights_sorted``. Raises ValueError for bad shapes, TypeError for a
    ``y_sorted`` that is not an array, ``weights_sorted`` that is not a float array,
    a ``permutation`` that is not :func:`sort_by_expert`'s / :func:`permute`'s
    :class:`Permutation`, or a ``dtype`` other than bfloat16, float16, float32 or float64.
    """
    if not isinstance(permutation, Permutation):
        raise TypeError(f"permutation must be the Permutation that permute / sort_by_expert returned, "
                        f"got permutation={type(permutation).__name__}")
    if dtype is not None:
        dtype = checks.float_dtype("dtype", dtype, ("bfloat16", "float16", "float32", "float64"))
    n = permutation.order.shape[0]
    _require_array("y_sorted", y_sorted, "a [T*k, H] array")
    if getattr(y_sorted, "ndim", None) != 2 or y_sorted.shape[0] != n:
        raise ValueError(
            f"y_sorted must be [T*k, H] with T*k={n} (the permutation's pairs), "
            f"got y_sorted.shape={getattr(y_sorted, 'shape', None)}"
        )
    _check_weights("weights_sorted", weights_sorted, (n,), f"[T*k]=({n},)")
    y = combine_f32(y_sorted, permutation, weights_sorted, forward_mode=True)
    return y.astype(y_sorted.dtype if dtype is None else dtype)


def combine_f32(
    y_sorted: jax.Array, permutation: Permutation, weights_sorted: jax.Array | None = None, *,
    forward_mode: bool = False,
) -> jax.Array:
    """:func:`combine` without the checks and the final cast (float32 out).

    The skipped pairs are masked by :func:`rows_below` and the rows un-permuted by
    :func:`gather_pairs` (both reverse-mode differentiable only; their backward keeps
    only a count and the permutation), or with ``forward_mode`` by the plain
    ``jnp.where`` and indexing they wrap (any mode): the same values and gradients."""
    num_valid = jnp.sum(permutation.group_sizes)
    y = y_sorted.astype(jnp.float32)
    y = _zero_rows_from(y, num_valid) if forward_mode else rows_below(y, num_valid)
    if weights_sorted is not None:  # a skipped pair's weight may be NaN (a masked token's)
        y = y * _zero_rows_from(weights_sorted.astype(jnp.float32), num_valid)[:, None]
    if forward_mode:
        y = y[permutation.inverse]
    else:
        y = gather_pairs(y, permutation.inverse, permutation.order)
    y = y.reshape(permutation.num_tokens, permutation.top_k, y_sorted.shape[-1])
    return jnp.sum(y, axis=1)


def _zero_rows_from(y: jax.Array, num_valid: jax.Array) -> jax.Array:
    """``y`` (rows first, any rank) with its rows at or past ``num_valid`` zero (plain ``jnp.where``)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (y.shape[0],) + (1,) * (y.ndim - 1), 0)
    return jnp.where(rows < num_valid, y, jnp.zeros((), y.dtype))


@jax.custom_vjp
def rows_below(y: jax.Array, num_valid: jax.Array) -> jax.Array:
    """``y`` with its rows at or past ``num_valid`` set to zero (whatever they hold, NaN
    included), and the same mask on the cotangent. The same values and gradients as
    ``jnp.where`` of a row mask, but its backward keeps only ``num_valid``, where
    differentiating ``jnp.where`` saves its mask, as large as ``y``, for the backward
    (what JAX saves; XLA may rebuild it instead). A ``custom_vjp``: reverse mode only
    (``jax.jvp`` raises)."""
    return _zero_rows_from(y, num_valid)


def _rows_below_fwd(y, num_valid):
    return _zero_rows_from(y, num_valid), num_valid


def _rows_below_bwd(num_valid, ct):
    return _zero_rows_from(ct, num_valid), None


rows_below.defvjp(_rows_below_fwd, _rows_below_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_pairs(x: jax.Array, order: jax.Array, inverse: jax.Array, top_k: int = 1) -> jax.Array:
    """``x[order // top_k]``, where ``order`` is a permutation of ``N = len(inverse)``
    pairs (or its first ``r`` entries) and ``inverse`` its inverse, with pairs
    ``t * top_k .. t * top_k + top_k - 1`` taking row ``t`` of ``x``.

    Its backward gathers instead of scatters: row ``t``'s cotangent is the sum of its
    ``top_k`` pairs' rows, ``ct[inverse]`` (rows past ``r`` count zero) summed in float32
    (or ``ct``'s wider dtype) in pair order, rounded once to ``x``'s dtype. Plain
    indexing's backward scatter-adds into a zero-filled buffer of ``x``'s shape: with
    repeated rows (``top_k > 1``) in ``x``'s dtype and, on XLA:GPU, in no fixed order;
    and XLA may merge that zero fill with a forward one and keep it from the forward
    pass on (in ``moe_block``'s step at the Nano shape, a float32 ``[49152, 2688]``
    per layer). With ``top_k = 1`` the gradient is the plain one bit for bit. A
    ``custom_vjp``: reverse mode only (``jax.jvp`` raises)."""
    return x[order // top_k]


def _gather_pairs_fwd(x, order, inverse, top_k):
    return x[order // top_k], inverse


def _gather_pairs_bwd(top_k, inverse, ct):
    return pair_sums(ct, inverse, top_k).astype(ct.dtype), None, None


def pair_sums(ct: jax.Array, inverse: jax.Array, top_k: int) -> jax.Array:
    """:func:`gather_pairs`' cotangent before its rounding: per row of ``x``, the sum of
    its ``top_k`` pairs' rows of ``ct`` (rows past ``len(ct)`` count zero), in pair
    order, in float32 or ``ct``'s wider dtype (``top_k = 1``: the rows as they are, in
    ``ct``'s dtype)."""
    n = inverse.shape[0]
    ct = jnp.pad(ct, ((0, n - ct.shape[0]),) + ((0, 0),) * (ct.ndim - 1))  # (a prefix of the pairs)
    if top_k == 1:  # a permutation: nothing to add
        return ct[inverse]
    acc = ct.dtype if jnp.finfo(ct.dtype).bits > 32 else jnp.float32  # (no promotion: strict mode)
    rows = ct[inverse].astype(acc).reshape(n // top_k, top_k, *ct.shape[1:])
    return jnp.sum(rows, axis=1)


gather_pairs.defvjp(_gather_pairs_fwd, _gather_pairs_bwd)
