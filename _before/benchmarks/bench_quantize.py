"""The quantize and dequantize passes of a step, each timed alone, as a share of HBM bandwidth.

    PYTHONPATH=. python3 benchmarks/bench_quantize.py [--shapes moe32,nano] [--alpha inf]
        [--rounds 3] [--iters 20] [--out FILE] [--plot]

For each shape of ``common.MLP_SHAPES`` (``G`` experts, ``M`` rows, ``H -> F``) it times,
one process, interleaved rounds (the machine drifts), on the same random bf16 operands:

  fp8_block x pair        ``quantize_pair_cuda(x [M, H], keep_col=True)``: rowwise +
                          group-aware FP8 copies (what the forward does to x; srelu's
                          output ``a [M, F]`` is the same pass, row "a pair")
  fp8_block dy pair_tm    ``quantize_pair_token_major_cuda(dy [M, H])``: rowwise FP8 + the
                          group-aware copy written token-major (the FP8 weight gradient's
                          layout): what the backward does to dy (dh [M, F] likewise)
  fp8_block dy pair_bf16  ``quantize_pair_cuda(dy [M, H], keep_col=False)``: rowwise FP8 +
                          the group-aware copy's bf16 values (dy and dh with the bf16
                          weight gradient, ``KernelChoices(fp8_block_wgrad=False)``)
  fp8_block w1 tile       ``quantize_weight_cuda(w1 [G, H, F])``: 128 x 128 tiles
  fp8_block w1 tile_t     the same tiles written transposed ``[G, F, H]`` by the kernel
                          (``k_major=True``: the copy the forward GEMM reads)
  ... tile+transpose      the tiles, then ``transpose_tiles`` by XLA (what the forward
                          ran before ``k_major``; its bytes column counts the kernel's
                          alone, so its GB/s is what the pair delivers)
  fp8_block x col token-major  ``gemm_ffi.token_major_blocks_cuda`` of x's group-aware FP8
                          copy: the FP8 weight gradient's operand layout (whole 128-token
                          blocks, token-major) and its float32 scales
  mxfp8 x col dequantize  ``dequantize_grouped_mxfp8_cuda`` of x's group-aware MXFP8 copy
                          (what the mxfp8 step does to its kept residuals)
  pure-JAX x pair         the same two quantizations as XLA fusions (the reference path,
                          a peer: what the op would run without the kernels)
  XLA copy x              ``x * 2`` on x (reads and writes 2 M H bytes): the bandwidth the
                          same process reaches with a plain XLA elementwise pass

Each row: ms, the bytes it must move (every input read once, every output written once;
scales included), GB/s, and that as a share of the XLA copy's GB/s. A pass at 1.0 is
bandwidth bound; the gap below it is what a better kernel could win. Group sizes are
equal (``--alpha inf``) or a Dirichlet router draw (``shapes.router_group_sizes``).
Writes JSON (``results/quantize_<device>.json`` unless ``--out``); ``--plot`` draws the
bandwidth shares next to it.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src.cuda import ffi, fp8_block_ffi, gemm_ffi
from jax_grouped_mlp._src.formats import fp8_block, mxfp8

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import MLP_SHAPES, RESULTS, command_line, time_call, write_result  # noqa: E402
from shapes import router_group_sizes, skew_label  # noqa: E402


def _parts(g: int, rows: int, h: int, f: int, alpha: float, seed: int) -> dict:
    """name -> (jitted fn, args, bytes moved) for one shape."""
    m = g * rows
    kx, ka, kw = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, h), jnp.bfloat16)
    a = jax.random.normal(ka, (m, f), jnp.bfloat16)
    w1 = (jax.random.normal(kw, (g, h, f), jnp.float32) / math.sqrt(h)).astype(jnp.bfloat16)
    sizes = np.full(g, rows, np.int32) if math.isinf(alpha) else router_group_sizes(m, g, alpha, seed)
    gs = jnp.asarray(sizes, jnp.int32)
    nb = fp8_block.grouped_scale_rows(m, g)
    nb_mx = mxfp8.grouped_scale_rows(m, g)

    def pair_bytes(k: int, keep_col: bool, token_major: bool = False) -> int:
        kb = -(-k // fp8_block.BLOCK)
        col = 128 * nb * k if token_major else (m * k if keep_col else 2 * m * k)
        return 2 * m * k + m * k + m * kb + col + nb * k

    pair_tm = jax.jit(fp8_block_ffi.quantize_pair_token_major_cuda)
    pair = jax.jit(fp8_block_ffi.quantize_pair_cuda, static_argnames="keep_col")
    x_col = pair(x, gs, keep_col=True)[1]
    x_mx = jax.jit(mxfp8.quantize_mxfp8_grouped)(x, gs)
    ref_pair = jax.jit(
        lambda x, gs: (fp8_block.quantize_fp8_block(x, 1), fp8_block.quantize_fp8_block(x, 0, group_sizes=gs))
    )
    return {
        "fp8_block x pair": (lambda x, gs: pair(x, gs, keep_col=True), (x, gs), pair_bytes(h, True)),
        "fp8_block a pair": (lambda a, gs: pair(a, gs, keep_col=True), (a, gs), pair_bytes(f, True)),
        "fp8_block dy pair_tm": (pair_tm, (x, gs), pair_bytes(h, True, token_major=True)),
        "fp8_block dh pair_tm": (pair_tm, (a, gs), pair_bytes(f, True, token_major=True)),
        "fp8_block dy pair_bf16": (lambda x, gs: pair(x, gs, keep_col=False), (x, gs), pair_bytes(h, False)),
        "fp8_block dh pair_bf16": (lambda a, gs: pair(a, gs, keep_col=False), (a, gs), pair_bytes(f, False)),
        "fp8_block w1 tile": (
            jax.jit(fp8_block_ffi.quantize_weight_cuda), (w1,),
            3 * g * h * f + g * (-(-h // 128)) * (-(-f // 128)),
        ),
        "fp8_block w1 tile_t": (
            jax.jit(lambda w: fp8_block_ffi.quantize_weight_cuda(w, k_major=True)), (w1,),
            3 * g * h * f + g * (-(-h // 128)) * (-(-f // 128)),
        ),
        "fp8_block w1 tile+transpose": (
            jax.jit(lambda w: fp8_block.transpose_tiles(fp8_block_ffi.quantize_weight_cuda(w))), (w1,),
            3 * g * h * f + g * (-(-h // 128)) * (-(-f // 128)),
        ),
        "fp8_block x col token-major": (
            jax.jit(gemm_ffi.token_major_blocks_cuda), (x_col,), m * h + 128 * nb * h + nb * h + 4 * nb * h,
        ),
        "mxfp8 x col dequantize": (jax.jit(ffi.dequantize_grouped_mxfp8_cuda), (x_mx,), m * h + nb_mx * h + 2 * m * h),
        "pure-JAX x pair": (ref_pair, (x, gs), pair_bytes(h, True)),
        "XLA copy x": (jax.jit(lambda x: x * 2), (x,), 4 * m * h),
    }


def bench(name: str, alpha: float, rounds: int, iters: int, seed: int) -> dict:
    g, rows, h, f = MLP_SHAPES[name]
    parts = _parts(g, rows, h, f, alpha, seed)
    times: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(max(rounds, 1)):
        for k, (fn, args, _) in parts.items():
            times[k].append(time_call(fn, *args, iters=iters))
    out = {}
    for k, (_, _, nbytes) in parts.items():
        s = float(np.median(times[k]))
        out[k] = {"ms": s * 1e3, "gbytes": nbytes / 1e9, "gb_per_s": nbytes / s / 1e9, "ms_rounds": [t * 1e3 for t in times[k]]}
    copy = out["XLA copy x"]["gb_per_s"]
    for v in out.values():
        v["vs_copy_bandwidth"] = v["gb_per_s"] / copy
    return out


def plot(results: dict, path: pathlib.Path) -> None:
    """Bars: each part's GB/s as a share of the XLA copy's, per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    parts = [p for p in next(iter(results.values())) if p != "XLA copy x"]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(parts)
    for i, p in enumerate(parts):
        ax.bar(np.arange(len(labels)) + i * width, [results[s][p]["vs_copy_bandwidth"] for s in labels], width, label=p)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels)
    ax.set_ylabel("GB/s / XLA copy's GB/s")
    ax.set_title(f"quantize passes, {jax.devices()[0].device_kind}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="moe32,nano")
    ap.add_argument("--alpha", default="inf", help="group sizes: inf (equal) or Dirichlet alphas, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ap.add_argument("--plot", action="store_true")
    ns = ap.parse_args(argv)
    unknown = [s for s in ns.shapes.split(",") if s not in MLP_SHAPES]
    if unknown:
        ap.error(f"--shapes must name shapes of {sorted(MLP_SHAPES)}, got {unknown}")
    if jax.devices()[0].platform != "gpu" or not (ffi.available() and fp8_block_ffi.pair_variants()):
        print("needs a CUDA GPU and the built extension with the quantize kernels; nothing measured")
        return 1
    results = {}
    print(f"{'shape':18} {'part':24} {'ms':>8} {'GB':>7} {'GB/s':>7} {'x copy':>7}")
    for name in ns.shapes.split(","):
        for alpha in (float(a) for a in ns.alpha.split(",")):
            label = f"{name}@{skew_label(alpha)}"
            results[label] = bench(name, alpha, ns.rounds, ns.iters, ns.seed)
            for part, v in results[label].items():
                print(f"{label:18} {part:24} {v['ms']:8.3f} {v['gbytes']:7.3f} {v['gb_per_s']:7.0f} {v['vs_copy_bandwidth']:7.2f}",
                      flush=True)
    out = ns.out or RESULTS / f"quantize_{jax.devices()[0].device_kind.replace(' ', '_').lower()}.json"
    write_result(out, command=command_line("benchmarks/bench_quantize.py", sys.argv[1:] if argv is None else argv), results=results,
                 extra={"timing": "median over --rounds interleaved rounds of time_call (iters back-to-back dispatches)"})
    if ns.plot:
        plot(results, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
