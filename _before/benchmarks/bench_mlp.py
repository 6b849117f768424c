"""Full expert-MLP training step (forward + backward): grouped_mlp against the ragged_dot MLP.

    PYTHONPATH=. python3 benchmarks/bench_mlp.py [--shapes moe8,moe32,nano] [--alphas inf,1,0.3] [--out FILE] [--plot]

Same process, same inputs. For each shape: ``grouped_mlp`` with recipes mxfp8, bf16
and fp8_block (whatever kernels the extension provides on this device; the pure-JAX
path elsewhere), the op's alternatives (mxfp8 with weight-quantizing passes;
``grouped_mlp_fp8_block_bf16_wgrad``: fp8_block with the bf16 weight-gradient kernel
instead of its default FP8 one) and a bf16 MLP built from ``jax.lax.ragged_dot``; tokamax's ragged_dot too when
it is importable (``--only`` picks candidates by name). ``grouped_mlp_mxfp8_qw_one_tile`` is
the mxfp8 op traced with ``JGM_QW_MIXED_TILES=0`` (its ``_qw`` GEMMs choose one token tile,
never the mixed tiles), and ``--qw-table`` adds ``grouped_mlp_mxfp8_qw_table``, the op
traced with another cost table for that choice: both A/B the choice in one process,
where separate processes drift by ~2 %. Reports ms per step, TFLOP/s (six GEMMs of 2·M·H·F per
step: two forward, two dgrad, two wgrad), the compiled program's temp memory, and
speedups against ragged_dot. Each shape runs with equal group sizes and with the
router-like skews of ``--alphas`` (``shapes.router_group_sizes``: Dirichlet(alpha)
expert loads), reported side by side with each candidate's slowdown against its own
equal-sizes step; with ``--rounds R`` in interleaved rounds, and ``--size-seeds`` adds
more router draws of each skew. Writes JSON (and a PNG with --plot).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_grouped_mlp as jgm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import (  # noqa: E402
    MLP_SHAPES, RESULTS, bar_plot, command_line, device_description, require_kernels, round_order, time_call,
    write_result,
)
from shapes import ALPHAS, router_group_sizes, skew_label  # noqa: E402


def ragged_dot_mlp(x, w1, w2, gs, probs):
    h = jax.lax.ragged_dot(x, w1, gs, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    r = jnp.maximum(h.astype(jnp.float32), 0)
    a = (probs[:, None] * r * r).astype(jnp.bfloat16)
    return jax.lax.ragged_dot(a, w2, gs, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _step(mlp):
    def loss(x, w1, w2, gs, probs, dy):
        return jnp.sum(mlp(x, w1, w2, gs, probs).astype(jnp.float32) * dy.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 4)))


def _weight_passes(**kw):
    """The MXFP8 op with ``KernelChoices(quantize_weights_in_gemm=False)``: a fake-quantize
    pass per weight use before the bf16 GEMMs (and the fused FC1 / FC2-dgrad epilogue
    kernels), the op as it was before the in-register weight quantization."""
    from jax_grouped_mlp._src.op.heuristics import KernelChoices
    from jax_grouped_mlp._src.op.mlp import grouped_mlp_with

    choices = KernelChoices(quantize_weights_in_gemm=False)
    return lambda *a: grouped_mlp_with(choices, *a, recipe="mxfp8", **kw)


def _fp8_block_bf16_wgrad(*a):
    """``fp8_block`` with ``KernelChoices(fp8_block_wgrad=False)``: the weight gradients on
    the bf16 kernel over the dequantized operands (the FP8 kernel is the default:
    docs/notes/2026-12-04-fp8-layout-passes.md)."""
    from jax_grouped_mlp._src.op.heuristics import KernelChoices
    from jax_grouped_mlp._src.op.mlp import grouped_mlp_with

    return grouped_mlp_with(KernelChoices(fp8_block_wgrad=False), *a, recipe="fp8_block")


# --qw-table's cost table for the `_qw` GEMM's device-side choice: ({tile: (full, half)},
# launch cost), or None (no grouped_mlp_mxfp8_qw_table candidate).
QW_TABLE: tuple[dict[int, tuple[float, float]], float] | None = None
QW_VARIANTS = ("grouped_mlp_mxfp8_qw_one_tile", "grouped_mlp_mxfp8_qw_table")


def parse_qw_table(text: str) -> tuple[dict[int, tuple[float, float]], float]:
    """``--qw-table``: ``TILE:FULL/HALF,...,launch:COST`` (every tile of
    ``heuristics.QW_TILE_COSTS``, e.g. ``192:0.44/0.41,256:0.5/0.44,384:0.77/0.55,launch:3.8``)."""
    from jax_grouped_mlp._src.op import heuristics

    table, launch = {}, None
    try:
        for item in text.split(","):
            key, value = item.split(":")
            if key.strip() == "launch":
                launch = float(value)
            else:
                full, half = value.split("/")
                table[int(key)] = (float(full), float(half))
    except ValueError:
        raise SystemExit(f"--qw-table takes TILE:FULL/HALF,...,launch:COST, got {text!r}") from None
    if launch is None or sorted(table) != sorted(heuristics.QW_TILE_COSTS):
        raise SystemExit(f"--qw-table must price the tiles {sorted(heuristics.QW_TILE_COSTS)} and the launch, got {text!r}")
    return table, launch


@contextlib.contextmanager
def tracing(cname: str):
    """What candidate ``cname`` changes while its step is traced (the `_qw` choice is
    computed by the traced program, from what it reads then): one tile only, or
    :data:`QW_TABLE`. Restored afterwards."""
    from jax_grouped_mlp._src.op import heuristics

    if cname == "grouped_mlp_mxfp8_qw_one_tile":
        old = os.environ.get("JGM_QW_MIXED_TILES")
        os.environ["JGM_QW_MIXED_TILES"] = "0"
        try:
            yield
        finally:
            os.environ.pop("JGM_QW_MIXED_TILES") if old is None else os.environ.update(JGM_QW_MIXED_TILES=old)
    elif cname == "grouped_mlp_mxfp8_qw_table":
        old = heuristics.QW_TILE_COSTS, heuristics.QW_MIXED_LAUNCH_COST
        heuristics.QW_TILE_COSTS, heuristics.QW_MIXED_LAUNCH_COST = QW_TABLE
        try:
            yield
        finally:
            heuristics.QW_TILE_COSTS, heuristics.QW_MIXED_LAUNCH_COST = old
    else:
        yield


def _candidates() -> dict:
    mxfp8 = lambda *a: jgm.grouped_mlp(*a, recipe="mxfp8")  # noqa: E731
    c = {
        "grouped_mlp_mxfp8": mxfp8,
        "grouped_mlp_mxfp8_qw_one_tile": mxfp8,  # (traced under tracing(): one `_qw` tile)
        "grouped_mlp_mxfp8_weight_passes": _weight_passes(),
        "grouped_mlp_mxfp8_weight_passes_unfused_fc1": _weight_passes(fuse_fc1_epilogue=False),
        "grouped_mlp_bf16": lambda *a: jgm.grouped_mlp(*a, recipe="bf16"),
        "grouped_mlp_fp8_block": lambda *a: jgm.grouped_mlp(*a, recipe="fp8_block"),
        "grouped_mlp_fp8_block_unfused_fc1": lambda *a: jgm.grouped_mlp(*a, recipe="fp8_block", fuse_fc1_epilogue=False),
        "grouped_mlp_fp8_block_bf16_wgrad": _fp8_block_bf16_wgrad,
        "ragged_dot_bf16": ragged_dot_mlp,
    }
    if QW_TABLE is not None:
        c["grouped_mlp_mxfp8_qw_table"] = mxfp8  # (traced under tracing(): --qw-table's costs)
    try:  # optional peer
        import tokamax

        def tok(x, w1, w2, gs, probs):
            h = tokamax.ragged_dot(x, w1, gs)
            r = jnp.maximum(h.astype(jnp.float32), 0)
            return tokamax.ragged_dot((probs[:, None] * r * r).astype(jnp.bfloat16), w2, gs)

        c["tokamax_bf16"] = tok
    except ImportError:
        pass
    return c


def step_inputs(name: str, seed: int, alpha: float = float("inf")) -> tuple[tuple, np.ndarray]:
    """The step's operands ``(x, w1, w2, group_sizes, probs, dy)`` at shape ``name`` (bf16
    N(0, 1) data, weights scaled by 1/sqrt(fan-in)), group sizes drawn by
    ``router_group_sizes(alpha)``; and those sizes as a host array."""
    g, rows, h, f = MLP_SHAPES[name]
    m = g * rows
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((g, h, f)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((g, f, h)) / np.sqrt(f), jnp.bfloat16)
    probs = jnp.asarray(rng.uniform(0.1, 1, m), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    sizes = router_group_sizes(m, g, alpha, seed)
    return (x, w1, w2, jnp.asarray(sizes), probs, dy), sizes


def compile_shape(name: str, seed: int, only: tuple[str, ...] = (), alpha: float = float("inf")):
    """The result header of shape ``name`` at skew ``alpha``, and per candidate either
    ``(compiled step, args)`` or an error string (OOM and unsupported shapes are results too)."""
    g, rows, h, f = MLP_SHAPES[name]
    args, sizes = step_inputs(name, seed, alpha)
    header = {"groups": g, "rows_per_group": rows, "hidden": h, "ffn": f, "flops_per_step": 6 * 2 * g * rows * h * f,
              "skew": skew_label(alpha), "group_sizes": {"min": int(sizes.min()), "max": int(sizes.max())}}
    jobs: dict = {}
    for cname, mlp in _candidates().items():
        if (only and cname not in only) or (cname in QW_VARIANTS and cname not in only):
            continue  # (the _qw A/B candidates run only where --only names them)
        try:
            with tracing(cname):
                jobs[cname] = (_step(mlp).lower(*args).compile(), args)
        except Exception as err:  # noqa: BLE001
            jobs[cname] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return header, jobs


def _entry(compiled, seconds: float, flops: float) -> dict:
    mem = compiled.memory_analysis()
    return {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12,
            "temp_bytes": getattr(mem, "temp_size_in_bytes", None) if mem is not None else None}


def bench_shape(name: str, iters: int, seed: int, only: tuple[str, ...] = (), alpha: float = float("inf")) -> dict:
    """Every candidate's step at shape ``name`` and skew ``alpha``, timed one after another."""
    res, jobs = compile_shape(name, seed, only, alpha)
    for cname, job in jobs.items():
        try:
            if isinstance(job, str):
                raise RuntimeError(job)
            compiled, args = job
            res[cname] = _entry(compiled, time_call(compiled, *args, iters=iters, warmup=1, samples=3),
                                res["flops_per_step"])
        except Exception as err:  # noqa: BLE001 - OOM and unsupported shapes are results too
            res[cname] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
        print(name, cname, res[cname], flush=True)
    base = res.get("ragged_dot_bf16", {}).get("ms")
    for cname in _candidates():
        if base and "ms" in res.get(cname, {}):
            res[cname]["speedup_vs_ragged_dot"] = base / res[cname]["ms"]
    return res


