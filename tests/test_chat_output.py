"""Chat replies with reasoning and tool calls (qmtp/serve/chat_output.py) and the requests that carry
tools (qmtp/serve/protocol.py), down to HTTP: the server (create_app) in front of a scripted engine that
answers each request with a set text in set chunks, so the parsers see exactly the outputs of Qwen3.5
and Qwen3 models without a model (tests/test_server.py runs the real engine with the parsers on).
"""

from __future__ import annotations

import contextlib
import json
import types

import httpx
import openai
import pytest
from tokenizers import AddedToken

from qmtp.serve import chat_output, protocol, tool_calls
from qmtp.serve.chat_output import ChatParsing
from qmtp.serve.requests import Event, RequestHandle
from qmtp.serve.server import Server, ServerSettings, create_app
from qmtp.tools import tiny_tokenizer

NAME = "scripted"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n" \
       "</parameter>\n</function>\n</tool_call>"
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
ARGUMENTS = {"city": "Paris", "days": 3}

# A template of the Qwen3.5 kind (written for these tests): tools listed in a system turn, calls as
# <function=...> blocks whose arguments are iterated as a mapping, tool results as user turns, and a
# generation prompt that opens <think> unless enable_thinking is false.
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + tool | tojson }}"
    "{%- endfor %}{{- '\\n</tools>\\nCall as <tool_call>\\n<function=NAME>...</function>\\n</tool_call>'"
    " + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.reasoning_content is defined %}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content }}"
    "{%- for call in m.tool_calls or [] %}{{- '<tool_call>\\n<function=' + call.function.name + '>\\n' }}"
    "{%- for key, value in call.function.arguments | items %}"
    "{{- '<parameter=' + key + '>\\n' + value | string + '\\n</parameter>\\n' }}{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}")
HERMES_TEMPLATE = (  # Qwen3's kind: calls as JSON
    TEMPLATE.replace("<function=NAME>...</function>", "{\"name\": ..., \"arguments\": ...}")
    .replace("{{- '<tool_call>\\n<function=' + call.function.name + '>\\n' }}"
             "{%- for key, value in call.function.arguments | items %}"
             "{{- '<parameter=' + key + '>\\n' + value | string + '\\n</parameter>\\n' }}{%- endfor %}"
             "{{- '</function>\\n</tool_call>' }}",
             "{{- '<tool_call>\\n' + call.function | tojson + '\\n</tool_call>' }}"))


# ---- chat_output: the two parsers together ---------------------------------------------------------
def _streamed(parsing: ChatParsing, chunks: list[str], reason: str = "stop") -> tuple[dict, str]:
    """The deltas of a streamed choice joined, tool calls without their index, and its finish reason."""
    stream, fields = parsing.stream(), {}
    for chunk in chunks:
        fields = chat_output.merge(fields, stream.push(chunk))
    fields = chat_output.merge(fields, stream.finish())
    assert [c["index"] for c in fields.get("tool_calls", [])] == list(range(len(fields.get("tool_calls", []))))
    return fields, stream.finish_reason(reason)


def _comparable(message: dict) -> dict:
    """A message with its tool calls' ids left out (fresh for every parse)."""
    calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
             for c in message.get("tool_calls") or ()]
    return {"reasoning_content": message.get("reasoning_content") or None, "content": message.get("content") or None,
            "tool_calls": calls}


