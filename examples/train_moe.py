"""Train a small MoE model under the offload policy the planner picks.

A Flax NNX model of ``--layers`` :class:`jax_grouped_mlp.flax.MoEBlock` layers (a
top-k softmax router, then the squared-ReLU experts as one grouped MLP over the
tokens sorted by expert) learns a synthetic task: map each of ``--vocab`` tokens to a fixed
random target token. Before training, :func:`jax_grouped_mlp.plan_offload` chooses
where each residual lives from the host link bandwidth and the layer time measured
on this device; every block runs under ``nnx.remat`` with that policy, and the
placement in the traced train step is read back and checked against the plan.

    PYTHONPATH=. python examples/train_moe.py                # CPU or GPU
    PYTHONPATH=. python examples/train_moe.py --steps 20 --layer-time 0.01   # quick

Ends with a report: first and last loss, median step time, peak memory.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx

import jax_grouped_mlp as jgm
from jax_grouped_mlp.flax import MoEBlock


class Model(nnx.Module):
    def __init__(self, vocab, hidden, ffn, num_experts, top_k, layers, *, recipe, policy, fuse_fc1_epilogue, rngs):
        self.embed = nnx.Embed(vocab, hidden, rngs=rngs)
        self.norms = nnx.List([nnx.RMSNorm(hidden, rngs=rngs) for _ in range(layers)])
        routing = jgm.RoutingConfig(top_k=top_k)
        self.blocks = nnx.List([
            MoEBlock(num_experts, hidden, ffn, routing=routing, recipe=recipe,
                     fuse_fc1_epilogue=fuse_fc1_epilogue, rngs=rngs)
            for _ in range(layers)
        ])  # fmt: skip
        self.out_norm = nnx.RMSNorm(hidden, rngs=rngs)
        self.head = nnx.Linear(hidden, vocab, rngs=rngs)
        self.policy = policy

    def __call__(self, tokens):
        x = self.embed(tokens)
        for norm, block in zip(self.norms, self.blocks):
            # One checkpoint per layer: the plan's residuals are kept, offloaded or
            # recomputed per layer; the layer input x is the only other thing saved.
            x = x + nnx.remat(lambda b, n, h: b(n(h)), policy=self.policy)(block, norm, x)
        return self.head(self.out_norm(x))


def _loss(model, tokens, targets):
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def compile_train_step(graphdef, state, tokens, targets):
    """The jitted step over the (model, optimizer) state, compiled once up front (it
    takes the state it returns, whatever the offload policy: no second compilation)."""

    def train_step(state, tokens, targets):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(_loss)(model, tokens, targets)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    return jax.jit(train_step, donate_argnums=0).lower(state, tokens, targets).compile()


def progress(step: int, total: int, loss: float, step_ms: float, width: int = 30) -> None:
    done = width * step // total
    bar = "#" * done + "." * (width - done)
    end = "\n" if step == total else ""
    sys.stderr.write(f"\r[{bar}] {step}/{total}  loss {loss:.4f}  {step_ms:.1f} ms/step{end}")
    sys.stderr.flush()


def peak_memory(compiled) -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return {"device_peak_bytes": stats["peak_bytes_in_use"]}
    # No allocator stats (CPU): XLA's buffer assignment of the train step instead.
    mem = compiled.memory_analysis()
    total = sum(
        getattr(mem, f, 0) or 0
        for f in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
    )
    return {"step_buffer_bytes": int(total), "process_max_rss_bytes": _max_rss()}


def _max_rss() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb if sys.platform == "darwin" else kb * 1024


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="Train a small MoE under the planned offload policy.")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--tokens", type=int, default=256, help="tokens per batch")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--recipe", default="mxfp8", choices=["mxfp8", "bf16"])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--budget-mb", type=float, default=None,
                   help="device memory for residuals (default: half of keeping all)")
    p.add_argument("--layer-time", type=float, default=None,
                   help="seconds per layer fwd+bwd (default: measured on this device)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    # 1. Plan. The grouped MLP sees tokens * top_k rows per layer.
    shape = dict(tokens=args.tokens * args.top_k, hidden=args.hidden, ffn=args.ffn,
                 num_experts=args.experts)  # fmt: skip
    if args.budget_mb is not None:
        budget = args.budget_mb * 1e6
    else:  # half of what keeping everything would take
        keep_all = jgm.plan_offload(**shape, num_layers=args.layers, budget_bytes=float("inf"),
                                    host_bandwidth=1.0, layer_time=1.0, recipe=args.recipe)  # fmt: skip
        budget = keep_all.chosen.device_bytes / 2
    platform = jax.devices()[0].platform
    print(f"planning on {jax.devices()[0].device_kind} ({platform})...", flush=True)
    plan = jgm.plan_offload(
        **shape, num_layers=args.layers, budget_bytes=budget, recipe=args.recipe,
        host_bandwidth=jgm.measure_host_bandwidth(1 << 22, repeats=3),
        layer_time=args.layer_time if args.layer_time is not None
        else jgm.measure_layer_time(**shape, recipe=args.recipe, repeats=3),
        overlap=1.0 if platform == "gpu" else 0.0,
    )  # fmt: skip
    print(plan.table(top=8), flush=True)

    # 2. Model, data, optimizer.
    rngs = nnx.Rngs(args.seed)
    model = Model(args.vocab, args.hidden, args.ffn, args.experts, args.top_k, args.layers,
                  recipe=args.recipe, policy=plan.policy, fuse_fc1_epilogue=plan.fuse_fc1_epilogue,
                  rngs=rngs)  # fmt: skip
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param)
    data = np.random.default_rng(args.seed)
    mapping = data.permutation(args.vocab)  # the task: token -> mapping[token]

    def batch():
        tokens = data.integers(0, args.vocab, args.tokens).astype(np.int32)
        return jax.device_put((tokens, mapping[tokens].astype(np.int32)))

    # 3. Check the traced step places the residuals as planned.
    tokens, targets = batch()
    graphdef, state = nnx.split(model)

    def loss_of(state):
        return _loss(nnx.merge(graphdef, state), tokens, targets)

    placed = jgm.residual_placements(jax.grad(loss_of), state)
    placed = {n: placed.get(n, "recompute") for n in jgm.RESIDUAL_NAMES}
    print(f"residuals in the traced step: {placed}", flush=True)
    if placed != plan.placement:
        raise RuntimeError(f"placement {placed} differs from the plan {plan.placement}")

    # 4. Train.
    t0 = time.perf_counter()
    graphdef, state = nnx.split((model, optimizer))
    step_fn = compile_train_step(graphdef, state, tokens, targets)
    print(f"compiled the train step in {time.perf_counter() - t0:.1f} s", flush=True)
    losses, times = [], []
    for step in range(1, args.steps + 1):
        tokens, targets = batch()
        t0 = time.perf_counter()
        loss, state = step_fn(state, tokens, targets)
        loss = float(loss)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if step == args.steps or step % max(1, args.steps // 50) == 0:
            progress(step, args.steps, loss, 1e3 * statistics.median(times))

    nnx.update((model, optimizer), state)
    step_time = statistics.median(times)
    memory = peak_memory(step_fn)
    tail = max(1, min(10, len(losses) // 4))
    report = {
        "placement": dict(plan.placement),
        "first_loss": losses[0],
        "final_loss": float(np.mean(losses[-tail:])),
        "step_time_s": step_time,
        "predicted_residual_bytes": plan.chosen.device_bytes,
        **memory,
        "losses": losses,
    }
    print(f"\n{'placement':<24}{'/'.join(plan.placement[n] for n in jgm.RESIDUAL_NAMES)} (fc1/act/fc2)")
    print(f"{'loss':<24}{report['first_loss']:.4f} -> {report['final_loss']:.4f} "
          f"(mean of last {tail} steps; ln(vocab) = {np.log(args.vocab):.4f})")  # fmt: skip
    print(f"{'step time':<24}{step_time * 1e3:.2f} ms (median)")
    for key, value in memory.items():
        print(f"{key.removesuffix('_bytes').replace('_', ' '):<24}{value / 1e6:.1f} MB")
    print(f"{'residuals on device':<24}{plan.chosen.device_bytes / 1e6:.3f} MB (predicted)")
    return report


if __name__ == "__main__":
    main()
