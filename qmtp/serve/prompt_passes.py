"""Prompts prefilled pass by pass into their batch slots: the long prompts (longer than a piece, one
pass of at most a piece per scheduling point, so the running streams wait for one pass at a time), and
with the prefix cache every prompt (qmtp/serve/prefix_cache.py). A piece (`limit`) is prefill_chunk
tokens, or the engine's interleave_piece while other slots decode.

A prompt's passes end on multiples of prefill_chunk, at the points the prefix cache keeps a checkpoint
at (`PrefixCache.keep_points`, and the ones later prompts await), and at its end, and a pass stops short
of that end after a piece's tokens. With the cache, admission looks the prompt up (`reserve_with_prefix`:
its reservation then shares the checkpoint's pages but the last); where a prompt being prefilled shares
more of its beginning, it waits for that one's checkpoint at the end of what they share
(`_await_shared`); and the first pass looks again (a deeper checkpoint kept since, e.g. by another
choice of the same prompt: its pages are copied but those the reservation shares); a prompt resumes
from the checkpoint (`slots.resume_prefix`) before its first pass. Every pass runs
`slots.prefill_piece`: one row padded to the piece, or with the cache up to `--prefill_batch` rows
(`Engine._group_rows`) of prompts whose next passes pad to the same prompt bucket (whole chunks and one
row under --deterministic: a resumed prefill runs a full one's passes, and a prompt's numbers do not
depend on the others).

`PassPrefill` belongs to the Engine and works on its state (device, allocator, prefix cache, slots'
sampling rows, the first-token delivery) on the scheduler thread.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from qmtp import api
from qmtp.runtime.loop import NO_STOP
from qmtp.serve.requests import RequestHandle

LONG_PROMPTS = "long prompts"  # how log lines name the piece-by-piece prefill


@dataclasses.dataclass
class Pieces:
    """A prompt's prefill in progress, one pass at a time: its slot's page and stop rows, the next pass's
    offset and every pass's end. With the prefix cache: the checkpoint to resume from first (and its
    boundary, the first offset), the boundaries to checkpoint, the prompt's hash chain."""

    handle: RequestHandle
    page_row: np.ndarray  # [Pmax]
    stop_row: np.ndarray  # [NS]
    ends: list[int]  # each pass's end (token count), ascending; the last is the prompt's length
    offset: int = 0
    resume: object = None  # a prefix_cache.Checkpoint to resume from before the first pass
    keep: tuple[int, ...] = ()  # points at which the prefix cache keeps a checkpoint (block boundaries, the end)
    digests: list = dataclasses.field(default_factory=list)  # the prompt's block chain
    shared_pages: int = 0  # leading pages shared with the checkpoint (the rest of its pages are copied)
    fresh: bool = True  # no pass has run yet
    awaits: tuple | None = None  # (Pieces, point): an earlier prompt's checkpoint to come, deeper than `offset`
    awaited: set = dataclasses.field(default_factory=set)  # points later prompts wait for (kept too)


