"""Device-side slot surgery for the serving engine: put a request into a batch slot, snapshot it, retire it.

The engine keeps one DecodeState of B slots (conv/ssm rows, page-table rows, lengths) over one
shared KV page pool, plus a `Slots` carry (pending token, d1, MTP hidden, remaining budget,
stop ids, done). Between bounded `loop.decode` calls the host calls these jitted functions; each takes the slot index as a traced int32, so one compiled
program serves every slot:

    prefill_into_slots prefill n prompts into slots b_1..b_n in one pass: an n-row sub-state (zero
                       conv/ssm, the slots' new page-table rows, length 0) over the shared KV pools
                       runs the same `loop.prefill` as qmtp.generate; its rows then replace rows b_j
                       of the big state, and rows b_j of the carry get `Slots.started`;
                       padding rows (id >= B, no valid token) write nothing
    take_snapshot      the state at the end of slot b's prompt as a one-row DecodeState: conv/ssm
                       rows, and the Pn KV pages (target and MTP) of the prompt, renumbered 0..Pn-1
    restore_snapshot   the reverse into slot b's freshly reserved pages (pages >= n_pages are not
                       written: they belong to nobody or to another slot), then the carry row as above
    retire             marks slots done (cancelled, stopped by a stop string, aborted): a done slot
                       writes nothing, so its pages can be handed to another request at once

A state row is never cleared: prefill starts from zero conv/ssm rows of its own, a restore overwrites
the rows, and KV entries at positions >= a slot's length are masked (state.py). The engine keeps the
GDN/conv state in the ring of K+2 slots between calls (qmtp/runtime/loop.py): a row's conv/ssm are its read
slot's, slots.gdn_slot[b], written and read there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from qmtp.model.config import ModelConfig
from qmtp.runtime import loop
from qmtp.runtime.kernel_config import KernelConfig
from qmtp.runtime.loop import Slots
from qmtp.runtime.state import DecodeState, PagedKV


def _put_carry_rows(slots: Slots, ids, new: Slots) -> Slots:
    """slots with rows ids [n] replaced by the rows of `new` (n rows; its read slots are not taken: a
    row keeps the slot its state was written to); an id outside [0, B) is a padding row and writes
    nothing."""
    put = lambda a, v: a.at[ids].set(v.astype(a.dtype), mode="drop")  # noqa: E731
    return dataclasses.replace(slots, pending=put(slots.pending, new.pending), d1=put(slots.d1, new.d1),
                               mh=put(slots.mh, new.mh), remaining=put(slots.remaining, new.remaining),
                               stop=put(slots.stop, new.stop), done=put(slots.done, new.done))


def _put_rows(state: DecodeState, ids, conv, ssm, page_rows, lengths, gdn_slot) -> DecodeState:
    """state with rows ids [n] of conv/ssm/page_table/lengths replaced (conv/ssm: Lg x [n, ...], each
    written to the row's read slot gdn_slot[id] of the ring; page_rows [n, Pmax]; lengths [n]); an id
    outside [0, B) writes nothing."""
    put = lambda a, v: a.at[ids].set(v, mode="drop")  # noqa: E731
    read = gdn_slot[jnp.clip(ids, 0, state.batch - 1)]  # [n]: padding ids are dropped by their row index
    put_gdn = lambda a, v: a.at[read, ids].set(v, mode="drop")  # noqa: E731
    return dataclasses.replace(
        state, conv=tuple(put_gdn(c, r) for c, r in zip(state.conv, conv)),
        ssm=tuple(put_gdn(s, r) for s, r in zip(state.ssm, ssm)),
        page_table=put(state.page_table, page_rows), lengths=put(state.lengths, lengths))


def _gdn_rows(state: DecodeState, slots: Slots, rows) -> tuple[tuple, tuple]:
    """(conv, ssm) rows [n, ...] of the batch rows `rows` [n], each from its read slot."""
    take = lambda a: a[slots.gdn_slot[rows], rows]  # noqa: E731
    return tuple(map(take, state.conv)), tuple(map(take, state.ssm))


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "use_mtp"), donate_argnames=("state",))
def prefill_into_slots(cfg: ModelConfig, kernels: KernelConfig, use_mtp: bool, params: dict, state: DecodeState,
                       slots: Slots, ids: jax.Array, page_rows: jax.Array, tokens: jax.Array, n_valid: jax.Array,
                       max_tokens: jax.Array, stop_rows: jax.Array):
    """Prefills n prompts (tokens [n, T] right-padded, n_valid [n]) into slots ids [n] in one pass.

    page_rows [n, Pmax] int32: each slot's reserved pages; max_tokens [n]: the requests' budgets;
    stop_rows [n, NS]. A padding row (n_valid 0, id >= B) writes no KV (invalid tokens are dropped)
    and no state or carry row. Returns (first tokens [n], state, slots)."""
    n = tokens.shape[0]
    zeros = lambda a: jnp.repeat(jnp.zeros_like(a[:1]), n, axis=0)  # noqa: E731  (zeros_like: a's TP sharding type)
    sub = DecodeState(kv=state.kv, mtp_kv=state.mtp_kv, conv=tuple(zeros(c[0]) for c in state.conv),
                      ssm=tuple(zeros(s[0]) for s in state.ssm), page_table=page_rows,
                      lengths=jnp.zeros((n,), jnp.int32))
    first, new, sub = loop.prefill(cfg, kernels, use_mtp, params, sub, tokens, n_valid, max_tokens, stop_rows)
    state = dataclasses.replace(state, kv=sub.kv, mtp_kv=sub.mtp_kv)
    state = _put_rows(state, ids, sub.conv, sub.ssm, page_rows, sub.lengths, slots.gdn_slot)
    return first, state, _put_carry_rows(slots, ids, new)


@functools.partial(jax.jit, static_argnames=("n_pages",), donate_argnames=("state",))
def take_snapshot(n_pages: int, state: DecodeState, slots: Slots, slot: jax.Array):
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
def restore_snapshot(state: DecodeState, snap: DecodeState, slots: Slots, slot: jax.Array,
                     page_row: jax.Array, n_pages: jax.Array, first: jax.Array, d1: jax.Array, mh: jax.Array,
                     max_tokens: jax.Array, stop_row: jax.Array):
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
    ids = jnp.reshape(slot, (1,))
    state = _put_rows(state, ids, snap.conv, snap.ssm, page_row[None], snap.lengths, slots.gdn_slot)
    new = Slots.started(first, d1, mh, jnp.reshape(max_tokens, (1,)), stop_row[None])
    return state, snap, _put_carry_rows(slots, ids, new)


@jax.jit
def retire(slots: Slots, mask: jax.Array) -> Slots:
    """Marks the slots with mask [B] done (they then ride along with n_valid = 0 and write nothing)."""
    return dataclasses.replace(slots, done=slots.done | mask)
