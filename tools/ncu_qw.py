#!/usr/bin/env python3
"""Runs the Nano-FC1 GEMM once as the plain bf16 kernel on the pre-quantized weight and once
as the in-register-quantizing ``_qw`` kernel, for ``ncu`` (no timing, no warm-up).

    ncu --clock-control none -k 'regex:GroupedGemmSm90_object|GroupedGemmQwSm90' -c 2 \
        --section SpeedOfLight --section WarpStateStats python3 tools/ncu_qw.py
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_grouped_mlp._src import ffi, gemm_ffi  # noqa: E402


def main() -> int:
    g, rows, k, n = 128, 384, 2688, 1856
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((g * rows, k), np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n), np.float32) / 64, jnp.bfloat16)
    gs = jnp.full((g,), rows, jnp.int32)
    w_fq = jax.block_until_ready(jax.jit(lambda w: ffi.fake_quantize_cuda(w, axis=1))(w))
    out = jax.jit(gemm_ffi.grouped_gemm_bf16_cuda)(x, w_fq, gs)
    out_qw = jax.jit(gemm_ffi.grouped_gemm_qw_cuda)(x, w, gs)
    same = bool(jnp.array_equal(out, out_qw))
    print(f"nano fc1: plain and qw outputs bitwise equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
