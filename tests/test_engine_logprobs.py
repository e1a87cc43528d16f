"""Logprobs in the serving engine: a request that asks for them gets qmtp.generate's (the same tokens,
values and alternatives), whichever way its first token came (a batched prefill, the pieces of a long
prompt, a prefix cache hit) and whatever the other slots do; the others get none.

Shapes of tests/serving_fixtures.py; the tiny checkpoint's `model` (float32) from tests/conftest.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import qmtp
from qmtp.serve import metrics
from qmtp.serve.requests import RequestError
from serving_fixtures import assert_all_free, make_engine

RNG = np.random.default_rng(23)
PROMPTS = [RNG.integers(0, 380, n).tolist() for n in (5, 13, 9)]
LONG = RNG.integers(0, 380, 29).tolist()  # two pieces of 16
pytestmark = pytest.mark.usefixtures("single_threaded_cpu_blas")


def assert_same(got, want, n):
    """An engine Completion's logprobs against qmtp.generate's for one prompt, n alternatives kept."""
    assert got.tokens == want.tokens[0]
    assert [t.token for t in got.logprobs] == got.tokens
    ref = want.logprobs[0]
    np.testing.assert_allclose([t.logprob for t in got.logprobs], [t.logprob for t in ref], rtol=1e-5, atol=1e-6)
    for g, r in zip(got.logprobs, ref):
        assert [i for i, _ in g.top] == [i for i, _ in r.top[:n]]
        np.testing.assert_allclose([v for _, v in g.top], [v for _, v in r.top[:n]], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # CI time: test_server.py's logprobs test takes the engine's logprobs through both routes
@pytest.mark.parametrize("k", [2])
def test_requests_get_generate_logprobs_and_others_none(model, k):
    """A greedy and a seeded sampled request with logprobs beside a plain one: generate's tokens and
    logprobs for each, and the sampled request's acceptance counted apart."""
    engine = make_engine(model, k)
    greedy = engine.submit(PROMPTS[0], 8, logprobs=3)
    sampled = engine.submit(PROMPTS[1], 8, logprobs=5, temperature=0.9, top_k=30, seed=7)
    plain = engine.submit(PROMPTS[2], 8)
    assert_same(greedy.result(300), qmtp.generate(model, [PROMPTS[0]], 8, mtp_k=k, logprobs=20), 3)
    assert_same(sampled.result(300), qmtp.generate(model, [PROMPTS[1]], 8, mtp_k=k, logprobs=20, temperature=0.9,
                                                   top_k=30, seed=7), 5)
    assert sampled.tokens != qmtp.generate(model, [PROMPTS[1]], 8, mtp_k=k).tokens[0]
    result = plain.result(300)
    assert result.logprobs is None and result.tokens == qmtp.generate(model, [PROMPTS[2]], 8, mtp_k=k).tokens[0]
    # acceptance is also counted apart for the sampled request
    assert 0 < engine.counters["mtp_rounds_sampled"] < engine.counters["mtp_rounds"]
    assert np.all(engine.sampled_position_accepts <= engine.position_accepts)
    text = metrics.render(engine)
    for decoding in ("greedy", "sampled"):
        assert f'qmtp_mtp_position_acceptance_by_decoding{{decoding="{decoding}",position="2"}}' in text
    assert engine.stop(5)
    assert_all_free(engine)


@pytest.mark.slow  # CI time: a resumed pass-wise prefill's first logprobs run in tests/test_prefix_cache.py
def test_a_long_prompt_carries_the_first_tokens_logprobs(model):
    """(A prefix cache hit's: tests/test_prefix_cache.py.)"""
    chunked = dataclasses.replace(model, kernels=dataclasses.replace(model.kernels, prefill_chunk=16))
    engine = make_engine(chunked, 2)
    want = qmtp.generate(chunked, [LONG], 6, mtp_k=2, logprobs=20)
    assert_same(engine.generate(LONG, 6, logprobs=2, timeout=300), want, 2)
    assert engine.stop(5)
    assert_all_free(engine)


@pytest.mark.parametrize("bad", [21, -1, 1.5])
def test_bad_logprobs_are_a_request_error(model, bad):
    engine = make_engine(model, 0, start=False)
    with pytest.raises(RequestError) as e:
        engine.submit(PROMPTS[0], 4, logprobs=bad)
    assert e.value.param == "logprobs"
