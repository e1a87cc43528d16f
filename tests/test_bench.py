"""The benchmark harness (python -m qmtp.bench): a CPU smoke run on the tiny controlled preset
(no figures asserted: only that every mode ran, matched plain greedy and was reported), the
roofline arithmetic against hand-computed values, and the token check that fails a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from qmtp.bench import report as br
from qmtp.bench import targets as bt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(*args, tmp_path, cache):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, QMTP_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "qmtp.bench", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


def test_tiny_smoke_run_writes_json_and_plot(tmp_path):
    out = tmp_path / "r.json"
    r = run_bench(f"--flagfile={ROOT}/configs/bench_tiny.flags", f"--out={out}", "--repeats=1", "--ks=3",
                  "--max_new_tokens=12", "--breakdown_ks=3", "--prompt_text=def fibonacci(",
                  "--draft_head=fp8", f"--trace_dir={tmp_path / 'traces'}", tmp_path=tmp_path,
                  cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["all_tokens_match_plain"] and res["copy"]["tb_per_s"] > 0 and res["load_s"] > 0
    (case,) = res["cases"]
    names = [m["name"] for m in case["modes"]]
    assert names == ["plain", "mtp K=3 natural", "mtp K=3 profiled"]
    for m in case["modes"]:
        assert m["decode_tokens_per_s"]["median"] > 0 and m["ttft_s"]["n"] == 1 and m["share_of_roofline"] > 0
        prompt_tokens = case["batch"] * case["prompt_length"]
        assert m["prefill_tokens_per_s"] == pytest.approx(prompt_tokens / m["ttft_s"]["median"])
        assert m["prefill_share_of_floor"] == pytest.approx(case["prefill_floor_s"] / m["ttft_s"]["median"])
        assert set(m["memory"]) == {"bytes_in_use", "peak_bytes_in_use"}  # per mode (None on the CPU)
    assert res["matmul"]["tflop_per_s"] > 0 and res["matmul"]["shape"] == [256, 256, 256]  # the CPU's small shape
    natural3 = case["modes"][1]
    assert natural3["position_acceptance"] == [1.0, 1.0, 1.0] and natural3["mean_accepted_length"] == 4.0
    assert case["modes"][2]["imposed_profile"] == [0.85, 0.70, 0.57]
    assert case["modes"][2]["mean_accepted_length"] < 4.0  # the cap took effect
    assert os.path.getsize(case["plot"]) > 1000
    assert set(case["breakdown"]) == {"3"}  # --breakdown_ks
    assert case["batch"] == 1 and res["config"]["prompt_text"] == ["def fibonacci("]
    assert res["config"]["fp8_act_quant"] is False and "xla_flags" in res["config"]
    assert res["config"]["draft_head"] == "fp8"  # drafts through the FP8 copy: acceptance unchanged here
    for pieces in case["breakdown"].values():
        assert {"target_step", "verify", "draft", "predicted_round", "measured_round"} <= set(pieces)
    assert "mtp K=3 profiled" in r.stdout and "per piece of a round" in r.stdout
    # a CPU run: the copy bandwidth is no ceiling there (the weights stay in cache), and the report says
    # so instead of quoting shares of a roofline
    assert res["platform"] == "cpu" and "not a ceiling" in r.stdout and "roofline" not in r.stdout
    assert "[1/3" in r.stderr  # progress
    # --trace_dir: one profiler trace per mode, named after it, readable as scripts/trace_summary.py reads it
    from pallas_kernels.bench import trace_events
    trace_dir = case["modes"][2]["trace_dir"]
    assert os.path.dirname(trace_dir) == str(tmp_path / "traces")
    assert os.path.basename(trace_dir) == f"ref_B1_P{case['prompt_length']}_K3_profiled"
    for m in case["modes"]:
        assert trace_events.load_events(trace_events.find_trace(m["trace_dir"]))


def test_help_and_plot_from(tmp_path):
    r = run_bench("--help", tmp_path=tmp_path, cache=tmp_path)
    assert r.returncode == 0
    for flag in ("checkpoint", "engine", "tp", "ks", "profile", "prompt_lengths", "batch", "repeats", "out", "plot_from",
                 "fp8_act_quant"):
        assert f"--{flag}" in r.stdout or f"--[no]{flag}" in r.stdout, flag


def test_table_shows_each_modes_memory_high_water_mark():
    from qmtp.bench import report as br
    mode = {"name": "plain", "k": 0, "decode_tokens_per_s": {"median": 100.0, "min": 99.0, "max": 101.0},
            "ttft_s": {"median": 0.05}, "share_of_roofline": 0.8, "speedup": 1.0}
    with_stats = dict(mode, memory={"bytes_in_use": 32.4e9, "peak_bytes_in_use": 40.3e9})
    lines = br.table([with_stats, dict(mode, memory={"bytes_in_use": None, "peak_bytes_in_use": None}), mode])
    rows = lines.splitlines()
    assert rows[0].split()[-2:] == ["peak", "GB"] and rows[1].split()[-1] == "40.3"
    assert rows[2].split()[-1] == "-" and rows[3].split()[-1] == "-"  # no statistics (CPU), or an older JSON


def test_roofline_and_ceiling_arithmetic():
    # 10 GB per target pass, 1 GB per draft step, 4 TB/s
    bw = 4e12
    assert br.roofline_tok_s(10e9, 1, bw) == pytest.approx(400.0)
    assert br.roofline_tok_s(10e9, 4, bw) == pytest.approx(1600.0)
    # K=3 at 0.85/0.70/0.57: 3.12 tokens per round of 10 + 3 GB -> 3.12 / 3.25 ms
    assert br.mtp_ceiling_tok_s(10e9, 1e9, [0.85, 0.70, 0.57], 1, bw) == pytest.approx(3.12 / 13e9 * 4e12)


def test_step_bytes_counts_weights_state_and_kv():
    import jax.numpy as jnp

    from qmtp.model import config as qc, params as qp
    from qmtp.runtime.state import state_shapes
    from qmtp.tools import make_checkpoint
    cfg = qc.from_dict(make_checkpoint.build_config("tiny", "bf16", 0, None))
    params = qp.abstract_params(cfg, jnp.bfloat16)
    state = state_shapes(cfg, 2, 8, 16, 4, jnp.bfloat16)
    b = br.step_bytes(params, state, context=100)
    e, v = cfg.hidden_size, cfg.vocab_size
    layer_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for layer in params["gdn"] + params["attn"]
                      for a in layer.values())
    assert b["target"]["weights"] == layer_bytes + v * e * 2 + e * 4  # layers + bf16 lm_head + f32 final norm
    hkv, d = cfg.num_key_value_heads, cfg.head_dim
    assert b["target"]["kv"] == cfg.num_full_layers * 2 * hkv * d * 2 * 100 * 2  # layers, K+V, bf16, ctx, batch
    assert b["draft"]["lm_head"] == v * e * 2 and b["batch"] == 2
    # with the FP8 draft head a draft reads it instead: 1 byte per weight + one f32 scale per 128 x 128
    import jax
    from qmtp.model import fp8
    head = jax.eval_shape(fp8.quantize, jax.ShapeDtypeStruct((v, e), jnp.bfloat16))
    b8 = br.step_bytes(dict(params, mtp=dict(params["mtp"], draft_head=head)), state, context=100)
    assert b8["draft"]["lm_head"] == v * e + -(-v // 128) * -(-e // 128) * 4
    assert b8["draft"]["mtp_weights"] == b["draft"]["mtp_weights"] and b8["target"] == b["target"]
    # a K=3 verify reads the states once and writes them after each of its 4 tokens; weights as plain
    v3 = br.step_bytes(params, state, context=100, verify_ks=[3])["verify"]["3"]
    assert v3["gdn_state"] == 5 * b["target"]["gdn_state"] // 2
    assert v3["conv_state"] == 5 * b["target"]["conv_state"] // 2
    assert v3["weights"] == b["target"]["weights"] and v3["kv"] == b["target"]["kv"]
    assert v3["total"] == sum(v for n, v in v3.items() if n != "total") > b["target_total"]


def test_a_token_mismatch_is_reported():
    from qmtp.bench import cases as bench
    run = lambda toks: types.SimpleNamespace(tokens=toks, stats={  # noqa: E731
        "decode_tokens_per_s": 1.0, "ttft_s": 0.1, "mean_accepted_length": 2.0, "acceptance_rate": 1.0,
        "position_acceptance": [1.0]})
    bytes_ = {"batch": 1, "target_total": 10, "draft_total": 1}
    good = bench.summarize("m", 1, "natural", {"compile_s": 0, "runs": [run([[1, 2, 3]])]}, [[1, 2, 3]], bytes_, 1e3)
    bad = bench.summarize("m", 1, "natural", {"compile_s": 0, "runs": [run([[1, 2, 4]])]}, [[1, 2, 3]], bytes_, 1e3)
    assert good["tokens_match_plain"] and not bad["tokens_match_plain"] and bad["first_mismatch"] == [2]
    # the MTP ceiling counts the verify pass's bytes at the mode's K: 2 tokens of 14 + 1 bytes at 1 kB/s
    verified = bench.summarize("m", 1, "natural", {"compile_s": 0, "runs": [run([[1, 2, 3]])]}, [[1, 2, 3]],
                               dict(bytes_, verify={"1": {"total": 14}}), 1e3)
    assert good["ceiling_tok_s"] == pytest.approx(2 / 11 * 1e3)
    assert verified["ceiling_tok_s"] == pytest.approx(2 / 15 * 1e3)


def test_breakdown_ks_must_be_among_ks(tmp_path):
    bad = run_bench(f"--flagfile={ROOT}/configs/bench_tiny.flags", f"--out={tmp_path / 'x.json'}", "--ks=1",
                    "--breakdown_ks=2", "--repeats=1", "--max_new_tokens=4", tmp_path=tmp_path, cache=tmp_path / "c")
    assert bad.returncode == 2 and "--breakdown_ks=2 not in --ks=1" in bad.stderr
    # without a breakdown the flag file's breakdown_ks does not matter (it fails on the engine, checked next)
    off = run_bench(f"--flagfile={ROOT}/configs/bench_tiny.flags", f"--out={tmp_path / 'x.json'}", "--ks=1",
                    "--breakdown_ks=2", "--breakdown=false", "--engine=bogus", tmp_path=tmp_path, cache=tmp_path / "c")
    assert off.returncode == 2 and "--engine=bogus" in off.stderr and "breakdown_ks" not in off.stderr


@pytest.mark.slow  # ~40 s (the Pallas engines in interpret mode)
def test_two_engines_share_the_weights_and_are_compared(tmp_path):
    """--engine=pallas,deterministic: the default kernels and the row-invariant ones on the same weights."""
    out = tmp_path / "e.json"
    r = run_bench(f"--flagfile={ROOT}/configs/bench_tiny.flags", f"--out={out}", "--repeats=1", "--ks=1",
                  "--profile=", "--breakdown=false", "--max_new_tokens=4", "--engine=pallas,deterministic",
                  "--prefill_chunk=16",  # deterministic prefills whole chunks
                  "--prompt_text=def fibonacci(", "--prompt_text=import os", tmp_path=tmp_path, cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [c["engine"] for c in res["cases"]] == ["pallas", "deterministic"]
    assert res["config"]["engine"] == "pallas,deterministic"
    assert [c["batch"] for c in res["cases"]] == [2, 2]  # two text prompts: one sequence each
    assert [row["mode"] for row in res["engine_comparison"]] == ["plain", "mtp K=1 natural"]
    assert all(row["ratio"] > 0 for row in res["engine_comparison"])
    assert "decode tok/s by engine (pallas / deterministic)" in r.stdout
    bad = run_bench(f"--flagfile={ROOT}/configs/bench_tiny.flags", f"--out={out}", "--engine=xla",
                    tmp_path=tmp_path, cache=tmp_path / "cache")
    assert bad.returncode == 2 and "--engine=xla: expected one or more of pallas, ref, deterministic" in bad.stderr


def test_breakdown_timing_leaves_out_building_the_input(monkeypatch):
    """A piece's time is its loop's alone: building the fresh (donated) state of each call, slow and
    variable at TP2, must not enter the difference of the two trip counts. A fake clock: input
    builds cost 0-50 units at random, the loop costs 1.0 per iteration."""
    from qmtp.bench import breakdown as bd
    rng = np.random.default_rng(0)
    clock = [0.0]
    monkeypatch.setattr(bd.time, "perf_counter", lambda: clock[0])

    def make_input():
        clock[0] += float(rng.uniform(0, 50))
        return np.zeros(1)

    def call(x, n):
        clock[0] += 1.0 * n
        return x

    assert bd._time_piece(call, make_input) == pytest.approx(1.0)


def test_bytes_count_each_device_shard():
    """Under TP the roofline is per GPU: a sharded array counts its shard, a replicated one in full."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    split = jax.device_put(jnp.zeros((4, 8), jnp.float32), NamedSharding(mesh, P("tp", None)))
    whole = jax.device_put(jnp.zeros((4, 8), jnp.float32), NamedSharding(mesh, P()))
    assert br.nbytes({"a": split}) == 4 * 8 * 4 // 2
    assert br.nbytes({"a": whole, "b": np.zeros((3,), np.float16)}) == 4 * 8 * 4 + 6


