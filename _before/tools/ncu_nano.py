#!/usr/bin/env python3
"""Runs each kernel of one Nano-FC1 "MXFP8 GEMM" once, for ``ncu`` (no timing, no warm-up).

    ncu --clock-control none -k 'regex:fake_kernel|GroupedGemmSm90_object|GroupedGemmQwSm90' -c 3 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats python3 tools/ncu_nano.py

The three launches: the weight's fake-quantize pass (the weight-pass path runs it before
the GEMM), the bf16 GEMM on the converted weight, and the ``_qw`` GEMM (bf16 weight
quantized in registers, what the op runs at this shape), named explicitly: the op's
default call launches every ``_qw`` tile and all but the device-chosen one exit at once. Shape: 128 groups x 384 rows,
2688 -> 1856 (DESIGN.md's Nano FC1). Exits 1 unless the ``_qw`` output is bitwise the
bf16 GEMM's.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_grouped_mlp._src.cuda import ffi, gemm_ffi  # noqa: E402


def main() -> int:
    g, rows, k, n = 128, 384, 2688, 1856
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((g * rows, k), np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n), np.float32) / 64, jnp.bfloat16)
    gs = jnp.full((g,), rows, jnp.int32)
    w_fq = jax.block_until_ready(jax.jit(lambda w: ffi.fake_quantize_cuda(w, axis=1))(w))
    out = jax.jit(gemm_ffi.grouped_gemm_bf16_cuda)(x, w_fq, gs)
    qw = "grouped_gemm_sm90_qw_w128t384k64_s3_ss"  # the tile the device picks for equal 384-row groups
    out_qw = jax.jit(gemm_ffi.grouped_gemm_qw_cuda, static_argnames="variant")(x, w, gs, variant=qw)
    same = bool(jnp.array_equal(out, out_qw))
    print(f"nano fc1: bf16 and qw outputs bitwise equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
