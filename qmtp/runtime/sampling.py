"""Sampling and lossless speculative sampling, per row, as pure functions of logits and keys.

Each row b has its own parameters (`SamplingParams`, arrays [B]): temperature T_b (0: greedy), top_k (0:
off), top_p (1: off), min_p (0: off), presence and frequency penalties (0: off), a repetition penalty r
(1: off), a logit bias (up to MAX_LOGIT_BIAS ids, which may also be the only ids allowed: vLLM's
allowed_token_ids), min_tokens (0: off) and a seed. The distribution a row samples from is HF
transformers' order of processors on the logits z after the adjustments vLLM makes, in its order: the
bias b_v of id v (-inf at the ids a row that allows only its listed ones does not list); the repetition
penalty (HF's and vLLM's) on each id s_v of the prompt or generated before the position, which divides a
positive logit by r and multiplies another by r; the OpenAI API's penalties on the count c_v of v among
the tokens the request generated before the position (not the prompt's); then, while fewer than
min_tokens tokens precede the position (n = sum_v c_v < min_tokens), the row's stop ids get -inf (vLLM's
min_tokens: the row cannot end there):

    y_v = z_v + b_v;  y_v -> y_v / r if y_v > 0 else y_v * r  where s_v  (in the prompt or c_v > 0)
    y_v - frequency * c_v - presence * [c_v > 0]  (-inf at stop ids while n < min_tokens)
        ->  / T  ->  keep the top_k largest
        ->  keep the smallest set of largest with mass >= top_p
        ->  keep those with probability >= min_p * the largest probability  ->  softmax

(ties at a threshold are all kept). A row with T = 0 gets the one-hot distribution of argmax z (the
adjusted z), so greedy rows go through the same code and keep greedy's tokens exactly; a row without
adjustments keeps z bit for bit.

Randomness: key(seed, position, purpose), so a seeded request draws the same numbers whatever batch
it is in. A token is drawn by the Gumbel-max trick, argmax(log p + G) with G ~ Gumbel(0, 1) per
vocabulary id (a one-hot p gives its token whatever G is).

Logprobs (what a request may ask to see, as OpenAI reports them): log_softmax(z / T) of the target
at each emitted token's position, T the row's temperature (1 for greedy rows), before top_k / top_p /
min_p: the chosen token's value and the N <= MAX_TOP_LOGPROBS largest.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): drafts x_i ~ q_i (the MTP head's
processed distribution), target p_i at the K+1 verified positions. Draft i is accepted with
probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection j the token is drawn from
norm(max(0, p_j - q_j)); after K accepted drafts the bonus token is drawn from p_K. Each emitted token
is then distributed exactly as p at its position. With one-hot p and q (greedy rows) this is the
exact-match rule: accept iff x_i = argmax p_i, and the residual is p_i's token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

F32 = jnp.float32
DRAFT, ACCEPT, SAMPLE = 0, 1, 2  # purposes of a position's random numbers
MAX_TOP_LOGPROBS = 20  # alternatives a request may ask for per token (the OpenAI API's limit)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (the OpenAI API's range)
MAX_LOGIT_BIAS = 300  # ids a row's logit bias may name (the width of SamplingParams.logit_bias_ids)
MAX_BIAS = 100.0  # a logit bias lies in [-MAX_BIAS, MAX_BIAS] (the OpenAI API's range)
# Batches whose truncating rows all ask 1 <= top_k <= SHORT_TOP_K find their cut among the SHORT_TOP_K
# largest logits (`largest`) instead of sorting the vocabulary (H200, 248,320 ids, top_k 20 and top_p
# 0.95: 1 / 4 / 16 rows 89 / 281 / 813 us sorted, 73 / 78 / 85 us so). The same cut, except that top_p
# would count the mass of ties at the k-th value only up to SHORT_TOP_K of them.
SHORT_TOP_K = 64
LARGEST_BLOCK = 128  # vocabulary ids per block of `largest`
LARGEST_SUB_BLOCK = 16  # ids per sub-block of `largest`'s second level


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling parameters, each [B]."""

    temperature: jax.Array  # f32, 0 = greedy
    top_k: jax.Array  # int32, 0 = all
    top_p: jax.Array  # f32 in (0, 1], 1 = all
    min_p: jax.Array  # f32 in [0, 1], 0 = off
    seed: jax.Array  # uint32
    presence_penalty: jax.Array  # f32, 0 = off: subtracted once from each id already generated
    frequency_penalty: jax.Array  # f32, 0 = off: subtracted per occurrence of each id already generated
    logit_bias_ids: jax.Array  # [B, MAX_LOGIT_BIAS] int32: the ids whose logit gets a bias (-1: unused)
    logit_bias: jax.Array  # [B, MAX_LOGIT_BIAS] f32: added to those ids' logits
    min_tokens: jax.Array  # int32, 0 = off: the row's stop ids get -inf until it has generated this many tokens
    repetition_penalty: jax.Array  # f32 > 0, 1 = off: divides (multiplies) the positive (other) logits of seen ids
    only_listed: jax.Array  # bool: the ids logit_bias_ids does not list get -inf (vLLM's allowed_token_ids)

    def adjusted(self) -> jax.Array:
        """[B] bool: the rows whose logits are adjusted (a penalty, a logit bias, min_tokens, allowed ids)
        before the processing."""
        return ((self.presence_penalty != 0) | (self.frequency_penalty != 0) | (self.repetition_penalty != 1)
                | jnp.any(self.logit_bias_ids >= 0, axis=-1) | (self.min_tokens > 0) | self.only_listed)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """The log-probabilities of emitted tokens (module doc) at [B, T] token slots."""

    chosen: jax.Array  # [B, T] f32: the emitted token's
    top_ids: jax.Array  # [B, T, N] int32: the N most likely ids, most likely first
    top: jax.Array  # [B, T, N] f32: their log-probabilities

    @staticmethod
    def empty(batch: int, length: int, n: int) -> "TokenLogprobs":
        return TokenLogprobs(jnp.zeros((batch, length), F32), jnp.zeros((batch, length, n), jnp.int32),
                             jnp.zeros((batch, length, n), F32))


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: jax.Array | None, n: int) -> TokenLogprobs:
    """TokenLogprobs [B, T] of tokens [B, T] under logits [B, T, V] (the whole vocabulary) at the rows'
    temperature [B] (None or 0: 1), with the n most likely ids."""
    z = logits.astype(F32)
    if temperature is not None:
        z = z / jnp.where(temperature > 0, temperature, 1.0)[:, None, None]
    logp = jax.nn.log_softmax(z, axis=-1)
    chosen = jnp.take_along_axis(logp, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    top, top_ids = largest(logp, n)
    return TokenLogprobs(chosen, top_ids, top)


def keys(seed: jax.Array, position: jax.Array, purpose: int) -> jax.Array:
    """Typed PRNG keys [B, ...] from seed [B] uint32, positions [B, ...] int32 and a purpose (DRAFT, ACCEPT,
    SAMPLE): a function of those three alone."""
    def row(s, p):
        one = lambda pp: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), pp), purpose)  # noqa: E731
        return jax.vmap(one)(p.reshape(-1)).reshape(p.shape)
    return jax.vmap(row)(seed, position)


