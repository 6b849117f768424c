"""The w8 GEMM's fast in-kernel E4M3 -> bf16 decode, checked exhaustively on the CPU.

``kernels/ptx.py`` (``dequant_e4m3x4_bf16_fast`` and its helpers) decodes an E4M3 byte
by placing its bits in a bf16 (``prmt`` + ``<< 4`` + mask: exactly ``e4m3 * 2**-120``)
and multiplying by the bf16 ``2**(e - 7)`` (one ``mul.rn.bf16x2``), for scale bytes
``e <= 134`` and non-NaN bytes; the kernel probes every batch for the other cases and
then takes the exact float32 path of the first version. This file emulates those PTX
instructions bit for bit in numpy (``mul.rn.bf16x2`` modelled as the IEEE product rounded
once to nearest even, subnormals kept, as the PTX ISA specifies for bf16) and checks,
for all 256 E4M3 bytes x all 256 E8M0 bytes, against ``mxfp8.dequantize``:

* the fast path is bitwise equal wherever it is taken (signed zeros, E4M3 subnormals,
  bf16 subnormal results, scale byte 0 = 2**-127, up to 134);
* the probes fire exactly for the cases it is not taken (E4M3 NaN 0x7F/0xFF, scale
  bytes 135..255 including the NaN scale 0xFF), with no carry between bytes;
* the exact fallback (f16 decode, float32 multiply, one bf16 rounding) is equal too.

It also checks that ptx.py still holds the constants emulated here. No GPU needed.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_grouped_mlp._src.formats import mxfp8
from jax_grouped_mlp._src.formats.mxfp8 import MXFP8Tensor

PTX_PY = pathlib.Path(__file__).resolve().parents[1] / "jax_grouped_mlp" / "kernels" / "ptx.py"
FAST_SCALE_MAX = 134
M32 = np.uint64(0xFFFFFFFF)


# ---- bit-exact emulation of the PTX used by the kernel ----


def prmt(a, b, sel: int) -> np.ndarray:
    """PTX ``prmt.b32 d, a, b, sel`` (default mode): byte i of d is byte (sel nibble i & 7)
    of {b, a} (0-3: a, 4-7: b), or its sign replicated if the nibble's bit 3 is set."""
    a = np.asarray(a, np.uint64) & M32
    b = np.asarray(b, np.uint64) & M32
    src = [(a >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)]
    src += [(b >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)]
    out = np.zeros(np.broadcast(a, b).shape, np.uint64)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= byte << np.uint64(8 * i)
    return out


def bf16_value(bits) -> np.ndarray:
    """bf16 bit patterns (uint) -> float64 values (exact)."""
    b32 = (np.asarray(bits, np.uint64) & np.uint64(0xFFFF)).astype(np.uint32) << np.uint32(16)
    return b32.view(np.float32).astype(np.float64)


def round_bf16(v) -> np.ndarray:
    """float64 -> bf16 bits, round to nearest even once, bf16 subnormals kept, overflow -> Inf."""
    v = np.asarray(v, np.float64)
    out = np.zeros(v.shape, np.uint64)
    mag = np.abs(v)
    fin = np.isfinite(v) & (mag > 0)
    _, e = np.frexp(np.where(fin, mag, 1.0))
    qe = np.maximum(e - 1, -126) - 7  # exponent of the last mantissa bit
    r = np.rint(np.where(fin, mag, 0.0) * np.exp2(-qe.astype(np.float64))) * np.exp2(qe.astype(np.float64))
    r = np.where(r >= 2.0**128, np.inf, r)
    bits = (r.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint64)
    out = np.where(fin, bits, out)
    out = np.where(np.isinf(v), np.uint64(0x7F80), out)
    out = np.where(np.isnan(v), np.uint64(0x7FC0), out)
    return out | np.where(np.signbit(v) & ~np.isnan(v), np.uint64(0x8000), np.uint64(0))


