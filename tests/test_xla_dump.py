"""benchmarks/xla_dump.py: the temp-allocation peak read from XLA's own dumps.

Two sources: a dump the H200 wrote for 4 Nano layers with every residual offloaded
(tests/data, from ``bench_offload.py --nano``), whose numbers are known, and a dump
this machine's XLA:CPU writes now for a tiny checkpointed step, so a change in the
dump format of the jax installed here shows up.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tarfile
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import bench_offload, hlo_text  # noqa: E402
from benchmarks.xla_dump import dump_flags, find_dump, parse_live_ranges, temp_peak_from_dump  # noqa: E402

H200_DUMP = ROOT / "tests" / "data" / "xla_dump_all_offload_h200.tgz"


def _peak(directory: pathlib.Path) -> dict:
    prefix = find_dump(directory, "jit_loss")
    assert prefix is not None, sorted(p.name for p in directory.iterdir())
    text = pathlib.Path(f"{prefix}.txt").read_text()
    return temp_peak_from_dump(prefix, hlo_text.parse_hlo(text)["instrs"])


def test_h200_all_offload_dump(tmp_path):
    with tarfile.open(H200_DUMP) as tar:
        tar.extractall(tmp_path, filter="data")
    tp = _peak(tmp_path)
    # compiled.memory_analysis().temp_size_in_bytes of that program: 1762893392
    assert tp["temp_allocation_bytes"] == 1762893392
    assert tp["estimated_peak_bytes"] == 1537654992  # live bytes, below the allocation (fragmentation)
    assert tp["peak_position"] == 260 and tp["peak_at_instruction"] == "ffi_call.197"
    split = tp["live_at_peak_residual_bytes"]
    assert split == {"kept": 0, "fetched": 644268088, "working": 893386904}
    assert sum(split.values()) == tp["estimated_peak_bytes"]
    assert sum(r["bytes"] for r in tp["live_at_peak_top"]) <= tp["estimated_peak_bytes"]
    top = tp["live_at_peak_top"][0]
    assert top["shape"].startswith("bf16[49152,2688]") and top["residual"] == "working"
    fetched = [r for r in tp["live_at_peak_top"] if r["residual"] == "fetched"]
    assert fetched and all(r["opcode"] == "copy-start" for r in fetched)
    assert tp["fraction_of_pass_done_at_peak"]["forward"] == 1.0


def test_live_range_parser_reads_sequence_and_ranges():
    text = textwrap.dedent("""\
        HloLiveRange (max 3):
          InstructionSequence:
            0:p
            1:f
            2:g
          BufferLiveRange:
            p{}:0-3
            f{1}:1-2
          Live ranges at 2 (peak):
            f{1}: 8 bytes
        """)
    order, ranges = parse_live_ranges(text)
    assert order == ["p", "f", "g"]
    assert ranges == {"p{}": (0, 3), "f{1}": (1, 2)}


STEP = """
import jax, jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

def layer(w, x):
    h = checkpoint_name(jnp.tanh(x @ w), "h")
    return jnp.sin(h) @ w.T

def loss(w, x):
    f = jax.checkpoint(layer, policy=jax.checkpoint_policies.save_only_these_names("h"))
    return jnp.sum(f(w, f(w, x)))

w = jnp.ones((256, 512), jnp.float32) / 64
x = jnp.ones((1024, 256), jnp.float32)
jax.jit(jax.grad(loss)).lower(w, x).compile()
"""


def test_cpu_dump_of_a_checkpointed_step(tmp_path):
    dump = tmp_path / "xla"
    env = {"XLA_FLAGS": dump_flags(dump, "jit_loss"), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", STEP], env=env, check=True, timeout=300)
    tp = _peak(dump)
    assert tp["source"] == "xla_dump"
    assert 0 < tp["estimated_peak_bytes"] <= tp["temp_allocation_bytes"]
    assert 0 <= tp["peak_position"] < tp["entry_schedule_length"]
    assert sum(tp["live_at_peak_residual_bytes"].values()) == tp["estimated_peak_bytes"]
    # the biggest live buffers are the [1024, 512] float32 activations (2 MiB)
    assert tp["live_at_peak_top"][0]["bytes"] == 1024 * 512 * 4


def test_find_dump_is_none_without_files(tmp_path):
    assert find_dump(tmp_path, "jit_loss") is None


@pytest.mark.parametrize("bad", ["slop", "=3"])
def test_xla_option_needs_key_value(bad):
    opts = bench_offload.argparse.Namespace(xla_option=[bad])
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        bench_offload._compiler_options(opts)


def test_xla_option_values_typed():
    opts = bench_offload.argparse.Namespace(xla_option=["a=40", "b=false", "c=0.5", "d=x"])
    assert bench_offload._compiler_options(opts) == {"a": 40, "b": False, "c": 0.5, "d": "x"}