def test_targets_name_the_pieces_of_a_miss():
    modes = [{"name": "plain", "share_of_roofline": 0.61},
             {"name": "mtp K=3 profiled", "speedup": 2.34, "mean_accepted_length": 2.98}]
    breakdown = {"3": {"measured_round": 0.0161, "measured_plain_step": 0.0127, "verify": 0.0135,
                       "all_reduce": 0.002}}
    case = {"modes": modes, "breakdown": breakdown, "batch": 1, "roofline": {"plain_tok_s": 130.0}}
    plain, k3 = bt.check(case)
    assert not plain["met"] and "12.70 ms against 7.69 ms" in plain["note"] and "all-reduces 2.00 ms" in plain["note"]
    assert not k3["met"] and "1.27 plain steps for 2.98 tokens" in k3["note"] and "the rest" in k3["note"]
    text = bt.text([plain, k3])
    assert text.count("target missed") == 2
    modes[0]["share_of_roofline"], modes[1]["speedup"] = 0.8, 2.6
    assert all(r["met"] and not r["note"] for r in bt.check(case))
    # an MoE checkpoint's own targets; a K=3 miss says what the round's bytes allow
    modes[0]["share_of_roofline"], modes[1]["speedup"], modes[1]["ceiling_tok_s"] = 0.62, 1.4, 182.0
    plain, k3 = bt.check(dict(case, moe=True))
    assert plain["met"] and plain["target"] == "plain decode >= 60% of the bandwidth roofline"
    assert not k3["met"] and k3["target"] == "MTP K=3 with the default profile >= 2x plain"
    assert "its bytes allow 1.40x" in k3["note"]


