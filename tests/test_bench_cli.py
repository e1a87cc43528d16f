"""CPU smoke test of `python -m pallas_kernels.bench` itself: the FP8 and whole-step parts run end to
end in interpret mode (tiny shapes), write one JSON with the copy bandwidth and well-formed rows,
and a bad --parts value is refused. The timings mean nothing on the CPU."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from pallas_kernels.bench import step as step_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(*args, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "pallas_kernels.bench", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # ~34 s; the kernels' H200 lowering tests and test_bench_smoke_kernels stay in the default suite
def test_fp8_and_step_quick_run(tmp_path):
    out = tmp_path / "bench.json"
    match = "block_o=128, split_k=2, use_dot=True, swap_ab=True, num_warps=8, num_stages=3"
    r = bench("--parts=fp8,step", "--quick", "--interpret", "--step_impls=pallas_m1fma,pallas_noxf16", f"--out={out}",
              "--fp8_sweep", f"--fp8_sweep_match={match}", f"--step_hlo_dir={tmp_path / 'hlo'}", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["copy"]["tb_per_s"] > 0
    assert res["xla_flags"] == os.environ.get("XLA_FLAGS", "")  # best_xla_flags.py compares it
    rows = res["rows"]
    assert not [r for r in rows if "error" in r], rows
    fp8 = [r for r in rows if r["kernel"] == "fp8_matmul"]
    assert {r["impl"] for r in fp8} == {"pallas", "pallas_a8", "xla", "xla_bf16", "pallas_bf16", "dequant_dot"}
    a8 = [r for r in fp8 if r["impl"] == "pallas_a8"]  # E4M3 activations: exact against their own reference
    assert {r["m"] for r in a8} == {1, 5} and all(r["rel_err_a8"] < 1e-5 and r["rel_err"] < 0.1 for r in a8), a8
    fp8 = [r for r in fp8 if r["impl"] != "pallas_a8"]
    from pallas_kernels import fp8_config
    dequant_rows = {r["m"] for r in fp8 if r["impl"] == "dequant_dot"}  # prefill rows only: past the decode kernel's
    assert dequant_rows and all(m > fp8_config.DECODE_MAX_ROWS for m in dequant_rows), dequant_rows
    bf16 = [r for r in fp8 if r["impl"] == "pallas_bf16"]
    assert bf16 and all(r["weight_tb_s"] == 2 * r["tb_s"] for r in bf16)  # two bytes per bf16 weight
    assert all(r["rel_err"] < 1e-2 for r in fp8), fp8  # bf16 outputs of the same exact products
    configs = {r["config"] for r in fp8 if r["impl"] == "pallas" and not r["default"] and r["m"] <= 16}
    assert any(match in c and "x_f16=True" in c for c in configs), configs  # the one candidate --fp8_sweep_match kept
    assert any("x_f16=False" in c and "block_o=64" in c for c in configs), configs  # the default with x_f16 flipped
    assert not any("use_dot=False" in c for c in configs)  # the rest of the sweep left out
    step = {r["impl"]: r for r in rows if r["kernel"] == "decode_step"}
    assert set(step) == {"pallas_m1fma", "pallas_noxf16"}  # two variants (each compiles a step); the plain paths run in many tests
    assert step["pallas_noxf16"]["kernel_settings"]["fp8_x_f16"] is False
    for row in step.values():
        parts = row["bytes_by_part"]
        assert row["bytes"] == sum(parts.values()) and parts["weights"] > parts["kv"] > 0
        assert row["roofline_s"] > 0 and row["steps_timed"] == 4
        assert row["launches_per_step"]["fusion"] > 0 and row["launches_per_step"]["total"] > 0
        with gzip.open(row["hlo"], "rt") as f:  # --step_hlo_dir: the compiled loop, as counted
            assert step_bench.count_launches(f.read()) == row["launches_per_step"]
    assert "decode_step" in r.stdout and "copy bandwidth" in r.stdout  # the summary table


def test_unknown_part_is_refused(tmp_path):
    r = bench("--parts=fp8,nope", f"--out={tmp_path / 'x.json'}", tmp_path=tmp_path)
    assert r.returncode == 2 and "unknown part(s) nope" in r.stderr
    r = bench("--parts=step", "--step_impls=pallas,pallas_preload", f"--out={tmp_path / 'x.json'}", tmp_path=tmp_path)
    assert r.returncode == 2 and "--step_impls: unknown pallas_preload" in r.stderr


def test_count_launches_skips_what_fusions_and_reductions_call():
    from pallas_kernels.bench.step import count_launches
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
