"""pallas_kernels/bench/trace_events.py and the FP8 bench's device-time figures: a kernel's device time
is the summed duration of its own launches in the GPU processes of a profiler trace, busy time the
union of every GPU event (no idle gaps); per call, they divide by the calls the traced loop made.
The figures come from crafted traces here: a CPU run has no GPU events, and says so with None."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.bench import common, fp8, trace_events

GPU, HOST = 1, 2
META = [{"ph": "M", "name": "process_name", "pid": GPU, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": HOST, "args": {"name": "/host:CPU"}}]


def x(pid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": 1, "name": name, "ts": ts, "dur": dur}


# two calls: each an 8 us kernel, a 2 us split-K sum right after it, then a 5 us idle gap
TWO_CALLS = META + [x(GPU, "fp8_matmul_decode", 0, 8), x(GPU, "loop_reduce_fusion", 8, 2),
                    x(GPU, "fp8_matmul_decode", 15, 8), x(GPU, "loop_reduce_fusion", 23, 2),
                    x(HOST, "fp8_matmul_decode launch", 0, 40)]  # host events never count


def test_kernel_time_counts_the_prefix_and_busy_time_skips_the_gaps():
    got = trace_events.kernel_time(TWO_CALLS, "fp8_matmul")
    assert got == pytest.approx({"kernel_s": 16e-6, "kernel_launches": 2, "busy_s": 20e-6, "devices": 1,
                                 "busy_s_per_device": 20e-6})
    assert trace_events.kernel_time(TWO_CALLS, "gdn") == pytest.approx({"kernel_s": 0.0, "kernel_launches": 0,
                                                                          "busy_s": 20e-6, "devices": 1,
                                                                          "busy_s_per_device": 20e-6})
    # a second GPU (TP2) busy 6 us: sums over both, the busiest device apart
    gpu1 = [{"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:GPU:1"}}, x(3, "k", 0, 6)]
    got = trace_events.kernel_time(TWO_CALLS + gpu1, "fp8_matmul")
    assert got["devices"] == 2 and got["busy_s"] == pytest.approx(26e-6)
    assert got["busy_s_per_device"] == pytest.approx(20e-6)
    assert trace_events.kernel_time(META + [x(HOST, "fp8_matmul_decode", 0, 5)], "fp8") is None  # no GPU events


def test_kernel_table_groups_launches_by_kind_on_the_busiest_device():
    """Launch names lose their numbering (two programs number the same kind differently); the table
    is the busiest GPU's, the largest kind first; no GPU events: None."""
    assert [trace_events.launch_kind(n) for n in ("fp8_matmul_decode__7", "loop_add_fusion_127", "memcpy128",
                                                   "input_concatenate_fusion_260", "gdn_conv_recurrence", "_1")] == [
        "fp8_matmul_decode", "loop_add_fusion", "memcpy128", "input_concatenate_fusion", "gdn_conv_recurrence", "_1"]
    events = TWO_CALLS + [x(GPU, "fusion_12", 30, 1), x(GPU, "fusion_7", 31, 1)]
    gpu1 = [{"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:GPU:1"}}, x(3, "other_9", 0, 6)]
    table = trace_events.kernel_table(events + gpu1)
    assert table == {"fp8_matmul_decode": {"us": 16.0, "count": 2}, "loop_reduce_fusion": {"us": 4.0, "count": 2},
                     "fusion": {"us": 2.0, "count": 2}}
    assert list(table) == ["fp8_matmul_decode", "loop_reduce_fusion", "fusion"]
    assert trace_events.kernel_table(META + [x(HOST, "k", 0, 5)]) is None


def test_device_time_of_a_cpu_run_is_none():
    f = jax.jit(lambda a: a * 2)
    jax.block_until_ready(f(jnp.ones(4)))
    assert trace_events.device_time(f, jnp.ones(4), prefix="fp8_matmul") is None


def test_device_figures_per_call_and_the_step_aggregate(monkeypatch):
    monkeypatch.setattr(trace_events, "device_time", lambda prog, *a, prefix: trace_events.kernel_time(TWO_CALLS,
                                                                                                     prefix))
    # 2 calls of a 40 kB weight: 8 us of kernel (5 TB/s) and 10 us busy (4 TB/s) per call, copy at 4 TB/s
    got = fp8._device_figures(None, (), calls=2, nbytes=40_000_000, copy_tb_s=4.0)
    assert got == pytest.approx({"kernel_launches_per_call": 1.0, "kernel_s_per_call": 8e-6, "kernel_tb_s": 5.0,
                                 "kernel_share_of_copy": 1.25, "busy_s_per_call": 10e-6, "busy_tb_s": 4.0,
                                 "busy_share_of_copy": 1.0})
    monkeypatch.setattr(trace_events, "device_time", lambda prog, *a, prefix: None)
    assert fp8._device_figures(None, (), calls=2, nbytes=1, copy_tb_s=4.0) == {}  # a CPU run: no keys
    # two shapes, one used twice per step: 3 x 10 us over 3 x 40 MB = 4 TB/s
    shapes = {(4000, 10000): ["a", "b"], (10000, 4000): ["c"]}
    agg = fp8._aggregate({(4000, 10000): 10e-6, (10000, 4000): 10e-6}, shapes, 4.0, "kernel_")
    assert agg == pytest.approx({"kernel_s_per_step": 30e-6, "kernel_tb_s": 4.0, "kernel_share_of_copy": 1.0})


