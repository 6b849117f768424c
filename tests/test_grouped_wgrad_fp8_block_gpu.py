"""The FP8 block-scaled grouped weight gradient (``gemm_ffi.grouped_wgrad_fp8_block``,
kernel ``kernels/grouped_wgrad_fp8_block_sm90.py``) against a float64 numpy reference of
the dequantized group-aware operands.

Tests marked ``gpu`` need an NVIDIA Hopper GPU and the built extension; the others check
the oracle and the operand layout (``fp8_block.token_major_blocks``) and run anywhere:

    python -m pytest -q -n 0 tests/test_grouped_wgrad_fp8_block_gpu.py

Error bound: E4M3 products are exact and the scales powers of two, so the roundings are
each 128-token block's sum inside the FP8 wgmma (an accumulator narrower than float32),
the float32 promotion over the blocks and the final rounding (bf16: 2^-9 relative;
float32: 2^-24). Per element ``|out - ref| <= r |ref| + 2^-10 sum_t |a_t b_t|`` with
``r`` 2^-8 (bf16) or 2^-20 (float32), and norm-wise <= 5e-3; a wrong scale, block or
group is off by O(|ref|). The second term is wider than the data GEMM's 2^-12
(tests/test_grouped_gemm_fp8_block_gpu.py) because here the reduction runs over tokens,
whose magnitudes the test spreads over 2^+-8 within one block: the FP8 accumulator then
adds terms far below its largest, and the H200 showed errors up to 2^-11.3 sum|ab|
(session 22) against 2^-12 for the data GEMM, whose K blocks are homogeneous.
Integer data with small power-of-two scales (:func:`test_exact_when_sums_are_exact`)
must give ``out_dtype(ref)`` bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_grouped_mlp._src.cuda import ffi, gemm_ffi
from jax_grouped_mlp._src.formats import fp8_block
from jax_grouped_mlp._src.formats.fp8_block import FP8BlockTensor
from jax_grouped_mlp.kernels import registry
from gpu_helpers import has_gpu, poison_freed

B = fp8_block.BLOCK

needs_kernels = pytest.mark.skipif(
    not (has_gpu() and ffi.available() and gemm_ffi.grouped_wgrad_fp8_block_variants()),
    reason="needs a GPU and the built extension",
)

_kernel = jax.jit(gemm_ffi.grouped_wgrad_fp8_block, static_argnames=("out_dtype", "variant"))
OUT_DTYPES = (jnp.bfloat16, jnp.float32)


# ---- operands and the float64 oracle (no library code but the format's field layout) ----


def clamped_bounds(group_sizes, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Each group's (start, end) rows after the kernels' clamp (negative sizes 0, cut at M)."""
    ends = np.clip(np.cumsum(np.maximum(np.asarray(group_sizes, np.int64), 0)), 0, m)
    return np.concatenate([[0], ends[:-1]]).astype(np.int64), ends


