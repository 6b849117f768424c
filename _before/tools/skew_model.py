"""Why skewed group sizes slow the Nano MLP step down: a tile-level model of every kernel.

    PYTHONPATH=. python3 tools/skew_model.py [--alphas inf,1,0.3] [--seeds 0,1,2,3,4] [--json FILE]

Issue 20: at Nemotron-3-Nano (M = 49152 rows, G = 128 experts, H = 2688, F = 1856) the
training step is ~1.4x slower with Dirichlet(alpha = 1) group sizes
(``benchmarks/shapes.router_group_sizes``) than with equal ones, for bf16 and mxfp8
alike. This script replays, per kernel, the schedule the kernels run (no GPU):

* the segment-scheduled GEMMs (``tile_scheduler.SegmentTileScheduler``: plain bf16
  128 x 192 tiles for the bf16 recipe; the ``_qw`` t384 ``_ss`` kernel, 128 weight
  columns x 384 tokens, that the mxfp8 recipe runs at Nano): tiles in the kernels'
  order (segment by segment, panels of 8 row tiles, column tile outer), CTA ``b`` of
  132 taking tiles ``b, b + 132, ...``;
* the weight gradients (``GroupTileScheduler``): 21 x 10 (dW1) or 15 x 14 (dW2) output
  tiles per group, each reducing over its group's rows in 64-row stages.

Per kernel and alpha it reports: tiles, the fraction of padded rows in them (MMA work on
rows that are not there), partial tiles (the slower predicated-store epilogue), the
weight bytes the row tiles read (each reads its group's weight panel for its column
tile) against the weights' size, the most weight panels in flight at once (one wave of
132 tiles: what L2 must serve from DRAM), and the modelled time: per CTA the sum of its
tiles' costs, the kernel's time the largest such sum (static round robin). Tile costs
are calibrated on the H200's equal-sizes times (``benchmarks/results/gemm_qw_h200.json``,
``wgrad_h200.json``); ``--validate`` checks the model against the skewed GEMM times
measured with the older log-normal generator (``common.routed_group_sizes``,
``results/gemm_qw_skew*_h200.json``).

It also models the proposed fixes: the weight gradient's tiles ordered longest first
(LPT) and the token tile per group (``_qw`` t256 or t192 instead of t384).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from shapes import router_group_sizes, skew_label  # noqa: E402

SMS = 132
M, G, H, F = 49152, 128, 2688, 1856
BF16 = 2
DRAM_BW = 4.0e12  # bytes/s the H200 sustains (4.8 nominal)
L2_BYTES = 50e6

# Calibration (H200, equal sizes, one 128 x 192 x 64 bf16 MMA stage = 3.1 MFLOP):
# nano_fc1 plain 0.738 ms = 30 tiles per CTA x 42 stages -> 0.586 us per stage (the
# epilogue hides behind the next tile's mainloop); wgrad dW1 0.885 ms = 204 tiles per CTA
# x (6 stages x 0.586 + EPI) -> EPI = 0.82 us per output tile (its K is short: the store
# and the barriers do not hide).
STAGE_US = 0.586
WGRAD_EPI_US = 0.82
# _qw t384 _ss: nano_fc1 0.962 ms = 15 tiles per CTA (1920 tiles) -> 64.1 us per full tile
# of 42 stages (1.53 us per stage for 2 x 192 tokens). A tile with <= 192 tokens runs
# one accumulator: QW_HALF_COST of a full tile (the weight quantization per stage
# stays). Fitted to the measured skewed t384 times with --validate.
QW384_STAGE_US = 64.1 / 42
QW_HALF_COST = 0.62
# Partial tiles (a group's last rows): predicated 16-byte stores after a wait for all
# earlier TMA stores, not overlapped with the next mainloop. Fitted with --validate.
PARTIAL_US = 2.0


def gemm_tiles(sizes: np.ndarray, tile_rows: int, n_tiles: int, panel: int = 8) -> list[tuple[int, int, int]]:
    """``(group, valid rows, column tile)`` of every tile of a segment-scheduled GEMM, in
    the kernels' order (segment by segment; panels of ``panel`` row tiles, column tile
    outer). The tail segment is empty here (the sizes sum to M)."""
    out = []
    for g, s in enumerate(sizes):
        m_tiles = -(-int(s) // tile_rows)
        for p0 in range(0, m_tiles, panel):
            rows_in_panel = min(panel, m_tiles - p0)
            for n in range(n_tiles):
                for r in range(rows_in_panel):
                    mt = p0 + r
                    out.append((g, min(tile_rows, int(s) - mt * tile_rows), n))
    return out


def round_robin(costs: np.ndarray, ctas: int = SMS) -> np.ndarray:
    """Per-CTA sums of ``costs`` when CTA ``b`` takes tiles ``b, b + ctas, ...``."""
    pad = (-len(costs)) % ctas
    return np.concatenate([costs, np.zeros(pad)]).reshape(-1, ctas).sum(0)


def greedy(costs: np.ndarray, ctas: int = SMS) -> np.ndarray:
    """Per-CTA sums when each tile goes to the CTA that frees first, in the given order
    (a dynamic tile counter); with costs sorted descending this is LPT."""
    import heapq

    heap = [(0.0, b) for b in range(ctas)]
    loads = np.zeros(ctas)
    for c in costs:
        t, b = heapq.heappop(heap)
        loads[b] = t + c
        heapq.heappush(heap, (t + c, b))
    return loads


def wave_weight_bytes(tiles: list[tuple[int, int, int]], panel_bytes: float) -> tuple[float, float]:
    """(max, mean) over waves of 132 consecutive tiles of the distinct weight panels'
    bytes: what DRAM must deliver per wave when no panel survives in L2 between waves."""
    per = []
    for w0 in range(0, len(tiles), SMS):
        per.append(len({(g, n) for g, _, n in tiles[w0:w0 + SMS]}) * panel_bytes)
    return max(per), float(np.mean(per))


def plain_gemm(sizes: np.ndarray, k: int, n: int, tile_n: int = 192, skip64: bool = False) -> dict:
    """The bf16 128 x ``tile_n`` grouped GEMM (``out [M, n] = lhs [M, k] @ w[g] [k, n]``).

    ``skip64``: the proposed change, the second consumer warp group (rows 64..127) skips
    its wgmmas when the tile has at most 64 rows (priced as half the MMA time)."""
    n_tiles = -(-n // tile_n)
    tiles = gemm_tiles(sizes, 128, n_tiles)
    valid = np.array([v for _, v, _ in tiles])
    stages = -(-k // 64)
    partial = valid < 128
    cost = stages * STAGE_US * np.where(skip64 & (valid <= 64), 0.5, 1.0) + PARTIAL_US * partial
    loads = round_robin(cost)
    wmax, wmean = wave_weight_bytes(tiles, k * tile_n * BF16)
    mma_us = stages * STAGE_US
    return {
        "tiles": len(tiles), "padded_row_fraction": 1 - valid.sum() / (128 * len(tiles)),
        "partial_tiles": int(partial.sum()),
        "weight_reads_over_weights": len(tiles) * k * tile_n / (int((sizes > 0).sum()) * k * n_tiles * tile_n),
        "wave_weight_MB_max": wmax / 1e6, "wave_weight_MB_mean": wmean / 1e6,
        # a wave's weights from DRAM against its MMA time (> 1: that wave waits on DRAM)
        "wave_dram_over_mma_max": wmax / DRAM_BW / (mma_us * 1e-6),
        "tiles_per_cta_max": int(math.ceil(len(tiles) / SMS)),
        "ms": loads.max() / 1e3, "imbalance": loads.max() / loads.mean(),
    }


def qw_gemm(sizes: np.ndarray, k: int, n: int, tile_t: int = 384, skip64: bool = False) -> dict:
    """The ``_qw`` GEMM (128 weight columns x ``tile_t`` tokens; t384 ``_ss`` runs one of
    its two 192-token accumulators for a tile of <= 192 tokens). Costs in units of the
    calibrated t384 tile; t256/t192 priced per token sub-tile of the same stage cost
    (an optimistic bound for those kernels: they measured slower per token)."""
    n_tiles = -(-n // 128)
    tiles = gemm_tiles(sizes, tile_t, n_tiles)
    valid = np.array([v for _, v, _ in tiles])
    stages = -(-k // 64)
    full = stages * QW384_STAGE_US * tile_t / 384
    if tile_t == 384 and skip64:
        # the proposed change: wgmmas of N = 64 tokens, those past the tile's tokens
        # skipped: the fixed part (the weight's conversion, 2 x QW_HALF_COST - 1 of a
        # full tile) stays, the MMA part scales with ceil(valid / 64) / 6.
        fixed = (2 * QW_HALF_COST - 1) * full
        cost = fixed + (full - fixed) * np.ceil(valid / 64) / 6
    elif tile_t == 384:
        cost = np.where(valid <= 192, QW_HALF_COST * full, full)
    else:
        cost = np.full(len(tiles), full)
    cost = cost + PARTIAL_US * (valid < tile_t)
    loads = round_robin(cost)
    return {
        "tiles": len(tiles), "padded_row_fraction": 1 - valid.sum() / (tile_t * len(tiles)),
        "weight_tile_quantizations_over_uniform": len(tiles) / (n_tiles * M / tile_t),
        "partial_tiles": int((valid < tile_t).sum()),
        "ms": loads.max() / 1e3, "imbalance": loads.max() / loads.mean(),
    }


def wgrad(sizes: np.ndarray, k_out: int, n_out: int, tile_n: int = 192, zero_us: float = 0.0) -> dict:
    """``out[g] [k_out, n_out] = lhs_g^T @ rhs_g``: every group has the same
    ``cdiv(k_out, 128) * cdiv(n_out, tile_n)`` tiles; a tile costs its group's 64-row
    stages plus the store. Round robin (today), greedy in the given order (a dynamic
    counter), LPT (longest first), and the lower bound (total / 132, or the longest tile).
    ``zero_us``: the cost of zeroing the rows past the group in a partial last slice
    (``_zero_rows_past``: scalar 2-byte shared stores, then a fence and a barrier; not
    measured, the uniform Nano case never runs it since 384 = 6 x 64)."""
    group_tiles = -(-k_out // 128) * -(-n_out // tile_n)
    per_group = np.array([-(-int(s) // 64) * STAGE_US + WGRAD_EPI_US + zero_us * (int(s) % 64 != 0) for s in sizes])
    costs = np.repeat(per_group, group_tiles)
    rr = round_robin(costs)
    lpt = greedy(np.sort(costs)[::-1])
    bound = max(costs.sum() / SMS, costs.max())
    uniform_cost = (-(-(M // G) // 64) * STAGE_US + WGRAD_EPI_US) * G * group_tiles / SMS
    return {
        "tiles": len(costs), "stages_over_uniform": float(np.sum(-(-sizes // 64))) / (G * -(-(M // G) // 64)),
        "longest_tile_us": float(costs.max()),
        "ms": rr.max() / 1e3, "imbalance": rr.max() / rr.mean(),
        "ms_dynamic_in_order": greedy(costs).max() / 1e3,
        "ms_lpt": lpt.max() / 1e3, "ms_bound": bound / 1e3,
        "work_over_uniform": costs.sum() / SMS / uniform_cost,
    }


def model(sizes: np.ndarray) -> dict:
    """Every GEMM kernel of a Nano step at these group sizes."""
    return {
        "plain fc1 [M,H]x[H,F]": plain_gemm(sizes, H, F),
        "plain fc2 [M,F]x[F,H]": plain_gemm(sizes, F, H),
        "plain dgrad fc2 (da [M,F], K=H)": plain_gemm(sizes, H, F),
        "plain dgrad fc1 (dx [M,H], K=F)": plain_gemm(sizes, F, H),
        "plain fc1, skip64 (proposed)": plain_gemm(sizes, H, F, skip64=True),
        "plain fc2, skip64 (proposed)": plain_gemm(sizes, F, H, skip64=True),
        "qw384 fc1": qw_gemm(sizes, H, F),
        "qw384 fc2": qw_gemm(sizes, F, H),
        "qw384 fc1, skip64 (proposed)": qw_gemm(sizes, H, F, skip64=True),
        "qw384 fc2, skip64 (proposed)": qw_gemm(sizes, F, H, skip64=True),
        "qw256 fc1": qw_gemm(sizes, H, F, 256),
        "qw192 fc1": qw_gemm(sizes, H, F, 192),
        "wgrad dW1 [H,F]": wgrad(sizes, H, F),
        "wgrad dW2 [F,H]": wgrad(sizes, F, H),
        "wgrad dW1, zeroing 1 us/partial slice": wgrad(sizes, H, F, zero_us=1.0),
        "wgrad dW1, zeroing 3 us/partial slice": wgrad(sizes, H, F, zero_us=3.0),
    }


def _lognormal_sizes(skew: float, seed: int = 0) -> np.ndarray:
    """``common.routed_group_sizes`` (the generator of the measured ``gemm_qw_skew*`` runs)."""
    rng = np.random.default_rng(seed)
    p = np.exp(skew * rng.standard_normal(G))
    return rng.multinomial(M, p / p.sum()).astype(np.int32)


def validate() -> list[dict]:
    """Modelled vs measured ms of the GEMMs at the measured log-normal skews."""
    res = ROOT / "benchmarks" / "results"
    rows = []
    for skew, path in ((0.0, "gemm_qw_h200.json"), (0.3, "gemm_qw_skew03_h200.json"), (1.0, "gemm_qw_skew10_h200.json")):
        data = json.loads((res / path).read_text())["results"]
        sizes = np.full(G, M // G, np.int32) if skew == 0 else _lognormal_sizes(skew)
        for shape, k, n in (("nano_fc1", H, F), ("nano_fc2", F, H)):
            meas = data[shape]["fprop"]
            rows.append({
                "skew": skew, "shape": shape,
                "plain_measured": meas["bf16_prequantized"]["ms"], "plain_model": plain_gemm(sizes, k, n)["ms"],
                "qw384_measured": meas["qw:grouped_gemm_sm90_qw_w128t384k64_s3_ss"]["ms"],
                "qw384_model": qw_gemm(sizes, k, n)["ms"],
            })
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alphas", default="inf,1,0.3")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--json", type=pathlib.Path, default=None)
    ap.add_argument("--validate", action="store_true", help="also compare with the measured skewed GEMM times")
    ns = ap.parse_args(argv)
    alphas = [float(a) for a in ns.alphas.split(",")]
    seeds = [int(s) for s in ns.seeds.split(",")]
    out: dict = {"shape": {"M": M, "G": G, "H": H, "F": F, "ctas": SMS}, "alphas": {}}
    for alpha in alphas:
        runs = [model(router_group_sizes(M, G, alpha, s)) for s in (seeds[:1] if math.isinf(alpha) else seeds)]
        sizes = [router_group_sizes(M, G, alpha, s) for s in seeds]
        agg = {}
        for kernel in runs[0]:
            agg[kernel] = {key: float(np.mean([r[kernel][key] for r in runs])) for key in runs[0][kernel]}
        out["alphas"][skew_label(alpha)] = {
            "group_sizes": {"max_mean": float(np.mean([s.max() for s in sizes])),
                            "zeros_mean": float(np.mean([(s == 0).sum() for s in sizes])),
                            "nonzero_below_128_mean": float(np.mean([((s > 0) & (s < 128)).sum() for s in sizes]))},
            "kernels": agg,
        }
    base = out["alphas"].get("uniform")
    for lab, entry in out["alphas"].items():
        print(f"== {lab}: group sizes {entry['group_sizes']}")
        for kernel, r in entry["kernels"].items():
            ratio = r["ms"] / base["kernels"][kernel]["ms"] if base else float("nan")
            extra = {k: round(v, 3) for k, v in r.items() if k != "ms"}
            print(f"  {kernel:34s} {r['ms']:7.3f} ms  x{ratio:5.2f}  {extra}")
    if ns.validate:
        out["validation"] = validate()
        print("== validation (log-normal skew of the measured runs): ms measured / modelled")
        for row in out["validation"]:
            print(f"  skew {row['skew']:3.1f} {row['shape']}: plain {row['plain_measured']:.3f} / {row['plain_model']:.3f}"
                  f"   qw384 {row['qw384_measured']:.3f} / {row['qw384_model']:.3f}")
    if ns.json:
        ns.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
