"""The serving engine's device side: one DecodeState of B slot rows over a shared KV page pool, the
`loop.Slots` carry, and every device call the scheduler (qmtp/serve/engine.py) makes on them.

The scheduler decides (which request, slot and pages); `DeviceBatch` only moves arrays. Slot indices,
page rows and stop rows are traced values, so the compiled programs are one loop, two prefills per
prompt bucket (1 and `prefill_batch` rows), and the prefix cache's passes, checkpoint and resume. A padding row (id B,
no valid token) writes nothing; a done slot writes nothing, so its pages can be handed on at once.

A state row is never cleared: a prefill starts from zero conv/ssm rows of its own, a resume
overwrites the rows, and KV entries at positions >= a slot's length are masked. The GDN/conv state
stays in the loop's ring of K+2 slots between calls (qmtp/runtime/loop.py), so no call copies it in
and out (~0.6 GB per sequence at 27B, K=3); row b's conv/ssm live in its read slot slots.gdn_slot[b].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from qmtp import api
from qmtp.model import mtp, target
from qmtp.model.config import ModelConfig
from qmtp.runtime import adaptive_k, loop, prefill, tp as tp_lib
from qmtp.runtime.kernel_config import KernelConfig
from qmtp.runtime.loop import Slots
from qmtp.runtime import sampling as smp
from qmtp.runtime.sampling import MAX_TOP_LOGPROBS
from qmtp.runtime.state import DecodeState, init_state


def _optional(sampling) -> tuple:
    """A device call's trailing sampling argument: none for greedy (the programs without it)."""
    return () if sampling is None else (sampling,)


