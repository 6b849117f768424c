#!/usr/bin/env python3
"""Runs every grouped GEMM (bf16, in-register weight quantization, MXFP8-weight, FC1- and dgrad-epilogue), wgrad and fake-quantize variant once on a small ragged case, for compute-sanitizer.

    compute-sanitizer --tool memcheck python3 tools/sanitize_small.py
    compute-sanitizer --tool memcheck python3 tools/sanitize_small.py --second-order

``--fp8-block`` instead runs every fp8_block kernel (the pair quantizer in its three modes,
the FC1-epilogue GEMM,
the weight quantizer in both layouts, the row quantizer, the token-major layout, every
FP8 GEMM and weight-gradient variant, the weight gradient on the pair's token-major
copies) on small ragged cases with an empty group and sizes past M.

``--host-store`` instead runs ``layer_scan`` with its CUDA host store (three steps against
the loop, bit for bit, its idle pinned memory released before the third).

``--second-order`` instead runs the op's second-order programs (``jit(grad(grad))`` over
every argument and ``jit(hessian)`` in probs, both recipes, an empty group and sizes
past M), the cases of tests/test_adversarial_gpu.py that pytest cannot run under the
sanitizer.

No pytest (the sanitizer crashed inside pytest's process on the H200). Exits 1 if an
output is not finite; the sanitizer reports memory errors itself.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from jax_grouped_mlp._src.cuda import ffi, gemm_ffi
from jax_grouped_mlp.kernels import registry  # noqa: E402


def main() -> int:
    rng = np.random.default_rng(0)
    m, k, n = 300, 200, 136
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, k, n)) / 16, jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    gs = jnp.asarray([100, 0, 150, 200], jnp.int32)  # the last group overshoots M
    bad = 0
    for v in gemm_ffi.grouped_gemm_variants():
        bk = registry.variant(v).rhs_k_major
        rhs = jnp.swapaxes(w, 1, 2) if bk else w
        out = gemm_ffi.grouped_gemm_bf16_cuda(a, rhs, gs, variant=v, transpose_rhs=bk)
        bad += int(not np.isfinite(np.asarray(out, np.float32)).all())
    for v in gemm_ffi.grouped_gemm_qw_variants():  # the weight quantized in registers
        bk = registry.variant(v).rhs_k_major
        rhs = jnp.swapaxes(w, 1, 2) if bk else w
        out = gemm_ffi.grouped_gemm_qw_cuda(a, rhs, gs, variant=v, transpose_rhs=bk)
        bad += int(not np.isfinite(np.asarray(out, np.float32)).all())
    for bk in (False, True):  # every tile in one call: the device's choice, out-of-range ones, the mixed tiles
        rhs = jnp.swapaxes(w, 1, 2) if bk else w
        fits = tuple(v for v in gemm_ffi.grouped_gemm_qw_variants() if registry.variant(v).rhs_k_major == bk)
        outs = [gemm_ffi.grouped_gemm_qw_cuda(a, rhs, gs, transpose_rhs=bk)]
        outs += [gemm_ffi._grouped_gemm_qw_call(a, rhs, gs, jnp.asarray(c, jnp.int32), fits, rhs.shape[1 if bk else 2])
                 for c in ((-3, 0), (len(fits) + 5, 0), (0, 1))]
        # The mixed tiles with whole 384-token chunks, remainders in every band (116 and 100,
        # 200, 306) and rows past the groups.
        a_long = jnp.asarray(rng.standard_normal((1700, k)), jnp.bfloat16)
        outs.append(gemm_ffi.grouped_gemm_qw_cuda(a_long, rhs, jnp.asarray([500, 200, 690, 100], jnp.int32),
                                                  transpose_rhs=bk, variant=fits))
        bad += sum(int(not np.isfinite(np.asarray(o, np.float32)).all()) for o in outs)
    # FC1 epilogue (h, a_row, a_col): probs with zeros and negatives.
    probs = jnp.asarray(rng.uniform(-1.0, 1.0, m) * (rng.random(m) > 0.1), jnp.float32)
    for v in gemm_ffi.grouped_gemm_fc1_variants():
        h, a_row, a_col = gemm_ffi.grouped_gemm_fc1_cuda(a, w, gs, probs, variant=v)
        for t in (h, a_row, ffi.dequantize_grouped_mxfp8_cuda(a_col)):
            bad += int(not np.isfinite(np.asarray(t, np.float32)).all())
    # FC2-dgrad epilogue (dh_row, dh_col, dprobs): a as dy [M, K], w2 = w as stored [G, N, K]
    # (N = 136, K = 200), h with negatives.
    h = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    w2 = jnp.swapaxes(w, 1, 2)
    for v in gemm_ffi.grouped_gemm_dgrad_variants():
        dh_row, dh_col, dprobs = gemm_ffi.grouped_gemm_dgrad_cuda(a, w2, gs, h, probs, variant=v)
        for t in (dh_row, dh_col, dprobs):
            bad += int(not np.isfinite(np.asarray(t, np.float32)).all())
    for v in gemm_ffi.grouped_wgrad_variants():
        out = gemm_ffi.grouped_wgrad_bf16_cuda(a, dy, gs, variant=v, out_dtype=gemm_ffi._wgrad_out_dtype(v))
        bad += int(not np.isfinite(np.asarray(out, np.float32)).all())
    for mode in ("row", "col"):
        out = ffi.fake_quantize_mxfp8_cuda(a, gs, mode=mode)
        bad += int(not np.isfinite(np.asarray(out, np.float32)).all())
    for keep in (False, True):
        row, col = ffi.fake_quantize_pair_mxfp8_cuda(a, gs, keep_col_fp8=keep)
        bad += int(not np.isfinite(np.asarray(row, np.float32)).all())
        col = ffi.dequantize_grouped_mxfp8_cuda(col) if keep else col
        bad += int(not np.isfinite(np.asarray(col, np.float32)).all())
    jax.block_until_ready(out)
    n = len(gemm_ffi.grouped_gemm_variants())
    n += len(gemm_ffi.grouped_gemm_qw_variants()) + 6
    n += len(gemm_ffi.grouped_wgrad_variants()) + len(gemm_ffi.grouped_gemm_fc1_variants()) + 5
    n += len(gemm_ffi.grouped_gemm_dgrad_variants())
    print(f"ran {n} variants, {bad} with non-finite output")
    return int(bad > 0)


def fp8_block_kernels() -> int:
    """Every fp8_block kernel once on a small ragged case (``--fp8-block``)."""
    from jax_grouped_mlp._src.cuda import fp8_block_fc1_ffi, fp8_block_ffi

    rng = np.random.default_rng(2)
    m, k, n = 300, 272, 144  # K and N off 128: partial last blocks
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, n, k)) / 16, jnp.bfloat16)
    gs = jnp.asarray([100, 0, 150, 200], jnp.int32)  # an empty group; the last overshoots M
    outs = []
    x_row, x_col = fp8_block_ffi.quantize_pair_cuda(x, gs, keep_col=True)
    dy_row, dy_col = fp8_block_ffi.quantize_pair_cuda(dy, gs, keep_col=True)
    outs += [x_row.data, x_col.data, fp8_block_ffi.quantize_pair_cuda(x, gs, keep_col=False)[1]]
    _, x_tm = fp8_block_ffi.quantize_pair_token_major_cuda(x, gs)
    _, dy_tm = fp8_block_ffi.quantize_pair_token_major_cuda(dy, gs)
    wq = fp8_block_ffi.quantize_weight_cuda(w)
    outs += [wq.data, fp8_block_ffi.quantize_weight_cuda(jnp.swapaxes(w, 1, 2), k_major=True).data]
    outs += [fp8_block_ffi.quantize_row_cuda(x).data, *gemm_ffi.token_major_blocks_cuda(x_col)]
    for v in gemm_ffi.grouped_gemm_fp8_block_variants():
        outs.append(gemm_ffi.grouped_gemm_fp8_block(x_row, wq, gs, variant=v))
    probs = jnp.asarray(rng.uniform(-1, 1, m), jnp.float32)
    for v in fp8_block_fc1_ffi.variants():  # FC1 with its epilogue: h and a's two copies
        h, a_row, a_col = fp8_block_fc1_ffi.grouped_gemm_fp8_block_fc1(x_row, wq, gs, probs, variant=v)
        outs += [h, a_row.data, a_row.scale, a_col.data, a_col.scale]
    for v in gemm_ffi.grouped_wgrad_fp8_block_variants():
        od = registry.variant(v).out_dtype
        outs.append(gemm_ffi.grouped_wgrad_fp8_block(x_col, dy_col, gs, out_dtype=od, variant=v))
    outs.append(gemm_ffi.grouped_wgrad_fp8_block(x_tm, dy_tm, gs))  # already token-major
    outs.append(gemm_ffi.grouped_wgrad_fp8_block(x_col, dy_tm, gs))  # one of each
    jax.block_until_ready(outs)
    floats = [o for o in outs if jnp.issubdtype(o.dtype, jnp.floating) and o.dtype.itemsize >= 2]
    bad = sum(int(not np.isfinite(np.asarray(o, np.float32)).all()) for o in floats)
    print(f"ran {len(outs)} fp8_block kernel outputs, {bad} of {len(floats)} GEMM outputs with non-finite values")
    return int(bad > 0)


def host_store() -> int:
    """``layer_scan`` over 4 small layers with every residual offloaded through its CUDA
    host store, three steps of one program, against the plain loop (bit for bit); the
    store's idle pinned memory released between the second and third step."""
    import jax_grouped_mlp as jgm

    rng = np.random.default_rng(0)
    m, h, f, g, layers = 300, 128, 96, 4, 4
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((layers, g, h, f)) / 12, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((layers, g, f, h)) / 10, jnp.bfloat16)
    gs = jnp.asarray([100, 0, 150, 200], jnp.int32)  # an empty group; the last overshoots M
    probs = jnp.asarray(rng.uniform(size=m), jnp.float32)

    def layer(p, x):
        return x + jgm.grouped_mlp(x, p[0], p[1], gs, probs)

    def scanned(w1):
        return jnp.sum(jgm.layer_scan(layer, (w1, w2), x, policy=jgm.offload_policy()).astype(jnp.float32) ** 2)

    def loop(w1):
        y = x
        for i in range(layers):
            y = layer((w1[i], w2[i]), y)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    step, want = jax.jit(jax.grad(scanned)), np.asarray(jax.jit(jax.grad(loop))(w1), np.float32)
    bad = 0
    for i in range(3):
        if i == 2:
            print(f"released {jgm.release_layer_scan_host_memory()} bytes of idle pinned memory")
        got = np.asarray(step(w1), np.float32)
        bad += int(not np.isfinite(got).all() or not np.array_equal(got, want))
    print(f"layer_scan with the host store: {bad} of 3 steps differ from the loop")
    return int(bad > 0)


