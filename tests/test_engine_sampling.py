"""Sampled and penalized requests in the serving engine: a seeded request gets qmtp.generate's tokens with that seed
(plain and MTP), greedy requests beside it keep the greedy tokens, bad values are request errors
naming the parameter, and the warm-up compiles the loop's sampled forms (with and without logprobs).

Shapes of tests/serving_fixtures.py; the tiny checkpoint's `model` (float32) from tests/conftest.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import qmtp
from qmtp.serve import metrics
from qmtp.serve.requests import RequestError
from serving_fixtures import assert_all_free, make_engine

RNG = np.random.default_rng(21)
PROMPTS = [RNG.integers(0, 380, n).tolist() for n in (5, 13, 9)]
SAMPLED = dict(temperature=1.5, top_k=40, top_p=0.95)
pytestmark = pytest.mark.usefixtures("single_threaded_cpu_blas")


# CI time: slow; tests/test_engine_logprobs.py serves a seeded request beside greedy ones at K = 2 and
# checks the split acceptance metrics
@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 2])
def test_seeded_requests_get_generate_tokens_and_greedy_ones_stay_greedy(model, k):
    engine = make_engine(model, k)
    sampled = [engine.submit(p, 10, seed=100 + i, **SAMPLED) for i, p in enumerate(PROMPTS[:2])]
    greedy = engine.submit(PROMPTS[2], 10)
    for i, (h, p) in enumerate(zip(sampled, PROMPTS)):
        want = qmtp.generate(model, [p], max_new_tokens=10, mtp_k=k, seed=100 + i, **SAMPLED).tokens[0]
        assert h.result(300).tokens == want, i
    assert greedy.result(300).tokens == qmtp.generate(model, [PROMPTS[2]], max_new_tokens=10, mtp_k=k).tokens[0]
    assert sampled[0].tokens != qmtp.generate(model, [PROMPTS[0]], max_new_tokens=10, mtp_k=k).tokens[0]
    if k:  # acceptance is also counted apart for the sampled requests
        assert 0 < engine.counters["mtp_rounds_sampled"] < engine.counters["mtp_rounds"]
        assert np.all(engine.sampled_position_accepts <= engine.position_accepts)
        text = metrics.render(engine)
        for decoding in ("greedy", "sampled"):
            assert f'qmtp_mtp_position_acceptance_by_decoding{{decoding="{decoding}",position="2"}}' in text
    assert engine.stop(5)
    assert_all_free(engine)


@pytest.mark.parametrize("kw, param", [(dict(temperature=-1.0), "temperature"),
                                       (dict(temperature=1.0, top_p=0.0), "top_p"),
                                       (dict(temperature=1.0, top_k=-2), "top_k"),
                                       (dict(temperature=1.0, min_p=1.5), "min_p"),
                                       (dict(temperature=1.0, seed=2 ** 40), "seed"),
                                       (dict(presence_penalty=2.5), "presence_penalty"),
                                       (dict(frequency_penalty=-3.0), "frequency_penalty"),
                                       (dict(logit_bias={10 ** 6: 1.0}), "logit_bias")])
def test_bad_sampling_values_name_their_parameter(model, kw, param):
    engine = make_engine(model, 0, start=False)
    with pytest.raises(RequestError) as e:
        engine.submit(PROMPTS[0], 4, **kw)
    assert e.value.param == param and str(e.value).startswith(f"{param}=")


def test_a_penalized_greedy_request_gets_generate_tokens_beside_a_plain_one(model):
    """A greedy request with penalties and a logit bias (against its first greedy token) decodes in the
    loop's sampled form (which counts the generated ids) and gets qmtp.generate's tokens, as does one with
    min_tokens past a stop id it would generate; the request beside them keeps its greedy tokens."""
    engine = make_engine(model, 2)
    penalty = dict(presence_penalty=-2.0, frequency_penalty=0.5,  # negative: the tiny model repeats ids
                   logit_bias={int(qmtp.generate(model, [PROMPTS[0]], max_new_tokens=1).tokens[0][0]): -50.0})
    # two stop ids (as the default ones: the programs compiled for those serve): its second greedy token and one
    stop = [qmtp.generate(model, [PROMPTS[2]], max_new_tokens=10, mtp_k=2).tokens[0][1], model.cfg.eos_token_ids[0]]
    penalized, plain = engine.submit(PROMPTS[0], 10, **penalty), engine.submit(PROMPTS[1], 10)
    held = engine.submit(PROMPTS[2], 10, stop_token_ids=stop, min_tokens=6)
    want = qmtp.generate(model, [PROMPTS[0]], max_new_tokens=10, mtp_k=2, **penalty).tokens[0]
    assert want != qmtp.generate(model, [PROMPTS[0]], max_new_tokens=10, mtp_k=2).tokens[0]
    assert penalized.result(300).tokens == want
    assert plain.result(300).tokens == qmtp.generate(model, [PROMPTS[1]], max_new_tokens=10, mtp_k=2).tokens[0]
    want = qmtp.generate(model, [PROMPTS[2]], max_new_tokens=10, mtp_k=2, stop_token_ids=stop, min_tokens=6).tokens[0]
    assert len(want) > 6 and held.result(300).tokens == want
    with pytest.raises(RequestError, match=r"^min_tokens=11 must be <= max_tokens=10"):
        engine.submit(PROMPTS[2], 10, min_tokens=11)
    assert engine.stop(5)
    assert_all_free(engine)


def test_the_warmup_compiles_the_sampled_and_logprobs_loops(model):
    lines = []
    engine = make_engine(model, 2, start=False, log=lines.append)
    engine.warmup([16])
    assert any("decode loop with sampling" in line for line in lines), lines
    assert any("decode loop with logprobs" in line for line in lines), lines
    engine.start()
    engine.generate(PROMPTS[0], 6, temperature=0.8, seed=1, timeout=300)
    engine.generate(PROMPTS[1], 6, timeout=300)
    assert len(engine.generate(PROMPTS[2], 6, logprobs=0, timeout=300).logprobs) == 6
    assert engine.counters["serving_compiles"] == 0
    assert engine.stop(5)
    assert_all_free(engine)
