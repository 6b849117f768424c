"""What is live at the temp peak of one MLP training step (bench_mlp's step), per recipe.

Compiles ``jax.value_and_grad`` of ``bench_mlp``'s loss for ``grouped_mlp`` under XLA's
text dump and prints, from XLA's own buffer assignment and live ranges
(``benchmarks/xla_dump.py``), the compiled temp size and the largest buffers live where
the temp allocation is fullest. Compile only: nothing runs on the device.

    PYTHONPATH=. python3 tools/step_peak.py --shape moe8 --recipes mxfp8,bf16
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="nano")
    ap.add_argument("--recipes", default="mxfp8,bf16")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--child-dump", default=None, help=argparse.SUPPRESS)  # set for the per-recipe child
    opts = ap.parse_args(argv)
    if opts.child_dump is None:
        _spawn(opts)
    else:
        _child(opts, opts.recipes, pathlib.Path(opts.child_dump))


def _spawn(opts) -> None:
    """One child per recipe: XLA reads XLA_FLAGS once, when its backend starts."""
    from benchmarks.xla_dump import dump_flags

    root = pathlib.Path(tempfile.mkdtemp(prefix="step_peak_"))
    for recipe in opts.recipes.split(","):
        dump = root / recipe
        env = os.environ | {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {dump_flags(dump, 'jit_loss')}".strip()}
        subprocess.run([sys.executable, __file__, "--shape", opts.shape, "--recipes", recipe, "--top", str(opts.top),
                        "--child-dump", str(dump)], env=env, check=False)  # fmt: skip


def _child(opts, recipe: str, dump: pathlib.Path) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_grouped_mlp as jgm
    from benchmarks import bench_offload, hlo_text
    from benchmarks.common import MLP_SHAPES
    from benchmarks.xla_dump import find_dump, temp_peak_from_dump

    g, rows, h, f = MLP_SHAPES[opts.shape]
    m = g * rows
    rng = np.random.default_rng(0)
    args = (
        jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((g, h, f)) / np.sqrt(h), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((g, f, h)) / np.sqrt(f), jnp.bfloat16),
        jnp.full((g,), rows, jnp.int32),
        jnp.asarray(rng.uniform(0.1, 1, m), jnp.float32),
        jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16),
    )

    def loss(x, w1, w2, gs, probs, dy):
        y = jgm.grouped_mlp(x, w1, w2, gs, probs, recipe=recipe)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 4))).lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    prefix = find_dump(dump, "jit_loss")
    tp = temp_peak_from_dump(prefix, hlo_text.parse_hlo(compiled.as_text())["instrs"], top=opts.top)
    print(f"\n== {opts.shape} {recipe}: compiled temp {temp / 1e6:.1f} MB")
    bench_offload.print_peaks([{"label": recipe, "temp_peak": tp}], labels=(recipe,), top=opts.top)


if __name__ == "__main__":
    main()