def _put_rows(state: DecodeState, slots: Slots, ids, conv, ssm, page_rows, lengths, new: Slots):
    """(state, slots) with rows ids [n] replaced: conv/ssm (Lg x [n, ...]) in each row's read slot
    slots.gdn_slot[id], page_rows [n, Pmax], lengths [n], and the carry rows by the n rows of `new`
    except their read slots (a row keeps the slot its state was written to). An id outside [0, B)
    writes nothing."""
    put = lambda a, v: a.at[ids].set(v.astype(a.dtype), mode="drop")  # noqa: E731
    read = slots.gdn_slot[jnp.clip(ids, 0, state.batch - 1)]  # [n]: padding ids are dropped by their row index
    put_gdn = lambda a, v: a.at[read, ids].set(v, mode="drop")  # noqa: E731
    state = dataclasses.replace(
        state, conv=tuple(put_gdn(c, r) for c, r in zip(state.conv, conv)),
        ssm=tuple(put_gdn(s, r) for s, r in zip(state.ssm, ssm)),
        page_table=put(state.page_table, page_rows), lengths=put(state.lengths, lengths))
    return state, dataclasses.replace(slots, **{f: put(getattr(slots, f), getattr(new, f))
                                                for f in ("pending", "d1", "q1", "mh", "remaining", "stop", "done",
                                                          "accept_ema", "counts", "in_prompt")})


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "use_mtp"), donate_argnames=("state",))
def prefill_into_slots(cfg: ModelConfig, kernels: KernelConfig, use_mtp: bool, params: dict, state: DecodeState,
                       slots: Slots, ids: jax.Array, page_rows: jax.Array, tokens: jax.Array, n_valid: jax.Array,
                       max_tokens: jax.Array, stop_rows: jax.Array, sampling=None):
    """Prefills n prompts (tokens [n, T] right-padded, n_valid [n]) into slots ids [n] in one pass: an
    n-row sub-state (zero conv/ssm, page_rows [n, Pmax], length 0) over the shared KV pools runs the
    same `prefill.prefill` as qmtp.generate; its rows then replace rows ids of the state, and the carry
    rows get `Slots.started` with budgets max_tokens [n] and stop_rows [n, NS]; sampling: the rows'
    SamplingParams (greedy rows at temperature 0) or None. Returns (first tokens [n], state, slots, their
    TokenLogprobs [n, 1] with MAX_TOP_LOGPROBS alternatives: a request may ask for them)."""
    n = tokens.shape[0]
    zeros = lambda a: jnp.repeat(jnp.zeros_like(a[:1]), n, axis=0)  # noqa: E731  (zeros_like: a's TP sharding type)
    sub = DecodeState(kv=state.kv, mtp_kv=state.mtp_kv, conv=tuple(zeros(c[0]) for c in state.conv),
                      ssm=tuple(zeros(s[0]) for s in state.ssm), page_table=page_rows,
                      lengths=jnp.zeros((n,), jnp.int32))
    first, new, sub, lp = prefill.prefill(cfg, kernels, use_mtp, params, sub, tokens, n_valid, max_tokens,
                                          stop_rows, sampling, MAX_TOP_LOGPROBS)
    state = dataclasses.replace(state, kv=sub.kv, mtp_kv=sub.mtp_kv)
    return first, *_put_rows(state, slots, ids, sub.conv, sub.ssm, page_rows, sub.lengths, new), lp


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "use_mtp"), donate_argnames=("state",))
def prefill_piece(cfg: ModelConfig, kernels: KernelConfig, use_mtp: bool, params: dict, state: DecodeState,
                  slots: Slots, ids: jax.Array, page_rows: jax.Array, offsets: jax.Array, tokens: jax.Array,
                  next_tokens: jax.Array, n_valid: jax.Array, last: jax.Array, max_tokens: jax.Array,
                  stop_rows: jax.Array, sampling=None):
    """One pass of n prompts in progress into slots ids [n] (an id past the last slot: a padding row,
    n_valid 0): row i's tokens [n, C] at positions offsets[i] .. offsets[i] + n_valid[i] - 1, after the KV
    pages (page_rows [n, Pmax]) and the conv/ssm rows in its slot's read slot that its passes before left
    (zero rows at offset 0). The math of one chunk of prefill.prefill (there the target runs layer by layer
    over all chunks; under KernelConfig.deterministic the same passes): the target,
    then the MTP head over next_tokens [n, C] (the prompt one token ahead; on a row's `last` [n] pass its
    last valid token becomes the first generated one). A row whose pass is not last leaves its slot done,
    so decode rounds skip it; a last one starts it like prefill_into_slots (budgets max_tokens [n], stop
    rows [n, NS]). Returns (first tokens [n] (meaningful on last passes), state, slots, their
    TokenLogprobs [n, 1], the target's hidden [n, E] at each row's last position (a prefix cache
    checkpoint's))."""
    n = tokens.shape[0]
    rows = jnp.clip(ids, 0, state.batch - 1)  # padding rows read row B - 1 and write nothing
    read = slots.gdn_slot[rows]  # [n]

    def resume(ring):  # [n, ...]: the slot's rows after its earlier passes, zeros before the first
        got = ring[read, rows]
        return jnp.where((offsets > 0).reshape((n,) + (1,) * (got.ndim - 1)), got, 0).astype(ring.dtype)

    sub = DecodeState(kv=state.kv, mtp_kv=state.mtp_kv, conv=tuple(map(resume, state.conv)),
                      ssm=tuple(map(resume, state.ssm)), page_table=page_rows, lengths=offsets)
    hidden, sub = target.forward(cfg, params, sub, tokens, n_valid, kernels)  # hidden [n, C, E]
    logits = target.logits_from_hidden(params, target.last_valid(hidden, n_valid), kernels)  # [n, V]
    # [n, V]: the prompt's ids so far (the repetition penalty's); before this pass's, those its earlier passes
    # or a resume (resume_prefix) left
    in_prompt = (jnp.where((offsets > 0)[:, None], slots.in_prompt[rows], False)
                 | smp.prompt_mask(tokens, n_valid, cfg.vocab_size))
    first = loop.choose(logits, sampling, offsets + n_valid, stop_rows, in_prompt)  # [n]
    if use_mtp:
        at = (jnp.arange(n), jnp.maximum(n_valid - 1, 0))  # each row's last valid column
        shifted = next_tokens.at[at].set(jnp.where(last, first, next_tokens[at]))
        mh, sub = mtp.forward(cfg, params, sub, shifted, hidden, offsets, n_valid, kernels)
        mh = target.last_valid(mh, n_valid)  # [n, E]
        d1, q1 = loop.draft(cfg, params, mh, kernels, sampling, offsets + n_valid + 1,
                            loop.first_counts(first, cfg.vocab_size), stop_rows, in_prompt)
    else:
        mh, d1 = jnp.zeros(hidden.shape[:1] + hidden.shape[2:], hidden.dtype), jnp.zeros_like(first)
        q1 = loop.unread_q(cfg, first.shape[0])
    new = Slots.started(first, d1, q1, mh, max_tokens, stop_rows, in_prompt)
    new = dataclasses.replace(new, done=new.done | ~last)
    state = dataclasses.replace(state, kv=sub.kv, mtp_kv=sub.mtp_kv)
    lp = prefill.first_logprobs(logits, first, sampling, MAX_TOP_LOGPROBS)
    last_hidden = target.last_valid(hidden, n_valid)  # [n, E]
    return first, *_put_rows(state, slots, ids, sub.conv, sub.ssm, page_rows, sub.lengths, new), lp, last_hidden


