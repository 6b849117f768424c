"""The MoE block: router -> top-k -> permute -> ``grouped_mlp`` -> un-permute -> combine.

Single device: the (token, choice) pairs are sorted by expert on the device and fed
to one ``grouped_mlp`` call with the routing weights as ``probs``.

Expert parallel (``parallel=ExpertParallel(...)``): experts are sharded over one mesh
axis, tokens over that axis and the data axes. Inside ``jax.shard_map`` each device
routes its own tokens, sorts the pairs by expert (which also sorts them by owning
device), sends each device its block with a ragged all-to-all, sorts what arrived by
local expert, runs ``grouped_mlp`` on its local experts, and sends the results back
the same way. Block sizes travel as small dense ``all_to_all``s; nothing goes to the
host. ``Exchange.ALL_GATHER`` instead gathers every token of the expert axis on each
device, runs the pairs its experts own, and reduce-scatters the per-token sums. Drop-free by default: the receive buffer holds ``axis_size * tokens * top_k``
rows, the worst case of every pair in the axis choosing this device. ``grouped_mlp``
only computes the rows its ``group_sizes`` cover, but its residuals are allocated at
the buffer's size; ``capacity_factor`` trades that memory for dropped pairs.

Both paths are ``route -> permute -> grouped_mlp -> combine`` (the public pieces in
:mod:`routing`); an optional shared expert runs as one more ``grouped_mlp`` call over
a device's own tokens, and router statistics (:mod:`router_stats`) are partial sums
per token shard, added outside ``shard_map``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jax.sharding import PartitionSpec as P

from jax_grouped_mlp._src import checks, eager, groups, warn
from jax_grouped_mlp._src.moe import router_stats
from jax_grouped_mlp._src.moe import routing as routing_lib
from jax_grouped_mlp._src.moe.exchange import Exchange, exclusive_cumsum, ragged_all_to_all
from jax_grouped_mlp._src.op.mlp import grouped_mlp, weight_grads_in_bf16
from jax_grouped_mlp._src.op.prepared import PreparedWeights, check_prepared
from jax_grouped_mlp._src.op.recipes import Recipe
from jax_grouped_mlp._src.op.validation import is_mlp_float
from jax_grouped_mlp._src.moe.router_stats import RouterStats
from jax_grouped_mlp._src.moe.routing import RoutingConfig


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Where the block's experts and tokens live.

    Experts (``w1``/``w2`` axis 0) are split over ``expert_axis``; tokens (axis 0 of
    the flattened ``x``) over ``(*data_axes, expert_axis)``; the router is replicated.
    ``exchange`` picks the collectives (see :class:`Exchange`): ``"auto"`` uses the
    ragged all-to-all except on CPU; ``"all_gather"`` all-gathers the tokens and
    reduce-scatters the outputs over the expert axis instead.

    ``capacity_factor=None`` (default) is drop-free. A number ``c`` sizes each
    device's receive buffer (the ``M`` of its ``grouped_mlp``) at ``ceil(c * local
    pairs)`` rows instead of ``axis_size`` times that, where local pairs is a token
    shard's ``tokens * top_k``; ``c >= axis_size`` is drop-free, and ``c < 1`` drops
    pairs even under perfectly balanced routing (it warns). ``c`` must be finite
    (a Python or NumPy number; use None, not ``inf``, for drop-free). Pairs that do not
    fit are dropped (they contribute zero and get zero gradient): a device accepts
    its peers' blocks in rank order along the expert axis, each block ordered by
    local expert then token, and drops the tail (``RouterStats.dropped`` counts them).
    """

    mesh: jax.sharding.Mesh
    expert_axis: str
    data_axes: tuple[str, ...] = ()
    exchange: Exchange = Exchange.AUTO
    capacity_factor: float | None = None

    def __post_init__(self):
        if not isinstance(self.mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got mesh={type(self.mesh).__name__}")
        names = tuple(self.mesh.axis_names)
        if self.expert_axis not in names:
            raise ValueError(f"expert_axis={self.expert_axis!r} is not an axis of the mesh (axes: {names})")
        if isinstance(self.data_axes, str):
            data_axes = (self.data_axes,)
        elif isinstance(self.data_axes, (tuple, list)):
            data_axes = tuple(self.data_axes)
        else:
            raise TypeError(f"data_axes must be a mesh axis name or a tuple of them, got data_axes={self.data_axes!r}")
        for axis in data_axes:
            if axis not in names:
                raise ValueError(f"data_axes={data_axes!r}: {axis!r} is not an axis of the mesh (axes: {names})")
        if self.expert_axis in data_axes or len(set(data_axes)) != len(data_axes):
            raise ValueError(
                f"data_axes={data_axes!r} must be distinct and must not contain expert_axis={self.expert_axis!r}"
            )
        object.__setattr__(self, "data_axes", data_axes)
        object.__setattr__(self, "exchange", Exchange.parse(self.exchange))
        c = self.capacity_factor
        if c is not None:
            if checks.is_real(c) and math.isinf(c):  # it sizes a buffer: None is drop-free
                raise ValueError(f"capacity_factor must be finite (None is drop-free), got capacity_factor={c!r}")
            c = checks.positive_float("capacity_factor", c)
            object.__setattr__(self, "capacity_factor", c)
            if c < 1:  # below the average load: balanced routing drops pairs too
                warn.warn(
                    f"capacity_factor={c!r} is below 1: each device's buffer holds fewer rows than "
                    "its share of the pairs, so pairs are dropped even when routing is perfectly "
                    "balanced (1 is the average load; None is drop-free)"
                )

    @property
    def token_axes(self) -> tuple[str, ...]:
        return (*self.data_axes, self.expert_axis)

    @property
    def expert_size(self) -> int:
        return self.mesh.shape[self.expert_axis]

    @property
    def token_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.token_axes)