def mul_bf16x2(a, b) -> np.ndarray:
    """``mul.rn.bf16x2``: per half, the exact product rounded once (float64 holds it exactly)."""
    a = np.asarray(a, np.uint64)
    b = np.asarray(b, np.uint64)
    out = np.zeros(np.broadcast(a, b).shape, np.uint64)
    for h in range(2):
        sh = np.uint64(16 * h)
        with np.errstate(over="ignore", invalid="ignore"):  # Inf/NaN products are part of the contract
            out |= round_bf16(bf16_value(a >> sh) * bf16_value(b >> sh)) << sh
    return out


def fast_decode(w, f01, f23):
    """``ptx.dequant_e4m3x4_bf16_fast``: four E4M3 bytes of ``w`` -> two bf16x2 words."""
    h0 = (prmt(w, 0, 0x9180) << np.uint64(4)) & np.uint64(0x87F087F0)
    h1 = (prmt(w, 0, 0xB3A2) << np.uint64(4)) & np.uint64(0x87F087F0)
    return mul_bf16x2(h0, f01), mul_bf16x2(h1, f23)


def factor_k(e):
    """``ptx.e8m0_bf16x2_factor``: ``mad.lo.u32 e, 0x00800080, 0x3C003C00``."""
    return (np.asarray(e, np.uint64) * np.uint64(0x00800080) + np.uint64(0x3C003C00)) & M32


def factor_n(s, sel: int):
    """``ptx.e8m0x2_bf16x2_factor``: prmt 0x4140 / 0x4342, then ``mad.lo.u32 h, 0x80, 0x3C003C00``."""
    h = prmt(s, 0, 0x4140 if sel == 0 else 0x4342)
    return (h * np.uint64(0x80) + np.uint64(0x3C003C00)) & M32


def nan_probe(w) -> np.ndarray:
    """``ptx.e4m3_nan_probe`` for one word, masked: bit 7 of byte i set iff byte i is NaN."""
    w = np.asarray(w, np.uint64)
    return (((w & np.uint64(0x7F7F7F7F)) + np.uint64(0x01010101)) & M32) & np.uint64(0x80808080)


def big_probe(s) -> np.ndarray:
    """``ptx.e8m0x4_big_probe`` for one word, masked: bit 7 of byte i set iff byte i > 134."""
    s = np.asarray(s, np.uint64)
    return ((((s & np.uint64(0x7F7F7F7F)) + np.uint64(0x79797979)) & M32) & s) & np.uint64(0x80808080)


def slow_decode(byte, e):
    """The exact path (``ptx.dequant_e4m3x4_bf16``): f16 decode, f32 multiply by
    ``e8m0_value(e)``, one bf16 rounding (``cvt.rn.bf16x2.f32``)."""
    x = np.asarray(byte, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    e = np.asarray(e, np.int64)
    scale = np.where(e == 0, np.float32(2.0**-127), (np.maximum(e, 1).astype(np.uint32) << 23).view(np.float32))
    scale = np.where(e == 255, np.float32(np.nan), scale).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # large scales overflow to Inf, as in float32
        return round_bf16((x * scale).astype(np.float64))


# ---- the reference: bf16(f32(e4m3) * 2**(e - 127)) on every (byte, scale) pair ----


def _dequantize_bits() -> np.ndarray:
    """[256 scale bytes, 256 E4M3 bytes] -> bf16 bits of ``mxfp8.dequantize`` (blocked along axis 0)."""
    data = np.tile(np.arange(256, dtype=np.uint8), (256 * 32, 1))  # row r: block r // 32
    scale = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 256, axis=1)
    t = MXFP8Tensor(
        jax.lax.bitcast_convert_type(jnp.asarray(data), jnp.float8_e4m3fn),
        jax.lax.bitcast_convert_type(jnp.asarray(scale), jnp.float8_e8m0fnu),
        0,
    )
    out = np.asarray(jax.lax.bitcast_convert_type(mxfp8.dequantize(t, jnp.bfloat16), jnp.uint16))
    return out[::32].astype(np.uint64)  # one row per block


