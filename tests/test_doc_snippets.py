"""Every ```python block of README.md and docs/*.md runs on CPU, so the examples cannot rot.

Blocks are found by glob, so a new one is covered at once. A file's blocks run in order in
one namespace seeded by ``_preamble`` (the names they assume, tiny shapes, fresh random
inputs; ``JGM_SEED`` reproduces). ``expr  # <Python literal>`` (same or next line) asserts
``expr`` equals the literal; ``CHECKS`` exercise what a block only defines. ``SUBS`` shrinks
what a CPU test cannot afford (each with why), ``SKIP`` lists blocks that cannot run (with
why); every other block runs, ``DEVICES`` files in a fresh interpreter with more CPU
devices. ``test_tables_match_the_docs`` fails on a missed fence or a stale table entry.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```", re.M | re.S)
ANY_FENCE = re.compile(r"^[ \t]*```[ \t]*py", re.M | re.I)  # what a reader would take for Python

NANO = "Nemotron-3-Nano's 128 x 2688 x 1856 experts (5 GB of float32 params) are far too big for a CPU test"
SUBS: dict[str, list[tuple[str, str, str]]] = {  # block -> [(text, replacement, why)]
    **{f"docs/moe.md#{n}": [("MoEBlock(128, 2688, 1856,", "MoEBlock(E, H, F,", NANO)] for n in (4, 8, 9)},
    "docs/offload.md#5": [
        ("jgm.measure_host_bandwidth()", "53e9", "times 1 GiB host copies; 53e9 is the doc's alternative and link"),
        ("jgm.measure_layer_time(**shape)",
         "jgm.LayerTime(1.53e-3, 3.12e-3, dict(fc1_input=99.1e-6, activation_input=799.7e-6, fc2_input=68.4e-6))",
         "times a Nano-shape layer (49152 x 2688 x 1856); the H200 times of the doc's table, so the "
         "placement comment is checked against the table (plan_offload itself is arithmetic)"),
    ],
}
SKIP: dict[str, str] = {}  # block -> why it cannot run here
DEVICES = {"docs/moe.md": 8}  # file -> CPU devices: blocks 6 and 10 build (2, 4) and (2, 2) meshes


class MicroBatch(NamedTuple):
    """design.md's ``mb``: a pytree of one micro-batch (stacked: all of them) with its loss."""

    x: Any
    group_sizes: Any
    probs: Any

    def loss(self, y: Any) -> Any:
        """The sum of squares of the micro-batch's output."""
        return (y.astype("float32") ** 2).sum()


