"""tools/wgmma_check.py reads ptxas' verdict right: it flags the PTX whose wgmmas ptxas
serializes and passes the pipelined one (both the bf16 GEMM of session 34, its skip
predicate from the thread index vs made warp-uniform; tests/data/*.ptx.gz). Needs the
CUDA toolkit's ptxas (CI has it), no GPU and no CuTe DSL."""

from __future__ import annotations

import gzip
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import wgmma_check  # noqa: E402

DATA = ROOT / "tests" / "data"
needs_ptxas = pytest.mark.skipif(wgmma_check.find_ptxas() is None, reason="no ptxas (CUDA toolkit) on this machine")


def _ptx(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    out = tmp_path / name.removesuffix(".gz")
    out.write_bytes(gzip.decompress((DATA / name).read_bytes()))
    return out


@needs_ptxas
def test_serialized_wgmmas_are_flagged(tmp_path):
    lines = wgmma_check.perf_losses(_ptx(tmp_path, "wgmma_serialized_sm90a.ptx.gz"), "sm_90a")
    assert len(lines) == 1 and "(C7520)" in lines[0] and "serialized" in lines[0], lines


@needs_ptxas
def test_pipelined_wgmmas_pass(tmp_path):
    assert wgmma_check.perf_losses(_ptx(tmp_path, "wgmma_pipelined_sm90a.ptx.gz"), "sm_90a") == []


def test_the_pattern_matches_ptxas_wording():
    line = ("ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized "
            "due to program dependence on compiler-inserted WG.AR in divergent path in the function 'k'")
    assert wgmma_check.PERF_LOSS.findall(line) == [line[line.index("(C7520)"):]]
    assert not wgmma_check.PERF_LOSS.findall("ptxas info    : (C7519) warpgroup.arrive is injected in around line 1460")
