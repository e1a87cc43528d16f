"""Incremental detokenization with stop strings, for streaming one request's text.

`push(tokens)` appends generated ids and returns the text that is now final. Text is decoded from
all ids so far (`tokenizer.decode(ids, skip_special_tokens=True)`, as qmtp.generate decodes), so
the concatenation of every delta equals the one-shot decode. Held back:
  * a trailing U+FFFD (an incomplete UTF-8 sequence that later bytes may complete);
  * the longest tail that is a prefix of a stop string (it may become the stop string).
When a stop string appears (searched only in text not yet released), the text ends just before it
(OpenAI semantics: the stop string is not returned) and `stopped` is set. `finish()` releases what
was held back when the request ends for another reason.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()):
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.ids: list[int] = []
        self.text = ""  # released so far
        self.stopped = False

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, tokens: list[int]) -> str:
        """Adds generated ids; returns the newly released text (maybe ""). After a stop string, ""."""
        if self.stopped:
            return ""
        self.ids.extend(tokens)
        full = self._decoded()
        start = len(self.text)
        if self.stop_strings:
            # a stop string may straddle what was released and what is new
            search_from = max(0, start - max(len(s) for s in self.stop_strings) + 1)
            hits = [i for i in (full.find(s, search_from) for s in self.stop_strings) if i >= 0]
            if hits:
                self.stopped = True
                end = max(min(hits), start)
                delta, self.text = full[start:end], full[:end]
                return delta
        end = len(full)
        while end > start and full[end - 1] == REPLACEMENT:
            end -= 1
        end = start + _safe_length(full[start:end], self.stop_strings)
        delta, self.text = full[start:end], full[:end]
        return delta

    def finish(self) -> str:
        """The held-back tail, when the request ends without a stop string."""
        if self.stopped:
            return ""
        full = self._decoded()
        delta, self.text = full[len(self.text):], full
        return delta


def _safe_length(tail: str, stop_strings: tuple[str, ...]) -> int:
    """Length of `tail` minus its longest suffix that is a proper prefix of a stop string."""
    hold = 0
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(tail)), hold, -1):
            if tail.endswith(s[:n]):
                hold = n
                break
    return len(tail) - hold
