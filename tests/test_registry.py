"""The kernel registry (``jax_grouped_mlp/kernels/registry.py``) is the one list of variants:
unique names, the same as the built extension exports, read by the bindings without parsing
names, and the C++ tables generated from it. No GPU needed."""

from __future__ import annotations

import ast
import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest

from jax_grouped_mlp.kernels import registry
from jax_grouped_mlp.kernels.registry import Family

ROOT = pathlib.Path(__file__).resolve().parent.parent
CUDA_MODULES = sorted((ROOT / "jax_grouped_mlp" / "_src" / "cuda").glob("*.py"))


def _extension():
    try:
        from jax_grouped_mlp import _kernels
    except ImportError:
        return None
    return _kernels


def test_names_are_unique_and_match_their_fields():
    names = [v.name for v in registry.VARIANTS]
    assert len(names) == len(set(names))
    for v in registry.VARIANTS:
        assert registry.variant(v.name) is v
        assert v in registry.variants(v.family)
        assert f"_s{v.stages}" in v.name if hasattr(v, "stages") else True
    # Every family has variants; its order is the registry's order.
    for family in Family:
        assert registry.names(family), family
        assert list(registry.names(family)) == [v.name for v in registry.VARIANTS if v.family is family]


def test_registry_imports_neither_cutlass_nor_jax():
    """The build and the CPU side read it without the DSL; run in a fresh interpreter."""
    path = ROOT / "jax_grouped_mlp" / "kernels" / "registry.py"
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }
    assert not imported & {"cutlass", "jax", "jaxlib", "numpy"}, imported
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('registry', {str(path)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['registry'] = m; spec.loader.exec_module(m)\n"
        "assert not {'cutlass', 'jax'} & set(sys.modules), sorted(sys.modules)\n"
        "print(len(m.VARIANTS))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and int(out.stdout) == len(registry.VARIANTS), out.stderr


def test_unknown_name_is_a_value_error():
    with pytest.raises(ValueError, match="name must be a registered kernel variant.*'grouped_gemm_sm90_w8"):
        registry.variant("grouped_gemm_sm90_w8_m128n256k64_s3")


@pytest.mark.skipif(_extension() is None, reason="the CUDA extension is not built")
def test_extension_exports_exactly_the_registry():
    from jax_grouped_mlp._src.offload import host_store

    ext = _extension()
    for family in Family:
        assert tuple(getattr(ext, family.attr)) == registry.names(family), family
    # the kernel families, and layer_scan's host store (no kernels, no variants)
    assert set(ext.registrations()) == {f.target for f in Family} | set(host_store.TARGETS) | {host_store.EMPTY}
    assert ext.ARCH == registry.ARCH
    # No tuple of variants the registry does not know (a removed family left behind).
    exported = {a for a in dir(ext) if a.endswith("_VARIANTS")}
    assert exported == {f.attr for f in Family}


def test_built_manifest_and_header_are_the_registry():
    """What the last build wrote (when there is one) is what the registry gives now."""
    kdir = ROOT / "build" / "kernels"
    if not (kdir / "jgm_variants.h").exists():
        pytest.skip("no build in this checkout")
    manifest = json.loads((kdir / "kernels.json").read_text())
    assert sorted(manifest.pop("kernels")) == sorted(v.name for v in registry.VARIANTS)
    assert manifest == registry.manifest()
    assert (kdir / "jgm_variants.h").read_text() == registry.cxx_header()


def test_generated_header_has_every_include_and_row_in_order():
    header = registry.cxx_header()
    assert header.index('#include "kernels.h"') < min(header.index(f'#include "{v.name}.h"') for v in registry.VARIANTS)
    for family in Family:
        body = header.split(f"#define {family.macro}(X)")[1].split("\n\n")[0]
        rows = re.findall(r"X\(([^)]*)\)", body)
        assert [r.split(", ")[0] for r in rows] == list(registry.names(family))
        assert all(len(r.split(", ")) == 1 + len(family.columns) for r in rows)
    # The handlers' per-variant facts, as C++ literals.
    gemm = header.split("#define JGM_GROUPED_GEMM_VARIANTS(X)")[1].split("\n\n")[0]
    assert "X(grouped_gemm_sm90_bf16_m128n256k64_s4_bk, true)" in gemm
    qw = header.split("#define JGM_GROUPED_GEMM_QW_VARIANTS(X)")[1].split("\n\n")[0]
    assert "X(grouped_gemm_sm90_qw_w128t384k64_s3_ss, false, 384)" in qw and "_qw_" not in gemm
    assert "X(grouped_wgrad_sm90_bf16_m128n192k64_s4_f32, ffi::F32)" in header
    assert "X(grouped_gemm_sm90_bf16_m128n192k64_s5_bk_dsrelu, 192)" in header
    assert "X(fake_quantize_mxfp8_row_colq_v8_t128, ffi::F8E4M3FN)" in header
    # A pure function of its argument: one more variant gives one more include and row.
    extra = registry.GemmVariant(tile_n=64, stages=7)
    more = registry.cxx_header(registry.VARIANTS + (extra,))
    assert more.count(extra.name) == 2 and header.count(extra.name) == 0


def test_handlers_hold_no_variant_lists():
    """The C++ handlers take their includes and tables from the generated header only."""
    for src in sorted((ROOT / "csrc").glob("*.cc")):
        text = src.read_text()
        assert not re.search(r'#include "(grouped_|fake_quantize_|dequantize_)\w+\.h"', text), src.name
        assert not re.search(r"#define JGM_\w+_VARIANTS", text), src.name
        assert "keep in the order" not in text.lower(), src.name
    aot = (ROOT / "jax_grouped_mlp" / "kernels" / "aot.py").read_text()
    assert "keep in the order" not in aot.lower()


@pytest.mark.parametrize("path", CUDA_MODULES, ids=lambda p: p.name)
def test_bindings_do_not_parse_variant_names(path):
    """Variant properties come from the registry, never from the name's text."""
    text = path.read_text()
    for pattern in ('"_qw', '"_bk', '"_f32', "endswith(", "startswith(", "import re\n", "re.search", "re.match"):
        assert pattern not in text, (path.name, pattern)


def test_bindings_read_properties_from_the_registry():
    from jax_grouped_mlp._src.cuda import gemm_ffi

    assert gemm_ffi.tile_n("grouped_gemm_sm90_bf16_m128n192k64_s5_bk_dsrelu") == 192
    assert gemm_ffi.qw_tile_tokens("grouped_gemm_sm90_qw_w128t384k64_s3_ss_bk") == 384
    with pytest.raises(ValueError, match="not a _qw"):
        gemm_ffi.qw_tile_tokens("grouped_gemm_sm90_bf16_m128n256k64_s4")
    assert str(gemm_ffi._wgrad_out_dtype("grouped_wgrad_sm90_bf16_m128n256k64_s4_f32")) == "float32"
    assert str(gemm_ffi._wgrad_out_dtype("grouped_wgrad_sm90_bf16_m128n256k64_s4_en64")) == "bfloat16"
    # default_variant takes the first of the least-padding widths (the registry's order).
    plain = tuple(v.name for v in registry.variants(Family.GROUPED_GEMM) if not v.rhs_k_major)
    assert gemm_ffi.default_variant(4096, plain) == "grouped_gemm_sm90_bf16_m128n256k64_s4"
    assert gemm_ffi.default_variant(1856, plain) == "grouped_gemm_sm90_bf16_m128n192k64_s5"
    assert gemm_ffi.default_variant(640, plain) == "grouped_gemm_sm90_bf16_m128n128k64_s6"


def test_aot_builds_the_registry_without_a_hand_list():
    """kernels/aot.py compiles registry.VARIANTS (needs cutlass to construct the kernels)."""
    if importlib.util.find_spec("cutlass") is None:
        text = (ROOT / "jax_grouped_mlp" / "kernels" / "aot.py").read_text()
        assert "registry.VARIANTS" in text and "Config(tile_n=256" not in text
        return
    from jax_grouped_mlp.kernels import aot

    assert [name for name, _, _ in aot.variants()] == [v.name for v in registry.VARIANTS]


def test_quantize_fp8_block_table_columns():
    """The fp8_block quantizers' C++ table columns: which variants write the weight tiles
    transposed (the forward's K-major copy) and which lay the group-aware copy out
    token-major (what the FP8 weight gradient reads)."""
    single = {v.mode: (v.rowwise, v.transposed) for v in registry.variants(registry.Family.QUANTIZE_FP8_BLOCK)}
    assert single == {"tile": ("false", "false"), "row": ("true", "false"), "tile_t": ("false", "true")}
    pair = {v.mode: (v.col_type, v.col_token_major) for v in registry.variants(registry.Family.QUANTIZE_FP8_BLOCK_PAIR)}
    assert pair == {"pair": ("ffi::F8E4M3FN", "false"), "pair_bf16": ("ffi::BF16", "false"),
                    "pair_tm": ("ffi::F8E4M3FN", "true")}


def test_qw_chunk_is_the_largest_token_tile_of_each_layout():
    """The mixed tiles hand every group's whole chunks of ``QW_CHUNK_TOKENS`` to the
    largest tile: a chunk must be exactly one tile of it, in both weight layouts."""
    qw = [v for v in registry.VARIANTS if isinstance(v, registry.QwGemmVariant)]
    for layout in (False, True):
        assert max(v.tile_t for v in qw if v.rhs_k_major == layout) == registry.QW_CHUNK_TOKENS