def test_a_batch_16_verify_is_checked_against_a_plain_step():
    """Batch 16: the K=3 verify (64 rows) against the plain step, from the breakdown, with its bytes' ratio."""
    breakdown = {"3": {"target_step": 0.0100, "verify": 0.0150}}
    case = {"modes": [], "batch": 16, "breakdown": breakdown,
            "bytes": {"target_total": 32e9, "verify": {"3": {"total": 39.36e9}}}}
    (row,) = bt.check(case)
    assert row["value"] == pytest.approx(1.5) and not row["met"] and row["note"] == "its bytes are 1.23x a step's"
    assert "1.50x" in br.breakdown_table(breakdown)
    breakdown["3"]["verify"] = 0.0130
    (row,) = bt.check(case)
    assert row["met"] and row["note"] == ""
    assert bt.check(dict(case, batch=1)) == []  # the target names batch 16


def test_targets_say_when_a_short_run_missed_its_profile():
    """A 128-token K=3 run: 0.83 / 0.69 / 0.57 realized for 0.85 / 0.70 / 0.57 is 0.02 off
    at the first position, so its speedup is not the profile's; 1024 tokens realized it."""
    k3 = {"name": "mtp K=3 profiled", "speedup": 2.47, "mean_accepted_length": 3.10,
          "imposed_profile": [0.85, 0.70, 0.57], "position_acceptance": [0.8333, 0.6905, 0.5714]}
    case = {"modes": [k3], "batch": 1}
    (row,) = bt.check(case)
    assert "0.83 / 0.69 / 0.57 strays from the profile 0.85 / 0.70 / 0.57" in row["note"]
    assert "--max_new_tokens" in row["note"]
    k3.update(speedup=2.57, position_acceptance=[0.8506, 0.6996, 0.5703])
    (row,) = bt.check(case)
    assert row["met"] and row["note"] == ""
    assert bt.profile_shortfall({"name": "mtp K=3 natural", "position_acceptance": [1.0, 1.0, 1.0]}) == ""


