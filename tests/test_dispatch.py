"""The dispatcher owns the fallback: bindings say ``Unsupported``, ``primitives`` falls back.

CPU tests. A CUDA implementation is traced on every platform (``platform_dependent``
traces both branches), so a binding that raises ``Unsupported`` must be caught by the
dispatcher even when the program runs on the CPU. The CUDA branch itself
(``primitives._cuda_branch``) can be run on the CPU whenever it ends up in the
fallback, which is how these tests compare its values with the reference.
"""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_grouped_mlp
from jax_grouped_mlp._src.cuda import ffi
from jax_grouped_mlp._src.cuda.ffi import Unsupported
from jax_grouped_mlp._src.formats import mxfp8
from jax_grouped_mlp._src.op import primitives

CUDA_DIR = pathlib.Path(jax_grouped_mlp.__file__).parent / "_src" / "cuda"
# What the bindings may import from the op layer: leaf modules of pure helpers.
ALLOWED_FROM_OP = {"jax_grouped_mlp._src.op.activation", "jax_grouped_mlp._src.op.heuristics"}


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every module a file imports, anywhere in it (also inside functions), as dotted names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_bindings_never_import_the_dispatcher():
    """No module under ``_src/cuda`` imports ``_src.op.primitives`` (or the op, recipes...):
    lower layers never import upper ones, only the op's pure helper modules."""
    files = sorted(CUDA_DIR.glob("*.py"))
    assert files
    for path in files:
        for name in _imported_modules(path):
            if name.startswith("jax_grouped_mlp._src.op"):
                assert name in ALLOWED_FROM_OP | {"jax_grouped_mlp._src.op"}, f"{path.name} imports {name}"
        # ``from jax_grouped_mlp._src.op import primitives`` shows up as the module + name.
        assert "jax_grouped_mlp._src.op.primitives" not in _imported_modules(path), path.name


def test_unsupported_is_a_not_implemented_error():
    assert issubclass(Unsupported, NotImplementedError)
    assert not issubclass(Unsupported, (TypeError, ValueError))


def _raising(calls: list, name: str):
    def impl(*args, **kwargs):
        calls.append(name)
        raise Unsupported(f"{name}: not this shape")

    return impl


def _recording(calls: list, name: str):
    """A stand-in CUDA implementation: the reference, noting that it was asked."""

    def impl(*args, **kwargs):
        calls.append(name)
        return primitives._REFERENCE[name](*args, **kwargs)

    return impl


def _bits(tree) -> list[np.ndarray]:
    out = []
    for leaf in jax.tree.leaves(tree):
        a = np.asarray(leaf)
        out.append(a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}"))
    return out


def _assert_same_bits(got, want):
    got_leaves, want_leaves = _bits(got), _bits(want)
    assert len(got_leaves) == len(want_leaves)
    for a, b in zip(got_leaves, want_leaves):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a, b)


@pytest.fixture
def operands(rng):
    m, k, n, g = 96, 64, 48, 3
    bf = lambda *s, scale=1.0: jnp.asarray(rng.standard_normal(s) * scale, jnp.bfloat16)
    return {
        "x": bf(m, k),
        "w": bf(g, k, n, scale=0.125),
        "w_t": bf(g, n, k, scale=0.125),
        "h": bf(m, n),
        "dy": bf(m, k),
        "gs": jnp.asarray([40, 0, 50], jnp.int32),
        "probs": jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32),
    }


def _cases(o):
    """(primitive, args, static) for each operation with a composed or reference fallback."""
    return {
        "grouped_gemm": ((o["x"], o["w"], o["gs"]), {"out_dtype": jnp.dtype(jnp.bfloat16), "transpose_rhs": False}),
        "grouped_gemm_qw": ((o["x"], o["w_t"], o["gs"]), {"out_dtype": jnp.dtype(jnp.bfloat16), "transpose_rhs": True}),
        "grouped_wgrad": ((o["x"], o["h"], o["gs"]), {"out_dtype": jnp.dtype(jnp.float32)}),
        "fc1_fused": ((o["x"], o["w"], o["gs"], o["probs"]), {}),
        "dgrad_fused": ((o["dy"], o["w_t"], o["gs"], o["h"], o["probs"]), {}),
    }


