"""The in-register weight quantizer of the ``_qw`` GEMM, emulated bit for bit on the CPU.

``kernels/ptx.py``'s ``fake_quant_bf16x2`` fake-quantizes two bf16 values with bf16x2
arithmetic only: ``y = x * r`` (``r = 2**(127 - e)``), rounding ``y`` to E4M3's grid by
adding and subtracting ``c = 1.5 * 2**(max(exp(y), -6) + 4)``, ``* v`` (``v = 2**(e -
127)``, NaN for a non-finite block), the sign of ``x`` put back. Here every PTX step is
emulated in numpy (``add/sub/mul.rn.bf16x2`` as the exact result rounded once to nearest
even, subnormals kept, as the PTX ISA specifies for bf16; the float32 intermediate is
exact or rounds away only bits far below the bf16 ulp) and compared with E4M3's own
rounding (``ml_dtypes``) for every bf16 ``x`` and every scale byte a finite block can
have, and with ``mxfp8``'s reference quantizer on random blocks. No GPU needed.
"""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_grouped_mlp._src.formats import mxfp8

PTX_PY = pathlib.Path(__file__).resolve().parents[1] / "jax_grouped_mlp" / "kernels" / "ptx.py"
E_MAX_FINITE = 247  # RCEIL scale byte of the largest finite bf16 block amax


def _bf16(bits) -> np.ndarray:
    return np.asarray(bits, np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)


def _round(f32) -> np.ndarray:
    return np.asarray(f32, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def scales(e: int) -> tuple[np.uint16, np.uint16]:
    """``e8m0_bf16x2_scales``' ``r`` and ``v`` (one half): ``(254 - e) * 0x80``, ``e * 0x80``
    with ``e = 0`` -> 0x0040 and ``e = 0xFF`` -> 0x7FFF (NaN)."""
    v = 0x40 if e == 0 else 0x7FFF if e == 0xFF else e << 7
    return np.uint16(((254 - e) * 0x80) & 0xFFFF), np.uint16(v)


def fake_quant(x: np.ndarray, e: int) -> np.ndarray:
    """``fake_quant_bf16x2`` on bf16 bits ``x`` (uint16) for a finite block's scale byte ``e``."""
    r, v = scales(e)
    with np.errstate(over="ignore", invalid="ignore"):
        y = _round(_bf16(x) * _bf16(r))
        eb = y & np.uint16(0x7F80)
        c = (np.maximum(eb, np.uint16(0x3C80)) + np.uint16(0x0240)).astype(np.uint16)
        t = _round(_bf16(y) + _bf16(c))
        t = _round(_bf16(t) - _bf16(c))
        t = _round(_bf16(t) * _bf16(v))
    return t | (x & np.uint16(0x8000))


def e4m3_reference(x: np.ndarray, e: int) -> np.ndarray:
    """``bf16(e4m3(x / 2**(e-127)) * 2**(e-127))``: what the quantize + dequantize pair computes."""
    with np.errstate(over="ignore", invalid="ignore"):
        y = _bf16(x).astype(np.float64) * 2.0 ** (127 - e)
        q = y.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        return _round((q * 2.0 ** (e - 127)).astype(np.float32))


def test_every_bf16_value_at_every_finite_block_scale():
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    xf = _bf16(x)
    checked = 0
    for e in range(E_MAX_FINITE + 1):
        # The values a block with scale byte e can hold: |x| <= 448 * 2**(e-127) * (1 + 2**-8)
        # (the RCEIL rule computes amax / 448 in bf16, which may round down by 2**-9).
        finite = np.isfinite(xf)  # (NaN bit patterns kept out of the float64 cast: it warns)
        holds = finite & (np.abs(np.where(finite, xf, 0).astype(np.float64)) <= 449.75 * 2.0 ** (e - 127))
        got, want = fake_quant(x, e), e4m3_reference(x, e)
        bad = holds & (got != want)
        assert not bad.any(), f"e={e}: x={hex(int(x[bad][0]))} got {hex(int(got[bad][0]))} want {hex(int(want[bad][0]))}"
        checked += int(holds.sum())
    assert checked > 8_000_000


def test_non_finite_block_is_nan():
    x = np.asarray([0x0000, 0x8000, 0x3F80, 0xC2C0, 0x7F7F, 0x0001], np.uint16)
    got = fake_quant(x, 0xFF)
    assert np.isnan(_bf16(got)).all(), [hex(v) for v in got]


def test_matches_the_reference_quantizer_on_random_blocks():
    rng = np.random.default_rng(0)
    # Scale bytes >= 1: XLA:CPU flushes the subnormal scale 2**-127 (byte 0) to zero, so
    # there the reference itself differs from the GPU kernels (blocks with amax < 2**-118).
    w = rng.standard_normal((512, 32)) * 2.0 ** rng.integers(-115, 110, size=(512, 1))
    w[::7, :5] = 0.0
    w[::11, 3] *= -1e-30
    wb = np.asarray(w, np.float32).astype(ml_dtypes.bfloat16)
    q = mxfp8.quantize_mxfp8(jnp.asarray(wb), axis=1)
    want = np.asarray(mxfp8.dequantize(q, jnp.bfloat16)).view(np.uint16)
    es = np.asarray(q.scale).view(np.uint8)[:, 0]
    assert es.min() >= 1 and es.max() >= 200
    got = np.stack([fake_quant(wb[i].view(np.uint16), int(es[i])) for i in range(len(wb))])
    assert (got == want).all(), np.argwhere(got != want)[:5]


def test_ptx_source_holds_the_emulated_constants():
    src = PTX_PY.read_text()
    body = src[src.index("def fake_quant_bf16x2"):src.index("def dequant_e4m3x4_bf16(")]
    for const in ("0x7F807F80", "0x3C803C80", "0x02400240", "0x80008000", "mul.rn.bf16x2", "add.rn.bf16x2",
                  "sub.rn.bf16x2", "max.u16x2"):
        assert const in body, const
    scl = src[src.index("def e8m0_bf16x2_scales"):src.index("def fake_quant_bf16x2")]
    for const in ("sub.u32 r, 254, e", "mul.lo.u32 $0, r, 0x00800080", "mul.lo.u32 $1, e, 0x00800080",
                  "@z mov.b32 $1, 0x00400040", "@nan mov.b32 $1, 0x7FFF7FFF"):
        assert const in scl, const