def moe_block(
    x: jax.Array,
    router_kernel: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    *,
    routing: RoutingConfig,
    score_bias: jax.Array | None = None,
    recipe: str = "mxfp8",
    parallel: ExpertParallel | None = None,
    fuse_fc1_epilogue: bool = True,
    shared_w1: jax.Array | None = None,
    shared_w2: jax.Array | None = None,
    return_stats: bool = False,
    return_router_probs: bool = False,
    prepared: PreparedWeights | None = None,
    weight_grad_dtype: DTypeLike | None = None,
) -> jax.Array | tuple[jax.Array, RouterStats]:
    """A mixture-of-experts layer of squared-ReLU experts; drop-free unless a capacity is set.

    Args:
      x: ``[..., H]`` tokens, any order (the block sorts them).
      router_kernel: ``[H, E]``; logits are ``x @ router_kernel`` in float32.
      w1: ``[E, H, F]`` and w2: ``[E, F, H]``, the stacked expert weights.
      routing: top-k, score function, normalisation and scaling (:class:`RoutingConfig`).
      score_bias: optional ``[E]`` added to the scores for expert *selection* only
        (DeepSeek-V3 / Nemotron-3 ``e_score_correction_bias``); gets no gradient.
      recipe: ``grouped_mlp``'s recipe, ``"mxfp8"``, ``"bf16"`` or ``"fp8_block"``.
      parallel: expert parallelism over a mesh (:class:`ExpertParallel`, which also
        holds the optional ``capacity_factor``), or None for one device.
      fuse_fc1_epilogue: ``grouped_mlp``'s (same numbers and the same recompute
        cost either way).
      shared_w1: ``[H, Fs]`` and shared_w2: ``[Fs, H]``, an optional shared expert
        (both or neither): a squared-ReLU MLP over every token, weight 1, added to
        the routed output. It runs as ``grouped_mlp`` with one group of all tokens
        (same recipe, same residual names); under expert parallelism on each
        device's own tokens, with the weights replicated.
      return_stats: also return :class:`RouterStats` (expert load, load-balancing
        and z losses, dropped pairs); the losses are differentiable.
      return_router_probs: with ``return_stats``, fill ``RouterStats.router_probs``.
      prepared: ``prepare_weights(w1, w2, recipe=recipe)`` of these same expert weights,
        made once for many micro-batches (``grouped_mlp``'s ``prepared``; the shared
        expert still prepares its own). Under expert parallelism it is split over the
        expert axis like the weights.
      weight_grad_dtype: ``grouped_mlp``'s, for the routed and the shared experts'
        weights: None (the default) or ``float32`` (float32 weights only) gives each
        weight's gradient in its own dtype; ``jnp.bfloat16`` rounds float32 weights'
        gradients to bfloat16 inside the op (half the bytes a training step keeps until
        its optimizer update). The router's gradient is float32 either way.

    Returns:
      ``[..., H]`` in ``x.dtype``: ``sum_k weight_k * expert_k(x)`` (plus the shared
      expert's output), summed in float32. With ``return_stats``: ``(y, stats)``.

    Raises:
      TypeError, ValueError: at trace time, naming the argument, for bad shapes,
        dtypes (``x``, ``w1``, ``w2`` and the shared expert's weights must be
        bfloat16 or float32, as ``grouped_mlp`` takes them), ``H``, ``F`` or ``Fs``
        of 0, ``top_k > E`` or ``E`` not divisible by the expert axis size.
    """
    if not isinstance(routing, RoutingConfig):
        raise TypeError(f"routing must be a RoutingConfig, got routing={type(routing).__name__}")
    if parallel is not None and not isinstance(parallel, ExpertParallel):
        raise TypeError(f"parallel must be an ExpertParallel or None, got parallel={type(parallel).__name__}")
    _check_args(x, router_kernel, w1, w2, score_bias, routing, parallel)
    shared = _check_extras(x, shared_w1, shared_w2, return_stats, return_router_probs)
    lead_shape = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if score_bias is not None:
        score_bias = jax.lax.stop_gradient(score_bias)
    if prepared is not None:
        check_prepared(prepared, Recipe.parse(recipe), w1, w2)
    if weight_grad_dtype is not None:  # (checked against the weights here, where the error names them)
        extra = {} if shared is None else {"shared_w1": shared[0], "shared_w2": shared[1]}
        weight_grads_in_bf16(weight_grad_dtype, w1=w1, w2=w2, **extra)
        weight_grad_dtype = jnp.dtype(weight_grad_dtype)
    statics = dict(routing=routing, recipe=recipe, parallel=parallel, fuse_fc1_epilogue=fuse_fc1_epilogue,
                   return_stats=return_stats, return_router_probs=return_router_probs,
                   weight_grad_dtype=weight_grad_dtype)
    arrays = (x, router_kernel, w1, w2, score_bias, shared_w1, shared_w2, prepared)
    if eager.outside_any_trace(arrays, tuple(statics.values())):
        return _moe_block_jit(*arrays, **statics)  # one compiled program per shape (eager.py)
    opts = _Options(
        routing=routing, recipe=recipe, fuse=fuse_fc1_epilogue, stats=return_stats, router_probs=return_router_probs,
        weight_grad_dtype=weight_grad_dtype,
    )
    if parallel is None:
        y, sums, probs = _moe_local(x2, router_kernel, score_bias, w1, w2, prepared, shared, opts)
    else:
        y, sums, probs = _moe_sharded(x2, router_kernel, score_bias, w1, w2, prepared, shared, opts, parallel)
    y = _unflatten_tokens(y, (*lead_shape, x.shape[-1]), x)
    if not return_stats:
        return y
    if probs is not None:
        probs = _unflatten_tokens(probs, (*lead_shape, probs.shape[-1]), x)
    return y, router_stats.finish(sums, x2.shape[0], routing.top_k, probs)


