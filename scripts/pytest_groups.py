#!/usr/bin/env python3
"""Runs the test suite as fresh pytest processes over groups of test files, a few at a time (`make test`).

    python scripts/pytest_groups.py [--groups=N (default 16)] [--jobs=J (default: the usable CPUs, at most 4)]
                                    [PYTEST ARGS...]

Why processes: one process running the whole CPU suite got slower as it went. Measured on the
2-core machine: tests/test_model.py + tests/test_engine.py took 121 s in a fresh
process and ~190 s late in the one-process suite, and GC was not it (3.6 s of the 121).

Why J at a time: the suite is mostly XLA compiling tiny programs, and a compile runs on one core, so
one process leaves the second core of a 2-core machine (CI's) mostly idle. J processes at a time
use them all; each test still runs alone in its process, so nothing a test checks changes. (The
tests that share state across processes use the cache's atomic writes: make_checkpoint.ensure_preset
renames a finished directory into place, JAX's compile cache writes whole files.)

The files that load the serving tests' tiny model at the same shapes (SHARED_COMPILES) form the first
group: in one process they compile its prefill and loops once (tests/test_engine.py + tests/test_server.py
151 s together against 81 + 103 s apart, 2-core machine); it is also the longest, so it starts first.
The other files of tests/ (test_*.py, sorted) are split into N - 1 groups of about equal count; each group is
one `python -m pytest PYTEST ARGS FILES` run whose output is printed whole when it ends (so two
groups' lines never interleave), with its wall time. After the first group that fails (pytest's exit
code 5, "no tests collected", counts as a pass: a group may hold only deselected tests) no new group
starts, the running ones finish, and the runner exits with the first failure's code.

The groups share one JAX persistent compile cache, new for each run and deleted after it, that keeps
every program however fast it compiled (JAX's default keeps only those of 1 s or more: almost none of
the tiny models' programs): a group loads what an earlier group compiled. Measured on the 2-core
machine, the whole suite 945 -> 854 s (the serving group 507 -> 443 s). A JAX_* variable set by the
caller wins.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_TESTS_COLLECTED = 5
MAX_DEFAULT_JOBS = 4  # beyond this the groups' memory (a JAX process holds ~1-2 GB) outweighs the gain
# tests/serving_fixtures.py's engines: one model, one set of shapes, the same compiled programs
SHARED_COMPILES = ("test_engine*.py", "test_server*.py", "test_prefix_cache.py", "test_gdn_state_slots.py")


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


def plan(files: list[str], groups: int) -> list[list[str]]:
    """The groups to run, in order: the SHARED_COMPILES files together, then the rest split in
    groups - 1 (at least one)."""
    shared = [f for f in files if any(fnmatch.fnmatch(os.path.basename(f), p) for p in SHARED_COMPILES)]
    rest = [f for f in files if f not in shared]
    if not shared or not rest:
        return split(files, groups)
    return [shared] + split(rest, max(1, groups - 1))


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which containers narrow; os.cpu_count()
    counts the host's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity on this platform
        return os.cpu_count() or 1


def parse_args(argv: list[str]) -> tuple[int, int, list[str]]:
    """(groups, jobs, pytest args) from the command line; ValueError naming a bad value."""
    groups, jobs, args = 16, min(usable_cpus(), MAX_DEFAULT_JOBS), []
    for a in argv:
        if a.startswith("--groups=") or a.startswith("--jobs="):
            name, value = a[2:].split("=", 1)
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"--{name}={value!r}: expected a positive integer")
            if name == "groups":
                groups = int(value)
            else:
                jobs = int(value)
        else:
            args.append(a)
    return groups, jobs, args


def shared_compile_cache_env(directory: str, environ=os.environ) -> dict:
    """The groups' environment: `environ` with JAX's persistent compile cache in `directory`, keeping
    every program (no minimum compile time or size), where `environ` does not set these itself."""
    env = dict(environ)
    for name, value in (("JAX_COMPILATION_CACHE_DIR", directory), ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"),
                        ("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")):
        env.setdefault(name, value)
    return env


def run_groups(chunks: list[list[str]], args: list[str], jobs: int, out=sys.stdout, env=None) -> int:
    """Runs each chunk of files as one pytest process (environment `env`; None: this one's), `jobs` at a
    time, printing each group's output when it ends; returns 0 or the first failing group's exit code."""
    n, t0 = len(chunks), time.perf_counter()
    pending = list(enumerate(chunks, 1))
    running: dict = {}  # group number -> (process, log file, start time, names)
    first_failure = 0
    while pending or running:
        while pending and len(running) < jobs and not first_failure:
            g, chunk = pending.pop(0)
            names = [os.path.relpath(f, ROOT) for f in chunk]
            log = tempfile.TemporaryFile(mode="w+")
            proc = subprocess.Popen([sys.executable, "-m", "pytest", *args, *names], cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT, env=env)
            running[g] = (proc, log, time.perf_counter(), names)
            print(f"== group {g}/{n} started: {' '.join(os.path.basename(x) for x in names)}", file=out, flush=True)
        if first_failure:
            pending.clear()
        done = [g for g, (proc, *_) in running.items() if proc.poll() is not None]
        if not done:
            time.sleep(0.2)
            continue
        for g in done:
            proc, log, start, names = running.pop(g)
            log.seek(0)
            print(f"== group {g}/{n}: {' '.join(os.path.basename(x) for x in names)}", file=out)
            out.write(log.read())
            log.close()
            rc = proc.returncode
            print(f"== group {g}/{n}: exit {rc} in {time.perf_counter() - start:.0f} s", file=out, flush=True)
            if rc not in (0, NO_TESTS_COLLECTED) and not first_failure:
                first_failure = rc
                print(f"pytest_groups: group {g} failed (exit {rc}) after {time.perf_counter() - t0:.0f} s; "
                      "no new group starts", file=out, flush=True)
    if first_failure:
        return first_failure
    print(f"pytest_groups: all {n} groups passed in {time.perf_counter() - t0:.0f} s ({jobs} at a time)", file=out,
          flush=True)
    return 0


def main(argv: list[str]) -> int:
    try:
        groups, jobs, args = parse_args(argv)
    except ValueError as e:
        print(f"pytest_groups: {e}", file=sys.stderr)
        return 2
    files = sorted(glob.glob(os.path.join(ROOT, "tests", "test_*.py")))
    if not files:
        print("pytest_groups: no tests/test_*.py found", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="qmtp_test_compile_cache_") as cache:
        return run_groups(plan(files, groups), args, jobs, env=shared_compile_cache_env(cache))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
