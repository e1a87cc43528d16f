"""Batched admission (qmtp.engine): prompts of one bucket that wait together are prefilled in one
pass (slots.prefill_into_slots, padding rows write nothing); tokens equal qmtp.generate of each prompt
alone, requests that end on their first token release their slots, and nothing leaks."""

from __future__ import annotations

import numpy as np
import pytest

import qmtp
from serving_fixtures import SLOTS, assert_all_free, make_engine

RNG = np.random.default_rng(11)
PROMPTS = [RNG.integers(0, 380, n).tolist() for n in (3, 9, 12, 5, 30, 1, 20)]  # buckets 16 and 32
pytestmark = pytest.mark.usefixtures("single_threaded_cpu_blas")


@pytest.fixture(scope="module")
def reference(model):
    return [qmtp.generate(model, [p], max_new_tokens=10).tokens[0] for p in PROMPTS]


@pytest.mark.parametrize("k", [0, 2])
def test_waiting_prompts_share_a_prefill_and_give_the_same_tokens(model, reference, k):
    engine = make_engine(model, k, start=False)
    handles = [engine.submit(p, 10) for p in PROMPTS]  # all queued before the first scheduling point
    engine.start()
    assert [h.result(300).tokens for h in handles] == reference
    assert engine.counters["admitted"] == len(PROMPTS)
    assert engine.counters["prefills"] < len(PROMPTS)  # at least one pass held several prompts
    assert engine.stop(5)
    assert_all_free(engine)


def test_one_prompt_per_pass_when_asked_and_first_token_finishes(model, reference):
    engine = make_engine(model, 0, start=False, prefill_batch=1)
    handles = [engine.submit(p, 10) for p in PROMPTS[:SLOTS]]
    engine.start()
    assert [h.result(300).tokens for h in handles] == reference[:SLOTS]
    assert engine.counters["prefills"] == SLOTS
    assert engine.stop(5)
    batched = make_engine(model, 2, start=False)
    short = [batched.submit(p, 1) for p in PROMPTS[:SLOTS]]  # each ends with its first token
    rest = [batched.submit(p, 10) for p in PROMPTS[SLOTS:]]
    batched.start()
    assert [h.result(300).tokens for h in short] == [r[:1] for r in reference[:SLOTS]]
    assert all(h.result(300).finish_reason == "length" for h in short)
    assert [h.result(300).tokens for h in rest] == reference[SLOTS:]
    assert batched.stop(5)
    assert_all_free(batched)
