"""The prefill: the target over the prompts, then the MTP head over the shifted prompts (MODEL_SPEC §4.2),
giving the first token, the first draft and the decode loop's `Slots` (qmtp/runtime/loop.py).

A prompt longer than `KernelConfig.prefill_chunk` runs in chunks, each after the KV and GDN/conv state
the one before left, so a pass's buffers are a chunk's (the hidden states [B, T, E] and the KV are the
prompt's): the target layer by layer (`target.forward_by_layer`: a layer's chunks in one scan on its
weights prepared once), then the MTP head chunk by chunk (`_chunked`). Under
`KernelConfig.deterministic` the prompts run one at a time in whole chunks of the whole model
(`prefill`'s doc), the passes the serving engine's pieces run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qmtp.model import mtp, target
from qmtp.model.config import ModelConfig
from qmtp.runtime import sampling as smp, tp
from qmtp.runtime.kernel_config import KernelConfig
from qmtp.runtime.loop import Slots, choose, draft, first_counts, unread_q
from qmtp.runtime.state import DecodeState


def first_logprobs(logits: jax.Array, first: jax.Array, sampling, top_logprobs: int | None):
    """The first token's TokenLogprobs [B, 1] from the prompt's last logits [B, V] (this shard's slice
    under TP); None when top_logprobs is None."""
    if top_logprobs is None:
        return None
    temperature = None if sampling is None else sampling.temperature
    return smp.token_logprobs(tp.gather_vocab(logits)[:, None], first[:, None], temperature, top_logprobs)


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "use_mtp", "top_logprobs"),
                   donate_argnames=("state",))
def prefill(cfg: ModelConfig, kernels: KernelConfig, use_mtp: bool, params: dict, state: DecodeState,
            tokens: jax.Array, n_valid: jax.Array, max_tokens: jax.Array, stop: jax.Array, sampling=None,
            top_logprobs: int | None = None):
    """Target prefill over the prompts tokens [B, T] (n_valid [B] real tokens each), then with MTP the
    MTP prefill over the shifted prompt (lag-1, MODEL_SPEC §4.2) for the first draft.

    max_tokens [B] >= 1, stop [B, NS]: the rows' budgets and stop ids; sampling: None (greedy) or the
    rows' SamplingParams, from which the first token and the first draft are drawn (a repetition penalty
    counts the ids of tokens as the prompts'). Returns (first token x_n [B], Slots.started for the rows,
    state); the state's GDN/conv rows are not in the ring. With top_logprobs
    N (0 .. MAX_TOP_LOGPROBS) a fourth result: the first token's TokenLogprobs [B, 1] with N alternatives.

    kernels.deterministic: one prompt at a time (a loop over the rows, at every batch size, one
    included), each padded to whole chunks of kernels.prefill_chunk tokens, so every pass of the prefill
    has the shape [1, prefill_chunk] and its XLA ops (the GDN chunk form's dots, the q/k L2 norms)
    choose their order from neither the batch nor the prompt bucket: a row's numbers do not depend on
    the other prompts of its batch, the serving engine's pieces are the same passes."""
    if kernels.deterministic:
        t = tokens.shape[1]  # T and the chunk are powers of two: max(T, chunk) is whole chunks
        tokens = jnp.pad(tokens, ((0, 0), (0, max(t, kernels.prefill_chunk) - t)))
        out = _prefill_rows(cfg, kernels, use_mtp, params, state, tokens, n_valid, max_tokens, stop, sampling,
                            top_logprobs)
    else:
        out = _prefill_batch(cfg, kernels, use_mtp, params, state, tokens, n_valid, max_tokens, stop, sampling,
                             top_logprobs)
    return out if top_logprobs is not None else out[:3]


def _prefill_rows(cfg, kernels, use_mtp, params, state: DecodeState, tokens, n_valid, max_tokens, stop, sampling,
                  top_logprobs):
    """_prefill_batch on one row at a time (DecodeState.row / with_row), results stacked as the batch's.

    A while loop whose trip count XLA cannot read (it comes from n_valid, a run-time input): a loop of
    one trip (batch 1) would otherwise be inlined into the program around it and fused with it
    differently from the loop body a larger batch runs."""
    take = lambda x, b: jax.lax.dynamic_slice_in_dim(x, b, 1)  # noqa: E731

    def one(b, state):
        smp_row = None if sampling is None else jax.tree_util.tree_map(lambda x: take(x, b), sampling)
        return _prefill_batch(cfg, kernels, use_mtp, params, state.row(b), take(tokens, b), take(n_valid, b),
                              take(max_tokens, b), take(stop, b), smp_row, top_logprobs)

    rows = tokens.shape[0]
    shapes = jax.eval_shape(lambda st: one(0, st), state)
    outs = jax.tree_util.tree_map(lambda s: jnp.zeros((rows,) + s.shape[1:], s.dtype),
                                  (shapes[0], shapes[1], shapes[3]))  # first [B], Slots, TokenLogprobs | None

    def body(b, carry):
        state, outs = carry
        first, slots, sub, lp = one(b, state)
        put = lambda o, r: jax.lax.dynamic_update_slice_in_dim(o, r, b, axis=0)  # noqa: E731
        return state.with_row(b, sub), jax.tree_util.tree_map(put, outs, (first, slots, lp))

    state, (first, slots, lp) = jax.lax.fori_loop(0, jnp.sum(n_valid >= 0), body, (state, outs))
    return first, slots, state, lp


def _prefill_batch(cfg, kernels, use_mtp, params, state: DecodeState, tokens, n_valid, max_tokens, stop,
                   sampling=None, top_logprobs=None):
    start = state.lengths
    width = (cfg.hidden_size, params["embed"].dtype)  # a pass's output [B, T, E] is in the embedding's dtype
    if tokens.shape[1] > kernels.prefill_chunk and not kernels.deterministic:  # deterministic: as the engine's pieces
        hidden, state = target.forward_by_layer(cfg, params, state, tokens, n_valid, kernels, kernels.prefill_chunk)
    else:
        hidden, state = _chunked(lambda st, tok, nv, _h, _off: target.forward(cfg, params, st, tok, nv, kernels),
                                 kernels.prefill_chunk, state, tokens, n_valid, None, width)
    logits = target.logits_from_hidden(params, target.last_valid(hidden, n_valid), kernels)  # [B, V]
    in_prompt = smp.prompt_mask(tokens, n_valid, cfg.vocab_size)  # [B, V]
    first = choose(logits, sampling, start + n_valid, stop, in_prompt)  # the token at position n
    if use_mtp:
        def mtp_pass(st, tok, nv, h, offset):  # a chunk's MTP positions start `offset` tokens into the prompt
            return mtp.forward(cfg, params, st, tok, h, start + jnp.minimum(offset, n_valid), nv, kernels)

        mh, state = _chunked(mtp_pass, kernels.prefill_chunk, state, mtp.shift_left(tokens, n_valid, first),
                             n_valid, hidden, width)
        mh = target.last_valid(mh, n_valid)
        d1, q1 = draft(cfg, params, mh, kernels, sampling, start + n_valid + 1, first_counts(first, cfg.vocab_size),
                       stop, in_prompt)
    else:
        mh, d1 = jnp.zeros(hidden.shape[:1] + hidden.shape[2:], hidden.dtype), jnp.zeros_like(first)
        q1 = unread_q(cfg, first.shape[0])
    return (first, Slots.started(first, d1, q1, mh, max_tokens, stop, in_prompt), state,
            first_logprobs(logits, first, sampling, top_logprobs))


def _chunked(run, chunk: int, state: DecodeState, tokens, n_valid, hidden, out: tuple):
    """run over the prompt tokens [B, T] in chunks of `chunk` tokens (one pass if T <= chunk), each chunk
    after the KV and GDN/conv state the one before left: a lax.scan, so the program holds one chunk's
    pass and its attention scores; a chunk of padding only (past every row's prompt) is skipped.
    run(state, tokens [B, C], n_valid [B], hidden [B, C, E] | None, offset) -> (out [B, C, E], state), with
    offset the chunk's first token; hidden (for the MTP pass) is cut into the same chunks; out = (E, dtype)
    of run's output. Returns (out [B, T, E], state)."""
    b, t = tokens.shape
    if t <= chunk:
        return run(state, tokens, n_valid, hidden, 0)
    n = t // chunk  # T and chunk are powers of two
    offsets = jnp.arange(n, dtype=jnp.int32) * chunk
    xs = {"tokens": tokens.reshape(b, n, chunk).swapaxes(0, 1),  # [n, B, C]
          "n_valid": jnp.clip(n_valid[None] - offsets[:, None], 0, chunk),  # [n, B] each chunk's real tokens
          "offset": offsets}
    if hidden is not None:
        xs["hidden"] = hidden.reshape(b, n, chunk, -1).swapaxes(0, 1)  # [n, B, C, E]

    def one(state, x):
        def pass_(state):
            out, state = run(state, x["tokens"], x["n_valid"], x.get("hidden"), x["offset"])
            return state, out

        def skip(state):  # every row's prompt ended before this chunk (the bucket's padding): no pass
            return state, jnp.zeros((b, chunk, out[0]), out[1])

        return jax.lax.cond(jnp.any(x["n_valid"] > 0), pass_, skip, state)

    state, outs = jax.lax.scan(one, state, xs)  # [n, B, C, E]
    return outs.swapaxes(0, 1).reshape(b, t, -1), state
