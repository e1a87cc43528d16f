"""Tool calls in a chat response's content (--tool_call_parser): the formats, their parsing, streaming.

qwen3_coder (Qwen3.5, Qwen3-Coder: templates that write `<function=`):
    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>
  VALUE is text: the newline after `<parameter=KEY>` and the one before `</parameter>` belong to the
  format. It becomes the JSON value that the request's tool schema asks for
  (function.parameters.properties.KEY: its `type`, a name or a list, else the types of its
  anyOf / oneOf, tried in order): "string" keeps the text, "null" takes `null`, integer / number /
  boolean / object / array take the text read as JSON (a boolean case-blind) when it is one; a value
  that fits no type, or a key or function the request does not describe, stays a string.
hermes (Qwen3, Qwen2.5: templates whose calls are JSON):
    <tool_call>
    {"name": NAME, "arguments": {...}}
    </tool_call>
  arguments: an object (or a string holding one); absent: {}.

A call spans from `<tool_call>` to the first `</tool_call>`, or to the end of the output where it stops
before one. A call that does not parse stays in the content as generated, so no text is lost. The
content is the text outside the calls, less blank space next to a call (None in a message when nothing
is left). Calls inside the reasoning are never seen here (reasoning.py keeps them there). The call's
name is not checked against the request's tools (the client sees what the model asked for).

Streaming (ToolCallStream): content goes out as it comes, less a tail that may begin `<tool_call>` and
trailing blank space (dropped if a call follows); from `<tool_call>` on, the text is buffered until
`</tool_call>` and the call then goes out whole, as one delta with all its arguments (they are not
streamed piece by piece). The pieces concatenate to parse()'s one-shot result for any chunking.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Callable

START, END = "<tool_call>", "</tool_call>"
PARSERS = ("qwen3_coder", "hermes", "none")
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.S)  # greedy: the last </function>
_PARAMETER, _PARAMETER_END = "<parameter=", "</parameter>"
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict:
        """The OpenAI API's shape: arguments as a JSON string."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


def resolve(name: str, template_source: str) -> tuple[str, str]:
    """The parser --tool_call_parser names, and why: 'auto' reads the chat template, qwen3_coder where it
    writes `<function=` (Qwen3.5, Qwen3-Coder), hermes where it writes `<tool_call>` otherwise (Qwen3,
    Qwen2.5), else none."""
    if name != "auto":
        return name, "--tool_call_parser"
    if "<function=" in template_source:
        return "qwen3_coder", "auto: the chat template writes <function=...> calls"
    if START in template_source:
        return "hermes", "auto: the chat template writes <tool_call> JSON calls"
    return "none", "auto: the chat template writes no tool calls"


def opening(parser: str, function: str | None = None) -> str:
    """The start of a call in the parser's format, through the function's name where one is given (then
    the model writes its arguments), else up to the name (the model chooses it)."""
    if parser == "qwen3_coder":
        return f"{START}\n<function=" + ("" if function is None else f"{function}>\n")
    if parser == "hermes":
        return f"{START}\n{{\"name\": " + ('"' if function is None else f"{json.dumps(function)}, \"arguments\": ")
    raise ValueError(f"no call format for the tool call parser {parser!r}")


def schemas(tools: list[dict] | None) -> dict[str, dict]:
    """Each function's parameters schema by name, from a request's (validated) tools."""
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or ()}