def test_in_program_copy_keeps_every_pass_and_reports_both_clocks():
    """The in-program copy (qmtp.bench.bandwidth.one_program_passes) really makes `passes` separate passes:
    the values count them and the compiled program keeps a loop whose body adds (not one x + n)."""
    import jax
    import jax.numpy as jnp

    from qmtp.bench import bandwidth

    x = jnp.arange(1024, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(bandwidth.one_program_passes(x, 5)), np.asarray(x) + 5)
    hlo = jax.jit(bandwidth.one_program_passes, static_argnums=1).lower(x, 5).compile().as_text()
    # the first pass, then a loop of 4 whose body adds: not folded into one x + 5
    assert " while(" in hlo and hlo.count("f32[1024]{0} add(") >= 2 and '"known_trip_count":{"n":"4"}' in hlo
    copy = bandwidth.copy_bandwidth(gib=1 / 1024, trials=2)
    assert copy["tb_per_s"] == copy["bytes"] / copy["best_s"] / 1e12 and copy["best_s"] <= copy["median_s"]  # fastest
    assert copy["in_program"]["passes"] == bandwidth.IN_PROGRAM_PASSES and copy["in_program"]["tb_per_s_best"] > 0


def _case(tp_rates: dict, breakdown=None) -> dict:
    modes = [{"name": n, "decode_tokens_per_s": {"median": v}} for n, v in tp_rates.items()]
    return {"engine": "pallas", "batch": 1, "prompt_length": 64, "modes": modes, "breakdown": breakdown}


