"""Our FFI handlers are CUDA-graph (command-buffer) compatible.

CPU: the execute handlers the extension exports carry XLA's command-buffer trait, and the
``registrations(cuda_graphs=False)`` ones (``JGM_CUDA_GRAPHS=0``) do not; read from the
handlers' own metadata, as XLA reads it at registration.

GPU: an MXFP8 training step (value_and_grad of grouped_mlp, fused FC1 and dgrad epilogues,
and the small-group path whose GEMMs quantize the weight) is bitwise the same with XLA's
command buffers on for custom calls, with them on but our handlers registered without
the trait, and with command buffers off; and with the trait our custom calls are inside
the compiled program's command buffers. XLA_FLAGS is read once per process: each
configuration runs in its own subprocess.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMMAND_BUFFER_COMPATIBLE = 1  # XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE


def _extension():
    try:
        from jax_grouped_mlp import _kernels
    except ImportError:
        return None
    return _kernels


# The XLA FFI C structs a metadata query needs (xla/ffi/api/c_api.h).
class _Ext(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int), ("next", ctypes.c_void_p)]


class _ApiVersion(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("ext", ctypes.c_void_p), ("major", ctypes.c_int),
                ("minor", ctypes.c_int)]


class _Metadata(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", _ApiVersion), ("traits", ctypes.c_uint32),
                ("state_type_id", ctypes.c_int64)]


class _MetadataExt(ctypes.Structure):
    _fields_ = [("base", _Ext), ("metadata", ctypes.POINTER(_Metadata))]


class _Span(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("ext", ctypes.c_void_p), ("size", ctypes.c_int64),
                ("types", ctypes.c_void_p), ("ptrs", ctypes.c_void_p)]


class _Attrs(ctypes.Structure):
    _fields_ = _Span._fields_ + [("attrs", ctypes.c_void_p)]


class _CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("ext", ctypes.c_void_p), ("api", ctypes.c_void_p),
                ("ctx", ctypes.c_void_p), ("stage", ctypes.c_int), ("args", _Span), ("rets", _Span),
                ("attrs", _Attrs), ("future", ctypes.c_void_p)]


def _traits(capsule) -> int:
    """The handler's traits, from a call frame carrying the metadata extension (type 1):
    the handler fills the metadata and returns without running."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    md = _Metadata(struct_size=ctypes.sizeof(_Metadata))
    ext = _MetadataExt(base=_Ext(struct_size=ctypes.sizeof(_MetadataExt), type=1), metadata=ctypes.pointer(md))
    # XLA_FFI_CallFrame_STRUCT_SIZE ends at `attrs` (the `future` field came later).
    frame = _CallFrame(struct_size=_CallFrame.future.offset, ext=ctypes.cast(ctypes.pointer(ext), ctypes.c_void_p))
    handler = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))(get(capsule, None))
    assert handler(ctypes.byref(frame)) is None, "the metadata query returned an error"
    assert md.api_version.major == 0 and md.api_version.minor > 0, "metadata not filled"
    return md.traits


@pytest.mark.skipif(_extension() is None, reason="the CUDA extension is not built")
def test_execute_handlers_are_command_buffer_compatible_unless_asked_not_to():
    from jax_grouped_mlp._src.offload import host_store

    ext = _extension()
    graphs, plain = ext.registrations(), ext.registrations(cuda_graphs=False)
    assert set(graphs) == set(plain) == set(ext.registrations(cuda_graphs=True))
    for target in graphs:
        if target in (*host_store.TARGETS, host_store.EMPTY):  # host state / nothing: never captured
            assert not _traits(graphs[target]["execute"]) & COMMAND_BUFFER_COMPATIBLE, target
            assert set(graphs[target]) == {"execute"}, target
            continue
        assert _traits(graphs[target]["execute"]) & COMMAND_BUFFER_COMPATIBLE, target
        assert not _traits(plain[target]["execute"]) & COMMAND_BUFFER_COMPATIBLE, target
        assert graphs[target]["instantiate"] is not None and _traits(graphs[target]["instantiate"]) == 0
    assert {*host_store.TARGETS, host_store.EMPTY} <= set(graphs)


@pytest.mark.skipif(_extension() is None, reason="the CUDA extension is not built")
def test_captured_launch_counter_is_zero_without_a_gpu_capture():
    """The evidence counter the GPU test reads: present, an int, and 0 in a process that
    captured nothing (here: the CPU, where no kernel launches)."""
    count = _extension().captured_launches()
    assert isinstance(count, int) and count == 0


def test_env_var_turns_the_trait_off(monkeypatch):
    from jax_grouped_mlp._src.cuda import ffi

    monkeypatch.delenv("JGM_CUDA_GRAPHS", raising=False)
    assert ffi.cuda_graphs_enabled()
    monkeypatch.setenv("JGM_CUDA_GRAPHS", "0")
    assert not ffi.cuda_graphs_enabled()
    monkeypatch.setenv("JGM_CUDA_GRAPHS", "1")
    assert ffi.cuda_graphs_enabled()