def skew_key(name: str, alpha: float, size_seed: int | None = None) -> str:
    """A result's key: the shape, its skew, and the draw of the sizes where it is not the
    run's ``--seed`` (``nano``, ``nano@alpha=1``, ``nano@alpha=1,sizes=3``)."""
    key = name if alpha == float("inf") else f"{name}@{skew_label(alpha)}"
    return key if size_seed is None else f"{key},sizes={size_seed}"


def bench_skews_interleaved(name: str, iters: int, seed: int, only: tuple[str, ...], alphas: list[float],
                            rounds: int, size_seeds: tuple[int, ...] = ()) -> dict:
    """Skewed steps against the equal-sizes step, measured in ``rounds`` interleaved rounds
    (every candidate at every skew once per round, after compiling all of them, in the
    order of :func:`round_order`), so that clock drift on a shared machine hits both sides
    of a ratio alike. One more round first, not kept: without it the first case's first
    round ran 2-3x slow on an H100 (16-23 ms against 7.3 for the mxfp8 Nano step,
    2026-12-07), which with two rounds moved its median and every ratio. Each entry's ``ms``
    is the median over rounds; a skewed entry's ``vs_uniform`` is the median of the
    per-round ratios and ``vs_uniform_rounds`` lists them.

    Each candidate is compiled once: the group sizes are an operand, so every skew runs
    the same executable. ``size_seeds``: more router draws per skewed alpha (the sizes'
    seed; the data stays ``seed``'s), keyed ``...,sizes=K``: one draw of Dirichlet(1) at
    the Nano shape ranges from a benign to a hard case for the static tile orders (skew
    notes, "Session 39"). The first draw's entry then also gets ``vs_uniform_draws``:
    the mean, min and max of every draw's ``vs_uniform``."""
    g, rows, _, _ = MLP_SHAPES[name]
    header0, jobs0 = compile_shape(name, seed, only, float("inf"))
    keyed = {}
    for alpha in alphas:
        draws = [seed] if alpha == float("inf") else [seed, *(s for s in size_seeds if s != seed)]
        for draw in draws:
            sizes = router_group_sizes(g * rows, g, alpha, draw)
            header = dict(header0, skew=skew_label(alpha), group_sizes={"min": int(sizes.min()), "max": int(sizes.max())})
            if draw != seed:
                header["sizes_seed"] = draw
            jobs = {c: j if isinstance(j, str) else (j[0], (*j[1][:3], jnp.asarray(sizes), *j[1][4:]))
                    for c, j in jobs0.items()}
            keyed[skew_key(name, alpha, None if draw == seed else draw)] = (alpha, header, jobs)
    times: dict = {(k, c): [] for k, (_, _, jobs) in keyed.items() for c, j in jobs.items() if not isinstance(j, str)}
    for r in range(-1, rounds):  # round -1 warms up and is not kept (see the docstring)
        for key, cname in round_order(list(times), max(r, 0)):
            if (key, cname) not in times:  # (failed in an earlier round)
                continue
            out = times[key, cname]
            compiled, args = keyed[key][2][cname]
            try:
                t = time_call(compiled, *args, iters=iters, warmup=1, samples=1)
                if r >= 0:
                    out.append(t)
            except Exception as err:  # noqa: BLE001 - an OOM at run time is a result too
                keyed[key][2][cname] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                del times[key, cname]
    report = {}
    for key, (alpha, header, jobs) in keyed.items():
        res = report[key] = header
        for cname, job in jobs.items():
            if isinstance(job, str):
                res[cname] = {"error": job}
                continue
            res[cname] = _entry(job[0], float(np.median(times[key, cname])), header["flops_per_step"])
            res[cname]["rounds_ms"] = [t * 1e3 for t in times[key, cname]]
            if alpha != float("inf") and (name, cname) in times:
                ratios = [t / u for t, u in zip(times[key, cname], times[name, cname])]
                res[cname]["vs_uniform"] = float(np.median(ratios))
                res[cname]["vs_uniform_rounds"] = ratios
            print(key, cname, {k: v for k, v in res[cname].items() if "rounds" not in k}, flush=True)
    _summarize_draws(report, name, alphas, seed, size_seeds)
    return report


