"""Moving ragged row blocks between the devices of one mesh axis (expert parallelism).

The collective is ``jax.lax.ragged_all_to_all``: each device sends a contiguous block
of rows to every peer, sizes known only on the device. XLA:CPU has no lowering for it
(jax 0.11.2: "HLO opcode `ragged-all-to-all` is not supported by XLA:CPU"), so on
CPU the same semantics are built from the dense ``all_to_all``: every block is padded
to the operand's full row count, exchanged, and scattered into place. That costs
``axis_size`` times the bytes of the ragged version and is meant for tests and
debugging, not for speed; it never drops a row, so results match the ragged path
exactly.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from jax_grouped_mlp._src import checks


class Exchange(str, enum.Enum):
    """Which collectives carry the tokens; ``AUTO`` picks by the mesh's platform.

    ``RAGGED`` and ``DENSE`` send each device only the (token, expert) pairs of its
    experts (an all-to-all there and back). ``ALL_GATHER`` all-gathers the tokens and
    their routing over the expert axis, runs each device's experts on the pairs they
    own, and reduce-scatters the per-token outputs: ``axis_size`` times the token
    bytes on the wire, but only collectives that NVLink runs at full speed, no
    per-peer cost, and no work split fixed in advance. ``AUTO`` keeps the all-to-all
    (ragged on GPUs, dense on CPU) until the crossover is measured on GPUs.
    """

    AUTO = "auto"
    RAGGED = "ragged"  # jax.lax.ragged_all_to_all (GPU, TPU)
    DENSE = "dense"  # padded jax.lax.all_to_all (any backend; CPU)
    ALL_GATHER = "all_gather"  # all-gather the tokens, reduce-scatter the outputs (any backend)

    @classmethod
    def parse(cls, value: "str | Exchange") -> "Exchange":
        return checks.parse_enum(cls, value, "exchange")

    def resolve(self, platform: str) -> "Exchange":
        if self is not Exchange.AUTO:
            return self
        return Exchange.DENSE if platform == "cpu" else Exchange.RAGGED


def exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


def ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: str,
    exchange: Exchange,
) -> jax.Array:
    """``jax.lax.ragged_all_to_all`` semantics, by the chosen collective.

    Rows ``input_offsets[d] : input_offsets[d] + send_sizes[d]`` of ``operand`` land at
    ``output_offsets[d]`` in device ``d``'s ``output``; rows of ``output`` that nobody
    writes keep their value.
    """
    if exchange is Exchange.RAGGED:
        return jax.lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name
        )
    if exchange is not Exchange.DENSE:
        raise ValueError(f"exchange must be resolved to 'ragged' or 'dense', got exchange={exchange!r}")
    return _dense_ragged_all_to_all(
        operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name
    )


def _dense_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    n = operand.shape[0]
    rows = jnp.arange(n, dtype=jnp.int32)[None, :]  # [1, n]
    feature = (1,) * (operand.ndim - 1)
    # Sender: one n-row slot per peer, the block at its front, zeros behind it.
    src = jnp.clip(input_offsets[:, None] + rows, 0, n - 1)
    keep = (rows < send_sizes[:, None]).reshape(*src.shape, *feature)
    slots = jnp.where(keep, operand[src], jnp.zeros((), operand.dtype))  # [peers, n, ...]
    slots = jax.lax.all_to_all(slots, axis_name, 0, 0, tiled=True)  # now [sources, n, ...]
    # Receiver: where each source asked its block to go.
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    dst = jnp.where(rows < recv_sizes[:, None], offsets[:, None] + rows, output.shape[0])
    return output.at[dst.reshape(-1)].set(slots.reshape(-1, *operand.shape[1:]), mode="drop")