def dequantize_f64(t: FP8BlockTensor, group_sizes) -> np.ndarray:
    """A group-aware ``[M, K]`` tensor in float64: row ``r`` of group ``g`` times the scale
    row ``first_g + (r - start_g) // 128``, ``first_g`` the exclusive cumsum of the
    groups' block counts; rows past the groups 0."""
    data = np.asarray(t.data).astype(np.float64)
    e = np.asarray(jax.lax.bitcast_convert_type(t.scale, jnp.uint8)).astype(np.int64)
    s = np.where(e == 255, np.nan, np.exp2(np.maximum(e, 0) - 127.0))
    out = np.zeros_like(data)
    first = 0
    for start, end in zip(*clamped_bounds(group_sizes, data.shape[0])):
        for r in range(start, end):
            out[r] = data[r] * s[first + (r - start) // B]
        first += -(-(end - start) // B)
    return out


def reference_f64(lhs, rhs, group_sizes) -> tuple[np.ndarray, np.ndarray]:
    """``(out [G, K, N], sum_t |a_t b_t|)`` in float64."""
    a, b = dequantize_f64(lhs, group_sizes), dequantize_f64(rhs, group_sizes)
    starts, ends = clamped_bounds(group_sizes, a.shape[0])
    out = np.stack([a[s:e].T @ b[s:e] for s, e in zip(starts, ends)]) if len(starts) else np.zeros((0, a.shape[1], b.shape[1]))
    mag = np.stack([np.abs(a[s:e]).T @ np.abs(b[s:e]) for s, e in zip(starts, ends)]) if len(starts) else out
    return out, mag


def _sizes(rng, g, total):
    cuts = np.sort(rng.integers(0, total + 1, size=g - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


def operands(rng, m, k, n, sizes) -> tuple[FP8BlockTensor, FP8BlockTensor]:
    """Group-aware quantized ``x [M, K]`` (rows spread over 2^+-8) and ``dy [M, N]``."""
    x = rng.standard_normal((m, k)) * np.exp2(rng.integers(-8, 8, size=(m, 1)))
    dy = rng.standard_normal((m, n))
    gs = jnp.asarray(np.asarray(sizes, np.int32))
    lhs = fp8_block.quantize_fp8_block(jnp.asarray(x, jnp.float32), 0, group_sizes=gs)
    rhs = fp8_block.quantize_fp8_block(jnp.asarray(dy, jnp.float32), 0, group_sizes=gs)
    return lhs, rhs


def exact_operands(rng, m, k, n, sizes) -> tuple[FP8BlockTensor, FP8BlockTensor]:
    """Integer data in [-3, 3] and scale exponents in [-2, 1]: a block's partial sum is an
    integer of magnitude <= 128 * 9 < 2^11, every running sum a multiple of 2^-4 below
    2^17 for groups of up to 2^13 rows (exact in float32): nothing rounds before the output."""
    gs = jnp.asarray(np.asarray(sizes, np.int32))
    nb = fp8_block.grouped_scale_rows(m, len(sizes))
    e8 = lambda s: jax.lax.bitcast_convert_type(jnp.asarray(s), jnp.float8_e8m0fnu)  # noqa: E731
    out = []
    for cols in (k, n):
        data = rng.integers(-3, 4, size=(m, cols)).astype(np.float32)
        scale = rng.integers(127 - 2, 127 + 2, size=(nb, cols)).astype(np.uint8)
        out.append(FP8BlockTensor(jnp.asarray(data, jnp.float8_e4m3fn), e8(scale), (0,), gs))
    return out[0], out[1]


def _poison(shape, itemsize: int, value: int) -> None:
    """Poisons freed device memory of the output's size with ``value`` bytes
    (:func:`gpu_helpers.poison_freed`)."""
    poison_freed(int(np.prod(shape)) * itemsize, value=value)


def _raw_call(m: int, g: int, k: int, n: int, out_dtype, variant: str | None = None):
    """The custom call alone, on operands already laid out token-major and with the group
    sizes as given (the kernel clamps them itself; the binding clamps them first);
    ``variant`` by name, or the binding's default for ``out_dtype``."""
    names = gemm_ffi.grouped_wgrad_fp8_block_variants()
    if variant is None:
        variant = next(v for v in names if registry.variant(v).out_dtype == jnp.dtype(out_dtype).name)
    index = names.index(variant)
    call = jax.ffi.ffi_call(gemm_ffi.GROUPED_WGRAD_FP8_BLOCK_TARGET,
                            (jax.ShapeDtypeStruct((g, k, n), out_dtype), gemm_ffi.ORDER_TOKEN))
    return jax.jit(lambda a, sa, b, sb, s: call(a, sa, b, sb, s, variant=np.int32(index), rows=np.int64(m))[0])


def _run(lhs, rhs, sizes, out_dtype=jnp.bfloat16, variant: str | None = None) -> np.ndarray:
    """The kernel's output in float64, from the custom call alone (its output is the only
    buffer it allocates) after two poisons of that buffer's bytes (0xFF: NaN; 0x7F: huge),
    with the group sizes unclamped; both runs must agree bit for bit (every element
    written, deterministic), and for the default variant the binding (its own layout
    pass, clamped sizes) must give the same bits."""
    m, k, n, g = lhs.data.shape[0], lhs.data.shape[1], rhs.data.shape[1], len(sizes)
    gs = jnp.asarray(np.asarray(sizes, np.int32))
    operands = (*fp8_block.token_major_blocks(lhs), *fp8_block.token_major_blocks(rhs))
    a, sa, b, sb = jax.block_until_ready(operands)
    call = _raw_call(m, g, k, n, out_dtype, variant)
    runs = []
    for value in (0xFF, 0x7F):
        _poison((g, k, n), jnp.dtype(out_dtype).itemsize, value)
        out = jax.block_until_ready(call(a, sa, b, sb, gs))
        assert out.shape == (g, k, n) and out.dtype == jnp.dtype(out_dtype)
        runs.append(np.asarray(out.astype(jnp.float32), np.float64))
    np.testing.assert_array_equal(runs[0], runs[1], err_msg="output differs between poisons: unwritten elements or a race")
    if variant is None:  # (the binding runs the default variant)
        binding = np.asarray(_kernel(lhs, rhs, gs, out_dtype=out_dtype).astype(jnp.float32), np.float64)
        np.testing.assert_array_equal(binding, runs[0], err_msg="the binding differs from the custom call")
    return runs[0]


def _check(lhs, rhs, sizes, out_dtype=jnp.bfloat16, variant: str | None = None) -> np.ndarray:
    """The kernel's output (:func:`_run`) within the float64 bands; returns it."""
    want, mag = reference_f64(lhs, rhs, sizes)
    got = _run(lhs, rhs, sizes, out_dtype, variant)
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} NaN outputs (unwritten elements?)"
    err = np.abs(got - want)
    if np.linalg.norm(want):
        rel = np.linalg.norm(err) / np.linalg.norm(want)
        assert rel <= 5e-3, f"relative error {rel:.2e}"
    r = 2.0**-8 if jnp.dtype(out_dtype) == jnp.bfloat16 else 2.0**-20
    bad = err > r * np.abs(want) + 2.0**-10 * mag
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{bad.sum()} elements off; first {i}: got {got[i]}, want {want[i]}, sum|ab| {mag[i]}")
    return got


BF16_VARIANTS = tuple(v for v in gemm_ffi.grouped_wgrad_fp8_block_variants()
                      if registry.variant(v).out_dtype == "bfloat16")  # fmt: skip


# ---- the oracle and the operand layout, anywhere ----


def test_oracle_matches_the_library_dequantizer(rng):
    sizes = [100, 0, 300, 29]
    lhs, _ = operands(rng, 500, 136, 8, sizes)
    np.testing.assert_array_equal(
        dequantize_f64(lhs, sizes), np.asarray(fp8_block.dequantize_fp8_block(lhs, jnp.float32))
    )


@pytest.mark.parametrize("sizes", [[100, 0, 300, 29], [0, 0], [700, -5, 2**30], [128, 256, 1]])
def test_token_major_blocks_is_the_tensor_rearranged(rng, sizes):
    """Each block's 128 token columns hold its group's rows in order, then zeros; unused
    blocks are zero; the scales are the byte values. The float64 dequantization read
    through that layout is the library's dequantization."""
    m, k = 600, 136
    lhs, _ = operands(rng, m, k, 8, np.array(sizes, np.int64).clip(-(2**31), 2**31 - 1).astype(np.int32))
    data, scale = fp8_block.token_major_blocks(lhs)
    nb = fp8_block.grouped_scale_rows(m, len(sizes))
    assert data.shape == (k, nb * B) and data.dtype == jnp.float8_e4m3fn
    assert scale.shape == (nb, k) and scale.dtype == jnp.float32
    d = np.asarray(data.astype(jnp.float32), np.float64)
    s = np.asarray(scale, np.float64)
    want = np.asarray(fp8_block.dequantize_fp8_block(lhs, jnp.float32), np.float64)
    seen = np.zeros(nb * B, bool)
    first = 0
    for start, end in zip(*clamped_bounds(np.asarray(lhs.group_sizes), m)):
        for r in range(start, end):
            col = (first * B) + (r - start)
            np.testing.assert_array_equal(d[:, col] * s[col // B], want[r])
            seen[col] = True
        first += -(-(end - start) // B)
    assert not d[:, ~seen].any(), "padding or unused blocks are not zero"


# ---- the kernel ----


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize(
    "m,k,n,g,total",
    [
        (1000, 256, 512, 7, 1000),  # sizes sum to M, ragged group starts
        (1000, 384, 256, 5, 700),  # sum below M: the rows past it do not count
        (777, 256, 384, 6, 1200),  # sum past M: clamped (by the kernel itself in _run's raw call)
        (1500, 2688, 1856, 4, 1500),  # Nano dims: K = 21 and N = 14.5 blocks of 128
        (300, 136, 208, 3, 300),  # K, N not multiples of 128 (nor of the epilogue subtile)
        (5, 128, 128, 2, 5),  # fewer rows than one block
        (3000, 256, 384, 19, 2900),  # many groups: blocks counted across them
        (3000, 512, 256, 2, 3000),  # long groups: many blocks a tile
    ],
)
def test_random(rng, out_dtype, m, k, n, g, total):
    sizes = _sizes(rng, g, total)
    lhs, rhs = operands(rng, m, k, n, sizes)
    _check(lhs, rhs, sizes, out_dtype)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize(
    "sizes",
    [
        [0, 0, 640, 0, 0, 0],  # empty groups around one
        [1, 127, 128, 129, 0, 255],  # every block-boundary offset
        [600, 30, 5, 3, 1, 1],  # skewed
        [5000, -3, 0, 7, 2**30, 1],  # giant and negative sizes: clamped by the kernel, never out of bounds
        [-1, -1, -1, -1, -1, -1],  # nothing: every gradient zero
    ],
)
def test_group_sizes_zero_skewed_giant_negative(rng, sizes):
    sizes = np.array(sizes, np.int64).clip(-(2**31), 2**31 - 1).astype(np.int32)
    lhs, rhs = operands(rng, 640, 256, 136, sizes)
    _check(lhs, rhs, sizes)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("m,k,n,sizes", [
    (900, 384, 256, [200, 0, 577, 123]),
    (700, 2688, 1856, [129, 1, 570]),
    (1500, 256, 256, [0, 130, 1, 255, 0, 0, 77, 128, 300, 2, 0, 129, 40, 200, 19, 38]),  # 16 groups
])
def test_exact_when_sums_are_exact(rng, out_dtype, m, k, n, sizes):
    """Every scale, block and group mapping and the promotion, bit for bit."""
    lhs, rhs = exact_operands(rng, m, k, n, sizes)
    want, _ = reference_f64(lhs, rhs, sizes)
    got = _run(lhs, rhs, sizes, out_dtype)
    rounded = want.astype(np.float32)
    if jnp.dtype(out_dtype) == jnp.bfloat16:
        rounded = rounded.astype(ml_dtypes.bfloat16)
    bad = got != rounded.astype(np.float64)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{bad.sum()} elements differ; first {i}: got {got[i]}, want {rounded[i]}")


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize(
    "m,k,sizes",
    [
        (600, 144, [100, 0, 300, 29]),  # K = 9 chunks of 16 (one partial 128-column block)
        (640, 256, [5000, -3, 0, 7, 2**30, 1]),  # giant and negative sizes: clamped
        (300, 2688, [128, 1, 171]),  # Nano's K; block-boundary sizes
        (0, 128, [0, 0]),  # no rows: all zero
    ],
)
def test_token_major_kernel_is_the_xla_layout(rng, m, k, sizes):
    """The CUDA layout kernel writes the bytes of ``fp8_block.token_major_blocks`` (the XLA
    gather), every one of them: the output buffer is poisoned twice first."""
    sizes = np.array(sizes, np.int64).clip(-(2**31), 2**31 - 1).astype(np.int32)
    lhs, _ = operands(rng, m, k, 8, sizes)
    want, want_scale = fp8_block.token_major_blocks(lhs)
    fn = jax.jit(gemm_ffi.token_major_blocks_cuda)
    for value in (0xFF, 0x7F):
        _poison(want.shape, 1, value)
        got, scale = jax.block_until_ready(fn(lhs))
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))
    if m:
        hlo = fn.lower(lhs).compile().as_text()
        assert 'custom_call_target="jgm_token_major_blocks"' in hlo


@pytest.mark.gpu
@needs_kernels
def test_nan_block_poisons_only_its_output_row(rng):
    """A NaN in ``x`` makes its group-aware block (128 tokens of one column) NaN, so the
    gradient row of that column in that group is NaN and nothing else."""
    m, k, n = 400, 256, 128
    sizes = [150, 250]
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[200, 7] = np.nan  # group 1, column 7
    gs = jnp.asarray(sizes, jnp.int32)
    lhs = fp8_block.quantize_fp8_block(jnp.asarray(x), 0, group_sizes=gs)
    _, rhs = operands(rng, m, k, n, sizes)
    out = np.array(_kernel(lhs, rhs, gs, out_dtype=jnp.float32))  # (a writable copy)
    assert np.isnan(out[1, 7]).all()
    out[1, 7] = 0
    assert np.isfinite(out).all()


@pytest.mark.gpu
@needs_kernels
def test_no_rows_and_no_groups(rng):
    """M = 0: every gradient zero; G = 0: an empty result."""
    lhs, rhs = operands(rng, 0, 128, 256, [0, 0])
    got = _run(lhs, rhs, [0, 0])
    assert got.shape == (2, 128, 256) and not got.any()
    lhs, rhs = operands(rng, 64, 128, 256, np.zeros((0,), np.int32))
    out = _kernel(lhs, rhs, jnp.zeros((0,), jnp.int32))
    assert out.shape == (0, 128, 256)


@pytest.mark.gpu
@needs_kernels
def test_small_for_sanitizer(rng):
    """Small and quick: the case compute-sanitizer runs (tools/gpu_check_fp8_wgrad.sh):
    K, N off 128, a group ending mid-block, sizes past M, an empty group; every variant."""
    sizes = [100, 0, 150, 200, 300]  # 1, 0, 2, 2 and 3 blocks (the ping-pong's tails)
    lhs, rhs = operands(rng, 700, 136, 264, sizes)
    for out_dtype in OUT_DTYPES:
        _check(lhs, rhs, sizes, out_dtype)
    for variant in BF16_VARIANTS[1:]:
        _check(lhs, rhs, sizes, jnp.bfloat16, variant)


@pytest.mark.gpu
@needs_kernels
def test_variants_give_the_same_bits(rng):
    """Groups of 0 to 6 blocks (a ping-pong mainloop has odd and even tails): every
    bf16-output variant within the float64 bands and bitwise equal to the first (each
    promotes the same block sums in the same order)."""
    sizes = [128, 0, 129, 300, 512, 513, 640, 768, 1]  # 1, 0, 2, 3, 4, 5, 5, 6, 1 blocks
    lhs, rhs = operands(rng, sum(sizes), 256, 384, sizes)
    outs = [_check(lhs, rhs, sizes, jnp.bfloat16, v) for v in BF16_VARIANTS]
    for v, o in zip(BF16_VARIANTS[1:], outs[1:]):
        np.testing.assert_array_equal(o, outs[0], err_msg=v)


@pytest.mark.gpu
@needs_kernels
def test_handler_rejects_bad_buffers(rng):
    """The C++ handler's own checks: a scale of the wrong shape reaches the custom call only
    by hand, and fails with the argument named."""
    lhs, rhs = operands(rng, 64, 128, 256, [32, 32])
    a, sa = fp8_block.token_major_blocks(lhs)
    b, sb = fp8_block.token_major_blocks(rhs)
    call = jax.ffi.ffi_call(gemm_ffi.GROUPED_WGRAD_FP8_BLOCK_TARGET,
                            (jax.ShapeDtypeStruct((2, 128, 256), jnp.bfloat16), gemm_ffi.ORDER_TOKEN))
    with pytest.raises(Exception, match="lhs_scale must be"):
        jax.block_until_ready(
            call(a, sa[:1], b, sb, jnp.asarray([32, 32], jnp.int32), variant=np.int32(0), rows=np.int64(64))
        )


@pytest.mark.gpu
@needs_kernels
def test_with_token_same_gradient_and_the_calls_second_result(rng):
    """``with_token=True``: the same bits as without, and the token (int32 ``[1]``, zero)
    is the kernel call's own second result, read directly (no barrier: the op's dx waits
    on it, and a scan then writes ``out`` into its stack in place); also through
    ``primitives.grouped_wgrad``, the op's entry."""
    from jax_grouped_mlp._src.op import primitives

    sizes = [300, 0, 129, 400]
    lhs, rhs = operands(rng, sum(sizes) + 50, 256, 384, sizes)
    gs = jnp.asarray(sizes, jnp.int32)
    plain = np.asarray(_kernel(lhs, rhs, gs, out_dtype=jnp.float32))
    for fn in (lambda a, b: gemm_ffi.grouped_wgrad_fp8_block(a, b, gs, out_dtype=jnp.float32, with_token=True),
               lambda a, b: primitives.grouped_wgrad(a, b, gs, jnp.float32, with_token=True)):
        fn = jax.jit(fn)
        out, token = fn(lhs, rhs)
        np.testing.assert_array_equal(np.asarray(out), plain)
        assert token.shape == (1,) and token.dtype == jnp.int32 and int(token[0]) == 0
        hlo = fn.lower(lhs, rhs).compile().as_text()
        assert "opt-barrier" not in hlo
        (call,) = [line.split(" = ")[0].strip() for line in hlo.splitlines()
                   if 'custom_call_target="jgm_grouped_wgrad_fp8_block"' in line]  # fmt: skip
        # The call's tuple is the program's result (the token returned as it is), or its
        # second element is read where it is used.
        assert call.startswith("ROOT ") or f"get-tuple-element({call}), index=1" in hlo, call
