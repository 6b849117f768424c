#!/usr/bin/env python3
"""Builds the CUDA extension ``jax_grouped_mlp/_kernels*.so`` (no GPU needed).

    python tools/build_kernels.py            # with a Python that has nvidia-cutlass-dsl,
                                             # jax and pybind11 (the .so is for that Python)

Steps: (1) compile every CuTe DSL kernel variant of the registry
(``jax_grouped_mlp/kernels/registry.py``) for sm_90a and export it to C
(``jax_grouped_mlp/kernels/aot.py`` -> ``build/kernels/<name>.h/.o``, and the manifest
``kernels.json``); (2) generate the handlers' variant tables from the registry
(``build/kernels/jgm_variants.h``: the exported headers' includes and one X-macro per
family) and compile the FFI handlers in ``csrc/`` against XLA's FFI headers
(``jax.ffi.include_dir()``) and pybind11; (3) link them with the kernel objects, the DSL's static CUDA-dialect
runtime (whole archive) and the static CUDA runtime into one extension. The
result needs only the NVIDIA driver at run time: no cutlass-dsl, no JIT.

When the CUDA toolkit, nvidia-cutlass-dsl or pybind11 is missing it says what
is missing and exits 0 without building (``--strict``: exit 1), so the CPU path
of the package keeps working.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import shlex
import subprocess
import sys
import sysconfig
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
BUILD = ROOT / "build"
SOURCES = ["fake_quantize_mxfp8.cc", "dequantize_mxfp8.cc", "grouped_gemm.cc", "grouped_gemm_qw.cc", "grouped_wgrad.cc",
           "grouped_gemm_fc1.cc", "grouped_gemm_dgrad.cc", "grouped_gemm_fp8_block.cc", "grouped_gemm_fp8_block_fc1.cc",
           "quantize_fp8_block.cc",
           "grouped_wgrad_fp8_block.cc", "token_major_blocks.cc", "host_store.cc", "empty.cc", "module.cc"]


def _missing() -> list[str]:
    missing = []
    for mod, pkg in (("cutlass", "nvidia-cutlass-dsl>=4.8,<4.9"), ("pybind11", "pybind11"),
                     ("jax", "jax")):
        if importlib.util.find_spec(mod) is None:
            missing.append(f"{pkg} (pip install '{pkg}')")
    try:
        sys.path.insert(0, str(ROOT))
        from jax_grouped_mlp.kernels import aot

        home = aot.cuda_home()
        if not (home / "include" / "cuda_runtime.h").exists():
            missing.append(f"the CUDA toolkit headers under {home}")
    except FileNotFoundError as e:
        missing.append(str(e))
    return missing


def _inputs() -> list[pathlib.Path]:
    """Every file the extension is built from."""
    files = [pathlib.Path(__file__)]
    files += [p for p in CSRC.iterdir() if p.is_file()]
    files += sorted((ROOT / "jax_grouped_mlp" / "kernels").glob("*.py"))
    return files


def _existing_extension() -> pathlib.Path | None:
    out = ROOT / "jax_grouped_mlp" / f"_kernels{sysconfig.get_config_var('EXT_SUFFIX')}"
    return out if out.exists() else None


BUILT_AGAINST_MARKER = b"jgm-built-against-jaxlib:"  # csrc/module.cc embeds it


def _running_jaxlib() -> str:
    """The jaxlib this Python runs ("" without one: then nothing counts as up to date)."""
    try:
        import jaxlib.version
    except ImportError:
        return ""
    return jaxlib.version.__version__


def built_against(ext: pathlib.Path) -> str | None:
    """The jaxlib version the extension file was compiled against (read from its bytes,
    without loading it), or None for an extension older than the marker or a file
    without a well-formed one."""
    data = ext.read_bytes()
    i = data.find(BUILT_AGAINST_MARKER)
    end = data.find(b"\0", i) if i >= 0 else -1
    if end < 0:
        return None
    return data[i + len(BUILT_AGAINST_MARKER):end].decode("ascii", errors="replace")


# Experimental kernel switches, read from the build's environment (docs/gpu.md); the
# settings of the last build are kept in SWITCH_STAMP, so changing one rebuilds.
SWITCHES = ("JGM_SKIP_EMPTY_WARP_GROUP", "JGM_DYNAMIC_TILES")
SWITCH_STAMP = BUILD / "kernel_switches.json"


def switches() -> dict[str, str]:
    """The switches this environment turns on (set to "1", as the kernels read them)."""
    return {k: "1" for k in SWITCHES if os.environ.get(k) == "1"}


def _built_switches() -> dict | None:
    """The switches of the last build (none recorded: all off; unreadable: None)."""
    try:
        return json.loads(SWITCH_STAMP.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None


def _up_to_date(ext: pathlib.Path) -> bool:
    """Newer than every input, compiled against the jaxlib that runs now (a build for
    another jaxlib, e.g. a device's, has the same file name but is stale here) and with
    the switches this environment sets."""
    running = _running_jaxlib()
    if not running or built_against(ext) != running or _built_switches() != switches():
        return False
    return all(f.stat().st_mtime <= ext.stat().st_mtime for f in _inputs())


VERBOSE = False  # --verbose: print every command line


def _say(what: str, cmd: list[str]) -> None:
    """One line per step; the full command line only with --verbose."""
    print("+ " + shlex.join(cmd) if VERBOSE else f"[build_kernels] {what}", flush=True)


def _run(what: str, cmd: list[str]) -> None:
    _say(what, cmd)
    subprocess.run(cmd, check=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strict", action="store_true", help="fail instead of skipping")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--force", action="store_true", help="rebuild even if the extension is up to date")
    ap.add_argument("--verbose", action="store_true", help="print the compiler and linker command lines")
    ns = ap.parse_args(argv)
    global VERBOSE
    VERBOSE = ns.verbose

    built = _existing_extension()
    if built is not None and not ns.force and _up_to_date(built):
        print(f"[build_kernels] {built.relative_to(ROOT)} is up to date", flush=True)
        return 0

    missing = _missing()
    if missing:
        print("[build_kernels] NOT building the CUDA kernels (the CPU path still works); missing:\n  "
              + "\n  ".join(missing), flush=True)
        return 1 if ns.strict else 0

    import jax
    import pybind11

    from jax_grouped_mlp.kernels import aot

    t0 = time.time()
    kdir = BUILD / "kernels"
    odir = BUILD / "ext"
    odir.mkdir(parents=True, exist_ok=True)
    # (1) AOT export in a child process: the DSL is heavy and loads a runtime shim.
    _run("exporting the CuTe DSL kernels for sm_90a (one line per kernel)",
         [sys.executable, "-m", "jax_grouped_mlp.kernels.aot", "--out", str(kdir)])
    # Only what this export wrote (kernels.json): stale objects of variants built from
    # other sources (another branch, a removed variant) stay out of the extension.
    from jax_grouped_mlp.kernels import registry

    manifest = json.loads((kdir / "kernels.json").read_text())
    names = manifest.pop("kernels")
    if manifest != registry.manifest() or sorted(names) != sorted(v.name for v in registry.VARIANTS):
        raise SystemExit(f"{kdir / 'kernels.json'} does not match jax_grouped_mlp/kernels/registry.py")
    kernel_objs = [kdir / f"{name}.o" for name in names]
    header = kdir / "jgm_variants.h"
    header.write_text(registry.cxx_header())

    # (2) handlers.
    home = aot.cuda_home()
    includes = [f"-I{CSRC}", f"-I{kdir}"]
    for d in (jax.ffi.include_dir(), pybind11.get_include(), sysconfig.get_paths()["include"],
              home / "include"):
        includes += ["-isystem", str(d)]  # third-party headers: no warnings from them
    cxx = os.environ.get("CXX", "g++")
    flags = ["-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-Wall",
             f'-DJGM_JAXLIB_VERSION="{_running_jaxlib()}"', *(f"-D{name}=1" for name in switches())]
    procs, objs = [], []
    for src in SOURCES:
        obj = odir / (pathlib.Path(src).stem + ".o")
        cmd = [cxx, *flags, *includes, "-c", str(CSRC / src), "-o", str(obj)]
        _say(f"compiling csrc/{src}", cmd)
        procs.append(subprocess.Popen(cmd))
        objs.append(obj)
        if len(procs) >= ns.jobs:
            if procs.pop(0).wait():
                raise SystemExit("compile failed")
    if any(p.wait() for p in procs):
        raise SystemExit("compile failed")

    # (3) link.
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out = ROOT / "jax_grouped_mlp" / f"_kernels{suffix}"
    libdirs = [d for d in (home / "lib64", home / "targets/x86_64-linux/lib") if d.exists()]
    _run(f"linking {out.relative_to(ROOT)}", [cxx, "-shared", "-o", str(out), *map(str, objs), *map(str, kernel_objs),
          "-Wl,--whole-archive", str(aot.dsl_libdir() / "libcuda_dialect_runtime_static.a"),
          "-Wl,--no-whole-archive", *[f"-L{d}" for d in libdirs],
          "-lcudart_static", "-ldl", "-lpthread", "-lrt",
          "-Wl,--exclude-libs,ALL", "-s"])
    SWITCH_STAMP.write_text(json.dumps(switches()))
    on = ", ".join(switches())
    print(f"[build_kernels] built {out.relative_to(ROOT)} ({out.stat().st_size / 1e6:.1f} MB) "
          f"in {time.time() - t0:.0f}s" + (f", with the experimental {on}" if on else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