def _reference_bits() -> np.ndarray:
    """The contract, computed exactly: the float64 product ``e4m3 * 2**(e - 127)`` (exact, and
    equal to the float32 one: 4 significant bits, >= 2**-136) rounded once to bf16; 0xFF NaN."""
    x = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    e = np.arange(256, dtype=np.float64)
    v = x[None, :] * np.exp2(e[:, None] - 127.0)
    v[255] = np.nan
    return round_bf16(v)


def _same(got, want) -> np.ndarray:
    """Bitwise equal, or both NaN (a NaN's payload does not reach the GEMM output)."""
    nan = lambda b: ((b & np.uint64(0x7F80)) == np.uint64(0x7F80)) & ((b & np.uint64(0x7F)) != np.uint64(0))
    return (got == want) | (nan(got) & nan(want))


_E, _B = np.meshgrid(np.arange(256, dtype=np.uint64), np.arange(256, dtype=np.uint64), indexing="ij")  # [e, byte]
_NAN_BYTE = (_B & np.uint64(0x7F)) == np.uint64(0x7F)
_FAST = (~_NAN_BYTE) & (_E <= FAST_SCALE_MAX)


def test_reference_is_mxfp8_dequantize():
    """The reference is ``mxfp8.dequantize``'s arithmetic on every pair, except where the
    float32 product or the scale 2**-127 itself is subnormal: XLA on the CPU flushes those
    to zero (680 pairs, scale bytes 0..6); the kernels keep them, as the float32 formula
    says (and as the first w8 kernel did)."""
    ref, deq = _reference_bits(), _dequantize_bits()
    x = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    prod = np.abs(x[None, :] * np.exp2(np.arange(256, dtype=np.float64)[:, None] - 127.0))
    f32_subnormal = (prod > 0) & ((prod < 2.0**-126) | (_E == 0))
    assert _same(ref, deq)[~f32_subnormal].all()
    assert (deq[f32_subnormal] & np.uint64(0x7FFF) == 0).all()  # flushed on the CPU
    assert _same(ref, slow_decode(_B, _E)).all()


def _fast_all(factor_of_e) -> np.ndarray:
    """Fast decode of every (e, byte): each word holds 4 copies of the byte (positions 0-3)."""
    w = _B * np.uint64(0x01010101)
    lo, hi = fast_decode(w, *factor_of_e)
    halves = [lo & np.uint64(0xFFFF), lo >> np.uint64(16), hi & np.uint64(0xFFFF), hi >> np.uint64(16)]
    return halves


def test_fast_decode_k_major_factor_is_exact():
    ref = _reference_bits()
    f = factor_k(_E)
    for i, got in enumerate(_fast_all((f, f))):
        bad = _FAST & (got != ref)
        assert not bad.any(), f"position {i}: {bad.sum()} mismatches, first (e, byte) {np.argwhere(bad)[0]}"


def test_fast_decode_n_major_factors_are_exact():
    """Per-column scales: word s = (e_0, e_1, e_2, e_3); each element with its own scale byte."""
    ref = _reference_bits()
    rng = np.random.default_rng(0)
    for pos in range(4):
        # scale byte e at position pos, random other scale bytes (<= 134) around it
        others = rng.integers(0, FAST_SCALE_MAX + 1, size=(3,) + _E.shape).astype(np.uint64)
        parts = list(others)
        parts.insert(pos, _E)
        s = sum(p << np.uint64(8 * i) for i, p in enumerate(parts))
        f01, f23 = factor_n(s, 0), factor_n(s, 1)
        got = _fast_all((f01, f23))[pos]
        bad = _FAST & (got != ref)
        assert not bad.any(), f"position {pos}: {bad.sum()} mismatches, first (e, byte) {np.argwhere(bad)[0]}"


