"""The decode loop: after the prefill (qmtp/runtime/prefill.py), rounds on the device (`lax.while_loop`);
plain decoding is K = 0.

One round, for a sequence whose target has consumed positions < L and whose pending token is t_L
(ARCHITECTURE.md "The speculative round"):
  1. draft   d_1 comes from the previous round (or the prefill); d_2..d_K from K-1 MTP steps at
             positions L .. L+K-2, each fed the previous draft and the previous post-mtp.norm hidden;
  2. verify  one target pass over [t_L, d_1 .. d_K] at positions L .. L+K -> argmaxes g_0 .. g_K;
             the GDN/conv state after each of its tokens goes to its own slot of the ring;
  3. accept  a = leading i with d_{i+1} == g_i (capped by `accept_cap` where given); bonus = g_a;
  4. commit  lengths += a+1 and the row's read slot moves a+1 slots on: the state after the accepted
             prefix is already stored, so nothing is recomputed or copied; attention KV past L+a is
             stale and masked by length; the MTP KV at L .. L+a is refreshed from the target hiddens
             h_L .. h_{L+a} with the shifted tokens (d_1 .. d_a, bonus) = (g_0 .. g_a), whose output at
             L+a gives the next d_1;
  5. emit    g_0 .. g_a (= d_1 .. d_a, bonus), clipped at a stop id and the row's token budget; a
             row that finishes so is committed through its emitted tokens only (the ring's slot of
             its last consumed one), so its state ends where its output does.
With K = 0 a round is a plain greedy step: the verify pass is one target token, a = 0, no MTP.
Greedy output with MTP equals plain greedy decoding token for token (tests pin it down). With
adaptive_ks, each round runs the K of those candidates that qmtp/runtime/adaptive_k.py chooses.

The slot ring: each GDN layer's conv and ssm state lives in K+2 slots per sequence, [K+2, B, ...],
with a read slot per row (`Slots.gdn_slot`). A verify pass of K+1 tokens reads one slot and writes
the state after each token to the next K+1 (pallas_kernels/gdn_conv.py), so the commit is an index
(K+1 more GDN states per sequence; WORKSPACE.md has the figures).

`decode` resumes from a carried `Slots` and runs at most n_rounds rounds: `qmtp.generate` runs it
once after `prefill.prefill`; the serving engine calls it repeatedly, inserting and retiring requests
between calls (qmtp/serve/slots.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from qmtp.model import mtp, target
from qmtp.model.config import ModelConfig
from qmtp.runtime import adaptive_k, ops, sampling as smp, tp
from qmtp.runtime.kernel_config import KernelConfig
from qmtp.runtime.state import DecodeState, gdn_slot_count

MAX_K = 4
PAD_TOKEN = -1  # fills the output buffer after a sequence's last token
NO_STOP = -1  # an unused entry of a per-slot stop-id row


def check_k(k: int) -> None:
    if not 0 <= k <= MAX_K:
        raise ValueError(f"mtp_k={k}: supported 0 (plain decoding) .. {MAX_K}")


def ring_size(k: int) -> int:
    """GDN state slots per sequence for K drafts: the one a verify pass reads and the K+1 it writes."""
    return k + 2


def greedy(logits: jax.Array) -> jax.Array:
    """argmax over the last axis; ties go to the lowest id (as torch.argmax and HF generate). Under
    tensor parallelism logits are this shard's vocabulary slice and the argmax is taken across shards."""
    return tp.greedy_argmax(logits)


def choose(logits: jax.Array, sampling, position: jax.Array, stop: jax.Array, in_prompt: jax.Array) -> jax.Array:
    """The first generated token [B] at positions [B] from logits [B, V] (its logit bias applies, min_tokens
    to the stop ids stop [B, NS], the repetition penalty to the prompts' ids in_prompt [B, V]; nothing
    generated before it): greedy (sampling None) or drawn from each row's processed distribution
    (qmtp/runtime/sampling.py; rows at temperature 0 keep the argmax)."""
    if sampling is None:
        return greedy(logits)
    z = smp.penalize(tp.gather_vocab(logits), sampling, None, stop=stop, in_prompt=in_prompt)
    return smp.sample(smp.logprobs(z, sampling), sampling.seed, position)


