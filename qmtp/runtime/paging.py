"""Host-side page allocator (numpy): reserves KV pages per sequence and reclaims them exactly once.

A sequence that may reach `capacity_tokens` positions gets ceil(capacity_tokens / page_size) pages
before the device loop starts; the loop only ever writes into reserved pages. Unused page-table
entries point at page 0: reads there are masked by length and writes beyond the reservation are
dropped, so the value never matters.

Pages are reference-counted: a reservation may start with pages it shares (a cached prompt prefix,
qmtp/serve/prefix_cache.py: pages the sequence reads and never writes), and the prefix cache holds
references of its own (`retain` / `drop`). A page is free again when its last holder lets it go.
"""

from __future__ import annotations

import numpy as np


class CapacityError(ValueError):
    """A request that does not fit the KV cache; the message says what the limit is."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages={num_pages} and page_size={page_size} must be positive")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._owned: dict[int, list[int]] = {}
        self._refs = np.zeros(num_pages, np.int32)  # holders of each page (reservations and retains)
        self._next_id = 0

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def reserve(self, capacity_tokens: int, shared=()) -> int:
        """Reserves pages for `capacity_tokens` positions; returns a handle for `release`. shared: pages
        (held by someone else) that become the reservation's first pages; only the rest are taken."""
        shared = list(shared)
        need = self.pages_for(capacity_tokens) - len(shared)
        if need + len(shared) > self.num_pages:
            raise CapacityError(f"{capacity_tokens} tokens need {need} pages of {self.page_size}, but the KV "
                                f"cache has only {self.num_pages} pages ({self.num_pages * self.page_size} "
                                "tokens); raise --num_pages or shorten the prompt / --max_new_tokens")
        if need > len(self._free):
            raise CapacityError(f"{capacity_tokens} tokens need {need} pages; only {len(self._free)} are free")
        handle, self._next_id = self._next_id, self._next_id + 1
        if any(self._refs[p] <= 0 for p in shared):
            raise ValueError(f"shared pages {shared} include a free page")
        pages = shared + [self._free.pop() for _ in range(max(need, 0))]
        self._refs[pages] += 1
        self._owned[handle] = pages
        return handle

    def release(self, handle: int) -> None:
        pages = self._owned.pop(handle, None)
        if pages is None:
            raise KeyError(f"page reservation {handle} was already released (or never made)")
        self.drop(pages)

    def retain(self, pages) -> None:
        """One more reference to each of these held pages (the prefix cache keeping a prompt's pages)."""
        pages = list(pages)
        if any(self._refs[p] <= 0 for p in pages):
            raise ValueError(f"retain of a free page among {pages}")
        self._refs[pages] += 1

    def drop(self, pages) -> None:
        """Lets go of one reference to each of these pages; a page nobody holds any more is free."""
        for p in reversed(list(pages)):
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} dropped more often than held")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refs(self, page: int) -> int:
        return int(self._refs[page])

    def pages(self, handle: int) -> list[int]:
        return list(self._owned[handle])

    def page_table(self, handles: list[int], pages_per_seq: int | None = None) -> np.ndarray:
        """[B, Pmax] int32 page table for the given reservations (unused entries = 0)."""
        width = pages_per_seq or max(len(self._owned[h]) for h in handles)
        table = np.zeros((len(handles), width), np.int32)
        for b, h in enumerate(handles):
            pages = self._owned[h]
            if len(pages) > width:
                raise ValueError(f"reservation {h} has {len(pages)} pages > table width {width}")
            table[b, :len(pages)] = pages
        return table
