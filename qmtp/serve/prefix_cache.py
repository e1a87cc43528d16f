"""The prefix cache's host side: which prompt prefixes are kept, where their state lives, what to evict.

A prompt is cut into blocks of `block` tokens (a multiple of the KV page size). The prefix of k blocks
is named by a hash chain, d_k = blake2b(d_{k-1} || the k-th block's token ids), so two prompts share d_k
exactly when their first k blocks are equal (128-bit digests: a collision is never expected; the full
ids are not kept). A checkpoint at boundary b = k * block holds what a prefill needs to resume there:

    pages    the KV pages of positions < b (target and MTP layers), held by reference in the page
             allocator: a request resuming there shares all but the last, which it copies, because the
             MTP layer's KV at b - 1 depends on the token at b (MODEL_SPEC §4.2: the MTP input at p is
             (h_p, x_{p+1})) and the resuming request rewrites it for its own next token;
    gdn      each GDN layer's conv and ssm state after position b - 1 (device arrays, one row);
    hidden   h_{b-1}, the target's last hidden at b - 1 [1, E], from which that MTP entry is rewritten.

A finished response is a prefix too (a chat's next turn starts with it): its end checkpoint (`put_end`)
holds the state after its committed tokens, positions < L, where L is not a block boundary; it is
keyed by the chain of its whole blocks and the tokens after them up to and including the token at L
(the last one generated, emitted but not yet consumed), whose MTP entry at L - 1 the decode loop
wrote already; so a prompt resumes there only if its token at L is that one, and nothing is rewritten.
A prompt's end can be kept the same way, at L = its length - 1 (a prefill pass ends there, so its MTP
entry at L - 1 was written for the prompt's last token): where the same prompt, admitted while it is
prefilled (a request's n choices), waits for it and then prefills one token.

Only committed tokens are ever checkpointed (a prefill's prompt tokens, a finished response's emitted
ones), never a draft: nothing speculative enters the cache. A checkpoint inside a prompt ends a
prefill pass there, and a pass costs about a short prompt's whole prefill (a 32-token prompt kept at
its end took two passes: 0.72x the tokens/s of the cache off, 27B's first 16 layers, H100), so a
prefill keeps (`keep_points`) only the points that pay: the deepest block boundary its chain shares
with a cached one or a recent prompt's (`remember`; the branch point: where a system prompt or a
few-shot block ends, which the next prompts resume from); where it takes several passes anyway, its
deepest block boundary before its last token (the same long prompt again resumes there); and the point
a prompt admitted while it is prefilled waits for (qmtp/serve/prompt_passes.py). A finished
response's end costs no pass.

Bytes: the cache's `bytes` are its checkpoints' GDN states and hiddens plus the pages only it holds
alive, counted once each; at most `budget_bytes` (LRU eviction). Pages it holds come out of the
engine's KV pool, so admission also evicts (`evict_for_pages`) when a request's pages do not fit. The
states are new device memory: where the device reports how much the warm-up left (`state_limit`, set
after it), they stay within it, room made before a state is taken (`make_room`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

DIGEST_BYTES = 16
SEEN_BLOCKS = 1 << 16  # block digests of recent prompts remembered by default (~7 MB of host memory)


def chain(tokens, block: int) -> list[bytes]:
    """[d_1 .. d_m] for the m whole blocks of tokens."""
    ids = np.asarray(tokens, np.int32)
    out, d = [], b""
    for k in range(len(ids) // block):
        d = hashlib.blake2b(d + ids[k * block:(k + 1) * block].tobytes(), digest_size=DIGEST_BYTES).digest()
        out.append(d)
    return out


@dataclasses.dataclass
class Checkpoint:
    digests: list[bytes]  # d_1 .. d_k: the chain of the whole blocks of the prefix it ends
    boundary: int  # b: the positions < b are in the state
    pages: list[int]  # KV pages of positions < b, held (allocator.retain) while the checkpoint lives
    gdn: tuple  # device (conv rows, ssm rows) of the GDN layers after b - 1 (DeviceBatch.take_gdn_rows)
    hidden: object  # device [1, E]: the target's hidden at b - 1; None at a response's end (nothing to rewrite)
    state_bytes: int  # device bytes of gdn and hidden
    tail: tuple = ()  # a response's end: the tokens from block k's end through position b (the next token)


class PrefixCache:
    """Checkpoints keyed by their last digest, LRU-ordered, within budget_bytes."""

    def __init__(self, block: int, budget_bytes: int, allocator, page_bytes: int, seen_blocks: int = SEEN_BLOCKS):
        self.block, self.budget_bytes, self.allocator, self.page_bytes = block, budget_bytes, allocator, page_bytes
        self.seen_blocks = seen_blocks  # how many block digests of recent prompts `remember` keeps
        self._entries: collections.OrderedDict[bytes, Checkpoint] = collections.OrderedDict()
        self._through = collections.Counter()  # digest -> checkpoints whose chain passes through it
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # recent prompts' blocks, LRU
        self._ends: dict[bytes, set[bytes]] = {}  # d_k (b"" for none) -> keys of response ends after it
        self._page_holds = collections.Counter()  # page -> checkpoints holding it
        self.state_bytes = 0
        self.state_limit: int | None = None  # device bytes the states may take (None: the budget's)
        self.reset_counts()

    def reset_counts(self) -> None:
        self.lookups = self.hits = self.hit_tokens = self.evicted = self.stored = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def bytes(self) -> int:
        return self.state_bytes + len(self._page_holds) * self.page_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens, again: bool = False) -> tuple[int, Checkpoint | None, list[bytes]]:
        """The deepest checkpoint a prompt can resume from (boundary b <= len - 1: at least its last token
        is prefilled), now the most recently used: (b, checkpoint, the prompt's chain) or (0, None, chain).
        again: a second look for an admitted prompt, counted by `count_second_look` where its caller takes it."""
        digests = chain(tokens, self.block)
        self.lookups += not again
        for k in range(min(len(digests), (len(tokens) - 1) // self.block), -1, -1):
            ends = [(self._entries[key].boundary, key) for key in self._ends.get(digests[k - 1] if k else b"", ())
                    if _end_matches(self._entries[key], tokens, k * self.block)]
            key = max(ends)[1] if ends else (digests[k - 1] if k and digests[k - 1] in self._entries else None)
            if key is not None:
                self._entries.move_to_end(key)
                ckpt = self._entries[key]
                if not again:
                    self.hits += 1
                    self.hit_tokens += ckpt.boundary
                return ckpt.boundary, ckpt, digests
        return 0, None, digests

    def count_second_look(self, boundary: int, before: int) -> None:
        """Counts a second look's checkpoint at `boundary` taken by a prompt whose first found `before`
        (0: it missed, and this is its hit)."""
        self.hits += before == 0
        self.hit_tokens += boundary - before

    def keep_points(self, n_tokens: int, digests: list[bytes], start: int, several_passes: bool) -> list[int]:
        """The block boundaries (token counts, > start, ascending, not checkpoints already) a prefill of
        n_tokens from `start` keeps: the deepest its chain shares with a checkpoint's or a prompt prefilled
        before (the branch point), and where the prefill takes several passes anyway, the deepest before its
        last token."""
        deepest = min(len(digests), (n_tokens - 1) // self.block)
        shared = max((k for k in range(1, deepest + 1) if digests[k - 1] in self._through
                      or digests[k - 1] in self._seen), default=0)
        return sorted({k * self.block for k in ((deepest, shared) if several_passes else (shared,))
                       if k * self.block > start and digests[k - 1] not in self._entries})

    def remember(self, digests: list[bytes]) -> None:
        """Notes a prefilled prompt's chain (no state kept): a later prompt that shares its first blocks keeps a
        checkpoint at their branch point (`keep_points`), which the ones after it resume from."""
        for d in digests:
            self._seen[d] = None
            self._seen.move_to_end(d)
        while len(self._seen) > self.seen_blocks:
            self._seen.popitem(last=False)

    def fits(self, state_bytes: int) -> bool:
        return 0 < state_bytes + self.page_bytes <= self.budget_bytes and (
            self.state_limit is None or state_bytes <= self.state_limit)

    def make_room(self, state_bytes: int) -> None:
        """Evicts LRU checkpoints until one more state of state_bytes stays within state_limit (before the
        device allocates it)."""
        while self.state_limit is not None and self.state_bytes + state_bytes > self.state_limit and self._entries:
            self._evict()

    def put(self, digests: list[bytes], pages: list[int], gdn, hidden, state_bytes: int) -> None:
        """Stores the checkpoint at the end of the chain `digests` (its pages: those of positions < b,
        retained here), evicting LRU entries until the cache fits its budget."""
        self._store(digests[-1], Checkpoint(list(digests), len(digests) * self.block, list(pages), gdn, hidden,
                                            state_bytes))

    def put_end(self, tokens, pages: list[int], gdn, state_bytes: int) -> None:
        """Stores a finished response's end: `tokens` are the prompt and the response (its last token, at
        position L = len - 1, not in the state), `pages` those of positions < L."""
        boundary = len(tokens) - 1
        digests = chain(tokens[:boundary], self.block)
        tail = tuple(int(t) for t in tokens[len(digests) * self.block:])
        parent = digests[-1] if digests else b""
        key = hashlib.blake2b(parent + np.asarray(tail, np.int32).tobytes(), digest_size=DIGEST_BYTES,
                              person=b"end").digest()
        self._store(key, Checkpoint(digests, boundary, list(pages), gdn, None, state_bytes, tail), parent)

    def _store(self, key: bytes, ckpt: Checkpoint, end_of: bytes | None = None) -> None:
        if key in self._entries:
            return
        self.allocator.retain(ckpt.pages)
        self._entries[key] = ckpt
        if end_of is not None:
            self._ends.setdefault(end_of, set()).add(key)
        self._through.update(ckpt.digests)
        self._page_holds.update(ckpt.pages)
        self.state_bytes += ckpt.state_bytes
        self.stored += 1
        while self.bytes > self.budget_bytes and self._entries:
            self._evict()

    def evict_for_pages(self, pages_needed: int) -> None:
        """Evicts LRU checkpoints until the allocator has pages_needed free pages or the cache is empty
        (pages that active requests still share are freed only when those requests end)."""
        while self.allocator.free_pages < pages_needed and self._entries:
            self._evict()

    def clear(self) -> None:
        """Drops every checkpoint and forgets the prompts seen."""
        self._seen.clear()
        while self._entries:
            self._drop(next(iter(self._entries)))

    def _evict(self) -> None:
        self._drop(next(iter(self._entries)))
        self.evicted += 1

    def _drop(self, key: bytes) -> None:
        ckpt = self._entries.pop(key)
        if ckpt.tail:
            parent = ckpt.digests[-1] if ckpt.digests else b""
            self._ends[parent].discard(key)
            if not self._ends[parent]:
                del self._ends[parent]
        _discount(self._through, ckpt.digests)
        _discount(self._page_holds, ckpt.pages)
        self.state_bytes -= ckpt.state_bytes
        self.allocator.drop(ckpt.pages)


def _discount(counter: collections.Counter, items) -> None:
    for item in items:
        counter[item] -= 1
        if counter[item] == 0:
            del counter[item]


def _end_matches(ckpt: Checkpoint, tokens, start: int) -> bool:
    """A response end after the whole blocks `tokens` shares up to `start`: its tail is the prompt's
    next tokens, and at least one token is left to prefill."""
    return ckpt.boundary <= len(tokens) - 1 and tuple(tokens[start:start + len(ckpt.tail)]) == ckpt.tail
