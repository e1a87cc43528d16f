"""The FP8 launch groups of the bench (pallas_kernels/bench/fp8_launches.py): they must be the launches
the step makes, over the 27B shapes the model declares, and the part must run end to end (interpret mode
on the CPU; timings mean nothing)."""

from __future__ import annotations

import collections
import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pallas_kernels.bench import fp8, fp8_launches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_shapes_are_the_models():
    """fp8.PROJECTIONS and LAYERS (the bench imports nothing from qmtp) are the FP8 weights of the 27B
    target's parameter tree, layer kind by layer kind."""
    import jax.numpy as jnp

    from qmtp.model import config as qc, params as qp
    from qmtp.model.fp8 import Fp8Block
    from qmtp.tools import make_checkpoint

    tree = qp.abstract_params(qc.from_dict(make_checkpoint.build_config("qwen3_5_27b", "fp8", 0, None)),
                              jnp.bfloat16, fp8_linear=True)
    for kind, projections in fp8.PROJECTIONS.items():
        assert len(tree[kind]) == fp8.LAYERS[kind], kind
        for layer in tree[kind]:
            assert {k: tuple(v.shape) for k, v in layer.items() if isinstance(v, Fp8Block)} == projections, kind


def test_launch_groups_cover_every_fp8_weight_of_the_step_once():
    """Summed over the launches, every FP8 weight shape of the 27B step appears as often as the
    per-weight bench counts it (fp8.step_shapes): nothing missed, nothing twice."""
    counts = collections.Counter()
    for launch in fp8_launches.step_launches():
        for shape in launch["shapes"]:
            counts[tuple(shape)] += launch["count"]
    assert counts == {shape: len(keys) for shape, keys in fp8.step_shapes().items()}
    names = {x["name"]: x for x in fp8_launches.step_launches()}
    # k and v never launch alone: they ride with q (16 attention layers of the 27B model)
    assert names["attn.q_proj+k_proj+v_proj"]["shapes"] == [(12288, 5120), (1024, 5120), (1024, 5120)]
    assert names["attn.q_proj+k_proj+v_proj"]["count"] == 16 and names["gdn.in_proj_qkv+in_proj_z"]["count"] == 48


def test_a_group_that_misses_a_weight_is_refused(monkeypatch):
    groups = dict(fp8_launches.LAUNCH_GROUPS, attn=(("q_proj", "k_proj"), ("o_proj",), ("mlp_gate", "mlp_up"),
                                                    ("mlp_down",)))
    monkeypatch.setattr(fp8_launches, "LAUNCH_GROUPS", groups)
    with pytest.raises(ValueError, match=r"LAUNCH_GROUPS\['attn'\] covers .*v_proj"):
        fp8_launches.step_launches()


def test_target_lines():
    result = {"per_step": {1: {"share_of_copy": 0.87, "by": "kernel_s_per_call", "s": 7.1e-3, "busy_s": 8.0e-3},
                           16: {"share_of_copy": 0.62, "by": "kernel_s_per_call", "s": 9.9e-3}},
              "targets": {1: [], 16: [{"launch": "attn.o_proj", "share_of_copy": 0.5}]}}
    lines = fp8_launches.target_lines(result)
    assert lines[0].startswith("target met: FP8 launches at M=1") and "87%" in lines[0]
    assert "7.10 ms, 8.00 ms with their XLA pieces and sums" in lines[0] and "9.90 ms)" in lines[1]
    assert lines[1].startswith("target missed: FP8 launches at M=16") and lines[1].endswith("attn.o_proj 50%")
    result["targets"][16][0]["floor_share_of_copy"] = 0.83  # with the launch's read floor measured
    assert fp8_launches.target_lines(result)[1].endswith("attn.o_proj 50% (read floor 83%)")


@pytest.mark.parametrize("m", [1, 136])  # the decode grid (one call for all weights) and the GEMM (one per weight)
def test_timed_launch_reads_every_weight(m):
    """The timing loop's result depends on every weight of a launch: a NaN scale in the last weight
    reaches it (XLA would drop a GEMM call whose output is never read, and the launch would be timed
    without it)."""
    from pallas_kernels.bench.fp8 import loop_program
    from pallas_kernels.bench.fp8_launches import launch_output
    from pallas_kernels import fp8_config
    import jax.numpy as jnp
    assert (m > fp8_config.DECODE_MAX_ROWS) == (m == 136)
    x = jnp.ones((m, 256), jnp.bfloat16)
    ws = tuple(jnp.ones((o, 256), jnp.float8_e4m3fn) for o in (128, 64))
    ss = (jnp.ones((1, 2), jnp.float32), jnp.full((1, 2), jnp.nan, jnp.float32))
    prog = loop_program(functools.partial(launch_output, interpret=True), 1, False)
    _, acc = prog(x, (ws,), (ss,))
    assert np.isnan(float(acc))


