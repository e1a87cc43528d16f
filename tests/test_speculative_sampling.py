"""Sampling through qmtp.generate, plain and with MTP (speculative sampling in the decode loop).

The distribution test: one prompt decoded by N rows, row i with seed i, plainly and with MTP K = 2,
on `tiny_controlled` (its MTP head predicts the target's greedy token, so at temperature 10 drafts are
accepted often and rejected often: both the acceptance and the residual draw matter). The tokens at
positions 1..4 (spanning two rounds) must follow the same distribution: a two-sample chi-square per
position, p > 0.001. N = 2,000 here; the `slow` run takes 20,000 and checks the test's power: with the
residual norm(max(0, p - q)) replaced by p the same comparison must fail.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from scipy import stats

import qmtp
from qmtp.runtime import sampling
from qmtp.tools.make_checkpoint import resolve_checkpoint
from marks import slow_except

ALPHA = 1e-3
TOKENS = 4
SAMPLED = dict(temperature=10.0, top_k=6)  # flat enough that drafts are rejected ~1 in 8


@pytest.fixture(scope="module")
def controlled():
    return qmtp.load(resolve_checkpoint("preset:tiny_controlled"), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def prompt(controlled):
    return np.random.default_rng(0).integers(0, controlled.cfg.vocab_size, 12).tolist()


def draws(model, prompt, n: int, k: int) -> np.ndarray:
    r = qmtp.generate(model, [prompt] * n, max_new_tokens=TOKENS, stop_token_ids=[], mtp_k=k, seed=np.arange(n),
                      **SAMPLED)
    if k:
        assert 0.1 < r.stats["acceptance_rate"] < 0.95, r.stats  # both branches of the acceptance test run
    return np.asarray(r.tokens)  # [n, TOKENS]


def same_distribution_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample chi-square of token counts (categories with fewer than 10 in both samples pooled)."""
    ids = np.union1d(a, b)
    table = np.array([[np.sum(x == i) for i in ids] for x in (a, b)], np.float64)
    rare = table.sum(axis=0) < 10
    if rare.any():
        table = np.concatenate([table[:, ~rare], table[:, rare].sum(axis=1, keepdims=True)], axis=1)
    if table.shape[1] < 2:
        return 1.0
    return stats.chi2_contingency(table).pvalue


def pvalues(plain: np.ndarray, mtp: np.ndarray) -> list[float]:
    return [same_distribution_pvalue(plain[:, i], mtp[:, i]) for i in range(TOKENS)]


def test_mtp_sampling_follows_plain_sampling(controlled, prompt):
    p = pvalues(draws(controlled, prompt, 2_000, 0), draws(controlled, prompt, 2_000, 2))
    assert min(p) > ALPHA, p


@pytest.mark.slow  # ~4 minutes: 3 runs of 20,000 rows
def test_mtp_sampling_follows_plain_sampling_over_20000_seeds_and_the_test_has_power(controlled, prompt,
                                                                                      monkeypatch):
    plain = draws(controlled, prompt, 20_000, 0)
    p = pvalues(plain, draws(controlled, prompt, 20_000, 2))
    assert min(p) > ALPHA, p
    monkeypatch.setattr(sampling, "_residual", lambda p_logp, q_logp: p_logp)
    jax.clear_caches()  # retrace the loop with the wrong residual
    p = pvalues(plain, draws(controlled, prompt, 20_000, 2))
    assert min(p) < 1e-6, p


@pytest.mark.parametrize("k", slow_except([0, 2], {2}))  # CI time: plain seeded draws also in test_sampling.py
def test_limits_equal_greedy_and_a_seeded_row_keeps_its_tokens_in_any_batch(controlled, prompt, k):
    other = np.random.default_rng(1).integers(0, controlled.cfg.vocab_size, 20).tolist()
    greedy = qmtp.generate(controlled, [prompt, other], max_new_tokens=8, stop_token_ids=[], mtp_k=k).tokens
    for limit in (dict(temperature=1e-4), dict(temperature=1.5, top_k=1)):
        got = qmtp.generate(controlled, [prompt, other], max_new_tokens=8, stop_token_ids=[], mtp_k=k, seed=3,
                            **limit).tokens
        assert got == greedy, limit
    alone = qmtp.generate(controlled, [prompt], max_new_tokens=8, stop_token_ids=[], mtp_k=k, seed=11,
                          **SAMPLED).tokens[0]
    batch = qmtp.generate(controlled, [other, prompt], max_new_tokens=8, stop_token_ids=[], mtp_k=k, seed=[5, 11],
                          **SAMPLED).tokens
    assert batch[1] == alone
    again = qmtp.generate(controlled, [prompt], max_new_tokens=8, stop_token_ids=[], mtp_k=k, seed=12,
                          **SAMPLED).tokens[0]
    assert again != alone  # another seed, other tokens (8 tokens at temperature 10)


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=-0.1), "temperature=-0.1 must be >= 0"), (dict(temperature=1.0, top_p=0.0), "top_p=0.0"),
    (dict(temperature=1.0, top_k=-1), "top_k=-1"), (dict(temperature=1.0, min_p=1.5), "min_p=1.5"),
    (dict(temperature=1.0, seed=-3), "seed=-3")])
def test_out_of_range_parameters_are_refused_by_name(controlled, prompt, kw, message):
    with pytest.raises(ValueError, match=message):
        qmtp.generate(controlled, [prompt], max_new_tokens=2, **kw)


@pytest.mark.slow  # CI time: test_tp_model.py's sampled logprobs case checks TP2's sampled MTP tokens == TP1's
def test_tp2_samples_the_tp1_tokens(controlled, prompt):
    """Under TP every shard gathers the vocabulary and draws the same numbers: a seeded prompt gets the
    TP1 tokens (float32; MTP K = 2: the drafts' and the target's draws; CI time: plain's are the same draws)."""
    assert len(jax.devices()) >= 2, "needs 2 devices (jax_num_cpu_devices=2 in conftest.py)"
    tp2 = qmtp.load(controlled.checkpoint_dir, dtype="float32", progress=False, tp=2)
    want = qmtp.generate(controlled, [prompt], max_new_tokens=8, stop_token_ids=[], mtp_k=2, seed=9, **SAMPLED)
    got = qmtp.generate(tp2, [prompt], max_new_tokens=8, stop_token_ids=[], mtp_k=2, seed=9, **SAMPLED)
    assert got.tokens == want.tokens
