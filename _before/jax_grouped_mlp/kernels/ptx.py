"""Small PTX helpers for the MXFP8 kernels (CuTe DSL inline assembly).

Everything here works on raw bit patterns: bf16 pairs packed in a 32-bit word
(element 0 in the low half), E8M0 scale bytes in the low byte of a 32-bit word.
Only used at kernel build time (needs nvidia-cutlass-dsl).
"""

from __future__ import annotations

from cutlass import Float32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm(result_type, operands, text: str, constraints: str):
    return llvm.inline_asm(
        result_type,
        operands,
        text,
        constraints,
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def _unpack_bf16x4(w01: int, w23: int) -> str:
    """PTX lines: the bf16 pairs in operands ``$w01``, ``$w23`` -> float32 ``f0..f3``
    (exact). The asm block must declare ``x0..x3`` (b32) and ``f0..f3`` (f32)."""
    return (
        f"shl.b32 x0, ${w01}, 16;\n"
        f"and.b32 x1, ${w01}, 0xFFFF0000;\n"
        f"shl.b32 x2, ${w23}, 16;\n"
        f"and.b32 x3, ${w23}, 0xFFFF0000;\n"
        "mov.b32 f0, x0;\n"
        "mov.b32 f1, x1;\n"
        "mov.b32 f2, x2;\n"
        "mov.b32 f3, x3;\n"
    )


def _encode_f32x4_e4m3(first_scale: int) -> str:
    """PTX lines: ``f0..f3`` times the scales in operands ``first_scale .. + 3`` -> E4M3
    pairs in b16 registers ``lo``, ``hi`` (round to nearest, saturating)."""
    s = first_scale
    return (
        f"mul.rn.f32 f0, f0, ${s};\n"
        f"mul.rn.f32 f1, f1, ${s + 1};\n"
        f"mul.rn.f32 f2, f2, ${s + 2};\n"
        f"mul.rn.f32 f3, f3, ${s + 3};\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, f1, f0;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, f3, f2;\n"
    )


def _decode_e4m3x4_to_bf16(first_scale: int) -> str:
    """PTX lines: the E4M3 pairs in b16 registers ``lo``, ``hi`` -> ``$0``, ``$1``, two
    bf16x2 words of ``e4m3 * scale`` (scales: operands ``first_scale .. + 3``).

    Decoded through f16 (exact for E4M3), multiplied in float32 (exact, no flush to
    zero), rounded once to bf16: ``mxfp8.dequantize``'s arithmetic. The asm block must
    declare ``d01, d23`` (b32), ``h0..h3`` (b16) and ``f0..f3`` (f32).
    """
    s = first_scale
    return (
        "cvt.rn.f16x2.e4m3x2 d01, lo;\n"
        "cvt.rn.f16x2.e4m3x2 d23, hi;\n"
        "mov.b32 {h0, h1}, d01;\n"
        "mov.b32 {h2, h3}, d23;\n"
        "cvt.f32.f16 f0, h0;\n"
        "cvt.f32.f16 f1, h1;\n"
        "cvt.f32.f16 f2, h2;\n"
        "cvt.f32.f16 f3, h3;\n"
        f"mul.rn.f32 f0, f0, ${s};\n"
        f"mul.rn.f32 f1, f1, ${s + 1};\n"
        f"mul.rn.f32 f2, f2, ${s + 2};\n"
        f"mul.rn.f32 f3, f3, ${s + 3};\n"
        "cvt.rn.bf16x2.f32 $0, f1, f0;\n"
        "cvt.rn.bf16x2.f32 $1, f3, f2;\n"
    )


@dsl_user_op
def abs_bf16x2(a: Uint32, *, loc=None, ip=None) -> Uint32:
    """|x| of both bf16 halves as bits (clears the sign bits)."""
    return Uint32(
        _asm(T.i32(), [Uint32(a).ir_value(loc=loc, ip=ip)], "and.b32 $0, $1, 0x7FFF7FFF;", "=r,r")
    )


@dsl_user_op
def max_u16x2(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """Per-half unsigned max (sm_90). On sign-cleared bf16 bits this is |x|'s max,
    and NaN (> 0x7F80) and Inf (0x7F80) win over every finite value, so one integer
    max tracks both the amax and 'the block is not finite'."""
    return Uint32(
        _asm(
            T.i32(),
            [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)],
            "max.u16x2 $0, $1, $2;",
            "=r,r,r",
        )
    )


@dsl_user_op
def e8m0_rceil(amax_bits: Uint32, *, loc=None, ip=None) -> Uint32:
    """RCEIL E8M0 byte for a bf16 block amax given as sign-cleared bits (low 16).

    s = bf16(f32(amax) / 448), then the exponent of s rounded up unless s
    is a power of two (JAX's cast_to_e8m0_with_rounding_up). NaN/Inf amax -> 0xFF.

    The division is a multiply by float32(1/448): for every one of the 2**15
    non-negative bf16 values, bf16(a * f32(1/448)) == bf16(a / 448) bit for bit
    (checked exhaustively, subnormals included; tests/test_fake_quantize_gpu.py
    repeats the check), and it avoids div.rn's slow path and its registers.
    """
    return Uint32(
        _asm(
            T.i32(),
            [Uint32(amax_bits).ir_value(loc=loc, ip=ip)],
            "{\n"
            ".reg .b32 a, e, m, bits;\n"
            ".reg .f32 fa, fs;\n"
            ".reg .b16 h;\n"
            ".reg .pred nf, up, z, lo, ne;\n"
            "shl.b32 a, $1, 16;\n"
            "mov.b32 fa, a;\n"
            "mul.rn.f32 fs, fa, 0f3B124925;\n"
            "cvt.rn.bf16.f32 h, fs;\n"
            "mov.b32 bits, {0, h};\n"
            "shr.u32 e, bits, 23;\n"
            "and.b32 m, bits, 0x7FFFFF;\n"
            "setp.ne.u32 up, m, 0;\n"
            "setp.eq.u32 z, e, 0;\n"
            "setp.le.u32 lo, m, 0x400000;\n"
            "and.pred z, z, lo;\n"
            "not.pred z, z;\n"
            "and.pred up, up, z;\n"
            "setp.ne.u32 ne, e, 0xFE;\n"
            "and.pred up, up, ne;\n"
            "@up add.u32 e, e, 1;\n"
            "setp.ge.u32 nf, $1, 0x7F80;\n"
            "@nf mov.b32 e, 0xFF;\n"
            "mov.b32 $0, e;\n"
            "}",
            "=r,r",
        )
    )


@dsl_user_op
def e8m0_reciprocal(e: Uint32, *, loc=None, ip=None) -> Float32:
    """2**(127 - e) as float32 (a normal number for e in [0, 254]); NaN for 0xFF,
    so that every element of a non-finite block encodes to the E4M3 NaN."""
    return Float32(
        _asm(
            T.f32(),
            [Uint32(e).ir_value(loc=loc, ip=ip)],
            "{\n"
            ".reg .b32 b;\n"
            ".reg .pred nan;\n"
            "sub.s32 b, 254, $1;\n"
            "max.s32 b, b, 1;\n"
            "shl.b32 b, b, 23;\n"
            "setp.eq.u32 nan, $1, 0xFF;\n"
            "@nan mov.b32 b, 0x7FFFFFFF;\n"
            "mov.b32 $0, b;\n"
            "}",
            "=f,r",
        )
    )


@dsl_user_op
def encode_e4m3x4(
    w0: Uint32, w1: Uint32, s0: Float32, s1: Float32, s2: Float32, s3: Float32, *, loc=None, ip=None
) -> Uint32:
    """Four bf16 (two words) -> four E4M3 bytes of ``x * s`` per element (``s``: one
    reciprocal scale per element, e.g. per column)."""
    ops = [Uint32(w0).ir_value(loc=loc, ip=ip), Uint32(w1).ir_value(loc=loc, ip=ip)]
    ops += [Float32(s).ir_value(loc=loc, ip=ip) for s in (s0, s1, s2, s3)]
    return Uint32(
        _asm(
            T.i32(),
            ops,
            "{\n"
            ".reg .b32 x0, x1, x2, x3;\n"
            ".reg .f32 f0, f1, f2, f3;\n"
            ".reg .b16 lo, hi;\n"
            + _unpack_bf16x4(1, 2)
            + _encode_f32x4_e4m3(3)
            + "mov.b32 $0, {lo, hi};\n"
            "}",
            "=r,r,r,f,f,f,f",
        )
    )


@dsl_user_op
def e8m0_value(e: Uint32, *, loc=None, ip=None) -> Float32:
    """2**(e - 127) as float32 (``e == 0``: the subnormal 2**-127); NaN for 0xFF.

    The dequantization scale, as ``mxfp8._scale_value`` computes it.
    """
    return Float32(
        _asm(
            T.f32(),
            [Uint32(e).ir_value(loc=loc, ip=ip)],
            "{\n"
            ".reg .b32 b;\n"
            ".reg .pred z, nan;\n"
            "max.u32 b, $1, 1;\n"
            "shl.b32 b, b, 23;\n"
            "setp.eq.u32 z, $1, 0;\n"
            "@z mov.b32 b, 0x00400000;\n"
            "setp.eq.u32 nan, $1, 0xFF;\n"
            "@nan mov.b32 b, 0x7FFFFFFF;\n"
            "mov.b32 $0, b;\n"
            "}",
            "=f,r",
        )
    )


@dsl_user_op
def fake_quant_bf16x4(
    w0: Uint32, w1: Uint32,
    r0: Float32, r1: Float32, r2: Float32, r3: Float32,
    v0: Float32, v1: Float32, v2: Float32, v3: Float32,
    *, loc=None, ip=None,
) -> tuple[Uint32, Uint32]:
    """Four bf16 -> their MXFP8 values as bf16: ``bf16(e4m3(x * r) * v)`` per element.

    ``r`` is the reciprocal scale (:func:`e8m0_reciprocal`), ``v`` the scale
    (:func:`e8m0_value`). The E4M3 rounding is the hardware conversion the quantize
    kernel uses; decoding goes through f16 (exact for E4M3), the product is exact in
    float32 (no flush to zero), so the result equals ``dequantize(quantize(x))``.
    """
    ops = [Uint32(w0).ir_value(loc=loc, ip=ip), Uint32(w1).ir_value(loc=loc, ip=ip)]
    ops += [Float32(s).ir_value(loc=loc, ip=ip) for s in (r0, r1, r2, r3, v0, v1, v2, v3)]
    res = _asm(
        llvm.StructType.get_literal([T.i32(), T.i32()]),
        ops,
        "{\n"
        ".reg .b32 x0, x1, x2, x3, d01, d23;\n"
        ".reg .f32 f0, f1, f2, f3;\n"
        ".reg .b16 lo, hi, h0, h1, h2, h3;\n"
        + _unpack_bf16x4(2, 3)
        + _encode_f32x4_e4m3(4)
        + _decode_e4m3x4_to_bf16(8)
        + "}",
        "=r,=r,r,r,f,f,f,f,f,f,f,f",
    )
    return (
        Uint32(llvm.extractvalue(T.i32(), res, [0], loc=loc, ip=ip)),
        Uint32(llvm.extractvalue(T.i32(), res, [1], loc=loc, ip=ip)),
    )


@dsl_user_op
def e8m0_bf16x2_scales(packed: Uint32, byte: int, *, loc=None, ip=None) -> tuple[Uint32, Uint32]:
    """For the E8M0 block scale in byte ``byte`` of ``packed``: ``(r, v)`` as bf16x2 words
    for :func:`fake_quant_bf16x2`: ``r = 2**(127 - e)`` and ``v = 2**(e - 127)`` in both
    halves (``e = 0``: ``v`` is the bf16 subnormal 2**-127), ``v`` NaN for ``e = 0xFF``
    (a non-finite block; ``r`` is then meaningless). ``e <= 247`` for every finite bf16
    block, so ``254 - e`` is a normal bf16 exponent."""
    res = _asm(
        llvm.StructType.get_literal([T.i32(), T.i32()]),
        [Uint32(packed).ir_value(loc=loc, ip=ip)],
        "{\n"
        ".reg .b32 e, r;\n"
        ".reg .pred z, nan;\n"
        f"bfe.u32 e, $2, {8 * byte}, 8;\n"
        "sub.u32 r, 254, e;\n"
        "mul.lo.u32 $0, r, 0x00800080;\n"
        "mul.lo.u32 $1, e, 0x00800080;\n"
        "setp.eq.u32 z, e, 0;\n"
        "@z mov.b32 $1, 0x00400040;\n"
        "setp.eq.u32 nan, e, 0xFF;\n"
        "@nan mov.b32 $1, 0x7FFF7FFF;\n"
        "}",
        "=r,=r,r",
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(2))


@dsl_user_op
def fake_quant_bf16x2(w: Uint32, r: Uint32, v: Uint32, *, loc=None, ip=None) -> Uint32:
    """Two bf16 (one word) -> their MXFP8 values as bf16, with the block's scale words
    from :func:`e8m0_bf16x2_scales`: ``bf16(e4m3(x * r) * v)``, the same bits as
    :func:`fake_quant_bf16x4`, in bf16x2 arithmetic only (no conversions).

    ``y = x * r`` is exact (a power of two; ``|y| <= 448 (1 + 2**-8)`` by the RCEIL
    scale). E4M3 keeps 3 mantissa bits above 2**-6 and multiples of 2**-9 below, so
    ``y`` is rounded to a multiple of ``q = 2**(max(exp(y), -6) - 3)`` by adding and
    subtracting ``c = 1.5 * 2**(max(exp(y), -6) + 4)``, whose bf16 ulp is ``q``
    (round to nearest even, as the E4M3 conversion; no saturation is ever needed).
    Then ``* v`` (exact, or rounded once to bf16 as ``mxfp8.dequantize`` does; NaN for a
    non-finite block) and the sign of ``x`` put back (E4M3 keeps the sign of values
    that round to zero). tests/test_qw_quantizer.py emulates it on the CPU against
    E4M3's rounding for every bf16 ``x`` and every finite-block scale.
    """
    ops = [Uint32(a).ir_value(loc=loc, ip=ip) for a in (w, r, v)]
    return Uint32(
        _asm(
            T.i32(),
            ops,
            "{\n"
            ".reg .b32 y, eb, c, t, s;\n"
            "mul.rn.bf16x2 y, $1, $2;\n"
            "and.b32 eb, y, 0x7F807F80;\n"
            "mov.b32 c, 0x3C803C80;\n"
            "max.u16x2 eb, eb, c;\n"
            "add.u32 c, eb, 0x02400240;\n"
            "add.rn.bf16x2 t, y, c;\n"
            "sub.rn.bf16x2 t, t, c;\n"
            "mul.rn.bf16x2 t, t, $3;\n"
            "and.b32 s, $1, 0x80008000;\n"
            "or.b32 $0, t, s;\n"
            "}",
            "=r,r,r,r",
        )
    )


@dsl_user_op
def dequant_e4m3x4_bf16(
    w: Uint32, v0: Float32, v1: Float32, v2: Float32, v3: Float32, *, loc=None, ip=None
) -> tuple[Uint32, Uint32]:
    """Four E4M3 bytes (byte ``i`` = element ``i``) times scales ``v`` -> two bf16x2 words.

    ``bf16(f32(e4m3) * v)`` per element: the E4M3 decode goes through f16 (exact), the
    product is one float32 rounding (exact for ``v = 2**k`` unless it falls below
    float32's subnormals; no flush to zero), then one bf16 rounding -- the same
    arithmetic as ``mxfp8.dequantize`` and :func:`fake_quant_bf16x4`'s second half, so
    the result equals ``dequantize(...)`` bit for bit. ``v`` NaN (E8M0 0xFF) gives NaN.
    """
    ops = [Uint32(w).ir_value(loc=loc, ip=ip)]
    ops += [Float32(s).ir_value(loc=loc, ip=ip) for s in (v0, v1, v2, v3)]
    res = _asm(
        llvm.StructType.get_literal([T.i32(), T.i32()]),
        ops,
        "{\n"
        ".reg .b32 d01, d23;\n"
        ".reg .f32 f0, f1, f2, f3;\n"
        ".reg .b16 lo, hi, h0, h1, h2, h3;\n"
        "mov.b32 {lo, hi}, $2;\n"
        + _decode_e4m3x4_to_bf16(3)
        + "}",
        "=r,=r,r,f,f,f,f",
    )
    return (
        Uint32(llvm.extractvalue(T.i32(), res, [0], loc=loc, ip=ip)),
        Uint32(llvm.extractvalue(T.i32(), res, [1], loc=loc, ip=ip)),
    )


@dsl_user_op
def srelu_scaled_bf16x2(h: Uint32, p: Float32, *, loc=None, ip=None) -> Uint32:
    """``bf16(p * relu(x)**2)`` for both bf16 halves ``x`` of ``h`` (the FC1 epilogue).

    float32 math from the bf16 input, one ``mul.rn`` per product (never fused, no flush
    to zero), one bf16 rounding: ``primitives.srelu_scaled``'s arithmetic,
    ``(probs * (r * r)).astype(bf16)`` with ``r = maximum(f32(h), 0)``. ``max.NaN``
    keeps a NaN input NaN, as ``jnp.maximum`` does.
    """
    return Uint32(
        _asm(
            T.i32(),
            [Uint32(h).ir_value(loc=loc, ip=ip), Float32(p).ir_value(loc=loc, ip=ip)],
            "{\n"
            ".reg .b32 x0, x1;\n"
            ".reg .f32 f0, f1;\n"
            "shl.b32 x0, $1, 16;\n"
            "and.b32 x1, $1, 0xFFFF0000;\n"
            "mov.b32 f0, x0;\n"
            "mov.b32 f1, x1;\n"
            "max.NaN.f32 f0, f0, 0f00000000;\n"
            "max.NaN.f32 f1, f1, 0f00000000;\n"
            "mul.rn.f32 f0, f0, f0;\n"
            "mul.rn.f32 f1, f1, f1;\n"
            "mul.rn.f32 f0, f0, $2;\n"
            "mul.rn.f32 f1, f1, $2;\n"
            "cvt.rn.bf16x2.f32 $0, f1, f0;\n"
            "}",
            "=r,r,f",
        )
    )


@dsl_user_op
def dsrelu_scaled_bf16x2(
    da: Uint32, h: Uint32, p2: Float32, acc: Float32, *, loc=None, ip=None
) -> tuple[Uint32, Float32]:
    """The FC2-dgrad epilogue on two columns: ``(bf16x2 dh, acc')`` from bf16 pairs ``da``, ``h``.

    With ``r = max(f32(h), 0)`` (``max.NaN``: a NaN ``h`` stays NaN, as ``jnp.maximum``)
    and ``d = f32(da)``, per element: ``dh = bf16((d * p2) * r)`` (``p2 = 2 * probs``, exact
    in float32), ``mlp._mlp_bwd``'s ``(da * (2.0 * probs)) * r`` with one ``mul.rn`` per
    product (never fused, no flush to zero) and one bf16 rounding; and the ``dprobs`` terms
    ``t = d * (r * r)`` added in order, ``acc' = (acc + t0) + t1`` (``add.rn``: the sum's
    order is fixed, so the result is reproducible bit for bit).
    """
    ops = [Uint32(x).ir_value(loc=loc, ip=ip) for x in (da, h)]
    ops += [Float32(x).ir_value(loc=loc, ip=ip) for x in (p2, acc)]
    res = _asm(
        llvm.StructType.get_literal([T.i32(), T.f32()]),
        ops,
        "{\n"
        ".reg .b32 x0, x1, y0, y1;\n"
        ".reg .f32 d0, d1, r0, r1, o0, o1, q0, q1, s;\n"
        "shl.b32 x0, $2, 16;\n"
        "and.b32 x1, $2, 0xFFFF0000;\n"
        "shl.b32 y0, $3, 16;\n"
        "and.b32 y1, $3, 0xFFFF0000;\n"
        "mov.b32 d0, x0;\n"
        "mov.b32 d1, x1;\n"
        "mov.b32 r0, y0;\n"
        "mov.b32 r1, y1;\n"
        "max.NaN.f32 r0, r0, 0f00000000;\n"
        "max.NaN.f32 r1, r1, 0f00000000;\n"
        "mul.rn.f32 o0, d0, $4;\n"
        "mul.rn.f32 o1, d1, $4;\n"
        "mul.rn.f32 o0, o0, r0;\n"
        "mul.rn.f32 o1, o1, r1;\n"
        "cvt.rn.bf16x2.f32 $0, o1, o0;\n"
        "mul.rn.f32 q0, r0, r0;\n"
        "mul.rn.f32 q1, r1, r1;\n"
        "mul.rn.f32 q0, d0, q0;\n"
        "mul.rn.f32 q1, d1, q1;\n"
        "add.rn.f32 s, $5, q0;\n"
        "add.rn.f32 $1, s, q1;\n"
        "}",
        "=r,=f,r,r,f,f",
    )
    return (
        Uint32(llvm.extractvalue(T.i32(), res, [0], loc=loc, ip=ip)),
        Float32(llvm.extractvalue(T.f32(), res, [1], loc=loc, ip=ip)),
    )


@dsl_user_op
def prmt(a: Uint32, b: Uint32, selector: int, *, loc=None, ip=None) -> Uint32:
    """``prmt.b32``: byte ``k`` of the result is byte ``selector``'s nibble ``k`` of the
    eight bytes ``b:a`` (``a``'s bytes 0-3, ``b``'s 4-7)."""
    return Uint32(
        _asm(
            T.i32(),
            [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)],
            f"prmt.b32 $0, $1, $2, {selector:#x};",
            "=r,r,r",
        )
    )