def draft_logprobs(cfg: ModelConfig, params: dict, h: jax.Array, kernels: KernelConfig, sampling,
                   counts: jax.Array, stop: jax.Array, in_prompt: jax.Array, drafts: jax.Array | None = None
                   ) -> jax.Array:
    """q: the processed log-probabilities [B, V] of an MTP draft from its hidden h [B, E], over the whole
    vocabulary (a draft vocabulary's other ids get probability 0), penalized as the target is after the
    ids counted in counts [B, V] and the drafts [B, n] before it, min_tokens holding back the stop ids
    stop [B, NS], the prompts' ids in_prompt [B, V] (any q keeps speculative sampling exact; the target's
    adjustments make it likelier to be accepted). Under TP every shard gathers the whole vocabulary and
    draws the same numbers."""
    z = tp.gather_vocab(target.draft_logits(params, h, kernels))
    vocab = params.get("mtp", {}).get("draft_vocab")
    if vocab is not None:
        z = jnp.full(z.shape[:-1] + (cfg.vocab_size,), -jnp.inf, z.dtype).at[..., vocab].set(z)
    return smp.logprobs(smp.penalize(z, sampling, counts, drafts, stop, in_prompt), sampling)


def draft(cfg: ModelConfig, params: dict, h: jax.Array, kernels: KernelConfig, sampling,
          position, counts: jax.Array, stop: jax.Array, in_prompt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """An MTP draft [B] for positions [B] and the distribution it was drawn from, q [B, V] f32
    (draft_logprobs after the ids in counts [B, V], stop ids stop [B, NS], prompt ids in_prompt [B, V]; the
    next round's q_1, Slots.q1): greedy (q all zeros, unread: Slots.q1), or drawn from q."""
    if sampling is None:
        return target.draft_token(params, h, kernels), unread_q(cfg, h.shape[0])
    q = draft_logprobs(cfg, params, h, kernels, sampling, counts, stop, in_prompt)
    return smp.gumbel_argmax(q, smp.keys(sampling.seed, position, smp.DRAFT)), q


def unread_q(cfg: ModelConfig, batch: int) -> jax.Array:
    """Slots.q1 where no round reads it (greedy rows, prefills without MTP): zeros [B, V] f32."""
    return jnp.zeros((batch, cfg.vocab_size), smp.F32)


def is_stop(tokens: jax.Array, stop: jax.Array) -> jax.Array:
    """Per-sequence stop ids: tokens [B, ...] against stop [B, NS] (NO_STOP entries match nothing)."""
    stop = stop.reshape(stop.shape[:1] + (1,) * (tokens.ndim - 1) + stop.shape[1:])  # [B, 1.., NS]
    return jnp.any((tokens[..., None] == stop) & (stop >= 0), axis=-1)


def stop_rows(stop_ids, batch: int) -> jax.Array:
    """The same stop ids for every row: [batch, max(1, len)] int32, NO_STOP-padded."""
    row = list(stop_ids) or [NO_STOP]
    return jnp.asarray([row] * batch, jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """What the loop carries per batch row besides the DecodeState (all replicated under TP).

        pending    [B] int32      the next token the target consumes (t_L: emitted, not yet in the KV)
        d1         [B] int32      the first draft of the next round (K = 0: unused)
        mh         [B, E]         the post-mtp.norm hidden that drafted d1 (K = 0: unused)
        remaining  [B] int32      tokens the row may still emit
        stop       [B, NS] int32  the row's stop ids, NO_STOP-padded
        done       [B] bool       finished, retired or empty: rides along with n_valid = 0 (no writes)
        gdn_slot   [B] int32      the slot of the ring each row's GDN/conv state is read from
        accept_ema [B, MAX_K] f32 the row's acceptance average per draft position (adaptive K; UNSEEN)
        q1         [B, V] f32     under sampling, the log-probabilities d1 was drawn from (a sampled
                                  round reads them, not the MTP's lm_head on mh again); greedy rounds
                                  leave it: a row at temperature 0 keeps the target's argmax whatever
                                  q1 holds (its p is one-hot: speculative_accept's doc)
        counts     [B, V] int32   how often each id was generated (pending included): the penalties'
                                  (qmtp/runtime/sampling.py). Sampled rounds keep it; greedy rounds leave
                                  it, so a row with a penalty decodes with SamplingParams only
        in_prompt  [B, V] bool    the ids of the row's prompt (the repetition penalty's)
    """

    pending: jax.Array
    d1: jax.Array
    mh: jax.Array
    remaining: jax.Array
    stop: jax.Array
    done: jax.Array
    gdn_slot: jax.Array
    accept_ema: jax.Array
    q1: jax.Array
    counts: jax.Array
    in_prompt: jax.Array

    @staticmethod
    def empty(batch: int, hidden: int, vocab: int, num_stop: int, dtype) -> "Slots":
        zeros = jnp.zeros((batch,), jnp.int32)
        return Slots(pending=zeros, d1=zeros, mh=jnp.zeros((batch, hidden), dtype), remaining=zeros,
                     stop=jnp.full((batch, num_stop), NO_STOP, jnp.int32), done=jnp.ones((batch,), bool),
                     gdn_slot=zeros, accept_ema=jnp.full((batch, MAX_K), adaptive_k.UNSEEN, jnp.float32),
                     q1=jnp.zeros((batch, vocab), smp.F32), counts=jnp.zeros((batch, vocab), jnp.int32),
                     in_prompt=jnp.zeros((batch, vocab), bool))

    @staticmethod
    def started(first, d1, q1, mh, max_tokens, stop, in_prompt) -> "Slots":
        """Rows whose first token `first` [B] was just emitted by the prefill, with their first draft d1
        [B] drawn from q1 [B, V] (`draft`), budgets max_tokens [B] (counting that token), stop ids
        stop [B, NS] and prompt ids in_prompt [B, V]; read slot 0."""
        remaining = max_tokens - 1
        return Slots(pending=first, d1=d1, mh=mh, remaining=remaining, stop=stop,
                     done=is_stop(first, stop) | (remaining <= 0), gdn_slot=jnp.zeros_like(first),
                     accept_ema=jnp.full(first.shape + (MAX_K,), adaptive_k.UNSEEN, jnp.float32), q1=q1,
                     counts=first_counts(first, q1.shape[-1]), in_prompt=in_prompt)


def first_counts(first: jax.Array, vocab: int) -> jax.Array:
    """Slots.counts [B, V] of rows whose only generated token is first [B]."""
    return jax.nn.one_hot(first, vocab, dtype=jnp.int32)


def to_ring(state: DecodeState, n: int) -> DecodeState:
    """The state with each GDN layer's conv and ssm state copied into n slots [n, B, ...]; read slots 0."""
    ring = lambda x: jnp.broadcast_to(x, (n,) + x.shape)  # noqa: E731
    return dataclasses.replace(state, conv=tuple(map(ring, state.conv)), ssm=tuple(map(ring, state.ssm)))


def from_ring(state: DecodeState, read: jax.Array) -> DecodeState:
    """The state with each row's read slot read [B] taken out of the ring."""
    take = lambda x: ops.read_slot(x, read)  # noqa: E731
    return dataclasses.replace(state, conv=tuple(map(take, state.conv)), ssm=tuple(map(take, state.ssm)))


def accepted_length(drafts: jax.Array, verified: jax.Array) -> jax.Array:
    """drafts [B, K], the target's argmax verified [B, K+1] -> number of leading drafts equal to it [B]."""
    match = drafts == verified[:, :-1]
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _round(cfg: ModelConfig, kernels: KernelConfig, k: int, params: dict, state: DecodeState, slots: Slots,
           live: jax.Array, cap: jax.Array | None, sampling=None, refresh_mtp: bool = False):
    """One round (steps 1-4 of the module doc) for the rows with live [B] = 1; cap [B] (None: none) caps
    the accepted drafts. Returns (the round's tokens [B, K+1], of which the first a + 1 are emitted,
    accepted a [B], state, slots, the verify pass's logits [B, K+1, V] (this shard's slice under TP; at
    index i those of the token at position L + 1 + i)). Greedy: the tokens are the target's argmax g_0 .. g_K; with
    `sampling`, see _sampled_round. refresh_mtp: also at K = 0, the MTP KV refresh and the next first
    draft (adaptive K: a plain step between speculative rounds keeps the MTP layer's context whole)."""
    if sampling is not None:
        return _sampled_round(cfg, kernels, k, params, state, slots, live, cap, sampling, refresh_mtp)
    base = state.lengths  # L [B]
    drafts, h = [slots.d1][:k], slots.mh  # 1. draft d_2 .. d_K
    for step in range(1, k):
        hs, state = mtp.forward(cfg, params, state, drafts[-1][:, None], h[:, None], base + step - 1, live, kernels)
        h = hs[:, 0]
        drafts.append(target.draft_token(params, h, kernels))
    tokens = jnp.stack([slots.pending] + drafts, axis=1)  # [B, K+1]  2. verify [t_L, d_1 .. d_K]
    hidden, state = target.forward(cfg, params, state, tokens, live * (k + 1), kernels, gdn_slots=slots.gdn_slot)
    logits = target.logits_from_hidden(params, hidden, kernels)  # [B, K+1, V]
    verified = greedy(logits)  # [B, K+1]: g_0 .. g_K
    a = accepted_length(tokens[:, 1:], verified)  # 3. accept
    if cap is not None:
        a = jnp.minimum(a, cap)
    n_keep = (a + 1) * live
    state = dataclasses.replace(state, lengths=base + n_keep)  # 4. commit
    read = ops.next_slots(slots.gdn_slot, n_keep, gdn_slot_count(state))
    d1, mh = slots.d1, slots.mh
    if k or refresh_mtp:  # the MTP KV at L .. L+a from the target hiddens; its output at L+a drafts the next d_1
        mh_all, state = mtp.forward(cfg, params, state, verified, hidden, base, n_keep, kernels)
        mh = jnp.take_along_axis(mh_all, a[:, None, None], axis=1)[:, 0]
        d1 = target.draft_token(params, mh, kernels)
    pending = jnp.take_along_axis(verified, a[:, None], axis=1)[:, 0]
    return verified, a, state, dataclasses.replace(slots, pending=pending, d1=d1, mh=mh, gdn_slot=read), logits


def _sampled_round(cfg: ModelConfig, kernels: KernelConfig, k: int, params: dict, state: DecodeState,
                   slots: Slots, live: jax.Array, cap: jax.Array | None, sampling, refresh_mtp: bool = False):
    """_round under sampling (speculative sampling, qmtp/runtime/sampling.py): draft i (for position
    L + 1 + i) is drawn from the MTP head's q_i (q_1 and d_1 from the previous round: Slots.q1), the verify
    pass gives p_0 .. p_K, speculative_accept keeps a drafts and draws the next token from the residual
    (or p_K). A cap below a accepts only the first cap drafts and draws the next token from p_cap, as a
    round of K = cap would. The emitted tokens feed the MTP refresh as the target's argmax does greedily.
    Penalties and min_tokens: p_i and q_i count the row's generated ids (Slots.counts) and the drafts
    before them, as plain decoding would count them had it emitted those drafts; the emitted tokens are
    then counted."""
    base = state.lengths  # L [B]: the pending token's position
    drafts, h = [slots.d1][:k], slots.mh
    q = [slots.q1] if k else []  # q_i [B, V]
    for step in range(1, k):
        hs, state = mtp.forward(cfg, params, state, drafts[-1][:, None], h[:, None], base + step - 1, live, kernels)
        h = hs[:, 0]
        # after d_1 .. d_step, counted only where a row has a penalty (penalize's lax.cond)
        q.append(draft_logprobs(cfg, params, h, kernels, sampling, slots.counts, slots.stop, slots.in_prompt,
                                jnp.stack(drafts, axis=1)))
        drafts.append(smp.gumbel_argmax(q[-1], smp.keys(sampling.seed, base + 1 + step, smp.DRAFT)))
    tokens = jnp.stack([slots.pending] + drafts, axis=1)  # [B, K+1]
    hidden, state = target.forward(cfg, params, state, tokens, live * (k + 1), kernels, gdn_slots=slots.gdn_slot)
    logits = target.logits_from_hidden(params, hidden, kernels)  # [B, K+1, V]
    z = smp.penalize(tp.gather_vocab(logits), sampling, slots.counts, tokens[:, 1:], slots.stop,
                     slots.in_prompt)  # p_i after d_1 .. d_i
    p = smp.logprobs(z, sampling)  # [B, K+1, V]
    if k:
        a, last = smp.speculative_accept(p, jnp.stack(q, axis=1), tokens[:, 1:], sampling.seed, base)
    else:
        a, last = jnp.zeros_like(base), smp.sample(p[:, 0], sampling.seed, base + 1)
    if cap is not None:  # a benchmark's profile: one more draw per round, so only when capping
        capped = a > cap
        a = jnp.minimum(a, cap)
        p_cap = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]
        last = jnp.where(capped, smp.sample(p_cap, sampling.seed, base + 1 + a), last)
    idx = jnp.arange(k + 1)[None]
    ahead = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)  # drafts d_1 .. d_K, then a filler
    emitted = jnp.where(idx < a[:, None], ahead, jnp.where(idx == a[:, None], last[:, None], PAD_TOKEN))
    n_keep = (a + 1) * live
    state = dataclasses.replace(state, lengths=base + n_keep)
    read = ops.next_slots(slots.gdn_slot, n_keep, gdn_slot_count(state))
    counts = smp.count_tokens(slots.counts, emitted, a + 1)
    d1, q1, mh = slots.d1, slots.q1, slots.mh
    if k or refresh_mtp:
        mh_all, state = mtp.forward(cfg, params, state, jnp.maximum(emitted, 0), hidden, base, n_keep, kernels)
        mh = jnp.take_along_axis(mh_all, a[:, None, None], axis=1)[:, 0]
        d1, q1 = draft(cfg, params, mh, kernels, sampling, base + a + 2, counts, slots.stop, slots.in_prompt)
    return emitted, a, state, dataclasses.replace(slots, pending=last, d1=d1, q1=q1, mh=mh, gdn_slot=read,
                                                  counts=counts), logits