def penalize(logits: jax.Array, params: SamplingParams, counts: jax.Array | None,
             drafts: jax.Array | None = None, stop: jax.Array | None = None, in_prompt: jax.Array | None = None):
    """The adjusted logits f32 (module doc: logit bias, penalties, min_tokens), shaped as logits: [B, V] at
    one position after the ids counted in counts [B, V] int32 (None: nothing generated yet) and then drafts
    [B, n] where given, or [B, K+1, V] at the K+1 positions that follow counts and then drafts [B, K]
    (position i also counts d_1 .. d_i). stop [B, NS]: the rows' stop ids (negative entries: none) that
    min_tokens holds back (None: none); in_prompt [B, V] bool: the ids of the rows' prompts, which the
    repetition penalty counts as seen (None: none). A row without adjustments keeps its logits bit for bit
    (z + 0 = z / 1 = z * 1 = z - 0 * c - 0); when no row has one nothing is counted (a lax.cond)."""
    z = logits.astype(F32)

    def apply(z):
        b, v = z.shape[0], z.shape[-1]
        per_id = lambda x: x.reshape((b,) + (1,) * (z.ndim - 2) + (v,))  # noqa: E731  ([B, V] over z's positions)
        per_row = lambda x: x.reshape((b,) + (1,) * (z.ndim - 1))  # noqa: E731  ([B] over z's positions and ids)
        z = z + per_id(_by_id(params.logit_bias_ids, params.logit_bias, v))
        listed = per_id(_by_id(params.logit_bias_ids, jnp.ones(params.logit_bias_ids.shape, jnp.int32), v) > 0)
        z = jnp.where(per_row(params.only_listed) & ~listed, -jnp.inf, z)
        # the drafts before each position: all n of them, or d_1 .. d_i at verify position i
        if drafts is None:
            before = 0
        elif z.ndim == 2:
            before = drafts.shape[1]
        else:
            before = jnp.arange(drafts.shape[1] + 1)
        c = None  # [B, V] / [B, K+1, V]: each id's count before the position
        if counts is not None:
            if drafts is None:
                c = counts
            elif z.ndim == 2:
                c = counts + jax.nn.one_hot(drafts, v, dtype=counts.dtype).sum(axis=1)
            else:
                c = _position_counts(counts, drafts)
            c = c.astype(F32)
        seen = None if in_prompt is None else per_id(in_prompt)  # the repetition penalty's ids
        if c is not None:
            seen = (c > 0) if seen is None else seen | (c > 0)
        if seen is not None:
            r = per_row(params.repetition_penalty)
            z = jnp.where(seen, jnp.where(z > 0, z / r, z * r), z)
        if c is not None:
            z = z - per_row(params.frequency_penalty) * c - per_row(params.presence_penalty) * (c > 0)
        if stop is None:
            return z
        generated = 0 if counts is None else counts.sum(axis=-1).reshape((b,) + (1,) * (z.ndim - 2))
        n = generated + before  # [B] / [B, K+1]: the tokens generated before the position
        held = jnp.asarray(n < params.min_tokens.reshape((b,) + (1,) * (z.ndim - 2)))[..., None]  # [B, .., 1]
        is_stop = per_id(_by_id(stop, jnp.ones(stop.shape, jnp.int32), v) > 0)
        return jnp.where(held & is_stop, -jnp.inf, z)

    return jax.lax.cond(jnp.any(params.adjusted()), apply, lambda z: z, z)


