"""Reading compiled HLO text and lowered MLIR: instructions, host memory space ``S(5)``,
host transfers, and the placement annotations JAX hands XLA.

Used by ``bench_offload.py`` to prove where residuals live in the compiled step, and
by ``xla_dump`` readers for opcodes, shapes and op names.
"""

from __future__ import annotations

import collections
import math
import re

_DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
    "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8,
    "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0,
}  # fmt: skip
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^{}]*\})?")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_HOST_CALLS = ("MoveToHost", "MoveToDevice", "annotate_device_placement")
# Ops that only forward, wrap or pick a buffer: not a transfer of their own.
_NOT_TRANSFERS = frozenset({
    "copy-done", "get-tuple-element", "tuple", "bitcast", "parameter", "while", "conditional",
    "call", "async-start", "async-update", "async-done", "opt-barrier", "optimization-barrier",
    "constant", "send", "recv", "send-done", "recv-done",
})  # fmt: skip


def _split_shape(rest: str) -> tuple[str, str]:
    """``"<shape> <opcode>(...)..."`` -> (shape, remainder); tuple shapes are parenthesised."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    shape, _, tail = rest.partition(" ")
    return shape, tail


def _array_bytes(dtype: str, dims: str) -> int:
    n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    return int(math.ceil(n * _DTYPE_BYTES.get(dtype, 0)))


def _host_bytes(shape: str) -> int:
    return sum(_array_bytes(t, d) for t, d, lay in _ARRAY.findall(shape) if lay and "S(5)" in lay)


def _arrays(shape: str) -> list[tuple[int, bool]]:
    """(bytes, in host memory space) of each array in a (possibly tuple) shape."""
    return [(_array_bytes(t, d), bool(lay) and "S(5)" in lay) for t, d, lay in _ARRAY.findall(shape)]


def parse_hlo(text: str) -> dict:
    """Instructions of an HLO module text: name -> dict(shape, opcode, operands, computation, ...)."""
    instrs: dict[str, dict] = {}
    fusion_called: set[str] = set()
    entry = None
    comp = None
    frames = _stack_frames(text)
    for line in text.splitlines():
        if not line.startswith(" "):
            mc = _COMP.match(line)
            if mc:
                comp = mc.group(2)
                if mc.group(1):
                    entry = comp
            continue
        mi = _INSTR.match(line)
        if not mi or comp is None:
            continue
        name, rest = mi.group(1), mi.group(2)
        shape, tail = _split_shape(rest)
        opcode, _, args = tail.partition("(")
        opcode = opcode.strip()
        operands = re.findall(r"%([^\s,()]+)", args.split("),", 1)[0]) if args else []
        if opcode == "fusion":
            fusion_called.update(re.findall(r"calls=%?([^\s,}]+)", line))
        op_name = re.search(r'op_name="([^"]*)"', line)
        frame = re.search(r"stack_frame_id=(\d+)", line)
        target = re.search(r'custom_call_target="([^"]*)"', line)
        instrs[name] = {
            "shape": shape,
            "opcode": opcode,
            "operands": operands,
            "computation": comp,
            "op_name": op_name.group(1) if op_name else "",
            "source": frames.get(int(frame.group(1)), "") if frame else "",
            "target": target.group(1) if target else "",
        }
    return {"instrs": instrs, "entry": entry, "fusion_computations": fusion_called}


def _stack_frames(text: str) -> dict[int, str]:
    """stack_frame_id -> "file:line" of its innermost frame, from the module's frame tables."""
    files, locs, frames = {}, {}, {}
    section = None
    for line in text.splitlines():
        s = line.strip()
        if s in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = s
            continue
        m = re.match(r"^(\d+) (.*)$", s) if section else None
        if not m:
            section = None
            continue
        idx, val = int(m.group(1)), m.group(2)
        if section == "FileNames":
            files[idx] = val.strip('"')
        elif section == "FileLocations":
            fid = re.search(r"file_name_id=(\d+)", val)
            ln = re.search(r"\bline=(\d+)", val)
            if fid and ln:
                locs[idx] = f"{files.get(int(fid.group(1)), '?')}:{ln.group(1)}"
        elif section == "StackFrames":
            fl = re.search(r"file_location_id=(\d+)", val)
            if fl:
                frames[idx] = locs.get(int(fl.group(1)), "")
    return frames