def _summarize_draws(report: dict, name: str, alphas: list[float], seed: int, size_seeds: tuple[int, ...]) -> None:
    """Adds ``vs_uniform_draws`` (mean, min, max over the draws) to each skewed alpha's
    first entry where more than one draw of its sizes ran, and prints it."""
    for alpha in alphas:
        if alpha == float("inf"):
            continue
        keys = [skew_key(name, alpha)] + [skew_key(name, alpha, s) for s in size_seeds if s != seed]
        if len(keys) < 2:
            continue
        for cname, entry in report[keys[0]].items():
            if not isinstance(entry, dict) or "vs_uniform" not in entry:
                continue
            ratios = [report[k][cname]["vs_uniform"] for k in keys if "vs_uniform" in report[k].get(cname, {})]
            entry["vs_uniform_draws"] = {"mean": float(np.mean(ratios)), "min": float(min(ratios)),
                                         "max": float(max(ratios)), "draws": len(ratios)}
            print(f"{keys[0]} {cname} over {len(ratios)} draws of the sizes: vs_uniform mean "
                  f"{np.mean(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})", flush=True)


def _plot(report: dict, path: pathlib.Path) -> None:
    title = f"expert MLP fwd+bwd step, {report['device']['device_kind']}"
    bar_plot(report["shapes"], "ms", "ms per step (log)", title, path, log=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="moe8,moe32,nano")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "mlp_step.json")
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated candidate names (default: all)")
    ap.add_argument("--alphas", default=",".join(str(a) for a in ALPHAS),
                    help="group-size skews to run each shape at: inf (equal sizes) and Dirichlet alphas")
    ap.add_argument("--rounds", type=int, default=1,
                    help="above 1: time every skew of a shape in this many interleaved rounds, the order "
                         "reversed every other round (use an even number; medians; "
                         "the skew ratios per round), with the equal sizes first in --alphas")
    ap.add_argument("--size-seeds", default="",
                    help="with --rounds: more router draws of each skewed alpha's group sizes (comma-separated "
                         "seeds; --seed's draw always runs), timed in the same rounds, with the mean, min and max "
                         "of their vs_uniform")
    ap.add_argument("--qw-table", default="",
                    help="adds grouped_mlp_mxfp8_qw_table: the mxfp8 op with this cost table for its _qw "
                         "GEMMs' tile choice (TILE:FULL/HALF,...,launch:COST)")
    ns = ap.parse_args(argv)
    global QW_TABLE
    QW_TABLE = parse_qw_table(ns.qw_table) if ns.qw_table else None
    require_kernels()  # (no timing of the pure-JAX fallback under our name)
    alphas = [float(a) for a in ns.alphas.split(",") if a]
    only = tuple(c for c in ns.only.split(",") if c)
    try:
        size_seeds = tuple(dict.fromkeys(int(v) for v in ns.size_seeds.split(",") if v.strip()))  # (once each)
    except ValueError:
        ap.error(f"--size-seeds takes comma-separated integers, got {ns.size_seeds!r}")
    if size_seeds and ns.rounds < 2:
        ap.error("--size-seeds needs --rounds 2 or more (the draws are timed in interleaved rounds)")
    # (tokamax_bf16 is a candidate only where tokamax is installed; asked for elsewhere, it is skipped.)
    unknown = sorted(set(only) - set(_candidates()) - {"tokamax_bf16"})
    if unknown:
        ap.error(f"--only: unknown candidates {unknown}; known: {sorted(_candidates())}")
    report = {"command": command_line("benchmarks/bench_mlp.py", argv or sys.argv[1:]),
              "device": device_description(), "shapes": {}}
    for name in ns.shapes.split(","):
        if ns.rounds > 1:
            report["shapes"].update(bench_skews_interleaved(name, ns.iters, ns.seed, only, alphas, ns.rounds,
                                                            size_seeds))
            continue
        uniform = None
        for alpha in alphas:
            res = report["shapes"][skew_key(name, alpha)] = bench_shape(name, ns.iters, ns.seed, only, alpha)
            if alpha == float("inf"):
                uniform = res
            elif uniform is not None:  # the issue-20 ratio: skewed step / equal-sizes step
                for c, e in res.items():
                    if isinstance(e, dict) and "ms" in e and "ms" in uniform.get(c, {}):
                        e["vs_uniform"] = e["ms"] / uniform[c]["ms"]
    write_result(ns.out, command=report["command"], results=report["shapes"])
    if ns.plot:
        _plot(report, ns.out.with_suffix(".png"))
    # Only the candidates that ran (--only); "error" for one that ran and failed.
    ran = [c for c in _candidates() if any(c in r for r in report["shapes"].values())]
    print(f"{'shape':8s} " + " ".join(f"{c:>22s}" for c in ran))
    for name, r in report["shapes"].items():
        cells = []
        for c in ran:
            e = r.get(c, {})
            cells.append(f"{e['ms']:9.2f} ms {e['tflops']:6.1f} TF" if "ms" in e else f"{'error' if e else '-':>22s}")
        print(f"{name:8s} " + " ".join(f"{c:>22s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
