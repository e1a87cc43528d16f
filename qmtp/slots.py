"""Device-side slot surgery for the serving engine: put a request into a batch slot, snapshot it, retire it.

The engine keeps one DecodeState of B slots (conv/ssm rows, page-table rows, lengths) over one
shared KV page pool, plus a `decode.Slots` carry (pending token, d1, MTP hidden, remaining budget,
stop ids, done). Between bounded loop calls (`decode.greedy_steps`, `speculate.spec_rounds`) the
host calls these jitted functions; each takes the slot index as a traced int32, so one compiled
program serves every slot:

    prefill_into_slot  prefill one prompt into slot b: a one-row sub-state (zero conv/ssm, the slot's
                       new page-table row, length 0) over the shared KV pools runs the same
                       `prefill` as qmtp.generate; its rows then replace row b of the big state, and
                       row b of the carry gets (pending = first token, d1, mh, remaining - 1, stop ids,
                       done = first is a stop id or remaining - 1 = 0)
    take_snapshot      the state at the end of slot b's prompt as a one-row DecodeState: conv/ssm
                       rows, and the Pn KV pages (target and MTP) of the prompt, renumbered 0..Pn-1
    restore_snapshot   the reverse into slot b's freshly reserved pages (pages >= n_pages are not
                       written: they belong to nobody or to another slot), then the carry row as above
    retire             marks slots done (cancelled, stopped by a stop string, aborted): a done slot
                       writes nothing, so its pages can be handed to another request at once

A state row is never cleared: prefill starts from zero conv/ssm rows of its own, a restore overwrites
the rows, and KV entries at positions >= a slot's length are masked (state.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from qmtp import decode, speculate
from qmtp.config import ModelConfig
from qmtp.state import DecodeState, PagedKV


def _carry_row(slots: decode.Slots, slot, first, d1, mh, remaining, stop_row) -> decode.Slots:
    """Slot `slot` of the carry after its first token `first` [1] was emitted (budget `remaining`)."""
    left = remaining - 1
    done = decode.is_stop_rows(first, stop_row[None])[0] | (left <= 0)
    return decode.Slots(pending=slots.pending.at[slot].set(first[0]), d1=slots.d1.at[slot].set(d1[0]),
                        mh=slots.mh.at[slot].set(mh[0].astype(slots.mh.dtype)),
                        remaining=slots.remaining.at[slot].set(left), stop=slots.stop.at[slot].set(stop_row),
                        done=slots.done.at[slot].set(done))


def _put_rows(state: DecodeState, slot, conv, ssm, page_row, length) -> DecodeState:
    """state with row `slot` of conv/ssm/page_table/lengths replaced (conv/ssm: Lg x [1, ...])."""
    return dataclasses.replace(
        state, conv=tuple(c.at[slot].set(r[0]) for c, r in zip(state.conv, conv)),
        ssm=tuple(s.at[slot].set(r[0]) for s, r in zip(state.ssm, ssm)),
        page_table=state.page_table.at[slot].set(page_row), lengths=state.lengths.at[slot].set(length))


@functools.partial(jax.jit, static_argnames=("cfg", "use_mtp", "impl"), donate_argnames=("state",))
def prefill_into_slot(cfg: ModelConfig, use_mtp: bool, params: dict, state: DecodeState, slots: decode.Slots,
                      slot: jax.Array, page_row: jax.Array, tokens: jax.Array, n_valid: jax.Array,
                      remaining: jax.Array, stop_row: jax.Array, impl: str = "ref"):
    """Prefills one prompt (tokens [1, T] right-padded, n_valid [1]) into slot `slot` (int32 []).

    page_row [Pmax] int32: the slot's reserved pages; remaining (int32 []): the request's max_tokens;
    stop_row [NS] int32. Returns (first token [1], state, slots)."""
    sub = DecodeState(kv=state.kv, mtp_kv=state.mtp_kv, conv=tuple(jnp.zeros_like(c[:1]) for c in state.conv),
                      ssm=tuple(jnp.zeros_like(s[:1]) for s in state.ssm), page_table=page_row[None],
                      lengths=jnp.zeros((1,), jnp.int32))
    if use_mtp:
        first, d1, mh, sub = speculate.prefill(cfg, params, sub, tokens, n_valid, impl=impl)
    else:
        first, _, sub = decode.prefill(cfg, params, sub, tokens, n_valid, impl=impl)
        d1, mh = jnp.zeros_like(first), jnp.zeros_like(slots.mh[:1])
    state = dataclasses.replace(state, kv=sub.kv, mtp_kv=sub.mtp_kv)
    state = _put_rows(state, slot, sub.conv, sub.ssm, page_row, sub.lengths[0])
    return first, state, _carry_row(slots, slot, first, d1, mh, remaining, stop_row)


@functools.partial(jax.jit, static_argnames=("n_pages",), donate_argnames=("state",))
def take_snapshot(n_pages: int, state: DecodeState, slots: decode.Slots, slot: jax.Array):
    """Slot `slot`'s state right after its prefill as a one-row DecodeState holding its first n_pages
    KV pages (target and MTP, renumbered 0..n_pages-1), and the prefill outputs of the carry.

    Returns (state (unchanged), snapshot, first token [1], d1 [1], mh [1, E])."""
    pages = state.page_table[slot, :n_pages]  # [Pn]
    take = lambda kv: PagedKV(tuple(k[pages] for k in kv.k), tuple(v[pages] for v in kv.v))  # [Pn, S, Hkv, D]
    snap = DecodeState(kv=take(state.kv), mtp_kv=take(state.mtp_kv),
                       conv=tuple(c[slot][None] for c in state.conv), ssm=tuple(s[slot][None] for s in state.ssm),
                       page_table=jnp.arange(n_pages, dtype=jnp.int32)[None], lengths=state.lengths[slot][None])
    return state, snap, slots.pending[slot][None], slots.d1[slot][None], slots.mh[slot][None]


@functools.partial(jax.jit, donate_argnames=("state",))
def restore_snapshot(state: DecodeState, snap: DecodeState, slots: decode.Slots, slot: jax.Array,
                     page_row: jax.Array, n_pages: jax.Array, first: jax.Array, d1: jax.Array, mh: jax.Array,
                     remaining: jax.Array, stop_row: jax.Array):
    """Copies a snapshot into slot `slot` with its new pages page_row [Pmax]; only the first n_pages
    (int32 []) snapshot pages are written. first, d1 [1] and mh [1, E] are the prompt's prefill outputs.
    Returns (state, snapshot (unchanged), slots)."""
    pn = snap.page_table.shape[1]
    num_pages = state.kv.num_pages if state.kv.k else state.mtp_kv.num_pages
    dest = jnp.where(jnp.arange(pn) < n_pages, page_row[:pn], num_pages)  # out of range: dropped

    def put(pool: PagedKV, saved: PagedKV) -> PagedKV:
        return PagedKV(tuple(p.at[dest].set(s, mode="drop") for p, s in zip(pool.k, saved.k)),
                       tuple(p.at[dest].set(s, mode="drop") for p, s in zip(pool.v, saved.v)))

    state = dataclasses.replace(state, kv=put(state.kv, snap.kv), mtp_kv=put(state.mtp_kv, snap.mtp_kv))
    state = _put_rows(state, slot, snap.conv, snap.ssm, page_row, snap.lengths[0])
    return state, snap, _carry_row(slots, slot, first, d1, mh, remaining, stop_row)


@jax.jit
def retire(slots: decode.Slots, mask: jax.Array) -> decode.Slots:
    """Marks the slots with mask [B] done (they then ride along with n_valid = 0 and write nothing)."""
    return dataclasses.replace(slots, done=slots.done | mask)
