"""Exact-prompt state snapshots: an LRU store under a byte budget (host bookkeeping, device arrays).

A request whose token ids equal a snapshot's prompt copies it into its slot and skips prefill
(greedy decoding from an identical state gives identical tokens). Invariant: `bytes <= budget_bytes`
at every moment (`peak_bytes` is the largest total ever held); an entry larger than the budget is
never stored. `clear()` drops everything (a model reload).
"""

from __future__ import annotations

import collections
import dataclasses

import jax


@dataclasses.dataclass
class Snapshot:
    state: object  # one-row DecodeState with the prompt's Pn KV pages, target and MTP (slots.take_snapshot)
    first: jax.Array  # [1] int32: the prompt's first generated token
    d1: jax.Array  # [1] int32: the first MTP draft (zeros without MTP)
    mh: jax.Array  # [1, E]: the MTP hidden that drafted d1 (zeros without MTP)
    n_pages: int  # pages that hold the prompt's positions: ceil(n / S) <= Pn
    nbytes: int  # device bytes of every array above (DeviceBatch.snapshot_bytes)
    first_logprobs: object  # host TokenLogprobs [1, 1] of `first` (the prefill's)


class SnapshotStore:
    """LRU map from prompt token ids (a tuple) to a Snapshot, never holding more than budget_bytes."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._entries: collections.OrderedDict[tuple, Snapshot] = collections.OrderedDict()
        self.bytes = self.peak_bytes = self.lookups = self.hits = self.evicted = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple) -> bool:
        return key in self._entries

    def get(self, key: tuple) -> Snapshot | None:
        """The snapshot for these prompt ids (now the most recently used), or None; counts the lookup."""
        self.lookups += 1
        snap = self._entries.get(key)
        if snap is not None:
            self.hits += 1
            self._entries.move_to_end(key)
        return snap

    def fits(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.budget_bytes

    def put(self, key: tuple, snap: Snapshot) -> None:
        """Stores (or replaces) an entry that fits(), evicting LRU entries until it fits."""
        self._drop(key)
        while self.bytes + snap.nbytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))
            self.evicted += 1
        self._entries[key] = snap
        self.bytes += snap.nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def _drop(self, key: tuple) -> None:
        if key in self._entries:
            self.bytes -= self._entries.pop(key).nbytes
