"""Device-side slot surgery for the serving engine: put a request into a batch slot, snapshot it, retire it.

The engine keeps one DecodeState of B slots (conv/ssm rows, page-table rows, lengths) over one
shared KV page pool, plus a `decode.Slots` carry (pending token, d1, MTP hidden, remaining budget,
stop ids, done). Between bounded loop calls (`decode.greedy_steps`, `speculate.spec_rounds`) the
host calls these jitted functions; each takes the slot index as a traced int32, so one compiled
program serves every slot:

    prefill_into_slots prefill n prompts into slots b_1..b_n in one pass: an n-row sub-state (zero
                       conv/ssm, the slots' new page-table rows, length 0) over the shared KV pools
                       runs the same `prefill` as qmtp.generate; its rows then replace rows b_j of
                       the big state, and rows b_j of the carry get (pending = first token, d1, mh,
                       remaining - 1, stop ids, done = first is a stop id or remaining - 1 = 0);
                       padding rows (id >= B, no valid token) write nothing
    take_snapshot      the state at the end of slot b's prompt as a one-row DecodeState: conv/ssm
                       rows, and the Pn KV pages (target and MTP) of the prompt, renumbered 0..Pn-1
    restore_snapshot   the reverse into slot b's freshly reserved pages (pages >= n_pages are not
                       written: they belong to nobody or to another slot), then the carry row as above
    retire             marks slots done (cancelled, stopped by a stop string, aborted): a done slot
                       writes nothing, so its pages can be handed to another request at once

A state row is never cleared: prefill starts from zero conv/ssm rows of its own, a restore overwrites
the rows, and KV entries at positions >= a slot's length are masked (state.py). With a slotted GDN
state (the engine with MTP keeps it slotted between calls: state.gdn_slot_count), a row's
conv/ssm are its read slot's, slots.gdn_slot[b]: written and read there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from qmtp import decode, speculate
from qmtp.config import ModelConfig
from qmtp.state import DecodeState, PagedKV, gdn_slot_count


def _carry_rows(slots: decode.Slots, ids, first, d1, mh, remaining, stop_rows) -> decode.Slots:
    """Rows ids [n] of the carry after their first tokens first [n] were emitted (budgets remaining
    [n], stop ids stop_rows [n, NS]); an id outside [0, B) is a padding row and writes nothing."""
    left = remaining - 1
    done = decode.is_stop_rows(first, stop_rows) | (left <= 0)
    put = lambda a, v: a.at[ids].set(v.astype(a.dtype), mode="drop")  # noqa: E731
    return decode.Slots(pending=put(slots.pending, first), d1=put(slots.d1, d1), mh=put(slots.mh, mh),
                        remaining=put(slots.remaining, left), stop=put(slots.stop, stop_rows),
                        done=put(slots.done, done), gdn_slot=slots.gdn_slot)


def _carry_row(slots: decode.Slots, slot, first, d1, mh, remaining, stop_row) -> decode.Slots:
    """Slot `slot` of the carry after its first token `first` [1] was emitted (budget `remaining`)."""
    return _carry_rows(slots, jnp.reshape(slot, (1,)), first, d1, mh, jnp.reshape(remaining, (1,)), stop_row[None])


def _put_rows(state: DecodeState, ids, conv, ssm, page_rows, lengths, gdn_slot) -> DecodeState:
    """state with rows ids [n] of conv/ssm/page_table/lengths replaced (conv/ssm: Lg x [n, ...];
    page_rows [n, Pmax]; lengths [n]); an id outside [0, B) writes nothing. A slotted conv/ssm row
    is written to the row's read slot gdn_slot[id]."""
    put = lambda a, v: a.at[ids].set(v, mode="drop")  # noqa: E731
    put_gdn = put
    if gdn_slot_count(state):
        read = gdn_slot[jnp.clip(ids, 0, state.batch - 1)]  # [n]: padding ids are dropped by their row index
        put_gdn = lambda a, v: a.at[read, ids].set(v, mode="drop")  # noqa: E731
    return dataclasses.replace(
        state, conv=tuple(put_gdn(c, r) for c, r in zip(state.conv, conv)),
        ssm=tuple(put_gdn(s, r) for s, r in zip(state.ssm, ssm)),
        page_table=put(state.page_table, page_rows), lengths=put(state.lengths, lengths))


