"""scripts/compare_launches.py: side-by-side FP8 launch figures of bench runs, on synthetic JSON."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("compare_launches", os.path.join(ROOT, "scripts", "compare_launches.py"))
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


def _run(path, kernel_us: dict, settings: dict, step_ms: float):
    rows = [{"kernel": "fp8_launch", "launch": name, "m": m, "layout": "tiled", "kernel_s_per_call": us * 1e-6,
             "s_per_call": 2 * us * 1e-6} for (name, m), us in kernel_us.items()]
    rows.append({"kernel": "copy_bandwidth"})
    res = {"rows": rows, "kernel_settings": settings,
           "fp8_launches": {"per_step": {"64 tiled": {"s": step_ms * 1e-3, "share_of_copy": 0.5,
                                                      "busy_s": step_ms * 1.1e-3, "busy_share_of_copy": 0.45}}}}
    path.write_text(json.dumps(res))
    return str(path)


def test_table_lists_each_launch_with_its_ratio_and_the_settings_that_differ(tmp_path):
    a = _run(tmp_path / "a.json", {("attn.o_proj", 64): 20.0, ("attn.mlp_down", 64): 50.0},
             {"fp8_decode_max_rows": 32, "fp8_tile_rows": 64}, 16.7)
    b = _run(tmp_path / "b.json", {("attn.o_proj", 64): 10.0}, {"fp8_decode_max_rows": 64, "fp8_tile_rows": 64}, 13.4)
    text = compare.table([a, b])
    assert "[1] b.json (fp8_decode_max_rows=64)" in text and "[0] a.json\n" in text
    [oproj] = [ln for ln in text.splitlines() if ln.startswith("attn.o_proj")]
    assert oproj.split()[-3:] == ["20.0", "10.0", "0.500"]
    [down] = [ln for ln in text.splitlines() if ln.startswith("attn.mlp_down")]
    assert down.split()[-2:] == ["-", "-"]  # not in the second run
    assert "16.70 (50%)" in text and "13.40 (50%)" in text
    wall = compare.table([a, b], by="wall")
    assert "40.0" in wall and "s_per_call" in wall


def test_a_file_without_launch_rows_is_refused_by_name(tmp_path):
    bad = tmp_path / "fp8.json"
    bad.write_text(json.dumps({"rows": [{"kernel": "fp8_matmul"}]}))
    with pytest.raises(SystemExit, match="fp8.json: no fp8_launch rows"):
        compare.table([str(bad)])
    with pytest.raises(SystemExit, match="missing.json: not a bench JSON"):
        compare.table([str(tmp_path / "missing.json")])