def test_quick_run(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "pallas_kernels.bench", "--parts=fp8_launches", "--quick", "--interpret",
                        "--fp8_launch_ms=1,9", "--fp8_launch_layouts=checkpoint",
                        f"--out={out}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = [x for x in res["rows"] if x["kernel"] == "fp8_launch"]
    assert not [x for x in rows if "error" in x], rows
    # each launch's read floor, measured once per launch before its rows (wall clock only on the CPU)
    floors = [x for x in res["rows"] if x["kernel"] == "read_floor"]
    assert [x["launch"] for x in floors] == ["quick.a+b", "quick.c"] and not [x for x in floors if "error" in x]
    assert floors[0]["bytes"] == 272 * 300 + 130 * 300 and floors[0]["share_of_copy"] > 0
    assert {(x["launch"], x["m"]) for x in rows} == {(n, m) for n in ("quick.a+b", "quick.c") for m in (1, 9)}
    # the default configs the launches ran with: two f16 pieces per row at 1 row, one scaled piece at 9
    assert all("x_f16=True" in x["config"] for x in rows), [x["config"] for x in rows]
    assert all(("x_f16_scaled=True" in x["config"]) == (x["m"] == 9) for x in rows), [x["config"] for x in rows]
    shared = next(x for x in rows if x["launch"] == "quick.a+b")
    assert shared["bytes"] == 272 * 300 + 130 * 300 and shared["share_of_copy"] > 0
    assert set(res["fp8_launches"]["per_step"]) == {"1", "9"}
    assert "FP8 launches at M=1" in r.stdout and "FP8 launches at M=9" in r.stdout


def test_quick_run_tiled_layout(tmp_path):
    """--fp8_launch_layouts=checkpoint,tiled: each launch and M timed on both layouts, the tiled ones
    summed under "M tiled", the read floor over tiled bytes too (the quick launch's 128-row weight in a
    128-row tile, its 64-row one in a 64-row tile, as the engine lays them out); bad flags refused."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "pallas_kernels.bench", "--parts=fp8_launches", "--quick", "--interpret",
                        "--fp8_launch_ms=1", "--fp8_launch_layouts=checkpoint,tiled",
                        f"--out={out}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = [x for x in res["rows"] if x["kernel"] == "fp8_launch"]
    assert not [x for x in rows if "error" in x], rows
    assert sorted(x["layout"] for x in rows) == ["checkpoint", "tiled"]
    assert set(res["fp8_launches"]["per_step"]) == {"1", "1 tiled"}
    [floor] = [x for x in res["rows"] if x["kernel"] == "read_floor"]
    assert any("tiled=True" in c for c in floor["configs"]) and any("tiled=False" in c for c in floor["configs"])
    bad = subprocess.run([sys.executable, "-m", "pallas_kernels.bench", "--parts=fp8_launches",
                          "--fp8_launch_layouts=rows", f"--out={tmp_path / 'x.json'}"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--fp8_launch_layouts: rows; choose from checkpoint, tiled" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "pallas_kernels.bench", "--parts=fp8,step", f"--out={tmp_path / 'x.json'}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unknown part(s) step; choose from fp8, fp8_launches, gdn, attention" in bad.stderr


def test_busy_time_sums_per_step(monkeypatch):
    """Where the device time is measured, each launch's busy time (every kernel of a call) is summed per
    step with its count, beside the kernel time; device figures are faked here (the CPU has none)."""
    from pallas_kernels.bench import fp8 as fp8_bench
    fake = {"kernel_s_per_call": 2e-6, "kernel_share_of_copy": 0.5, "busy_s_per_call": 3e-6}
    monkeypatch.setattr(fp8_bench, "_device_figures", lambda *a, **k: dict(fake))
    monkeypatch.setattr(fp8_launches, "step_launches", lambda: [])  # quick's launches replace these
    rows = []
    res = fp8_launches.run(1.0, rows.append, quick=True, interpret=True, decode_ms=(1,), floor=False,
                           layouts=("checkpoint",))
    launches = [r for r in rows if r["kernel"] == "fp8_launch"]
    assert len(launches) == 2 and not [r for r in launches if "error" in r]
    agg = res["per_step"][1]
    assert agg["by"] == "kernel_s_per_call" and agg["s"] == pytest.approx(2 * 2e-6)  # two launches, count 1
    assert agg["busy_s"] == pytest.approx(2 * 3e-6) and agg["busy_share_of_copy"] > 0
