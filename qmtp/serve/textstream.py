"""Incremental detokenization with stop strings, for streaming one request's text.

Text is decoded from all ids so far (`skip_special_tokens=True` by default, as qmtp.generate and
vLLM), so the deltas concatenate to the one-shot decode. Held back: a trailing U+FFFD (an incomplete
UTF-8 sequence) and the longest tail that is a prefix of a stop string. A stop string ends the text
just before it (as OpenAI: it is not returned; through it with vLLM's include_stop_str_in_output) and
sets `stopped`, unless it ends within the text of the first min_tokens ids (vLLM's min_tokens: the
request cannot end before them).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = (), min_tokens: int = 0,
                 include_stop: bool = False, skip_special_tokens: bool = True):
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.min_tokens = min_tokens
        self.include_stop = include_stop  # the text ends after the stop string, not before it
        self.skip_special_tokens = skip_special_tokens
        self.floor: int | None = 0 if min_tokens == 0 else None  # a stop string must end past this much text
        self.ids: list[int] = []
        self.text = ""  # released so far
        self.stopped = False

    def push(self, tokens: list[int]) -> str:
        """Adds generated ids; returns the newly released text (maybe ""). After a stop string, ""."""
        if self.stopped:
            return ""
        self.ids.extend(tokens)
        full, start = self._decoded(), len(self.text)
        if self.floor is None and len(self.ids) >= self.min_tokens:
            self.floor = len(self.tokenizer.decode(self.ids[:self.min_tokens],
                                                   skip_special_tokens=self.skip_special_tokens))
        hits = []  # (where a stop string begins, where it ends)
        if self.stop_strings and self.floor is not None:
            # searched from where a stop string straddling released and new text begins, ending past the floor
            hits = [(i, i + len(s)) for s in self.stop_strings
                    for i in [full.find(s, max(0, start - len(s) + 1, self.floor - len(s) + 1))] if i >= 0]
        if hits:
            self.stopped = True
            begin, end = min(hits)
            return self._release(full, max(end if self.include_stop else begin, start))
        end = max(start, len(full.rstrip(REPLACEMENT)))
        return self._release(full, start + _safe_length(full[start:end], self.stop_strings))

    def finish(self) -> str:
        """The held-back tail, when the request ends without a stop string."""
        if self.stopped:
            return ""
        full = self._decoded()
        return self._release(full, len(full))

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)

    def _release(self, full: str, end: int) -> str:
        delta, self.text = full[len(self.text):end], full[:end]
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
