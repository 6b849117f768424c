"""XLA's serialized buffer assignment and HLO module (protobuf, read without protobuf
bindings), and the temp peak estimated from them (``temp_peak_report``).

XLA:CPU exposes the serialized buffer assignment through ``memory_analysis()``;
XLA:GPU does not, where ``xla_dump.temp_peak_from_dump`` reads XLA's text dump instead
(exact live ranges rather than the liveness estimated here).
"""

from __future__ import annotations

import collections

from benchmarks.xla_dump import LiveAtPeak, phase


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7


def _fields(buf: bytes):
    """(field number, value) of a protobuf message: ints for varints, bytes for the rest."""
    i, n = 0, len(buf)
    while i < n:
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            val, i = _varint(buf, i)
        elif wire == 2:
            size, i = _varint(buf, i)
            val, i = buf[i : i + size], i + size
        elif wire == 1:
            val, i = buf[i : i + 8], i + 8
        elif wire == 5:
            val, i = buf[i : i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield key >> 3, val


def _ints(vals) -> list[int]:
    """A repeated integer field, packed (bytes) or not (ints)."""
    out = []
    for v in vals:
        if isinstance(v, int):
            out.append(v)
            continue
        i = 0
        while i < len(v):
            x, i = _varint(v, i)
            out.append(x)
    return out


def _multi(buf: bytes) -> dict[int, list]:
    d: dict[int, list] = collections.defaultdict(list)
    for fn, val in _fields(buf):
        d[fn].append(val)
    return d


def decode_buffer_assignment(blob: bytes) -> dict:
    """The parts of xla.BufferAssignmentProto (xla/service/hlo.proto) used here.

    logical buffer id -> (size, defining instruction id, color); allocations with
    their flags and assigned (logical buffer, offset, size) slices.
    """
    buffers, allocs = {}, []
    names = {1: "index", 2: "size", 3: "thread_local", 5: "parameter", 7: "live_out", 8: "color",
             11: "tuple", 12: "constant"}  # fmt: skip
    for fn, val in _fields(blob):
        if fn == 1:  # LogicalBufferProto {id=1, size=2, defined_at=3 {instruction_id=4}, color=4}
            d = _multi(val)
            loc = _multi(d[3][0]) if d.get(3) else {}
            buffers[d.get(1, [0])[0]] = {
                "size": d.get(2, [0])[0],
                "instruction_id": loc.get(4, [None])[0],
                "color": d.get(4, [0])[0],
            }
        elif fn == 3:  # BufferAllocationProto; Assigned {logical_buffer_id=1, offset=2, size=3}
            a = dict.fromkeys(names.values(), 0)
            a["assigned"] = []
            for f2, v2 in _fields(val):
                if f2 in names and isinstance(v2, int):
                    a[names[f2]] = v2
                elif f2 == 9:
                    d = _multi(v2)
                    a["assigned"].append((d.get(1, [0])[0], d.get(2, [0])[0], d.get(3, [0])[0]))
            allocs.append(a)
    return {"buffers": buffers, "allocations": allocs}


def decode_module(blob: bytes) -> dict:
    """Instructions (id -> name, opcode, operand ids, called computation ids, computation id)
    and the schedule of an xla.HloModuleProto."""
    instrs, comps = {}, {}
    entry, schedule = None, {}
    for fn, val in _fields(blob):
        if fn == 3:  # HloComputationProto {name=1, instructions=2, id=5}
            c = _multi(val)
            cid = c.get(5, [0])[0]
            ids = []
            for raw in c.get(2, []):
                d = _multi(raw)  # HloInstructionProto {name=1, opcode=2, id=35, operand_ids=36, called=38}
                iid = d.get(35, [0])[0]
                ids.append(iid)
                instrs[iid] = {
                    "name": bytes(d.get(1, [b""])[0]).decode(errors="replace"),
                    "opcode": bytes(d.get(2, [b""])[0]).decode(errors="replace"),
                    "operands": _ints(d.get(36, [])),
                    "called": _ints(d.get(38, [])),
                    "computation": cid,
                }
            comps[cid] = {"name": bytes(c.get(1, [b""])[0]).decode(errors="replace"), "instructions": ids}
        elif fn == 6:
            entry = val
        elif fn == 7:  # HloScheduleProto {sequences=1: map<int64, InstructionSequence {instruction_ids=1}>}
            for f2, ent in _fields(val):
                if f2 == 1:
                    e = _multi(ent)
                    seq = _multi(e[2][0]).get(1, []) if e.get(2) else []
                    schedule[e.get(1, [0])[0]] = _ints(seq)
    return {"instructions": instrs, "computations": comps, "entry": entry, "schedule": schedule}


# Ops whose result holds (part of) an operand's buffer: a reader of the result reads the
# operand. copy-start and async-start keep their operands until the matching -done,
# whose result is a new buffer (for a host copy, the other memory space).
_FORWARDING = frozenset({
    "bitcast", "get-tuple-element", "tuple", "while", "call", "opt-barrier", "optimization-barrier",
    "async-start", "copy-start",
})  # fmt: skip


def temp_peak_report(ba_blob: bytes, module_blob: bytes, text_instrs: dict, top: int = 16) -> dict:
    """What is live in the device temp allocation at its busiest point of the entry schedule.

    Buffer slices (offset, size) come from XLA's buffer assignment; liveness is
    estimated here on the scheduled entry computation: a buffer defined by an entry
    instruction lives from it to its last user (following bitcasts, tuples,
    get-tuple-elements, loops, calls and async pairs), a buffer defined inside a
    nested computation lives during the entry instruction that calls it. Slices
    that coincide count once. An estimate: it cannot exceed the allocation, and the
    buffers it lists at the peak are the ones to look at.
    """
    ba = decode_buffer_assignment(ba_blob)
    mod = decode_module(module_blob)
    instrs, entry = mod["instructions"], mod["entry"]
    order = mod["schedule"].get(entry) or mod["computations"].get(entry, {}).get("instructions", [])
    pos = {iid: k for k, iid in enumerate(order)}
    temp = [
        a for a in ba["allocations"]
        if not (a["parameter"] or a["live_out"] or a["constant"] or a["thread_local"] or a["tuple"])
        and a["color"] == 0
    ]  # fmt: skip
    out = {
        "temp_allocations": len(temp),
        "temp_allocation_bytes": sum(a["size"] for a in temp),
        "entry_schedule_length": len(order),
    }
    if not order or not temp:
        return out | {"estimated_peak_bytes": None}
    # Entry instruction that (transitively) runs each computation.
    caller: dict[int, int] = {}
    for iid, ins in instrs.items():
        for c in ins["called"]:
            caller.setdefault(c, iid)

    def entry_pos(iid):
        seen = 0
        while iid not in pos and seen < 64:
            ins = instrs.get(iid)
            if ins is None or ins["computation"] not in caller:
                return None
            iid = caller[ins["computation"]]
            seen += 1
        return pos.get(iid)

    users: dict[int, list[int]] = collections.defaultdict(list)
    for iid in order:
        for o in instrs[iid]["operands"]:
            users[o].append(iid)
    last_use: dict[int, int] = {}

    def last(iid):  # last entry position at which the buffer defined by entry instruction iid is read
        if iid not in last_use:
            end, seen, stack = pos[iid], {iid}, [iid]
            while stack:
                for u in users.get(stack.pop(), ()):
                    end = max(end, pos[u])
                    if instrs[u]["opcode"] in _FORWARDING and u not in seen:
                        seen.add(u)
                        stack.append(u)
            last_use[iid] = end
        return last_use[iid]

    events: dict[int, list] = collections.defaultdict(list)  # position -> [(+1/-1, key)]
    spans_of: dict[tuple, list] = collections.defaultdict(list)  # slice -> [(first, last, instruction)]
    for a in temp:
        for buf, offset, size in a["assigned"]:
            lb = ba["buffers"].get(buf)
            if lb is None or lb["instruction_id"] is None or size <= 0:
                continue
            iid = lb["instruction_id"]
            if iid in pos:
                lo, hi = pos[iid], last(iid)
            else:
                lo = entry_pos(iid)
                if lo is None:
                    continue
                hi = lo
            key = (a["index"], offset, size)
            spans_of[key].append((lo, hi, iid))
            events[lo].append((1, key))
            events[hi + 1].append((-1, key))
    count: collections.Counter = collections.Counter()
    live = peak = 0
    peak_pos = 0
    for k in range(len(order) + 1):
        for delta, key in sorted(events.get(k, ()), key=lambda e: e[0]):  # frees first
            before = count[key]
            count[key] += delta
            if before == 0 and count[key] > 0:
                live += key[2]
            elif before > 0 and count[key] == 0:
                live -= key[2]
        if live > peak:
            peak, peak_pos = live, k
    # Live slices at the peak position.
    count = collections.Counter()
    for k in range(peak_pos + 1):
        for delta, key in events.get(k, ()):
            count[key] += delta
    # Where the backward pass begins in the schedule: XLA hoists a few weight-only and
    # constant backward ops to the top, so take the position by which a tenth of the
    # backward's (transposed) instructions have run; and how far each pass is at the peak.
    phase_pos = collections.defaultdict(list)
    for k, iid in enumerate(order):
        phase_pos[phase(text_instrs.get(instrs[iid]["name"], {}).get("op_name", ""))].append(k)
    bwd, fwd = phase_pos["backward"], phase_pos["forward"]
    bwd_start = bwd[len(bwd) // 10] if bwd else None
    done = {
        "forward": sum(k <= peak_pos for k in fwd) / len(fwd) if fwd else None,
        "backward": sum(k <= peak_pos for k in bwd) / len(bwd) if bwd else None,
    }
    tally = LiveAtPeak(bwd_start)
    for key, c in count.items():
        if c <= 0:
            continue
        here = [sp for sp in spans_of[key] if sp[0] <= peak_pos <= sp[1]] or spans_of[key][:1]
        lo, hi, iid = here[0]
        ins = instrs.get(iid, {})
        t = text_instrs.get(ins.get("name", ""), {})
        tally.add(key[2], ins.get("name", ""), ins.get("opcode", ""), t.get("shape", ""), t.get("op_name", ""), lo, hi)
    # Slices of different buffers that overlap in memory cannot both be live: where the
    # estimate says they are, count their union (per allocation) instead of the sum.
    union = 0
    spans = sorted((k[0], k[1], k[1] + k[2]) for k, c in count.items() if c > 0)
    cur = None
    for alloc, lo, hi in spans:
        if cur is None or alloc != cur[0] or lo > cur[2]:
            union += 0 if cur is None else cur[2] - cur[1]
            cur = [alloc, lo, hi]
        else:
            cur[2] = max(cur[2], hi)
    union += 0 if cur is None else cur[2] - cur[1]
    at = instrs.get(order[min(peak_pos, len(order) - 1)], {}).get("name", "")
    return out | {
        "estimated_peak_bytes": int(union),
        "estimated_peak_sum_of_slices": int(peak),
        "peak_position": peak_pos,
        "peak_at_instruction": at,
        "peak_at_op_name": text_instrs.get(at, {}).get("op_name", "")[-200:],
        "backward_starts_at": bwd_start,
        "fraction_of_pass_done_at_peak": done,
    } | tally.report(top)

