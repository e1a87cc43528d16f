"""The serving engine's device side: one DecodeState of B slot rows over a shared KV page pool plus
the `loop.Slots` carry, and every device call the scheduler (qmtp.serve.engine) makes on them.

The scheduler decides (which request, which slot, which pages); this class only moves arrays:
prefill a group of prompts into their slots, copy an exact-prompt snapshot in or out, run a bounded
number of rounds / steps over all slots, retire slots that the host released. Slot indices, page
rows and stop rows are traced values, so the compiled programs are: one loop, two prefills per
prompt bucket (1 and `prefill_batch` rows), one snapshot copy per page count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qmtp import api
from qmtp.runtime import loop, tp as tp_lib
from qmtp.runtime.state import init_state
from qmtp.serve import slots as slots_lib
from qmtp.serve.snapshots import Snapshot, snapshot_bytes


class DeviceBatch:
    def __init__(self, model: api.Model, batch_slots: int, pages_per_slot: int, num_pages: int, max_stop_ids: int,
                 mtp_k: int):
        self.model, self.k = model, mtp_k
        cfg, dtype = model.cfg, api.DTYPES[model.dtype]
        table = np.zeros((batch_slots, pages_per_slot), np.int32)  # [B, Pmax]
        # the GDN state stays in the loop's ring of K+2 slots between calls, so no call copies it in
        # and out (~0.6 GB per sequence at 27B, K=3)
        slots = loop.ring_size(mtp_k)
        if model.mesh is not None:
            self.state = tp_lib.init_state(cfg, model.mesh, table, num_pages, model.page_size, dtype, gdn_slots=slots)
        else:
            self.state = init_state(cfg, table, num_pages, model.page_size, dtype, gdn_slots=slots)
        self.slots = loop.Slots.empty(batch_slots, cfg.hidden_size, max_stop_ids, dtype)

    def _call(self, fn, lead, args, kinds, out_kinds, **static):
        return api._call(self.model, fn, lead, args, kinds, out_kinds, **static)

    def prefill(self, ids, page_rows, tokens, n_valid, remaining, stop_rows) -> np.ndarray:
        """Prefills prompts tokens [n, T] (n_valid [n]) into slots ids [n] (id B: a padding row that
        writes nothing) with their page rows [n, Pmax], token budgets [n] and stop rows [n, NS];
        returns each row's first token [n]."""
        first, self.state, self.slots = self._call(
            slots_lib.prefill_into_slots, (self.model.cfg, self.model.kernels, bool(self.k)),
            (self.model.params, self.state, self.slots, ids, page_rows, tokens, n_valid, remaining, stop_rows),
            ("params", "state") + ("rep",) * 7, ("rep", "state", "rep"))
        return np.asarray(first)

    def restore(self, snap: Snapshot, slot: int, page_row, max_tokens: int, stop_row):
        """Copies a snapshot into `slot` (its pages: page_row [Pmax]); returns the snapshot's state,
        whose arrays the copy donated and handed back."""
        self.state, snap_state, self.slots = self._call(
            slots_lib.restore_snapshot, (),
            (self.state, snap.state, self.slots, np.int32(slot), page_row, np.int32(snap.n_pages), snap.first,
             snap.d1, snap.mh, np.int32(max_tokens), stop_row),
            ("state", "state") + ("rep",) * 9, ("state", "state", "rep"))
        return snap_state

    def take_snapshot(self, slot: int, n_pages: int) -> tuple:
        """(state, first, d1, mh) of `slot` right after its prefill: its conv/ssm rows and its first
        n_pages KV pages (target and MTP)."""
        self.state, snap_state, first, d1, mh = self._call(
            slots_lib.take_snapshot, (n_pages,), (self.state, self.slots, np.int32(slot)), ("state", "rep", "rep"),
            ("state", "rows_state", "rep", "rep", "rep"))
        return snap_state, first, d1, mh

    def snapshot_bytes(self, n_pages: int) -> int:
        return snapshot_bytes(self.state, self.slots, n_pages)

    def run(self, n: int):
        """n MTP rounds (or plain steps) over all slots. Returns host arrays (out [B, n (K+1)], count
        [B], done [B]) and the MTP statistics (None for plain decoding)."""
        out, count, stats, self.state, self.slots = self._call(
            loop.decode, (self.model.cfg, self.model.kernels, self.k, n), (self.model.params, self.state, self.slots),
            ("params", "state", "rep"), ("rep", "rep", "rep", "state", "rep"))
        out, count, done = jax.device_get((out, count, self.slots.done))
        return out, count, done, (jax.device_get(stats) if self.k else None)

    def retire(self, mask: np.ndarray) -> None:
        """Marks the slots of mask [B] done on the device (released by the host while still live)."""
        self.slots = slots_lib.retire(self.slots, jnp.asarray(mask))