@functools.partial(jax.jit, donate_argnames=("state",))
def take_gdn_rows(state: DecodeState, slots: Slots, slot: jax.Array):
    """Slot `slot`'s GDN rows, from its read slot: (state (unchanged), (conv rows, ssm rows), each [1, ...])."""
    take = lambda ring: ring[slots.gdn_slot[slot], slot][None]  # noqa: E731
    return state, (tuple(map(take, state.conv)), tuple(map(take, state.ssm)))


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "use_mtp"), donate_argnames=("state",))
def resume_prefix(cfg: ModelConfig, kernels: KernelConfig, use_mtp: bool, params: dict, state: DecodeState,
                  gdn_rows: tuple, slots: Slots, slot: jax.Array, page_row: jax.Array, copy_from: jax.Array,
                  copy_to: jax.Array, hidden: jax.Array, next_token: jax.Array, boundary: jax.Array,
                  rewrite: jax.Array, in_prompt: jax.Array):
    """Resumes slot `slot` (int32 []) at a prefix cache checkpoint of `boundary` tokens (qmtp/serve/
    prefix_cache.py): the checkpoint's GDN rows (take_gdn_rows') go to the slot's read slot; its KV pages
    copy_from [Pmax] are copied into the slot's own pages copy_to [Pmax] (entries past the pool: none;
    at least its last page, which holds position boundary - 1, the others where not shared); and with MTP
    and `rewrite` (bool []: a block checkpoint, not a response's end), the MTP KV at boundary - 1 is
    written again from the checkpoint's hidden h_{b-1} [1, E] and the request's own token there,
    next_token (int32 []). The piece prefill then continues at `boundary`. in_prompt [V] bool: the ids of
    the request's first `boundary` tokens (Slots.in_prompt's row). Returns (the state, Slots.in_prompt)."""
    read = slots.gdn_slot[slot]
    put = lambda ring, row: ring.at[read, slot].set(row[0])  # noqa: E731
    copy = lambda pool: pool.at[copy_to].set(pool[jnp.minimum(copy_from, pool.shape[0] - 1)],  # noqa: E731
                                             mode="drop")
    conv, ssm = gdn_rows
    state = dataclasses.replace(state, conv=tuple(map(put, state.conv, conv)), ssm=tuple(map(put, state.ssm, ssm)),
                                kv=jax.tree.map(copy, state.kv), mtp_kv=jax.tree.map(copy, state.mtp_kv))
    if use_mtp:
        sub = dataclasses.replace(state, page_table=page_row[None], lengths=boundary[None] - 1)
        _, sub = mtp.forward(cfg, params, sub, next_token.reshape(1, 1), hidden[:, None], boundary[None] - 1,
                             rewrite.astype(jnp.int32)[None], kernels)  # n_valid 0 writes nothing
        state = dataclasses.replace(state, mtp_kv=sub.mtp_kv)
    return state, slots.in_prompt.at[slot].set(in_prompt)