def _gdn_rows(state: DecodeState, slots: decode.Slots, rows) -> tuple[tuple, tuple]:
    """(conv, ssm) rows [n, ...] of the batch rows `rows` [n] (each from its read slot when slotted)."""
    take = (lambda a: a[slots.gdn_slot[rows], rows]) if gdn_slot_count(state) else (lambda a: a[rows])  # noqa: E731
    return tuple(map(take, state.conv)), tuple(map(take, state.ssm))


@functools.partial(jax.jit, static_argnames=("cfg", "use_mtp", "impl"), donate_argnames=("state",))
def prefill_into_slots(cfg: ModelConfig, use_mtp: bool, params: dict, state: DecodeState, slots: decode.Slots,
                       ids: jax.Array, page_rows: jax.Array, tokens: jax.Array, n_valid: jax.Array,
                       remaining: jax.Array, stop_rows: jax.Array, impl: str = "ref"):
    """Prefills n prompts (tokens [n, T] right-padded, n_valid [n]) into slots ids [n] in one pass.

    page_rows [n, Pmax] int32: each slot's reserved pages; remaining [n]: the requests' max_tokens;
    stop_rows [n, NS]. A padding row (n_valid 0, id >= B) writes no KV (invalid tokens are dropped)
    and no state or carry row. Returns (first tokens [n], state, slots)."""
    n = tokens.shape[0]
    zeros = lambda a: jnp.repeat(jnp.zeros_like(a[:1]), n, axis=0)  # noqa: E731  (zeros_like: a's TP sharding type)
    row = (lambda a: a[0]) if gdn_slot_count(state) else (lambda a: a)  # noqa: E731  a [B, ...] per slot
    sub = DecodeState(kv=state.kv, mtp_kv=state.mtp_kv, conv=tuple(zeros(row(c)) for c in state.conv),
                      ssm=tuple(zeros(row(s)) for s in state.ssm), page_table=page_rows,
                      lengths=jnp.zeros((n,), jnp.int32))
    if use_mtp:
        first, d1, mh, sub = speculate.prefill(cfg, params, sub, tokens, n_valid, impl=impl)
    else:
        first, _, sub = decode.prefill(cfg, params, sub, tokens, n_valid, impl=impl)
        d1, mh = jnp.zeros_like(first), zeros(slots.mh)
    state = dataclasses.replace(state, kv=sub.kv, mtp_kv=sub.mtp_kv)
    state = _put_rows(state, ids, sub.conv, sub.ssm, page_rows, sub.lengths, slots.gdn_slot)
    return first, state, _carry_rows(slots, ids, first, d1, mh, remaining, stop_rows)


@functools.partial(jax.jit, static_argnames=("n_pages",), donate_argnames=("state",))
def take_snapshot(n_pages: int, state: DecodeState, slots: decode.Slots, slot: jax.Array):
    """Slot `slot`'s state right after its prefill as a one-row DecodeState holding its first n_pages
    KV pages (target and MTP, renumbered 0..n_pages-1), and the prefill outputs of the carry.

    Returns (state (unchanged), snapshot, first token [1], d1 [1], mh [1, E])."""
    pages = state.page_table[slot, :n_pages]  # [Pn]
    take = lambda kv: PagedKV(tuple(k[pages] for k in kv.k), tuple(v[pages] for v in kv.v))  # [Pn, S, Hkv, D]
    conv, ssm = _gdn_rows(state, slots, jnp.reshape(slot, (1,)))
    snap = DecodeState(kv=take(state.kv), mtp_kv=take(state.mtp_kv), conv=conv, ssm=ssm,
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
    state = _put_rows(state, jnp.reshape(slot, (1,)), snap.conv, snap.ssm, page_row[None], snap.lengths,
                      slots.gdn_slot)
    return state, snap, _carry_row(slots, slot, first, d1, mh, remaining, stop_row)


@jax.jit
def retire(slots: decode.Slots, mask: jax.Array) -> decode.Slots:
    """Marks the slots with mask [B] done (they then ride along with n_valid = 0 and write nothing)."""
    return dataclasses.replace(slots, done=slots.done | mask)