try:  # (not public in jax 0.11 / 0.12)
    from jax._src.core import ShardingTypeError as _SHARDING_TYPE_ERROR
except ImportError:  # pragma: no cover
    _SHARDING_TYPE_ERROR = Exception


def _unflatten_tokens(a: jax.Array, shape: tuple[int, ...], x: jax.Array) -> jax.Array:
    """``a`` ([T, ...], tokens flattened) reshaped to ``x``'s leading axes. On an
    ``Explicit`` mesh JAX cannot infer the layout of a reshape that splits a sharded
    token axis unevenly (``[16@expert, H]`` to ``[2, 8, H]`` over 4 devices): the result
    then takes ``x``'s own sharding on its leading axes."""
    try:
        return a.reshape(shape)
    except _SHARDING_TYPE_ERROR:
        spec = tuple(jax.typeof(x).sharding.spec)[: x.ndim - 1]
        spec = spec + (None,) * (x.ndim - 1 - len(spec)) + (None,) * (len(shape) - x.ndim + 1)
        return jax.lax.reshape(a, shape, out_sharding=jax.NamedSharding(jax.typeof(a).sharding.mesh, P(*spec)))


def _moe_block_positional(x, router_kernel, w1, w2, score_bias, shared_w1, shared_w2, prepared, **statics):
    return moe_block(x, router_kernel, w1, w2, score_bias=score_bias, shared_w1=shared_w1, shared_w2=shared_w2,
                     prepared=prepared, **statics)