class DeviceBatch:
    """The state and carry of B slots, and the device calls on them (one device, or one shard_map)."""

    def __init__(self, model: api.Model, batch_slots: int, pages_per_slot: int, num_pages: int, max_stop_ids: int,
                 mtp_k: int):
        self.model, self.k, self.num_pages = model, mtp_k, num_pages
        # every device call goes through this (api._call's signature): the warm-up's precompile swaps in a
        # recorder for one pass (qmtp/serve/warmup.py)
        self.call = api._call
        cfg, dtype = model.cfg, api.DTYPES[model.dtype]
        args = (np.zeros((batch_slots, pages_per_slot), np.int32), num_pages, model.page_size, dtype)  # [B, Pmax]
        ring = loop.ring_size(mtp_k)
        self.state = (init_state(cfg, *args, gdn_slots=ring) if model.mesh is None
                      else tp_lib.init_state(cfg, model.mesh, *args, gdn_slots=ring))
        self.slots = Slots.empty(batch_slots, cfg.hidden_size, cfg.vocab_size, max_stop_ids, dtype)
        # one device: the params' (None under TP). State and carry are committed to it from the start, as the
        # outputs of the calls that replace them are: a program compiled for uncommitted arguments is not the
        # one a call with committed ones looks up (the warm-up's precompile relies on that)
        self.device = model.device
        if self.device is not None:
            self.state, self.slots = jax.device_put((self.state, self.slots), self.device)
        # a response end's resume has no hidden: these zeros [1, E], placed as a pass's hiddens are, so that
        # both kinds of resume are one program
        self._no_hidden = jax.device_put(np.zeros((1, cfg.hidden_size), model.params["embed"].dtype),
                                         self.device or tp_lib.replicated(model.mesh))

    def prefill(self, ids, page_rows, tokens, n_valid, remaining, stop_rows, sampling=None):
        """prefill_into_slots; returns each row's first token [n] and its TokenLogprobs [n, 1] (host)."""
        m = self.model
        args = (m.params, self.state, self.slots, ids, page_rows, tokens, n_valid, remaining, stop_rows)
        first, self.state, self.slots, lp = self.call(
            m, prefill_into_slots, (m.cfg, m.kernels, bool(self.k)), args + _optional(sampling),
            ("params", "state") + ("rep",) * (7 + len(_optional(sampling))), ("rep", "state", "rep", "rep"))
        return jax.device_get((first, lp))

    def prefill_piece(self, ids, page_rows, offsets, tokens, next_tokens, n_valid, last, max_tokens, stop_rows,
                      sampling=None):
        """prefill_piece (every argument a host array of n rows); returns the first tokens [n] and their
        TokenLogprobs [n, 1] (host; meaningful on last passes), and the rows' last target hiddens [n, E]
        (device)."""
        m = self.model
        i32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
        args = (m.params, self.state, self.slots, i32(ids), i32(page_rows), i32(offsets), i32(tokens),
                i32(next_tokens), i32(n_valid), np.asarray(last, bool), i32(max_tokens), i32(stop_rows))
        first, self.state, self.slots, lp, hidden = self.call(
            m, prefill_piece, (m.cfg, m.kernels, bool(self.k)), args + _optional(sampling),
            ("params", "state") + ("rep",) * (10 + len(_optional(sampling))), ("rep", "state", "rep", "rep", "rep"))
        return (*jax.device_get((first, lp)), hidden)

    def take_gdn_rows(self, slot: int) -> tuple:
        """take_gdn_rows: the slot's (conv rows, ssm rows)."""
        self.state, rows = self.call(self.model, take_gdn_rows, (), (self.state, self.slots, np.int32(slot)),
                                     ("state", "rep", "rep"), ("state", "gdn_rows"))
        return rows

    def gdn_row_bytes(self) -> int:
        """Device bytes of one take_gdn_rows."""
        size = lambda a: a.size * a.dtype.itemsize  # noqa: E731
        return sum(map(size, self.state.conv + self.state.ssm)) // self.state.batch // loop.ring_size(self.k)

    def memory_headroom(self) -> int | None:
        """Device bytes beyond the most used so far (peak_bytes_in_use), summed over the model's devices,
        where a sharded state's rows spread (the least on any one, times their count); None where a device
        reports no memory statistics (the CPU)."""
        devices = jax.tree.leaves(self.model.params)[0].devices()
        stats = [d.memory_stats() for d in devices]
        if not all(s and "bytes_limit" in s and "peak_bytes_in_use" in s for s in stats):
            return None
        return len(stats) * min(s["bytes_limit"] - s["peak_bytes_in_use"] for s in stats)

    def page_bytes(self) -> int:
        """Device bytes of one KV page (every attention layer's, target and MTP)."""
        s = self.state
        return sum(a.size * a.dtype.itemsize for a in s.kv.k + s.kv.v + s.mtp_kv.k + s.mtp_kv.v) // self.num_pages

    def resume(self, gdn_rows: tuple, slot: int, page_row, copy_from, copy_to, hidden, next_token: int,
               prefix_ids) -> None:
        """resume_prefix at the end of prefix_ids (the request's first tokens); hidden None: a response's end
        (no MTP entry rewritten)."""
        m = self.model
        in_prompt = np.zeros(m.cfg.vocab_size, bool)  # [V]
        in_prompt[np.asarray(prefix_ids, np.int64)] = True
        self.state, seen = self.call(
            m, resume_prefix, (m.cfg, m.kernels, bool(self.k)),
            (m.params, self.state, gdn_rows, self.slots, np.int32(slot), page_row, copy_from, copy_to,
             self._no_hidden if hidden is None else hidden,
             np.int32(next_token), np.int32(len(prefix_ids)), np.bool_(hidden is not None), in_prompt),
            ("params", "state", "gdn_rows") + ("rep",) * 10, ("state", "rep"))
        self.slots = dataclasses.replace(self.slots, in_prompt=seen)

    def run(self, n: int, sampling=None, logprobs: bool = False, round_cost=None):
        """n MTP rounds (or plain steps) over all slots; sampling: every slot's SamplingParams (the loop's
        sampled form) or None (greedy); logprobs: also each token's TokenLogprobs with MAX_TOP_LOGPROBS
        alternatives; round_cost: the seconds of a round at each of adaptive_k.CANDIDATES, for a loop that
        chooses K per round (None: K = self.k every round). Returns host arrays (out [B, n (K+1)], count
        [B], done [B]), the MTP statistics (None for plain decoding) and the TokenLogprobs [B, n (K+1)]
        (None without logprobs)."""
        m = self.model
        args = (m.params, self.state, self.slots)
        if sampling is not None or round_cost is not None:
            args += (None, sampling)
        if round_cost is not None:
            args += (np.asarray(round_cost, np.float32),)
        statics = {"top_logprobs": MAX_TOP_LOGPROBS} if logprobs else {}
        if round_cost is not None:
            statics["adaptive_ks"] = adaptive_k.CANDIDATES
        out, count, stats, self.state, self.slots, *lp = self.call(
            m, loop.decode, (m.cfg, m.kernels, self.k, n), args,
            ("params", "state") + ("rep",) * (len(args) - 2),
            ("rep", "rep", "rep", "state", "rep") + ("rep",) * logprobs, **statics)
        out, count, done, lp = jax.device_get((out, count, self.slots.done, lp))
        return out, count, done, (jax.device_get(stats) if self.k else None), (lp[0] if lp else None)

    def retire(self, mask: np.ndarray) -> None:
        """Marks the slots of mask [B] done on the device (released by the host while still live): they
        then ride along with n_valid = 0 and write nothing."""
        self.slots = dataclasses.replace(self.slots, done=self.slots.done | jnp.asarray(mask))
