"""Flax NNX shell over :func:`grouped_mlp`: holds the stacked expert weights.

Sharding: every param carries Flax's ``out_sharding`` metadata in *logical* axis names
(:class:`AxisNames`; defaults :data:`EXPERT_AXIS`, :data:`EMBED_AXIS`,
:data:`MLP_AXIS`, the MaxText/Flax names), which ``nnx.logical_axis_rules`` maps to
mesh axes. How a param is placed at construction depends on the mesh known then
(``mesh=``, or the one ``jax.set_mesh`` set): with none, the param stays where it was
created and carries only the names (no mesh is needed later, e.g. to build an
optimizer); with one, each name resolves through the active logical axis rules, else
to the mesh axis of that name, else to ``None`` (replicated), the param is sharded so
(Flax's eager sharding), and the resolved rules and the mesh are recorded on it
(``sharding_rules`` / ``mesh`` metadata), so later Variable copies such as
``nnx.Optimizer``'s state shard the same way without a mesh context.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from flax import nnx
from flax.core import spmd as flax_spmd

from jax_grouped_mlp._src import checks
from jax_grouped_mlp._src.op.mlp import grouped_mlp, weight_grads_in_bf16
from jax_grouped_mlp._src.op.prepared import PreparedWeights, prepare_weights
from jax_grouped_mlp._src.op.recipes import Recipe

# He-style fan-in init per expert: the expert axis (0) is a batch axis, the
# reduction axis (1) is fan-in.
default_kernel_init = nnx.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
)
default_kernel_init.__doc__ = """The expert weights' default initializer: ``(key, [E, in, out], dtype)``,
truncated normal with variance 1 / fan-in, where fan-in is ``in`` (axis -2) and the
expert axis 0 is a batch axis (each expert is initialised like its own dense layer)."""

EXPERT_AXIS = "expert"
"""Default logical name of the expert axis (axis 0 of ``w1``/``w2``)."""
EMBED_AXIS = "embed"
"""Default logical name of the hidden (model) axis: ``w1`` axis 1, ``w2`` axis 2, ``router`` axis 0."""
MLP_AXIS = "mlp"
"""Default logical name of the expert FFN axis: ``w1`` axis 2, ``w2`` axis 1."""


@dataclasses.dataclass(frozen=True)
class AxisNames:
    """The logical axis names the Flax modules' params carry as ``out_sharding`` metadata.

    ``w1 [E, H, F]`` gets ``(expert, hidden, ffn)``, ``w2 [E, F, H]``
    ``(expert, ffn, hidden)`` and ``MoEBlock``'s ``router [H, E]`` ``(hidden, None)``
    (the router is used whole by every token, so its expert axis is never split).
    ``None`` for a field: that axis is never sharded.
    """

    expert: str | None = EXPERT_AXIS
    hidden: str | None = EMBED_AXIS
    ffn: str | None = MLP_AXIS

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"AxisNames.{field.name} must be a non-empty str or None, got {field.name}={value!r}")
        names = [n for n in (self.expert, self.hidden, self.ffn) if n is not None]
        if len(set(names)) != len(names):
            raise ValueError(f"AxisNames must be distinct, got {self!r}")


def _context_mesh() -> jax.sharding.Mesh | None:
    """The concrete mesh ``jax.set_mesh`` set, if any (under a trace only the abstract one is known)."""
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:
        return None
    return None if mesh is None or mesh.empty else mesh


def sharded_param(value: jax.Array, names: tuple[str | None, ...], mesh: jax.sharding.Mesh | None) -> nnx.Param:
    """``nnx.Param(value)`` annotated with logical ``names``, placed as the module docstring says."""
    mesh = mesh if mesh is not None else _context_mesh()
    axes_of = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if axes_of.empty:
        # No mesh to shard over: names only. eager_sharding=False, or Flax would
        # demand a mesh here and again for every copy (the optimizer's state).
        return nnx.Param(value, out_sharding=names, eager_sharding=False)
    rules = dict(flax_spmd.get_logical_axis_rules())
    mesh_axes = set(axes_of.axis_names)
    resolved = tuple(
        (n, rules[n] if n in rules else (n if n in mesh_axes else None)) for n in names if n is not None
    )
    metadata: dict[str, Any] = {"out_sharding": names, "sharding_rules": resolved}
    if mesh is not None:
        metadata["mesh"] = mesh
    return nnx.Param(value, **metadata)


def replicated(value: jax.Array, mesh: jax.sharding.Mesh | None) -> jax.Array:
    """``value`` placed whole on every device of ``mesh`` (else of the mesh ``jax.set_mesh``
    set), or left where it is without one: state that is not a param (the router's
    score bias) then starts where a jitted step returns it, so the second step does not
    compile again for its new placement."""
    mesh = mesh if mesh is not None else _context_mesh()
    if mesh is None:
        return value
    return jax.device_put(value, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def initialized(name: str, init: nnx.Initializer, rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> jax.Array:
    """``init(key, shape, dtype)``, or an error naming the initializer when it returns
    another shape or dtype (it would otherwise fail at the first call, blaming ``x``).
    ``rngs`` must be an ``nnx.Rngs`` (``None`` or a bare key would fail inside Flax with
    an ``AttributeError``)."""
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"rngs must be an nnx.Rngs (for example rngs=nnx.Rngs(0)), got rngs={rngs!r}")
    value = init(rngs.params(), shape, dtype)
    if getattr(value, "shape", None) != tuple(shape) or getattr(value, "dtype", None) != jnp.dtype(dtype):
        got = f"{getattr(value, 'shape', type(value).__name__)} {getattr(value, 'dtype', '')}".strip()
        raise ValueError(f"{name} must return an array of shape {tuple(shape)} and dtype {jnp.dtype(dtype)} "
                         f"(it is called as {name}(key, shape, dtype)), got {got}")
    return value


def float_tokens(x, dtype) -> jax.Array:
    """``x`` cast to the module's ``dtype``, if it is a float array (an int, bool or
    complex ``x`` is refused, not cast)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a float array (it is cast to the module's dtype={jnp.dtype(dtype)}), "
                        f"got x.dtype={x.dtype}")
    return x.astype(dtype)


