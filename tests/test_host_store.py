"""``layer_scan``'s host store (``_src/offload/host_store.py``, ``csrc/host_store.cc``):
the scan's offloaded residuals copied by the library on its own CUDA streams.

CPU: ``layer_scan`` with :class:`PythonStore` (the same protocol in Python) gives the
loop's gradients bit for bit, misuse is caught, and the program lowered for CUDA
holds the four custom calls in the right loops. GPU: the CUDA store round-trips random
arrays of every residual dtype bit for bit, fails on an empty store, turns an
out-of-order read into NaN and an error, and ``layer_scan`` with it (the default on a
GPU) gives the loop's gradients bit for bit over repeated steps.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_grouped_mlp as jgm
from jax_grouped_mlp._src.cuda import ffi
from jax_grouped_mlp._src.offload import host_store

from test_layer_stack import _check, _grads, _loop_loss, _one, _scan_loss, nnx_layers
from test_offload_policies import PAIRWISE, _make_inputs


@pytest.fixture
def python_store(monkeypatch):
    """``layer_scan`` traced with a fresh :class:`PythonStore` per call."""
    made: list[host_store.PythonStore] = []

    def make():
        made.append(host_store.PythonStore())
        return made[-1]

    monkeypatch.setattr(host_store, "for_this_platform", make)
    return made


def _scan_grad(w2, x, gs, probs, policy=None):
    def loss(w1):
        y = jgm.layer_scan(_one, (w1, w2), x, gs, probs, policy=policy or jgm.offload_policy())
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.grad(loss)


def test_with_the_python_store_gradients_are_the_loops(rng, python_store):
    """Every pairwise placement, two layers per ``layer_scan`` (a store per stack)."""
    _check(rng, PAIRWISE, loss=_scan_loss)
    assert python_store and all(not s.stack for s in python_store)  # every entry read back once


@pytest.mark.parametrize("layers", [3, 4, 6])
def test_one_store_over_all_layers_is_bitwise_the_loop(rng, python_store, layers):
    inputs = _make_inputs(rng, layers=layers)
    want = _grads(_loop_loss, inputs)

    def loss(x, w1, w2, probs, gs):
        y = jgm.layer_scan(_one, (w1, w2), x, gs, probs, policy=jgm.offload_policy())
        return jnp.sum(y.astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    for i in range(2):  # the second step reuses the program, and the store
        got = [np.asarray(g.astype(jnp.float32)) for g in step(*inputs)]
        for name, a, b in zip(("dx", "dw1", "dw2", "dprobs"), got, want):
            np.testing.assert_array_equal(a, b, err_msg=f"step {i} {name}")
    (store,) = python_store
    assert not store.stack and next(store.serials) == 2 * (layers - 2) + 1  # layers 0 .. L-3, each step


def test_forward_and_backward_out_of_order_is_caught(rng, python_store):
    """One traced program (one store), two forwards, then their backwards: in reverse
    order they get their own entries and the gradients are right; in the order they
    were made the first backward gets the second forward's entry and fails instead of
    returning wrong gradients."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=4)
    f = jax.jit(lambda w: jgm.layer_scan(_one, (w, w2), x, gs, probs, policy=jgm.offload_policy()))
    want = [jax.vjp(lambda w: _plain(w, w2, x, gs, probs), w)[1](jnp.ones_like(x))[0] for w in (w1, w1 * 0.5)]
    (y1, pull1), (y2, pull2) = jax.vjp(f, w1), jax.vjp(f, w1 * 0.5)
    got2, got1 = pull2(jnp.ones_like(y2))[0], pull1(jnp.ones_like(y1))[0]
    for a, b in zip((got1, got2), want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert len(python_store) == 1  # traced once

    (y1, pull1), (y2, pull2) = jax.vjp(f, w1), jax.vjp(f, w1 * 0.5)
    with pytest.raises(Exception, match="out of order"):
        jax.block_until_ready(pull1(jnp.ones_like(y1)))


def _plain(w1, w2, x, gs, probs):
    return jax.lax.scan(lambda x, w: (_one(w, x, gs, probs), None), x, (w1, w2))[0]


def test_a_pullback_run_twice_finds_the_store_empty(rng, python_store):
    x, w1, w2, probs, gs = _make_inputs(rng, layers=4)
    _, pull = jax.vjp(lambda w: jgm.layer_scan(_one, (w, w2), x, gs, probs, policy=jgm.offload_policy()), w1)
    g = pull(jnp.ones_like(x))
    assert np.isfinite(np.asarray(g[0], np.float32)).all()
    with pytest.raises(Exception, match="empty"):
        jax.block_until_ready(pull(jnp.ones_like(x)))


def _calls(text: str) -> dict[str, int]:
    return {t: len(re.findall(rf"custom_call @{t}\(", text)) for t in host_store.TARGETS}


def test_lowered_for_cuda_the_copies_are_the_stores(rng, monkeypatch):
    """With the CUDA store (lowered here for CUDA, no GPU needed): one put_start /
    put_done in the forward loop, one get_start / get_done in the backward loop, the
    get_done results aliased to its operands, and nothing placed on the host (XLA makes
    no copies of its own; the pullbacks' moves to the device remain, no-ops for arrays
    already there). The stacked gradients of w1 and w2 start from unwritten buffers."""
    monkeypatch.setattr(host_store, "for_this_platform", host_store.CudaStore)
    x, w1, w2, probs, gs = _make_inputs(rng, layers=4)
    text = jax.jit(_scan_grad(w2, x, gs, probs)).trace(w1).lower(lowering_platforms=("cuda",)).as_text()
    assert _calls(text) == dict.fromkeys(host_store.TARGETS, 1)
    # (An extension without jgm_empty, or none: the buffers start as zeros instead.)
    empty = 2 if host_store.EMPTY in ffi.registered_targets() else 0
    assert len(re.findall(rf"custom_call @{host_store.EMPTY}\(", text)) == empty
    assert "output_operand_aliases" in text
    assert "pinned_host" not in text and "unpinned_host" not in text
    # vmap of grad (over x): each call takes the whole batch at once
    grad_x = jax.vmap(lambda x: _scan_grad(w2, x, gs, probs)(w1))
    text = jax.jit(grad_x).trace(jnp.stack([x, x * 0.5])).lower(lowering_platforms=("cuda",)).as_text()
    assert _calls(text) == dict.fromkeys(host_store.TARGETS, 1)


def test_the_store_is_chosen_for_cuda_only(monkeypatch):
    """On the CPU there is none (XLA's copies); ``JGM_LAYER_SCAN_STREAMS=0`` and
    :func:`xla_copies` turn it off on a GPU too."""
    with jax.default_device(jax.devices("cpu")[0]):
        assert host_store.for_this_platform() is None
    monkeypatch.setattr(host_store, "_platform", lambda: "gpu")
    monkeypatch.setattr(host_store, "cuda_store_available", lambda: True)
    assert isinstance(host_store.for_this_platform(), host_store.CudaStore)
    with host_store.xla_copies():
        assert host_store.for_this_platform() is None
    monkeypatch.setenv(host_store.ENV, "0")
    assert host_store.for_this_platform() is None


def test_host_memory_without_copies_is_zero():
    """Nothing held before any CUDA copy (on the CPU, or without the extension): zeros,
    and a release frees nothing."""
    if jax.default_backend() == "gpu":
        pytest.skip("the GPU test below covers the store's memory there")
    assert jgm.layer_scan_host_memory() == jgm.LayerScanHostMemory(0, 0, 0, 0)
    assert jgm.release_layer_scan_host_memory() == 0


# ---------------------------------------------------------------------------------
# On the GPU: the CUDA store itself.

_DTYPES = (jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e8m0fnu, jnp.float32, jnp.int32)


def _random(rng, shape, dtype):
    bits = rng.integers(0, 256, size=(*shape, np.dtype(dtype).itemsize), dtype=np.uint8)
    return jnp.asarray(bits.view(dtype).reshape(shape))


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8)


