"""Continuous-batching engine: a bounded request queue, B batch slots, one scheduler thread.

The scheduler thread owns the device side (slots.DeviceBatch). Each iteration (a scheduling point):
  1. drops cancelled requests and, while shutting down past the deadline, aborts the active ones;
  2. admits queued requests FIFO while a slot is free and the head's pages (prompt + max_tokens +
     K+1) fit: each is prefilled with the others of its prompt bucket in one pass, and its first
     token emitted; a longer prompt is prefilled piece by piece instead, one piece per scheduling
     point (FIFO), so it holds the running streams up by one piece at a time, not its whole prefill.
     A piece is prefill_chunk tokens, or interleave_piece while other slots decode (a smaller piece
     bounds their wait; a prompt that arrives at an idle engine still goes in prefill_chunk pieces),
     and "longer" means longer than that. With the prefix cache
     (qmtp/serve/prefix_cache.py) every prompt is prefilled in passes, several prompts' of one width
     together, up to a piece's tokens of them per scheduling point: from the deepest checkpoint of
     its block chain (looked up at admission, whose pages it then shares, and again before its first
     pass), with passes ending where the cache keeps a checkpoint;
  3. runs `rounds_per_call` rounds of `loop.decode` over all slots (done or empty ones write nothing;
     a slot between pieces is done on the device);
  4. streams each slot's new tokens; a slot that stopped (stop id, max_tokens, stop string) finishes.
Tokens equal qmtp.generate's: the same prefill bucket and loop body; greedy decoding does not see the
batch composition. A request may sample (temperature > 0, top_k, top_p, min_p, seed): its slot's
parameters go to every device call, and a sampled request's draws depend only on its seed and the
position, so a seeded request gives qmtp.generate's tokens with that seed. While any active slot
samples, the loop runs its sampled form (greedy slots at temperature 0 keep the greedy tokens); while
any asks for logprobs, the sampled form that also returns them (prefills always return the first
token's).

Release exactly once: a slot's record lives in `_active` from admission until `_release` pops it,
the only place that returns its pages and slot. A slot released while live on the device is retired
(marked done) there before any other device call, so its old pages are never written again.

Compiles: a device call whose shape has no compiled program compiles inside the scheduling point and
stalls every slot. `warmup()` (or `start(warmup_buckets=...)`, on the thread, before the first
scheduling point) runs every program of the chosen prompt buckets and the loop first
(qmtp/serve/warmup.py), one log line each; until it is done `warming` holds its progress and submit()
refuses requests (WarmingUp). Any compile after it, a shape it did not cover, is logged with its
seconds ("compiled while serving: ...", counted in counters["serving_compiles"]).

Scoring (`score`: a prompt's tokens' log-probabilities, qmtp.score, for the server's echo) runs on the
scheduler thread too, at the next scheduling point, on a state of its own beside the slots'.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import threading
import time
import traceback

import numpy as np

from qmtp import api, sampling_args, scoring
from qmtp.runtime import adaptive_k, loop, ops
from qmtp.runtime.paging import PageAllocator
from qmtp.serve import compile_watch, slot_sampling
from qmtp.serve.engine_config import (DEFAULT_MAX_MODEL_LEN, EngineConfig, RequestLimits, interleave_piece, prefix_block,
                                      prefix_cache_budget)
from qmtp.serve.requests import EngineStopped, Event, QueueFull, RequestError, RequestHandle, WarmingUp
from qmtp.serve.slots import DeviceBatch
from qmtp.serve.prefix_cache import PrefixCache
from qmtp.serve.textstream import TextStream
from qmtp.serve.prompt_passes import PassPrefill
from qmtp.serve.warmup import Step, plan as warmup_plan, run as warmup_run

IDLE_WAIT_S = 0.5  # the thread re-checks deadlines this often while idle
SHUTTING_DOWN = "the server is shutting down"


@dataclasses.dataclass
class Active:
    """An admitted request's slot record, from admission until its release."""

    handle: RequestHandle
    reservation: int  # PageAllocator handle
    stream: TextStream | None


def _print_line(line: str) -> None:
    print(line, flush=True)


