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

from pallas_kernels import gdn_conv
from qmtp import model, ops, tp
from qmtp.config import ModelConfig
from qmtp.state import DecodeState, gdn_slot_count

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


def gdn_conv_path(impl: str, ssm_dtype) -> bool:
    """Whether a pass runs the GDN layers through the conv kernel (or, impl="ref", its jnp twin) with an
    f32 state: the paths that can read and write slotted GDN state."""
    return (impl == "ref" or ops.gdn_conv_in_kernel(impl)) and jnp.dtype(ssm_dtype) == jnp.float32


PLAIN_GDN_SLOTS = 2  # a plain step writes one state besides the one it reads


def plain_gdn_slots(impl: str, ssm_dtype) -> int:
    """PLAIN_GDN_SLOTS when the plain loops slot the GDN state (ops.GDN_PLAIN_SLOTS on a gdn_conv_path),
    else 0."""
    return PLAIN_GDN_SLOTS if ops.GDN_PLAIN_SLOTS and gdn_conv_path(impl, ssm_dtype) else 0


def slot_gdn_state(state: DecodeState, n: int) -> tuple[DecodeState, jax.Array]:
    """(state with each GDN layer's conv and ssm state in n slots [n, B, ...], read slots [B] = 0)."""
    slot = lambda x: jnp.broadcast_to(x, (n,) + x.shape)  # noqa: E731
    state = dataclasses.replace(state, conv=tuple(map(slot, state.conv)), ssm=tuple(map(slot, state.ssm)))
    return state, jnp.zeros(state.lengths.shape, jnp.int32)


def unslot_gdn_state(state: DecodeState, read: jax.Array) -> DecodeState:
    """The state with each row's read slot taken out of the slotted conv and ssm state."""
    take = lambda x: gdn_conv.read_slot(x, read)  # noqa: E731
    return dataclasses.replace(state, conv=tuple(map(take, state.conv)), ssm=tuple(map(take, state.ssm)))


def _plain_slots(state: DecodeState, impl: str, kept=None) -> tuple[DecodeState, jax.Array | None, bool]:
    """(state, read slots or None, slotted here): a state that arrives slotted (the engine's, two slots,
    read slots `kept`) stays so; otherwise it is slotted for the loop when plain_gdn_slots says so."""
    if gdn_slot_count(state):
        if gdn_slot_count(state) != PLAIN_GDN_SLOTS or kept is None:
            raise ValueError(f"plain decoding: the state has {gdn_slot_count(state)} GDN state slots; the plain "
                             "loops take 2 (ops.GDN_PLAIN_SLOTS) with the read slots in Slots.gdn_slot")
        return state, kept, False
    if not state.ssm or not plain_gdn_slots(impl, state.ssm[0].dtype):
        return state, None, False
    return (*slot_gdn_state(state, PLAIN_GDN_SLOTS), True)


def _step(cfg: ModelConfig, params: dict, state: DecodeState, last: jax.Array, live: jax.Array, impl: str,
          gdn_slots=None):
    """One target step: last [B] at position lengths[b] (rows with live[b] = 0 change nothing).

    gdn_slots int [B] or None: the GDN/conv state is slotted (two slots) and row b reads slot gdn_slots[b];
    the step writes the state after its token to the other slot.

    Returns (greedy next token [B], state, next read slots or None)."""
    hidden, state = model.forward(cfg, params, state, last[:, None], live, impl=impl,
                                  gdn_slots=gdn_slots)  # hidden [B, 1, E]
    if gdn_slots is not None:  # a live row's new state is in the next slot; a done row's stays put
        gdn_slots = gdn_conv.next_slots(gdn_slots, live, gdn_slot_count(state))
    return greedy(model.logits_from_hidden(params, hidden[:, 0], impl)), state, gdn_slots


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

    state, read, _ = _plain_slots(state, impl)

    def cond(carry):
        done, step = carry[4], carry[5]
        return (~jnp.all(done)) & (step < spec.max_tokens)

    def body(carry):
        state, last, out, count, done, step, read = carry
        live = (~done).astype(jnp.int32)
        nxt, state, read = _step(cfg, params, state, last, live, impl, read)
        out = out.at[jnp.arange(b), jnp.where(done, spec.max_tokens, count)].set(nxt, mode="drop")
        count = count + live
        done = done | is_stop(nxt, spec.stop_ids) | (count >= max_new)
        return state, jnp.where(live > 0, nxt, last), out, count, done, step + 1, read

    carry = (state, first, out, count, done, jnp.int32(0), read)
    state, _, out, count, _, steps, read = jax.lax.while_loop(cond, body, carry)
    return out, count, steps, state if read is None else unslot_gdn_state(state, read)


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
    state, read, slotted_here = _plain_slots(state, impl, slots.gdn_slot)

    def cond(carry):
        done, step = carry[4], carry[5]
        return (~jnp.all(done)) & (step < n_steps)

    def body(carry):
        state, last, out, count, done, step, read = carry
        live = (~done).astype(jnp.int32)
        nxt, state, read = _step(cfg, params, state, last, live, impl, read)
        out = out.at[jnp.arange(b), jnp.where(done, n_steps, count)].set(nxt, mode="drop")
        count = count + live
        done = done | is_stop_rows(nxt, slots.stop) | (count >= slots.remaining)
        return state, jnp.where(live > 0, nxt, last), out, count, done, step + 1, read

    carry = (state, slots.pending, out, count, slots.done, jnp.int32(0), read)
    state, last, out, count, done, _, read = jax.lax.while_loop(cond, body, carry)
    if slotted_here:
        state, read = unslot_gdn_state(state, read), slots.gdn_slot
    slots = dataclasses.replace(slots, pending=last, remaining=slots.remaining - count, done=done,
                                gdn_slot=slots.gdn_slot if read is None else read)
    return out, count, state, slots