def _roundtrip(store, arrays):
    serial = store.put_start(arrays)
    store.put_done(arrays, serial, [])
    back = store.get_start(serial, arrays)
    return store.get_done(back, serial, [])


@pytest.mark.gpu
def test_cuda_store_round_trips_every_residual_dtype(rng):
    """Random bit patterns (every element differs from whatever the buffers held), odd
    and zero sizes, several arrays per entry: back bit for bit, twice per program."""
    assert host_store.cuda_store_available()
    arrays = [_random(rng, shape, dt) for shape, dt in zip([(257, 33), (1000,), (0, 8), (3, 5, 7), (64,)], _DTYPES)]
    store = host_store.CudaStore()

    @jax.jit
    def twice(arrays):
        once = _roundtrip(store, arrays)
        return once, _roundtrip(store, [a[::-1] if a.ndim else a for a in once])

    for _ in range(3):  # entries reused from the store's free list
        once, again = twice(arrays)
        for a, b, c in zip(arrays, once, again):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(_bits(b), _bits(a))
            np.testing.assert_array_equal(_bits(c), _bits(a[::-1] if a.ndim else a))


@pytest.mark.gpu
def test_cuda_store_memory_is_counted_and_idle_entries_released(rng):
    """An entry is in use between its put and its get, idle after; a release frees the
    idle ones only (an entry in use survives and reads back bit for bit), and the store
    allocates again afterwards."""
    jgm.release_layer_scan_host_memory()
    base = jgm.layer_scan_host_memory()
    assert base.idle_entries == 0
    store = host_store.CudaStore()
    a = _random(rng, (1000, 37), np.float32)  # 148000 bytes: one 256-byte-aligned entry
    nbytes = -(-a.nbytes // 256) * 256

    @jax.jit
    def put(a):
        serial = store.put_start([a])
        store.put_done([a], serial, [])
        return serial

    get = jax.jit(lambda s: store.get_done(store.get_start(s, [a]), s, [])[0])
    serial = jax.block_until_ready(put(a))
    held = jgm.layer_scan_host_memory()
    assert (held.in_use_entries, held.in_use_bytes) == (base.in_use_entries + 1, base.in_use_bytes + nbytes)
    assert jgm.release_layer_scan_host_memory() == 0  # nothing idle; the entry in use stays
    np.testing.assert_array_equal(_bits(get(serial)), _bits(a))
    idle = jgm.layer_scan_host_memory()
    assert (idle.in_use_entries, idle.idle_entries, idle.idle_bytes) == (base.in_use_entries, 1, nbytes)
    assert jgm.release_layer_scan_host_memory() == nbytes
    assert jgm.layer_scan_host_memory() == base
    b = _random(rng, (1000, 37), np.float32)
    np.testing.assert_array_equal(_bits(get(put(b))), _bits(b))  # a fresh entry


@pytest.mark.gpu
def test_cuda_store_empty_and_out_of_order(rng):
    """A get without a put fails at once, naming the store; two puts then a get with the
    first serial reads NaN and the store's next get_done fails."""
    store = host_store.CudaStore()
    like = [jax.ShapeDtypeStruct((128,), jnp.float32)]
    get = jax.jit(lambda s: store.get_done(store.get_start(s, like), s, []))
    with pytest.raises(Exception, match="is empty"):
        jax.block_until_ready(get(jnp.int32(1)))

    put = jax.jit(lambda a: store.put_start([a]))
    a = _random(rng, (128,), np.float32)
    first = put(a)
    put(a * 2)
    (back,) = get(first)  # the second put's entry, checked against the first's serial
    assert np.isnan(np.asarray(back)).all()
    with pytest.raises(Exception, match="out of order|another forward"):
        jax.block_until_ready(get(first))
    # The failed call's runtime token holds the error too, and JAX's exit-time effects
    # barrier would raise it again ("Exception ignored in atexit callback" at the end of
    # the GPU suite's log). A program that failed so stops; this test process goes on.
    # jax.effects_barrier() raises it without dropping the token (it clears only after
    # every token succeeded), so the token set is cleared by hand (private; skipped where
    # a jax has moved it).
    from jax._src import dispatch

    tokens = getattr(dispatch, "runtime_tokens", None)
    if tokens is not None and hasattr(tokens, "clear"):
        tokens.clear()


@pytest.mark.gpu
def test_layer_scan_uses_the_store_on_the_gpu(rng):
    x, w1, w2, probs, gs = _make_inputs(rng, layers=4)
    text = jax.jit(_scan_grad(w2, x, gs, probs)).lower(w1).as_text()
    assert _calls(text) == dict.fromkeys(host_store.TARGETS, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("layers", [3, 5])
def test_layer_scan_with_the_cuda_store_is_bitwise_the_loop_over_steps(rng, layers):
    """Three steps of one compiled program (the store's entries reused), against the loop
    with everything on the device and against XLA's own copies."""
    inputs = _make_inputs(rng, layers=layers)
    want = _grads(_loop_loss, inputs)

    def loss(x, w1, w2, probs, gs):
        y = jgm.layer_scan(_one, (w1, w2), x, gs, probs, policy=jgm.offload_policy())
        return jnp.sum(y.astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    for i in range(3):
        got = [np.asarray(g.astype(jnp.float32)) for g in step(*inputs)]
        for name, a, b in zip(("dx", "dw1", "dw2", "dprobs"), got, want):
            np.testing.assert_array_equal(a, b, err_msg=f"step {i} {name}")
    with host_store.xla_copies():
        xla = _grads(loss, inputs)
    for a, b in zip(xla, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_layer_scan_with_the_cuda_store_every_pairwise_placement(rng):
    _check(rng, PAIRWISE, loss=_scan_loss)


def _check_nnx_stack(rng) -> None:
    """A Flax NNX stack as a user scans it: the layers' states (float32 master weights)
    stacked along a leading axis, the module rebuilt inside ``layer`` with
    ``nnx.merge``; ``layer_scan``'s gradients are those of the same modules in a loop
    of ``jax.checkpoint`` bit for bit, over two steps of one program."""
    x, gs, probs, states, layer, loop = nnx_layers(rng, 4)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *states)

    def via_scan(stacked):
        y = jgm.layer_scan(layer, stacked, x, gs, probs, policy=jgm.offload_policy())
        return jnp.sum(y.astype(jnp.float32) ** 2)

    want = jax.tree.leaves(jax.jit(jax.grad(loop))(stacked))
    assert want and all(w.dtype == jnp.float32 and np.abs(np.asarray(w)).max() > 0 for w in want)
    step = jax.jit(jax.grad(via_scan))
    for _ in range(2):
        for a, b in zip(jax.tree.leaves(step(stacked)), want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_flax_nnx_stack_through_the_python_store(rng, python_store):
    _check_nnx_stack(rng)
    (store,) = python_store
    assert not store.stack and next(store.serials) == 2 * 2 + 1  # layers 0 and 1, each step


@pytest.mark.gpu
def test_flax_nnx_stack_through_the_cuda_store(rng):
    _check_nnx_stack(rng)


@pytest.mark.parametrize("case", ["jax_own_offload", "x_among_args"])
def test_the_store_with_unusual_layers(rng, python_store, case):
    """The layers of tests/test_layer_stack.py that once broke ``layer_scan``'s carry,
    through the store: arrays JAX offloads itself stay JAX's (only the op's offloads go
    through the store), and ``x`` passed again among the args."""
    from test_layer_stack import _assert_scan_is_the_loop, _one_named

    if case == "jax_own_offload":
        policy = jgm.offload_policy("device", "offload", "device", extra_offloadable=["mine"])
        _assert_scan_is_the_loop(rng, _one_named, policy, lambda x, gs, probs: (gs, probs))
    else:

        def layer(p, x, x0, gs, probs):
            return x + jgm.grouped_mlp(x * x0, p[0], p[1], gs, probs)

        _assert_scan_is_the_loop(rng, layer, jgm.offload_policy(), lambda x, gs, probs: (x, gs, probs),
                                 dx_exact=False)  # fmt: skip
    (store,) = python_store
    assert not store.stack and next(store.serials) == 2 + 1  # 4 layers: layers 0 and 1 went through it


def _dots(fn, argnums, *args) -> int:
    """Dot products in the CPU-compiled gradient of ``fn`` with respect to ``argnums``."""
    text = jax.jit(jax.grad(fn, argnums=argnums)).lower(*args).compile().as_text()
    return text.count(" dot(") + text.count(" ragged-dot(")


def test_frozen_weights_get_no_weight_gradient_gemms(rng, python_store):
    """With only ``x`` differentiated, XLA must still drop the weight-gradient GEMMs: the
    store's calls must not take the weight gradients as operands (an operand of a
    side-effecting call is never removed; the Python store keeps its operands like the
    CUDA one). Freezing the weights removes the same share of the compiled dots as from
    the plain checkpointed scan (a third: per layer 2 forward, 2 input-gradient and 2
    weight-gradient GEMMs)."""
    x, w1, w2, probs, gs = _make_inputs(rng, layers=3)

    def ours(x, w1, w2):
        y = jgm.layer_scan(_one, (w1, w2), x, gs, probs, policy=jgm.offload_policy())
        return jnp.sum(y.astype(jnp.float32) ** 2)

    def plain(x, w1, w2):
        layer = jax.checkpoint(_one, policy=jgm.offload_policy())
        y = jax.lax.scan(lambda x, w: (layer(w, x, gs, probs), None), x, (w1, w2))[0]
        return jnp.sum(y.astype(jnp.float32) ** 2)

    frozen, trained = _dots(ours, (0,), x, w1, w2), _dots(ours, (0, 1, 2), x, w1, w2)
    want_frozen, want_trained = _dots(plain, (0,), x, w1, w2), _dots(plain, (0, 1, 2), x, w1, w2)
    assert want_frozen * 3 == want_trained * 2, (want_frozen, want_trained)  # the premise
    assert frozen * want_trained == trained * want_frozen, (frozen, trained)
    assert python_store  # the store's calls were traced