def _padded_round(cfg, kernels, kc: int, k: int, params, state, slots, *, live, cap, sampling, keep_logits: bool):
    """_round at K = kc (MTP refreshed at 0 too), its tokens padded to k + 1 positions (the branches of an
    adaptive round share one shape); its logits likewise when keep_logits (logprobs asked), else None
    (a [B, k+1, V] copy per round that nothing reads)."""
    cap = None if cap is None else jnp.minimum(cap, kc)
    tokens, a, state, slots, logits = _round(cfg, kernels, kc, params, state, slots, live, cap, sampling,
                                             refresh_mtp=True)
    pad = k - kc
    tokens = jnp.pad(tokens, ((0, 0), (0, pad)), constant_values=PAD_TOKEN)  # [B, k+1]
    logits = jnp.pad(logits, ((0, 0), (0, pad), (0, 0))) if keep_logits else None  # [B, k+1, V]
    return tokens, a, state, slots, logits


def _end_at_emitted(state: DecodeState, slots: Slots, done_now: jax.Array, base: jax.Array, read: jax.Array,
                    n: jax.Array):
    """(state, slots) with the rows that finished this round (done_now [B]) marked done and committed
    through the tokens they emitted, n [B] of them, not through all a + 1 of the round: the state then
    holds the prompt and the response but its last token (length base + n, the ring's state after the
    n-th token of the round, whose slot the verify wrote; the MTP entry before it is the refresh's), so
    a finished response is a prefix for the next turn (qmtp/serve/prefix_cache.py) also when a stop id
    or the token budget cut its last round short."""
    lengths = jnp.where(done_now, base + n, state.lengths)
    gdn_slot = jnp.where(done_now, ops.next_slots(read, n, gdn_slot_count(state)), slots.gdn_slot)
    return (dataclasses.replace(state, lengths=lengths),
            dataclasses.replace(slots, done=slots.done | done_now, gdn_slot=gdn_slot))


