"""Shapes and timing shared by the benchmarks (and by the GPU tests that want real shapes)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import time

import jax
import numpy as np

RESULTS = pathlib.Path(__file__).resolve().parent / "results"

# The expert-MLP shapes the issues ask about: name -> (groups, rows per group, H, F).
MLP_SHAPES = {
    "moe8": (8, 8192, 4096, 4096),
    "moe32": (32, 1024, 4096, 1536),
    "nano": (128, 384, 2688, 1856),  # Nemotron-3-Nano: 8192 tokens x top-6
    "ep_share": (16, 3072, 2688, 1856),  # Nano's expert-parallel local share (8-way)
    "tiny": (4, 64, 128, 128),  # a CPU smoke test of the scripts, not a measurement
}


# The grouped-GEMM shapes the issues ask about: name -> (groups, rows per group, K, N).
GEMM_SHAPES = {
    "moe8": (8, 8192, 4096, 4096),
    "moe32": (32, 1024, 4096, 1536),
    "nano_fc1": (128, 384, 2688, 1856),
    "nano_fc2": (128, 384, 1856, 2688),
}


def routed_group_sizes(m: int, g: int, skew: float, seed: int = 0) -> np.ndarray:
    """``g`` group sizes summing to ``m``: equal for ``skew == 0``, else a multinomial
    draw of ``m`` tokens over experts with probabilities ``exp(skew * N(0, 1))``
    (normalized): 0.3 is about a load-balanced router, 1.0 a poorly balanced one."""
    if skew == 0:
        sizes = np.full(g, m // g, np.int64)
        sizes[: m % g] += 1
        return sizes.astype(np.int32)
    rng = np.random.default_rng(seed)
    p = np.exp(skew * rng.standard_normal(g))
    return rng.multinomial(m, p / p.sum()).astype(np.int32)


def gemm_shape(name: str) -> tuple[int, int, int, int]:
    """``(G, rows per group, K, N)`` of a :data:`GEMM_SHAPES` name, or of a spec
    ``GxROWSxKxN`` (e.g. ``8x8192x16384x4096``: moe8 with a longer K)."""
    if name in GEMM_SHAPES:
        return GEMM_SHAPES[name]
    parts = name.split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"shape must be one of {sorted(GEMM_SHAPES)} or GxROWSxKxN, got {name!r}")
    g, rows, k, n = (int(p) for p in parts)
    return g, rows, k, n


def gemm_problem(name: str, skew: float = 0.0, alpha: float | None = None):
    """The GEMM benchmark shape ``name`` (:func:`gemm_shape`) with fresh random bf16 operands:
    ``(header, a [M, K], w [G, K, N], group_sizes)``, the header being the result's
    ``{"shape": ..., "flops": 2 M N K}``; group sizes from :func:`routed_group_sizes`
    (equal by default), or, with ``alpha``, as a router makes them
    (``shapes.router_group_sizes``, Dirichlet(alpha); ``inf``: equal); ``w`` scaled by
    ``1/sqrt(K)``."""
    import jax.numpy as jnp

    from shapes import router_group_sizes

    g, rows, k, n = gemm_shape(name)
    m = g * rows
    ka, kb = jax.random.split(jax.random.key(hash(name) % 2**31))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kb, (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    sizes = routed_group_sizes(m, g, skew) if alpha is None else router_group_sizes(m, g, alpha)
    gs = jnp.asarray(sizes)
    header = {"shape": {"G": g, "rows_per_group": rows, "M": m, "K": k, "N": n}, "flops": 2.0 * m * n * k}
    if skew or alpha is not None:
        header["group_sizes"] = {"skew": skew, "alpha": alpha, "min": int(sizes.min()), "max": int(sizes.max()),
                                 "std": float(sizes.std())}
    return header, a, w, gs


def gemm_entry(seconds: float, flops: float) -> dict:
    """A timing row of the GEMM benchmarks: ms and TFLOP/s."""
    return {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12}


def time_call(fn, *args, iters: int, warmup: int = 2, samples: int = 5) -> float:
    """Seconds per call: back-to-back async dispatches, one sync at the end (median of ``samples``)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        res = None
        for _ in range(iters):
            res = fn(*args)
        jax.block_until_ready(res)
        out.append((time.perf_counter() - t0) / iters)
    return float(np.median(out))