def _by_id(ids: jax.Array, values: jax.Array, vocab: int) -> jax.Array:
    """[B, vocab]: values [B, N] added at ids [B, N] (negative ids: none), zero elsewhere."""
    cols = jnp.where(ids >= 0, ids, vocab)  # past the vocabulary: dropped
    return jnp.zeros((ids.shape[0], vocab), values.dtype).at[jnp.arange(ids.shape[0])[:, None], cols].add(
        values, mode="drop")


def _position_counts(counts: jax.Array, drafts: jax.Array) -> jax.Array:
    """[B, K+1, V]: counts [B, V], then at position i also d_1 .. d_i of drafts [B, K]."""
    ahead = jnp.cumsum(jax.nn.one_hot(drafts, counts.shape[-1], dtype=counts.dtype), axis=1)  # [B, K, V]
    return jnp.concatenate([counts[:, None], counts[:, None] + ahead], axis=1)


def prompt_mask(tokens: jax.Array, n_valid: jax.Array, vocab: int) -> jax.Array:
    """[B, vocab] bool: the ids among the first n_valid [B] of tokens [B, T] of each row (penalize's in_prompt)."""
    b, t = tokens.shape
    cols = jnp.where(jnp.arange(t)[None] < n_valid[:, None], tokens, vocab)  # past the vocabulary: dropped
    return jnp.zeros((b, vocab), bool).at[jnp.arange(b)[:, None], cols].set(True, mode="drop")


def count_tokens(counts: jax.Array, tokens: jax.Array, n: jax.Array) -> jax.Array:
    """counts [B, V] plus the first n [B] of tokens [B, T] of each row."""
    b, t = tokens.shape
    cols = jnp.where(jnp.arange(t)[None] < n[:, None], tokens, counts.shape[-1])  # past the vocabulary: dropped
    return counts.at[jnp.arange(b)[:, None], cols].add(1, mode="drop")