def _emit(out, count, tokens, n_take, remaining, stop_mask, live):
    """Writes tokens[b, :n] after count[b], n = n_take clipped at the first stop and at remaining; out and
    tokens are dicts of [B, T, ...] pytrees: "tokens" the ids, "logprobs" (if asked) their TokenLogprobs.

    stop_mask [B, T]: which tokens are stop ids. Returns (out, count, done_now)."""
    b, t = tokens["tokens"].shape
    idx = jnp.arange(t)[None]
    stop = stop_mask & (idx < n_take[:, None])
    first_stop = jnp.where(jnp.any(stop, axis=1), jnp.argmax(stop, axis=1) + 1, t + 1)
    n = jnp.minimum(jnp.minimum(n_take, first_stop), remaining - count) * live
    cols = jnp.where(idx < n[:, None], count[:, None] + idx, out["tokens"].shape[1])  # out of range: dropped
    out = jax.tree.map(lambda o, v: o.at[jnp.arange(b)[:, None], cols].set(v, mode="drop"), out, tokens)
    count = count + n
    done_now = live.astype(bool) & ((first_stop <= n) | (count >= remaining))
    return out, count, done_now


def _zero_stats(b: int, k: int) -> dict:
    zeros = jnp.zeros((b,), jnp.int32)
    return {"rounds": zeros, "drafted": zeros, "accepted": zeros,
            "accept_hist": jnp.zeros((k + 1,), jnp.int32), "position_accepts": jnp.zeros((k,), jnp.int32),
            "sampled_rounds": zeros, "sampled_position_accepts": jnp.zeros((k,), jnp.int32)}


