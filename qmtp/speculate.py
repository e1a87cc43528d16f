"""Greedy MTP speculative decoding: the whole generation is one `lax.while_loop` on the device.

One round, for a sequence whose target has consumed positions < L and whose pending token is t_L
(ARCHITECTURE.md "The speculative round"):
  1. draft   d_1 comes from the previous round (or the MTP prefill); d_2..d_K from K-1 MTP steps at
             positions L .. L+K-2, each fed the previous draft and the previous post-mtp.norm hidden;
  2. verify  one target pass over [t_L, d_1 .. d_K] at positions L .. L+K -> argmaxes g_0 .. g_K;
  3. accept  a = leading i with d_{i+1} == g_i (optionally capped by a schedule); bonus = g_a;
  4. commit  lengths += a+1; with slotted GDN/conv state (ops.GDN_STATE_SLOTS) the verify pass wrote
             the state after each of its tokens to its own slot and the read slot moves a+1 slots on;
             otherwise the state is rebuilt after a+1 tokens from the verify replay (model.commit_gdn),
             or, when every live row kept all K+1 tokens, the verify pass's own state is taken as is
             (SKIP_FULL_COMMIT); attention KV past L+a is stale and masked by length;
             the MTP KV at L .. L+a is refreshed from the target hiddens h_L .. h_{L+a} with the
             shifted tokens (d_1 .. d_a, bonus) = (g_0 .. g_a), whose output at L+a gives the next d_1;
  5. emit    g_0 .. g_a (= d_1 .. d_a, bonus), clipped at a stop id and max_new_tokens.
Greedy output equals plain greedy decoding token for token (tests pin it down).

Two loops share the round (`_round`):
  spec_loop    a whole generation from `prefill` (static stop ids, output width max_tokens);
  spec_rounds  at most N rounds resumed from a carried `decode.Slots` (pending t_L, d1, MTP hidden,
               remaining budget, per-slot stop ids, done), for the serving engine: between calls the
               host inserts new requests into free slots and retires finished ones (qmtp.slots).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import gdn_conv
from qmtp import decode, model, mtp, ops, state as state_lib
from qmtp.config import ModelConfig
from qmtp.state import DecodeState

MAX_K = 4
# True: a round whose live rows all kept every verified token takes the verify pass's GDN/conv state
# instead of rebuilding it (model.commit_gdn would re-run the same kernels over the same inputs): every
# round at natural acceptance with the controlled checkpoint, 57% of rounds at the 0.85 / 0.70 / 0.57
# profile. The price is one lax.cond per round. Measured at the 27B shapes (H200, session 8, bf16 draft
# head, against session 7's run without it): +1.7% tok/s at natural acceptance, no change at the
# profile; in the round's trace a rebuild is 48 kernels of ~8 us. False: every round rebuilds.
SKIP_FULL_COMMIT = True


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static shape of a speculative loop."""

    k: int  # drafts per round, 1..MAX_K
    max_tokens: int  # output buffer width (>= every max_new_tokens)
    stop_ids: tuple[int, ...]

    def __post_init__(self):
        if not 1 <= self.k <= MAX_K:
            raise ValueError(f"mtp_k={self.k}: supported 1..{MAX_K} (0 = plain decoding)")


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
    counted in rounds, max over prefixes and positions. A random offset left session 6's 42-round K=3
    run at 0.81 / 0.67 / 0.55 for a profile of 0.85 / 0.70 / 0.57 (accepted length 3.02 instead of
    3.12); independent draws, before that, at 0.47 for 0.57. Capping never changes greedy tokens."""
    import numpy as np
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


def _logits(params, h, impl):
    return model.logits_from_hidden(params, h, impl)


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("state",))
def prefill(cfg: ModelConfig, params: dict, state: DecodeState, tokens: jax.Array, n_valid: jax.Array,
            impl: str = "ref"):
    """Target prefill, then MTP prefill over the shifted prompt (lag-1, MODEL_SPEC §4.2).

    Returns (first token x_n [B], first draft d_1 [B], MTP hidden at n-1 [B, E], state)."""
    start = state.lengths
    hidden, state = model.forward(cfg, params, state, tokens, n_valid, impl=impl)
    first = decode.greedy(_logits(params, model.last_valid(hidden, n_valid), impl))
    shifted = mtp.shift_left(tokens, n_valid, first)
    mh, state = mtp.forward(cfg, params, state, shifted, hidden, start, n_valid, impl=impl)
    mh_last = model.last_valid(mh, n_valid)
    return first, model.draft_token(params, mh_last, impl), mh_last, state


def accepted_length(drafts: jax.Array, target: jax.Array) -> jax.Array:
    """drafts [B, K], target argmax [B, K+1] -> number of leading drafts equal to the target [B]."""
    match = drafts == target[:, :-1]
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _emit(out, count, tokens, n_take, max_new, stop_mask, live, max_tokens):
    """Writes tokens[b, :n] (n = n_take clipped at the first stop and at max_new) after count[b].

    stop_mask [B, T]: which tokens are stop ids. Returns (out, count, done_now)."""
    b, t = tokens.shape
    idx = jnp.arange(t)[None]
    stop = stop_mask & (idx < n_take[:, None])
    first_stop = jnp.where(jnp.any(stop, axis=1), jnp.argmax(stop, axis=1) + 1, t + 1)
    n = jnp.minimum(jnp.minimum(n_take, first_stop), max_new - count) * live
    cols = jnp.where(idx < n[:, None], count[:, None] + idx, max_tokens)  # out-of-range -> dropped
    out = out.at[jnp.arange(b)[:, None], cols].set(tokens, mode="drop")
    count = count + n
    done_now = live.astype(bool) & ((first_stop <= n) | (count >= max_new))
    return out, count, done_now


def _round(cfg: ModelConfig, k: int, params: dict, state: DecodeState, pending: jax.Array, d1: jax.Array,
           mh: jax.Array, live: jax.Array, cap: jax.Array, impl: str, gdn_slots=None):
    """One speculative round (steps 1-4 of the module doc) for the rows with live [B] = 1.

    pending [B] = t_L, d1 [B], mh [B, E]; cap [B] caps the accepted drafts (K = no cap). Returns
    (target argmax g_0..g_K [B, K+1], accepted a [B], state, next pending, next d1, next mh, next
    gdn_slots). gdn_slots int [B]: state.conv / state.ssm are slotted (slotted_state) and each row's
    state is read from slot gdn_slots[b]; the returned slots point at the state after the accepted
    tokens (None when not slotted)."""
    base = state.lengths  # L [B]
    # 1. draft d_2 .. d_K
    drafts, h = [d1], mh
    for step in range(1, k):
        hs, state = mtp.forward(cfg, params, state, drafts[-1][:, None], h[:, None], base + step - 1, live,
                                impl=impl)
        h = hs[:, 0]
        drafts.append(model.draft_token(params, h, impl))
    drafts = jnp.stack(drafts, axis=1)  # [B, K]
    # 2. verify [t_L, d_1 .. d_K]
    ssm0 = state.ssm  # unslotted: the state before the verify, which the rebuild starts from
    tokens = jnp.concatenate([pending[:, None], drafts], axis=1)  # [B, K+1]
    if gdn_slots is None:
        hidden, state, replay = model.forward(cfg, params, state, tokens, live * (k + 1), impl=impl,
                                              return_gdn_replay=True)
    else:
        hidden, state = model.forward(cfg, params, state, tokens, live * (k + 1), impl=impl, gdn_slots=gdn_slots)
    target = decode.greedy(_logits(params, hidden, impl))  # [B, K+1]
    # 3. accept
    a = jnp.minimum(accepted_length(drafts, target), cap)
    n_keep = (a + 1) * live
    # 4. commit
    if gdn_slots is None:
        conv, ssm = _commit(replay, ssm0, n_keep, (state.conv, state.ssm), live * (k + 1), impl)
        state = dataclasses.replace(state, conv=conv, ssm=ssm)
    else:  # the state after n_keep tokens is in its slot already
        gdn_slots = gdn_conv.next_slots(gdn_slots, n_keep, state.ssm[0].shape[0])
    state = dataclasses.replace(state, lengths=base + n_keep)
    mh_all, state = mtp.forward(cfg, params, state, target, hidden, base, n_keep, impl=impl)
    mh = jnp.take_along_axis(mh_all, a[:, None, None], axis=1)[:, 0]
    d1 = model.draft_token(params, mh, impl)
    pending = jnp.take_along_axis(target, a[:, None], axis=1)[:, 0]
    return target, a, state, pending, d1, mh, gdn_slots


def _commit(replay: tuple, ssm0: tuple, n_keep: jax.Array, verified: tuple, n_verified: jax.Array, impl: str):
    """(conv, ssm) after the first n_keep [B] tokens of the verify pass. verified = the (conv, ssm)
    tuples the verify pass left after n_verified [B] tokens: the answer itself when every row kept
    them all (n_keep == n_verified; dead rows have 0 of 0), so the rebuild is skipped then."""
    rebuild = lambda: model.commit_gdn(replay, ssm0, n_keep, impl=impl)  # noqa: E731
    if not SKIP_FULL_COMMIT:
        return rebuild()
    return jax.lax.cond(jnp.all(n_keep == n_verified), lambda: verified, rebuild)


def gdn_slots_needed(k: int, impl: str, ssm_dtype) -> int:
    """K+2 when the speculative loops slot the GDN state (ops.GDN_STATE_SLOTS on a decode.gdn_conv_path:
    an f32 GDN state through the conv kernel, or its jnp twin for impl="ref"): a verify pass of K+1
    tokens writes one state per token besides the one it reads. 0 otherwise."""
    return k + 2 if ops.GDN_STATE_SLOTS and decode.gdn_conv_path(impl, ssm_dtype) else 0


def slotted_state(state: DecodeState, k: int, impl: str) -> tuple[DecodeState, jax.Array | None]:
    """(state, read slots or None): when gdn_slots_needed says so, each GDN layer's conv and ssm state
    in K+2 slots [K+2, B, ...], every row reading slot 0."""
    if not state.ssm or not gdn_slots_needed(k, impl, state.ssm[0].dtype):
        return state, None
    return decode.slot_gdn_state(state, k + 2)


def unslotted_state(state: DecodeState, gdn_slots) -> DecodeState:
    """The loop's state with each row's current slot taken out of the slotted GDN/conv state."""
    return state if gdn_slots is None else decode.unslot_gdn_state(state, gdn_slots)


def _zero_stats(b: int, k: int) -> dict:
    zeros = jnp.zeros((b,), jnp.int32)
    return {"rounds": zeros, "drafted": zeros, "accepted": zeros,
            "accept_hist": jnp.zeros((k + 1,), jnp.int32), "position_accepts": jnp.zeros((k,), jnp.int32)}


def _add_stats(stats: dict, a: jax.Array, live: jax.Array, k: int) -> dict:
    """Adds one round (accepted a [B] of the live [B] rows) to the acceptance statistics."""
    on = live.astype(bool)
    return {"rounds": stats["rounds"] + live, "drafted": stats["drafted"] + live * k,
            "accepted": stats["accepted"] + a * live,
            "accept_hist": stats["accept_hist"] + jnp.sum(jax.nn.one_hot(a, k + 1, dtype=jnp.int32)
                                                          * live[:, None], axis=0),
            "position_accepts": stats["position_accepts"] + jnp.sum(
                ((jnp.arange(k)[None] < a[:, None]) & on[:, None]).astype(jnp.int32), axis=0)}


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "impl"), donate_argnames=("state",))
def spec_loop(cfg: ModelConfig, spec: SpecConfig, params: dict, state: DecodeState, first: jax.Array,
              d1: jax.Array, mh: jax.Array, max_new: jax.Array, accept_cap: jax.Array, impl: str = "ref"):
    """Speculative greedy decoding after `prefill`.

    first [B] = x_n (already emitted as token 0), d1 [B] / mh [B, E] = first draft and its MTP hidden,
    max_new [B] >= 1, accept_cap [R, B] int32 caps the accepted drafts of round r (K = no cap).
    Returns (tokens [B, max_tokens], counts [B], stats, state) with stats: rounds [B], drafted [B],
    accepted [B], accept_hist [K+1] (rounds that accepted exactly a drafts), position_accepts [K]."""
    k = spec.k
    b = first.shape[0]
    out = jnp.full((b, spec.max_tokens), decode.PAD_TOKEN, jnp.int32).at[:, 0].set(first)
    count = jnp.ones((b,), jnp.int32)
    done = decode.is_stop(first, spec.stop_ids) | (count >= max_new)
    stats = _zero_stats(b, k)

    def cond(carry):
        done, r = carry[5], carry[6]
        return (~jnp.all(done)) & (r < spec.max_tokens)

    state, slots = slotted_state(state, k, impl)

    def body(carry):
        state, pending, d1, mh, out, done, r, count, stats, slots = carry
        live = (~done).astype(jnp.int32)
        cap = accept_cap[jnp.minimum(r, accept_cap.shape[0] - 1)]
        target, a, state, pending, d1, mh, slots = _round(cfg, k, params, state, pending, d1, mh, live, cap, impl,
                                                          slots)
        out, count, done_now = _emit(out, count, target, a + 1, max_new, decode.is_stop(target, spec.stop_ids),
                                     live, spec.max_tokens)
        return (state, pending, d1, mh, out, done | done_now, r + 1, count, _add_stats(stats, a, live, k), slots)

    carry = (state, first, d1, mh, out, done, jnp.int32(0), count, stats, slots)
    state, _, _, _, out, _, _, count, stats, slots = jax.lax.while_loop(cond, body, carry)
    return out, count, stats, unslotted_state(state, slots)


@functools.partial(jax.jit, static_argnames=("cfg", "k", "n_rounds", "impl"), donate_argnames=("state",))
def spec_rounds(cfg: ModelConfig, k: int, n_rounds: int, params: dict, state: DecodeState, slots: decode.Slots,
                impl: str = "ref"):
    """At most n_rounds speculative rounds with K = k drafts, resumed from `slots` (stops early once
    every slot is done); each round emits g_0 .. g_a clipped at the slot's stop ids and `remaining`.
    A state that comes in slotted (the serving engine's, K+2 slots) stays slotted, its read slots in
    slots.gdn_slot; otherwise the GDN state is slotted for the call and taken out at its end.

    Returns (tokens [B, n_rounds * (k+1)] (PAD_TOKEN after each slot's count), counts [B], stats as
    spec_loop's, state, slots); concatenated over calls, the same tokens as spec_loop."""
    if not 1 <= k <= MAX_K:
        raise ValueError(f"mtp_k={k}: supported 1..{MAX_K} (0 = plain decoding: decode.greedy_steps)")
    b = slots.done.shape[0]
    width = n_rounds * (k + 1)
    out = jnp.full((b, width), decode.PAD_TOKEN, jnp.int32)
    count = jnp.zeros((b,), jnp.int32)
    no_cap = jnp.full((b,), k, jnp.int32)

    def cond(carry):
        done, r = carry[5], carry[6]
        return (~jnp.all(done)) & (r < n_rounds)

    kept_slotted = state_lib.gdn_slot_count(state) > 0
    if kept_slotted and state_lib.gdn_slot_count(state) != k + 2:
        raise ValueError(f"spec_rounds: the state has {state_lib.gdn_slot_count(state)} GDN state slots; K = {k} "
                         f"needs K+2 = {k + 2}")
    state, gdn_slots = (state, slots.gdn_slot) if kept_slotted else slotted_state(state, k, impl)

    def body(carry):
        state, pending, d1, mh, out, done, r, count, stats, gdn_slots = carry
        live = (~done).astype(jnp.int32)
        target, a, state, pending, d1, mh, gdn_slots = _round(cfg, k, params, state, pending, d1, mh, live, no_cap,
                                                              impl, gdn_slots)
        out, count, done_now = _emit(out, count, target, a + 1, slots.remaining,
                                     decode.is_stop_rows(target, slots.stop), live, width)
        return (state, pending, d1, mh, out, done | done_now, r + 1, count, _add_stats(stats, a, live, k), gdn_slots)

    carry = (state, slots.pending, slots.d1, slots.mh, out, slots.done, jnp.int32(0), count, _zero_stats(b, k),
             gdn_slots)
    state, pending, d1, mh, out, done, _, count, stats, gdn_slots = jax.lax.while_loop(cond, body, carry)
    if not kept_slotted:
        state, gdn_slots = unslotted_state(state, gdn_slots), slots.gdn_slot
    slots = decode.Slots(pending=pending, d1=d1, mh=mh, remaining=slots.remaining - count, stop=slots.stop,
                         done=done, gdn_slot=gdn_slots)
    return out, count, stats, state, slots
