"""What a caller of the serving engine holds: request limits and errors, streamed events, the request handle.

A `RequestHandle` is created by `Engine.submit` and written to only by the engine thread (after
submission). Every request ends exactly once with one of these finish reasons:

    "stop"       a stop token id (included in `tokens`) or a stop string (cut from `text`)
    "length"     max_tokens tokens were generated
    "cancelled"  the caller cancelled it (e.g. its HTTP client disconnected)
    "abort"      the engine shut down before it finished (queued ones never started)
    "error"      the engine failed (message in `error`)

Events go to `listener(event)` when one is given (called on the engine thread: it must not block;
the HTTP server hands them to its event loop), else into a queue read by `events()` / `result()`.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

FINISH_REASONS = ("stop", "length", "cancelled", "abort", "error")


class RequestError(ValueError):
    """A request that can never be served as given (HTTP 400); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


class QueueFull(RuntimeError):
    """The bounded request queue is full (HTTP 429): retry later."""


class EngineStopped(RuntimeError):
    """The engine is shutting down, stopped, or failed (HTTP 503)."""


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What a request must satisfy to be servable at all (checked at submission, before queueing)."""

    vocab_size: int
    max_model_len: int  # prompt + max_tokens
    page_size: int
    num_pages: int  # KV pages in the pool
    extra_positions: int  # K + 1 verify positions past the committed length (0 without MTP)
    max_stop_ids: int
    has_tokenizer: bool

    def check(self, prompt_ids, max_tokens, stop_token_ids, stop) -> list[int]:
        """The prompt as a list of ints, or RequestError naming the field and the limit."""
        vocab = self.vocab_size
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} outside the vocabulary [0, {vocab})", "prompt")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(f"max_tokens={max_tokens} must be an integer >= 1", "max_tokens")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; the context limit is max_model_len="
                               f"{self.max_model_len} tokens (prompt + completion, --max_model_len)", "prompt",
                               "context_length_exceeded")
        if len(ids) + max_tokens > self.max_model_len:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} "
                               f"exceeds the context limit max_model_len={self.max_model_len} (--max_model_len)",
                               "max_tokens", "context_length_exceeded")
        need = -(-(len(ids) + max_tokens + self.extra_positions) // self.page_size)
        if need > self.num_pages:
            raise RequestError(f"the request needs {need} KV pages of {self.page_size} tokens but the cache has "
                               f"only {self.num_pages} pages (--num_pages)", "max_tokens", "context_length_exceeded")
        if stop_token_ids is not None:
            stop_ids = [int(t) for t in stop_token_ids]
            if len(stop_ids) > self.max_stop_ids:
                raise RequestError(f"{len(stop_ids)} stop token ids > the limit of {self.max_stop_ids} "
                                   "(--max_stop_ids)", "stop_token_ids")
            if any(not 0 <= t < vocab for t in stop_ids):
                raise RequestError(f"stop token ids must be in [0, {vocab})", "stop_token_ids")
        if stop and not self.has_tokenizer:
            raise RequestError("stop strings need a tokenizer (the checkpoint has no tokenizer.json)", "stop")
        if any(not isinstance(x, str) or not x for x in stop):
            raise RequestError("stop strings must be non-empty strings", "stop")
        return ids


@dataclasses.dataclass
class Event:
    tokens: list[int]  # new token ids
    text: str  # new text ("" without a tokenizer)
    finish_reason: str | None = None  # set on the last event only
    error: str | None = None


@dataclasses.dataclass
class Completion:
    tokens: list[int]
    text: str | None
    finish_reason: str
    prompt_tokens: int
    snapshot_hit: bool
    error: str | None = None


class RequestHandle:
    def __init__(self, engine, request_id: int, prompt_ids: list[int], max_tokens: int, stop_ids: tuple[int, ...],
                 stop_strings: tuple[str, ...], listener=None):
        self._engine = engine
        self.id = request_id
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.stop_ids = stop_ids
        self.stop_strings = stop_strings
        self.capacity = 0  # KV positions reserved while active (set by the engine)
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.snapshot_hit = False
        self.submitted_s = time.perf_counter()
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self.cancel_requested = False
        self._listener = listener
        self._queue: queue.Queue | None = None if listener is not None else queue.Queue()
        self._done = threading.Event()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Asks the engine to drop this request; it then finishes with "cancelled" (no-op once finished)."""
        self._engine._cancel(self)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> Completion:
        """Blocks until the request finished; raises TimeoutError after `timeout` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        return Completion(list(self.tokens), self.text, self.finish_reason, len(self.prompt_ids), self.snapshot_hit,
                          self.error)

    def events(self, timeout: float | None = None):
        """Yields Events until the last one (only without a listener)."""
        if self._queue is None:
            raise RuntimeError("this request streams to its listener")
        while True:
            event = self._queue.get(timeout=timeout)
            yield event
            if event.finish_reason is not None:
                return

    # ---- called by the engine thread -------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        if event.tokens and self.first_token_s is None:
            self.first_token_s = time.perf_counter()
        self.tokens.extend(event.tokens)
        self.text += event.text
        if event.finish_reason is not None:
            self.finish_reason, self.error = event.finish_reason, event.error
            self.finished_s = time.perf_counter()
        if self._listener is not None:
            self._listener(event)
        else:
            self._queue.put(event)
        if event.finish_reason is not None:
            self._done.set()
