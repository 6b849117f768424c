"""Host copies that ``layer_scan`` issues itself, on CUDA streams of its own.

Inside a ``while`` loop XLA's GPU scheduler puts each host copy right next to the op
that needs it, so a scanned layer stack waits for every copy (measured on the H200:
docs/notes/2026-12-03-layer-scan.md). A *store* moves the arrays with custom calls
(``csrc/host_store.cc``) that XLA sees as four ordinary calls with side effects:

* ``put_start(arrays) -> serial``: the copies out start on the store's copy-out
  stream once XLA's stream has written ``arrays``; they go into a pinned host entry
  pushed on the store's stack. ``serial`` (an int32 scalar) names the entry.
* ``put_done(arrays, serial, after)``: XLA's stream waits for those copies. ``arrays``
  are operands, so XLA keeps their device buffers until here; ``after`` (arrays made
  later, e.g. the next layer's output) places the wait after that work.
* ``get_start(serial, like) -> arrays``: pops the stack and copies the entry back on
  the copy-in stream, into buffers shaped like ``like``.
* ``get_done(arrays, serial, after) -> arrays``: XLA's stream waits for the copies in.

The caller ties ``put_start`` / ``get_start`` to the work the copies should overlap
(an optimization barrier) and passes that work's result as ``after``; between the two
the copies and XLA's kernels run at the same time.

The stack is last in, first out, like a scan's backward pass against its forward. A
backward pass run in another order than the forward passes it belongs to (two forwards
in separate executables, then their backwards in the order they were made) gets an
entry whose serial differs: the arrays read back are NaN, and from then on the store's
``get_done`` fails (once the check, which runs on the copy stream, has seen it), so it
cannot go unnoticed. A store on an empty stack fails at once.

:class:`PythonStore` implements the same protocol with ``io_callback`` and numpy, so
the CPU tests run ``layer_scan``'s store path; :func:`for_this_platform` picks the
CUDA store where its handlers are registered.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import os
from typing import Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jax_grouped_mlp._src.cuda import ffi

PUT_START = "jgm_host_put_start"
PUT_DONE = "jgm_host_put_done"
GET_START = "jgm_host_get_start"
GET_DONE = "jgm_host_get_done"
TARGETS = (PUT_START, PUT_DONE, GET_START, GET_DONE)
# A result buffer left unwritten (csrc/empty.cc): layer_scan's stacked gradients start
# from it where the CUDA store runs (every slot is written before it is read).
EMPTY = "jgm_empty"

# Read at trace time: "0" turns the CUDA store off (layer_scan then uses XLA's own
# host copies, as before 2026-12-04; docs/troubleshooting.md).
ENV = "JGM_LAYER_SCAN_STREAMS"

_XLA_COPIES = contextvars.ContextVar("jgm_layer_scan_xla_copies", default=False)
_SERIAL = jax.ShapeDtypeStruct((), jnp.int32)
_VMAP = "broadcast_all"  # a batch is one call: one entry, pushed and popped once
_ids = itertools.count(1)


class Store(Protocol):
    """The four calls of a host store (module docstring)."""

    def put_start(self, arrays: Sequence[jax.Array]) -> jax.Array: ...

    def put_done(self, arrays: Sequence[jax.Array], serial: jax.Array, after: Sequence[jax.Array]) -> None: ...

    def get_start(self, serial: jax.Array, like: Sequence[jax.ShapeDtypeStruct]) -> list[jax.Array]: ...

    def get_done(self, arrays: Sequence[jax.Array], serial: jax.Array,
                 after: Sequence[jax.Array]) -> list[jax.Array]: ...

    def unwritten(self, like: jax.ShapeDtypeStruct) -> jax.Array: ...


def _avals(arrays: Sequence) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in arrays]


class CudaStore:
    """The store of ``csrc/host_store.cc``: one stack per store (``store``, a number
    unique in the process, fixed when the program is traced) and per device.

    Under ``jax.vmap`` each call takes the whole batch at once (``broadcast_all``): one
    entry holds every example's arrays, and the serial is repeated along the batch."""

    def __init__(self) -> None:
        self.store = np.int64(next(_ids))

    def put_start(self, arrays):
        return jax.ffi.ffi_call(PUT_START, _SERIAL, has_side_effect=True, vmap_method=_VMAP)(*arrays, store=self.store)

    def put_done(self, arrays, serial, after):
        jax.ffi.ffi_call(PUT_DONE, (), has_side_effect=True, vmap_method=_VMAP)(*arrays, serial, *after)

    def get_start(self, serial, like):
        call = jax.ffi.ffi_call(GET_START, _avals(like), has_side_effect=True, vmap_method=_VMAP)
        return list(call(serial, store=self.store))

    def get_done(self, arrays, serial, after):
        arrays = list(arrays)
        call = jax.ffi.ffi_call(GET_DONE, _avals(arrays), has_side_effect=True, vmap_method=_VMAP,
                                input_output_aliases={i: i for i in range(len(arrays))})
        return list(call(*arrays, serial, *after, store=self.store))

    def unwritten(self, like: jax.ShapeDtypeStruct) -> jax.Array:
        """A buffer shaped like ``like`` whose bytes are whatever the allocator left:
        for a caller that writes every element before reading any. (Side-effecting, so
        that XLA neither merges two of them nor moves one.) Zeros with an extension
        built before ``jgm_empty`` existed."""
        if EMPTY not in ffi.registered_targets():
            return jnp.zeros(like.shape, like.dtype)
        return jax.ffi.ffi_call(EMPTY, like, has_side_effect=True, vmap_method=_VMAP)()


