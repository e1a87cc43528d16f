"""Prefill and plain greedy decoding, the whole loop on the device (`lax.while_loop`).

Per sequence: the prompt is prefilled (right-padded to a common T), the first token is the argmax
at the last prompt position, then one target step per token until an EOS id or the sequence's
`max_new_tokens`. Finished sequences ride along with n_valid = 0, which changes none of their state.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from qmtp import model, tp
from qmtp.config import ModelConfig
from qmtp.state import DecodeState

PAD_TOKEN = -1  # fills the output buffer after a sequence stops


def greedy(logits: jax.Array) -> jax.Array:
    """argmax over the last axis; ties go to the lowest id (as torch.argmax and HF generate). Under
    tensor parallelism logits are this shard's vocabulary slice and the argmax is taken across shards."""
    return tp.greedy_argmax(logits)


def is_stop(tokens: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
    if not stop_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.any(tokens[..., None] == jnp.asarray(stop_ids, jnp.int32), axis=-1)


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("state",))
def prefill(cfg: ModelConfig, params: dict, state: DecodeState, tokens: jax.Array, n_valid: jax.Array,
            impl: str = "ref"):
    """Target over the prompts tokens [B, T] (n_valid [B] real tokens each).

    Returns (first generated token [B], hidden [B, T, E], state)."""
    hidden, state = model.forward(cfg, params, state, tokens, n_valid, impl=impl)
    last = model.last_valid(hidden, n_valid)  # [B, E]
    return greedy(model.logits_from_hidden(params, last, impl)), hidden, state


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """Static shape of a decode loop: output buffer width and stop ids."""

    max_tokens: int  # output buffer width (>= every max_new_tokens)
    stop_ids: tuple[int, ...]


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "impl"), donate_argnames=("state",))
def greedy_loop(cfg: ModelConfig, spec: LoopSpec, params: dict, state: DecodeState, first: jax.Array,
                max_new: jax.Array, impl: str = "ref"):
    """Plain greedy decoding. first [B] = token from prefill; max_new [B] >= 1.

    Returns (tokens [B, max_tokens] (PAD_TOKEN after the end), counts [B], steps, state)."""
    b = first.shape[0]
    out = jnp.full((b, spec.max_tokens), PAD_TOKEN, jnp.int32).at[:, 0].set(first)
    count = jnp.ones((b,), jnp.int32)
    done = is_stop(first, spec.stop_ids) | (count >= max_new)

    def cond(carry):
        _, _, _, _, done, step = carry
        return (~jnp.all(done)) & (step < spec.max_tokens)

    def body(carry):
        state, last, out, count, done, step = carry
        live = (~done).astype(jnp.int32)
        hidden, state = model.forward(cfg, params, state, last[:, None], live, impl=impl)
        nxt = greedy(model.logits_from_hidden(params, hidden[:, 0], impl))
        out = out.at[jnp.arange(b), jnp.where(done, spec.max_tokens, count)].set(nxt, mode="drop")
        count = count + live
        done = done | is_stop(nxt, spec.stop_ids) | (count >= max_new)
        return state, jnp.where(live > 0, nxt, last), out, count, done, step + 1

    state, _, out, count, _, steps = jax.lax.while_loop(cond, body, (state, first, out, count, done, jnp.int32(0)))
    return out, count, steps, state
