"""CPU smoke test of `python -m pallas_kernels.bench` itself: the FP8 part runs end to end in interpret
mode (tiny shapes), writes one JSON with the copy bandwidth and well-formed rows, and a bad --parts
value is refused. The timings mean nothing on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(*args, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "pallas_kernels.bench", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # ~30 s; the kernels' H200 lowering tests and test_bench_smoke_kernels stay in the default suite
def test_fp8_quick_run(tmp_path):
    out = tmp_path / "bench.json"
    r = bench("--parts=fp8", "--quick", "--interpret", f"--out={out}", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["copy"]["tb_per_s"] > 0
    rows = res["rows"]
    assert not [r for r in rows if "error" in r], rows
    fp8 = [r for r in rows if r["kernel"] == "fp8_matmul"]
    assert {"pallas", "xla", "dequant_dot"} <= {r["impl"] for r in fp8}
    from pallas_kernels import fp8_config
    dequant_rows = {r["m"] for r in fp8 if r["impl"] == "dequant_dot"}  # prefill rows only: past the decode kernel's
    assert dequant_rows and all(m > fp8_config.DECODE_MAX_ROWS for m in dequant_rows), dequant_rows
    exact = [r for r in fp8 if r["impl"] != "pallas_a8"]
    assert all(r["rel_err"] < 1e-2 for r in exact), exact  # bf16 outputs of the same exact products
    assert "copy bandwidth" in r.stdout  # the summary table


def test_unknown_part_is_refused(tmp_path):
    r = bench("--parts=fp8,nope", f"--out={tmp_path / 'x.json'}", tmp_path=tmp_path)
    assert r.returncode == 2 and "unknown part(s) nope" in r.stderr
    r = bench("--parts=step", f"--out={tmp_path / 'x.json'}", tmp_path=tmp_path)  # python -m qmtp.bench.step
    assert r.returncode == 2 and "unknown part(s) step" in r.stderr


@pytest.mark.slow  # ~16 s: interpret-mode kernels; the tiled layouts themselves are tested in test_kernel_fp8_matmul
def test_fp8_part_on_tiled_weights():
    """fp8.run(layout="tiled"): the Pallas rows read tile_weight's tiles (labelled "tiled") and agree
    with the reference."""
    from pallas_kernels.bench import fp8
    rows = []
    fp8.run(1.0, rows.append, quick=True, interpret=True, xla=False, only_shapes=[(128, 256)], device_time=False,
            layout="tiled")
    assert rows and not [r for r in rows if "error" in r], rows
    assert {r["layout"] for r in rows if r["impl"] in ("pallas", "pallas_a8")} == {"tiled"}
    assert all(r["rel_err"] < 1e-2 for r in rows if r["impl"] == "pallas"), rows
