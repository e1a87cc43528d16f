"""Acceptance profiles for benchmarks: a seeded schedule of per-round caps on the accepted drafts.

A controlled checkpoint accepts every draft; capping the accepted length per round (qmtp.runtime.loop.decode's
accept_cap) makes it accept as a real model would, at a chosen cumulative per-position profile,
without changing a single token.
"""

from __future__ import annotations

import numpy as np

# Candidate offsets per sequence that `acceptance_schedule` scores, and the shortest prefix it scores
SCHEDULE_OFFSET_CANDIDATES = 64
SCHEDULE_MIN_PREFIX = 8
SCHEDULE_SCORED_ROUNDS = 1024  # prefixes scored: a longer run is near the profile with any offset


def acceptance_schedule(profile, k: int, rounds: int, batch: int, seed: int = 0):
    """A seeded cap schedule [rounds, batch] reproducing a cumulative per-position acceptance profile.

    profile[i] = P(accepted length >= i + 1), non-increasing in [0, 1] (e.g. 0.85, 0.70, 0.57); positions
    past the profile get 0. Round j of sequence b gets u = frac(o_b + j * g), g = (sqrt(5) - 1) / 2
    (a golden-ratio sequence), and caps the accepted drafts at #{i : u < profile[i]}: one u per round
    keeps the positions nested. Over many rounds P(cap >= i + 1) = profile[i], as with independent
    uniform draws, and a run uses only its first rounds (about max_new_tokens / accepted length of
    them), so the offset o_b matters: of SCHEDULE_OFFSET_CANDIDATES seeded candidates, each sequence
    takes the one whose prefixes (from SCHEDULE_MIN_PREFIX rounds on) stray least from the profile,
    counted in rounds, max over prefixes and positions. A random offset left a 42-round K=3
    run at 0.81 / 0.67 / 0.55 for a profile of 0.85 / 0.70 / 0.57 (accepted length 3.02 instead of
    3.12); independent draws, before that, at 0.47 for 0.57. Capping never changes greedy tokens."""
    p = np.zeros(k)
    given = np.asarray(profile, np.float64)[:k]
    p[:len(given)] = given
    if (p < 0).any() or (p > 1).any() or (np.diff(p) > 0).any():
        raise ValueError(f"acceptance profile {list(profile)}: expected non-increasing values in [0, 1]")
    offsets = np.random.default_rng(seed).random((batch, SCHEDULE_OFFSET_CANDIDATES))  # [batch, C]
    steps = np.arange(rounds) * ((5 ** 0.5 - 1) / 2)  # [rounds]
    scored = min(rounds, SCHEDULE_SCORED_ROUNDS)
    n = np.arange(1, scored + 1)[:, None]  # prefix lengths
    first = min(SCHEDULE_MIN_PREFIX, scored) - 1
    best = np.empty(batch)
    for b in range(batch):  # one sequence at a time: [C, scored, k] stays a few MB
        hits = np.mod(offsets[b, :, None] + steps[:scored], 1.0)[..., None] < p  # cap >= i + 1
        stray = np.abs(np.cumsum(hits, axis=1) - n * p)[:, first:]  # [C, prefixes, k] in rounds
        best[b] = offsets[b, stray.max(axis=(1, 2)).argmin()]
    u = np.mod(best[None, :] + steps[:, None], 1.0)  # [rounds, batch]
    return (u[..., None] < p).sum(-1).astype(np.int32)