def second_order(recipes: tuple[str, ...] = ("mxfp8", "bf16"), which: tuple[str, ...] = ("grad2", "hessian")) -> int:
    """jit(grad of <c, grad>) and jit(hessian) of the op's loss, on the kernels
    (``--recipe R`` and ``--only grad2|hessian`` pick one of each)."""
    import jax_grouped_mlp as jgm

    rng = np.random.default_rng(1)
    m, h, f, g = 96, 64, 96, 3
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((g, h, f)) / 8, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((g, f, h)) / 8, jnp.bfloat16)
    p = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
    gs = jnp.asarray([40, 0, 70], jnp.int32)  # an empty group; the sizes pass M
    bad = 0
    for recipe in recipes:
        def loss(x, w1, w2, p, recipe=recipe):
            return jnp.sum(jgm.grouped_mlp(x, w1, w2, gs, p, recipe=recipe).astype(jnp.float32) ** 2)

        cs = [jnp.asarray(rng.standard_normal(a.shape), jnp.float32) for a in (x, w1, w2, p)]

        def inner(x, w1, w2, p, loss=loss, cs=cs):
            grads = jax.grad(loss, argnums=(0, 1, 2, 3))(x, w1, w2, p)
            return sum(jnp.vdot(c, gr.astype(jnp.float32)) for c, gr in zip(cs, grads))

        outs = list(jax.jit(jax.grad(inner, argnums=(0, 1, 2, 3)))(x, w1, w2, p)) if "grad2" in which else []
        if "hessian" in which:
            outs.append(jax.jit(jax.hessian(lambda p, loss=loss: loss(x, w1, w2, p)))(p))
        bad += sum(int(not np.isfinite(np.asarray(o, np.float32)).all()) for o in outs)
    print(f"ran {'+'.join(which)} for {'+'.join(recipes)}, {bad} outputs with non-finite values")
    return int(bad > 0)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--second-order", action="store_true")
    ap.add_argument("--fp8-block", action="store_true")
    ap.add_argument("--host-store", action="store_true")
    ap.add_argument("--recipe", choices=["mxfp8", "bf16"], default=None)
    ap.add_argument("--only", choices=["grad2", "hessian"], default=None)
    a = ap.parse_args()
    if a.fp8_block:
        sys.exit(fp8_block_kernels())
    if a.host_store:
        sys.exit(host_store())
    if not a.second_order:
        sys.exit(main())
    sys.exit(second_order(*[(v,) if v else d for v, d in ((a.recipe, ("mxfp8", "bf16")), (a.only, ("grad2", "hessian")))]))