THINKING = ChatParsing(reasoning=True, in_reasoning=True, tool_parser="qwen3_coder", tools=[WEATHER])
# (parsing, text, reasoning_content, content, calls, finish reason of a reply that stopped)
REPLIES = [
    (THINKING, "The user wants Paris.\n</think>\n\n" + CALL, "The user wants Paris.\n", None, [ARGUMENTS],
     "tool_calls"),
    (THINKING, "Paris.\n</think>\n\nLet me check.\n\n" + CALL + "\n" + CALL, "Paris.\n", "\n\nLet me check.",
     [ARGUMENTS, ARGUMENTS], "tool_calls"),
    (THINKING, "Paris.\n" + CALL, "Paris.\n", None, [ARGUMENTS], "tool_calls"),  # called from inside the thinking
    (THINKING, "Easy.\n</think>\n\nIt is 4.", "Easy.\n", "\n\nIt is 4.", [], "stop"),
    # cut inside a call made from the thinking: the call's text is content, where it does not parse
    (THINKING, "Hmm, " + CALL[:40], "Hmm, ", CALL[:40], [], "stop"),
    (THINKING, "Hmm, <tool_call>\n<func", "Hmm, <tool_call>\n<func", None, [], "stop"),  # not yet a call
    # enable_thinking=false: the prompt closed the block, so all is content
    (ChatParsing(reasoning=True, in_reasoning=False, tool_parser="qwen3_coder", tools=[WEATHER]),
     "It is 4.", None, "It is 4.", [], "stop"),
    (ChatParsing(reasoning=True, in_reasoning=False, tool_parser="qwen3_coder", tools=[WEATHER]),
     CALL, None, None, [ARGUMENTS], "tool_calls"),
    # hermes: a call written inside the thinking is reasoning text, never parsed
    (ChatParsing(reasoning=True, in_reasoning=True, tool_parser="hermes", tools=[WEATHER]),
     "Maybe " + HERMES_CALL + "?\n</think>\n\n" + HERMES_CALL, "Maybe " + HERMES_CALL + "?\n", None, [ARGUMENTS],
     "tool_calls"),
    # tools without the reasoning parser: the thinking text stays content, the call is parsed
    (ChatParsing(tool_parser="qwen3_coder", tools=[WEATHER]), "Ok.\n</think>\n\n" + CALL, None, "Ok.\n</think>",
     [ARGUMENTS], "tool_calls"),
    # the reasoning parser alone: a call stays content
    (ChatParsing(reasoning=True, in_reasoning=True), "Ok.\n</think>\n\n" + CALL, "Ok.\n", "\n\n" + CALL, [], "stop"),
]


@pytest.mark.parametrize("parsing,text,want_reasoning,want_content,want_calls,want_reason", REPLIES)
def test_message_and_every_two_chunk_stream(parsing, text, want_reasoning, want_content, want_calls, want_reason):
    message, reason = parsing.message(text, "stop")
    want = {"reasoning_content": want_reasoning, "content": want_content,
            "tool_calls": [{"name": "get_weather", "arguments": a} for a in want_calls]}
    assert _comparable(message) == want and reason == want_reason
    assert message["role"] == "assistant" and message["content"] == want_content
    assert ("reasoning_content" in message) == parsing.reasoning
    assert ("tool_calls" in message) == bool(want_calls)
    for k in range(len(text) + 1):
        fields, streamed_reason = _streamed(parsing, [text[:k], text[k:]])
        assert _comparable(fields) == want and streamed_reason == want_reason, k
    assert parsing.message(text, "length")[1] == "length"  # cut by max_tokens: not "tool_calls"


def test_without_parsers_the_message_is_the_text():
    plain = ChatParsing()
    assert not plain.active
    assert plain.message("<think>a</think>\n\n" + CALL, "stop") == (
        {"role": "assistant", "content": "<think>a</think>\n\n" + CALL}, "stop")
    assert plain.message("", "length") == ({"role": "assistant", "content": ""}, "length")


def test_for_request_parses_calls_only_with_tools_tool_choice_auto_and_a_parser():
    on = chat_output.for_request("qwen3", "hermes", "...<|im_start|>assistant\n<think>\n", [WEATHER], "auto", True)
    assert on == ChatParsing(True, True, "hermes", [WEATHER], None)
    assert chat_output.for_request("none", "hermes", "x", [WEATHER], "none", True).tool_parser is None
    assert chat_output.for_request("none", "hermes", "x", None, "auto", True).tool_parser is None
    assert chat_output.for_request("none", "none", "x", [WEATHER], "none", True) == ChatParsing(tools=[WEATHER])
    assert chat_output.for_request("qwen3", "qwen3_coder", "x", [WEATHER], "auto", False).max_calls == 1


