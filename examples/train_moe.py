"""Train a small MoE model under the offload policy the planner picks, like a real run.

A Flax NNX model of ``--layers`` :class:`jax_grouped_mlp.flax.MoEBlock` layers (a
top-k router, then the squared-ReLU experts as one grouped MLP over the tokens
sorted by expert) learns a synthetic task: map each of ``--vocab`` tokens to a fixed
random target token. Before training, :func:`jax_grouped_mlp.plan_offload` chooses
where each residual lives from the host link bandwidth and the layer time measured
on this device; every block runs under ``nnx.remat`` with that policy, and the
placement in the traced train step is read back and checked against the plan.

Load balancing, ``--balance``:

- ``bias`` (default; DeepSeek-V3, Nemotron-3): a sigmoid router with a selection
  bias (``use_score_bias=True``); after each optimizer step, inside the jitted step,
  every block moves its bias by ``--bias-rate`` against its expert load of that step
  (``MoEBlock.update_score_bias``). No auxiliary loss.
- ``loss`` (Switch / GShard): a softmax router, and ``--aux-coef`` times the
  load-balancing loss of every block added to the loss.

Either way the blocks sow their router statistics; each step logs the task loss,
the load-balancing loss (mean over layers; 1 for a uniform router) and the load
spread, max/mean of the per-expert load of the worst layer (1 when balanced), on
a tqdm bar, with a line every ``--log-every`` steps.

Checkpoints (orbax): with ``--ckpt-dir DIR`` the (model, optimizer) state
(``nnx.state``, the router biases included) and the metrics so far are saved every
``--save-every`` steps and at the last step. A run started on a directory that holds
a checkpoint restores the newest one and resumes from its step (``--no-resume``
refuses instead); ``--steps`` is the total, so a resumed run continues to it. Batches
are a function of (seed, step), so a resumed run follows the trajectory of one that
never stopped. The state is restored into the shapes, dtypes and shardings of a
freshly built model, so the train step compiles once, restored or not: the report
counts its compilations.

    PYTHONPATH=. python examples/train_moe.py                # CPU or GPU
    PYTHONPATH=. python examples/train_moe.py --steps 20 --layer-time 0.01   # quick
    PYTHONPATH=. python examples/train_moe.py --ckpt-dir /tmp/moe --save-every 50 \\
        --plot moe.png                                       # run again to resume

``--plot PATH.png`` draws the loss, the load-balancing loss and load spread, and
each expert's load over the steps (needs matplotlib). Ends with a report: first and
last loss, median step time, compilations of the train step, peak memory.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

import jax_grouped_mlp as jgm
from jax_grouped_mlp.flax import MoEBlock

# What the history (saved with each checkpoint, returned in the report) keeps per step.
HISTORY_KEYS = ("loss", "aux_loss", "lb_loss", "load_spread", "expert_load")


class Model(nnx.Module):
    def __init__(self, vocab, hidden, ffn, num_experts, top_k, layers, *, balance, aux_coef, recipe, policy,
                 fuse_fc1_epilogue, rngs):  # fmt: skip
        self.embed = nnx.Embed(vocab, hidden, rngs=rngs)
        self.norms = nnx.List([nnx.RMSNorm(hidden, rngs=rngs) for _ in range(layers)])
        routing = jgm.RoutingConfig(top_k=top_k, score_function="sigmoid" if balance == "bias" else "softmax")
        self.blocks = nnx.List([
            MoEBlock(num_experts, hidden, ffn, routing=routing, recipe=recipe, fuse_fc1_epilogue=fuse_fc1_epilogue,
                     use_score_bias=balance == "bias", sow_stats=True,
                     load_balancing_coef=aux_coef if balance == "loss" else 0.0, rngs=rngs)
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


def _loss(model: Model, tokens, targets) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Task loss plus the blocks' ``aux_loss``; the metrics of the step as aux."""
    # nnx.capture collects what the blocks sow (inside nnx.remat too) without storing
    # it on the model, so the state the step returns has the structure it was given.
    logits, inter = nnx.capture(model, nnx.Intermediate)(tokens)
    task = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    layers = [inter["blocks"][i] for i in range(len(model.blocks))]
    stats = [layer["router_stats"].get_value() for layer in layers]
    aux = sum(layer["aux_loss"].get_value() for layer in layers)
    metrics = {
        "loss": task,
        "aux_loss": aux,
        "lb_loss": jnp.mean(jnp.stack([s.load_balancing_loss for s in stats])),
        "expert_load": jnp.stack([s.expert_load for s in stats]),  # [layers, experts]
    }
    return task + aux, metrics


