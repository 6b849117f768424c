"""Where the time of one MLP training step goes: every part of it timed alone.

    PYTHONPATH=. python3 benchmarks/bench_step_parts.py [--shape nano] [--out FILE]

For one shape of ``common.MLP_SHAPES`` it times, each as its own jitted program on
the same inputs: the six GEMMs of a step (FC1 and the FC2 dgrad as the fused kernels
the mxfp8 step runs: FC1 with the squared ReLU and both MXFP8 copies of ``a``, the
FC2 dgrad with dSReLU, ``dprobs`` and both copies of ``dh``; FC2, the FC1 dgrad with
the weight as stored, the two wgrads) on bf16 operands, and the MXFP8 conversions
the mxfp8 recipe adds around them: one two-copy pass for x and dy (the rowwise
values in bf16 plus the columnwise copy, kept as FP8 for x), the weights' one-pass
fake quantization, and the dequantization of the two kept FP8 residuals before the
weight gradients. Rows with a count of 0 are what earlier versions ran
instead (quantize both copies to FP8, then dequantize in XLA), kept for
comparison. Each part is multiplied by
how often one step runs it, so the table adds up to an estimate of the step, to set
against ``bench_mlp.py``'s measured step time. Writes JSON
(``results/step_parts_<platform>.json``).

What it answers: how much of the mxfp8 recipe's extra time is dequantization that an
in-kernel conversion would remove, and how much is quantization that stays.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src.cuda import ffi
from jax_grouped_mlp._src.formats import mxfp8
from jax_grouped_mlp._src.op import primitives

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import MLP_SHAPES, RESULTS, command_line, device_description, time_call, write_result  # noqa: E402


def _parts(m: int, h: int, f: int, g: int, seed: int):
    """(name, per-step count, jitted fn, args) for every part of a step."""
    rng = np.random.default_rng(seed)
    bf = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16)  # noqa: E731
    x, a, w1, w2 = bf(m, h), bf(m, f), bf(g, h, f) / 32, bf(g, f, h) / 32
    gs = jnp.full((g,), m // g, jnp.int32)
    gemm = jax.jit(lambda l, r, s: primitives.grouped_gemm(l, r, s, jnp.bfloat16))
    dgrad = jax.jit(lambda l, r, s: primitives.grouped_gemm(l, r, s, jnp.bfloat16, transpose_rhs=True))
    wgrad = jax.jit(lambda l, r, s: primitives.grouped_wgrad(l, r, s, jnp.bfloat16))
    q_both = jax.jit(primitives.quantize_both)
    q_w = {ax: jax.jit(lambda w, ax=ax: primitives.quantize(w, ax)) for ax in (1, 2)}
    fq_w = {ax: jax.jit(lambda w, ax=ax: primitives.fake_quantize(w, ax)) for ax in (1, 2)}
    deq = jax.jit(lambda t: mxfp8.dequantize(t, jnp.bfloat16))  # XLA's
    # What the weight gradients' adapter runs on a kept residual (a kernel on CUDA).
    deq_kept = jax.jit(lambda t: jax.lax.platform_dependent(
        t, cuda=ffi.dequantize_cuda, default=lambda t: mxfp8.dequantize(t, jnp.bfloat16)))
    pair = {keep: jax.jit(lambda x, gs, keep=keep: primitives.fake_quantize_pair(x, gs, keep_col_fp8=keep))
            for keep in (False, True)}
    probs = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
    fc1_fused = jax.jit(primitives.fc1_fused)
    dgrad_fused = jax.jit(primitives.dgrad_fused)
    x_row, x_col = q_both(x, gs)
    a_row, a_col = q_both(a, gs)
    w1_k = q_w[1](w1)
    w1_t = q_w[2](w1)
    return [
        # What the mxfp8 step runs (per-step counts; the default fused FC1 epilogue):
        ("fused fc1: gemm + srelu + pair(a) [M,H]x[G,H,F]", 1, fc1_fused, (x, w1, gs, probs)),
        ("gemm fc2 [M,F]x[G,F,H]", 1, gemm, (a, w2, gs)),
        ("fused dgrad fc2: dgrad + dsrelu + dprobs + pair(dh)", 1, dgrad_fused, (x, w2, gs, a, probs)),
        ("gemm dgrad fc1 (w1 as stored, K-major)", 1, dgrad, (a, w1, gs)),
        ("wgrad dw1 [M,H]^T[M,F]", 1, wgrad, (x, a, gs)),
        ("wgrad dw2 [M,F]^T[M,H]", 1, wgrad, (a, x, gs)),
        ("fake_quantize_pair + FP8 col [M,H] (x)", 1, pair[True], (x, gs)),
        ("fake_quantize_pair bf16 col [M,H] (dy)", 1, pair[False], (x, gs)),
        # What the fused kernels replace (count 0: the unfused parts, for comparison):
        ("gemm fc1 [M,H]x[G,H,F]", 0, gemm, (x, w1, gs)),
        ("fake_quantize_pair + FP8 col [M,F] (a)", 0, pair[True], (a, gs)),
        ("gemm dgrad fc2 (w2 as stored, K-major)", 0, dgrad, (x, w2, gs)),
        ("fake_quantize_pair bf16 col [M,F] (dh)", 0, pair[False], (a, gs)),
        ("fake_quantize weight along K (fprop)", 2, fq_w[1], (w1,)),
        ("fake_quantize weight along N (dgrad)", 2, fq_w[2], (w1,)),
        ("dequantize grouped col [M,H] (x kept)", 1, deq_kept, (x_col,)),
        ("dequantize grouped col [M,F] (a kept)", 1, deq_kept, (a_col,)),
        # What earlier versions ran instead (count 0: for comparison only):
        ("dequantize grouped col [M,H] in XLA", 0, deq, (x_col,)),
        ("dequantize rowwise [M,H]", 0, deq, (x_row,)),
        ("dequantize rowwise [M,F]", 0, deq, (a_row,)),
        ("dequantize weight (fprop)", 0, deq, (w1_k,)),
        ("dequantize weight along N (dgrad)", 0, deq, (w1_t,)),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="nano", choices=sorted(MLP_SHAPES))
    ap.add_argument("--dims", default=None, help="groups,rows_per_group,hidden,ffn (overrides --shape)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ns = ap.parse_args(argv)
    dims = tuple(int(d) for d in ns.dims.split(",")) if ns.dims else MLP_SHAPES[ns.shape]
    g, rows, h, f = dims
    m = g * rows
    shape = {"name": "custom" if ns.dims else ns.shape, "groups": g, "rows_per_group": rows, "hidden": h, "ffn": f}
    report = {"command": command_line("benchmarks/bench_step_parts.py", sys.argv[1:] if argv is None else argv), "device": device_description(),
              "shape": shape, "parts": {}}
    totals = {"gemm": 0.0, "fused": 0.0, "quantize": 0.0, "dequantize": 0.0, "fake_quantize": 0.0}
    print(f"{'part':42s} {'ms':>8s} {'x/step':>6s} {'ms/step':>8s}")
    for name, count, fn, args in _parts(m, h, f, g, ns.seed):
        ms = 1e3 * time_call(fn, *args, iters=ns.iters)
        kind = {"wgrad": "gemm", "quantize_both": "quantize", "fake_quantize_pair": "quantize"}.get(
            name.split()[0], name.split()[0]
        )
        totals[kind] += ms * count
        report["parts"][name] = {"ms": ms, "per_step": count}
        print(f"{name:42s} {ms:8.3f} {count:6d} {ms * count:8.3f}", flush=True)
    report["ms_per_step"] = totals
    print({k: round(v, 3) for k, v in totals.items()})
    out = ns.out or RESULTS / f"step_parts_{jax.devices()[0].platform}.json"
    write_result(out, command=report["command"], results=report["parts"],
                 extra={"shape": report["shape"], "ms_per_step": report["ms_per_step"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
