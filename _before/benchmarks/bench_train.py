"""A model-level training step: a decoder stack of Nemotron-3-Nano MoE layers, as users train it.

    PYTHONPATH=. python3 benchmarks/bench_train.py [--layers 4] [--tokens 8192] [--out FILE] [--plot]
    PYTHONPATH=. python3 benchmarks/bench_train.py --small        # CPU smoke test

The model (Flax NNX): token embedding -> ``--layers`` x (RMSNorm -> MoE layer ->
residual add) -> RMSNorm -> vocabulary head, cross-entropy loss, optax AdamW over
float32 master parameters. Each MoE layer is Nemotron-3-Nano's (H 2688, expert FFN
1856, 128 experts, sigmoid top-6 router with a selection score bias and routed
scaling 2.5), so the expert group sizes come from the router (unequal, as in
training), not from a generator.

Candidates, one process, same shapes, initialisers and batch:
  * ``jgm_mxfp8_offload`` / ``jgm_bf16_offload``: ``jax_grouped_mlp.flax.MoEBlock``
    under ``nnx.remat`` with the default ``offload_policy()`` (every residual to pinned
    host memory);
  * ``jgm_mxfp8_device`` / ``jgm_bf16_device``: the same block, every residual on
    the device;
  * ``jgm_mxfp8_device_bf16grad`` / ``jgm_bf16_device_bf16grad``: the all-device block
    with ``weight_grad_dtype=jnp.bfloat16`` (the experts' gradients rounded to bf16
    inside the op, as the peers' bf16 ``ragged_dot`` gives them; no float32 gradient
    buffer: XLA fuses the cast into the AdamW update);
  * ``jgm_bf16_device_bf16grad_copies``: the same, reading bf16 copies of the float32
    expert weights that persist across steps and are rewritten after each optimizer
    update (``MoEWithCopies``: a pattern measured here, not a library API), so the step
    reads no float32 weight only to cast it;
  * ``jgm_mxfp8_remat_device`` / ``jgm_bf16_remat_device``: the same under ``nnx.remat``
    with every residual of the op on the device: what the layer's checkpoint costs and
    saves (the router, norm, permutation and the float32 masters' bf16 casts are then
    recomputed in the backward pass);
  * ``tokamax_bf16`` (when tokamax imports) and ``ragged_dot_bf16``: the same model
    whose experts are a bf16 squared-ReLU MLP of ``tokamax.ragged_dot`` /
    ``jax.lax.ragged_dot`` over the same routing (the library's route and sort).
Reports the training step time (median), the compiled program's device memory
(arguments + outputs + temp, less donated aliases: the step's peak as XLA plans it)
and writes JSON (a PNG with --plot).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_grouped_mlp as jgm
from jax_grouped_mlp._src.moe import routing as routing_lib
from jax_grouped_mlp.flax import MoEBlock, RouterBias, default_kernel_init

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import RESULTS, bar_plot, gemm_report, require_kernels, time_call, write_report  # noqa: E402

NANO = {"hidden": 2688, "ffn": 1856, "experts": 128, "top_k": 6, "vocab": 4096}
SMALL = {"hidden": 64, "ffn": 32, "experts": 8, "top_k": 2, "vocab": 128}


def _routing(shape: dict) -> jgm.RoutingConfig:
    return jgm.RoutingConfig(top_k=shape["top_k"], score_function="sigmoid", routed_scaling_factor=2.5)


def _srelu_mlp(matmul: Callable) -> Callable:
    def mlp(x, w1, w2, gs, probs):
        h = matmul(x, w1.astype(jnp.bfloat16), gs)
        r = jnp.maximum(h.astype(jnp.float32), 0)
        return matmul((probs[:, None] * r * r).astype(jnp.bfloat16), w2.astype(jnp.bfloat16), gs)

    return mlp


def _peer_matmuls() -> dict[str, Callable]:
    out = {"ragged_dot_bf16": lambda a, b, gs: jax.lax.ragged_dot(
        a, b, gs, preferred_element_type=jnp.float32).astype(jnp.bfloat16)}
    try:  # optional peer
        import tokamax

        out["tokamax_bf16"] = lambda a, b, gs: tokamax.ragged_dot(a, b, gs)
    except ImportError:
        pass
    return out


class PeerMoE(nnx.Module):
    """The MoE layer with the experts computed by another grouped matmul (same routing)."""

    def __init__(self, shape: dict, matmul: Callable, *, rngs: nnx.Rngs):
        e, h, f = shape["experts"], shape["hidden"], shape["ffn"]
        self.routing = _routing(shape)
        self.mlp = _srelu_mlp(matmul)
        self.router = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (h, e), jnp.float32))
        self.score_bias = RouterBias(jnp.zeros((e,), jnp.float32))
        init = default_kernel_init
        self.w1 = nnx.Param(init(rngs.params(), (e, h, f), jnp.float32))
        self.w2 = nnx.Param(init(rngs.params(), (e, f, h), jnp.float32))

    def __call__(self, x):
        t, k, e = x.shape[0], self.routing.top_k, self.w1.shape[0]
        x = x.astype(jnp.bfloat16)
        logits = jnp.dot(x.astype(jnp.float32), self.router[...], precision=jax.lax.Precision.HIGHEST)
        ids, weights = routing_lib.route(logits, self.routing, jax.lax.stop_gradient(self.score_bias[...]))
        perm = routing_lib.sort_by_expert(ids.reshape(-1), e)
        ys = self.mlp(x[perm.order // k], self.w1[...], self.w2[...], perm.group_sizes,
                      weights.reshape(-1)[perm.order])
        y = ys[perm.inverse].reshape(t, k, -1)
        return jnp.sum(y.astype(jnp.float32), axis=1).astype(x.dtype)


class WeightCopies(nnx.Variable):
    """bf16 copies of float32 expert weights, kept across steps (not trained)."""


class MoEWithCopies(nnx.Module):
    """A ``MoEBlock`` that reads bf16 copies of its float32 expert weights which persist
    across steps, passed as ``prepared``. :meth:`refresh` rewrites them from the weights
    after each optimizer update (the training step calls it), where XLA can fuse the cast
    into the update, which writes the new weights anyway: the step then reads no float32
    weight only to cast it (2 x 2.55 GB a Nano layer). A pattern measured by this
    benchmark, not a library API: a step that skips the refresh, or weights restored
    from a checkpoint without one, trains on stale copies, silently; and the copies are
    part of the module's state (saved with it unless filtered out)."""

    def __init__(self, block: MoEBlock):
        self.block = block
        self.w1_copy = WeightCopies(block.experts.w1[...].astype(jnp.bfloat16))
        self.w2_copy = WeightCopies(block.experts.w2[...].astype(jnp.bfloat16))

    def __call__(self, x):
        prepared = jgm.prepare_weights(self.w1_copy[...], self.w2_copy[...], recipe=self.block.recipe)
        return self.block(x, prepared=prepared)

    def refresh(self) -> None:
        self.w1_copy[...] = self.block.experts.w1[...].astype(jnp.bfloat16)
        self.w2_copy[...] = self.block.experts.w2[...].astype(jnp.bfloat16)