@pytest.mark.parametrize("parser,function,generated", [
    ("qwen3_coder", None, CALL[len("<tool_call>\n<function="):]),
    ("qwen3_coder", "get_weather", CALL[len("<tool_call>\n<function=get_weather>\n"):]),
    ("hermes", None, HERMES_CALL[len('<tool_call>\n{"name": "'):]),
    ("hermes", "get_weather", HERMES_CALL[len('<tool_call>\n{"name": "get_weather", "arguments": '):]),
])
def test_a_required_call_is_opened_in_the_prompt_and_read_before_the_generated_text(parser, function, generated):
    """tool_choice "required" (or a named function): the prompt ends with the call's opening (after closing
    the think block it left open); the parsers read it, then the model's rest of the call, whole or in
    two-character chunks; a rest that does not complete a call comes back as content, opening included."""
    parsing = chat_output.for_request("qwen3", parser, "...<|im_start|>assistant\n<think>\n", [WEATHER],
                                      "required", True, function)
    assert parsing.prompt_suffix == "\n</think>\n\n" + parsing.opening and not parsing.in_reasoning
    assert (parsing.opening + generated) in (CALL, HERMES_CALL)
    message, reason = parsing.message(generated, "stop")
    assert message["content"] is None and message["reasoning_content"] is None and reason == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == ARGUMENTS
    stream = parsing.stream()
    deltas = [stream.push(generated[i:i + 2]) for i in range(0, len(generated), 2)] + [stream.finish()]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and not any("content" in d for d in deltas)
    broken, _ = parsing.message("{{{", "length")
    assert broken["content"] == parsing.opening + "{{{" and "tool_calls" not in broken
    thinking_off = chat_output.for_request("qwen3", parser, "<think>\n\n</think>\n\n", [WEATHER], "required", True)
    assert thinking_off.prompt_suffix == thinking_off.opening == tool_calls.opening(parser)


# ---- protocol: tools, tool_choice, tool messages ---------------------------------------------------
def _chat(**fields) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}


def _parse(body, tool_parser="qwen3_coder"):
    return protocol.parse_chat(body, NAME, 100, 4, {}, tool_parser=tool_parser)


@pytest.mark.parametrize("tools,param", [
    ([WEATHER, TIME, {"type": "function", "function": {"description": "no name"}}], "tools[2].function.name"),
    ([WEATHER, {"type": "function", "function": {"name": 7}}], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name"),  # two tools of one name
    ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0].type"),
    ([{"function": {"name": "f"}}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    (["get_weather"], "tools[0]"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0].function.description"),
])
def test_bad_tools_get_a_400_naming_the_field(tools, param):
    with pytest.raises(protocol.APIError) as e:
        _parse(_chat(tools=tools))
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "invalid_value")
    assert e.value.message.startswith(param + ": ")


def test_tool_choice_and_the_server_without_a_tool_call_parser():
    parsed, _, _ = _parse(_chat(tools=[WEATHER]))
    assert (parsed.tools, parsed.tool_choice, parsed.parallel_tool_calls) == ([WEATHER], "auto", True)
    parsed, _, _ = _parse(_chat(tools=[WEATHER], tool_choice="none", parallel_tool_calls=False))
    assert (parsed.tool_choice, parsed.parallel_tool_calls) == ("none", False)
    assert _parse(_chat(tools=[]))[0].tools is None
    assert _parse(_chat(tools=[WEATHER], tool_choice="required"))[0].tool_choice == "required"
    named = _parse(_chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}))[0]
    assert (named.tool_choice, named.tool_function) == ("required", "get_time")
    for fields, param in (({"tool_choice": "sometimes"}, "tool_choice"),
                          ({"tool_choice": "required"}, "tool_choice"),  # no tools
                          ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
                          ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": 3}}},
                           "tool_choice.function.name"),
                          ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                           "tool_choice.function.name")):
        with pytest.raises(protocol.APIError, match="^" + param.replace(".", r"\.") + ": ") as e:
            _parse(_chat(**fields))
        assert (e.value.status, e.value.param, e.value.code) == (400, param, "invalid_value")
    with pytest.raises(protocol.APIError, match="--tool_call_parser=none") as e:
        _parse(_chat(tools=[WEATHER]), tool_parser="none")
    assert (e.value.status, e.value.param) == (400, "tools")
    assert _parse(_chat(tools=[WEATHER], tool_choice="none"), tool_parser="none")[0].tools == [WEATHER]
    assert _parse(_chat(), tool_parser="none")[0].tools is None


