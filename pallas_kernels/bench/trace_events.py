"""Device time from a JAX profiler trace: what a kernel costs on the GPU, without the host's clock.

A wall-clock figure per call (`common.timed` over a jitted loop) includes the device's idle time
between back-to-back launches (~2-4 us on the H200), which weighs most on small weights: a 31 MB
FP8 GEMV of ~10 us of kernel time measured ~13 us per call. `device_time` runs a program once under
`jax.profiler.trace` and reads the perfetto trace's complete events ("X") of the GPU processes:

    kernel_s  summed duration of the events whose name starts with a prefix (one kernel's launches)
    busy_s    length of the union of every event's interval (the kernel and the XLA fusions around
              it, no idle gaps)

`scripts/trace_summary.py` reads the same traces for a whole decode step.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import tempfile


def find_trace(path: str) -> str:
    """The newest perfetto_trace.json.gz at or under `path`."""
    if os.path.isfile(path):
        return path
    found = sorted(glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True))
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {path}")
    return found[-1]


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def process_events(events: list[dict], process_filter: str = "GPU") -> dict[int, list[dict]]:
    """pid -> the complete events (with a duration) of the processes whose name contains the filter."""
    names = {e["pid"]: e.get("args", {}).get("name", "")
             for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    out: dict[int, list[dict]] = {}
    for e in events:
        if e.get("ph") == "X" and "dur" in e and process_filter in names.get(e.get("pid"), ""):
            out.setdefault(e["pid"], []).append(e)
    return out


def kernel_time(events: list[dict], prefix: str, process_filter: str = "GPU") -> dict | None:
    """{kernel_s, kernel_launches, busy_s, devices, busy_s_per_device} over the GPU processes' events
    (trace times are in us; the sums run over every device, busy_s_per_device is the busiest one's),
    or None when the trace has no GPU events (a CPU run)."""
    per_pid = process_events(events, process_filter)
    if not per_pid:
        return None
    kernel_us, launches, busy = 0.0, 0, []
    for evs in per_pid.values():
        mine = [e for e in evs if str(e.get("name", "")).startswith(prefix)]
        kernel_us += sum(float(e["dur"]) for e in mine)
        launches += len(mine)
        busy.append(busy_time([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in evs]))
    return {"kernel_s": kernel_us * 1e-6, "kernel_launches": launches, "busy_s": sum(busy) * 1e-6,
            "devices": len(busy), "busy_s_per_device": max(busy) * 1e-6}


# the numbering XLA and Pallas append to a launch's name (fusion_6282, fp8_matmul_decode__7,
# input_concatenate_fusion_260): two compiled programs number the same kind of launch differently
_NUMBERING = re.compile(r"(?:_+\d+)+$")


def launch_kind(name: str) -> str:
    """A launch's name without its numbering: 'fp8_matmul_decode__7' -> 'fp8_matmul_decode',
    'loop_add_fusion_127' -> 'loop_add_fusion', 'memcpy128' stays (no separator)."""
    return _NUMBERING.sub("", name) or name


def kernel_table(events: list[dict], process_filter: str = "GPU") -> dict[str, dict] | None:
    """launch_kind -> {"us": summed duration, "count": launches} over the busiest GPU process (the
    one with the most summed event time), the largest first; None without GPU events."""
    per_pid = process_events(events, process_filter)
    if not per_pid:
        return None
    evs = max(per_pid.values(), key=lambda es: sum(float(e["dur"]) for e in es))
    table: dict[str, dict] = {}
    for e in evs:
        row = table.setdefault(launch_kind(str(e.get("name", ""))), {"us": 0.0, "count": 0})
        row["us"] += float(e["dur"])
        row["count"] += 1
    return dict(sorted(table.items(), key=lambda kv: -kv[1]["us"]))


def device_time(fn, *args, prefix: str) -> dict | None:
    """kernel_time of one call of `fn(*args)` (compiled before: call it once first) run under the
    profiler, with its kernel_table under "kernels"; None on the CPU (no device events: the profiler
    is not started) or on a backend whose trace has no GPU events."""
    import jax
    if jax.default_backend() == "cpu":
        return None
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(fn(*args))
        events = load_events(find_trace(d))
    got = kernel_time(events, prefix)
    return None if got is None else dict(got, kernels=kernel_table(events))
