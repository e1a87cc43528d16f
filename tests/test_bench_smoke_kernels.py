"""CPU smoke test of the GDN, paged-attention and expert-matmul benchmarks (`python -m pallas_kernels.bench`): the
quick case set with the kernels in interpret mode runs end to end and emits well-formed rows. The
timings themselves mean nothing on the CPU."""

from __future__ import annotations

import math

import pytest

from pallas_kernels.bench import attention, common, gdn, moe

REQUIRED = {"kernel", "case", "impl", "s_per_call", "bytes", "tb_s", "share_of_copy"}


def rel_err_bound(row: dict) -> float:
    # bf16 outputs (paged attention) round to 2^-8 relative to the largest element; f32 ones (GDN)
    # agree to ~1e-6
    return 2.0 ** -7 if row.get("dtype") == "bfloat16" else 1e-3


@pytest.mark.parametrize("module, kernels, impls", [
    pytest.param(gdn, {"gdn_conv_decode", "gdn_prefill"}, {"pallas", "xla", "wy_inputs"},
                 marks=pytest.mark.slow),  # ~15 s
    pytest.param(moe, {"moe_expert_matmul"}, {"pallas", "xla_ragged_dot", "xla_dequant_ragged_dot"},
                 marks=pytest.mark.slow),  # ~2 min
    (attention, {"paged_attention"}, {"pallas", "xla"})])
def test_quick_interpret_run(module, kernels, impls):
    rows = []
    module.run(copy_tb_s=1.0, emit=rows.append, quick=True, interpret=True)
    assert rows
    for row in rows:
        assert REQUIRED <= row.keys(), row
        assert "error" not in row, row
        assert row["kernel"] in kernels and row["impl"] in impls, row
        assert math.isfinite(row["s_per_call"]) and row["s_per_call"] > 0, row
        assert isinstance(row["bytes"], int) and row["bytes"] > 0, row
        assert row["tb_s"] == pytest.approx(row["bytes"] / row["s_per_call"] / 1e12)
        assert row["share_of_copy"] == pytest.approx(row["tb_s"])  # copy_tb_s = 1
        if "rel_err" in row:
            assert row["rel_err"] < rel_err_bound(row), row
    assert {r["kernel"] for r in rows} == kernels
    assert {r["impl"] for r in rows} == impls
    assert any("rel_err" in r for r in rows if r["impl"] == "pallas")


def test_gdn_cases_and_batches_choose_what_runs(monkeypatch):
    calls = []  # (case, batches) of each bench function run() calls (their rows: the quick run above)
    for name in ("bench_conv_decode", "bench_prefill"):
        monkeypatch.setattr(gdn, name, lambda tb, emit, sz, *a, _n=name, **kw: calls.append((_n, sz.batches)))
    gdn.run(copy_tb_s=1.0, emit=None, quick=False, interpret=True, cases=("conv",), batches=(2,))
    assert calls == [("bench_conv_decode", (2,))] * 2  # the ref and the first tile, then the rest of the sweep
    calls.clear()
    gdn.run(copy_tb_s=1.0, emit=None, quick=False, interpret=True)
    assert [c for c, _ in calls] == ["bench_conv_decode", "bench_prefill", "bench_conv_decode"]
    assert calls[0][1] == gdn.Sizes().batches
    for cases in (("conv", "verify"), ("decode",)):
        with pytest.raises(ValueError, match="unknown case"):
            gdn.run(copy_tb_s=1.0, emit=None, quick=True, interpret=True, cases=cases)
    with pytest.raises(ValueError, match="want BVxWARPS"):
        gdn.run(copy_tb_s=1.0, emit=None, quick=True, interpret=True, conv_configs=("32x4:hoisted",))


def test_gdn_prefill_times_each_chunk_and_refuses_other_than_powers_of_two():
    rows, sz = [], gdn.sizes(True, True)
    gdn.bench_prefill(1.0, rows.append, sz, chunks=(16, 32), interpret=True, chain_configs=("16x4",))
    t = sz.prefill_tokens[0]
    assert [(r["T"], r["chunk"], r["impl"], r.get("config")) for r in rows] == [
        (t, c, impl, config) for c in (16, 32) for impl, config in
        (("xla", None), ("pallas", "16x4"), ("wy_inputs", None))]
    assert all("error" not in r and r["s_per_call"] > 0 for r in rows), rows
    assert all(r["tflops"] > 0 for r in rows if r["impl"] != "wy_inputs"), rows
    assert all(r["rel_err"] < 1e-5 for r in rows if r["impl"] == "pallas"), rows
    with pytest.raises(ValueError, match="powers of two"):
        gdn.run(copy_tb_s=1.0, emit=None, quick=True, interpret=True, cases=("prefill",), prefill_chunks=(48,))


def test_attention_prefill_times_each_config_and_names_a_bad_one():
    rows = []
    attention.run_prefill(1.0, rows.append, quick=True, interpret=True)
    assert [r["config"] for r in rows] == list(attention.PREFILL_CONFIGS[:2])
    table = common.summary_table(rows).splitlines()  # the other configs named in the table's note
    assert table[2].split()[-1] == attention.PREFILL_CONFIGS[1] != table[1].split()[-1]
    for row in rows:
        assert "error" not in row and row["kernel"] == "paged_attention_prefill", row
        assert row["tflop_s"] > 0 and row["rel_err"] < 2.0 ** -7, row
    assert attention.parse_prefill_config("128x8x32x2").prefill_rows == 128
    with pytest.raises(ValueError, match="'64x4'.*ROWSxWARPSxBKxSTAGES"):
        attention.run_prefill(1.0, rows.append, interpret=True, configs=("32x4x64x2", "64x4"))