def transpose_bytes_4x4(w0, w1, w2, w3) -> list:
    """Four words holding a 4 x 4 byte matrix by rows (word ``i``'s byte ``e`` is element
    ``(i, e)``) -> the same matrix by columns (word ``e``'s byte ``i``). Six ``prmt``."""
    lo01, lo23 = prmt(w0, w1, 0x5140), prmt(w2, w3, 0x5140)  # (0,0) (1,0) (0,1) (1,1) / rows 2, 3
    hi01, hi23 = prmt(w0, w1, 0x7362), prmt(w2, w3, 0x7362)  # (0,2) (1,2) (0,3) (1,3) / rows 2, 3
    return [prmt(lo01, lo23, 0x5410), prmt(lo01, lo23, 0x7632), prmt(hi01, hi23, 0x5410), prmt(hi01, hi23, 0x7632)]


@dsl_user_op
def bf16x2_from_f32(f0: Float32, f1: Float32, *, loc=None, ip=None) -> Uint32:
    """``(bf16(f0), bf16(f1))`` packed (``f0`` in the low half), round to nearest even:
    the rounding of the epilogues' staging (``.to(bf16)``) on a pair of accumulators."""
    return Uint32(
        _asm(
            T.i32(),
            [Float32(f0).ir_value(loc=loc, ip=ip), Float32(f1).ir_value(loc=loc, ip=ip)],
            "cvt.rn.bf16x2.f32 $0, $2, $1;",
            "=r,f,f",
        )
    )