class Decoder(nnx.Module):
    def __init__(self, shape: dict, layers: int, make_moe: Callable, policy, *, rngs: nnx.Rngs):
        h = shape["hidden"]
        self.embed = nnx.Embed(shape["vocab"], h, rngs=rngs)
        self.norms = nnx.List([nnx.RMSNorm(h, rngs=rngs) for _ in range(layers)])
        self.moes = nnx.List([make_moe(rngs) for _ in range(layers)])
        self.out_norm = nnx.RMSNorm(h, rngs=rngs)
        self.head = nnx.Linear(h, shape["vocab"], rngs=rngs)
        self.policy = policy

    def __call__(self, tokens):
        x = self.embed(tokens)
        for norm, moe in zip(self.norms, self.moes):
            layer = lambda m, n, v: m(n(v))  # noqa: E731
            if self.policy is not None:
                layer = nnx.remat(layer, policy=self.policy)
            x = x + layer(moe, norm, x).astype(x.dtype)
        return self.head(self.out_norm(x))


def _candidates(shape: dict) -> dict[str, tuple[Callable, object]]:
    def ours(recipe, **kw):
        return lambda rngs: MoEBlock(shape["experts"], shape["hidden"], shape["ffn"], routing=_routing(shape),
                                     use_score_bias=True, recipe=recipe, rngs=rngs, **kw)

    c: dict[str, tuple[Callable, object]] = {}
    on_device = jgm.offload_policy(fc1_input="device", activation_input="device", fc2_input="device")
    for recipe in ("mxfp8", "bf16"):
        c[f"jgm_{recipe}_offload"] = (ours(recipe), jgm.offload_policy())
        c[f"jgm_{recipe}_device"] = (ours(recipe), None)
        # nnx.remat with the op's residuals on the device: everything else of the layer
        # (router, norm, the masters' bf16 casts) is recomputed in the backward pass.
        c[f"jgm_{recipe}_remat_device"] = (ours(recipe), on_device)
        # The experts' float32 gradients rounded to bf16 inside the op (as the peers'
        # bf16 ragged_dot gives them): XLA fuses their cast back into the AdamW update.
        c[f"jgm_{recipe}_device_bf16grad"] = (ours(recipe, weight_grad_dtype=jnp.bfloat16), None)
    c["jgm_bf16_device_bf16grad_copies"] = (
        lambda rngs: MoEWithCopies(ours("bf16", weight_grad_dtype=jnp.bfloat16)(rngs)), None)
    for name, matmul in _peer_matmuls().items():
        c[name] = ((lambda mm: lambda rngs: PeerMoE(shape, mm, rngs=rngs))(matmul), None)
    return c


