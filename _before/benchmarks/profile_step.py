"""Where a training step's GPU time goes: per-kernel time of one expert-MLP step.

    PYTHONPATH=. python3 benchmarks/profile_step.py [--shape nano] [--alphas inf,1]
        [--candidates grouped_mlp_mxfp8,grouped_mlp_fp8_block] [--iters 5] [--top 25] [--out FILE]
    PYTHONPATH=. python3 benchmarks/profile_step.py --step grad_accum [--micro-batches 4]
        [--candidates bf16/per_micro_batch,fp8_block/prepared_once]
    PYTHONPATH=. python3 benchmarks/profile_step.py --step stack --layers 8
        [--candidates loop/d-d-d,scan/d-d-d,stack/o-d-d] [--timeline DIR]
    PYTHONPATH=. python3 benchmarks/profile_step.py --step block
        [--candidates bf16/bfloat16,bf16/float32,mxfp8/float32/bf16grad] [--tokens 8192] [--shape nano|small]

Runs the step of ``bench_mlp`` (same candidates, same operands, same router-made group
sizes), or with ``--step grad_accum`` the scanned micro-batch step of
``bench_grad_accum`` (candidates ``RECIPE/per_micro_batch`` or ``RECIPE/prepared_once``,
float32 master weights), or with ``--step stack`` the layer stack of ``bench_offload``
(candidates ``LAYOUT/POLICY``: a Python loop, ``lax.scan`` or ``layer_stack`` of ``--layers``
checkpointed layers, the policy as a label like ``d-o-d``), or with ``--step block`` the
Flax ``MoEBlock`` step of ``bench_moe_block`` (candidates ``RECIPE/PARAM_DTYPE``, with
``/bf16grad`` for ``weight_grad_dtype=jnp.bfloat16``; the Nano layer, router-made group
sizes; ``--shape`` nano or small, ``--alphas`` does not apply); ``--timeline DIR`` (any step) also
writes every device event with its stream and start time, to see what overlaps what; ``--shape`` nano, ep_share or cpu, equal
group sizes), ``--iters`` times under ``jax.profiler.trace``, reads the trace with jaxlib's
``ProfileData`` and sums the device events by kernel name: ms per step and launches
per step, largest first, grouped into our CUDA kernels (``jgm`` / CuTe names), XLA's
fusions and copies, and the GEMMs of cuBLAS. The step's wall time (``time_call``) is
printed next to the summed kernel time, so gaps (launch latency, host syncs) show.

XLA command buffers (CUDA graphs) hide the kernels inside them from some tracers, so by
default this turns them off (``--xla_gpu_enable_command_buffer=``) before jax starts;
``--keep-command-buffers`` leaves them on. Without a GPU there are no device events: the
script says so and writes nothing.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import pathlib
import re
import sys
import tempfile

import numpy as np

KIND_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ours", ("jgm", "grouped_gemm", "grouped_wgrad", "fake_quantize", "dequantize", "kernel_cutlass", "cutlass")),
    ("xla copy", ("copy", "memcpy", "memset", "transpose")),
    ("cublas", ("gemm", "cublas", "sm90_xmma", "nvjet")),
    ("xla fusion", ("fusion", "reduce", "loop_", "input_", "wrapped_", "convert", "broadcast")),
)


def kind_of(kernel: str) -> str:
    """A coarse label for a kernel name (the first rule whose word occurs in it)."""
    low = kernel.lower()
    for kind, words in KIND_RULES:
        if any(w in low for w in words):
            return kind
    return "other"


def summarize(events: list[tuple[str, float]], steps: int) -> list[dict]:
    """``[(kernel name, duration in ns)]`` of ``steps`` steps -> one row a name with ms
    and launches per step and its kind, largest total first."""
    if steps <= 0:
        raise ValueError(f"steps must be >= 1, got steps={steps}")
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter = collections.Counter()
    for name, ns in events:
        total[name] += ns
        count[name] += 1
    rows = [{"kernel": n, "kind": kind_of(n), "ms_per_step": t / steps / 1e6, "launches_per_step": count[n] / steps}
            for n, t in total.items()]
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def by_kind(rows: list[dict]) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for r in rows:
        out[r["kind"]] += r["ms_per_step"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def device_events(xplane: str, timeline: list | None = None) -> list[tuple[str, float]]:
    """Kernel events of the GPU planes of a trace file (empty without a GPU plane).
    With ``timeline`` (a list), also appends ``(stream line, name, start ns, duration ns)``
    of each event, for reading the overlap of copies and compute."""
    from jax._src.lib import _profile_data

    data = _profile_data.ProfileData.from_file(xplane)
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            # CUPTI puts kernels and memcpys on per-stream lines; "XLA Ops"/"XLA Modules"
            # lines repeat them at HLO level, which would count twice.
            if line.name.startswith("XLA") or line.name in ("Steps", "Framework Ops", "Source code"):
                continue
            events += [(e.name, e.duration_ns) for e in line.events]
            if timeline is not None:
                timeline += [(line.name, e.name, e.start_ns, e.duration_ns) for e in line.events]
    return events


def profile(step, args, iters: int, timeline: list | None = None) -> list[tuple[str, float]]:
    import jax

    jax.block_until_ready(step(*args))  # compile and warm up outside the trace
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(iters):
                out = step(*args)
            jax.block_until_ready(out)
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        return device_events(files[0], timeline) if files else []


def measure(key: str, step, args, iters: int, top: int, timeline: pathlib.Path | None = None) -> dict | None:
    """Profile ``step(*args)``, time it, print its largest kernels; None without device events.
    ``timeline``: also write every device event (stream, name, start, duration) there as JSON."""
    from common import time_call

    events_at: list | None = [] if timeline is not None else None
    events = profile(step, args, iters, events_at)
    if timeline is not None and events_at:
        import json

        t0 = min(e[2] for e in events_at)
        rows = sorted([(line, name, (start - t0) / 1e3, dur / 1e3) for line, name, start, dur in events_at],
                      key=lambda r: r[2])
        timeline.write_text(json.dumps({"key": key, "iters": iters, "unit": "us",
                                        "events": [dict(zip(("stream", "name", "start", "dur"), r)) for r in rows]}))
    if not events:
        print(f"{key}: no device events in the trace (no GPU?); nothing to report", flush=True)
        return None
    rows = summarize(events, iters)
    wall = time_call(step, *args, iters=iters, warmup=1, samples=3) * 1e3
    kernels = sum(r["ms_per_step"] for r in rows)
    report = {"step_ms": wall, "kernel_ms": kernels, "by_kind": by_kind(rows), "kernels": rows}
    print(f"\n{key}: step {wall:.2f} ms, kernels {kernels:.2f} ms; by kind: "
          + ", ".join(f"{k} {v:.2f}" for k, v in report["by_kind"].items()), flush=True)
    for r in rows[:top]:
        print(f"  {r['ms_per_step']:7.3f} ms  x{r['launches_per_step']:<5g} {r['kind']:10s} {r['kernel'][:110]}")
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="nano")
    ap.add_argument("--alphas", default="inf", help="group-size skews: inf (equal sizes) and Dirichlet alphas")
    ap.add_argument("--step", default="mlp", choices=["mlp", "grad_accum", "stack", "block"],
                    help="bench_mlp's step, bench_grad_accum's scan over micro-batches, or bench_offload's "
                         "stack of layers")
    ap.add_argument("--layers", type=int, default=8, help="with --step stack")
    ap.add_argument("--tokens", type=int, default=8192, help="with --step block")
    ap.add_argument("--no-prevent-cse", dest="prevent_cse", action="store_false",
                    help="with --step stack: jax.checkpoint(..., prevent_cse=False)")
    ap.add_argument("--micro-batches", type=int, default=4, help="with --step grad_accum")
    ap.add_argument("--candidates", default=None,
                    help="comma-separated: bench_mlp candidates (default grouped_mlp_mxfp8), or with "
                         "--step grad_accum RECIPE/per_micro_batch or RECIPE/prepared_once (default bf16/per_micro_batch)")
    ap.add_argument("--qw-table", default="",
                    help="with --step mlp: bench_mlp's --qw-table (the candidate grouped_mlp_mxfp8_qw_table)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=25, help="kernels printed per run")
    ap.add_argument("--keep-command-buffers", action="store_true")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ap.add_argument("--timeline", type=pathlib.Path, default=None,
                    help="a folder; writes <candidate>.timeline.json (every device event of the profiled steps)")
    ns = ap.parse_args(argv)
    ns.argv = list(argv) if argv else sys.argv[1:]  # (the command the results file records)
    if ns.candidates is None:
        ns.candidates = {"mlp": "grouped_mlp_mxfp8", "grad_accum": "bf16/per_micro_batch",
                         "stack": "loop/d-d-d,scan/d-d-d", "block": "bf16/bfloat16,bf16/float32"}[ns.step]
    if ns.iters < 1:
        ap.error(f"--iters must be >= 1, got {ns.iters}")
    if not ns.keep_command_buffers:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import bench_mlp
    from common import MLP_SHAPES, command_line, require_kernels, write_result

    require_kernels()  # (after XLA_FLAGS: it starts the backend, which reads them once)
    from shapes import skew_label

    if ns.step == "stack":
        return _profile_stacks(ap, ns)
    if ns.step == "block":
        return _profile_blocks(ap, ns)
    if ns.shape not in MLP_SHAPES:
        ap.error(f"--shape must be one of {sorted(MLP_SHAPES)}, got {ns.shape!r}")
    names = [c for c in ns.candidates.split(",") if c]
    if ns.step == "mlp":
        bench_mlp.QW_TABLE = bench_mlp.parse_qw_table(ns.qw_table) if ns.qw_table else None
        known = bench_mlp._candidates()
        make_step = lambda c: bench_mlp._step(known[c])  # noqa: E731
    else:
        import bench_grad_accum

        known = {f"{r}/{p}": (r, p == "prepared_once")
                 for r in ("mxfp8", "bf16", "fp8_block") for p in ("per_micro_batch", "prepared_once")}
        make_step = lambda c: bench_grad_accum._step(*known[c])  # noqa: E731
    unknown = [c for c in names if c not in known]
    if unknown:
        ap.error(f"--candidates: unknown {unknown} for --step {ns.step}; known: {sorted(known)}")
    if ns.micro_batches < 1:
        ap.error(f"--micro-batches must be >= 1, got {ns.micro_batches}")
    results: dict = {}
    for alpha in (float(a) for a in ns.alphas.split(",") if a):
        if ns.step == "mlp":
            args, sizes = bench_mlp.step_inputs(ns.shape, ns.seed, alpha)
        else:
            args, _ = bench_grad_accum._inputs(ns.shape, ns.micro_batches, "float32", alpha, ns.seed)
            sizes = np.asarray(args[3])
        for cname in names:
            key = f"{ns.shape}@{skew_label(alpha)}/{cname}" + (f"/{ns.micro_batches}mb" if ns.step != "mlp" else "")
            where = None
            if ns.timeline is not None:
                ns.timeline.mkdir(parents=True, exist_ok=True)
                where = ns.timeline / (re.sub(r"[^A-Za-z0-9_.-]", "_", key) + ".timeline.json")
            # (bench_mlp's _qw A/B candidates change what the step's trace reads: traced here,
            # on the first call inside measure.)
            with bench_mlp.tracing(cname):
                report = measure(key, make_step(cname), args, ns.iters, ns.top, where)
            if report is not None:
                results[key] = {**report, "group_sizes": {"min": int(sizes.min()), "max": int(sizes.max())}}
    if ns.out is not None and results:
        write_result(ns.out, command=command_line("benchmarks/profile_step.py", argv or sys.argv[1:]),
                     results=results, extra={"command_buffers": ns.keep_command_buffers, "step": ns.step})
    return 0


def _profile_stacks(ap: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    """``--step stack``: bench_offload's stacks of checkpointed layers, per layout and policy."""
    import jax

    import bench_offload

    shapes = {"nano": bench_offload.NANO_SHAPE, "ep_share": bench_offload.EP_SHARE_SHAPE,
              "cpu": bench_offload.CPU_SHAPE}
    if ns.shape not in shapes:
        ap.error(f"--shape must be one of {sorted(shapes)} with --step stack, got {ns.shape!r}")
    if ns.layers < 1:
        ap.error(f"--layers must be >= 1, got {ns.layers}")
    names = [c for c in ns.candidates.split(",") if c]
    bad = [c for c in names if c.partition("/")[0] not in bench_offload.LAYOUTS
           or c.partition("/")[2] not in bench_offload.POLICIES]
    if bad:
        ap.error(f"--candidates: {bad} are not LAYOUT/POLICY (layouts {bench_offload.LAYOUTS}, "
                 "policies like d-o-d)")

    def make(layout, label):
        loss_for, args = bench_offload.make_stack(shapes[ns.shape], ns.layers, "mxfp8", False, ns.seed,
                                                  layout=layout, prevent_cse=ns.prevent_cse)
        return jax.jit(jax.value_and_grad(loss_for(label), argnums=(0, 1))), args

    suffix = "" if ns.prevent_cse else "/no_prevent_cse"
    runs = [(c, f"{ns.shape}/{ns.layers}L/{c}{suffix}", lambda c=c: make(*c.split("/", 1))) for c in names]
    return _measure_runs(ns, runs, {"layers": ns.layers, "prevent_cse": ns.prevent_cse})


