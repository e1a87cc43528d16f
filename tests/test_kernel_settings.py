"""qmtp.ops.set_kernel_settings (the --kernels flag): names map to the module switches the kernels
read, text values parse, bad names and values are refused with the setting named, and the previous
settings come back for restoring."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp8_config, fp8_matmul, fp8_tiles
from pallas_kernels.bench import step
from qmtp import ops
from qmtp.fp8 import Fp8Block


@pytest.fixture(autouse=True)
def restore():
    before = ops.kernel_settings()
    yield
    ops.set_kernel_settings(before)


def test_settings_reach_the_module_switches_and_restore():
    previous = ops.set_kernel_settings(ops.parse_kernel_settings(
        ["fp8_scale_preload=false", "xla_single_row=1", "fp8_decode_max_rows= 8", "dequant_dot_min_rows=0",
         "fp8_narrow_decode_max_rows=0"]))
    assert fp8_config.SCALE_PRELOAD is False and ops.XLA_SINGLE_ROW is True
    assert fp8_config.DECODE_MAX_ROWS == 8 and ops.DEQUANT_DOT_MIN_ROWS == 0
    assert fp8_config.NARROW_DECODE_MAX_ROWS == 0
    assert not fp8_matmul.default_config(1, 256, 512).scale_preload  # what the kernels see
    assert isinstance(fp8_matmul.default_config(9, 256, 512), fp8_matmul.PrefillConfig)
    assert ops.kernel_settings()["fp8_decode_max_rows"] == 8
    ops.set_kernel_settings(previous)
    assert ops.kernel_settings() == previous


def test_verify_narrow_stages_setting_reaches_the_33_to_64_row_config():
    """fp8_verify_narrow_stages sets the pipeline depth of a batched verify's narrow launches (33-64
    rows on the decode grid) and nothing below 33 rows."""
    previous = ops.set_kernel_settings(ops.parse_kernel_settings(["fp8_verify_narrow_stages=4"]))
    try:
        assert fp8_matmul.default_config(64, 5120, 6144).num_stages == 4
        ops.set_kernel_settings({"fp8_verify_narrow_stages": 2})
        assert fp8_matmul.default_config(48, 5120, 17408).num_stages == 2
        assert fp8_matmul.default_config(32, 5120, 17408).num_stages == fp8_tiles.DecodeConfig.num_stages
    finally:
        ops.set_kernel_settings(previous)
    assert fp8_matmul.default_config(64, 5120, 6144).num_stages == 3


def test_tall_rows_run_the_decode_grid_with_the_tall_stages():
    """65-128 rows run on the decode grid by default (DECODE_MAX_ROWS = DECODE_DOT_MAX_ROWS; 129 is
    refused as a setting, test_bad_settings_are_refused_by_name), where fp8_verify_tall_stages sets the
    pipeline depth and 33-64 rows keep theirs; fp8_decode_max_rows=64 sends them back to the GEMM."""
    assert fp8_config.DECODE_MAX_ROWS == 128 and fp8_config.VERIFY_TALL_STAGES == 3
    assert fp8_matmul.default_config(128, 17408, 5120).num_stages == 3
    assert isinstance(fp8_matmul.default_config(129, 17408, 5120), fp8_tiles.PrefillConfig)
    previous = ops.set_kernel_settings(ops.parse_kernel_settings(["fp8_verify_tall_stages=2"]))
    try:
        assert fp8_matmul.default_config(128, 17408, 5120).num_stages == 2
        assert fp8_matmul.default_config(65, 5120, 17408).num_stages == 2
        ops.set_kernel_settings({"fp8_verify_tall_stages": 1})
        assert fp8_matmul.default_config(100, 5120, 6144).num_stages == 1
        assert fp8_matmul.default_config(64, 5120, 6144).num_stages == fp8_config.VERIFY_NARROW_STAGES
        ops.set_kernel_settings({"fp8_decode_max_rows": 64})
        assert isinstance(fp8_matmul.default_config(65, 17408, 5120), fp8_tiles.PrefillConfig)
    finally:
        ops.set_kernel_settings(previous)
    assert fp8_config.VERIFY_TALL_STAGES == 3 and fp8_config.DECODE_MAX_ROWS == 128


def test_narrow_block_o_setting_reaches_narrow_launches_at_1_to_16_rows():
    """fp8_narrow_block_o=128: the narrow launches (o_proj, mlp_down) at 1-16 rows on 128-row programs;
    wide launches and 17+ rows keep 64."""
    previous = ops.set_kernel_settings({"fp8_narrow_block_o": "128"})
    try:
        for m in (1, 4, 16):
            assert fp8_matmul.default_config(m, 5120, 6144).block_o == 128, m
            assert fp8_matmul.default_config(m, 5120, 17408).block_o == 128, m
            assert fp8_matmul.default_config(m, 17408, 5120).block_o == 64, m
        assert fp8_matmul.default_config(17, 5120, 6144).block_o == 64
    finally:
        ops.set_kernel_settings(previous)
    assert fp8_matmul.default_config(16, 5120, 6144).block_o == 64


def test_verify_narrow_block_o_setting_reaches_narrow_launches_only():
    """fp8_verify_narrow_block_o=128: 33-128-row narrow launches on 128-row programs with 8 warps (two
    64-row tiles joined on 64-row tiled weights); wide launches and 16 rows keep their tiles; 96 is
    refused (not a power of two)."""
    previous = ops.set_kernel_settings({"fp8_verify_narrow_block_o": "128"})
    try:
        c = fp8_matmul.default_config(64, 5120, 17408)
        assert (c.block_o, c.num_warps, c.split_k) == (128, 8, 8)
        assert fp8_matmul.default_config(100, 5120, 6144).block_o == 128
        assert fp8_matmul.default_config(16, 5120, 17408).block_o == 64
        assert fp8_matmul.default_config(64, 17408, 5120).block_o == 64
    finally:
        ops.set_kernel_settings(previous)
    assert fp8_matmul.default_config(64, 5120, 17408).block_o == 64
    with pytest.raises(ValueError, match="must be a power of two"):
        ops.set_kernel_settings({"fp8_verify_narrow_block_o": "96"})


@pytest.mark.parametrize("m, tile_rows, block_o", [
    (40, 128, 128), (64, 128, 128),  # a batched verify of 10-16 slots on 128-row tiles
    (64, 64, 64), (64, None, 64),  # 64-row tiles (a join) and the checkpoint layout
    (32, 128, 64), (65, 128, 64), (128, 128, 64),  # 17-32 rows and the tall rows keep 64
])
def test_verify_wide_block_o_needs_128_row_tiles(m, tile_rows, block_o):
    """fp8_config.VERIFY_WIDE_BLOCK_O: the wide launches (gate + up, q + k + v, in_proj) take 128-row
    programs with 8 warps at 33-64 rows where their weights lie in 128-row tiles; narrow launches keep
    VERIFY_NARROW_BLOCK_O; fp8_verify_wide_block_o=64 turns it off."""
    c = fp8_matmul.default_config(m, 17408, 5120, tile_rows=tile_rows)
    assert (c.block_o, c.num_warps) == (block_o, 8 if block_o == 128 else 4)
    assert fp8_matmul.default_config(m, 5120, 17408, tile_rows=tile_rows).block_o == 64  # narrow
    previous = ops.set_kernel_settings({"fp8_verify_wide_block_o": "64"})
    try:
        assert fp8_matmul.default_config(m, 17408, 5120, tile_rows=tile_rows).block_o == 64
    finally:
        ops.set_kernel_settings(previous)


def test_gemm_mid_row_tiles_setting_reaches_129_to_256_rows_only():
    """fp8_gemm_mid_block_m / fp8_gemm_mid_stages set the GEMM's tiles at 129-256 rows (33-256 where
    fp8_decode_max_rows is 32) and nothing at 512 or on the decode grid; a tile height that is no power
    of two is refused."""
    previous = ops.set_kernel_settings({"fp8_gemm_mid_block_m": "32", "fp8_gemm_mid_stages": "4"})
    try:
        for m in (129, 256):
            c = fp8_matmul.default_config(m, 17408, 5120)
            assert (c.block_m, c.num_stages) == (32, 4), (m, c)
        assert fp8_matmul.default_config(512, 17408, 5120).block_m == 128
        assert fp8_matmul.default_config(128, 17408, 5120) == fp8_config.decode_config(128, 17408, 5120)
        assert fp8_config.prefill_config(33, 17408, 5120).block_m == 32
    finally:
        ops.set_kernel_settings(previous)
    gemm = fp8_matmul.default_config(200, 17408, 5120)
    assert (gemm.block_m, gemm.num_stages) == (64, 3)
    with pytest.raises(ValueError, match="fp8_gemm_mid_block_m=48: must be a power of two"):
        ops.set_kernel_settings({"fp8_gemm_mid_block_m": "48"})
    assert fp8_config.GEMM_MID_BLOCK_M == 64


def test_xla_single_row_setting_changes_the_path():
    # one row through ops.linear: with xla_single_row the reference formula runs (bitwise equal to it)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(128, 256)) * 16, jnp.float32).astype(jnp.float8_e4m3fn)
    s = jnp.asarray(rng.uniform(1e-3, 2e-3, size=(1, 2)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(1, 256)), jnp.float32)
    ops.set_kernel_settings({"xla_single_row": "true"})
    got = ops.linear(x, Fp8Block(w, s), impl="pallas")
    want = fp8_matmul.fp8_matmul_ref(x, w, s)
    assert np.array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("items, match", [
    (["nope=1"], "unknown kernel setting 'nope'"),
    (["fp8_scale_preload=maybe"], "fp8_scale_preload='maybe': expected true or false"),
    (["fp8_decode_max_rows=many"], "expected an integer"),
    (["fp8_decode_max_rows=129"], r"fp8_decode_max_rows=129: must be in \[1, 128\]"),
])
def test_bad_settings_are_refused_by_name(items, match):
    before = ops.kernel_settings()
    with pytest.raises(ValueError, match=match):
        ops.set_kernel_settings(ops.parse_kernel_settings(items))
    assert ops.kernel_settings()["fp8_decode_max_rows"] == before["fp8_decode_max_rows"]


def test_a_bad_setting_changes_nothing():
    before = ops.kernel_settings()
    with pytest.raises(ValueError, match="unknown kernel setting 'nope'"):
        ops.set_kernel_settings({"fp8_x_f16": not before["fp8_x_f16"], "nope": 1})
    assert ops.kernel_settings() == before


@pytest.mark.parametrize("item", ["fp8_scale_preload", "=1", "fp8_scale_preload="])
def test_malformed_items_are_refused(item):
    with pytest.raises(ValueError, match="expected name=value"):
        ops.parse_kernel_settings([item])


def test_step_bench_variants_are_settings():
    defaults = ops.kernel_settings()
    for name, overrides in step.VARIANTS.items():
        settings = step.variant_settings(name, defaults)
        assert set(settings) == set(defaults) and all(settings[k] == v for k, v in overrides.items()), name
        ops.set_kernel_settings(settings)  # every variant's names are known
    assert step.variant_settings("pallas", defaults) == defaults


def test_best_step_variant_flag():
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "best_step_variant.py")
    spec = importlib.util.spec_from_file_location("best_step_variant", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [{"kernel": "decode_step", "impl": "pallas", "s_per_step": 0.013},
            {"kernel": "decode_step", "impl": "pallas_nopreload", "s_per_step": 0.012},
            {"kernel": "decode_step", "impl": "pallas_m1xla", "error": "boom"},
            {"kernel": "decode_step", "impl": "ref", "s_per_step": 0.001}]  # not a pallas variant
    flag = mod.best_flag({"rows": rows})
    assert flag == "--kernels=fp8_scale_preload=False"
    ops.set_kernel_settings(ops.parse_kernel_settings(flag.split("=", 1)[1].split(",")))  # it parses back
    assert mod.best_flag({"rows": rows[:1] + rows[2:]}) == ""  # the defaults won
    assert mod.best_flag({}) == ""
    # every variant that beat the defaults by more than 1% joins the flag; one within noise does not
    more = [{"kernel": "decode_step", "impl": "pallas_gdngated", "s_per_step": 0.0125},
            {"kernel": "decode_step", "impl": "pallas_pps4", "s_per_step": 0.01295}]
    assert mod.best_flag({"rows": rows + more}) == ("--kernels=gdn_gates_in_kernel=True,gdn_conv_in_kernel=False,"
                                                    "fp8_scale_preload=False")
    assert mod.best_flag({"rows": rows[1:]}) == "--kernels=fp8_scale_preload=False"  # no default row: the fastest


def test_best_round_variant_settings():
    """scripts/best_round_variant.py: the round_pieces variants whose verify + commit (device time when
    there) beat the defaults' by more than 1%, the faster of two that set a common name."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "best_round_variant.py")
    spec = importlib.util.spec_from_file_location("best_round_variant", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    piece = lambda verify, commit: {"verify": 1.0, "commit": 1.0, "device_verify": verify, "device_commit": commit}
    result = {"pieces": piece(10.0, 1.0), "variants": {
        "gdn_conv_block_v=16": {"pieces": piece(9.6, 0.8)},
        "gdn_conv_block_v=16,gdn_conv_num_warps=2": {"pieces": piece(9.7, 0.8)},  # slower, a common name
        "bf16_reduce_max_out=256": {"pieces": piece(9.8, 1.0)},
        "fp8_scale_preload=false": {"pieces": piece(9.95, 1.0)}}}  # within 1%
    settings = mod.best_settings(result)
    assert settings == "gdn_conv_block_v=16,bf16_reduce_max_out=256"
    previous = ops.set_kernel_settings(ops.parse_kernel_settings(settings.split(",")))  # it parses back
    ops.set_kernel_settings(previous)
    result["variants"]["gdn_conv_block_v=16"]["pieces"] = piece(9.8, 0.8)  # now the two-warp one is faster
    assert mod.best_settings(result) == "gdn_conv_block_v=16,gdn_conv_num_warps=2,bf16_reduce_max_out=256"
    assert mod.best_settings({"pieces": {"verify": 1.0, "commit": 0.1},
                              "variants": {"bf16_reduce_max_out=256": {"pieces": {"verify": 2.0, "commit": 0.1}}}}) == ""
    assert mod.best_settings({}) == ""


def test_spec_skip_full_commit_is_a_setting():
    """--kernels=spec_skip_full_commit=false reaches qmtp.speculate (the A/B of the commit skip)."""
    from qmtp import speculate
    previous = ops.set_kernel_settings(ops.parse_kernel_settings(["spec_skip_full_commit=false"]))
    try:
        assert speculate.SKIP_FULL_COMMIT is False and previous["spec_skip_full_commit"] is True
    finally:
        ops.set_kernel_settings(previous)
    assert speculate.SKIP_FULL_COMMIT is True


def test_best_xla_flags_joins_the_settings_that_beat_the_run_without_flags(tmp_path):
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "best_xla_flags.py")
    spec = importlib.util.spec_from_file_location("best_xla_flags", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    step = lambda flags, s: {"xla_flags": flags, "rows": [  # noqa: E731
        {"kernel": "decode_step", "impl": "ref", "s_per_step": 0.001},  # not the Pallas step
        {"kernel": "decode_step", "impl": "pallas", "s_per_step": s}]}
    results = [step("", 0.0100), step("--a=true", 0.0095), step("--b=true", 0.0098), step("--c=1", 0.00995),
               {"xla_flags": "--d=true", "rows": [{"kernel": "decode_step", "impl": "pallas", "error": "boom"}]}]
    assert mod.best_flags(results) == "--a=true --b=true"  # fastest first; --c within 1%, --d failed
    assert mod.best_flags(results[1:]) == ""  # no run without flags: no baseline
    assert mod.best_flags([step("", 0.01), step("--a=true", 0.0101)]) == ""
    files = []
    for i, r in enumerate(results[:2]):
        files.append(tmp_path / f"s{i}.json")
        files[-1].write_text(json.dumps(r))
    out = subprocess.run([sys.executable, path, *map(str, files), str(tmp_path / "missing.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "--a=true" and "missing.json" in out.stderr
