#!/usr/bin/env python3
"""Where a profiled run's device time goes: a summary of a jax.profiler perfetto trace.

    python scripts/trace_summary.py DIR_OR_FILE [--top=15] [--process=GPU]

DIR_OR_FILE: a `perfetto_trace.json.gz` (or a directory holding one, e.g. what
`python -m pallas_kernels.bench --parts=step --step_trace_dir=DIR` writes). For every traced process
whose name contains --process (default "GPU"; "" = all): the number of complete events (kernels),
their summed time, the wall span from the first start to the last end, the busy share of that span
(the union of the events' intervals: what is left is idle device time between kernels, i.e. launch
gaps and host waits), and the events with the most summed time. A decode step that is bound by
launches shows many short kernels and a low busy share; one bound by HBM, a high busy share with
the matmuls on top.

Per process also: the device time of each compiled program (the kernels' `hlo_module`, so a served
run splits into its decode loop, prefills and cache copies) and, where the trace holds the host's
Python frames (jax.profiler's Python tracer, on by default), which frames ran while the device idled
for --gap_us or longer: each frame's summed overlap with those gaps (callers include their callees'),
i.e. what the host was doing while the device waited for it.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere
from pallas_kernels.bench import trace_events  # noqa: E402


def find_trace(path: str) -> str:
    try:
        return trace_events.find_trace(path)
    except FileNotFoundError as e:
        raise SystemExit(f"trace_summary: {e}") from None



GAP_BUCKETS_US = (5, 20, 100, 1000)  # idle gaps counted as < 5 us, 5-20, 20-100, 100-1000, >= 1000


def device_gaps(events: list[dict]) -> list[tuple]:
    """The device's idle gaps between kernels: where no event runs, from the end of the union of the
    events so far to the next start, each (start us, end us, kernel before, kernel after, program) with
    program the args hlo_module of the kernels on both sides where they belong to one run of it (same
    hlo_module and run_id: the program's own control flow or launches), else None (between runs: the
    host's work between device calls). A trace without run ids counts back-to-back runs of one program
    as one run."""
    evs = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "?"), _run(e)) for e in events)
    gaps, end, last, last_run = [], float("-inf"), None, None
    for a, b, name, run in evs:
        if last is not None and a > end:
            gaps.append((end, a, last, name, run[0] if run is not None and run == last_run else None))
        if b > end:
            end, last, last_run = b, name, run
    return gaps


def _run(event: dict):
    """(program, run id) of a kernel event, None where the trace does not say."""
    args = event.get("args", {})
    return (args["hlo_module"], args.get("run_id")) if "hlo_module" in args else None


def idle_gaps(gaps: list[tuple], top: int = 10) -> dict:
    """device_gaps summed: per-bucket counts and microseconds, the largest gaps with the kernels on
    either side, and the time inside a program's run against between runs, the inside summed per program.
    A sync of the host (a while loop's or a cond's predicate read, as XLA on the GPU does) shows as a gap
    before the kernels that follow it; launch-bound stretches as many short gaps."""
    edges = (0,) + GAP_BUCKETS_US + (float("inf"),)
    buckets = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = [b - a for a, b, *_ in gaps if lo <= b - a < hi]
        buckets.append({"from_us": lo, "to_us": hi, "count": len(inside), "us": sum(inside)})
    in_run = collections.defaultdict(lambda: [0, 0.0])
    for a, b, _, _, program in gaps:
        if program is not None:
            in_run[program][0] += 1
            in_run[program][1] += b - a
    largest = sorted(gaps, key=lambda g: g[0] - g[1])[:top]
    total = sum(b - a for a, b, *_ in gaps)
    inside_us = sum(t for _, t in in_run.values())
    return {"count": len(gaps), "us": total, "buckets": buckets,
            "largest": [{"us": b - a, "after": p, "before": n} for a, b, p, n, _ in largest],
            "inside_runs_us": inside_us, "between_runs_us": total - inside_us,
            "inside_by_program": [{"program": n, "count": c, "us": t}
                                  for n, (c, t) in sorted(in_run.items(), key=lambda kv: -kv[1][1])[:top]]}


def per_program(events: list[dict], top: int) -> list[dict]:
    """Device time by compiled program (the events' args.hlo_module; "?" where absent), most first."""
    sums = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        name = e.get("args", {}).get("hlo_module", "?")
        sums[name][0] += 1
        sums[name][1] += float(e["dur"])
    ranked = sorted(sums.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"program": n, "kernels": c, "us": t} for n, (c, t) in ranked]


def host_during_gaps(gaps: list[tuple], host_events: list[dict], min_gap_us: float, top: int) -> dict:
    """The host's Python frames (events named "$file:line function") during the device's idle gaps
    (device_gaps) of at least min_gap_us: per frame name, the summed overlap of its events with those
    gaps (a caller's includes its callees'), most first."""
    gaps = [(a, b) for a, b, *_ in gaps if b - a >= min_gap_us]
    starts = [a for a, _ in gaps]
    overlap = collections.defaultdict(float)
    for e in host_events:
        name = e.get("name", "")
        if not name.startswith("$"):
            continue
        a, b = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        i = max(bisect.bisect_right(starts, a) - 1, 0)
        while i < len(gaps) and gaps[i][0] < b:
            overlap[name] += max(0.0, min(b, gaps[i][1]) - max(a, gaps[i][0]))
            i += 1
    ranked = sorted(((n, t) for n, t in overlap.items() if t > 0), key=lambda kv: -kv[1])[:top]
    return {"min_gap_us": min_gap_us, "gaps": len(gaps), "gap_us": sum(b - a for a, b in gaps),
            "frames": [{"frame": n[1:], "us": t} for n, t in ranked]}


def summarize(events: list[dict], process_filter: str = "GPU", top: int = 15, gap_us: float = 100.0) -> list[dict]:
    names = {e["pid"]: e.get("args", {}).get("name", "")
             for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    by_pid = trace_events.process_events(events, process_filter)
    host = [e for e in events if e.get("ph") == "X" and "dur" in e and e.get("pid") not in by_pid]
    out = []
    for pid, evs in sorted(by_pid.items()):
        gaps = device_gaps(evs)
        intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in evs]
        span = max(b for _, b in intervals) - min(a for a, _ in intervals)
        per_name = collections.defaultdict(lambda: [0, 0.0])
        for e in evs:
            per_name[e.get("name", "?")][0] += 1
            per_name[e.get("name", "?")][1] += float(e["dur"])
        ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]
        busy = trace_events.busy_time(intervals)
        out.append({"process": names.get(pid, str(pid)), "events": len(evs),
                    "summed_us": sum(float(e["dur"]) for e in evs), "span_us": span, "busy_us": busy,
                    "busy_share": busy / span if span > 0 else 0.0,
                    "top": [{"name": n, "count": c, "us": t} for n, (c, t) in ranked],
                    "programs": per_program(evs, top), "idle_gaps": idle_gaps(gaps),
                    "host_during_gaps": host_during_gaps(gaps, host, gap_us, top)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--process", default="GPU", help="substring of the process names to keep ('' = all)")
    ap.add_argument("--gap_us", type=float, default=100.0,
                    help="the shortest device idle gap whose host Python frames are summed (us)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    trace = find_trace(args.path)
    summary = summarize(trace_events.load_events(trace), args.process, args.top, args.gap_us)
    if args.json:
        print(json.dumps({"trace": trace, "processes": summary}, indent=1))
        return 0
    print(f"trace {trace}")
    if not summary:
        print(f"no complete events in processes matching {args.process!r}", file=sys.stderr)
        return 1
    for p in summary:
        print(f"\n{p['process']}: {p['events']} events, {p['summed_us'] / 1e3:.2f} ms summed over a "
              f"{p['span_us'] / 1e3:.2f} ms span, busy {p['busy_share']:.0%}")
        for t in p["top"]:
            print(f"  {t['us'] / 1e3:9.3f} ms  {t['count']:6d} x  {t['name'][:100]}")
        gaps = p["idle_gaps"]
        print(f"  idle gaps: {gaps['count']}, {gaps['us'] / 1e3:.2f} ms: " + ", ".join(
            f"[{b['from_us']:g}, {b['to_us']:g}) us {b['count']} x {b['us'] / 1e3:.2f} ms" for b in gaps["buckets"]))
        for g in gaps["largest"][:5]:
            print(f"    {g['us']:9.1f} us after {g['after'][:50]} before {g['before'][:50]}")
        print(f"  idle inside a program's run {gaps['inside_runs_us'] / 1e3:.2f} ms, between runs "
              f"{gaps['between_runs_us'] / 1e3:.2f} ms; inside, by program:")
        for q in gaps["inside_by_program"][:5]:
            print(f"  {q['us'] / 1e3:9.3f} ms  {q['count']:7d} gaps  {q['program'][:90]}")
        print("  device time by program:")
        for q in p["programs"]:
            print(f"  {q['us'] / 1e3:9.3f} ms  {q['kernels']:7d} kernels  {q['program'][:90]}")
        h = p["host_during_gaps"]
        if h["frames"]:
            print(f"  host Python frames during the {h['gaps']} idle gaps of >= {h['min_gap_us']:g} us "
                  f"({h['gap_us'] / 1e3:.2f} ms):")
            for f in h["frames"]:
                print(f"  {f['us'] / 1e3:9.3f} ms  {f['frame'][:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
