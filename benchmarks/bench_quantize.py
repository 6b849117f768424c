"""Effective bandwidth of the one-pass MXFP8 quantize kernel vs a device-to-device copy.

    PYTHONPATH=. python3 benchmarks/bench_quantize.py [--m 65536 --k 4096 --groups 128]

Bytes moved by the kernel = read x (2*M*K) + write both data copies (2*M*K) + both
scale tensors. The copy baseline moves the same number of bytes (reads and writes
half each), timed in the same process: an XLA copy kernel and, where PyTorch is
installed, cudaMemcpy D2D through torch. Writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_grouped_mlp._src.cuda import ffi
from jax_grouped_mlp._src.formats import mxfp8

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import RESULTS, time_call  # noqa: E402


def _torch_copy_seconds(nbytes: int, iters: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(5):
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / iters)
    del src, dst
    torch.cuda.empty_cache()
    return float(np.median(samples))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=65536)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--groups", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "quantize_mxfp8_h200.json")
    ns = ap.parse_args(argv)
    if not ffi.available() or not jax.devices()[0].platform == "gpu":
        print("needs a GPU and the built extension (tools/build_kernels.py)")
        return 1

    m, k, g = ns.m, ns.k, ns.groups
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    cuts = np.sort(rng.integers(0, m + 1, size=g - 1))
    gs = jnp.asarray(np.diff(np.concatenate([[0], cuts, [m]])), jnp.int32)
    nb = mxfp8.grouped_scale_rows(m, g)
    nbytes = 2 * m * k + 2 * m * k + m * (-(-k // 32)) + nb * k + 4 * g

    results = {}
    for variant in ffi.quantize_variants():
        fn = jax.jit(lambda x, gs, v=variant: ffi.quantize_mxfp8_both_cuda(x, gs, variant=v))
        t = time_call(fn, x, gs, iters=ns.iters)
        results[f"kernel:{variant}"] = {"seconds": t, "GBps": nbytes / t / 1e9}

    ref = jax.jit(lambda x, gs: (mxfp8.quantize_mxfp8(x), mxfp8.quantize_mxfp8_grouped(x, gs)))
    t = time_call(ref, x, gs, iters=5, warmup=1)
    results["xla_reference"] = {"seconds": t, "GBps": nbytes / t / 1e9}

    half = jnp.zeros((nbytes // 2 // 4,), jnp.uint32)
    copy = jax.jit(lambda a: a ^ jnp.uint32(1))  # one read + one write per byte: a copy kernel
    t = time_call(copy, half, iters=ns.iters)
    results["xla_copy"] = {"seconds": t, "GBps": nbytes / t / 1e9}
    del half
    t = _torch_copy_seconds(nbytes, ns.iters)
    if t is not None:
        results["torch_memcpy_d2d"] = {"seconds": t, "GBps": nbytes / t / 1e9}

    best_copy = max(v["GBps"] for n, v in results.items() if "copy" in n or "memcpy" in n)
    best_kernel = max(results[n]["GBps"] for n in results if n.startswith("kernel"))
    report = {
        "what": "MXFP8 quantize, rowwise + group-aware columnwise in one pass, bf16 in",
        "command": "PYTHONPATH=. python3 " + " ".join(["benchmarks/bench_quantize.py", *sys.argv[1:]]),
        "gpu": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "host": platform.node(),
        "shape": {"M": m, "K": k, "G": g},
        "bytes_moved": nbytes,
        "results": results,
        "default_variant": ffi.QUANTIZE_VARIANT,
        "best_variant": max((n for n in results if n.startswith("kernel")), key=lambda n: results[n]["GBps"]),
        "kernel_fraction_of_copy": best_kernel / best_copy,
        "target_fraction": 0.70,
    }
    print(json.dumps(report, indent=1))
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
