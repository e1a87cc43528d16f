"""Logit bias, presence and frequency penalties (qmtp/runtime/sampling.py, the OpenAI API's), the
repetition penalty (HF's and vLLM's) and min_tokens (vLLM's): the adjusted logits at each position of a
verify pass against counts made here, a bias that bans or forces a token (plain and MTP), and greedy
decoding with penalties or min_tokens on the demo model
(float32): each token the argmax of the teacher-forced logits (qmtp.target_logits, another program than
the decode loop) adjusted in numpy for the tokens generated before it, and MTP K = 1 and 3 giving plain
decoding's tokens (tests/test_engine_sampling.py: adjusted requests beside others in the engine).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import qmtp
from qmtp import api, sampling_args
from qmtp.runtime import sampling
from qmtp.runtime.sampling import SamplingParams

PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:\n    def"]
NEW = 24
# a negative presence penalty makes the demo repeat a token within a round, where the counts of the drafts
# before a position matter (leaving them out parts MTP from plain at K = 3)
# (a repetition penalty below 1 favours the ids seen, which the order of the adjustments then decides)
PENALTIES = [dict(presence_penalty=2.0), dict(presence_penalty=-2.0), dict(presence_penalty=-1.0,
                                                                           frequency_penalty=1.5),
             dict(repetition_penalty=1.5), dict(repetition_penalty=0.7, presence_penalty=0.4)]


def params(presence, frequency, bias=None, temperature=0.0, min_tokens=0, repetition=1.0,
           only_listed=False) -> SamplingParams:
    """Greedy rows with these penalties [B], logit biases (a {id: bias} per row; None: none), min_tokens,
    repetition penalties and whether only the biased ids are allowed."""
    b = len(presence)
    full = lambda x, dt: jnp.broadcast_to(jnp.asarray(x, dt), (b,))  # noqa: E731
    ids, values = zip(*(sampling_args.logit_bias_row(row) for row in (bias or [None] * b)))
    return SamplingParams(full(temperature, jnp.float32), full(0, jnp.int32), full(1.0, jnp.float32),
                          full(0.0, jnp.float32), jnp.arange(b, dtype=jnp.uint32), jnp.asarray(presence, jnp.float32),
                          jnp.asarray(frequency, jnp.float32), jnp.asarray(np.stack(ids)),
                          jnp.asarray(np.stack(values)), full(min_tokens, jnp.int32),
                          jnp.broadcast_to(jnp.asarray(repetition, jnp.float32), (b,)),
                          jnp.broadcast_to(jnp.asarray(only_listed), (b,)))


def np_penalized(z, generated, presence, frequency, repetition=1.0, prompt=()):
    """z [V] after the ids `generated` of a prompt of ids `prompt` (vLLM's formulas, float64): the repetition
    penalty on the ids of both, then the OpenAI API's penalties on those generated."""
    c = np.bincount(np.asarray(generated, np.int64), minlength=z.size).astype(np.float64)
    z = np.asarray(z, np.float64)
    seen = (c > 0) | np.isin(np.arange(z.size), np.asarray(prompt, np.int64))
    z = np.where(seen, np.where(z > 0, z / repetition, z * repetition), z)
    return z - frequency * c - presence * (c > 0)


def test_each_position_of_a_verify_pass_counts_the_drafts_before_it():
    rng = np.random.default_rng(0)
    b, k, v = 2, 3, 11
    z = rng.standard_normal((b, k + 1, v)).astype(np.float32)
    counts = rng.integers(0, 3, (b, v)).astype(np.int32)
    drafts = np.array([[4, 4, 7], [1, 2, 3]], np.int32)  # a repeated draft, and ids already counted
    prm = params([0.7, 0.0], [0.3, 0.0], [{2: 5.0, 9: -1.5}, None])  # row 1 without adjustments
    got = np.asarray(sampling.penalize(jnp.asarray(z), prm, jnp.asarray(counts), jnp.asarray(drafts)))
    bias = np.zeros(v)
    bias[2], bias[9] = 5.0, -1.5
    for i in range(k + 1):
        before = np.repeat(np.arange(v), counts[0]).tolist() + drafts[0, :i].tolist()
        np.testing.assert_allclose(got[0, i], np_penalized(z[0, i] + bias, before, 0.7, 0.3), atol=1e-6,
                                   err_msg=f"{i}")
    np.testing.assert_array_equal(got[1], z[1])  # bit for bit
    one = np.asarray(sampling.penalize(jnp.asarray(z[:, 0]), prm, jnp.asarray(counts)))  # one position
    np.testing.assert_array_equal(one, got[:, 0])
    # one position after the drafts (an MTP draft step's q): the verify's last position's counts
    last = np.asarray(sampling.penalize(jnp.asarray(z[:, k]), prm, jnp.asarray(counts), jnp.asarray(drafts)))
    np.testing.assert_array_equal(last, got[:, k])


def test_the_repetition_penalty_counts_the_prompt_and_the_ids_before_each_position():
    rng = np.random.default_rng(3)
    b, k, v = 2, 3, 13
    z = (3 * rng.standard_normal((b, k + 1, v))).astype(np.float32)
    counts = np.zeros((b, v), np.int32)
    counts[:, [1, 6]] = [[1, 2]]
    drafts = np.array([[4, 4, 9], [0, 2, 3]], np.int32)
    prompts = [[2, 3, 3, 11], [5]]
    in_prompt = np.asarray(sampling.prompt_mask(jnp.asarray([[2, 3, 3, 11], [5, 7, 7, 7]]), jnp.asarray([4, 1]), v))
    np.testing.assert_array_equal(in_prompt, np.isin(np.arange(v), prompts[0]) & [[True], [False]]
                                  | np.isin(np.arange(v), prompts[1]) & [[False], [True]])
    prm = params([0.5, 0.0], [0.2, 0.0], [{4: 1.0}, None], repetition=[1.3, 0.6])
    got = np.asarray(sampling.penalize(jnp.asarray(z), prm, jnp.asarray(counts), jnp.asarray(drafts),
                                       in_prompt=jnp.asarray(in_prompt)))
    bias = np.zeros(v)
    bias[4] = 1.0
    for row, (presence, frequency, r) in enumerate([(0.5, 0.2, 1.3), (0.0, 0.0, 0.6)]):
        for i in range(k + 1):
            before = np.repeat(np.arange(v), counts[row]).tolist() + drafts[row, :i].tolist()
            want = np_penalized(z[row, i] + bias * (row == 0), before, presence, frequency, r, prompts[row])
            np.testing.assert_allclose(got[row, i], want, rtol=1e-6, atol=1e-6, err_msg=f"{row}, {i}")
    # the first token: the prompt's ids alone
    first = np.asarray(sampling.penalize(jnp.asarray(z[:, 0]), prm, None, in_prompt=jnp.asarray(in_prompt)))
    np.testing.assert_allclose(first[1], np_penalized(z[1, 0], [], 0.0, 0.0, 0.6, prompts[1]), rtol=1e-6)


def test_allowed_ids_leave_every_other_id_at_minus_infinity():
    z = np.random.default_rng(4).standard_normal((2, 3, 9)).astype(np.float32)  # [B, K+1, V]
    bias = {2: 0.0, 5: 1.5}  # allowed: 2 and 5, one biased
    got = np.asarray(sampling.penalize(jnp.asarray(z), params([0.0, 0.0], [0.0, 0.0], [bias, bias],
                                                              only_listed=[True, False]), None))
    want = np.full_like(z[0], -np.inf)
    want[:, 2], want[:, 5] = z[0, :, 2], z[0, :, 5] + 1.5
    np.testing.assert_array_equal(got[0], want)
    np.testing.assert_array_equal(got[1], z[1] + np.where(np.arange(9) == 5, 1.5, 0.0).astype(np.float32))  # bias only
    assert sampling_args.allowed_bias([5, 2, 5], {5: 1.5, 7: -3.0}) == {5: 1.5, 2: 0.0}  # 7: not allowed anyway


def test_min_tokens_holds_back_the_stop_ids_at_each_position_before_it():
    rng = np.random.default_rng(2)
    b, k, v = 3, 3, 11
    z = rng.standard_normal((b, k + 1, v)).astype(np.float32)
    counts = np.zeros((b, v), np.int32)
    counts[:, 5] = 2  # two tokens generated: position i follows 2 + i of them
    drafts = np.array([[1, 2, 3]] * b, np.int32)
    stop = np.array([[4, 9, -1]] * b, np.int32)
    prm = params([0.0] * b, [0.0] * b, min_tokens=[4, 0, 2])  # 4: positions 0, 1 held back; 0 and 2: none
    got = np.asarray(sampling.penalize(jnp.asarray(z), prm, jnp.asarray(counts), jnp.asarray(drafts),
                                       jnp.asarray(stop)))
    want = z.copy()
    want[0, :2, 4] = want[0, :2, 9] = -np.inf
    np.testing.assert_array_equal(got, want)
    # the first token (nothing generated yet): held back wherever min_tokens > 0
    first = np.asarray(sampling.penalize(jnp.asarray(z[:, 0]), prm, None, stop=jnp.asarray(stop)))
    want = z[:, 0].copy()
    want[[0, 2], 4] = want[[0, 2], 9] = -np.inf
    np.testing.assert_array_equal(first, want)


def test_no_penalties_leave_the_logits_and_counting_adds_the_first_n_tokens():
    z = jnp.asarray(np.random.default_rng(1).standard_normal((2, 9)), jnp.float32)
    counts = jnp.ones((2, 9), jnp.int32)
    np.testing.assert_array_equal(np.asarray(sampling.penalize(z, params([0.0, 0.0], [0.0, 0.0]), counts)), z)
    got = sampling.count_tokens(jnp.zeros((2, 9), jnp.int32), jnp.asarray([[3, 3, 5], [8, -1, -1]]),
                                jnp.asarray([2, 1]))
    want = np.zeros((2, 9), np.int32)
    want[0, 3], want[1, 8] = 2, 1
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.fixture(scope="module")
def demo():
    return qmtp.load("models/qmtp-demo", dtype="float32", progress=False)


@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_greedy_with_penalties_is_the_penalized_argmax_and_mtp_keeps_it(demo, penalty):
    ids = api.encode(demo, PROMPTS)
    plain = qmtp.generate(demo, PROMPTS, max_new_tokens=NEW, stop_token_ids=[], **penalty).tokens
    presence, frequency = penalty.get("presence_penalty", 0.0), penalty.get("frequency_penalty", 0.0)
    repetition = penalty.get("repetition_penalty", 1.0)
    changed = 0  # tokens other than the unpenalized argmax
    for prompt, out in zip(ids, plain):
        logits = qmtp.target_logits(demo, prompt + out)  # [T, V]: position t predicts token t + 1
        for i, token in enumerate(out):
            z = logits[len(prompt) - 1 + i]
            want = np_penalized(z, out[:i], presence, frequency, repetition, prompt)
            assert token == int(np.argmax(want)), (prompt, i)
            changed += token != int(np.argmax(z))
    assert changed  # the penalties decide some tokens
    for k in (1, 3):
        assert qmtp.generate(demo, PROMPTS, max_new_tokens=NEW, stop_token_ids=[], mtp_k=k, **penalty).tokens == plain


def test_greedy_among_allowed_ids_is_their_argmax_and_mtp_keeps_it(demo):
    ids = api.encode(demo, PROMPTS)
    plain = qmtp.generate(demo, PROMPTS, max_new_tokens=NEW, stop_token_ids=[]).tokens
    allowed = sorted(set(plain[0][:3]) | {11, 200, 3000})  # some the model picks, some it would not
    got = qmtp.generate(demo, PROMPTS, max_new_tokens=NEW, stop_token_ids=[], allowed_token_ids=allowed).tokens
    assert got != plain
    for prompt, out in zip(ids, got):
        logits = qmtp.target_logits(demo, prompt + out)
        assert out == [allowed[int(np.argmax(logits[len(prompt) - 1 + i][allowed]))] for i in range(NEW)]
    assert qmtp.generate(demo, PROMPTS, max_new_tokens=NEW, stop_token_ids=[], mtp_k=3,
                         allowed_token_ids=allowed).tokens == got


@pytest.mark.parametrize("k", [0, 3])
def test_a_logit_bias_bans_or_forces_a_token(demo, k):
    ids = api.encode(demo, PROMPTS)
    plain = qmtp.generate(demo, PROMPTS, max_new_tokens=NEW, stop_token_ids=[]).tokens
    common = max(set(sum(plain, [])), key=sum(plain, []).count)  # the most frequent generated token
    banned = qmtp.generate(demo, PROMPTS, max_new_tokens=NEW, stop_token_ids=[], mtp_k=k,
                           logit_bias={common: -100.0}).tokens
    assert all(common not in out for out in banned)
    for prompt, out in zip(ids, banned):  # each token the argmax of the biased teacher-forced logits
        logits = qmtp.target_logits(demo, prompt + out)
        assert out == [int(np.argmax(logits[len(prompt) - 1 + i] + np.where(np.arange(logits.shape[1]) == common,
                                                                              -100.0, 0.0))) for i in range(NEW)]
    forced = qmtp.generate(demo, PROMPTS, max_new_tokens=NEW, stop_token_ids=[], mtp_k=k, logit_bias={7: 100.0})
    assert forced.tokens == [[7] * NEW] * len(PROMPTS)


def test_min_tokens_holds_back_the_stop_ids_and_mtp_keeps_the_tokens(demo):
    """The first prompt's second greedy token made the stop id ends it early; with min_tokens it goes on,
    each token (every prompt's) the argmax of the teacher-forced logits with the stop id at -inf before
    min_tokens tokens, until the stop id after them. Sampled (MTP K = 3) too: no stop id before min_tokens
    tokens. (One stop id and NEW tokens, as the tests above: their compiled programs serve.)"""
    ids = api.encode(demo, PROMPTS)
    stop = qmtp.generate(demo, PROMPTS, max_new_tokens=NEW, stop_token_ids=[]).tokens[0][1]
    low = 8

    def run(**kw):
        return qmtp.generate(demo, PROMPTS, max_new_tokens=NEW, stop_token_ids=[stop], **kw).tokens

    assert len(run()[0]) <= 2
    held = run(min_tokens=low)
    assert len(held[0]) > low
    for prompt, out in zip(ids, held):
        assert len(out) >= low and stop not in out[:-1], out
        # padded to NEW tokens (the positions read do not see the padding): one program for every prompt
        logits = qmtp.target_logits(demo, prompt + out + [0] * (NEW - len(out)))
        for i, token in enumerate(out):
            z = logits[len(prompt) - 1 + i].copy()
            if i < low:
                z[stop] = -np.inf
            assert token == int(np.argmax(z)), (prompt, i)
    for k in (1, 3):
        assert run(min_tokens=low, mtp_k=k) == held
    for out in run(min_tokens=low, mtp_k=3, temperature=1.0, seed=0):
        assert len(out) >= low and stop not in out[:low], out
    with pytest.raises(ValueError, match=r"^min_tokens=25 must be <= max_new_tokens=24"):
        run(min_tokens=NEW + 1)


def test_out_of_range_adjustments_name_their_parameter():
    for name in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(ValueError, match=f"^{name}=2.5 must be in"):
            qmtp.sampling_params(1, **{name: 2.5})
    with pytest.raises(ValueError, match=r"^logit_bias=-101.0 \(token 3\) must be in \[-100, 100\]"):
        qmtp.sampling_params(1, logit_bias={3: -101.0})
    with pytest.raises(ValueError, match=r"^logit_bias=500: a token id must be in \[0, 500\)"):
        qmtp.sampling_params(1, logit_bias={500: 1.0}, vocab_size=500)
    with pytest.raises(ValueError, match=f"^logit_bias=301 ids: at most {sampling.MAX_LOGIT_BIAS}"):
        qmtp.sampling_params(1, logit_bias=dict.fromkeys(range(301), 1.0))
    with pytest.raises(ValueError, match=r"^min_tokens=-1 must be an integer >= 0"):
        qmtp.sampling_params(1, min_tokens=-1)
    with pytest.raises(ValueError, match=r"^allowed_token_ids=0 ids: from 1 to 300"):
        qmtp.sampling_params(1, allowed_token_ids=[])
    with pytest.raises(ValueError, match=r"^allowed_token_ids=500: a token id must be an integer in \[0, 500\)"):
        qmtp.sampling_params(1, allowed_token_ids=[3, 500], vocab_size=500)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=rf"^repetition_penalty={bad} must be > 0 \(1: off\)"):
            qmtp.sampling_params(1, repetition_penalty=bad)
