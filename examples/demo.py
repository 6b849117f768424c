"""The main job: one small MoE expert layer, forward and backward, on whatever device is present.

Runs ``grouped_mlp`` (MXFP8) over 8 experts with skewed group sizes under the
default ``offload_policy`` (all residuals to pinned host memory), then prints where
each residual went (read from the traced program), the error against a float64
unquantized reference, and the time per training step.

    python examples/demo.py [--tokens 2048] [--hidden 256] [--ffn 512] [--experts 8]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_grouped_mlp as jgm


def skewed_sizes(rng: np.random.Generator, tokens: int, experts: int) -> np.ndarray:
    """Zipf-like routing: a few hot experts, some cold ones, one with no tokens; sums to ~95% of M."""
    weights = 1.0 / np.arange(1, experts + 1) ** 1.2
    if experts > 1:
        weights[experts // 2] = 0.0
    sizes = np.floor(0.95 * tokens * weights / weights.sum()).astype(np.int32)
    return rng.permutation(sizes)


def reference_f64(x, w1, w2, gs, probs, dy):
    """Float64, unquantized: ``jax.lax.ragged_dot`` MLP and its VJP."""
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(a, np.float64)) for a in (x, w1, w2, probs)]

        def mlp(x, w1, w2, p):
            h = jax.lax.ragged_dot(x, w1, jnp.asarray(gs))
            return jax.lax.ragged_dot(p[:, None] * jnp.maximum(h, 0) ** 2, w2, jnp.asarray(gs))

        y, vjp = jax.vjp(mlp, *args)
        grads = vjp(jnp.asarray(np.asarray(dy, np.float64)))
        return np.asarray(y), [np.asarray(g) for g in grads]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()

    rng = np.random.default_rng(args.seed)
    m, h, f, g = args.tokens, args.hidden, args.ffn, args.experts
    gs_np = skewed_sizes(rng, m, g)
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((g, h, f)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((g, f, h)) / np.sqrt(f), jnp.bfloat16)
    probs = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    gs = jnp.asarray(gs_np)

    policy = jgm.offload_policy()  # the default: every residual to pinned host memory
    layer = jax.checkpoint(lambda x, w1, w2, p: jgm.grouped_mlp(x, w1, w2, gs, p), policy=policy)

    def step(x, w1, w2, p):
        y, vjp = jax.vjp(layer, x, w1, w2, p)
        return y, vjp(dy)

    device = jax.devices()[0]
    print(f"device: {device.platform} ({device.device_kind}); jax {jax.__version__}")
    print(f"layer: M={m} tokens, H={h}, F={f}, {g} experts, group sizes {gs_np.tolist()} "
          f"(sum {int(gs_np.sum())}), recipe mxfp8")

    placements = jgm.residual_placements(step, x, w1, w2, probs)
    note = " (the CPU has one memory: nothing is copied)" if device.platform == "cpu" else ""
    print("residuals:", ", ".join(f"{k} -> {v}" for k, v in placements.items()) + note)

    step_jit = jax.jit(step)
    t0 = time.perf_counter()
    y, grads = jax.block_until_ready(step_jit(x, w1, w2, probs))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        jax.block_until_ready(step_jit(x, w1, w2, probs))
        times.append(time.perf_counter() - t0)

    ry, rgrads = reference_f64(x, w1, w2, gs_np, probs, dy)
    print("error vs float64 unquantized reference (max |err| / max |ref|, and ||err|| / ||ref||):")
    for name, got, want in zip(("y", "dx", "dw1", "dw2", "dprobs"), (y, *grads), (ry, *rgrads)):
        got = np.asarray(got, np.float64)
        err = got - want
        print(f"  {name:7s} max {np.abs(err).max() / np.abs(want).max():.4f}   "
              f"norm {np.linalg.norm(err) / np.linalg.norm(want):.4f}")
    print(f"time per fwd+bwd step: {1e3 * np.median(times):.2f} ms "
          f"(median of {args.steps}; first call incl. compile {compile_s:.1f} s)")


if __name__ == "__main__":
    main()