_moe_block_jit = jax.jit(
    _moe_block_positional,
    static_argnames=("routing", "recipe", "parallel", "fuse_fc1_epilogue", "return_stats", "return_router_probs",
                     "weight_grad_dtype"),
)


def _check_args(x, router_kernel, w1, w2, score_bias, routing, parallel) -> None:
    for name, arr in (("x", x), ("router_kernel", router_kernel), ("w1", w1), ("w2", w2)):
        if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise TypeError(f"{name} must be an array, got {name}={type(arr).__name__}")
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float array, got {name}.dtype={arr.dtype}")
    for name, arr in (("x", x), ("w1", w1), ("w2", w2)):  # grouped_mlp's operands
        if not is_mlp_float(arr):
            raise TypeError(f"{name} must be bfloat16 or float32, got {name}.dtype={arr.dtype}")
    if x.ndim < 2:
        raise ValueError(f"x must be [..., H] with at least one token axis, got x.shape={x.shape}")
    h = x.shape[-1]
    if h == 0:  # grouped_mlp takes no H = 0
        raise ValueError(f"x must be [..., H] with H >= 1, got x.shape={x.shape}")
    if router_kernel.ndim != 2:
        raise ValueError(f"router_kernel must be [H, E] (rank 2), got router_kernel.shape={router_kernel.shape}")
    if router_kernel.shape[0] != h:
        raise ValueError(
            f"x's hidden size x.shape[-1]={h} does not match router_kernel.shape={router_kernel.shape} "
            f"([H, E]): x must be [..., {router_kernel.shape[0]}], or the block built for H={h}"
        )
    e = router_kernel.shape[1]
    if w1.ndim == 3 and w1.shape[1] == h and w1.shape[0] != e:
        raise ValueError(
            f"router_kernel.shape={router_kernel.shape} ([H, E]) scores E={e} experts, but "
            f"w1.shape={w1.shape} ([E, H, F]) holds {w1.shape[0]}: they must agree"
        )
    if w1.ndim != 3 or w1.shape[:2] != (e, h):
        raise ValueError(f"w1 must be [E, H, F] with E={e}, H={h}, got w1.shape={w1.shape}")
    f = w1.shape[2]
    if f == 0:  # grouped_mlp takes no F = 0 (its error would show the permuted x)
        raise ValueError(f"w1 must be [E, H, F] with F >= 1, got w1.shape={w1.shape}")
    if w2.shape != (e, f, h):
        raise ValueError(f"w2 must be [E, F, H]={(e, f, h)}, got w2.shape={w2.shape}")
    routing_lib.check_score_bias(score_bias, e)
    if routing.top_k > e:
        raise ValueError(f"routing.top_k={routing.top_k} is larger than the number of experts E={e}")
    if parallel is not None and e % parallel.expert_size:
        raise ValueError(
            f"the number of experts E={e} must be divisible by the size of "
            f"expert_axis={parallel.expert_axis!r} ({parallel.expert_size})"
        )


def _check_extras(x, shared_w1, shared_w2, return_stats, return_router_probs):
    """Checks the shared expert and the stats flags; returns ``(w1, w2)`` or None."""
    return_stats = checks.boolean("return_stats", return_stats)
    return_router_probs = checks.boolean("return_router_probs", return_router_probs)
    if return_router_probs and not return_stats:
        raise ValueError("return_router_probs=True needs return_stats=True (the probs travel in RouterStats)")
    if (shared_w1 is None) != (shared_w2 is None):
        raise ValueError(
            "shared_w1 and shared_w2 go together: got "
            f"shared_w1={'None' if shared_w1 is None else 'an array'}, "
            f"shared_w2={'None' if shared_w2 is None else 'an array'}"
        )
    if shared_w1 is None:
        return None
    for name, arr in (("shared_w1", shared_w1), ("shared_w2", shared_w2)):
        if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise TypeError(f"{name} must be an array, got {name}={type(arr).__name__}")
        if not is_mlp_float(arr):  # what the one-group grouped_mlp call takes, named here
            raise TypeError(f"{name} must be bfloat16 or float32, got {name}.dtype={arr.dtype}")
    h = x.shape[-1]
    if shared_w1.ndim != 2 or shared_w1.shape[0] != h or shared_w1.shape[1] == 0:
        raise ValueError(f"shared_w1 must be [H, Fs] with Fs >= 1, H={h}, got shared_w1.shape={shared_w1.shape}")
    fs = shared_w1.shape[1]
    if shared_w2.shape != (fs, h):
        raise ValueError(f"shared_w2 must be [Fs, H]={(fs, h)}, got shared_w2.shape={shared_w2.shape}")
    return shared_w1, shared_w2


