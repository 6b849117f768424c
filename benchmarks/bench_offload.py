"""Residual offload, measured: device and host memory, step time and proof of placement per policy.

A stack of grouped-MLP layers, each ``x + jax.checkpoint(grouped_mlp,
policy=offload_policy(...))(x, w1, w2, sizes, probs)``, full forward + backward
(``jax.value_and_grad`` of a scalar loss over every layer's weights and x) under
``jax.jit``, in two layouts (``--layout loop|scan|both``): ``loop``, a Python loop
over separate per-layer weights; ``scan``, ``jax.lax.scan`` over stacked weights
``(L, G, H, F)`` with the checkpoint inside the scanned body. Each layout runs at
each of ``--layers`` (``4,8``: a comma list) and for these policies
(fc1_input / activation_input / fc2_input), or ``--policies all27``: every
placement in {device, offload, recompute}^3, labelled by initials (``d-o-r``):

    all_device                 device / device / device
    fc1_input_offload          offload / device / device
    activation_input_offload   device / offload / device
    fc2_input_offload          device / device / offload
    all_offload                offload / offload / offload
    default                    offload_policy() with no arguments
    all_recompute              recompute / recompute / recompute   (reference)

For each one it records

* the compiled program's memory (``compiled.memory_analysis()``: temp, argument,
  output and, where the backend reports them, the host-side sizes), and which
  buffers are live where the temp allocation is fullest (XLA's buffer assignment
  and schedule, read from the executable; liveness estimated here);
* the device's ``peak_bytes_in_use`` after one step (each policy runs in a fresh
  subprocess, since the peak cannot be reset; ``None`` on the CPU);
* the residual bytes kept on device / in pinned host memory, read from the traced
  gradient (``placement.residual_report``); with ``--runtime-check`` also the
  bytes of the residual arrays a jitted forward returns, by memory kind;
* the median step time (``benchmarks/common.py: time_call``);
* proof of placement in the compiled program: the instructions whose shapes carry
  host memory space ``S(5)``, the device->host / host->device copies among them and
  their bytes, and any ``MoveToHost`` / ``MoveToDevice`` /
  ``annotate_device_placement`` custom calls left.

It then prints, per layout and layer count, the table, the residual-device-memory
bar (all three offloaded must keep >= 90 % less residual memory on the device than
all three on the device, judged from the traced bytes and from compiled temp
memory) and the link time the host bytes imply; then issue 17's bars
(``benchmarks/offload_bars.py``): the per-layer growth of compiled temp memory and
of the device peak between the smallest and largest layer count against
``kept_on_device + 0.10 * offloaded`` residual bytes per layer, and the step time
against ``1.15 * max(compute step, transfer time)`` (compute: the policy with its
offloads kept on the device, recomputes still recomputed), the transfer time from the
host link bandwidth measured in the worker process (a pinned-host <-> device copy of
``--link-mb`` MB each way, large so that the fixed cost of one copy hardly counts;
``--link-gbps`` where there is no ``pinned_host``).
JSON goes to ``benchmarks/results/offload_<platform>.json``; ``--plot`` draws it
(``benchmarks/plot_offload.py``).

    PYTHONPATH=. python benchmarks/bench_offload.py                                # small CPU shape
    PYTHONPATH=. python3 benchmarks/bench_offload.py --nano --plot offload.png       # H200
    PYTHONPATH=. python3 benchmarks/bench_offload.py --ep-share --policies all27 --layers 4,8 \
        --inprocess --no-time                                      # compiled temp of all 27, one process

On the CPU, ``device_put`` to a memory kind inside ``jit`` lowers to nothing
(jax/_src/dispatch.py registers the memory-kind annotation for 'gpu' and 'tpu'
only), so the compiled CPU program has no host placement at all: the traced
columns show what the policy asks for, the compiled columns show what XLA:CPU does
(keep everything in ordinary memory).
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import itertools
import json
import math
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks import offload_bars
from benchmarks.common import RESULTS, require_kernels, time_call, write_result
from benchmarks.buffer_assignment import temp_peak_report
from benchmarks.shapes import router_group_sizes
from benchmarks.hlo_text import host_placement_report, lowered_placement_report, parse_hlo
from benchmarks.xla_dump import dump_flags, find_dump, temp_peak_from_dump

PLACEMENT_NAMES = ("fc1_input", "activation_input", "fc2_input")
NAMED_POLICIES = {
    "all_device": ("device", "device", "device"),
    "fc1_input_offload": ("offload", "device", "device"),
    "activation_input_offload": ("device", "offload", "device"),
    "fc2_input_offload": ("device", "device", "offload"),
    "all_offload": ("offload", "offload", "offload"),
    "default": None,  # offload_policy() exactly as a user gets it
    "all_recompute": ("recompute", "recompute", "recompute"),
}
POLICIES = NAMED_POLICIES | offload_bars.ALL27  # "d-o-r": fc1_input device, activation_input offload, ...
LAYOUTS = ("loop", "scan", "stack", "layer_scan", "layer_scan_xla")
SCANNED = ("layer_scan", "layer_scan_xla")  # layer_scan with its own copies (CUDA), and with XLA's
# Run order: what the bar and the temp-memory question need first, in case a run is cut short.
RUN_ORDER = ["all_device", "all_offload", "all_recompute", "fc1_input_offload", "activation_input_offload",
             "fc2_input_offload", "default", "d-d-d", "o-o-o", "r-r-r"]  # fmt: skip
RUN_ORDER += [k for k in offload_bars.ALL27 if k not in RUN_ORDER]
CPU_SHAPE = dict(tokens=2048, hidden=256, ffn=384, experts=8)
NANO_SHAPE = dict(tokens=49152, hidden=2688, ffn=1856, experts=128)  # 8192 tokens x top-6
# Issue 17's shape: one device's expert-parallel share of Nemotron-3-Nano (16 local experts).
EP_SHARE_SHAPE = dict(tokens=49152, hidden=2688, ffn=1856, experts=16)
BAR = 0.90  # all_offload keeps >= 90 % less residual memory on the device than all_device
MB = 1e6
LOSS_MODULE = "jit_loss"  # XLA's name for the jitted step (make_stack's ``loss``)


def default_placement() -> tuple[str, ...]:
    from jax_grouped_mlp._src.offload.policy import offload_policy

    sig = inspect.signature(offload_policy)
    return tuple(sig.parameters[n].default for n in PLACEMENT_NAMES)


def placement_of(label: str) -> tuple[str, ...]:
    p = POLICIES[label]
    return default_placement() if p is None else p


# --------------------------------------------------------------------------- the stack


def group_sizes(tokens: int, experts: int, ragged: bool, seed: int = 0) -> np.ndarray:
    """Equal sizes, or with ``ragged`` a router-like Dirichlet(1) draw (the generator the
    tests and the other benchmarks share)."""
    return router_group_sizes(tokens, experts, 1.0 if ragged else math.inf, seed)


def make_stack(shape: dict, layers: int, recipe: str, ragged: bool, seed: int = 0, layout: str = "loop",
               prevent_cse: bool = True, param_dtype: str = "bfloat16"):
    """``loss_for(label)`` -> ``loss(params, x, sizes, probs)``, and the arguments.

    Every layer is ``x + jax.checkpoint(grouped_mlp, policy=...)(x, w1, w2, sizes, probs)``.
    ``layout="loop"``: ``params`` is a list of ``(w1, w2)`` per layer (separate arrays: no
    slicing of a stacked weight inside the step) and a Python loop over them;
    ``layout="scan"``: ``params`` is ``(w1 (L, G, H, F), w2 (L, G, F, H))`` and
    ``jax.lax.scan`` runs the layer over them; ``layout="stack"``: the loop's list run by
    ``layer_stack``; ``layout="layer_scan"``: the scan's stacked weights run by
    ``layer_scan`` (``layer_scan_xla``: with XLA's own host copies instead of its CUDA
    store's, ``host_store.xla_copies``). Every layout gets the same values. ``param_dtype``: the weights'
    dtype ("float32": master weights, which the op rounds to bf16 per use, and whose
    bf16 copies become residuals of the backward pass).
    ``prevent_cse`` is ``jax.checkpoint``'s: its default (True) puts every residual
    of a layer's backward, host copies included, in one optimization barrier with the
    layer's cotangent, so no reload can start before that layer's backward does.
    """
    import jax
    import jax.numpy as jnp

    from jax_grouped_mlp._src.op.mlp import grouped_mlp
    from jax_grouped_mlp._src.offload.policy import offload_policy
    from jax_grouped_mlp._src.offload import host_store
    from jax_grouped_mlp._src.offload.scan_stack import layer_scan
    from jax_grouped_mlp._src.offload.stack import layer_stack

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got layout={layout!r}")
    m, h, f, g = shape["tokens"], shape["hidden"], shape["ffn"], shape["experts"]
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (m, h), jnp.bfloat16)
    probs = jax.random.uniform(keys[1], (m,), jnp.float32)
    w1 = (jax.random.normal(keys[2], (layers, g, h, f), jnp.bfloat16) * h**-0.5).astype(param_dtype)
    w2 = (jax.random.normal(keys[3], (layers, g, f, h), jnp.bfloat16) * f**-0.5).astype(param_dtype)
    if layout in ("loop", "stack"):
        params = [(w1[i], w2[i]) for i in range(layers)]
        del w1, w2
    else:
        params = (w1, w2)
    sizes = jnp.asarray(group_sizes(m, g, ragged, seed))

    def loss_for(label, layout=layout):
        p = POLICIES[label]
        policy = offload_policy() if p is None else offload_policy(*p)
        layer = jax.checkpoint(functools.partial(grouped_mlp, recipe=recipe), policy=policy, prevent_cse=prevent_cse)

        if layout == "loop":

            def loss(params, x, sizes, probs):
                for w1, w2 in params:
                    x = x + layer(x, w1, w2, sizes, probs)
                return jnp.mean(x.astype(jnp.float32) ** 2)

        elif layout in ("stack", *SCANNED):
            run = layer_stack if layout == "stack" else layer_scan
            if layout == "layer_scan_xla":

                def run(*a, **k):
                    with host_store.xla_copies():
                        return layer_scan(*a, **k)

            def one(p, x, sizes, probs):
                return x + grouped_mlp(x, p[0], p[1], sizes, probs, recipe=recipe)

            def loss(params, x, sizes, probs):
                x = run(one, params, x, sizes, probs, policy=policy)
                return jnp.mean(x.astype(jnp.float32) ** 2)

        else:

            def loss(params, x, sizes, probs):
                def body(x, w):
                    return x + layer(x, w[0], w[1], sizes, probs), None

                x, _ = jax.lax.scan(body, x, params)
                return jnp.mean(x.astype(jnp.float32) ** 2)

        return loss

    return loss_for, (params, x, sizes, probs)


# --------------------------------------------------------------------------- one policy


def _memory_analysis(compiled) -> dict:
    mem = compiled.memory_analysis()
    fields = (
        "temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
        "generated_code_size_in_bytes", "host_temp_size_in_bytes", "host_argument_size_in_bytes",
        "host_output_size_in_bytes", "host_alias_size_in_bytes", "host_generated_code_size_in_bytes",
        "peak_memory_in_bytes", "total_allocation_bytes", "indefinite_allocations",
    )  # fmt: skip
    out = {}
    for f in fields:
        v = getattr(mem, f, None) if mem is not None else None
        out[f] = int(v) if isinstance(v, (int, np.integer)) else None
    return out


def _memory_stats(device) -> dict | None:
    stats = device.memory_stats()
    if not stats:
        return None
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "largest_alloc_size", "num_allocs")
    return {k: int(stats[k]) for k in keys if k in stats}


def _compiler_options(opts) -> dict:
    """``--xla-option KEY=VALUE`` pairs as XLA debug options for ``Lowered.compile``."""
    out: dict = {}
    for item in getattr(opts, "xla_option", None) or ():
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--xla-option wants KEY=VALUE, got {item!r}")
        if val.lower() in ("true", "false"):
            out[key] = val.lower() == "true"
        else:
            try:
                out[key] = int(val)
            except ValueError:
                try:
                    out[key] = float(val)
                except ValueError:
                    out[key] = val
    return out


def _temp_peak(compiled, text: str, opts) -> dict | None:
    """What is live at the temp peak: from XLA's dump of this module when the worker was
    started with one (exact live ranges), else from the serialized buffer assignment
    (estimated liveness; XLA:CPU has it, XLA:GPU returns none)."""
    instrs = parse_hlo(text)["instrs"]
    dump = find_dump(opts.xla_dump_dir, LOSS_MODULE) if getattr(opts, "xla_dump_dir", None) else None
    if dump is not None:
        return temp_peak_from_dump(dump, instrs)
    blob = compiled.memory_analysis().serialized_buffer_assignment_proto
    module = compiled.runtime_executable().hlo_modules()[0].as_serialized_hlo_module_proto()
    return temp_peak_report(blob, module, instrs) if blob else None


def _recompile_with_profile(lowered, compiled, args, opts):
    """``lowered`` compiled again with a profile of ``compiled``'s own kernels and copies
    (XLA's profile-guided latency estimator, what ``jax_enable_pgle`` does for jitted
    calls): the latency-hiding scheduler then knows how long each copy and kernel takes."""
    import tempfile

    import jax
    from jax._src import profiler as jax_profiler

    jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(2):
            out = compiled(*args)
        jax.block_until_ready(out)
        profile = jax_profiler.stop_and_get_fdo_profile()
    if not profile:
        return compiled, {"used": False, "why": "empty profile"}
    folder = pathlib.Path(tempfile.mkdtemp())
    if isinstance(profile, str):  # (a text proto)
        path = folder / "profile.pbtxt"
        path.write_text(profile)
    else:
        path = folder / "profile.pb"
        path.write_bytes(profile)
    options = {**_compiler_options(opts), "xla_gpu_pgle_profile_file_or_directory_path": str(path)}
    return lowered.compile(compiler_options=options), {"used": True, "profile_bytes": len(profile)}


def measure_policy(label: str, stack, opts, layout: str = "loop", layers: int | None = None) -> dict:
    """Everything measured for one policy (run it in a fresh process for a clean device peak).

    ``stack``: :func:`make_stack`'s result for ``layout`` and ``layers``."""
    import jax

    from jax_grouped_mlp._src.op.names import RESIDUAL_NAMES
    from jax_grouped_mlp._src.offload.placement import residual_report

    t_start = time.perf_counter()
    loss_for, args = stack
    loss = loss_for(label)
    device = jax.devices()[0]
    layers = opts.layers[0] if layers is None else layers
    row: dict = {"label": label, "layout": layout, "layers": layers,
                 "placement": dict(zip(PLACEMENT_NAMES, placement_of(label)))}  # fmt: skip

    # 1. What the traced gradient keeps where (per residual name): summed over the layers
    # of a loop, once for a scan's body (one layer); normalized here to per layer and per step.
    # (layer_scan's body keeps its copies on the device for one iteration: the plain
    # scan's body shows what the policy puts where)
    traced_loss = loss_for(label, "scan") if layout in SCANNED else loss
    report = residual_report(jax.grad(traced_loss, argnums=(0, 1)), *args)
    row["traced"] = {
        n: {"placement": r.placement, "device_bytes": r.device_bytes, "host_bytes": r.host_bytes}
        for n, r in report.items()
    }
    per = {"loop": layers, "scan": 1, "stack": layers, "layer_scan": 1, "layer_scan_xla": 1}[layout]  # layers the traced bytes cover
    dev = sum(report[n].device_bytes for n in RESIDUAL_NAMES if n in report)
    host = sum(report[n].host_bytes for n in RESIDUAL_NAMES if n in report)
    x = args[1]
    row["residual_bytes_per_layer"] = {
        "source": "placement.residual_report (traced gradient)",
        "device": dev // per, "host": host // per,
        "layer_input": x.size * x.dtype.itemsize,  # the checkpoint's input, kept by every policy
        "by_name": {n: {"device": r.device_bytes // per, "host": r.host_bytes // per} for n, r in report.items()},
    }  # fmt: skip
    row["device_residual_bytes"] = dev // per * layers  # all layers of the step
    row["host_residual_bytes"] = host // per * layers
    if layout in SCANNED:  # the last two layers keep what the policy offloads on the device
        kept = min(layers, 2)
        row["device_residual_bytes"], row["host_residual_bytes"] = dev * layers + host * kept, host * (layers - kept)

    # 2. The compiled step: memory analysis, host placement in the HLO, heap trace at the peak.
    stats_before = _memory_stats(device)
    t0 = time.perf_counter()
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    lowered = step.lower(*args)
    # What JAX hands XLA to move to pinned host and back. XLA:CPU gets no annotations
    # (device_put to a memory kind lowers to nothing there), so on other platforms the
    # step is also lowered for CUDA, which needs no GPU.
    try:
        if device.platform == "gpu":
            row["lowered_placement"] = lowered_placement_report(lowered.as_text())
        else:
            cuda = step.trace(*args).lower(lowering_platforms=("cuda",))
            row["lowered_placement"] = {"lowered_for": "cuda"} | lowered_placement_report(cuda.as_text())
    except Exception as e:
        row["lowered_placement"] = {"error": f"{type(e).__name__}: {e}"}
    compiled = lowered.compile(compiler_options=_compiler_options(opts) or None)
    if opts.pgle and device.platform == "gpu":
        compiled, row["pgle"] = _recompile_with_profile(lowered, compiled, args, opts)
    row["compile_s"] = time.perf_counter() - t0
    row["compiled"] = _memory_analysis(compiled)
    text = compiled.as_text()
    row["hlo"] = host_placement_report(text)
    try:
        row["temp_peak"] = _temp_peak(compiled, text, opts)
    except Exception as e:  # diagnostics only: never lose the measurement over them
        row["temp_peak"] = {"error": f"{type(e).__name__}: {e}"}
    if opts.dump_hlo:
        import gzip

        d = pathlib.Path(opts.dump_hlo)
        d.mkdir(parents=True, exist_ok=True)
        with gzip.open(d / f"{layout}_{layers}_{label}.hlo.txt.gz", "wt") as fh:
            fh.write(text)
    stats_compiled = _memory_stats(device)

    # 3. One step alone (device peak), then the timed steps.
    run = functools.partial(compiled, *args)
    jax.block_until_ready(run())
    stats_step = _memory_stats(device)
    row["step_time_s"] = (
        time_call(run, iters=opts.iters, warmup=opts.warmup, samples=opts.samples) if opts.samples > 0 else None
    )
    stats_timed = _memory_stats(device)
    row["memory_stats"] = {
        "before_compile": stats_before,
        "after_compile": stats_compiled,
        "after_one_step": stats_step,
        "after_timing": stats_timed,
    }
    if stats_step:
        row["peak_bytes_in_use"] = stats_step.get("peak_bytes_in_use")
        row["peak_minus_before"] = stats_step.get("peak_bytes_in_use", 0) - stats_before.get("bytes_in_use", 0)
        row["peak_masked_by_compile"] = stats_step.get("peak_bytes_in_use") == stats_compiled.get(
            "peak_bytes_in_use"
        ) and stats_compiled.get("peak_bytes_in_use") != stats_before.get("peak_bytes_in_use")
    else:
        row["peak_bytes_in_use"] = row["peak_minus_before"] = row["peak_masked_by_compile"] = None
    del run, compiled

    # 4. The residual arrays a jitted forward really returns, by memory kind.
    if opts.runtime_check:
        # Residuals returned by jit get their memory kind only from JAX's own transfers.
        from jax_grouped_mlp._src.op import residuals

        residuals.OWN_TRANSFERS = False
        try:
            vjp_fn = jax.jit(lambda *a: jax.vjp(loss, *a)[1])(*args)
        finally:
            residuals.OWN_TRANSFERS = True
        kinds: collections.Counter = collections.Counter()
        for a in jax.tree.leaves(vjp_fn):
            if isinstance(a, jax.Array):
                kinds[str(a.sharding.memory_kind)] += a.nbytes
        row["runtime_residual_bytes_by_memory_kind"] = dict(kinds)
        row["host_bytes_runtime"] = int(kinds.get("pinned_host", 0))
        del vjp_fn
    row["wall_s"] = time.perf_counter() - t_start
    return row


# --------------------------------------------------------------------------- the whole run


def _shape(opts) -> dict:
    shape = dict(EP_SHARE_SHAPE if opts.ep_share else NANO_SHAPE if opts.nano else CPU_SHAPE)
    for k in shape:
        if getattr(opts, k) is not None:
            shape[k] = getattr(opts, k)
    return shape


def _device_description() -> dict:
    import jax

    d = jax.devices()[0]
    return {
        "platform": d.platform,
        "device_kind": d.device_kind,
        "jax": jax.__version__,
        "memory_kinds": sorted(m.kind for m in d.addressable_memories()),
    }


def worker(opts, labels: list[str]) -> tuple[dict, list[dict]]:
    """Measures ``labels`` in this process, for each of ``opts.layout`` and ``opts.layers``
    (one stack at a time), then the host link (after every device peak is read: its
    copies need device memory); returns (device description, rows)."""
    require_kernels()  # (no timing of the pure-JAX fallback under our name)
    shape = _shape(opts)
    desc = _device_description()
    rows = []
    for layout in opts.layout:
        for layers in opts.layers:
            stack = make_stack(shape, layers, opts.recipe, opts.ragged, layout=layout, prevent_cse=opts.prevent_cse,
                               param_dtype=opts.param_dtype)
            for label in labels:
                tag = f"{layout} x{layers} {label}"
                print(f"[{tag}] measuring...", file=sys.stderr, flush=True)
                rows.append(measure_policy(label, stack, opts, layout, layers))
                print(f"[{tag}] done in {rows[-1]['wall_s']:.1f} s", file=sys.stderr, flush=True)
            del stack
    desc["link"] = offload_bars.measure_link(int(opts.link_mb * MB)) if opts.link_mb > 0 else None
    return desc, rows


def _child_argv(opts, label: str, out: str, layout: str, layers: int) -> list[str]:
    argv = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", label, "--worker-out", out]
    argv += ["--layout", layout, "--layers", str(layers), "--recipe", opts.recipe, "--param-dtype", opts.param_dtype,
             "--iters", str(opts.iters),
             "--warmup", str(opts.warmup), "--samples", str(opts.samples), "--link-mb", str(opts.link_mb)]  # fmt: skip
    for k in ("tokens", "hidden", "ffn", "experts"):
        if getattr(opts, k) is not None:
            argv += [f"--{k}", str(getattr(opts, k))]
    if opts.nano:
        argv.append("--nano")
    if opts.ep_share:
        argv.append("--ep-share")
    if opts.ragged:
        argv.append("--ragged")
    if opts.runtime_check:
        argv.append("--runtime-check")
    if not opts.fence:
        argv.append("--no-fence")
    if not opts.prevent_cse:
        argv.append("--no-prevent-cse")
    if opts.reload_after_cotangent:
        argv.append("--reload-after-cotangent")
    if not opts.stack_lag:
        argv.append("--no-stack-lag")
    if opts.pgle:
        argv.append("--pgle")
    if opts.dump_hlo:
        argv += ["--dump-hlo", str(opts.dump_hlo)]
    for item in opts.xla_option or ():
        argv += ["--xla-option", item]
    return argv


def run_subprocesses(opts, labels: list[str], done=None) -> tuple[dict, list[dict]]:
    """One fresh process per (policy, layout, layer count): ``peak_bytes_in_use`` only
    grows within a process. Policy outermost, so a run cut short has both layouts and
    every layer count of the policies it reached.

    ``done(desc, rows)`` is called after each process (the caller saves partial results);
    ``desc["links"]`` collects each process's link measurement."""
    desc, rows, links = {}, [], []
    root = pathlib.Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        if opts.autotune_cache:
            # JAX's persistent-cache settings turn on XLA:GPU's per-fusion autotuning cache
            # (jax_persistent_cache_enable_xla_caches), so the policies after the first
            # reuse its GEMM autotuning; no executable is stored (the minimum compile time
            # is never reached), so every policy still compiles from scratch.
            env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tmp, "jax_cache")
            env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "1e9"
        for label, layout, layers in itertools.product(labels, opts.layout, opts.layers):
            name = f"{layout}_{layers}_{label}"
            out = os.path.join(tmp, f"{name}.json")
            dump = os.path.join(tmp, f"{name}_xla")
            child_env = env | {"XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} {dump_flags(dump, LOSS_MODULE)}".strip()}
            t0 = time.perf_counter()
            try:
                argv = _child_argv(opts, label, out, layout, layers) + ["--xla-dump-dir", dump]
                proc = subprocess.run(argv, env=child_env, timeout=opts.child_timeout)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc == 0 and os.path.exists(out):
                res = json.loads(pathlib.Path(out).read_text())
                links.append(res["device"].pop("link", None))
                desc = desc or res["device"]
                rows.extend(res["rows"])
            else:
                print(f"[{name}] FAILED (exit {rc})", file=sys.stderr, flush=True)
                rows.append({"label": label, "layout": layout, "layers": layers,
                             "placement": dict(zip(PLACEMENT_NAMES, placement_of(label))),
                             "error": f"worker exit {rc}", "wall_s": time.perf_counter() - t0})  # fmt: skip
            if done is not None:
                done(desc | {"links": links}, rows)
    return desc | {"links": links}, rows


def _get(rows: dict, label: str, *path):
    v = rows.get(label)
    for p in path:
        if not isinstance(v, dict):
            return None
        v = v.get(p)
    return v


def summarize(rows: list[dict], link: dict) -> dict:
    """Differences against all_device / all_recompute, link time, the residual-memory bar and
    the step-time bar, for the rows of one layout and layer count. The baselines are found by
    placement ("d-d-d" stands in for all_device)."""
    ok = [r for r in rows if "error" not in r]
    by = {r["label"]: r for r in ok}
    for name in ("all_device", "all_offload", "all_recompute"):
        if name not in by:
            match = next((r for r in ok if tuple(r["placement"].values()) == NAMED_POLICIES[name]), None)
            if match is not None:
                by[name] = match
    link_bw = link["d2h_bytes_per_s"]
    t_dev = _get(by, "all_device", "compiled", "temp_size_in_bytes")
    t_rec = _get(by, "all_recompute", "compiled", "temp_size_in_bytes")
    s_dev = _get(by, "all_device", "step_time_s")
    p_dev = _get(by, "all_device", "peak_bytes_in_use")
    p_rec = _get(by, "all_recompute", "peak_bytes_in_use")
    for r in ok:
        temp = r["compiled"]["temp_size_in_bytes"]
        r["temp_minus_all_device"] = temp - t_dev if None not in (temp, t_dev) else None
        r["temp_minus_all_recompute"] = temp - t_rec if None not in (temp, t_rec) else None
        r["step_minus_all_device_s"] = r["step_time_s"] - s_dev if None not in (r["step_time_s"], s_dev) else None
        p = r.get("peak_bytes_in_use")
        r["peak_minus_all_device"] = p - p_dev if None not in (p, p_dev) else None
        r["link_time_each_way_s"] = r["host_residual_bytes"] / link_bw

    def drop(kept_off, kept_dev):
        if kept_off is None or not kept_dev or kept_dev <= 0:
            return None
        return 1.0 - kept_off / kept_dev

    bar = {"threshold": BAR}
    traced = drop(_get(by, "all_offload", "device_residual_bytes"), _get(by, "all_device", "device_residual_bytes"))
    bar["traced"] = {
        "all_device_bytes": _get(by, "all_device", "device_residual_bytes"),
        "all_offload_bytes": _get(by, "all_offload", "device_residual_bytes"),
        "drop": traced,
        "passes": None if traced is None else traced >= BAR,
    }
    dev_c, off_c = _get(by, "all_device", "temp_minus_all_recompute"), _get(by, "all_offload", "temp_minus_all_recompute")
    compiled = drop(off_c, dev_c)
    bar["compiled_temp"] = {
        "definition": "temp(policy) - temp(all_recompute)",
        "all_device_bytes": dev_c,
        "all_offload_bytes": off_c,
        "drop": compiled,
        "passes": None if compiled is None else compiled >= BAR,
        "note": None if dev_c is None or dev_c > 0
        else "all_device does not need more temp than all_recompute: no baseline",
    }
    p_off = _get(by, "all_offload", "peak_bytes_in_use")
    pk_dev = p_dev - p_rec if None not in (p_dev, p_rec) else None
    pk_off = p_off - p_rec if None not in (p_off, p_rec) else None
    peak = drop(pk_off, pk_dev)
    bar["device_peak"] = {
        "definition": "peak_bytes_in_use(policy) - peak_bytes_in_use(all_recompute)",
        "all_device_bytes": pk_dev, "all_offload_bytes": pk_off, "drop": peak,
        "passes": None if peak is None else peak >= BAR,
    }  # fmt: skip
    res_dev, res_off = _residuals_at_peak(by.get("all_device")), _residuals_at_peak(by.get("all_offload"))
    at_peak = drop(res_off, res_dev)
    bar["residuals_at_temp_peak"] = {
        "definition": "residual bytes live where the device temp allocation is fullest: kept on the device "
                      "plus fetched back from pinned host (XLA's live ranges, from its dump of the step)",
        "all_device_bytes": res_dev, "all_offload_bytes": res_off, "drop": at_peak,
        "passes": None if at_peak is None else at_peak >= BAR,
    }  # fmt: skip
    offload_bars.step_bars(rows, link)
    return bar


def _residuals_at_peak(row: dict | None) -> int | None:
    split = ((row or {}).get("temp_peak") or {}).get("live_at_peak_residual_bytes")
    return None if split is None else split["kept"] + split["fetched"]


def _fmt(v, scale=MB, spec=".1f", none="-"):
    return none if v is None else format(v / scale, spec)


def print_table(rows: list[dict], link_bw: float) -> None:
    """The rows of one layout and layer count."""
    hdr = (
        f"{'policy':<26}{'fc1/act/fc2':<14}{'res dev':>9}{'res host':>9}{'temp':>10}{'dtemp':>9}"
        f"{'host tmp':>9}{'peak':>10}{'dpeak':>9}{'S5':>5}{'D2H':>5}{'H2D':>5}{'HLO->host':>10}"
        f"{'step ms':>9}{'dstep':>8}{'link/way':>9}"
    )
    print("\nMB = 1e6 bytes; res dev / res host: residual bytes the traced gradient keeps on device / in")
    print("pinned host (all layers); temp: compiled temp; dtemp, dpeak, dstep: minus all_device;")
    print("peak: device peak_bytes_in_use after one step; S5: instructions with host-memory (S(5)) shapes;")
    print(f"D2H/H2D: host transfers in the compiled HLO; link/way: res host / {link_bw / 1e9:.1f} GB/s, ms\n")
    print(hdr)
    for r in rows:
        pl = "/".join(p[0].upper() for p in r["placement"].values())
        if "error" in r:
            print(f"{r['label']:<26}{pl:<14}ERROR: {r['error']}")
            continue
        h, c = r["hlo"], r["compiled"]
        print(
            f"{r['label']:<26}{pl:<14}{_fmt(r['device_residual_bytes']):>9}{_fmt(r['host_residual_bytes']):>9}"
            f"{_fmt(c['temp_size_in_bytes']):>10}{_fmt(r['temp_minus_all_device'], spec='+.1f'):>9}"
            f"{_fmt(c['host_temp_size_in_bytes']):>9}{_fmt(r['peak_bytes_in_use']):>10}"
            f"{_fmt(r['peak_minus_all_device'], spec='+.1f'):>9}{h['s5_instructions']:>5}"
            f"{sum(h['to_host_ops'].values()):>5}{sum(h['to_device_ops'].values()):>5}"
            f"{_fmt(h['to_host_bytes']):>10}{_fmt(r['step_time_s'], 1e-3, '.2f'):>9}"
            f"{_fmt(r['step_minus_all_device_s'], 1e-3, '+.2f'):>8}{r['link_time_each_way_s'] * 1e3:>9.2f}"
        )


def print_bar(bar: dict) -> None:
    print(f"\nresidual device memory, all_offload vs all_device (bar: >= {bar['threshold']:.0%} less):")
    for key, what in (("traced", "traced residual bytes"), ("compiled_temp", "compiled temp - all_recompute"),
                      ("device_peak", "device peak - all_recompute"),
                      ("residuals_at_temp_peak", "residuals live at the temp peak")):  # fmt: skip
        b = bar.get(key)
        if b is None:
            continue
        if b["drop"] is None:
            print(f"  {what:<32} n/a ({b.get('note') or 'not available'}; "
                  f"all_device {_fmt(b['all_device_bytes'])} MB, all_offload {_fmt(b['all_offload_bytes'])} MB)")
            continue
        print(f"  {what:<32} {_fmt(b['all_device_bytes']):>10} MB -> {_fmt(b['all_offload_bytes']):>10} MB"
              f"   {b['drop']:.1%} less  {'PASS' if b['passes'] else 'FAIL'}")  # fmt: skip


def print_temp_question(rows: list[dict]) -> None:
    """Does offloading raise compiled temp memory (issue 5: +3.3 GB at Nano, 2 layers, on the H200)?"""
    print("\ncompiled temp memory of each offloading policy against all_device (what offloading should save:")
    print("the residual bytes it moves off the device):")
    for r in rows:
        if "error" in r or not r["host_residual_bytes"] or r.get("temp_minus_all_device") is None:
            continue
        d, moved = r["temp_minus_all_device"], r["host_residual_bytes"]
        asked = (r.get("lowered_placement") or {}).get("pinned_host", {})
        what = ", ".join(f"{t} {v['bytes'] / MB:.1f}" for t, v in asked.items()) or "-"
        print(f"  {r['label']:<26} temp {d / MB:+10.1f} MB   moved to host {moved / MB:9.1f} MB "
              f"(lowered: {what})   host temp {_fmt(r['compiled']['host_temp_size_in_bytes'])} MB   "
              f"HLO transfers {sum(r['hlo']['to_host_ops'].values())} out / "
              f"{sum(r['hlo']['to_device_ops'].values())} in, {r['hlo'].get('read_backs', 0)} read-backs")  # fmt: skip


def print_peaks(rows: list[dict], labels=("all_device", "all_offload"), top: int = 10) -> None:
    """What is live at the compiled temp peak, for the baseline and the all-offload program."""
    for r in rows:
        tp = r.get("temp_peak") or {}
        if r["label"] not in labels or not tp.get("live_at_peak_top"):
            continue
        phases = ", ".join(f"{k} {v / MB:.1f}" for k, v in sorted(tp["live_at_peak_bytes_by_phase"].items()))
        print(f"\n[{r['label']}] temp {tp['temp_allocation_bytes'] / MB:.1f} MB; estimated live peak "
              f"{tp['estimated_peak_bytes'] / MB:.1f} MB at entry position {tp['peak_position']} of "
              f"{tp['entry_schedule_length']} (backward from ~{tp['backward_starts_at']}; "
              + ", ".join(f"{k} {v:.0%}" for k, v in tp["fraction_of_pass_done_at_peak"].items() if v is not None)
              + " done), "
              f"{tp['live_at_peak_buffers']} buffers live, MB by phase: {phases}; "
              f"backward/unlabelled buffers made before the backward: "
              f"{tp['live_at_peak_made_before_backward_bytes'] / MB:.1f} MB")  # fmt: skip
        split = tp.get("live_at_peak_residual_bytes")
        if split:
            print("  residuals live at the peak: " + ", ".join(f"{k} {v / MB:.1f} MB" for k, v in split.items())
                  + f" (XLA's live ranges; temp allocation {tp['temp_allocation_bytes'] / MB:.1f} MB)")
        print(f"  {'MB':>9}  {'phase':<8} {'residual':<8} {'opcode':<12} {'live':>11}  {'shape':<34} op_name (tail)")
        for b in tp["live_at_peak_top"][:top]:
            print(f"  {b['bytes'] / MB:9.1f}  {b['phase']:<8} {b.get('residual', '-'):<8} {b['opcode'][:12]:<12} "
                  f"{b['live_from']:>5}-{b['live_to']:<5}  {b['shape'][:34]:<34} {b['op_name'][-50:]}")  # fmt: skip


def print_peak_diff(rows: list[dict], base: str = "all_device", other: str = "all_offload", top: int = 8) -> None:
    """Which buffer shapes are live at the temp peak of ``other`` beyond ``base``'s."""
    by = {r["label"]: (r.get("temp_peak") or {}).get("live_at_peak_by_shape") for r in rows}
    if not by.get(base) or not by.get(other):
        return
    diff = []
    for shape in set(by[base]) | set(by[other]):
        b, o = by[base].get(shape, [0, 0]), by[other].get(shape, [0, 0])
        if o[0] != b[0]:
            diff.append((o[0] - b[0], shape, b[1], o[1]))
    diff.sort(key=lambda d: -abs(d[0]))
    print(f"\nlive at the temp peak, {other} minus {base}, by shape (largest shapes only):")
    for delta, shape, nb, no in diff[:top]:
        print(f"  {delta / MB:+10.1f} MB  {shape[:60]:<60} buffers {nb} -> {no}")
    if not diff:
        print("  (the same)")


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"--layers must be positive integers, comma-separated, got {text!r}")
    return sorted(set(vals))


def _layouts(text: str) -> list[str]:
    """``--layout``: "both" (loop and scan), or a comma-separated list of LAYOUTS."""
    if text == "both":
        return ["loop", "scan"]
    out = [t for t in text.split(",") if t]
    bad = [t for t in out if t not in LAYOUTS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"--layout must be 'both' or a comma-separated list of {LAYOUTS}, got {text!r}")
    return out


def _labels(text: str, error) -> list[str]:
    labels: list[str] = []
    for s in (s.strip() for s in text.split(",")):
        for label in offload_bars.ALL27 if s == "all27" else [s] if s else []:
            if label not in labels:
                labels.append(label)
    unknown = sorted(set(labels) - set(POLICIES))
    if unknown:
        error(f"unknown policies {unknown}; choose from {list(NAMED_POLICIES)}, all27 or labels like d-o-r")
    return labels


def _label_of(rows: list[dict], placement: tuple[str, ...]) -> str | None:
    """The label of the row with ``placement``, a named policy before a d-o-r label."""
    found = [r["label"] for r in rows if tuple(r["placement"].values()) == placement and r["label"] != "default"]
    return min(found, key=lambda label: label in offload_bars.ALL27, default=None)


def _group(rows: list[dict], layout: str, layers: int) -> list[dict]:
    return [r for r in rows if r.get("layout", "loop") == layout and r.get("layers") == layers]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=_int_list, default=[4, 8],
                   help="layer counts, comma-separated (default 4,8); the per-layer growth is taken between "
                        "the smallest and the largest")
    p.add_argument("--layout", default="both", type=_layouts,
                   help="loop: a Python loop over per-layer weights; scan: lax.scan over stacked weights")
    p.add_argument("--recipe", default="mxfp8", choices=["mxfp8", "bf16", "fp8_block"])
    shapes = p.add_mutually_exclusive_group()
    shapes.add_argument("--nano", action="store_true",
                        help="Nemotron-3-Nano expert shape: 49152 x 2688 x 1856, 128 experts")
    shapes.add_argument("--ep-share", action="store_true",
                        help="issue 17's shape, an expert-parallel device's share of Nano: 49152 x 2688 x 1856, "
                             "16 experts")
    p.add_argument("--ragged", action="store_true",
                   help="router-like group sizes, multinomial over Dirichlet(1) shares (default: equal)")
    p.add_argument("--param-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the weights' dtype (float32: master weights, as the Flax modules keep them)")
    p.add_argument("--tokens", type=int, default=None, help="override the shape's rows (tokens x top-k)")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--policies", default=",".join(NAMED_POLICIES),
                   help="comma-separated: " + ",".join(NAMED_POLICIES) + ", labels like d-o-r "
                        "(fc1_input/activation_input/fc2_input: device, offload, recompute) or all27")
    p.add_argument("--iters", type=int, default=1, help="steps per timed sample")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--samples", type=int, default=5, help="timed samples; the median is reported (0: no timing)")
    p.add_argument("--no-time", dest="samples", action="store_const", const=0,
                   help="skip the timing (--samples 0): compiled memory, one step for the device peak")
    p.add_argument("--link-gbps", type=float, default=53.0,
                   help="host link bandwidth each way, GB/s, where it cannot be measured")
    p.add_argument("--link-mb", type=float, default=2048.0,
                   help="MB copied each way to measure the host link (0: use --link-gbps)")
    p.add_argument("--inprocess", action="store_true",
                   help="everything in this process (compiled memory only: the device peak is then cumulative)")
    p.add_argument("--runtime-check", action="store_true",
                   help="also compile and run the forward alone and sum the residual arrays it returns by memory kind")
    p.add_argument("--child-timeout", type=float, default=1800, help="seconds per policy process")
    p.add_argument("--no-autotune-cache", dest="autotune_cache", action="store_false",
                   help="do not share XLA:GPU autotuning results between the policy processes")
    p.add_argument("--no-prevent-cse", dest="prevent_cse", action="store_false",
                   help="jax.checkpoint(..., prevent_cse=False): no barrier ties a layer's reloads "
                        "to its cotangent (lets XLA prefetch them; issue 17's time bar)")
    p.add_argument("--no-fence", dest="fence", action="store_false",
                   help="the op's output does not wait for its residuals' host copies "
                        "(residuals.FENCE_HOST_COPIES = False: the mechanism before the fence, for A/B)")
    p.add_argument("--reload-after-cotangent", action="store_true",
                   help="residuals.RELOAD_AFTER_COTANGENT (an experiment): the op's backward rule brings "
                        "offloaded residuals back once the layer's cotangent exists (keeps a loop's "
                        "offload under --no-prevent-cse)")
    p.add_argument("--pgle", action="store_true",
                   help="compile each step again with a profile of its first compile (XLA's profile-guided "
                        "latency estimator, as jax_enable_pgle does), and time that")
    p.add_argument("--no-stack-lag", dest="stack_lag", action="store_false",
                   help="layout stack: each layer's output waits for its own host copies (the op's fence) "
                        "instead of the next layer's output waiting for them (stack.LAG_FENCE = False, for A/B)")
    p.add_argument("--dump-hlo", type=pathlib.Path, default=None,
                   help="write <layout>_<layers>_<policy>.hlo.txt.gz here")
    p.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an XLA debug option for compiling the step, e.g. xla_gpu_memory_limit_slop_factor=30 "
                        "(repeatable; passed to Lowered.compile(compiler_options=...))")
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument("--plot", type=pathlib.Path, default=None,
                   help="PNG: per layout, compiled temp (device peak where measured) against step time, with "
                        "each policy's step bar, and the per-layer growth against its bar")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--xla-dump-dir", default=None, help=argparse.SUPPRESS)  # set by the parent with XLA_FLAGS
    opts = p.parse_args(argv)
    if opts.samples < 0:
        p.error(f"--samples must be >= 0, got {opts.samples}")
    from jax_grouped_mlp._src.op import residuals

    residuals.FENCE_HOST_COPIES = opts.fence
    residuals.RELOAD_AFTER_COTANGENT = opts.reload_after_cotangent
    from jax_grouped_mlp._src.offload import stack as layer_stack_module

    layer_stack_module.LAG_FENCE = opts.stack_lag

    if opts.worker:  # child: one policy, layout and layer count, results to --worker-out
        desc, rows = worker(opts, [opts.worker])
        pathlib.Path(opts.worker_out).write_text(json.dumps({"device": desc, "rows": rows}))
        return {}

    labels = _labels(opts.policies, p.error)
    shape = _shape(opts)
    t0 = time.perf_counter()
    print(f"grouped_mlp x {','.join(map(str, opts.layers))} layers, layout {'+'.join(opts.layout)}, "
          f"M={shape['tokens']} H={shape['hidden']} F={shape['ffn']} G={shape['experts']} {opts.recipe}"
          f"{' ragged' if opts.ragged else ''}; default offload_policy() = {'/'.join(default_placement())}; "
          f"{'in-process' if opts.inprocess else 'one process per policy, layout and layer count'}",
          flush=True)  # fmt: skip
    order = sorted(labels, key=RUN_ORDER.index)  # the rows the bar needs first
    groups = [(layout, layers) for layout in opts.layout for layers in opts.layers]

    def result_for(desc, rows, complete):
        rows = sorted(rows, key=lambda r: (LAYOUTS.index(r.get("layout", "loop")), r.get("layers", 0),
                                           list(POLICIES).index(r["label"])))  # fmt: skip
        link = offload_bars.link_bandwidth(desc.get("links") or [desc.get("link")], opts.link_gbps)
        bars = {f"{layout}/{layers}": summarize(_group(rows, layout, layers), link) for layout, layers in groups}
        return {
            "command": shlex.join(["python"] + (sys.argv if argv is None else [__file__] + list(argv))),
            "argv": list(sys.argv if argv is None else argv),
            "complete": complete,
            "device": desc.get("device_kind"),
            "platform": desc.get("platform"),
            "jax": desc.get("jax"),
            "memory_kinds": desc.get("memory_kinds"),
            "shape": shape | {"layers": opts.layers, "recipe": opts.recipe, "ragged": opts.ragged,
                              "param_dtype": opts.param_dtype},
            "layouts": opts.layout,
            "layer_counts": opts.layers,
            "policies": order,
            "default_offload_policy": dict(zip(PLACEMENT_NAMES, default_placement())),
            "compiler_options": _compiler_options(opts),
            "fence_host_copies": opts.fence,
            "checkpoint_prevent_cse": opts.prevent_cse,
            "reload_after_cotangent": opts.reload_after_cotangent,
            "stack_lag_fence": opts.stack_lag,
            "pgle": opts.pgle,
            "timing": {"iters": opts.iters, "warmup": opts.warmup, "samples": opts.samples, "statistic": "median"},
            "link": link,
            "link_bandwidth_each_way": link["d2h_bytes_per_s"],
            "one_process_per_policy": not opts.inprocess,
            "bars": bars,  # per "layout/layers": the all-offload vs all-device residual-memory bar
            "growth": offload_bars.growth(rows, opts.layout, order, opts.layers, peak_valid=not opts.inprocess),
            "bar_definitions": {
                "memory": "growth per layer <= kept_on_device_bytes_per_layer + 0.10 * offloaded_bytes_per_layer "
                          "(residual bytes per layer from placement.residual_report of the traced gradient)",
                "step": "step_time_s <= 1.15 * max(compute_s, transfer_s); compute_s: the step of the same layout "
                        "and layer count with the policy's offloaded residuals kept on the device (compute_ref; "
                        "all-device where that placement was not measured); transfer_s: host bytes per step / d2h "
                        "+ / h2d bandwidth",
            },  # fmt: skip
            "rows": rows,
            "wall_s": time.perf_counter() - t0,
        }

    def write(result, out):  # the device as the workers saw it: this parent need not start a backend
        extra = {k: v for k, v in result.items() if k not in ("command", "rows", "device", "jax")}
        write_result(out, command=result["command"], rows=result["rows"], extra=extra, device=result["device"])

    def save_partial(desc, rows):  # a run cut short still leaves what it measured
        out = opts.out or RESULTS / f"offload_{desc.get('platform', 'unknown')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        result = result_for(desc, rows, False)
        write(result, out)
        if opts.plot and any("error" not in r for r in rows):
            from benchmarks.plot_offload import plot

            plot(result, opts.plot, verbose=False)

    if opts.inprocess:
        desc, rows = worker(opts, order)
    else:
        desc, rows = run_subprocesses(opts, order, save_partial)
    result = result_for(desc, rows, True)
    rows = result["rows"]
    link = result["link"]
    print(f"\ndevice: {desc.get('device_kind')} ({desc.get('platform')}), memory kinds {desc.get('memory_kinds')}")
    if link["source"] == "measured":
        print(f"host link, measured ({link['bytes'] / MB:.0f} MB each way): device->host "
              f"{link['d2h_bytes_per_s'] / 1e9:.1f} GB/s, host->device {link['h2d_bytes_per_s'] / 1e9:.1f} GB/s")
    else:
        print(f"host link: --link-gbps {opts.link_gbps} each way (not measured: "
              f"{(link.get('measure_errors') or ['no pinned_host memory kind, or --link-mb 0'])[0]})")
    for layout, layers in groups:
        group = _group(rows, layout, layers)
        print(f"\n===== layout {layout}, {layers} layers =====")
        print_table(group, link["d2h_bytes_per_s"])
        print_bar(result["bars"][f"{layout}/{layers}"])
        if layers == max(opts.layers):  # the details once per layout
            base, other = (_label_of(group, NAMED_POLICIES[n]) for n in ("all_device", "all_offload"))
            print_temp_question(group)
            print_peaks(group, labels=(base, other))
            print_peak_diff(group, base=base, other=other)
    print("\n===== issue 17's bars =====")
    offload_bars.print_growth(result["growth"])
    offload_bars.print_step(rows, link)
    write(result, opts.out or RESULTS / f"offload_{desc.get('platform', 'unknown')}.json")
    if opts.plot:
        from benchmarks.plot_offload import plot

        plot(result, opts.plot)
    print(f"total wall time {result['wall_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
