"""A chat response's reasoning, split from its answer (--reasoning_parser=qwen3).

Format (Qwen3, Qwen3.5, QwQ): the reasoning lies between `<think>` and `</think>`; the rest of the
text is the answer (`content`). The tags are dropped; all other text is kept as generated (so the
content after `</think>` usually starts with "\\n\\n"). Where the output starts:
  - In the reasoning when the prompt ends inside an open think block: its last non-blank text is
    `<think>` (opens_reasoning). Qwen3.5's template and Qwen3's thinking models put
    `<|im_start|>assistant\\n<think>\\n` in the prompt, so their output holds only the closing tag. The
    reasoning then runs to the first `</think>`; an output without one (cut by max_tokens) is all
    reasoning.
  - In the content otherwise: no thinking template, or thinking turned off (Qwen's templates then end
    the prompt with `<think>\\n\\n</think>\\n\\n`, so enable_thinking=false leaves everything content).
    An output that opens with `<think>` itself (after blank space: Qwen3's first templates, where the
    model writes the tag) starts a reasoning that runs to `</think>`.
The prompt decides, not the text alone, so a model that never thinks may write `</think>` in its
answer without losing the text before it.

In the reasoning, `<tool_call>` followed (after blank space) by `<function=` also ends it: Qwen3.5 may
call a tool from inside its thinking without closing it (vLLM's qwen3 parser does the same). The call
goes to the content, where the tool-call parser (tool_calls.py) reads it; a `<tool_call>` that the
reasoning only mentions stays in the reasoning.

ReasoningSplitter parses a stream: push(text) returns what can be placed so far, holding back a tail
that could still grow into a tag (a chunk ending in `</thi`, or `<tool_call>\\n<func`) until the next
text decides it; finish() releases the rest. The pieces concatenate to split()'s one-shot result for
any chunking of the text. Needs the tags in the decoded text: Qwen's tokenizers mark them non-special,
so the engine's detokenizer (skip_special_tokens=True) keeps them.
"""

from __future__ import annotations

import dataclasses
import re

THINK, END_THINK = "<think>", "</think>"
TOOL_CALL, FUNCTION = "<tool_call>", "<function="
PARSERS = ("qwen3", "none")
_CALL_IN_REASONING = re.compile(re.escape(TOOL_CALL) + r"\s*" + re.escape(FUNCTION))
_START, _REASONING, _CONTENT = "start", "reasoning", "content"


@dataclasses.dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: "Split") -> "Split":
        self.reasoning += other.reasoning
        self.content += other.content
        return self


def opens_reasoning(prompt: str) -> bool:
    """Whether a rendered chat prompt ends inside an open think block (generation starts in the reasoning)."""
    return prompt.rstrip().endswith(THINK)


def resolve(name: str, tokenizer) -> tuple[str, str]:
    """The parser --reasoning_parser names, and why: 'auto' is qwen3 when the tokenizer has `<think>`
    and `</think>` as tokens that decoding keeps (not special), else none."""
    if name != "auto":
        return name, "--reasoning_parser"
    ids = [None if tokenizer is None else tokenizer.token_to_id(tag) for tag in (THINK, END_THINK)]
    if None in ids:
        return "none", f"auto: the tokenizer has no {THINK} and {END_THINK} tokens"
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    if special & set(ids):
        return "none", f"auto: the tokenizer's {THINK} / {END_THINK} are special tokens, which decoding drops"
    return "qwen3", f"auto: the tokenizer has {THINK} and {END_THINK} tokens"


class ReasoningSplitter:
    """One response's text, pushed as it streams, split into reasoning and content (module docstring)."""

    def __init__(self, in_reasoning: bool):
        self._then = _REASONING if in_reasoning else _CONTENT  # the state once no opening tag came
        self._state = _START  # until the output's first non-blank text shows whether it opens with <think>
        self._held = ""  # text not yet placed

    def push(self, text: str) -> Split:
        self._held += text
        out = Split()
        while True:
            if self._state == _START:
                lead = self._held.lstrip()
                if lead.startswith(THINK):
                    self._held, self._state = lead[len(THINK):], _REASONING
                elif THINK.startswith(lead):  # blank so far, or a piece of the tag: wait for more
                    return out
                else:
                    self._state = self._then
            elif self._state == _CONTENT:
                out.content += self._held
                self._held = ""
                return out
            else:
                end = _reasoning_end(self._held)
                if end is None:
                    keep = _undecided_tail(self._held)
                    out.reasoning += self._held[:keep]
                    self._held = self._held[keep:]
                    return out
                at, resume = end
                out.reasoning += self._held[:at]
                self._held, self._state = self._held[resume:], _CONTENT

    def finish(self) -> Split:
        """The held-back text, once the response has ended: it stays where it was."""
        held, self._held = self._held, ""
        state = self._then if self._state == _START else self._state
        return Split(reasoning=held) if state == _REASONING else Split(content=held)


def split(text: str, in_reasoning: bool) -> Split:
    """The whole text's reasoning and content."""
    splitter = ReasoningSplitter(in_reasoning)
    out = splitter.push(text)
    out += splitter.finish()
    return out


def _reasoning_end(text: str) -> tuple[int, int] | None:
    """Where the reasoning in `text` ends: (its end, where the content resumes), or None. `</think>` is
    dropped; a tool call that ends it is kept for the content."""
    close = text.find(END_THINK)
    call = _CALL_IN_REASONING.search(text)
    if call is not None and (close < 0 or call.start() < close):
        return call.start(), call.start()
    return None if close < 0 else (close, close + len(END_THINK))


def _undecided_tail(text: str) -> int:
    """Where the tail of reasoning text that could still become `</think>` or a tool call begins
    (len(text) when none could)."""
    call = text.rfind(TOOL_CALL)
    if call >= 0 and FUNCTION.startswith(text[call + len(TOOL_CALL):].lstrip()):
        return call  # `<tool_call>`, maybe blank space, maybe a piece of `<function=`
    for n in range(min(len(text), len(TOOL_CALL) - 1), 0, -1):
        if END_THINK.startswith(text[-n:]) or TOOL_CALL.startswith(text[-n:]):
            return len(text) - n
    return len(text)