def logprobs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Log-probabilities [B, ..., V] f32 of the processed distribution (module doc) of logits [B, ..., V]
    (already penalized: `penalize`); ids outside it are -inf. A row's parameters apply to all its
    positions."""
    z = logits.astype(F32)
    shape = (-1,) + (1,) * (z.ndim - 1)
    t = params.temperature.reshape(shape)
    greedy = t <= 0
    z = z / jnp.where(greedy, 1.0, t)
    v = z.shape[-1]
    truncating = (params.top_k > 0) | (params.top_p < 1) | (params.min_p > 0)  # [B]
    asked = truncating & ~greedy.reshape(-1)  # [B]: rows whose distribution is cut
    short = jnp.all(~asked | ((params.top_k > 0) & (params.top_k <= SHORT_TOP_K)))

    def truncated(z, width):  # the cut from the `width` largest logits of each row, descending
        srt = -jnp.sort(-z, axis=-1) if width == v else largest(z, width)[0]  # [B, ..., width]
        k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, width), width).reshape(shape)
        kth = jnp.take_along_axis(srt, k - 1, axis=-1)  # the k-th largest
        srt = jnp.where(srt >= kth, srt, -jnp.inf)
        probs = jax.nn.softmax(srt, axis=-1)  # sorted, top-k kept
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the larger ones
        top_p = params.top_p.reshape(shape)
        # the smallest prefix whose mass reaches top_p; top_p 1 keeps all (an f32 cumsum may pass 1 early)
        keep = (before < top_p) | (top_p >= 1)
        keep &= probs >= params.min_p.reshape(shape) * probs[..., :1]
        keep &= srt > -jnp.inf
        cut = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)  # the smallest kept value
        cut = jnp.where(asked.reshape(shape), cut, -jnp.inf)  # rows that cut nothing keep all
        return jnp.where(z >= cut, z, -jnp.inf)

    # no row cuts: nothing to sort; all cut rows ask a short top_k: their cut lies among the largest
    branch = jnp.where(jnp.any(asked), jnp.where(short, 1, 2), 0)
    z = jax.lax.switch(branch, [lambda z: z, lambda z: truncated(z, min(SHORT_TOP_K, v)),
                                lambda z: truncated(z, v)], z)
    top = jnp.argmax(logits, axis=-1)[..., None]
    one_hot = jnp.where(jnp.arange(v) == top, 0.0, -jnp.inf)
    return jnp.where(greedy, one_hot, jax.nn.log_softmax(z, axis=-1))


def largest(z: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest values [..., k] of z [..., V] along the last axis, descending, and their ids [..., k]
    int32 (ties: the lower id first), as lax.top_k gives them, without sorting V (on the H200 XLA's top_k
    sorts: 290 us for 4 x 248,320 logits; this form at k = 64: 61 / 58 / 64 us at 1 / 4 / 16 rows, H100,
    `qmtp.bench.sampling_ops`, against 91 / 96 / 100 us with one level of blocks). An id among the k
    largest lies in a block of LARGEST_BLOCK ids whose maximum ranks among the k largest block maxima
    (ties: the lower block first), so those k blocks hold them; the same holds again for sub-blocks of
    LARGEST_SUB_BLOCK ids inside the kept blocks, kept in id order. Three short sorts: the V /
    LARGEST_BLOCK block maxima, the k * LARGEST_BLOCK / LARGEST_SUB_BLOCK sub-block maxima, then the
    k * LARGEST_SUB_BLOCK values left."""
    lead, v = z.shape[:-1], z.shape[-1]
    if not 0 <= k <= v:
        raise ValueError(f"largest: k={k} must be in [0, {v}] (the last axis)")
    rows = z.reshape(-1, v)
    r = rows.shape[0]
    blocks = jnp.pad(rows, ((0, 0), (0, (-v) % LARGEST_BLOCK)), constant_values=-jnp.inf)
    blocks = blocks.reshape(r, -1, LARGEST_BLOCK)  # [R, V / LARGEST_BLOCK, LARGEST_BLOCK]
    ids = jnp.broadcast_to(jnp.arange(blocks.shape[1] * LARGEST_BLOCK, dtype=jnp.int32), (r, blocks[0].size))
    for size in (LARGEST_BLOCK, LARGEST_SUB_BLOCK):
        blocks, ids = blocks.reshape(r, -1, size), ids.reshape(r, -1, size)  # [R, n, size], in id order
        order = jnp.sort(jnp.argsort(-jnp.max(blocks, axis=-1), axis=-1, stable=True)[:, :k], axis=-1)  # [R, <=k]
        blocks = jnp.take_along_axis(blocks, order[:, :, None], axis=1)  # the kept blocks, in id order
        ids = jnp.take_along_axis(ids, order[:, :, None], axis=1)
    neg, ids = jax.lax.sort((-blocks.reshape(r, -1), ids.reshape(r, -1)), dimension=1, num_keys=2)
    return -neg[:, :k].reshape(lead + (k,)), ids[:, :k].reshape(lead + (k,))


