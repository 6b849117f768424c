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
No GPU needed. Exit status 0 when equal, 1 when not.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=pathlib.Path)
    ap.add_argument("new", type=pathlib.Path)
    ap.add_argument("--rename", action="store_true", help="compare modulo register names")
    ns = ap.parse_args(argv)
    old, new = sass_lines(ns.old, ns.rename), sass_lines(ns.new, ns.rename)
    differing = sum(a != b for a, b in zip(old, new)) + abs(len(old) - len(new))
    print(f"{len(old)} vs {len(new)} instructions, {differing} differing lines"
          + (" (registers renamed)" if ns.rename else ""))
    return 0 if differing == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