# ---- GPU: the training step in and out of CUDA graphs ----

GRAPH_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
CONFIGS = {
    # name: (XLA_FLAGS, JGM_CUDA_GRAPHS)
    "graphs": (GRAPH_FLAGS, "1"),
    "graph_flags_no_trait": (GRAPH_FLAGS, "0"),
    "no_command_buffers": ("--xla_gpu_enable_command_buffer=", "1"),
}

# Runs in a fresh interpreter: argv = [out.npz, evidence.json]. Three steps with fresh
# random inputs per kernel choice; the loss's value and grads saved for a bitwise compare.
CHILD = r"""
import json, re, sys
import jax, jax.numpy as jnp, numpy as np
from jax_grouped_mlp._src.op import mlp
from jax_grouped_mlp._src.op.heuristics import KernelChoices

def step(choices):
    def loss(x, w1, w2, gs, probs, dy):
        y = mlp.grouped_mlp_with(choices, x, w1, w2, gs, probs, recipe="mxfp8", fuse_fc1_epilogue=True)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 4)))

def inputs(rng, m=1024, h=256, f=384, g=4):
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    sizes = rng.multinomial(m - 40, np.ones(g) / g).astype(np.int32)  # ragged, sum < M
    return (bf(rng.standard_normal((m, h))), bf(rng.standard_normal((g, h, f)) / 16),
            bf(rng.standard_normal((g, f, h)) / 20), jnp.asarray(sizes), jnp.asarray(rng.uniform(0.1, 1, m), jnp.float32),
            bf(rng.standard_normal((m, h))))

from jax_grouped_mlp import _kernels

out, evidence = {}, {}
rng = np.random.default_rng(1234)
for label, choices in (("fused_epilogues", KernelChoices(quantize_weights_in_gemm=False)),
                       ("weight_quantizing_gemms", KernelChoices(quantize_weights_in_gemm=True))):
    fn = step(choices)
    for i in range(3):
        args = inputs(rng)
        if i == 0:
            hlo = fn.lower(*args).compile().as_text()
            before = _kernels.captured_launches()
            evidence[label] = {"targets": sorted(set(re.findall(r'custom_call_target="(jgm_\w+)"', hlo)))}
        value, grads = fn(*args)
        jax.block_until_ready(grads)
        if i == 2:  # our launches that ran inside CUDA-graph capture (counted by the extension)
            evidence[label]["captured_launches"] = _kernels.captured_launches() - before
        out[f"{label}/{i}/loss"] = np.asarray(value)
        for name, g in zip(("dx", "dw1", "dw2", "dprobs"), grads):
            out[f"{label}/{i}/{name}"] = np.asarray(g.astype(jnp.float32))
np.savez(sys.argv[1], **out)
json.dump(evidence, open(sys.argv[2], "w"))
"""


def _run_config(tmp_path, name):
    flags, graphs = CONFIGS[name]
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip(), JGM_CUDA_GRAPHS=graphs)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    npz, ev = tmp_path / f"{name}.npz", tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(npz), str(ev)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{name} failed:\n{(proc.stdout + proc.stderr)[-20000:]}"
    evidence = json.loads(ev.read_text())
    print(f"[{name}] XLA_FLAGS={env['XLA_FLAGS']!r} JGM_CUDA_GRAPHS={graphs}: {json.dumps(evidence)}")
    return dict(np.load(npz)), evidence


@pytest.mark.gpu
def test_training_step_is_bitwise_the_same_in_cuda_graphs(gpu, tmp_path):
    results = {name: _run_config(tmp_path, name) for name in CONFIGS}
    want, _ = results["no_command_buffers"]
    for name, (got, _) in results.items():
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name}: {key}")
    # Fresh inputs per step: the steps differ (a replayed graph must not repeat one).
    assert not np.array_equal(want["fused_epilogues/0/dw1"], want["fused_epilogues/1/dw1"])
    for label in ("fused_epilogues", "weight_quantizing_gemms"):
        graphs = results["graphs"][1][label]
        assert graphs["captured_launches"] > 0, graphs
        # Without the trait (or without command buffers) XLA keeps our calls out of capture.
        assert results["graph_flags_no_trait"][1][label]["captured_launches"] == 0
        assert results["no_command_buffers"][1][label]["captured_launches"] == 0
    assert "jgm_grouped_gemm_fc1" in results["graphs"][1]["fused_epilogues"]["targets"]
    assert "jgm_grouped_gemm_dgrad" in results["graphs"][1]["fused_epilogues"]["targets"]
