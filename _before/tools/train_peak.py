"""What is live at the temp peak of bench_train's training step, per candidate (compile only).

Compiles ``benchmarks/bench_train.py``'s step (the Nano decoder stack: float32 masters,
AdamW, router-made group sizes) for each candidate from abstract parameters (nothing is
allocated or run on the device) under XLA's text dump, and prints the compiled temp size
and the largest buffers live where the temp allocation is fullest, from XLA's own buffer
assignment and live ranges (``benchmarks/xla_dump.py``). One child process per candidate
and layer count (XLA reads XLA_FLAGS once). Comparing two layer counts gives the temp each
added layer costs.

    PYTHONPATH=. python3 tools/train_peak.py --candidates jgm_bf16_device,tokamax_bf16 --layers 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--candidates", default="jgm_bf16_device,tokamax_bf16")
    ap.add_argument("--layers", default="1,2")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--small", action="store_true", help="bench_train's tiny shape (CPU smoke test)")
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--out", type=pathlib.Path, default=None, help="also write every peak report here (results JSON)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # "candidate:layers:dumpdir" in the child
    opts = ap.parse_args(argv)
    if opts.child is not None:
        name, layers, dump = opts.child.split(":", 2)
        print(json.dumps(_child(opts, name, int(layers), pathlib.Path(dump))))
        return
    import bench_train
    from benchmarks.bench_offload import print_peaks
    from benchmarks.common import command_line, write_result
    from benchmarks.xla_dump import dump_flags

    known = bench_train._candidates(bench_train.SMALL)
    unknown = [c for c in opts.candidates.split(",") if c not in known]
    if unknown:
        ap.error(f"--candidates: unknown {unknown}; bench_train's are {sorted(known)}")

    root = pathlib.Path(tempfile.mkdtemp(prefix="train_peak_"))
    rows, failed = [], []
    for name in opts.candidates.split(","):
        for layers in (int(x) for x in opts.layers.split(",")):
            dump = root / f"{name}_{layers}"
            flags = f"{os.environ.get('XLA_FLAGS', '')} {dump_flags(dump, 'jit_train_step')}".strip()
            args = [sys.executable, __file__, "--tokens", str(opts.tokens), "--top", str(opts.top),
                    "--child", f"{name}:{layers}:{dump}"] + (["--small"] if opts.small else [])
            out = subprocess.run(args, env=os.environ | {"XLA_FLAGS": flags}, capture_output=True, text=True)
            if out.returncode:
                print(f"{name} L={layers}: failed\n{out.stderr[-1500:]}", flush=True)
                failed.append(f"{name} L={layers}")
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{name:24s} layers {layers}: temp {row['temp_bytes'] / 2**30:.3f} GiB, "
                  f"arguments {row['argument_bytes'] / 2**30:.2f} GiB", flush=True)
    for row in rows:
        print_peaks([row], labels=(row["label"],), top=opts.top)
    if opts.out and rows:
        write_result(opts.out, command=command_line("tools/train_peak.py", sys.argv[1:] if argv is None else argv),
                     rows=rows, device=rows[0]["device"],
                     extra={"what": "compiled temp and what is live at its peak, bench_train's step (compile only)",
                            "tokens": opts.tokens, "shape": "small" if opts.small else "nano"})
    if failed:
        raise SystemExit(f"train_peak: {len(failed)} compile(s) failed: {', '.join(failed)}")


def _child(opts, name: str, layers: int, dump: pathlib.Path) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import bench_train
    from benchmarks import hlo_text
    from benchmarks.xla_dump import find_dump, temp_peak_from_dump

    shape = bench_train.SMALL if opts.small else bench_train.NANO
    make_moe, policy = bench_train._candidates(shape)[name]

    def build():
        model = bench_train.Decoder(shape, layers, make_moe, policy, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

    graphdef, state = nnx.split(nnx.eval_shape(build))
    tokens = jax.ShapeDtypeStruct((opts.tokens,), jnp.int32)

    step = jax.jit(bench_train.train_step_fn(graphdef), donate_argnums=0)  # (the module name XLA dumps)
    compiled = step.lower(state, tokens, tokens).compile()
    mem = compiled.memory_analysis()
    prefix = find_dump(dump, "jit_train_step")
    tp = None
    if prefix is not None:
        tp = temp_peak_from_dump(prefix, hlo_text.parse_hlo(compiled.as_text())["instrs"], top=opts.top)
    return {"label": f"{name} L={layers}", "candidate": name, "layers": layers,
            "device": jax.devices()[0].device_kind,
            "temp_bytes": int(mem.temp_size_in_bytes), "argument_bytes": int(mem.argument_size_in_bytes),
            "temp_peak": tp}


if __name__ == "__main__":
    main()
