"""What is live at the peak of a compiled program's device temp allocation, from XLA's own dumps.

XLA writes, for every module it compiles under
``XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"``, the buffer assignment
(``*-buffer-assignment.txt``: each allocation, and each value in it with its size)
and the live ranges of the scheduled entry computation (``*-live-range.txt``: each
value's first and last position in the schedule). Together they give the exact
occupancy of the temp allocation at every point of the schedule: no liveness
estimate (as ``buffer_assignment.temp_peak_report`` must make from the serialized
buffer assignment, which XLA:GPU does not expose through ``memory_analysis()``).

``temp_peak_from_dump`` returns the same keys as ``buffer_assignment.temp_peak_report``
(so ``print_peaks`` shows either) plus, for a program run under ``jax.checkpoint``,
how much of what is live at the peak is residual:

* ``kept``: made by a forward instruction and still live at a backward position
  (a residual kept on the device);
* ``fetched``: the device side of a copy from pinned host memory (``S(5)``) back to
  the device (an offloaded residual brought back for the backward pass);
* everything else is the backward's (or forward's) working set.
"""

from __future__ import annotations

import collections
import pathlib
import re

DUMP_SUFFIX = "_after_optimizations"

_ALLOC = re.compile(r"allocation (\d+): size (\d+)(.*)")
_VALUE = re.compile(r"\s+value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (.*)")
_SEQ = re.compile(r"\s+(\d+):(\S+)$")
_RANGE = re.compile(r"\s+(\S+):(\d+)-(\d+)$")


def dump_flags(directory: str | pathlib.Path, module: str) -> str:
    """XLA_FLAGS entries that dump module ``module`` (a regex) as text into ``directory``."""
    return f"--xla_dump_to={directory} --xla_dump_hlo_as_text --xla_dump_hlo_module_re={module}"


def find_dump(directory: str | pathlib.Path, module: str) -> pathlib.Path | None:
    """The optimized module dump of ``module`` in ``directory`` (the largest, if it was
    compiled more than once), as the common path prefix of its files; None if absent."""
    found = sorted(
        pathlib.Path(directory).glob(f"*.{module}.*{DUMP_SUFFIX}-live-range.txt"),
        key=lambda p: p.stat().st_size,
    )
    if not found:
        return None
    return pathlib.Path(str(found[-1])[: -len("-live-range.txt")])


def parse_buffer_assignment(text: str) -> tuple[dict[int, dict], dict[str, dict]]:
    """(allocations by index: size, temp, color; values by name: allocation, size, shape)."""
    allocs: dict[int, dict] = {}
    values: dict[str, dict] = {}
    cur = None
    for line in text.splitlines():
        m = _ALLOC.match(line)
        if m:
            cur = int(m.group(1))
            flags = m.group(3)
            color = re.search(r"color (\d+)", flags)
            allocs[cur] = {
                "size": int(m.group(2)),
                "temp": "preallocated-temp" in flags,
                "color": int(color.group(1)) if color else 0,
            }
            continue
        m = _VALUE.match(line)
        if m and cur is not None:
            name = m.group(1) if "{" in m.group(1) else m.group(1) + "{}"  # the live ranges' spelling
            values[name] = {"allocation": cur, "size": int(m.group(2)), "shape": m.group(4)}
        elif line and not line.startswith(" "):
            cur = None  # the sections after the allocations list values again
    return allocs, values


def parse_live_ranges(text: str) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """(the entry schedule, value name -> (first, last) position)."""
    seq: dict[int, str] = {}
    ranges: dict[str, tuple[int, int]] = {}
    section = None
    for line in text.splitlines():
        if "InstructionSequence" in line:
            section = "seq"
        elif "BufferLiveRange" in line:
            section = "range"
        elif "Live ranges at" in line:
            section = None
        elif section == "seq" and (m := _SEQ.match(line)):
            seq[int(m.group(1))] = m.group(2)
        elif section == "range" and (m := _RANGE.match(line)):
            ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return [seq[k] for k in sorted(seq)], ranges


def phase(op_name: str) -> str:
    if "transpose(" in op_name:
        return "backward"
    return "forward" if op_name else "?"