class PassPrefill:
    """The prompts being prefilled (`pending`, slot -> Pieces, FIFO) and the passes that advance them."""

    def __init__(self, engine):
        self.engine = engine
        self.pending: dict[int, Pieces] = {}

    def reserve_with_prefix(self, handle: RequestHandle):
        """The head request's pages when they fit (evicting cache entries for them): its prompt's deepest
        checkpoint's pages shared, but the last, then its own; (reservation, boundary, checkpoint, chain), or
        None to wait."""
        e = self.engine
        boundary, ckpt, digests = e.prefix.lookup(handle.prompt_ids)
        shared = ckpt.pages[:_shared_pages(boundary, e.page_size)] if ckpt is not None else []
        need = e.allocator.pages_for(e._capacity(handle)) - len(shared)
        e.allocator.retain(shared)  # pinned while evicting: the checkpoint itself may go
        try:
            e.prefix.evict_for_pages(need)
            if need > e.allocator.free_pages:
                return None
            return e.allocator.reserve(e._capacity(handle), shared), boundary, ckpt, digests
        finally:
            e.allocator.drop(shared)

    def start(self, handle: RequestHandle, slot: int, reservation: int, boundary: int = 0, ckpt=None,
              digests=()) -> int:
        """Queues a prompt's prefill, pass by pass, into `slot`, from `boundary`, after resuming from the
        prefix cache checkpoint `ckpt` there (whose pages but the last the reservation shares). Returns
        the slot."""
        e = self.engine
        p = Pieces(handle, *e._activate(handle, slot, reservation), ends=[], digests=list(digests),
                   shared_pages=_shared_pages(boundary, e.page_size))
        self._plan(p, boundary, ckpt)
        if e.prefix is not None:
            self._await_shared(p)
        self.pending[slot] = p
        return slot

    def _await_shared(self, q: Pieces) -> None:
        """With the cache: where a prompt being prefilled shares more of q's beginning than q resumes from,
        q waits for that one's checkpoint at the deepest point of their common prefix (which it then keeps),
        so prompts arriving together with one system prompt prefill it once. That point: the earlier
        prompt's end but its last token where q extends it (as a request's n choices do), else their
        deepest common block boundary; only where q's shared pages (from its own checkpoint) are the
        earlier prompt's too, and at least one token of q is left to prefill."""
        e, ids_q = self.engine, q.handle.prompt_ids
        best = q.offset
        for p in self.pending.values():
            ids_p = p.handle.prompt_ids
            if list(p.page_row[:q.shared_pages]) != list(q.page_row[:q.shared_pages]):
                continue
            common = _common_prefix(ids_p, ids_q)
            point = (len(ids_p) - 1 if common >= len(ids_p) and len(ids_p) <= len(ids_q) else
                     min(common, len(ids_p) - 1, len(ids_q) - 1) // e.prefix.block * e.prefix.block)
            if point > max(best, p.offset):
                best, q.awaits = point, (p, point)
        if q.awaits is not None:
            p, point = q.awaits
            p.awaited.add(point)
            p.keep, p.ends = tuple(sorted({*p.keep, point})), sorted({*p.ends, point})

    def _waiting(self, q: Pieces) -> bool:
        """Whether q still waits for an earlier prompt's checkpoint (`_await_shared`): that prompt is still
        being prefilled and has not reached the point."""
        if q.awaits is not None:
            p, point = q.awaits
            if p.offset < point and any(r is p for r in self.pending.values()):
                return True
            q.awaits = None
        return False

    def _plan(self, p: Pieces, boundary: int, ckpt) -> None:
        """p's passes from `boundary` (resuming from `ckpt` there, if any): they end on multiples of
        prefill_chunk, at the boundaries the prefix cache keeps (and those later prompts await), and at
        the prompt's end."""
        e = self.engine
        n = len(p.handle.prompt_ids)
        if e.prefix is not None:
            awaited = {b for b in p.awaited if b > boundary}
            several = n - boundary > e.piece
            p.keep = tuple(sorted({*e.prefix.keep_points(n, p.digests, boundary, several), *awaited}))
        else:
            p.keep = ()
        p.ends = sorted(set(range(boundary - boundary % e.piece + e.piece, n, e.piece)) | set(p.keep) | {n})
        p.offset, p.resume = boundary, ckpt
        p.handle.prefix_hit_tokens = boundary

    def limit(self) -> int:
        """The most tokens of a pass now (a piece): interleave_piece while other slots decode, else
        prefill_chunk (the two are equal under --deterministic, whose passes are whole chunks)."""
        e = self.engine
        return e.interleave_piece if e.decoding() else e.piece

    def run(self) -> None:
        """Passes of the prompts in progress (FIFO): one; with the prefix cache, which runs every prompt's
        prefill in passes, as many as a piece's padded tokens allow (at least one), then those of the short
        prompts (at most a piece to prefill after what they resume from) until all of these are in, as the
        admission without the cache prefills every short prompt at once. A short prompt left for a later
        scheduling point would wait a decode call, and its pass would take a scheduling point of its own
        (prompts arriving a little apart then stay apart, in more passes of fewer rows)."""
        e = self.engine
        limit = self.limit()
        if e.prefix is None:
            if self.pending:
                self.run_one(limit)
            return
        budget = limit
        while self.pending and budget > 0:
            budget -= self.run_one(limit)
        while self.run_one(limit, short_only=True):
            pass

    def _width(self, tokens: int, limit: int) -> int:
        """A pass's padded width: the piece `limit`, but with the prefix cache the prompt bucket of a pass of
        fewer tokens (not under --deterministic, whose passes are whole chunks)."""
        e = self.engine
        if e.prefix is None or e.model.kernels.deterministic:
            return limit
        return min(limit, api._bucket(tokens))

    def run_one(self, limit: int | None = None, short_only: bool = False) -> int:
        """The next pass: the first prompt in progress and, with the prefix cache (not under
        --deterministic, whose prefills run one prompt at a time), up to _group_rows(width) - 1 more
        whose next passes take the same padded width, in FIFO order, but those waiting for an earlier
        one's checkpoint (`_await_shared`), where the batched program's rows x width stay within the piece
        (a pass costs at most a piece: at the 27B shapes a 512-row pass's FP8 launches take 3.5x a 128-row one's).
        After a prompt's last pass its request starts. limit: the piece (default: `limit()`); short_only:
        only the short prompts (see run), not waiting (none: no pass). Returns the pass's padded
        tokens."""
        e = self.engine
        limit = self.limit() if limit is None else limit
        e._flush_retired()
        queue = list(self.pending.items())
        if short_only:
            queue = [(s, q) for s, q in queue
                     if len(q.handle.prompt_ids) - q.handle.prefix_hit_tokens <= limit and not self._waiting(q)]
            if not queue:
                return 0
        slot, p = queue[0]
        self._prepare(slot, p)
        width = self._width(p.ends[0] - p.offset, limit)
        rows = [(slot, p)]
        if e.prefix is not None and not e.model.kernels.deterministic:
            most = e._group_rows(width) if e._group_rows(width) * width <= limit else 1
            for slot_q, q in queue[1:]:
                if len(rows) == most:
                    break
                if self._waiting(q):
                    continue
                self._prepare(slot_q, q)
                if self._width(q.ends[0] - q.offset, limit) == width:
                    rows.append((slot_q, q))
        return self._pass(rows, width)

    def _prepare(self, slot: int, p: Pieces) -> None:
        """Before a prompt's first pass: a checkpoint kept since its admission deeper than the one it
        resumes from (an earlier request's prefill, e.g. a choice of the same prompt) is resumed from
        instead, with a copy of its pages but those the reservation shares (the same ones); and a planned
        resume is done."""
        e = self.engine
        if p.fresh and e.prefix is not None:
            boundary, ckpt, _ = e.prefix.lookup(p.handle.prompt_ids, again=True)
            if (ckpt is not None and boundary > p.offset
                    and list(ckpt.pages[:p.shared_pages]) == list(p.page_row[:p.shared_pages])):
                e.prefix.count_second_look(boundary, p.offset)
                self._plan(p, boundary, ckpt)
        p.fresh = False
        if p.resume is not None:
            self._resume(slot, p)

    def _pass(self, rows: list, width: int) -> int:
        """One prefill pass of the prompts `rows` [(slot, Pieces)], each its next pass (its first `width`
        tokens at most) padded to `width` tokens; 1 row, or _group_rows(width) with padding rows (slot id B,
        no token). Returns its padded tokens."""
        e = self.engine
        n = 1 if len(rows) == 1 else e._group_rows(width)
        ids = np.full(n, e.config.batch_slots, np.int32)
        page_rows = np.zeros((n, e.pages_per_slot), np.int32)  # [n, Pmax]
        stop_rows = np.full((n, e.config.max_stop_ids), NO_STOP, np.int32)  # [n, NS]
        tokens, next_tokens = np.zeros((n, width), np.int32), np.zeros((n, width), np.int32)  # [n, C]
        offsets, n_valid, max_tokens, last = (np.zeros(n, np.int32) for _ in range(4))
        ends = []
        for i, (slot, p) in enumerate(rows):
            ids_p = p.handle.prompt_ids
            end = min(p.ends[0], p.offset + width)
            if end == p.ends[0]:
                p.ends.pop(0)
            piece = ids_p[p.offset:end]
            ahead = ids_p[p.offset + 1:end + 1]  # the MTP head's inputs, one token ahead
            tokens[i, :len(piece)], next_tokens[i, :len(ahead)] = piece, ahead
            ids[i], page_rows[i], stop_rows[i] = slot, p.page_row, p.stop_row
            offsets[i], n_valid[i], max_tokens[i] = p.offset, len(piece), p.handle.max_tokens
            last[i] = end >= len(ids_p)
            ends.append(end)
        what = f"prefill piece of {width} tokens" + (f" x {n} rows" if n > 1 else "")
        with e._watch(f"{LONG_PROMPTS}: {what}"):
            first, first_lp, hidden = e._device.prefill_piece(
                ids, page_rows, offsets, tokens, next_tokens, n_valid, last.astype(bool), max_tokens, stop_rows,
                e._sampling.rows(ids, always=True))
        e.counters["prefill_passes"] += 1
        e.counters["prefill_pass_rows"] += len(rows)
        for i, ((slot, p), end) in enumerate(zip(rows, ends)):
            p.offset = end
            if end in p.keep:
                self._checkpoint(slot, p, hidden[i:i + 1])
            if last[i]:
                if e.prefix is not None:
                    e.prefix.remember(p.digests)
                del self.pending[slot]
                e.counters["prefills"] += 1
                e._started(p.handle, slot, int(first[i]), first_lp, i)
        return n * width

    def _resume(self, slot: int, p: Pieces) -> None:
        """Puts the prefix cache checkpoint p.resume into the slot (its GDN rows, a copy of its pages that
        the reservation does not share, the MTP KV at the boundary - 1 for this prompt's next token) before
        the pass from p.offset."""
        e = self.engine
        ckpt, b = p.resume, p.offset
        pages = range(p.shared_pages, -(-b // e.page_size))  # the last holds position b - 1
        copy_from = np.full(e.pages_per_slot, e.allocator.num_pages, np.int32)  # [Pmax]; out of range: none
        copy_to = copy_from.copy()
        copy_from[:len(pages)] = [ckpt.pages[i] for i in pages]
        copy_to[:len(pages)] = p.page_row[list(pages)]
        with e._watch("prefix cache: resume"):
            e._device.resume(ckpt.gdn, slot, p.page_row, copy_from, copy_to, ckpt.hidden, p.handle.prompt_ids[b],
                             p.handle.prompt_ids[:b])
        p.resume = None

    def _checkpoint(self, slot: int, p: Pieces, hidden) -> None:
        """Keeps the slot's state at p.offset in the prefix cache: at a block boundary the prefill just
        reached, or at the prompt's end but its last token (prefix_cache.put_end: nothing to rewrite)."""
        e = self.engine
        b = p.offset
        end = b % e.prefix.block != 0
        state_bytes = e._device.gdn_row_bytes() + (0 if end else hidden.size * hidden.dtype.itemsize)
        gdn = self._take_rows(slot, state_bytes)
        if gdn is None:
            return
        if end:
            e.prefix.put_end(p.handle.prompt_ids, p.page_row[:-(-b // e.page_size)].tolist(), gdn, state_bytes)
        else:
            e.prefix.put(p.digests[:b // e.prefix.block], p.page_row[:b // e.page_size].tolist(), gdn, hidden,
                         state_bytes)

    def keep_response_end(self, slot: int, handle: RequestHandle, reservation: int) -> None:
        """With the prefix cache, keeps the end of a request the device finished (a stop id or its budget;
        not one the host cut, e.g. at a stop string, whose state runs past its tokens) in the cache
        (prefix_cache.put_end): its state holds the prompt and the response but the last token (the loop
        commits a row that a stop id or its budget finished through its emitted tokens only), which the
        host knows without reading the device."""
        e = self.engine
        tokens = list(handle.prompt_ids) + list(handle.tokens)
        state_bytes = e._device.gdn_row_bytes()
        gdn = self._take_rows(slot, state_bytes)
        if gdn is None:
            return
        pages = e.allocator.pages(reservation)[:-(-(len(tokens) - 1) // e.page_size)]
        e.prefix.put_end(tokens, pages, gdn, state_bytes)

    def _take_rows(self, slot: int, state_bytes: int):
        """The slot's GDN rows for a checkpoint of state_bytes, room made for them in the cache first; None
        where they cannot fit."""
        e = self.engine
        if not e.prefix.fits(state_bytes):
            return None
        e.prefix.make_room(state_bytes)
        with e._watch("prefix cache: checkpoint"):
            return e._device.take_gdn_rows(slot)


def _common_prefix(a, b) -> int:
    """The number of leading tokens two prompts share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def _shared_pages(boundary: int, page_size: int) -> int:
    """Pages of a checkpoint at `boundary` a resuming request shares: those before the page of position
    boundary - 1, which it copies (it rewrites the MTP entry there, or writes its own positions after it)."""
    return max((boundary - 1) // page_size, 0)
