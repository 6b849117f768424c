"""Ahead-of-time build of every kernel variant: CuTe DSL -> sm_90a -> C header + object.

Run with the build venv's Python (nvidia-cutlass-dsl installed; no GPU needed):

    python -m jax_grouped_mlp.kernels.aot --out build/kernels

For each variant of ``registry.VARIANTS`` it writes ``<name>.h`` and ``<name>.o``
(exported with ``export_to_c``: a host launch wrapper taking the stream, the cubin,
and a module load/unload pair) and the manifest ``kernels.json`` (the registry, and
the names this run exported). M, K and G are
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

from jax_grouped_mlp.kernels import registry

ARCH = registry.ARCH


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


def _fake(dtype, shape, order=None, align: int = 16):
    """A fake compact tensor to compile against: stride order ``order`` (default
    row-major), ``align``-byte aligned, 32-bit strides (every exported entry point)."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    order = tuple(reversed(range(len(shape)))) if order is None else order
    return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=align, use_32bit_stride=True)

def _grouped_gemm_args(b_k_major: bool = False, tile_counter: bool = True):
    """Fake (lhs [M, K], rhs seen as (N, K, G), out [M, N], group_sizes, tile_counter [1],
    num_ctas, stream); ``tile_counter=False`` leaves the counter out.

    rhs is N-contiguous (JAX's [G, K, N]), or K-contiguous (JAX's [G, N, K]) for ``b_k_major``.
    The counter has a symbolic length, so its exported struct is the other rank-1 tensors'.
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
            *((t(cutlass.Int32, (cute.sym_int32(),), (0,), align=4),) if tile_counter else ()),
            cutlass.Int32(132), make_fake_stream())


def _grouped_gemm_qw_args(b_k_major: bool):
    """Fake (lhs [M, K], rhs (N, K, G), out [M, N], group_sizes, choice [2], slot, count, lo,
    top, num_ctas, stream): :func:`_grouped_gemm_args` with the device-side choice among the
    ``count`` variants one FFI call launches and this launch's band of the mixed tiles
    (``choice`` has a symbolic length, so its exported struct is the other rank-1 tensors')."""
    import cutlass
    import cutlass.cute as cute

    *head, num_ctas, stream = _grouped_gemm_args(b_k_major, tile_counter=False)
    choice = _fake(cutlass.Int32, (cute.sym_int32(),), (0,), align=4)
    return (*head, choice, cutlass.Int32(0), cutlass.Int32(1), cutlass.Int32(0), cutlass.Int32(1), num_ctas, stream)


def _grouped_gemm_fp8_block_args():
    """Fake (lhs [M, K] e4m3, rhs (N, K, G) e4m3 K-contiguous (JAX's [G, N, K]), lhs_scale
    [M, KB] uint8, rhs_scale [G, NB, KB] uint8, out [M, N] bf16, group_sizes, num_ctas, stream)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    t = _fake

    m, g, kb, nb = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    n, k = cute.sym_int32(divisibility=8), cute.sym_int32(divisibility=16)
    return (t(cutlass.Float8E4M3FN, (m, k), (1, 0)), t(cutlass.Float8E4M3FN, (n, k, g), (1, 0, 2)),
            t(cutlass.Uint8, (m, kb), (1, 0), align=1), t(cutlass.Uint8, (g, nb, kb), (2, 1, 0), align=1),
            t(cutlass.BFloat16, (m, n), (1, 0)), t(cutlass.Int32, (g,), (0,), align=4),
            cutlass.Int32(132), make_fake_stream())


def _grouped_gemm_fp8_block_fc1_args():
    """Fake (lhs, rhs, lhs_scale, rhs_scale, h [M, N] bf16 as :func:`_grouped_gemm_fp8_block_args`,
    a_row [M, N] uint8, a_row_scale [M, NB] uint8, a_col [M, N] uint8, a_col_scale [BB, N]
    uint8, probs [M] f32, group_sizes, num_ctas, stream)."""
    import cutlass
    import cutlass.cute as cute

    t = _fake
    lhs, rhs, sa, sb, h, group_sizes, num_ctas, stream = _grouped_gemm_fp8_block_args()
    m, n = h.shape
    nb, bb = cute.sym_int32(), cute.sym_int32()
    return (lhs, rhs, sa, sb, h, t(cutlass.Uint8, (m, n), (1, 0)), t(cutlass.Uint8, (m, nb), (1, 0), align=1),
            t(cutlass.Uint8, (m, n), (1, 0)), t(cutlass.Uint8, (bb, n), (1, 0), align=1),
            t(cutlass.Float32, (m,), (0,), align=4), group_sizes, num_ctas, stream)


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


def _grouped_wgrad_args(out_f32: bool):
    """Fake (X seen as (K, M), dY seen as (N, M), out seen as (K, N, G), group_sizes,
    tile_counter [1] and tile_order [1] (symbolic lengths, as in :func:`_grouped_gemm_args`),
    num_ctas, stream)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    t = _fake

    m, g = cute.sym_int32(), cute.sym_int32()
    n, k = cute.sym_int32(divisibility=8), cute.sym_int32(divisibility=8)
    return (t(cutlass.BFloat16, (k, m), (0, 1)), t(cutlass.BFloat16, (n, m), (0, 1)),
            t(cutlass.Float32 if out_f32 else cutlass.BFloat16, (k, n, g), (1, 0, 2)),
            t(cutlass.Int32, (g,), (0,), align=4), t(cutlass.Int32, (cute.sym_int32(),), (0,), align=4),
            t(cutlass.Int32, (cute.sym_int32(),), (0,), align=4), cutlass.Int32(132), make_fake_stream())


def _grouped_wgrad_fp8_block_args(out_f32: bool):
    """Fake (A [K, P] e4m3, B [N, P] e4m3 (tokens contiguous), sa [NB, K] f32, sb [NB, N] f32,
    out seen as (K, N, G), group_sizes, rows, num_ctas, stream)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    t = _fake

    g, nb = cute.sym_int32(), cute.sym_int32()
    p = cute.sym_int32(divisibility=128)
    n, k = cute.sym_int32(divisibility=8), cute.sym_int32(divisibility=8)
    return (t(cutlass.Float8E4M3FN, (k, p), (1, 0)), t(cutlass.Float8E4M3FN, (n, p), (1, 0)),
            t(cutlass.Float32, (nb, k), (1, 0), align=4), t(cutlass.Float32, (nb, n), (1, 0), align=4),
            t(cutlass.Float32 if out_f32 else cutlass.BFloat16, (k, n, g), (1, 0, 2)),
            t(cutlass.Int32, (g,), (0,), align=4), cutlass.Int32(0),
            cutlass.Int32(132), make_fake_stream())


def _token_major_blocks_args():
    """Fake (x [M, K] uint8 (K % 16 == 0), group_sizes, out [K, P] uint8 (P % 128 == 0), stream)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    t = _fake
    m, g = cute.sym_int32(), cute.sym_int32()
    k, p = cute.sym_int32(divisibility=16), cute.sym_int32(divisibility=128)
    return (t(cutlass.Uint8, (m, k)), t(cutlass.Int32, (g,), align=4), t(cutlass.Uint8, (k, p)), make_fake_stream())


def _kernel(v: registry.Variant):
    """``(config, kernel object, fake arguments)`` for registry entry ``v``; the config is
    the kernel module's own, built from the entry's fields."""
    if isinstance(v, registry.GemmVariant):
        from jax_grouped_mlp.kernels.grouped_gemm_sm90 import GroupedGemmConfig, GroupedGemmSm90

        cfg = GroupedGemmConfig(
            tile_n=v.tile_n, stages=v.stages, panel_m=v.panel_m, b_k_major=v.rhs_k_major,
            fc1_epilogue=v.epilogue == "fc1", dgrad_epilogue=v.epilogue == "dgrad",
        )
        if v.epilogue == "fc1":
            from jax_grouped_mlp.kernels.grouped_gemm_fc1_sm90 import GroupedGemmFc1Sm90

            return cfg, GroupedGemmFc1Sm90(cfg), _grouped_gemm_fc1_args()
        if v.epilogue == "dgrad":
            from jax_grouped_mlp.kernels.grouped_gemm_dgrad_sm90 import GroupedGemmDgradSm90

            return cfg, GroupedGemmDgradSm90(cfg), _grouped_gemm_dgrad_args()
        return cfg, GroupedGemmSm90(cfg), _grouped_gemm_args(v.rhs_k_major)
    if isinstance(v, registry.Fp8BlockFc1Variant):
        from jax_grouped_mlp.kernels.grouped_gemm_fp8_block_fc1_sm90 import (
            Fp8BlockFc1Config, GroupedGemmFp8BlockFc1Sm90,
        )

        cfg = Fp8BlockFc1Config(tile_n=v.tile_n, stages=v.stages, panel_m=v.panel_m)
        return cfg, GroupedGemmFp8BlockFc1Sm90(cfg), _grouped_gemm_fp8_block_fc1_args()
    if isinstance(v, registry.Fp8BlockGemmVariant):
        from jax_grouped_mlp.kernels.grouped_gemm_fp8_block_sm90 import Fp8BlockGemmConfig, GroupedGemmFp8BlockSm90

        cfg = Fp8BlockGemmConfig(tile_n=v.tile_n, stages=v.stages, panel_m=v.panel_m)
        return cfg, GroupedGemmFp8BlockSm90(cfg), _grouped_gemm_fp8_block_args()
    if isinstance(v, registry.Fp8BlockWgradVariant):
        from jax_grouped_mlp.kernels.grouped_wgrad_fp8_block_sm90 import (
            Fp8BlockWgradConfig, GroupedWgradFp8BlockSm90,
        )

        cfg = Fp8BlockWgradConfig(stages=v.stages, epi_n=v.epi_n, out_f32=v.out_f32, pingpong=v.pingpong)
        return cfg, GroupedWgradFp8BlockSm90(cfg), _grouped_wgrad_fp8_block_args(v.out_f32)
    if isinstance(v, registry.TokenMajorVariant):
        from jax_grouped_mlp.kernels.token_major_blocks import TokenMajorBlocks, TokenMajorBlocksConfig

        cfg = TokenMajorBlocksConfig(threads=v.threads)
        return cfg, TokenMajorBlocks(cfg), _token_major_blocks_args()
    if isinstance(v, registry.QwGemmVariant):
        from jax_grouped_mlp.kernels.grouped_gemm_qw_sm90 import GroupedGemmQwConfig, GroupedGemmQwSm90

        cfg = GroupedGemmQwConfig(tile_t=v.tile_t, stages=v.stages, w_k_major=v.rhs_k_major, smem_a=v.smem_a)
        return cfg, GroupedGemmQwSm90(cfg), _grouped_gemm_qw_args(v.rhs_k_major)
    if isinstance(v, registry.WgradVariant):
        from jax_grouped_mlp.kernels.grouped_wgrad_sm90 import GroupedWgradConfig, GroupedWgradSm90

        cfg = GroupedWgradConfig(tile_n=v.tile_n, stages=v.stages, epi_n=v.epi_n, out_f32=v.out_f32)
        return cfg, GroupedWgradSm90(cfg), _grouped_wgrad_args(v.out_f32)
    if isinstance(v, registry.FakeQuantizeVariant):
        from jax_grouped_mlp.kernels.fake_quantize_mxfp8 import (
            PAIR_MODES, FakeQuantizeConfig, FakeQuantizeMxfp8, FakeQuantizePairMxfp8,
        )

        cfg = FakeQuantizeConfig(vec=v.vec, threads=v.threads, mode=v.mode)
        if v.mode in PAIR_MODES:
            return cfg, FakeQuantizePairMxfp8(cfg), _fake_quantize_pair_args(v.mode == "rowcol")
        return cfg, FakeQuantizeMxfp8(cfg), _fake_quantize_args()
    if isinstance(v, registry.QuantizeFp8BlockVariant):
        from jax_grouped_mlp.kernels.quantize_fp8_block import (
            QuantizeFp8Block, QuantizeFp8BlockConfig, QuantizeFp8BlockTile,
        )

        cfg = QuantizeFp8BlockConfig(vec=v.vec, threads=v.threads, mode=v.mode)
        if v.mode in ("tile", "tile_t", "row"):
            return cfg, QuantizeFp8BlockTile(cfg), _quantize_fp8_block_tile_args(transposed=v.mode == "tile_t")
        return cfg, QuantizeFp8Block(cfg), _quantize_fp8_block_pair_args(v.mode == "pair_bf16", v.mode == "pair_tm")
    if isinstance(v, registry.DequantizeVariant):
        from jax_grouped_mlp.kernels.dequantize_mxfp8 import DequantizeColMxfp8, DequantizeConfig

        cfg = DequantizeConfig(vec=v.vec, threads=v.threads)
        return cfg, DequantizeColMxfp8(cfg), _dequantize_args()
    raise TypeError(f"v must be a registry variant, got {v!r}")


def _fake_quantize_args():
    """Fake (x [M, K] bf16, group_sizes, out [M, K] bf16, stream)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    t = _fake
    m, g = cute.sym_int32(), cute.sym_int32()
    k = cute.sym_int32(divisibility=8)
    return (t(cutlass.BFloat16, (m, k)), t(cutlass.Int32, (g,), align=4), t(cutlass.BFloat16, (m, k)),
            make_fake_stream())


def _fake_quantize_pair_args(col_bf16: bool):
    """Fake (x [M, K] bf16, group_sizes, row [M, K] bf16, col [M, K] bf16 or uint8, col_scale [NB, K], stream)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    t = _fake
    m, g, nb = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    k = cute.sym_int32(divisibility=8)
    col = cutlass.BFloat16 if col_bf16 else cutlass.Uint8
    return (t(cutlass.BFloat16, (m, k)), t(cutlass.Int32, (g,), align=4), t(cutlass.BFloat16, (m, k)),
            t(col, (m, k)), t(cutlass.Uint8, (nb, k)), make_fake_stream())


def _quantize_fp8_block_pair_args(col_bf16: bool, col_token_major: bool = False):
    """Fake (x [M, K] bf16, group_sizes, row [M, K] uint8, row_scale [M, KB] uint8,
    col [M, K] uint8 or bf16 (``col_token_major``: [K, 128 NB] uint8), col_scale [NB, K]
    uint8, stream)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    t = _fake
    m, g, nb, kb = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    k = cute.sym_int32(divisibility=8)
    if col_token_major:
        col = t(cutlass.Uint8, (cute.sym_int32(), cute.sym_int32(divisibility=128)))
    else:
        col = t(cutlass.BFloat16 if col_bf16 else cutlass.Uint8, (m, k))
    return (t(cutlass.BFloat16, (m, k)), t(cutlass.Int32, (g,), align=4), t(cutlass.Uint8, (m, k)),
            t(cutlass.Uint8, (m, kb), align=1), col, t(cutlass.Uint8, (nb, k)), make_fake_stream())


def _quantize_fp8_block_tile_args(transposed: bool = False):
    """Fake (x [M, K] bf16, group_sizes, data [M, K] uint8 (``transposed``: [G * K, A],
    A % 16 == 0), scale [NB or M, KB] uint8, stream)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    t = _fake
    m, g, nb, kb = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    k = cute.sym_int32(divisibility=8)
    data = t(cutlass.Uint8, (cute.sym_int32(), cute.sym_int32(divisibility=16))) if transposed else t(cutlass.Uint8, (m, k))
    return (t(cutlass.BFloat16, (m, k)), t(cutlass.Int32, (g,), align=4), data,
            t(cutlass.Uint8, (nb, kb), align=1), make_fake_stream())


def _dequantize_args():
    """Fake (data [M, K] uint8, scale [NB, K] uint8, group_sizes, out [M, K] bf16, stream)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    t = _fake
    m, g, nb = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    k = cute.sym_int32(divisibility=8)
    return (t(cutlass.Uint8, (m, k)), t(cutlass.Uint8, (nb, k)), t(cutlass.Int32, (g,), align=4),
            t(cutlass.BFloat16, (m, k)), make_fake_stream())


def variants():
    """(name, kernel object, fake arguments) for every variant of the registry, in its order."""
    for v in registry.VARIANTS:
        cfg, kernel, args = _kernel(v)
        if cfg.name != v.name:
            raise ValueError(f"registry entry {v} builds the kernel {cfg.name!r}, not {v.name!r} (stages too many?)")
        yield v.name, kernel, args


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--only", default=None, help="build only the variant with this name")
    ap.add_argument("--keep-dir", default=None, help="also write each kernel's PTX and cubin here")
    ns = ap.parse_args(argv)
    ns.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("CUTE_DSL_ARCH", ARCH)
    if ns.keep_dir:  # the PTX and cubin of each kernel, for ptxas -v and cuobjdump -sass
        # (read by the DSL when it is imported; nvidia-cutlass-dsl 4.8 ignores the
        # --keep-ptx / --dump-dir compile options)
        pathlib.Path(ns.keep_dir).mkdir(parents=True, exist_ok=True)
        os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"
        os.environ["CUTE_DSL_DUMP_DIR"] = str(ns.keep_dir)
    _load_dialect_runtime(ns.out)

    import cutlass.cute as cute

    options = f"--gpu-arch {ARCH}"
    built = []
    for name, kernel, args in variants():
        if ns.only and name != ns.only:
            continue
        t0 = time.time()
        compiled = cute.compile(kernel, *args, options=options)
        compiled.export_to_c(str(ns.out), name, function_prefix=name)
        print(f"[aot] {name}: {time.time() - t0:.1f}s -> {ns.out / name}.h/.o", flush=True)
        built.append(name)
    # The manifest: the registry, and what this run exported (tools/build_kernels.py links those).
    (ns.out / "kernels.json").write_text(json.dumps({**registry.manifest(), "kernels": built}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
