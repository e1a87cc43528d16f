"""Prefill and plain greedy decoding, the whole loop on the device (`lax.while_loop`).

Per sequence: the prompt is prefilled (right-padded to a common T), the first token is the argmax
at the last prompt position, then one target step per token until an EOS id or the sequence's
`max_new_tokens`. Finished sequences ride along with n_valid = 0, which changes none of their state.

Two loops share one step (`_step`):
  greedy_loop    a whole generation from `prefill` (static stop ids, output width max_tokens);
  greedy_steps   at most N steps resumed from a carried `Slots` (per-slot pending token, remaining
                 budget, stop ids, done flag), for the serving engine: between calls the host inserts
                 new requests into free slots and retires finished ones (qmtp.slots).
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


NO_STOP = -1  # an unused entry of a per-slot stop-id row


def is_stop_rows(tokens: jax.Array, stop: jax.Array) -> jax.Array:
    """Per-sequence stop ids: tokens [B, ...] against stop [B, NS] (NO_STOP entries match nothing)."""
    stop = stop.reshape(stop.shape[:1] + (1,) * (tokens.ndim - 1) + stop.shape[1:])  # [B, 1.., NS]
    return jnp.any((tokens[..., None] == stop) & (stop >= 0), axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """What a resumable loop carries per batch slot besides the DecodeState (all replicated under TP).

        pending    [B] int32      the next token the target consumes (t_L: emitted, not yet in the KV)
        d1         [B] int32      MTP: the first draft of the next round (plain decoding: unused)
        mh         [B, E]         MTP: the post-mtp.norm hidden that drafted d1 (plain: unused)
        remaining  [B] int32      tokens the slot may still emit (its max_tokens minus those emitted)
        stop       [B, NS] int32  the slot's stop ids, NO_STOP-padded
        done       [B] bool       finished, retired or empty: rides along with n_valid = 0 (no writes)
        gdn_slot   [B] int32      MTP with a slotted GDN state kept between calls (the serving engine on
                                  one device, speculate.spec_rounds): the slot each row's GDN/conv state
                                  is read from; 0 otherwise
    """

    pending: jax.Array
    d1: jax.Array
    mh: jax.Array
    remaining: jax.Array
    stop: jax.Array
    done: jax.Array
    gdn_slot: jax.Array

    @staticmethod
    def empty(batch: int, hidden: int, num_stop: int, dtype) -> "Slots":
        zeros = jnp.zeros((batch,), jnp.int32)
        return Slots(pending=zeros, d1=zeros, mh=jnp.zeros((batch, hidden), dtype), remaining=zeros,
                     stop=jnp.full((batch, num_stop), NO_STOP, jnp.int32), done=jnp.ones((batch,), bool),
                     gdn_slot=zeros)


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("state",))
def prefill(cfg: ModelConfig, params: dict, state: DecodeState, tokens: jax.Array, n_valid: jax.Array,
            impl: str = "ref"):
    """Target over the prompts tokens [B, T] (n_valid [B] real tokens each).

    Returns (first generated token [B], hidden [B, T, E], state)."""
    hidden, state = model.forward(cfg, params, state, tokens, n_valid, impl=impl)
    last = model.last_valid(hidden, n_valid)  # [B, E]
    return greedy(model.logits_from_hidden(params, last, impl)), hidden, state


def _step(cfg: ModelConfig, params: dict, state: DecodeState, last: jax.Array, live: jax.Array, impl: str):
    """One target step: last [B] at position lengths[b] (rows with live[b] = 0 change nothing).

    Returns (greedy next token [B], state)."""
    hidden, state = model.forward(cfg, params, state, last[:, None], live, impl=impl)  # hidden [B, 1, E]
    return greedy(model.logits_from_hidden(params, hidden[:, 0], impl)), state


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
        nxt, state = _step(cfg, params, state, last, live, impl)
        out = out.at[jnp.arange(b), jnp.where(done, spec.max_tokens, count)].set(nxt, mode="drop")
        count = count + live
        done = done | is_stop(nxt, spec.stop_ids) | (count >= max_new)
        return state, jnp.where(live > 0, nxt, last), out, count, done, step + 1

    state, _, out, count, _, steps = jax.lax.while_loop(cond, body, (state, first, out, count, done, jnp.int32(0)))
    return out, count, steps, state


@functools.partial(jax.jit, static_argnames=("cfg", "n_steps", "impl"), donate_argnames=("state",))
def greedy_steps(cfg: ModelConfig, n_steps: int, params: dict, state: DecodeState, slots: Slots,
                 impl: str = "ref"):
    """At most n_steps plain greedy steps resumed from `slots` (stops early once every slot is done).

    Step: token = argmax(target(pending)); emitted unless the slot is done; the slot is done after a
    stop id (slots.stop) or when `remaining` reaches 0. Returns (tokens [B, n_steps] (PAD_TOKEN
    after each slot's count), counts [B], state, slots); the same tokens as greedy_loop."""
    b = slots.done.shape[0]
    out = jnp.full((b, n_steps), PAD_TOKEN, jnp.int32)
    count = jnp.zeros((b,), jnp.int32)

    def cond(carry):
        done, step = carry[4], carry[5]
        return (~jnp.all(done)) & (step < n_steps)

    def body(carry):
        state, last, out, count, done, step = carry
        live = (~done).astype(jnp.int32)
        nxt, state = _step(cfg, params, state, last, live, impl)
        out = out.at[jnp.arange(b), jnp.where(done, n_steps, count)].set(nxt, mode="drop")
        count = count + live
        done = done | is_stop_rows(nxt, slots.stop) | (count >= slots.remaining)
        return state, jnp.where(live > 0, nxt, last), out, count, done, step + 1

    carry = (state, slots.pending, out, count, slots.done, jnp.int32(0))
    state, last, out, count, done, _ = jax.lax.while_loop(cond, body, carry)
    slots = dataclasses.replace(slots, pending=last, remaining=slots.remaining - count, done=done)
    return out, count, state, slots