def _history(arguments) -> list[dict]:
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "reasoning": "Use the tool.",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]}]


def test_tool_calls_and_results_in_the_messages_reach_the_template_as_objects():
    _, messages, _ = _parse(_chat(messages=_history(json.dumps(ARGUMENTS))))
    assert messages[1] == {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
                           "tool_calls": [{"id": "call_1", "type": "function",
                                           "function": {"name": "get_weather", "arguments": ARGUMENTS}}]}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert _parse(_chat(messages=_history("")))[1][1]["tool_calls"][0]["function"]["arguments"] == {}
    assert _parse(_chat(messages=_history(ARGUMENTS)))[1][1]["tool_calls"][0]["function"]["arguments"] == ARGUMENTS
    for bad in ('{"city": "Paris"', "[1, 2]"):
        with pytest.raises(protocol.APIError) as e:
            _parse(_chat(messages=_history(bad)))
        assert e.value.param == "messages[1].tool_calls[0].function.arguments" and e.value.status == 400


# ---- the server over a scripted engine -------------------------------------------------------------
class ScriptedEngine:
    """What create_app and Server use of qmtp.serve.engine.Engine: each submitted request gets the next
    scripted reply, (chunks, finish reason), one engine event per chunk (the last one finishing it)."""

    def __init__(self, checkpoint_dir: str, tokenizer):
        self.model = types.SimpleNamespace(checkpoint_dir=checkpoint_dir, tokenizer=tokenizer)
        self.config = types.SimpleNamespace(max_queue=8)
        self.max_model_len, self.default_stop_ids = 4096, (0,)
        self.failed = self.warming = None
        self.running = True
        self.replies: list[tuple[list[str], str]] = []
        self.prompts: list[str] = []  # each request's prompt, decoded

    def start(self, **_):
        return self

    def stop(self, *_) -> bool:
        return True

    def shutdown(self, *_) -> None:
        self.running = False

    @contextlib.contextmanager
    def together(self):
        yield

    def submit(self, ids, max_tokens, stop_ids, stop_strings, listener=None, logprobs=None, **sampling):
        chunks, reason = self.replies.pop(0)
        self.prompts.append(self.model.tokenizer.decode(ids, skip_special_tokens=False))
        handle = RequestHandle(self, len(self.prompts), ids, max_tokens, stop_ids, stop_strings, listener, sampling)
        for k, chunk in enumerate(chunks):
            handle._emit(Event([k + 1], chunk, reason if k == len(chunks) - 1 else None))
        return handle

    def _cancel(self, handle) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny checkpoints' tokenizer with Qwen's think and tool tags as (non-special) tokens."""
    tok = tiny_tokenizer.build_tokenizer()
    tok.add_tokens([AddedToken(t, special=False) for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")])
    return tok


@contextlib.contextmanager
def scripted_server(tmp_path, tokenizer, template=TEMPLATE, **settings):
    (tmp_path / "chat_template.jinja").write_text(template)
    engine = ScriptedEngine(str(tmp_path), tokenizer)
    server = Server(create_app(engine, ServerSettings(NAME, **settings)), engine, port=0).start_in_thread()
    try:
        yield engine, f"http://127.0.0.1:{server.port}"
    finally:
        assert server.stop(30)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _chunked(text: str, *cuts: str) -> list[str]:
    """`text` cut just after each of `cuts` (awkward places: inside tags)."""
    chunks, rest = [], text
    for cut in cuts:
        at = rest.index(cut) + len(cut)
        chunks.append(rest[:at])
        rest = rest[at:]
    return chunks + [rest]


def _joined(stream, index: int = 0) -> tuple[dict, list, list]:
    """Choice `index` of streamed chat chunks: its joined reasoning_content and content, its tool calls
    (name, arguments) by their index, and the finish reasons of its chunks."""
    out, calls, reasons = {"reasoning_content": "", "content": ""}, {}, []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.index != index:
                continue
            reasons.append(choice.finish_reason)
            delta = choice.delta
            out["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
            out["content"] += delta.content or ""
            for call in delta.tool_calls or ():
                assert call.index not in calls and call.type == "function" and call.id.startswith("call_")
                calls[call.index] = (call.function.name, json.loads(call.function.arguments))
    return out, [calls[i] for i in sorted(calls)], reasons


def test_reasoning_and_a_tool_call_whole_and_streamed(tmp_path, tokenizer):
    reply = "The user asks about Paris.\n</think>\n\nLet me check.\n\n" + CALL
    with scripted_server(tmp_path, tokenizer) as (engine, url):  # auto: qwen3 and qwen3_coder
        c = client(url)
        engine.replies = [([reply], "stop"), (_chunked(reply, "</thi", "<tool_", "<parameter=ci"), "stop")]
        r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                      tools=[WEATHER])
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.model_extra["reasoning_content"] == "The user asks about Paris.\n"
        assert choice.message.content == "\n\nLet me check."
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == ARGUMENTS  # typed by the schema: days is 3, not "3"
        prompt = engine.prompts[0]
        assert json.dumps(WEATHER) in prompt and prompt.endswith("<|im_start|>assistant\n<think>\n")
        stream = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                           tools=[WEATHER], stream=True)
        fields, calls, reasons = _joined(stream)
        assert fields == {"reasoning_content": choice.message.model_extra["reasoning_content"],
                          "content": choice.message.content}
        assert calls == [("get_weather", ARGUMENTS)] and reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
        # n = 2: each choice has its own parser (the second starts in the reasoning again)
        engine.replies = [(_chunked(reply, "<tool_"), "stop"), (["Easy.\n</th", "ink>\n\nIt is 4."], "stop")]
        chunks = list(c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Paris?"}],
                                                tools=[WEATHER], stream=True, n=2))
        assert _joined(chunks, 0) == (fields, calls, reasons[:1] * 2 + ["tool_calls"])
        assert _joined(chunks, 1) == ({"reasoning_content": "Easy.\n", "content": "\n\nIt is 4."}, [], [None, None,
                                                                                                         "stop"])


def test_a_named_function_opens_the_reply_with_its_call(tmp_path, tokenizer):
    """tool_choice naming a function: the engine gets the prompt with the think block closed and the call
    opened through the name; the model's rest of the call comes back as the call, whole or streamed."""
    rest = CALL[len("<tool_call>\n<function=get_weather>\n"):]
    with scripted_server(tmp_path, tokenizer) as (engine, url):  # auto: qwen3 and qwen3_coder
        engine.replies = [([rest], "stop"), (_chunked(rest, "<parameter=ci", "</tool"), "stop")]
        body = dict(model=NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, TIME],
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
        r = client(url).chat.completions.create(**body)
        assert engine.prompts[0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n"
                                          "<function=get_weather>\n")
        message = r.choices[0].message
        assert message.content is None and message.model_extra["reasoning_content"] is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("get_weather", ARGUMENTS)] and r.choices[0].finish_reason == "tool_calls"
        fields, calls, reasons = _joined(client(url).chat.completions.create(**body, stream=True))
        assert fields == {"reasoning_content": "", "content": ""} and calls == [("get_weather", ARGUMENTS)]
        assert reasons[-1] == "tool_calls"