def test_compare_checks_tp2_against_tp1_and_names_the_all_reduces():
    """A measured TP2 step: 124.2 vs 108.3 tok/s plain, 8.08 ms per step of which 2.49 ms all-reduces."""
    tp1 = {"config": {"tp": 1, "title": "tp1"}, "cases": [_case({"plain": 108.3, "mtp K=3 profiled": 256.2})]}
    tp2 = _case({"plain": 124.2, "mtp K=3 profiled": 281.2, "mtp K=4 natural": 400.0},
                {"3": {"measured_plain_step": 0.00808, "all_reduce": 0.00249}})
    c = br.compare(tp2, 2, tp1)
    assert [r["mode"] for r in c["modes"]] == ["plain", "mtp K=3 profiled"]  # K=4 has nothing to compare with
    assert abs(c["modes"][0]["ratio"] - 124.2 / 108.3) < 1e-12
    (row,) = c["targets"]
    assert not row["met"] and row["goal"] == 1.6
    need = 8.08 * (124.2 / 108.3) / 1.6
    assert f"1.6x needs a step of {need:.2f} ms ({8.08 - need:.2f} ms less)" in row["note"]
    assert "all-reduces 2.49 ms" in row["note"]
    assert "1.15x" in br.comparison_table(c, 2)
    tp2["modes"][0]["decode_tokens_per_s"]["median"] = 180.0
    assert br.compare(tp2, 2, tp1)["targets"][0]["met"]
    assert br.compare(tp2, 1, tp1)["targets"] == []  # a TP1 run against TP1: ratios only
    tp2["batch"] = 8
    assert br.compare(tp2, 2, tp1) is None  # no case of that batch there