def _preamble(rel: str, seed: int) -> dict[str, Any]:
    """The names the snippets of ``rel`` use without defining them, at CPU-test sizes."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jax_grouped_mlp as jgm
    from jax_grouped_mlp.flax import GroupedMLP, MoEBlock

    # moe.md's RoutingConfig(top_k=6) needs at least 6 experts; 8 split over its expert axis of 4.
    M, H, F, E, T = 64, 32, 64, 8 if rel == "docs/moe.md" else 4, 16
    keys = iter(jax.random.split(jax.random.key(seed), 32))

    def normal(*shape: int, dtype: Any = jnp.bfloat16, scale: float = 1.0) -> jax.Array:
        return (scale * jax.random.normal(next(keys), shape)).astype(dtype)

    cuts = jnp.sort(jax.random.choice(next(keys), jnp.arange(1, M), (E - 2,), replace=False))
    sizes = jnp.diff(jnp.concatenate([jnp.zeros(1, int), cuts, jnp.full(1, M)]))
    empty = int(jax.random.randint(next(keys), (), 0, E))  # one expert gets no rows
    group_sizes = jnp.insert(sizes, empty, 0).astype(jnp.int32)
    assert int(group_sizes.sum()) == M and int((group_sizes == 0).sum()) == 1

    def weights(dtype: Any = jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
        return normal(E, H, F, dtype=dtype, scale=H**-0.5), normal(E, F, H, dtype=dtype, scale=F**-0.5)

    w1, w2 = weights()
    w1b, w2b = weights()
    x = normal(T if rel == "docs/moe.md" else M, H)  # moe.md: tokens, the block routes them
    probs = jax.random.uniform(next(keys), (M,), minval=0.1, maxval=1.0)
    (p0, p1), (p2, p3) = weights(jnp.float32), weights(jnp.float32)
    mbs = MicroBatch(normal(3, M, H), jnp.stack([group_sizes] * 3), jax.random.uniform(next(keys), (3, M)) + 0.1)

    def task_loss(y: jax.Array, target: jax.Array | None = None) -> jax.Array:
        return jnp.mean((y.astype(jnp.float32) - (0.0 if target is None else target)) ** 2)

    def train_step(params: dict, batch: tuple) -> dict:
        def loss(p: dict) -> jax.Array:
            return task_loss(jgm.grouped_mlp(batch[0], p["w1"], p["w2"], batch[1], batch[2]))
        return jax.grad(loss)(params)

    class MyModel(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs) -> None:
            self.moe = MoEBlock(E, H, F, routing=jgm.RoutingConfig(top_k=2), rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.moe(x)

    return dict(
        jax=jax, jnp=jnp, jgm=jgm, nnx=nnx, optax=optax, MoEBlock=MoEBlock, M=M, H=H, F=F, E=E,
        x=x, w1=w1, w2=w2, w1b=w1b, w2b=w2b, group_sizes=group_sizes, probs=probs,
        router=normal(H, E, dtype=jnp.float32, scale=H**-0.5), score_bias=normal(E, dtype=jnp.float32, scale=0.1),
        num_experts=E, sw1=w1[0], sw2=w2[0], target=normal(T, H, dtype=jnp.float32), task_loss=task_loss,
        my_experts=lambda xs, gs: jgm.grouped_mlp(xs, w1, w2, gs),
        my_layer=lambda x: jgm.grouped_mlp(x, w1, w2, group_sizes, probs),
        params=dict(w1=p0, w2=p1), params_0=dict(w1=p0, w2=p1), params_1=dict(w1=p2, w2=p3),
        micro_batches=mbs, batch=(x, group_sizes, probs), train_step=train_step, MyModel=MyModel,
        modules=[GroupedMLP(E, H, F, rngs=nnx.Rngs(i)) for i in range(2)],
    )


def _check_accumulated_grads(ns: dict[str, Any]) -> None:
    """design.md: the body-accumulated gradient (weights prepared once) is, bit for bit,
    the sum of the micro-batches' gradients without preparing, in the masters' dtype.
    """
    import jax

    def loss(p: dict, mb: MicroBatch) -> jax.Array:
        return mb.loss(ns["jgm"].grouped_mlp(mb.x, p["w1"], p["w2"], mb.group_sizes, mb.probs))

    got = ns["accumulated_grads"](ns["params"], ns["micro_batches"])
    want = jax.tree.map(lambda p: 0 * p, ns["params"])
    for i in range(3):
        g = jax.grad(loss)(ns["params"], MicroBatch(*(a[i] for a in ns["micro_batches"])))
        want = jax.tree.map(lambda a, b: a + b, want, g)
    for k in want:
        assert got[k].dtype == ns["params"][k].dtype
        np.testing.assert_array_equal(got[k], want[k])  # README: "bitwise the same"


def _check_moe_step(ns: dict[str, Any]) -> None:
    """moe.md#4: the training step runs and moves the score bias."""
    opt = ns["nnx"].Optimizer(ns["block"], ns["optax"].adamw(1e-3), wrt=ns["nnx"].Param)
    bias = ns["block"].score_bias[...]
    loss = ns["step"](ns["block"], opt, ns["x"], ns["target"])
    assert bool(ns["jnp"].isfinite(loss)) and not bool((ns["block"].score_bias[...] == bias).all())


def _check_placements(ns: dict[str, Any]) -> None:
    """offload.md#1: the policy places the residuals as it says."""
    jax, layer = ns["jax"], ns["layer"]
    grad = jax.grad(lambda *a: layer(*a).astype("float32").sum(), argnums=(0, 1, 2))
    got = ns["jgm"].residual_placements(grad, ns["x"], ns["w1"], ns["w2"], ns["group_sizes"], ns["probs"])
    assert got == {"fc1_input": "offload", "activation_input": "device", "fc2_input": "recompute"}


