"""Ahead-of-time build of every kernel variant: CuTe DSL -> sm_90a -> C header + object.

Run with the build venv's Python (nvidia-cutlass-dsl installed; no GPU needed):

    python -m jax_grouped_mlp.kernels.aot --out build/kernels

For each variant it writes ``<name>.h`` and ``<name>.o`` (exported with
``export_to_c``: a host launch wrapper taking the stream, the cubin, and a
module load/unload pair) and one ``kernels.json`` listing them. M, K and G are
symbolic, so one binary serves every shape (K must be a multiple of 8).

``export_to_c`` needs the DSL's CUDA-dialect runtime symbols in the process even
though nothing runs: we link ``libcuda_dialect_runtime_static.a`` (whole archive)
with cudart and a one-symbol libcuda stub into a shared library and load it with
RTLD_GLOBAL first (see ``_load_dialect_runtime``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pathlib
import subprocess
import sys
import time

ARCH = "sm_90a"


def dsl_libdir() -> pathlib.Path:
    import nvidia_cutlass_dsl

    roots = [pathlib.Path(p) for p in nvidia_cutlass_dsl.__path__]
    for root in roots:
        for lib in sorted(root.glob("cu*/lib/libcuda_dialect_runtime_static.a")):
            return lib.parent
    raise FileNotFoundError(f"libcuda_dialect_runtime_static.a not found under {roots}")


def cuda_home() -> pathlib.Path:
    """The CUDA toolkit root: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, or nvcc's parent."""
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and (pathlib.Path(cand) / "include" / "cuda.h").exists():
            return pathlib.Path(cand)
    out = subprocess.run(["which", "nvcc"], capture_output=True, text=True)
    if out.returncode:
        raise FileNotFoundError("no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)")
    return pathlib.Path(out.stdout.strip()).resolve().parent.parent


def _load_dialect_runtime(workdir: pathlib.Path) -> None:
    """Makes the CUDA-dialect runtime's symbols global in this process (export needs them)."""
    lib = workdir / "libcute_dialect_rt_export.so"
    if not lib.exists():
        stub = workdir / "cuda_stub.c"
        # The archive resolves driver entry points through cudart; this stub only
        # satisfies the one direct libcuda reference so dlopen succeeds without a driver.
        stub.write_text("int cuGetProcAddress_v2(void){return 1;}\n")
        home = cuda_home()
        cudart_dirs = [home / "lib64", home / "targets/x86_64-linux/lib"]
        cmd = ["cc", "-shared", "-fPIC", "-o", str(lib), str(stub),
               "-Wl,--whole-archive", str(dsl_libdir() / "libcuda_dialect_runtime_static.a"),
               "-Wl,--no-whole-archive"]
        cmd += [f"-L{d}" for d in cudart_dirs if d.exists()]
        cmd += ["-lcudart_static", "-ldl", "-lpthread", "-lrt"]
        subprocess.run(cmd, check=True)
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


def _quantize_variants():
    from jax_grouped_mlp.kernels.quantize_mxfp8 import QuantizeConfig

    return (
        QuantizeConfig(vec=8, threads=128),
        QuantizeConfig(vec=8, threads=128, min_blocks=3),
        QuantizeConfig(vec=4, threads=128),
        QuantizeConfig(vec=4, threads=256, min_blocks=2),
    )


def _grouped_gemm_variants():
    from jax_grouped_mlp.kernels.grouped_gemm_sm90 import GroupedGemmConfig

    # Keep in the order of JGM_GROUPED_GEMM_VARIANTS in csrc/grouped_gemm.cc.
    from jax_grouped_mlp.kernels.grouped_gemm_qw_sm90 import GroupedGemmQwConfig

    # Keep in the order of JGM_GROUPED_GEMM_VARIANTS in csrc/grouped_gemm.cc. The "_qw"
    # configurations (GroupedGemmQwSm90: the weight fake-quantized in registers) share
    # the handler, arguments and launch; only what they multiply by differs.
    return (GroupedGemmConfig(tile_n=256), GroupedGemmConfig(tile_n=192), GroupedGemmConfig(tile_n=128),
            GroupedGemmConfig(tile_n=256, panel_m=4), GroupedGemmConfig(tile_n=256, panel_m=16),
            GroupedGemmConfig(tile_n=256, b_k_major=True), GroupedGemmConfig(tile_n=192, b_k_major=True),
            GroupedGemmQwConfig(tile_t=192), GroupedGemmQwConfig(tile_t=192, w_k_major=True),
            GroupedGemmQwConfig(tile_t=256), GroupedGemmQwConfig(tile_t=256, w_k_major=True),
            GroupedGemmQwConfig(tile_t=384, smem_a=True), GroupedGemmQwConfig(tile_t=384, smem_a=True, w_k_major=True))