@dataclasses.dataclass(frozen=True)
class _Options:
    """The block's static choices, passed down as one value."""

    routing: RoutingConfig
    recipe: str
    fuse: bool
    stats: bool
    router_probs: bool
    weight_grad_dtype: Any = None

    def mlp_kwargs(self) -> dict:
        """The keyword arguments of every ``grouped_mlp`` call of the block."""
        return dict(recipe=self.recipe, fuse_fc1_epilogue=self.fuse, weight_grad_dtype=self.weight_grad_dtype)


def _logits(x, router_kernel):
    return jnp.dot(
        x.astype(jnp.float32), router_kernel.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )


@jax.custom_vjp
def _router_logits(x, router_kernel):
    """``x @ router`` in float32 at HIGHEST precision (TF32 could change the winners).

    Differentiated as the plain product is (the same gradients, bit for bit), but its
    backward keeps ``x`` in its own dtype and casts it to float32 again, where plain AD
    keeps the float32 copy: a bf16 ``[T, H]`` instead of a float32 one (44 MB less per
    MoE layer of 8192 Nano tokens)."""
    return _logits(x, router_kernel)


def _router_logits_fwd(x, router_kernel):
    return _logits(x, router_kernel), (x, router_kernel)


def _router_logits_bwd(res, ct):
    # The cast again after ct exists: XLA would otherwise merge it with the forward's
    # and keep that float32 copy.
    x, router_kernel, ct = jax.lax.optimization_barrier((*res, ct))
    return jax.vjp(_logits, x, router_kernel)[1](ct)


_router_logits.defvjp(_router_logits_fwd, _router_logits_bwd)


def _shared_expert(x, shared, num_valid, opts):
    """The shared expert over the first ``num_valid`` rows of ``x`` (None: all), float32."""
    w1, w2 = shared
    rows = x.shape[0] if num_valid is None else jnp.clip(num_valid, 0, x.shape[0])
    sizes = jnp.asarray(rows, jnp.int32).reshape(1)
    y = grouped_mlp(x, w1[None], w2[None], sizes, None, **opts.mlp_kwargs())
    return y.astype(jnp.float32)


def _moe_local(x, router_kernel, score_bias, w1, w2, prepared, shared, opts: _Options):
    """One device: ``(y, StatSums or None, router probs or None)``."""
    e = w1.shape[0]
    logits = _router_logits(x, router_kernel)
    expert_ids, weights = routing_lib.route(logits, opts.routing, score_bias)
    xs, ps, group_sizes, perm = routing_lib.permute_pairs(x, expert_ids, weights, e)
    ys = grouped_mlp(xs, w1, w2, group_sizes, ps, prepared=prepared, **opts.mlp_kwargs())
    y = routing_lib.combine_f32(ys, perm)
    if shared is not None:
        y = y + _shared_expert(x, shared, None, opts)
    y = y.astype(x.dtype)
    if not opts.stats:
        return y, None, None
    probs = router_stats.balance_probs(logits, opts.routing)
    sums = router_stats.sums(logits, probs, group_sizes, None)
    return y, sums, probs if opts.router_probs else None


def _no_tokens(x, router_kernel, num_experts: int, opts: _Options):
    """What :func:`_moe_local` returns for ``x [0, H]``, without the experts: an empty
    output and the stats of no tokens (zero sums; zero gradients)."""
    y = jnp.zeros(x.shape, x.dtype)
    if not opts.stats:
        return y, None, None
    logits = _router_logits(x, router_kernel)
    probs = router_stats.balance_probs(logits, opts.routing)
    sums = router_stats.sums(logits, probs, jnp.zeros((num_experts,), jnp.int32), None)
    return y, sums, probs if opts.router_probs else None


def _check_exchange(exchange: Exchange, platform: str) -> None:
    """At trace time, what XLA:CPU would otherwise refuse only when it compiles (with an
    error naming an HLO opcode, not the argument)."""
    if platform == "cpu" and exchange is Exchange.RAGGED:
        raise ValueError(
            "ExpertParallel(exchange='ragged') needs jax.lax.ragged_all_to_all, which XLA:CPU cannot "
            "compile; on a CPU mesh use exchange='auto' (the dense all-to-all there), 'dense' or 'all_gather'"
        )


