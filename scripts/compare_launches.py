"""Side by side: the FP8 launches of several `pallas_kernels.bench --parts=fp8_launches` runs.

    python scripts/compare_launches.py BASE.json OTHER.json [...] [--by=kernel|busy|wall]

One row per (launch, M, layout): each run's time per call in us (by the kernels' device time by
default; `busy` adds the launch's XLA pieces, `wall` is the timing loop's clock), and each other run's
ratio to the first; then each run's per-step sums ("M layout": ms per step and share of its copy
bandwidth; the bench's own sums, by the kernels' device time where measured, or with --by=busy the
busy time). Each column is headed by its file's name and the kernel settings that differ from the
first run's, so a lease's variants (`--kernels=...`) read as what they changed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

BY = {"kernel": "kernel_s_per_call", "busy": "busy_s_per_call", "wall": "s_per_call"}


def load(path: str) -> dict:
    """A bench JSON with fp8_launch rows, or SystemExit naming the file."""
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: not a bench JSON ({e})") from None
    if not any(r.get("kernel") == "fp8_launch" for r in res.get("rows", [])):
        raise SystemExit(f"{path}: no fp8_launch rows (run `pallas_kernels.bench --parts=fp8_launches`)")
    return res


def label(path: str, res: dict, base: dict) -> str:
    """The file's name and the kernel settings that differ from the base run's."""
    mine, theirs = res.get("kernel_settings", {}), base.get("kernel_settings", {})
    diff = [f"{k}={v}" for k, v in mine.items() if theirs.get(k) != v]
    return os.path.basename(path) + (f" ({', '.join(diff)})" if diff else "")


def launch_times(res: dict, key: str) -> dict:
    """{(launch, m, layout): seconds per call} of a run's fp8_launch rows that carry `key`."""
    return {(r["launch"], r["m"], r.get("layout", "checkpoint")): r[key]
            for r in res["rows"] if r.get("kernel") == "fp8_launch" and key in r}


def table(paths: list[str], by: str = "kernel") -> str:
    """The comparison as text (module doc)."""
    runs = [load(p) for p in paths]
    key = BY[by]
    times = [launch_times(r, key) for r in runs]
    lines = [f"by {key}; columns:"] + [f"  [{j}] {label(p, r, runs[0])}" for j, (p, r) in enumerate(zip(paths, runs))]
    cases = sorted({c for t in times for c in t}, key=lambda c: (c[1], c[2], c[0]))
    head = f"{'launch':34s} {'M':>4s} {'layout':10s}" + "".join(f" {f'[{j}] us':>10s}" for j in range(len(runs)))
    head += "".join(f" {f'[{j}]/[0]':>8s}" for j in range(1, len(runs)))
    lines += ["", head]
    for c in cases:
        vals = [t.get(c) for t in times]
        row = f"{c[0]:34s} {c[1]:4d} {c[2]:10s}" + "".join(f" {v * 1e6:10.1f}" if v else f" {'-':>10s}" for v in vals)
        row += "".join(f" {v / vals[0]:8.3f}" if v and vals[0] else f" {'-':>8s}" for v in vals[1:])
        lines.append(row)
    # the bench sums a step by the kernels' device time where measured (its "by"), or with the XLA pieces
    busy = by == "busy"
    basis = "busy" if busy else "the bench's own"
    lines += ["", f"per step (ms, share of the run's copy bandwidth; {basis} sums):"]
    steps = sorted({k for r in runs for k in r.get("fp8_launches", {}).get("per_step", {})},
                   key=lambda k: (int(k.split()[0]), k))
    for k in steps:
        cells = []
        for r in runs:
            s = r.get("fp8_launches", {}).get("per_step", {}).get(k, {})
            prefix = "busy_" if busy else ""
            sec, share = s.get(f"{prefix}s"), s.get(f"{prefix}share_of_copy")
            cells.append(f"{sec * 1e3:8.2f} ({share:.0%})" if sec else "-")
        lines.append(f"  {k:12s}" + "".join(f" {c:>15s}" for c in cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="bench JSON files; the first is the base of the ratios")
    ap.add_argument("--by", choices=sorted(BY), default="kernel",
                    help="kernel: the Pallas kernels' device time; busy: with the launch's XLA pieces; wall: the clock")
    args = ap.parse_args(argv)
    print(table(args.runs, args.by))
    return 0


if __name__ == "__main__":
    sys.exit(main())
