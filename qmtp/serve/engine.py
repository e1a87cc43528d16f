"""Continuous-batching engine: a bounded request queue, B batch slots, one scheduler thread.

    submit() -> bounded FIFO queue -> admission into a free slot (pages reserved for
    prompt + max_tokens + K + 1 through qmtp.runtime.paging.PageAllocator) -> prefill into the slot (or an
    exact-prompt snapshot copied in) -> bounded device loop -> tokens out -> finish -> release

The scheduler thread owns the device state: one DecodeState of `batch_slots` rows over a shared KV
page pool, and the `loop.Slots` carry. Each iteration (a "scheduling point"):
  1. drops cancelled requests and, while shutting down, aborts what must be aborted;
  2. admits queued requests in FIFO order while a slot is free and the head's pages fit (the head
     waits for pages; a request that could never fit was refused by submit());
  3. runs `rounds_per_call` rounds of the decode loop (`loop.decode`: MTP rounds, or plain steps
     at K = 0) over all slots; done or empty slots ride along and write nothing;
  4. streams each slot's new tokens; a slot that stopped (stop id, max_tokens, stop string) finishes.
The device side (the state, the slots carry and every device call) is `engine_device.DeviceBatch`;
this module is the host side, with admission (step 2 and the first tokens) in `engine_admission`.
Compiled programs: one loop; per prompt bucket (powers of two >= 16, as qmtp.generate) a prefill of
one prompt and one of `prefill_batch` prompts (requests of one bucket admitted at one scheduling
point share a pass: the weights are read once for all of them); one snapshot copy per page-count
bucket: slot indices and page rows are traced values.

Release exactly once: a slot's record lives in `_active` from admission until `_release` pops it;
the pop is the only place that returns pages (PageAllocator.release raises on a second release) and
the slot, so a request that finishes, is cancelled, stopped by a string, or aborted releases once.
A slot released while still live on the device is marked done there (`slots.retire`) before any
other device call, so its old pages are never written again.

Tokens equal qmtp.generate's for the same prompt: the same prefill (the same bucket) and the same
loop body (steps and rounds are shared functions); only the batch composition differs, which
greedy decoding does not see (float32; the bf16 rule is in WORKSPACE.md).

Shutdown: `shutdown(timeout)` stops admission, aborts queued requests (finish "abort"), lets active
ones run until `timeout`, then aborts them; `stop(timeout)` also joins the thread, returns whether it
exited, and can be called again. Everything is released when the thread exits.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import traceback

import numpy as np

from qmtp import api
from qmtp.runtime import loop
from qmtp.runtime.paging import PageAllocator
from qmtp.serve.admission import Active, Admission
from qmtp.serve.device import DeviceBatch
from qmtp.serve.requests import EngineStopped, Event, QueueFull, RequestHandle, RequestLimits
from qmtp.serve.snapshots import SnapshotStore
from qmtp.serve.textstream import TextStream

IDLE_WAIT_S = 0.5  # the thread re-checks deadlines this often while idle


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    batch_slots: int = 4  # B: requests decoded together
    mtp_k: int = 0  # drafts per round, 0 (plain) .. 4
    rounds_per_call: int = 4  # MTP rounds (or plain steps) per device call between scheduling points
    max_model_len: int = 0  # prompt + max_tokens limit; 0 = max_position_embeddings - (K+1)
    num_pages: int = 0  # KV pages in the pool; 0 = every slot can hold a max_model_len request
    max_queue: int = 64  # queued (not yet admitted) requests beyond which submit() raises QueueFull
    max_stop_ids: int = 8  # stop token ids per request (device-side, NS)
    snapshot_budget_bytes: int = 0  # exact-prompt snapshots; 0 = off
    stop_token_ids: tuple[int, ...] | None = None  # default stop ids (None: the checkpoint's eos ids)
    prefill_batch: int = 4  # prompts of one bucket admitted together are prefilled in one pass (1: one by one)
    max_prefill_tokens: int = 8192  # rows x bucket of one batched prefill at most

    def validate(self) -> None:
        checks = [(self.batch_slots >= 1, f"--batch_slots={self.batch_slots} must be >= 1"),
                  (0 <= self.mtp_k <= loop.MAX_K, f"--mtp_k={self.mtp_k}: supported 0..{loop.MAX_K}"),
                  (self.rounds_per_call >= 1, f"--rounds_per_call={self.rounds_per_call} must be >= 1"),
                  (self.max_model_len >= 0, f"--max_model_len={self.max_model_len} must be >= 0"),
                  (self.num_pages >= 0, f"--num_pages={self.num_pages} must be >= 0"),
                  (self.max_queue >= 1, f"--max_queue={self.max_queue} must be >= 1"),
                  (self.max_stop_ids >= 1, f"--max_stop_ids={self.max_stop_ids} must be >= 1"),
                  (self.snapshot_budget_bytes >= 0, f"--snapshot_budget_bytes={self.snapshot_budget_bytes} < 0"),
                  (self.prefill_batch >= 1, f"--prefill_batch={self.prefill_batch} must be >= 1"),
                  (self.max_prefill_tokens >= 1, f"--max_prefill_tokens={self.max_prefill_tokens} must be >= 1")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class Engine(Admission):
    """The scheduler (module doc); admission into slots is `engine_admission.Admission`'s."""

    def __init__(self, model: api.Model, config: EngineConfig = EngineConfig()):
        config.validate()
        self.config = config
        self.k = config.mtp_k
        self.extra = self.k + 1 if self.k else 0  # verify writes K+1 positions past the committed length
        self._cv = threading.Condition()
        self._finish_lock = threading.Lock()
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._active: dict[int, Active] = {}
        self._retire_mask = np.zeros(config.batch_slots, bool)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._deadline = float("inf")
        self._failed: str | None = None
        self._reload: api.Model | None = None
        self._reload_error: str | None = None
        self._next_id = 0
        self.counters = collections.Counter()  # read by qmtp.serve.metrics
        self.accept_hist = np.zeros(self.k + 1, np.int64)
        self.position_accepts = np.zeros(self.k, np.int64)
        self.snapshots = SnapshotStore(config.snapshot_budget_bytes)
        self._set_model(model)

    # ---- model and device state --------------------------------------------------------------------
    def _set_model(self, model: api.Model) -> None:
        """Checks the model against the config (ValueError, nothing changed), then builds the state."""
        cfg, c = model.cfg, self.config
        if self.k:
            from qmtp.model import mtp
            mtp.check_supported(cfg)
        limit = cfg.max_position_embeddings - self.extra
        if c.max_model_len > limit:
            raise ValueError(f"--max_model_len={c.max_model_len} + {self.extra} (K+1 verify positions) exceeds "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        stop_ids = tuple(cfg.eos_token_ids if c.stop_token_ids is None else c.stop_token_ids)
        if len(stop_ids) > c.max_stop_ids:
            raise ValueError(f"{len(stop_ids)} default stop ids > --max_stop_ids={c.max_stop_ids}")
        self.model, self.default_stop_ids = model, stop_ids
        self.max_model_len = c.max_model_len or limit
        self.page_size = model.page_size
        self.pages_per_slot = -(-(self.max_model_len + self.extra) // self.page_size)  # Pmax
        num_pages = c.num_pages or model.num_pages or c.batch_slots * self.pages_per_slot
        self.allocator = PageAllocator(num_pages, self.page_size)
        self.limits = RequestLimits(cfg.vocab_size, self.max_model_len, self.page_size, num_pages, self.extra,
                                    c.max_stop_ids, model.tokenizer is not None)
        self._device = DeviceBatch(model, c.batch_slots, self.pages_per_slot, num_pages, c.max_stop_ids, self.k)
        self._free_slots = list(range(c.batch_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.snapshots.clear()  # snapshots belong to the weights they were computed with

    # ---- public API ---------------------------------------------------------------------------------
    def start(self) -> "Engine":
        with self._cv:
            if self._stopping:
                raise EngineStopped("the engine was stopped; create a new one")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="qmtp-engine", daemon=True)
                self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def failed(self) -> str | None:
        return self._failed

    def submit(self, prompt_ids, max_tokens: int, stop_token_ids=None, stop: tuple[str, ...] = (),
               listener=None) -> RequestHandle:
        """Queues a greedy completion of prompt_ids (token ids) for up to max_tokens tokens.

        stop_token_ids: None = the default stop ids (the checkpoint's eos ids), else exactly these;
        stop: stop strings (need a tokenizer). Raises RequestError (never servable as given),
        QueueFull, or EngineStopped."""
        ids = self.limits.check(prompt_ids, max_tokens, stop_token_ids, stop)
        stop_ids = self.default_stop_ids if stop_token_ids is None else tuple(int(t) for t in stop_token_ids)
        with self._cv:
            if self._stopping or self._failed:
                self.counters["rejected_shutting_down"] += 1
                raise EngineStopped(f"the engine is not accepting requests: {self._failed or 'shutting down'}")
            if len(self._queue) >= self.config.max_queue:
                self.counters["rejected_queue_full"] += 1
                raise QueueFull(f"the request queue is full ({self.config.max_queue} waiting, --max_queue); "
                                "retry later")
            handle = RequestHandle(self, self._next_id, ids, max_tokens, stop_ids, tuple(stop), listener)
            handle.capacity = len(ids) + max_tokens + self.extra
            self._next_id += 1
            self._queue.append(handle)
            self.counters["submitted"] += 1
            self._cv.notify_all()
        return handle

    def generate(self, prompt_ids, max_tokens: int, stop_token_ids=None, stop=(), timeout: float | None = None):
        """submit() and wait: a Completion."""
        return self.submit(prompt_ids, max_tokens, stop_token_ids, stop).result(timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops admission now, aborts queued requests, gives active ones `timeout` s, then aborts them."""
        with self._cv:
            self._deadline = min(self._deadline, time.monotonic() + timeout)
            self._stopping = True
            queued = self._drain_queue()
            self._cv.notify_all()
        for handle in queued:  # listeners are never called under the lock
            self._finish(handle, "abort", error="the server is shutting down")

    def stop(self, timeout: float = 30.0, wait: float | None = None) -> bool:
        """shutdown(timeout), then waits up to `wait` s (default timeout + 10) for the thread to exit.
        True once the thread exited and everything is released; safe to call again after False."""
        self.shutdown(timeout)
        if self._thread is None:
            return True
        self._thread.join(timeout + 10.0 if wait is None else wait)
        return not self._thread.is_alive()

    def reload(self, model: api.Model, timeout: float | None = None) -> None:
        """Swaps in another model between requests: admission pauses, active requests finish, the state
        is rebuilt and every snapshot dropped. Blocks until done (TimeoutError after `timeout`)."""
        with self._cv:
            if self._thread is None or not self._thread.is_alive():
                if self._active:
                    raise RuntimeError("reload with active requests but no engine thread")
                self._set_model(model)
                return
            self._reload, self._reload_error = model, None
            self._cv.notify_all()
            if not self._cv.wait_for(lambda: self._reload is None or self._failed, timeout):
                raise TimeoutError(f"reload not done after {timeout} s (active requests still running)")
            if self._reload_error:
                raise ValueError(self._reload_error)

    def warmup(self, prompt_lengths=(1,)) -> float:
        """Compiles the prefill for these prompt lengths' buckets and the loop before start(); seconds."""
        if self._thread is not None:
            raise RuntimeError("warmup() must run before start()")
        t0 = time.perf_counter()
        for n in prompt_lengths:
            # the single prefill, and the batched one (two requests are padded to _group_rows rows)
            batched = 2 if self._group_rows(api._bucket(n)) > 1 else 1
            fit = self.allocator.free_pages // self.allocator.pages_for(n + 1 + self.extra)
            for rows in sorted({1, min(batched, fit)}):
                group = []
                for _ in range(rows):
                    handle = RequestHandle(self, -1, [0] * n, 1, (), (), listener=lambda e: None)
                    handle.capacity = n + 1 + self.extra
                    group.append((handle, self._free_slots.pop(), self.allocator.reserve(handle.capacity)))
                self._prefill_group(group)
                self._flush_retired()
        self._run_loop()  # every slot is done: compiles, runs no round
        self.counters.clear()
        return time.perf_counter() - t0

    def stats(self) -> dict:
        """Gauges for /metrics and tests."""
        with self._cv:
            queued = len(self._queue)
        return {"queued": queued, "active": len(self._active), "free_slots": len(self._free_slots),
                "batch_slots": self.config.batch_slots, "free_pages": self.allocator.free_pages,
                "num_pages": self.allocator.num_pages}

    # ---- the scheduler thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._iteration():
                pass
        except Exception as e:  # a device or program failure: fail every request, release everything
            self._failed = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            with self._cv:
                self._stopping = True
                queued = self._drain_queue()
                self._cv.notify_all()
            for handle in queued:
                self._finish(handle, "error", error=self._failed)
            for slot in list(self._active):
                self._release(slot, "error", error=self._failed)
            with self._cv:
                self._cv.notify_all()

    def _iteration(self) -> bool:
        """One scheduling point; False when the thread should exit."""
        with self._cv:
            while not (self._queue or self._active or self._stopping or self._reload is not None):
                self._cv.wait(IDLE_WAIT_S)
            expired = self._stopping and time.monotonic() >= self._deadline
            cancelled = [s for s, a in self._active.items() if a.handle.cancel_requested or expired]
        for slot in cancelled:
            reason = "abort" if expired and not self._active[slot].handle.cancel_requested else "cancelled"
            self._release(slot, reason, error="the server is shutting down" if reason == "abort" else None)
        self._flush_retired()
        if self._reload is not None and not self._active:
            self._apply_reload()
        self._admit_all(self._take_admissions())
        if self._active:
            self._run_loop()
        if self._stopping and not self._active:
            with self._cv:
                queued = self._drain_queue()  # normally empty: shutdown() drained it
            for handle in queued:
                self._finish(handle, "abort", error="the server is shutting down")
            return False
        return True

    def _apply_reload(self) -> None:
        """Swaps the model (no request is active); queued requests the new limits refuse end in "error"."""
        error, refused = None, []
        try:
            self._set_model(self._reload)
            self.counters["reloads"] += 1
        except ValueError as e:  # the old model stays
            error = f"reload refused: {e}"
        with self._cv:
            for handle in list(self._queue):
                try:
                    self.limits.check(handle.prompt_ids, handle.max_tokens, handle.stop_ids, handle.stop_strings)
                except ValueError as e:
                    self._queue.remove(handle)
                    refused.append((handle, str(e)))
                handle.capacity = len(handle.prompt_ids) + handle.max_tokens + self.extra
            self._reload, self._reload_error = None, error
            self._cv.notify_all()
        for handle, message in refused:
            self._finish(handle, "error", error=f"after a model reload: {message}")

    def _drain_queue(self) -> list[RequestHandle]:
        """Empties the queue (caller holds the lock)."""
        queued = list(self._queue)
        self._queue.clear()
        return queued

    def _run_loop(self) -> None:
        """One bounded device call over all slots, then delivery and finishing."""
        self._flush_retired()
        out, count, done, stats = self._device.run(self.config.rounds_per_call)
        self.counters["loop_calls"] += 1
        if stats is not None:
            self.counters["mtp_rounds"] += int(stats["rounds"].sum())
            self.counters["mtp_drafted"] += int(stats["drafted"].sum())
            self.counters["mtp_accepted"] += int(stats["accepted"].sum())
            self.accept_hist += stats["accept_hist"]
            self.position_accepts += stats["position_accepts"]
        for slot in list(self._active):
            tokens = out[slot, :count[slot]].tolist()
            if tokens:
                self._deliver(slot, tokens)
            if slot in self._active and done[slot]:
                active = self._active[slot]
                active.live_on_device = False
                last = active.handle.tokens[-1]
                self._release(slot, "stop" if last in active.handle.stop_ids else "length")

    # ---- per-request bookkeeping (engine thread) ----------------------------------------------------
    def _text_stream(self, handle: RequestHandle) -> TextStream | None:
        if self.model.tokenizer is None:
            return None
        return TextStream(self.model.tokenizer, handle.stop_strings)

    def _deliver(self, slot: int, tokens: list[int]) -> None:
        active = self._active[slot]
        handle = active.handle
        room = handle.max_tokens - len(handle.tokens)
        if len(tokens) > room:
            raise AssertionError(f"slot {slot} produced {len(tokens)} tokens with {room} left of max_tokens")
        self.counters["generation_tokens"] += len(tokens)
        text = active.stream.push(tokens) if active.stream is not None else ""
        self._send(handle, Event(tokens, text))
        if active.stream is not None and active.stream.stopped:
            self._release(slot, "stop")

    def _release(self, slot: int, reason: str, error: str | None = None) -> None:
        """Finishes the slot's request and returns its pages and the slot: the only place that does."""
        active = self._active.pop(slot)
        self.allocator.release(active.reservation)
        if active.live_on_device:
            self._retire_mask[slot] = True
        tail = active.stream.finish() if active.stream is not None and reason in ("stop", "length") else ""
        with self._cv:
            self._free_slots.append(slot)
            self.counters["released"] += 1
            self._cv.notify_all()
        self._finish(active.handle, reason, error, tail)

    def _flush_retired(self) -> None:
        if self._retire_mask.any():
            self._device.retire(self._retire_mask)
            self._retire_mask[:] = False

    def _finish(self, handle: RequestHandle, reason: str, error: str | None = None, text: str = "") -> None:
        with self._finish_lock:  # finishing happens on the engine thread and on callers' threads
            self.counters[f"finished_{reason}"] += 1
        self._send(handle, Event([], text, reason, error))

    def _send(self, handle: RequestHandle, event: Event) -> None:
        try:
            handle._emit(event)
        except Exception:  # a listener's failure must not stop the engine
            traceback.print_exc()
            handle._done.set()

    def _cancel(self, handle: RequestHandle) -> None:
        with self._cv:
            if handle.finished or handle.cancel_requested:
                return
            handle.cancel_requested = True
            queued = handle in self._queue
            if queued:  # never started: finish now
                self._queue.remove(handle)
            self._cv.notify_all()
        if queued:
            self._finish(handle, "cancelled")
