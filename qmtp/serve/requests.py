"""What a caller of the serving engine holds: errors, streamed events, the request handle.

Every request ends exactly once with one finish reason (FINISH_REASONS):
    "stop"       a stop token id (included in `tokens`) or a stop string (cut from `text`)
    "length"     max_tokens tokens were generated
    "cancelled"  the caller cancelled it (e.g. its HTTP client disconnected)
    "abort"      the engine shut down before it finished (queued ones never started)
    "error"      the engine failed (message in `error`)
"""

from __future__ import annotations

import dataclasses
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


class WarmingUp(RuntimeError):
    """The engine is still compiling its programs before serving (HTTP 503): retry once /health is ok."""


@dataclasses.dataclass
class Event:
    tokens: list[int]  # new token ids
    text: str  # new text ("" without a tokenizer)
    finish_reason: str | None = None  # set on the last event only
    error: str | None = None
    logprobs: list | None = None  # one api.TokenLogprob per token, when the request asked for them


@dataclasses.dataclass
class Completion:
    tokens: list[int]
    text: str | None
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the prefix cache served (not prefilled)
    error: str | None = None
    logprobs: list | None = None  # one api.TokenLogprob per token, when asked for


class RequestHandle:
    """Created by `Engine.submit`; after submission only the engine writes to it. Events go to
    `listener(event)`, called on the engine thread (it must not block)."""

    def __init__(self, engine, request_id: int, prompt_ids: list[int], max_tokens: int, stop_ids: tuple[int, ...],
                 stop_strings: tuple[str, ...], listener=None, sampling: dict | None = None,
                 top_logprobs: int | None = None, include_stop_str: bool = False, skip_special_tokens: bool = True):
        self._engine, self.id, self._listener = engine, request_id, listener
        self.sampling = sampling  # None: greedy; else temperature, top_k, top_p, min_p, seed (an int)
        self.prompt_ids, self.max_tokens = prompt_ids, max_tokens
        self.stop_ids, self.stop_strings = stop_ids, stop_strings
        self.include_stop_str = include_stop_str  # the text goes on through the stop string that ends it
        self.skip_special_tokens = skip_special_tokens  # the text leaves special tokens out
        self.top_logprobs = top_logprobs  # None: no logprobs; else the alternatives per token (0 .. 20)
        self.tokens: list[int] = []
        self.logprobs: list | None = None if top_logprobs is None else []
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.prefix_hit_tokens = 0  # prompt tokens the prefix cache served (not prefilled)
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self.cancel_requested = False
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
        return Completion(list(self.tokens), self.text, self.finish_reason, len(self.prompt_ids),
                          self.prefix_hit_tokens, self.error, None if self.logprobs is None else list(self.logprobs))

    def _emit(self, event: Event) -> None:
        """Records an event (engine thread) and hands it to the listener."""
        if event.tokens and self.first_token_s is None:
            self.first_token_s = time.perf_counter()
        self.tokens.extend(event.tokens)
        if event.logprobs is not None:
            self.logprobs.extend(event.logprobs)
        self.text += event.text
        if event.finish_reason is not None:
            self.finish_reason, self.error = event.finish_reason, event.error
            self.finished_s = time.perf_counter()
        if self._listener is not None:
            self._listener(event)
        if event.finish_reason is not None:
            self._done.set()