def test_fast_decode_covers_the_hard_cases():
    """The eligible set includes what the brief worries about; spot values."""
    ref = _reference_bits()
    f = factor_k(_E)
    got = _fast_all((f, f))[0]
    assert _FAST[0, :0x7F].all()  # scale byte 0 = 2**-127 takes the fast path
    assert got[0, 0x80] == 0x8000 and got[100, 0x00] == 0x0000  # signed zeros survive
    sub_out = (ref & np.uint64(0x7F80)) == 0
    assert (_FAST & sub_out & (ref & np.uint64(0x7F) != 0)).any()  # bf16 subnormal results exist and match
    assert (got[_FAST] == ref[_FAST]).all()
    # E4M3 subnormals (exponent field 0) at a normal scale
    assert (got[127, 1:8] == ref[127, 1:8]).all() and (got[127, 0x81:0x88] == ref[127, 0x81:0x88]).all()


def test_probes_flag_exactly_the_slow_cases():
    # NaN probe: every byte value at every position, with every value in the next byte (carries)
    vals = np.arange(256, dtype=np.uint64)
    a, b = np.meshgrid(vals, vals, indexing="ij")
    for pos in range(3):
        w = (a << np.uint64(8 * pos)) | (b << np.uint64(8 * (pos + 1)))
        got = nan_probe(w)
        want = (((a & np.uint64(0x7F)) == np.uint64(0x7F)) << np.uint64(8 * pos + 7)) | (
            ((b & np.uint64(0x7F)) == np.uint64(0x7F)) << np.uint64(8 * (pos + 1) + 7)
        )
        assert (got == want).all()
        got = big_probe(w)
        want = ((a > FAST_SCALE_MAX).astype(np.uint64) << np.uint64(8 * pos + 7)) | (
            (b > FAST_SCALE_MAX).astype(np.uint64) << np.uint64(8 * (pos + 1) + 7)
        )
        assert (got == want).all()
    # K-major: one scale byte, (smax + 121) >> 8 is 1 iff smax > 134
    e = np.arange(256)
    assert (((e + 121) >> 8) == (e > FAST_SCALE_MAX)).all()
    # and the fast set is exactly the complement of what the probes flag
    flagged = _NAN_BYTE | (_E > FAST_SCALE_MAX)
    assert (flagged == ~_FAST).all()


def test_slow_path_is_exact_everywhere():
    assert _same(slow_decode(_B, _E), _reference_bits()).all()


def test_factors_are_powers_of_two():
    e = np.arange(FAST_SCALE_MAX + 1, dtype=np.uint64)
    f = factor_k(e)
    assert ((f >> np.uint64(16)) == (f & np.uint64(0xFFFF))).all()
    assert (bf16_value(f) == np.exp2(e.astype(np.float64) - 7)).all()
    s = e[:, None] | (e[::-1, None] << np.uint64(8)) | (e[:, None] << np.uint64(16)) | (e[::-1, None] << np.uint64(24))
    f01 = factor_n(s[:, 0], 0)
    assert (bf16_value(f01) == np.exp2(e.astype(np.float64) - 7)).all()
    assert (bf16_value(f01 >> np.uint64(16)) == np.exp2(e[::-1].astype(np.float64) - 7)).all()


def test_ptx_source_holds_the_emulated_constants():
    src = PTX_PY.read_text()
    for needle in (
        "prmt.b32 h0, $2, z, 0x9180;",
        "prmt.b32 h1, $2, z, 0xB3A2;",
        "shl.b32 h0, h0, 4;",
        "and.b32 h0, h0, 0x87F087F0;",
        "and.b32 h1, h1, 0x87F087F0;",
        "mul.rn.bf16x2 $0, h0, $3;",
        "mul.rn.bf16x2 $1, h1, $4;",
        "mad.lo.u32 $0, $1, 0x00800080, 0x3C003C00;",
        "0x4140 if sel == 0 else 0x4342",
        "mad.lo.u32 $0, h, 0x80, 0x3C003C00;",
        "and.b32 t0, $2, 0x7F7F7F7F;",
        "add.u32 t0, t0, 0x01010101;",
        "add.u32 t, t, 0x79797979;",
        f"FAST_SCALE_MAX = {FAST_SCALE_MAX}",
    ):
        assert needle in src, needle