def gumbel_argmax(logp: jax.Array, key: jax.Array) -> jax.Array:
    """One draw per row from exp(logp [B, V]) with keys [B]: argmax(logp + Gumbel noise) [B] int32."""
    g = jax.vmap(lambda kk: jax.random.gumbel(kk, logp.shape[-1:], F32))(key)
    return jnp.argmax(logp + g, axis=-1).astype(jnp.int32)


def sample(logp: jax.Array, seed: jax.Array, position: jax.Array) -> jax.Array:
    """The token [B] at positions [B] from log-probabilities logp [B, V] (plain decoding)."""
    return gumbel_argmax(logp, keys(seed, position, SAMPLE))


def speculative_accept(p_logp: jax.Array, q_logp: jax.Array, drafts: jax.Array, seed: jax.Array,
                       base: jax.Array):
    """Accept / reject K drafts [B, K] (drawn from q) against the target.

    p_logp [B, K+1, V]: the target's processed log-probabilities at the verified positions base + 1 ..
    base + K + 1 (base [B]: the position of the last committed token); q_logp [B, K, V]: the drafts'
    distributions. Returns (a [B] accepted drafts, the token [B] drawn at position base + a + 1 from
    the residual norm(max(0, p_a - q_a)), or from p_K when a = K). The emitted tokens are drafts[:a]
    and that token.

    A row whose p is one-hot (temperature 0) gets p's tokens whatever log-probabilities q holds: a draft
    at p's argmax is accepted (log u < 0 <= -q(x)), another rejected (p(x) = 0), and the residual's
    mass lies at p's argmax alone (or nowhere, and then p is drawn)."""
    b, k = drafts.shape
    pos = base[:, None] + 1 + jnp.arange(k + 1)[None]  # [B, K+1]
    p_x = jnp.take_along_axis(p_logp[:, :k], drafts[..., None], axis=-1)[..., 0]  # [B, K]
    q_x = jnp.take_along_axis(q_logp, drafts[..., None], axis=-1)[..., 0]
    u = jax.vmap(jax.vmap(lambda kk: jax.random.uniform(kk, (), F32)))(keys(seed, pos[:, :k], ACCEPT))  # [B, K]
    # accept with probability min(1, p/q): log u < log p - log q (u in [0, 1); q(x) > 0 for a drawn x)
    ok = jnp.log(u) < p_x - q_x
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)  # [B]
    p_a = jnp.take_along_axis(p_logp, a[:, None, None], axis=1)[:, 0]  # [B, V]
    q_pad = jnp.concatenate([q_logp, jnp.full((b, 1, q_logp.shape[-1]), -jnp.inf, F32)], axis=1)
    q_a = jnp.take_along_axis(q_pad, a[:, None, None], axis=1)[:, 0]  # -inf at a = K: the residual is p_K
    pos_a = jnp.take_along_axis(pos, a[:, None], axis=1)[:, 0]
    return a, gumbel_argmax(_residual(p_a, q_a), keys(seed, pos_a, SAMPLE))


def _residual(p_logp: jax.Array, q_logp: jax.Array) -> jax.Array:
    """log max(0, p - q) [B, V], unnormalised (Gumbel-max needs no sum); where p = q leaves no mass (a
    rejection there has probability 0), p itself."""
    r = jnp.log(jnp.maximum(jnp.exp(p_logp) - jnp.exp(q_logp), 0.0))
    return jnp.where(jnp.any(r > -jnp.inf, axis=-1, keepdims=True), r, p_logp)