class LiveAtPeak:
    """Tallies the buffers live at a temp peak into the report keys both peak readers
    (this module's and ``buffer_assignment.temp_peak_report``) share."""

    def __init__(self, bwd_start: int | None):
        self.bwd_start = bwd_start
        self.rows: list[dict] = []
        self.by_phase: collections.Counter = collections.Counter()
        self.by_opcode: collections.Counter = collections.Counter()
        self.by_shape: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])  # shape -> [bytes, count]
        self.early = 0  # backward (or unlabelled) bytes made before the backward pass began

    def add(self, nbytes: int, name: str, opcode: str, shape: str, op_name: str, lo: int, hi: int, **extra) -> None:
        ph = phase(op_name)
        self.by_phase[ph] += nbytes
        self.by_opcode[opcode or "?"] += nbytes
        key = re.sub(r"\{[^{}]*\}", "", shape or "?")  # without the layout
        self.by_shape[key][0] += nbytes
        self.by_shape[key][1] += 1
        if ph != "forward" and self.bwd_start is not None and lo < self.bwd_start:
            self.early += nbytes
        self.rows.append({
            "bytes": int(nbytes), "instruction": name, "opcode": opcode, "shape": shape[:120], "phase": ph,
            **extra, "live_from": lo, "live_to": hi, "op_name": op_name[-200:],
        })  # fmt: skip

    def report(self, top: int) -> dict:
        rows = sorted(self.rows, key=lambda r: -r["bytes"])
        return {
            "live_at_peak_buffers": len(rows),
            "live_at_peak_bytes_by_phase": dict(self.by_phase),
            "live_at_peak_bytes_by_opcode": dict(self.by_opcode.most_common(8)),
            "live_at_peak_made_before_backward_bytes": int(self.early),
            "live_at_peak_top": rows[:top],
            "live_at_peak_by_shape": dict(sorted(self.by_shape.items(), key=lambda kv: -kv[1][0])[: 3 * top]),
        }


def _is_fetch(ins: dict) -> bool:
    """A copy from host memory space S(5) to the device (its device side)."""
    if ins.get("opcode") not in ("copy-start", "copy-done"):
        return False
    shape = ins.get("shape", "")
    if ins["opcode"] == "copy-start":  # (destination, source, context)
        parts = re.findall(r"\{[^{}]*\}", shape)
        return len(parts) >= 2 and "S(5)" not in parts[0] and "S(5)" in parts[1]
    return "S(5)" not in shape


def temp_peak_from_dump(prefix: pathlib.Path, text_instrs: dict, top: int = 16) -> dict:
    """Occupancy of the device temp allocation at its fullest point of the schedule.

    ``prefix``: from :func:`find_dump`; ``text_instrs``: ``hlo_text.parse_hlo`` of
    the same compiled module (for opcodes, shapes and op names)."""
    allocs, values = parse_buffer_assignment(pathlib.Path(f"{prefix}-buffer-assignment.txt").read_text())
    order, ranges = parse_live_ranges(pathlib.Path(f"{prefix}-live-range.txt").read_text())
    temp = {i for i, a in allocs.items() if a["temp"] and a["color"] == 0}
    out = {
        "source": "xla_dump",
        "temp_allocations": len(temp),
        "temp_allocation_bytes": sum(allocs[i]["size"] for i in temp),
        "entry_schedule_length": len(order),
    }
    live_vals = [(n, v) for n, v in values.items() if v["allocation"] in temp and n in ranges]
    if not order or not live_vals:
        return out | {"estimated_peak_bytes": None}
    delta = [0] * (len(order) + 2)
    for name, v in live_vals:
        lo, hi = ranges[name]
        delta[lo] += v["size"]
        delta[min(hi, len(order)) + 1] -= v["size"]
    running, peak, peak_pos = 0, -1, 0
    for k in range(len(order)):
        running += delta[k]
        if running > peak:
            peak, peak_pos = running, k

    def ins_of(value_name: str) -> dict:
        return text_instrs.get(value_name.split("{", 1)[0], {})

    phase_pos = collections.defaultdict(list)
    for k, name in enumerate(order):
        phase_pos[phase(text_instrs.get(name, {}).get("op_name", ""))].append(k)
    bwd, fwd = phase_pos["backward"], phase_pos["forward"]
    bwd_start = bwd[len(bwd) // 10] if bwd else None  # XLA hoists a few backward ops to the top
    in_backward = bwd_start is not None and peak_pos >= bwd_start

    tally = LiveAtPeak(bwd_start)
    by_kind: collections.Counter = collections.Counter()
    for name, v in live_vals:
        lo, hi = ranges[name]
        if not lo <= peak_pos <= hi:
            continue
        ins = ins_of(name)
        op_name = ins.get("op_name", "")
        if _is_fetch(ins):
            kind = "fetched"
        elif phase(op_name) == "forward" and in_backward:
            kind = "kept"
        else:
            kind = "working"
        by_kind[kind] += v["size"]
        tally.add(v["size"], name, ins.get("opcode", ""), v["shape"], op_name, lo, hi, residual=kind)
    at = order[peak_pos]
    return out | {
        "estimated_peak_bytes": int(peak),  # exact here: XLA's own live ranges
        "estimated_peak_sum_of_slices": int(peak),
        "peak_position": peak_pos,
        "peak_at_instruction": at,
        "peak_at_op_name": text_instrs.get(at, {}).get("op_name", "")[-200:],
        "backward_starts_at": bwd_start,
        "fraction_of_pass_done_at_peak": {
            "forward": sum(k <= peak_pos for k in fwd) / len(fwd) if fwd else None,
            "backward": sum(k <= peak_pos for k in bwd) / len(bwd) if bwd else None,
        },
        "live_at_peak_residual_bytes": {k: int(by_kind.get(k, 0)) for k in ("kept", "fetched", "working")},
    } | tally.report(top)
