"""Scoring a sequence: the target's log-probability of each of its tokens given the tokens before it
(teacher forcing), with the most likely alternatives at each position. What loglikelihood evaluations
and perplexity need, and the server's `echo` with `logprobs` (a prompt's tokens reported as OpenAI
reports them).

    log p(x_i | x_<i) = log_softmax(z_{i-1})[x_i],   i = 1 .. T-1

z_{i-1} being the target's logits at position i - 1 (temperature 1, no adjustment); x_0 has no score.
One prompt at a time, padded to its power-of-two bucket (prompts of one bucket share the program); the
target runs over it as the prefill does (chunk by chunk past KernelConfig.prefill_chunk), and the logits
are made a block of positions at a time (SCORE_BLOCK, at most a prefill chunk), so no [T, V] array is formed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import qmtp.api as api  # not `from qmtp import api`: the package's __init__ imports this module
from qmtp.model import target
from qmtp.runtime import sampling as smp, tp as tp_lib
from qmtp.sampling_args import check_logprobs

SCORE_BLOCK = 128  # positions whose logits [SCORE_BLOCK, V] exist at once (fewer where the prefill chunk is smaller)


def score(model: api.Model, prompts, top_logprobs: int = 0) -> list[list[api.TokenLogprob]]:
    """Per prompt (text or token ids), the TokenLogprob of each token but the first (T - 1 of them: none
    for a one-token prompt), with its top_logprobs (0 .. 20) most likely alternatives and its rank (1 + the
    ids more likely than it); ValueError naming a bad prompt or top_logprobs."""
    check_logprobs(top_logprobs)
    out = []
    for ids in api.encode(model, prompts):
        if len(ids) < 2:
            out.append([])
            continue
        tokens, n_valid = api._prompt_batch([ids])  # [1, T], [1]
        state = api._new_state(model, [tokens.shape[1]])
        lp, rank = api._call(model, _score, (model.cfg, model.kernels, top_logprobs),
                             (model.params, state, tokens, n_valid), ("params", "state", "rep", "rep"), ("rep", "rep"))
        chosen, top_ids, top, rank = (np.asarray(a)[:len(ids) - 1] for a in (lp.chosen, lp.top_ids, lp.top, rank))
        out.append([api.TokenLogprob(t, float(c), list(zip(i.tolist(), v.tolist())), int(r))
                    for t, c, i, v, r in zip(ids[1:], chosen, top_ids, top, rank)])
    return out


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "top_logprobs"))
def _score(cfg, kernels, top_logprobs: int, params: dict, state, tokens: jax.Array, n_valid: jax.Array):
    """(TokenLogprobs [T] of tokens[0, 1:] (then a filler) at positions 0 .. T-1, their ranks [T] int32) for one
    prompt tokens [1, T] (n_valid [1] real tokens)."""
    t = tokens.shape[1]
    if t > kernels.prefill_chunk:  # T and the chunk are powers of two: whole chunks
        hidden, _ = target.forward_by_layer(cfg, params, state, tokens, n_valid, kernels, kernels.prefill_chunk)
    else:
        hidden, _ = target.forward(cfg, params, state, tokens, n_valid, kernels)
    block = min(SCORE_BLOCK, kernels.prefill_chunk, t)  # powers of two: whole blocks
    nexts = jnp.concatenate([tokens[0, 1:], tokens[0, :1]])  # [T]: the token each position predicts
    blocks = (hidden[0].reshape(t // block, block, -1), nexts.reshape(t // block, block))

    def one(b):  # a block's TokenLogprobs [block] and ranks [block]
        h, x = b
        logits = tp_lib.gather_vocab(target.logits_from_hidden(params, h, kernels)).astype(jnp.float32)  # [block, V]
        lp = jax.tree.map(lambda a: a[0], smp.token_logprobs(logits[None], x[None], None, top_logprobs))
        chosen = jnp.take_along_axis(logits, x[:, None], axis=-1)  # [block, 1]: ranked by logit, as by logprob
        return lp, 1 + jnp.sum(logits > chosen, axis=-1, dtype=jnp.int32)

    out = jax.lax.map(one, blocks)  # [T / block, block, ...]
    return jax.tree.map(lambda a: a.reshape((t,) + a.shape[2:]), out)