def _check_eager_sharding(ns: dict[str, Any]) -> None:
    """moe.md#10: w1 [E, H, F] is sharded by its logical axes under the rules."""
    spec = ns["model"].moe.experts.w1[...].sharding.spec
    assert tuple(spec) == (None, "fsdp", "tp"), spec


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {  # block -> run after it
    "docs/design.md#1": _check_accumulated_grads,
    "docs/moe.md#4": _check_moe_step,
    "docs/moe.md#10": _check_eager_sharding,
    "docs/offload.md#1": _check_placements,
    "docs/offload.md#2": lambda ns: ns["jax"].block_until_ready(ns["step"](ns["params"], ns["batch"])),
}


def _blocks() -> dict[str, str]:
    """``"path#n"`` (n from 1 in file order) -> the source of each ```python block."""
    out = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        rel = path.relative_to(ROOT).as_posix()
        for n, m in enumerate(FENCE.finditer(path.read_text()), 1):
            out[f"{rel}#{n}"] = textwrap.dedent(m.group(2))
    return out


BLOCKS = _blocks()
FILES = sorted({k.split("#")[0] for k in BLOCKS})


def _expected(lines: list[str], stmt: ast.stmt) -> tuple[bool, Any]:
    """(True, value) when expression statement ``stmt`` is followed by ``# <literal>``."""
    if not isinstance(stmt, ast.Expr):
        return False, None
    same = lines[stmt.end_lineno - 1][stmt.end_col_offset:].strip()
    after = lines[stmt.end_lineno].strip() if stmt.end_lineno < len(lines) else ""
    for comment in (same, after):
        if comment.startswith("#"):
            try:
                return True, ast.literal_eval(comment[1:].strip())
            except (ValueError, SyntaxError):
                pass
    return False, None


def run_file(rel: str, seed: int) -> None:
    """Runs ``rel``'s blocks in order in one namespace (SUBS applied, SKIP left out)."""
    ns = _preamble(rel, seed)
    for key in (k for k in BLOCKS if k.startswith(rel + "#") and k not in SKIP):
        src = BLOCKS[key]
        for old, new, _ in SUBS.get(key, []):
            src = src.replace(old, new)
        lines = src.splitlines()
        for stmt in ast.parse(src).body:
            has, want = _expected(lines, stmt)
            if has:
                got = eval(compile(ast.Expression(stmt.value), key, "eval"), ns)
                assert got == want, f"{key}, line {stmt.lineno}: got {got!r}, the doc says {want!r}"
            else:
                exec(compile(ast.Module([stmt], type_ignores=[]), key, "exec"), ns)
        if key in CHECKS:
            CHECKS[key](ns)


@pytest.mark.parametrize("rel", FILES)
def test_doc_blocks_run(rel: str, rng: np.random.Generator) -> None:
    """Every block of ``rel`` not in SKIP runs; DEVICES files in a fresh interpreter."""
    seed = int(rng.integers(2**31))
    if rel not in DEVICES:
        run_file(rel, seed)
        return
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES[rel]}".strip()
    cmd = [sys.executable, __file__, rel, str(seed)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"{rel}'s blocks failed (seed={seed}):\n{(proc.stdout + proc.stderr)[-20000:]}")


def test_tables_match_the_docs() -> None:
    """No fence is missed, and every SUBS / SKIP / CHECKS / DEVICES entry still matches a block."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        rel, text = path.relative_to(ROOT).as_posix(), path.read_text()
        found = sum(k.startswith(rel + "#") for k in BLOCKS)
        assert found == len(ANY_FENCE.findall(text)), f"{rel}: a Python fence this test does not read"
    assert "README.md#1" in BLOCKS and set(FILES) >= {"docs/moe.md", "docs/offload.md"}
    for key, subs in SUBS.items():
        assert key in BLOCKS and key not in SKIP, f"SUBS[{key!r}] names no block that runs"
        for old, _, why in subs:
            assert old in BLOCKS[key] and why, f"SUBS[{key!r}]: {old!r} is no longer in the block"
    for key, why in SKIP.items():
        assert key in BLOCKS and why, f"SKIP[{key!r}] names no block (or gives no reason)"
    for key in CHECKS:
        assert key in BLOCKS and key not in SKIP, f"CHECKS[{key!r}] names no block that runs"
    assert set(DEVICES) <= set(FILES), "DEVICES names a file without blocks"


if __name__ == "__main__":  # test_doc_blocks_run's fresh interpreter: FILE SEED
    run_file(sys.argv[1], int(sys.argv[2]))
