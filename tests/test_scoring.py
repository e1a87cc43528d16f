"""qmtp.score: each token's log-probability given the tokens before it, and the alternatives, against the
log_softmax (numpy, float64) of qmtp.target_logits' teacher-forced logits (another program: one pass, the
whole [T, V]); also past the prefill chunk (the target chunk by chunk, logits block by block)."""

from __future__ import annotations

import numpy as np
import pytest

import qmtp


def np_logprobs(model, ids):
    z = np.asarray(qmtp.target_logits(model, ids), np.float64)  # [T, V]: position t predicts token t + 1
    return z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)


def check(model, ids, got, top):
    want = np_logprobs(model, ids)
    assert [t.token for t in got] == ids[1:]
    np.testing.assert_allclose([t.logprob for t in got], want[np.arange(len(ids) - 1), ids[1:]], rtol=1e-5,
                               atol=1e-5)
    for t, row, x in zip(got, want, ids[1:]):
        assert t.rank == 1 + np.sum(row > row[x])
        assert [i for i, _ in t.top] == np.argsort(-row, kind="stable")[:top].tolist()
        np.testing.assert_allclose([v for _, v in t.top], np.sort(row)[::-1][:top], rtol=1e-5, atol=1e-5)


def test_scores_are_the_teacher_forced_log_softmax(model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in (5, 16, 23)]
    got = qmtp.score(model, prompts + [[7]], top_logprobs=3)
    for ids, scores in zip(prompts, got):
        check(model, ids, scores, 3)
    assert got[-1] == []  # a one-token prompt: nothing to score
    with pytest.raises(ValueError, match=r"^logprobs=21 must be an integer in \[0, 20\]"):
        qmtp.score(model, prompts[:1], top_logprobs=21)


def test_a_prompt_past_the_prefill_chunk_is_scored_chunk_by_chunk(ckpt):
    model = qmtp.load(ckpt, dtype="float32", prefill_chunk=16, progress=False)  # logits blocks of 16 positions too
    ids = np.random.default_rng(1).integers(0, model.cfg.vocab_size, 40).tolist()  # bucket 64: 4 chunks
    check(model, ids, qmtp.score(model, [ids], top_logprobs=2)[0], 2)