def _fake(dtype, shape, order=None, align: int = 16):
    """A fake compact tensor to compile against: stride order ``order`` (default
    row-major), ``align``-byte aligned, 32-bit strides (every exported entry point)."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    order = tuple(reversed(range(len(shape)))) if order is None else order
    return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=align, use_32bit_stride=True)

def _grouped_gemm_args(b_k_major: bool = False):
    """Fake (lhs [M, K], rhs seen as (N, K, G), out [M, N], group_sizes, num_ctas, stream).

    rhs is N-contiguous (JAX's [G, K, N]), or K-contiguous (JAX's [G, N, K]) for ``b_k_major``.
    """
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    t = _fake

    m, g = cute.sym_int32(), cute.sym_int32()
    n, k = cute.sym_int32(divisibility=8), cute.sym_int32(divisibility=8)
    return (t(cutlass.BFloat16, (m, k), (1, 0)),
            t(cutlass.BFloat16, (n, k, g), (1, 0, 2) if b_k_major else (0, 1, 2)),
            t(cutlass.BFloat16, (m, n), (1, 0)), t(cutlass.Int32, (g,), (0,), align=4),
            cutlass.Int32(132), make_fake_stream())


def _grouped_gemm_w8_variants():
    from jax_grouped_mlp.kernels.grouped_gemm_sm90 import GroupedGemmConfig

    # Keep in the order of JGM_GROUPED_GEMM_W8_VARIANTS in csrc/grouped_gemm_w8.cc. The
    # _c7 variants (7 converter warps, 512 threads; n192 only: at n256 the consumers do not
    # fit the 128-register cap of 512 threads) come last, so the default rule (first of
    # the least-padding widths) keeps the 3-warp ones until measured.
    base = tuple(GroupedGemmConfig(tile_n=n, b_k_major=bk, b_fp8=True) for bk in (False, True) for n in (256, 192))
    return base + tuple(GroupedGemmConfig(tile_n=192, b_k_major=bk, b_fp8=True, converter_warps=7) for bk in (False, True))


def _grouped_gemm_w8_args(b_k_major: bool = False):
    """Fake (lhs [M, K] bf16, rhs (N, K, G) uint8, rhs_scale (N, KB, G) uint8, out, group_sizes, num_ctas, stream).

    rhs is N-contiguous (JAX's [G, K, N]) or K-contiguous ([G, N, K]) for ``b_k_major``;
    rhs_scale is always N-contiguous (JAX's [G, KB, N]). N and K are multiples of 16
    (16-byte TMA strides of the byte tensors).
    """
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    t = _fake

    m, g, kb = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    n, k = cute.sym_int32(divisibility=16), cute.sym_int32(divisibility=16)
    return (t(cutlass.BFloat16, (m, k), (1, 0)),
            t(cutlass.Uint8, (n, k, g), (1, 0, 2) if b_k_major else (0, 1, 2)),
            t(cutlass.Uint8, (n, kb, g), (0, 1, 2)),
            t(cutlass.BFloat16, (m, n), (1, 0)), t(cutlass.Int32, (g,), (0,), align=4),
            cutlass.Int32(132), make_fake_stream())


def _grouped_gemm_fc1_variants():
    from jax_grouped_mlp.kernels.grouped_gemm_sm90 import GroupedGemmConfig

    # Keep in the order of JGM_GROUPED_GEMM_FC1_VARIANTS in csrc/grouped_gemm_fc1.cc.
    return tuple(GroupedGemmConfig(tile_n=n, fc1_epilogue=True) for n in (256, 192))


def _grouped_gemm_fc1_args():
    """Fake (lhs [M, K], rhs (N, K, G) N-contiguous, h [M, N], a_row [M, N] bf16, a_col [M, N]
    uint8, a_scale [NB, N] uint8, probs [M] f32, group_sizes, num_ctas, stream)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    t = _fake

    m, g, nb = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    n, k = cute.sym_int32(divisibility=8), cute.sym_int32(divisibility=8)
    return (t(cutlass.BFloat16, (m, k), (1, 0)), t(cutlass.BFloat16, (n, k, g), (0, 1, 2)),
            t(cutlass.BFloat16, (m, n), (1, 0)), t(cutlass.BFloat16, (m, n), (1, 0)),
            t(cutlass.Uint8, (m, n), (1, 0)), t(cutlass.Uint8, (nb, n), (1, 0)),
            t(cutlass.Float32, (m,), (0,), align=4), t(cutlass.Int32, (g,), (0,), align=4),
            cutlass.Int32(132), make_fake_stream())


def _grouped_gemm_dgrad_variants():
    from jax_grouped_mlp.kernels.grouped_gemm_sm90 import GroupedGemmConfig

    # Keep in the order of JGM_GROUPED_GEMM_DGRAD_VARIANTS in csrc/grouped_gemm_dgrad.cc.
    return tuple(GroupedGemmConfig(tile_n=n, b_k_major=True, dgrad_epilogue=True) for n in (256, 192))


def _grouped_gemm_dgrad_args():
    """Fake (dy [M, K], w2 (N, K, G) K-contiguous, h [M, N] bf16, dh_row [M, N] bf16, dh_col
    [M, N] bf16, dpart [NT, M] f32, probs [M] f32, group_sizes, num_ctas, stream)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    t = _fake

    m, g, nt = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    n, k = cute.sym_int32(divisibility=8), cute.sym_int32(divisibility=8)
    return (t(cutlass.BFloat16, (m, k), (1, 0)), t(cutlass.BFloat16, (n, k, g), (1, 0, 2)),
            t(cutlass.BFloat16, (m, n), (1, 0)), t(cutlass.BFloat16, (m, n), (1, 0)),
            t(cutlass.BFloat16, (m, n), (1, 0)), t(cutlass.Float32, (nt, m), (1, 0), align=4),
            t(cutlass.Float32, (m,), (0,), align=4), t(cutlass.Int32, (g,), (0,), align=4),
            cutlass.Int32(132), make_fake_stream())


def _fake_quantize_variants():
    from jax_grouped_mlp.kernels.fake_quantize_mxfp8 import FakeQuantizeConfig

    # Keep in the order of JGM_FAKE_QUANTIZE_VARIANTS in csrc/fake_quantize_mxfp8.cc.
    return tuple(FakeQuantizeConfig(vec=8, threads=128, mode=mode) for mode in ("row", "col"))


def _fake_quantize_pair_variants():
    from jax_grouped_mlp.kernels.fake_quantize_mxfp8 import FakeQuantizeConfig

    # Keep in the order of JGM_FAKE_QUANTIZE_PAIR_VARIANTS in csrc/fake_quantize_mxfp8.cc.
    return tuple(FakeQuantizeConfig(vec=8, threads=128, mode=mode) for mode in ("rowcol", "row_colq"))


def _dequantize_variants():
    from jax_grouped_mlp.kernels.dequantize_mxfp8 import DequantizeConfig

    # Keep in the order of JGM_DEQUANTIZE_VARIANTS in csrc/dequantize_mxfp8.cc.
    return (DequantizeConfig(vec=8, threads=128),)


def _grouped_wgrad_variants():
    from jax_grouped_mlp.kernels.grouped_wgrad_sm90 import GroupedWgradConfig

    # Keep in the order of JGM_GROUPED_WGRAD_VARIANTS in csrc/grouped_wgrad.cc.
    # The _en64 variants first: the default choice takes the first of equal tile widths.
    return tuple(GroupedWgradConfig(tile_n=n, epi_n=64) for n in (256, 192)) + tuple(
        GroupedWgradConfig(tile_n=n, out_f32=f32) for f32 in (False, True) for n in (256, 192)
    )


def _grouped_wgrad_args(out_f32: bool):
    """Fake (X seen as (K, M), dY seen as (N, M), out seen as (K, N, G), group_sizes, num_ctas, stream)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    t = _fake

    m, g = cute.sym_int32(), cute.sym_int32()
    n, k = cute.sym_int32(divisibility=8), cute.sym_int32(divisibility=8)
    return (t(cutlass.BFloat16, (k, m), (0, 1)), t(cutlass.BFloat16, (n, m), (0, 1)),
            t(cutlass.Float32 if out_f32 else cutlass.BFloat16, (k, n, g), (1, 0, 2)),
            t(cutlass.Int32, (g,), (0,), align=4),
            cutlass.Int32(132), make_fake_stream())


def variants():
    """(name, kernel object, fake arguments) for every variant we ship."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from jax_grouped_mlp.kernels.quantize_mxfp8 import QuantizeMxfp8

    QUANTIZE_VARIANTS = _quantize_variants()

    t = _fake

    for cfg in QUANTIZE_VARIANTS:
        m = cute.sym_int32()
        k = cute.sym_int32(divisibility=8)
        kb = cute.sym_int32()
        g = cute.sym_int32()
        nb = cute.sym_int32()
        args = (
            t(cutlass.BFloat16, (m, k)),
            t(cutlass.Int32, (g,), align=4),
            t(cutlass.Uint8, (m, k)),
            t(cutlass.Uint8, (m, kb), align=1),
            t(cutlass.Uint8, (m, k)),
            t(cutlass.Uint8, (nb, k)),
            make_fake_stream(),
        )
        yield cfg.name, QuantizeMxfp8(cfg), args

    from jax_grouped_mlp.kernels.fake_quantize_mxfp8 import FakeQuantizeMxfp8

    for cfg in _fake_quantize_variants():
        m, g = cute.sym_int32(), cute.sym_int32()
        k = cute.sym_int32(divisibility=8)
        args = (t(cutlass.BFloat16, (m, k)), t(cutlass.Int32, (g,), align=4), t(cutlass.BFloat16, (m, k)),
                make_fake_stream())
        yield cfg.name, FakeQuantizeMxfp8(cfg), args

    from jax_grouped_mlp.kernels.fake_quantize_mxfp8 import FakeQuantizePairMxfp8

    for cfg in _fake_quantize_pair_variants():
        m, g, nb = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        k = cute.sym_int32(divisibility=8)
        col = cutlass.BFloat16 if cfg.mode == "rowcol" else cutlass.Uint8
        args = (t(cutlass.BFloat16, (m, k)), t(cutlass.Int32, (g,), align=4), t(cutlass.BFloat16, (m, k)),
                t(col, (m, k)), t(cutlass.Uint8, (nb, k)), make_fake_stream())
        yield cfg.name, FakeQuantizePairMxfp8(cfg), args

    from jax_grouped_mlp.kernels.dequantize_mxfp8 import DequantizeColMxfp8

    for cfg in _dequantize_variants():
        m, g, nb = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        k = cute.sym_int32(divisibility=8)
        args = (t(cutlass.Uint8, (m, k)), t(cutlass.Uint8, (nb, k)), t(cutlass.Int32, (g,), align=4),
                t(cutlass.BFloat16, (m, k)), make_fake_stream())
        yield cfg.name, DequantizeColMxfp8(cfg), args

    from jax_grouped_mlp.kernels.grouped_gemm_sm90 import GroupedGemmSm90

    from jax_grouped_mlp.kernels.grouped_gemm_qw_sm90 import GroupedGemmQwConfig, GroupedGemmQwSm90

    for cfg in _grouped_gemm_variants():
        if isinstance(cfg, GroupedGemmQwConfig):
            yield cfg.name, GroupedGemmQwSm90(cfg), _grouped_gemm_args(cfg.w_k_major)
        else:
            yield cfg.name, GroupedGemmSm90(cfg), _grouped_gemm_args(cfg.b_k_major)

    from jax_grouped_mlp.kernels.grouped_wgrad_sm90 import GroupedWgradSm90

    for cfg in _grouped_wgrad_variants():
        yield cfg.name, GroupedWgradSm90(cfg), _grouped_wgrad_args(cfg.out_f32)

    from jax_grouped_mlp.kernels.grouped_gemm_w8_sm90 import GroupedGemmW8Sm90

    for cfg in _grouped_gemm_w8_variants():
        yield cfg.name, GroupedGemmW8Sm90(cfg), _grouped_gemm_w8_args(cfg.b_k_major)

    from jax_grouped_mlp.kernels.grouped_gemm_fc1_sm90 import GroupedGemmFc1Sm90

    for cfg in _grouped_gemm_fc1_variants():
        yield cfg.name, GroupedGemmFc1Sm90(cfg), _grouped_gemm_fc1_args()

    from jax_grouped_mlp.kernels.grouped_gemm_dgrad_sm90 import GroupedGemmDgradSm90

    for cfg in _grouped_gemm_dgrad_variants():
        yield cfg.name, GroupedGemmDgradSm90(cfg), _grouped_gemm_dgrad_args()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--only", default=None, help="build only the variant with this name")
    ap.add_argument("--keep-dir", default=None, help="also write each kernel's PTX and cubin here")
    ns = ap.parse_args(argv)
    ns.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("CUTE_DSL_ARCH", ARCH)
    _load_dialect_runtime(ns.out)

    import cutlass.cute as cute

    options = f"--gpu-arch {ARCH}"
    if ns.keep_dir:  # the PTX and cubin of each kernel, for ptxas -v and cuobjdump -sass
        options += f" --keep-ptx --keep-cubin --dump-dir {ns.keep_dir}"
    built = []
    for name, kernel, args in variants():
        if ns.only and name != ns.only:
            continue
        t0 = time.time()
        compiled = cute.compile(kernel, *args, options=options)
        compiled.export_to_c(str(ns.out), name, function_prefix=name)
        print(f"[aot] {name}: {time.time() - t0:.1f}s -> {ns.out / name}.h/.o", flush=True)
        built.append(name)
    (ns.out / "kernels.json").write_text(json.dumps({"arch": ARCH, "kernels": built}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