def test_compare_to_names_a_bad_file(tmp_path):
    with pytest.raises(ValueError, match="--compare_to=.*missing.json: cannot read"):
        br.load_comparison(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a bench JSON"):
        br.load_comparison(str(bad))
    bad.write_text('{"cases": []}')
    with pytest.raises(ValueError, match="not a qmtp.bench result"):
        br.load_comparison(str(bad))


def _plot_case(**extra) -> dict:
    """One case as qmtp.bench plots it: plain, K=1/2 natural and profiled, their ceilings, the roofline."""
    mode = lambda name, k, acc, tps, ceil=None: {  # noqa: E731
        "name": name, "k": k, "acceptance": acc, "decode_tokens_per_s": {"median": tps}, "ceiling_tok_s": ceil}
    modes = [mode("plain", 0, "-", 100.0), mode("mtp K=1 natural", 1, "natural", 180.0, 150.0),
             mode("mtp K=2 natural", 2, "natural", 240.0, 190.0), mode("mtp K=1 profiled", 1, "profiled", 160.0, 140.0),
             mode("mtp K=2 profiled", 2, "profiled", 200.0, 170.0)]
    return {"batch": 1, "prompt_length": 16, "modes": modes, "roofline": {"plain_tok_s": 90.0},
            "config": {"title": "tiny engine=ref TP1"}, **extra}


def _drawn(case: dict) -> tuple[list[str], str]:
    """The labels of the lines figure(case) draws, and its title."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = br.figure(case)
    try:
        (ax,) = fig.axes
        return [line.get_label() for line in ax.get_lines()], ax.get_title()
    finally:
        plt.close(fig)


def test_plot_draws_the_bandwidth_ceilings_on_a_gpu_only():
    """On a CPU the copy bandwidth is no ceiling (a small model's weights stay in cache and decode runs
    above it): the roofline and the MTP ceilings are left out and the title says why; on a GPU they
    are drawn. A result from before the platform was recorded is told by its device names."""
    gpu, gpu_title = _drawn(_plot_case(platform="gpu"))
    assert gpu == ["qmtp, natural acceptance", "bandwidth ceiling, natural", "qmtp, profiled acceptance",
                   "bandwidth ceiling, profiled", "plain roofline 90 tok/s"]
    assert "cache" not in gpu_title
    for case in (_plot_case(platform="cpu"), _plot_case(device=["cpu:0"])):
        cpu, cpu_title = _drawn(case)
        assert cpu == ["qmtp, natural acceptance", "qmtp, profiled acceptance"], cpu
        assert cpu_title.startswith("tiny engine=ref TP1") and "not a ceiling" in cpu_title and "cache" in cpu_title
    assert _drawn(_plot_case(device=["cuda:0", "cuda:1"]))[0] == gpu


def _batch_cases() -> list[dict]:
    """Cases at batches 1, 4 and 16 (one engine, one prompt length), K=3 natural missing at 16."""
    cases = []
    for b in (1, 4, 16):
        case = {k: v for k, v in _plot_case(batch=b).items() if k != "config"}
        case["modes"] = [dict(m, decode_tokens_per_s={"median": m["decode_tokens_per_s"]["median"] * b})
                         for m in case["modes"] if not (b == 16 and m["name"] == "mtp K=2 natural")]
        cases.append(case)
    return cases


def test_the_batch_plot_draws_each_mode_against_batch(tmp_path):
    """One line per mode through its batches, tokens/s by batch; a mode at one batch only has no line,
    and several engines or prompt lengths are told apart in the labels."""
    cases = _batch_cases()
    lines = br.batch_lines(cases)
    assert lines["plain"] == [(1, 100.0), (4, 400.0), (16, 1600.0)]
    assert lines["mtp K=2 natural"] == [(1, 240.0), (4, 960.0)] and len(lines) == 5
    assert br.batch_lines(cases[:1]) == {}
    other = dict(cases[0], engine="pallas", prompt_length=64)
    assert "plain (pallas, P64)" not in br.batch_lines(cases + [other])  # at one batch only
    assert br.batch_lines(cases + [other, dict(other, batch=4)])["plain (pallas, P64)"] == [(1, 100.0), (4, 100.0)]
    path = br.plot_batches({"config": {"title": "tiny"}, "cases": cases}, str(tmp_path / "b.png"))
    assert path == str(tmp_path / "b.png") and os.path.getsize(path) > 1000
    assert br.plot_batches({"config": {}, "cases": cases[:1]}, str(tmp_path / "none.png")) is None
    # --plot_from draws it beside the cases' plots
    src = tmp_path / "src.json"
    src.write_text(json.dumps({"config": {"title": "tiny"}, "cases": cases}))
    r = run_bench(f"--plot_from={src}", tmp_path=tmp_path, cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [str(tmp_path / f"src_{i}.png") for i in range(3)] + [str(tmp_path / "src_batches.png")]


def _refused_at_once(r, flag: str, tmp_path) -> None:
    """Exit status 2 with one `error: --flag=...` line, before anything ran (no progress, no bandwidth
    figure, no checkpoint built into the cache)."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --{flag}="), r.stderr[-3000:]
    assert not (tmp_path / "cache").exists()


QUICK = ("--repeats=1", "--ks=1", "--profile=", "--breakdown=false", "--max_new_tokens=4")


