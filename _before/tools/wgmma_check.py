#!/usr/bin/env python3
"""Fails when ptxas serializes any kernel's wgmmas (no GPU needed).

    /tmp/venv-dsl/bin/python tools/wgmma_check.py [--only NAME] [--keep DIR]

Run with the build venv's Python (nvidia-cutlass-dsl installed, as for
``tools/build_kernels.py``). Every variant of ``kernels/aot.variants()`` is compiled to
PTX, and the PTX is assembled for sm_90a by the CUDA toolkit's ``ptxas -v``
(``$CUDA_HOME/bin/ptxas``, else ``ptxas`` on PATH). ptxas reports

    (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized ...

when it has to wait for each wgmma before issuing the next, for example around a branch
it cannot prove warp-uniform. The kernel then runs, gives the same bits, and is slower
at every shape (session 34: the warp-group skip of the bf16 mainloop, rejected twice as
"5-17 % slower at equal sizes", was exactly this: its predicate came from the thread
index). The SASS shows it as a ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` after every ``HGMMA``.
Exit status 1 when any variant draws that diagnostic (or another "Potential Performance
Loss"), with the variant and ptxas' line; 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PERF_LOSS = re.compile(r"\(C75\d\d\) Potential Performance Loss[^\n]*")


def find_ptxas() -> str | None:
    """The CUDA toolkit's ptxas (``$CUDA_HOME/bin``, PATH, ``/usr/local/cuda*/bin``), or None."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (pathlib.Path(home) / "bin" / "ptxas").exists():
        return str(pathlib.Path(home) / "bin" / "ptxas")
    found = shutil.which("ptxas") or next(iter(sorted(pathlib.Path("/usr/local").glob("cuda*/bin/ptxas"))), None)
    return str(found) if found else None


def perf_losses(ptx: pathlib.Path, arch: str) -> list[str]:
    """ptxas' "Potential Performance Loss" lines for this PTX file."""
    tool = find_ptxas()
    if tool is None:
        raise SystemExit("ptxas not found: set CUDA_HOME")
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([tool, f"-arch={arch}", "-v", str(ptx), "-o", str(pathlib.Path(tmp) / "k.cubin")],
                             capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"ptxas failed on {ptx}:\n{out.stderr[-2000:]}")
    return PERF_LOSS.findall(out.stdout + out.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="check only the variant with this name")
    ap.add_argument("--keep", default=None, type=pathlib.Path, help="keep each variant's PTX under DIR/<name>/")
    ns = ap.parse_args(argv)
    dump = pathlib.Path(tempfile.mkdtemp(prefix="wgmma_check_"))
    os.environ["CUTE_DSL_KEEP"] = "ptx"
    os.environ["CUTE_DSL_DUMP_DIR"] = str(dump)

    from jax_grouped_mlp.kernels import aot, registry

    os.environ.setdefault("CUTE_DSL_ARCH", registry.ARCH)
    import cutlass.cute as cute

    names = [name for name, _, _ in aot.variants()]
    if ns.only and ns.only not in names:
        raise SystemExit(f"--only: no kernel variant named {ns.only!r}; the variants are {names}")
    bad, checked = [], 0
    try:
        for name, kernel, args in aot.variants():
            if ns.only and name != ns.only:
                continue
            cute.compile(kernel, *args, options=f"--gpu-arch {registry.ARCH}")
            written = sorted(dump.glob("*.ptx"))  # (each variant's PTX is removed once checked)
            if not written:
                raise SystemExit(f"{name}: the DSL wrote no PTX to {dump}")
            for ptx in written:
                for line in perf_losses(ptx, registry.ARCH):
                    bad.append(f"{name}: {line[:200]}")
                if ns.keep:
                    (ns.keep / name).mkdir(parents=True, exist_ok=True)
                    shutil.copy(ptx, ns.keep / name / ptx.name)
                ptx.unlink()
            checked += 1
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    for line in bad:
        print(line)
    print(f"wgmma_check: {checked} variants, {len(bad)} with serialized wgmmas or other ptxas performance losses")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