class GroupedMLP(nnx.Module):
    """The squared-ReLU expert MLP of an MoE layer, over tokens already sorted by expert.

    Params: ``w1 [num_experts, hidden, ffn]`` and ``w2 [num_experts, ffn, hidden]``,
    stored in ``param_dtype`` (float32 master weights by default, or bfloat16): the
    op reads them as bf16 (MXFP8 with ``recipe="mxfp8"``) and returns their
    gradients in ``param_dtype``; ``dtype`` is the dtype of the tokens. ``recipe``,
    ``fuse_fc1_epilogue`` and ``weight_grad_dtype`` are :func:`jax_grouped_mlp.grouped_mlp`'s
    (None, the default, or ``float32``: gradients in ``param_dtype``;
    ``jnp.bfloat16`` with float32 params: their gradients rounded to bf16 inside the op,
    half the bytes a training step keeps until its optimizer update).

    Call as ``module(x, group_sizes, probs=None)`` with ``x [M, hidden]`` of a float
    dtype, cast to ``dtype``; the output is in ``dtype``. See
    :func:`jax_grouped_mlp.grouped_mlp`. Use under ``nnx.jit`` and ``nnx.remat``
    with :func:`jax_grouped_mlp.offload_policy` to place the residuals.

    Sharding: ``w1`` carries ``out_sharding=(expert, hidden, ffn)`` and ``w2``
    ``(expert, ffn, hidden)`` in the logical names of ``axis_names``
    (:class:`AxisNames`); ``mesh`` (default: the mesh set by ``jax.set_mesh``, if
    any) is where they are placed at construction (see this module's docstring).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn: int,
        *,
        recipe: str = "mxfp8",
        fuse_fc1_epilogue: bool = True,
        dtype: Any = jnp.bfloat16,
        param_dtype: Any = jnp.float32,
        kernel_init: nnx.Initializer = default_kernel_init,
        axis_names: AxisNames = AxisNames(),
        mesh: jax.sharding.Mesh | None = None,
        weight_grad_dtype: DTypeLike | None = None,
        rngs: nnx.Rngs,
    ):
        num_experts = checks.positive_int("num_experts", num_experts)
        hidden = checks.positive_int("hidden", hidden)
        ffn = checks.positive_int("ffn", ffn)
        self.recipe = Recipe.parse(recipe).value
        self.fuse_fc1_epilogue = checks.boolean("fuse_fc1_epilogue", fuse_fc1_epilogue)
        self.num_experts, self.hidden, self.ffn = num_experts, hidden, ffn
        self.dtype = checks.float_dtype("dtype", dtype)  # grouped_mlp takes bf16 or f32
        self.param_dtype = checks.float_dtype("param_dtype", param_dtype)
        weight_grads_in_bf16(weight_grad_dtype, param_dtype=self.param_dtype)  # (checked here, once)
        self.weight_grad_dtype = None if weight_grad_dtype is None else jnp.dtype(weight_grad_dtype)
        if not isinstance(axis_names, AxisNames):
            raise TypeError(f"axis_names must be an AxisNames, got axis_names={axis_names!r}")
        if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got mesh={type(mesh).__name__}")
        e_, h_, f_ = axis_names.expert, axis_names.hidden, axis_names.ffn
        self.w1 = sharded_param(
            initialized("kernel_init", kernel_init, rngs, (num_experts, hidden, ffn), self.param_dtype),
            (e_, h_, f_), mesh,
        )
        self.w2 = sharded_param(
            initialized("kernel_init", kernel_init, rngs, (num_experts, ffn, hidden), self.param_dtype),
            (e_, f_, h_), mesh,
        )

    def prepare(self) -> PreparedWeights:
        """The weights cast and quantized for this module's recipe, once: pass the result
        as ``prepared`` to every micro-batch's call within one optimizer step
        (:func:`jax_grouped_mlp.prepare_weights`), and make it again after each update.
        The op checks the copies' recipe and shapes, not their values: copies made before
        an update, or from another module, are used without a warning."""
        return prepare_weights(self.w1[...], self.w2[...], recipe=self.recipe)

    def __call__(
        self, x: jax.Array, group_sizes: jax.Array, probs: jax.Array | None = None,
        prepared: PreparedWeights | None = None,
    ) -> jax.Array:
        x = float_tokens(x, self.dtype)
        if x.ndim != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [M, hidden={self.hidden}] (the module's hidden size), got x.shape={x.shape}")
        return grouped_mlp(
            x,
            # Params go in as stored: the op rounds float32 weights to bf16 itself and
            # returns their gradients in float32 (a cast here would round them to bf16).
            self.w1[...],
            self.w2[...],
            group_sizes,
            probs,
            recipe=self.recipe,
            fuse_fc1_epilogue=self.fuse_fc1_epilogue,
            prepared=prepared,
            weight_grad_dtype=self.weight_grad_dtype,
        )
