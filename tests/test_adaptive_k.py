"""The draft length chosen per round (qmtp/runtime/adaptive_k.py): the expected tokens and the choice
against numpy on synthetic acceptance and cost tables, the per-position update, and in the decode loop
tokens equal to plain greedy decoding whichever K each round runs (batch 1..8, random and controlled
checkpoints), with every candidate run somewhere."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import qmtp
from qmtp.api import _new_state, _prompt_batch
from qmtp.runtime import adaptive_k, loop, prefill
from qmtp.runtime.kernel_config import REF
from qmtp.tools import make_checkpoint
from marks import slow_except
from tolerance import F32_MODEL, assert_close

KS = (0, 1, 3)
RNG = np.random.default_rng(4)
PROMPTS = [RNG.integers(0, 380, int(n)).tolist() for n in RNG.integers(3, 30, 8)]


def np_expected(ema, k):
    return 1.0 + sum(np.prod(ema[:j]) for j in range(1, k + 1))


def test_expected_tokens_and_choice_against_numpy():
    ema = RNG.uniform(0, 1, (5, loop.MAX_K)).astype(np.float32)
    got = np.asarray(adaptive_k.expected_tokens(jnp.asarray(ema), KS))
    want = np.array([[np_expected(row, k) for k in KS] for row in ema])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    cost = np.array([1.0, 1.3, 1.9], np.float32)
    live = np.array([1, 1, 0, 1, 0], np.int32)
    want_c = np.argmax((live[:, None] * want).sum(0) / cost)
    assert int(adaptive_k.choose(jnp.asarray(ema), jnp.asarray(live), KS, jnp.asarray(cost))) == want_c


@pytest.mark.parametrize("acceptance, cost, k", [
    (0.95, (1.0, 1.1, 1.3), 3),  # drafts land and cost little: the most
    (0.95, (1.0, 1.9, 4.1), 1),  # a K=3 round costs more than its two extra tokens
    (0.05, (1.0, 1.1, 1.3), 0),  # drafts miss: plain steps
    (0.60, (1.0, 1.5, 2.2), 1)])
def test_the_choice_follows_the_cost_model(acceptance, cost, k):
    ema = jnp.full((3, loop.MAX_K), acceptance, jnp.float32)
    c = adaptive_k.choose(ema, jnp.ones((3,), jnp.int32), KS, jnp.asarray(cost, jnp.float32))
    assert KS[int(c)] == k


def test_update_observes_only_reached_positions():
    ema = jnp.full((3, loop.MAX_K), 0.5, jnp.float32)
    out = np.asarray(adaptive_k.update(ema, jnp.asarray([1, 3, 0]), jnp.int32(3), jnp.asarray([1, 1, 0])))
    w = adaptive_k.EMA_WEIGHT
    hit, miss = 0.5 + w * 0.5, 0.5 - w * 0.5
    np.testing.assert_allclose(out[0], [hit, miss, 0.5, 0.5])  # draft 1 accepted, draft 2 rejected, 3 unseen
    np.testing.assert_allclose(out[1], [hit, hit, hit, 0.5])  # all 3 accepted; position 4 not drafted
    np.testing.assert_allclose(out[2], [0.5] * 4)  # not live


def test_an_unseen_position_is_estimated_as_the_one_before_until_observed():
    unseen = adaptive_k.UNSEEN
    ema = jnp.asarray([[unseen] * 4, [0.9, unseen, 0.3, unseen]], jnp.float32)
    p = adaptive_k.PRIOR
    np.testing.assert_allclose(np.asarray(adaptive_k.estimate(ema)), [[p] * 4, [0.9, 0.9, 0.3, 0.3]])
    out = np.asarray(adaptive_k.update(ema, jnp.asarray([1, 2]), jnp.int32(3), jnp.asarray([1, 1])))
    w = adaptive_k.EMA_WEIGHT
    np.testing.assert_allclose(out, [[p + w * (1 - p), p - w * p, unseen, unseen],  # draft 2 rejected: seen
                                     [0.9 + w * 0.1, 0.9 + w * 0.1, 0.3 - w * 0.3, unseen]], rtol=1e-6)


def test_first_drafts_that_land_lead_to_k3_within_a_few_rounds():
    """Every draft accepted, round costs of the 27B shapes at batch 32 (H100: 22.9 / 30.6 / 50.3 ms at K = 0 /
    1 / 3): a new request's first rounds run K=1 (its prior says so) until position 1's hits lift the
    deeper positions' estimates with it, after 2 rounds (a fixed guess at the unseen positions took 17)."""
    cost = jnp.asarray([0.0229, 0.0306, 0.0503], jnp.float32)
    ema, live, ks = jnp.full((32, loop.MAX_K), adaptive_k.UNSEEN, jnp.float32), jnp.ones((32,), jnp.int32), []
    for _ in range(6):
        k = KS[int(adaptive_k.choose(ema, live, KS, cost))]
        ks.append(k)
        ema = adaptive_k.update(ema, jnp.full((32,), k, jnp.int32), jnp.int32(max(k, 1)), live)
    assert ks == [1, 1, 3, 3, 3, 3]