class Engine:
    def __init__(self, model: api.Model, config: EngineConfig = EngineConfig(), log=None):
        """log(line): where the warm-up's progress and compiles while serving are reported (default: stdout)."""
        config.validate()
        self.config = config
        self._log = log or _print_line
        self.warming: tuple[int, int] | None = None  # (programs done, programs) while warming up
        self.adaptive = config.mtp_k == api.AUTO  # K chosen per round among adaptive_k.CANDIDATES
        self.k = adaptive_k.CANDIDATES[-1] if self.adaptive else config.mtp_k  # the most drafts of a round
        self.round_cost: np.ndarray | None = None  # adaptive: seconds per round at each candidate (the warm-up's)
        self.extra = self.k + 1 if self.k else 0  # verify writes K+1 positions past the committed length
        self._cv = threading.Condition()
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._scores: collections.deque = collections.deque()  # (prompt ids, top_logprobs, Future) to score
        self._active: dict[int, Active] = {}
        self.passes = PassPrefill(self)  # prompts being prefilled pass by pass
        self._retire_mask = np.zeros(config.batch_slots, bool)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._deadline = float("inf")
        self.failed: str | None = None  # why the engine thread died
        self._reload: api.Model | None = None
        self._reload_error: str | None = None
        self._next_id = 0
        self.counters = collections.Counter()  # read by qmtp.serve.metrics
        self.accept_hist = np.zeros(self.k + 1, np.int64)
        self.position_accepts = np.zeros(self.k, np.int64)
        self.sampled_position_accepts = np.zeros(self.k, np.int64)  # of sampled requests only
        self.k_rounds = np.zeros(len(adaptive_k.CANDIDATES), np.int64)  # adaptive: loop rounds run at each K
        self.prefix: PrefixCache | None = None
        self._set_model(model)

    def _set_model(self, model: api.Model) -> None:
        """Checks the model against the config (ValueError, nothing changed), then builds the state."""
        cfg, c = model.cfg, self.config
        if self.k:
            from qmtp.model import mtp
            mtp.check_supported(cfg)
        ops.check_deterministic_rows(model.kernels, c.batch_slots, self.k, "--batch_slots x (K+1)")
        limit = cfg.max_position_embeddings - self.extra
        if c.max_model_len > limit:
            raise ValueError(f"--max_model_len={c.max_model_len} + {self.extra} (K+1 verify positions) exceeds "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        stop_ids = tuple(cfg.eos_token_ids if c.stop_token_ids is None else c.stop_token_ids)
        if len(stop_ids) > c.max_stop_ids:
            raise ValueError(f"{len(stop_ids)} default stop ids > --max_stop_ids={c.max_stop_ids}")
        self.model, self.default_stop_ids = model, stop_ids
        self.piece = model.kernels.prefill_chunk  # longer prompts are prefilled piece by piece
        self.interleave_piece = interleave_piece(c, model)  # a pass's tokens at most while other slots decode
        self.max_model_len = c.max_model_len or min(DEFAULT_MAX_MODEL_LEN, limit)
        self.page_size = model.page_size
        self.pages_per_slot = -(-(self.max_model_len + self.extra) // self.page_size)  # Pmax
        num_pages = c.num_pages or model.num_pages or c.batch_slots * self.pages_per_slot
        self.allocator = PageAllocator(num_pages, self.page_size)
        self.limits = RequestLimits(cfg.vocab_size, self.max_model_len, self.page_size, num_pages, self.extra,
                                    c.max_stop_ids, model.tokenizer is not None)
        self._device = DeviceBatch(model, c.batch_slots, self.pages_per_slot, num_pages, c.max_stop_ids, self.k)
        self._sampling = slot_sampling.SlotSampling(c.batch_slots)
        self._free_slots = list(range(c.batch_slots - 1, -1, -1))  # pop() hands out slot 0 first
        if self.prefix is not None:
            self.prefix.clear()  # its checkpoints belong to the weights they were computed with
        self.prefix = None
        if c.prefix_cache_bytes:
            page_bytes = self._device.page_bytes()
            budget, state_limit = prefix_cache_budget(c, num_pages * page_bytes, self._device.memory_headroom())
            self.prefix = PrefixCache(prefix_block(c, model), budget, self.allocator, page_bytes)
            self.prefix.state_limit = state_limit

    # ---- public API ---------------------------------------------------------------------------------
    def start(self, warmup_buckets=None) -> "Engine":
        """Starts the scheduler thread (no-op once started). warmup_buckets: prompt lengths or buckets (e.g.
        prompt_buckets()) whose programs the thread compiles first, with the loop, as warmup() does; until
        then `warming` is set and submit() raises WarmingUp. ValueError (nothing started) for a bucket no
        request can reach."""
        if warmup_buckets is None and self.adaptive and self.round_cost is None:  # the warm-up times the rounds
            warmup_buckets = [api.MIN_PROMPT_BUCKET]
        steps = None if warmup_buckets is None else warmup_plan(self, warmup_buckets)
        with self._cv:
            if self._stopping:
                raise EngineStopped("the engine was stopped; create a new one")
            if self._thread is None:
                if steps is not None:
                    self.warming = (0, len(steps))
                self._thread = threading.Thread(target=self._loop, args=(steps,), name="qmtp-engine", daemon=True)
                self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, prompt_ids, max_tokens: int, stop_token_ids=None, stop: tuple[str, ...] = (),
               listener=None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
               seed: int | None = None, logprobs: int | None = None, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, logit_bias: dict | None = None, min_tokens: int = 0,
               repetition_penalty: float = 1.0, allowed_token_ids=None, include_stop_str_in_output: bool = False,
               skip_special_tokens: bool = True) -> RequestHandle:
        """Queues a completion of prompt_ids (token ids) for up to max_tokens tokens: greedy at temperature
        0, else sampled (qmtp.generate's parameters; seed None: a random one), after the logit bias, the
        repetition penalty and the presence and frequency penalties, among allowed_token_ids where given
        (qmtp.generate's); no stop id or stop string ends it before min_tokens tokens; logprobs N (0 .. 20):
        each token's log-probability and N alternatives (qmtp.generate's), None: off.

        stop_token_ids: None = the default stop ids, else exactly these; stop: stop strings (need a
        tokenizer), which end the text before them or, include_stop_str_in_output (vLLM's), after them;
        skip_special_tokens (vLLM's, default True): the text leaves special tokens out. Raises RequestError
        (never servable as given), QueueFull, or EngineStopped."""
        ids = self.limits.check(prompt_ids, max_tokens, stop_token_ids, stop)
        sampling = slot_sampling.check(temperature, top_k, top_p, min_p, seed, presence_penalty, frequency_penalty,
                                       logit_bias, self.model.cfg.vocab_size, min_tokens, repetition_penalty,
                                       allowed_token_ids)
        if min_tokens > max_tokens:
            raise RequestError(f"min_tokens={min_tokens} must be <= max_tokens={max_tokens}", "min_tokens")
        try:
            sampling_args.check_logprobs(logprobs)
        except ValueError as e:
            raise RequestError(str(e), "logprobs") from None
        stop_ids = self.default_stop_ids if stop_token_ids is None else tuple(int(t) for t in stop_token_ids)
        with self._cv:
            if self._stopping or self.failed:
                self.counters["rejected_shutting_down"] += 1
                raise EngineStopped(f"the engine is not accepting requests: {self.failed or 'shutting down'}")
            warming = self.warming
            if warming is not None:
                self.counters["rejected_warming_up"] += 1
                raise WarmingUp(f"the server is warming up: {warming[0]} of {warming[1]} programs compiled; retry "
                                "when GET /health answers 200")
            if len(self._queue) >= self.config.max_queue:
                self.counters["rejected_queue_full"] += 1
                raise QueueFull(f"the request queue is full ({self.config.max_queue} waiting, --max_queue); "
                                "retry later")
            handle = RequestHandle(self, self._next_id, ids, max_tokens, stop_ids, tuple(stop), listener, sampling,
                                   logprobs, bool(include_stop_str_in_output), bool(skip_special_tokens))
            self._next_id += 1
            self._queue.append(handle)
            self.counters["submitted"] += 1
            self._cv.notify_all()
        return handle

    def score(self, prompt_ids, top_logprobs: int) -> concurrent.futures.Future:
        """Queues the scoring of prompt_ids (qmtp.score: each token's log-probability after the first, with
        top_logprobs alternatives) for the next scheduling point; the Future's result is its TokenLogprobs.
        Raises RequestError (a bad prompt or top_logprobs), EngineStopped or WarmingUp."""
        ids = self.limits.check(prompt_ids, 1, None, ())
        try:
            sampling_args.check_logprobs(top_logprobs)
        except ValueError as e:
            raise RequestError(str(e), "logprobs") from None
        future = concurrent.futures.Future()
        with self._cv:
            if self._stopping or self.failed:
                raise EngineStopped(f"the engine is not accepting requests: {self.failed or 'shutting down'}")
            if self.warming is not None:
                raise WarmingUp("the server is warming up; retry when GET /health answers 200")
            self._scores.append((ids, top_logprobs, future))
            self._cv.notify_all()
        return future

    def _run_scores(self) -> None:
        """Scores the queued prompts."""
        while True:
            with self._cv:
                if not self._scores:
                    return
                ids, top, future = self._scores.popleft()
            try:
                with self._watch(f"scoring a prompt of {len(ids)} tokens"):
                    future.set_result(scoring.score(self.model, [ids], top)[0])
            except Exception as e:  # a device failure: the engine fails (_loop), and so does this request
                future.set_exception(e)
                raise

    @contextlib.contextmanager
    def together(self):
        """Holds admission while the caller submits several requests (a request's n choices), so that one
        scheduling point admits them all where slots allow: choices of one prompt then share its prefill
        (the prefix cache keeps a prompt's end only for the prompts admitted with it)."""
        with self._cv:  # reentrant: submit() takes it too
            yield

    def generate(self, prompt_ids, max_tokens: int, stop_token_ids=None, stop=(), timeout: float | None = None,
                 **sampling):
        """submit() (sampling: its temperature, top_k, top_p, min_p, seed, logprobs) and wait: a Completion."""
        return self.submit(prompt_ids, max_tokens, stop_token_ids, stop, **sampling).result(timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops admission now, aborts queued requests, gives active ones `timeout` s, then aborts them."""
        with self._cv:
            self._deadline = min(self._deadline, time.monotonic() + timeout)
        self._end_queue("abort", SHUTTING_DOWN)

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
        is rebuilt and the prefix cache emptied. Blocks until done (TimeoutError after `timeout`). No
        warm-up: the new model's programs compile on first use (each logged as a compile while serving)."""
        with self._cv:
            if self._thread is None or not self._thread.is_alive():
                if self._active:
                    raise RuntimeError("reload with active requests but no engine thread")
                self._set_model(model)
                return
            self._reload, self._reload_error = model, None
            self._cv.notify_all()
            if not self._cv.wait_for(lambda: self._reload is None or self.failed, timeout):
                raise TimeoutError(f"reload not done after {timeout} s (active requests still running)")
            if self._reload_error:
                raise ValueError(self._reload_error)

    def warmup(self, buckets=None) -> float:
        """Compiles, before start(), every program of these prompt lengths or buckets (None: all of
        prompt_buckets()) and the loop: one log line per program (its seconds), then a total. Returns the
        seconds. ValueError for a bucket no request can reach."""
        if self._thread is not None:
            raise RuntimeError("warmup() must run before start()")
        return warmup_run(self, warmup_plan(self, self.prompt_buckets() if buckets is None else buckets))

    def longest_prompt(self) -> int:
        """The most prompt tokens a request can have: one token of completion must fit in max_model_len
        and, with the K+1 verify positions, in the page pool."""
        return min(self.max_model_len - 1, self.allocator.num_pages * self.page_size - 1 - self.extra)

    def prompt_buckets(self) -> list[int]:
        """Every bucket a servable prompt length rounds up to (powers of two from api.MIN_PROMPT_BUCKET); those
        above the model's prefill_chunk share one program, the piece prefill."""
        top, b, out = api._bucket(self.longest_prompt()), api.MIN_PROMPT_BUCKET, []
        while b <= top:
            out.append(b)
            b *= 2
        return out

    def stats(self) -> dict:
        """Gauges for /metrics and tests."""
        with self._cv:
            return {"queued": len(self._queue), "active": len(self._active), "free_slots": len(self._free_slots),
                    "batch_slots": self.config.batch_slots, "free_pages": self.allocator.free_pages,
                    "num_pages": self.allocator.num_pages}

    def _capacity(self, handle: RequestHandle) -> int:
        """KV positions a request reserves while active."""
        return len(handle.prompt_ids) + handle.max_tokens + self.extra

    # ---- compiles while serving -----------------------------------------------------------------------
    @contextlib.contextmanager
    def _watch(self, program: str):
        """Logs a compile (or compile-cache load) inside the block with its seconds, once warm-up is over
        (the warm-up logs its own lines). program: what the log line calls the device call."""
        if self.warming is not None:
            yield
            return
        t0 = time.perf_counter()
        with compile_watch.watch() as compiles:
            yield
        if compiles:
            self.counters["serving_compiles"] += 1
            xla = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in compiles)
            self._log(f"compiled while serving: {program}: {time.perf_counter() - t0:.2f} s (XLA: {xla}); the "
                      "warm-up did not cover it (--warmup_buckets)")

    # ---- the scheduler thread -----------------------------------------------------------------------
    def _loop(self, warmup_steps: list[Step] | None = None) -> None:
        try:
            if warmup_steps is not None:
                warmup_run(self, warmup_steps)
            while self._iteration():
                pass
        except Exception as e:  # a device or program failure: fail every request, release everything
            self.failed = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            self._end_queue("error", self.failed)
            for slot in list(self._active):
                self._release(slot, "error", error=self.failed)

    def _iteration(self) -> bool:
        """One scheduling point; False when the thread should exit."""
        with self._cv:
            while not (self._queue or self._active or self._scores or self._stopping or self._reload is not None):
                self._cv.wait(IDLE_WAIT_S)
            expired = self._stopping and time.monotonic() >= self._deadline
            cancelled = [s for s, a in self._active.items() if a.handle.cancel_requested or expired]
        for slot in cancelled:
            by_caller = self._active[slot].handle.cancel_requested
            self._release(slot, "cancelled" if by_caller else "abort", None if by_caller else SHUTTING_DOWN)
        self._flush_retired()
        if self._reload is not None and not self._active:
            self._apply_reload()
        self._run_scores()
        self._admit()
        if self.passes.pending:
            self.passes.run()
        if self.decoding():
            self._run_loop()
        if self._stopping and not self._active:
            self._end_queue("abort", SHUTTING_DOWN)  # normally empty: shutdown() drained it
            return False
        return True

    def _end_queue(self, reason: str, error: str) -> None:
        """Stops admission and finishes every queued request and scoring (outside the lock: listeners never run
        under it)."""
        with self._cv:
            self._stopping = True
            queued, scores = list(self._queue), list(self._scores)
            self._queue.clear()
            self._scores.clear()
            self._cv.notify_all()
        for handle in queued:
            self._finish(handle, reason, error)
        for _, _, future in scores:
            future.set_exception(EngineStopped(error))

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
            self._reload, self._reload_error = None, error
            self._cv.notify_all()
        for handle, message in refused:
            self._finish(handle, "error", error=f"after a model reload: {message}")

    # ---- admission ----------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Pops queued requests into free slots (FIFO; the head waits while its pages do not fit). They are
        prefilled in groups of one prompt bucket (FIFO within a bucket), `_group_rows(bucket)` prompts per
        pass; longer prompts than prefill_chunk, and every prompt with the prefix cache, pass by pass."""
        admitted = []
        with self._cv:
            while not self._stopping and self._reload is None and self._queue and self._free_slots:
                head = self._queue[0]
                if self.prefix is not None:
                    reservation = self.passes.reserve_with_prefix(head)
                    if reservation is None:
                        break
                    self._queue.popleft()
                    self.passes.start(head, self._free_slots.pop(), *reservation)
                    continue
                capacity = self._capacity(head)
                if self.allocator.pages_for(capacity) > self.allocator.free_pages:
                    break
                admitted.append((self._queue.popleft(), self._free_slots.pop(), self.allocator.reserve(capacity)))
        groups: dict[int, list] = {}
        longest_pass = self.passes.limit()
        for handle, slot, reservation in admitted:
            if len(handle.prompt_ids) > longest_pass:
                self.passes.start(handle, slot, reservation)
            else:
                groups.setdefault(api._bucket(len(handle.prompt_ids)), []).append((handle, slot, reservation))
        for bucket, group in groups.items():
            rows = self._group_rows(bucket)
            for i in range(0, len(group), rows):
                self._prefill_group(group[i:i + rows])

    def decoding(self) -> bool:
        """Whether a slot decodes at this scheduling point (an active one not being prefilled)."""
        return any(slot not in self.passes.pending for slot in self._active)

    def _group_rows(self, bucket: int) -> int:
        """Rows of a batched prefill for this prompt bucket (padding rows fill a smaller group)."""
        c = self.config
        return max(1, min(c.prefill_batch, c.batch_slots, c.max_prefill_tokens // bucket))

    def _activate(self, handle: RequestHandle, slot: int, reservation: int):
        """Records and counts the slot's request; returns its (page row [Pmax], stop row [NS])."""
        self.counters["admitted"] += 1
        self.counters["prompt_tokens"] += len(handle.prompt_ids)
        tokenizer = self.model.tokenizer
        min_tokens = int((handle.sampling or {}).get("min_tokens", 0))
        stream = (TextStream(tokenizer, handle.stop_strings, min_tokens, handle.include_stop_str,
                             handle.skip_special_tokens) if tokenizer is not None else None)
        self._active[slot] = Active(handle, reservation, stream)
        pages = self.allocator.pages(reservation)
        page_row = np.zeros(self.pages_per_slot, np.int32)
        page_row[:len(pages)] = pages
        stop_row = np.full(self.config.max_stop_ids, loop.NO_STOP, np.int32)
        stop_row[:len(handle.stop_ids)] = handle.stop_ids
        self._sampling.set(slot, handle.sampling)
        return page_row, stop_row

    def _prefill_group(self, group: list) -> None:
        """Prefills the (handle, slot, reservation) of one prompt bucket in one pass and emits their first
        tokens. One request runs at n = 1; several at n = _group_rows(bucket) (padding rows: slot id B),
        so each bucket has two compiled prefills."""
        c = self.config
        prompts = [h.prompt_ids for h, _, _ in group]
        bucket = api._bucket(max(len(p) for p in prompts))
        n = 1 if len(group) == 1 else self._group_rows(bucket)
        ids = np.full(n, c.batch_slots, np.int32)
        page_rows = np.zeros((n, self.pages_per_slot), np.int32)
        stop_rows = np.full((n, c.max_stop_ids), loop.NO_STOP, np.int32)
        remaining = np.ones(n, np.int32)
        for j, (handle, slot, reservation) in enumerate(group):
            ids[j], remaining[j] = slot, handle.max_tokens
            page_rows[j], stop_rows[j] = self._activate(handle, slot, reservation)
        with self._watch(f"prompt bucket {bucket}: prefill x {n} row{'s' if n > 1 else ''}"):
            tokens, n_valid = api._prompt_batch(prompts + [[]] * (n - len(group)))  # [n, T], [n]: padding rows empty
            first, first_lp = self._device.prefill(ids, page_rows, tokens, n_valid, remaining, stop_rows,
                                                   self._sampling.rows(ids, always=True))
        self.counters["prefills"] += len(group)
        self.counters["prefill_passes"] += 1
        self.counters["prefill_pass_rows"] += len(group)
        for j, (handle, slot, _) in enumerate(group):
            self._started(handle, slot, int(first[j]), first_lp, j)

    def _started(self, handle: RequestHandle, slot: int, token: int, logprobs, row: int) -> None:
        """Emits an admitted request's first token (which may also finish it); logprobs: host TokenLogprobs
        [n, 1] of the prefill, the token's at `row`."""
        self._deliver(slot, [token], logprobs, row)
        if slot in self._active and (token in handle.stop_ids or handle.max_tokens == 1):
            self._release_done([slot])  # done on the device too (the prefill's done flag)

    # ---- decoding and delivery ----------------------------------------------------------------------
    def _run_loop(self) -> None:
        """One bounded device call over all slots, then delivery and finishing."""
        self._flush_retired()
        decoding = [s for s in self._active if s not in self.passes.pending]
        logprobs = any(self._active[s].handle.top_logprobs is not None for s in decoding)
        sampling = (self._sampling.rows(range(self.config.batch_slots), always=True)
                    if logprobs or self._sampling.any_sampled(decoding) else None)
        form = "with logprobs" if logprobs else "with sampling" if sampling is not None else ""
        with self._watch(f"decode loop {form}".strip()):
            out, count, done, stats, lp = self._device.run(self.config.rounds_per_call, sampling, logprobs,
                                                           self._round_costs())
        self.counters["loop_calls"] += 1
        if stats is not None:
            for name in ("rounds", "drafted", "accepted"):
                self.counters[f"mtp_{name}"] += int(stats[name].sum())
            self.accept_hist += stats["accept_hist"]
            self.position_accepts += stats["position_accepts"]
            self.counters["mtp_rounds_sampled"] += int(stats["sampled_rounds"].sum())
            self.sampled_position_accepts += stats["sampled_position_accepts"]
            if self.adaptive:
                self.k_rounds += stats["k_rounds"]
        for slot in decoding:  # every slot's tokens first, then the finishes (_release_done)
            tokens = out[slot, :count[slot]].tolist()
            if tokens:
                self._deliver(slot, tokens, lp, slot)
        self._release_done([slot for slot in decoding if slot in self._active and done[slot]])

    def _round_costs(self) -> np.ndarray | None:
        """What the loop chooses K from (adaptive; None: K = self.k every round): the seconds the warm-up
        timed, or while it compiles the loop, equal costs."""
        if not self.adaptive:
            return None
        if self.round_cost is not None:
            return self.round_cost
        if self.warming is None:
            raise RuntimeError("mtp_k='auto' decodes once the warm-up timed a round at each K (Engine.start)")
        return np.ones(len(adaptive_k.CANDIDATES), np.float32)

    def _deliver(self, slot: int, tokens: list[int], logprobs=None, row: int = 0) -> None:
        """Streams the slot's new tokens; logprobs: host TokenLogprobs [n, W] whose row `row` scores them
        (None when no request of the call asked)."""
        active = self._active[slot]
        handle = active.handle
        room = handle.max_tokens - len(handle.tokens)
        if len(tokens) > room:
            raise AssertionError(f"slot {slot} produced {len(tokens)} tokens with {room} left of max_tokens")
        self.counters["generation_tokens"] += len(tokens)
        text = active.stream.push(tokens) if active.stream is not None else ""
        lps = None
        if handle.top_logprobs is not None:
            lps = [dataclasses.replace(t, top=t.top[:handle.top_logprobs])
                   for t in api.token_logprobs(logprobs, row, tokens)]
        self._send(handle, Event(tokens, text, logprobs=lps))
        if active.stream is not None and active.stream.stopped:
            self._release(slot, "stop")

    def _release_done(self, slots: list[int]) -> None:
        """Releases slots the device marked done itself (a stop id or max_tokens): nothing to retire. With
        the prefix cache their ends are kept first, all before any of the requests finishes: a finished
        client's next request then meets the next admission with the others' (a checkpoint between two
        finishes let some arrive a scheduling point earlier, alone: 153 prefill passes instead of 115 for
        256 requests in 8 clients, H100)."""
        if self.prefix is not None:
            for slot in slots:
                active = self._active[slot]
                if active.handle.id >= 0:  # not a warm-up request
                    self.passes.keep_response_end(slot, active.handle, active.reservation)
        for slot in slots:
            handle = self._active[slot].handle
            self._release(slot, "stop" if handle.tokens[-1] in handle.stop_ids else "length", retire=False)

    def _release(self, slot: int, reason: str, error: str | None = None, retire: bool = True) -> None:
        """Finishes the slot's request and returns its pages and the slot: the only place that does. A slot
        still live on the device is retired there before the next device call."""
        active = self._active.pop(slot)
        self.passes.pending.pop(slot, None)
        self.allocator.release(active.reservation)
        if retire:
            self._retire_mask[slot] = True
        tail = active.stream.finish() if active.stream is not None and reason in ("stop", "length") else ""
        with self._cv:
            self._free_slots.append(slot)
            self.counters["released"] += 1
            self._cv.notify_all()
        self._finish(active.handle, reason, error, tail)

    def _flush_retired(self) -> None:
        if self._retire_mask.any():
            with self._watch("slot retire"):
                self._device.retire(self._retire_mask)
            self._retire_mask[:] = False

    def _finish(self, handle: RequestHandle, reason: str, error: str | None = None, text: str = "") -> None:
        with self._cv:  # finishing happens on the engine thread and on callers' threads
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
