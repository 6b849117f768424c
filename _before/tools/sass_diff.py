#!/usr/bin/env python3
"""Compares the SASS of two exported kernel objects, optionally modulo register names.

    python3 tools/sass_diff.py OLD.o NEW.o [--rename]

The objects are what ``python -m jax_grouped_mlp.kernels.aot --out DIR`` writes: host
objects with the kernel's cubin embedded as data. Each cubin is cut out of its object
(the ELF header gives its size), disassembled with ``cuobjdump -sass`` (the one the
nvidia-cutlass-dsl wheel ships under ``nvidia/cu13/bin``, or ``CUOBJDUMP``), and the
instruction lines compared. ``--rename`` maps every register (R, UR, P, UP) to its
class first, so two builds that differ only in register allocation compare equal: a
Python-side refactor of a GPU-tested kernel that leaves its instructions as they were.
That is a loose check (two programs that swap two registers' roles compare equal);
``--bijective`` is the strict one: the instructions must be equal up to one renaming
of the registers, a bijection per class (R, UR, P, UP) that holds over the whole
program, so the two compute the same thing. No GPU needed. Exit status 0 when equal,
1 when not.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile

EM_CUDA = 190


def embedded_cubins(obj: bytes) -> list[bytes]:
    """Every 64-bit CUDA ELF image inside ``obj`` (the host object's own header skipped)."""
    found = []
    i = obj.find(b"\x7fELF", 1)
    while i != -1:
        hdr = obj[i : i + 64]
        if len(hdr) == 64 and hdr[4] == 2 and struct.unpack_from("<H", hdr, 18)[0] == EM_CUDA:
            phoff, shoff = struct.unpack_from("<QQ", hdr, 32)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", hdr, 54)
            end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
            found.append(obj[i : i + end])
        i = obj.find(b"\x7fELF", i + 1)
    return found


def _cuobjdump() -> str:
    if os.environ.get("CUOBJDUMP"):
        return os.environ["CUOBJDUMP"]
    try:
        import nvidia  # the cu13 wheel the DSL depends on

        for root in nvidia.__path__:
            cand = pathlib.Path(root) / "cu13" / "bin" / "cuobjdump"
            if cand.exists():
                return str(cand)
    except ImportError:
        pass
    found = shutil.which("cuobjdump")
    if not found:
        raise SystemExit("cuobjdump not found: set CUOBJDUMP")
    return found


def sass_lines(obj_path: pathlib.Path, rename: bool) -> list[str]:
    """The instruction lines of every cubin in ``obj_path`` (encodings dropped)."""
    cubins = embedded_cubins(obj_path.read_bytes())
    if not cubins:
        raise SystemExit(f"{obj_path}: no embedded cubin")
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, cubin in enumerate(cubins):
            path = pathlib.Path(tmp) / f"{n}.cubin"
            path.write_bytes(cubin)
            out = subprocess.run([_cuobjdump(), "-sass", str(path)], capture_output=True, text=True, check=True)
            for line in out.stdout.splitlines():
                if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
                    text = re.sub(r"/\* 0x[0-9a-f]+ \*/", "", line).strip()
                    if rename:
                        text = re.sub(r"\bU?R\d+\b", "R", re.sub(r"\bU?P\d\b", "P", text))
                    lines.append(text)
    return lines


_REGISTER = re.compile(r"\b(UR|R|UP|P)(\d+)\b")


def equal_up_to_register_bijection(old: list[str], new: list[str]) -> tuple[bool, str]:
    """Whether ``new`` is ``old`` with its registers consistently renamed (one bijection
    per register class over all lines); the first line that breaks it, if any."""
    if len(old) != len(new):
        return False, f"{len(old)} vs {len(new)} instructions"
    fwd: dict[str, str] = {}
    back: dict[str, str] = {}
    for i, (a, b) in enumerate(zip(old, new)):
        ra, rb = _REGISTER.findall(a), _REGISTER.findall(b)
        if _REGISTER.sub(r"\1#", a) != _REGISTER.sub(r"\1#", b) or len(ra) != len(rb):
            return False, f"line {i}: {a!r} vs {b!r}"
        for (ca, na), (cb, nb) in zip(ra, rb):
            x, y = ca + na, cb + nb
            if fwd.setdefault(x, y) != y or back.setdefault(y, x) != x:
                return False, f"line {i}: {x} -> {y} breaks the renaming ({x} -> {fwd[x]}, {back[y]} -> {y})"
    return True, f"{len(fwd)} registers renamed consistently" if fwd != {k: k for k in fwd} else "identical"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=pathlib.Path)
    ap.add_argument("new", type=pathlib.Path)
    ap.add_argument("--rename", action="store_true", help="compare modulo register names")
    ap.add_argument("--bijective", action="store_true",
                    help="equal up to one consistent renaming of the registers (the strict check)")
    ns = ap.parse_args(argv)
    if ns.bijective:
        ok, why = equal_up_to_register_bijection(sass_lines(ns.old, False), sass_lines(ns.new, False))
        print(("equal: " if ok else "differ: ") + why)
        return 0 if ok else 1
    old, new = sass_lines(ns.old, ns.rename), sass_lines(ns.new, ns.rename)
    differing = sum(a != b for a, b in zip(old, new)) + abs(len(old) - len(new))
    print(f"{len(old)} vs {len(new)} instructions, {differing} differing lines"
          + (" (registers renamed)" if ns.rename else ""))
    return 0 if differing == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
