"""qmtp.bench.step, the model-level decode-step benchmark: a CPU smoke run on the tiny preset writes
its rows (the timings mean nothing on the CPU), and the launch count skips what fusions call."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from qmtp.bench.step import count_launches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # CI time: a GPU measuring tool; its launch counter is tested below
def test_quick_run_writes_both_paths(tmp_path):
    out = tmp_path / "step.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "qmtp.bench.step", "--quick", f"--out={out}"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["impl"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"pallas", "ref"}
    for row in rows.values():
        parts = row["bytes_by_part"]
        assert row["bytes"] == sum(parts.values()) and parts["weights"] > parts["kv"] > 0
        assert row["roofline_s"] > 0 and row["steps_timed"] == 4
        # a difference of two timings: on a loaded CPU it can come out <= 0, so only its presence is checked
        assert math.isfinite(row["s_per_step"])
        assert row["launches_per_step"]["fusion"] > 0 and row["launches_per_step"]["total"] > 0
    assert "pallas:" in r.stdout and "of the roofline" in r.stdout


def test_count_launches_skips_what_fusions_and_reductions_call():
    hlo = """HloModule m

%fused_computation (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %copy.9 = f32[8]{0} copy(%p)
  ROOT %inner = f32[8]{0} fusion(%copy.9), kind=kLoop, calls=%nested
}

%nested (q: f32[8]) -> f32[8] {
  ROOT %q = f32[8]{0} parameter(0)
}

%add_reduce (a: f32[], b: f32[]) -> f32[] {
  ROOT %copy.3 = f32[] copy(%a)
}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %f = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %k = f32[8]{0} custom-call(%f), custom_call_target="__gpu$xla.gpu.triton"
  %r = f32[8]{0} all-reduce(%k), to_apply=%add_reduce
  ROOT %c = f32[8]{0} copy(%r)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %w = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_computation
}
"""
    assert count_launches(hlo) == {"fusion": 2, "custom-call": 1, "all-reduce": 1, "copy": 1, "total": 5}


def test_step_bench_checks_its_output_before_the_run(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "qmtp.bench.step", "--quick", f"--out={tmp_path / 'missing' / 's.json'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --out=") and "does not exist" in lines[0], r.stderr[-3000:]
    assert "pallas:" not in r.stdout  # nothing was timed
