"""The draft length chosen per round on the device, from each request's recent acceptance and the cost
of a round at each candidate K.

Each row keeps an exponential average of its drafts' acceptance per position, ema [B, MAX_K]: the
chance that draft i is accepted given drafts 1 .. i-1 were (a position is only observed when every
draft before it was accepted). A new request starts with every position UNSEEN. Until it is
observed, a position is estimated as the one before it (position 1 as PRIOR), and its first
observation moves that estimate: rounds of few drafts never observe the deeper positions, and a fixed
guess there kept rows whose first drafts all landed at K=1 for 17 rounds (H100, 27B shapes, batch 32,
a K=3 round 1.65x a K=1 round), where following position 1 takes 2. With that estimate a_{b,i},
candidates K_c and the measured seconds of a round at each, round_cost [C], a round chooses

    c* = argmax_c  sum_b live_b * E_b(K_c) / round_cost_c,   E_b(K) = 1 + sum_{j=1..K} prod_{i<=j} a_{b,i}

(E_b: the tokens row b is expected to emit, the bonus token included). The cost does not depend on how
many rows are live: done rows ride along in every launch. K = 0 is a plain step; it still refreshes
the MTP layer and drafts the next first draft, so position 1 is observed there too (that draft against
the token the step emits) and a request whose drafts become good again gets them back. Which K runs
changes only how many drafts are proposed, never the tokens: greedy output stays plain greedy's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

CANDIDATES = (0, 1, 3)  # mtp_k="auto": few candidates keep the loop's program small (every one is in it)
PRIOR = 0.75  # a new request's acceptance estimate at position 1: optimistic, so drafts get tried
UNSEEN = -1.0  # ema of a position not observed yet in the row's request
EMA_WEIGHT = 0.125  # weight of one observation (~ the last 8 observed rounds count)


def estimate(ema: jax.Array) -> jax.Array:
    """a [B, MAX_K]: ema where observed; an unseen position the estimate of the one before (PRIOR at 1)."""
    before, out = jnp.full(ema.shape[:1], PRIOR, ema.dtype), []
    for i in range(ema.shape[1]):
        before = jnp.where(ema[:, i] == UNSEEN, before, ema[:, i])
        out.append(before)
    return jnp.stack(out, axis=1)


def expected_tokens(ema: jax.Array, ks: tuple[int, ...]) -> jax.Array:
    """E_b(K_c) [B, C] for acceptance averages ema [B, MAX_K] (UNSEEN where not observed) and candidates ks."""
    reach = jnp.cumprod(estimate(ema), axis=1)  # [B, MAX_K]: P(drafts 1 .. j all accepted)
    reached = jnp.concatenate([jnp.zeros_like(reach[:, :1]), jnp.cumsum(reach, axis=1)], axis=1)  # [B, MAX_K+1]
    return 1.0 + reached[:, jnp.asarray(ks)]


def choose(ema: jax.Array, live: jax.Array, ks: tuple[int, ...], round_cost: jax.Array) -> jax.Array:
    """The index c* (int32 []) of the candidate with the most expected tokens per second over the live
    rows live [B] (0/1); round_cost [C] seconds per round at each candidate."""
    tokens = jnp.sum(live[:, None] * expected_tokens(ema, ks), axis=0)  # [C]
    return jnp.argmax(tokens / round_cost).astype(jnp.int32)


def forcing(c: int) -> np.ndarray:
    """Round costs [C] under which `choose` picks candidate c whatever the acceptance (every other one
    costs 1e9 s): how a round at one K is timed in the program that serving runs."""
    costs = np.full(len(CANDIDATES), 1e9, np.float32)
    costs[c] = 1.0
    return costs


def update(ema: jax.Array, accepted: jax.Array, k: jax.Array, live: jax.Array) -> jax.Array:
    """ema after a round of k drafts (int32 []) that accepted accepted [B] of them: position i (0-based)
    was observed when i < k and every draft before it was accepted (i <= accepted), a hit when
    i < accepted; an UNSEEN one moves from its estimate. Rows not live keep theirs."""
    i = jnp.arange(ema.shape[1])[None]
    observed = (i < k) & (i <= accepted[:, None]) & live[:, None].astype(bool)
    hit = (i < accepted[:, None]).astype(ema.dtype)
    start = jnp.where(ema == UNSEEN, estimate(ema), ema)
    return jnp.where(observed, start + EMA_WEIGHT * (hit - start), ema)