def _add_stats(stats: dict, a: jax.Array, live: jax.Array, k: int, sampled: jax.Array, drafts=None) -> dict:
    """Adds one round (accepted a [B] of the live [B] rows) to the acceptance statistics; sampled [B]
    marks the rows at temperature > 0, also counted apart (sampled_rounds, sampled_position_accepts);
    drafts: the round's K when it is chosen per round (int32 []; None: k)."""
    on = live.astype(bool)
    hit = (jnp.arange(k)[None] < a[:, None]) & on[:, None]  # [B, K]: the row's draft at this position accepted
    return {"rounds": stats["rounds"] + live, "drafted": stats["drafted"] + live * (k if drafts is None else drafts),
            "sampled_rounds": stats["sampled_rounds"] + live * sampled,
            "sampled_position_accepts": stats["sampled_position_accepts"] + jnp.sum(
                (hit & sampled[:, None].astype(bool)).astype(jnp.int32), axis=0),
            "accepted": stats["accepted"] + a * live,
            "accept_hist": stats["accept_hist"] + jnp.sum(jax.nn.one_hot(a, k + 1, dtype=jnp.int32)
                                                          * live[:, None], axis=0),
            "position_accepts": stats["position_accepts"] + jnp.sum(hit.astype(jnp.int32), axis=0)}


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "k", "n_rounds", "top_logprobs", "adaptive_ks"),
                   donate_argnames=("state",))
