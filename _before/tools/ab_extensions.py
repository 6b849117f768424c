"""A/B of several builds of the extension on one machine, in alternating processes.

A kernel change is timed against its base by building both extensions here (e.g. one with
an experimental switch, docs/gpu.md), carrying both to the device, and running the same
benchmark with each in turn, in separate processes (a process loads the extension once),
the build order reversed every other round (this machine drifts by 10-15 % over a run).

    PYTHONPATH=. python3 tools/ab_extensions.py --builds base=exp/base.sobin,dyn=exp/dyn.sobin \\
        --rounds 2 --out $OUT/ab.json -- \\
        python3 benchmarks/bench_step_parts.py --shape nano --alpha inf,1 --parts '^gemm' --out {out}

``--env NAME:KEY=VALUE`` (repeatable) sets an environment variable for build NAME's runs only,
so one extension file can appear twice under two names with different run-time switches
(e.g. ``auto=exp/dyn.sobin,dynamic=exp/dyn.sobin --env dynamic:JGM_WGRAD_TILE_ORDER=dynamic``).

The benchmark command must write its results-schema JSON to ``{out}``. Each build's file is
copied over the extension before its run and the original extension is put back at the end.
Writes one results file (``--out``): every run's ``results`` with its build and round, and,
for ``bench_step_parts.py``-style results (``{part: {"by_alpha": {label: ms}}}``), the mean
per part, label and build, and each build's ratio to the first. Prints that table.

The file is rewritten after every run (``"complete": false`` until the last), so a device
call cut off by its time limit still brings back the runs it finished. ``--budget S``
starts no run that would end past S seconds from the start, judged by the longest run so
far (the call's limit minus what runs before this tool, with some margin).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import write_result  # noqa: E402

EXTENSION = ROOT / "jax_grouped_mlp" / "_kernels.cpython-312-x86_64-linux-gnu.so"


def parse_builds(text: str) -> dict[str, pathlib.Path]:
    """``name=path,name=path`` -> ``{name: path}`` (at least two builds, existing files)."""
    builds = {}
    for item in (t for t in text.split(",") if t):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--builds takes name=path pairs, got {item!r}")
        if name in builds:
            raise SystemExit(f"--builds names build {name!r} twice")
        if not pathlib.Path(path).is_file():
            raise SystemExit(f"--builds {name}: no file {path}")
        builds[name] = pathlib.Path(path)
    if len(builds) < 2:
        raise SystemExit(f"--builds needs at least two builds to compare, got {list(builds)}")
    return builds


def parse_envs(items: list[str], names: list[str]) -> dict[str, dict[str, str]]:
    """``["name:KEY=VALUE", ...]`` -> ``{name: {KEY: VALUE}}``; each name must be a build."""
    envs: dict[str, dict[str, str]] = {n: {} for n in names}
    for item in items:
        name, sep, assignment = item.partition(":")
        key, eq, value = assignment.partition("=")
        if not sep or not eq or not key:
            raise SystemExit(f"--env takes NAME:KEY=VALUE, got {item!r}")
        if name not in envs:
            raise SystemExit(f"--env {item!r}: no build named {name!r} (builds: {', '.join(names)})")
        envs[name][key] = value
    return envs


def round_order(names: list[str], r: int) -> list[str]:
    """The builds in round ``r`` (0-based): as given in even rounds, reversed in odd ones."""
    return list(names) if r % 2 == 0 else list(reversed(names))


def summarize(runs: list[dict], names: list[str]) -> dict:
    """``{part: {label: {build: mean ms, build + "/" + first: ratio}}}`` over the runs whose
    results map parts to ``{"by_alpha": {label: ms}}``; empty when none do."""
    samples: dict = {}
    for run in runs:
        for part, entry in run["results"].items():
            if isinstance(entry, dict) and isinstance(entry.get("by_alpha"), dict):
                for label, ms in entry["by_alpha"].items():
                    samples.setdefault(part, {}).setdefault(label, {}).setdefault(run["build"], []).append(ms)
    table: dict = {}
    for part, labels in samples.items():
        for label, by_build in labels.items():
            row = {b: statistics.mean(v) for b, v in by_build.items()}
            base = row.get(names[0])
            for b in names[1:]:
                if base and b in row:
                    row[f"{b}/{names[0]}"] = row[b] / base
            table.setdefault(part, {})[label] = row
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--builds", required=True, help="name=path,... of extension files; the first is the base")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--extension", type=pathlib.Path, default=EXTENSION, help="the file each build is copied over")
    ap.add_argument("--env", action="append", default=[], metavar="NAME:KEY=VALUE",
                    help="an environment variable for one build's runs (repeatable)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per benchmark run")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds from the start after which no run may end (by the longest run so far)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark command, with {out}")
    ns = ap.parse_args(argv)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command or not any("{out}" in c for c in command):
        raise SystemExit("give the benchmark command after --, with {out} where it writes its JSON")
    if ns.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got --rounds={ns.rounds}")
    if ns.budget is not None and not ns.budget > 0:
        raise SystemExit(f"--budget must be a positive number of seconds, got --budget={ns.budget}")
    builds = parse_builds(ns.builds)
    names = list(builds)
    envs = parse_envs(ns.env, names)
    runs: list[dict] = []
    device = None
    this = "PYTHONPATH=. python3 tools/ab_extensions.py " + shlex.join(sys.argv[1:] if argv is None else argv)

    def save(complete: bool, stopped: str | None = None) -> dict:
        """Writes the runs so far to ``--out``; returns the mean table."""
        table = summarize(runs, names)
        results = {"builds": {n: str(p) for n, p in builds.items()},
                   "env": {n: e for n, e in envs.items() if e}, "complete": complete, "mean": table, "runs": runs}
        if stopped:
            results["stopped"] = stopped
        write_result(ns.out, command=this, results=results, device=device if isinstance(device, str) else None)
        return table

    start = time.monotonic()
    longest = 0.0
    stopped = None
    with tempfile.TemporaryDirectory() as tmp:
        saved = pathlib.Path(tmp) / "original.so"
        had_extension = ns.extension.is_file()
        if had_extension:
            shutil.copy2(ns.extension, saved)
        try:
            for r in range(ns.rounds):
                for name in round_order(names, r):
                    elapsed = time.monotonic() - start
                    if ns.budget is not None and runs and elapsed + longest > ns.budget:
                        stopped = (f"--budget {ns.budget:g} s: {len(runs)} of {ns.rounds * len(names)} runs done "
                                   f"after {elapsed:.0f} s, the longest took {longest:.0f} s")
                        print(f"[ab] {stopped}", flush=True)
                        break
                    shutil.copy2(builds[name], ns.extension)
                    out = pathlib.Path(tmp) / f"{name}_{r}.json"
                    cmd = [c.replace("{out}", str(out)) for c in command]
                    shown = [f"{k}={shlex.quote(v)}" for k, v in envs[name].items()] + [shlex.join(cmd)]
                    print(f"[ab] round {r + 1}/{ns.rounds}, {name}: {' '.join(shown)}", flush=True)
                    t0 = time.monotonic()
                    proc = subprocess.run(cmd, timeout=ns.timeout, env={**os.environ, **envs[name]})
                    if proc.returncode or not out.is_file():
                        if runs:
                            save(False, f"{name} round {r + 1} failed (rc {proc.returncode})")
                        raise SystemExit(f"[ab] {name} round {r + 1}: the command failed (rc {proc.returncode})")
                    longest = max(longest, time.monotonic() - t0)
                    data = json.loads(out.read_text())
                    device = device or data.get("device")
                    runs.append({"build": name, "round": r + 1, "results": data.get("results", data.get("rows"))})
                    save(False)
                if stopped:
                    break
        finally:
            if had_extension:
                shutil.copy2(saved, ns.extension)
    table = save(stopped is None, stopped)
    for part, labels in table.items():
        for label, row in labels.items():
            cells = " ".join(f"{b}={row[b]:.4g}" for b in row)
            print(f"{part[:40]:40s} {label:12s} {cells}")
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
