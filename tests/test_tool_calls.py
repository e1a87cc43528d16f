"""qmtp/serve/tool_calls.py: the qwen3_coder and hermes call formats parsed from a chat reply's content,
whole and streamed (every split of the text into two chunks, and one character at a time, gives the
one-shot result), values typed by the tool's schema, malformed calls left as content, and the auto
choice of the parser from the chat template."""

from __future__ import annotations

import json
import re

import pytest

from qmtp.serve import tool_calls
from qmtp.serve.tool_calls import ToolCallStream

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"},
                                                "celsius": {"type": "boolean"}, "hours": {"type": "array"},
                                                "where": {"type": "object"}, "scale": {"type": "number"},
                                                "note": {"type": ["integer", "null"]},
                                                "zip": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                                                "count": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
                                            }}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]


def coder(name: str, **params: str) -> str:
    """A call in the qwen3_coder format, as Qwen3.5 writes it."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def hermes(name: str, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# (parser, text, content, [(name, arguments)])
CASES = [
    ("qwen3_coder", coder("get_weather", city="Paris"), "", [("get_weather", {"city": "Paris"})]),
    ("qwen3_coder", "Let me check.\n\n" + coder("get_weather", city="Paris", days="3") + "\n",
     "Let me check.", [("get_weather", {"city": "Paris", "days": 3})]),
    ("qwen3_coder", coder("get_weather", city="Paris") + "\n" + coder("get_time") + "\n" +
     coder("get_weather", city="Oslo"), "",
     [("get_weather", {"city": "Paris"}), ("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    ("qwen3_coder", "No tools needed.\n\nIt is 4.\n", "No tools needed.\n\nIt is 4.\n", []),  # text untouched
    ("qwen3_coder", "\n\n" + coder("get_time"), "", [("get_time", {})]),  # blank before a call: dropped
    ("qwen3_coder", coder("get_time") + "\nDone.", "Done.", [("get_time", {})]),
    # multi-line string values keep their inner newlines; one newline each side is the format's
    ("qwen3_coder", coder("get_weather", city="line 1\n\nline 3\n"), "",
     [("get_weather", {"city": "line 1\n\nline 3\n"})]),
    # a value holding "</parameter>" text: the structural one closes it
    ("qwen3_coder", coder("get_weather", city="a</parameter>b", days="2"), "",
     [("get_weather", {"city": "a</parameter>b", "days": 2})]),
    # malformed calls stay content, and the text around them too
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=x>\n1\n</function>\n</tool_call> after",
     "<tool_call>\n<function=get_time>\n<parameter=x>\n1\n</function>\n</tool_call> after", []),
    ("qwen3_coder", "a <tool_call>\n{\"name\": \"get_time\"}\n</tool_call> b " + coder("get_time"),
     "a <tool_call>\n{\"name\": \"get_time\"}\n</tool_call> b", [("get_time", {})]),
    ("qwen3_coder", "<tool_call>\n<function= >\n</function>\n</tool_call>",
     "<tool_call>\n<function= >\n</function>\n</tool_call>", []),  # no name
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=>\n1\n</parameter>\n</function>\n</tool_call>",
     "<tool_call>\n<function=f>\n<parameter=>\n1\n</parameter>\n</function>\n</tool_call>", []),  # no key
    ("qwen3_coder", "Use <tool_call> like this.", "Use <tool_call> like this.", []),  # never closed
    ("qwen3_coder", coder("get_time")[:-len("</tool_call>")], "", [("get_time", {})]),  # stopped before the end tag
    ("qwen3_coder", coder("get_time")[:-len("</function>\n</tool_call>")],  # cut by max_tokens: left as text
     coder("get_time")[:-len("</function>\n</tool_call>")], []),
    ("qwen3_coder", "x <tool_cal", "x <tool_cal", []),
    ("hermes", "Checking.\n" + hermes("get_weather", {"city": "Paris", "days": 3}),
     "Checking.", [("get_weather", {"city": "Paris", "days": 3})]),
    ("hermes", hermes("get_weather", {"city": "Paris"}) + "\n" + hermes("get_time", {}), "",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hermes", "<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>", "", [("get_time", {})]),  # no arguments
    ("hermes", hermes("get_weather", json.dumps({"city": "Oslo"})), "", [("get_weather", {"city": "Oslo"})]),
    ("hermes", "<tool_call>\n{\"name\": \"get_time\", \"arguments\": [1]}\n</tool_call>",
     "<tool_call>\n{\"name\": \"get_time\", \"arguments\": [1]}\n</tool_call>", []),
    ("hermes", "<tool_call>\n{\"arguments\": {}}\n</tool_call>", "<tool_call>\n{\"arguments\": {}}\n</tool_call>", []),
    ("hermes", "<tool_call>\n{\"name\": \"get_time\", \n</tool_call>",
     "<tool_call>\n{\"name\": \"get_time\", \n</tool_call>", []),
    ("hermes", coder("get_time"), coder("get_time"), []),  # the other format is text to this parser
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_parse(parser, text, content, calls):
    got_content, got_calls = tool_calls.parse(parser, text, TOOLS)
    assert (got_content, _calls(got_calls)) == (content, calls)


def _streamed(parser: str, chunks: list[str], max_calls=None) -> tuple[str, list]:
    stream, content, calls = ToolCallStream(parser, TOOLS, max_calls), "", []
    for chunk in chunks:
        c, new = stream.push(chunk)
        content, calls = content + c, calls + new
    c, new = stream.finish()
    assert stream.calls == calls + new
    return content + c, _calls(calls + new)


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_every_two_chunk_stream_and_one_character_at_a_time_equal_the_whole(parser, text, content, calls):
    for k in range(len(text) + 1):
        assert _streamed(parser, [text[:k], text[k:]]) == (content, calls), k
    assert _streamed(parser, list(text)) == (content, calls)


def test_content_streams_until_a_call_begins_and_a_call_goes_out_once_complete():
    stream = ToolCallStream("qwen3_coder", TOOLS)
    assert stream.push("Let me") == ("Let me", [])
    assert stream.push(" check.\n\n<tool_") == (" check.", [])  # the blank run and a possible tag held
    assert stream.push("call>\n<function=get_time>\n") == ("", [])  # the call is buffered
    content, calls = stream.push("</function>\n</tool_call>\n")
    assert content == "" and _calls(calls) == [("get_time", {})]
    assert stream.push("\nDone") == ("Done", [])  # blank space after a call dropped
    assert stream.finish() == ("", [])


SCHEMA = WEATHER["function"]["parameters"]["properties"]


@pytest.mark.parametrize("key,text,want", [
    ("city", "42", "42"), ("city", " null ", " null "), ("days", "3", 3), ("days", "3.5", "3.5"),
    ("days", "three", "three"), ("days", "true", "true"), ("scale", "2.5", 2.5), ("scale", "7", 7),
    ("celsius", "true", True), ("celsius", "False", False), ("celsius", "yes", "yes"),
    ("hours", "[1, 2]", [1, 2]), ("hours", "{\"a\": 1}", "{\"a\": 1}"), ("where", "{\"lat\": 1.5}", {"lat": 1.5}),
    ("where", "not json", "not json"), ("note", "null", None), ("note", "5", 5), ("zip", "12345", "12345"),
    ("count", "7", 7), ("count", "null", None), ("count", "many", "many"),
    ("unknown", "5", "5"),
])
def test_qwen3_coder_values_take_the_schema_type(key, text, want):
    got = tool_calls.convert(text, SCHEMA.get(key))
    assert got == want and type(got) is type(want)


def test_values_of_a_function_or_key_the_tools_do_not_describe_stay_strings():
    _, calls = tool_calls.parse("qwen3_coder", coder("get_weather", days="3", extra="4") + coder("other", n="5"), TOOLS)
    assert _calls(calls) == [("get_weather", {"days": 3, "extra": "4"}), ("other", {"n": "5"})]
    _, calls = tool_calls.parse("qwen3_coder", coder("get_weather", days="3"), None)
    assert _calls(calls) == [("get_weather", {"days": "3"})]


def test_max_calls_keeps_the_first_call_only():
    text = coder("get_weather", city="Paris") + "\n" + coder("get_time")
    content, calls = tool_calls.parse("qwen3_coder", text, TOOLS, max_calls=1)
    assert content == "" and _calls(calls) == [("get_weather", {"city": "Paris"})]
    for k in range(len(text) + 1):
        assert _streamed("qwen3_coder", [text[:k], text[k:]], max_calls=1) == ("", _calls(calls)), k


def test_a_call_in_the_openai_shape():
    call = tool_calls.ToolCall("get_weather", {"city": "Zürich", "days": 2})
    out = call.openai()
    assert re.fullmatch(r"call_[0-9a-f]{24}", out["id"]) and out["type"] == "function"
    assert out["function"]["name"] == "get_weather"
    assert out["function"]["arguments"] == '{"city": "Zürich", "days": 2}'  # a JSON string, as the OpenAI API
    assert tool_calls.ToolCall("f", {}).id != tool_calls.ToolCall("f", {}).id


def test_auto_reads_the_format_from_the_chat_template():
    qwen35 = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    qwen3 = "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}"
    assert tool_calls.resolve("auto", qwen35)[0] == "qwen3_coder"
    assert tool_calls.resolve("auto", qwen3)[0] == "hermes"
    assert tool_calls.resolve("auto", "{{ messages[0].content }}") == ("none", "auto: the chat template writes no "
                                                                             "tool calls")
    assert tool_calls.resolve("hermes", qwen35) == ("hermes", "--tool_call_parser")
    with pytest.raises(ValueError, match="tool call parser 'none'"):
        ToolCallStream("none", TOOLS)