def _profile_blocks(ap: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    """``--step block``: bench_moe_block's Flax ``MoEBlock`` step, per recipe and param dtype."""
    import jax.numpy as jnp

    import bench_moe_block

    names = [c for c in ns.candidates.split(",") if c]
    parsed = {}
    for c in names:
        parts = c.split("/")
        if (len(parts) not in (2, 3) or parts[0] not in ("bf16", "mxfp8", "fp8_block")
                or parts[1] not in ("float32", "bfloat16") or parts[2:] not in ([], ["bf16grad"])):
            ap.error(f"--candidates: {c!r} is not RECIPE/PARAM_DTYPE[/bf16grad] "
                     "(recipes bf16, mxfp8, fp8_block; param dtypes float32, bfloat16)")
        parsed[c] = (parts[0], jnp.dtype(parts[1]), jnp.bfloat16 if parts[2:] else None)
    if ns.tokens < 1:
        ap.error(f"--tokens must be >= 1, got {ns.tokens}")
    shapes = {"nano": bench_moe_block.NANO, "small": bench_moe_block.SMALL}
    if ns.shape not in shapes:
        ap.error(f"--shape must be one of {sorted(shapes)} with --step block, got {ns.shape!r}")

    def make(recipe, param_dtype, grad_dtype):
        step, args, _ = bench_moe_block.block_step(shapes[ns.shape], ns.tokens, recipe, param_dtype, grad_dtype)
        return step, args

    where = "" if ns.shape == "nano" else f"{ns.shape}/"  # (nano: the keys of profile_moe_block_h100.json)
    runs = [(c, f"moe_block/{where}{ns.tokens}tok/{c}", lambda spec=spec: make(*spec))
            for c, spec in parsed.items()]
    return _measure_runs(ns, runs, {"tokens": ns.tokens})


def _measure_runs(ns: argparse.Namespace, runs: list, extra: dict) -> int:
    """Profiles each ``(candidate, key, make)`` of ``runs`` (``make()`` -> ``(step, args)``),
    with ``--timeline`` files named after the candidate; writes ``--out``."""
    from common import command_line, write_result

    results: dict = {}
    for cname, key, make in runs:
        step, args = make()
        where = None
        if ns.timeline is not None:
            ns.timeline.mkdir(parents=True, exist_ok=True)
            where = ns.timeline / f"{cname.replace('/', '_')}.timeline.json"
        report = measure(key, step, args, ns.iters, ns.top, where)
        if report is not None:
            results[key] = report
    if ns.out is not None and results:
        write_result(ns.out, command=command_line("benchmarks/profile_step.py", ns.argv), results=results,
                     extra={"command_buffers": ns.keep_command_buffers, "step": ns.step, **extra})
    return 0


if __name__ == "__main__":
    sys.exit(main())
