"""Admission of queued requests into batch slots, step 2 of the engine's scheduling point
(qmtp/serve/engine.py): FIFO into free slots while the head's pages fit, then each request either copied
in from an exact-prompt snapshot or prefilled with the others of its prompt bucket in one pass, and
its first token emitted.

`Admission` is a mixin of `engine.Engine` and runs on the engine thread only; it uses the engine's
config, queue and lock (_cv, _queue, _free_slots, _stopping, _reload), page allocator, device
batch (_device), slot records (_active), snapshot store and counters, and calls back into its
delivery (_deliver, _release, _text_stream).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from qmtp import api
from qmtp.runtime import loop
from qmtp.serve.requests import RequestHandle
from qmtp.serve.snapshots import Snapshot
from qmtp.serve.textstream import TextStream


@dataclasses.dataclass
class Active:
    """An admitted request's slot record, from admission until its release."""

    handle: RequestHandle
    reservation: int  # PageAllocator handle
    stream: TextStream | None
    live_on_device: bool = True


class Admission:
    """Requests from the queue into free slots (the module doc)."""

    def _take_admissions(self) -> list:
        """Pops queued requests into free slots (FIFO; the head waits while its pages do not fit)."""
        admitted = []
        with self._cv:
            if self._stopping or self._reload is not None:
                return admitted
            while self._queue and self._free_slots:
                handle = self._queue[0]
                if self.allocator.pages_for(handle.capacity) > self.allocator.free_pages:
                    break
                self._queue.popleft()
                admitted.append((handle, self._free_slots.pop(), self.allocator.reserve(handle.capacity)))
        return admitted

    def _group_rows(self, bucket: int) -> int:
        """Rows of a batched prefill for this prompt bucket (padding rows fill a smaller group)."""
        c = self.config
        return max(1, min(c.prefill_batch, c.batch_slots, c.max_prefill_tokens // bucket))

    def _admit_all(self, admissions: list) -> None:
        """Admits requests: snapshot hits are copied in one by one; the rest are prefilled in groups
        of one prompt bucket (FIFO within a bucket), `_group_rows(bucket)` prompts per pass."""
        groups: dict[int, list] = {}
        for handle, slot, reservation in admissions:
            snap = self.snapshots.get(tuple(handle.prompt_ids)) if self.snapshots.enabled and handle.id >= 0 else None
            if snap is not None:
                self._restore(handle, slot, reservation, snap)
            else:
                groups.setdefault(api._bucket(len(handle.prompt_ids)), []).append((handle, slot, reservation))
        for bucket, group in groups.items():
            rows = self._group_rows(bucket)
            for i in range(0, len(group), rows):
                self._prefill_group(group[i:i + rows])

    def _rows_for(self, handle: RequestHandle, reservation: int):
        """(page row [Pmax], stop row [NS]) of an admitted request."""
        pages = self.allocator.pages(reservation)
        page_row = np.zeros(self.pages_per_slot, np.int32)
        page_row[:len(pages)] = pages
        stop_row = np.full(self.config.max_stop_ids, loop.NO_STOP, np.int32)
        stop_row[:len(handle.stop_ids)] = handle.stop_ids
        return page_row, stop_row

    def _restore(self, handle: RequestHandle, slot: int, reservation: int, snap: Snapshot) -> None:
        """Copies the exact-prompt snapshot of the request into `slot` and emits its first token."""
        self._active[slot] = Active(handle, reservation, self._text_stream(handle))
        page_row, stop_row = self._rows_for(handle, reservation)
        snap_state = self._device.restore(snap, slot, page_row, handle.max_tokens, stop_row)
        self.snapshots.replace_arrays(tuple(handle.prompt_ids), snap_state)
        handle.snapshot_hit = True
        self.counters["snapshot_restores"] += 1
        self._started(handle, slot, int(np.asarray(snap.first)[0]))

    def _prefill_group(self, group: list) -> None:
        """Prefills the requests of one prompt bucket into their slots in one pass and emits their first
        tokens. One request runs at n = 1; several at n = _group_rows(bucket) (padding rows: slot id B,
        no valid token), so each bucket has two compiled prefills."""
        c = self.config
        prompts = [h.prompt_ids for h, _, _ in group]
        n = 1 if len(group) == 1 else self._group_rows(api._bucket(max(len(p) for p in prompts)))
        tokens, n_valid = api._prompt_batch(prompts + [[]] * (n - len(group)))  # [n, T], [n]: padding rows empty
        bucket = tokens.shape[1]
        ids = np.full(n, c.batch_slots, np.int32)
        page_rows = np.zeros((n, self.pages_per_slot), np.int32)
        stop_rows = np.full((n, c.max_stop_ids), loop.NO_STOP, np.int32)
        remaining = np.ones(n, np.int32)
        for j, (handle, slot, reservation) in enumerate(group):
            self._active[slot] = Active(handle, reservation, self._text_stream(handle))
            ids[j], remaining[j] = slot, handle.max_tokens
            page_rows[j], stop_rows[j] = self._rows_for(handle, reservation)
        first = self._device.prefill(ids, page_rows, tokens, n_valid, remaining, stop_rows)
        self.counters["prefills"] += 1
        for handle, slot, _ in group:
            key = tuple(handle.prompt_ids)
            if self.snapshots.enabled and handle.id >= 0 and key not in self.snapshots:
                self._save_snapshot(key, slot, len(handle.prompt_ids), bucket)
        for j, (handle, slot, _) in enumerate(group):
            self._started(handle, slot, int(first[j]))

    def _started(self, handle: RequestHandle, slot: int, token: int) -> None:
        """Counts an admitted request and emits its first token (which may also finish it)."""
        self.counters["admitted"] += 1
        self.counters["prompt_tokens"] += len(handle.prompt_ids)
        self._deliver(slot, [token])
        if slot in self._active and (token in handle.stop_ids or handle.max_tokens == 1):
            self._active[slot].live_on_device = False  # done there too (the prefill's done flag)
            self._release(slot, "stop" if token in handle.stop_ids else "length")

    def _save_snapshot(self, key: tuple, slot: int, prompt_len: int, bucket: int) -> None:
        n_pages = min(self.allocator.pages_for(bucket), self.pages_per_slot)
        if not self.snapshots.fits(self._snapshot_bytes(n_pages)):
            self.snapshots.too_large += 1
            return
        snap_state, first, d1, mh = self._device.take_snapshot(slot, n_pages)
        self.snapshots.put(key, Snapshot(snap_state, first, d1, mh, self.allocator.pages_for(prompt_len), prompt_len))

    def _snapshot_bytes(self, n_pages: int) -> int:
        return self._device.snapshot_bytes(n_pages)