def make_train_step(graphdef, bias_rate: float | None):
    """The jitted step over the (model, optimizer) state. It returns a state of the
    structure, shardings and dtypes it takes, so it compiles once for the whole run."""

    def train_step(state, tokens, targets):
        model, optimizer = nnx.merge(graphdef, state)
        (_, metrics), grads = nnx.value_and_grad(_loss, has_aux=True)(model, tokens, targets)
        optimizer.update(model, grads)
        if bias_rate is not None:  # aux-loss-free balancing, from this step's load
            for block, load in zip(model.blocks, metrics["expert_load"]):
                block.update_score_bias(load, bias_rate)
        return metrics, nnx.state((model, optimizer))

    return jax.jit(train_step, donate_argnums=0)


class CompileCounter:
    """Counts XLA compilations of the functions named ``name`` (jax.monitoring)."""

    def __init__(self, name: str):
        self.name, self.count = name, 0

    def _on_event(self, event: str, duration: float, **kwargs: Any) -> None:
        # jit names its programs "jit(<function name>)".
        if event == "/jax/core/compile/backend_compile_duration" and kwargs.get("fun_name") == f"jit({self.name})":
            self.count += 1

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_event)


def load_spread(expert_load: np.ndarray) -> float:
    """max/mean of the per-expert load of the worst layer: 1 when balanced."""
    load = np.asarray(expert_load, np.float64)
    return float(np.max(load.max(axis=-1) / load.mean(axis=-1)))


def checkpoint_manager(path: str, save_every: int) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=save_every, create=True)
    return ocp.CheckpointManager(os.path.abspath(path), options=options, item_names=("state", "history"))


def restore(manager: ocp.CheckpointManager, step: int, state) -> tuple[Any, dict]:
    """The state and history saved at ``step``, the state placed as ``state`` is."""
    # Restored into the abstract form of the fresh state (shape, dtype, sharding of
    # each leaf), so the restored arrays are placed like the ones the step returns:
    # no second compilation.
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    restored = manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), history=ocp.args.JsonRestore())
    )
    return restored["state"], dict(restored["history"])


