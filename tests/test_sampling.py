"""qmtp/runtime/sampling.py: the processed distribution against a numpy reference written here, greedy
limits, seeded reproducibility, and the distributions of plain and speculative sampling by chi-square
over 20,000 seeded draws (p > 0.001), with the power check the speculative test needs: replacing the
residual norm(max(0, p - q)) by p must be rejected.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from qmtp.runtime import sampling
from qmtp.runtime.sampling import SamplingParams

DRAWS = 20_000
ALPHA = 1e-3


def params(b, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, presence=0.0, frequency=0.0) -> SamplingParams:
    full = lambda x, dt: jnp.broadcast_to(jnp.asarray(x, dt), (b,))  # noqa: E731
    seed = jnp.arange(b, dtype=jnp.uint32) if seed is None else full(seed, jnp.uint32)
    return SamplingParams(full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                          full(min_p, jnp.float32), seed, full(presence, jnp.float32), full(frequency, jnp.float32),
                          *unadjusted(b))


def unadjusted(b):
    """SamplingParams' last fields (logit bias, min_tokens, repetition penalty, allowed ids) of b rows without
    them."""
    return (jnp.full((b, sampling.MAX_LOGIT_BIAS), -1, jnp.int32), jnp.zeros((b, sampling.MAX_LOGIT_BIAS)),
            jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.float32), jnp.zeros((b,), bool))


def np_processed(z, temperature, top_k, top_p, min_p):
    """The module doc's order, one row, float64: a probability vector."""
    z = np.asarray(z, np.float64)
    if temperature == 0:
        out = np.zeros_like(z)
        out[np.argmax(z)] = 1.0
        return out
    z = z / temperature
    keep = np.ones(z.shape, bool)
    if top_k:
        keep &= z >= np.sort(z)[::-1][min(top_k, z.size) - 1]
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    kept = np.zeros(z.shape, bool)
    kept[order[before < top_p]] = True
    keep &= z >= z[kept].min()  # ties with the last kept are kept
    keep &= p >= min_p * p.max()
    out = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    return out / out.sum()


# a vocabulary of 40 sorts it; of 1000, a top_k <= SHORT_TOP_K takes the cut from `largest`
@pytest.mark.parametrize("vocab", [40, 1000])
@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.3, 0, 1.0, 0.1),
    (0.6, 20, 0.95, 0.05), (0.0, 0, 1.0, 0.0), (1.0, 1, 1.0, 0.0), (1.0, 64, 1.0, 0.0)])