def _moe_sharded(x, router_kernel, score_bias, w1, w2, prepared, shared, opts: _Options, parallel: ExpertParallel):
    """Expert parallel: ``(y, StatSums or None, router probs or None)``, as ``_moe_local``."""
    mesh, token_axes = parallel.mesh, parallel.token_axes
    t = x.shape[0]
    shards = parallel.token_shards
    t_pad = -(-t // shards) * shards
    if t_pad != t:
        x = jnp.pad(x, ((0, t_pad - t), (0, 0)))
    platform = mesh.devices.flat[0].platform
    _check_exchange(parallel.exchange, platform)
    if t == 0:  # nothing to exchange (and a size-0 reduce-scatter does not lower)
        return _no_tokens(x, router_kernel, w1.shape[0], opts)
    body = _ExpertParallelBody(
        opts=opts,
        axis=parallel.expert_axis,
        data_axes=parallel.data_axes,
        num_tokens=t,
        exchange=parallel.exchange.resolve(platform),
        capacity_factor=parallel.capacity_factor,
    )
    tok, exp = P(token_axes, None), P(parallel.expert_axis, None, None)
    if score_bias is None:
        score_bias = jnp.zeros((router_kernel.shape[1],), jnp.float32)  # selection-neutral
    # prepared: a pytree (or None) whose leaves all have the experts on axis 0.
    args = (x, router_kernel, score_bias, w1, w2, prepared, *(shared or ()))
    specs = (tok, P(None, None), P(None), exp, exp, exp, *((P(None, None),) * len(shared or ())))
    args = tuple(jax.tree.map(lambda leaf, s=s: _reshard(leaf, mesh, s), a) for a, s in zip(args, specs))
    # Stats leave as one row of partial sums per token shard (summed below, outside the
    # shard_map: an ordinary reduction, so the losses' gradients need no psum transpose).
    out_specs = (tok, P(token_axes), tok if opts.router_probs else None) if opts.stats else tok
    # check_vma=False: the transpose then sums the replicated inputs' gradients (router,
    # and weights over the data axes) at the shard_map's edge. The op also type-checks
    # with True (varying.py; tests/moe_sharded_cases.py passes with it on the CPU's
    # dense exchange), but the GPU's ragged exchange has only been run with False.
    out = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)(*args)
    y, sums, probs = out if opts.stats else (out, None, None)
    if sums is not None:
        sums = jax.tree.map(lambda a: jnp.sum(a, axis=0), sums)
    if t_pad != t:  # an explicit mesh cannot slice a sharded axis to a non-multiple
        y = _reshard(y, mesh, P(None, None))[:t]
        if probs is not None:
            probs = _reshard(probs, mesh, P(None, None))[:t]
    return y, sums, probs


def _reshard(a, mesh, spec):
    """Explicit-mode meshes need operands already laid out as shard_map's in_specs."""
    explicit = jax.sharding.AxisType.Explicit
    if any(t == explicit for t in getattr(mesh, "axis_types", ())):
        return jax.sharding.reshard(a, jax.sharding.NamedSharding(mesh, spec))
    return a