def test_summary_table_shows_the_device_time_where_measured():
    rows = [{"kernel": "fp8_matmul", "case": "c", "impl": "pallas", "s_per_call": 13e-6, "tb_s": 2.4,
             "share_of_copy": 0.6, "tflop_s": 1.0, "kernel_s_per_call": 10e-6, "kernel_share_of_copy": 0.8},
            {"kernel": "fp8_matmul", "case": "c", "impl": "xla", "s_per_call": 20e-6}]
    header, with_kernel, without = common.summary_table(rows).splitlines()
    assert header.split()[7:9] == ["kernel_us", "kernel_share"]
    assert with_kernel.split()[7:9] == ["10", "0.8"] and len(without.split()) == 4
    failed = {"kernel": "gdn_prefill", "case": "c", "impl": "xla", "s_per_call": None, "error": "RESOURCE_EXHAUSTED"}
    assert common.summary_table([failed]).splitlines()[1].split() == ["gdn_prefill", "c", "xla", "RESOURCE_EXHAUSTED"]


@pytest.mark.gpu
def test_device_time_of_an_fp8_matmul_on_the_gpu():
    """On the H200: one jitted FP8 GEMV at the o_proj shape, traced: one Pallas launch, its device
    time within the busy time, both shorter than the wall-clock call."""
    import time

    from pallas_kernels import fp8_matmul as fm
    w = (jax.random.normal(jax.random.key(0), (5120, 6144)) * 64).clip(-448, 448).astype(jnp.float8_e4m3fn)
    s = jnp.full((40, 48), 1e-4, jnp.float32)
    x = jnp.ones((1, 6144), jnp.bfloat16)
    f = jax.jit(lambda x, w, s: fm.fp8_matmul(x, w, s))
    jax.block_until_ready(f(x, w, s))
    t = time.perf_counter()
    jax.block_until_ready(f(x, w, s))
    wall = time.perf_counter() - t
    got = trace_events.device_time(f, x, w, s, prefix="fp8_matmul")
    assert got is not None and got["kernel_launches"] == 1
    assert 0 < got["kernel_s"] <= got["busy_s"] < wall


def test_breakdown_device_piece_per_iteration(monkeypatch):
    """qmtp.bench.breakdown's device figure: the busiest device's busy time of one profiled call over its
    iterations; a predicted round from the device pieces as from the wall-clock ones."""
    from qmtp.bench import breakdown as bd
    from qmtp.runtime import ops
    calls = []
    monkeypatch.setattr(ops, "device_time", lambda fn, *a, prefix: calls.append(a) or {
        "busy_s_per_device": 18e-3, "kernels": {"gdn": {"us": 36.0, "count": 18}}})
    busy, kinds = bd._device_piece(lambda x, n: x, lambda: jnp.zeros(2), n=18)
    assert busy == pytest.approx(1e-3) and kinds == {"gdn": {"us": 2.0, "count": 1.0}}  # per iteration
    assert calls[0][1] == 18  # (input, n): one call of n iterations
    monkeypatch.setattr(ops, "device_time", lambda fn, *a, prefix: None)
    assert bd._device_piece(lambda x, n: x, lambda: jnp.zeros(2)) is None  # a CPU run: no figure
    pieces = {"device_draft": 0.5, "device_verify": 10.0, "draft": 0.6, "verify": 10.5}
    assert bd._predicted_round(pieces, 3, "device_") == pytest.approx(3 * 0.5 + 10.0)
    assert bd._predicted_round(pieces, 3, "") == pytest.approx(3 * 0.6 + 10.5)


def test_breakdown_table_adds_the_device_columns_when_measured():
    from qmtp.bench import report as br
    wall = {"3": {"verify": 0.0105, "draft": 0.0006, "predicted_round": 0.0123}}
    assert "device_" not in br.breakdown_table(wall)  # a CPU run
    header = br.breakdown_table({"3": dict(wall["3"], device_verify=0.0099, device_draft=0.0005)}).splitlines()[1]
    assert header.split()[-3:] == ["device_verify", "device_draft", "verify/step"]  # no target_step: "-"


def test_kernel_diff_table_orders_the_kinds_by_what_verify_adds():
    from qmtp.bench import report as br
    pieces = {"target_step": {"fp8_matmul_decode": {"us": 7500.0, "count": 401}, "memcpy128": {"us": 0.0, "count": 0},
                              "fusion": {"us": 900.0, "count": 500}},
              "verify": {"fp8_matmul_decode": {"us": 7670.0, "count": 401}, "memcpy128": {"us": 130.0, "count": 48},
                         "fusion": {"us": 880.0, "count": 500}}}
    lines = br.kernel_diff_table(pieces).splitlines()
    assert "+280.0 us" in lines[0]  # summed: 170 + 130 - 20
    assert [ln.split()[0] for ln in lines[2:]] == ["fp8_matmul_decode", "memcpy128", "fusion"]
    assert lines[3].split()[-1] == "+130.0" and lines[4].split()[-1] == "-20.0"
