"""scripts/trace_summary.py on a crafted perfetto trace: busy time is the union of the kernels'
intervals, idle gaps are what remains of the span, only the asked-for processes count, device time
splits by program, and the host's Python frames are charged with the idle gaps they overlap."""

import gzip
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import trace_summary  # noqa: E402

EVENTS = [
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    # GPU: [0, 10) matmul, [5, 12) overlapping copy, gap, [20, 24) matmul: busy 12 + 4 of a 24 span
    {"ph": "X", "pid": 1, "tid": 1, "name": "matmul", "ts": 0, "dur": 10, "args": {"hlo_module": "jit_decode"}},
    {"ph": "X", "pid": 1, "tid": 2, "name": "copy", "ts": 5, "dur": 7, "args": {"hlo_module": "jit_take_rows"}},
    {"ph": "X", "pid": 1, "tid": 1, "name": "matmul", "ts": 20, "dur": 4, "args": {"hlo_module": "jit_decode"}},
    {"ph": "X", "pid": 2, "tid": 1, "name": "host work", "ts": 0, "dur": 100},
]


def test_busy_share_and_ranking():
    (gpu,) = trace_summary.summarize(EVENTS, "GPU")
    assert gpu["events"] == 3 and gpu["summed_us"] == 21 and gpu["span_us"] == 24 and gpu["busy_us"] == 16
    assert gpu["top"][0] == {"name": "matmul", "count": 2, "us": 14.0}
    assert len(trace_summary.summarize(EVENTS, "")) == 2


def test_idle_gaps_lie_between_the_union_of_the_kernels():
    (gpu,) = trace_summary.summarize(EVENTS, "GPU")
    gaps = gpu["idle_gaps"]
    # one gap: the overlapping copy ends the busy stretch at 12, the next matmul starts at 20
    assert gaps["count"] == 1 and gaps["us"] == 8 and gaps["largest"] == [{"us": 8, "after": "copy", "before": "matmul"}]
    assert [b["count"] for b in gaps["buckets"]] == [0, 1, 0, 0, 0] and gaps["buckets"][1]["us"] == 8
    events = EVENTS + [{"ph": "X", "pid": 1, "tid": 1, "name": "after a sync", "ts": 1124, "dur": 1}]
    (gpu,) = trace_summary.summarize(events, "GPU")
    assert [b["count"] for b in gpu["idle_gaps"]["buckets"]] == [0, 1, 0, 0, 1]  # 1100 us: >= 1 ms
    assert gpu["idle_gaps"]["largest"][0] == {"us": 1100, "after": "matmul", "before": "after a sync"}


def test_idle_gaps_inside_a_run_and_between_runs():
    kernels = [{"ph": "X", "pid": 1, "tid": 1, "name": n, "ts": ts, "dur": 2, "args": {"hlo_module": m, "run_id": r}}
               for n, ts, m, r in (("a", 0, "jit_loop", 1), ("b", 5, "jit_loop", 1),  # 3 us inside run 1
                                   ("c", 20, "jit_loop", 2),  # 13 us between runs 1 and 2
                                   ("d", 30, "jit_prefill", 7), ("e", 33, "jit_prefill", 7))]  # 8 between, 1 inside
    (gpu,) = trace_summary.summarize(EVENTS[:1] + kernels, "GPU")
    gaps = gpu["idle_gaps"]
    assert gaps["us"] == 25 and gaps["inside_runs_us"] == 4 and gaps["between_runs_us"] == 21
    assert gaps["inside_by_program"] == [{"program": "jit_loop", "count": 1, "us": 3.0},
                                         {"program": "jit_prefill", "count": 1, "us": 1.0}]


def test_device_time_by_program():
    (gpu,) = trace_summary.summarize(EVENTS, "GPU")
    assert gpu["programs"] == [{"program": "jit_decode", "kernels": 2, "us": 14.0},
                               {"program": "jit_take_rows", "kernels": 1, "us": 7.0}]


def test_host_frames_are_charged_with_the_gaps_they_overlap():
    # device busy [0, 12) and [20, 24), then [124, 125): gaps [12, 20) (8 us) and [24, 124) (100 us)
    host = [{"ph": "X", "pid": 2, "tid": 7, "name": "$engine.py:1 _iteration", "ts": 10, "dur": 120},
            {"ph": "X", "pid": 2, "tid": 7, "name": "$prompt_passes.py:2 keep", "ts": 30, "dur": 50},
            {"ph": "X", "pid": 2, "tid": 7, "name": "$engine.py:3 _deliver", "ts": 14, "dur": 4},
            {"ph": "X", "pid": 2, "tid": 8, "name": "not a Python frame", "ts": 30, "dur": 50}]
    events = EVENTS + host + [{"ph": "X", "pid": 1, "tid": 1, "name": "late", "ts": 124, "dur": 1}]
    (gpu,) = trace_summary.summarize(events, "GPU", gap_us=5)
    h = gpu["host_during_gaps"]
    assert h["gaps"] == 2 and h["gap_us"] == 108
    assert h["frames"] == [{"frame": "engine.py:1 _iteration", "us": 108.0},
                           {"frame": "prompt_passes.py:2 keep", "us": 50.0}, {"frame": "engine.py:3 _deliver", "us": 4.0}]
    (gpu,) = trace_summary.summarize(events, "GPU", gap_us=50)  # only the 100 us gap
    assert gpu["host_during_gaps"]["frames"] == [{"frame": "engine.py:1 _iteration", "us": 100.0},
                                                 {"frame": "prompt_passes.py:2 keep", "us": 50.0}]


def test_cli_finds_the_trace_in_a_directory(tmp_path):
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "trace_summary.py"), str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    (gpu,) = json.loads(r.stdout)["processes"]
    assert gpu["busy_share"] == 16 / 24