def require_kernels() -> None:
    """Stops a benchmark of the op on a GPU where this process has no CUDA extension
    (not built, or not carried to the device machine): every op would run its pure-JAX
    reference and be timed under the op's name (session 39 timed 44 ms weight gradients,
    1 ms with the kernels, that way). ``JGM_BENCH_ALLOW_REFERENCE=1`` runs it anyway."""
    if os.environ.get("JGM_BENCH_ALLOW_REFERENCE") == "1" or jax.default_backend() != "gpu":
        return
    from jax_grouped_mlp._src.cuda import ffi

    if not ffi.available():
        raise SystemExit(
            "benchmark refused: a GPU is present but jax_grouped_mlp has no CUDA extension in this process, so "
            "it would time the pure-JAX reference under the op's name. Build it (`make kernels`) or carry "
            "jax_grouped_mlp/_kernels.*.so to the device; JGM_BENCH_ALLOW_REFERENCE=1 runs it anyway.")


def device_description() -> dict:
    d = jax.devices()[0]
    return {"platform": d.platform, "device_kind": d.device_kind, "jax": jax.__version__}


def library_commit(cwd: pathlib.Path | None = None) -> str | None:
    """The library's git commit: ``$JGM_COMMIT`` (set it where the tree travels without
    ``.git``, as on the device machine), else ``git rev-parse HEAD`` with ``-dirty``
    appended when tracked files differ from it, and then the git tree id of the tracked
    files as they are (``-dirty tree <id>``), else None.

    The tree id names the code that ran even where ``.git`` lags the files (the device
    machine's copy has read an older HEAD than the tree it was sent): the commit whose
    tree it is, ``git log --all --format='%H %T' | grep <id>``, is the code measured."""
    import subprocess

    if os.environ.get("JGM_COMMIT"):
        return os.environ["JGM_COMMIT"]
    here = cwd or pathlib.Path(__file__).resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=here)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode:
            return None
        commit = head.stdout.strip()
        if git("diff", "--quiet", "HEAD", "--").returncode != 1:
            return commit
        # A commit object of the tracked files as they are (no ref moves; objects only).
        stash = git("-c", "user.name=library_commit", "-c", "user.email=none", "stash", "create").stdout.strip()
        tree = git("rev-parse", f"{stash}^{{tree}}").stdout.strip() if stash else ""
    except OSError:
        return None
    return f"{commit}-dirty" + (f" tree {tree}" if tree else "")


# Every JSON under benchmarks/results is one of these (tests/test_bench_results.py checks
# it); ``write_result`` is the one writer. The measurements go under "rows" (a list) or
# "results" (a dict), anything else a script records (shape, timing, notes) beside them.
RESULT_SCHEMA = 1
RESULT_KEYS = ("schema", "command", "library_commit", "device", "date", "jax_version")
RESULT_DATA_KEYS = ("rows", "results")


def command_line(script: str, argv: list[str]) -> str:
    """The command that reproduces a run, from the repository root: ``PYTHONPATH=. python3 script argv``."""
    import shlex

    return "PYTHONPATH=. python3 " + shlex.join([script, *argv])


def check_result(data: object) -> list[str]:
    """What is wrong with ``data`` as a results file (empty when it follows the schema)."""
    if not isinstance(data, dict):
        return [f"a results file is a JSON object, got {type(data).__name__}"]
    errors = [f"missing key {k!r}" for k in RESULT_KEYS if k not in data]
    if data.get("schema") != RESULT_SCHEMA:
        errors.append(f"schema must be {RESULT_SCHEMA}, got schema={data.get('schema')!r}")
    if not isinstance(data.get("command"), str) or not data.get("command"):
        errors.append(f"command must be a non-empty string, got command={data.get('command')!r}")
    for key in ("library_commit", "device", "date", "jax_version"):
        if key in data and not (data[key] is None or (isinstance(data[key], str) and data[key])):
            errors.append(f"{key} must be a non-empty string or null, got {key}={data[key]!r}")
    date = data.get("date")
    if isinstance(date, str) and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
        errors.append(f"date must be YYYY-MM-DD, got date={date!r}")
    present = [k for k in RESULT_DATA_KEYS if k in data]
    if len(present) != 1:
        errors.append(f"exactly one of {RESULT_DATA_KEYS} must be present, got {present}")
    elif present == ["rows"] and not isinstance(data["rows"], list):
        errors.append(f"rows must be a list, got rows={type(data['rows']).__name__}")
    elif present == ["results"] and not isinstance(data["results"], dict):
        errors.append(f"results must be a dict, got results={type(data['results']).__name__}")
    return errors