def plot(history: dict, path: str) -> bool:
    """Loss, load-balancing loss and load spread, and each expert's load over steps."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f"--plot: matplotlib is not installed, not writing {path} (pip install matplotlib)")
        return False
    steps = np.arange(1, len(history["loss"]) + 1)
    load = np.asarray(history["expert_load"], np.float64)  # [steps, layers, experts]
    share = load / load.mean(axis=-1, keepdims=True)
    layers, experts = load.shape[1:]
    fig = Figure(figsize=(8, 8), layout="constrained")
    ax_loss, ax_bal, ax_load = fig.subplots(3, 1, sharex=True, height_ratios=[1, 1, 1.4])
    ax_loss.plot(steps, history["loss"], label="task loss")
    if np.any(history["aux_loss"]):
        ax_loss.plot(steps, np.add(history["loss"], history["aux_loss"]), label="loss + aux loss")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_bal.plot(steps, history["lb_loss"], label="load-balancing loss (mean over layers)")
    ax_bal.plot(steps, history["load_spread"], label="max/mean expert load (worst layer)")
    ax_bal.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax_bal.set_ylabel("1 = balanced")
    ax_bal.legend()
    rows = share.reshape(len(steps), layers * experts).T  # one row per (layer, expert)
    image = ax_load.imshow(rows, aspect="auto", interpolation="nearest", cmap="RdBu_r", vmin=0.0, vmax=2.0,
                           extent=(0.5, len(steps) + 0.5, layers * experts - 0.5, -0.5))  # fmt: skip
    ax_load.set_yticks(np.arange(layers) * experts + (experts - 1) / 2, [f"layer {i}" for i in range(layers)])
    for i in range(1, layers):
        ax_load.axhline(i * experts - 0.5, color="black", lw=0.8)
    ax_load.set_ylabel(f"expert (rows: {experts} per layer)")
    ax_load.set_xlabel("step")
    fig.colorbar(image, ax=ax_load, label="expert load / mean")
    fig.savefig(path, dpi=100)
    return True


def peak_memory(step_fn, *args) -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return {"device_peak_bytes": stats["peak_bytes_in_use"]}
    # No allocator stats (CPU): XLA's buffer assignment of the train step instead.
    mem = step_fn.lower(*args).compile().memory_analysis()
    total = sum(
        getattr(mem, f, 0) or 0
        for f in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
    )
    return {"step_buffer_bytes": int(total), "process_max_rss_bytes": _max_rss()}


def _max_rss() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb if sys.platform == "darwin" else kb * 1024


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a small MoE under the planned offload policy.")
    p.add_argument("--steps", type=int, default=300, help="total steps (a resumed run continues to it)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per batch")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--recipe", default="mxfp8", choices=["mxfp8", "bf16", "fp8_block"])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--balance", default="bias", choices=["bias", "loss"],
                   help="bias: sigmoid router, aux-loss-free bias update; loss: softmax router, aux loss")
    p.add_argument("--bias-rate", type=float, default=1e-3, help="score-bias step per train step (--balance bias)")
    p.add_argument("--aux-coef", type=float, default=1e-2, help="load-balancing loss weight (--balance loss)")
    p.add_argument("--budget-mb", type=float, default=None,
                   help="device memory for residuals (default: half of keeping all)")
    p.add_argument("--layer-time", type=float, default=None,
                   help="seconds per layer fwd+bwd (default: measured on this device)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None, help="orbax checkpoint directory (resumed from if it has one)")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (and at the last)")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="resume from the newest checkpoint in --ckpt-dir (default); --no-resume refuses one")
    p.add_argument("--log-every", type=int, default=None, help="print a metrics line every N steps (default steps/10)")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="plot loss and expert load over the steps")
    args = p.parse_args(argv)  # fmt: skip
    for name in ("steps", "save_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k must be in [1, --experts={args.experts}], got {args.top_k}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    manager = checkpoint_manager(args.ckpt_dir, args.save_every) if args.ckpt_dir else None
    latest = manager.latest_step() if manager is not None else None
    if latest is not None and not args.resume:
        raise SystemExit(f"--no-resume: {args.ckpt_dir} holds a checkpoint of step {latest}; "
                         "resume from it or give an empty --ckpt-dir")  # fmt: skip

    # 1. Plan. The grouped MLP sees tokens * top_k rows per layer. The layers are MoE
    # blocks: each keeps its input anyway (the router's gradient reads it), and its
    # fc1_input is the permuted tokens, not that input.
    shape = dict(tokens=args.tokens * args.top_k, hidden=args.hidden, ffn=args.ffn,
                 num_experts=args.experts)  # fmt: skip
    block = dict(recipe=args.recipe, layer="moe_block")
    if args.budget_mb is not None:
        budget = args.budget_mb * 1e6
    else:  # half of what keeping everything would take
        keep_all = jgm.plan_offload(**shape, **block, num_layers=args.layers, budget_bytes=float("inf"),
                                    host_bandwidth=1.0, layer_time=1.0)  # fmt: skip
        budget = keep_all.chosen.device_bytes / 2
    platform = jax.devices()[0].platform
    print(f"planning on {jax.devices()[0].device_kind} ({platform})...", flush=True)
    plan = jgm.plan_offload(
        **shape, **block, num_layers=args.layers, budget_bytes=budget,
        host_bandwidth=jgm.measure_host_bandwidth(1 << 30 if platform == "gpu" else 1 << 22, repeats=3),
        layer_time=args.layer_time if args.layer_time is not None
        else jgm.measure_layer_time(**shape, recipe=args.recipe, repeats=3),
        overlap=1.0 if platform == "gpu" else 0.0,
    )  # fmt: skip
    print(plan.table(top=8), flush=True)

    # 2. Model, data, optimizer.
    model = Model(args.vocab, args.hidden, args.ffn, args.experts, args.top_k, args.layers,
                  balance=args.balance, aux_coef=args.aux_coef, recipe=args.recipe, policy=plan.policy,
                  fuse_fc1_epilogue=plan.fuse_fc1_epilogue, rngs=nnx.Rngs(args.seed))  # fmt: skip
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param)
    mapping = np.random.default_rng(args.seed).permutation(args.vocab)  # the task: token -> mapping[token]

    def batch(step: int):
        # A function of (seed, step): a resumed run sees the batches of an unbroken one.
        tokens = np.random.default_rng([args.seed, step]).integers(0, args.vocab, args.tokens).astype(np.int32)
        return jax.device_put((tokens, mapping[tokens].astype(np.int32)))

    # 3. Check the traced step places the residuals as planned.
    tokens, targets = batch(0)
    graphdef, state = nnx.split(model)

    def loss_of(state):
        return _loss(nnx.merge(graphdef, state), tokens, targets)[0]

    placed = jgm.residual_placements(jax.grad(loss_of), state)
    placed = {n: placed.get(n, "recompute") for n in jgm.RESIDUAL_NAMES}
    print(f"residuals in the traced step: {placed}", flush=True)
    if placed != plan.placement:
        raise RuntimeError(f"placement {placed} differs from the plan {plan.placement}")

    # 4. Restore the newest checkpoint, if any.
    graphdef, state = nnx.split((model, optimizer))
    history: dict[str, list] = {key: [] for key in HISTORY_KEYS}
    start = 0
    if latest is not None:
        start = latest
        state, history = restore(manager, start, state)
        print(f"resumed from the checkpoint of step {start} in {args.ckpt_dir}", flush=True)

    # 5. Train.
    step_fn = make_train_step(graphdef, args.bias_rate if args.balance == "bias" else None)
    log_every = args.log_every or max(1, args.steps // 10)
    times = []
    with CompileCounter("train_step") as compiles, tqdm(total=args.steps, initial=start, desc="train",
                                                        unit="step", file=sys.stderr) as bar:  # fmt: skip
        for step in range(start + 1, args.steps + 1):
            tokens, targets = batch(step)
            t0 = time.perf_counter()
            metrics, state = step_fn(state, tokens, targets)
            metrics = jax.device_get(metrics)  # waits for the step
            times.append(time.perf_counter() - t0)
            for key in ("loss", "aux_loss", "lb_loss"):
                history[key].append(float(metrics[key]))
            history["expert_load"].append(metrics["expert_load"].tolist())
            history["load_spread"].append(load_spread(metrics["expert_load"]))
            bar.set_postfix({"loss": f"{history['loss'][-1]:.4f}", "aux": f"{history['aux_loss'][-1]:.3g}",
                             "lb": f"{history['lb_loss'][-1]:.3f}", "spread": f"{history['load_spread'][-1]:.2f}",
                             "ms": f"{1e3 * times[-1]:.1f}"}, refresh=False)  # fmt: skip
            bar.update()
            if step % log_every == 0 or step == args.steps:
                bar.write(f"step {step:>6}  loss {history['loss'][-1]:.4f}  aux {history['aux_loss'][-1]:.4g}  "
                          f"lb loss {history['lb_loss'][-1]:.4f}  load max/mean {history['load_spread'][-1]:.2f}  "
                          f"{1e3 * times[-1]:.1f} ms", file=sys.stdout)  # fmt: skip
            if manager is not None:
                # save() copies the arrays to host before it returns (the writing is
                # asynchronous), so the next step may donate them. The history is copied
                # here: the asynchronous write would otherwise see the next steps'
                # entries appended to the same lists (a checkpoint of step 3 holding step
                # 4's loss; seen once in CI).
                saved = {key: list(values) for key, values in history.items()}
                manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                           history=ocp.args.JsonSave(saved)),
                             force=step == args.steps)  # fmt: skip
    if manager is not None:
        manager.wait_until_finished()
        manager.close()

    nnx.update((model, optimizer), state)
    # The first step includes the compilation.
    step_time = statistics.median(times[1:] or times) if times else float("nan")
    memory = peak_memory(step_fn, state, *batch(0))
    losses = history["loss"]
    tail = max(1, min(10, len(losses) // 4))
    report = {
        "placement": dict(plan.placement),
        "start_step": start,
        "first_loss": losses[0] if losses else float("nan"),
        "final_loss": float(np.mean(losses[-tail:])) if losses else float("nan"),
        "step_time_s": step_time,
        "train_step_compiles": compiles.count,
        "predicted_residual_bytes": plan.chosen.device_bytes,
        **memory,
        # Per step from step 1 (restored ones included): task loss, the blocks' summed
        # aux loss, mean load-balancing loss, load spread, expert load [layers][experts].
        "losses": losses,
        **{key: history[key] for key in HISTORY_KEYS if key != "loss"},
        "model": model,
    }
    print(f"\n{'placement':<24}{'/'.join(plan.placement[n] for n in jgm.RESIDUAL_NAMES)} (fc1/act/fc2)")
    print(f"{'loss':<24}{report['first_loss']:.4f} -> {report['final_loss']:.4f} "
          f"(mean of last {tail} steps; ln(vocab) = {np.log(args.vocab):.4f})")  # fmt: skip
    if losses:
        print(f"{'load max/mean':<24}{history['load_spread'][0]:.2f} -> {history['load_spread'][-1]:.2f} "
              f"(worst layer; lb loss {history['lb_loss'][0]:.3f} -> {history['lb_loss'][-1]:.3f})")  # fmt: skip
    print(f"{'step time':<24}{step_time * 1e3:.2f} ms (median)")
    print(f"{'train step compiles':<24}{compiles.count} (steps {start + 1}-{args.steps})")
    for key, value in memory.items():
        print(f"{key.removesuffix('_bytes').replace('_', ' '):<24}{value / 1e6:.1f} MB")
    print(f"{'residuals on device':<24}{plan.chosen.device_bytes / 1e6:.3f} MB (predicted)")
    if args.plot and losses and plot(history, args.plot):
        print(f"{'plot':<24}{args.plot}")
    return report


if __name__ == "__main__":
    main()