# What the fallback of each primitive asks of the other primitives' CUDA implementations.
_COMPOSED = {
    "grouped_gemm": [],
    "grouped_wgrad": [],
    "grouped_gemm_qw": ["fake_quantize", "grouped_gemm"],
    "fc1_fused": ["grouped_gemm", "fake_quantize_pair"],
    "dgrad_fused": ["grouped_gemm", "fake_quantize_pair"],
}


@pytest.mark.parametrize("name", sorted(_COMPOSED))
def test_cuda_branch_falls_back_when_the_binding_says_unsupported(operands, monkeypatch, name):
    """A CUDA implementation that raises ``Unsupported``: the CUDA branch runs the
    fallback (the reference, or the unfused primitives, each of which is offered to its
    own CUDA implementation first), bit for bit the reference's result, and the public
    primitive traces and runs without the exception escaping."""
    calls: list = []
    impls = {n: _recording(calls, n) for n in primitives._REFERENCE}
    impls[name] = _raising(calls, name)
    monkeypatch.setattr(primitives, "_CUDA_IMPLS", impls)
    args, static = _cases(operands)[name]
    want = jax.jit(lambda *a: primitives._REFERENCE[name](*a, **static))(*args)

    got = jax.jit(lambda *a: primitives._cuda_branch(name, tuple(sorted(static.items())), *a))(*args)
    _assert_same_bits(got, want)
    assert calls[0] == name and sorted(set(calls[1:])) == sorted(_COMPOSED[name]), calls

    calls.clear()
    public = getattr(primitives, name)
    positional = {k: v for k, v in static.items() if k == "out_dtype"}
    keywords = {k: v for k, v in static.items() if k != "out_dtype"}
    out = jax.jit(lambda *a: public(*a, *positional.values(), **keywords))(*args)
    assert name in calls  # the CUDA branch was traced (and fell back) on the CPU too
    _assert_same_bits(out, want)


def test_other_errors_are_not_swallowed(operands, monkeypatch):
    """Only ``Unsupported`` means "fall back": any other error of a CUDA implementation
    (a malformed operand, a bug) reaches the caller."""

    def broken(*args, **kwargs):
        raise ValueError("lhs must be [M, K], got lhs.shape=(3,)")

    monkeypatch.setitem(primitives._CUDA_IMPLS, "grouped_gemm", broken)
    args, _ = _cases(operands)["grouped_gemm"]
    with pytest.raises(ValueError, match="lhs must be"):
        jax.jit(lambda *a: primitives.grouped_gemm(*a, jnp.bfloat16))(*args)


def test_fallback_under_grad_and_vmap(operands, monkeypatch):
    """Differentiating or batching a primitive whose CUDA implementation falls back gives
    the reference's derivative and batched values."""
    monkeypatch.setitem(primitives._CUDA_IMPLS, "grouped_gemm", _raising([], "grouped_gemm"))
    x, w, gs = operands["x"], operands["w"], operands["gs"]

    def loss(fn, x, w):
        return jnp.sum(fn(x, w, gs, out_dtype=jnp.dtype(jnp.float32)) ** 2)

    branch = lambda x, w, gs, out_dtype: primitives._cuda_branch(
        "grouped_gemm", (("out_dtype", out_dtype), ("transpose_rhs", False)), x, w, gs
    )
    ref = lambda x, w, gs, out_dtype: primitives._REFERENCE["grouped_gemm"](x, w, gs, out_dtype=out_dtype)
    got = jax.jit(jax.grad(lambda x, w: loss(branch, x, w), argnums=(0, 1)))(x, w)
    want = jax.jit(jax.grad(lambda x, w: loss(ref, x, w), argnums=(0, 1)))(x, w)
    _assert_same_bits(got, want)
    xs = jnp.stack([x, x * 2])
    got = jax.jit(jax.vmap(lambda x: branch(x, w, gs, jnp.dtype(jnp.float32))))(xs)
    want = jax.jit(jax.vmap(lambda x: ref(x, w, gs, jnp.dtype(jnp.float32))))(xs)
    _assert_same_bits(got, want)