def test_processed_distribution_matches_numpy(vocab, temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(0)
    z = rng.standard_normal((3, vocab)) * 2.0
    z[1, [3, 17]] = z[1].max() + 1.0  # a tie at the top
    z[2, 5:9] = np.sort(z[2])[-20]  # ties at the 20th largest
    got = np.exp(np.asarray(sampling.logprobs(jnp.asarray(z, jnp.float32),
                                              params(3, temperature, top_k, top_p, min_p)), np.float64))
    for row in range(3):
        want = np_processed(z[row], temperature, top_k, top_p, min_p)
        np.testing.assert_allclose(got[row], want, atol=1e-6, err_msg=f"row {row}")


def test_rows_that_cut_nothing_keep_every_id_beside_rows_with_a_short_top_k():
    """One batch: a greedy row, a row with top_k 20 (the cut taken from the largest logits), a row at
    temperature 0.9 alone (every id kept) and a row with top_k 30 and top_p 0.9."""
    z = np.random.default_rng(3).standard_normal((4, 700)) * 2.0
    rows = [(0.0, 0, 1.0), (0.6, 20, 1.0), (0.9, 0, 1.0), (1.0, 30, 0.9)]
    prm = SamplingParams(*(jnp.asarray(c, dt) for c, dt in zip(zip(*rows), (jnp.float32, jnp.int32, jnp.float32))),
                         jnp.zeros(4, jnp.float32), jnp.zeros(4, jnp.uint32), jnp.zeros(4), jnp.zeros(4),
                         *unadjusted(4))
    got = np.exp(np.asarray(sampling.logprobs(jnp.asarray(z, jnp.float32), prm), np.float64))
    for row, (t, k, p) in enumerate(rows):
        np.testing.assert_allclose(got[row], np_processed(z[row], t, k, p, 0.0), atol=1e-6, err_msg=f"row {row}")


@pytest.mark.parametrize("shape, k", [((3, 3000), 20), ((2, 4, 8300), 64), ((1, 128), 64), ((2, 300), 1)])
def test_largest_equals_the_head_of_a_sort(shape, k):
    rng = np.random.default_rng(4)
    z = rng.standard_normal(shape).astype(np.float32)
    rows = z.reshape(-1, shape[-1])  # a view
    spread = np.arange(min(k, shape[-1] // sampling.LARGEST_BLOCK)) * sampling.LARGEST_BLOCK + 7
    rows[:, spread] += 10.0  # the largest values each in its own block: every one of k blocks is needed
    rows[0, :40] = np.sort(rows[0])[-k]  # ties at the k-th value
    rows[-1, ::3] = -np.inf
    values, ids = sampling.largest(jnp.asarray(z), k)
    want_ids = np.argsort(-z, axis=-1, kind="stable")[..., :k]  # ties: the lower id first
    np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(z, want_ids, axis=-1))
    np.testing.assert_array_equal(np.asarray(ids), want_ids)


@pytest.mark.parametrize("k", [1, 20, 64])
def test_largest_equals_lax_top_k_where_most_values_tie(k):
    """Logits of five distinct values over 20,000 ids (and a row of one value): ties inside and across
    blocks and sub-blocks at every level, broken by the lower id as lax.top_k breaks them."""
    rng = np.random.default_rng(8)
    z = rng.integers(0, 5, (3, 20_000)).astype(np.float32)
    z[1] = 2.0
    values, ids = sampling.largest(jnp.asarray(z), k)
    want_values, want_ids = jax.lax.top_k(jnp.asarray(z), k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))


def test_largest_breaks_a_tie_across_blocks_by_the_lower_id():
    """k = 2 over two blocks: the higher block holds the largest value and a tie at the 2nd in another of
    its sub-blocks; the lower block's only value ties too, at a lower id, which must win."""
    z = np.full((1, 2 * sampling.LARGEST_BLOCK), -5.0, np.float32)
    z[0, 200], z[0, 230], z[0, 3] = 10.0, 5.0, 5.0
    values, ids = sampling.largest(jnp.asarray(z), 2)
    assert np.asarray(ids).tolist() == [[200, 3]] and np.asarray(values).tolist() == [[10.0, 5.0]]


def test_rows_keep_their_own_parameters_and_greedy_rows_their_token():
    z = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 30)), jnp.float32)  # [B, positions, V]
    p = SamplingParams(jnp.array([0.0, 0.8]), jnp.array([0, 3]), jnp.array([1.0, 1.0]), jnp.array([0.0, 0.0]),
                       jnp.array([0, 0], jnp.uint32), jnp.zeros(2), jnp.zeros(2), *unadjusted(2))
    lp = np.asarray(sampling.logprobs(z, p))
    assert np.all((lp[0] == 0) == (np.arange(30) == np.asarray(jnp.argmax(z[0], -1))[:, None]))
    assert np.all(np.sum(np.isfinite(lp[1]), axis=-1) == 3)


def test_temperature_zero_and_top_k_one_give_the_argmax_for_every_seed():
    z = jnp.asarray(np.random.default_rng(2).standard_normal((64, 50)), jnp.float32)
    want = np.asarray(jnp.argmax(z, -1))
    for prm in (params(64, temperature=0.0), params(64, temperature=1.5, top_k=1)):
        got = sampling.sample(sampling.logprobs(z, prm), prm.seed, jnp.arange(64, dtype=jnp.int32))
        np.testing.assert_array_equal(np.asarray(got), want)


def test_a_seeded_draw_depends_on_seed_and_position_alone():
    z = jnp.asarray(np.random.default_rng(3).standard_normal((1, 1000)), jnp.float32)
    prm = params(1, seed=7)
    lp = sampling.logprobs(z, prm)
    alone = sampling.sample(lp, prm.seed, jnp.array([5]))
    other = jnp.asarray(np.random.default_rng(4).standard_normal((1, 1000)), jnp.float32)
    batch = sampling.sample(jnp.concatenate([sampling.logprobs(other, prm), lp]), jnp.array([9, 7], jnp.uint32),
                            jnp.array([2, 5]))
    assert int(batch[1]) == int(alone[0])
    draws = {int(sampling.sample(lp, prm.seed, jnp.array([p]))[0]) for p in range(20)}
    assert len(draws) > 5  # positions draw different numbers


