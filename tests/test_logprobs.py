"""Logprobs of generated tokens (qmtp.generate(logprobs=N)): each token's value and its N most likely
alternatives equal the log-softmax of the target's teacher-forced logits over the prompt and the
generated tokens (qmtp.target_logits, at the sampling temperature, before top_k), for plain and MTP
decoding, greedy and sampled, in the batched and the row-at-a-time (deterministic) prefill.
"""

from __future__ import annotations

import numpy as np
import pytest

import qmtp
from qmtp.tools import make_checkpoint

PROMPTS = [[5, 17, 99, 3, 250], [7, 8, 301]]
N = 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_checkpoint.write_checkpoint(str(tmp_path_factory.mktemp("logprobs") / "tiny"), "tiny", "fp32", seed=3)
    return qmtp.load(path, dtype="float32", progress=False)


def reference(model, prompt, tokens, temperature=1.0):
    """log_softmax(z / T) [len(tokens), V] of the target at each generated token's position (float64)."""
    z = qmtp.target_logits(model, prompt + tokens[:-1]).astype(np.float64)[len(prompt) - 1:] / temperature
    return z - np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1, keepdims=True)) - z.max(-1, keepdims=True)


def assert_logprobs(model, result, temperature=1.0):
    for prompt, tokens, lps in zip(PROMPTS, result.tokens, result.logprobs):
        want = reference(model, prompt, tokens, temperature)
        assert [t.token for t in lps] == tokens
        got = np.array([t.logprob for t in lps])
        np.testing.assert_allclose(got, want[np.arange(len(tokens)), tokens], rtol=1e-4, atol=1e-5)
        for i, t in enumerate(lps):
            ids, values = zip(*t.top)
            assert list(ids) == np.argsort(-want[i], kind="stable")[:N].tolist(), i
            np.testing.assert_allclose(values, np.sort(want[i])[::-1][:N], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k", [0, 3])
def test_greedy_logprobs_are_the_targets(tiny, k):
    result = qmtp.generate(tiny, PROMPTS, max_new_tokens=9, mtp_k=k, logprobs=N)
    assert_logprobs(tiny, result)
    assert all(t.top[0][0] == t.token for row in result.logprobs for t in row)  # greedy: the argmax


@pytest.mark.parametrize("k", [2])
def test_sampled_logprobs_are_at_the_temperature_before_truncation(tiny, k):
    result = qmtp.generate(tiny, PROMPTS, max_new_tokens=9, mtp_k=k, logprobs=N, temperature=0.7, top_k=8, seed=4)
    assert_logprobs(tiny, result, temperature=0.7)


@pytest.mark.slow  # CI time: the deterministic prefill's tokens: test_deterministic.py; its logprobs are these
def test_row_at_a_time_prefill_gives_the_same_logprobs(tiny):
    det = qmtp.load(tiny.checkpoint_dir, dtype="float32", progress=False, impl="pallas", deterministic=True,
                    prefill_chunk=16)
    assert_logprobs(det, qmtp.generate(det, PROMPTS, max_new_tokens=4, mtp_k=2, logprobs=N))


def test_no_alternatives_and_off(tiny):
    result = qmtp.generate(tiny, PROMPTS, max_new_tokens=3, logprobs=0)
    assert all(t.top == [] for row in result.logprobs for t in row)
    assert qmtp.generate(tiny, PROMPTS, max_new_tokens=3).logprobs is None


@pytest.mark.parametrize("bad", [21, -1, True, 2.0])
def test_out_of_range_is_refused(tiny, bad):
    with pytest.raises(ValueError, match=r"logprobs=.* must be an integer in \[0, 20\]"):
        qmtp.generate(tiny, PROMPTS, max_new_tokens=3, logprobs=bad)