def test_a_hermes_template_and_two_calls(tmp_path, tokenizer):
    reply = "Two cities.\n</think>\n\n" + HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Oslo")
    with scripted_server(tmp_path, tokenizer, HERMES_TEMPLATE) as (engine, url):  # auto: hermes
        engine.replies = [([reply], "stop"), (_chunked(reply, '"Par', "</tool_call>\n<tool"), "stop")]
        body = {"model": NAME, "messages": [{"role": "user", "content": "Paris and Oslo?"}], "tools": [WEATHER]}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30).json()
        message = r["choices"][0]["message"]
        assert message["content"] is None and message["reasoning_content"] == "Two cities.\n"
        want = [("get_weather", ARGUMENTS), ("get_weather", {"city": "Oslo", "days": 3})]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == want
        assert r["choices"][0]["finish_reason"] == "tool_calls"
        _, calls, reasons = _joined(client(url).chat.completions.create(**body, stream=True))
        assert calls == want and reasons[-1] == "tool_calls"


def test_thinking_off_tool_results_and_options_that_turn_the_parsing_off(tmp_path, tokenizer):
    with scripted_server(tmp_path, tokenizer) as (engine, url):
        c = client(url)
        engine.replies = [(["It is sunny", " in Paris."], "stop")] * 2 + [(["a</think>", CALL], "length")] * 2
        r = c.chat.completions.create(model=NAME, messages=_history(json.dumps(ARGUMENTS)), tools=[WEATHER],
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert r.choices[0].message.content == "It is sunny in Paris." and r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.model_extra["reasoning_content"] is None and not r.choices[0].message.tool_calls
        prompt = engine.prompts[-1]
        assert "<parameter=days>\n3\n</parameter>" in prompt and "<tool_response>\nsunny\n</tool_response>" in prompt
        assert prompt.endswith("<think>\n\n</think>\n\n")
        # tool_choice none: the tools are shown, the text is not parsed for calls
        r = c.chat.completions.create(model=NAME, messages=_history(json.dumps(ARGUMENTS)), tools=[WEATHER],
                                      tool_choice="none",
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert json.dumps(WEATHER) in engine.prompts[-1] and r.choices[0].message.content == "It is sunny in Paris."
        # the reply was cut by max_tokens: the call is parsed, the finish reason stays "length"
        r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], tools=[WEATHER])
        assert r.choices[0].finish_reason == "length" and len(r.choices[0].message.tool_calls) == 1
        # /v1/completions returns the text as generated
        r = c.completions.create(model=NAME, prompt="x")
        assert r.choices[0].text == "a</think>" + CALL
        bad = httpx.post(url + "/v1/chat/completions",
                         json={"model": NAME, "messages": _history("{"), "tools": [WEATHER]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
        bad = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": _history("{}"),
                                                             "tools": [{"type": "function", "function": {}}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].function.name"
        assert not engine.replies


def test_parsers_set_to_none_return_the_text_and_refuse_tools(tmp_path, tokenizer):
    with scripted_server(tmp_path, tokenizer, reasoning_parser="none", tool_call_parser="none") as (engine, url):
        c = client(url)
        engine.replies = [(["a</think>\n\n", CALL], "stop")]
        r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}])
        assert r.choices[0].message.content == "a</think>\n\n" + CALL and r.choices[0].finish_reason == "stop"
        assert "reasoning_content" not in r.choices[0].message.model_extra
        with pytest.raises(openai.BadRequestError, match="tool call parser") as e:
            c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], tools=[WEATHER])
        assert e.value.param == "tools"