def chi2_pvalue(tokens: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square of the counts of tokens against probs (ids of expected count < 5 pooled)."""
    counts = np.bincount(tokens, minlength=probs.size).astype(np.float64)
    expected = probs * tokens.size
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        assert counts[-1] == 0
        counts, expected = counts[:-1], expected[:-1]
    return stats.chisquare(counts, expected).pvalue


def test_plain_sampling_follows_the_processed_distribution():
    z = np.random.default_rng(5).standard_normal(12) * 1.5
    prm = params(DRAWS, temperature=0.8, top_p=0.9)
    lp = sampling.logprobs(jnp.broadcast_to(jnp.asarray(z, jnp.float32), (DRAWS, 12)), prm)
    tokens = np.asarray(sampling.sample(lp, prm.seed, jnp.zeros(DRAWS, jnp.int32)))
    assert chi2_pvalue(tokens, np_processed(z, 0.8, 0, 0.9, 0.0)) > ALPHA


def speculative_tokens(p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DRAWS rounds (one seed each) with the context-free targets p [K+1, V] and drafts q [K, V]: the
    drafts drawn from q, then speculative_accept. Returns (accepted a, the emitted tokens [DRAWS, K+1],
    -1 past the round's a + 1)."""
    k, v = q.shape
    seed, base = jnp.arange(DRAWS, dtype=jnp.uint32), jnp.zeros(DRAWS, jnp.int32)
    q_logp = jnp.broadcast_to(jnp.log(jnp.asarray(q, jnp.float32)), (DRAWS, k, v))
    p_logp = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (DRAWS, k + 1, v))
    pos = base[:, None] + 1 + jnp.arange(k)[None]
    g = jax.vmap(jax.vmap(lambda kk: jax.random.gumbel(kk, (v,), jnp.float32)))(
        sampling.keys(seed, pos, sampling.DRAFT))
    drafts = jnp.argmax(q_logp + g, axis=-1).astype(jnp.int32)  # [DRAWS, K] ~ q
    a, last = jax.jit(sampling.speculative_accept)(p_logp, q_logp, drafts, seed, base)
    a, last, drafts = map(np.asarray, (a, last, drafts))
    emitted = np.full((DRAWS, k + 1), -1)
    for i in range(k + 1):
        emitted[:, i] = np.where(i < a, drafts[:, min(i, k - 1)], np.where(i == a, last, -1))
    return a, emitted


def peaked_pair(k: int, v: int = 8, seed: int = 6):
    """Targets p and drafts q that differ (a draft head half right): p_i, q_i [V]."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(v, 0.7), k + 1)
    q = 0.5 * p[:k] + 0.5 * rng.dirichlet(np.full(v, 0.3), k)
    return p, q


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_sampling_emits_the_target_distribution(k):
    """Token 1 of a round follows p_0; token i + 1, when the round emits it, follows p_i."""
    p, q = peaked_pair(k)
    a, emitted = speculative_tokens(p, q)
    assert 0 < a.mean() < k  # drafts are accepted and rejected
    for i in range(k + 1):
        got = emitted[:, i][emitted[:, i] >= 0]
        assert got.size > 1000, (i, got.size)
        assert chi2_pvalue(got, p[i]) > ALPHA, f"token {i + 1}"


def test_the_distribution_test_rejects_a_residual_of_p(monkeypatch):
    """Power check: drawing the token after a rejection from p instead of norm(max(0, p - q)) skews
    token 1 towards what q under-proposes; the chi-square above must see it."""
    monkeypatch.setattr(sampling, "_residual", lambda p_logp, q_logp: p_logp)
    jax.clear_caches()  # the speculative step traced above must be traced again with the fault
    p, q = peaked_pair(1)
    _, emitted = speculative_tokens(p, q)
    assert chi2_pvalue(emitted[:, 0], p[0]) < 1e-6


@pytest.mark.parametrize("q", ["drafts", "zeros", "other ids", "random"])
def test_greedy_rows_take_the_exact_match_rule_whatever_q_holds(q):
    """One-hot p (temperature 0): a = the leading drafts equal to p's argmax, then p's token, with q one-hot
    at the drafts and with any other log-probabilities (greedy rounds leave Slots.q1 stale: a greedy row
    must not depend on it)."""
    v = 10
    target = np.array([[4, 2, 7, 1], [4, 2, 7, 1], [5, 5, 5, 5]])  # argmax of p at the K+1 positions
    drafts = np.array([[4, 2, 7], [4, 3, 7], [1, 5, 5]])
    one_hot = lambda ids: jnp.where(jnp.arange(v) == jnp.asarray(ids)[..., None], 0.0, -jnp.inf)  # noqa: E731
    q_logp = {"drafts": lambda: one_hot(drafts), "zeros": lambda: jnp.zeros((3, 3, v)),
              "other ids": lambda: one_hot((drafts + 1) % v),
              "random": lambda: jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (3, 3, v)))}[q]()
    a, last = sampling.speculative_accept(one_hot(target), q_logp, jnp.asarray(drafts, jnp.int32),
                                          jnp.arange(3, dtype=jnp.uint32), jnp.zeros(3, jnp.int32))
    np.testing.assert_array_equal(np.asarray(a), [3, 1, 0])
    np.testing.assert_array_equal(np.asarray(last), [1, 2, 5])
