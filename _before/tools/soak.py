#!/usr/bin/env python3
"""Soak test: a jitted training step run many times with new group sizes every step,
checking that device memory stays flat.

The step is ``grouped_mlp`` forward + backward and an SGD update of ``w1`` and ``w2``
(donated); the group sizes are drawn on the device every step (random, summing below,
at or past M, some groups empty), so one compiled program sees a different ragged
layout each time. ``bytes_in_use`` is read every ``--every`` steps after a sync; it
must not grow past the first reading by more than ``--slack-mib``. On a backend with
no memory stats (XLA:CPU returns None) the check is skipped.

    python3 tools/soak.py --steps 1000 --out soak.json            # on the GPU
    python3 tools/soak.py --steps 20 --out /tmp/soak.json         # smoke test (CPU)

Exits 1 when memory grew or a loss was not finite.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
import jax_grouped_mlp as jgm  # noqa: E402
from benchmarks.common import command_line, write_result  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=50, help="read memory stats every this many steps")
    p.add_argument("--m", type=int, default=4096, help="tokens")
    p.add_argument("--h", type=int, default=512)
    p.add_argument("--f", type=int, default=384)
    p.add_argument("--g", type=int, default=16, help="experts")
    p.add_argument("--recipe", default="mxfp8", choices=("mxfp8", "bf16"))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--slack-mib", type=float, default=4.0, help="allowed growth of bytes_in_use")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSON results path")
    return p.parse_args(argv)


def make_step(args):
    m, g = args.m, args.g

    def sizes(key):
        """Random group sizes on the device: a Dirichlet-like split of a total between
        M/2 and 1.25 M (so past M sometimes), with about a quarter of the groups empty."""
        k1, k2, k3 = jax.random.split(key, 3)
        total = jax.random.randint(k1, (), m // 2, m + m // 4 + 1)
        share = jax.random.exponential(k2, (g,)) * (jax.random.uniform(k3, (g,)) > 0.25)
        share = share / jnp.maximum(jnp.sum(share), 1e-6)
        return jnp.floor(share * total).astype(jnp.int32)

    def loss(w1, w2, x, gs, p, target):
        y = jgm.grouped_mlp(x, w1, w2, gs, p, recipe=args.recipe)
        return jnp.mean((y.astype(jnp.float32) - target) ** 2)

    def step(w1, w2, x, p, target, key):
        key, sub = jax.random.split(key)
        gs = sizes(sub)
        value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2, x, gs, p, target)
        w1 = (w1.astype(jnp.float32) - args.lr * g1.astype(jnp.float32)).astype(w1.dtype)
        w2 = (w2.astype(jnp.float32) - args.lr * g2.astype(jnp.float32)).astype(w2.dtype)
        return w1, w2, key, value, jnp.sum(gs)

    return jax.jit(step, donate_argnums=(0, 1, 5))


def bytes_in_use(device) -> int | None:
    stats = device.memory_stats()
    return None if not stats else int(stats.get("bytes_in_use", 0))


def main(argv=None) -> int:
    args = parse_args(argv)
    device = jax.devices()[0]
    rng = np.random.default_rng(args.seed)
    m, h, f, g = args.m, args.h, args.f, args.g
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    x = bf(rng.standard_normal((m, h)))
    w1 = bf(rng.standard_normal((g, h, f)) / np.sqrt(h))
    w2 = bf(rng.standard_normal((g, f, h)) / np.sqrt(f))
    p = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
    target = jnp.asarray(rng.standard_normal((m, h)), jnp.float32)
    key = jax.random.key(args.seed)
    step = make_step(args)

    rows = []
    t0 = time.perf_counter()
    first = None
    for i in range(1, args.steps + 1):
        w1, w2, key, loss, total = step(w1, w2, x, p, target, key)
        if i % args.every == 0 or i == args.steps or i == 1:
            loss_f = float(loss)  # syncs
            mem = bytes_in_use(device)
            if first is None:
                first = mem
            rows.append(dict(step=i, loss=loss_f, tokens=int(total), bytes_in_use=mem,
                             growth_mib=None if mem is None or first is None else (mem - first) / 2**20,
                             seconds=time.perf_counter() - t0))
    print(f"{'step':>6} {'loss':>10} {'tokens':>7} {'MiB in use':>11} {'growth MiB':>11} {'s':>7}")
    for r in rows:
        mem = "n/a" if r["bytes_in_use"] is None else f"{r['bytes_in_use'] / 2**20:.1f}"
        growth = "n/a" if r["growth_mib"] is None else f"{r['growth_mib']:+.2f}"
        print(f"{r['step']:>6} {r['loss']:>10.5f} {r['tokens']:>7} {mem:>11} {growth:>11} {r['seconds']:>7.2f}")

    finite = all(np.isfinite(r["loss"]) for r in rows)
    growths = [r["growth_mib"] for r in rows if r["growth_mib"] is not None]
    checked = bool(growths)
    max_growth = max(growths) if growths else None
    flat = not checked or max_growth <= args.slack_mib
    write_result(args.out, command=command_line("tools/soak.py", sys.argv[1:] if argv is None else argv), rows=rows,
                 extra=dict(config=vars(args), memory_checked=checked, max_growth_mib=max_growth,
                            slack_mib=args.slack_mib, flat=flat, finite=finite, ok=flat and finite))
    if not checked:
        print(f"{device.platform}: no memory stats, memory check skipped")
    else:
        print(f"max growth {max_growth:+.2f} MiB (slack {args.slack_mib} MiB): {'flat' if flat else 'GREW'}")
    if not finite:
        print("a loss was not finite")
    return 0 if flat and finite else 1


if __name__ == "__main__":
    sys.exit(main())
