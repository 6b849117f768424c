"""The copy rate of ``layer_scan``'s host store against ``jax.device_put``, per size.

    PYTHONPATH=. python3 benchmarks/bench_host_store.py [--sizes-mb 94,182,1024]
        [--samples 10] [--out FILE]

For each size, an array of that many bytes goes to pinned host memory and back: with
``jax.device_put`` (``pinned_host`` and back; what ``measure_host_bandwidth`` and the
offload benchmarks' bars use), and through the CUDA store (``csrc/host_store.cc``). Each
direction is its own jitted call, timed on the host around a blocking call (median of
``--samples``; the dispatch, tens of microseconds, is inside). Prints GB/s each way and
writes JSON. Needs a CUDA GPU and the extension's store; elsewhere it says so and writes
nothing. (Splitting each copy over 2 or 4 streams was measured and gave nothing:
docs/notes/2026-12-04-layer-scan-floor.md.)
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import command_line, write_result

from jax_grouped_mlp._src.offload import host_store
from jax_grouped_mlp._src.offload.measure import single_device_sharding


def _median_s(fn, samples: int) -> float:
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def device_put_rates(x: jax.Array, samples: int) -> tuple[float, float]:
    """Seconds to ``pinned_host`` and back with ``jax.device_put``."""
    device = x.devices().pop()
    on_host = single_device_sharding(device, "pinned_host")
    on_device = single_device_sharding(device, "device")
    h = jax.block_until_ready(jax.device_put(x, on_host))
    out = _median_s(lambda: jax.device_put(x, on_host), samples)
    back = _median_s(lambda: jax.device_put(h, on_device), samples)
    return out, back


def store_rates(x: jax.Array, samples: int) -> tuple[float, float]:
    """Seconds of the store's copy out (put_start + put_done) and back (get_start +
    get_done), each its own jitted call, alternating (the stack holds one entry)."""
    store = host_store.CudaStore()
    like = [jax.ShapeDtypeStruct(x.shape, x.dtype)]

    @jax.jit
    def put(x):
        serial = store.put_start([x])
        store.put_done([x], serial, [])
        return serial

    @jax.jit
    def get(serial):
        (y,) = store.get_done(store.get_start(serial, like), serial, [])
        return y

    y = get(put(x))
    if not bool(jnp.array_equal(y, x)):
        raise RuntimeError("the store's round trip changed the bytes")
    outs, backs = [], []
    for _ in range(samples):
        t0 = time.perf_counter()
        serial = jax.block_until_ready(put(x))
        t1 = time.perf_counter()
        jax.block_until_ready(get(serial))
        outs.append(t1 - t0)
        backs.append(time.perf_counter() - t1)
    return float(np.median(outs)), float(np.median(backs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", default="94,182,1024", help="comma-separated sizes in MB (1e6 bytes)")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ns = ap.parse_args(argv)
    try:
        sizes = [int(float(s) * 1e6) for s in ns.sizes_mb.split(",") if s]
    except ValueError as e:
        ap.error(f"--sizes-mb takes comma-separated numbers: {e}")
    if not sizes or min(sizes) < 1:
        ap.error(f"--sizes-mb must name positive sizes, got {ns.sizes_mb!r}")
    if ns.samples < 1:
        ap.error(f"--samples must be >= 1, got {ns.samples}")
    if jax.default_backend() != "gpu" or not host_store.cuda_store_available():
        print("bench_host_store: needs a CUDA GPU and the extension's host store; nothing measured")
        return 0
    rows = []
    print(f"{'MB':>7} {'copier':>14} {'to host GB/s':>13} {'to device GB/s':>15}")
    for nbytes in sizes:
        x = jax.device_put(jnp.asarray(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)))
        cases = [("device_put", *device_put_rates(x, ns.samples)), ("store", *store_rates(x, ns.samples))]
        for name, out_s, back_s in cases:
            row = {"bytes": nbytes, "copier": name,
                   "to_host_s": out_s, "to_device_s": back_s,
                   "to_host_gb_s": nbytes / out_s / 1e9, "to_device_gb_s": nbytes / back_s / 1e9}
            rows.append(row)
            print(f"{nbytes / 1e6:7.0f} {name:>14} {row['to_host_gb_s']:13.1f} {row['to_device_gb_s']:15.1f}")
        del x
    if ns.out is not None:
        write_result(ns.out, command=command_line("benchmarks/bench_host_store.py", argv or sys.argv[1:]),
                     rows=rows, extra={"samples": ns.samples})
    return 0


if __name__ == "__main__":
    sys.exit(main())