class PythonStore:
    """The same protocol in Python (``io_callback``; host numpy copies), for tests on any
    platform: last in, first out, serials checked (a mismatch raises at once)."""

    def __init__(self) -> None:
        self.stack: list[tuple[int, list[np.ndarray]]] = []
        self.serials = itertools.count(1)

    def _push(self, *arrays):
        serial = next(self.serials)
        self.stack.append((serial, [np.array(a) for a in arrays]))
        return np.int32(serial)

    def _pop(self, serial):
        if not self.stack:
            raise RuntimeError("host store is empty: a backward pass ran without its forward pass")
        expected, arrays = self.stack.pop()
        if int(serial) != expected:
            raise RuntimeError(f"host store: serial {int(serial)} read back where {expected} was written "
                               "(forward and backward passes out of order)")
        return arrays

    def put_start(self, arrays):
        return io_callback(self._push, _SERIAL, *arrays)

    def put_done(self, arrays, serial, after):
        io_callback(lambda *a: None, None, *arrays, serial, *after)  # keeps them computed, as on CUDA

    def get_start(self, serial, like):
        return list(io_callback(self._pop, _avals(like), serial))

    def get_done(self, arrays, serial, after):
        """The arrays, passed through a host callback that also takes ``after``: like the
        CUDA call, it keeps everything in ``after`` computed (XLA never removes an
        operand of a side-effecting call), so a CPU test sees what such an ordering
        operand costs (e.g. a frozen parameter's gradient that is no longer dropped)."""
        arrays = list(arrays)
        n = len(arrays)
        return list(io_callback(lambda *a: a[:n], _avals(arrays), *arrays, serial, *after))

    def unwritten(self, like: jax.ShapeDtypeStruct) -> jax.Array:
        """NaN here (the CUDA store's buffer is unwritten; callers write every element,
        and a slot they missed then shows in the CPU tests)."""
        return jnp.full(like.shape, jnp.nan, like.dtype)


@dataclasses.dataclass(frozen=True)
class LayerScanHostMemory:
    """Pinned host memory :func:`jax_grouped_mlp.layer_scan`'s CUDA store holds in this
    process (:func:`layer_scan_host_memory`).

    Attributes:
      in_use_bytes / in_use_entries: copies a forward pass made that its backward pass
        has not read yet (one entry per offloaded layer).
      idle_bytes / idle_entries: entries kept after their backward pass read them, reused
        by later steps whose layers offload the same bytes;
        :func:`release_layer_scan_host_memory` frees them.
    """

    in_use_bytes: int = 0
    in_use_entries: int = 0
    idle_bytes: int = 0
    idle_entries: int = 0


def layer_scan_host_memory() -> LayerScanHostMemory:
    """The pinned host memory ``layer_scan``'s copies hold now (all zero without the CUDA
    extension, or before the first step on a GPU). A training step's copies take one
    entry per offloaded layer at the first step and reuse them at every later one; a
    program with other shapes (another batch or sequence length, an evaluation step)
    adds its own entries."""
    ext = ffi.extension()
    if ext is None or not hasattr(ext, "host_store_memory"):
        return LayerScanHostMemory()
    return LayerScanHostMemory(**{k: int(v) for k, v in ext.host_store_memory().items()})


def release_layer_scan_host_memory() -> int:
    """Frees the idle pinned host memory of ``layer_scan``'s copies (entries no backward
    pass is waiting to read) and returns the bytes freed, once their last copies have
    finished. Call it between steps (not from another thread while one runs); the next
    step that offloads pins its memory again (the cost of a first step). Entries still
    in use stay. 0 without the CUDA extension.

    Raises:
      RuntimeError: CUDA failed to free an entry (the bytes of the others are freed).
    """
    ext = ffi.extension()
    if ext is None or not hasattr(ext, "host_store_release"):
        return 0
    return int(ext.host_store_release())


def cuda_store_available() -> bool:
    """The extension is loaded and has the store's handlers."""
    return ffi.available() and all(t in ffi.registered_targets() for t in TARGETS)


def _platform() -> str:
    device = jax.config.jax_default_device
    if device is not None:
        return device if isinstance(device, str) else device.platform
    return jax.default_backend()


@contextlib.contextmanager
def xla_copies():
    """Within it, programs traced use XLA's own host copies (:func:`for_this_platform`
    returns None): what the benchmarks compare the store with."""
    token = _XLA_COPIES.set(True)
    try:
        yield
    finally:
        _XLA_COPIES.reset(token)


def for_this_platform() -> Store | None:
    """A :class:`CudaStore` when programs traced now run on CUDA GPUs (the default
    device's platform) with the store's handlers, ``JGM_LAYER_SCAN_STREAMS`` is not
    ``0`` and no :func:`xla_copies` is open; else ``None`` (the caller uses XLA's own
    host copies)."""
    if _XLA_COPIES.get() or os.environ.get(ENV, "1").strip() == "0":
        return None
    if _platform() not in ("gpu", "cuda") or not cuda_store_available():
        return None
    return CudaStore()
