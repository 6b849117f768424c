"""Every kernel variant the extension ships, each declared once, as a typed frozen config.

Pure Python (imports neither cutlass nor jax), so everything reads it:

* ``kernels/aot.py`` compiles each variant: it builds the kernel module's own config
  class from the entry and checks that the kernel names it the same;
* ``tools/build_kernels.py`` generates from it the C++ tables of the FFI handlers
  (:func:`cxx_header` -> ``build/kernels/jgm_variants.h``: the exported headers'
  ``#include``s and one X-macro per family) and the manifest ``build/kernels/kernels.json``
  (:func:`manifest`);
* the bindings (``_src/cuda``) read a variant's properties here, by name (tile sizes,
  operand layout, output dtype, mode), never by parsing the name;
* ``tests/test_registry.py`` checks that the built extension exports exactly this.

A *family* is one FFI target (one C++ handler). Its variants are listed in the order of
the handler's ``variant`` attribute (``jgm_grouped_gemm_qw``: the indices in its
``variants`` attribute), which is the order of :data:`VARIANTS` filtered by family. A variant's ``name`` (the exported symbol prefix and the object file's stem) is
derived from its fields.

Adding a variant: add one entry to :data:`VARIANTS` (in its family's run; the default
choices in the bindings take the first of equally good variants, so put new ones after
the current defaults), then rebuild (``python tools/build_kernels.py``). Nothing else
changes: the build compiles it, the generated header gives the handler its include and
table row, the extension exports its name and the bindings find it. A
:class:`QwGemmVariant` also needs its token tile in ``heuristics.QW_TILE_COSTS`` (the
cost model of the device-side tile choice; ``tests/test_heuristics.py`` checks), and one
token tile per weight layout. A new *family* needs its kernel class in ``aot.py``, a
handler in ``csrc/`` and a binding.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar, Literal, Union

ARCH = "sm_90a"


class Family(enum.Enum):
    """An FFI handler family: ``(target, extension attribute, C++ table columns)``.

    The extension exports the family's variant names as the tuple ``attr`` and the
    generated header defines ``JGM_<attr>(X)``, expanding ``X(name, *columns)`` per
    variant (each column is a property of the variant, written as a C++ literal).
    """

    GROUPED_GEMM = ("jgm_grouped_gemm", "GROUPED_GEMM_VARIANTS", ("rhs_k_major",))
    GROUPED_GEMM_QW = ("jgm_grouped_gemm_qw", "GROUPED_GEMM_QW_VARIANTS", ("rhs_k_major", "tile_tokens"))
    GROUPED_WGRAD = ("jgm_grouped_wgrad", "GROUPED_WGRAD_VARIANTS", ("out_type",))
    GROUPED_GEMM_FC1 = ("jgm_grouped_gemm_fc1", "GROUPED_GEMM_FC1_VARIANTS", ())
    GROUPED_GEMM_DGRAD = ("jgm_grouped_gemm_dgrad", "GROUPED_GEMM_DGRAD_VARIANTS", ("tile_n",))
    FAKE_QUANTIZE = ("jgm_fake_quantize_mxfp8", "FAKE_QUANTIZE_VARIANTS", ())
    FAKE_QUANTIZE_PAIR = ("jgm_fake_quantize_pair", "FAKE_QUANTIZE_PAIR_VARIANTS", ("col_type",))
    DEQUANTIZE = ("jgm_dequantize_mxfp8", "DEQUANTIZE_VARIANTS", ())
    GROUPED_GEMM_FP8_BLOCK = ("jgm_grouped_gemm_fp8_block", "GROUPED_GEMM_FP8_BLOCK_VARIANTS", ())
    GROUPED_GEMM_FP8_BLOCK_FC1 = ("jgm_grouped_gemm_fp8_block_fc1", "GROUPED_GEMM_FP8_BLOCK_FC1_VARIANTS", ())
    QUANTIZE_FP8_BLOCK_PAIR = (
        "jgm_quantize_fp8_block_pair", "QUANTIZE_FP8_BLOCK_PAIR_VARIANTS", ("col_type", "col_token_major")
    )
    QUANTIZE_FP8_BLOCK = ("jgm_quantize_fp8_block", "QUANTIZE_FP8_BLOCK_VARIANTS", ("rowwise", "transposed"))
    GROUPED_WGRAD_FP8_BLOCK = ("jgm_grouped_wgrad_fp8_block", "GROUPED_WGRAD_FP8_BLOCK_VARIANTS", ("out_type",))
    TOKEN_MAJOR_BLOCKS = ("jgm_token_major_blocks", "TOKEN_MAJOR_BLOCKS_VARIANTS", ())

    @property
    def target(self) -> str:
        """The FFI target name (``jax.ffi.ffi_call``'s first argument)."""
        return self.value[0]

    @property
    def attr(self) -> str:
        """The extension's tuple of this family's variant names."""
        return self.value[1]

    @property
    def macro(self) -> str:
        """The X-macro of the generated header."""
        return f"JGM_{self.value[1]}"

    @property
    def columns(self) -> tuple[str, ...]:
        """The per-variant facts the handler reads, after the name."""
        return self.value[2]


Epilogue = Literal["store", "fc1", "dgrad"]
FakeQuantizeMode = Literal["row", "col", "rowcol", "row_colq"]
_EPILOGUE_FAMILY = {
    "store": Family.GROUPED_GEMM, "fc1": Family.GROUPED_GEMM_FC1, "dgrad": Family.GROUPED_GEMM_DGRAD,
}


@dataclasses.dataclass(frozen=True)
class GemmVariant:
    """``GroupedGemmSm90`` and its epilogue subclasses (``kernels/grouped_gemm_sm90.py``,
    ``grouped_gemm_fc1_sm90.py``, ``grouped_gemm_dgrad_sm90.py``): bf16 ``lhs [M, K]``
    times bf16 ``rhs``, 128-row tiles of ``tile_n`` output columns.

    stages: the shared-memory pipeline depth (the kernel config's ``num_stages``; the
      build fails if it does not fit). panel_m: row tiles per rasterization panel.
    rhs_k_major: rhs is ``[G, N, K]`` (a weight used transposed, as stored).
    epilogue: "store" (``jgm_grouped_gemm``), "fc1" (squared ReLU + MXFP8 copies,
      ``jgm_grouped_gemm_fc1``) or "dgrad" (dSReLU + dprobs, ``jgm_grouped_gemm_dgrad``).
    """

    tile_n: int
    stages: int
    rhs_k_major: bool = False
    panel_m: int = 8
    epilogue: Epilogue = "store"

    tile_m: ClassVar[int] = 128
    tile_k: ClassVar[int] = 64
    quantizes_weight: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check(self.epilogue in _EPILOGUE_FAMILY, self, "epilogue")
        _check(self.epilogue != "fc1" or not self.rhs_k_major, self, "rhs_k_major (fc1 reads [G, K, N])")
        _check(self.epilogue != "dgrad" or self.rhs_k_major, self, "rhs_k_major (dgrad reads [G, N, K])")

    @property
    def family(self) -> Family:
        return _EPILOGUE_FAMILY[self.epilogue]

    @property
    def tile_tokens(self) -> int:
        """Rows of ``lhs`` (tokens) per CTA tile."""
        return self.tile_m

    @property
    def name(self) -> str:
        s = f"grouped_gemm_sm90_bf16_m{self.tile_m}n{self.tile_n}k{self.tile_k}_s{self.stages}"
        s += f"_p{self.panel_m}" if self.panel_m != 8 else ""
        s += "_bk" if self.rhs_k_major else ""
        return s + {"store": "", "fc1": "_fc1", "dgrad": "_dsrelu"}[self.epilogue]


# The mixed tiles of the ``_qw`` GEMM (one call, every launched variant working on its
# band of each group, ``tile_scheduler.RowBand``): every group's whole chunks of this many
# tokens go to the largest tile. The largest compiled token tile, so that a chunk is
# exactly one of its tiles (tests/test_registry.py).
QW_CHUNK_TOKENS = 384


@dataclasses.dataclass(frozen=True)
class QwGemmVariant:
    """``GroupedGemmQwSm90`` (``kernels/grouped_gemm_qw_sm90.py``, ``jgm_grouped_gemm_qw``):
    the ``jgm_grouped_gemm`` operands, but the kernel multiplies by the MXFP8 values of
    ``rhs`` (quantized along K in the kernel). Tiles of 128 output columns (weight rows)
    by ``tile_t`` tokens. One FFI call launches several of these and a device-side choice
    operand says which one works (the token tile picked from the group sizes).

    smem_a: the quantized weight tile goes back to shared memory and feeds both token
      halves of a ``tile_t`` > 256 tile (name ``_ss``).
    """

    tile_t: int
    stages: int
    rhs_k_major: bool = False
    smem_a: bool = False

    tile_n: ClassVar[int] = 128  # TILE_W of the kernel: output columns per tile
    tile_k: ClassVar[int] = 64
    quantizes_weight: ClassVar[bool] = True
    family: ClassVar[Family] = Family.GROUPED_GEMM_QW

    @property
    def tile_tokens(self) -> int:
        return self.tile_t

    @property
    def name(self) -> str:
        s = f"grouped_gemm_sm90_qw_w{self.tile_n}t{self.tile_t}k{self.tile_k}_s{self.stages}"
        s += "_ss" if self.smem_a else ""
        return s + ("_bk" if self.rhs_k_major else "")


class _WgradOutput:
    """The output dtype of a weight-gradient variant (its ``out_f32`` field)."""

    out_f32: bool

    @property
    def out_dtype(self) -> str:
        """The output's dtype name (``jnp.dtype`` takes it)."""
        return "float32" if self.out_f32 else "bfloat16"

    @property
    def out_type(self) -> str:
        """The output's XLA FFI element type (a C++ table column)."""
        return "ffi::F32" if self.out_f32 else "ffi::BF16"


@dataclasses.dataclass(frozen=True)
class WgradVariant(_WgradOutput):
    """``GroupedWgradSm90`` (``kernels/grouped_wgrad_sm90.py``): ``out[g] = lhs_g^T @ rhs_g``,
    tiles of 128 x ``tile_n`` of the ``[K, N]`` output, 64 tokens per stage.

    epi_n: columns per epilogue subtile (name ``_en64`` for 64). out_f32: float32 output.
    """

    tile_n: int
    stages: int
    epi_n: int = 32
    out_f32: bool = False

    tile_m: ClassVar[int] = 128
    tile_k: ClassVar[int] = 64
    family: ClassVar[Family] = Family.GROUPED_WGRAD

    @property
    def name(self) -> str:
        s = f"grouped_wgrad_sm90_bf16_m{self.tile_m}n{self.tile_n}k{self.tile_k}_s{self.stages}"
        s += f"_en{self.epi_n}" if self.epi_n != 32 else ""
        return s + ("_f32" if self.out_f32 else "")


@dataclasses.dataclass(frozen=True)
class FakeQuantizeVariant:
    """``FakeQuantizeMxfp8`` / ``FakeQuantizePairMxfp8`` (``kernels/fake_quantize_mxfp8.py``).

    mode: "row" or "col" (one bf16 output, ``jgm_fake_quantize_mxfp8``); "rowcol" or
    "row_colq" (both copies, ``jgm_fake_quantize_pair``; the column copy as bf16 values
    or as E4M3 data). vec, threads: bf16 columns per thread, threads per CTA.
    """

    mode: FakeQuantizeMode
    vec: int = 8
    threads: int = 128

    def __post_init__(self) -> None:
        _check(self.mode in ("row", "col", "rowcol", "row_colq"), self, "mode")

    @property
    def family(self) -> Family:
        return Family.FAKE_QUANTIZE if self.mode in ("row", "col") else Family.FAKE_QUANTIZE_PAIR

    @property
    def col_type(self) -> str:
        """The column output's XLA FFI element type (pair modes; a C++ table column)."""
        return "ffi::F8E4M3FN" if self.mode == "row_colq" else "ffi::BF16"

    @property
    def name(self) -> str:
        return f"fake_quantize_mxfp8_{self.mode}_v{self.vec}_t{self.threads}"


@dataclasses.dataclass(frozen=True)
class DequantizeVariant:
    """``DequantizeColMxfp8`` (``kernels/dequantize_mxfp8.py``): a group-aware columnwise
    MXFP8 ``[M, K]`` tensor to bf16 (``jgm_dequantize_mxfp8``)."""

    vec: int = 8
    threads: int = 128

    family: ClassVar[Family] = Family.DEQUANTIZE

    @property
    def name(self) -> str:
        return f"dequantize_mxfp8_col_v{self.vec}_t{self.threads}"


@dataclasses.dataclass(frozen=True)
class Fp8BlockGemmVariant:
    """``GroupedGemmFp8BlockSm90`` (``kernels/grouped_gemm_fp8_block_sm90.py``,
    ``jgm_grouped_gemm_fp8_block``): FP8 E4M3 ``lhs [M, K]`` (E8M0 scales per 1 x 128
    block along K) times FP8 E4M3 ``rhs [G, N, K]`` (one E8M0 scale per 128 x 128 block),
    FP8 wgmma promoted into float32 every 128 of K, bf16 output. 128-row tiles of
    ``tile_n`` output columns, one 128-wide K block per pipeline stage.
    """

    tile_n: int
    stages: int
    panel_m: int = 8

    tile_m: ClassVar[int] = 128
    tile_k: ClassVar[int] = 128
    rhs_k_major: ClassVar[bool] = True
    family: ClassVar[Family] = Family.GROUPED_GEMM_FP8_BLOCK

    def __post_init__(self) -> None:
        _check(self.tile_n in (128, 256), self, "tile_n (one or two B scale blocks per tile: 128 or 256)")

    @property
    def tile_tokens(self) -> int:
        return self.tile_m

    @property
    def name(self) -> str:
        s = f"grouped_gemm_sm90_fp8block_m{self.tile_m}n{self.tile_n}k{self.tile_k}_s{self.stages}"
        return s + (f"_p{self.panel_m}" if self.panel_m != 8 else "")


@dataclasses.dataclass(frozen=True)
class Fp8BlockFc1Variant(Fp8BlockGemmVariant):
    """``GroupedGemmFp8BlockFc1Sm90`` (``kernels/grouped_gemm_fp8_block_fc1_sm90.py``,
    ``jgm_grouped_gemm_fp8_block_fc1``): :class:`Fp8BlockGemmVariant`'s GEMM writing ``h``
    and both ``fp8_block`` copies of ``a = probs * relu(h)**2`` (the FC1 epilogue)."""

    family: ClassVar[Family] = Family.GROUPED_GEMM_FP8_BLOCK_FC1

    @property
    def name(self) -> str:
        return super().name + "_fc1"


@dataclasses.dataclass(frozen=True)
class Fp8BlockWgradVariant(_WgradOutput):
    """``GroupedWgradFp8BlockSm90`` (``kernels/grouped_wgrad_fp8_block_sm90.py``,
    ``jgm_grouped_wgrad_fp8_block``): ``out[g] = lhs_g^T @ rhs_g`` on the group-aware
    ``fp8_block`` copies, laid out token-major in whole 128-token blocks; FP8 wgmma per
    block, promoted into float32 with the two blocks' scales. Tiles of 128 x 128 of the
    ``[K, N]`` output, one block per pipeline stage; bf16 or float32 output. pingpong:
    two temporary accumulators, block k + 1 issued before block k is promoted (``_pp``).
    """

    stages: int
    epi_n: int = 64
    out_f32: bool = False
    pingpong: bool = False

    tile_m: ClassVar[int] = 128
    tile_n: ClassVar[int] = 128
    tile_k: ClassVar[int] = 128
    family: ClassVar[Family] = Family.GROUPED_WGRAD_FP8_BLOCK

    @property
    def name(self) -> str:
        s = f"grouped_wgrad_sm90_fp8block_m{self.tile_m}n{self.tile_n}k{self.tile_k}_s{self.stages}"
        s += f"_en{self.epi_n}" if self.epi_n != 32 else ""
        s += "_pp" if self.pingpong else ""
        return s + ("_f32" if self.out_f32 else "")


@dataclasses.dataclass(frozen=True)
class TokenMajorVariant:
    """``TokenMajorBlocks`` (``kernels/token_major_blocks.py``, ``jgm_token_major_blocks``):
    a group-aware FP8 ``[M, K]`` copy as ``[K, 128 * (cdiv(M, 128) + G)]``, tokens
    contiguous in whole 128-token blocks (the FP8 weight gradient's operand layout)."""

    threads: int = 128

    family: ClassVar[Family] = Family.TOKEN_MAJOR_BLOCKS

    @property
    def name(self) -> str:
        return f"token_major_blocks_t{self.threads}"


@dataclasses.dataclass(frozen=True)
class QuantizeFp8BlockVariant:
    """``QuantizeFp8Block`` / ``QuantizeFp8BlockTile`` (``kernels/quantize_fp8_block.py``):
    bf16 ``[M, K]`` to the ``fp8_block`` format in one read.

    mode: "pair" (rowwise 1 x 128 blocks and the group-aware 128-row copy as E4M3,
    ``jgm_quantize_fp8_block_pair``), "pair_bf16" (the same, the group-aware copy as its
    bf16 values), "pair_tm" (as "pair", the group-aware copy laid out token-major in whole
    blocks, as the FP8 weight gradient reads it; built, not yet run on a GPU nor used by
    the op), "tile" (128 x 128 tiles of each group's rows: a weight,
    ``jgm_quantize_fp8_block``), "tile_t" (the same tiles, each expert's written transposed:
    the K-major copy a forward GEMM reads) or "row" (the rowwise copy alone,
    ``jgm_quantize_fp8_block``).
    vec, threads: bf16 columns per thread, threads per CTA.
    """

    mode: Literal["pair", "pair_bf16", "pair_tm", "tile", "tile_t", "row"]
    vec: int = 8
    threads: int = 128

    def __post_init__(self) -> None:
        _check(self.mode in ("pair", "pair_bf16", "pair_tm", "tile", "tile_t", "row"), self, "mode")

    @property
    def family(self) -> Family:
        return Family.QUANTIZE_FP8_BLOCK if self.mode in ("tile", "tile_t", "row") else Family.QUANTIZE_FP8_BLOCK_PAIR

    @property
    def rowwise(self) -> str:
        """Whether the scales are per row ([M, cdiv(K, 128)], mode "row") rather than per
        group-aware block ("tile"): a C++ table column of ``jgm_quantize_fp8_block``."""
        return "true" if self.mode == "row" else "false"

    @property
    def transposed(self) -> str:
        """Whether the data is ``[G * K, M / G]``, each group's ``[A, K]`` rows transposed
        (mode "tile_t"): a C++ table column of ``jgm_quantize_fp8_block``."""
        return "true" if self.mode == "tile_t" else "false"

    @property
    def col_type(self) -> str:
        """The group-aware copy's XLA FFI element type (pair modes; a C++ table column)."""
        return "ffi::BF16" if self.mode == "pair_bf16" else "ffi::F8E4M3FN"

    @property
    def col_token_major(self) -> str:
        """Whether the group-aware copy is written token-major in whole blocks,
        ``[K, 128 * (cdiv(M, 128) + G)]`` (mode "pair_tm"; a C++ table column)."""
        return "true" if self.mode == "pair_tm" else "false"

    @property
    def name(self) -> str:
        return f"quantize_fp8_block_{self.mode}_v{self.vec}_t{self.threads}"


Variant = Union[
    GemmVariant, QwGemmVariant, WgradVariant, FakeQuantizeVariant, DequantizeVariant, Fp8BlockGemmVariant,
    Fp8BlockFc1Variant, QuantizeFp8BlockVariant, Fp8BlockWgradVariant, TokenMajorVariant,
]


def _check(ok: bool, variant, what: str) -> None:
    if not ok:
        raise ValueError(f"bad {what} in {variant!r}")


# Every shipped variant. Within a family: the order of the handler's `variant` attribute.
VARIANTS: tuple[Variant, ...] = (
    # jgm_grouped_gemm. Default: least column padding, then the widest tile, first of
    # equals (so p4/p16, the rasterization alternatives, are picked only by name).
    GemmVariant(tile_n=256, stages=4),
    GemmVariant(tile_n=192, stages=5),
    GemmVariant(tile_n=128, stages=6),
    GemmVariant(tile_n=256, stages=4, panel_m=4),
    GemmVariant(tile_n=256, stages=4, panel_m=16),
    GemmVariant(tile_n=256, stages=4, rhs_k_major=True),
    GemmVariant(tile_n=192, stages=5, rhs_k_major=True),
    # jgm_grouped_gemm_qw: the ones that quantize the weight themselves.
    QwGemmVariant(tile_t=192, stages=5),
    QwGemmVariant(tile_t=192, stages=5, rhs_k_major=True),
    QwGemmVariant(tile_t=256, stages=4),
    QwGemmVariant(tile_t=256, stages=4, rhs_k_major=True),
    QwGemmVariant(tile_t=384, stages=3, smem_a=True),
    QwGemmVariant(tile_t=384, stages=3, smem_a=True, rhs_k_major=True),
    # jgm_grouped_wgrad: the _en64 ones first (the default takes the first of equal widths).
    WgradVariant(tile_n=256, stages=4, epi_n=64),
    WgradVariant(tile_n=192, stages=4, epi_n=64),
    WgradVariant(tile_n=256, stages=4),
    WgradVariant(tile_n=192, stages=5),
    WgradVariant(tile_n=256, stages=4, out_f32=True),
    WgradVariant(tile_n=192, stages=4, out_f32=True),
    # jgm_grouped_gemm_fc1, jgm_grouped_gemm_dgrad
    GemmVariant(tile_n=256, stages=4, epilogue="fc1"),
    GemmVariant(tile_n=192, stages=5, epilogue="fc1"),
    GemmVariant(tile_n=256, stages=4, rhs_k_major=True, epilogue="dgrad"),
    GemmVariant(tile_n=192, stages=5, rhs_k_major=True, epilogue="dgrad"),
    # jgm_fake_quantize_mxfp8, jgm_fake_quantize_pair, jgm_dequantize_mxfp8
    FakeQuantizeVariant("row"),
    FakeQuantizeVariant("col"),
    FakeQuantizeVariant("rowcol"),
    FakeQuantizeVariant("row_colq"),
    DequantizeVariant(),
    # jgm_grouped_gemm_fp8_block (the op picks by N: gemm_ffi.fp8_block_default_variant)
    Fp8BlockGemmVariant(tile_n=128, stages=6),
    Fp8BlockGemmVariant(tile_n=256, stages=4),
    # jgm_grouped_gemm_fp8_block_fc1 (picked by N as the plain GEMM is)
    Fp8BlockFc1Variant(tile_n=128, stages=6),
    Fp8BlockFc1Variant(tile_n=256, stages=4),
    # jgm_quantize_fp8_block_pair, jgm_quantize_fp8_block
    QuantizeFp8BlockVariant("pair"),
    QuantizeFp8BlockVariant("pair_bf16"),
    QuantizeFp8BlockVariant("tile"),
    QuantizeFp8BlockVariant("row"),
    QuantizeFp8BlockVariant("tile_t"),
    QuantizeFp8BlockVariant("pair_tm"),  # (session 23: built, not yet run on a GPU)
    # jgm_grouped_wgrad_fp8_block: the binding's default for an output dtype is the first
    # of that dtype. bf16: the ping-pong mainloop (the same bits as the plain one, 1-9 %
    # faster on the H200: wgrad_fp8_block_pp_h200.json), then the plain one; float32 plain.
    Fp8BlockWgradVariant(stages=5, pingpong=True),
    Fp8BlockWgradVariant(stages=5),
    Fp8BlockWgradVariant(stages=4, out_f32=True),
    # jgm_token_major_blocks
    TokenMajorVariant(),
)

_BY_NAME: dict[str, Variant] = {v.name: v for v in VARIANTS}


def variants(family: Family) -> tuple[Variant, ...]:
    """``family``'s variants in the order of its handler's ``variant`` attribute."""
    return tuple(v for v in VARIANTS if v.family is family)


def names(family: Family) -> tuple[str, ...]:
    """``family``'s variant names, in order (what the extension exports as ``family.attr``)."""
    return tuple(v.name for v in variants(family))


def variant(name: str) -> Variant:
    """The variant called ``name``, or a ValueError (an extension built from other sources)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"name must be a registered kernel variant (jax_grouped_mlp/kernels/registry.py), got "
            f"name={name!r}; an extension built from other sources needs a rebuild"
        ) from None


def _cxx(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def cxx_header(all_variants: tuple[Variant, ...] = VARIANTS) -> str:
    """The C++ header the FFI handlers include (``build/kernels/jgm_variants.h``): every
    variant's exported header, and per family ``#define JGM_<attr>(X)`` expanding
    ``X(name, *columns)`` per variant, in order."""
    lines = [
        "// Generated by tools/build_kernels.py from jax_grouped_mlp/kernels/registry.py: do not edit.",
        "#pragma once",
        "",
        '#include "kernels.h"  // first: it defines CUTE_DSL_CUDA_ERROR_CHECK for the headers below',
    ]
    lines += [f'#include "{name}.h"' for name in sorted(v.name for v in all_variants)]
    for family in Family:
        members = [v for v in all_variants if v.family is family]
        lines += ["", f"// X({', '.join(('name',) + family.columns)}): {family.target}'s variant index order."]
        rows = [f"X({', '.join([v.name] + [_cxx(getattr(v, c)) for c in family.columns])})" for v in members]
        lines.append(f"#define {family.macro}(X)" + "".join(f" \\\n  {row}" for row in rows))
    return "\n".join(lines) + "\n"


def manifest(all_variants: tuple[Variant, ...] = VARIANTS) -> dict:
    """The registry as JSON data (``build/kernels/kernels.json``): per family, its target
    and its variants in order, each with its name, kind and fields."""
    families = {}
    for family in Family:
        families[family.name.lower()] = {
            "target": family.target,
            "variants": [
                {"name": v.name, "kind": type(v).__name__, **dataclasses.asdict(v)}
                for v in all_variants if v.family is family
            ],
        }
    return {"arch": ARCH, "families": families}
