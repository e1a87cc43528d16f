"""--mtp_k=auto in the serving engine: the warm-up times a round at each candidate K; requests joining
and leaving mid-run get plain greedy tokens whatever K each round runs; each slot's acceptance estimate
starts over with its request; /metrics reports the rounds per K and their seconds.

Shapes of tests/serving_fixtures.py; the tiny checkpoint's `model` (float32) from tests/conftest.py.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import qmtp
from qmtp.runtime import adaptive_k
from qmtp.serve import metrics, round_costs
from serving_fixtures import assert_all_free, make_engine

RNG = np.random.default_rng(31)
PROMPTS = [RNG.integers(0, 380, int(n)).tolist() for n in RNG.integers(2, 17, 7)]  # one prompt bucket: 16
pytestmark = pytest.mark.usefixtures("single_threaded_cpu_blas")


def test_auto_times_rounds_and_keeps_greedy_tokens(model, tmp_path):
    lines = []
    engine = make_engine(model, "auto", start=False, log=lines.append, round_cost_dir=str(tmp_path))
    assert engine.k == adaptive_k.CANDIDATES[-1]
    engine.warmup([16])
    assert any(line.startswith("warm-up [") and "timing a round at K = 0, 1, 3" in line for line in lines), lines
    assert engine.round_cost is not None and np.all(engine.round_cost > 0) and engine.counters["admitted"] == 0
    assert engine.round_cost[0] < 3 * engine.round_cost[-1], engine.round_cost  # no compile inside a timing
    np.testing.assert_array_equal(round_costs.load(str(tmp_path), engine), engine.round_cost)  # kept for next time
    assert_all_free(engine)
    engine.start()
    handles = [engine.submit(p, int(n)) for p, n in zip(PROMPTS, RNG.integers(3, 12, len(PROMPTS)))]
    for h, p in zip(handles, PROMPTS):  # one budget for the references: one compiled loop (CI time)
        assert h.result(300).tokens == qmtp.generate(model, [p], max_new_tokens=12).tokens[0][:h.max_tokens]
    assert engine.k_rounds.sum() > 0 and engine.counters["serving_compiles"] == 0
    text = metrics.render(engine)
    assert 'qmtp_mtp_loop_rounds_by_k_total{k="3"}' in text and 'qmtp_mtp_round_seconds{k="0"}' in text
    assert engine.stop(10)
    assert_all_free(engine)


def test_a_new_request_starts_with_no_acceptance_seen(model):
    engine = make_engine(model, "auto", start=False)
    engine.warmup([16])
    first = engine.submit(PROMPTS[0], 10)
    while not first.finished:
        engine._iteration()
    slot = 0  # the first free slot, handed out again
    assert not np.allclose(np.asarray(engine._device.slots.accept_ema[slot]), adaptive_k.UNSEEN)
    engine.submit(PROMPTS[1], 10)
    engine._admit()
    np.testing.assert_allclose(np.asarray(engine._device.slots.accept_ema[slot]), adaptive_k.UNSEEN)


@pytest.mark.slow  # CI time: another warm-up
def test_auto_without_a_warm_up_warms_up_at_start(model):
    engine = make_engine(model, "auto")  # start() with no buckets: the loop and the timing still run first
    assert engine.warming is not None
    deadline = time.monotonic() + 300
    while engine.warming is not None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert engine.generate(PROMPTS[2], 4, timeout=300).tokens == qmtp.generate(model, [PROMPTS[2]], 4).tokens[0]
    assert engine.round_cost is not None
    assert engine.stop(10)


def test_round_costs_are_reused_by_the_same_shapes_only(model, tmp_path):
    """An engine whose round_cost_dir holds costs for its model and shapes takes them instead of timing
    (the first test checks that a timing writes them); one of another batch size does not find them."""
    costs = np.asarray([0.25, 0.5, 0.75], np.float32)
    lines = []
    engine = make_engine(model, "auto", start=False, log=lines.append, round_cost_dir=str(tmp_path))
    kept = round_costs.save(str(tmp_path), engine, costs)
    engine.warmup([16])
    assert not any("timing a round" in line for line in lines), lines
    assert any(f"round costs at K = 0, 1, 3 from {kept}" in line for line in lines), lines
    np.testing.assert_array_equal(engine.round_cost, costs)
    other = make_engine(model, "auto", start=False, round_cost_dir=str(tmp_path), batch_slots=2)
    assert round_costs.key(other) != round_costs.key(engine) and round_costs.load(str(tmp_path), other) is None
    with open(kept, "w") as f:
        f.write("{not json")  # an unreadable file counts as none
    assert round_costs.load(str(tmp_path), engine) is None
