"""Exact-prompt state snapshots: an LRU store under a byte budget (host bookkeeping, device arrays).

After a prompt is prefilled into a slot, the engine may save the state at the end of that prompt
(`qmtp.serve.slots.take_snapshot`: conv/ssm rows and the prompt's KV pages, target and MTP) together
with the prefill's outputs (first token, first draft d1, MTP hidden). A later request with the
identical token ids copies it into its own slot (`slots.restore_snapshot`) and skips prefill;
greedy decoding from an identical state gives identical tokens.

Accounting: a snapshot costs the bytes of every array it holds (device memory, summed over TP
shards). `put` evicts least-recently-used entries until the new one fits; an entry larger than the
whole budget is not stored. Invariant: `bytes <= budget_bytes` at every moment (`peak_bytes`
records the largest total ever held). `clear()` drops everything (model reload).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np

from qmtp.runtime.state import gdn_slot_count


@dataclasses.dataclass
class Snapshot:
    state: object  # one-row DecodeState with Pn pages (qmtp.serve.slots.take_snapshot)
    first: jax.Array  # [1] int32: the prompt's first generated token
    d1: jax.Array  # [1] int32: the first MTP draft (zeros without MTP)
    mh: jax.Array  # [1, E]: the MTP hidden that drafted d1 (zeros without MTP)
    n_pages: int  # pages that hold the prompt's positions: ceil(n / S) <= Pn
    prompt_len: int

    @property
    def nbytes(self) -> int:
        leaves = jax.tree_util.tree_leaves((self.state, self.first, self.d1, self.mh))
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in leaves)


class SnapshotStore:
    """LRU map from prompt token ids (a tuple) to a Snapshot, never holding more than budget_bytes."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"--snapshot_budget_bytes={budget_bytes} must be >= 0 (0 = no snapshots)")
        self.budget_bytes = budget_bytes
        self._entries: collections.OrderedDict[tuple, Snapshot] = collections.OrderedDict()
        self._sizes: dict[tuple, int] = {}
        self.bytes = 0
        self.peak_bytes = 0
        self.lookups = self.hits = self.stored = self.evicted = self.too_large = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

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

    def put(self, key: tuple, snap: Snapshot) -> bool:
        """Stores (or replaces) an entry, evicting LRU entries until it fits. False if it never can."""
        size = snap.nbytes
        if not self.fits(size):
            self.too_large += 1
            return False
        self._drop(key)
        while self.bytes + size > self.budget_bytes:
            self._drop(next(iter(self._entries)))
            self.evicted += 1
        self._entries[key] = snap
        self._sizes[key] = size
        self.bytes += size
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.stored += 1
        return True

    def replace_arrays(self, key: tuple, state) -> None:
        """Swaps in the same snapshot's state as returned by a donating restore (same shapes, same bytes)."""
        if key in self._entries:
            self._entries[key].state = state

    def clear(self) -> None:
        self._entries.clear()
        self._sizes.clear()
        self.bytes = 0

    def _drop(self, key: tuple) -> None:
        if key in self._entries:
            del self._entries[key]
            self.bytes -= self._sizes.pop(key)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


def snapshot_bytes(state, slots, n_pages: int) -> int:
    """Bytes of a snapshot of n_pages pages taken from `state` (B rows) and its carry (= Snapshot.nbytes)."""
    size = lambda a: int(np.prod(a.shape)) * a.dtype.itemsize  # noqa: E731
    b, num_pages = state.lengths.shape[0], (state.kv.k or state.mtp_kv.k)[0].shape[0]
    pages = sum(size(a) for a in state.kv.k + state.kv.v + state.mtp_kv.k + state.mtp_kv.v) // num_pages
    rows = sum(size(a) for a in state.conv + state.ssm) // b // max(gdn_slot_count(state), 1)  # one slot's row
    return pages * n_pages + rows + 4 * (n_pages + 1) + 8 + size(slots.mh) // b  # + page table, length, first, d1
