"""The public quantizers refuse to be differentiated (a clear error at trace time).

JAX would differentiate ``quantize_*``'s cast to ``float8_e4m3fn`` and round the
tangent (and so the cotangent) to E4M3 on the block's scale: 4 significant bits,
flushed to 0 below 2**-9 of the scale and NaN past 448 times it: gradients that look
plausible and are wrong. No exact derivative fits there (a tangent of FP8 data is FP8
itself), so :func:`refuse_derivative` raises instead, naming the quantizer and what to
do. A quantizer applied to a value JAX does not differentiate (a symbolic zero tangent:
a constant, or one under ``jax.lax.stop_gradient``) is unaffected; so are the op's own
quantizers, which are straight-through ``custom_jvp`` rules around these functions.
"""

from __future__ import annotations

import functools

import jax


def _message(fn: str) -> str:
    deq = "dequantize_fp8_block" if fn == "quantize_fp8_block" else "dequantize"
    return (
        f"{fn} is not differentiable: its derivative would round the gradient to FP8 E4M3 on "
        f"the block scales (wrong values, 0 when small, NaN when large). Quantize a constant "
        f"with {fn}(jax.lax.stop_gradient(x), ...); for a straight-through fake quantization, "
        f"with xs = jax.lax.stop_gradient(x) and f32 = jnp.float32, write (x.astype(f32) + "
        f"({deq}({fn}(xs, ...), f32) - xs.astype(f32))).astype(x.dtype) (bitwise the quantized "
        f"values, gradient 1); grouped_mlp's recipes quantize straight-through inside."
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def refuse_derivative(fn: str, x: jax.Array) -> jax.Array:
    """``x`` itself; differentiating through it is a TypeError naming ``fn``."""
    return x


@refuse_derivative.defjvp
def _refuse_derivative_jvp(fn, primals, tangents):
    raise TypeError(_message(fn))
