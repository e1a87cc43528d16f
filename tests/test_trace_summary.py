"""scripts/trace_summary.py on a crafted perfetto trace: busy time is the union of the kernels'
intervals, idle gaps are what remains of the span, only the asked-for processes count."""

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
    {"ph": "X", "pid": 1, "tid": 1, "name": "matmul", "ts": 0, "dur": 10},
    {"ph": "X", "pid": 1, "tid": 2, "name": "copy", "ts": 5, "dur": 7},
    {"ph": "X", "pid": 1, "tid": 1, "name": "matmul", "ts": 20, "dur": 4},
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