def test_outputs_are_checked_before_the_run(tmp_path):
    """--out, --plot and --trace_dir that cannot be written are refused before the copy bandwidth is
    measured or the model loaded, not after the run."""
    flagfile = f"--flagfile={ROOT}/configs/bench_tiny.flags"
    missing = tmp_path / "missing"
    r = run_bench(flagfile, *QUICK, f"--out={missing / 'r.json'}", tmp_path=tmp_path, cache=tmp_path / "cache")
    _refused_at_once(r, "out", tmp_path)
    assert f"directory {missing} does not exist" in r.stderr
    r = run_bench(flagfile, *QUICK, f"--out={tmp_path / 'r.json'}", f"--plot={missing / 'r.png'}", tmp_path=tmp_path,
                  cache=tmp_path / "cache")
    _refused_at_once(r, "plot", tmp_path)
    (tmp_path / "r.png").mkdir()  # the default plot path, beside --out, is a directory
    r = run_bench(flagfile, *QUICK, f"--out={tmp_path / 'r.json'}", tmp_path=tmp_path, cache=tmp_path / "cache")
    _refused_at_once(r, "plot", tmp_path)
    assert "is a directory" in r.stderr
    (tmp_path / "file").write_text("")
    r = run_bench(flagfile, *QUICK, f"--out={tmp_path / 'x.json'}", f"--trace_dir={tmp_path / 'file' / 'traces'}",
                  tmp_path=tmp_path, cache=tmp_path / "cache")
    _refused_at_once(r, "trace_dir", tmp_path)
    assert not (tmp_path / "x.json").exists()
    # --plot_from: its plot's path too, and an unreadable result is named
    src = tmp_path / "src.json"
    src.write_text(json.dumps({"config": {}, "cases": [{k: v for k, v in _plot_case().items() if k != "config"}]}))
    r = run_bench(f"--plot_from={src}", f"--plot={missing / 'p.png'}", tmp_path=tmp_path, cache=tmp_path / "cache")
    _refused_at_once(r, "plot", tmp_path)
    r = run_bench(f"--plot_from={tmp_path / 'nope.json'}", tmp_path=tmp_path, cache=tmp_path / "cache")
    _refused_at_once(r, "plot_from", tmp_path)



def test_prefill_floor_counts_the_decoder_projections():
    """compute.projection_weights: every FP8 block and 2-D weight of the decoder layers (projections, MLP,
    the GDN conv), not the embedding, lm_head, norms or MTP head, counted here from the config's dims; the
    floor is 2 x tokens x that / the rate."""
    import qmtp
    from qmtp.bench import compute
    from qmtp.tools.make_checkpoint import resolve_checkpoint
    model = qmtp.load(resolve_checkpoint("preset:tiny:fp8"), dtype="bfloat16", impl="pallas", progress=False)
    c = model.cfg
    e, mlp = c.hidden_size, 3 * c.hidden_size * c.intermediate_size
    hv = c.linear_num_value_heads
    gdn = (c.conv_dim + c.value_dim + 2 * hv) * e + e * c.value_dim + c.conv_dim * c.linear_conv_kernel_dim + mlp
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn = (2 * q_dim + 2 * kv_dim) * e + e * q_dim + mlp  # q_proj holds query and gate
    want = c.num_linear_layers * gdn + c.num_full_layers * attn
    assert compute.projection_weights(model.params) == want
    assert compute.prefill_floor_s(model.params, 1000, 2.0) == pytest.approx(2 * 1000 * want / 2e12)