def decode(cfg: ModelConfig, kernels: KernelConfig, k: int, n_rounds: int, params: dict, state: DecodeState,
           slots: Slots, accept_cap: jax.Array | None = None, sampling=None, round_cost: jax.Array | None = None,
           top_logprobs: int | None = None, adaptive_ks: tuple[int, ...] | None = None):
    """At most n_rounds rounds with K = k drafts (0: plain greedy steps), resumed from `slots`; stops
    early once every row is done. Each round emits g_0 .. g_a clipped at the row's stop ids and
    `remaining`. accept_cap [R, B] int32 (a benchmark's acceptance profile) caps the accepted drafts of
    round r at row min(r, R-1); None: no cap. Capping never changes greedy tokens. sampling: None
    (greedy) or the rows' SamplingParams (speculative sampling: each token follows the target's
    processed distribution).

    A state whose GDN/conv rows are in a ring of K+2 slots (the serving engine keeps it so) stays in
    it, its read slots in slots.gdn_slot; a state without the ring is put into one for the call and
    taken out at its end. Returns (tokens [B, n_rounds (k+1)] (PAD_TOKEN after each row's count),
    counts [B], stats, state, slots); stats: rounds [B], drafted [B], accepted [B], accept_hist [K+1]
    (rounds that accepted exactly a drafts), position_accepts [K], and sampled_rounds [B] and
    sampled_position_accepts [K] of the rows at temperature > 0. With top_logprobs N (0 ..
    MAX_TOP_LOGPROBS) a sixth result: the tokens' TokenLogprobs [B, n_rounds (k+1)] with N alternatives
    (qmtp/runtime/sampling.py: log_softmax of the verify pass's logits at the row's temperature; under
    TP each round then gathers the vocabulary).

    adaptive_ks: candidate draft lengths (ascending, the last = k) of which each round runs the one
    qmtp/runtime/adaptive_k.py chooses from slots.accept_ema and round_cost [C] (seconds per round at
    each); every candidate's round is in the program (lax.switch), the GDN ring is k's, and K = 0
    rounds refresh the MTP layer too. stats then also hold k_rounds [C]: rounds run at each candidate."""
    check_k(k)
    b = slots.done.shape[0]
    width = n_rounds * (k + 1)
    out = {"tokens": jnp.full((b, width), PAD_TOKEN, jnp.int32)}
    if top_logprobs is not None:
        out["logprobs"] = smp.TokenLogprobs.empty(b, width, top_logprobs)
    in_ring = gdn_slot_count(state) > 0
    if in_ring and gdn_slot_count(state) != ring_size(k):
        raise ValueError(f"decode: the state has {gdn_slot_count(state)} GDN state slots; K = {k} needs "
                         f"{ring_size(k)}")
    entry = slots
    if not in_ring:
        state, slots = to_ring(state, ring_size(k)), dataclasses.replace(slots, gdn_slot=jnp.zeros((b,), jnp.int32))

    sampled = jnp.zeros((b,), jnp.int32) if sampling is None else (sampling.temperature > 0).astype(jnp.int32)

    def cond(carry):
        slots, r = carry[1], carry[4]
        return (~jnp.all(slots.done)) & (r < n_rounds)

    def body(carry):
        state, slots, out, count, r, stats = carry
        live = (~slots.done).astype(jnp.int32)
        base, read = state.lengths, slots.gdn_slot  # the round's start: L [B] and the read slots [B]
        cap = None if accept_cap is None else accept_cap[jnp.minimum(r, accept_cap.shape[0] - 1)]
        if adaptive_ks is None:
            verified, a, state, slots, logits = _round(cfg, kernels, k, params, state, slots, live, cap, sampling)
        else:
            c = adaptive_k.choose(slots.accept_ema, live, adaptive_ks, round_cost)
            branches = [functools.partial(_padded_round, cfg, kernels, kc, k, params, live=live, cap=cap,
                                          sampling=sampling, keep_logits=top_logprobs is not None)
                        for kc in adaptive_ks]
            d1 = slots.d1  # a plain step still checks the first draft: observed at position 1
            verified, a, state, slots, logits = jax.lax.switch(c, branches, state, slots)
            k_round = jnp.asarray(adaptive_ks, jnp.int32)[c]
            seen = jnp.where(k_round > 0, a, (d1 == verified[:, 0]).astype(jnp.int32))
            slots = dataclasses.replace(slots, accept_ema=adaptive_k.update(slots.accept_ema, seen,
                                                                            jnp.maximum(k_round, 1), live))
        emitted = {"tokens": verified}
        if top_logprobs is not None:
            temperature = None if sampling is None else sampling.temperature
            emitted["logprobs"] = smp.token_logprobs(tp.gather_vocab(logits), verified, temperature, top_logprobs)
        before = count
        out, count, done_now = _emit(out, count, emitted, a + 1, entry.remaining, is_stop(verified, slots.stop),
                                     live)
        state, slots = _end_at_emitted(state, slots, done_now, base, read, count - before)
        if adaptive_ks is None:
            return state, slots, out, count, r + 1, _add_stats(stats, a, live, k, sampled)
        new_stats = _add_stats(stats, a, live, k, sampled, k_round)
        new_stats["k_rounds"] = stats["k_rounds"] + jax.nn.one_hot(c, len(adaptive_ks), dtype=jnp.int32)
        return state, slots, out, count, r + 1, new_stats

    stats0 = _zero_stats(b, k)
    if adaptive_ks is not None:
        if list(adaptive_ks) != sorted(set(adaptive_ks)) or adaptive_ks[-1] != k or adaptive_ks[0] < 0:
            raise ValueError(f"adaptive_ks={adaptive_ks}: distinct ascending draft lengths ending at k={k}")
        stats0["k_rounds"] = jnp.zeros((len(adaptive_ks),), jnp.int32)
    carry = (state, slots, out, jnp.zeros((b,), jnp.int32), jnp.int32(0), stats0)
    state, slots, out, count, _, stats = jax.lax.while_loop(cond, body, carry)
    if not in_ring:
        state, slots = from_ring(state, slots.gdn_slot), dataclasses.replace(slots, gdn_slot=entry.gdn_slot)
    slots = dataclasses.replace(slots, remaining=entry.remaining - count)
    if top_logprobs is not None:
        return out["tokens"], count, stats, state, slots, out["logprobs"]
    return out["tokens"], count, stats, state, slots
