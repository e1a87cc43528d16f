#!/usr/bin/env python3
"""What each launch of a compiled program holds: an inventory of an optimized HLO module's top-level
ops (fusions, custom calls, copies, collectives), with the ops inside every fusion and the source
lines they came from.

    python scripts/hlo_fusions.py STEP.hlo.txt[.gz] [--top=30] [--json] [--all]

STEP: what `python -m pallas_kernels.bench --parts=step --step_hlo_dir=DIR` writes (the compiled
decode loop), or any `compiled.as_text()`. Each launch is described by its kind (fusion kind or the
op), its output shape, the ops its fused computation runs (parameters, constants, bitcasts and
broadcasts left out) and the project functions its ops were traced from (the innermost stack frame
under qmtp/ or pallas_kernels/, from the module's metadata). Launches with the same description
are grouped and counted: in a 64-layer step, a group that appears 128 times runs at every layer
boundary. The launch counting is `pallas_kernels.bench.step.count_launches`'s: ops inside
computations that other ops call run inside those ops.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere
from pallas_kernels.bench.step import LAUNCH_KINDS, called_computations  # noqa: E402

PROJECT_DIRS = ("qmtp/", "pallas_kernels/")
QUIET_OPS = {"parameter", "constant", "bitcast", "broadcast", "get-tuple-element", "tuple", "reshape"}
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+|\([^=]*?\)) ([\w\-]+)\((.*)$")


def read(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def _table(text: str, title: str) -> list[str]:
    """The lines of one of the module's metadata tables (FileNames, FunctionNames, ...)."""
    m = re.search(rf"^{title}\n(.*?)(?:\n\n|\Z)", text, re.S | re.M)
    return m.group(1).splitlines() if m else []


def source_frames(text: str) -> dict[int, list[str]]:
    """stack_frame_id -> its frames, innermost first, as 'file.py:line function'."""
    files = {int(i): n.strip('"') for i, n in (line.split(" ", 1) for line in _table(text, "FileNames"))}
    funcs = {int(i): n.strip('"') for i, n in (line.split(" ", 1) for line in _table(text, "FunctionNames"))}
    locs = {}
    for line in _table(text, "FileLocations"):
        i, body = line.split(" ", 1)
        f = dict(re.findall(r"(\w+)=(\d+)", body))
        locs[int(i)] = (files.get(int(f.get("file_name_id", 0)), "?"), funcs.get(int(f.get("function_name_id", 0)), "?"),
                        int(f.get("line", 0)))
    parents = {}
    for line in _table(text, "StackFrames"):
        i, body = line.split(" ", 1)
        f = dict(re.findall(r"(\w+)=(\d+)", body))
        parents[int(i)] = (int(f.get("file_location_id", 0)), int(f.get("parent_frame_id", 0)))
    frames = {}
    for i in parents:
        out, j, seen = [], i, set()
        while j in parents and j not in seen:
            seen.add(j)
            loc, parent = parents[j]
            if loc in locs:
                file, func, line = locs[loc]
                out.append(f"{file}:{line} {func}")
            j = parent
        frames[i] = out
    return frames


def project_frame(frames: list[str]) -> str | None:
    """The innermost frame in the project's own code ('qmtp/layers.py:24 rms_norm'), path shortened."""
    for frame in frames:
        for d in PROJECT_DIRS:
            k = frame.find(d)
            if k >= 0:
                return frame[k:]
    return None


def computations(text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines; 'ENTRY' marks the entry computation's name."""
    out, name = {}, None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(2)
            out[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            out[name].append(line)
    return out


def inventory(text: str) -> list[dict]:
    """One entry per launch, in program order: name, kind, shape, ops (opcode -> count inside a
    fusion), sources (project frames of its ops), computation (where it sits)."""
    frames = source_frames(text)
    comps = computations(text)
    called = called_computations(text)
    launches = []
    for comp, lines in comps.items():
        if comp in called:
            continue
        for line in lines:
            m = _INSTR.match(line)
            if not m or m.group(3) not in LAUNCH_KINDS:
                continue
            name, shape, op, rest = m.groups()
            entry = {"name": name, "computation": comp, "shape": shape, "kind": op, "ops": {}, "sources": []}
            target = re.search(r'custom_call_target="([^"]+)"', rest)
            if target:
                entry["kind"] = f"custom-call {target.group(1)}"
            kind = re.search(r"kind=(k\w+)", rest)
            body = re.search(r"calls=%([\w.\-]+)", rest)
            if op == "fusion":
                entry["kind"] = f"fusion {kind.group(1) if kind else ''}".strip()
            inner = comps.get(body.group(1), []) if body else [line]
            ops, sources = collections.Counter(), collections.Counter()
            for inst in inner:
                im = _INSTR.match(inst)
                if not im:
                    continue
                if im.group(3) not in QUIET_OPS:
                    ops[im.group(3)] += 1
                sf = re.search(r"stack_frame_id=(\d+)", inst)
                frame = project_frame(frames.get(int(sf.group(1)), [])) if sf else None
                if frame:
                    sources[frame] += 1
            entry["ops"] = dict(sorted(ops.items()))
            entry["sources"] = [s for s, _ in sources.most_common()]
            launches.append(entry)
    return launches


def groups(launches: list[dict]) -> list[dict]:
    """Launches with the same kind, ops and sources, counted, the most frequent first."""
    counter, first = collections.Counter(), {}
    for e in launches:
        key = (e["kind"], json.dumps(e["ops"], sort_keys=True), tuple(sorted(e["sources"])))
        counter[key] += 1
        first.setdefault(key, e)
    return [dict(first[k], count=c) for k, c in counter.most_common()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=30, help="groups to print")
    ap.add_argument("--json", action="store_true", help="print every launch and the groups as JSON")
    ap.add_argument("--all", action="store_true", help="also list every launch in program order")
    args = ap.parse_args(argv)
    launches = inventory(read(args.path))
    grouped = groups(launches)
    if args.json:
        print(json.dumps({"launches": launches, "groups": grouped}, indent=1))
        return 0
    kinds = collections.Counter(e["kind"].split(" ")[0] for e in launches)
    print(f"{len(launches)} launches ({', '.join(f'{k} {n}' for k, n in kinds.most_common())}), "
          f"{len(grouped)} distinct")
    for g in grouped[:args.top]:
        ops = " ".join(f"{k}x{v}" if v > 1 else k for k, v in g["ops"].items())
        print(f"{g['count']:5d} x  {g['kind'][:40]:40s} {g['shape'][:28]:28s} {ops[:70]}")
        for s in g["sources"][:4]:
            print(f"{'':10s}{s}")
    if args.all:
        for e in launches:
            print(f"{e['computation'][:24]:24s} {e['name'][:36]:36s} {e['kind'][:30]:30s} {e['shape'][:28]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
