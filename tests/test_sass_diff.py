"""tools/sass_diff.py finds the cubins embedded in an exported kernel object (CPU only)."""

from __future__ import annotations

import pathlib
import struct
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import sass_diff  # noqa: E402


def _elf(machine: int, body: int, *, shoff: int, shnum: int, phoff: int = 0, phnum: int = 0) -> bytes:
    """A 64-bit ELF header (fields sass_diff reads) followed by ``body`` filler bytes."""
    hdr = bytearray(64)
    hdr[:5] = b"\x7fELF\x02"
    struct.pack_into("<H", hdr, 18, machine)
    struct.pack_into("<QQ", hdr, 32, phoff, shoff)
    struct.pack_into("<HHHH", hdr, 54, 56, phnum, 64, shnum)
    return bytes(hdr) + b"\xaa" * body


def test_embedded_cubins_cut_at_the_last_header_table():
    host = _elf(62, 100, shoff=0, shnum=0)  # the host object's own header (x86-64): skipped
    # Section headers end at 300 + 2 * 64 = 428; program headers further, at 500 + 3 * 56 = 668.
    cubin = _elf(sass_diff.EM_CUDA, 700, shoff=300, shnum=2, phoff=500, phnum=3)
    other = _elf(62, 50, shoff=64, shnum=1)  # a non-CUDA ELF image later in the data: ignored
    found = sass_diff.embedded_cubins(host + cubin + b"\x00" * 16 + other)
    assert [len(c) for c in found] == [668]
    assert found[0] == cubin[:668]


def test_no_cubin():
    assert sass_diff.embedded_cubins(_elf(62, 10, shoff=0, shnum=0)) == []


def test_bijective_renaming_accepts_a_consistent_renaming_only():
    old = ["IMAD R2, R4, R6, RZ ;", "ISETP.GE.AND P0, PT, R2, UR5, PT ;", "@P0 BRA 0x100 ;", "FADD R4, R2, R6 ;"]
    renamed = ["IMAD R3, R7, R6, RZ ;", "ISETP.GE.AND P1, PT, R3, UR9, PT ;", "@P1 BRA 0x100 ;", "FADD R7, R3, R6 ;"]
    assert sass_diff.equal_up_to_register_bijection(old, renamed)[0]
    assert sass_diff.equal_up_to_register_bijection(old, old) == (True, "identical")
    # Swapping two registers' roles in one instruction only: --rename would call it equal.
    swapped = ["IMAD R2, R4, R6, RZ ;", "ISETP.GE.AND P0, PT, R2, UR5, PT ;", "@P0 BRA 0x100 ;", "FADD R4, R6, R2 ;"]
    assert not sass_diff.equal_up_to_register_bijection(old, swapped)[0]
    # Two old registers onto one new one.
    merged = ["IMAD R2, R2, R6, RZ ;", *old[1:]]
    assert not sass_diff.equal_up_to_register_bijection(old, merged)[0]
    assert not sass_diff.equal_up_to_register_bijection(old, old[:3])[0]
    assert not sass_diff.equal_up_to_register_bijection(old, [old[0].replace("IMAD", "IADD3"), *old[1:]])[0]
