"""Shapes and timing shared by the benchmarks (and by the GPU tests that want real shapes)."""

from __future__ import annotations

import json
import pathlib
import time

import jax
import numpy as np

RESULTS = pathlib.Path(__file__).resolve().parent / "results"

# The expert-MLP shapes the issues ask about: name -> (groups, rows per group, H, F).
MLP_SHAPES = {
    "moe8": (8, 8192, 4096, 4096),
    "moe32": (32, 1024, 4096, 1536),
    "nano": (128, 384, 2688, 1856),  # Nemotron-3-Nano: 8192 tokens x top-6
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


def gemm_problem(name: str, skew: float = 0.0):
    """The GEMM benchmark shape ``name`` with fresh random bf16 operands:
    ``(header, a [M, K], w [G, K, N], group_sizes)``, the header being the result's
    ``{"shape": ..., "flops": 2 M N K}``; group sizes from :func:`routed_group_sizes`
    (equal by default), ``w`` scaled by ``1/sqrt(K)``."""
    import jax.numpy as jnp

    g, rows, k, n = GEMM_SHAPES[name]
    m = g * rows
    ka, kb = jax.random.split(jax.random.key(hash(name) % 2**31))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kb, (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    sizes = routed_group_sizes(m, g, skew)
    gs = jnp.asarray(sizes)
    header = {"shape": {"G": g, "rows_per_group": rows, "M": m, "K": k, "N": n}, "flops": 2.0 * m * n * k}
    if skew:
        header["group_sizes"] = {"skew": skew, "min": int(sizes.min()), "max": int(sizes.max()),
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


def device_description() -> dict:
    d = jax.devices()[0]
    return {"platform": d.platform, "device_kind": d.device_kind, "jax": jax.__version__}


def library_commit() -> str:
    """The library's git commit: ``$JGM_COMMIT`` (set it where the tree travels without
    ``.git``, as on the device machine), else ``git rev-parse HEAD``, else "unknown"."""
    import os
    import subprocess

    if os.environ.get("JGM_COMMIT"):
        return os.environ["JGM_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=pathlib.Path(__file__).resolve().parent)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gemm_report(what: str, script: str, argv: list[str]) -> dict:
    """The header of a benchmark's JSON: what, the command, library commit, date, GPU, jax,
    host, timing."""
    import datetime
    import platform

    return {
        "what": what,
        "command": "PYTHONPATH=. python3 " + " ".join([script, *argv]),
        "commit": library_commit(),
        "date": datetime.date.today().isoformat(),
        "gpu": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "host": platform.node(),
        "timing": "median of 5 x (iters back-to-back dispatches / iters), after warm-up",
        "shapes": {},
    }


def bench_gemm_shapes(report: dict, names: str, bench, path: pathlib.Path) -> None:
    """Fills ``report["shapes"]`` with ``bench(name)`` for each comma-separated shape name,
    printing each as it comes, and writes the report to ``path``."""
    for name in names.split(","):
        report["shapes"][name] = bench(name)
        print(name, json.dumps(report["shapes"][name]), flush=True)
    write_json(report, path)


def gemm_cell(e: dict, width: int = 6) -> str:
    """A table cell of a GEMM timing row: ms and TFLOP/s."""
    return f"{e['ms']:7.3f} {e['tflops']:{width}.0f}"


def write_json(report: dict, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")


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