@pytest.fixture(scope="module", params=["tiny", "tiny_controlled"])
def model(request, tmp_path_factory):
    path = make_checkpoint.write_checkpoint(str(tmp_path_factory.mktemp("ak") / "c"), request.param, "fp32", seed=6)
    return qmtp.load(path, dtype="float32", progress=False)


def adaptive_decode(model, prompts, max_new, cost):
    """prefill + the adaptive loop (K_max 3): (tokens per prompt, stats)."""
    b = len(prompts)
    state = _new_state(model, [len(p) + max_new + 4 for p in prompts])
    tokens, n_valid = _prompt_batch(prompts)
    first, slots, state = prefill.prefill(model.cfg, REF, True, model.params, state, tokens, n_valid,
                                       jnp.full((b,), max_new, jnp.int32), loop.stop_rows((), b))
    out, count, stats, _, _ = loop.decode(model.cfg, REF, 3, max_new, model.params, state, slots, adaptive_ks=KS,
                                          round_cost=jnp.asarray(cost, jnp.float32))
    out, count, first = np.asarray(out), np.asarray(count), np.asarray(first)
    return [[int(first[i])] + out[i, :count[i]].tolist() for i in range(b)], stats


@pytest.mark.parametrize("batch", slow_except([1, 8], {8}))  # CI time: batch 8's rows include what one row runs
def test_tokens_equal_plain_greedy_whatever_k_each_round_runs(model, batch):
    prompts = PROMPTS[:batch]
    want = qmtp.generate(model, prompts, max_new_tokens=12, stop_token_ids=[]).tokens
    used = np.zeros(len(KS), int)
    for cost in ((1.0, 1.5, 2.2), (1.0, 1.9, 4.1), (1.0, 1.05, 1.1)):
        got, stats = adaptive_decode(model, prompts, 12, cost)
        assert got == want, cost
        used += np.asarray(stats["k_rounds"])
    if batch == 8:
        assert (used > 0).sum() >= 2, used  # the rounds ran more than one K


def test_plain_steps_keep_the_drafts_right(tmp_path):
    """The controlled checkpoint's drafts are always right: a cost table that starts with plain steps
    (the prior acceptance does not pay for drafts) moves to K = 3 as the first drafts, checked in the
    plain steps, prove right; every draft then proposed is accepted, so the plain steps kept the MTP
    layer's KV and the next first draft up to date."""
    path = make_checkpoint.write_checkpoint(str(tmp_path / "c"), "tiny_controlled", "fp32", seed=6)
    model = qmtp.load(path, dtype="float32", progress=False)
    got, stats = adaptive_decode(model, PROMPTS[:4], 24, (1.0, 2.0, 3.0))
    assert got == qmtp.generate(model, PROMPTS[:4], max_new_tokens=24, stop_token_ids=[]).tokens
    rounds = np.asarray(stats["k_rounds"])
    assert rounds[0] > 0 and rounds[2] > 0, rounds
    assert np.asarray(stats["accepted"]).sum() == np.asarray(stats["drafted"]).sum() > 0


def test_generate_auto_times_each_k_and_keeps_the_tokens_and_logprobs(model):
    plain = qmtp.generate(model, PROMPTS[:3], max_new_tokens=10, logprobs=2)
    lines = []
    got = qmtp.generate(model, PROMPTS[:3], max_new_tokens=10, mtp_k="auto", progress=lines.append, logprobs=2)
    assert got.tokens == plain.tokens and got.stats["mtp_k"] == "auto"
    for row, want in zip(got.logprobs, plain.logprobs):  # the rounds' logits at whichever K ran
        assert [[i for i, _ in t.top] for t in row] == [[i for i, _ in t.top] for t in want]
        assert_close([t.logprob for t in row], [t.logprob for t in want], F32_MODEL, "logprobs")
    assert set(got.stats["k_rounds"]) == set(got.stats["round_cost_s"]) == set(adaptive_k.CANDIDATES)
    assert all(c > 0 for c in got.stats["round_cost_s"].values()) and sum(got.stats["k_rounds"].values()) > 0
    assert any(line.startswith("timing a round at K = 0, 1, 3") for line in lines), lines


@pytest.mark.parametrize("kw, message", [(dict(mtp_k="fast"), r"mtp_k='fast': an integer 0..4 or 'auto'"),
                                         (dict(mtp_k="auto", accept_cap=4), r"accept_cap: expected ints in \[0, 3\]")])
def test_generate_refuses_what_auto_cannot_do(model, kw, message):
    with pytest.raises(ValueError, match=message):
        qmtp.generate(model, PROMPTS[:1], max_new_tokens=2, **kw)