@pytest.mark.skipif(not ffi.available(), reason="needs the built CUDA extension")
@pytest.mark.parametrize(
    "name,k,dtype",
    [("grouped_gemm", 36, jnp.bfloat16), ("grouped_gemm", 64, jnp.float32), ("grouped_wgrad", 36, jnp.bfloat16)],
)
def test_real_bindings_say_unsupported_and_lower_without_their_kernel(rng, name, k, dtype):
    """The extension's own bindings on a shape or dtype their kernels do not take (K not a
    multiple of 8, float32 operands): ``Unsupported`` from the adapter; through the
    dispatcher, lowered for CUDA, no custom call of that kernel, and on the CPU the
    reference's bits."""
    from jax_grouped_mlp._src.cuda import gemm_ffi

    m, n, g = 64, 32, 2
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    gs = jnp.asarray([30, 20], jnp.int32)
    if name == "grouped_gemm":
        rhs = jnp.asarray(rng.standard_normal((g, k, n)), dtype)
        adapter = lambda: gemm_ffi.grouped_gemm_cuda(x, rhs, gs, out_dtype=jnp.bfloat16)
        public = lambda x, rhs: primitives.grouped_gemm(x, rhs, gs, jnp.bfloat16)
        target = gemm_ffi.GROUPED_GEMM_TARGET
    else:
        rhs = jnp.asarray(rng.standard_normal((m, n)), dtype)
        adapter = lambda: gemm_ffi.grouped_wgrad_cuda(x, rhs, gs, out_dtype=jnp.float32)
        public = lambda x, rhs: primitives.grouped_wgrad(x, rhs, gs, jnp.float32)
        target = gemm_ffi.GROUPED_WGRAD_TARGET
    with pytest.raises(Unsupported):
        jax.eval_shape(adapter)
    text = jax.jit(public).trace(x, rhs).lower(lowering_platforms=("cuda",)).as_text()
    assert target not in text
    ref = primitives._REFERENCE[name]
    static = {"out_dtype": jnp.dtype(jnp.bfloat16 if name == "grouped_gemm" else jnp.float32)}
    _assert_same_bits(jax.jit(public)(x, rhs), jax.jit(lambda x, rhs: ref(x, rhs, gs, **static))(x, rhs))


@pytest.mark.skipif(not ffi.available(), reason="needs the built CUDA extension")
def test_real_fc1_fallback_lowers_to_the_unfused_kernels(rng):
    """fc1_fused on an MXFP8 x with a float32 weight (the FC1 kernel takes bf16 only):
    lowered for CUDA, the unfused GEMM and fake-quantize-pair kernels instead of the
    fused one; on the CPU the reference's bits."""
    from jax_grouped_mlp._src.cuda import gemm_ffi

    m, k, n = 64, 64, 32
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, k, n)) / 8, jnp.bfloat16)
    gs = jnp.asarray([30, 20], jnp.int32)
    p = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
    xq = mxfp8.quantize_mxfp8(x, axis=1)
    fn = lambda xq, w, p: primitives.fc1_fused(xq, w.astype(jnp.float32), gs, p)
    text = jax.jit(fn).trace(xq, w, p).lower(lowering_platforms=("cuda",)).as_text()
    assert gemm_ffi.GROUPED_GEMM_FC1_TARGET not in text
    assert ffi.FAKE_QUANTIZE_PAIR_TARGET in text
    want = jax.jit(lambda xq, w, p: primitives._REFERENCE["fc1_fused"](xq, w.astype(jnp.float32), gs, p))(xq, w, p)
    _assert_same_bits(jax.jit(fn)(xq, w, p), want)