def train_step_fn(graphdef) -> Callable:
    """The training step over ``nnx.split((model, optimizer))``'s state: the mean
    next-token cross-entropy, its gradient and the optimizer's update; returns
    ``(loss, new state)``."""

    def train_step(state, inputs, targets):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits = model(inputs).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        for moe in model.moes:  # (MoEWithCopies: its bf16 copies follow the new weights)
            if isinstance(moe, MoEWithCopies):
                moe.refresh()
        return loss, nnx.state((model, optimizer))

    return train_step


def bench(name: str, make_moe, policy, shape: dict, layers: int, tokens: int, iters: int) -> dict:
    model = Decoder(shape, layers, make_moe, policy, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(0, shape["vocab"], (tokens + 1,)), jnp.int32)
    inputs, targets = batch[:-1], batch[1:]

    step = jax.jit(train_step_fn(graphdef), donate_argnums=0)
    try:
        compiled = step.lower(state, inputs, targets).compile()
    except Exception as err:  # noqa: BLE001 - out of memory is a result too
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    mem = compiled.memory_analysis()
    peak = None
    if mem is not None:
        peak = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                   - mem.alias_size_in_bytes)
    losses = []
    holder = {"state": state}

    def run():
        loss, holder["state"] = compiled(holder["state"], inputs, targets)
        losses.append(loss)
        return loss

    try:
        sec = time_call(run, iters=iters, warmup=2, samples=3)
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}", "device_bytes": peak}
    first, last = float(losses[0]), float(losses[-1])
    return {"ms": sec * 1e3, "device_bytes": peak,
            "temp_bytes": None if mem is None else int(mem.temp_size_in_bytes),
            "loss_first": first, "loss_last": last}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated candidate names (default: all)")
    ap.add_argument("--small", action="store_true", help="tiny shape (CPU smoke test)")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "train_step.json")
    ap.add_argument("--plot", action="store_true")
    args = ap.parse_args(argv)
    require_kernels()  # (no timing of the pure-JAX fallback under our name)
    shape = SMALL if args.small else NANO
    report = gemm_report("training step of a decoder stack of MoE layers (AdamW, float32 master params)",
                         "benchmarks/bench_train.py", argv)
    report.update(shape=shape, layers=args.layers, tokens=args.tokens, results={})
    only = {c for c in args.only.split(",") if c}
    for name, (make_moe, policy) in _candidates(shape).items():
        if only and name not in only:
            continue
        report["results"][name] = bench(name, make_moe, policy, shape, args.layers, args.tokens, args.iters)
        print(name, report["results"][name], flush=True)
    write_report({k: v for k, v in report.items() if k != "shapes"}, args.out, data_key="results")
    base = report["results"].get("tokamax_bf16", {}).get("ms")
    print(f"\n{'candidate':24s} {'ms/step':>9s} {'device GiB':>11s} {'vs tokamax':>10s}")
    for name, e in report["results"].items():
        if "ms" not in e:
            print(f"{name:24s} {e['error'][:60]}")
            continue
        gib = e["device_bytes"] / 2**30 if e["device_bytes"] else float("nan")
        ratio = f"{base / e['ms']:9.2f}x" if base else ""
        print(f"{name:24s} {e['ms']:9.2f} {gib:11.2f} {ratio:>10s}")
    if args.plot:
        shapes = {"step ms": {n: {"v": e["ms"]} for n, e in report["results"].items() if "ms" in e},
                  "device GiB": {n: {"v": e["device_bytes"] / 2**30} for n, e in report["results"].items()
                                 if e.get("device_bytes")}}
        bar_plot(shapes, "v", "ms / GiB", f"{args.layers}-layer MoE training step, {jax.devices()[0].device_kind}",
                 args.out.with_suffix(".png"))


if __name__ == "__main__":
    main(sys.argv[1:])
