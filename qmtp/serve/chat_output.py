"""A chat choice's text as the message fields clients of vLLM and SGLang expect: `reasoning_content`,
`content` and `tool_calls`.

The text first goes through the reasoning parser (reasoning.py: `<think>` ... `</think>` ->
reasoning_content), then its content through the tool-call parser (tool_calls.py), so a call written
inside the reasoning is never parsed. A message then has `content` None when nothing is left,
`reasoning_content` (None when empty) wherever the reasoning parser runs, and `tool_calls` where calls
were parsed; the finish reason "stop" becomes "tool_calls" when the choice made calls. With neither
parser the message is the text as generated (`content` a string, as before). A streamed choice's deltas
carry the same fields, only those with something new; each tool call is one delta entry
{index, id, type, function: {name, arguments}}, sent once the call is complete.

tool_choice "required" or a named function: the reply is opened with a call (`opening`: the format's
`<tool_call>` start, through the function's name where one is named), which the server appends to the
prompt (`prompt_suffix`: after closing a think block the prompt left open, so the reasoning is empty),
and the parsers read that opening before the generated text, as if the model had written it. The model
writes the rest of the call; one that does not parse stays in the content, opening included.
"""

from __future__ import annotations

import dataclasses

from qmtp.serve import reasoning, tool_calls


@dataclasses.dataclass(frozen=True)
class ChatParsing:
    """What one chat request's choices are parsed for; stream() gives one choice's parser."""

    reasoning: bool = False  # split the reasoning out
    in_reasoning: bool = False  # the prompt ended inside an open think block (reasoning.opens_reasoning)
    tool_parser: str | None = None  # tool_calls.py's format; None: calls are left in the content
    tools: list | None = None  # the request's tools (their parameter schemas convert qwen3_coder values)
    max_calls: int | None = None  # 1 when the request sets parallel_tool_calls false
    opening: str = ""  # the call the reply was opened with, read before the generated text
    closed_reasoning: bool = False  # the prompt's open think block was closed before the opening

    @property
    def prompt_suffix(self) -> str:
        """What the server appends to the rendered prompt: the opening, after closing the think block as a
        template with thinking off writes it (`<think>` then a blank line and `</think>`)."""
        return ("\n" + reasoning.END_THINK + "\n\n" if self.closed_reasoning else "") + self.opening

    @property
    def active(self) -> bool:
        return self.reasoning or self.tool_parser is not None

    def stream(self) -> "ChatStream":
        return ChatStream(self)

    def message(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """The non-streamed message of a choice's whole text, and its finish reason."""
        if not self.active:
            return {"role": "assistant", "content": text}, finish_reason
        stream = self.stream()
        fields = merge(stream.push(text), stream.finish())
        message = {"role": "assistant", "content": fields.get("content") or None}
        if self.reasoning:
            message["reasoning_content"] = fields.get("reasoning_content") or None
        if fields.get("tool_calls"):
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in fields["tool_calls"]]
        return message, stream.finish_reason(finish_reason)


def for_request(reasoning_parser: str, tool_parser: str, prompt: str, tools: list | None, tool_choice: str,
                parallel_tool_calls: bool, tool_function: str | None = None) -> ChatParsing:
    """The parsing of a chat request: the reasoning where the server's parser is qwen3; tool calls where
    the request gives tools, tool_choice is not none and the server has a tool-call parser; under
    tool_choice "required" (tool_function: the function it names, if any) the call's opening."""
    calls = bool(tools) and tool_choice != "none" and tool_parser != "none"
    forced = calls and tool_choice == "required"
    in_reasoning = reasoning.opens_reasoning(prompt)
    return ChatParsing(reasoning=reasoning_parser == "qwen3", in_reasoning=in_reasoning and not forced,
                       tool_parser=tool_parser if calls else None, tools=tools,
                       max_calls=None if parallel_tool_calls else 1,
                       opening=tool_calls.opening(tool_parser, tool_function) if forced else "",
                       closed_reasoning=forced and in_reasoning)


class ChatStream:
    """One choice's text, pushed as it streams; push() and finish() return delta fields."""

    def __init__(self, parsing: ChatParsing):
        self._reasoning = reasoning.ReasoningSplitter(parsing.in_reasoning) if parsing.reasoning else None
        self._tools = (tool_calls.ToolCallStream(parsing.tool_parser, parsing.tools, parsing.max_calls)
                       if parsing.tool_parser else None)
        self._calls = 0  # tool calls sent (the next one's index)
        self._held = {}  # what reading the opening gave (nothing: it ends inside a call), sent with the next delta
        if parsing.opening:
            self._held = self.push(parsing.opening)

    def push(self, text: str) -> dict:
        fields = self._fields(self._reasoning.push(text) if self._reasoning else reasoning.Split(content=text))
        return self._release(fields)

    def finish(self) -> dict:
        """The held-back rest, once the choice has ended."""
        fields = self._fields(self._reasoning.finish() if self._reasoning else reasoning.Split())
        if self._tools is not None:
            content, calls = self._tools.finish()
            fields = merge(fields, self._delta("", content, calls))
        return self._release(fields)

    def _release(self, fields: dict) -> dict:
        held, self._held = self._held, {}
        return merge(held, fields)

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self._calls and reason == "stop" else reason

    def _fields(self, split: reasoning.Split) -> dict:
        content, calls = self._tools.push(split.content) if self._tools else (split.content, [])
        return self._delta(split.reasoning, content, calls)

    def _delta(self, reasoning_text: str, content: str, calls: list[tool_calls.ToolCall]) -> dict:
        out: dict = {}
        if reasoning_text:
            out["reasoning_content"] = reasoning_text
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = [{"index": self._calls + i, **call.openai()} for i, call in enumerate(calls)]
            self._calls += len(calls)
        return out


def merge(first: dict, second: dict) -> dict:
    """Two deltas' fields as one: text joined, tool calls in order."""
    out = dict(first)
    for key, value in second.items():
        out[key] = out[key] + value if key in out else value
    return out
