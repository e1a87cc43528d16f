"""scripts/hlo_fusions.py on a program compiled here: every launch that count_launches counts is
listed once, with the ops of its fused computation and the project function they came from."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.bench.step import count_launches
from qmtp import layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import hlo_fusions  # noqa: E402


def compiled_loop_text() -> str:
    def f(x, w):
        def body(_, x):  # a norm, a matmul and a residual add per iteration, as a decoder layer
            return (layers.rms_norm(x, w, 1e-6) @ jnp.ones((8, 8))).astype(x.dtype) + x
        return jax.lax.fori_loop(0, 3, body, x)
    return jax.jit(f).lower(jnp.ones((2, 8)), jnp.ones(8)).compile().as_text()


def test_inventory_counts_the_launches_and_names_their_sources(tmp_path):
    text = compiled_loop_text()
    launches = hlo_fusions.inventory(text)
    assert len(launches) == count_launches(text)["total"]
    from_norm = [e for e in launches if any("qmtp/layers.py" in s and "rms_norm" in s for s in e["sources"])]
    assert from_norm, launches  # the norm's fusions are traced back to qmtp.layers.rms_norm
    assert any("reduce" in e["ops"] for e in from_norm)  # its mean of squares
    assert all(e["kind"].startswith(("fusion", "copy", "custom-call")) for e in launches)
    grouped = hlo_fusions.groups(launches + launches)  # every group twice
    assert sum(g["count"] for g in grouped) == 2 * len(launches) and all(g["count"] % 2 == 0 for g in grouped)
    path = tmp_path / "step.hlo.txt"
    path.write_text(text)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "hlo_fusions.py"), str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{len(launches)} launches") and "rms_norm" in r.stdout


def test_source_frames_walk_the_stack_innermost_first():
    text = """HloModule m

FileNames
1 "/x/qmtp/layers.py"
2 "/x/other.py"

FunctionNames
1 "rms_norm"
2 "caller"

FileLocations
1 {file_name_id=1 function_name_id=1 line=24 end_line=24 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=7 end_line=7 column=1 end_column=2}

StackFrames
1 {file_location_id=2 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=1}
"""
    frames = hlo_fusions.source_frames(text)
    assert frames[2] == ["/x/qmtp/layers.py:24 rms_norm", "/x/other.py:7 caller"]
    assert hlo_fusions.project_frame(frames[2]) == "qmtp/layers.py:24 rms_norm"
    assert hlo_fusions.project_frame(frames[1]) is None
