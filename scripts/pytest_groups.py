#!/usr/bin/env python3
"""Runs the test suite as a few pytest processes over consecutive groups of test files (`make test`).

    python scripts/pytest_groups.py [--groups=N (default 16)] [PYTEST ARGS...]

Why: one process running the whole CPU suite got slower as it went. Measured on the 2-core machine
(session 16): tests/test_model.py + tests/test_engine.py took 121 s in a fresh process and ~190 s
late in the one-process suite, and GC was not it (3.6 s of the 121). Each group starts a fresh
process; the per-process start (jax import, collection) is a few seconds.

The files of tests/ (test_*.py, sorted) are split into N groups of about equal count; each group is
one `python -m pytest PYTEST ARGS FILES` run. Stops after the first group that fails (pytest's exit
code 5, "no tests collected", counts as a pass: a group may hold only deselected tests) and exits with
that code; prints each group's wall time and the total.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_TESTS_COLLECTED = 5


def split(files: list[str], groups: int) -> list[list[str]]:
    """Consecutive runs of files, as equal in count as they can be, none empty."""
    groups = max(1, min(groups, len(files)))
    size, extra = divmod(len(files), groups)
    out, start = [], 0
    for g in range(groups):
        end = start + size + (1 if g < extra else 0)
        out.append(files[start:end])
        start = end
    return out


def main(argv: list[str]) -> int:
    groups = 16
    args = []
    for a in argv:
        if a.startswith("--groups="):
            groups = int(a.split("=", 1)[1])
        else:
            args.append(a)
    files = sorted(glob.glob(os.path.join(ROOT, "tests", "test_*.py")))
    if not files:
        print("pytest_groups: no tests/test_*.py found", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    for g, chunk in enumerate(split(files, groups), 1):
        names = [os.path.relpath(f, ROOT) for f in chunk]
        print(f"== group {g}/{groups}: {' '.join(os.path.basename(n) for n in names)}", flush=True)
        t = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", "pytest", *args, *names], cwd=ROOT)
        print(f"== group {g}/{groups}: exit {rc} in {time.perf_counter() - t:.0f} s", flush=True)
        if rc not in (0, NO_TESTS_COLLECTED):
            print(f"pytest_groups: group {g} failed (exit {rc}) after {time.perf_counter() - t0:.0f} s", flush=True)
            return rc
    print(f"pytest_groups: all {groups} groups passed in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