@dataclasses.dataclass(frozen=True)
class _ExpertParallelBody:
    """The per-device program of the expert-parallel block (runs inside shard_map)."""

    opts: _Options
    axis: str
    data_axes: tuple[str, ...]
    num_tokens: int
    exchange: Exchange
    capacity_factor: float | None

    def __call__(self, x, router_kernel, score_bias, w1, w2, prepared, *shared):
        k = self.opts.routing.top_k
        ep = jax.lax.axis_size(self.axis)
        t_local = x.shape[0]
        e_local = w1.shape[0]
        n = t_local * k
        rows = ep * n  # receive buffer: drop-free worst case ...
        if self.capacity_factor is not None:  # ... or what the capacity allows
            rows = min(rows, max(1, math.ceil(self.capacity_factor * n)))

        # 1. Route local tokens; padding rows (past num_tokens globally) go nowhere.
        first_row = jax.lax.axis_index((*self.data_axes, self.axis)) * t_local
        num_valid = self.num_tokens - first_row
        valid = jnp.arange(t_local) < num_valid
        logits = _router_logits(x, router_kernel)
        expert_ids, weights = routing_lib.route(logits, self.opts.routing, score_bias)
        expert_ids = jnp.where(valid[:, None], expert_ids, ep * e_local)

        # 2.-4. Pairs to their experts' devices, the experts, results back, per-token sums.
        exchange = self._all_gather if self.exchange is Exchange.ALL_GATHER else self._all_to_all
        y, load, dropped = exchange(x, expert_ids, weights, w1, w2, prepared, rows)
        if shared:
            y = y + _shared_expert(x, shared, num_valid, self.opts)
        y = y.astype(x.dtype)
        if not self.opts.stats:
            return y
        probs = router_stats.balance_probs(logits, self.opts.routing)
        sums = router_stats.sums(logits, probs, load, valid, dropped)
        sums = jax.tree.map(lambda a: a[None], sums)  # one row per token shard
        return y, sums, probs if self.opts.router_probs else None

    def _experts(self, x_rows, w1, w2, prepared, group_sizes, probs):
        return grouped_mlp(x_rows, w1, w2, group_sizes, probs, prepared=prepared, **self.opts.mlp_kwargs())

    def _all_to_all(self, x, expert_ids, weights, w1, w2, prepared, rows):
        """Ragged (or dense) all-to-all: each device receives only the pairs of its experts.

        Returns ``(y [t_local, H] float32, expert load [E], dropped pairs)``.
        """
        ep = jax.lax.axis_size(self.axis)
        e_local = w1.shape[0]
        n = expert_ids.size
        h = x.shape[1]
        # Global expert order is also owner order: expert e lives on device e // e_local.
        xs, ps, group_sizes, perm = routing_lib.permute_pairs(x, expert_ids, weights, ep * e_local)

        # Block sizes: per (peer, local expert) counts out, the transposed counts in.
        counts_out = group_sizes.reshape(ep, e_local)
        counts_in = jax.lax.all_to_all(counts_out, self.axis, 0, 0, tiled=True)  # [source, e_local]
        send_offsets = exclusive_cumsum(counts_out.sum(axis=1))  # block starts in xs
        recv_sizes = counts_in.sum(axis=1)
        dropped = jnp.zeros((), jnp.int32)
        if rows < ep * n:  # keep what fits, in source order; each block loses its tail
            arrived = jnp.sum(recv_sizes)
            recv_sizes, counts_in = _fit_arrivals(counts_in, rows)
            dropped = arrived - jnp.sum(recv_sizes)
            send_sizes = jax.lax.all_to_all(recv_sizes, self.axis, 0, 0, tiled=True)
        else:
            send_sizes = counts_out.sum(axis=1)
        recv_offsets = exclusive_cumsum(recv_sizes)  # blocks land contiguously, by source
        dest_offsets = jax.lax.all_to_all(recv_offsets, self.axis, 0, 0, tiled=True)
        back_offsets = jax.lax.all_to_all(send_offsets, self.axis, 0, 0, tiled=True)

        def send(operand):
            out = jnp.zeros((rows, *operand.shape[1:]), operand.dtype)
            return ragged_all_to_all(
                operand, out, send_offsets, send_sizes, dest_offsets, recv_sizes,
                axis_name=self.axis, exchange=self.exchange,
            )

        x_in = send(xs)
        p_in = send(ps[:, None])[:, 0]  # ragged_all_to_all documents operands of rank >= 2

        # Sort what arrived (source-major, expert-minor runs) by local expert.
        run_ends = jnp.cumsum(counts_in.reshape(-1))
        run = groups.search_sorted(run_ends, jnp.arange(rows, dtype=jnp.int32), side="right")
        local_ids = jnp.where(run < ep * e_local, run % e_local, e_local).astype(jnp.int32)
        local = routing_lib.sort_by_expert(local_ids, e_local)
        gather = routing_lib.gather_pairs
        y_local = self._experts(gather(x_in, local.order, local.inverse), w1, w2, prepared, local.group_sizes,
                                gather(p_in, local.order, local.inverse))
        y_in = gather(y_local, local.inverse, local.order)

        # Results go back to where their pairs came from, then combine per token.
        ys = ragged_all_to_all(
            y_in, jnp.zeros((n, h), y_in.dtype), recv_offsets, recv_sizes, back_offsets, send_sizes,
            axis_name=self.axis, exchange=self.exchange,
        )
        return routing_lib.combine_f32(ys, perm), group_sizes, dropped

    def _all_gather(self, x, expert_ids, weights, w1, w2, prepared, rows):
        """All-gather over the expert axis: every device sees every pair of the axis, runs
        the ones its experts own, and a reduce-scatter sums each token's outputs back to
        the token's device. Same pairs kept, same order in ``grouped_mlp`` as
        :meth:`_all_to_all` (so the same drops under a capacity); only the float32
        per-token sum is added in another order.
        """
        ep = jax.lax.axis_size(self.axis)
        e_local = w1.shape[0]
        t_local, k = expert_ids.shape
        load = jnp.bincount(expert_ids.reshape(-1), length=ep * e_local).astype(jnp.int32)
        ids_all = jax.lax.all_gather(expert_ids, self.axis, tiled=True)
        w_all = jax.lax.all_gather(weights, self.axis, tiled=True)
        lid = ids_all - jax.lax.axis_index(self.axis) * e_local
        mine = (lid >= 0) & (lid < e_local)
        lid = jnp.where(mine, lid, e_local).reshape(-1)  # pairs in (source, token, choice) order
        dropped = jnp.zeros((), jnp.int32)
        if rows < lid.shape[0]:  # keep the arrivals the all-to-all would keep
            src = jnp.arange(lid.shape[0], dtype=jnp.int32) // (t_local * k)
            run = jnp.where(mine.reshape(-1), src * e_local + lid, ep * e_local)  # (source, expert) runs
            counts = jnp.bincount(run, length=ep * e_local).reshape(ep, e_local)
            _, kept = _fit_arrivals(counts, rows)
            keep = _rank_in_run(run) < jnp.append(kept.reshape(-1), 0)[run]
            dropped = jnp.sum(mine) - jnp.sum(keep)
            lid = jnp.where(keep, lid, e_local)
        perm = routing_lib.sort_by_expert(lid, e_local, top_k=k)
        order = perm.order[:rows]  # the kept pairs sort first, at most `rows` of them
        x_rows = _gathered_pairs(x, order, perm.inverse, k, self.axis)  # [rows, H] of [ep * t_local, H]
        y_rows = self._experts(x_rows, w1, w2, prepared, perm.group_sizes,
                               routing_lib.gather_pairs(w_all.reshape(-1), order, perm.inverse))
        y_pairs = jnp.pad(y_rows, ((0, lid.shape[0] - rows), (0, 0)))
        y_all = routing_lib.combine_f32(y_pairs, perm)  # this device's experts' share, every token
        y = jax.lax.psum_scatter(y_all, self.axis, scatter_dimension=0, tiled=True)
        return y, load, dropped


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gathered_pairs(x, order, inverse, top_k, axis):
    """``all_gather(x)[order // top_k]`` over ``axis`` (tiled), whose backward sums each
    token's pairs in float32 (:func:`routing.pair_sums`) and reduce-scatters that float32
    sum, rounding to ``x``'s dtype once, as the single-device block does, where the
    plain composition would add the devices' rounded bf16 sums."""
    return jax.lax.all_gather(x, axis, tiled=True)[order // top_k]


def _gathered_pairs_fwd(x, order, inverse, top_k, axis):
    return jax.lax.all_gather(x, axis, tiled=True)[order // top_k], inverse


def _gathered_pairs_bwd(top_k, axis, inverse, ct):
    sums = routing_lib.pair_sums(ct, inverse, top_k)  # [ep * t_local, H]
    return jax.lax.psum_scatter(sums, axis, scatter_dimension=0, tiled=True).astype(ct.dtype), None, None


_gathered_pairs.defvjp(_gathered_pairs_fwd, _gathered_pairs_bwd)


def _fit_arrivals(counts_in: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """A receive buffer of ``rows`` takes arrivals by source, each source's block in
    local-expert order, and drops the tail: ``(kept per source, kept per (source, expert))``
    from the ``[source, expert]`` counts."""
    recv = counts_in.sum(axis=1)
    recv = jnp.minimum(recv, jnp.maximum(rows - exclusive_cumsum(recv), 0))
    kept = jnp.minimum(jnp.cumsum(counts_in, axis=1), recv[:, None])
    return recv, jnp.diff(kept, axis=1, prepend=jnp.zeros_like(kept[:, :1]))


def _rank_in_run(run: jax.Array) -> jax.Array:
    """Each element's index among the earlier elements with the same value (stable)."""
    order = jnp.argsort(run, stable=True)
    sorted_run = run[order]
    first = groups.search_sorted(sorted_run, sorted_run, side="left")
    rank = jnp.arange(run.shape[0], dtype=jnp.int32) - first.astype(jnp.int32)
    return jnp.zeros_like(rank).at[order].set(rank)