@pytest.mark.slow  # CI time: the sampled loops: test_speculative_sampling.py; the flag check: below
def test_sampled_run_records_its_parameters_and_skips_the_token_check(tmp_path):
    """--temperature > 0: every mode samples (seeded), the run reports acceptance under sampling and does not
    demand plain greedy's tokens."""
    out = tmp_path / "s.json"
    r = run_bench(f"--flagfile={ROOT}/configs/bench_tiny.flags", "--ks=2", "--profile=", "--repeats=1",
                  "--breakdown=false", "--temperature=10", "--top_k=6", "--sampling_cost", f"--out={out}",
                  tmp_path=tmp_path, cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["config"]["sampling"] == {"temperature": 10.0, "top_k": 6, "top_p": 1.0, "min_p": 0.0, "seed": 0}
    mtp = res["cases"][0]["modes"][1]
    assert mtp["name"] == "mtp K=2 natural" and 0 < mtp["acceptance_rate"] <= 1 and mtp["tokens_match_plain"]
    for m in res["cases"][0]["modes"]:  # --sampling_cost: each mode's greedy twin ran in this process
        assert m["greedy_round_s"] > 0
        assert m["sampling_cost"] == pytest.approx(m["sampled_round_s"] / m["greedy_round_s"] - 1)
    assert "sampling adds" in r.stdout and "B=1 P=16 K=2 natural greedy repeat 1/1" in r.stderr


def test_sampling_cost_compares_time_per_round_with_the_greedy_twin():
    """What sampling adds: the medians of decode seconds per round, sampled over greedy, and its target rows
    for a plain step and a K=3 round."""
    from types import SimpleNamespace as Run
    sampled = [Run(stats={"decode_s": 1.03, "steps": 100}), Run(stats={"decode_s": 2.0, "steps": 100}),
               Run(stats={"decode_s": 1.05, "steps": 100})]
    greedy = [Run(stats={"decode_s": 1.0, "steps": 100})]
    cost = br.sampling_cost(sampled, greedy)
    assert cost["sampled_round_s"] == pytest.approx(0.0105) and cost["sampling_cost"] == pytest.approx(0.05)
    modes = [dict(name="plain", **br.sampling_cost(greedy, greedy)), dict(name="mtp K=3 natural", **cost)]
    assert "+5.0%" in br.sampling_cost_table(modes)
    rows = {r["target"]: r["met"] for r in bt.check({"modes": modes, "batch": 1})}
    assert rows == {"sampling adds <= 3% to a plain step": True, "sampling adds <= 3% to a K=3 round": False}


def test_a_bad_sampling_value_is_one_error_line_before_anything_loads(tmp_path):
    bad = run_bench("--checkpoint=/nonexistent", "--temperature=1", "--top_p=2", tmp_path=tmp_path,
                    cache=tmp_path / "cache")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == "error: --top_p=2.0 must be in (0, 1]"
    unsampled = run_bench("--checkpoint=/nonexistent", "--sampling_cost", tmp_path=tmp_path, cache=tmp_path / "cache")
    assert unsampled.returncode == 2 and "--sampling_cost" in unsampled.stderr.strip().splitlines()[-1]


def test_moe_roofline_counts_the_experts_a_pass_reads():
    """One token reads k of X experts; many tokens read (nearly) all of them."""
    import qmtp
    from qmtp import api
    from qmtp.tools.make_checkpoint import resolve_checkpoint
    model = qmtp.load(resolve_checkpoint("preset:tiny_moe"), progress=False)
    experts = sum(br.nbytes(layer[k]) for group in ("gdn", "attn") for layer in model.params[group]
                  for k in ("experts_gate_up", "experts_down"))
    full = br.step_bytes(model.params, api._new_state(model, [64]), 64)["target"]["weights"]
    one = br.step_bytes(model.params, api._new_state(model, [64]), 64, moe_top_k=2)["target"]["weights"]
    many = br.step_bytes(model.params, api._new_state(model, [64] * 64), 64, moe_top_k=2)["target"]["weights"]
    assert abs(one - (full - experts * 6 / 8)) <= 8  # 2 of 8 experts; each of the 8 stacks rounds to a byte
    assert full - many < experts * 1e-3
    # a K=3 verify of one sequence reads the experts of 4 tokens: a plain pass of 4 sequences' share
    four = br.step_bytes(model.params, api._new_state(model, [64] * 4), 64, moe_top_k=2)["target"]["weights"]
    verify = br.step_bytes(model.params, api._new_state(model, [64]), 64, moe_top_k=2, verify_ks=[3])["verify"]["3"]
    assert verify["weights"] == four > one


@pytest.mark.slow  # CI time: generate's auto is tested in test_adaptive_k.py; this is the bench's report of it
def test_auto_modes_report_the_rounds_and_costs_of_each_k(tmp_path):
    out = tmp_path / "a.json"
    r = run_bench(f"--flagfile={ROOT}/configs/bench_tiny.flags", "--ks=3", "--repeats=1", "--breakdown=false",
                  "--max_new_tokens=12", "--auto", f"--out={out}", tmp_path=tmp_path, cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr[-3000:]
    (case,) = json.loads(out.read_text())["cases"]
    assert [m["name"] for m in case["modes"]][3:] == ["mtp auto natural", "mtp auto profiled"]
    for auto in case["modes"][3:]:  # the draft length chosen per round, timed per K first
        assert set(auto["k_rounds"]) == {"0", "1", "3"} and all(c > 0 for c in auto["round_cost_s"].values())
        assert auto["tokens_match_plain"]