def write_result(path: pathlib.Path | str, *, command: str, rows: list | None = None, results: dict | None = None,
                 extra: dict | None = None, device: str | None = None) -> dict:
    """Writes one benchmark result to ``path`` (JSON) in the results schema and returns it.

    ``{"schema": 1, "command", "library_commit", "device", "date", "jax_version"}``, then
    ``rows`` (a list) or ``results`` (a dict), exactly one of them, then ``extra``'s keys.
    ``device`` defaults to ``jax.devices()[0].device_kind``; pass it when this process
    must not start a backend of its own (a parent of per-policy worker processes).
    """
    import datetime

    if (rows is None) == (results is None):
        raise ValueError(f"pass exactly one of rows and results, got rows={rows!r}, results={results!r}")
    extra = dict(extra or {})
    clash = sorted(set(extra) & {*RESULT_KEYS, *RESULT_DATA_KEYS})
    if clash:
        raise ValueError(f"extra must not set the schema's keys, got extra keys {clash}")
    data = {
        "schema": RESULT_SCHEMA,
        "command": command,
        "library_commit": library_commit(),
        "device": jax.devices()[0].device_kind if device is None else device,
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "jax_version": jax.__version__,
    }
    data.update({"rows": rows} if rows is not None else {"results": results})
    data.update(extra)
    errors = check_result(data)
    if errors:
        raise ValueError(f"not a valid result for {path}: {'; '.join(errors)}")
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")
    return data


def gemm_report(what: str, script: str, argv: list[str]) -> dict:
    """The in-memory report of a GEMM benchmark: what, the command, timing, and
    ``shapes`` to fill; :func:`write_report` writes it."""
    return {
        "what": what,
        "command": command_line(script, argv),
        "timing": "median of 5 x (iters back-to-back dispatches / iters), after warm-up",
        "shapes": {},
    }


def write_report(report: dict, path: pathlib.Path, data_key: str = "shapes") -> dict:
    """Writes a :func:`gemm_report`-style report through :func:`write_result`:
    ``report[data_key]`` becomes ``results``, the other keys (``command`` aside) extras."""
    extra = {k: v for k, v in report.items() if k not in ("command", data_key)}
    return write_result(path, command=report["command"], results=report[data_key], extra=extra)


def bench_gemm_shapes(report: dict, names: str, bench, path: pathlib.Path) -> None:
    """Fills ``report["shapes"]`` with ``bench(name)`` for each comma-separated shape name,
    printing each as it comes, and writes the report to ``path``."""
    for name in names.split(","):
        report["shapes"][name] = bench(name)
        print(name, json.dumps(report["shapes"][name]), flush=True)
    write_report(report, path)


def gemm_cell(e: dict, width: int = 6) -> str:
    """A table cell of a GEMM timing row: ms and TFLOP/s."""
    return f"{e['ms']:7.3f} {e['tflops']:{width}.0f}"


def bar_plot(shapes: dict, metric: str, ylabel: str, title: str, path: pathlib.Path, *,
             log: bool = False, figsize=(9, 4)) -> None:
    """Grouped bars: one group per shape, one bar per candidate that reported ``metric``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(shapes)
    series = sorted({k for s in shapes.values() for k, v in s.items() if isinstance(v, dict) and metric in v})
    fig, ax = plt.subplots(figsize=figsize)
    width = 0.8 / max(len(series), 1)
    for i, sname in enumerate(series):
        vals = [shapes[n].get(sname, {}).get(metric, np.nan) for n in names]
        ax.bar(np.arange(len(names)) + i * width, vals, width, label=sname)
    ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def round_order(jobs: list, r: int) -> list:
    """The order of round ``r``'s timings: ``jobs`` as listed in even rounds, reversed in odd
    ones. On the H200 a step's place in the round moved it by up to ~0.3 ms (the one timed
    right after another program ran slower: docs/notes/2026-12-04-fp8-block-fc1-epilogue.md),
    so a fixed order biased every ratio between candidates; alternating it cancels that
    over an even number of rounds."""
    return list(reversed(jobs)) if r % 2 else list(jobs)
