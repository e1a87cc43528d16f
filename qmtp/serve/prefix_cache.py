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

Only prompt tokens are ever checkpointed (a prefill's passes), never a draft: nothing speculative
enters the cache. Which boundaries a prefill keeps (`keep_points`): the deepest block boundary before
its last token (the next turn of a chat starts with the whole prompt) and the deepest boundary its
chain shares with a cached one (the branch point: where a system prompt or a few-shot block ends).

Bytes: the cache's `bytes` are its checkpoints' GDN states and hiddens plus the pages only it holds
alive, counted once each; at most `budget_bytes` (LRU eviction). Pages it holds come out of the
engine's KV pool, so admission also evicts (`evict_for_pages`) when a request's pages do not fit.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

DIGEST_BYTES = 16


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
    digests: list[bytes]  # d_1 .. d_k: the chain of the prefix it ends
    pages: list[int]  # KV pages of positions < b, held (allocator.retain) while the checkpoint lives
    gdn: tuple  # device (conv rows, ssm rows) of the GDN layers after b - 1 (DeviceBatch.take_gdn_rows)
    hidden: object  # device [1, E]: the target's hidden at b - 1
    state_bytes: int  # device bytes of gdn and hidden

    @property
    def blocks(self) -> int:
        return len(self.digests)


class PrefixCache:
    """Checkpoints keyed by their last digest, LRU-ordered, within budget_bytes."""

    def __init__(self, block: int, budget_bytes: int, allocator, page_bytes: int):
        self.block, self.budget_bytes, self.allocator, self.page_bytes = block, budget_bytes, allocator, page_bytes
        self._entries: collections.OrderedDict[bytes, Checkpoint] = collections.OrderedDict()
        self._through = collections.Counter()  # digest -> checkpoints whose chain passes through it
        self._page_holds = collections.Counter()  # page -> checkpoints holding it
        self.state_bytes = 0
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
        again: a second look for a prompt that missed (not counted as a lookup; a hit counts)."""
        digests = chain(tokens, self.block)
        self.lookups += not again
        for k in range(min(len(digests), (len(tokens) - 1) // self.block), 0, -1):
            ckpt = self._entries.get(digests[k - 1])
            if ckpt is not None:
                self._entries.move_to_end(digests[k - 1])
                self.hits += 1
                self.hit_tokens += k * self.block
                return k * self.block, ckpt, digests
        return 0, None, digests

    def keep_points(self, n_tokens: int, digests: list[bytes], start: int) -> list[int]:
        """The boundaries (token counts, > start, ascending) a prefill of n_tokens from `start` should
        checkpoint: the deepest before its last token and the deepest its chain shares with the cache's
        (when neither is already a checkpoint)."""
        deepest = min(len(digests), (n_tokens - 1) // self.block)
        shared = max((k for k in range(1, deepest + 1) if digests[k - 1] in self._through), default=0)
        points = {k for k in (deepest, shared) if k * self.block > start and digests[k - 1] not in self._entries}
        return sorted(k * self.block for k in points)

    def fits(self, state_bytes: int) -> bool:
        return 0 < state_bytes + self.page_bytes <= self.budget_bytes

    def put(self, digests: list[bytes], pages: list[int], gdn, hidden, state_bytes: int) -> None:
        """Stores the checkpoint at the end of the chain `digests` (its pages: those of positions < b,
        retained here), evicting LRU entries until the cache fits its budget."""
        key = digests[-1]
        if key in self._entries:
            return
        self.allocator.retain(pages)
        ckpt = Checkpoint(list(digests), list(pages), gdn, hidden, state_bytes)
        self._entries[key] = ckpt
        self._through.update(ckpt.digests)
        self._page_holds.update(ckpt.pages)
        self.state_bytes += state_bytes
        self.stored += 1
        while self.bytes > self.budget_bytes and self._entries:
            self._evict()

    def evict_for_pages(self, pages_needed: int) -> None:
        """Evicts LRU checkpoints until the allocator has pages_needed free pages or the cache is empty
        (pages that active requests still share are freed only when those requests end)."""
        while self.allocator.free_pages < pages_needed and self._entries:
            self._evict()

    def clear(self) -> None:
        while self._entries:
            self._drop(next(iter(self._entries)))

    def _evict(self) -> None:
        self._drop(next(iter(self._entries)))
        self.evicted += 1

    def _drop(self, key: bytes) -> None:
        ckpt = self._entries.pop(key)
        _discount(self._through, ckpt.digests)
        _discount(self._page_holds, ckpt.pages)
        self.state_bytes -= ckpt.state_bytes
        self.allocator.drop(ckpt.pages)


def _discount(counter: collections.Counter, items) -> None:
    for item in items:
        counter[item] -= 1
        if counter[item] == 0:
            del counter[item]