def parse_qwen3_coder(body: str, params: dict[str, dict]) -> tuple[str, dict] | None:
    """(name, arguments) of the text between `<tool_call>` and `</tool_call>`, or None."""
    match = _FUNCTION.fullmatch(body.strip())
    if match is None or not match[1].strip():
        return None
    name, inner = match[1].strip(), match[2]
    properties = (params.get(name) or {}).get("properties") or {}
    arguments, pos = {}, 0
    while True:
        pos = len(inner) - len(inner[pos:].lstrip())
        if pos == len(inner):
            return name, arguments
        if not inner.startswith(_PARAMETER, pos):
            return None
        close = inner.find(">", pos)
        key = inner[pos + len(_PARAMETER):close] if close >= 0 else ""
        if not key.strip() or "\n" in key:
            return None
        end = _parameter_end(inner, close + 1)
        if end < 0:
            return None
        value = inner[close + 1:end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[key.strip()] = convert(value, properties.get(key.strip()))
        pos = end + len(_PARAMETER_END)


def _parameter_end(inner: str, start: int) -> int:
    """The `</parameter>` that closes a value begun at `start`: the first one followed (after blank
    space) by the next parameter or the function's end, so a value may itself hold `</parameter>`."""
    end = inner.find(_PARAMETER_END, start)
    while end >= 0:
        rest = inner[end + len(_PARAMETER_END):].lstrip()
        if not rest or rest.startswith(_PARAMETER):
            return end
        end = inner.find(_PARAMETER_END, end + 1)
    return -1


def convert(value: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as the JSON value its schema's type asks for (module docstring)."""
    for kind in _types(schema):
        if kind == "string":
            return value
        if kind == "null" and value.strip() == "null":
            return None
        if kind in _JSON_TYPES:
            try:
                parsed = json.loads(value.strip().lower() if kind == "boolean" else value)
            except ValueError:
                continue
            if _JSON_TYPES[kind](parsed):
                return parsed
    return value


def _types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    return [k for option in schema.get("anyOf") or schema.get("oneOf") or () for k in _types(option)]


def parse_hermes(body: str, params: dict[str, dict]) -> tuple[str, dict] | None:
    """(name, arguments) of the JSON between `<tool_call>` and `</tool_call>`, or None."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the OpenAI API's JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return (call["name"], arguments) if isinstance(arguments, dict) else None


_PARSE = {"qwen3_coder": parse_qwen3_coder, "hermes": parse_hermes}


class ToolCallStream:
    """One response's content, pushed as it streams: the text outside the calls and the calls
    (module docstring). max_calls: calls kept (1 for parallel_tool_calls false); later ones are dropped."""

    def __init__(self, parser: str, tools: list[dict] | None, max_calls: int | None = None):
        if parser not in _PARSE:
            raise ValueError(f"tool call parser {parser!r}: expected one of {', '.join(_PARSE)}")
        self._parse, self._params, self._max_calls = _PARSE[parser], schemas(tools), max_calls
        self._held = ""  # text not yet placed: a call's text from START on, or a tail that may begin one
        self._in_call = False
        self._blank = ""  # trailing blank content, out once more content follows, dropped before a call
        self._after_call = False  # just after a call: blank space here is dropped
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content placed and the calls completed by `text`."""
        self._held += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._held.find(END)
                if end < 0:
                    return content, calls
                content += self._call(self._held[:end + len(END)], self._held[len(START):end], calls)
                self._held = self._held[end + len(END):]
                continue
            start = self._held.find(START)
            if start >= 0:
                content += self._text(self._held[:start])
                self._held, self._in_call = self._held[start:], True
                continue
            keep = _undecided_tail(self._held)
            content += self._text(self._held[:keep])
            self._held = self._held[keep:]
            return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest once the response has ended: a call left open by its end is parsed as it stands."""
        held, self._held = self._held, ""
        calls: list[ToolCall] = []
        content = self._call(held, held[len(START):], calls) if self._in_call else self._text(held)
        content, self._blank = content + self._blank, ""
        return content, calls

    def _call(self, whole: str, body: str, calls: list[ToolCall]) -> str:
        """A call's text: its call appended to `calls` and "", or the text as content where it does not
        parse."""
        self._in_call = False
        parsed = self._parse(body, self._params)
        if parsed is None:
            return self._text(whole)
        self._blank, self._after_call = "", True
        if self._max_calls is None or len(self.calls) < self._max_calls:
            call = ToolCall(*parsed)
            self.calls.append(call)
            calls.append(call)
        return ""

    def _text(self, text: str) -> str:
        """Content text to release: blank space after a call dropped, a trailing blank run held."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        text = self._blank + text
        out = text.rstrip()
        self._blank = text[len(out):]
        return out


def parse(parser: str, text: str, tools: list[dict] | None, max_calls: int | None = None
          ) -> tuple[str, list[ToolCall]]:
    """The whole content's text outside the calls, and the calls."""
    stream = ToolCallStream(parser, tools, max_calls)
    content, calls = stream.push(text)
    rest, more = stream.finish()
    return content + rest, calls + more


def _undecided_tail(text: str) -> int:
    """Where a tail that may still grow into `<tool_call>` begins (len(text) when none)."""
    for n in range(min(len(text), len(START) - 1), 0, -1):
        if START.startswith(text[-n:]):
            return len(text) - n
    return len(text)