# A host->device move of at most this many bytes is the host-copy fence's read-back of
# one element (jax_grouped_mlp/_src/op/residuals.py), not a residual's reload.
_READ_BACK_BYTES = 8


def host_placement_report(text: str) -> dict:
    """Counts what in a compiled HLO module lives in, or moves to and from, host memory ``S(5)``.

    Only instructions of non-fusion computations are counted (a fusion's body would
    count its own output twice). A transfer is an instruction whose result and one of
    its operands sit in different memory spaces (``copy-start``: its destination and
    source, the first two tuple elements); its bytes are those of the host-side array.
    One-element reads of a host copy (the fence's read-backs) are counted apart.
    """
    mod = parse_hlo(text)
    instrs, fused = mod["instrs"], mod["fusion_computations"]
    s5_by_op: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    moves = {"to_host": collections.Counter(), "to_device": collections.Counter()}
    nbytes = {"to_host": 0, "to_device": 0}
    read_backs = 0
    for ins in instrs.values():
        if ins["computation"] in fused:
            continue
        if ins["target"] in _HOST_CALLS:
            calls[ins["target"]] += 1
        shape, op = ins["shape"], ins["opcode"]
        if "S(5)" in shape:
            s5_by_op[op] += 1
        if op in _NOT_TRANSFERS:
            continue
        if op == "copy-start":
            arr = _arrays(shape)
            if len(arr) >= 2 and arr[0][1] != arr[1][1]:
                kind = "to_host" if arr[0][1] else "to_device"
                moves[kind][op] += 1
                nbytes[kind] += arr[0][0] if arr[0][1] else arr[1][0]
            continue
        out_host = "S(5)" in shape
        # Array operands (not scalars such as slice offsets), as (bytes, on host).
        src = [a for o in ins["operands"] if o in instrs for a in _arrays(instrs[o]["shape"]) if a[0] > 8]
        dev_in = sum(b for b, host in src if not host)
        host_in = sum(b for b, host in src if host)
        if out_host and dev_in:  # e.g. copy, or dynamic-update-slice of a device slice into host
            moves["to_host"][op] += 1
            nbytes["to_host"] += min(_host_bytes(shape), dev_in)
        elif not out_host and host_in:  # e.g. copy, or dynamic-slice of a host buffer
            if sum(b for b, _ in _arrays(shape)) <= _READ_BACK_BYTES:  # the fence's one-element read
                read_backs += 1
                continue
            moves["to_device"][op] += 1
            nbytes["to_device"] += min(host_in, sum(b for b, _ in _arrays(shape)))
    header = text.split("\n", 1)[0]
    layout = re.search(r"entry_computation_layout=\{(.*)\}", header)
    return {
        "s5_instructions": sum(s5_by_op.values()),
        "s5_instructions_by_opcode": dict(s5_by_op),
        "s5_in_entry_layout": layout.group(1).count("S(5)") if layout else 0,
        "to_host_ops": dict(moves["to_host"]),
        "to_device_ops": dict(moves["to_device"]),
        "to_host_bytes": nbytes["to_host"],
        "to_device_bytes": nbytes["to_device"],
        "read_backs": read_backs,
        "host_placement_custom_calls": dict(calls),
        "instructions": len(instrs),
    }


_MLIR_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i1": 1, "i8": 1, "ui8": 1, "i16": 2, "ui16": 2,
               "i32": 4, "ui32": 4, "i64": 8, "ui64": 8}  # f8* and f4*: below  # fmt: skip
_ANNOTATION = re.compile(
    r'@annotate_device_placement\(.*?_xla_buffer_placement = "(\w+)".*?:\s*\(tensor<([^>]*)>\)'
)


def lowered_placement_report(mlir_text: str) -> dict:
    """What JAX asks XLA to move: the ``annotate_device_placement`` custom calls in the
    lowered (StableHLO) program, by destination memory kind and element type, with bytes."""
    out: dict = {}
    for kind, tensor in _ANNOTATION.findall(mlir_text):
        *dims, dtype = tensor.split("x")
        size = _MLIR_BYTES.get(dtype, 1 if dtype.startswith("f8") else 0.5 if dtype.startswith("f4") else 0)
        n = math.prod(int(d) for d in dims) if dims else 1
        entry = out.setdefault(kind, {}).setdefault(dtype, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += int(n * size)
    return out

