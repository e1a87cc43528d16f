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
"""

from __future__ import annotations

import argparse
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


def idle_gaps(events: list[dict], top: int = 10) -> dict:
    """The device's idle gaps between kernels: where no event runs, from the end of the union of the
    events so far to the next start. A sync of the host (a while loop's or a cond's predicate read,
    as XLA on the GPU does) shows as a gap before the kernels that follow it; launch-bound stretches
    as many short gaps. Returns per-bucket counts and microseconds, and the largest gaps with the
    kernels on either side."""
    evs = sorted(((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "?")) for e in events))
    gaps, end, last = [], float("-inf"), None
    for a, b, name in evs:
        if last is not None and a > end:
            gaps.append((a - end, last, name))
        if b > end:
            end, last = b, name
    edges = (0,) + GAP_BUCKETS_US + (float("inf"),)
    buckets = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = [g for g, _, _ in gaps if lo <= g < hi]
        buckets.append({"from_us": lo, "to_us": hi, "count": len(inside), "us": sum(inside)})
    largest = sorted(gaps, key=lambda g: -g[0])[:top]
    return {"count": len(gaps), "us": sum(g for g, _, _ in gaps), "buckets": buckets,
            "largest": [{"us": g, "after": p, "before": n} for g, p, n in largest]}


def summarize(events: list[dict], process_filter: str = "GPU", top: int = 15) -> list[dict]:
    names = {e["pid"]: e.get("args", {}).get("name", "")
             for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    by_pid = trace_events.process_events(events, process_filter)
    out = []
    for pid, evs in sorted(by_pid.items()):
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
                    "idle_gaps": idle_gaps(evs)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--process", default="GPU", help="substring of the process names to keep ('' = all)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    trace = find_trace(args.path)
    summary = summarize(trace_events.load_events(trace), args.process, args.top)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
